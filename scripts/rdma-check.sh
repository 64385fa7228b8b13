#!/usr/bin/env bash
# Compiles and lints the RDMA transport (cargo feature `rdma` of strata-worker and
# strata-client, through ibverbs / ibverbs-sys). It can only be compiled here: no machine this
# runs on has an RDMA device, so its protocol is tested through the emulated RDMA instead
# (testkit/tests/rdma.rs; see docs/ARCHITECTURE.md, "RDMA").
#
# ibverbs-sys builds the vendored rdma-core with cmake and generates its bindings with bindgen,
# so it needs cmake, libclang and the libnl / libibverbs headers: installed with apt when
# missing (Debian/Ubuntu; root or sudo).
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(cmake libclang-dev libnl-3-dev libnl-route-3-dev libibverbs-dev)
if ! command -v dpkg >/dev/null; then
  echo "rdma-check: no dpkg; install ${pkgs[*]} (or your distribution's equivalents) and rerun" >&2
  exit 1
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

cargo clippy -p strata-worker -p strata-client --all-targets --locked \
  --features strata-worker/rdma,strata-client/rdma -- -D warnings
