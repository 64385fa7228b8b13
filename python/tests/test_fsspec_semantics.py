"""fsspec semantics: the same calls on fsspec's local filesystem (``auto_mkdir=True``, in a temp
dir) and on ``strata://`` (the cluster's ``/data``, a ``mode=write-through`` mount over another
local temp dir) give the same results — names returned (relative to each side's root), the bytes
and directories left on disk, the exception types — for put/get/cp of nested trees (trailing
slashes, existing and new targets, globs, maxdepth), mv, rm, touch, modified/created,
open(mode="ab"), mkdir/makedirs/rmdir and errors. rm with globs or maxdepth (which the local
filesystem does not take) is compared with fsspec's memory filesystem. Then fsspec's own
abstract suites (fsspec/tests/abstract) run against strata://, and a 64 MiB copy shows that no
byte of a copy passes through the client.

Each side's tree is read straight from its directory on disk (the strata side from the mount's
UFS directory), so what is compared is what the UFS holds, not what a listing says.
"""

from __future__ import annotations

import datetime
import errno
import io
import json
import os
import shutil
import time
import uuid

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.tests.abstract import AbstractFixtures
from fsspec.tests.abstract.copy import AbstractCopyTests
from fsspec.tests.abstract.get import AbstractGetTests
from fsspec.tests.abstract.open import AbstractOpenTests
from fsspec.tests.abstract.pipe import AbstractPipeTests
from fsspec.tests.abstract.put import AbstractPutTests


