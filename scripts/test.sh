#!/usr/bin/env bash
# Every test, on any machine (no GPU needed): formatting, lints, the header check, Rust unit,
# property, stress and C/C++ ABI tests, the loom model, and the Python package's tests on the
# sim backend. Installs what it can (rustfmt/clippy components; pytest, setuptools-rust and
# wheel in a venv under target/) and stops at once, naming the package, when a system tool is
# missing.
#
# Every cargo step uses one feature set and flags, so each crate is compiled once per profile
# and a re-run with nothing changed compiles nothing. The cdylib the C/C++ and Python tests
# load (target/debug/libccalloc.so) comes from `cargo build --lib --tests`: the same units as
# `cargo test` (dev-dependency features included), but copied up to target/debug/; a plain
# `cargo build` resolves features without dev-dependencies, compiles many dependencies a
# second time, and rewrites deps/libccalloc.so (no hash in a cdylib's name), so `cargo test`
# would then rebuild the crate on every run. Loom needs
# `--cfg loom` on every crate, so it has its own profile (output in target/loom/): unoptimised
# and without debug info, which builds fastest for a model that runs in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }
missing() {
  printf 'scripts/test.sh: %s\n' "$*" >&2
  exit 2
}

step "prerequisites"
command -v cargo >/dev/null || missing "cargo not found: install Rust with rustup (rustup.rs)"
command -v "${CC:-cc}" >/dev/null ||
  missing "no C compiler (${CC:-cc}): install gcc (Debian/Ubuntu: apt-get install gcc)"
for cxx in "${CXX:-g++}" c++; do
  command -v "$cxx" >/dev/null ||
    missing "no C++ compiler ($cxx): install g++ (Debian/Ubuntu: apt-get install g++)"
done
command -v python3 >/dev/null ||
  missing "python3 not found: install python3 (Debian/Ubuntu: apt-get install python3)"
python3 -c 'import venv, ensurepip' 2>/dev/null ||
  missing "python3 cannot create a venv: install python3-venv (Debian/Ubuntu: apt-get install python3-venv)"

step "toolchain components"
rustup component add rustfmt clippy >/dev/null 2>&1 || true

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy -D warnings"
cargo clippy --all-targets --locked --features replay -- -D warnings

step "cargo build --lib --tests (target/debug/libccalloc.so for the C/C++ and Python tests)"
cargo build --locked --features replay --lib --tests

step "cargo test"
cargo test --locked --features replay

step "loom model of the device lock (profile loom: --cfg loom rebuilds every crate)"
RUSTFLAGS="--cfg loom" cargo test --locked --profile loom --test loom_lock

step "python tests (sim backend)"
venv=target/pyenv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check pytest setuptools-rust wheel
# The tests import python/ from this checkout (conftest.py); the full wheel build and install
# is opt-in: CCALLOC_TEST_WHEEL=1 (python/tests/test_packaging.py).
CCALLOC_LIBRARY="$PWD/target/debug/libccalloc.so" "$venv/bin/python" -m pytest -q python/tests
