//! `stratafs._native`: the Strata client SDK for Python. The fsspec filesystem in
//! `stratafs/__init__.py` is a thin layer over these classes.
//!
//! Three rules hold everywhere here:
//! - **The GIL is released during I/O** (`Python::detach`); Rust state is locked only after the
//!   GIL is released, so a thread waiting for a lock never holds the GIL someone else needs.
//! - **At most one copy into Python**: block bytes are copied once, straight into the `bytes`
//!   object being built or into the caller's buffer (`readinto`).
//! - **Fork safety**: the tokio runtime and every connection belong to the process that made
//!   them. Each call compares the pid with the one its state was built in; in a forked child
//!   the inherited runtime, client and connections are leaked (never used, never dropped:
//!   dropping would join threads and take locks that do not exist in the child) and new ones
//!   are built lazily. Placement is the Rust ring, so every process agrees on it.

use std::fs::File;
use std::io::{Read, Write};
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{
    PyConnectionError, PyFileExistsError, PyFileNotFoundError, PyIsADirectoryError, PyOSError,
    PyPermissionError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use strata_client::{ClientConfig, ClientError, FileInfo, StrataReader, StrataWriter};
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::runtime::Runtime;

/// Largest window `get_file` reads at once (blocks of it are fetched in parallel).
const GET_WINDOW: u64 = 64 << 20;
/// Chunk `put_file` reads from the local file.
const PUT_CHUNK: usize = 8 << 20;

fn to_py(e: ClientError) -> PyErr {
    let msg = e.to_string();
    match e {
        ClientError::NotFound(_) => PyFileNotFoundError::new_err(msg),
        ClientError::IsDirectory(_) => PyIsADirectoryError::new_err(msg),
        ClientError::PermissionDenied(_) => PyPermissionError::new_err(msg),
        ClientError::InvalidArgument(_) => PyValueError::new_err(msg),
        ClientError::AlreadyExists(_) => PyFileExistsError::new_err(msg),
        ClientError::MasterUnavailable(_) | ClientError::Unavailable(_) => PyConnectionError::new_err(msg),
        _ => PyOSError::new_err(msg),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The runtime and client of one process.
struct Proc {
    pid: u32,
    rt: Arc<Runtime>,
    client: strata_client::Client,
}

/// What a `Client` and the files it opened share.
struct Shared {
    master: String,
    proc_: Mutex<Option<Proc>>,
}

impl Shared {
    /// This process's runtime and client, built on first use and again after a fork. Called
    /// without the GIL.
    fn get(&self) -> PyResult<(Arc<Runtime>, strata_client::Client)> {
        let pid = std::process::id();
        let mut guard = lock(&self.proc_);
        if let Some(p) = guard.as_ref()
            && p.pid == pid
        {
            return Ok((p.rt.clone(), p.client.clone()));
        }
        if let Some(inherited) = guard.take() {
            // Built by our parent before a fork: its threads are gone here.
            std::mem::forget(inherited);
        }
        let rt = Arc::new(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("strata-py")
                .enable_all()
                .build()
                .map_err(|e| PyOSError::new_err(format!("cannot start the I/O runtime: {e}")))?,
        );
        let client = rt.block_on(strata_client::Client::connect(ClientConfig::new(self.master.clone())));
        let client = client.map_err(to_py)?;
        *guard = Some(Proc { pid, rt: rt.clone(), client: client.clone() });
        Ok((rt, client))
    }

    fn pid(&self) -> Option<u32> {
        lock(&self.proc_).as_ref().map(|p| p.pid)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let slot = self.proc_.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = slot.take()
            && p.pid != std::process::id()
        {
            // Inherited through a fork (a filesystem the child never used, collected there):
            // dropping the runtime would wait for worker threads that do not exist here.
            std::mem::forget(p);
        }
    }
}

fn info_dict<'py>(py: Python<'py>, f: &FileInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", &f.path)?;
    d.set_item("size", f.size)?;
    d.set_item("type", if f.is_dir { "directory" } else { "file" })?;
    d.set_item("version", &f.version)?;
    d.set_item("mtime", f.mtime_ms as f64 / 1000.0)?;
    d.set_item("block_size", f.block_size)?;
    Ok(d)
}

/// fsspec's `start`/`end` (negative counts from the end, `None` is the start/end of the file)
/// as an offset and a length within a file of `size` bytes.
fn byte_range(size: u64, start: Option<i64>, end: Option<i64>) -> (u64, u64) {
    let clamp =
        |v: i64| -> u64 { if v < 0 { size.saturating_sub(v.unsigned_abs()) } else { (v as u64).min(size) } };
    let s = start.map_or(0, clamp);
    let e = end.map_or(size, clamp);
    (s, e.saturating_sub(s))
}

/// A `bytes` object of `len` bytes filled by `fill` without the GIL, copied into once.
fn bytes_filled<'py>(
    py: Python<'py>,
    len: u64,
    fill: impl FnOnce(&mut [u8]) -> PyResult<()> + Send,
) -> PyResult<Bound<'py, PyBytes>> {
    let len = usize::try_from(len).map_err(|_| PyValueError::new_err("read too large"))?;
    let size = isize::try_from(len).map_err(|_| PyValueError::new_err("read too large"))?;
    // Not `PyBytes::new_with`, which zero-fills first: for a 1 GiB read that fill costs as much
    // as the copy. SAFETY: a NULL source asks CPython for an uninitialised bytes object of `len`
    // bytes; nothing else refers to it until it is returned, and it is returned only after
    // `fill` succeeded, which writes every byte (callers that may fill less return a copy of the
    // filled part instead).
    let obj = unsafe {
        Bound::from_owned_ptr_or_err(py, pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), size))?
    };
    // SAFETY: `obj` is a bytes object (just created); its storage holds `len` bytes.
    let ptr = unsafe { pyo3::ffi::PyBytes_AsString(obj.as_ptr()) } as usize;
    py.detach(|| {
        // SAFETY: see above; `obj` outlives this closure.
        let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
        fill(buf)
    })?;
    // SAFETY: created by PyBytes_FromStringAndSize.
    Ok(unsafe { obj.cast_into_unchecked::<PyBytes>() })
}