def disk(path) -> dict:
    """What a directory holds: relative path -> bytes for files, None for directories."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        rel = os.path.relpath(dirpath, path)
        for d in dirnames:
            out[os.path.normpath(os.path.join(rel, d))] = None
        for f in filenames:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.normpath(os.path.join(rel, f))] = fh.read()
    return out


class Side:
    """One filesystem under test: ``fs``, the root of this test's tree on it, and the local
    directory that holds the tree (None for the memory filesystem)."""

    def __init__(self, name, fs, root, backing):
        self.name = name
        self.fs = fs
        self.root = root.rstrip("/")
        self.backing = backing

    def p(self, rel=""):
        return f"{self.root}/{rel}" if rel else self.root

    def tree(self):
        if self.backing is not None:
            return disk(self.backing)
        out = {}
        for name, info in self.fs.find(self.root, withdirs=True, detail=True).items():
            rel = name[len(self.root) + 1:]
            if rel:
                out[rel] = None if info["type"] == "directory" else self.fs.cat_file(name)
        return out

    def norm(self, value):
        """A result with this side's root replaced, so two sides' results compare."""
        if isinstance(value, str):
            return value.replace(self.root, "<root>")
        if isinstance(value, (list, tuple)):
            return sorted(self.norm(v) for v in value)
        if isinstance(value, dict):
            return {self.norm(k): self.norm(v) for k, v in value.items()}
        return value


def outcome(side, op):
    try:
        return ("ok", side.norm(op(side)))
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return ("raised", type(e).__name__)


def same(a, b, op, what=""):
    """Runs ``op`` on both sides; the results and then the trees on disk must be equal."""
    got_a, got_b = outcome(a, op), outcome(b, op)
    assert got_a == got_b, f"{what}: {a.name} {got_a} != {b.name} {got_b}"
    tree_a, tree_b = a.tree(), b.tree()
    assert tree_a == tree_b, f"{what}: trees differ after the call\n{a.name}: {sorted(tree_a)}\n{b.name}: {sorted(tree_b)}"
    return got_a


def build(side, with_empty_dir=True):
    """📁 src: a.txt, b.bin, sub/c.txt, sub/nested/d.txt, sub/nested/e.bin (and empty/)."""
    fs, p = side.fs, side.p
    fs.makedirs(p("src/sub/nested"), exist_ok=True)
    fs.pipe_file(p("src/a.txt"), b"A")
    fs.pipe_file(p("src/b.bin"), b"B" * 10)
    fs.pipe_file(p("src/sub/c.txt"), b"C")
    fs.pipe_file(p("src/sub/nested/d.txt"), b"D")
    fs.pipe_file(p("src/sub/nested/e.bin"), b"E")
    if with_empty_dir:
        fs.makedirs(p("src/empty"), exist_ok=True)


def clear(side):
    for name in side.fs.ls(side.root, detail=False):
        side.fs.rm(name, recursive=True)


@pytest.fixture(scope="module")
def data2(cluster):
    """A second write-through mount over another local directory, for copies across mounts."""
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="stratafs-data2-"))
    cluster.cli("mount", "add", "/data2", f"file://{path}", "-o", "mode=write-through",
                "-o", "block_size=1MiB", "-o", "metadata_ttl=60s")
    yield path
    cluster.cli("mount", "rm", "/data2")
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def local(tmp_path):
    root = tmp_path / "local"
    root.mkdir()
    return Side("local", LocalFileSystem(auto_mkdir=True), str(root), root)


@pytest.fixture
def strata(cluster, fs):
    name = f"sem-{uuid.uuid4().hex[:8]}"
    fs.makedirs(f"/data/{name}")
    yield Side("strata", fs, f"/data/{name}", cluster.data / name)
    fs.rm(f"/data/{name}", recursive=True)


@pytest.fixture
def memory():
    m = MemoryFileSystem(global_store=False, skip_instance_cache=True)
    m.makedirs("/mem")
    return Side("memory", m, "/mem", None)


# ---- put / get / cp of nested trees ----

# (source relative to src's parent, target relative to the root, recursive, maxdepth)
TREE_CASES = [
    (src, tgt, rec, depth)
    for src in ("src", "src/", "src/*", "src/**", "src/sub*", "src/**/*.txt", "src/a.txt", "src/sub/")
    for tgt in ("new", "new/", "existing", "existing/")
    for rec, depth in ((False, None), (True, None), (True, 1), (True, 2))
]


@pytest.mark.parametrize("src,tgt,recursive,maxdepth", TREE_CASES)
def test_cp_of_nested_trees(local, strata, src, tgt, recursive, maxdepth):
    for side in (local, strata):
        build(side)
        side.fs.makedirs(side.p("existing"), exist_ok=True)
    same(local, strata,
         lambda s: s.fs.copy(s.p(src), s.p(tgt), recursive=recursive, maxdepth=maxdepth),
         f"cp({src!r}, {tgt!r}, recursive={recursive}, maxdepth={maxdepth})")


@pytest.mark.parametrize("src,tgt,recursive,maxdepth", TREE_CASES[::3])
def test_put_of_nested_trees(local, strata, tmp_path, src, tgt, recursive, maxdepth):
    source = Side("source", LocalFileSystem(auto_mkdir=True), str(tmp_path / "source"), tmp_path / "source")
    os.makedirs(source.root)
    build(source)
    for side in (local, strata):
        side.fs.makedirs(side.p("existing"), exist_ok=True)
    same(local, strata,
         lambda s: s.fs.put(source.p(src), s.p(tgt), recursive=recursive, maxdepth=maxdepth),
         f"put({src!r}, {tgt!r}, recursive={recursive}, maxdepth={maxdepth})")


@pytest.mark.parametrize("src,tgt,recursive,maxdepth", TREE_CASES[1::3])
def test_get_of_nested_trees(local, strata, tmp_path, src, tgt, recursive, maxdepth):
    targets = {}
    for side in (local, strata):
        build(side)
        out = tmp_path / f"get-{side.name}"
        (out / "existing").mkdir(parents=True)
        targets[side.name] = out

    def get(s):
        t = str(targets[s.name]) + "/" + tgt
        s.fs.get(s.p(src), t, recursive=recursive, maxdepth=maxdepth)

    assert outcome(local, get) == outcome(strata, get)
    assert disk(targets["local"]) == disk(targets["strata"])


def test_lists_of_paths_and_missing_sources(local, strata):
    for side in (local, strata):
        build(side, with_empty_dir=False)
    same(local, strata, lambda s: s.fs.copy([s.p("src/a.txt"), s.p("src/sub/c.txt")], s.p("flat/")), "cp list")
    same(local, strata,
         lambda s: s.fs.copy([s.p("src/a.txt"), s.p("src/b.bin")], [s.p("x/1"), s.p("y/2")]), "cp list to list")
    same(local, strata, lambda s: s.fs.copy(s.p("src/missing"), s.p("t")), "cp missing")
    same(local, strata, lambda s: s.fs.copy(s.p("src/missing*"), s.p("t")), "cp glob matching nothing")
    same(local, strata, lambda s: s.fs.cp_file(s.p("src/missing"), s.p("t")), "cp_file missing")
    same(local, strata, lambda s: s.fs.cp_file(s.p("src/a.txt"), s.p("src/a.txt")), "cp_file onto itself")
    same(local, strata, lambda s: s.fs.cp_file(s.p("src/a.txt"), s.p("src/b.bin")), "cp_file over a file")
    same(local, strata, lambda s: s.fs.cp_file(s.p("src/a.txt"), s.p("src/sub")), "cp_file onto a directory")
    same(local, strata, lambda s: s.fs.cp_file(s.p("src/sub"), s.p("made/dir")), "cp_file of a directory")


# ---- mv ----

MV_CASES = [
    ("src/a.txt", "moved.txt"),          # file to a new path
    ("src/a.txt", "src/b.bin"),          # file over a file
    ("src/a.txt", "existing"),           # file into an existing directory
    ("src/a.txt", "existing/"),
    ("src/a.txt", "deep/new/a.txt"),     # parents made (auto_mkdir)
    ("src/sub", "moved"),                # directory to a new path
    ("src/sub", "existing"),             # directory into an existing directory
    ("src/sub", "existing/"),
    ("src/sub", "src/sub/inside"),       # into itself
    ("src/sub", "src/a.txt"),            # directory over a file
    ("src/missing", "x"),
    ("src/a.txt", "src/a.txt"),          # onto itself: nothing
    ("src", "existing"),                 # a whole tree
]


@pytest.mark.parametrize("src,dst", MV_CASES)
@pytest.mark.parametrize("recursive", [False, True])
def test_mv(local, strata, src, dst, recursive):
    for side in (local, strata):
        build(side, with_empty_dir=False)
        side.fs.makedirs(side.p("existing"), exist_ok=True)
    same(local, strata, lambda s: s.fs.mv(s.p(src), s.p(dst), recursive=recursive), f"mv({src!r}, {dst!r})")


def test_mv_into_a_directory_holding_the_same_name(local, strata):
    for side in (local, strata):
        build(side, with_empty_dir=False)
        side.fs.makedirs(side.p("existing/sub"), exist_ok=True)
        side.fs.pipe_file(side.p("existing/sub/keep.txt"), b"keep")
        side.fs.pipe_file(side.p("existing/a.txt"), b"taken")
    # shutil.move raises shutil.Error (an OSError); strata the builtin FileExistsError (an
    # OSError too): documented in docs/PYTHON.md. Nothing moves on either side.
    for src, dst in (("src/sub", "existing"), ("src/a.txt", "existing"), ("src/a.txt", "src")):
        for side in (local, strata):
            with pytest.raises(OSError):
                side.fs.mv(side.p(src), side.p(dst))
        with pytest.raises(FileExistsError):
            strata.fs.mv(strata.p(src), strata.p(dst + "/"))
    assert local.tree() == strata.tree()


def test_mv_across_mounts_copies_then_deletes(cluster, fs, strata, data2):
    other = f"/data2/{uuid.uuid4().hex[:8]}"
    build(strata, with_empty_dir=False)
    fs.mv(strata.p("src"), other)
    assert not fs.exists(strata.p("src"))
    assert sorted(n[len(other):] for n in fs.find(other)) == [
        "/a.txt", "/b.bin", "/sub/c.txt", "/sub/nested/d.txt", "/sub/nested/e.bin"]
    assert fs.cat_file(other + "/sub/nested/d.txt") == b"D"
    fs.mv(other + "/a.txt", strata.p("back.txt"))
    assert fs.cat_file(strata.p("back.txt")) == b"A" and not fs.exists(other + "/a.txt")


# ---- rm ----

RM_LOCAL_CASES = [
    (["src/a.txt"], False),
    (["src/sub"], True),
    (["src/missing"], False),
    (["src/missing"], True),
    (["src/a.txt", "src/sub"], True),
    (["src"], True),
]


@pytest.mark.parametrize("paths,recursive", RM_LOCAL_CASES)
def test_rm_like_local(local, strata, paths, recursive):
    for side in (local, strata):
        build(side)
    same(local, strata,
         lambda s: s.fs.rm([s.p(q) for q in paths] if len(paths) > 1 else s.p(paths[0]), recursive=recursive),
         f"rm({paths}, recursive={recursive})")


def test_rm_of_a_directory_without_recursive_like_memory(memory, strata, local):
    """fsspec's generic rm (the memory filesystem): an empty directory goes, another raises
    OSError (ENOTEMPTY). fsspec's local filesystem raises ValueError for both (docs/PYTHON.md)."""
    for side in (memory, strata, local):
        build(side)
    for side in (memory, strata):
        with pytest.raises(OSError) as e:
            side.fs.rm(side.p("src/sub"))
        assert e.value.errno == errno.ENOTEMPTY and type(e.value) is OSError
        side.fs.rm(side.p("src/empty"))
        assert not side.fs.exists(side.p("src/empty")) and side.fs.isfile(side.p("src/sub/c.txt"))
    assert not (strata.backing / "src" / "empty").exists()
    with pytest.raises(ValueError):
        local.fs.rm(local.p("src/empty"))


