//! `stratafs._native`: the Strata client SDK for Python. The fsspec filesystem in
//! `stratafs/__init__.py` is a thin layer over these classes.
//!
//! Three rules hold everywhere here:
//! - **The GIL is released during I/O** (`Python::detach`); Rust state is locked only after the
//!   GIL is released, so a thread waiting for a lock never holds the GIL someone else needs.
//! - **At most one copy into Python**: block bytes are copied once, straight into the `bytes`
//!   object being built or into the caller's buffer (`readinto`).
//! - **Fork safety by construction** (`process`): every piece of Rust work runs inside a
//!   *section* of the process's runtime, and no section and no runtime thread runs at the instant
//!   of a `fork`: the `os.register_at_fork` hook waits for the sections and shuts the runtime
//!   down first. Clients, readers and writers remember the runtime generation they were made in
//!   and rebuild their runtime state from plain state (address, file and position) when it
//!   changed. Any lock besides the GIL is taken only inside a section, so none is held at a fork.

use std::fs::File;
use std::io::{Read, Write};
use std::sync::{Arc, Mutex, MutexGuard};

mod process;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{
    PyConnectionError, PyFileExistsError, PyFileNotFoundError, PyIsADirectoryError, PyOSError,
    PyPermissionError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use strata_client::{
    ClientConfig, ClientError, FileInfo, PendingFile, Persist, PersistState, ReadSpec, StrataReader,
    StrataWriter,
};
use tokio::io::{AsyncReadExt, AsyncSeek};
use tokio::runtime::Runtime;

/// Largest window `get_file` reads at once (blocks of it are fetched in parallel).
const GET_WINDOW: u64 = 64 << 20;
/// Chunk `put_file` reads from the local file.
const PUT_CHUNK: usize = 8 << 20;

/// The Python exception for an error, chosen by its kind (so a kind added later gets a
/// sensible builtin type: `OSError`).
fn to_py(e: ClientError) -> PyErr {
    use strata_common::ErrorKind as K;
    let msg = e.to_string();
    match e.kind() {
        K::NotFound => PyFileNotFoundError::new_err(msg),
        K::IsDirectory => PyIsADirectoryError::new_err(msg),
        K::PermissionDenied | K::Unauthenticated => PyPermissionError::new_err(msg),
        K::InvalidArgument => PyValueError::new_err(msg),
        K::AlreadyExists => PyFileExistsError::new_err(msg),
        K::Unavailable | K::NotLeader => PyConnectionError::new_err(msg),
        // No room (a pin beyond a tier's capacity): an OSError whose errno says so.
        K::ResourceExhausted => PyOSError::new_err((libc::ENOSPC, msg)),
        // The file changed under a reader of one version: what NFS calls a stale handle.
        K::VersionChanged => PyOSError::new_err((libc::ESTALE, msg)),
        // The storage behind the cache failed (after its retries).
        K::Ufs => PyOSError::new_err((libc::EIO, msg)),
        _ => PyOSError::new_err(msg),
    }
}

pyo3::import_exception!(io, UnsupportedOperation);

/// A refused append as `io.UnsupportedOperation` (an `OSError` and a `ValueError`, as Python's
/// own files raise for an operation they cannot do); any other error as [`to_py`].
fn append_to_py(e: ClientError) -> PyErr {
    match e.kind() {
        strata_common::ErrorKind::InvalidArgument => UnsupportedOperation::new_err(e.to_string()),
        _ => to_py(e),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a `Client` and the files it opened share: the master's address and the client of the
/// current runtime generation (connected on first use in each generation).
struct Shared {
    master: String,
    /// The token given to the constructor; `None`: the SDK's default (`STRATA_TOKEN`, ...).
    token: Option<String>,
    /// The job reads are recorded under; `None`: the SDK's default (`STRATA_JOB`).
    job: Option<String>,
    /// The request class; `None`: the SDK's default (`STRATA_QOS`).
    qos: Option<strata_client::QosClass>,
    client: Mutex<Option<(u64, strata_client::Client)>>,
}

impl Shared {
    /// Runs `f` in a section (see `process`) with this process's runtime, a client of its
    /// generation, and the generation. Call without the GIL.
    fn run<T>(&self, f: impl FnOnce(&Runtime, &strata_client::Client, u64) -> PyResult<T>) -> PyResult<T> {
        process::section(|rt, generation| {
            let client = self.client(rt, generation)?;
            f(rt, &client, generation)
        })
    }

    /// The client of `generation`, connected now if the one we have is older. Inside a section.
    fn client(&self, rt: &Runtime, generation: u64) -> PyResult<strata_client::Client> {
        let mut slot = lock(&self.client);
        if let Some((g, c)) = slot.as_ref()
            && *g == generation
        {
            return Ok(c.clone());
        }
        let client = match slot.take() {
            // After a fork: the same configuration and cached metadata, new connections.
            Some((g, old)) if process::is_shut_down(g) => {
                let fresh = {
                    let _in_runtime = rt.enter();
                    old.with_new_connections()
                };
                process::dispose(g, old);
                fresh.map_err(to_py)?
            }
            inherited => {
                if let Some((g, old)) = inherited {
                    process::dispose(g, old);
                }
                let mut config = ClientConfig::from_env(self.master.clone());
                if let Some(token) = &self.token {
                    config.token = Some(strata_client::Token(token.clone()));
                }
                if self.job.is_some() {
                    config.job = self.job.clone();
                }
                if let Some(qos) = self.qos {
                    config.qos = qos;
                }
                rt.block_on(strata_client::Client::connect(config)).map_err(to_py)?
            }
        };
        *slot = Some((generation, client.clone()));
        Ok(client)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some((g, c)) = self.client.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            process::dispose(g, c);
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
    // Write-back mounts: where the file's upload stands ("persisted" for every other file),
    // and the workers whose journals hold it until then.
    d.set_item("persist", f.persist.as_str())?;
    d.set_item("holders", f.holders.iter().map(|m| m.id.as_str()).collect::<Vec<_>>())?;
    Ok(d)
}

/// A pin, as `Client.pin`/`pins` return it (`expires` in Unix seconds, None: never).
fn pin_dict<'py>(py: Python<'py>, p: &strata_client::PinInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("path", &p.path)?;
    d.set_item("tier", strata_client::pin_tier_name(p.tier))?;
    d.set_item("bytes", p.bytes)?;
    d.set_item("created", p.created_unix_ms as f64 / 1000.0)?;
    d.set_item("expires", (p.expires_unix_ms != 0).then(|| p.expires_unix_ms as f64 / 1000.0))?;
    set_applied(&d, &p.applied)?;
    Ok(d)
}

/// The answer to a pin, unpin or TTL change: `workers` live, `workers_applied` of them with the
/// change in force, `pending` the ids of the others (they apply it at their next heartbeat).
fn set_applied(d: &Bound<'_, PyDict>, applied: &Option<strata_client::Applied>) -> PyResult<()> {
    if let Some(a) = applied {
        d.set_item("workers", a.workers)?;
        d.set_item("workers_applied", a.workers_applied)?;
        d.set_item("pending", a.pending.clone())?;
    }
    Ok(())
}

fn cache_ttl_dict<'py>(py: Python<'py>, t: &strata_client::CacheTtlInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("path", &t.path)?;
    d.set_item("ttl", t.cache_ttl_ms as f64 / 1000.0)?;
    d.set_item("created", t.created_unix_ms as f64 / 1000.0)?;
    set_applied(&d, &t.applied)?;
    Ok(d)
}

/// A write-back file not yet in the UFS, as `Client.sync` lists it.
fn pending_dict<'py>(py: Python<'py>, f: &PendingFile) -> PyResult<Bound<'py, PyDict>> {
    // The names `info` uses (`Persist::as_str`); a state newer than this build is "unknown",
    // still pending for a caller that waits.
    let state = match PersistState::try_from(f.state) {
        Ok(PersistState::Persisted) => Persist::Persisted.as_str(),
        Ok(PersistState::Pending) => Persist::Pending.as_str(),
        Ok(PersistState::Uploading) => Persist::Uploading.as_str(),
        Ok(PersistState::Failed) => Persist::Failed.as_str(),
        Err(_) => "unknown",
    };
    let d = PyDict::new(py);
    d.set_item("path", &f.path)?;
    d.set_item("size", f.size)?;
    d.set_item("state", state)?;
    d.set_item("error", &f.error)?;
    d.set_item("holders", &f.holders)?;
    d.set_item("uploader", &f.uploader)?;
    d.set_item("write_id", &f.write_id)?;
    d.set_item("version", format!("{}{}", strata_common::block::WRITE_BACK_VERSION_PREFIX, f.write_id))?;
    d.set_item("committed", f.committed_unix_ms as f64 / 1000.0)?;
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

/// A connection to a Strata cluster (through its master's `host:port`). Weakly referable: the
/// Python layer keeps a weak set of clients to report their lineage at exit.
#[pyclass(module = "stratafs._native", frozen, weakref)]
struct Client {
    shared: Arc<Shared>,
}

#[pymethods]
impl Client {
    /// Connects at once, so a wrong address (or a refused token) fails here. `token`: the
    /// token to present; default `STRATA_TOKEN`, else the file `STRATA_TOKEN_FILE` names, else
    /// the admin token of a standalone started in the current directory. `qos`: `latency`, `throughput` or
    /// `background`; default `STRATA_QOS`, else `throughput`.
    #[new]
    #[pyo3(signature = (master, token=None, job=None, qos=None))]
    fn new(
        py: Python<'_>,
        master: String,
        token: Option<String>,
        job: Option<String>,
        qos: Option<String>,
    ) -> PyResult<Self> {
        let token = token.filter(|t| !t.is_empty());
        let job = job.map(|j| j.trim().to_string()).filter(|j| !j.is_empty());
        let qos = match qos.as_deref().map(str::trim).filter(|q| !q.is_empty()) {
            Some(q) => {
                Some(q.parse::<strata_client::QosClass>().map_err(|e| PyValueError::new_err(e.to_string()))?)
            }
            None => None,
        };
        let shared = Arc::new(Shared { master, token, job, qos, client: Mutex::new(None) });
        py.detach(|| shared.run(|_, _, _| Ok(())))?;
        Ok(Self { shared })
    }

