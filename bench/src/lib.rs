//! What the benchmark binaries share: writing a large patterned object and reading it straight
//! from the UFS the way a tuned direct client would.

use std::time::{Duration, Instant};

use futures::StreamExt;
use strata_testkit::fill_pattern;

const MIB: u64 = 1 << 20;

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