RM_GLOB_CASES = [
    ("src/*.txt", False, None),
    ("src/*", True, None),
    ("src/*", False, None),
    ("src/**/*.txt", False, None),
    ("src/sub*", True, None),
    ("src/nothing*", False, None),
    ("src", True, 1),
    ("src", True, 2),
    ("src/sub", True, 3),
]


@pytest.mark.parametrize("path,recursive,maxdepth", RM_GLOB_CASES)
def test_rm_globs_and_maxdepth_like_memory(memory, strata, path, recursive, maxdepth):
    for side in (memory, strata):
        build(side, with_empty_dir=False)

    def files(side):
        return {k: v for k, v in side.tree().items() if v is not None}

    got = [outcome(s, lambda s: s.fs.rm(s.p(path), recursive=recursive, maxdepth=maxdepth)) for s in (memory, strata)]
    assert got[0] == got[1], f"rm({path!r}, {recursive}, {maxdepth}): {got}"
    assert files(memory) == files(strata)


# ---- touch, modified, created ----

def test_touch(local, strata):
    for side in (local, strata):
        build(side, with_empty_dir=False)
    same(local, strata, lambda s: s.fs.touch(s.p("new/deep/t.txt")), "touch a new file under new directories")
    same(local, strata, lambda s: s.fs.touch(s.p("src/a.txt")), "touch truncates")
    before = strata.fs.modified(strata.p("src/b.bin"))
    time.sleep(0.02)
    same(local, strata, lambda s: s.fs.touch(s.p("src/b.bin"), truncate=False), "touch(truncate=False) keeps the bytes")
    assert strata.fs.modified(strata.p("src/b.bin")) > before, "the modification time moved"
    same(local, strata, lambda s: s.fs.touch(s.p("src/sub")), "touch of a directory")