    #[getter]
    fn master(&self) -> String {
        self.shared.master.clone()
    }

    /// The pid of the process whose runtime this client's connections belong to: this one once
    /// it was used here, None before (and after a fork, until its next call).
    fn runtime_pid(&self, py: Python<'_>) -> Option<u32> {
        py.detach(|| {
            process::guarded(|| {
                lock(&self.shared.client)
                    .as_ref()
                    .filter(|(g, _)| process::is_current(*g))
                    .map(|_| std::process::id())
            })
        })
    }

    #[pyo3(signature = (path, sync=false))]
    fn stat<'py>(&self, py: Python<'py>, path: &str, sync: bool) -> PyResult<Bound<'py, PyDict>> {
        let info =
            py.detach(|| self.shared.run(|rt, c, _| rt.block_on(c.stat_with(path, sync)).map_err(to_py)))?;
        info_dict(py, &info)
    }

    fn ls<'py>(&self, py: Python<'py>, path: &str) -> PyResult<Bound<'py, PyList>> {
        let entries = py.detach(|| self.shared.run(|rt, c, _| rt.block_on(c.list(path)).map_err(to_py)))?;
        let out = PyList::empty(py);
        for e in &entries {
            out.append(info_dict(py, e)?)?;
        }
        Ok(out)
    }

    /// One page of a directory's entries: `(entries, next_token)`, `next_token` None on the
    /// last page. Lets a Python caller walk a huge directory without holding it whole.
    #[pyo3(signature = (path, token="", page_size=0))]
    fn ls_page<'py>(
        &self,
        py: Python<'py>,
        path: &str,
        token: &str,
        page_size: u32,
    ) -> PyResult<(Bound<'py, PyList>, Option<String>)> {
        let (entries, next) = py.detach(|| {
            self.shared.run(|rt, c, _| rt.block_on(c.list_page(path, token, page_size)).map_err(to_py))
        })?;
        let out = PyList::empty(py);
        for e in &entries {
            out.append(info_dict(py, e)?)?;
        }
        Ok((out, next))
    }

    /// One page of every file under `path` (recursively, server side): `(entries, next_token)`.
    /// `with_dirs`: every directory too, on mounts listed directory by directory (a local
    /// directory), so empty ones are found.
    #[pyo3(signature = (path, token="", page_size=0, max_depth=0, with_dirs=false))]
    fn find_page<'py>(
        &self,
        py: Python<'py>,
        path: &str,
        token: &str,
        page_size: u32,
        max_depth: u32,
        with_dirs: bool,
    ) -> PyResult<(Bound<'py, PyList>, Option<String>)> {
        let (entries, next) = py.detach(|| {
            self.shared.run(|rt, c, _| {
                let page = if with_dirs {
                    rt.block_on(c.find_page_with_dirs(path, token, page_size, max_depth))
                } else {
                    rt.block_on(c.find_page(path, token, page_size, max_depth))
                };
                page.map_err(to_py)
            })
        })?;
        let out = PyList::empty(py);
        for e in &entries {
            out.append(info_dict(py, e)?)?;
        }
        Ok((out, next))
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
            let info = py
                .detach(|| self.shared.run(|rt, c, _| rt.block_on(c.stat_with(path, sync)).map_err(to_py)))?;
            if info.is_dir {
                return Err(PyIsADirectoryError::new_err(format!("is a directory: {}", info.path)));
            }
            let (offset, len) = byte_range(info.size, start, end);
            let mut changed = false;
            let result = bytes_filled(py, len, |buf| {
                self.shared.run(|rt, c, _| {
                    rt.block_on(c.read_into(&info, offset, buf)).map_err(|e| {
                        changed = matches!(e, ClientError::Changed(_));
                        to_py(e)
                    })
                })
            });
            match result {
                // Our idea of the version was stale: ask the UFS and read the new one whole.
                Err(_) if changed && !sync => sync = true,
                other => return other,
            }
        }
    }

    /// Many ranges at once: a list of `bytes`, or the first error (as `cat_many` reads them).
    fn cat_ranges<'py>(
        &self,
        py: Python<'py>,
        paths: Vec<String>,
        starts: Vec<Option<i64>>,
        ends: Vec<Option<i64>>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let read = self.read_ranges(py, paths, starts, ends)?;
        let mut out = Vec::with_capacity(read.len());
        for answer in read {
            out.push(PyBytes::new(py, &answer.map_err(to_py)?));
        }
        Ok(out)
    }

    /// Many ranges at once (fsspec's `cat_ranges`, and `cat` of many paths): their stats in
    /// `StatMany` calls, their bytes in `ReadMany` batches grouped by worker (the SDK's
    /// `stat_many` and `read_many`). One entry per path, in order: its `bytes`, or the
    /// exception reading it alone would raise, as an instance (not raised), so the caller
    /// applies fsspec's `on_error`. `start`/`end` as for `cat`; a file that changed since its
    /// stat is read again at its new version (an open-ended range to its new end).
    fn cat_many<'py>(
        &self,
        py: Python<'py>,
        paths: Vec<String>,
        starts: Vec<Option<i64>>,
        ends: Vec<Option<i64>>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let read = self.read_ranges(py, paths, starts, ends)?;
        let mut out = Vec::with_capacity(read.len());
        // One `Bytes` dropped as each `bytes` is made: the answers are held once, not twice.
        for answer in read {
            out.push(match answer {
                Ok(bytes) => PyBytes::new(py, &bytes).into_any(),
                Err(e) => to_py(e).into_value(py).into_bound(py).into_any(),
            });
        }
        Ok(out)
    }

    /// A seekable reader pinned to the current version of the file.
    fn open_read(&self, py: Python<'_>, path: &str) -> PyResult<Reader> {
        let info = py.detach(|| self.shared.run(|rt, c, _| rt.block_on(c.stat(path)).map_err(to_py)))?;
        if info.is_dir {
            return Err(PyIsADirectoryError::new_err(format!("is a directory: {}", info.path)));
        }
        Ok(Reader {
            shared: self.shared.clone(),
            info,
            state: Mutex::new(ReaderState { reader: None, pos: 0 }),
        })
    }

    /// A writer replacing the file when it is closed; with `append`, one whose bytes go after
    /// the file's (`io.UnsupportedOperation` where the mount cannot append).
    #[pyo3(signature = (path, append=false))]
    fn open_write(&self, py: Python<'_>, path: &str, append: bool) -> PyResult<Writer> {
        // A bad path is a ValueError of its own, not a refused append.
        strata_common::path::normalize(path).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let w = py.detach(|| {
            self.shared.run(|rt, c, generation| {
                let mut w = if append {
                    rt.block_on(c.append(path)).map_err(append_to_py)?
                } else {
                    rt.block_on(c.create(path)).map_err(to_py)?
                };
                let _in_runtime = rt.enter();
                w.park().map_err(to_py)?;
                Ok((generation, w))
            })
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
            self.shared.run(|rt, c, _| {
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
        })
    }

    /// Writes a local file to `rpath`; returns the new file's info.
    fn put_file<'py>(&self, py: Python<'py>, lpath: &str, rpath: &str) -> PyResult<Bound<'py, PyDict>> {
        let info = py.detach(|| {
            let mut src = File::open(lpath)?;
            self.shared.run(|rt, c, _| {
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
            })
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
            self.shared.run(|rt, c, _| {
                rt.block_on(async {
                    let mut w = c.create(path).await?;
                    w.write(bytes).await?;
                    w.close().await
                })
                .map_err(to_py)
            })
        })?;
        drop(data);
        info_dict(py, &info)
    }

    /// Makes `dst` a copy of the file `src` inside the cluster (no byte through this process,
    /// unless `dst` is on a write-back mount). Returns a dict: `by` ("ufs", "worker" or
    /// "client"), `bytes`, `worker` (the worker that made it, "" for "client").
    fn copy<'py>(&self, py: Python<'py>, src: &str, dst: &str) -> PyResult<Bound<'py, PyDict>> {
        let copied =
            py.detach(|| self.shared.run(|rt, c, _| rt.block_on(c.copy(src, dst)).map_err(to_py)))?;
        let d = PyDict::new(py);
        let by = match copied.by {
            strata_client::CopiedBy::Ufs => "ufs",
            strata_client::CopiedBy::Worker => "worker",
            strata_client::CopiedBy::Client => "client",
        };
        d.set_item("by", by)?;
        d.set_item("bytes", copied.bytes)?;
        d.set_item("worker", copied.worker)?;
        Ok(d)
    }

    /// Renames a file or a directory in place through the master (`dst` is the new path
    /// exactly). False when it cannot be done in place and nothing changed (another mount, a
    /// UFS that cannot rename, write-back files not yet uploaded): copy and delete instead.
    fn rename(&self, py: Python<'_>, src: &str, dst: &str) -> PyResult<bool> {
        py.detach(|| self.shared.run(|rt, c, _| rt.block_on(c.rename(src, dst)).map_err(to_py)))
    }

    #[pyo3(signature = (path, recursive=false))]
    fn rm(&self, py: Python<'_>, path: &str, recursive: bool) -> PyResult<()> {
        py.detach(|| self.shared.run(|rt, c, _| rt.block_on(c.delete(path, recursive)).map_err(to_py)))
    }

    fn mkdir(&self, py: Python<'_>, path: &str) -> PyResult<()> {
        py.detach(|| self.shared.run(|rt, c, _| rt.block_on(c.mkdir(path)).map_err(to_py)))
    }

    /// The write-back files at or under `path` not yet in the UFS (an empty list: all are), as
    /// dicts. `retry_failed` queues uploads that gave up again first. One master call: waiting
    /// is the caller's loop, so no section outlives a poll (a fork waits for sections).
    #[pyo3(signature = (path, retry_failed=false))]
    fn sync<'py>(&self, py: Python<'py>, path: &str, retry_failed: bool) -> PyResult<Bound<'py, PyList>> {
        let pending =
            py.detach(|| self.shared.run(|rt, c, _| rt.block_on(c.sync(path, retry_failed)).map_err(to_py)))?;
        let out = PyList::empty(py);
        for f in &pending {
            out.append(pending_dict(py, f)?)?;
        }
        Ok(out)
    }

    /// Pins the cached blocks under `path` in `tier` ("memory" or "nvme"), for `ttl_secs` (0:
    /// until unpinned). Returns the pin as a dict.
    #[pyo3(signature = (path, tier="nvme", ttl_secs=0.0))]
    fn pin<'py>(
        &self,
        py: Python<'py>,
        path: &str,
        tier: &str,
        ttl_secs: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let tier = strata_client::parse_pin_tier(tier).map_err(pyo3::exceptions::PyValueError::new_err)?;
        if !ttl_secs.is_finite() || ttl_secs < 0.0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "ttl {ttl_secs}: expected seconds >= 0"
            )));
        }
        let ttl = (ttl_secs > 0.0).then(|| std::time::Duration::from_secs_f64(ttl_secs));
        let p = py.detach(|| {
            self.shared.run(|rt, c, _| rt.block_on(c.admin().pin(path, tier, ttl)).map_err(to_py))
        })?;
        pin_dict(py, &p)
    }

    fn unpin<'py>(&self, py: Python<'py>, path: &str) -> PyResult<Bound<'py, PyDict>> {
        let p =
            py.detach(|| self.shared.run(|rt, c, _| rt.block_on(c.admin().unpin(path)).map_err(to_py)))?;
        pin_dict(py, &p)
    }

    /// `ttl_secs` 0 clears the path's own TTL.
    fn set_cache_ttl<'py>(&self, py: Python<'py>, path: &str, ttl_secs: f64) -> PyResult<Bound<'py, PyDict>> {
        if !ttl_secs.is_finite() || ttl_secs < 0.0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "ttl {ttl_secs}: expected seconds >= 0"
            )));
        }
        let ttl = (ttl_secs > 0.0).then(|| std::time::Duration::from_secs_f64(ttl_secs));
        let t = py.detach(|| {
            self.shared.run(|rt, c, _| rt.block_on(c.admin().set_cache_ttl(path, ttl)).map_err(to_py))
        })?;
        cache_ttl_dict(py, &t)
    }

    fn cache_ttls<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let ttls =
            py.detach(|| self.shared.run(|rt, c, _| rt.block_on(c.admin().cache_ttls()).map_err(to_py)))?;
        let out = PyList::empty(py);
        for t in &ttls {
            out.append(cache_ttl_dict(py, t)?)?;
        }
        Ok(out)
    }

    fn pins<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let pins = py.detach(|| self.shared.run(|rt, c, _| rt.block_on(c.admin().pins()).map_err(to_py)))?;
        let out = PyList::empty(py);
        for p in &pins {
            out.append(pin_dict(py, p)?)?;
        }
        Ok(out)
    }

    /// Drops the cached blocks under `path` from every worker; returns a dict of `blocks`,
    /// `bytes`, `workers` and `workers_done`.
    #[pyo3(signature = (path, wait_secs=10.0))]
    fn free<'py>(&self, py: Python<'py>, path: &str, wait_secs: f64) -> PyResult<Bound<'py, PyDict>> {
        let wait = std::time::Duration::from_secs_f64(wait_secs.clamp(0.001, 600.0));
        let r =
            py.detach(|| self.shared.run(|rt, c, _| rt.block_on(c.admin().free(path, wait)).map_err(to_py)))?;
        let d = PyDict::new(py);
        d.set_item("blocks", r.blocks)?;
        d.set_item("bytes", r.bytes)?;
        d.set_item("workers", r.workers)?;
        d.set_item("workers_done", r.workers_done)?;
        d.set_item("pending", r.workers_pending)?;
        Ok(d)
    }

    /// What this process's client served while the master was unreachable: stale stats and
    /// listing pages, stats workers made, outages, and whether it started from a worker's view.
    fn outage_counters(&self, py: Python<'_>) -> PyResult<std::collections::HashMap<&'static str, u64>> {
        py.detach(|| {
            self.shared.run(|_, c, _| {
                let o = c.outage_counters();
                Ok([
                    ("stale_stats", o.stale_stats),
                    ("stale_listings", o.stale_listings),
                    ("worker_stats", o.worker_stats),
                    ("outages", o.outages),
                    ("started_from_worker", o.started_from_worker),
                ]
                .into())
            })
        })
    }

    /// How this process's client read blocks: by mapping a descriptor a worker on this host
    /// (or the sidecar) passed, from another worker after the owner failed, hedged, and sent
    /// first to a read replica on this node.
    fn read_counters(&self, py: Python<'_>) -> PyResult<std::collections::HashMap<&'static str, u64>> {
        py.detach(|| {
            self.shared.run(|_, c, _| {
                Ok([
                    ("short_circuit_reads", c.short_circuit_reads()),
                    ("short_circuit_declined", c.short_circuit_fallbacks().declined),
                    ("short_circuit_failed", c.short_circuit_fallbacks().failed),
                    ("failovers", c.failovers()),
                    ("hedged_reads", c.hedged_reads()),
                    ("local_reads", c.local_reads()),
                    ("lineage_reported", c.lineage_counters().reported),
                    ("lineage_dropped", c.lineage_counters().dropped),
                    ("lineage_pending", c.lineage_counters().pending),
                ]
                .into())
            })
        })
    }

    /// Tells the workers that `paths`, in this order, are what `stream` reads next (its whole
    /// window, replacing the previous one; empty clears it). Returns (queued blocks, unknown
    /// paths skipped, workers told).
    fn prefetch(&self, py: Python<'_>, stream: u64, paths: Vec<String>) -> PyResult<(u64, u64, usize)> {
        py.detach(|| {
            self.shared.run(|rt, c, _| {
                let refs: Vec<&str> = paths.iter().map(String::as_str).collect();
                let done = rt.block_on(c.prefetch(stream, &refs)).map_err(to_py)?;
                Ok((done.queued, done.unknown, done.workers))
            })
        })
    }

    /// The request class of this client's reads (`latency`, `throughput`, `background`).
    #[getter]
    fn qos(&self, py: Python<'_>) -> PyResult<String> {
        py.detach(|| self.shared.run(|_, c, _| Ok(c.qos().as_str().to_string())))
    }

    /// The job this client's reads are recorded under; None: anonymous.
    #[getter]
    fn job(&self, py: Python<'_>) -> PyResult<Option<String>> {
        py.detach(|| self.shared.run(|_, c, _| Ok(c.job().map(String::from))))
    }

    /// Marks a point in this client's job; its reads so far are reported first. Returns
    /// (seq, label, at_ms).
    fn lineage_mark(&self, py: Python<'_>, label: &str) -> PyResult<(u64, String, i64)> {
        py.detach(|| {
            self.shared.run(|rt, c, _| {
                let mark = rt.block_on(c.lineage_mark(label)).map_err(to_py)?;
                Ok((mark.seq, mark.label, mark.at_ms))
            })
        })
    }

    /// Reports this process's recorded reads now, if its client was used in this process (a
    /// forked child that never read has nothing to report, and no connection is made).
    fn lineage_flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            let used_here = process::guarded(|| {
                lock(&self.shared.client).as_ref().is_some_and(|(g, c)| {
                    process::is_current(*g) || (process::is_shut_down(*g) && c.lineage_counters().pending > 0)
                })
            });
            if !used_here {
                return Ok(());
            }
            self.shared.run(|rt, c, _| rt.block_on(c.flush_lineage()).map_err(to_py))
        })
    }

    /// What `job` read: {"job", "marks": [(seq, label, at_ms)], "records": [dict]} (see
    /// docs/LINEAGE.md), from the mark `since` names on.
    #[pyo3(signature = (job, since=""))]
    fn lineage_job<'py>(&self, py: Python<'py>, job: &str, since: &str) -> PyResult<Bound<'py, PyDict>> {
        let found =
            py.detach(|| self.shared.run(|rt, c, _| rt.block_on(c.lineage_job(job, since)).map_err(to_py)))?;
        let d = PyDict::new(py);
        d.set_item("job", &found.job)?;
        let marks: Vec<(u64, String, i64)> =
            found.marks.into_iter().map(|m| (m.seq, m.label, m.at_ms)).collect();
        d.set_item("marks", marks)?;
        let records = PyList::empty(py);
        for r in found.records {
            let rd = PyDict::new(py);
            rd.set_item("path", r.path)?;
            rd.set_item("version", r.version)?;
            rd.set_item("ufs", r.ufs)?;
            rd.set_item("bytes", r.bytes)?;
            rd.set_item("reads", r.reads)?;
            rd.set_item("first_read_ms", r.first_read_ms)?;
            rd.set_item("last_read_ms", r.last_read_ms)?;
            rd.set_item("mark", r.mark_seq)?;
            rd.set_item("reader", r.reader)?;
            records.append(rd)?;
        }
        d.set_item("records", records)?;
        Ok(d)
    }

    /// Worker ids that hold (first) each block of a file, from the placement ring: the same
    /// in every process that sees the same membership.
    fn placement(&self, py: Python<'_>, path: &str) -> PyResult<Vec<String>> {
        py.detach(|| {
            self.shared.run(|rt, c, _| {
                rt.block_on(async {
                    let info = c.stat(path).await?;
                    let ring = c.ring().await?;
                    let blocks = strata_common::block::block_count(info.size, info.block_size);
                    Ok((0..blocks)
                        .map(|i| {
                            let key =
                                strata_common::BlockKey::new(info.file_id.clone(), info.version.clone(), i);
                            ring.owners(key.placement_hash(), 1)
                                .first()
                                .map_or(String::new(), |m| m.id.clone())
                        })
                        .collect())
                })
                .map_err(to_py)
            })
        })
    }
}

