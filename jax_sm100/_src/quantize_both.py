"""`jax_sm100.quantize_both`: an operand quantized along both of its dims in one pass.

    quantize_both_p   x [L, R, C]  ->  q [L, R, C], s [L, R, C / 128],
                                       qt [L, C, R], st [L, C, R / 128]
                      (recipe="fp8_block128x128": s [L, R / 128, C / 128],
                                                  st [L, C / 128, R / 128])

(q, s) is `scaled.quantize(x, "fp8_block128")` (blocks of 128 along C) and (qt, st) is
`scaled.quantize_transposed(x, "fp8_block128")` (blocks of 128 along R, the data written
transposed): on CPU and wherever XLA's ops run, those two functions themselves; on the kernel,
their scales bit for bit (XLA's on the GPU) and their data as the correctly rounded quotient
x / scale gives it, which XLA's GPU division (div.full, not correctly rounded) misses by one
fp8 unit in a few elements a million. With recipe "fp8_block128x128" (weights) the scales are
one per 128 x 128 tile, s [L, R / 128, C / 128] and st its transpose, the same scale for both
orientations. A training step needs both of each activation, weight and cotangent: the forward
product contracts an activation along its k and the weight's gradient along its rows, the
weight is read along its k forward and along its n for the input's gradient, and the two
gradients contract the cotangent along its n and its rows (`scaled_dot_general`). As XLA
fusions that is two passes over the operand; on an sm_90a or sm_100a device (or target) the
`quantize_both` kernel (kernels/quantize.py) reads it once.

CPU, and CUDA where the kernel does not take the call (`constraints.quantize_both_support`:
R and C whole 128-blocks, bfloat16, float16 or float32 input; or no sm_90a/sm_100a target, or
`jax.export`'s symbolic dims), lower to those two functions; each CUDA lowering records its
path (`jax_sm100.lowerings()`). In a program sharded over several devices the primitive is
partitioned (`custom_partitioning` with a Shardy rule, below): each device quantizes its block
of x, on the kernel or XLA's ops as above. Under Explicit mesh axes the results are typed as
that partitioning writes them (x's split where it holds whole 128-blocks); where merging x's
leading dims would move data between devices, `quantize_both` calls the two functions
directly (their sharding rules). Inside a `shard_map` every axis of which is
manual the kernel runs on the local blocks; one that leaves some axes automatic runs it
unpartitioned over those (as the products do). Quantization has no useful derivative:
differentiating the primitive raises NotImplementedError (`scaled_dot_general` quantizes
inside its own gradient).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch as jax_dispatch
from jax.experimental.custom_partitioning import ArrayMapping, CompoundFactor, SdyShardingRule
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from jax_sm100._src import constraints, dispatch, ffi_checks, scaled, sharding
from jax_sm100._src import primitive as P

quantize_both_p = P.Primitive("jax_sm100_quantize_both")
quantize_both_p.multiple_results = True

_RECIPE = "fp8_block128"
_BLOCK = scaled.RECIPES[_RECIPE].block


def quantize_both(x, recipe: str = _RECIPE, *, data_dtype=None):
    """x [..., rows, cols] quantized per block of 128 along its cols and along its rows, in
    one pass over x where the kernel runs (the module docstring).

    Args:
      x: a floating array of 2 or more dims; rows and cols multiples of 128.
      recipe: "fp8_block128" (DeepSeek-V3's activations and gradients: a scale per 1 x 128
        block of each orientation) or "fp8_block128x128" (its weights: one scale per 128 x 128
        tile, which serves both orientations), the recipes whose blocks run along either dim.
      data_dtype: float8_e4m3fn (the default) or float8_e5m2.

    Returns:
      ((data, scales), (data_t, scales_t)): data [..., rows, cols] and its scales,
      `jax_sm100.quantize(x, recipe)`; data_t [..., cols, rows] and its scales,
      `quantize(swapaxes(x, -1, -2), recipe)` (on the kernel: the scales bit for bit, the data
      the correctly rounded quotient's; module docstring). The scales are [..., rows, cols /
      128] and [..., cols, rows / 128] for fp8_block128, [..., rows / 128, cols / 128] and
      its transpose for fp8_block128x128.

    Raises:
      ValueError: another recipe, x of fewer than 2 dims, or rows or cols not multiples of
        128 (pad them with zeros: zeros add nothing to a product).
      TypeError: x not floating, or a `data_dtype` the recipe does not take.
    """
    if recipe not in constraints.QUANTIZE_RECIPES:
        raise ValueError(
            f"jax_sm100.quantize_both: {recipe=} is not one of {constraints.QUANTIZE_RECIPES}, "
            "the recipes with blocks along either dim; for the others call jax_sm100.quantize "
            "once per orientation"
        )
    r = scaled.recipe_with(recipe, data_dtype, "jax_sm100.quantize_both")
    x = P.as_array(x, "quantize_both", "x")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"jax_sm100.quantize_both: x is {x.dtype}; it quantizes real floats")
    if x.ndim < 2:
        raise ValueError(f"jax_sm100.quantize_both: x is {x.ndim}-D; it takes [..., rows, cols]")
    *lead, rows, cols = x.shape
    for length in (rows, cols):
        scaled._check_divides(length, recipe, _BLOCK, "jax_sm100.quantize_both")
    # (-1 cannot be inferred for an empty x.) Under Explicit axes the merge of the leading dims
    # is typed where it moves no data; where it would, XLA's two quantizations run instead.
    x3 = P.reshape_in_place(x, (math.prod(lead), rows, cols))
    if x3 is None:
        return _reference(x, data_dtype=r.data_dtype, recipe=recipe)
    outs = quantize_both_p.bind(x3, data_dtype=r.data_dtype, recipe=recipe)
    q, s, qt, st = (_split_lead(o, lead, x) for o in outs)
    return (q, s), (qt, st)


def _split_lead(out, lead, x):
    """A result `out` [L, a, b] as [*lead, a, b]: the inverse of merging x's leading dims,
    typed under Explicit axes with x's leading dims' axes (as the merge, it moves no data;
    JAX's own rule cannot always type it, e.g. beside a mesh axis of size 1)."""
    shape = (*lead, *out.shape[1:])
    typed = P.explicit_type(out)
    if typed is None:
        return out.reshape(shape)
    x_axes, out_axes = P.explicit_axes(x), P.explicit_axes(out)
    spec = PS(*map(P.spec_entry, (*x_axes[: len(lead)], *out_axes[1:])))
    return jax.lax.reshape(out, shape, out_sharding=typed.update(spec=spec))


def keeps_type(x3) -> bool:
    """Whether `quantize_both_p`'s results keep every split of `x3`'s type (True without
    Explicit axes): under Explicit axes, a split that cuts a 128-block is typed whole."""
    typed = P.explicit_type(x3)
    if typed is None:
        return True
    kept = _local_axes(x3.shape, typed.mesh, typed)
    have = P.explicit_axes(x3)
    return all(tuple(k) == tuple(h) for k, h in zip(kept, have, strict=True))


def _reference(x, *, data_dtype, recipe=_RECIPE):
    """XLA's two quantizations."""
    q, s = scaled.quantize(x, recipe, data_dtype=data_dtype)
    qt, st = scaled.quantize_transposed(x, recipe, data_dtype=data_dtype)
    return (q, s), (qt, st)


def _flat_reference(x3, *, data_dtype, recipe):
    (q, s), (qt, st) = _reference(x3, data_dtype=data_dtype, recipe=recipe)
    return [q, s, qt, st]


def _scale_shapes(L, R, C, recipe):
    """The shapes of s and st for x [L, R, C]."""
    Rb, Cb = R // _BLOCK, C // _BLOCK
    if recipe == constraints.QUANTIZE_TILE_RECIPE:
        return (L, Rb, Cb), (L, Cb, Rb)
    return (L, R, Cb), (L, C, Rb)


def _abstract(x, *, data_dtype, recipe):
    L, R, C = x.shape
    if R % _BLOCK or C % _BLOCK:
        raise ValueError(f"quantize_both_p takes [L, R, C] of whole {_BLOCK}-blocks, not {x.shape}")
    data = np.dtype(data_dtype)
    s_shape, st_shape = _scale_shapes(L, R, C, recipe)
    shapes = [((L, R, C), data), (s_shape, np.float32),
              ((L, C, R), data), (st_shape, np.float32)]  # fmt: skip
    # Under Explicit axes each result is typed as the partitioned kernels write it: split as x
    # is where x's split holds whole 128-blocks (`_local_axes`), else whole there.
    typed = P.explicit_type(x)
    if typed is None:
        return [jax.core.ShapedArray(shape, dtype) for shape, dtype in shapes]
    results = _result_shardings(typed.mesh, _local_axes(x.shape, typed.mesh, typed))
    return [
        jax.core.ShapedArray(shape, dtype, sharding=sh)
        for (shape, dtype), sh in zip(shapes, results, strict=True)
    ]


def _xla(why: str, plan, x3, data_dtype, recipe):
    dispatch.record(dispatch.Lowered(plan, f"quantize_both: XLA ops ({why})"))
    return _flat_reference(x3, data_dtype=data_dtype, recipe=recipe)


def _ties(tiles: bool) -> list:
    """The kernel writes q, s, qt and st over x's grid of 128 x 128 tiles with plain stores
    (kernels/quantize.py), so the handler checks each of their extents against x's (modes
    (rows, cols, L)): q (R, C, L), qt (C, R, L), s (R, C / 128, L) or per tile (R / 128,
    C / 128, L), st (C, R / 128, L) or (C / 128, R / 128, L)."""
    b, r, c = _BLOCK, 0, 1
    of_x = {  # name -> (x's mode, divisor) of its modes 0 and 1; mode 2 is L
        "q": ((r, 1), (c, 1)),
        "qt": ((c, 1), (r, 1)),
        "s": ((r, b if tiles else 1), (c, b)),
        "st": ((c, b if tiles else 1), (r, b)),
    }
    return [
        ffi_checks.Tie(name, mode, "x", x_mode, divisor)
        for name, modes in of_x.items()
        for mode, (x_mode, divisor) in enumerate((*modes, (2, 1)))
    ]


def _cuda(x3, *, data_dtype, recipe):
    """The kernel where the plan takes the call, else XLA's quantizations (recorded)."""
    from jax_sm100._src import compile as compile_mod  # noqa: PLC0415
    from jax_sm100._src import ffi, gpu_lowering  # noqa: PLC0415
    from jax_sm100._src.planning.quantize import plan_quantize_both  # noqa: PLC0415

    target = dispatch.lowering_target()
    if target is None:
        return _xla("no sm_90a/sm_100a device", None, x3, data_dtype, recipe)
    if dispatch.symbolic_dims(x3):
        return _xla(f"symbolic dims {x3.shape}", None, x3, data_dtype, recipe)
    L, R, C = x3.shape
    in_dtype = np.dtype(x3.dtype).name
    plan = plan_quantize_both(R, C, L, in_dtype, np.dtype(data_dtype).name, target.arch, recipe)
    if plan.kernel != constraints.KERNEL_QUANTIZE_BOTH:
        return _xla(plan.reason.removeprefix("XLA ops: "), plan, x3, data_dtype, recipe)
    dispatch.record(dispatch.Lowered(plan, "quantize_both: kernel (one pass, both ways)"))
    ffi.register()
    compiled = compile_mod.compile_plan(plan)
    Cb, Rb = C // _BLOCK, R // _BLOCK
    tiles = recipe == constraints.QUANTIZE_TILE_RECIPE
    # The kernel's modes (rows, cols, L) of each row-major buffer (kernels/quantize.py). Per 1
    # x 128 block the scales are written with the rows contiguous ([L, C / 128, R] and [L, R /
    # 128, C]); per tile as they are returned ([L, R / 128, C / 128] and its transpose).
    s_modes = ((Rb, Cb, L), (Cb, 1, Rb * Cb)) if tiles else ((R, Cb, L), (1, R, R * Cb))
    st_modes = ((Cb, Rb, L), (Rb, 1, Rb * Cb)) if tiles else ((C, Rb, L), (1, C, C * Rb))
    modes = {
        "x": ((R, C, L), (C, 1, R * C)),
        "q": ((R, C, L), (C, 1, R * C)),
        "s": s_modes,
        "qt": ((C, R, L), (R, 1, R * C)),
        "st": st_modes,
    }
    data = np.dtype(data_dtype)
    out_types = [
        jax.ShapeDtypeStruct((L, R, C), data),
        jax.ShapeDtypeStruct((L, Rb, Cb) if tiles else (L, Cb, R), np.float32),
        jax.ShapeDtypeStruct((L, C, R), data),
        jax.ShapeDtypeStruct((L, Cb, Rb) if tiles else (L, Rb, C), np.float32),
    ]
    dtypes = {"x": in_dtype, "q": data.name, "s": "float32", "qt": data.name, "st": "float32"}
    index = {"x": 0, "q": -1, "s": -2, "qt": -3, "st": -4}
    q, s, qt, st = gpu_lowering.launch(compiled, [x3], index, out_types, modes, dtypes,
                                       ties=_ties(tiles))  # fmt: skip
    if tiles:
        return [q, s, qt, st]
    return [q, jnp.swapaxes(s, 1, 2), qt, jnp.swapaxes(st, 1, 2)]


# --- partitioning ------------------------------------------------------------------------------
#
# In a program sharded over devices the primitive is wrapped in `custom_partitioning`, as the
# products are (sharding.py): XLA would run the kernel's custom call whole on every device.
# Each device quantizes its block of x where that block holds whole 128-blocks both ways, so
# its scales are a block of the scales and nothing moves between devices. Factors: L, and R
# and C each as (blocks, 128) with the scales' dim the blocks alone; a mesh axis (of x's
# sharding) that does not divide a dim's blocks evenly is dropped, x gathered along it
# (replicated rather than wrong); R or C of one block stays whole.


def _factors(shape):
    """(data dims, scale dims, minor factors, whole factors) of R and C."""
    _, R, C = shape
    data, scales, minor, whole = {}, {}, {}, []
    for f, extent in (("r", R), ("c", C)):
        if extent // _BLOCK > 1:
            data[f], scales[f] = (f, f"{f}_in"), (f,)
            minor[f"{f}_in"] = _BLOCK
            whole.append(f"{f}_in")
        else:  # one block: never split (a compound factor of size 1 is not a rule Shardy takes)
            data[f], scales[f] = (f,), (f"{f}_s",)
            whole += [f, f"{f}_s"]
    return data, scales, minor, whole


def _sharding_rule(shape, recipe) -> SdyShardingRule:
    data, scales, minor, whole = _factors(shape)
    # A scale's first dim: per 1 x 128 block, the rows of its orientation (s's R, st's C);
    # per tile, their blocks.
    lead = scales if recipe == constraints.QUANTIZE_TILE_RECIPE else data
    mappings = (
        (("l",), data["r"], data["c"]),  # x
        (("l",), data["r"], data["c"]),  # q
        (("l",), lead["r"], scales["c"]),  # s
        (("l",), data["c"], data["r"]),  # qt
        (("l",), lead["c"], scales["r"]),  # st
    )

    def mapping(dims):
        return ArrayMapping(*(CompoundFactor(*d) if len(d) > 1 else d[0] for d in dims))

    # Shardy wants the special factors in the order the rule first names them.
    named = list(dict.fromkeys(f for dims in mappings for d in dims for f in d))
    return SdyShardingRule(
        operand_mappings=(mapping(mappings[0]),),
        result_mappings=tuple(mapping(m) for m in mappings[1:]),
        need_replication_factors=tuple(sorted(whole, key=named.index)),
        **minor,
    )


def _local_axes(shape, mesh, x_sharding):
    """The mesh axes each of x's dims (L, R, C) is split over for the per-device kernels."""
    L, R, C = shape
    sizes = dict(mesh.shape)
    axes = sharding._spec_axes(x_sharding, 3)
    return (
        sharding._even_prefix(axes[0], L, sizes),
        sharding._even_prefix(axes[1], R // _BLOCK, sizes) if R > _BLOCK else (),
        sharding._even_prefix(axes[2], C // _BLOCK, sizes) if C > _BLOCK else (),
    )


def _result_shardings(mesh, local):
    lx, rx, cx = (P.spec_entry(a) for a in local)
    specs = (PS(lx, rx, cx), PS(lx, rx, cx), PS(lx, cx, rx), PS(lx, cx, rx))
    return tuple(NamedSharding(mesh, s) for s in specs)


def _infer(shape, mesh, arg_shapes):
    return _result_shardings(mesh, _local_axes(shape, mesh, arg_shapes[0].sharding))


def _partition(shape, params, mesh, arg_shapes, result_shapes):
    del result_shapes  # each result's blocks are x's: its sharding follows x's
    local = _local_axes(shape, mesh, arg_shapes[0].sharding)
    x_sharding = NamedSharding(mesh, PS(*(P.spec_entry(a) for a in local)))

    def lower_fn(x3):
        return tuple(quantize_both_p.bind(x3, **params))

    return mesh, lower_fn, _result_shardings(mesh, local), (x_sharding,)


def _lowering(local_rule):
    """The lowering of `quantize_both_p` whose one-device computation is `local_rule(ctx, x3,
    **params)`: partitioned where the program is sharded over devices."""

    def rule(ctx, x3, **params):
        if not sharding._is_sharded(ctx.module_context.axis_context):
            return local_rule(ctx, x3, **params)
        shape = ctx.avals_in[0].shape
        wrapped = sharding.partitioned(
            lambda x: tuple(quantize_both_p.bind(x, **params)),
            partition=lambda mesh, args, result: _partition(shape, params, mesh, args, result),
            infer=lambda mesh, args: _infer(shape, mesh, args),
            rule=_sharding_rule(shape, params["recipe"]),
        )
        return sharding.lower_partitioned(wrapped, ctx, x3, multiple_results=True)

    return rule


def _local(fn):
    """The unpartitioned lowering of `fn(x3, **params)`. Typed over Explicit axes there
    (a one-device mesh, or automatic axes inside a `shard_map`: the call runs whole over them),
    `fn` is traced untyped."""

    def rule(ctx, x3, **params):
        local = functools.partial(fn, **params)
        if sharding.typed_over_explicit_axes(ctx) or sharding.explicit_context():
            ctx, local = sharding.untyped_context(ctx), sharding.untyped(local)
        return mlir.lower_fun(local, multiple_results=True)(ctx, x3)

    return rule


def _jvp(primals, tangents, **params):
    del primals, tangents, params
    raise NotImplementedError(
        "jax_sm100.quantize_both is not differentiable (its data is piecewise constant and its "
        "scales follow block maxima); jax_sm100.scaled_dot_general, which quantizes with it, "
        "has a gradient of its own: differentiate it once, or use configs=None (unquantized) "
        "for higher-order derivatives"
    )


def _batch(args, dims, **params):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)
    size, L = x.shape[:2]
    x3 = P.reshape_in_place(x, (size * L, *x.shape[2:]))
    if x3 is None:  # under Explicit axes, a merge that would move data: XLA's quantizations
        return _flat_reference(x, **params), [0] * 4
    outs = quantize_both_p.bind(x3, **params)
    return [_split_lead(o, (size, L), x) for o in outs], [0] * 4


quantize_both_p.def_abstract_eval(_abstract)
quantize_both_p.def_impl(functools.partial(jax_dispatch.apply_primitive, quantize_both_p))
# custom_partitioning needs the device assignment while lowering (as for the products).
jax_dispatch.prim_requires_devices_during_lowering.add(quantize_both_p)
mlir.register_lowering(quantize_both_p, _lowering(_local(_flat_reference)), platform="cpu")
mlir.register_lowering(quantize_both_p, _lowering(_local(_cuda)), platform="cuda")
batching.primitive_batchers[quantize_both_p] = _batch
ad.primitive_jvps[quantize_both_p] = _jvp
