#!/usr/bin/env bash
# Garage (a real S3-compatible store) for the test suite: installed once under $HOME (outside
# the repository, so a fresh clone reuses it), started on 127.0.0.1 with ports picked now,
# one bucket and one key created through its CLI.
#
#   source scripts/garage.sh
#   garage_ensure            # install if absent (~15 min the first time on 2 cores)
#   garage_start             # exports STRATA_TEST_S3_{ENDPOINT,BUCKET,REGION,ACCESS_KEY,SECRET_KEY}
#   garage_stop              # also run by the EXIT trap garage_start installs

GARAGE_VERSION="${GARAGE_VERSION:-2.5.0}"
GARAGE_ROOT="${STRATA_TOOLS_DIR:-$HOME/.cache/strata-tools}/garage-$GARAGE_VERSION"
GARAGE_BIN="$GARAGE_ROOT/bin/garage"

garage_ensure() {
  if [ -x "$GARAGE_BIN" ]; then
    return 0
  fi
  echo "installing garage $GARAGE_VERSION into $GARAGE_ROOT (first run only)" >&2
  cargo install garage --version "$GARAGE_VERSION" --locked --root "$GARAGE_ROOT" >&2
}

_free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

garage_start() {
  # LMDB, the metadata engine Garage's authors recommend: with sqlite, concurrent puts (the UFS
  # suite writes 10,000 objects 32 at a time) were answered 503 "database is locked".
  GARAGE_DIR="$(mktemp -d -t strata-garage.XXXXXX)"
  local rpc s3 admin
  rpc=$(_free_port); s3=$(_free_port); admin=$(_free_port)
  cat > "$GARAGE_DIR/garage.toml" <<TOML
metadata_dir = "$GARAGE_DIR/meta"
data_dir = "$GARAGE_DIR/data"
db_engine = "lmdb"
replication_factor = 1
rpc_bind_addr = "127.0.0.1:$rpc"
rpc_public_addr = "127.0.0.1:$rpc"
rpc_secret = "$(python3 -c 'import secrets; print(secrets.token_hex(32))')"

[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:$s3"
root_domain = ".s3.garage.localhost"

[admin]
api_bind_addr = "127.0.0.1:$admin"
admin_token = "$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
TOML
  local g=("$GARAGE_BIN" -c "$GARAGE_DIR/garage.toml")
  "${g[@]}" server > "$GARAGE_DIR/server.log" 2>&1 &
  GARAGE_PID=$!
  trap garage_stop EXIT
  local node="" up=""
  for _ in $(seq 1 150); do
    if "${g[@]}" status > /dev/null 2>&1; then
      up=1
      break
    fi
    sleep 0.2
  done
  [ -n "$up" ] && node=$("${g[@]}" node id -q 2>/dev/null | cut -d@ -f1)
  if [ -z "$node" ]; then
    echo "garage did not start; its log:" >&2
    cat "$GARAGE_DIR/server.log" >&2
    return 1
  fi
  "${g[@]}" layout assign -z dc1 -c 10G "$node" > /dev/null
  "${g[@]}" layout apply --version 1 > /dev/null
  "${g[@]}" bucket create strata-test > /dev/null
  local key_out
  key_out=$("${g[@]}" key create strata-test-key)
  "${g[@]}" bucket allow --read --write --owner strata-test --key strata-test-key > /dev/null
  export STRATA_TEST_S3_ENDPOINT="http://127.0.0.1:$s3"
  export STRATA_TEST_S3_BUCKET="strata-test"
  export STRATA_TEST_S3_REGION="garage"
  STRATA_TEST_S3_ACCESS_KEY=$(printf '%s\n' "$key_out" | awk -F': *' '/Key ID/ {print $2; exit}')
  STRATA_TEST_S3_SECRET_KEY=$(printf '%s\n' "$key_out" | awk -F': *' '/Secret key/ {print $2; exit}')
  export STRATA_TEST_S3_ACCESS_KEY STRATA_TEST_S3_SECRET_KEY
  if [ -z "$STRATA_TEST_S3_ACCESS_KEY" ] || [ -z "$STRATA_TEST_S3_SECRET_KEY" ]; then
    echo "could not read the key garage created:" >&2
    printf '%s\n' "$key_out" >&2
    return 1
  fi
  echo "garage $GARAGE_VERSION serving S3 on $STRATA_TEST_S3_ENDPOINT (bucket strata-test)" >&2
}

garage_stop() {
  if [ -n "${GARAGE_PID:-}" ]; then
    kill "$GARAGE_PID" 2>/dev/null || true
    wait "$GARAGE_PID" 2>/dev/null || true
    GARAGE_PID=""
  fi
  if [ -n "${GARAGE_DIR:-}" ]; then
    rm -rf "$GARAGE_DIR"
    GARAGE_DIR=""
  fi
}
