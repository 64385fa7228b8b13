"""Request classes through stratafs (docs/QOS.md): `qos=` and STRATA_QOS reach the worker with
the reads (counted per class in its /metrics), and a name that is no class is refused clearly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
import uuid

import fsspec
import pytest


def _served_by_class(cluster):
    """Answers to block reads per request class, summed over the workers' /metrics."""
    status = json.loads(cluster.cli("status", "--json"))
    totals = {}
    for w in status["workers"]:
        text = urllib.request.urlopen(f"http://{w['http_addr']}/metrics", timeout=10).read().decode()
        for labels, n in re.findall(r"^strata_worker_qos_requests_total\{([^}]*)\} (\d+)", text, re.M):
            cls = re.search(r'class="(\w+)"', labels).group(1)
            totals[cls] = totals.get(cls, 0) + int(n)
    return totals


def test_each_filesystems_class_reaches_the_workers(cluster):
    name = f"qos-{uuid.uuid4().hex[:8]}.bin"
    data = bytes(range(256)) * 64
    (cluster.data / name).write_bytes(data)
    latency = fsspec.filesystem("strata", master=cluster.master, qos="latency", skip_instance_cache=True)
    background = fsspec.filesystem("strata", master=cluster.master, qos=" Background ", skip_instance_cache=True)
    assert latency.qos == "latency" and background.qos == "background"
    before = _served_by_class(cluster)
    assert latency.cat_file(f"/data/{name}") == data
    assert latency.cat_file(f"/data/{name}") == data
    assert background.cat_file(f"/data/{name}") == data
    after = _served_by_class(cluster)
    assert after.get("latency", 0) - before.get("latency", 0) == 2, (before, after)
    assert after.get("background", 0) - before.get("background", 0) == 1, (before, after)


def test_strata_qos_in_the_environment_is_the_default(cluster):
    code = (
        "import fsspec, sys; "
        f"fs = fsspec.filesystem('strata', master={cluster.master!r}); "
        "print(fs.qos)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, STRATA_QOS="background"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "background"
    bad = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, STRATA_QOS="fast"),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0
    assert "STRATA_QOS" in bad.stderr and '"fast" is not a request class' in bad.stderr, bad.stderr


def test_a_name_that_is_no_class_is_a_value_error(cluster):
    with pytest.raises(ValueError, match="latency, throughput"):
        fsspec.filesystem("strata", master=cluster.master, qos="urgent", skip_instance_cache=True)