/// A writable, contiguous view of a Python buffer, usable without the GIL while `buf` lives.
fn writable_slice(buf: &PyBuffer<u8>) -> PyResult<(usize, usize)> {
    if buf.readonly() {
        return Err(PyValueError::new_err("readinto needs a writable buffer"));
    }
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err("readinto needs a contiguous buffer"));
    }
    Ok((buf.buf_ptr() as usize, buf.len_bytes()))
}

fn contiguous(buf: &PyBuffer<u8>) -> PyResult<(usize, usize)> {
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err("expected a contiguous bytes-like object"));
    }
    Ok((buf.buf_ptr() as usize, buf.len_bytes()))
}

/// A connection to a Strata cluster (through its master's `host:port`).
#[pyclass(module = "stratafs._native", frozen)]
struct Client {
    shared: Arc<Shared>,
}

#[pymethods]
impl Client {
    /// Connects at once, so a wrong address fails here.
    #[new]
    fn new(py: Python<'_>, master: String) -> PyResult<Self> {
        let shared = Arc::new(Shared { master, proc_: Mutex::new(None) });
        py.detach(|| shared.get().map(|_| ()))?;
        Ok(Self { shared })
    }

    #[getter]
    fn master(&self) -> String {
        self.shared.master.clone()
    }

    /// The pid this client's runtime and connections were built in (None before first use).
    fn runtime_pid(&self) -> Option<u32> {
        self.shared.pid()
    }

