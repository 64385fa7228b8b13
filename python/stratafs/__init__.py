"""fsspec filesystem for Strata: ``strata://mount/path``.

Every method below goes to the Strata cluster through the Rust client (``stratafs._native``):
placement on the consistent-hash ring, parallel block reads, readahead, failover. Nothing falls
back to another filesystem. ``find`` (and so ``glob`` and ``du``) is one paged recursive
listing by the master; ``walk`` is fsspec's generic algorithm over this filesystem's ``ls``,
which the master answers page by page.

``strata://data/x.bin`` and ``strata:///data/x.bin`` both name ``/data/x.bin``: the first
component is the mount, as a bucket is for s3fs.
"""

from __future__ import annotations

import errno
import io
import os
import time
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from . import _native

__all__ = ["StrataFileSystem", "StrataReadFile", "StrataWriteFile"]

DEFAULT_MASTER: str = _native.DEFAULT_MASTER
# How long `sync(wait=True)` and a `wait_persisted` close wait for uploads by default (seconds).
DEFAULT_PERSIST_TIMEOUT: float = 600.0
# "The filesystem's setting" for keyword arguments where None means something (no limit).
_FS_DEFAULT = object()


class StrataFileSystem(AbstractFileSystem):
    """A Strata cluster as an fsspec filesystem.

    ``master`` is the master's ``host:port``, or the masters of a highly available cluster as a
    comma-separated list (calls follow the leader); it defaults to ``$STRATA_MASTER``, then
    ``127.0.0.1:19998`` (as for the ``strata`` CLI). ``token`` is the token to present (see
    docs/SECURITY.md); it defaults to ``$STRATA_TOKEN``, then the file ``$STRATA_TOKEN_FILE``
    names, then a standalone's ``.strata/admin.token`` (under ``$STRATA_DIR`` when set).

    ``wait_persisted`` makes every file written (``open(..., "wb")`` at ``close``, ``pipe_file``,
    ``put_file``) wait until it is in the UFS (on a ``mode=write-back`` mount a write returns once
    the workers' journals hold it; the upload follows), for up to ``persist_timeout`` seconds
    (None: no limit). The same keywords given to ``open``, ``pipe_file`` or ``put_file``
    override them for that file.

    The instance may be created before ``fork`` (PyTorch DataLoader workers, multiprocessing
    pools) and used in the children: each process builds its own runtime and connections on
    first use.
    """

    protocol = "strata"
    root_marker = "/"
    # Metadata is cached by the Rust client and the master for the mount's TTL, and dropped on
    # writes; fsspec's own listings cache would keep stale entries longer.
    cachable = True

    def __init__(self, master: str | None = None, token: str | None = None, wait_persisted: bool = False,
                 persist_timeout: float | None = DEFAULT_PERSIST_TIMEOUT, **kwargs: Any):
        kwargs.pop("use_listings_cache", None)
        super().__init__(use_listings_cache=False, **kwargs)
        self.master = master or os.environ.get("STRATA_MASTER") or DEFAULT_MASTER
        self.wait_persisted = bool(wait_persisted)
        self.persist_timeout = persist_timeout
        self._client = _native.Client(self.master, token)

    # ---- paths ----

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        if path.startswith("strata://"):
            path = path[len("strata://"):]
        elif path.startswith("strata:"):
            path = path[len("strata:"):]
        path = "/" + path.lstrip("/")
        if len(path) > 1:
            path = path.rstrip("/")
        return path

    @staticmethod
    def _get_kwargs_from_urls(path):
        return {}

    def unstrip_protocol(self, name: str) -> str:
        return "strata://" + name.lstrip("/")

    # ---- metadata ----

    def ls(self, path, detail=True, **kwargs):
        entries = self._client.ls(self._strip_protocol(path))
        return entries if detail else [e["name"] for e in entries]

    def ls_iter(self, path):
        """A directory's entries page by page (detail dicts): for directories too large to list
        at once."""
        path = self._strip_protocol(path)
        token = ""
        while True:
            page, token = self._client.ls_page(path, token)
            yield from page
            if not token:
                return

    def _find_iter(self, path, max_depth=0):
        token = ""
        while True:
            page, token = self._client.find_page(path, token, 0, max_depth)
            yield from page
            if not token:
                return

    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kwargs):
        """Every file under ``path``, as fsspec's ``find``, listed by the master in one paged
        stream (``glob`` and ``du`` use it too) instead of one listing per directory.

        Directories (``withdirs``) are the parents of the files found: a directory with no file
        anywhere below it is not listed (object stores have no such directories anyway)."""
        path = self._strip_protocol(path)
        if maxdepth is not None and maxdepth < 1:
            raise ValueError("maxdepth must be at least 1")
        try:
            root = self.info(path)
        except FileNotFoundError:
            return {} if detail else []
        out = {}
        if root["type"] == "file":
            out[path] = root
        else:
            if withdirs and path != "/":
                out[path] = root
            base = path.rstrip("/")
            # Directories deeper than maxdepth still matter for the parents they imply.
            server_depth = 0 if withdirs else (maxdepth or 0)
            for info in self._find_iter(path, server_depth):
                name = info["name"]
                parts = name[len(base) + 1:].split("/")
                if maxdepth is None or len(parts) <= maxdepth:
                    out[name] = info
                if withdirs:
                    for d in range(1, len(parts) if maxdepth is None else min(len(parts), maxdepth + 1)):
                        dname = base + "/" + "/".join(parts[:d])
                        if dname not in out:
                            out[dname] = {"name": dname, "size": 0, "type": "directory"}
        names = sorted(out)
        return {n: out[n] for n in names} if detail else names

    def du(self, path, total=True, maxdepth=None, withdirs=False, **kwargs):
        """Bytes used under ``path``, as fsspec's ``du``, from the sizes the paged ``find``
        already carries (fsspec's generic ``du`` asks ``info`` once per file)."""
        sizes = {}
        if withdirs and self.isdir(path):
            info = self.info(path)
            sizes[info["name"]] = info["size"]
        found = self.find(path, maxdepth=maxdepth, withdirs=withdirs, detail=True, **kwargs)
        for name, info in found.items():
            sizes[name] = info["size"]
        return sum(sizes.values()) if total else sizes

    def info(self, path, **kwargs):
        return self._client.stat(self._strip_protocol(path), bool(kwargs.get("refresh", False)))

    def exists(self, path, **kwargs):
        try:
            self.info(path)
            return True
        except FileNotFoundError:
            return False

    def isdir(self, path):
        try:
            return self.info(path)["type"] == "directory"
        except FileNotFoundError:
            return False

    def isfile(self, path):
        try:
            return self.info(path)["type"] == "file"
        except FileNotFoundError:
            return False

    def size(self, path):
        return self.info(path)["size"]

    def ukey(self, path):
        """The file's UFS version (ETag, or mtime+size): changes exactly when the file does."""
        info = self.info(path)
        return f"{info['name']}@{info['version']}:{info['size']}"

    def checksum(self, path):
        return int.from_bytes(
            __import__("hashlib").sha256(self.ukey(path).encode()).digest()[:8], "big"
        )

    # ---- cache control ----

    def pin(self, path, tier="nvme", ttl=None):
        """Pins the cached blocks of the files under ``path`` in ``tier`` ("memory" or "nvme")
        of every worker: eviction passes over them. ``ttl`` (seconds) unpins by itself after
        that long; None keeps the pin until ``unpin``. Returns the pin as a dict (``path``,
        ``tier``, ``bytes``, ``created``, ``expires``). Raises ``OSError`` (ENOSPC) when the
        tier's pins would exceed its capacity across the live workers."""
        return self._client.pin(self._strip_protocol(path), tier, float(ttl or 0))

    def unpin(self, path):
        """Removes the pin of exactly ``path``; ``FileNotFoundError`` if there is none."""
        return self._client.unpin(self._strip_protocol(path))

    def pins(self):
        """Every pin, as dicts (see ``pin``)."""
        return self._client.pins()

    def set_cache_ttl(self, path, ttl):
        """Workers drop the cached blocks of the files under ``path`` ``ttl`` seconds after they
        stored them, whatever the mount's ``cache_ttl``; ``ttl=None`` clears the path's own TTL
        (``FileNotFoundError`` if it has none). Returns ``{"path", "ttl", "created"}``."""
        return self._client.set_cache_ttl(self._strip_protocol(path), float(ttl or 0))

    def cache_ttls(self):
        """Every path's own cache TTL, as dicts (see ``set_cache_ttl``)."""
        return self._client.cache_ttls()

    def free(self, path, wait=10.0):
        """Drops the cached blocks of the files under ``path`` from every worker now (waiting up
        to ``wait`` seconds for all of them); nothing is read from the UFS until they are read
        again. Returns a dict: ``blocks``, ``bytes``, ``workers``, ``workers_done``."""
        return self._client.free(self._strip_protocol(path), float(wait))

    # ---- write-back ----

    def sync(self, path, wait=False, timeout=DEFAULT_PERSIST_TIMEOUT, retry_failed=False):
        """The files written to ``mode=write-back`` mounts at or under ``path`` that are not in
        the UFS yet, as a list of dicts: ``path``, ``size``, ``state`` ("pending", "uploading"
        or "failed"), ``error`` (why the last upload attempt failed, "" if none), ``holders``
        (the worker ids whose journals hold it), ``uploader``, ``version`` (what ``info`` shows
        until the upload), ``write_id``, ``committed`` (Unix seconds). An empty list: every one
        is in the UFS. ``retry_failed`` queues uploads that gave up again.

        With ``wait=True``: queues failed uploads again once, then blocks until every such file
        is in the UFS and returns an empty list. Raises ``OSError`` (errno EIO) naming the file
        and the UFS's reason if an upload gives up, ``TimeoutError`` naming what is still
        pending after ``timeout`` seconds (None: no limit), ``KeyboardInterrupt`` at Ctrl-C.
        Polls the master (from 20 ms up to every 0.5 s); nothing runs between polls, so forks and
        other threads go on."""
        path = self._strip_protocol(path)
        if not wait:
            return self._client.sync(path, bool(retry_failed))
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = self._client.sync(path, True)
        delay = 0.02
        while pending:
            failed = next((f for f in pending if f["state"] == "failed"), None)
            if failed is not None:
                raise OSError(errno.EIO, f"upload to the UFS failed: {failed['error'] or 'no reason given'} "
                              f"(the file is still held by workers {', '.join(failed['holders'])}; "
                              f"fs.sync(path, wait=True) tries again)", failed["path"])
            if deadline is not None and time.monotonic() + delay > deadline:
                first = pending[0]
                last = f", last error: {first['error']}" if first["error"] else ""
                raise TimeoutError(
                    f"{len(pending)} file(s) at or under {path} still not in the UFS after {timeout} s "
                    f"(e.g. {first['path']}: {first['state']}{last})")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            pending = self._client.sync(path, False)
        return []

    def outage_counters(self):
        """What this process served while the master was unreachable (docs/METRICS.md): a dict
        of stale_stats, stale_listings, worker_stats, outages, started_from_worker."""
        return self._client.outage_counters()

    def placement(self, path):
        """Worker id that owns each block of a file on the placement ring (for diagnostics)."""
        return self._client.placement(self._strip_protocol(path))

    # ---- reads ----

    def cat_file(self, path, start=None, end=None, **kwargs):
        return self._client.cat(self._strip_protocol(path), start, end)

    def cat_ranges(self, paths, starts, ends, max_gap=None, on_error="return", **kwargs):
        if isinstance(starts, int):
            starts = [starts] * len(paths)
        if isinstance(ends, int):
            ends = [ends] * len(paths)
        if len(starts) != len(paths) or len(ends) != len(paths):
            raise ValueError("paths, starts and ends must have the same length")
        paths = [self._strip_protocol(p) for p in paths]
        try:
            return self._client.cat_ranges(paths, list(starts), list(ends))
        except Exception:
            if on_error != "return":
                raise
        # One failed: redo them one by one so each gets its own result or exception.
        out = []
        for p, s, e in zip(paths, starts, ends):
            try:
                out.append(self._client.cat(p, s, e))
            except Exception as exc:  # noqa: BLE001 - fsspec's contract: return the exception
                out.append(exc)
        return out

    def get_file(self, rpath, lpath, callback=None, outfile=None, **kwargs):
        rpath = self._strip_protocol(rpath)
        if self.isdir(rpath):
            os.makedirs(lpath, exist_ok=True)
            return None
        if outfile is not None:
            with self.open(rpath, "rb") as f:
                while chunk := f.read(8 << 20):
                    outfile.write(chunk)
            return None
        parent = os.path.dirname(os.path.abspath(lpath))
        os.makedirs(parent, exist_ok=True)
        n = self._client.get_file(rpath, os.fspath(lpath))
        if callback is not None:
            callback.set_size(n)
            callback.relative_update(n)
        return None

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        path = self._strip_protocol(path)
        if mode == "rb":
            return StrataReadFile(self, path, block_size)
        if mode in ("wb", "xb"):
            if mode == "xb" and self.exists(path):
                raise FileExistsError(path)
            return StrataWriteFile(self, path, wait_persisted=kwargs.get("wait_persisted"),
                                   persist_timeout=kwargs.get("persist_timeout", _FS_DEFAULT))
        raise ValueError(f"unsupported mode {mode!r} (strata files are 'rb' or 'wb')")

    # ---- writes (mounts with mode=write-through or mode=write-back) ----

    def _written(self, info, wait_persisted=None, persist_timeout=_FS_DEFAULT, **_):
        """After a file was written (its info): waits for its upload when asked (the call's
        ``wait_persisted`` and ``persist_timeout``, else the filesystem's); returns its info
        then."""
        wait = self.wait_persisted if wait_persisted is None else bool(wait_persisted)
        if not wait or info["persist"] == "persisted":
            return info
        timeout = self.persist_timeout if persist_timeout is _FS_DEFAULT else persist_timeout
        self.sync(info["name"], wait=True, timeout=timeout)
        return self.info(info["name"])

    def put_file(self, lpath, rpath, callback=None, **kwargs):
        """Writes a local file (on a write-back mount, waits for its upload if
        ``wait_persisted``: the keyword or the filesystem's default)."""
        rpath = self._strip_protocol(rpath)
        if os.path.isdir(lpath):
            self.makedirs(rpath, exist_ok=True)
            return None
        info = self._client.put_file(os.fspath(lpath), rpath)
        if callback is not None:
            callback.set_size(info["size"])
            callback.relative_update(info["size"])
        self._written(info, **kwargs)
        return None

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        """Writes ``value`` as the whole file (waits for its upload as ``put_file`` does)."""
        path = self._strip_protocol(path)
        if mode == "create" and self.exists(path):
            raise FileExistsError(path)
        self._written(self._client.pipe(path, value), **kwargs)

    def rm_file(self, path):
        self._client.rm(self._strip_protocol(path), False)

    def _rm(self, path):
        self.rm_file(path)

    def rm(self, path, recursive=False, maxdepth=None):
        paths = path if isinstance(path, list) else [path]
        for p in paths:
            p = self._strip_protocol(p)
            if maxdepth is None and not any(c in p for c in "*?["):
                self._client.rm(p, bool(recursive))
                continue
            # Globs and depth limits: expand with our own find, deepest first.
            for q in sorted(self.expand_path(p, recursive=recursive, maxdepth=maxdepth), reverse=True):
                self._client.rm(q, bool(recursive))

    def mkdir(self, path, create_parents=True, **kwargs):
        path = self._strip_protocol(path)
        if not create_parents and not self.exists(self._parent(path)):
            raise FileNotFoundError(self._parent(path))
        self._client.mkdir(path)

    def makedirs(self, path, exist_ok=False):
        path = self._strip_protocol(path)
        if not exist_ok and self.exists(path):
            raise FileExistsError(path)
        self._client.mkdir(path)

    def rmdir(self, path):
        self._client.rm(self._strip_protocol(path), False)

    def invalidate_cache(self, path=None):
        # Nothing cached at this layer (see `use_listings_cache` above).
        pass


