#!/usr/bin/env python3
"""What fork safety costs a parent that forks often (docs/PYTHON.md, "Fork").

Before every fork stratafs waits for calls in flight and shuts its Rust runtime down (joining
its threads); the runtime and the client's connections are built again on the next call. This
measures, in one run, alternating the two modes:

  fork RTT, idle       os.fork() + child os._exit(0) + waitpid, the filesystem not used since
                       the last fork (nothing to shut down: the cost of fork itself)
  fork RTT, after use  the same right after a cat_file (a live runtime to shut down)
  read, steady         one cat_file of a small cached file, the runtime up
  read, first after    the first cat_file after a fork (runtime and connections rebuilt)

Needs `pip install ./python` (or the wheel python/test.sh builds) and either --master of a
running cluster or a `strata` binary (--strata-bin, default target/release/strata) to start a
standalone over a temporary directory.

  python3 bench/fork_cost.py --rounds 300
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import fsspec

REPO = Path(__file__).resolve().parents[1]


def start_standalone(binary: str) -> tuple[subprocess.Popen, str, Path]:
    d = Path(tempfile.mkdtemp(prefix="strata-forkcost-"))
    (d / "data").mkdir()
    (d / "data" / "small.bin").write_bytes(os.urandom(64 * 1024))
    p = subprocess.Popen([binary, "standalone", "--dir", str(d / "state"), "--rpc-addr", "127.0.0.1:0",
                          "--mount", f"/data=file://{d / 'data'}", "--memory", "256MiB", "--nvme", "1GiB"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        m = re.match(r"\s*master\s+(\S+)", p.stdout.readline())
        if m:
            return p, m.group(1), d
    p.kill()
    raise SystemExit("strata standalone did not start")


def fork_rtt() -> float:
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return time.perf_counter() - t


def timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--master", help="host:port of a running cluster with /data/small.bin")
    ap.add_argument("--strata-bin", default=str(REPO / "target" / "release" / "strata"))
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    proc = tmp = None
    master = args.master
    if not master:
        proc, master, tmp = start_standalone(args.strata_bin)
    try:
        fs = fsspec.filesystem("strata", master=master)
        path = "/data/small.bin"
        fs.cat_file(path)
        idle, used, steady, first = [], [], [], []
        for _ in range(args.rounds):
            # Idle: the runtime was shut down by the previous fork and not rebuilt since.
            idle.append(fork_rtt())
            first.append(timed(lambda: fs.cat_file(path)))
            steady.append(timed(lambda: fs.cat_file(path)))
            used.append(fork_rtt())
            fs.cat_file(path)
        ms = lambda xs: f"{statistics.median(xs) * 1e3:.3f} ms (p90 {sorted(xs)[int(len(xs) * 0.9)] * 1e3:.3f})"
        print(f"load average {os.getloadavg()[0]:.2f}, {args.rounds} rounds, median (p90):")
        print(f"| fork RTT, idle | {ms(idle)} |")
        print(f"| fork RTT, after use (runtime shut down in the hook) | {ms(used)} |")
        print(f"| cat_file 64 KiB, steady | {ms(steady)} |")
        print(f"| cat_file 64 KiB, first after a fork (runtime + connections rebuilt) | {ms(first)} |")
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=10)
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