def test_touch_without_truncate_where_the_ufs_cannot(fs, cluster):
    if cluster.s3 is None:
        pytest.skip("needs the S3 mount (./test.sh starts Garage)")
    path = f"/s3/{uuid.uuid4().hex[:8]}/t.bin"
    fs.pipe_file(path, b"kept")
    with pytest.raises(io.UnsupportedOperation, match="cannot append"):
        fs.touch(path, truncate=False)
    assert fs.cat_file(path) == b"kept"


def test_modified_and_created(local, strata, cluster):
    for side in (local, strata):
        side.fs.pipe_file(side.p("f.bin"), b"x")
    now = datetime.datetime.now(tz=datetime.timezone.utc)
    for side in (local, strata):
        for when in (side.fs.modified(side.p("f.bin")), side.fs.created(side.p("f.bin"))):
            assert isinstance(when, datetime.datetime) and when.tzinfo == datetime.timezone.utc
            assert abs((when - now).total_seconds()) < 60
    # strata's is the UFS's own modification time, to the millisecond.
    on_disk = os.stat(strata.backing / "f.bin").st_mtime
    assert abs(strata.fs.modified(strata.p("f.bin")).timestamp() - on_disk) < 0.002
    assert strata.fs.created(strata.p("f.bin")) == strata.fs.modified(strata.p("f.bin"))
    for side in (local, strata):
        with pytest.raises(FileNotFoundError):
            side.fs.modified(side.p("missing"))


