"""`jax_sm100.ragged_dot`: the grouped GEMM of mixture-of-experts layers, as two primitives.

    ragged_dot_p       lhs [*B, m, k], rhs [*B, g, k, n] ([*B, g, n, k] with transpose_rhs),
                       group_sizes [*B, g], optionally bias [*B, g, n]  -> out [*B, m, n]
                       rows [s_i, s_i + group_sizes[i]) of lhs times rhs[i], where s_i is the
                       sum of the sizes before group i, plus bias[i]; rows past the last group
                       are zero; then `activation` (None, "relu", "gelu" (tanh form) or
                       "silu") of each float32 sum, rounded once
    ragged_outer_p     lhs [*B, m, k], rhs [*B, m, n], group_sizes [*B, g]
                                                     -> out [*B, g, k, n]
                       out[i] = lhs[rows of group i]^T @ rhs[rows of group i]: the weight
                       gradient of ragged_dot (a contraction whose k-segments vary in length);
                       with `summed` = s > 0, the innermost s batch dims summed in the
                       accumulator (out [*B[:-s], g, k, n]: the gradient of experts shared by
                       those batches)

Both accumulate in float32 (float64 for float64 operands) and round once to `out_dtype`; with a
`precision` (lax.ragged_dot's path: float32 at HIGHEST, integer and complex operands, other dot
algorithms; `_on_lax`) they are XLA's ragged dot at that precision in lax's dtypes, on every
platform, never a kernel. They are each other's transposes, so a training step differentiates
into these two primitives only (each product keeping the `precision`):

    d lhs = ragged_dot(ct, rhs, transpose_rhs=not transpose_rhs)
    d rhs = ragged_outer(lhs, ct)                  ([g, n, k] order under transpose_rhs)

Under `vmap` the experts may stay unbatched beside batched rows (rhs [g, k, n], bias [g, n]:
shared by every batch; `_batch_ragged_dot`): the kernels read them in place, and their gradient
is ragged_outer summed over those batches (`summed`), in one product.

A bias (the optional fourth operand, in the accumulator dtype) is added in the grouped
kernel's epilogue, row by row as its group's; it makes the product affine: the JVP binds the
bilinear terms without it and adds the bias tangent's rows (a product with the rows' one-hot
groups, whose transpose is the per-group sum of the cotangent's rows: `_bias_tangent_rows`),
so only a primal bind ever carries a bias.
An activation makes ragged_dot_p nonlinear: its JVP takes the float32 product z of the same
operands without it (ragged_dot_p again, with the bias), returns act(z) and scales the tangent
by act'(z), so a training step still differentiates into the two bilinear primitives. Only a
call that is not differentiated runs the activation in the grouped kernel's epilogue (unless
JAX_SM100_RAGGED_FUSED_ACTIVATION=0; ragged_gpu.py); sharded
partial sums over k take it after their reduction (ragged_sharding.py).

The batch dims `B` come from `vmap` (the batching rules move every mapped dim to the front and
broadcast the unmapped operands). On CUDA each primitive lowers through `ragged_gpu.py` to the
grouped GEMM kernel its plan names (`kernels/sm90_grouped.py`, `kernels/sm100_grouped.py`;
batched operands fold into one grouped product), or to XLA's `ragged_dot_general` where none
takes it (mixed dtypes, an arch without a grouped kernel, whatever the plan's reason names); on
CPU to `ragged_dot_general`. Every CUDA lowering records which in
`jax_sm100.lowerings()`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import dispatch as jax_dispatch
from jax.interpreters import ad, batching, mlir

from jax_sm100._src import autodiff, dispatch, ragged_sharding
from jax_sm100._src import dot_general as DG
from jax_sm100._src import dtypes as D
from jax_sm100._src import primitive as P
from jax_sm100._src.kernels.spec import ACTIVATIONS

ragged_dot_p = P.Primitive("jax_sm100_ragged_dot")
ragged_outer_p = P.Primitive("jax_sm100_ragged_outer")


# --- the public function -------------------------------------------------------------------------


# What ragged_dot says of data that runs only block-scaled (fp4): no grouped product is.
_BLOCK_SCALED_FIX = (
    ", and no grouped product is block-scaled: give lhs and rhs in bfloat16 or fp8 "
    "(float8_e4m3fn), or run each group through jax_sm100.scaled_matmul"
)


def ragged_dot(
    lhs,
    rhs,
    group_sizes,
    precision=None,
    preferred_element_type=None,
    group_offset=None,
    out_sharding=None,
    *,
    bias=None,
    activation=None,
) -> jax.Array:
    """`jax.lax.ragged_dot`: lhs [m, k] rows in consecutive groups, group i (of `group_sizes[i]`
    rows) multiplied by rhs[i] ([g, k, n]); rows past the last group give zeros. With
    `activation` ("relu", "gelu": the tanh form, or "silu"), that of each float32 sum, rounded
    once: `act(lax.ragged_dot(...))` in one product (an extension of lax.ragged_dot's
    signature, as `jax_sm100.matmul`'s activation is of jnp.matmul's). With `bias` [g, n] (one
    row per group, as experts with biases have), each row of group i gets bias[i] (in float32)
    added to its float32 sum before the activation, in the grouped kernel's epilogue; rows past
    the last group stay zero. Its gradient is the per-group sum of the cotangent's rows.
    `out_sharding`, as lax.ragged_dot's: the result is resharded to it.

    Differences from `lax.ragged_dot`, as for `jax_sm100.matmul`: products accumulate in float32
    and round once; two fp8 operands give bfloat16 unless `preferred_element_type` says
    otherwise (fp8 results lose too much); group sizes are clamped to [0, m] before use (in
    their own dtype: sizes past int32 do not wrap), negative ones being empty groups, as the
    kernels read them, so the groups never overlap. `precision` is taken as lax takes it (None
    is `jax.default_matmul_precision`'s value). These run as lax.ragged_dot computes them, on
    XLA's ragged dot (recorded in `jax_sm100.lowerings()`; batched under `vmap` with shared
    experts or sizes, which lax.ragged_dot's own rule refuses, and their gradients at the
    same precision, each written in its operand's dtype: with a narrower
    `preferred_element_type` more exact than lax's, which rounds them to it): float32
    operands at `Precision.HIGHEST`, integer and complex operands, a `lax.DotAlgorithm`, and a
    `lax.DotAlgorithmPreset` other than the kernels' own
    (DEFAULT; BF16_BF16_F32, F16_F16_F32 and ANY_F8_ANY_F8_F32_FAST_ACCUM of such operands;
    HIGH, HIGHEST and ANY_F8_ANY_F8_F32 of two fp8 operands of one format ask for float32
    accumulation: `dot_general.precision_reason`). An fp8
    operand beside a bfloat16 or float16 one is converted to that dtype first (exactly), and so
    are e4m3 beside e5m2 to bfloat16, so the pair runs on the 16-bit kernel. Two operands of one fp8
    format run on the fp8 kernel; on sm_90a (whose fp8 wgmma reads them K-major) XLA
    transposes the experts to [g, n, k] for it. `group_offset` raises
    NotImplementedError (lax.ragged_dot cannot take one either).

    Raises:
      ValueError: ranks or sizes that do not match (named in the message), a bias not [g, n],
        or an unknown activation.
      TypeError: boolean operands, a bias or activation with integer operands, a non-floating
        bias, group sizes that are not integers, or with floating operands a
        `preferred_element_type` the kernels do not write (integer, complex, boolean).
      NotImplementedError: a `group_offset`.
    """
    lhs, rhs, group_sizes = (
        P.as_array(x, "ragged_dot", name)
        for x, name in ((lhs, "lhs"), (rhs, "rhs"), (group_sizes, "group_sizes"))
    )
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"jax_sm100.ragged_dot: {activation=} must be one of {ACTIVATIONS} (None: the plain "
            "product)"
        )
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            f"jax_sm100.ragged_dot: lhs must be [m, k], rhs [g, k, n] and group_sizes [g]; got "
            f"lhs.shape={lhs.shape}, rhs.shape={rhs.shape}, group_sizes.shape={group_sizes.shape}"
            + ("; batches of tokens: jax.vmap(jax_sm100.ragged_dot) over their leading dims"
               if lhs.ndim > 2 else "")
        )  # fmt: skip
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(
            f"jax_sm100.ragged_dot: group_sizes must be integers, got {group_sizes.dtype}; "
            "e.g. group_sizes.astype(jnp.int32)"
        )
    k, (g, kb, _) = lhs.shape[1], rhs.shape
    if k != kb or group_sizes.shape[0] != g:
        # rhs given [g, n, k] (the layout of a weight stored transposed) is the likely slip.
        hint = (
            "; rhs is [g, k, n]: rhs.transpose(0, 2, 1) if it is stored [g, n, k]"
            if k != kb and rhs.shape[2] == k
            else ""
        )
        raise ValueError(
            f"jax_sm100.ragged_dot: lhs.shape={lhs.shape} has k={k}, rhs.shape={rhs.shape} has "
            f"k={kb} and g={g}, group_sizes.shape={group_sizes.shape}: k and g must agree{hint}"
        )
    if group_offset is not None:
        raise NotImplementedError(
            "jax_sm100.ragged_dot: group_offset is not supported (nor does lax.ragged_dot "
            f"take one in JAX {jax.__version__}); for experts held locally, pass rhs and "
            "group_sizes sliced to them and the rows routed to them"
        )
    sizes = _int32_sizes(group_sizes, lhs.shape[0])
    numeric = [jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.complexfloating)
               for x in (lhs, rhs)]  # fmt: skip
    if any(numeric):
        if bias is not None or activation is not None:
            raise TypeError(
                f"jax_sm100.ragged_dot: {lhs.dtype} x {rhs.dtype} operands run on "
                "lax.ragged_dot, which takes no bias or activation; apply them to its result"
            )
        return _on_lax(f"{lhs.dtype} x {rhs.dtype} operands", lhs, rhs, sizes, precision,
                       preferred_element_type, out_sharding)  # fmt: skip
    a_name = D.operand_dtype_name(lhs.dtype, "lhs", "jax_sm100.ragged_dot", _BLOCK_SCALED_FIX)
    b_name = D.operand_dtype_name(rhs.dtype, "rhs", "jax_sm100.ragged_dot", _BLOCK_SCALED_FIX)
    if preferred_element_type is None:
        out_dtype = np.dtype(_default_out_dtype(a_name, b_name))
    else:
        out_dtype = D.requested(preferred_element_type, "preferred_element_type",
                                "jax_sm100.ragged_dot")  # fmt: skip
    lhs, rhs = D.widen_fp8_pair(lhs, rhs)
    acc = P.acc_dtype(lhs.dtype, rhs.dtype, out_dtype)
    biases = ()
    if bias is not None:
        biases = (_check_bias(bias, g, rhs.shape[2]).astype(acc),)
    # The algorithms of the operands the kernels take (fp8 ones widened above), or of the
    # operands as given (ANY_F8_ANY_F8_F32 of e4m3 x e5m2, computed exactly as bfloat16).
    fallback = DG.precision_reason(precision, lhs.dtype, rhs.dtype)
    fallback = fallback and DG.precision_reason(precision, a_name, b_name)
    if fallback is not None and activation is None and bias is None:
        return _on_lax(fallback, lhs, rhs, sizes, precision, out_dtype, out_sharding)
    if fallback is not None:
        z = _on_lax(fallback, lhs, rhs, sizes, precision, acc, None)
        if bias is not None:
            z = z + group_rows(biases[0], sizes, lhs.shape[0])
        out = P.apply_activation(z, activation).astype(out_dtype)
    else:
        out = ragged_dot_p.bind(
            lhs, rhs, sizes, *biases, transpose_rhs=False, out_dtype=out_dtype,
            activation=activation, precision=None,
        )  # fmt: skip
    return out if out_sharding is None else jax.sharding.reshard(out, out_sharding)


def _int32_sizes(group_sizes, m: int):
    """The sizes as int32, as the primitive takes them. Sizes of wider or unsigned 32-bit types
    are clamped to [0, m] first (to the last int32 row where m passes it), in their own dtype,
    so that one past int32 saturates rather than wrapping; int32 and narrower pass as they are
    (an op on them would cost the expert-sharded sizes a gather). Negative sizes are empty
    groups on every path (the kernels clamp them, `_lax_sizes` on XLA's)."""
    dtype = np.dtype(group_sizes.dtype)
    if dtype.itemsize > 4 or (dtype.kind == "u" and dtype.itemsize == 4):
        group_sizes = jnp.clip(group_sizes, 0, ragged_sharding.int32_rows(m))
    return group_sizes.astype(jnp.int32)


def _lax_sizes(gs, m):
    """The sizes XLA's ragged dot takes for the groups the kernels read
    (`ragged_sharding.group_ends`): with negative sizes it would overlap the groups, and a
    running sum past int32 would wrap. Each size clamped to [0, m] (element by element, so
    sizes split over experts stay split) is enough while g m stays within int32: XLA's groups
    end at m as the kernels' do; past that, or for a symbolic m, the saturated sizes. (A
    symbolic g gets the clipped sizes: XLA's ragged dot then raises its own error, that it
    takes a static group count.)"""
    g = gs.shape[-1]
    if jax.export.is_symbolic_dim(g) or (not jax.export.is_symbolic_dim(m) and g * m < 2**31):
        return jnp.clip(gs, 0, m)
    return ragged_sharding.saturated_sizes(gs, m)


@functools.lru_cache(maxsize=64)
def _default_out_dtype(a_name: str, b_name: str) -> str:
    """The result dtype with no `preferred_element_type`: lax.ragged_dot's (bfloat16 beside
    float16 is bfloat16, as for lax.dot_general, where jnp would promote to float32), but
    bfloat16 for fp8 operands (`dtypes.default_out_dtype`)."""
    if a_name in D.FP8_DTYPES or b_name in D.FP8_DTYPES:
        return D.default_out_dtype(a_name, b_name)
    return _lax_out_dtype(a_name, b_name, None).name


def _on_lax(why, lhs, rhs, sizes, precision, preferred_element_type, out_sharding):
    """lax.ragged_dot's product, recorded as the path taken and why: ragged_dot_p with lax's
    canonical `precision` (`_lax_precision`), whose every lowering is XLA's ragged dot at that
    precision and in lax's result dtype. Bound as our primitive rather than called, so that
    its batching rule takes experts or sizes that a vmap leaves unmapped (lax.ragged_dot's
    batches only operands all mapped at dim 0), in its gradients too."""
    dispatch.record(
        dispatch.Lowered(None, f"jax_sm100.ragged_dot: XLA's ragged dot, as lax.ragged_dot ({why})")
    )
    out_dtype = _lax_out_dtype(lhs.dtype, rhs.dtype, preferred_element_type)
    out = ragged_dot_p.bind(
        lhs, rhs, sizes, transpose_rhs=False, out_dtype=out_dtype, activation=None,
        precision=_lax_precision(precision),
    )  # fmt: skip
    return out if out_sharding is None else jax.sharding.reshard(out, out_sharding)


def _lax_precision(precision):
    """`precision` as lax canonicalizes it (None read from `jax.default_matmul_precision`
    now, so that the backward products keep it), DEFAULT where that leaves None: the
    primitives' `precision` parameter, which is None only on the kernels' path."""
    from jax._src.lax import lax as lax_internal  # noqa: PLC0415  (no public canonicalizer)

    return lax_internal.canonicalize_precision(precision) or (
        lax.Precision.DEFAULT, lax.Precision.DEFAULT
    )  # fmt: skip


def _lax_out_dtype(a_dtype, b_dtype, preferred_element_type) -> np.dtype:
    """lax.ragged_dot's result dtype: lax.dot_general's rule, which it shares. Asked of
    dot_general because, asked of ragged_dot itself under a mesh of Explicit axes, JAX 0.12
    raises (it infers no result sharding for ragged_dot)."""
    out = jax.eval_shape(
        functools.partial(lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())),
                          preferred_element_type=preferred_element_type),
        jax.ShapeDtypeStruct((1, 1), a_dtype), jax.ShapeDtypeStruct((1, 1), b_dtype),
    )  # fmt: skip
    return np.dtype(out.dtype)


