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

import io
import os
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from . import _native

__all__ = ["StrataFileSystem", "StrataReadFile", "StrataWriteFile"]

DEFAULT_MASTER: str = _native.DEFAULT_MASTER


class StrataFileSystem(AbstractFileSystem):
    """A Strata cluster as an fsspec filesystem.

    ``master`` is the master's ``host:port``, or the masters of a highly available cluster as a
    comma-separated list (calls follow the leader); it defaults to ``$STRATA_MASTER``, then
    ``127.0.0.1:19998`` (as for the ``strata`` CLI). ``token`` is the token to present (see
    docs/SECURITY.md); it defaults to ``$STRATA_TOKEN``, then the file ``$STRATA_TOKEN_FILE``
    names, then a standalone's ``.strata/admin.token`` (under ``$STRATA_DIR`` when set).

    The instance may be created before ``fork`` (PyTorch DataLoader workers, multiprocessing
    pools) and used in the children: each process builds its own runtime and connections on
    first use.
    """

    protocol = "strata"
    root_marker = "/"
    # Metadata is cached by the Rust client and the master for the mount's TTL, and dropped on
    # writes; fsspec's own listings cache would keep stale entries longer.
    cachable = True

    def __init__(self, master: str | None = None, token: str | None = None, **kwargs: Any):
        kwargs.pop("use_listings_cache", None)
        super().__init__(use_listings_cache=False, **kwargs)
        self.master = master or os.environ.get("STRATA_MASTER") or DEFAULT_MASTER
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
            return StrataWriteFile(self, path)
        raise ValueError(f"unsupported mode {mode!r} (strata files are 'rb' or 'wb')")

    # ---- writes (mounts with mode=write-through) ----

    def put_file(self, lpath, rpath, callback=None, **kwargs):
        rpath = self._strip_protocol(rpath)
        if os.path.isdir(lpath):
            self.makedirs(rpath, exist_ok=True)
            return None
        info = self._client.put_file(os.fspath(lpath), rpath)
        if callback is not None:
            callback.set_size(info["size"])
            callback.relative_update(info["size"])
        return None

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        path = self._strip_protocol(path)
        if mode == "create" and self.exists(path):
            raise FileExistsError(path)
        self._client.pipe(path, value)

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
    """A Strata file open for writing: the bytes stream through a worker to the UFS, and the
    file is replaced when ``close`` succeeds. Leaving a ``with`` block by an exception aborts
    (the old file stays)."""

    def __init__(self, fs: StrataFileSystem, path: str):
        super().__init__()
        self.fs = fs
        self.path = path
        self.mode = "wb"
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
        if not self.closed:
            try:
                self.info_after_close = self._w.close()
            finally:
                super().close()

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
