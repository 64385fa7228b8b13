#!/usr/bin/env python3
"""Small files through Strata against the other ways Python reads S3, on the same Garage, in one
run (issue 17's benchmark):

  warmup       `strata warmup` of FILES x 16 KiB, against a threaded Python client reading the
               same objects (boto3, --boto-threads threads). The Rust benchmark
               (`warmup_bench throughput s3`) gives the same warmup against a direct opendal
               read; the stronger of the two ceilings is the one to beat.
  cold epoch   FILES x 64 KiB read once through Python, nothing cached: s3fs, fsspec
               `simplecache::s3` (first pass), and `strata://` (a standalone cluster over the
               same bucket, nothing loaded).
  warm epoch   the same read again: s3fs (no cache: the same as cold), `simplecache` (a local
               file each), `strata://` (the cluster's DRAM).

Each epoch is read two ways, both as a training job would: `--threads` threads each calling
`cat_file` on its share of the paths (a DataLoader's workers asking for samples), and one
`cat` of every path (a batched read: s3fs and strata both fetch many at once). The file list
comes from one listing (`find`) before the clock starts, as a dataset builds its index once.

Needs: a Garage from scripts/garage.sh (STRATA_TEST_S3_* in the environment), a release
`strata` binary (cargo build --release --bin strata; or --strata-bin), and
`pip install ./python s3fs boto3`. Prints a Markdown table; `--json PATH` writes the figures.

  bash -c 'source scripts/garage.sh && garage_start && env | grep STRATA_TEST_S3 \\
      | sed "s/^/export /" > /tmp/garage.env && sleep 100000' &
  source /tmp/garage.env && python3 bench/small_files_bench.py
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

import boto3
import fsspec
import s3fs
from botocore.config import Config

REPO = Path(__file__).resolve().parents[1]
KiB = 1 << 10


def env(name: str) -> str:
    v = os.environ.get(name)
    if not v:
        raise SystemExit(f"{name} is not set: start Garage with scripts/garage.sh (see this file's doc)")
    return v


class Standalone:
    """`strata standalone` on 127.0.0.1, port chosen by the kernel, fresh state."""

    def __init__(self, binary: str, memory: str, worker_settings: str = ""):
        """`worker_settings`: TOML for the standalone's worker (`--worker-config`), if any."""
        self.dir = Path(tempfile.mkdtemp(prefix="small-files-bench-"))
        self.bin = binary
        (self.dir / "empty").mkdir()
        extra = []
        if worker_settings:
            (self.dir / "worker.toml").write_text(worker_settings)
            extra = ["--worker-config", str(self.dir / "worker.toml")]
        self.proc = subprocess.Popen(
            [binary, "standalone", "--dir", str(self.dir / "state"), "--rpc-addr", "127.0.0.1:0",
             "--mount", f"/boot=file://{self.dir / 'empty'}", "--memory", memory, "--nvme", "4GiB", *extra],
            stdout=subprocess.PIPE, stderr=open(self.dir / "strata.log", "w"), text=True,
            env=dict(os.environ, RUST_LOG="warn"))
        for line in self.proc.stdout:
            m = re.match(r"\s*master\s+(\S+)", line)
            if m:
                self.master = m.group(1)
                # Clients in this process find the standalone's admin token there.
                os.environ["STRATA_DIR"] = str(self.dir / "state")
                return
        raise SystemExit("strata standalone did not start; log in " + str(self.dir))

    def cli(self, *args) -> str:
        out = subprocess.run([self.bin, "--master", self.master, *args], check=True, capture_output=True,
                             text=True, env=dict(os.environ, STRATA_DIR=str(self.dir / "state")))
        return out.stdout

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


def threaded(fn, items, threads):
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(fn, items))
    return time.perf_counter() - started, total


def checked(got: bytes, want: bytes, path: str) -> int:
    if got != want:
        raise SystemExit(f"{path}: {len(got)} bytes read, not the {len(want)} bytes written")
    return len(got)


def epoch_threads(fs, paths, threads, want):
    return threaded(lambda p: checked(fs.cat_file(p), want, p), paths, threads)


