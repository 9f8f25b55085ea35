"""Warming the kernel cache ahead of time, on any machine, for a list of problem shapes.

`precompile` plans each shape for a named arch and compiles its kernel with `compile_plan`,
which targets the plan's arch rather than the local GPU: a CPU-only build machine can fill the
cache directory (`JAX_SM100_CACHE_DIR`) that GPU processes later start from.

Shapes are given as the CUDA lowering plans them (gpu_lowering.py): `(m, n, k)` for one GEMM
and `(batch, m, n, k)` for a batch whose operands are all batched. A batch whose B is shared
(a weight) folds into m there, so precompile it as `(batch * m, n, k)`. Each shape is planned
by the lowering's own function (`dispatch.plan_call`, split-K fitted as for a call), so the
binaries compiled here are the ones calls ask for. On sm_100a a call's grid also follows its
driver's occupancy answer: give it as `resident_clusters` when the cache is filled elsewhere.

A training step asks for more kernels than its forward shapes: under `jax.grad` the forward of
a fused activation also writes its pre-activation (`preact_out=True` here), and the backward
products run transposed layouts with the activation's derivative fused in. The sure way to warm
all of them is to lower the step itself for the target on the build machine, which compiles
every kernel its lowering asks for into the cache:

    os.environ["JAX_SM100_TARGET_ARCH"] = "sm_90a"     # before the first lowering
    jax.export.export(jax.jit(step), platforms=["cuda"],
                      disabled_checks=jax_sm100.export_disabled_checks())(*example_args)
"""

from __future__ import annotations

import dataclasses
import importlib
import operator
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

import jax
import numpy as np

from jax_sm100._src import constraints, dispatch, planning
from jax_sm100._src.kernels.spec import ACTIVATIONS, KernelSpec

_BAR_WIDTH = 24


@dataclasses.dataclass(frozen=True)
class Precompiled:
    """What `precompile` did for one shape.

    Attributes:
      shape: the shape as given.
      plan: its plan, as the CUDA lowering adjusts it for a call.
      spec: the spec it was compiled with.
      compiled: the `CompiledGemm`, or None when no kernel was compiled (see `note`).
      note: "compiled" (followed by the lowering's notes on the plan, if any), "same kernel
        as <shape>" (an earlier shape's plan compiles to the same binary: the plans differ in
        their sizes only) or "XLA dot: <reason>".
      seconds: wall time of this shape's compile (0 when none ran).
    """

    shape: tuple[int, ...]
    plan: planning.GemmPlan
    spec: KernelSpec
    compiled: Any
    note: str
    seconds: float


def _split_shape(shape: Sequence[int]) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a shape given as (m, n, k) or (batch, m, n, k)."""
    dims = tuple(shape)
    if len(dims) == 3:
        return (1, *dims)
    if len(dims) == 4:
        return dims
    raise ValueError(f"shape={dims!r} must be (m, n, k) or (batch, m, n, k)")


class _Progress:
    """A one-line text progress bar; one line per step when the stream is not a terminal."""

    def __init__(self, total: int, stream: TextIO | None):
        self._total = total
        self._stream = stream
        self._tty = stream is not None and getattr(stream, "isatty", lambda: False)()

    def update(self, done: int, label: str) -> None:
        if self._stream is None:
            return
        filled = _BAR_WIDTH * done // max(self._total, 1)
        bar = "#" * filled + "." * (_BAR_WIDTH - filled)
        line = f"precompile [{bar}] {done}/{self._total} {label}"
        if self._tty:
            self._stream.write("\r\x1b[K" + line)
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def close(self, summary: str) -> None:
        if self._stream is None:
            return
        self._stream.write(("\n" if self._tty else "") + summary + "\n")
        self._stream.flush()


def _int_shape(shape) -> tuple[int, ...]:
    """A shape's sizes as ints; a float or bool size (64.0, say) is refused, not truncated."""
    sizes = tuple(shape)
    out = []
    for d in sizes:
        try:
            if isinstance(d, (bool, np.bool_)):
                raise TypeError
            out.append(operator.index(d))
        except TypeError:
            raise ValueError(f"shape {sizes!r}: sizes must be ints, got {type(d).__name__} "
                             f"{d!r}") from None  # fmt: skip
    return tuple(out)


