"""Packaging hook: a wheel carries the FFI handler's source inside the package.

The handler (`ffi/gemm_ffi.cc`) is compiled on first CUDA use against the installed jaxlib's
headers (BUILD.md). An editable install reads it from the repository's `ffi/`; a built wheel gets
a copy at `jax_sm100/_ffi/gemm_ffi.cc`, which `jax_sm100/_src/ffi.py` looks for first.
"""

import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithFfiSource(build_py):
    def run(self):
        super().run()
        dest = pathlib.Path(self.build_lib) / "jax_sm100" / "_ffi"
        dest.mkdir(parents=True, exist_ok=True)
        for src in sorted(pathlib.Path(__file__).parent.joinpath("ffi").glob("*.cc")):
            shutil.copy2(src, dest / src.name)


setup(cmdclass={"build_py": BuildPyWithFfiSource})