# ---- open(mode="ab") ----

def test_append(local, strata):
    for side in (local, strata):
        side.fs.pipe_file(side.p("log.txt"), b"one\n")

    def append(s, path, data):
        with s.fs.open(s.p(path), "ab") as f:
            f.write(data)

    same(local, strata, lambda s: append(s, "log.txt", b"two\n"), "append to a file")
    same(local, strata, lambda s: append(s, "new/log.txt", b"first\n"), "append to a missing file")
    same(local, strata, lambda s: s.fs.open(s.p("new"), "ab"), "append to a directory")
    # tell() counts from the end of the file, as builtin open(path, "ab") and fsspec's memory
    # filesystem do (fsspec's local file counts from 0: docs/PYTHON.md).
    with strata.fs.open(strata.p("log.txt"), "ab") as f:
        assert f.tell() == 8
        f.write(b"three\n")
        assert f.tell() == 14
    with pytest.raises(ValueError):
        f.write(b"closed")
    assert strata.fs.cat_file(strata.p("log.txt")) == b"one\ntwo\nthree\n"


def test_append_refused_where_the_mount_cannot(fs, cluster):
    mounts = ["/wb"] + (["/s3"] if cluster.s3 is not None else [])
    for mount in mounts:
        path = f"{mount}/{uuid.uuid4().hex[:8]}.log"
        fs.pipe_file(path, b"kept")
        with pytest.raises(io.UnsupportedOperation) as e:
            fs.open(path, "ab")
        assert isinstance(e.value, OSError) and isinstance(e.value, ValueError)
        assert "cannot append" in str(e.value), str(e.value)
        assert fs.cat_file(path) == b"kept"
    with pytest.raises(PermissionError):
        fs.open("/ro/x.log", "ab")


# ---- directories and errors ----

