"""stratafs against a real cluster (see conftest.py): bytes, listings, errors, writes, fork,
pandas/pyarrow and fsspec caching chains."""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import uuid

import fsspec
import pytest

from stratafs import StrataFileSystem

MiB = 1 << 20


def rand(n: int) -> bytes:
    return os.urandom(n)


def unique(mount: str) -> str:
    return f"{mount}/t-{uuid.uuid4().hex[:10]}"


# ---- registration and paths ----


def test_registered_protocol_and_url_forms(cluster, fs):
    assert isinstance(fs, StrataFileSystem)
    assert fsspec.get_filesystem_class("strata") is StrataFileSystem
    assert StrataFileSystem._strip_protocol("strata://data/x.bin") == "/data/x.bin"
    assert StrataFileSystem._strip_protocol("strata:///data/x.bin") == "/data/x.bin"
    assert StrataFileSystem._strip_protocol("/data/dir/") == "/data/dir"
    payload = rand(1234)
    fs.pipe_file("/data/url-forms.bin", payload)
    # The master comes from STRATA_MASTER (set by the cluster fixture) when not given.
    with fsspec.open("strata://data/url-forms.bin", "rb") as f:
        assert f.read() == payload
    with fsspec.open("strata:///data/url-forms.bin", "rb") as f:
        assert f.read() == payload
    assert fsspec.filesystem("strata").master == cluster.master


def test_a_list_of_masters_whose_first_is_down(cluster):
    # STRATA_MASTER / master= take a comma-separated list; the client follows the one that
    # answers (and, with HA masters, the leader).
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    masters = f"{dead},{cluster.master}"
    fs2 = fsspec.filesystem("strata", master=masters, skip_instance_cache=True)
    assert fs2.master == masters
    payload = rand(4321)
    fs2.pipe_file("/data/master-list.bin", payload)
    assert fs2.cat_file("/data/master-list.bin") == payload
    assert "/data/master-list.bin" in fs2.ls("/data", detail=False)


# ---- bytes ----


COUNT_SHORT_CIRCUIT = """
import sys, fsspec
fs = fsspec.filesystem("strata", master=sys.argv[1])
assert fs.cat_file(sys.argv[2]) == open(sys.argv[3], "rb").read()
print(fs.read_counters()["short_circuit_reads"])
"""


