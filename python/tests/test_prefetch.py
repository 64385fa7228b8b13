"""Prefetch hints through stratafs (docs/PYTHON.md, "Prefetch"): `fs.prefetch` makes the workers
fetch the hinted files ahead of the reader (read afterwards without touching the UFS), unknown
paths are skipped and counted, and `stratafs.torch.PrefetchSampler` hints a shuffled epoch's
order to the cluster as a DataLoader draws it.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
import uuid

import fsspec

KiB = 1 << 10


def _worker_totals(cluster):
    """Summed over the workers: prefetch results from /metrics, and UFS reads."""
    status = json.loads(cluster.cli("status", "--json"))
    totals = {"ufs_reads": 0}
    for w in status["workers"]:
        # From /metrics, not the status: heartbeats carry counters a second late.
        text = urllib.request.urlopen(f"http://{w['http_addr']}/metrics", timeout=10).read().decode()
        for n in re.findall(r"^strata_worker_ufs_reads_total(?:\{[^}]*\})? (\d+)", text, re.M):
            totals["ufs_reads"] += int(n)
        for result, n in re.findall(r'strata_worker_prefetch_total\{result="(\w+)"\} (\d+)', text):
            totals[result] = totals.get(result, 0) + int(n)
    return totals


def _delta(after, before, key):
    return after.get(key, 0) - before.get(key, 0)


def _cold_files(cluster, n, size):
    """Files written straight into /data's directory: in the UFS, never in the cache."""
    name = f"prefetch-{uuid.uuid4().hex[:8]}"
    (cluster.data / name).mkdir()
    files = {}
    for i in range(n):
        data = bytes([(i * 7 + j) % 251 for j in range(256)]) * (size // 256)
        (cluster.data / name / f"f{i:03d}.bin").write_bytes(data)
        files[f"/data/{name}/f{i:03d}.bin"] = data
    return files


def test_hinted_files_are_fetched_ahead_and_unknown_paths_counted(cluster):
    fs = fsspec.filesystem("strata", master=cluster.master)
    files = _cold_files(cluster, 16, 64 * KiB)
    paths = sorted(files)
    before = _worker_totals(cluster)
    done = fs.prefetch(paths + ["/data/no-such-file.bin", "strata://data/also-missing.bin"])
    assert done["unknown"] == 2 and done["queued"] == len(paths), done
    deadline = time.time() + 30
    while _delta(_worker_totals(cluster), before, "fetched") < len(paths):
        assert time.time() < deadline, _worker_totals(cluster)
        time.sleep(0.05)
    fetched = _worker_totals(cluster)
    assert fetched["ufs_reads"] >= before["ufs_reads"] + len(paths), "the lane read them from the UFS"
    for p in paths:
        assert fs.cat_file(p) == files[p]
    after = _worker_totals(cluster)
    assert after["ufs_reads"] == fetched["ufs_reads"], "the hinted files were read from the cache"
    assert _delta(after, before, "hit") == len(paths)
    assert fs.prefetch([]) == {"queued": 0, "unknown": 0, "workers": done["workers"]}


class _Samples:
    def __init__(self, fs, paths):
        self.fs, self.paths = fs, paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.fs.cat_file(self.paths[i]), i


def test_prefetch_sampler_hints_a_shuffled_epoch(cluster):
    from torch.utils.data import DataLoader, RandomSampler

    from stratafs.torch import PrefetchSampler

    fs = fsspec.filesystem("strata", master=cluster.master)
    files = _cold_files(cluster, 48, 64 * KiB)
    paths = sorted(files)
    dataset = _Samples(fs, paths)
    sampler = PrefetchSampler(RandomSampler(dataset), fs, paths, lookahead=32, every=8)
    before = _worker_totals(cluster)
    loader = DataLoader(dataset, sampler=sampler, batch_size=None, num_workers=2,
                        multiprocessing_context="fork", timeout=120)
    seen = []
    for data, i in loader:
        assert data == files[paths[i]], paths[i]
        seen.append(i)
    assert sorted(seen) == list(range(len(paths)))
    assert sampler.hints_sent == len(paths) // 8
    after = _worker_totals(cluster)
    # The lane starts on the first hint, before the DataLoader's workers have started: most
    # samples find their file fetched. Each hinted file is read once, so hits cannot exceed it.
    hits = _delta(after, before, "hit")
    assert len(paths) // 2 <= hits <= len(paths), (before, after)