def test_directories_and_errors(local, strata):
    for side in (local, strata):
        build(side, with_empty_dir=False)
    cases = [
        ("mkdir existing", lambda s: s.fs.mkdir(s.p("src/sub"))),
        ("mkdir new", lambda s: s.fs.mkdir(s.p("made"))),
        ("mkdir without parents", lambda s: s.fs.mkdir(s.p("no/parent"), create_parents=False)),
        ("makedirs existing", lambda s: s.fs.makedirs(s.p("src/sub"))),
        ("makedirs existing ok", lambda s: s.fs.makedirs(s.p("src/sub"), exist_ok=True)),
        ("makedirs over a file", lambda s: s.fs.makedirs(s.p("src/a.txt"), exist_ok=True)),
        ("makedirs under a file", lambda s: s.fs.makedirs(s.p("src/a.txt/sub"), exist_ok=True)),
        ("rmdir not empty", lambda s: s.fs.rmdir(s.p("src/sub"))),
        ("rmdir a file", lambda s: s.fs.rmdir(s.p("src/a.txt"))),
        ("rmdir empty", lambda s: s.fs.rmdir(s.p("made"))),
        ("write under a file", lambda s: s.fs.pipe_file(s.p("src/a.txt/x"), b"x")),
        ("write deeper under a file", lambda s: s.fs.pipe_file(s.p("src/a.txt/y/x"), b"x")),
        ("write over a directory", lambda s: s.fs.pipe_file(s.p("src/sub"), b"x")),
        ("open a directory", lambda s: s.fs.open(s.p("src/sub"), "rb")),
        ("cat missing", lambda s: s.fs.cat_file(s.p("missing"))),
        ("info missing", lambda s: s.fs.info(s.p("missing"))),
        ("exists under a file", lambda s: s.fs.exists(s.p("src/a.txt/x"))),
        ("isdir", lambda s: [s.fs.isdir(s.p("src")), s.fs.isdir(s.p("src/a.txt")), s.fs.isdir(s.p("nope"))]),
        ("isfile", lambda s: [s.fs.isfile(s.p("src")), s.fs.isfile(s.p("src/a.txt"))]),
        ("exclusive create", lambda s: s.fs.open(s.p("src/a.txt"), "xb")),
        ("ls", lambda s: s.fs.ls(s.p("src"), detail=False)),
        ("ls a file", lambda s: s.fs.ls(s.p("src/a.txt"), detail=False)),
        ("find", lambda s: s.fs.find(s.p("src"))),
        ("find withdirs", lambda s: s.fs.find(s.p("src"), withdirs=True)),
        ("find maxdepth", lambda s: s.fs.find(s.p("src"), maxdepth=2)),
        ("glob", lambda s: s.fs.glob(s.p("src/**/*.txt"))),
        ("expand_path", lambda s: s.fs.expand_path(s.p("src"), recursive=True, maxdepth=2)),
    ]
    for what, op in cases:
        same(local, strata, op, what)


def test_errors_are_builtin_types(fs, cluster):
    # The local filesystem opens "r+b"; strata files are read whole-file or written whole.
    with pytest.raises(ValueError, match="unsupported mode"):
        fs.open("/data/x", "r+b")
    fs.pipe_file("/data/perm/src.bin", b"x")
    with pytest.raises(PermissionError):
        fs.cp_file("/data/perm/src.bin", "/ro/x")
    with pytest.raises(PermissionError):
        fs.mv("/data/perm/src.bin", "/ro/x")
    assert fs.exists("/data/perm/src.bin"), "a refused move deletes nothing"
    with pytest.raises(PermissionError):
        fs.touch("/ro/t")
    with pytest.raises(OSError):
        fs.rm("/data/perm")
    with pytest.raises(FileNotFoundError):
        fs.cp_file("/nomount/a", "/data/perm/b")


# ---- server-side copies ----

