//! The `rbd` backend: disks that are RBD images on a Ceph cluster, served
//! through librbd's asynchronous API.
//!
//! - One rados connection per process and client settings ([`Cluster`]),
//!   shared by every RBD export that uses the same settings.
//! - One open image per export ([`RbdImage`], owned by the export's `Disk`).
//! - One [`RbdEngine`] per IOThread and image: requests are submitted from the
//!   IOThread straight from guest memory (the iovecs point into it: zero copy);
//!   librbd calls back from its own thread, the callback queues the result and
//!   signals the engine's eventfd, which the IOThread watches in its epoll like
//!   an io_uring's: polling and naps treat RBD completions the same way.
//!
//! librados and librbd are loaded at run time (module [`ffi`]).

pub mod ffi;

use std::ffi::c_void;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{Completion, Engine, IoKind, IoOp};
use ffi::{api, cstring, errno_text, Api, LoadError};

/// Default `rados_osd_op_timeout` (and monitor/connect timeouts), seconds:
/// a request to an unreachable cluster fails with an I/O error after this long
/// instead of waiting for ever.
pub const DEFAULT_OP_TIMEOUT_S: u64 = 30;

/// Where an image is: `POOL/IMAGE`, `POOL/NAMESPACE/IMAGE`, each optionally
/// followed by `@SNAPSHOT` (a snapshot is exported read-only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdSpec {
    /// The pool.
    pub pool: String,
    /// The RADOS namespace in the pool (None: the default one).
    pub namespace: Option<String>,
    /// The image.
    pub image: String,
    /// A snapshot of the image (read-only).
    pub snap: Option<String>,
}

/// The prefix that marks an image argument as an RBD image.
pub const PREFIX: &str = "rbd:";

impl RbdSpec {
    /// Parses `rbd:POOL/[NAMESPACE/]IMAGE[@SNAP]` (the `rbd:` prefix optional).
    pub fn parse(s: &str) -> Result<RbdSpec, String> {
        let bad = |why: &str| {
            format!("{s:?} is not an RBD image ({why}; expected rbd:POOL/IMAGE, rbd:POOL/NAMESPACE/IMAGE, optionally @SNAPSHOT)")
        };
        let rest = s.strip_prefix(PREFIX).unwrap_or(s);
        let (path, snap) = match rest.split_once('@') {
            Some((p, snap)) if !snap.is_empty() && !snap.contains('/') => {
                (p, Some(snap.to_string()))
            }
            Some(_) => return Err(bad("empty or malformed snapshot name")),
            None => (rest, None),
        };
        let parts: Vec<&str> = path.split('/').collect();
        if parts.iter().any(|p| p.is_empty()) {
            return Err(bad("empty pool, namespace or image name"));
        }
        let (pool, namespace, image) = match parts[..] {
            [pool, image] => (pool, None, image),
            [pool, ns, image] => (pool, Some(ns.to_string()), image),
            _ => return Err(bad("wrong number of '/'")),
        };
        Ok(RbdSpec {
            pool: pool.to_string(),
            namespace,
            image: image.to_string(),
            snap,
        })
    }
}

impl std::fmt::Display for RbdSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{PREFIX}{}/", self.pool)?;
        if let Some(ns) = &self.namespace {
            write!(f, "{ns}/")?;
        }
        write!(f, "{}", self.image)?;
        if let Some(s) = &self.snap {
            write!(f, "@{s}")?;
        }
        Ok(())
    }
}

/// How to reach the cluster: what distinguishes one rados connection from another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    /// ceph.conf to read (None: librados's default search, `$CEPH_CONF` first).
    pub conf: Option<PathBuf>,
    /// cephx user without the `client.` prefix (None: `admin`).
    pub id: Option<String>,
    /// `rados_osd_op_timeout`, `rados_mon_op_timeout` and `client_mount_timeout`, seconds.
    pub op_timeout_s: u64,
    /// librbd's own cache (`rbd_cache`): on for cache=writeback, off for cache=none.
    pub rbd_cache: bool,
}

