"""Only here to tag the wheel for the platform when libccalloc.so is bundled (pyproject.toml
holds the metadata). Without the library the wheel is pure Python (py3-none-any); with it,
py3-none-<platform>: the library is loaded with ctypes, so no Python ABI is involved."""

import os

from setuptools import setup

_BUNDLED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ccalloc", "libccalloc.so")

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

cmdclass = {}
if bdist_wheel is not None:

    class _BdistWheel(bdist_wheel):
        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = not os.path.isfile(_BUNDLED)

        def get_tag(self):
            python, abi, plat = super().get_tag()
            if not self.root_is_pure:
                python, abi = "py3", "none"
            return python, abi, plat

    cmdclass["bdist_wheel"] = _BdistWheel

setup(cmdclass=cmdclass)
