#!/usr/bin/env python3
"""A cold, shuffled epoch of small files on Garage through a PyTorch DataLoader, with and
without prefetch hints (issue 19's benchmark; docs/PYTHON.md, "Prefetch").

Each round reads two fresh sets of FILES x SIZE objects (nothing cached, nothing loaded), one
without hints and one through `stratafs.torch.PrefetchSampler`; the order of the two alternates
between rounds, so both see the same machine. The dataset's index (one `find`) is built before
the clock starts. Then the hinted set is read once more, every file cached: that warm epoch is
the ceiling (what the DataLoader, Python and this machine's cores allow with no store in the
way), which hints can approach but not pass. Reports files/s of each epoch, the ratio hints /
no hints and each cold epoch against the warm one, with the load average at the start and the
end.

With `--store-delay-ms D` every read of the store (the cluster's and the direct GETs) goes
through `bench/delay_proxy.py`, which holds each request D ms before passing it on: a store
across a network (S3 answers a small GET in 10-30 ms) rather than one sharing this machine's
cores, where the store's CPU, not its round trips, sets the pace.

Needs a Garage from scripts/garage.sh (STRATA_TEST_S3_* in the environment), a release `strata`
binary (cargo build --release --bin strata; or --strata-bin), and `pip install ./python torch
boto3`:

  bash -c 'source scripts/garage.sh && garage_start && env | grep STRATA_TEST_S3 \\
      | sed "s/^/export /" > /tmp/garage.env && sleep 100000' &
  source /tmp/garage.env && python3 bench/prefetch_bench.py --files 10000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.parse
import uuid
from pathlib import Path

import boto3
import fsspec
from botocore.config import Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from delay_proxy import DelayProxy  # noqa: E402
from small_files_bench import REPO, Standalone, env, threaded  # noqa: E402

KiB = 1 << 10


class Samples:
    """A map-style dataset over strata:// files, as a training job's Dataset is."""

    def __init__(self, fs, paths, size):
        self.fs, self.paths, self.size = fs, paths, size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        data = self.fs.cat_file(self.paths[i])
        if len(data) != self.size:
            raise RuntimeError(f"{self.paths[i]}: {len(data)} bytes, not {self.size}")
        return len(data)


def lane_counts(cluster):
    """The workers' prefetch lane results so far (strata_worker_prefetch_total by result)."""
    import re
    import urllib.request

    totals = {}
    for w in json.loads(cluster.cli("status", "--json"))["workers"]:
        text = urllib.request.urlopen(f"http://{w['http_addr']}/metrics", timeout=10).read().decode()
        for result, n in re.findall(r'strata_worker_prefetch_total\{result="(\w+)"\} (\d+)', text):
            totals[result] = totals.get(result, 0) + int(n)
    return totals