def _check_bias(bias, g: int, n: int):
    bias = P.as_array(bias, "ragged_dot", "bias")
    if bias.shape != (g, n):
        raise ValueError(
            f"jax_sm100.ragged_dot: bias.shape={bias.shape}, expected (g, n) = {(g, n)}: one "
            "row per group (for one bias shared by all groups, add it to the result instead)"
        )
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"jax_sm100.ragged_dot: bias must be floating, got {bias.dtype}")
    return bias


def group_rows(per_group, group_sizes, m: int):
    """[*B, m, ...] from per_group [*B, g, ...] and group sizes [*B, g], per batch element: row
    r holds per_group[i] for the group i it belongs to (the sizes clamped to [0, m] and their
    running sum saturating at m, as the grouped kernels read them), zeros past the last group.
    (ragged_dot's bias rows: the XLA lowering's, and the bias tangent's past
    `_bias_tangent_rows`' limits.)"""
    nb = group_sizes.ndim - 1
    take = lambda b, s: _take_rows(b, s, m)
    for _ in range(nb):
        take = jax.vmap(take)
    return take(ragged_sharding.whole_groups(per_group, nb), group_sizes)


def _take_rows(per_group, group_sizes, m: int):
    if per_group.shape[0] == 0:
        return jnp.zeros((m, *per_group.shape[1:]), per_group.dtype)
    ids = _row_groups(group_sizes, m)
    return jnp.take(per_group, ids, axis=0, mode="fill", fill_value=0)


