#!/usr/bin/env bash
# etcd (a real one) for the HA master tests (cli/tests/ha.rs): the binary only; each test starts
# its own members on 127.0.0.1 with ports picked at run time.
#
#   source scripts/etcd.sh
#   etcd_ensure      # installs Debian's etcd-server when no etcd is found; exports STRATA_TEST_ETCD

etcd_ensure() {
  if [ -n "${STRATA_TEST_ETCD:-}" ] && [ -x "$STRATA_TEST_ETCD" ]; then
    echo "using etcd from STRATA_TEST_ETCD: $STRATA_TEST_ETCD" >&2
    return 0
  fi
  if ! command -v etcd >/dev/null 2>&1; then
    if ! command -v apt-get >/dev/null 2>&1; then
      echo "etcd.sh: no etcd on PATH and no apt-get: install etcd 3.4+ and set STRATA_TEST_ETCD" >&2
      return 1
    fi
    local sudo=""
    if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
    echo "installing etcd-server with apt-get (first run only)" >&2
    $sudo apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq etcd-server >&2
  fi
  STRATA_TEST_ETCD="$(command -v etcd)"
  export STRATA_TEST_ETCD
  echo "etcd: $("$STRATA_TEST_ETCD" --version | head -1) at $STRATA_TEST_ETCD" >&2
}
