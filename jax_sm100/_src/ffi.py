"""The native FFI library: building it, loading it, registering its targets with XLA.

The handler (`ffi/gemm_ffi.cc`) is plain C++ against the XLA FFI headers that jaxlib ships
(`jax.ffi.include_dir()`); it links nothing from CUDA and dlopens the CuTe DSL runtime
(`libcute_dsl_runtime.so`, in the nvidia-cutlass-dsl wheel) on first use. It is built lazily, on
the first CUDA lowering in a process, with the system C++ compiler into a per-user cache
directory keyed by a hash of its source and of the FFI headers, so importing jax_sm100 needs
no compiler, no GPU and no CUDA toolkit, and CPU-only installs never build it. BUILD.md says
how to prebuild it (`python -m jax_sm100._src.ffi`) and which variables steer it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading

import jax

TARGET = "jax_sm100_gemm"
_LIB_NAME = "libjax_sm100_ffi.so"
# A wheel carries the source inside the package (setup.py); an editable install reads the
# repository's ffi/ folder.
_PACKAGED_SOURCE = pathlib.Path(__file__).resolve().parents[1] / "_ffi" / "gemm_ffi.cc"
_REPO_SOURCE = pathlib.Path(__file__).resolve().parents[2] / "ffi" / "gemm_ffi.cc"
_SOURCE = _PACKAGED_SOURCE if _PACKAGED_SOURCE.is_file() else _REPO_SOURCE
_lock = threading.Lock()


class FfiBuildError(RuntimeError):
    """The FFI library could not be built or loaded; the message says what to install."""


def source_path() -> pathlib.Path:
    override = os.environ.get("JAX_SM100_FFI_SOURCE")
    return pathlib.Path(override) if override else _SOURCE


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("JAX_SM100_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jax_sm100"
    )
    return pathlib.Path(root)


def _build_key(src: bytes, include_dir: str) -> str:
    h = hashlib.sha256(src)
    h.update(jax.__version__.encode())
    for header in sorted(pathlib.Path(include_dir, "xla", "ffi", "api").glob("*.h")):
        h.update(header.read_bytes())
    return h.hexdigest()[:16]


def build(out_dir: pathlib.Path | None = None) -> pathlib.Path:
    """Compiles the handler (if not already built) and returns the shared library's path.

    Raises:
      FfiBuildError: no C++ compiler, or the compile failed (its output is in the message).
    """
    prebuilt = os.environ.get("JAX_SM100_FFI_LIB")
    if prebuilt:
        return pathlib.Path(prebuilt)
    src_path = source_path()
    if not src_path.exists():
        raise FfiBuildError(
            f"jax_sm100: the FFI handler source {src_path} is missing; install jax_sm100 from "
            "its source tree (pip install -e .) or set JAX_SM100_FFI_LIB to a prebuilt library"
        )
    include_dir = jax.ffi.include_dir()
    key = _build_key(src_path.read_bytes(), include_dir)
    target = (out_dir or _cache_dir() / f"ffi-{key}") / _LIB_NAME
    if target.exists():
        return target
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise FfiBuildError(
            "jax_sm100: building the FFI handler needs a C++17 compiler (g++ or clang++) on PATH, "
            "or CXX set; or set JAX_SM100_FFI_LIB to a library built elsewhere (BUILD.md)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        tmp_path = tmp.name
    cmd = [cxx, "-std=c++17", "-O2", "-fPIC", "-shared", "-w", f"-I{include_dir}",
           str(src_path), "-o", tmp_path, "-ldl"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp_path)
        raise FfiBuildError(
            f"jax_sm100: building the FFI handler failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}"
        )
    os.replace(tmp_path, target)  # atomic: concurrent builders agree on the result
    return target


def runtime_library() -> str:
    """Path of the CuTe DSL runtime library of the installed nvidia-cutlass-dsl."""
    # The DSL's own lookup: CUTE_DSL_LIBS, else the wheel's runtime for the CUDA flavour it uses.
    from cutlass.base_dsl.env_manager import get_prefix_dsl_libs  # noqa: PLC0415

    for lib in (get_prefix_dsl_libs("CUTE_DSL") or "").split(os.pathsep):
        if lib.endswith("libcute_dsl_runtime.so"):
            return lib
    raise FfiBuildError(
        "jax_sm100: libcute_dsl_runtime.so was not found in the nvidia-cutlass-dsl install; "
        "reinstall nvidia-cutlass-dsl (pip install 'nvidia-cutlass-dsl[cu13]' for CUDA 13)"
    )


@functools.cache
def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    lib.JaxSm100_SetRuntimePath.argtypes = [ctypes.c_char_p]
    lib.JaxSm100_SetRuntimePath(runtime_library().encode())
    return lib


def register() -> None:
    """Builds/loads the handler and registers the `jax_sm100_gemm` target for CUDA (once)."""
    with _lock:
        _register_locked()


@functools.cache
def _register_locked() -> None:
    lib = _load()
    jax.ffi.register_ffi_target(
        TARGET,
        {
            "instantiate": jax.ffi.pycapsule(lib.JaxSm100GemmInstantiate),
            "execute": jax.ffi.pycapsule(lib.JaxSm100GemmExecute),
        },
        platform="CUDA",
    )


def cuda_plugin_installed() -> bool:
    """Whether a JAX CUDA plugin is installed (checked without initialising any backend)."""
    import importlib.util  # noqa: PLC0415

    names = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13",
             "jax_plugins.xla_cuda12")  # fmt: skip
    for name in names:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:
            continue
    return False


def register_if_cuda() -> bool:
    """Registers the target when JAX can run on CUDA here; True when registered.

    For processes that run a deserialised `jax.export` artifact or a persistent-cache hit
    without lowering jax_sm100.matmul themselves. On a machine without a CUDA plugin this does
    nothing (no compiler is needed there); a failed build is reported as a warning, and the
    CUDA lowering will raise it again with the full message if a kernel is actually used.
    """
    if not cuda_plugin_installed():
        return False
    try:
        register()
    except (FfiBuildError, OSError) as e:
        import warnings  # noqa: PLC0415

        warnings.warn(f"jax_sm100: FFI handler not registered: {e}", stacklevel=2)
        return False
    return True


def export_safety_checks() -> list:
    """`disabled_checks` for `jax.export.export` of functions that call our kernels."""
    return [jax.export.DisabledSafetyCheck.custom_call(TARGET)]


if __name__ == "__main__":
    print(build())