/// Errors opening an RBD image.
#[derive(Debug, thiserror::Error)]
pub enum RbdError {
    /// librados/librbd could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// A setting could not be passed to librados.
    #[error("{0}")]
    Setting(String),
    /// A librados or librbd call failed.
    #[error("{what}: {message}")]
    Call {
        /// What was being done (names the pool, image, conf...).
        what: String,
        /// The errno's text.
        message: String,
    },
}

fn check(r: i32, what: impl FnOnce() -> String) -> Result<(), RbdError> {
    if r < 0 {
        return Err(RbdError::Call {
            what: what(),
            message: errno_text(r),
        });
    }
    Ok(())
}

/// One rados connection, shared by every image opened with the same
/// [`ClientConfig`]; shut down when the last of them is closed.
pub struct Cluster {
    api: &'static Api,
    rados: NonNull<c_void>,
    config: ClientConfig,
}

// SAFETY: a rados_t may be used from any thread (librados is thread safe);
// after `connect` it is only read (ioctx creation) and finally shut down in
// Drop, which runs once, when no image uses it any more.
unsafe impl Send for Cluster {}
// SAFETY: as above: concurrent ioctx creation on one rados_t is allowed.
unsafe impl Sync for Cluster {}

impl Cluster {
    /// The process's connection for `config`, made if there is none yet.
    /// Blocks for at most about the configured timeout if the cluster is unreachable.
    pub fn get(config: &ClientConfig) -> Result<Arc<Cluster>, RbdError> {
        static CLUSTERS: Mutex<Vec<Weak<Cluster>>> = Mutex::new(Vec::new());
        let mut all = CLUSTERS.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|w| w.strong_count() > 0);
        if let Some(c) = all
            .iter()
            .filter_map(Weak::upgrade)
            .find(|c| c.config == *config)
        {
            return Ok(c);
        }
        let c = Arc::new(Cluster::connect(config)?);
        all.push(Arc::downgrade(&c));
        Ok(c)
    }

    fn connect(config: &ClientConfig) -> Result<Cluster, RbdError> {
        let api = api()?;
        let id = config.id.as_deref().unwrap_or("admin");
        let name = cstring("--ceph-id", &format!("client.{id}")).map_err(RbdError::Setting)?;
        let mut rados: ffi::Rados = std::ptr::null_mut();
        // SAFETY: `rados` is a valid out-pointer; the strings are NUL-terminated
        // and live across the call.
        let r = unsafe { (api.rados_create2)(&mut rados, c"ceph".as_ptr(), name.as_ptr(), 0) };
        check(r, || {
            format!("cannot create a rados client for client.{id}")
        })?;
        let rados = NonNull::new(rados).ok_or_else(|| RbdError::Call {
            what: "rados_create2".into(),
            message: "returned no handle".into(),
        })?;
        // From here on, Drop shuts the handle down on every error path.
        let cluster = Cluster {
            api,
            rados,
            config: config.clone(),
        };
        let conf = config
            .conf
            .as_deref()
            .map(|p| cstring("--ceph-conf", &p.to_string_lossy()))
            .transpose()
            .map_err(RbdError::Setting)?;
        // SAFETY: `rados` is a live, not yet connected handle; `conf` is NULL
        // (default search) or a NUL-terminated path living across the call.
        let r = unsafe {
            (api.rados_conf_read_file)(
                rados.as_ptr(),
                conf.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            )
        };
        check(r, || match &config.conf {
            Some(p) => format!("cannot read the Ceph configuration {}", p.display()),
            None => "cannot find a Ceph configuration (set --ceph-conf or CEPH_CONF)".into(),
        })?;
        let t = config.op_timeout_s.to_string();
        let cache = if config.rbd_cache { "true" } else { "false" };
        for (k, v) in [
            ("rados_osd_op_timeout", t.as_str()),
            ("rados_mon_op_timeout", &t),
            ("client_mount_timeout", &t),
            ("rbd_cache", cache),
            // librados would print its own errors on stderr, next to ours
            // (which name the export): it keeps them in its log file only.
            ("log_to_stderr", "false"),
            ("err_to_stderr", "false"),
        ] {
            let (k, v) = (cstring("key", k).unwrap(), cstring(k, v).unwrap());
            // SAFETY: live handle; both strings NUL-terminated and alive.
            let r = unsafe { (api.rados_conf_set)(rados.as_ptr(), k.as_ptr(), v.as_ptr()) };
            check(r, || format!("cannot set {k:?} = {v:?}"))?;
        }
        // SAFETY: live, configured handle. Blocks until connected or
        // `client_mount_timeout` has passed.
        let r = unsafe { (api.rados_connect)(rados.as_ptr()) };
        check(r, || {
            format!("cannot connect to the Ceph cluster as client.{id} (within {t} s)")
        })?;
        Ok(cluster)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: the handle was created by rados_create2 and is shut down
        // once; every ioctx and image made from it holds an Arc of this
        // Cluster, so none is left.
        unsafe { (self.api.rados_shutdown)(self.rados.as_ptr()) }
    }
}