def _row_groups(group_sizes, m: int):
    """[m] int32: each row's group index (g past the last group)."""
    ends = ragged_sharding.group_ends(group_sizes, m)
    # Row r's group is the count of group ends <= r, compared and summed in one fusion (O(m g)
    # compares; the default binary search is a while loop, which on a GPU waits for the host
    # at each of its log2(g) steps: about 150 us at 128 groups, as long as the product). Not a
    # scatter of a mark per end and a running sum: with the ends split unevenly across devices
    # (g experts over an axis that does not divide g, Auto axes) XLA's partitioner scattered
    # their padding too, at row 0, and every row's group came out one too high.
    rows = jnp.arange(m, dtype=ends.dtype)
    return jnp.sum(ends[None, :] <= rows[:, None], axis=-1, dtype=jnp.int32)


# --- abstract evaluation --------------------------------------------------------------------------


def _check_groups(group_sizes, batch, g):
    if tuple(group_sizes.shape) != (*batch, g):
        raise ValueError(f"group_sizes.shape={group_sizes.shape}, expected {(*batch, g)}")


def _ragged_dot_abstract(lhs, rhs, group_sizes, *bias, transpose_rhs, out_dtype,
                         activation=None, differentiated=False, precision=None):  # fmt: skip
    del differentiated, precision  # lowering choices (`_jvp`, `_on_lax`)
    *batch, m, k = lhs.shape
    *rbatch, g, r1, r2 = rhs.shape
    kb, n = (r2, r1) if transpose_rhs else (r1, r2)
    # rhs (and bias) batched as lhs is, or shared by every batch (`_batch`).
    if tuple(rbatch) not in (tuple(batch), ()) or kb != k:
        raise ValueError(f"ragged_dot: lhs {lhs.shape} and rhs {rhs.shape} ({transpose_rhs=})")
    _check_groups(group_sizes, batch, g)
    if len(bias) > 1 or (bias and tuple(bias[0].shape) != (*rbatch, g, n)):
        raise ValueError(f"ragged_dot: bias {[b.shape for b in bias]}, expected {(*rbatch, g, n)}")
    return jax.core.ShapedArray((*batch, m, n), out_dtype)


