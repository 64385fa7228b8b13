#!/usr/bin/env python3
"""Python on a worker's host: short-circuit (the worker's own socket, no sidecar) against TCP
and against a page-cache read of the same file, in one run.

Starts `strata standalone` over a local directory holding one file (1 GiB by default), reads
it cold over TCP, waits until the worker's reads have been quiet long enough for every block
to reach its NVMe tier (nvme_writeback_idle_ms, 1 s: --quiet 12 leaves room for the writes),
then, for each round: a new stratafs filesystem object's first pass ("first": every block
granted and mapped), its second pass ("kept": the mappings it kept), a pass of a client with
STRATA_SHORT_CIRCUIT=0 ("tcp"), and a `readinto` of the local file ("page cache"). Every pass
reads into the same already-touched bytearray, so no pass pays for faulting in new memory
(a 1 GiB `cat_file` does, whoever serves it). Then the first read of single 4 MiB blocks by a
new process-like client, mapped vs TCP (p50/p90 of 64).

Needs a release `strata` (cargo build --release --bin strata) and `pip install ./python`.

  python3 bench/colocated_bench.py [--size-mib 1024] [--rounds 2] [--quiet 12]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import fsspec

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quiet", type=float, default=12.0, help="seconds of quiet after the cold read")
    ap.add_argument("--strata-bin", default=str(REPO / "target" / "release" / "strata"))
    args = ap.parse_args()
    size = args.size_mib * MiB

    root = Path(tempfile.mkdtemp(prefix="colocated-bench-"))
    proc = None
    try:
        (root / "ufs").mkdir()
        local = root / "ufs" / "big.bin"
        with open(local, "wb") as f:
            for _ in range(args.size_mib // 64):
                f.write(os.urandom(64 * MiB))
        proc = subprocess.Popen(
            [args.strata_bin, "standalone", "--dir", str(root / "state"), "--rpc-addr", "127.0.0.1:0",
             "--mount", f"/u=file://{root / 'ufs'}", "--memory", f"{args.size_mib + 1024}MiB",
             "--nvme", f"{2 * args.size_mib + 1024}MiB"],
            stdout=subprocess.PIPE, stderr=open(root / "strata.log", "w"), text=True)
        master = None
        for line in proc.stdout:
            m = re.match(r"\s*master\s+(\S+)", line)
            if m:
                master = m.group(1)
                break
        if master is None:
            raise SystemExit(f"strata standalone did not start; log in {root}")
        os.environ["STRATA_TOKEN_FILE"] = str(root / "state" / "admin.token")

        def new_fs(short_circuit: bool):
            # A client reads STRATA_SHORT_CIRCUIT when it connects (its first call).
            os.environ["STRATA_SHORT_CIRCUIT"] = "1" if short_circuit else "0"
            fs = fsspec.filesystem("strata", master=master, skip_instance_cache=True)
            fs.info("/u/big.bin")
            del os.environ["STRATA_SHORT_CIRCUIT"]
            return fs

        buf = bytearray(size)

        def timed(read) -> float:
            started = time.perf_counter()
            n = read()
            assert n == size, n
            return size / MiB / (time.perf_counter() - started)

        def strata_pass(fs) -> float:
            def read():
                with fs.open("/u/big.bin", "rb") as f:
                    return f.readinto(buf)
            return timed(read)

        def page_cache_pass() -> float:
            def read():
                with open(local, "rb", buffering=0) as f:
                    return f.readinto(buf)
            return timed(read)

        tcp = new_fs(False)
        print(f"cold (TCP)        {strata_pass(tcp):8.0f} MiB/s", flush=True)
        time.sleep(args.quiet)
        rows = []
        for r in range(args.rounds):
            fresh = new_fs(True)
            first, kept = strata_pass(fresh), strata_pass(fresh)
            over_tcp, page = strata_pass(tcp), page_cache_pass()
            mapped = fresh.read_counters()["short_circuit_reads"]
            rows.append((first, kept, over_tcp, page))
            print(f"round {r + 1}: first {first:.0f}, kept {kept:.0f}, tcp {over_tcp:.0f}, page cache {page:.0f}"
                  f" MiB/s; {mapped} block reads mapped", flush=True)

        block = 4 * MiB
        for name, fs in (("mapped", new_fs(True)), ("tcp", new_fs(False))):
            lat = []
            for i in range(min(64, args.size_mib // 4)):
                started = time.perf_counter()
                fs.cat_file("/u/big.bin", i * block, (i + 1) * block)
                lat.append(time.perf_counter() - started)
            lat.sort()
            print(f"first read of one 4 MiB block, {name}: p50 {lat[len(lat) // 2] * 1e3:.2f} ms, "
                  f"p90 {lat[len(lat) * 9 // 10] * 1e3:.2f} ms", flush=True)

        print()
        print("| round | first | kept | tcp | page cache | first / page | kept / page | tcp / page |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for i, (first, kept, over_tcp, page) in enumerate(rows):
            print(f"| {i + 1} | {first:.0f} | {kept:.0f} | {over_tcp:.0f} | {page:.0f} | {first / page:.2f}x "
                  f"| {kept / page:.2f}x | {over_tcp / page:.2f}x |")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
