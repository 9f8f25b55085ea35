"""The native FFI library: building it, loading it, registering its targets with XLA.

The handler (`ffi/gemm_ffi.cc`) is plain C++ against the XLA FFI headers that jaxlib ships
(`jax.ffi.include_dir()`); it links nothing from CUDA and dlopens the CuTe DSL runtime
(`libcute_dsl_runtime.so`, in the nvidia-cutlass-dsl wheel) on first use. It is built on first
need, with the system C++ compiler into a per-user cache directory keyed by a hash of its
source, the host and the FFI headers: at import where a JAX CUDA plugin is installed and
JAX_PLATFORMS does not leave CUDA out (`register_if_cuda`), else at the first CUDA lowering.
So CPU-only installs need no compiler, no GPU and no CUDA toolkit, and never build it. BUILD.md
says how to prebuild it (`python -m jax_sm100.build_ffi`) and which variables steer it.

A library found in the cache folder is loaded only when that folder is private to the user
(`disk_cache.check_private_dir`): loading it runs its code, as loading a kernel does.

`check_call` runs the handler's layout checks on described buffers, without a GPU (tests
compare it with `ffi_checks.check_call`, and time it).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import threading

import jax
import numpy as np

from jax_sm100._src import constraints, disk_cache

TARGET = "jax_sm100_gemm"
# The same handler under a second name for the calls that are not products (the quantize_both
# kernel), so that whoever counts products in a compiled program counts `TARGET`'s calls.
QUANTIZE_TARGET = "jax_sm100_quantize"
TARGETS = (TARGET, QUANTIZE_TARGET)


def target_for(kernel: str) -> str:
    """The custom call target of a plan's kernel family (`GemmPlan.kernel` and alike)."""
    return QUANTIZE_TARGET if kernel == constraints.KERNEL_QUANTIZE_BOTH else TARGET


# The handler's per-instance state type (GemmState in gemm_ffi.cc).
STATE_TYPE = "jax_sm100_gemm_state"
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
    # The kernel cache's folder; with that cache off, its default location.
    return disk_cache.cache_dir_from_env() or disk_cache.default_cache_dir()


def compile_command(cxx: str, src: os.PathLike, include_dir: str, out: os.PathLike) -> list[str]:
    """The command that builds the handler: warnings on (it builds without any), the XLA FFI
    headers as system headers (their own warnings are not ours to fix)."""
    return [cxx, "-std=c++17", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra",
            "-isystem", include_dir, str(src), "-o", str(out), "-ldl"]  # fmt: skip


def _build_key(src: bytes, include_dir: str) -> str:
    # The library is host code: one cache folder shared by x86-64 and aarch64 machines (an NFS
    # home) holds one build of each.
    h = hashlib.sha256(src)
    h.update(f"{jax.__version__}\0{sys.platform}\0{platform.machine()}".encode())
    for header in sorted(pathlib.Path(include_dir, "xla", "ffi", "api").glob("*.h")):
        h.update(header.read_bytes())
    return h.hexdigest()[:16]


def build(*, lasting: bool = False) -> pathlib.Path:
    """Compiles the handler (if not already built) and returns the shared library's path.

    `lasting=True` (`python -m jax_sm100.build_ffi`, whose path is shipped): never the private
    temporary folder below, which is removed when the process exits; the default folder that
    is not private is refused instead, naming the fix.

    Raises:
      FfiBuildError: no C++ compiler, or the compile failed (its output is in the message).
      UntrustedCacheError: the cache folder named by JAX_SM100_CACHE_DIR, or the library in
        it, could have been written by another user (disk_cache.py, "Trust"): checked before
        a library is built there, and before one found there is returned. The default folder
        found so is passed over, with a warning, for a private temporary one.
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
    target = _cache_dir() / f"ffi-{key}" / _LIB_NAME
    try:
        return _build_at(target, src_path, include_dir)
    except disk_cache.UntrustedCacheError as e:
        if lasting or disk_cache.folder_named_by_env():
            raise  # a folder the user named, or a path to keep: refused, naming the fix
        # The default folder under, say, a group-writable ~/.cache (umask 002): built in a
        # private folder of this process's instead (as the kernel cache then keeps to memory).
        disk_cache.logger.warning(
            "jax_sm100: not using the default cache folder for the FFI handler: %s. Building "
            "it in a private temporary folder",
            e,
        )
        return _build_at(_private_dir() / f"ffi-{key}" / _LIB_NAME, src_path, include_dir)


@functools.cache
def _private_dir() -> pathlib.Path:
    """A folder of this process's own (mkdtemp: 0700, under the sticky temporary folder),
    removed when the process exits."""
    folder = tempfile.mkdtemp(prefix="jax_sm100_ffi_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return pathlib.Path(folder)


def _build_at(target: pathlib.Path, src_path: pathlib.Path, include_dir: str) -> pathlib.Path:
    """`build` of the library at `target` (`<folder>/ffi-<key>/<library>`)."""
    if target.exists():
        disk_cache.check_private_dir(target.parent)
        disk_cache.check_private_file(target, os.stat(target))
        return target
    no_compiler = (
        "jax_sm100: building the FFI handler needs a C++17 compiler on PATH (g++ or c++), or "
        "CXX set; or set JAX_SM100_FFI_LIB to a library built elsewhere (BUILD.md)"
    )
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise FfiBuildError(no_compiler)
    disk_cache.make_private_dir(target.parent)  # as the kernel cache makes its folder
    # A folder that was there already keeps its modes: the build goes only where a library
    # found later would be trusted.
    disk_cache.check_private_dir(target.parent)
    fd, tmp_path = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        cmd = compile_command(cxx, src_path, include_dir, tmp_path)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise FfiBuildError(f"{no_compiler}; {cxx!r} did not run: {e}") from e
        if proc.returncode != 0:
            raise FfiBuildError(
                f"jax_sm100: building the FFI handler failed:\n{' '.join(cmd)}\n"
                f"{proc.stderr[-4000:]}"
            )
        os.chmod(tmp_path, 0o755)  # the linker's mode follows the umask; nobody else may write
        os.replace(tmp_path, target)  # atomic: concurrent builders agree on the result
    finally:
        if os.path.lexists(tmp_path):
            os.unlink(tmp_path)
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
def library() -> ctypes.CDLL:
    """The handler's library, built if needed and loaded (once per process)."""
    lib = ctypes.CDLL(str(build()))
    for name in ("JaxSm100_GemmStateTypeId", "JaxSm100_GemmStateTypeInfo"):
        getattr(lib, name).restype = ctypes.c_void_p
    lib.JaxSm100_SetRuntimePath.argtypes = [ctypes.c_char_p]
    i64p = ctypes.POINTER(ctypes.c_int64)
    lib.JaxSm100_CheckCall.argtypes = [
        i64p, ctypes.c_size_t, i64p, ctypes.c_size_t, ctypes.c_char_p, i64p, ctypes.c_size_t,
        i64p, ctypes.c_size_t, ctypes.c_int64, ctypes.POINTER(ctypes.c_double),
        ctypes.c_char_p, ctypes.c_size_t,
    ]  # fmt: skip
    lib.JaxSm100_Sha256Hex.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p]
    return lib


