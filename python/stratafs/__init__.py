"""fsspec filesystem for Strata: ``strata://mount/path``.

Every method below goes to the Strata cluster through the Rust client (``stratafs._native``):
placement on the consistent-hash ring, parallel block reads, readahead, failover. Nothing falls
back to another filesystem. ``find`` (and so ``glob`` and ``du``) is one paged recursive
listing by the master; ``walk`` is fsspec's generic algorithm over this filesystem's ``ls``,
which the master answers page by page.

``strata://data/x.bin`` and ``strata:///data/x.bin`` both name ``/data/x.bin``: the first
component is the mount, as a bucket is for s3fs.

Copies (``cp_file``, ``copy``, ``cp``) are made inside the cluster by a worker, no byte through
this process; ``mv`` renames in place where the UFS can (a local directory), else copies and
deletes. Bulk ``put``/``get``/``cp``/``rm``/``mv`` follow fsspec's local filesystem created with
``auto_mkdir=True`` (parents are made as on an object store); docs/PYTHON.md, "The fsspec
surface", lists every difference.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import io
import multiprocessing.util
import os
import shutil
import time
import weakref
from glob import has_magic
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from . import _native

__all__ = ["StrataFileSystem", "StrataReadFile", "StrataWriteFile"]

DEFAULT_MASTER: str = _native.DEFAULT_MASTER
# How long `sync(wait=True)` and a `wait_persisted` close wait for uploads by default (seconds).
DEFAULT_PERSIST_TIMEOUT: float = 600.0
# "The filesystem's setting" for keyword arguments where None means something (no limit).
_FS_DEFAULT = object()

# Every native client of this process, so the reads each recorded are reported before the
# process exits (lineage, docs/LINEAGE.md): at interpreter exit, and in processes that
# multiprocessing started (PyTorch DataLoader workers), which leave through its finalizers
# rather than atexit.
_clients: "weakref.WeakSet" = weakref.WeakSet()


def _report_lineage() -> None:
    for client in list(_clients):
        try:
            client.lineage_flush()
        except Exception:  # noqa: BLE001 - an exiting process has no one to tell but the log
            pass


atexit.register(_report_lineage)


class _ForkHook:
    """multiprocessing clears its finalizers in each process it starts, then runs the hooks
    registered with `register_after_fork` (which holds this object weakly: kept alive here)."""


_FORK_HOOK = _ForkHook()
multiprocessing.util.register_after_fork(
    _FORK_HOOK, lambda _: multiprocessing.util.Finalize(None, _report_lineage, exitpriority=100))


class StrataFileSystem(AbstractFileSystem):
    """A Strata cluster as an fsspec filesystem.

    ``master`` is the master's ``host:port``, or the masters of a highly available cluster as a
    comma-separated list (calls follow the leader); it defaults to ``$STRATA_MASTER``, then
    ``127.0.0.1:19998`` (as for the ``strata`` CLI). ``token`` is the token to present (see
    docs/SECURITY.md); it defaults to ``$STRATA_TOKEN``, then the file ``$STRATA_TOKEN_FILE``
    names, then the admin token of a standalone started in the current directory (in its state
    directory, or ``$STRATA_DIR`` when set).

    ``wait_persisted`` makes every file written (``open(..., "wb")`` at ``close``, ``pipe_file``,
    ``put_file``) wait until it is in the UFS (on a ``mode=write-back`` mount a write returns once
    the workers' journals hold it; the upload follows), for up to ``persist_timeout`` seconds
    (None: no limit). The same keywords given to ``open``, ``pipe_file`` or ``put_file``
    override them for that file.

    ``job`` names the job this filesystem reads for (default ``$STRATA_JOB``): the cluster
    records which version of which file it read (docs/LINEAGE.md); ``lineage_mark`` marks
    points of its run. Without one, reads are recorded as ``anonymous``.

    ``qos`` is this filesystem's request class on a busy worker (default ``$STRATA_QOS``, else
    ``"throughput"``): ``"latency"`` for inference, RAG and weight loading is served first,
    ``"background"`` last (docs/QOS.md).

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
                 persist_timeout: float | None = DEFAULT_PERSIST_TIMEOUT, job: str | None = None,
                 qos: str | None = None, **kwargs: Any):
        kwargs.pop("use_listings_cache", None)
        super().__init__(use_listings_cache=False, **kwargs)
        self.master = master or os.environ.get("STRATA_MASTER") or DEFAULT_MASTER
        self.wait_persisted = bool(wait_persisted)
        self.persist_timeout = persist_timeout
        self._client = _native.Client(self.master, token, job, qos)
        _clients.add(self._client)

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

    def _find_iter(self, path, max_depth=0, with_dirs=False):
        token = ""
        if with_dirs:
            try:
                page, token = self._client.find_page(path, token, 0, max_depth, True)
            except ConnectionError:
                # No master: the listing kept for outages names files only.
                with_dirs = False
            else:
                yield from page
                if not token:
                    return
        while True:
            page, token = self._client.find_page(path, token, 0, max_depth, with_dirs)
            yield from page
            if not token:
                return

    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kwargs):
        """Every file under ``path``, as fsspec's ``find``, listed by the master in one paged
        stream (``glob`` and ``du`` use it too) instead of one listing per directory.

        Directories (``withdirs``) come from the same listing on mounts listed directory by
        directory (a local directory: empty ones too); on an object store they are the parents
        of the files found (a directory marker holding nothing is not listed)."""
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
            for info in self._find_iter(path, server_depth, with_dirs=withdirs):
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
        that long; None keeps the pin until ``unpin``. Returns once every live worker has the
        pin in force (or after 10 s), as a dict: ``path``, ``tier``, ``bytes``, ``created``,
        ``expires``, and ``workers``, ``workers_applied``, ``pending`` (ids of live workers that
        had not applied it yet). It loads nothing: what is cached, or read later, is held.
        Raises ``OSError`` (ENOSPC) when the tier's pins would exceed its capacity across the
        live workers."""
        return self._client.pin(self._strip_protocol(path), tier, float(ttl or 0))

    def unpin(self, path):
        """Removes the pin of exactly ``path`` (in force when it returns, as ``pin``);
        ``FileNotFoundError`` if there is none."""
        return self._client.unpin(self._strip_protocol(path))

    def pins(self):
        """Every pin, as dicts (see ``pin``)."""
        return self._client.pins()

    def set_cache_ttl(self, path, ttl):
        """Workers drop the cached blocks of the files under ``path`` ``ttl`` seconds after they
        stored them, whatever the mount's ``cache_ttl``; ``ttl=None`` clears the path's own TTL
        (``FileNotFoundError`` if it has none). Returns once in force, as ``pin`` does:
        ``{"path", "ttl", "created", "workers", "workers_applied", "pending"}``."""
        return self._client.set_cache_ttl(self._strip_protocol(path), float(ttl or 0))

    def cache_ttls(self):
        """Every path's own cache TTL, as dicts (see ``set_cache_ttl``)."""
        return self._client.cache_ttls()

    def free(self, path, wait=10.0):
        """Drops the cached blocks of the files under ``path`` from every worker now (waiting up
        to ``wait`` seconds for all of them); nothing is read from the UFS until they are read
        again. Returns a dict: ``blocks``, ``bytes``, ``workers``, ``workers_done``,
        ``pending`` (ids of live workers that had not dropped them yet)."""
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

    def read_counters(self):
        """How this process's client read blocks (docs/PYTHON.md): a dict of
        short_circuit_reads (mapped from a worker on this host, or the sidecar, with no copy
        through a socket), short_circuit_declined and short_circuit_failed (attempts read
        through a socket instead: the worker declined that block, e.g. one only in its memory;
        or the attempt failed), failovers, hedged_reads, local_reads; and of its lineage record:
        lineage_reported, lineage_dropped, lineage_pending (docs/LINEAGE.md)."""
        return self._client.read_counters()

    # ---- prefetch ----

    def prefetch(self, paths, stream: int | None = None):
        """Tells the cluster that ``paths``, in this order, are what this reader reads next:
        the workers owning their blocks fetch them ahead (docs/PYTHON.md, "Prefetch"). Each
        call is the stream's whole window and replaces the previous one, so files the reader
        has passed are not fetched late; ``[]`` clears it. ``stream`` names the reader (default:
        one per filesystem and process). Paths that name no file are skipped and counted.
        Returns a dict of queued (blocks), unknown (paths skipped), workers (told)."""
        if stream is None:
            stream = self._default_stream()
        queued, unknown, workers = self._client.prefetch(int(stream), [self._strip_protocol(p) for p in paths])
        return {"queued": queued, "unknown": unknown, "workers": workers}

    def _default_stream(self) -> int:
        pid = os.getpid()
        if getattr(self, "_stream_pid", None) != pid:
            self._stream_pid = pid
            self._stream = int.from_bytes(os.urandom(8), "little") >> 1
        return self._stream

    @property
    def qos(self):
        """This filesystem's request class: ``latency``, ``throughput`` or ``background``."""
        return self._client.qos

    # ---- lineage (docs/LINEAGE.md) ----

    @property
    def job(self):
        """The job this filesystem's reads are recorded under; None: anonymous."""
        return self._client.job

    def lineage_mark(self, label: str):
        """Marks a point in this job's run (``"epoch=3 step=12000"``): the reads so far are
        reported first and grouped before it, later ones after it. Returns the mark as a dict
        of seq, label, at (Unix seconds)."""
        seq, label, at_ms = self._client.lineage_mark(label)
        return {"seq": seq, "label": label, "at": at_ms / 1000.0}

    def lineage_flush(self):
        """Reports this process's recorded reads now (they are otherwise reported every 2 s and
        at exit)."""
        self._client.lineage_flush()

    def lineage(self, job: str | None = None, since: str | None = None):
        """What ``job`` (default this filesystem's job) read: a dict of job, marks (a list of
        dicts seq, label, at) and records (dicts path, version, ufs, bytes, reads,
        first_read_ms, last_read_ms, mark, reader), from the mark ``since`` names on
        (``"#N"``: mark number N)."""
        name = job or self.job or "anonymous"
        found = self._client.lineage_job(name, since or "")
        found["marks"] = [{"seq": s, "label": lbl, "at": at / 1000.0} for s, lbl, at in found["marks"]]
        return found

    def placement(self, path):
        """Worker id that owns each block of a file on the placement ring (for diagnostics)."""
        return self._client.placement(self._strip_protocol(path))

    # ---- reads ----

    def cat_file(self, path, start=None, end=None, **kwargs):
        return self._client.cat(self._strip_protocol(path), start, end)

    def cat(self, path, recursive=False, on_error="raise", **kwargs):
        """fsspec's ``cat``: paths, lists and globs expanded as fsspec expands them, and the
        same answers (one path's bytes, or a dict of path to bytes; ``on_error`` "raise",
        "omit" or "return"), but many paths are read at once: their stats in a few master
        calls and their bytes in a few requests per worker, instead of a round trip of each
        per file."""
        paths = self.expand_path(path, recursive=recursive, **kwargs)
        if len(paths) > 1 or isinstance(path, list) or paths[0] != self._strip_protocol(path):
            n = len(paths)
            got = self._client.cat_many(paths, [kwargs.get("start")] * n, [kwargs.get("end")] * n)
            out = {}
            for p, value in zip(paths, got):
                if isinstance(value, BaseException):
                    if on_error == "raise":
                        raise value
                    if on_error == "return":
                        out[p] = value
                else:
                    out[p] = value
            return out
        return self.cat_file(paths[0], **kwargs)

    def cat_ranges(self, paths, starts, ends, max_gap=None, on_error="return", **kwargs):
        """fsspec's ``cat_ranges`` (``on_error="return"`` puts each failed range's exception in
        its place, anything else raises the first), every range read at once as ``cat`` reads
        many paths."""
        if not isinstance(starts, (list, tuple)):
            starts = [starts] * len(paths)
        if not isinstance(ends, (list, tuple)):
            ends = [ends] * len(paths)
        if len(starts) != len(paths) or len(ends) != len(paths):
            raise ValueError("paths, starts and ends must have the same length")
        paths = [self._strip_protocol(p) for p in paths]
        got = self._client.cat_many(paths, list(starts), list(ends))
        if on_error != "return":
            for value in got:
                if isinstance(value, BaseException):
                    raise value
        return got

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
        if mode in ("wb", "xb", "ab"):
            if mode == "xb" and self.exists(path):
                raise FileExistsError(errno.EEXIST, "File exists", path)
            try:
                return StrataWriteFile(self, path, wait_persisted=kwargs.get("wait_persisted"),
                                       persist_timeout=kwargs.get("persist_timeout", _FS_DEFAULT),
                                       append=mode == "ab")
            except (FileNotFoundError, FileExistsError) as e:
                self._raise_if_parent_is_file(path, e)
                raise
        raise ValueError(f"unsupported mode {mode!r} (strata files are 'rb', 'wb', 'xb' or 'ab')")

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
        try:
            info = self._client.put_file(os.fspath(lpath), rpath)
        except (FileNotFoundError, FileExistsError) as e:
            if os.path.exists(lpath):
                self._raise_if_parent_is_file(rpath, e)
            raise
        if callback is not None:
            callback.set_size(info["size"])
            callback.relative_update(info["size"])
        self._written(info, **kwargs)
        return None

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        """Writes ``value`` as the whole file (waits for its upload as ``put_file`` does)."""
        path = self._strip_protocol(path)
        if mode == "create" and self.exists(path):
            raise FileExistsError(errno.EEXIST, "File exists", path)
        try:
            info = self._client.pipe(path, value)
        except (FileNotFoundError, FileExistsError) as e:
            self._raise_if_parent_is_file(path, e)
            raise
        self._written(info, **kwargs)

    def rm_file(self, path):
        self._client.rm(self._strip_protocol(path), False)

    def _rm(self, path):
        self.rm_file(path)

    def rm(self, path, recursive=False, maxdepth=None):
        """Deletes files, and directories: with ``recursive=True`` everything under them (one
        call to the master per path given), without it only an empty one (``OSError`` ENOTEMPTY
        otherwise), as fsspec's generic and memory filesystems do. ``path`` may be a list and
        hold globs; ``maxdepth`` limits how deep a recursive delete goes: the files within it
        go, and a directory that still holds something deeper raises ``OSError`` (ENOTEMPTY) and
        stays. A literal path that does not exist raises ``FileNotFoundError``; a glob that
        matches nothing too."""
        paths = [self._strip_protocol(p) for p in (path if isinstance(path, list) else [path])]
        if maxdepth is None and not any(has_magic(p) for p in paths):
            for p in paths:
                if recursive:
                    # One call for a whole tree: the master deletes it in the UFS.
                    self._client.rm(p, True)
                else:
                    self._rm_one(p)
            return
        literal = {p for p in paths if not has_magic(p)}
        expanded = self.expand_path(paths, recursive=recursive, maxdepth=maxdepth)
        # Deepest first, so a directory comes after what is in it.
        for p in reversed(expanded):
            try:
                info = self.info(p)
            except FileNotFoundError:
                if p in literal:
                    raise
                # A directory an object store only had through the files just deleted.
                continue
            if info["type"] == "directory" and recursive and maxdepth is None:
                self._client.rm(p, True)
            else:
                # A file; or a directory: empty by now, or holding what is below maxdepth.
                self._rm_one(p)

    def _rm_one(self, path):
        """Deletes a file or an empty directory (``OSError`` ENOTEMPTY for one that is not)."""
        try:
            self._client.rm(path, False)
        except IsADirectoryError as e:
            raise OSError(errno.ENOTEMPTY, "Directory not empty", path) from e

    def mkdir(self, path, create_parents=True, **kwargs):
        """Makes a directory: ``FileExistsError`` if the path exists (file or directory), as on
        fsspec's local filesystem; without ``create_parents`` its parent must exist."""
        path = self._strip_protocol(path)
        if self.exists(path):
            raise FileExistsError(errno.EEXIST, "File exists", path)
        parent = self._parent(path)
        if not create_parents:
            try:
                if self.info(parent)["type"] != "directory":
                    raise NotADirectoryError(errno.ENOTDIR, "Not a directory", parent)
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", parent) from None
        self._mkdir(path)

    def makedirs(self, path, exist_ok=False):
        path = self._strip_protocol(path)
        if not exist_ok and self.exists(path):
            raise FileExistsError(errno.EEXIST, "File exists", path)
        self._mkdir(path)

    def _mkdir(self, path):
        try:
            self._client.mkdir(path)
        except (PermissionError, ConnectionError):
            raise
        except OSError as e:
            # A file where a parent directory must go: what os.makedirs raises.
            blocking = self._file_among_parents(self._parent(path))
            if blocking is None:
                raise
            raise NotADirectoryError(errno.ENOTDIR, f"Not a directory: {blocking}", path) from e

    def rmdir(self, path):
        """Deletes an empty directory (``OSError`` ENOTEMPTY otherwise, ``NotADirectoryError``
        for a file), as ``os.rmdir``."""
        path = self._strip_protocol(path)
        if self.info(path)["type"] != "directory":
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        self._rm_one(path)

    def _file_among_parents(self, path):
        """The nearest of ``path`` and its parents that is a file, or None (to tell why a
        write or a mkdir under it failed)."""
        p = path
        while p and p != "/":
            try:
                if self.info(p)["type"] == "file":
                    return p
            except (FileNotFoundError, ValueError):
                pass
            p = self._parent(p)
        return None

    # ---- copies, moves, touch, times ----

    def cp_file(self, path1, path2, **kwargs):
        """Copies one file inside the cluster: a worker has the UFS copy it (same mount, a UFS
        that copies: S3 CopyObject, a local file copy) or streams it through its block cache
        into the destination; no byte passes through this process. To a write-back mount the
        copy goes through this process's reads and write path (its files need several workers'
        journals). A directory is made at ``path2`` (fsspec's ``copy`` of a tree calls this for
        its directories). ``shutil.SameFileError`` (an ``OSError``) copying a file onto itself,
        as fsspec's local filesystem."""
        path1 = self._strip_protocol(path1)
        path2 = self._strip_protocol(path2)
        info = self.info(path1)
        if info["type"] == "directory":
            self.makedirs(path2, exist_ok=True)
            return None
        if path1 == path2:
            raise shutil.SameFileError(f"{path1!r} and {path2!r} are the same file")
        try:
            self._client.copy(path1, path2)
        except (FileNotFoundError, FileExistsError) as e:
            self._raise_if_parent_is_file(path2, e)
            raise
        if kwargs.get("wait_persisted") or self.wait_persisted:
            self._written(self.info(path2), **kwargs)
        return None

    def _raise_if_parent_is_file(self, path, err):
        """A write or copy to ``path`` failed: when a parent of it is a file, raise what fsspec's
        local filesystem (``auto_mkdir=True``) raises there."""
        blocking = self._file_among_parents(self._parent(path))
        if blocking is None:
            return
        if blocking == self._parent(path):
            raise FileExistsError(errno.EEXIST, "File exists", blocking) from err
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", self._parent(path)) from err

    def mv(self, path1, path2, recursive=False, maxdepth=None, **kwargs):
        """Moves a file or a directory, as ``shutil.move`` (fsspec's local filesystem): into
        ``path2`` when it is an existing directory (or ends with "/"), else to ``path2``; a file
        at ``path2`` is replaced, but a name already taken inside a directory moved into, or any
        path in the way of a directory, raises ``FileExistsError``; a directory moves whole,
        ``recursive`` or not. Renamed in place where the UFS can (a local
        directory; one call, atomic), else copied by the workers and deleted. Lists, globs or
        ``maxdepth`` take fsspec's generic path: ``copy`` then ``rm``."""
        if isinstance(path1, list) or isinstance(path2, list) or has_magic(str(path1)) or maxdepth is not None:
            return super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
        into = str(path2).endswith("/")
        src = self._strip_protocol(path1)
        dst = self._strip_protocol(path2)
        if src == dst:
            return None
        info = self.info(src)
        is_dir = info["type"] == "directory"
        inside = into or self.isdir(dst)
        if inside:
            dst = dst.rstrip("/") + "/" + src.rsplit("/", 1)[-1]
        if is_dir and dst.startswith(src + "/"):
            # What shutil.move raises (an OSError): no builtin type says this.
            raise shutil.Error(f"Cannot move a directory, {src!r}, into itself, {dst!r}.")
        if (inside or is_dir) and self.exists(dst):
            # shutil.move raises shutil.Error here; the builtin type says what is wrong.
            raise FileExistsError(errno.EEXIST, "Destination path already exists", dst)
        if self._client.rename(src, dst):
            return None
        if is_dir:
            self.copy(src, dst, recursive=True, on_error="raise")
            self.rm(src, recursive=True)
        else:
            self.cp_file(src, dst)
            self._client.rm(src, False)
        return None

    def rename(self, path1, path2, **kwargs):
        return self.mv(path1, path2, **kwargs)

    def touch(self, path, truncate=True, **kwargs):
        """``truncate=True`` (or a missing file): writes an empty file. ``truncate=False`` on an
        existing file updates its modification time and keeps its bytes where the mount can
        append (a local directory: an empty append, published by a rename); elsewhere (object
        stores cannot change an object's time without rewriting it) ``io.UnsupportedOperation``."""
        path = self._strip_protocol(path)
        if truncate or not self.exists(path):
            with self.open(path, "wb", **kwargs):
                pass
            return None
        try:
            with self.open(path, "ab"):
                pass
        except io.UnsupportedOperation as e:
            raise io.UnsupportedOperation(
                f"touch({path!r}, truncate=False) cannot update the modification time here: {e}") from e
        return None

    def modified(self, path):
        """The last modification time as a timezone-aware UTC ``datetime`` (as fsspec's local
        filesystem returns it). ``IsADirectoryError`` for a directory that has none (an object
        store's)."""
        info = self.info(path)
        if not info.get("mtime"):
            if info["type"] == "directory":
                raise IsADirectoryError(errno.EISDIR, "This directory has no modification time", info["name"])
            raise OSError(errno.ENODATA, "The UFS gave no modification time", info["name"])
        return datetime.datetime.fromtimestamp(info["mtime"], tz=datetime.timezone.utc)

    def created(self, path):
        """When the file was created, as ``modified`` returns times. The UFS keeps no separate
        creation time: an object store's object is created whole by its last write, so its
        creation time is its last modification; a local directory's file is reported the same
        way (its last modification), which is later than its creation if it was changed in
        place since."""
        return self.modified(path)

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

    Mode ``"ab"`` (write-through mounts whose UFS can append: a local directory) appends: the
    file's bytes followed by the ones written replace it at ``close``, so an aborted append
    leaves it as it was. Elsewhere opening it raises ``io.UnsupportedOperation`` (an
    ``OSError`` and a ``ValueError``) saying why.

    ``wait_persisted`` and ``persist_timeout`` (default: the filesystem's) make ``close`` also
    wait until the file is in the UFS, as ``fs.sync(path, wait=True, timeout=persist_timeout)``;
    if that fails, ``close`` raises its ``OSError``/``TimeoutError``, and the file stays written
    (the workers hold it and go on uploading)."""

    def __init__(self, fs: StrataFileSystem, path: str, wait_persisted: bool | None = None,
                 persist_timeout: Any = _FS_DEFAULT, append: bool = False):
        super().__init__()
        self.fs = fs
        self.path = path
        self.mode = "ab" if append else "wb"
        self.wait_persisted = fs.wait_persisted if wait_persisted is None else bool(wait_persisted)
        self.persist_timeout = fs.persist_timeout if persist_timeout is _FS_DEFAULT else persist_timeout
        # An append starts at the end of the file ("ab": tell() is its size at open).
        self._start = 0
        if append:
            try:
                self._start = fs.info(path)["size"]
            except FileNotFoundError:
                pass
        self._w = fs._client.open_write(path, append)
        self.info_after_close = None

    @property
    def name(self):
        return self.path

    def writable(self):
        return True

    def tell(self):
        return self._start + self._w.written

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
