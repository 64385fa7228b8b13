"""Lineage through stratafs (docs/LINEAGE.md): a PyTorch DataLoader's forked workers record what
they read under the filesystem's job, reported when they exit; marks group epochs; `STRATA_JOB`
names the job of any client; a process killed without flushing loses at most its unflushed
window; the OpenLineage export follows the published schema.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import fsspec
import pytest

from openlineage_schema import validate_events

KiB = 1 << 10


def _files(fs, root, n, size):
    paths = []
    for i in range(n):
        p = f"{root}/f{i:03d}.bin"
        fs.pipe_file(p, bytes([i % 251]) * (size + i))
        paths.append(p)
    return paths


class _Samples:
    def __init__(self, fs, paths):
        self.fs, self.paths = fs, paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        import torch

        return torch.frombuffer(bytearray(self.fs.cat_file(self.paths[i])), dtype=torch.uint8), i


def _by_mark(found):
    """{mark seq: {path: (version, bytes)}} of a lineage answer."""
    out = {}
    for r in found["records"]:
        seen = out.setdefault(r["mark"], {})
        version, total = seen.get(r["path"], (r["version"], 0))
        assert version == r["version"], r
        seen[r["path"]] = (version, total + r["bytes"])
    return out


def test_dataloader_workers_record_each_epoch_under_the_job(cluster):
    from torch.utils.data import DataLoader

    job = f"train-{uuid.uuid4().hex[:6]}"
    fs = fsspec.filesystem("strata", master=cluster.master, job=job)
    assert fs.job == job
    paths = _files(fs, f"/data/lineage-{job}", 12, 4 * KiB)
    versions = {p: fs.info(p)["version"] for p in paths}
    sizes = {p: fs.info(p)["size"] for p in paths}
    loader = DataLoader(_Samples(fs, paths), batch_size=None, shuffle=True, num_workers=2,
                        multiprocessing_context="fork", timeout=120)
    for epoch in range(2):
        if epoch:
            mark = fs.lineage_mark(f"epoch={epoch}")
            assert mark["seq"] == epoch and mark["label"] == f"epoch={epoch}"
        assert sorted(i for _, i in loader) == list(range(len(paths)))
    # The workers exited with the epochs (their reads reported by multiprocessing's finalizers);
    # the parent reported before each mark and has read nothing since.
    found = fs.lineage()
    assert found["job"] == job
    assert [m["label"] for m in found["marks"]] == ["epoch=1"]
    by_mark = _by_mark(found)
    expected = {p: (versions[p], sizes[p]) for p in paths}
    assert by_mark == {0: expected, 1: expected}
    assert fs.lineage(since="epoch=1")["records"] == [r for r in found["records"] if r["mark"] == 1]


_CHILD = r"""
import os, sys, fsspec
fs = fsspec.filesystem("strata", master=os.environ["STRATA_MASTER"])
fs.cat_file(sys.argv[1])
if sys.argv[3] == "flush":
    fs.lineage_flush()
fs.cat_file(sys.argv[2])
print("ready", flush=True)
sys.stdin.read()
"""


def _child(job, first, second, flush, interval):
    env = dict(os.environ, STRATA_JOB=job, STRATA_LINEAGE_FLUSH=interval)
    return subprocess.Popen([sys.executable, "-c", _CHILD, first, second, flush], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def _wait_ready(proc):
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"child said {line!r}, exit {proc.poll()}"


def test_strata_job_names_any_client_and_a_killed_one_loses_at_most_its_window(cluster, fs):
    root = f"/data/lineage-kill-{uuid.uuid4().hex[:6]}"
    a, b = _files(fs, root, 2, 2 * KiB)
    # Flushed after the first read, killed before the window with the second is due (1 h).
    job = f"killed-{uuid.uuid4().hex[:6]}"
    proc = _child(job, a, b, "flush", "1h")
    try:
        _wait_ready(proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    # The master acknowledged the flush before the child went on: nothing to wait for.
    recorded = {r["path"]: r["version"] for r in fs.lineage(job=job)["records"]}
    assert recorded == {a: fs.info(a)["version"]}, "the flushed read is kept, the unflushed window lost"

    # With a 200 ms interval, both reads are reported while the child lives, without a flush.
    job = f"live-{uuid.uuid4().hex[:6]}"
    proc = _child(job, a, b, "no-flush", "200ms")
    try:
        _wait_ready(proc)
        deadline = time.time() + 30
        while True:
            try:
                recorded = {r["path"] for r in fs.lineage(job=job)["records"]}
            except FileNotFoundError:
                recorded = set()
            if recorded == {a, b}:
                break
            assert time.time() < deadline, f"reported within the interval: {recorded}"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_openlineage_export_follows_the_published_schema(cluster):
    job = f"export-{uuid.uuid4().hex[:6]}"
    fs = fsspec.filesystem("strata", master=cluster.master, job=job)
    paths = _files(fs, f"/s3/lineage-{job}", 3, 3 * KiB)
    fs.cat_file(paths[0])
    fs.lineage_mark("epoch=1 step=100")
    fs.cat_file(paths[1])
    fs.cat_file(paths[2])
    fs.lineage_flush()
    out = cluster.cli("lineage", "export", job)
    events = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert [e["eventType"] for e in events] == ["START", "COMPLETE", "START", "COMPLETE"]
    validate_events(events)
    inputs = events[-1]["inputs"]
    names = sorted(i["name"] for i in inputs)
    assert len(names) == 2 and all(n.endswith((".bin")) for n in names), names
    assert all(i["namespace"].startswith("s3://") for i in inputs), inputs
    assert {i["facets"]["version"]["datasetVersion"] for i in inputs} == {fs.info(p)["version"] for p in paths[1:]}
    # The CLI's JSON (the interface other tools read) names the same versions.
    listed = json.loads(cluster.cli("lineage", "job", job, "--json"))
    assert {(f["path"], f["version"]) for f in listed["files"]} == {(p, fs.info(p)["version"]) for p in paths}
    with pytest.raises(FileNotFoundError):
        fs.lineage(job=f"nobody-{uuid.uuid4().hex[:6]}")
