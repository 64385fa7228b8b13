"""Reads survive the master: a master and a worker as separate `strata` processes; the master
is stopped (SIGSTOP: it accepts connections and never answers, the hardest kind of outage)
while `fs.cat` and `fs.ls` go on from what the client has seen, and a new process started
during the outage starts from the worker's view of the cluster (STRATA_WORKERS)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bin() -> str:
    return os.environ.get("STRATA_BIN") or str(REPO / "target" / "debug" / "strata")


class Split:
    """A master process and a worker process (not a standalone: stopping the master must not
    stop the worker)."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="stratafs-outage-"))
        self.ufs = self.dir / "ufs"
        self.ufs.mkdir()
        self.procs: list[subprocess.Popen] = []
        self.master_proc, line = self._spawn(
            ["master", "--rpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
             "--data-dir", str(self.dir / "master")], r"master listening on (\S+)")
        self.master = line
        # The master wrote its tokens at start: clients present the admin one, the worker its own.
        self.token = (self.dir / "master" / "admin.token").read_text().strip()
        _, self.worker = self._spawn(
            ["--master", self.master, "worker", "--data-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
             "--data-dir", str(self.dir / "worker"), "--memory", "64MiB", "--nvme", "256MiB",
             "--token-file", str(self.dir / "master" / "worker.token")],
            r"worker \S+ serving data on (\S+)")
        self.cli("mount", "add", "/out", f"file://{self.ufs}", "-o", "block_size=1MiB", "-o", "metadata_ttl=1s")

    def _spawn(self, args, pattern):
        env = dict(os.environ, RUST_LOG="warn")
        env.pop("STRATA_MASTER", None)
        p = subprocess.Popen([_bin(), *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.procs.append(p)
        deadline = time.time() + 60
        while time.time() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            m = re.search(pattern, line)
            if m:
                return p, m.group(1)
        self.stop()
        raise RuntimeError(f"strata {args[0]} did not start")

    def cli(self, *args):
        env = dict(os.environ, STRATA_TOKEN=self.token)
        out = subprocess.run([_bin(), "--master", self.master, *args], capture_output=True, text=True, timeout=60,
                             env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def stop(self):
        for p in self.procs:
            os.kill(p.pid, signal.SIGCONT)
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def split():
    s = Split()
    yield s
    s.stop()


NEW_PROCESS = """
import sys, fsspec
fs = fsspec.filesystem("strata", master=sys.argv[1])
sys.stdout.buffer.write(fs.cat(sys.argv[2]))
sys.stderr.write(repr(fs.outage_counters()))
"""


def test_cat_and_ls_work_with_the_master_stopped(split):
    import fsspec

    data = os.urandom(3 * (1 << 20) + 11)
    (split.ufs / "d").mkdir()
    (split.ufs / "d" / "a.bin").write_bytes(data)
    (split.ufs / "d" / "b.txt").write_bytes(b"small")
    fs = fsspec.filesystem("strata", master=split.master, token=split.token, skip_instance_cache=True)
    assert fs.cat("/out/d/a.bin") == data
    names = sorted(fs.ls("/out/d", detail=False))
    assert len(names) == 2
    # The worker's view of the cluster is filled at its registration; wait until it has the mount.
    deadline = time.time() + 10
    while True:
        probe = subprocess.run([sys.executable, "-c", NEW_PROCESS, "127.0.0.1:1", "/out/d/b.txt"],
                               env=dict(os.environ, STRATA_WORKERS=split.worker, STRATA_TOKEN=split.token),
                               capture_output=True, timeout=60)
        if probe.returncode == 0:
            break
        assert time.time() < deadline, probe.stderr.decode()
        time.sleep(0.2)

    os.kill(split.master_proc.pid, signal.SIGSTOP)
    try:
        time.sleep(1.2)  # past the mount's 1 s metadata TTL: every stat the client has is stale
        for _ in range(3):
            assert fs.cat("/out/d/a.bin") == data
            assert sorted(fs.ls("/out/d", detail=False)) == names
            assert fs.cat("/out/d/b.txt") == b"small"
        counters = fs.outage_counters()
        assert counters["outages"] == 1, counters
        assert counters["stale_stats"] >= 3 and counters["stale_listings"] >= 3, counters

        new = subprocess.run([sys.executable, "-c", NEW_PROCESS, split.master, "/out/d/a.bin"],
                             env=dict(os.environ, STRATA_WORKERS=split.worker, STRATA_TOKEN=split.token),
                               capture_output=True, timeout=60)
        assert new.returncode == 0, new.stderr.decode()
        assert new.stdout == data
        assert "'started_from_worker': 1" in new.stderr.decode()
    finally:
        os.kill(split.master_proc.pid, signal.SIGCONT)