impl Client {
    /// The ranges of `cat_many` (one answer per path, in order), read without the GIL.
    fn read_ranges(
        &self,
        py: Python<'_>,
        paths: Vec<String>,
        starts: Vec<Option<i64>>,
        ends: Vec<Option<i64>>,
    ) -> PyResult<Vec<Result<bytes::Bytes, ClientError>>> {
        if paths.len() != starts.len() || paths.len() != ends.len() {
            return Err(PyValueError::new_err("paths, starts and ends must have the same length"));
        }
        py.detach(|| {
            self.shared.run(|rt, c, _| {
                Ok(rt.block_on(async {
                    let asked: Vec<&str> = paths.iter().map(String::as_str).collect();
                    let mut specs = Vec::with_capacity(paths.len());
                    // Per path: the index of its read, or why it has none.
                    let mut slots = Vec::with_capacity(paths.len());
                    for (i, stat) in c.stat_many(&asked).await.into_iter().enumerate() {
                        match stat {
                            Ok(info) => {
                                let (offset, len) = byte_range(info.size, starts[i], ends[i]);
                                let len = if ends[i].is_none() { u64::MAX } else { len };
                                slots.push(Ok(specs.len()));
                                specs.push(ReadSpec { info, offset, len });
                            }
                            Err(e) => slots.push(Err(e)),
                        }
                    }
                    let mut read: Vec<_> = c.read_many(&specs).await.into_iter().map(Some).collect();
                    slots
                        .into_iter()
                        .map(|slot| match slot {
                            Ok(k) => read[k].take().expect("one read per spec"),
                            Err(e) => Err(e),
                        })
                        .collect()
                }))
            })
        })
    }
}

