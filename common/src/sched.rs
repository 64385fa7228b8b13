//! How the kernel schedules one thread: its priority (nice) and its slice.
//!
//! Why a slice as well as a priority: Linux's fair scheduler (EEVDF, since 6.6) does not let a
//! waking thread preempt the running one just because its priority is higher. A thread at nice
//! -10 woken by a request on a host whose cores a flood keeps busy measured here a wait of
//! 0.3–2.6 ms to run (`perf sched timehist`, kernel 6.18), behind nice-0 threads finishing
//! their slices. Since 6.12 a thread may ask for a shorter slice (`sched_setattr`'s
//! `sched_runtime`, 0.1–100 ms), and a waking thread with a shorter slice than the running
//! one's preempts it. That needs no privilege: a short slice buys earlier turns, not more CPU.
//! Older kernels accept the call and ignore the slice.

use std::io;
use std::time::Duration;

/// The shortest and longest slice the kernel accepts (`sched_setattr(2)`; it clamps to these).
pub const MIN_SLICE: Duration = Duration::from_micros(100);
pub const MAX_SLICE: Duration = Duration::from_millis(100);

/// What a thread asks of the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThreadPriority {
    /// -20..=19; 0 leaves the thread's priority as it is. Below 0 needs `CAP_SYS_NICE`.
    pub nice: i32,
    /// `None` leaves the kernel's default slice.
    pub slice: Option<Duration>,
}

impl ThreadPriority {
    /// Gives the calling thread this priority, then this slice. Each that the kernel refuses
    /// is returned as an error after the other was tried, so a thread without `CAP_SYS_NICE`
    /// still gets its slice.
    pub fn apply_to_current_thread(&self) -> Result<(), ThreadPriorityError> {
        let nice = if self.nice == 0 { Ok(()) } else { set_current_thread_nice(self.nice) };
        let slice = self.slice.map_or(Ok(()), set_current_thread_slice);
        match (nice, slice) {
            (Ok(()), Ok(())) => Ok(()),
            (Err(e), _) => Err(ThreadPriorityError::Nice { nice: self.nice, source: e }),
            (_, Err(e)) => {
                Err(ThreadPriorityError::Slice { slice: self.slice.unwrap_or_default(), source: e })
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ThreadPriorityError {
    #[error("cannot set nice {nice} (below 0 needs CAP_SYS_NICE): {source}")]
    Nice { nice: i32, source: io::Error },
    #[error("cannot set a scheduling slice of {slice:?}: {source}")]
    Slice { slice: Duration, source: io::Error },
}

fn current_tid() -> libc::id_t {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() as libc::id_t }
}

/// Sets the calling thread's nice (not its process's: on Linux `PRIO_PROCESS` with a thread
/// id names the thread).
pub fn set_current_thread_nice(nice: i32) -> io::Result<()> {
    // SAFETY: a plain syscall on the calling thread's own id; no memory is passed.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, current_tid(), nice) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The calling thread's nice.
pub fn current_thread_nice() -> io::Result<i32> {
    // getpriority may return -1 as a priority: only errno tells a failure.
    // SAFETY: errno is thread-local; writing it and a plain syscall pass no memory.
    unsafe {
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, current_tid());
        match *libc::__errno_location() {
            0 => Ok(nice),
            errno => Err(io::Error::from_raw_os_error(errno)),
        }
    }
}

/// Asks for a slice of `slice` (clamped to [`MIN_SLICE`]..=[`MAX_SLICE`]) for the calling
/// thread, keeping its policy (normal) and its nice.
pub fn set_current_thread_slice(slice: Duration) -> io::Result<()> {
    let slice = slice.clamp(MIN_SLICE, MAX_SLICE);
    let mut attr = empty_attr();
    attr.sched_policy = libc::SCHED_OTHER as u32;
    attr.sched_nice = current_thread_nice()?;
    attr.sched_runtime = slice.as_nanos() as u64;
    // SAFETY: `attr` is a valid `sched_attr` whose `size` says how much of it the kernel reads.
    let set = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const libc::sched_attr, 0) };
    if set == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// The slice the calling thread runs with (the kernel's default unless one was asked for).
pub fn current_thread_slice() -> io::Result<Duration> {
    let mut attr = empty_attr();
    // SAFETY: the kernel writes at most `size` bytes into `attr`, which is that large.
    let got = unsafe {
        libc::syscall(libc::SYS_sched_getattr, 0, &mut attr as *mut libc::sched_attr, attr.size, 0)
    };
    if got == 0 { Ok(Duration::from_nanos(attr.sched_runtime)) } else { Err(io::Error::last_os_error()) }
}

fn empty_attr() -> libc::sched_attr {
    libc::sched_attr {
        size: std::mem::size_of::<libc::sched_attr>() as u32,
        sched_policy: 0,
        sched_flags: 0,
        sched_nice: 0,
        sched_priority: 0,
        sched_runtime: 0,
        sched_deadline: 0,
        sched_period: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a thread of its own, so the test runner's threads keep their scheduling.
    fn on_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(f).join().expect("thread")
    }

    #[test]
    fn a_thread_gets_the_slice_it_asks_for_and_keeps_its_nice() {
        let (slice, nice) = on_thread(|| {
            set_current_thread_nice(5).expect("raising nice needs no privilege");
            set_current_thread_slice(Duration::from_micros(250)).expect("a slice needs no privilege");
            (current_thread_slice().unwrap(), current_thread_nice().unwrap())
        });
        // Kernels before 6.12 ignore the slice; the machines this project runs on are newer.
        assert_eq!(slice, Duration::from_micros(250), "the kernel kept the slice asked for");
        assert_eq!(nice, 5, "asking for a slice left the nice as it was");
    }

    #[test]
    fn slices_outside_what_the_kernel_accepts_are_clamped() {
        let (short, long) = on_thread(|| {
            set_current_thread_slice(Duration::from_micros(1)).unwrap();
            let short = current_thread_slice().unwrap();
            set_current_thread_slice(Duration::from_secs(5)).unwrap();
            (short, current_thread_slice().unwrap())
        });
        assert_eq!((short, long), (MIN_SLICE, MAX_SLICE));
    }

    #[test]
    fn a_priority_sets_both_its_nice_and_its_slice() {
        let (result, nice, slice) = on_thread(|| {
            let priority = ThreadPriority { nice: 3, slice: Some(Duration::from_micros(400)) };
            let result = priority.apply_to_current_thread().map_err(|e| e.to_string());
            (result, current_thread_nice().unwrap(), current_thread_slice().unwrap())
        });
        assert_eq!(result, Ok(()));
        assert_eq!((nice, slice), (3, Duration::from_micros(400)));
    }
}
