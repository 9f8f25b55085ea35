"""The CUDA lowering of ragged_dot's two primitives: plan for the device, compile, call the FFI.

    ragged_dot_p   lhs [m, k], rhs [g, k, n] (or [g, n, k]), group_sizes [g] -> [m, n]
                   the grouped kernel in ragged-rows mode ("m"): A = lhs, B = rhs as (N, K, G)
    ragged_outer_p lhs [m, k], rhs [m, n], group_sizes [g] -> [g, k, n] (or [g, n, k])
                   ragged-contraction mode ("k"): A = lhs^T (M-major), B = rhs^T (N-major),
                   D (k, n, g); under transpose_out the operands swap roles

Each call is one `GemmProblem` with `groups` and `ragged` (planning), the plan `dispatch.
plan_call` decides, one compiled binary (`compile_plan`, the family `plan.kernel` names) and one
call of the same FFI handler the dense kernels use, with the group sizes as a device buffer.
Batched operands (vmap: every operand with the same leading dims, `ragged._batch`, or experts
unbatched beside batched rows, `ragged._batch_ragged_dot`) fold into one grouped product of
B x g groups over the B x m rows (`fold_rows`, `fold_outer`), so they run on the kernels too;
experts shared by the batches are read in place (`KernelSpec.b_groups`), and their gradient
summed over the batches in the kernel (`KernelSpec.k_segments`), or, where the groups are small
(`merges_batches`), the batches' rows are gathered expert by expert first (`merge_rows`). On
sm_90a, fp8 experts [g, k, n] are transposed by XLA for the K-major fp8 kernel
(`_k_major_experts_only`).
Mixed dtypes and anything the planner sends to XLA (`plan.reason`) run on XLA's ragged dot;
every lowering is recorded (`jax_sm100.lowerings()`).

A plan with `dynamic_tiles` (kernels/grouped.py) takes one more operand, its tile counter: zeros
aliased to a second result, so every launch starts from zero.

ragged_dot's `activation` runs in the grouped kernel's epilogue, on each float32 sum before the
one rounding (verified on the H200 by tests/test_gpu_ragged.py, eleventh session), and so does
its bias (one float32 row per group, read in the epilogue at the tile's group) where the family
takes one (`why_not`); where it does not, the kernel writes the float32 product and XLA adds
each row's bias row (recorded).
JAX_SM100_RAGGED_FUSED_ACTIVATION=0 in the environment turns that off: the kernel then writes
the float32 product and XLA applies the activation, which means the same.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_sm100._src import constraints, dispatch, planning, ragged_sharding
from jax_sm100._src import primitive as P
from jax_sm100._src.ffi_checks import Tie, problem_ties
from jax_sm100._src.kernels.spec import KernelSpec

FUSED_ACTIVATION_ENV = "JAX_SM100_RAGGED_FUSED_ACTIVATION"


def fused_activation() -> bool:
    """Whether ragged_dot's activation runs in the grouped kernel's epilogue (module docstring):
    unless FUSED_ACTIVATION_ENV is "0"; "1" or unset fuse it, other values raise PlanError."""
    value = os.environ.get(FUSED_ACTIVATION_ENV, "")
    if value not in ("", "0", "1"):
        raise constraints.PlanError(f"{FUSED_ACTIVATION_ENV}={value!r}: '1', '0' or unset")
    return value != "0"


def _kernel_problem(name, lhs, rhs, group_sizes, params, segments=1):
    """(problem, operands, modes, out_shape) for the grouped kernel, or a reason it cannot
    (`segments`: ragged_outer's groups summed into each result, `KernelSpec.k_segments`)."""
    if lhs.ndim != 2:
        return f"{name}: batched operands with no groups or no batches run on XLA's ragged dot"
    if lhs.dtype != rhs.dtype:
        return f"{name}: mixed operand dtypes {lhs.dtype} x {rhs.dtype} run on XLA's ragged dot"
    g = group_sizes.shape[0]
    if 0 in (*lhs.shape, *rhs.shape, g):
        return f"{name}: an empty operand ({lhs.shape} x {rhs.shape}) runs on XLA's ragged dot"
    out_dtype = np.dtype(params["out_dtype"])
    dtypes = dict(a_dtype=lhs.dtype, b_dtype=rhs.dtype, out_dtype=out_dtype)
    if name == "ragged_dot":
        m, k = lhs.shape
        t = params["transpose_rhs"]
        n = rhs.shape[1] if t else rhs.shape[2]
        problem = planning.make_problem(
            m, n, k, **dtypes, a_major="k", b_major="k" if t else "n", groups=g, ragged="m"
        )
        # B (N, K, G), or (N, K, E) of E < G experts shared by batches folded in (fold_rows).
        e = rhs.shape[0]
        b_mode = ((n, k, e), (k, 1, n * k)) if t else ((n, k, e), (1, n, n * k))
        modes = {"a": ((m, k), (k, 1)), "b": b_mode, "d": ((m, n), (n, 1))}
        # The bias [g, n] as the kernel's (N, G).
        modes["bias"] = ((n, g), (1, n))
        operands, out_shape = (lhs, rhs), (m, n)
    else:
        rows = lhs.shape[0]
        first, second = (rhs, lhs) if params["transpose_out"] else (lhs, rhs)
        mm, nn = first.shape[1], second.shape[1]
        problem = planning.make_problem(
            mm, nn, rows, **dtypes, a_major="m", b_major="n", groups=g, ragged="k"
        )
        out_groups = g // segments
        modes = {
            "a": ((mm, rows), (1, mm)),
            "b": ((nn, rows), (1, nn)),
            "d": ((mm, nn, out_groups), (nn, 1, mm * nn)),
        }
        operands, out_shape = (first, second), (out_groups, mm, nn)
    modes["group_sizes"] = ((g,), (1,))
    return problem, operands, modes, out_shape


def _ties(name, modes, segments):
    """The grouped call's `ffi_checks.Tie`s: A, B and D agree on the problem (`problem_ties`;
    neither has a batch mode), and the kernel walks g = group_sizes' extent groups, reading
    each group's bias row (N, G) by plain loads and B's expert (ragged_dot: G groups over E
    experts, E dividing G) or writing D's result (ragged_outer: G / segments of them) through
    TMA."""
    ties = problem_ties(batched=False)
    g = modes["group_sizes"][0][0]
    if name == "ragged_dot":
        experts = modes["b"][0][2]
        ties += [Tie("bias", 0, "d", 1), Tie("bias", 1, "group_sizes", 0),
                 Tie("b", 2, "group_sizes", 0, g // experts)]  # fmt: skip
    else:
        ties.append(Tie("d", 2, "group_sizes", 0, segments))
    return ties


def lower(name, xla_fn, lhs, rhs, group_sizes, *bias, _after="", _segments=1, **params):
    """The CUDA lowering of `name` ("ragged_dot" or "ragged_outer"; `bias`: ragged_dot's, if
    any): the grouped kernel where the plan takes it, else `xla_fn` (XLA's ragged dot),
    recorded either way (with `_after`, what follows the product, appended to the note;
    `_segments`: a folded ragged_outer's groups summed into each result, `fold_outer`).
    ragged_dot's `differentiated` (set by its JVP and transpose) only steers `_folded`'s
    choice."""
    differentiated = params.pop("differentiated", name == "ragged_outer")
    if params.get("precision") is not None:
        # lax.ragged_dot's path (`ragged._on_lax`), its gradients' products included.
        why = f"{name}: XLA's ragged dot at precision={params['precision']} (lax.ragged_dot's)"
        dispatch.record(dispatch.Lowered(None, _noted(why, _after)))
        return xla_fn(lhs, rhs, group_sizes, *bias, **params)
    target = dispatch.lowering_target()
    if target is None:
        dispatch.record(
            dispatch.Lowered(None, _noted(f"{name}: no sm_90a/sm_100a device: XLA", _after))
        )
        return xla_fn(lhs, rhs, group_sizes, *bias, **params)
    if dispatch.symbolic_dims(lhs, rhs, group_sizes):
        why = f"{name}: symbolic dims ({lhs.shape} x {rhs.shape}) run on XLA's ragged dot"
        dispatch.record(dispatch.Lowered(None, _noted(why, _after)))
        return xla_fn(lhs, rhs, group_sizes, *bias, **params)
    if lhs.ndim > 2 and group_sizes.shape[-1] > 0 and math.prod(lhs.shape[:-2]) > 0:
        return _folded(name, xla_fn, lhs, rhs, group_sizes, bias, params, _after,
                       differentiated)  # fmt: skip
    # What XLA's ragged dot takes where no kernel runs: the operands as given, noted as such.
    as_given = (rhs, params, _after)
    if _k_major_experts_only(name, target, lhs, rhs, params):
        # sm_90a's fp8 wgmma reads B K-major: the experts [g, k, n] as [g, n, k], transposed by
        # XLA (in a training step, in one fusion with the quantization that made them).
        rhs, params = jnp.swapaxes(rhs, -1, -2), dict(params, transpose_rhs=True)
        _after = _noted("fp8 experts transposed to [g, n, k] by XLA (sm_90a reads B K-major)",
                        _after)  # fmt: skip
    activation = params.get("activation")
    fused = fused_activation()  # checked on every lowering: a bad value is refused, not ignored
    if activation is not None and not fused:
        # The kernel's float32 product (with the bias), then XLA's activation and rounding.
        return _composed(name, xla_fn, lhs, rhs, group_sizes, bias, params, _after)
    made = _kernel_problem(name, lhs, rhs, group_sizes, params, _segments)
    if isinstance(made, str):
        rhs, params, _after = as_given
        dispatch.record(dispatch.Lowered(None, _noted(made, _after)))
        return xla_fn(lhs, rhs, group_sizes, *bias, **params)
    problem, operands, modes, out_shape = made
    decision = dispatch.plan_call(problem, target)
    plan = decision.plan
    if plan.kernel == planning.KERNEL_XLA:
        rhs, params, _after = as_given
        dispatch.record(dispatch.Lowered(plan, _noted(f"{name}: {plan.reason}", _after)))
        return xla_fn(lhs, rhs, group_sizes, *bias, **params)
    from jax_sm100._src import gpu_lowering  # noqa: PLC0415
    from jax_sm100._src.compile import compile_plan  # noqa: PLC0415
    from jax_sm100._src.kernels import family  # noqa: PLC0415

    shared = name == "ragged_dot" and rhs.shape[0] != group_sizes.shape[0]
    spec = KernelSpec(
        a_dtype=plan.a_dtype, b_dtype=plan.b_dtype, out_dtype=plan.out_dtype,
        a_major=plan.a_major, b_major=plan.b_major, activation=activation,
        bias_dtype=np.dtype(bias[0].dtype).name if bias else None,
        b_groups=int(rhs.shape[0]) if shared else 0, k_segments=_segments,
    )  # fmt: skip
    why = family.family(plan.kernel).why_not(plan, spec) if bias else None
    if why is not None:
        # The family's epilogue cannot add it: the kernel's float32 product, then XLA's bias
        # rows, activation and one rounding.
        return _composed(name, xla_fn, lhs, rhs, group_sizes, bias, params, _after, why)
    compiled = compile_plan(plan, spec)
    dtypes = {"a": spec.a_dtype, "b": spec.b_dtype, "d": spec.out_dtype, "group_sizes": "int32",
              "bias": spec.bias_dtype}  # fmt: skip
    index = {"a": 0, "b": 1, "group_sizes": 2, "bias": 3, "d": -1}
    # The dynamic schedule's tile counter, zeroed at every launch.
    counter = {"counter": ((1,), "int32")} if plan.dynamic_tiles else None
    out_type = jax.ShapeDtypeStruct(out_shape, params["out_dtype"])
    operands = [*operands, group_sizes.astype(np.int32), *bias]
    out = gpu_lowering.launch(compiled, operands, index, [out_type], modes, dtypes, counter,
                              _ties(name, modes, _segments))[0]  # fmt: skip
    fused = [f for f, on in (("bias", bias), (activation, activation)) if on]
    notes = decision.notes
    if fused:
        notes = (*notes, " and ".join(fused) + " in the epilogue")
    notes = (*notes, _after) if _after else notes
    (tm, tn), (cm, cn) = plan.cta_tile_mnk[:2], plan.cluster_shape_mn
    how = f"{plan.kernel} {tm}x{tn} {'ping-pong' if plan.pingpong else 'cooperative'} tiles "
    how += f"in {cm}x{cn} clusters" + (", dynamic tiles" if plan.dynamic_tiles else "")
    dispatch.record(dispatch.Lowered(plan, f"{name}: " + "; ".join((how, *notes))))
    return out


def _k_major_experts_only(name, target, lhs, rhs, params) -> bool:
    """Whether ragged_dot's N-major experts ([g, k, n]) go to the kernel transposed: equal
    8-bit operands on an arch whose grouped kernel reads them K-major only
    (`planning.grouped_b_k_major_only`)."""
    return (name == "ragged_dot" and not params["transpose_rhs"] and lhs.dtype == rhs.dtype
            and planning.grouped_b_k_major_only(target.arch, np.dtype(lhs.dtype).name))  # fmt: skip


def _saturated_sizes(group_sizes, m: int):
    """[B, g] sizes as the kernels read them (`ragged_sharding.saturated_sizes`). Returns
    (sizes, rows in groups [B])."""
    sizes = ragged_sharding.saturated_sizes(group_sizes, m)
    return sizes, jnp.sum(sizes, axis=-1, dtype=sizes.dtype)


def fold_rows(lhs, rhs, group_sizes, bias):
    """ragged_dot's batched operands (lhs [*B, m, k], rhs [*B, g, ...], sizes [*B, g], bias
    [*B, g, n] or none; g >= 1) as one grouped product: the B x m rows in order, B x g groups
    (batch b's group j is group b g + j, its matrix rhs[b, j]). The rows past a batch's groups
    join its last group (so no group spans two batches) and are zeroed after. Experts shared
    by every batch (rhs [g, ...], bias [g, n]: `vmap` of lhs and sizes only) stay as they are,
    g matrices that group b g + j reads as rhs[j] (`KernelSpec.b_groups`); their bias rows
    (small) are repeated per batch. Returns (lhs, rhs, sizes, bias, unfold): unfold maps the
    product [B m, n] to [*B, m, n]."""
    *batch, m, k = lhs.shape
    nb = len(batch)
    b = int(np.prod(batch))
    g = group_sizes.shape[-1]
    sizes, filled = _saturated_sizes(group_sizes.reshape(b, g), m)
    sizes = sizes.at[:, -1].add(m - filled)
    rows = jnp.arange(m)[None, :] < filled[:, None]  # [B, m]: in a group

    def unfold(out):
        out = out.reshape(b, m, out.shape[-1])
        return jnp.where(rows[..., None], out, 0).reshape(*batch, m, out.shape[-1])

    if rhs.ndim == 3:  # shared experts
        folded_bias = tuple(jnp.tile(x, (b, 1)) for x in bias)
    else:
        rhs = rhs.reshape(b * g, *rhs.shape[nb + 1 :])
        folded_bias = tuple(x.reshape(b * g, *x.shape[nb + 1 :]) for x in bias)
    return lhs.reshape(b * m, k), rhs, sizes.reshape(b * g), folded_bias, unfold


def fold_outer(lhs, rhs, group_sizes, summed=0):
    """ragged_outer's batched operands (lhs [*B, m, k], rhs [*B, m, n], sizes [*B, g]) as one
    grouped product: the B x m rows in order, B x (g + 1) groups, batch b's groups then one
    more for its rows past them (computed and dropped). The `summed` innermost batch dims
    (S batches in all) go first, so that the groups are S runs of the same (K (g + 1))
    results, which the kernel sums (`KernelSpec.k_segments`; the other batch dims, K in all,
    are moved after them: a copy). Returns (lhs, rhs, sizes, unfold, S): unfold maps the
    product [K (g + 1), ...] to [*B minus its summed dims, g, ...]."""
    *batch, m, k = lhs.shape
    nb, g = len(batch), group_sizes.shape[-1]
    if summed and summed < nb:
        order = (*range(nb - summed, nb), *range(nb - summed))
        lhs, rhs = (jnp.transpose(x, (*order, nb, nb + 1)) for x in (lhs, rhs))
        group_sizes = jnp.transpose(group_sizes, (*order, nb))
    kept = tuple(batch[: nb - summed])
    segments = int(np.prod(batch[nb - summed :]))
    b = int(np.prod(batch))
    sizes, filled = _saturated_sizes(group_sizes.reshape(b, g), m)
    sizes = jnp.concatenate([sizes, (m - filled)[:, None]], axis=1)

    def unfold(out):
        out = out.reshape(-1, g + 1, *out.shape[1:])[:, :g]
        return out.reshape(*kept, g, *out.shape[2:])

    return (lhs.reshape(b * m, k), rhs.reshape(b * m, rhs.shape[-1]), sizes.reshape(b * (g + 1)),
            unfold, segments)  # fmt: skip


def _folded(name, xla_fn, lhs, rhs, group_sizes, bias, params, after, differentiated):
    """`lower` of batched operands (vmap) as one unbatched grouped product (`fold_rows`,
    `fold_outer`), noted as such; or, for batches sharing their experts, merged
    (`merges_batches`)."""
    b = int(np.prod(lhs.shape[:-2]))
    shared = rhs.ndim == 3 if name == "ragged_dot" else params.get("summed", 0) == lhs.ndim - 2
    if shared and merges_batches(lhs.shape[-2], group_sizes.shape[-1], differentiated):
        return _merged(name, xla_fn, lhs, rhs, group_sizes, bias, params, after)
    note = f"vmap: {b} batches folded into one grouped product"
    if name == "ragged_dot":
        if rhs.ndim == 3:
            note += f" (its {rhs.shape[0]} experts shared, read by each batch's groups)"
            xla_fn = functools.partial(_on_copied_experts, xla_fn, b)
        lhs, rhs, sizes, bias, unfold = fold_rows(lhs, rhs, group_sizes, bias)
        segments = 1
    else:
        lhs, rhs, sizes, unfold, segments = fold_outer(lhs, rhs, group_sizes,
                                                       params.get("summed", 0))  # fmt: skip
        params = dict(params, summed=0)
        if segments > 1:
            note += f", {segments} of them summed in the kernel's accumulators"
            xla_fn = functools.partial(_summed_segments, xla_fn, segments)
    note = _noted(note, after)
    return unfold(lower(name, xla_fn, lhs, rhs, sizes, *bias, _after=note, _segments=segments,
                        **params))  # fmt: skip


# Batches sharing their experts merge their rows expert by expert (`merge_rows`) when their
# groups average fewer rows than this; else they fold (`fold_rows`, `fold_outer`). A small
# group fills little of a work tile (the product) or of its k-blocks (the weight gradient:
# each batch's segment ends in a partial one); a merge costs row gathers. "forward": a product
# that is not differentiated. "differentiated": a training step's three products (ragged_dot's
# JVP marks them), which decide alike so that the backward reuses the forward's gathers (the
# lhs rows) and the weight gradient d lhs's (the cotangent rows): XLA merges the equal gathers.
# Deciding apart cost more than either way (at 128 rows a group: forward folded, gradient
# merged 985 us a step against 808 merged and 957 folded). H200, bfloat16 (RESULTS.md,
# thirty-fourth session's table), merged / folded, forward and step (value_and_grad): 16 rows a
# group (16 x [2048 x 2048] rows, 128 experts) 494 / 1595 and 968 / 4180 us; 128 (4 x [8192 x
# 2048], 64) 381 / 333 and 812 / 980; 192 (8 x [6144 x 2048], 32) 564 / 527 and 1350 / 1486;
# 256 (8 x [4096 x 2048], 16) 497 / 386 and 1123 / 1115; 512 (8 experts) 777 / 679 and
# 2003 / 2004. Under a gradient inside the vmap (per-batch weight gradients, never merged) and
# without a weight gradient the products decide as a forward (ragged.py's batching and JVP).
MERGE_BELOW_ROWS = {"forward": 64, "differentiated": 256}


def merges_batches(m: int, g: int, differentiated: bool) -> bool:
    """Whether batches of m rows in g groups that share their experts merge (`_merged`): a
    `differentiated` product (of a training step) or a forward one (`MERGE_BELOW_ROWS`)."""
    return m < MERGE_BELOW_ROWS["differentiated" if differentiated else "forward"] * g


def merge_rows(group_sizes, m: int):
    """The rows of batches [B, m] sharing g experts (sizes [B, g]) reordered expert by expert:
    expert j's rows of batch 0, then of batch 1, ..., then every row past its batch's groups.
    Returns (src, dest, sizes): merged row i is batch row src[i] (of the B m flattened), batch
    row r lands at dest[r], and expert j has sizes[j] rows (the batches' sizes as the kernels
    read them, `_saturated_sizes`, summed)."""
    from jax_sm100._src import ragged  # noqa: PLC0415

    b, g = group_sizes.shape
    sizes, _ = _saturated_sizes(group_sizes, m)
    merged = sizes.sum(0)
    expert_start = jnp.cumsum(merged) - merged  # [g]
    batch_before = jnp.cumsum(sizes, 0) - sizes  # [B, g]: the expert's rows in earlier batches
    row_start = jnp.cumsum(sizes, 1) - sizes  # [B, g]: the group's first row in its batch
    ids = jax.vmap(lambda s: ragged._row_groups(s, m))(group_sizes)  # [B, m], g past the groups
    j = jnp.minimum(ids, g - 1)
    take = lambda t: jnp.take_along_axis(t, j, axis=1)  # noqa: E731
    inside = ids < g
    dest = take(expert_start[None, :] + batch_before - row_start) + jnp.arange(m)[None, :]
    past = jnp.cumsum(~inside.reshape(-1)) - 1 + merged.sum()
    dest = jnp.where(inside.reshape(-1), dest.reshape(-1), past).astype(jnp.int32)
    src = (
        jnp.zeros((b * m,), jnp.int32)
        .at[dest]
        .set(jnp.arange(b * m, dtype=jnp.int32), unique_indices=True)
    )
    return src, dest, merged


def _merged(name, xla_fn, lhs, rhs, group_sizes, bias, params, after):
    """`lower` of batches that share their experts with their rows merged expert by expert
    (`merge_rows`): one unbatched grouped product over every batch's rows (ragged_dot: the
    result's rows put back in place after; ragged_outer summed over every batch: the weight
    gradient itself). Two row gathers, against groups that fill the tiles."""
    *batch, m, k = lhs.shape
    b, g = int(np.prod(batch)), group_sizes.shape[-1]
    src, dest, sizes = merge_rows(group_sizes.reshape(b, g), m)
    rows = lambda x: jnp.take(x.reshape(b * m, x.shape[-1]), src, axis=0)  # noqa: E731
    note = _noted(f"vmap: {b} batches' rows merged by expert into one grouped product", after)
    if name == "ragged_dot":
        out = lower(name, xla_fn, rows(lhs), rhs, sizes, *bias, _after=note, **params)
        return jnp.take(out, dest, axis=0).reshape(*batch, m, out.shape[-1])
    return lower(name, xla_fn, rows(lhs), rows(rhs), sizes, _after=note,
                 **dict(params, summed=0))  # fmt: skip


def _on_copied_experts(xla_fn, b, lhs, rhs, sizes, *bias, **params):
    """`xla_fn` (XLA's ragged dot, where no kernel takes a folded product) on shared experts
    copied once per batch, as its folded groups read them."""
    return xla_fn(lhs, jnp.tile(rhs, (b, 1, 1)), sizes, *bias, **params)


def _summed_segments(xla_fn, segments, lhs, rhs, sizes, **params):
    """`xla_fn` (XLA's ragged dot, where no kernel takes a folded ragged_outer) on runs of
    groups summed `segments` at a time, as the kernel's `KernelSpec.k_segments` sums them: in
    the accumulator dtype, rounded once."""
    out_dtype = params["out_dtype"]
    out = xla_fn(lhs, rhs, sizes, **dict(params, out_dtype=P.acc_dtype(lhs.dtype, out_dtype)))
    return out.reshape(segments, -1, *out.shape[1:]).sum(0).astype(out_dtype)


def _composed(name, xla_fn, lhs, rhs, group_sizes, bias, params, after, why=None):
    """`lower` of the product in the accumulator dtype without the activation, then XLA's
    activation and one rounding. The bias goes into the product, or with `why` (the reason the
    family's epilogue cannot add it) XLA adds its rows after the product. Noted either way."""
    from jax_sm100._src import ragged  # noqa: PLC0415

    activation = params.get("activation")
    acc = P.acc_dtype(lhs.dtype, rhs.dtype, params["out_dtype"])
    in_xla = ["bias"] * (why is not None) + [activation] * (activation is not None)
    note = f"{' and '.join(in_xla)} by XLA after the {np.dtype(acc).name} product"
    note += f" ({why})" if why is not None else ""
    in_product = () if why is not None else bias
    z = lower(name, xla_fn, lhs, rhs, group_sizes, *in_product, _after=_noted(note, after),
              **dict(params, out_dtype=acc, activation=None))  # fmt: skip
    if why is not None:
        z = z + ragged.group_rows(bias[0].astype(acc), group_sizes, lhs.shape[0])
    return P.apply_activation(z, activation).astype(params["out_dtype"])


def _noted(note: str, after: str) -> str:
    return f"{note}; {after}" if after else note