def _served_after(cluster, since):
    """The workers' (bytes served to readers, bytes read from the UFS), summed, from a status
    whose every worker heartbeat was sent after ``since`` (time.monotonic()): the counters of
    everything done before then."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        asked = time.monotonic()
        workers = [w for w in json.loads(cluster.cli("status", "--json"))["workers"] if w["live"]]
        # A heartbeat counted ms_ago before the status was made, which was after `asked`.
        if all(asked - w["last_heartbeat_ms_ago"] / 1000 > since for w in workers):
            return sum(w["bytes_served"] for w in workers), sum(w["ufs_bytes_read"] for w in workers)
        time.sleep(0.2)
    raise TimeoutError("no heartbeat from every worker within 30 s")


def test_a_copy_moves_no_byte_through_the_client(fs, cluster, data2):
    big = os.urandom(1 << 20) * 64   # 64 MiB
    name = uuid.uuid4().hex[:8]
    (cluster.data / name).mkdir()
    with open(cluster.data / name / "big.bin", "wb") as f:
        f.write(big)
    src = f"/data/{name}/big.bin"
    served, ufs_read = _served_after(cluster, time.monotonic())
    result = fs._client.copy(src, f"/data/{name}/copy.bin")
    assert result["by"] == "ufs" and result["bytes"] == len(big)
    # Through the client, 64 MiB would have been served by the workers (and read from the UFS):
    # the UFS copied it, no worker read a byte.
    assert _served_after(cluster, time.monotonic()) == (served, ufs_read)
    with open(cluster.data / name / "copy.bin", "rb") as f:
        assert f.read() == big

    # Across mounts a worker streams the blocks, read once from the UFS into its cache (and
    # counted as served by it); this process sends one request and reads a 9-byte answer.
    result = fs._client.copy(src, f"/data2/{name}/big.bin")
    assert result["by"] == "worker" and result["bytes"] == len(big)
    after, ufs_after = _served_after(cluster, time.monotonic())
    assert after - served >= len(big) and ufs_after - ufs_read >= len(big)
    with open(data2 / name / "big.bin", "rb") as f:
        assert f.read() == big
    assert fs.info(f"/data2/{name}/big.bin")["size"] == len(big)


def test_copy_through_fsspec_generic_copy_is_server_side(fs, cluster):
    name = uuid.uuid4().hex[:8]
    fs.pipe_file(f"/data/{name}/a/x.bin", b"x" * 1000)
    fs.pipe_file(f"/data/{name}/a/y/z.bin", b"z" * 10)
    fs.copy(f"/data/{name}/a", f"/data/{name}/b", recursive=True)
    assert fs.cat_file(f"/data/{name}/b/y/z.bin") == b"z" * 10
    assert fs.info(f"/data/{name}/b/x.bin")["size"] == 1000


def test_copy_to_a_write_back_mount_goes_through_the_client(fs):
    name = uuid.uuid4().hex[:8]
    fs.pipe_file(f"/data/{name}.bin", b"to wb")
    result = fs._client.copy(f"/data/{name}.bin", f"/wb/{name}.bin")
    assert result["by"] == "client"
    assert fs.cat_file(f"/wb/{name}.bin") == b"to wb"
    fs.sync(f"/wb/{name}.bin", wait=True, timeout=60)


def test_copy_and_move_on_s3(fs, cluster):
    if cluster.s3 is None:
        pytest.skip("needs the S3 mount (./test.sh starts Garage)")
    base = f"/s3/{uuid.uuid4().hex[:8]}"
    fs.pipe_file(f"{base}/a.bin", b"s3 bytes")
    assert fs._client.copy(f"{base}/a.bin", f"{base}/b.bin")["by"] == "ufs"
    fs.mv(f"{base}/b.bin", f"{base}/c.bin")
    assert not fs.exists(f"{base}/b.bin") and fs.cat_file(f"{base}/c.bin") == b"s3 bytes"
    fs.mv(f"{base}", f"/data/{uuid.uuid4().hex[:8]}-from-s3")
    assert not fs.exists(f"{base}/a.bin")


# ---- fsspec's own abstract suites ----

class StrataFixtures(AbstractFixtures):
    @pytest.fixture(scope="class")
    @classmethod
    def fs(cls, cluster):
        return fsspec.filesystem("strata", master=cluster.master)

    @pytest.fixture
    def fs_path(self, fs):
        root = f"/data/abstract-{uuid.uuid4().hex[:8]}"
        fs.makedirs(root)
        yield root
        fs.rm(root, recursive=True)

    @pytest.fixture
    def fs_join(self):
        return lambda *parts: "/".join(p.rstrip("/") if i < len(parts) - 1 else p for i, p in enumerate(parts))

    @pytest.fixture
    def supports_empty_directories(self):
        return True


class TestStrataCopy(StrataFixtures, AbstractCopyTests):
    pass


class TestStrataGet(StrataFixtures, AbstractGetTests):
    pass


class TestStrataPut(StrataFixtures, AbstractPutTests):
    pass


class TestStrataOpen(StrataFixtures, AbstractOpenTests):
    pass


class TestStrataPipe(StrataFixtures, AbstractPipeTests):
    pass