struct ReaderState {
    /// The streaming reader and the runtime generation it belongs to (rebuilt at `pos` in a
    /// new one).
    reader: Option<(u64, StrataReader)>,
    pos: u64,
}

impl Drop for ReaderState {
    fn drop(&mut self) {
        if let Some((g, r)) = self.reader.take() {
            process::dispose(g, r);
        }
    }
}

impl ReaderState {
    /// The streaming reader of this generation. Inside a section.
    fn reader(
        &mut self,
        info: &FileInfo,
        client: &strata_client::Client,
        generation: u64,
    ) -> PyResult<&mut StrataReader> {
        if let Some((g, old)) = self.reader.take_if(|(g, _)| *g != generation) {
            // Its readahead tasks and connections belonged to a runtime that is gone.
            process::dispose(g, old);
        }
        if self.reader.is_none() {
            let mut r = client.reader_of(info.clone());
            std::pin::Pin::new(&mut r).start_seek(std::io::SeekFrom::Start(self.pos))?;
            self.reader = Some((generation, r));
        }
        Ok(&mut self.reader.as_mut().expect("just set").1)
    }
}

/// A file open for reading: one version, block-aligned fetches, readahead when sequential.
#[pyclass(module = "stratafs._native", frozen)]
struct Reader {
    shared: Arc<Shared>,
    info: FileInfo,
    state: Mutex<ReaderState>,
}

