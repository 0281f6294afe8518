"""Builds libccalloc.so from the Rust crate and bundles it, with the C header, in the package
(pyproject.toml holds the metadata).

setuptools-rust runs ``cargo rustc --release --features sim`` on the crate: the repository
root in a checkout (``pip install ./python``, ``pip wheel ./python``), or its copy under
``rust/`` in an sdist made by ``python setup.py sdist``. The library is installed as
``ccalloc/libccalloc.so`` and the headers as ``ccalloc/include/ccalloc.h`` and
``ccalloc_sim.h``. It is built with the simulated device (``CCALLOC_BACKEND=sim``), so that
the package can be tried, and its tests run, on a machine without a GPU.

The wheel is tagged ``py3-none-<platform>``: the library is loaded with ctypes, so it works
with any Python 3 on that platform, and the wheel installs where no Rust toolchain is.
"""

import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist
from setuptools_rust import Binding, RustExtension
from setuptools_rust.build import build_rust

HERE = os.path.dirname(os.path.abspath(__file__))

if sys.platform == "darwin":
    LIBRARY_NAME = "libccalloc.dylib"
elif sys.platform == "win32":
    LIBRARY_NAME = "ccalloc.dll"
else:
    LIBRARY_NAME = "libccalloc.so"

# What of the crate an sdist carries under rust/ (what `cargo build` of the library reads).
CRATE_FILES = ("Cargo.toml", "Cargo.lock", "build.rs", "cbindgen.toml", "README.md")
CRATE_DIRS = ("src", "include", "benches")


def crate_dir():
    """The Rust crate: ``rust/`` beside this file in an sdist, else the checkout's root."""
    for candidate in (os.path.join(HERE, "rust"), os.path.dirname(HERE)):
        if os.path.isfile(os.path.join(candidate, "Cargo.toml")):
            return candidate
    sys.exit(
        f"ccalloc: the Rust crate (Cargo.toml) is neither in {os.path.dirname(HERE)} nor in "
        f"{os.path.join(HERE, 'rust')}: build from a ccalloc checkout (pip install ./python) "
        f"or from an sdist made with `python setup.py sdist`."
    )


CRATE = crate_dir()
HEADERS = ("ccalloc.h", "ccalloc_sim.h")


class BuildRust(build_rust):
    """Installs the library as ``ccalloc/libccalloc.so``: ctypes and PyTorch dlopen it by
    that name, so it carries no CPython extension suffix."""

    def get_dylib_ext_path(self, ext, target_fname):
        tagged = super().get_dylib_ext_path(ext, target_fname)
        return os.path.join(os.path.dirname(tagged), LIBRARY_NAME)


class BuildPy(build_py):
    """Adds the crate's C headers under ``ccalloc/include/`` (ccalloc.torch compiles the C++
    allocator shim against ccalloc.h). An editable install reads the checkout's include/."""

    def run(self):
        super().run()
        if not self.editable_mode:
            for name in HEADERS:
                target = os.path.join(self.build_lib, "ccalloc", "include", name)
                self.mkpath(os.path.dirname(target))
                self.copy_file(os.path.join(CRATE, "include", name), target)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not self.editable_mode:
            outputs += [os.path.join(self.build_lib, "ccalloc", "include", n) for n in HEADERS]
        return outputs


class Sdist(sdist):
    """Copies the crate into the sdist under ``rust/`` so that the sdist builds on its own."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        if CRATE == os.path.join(HERE, "rust"):
            return  # building an sdist from an sdist: rust/ is in `files` already
        self.mkpath(os.path.join(base_dir, "rust"))
        for name in CRATE_FILES:
            self.copy_file(os.path.join(CRATE, name), os.path.join(base_dir, "rust", name))
        for name in CRATE_DIRS:
            shutil.copytree(
                os.path.join(CRATE, name),
                os.path.join(base_dir, "rust", name),
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            )


cmdclass = {"build_rust": BuildRust, "build_py": BuildPy, "sdist": Sdist}

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:  # no wheel support: nothing to tag
        bdist_wheel = None

if bdist_wheel is not None:

    class BdistWheel(bdist_wheel):
        """``py3-none-<platform>``: no Python ABI is involved (ctypes), only the platform's."""

        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    cmdclass["bdist_wheel"] = BdistWheel

setup(
    cmdclass=cmdclass,
    rust_extensions=[
        RustExtension(
            "ccalloc.libccalloc",
            path=os.path.join(CRATE, "Cargo.toml"),
            binding=Binding.NoBinding,
            py_limited_api=False,
            # Release even for `pip install -e`: the library is a dependency, not the code
            # being edited here.
            debug=False,
            # The simulated device: the package works, and is tested, without a GPU.
            features=["sim"],
            args=["--locked"],
        )
    ],
)
