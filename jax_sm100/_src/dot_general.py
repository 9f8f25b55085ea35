"""`jax_sm100.dot_general`: `jax.lax.dot_general`'s signature and semantics on the GEMM primitive.

Background: a dot_general contracts `lhs` and `rhs` over paired contracting dims, keeps paired
batch dims, and returns `[batch..., lhs free..., rhs free...]`. The primitive computes
`[*B, m, n]` from `a` = `[*B, m, k]` (or `[*B, k, m]`, `transpose_a`) and `b` = `[*B, k, n]` (or
`[*B, n, k]`, `transpose_b`). A contraction is a GEMM when each operand, with its batch dims first
(in the output's order), reads as two groups of dims, its free dims and its contracting dims in
either order, and the contracting dims of both operands are grouped in one order. Reading a group
as one dim is a reshape of adjacent dims, and the order of the two groups is the transpose flag,
so neither copies anything.

Algorithm (`gemm_form`):

1. The pairing order of the contracting dims is taken from lhs's or rhs's own order of them
   (both are tried).
2. For each operand, its two group orders (free-contracting and contracting-free) are checked:
   a layout is free when it moves no dim of size > 1 past another (then it is a reshape). The
   layout whose last group is larger than 1 wins where both are free (a K-major A, and a K-major B
   for a matrix-vector product, keep the contiguous dim the long one).
3. Where no layout is free, that operand is transposed first (a copy, as XLA's dot would make);
   the pairing order needing fewer copies wins.
4. Without batch dims, leading free dims of a K-major lhs stay separate dims of `a`, as the
   primitive's broadcast batch (rhs gets unit dims there), so `[b, s, d] x [d, n]` binds `a` as
   the very array given: one GEMM with the batch folded into m, autodiff's fusion of a previous
   activation's derivative kept (autodiff.py), and sharded batch dims passed through as they are.

Anything else runs on `lax.dot_general` itself, recorded in `jax_sm100.lowerings()` with the
reason: no contracting dim (an outer product), non-floating operands or result, an empty dim,
`precision=HIGHEST` on float32 operands (the SM100 kernels multiply float32 as tf32, which meets
DEFAULT and HIGH only), a precision above DEFAULT (or ANY_F8_ANY_F8_F32) on two fp8 operands
(XLA then accumulates in float32; the kernels, as cuBLAS's fast accumulation, in the fp8 tensor
core's accumulator: `precision_reason`) and explicit dot algorithms other than the kernels' own
(`KERNEL_ALGORITHMS`: BF16_BF16_F32, F16_F16_F32 and ANY_F8_ANY_F8_F32_FAST_ACCUM of such
operands).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as jax_core

from jax_sm100._src import (
    dispatch,
    lowering,  # noqa: F401  (registers the lowerings)
)
from jax_sm100._src import primitive as P
from jax_sm100._src.constraints import DTYPE_BITS, FP8_DTYPES


@dataclasses.dataclass(frozen=True)
class OperandForm:
    """How one dot_general operand becomes a primitive operand: an optional transpose (`perm`,
    a copy; None when the layout is free), then a reshape to `shape` (free), with the
    primitive's transpose flag `transposed`."""

    perm: tuple[int, ...] | None
    shape: tuple[int, ...]
    transposed: bool


@dataclasses.dataclass(frozen=True)
class GemmForm:
    """A dot_general as one bind of the primitive: its operands' forms, the primitive's result
    shape and the dot_general's result shape (a free reshape of it)."""

    lhs: OperandForm
    rhs: OperandForm
    out_shape: tuple[int, ...]

    @property
    def copies(self) -> tuple[str, ...]:
        return tuple(
            f"{name} transposed {form.perm} (a copy)"
            for name, form in (("lhs", self.lhs), ("rhs", self.rhs))
            if form.perm is not None
        )