def epoch_batched(fs, paths, want):
    started = time.perf_counter()
    out = fs.cat(paths)
    seconds = time.perf_counter() - started
    if len(out) != len(paths):
        raise SystemExit(f"cat of {len(paths)} paths returned {len(out)}")
    return seconds, sum(checked(v, want, p) for p, v in out.items())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--warm-size", type=int, default=16 * KiB, help="bytes per file of the warmup set")
    ap.add_argument("--epoch-size", type=int, default=64 * KiB, help="bytes per file of the epoch set")
    ap.add_argument("--threads", type=int, default=8, help="reader threads of a threaded epoch")
    ap.add_argument("--boto-threads", type=int, default=16, help="threads of the boto3 ceiling")
    ap.add_argument("--strata-bin", default=str(REPO / "target" / "release" / "strata"))
    ap.add_argument("--memory", default="3GiB", help="DRAM tier of the standalone worker")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    endpoint, bucket = env("STRATA_TEST_S3_ENDPOINT"), env("STRATA_TEST_S3_BUCKET")
    key, secret = env("STRATA_TEST_S3_ACCESS_KEY"), env("STRATA_TEST_S3_SECRET_KEY")
    region = os.environ.get("STRATA_TEST_S3_REGION", "garage")
    s3_opts = {"key": key, "secret": secret, "endpoint_url": endpoint, "client_kwargs": {"region_name": region}}
    prefix = f"sfbench-{uuid.uuid4().hex[:8]}"
    s3 = s3fs.S3FileSystem(**s3_opts)
    boto = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                        region_name=region, config=Config(max_pool_connections=args.boto_threads * 2))

    n = args.files
    warm_keys = [f"{prefix}/warm/{i // 1000:02}/f{i:05}.bin" for i in range(n)]
    epoch_keys = [f"{prefix}/epoch/{i // 1000:02}/f{i:05}.bin" for i in range(n)]
    print(f"writing {n} x {args.warm_size} B and {n} x {args.epoch_size} B to s3://{bucket}/{prefix}", flush=True)
    blob_w, blob_e = os.urandom(args.warm_size), os.urandom(args.epoch_size)

    def put(kv):
        boto.put_object(Bucket=bucket, Key=kv[0], Body=kv[1])
        return 1

    threaded(put, [(k, blob_w) for k in warm_keys] + [(k, blob_e) for k in epoch_keys], 32)

    results = []

    def record(test, reader, how, seconds, nbytes, files):
        r = {"test": test, "reader": reader, "how": how, "seconds": seconds, "bytes": nbytes,
             "files_per_s": files / seconds, "mib_per_s": nbytes / (1 << 20) / seconds}
        results.append(r)
        print(f"  {test:11s} {reader:18s} {how:10s} {seconds:7.2f}s {r['files_per_s']:9.0f} files/s "
              f"{r['mib_per_s']:8.1f} MiB/s", flush=True)

    # The threaded Python ceiling for the warmup: every warm-set object read once.
    def get(k):
        return checked(boto.get_object(Bucket=bucket, Key=k)["Body"].read(), blob_w, k)

    t, b = threaded(get, warm_keys, args.boto_threads)
    record("warmup", f"boto3 x{args.boto_threads}", "direct", t, b, n)

    cluster = Standalone(args.strata_bin, args.memory)
    try:
        cluster.cli("mount", "add", "/bench", f"s3://{bucket}/{prefix}", "-o", f"endpoint={endpoint}",
                    "-o", f"region={region}", "-o", f"access_key_id={key}", "-o", f"secret_access_key={secret}",
                    "-o", "metadata_ttl=10m")
        started = time.perf_counter()
        cluster.cli("warmup", "/bench/warm", "--json")
        record("warmup", "strata warmup", "cli", time.perf_counter() - started, n * args.warm_size, n)

        st = fsspec.filesystem("strata", master=cluster.master, skip_instance_cache=True)
        s3fs.S3FileSystem.clear_instance_cache()
        s3r = s3fs.S3FileSystem(**s3_opts)
        cache_dir = tempfile.mkdtemp(prefix="small-files-bench-simplecache-")
        sc = fsspec.filesystem("simplecache", target_protocol="s3", target_options=s3_opts,
                               cache_storage=cache_dir, skip_instance_cache=True)
        readers = [("s3fs", s3r, f"{bucket}/{prefix}/epoch"), ("simplecache::s3", sc, f"{bucket}/{prefix}/epoch"),
                   ("strata", st, "/bench/epoch")]
        for name, fs, root in readers:
            # The dataset's index: one listing, before the clock starts (simplecache lists through s3).
            lister = s3r if name == "simplecache::s3" else fs
            paths = sorted(lister.find(root))
            assert len(paths) == n, f"{name}: listed {len(paths)} of {n}"
            half = n // 2
            # Cold: the first half threaded, the second half batched, each read once.
            t, b = epoch_threads(fs, paths[:half], args.threads, blob_e)
            record("cold epoch", name, f"{args.threads} thr", t, b, half)
            t, b = epoch_batched(fs, paths[half:], blob_e)
            record("cold epoch", name, "batched", t, b, n - half)
            # Warm: every file again, both ways.
            t, b = epoch_threads(fs, paths, args.threads, blob_e)
            record("warm epoch", name, f"{args.threads} thr", t, b, n)
            t, b = epoch_batched(fs, paths, blob_e)
            record("warm epoch", name, "batched", t, b, n)
        shutil.rmtree(cache_dir, ignore_errors=True)
    finally:
        cluster.stop()
        s3.rm(f"{bucket}/{prefix}", recursive=True)

    def fps(test, reader, how):
        return next(r["files_per_s"] for r in results if (r["test"], r["reader"], r["how"]) == (test, reader, how))

    print()
    print("| test | how | strata files/s | against | its files/s | ratio |")
    print("|---|---|---:|---|---:|---:|")
    w = fps("warmup", "strata warmup", "cli")
    b3 = fps("warmup", f"boto3 x{args.boto_threads}", "direct")
    print(f"| warmup {n} x {args.warm_size // KiB} KiB | cli | {w:.0f} | boto3 x{args.boto_threads} | {b3:.0f} | {w / b3:.2f}x |")
    for test in ("cold epoch", "warm epoch"):
        for how in (f"{args.threads} thr", "batched"):
            s = fps(test, "strata", how)
            for other in ("s3fs", "simplecache::s3"):
                o = fps(test, other, how)
                print(f"| {test} {n} x {args.epoch_size // KiB} KiB | {how} | {s:.0f} | {other} | {o:.0f} | {s / o:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