/// An open image, owned by its export's `Disk`. Closing it (Drop) waits for
/// librbd's own in-flight work.
pub struct RbdImage {
    api: &'static Api,
    image: ImageRef,
    ioctx: NonNull<c_void>,
    /// The spec it was opened with (logs).
    pub spec: RbdSpec,
    /// Size in bytes at open time.
    pub size: u64,
    /// Opened read-only (asked for, or a snapshot).
    pub read_only: bool,
    /// Keeps the connection up while the image is open.
    _cluster: Arc<Cluster>,
}

// SAFETY: librbd image handles may be used from several threads at once for
// asynchronous I/O (QEMU does so from its IOThreads); the ioctx is only
// destroyed in Drop, after the image is closed.
unsafe impl Send for RbdImage {}
// SAFETY: as above.
unsafe impl Sync for RbdImage {}

impl std::fmt::Debug for RbdImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdImage")
            .field("spec", &self.spec.to_string())
            .field("size", &self.size)
            .field("read_only", &self.read_only)
            .finish()
    }
}

impl RbdImage {
    /// Opens `spec` over the process's connection for `client` (a snapshot is
    /// always opened read-only).
    pub fn open(spec: &RbdSpec, client: &ClientConfig, read_only: bool) -> Result<Self, RbdError> {
        let cluster = Cluster::get(client)?;
        let api = cluster.api;
        let read_only = read_only || spec.snap.is_some();
        let s = |w: &str, v: &str| cstring(w, v).map_err(RbdError::Setting);
        let pool = s("pool", &spec.pool)?;
        let name = s("image", &spec.image)?;
        let ns = spec
            .namespace
            .as_deref()
            .map(|n| s("namespace", n))
            .transpose()?;
        let snap = spec.snap.as_deref().map(|n| s("snapshot", n)).transpose()?;
        let mut ioctx: ffi::IoCtx = std::ptr::null_mut();
        // SAFETY: connected handle (the Arc keeps it up), NUL-terminated pool
        // name, valid out-pointer.
        let r =
            unsafe { (api.rados_ioctx_create)(cluster.rados.as_ptr(), pool.as_ptr(), &mut ioctx) };
        if r == -libc::ENOENT {
            return Err(RbdError::Call {
                what: format!("pool {:?}", spec.pool),
                message: "does not exist (`ceph osd pool ls` lists the pools)".into(),
            });
        }
        check(r, || format!("pool {:?}", spec.pool))?;
        let ioctx = NonNull::new(ioctx).expect("rados_ioctx_create succeeded");
        let destroy = |ioctx: NonNull<c_void>| {
            // SAFETY: the ioctx was created above and no image uses it.
            unsafe { (api.rados_ioctx_destroy)(ioctx.as_ptr()) }
        };
        if let Some(ns) = &ns {
            // SAFETY: live ioctx, NUL-terminated namespace.
            unsafe { (api.rados_ioctx_set_namespace)(ioctx.as_ptr(), ns.as_ptr()) };
        }
        let open = if read_only {
            api.rbd_open_read_only
        } else {
            api.rbd_open
        };
        let mut image: ffi::Image = std::ptr::null_mut();
        // SAFETY: live ioctx, NUL-terminated names (snap NULL: the image's
        // head), valid out-pointer.
        let r = unsafe {
            open(
                ioctx.as_ptr(),
                name.as_ptr(),
                &mut image,
                snap.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            )
        };
        if r < 0 {
            destroy(ioctx);
            let message = if r == -libc::ENOENT {
                let what = if spec.snap.is_some() {
                    "image or snapshot"
                } else {
                    "image"
                };
                format!("{what} does not exist (`rbd ls` and `rbd snap ls` list them)")
            } else {
                errno_text(r)
            };
            return Err(RbdError::Call {
                what: format!("image {spec}"),
                message,
            });
        }
        let image = ImageRef(NonNull::new(image).expect("rbd_open succeeded"));
        let mut size = 0u64;
        // SAFETY: open image, valid out-pointer.
        let r = unsafe { (api.rbd_get_size)(image.0.as_ptr(), &mut size) };
        let img = RbdImage {
            api,
            image,
            ioctx,
            spec: spec.clone(),
            size,
            read_only,
            _cluster: cluster,
        };
        check(r, || format!("size of image {spec}"))?;
        Ok(img)
    }