def _ragged_outer_abstract(lhs, rhs, group_sizes, *, out_dtype, transpose_out, summed=0,
                           precision=None):  # fmt: skip
    del precision  # a lowering choice (`_on_lax`)
    *batch, m, k = lhs.shape
    *rbatch, mr, n = rhs.shape
    if tuple(rbatch) != tuple(batch) or mr != m:
        raise ValueError(f"ragged_outer: lhs {lhs.shape} and rhs {rhs.shape} share [*B, m]")
    if not 0 <= summed <= len(batch):
        raise ValueError(f"ragged_outer: {summed=} of the batch dims {tuple(batch)}")
    g = group_sizes.shape[-1]
    _check_groups(group_sizes, batch, g)
    tail = (n, k) if transpose_out else (k, n)
    return jax.core.ShapedArray((*batch[: len(batch) - summed], g, *tail), out_dtype)


# Results typed under Explicit mesh axes as the partitioner shards them (ragged_sharding.py).
ragged_dot_p.def_abstract_eval(ragged_sharding.typed(_ragged_dot_abstract, "ragged_dot"))
ragged_outer_p.def_abstract_eval(ragged_sharding.typed(_ragged_outer_abstract, "ragged_outer"))


# --- the math in XLA ops (CPU, and the CUDA paths no grouped kernel takes) ---------------------