def _free(order: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether reading `shape` in dim order `order` moves no dim of size > 1 past another."""
    big = [d for d in order if shape[d] != 1]
    return big == sorted(big)


def _layout(shape, lead, groups):
    """(order, transposed, copy) of an operand: `lead` then the two `groups` in either order,
    the first order being the primitive's untransposed one."""
    orders = [(tuple(lead) + tuple(groups[0]) + tuple(groups[1]), False),
              (tuple(lead) + tuple(groups[1]) + tuple(groups[0]), True)]  # fmt: skip
    free = [(o, t) for o, t in orders if _free(o, shape)]
    if len(free) == 2:
        # One group is all unit dims: the layout that keeps the other one last (contiguous).
        # (`!=`, not a product's `>`: a symbolic dim compares unequal to 1, but not greater.)
        transposed = any(shape[d] != 1 for d in groups[0])
        return orders[transposed][0], transposed, False
    if free:
        return (*free[0], False)
    # A copy either way: the one that keeps the operand's contiguous dim last moves less.
    keeps_last = [(o, t) for o, t in orders if o[-1] == len(shape) - 1]
    return (*(keeps_last or orders)[0], True)


def gemm_form(lhs_shape, rhs_shape, dimension_numbers) -> GemmForm | str:
    """The primitive bind that computes `lax.dot_general(lhs, rhs, dimension_numbers)`, or the
    reason it is not a GEMM (see the module docstring). Dimension numbers must be valid (lax's
    shape rule has checked them)."""
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc = tuple(d % len(lhs_shape) for d in lc), tuple(d % len(rhs_shape) for d in rc)
    lb, rb = tuple(d % len(lhs_shape) for d in lb), tuple(d % len(rhs_shape) for d in rb)
    if not lc:
        return "no contracting dimension (an outer product)"
    if 0 in lhs_shape or 0 in rhs_shape:
        return "an empty dimension"
    lf = tuple(d for d in range(len(lhs_shape)) if d not in lc + lb)
    rf = tuple(d for d in range(len(rhs_shape)) if d not in rc + rb)
    pairs = list(zip(lc, rc, strict=True))
    best = None
    for key in (0, 1):  # the contracting dims' order: lhs's own, then rhs's
        ordered = sorted(pairs, key=lambda p, key=key: p[key])
        kl, kr = tuple(p[0] for p in ordered), tuple(p[1] for p in ordered)
        lhs = _layout(lhs_shape, lb, (lf, kl))
        rhs = _layout(rhs_shape, rb, (kr, rf))
        copies = lhs[2] + rhs[2]
        if best is None or copies < best[0]:
            best = (copies, lhs, rhs, kl)
    _, (l_order, ta, l_copy), (r_order, tb, r_copy), kl = best

    batch = tuple(lhs_shape[d] for d in lb)
    free_l = tuple(lhs_shape[d] for d in lf)
    m, n = math.prod(free_l), math.prod(rhs_shape[d] for d in rf)
    k = math.prod(lhs_shape[d] for d in kl)
    if not batch and not ta and len(free_l) > 1:
        # Leading free dims as the primitive's broadcast batch (step 4).
        extra, a_shape = len(free_l) - 1, (*free_l, k)
    else:
        extra, a_shape = 0, ((*batch, k, m) if ta else (*batch, m, k))
    b_shape = (*batch, *(1,) * extra, *((n, k) if tb else (k, n)))
    out_shape = (*batch, *free_l, *(rhs_shape[d] for d in rf))
    return GemmForm(
        OperandForm(l_order if l_copy else None, a_shape, ta),
        OperandForm(r_order if r_copy else None, b_shape, tb),
        out_shape,
    )


# The dot algorithms the kernels compute (operands of the named dtypes multiplied exactly, float32
# accumulation; two fp8 operands in the tensor core's fp8 accumulator, below): a preset naming
# one runs on the kernels for such operands, as DEFAULT does.
KERNEL_ALGORITHMS = {
    "BF16_BF16_F32": ("bfloat16",),
    "F16_F16_F32": ("float16",),
    "ANY_F8_ANY_F8_F32_FAST_ACCUM": FP8_DTYPES,
}
# Hopper's fp8 wgmma adds each k32 step into its float32 accumulator keeping about 14 mantissa
# bits (the DeepSeek-V3 report, 3.5.2; tests/test_gpu_scaled.py), and the dense and grouped
# kernels accumulate there for the whole k: cuBLAS's "fast accumulation", which XLA asks for
# at DEFAULT precision only. HIGH, HIGHEST and ANY_F8_ANY_F8_F32 of two operands of one fp8
# format ask for float32 accumulation (XLA promotes), so they run on lax.
_FP8_FULL_ACCUMULATION = (
    "with two fp8 operands asks for float32 accumulation; the kernels accumulate in the fp8 "
    "tensor core's accumulator (XLA's DEFAULT, cuBLAS's fast accumulation; "
    "ANY_F8_ANY_F8_F32_FAST_ACCUM names it)"
)


def precision_reason(precision, lhs_dtype, rhs_dtype) -> str | None:
    """Why the kernels would not meet `precision` for these operand dtypes, or None.

    `precision` is taken as lax canonicalizes it: None is `jax.default_matmul_precision`'s
    value, and a preset may be given by name.

    The kernels multiply 16-bit operands exactly and accumulate in float32, which meets every
    `lax.Precision` and the presets that name those operands (`KERNEL_ALGORITHMS`); float32
    operands run as tf32 on SM100 (DEFAULT and HIGH, as XLA's dot on a GPU), so HIGHEST goes
    to lax. Two operands of one fp8 format accumulate in the fp8 tensor core's accumulator,
    which is what XLA computes at DEFAULT (and ANY_F8_ANY_F8_F32_FAST_ACCUM names); HIGH,
    HIGHEST and ANY_F8_ANY_F8_F32 ask for float32 accumulation and go to lax. Two fp8 formats
    (e4m3 beside e5m2) are widened to bfloat16 on every path (`dtypes.widen_fp8_pair`), whose
    exact product meets them; fp8 beside a 16-bit operand, widened to its dtype, meets every
    `lax.Precision`. A `lax.DotAlgorithm` and every other preset go to lax, which implements
    them as asked.
    """
    from jax._src.lax import lax as lax_internal  # noqa: PLC0415  (no public canonicalizer)

    canonical = lax_internal.canonicalize_precision(precision)
    if canonical is None:
        return None
    names = {np.dtype(d).name for d in (lhs_dtype, rhs_dtype)}
    # One fp8 format on both sides runs the fp8 MMA; other pairs with fp8 are widened first.
    fp8_mma = len(names) == 1 and names <= set(FP8_DTYPES)
    if isinstance(canonical, lax.DotAlgorithmPreset):
        if canonical == lax.DotAlgorithmPreset.DEFAULT:
            return None
        if names <= set(KERNEL_ALGORITHMS.get(canonical.name, ())):
            return None
        if canonical.name == "ANY_F8_ANY_F8_F32" and names <= set(FP8_DTYPES):
            return f"precision={canonical.name} {_FP8_FULL_ACCUMULATION}" if fp8_mma else None
        return f"precision={canonical.name}, not a dot algorithm the kernels compute"
    if isinstance(canonical, lax.DotAlgorithm):
        return "an explicit lax.DotAlgorithm"
    if fp8_mma and any(p != lax.Precision.DEFAULT for p in canonical):
        top = max(canonical, key=lambda p: p.value)
        return f"precision={top.name} {_FP8_FULL_ACCUMULATION}"
    if "float32" in names and lax.Precision.HIGHEST in canonical:
        return (
            "precision=HIGHEST with float32 operands (the SM100 kernels multiply float32 as "
            "tf32, which meets DEFAULT and HIGH)"
        )
    return None


def fallback_reason(lhs_dtype, rhs_dtype, out_dtype, precision) -> str | None:
    """Why a contraction of these dtypes and precision runs on lax.dot_general, or None."""
    for what, dt in (("lhs", lhs_dtype), ("rhs", rhs_dtype), ("result", out_dtype)):
        if np.dtype(dt).name not in DTYPE_BITS:
            return f"{what} dtype {np.dtype(dt).name} (the kernels take floating dtypes)"
    return precision_reason(precision, lhs_dtype, rhs_dtype)


def record_fallback(what: str, reason: str, runs: str = "lax.dot_general") -> None:
    """Records, at trace time, that a call runs on XLA (`runs`) rather than the primitive."""
    dispatch.record(dispatch.Lowered(None, f"{what}: {runs} ({reason})"))


def unreduced_axes(out_sharding) -> frozenset:
    """The mesh axes over which `out_sharding` asks for partial sums (`unreduced=`)."""
    spec = getattr(out_sharding, "spec", out_sharding)
    return frozenset(getattr(spec, "unreduced", None) or ())


def with_result_type(out, weak_type: bool, out_sharding):
    """`out` weakly typed where the reference result is, and resharded where asked."""
    if weak_type:
        from jax._src.lax import lax as lax_internal  # noqa: PLC0415

        out = lax_internal._convert_element_type(out, out.dtype, weak_type=True)
    if out_sharding is not None:
        out = jax.sharding.reshard(out, out_sharding)
    return out


def dot_general(
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
) -> jax.Array:
    """`jax.lax.dot_general` on CuTe DSL GEMM kernels, wherever the contraction is a GEMM.

    Same signature, result shape, dtype and weak type as `lax.dot_general`, so it can be passed
    as `dot_general=` to `flax.nnx.Linear`, `flax.linen.Dense`, `DenseGeneral` and the like, and
    as `_dot_general=` to `jnp.einsum` (`jax_sm100.einsum`). Contractions a GEMM can do (any
    batch dims, any number of contracting dims that group into one, transposes folded into the
    kernels' operand layouts) bind the matmul primitive, with its autodiff, batching and
    sharding rules; the rest run `lax.dot_general`, and `jax_sm100.lowerings()` records why.

    Args:
      lhs: array.
      rhs: array.
      dimension_numbers: `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`.
      precision: as `lax.dot_general`. Every `lax.Precision` runs on the kernels for 16-bit
        operands, as do the presets naming them (`lax.DotAlgorithmPreset`'s BF16_BF16_F32,
        F16_F16_F32, and ANY_F8_ANY_F8_F32_FAST_ACCUM of two fp8 operands); two fp8 operands
        run on the kernels at DEFAULT (XLA's fast accumulation), and on `lax.dot_general` at
        HIGH, HIGHEST or ANY_F8_ANY_F8_F32 (float32 accumulation); `HIGHEST` with float32
        operands, or another algorithm, runs `lax.dot_general`.
      preferred_element_type: the result dtype (as `lax.dot_general`; accumulation is float32,
        of two fp8 operands the fp8 tensor core's accumulator).
      out_sharding: as `lax.dot_general`; the result is resharded to it.

    Returns:
      `[batch..., lhs free..., rhs free...]`, as `lax.dot_general`.

    Raises:
      The errors of `lax.dot_general` for invalid dimension numbers, shapes or dtypes.
    """
    lhs, rhs = P.as_array(lhs, "dot_general", "lhs"), P.as_array(rhs, "dot_general", "rhs")
    reference = functools.partial(
        lax.dot_general, dimension_numbers=dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type, out_sharding=out_sharding,
    )  # fmt: skip
    want = jax.eval_shape(reference, lhs, rhs)  # lax's checks, result dtype and weak type
    reason = fallback_reason(lhs.dtype, rhs.dtype, want.dtype, precision)
    if reason is None and (pending := unreduced_axes(out_sharding)):
        # The partitioned kernels reduce k's partial sums; lax types them as asked.
        reason = f"out_sharding unreduced over {sorted(pending)}"
    form = None
    if reason is None:
        form = gemm_form(lhs.shape, rhs.shape, dimension_numbers)
        if isinstance(form, str):
            reason, form = form, None
    if form is None:
        record_fallback(f"jax_sm100.dot_general {dimension_numbers}", reason)
        return reference(lhs, rhs)
    params = dict(
        transpose_a=form.lhs.transposed, transpose_b=form.rhs.transposed, alpha=1.0,
        beta=1.0, activation=None, out_dtype=np.dtype(want.dtype), has_bias=False,
        has_c=False, save_preact=False, act_grad=None,
    )  # fmt: skip

    def on_kernels(lhs, rhs):
        a = lhs if form.lhs.perm is None else lax.transpose(lhs, form.lhs.perm)
        b = rhs if form.rhs.perm is None else lax.transpose(rhs, form.rhs.perm)
        # Only reshapes that change the shape: `a` unchanged must reach the primitive as itself.
        a = a if a.shape == form.lhs.shape else P.typed_reshape(a, form.lhs.shape)
        b = b if b.shape == form.rhs.shape else P.typed_reshape(b, form.rhs.shape)
        (out,) = P.matmul_p.bind(a, b, plan=None, **params)
        return out if out.shape == form.out_shape else P.typed_reshape(out, form.out_shape)

    if form.lhs.shape != lhs.shape or form.rhs.shape != rhs.shape or form.out_shape != want.shape:
        if P.explicit_type(lhs) is not None or P.explicit_type(rhs) is not None:
            # Under Explicit axes a reshape that merges a split dim as the minor part (heads
            # split after the head dim, a sequence split under a whole batch) has no type
            # without moving data (`P.typed_reshape` types those that have one): lax's own
            # rule handles those layouts.
            try:
                jax.eval_shape(on_kernels, lhs, rhs)
            except jax_core.ShardingTypeError as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                record_fallback(f"jax_sm100.dot_general {dimension_numbers}",
                                f"the GEMM's reshape of a sharded dim: {first}")  # fmt: skip
                return reference(lhs, rhs)
    if form.copies:
        dispatch.record(dispatch.Lowered(None, "jax_sm100.dot_general: " + "; ".join(form.copies)))
    out = on_kernels(lhs, rhs)
    if out_sharding is None:
        out_sharding = lax_type(out, want)
    return with_result_type(out, want.weak_type, out_sharding)


def lax_type(out, want):
    """Under Explicit axes, lax.dot_general's result type `want`'s sharding where `out`'s
    differs, else None: the GEMM's result is typed by its own rule (a batch dim split as
    either operand has it, heads kept split through the reshapes), lax's by its (batch dims as
    lhs has them), and a caller's cotangents, `out_specs` and later ops expect lax's."""
    have, need = P.explicit_type(out), getattr(want, "sharding", None)
    if have is None or need is None:
        return None
    ndim = len(want.shape)

    def entries(spec):
        return [P.spec_axes(spec[i] if i < len(spec) else None) for i in range(ndim)]

    if entries(tuple(have.spec)) == entries(tuple(need.spec)):
        return None
    return need


def einsum(subscripts, /, *operands, **kwargs) -> jax.Array:
    """`jnp.einsum` with every pairwise contraction through `jax_sm100.dot_general`.

    Same signature as `jnp.einsum`; pass it as `einsum_op=` to `flax.nnx.Einsum`.
    """
    return jnp.einsum(subscripts, *operands, _dot_general=dot_general, **kwargs)