def _kernel_form(m, n, k, a_dtype, b_dtype, out_dtype, c_dtype, a_major, b_major, arch):
    """`make_problem`'s dtype and layout arguments of the form the lowering runs such a call
    in (`dispatch.kernel_form`: fp8 operands widened or transposed K-major, fp8 results
    planned in float32); the arguments as given where it changes nothing."""
    given = dict(a_dtype=a_dtype, b_dtype=b_dtype, out_dtype=out_dtype, c_dtype=c_dtype,
                 a_major=a_major, b_major=b_major)  # fmt: skip
    try:
        a = jax.ShapeDtypeStruct((k, m) if a_major == "m" else (m, k), np.dtype(a_dtype))
        b = jax.ShapeDtypeStruct((n, k) if b_major == "k" else (k, n), np.dtype(b_dtype))
        c = None if c_dtype is None else jax.ShapeDtypeStruct((m, n), np.dtype(c_dtype))
    except TypeError:
        return given  # make_problem names the bad dtype
    f = dispatch.kernel_form_of(
        a, b, c, transpose_a=a_major == "m", transpose_b=b_major == "k",
        out_dtype=np.float32 if out_dtype is None else out_dtype, arch=arch,
    )  # fmt: skip
    if not f.notes:
        return given
    return dict(
        a_dtype=f.a.dtype, b_dtype=f.b.dtype, c_dtype=None if f.c is None else f.c.dtype,
        out_dtype=out_dtype if out_dtype is None else f.out_dtype,
        a_major="m" if f.transpose_a else "k", b_major="k" if f.transpose_b else "n",
    )  # fmt: skip