def _flat(x, nb):
    """x with its nb leading batch dims merged into one (a new unit one when nb == 0)."""
    return x.reshape((math.prod(x.shape[:nb]), *x.shape[nb:])) if nb else x[None]


def _operands(x, y, acc):
    """The operands XLA's ragged dot takes: as they are when both have one dtype of 16 or more
    bits (it accumulates in `acc` itself), else both in `acc` (fp8, or mixed dtypes)."""
    if x.dtype == y.dtype and np.dtype(x.dtype).itemsize >= 2:
        return x, y
    return x.astype(acc), y.astype(acc)


def _ragged_dot_xla(lhs, rhs, group_sizes, *bias, transpose_rhs, out_dtype, activation=None,
                    differentiated=False, precision=None):  # fmt: skip
    del differentiated  # a lowering choice of the CUDA path (`_jvp`)
    nb = lhs.ndim - 2
    if rhs.shape[-3] == 0:
        # No groups: every row is past the last group (XLA's ragged dot cannot lower this).
        n = rhs.shape[-2] if transpose_rhs else rhs.shape[-1]
        zeros = jnp.zeros((*lhs.shape[:-1], n), jnp.float32)
        return P.apply_activation(zeros, activation).astype(out_dtype)
    acc = P.acc_dtype(lhs.dtype, rhs.dtype, out_dtype)
    rhs, bias = _experts_per_batch(lhs, rhs, bias)
    l3, r4, gs = _flat(lhs, nb), _flat(rhs, nb), _lax_sizes(_flat(group_sizes, nb), lhs.shape[-2])
    if transpose_rhs:
        r4 = jnp.swapaxes(r4, -1, -2)
    dn = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((2,), (2,)), ((0,), (0,))),
        lhs_ragged_dimensions=[1],
        rhs_group_dimensions=[1],
    )
    out = _xla_ragged(l3, r4, gs, dn, acc, precision, out_dtype)
    out = out.reshape((*lhs.shape[:-1], out.shape[-1]))
    if bias:
        out = out + group_rows(bias[0].astype(acc), group_sizes, lhs.shape[-2])
    return P.apply_activation(out, activation).astype(out_dtype)


def _xla_ragged(x, y, gs, dn, acc, precision, out_dtype):
    """XLA's ragged dot: with `precision` (lax's path, `_on_lax`), as lax.ragged_dot computes
    it (the operands as given, the result in `out_dtype`); else the primitives' own math (both
    operands exact in `acc`, HIGHEST: no tf32 or bfloat16 passes), in `acc`."""
    if precision is not None:
        return lax.ragged_dot_general(
            x, y, gs, dn, precision=precision, preferred_element_type=out_dtype
        )
    x, y = _operands(x, y, acc)
    return lax.ragged_dot_general(
        x, y, gs, dn, precision=lax.Precision.HIGHEST, preferred_element_type=acc
    )


def shared_experts(lhs, rhs) -> bool:
    """Whether ragged_dot's rhs [g, k, n] is shared by lhs's batches (`_batch`)."""
    return rhs.ndim == 3 and lhs.ndim > 2


def _experts_per_batch(lhs, rhs, bias):
    """(rhs, bias) broadcast along lhs's batch dims where shared (XLA's ragged dot takes
    batched operands alike)."""
    if not shared_experts(lhs, rhs):
        return rhs, bias
    batch = lhs.shape[:-2]
    return (jnp.broadcast_to(rhs, (*batch, *rhs.shape)),
            tuple(jnp.broadcast_to(x, (*batch, *x.shape)) for x in bias))  # fmt: skip


def _ragged_outer_xla(lhs, rhs, group_sizes, *, out_dtype, transpose_out, summed=0,
                      precision=None):  # fmt: skip
    nb = lhs.ndim - 2
    kept = lhs.shape[: nb - summed]
    if group_sizes.shape[-1] == 0:
        tail = (rhs.shape[-1], lhs.shape[-1]) if transpose_out else (lhs.shape[-1], rhs.shape[-1])
        return jnp.zeros((*kept, 0, *tail), out_dtype)
    acc = P.acc_dtype(lhs.dtype, rhs.dtype, out_dtype)
    l3, r3, gs = _flat(lhs, nb), _flat(rhs, nb), _lax_sizes(_flat(group_sizes, nb), lhs.shape[-2])
    dn = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (1,)), ((0,), (0,))),
        lhs_ragged_dimensions=[1],
        rhs_group_dimensions=[],
    )
    out = _xla_ragged(l3, r3, gs, dn, acc, precision, out_dtype)
    out = jnp.moveaxis(out, 0, 1)  # (g, B, k, n) -> (B, g, k, n)
    if transpose_out:
        out = jnp.swapaxes(out, -1, -2)
    out = out.reshape((*lhs.shape[:-2], *out.shape[1:]))
    if summed:
        out = out.sum(axis=tuple(range(nb - summed, nb)))
    return out.astype(out_dtype)


def _cuda(xla_fn, name):
    def lower(*args, **params):
        from jax_sm100._src import ragged_gpu  # noqa: PLC0415

        return ragged_gpu.lower(name, xla_fn, *args, **params)

    return lower


