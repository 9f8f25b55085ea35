"""Plan + spec -> a compiled kernel object, compiled once per process.

`compile_plan` runs `cute.compile` for the plan's kernel family with symbolic m, n, k and l
(`kernels/common.py`), on any machine: the target is the plan's arch, not the local GPU. The
result carries what the FFI handler needs: the object file (`dump_to_object`: cubin plus the
host launch wrapper, loaded at run time by the CuTe DSL runtime), the name of its function and,
per tensor argument, which extents and strides are runtime values (the layout of the argument
structs that the handler fills).

Because the binary depends on the plan's tiling and the spec but not on the problem sizes, both
caches are keyed on the plan without m, n, k and batch: all problems that plan the same tiles
share one compile. In front of the compiler sit an in-process dict and the on-disk store of
disk_cache.py (`JAX_SM100_CACHE_DIR`; `off` disables it), so a new process that meets a binary
a previous one built loads it without compiling (the key reads the DSL's version, compiler
flavour and settings, which the planner has imported already).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import math
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import zlib

from jax_sm100._src.constraints import KERNEL_XLA
from jax_sm100._src.kernels.spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class TensorArg:
    """One tensor argument of a compiled kernel: which of its modes are runtime values."""

    name: str
    dynamic_shape_modes: tuple[int, ...]
    dynamic_stride_modes: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledGemm:
    """A compiled GEMM kernel, ready for the FFI handler.

    Attributes:
      plan: the plan it was compiled from (the first of its binary-equivalence class), from
        memory, from the disk cache or freshly compiled alike.
      spec: the spec the kernel was compiled with: a split-K plan reduced by XLA compiles its
        float32 partial product, whose spec says so (float32 out, no epilogue).
      arch: "sm_90a" or "sm_100a".
      function_prefix: the name the runtime looks the host function up by.
      object_bytes: the host (x86-64 or aarch64) object file holding the cubin and the launch
        wrapper.
      ptx: the kernel's PTX; cubin: its cubin (both kept for tests and inspection).
      tensor_args: the kernel's tensor arguments, in order (absent c/bias are left out).
      split_k: the plan's split factor (A and B are then passed as (M, K/split, split) views;
        with `plan.split_reduce == "xla"` the kernel writes float32 partials, batch = split).
      compile_seconds: wall time of `cute.compile` plus export.
    """

    plan: object
    spec: KernelSpec
    arch: str
    function_prefix: str
    object_bytes: bytes = dataclasses.field(repr=False)
    ptx: str = dataclasses.field(repr=False)
    cubin: bytes = dataclasses.field(repr=False)
    tensor_args: tuple[TensorArg, ...]
    split_k: int
    compile_seconds: float

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.object_bytes).hexdigest()


_cache: dict[tuple, CompiledGemm] = {}
_lock = threading.Lock()


def binary_key(plan, spec: KernelSpec) -> tuple:
    """What determines the compiled binary: the plan without its sizes, and the spec."""
    return (plan.binary_fields(), spec)


def compile_plan(plan, spec: KernelSpec | None = None) -> CompiledGemm:
    """Compiles the kernel `plan` selects, for `plan.arch`, once per process.

    Works without a GPU. For a split-K plan (`plan.split_k > 1`) the binary is the SM90 kernel
    with A and B taken as (M, K/split, split) and (N, K/split, split) strided views. With
    `plan.split_reduce == "xla"` it writes float32 partials (M, N, split), whose sum the caller
    reduces before the epilogue (gpu_lowering.py); with "cluster" it sums the splits in the
    cluster and writes D through the fused epilogue itself.

    Args:
      plan: a GemmPlan whose kernel is not "xla_dot" (or a `planning.quantize.QuantizePlan`
        of the quantize_both kernel).
      spec: layouts and epilogue; defaults to `KernelSpec.for_plan(plan)`.

    Returns:
      A CompiledGemm.

    Raises:
      TypeError: `plan` is not a GemmPlan (`jax_sm100.plan` makes one) or `spec` not a
        KernelSpec.
      ValueError: the plan selects XLA's dot, or its kernel family cannot take (plan, spec).
    """
    from jax_sm100._src.planning import GemmPlan  # noqa: PLC0415 (planning imports kernels)
    from jax_sm100._src.planning.quantize import QuantizePlan  # noqa: PLC0415

    if not isinstance(plan, (GemmPlan, QuantizePlan)):
        raise TypeError(f"plan must be a jax_sm100.GemmPlan (from jax_sm100.plan) or a "
                        f"QuantizePlan, got {type(plan).__name__}")  # fmt: skip
    if spec is not None and not isinstance(spec, KernelSpec):
        raise TypeError(f"spec must be a KernelSpec or None, got {type(spec).__name__}")
    spec = spec or KernelSpec.for_plan(plan)
    key = binary_key(plan, spec)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        compiled = _from_disk_or_compile(plan, spec)
        if compiled.plan != plan:  # the family's own plan (a split-K partial's float32 out)
            compiled = dataclasses.replace(compiled, plan=plan)
        _cache[key] = compiled
        return compiled


def _build(plan, spec: KernelSpec) -> CompiledGemm:
    if os.environ.get("JAX_SM100_COMPILE_SUBPROCESS") == "1":
        return _compile_in_subprocess(plan, spec)
    return _compile(plan, spec)


def _from_disk_or_compile(plan, spec: KernelSpec) -> CompiledGemm:
    """The on-disk kernel cache (disk_cache.py) in front of the compiler.

    The entry's payload is the object file; its metadata holds everything else a CompiledGemm
    carries (PTX and cubin deflated, argument layout), so a hit needs no compile.
    """
    from jax_sm100._src import disk_cache, kernel_key  # noqa: PLC0415

    cache = disk_cache.default_cache()
    if cache.directory is None:
        return _build(plan, spec)
    key = kernel_key.cache_key(plan, spec, arch=plan.arch, ignore_plan_fields=plan.RUNTIME_FIELDS)
    built: list[CompiledGemm] = []

    def build_entry():
        compiled = _build(plan, spec)
        built.append(compiled)
        return disk_cache.CacheEntry(compiled.object_bytes, _metadata(compiled))

    entry = cache.get_or_create(key, build_entry)
    if built:
        return built[0]
    return _from_entry(plan, entry)


def _spec_json(spec: KernelSpec) -> dict:
    """The spec's fields as JSON takes them: a non-finite float (an alpha or beta of inf or
    NaN, which `matmul` accepts) as {"float": its repr}, which JSON has no number for."""
    out = {}
    for name, value in dataclasses.asdict(spec).items():
        if isinstance(value, float) and not math.isfinite(value):
            value = {"float": repr(value)}
        out[name] = value
    return out


def _spec_from_json(fields: dict) -> KernelSpec:
    return KernelSpec(**{
        name: float(value["float"]) if isinstance(value, dict) else value
        for name, value in fields.items()
    })  # fmt: skip


def _deflate(data: bytes) -> str:
    return base64.b64encode(zlib.compress(data, 6)).decode("ascii")


def _inflate(text: str) -> bytes:
    return zlib.decompress(base64.b64decode(text))


def _metadata(c: CompiledGemm) -> dict:
    return {
        "spec": _spec_json(c.spec),
        "arch": c.arch,
        "function_prefix": c.function_prefix,
        # PTX and cubin (for tests and inspection) deflated: as text and hex they made an
        # entry 3.8x its object file (review helper-134), and the cubin is in the object too.
        "ptx_z": _deflate(c.ptx.encode()),
        "cubin_z": _deflate(c.cubin),
        "tensor_args": [
            [t.name, list(t.dynamic_shape_modes), list(t.dynamic_stride_modes)]
            for t in c.tensor_args
        ],
        "split_k": c.split_k,
        "compile_seconds": c.compile_seconds,
    }


def _from_entry(plan, entry) -> CompiledGemm:
    md = entry.metadata
    return CompiledGemm(
        plan=plan,
        spec=_spec_from_json(md["spec"]),
        arch=md["arch"],
        function_prefix=md["function_prefix"],
        object_bytes=entry.payload,
        ptx=_inflate(md["ptx_z"]).decode(),
        cubin=_inflate(md["cubin_z"]),
        tensor_args=tuple(TensorArg(n, tuple(s), tuple(t)) for n, s, t in md["tensor_args"]),
        split_k=int(md["split_k"]),
        compile_seconds=0.0,
    )


def _compile_in_subprocess(plan, spec: KernelSpec) -> CompiledGemm:
    """`_compile` in a fresh interpreter (JAX_SM100_COMPILE_SUBPROCESS=1).

    Isolates the DSL's compiler from the caller's heap; used while debugging crashes in the
    DSL, at about 1.5 s more per compile.
    """
    payload = pickle.dumps((plan, spec))
    proc = subprocess.run(
        [sys.executable, "-m", "jax_sm100._src.compile"],
        input=payload,
        capture_output=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"jax_sm100: compiling {plan.kernel} for {plan.arch} failed in a worker process:\n"
            + proc.stderr.decode(errors="replace")[-4000:]
        )
    return pickle.loads(proc.stdout)


def workspace_shapes(plan) -> dict[str, tuple[tuple[int, ...], str]]:
    """The extra buffers a plan's kernel takes, by name: (shape, dtype).

    A stream-K plan takes "ws", one float32 tile per CTA of the persistent grid (the partial
    tiles two clusters meet in), and "flags", one int32 per CTA, zero at every launch (the
    caller passes zeros). Other plans take none.
    """
    if not plan.stream_k:
        return {}
    tm, tn, _ = plan.cta_tile_mnk
    return {
        "ws": ((plan.num_sms * tm * tn,), "float32"),
        "flags": ((plan.num_sms,), "int32"),
    }


def _tensor_args(names, operands) -> tuple[TensorArg, ...]:
    from cutlass.cute.typing import SymInt  # noqa: PLC0415

    out = []
    for name, t in zip(names, operands, strict=True):
        if t is None:
            continue
        shape_modes = tuple(i for i, x in enumerate(t.shape) if isinstance(x, SymInt))
        stride_modes = tuple(i for i, x in enumerate(t.stride) if isinstance(x, SymInt))
        out.append(TensorArg(name, shape_modes, stride_modes))
    return tuple(out)


def _compile(plan, spec: KernelSpec) -> CompiledGemm:
    from cutlass import cute  # noqa: PLC0415
    from cutlass.cute.runtime import make_fake_stream  # noqa: PLC0415
    from cutlass.cutlass_dsl.cutlass import CuTeDSL  # noqa: PLC0415

    from jax_sm100._src.kernels import common, family  # noqa: PLC0415

    if plan.kernel == KERNEL_XLA:
        raise ValueError(f"the plan runs on XLA's dot, not a kernel: {plan.reason}")
    kernel_family = family.family(plan.kernel)
    inputs = kernel_family.compile_inputs(plan, spec)
    plan, spec, operands = inputs.plan, inputs.spec, inputs.operands
    kernel = kernel_family(plan, spec)

    prefix = "jax_sm100_gemm"
    envar = CuTeDSL._get_dsl().envar
    saved = (envar.keep_ptx, envar.keep_cubin, envar.dump_dir)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jax_sm100_") as dump:
        try:
            envar.keep_ptx, envar.keep_cubin, envar.dump_dir = True, True, dump
            with common.target_arch(plan.arch):
                compiled = cute.compile(kernel, *operands, make_fake_stream())
                ptx, cubin = compiled.__ptx__, compiled.__cubin__
                obj = compiled.dump_to_object(prefix)
        finally:
            envar.keep_ptx, envar.keep_cubin, envar.dump_dir = saved
        if isinstance(ptx, str) and os.path.isfile(ptx):
            with open(ptx) as f:
                ptx = f.read()
    return CompiledGemm(
        plan=plan,
        spec=spec,
        arch=plan.arch,
        function_prefix=prefix,
        object_bytes=bytes(obj),
        ptx=ptx or "",
        cubin=bytes(cubin or b""),
        tensor_args=_tensor_args(kernel_family.HOST_OPERANDS, operands),
        split_k=plan.split_k,
        compile_seconds=time.perf_counter() - t0,
    )


if __name__ == "__main__":
    from jax_sm100._src import compile as _this  # the importable module, for pickling

    _plan, _spec = pickle.loads(sys.stdin.buffer.read())
    _result = _this._compile(_plan, _spec)
    sys.stdout.buffer.write(pickle.dumps(_result))
    sys.stdout.buffer.flush()