class StrataReadFile(AbstractBufferedFile):
    """A Strata file open for reading: seekable, pinned to the version it was opened at,
    block-aligned fetches with readahead on sequential reads, zero-copy ``readinto``.

    Reads go to the native reader. An ``AbstractBufferedFile`` all the same, so fsspec's
    ``blockcache``/``filecache`` chains, which put their own cache in front of ``_fetch_range``,
    work: once a chain has replaced ``cache``, reads go through it."""

    def __init__(self, fs: StrataFileSystem, path: str, block_size=None, cache_options=None, **kwargs):
        self._r = fs._client.open_read(path)
        super().__init__(fs, path, mode="rb", block_size=block_size or (4 << 20), cache_type="none",
                         size=self._r.size, cache_options=cache_options)
        self._own_cache = self.cache
        self.version = self._r.version

    def _chained(self):
        return self.cache is not self._own_cache

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        if self.closed:
            raise ValueError("I/O operation on closed file")
        return self._r.tell()

    def seek(self, loc, whence=io.SEEK_SET):
        if self.closed:
            raise ValueError("I/O operation on closed file")
        self.loc = self._r.seek(loc, whence)
        return self.loc

    def read(self, length=-1):
        if self.closed:
            raise ValueError("I/O operation on closed file")
        length = -1 if length is None else length
        if self._chained():
            self.loc = self._r.tell()
            out = super().read(length)
            self._r.seek(self.loc)
            return out
        out = self._r.read(length)
        self.loc = self._r.tell()
        return out

    def readinto(self, b):
        if self.closed:
            raise ValueError("I/O operation on closed file")
        if self._chained():
            data = self.read(memoryview(b).nbytes)
            memoryview(b).cast("B")[: len(data)] = data
            return len(data)
        n = self._r.readinto(b)
        self.loc = self._r.tell()
        return n

    def readall(self):
        return self.read(-1)

    def _fetch_range(self, start, end):
        return self.fs.cat_file(self.path, start, end)

    def close(self):
        if not self.closed:
            self._r.close()
        super().close()


