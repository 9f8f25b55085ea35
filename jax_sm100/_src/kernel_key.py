"""The name of a compiled kernel in the kernel cache: sha256 over everything that changes it.

disk_cache.py stores compiled kernels under the names `cache_key` gives. The name covers every
field of the plan and the kernel spec, serialized canonically (stable across processes and
Python's hash salting), the target arch, the host's OS and CPU, the nvidia-cutlass-dsl version,
the fingerprint of its compiler library and its own compile settings (`dsl_compile_settings`),
and a hash of our kernel sources. At import this module needs only the standard library; the
DSL is read from its files, and the compiler flavour and settings from the DSL's own loaded
modules.

Which sources count
-------------------
Every `.py` under `jax_sm100/_src/kernels/` and `jax_sm100/_src/planning/` (the kernels run
the planner's code while they are traced: the sm_100a grid's cluster count, the TMEM columns
of the scale factors, the grouped cluster shapes), `compile.py` and `constraints.py`, whose
text makes the binary (their `.pyc` files in an install without the `.py`; with neither
readable, each process keys its binaries apart from every other's: `_hash_sources`).
Neither this module nor disk_cache.py counts: they name and store a binary without changing
it. A change to what the key's serialization means bumps `_KEY_FORMAT` instead; a change to
the entry file layout bumps disk_cache's `_FORMAT_VERSION`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

DSL_DISTRIBUTION = "nvidia-cutlass-dsl"

# Bump when the serialization in `cache_key` changes meaning.
_KEY_FORMAT = 1

# Everything whose source text changes a compiled kernel: the kernels, the planning code they
# call while traced, the module that drives the DSL compile, and the constraints the kernels
# read (e.g. the split-K partial tile's row padding). Not this module nor disk_cache.py (see
# the module docstring).
_SRC_ROOT = Path(__file__).resolve().parent
_SOURCE_DIRS = ("kernels", "planning")
_SOURCE_FILES = ("compile.py", "constraints.py")


def _canonical(value: Any, ignore: Collection[str] = ()) -> Any:
    """A JSON-able form of `value` that is equal exactly when the values are.

    Primitives become their repr (so `1`, `1.0` and `True` stay distinct); dataclasses list
    every field by name but those in `ignore` (top level only); `hash()` is never used, since
    Python salts it per process.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        names = {f.name for f in dataclasses.fields(value)}
        unknown = set(ignore) - names
        if unknown:
            raise ValueError(f"{sorted(unknown)} are not fields of {cls.__qualname__}")
        return {
            "dataclass": f"{cls.__module__}.{cls.__qualname__}",
            "fields": [[n, _canonical(getattr(value, n))] for n in sorted(names - set(ignore))],
        }
    if ignore:
        raise ValueError(f"cannot ignore fields of {type(value).__qualname__}, not a dataclass")
    if isinstance(value, enum.Enum):
        cls = type(value)
        return f"{cls.__module__}.{cls.__qualname__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [_canonical(v) for v in value]]
    if isinstance(value, (frozenset, set)):
        items = sorted(json.dumps(_canonical(v), sort_keys=True) for v in value)
        return ["set", items]
    if isinstance(value, Mapping):
        items = sorted(
            (json.dumps(_canonical(k), sort_keys=True), _canonical(v)) for k, v in value.items()
        )
        return ["mapping", [list(kv) for kv in items]]
    raise TypeError(
        f"cache_key cannot serialize {value!r} of type {type(value).__qualname__}; plan and spec "
        "fields must be None, bool, int, float, str, bytes, enums, tuples, mappings or dataclasses"
    )


def _hash_sources(root: Path) -> str:
    """sha256 over the kernel sources under `root`, in sorted relative-path order.

    An install without the kernels' `.py` files (compiled `.pyc` only) hashes those instead;
    one where neither can be read (a zip import) gets a value of its own for this process, so
    that its kernels are never taken for another version's: the disk cache then serves only
    this process, and a warning says why.
    """
    paths = []
    for suffix in (".py", ".pyc"):
        for d in _SOURCE_DIRS:
            paths.extend(p for p in (root / d).rglob("*" + suffix)
                         if "__pycache__" not in p.parts)  # fmt: skip
        if paths:
            break
    if not paths:
        logging.getLogger("jax_sm100._src.disk_cache").warning(
            "jax_sm100 kernel cache: no kernel sources under %s to key binaries by; kernels "
            "compiled by this process are not reused by others (install jax_sm100 from its "
            "files, not a zip)",
            root,
        )
        return "unkeyed-" + os.urandom(16).hex()
    files = (root / Path(f).with_suffix(suffix) for f in _SOURCE_FILES)
    paths.extend(p for p in files if p.is_file())
    h = hashlib.sha256()
    for rel, path in sorted((p.relative_to(root).as_posix(), p) for p in paths):
        data = path.read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


@functools.cache
def kernel_sources_hash() -> str:
    """sha256 of every `.py` under `jax_sm100/_src/kernels/` and `planning/`, of `compile.py`
    and `constraints.py` (or of their `.pyc` files; see `_hash_sources`).

    Computed once per process: editing a kernel changes the key of every kernel in the next
    process.
    """
    return _hash_sources(_SRC_ROOT)


def _dsl_version_from_source() -> str | None:
    """The DSL's `__version__`, read from its source without importing it (~1 s).

    The project's GPU machines put an unpacked DSL on PYTHONPATH, which has no distribution
    metadata.
    """
    try:
        spec = importlib.util.find_spec("cutlass")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    try:
        text = Path(spec.origin).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    match = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.MULTILINE)
    return match.group(1) if match else None