impl Reader {
    /// Fills `buf` from the current position (less at the end of the file); returns the count.
    /// Without the GIL.
    fn read_into(&self, buf: &mut [u8]) -> PyResult<usize> {
        self.shared.run(|rt, c, generation| {
            let mut s = lock(&self.state);
            let r = s.reader(&self.info, c, generation)?;
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
            s.pos += n as u64;
            Ok(n)
        })
    }

    /// The position, read without the GIL (a read in another thread holds the state).
    fn position(&self, py: Python<'_>) -> u64 {
        py.detach(|| process::guarded(|| lock(&self.state).pos))
    }
}

#[pymethods]
impl Reader {
    #[getter]
    fn size(&self) -> u64 {
        self.info.size
    }

    #[getter]
    fn version(&self) -> String {
        self.info.version.clone()
    }

    fn tell(&self, py: Python<'_>) -> u64 {
        self.position(py)
    }

    /// Moves to `offset` relative to `whence` (0 start, 1 current, 2 end).
    #[pyo3(signature = (offset, whence=0))]
    fn seek(&self, py: Python<'_>, offset: i64, whence: i32) -> PyResult<u64> {
        let size = self.info.size;
        py.detach(|| {
            process::guarded(|| {
                let mut s = lock(&self.state);
                let base = match whence {
                    0 => 0,
                    1 => s.pos as i64,
                    2 => size as i64,
                    _ => return Err(PyValueError::new_err(format!("invalid whence ({whence})"))),
                };
                let target = base.checked_add(offset).filter(|t| *t >= 0).ok_or_else(|| {
                    PyValueError::new_err(format!("negative seek position {}", base.saturating_add(offset)))
                })? as u64;
                s.pos = target;
                if let Some((g, r)) = s.reader.as_mut()
                    && process::is_current(*g)
                {
                    // Only moves the reader's position: blocks are fetched at the next read.
                    std::pin::Pin::new(r).start_seek(std::io::SeekFrom::Start(target))?;
                }
                Ok(target)
            })
        })
    }