    #[pyo3(signature = (path, sync=false))]
    fn stat<'py>(&self, py: Python<'py>, path: &str, sync: bool) -> PyResult<Bound<'py, PyDict>> {
        let info = py.detach(|| {
            let (rt, c) = self.shared.get()?;
            rt.block_on(c.stat_with(path, sync)).map_err(to_py)
        })?;
        info_dict(py, &info)
    }

    fn ls<'py>(&self, py: Python<'py>, path: &str) -> PyResult<Bound<'py, PyList>> {
        let entries = py.detach(|| {
            let (rt, c) = self.shared.get()?;
            rt.block_on(c.list(path)).map_err(to_py)
        })?;
        let out = PyList::empty(py);
        for e in &entries {
            out.append(info_dict(py, e)?)?;
        }
        Ok(out)
    }

    /// Bytes `start..end` of a file (fsspec's `cat_file` semantics).
    #[pyo3(signature = (path, start=None, end=None))]
    fn cat<'py>(
        &self,
        py: Python<'py>,
        path: &str,
        start: Option<i64>,
        end: Option<i64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut sync = false;
        loop {
            let (rt, c, info) = py.detach(|| {
                let (rt, c) = self.shared.get()?;
                let info = rt.block_on(c.stat_with(path, sync)).map_err(to_py)?;
                Ok::<_, PyErr>((rt, c, info))
            })?;
            if info.is_dir {
                return Err(PyIsADirectoryError::new_err(format!("is a directory: {}", info.path)));
            }
            let (offset, len) = byte_range(info.size, start, end);
            let mut changed = false;
            let result = bytes_filled(py, len, |buf| {
                rt.block_on(c.read_into(&info, offset, buf)).map_err(|e| {
                    changed = matches!(e, ClientError::Changed(_));
                    to_py(e)
                })
            });
            match result {
                // Our idea of the version was stale: ask the UFS and read the new one whole.
                Err(_) if changed && !sync => sync = true,
                other => return other,
            }
        }
    }

    /// Many ranges at once, fetched in parallel: a list of `bytes`.
    fn cat_ranges<'py>(
        &self,
        py: Python<'py>,
        paths: Vec<String>,
        starts: Vec<Option<i64>>,
        ends: Vec<Option<i64>>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        if paths.len() != starts.len() || paths.len() != ends.len() {
            return Err(PyValueError::new_err("paths, starts and ends must have the same length"));
        }
        let (rt, c, infos) = py.detach(|| {
            let (rt, c) = self.shared.get()?;
            let infos = rt.block_on(async {
                let mut out = Vec::with_capacity(paths.len());
                for p in &paths {
                    out.push(c.stat(p).await?);
                }
                Ok::<_, ClientError>(out)
            });
            Ok::<_, PyErr>((rt, c, infos.map_err(to_py)?))
        })?;
        let mut outs = Vec::with_capacity(paths.len());
        let mut jobs = Vec::with_capacity(paths.len());
        for (i, info) in infos.iter().enumerate() {
            if info.is_dir {
                return Err(PyIsADirectoryError::new_err(format!("is a directory: {}", info.path)));
            }
            let (offset, len) = byte_range(info.size, starts[i], ends[i]);
            let b = PyBytes::new_with(py, len as usize, |_| Ok(()))?;
            // SAFETY: the object was created just now and nothing else refers to it until we
            // return it; PyBytes_AsString gives its (writable) storage of exactly `len` bytes.
            let ptr = unsafe { pyo3::ffi::PyBytes_AsString(b.as_ptr()) } as usize;
            jobs.push((i, offset, len, ptr));
            outs.push(b);
        }
        py.detach(|| {
            rt.block_on(async {
                let tasks = jobs.iter().map(|&(i, offset, len, ptr)| {
                    let c = &c;
                    let info = &infos[i];
                    async move {
                        // SAFETY: see above; each job writes its own object, and the objects
                        // outlive this block (they are in `outs`, held by this frame).
                        let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len as usize) };
                        c.read_into(info, offset, buf).await
                    }
                });
                futures_lite_join(tasks).await
            })
        })
        .map_err(to_py)?;
        Ok(outs)
    }

    /// A seekable reader pinned to the current version of the file.
    fn open_read(&self, py: Python<'_>, path: &str) -> PyResult<Reader> {
        let info = py.detach(|| {
            let (rt, c) = self.shared.get()?;
            rt.block_on(c.stat(path)).map_err(to_py)
        })?;
        if info.is_dir {
            return Err(PyIsADirectoryError::new_err(format!("is a directory: {}", info.path)));
        }
        Ok(Reader {
            shared: self.shared.clone(),
            state: Mutex::new(ReaderState { info, reader: None, pos: 0 }),
        })
    }

    /// A writer replacing the file when it is closed.
    fn open_write(&self, py: Python<'_>, path: &str) -> PyResult<Writer> {
        let w = py.detach(|| {
            let (rt, c) = self.shared.get()?;
            rt.block_on(c.create(path)).map_err(to_py)
        })?;
        Ok(Writer {
            shared: self.shared.clone(),
            pid: std::process::id(),
            inner: Mutex::new(Some(w)),
            path: path.to_string(),
        })
    }

    /// Copies a file to a local path; returns the bytes copied.
    fn get_file(&self, py: Python<'_>, rpath: &str, lpath: &str) -> PyResult<u64> {
        py.detach(|| {
            let (rt, c) = self.shared.get()?;
            let info = rt.block_on(c.stat(rpath)).map_err(to_py)?;
            if info.is_dir {
                return Err(PyIsADirectoryError::new_err(format!("is a directory: {}", info.path)));
            }
            let mut out = File::create(lpath)?;
            let mut buf = vec![0u8; info.size.min(GET_WINDOW) as usize];
            let mut offset = 0;
            while offset < info.size {
                let n = (info.size - offset).min(GET_WINDOW) as usize;
                rt.block_on(c.read_into(&info, offset, &mut buf[..n])).map_err(to_py)?;
                out.write_all(&buf[..n])?;
                offset += n as u64;
            }
            out.flush()?;
            Ok(info.size)
        })
    }

    /// Writes a local file to `rpath`; returns the new file's info.
    fn put_file<'py>(&self, py: Python<'py>, lpath: &str, rpath: &str) -> PyResult<Bound<'py, PyDict>> {
        let info = py.detach(|| {
            let mut src = File::open(lpath)?;
            let (rt, c) = self.shared.get()?;
            let mut w = rt.block_on(c.create(rpath)).map_err(to_py)?;
            let mut buf = vec![0u8; PUT_CHUNK];
            loop {
                let n = src.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                rt.block_on(w.write(&buf[..n])).map_err(to_py)?;
            }
            rt.block_on(w.close()).map_err(to_py)
        })?;
        info_dict(py, &info)
    }

    /// Writes `data` (any contiguous bytes-like object) as the whole file.
    fn pipe<'py>(&self, py: Python<'py>, path: &str, data: PyBuffer<u8>) -> PyResult<Bound<'py, PyDict>> {
        let (ptr, len) = contiguous(&data)?;
        let info = py.detach(|| {
            // SAFETY: `data` holds the buffer export (its memory stays put) until after this
            // closure returns; we only read it.
            let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
            let (rt, c) = self.shared.get()?;
            rt.block_on(async {
                let mut w = c.create(path).await?;
                w.write(bytes).await?;
                w.close().await
            })
            .map_err(to_py)
        })?;
        drop(data);
        info_dict(py, &info)
    }

    #[pyo3(signature = (path, recursive=false))]
    fn rm(&self, py: Python<'_>, path: &str, recursive: bool) -> PyResult<()> {
        py.detach(|| {
            let (rt, c) = self.shared.get()?;
            rt.block_on(c.delete(path, recursive)).map_err(to_py)
        })
    }

    fn mkdir(&self, py: Python<'_>, path: &str) -> PyResult<()> {
        py.detach(|| {
            let (rt, c) = self.shared.get()?;
            rt.block_on(c.mkdir(path)).map_err(to_py)
        })
    }

    /// Worker ids that hold (first) each block of a file, from the placement ring: the same
    /// in every process that sees the same membership.
    fn placement(&self, py: Python<'_>, path: &str) -> PyResult<Vec<String>> {
        py.detach(|| {
            let (rt, c) = self.shared.get()?;
            rt.block_on(async {
                let info = c.stat(path).await?;
                let ring = c.ring().await?;
                let blocks = strata_common::block::block_count(info.size, info.block_size);
                Ok((0..blocks)
                    .map(|i| {
                        let key = strata_common::BlockKey::new(info.file_id.clone(), info.version.clone(), i);
                        ring.owners(key.placement_hash(), 1).first().map_or(String::new(), |m| m.id.clone())
                    })
                    .collect())
            })
            .map_err(to_py)
        })
    }
}

