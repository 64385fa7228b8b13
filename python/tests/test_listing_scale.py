"""Listings at the sizes training data has: a directory of 100,000 entries through `ls`, the
paged `ls_iter`, and `find`/`glob`/`du` (one paged recursive listing by the master), and
`find` against fsspec's local filesystem on the same tree."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import fsspec
import pytest


@pytest.fixture(scope="module")
def flat(cluster):
    # On tmpfs when the machine has one: 100,000 unlinks of inodes that fell out of the cache
    # take minutes on a busy virtual disk, seconds in memory.
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="stratafs-flat-", dir=shm if shm.is_dir() else None))
    d = root / "flat100k"
    d.mkdir()
    for i in range(100_000):
        (d / f"s{i:06}").write_bytes(b"x")
    cluster.cli("mount", "add", "/flat", f"file://{root}", "-o", "metadata_ttl=60s")
    yield "/flat/flat100k"
    cluster.cli("mount", "rm", "/flat")
    shutil.rmtree(root, ignore_errors=True)


def test_a_100k_entry_directory_through_ls_find_glob_du(fs, flat):
    names = fs.ls(flat, detail=False)
    assert len(names) == 100_000
    assert names[0] == flat + "/s000000" and names[-1] == flat + "/s099999"
    # Page by page: a caller that cannot hold the listing never has to.
    assert sum(1 for _ in fs.ls_iter(flat)) == 100_000
    found = fs.find(flat)
    assert len(found) == 100_000 and found == sorted(found)
    assert fs.du(flat) == 100_000
    assert fs.glob(flat + "/s00001?") == [f"{flat}/s{i:06}" for i in range(10, 20)]


@pytest.mark.parametrize("maxdepth", [None, 1, 2, 3])
@pytest.mark.parametrize("withdirs", [False, True])
def test_find_matches_the_local_filesystem(fs, cluster, maxdepth, withdirs):
    root = cluster.data / "findtree"
    if not root.exists():
        for a in range(3):
            for b in range(2):
                (root / f"a{a}" / f"b{b}").mkdir(parents=True)
                (root / f"a{a}" / f"b{b}" / "leaf.bin").write_bytes(b"12345")
            (root / f"a{a}" / "mid.bin").write_bytes(b"1")
        (root / "top.bin").write_bytes(b"")
    local = fsspec.filesystem("file")
    want = local.find(str(root), maxdepth=maxdepth, withdirs=withdirs, detail=True)
    got = fs.find("/data/findtree", maxdepth=maxdepth, withdirs=withdirs, detail=True)
    as_strata = {"/data/findtree" + p[len(str(root)):]: info for p, info in want.items()}
    assert sorted(got) == sorted(as_strata)
    for p, info in got.items():
        assert info["type"] == as_strata[p]["type"], p
        if info["type"] == "file":
            assert info["size"] == as_strata[p]["size"], p
    # du from the same stream: the same paths and file sizes as fsspec's generic du on the
    # local tree (a local directory's own size is its inode's; ours is 0).
    want_du = {"/data/findtree" + p[len(str(root)):]: n
               for p, n in local.du(str(root), total=False, maxdepth=maxdepth, withdirs=withdirs).items()}
    got_du = fs.du("/data/findtree", total=False, maxdepth=maxdepth, withdirs=withdirs)
    assert sorted(got_du) == sorted(want_du)
    for p, n in got_du.items():
        assert n == (want_du[p] if as_strata.get(p, {}).get("type") == "file" else 0), p
    assert fs.du("/data/findtree", maxdepth=maxdepth) == local.du(str(root), maxdepth=maxdepth)
    # A file finds itself; a missing path finds nothing.
    assert fs.find("/data/findtree/top.bin") == ["/data/findtree/top.bin"]
    assert fs.find("/data/findtree/missing") == []