for _prim, _fn, _name in (
    (ragged_dot_p, _ragged_dot_xla, "ragged_dot"),
    (ragged_outer_p, _ragged_outer_xla, "ragged_outer"),
):
    # Eager calls compile the primitive alone, as jit would (dispatch.apply_primitive): the
    # same kernels and sharding rules (XLA's ragged_dot has no Explicit-axes rule of its own).
    _prim.def_impl(functools.partial(jax_dispatch.apply_primitive, _prim))
    # Sharded programs run the registered function per device (ragged_sharding.py).
    mlir.register_lowering(_prim, ragged_sharding.lowering(_prim, _name, _fn), platform="cpu")
    mlir.register_lowering(
        _prim, ragged_sharding.lowering(_prim, _name, _cuda(_fn, _name)), platform="cuda"
    )


# --- batching: every mapped dim to the front, unmapped operands broadcast (shared experts kept) --


def _front(x, d, size):
    """x with its mapped dim `d` moved to the front, or broadcast along a new one (d None)."""
    return jnp.broadcast_to(x[None], (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)


def _mapped_size(args, dims):
    """The vmap's size: the length of the first mapped operand's mapped dim."""
    return next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)


def _batch(prim, args, dims, **params):
    size = _mapped_size(args, dims)
    moved = [_front(x, d, size) for x, d in zip(args, dims, strict=True)]
    return prim.bind(*moved, **params), 0


def _batch_ragged_dot(args, dims, **params):
    """ragged_dot under vmap. Experts that the vmap does not map (rhs [g, k, n], and its bias,
    unbatched) stay shared by every batch: the kernels read them in place for each batch's
    groups (`ragged_gpu.fold_rows`), rather than from a copy per batch. Otherwise `_batch`; and
    experts shared under an inner vmap that this one maps are broadcast along its batch dims."""
    size = _mapped_size(args, dims)
    (lhs, rhs, sizes, *bias), (d_lhs, d_rhs, d_sizes, *d_bias) = args, dims
    if d_rhs is None and rhs.ndim == 3 and all(d is None for d in d_bias):
        lhs, sizes = _front(lhs, d_lhs, size), _front(sizes, d_sizes, size)
        # Marked `differentiated` before this vmap (a gradient inside it): the experts' gradient
        # is per batch (ragged_outer unsummed, always folded), so the products decide as a
        # forward alone would.
        params = dict(params, differentiated=False)
        return ragged_dot_p.bind(lhs, rhs, sizes, *bias, **params), 0
    lhs, rhs, sizes, *bias = (_front(x, d, size) for x, d in zip(args, dims, strict=True))
    batch = lhs.shape[:-2]

    def inner(x):
        # [size, *tail] -> [*batch, *tail]: the inner vmaps' batch dims added after the first.
        tail = x.shape[1:]
        x = x.reshape((size, *(1,) * (len(batch) - 1), *tail))
        return jnp.broadcast_to(x, (*batch, *tail))

    if rhs.ndim < len(batch) + 3:
        rhs, bias = inner(rhs), [inner(x) for x in bias]
    return ragged_dot_p.bind(lhs, rhs, sizes, *bias, **params), 0


batching.primitive_batchers[ragged_dot_p] = _batch_ragged_dot
batching.primitive_batchers[ragged_outer_p] = lambda a, d, **p: _batch(ragged_outer_p, a, d, **p)


# --- differentiation: bilinear in (lhs, rhs); group sizes are integers -------------------------


def _ragged_dot_transpose(ct, lhs, rhs, group_sizes, *bias, transpose_rhs, out_dtype,
                          activation=None, differentiated=False, precision=None):  # fmt: skip
    # Only the linear product is transposed: the JVP of an activated or biased one binds the
    # tangent's products without either.
    assert activation is None and not bias, (activation, len(bias))
    if type(ct) is ad.Zero:
        return [_zero(lhs), _zero(rhs), None]
    d_lhs = d_rhs = None
    cd = _compute_dtype(lhs, rhs)
    if ad.is_undefined_primal(lhs):
        d_lhs = _cotangent(lhs, ragged_dot_p, ct.astype(cd), rhs.astype(cd), group_sizes,
                           transpose_rhs=not transpose_rhs, activation=None,
                           differentiated=differentiated, precision=precision)  # fmt: skip
    if ad.is_undefined_primal(rhs):
        # Experts shared by lhs's batches: their gradient summed over those batches.
        summed = lhs.ndim + 1 - rhs.aval.ndim
        d_rhs = _cotangent(rhs, ragged_outer_p, lhs.astype(cd), ct.astype(cd),
                           ragged_sharding.group_sizes_like(group_sizes, rhs),
                           transpose_out=transpose_rhs, summed=summed,
                           precision=precision)  # fmt: skip
    return [d_lhs, d_rhs, None]


