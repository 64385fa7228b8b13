"""Write-back mounts through stratafs (conftest.py: /wb over a local directory, /s3wb over
Garage, both mode=write-back with write_replicas=2 on the cluster's 2 workers).

`close` returns once both workers hold the file in their journals; a worker uploads it in the
background. These tests check what a Python caller sees on the way: the file readable at once
from another process, `info`'s `persist`, `fs.sync` (listing, waiting, its errors), the bytes in
the UFS exactly, `wait_persisted` on close, and a PyTorch checkpoint saved and loaded through
`strata://`. No fixed sleeps: everything that waits polls with a deadline.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import fsspec
import pytest

MiB = 1 << 20
# Uploads are background work on a loaded 2-core machine: generous, never slept through.
PERSIST_DEADLINE = 120.0
NOT_PERSISTED = ("pending", "uploading", "failed")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def unique(mount: str) -> str:
    return f"{mount}/t-{uuid.uuid4().hex[:10]}"


def ufs_read(cluster, path: str) -> bytes | None:
    """The bytes of a /wb or /s3wb file straight from its UFS (the local directory, or Garage
    through pyarrow's own S3 client), None if it is not there."""
    mount, rel = path.lstrip("/").split("/", 1)
    if mount == "wb":
        local = cluster.wb / rel
        return local.read_bytes() if local.is_file() else None
    assert mount == "s3wb", path
    from pyarrow import fs as pafs

    s3 = cluster.s3
    scheme, endpoint = s3["endpoint"].split("://", 1)
    store = pafs.S3FileSystem(access_key=s3["key"], secret_key=s3["secret"], region=s3["region"],
                              endpoint_override=endpoint, scheme=scheme)
    key = f"{s3['bucket']}/{s3['wb_prefix']}/{rel}"
    if store.get_file_info(key).type != pafs.FileType.File:
        return None
    with store.open_input_stream(key) as f:
        return f.read()


def journals(cluster, write_id: str) -> int:
    """How many workers hold a durable journal of a write (its `<write_id>.rec` record)."""
    return sum(1 for d in Path(cluster.dir).rglob("journal") if (d / f"{write_id}.rec").is_file())


# Reads a file in a fresh process (its own client, no cache shared with the test's).
_READER = r"""
import hashlib, json, sys, fsspec
fs = fsspec.filesystem("strata")
path = sys.argv[1]
info = fs.info(path)
whole = fs.cat_file(path)
with fs.open(path, "rb") as f:
    f.seek(len(whole) // 2)
    tail = f.read()
print(json.dumps({"sha": hashlib.sha256(whole).hexdigest(), "tail": hashlib.sha256(tail).hexdigest(),
                  "size": info["size"], "version": info["version"], "persist": info["persist"],
                  "holders": info["holders"]}))
"""


def read_in_another_process(path: str) -> dict:
    # STRATA_MASTER and STRATA_TOKEN_FILE come from the cluster fixture's environment.
    out = subprocess.run([sys.executable, "-c", _READER, path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_write_read_elsewhere_at_once_then_sync(fs, cluster, wb_mount):
    base = unique(wb_mount)
    path = f"{base}/ckpt/shard-0.bin"
    data = os.urandom(3 * MiB + 17)
    with fs.open(path, "wb") as f:
        for i in range(0, len(data), 700_001):
            f.write(data[i:i + 700_001])
    closed = f.info_after_close
    assert closed["size"] == len(data)
    if closed["persist"] != "persisted":
        # Acknowledged from the journals: a write-back version, held by both workers.
        assert closed["version"].startswith("wb-"), closed
        assert len(set(closed["holders"])) == 2, closed

    # Another client at once (its own connections and caches), then another process: the
    # bytes are all there, whole and from the middle.
    other = fsspec.filesystem("strata", skip_instance_cache=True)
    assert other is not fs and other.cat_file(path) == data
    assert other.info(path)["persist"] in ("persisted", *NOT_PERSISTED)
    seen = read_in_another_process(path)
    assert (seen["sha"], seen["tail"], seen["size"]) == (sha(data), sha(data[len(data) // 2:]), len(data))
    assert seen["persist"] in ("persisted", *NOT_PERSISTED), seen

    # What is not uploaded yet is listed (the upload may also be done already).
    for pending in fs.sync(base):
        assert (pending["path"], pending["size"]) == (path, len(data)), pending
        assert pending["state"] in NOT_PERSISTED and pending["version"].startswith("wb-"), pending
        assert len(set(pending["holders"])) == 2, pending

    assert fs.sync(f"strata://{base.lstrip('/')}", wait=True, timeout=PERSIST_DEADLINE) == []
    assert fs.sync(base) == []
    assert ufs_read(cluster, path) == data, "the UFS holds exactly the bytes written"
    # This process's client cached the write-back stat at close: it must not be served now.
    info = fs.info(path)
    assert info["persist"] == "persisted" and not info["version"].startswith("wb-"), info
    assert info["holders"] == [] and info["size"] == len(data)
    assert fs.cat_file(path) == data
    assert read_in_another_process(path)["persist"] == "persisted"


def test_a_reader_opened_after_the_upload_reads_the_ufs_version(fs, cluster):
    """This process's client learnt the write-back version at close (the mount's metadata TTL
    is 60 s). Once the file is uploaded, a reader it opens must be pinned to the UFS's version:
    the workers drop the write-back version's journals a grace after the upload."""
    path = unique("/wb") + "/reopened.bin"
    data = os.urandom(2 * MiB + 5)
    with fs.open(path, "wb") as f:
        f.write(data)
    closed = f.info_after_close
    if closed["persist"] != "persisted":
        write_id = closed["version"].removeprefix("wb-")
        assert journals(cluster, write_id) == 2, "both workers hold the write durably"
    fs.sync(path, wait=True, timeout=PERSIST_DEADLINE)
    with fs.open(path, "rb") as r:
        assert not r.version.startswith("wb-") and r.version == fs.info(path)["version"], r.version
        assert r.read() == data
    assert ufs_read(cluster, path) == data


@pytest.fixture
def blocked(cluster):
    """A /wb path whose upload cannot land: a plain file in the UFS directory stands where the
    path's parent directory would be created. The write itself only needs the journals.
    Yields (strata path, unblock)."""
    base = unique("/wb")
    rel = base.removeprefix("/wb/")
    (cluster.wb / rel).mkdir()
    blocker = cluster.wb / rel / "blocker"
    blocker.write_bytes(b"a file where the upload needs a directory")
    yield f"{base}/blocker/f.bin", lambda: blocker.unlink()


def test_persist_state_sync_errors_and_retry(fs, cluster, blocked):
    path, unblock = blocked
    data = os.urandom(MiB + 3)
    with fs.open(path, "wb") as f:
        f.write(data)
    closed = f.info_after_close
    assert closed["persist"] in NOT_PERSISTED, closed
    assert closed["version"].startswith("wb-") and closed["size"] == len(data), closed
    assert len(set(closed["holders"])) == 2, closed
    write_id = closed["version"].removeprefix("wb-")
    assert journals(cluster, write_id) == 2, "acknowledged once both workers hold it"

    # Served from the journals, here and in another process; not in the UFS.
    assert fs.cat_file(path) == data
    seen = read_in_another_process(path)
    assert seen["sha"] == sha(data) and seen["persist"] in NOT_PERSISTED, seen
    assert seen["version"] == closed["version"]
    info = fs.info(path)
    assert info["persist"] in NOT_PERSISTED and info["version"] == closed["version"], info
    assert sorted(info["holders"]) == sorted(closed["holders"])
    assert ufs_read(cluster, path) is None

    [pending] = fs.sync(path.rsplit("/", 2)[0])
    assert (pending["path"], pending["size"], pending["version"]) == (path, len(data), closed["version"])
    assert pending["state"] in NOT_PERSISTED and sorted(pending["holders"]) == sorted(closed["holders"])
    assert pending["write_id"] == write_id and pending["committed"] > time.time() - 600

    # A deadline that passes first: TimeoutError naming the file.
    with pytest.raises(TimeoutError, match="f.bin"):
        fs.sync(path, wait=True, timeout=0.2)

    # The upload gives up after its retries: OSError with the path and the UFS's reason.
    t0 = time.monotonic()
    with pytest.raises(OSError) as failed:
        fs.sync(path, wait=True, timeout=PERSIST_DEADLINE)
    assert not isinstance(failed.value, TimeoutError), failed.value
    assert failed.value.errno == errno.EIO and failed.value.filename == path, failed.value
    assert "upload to the UFS failed" in str(failed.value) and len(failed.value.strerror) > 40
    assert time.monotonic() - t0 < PERSIST_DEADLINE
    assert fs.info(path)["persist"] == "failed"
    [pending] = fs.sync(path)
    assert pending["state"] == "failed" and pending["error"], pending
    # Still whole in the journals, and readable.
    assert fs.cat_file(path) == data
    assert journals(cluster, write_id) == 2

    # A filesystem whose files wait for their upload at close: closing one that cannot land
    # raises, and the file stays written (held by the workers, readable) all the same.
    waits = fsspec.filesystem("strata", wait_persisted=True, persist_timeout=0.3)
    again = os.urandom(4321)
    with pytest.raises(TimeoutError, match="f.bin"):
        with waits.open(path, "wb") as f:
            f.write(again)
    assert f.closed
    assert fs.cat_file(path) == again
    assert fs.info(path)["persist"] in NOT_PERSISTED
    with pytest.raises(TimeoutError):
        fs.pipe_file(path, again, wait_persisted=True, persist_timeout=0.3)
    # A file that opts out returns from close as soon as the journals hold it.
    last = os.urandom(2 * MiB)
    with waits.open(path, "wb", wait_persisted=False) as f:
        f.write(last)
    assert f.info_after_close["persist"] in NOT_PERSISTED, f.info_after_close

    # The UFS heals: the uploads still retrying land, or sync queues them again if they gave
    # up; older versions never overwrite the last one.
    unblock()
    assert fs.sync(path, wait=True, timeout=PERSIST_DEADLINE) == []
    assert ufs_read(cluster, path) == last, "the last acknowledged version lands"
    info = fs.info(path)
    assert info["persist"] == "persisted" and not info["version"].startswith("wb-"), info
    assert fs.cat_file(path) == last


def test_sync_of_other_mounts_and_bad_paths(fs):
    # Nothing is ever pending on a write-through mount; waiting returns at once.
    fs.pipe_file("/data/sync-through.bin", b"x")
    assert fs.sync("/data") == []
    assert fs.sync("/data", wait=True, timeout=5) == []
    with pytest.raises(FileNotFoundError):
        fs.sync("/no-such-mount/x")
    with pytest.raises(ValueError):
        fs.sync("/wb/../etc")


def test_wait_persisted(fs, cluster, wb_mount, tmp_path):
    base = unique(wb_mount)
    # Per file.
    data = os.urandom(2 * MiB + 1)
    with fs.open(f"{base}/a.bin", "wb", wait_persisted=True) as f:
        f.write(data)
    # No polling: close returned only once the file was in the UFS.
    assert ufs_read(cluster, f"{base}/a.bin") == data
    assert f.info_after_close["persist"] == "persisted", f.info_after_close
    assert not f.info_after_close["version"].startswith("wb-")
    assert fs.sync(f"{base}/a.bin") == []

    # The filesystem's default (fsspec passes storage options to the filesystem).
    other = os.urandom(12345)
    url = f"strata://{base.lstrip('/')}/b.bin"
    with fsspec.open(url, "wb", wait_persisted=True) as f:
        f.write(other)
    assert ufs_read(cluster, f"{base}/b.bin") == other
    waits = fsspec.filesystem("strata", wait_persisted=True)
    assert waits is not fs and waits.wait_persisted
    third = os.urandom(777)
    with waits.open(f"{base}/c.bin", "wb") as f:
        f.write(third)
    assert ufs_read(cluster, f"{base}/c.bin") == third
    # pipe_file and put (file by file) wait the same way.
    waits.pipe_file(f"{base}/piped.bin", other)
    assert ufs_read(cluster, f"{base}/piped.bin") == other
    local = tmp_path / "tree"
    (local / "sub").mkdir(parents=True)
    (local / "x.bin").write_bytes(third)
    (local / "sub" / "y.bin").write_bytes(data)
    waits.put(str(local), f"{base}/tree", recursive=True)
    assert ufs_read(cluster, f"{base}/tree/x.bin") == third
    assert ufs_read(cluster, f"{base}/tree/sub/y.bin") == data
    # ... and so does a single call on a filesystem that does not by default.
    fs.pipe_file(f"{base}/piped-once.bin", third, wait_persisted=True)
    assert ufs_read(cluster, f"{base}/piped-once.bin") == third


def _model_and_optimizer(seed: int):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def _assert_same_tensors(a, b, where="state"):
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same_tensors(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


_TORCH_LOADER = r"""
import hashlib, sys, fsspec, torch
with fsspec.open(sys.argv[1], "rb") as f:
    state = torch.load(f, weights_only=True)
for name, t in sorted(state["model"].items()):
    print(name, hashlib.sha256(t.numpy().tobytes()).hexdigest())
"""


def test_torch_checkpoint(fs, cluster, wb_mount):
    # torch is installed by python/test.sh: missing, this fails rather than skips.
    import torch

    model, opt = _model_and_optimizer(100)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 100}
    base = unique(wb_mount)
    url = f"strata://{base.lstrip('/')}/ckpt/step-100.pt"
    with fsspec.open(url, "wb") as f:
        torch.save(state, f)

    with fsspec.open(url, "rb") as f:
        loaded = torch.load(f, weights_only=True)
    _assert_same_tensors(state, loaded)
    fresh, _ = _model_and_optimizer(7)
    fresh.load_state_dict(loaded["model"])
    probe = torch.randn(4, 64)
    assert torch.equal(fresh(probe), model(probe))

    # Another process loads it too (its own client, possibly from the journals still).
    out = subprocess.run([sys.executable, "-c", _TORCH_LOADER, url], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    expected = "".join(f"{n} {sha(t.numpy().tobytes())}\n" for n, t in sorted(state["model"].items()))
    assert out.stdout == expected

    # Once persisted, the UFS object is the same checkpoint, byte for byte.
    fs.sync(f"{base}/ckpt", wait=True, timeout=PERSIST_DEADLINE)
    path = f"{base}/ckpt/step-100.pt"
    stored = ufs_read(cluster, path)
    assert stored is not None and stored == fs.cat_file(path)
    _assert_same_tensors(state, torch.load(io.BytesIO(stored), weights_only=True))
