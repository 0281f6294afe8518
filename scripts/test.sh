#!/usr/bin/env bash
# Every test, on any machine (no GPU needed): formatting, lints, the header check, Rust unit,
# property, stress and C/C++ ABI tests, and the Python package's tests on the sim backend.
# Installs what it needs (rustfmt/clippy components, pytest in a venv under target/).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }

step "toolchain components"
rustup component add rustfmt clippy >/dev/null 2>&1 || true

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy -D warnings"
cargo clippy --all-targets --locked -- -D warnings

step "cargo build (the cdylib the C/C++ tests link)"
cargo build --locked

step "cargo test"
cargo test --locked

step "loom model of the device lock (own target dir: --cfg loom rebuilds every crate)"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test --locked --release --test loom_lock

step "python tests (sim backend)"
venv=target/pyenv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check pytest
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps ./python
CCALLOC_LIBRARY="$PWD/target/debug/libccalloc.so" "$venv/bin/python" -m pytest -q python/tests