def _cotangent(target, prim, *operands, **params):
    """`prim` bound as the cotangent of the operand `target`, in its dtype: written in it, or
    (an fp8 operand's on the kernels' path) in bfloat16 and converted after
    (`autodiff.cotangent_product_dtype`)."""
    want = np.dtype(target.aval.dtype)
    cd = np.dtype(operands[0].dtype)  # both operands are in the compute dtype
    if params["precision"] is None:
        written = autodiff.cotangent_product_dtype(want)
    elif jnp.issubdtype(cd, jnp.complexfloating):
        # XLA takes no result narrower than complex operands (a real operand's cotangent, or
        # complex64 of complex128): written in their dtype, its real part kept, as lax's
        # transpose converts after.
        written = cd
    else:
        written = want
    out = prim.bind(*operands, out_dtype=written, **params)
    if jnp.iscomplexobj(out) and not jnp.issubdtype(want, jnp.complexfloating):
        out = jnp.real(out)
    return P.cotangent_like(out.astype(want), target)


def _ragged_outer_transpose(ct, lhs, rhs, group_sizes, *, out_dtype, transpose_out, summed=0,
                            precision=None):  # fmt: skip
    # out[i] = lhs_i^T rhs_i: d lhs_i = rhs_i ct[i]^T, d rhs_i = lhs_i ct[i] (per group's rows).
    if type(ct) is ad.Zero:
        return [_zero(lhs), _zero(rhs), None]
    d_lhs = d_rhs = None
    cd = _compute_dtype(lhs, rhs)
    if summed:
        # A sum over batches: its cotangent is shared by them (ragged_dot's experts), or
        # broadcast along them when batch dims outside the sum remain.
        nb = len(_aval_shape(lhs)) - 2
        if summed < nb:
            shape = ct.shape
            ct = ct.reshape((*shape[: nb - summed], *(1,) * summed, *shape[nb - summed :]))
            ct = jnp.broadcast_to(ct, (*_aval_shape(lhs)[:nb], *shape[nb - summed :]))
    if ad.is_undefined_primal(lhs):
        d_lhs = _cotangent(lhs, ragged_dot_p, rhs.astype(cd), ct.astype(cd), group_sizes,
                           transpose_rhs=not transpose_out, activation=None,
                           differentiated=True, precision=precision)  # fmt: skip
    if ad.is_undefined_primal(rhs):
        d_rhs = _cotangent(rhs, ragged_dot_p, lhs.astype(cd), ct.astype(cd), group_sizes,
                           transpose_rhs=transpose_out, activation=None,
                           differentiated=True, precision=precision)  # fmt: skip
    return [d_lhs, d_rhs, None]


def _zero(x):
    return ad.Zero(x.aval.to_ct_aval()) if ad.is_undefined_primal(x) else None


def _aval_shape(x):
    return x.aval.shape if ad.is_undefined_primal(x) else x.shape


def _compute_dtype(x, y):
    """The dtype a backward product takes its operands in: matmul's policy
    (`autodiff.compute_dtype`: 16-bit kept, fp8 as bfloat16, a float32 cotangent rounded once)."""
    return autodiff.compute_dtype(autodiff._aval_dtype(x), autodiff._aval_dtype(y))


def _jvp(prim, primals, tangents, *, _result_dtype=None, **params):
    """Bilinear in (lhs, rhs): d out = f(d lhs, rhs) + f(lhs, d rhs). With an activation:
    z = the float32 product (bilinear, as above), out = act(z), d out = act'(z) d z.

    Where rhs is differentiated, ragged_dot's products here are marked `differentiated`, and
    so is d lhs (the transpose binds it as the product it transposes is marked): where batches
    share their experts, the CUDA lowering then makes one choice for the forward and the
    backward products (`ragged_gpu.merges_batches`), so that they share the row gathers of a
    merge with the weight gradient's rather than each paying its own. Without a weight
    gradient they decide as a forward."""
    if prim is ragged_dot_p:
        params = dict(params, differentiated=type(tangents[1]) is not ad.Zero)
    if params.get("activation") is not None:
        return _jvp_activated(primals, tangents, **params)
    lhs, rhs, group_sizes, *bias = primals
    d_lhs, d_rhs, _, *d_bias = tangents
    out = prim.bind(*primals, **params)
    terms = []
    if type(d_lhs) is not ad.Zero:
        terms.append(prim.bind(d_lhs, rhs, group_sizes, **params))
    if type(d_rhs) is not ad.Zero:
        terms.append(prim.bind(lhs, d_rhs, group_sizes, **params))
    if bias and type(d_bias[0]) is not ad.Zero:
        result = out.dtype if _result_dtype is None else _result_dtype
        d_b = d_bias[0]
        if shared_experts(lhs, rhs):  # a bias shared by the batches, as its experts
            d_b = jnp.broadcast_to(d_b, (*group_sizes.shape[:-1], *d_b.shape))
        rows = _bias_tangent_rows(d_b, group_sizes, lhs.shape[-2], result, like=out)
        terms.append(P.cotangent_like(rows.astype(out.dtype), out))
    if not terms:
        return out, ad.Zero.from_primal_value(out)
    return out, sum(terms[1:], terms[0])


# `_bias_tangent_rows` takes the one-hot product up to this many groups (measured up to 256),
# and one-hot matrices of up to this many elements (256 MiB of float32); past them, the gather.
_ONE_HOT_MAX_GROUPS = 512
_ONE_HOT_MAX = 1 << 26


