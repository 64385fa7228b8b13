"""Cross-references in rendered Kubernetes objects that a schema cannot check.

For each file (a `helm template` or `kubectl kustomize` output):
- every ConfigMap a pod mounts exists, with every key the volume's `items` name;
- every Service selects the pods of some workload, and each named targetPort is a container
  port of those pods;
- probes name ports their container declares;
- the worker's memory limit covers its DRAM tier (memory_capacity in worker.toml);
- a ServiceMonitor (a CRD: no schema offline) selects a Service and names its ports.
Run by scripts/k8s-check.sh with kubernetes-validate's PyYAML on PYTHONPATH.
"""

import re
import sys

import yaml


def pod_specs(objs):
    """(workload name, pod template metadata, pod spec) of every workload."""
    for o in objs:
        spec = o.get("spec") or {}
        kind = o["kind"]
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            t = spec["template"]
        elif kind == "CronJob":
            t = spec["jobTemplate"]["spec"]["template"]
        else:
            continue
        yield f"{kind}/{o['metadata']['name']}", t.get("metadata") or {}, t["spec"]


def quantity_bytes(q):
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(q))
    if not m:
        raise ValueError(f"unsupported quantity {q!r}")
    return int(m.group(1)) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[m.group(2)]


def check(path):
    errors = []
    with open(path) as f:
        objs = [o for o in yaml.safe_load_all(f) if o]
    configmaps = {o["metadata"]["name"]: o.get("data") or {} for o in objs if o["kind"] == "ConfigMap"}
    pods = list(pod_specs(objs))

    for name, _, spec in pods:
        containers = spec.get("containers", []) + spec.get("initContainers", [])
        for vol in spec.get("volumes", []):
            cm = vol.get("configMap")
            if not cm:
                continue
            if cm["name"] not in configmaps:
                errors.append(f"{name}: mounts ConfigMap {cm['name']}, which is not rendered")
                continue
            for item in cm.get("items", []):
                if item["key"] not in configmaps[cm["name"]]:
                    errors.append(f"{name}: ConfigMap {cm['name']} has no key {item['key']}")
        for c in containers:
            ports = {p.get("name") for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe)
                if not p:
                    continue
                port = (p.get("httpGet") or p.get("tcpSocket") or {}).get("port")
                if isinstance(port, str) and port not in ports:
                    errors.append(f"{name}/{c['name']}: {probe} names port {port}, not declared")
        if name.startswith("DaemonSet/") and name.endswith("-worker"):
            worker = next(c for c in spec["containers"] if c["name"] == "worker")
            toml = next((d["worker.toml"] for d in configmaps.values() if "worker.toml" in d), "")
            m = re.search(r"^memory_capacity = (\d+)$", toml, re.M)
            limit = quantity_bytes(worker["resources"]["limits"]["memory"])
            if not m or limit <= int(m.group(1)):
                errors.append(f"{name}: memory limit {limit} does not cover the DRAM tier ({m and m.group(1)})")

    # Several masters need their state in etcd, and the chart's etcd (when rendered) must be
    # the one they are told about.
    for o in objs:
        if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("-master") and o["spec"]["replicas"] > 1:
            toml = next((d["master.toml"] for d in configmaps.values() if "master.toml" in d), "")
            m = re.search(r'^meta = "etcd://([^"]+)"$', toml, re.M)
            if not m:
                errors.append(f"StatefulSet/{o['metadata']['name']}: {o['spec']['replicas']} replicas without meta = etcd://")
                continue
            etcd = [e for e in objs if e["kind"] == "StatefulSet" and e["metadata"]["name"].endswith("-etcd")]
            for e in etcd:
                name = e["metadata"]["name"]
                want = {f"{name}-{i}.{name}" for i in range(e["spec"]["replicas"])}
                got = {ep.rsplit(":", 1)[0] for ep in m.group(1).split(",")}
                if want != got:
                    errors.append(f"master.toml meta names {sorted(got)}, the chart's etcd is {sorted(want)}")

    services = [o for o in objs if o["kind"] == "Service"]
    for svc in services:
        sel = svc["spec"].get("selector") or {}
        selected = [
            (n, spec)
            for n, meta, spec in pods
            if sel and all((meta.get("labels") or {}).get(k) == v for k, v in sel.items())
        ]
        if not selected:
            errors.append(f"Service/{svc['metadata']['name']}: selects no rendered pods")
        for port in svc["spec"].get("ports", []):
            tp = port.get("targetPort")
            if isinstance(tp, str):
                for n, spec in selected:
                    names = {p.get("name") for c in spec["containers"] for p in c.get("ports", [])}
                    if tp not in names:
                        errors.append(f"Service/{svc['metadata']['name']}: {n} has no port {tp}")

    for sm in (o for o in objs if o["kind"] == "ServiceMonitor"):
        if sm.get("apiVersion") != "monitoring.coreos.com/v1":
            errors.append(f"ServiceMonitor/{sm['metadata']['name']}: apiVersion {sm.get('apiVersion')}")
        want = sm["spec"]["selector"]["matchLabels"]
        matched = [s for s in services if all(s["metadata"].get("labels", {}).get(k) == v for k, v in want.items())]
        if not matched:
            errors.append(f"ServiceMonitor/{sm['metadata']['name']}: selects no rendered Service")
        for ep in sm["spec"]["endpoints"]:
            if not any(ep["port"] in {p.get("name") for p in s["spec"]["ports"]} for s in matched):
                errors.append(f"ServiceMonitor/{sm['metadata']['name']}: no selected Service has port {ep['port']}")
    return errors


def main():
    failed = False
    for path in sys.argv[1:]:
        for e in check(path):
            print(f"{path}: {e}", file=sys.stderr)
            failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
