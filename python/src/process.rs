//! The I/O runtime of this process, and how it survives `fork`.
//!
//! **The hazard.** Between calls the tokio runtime's threads live on: two workers parked in the
//! I/O driver or on a condition variable, blocking-pool threads (name lookups) waiting for work,
//! readahead and connection tasks running. tokio is built with `parking_lot`, so its locks and
//! condition variables park through `parking_lot_core`'s process-wide table of wait queues,
//! whose buckets are guarded by word locks. `fork` copies the memory of every thread but starts
//! only the forking one: a bucket that a runtime thread held at that instant stays held in the
//! child, pointing at a queue node on a stack whose thread no longer runs. The child's first
//! call builds a runtime, which parks and unparks threads through that table: it hangs on the
//! held bucket, or follows the stale queue pointer and segfaults in
//! `parking_lot_core::lock_bucket_pair` (what the kernel logged for DataLoader workers). The
//! same holds for any lock a runtime thread held: the allocator's arenas are made safe by
//! glibc's own fork handlers, tokio's and h2's are not. Rebuilding the runtime lazily in the
//! child cannot help: the damage is done at the instant of fork.
//!
//! **The rule.** No thread of ours runs at the instant of fork. Python's `os.fork` (and so
//! `multiprocessing` and PyTorch's DataLoader) runs the hooks registered with
//! `os.register_at_fork`; the `before` hook ([`before_fork`]) closes a gate that every call into
//! Rust passes, waits until no call is inside, and shuts the runtime down, which joins its
//! worker and blocking threads and cancels its tasks. Then the process forks with only Python's
//! threads running, none of them inside Rust. Both sides build a new runtime on their next call.
//!
//! **Generations.** Every runtime has a generation number, and every object holding runtime
//! state (a client, a reader, a writer) remembers the generation it was made in. An object of
//! an older generation is rebuilt from its plain state (a reader from its file and position, a
//! client from its master address) on its next use. Its old parts are dropped if their runtime
//! was shut down here or in an ancestor before the fork ([`dispose`]): nothing of theirs runs,
//! and dropping them only closes this process's copies of their sockets. Without the hooks (a
//! `fork()` from C that bypasses Python) the parent's runtime was live at the fork: the child
//! then forgets its parts (leaks them, never touching their locks or their shared epoll), as
//! before; that case is not made safe, only no worse.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use tokio::runtime::Runtime;

/// Generation of the runtime that is, or will next be, this process's.
static GENERATION: AtomicU64 = AtomicU64::new(1);
/// Every generation below this one had its runtime shut down (its threads joined) in this
/// process or in an ancestor before the fork that made this one.
static SHUT_DOWN_BELOW: AtomicU64 = AtomicU64::new(1);
/// Generations up to this one may have a runtime running in another process: this one was
/// forked without our hooks while it ran. Their state is never dropped here.
static LIVE_ELSEWHERE_UP_TO: AtomicU64 = AtomicU64::new(0);
/// Set by the `before` hook once the runtime is down, cleared after the fork: a child that
/// inherits it set was forked cleanly.
static PREPARED: AtomicBool = AtomicBool::new(false);
/// The gate of this process; replaced (the old one leaked) in a child, whose copy may be locked
/// by a thread that does not exist there.
static GATE: AtomicPtr<Gate> = AtomicPtr::new(std::ptr::null_mut());

thread_local! {
    /// Sections this thread is inside (a nested one must not wait for a fork that waits for it).
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

struct Gate {
    pid: u32,
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Default)]
struct GateState {
    /// A fork is being prepared: new sections wait.
    forking: bool,
    /// Sections running now.
    active: usize,
    runtime: Option<Arc<Runtime>>,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, GateState>) -> MutexGuard<'a, GateState> {
        self.changed.wait(guard).unwrap_or_else(|p| p.into_inner())
    }
}

/// This process's gate, made on first use and again in a forked child.
fn gate() -> &'static Gate {
    let current = GATE.load(Ordering::Acquire);
    // SAFETY: a gate is never freed once published (a replaced one is leaked).
    if let Some(g) = unsafe { current.as_ref() }
        && g.pid == std::process::id()
    {
        return g;
    }
    adopt(current)
}

/// Makes and publishes this process's gate, in place of `inherited` (null in the first process).
#[cold]
fn adopt(inherited: *mut Gate) -> &'static Gate {
    if !inherited.is_null() && !PREPARED.swap(false, Ordering::AcqRel) {
        // Forked without our hooks (a `fork()` from C): the runtime of this generation may be
        // running in the parent. Nothing of it is used, or dropped, here.
        let generation = GENERATION.fetch_add(1, Ordering::AcqRel);
        LIVE_ELSEWHERE_UP_TO.fetch_max(generation, Ordering::AcqRel);
    }
    let fresh = Box::into_raw(Box::new(Gate {
        pid: std::process::id(),
        state: Mutex::new(GateState::default()),
        changed: Condvar::new(),
    }));
    match GATE.compare_exchange(inherited, fresh, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: just published; never freed.
        Ok(_) => unsafe { &*fresh },
        Err(_) => {
            // Another thread of this process published one first.
            // SAFETY: `fresh` was never shared.
            drop(unsafe { Box::from_raw(fresh) });
            gate()
        }
    }
}