def precompile(
    shapes: Iterable[Sequence[int]],
    *,
    dtypes: Sequence[Any] = ("bfloat16", "bfloat16"),
    arch: str = "sm_100a",
    a_major: str = "k",
    b_major: str = "n",
    c_dtype: Any = None,
    bias_dtype: Any = None,
    activation: str | None = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    preact_out: bool = False,
    num_sms: int | None = None,
    resident_clusters: Mapping[int, int] | None = None,
    progress: bool = True,
    file: TextIO | None = None,
) -> list[Precompiled]:
    """Plans and compiles the kernel of each shape for `arch`, filling the kernel cache.

    Needs no GPU: kernels are cross-compiled for `arch`. Shapes that plan identically compile
    once; shapes planned onto XLA's dot compile nothing.

    Args:
      shapes: `(m, n, k)` or `(batch, m, n, k)` per problem, as the lowering plans it (see the
        module docstring; with fp8, in the form the lowering gives the call,
        `dispatch.kernel_form`: an sm_90a fp8 B given N-major is planned K-major, say).
      dtypes: `(a_dtype, b_dtype)` or `(a_dtype, b_dtype, out_dtype)`, anything `np.dtype`
        takes; out defaults to the planner's choice.
      arch: "sm_100a" or "sm_90a".
      a_major, b_major: operand layouts ("k"/"m" for A, "n"/"k" for B), as in `plan`.
      c_dtype, bias_dtype, activation, alpha, beta: the fused epilogue (`KernelSpec`).
      preact_out: also write the pre-activation (`KernelSpec.preact_out`), as the forward
        product of a fused activation does under `jax.grad`. The backward products of a
        training step take other layouts and fused derivatives: to warm every kernel of a
        step, lower the step itself for CUDA on the build machine (the module docstring).
      num_sms: SM count of the target device, which the plan depends on; None keeps the
        planner's default for `arch` (132 for sm_90a as on H100/H200, 148 for sm_100a as on
        B200).
      resident_clusters: for sm_100a, the target device's answer to its driver's occupancy
        query, {cluster size: clusters resident} (`dispatch.driver_max_clusters(size)` run on
        that machine). The CUDA lowering asks the driver on its own device and compiles the
        grid into the binary where the answer is below the plan's count, so without it a
        build machine's binaries can miss those calls. None: the driver's answer when this
        machine's GPU is the target (`arch`, and `num_sms` if given), else none.
      progress: write a progress bar and a summary to `file`.
      file: the stream for progress; default `sys.stderr`.

    Returns:
      One `Precompiled` per shape, in order.

    Raises:
      ValueError: for a shape that is not 3 or 4 ints, `dtypes` not 2 or 3 long, an
        activation the epilogue does not apply, `preact_out` without an activation, or
        `num_sms` below 1.
      TypeError: for `shapes` not a list of shapes (one shape alone, say), a dtype the
        kernels do not take, `alpha` or `beta` not a real number, `num_sms` not an int, or
        `resident_clusters` not a mapping.
      Exception: whatever planning or `compile_plan` raises, with a note naming the shape.
    """
    compile_mod = importlib.import_module("jax_sm100._src.compile")
    from jax_sm100._src import dtypes as D  # noqa: PLC0415

    if len(dtypes) not in (2, 3):
        raise ValueError(f"dtypes={tuple(dtypes)!r} must be (a, b) or (a, b, out)")
    # Every dtype is checked here, under precompile's names (make_problem's own checks, which
    # name plan's arguments, then pass).
    for what, dtype in zip(("a", "b", "out"), dtypes, strict=False):
        D.dtype_argument_name(dtype, f"the {what} dtype", "jax_sm100.precompile",
                              "dtypes=('bfloat16', 'bfloat16')")  # fmt: skip
    a_dtype, b_dtype, out_dtype = (*dtypes, None)[:3]
    # The dtype the lowering hands the kernel the bias in (an fp8 or float64 bias as float32).
    bias_name = (
        None
        if bias_dtype is None
        else constraints.kernel_bias_dtype(
            D.dtype_argument_name(bias_dtype, "bias_dtype", "jax_sm100.precompile")
        )
    )
    if c_dtype is not None:
        D.dtype_argument_name(c_dtype, "c_dtype", "jax_sm100.precompile")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS} "
                         "(jax_sm100.precompile's fused epilogue)")  # fmt: skip
    if preact_out and activation is None:
        raise ValueError("jax_sm100.precompile: preact_out=True needs an activation (the "
                         "pre-activation is written beside activation(z))")  # fmt: skip
    for name, v in (("alpha", alpha), ("beta", beta)):
        if not isinstance(v, (int, float, np.floating, np.integer)) or isinstance(v, bool):
            raise TypeError(f"jax_sm100.precompile: {name} must be a Python float, as for "
                            f"matmul, got {type(v).__name__}")  # fmt: skip
    if num_sms is not None:
        if isinstance(num_sms, (bool, np.bool_)) or not isinstance(num_sms, (int, np.integer)):
            raise TypeError(f"jax_sm100.precompile: num_sms must be an int (the target's SM "
                            f"count) or None, got {type(num_sms).__name__}")  # fmt: skip
        if num_sms < 1:
            raise ValueError(f"jax_sm100.precompile: num_sms={num_sms!r} must be an int >= 1 "
                             "(the target's SM count), or None for the arch's default")  # fmt: skip
        num_sms = int(num_sms)
    if resident_clusters is not None and not isinstance(resident_clusters, Mapping):
        raise TypeError(
            "jax_sm100.precompile: resident_clusters must be a mapping {cluster "
            f"size: clusters resident}}, got {type(resident_clusters).__name__}"
        )
    shapes = list(shapes)
    if shapes and not isinstance(shapes[0], Iterable):
        raise TypeError(f"jax_sm100.precompile: shapes must be a list of shapes, got "
                        f"{tuple(shapes)!r}; for one shape pass [{tuple(shapes)!r}]")  # fmt: skip
    shapes = [_int_shape(s) for s in shapes]
    problems = [_split_shape(s) for s in shapes]
    target = dispatch.Target(arch, num_sms or 0)
    if resident_clusters is not None:
        pairs = tuple(sorted((operator.index(c), operator.index(n))
                             for c, n in resident_clusters.items()))  # fmt: skip
        target = dataclasses.replace(target, resident_clusters=pairs)
    else:
        local = dispatch.device_target()
        if local is not None and local.arch == arch and num_sms in (None, local.num_sms):
            target = local  # this machine's GPU: its driver answers, as for a call

    bar = _Progress(len(shapes), (file or sys.stderr) if progress else None)
    results: list[Precompiled] = []
    # The first shape of each binary (`compile.binary_key`: plans differing in their sizes only
    # share one).
    first_shape: dict[tuple, tuple[int, ...]] = {}
    start = time.perf_counter()
    for i, (shape, (batch, m, n, k)) in enumerate(zip(shapes, problems, strict=True)):
        label = "x".join(map(str, shape)) + f" {arch}"
        bar.update(i, label)
        try:
            form = _kernel_form(m, n, k, a_dtype, b_dtype, out_dtype, c_dtype, a_major,
                                b_major, arch)  # fmt: skip
            problem = planning.make_problem(m, n, k, batch=batch, **form)
            decision = dispatch.plan_call(problem, target)
            plan, plan_notes = decision.plan, decision.notes
            spec = dataclasses.replace(
                KernelSpec.for_plan(plan), bias_dtype=bias_name, activation=activation,
                alpha=alpha, beta=beta, preact_out=bool(preact_out),
            )  # fmt: skip
            if plan.kernel == planning.KERNEL_XLA:
                results.append(Precompiled(shape, plan, spec, None, plan.reason, 0.0))
                continue
            binary = compile_mod.binary_key(plan, spec)
            if binary in first_shape:
                note = f"same kernel as {first_shape[binary]}"
                results.append(Precompiled(shape, plan, spec, None, note, 0.0))
                continue
            first_shape[binary] = shape
            t0 = time.perf_counter()
            compiled = compile_mod.compile_plan(plan, spec)
            seconds = time.perf_counter() - t0
        except Exception as e:
            e.add_note(f"jax_sm100.precompile: while compiling shape {shape} for {arch}")
            raise
        note = "; ".join(("compiled", *plan_notes))
        results.append(Precompiled(shape, plan, spec, compiled, note, seconds))
    bar.update(len(shapes), "done")
    n_compiled = sum(r.compiled is not None for r in results)
    n_xla = sum(r.plan.kernel == planning.KERNEL_XLA for r in results)
    bar.close(
        f"precompile: {n_compiled} kernels for {arch} in {time.perf_counter() - start:.1f} s "
        f"({len(results) - n_compiled - n_xla} shapes shared a kernel, {n_xla} run on XLA's dot)"
    )
    return results
