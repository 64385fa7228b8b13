#!/usr/bin/env python3
"""stratafs against the other ways Python reads S3, on the same Garage, in one run.

For 1,000 files of 256 KiB and for one 1 GiB file, reads every byte through:

  s3fs direct            s3fs.S3FileSystem on the Garage endpoint
  simplecache cold/warm  fsspec "simplecache::s3://" (first pass downloads to local disk)
  strata cold/warm       stratafs ("strata://"), a standalone cluster over the same bucket;
                         cold = nothing cached, warm = later passes, 3 s after the cold one
                         (the blocks are then on the worker's disk too). This process is on
                         the standalone worker's host, so warm reads map the block files
                         (short-circuit through the socket it advertises)
  strata warm (TCP)      the same warm reads with STRATA_SHORT_CIRCUIT=0: over TCP, as from
                         another host; alternated with "strata warm", two passes each

Small files are read by 8 threads (cat_file each, as a DataLoader's workers would ask for
samples); the big file with one cat_file. Prints a Markdown table (files/s and MiB/s; the
best pass of each reader).

Needs: a Garage from scripts/garage.sh (STRATA_TEST_S3_* in the environment), a release
`strata` binary (cargo build --release --bin strata; or --strata-bin), and
`pip install ./python s3fs`.

  bash -c 'source scripts/garage.sh && garage_start && env | grep STRATA_TEST_S3 \\
      | sed "s/^/export /" > /tmp/garage.env && sleep 100000' &
  source /tmp/garage.env && python3 bench/stratafs_bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec
import s3fs

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def env(name: str) -> str:
    v = os.environ.get(name)
    if not v:
        raise SystemExit(f"{name} is not set: start Garage with scripts/garage.sh (see this file's doc)")
    return v


class Standalone:
    """`strata standalone` on 127.0.0.1, port chosen by the kernel."""

    def __init__(self, binary: str, memory: str):
        self.dir = Path(tempfile.mkdtemp(prefix="stratafs-bench-"))
        self.bin = binary
        (self.dir / "empty").mkdir()
        self.proc = subprocess.Popen(
            [binary, "standalone", "--dir", str(self.dir / "state"), "--rpc-addr", "127.0.0.1:0",
             "--mount", f"/boot=file://{self.dir / 'empty'}", "--memory", memory, "--nvme", "4GiB"],
            stdout=subprocess.PIPE, stderr=open(self.dir / "strata.log", "w"), text=True,
            env=dict(os.environ, RUST_LOG="warn"))
        # Auth is on: the CLI and this process's clients present the admin token it wrote.
        self.token_file = self.dir / "state" / "admin.token"
        for line in self.proc.stdout:
            m = re.match(r"\s*master\s+(\S+)", line)
            if m:
                self.master = m.group(1)
                os.environ["STRATA_TOKEN_FILE"] = str(self.token_file)
                return
        raise SystemExit("strata standalone did not start; log in " + str(self.dir))

    def cli(self, *args):
        out = subprocess.run([self.bin, "--master", self.master, *args], capture_output=True, text=True,
                             env=dict(os.environ, STRATA_TOKEN_FILE=str(self.token_file)))
        if out.returncode != 0:
            raise SystemExit(f"strata {args[0]} {args[1]}: {out.stderr.strip()}")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


def read_small(fs, paths, threads=8):
    def one(p):
        return len(fs.cat_file(p))

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(one, paths))
    return time.perf_counter() - started, total


def read_big(fs, path):
    started = time.perf_counter()
    n = len(fs.cat_file(path))
    return time.perf_counter() - started, n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--file-size", type=int, default=256 * 1024)
    ap.add_argument("--big-size", type=int, default=1 << 30)
    ap.add_argument("--strata-bin", default=str(REPO / "target" / "release" / "strata"))
    ap.add_argument("--memory", default="3GiB", help="DRAM tier of the standalone worker")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    endpoint, bucket = env("STRATA_TEST_S3_ENDPOINT"), env("STRATA_TEST_S3_BUCKET")
    key, secret = env("STRATA_TEST_S3_ACCESS_KEY"), env("STRATA_TEST_S3_SECRET_KEY")
    region = os.environ.get("STRATA_TEST_S3_REGION", "garage")
    s3_opts = {"key": key, "secret": secret, "endpoint_url": endpoint,
               "client_kwargs": {"region_name": region}}
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    s3 = s3fs.S3FileSystem(**s3_opts)

    print(f"writing {args.files} x {args.file_size} B and 1 x {args.big_size} B to s3://{bucket}/{prefix}",
          flush=True)
    small = [f"{bucket}/{prefix}/small/{i:05d}.bin" for i in range(args.files)]
    blob = os.urandom(args.file_size)
    s3.pipe({p: blob for p in small})
    big = f"{bucket}/{prefix}/big.bin"
    with s3.open(big, "wb", block_size=64 * MiB) as f:
        chunk = os.urandom(64 * MiB)
        for _ in range(args.big_size // len(chunk)):
            f.write(chunk)

    results = []

    def record(name, kind, seconds, nbytes, files):
        results.append({"reader": name, "set": kind, "seconds": seconds, "bytes": nbytes,
                        "files_per_s": files / seconds, "mib_per_s": nbytes / MiB / seconds})
        print(f"  {name:18s} {kind:6s} {seconds:8.2f}s  {files / seconds:9.1f} files/s  "
              f"{nbytes / MiB / seconds:9.1f} MiB/s", flush=True)

    def run(name, fs, small_paths, big_path):
        t, n = read_small(fs, small_paths)
        record(name, "small", t, n, len(small_paths))
        t, n = read_big(fs, big_path)
        record(name, "big", t, n, 1)

    s3fs.S3FileSystem.clear_instance_cache()
    run("s3fs direct", s3fs.S3FileSystem(**s3_opts), small, big)

    cache_dir = tempfile.mkdtemp(prefix="stratafs-bench-simplecache-")
    sc = fsspec.filesystem("simplecache", target_protocol="s3", target_options=s3_opts,
                           cache_storage=cache_dir)
    run("simplecache cold", sc, small, big)
    run("simplecache warm", sc, small, big)
    shutil.rmtree(cache_dir, ignore_errors=True)

    cluster = Standalone(args.strata_bin, args.memory)
    try:
        cluster.cli("mount", "add", "/bench", f"s3://{bucket}/{prefix}", "-o", f"endpoint={endpoint}",
                    "-o", f"region={region}", "-o", f"access_key_id={key}",
                    "-o", f"secret_access_key={secret}", "-o", "metadata_ttl=10m")
        st = fsspec.filesystem("strata", master=cluster.master)
        st_small = [f"/bench/small/{i:05d}.bin" for i in range(args.files)]
        run("strata cold", st, st_small, "/bench/big.bin")
        # Quiet for longer than the worker's nvme_writeback_idle_ms (1 s), as between epochs:
        # the blocks reach its disk, from which this host's readers map them.
        time.sleep(3)
        # The client reads STRATA_SHORT_CIRCUIT when it connects (its first call).
        os.environ["STRATA_SHORT_CIRCUIT"] = "0"
        tcp = fsspec.filesystem("strata", master=cluster.master, skip_instance_cache=True)
        tcp.info("/bench/big.bin")
        del os.environ["STRATA_SHORT_CIRCUIT"]
        for _ in range(2):
            run("strata warm", st, st_small, "/bench/big.bin")
            run("strata warm (TCP)", tcp, st_small, "/bench/big.bin")
        mapped = st.read_counters()["short_circuit_reads"]
        print(f"  strata warm: {mapped} block reads mapped; TCP client: "
              f"{tcp.read_counters()['short_circuit_reads']}", flush=True)
    finally:
        cluster.stop()
        s3.rm(f"{bucket}/{prefix}", recursive=True)

    print()
    print(f"| reader | {args.files} x {args.file_size // 1024} KiB: files/s | MiB/s "
          f"| 1 x {args.big_size // MiB} MiB: MiB/s |")
    print("|---|---:|---:|---:|")
    names = dict.fromkeys(r["reader"] for r in results)
    for name in names:
        s = max((r for r in results if r["reader"] == name and r["set"] == "small"), key=lambda r: r["mib_per_s"])
        b = max((r for r in results if r["reader"] == name and r["set"] == "big"), key=lambda r: r["mib_per_s"])
        print(f"| {name} | {s['files_per_s']:.0f} | {s['mib_per_s']:.0f} | {b['mib_per_s']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