    /// Up to `size` bytes (all the rest when negative) as `bytes`.
    #[pyo3(signature = (size=-1))]
    fn read<'py>(&self, py: Python<'py>, size: i64) -> PyResult<Bound<'py, PyBytes>> {
        let left = self.info.size.saturating_sub(self.position(py));
        let want = if size < 0 { left } else { (size as u64).min(left) };
        let mut got = 0;
        let b = bytes_filled(py, want, |buf| {
            got = self.read_into(buf)?;
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
            self.read_into(buf)
        })?;
        drop(buffer);
        Ok(n)
    }

    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            process::guarded(|| {
                if let Some((g, r)) = lock(&self.state).reader.take() {
                    // Aborts its readahead tasks (when they are of this process's runtime).
                    process::dispose(g, r);
                }
            })
        })
    }
}

/// A file open for writing: the bytes stream to a worker, which writes the UFS; the file is
/// replaced when `close` succeeds. Between calls its connection is parked (not registered with
/// any runtime), so it survives the runtime's shutdown before a fork in this process; in a
/// forked child it refuses to be used.
#[pyclass(module = "stratafs._native", frozen)]
struct Writer {
    shared: Arc<Shared>,
    /// The process that opened it.
    pid: u32,
    path: String,
    /// The writer and the runtime generation of the client it uses.
    inner: Mutex<Option<(u64, StrataWriter)>>,
}

