#!/usr/bin/env bash
# The stratafs pytest suite, sourced by the repository's test.sh after the Rust tests (which
# built target/debug/strata). Installs its Python tools into a venv cached under $HOME
# (~/.cache/strata-tools/py-venv: torch from PyPI is the CUDA build, 2.8 GB to download and
# 5-6 GB installed, so it is installed once, never into the repository; nothing comes from the
# machine's site-packages), builds the extension with cargo's dev profile into the workspace's
# target dir, and runs pytest over the `strata` binary the test build produced.

stratafs_tests() {
  local root venv py target
  root="$(pwd)"
  # The test build's target dir: the workspace's own unless CARGO_TARGET_DIR moved it (a second
  # worktree of the repository builds into its own).
  target="${CARGO_TARGET_DIR:-$root/target}"
  venv="${STRATA_TOOLS_DIR:-$HOME/.cache/strata-tools}/py-venv"
  py="$venv/bin/python"
  local pip=("$py" -m pip)
  if [ ! -x "$py" ] && ! python3 -m venv "$venv"; then
    # Debian without python3-venv: a venv without pip, filled by the system's pip.
    rm -rf "$venv"
    python3 -m venv --without-pip "$venv" || return 1
  fi
  if ! "$py" -m pip --version >/dev/null 2>&1; then
    pip=(python3 -m pip --python "$py")
  fi
  "${pip[@]}" install -q --disable-pip-version-check "maturin==1.16.0" fsspec pytest pytest-timeout pyarrow pandas torch \
    s3fs boto3 jsonschema
  # The dev profile and the shared target dir reuse the dependencies the test build compiled
  # (those whose features agree: cargo unifies features per invocation, so crates that other
  # workspace members enable extra features of are compiled once more for this build).
  rm -rf "$target/stratafs-wheel"
  "$venv/bin/maturin" build --profile dev --manifest-path python/Cargo.toml -i "$py" \
    --out "$target/stratafs-wheel"
  "${pip[@]}" install -q --disable-pip-version-check --force-reinstall --no-deps "$target"/stratafs-wheel/stratafs-*.whl
  # --timeout: a hanging test fails by name instead of holding CI.
  STRATA_BIN="$target/debug/strata" "$py" -m pytest -q -p no:cacheprovider --timeout 900 python/tests || return 1
  # The small-file benchmark at a smoke size (debug build, Garage): it runs and reads back every
  # file; its figures come from release builds on a quiet machine (docs/BENCHMARKS.md).
  "$py" bench/small_files_bench.py --files 300 --strata-bin "$target/debug/strata" --memory 256MiB || return 1
  # The prefetch benchmark likewise: a cold shuffled epoch with and without hints, read back whole,
  # with the store reached through the proxy that delays each request (bench/delay_proxy.py).
  "$py" bench/prefetch_bench.py --files 300 --rounds 1 --strata-bin "$target/debug/strata" --memory 256MiB \
    --store-delay-ms 5
}
