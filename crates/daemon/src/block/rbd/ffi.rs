//! The C API of librados and librbd that the RBD backend uses, loaded at run
//! time (`dlopen`), so that vqblk builds and runs on machines without Ceph
//! libraries: only a user who asks for an RBD export needs them.
//!
//! The surface is hand-written from the documented prototypes of
//! `rados/librados.h` and `rbd/librbd.h` (Ceph 16 "Pacific"); every function
//! is looked up once, when the libraries are first needed, and kept as a plain
//! function pointer next to the [`libloading::Library`] that owns the mapping.

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use libloading::Library;

/// Environment variable overriding the path of `librbd.so.1` (for tests and
/// packaging: a nonexistent path simulates a host without librbd).
pub const LIBRBD_ENV: &str = "VQBLK_LIBRBD_PATH";
/// Environment variable overriding the path of `librados.so.2`.
pub const LIBRADOS_ENV: &str = "VQBLK_LIBRADOS_PATH";

/// `rados_t`: a cluster handle.
pub type Rados = *mut c_void;
/// `rados_ioctx_t`: an I/O context on one pool.
pub type IoCtx = *mut c_void;
/// `rbd_image_t`: an open image.
pub type Image = *mut c_void;
/// `rbd_completion_t`: one asynchronous operation.
pub type AioCompletion = *mut c_void;
/// `rbd_callback_t`: called by librbd (from its own thread) when an operation ends.
pub type Callback = unsafe extern "C" fn(c: AioCompletion, arg: *mut c_void);

/// The functions of librados and librbd the backend calls. Each field has the
/// C prototype of the function it is named after.
#[allow(missing_docs)] // each field is the C function of the same name
pub struct Api {
    pub rados_create2: unsafe extern "C" fn(*mut Rados, *const c_char, *const c_char, u64) -> c_int,
    pub rados_conf_read_file: unsafe extern "C" fn(Rados, *const c_char) -> c_int,
    pub rados_conf_set: unsafe extern "C" fn(Rados, *const c_char, *const c_char) -> c_int,
    pub rados_connect: unsafe extern "C" fn(Rados) -> c_int,
    pub rados_shutdown: unsafe extern "C" fn(Rados),
    pub rados_ioctx_create: unsafe extern "C" fn(Rados, *const c_char, *mut IoCtx) -> c_int,
    pub rados_ioctx_destroy: unsafe extern "C" fn(IoCtx),
    pub rados_ioctx_set_namespace: unsafe extern "C" fn(IoCtx, *const c_char),
    pub rbd_open: unsafe extern "C" fn(IoCtx, *const c_char, *mut Image, *const c_char) -> c_int,
    pub rbd_open_read_only:
        unsafe extern "C" fn(IoCtx, *const c_char, *mut Image, *const c_char) -> c_int,
    pub rbd_close: unsafe extern "C" fn(Image) -> c_int,
    pub rbd_get_size: unsafe extern "C" fn(Image, *mut u64) -> c_int,
    pub rbd_flush: unsafe extern "C" fn(Image) -> c_int,
    pub rbd_aio_create_completion:
        unsafe extern "C" fn(*mut c_void, Callback, *mut AioCompletion) -> c_int,
    pub rbd_aio_readv:
        unsafe extern "C" fn(Image, *const libc::iovec, c_int, u64, AioCompletion) -> c_int,
    pub rbd_aio_writev:
        unsafe extern "C" fn(Image, *const libc::iovec, c_int, u64, AioCompletion) -> c_int,
    pub rbd_aio_flush: unsafe extern "C" fn(Image, AioCompletion) -> c_int,
    pub rbd_aio_discard: unsafe extern "C" fn(Image, u64, u64, AioCompletion) -> c_int,
    pub rbd_aio_write_zeroes:
        unsafe extern "C" fn(Image, u64, usize, AioCompletion, c_int, c_int) -> c_int,
    pub rbd_aio_get_return_value: unsafe extern "C" fn(AioCompletion) -> isize,
    pub rbd_aio_release: unsafe extern "C" fn(AioCompletion),
    /// Keeps the libraries mapped for as long as the pointers above are used
    /// (forever: the value lives in a `static`).
    _libs: [Library; 2],
}

/// Why the Ceph libraries could not be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LoadError {
    /// A library is not installed (or the override path is wrong).
    #[error(
        "cannot load {lib} ({reason}); the rbd backend needs Ceph's client libraries: \
         install the Debian package librbd1 (it brings librados2)"
    )]
    Missing {
        /// The library file asked for.
        lib: String,
        /// The loader's message.
        reason: String,
    },
    /// A library lacks a function (too old a Ceph).
    #[error("{lib} has no {symbol} (Ceph 15 \"Octopus\" or newer is needed): {reason}")]
    Symbol {
        /// The library file.
        lib: String,
        /// The missing function.
        symbol: &'static str,
        /// The loader's message.
        reason: String,
    },
}

