//! What the benchmark binaries share: writing a large patterned object and reading it straight
//! from the UFS the way a tuned direct client would.

use std::time::{Duration, Instant};

use futures::StreamExt;
use strata_testkit::fill_pattern;

const MIB: u64 = 1 << 20;

/// The machine's 1, 5 and 15-minute load averages, as `/proc/loadavg` says them ("?" when it
/// cannot be read): every figure is reported with the load it was measured under.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Writes `size` bytes of `fill_pattern(seed, ..)` to `path`, 16 MiB parts, 4 in flight.
pub async fn put_pattern_object(op: &opendal::Operator, path: &str, size: u64, seed: u64) {
    let mut writer = op.writer_with(path).chunk(16 << 20).concurrent(4).await.expect("writer");
    let mut off = 0;
    while off < size {
        let mut buf = vec![0u8; (16 * MIB).min(size - off) as usize];
        fill_pattern(seed, off, &mut buf);
        off += buf.len() as u64;
        writer.write(buf).await.expect("write");
    }
    writer.close().await.expect("close");
}

/// Reads `path` straight from the UFS in `range`-byte ranges, `in_flight` at a time.
pub async fn direct_read(
    op: &opendal::Operator,
    path: &str,
    size: u64,
    range: u64,
    in_flight: usize,
) -> Duration {
    let started = Instant::now();
    let n: u64 = futures::stream::iter((0..size).step_by(range as usize).map(|start| {
        let op = op.clone();
        async move {
            let end = (start + range).min(size);
            op.read_with(path).range(start..end).await.expect("range read").len() as u64
        }
    }))
    .buffered(in_flight)
    .fold(0u64, |acc, n| async move { acc + n })
    .await;
    assert_eq!(n, size);
    started.elapsed()
}

/// Heap measured, not estimated: a global allocator that forwards to the system's and keeps the
/// live byte count. A binary installs it with
/// `#[global_allocator] static ALLOCATOR: Counting = Counting;` and reads [`counting::live`].
pub mod counting {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicI64, Ordering};

    #[derive(Debug)]
    pub struct Counting;

    static LIVE: AtomicI64 = AtomicI64::new(0);

    // SAFETY: forwards to the system allocator and only counts the sizes it is asked for.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
            // SAFETY: the caller's contract is System's.
            unsafe { System.alloc(layout) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
            // SAFETY: as above.
            unsafe { System.dealloc(ptr, layout) }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            LIVE.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
            // SAFETY: as above.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    /// Bytes allocated and not yet freed, through [`Counting`].
    pub fn live() -> i64 {
        LIVE.load(Ordering::Relaxed)
    }
}
