//! A counting global allocator for the unit tests: counts the allocations
//! made by the current thread while it is armed, so a test can show that a
//! code path allocates nothing (a request allocates nothing in steady state,
//! so its cost does not depend on the allocator's). Every other allocation
//! goes straight to the system.

use std::alloc::{GlobalAlloc, Layout, System};
use std::backtrace::Backtrace;
use std::cell::{Cell, RefCell};

struct Counting;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<u64> = const { Cell::new(0) };
    /// Where the first allocation counted was made, for the failure message.
    static FIRST: RefCell<Option<String>> = const { RefCell::new(None) };
}

fn count() {
    // `try_with`: a thread being torn down has no locals; it is not counted.
    let _ = ARMED.try_with(|armed| {
        if armed.get() {
            let _ = COUNT.try_with(|c| c.set(c.get() + 1));
            let _ = FIRST.try_with(|f| {
                if let Ok(mut f) = f.try_borrow_mut() {
                    if f.is_none() {
                        // Disarmed: capturing the backtrace allocates.
                        armed.set(false);
                        *f = Some(Backtrace::force_capture().to_string());
                        armed.set(true);
                    }
                }
            });
        }
    });
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged; counting touches only const-initialized thread-locals, and the
// one backtrace it captures (whose allocations go to `System` through this
// allocator, disarmed, before the caller's own) is taken outside `System`.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded as received (the caller's contract holds).
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` and returns what it returned with the number of allocations
/// (and reallocations) this thread made meanwhile.
pub(super) fn allocations_in<T>(f: impl FnOnce() -> T) -> (T, u64) {
    COUNT.with(|c| c.set(0));
    FIRST.with(|f| f.borrow_mut().take());
    ARMED.with(|a| a.set(true));
    let r = f();
    ARMED.with(|a| a.set(false));
    (r, COUNT.with(Cell::get))
}

/// The backtrace of the first allocation the last [`allocations_in`] counted.
pub(super) fn first_allocation() -> Option<String> {
    FIRST.with(|f| f.borrow().clone())
}
