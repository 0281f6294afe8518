"""What ``pip install ./python`` and ``pip wheel ./python`` put in the package.

The quick tests run setup.py's commands that need no Rust build: ``build_py`` (the Python
files, the C++ shim and the header copied from include/), ``sdist`` (which carries the crate
under rust/), and the names the cargo step and the wheel tag will use.

The full check builds a real wheel (cargo build --release, minutes cold) and is opt-in:

    CCALLOC_TEST_WHEEL=1 python -m pytest -q python/tests/test_packaging.py

It builds the wheel with ``pip wheel`` into a temporary folder, checks its file list,
installs it into a fresh venv and allocates on the sim backend from outside the checkout,
with neither PYTHONPATH nor CCALLOC_LIBRARY set. It needs network access for pip's
isolated build (setuptools, setuptools-rust) and cargo on PATH.
"""

import os
import subprocess
import sys
import tarfile
import textwrap
import venv
import zipfile

import pytest

from conftest import HEADER, PYTHON_DIR, REPO_DIR, SIM_HEADER

pytest.importorskip("setuptools_rust", reason="setup.py needs setuptools-rust")

PACKAGE_FILES = {
    "ccalloc/__init__.py",
    "ccalloc/_lib.py",
    "ccalloc/memory.py",
    "ccalloc/torch.py",
    "ccalloc/py.typed",
    "ccalloc/csrc/torch_allocator.cpp",
    "ccalloc/include/ccalloc.h",
    "ccalloc/include/ccalloc_sim.h",
}


def _setup(*args, cwd=PYTHON_DIR):
    """Runs ``python setup.py ARGS`` in python/ and returns its stdout."""
    result = subprocess.run(
        [sys.executable, "setup.py", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _files_under(root):
    return {
        os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
        for d, _, files in os.walk(root)
        for f in files
    }


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def test_build_py_ships_the_shim_and_the_header(tmp_path):
    _setup("-q", "build_py", "--build-lib", str(tmp_path))
    files = _files_under(tmp_path)
    assert PACKAGE_FILES <= files, sorted(PACKAGE_FILES - files)
    assert _read(tmp_path / "ccalloc" / "include" / "ccalloc.h") == _read(HEADER)
    assert _read(tmp_path / "ccalloc" / "include" / "ccalloc_sim.h") == _read(SIM_HEADER)
    assert _read(tmp_path / "ccalloc" / "csrc" / "torch_allocator.cpp") == _read(
        os.path.join(PYTHON_DIR, "ccalloc", "csrc", "torch_allocator.cpp")
    )


def test_cargo_step_and_wheel_tag():
    """The library lands as ccalloc/libccalloc.so (no CPython suffix: ctypes and PyTorch
    dlopen it by name), built in release from the checkout's crate, in a py3-none wheel."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import os
                from setuptools import distutils  # noqa: F401  (setuptools' distutils)
                from distutils.core import run_setup
                dist = run_setup("setup.py", stop_after="init")
                (ext,) = dist.rust_extensions
                build = dist.get_command_obj("build_rust")
                build.ensure_finalized()
                print(build.get_dylib_ext_path(ext, ext.name))
                print(os.path.abspath(ext.path))
                print(",".join(ext.features))
                print(build._is_debug_build(ext))
                wheel = dist.get_command_obj("bdist_wheel")
                wheel.ensure_finalized()
                print("-".join(wheel.get_tag()))
                """
            ),
        ],
        cwd=PYTHON_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    library, manifest, features, debug, tag = out.stdout.strip().splitlines()[-5:]
    assert library.replace(os.sep, "/").endswith("/ccalloc/libccalloc.so"), library
    assert manifest == os.path.join(REPO_DIR, "Cargo.toml")
    # The simulated device is in the wheel: the package can be tried without a GPU.
    assert features == "sim"
    assert debug == "False"
    python, abi, plat = tag.split("-")
    assert (python, abi) == ("py3", "none") and plat != "any", tag


def test_sdist_carries_the_crate(tmp_path):
    _setup("-q", "egg_info", "--egg-base", str(tmp_path), "sdist", "--dist-dir", str(tmp_path))
    (sdist,) = tmp_path.glob("ccalloc-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for name in (
        "setup.py",
        "pyproject.toml",
        "ccalloc/csrc/torch_allocator.cpp",
        "ccalloc/py.typed",
        "rust/Cargo.toml",
        "rust/Cargo.lock",
        "rust/build.rs",
        "rust/src/lib.rs",
        "rust/include/ccalloc.h",
    ):
        assert name in names, name
    assert not any(n.endswith(".so") for n in names), sorted(names)


@pytest.mark.skipif(
    os.environ.get("CCALLOC_TEST_WHEEL") != "1",
    reason="builds a release wheel (minutes); set CCALLOC_TEST_WHEEL=1",
)
def test_wheel_installs_and_runs_without_the_checkout(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), PYTHON_DIR],
        check=True,
        timeout=1800,
    )
    (wheel,) = wheels.glob("ccalloc-*.whl")
    assert "-py3-none-" in wheel.name and not wheel.name.endswith("-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert _read(HEADER) == z.read("ccalloc/include/ccalloc.h")
        assert _read(SIM_HEADER) == z.read("ccalloc/include/ccalloc_sim.h")
    assert PACKAGE_FILES | {"ccalloc/libccalloc.so"} <= names, sorted(names)

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CCALLOC_LIBRARY")}
    env["CCALLOC_BACKEND"] = "sim"
    run = subprocess.run(
        [
            python,
            "-c",
            "import ccalloc; p=ccalloc.malloc(1<<20); print(ccalloc.memory_allocated()); "
            "ccalloc.free(p); print(ccalloc.memory_allocated()); print(ccalloc.library_path())",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    during, after, library = run.stdout.split()
    assert (int(during), int(after)) == (1 << 20, 0)
    assert library.startswith(str(env_dir)) and library.endswith("/ccalloc/libccalloc.so")