class StrataWriteFile(io.RawIOBase):
    """A Strata file open for writing: the bytes stream through a worker to the UFS (on a
    write-back mount, to the journals of ``write_replicas`` workers), and the file is replaced
    when ``close`` succeeds. Leaving a ``with`` block by an exception aborts (the old file stays).

    ``wait_persisted`` and ``persist_timeout`` (default: the filesystem's) make ``close`` also
    wait until the file is in the UFS, as ``fs.sync(path, wait=True, timeout=persist_timeout)``;
    if that fails, ``close`` raises its ``OSError``/``TimeoutError``, and the file stays written
    (the workers hold it and go on uploading)."""

    def __init__(self, fs: StrataFileSystem, path: str, wait_persisted: bool | None = None,
                 persist_timeout: Any = _FS_DEFAULT):
        super().__init__()
        self.fs = fs
        self.path = path
        self.mode = "wb"
        self.wait_persisted = fs.wait_persisted if wait_persisted is None else bool(wait_persisted)
        self.persist_timeout = fs.persist_timeout if persist_timeout is _FS_DEFAULT else persist_timeout
        self._w = fs._client.open_write(path)
        self.info_after_close = None

    @property
    def name(self):
        return self.path

    def writable(self):
        return True

    def tell(self):
        return self._w.written

    def write(self, b):
        if self.closed:
            raise ValueError("I/O operation on closed file")
        return self._w.write(b)

    def flush(self):
        # Bytes are on their way to the worker already; the file appears at close.
        pass

    def close(self):
        if self.closed:
            return
        try:
            self.info_after_close = self._w.close()
        finally:
            super().close()
        self.info_after_close = self.fs._written(self.info_after_close, self.wait_persisted, self.persist_timeout)

    def discard(self):
        if not self.closed:
            self._w.abort()
            super().close()

    def __del__(self):
        # Never commit a file nobody closed: a half-written file must not replace the old one.
        try:
            self.discard()
        except Exception:  # noqa: BLE001 - nothing to report to at garbage collection
            pass

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.discard()
            return False
        self.close()
        return False