    /// The handle engines submit to.
    pub fn handle(&self) -> ImageRef {
        self.image
    }

    /// Waits until every completed write is durable (librbd's cache flushed).
    pub fn flush(&self) -> std::io::Result<()> {
        // SAFETY: the image is open (closed only in Drop).
        let r = unsafe { (self.api.rbd_flush)(self.image.0.as_ptr()) };
        if r < 0 {
            return Err(std::io::Error::from_raw_os_error(-r));
        }
        Ok(())
    }
}

impl Drop for RbdImage {
    fn drop(&mut self) {
        // SAFETY: opened in `open`, closed once; no request is in flight on it
        // (the IOThreads are joined, or every queue of the export detached and
        // drained, before its Disk is dropped). Then its ioctx goes.
        unsafe {
            (self.api.rbd_close)(self.image.0.as_ptr());
            (self.api.rados_ioctx_destroy)(self.ioctx.as_ptr());
        }
    }
}

/// An open image's handle as the engines see it: a copyable key. Valid while
/// the [`RbdImage`] it came from is alive (its `Disk` outlives every request
/// submitted to it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageRef(NonNull<c_void>);

// SAFETY: a librbd image handle may be used for aio from any thread.
unsafe impl Send for ImageRef {}
// SAFETY: as above.
unsafe impl Sync for ImageRef {}

/// Results queued by librbd's callback thread for one engine.
struct Done {
    list: Mutex<Vec<Completion>>,
    /// Length of `list`, changed under its lock: the IOThread's busy-poll reads
    /// it without taking the lock.
    ready: AtomicUsize,
    efd: EventFd,
}

/// What a librbd callback needs: where to queue the result, for which token.
struct OpCtx {
    api: &'static Api,
    done: Arc<Done>,
    token: u64,
    /// What success reports: librbd's aio writes (and flush, discard,
    /// write-zeroes) complete with 0, not with the bytes written, as the
    /// engines' contract asks; reads give the bytes read.
    written: Option<i32>,
}

/// librbd's completion callback (runs on a librbd thread): queues the
/// result, releases the completion and signals the IOThread.
unsafe extern "C" fn on_complete(c: ffi::AioCompletion, arg: *mut c_void) {
    // SAFETY: `arg` is the Box leaked in `RbdEngine::submit` for this
    // completion, which librbd calls back exactly once.
    let ctx = unsafe { Box::from_raw(arg.cast::<OpCtx>()) };
    // SAFETY: `c` is the live completion this callback is for; it is released
    // here, once, and not used afterwards.
    let r = unsafe {
        let r = (ctx.api.rbd_aio_get_return_value)(c);
        (ctx.api.rbd_aio_release)(c);
        r
    };
    let result = match (r, ctx.written) {
        (0, Some(len)) => len,
        _ => r.clamp(i32::MIN as isize, i32::MAX as isize) as i32,
    };
    let first = {
        let mut list = ctx.done.list.lock().unwrap_or_else(|e| e.into_inner());
        list.push(Completion {
            token: ctx.token,
            result,
        });
        ctx.done.ready.store(list.len(), Ordering::Release);
        list.len() == 1
    };
    // Only the first result since the IOThread last reaped signals it: the
    // ones queued after it are reaped with it (`reap` takes the whole list
    // under the lock), so a burst of librbd callbacks costs one eventfd write
    // and one wake-up, not one each.
    if first {
        let _ = ctx.done.efd.write(1);
    }
}

