"""Tokens from Python: `token=` and the environment, and what each role may do (docs/SECURITY.md)."""

from __future__ import annotations

import pytest


def _create(cluster, *args) -> str:
    out = cluster.cli("token", "create", *args)
    # The token alone on the last line of stdout (the interface scripts rely on).
    return out.strip().splitlines()[-1]


def test_a_scoped_reader_reads_its_subtree_and_nothing_else(cluster, fs):
    import fsspec

    fs.pipe("/data/authz/team-a/f.txt", b"team a")
    fs.pipe("/data/authz/team-b/f.txt", b"team b")
    reader = _create(cluster, "--role", "reader", "--prefix", "/data/authz/team-a", "--name", "py reader")
    rfs = fsspec.filesystem("strata", master=cluster.master, token=reader, skip_instance_cache=True)
    assert rfs.cat("/data/authz/team-a/f.txt") == b"team a"
    assert rfs.ls("/data/authz/team-a", detail=False) == ["/data/authz/team-a/f.txt"]
    with pytest.raises(PermissionError, match="scoped to /data/authz/team-a"):
        rfs.cat("/data/authz/team-b/f.txt")
    with pytest.raises(PermissionError, match="reader token may not write"):
        rfs.pipe("/data/authz/team-a/new.txt", b"x")
    with pytest.raises(PermissionError):
        rfs.rm("/data/authz/team-a/f.txt")
    assert fs.cat("/data/authz/team-a/f.txt") == b"team a", "nothing changed"
    assert not fs.exists("/data/authz/team-a/new.txt")


def test_a_writer_writes_and_an_unknown_token_is_refused_at_once(cluster, fs):
    import fsspec

    writer = _create(cluster, "--role", "writer", "--prefix", "/data/authz/w")
    wfs = fsspec.filesystem("strata", master=cluster.master, token=writer, skip_instance_cache=True)
    wfs.pipe("/data/authz/w/out.bin", b"written")
    assert fs.cat("/data/authz/w/out.bin") == b"written"
    with pytest.raises(PermissionError, match="unknown or revoked token"):
        fsspec.filesystem("strata", master=cluster.master, token="strata_" + "0" * 64, skip_instance_cache=True)
    with pytest.raises(PermissionError, match="not a Strata token"):
        fsspec.filesystem("strata", master=cluster.master, token="hunter2", skip_instance_cache=True)


def test_no_secret_or_token_in_any_answer_or_log(cluster, fs):
    """The S3 mount's secret key and the tokens never reach a reader, an admin's listing, or a
    log line of the cluster's processes (which run at RUST_LOG=info)."""
    import json

    import fsspec

    if cluster.s3 is None:
        pytest.fail("STRATA_TEST_S3_ENDPOINT is not set: this test needs the S3 mount's secret (./test.sh starts Garage)")
    secret = cluster.s3["secret"]
    fs.pipe("/s3/secret-check/f.txt", b"via s3")
    reader = _create(cluster, "--role", "reader")
    rfs = fsspec.filesystem("strata", master=cluster.master, token=reader, skip_instance_cache=True)
    assert rfs.cat("/s3/secret-check/f.txt") == b"via s3"
    answers = [
        cluster.cli("mount", "ls"),
        cluster.cli("mount", "ls", "--json"),
        cluster.cli("status", "--json"),
        cluster.cli("token", "ls", "--json"),
        cluster.cli("job", "ls"),
        json.dumps(rfs.info("/s3/secret-check/f.txt")),
        json.dumps(rfs.ls("/s3/secret-check", detail=True)),
    ]
    for answer in answers:
        assert secret not in answer
        assert reader not in answer
    assert "***" in cluster.cli("mount", "ls"), "secret options are shown redacted"
    admin = cluster.token_file.read_text().strip()
    logs = "".join(p.read_text(errors="replace") for p in cluster.dir.glob("*.log"))
    assert "mount added" in logs or "INFO" in logs, "the logs are at info level: the grep means something"
    for needle in (secret, reader, admin):
        assert needle not in logs