@functools.cache
def dsl_version() -> str:
    """The installed nvidia-cutlass-dsl version, or "absent" when it is not installed."""
    try:
        return importlib.metadata.version(DSL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pass
    return _dsl_version_from_source() or "absent"


def _loaded_compiler_library() -> Path | None:
    """The DSL compiler library this process uses (`_cutlass_ir.cu<N>...so`), or None.

    Importing `cutlass._mlir._mlir_libs` picks the CUDA flavour: the newest installed one the
    driver supports, or the newest one when there is no driver. Wherever a plan is made or a
    kernel compiled, the DSL is imported already, so this costs nothing there.
    """
    try:
        import cutlass._mlir._mlir_libs  # noqa: F401, PLC0415
    except Exception:  # Absent, or no flavour this driver can use: the compile fails anyway.
        return None
    library = sys.modules.get("cutlass._mlir._mlir_libs._cutlass_ir")
    path = getattr(library, "__file__", None)
    return Path(path) if path else None


def _fingerprint_files() -> list[Path]:
    """`_cutlass_ir_version_<flavour>.py` of every installed flavour, found without importing."""
    try:
        spec = importlib.util.find_spec("cutlass")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    paths = []
    for location in spec.submodule_search_locations:
        with contextlib.suppress(OSError):
            paths.extend(Path(location, "_mlir", "_mlir_libs").glob("_cutlass_ir_version_*.py"))
    return sorted(paths)


@functools.cache
def dsl_build_fingerprint() -> str:
    """The DSL's own fingerprint of the compiler library it compiles with.

    One DSL version ships a CUDA 12 and a CUDA 13 compiler; each comes with
    `_cutlass_ir_version_<flavour>.py`, holding the sha256 of its library. Keying on the
    flavour in use (not on every installed one) lets a CPU machine with both flavours fill a
    cache for a GPU machine with one. When the DSL cannot be loaded, every installed
    fingerprint is used; empty when there is none.
    """
    library = _loaded_compiler_library()
    if library is not None:
        match = re.match(r"_cutlass_ir\.(cu\d+)\.", library.name)
        flavour = match.group(1) if match else library.name
        version_file = library.with_name(f"_cutlass_ir_version_{flavour}.py")
        with contextlib.suppress(OSError):
            return f"{flavour}={hashlib.sha256(version_file.read_bytes()).hexdigest()}"
        return flavour
    parts = [f"{p.name}={hashlib.sha256(p.read_bytes()).hexdigest()}" for p in _fingerprint_files()]
    return ";".join(parts)


# Of the DSL's compile settings, those the key leaves out: the target arch is the kernel's own
# (`cache_key`'s `arch`; the compile sets the DSL's for it), and the runtime library's path
# names a directory of this machine (the library itself is the DSL version's and flavour's).
_DSL_SETTINGS_LEFT_OUT = ("arch", "shared_libs")


def dsl_compile_settings() -> str:
    """The settings the DSL's own JIT cache keys on (those it marks as changing a compile, from
    its `CUTE_DSL_*` environment variables: line info, debug, compiler options, assertions...),
    but `_DSL_SETTINGS_LEFT_OUT`. Where the DSL's settings object cannot be read, every
    `CUTE_DSL_*` variable in the environment but `CUTE_DSL_ARCH`."""
    try:
        from cutlass.cutlass_dsl.cutlass import CuTeDSL  # noqa: PLC0415

        rendered = CuTeDSL._get_dsl().envar.cache_key_str()
    except Exception:  # Absent, or another version's API: what the environment says.
        return ";".join(
            f"{k}={v}"
            for k, v in sorted(os.environ.items())
            if k.startswith("CUTE_DSL_") and k != "CUTE_DSL_ARCH"
        )
    kept = (
        x for x in rendered.split(";") if x and x.split("=", 1)[0] not in _DSL_SETTINGS_LEFT_OUT
    )
    return ";".join(kept)


def cache_key(
    plan: Any,
    spec: Any,
    *,
    arch: str,
    ignore_plan_fields: Collection[str] = (),
) -> str:
    """The name of a compiled kernel: sha256 over everything that changes its binary.

    Serializes every field of `plan` and `spec` canonically (stable across processes and
    Python's hash salting), the target arch, the host's OS and CPU (the object file holds the
    host-side launch code), the nvidia-cutlass-dsl version, compiler fingerprint and compile
    settings (`dsl_compile_settings`) and the hash of the kernel sources (`kernel_sources_hash`).

    Args:
      plan: a frozen dataclass (a `GemmPlan`) whose fields are None, bool, int, float, str,
        tuples of those, or nested dataclasses.
      spec: a frozen dataclass (a `KernelSpec`), likewise.
      arch: the target the kernel is compiled for, e.g. "sm_100a".
      ignore_plan_fields: plan fields the binary does not depend on (e.g. the problem sizes,
        when the kernel is compiled for symbolic shapes), left out so that plans differing
        only in them share an entry.

    Returns:
      64 lowercase hex digits.

    Raises:
      TypeError: for a field of a type with no canonical form, or a non-string `arch`.
      ValueError: when `ignore_plan_fields` names a field `plan` does not have.
    """
    if not isinstance(arch, str) or not arch:
        raise TypeError(f"{arch=} must be a non-empty str such as 'sm_100a'")
    document = {
        "key_format": _KEY_FORMAT,
        "plan": _canonical(plan, ignore=tuple(ignore_plan_fields)),
        "spec": _canonical(spec),
        "arch": arch,
        # The object file holds host code too (the launch wrapper): x86-64 or aarch64.
        "host": f"{sys.platform}-{platform.machine()}",
        "dsl_version": dsl_version(),
        "dsl_build": dsl_build_fingerprint(),
        "dsl_settings": dsl_compile_settings(),
        "sources": kernel_sources_hash(),
    }
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()
