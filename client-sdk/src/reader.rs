//! A streaming reader of one version of a file: `AsyncRead + AsyncSeek`, block-aligned
//! fetches, and adaptive readahead: the window of blocks fetched ahead doubles with every
//! sequential block (1, 2, 4, ... up to `readahead_blocks`) and falls back to none on a seek,
//! so a sequential reader soon has many fetches in flight while a random one wastes none.

use std::collections::VecDeque;
use std::io::{self, SeekFrom};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncSeek, ReadBuf};
use tokio::task::JoinHandle;

use crate::{Client, FileInfo, Result};

pub struct StrataReader {
    client: Client,
    info: FileInfo,
    pos: u64,
    current: Option<(u64, Bytes)>,
    /// Fetches in flight for consecutive blocks, the first one being the next needed.
    pending: VecDeque<(u64, JoinHandle<Result<Bytes>>)>,
    /// The block the window was last sized for: a reader polled again while it waits for
    /// that block must not grow the window again.
    scheduled: Option<u64>,
    /// Blocks fetched ahead of the one needed now.
    window: u64,
}

impl StrataReader {
    pub(crate) fn new(client: Client, info: FileInfo) -> Self {
        Self { client, info, pos: 0, current: None, pending: VecDeque::new(), scheduled: None, window: 0 }
    }

    /// The file (and version) this reader is pinned to.
    pub fn info(&self) -> &FileInfo {
        &self.info
    }

    pub fn position(&self) -> u64 {
        self.pos
    }

    fn spawn_fetch(&self, index: u64) -> JoinHandle<Result<Bytes>> {
        let client = self.client.clone();
        let info = self.info.clone();
        tokio::spawn(async move { client.read_block_of(&info, index).await })
    }

    fn block_count(&self) -> u64 {
        strata_common::block::block_count(self.info.size, self.info.block_size)
    }

    /// Makes sure `index` is being fetched, and, for a sequential reader, the blocks after it.
    fn schedule(&mut self, index: u64) {
        if self.scheduled == Some(index) {
            return;
        }
        self.scheduled = Some(index);
        if self.pending.front().is_some_and(|(i, _)| *i != index) {
            for (_, task) in self.pending.drain(..) {
                task.abort();
            }
        }
        // Sequential: the block needed now follows the one the reader has just finished.
        let sequential = self.current.as_ref().is_some_and(|(current, _)| current + 1 == index);
        self.window = next_window(self.window, sequential, self.client.config().readahead_blocks as u64);
        let end = (index + 1 + self.window).min(self.block_count());
        let mut next = self.pending.back().map_or(index, |(i, _)| i + 1);
        while next < end {
            let task = self.spawn_fetch(next);
            self.pending.push_back((next, task));
            next += 1;
        }
    }
}

/// The readahead window after one more block: doubled on a sequential step, reset by a seek.
fn next_window(window: u64, sequential: bool, max: u64) -> u64 {
    if sequential { (window * 2).max(1).min(max) } else { 0 }
}

impl Drop for StrataReader {
    fn drop(&mut self) {
        for (_, task) in self.pending.drain(..) {
            task.abort();
        }
    }
}

impl StrataReader {
    /// Makes `current` the block holding `pos`; `false` at the end of the file.
    fn poll_current(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<bool>> {
        loop {
            if self.pos >= self.info.size {
                return Poll::Ready(Ok(false));
            }
            let index = self.pos / self.info.block_size;
            if self.current.as_ref().is_some_and(|(cur, _)| *cur == index) {
                return Poll::Ready(Ok(true));
            }
            self.schedule(index);
            let (_, task) = self.pending.front_mut().expect("schedule queued the needed block");
            let fetched = ready!(Pin::new(task).poll(cx));
            self.pending.pop_front();
            let bytes = match fetched {
                Ok(Ok(bytes)) => bytes,
                Ok(Err(e)) => {
                    // A read again after an error fetches the block again.
                    self.scheduled = None;
                    return Poll::Ready(Err(e.into()));
                }
                Err(join) => {
                    self.scheduled = None;
                    return Poll::Ready(Err(io::Error::other(join)));
                }
            };
            self.current = Some((index, bytes));
        }
    }

    /// The current block and where `pos` is in it (only after `poll_current` said `true`).
    fn current_at_pos(&self) -> (&Bytes, usize) {
        let (index, bytes) = self.current.as_ref().expect("poll_current filled it");
        (bytes, (self.pos - index * self.info.block_size) as usize)
    }

    /// The bytes from the position to the end of its block, as they arrived from the worker:
    /// no copy (`read` copies into the caller's buffer). `None` at the end of the file. Mixes
    /// with `read` and seeks; readahead works the same.
    pub async fn next_chunk(&mut self) -> io::Result<Option<Bytes>> {
        if !std::future::poll_fn(|cx| self.poll_current(cx)).await? {
            return Ok(None);
        }
        let (bytes, start) = self.current_at_pos();
        let chunk = bytes.slice(start..);
        self.pos += chunk.len() as u64;
        Ok(Some(chunk))
    }
}

impl AsyncRead for StrataReader {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if buf.remaining() == 0 || !ready!(this.poll_current(cx))? {
            return Poll::Ready(Ok(()));
        }
        let (bytes, start) = this.current_at_pos();
        let n = (bytes.len() - start).min(buf.remaining());
        buf.put_slice(&bytes[start..start + n]);
        this.pos += n as u64;
        Poll::Ready(Ok(()))
    }
}

impl AsyncSeek for StrataReader {
    fn start_seek(mut self: Pin<&mut Self>, position: SeekFrom) -> io::Result<()> {
        let target = match position {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.info.size.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = target.ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "seek before the start of the file")
        })?;
        Ok(())
    }

    fn poll_complete(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<u64>> {
        Poll::Ready(Ok(self.pos))
    }
}

#[cfg(test)]
mod tests {
    use super::next_window;

    #[test]
    fn the_window_doubles_while_sequential_and_a_seek_resets_it() {
        let mut w = 0;
        let mut seen = Vec::new();
        for _ in 0..6 {
            w = next_window(w, true, 8);
            seen.push(w);
        }
        assert_eq!(seen, [1, 2, 4, 8, 8, 8]);
        assert_eq!(next_window(w, false, 8), 0, "a seek drops the readahead");
        assert_eq!(next_window(0, true, 0), 0, "readahead_blocks = 0 turns it off");
    }
}