def epoch(fs, root, size, workers, hints, lookahead, seed):
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    from stratafs.torch import PrefetchSampler

    paths = sorted(fs.find(root))
    dataset = Samples(fs, paths, size)
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    if hints:
        sampler = PrefetchSampler(sampler, fs, paths, lookahead=lookahead)
    loader = DataLoader(dataset, sampler=sampler, batch_size=None, num_workers=workers,
                        multiprocessing_context="fork", timeout=600)
    started = time.perf_counter()
    total = sum(loader)
    seconds = time.perf_counter() - started
    if total != len(paths) * size:
        raise SystemExit(f"read {total} bytes, not {len(paths) * size}")
    return len(paths), seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--size", type=int, default=64 * KiB, help="bytes per file")
    ap.add_argument("--workers", type=int, default=4, help="DataLoader workers")
    ap.add_argument("--lookahead", type=int, default=512, help="files hinted ahead of the sampler")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--strata-bin", default=str(REPO / "target" / "release" / "strata"))
    ap.add_argument("--memory", default="4GiB", help="DRAM tier of the standalone worker")
    ap.add_argument("--prefetch-parallelism", type=int,
                    help="the worker's prefetch fetches in flight (its prefetch_parallelism; default 16)")
    ap.add_argument("--store-delay-ms", type=float, default=0.0,
                    help="reach the store through a proxy that delays every request by this much "
                         "(bench/delay_proxy.py), as a store across a network is; 0 = straight to it")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    endpoint, bucket = env("STRATA_TEST_S3_ENDPOINT"), env("STRATA_TEST_S3_BUCKET")
    key, secret = env("STRATA_TEST_S3_ACCESS_KEY"), env("STRATA_TEST_S3_SECRET_KEY")
    region = os.environ.get("STRATA_TEST_S3_REGION", "garage")

    def s3_client(url):
        return boto3.client("s3", endpoint_url=url, aws_access_key_id=key, aws_secret_access_key=secret,
                            region_name=region, config=Config(max_pool_connections=64))

    boto = s3_client(endpoint)
    # Objects are written straight to the store; every read (the direct GETs and the cluster's)
    # goes through the delaying proxy when there is one.
    proxy = None
    read_endpoint = endpoint
    if args.store_delay_ms > 0:
        store = urllib.parse.urlsplit(endpoint)
        proxy = DelayProxy(store.hostname, store.port, args.store_delay_ms)
        read_endpoint = f"http://127.0.0.1:{proxy.port}"
        print(f"reads reach the store through a proxy adding {args.store_delay_ms:g} ms per request", flush=True)
    read_boto = s3_client(read_endpoint)
    prefix = f"pfbench-{uuid.uuid4().hex[:8]}"
    sets = [f"r{r}-{kind}" for r in range(args.rounds) for kind in ("plain", "hinted")]
    blob = os.urandom(args.size)
    keys = [f"{prefix}/{s}/{i // 1000:02}/f{i:05}.bin" for s in sets for i in range(args.files)]
    print(f"writing {len(keys)} x {args.size} B to s3://{bucket}/{prefix}", flush=True)

    def put(k):
        boto.put_object(Bucket=bucket, Key=k, Body=blob)
        return 1

    threaded(put, keys, 32)

    # What the store itself serves: the first set's objects read straight from Garage with
    # boto3, 32 at a time (not through Strata, so the epochs still start cold).
    def get(k):
        return len(read_boto.get_object(Bucket=bucket, Key=k)["Body"].read())

    direct_keys = keys[: args.files]
    direct_seconds, _ = threaded(get, direct_keys, 32)
    direct_rate = len(direct_keys) / direct_seconds
    print(f"  direct GETs from the store, 32 at a time: {direct_rate:8.0f} files/s", flush=True)
    load_start = os.getloadavg()
    tuned = f"prefetch_parallelism = {args.prefetch_parallelism}\n" if args.prefetch_parallelism else ""
    cluster = Standalone(args.strata_bin, args.memory, tuned)
    results = []
    try:
        cluster.cli("mount", "add", "/bench", f"s3://{bucket}/{prefix}", "-o", f"endpoint={read_endpoint}",
                    "-o", f"region={region}", "-o", f"access_key_id={key}", "-o", f"secret_access_key={secret}",
                    "-o", "metadata_ttl=10m")
        fs = fsspec.filesystem("strata", master=cluster.master, skip_instance_cache=True)
        for r in range(args.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            for hints in order:
                root = f"/bench/r{r}-{'hinted' if hints else 'plain'}"
                before = lane_counts(cluster)
                n, seconds = epoch(fs, root, args.size, args.workers, hints, args.lookahead, seed=r)
                after = lane_counts(cluster)
                lane = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                results.append({"round": r, "hints": hints, "files": n, "seconds": seconds, "files_per_s": n / seconds,
                                "prefetch_lane": lane})
                print(f"  round {r} {'hints   ' if hints else 'no hints'} {seconds:7.2f}s {n / seconds:8.0f} files/s"
                      + (f"  lane {lane}" if hints else ""), flush=True)
            n, seconds = epoch(fs, f"/bench/r{r}-hinted", args.size, args.workers, False, args.lookahead, seed=r + 1)
            results.append({"round": r, "warm": True, "files": n, "seconds": seconds, "files_per_s": n / seconds})
            print(f"  round {r} warm     {seconds:7.2f}s {n / seconds:8.0f} files/s (the ceiling)", flush=True)
    finally:
        cluster.stop()
        if proxy:
            proxy.close()
    load_end = os.getloadavg()
    print(f"\nload average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end; "
          f"{args.files} x {args.size // KiB} KiB, {args.workers} DataLoader workers, lookahead {args.lookahead}, "
          f"prefetch_parallelism {args.prefetch_parallelism or 'default (16)'}, "
          f"store delay {args.store_delay_ms:g} ms")
    print("| round | no hints files/s | hints files/s | hints / no hints | warm (ceiling) files/s "
          "| no hints / warm | hints / warm |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in range(args.rounds):
        plain = next(x for x in results if x["round"] == r and x.get("hints") is False)
        hinted = next(x for x in results if x["round"] == r and x.get("hints") is True)
        warm = next(x for x in results if x["round"] == r and x.get("warm"))
        p, h, w = plain["files_per_s"], hinted["files_per_s"], warm["files_per_s"]
        print(f"| {r} | {p:.0f} | {h:.0f} | {h / p:.2f}x | {w:.0f} | {p / w:.2f} | {h / w:.2f} |")
    print(f"direct GETs from the store (boto3, 32 threads): {direct_rate:.0f} files/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "direct_files_per_s": direct_rate,
                                               "load_start": load_start,
                                               "load_end": load_end, "results": results}, indent=2))


if __name__ == "__main__":
    main()