/// Runs `f` with this process's runtime (built if there is none) as a section: a fork waits
/// until it ends, and it does not start while a fork is being prepared. Call without the GIL,
/// and take any other lock only inside (a lock held while waiting at the gate would be held
/// forever in the child). `f` gets the runtime and its generation.
pub(crate) fn section<T>(f: impl FnOnce(&Runtime, u64) -> PyResult<T>) -> PyResult<T> {
    let (leave, generation) = enter(true)?;
    f(leave.runtime.as_deref().expect("entered with a runtime"), generation)
}

/// A section for work that needs no runtime (locking state, dropping it): the same gate, and no
/// runtime built.
pub(crate) fn guarded<T>(f: impl FnOnce() -> T) -> T {
    let (_leave, _) = enter(false).expect("nothing to build");
    f()
}

fn enter(with_runtime: bool) -> PyResult<(Leave, u64)> {
    let g = gate();
    let nested = DEPTH.with(|d| d.get()) > 0;
    let mut s = g.lock();
    while s.forking && !nested {
        s = g.wait(s);
    }
    let runtime = match (&s.runtime, with_runtime) {
        (_, false) => None,
        (Some(rt), true) => Some(rt.clone()),
        (None, true) => {
            let rt = Arc::new(
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("strata-py")
                    .enable_all()
                    .build()
                    .map_err(|e| PyOSError::new_err(format!("cannot start the I/O runtime: {e}")))?,
            );
            s.runtime = Some(rt.clone());
            Some(rt)
        }
    };
    s.active += 1;
    let generation = GENERATION.load(Ordering::Acquire);
    drop(s);
    DEPTH.with(|d| d.set(d.get() + 1));
    Ok((Leave { gate: g, runtime }, generation))
}

/// Ends a section, also when it unwinds.
struct Leave {
    gate: &'static Gate,
    runtime: Option<Arc<Runtime>>,
}

impl Drop for Leave {
    fn drop(&mut self) {
        // First: a fork waiting for this section must find the only reference in the gate.
        self.runtime = None;
        DEPTH.with(|d| d.set(d.get() - 1));
        let mut s = self.gate.lock();
        s.active -= 1;
        if s.active == 0 {
            self.gate.changed.notify_all();
        }
    }
}

/// Whether an object made in `generation` may be used now.
pub(crate) fn is_current(generation: u64) -> bool {
    generation == GENERATION.load(Ordering::Acquire)
}

/// Whether the runtime of `generation` was shut down (its threads joined) in this process or in
/// an ancestor before the fork that made this one: then nothing of it runs anywhere that could
/// hold its locks, and its state may be read and dropped.
pub(crate) fn is_shut_down(generation: u64) -> bool {
    generation < SHUT_DOWN_BELOW.load(Ordering::Acquire)
        && generation > LIVE_ELSEWHERE_UP_TO.load(Ordering::Acquire)
}

/// Gets rid of runtime state made in `generation`: dropped when its runtime was shut down (or
/// is this process's current one), leaked when it may still be running in another process.
pub(crate) fn dispose<T>(generation: u64, value: T) {
    if is_shut_down(generation) || is_current(generation) {
        drop(value);
    } else {
        std::mem::forget(value);
    }
}

/// The `before` fork hook: waits for the sections running now, keeps new ones out, and shuts
/// the runtime down (joining its threads). Called by Python with the GIL, which it releases
/// while it waits.
#[pyfunction]
pub(crate) fn before_fork(py: Python<'_>) {
    py.detach(|| {
        let g = gate();
        let mut s = g.lock();
        // Another thread's fork first (each fork runs the hooks on its own thread).
        while s.forking {
            s = g.wait(s);
        }
        s.forking = true;
        while s.active > 0 {
            s = g.wait(s);
        }
        let runtime = s.runtime.take();
        drop(s);
        if let Some(runtime) = runtime {
            let generation = GENERATION.load(Ordering::Acquire);
            match Arc::try_unwrap(runtime) {
                // Dropping joins the worker and blocking threads; tasks are cancelled.
                Ok(runtime) => drop(runtime),
                Err(_) => unreachable!("sections hold the runtime only while active"),
            }
            SHUT_DOWN_BELOW.store(generation + 1, Ordering::Release);
            GENERATION.store(generation + 1, Ordering::Release);
        }
        PREPARED.store(true, Ordering::Release);
    });
}

/// The `after_in_parent` fork hook: lets sections in again.
#[pyfunction]
pub(crate) fn after_fork_in_parent() {
    PREPARED.store(false, Ordering::Release);
    let g = gate();
    let mut s = g.lock();
    s.forking = false;
    g.changed.notify_all();
}

/// The `after_in_child` fork hook: a fresh gate (the inherited one may be locked by a thread
/// that does not exist here). The runtime is built on first use.
#[pyfunction]
pub(crate) fn after_fork_in_child() {
    gate();
}

/// Registers the hooks with `os.register_at_fork` (once, at import).
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("before", wrap_pyfunction!(before_fork, m)?)?;
    kwargs.set_item("after_in_parent", wrap_pyfunction!(after_fork_in_parent, m)?)?;
    kwargs.set_item("after_in_child", wrap_pyfunction!(after_fork_in_child, m)?)?;
    py.import("os")?.getattr("register_at_fork")?.call((), Some(&kwargs))?;
    Ok(())
}

/// Generation of the runtime in use or next built (for tests and diagnostics).
pub(crate) fn generation() -> u64 {
    GENERATION.load(Ordering::Acquire)
}

/// Whether a runtime is running in this process now (for tests and diagnostics).
pub(crate) fn runtime_running() -> bool {
    guarded(|| gate().lock().runtime.is_some())
}