def _bias_tangent_rows(d_bias, group_sizes, m: int, result_dtype, like=None):
    """The bias tangent's rows, [*B, m, n], as a product of each row's one-hot group [*B, m, g]
    with d_bias [*B, g, n]: its transpose, the bias's gradient, is then the product of the
    one-hot transposed with the cotangent (XLA's GEMM: the per-group sums of the cotangent's
    rows, in float32) rather than a gather's scatter-add, whose atomics on g rows took 1.4 ms
    at 8 groups of 4096 rows x 4096 on the H200 against 0.09 ms for the product (RESULTS.md).
    The one-hot is rebuilt from the group sizes where the product runs (`jax.checkpoint`), so
    a gradient keeps the sizes, not an [m, g] residual. Its precision follows ragged_dot's
    result dtype `result_dtype`: for bfloat16 and 8-bit results the default (their cotangents
    are exact in one bfloat16 pass; an activation's float32 cotangent is then rounded no
    coarser than the backward products round it: to bfloat16), HIGHEST for float16 and float32
    results. Past `_ONE_HOT_MAX_GROUPS` or `_ONE_HOT_MAX` (checked on the shapes the JVP
    sees: under `vmap` of a gradient the batch is added after) or with a symbolic m (whose
    size no comparison can decide), the gather. Under Explicit mesh
    axes the rows come out typed as `like` (ragged_dot's result): the one-hot split as its
    batch and rows, d_bias as its batch and n, so that the gradient's product runs on each
    device's rows and reduces the [g, n] partial sums, rather than gathering the cotangent."""
    *batch, g, n = d_bias.shape
    elements = math.prod(batch) * m * g
    if (
        g == 0
        or g > _ONE_HOT_MAX_GROUPS
        or jax.export.is_symbolic_dim(elements)
        or (elements > _ONE_HOT_MAX)
    ):
        return group_rows(d_bias, group_sizes, m)
    result = np.dtype(result_dtype)
    narrow = result == np.dtype(jnp.bfloat16) or result.itemsize == 1
    nb = len(batch)
    typed = None if like is None else P.explicit_type(like)
    if typed is None:
        d_bias = ragged_sharding.whole_groups(d_bias, nb)
        one_hot_type = None
    else:
        # [*B, m, n] as `like`: the one-hot [*B, m, g] and d_bias [*B, g, n] cut to match.
        spec = tuple(typed.spec) + (None,) * (nb + 2 - len(typed.spec))
        bias_type = typed.update(spec=jax.sharding.PartitionSpec(*spec[:nb], None, spec[nb + 1]))
        one_hot_type = typed.update(spec=jax.sharding.PartitionSpec(*spec[: nb + 1], None))
        d_bias = jax.sharding.reshard(d_bias, bias_type)
    product = functools.partial(
        _one_hot_product, m=m, one_hot_type=one_hot_type, out_type=typed,
        precision=lax.Precision.DEFAULT if narrow else lax.Precision.HIGHEST,
    )  # fmt: skip
    return jax.checkpoint(product, prevent_cse=False)(d_bias, group_sizes)


def _one_hot_product(d_bias, group_sizes, *, m: int, one_hot_type, out_type, precision):
    *batch, g, _ = d_bias.shape
    nb = len(batch)
    ids = jax.vmap(lambda s: _row_groups(s, m))(group_sizes.reshape((-1, g)))
    # (Of equal ranks: a program under jax_numpy_rank_promotion='raise' differentiates too.)
    groups = jnp.arange(g, dtype=ids.dtype).reshape((*[1] * nb, 1, g))
    one_hot = ids.reshape((*batch, m, 1)) == groups
    one_hot = one_hot.astype(d_bias.dtype)
    if one_hot_type is not None:
        one_hot = jax.sharding.reshard(one_hot, one_hot_type)
    dims = (((nb + 1,), (nb,)), (tuple(range(nb)), tuple(range(nb))))
    rows = lax.dot_general(one_hot, d_bias, dims, precision=precision, out_sharding=out_type)
    # Rows past every group selected to zeros, so that the gradient's product reads none of
    # their cotangent (padding, dropped tokens): a NaN there, as jnp.where(mask, f(out), 0)
    # gives where f' is infinite, made every group's bias gradient NaN (0 * NaN in the
    # one-hot product), where lax's math ignores them. Inside the groups the product still
    # spreads a non-finite cotangent row to every group's sum, and (forward mode) a non-finite
    # entry of one group's bias tangent to every row (README: the gather's transpose, a
    # scatter-add, is what the product avoids).
    inside = jnp.sum(one_hot, axis=-1, keepdims=True) > 0
    return jnp.where(inside, rows, jnp.zeros_like(rows))


def _jvp_activated(primals, tangents, *, activation, out_dtype, **params):
    lhs, rhs, *_ = primals
    acc = P.acc_dtype(lhs.dtype, rhs.dtype, out_dtype)
    z, dz = _jvp(ragged_dot_p, primals, tangents, out_dtype=acc, activation=None,
                 _result_dtype=out_dtype, **params)  # fmt: skip
    out = P.apply_activation(z, activation).astype(out_dtype)
    if type(dz) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    return out, P.times_activation_grad(dz, z, activation).astype(out_dtype)


for _prim, _transpose in (
    (ragged_dot_p, _ragged_dot_transpose),
    (ragged_outer_p, _ragged_outer_transpose),
):
    ad.primitive_jvps[_prim] = lambda primals, tangents, _prim=_prim, **params: _jvp(
        _prim, primals, tangents, **params
    )
    ad.primitive_transposes[_prim] = _transpose