/// Runs futures concurrently (bounded by the client's own per-read parallelism) and returns the
/// first error.
async fn futures_lite_join<F>(tasks: impl Iterator<Item = F>) -> Result<(), ClientError>
where
    F: std::future::Future<Output = Result<(), ClientError>>,
{
    use futures::{StreamExt, TryStreamExt};
    futures::stream::iter(tasks).buffer_unordered(16).try_collect::<()>().await
}

struct ReaderState {
    info: FileInfo,
    /// The streaming reader, with this process's pid (rebuilt after a fork).
    reader: Option<(u32, StrataReader)>,
    pos: u64,
}

impl Drop for ReaderState {
    fn drop(&mut self) {
        if let Some((pid, r)) = self.reader.take()
            && pid != std::process::id()
        {
            // Its readahead tasks belong to the parent's runtime (see `Shared::drop`).
            std::mem::forget(r);
        }
    }
}

impl ReaderState {
    fn reader(&mut self, shared: &Shared) -> PyResult<(Arc<Runtime>, &mut StrataReader)> {
        let pid = std::process::id();
        let (rt, client) = shared.get()?;
        if self.reader.as_ref().is_some_and(|(p, _)| *p != pid)
            && let Some(inherited) = self.reader.take()
        {
            // Its readahead tasks live in the parent's runtime.
            std::mem::forget(inherited);
        }
        if self.reader.is_none() {
            let mut r = client.reader_of(self.info.clone());
            rt.block_on(r.seek(std::io::SeekFrom::Start(self.pos)))?;
            self.reader = Some((pid, r));
        }
        let (_, r) = self.reader.as_mut().expect("just set");
        Ok((rt, r))
    }