fn open(env: &str, default: &str) -> Result<(Library, String), LoadError> {
    let path = std::env::var(env).unwrap_or_else(|_| default.to_string());
    // SAFETY: loading a shared library runs its initialisers; librados and
    // librbd are the system's Ceph client libraries (or what the operator
    // points the override variable at), whose initialisers only set up their
    // own global state.
    match unsafe { Library::new(&path) } {
        Ok(l) => Ok((l, path)),
        Err(e) => Err(LoadError::Missing {
            lib: path,
            reason: e.to_string(),
        }),
    }
}

/// Looks `name` up in `lib` as a value of type `T`.
///
/// # Safety
/// `T` must be the function-pointer type of the C prototype of `name`.
unsafe fn sym<T: Copy>(lib: &Library, path: &str, name: &'static str) -> Result<T, LoadError> {
    let mut z = Vec::with_capacity(name.len() + 1);
    z.extend_from_slice(name.as_bytes());
    z.push(0);
    // SAFETY: the caller guarantees `T` matches the symbol's C type.
    match unsafe { lib.get::<T>(&z) } {
        Ok(s) => Ok(*s),
        Err(e) => Err(LoadError::Symbol {
            lib: path.to_string(),
            symbol: name,
            reason: e.to_string(),
        }),
    }
}

fn load() -> Result<Api, LoadError> {
    // librados first: librbd depends on it, and a missing librados is then
    // named as such.
    let (rados, rp) = open(LIBRADOS_ENV, "librados.so.2")?;
    let (rbd, bp) = open(LIBRBD_ENV, "librbd.so.1")?;
    macro_rules! r {
        ($n:ident) => {
            // SAFETY: the field's type is the C prototype of the function of
            // the same name in librados.h.
            unsafe { sym(&rados, &rp, stringify!($n))? }
        };
    }
    macro_rules! b {
        ($n:ident) => {
            // SAFETY: the field's type is the C prototype of the function of
            // the same name in librbd.h.
            unsafe { sym(&rbd, &bp, stringify!($n))? }
        };
    }
    Ok(Api {
        rados_create2: r!(rados_create2),
        rados_conf_read_file: r!(rados_conf_read_file),
        rados_conf_set: r!(rados_conf_set),
        rados_connect: r!(rados_connect),
        rados_shutdown: r!(rados_shutdown),
        rados_ioctx_create: r!(rados_ioctx_create),
        rados_ioctx_destroy: r!(rados_ioctx_destroy),
        rados_ioctx_set_namespace: r!(rados_ioctx_set_namespace),
        rbd_open: b!(rbd_open),
        rbd_open_read_only: b!(rbd_open_read_only),
        rbd_close: b!(rbd_close),
        rbd_get_size: b!(rbd_get_size),
        rbd_flush: b!(rbd_flush),
        rbd_aio_create_completion: b!(rbd_aio_create_completion),
        rbd_aio_readv: b!(rbd_aio_readv),
        rbd_aio_writev: b!(rbd_aio_writev),
        rbd_aio_flush: b!(rbd_aio_flush),
        rbd_aio_discard: b!(rbd_aio_discard),
        rbd_aio_write_zeroes: b!(rbd_aio_write_zeroes),
        rbd_aio_get_return_value: b!(rbd_aio_get_return_value),
        rbd_aio_release: b!(rbd_aio_release),
        _libs: [rados, rbd],
    })
}

/// The Ceph client API, loaded on first use (later calls return the same
/// result, failure included).
pub fn api() -> Result<&'static Api, LoadError> {
    static API: OnceLock<Result<Api, LoadError>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// The message of a negative errno returned by librados or librbd.
pub fn errno_text(r: c_int) -> String {
    std::io::Error::from_raw_os_error(-r).to_string()
}

/// A C string for librados, or an error naming the field if it holds a NUL.
pub fn cstring(what: &str, s: &str) -> Result<std::ffi::CString, String> {
    std::ffi::CString::new(s).map_err(|_| format!("{what} {s:?} contains a NUL byte"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Ceph client libraries of the test machine load and have every
    /// function (they are in scripts/install-deps.sh); a wrong path names the
    /// Debian package.
    #[test]
    fn loads_or_names_the_package() {
        let api = api().expect("librbd1 is installed on test machines");
        assert!(std::ptr::fn_addr_eq(api.rbd_close, api.rbd_close));
        let e = open("VQBLK_TEST_NO_SUCH_VARIABLE", "/nonexistent/librbd.so.1").unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("librbd1") && m.contains("/nonexistent/librbd.so.1"),
            "{m}"
        );
    }
}
