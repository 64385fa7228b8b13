"""Batched reads through fsspec: ``cat`` of many paths (a list, a glob, a recursive directory)
and ``cat_ranges`` answer exactly what one ``cat_file`` per path answers — bytes, and the same
exception types in the same places under each ``on_error`` — while the stats and the bytes go
out in a few batched requests (counted on the master's and the workers' /metrics)."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid

import pytest


def _metric(text: str, name: str, labels: str = "") -> float:
    """The sum of a counter's series whose labels contain ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def _scrape(cluster) -> str:
    """Every service's /metrics (the standalone's master and worker, the second worker)."""
    status = json.loads(cluster.cli("status", "--json"))
    addrs = {w["http_addr"] for w in status["workers"] if w.get("http_addr")}
    text = []
    for addr in sorted(addrs):
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
            text.append(r.read().decode())
    return "\n".join(text)


@pytest.fixture
def tree(fs, cluster):
    """60 small files (and a subdirectory with 5 more) under a fresh directory of /data."""
    name = f"batched-{uuid.uuid4().hex[:8]}"
    base = cluster.data / name
    (base / "sub").mkdir(parents=True)
    files = {}
    for i in range(60):
        data = bytes((i * 31 + j) % 251 for j in range(100 + i * 97))
        (base / f"f{i:03d}.bin").write_bytes(data)
        files[f"/data/{name}/f{i:03d}.bin"] = data
    for i in range(5):
        data = f"nested {i}".encode() * (i + 1)
        (base / "sub" / f"n{i}.txt").write_bytes(data)
        files[f"/data/{name}/sub/n{i}.txt"] = data
    return f"/data/{name}", files


def test_cat_of_many_paths_equals_cat_file_of_each(fs, cluster, tree):
    base, files = tree
    flat = sorted(p for p in files if "/sub/" not in p)
    before = _scrape(cluster)
    got = fs.cat(flat)
    after = _scrape(cluster)
    assert got == {p: files[p] for p in flat}
    assert got == {p: fs.cat_file(p) for p in flat}
    # Batched: every file in a ReadMany, far fewer requests than files (two workers).
    items = _metric(after, "strata_worker_read_many_items_total") - _metric(before, "strata_worker_read_many_items_total")
    batches = (_metric(after, "strata_worker_read_many_requests_total")
               - _metric(before, "strata_worker_read_many_requests_total"))
    assert items == len(flat), (items, batches)
    assert 1 <= batches <= 4, batches
    stat_many = (_metric(after, "strata_master_rpc_requests_total", 'rpc="stat_many"')
                 - _metric(before, "strata_master_rpc_requests_total", 'rpc="stat_many"'))
    stats = (_metric(after, "strata_master_rpc_requests_total", 'rpc="stat"')
             - _metric(before, "strata_master_rpc_requests_total", 'rpc="stat"'))
    assert (stat_many, stats) == (1, 0), "one StatMany instead of a stat per file"

    # A glob, and a range of each.
    assert fs.cat(f"{base}/f00*.bin") == {p: files[p] for p in flat[:10]}
    assert fs.cat(f"strata:/{base}/f01*.bin", start=5, end=-3) == {p: files[p][5:-3] for p in flat[10:20]}
    # Recursive: directories are among the paths, as fsspec expands them.
    with pytest.raises(IsADirectoryError):
        fs.cat(base, recursive=True)
    assert fs.cat(base, recursive=True, on_error="omit") == files
    returned = fs.cat(base, recursive=True, on_error="return")
    assert isinstance(returned[base], IsADirectoryError)
    assert isinstance(returned[f"{base}/sub"], IsADirectoryError)
    assert {p: v for p, v in returned.items() if not isinstance(v, Exception)} == files
    # One path stays one path's bytes.
    assert fs.cat(flat[3]) == files[flat[3]]


def test_cat_errors_per_path_follow_on_error(fs, tree):
    base, files = tree
    ok = sorted(files)[:3]
    paths = [ok[0], f"{base}/missing.bin", ok[1], "/nomount/x", ok[2]]
    with pytest.raises(FileNotFoundError):
        fs.cat(paths)
    assert fs.cat(paths, on_error="omit") == {p: files[p] for p in ok}
    got = fs.cat(paths, on_error="return")
    assert isinstance(got[f"{base}/missing.bin"], FileNotFoundError)
    assert isinstance(got["/nomount/x"], FileNotFoundError)
    assert {p: got[p] for p in ok} == {p: files[p] for p in ok}
    with pytest.raises(ValueError):
        fs.cat([ok[0], "/data/../etc/passwd"])


def test_cat_ranges_equals_cat_file_per_range_with_errors_in_place(fs, tree):
    base, files = tree
    names = sorted(files)
    paths = names[:40] + [f"{base}/missing.bin", base, names[40]]
    starts = [i % 7 for i in range(40)] + [0, 0, -10]
    ends = [None if i % 3 else 50 + i for i in range(40)] + [5, 5, None]
    got = fs.cat_ranges(paths, starts, ends)
    assert len(got) == len(paths)
    for i in range(40):
        assert got[i] == fs.cat_file(paths[i], starts[i], ends[i]) == files[paths[i]][starts[i]:ends[i]]
    assert isinstance(got[40], FileNotFoundError)
    assert isinstance(got[41], IsADirectoryError)
    assert got[42] == files[names[40]][-10:]
    with pytest.raises(FileNotFoundError):
        fs.cat_ranges(paths, starts, ends, on_error="raise")
    # Single values apply to every path.
    assert fs.cat_ranges(names[:5], 1, 4) == [files[p][1:4] for p in names[:5]]
    with pytest.raises(ValueError):
        fs.cat_ranges(names[:2], [0], [1, 2])


def test_cat_many_reads_a_file_changed_since_it_was_listed_at_its_new_version(fs, cluster, tree):
    base, files = tree
    names = sorted(p for p in files if "/sub/" not in p)[:8]
    assert len(fs.ls(base)) == 61  # the client now holds these files' stats (from the listing)
    changed = b"a new version, longer than the old one " * 300
    (cluster.data / names[2][len("/data/"):]).write_bytes(changed)
    got = fs.cat(names)
    assert got[names[2]] == changed
    assert {p: got[p] for p in names if p != names[2]} == {p: files[p] for p in names if p != names[2]}