impl Writer {
    fn check_process(&self) -> PyResult<()> {
        if std::process::id() != self.pid {
            return Err(PyOSError::new_err(format!(
                "{} was opened for writing in another process (before a fork); open it again here",
                self.path
            )));
        }
        Ok(())
    }

    /// Runs `f` on the writer inside a section, its connection attached for the call and
    /// parked again after. Without the GIL.
    fn with<T>(&self, f: impl FnOnce(&Runtime, &mut StrataWriter) -> Result<T, ClientError>) -> PyResult<T> {
        self.check_process()?;
        self.shared.run(|rt, c, generation| {
            let mut guard = lock(&self.inner);
            let (g, w) =
                guard.as_mut().ok_or_else(|| PyValueError::new_err("I/O operation on closed file"))?;
            if *g != generation {
                let old = w.rebind(c.clone());
                process::dispose(std::mem::replace(g, generation), old);
            }
            let out = f(rt, w);
            // A write to several workers queues frames to tasks of the runtime: they must be
            // sent, and the connections back with the writer, before it is parked.
            let settled = rt.block_on(w.settle());
            let _in_runtime = rt.enter();
            let parked = w.park();
            let out = out.map_err(to_py)?;
            settled.map_err(to_py)?;
            parked.map_err(to_py)?;
            Ok(out)
        })
    }