def test_blocks_of_the_worker_on_this_host_are_mapped_not_sent(fs, cluster, tmp_path):
    # The standalone's worker serves <state>/worker.sock and registers it; this process is on
    # its host, so it maps the blocks that worker owns once they are on its disk (a block in
    # DRAM only is read over TCP: granting it would cost the worker a copy). The second worker
    # serves TCP only.
    payload = rand(16 * MiB + 5)  # 17 blocks over two workers: the standalone owns some
    path = unique("/data") + ".bin"
    fs.pipe_file(path, payload)
    before = fs.read_counters()["short_circuit_reads"]
    deadline = time.time() + 30
    while True:
        assert fs.cat_file(path) == payload
        if fs.read_counters()["short_circuit_reads"] > before:
            break
        assert time.time() < deadline, "no block was ever mapped"
        # Blocks read go to the worker's disk once its reads have been quiet for a second.
        time.sleep(2)
    counters = fs.read_counters()
    assert {"short_circuit_declined", "short_circuit_failed"} <= counters.keys(), counters
    buf = bytearray(3 * MiB)
    with fs.open(path, "rb") as f:
        f.seek(5 * MiB - 7)
        assert f.readinto(buf) == len(buf)
    assert bytes(buf) == payload[5 * MiB - 7:8 * MiB - 7]

    # Opted out (STRATA_SHORT_CIRCUIT=0): the same bytes, none mapped.
    expected = tmp_path / "expected.bin"
    expected.write_bytes(payload)
    for value, mapped in (("0", False), ("1", True)):
        env = dict(os.environ, STRATA_SHORT_CIRCUIT=value)
        out = subprocess.run([sys.executable, "-c", COUNT_SHORT_CIRCUIT, cluster.master, path, str(expected)],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert (int(out.stdout) > 0) == mapped, (value, out.stdout)


@pytest.mark.parametrize("size", [0, 1, 4097, MiB - 1, MiB, 3 * MiB + 12345])
def test_binary_round_trip(fs, mount, size):
    path = unique(mount) + ".bin"
    data = rand(size)
    fs.pipe_file(path, data)
    assert fs.cat_file(path) == data
    assert fs.size(path) == size
    info = fs.info(path)
    assert info["type"] == "file" and info["size"] == size and info["name"] == path
    if size:
        # Ranges across block boundaries, open ends, negative starts (fsspec semantics).
        for start, end in [(0, 1), (size // 3, size - 1), (MiB - 5, MiB + 5), (-7, None), (None, 10), (5, 2)]:
            assert fs.cat_file(path, start, end) == data[start:end], (start, end)


def test_open_rb_seek_read_readinto(fs, mount):
    path = unique(mount) + ".bin"
    data = rand(5 * MiB + 333)
    fs.pipe_file(path, data)
    with fs.open(path, "rb") as f:
        assert f.seekable() and f.readable()
        assert f.size == len(data)
        assert f.read(10) == data[:10]
        assert f.tell() == 10
        f.seek(MiB - 3)
        assert f.read(6) == data[MiB - 3:MiB + 3]
        f.seek(-100, io.SEEK_END)
        assert f.read() == data[-100:]
        assert f.read(5) == b""
        f.seek(2 * MiB)
        buf = bytearray(MiB + 17)
        assert f.readinto(buf) == len(buf)
        assert bytes(buf) == data[2 * MiB:3 * MiB + 17]
        view = memoryview(bytearray(4096))
        f.seek(len(data) - 10)
        assert f.readinto(view) == 10 and bytes(view[:10]) == data[-10:]
        f.seek(0)
        # Sequential reads through readahead.
        out = bytearray()
        while chunk := f.read(300_001):
            out += chunk
        assert bytes(out) == data
    with pytest.raises(ValueError):
        f.read(1)


def test_write_modes_and_metadata_not_stale(fs, mount):
    path = unique(mount) + "/w.bin"
    parts = [rand(n) for n in (10, 2 * MiB + 1, 7, 5 * MiB)]
    with fs.open(path, "wb") as f:
        for p in parts:
            f.write(p)
        f.write(memoryview(b"tail"))
    whole = b"".join(parts) + b"tail"
    assert fs.cat_file(path) == whole
    key_before = fs.ukey(path)
    # Rewrite smaller: size, version and bytes change at once, not after the metadata TTL (60 s).
    fs.pipe_file(path, b"short")
    assert fs.size(path) == 5
    assert fs.cat_file(path) == b"short"
    assert fs.ukey(path) != key_before
    with fs.open(path, "rb") as f:
        assert f.read() == b"short"
    # A write that fails inside `with` leaves the old file.
    with pytest.raises(RuntimeError):
        with fs.open(path, "wb") as f:
            f.write(b"half-written")
            f.write(rand(3 * MiB))  # streamed to the worker already, never committed
            raise RuntimeError("boom")
    assert fs.cat_file(path) == b"short"
    assert fs.ls(path.rsplit("/", 1)[0], detail=False) == [path], "no partial file is left behind"


def test_put_get(fs, mount, tmp_path):
    src = tmp_path / "src.bin"
    data = rand(9 * MiB + 5)
    src.write_bytes(data)
    rpath = unique(mount) + "/put.bin"
    fs.put(str(src), rpath)
    assert fs.cat_file(rpath) == data
    dst = tmp_path / "out" / "dst.bin"
    fs.get(rpath, str(dst))
    assert dst.read_bytes() == data
    # Directory trees both ways.
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.bin").write_bytes(b"a" * 10)
    (tree / "sub" / "b.bin").write_bytes(b"b" * 20)
    rdir = unique(mount)
    fs.put(str(tree), rdir, recursive=True)
    assert fs.cat_file(rdir + "/sub/b.bin") == b"b" * 20
    back = tmp_path / "back"
    fs.get(rdir, str(back), recursive=True)
    assert (back / "sub" / "b.bin").read_bytes() == b"b" * 20
    assert (back / "a.bin").read_bytes() == b"a" * 10


def test_cat_ranges(fs, mount):
    base = unique(mount)
    blobs = {f"{base}/r{i}.bin": rand(MiB + i * 1000) for i in range(6)}
    fs.pipe(blobs)
    paths = list(blobs)
    starts = [0, 10, MiB - 1, None, -50, 3]
    ends = [100, None, MiB + 1, 20, None, 3]
    got = fs.cat_ranges(paths, starts, ends)
    assert got == [blobs[p][s:e] for p, s, e in zip(paths, starts, ends)]
    got = fs.cat_ranges(paths + [base + "/missing"], [0] * 7, [5] * 7)
    assert got[:6] == [blobs[p][:5] for p in paths]
    assert isinstance(got[6], FileNotFoundError)


# ---- listings and tree operations ----


def test_listing_find_glob_du_walk_rm_mkdir(fs, mount):
    base = unique(mount)
    files = {f"{base}/a.bin": 3, f"{base}/b.csv": 5, f"{base}/d/c.bin": 7, f"{base}/d/e/f.bin": 11}
    for p, n in files.items():
        fs.pipe_file(p, rand(n))
    fs.mkdir(f"{base}/empty")
    assert fs.isdir(f"{base}/empty")
    names = fs.ls(base, detail=False)
    assert sorted(names) == sorted([f"{base}/a.bin", f"{base}/b.csv", f"{base}/d", f"{base}/empty"])
    detail = {e["name"]: e for e in fs.ls(base)}
    assert detail[f"{base}/d"]["type"] == "directory" and detail[f"{base}/a.bin"]["size"] == 3
    assert fs.exists(f"{base}/d/c.bin") and not fs.exists(f"{base}/nope")
    assert fs.isfile(f"{base}/a.bin") and not fs.isfile(f"{base}/d")
    assert fs.isdir(f"{base}/d") and not fs.isdir(f"{base}/a.bin")
    assert sorted(fs.find(base)) == sorted(files)
    assert sorted(fs.glob(f"{base}/**/*.bin")) == sorted(p for p in files if p.endswith(".bin"))
    assert fs.glob(f"{base}/*.csv") == [f"{base}/b.csv"]
    assert fs.du(base) == sum(files.values())
    walked = {root: (sorted(dirs), sorted(fnames)) for root, dirs, fnames in fs.walk(base)}
    assert walked[base] == (["d", "empty"], ["a.bin", "b.csv"])
    assert walked[f"{base}/d/e"] == ([], ["f.bin"])
    assert fs.checksum(f"{base}/a.bin") != fs.checksum(f"{base}/b.csv")

    fs.rm(f"{base}/a.bin")
    assert not fs.exists(f"{base}/a.bin")
    assert f"{base}/a.bin" not in fs.ls(base, detail=False)
    with pytest.raises(OSError):
        fs.rm(f"{base}/d")  # not empty, not recursive
    fs.rm(f"{base}/d", recursive=True)
    assert not fs.exists(f"{base}/d/e/f.bin")
    assert sorted(fs.find(base)) == [f"{base}/b.csv"]


# ---- errors ----


def test_errors_map_to_python_exceptions(fs, cluster):
    (cluster.ro / "present.bin").write_bytes(b"read-only bytes")
    (cluster.ro / "dir").mkdir(exist_ok=True)
    with pytest.raises(FileNotFoundError):
        fs.cat_file("/data/does-not-exist")
    with pytest.raises(FileNotFoundError):
        fs.info("/nomount/x")
    with pytest.raises(FileNotFoundError):
        fs.open("/data/does-not-exist", "rb")
    with pytest.raises(IsADirectoryError):
        fs.cat_file("/ro/dir")
    with pytest.raises(IsADirectoryError):
        fs.open("/ro/dir", "rb")
    with pytest.raises(ValueError):
        fs.cat_file("/data/../etc/passwd")
    with pytest.raises(ValueError):
        fs.open("/data/x", "r+b")
    # A read-only mount refuses every write, with a message that says how to allow it.
    assert fs.cat_file("/ro/present.bin") == b"read-only bytes"
    with pytest.raises(PermissionError, match="write-through"):
        fs.pipe_file("/ro/new.bin", b"x")
    with pytest.raises(PermissionError):
        with fs.open("/ro/new.bin", "wb") as f:
            f.write(b"x")
    with pytest.raises(PermissionError):
        fs.rm("/ro/present.bin")
    with pytest.raises(PermissionError):
        fs.mkdir("/ro/newdir")
    assert not (cluster.ro / "new.bin").exists()
    assert (cluster.ro / "present.bin").read_bytes() == b"read-only bytes"


# ---- the GIL ----


def test_gil_is_released_during_io(fs):
    path = "/data/gil.bin"
    fs.pipe_file(path, rand(64 * MiB))
    fs.cat_file(path)  # warm: measure our side, not the UFS
    ticks = 0
    stop = threading.Event()

    def spin():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.05)
    before = ticks
    started = time.perf_counter()
    for _ in range(3):
        fs.cat_file(path)
    elapsed = time.perf_counter() - started
    during = ticks - before
    stop.set()
    t.join()
    # With the GIL held through the reads, the spinning thread would stall for their whole length.
    assert during > 1000, f"a Python thread made {during} steps during {elapsed:.3f}s of reads"


# ---- fork ----


_FORK_FS = None


def _child_read(args):
    path, = args
    data = _FORK_FS.cat_file(path)
    with _FORK_FS.open(path, "rb") as f:
        assert f.read() == data
    return (path, hashlib.sha256(data).hexdigest(), os.getpid(), _FORK_FS._client.runtime_pid(),
            _FORK_FS.placement(path))


def test_fork_pool_reads_with_checksums(fs, mount):
    global _FORK_FS
    base = unique(mount)
    blobs = {f"{base}/f{i:03d}.bin": rand(4096 + (i * 7919) % (300 * 1024)) for i in range(200)}
    fs.pipe(blobs)
    # The parent has a live runtime, pooled connections and an open reader before the fork.
    _FORK_FS = fs
    parent_pid = os.getpid()
    assert fs.cat_file(next(iter(blobs))) == blobs[next(iter(blobs))]
    assert fs._client.runtime_pid() == parent_pid
    open_in_parent = fs.open(next(iter(blobs)), "rb")
    open_in_parent.read(10)
    expected_placement = {p: fs.placement(p) for p in list(blobs)[:20]}
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        results = pool.map(_child_read, [(p,) for p in blobs], chunksize=5)
    assert len(results) == 200
    pids = set()
    for path, digest, pid, rt_pid, placement in results:
        assert digest == hashlib.sha256(blobs[path]).hexdigest(), path
        assert rt_pid == pid != parent_pid, "each child builds its own runtime"
        if path in expected_placement:
            assert placement == expected_placement[path], "placement is the same in every process"
        pids.add(pid)
    assert len(pids) >= 2, "the pool spread the reads over several processes"
    # The parent's state was not disturbed by its children: its reader goes on (the runtime,
    # shut down before each fork, is built again here on that call).
    assert open_in_parent.read(10) == blobs[next(iter(blobs))][10:20]
    assert fs._client.runtime_pid() == parent_pid
    open_in_parent.close()


def _child_uses_inherited_file(f):
    f.seek(3)
    return f.read(4)


def test_file_opened_before_fork_reads_in_child(fs):
    data = rand(2 * MiB)
    fs.pipe_file("/data/inherited.bin", data)
    f = fs.open("/data/inherited.bin", "rb")
    f.read(100)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            ok = _child_uses_inherited_file(f) == data[3:7]
            ok = ok and f.read(MiB) == data[7:7 + MiB]
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.waitpid(pid, 0)
    assert f.read(5) == data[100:105]
    f.close()


# ---- pandas, pyarrow, caching chains ----


def test_pyarrow_and_pandas(fs, mount, cluster):
    # Installed by python/test.sh: a missing one is a failure, not a skip.
    import pandas as pd
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    base = unique(mount)
    table = pa.table({"id": list(range(3000)), "part": [i % 3 for i in range(3000)],
                      "blob": [os.urandom(16) for _ in range(3000)]})
    pafs = PyFileSystem(FSSpecHandler(fs))
    pq.write_to_dataset(table, base + "/ds", partition_cols=["part"], filesystem=pafs)
    back = pq.read_table(base + "/ds", filesystem=pafs).sort_by("id")
    assert back.column("id").to_pylist() == list(range(3000))
    assert back.column("blob").to_pylist() == table.column("blob").to_pylist()
    dataset = ds.dataset(base + "/ds", filesystem=pafs, format="parquet", partitioning="hive")
    assert dataset.to_table(filter=ds.field("part") == 1).num_rows == 1000
    # Through fsspec URLs, as pandas users write them.
    url = "strata://" + base.lstrip("/")
    df = pd.DataFrame({"x": range(100), "y": [f"row{i}" for i in range(100)]})
    df.to_parquet(url + "/one.parquet", storage_options={"master": cluster.master})
    pd.testing.assert_frame_equal(
        pd.read_parquet(url + "/one.parquet", storage_options={"master": cluster.master}), df)
    df.to_csv(url + "/one.csv", index=False, storage_options={"master": cluster.master})
    pd.testing.assert_frame_equal(pd.read_csv(url + "/one.csv"), df)


def test_fsspec_caching_chain(fs, tmp_path, cluster):
    data = rand(3 * MiB)
    fs.pipe_file("/data/chain.bin", data)
    url = "simplecache::strata://data/chain.bin"
    opts = {"strata": {"master": cluster.master}, "simplecache": {"cache_storage": str(tmp_path)}}
    with fsspec.open(url, "rb", **opts) as f:
        assert f.read() == data
    with fsspec.open("blockcache::strata://data/chain.bin", "rb", strata={"master": cluster.master},
                     blockcache={"cache_storage": str(tmp_path / "b")}) as f:
        f.seek(MiB)
        assert f.read(100) == data[MiB:MiB + 100]


def test_pin_unpin_free(fs, mount):
    path = unique(mount) + "-pinned.bin"
    data = rand(3 * MiB + 5)
    fs.pipe_file(path, data)
    assert fs.cat_file(path) == data
    pin = fs.pin(path, tier="nvme", ttl=3600)
    assert pin["path"] == path and pin["tier"] == "nvme" and pin["bytes"] == len(data)
    assert pin["expires"] > pin["created"]
    assert any(p["path"] == path for p in fs.pins())
    with pytest.raises(ValueError, match="unpin"):
        fs.free(path)  # a pinned path is refused
    fs.unpin(path)
    assert all(p["path"] != path for p in fs.pins())
    with pytest.raises(FileNotFoundError):
        fs.unpin(path)
    freed = fs.free(path)
    assert freed["workers"] >= 1 and freed["workers_done"] == freed["workers"]
    assert fs.cat_file(path) == data  # read again from the UFS, the same bytes
    with pytest.raises(ValueError, match="tier"):
        fs.pin(path, tier="tape")


def test_cache_ttl_set_list_clear(fs, mount):
    path = unique(mount) + "-ttl"
    fs.pipe_file(path + "/a.bin", rand(1000))
    t = fs.set_cache_ttl(path, 6 * 3600)
    assert t["path"] == path and t["ttl"] == 6 * 3600 and t["created"] > 0
    assert any(x["path"] == path and x["ttl"] == 6 * 3600 for x in fs.cache_ttls())
    fs.set_cache_ttl(path, None)
    assert all(x["path"] != path for x in fs.cache_ttls())
    with pytest.raises(FileNotFoundError):
        fs.set_cache_ttl(path, None)
    with pytest.raises(ValueError, match="ttl"):
        fs.set_cache_ttl(path, -1)