def _load() -> ctypes.CDLL:
    lib = library()
    lib.JaxSm100_SetRuntimePath(runtime_library().encode())
    return lib


def check_call(dims, order, names: str, inputs, results, repeats: int = 1):
    """The handler's own checks of a call, on buffers described as (XLA_FFI_DataType code,
    element count) pairs: its instantiate stage's parse of the attributes, then its execute
    stage's buffer checks, `repeats` times.

    Returns:
      (error code, message, nanoseconds per execute-stage check): code 0 and "" when the call
      would launch, else the XLA_FFI_Error_Code (3: INVALID_ARGUMENT) and the handler's message.
    """
    lib = library()

    def arr(values):
        a = np.ascontiguousarray(np.asarray(values, dtype=np.int64).reshape(-1))
        return a, a.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))

    (d, dp), (o, op), (i, ip), (r, rp) = map(arr, (dims, order, inputs, results))
    ns = ctypes.c_double(0.0)
    msg = ctypes.create_string_buffer(4096)
    code = lib.JaxSm100_CheckCall(
        dp, d.size, op, o.size, names.encode(), ip, i.size // 2, rp, r.size // 2, repeats,
        ctypes.byref(ns), msg, len(msg),
    )  # fmt: skip
    return code, msg.value.decode(), ns.value


def register() -> None:
    """Builds/loads the handler and registers its targets (`TARGETS`) for CUDA (once)."""
    with _lock:
        _register_locked()


@functools.cache
def _register_locked() -> None:
    lib = _load()
    # The state Instantiate makes and Execute reads: XLA assigns its type id.
    jax.ffi.register_ffi_type(
        STATE_TYPE,
        {
            "type_id": jax.ffi.pycapsule(lib.JaxSm100_GemmStateTypeId()),
            "type_info": jax.ffi.pycapsule(lib.JaxSm100_GemmStateTypeInfo()),
        },
        platform="CUDA",
    )
    for target in TARGETS:
        jax.ffi.register_ffi_target(
            target,
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


def cuda_excluded(platforms: str | None) -> bool:
    """Whether JAX's platforms setting (`JAX_PLATFORMS`, e.g. "cpu") keeps CUDA out of the
    process; unset (None or ""), JAX takes every platform installed."""
    names = {p.strip().lower() for p in (platforms or "").split(",") if p.strip()}
    return bool(names) and not names & {"cuda", "gpu"}


def register_if_cuda() -> bool:
    """Registers the targets when JAX can run on CUDA here; True when registered.

    For processes that run a deserialised `jax.export` artifact or a persistent-cache hit
    without lowering jax_sm100.matmul themselves. On a machine without a CUDA plugin, or where
    JAX_PLATFORMS leaves CUDA out, this does nothing (no compiler is needed there); a failed
    build is reported as a warning, and the
    CUDA lowering will raise it again with the full message if a kernel is actually used.
    """
    if not cuda_plugin_installed():
        return False
    if cuda_excluded(jax.config.jax_platforms):
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
    return [jax.export.DisabledSafetyCheck.custom_call(target) for target in TARGETS]
