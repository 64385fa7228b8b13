"""A real Strata cluster for the tests: the `strata` binary the Rust build produced
(`$STRATA_BIN`, default target/debug/strata), run as `standalone` plus a second worker, on
127.0.0.1 with ports picked by the kernel. Mounts:

- /data  a local directory, mode=write-through
- /ro    a local directory, read-only (the default mode)
- /s3    a fresh prefix of the Garage bucket from $STRATA_TEST_S3_* (scripts/garage.sh),
         mode=write-through; without $STRATA_TEST_S3_* its tests fail with a pointer to
         ./test.sh (which starts Garage), as the Rust S3 tests do.
- /wb    a local directory, mode=write-back with write_replicas=2 (both workers hold every
         write in their journals; one uploads it to the directory in the background)
- /s3wb  another fresh prefix of the same Garage bucket, mode=write-back, write_replicas=2
         (only with $STRATA_TEST_S3_*, as /s3)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _strata_bin() -> str:
    path = os.environ.get("STRATA_BIN") or str(REPO / "target" / "debug" / "strata")
    if not os.access(path, os.X_OK):
        pytest.exit(f"no strata binary at {path}: build it (cargo build --bin strata) or set STRATA_BIN", 2)
    return path


class Cluster:
    def __init__(self):
        self.bin = _strata_bin()
        self.dir = Path(tempfile.mkdtemp(prefix="stratafs-test-"))
        self.data = self.dir / "data"
        self.ro = self.dir / "ro"
        self.wb = self.dir / "wb"
        self.data.mkdir()
        self.ro.mkdir()
        self.wb.mkdir()
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        self.master = self._start_standalone()
        # The standalone wrote its admin token (clients) and the workers' token at start.
        self.token_file = self.dir / "state" / "admin.token"
        self._start_worker()
        self.cli("mount", "add", "/data", f"file://{self.data}", "-o", "mode=write-through",
                 "-o", "block_size=1MiB", "-o", "metadata_ttl=60s")
        self.cli("mount", "add", "/ro", f"file://{self.ro}", "-o", "block_size=1MiB")
        write_back = ["-o", "mode=write-back", "-o", "write_replicas=2"]
        self.cli("mount", "add", "/wb", f"file://{self.wb}", *write_back,
                 "-o", "block_size=1MiB", "-o", "metadata_ttl=60s")
        self.s3 = None
        if os.environ.get("STRATA_TEST_S3_ENDPOINT"):
            prefix = f"stratafs-{uuid.uuid4().hex[:8]}"
            self.s3 = {
                "endpoint": os.environ["STRATA_TEST_S3_ENDPOINT"],
                "bucket": os.environ["STRATA_TEST_S3_BUCKET"],
                "key": os.environ["STRATA_TEST_S3_ACCESS_KEY"],
                "secret": os.environ["STRATA_TEST_S3_SECRET_KEY"],
                "region": os.environ.get("STRATA_TEST_S3_REGION", "garage"),
                "prefix": prefix,
                "wb_prefix": f"{prefix}-wb",
            }
            for mount, prefix, mode in (("/s3", self.s3["prefix"], ["-o", "mode=write-through"]),
                                        ("/s3wb", self.s3["wb_prefix"], write_back)):
                self.cli("mount", "add", mount, f"s3://{self.s3['bucket']}/{prefix}",
                         "-o", f"endpoint={self.s3['endpoint']}", "-o", f"region={self.s3['region']}",
                         "-o", f"access_key_id={self.s3['key']}",
                         "-o", f"secret_access_key={self.s3['secret']}",
                         *mode, "-o", "block_size=1MiB", "-o", "metadata_ttl=60s")

    def _spawn(self, name, *args):
        log = open(self.dir / f"{name}.log", "w+")
        # Info level: the secrets test greps these logs, which must say something to mean anything.
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info"))
        p = subprocess.Popen([self.bin, *args], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        self.procs.append(p)
        self.logs.append(log)
        return p

    def _start_standalone(self) -> str:
        p = self._spawn("standalone", "standalone", "--dir", str(self.dir / "state"),
                        "--rpc-addr", "127.0.0.1:0", "--mount", f"/boot=file://{self.ro}",
                        "--memory", "256MiB", "--nvme", "1GiB")
        deadline = time.time() + 60
        while time.time() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            m = re.match(r"\s*master\s+(\S+)", line)
            if m:
                return m.group(1)
        self.stop()
        raise RuntimeError("strata standalone did not start; see its log in " + str(self.dir))

    def _start_worker(self):
        self._spawn("worker2", "--master", self.master, "worker", "--data-addr", "127.0.0.1:0",
                    "--http-addr", "127.0.0.1:0", "--data-dir", str(self.dir / "worker2"),
                    "--memory", "256MiB", "--nvme", "1GiB",
                    "--token-file", str(self.dir / "state" / "master" / "worker.token"))
        deadline = time.time() + 60
        while time.time() < deadline:
            status = json.loads(self.cli("status", "--json"))
            if sum(1 for w in status.get("workers", []) if w.get("live")) >= 2:
                return
            time.sleep(0.2)
        raise RuntimeError("the second worker did not join")

    def cli(self, *args) -> str:
        env = dict(os.environ, STRATA_TOKEN_FILE=str(self.token_file))
        out = subprocess.run([self.bin, "--master", self.master, *args], capture_output=True, text=True,
                             timeout=60, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"strata {' '.join(args)}: {out.stderr}")
        return out.stdout

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in self.logs:
            log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster():
    c = Cluster()
    os.environ["STRATA_MASTER"] = c.master
    # Every client of the tests (and the processes they fork or spawn) presents the admin token.
    os.environ["STRATA_TOKEN_FILE"] = str(c.token_file)
    yield c
    c.stop()


@pytest.fixture(scope="session")
def fs(cluster):
    import fsspec

    return fsspec.filesystem("strata", master=cluster.master)


def _needs_s3(cluster):
    if cluster.s3 is None:
        pytest.fail(
            "STRATA_TEST_S3_ENDPOINT is not set: the S3 half of these tests needs a real S3 server. "
            "./test.sh starts Garage and sets STRATA_TEST_S3_*; set them yourself for another endpoint"
        )


@pytest.fixture(params=["data", "s3"])
def mount(request, cluster):
    """A writable mount: the local directory, then Garage."""
    if request.param == "s3":
        _needs_s3(cluster)
    return "/" + request.param


@pytest.fixture(params=["wb", "s3wb"])
def wb_mount(request, cluster):
    """A write-back mount: the local directory, then Garage."""
    if request.param == "s3wb":
        _needs_s3(cluster)
    return "/" + request.param