    /// Fills `buf` from the current position (less at the end of the file); returns the count.
    fn read_into(&mut self, shared: &Shared, buf: &mut [u8]) -> PyResult<usize> {
        let (rt, r) = self.reader(shared)?;
        let n = rt.block_on(async {
            let mut n = 0;
            while n < buf.len() {
                let got = r.read(&mut buf[n..]).await?;
                if got == 0 {
                    break;
                }
                n += got;
            }
            Ok::<_, std::io::Error>(n)
        })?;
        self.pos += n as u64;
        Ok(n)
    }
}

/// A file open for reading: one version, block-aligned fetches, readahead when sequential.
#[pyclass(module = "stratafs._native", frozen)]
struct Reader {
    shared: Arc<Shared>,
    state: Mutex<ReaderState>,
}

#[pymethods]
impl Reader {
    #[getter]
    fn size(&self) -> u64 {
        lock(&self.state).info.size
    }

    #[getter]
    fn version(&self) -> String {
        lock(&self.state).info.version.clone()
    }

    fn tell(&self) -> u64 {
        lock(&self.state).pos
    }

    /// Moves to `offset` relative to `whence` (0 start, 1 current, 2 end).
    #[pyo3(signature = (offset, whence=0))]
    fn seek(&self, offset: i64, whence: i32) -> PyResult<u64> {
        let mut s = lock(&self.state);
        let base = match whence {
            0 => 0,
            1 => s.pos as i64,
            2 => s.info.size as i64,
            _ => return Err(PyValueError::new_err(format!("invalid whence ({whence})"))),
        };
        let target = base.checked_add(offset).filter(|t| *t >= 0).ok_or_else(|| {
            PyValueError::new_err(format!("negative seek position {}", base.saturating_add(offset)))
        })? as u64;
        s.pos = target;
        let pid = std::process::id();
        if let Some((p, r)) = s.reader.as_mut()
            && *p == pid
        {
            // Only moves the reader's position: blocks are fetched at the next read.
            let (rt, _) = self.shared.get()?;
            rt.block_on(r.seek(std::io::SeekFrom::Start(target)))?;
        }
        Ok(target)
    }