    /// Drops the writer: sends nothing, so the old file stays. Inside a section.
    fn discard(&self) {
        let taken = lock(&self.inner).take();
        if let Some((g, mut w)) = taken {
            if std::process::id() == self.pid {
                w.abort();
            }
            process::dispose(g, w);
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if let Some((g, w)) = self.inner.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            process::dispose(g, w);
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
    fn written(&self, py: Python<'_>) -> u64 {
        py.detach(|| process::guarded(|| lock(&self.inner).as_ref().map_or(0, |(_, w)| w.written())))
    }

    /// Commits the file; returns its new info.
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let info = py.detach(|| {
            let info = self.with(|rt, w| rt.block_on(w.close()));
            if std::process::id() == self.pid {
                // Closed for good, committed or not (a failed close cannot be retried).
                process::guarded(|| self.discard());
            }
            info
        })?;
        info_dict(py, &info)
    }

    /// Drops what was written; the old file stays.
    fn abort(&self, py: Python<'_>) {
        py.detach(|| process::guarded(|| self.discard()))
    }
}

/// Generation of this process's runtime (for tests: it changes when a fork shut it down).
#[pyfunction]
fn runtime_generation() -> u64 {
    process::generation()
}

/// Whether this process has a running I/O runtime now (for tests).
#[pyfunction]
fn runtime_running(py: Python<'_>) -> bool {
    py.detach(process::runtime_running)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Client>()?;
    m.add_class::<Reader>()?;
    m.add_class::<Writer>()?;
    m.add_function(wrap_pyfunction!(runtime_generation, m)?)?;
    m.add_function(wrap_pyfunction!(runtime_running, m)?)?;
    // The CLI's default too: one constant, so the two cannot drift apart.
    m.add("DEFAULT_MASTER", strata_common::DEFAULT_MASTER_ADDR)?;
    process::register(m)
}