/// The RBD engine of one IOThread for one image.
pub struct RbdEngine {
    api: &'static Api,
    image: ImageRef,
    done: Arc<Done>,
}

impl RbdEngine {
    /// An engine submitting to `image`.
    pub fn new(image: ImageRef) -> std::io::Result<RbdEngine> {
        let api = api().map_err(std::io::Error::other)?;
        Ok(RbdEngine {
            api,
            image,
            done: Arc::new(Done {
                list: Mutex::new(Vec::new()),
                ready: AtomicUsize::new(0),
                efd: EventFd::new(EFD_NONBLOCK)?,
            }),
        })
    }
}

impl RbdEngine {
    /// Queues `op`; the completion carries `token`.
    ///
    /// # Safety
    /// As [`Engines::submit`](super::Engines::submit).
    pub unsafe fn submit(&mut self, op: &IoOp, token: u64) -> std::io::Result<()> {
        let api = self.api;
        let arg = Box::into_raw(Box::new(OpCtx {
            api,
            done: self.done.clone(),
            token,
            written: (op.kind == IoKind::Write).then(|| op.len.min(i32::MAX as u64) as i32),
        }));
        let mut c: ffi::AioCompletion = std::ptr::null_mut();
        // SAFETY: `arg` stays valid until the callback takes it back; the
        // callback has the `rbd_callback_t` prototype; `c` is a valid out-pointer.
        let r = unsafe { (api.rbd_aio_create_completion)(arg.cast(), on_complete, &mut c) };
        if r < 0 {
            // SAFETY: no completion refers to `arg`: take it back.
            drop(unsafe { Box::from_raw(arg) });
            return Err(std::io::Error::from_raw_os_error(-r));
        }
        let img = self.image.0.as_ptr();
        // SAFETY: the image is open (see `ImageRef`); the caller guarantees
        // the iovecs and the buffers they describe stay valid until this
        // token's completion is reaped, which is after librbd's callback.
        let r = unsafe {
            match op.kind {
                IoKind::Read => (api.rbd_aio_readv)(img, op.iov, op.iovcnt as i32, op.offset, c),
                IoKind::Write => (api.rbd_aio_writev)(img, op.iov, op.iovcnt as i32, op.offset, c),
                IoKind::Flush => (api.rbd_aio_flush)(img, c),
                IoKind::Discard => (api.rbd_aio_discard)(img, op.offset, op.len, c),
                IoKind::WriteZeroes => {
                    (api.rbd_aio_write_zeroes)(img, op.offset, op.len as usize, c, 0, 0)
                }
            }
        };
        if r < 0 {
            // librbd refused the arguments before taking the completion (it
            // returns an error only then; failures later come through the
            // callback): nothing will call back, release both here.
            // SAFETY: `c` and `arg` are not referenced by librbd.
            unsafe {
                (api.rbd_aio_release)(c);
                drop(Box::from_raw(arg));
            }
            return Err(std::io::Error::from_raw_os_error(-r));
        }
        Ok(())
    }
}

impl Engine for RbdEngine {
    fn commit(&mut self) -> std::io::Result<()> {
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        if self.done.ready.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut list = self.done.list.lock().unwrap_or_else(|e| e.into_inner());
        out.append(&mut list);
        self.done.ready.store(0, Ordering::Release);
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.done.efd.as_raw_fd())
    }

    fn has_completions(&mut self) -> bool {
        // No lock: this is called on every busy-poll spin.
        self.done.ready.load(Ordering::Acquire) > 0
    }
}

/// Whether an `--image` value names an RBD image (`rbd:...`).
pub fn is_rbd_image(p: &Path) -> bool {
    p.to_str().is_some_and(|s| s.starts_with(PREFIX))
}

#[cfg(test)]
mod tests;