    /// Up to `size` bytes (all the rest when negative) as `bytes`.
    #[pyo3(signature = (size=-1))]
    fn read<'py>(&self, py: Python<'py>, size: i64) -> PyResult<Bound<'py, PyBytes>> {
        let (pos, file_size) = py.detach(|| {
            let s = lock(&self.state);
            (s.pos, s.info.size)
        });
        let left = file_size.saturating_sub(pos);
        let want = if size < 0 { left } else { (size as u64).min(left) };
        let mut got = 0;
        let b = bytes_filled(py, want, |buf| {
            got = lock(&self.state).read_into(&self.shared, buf)?;
            Ok(())
        })?;
        if got as u64 == want {
            Ok(b)
        } else {
            // The file is shorter than its stat said (cannot happen for a pinned version).
            Ok(PyBytes::new(py, &b.as_bytes()[..got]))
        }
    }

    /// Reads into a writable buffer (bytearray, memoryview, numpy array...) with no copy
    /// besides the one into it; returns the count (0 at the end).
    fn readinto(&self, py: Python<'_>, buffer: PyBuffer<u8>) -> PyResult<usize> {
        let (ptr, len) = writable_slice(&buffer)?;
        let n = py.detach(|| {
            // SAFETY: `buffer` keeps the export (and so the memory) alive and in place until it
            // is dropped after this closure; it was checked writable and contiguous.
            let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
            lock(&self.state).read_into(&self.shared, buf)
        })?;
        drop(buffer);
        Ok(n)
    }

    fn close(&self) {
        let mut s = lock(&self.state);
        if let Some((pid, r)) = s.reader.take() {
            if pid == std::process::id() {
                // Dropping aborts readahead tasks: that needs this process's runtime.
                if let Ok((rt, _)) = self.shared.get() {
                    let _guard = rt.enter();
                    drop(r);
                    return;
                }
            }
            std::mem::forget(r);
        }
    }
}

/// A file open for writing: the bytes stream to a worker, which writes the UFS; the file is
/// replaced when `close` succeeds.
#[pyclass(module = "stratafs._native", frozen)]
struct Writer {
    shared: Arc<Shared>,
    pid: u32,
    path: String,
    inner: Mutex<Option<StrataWriter>>,
}

impl Writer {
    fn with<T>(&self, f: impl FnOnce(&Runtime, &mut StrataWriter) -> Result<T, ClientError>) -> PyResult<T> {
        if std::process::id() != self.pid {
            return Err(PyOSError::new_err(format!(
                "{} was opened for writing in another process (before a fork); open it again here",
                self.path
            )));
        }
        let (rt, _) = self.shared.get()?;
        let mut guard = lock(&self.inner);
        let w = guard.as_mut().ok_or_else(|| PyValueError::new_err("I/O operation on closed file"))?;
        f(&rt, w).map_err(to_py)
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if std::process::id() != self.pid
            && let Some(w) = self.inner.get_mut().unwrap_or_else(|p| p.into_inner()).take()
        {
            // Its connection is registered with the parent's runtime (see `Shared::drop`).
            std::mem::forget(w);
        }
    }
}

#[pymethods]
impl Writer {
    /// Appends any contiguous bytes-like object; returns its length.
    fn write(&self, py: Python<'_>, data: PyBuffer<u8>) -> PyResult<usize> {
        let (ptr, len) = contiguous(&data)?;
        py.detach(|| {
            // SAFETY: `data` keeps the export alive until after this closure; read only.
            let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
            self.with(|rt, w| rt.block_on(w.write(bytes)))
        })?;
        drop(data);
        Ok(len)
    }

    #[getter]
    fn written(&self) -> u64 {
        lock(&self.inner).as_ref().map_or(0, |w| w.written())
    }

    /// Commits the file; returns its new info.
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let info = py.detach(|| {
            let info = self.with(|rt, w| rt.block_on(w.close()));
            if std::process::id() == self.pid {
                lock(&self.inner).take();
            }
            info
        })?;
        info_dict(py, &info)
    }

    /// Drops what was written; the old file stays.
    fn abort(&self) {
        let mut guard = lock(&self.inner);
        if let Some(mut w) = guard.take() {
            if std::process::id() == self.pid {
                w.abort();
            } else {
                std::mem::forget(w);
            }
        }
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Client>()?;
    m.add_class::<Reader>()?;
    m.add_class::<Writer>()?;
    Ok(())
}
