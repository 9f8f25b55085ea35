"""Partitioning of the matmul primitive across devices.

When a jitted program is sharded over more than one device, the lowering of `matmul_p` wraps
its local computation (XLA's dot on CPU, our kernel on CUDA) in `custom_partitioning`, so XLA
sees an opaque custom call on every platform and never partitions the product by itself: the
CPU tests exercise exactly the decisions the GPU runs with.

Background / Algorithm. The product has one factor per dim: `b0..` (batch), `m`, `n`, and the
contracting `k`, which is a reduction factor. Shardy propagates operand and result shardings
through the rule built by `_Roles`; the partition callback then turns the shardings it is
given into per-device work:

  * batch, m and n shardings are kept: every device runs one local GEMM (with the whole fused
    epilogue) on its block, with no communication.
  * k sharded (row-parallel): every device computes `A_local @ B_local` in the
    accumulator dtype with no epilogue; the partials are reduced by one `psum_scatter` over the
    mesh axes that the requested output sharding puts on an output dim (a reduce-scatter), and
    one `psum` over the rest; then the epilogue (`primitive.epilogue_xla`: alpha,
    `beta * c + bias` and the activation, the saved pre-activation, or a backward epilogue's
    act'(c)) runs once, on the reduced block.
  * k sharded beside another operand's split of a result dim over the same axes (FSDP: the
    activations' rows and the weight's k over one axis): the k-split operand is gathered
    instead, and every device computes its block of the result, where that moves fewer bytes
    than the reduction (`_gathers_less`).
  * a mesh axis is used by one factor at most; a sharding that does not divide its dim evenly
    is dropped (XLA would pad the block, and padding inside k would corrupt the sum).

The operand and result shardings the callback returns are those it computes with; XLA
reshards to and from them where the surrounding program wants something else.

Unsharded lowerings (one device, or every mesh axis manual as inside `shard_map`) return the
local computation unchanged: no custom call, nothing extra to serialize for `jax.export`.

Limits: a sharded program cannot be serialized with `jax.export` (custom_partitioning's
callbacks live in this process). Inside a `shard_map` that leaves some mesh axes automatic,
the product runs unpartitioned over those axes (its operands are gathered over them). When
the program names no mesh (only positional shardings), every operand is replicated and each
device computes the whole product; so is an operand's dim split over a part of a mesh axis
(Shardy makes such splits where a reshape cuts a split dim), which no axis names (`decoded`).
Under Explicit axes the custom call's results pass through open constraints
(`lower_partitioned`), so a reshard of them to an `unreduced=` type starts from a sum, as
after lax's dot; partial sums asked for with `out_sharding=` run on XLA's dot. A user's
`plan=` is resized to the per-device problem; if its tiles do not fit that problem, the
planner chooses again.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax import lax
from jax._src import dispatch, sharding_impls
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import xla_client as xc
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    SdyShardingRule,
    custom_partitioning,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from jax_sm100._src import autodiff
from jax_sm100._src import constraints as C
from jax_sm100._src import primitive as P

# custom_partitioning needs the device assignment while lowering, and jit only provides it for
# programs holding a primitive from this registry; the primitive's custom call is made in its
# lowering, so the primitive itself must be registered, and so must the backward's gated
# product, which lowers to it.
dispatch.prim_requires_devices_during_lowering.add(P.matmul_p)
dispatch.prim_requires_devices_during_lowering.add(autodiff.gated_matmul_p)

_NO_MESH = jax.sharding.AbstractMesh((), ())


def partition(fn, ctx, **params):
    """Wraps the local lowering `fn(*operands)` so sharded operands split into local GEMMs.

    Args:
      fn: the per-device computation of one bind, `fn(a, b, [bias], [c]) -> [out, (z)]`.
      ctx: the lowering rule context of the bind.
      **params: the primitive's params.

    Returns:
      `fn` itself when the lowering is not sharded; else a `custom_partitioning` function whose
      partition callback runs the per-device binds of the primitive, which lower to `fn`.
    """
    if not _is_sharded(ctx.module_context.axis_context):
        return fn
    roles = _Roles.of(ctx.avals_in, ctx.avals_out[0].shape, params)
    # The custom call's body is the primitive itself rather than `fn`: tracing `fn` would trace
    # XLA's dot on the global avals, which under an Explicit mesh carry shardings that dot
    # rejects when k is sharded. The body is only lowered where every axis is manual, and there
    # the primitive lowers to `fn`.
    return partitioned(
        lambda *operands: P.matmul_p.bind(*operands, **params),
        partition=lambda mesh, args, result: _partition(roles, params, mesh, args, result),
        infer=lambda mesh, args: _infer(roles, mesh, args),
        rule=roles.sharding_rule(),
    )


def partitioned(body, *, partition, infer, rule):
    """`custom_partitioning(body)` with these callbacks and Shardy rule, its callbacks given
    the shardings as the mesh's axes name them (`decoded`).

    JAX's own decoding (custom_partitioning's `decode_shardings`) raises inside the partitioner
    on a sharding over a part of a mesh axis, which Shardy propagates where an axis splits a
    dim of 256 rows that a rule (or a reshape before it) sees as 2 x 128: the compile then
    fails, and under GSPMD XLA aborts the process. Here such a dim is read as unsplit (that
    operand is gathered along it: slower, never wrong) and the operand's other dims keep
    their axes.

    The per-device function is traced with no mesh in context. XLA calls the partition
    callback while it compiles, inside the caller's `jax.sharding.set_mesh` when there is one,
    and custom_partitioning types the per-device operands over that context's mesh. Under
    Explicit axes, JAX 0.11 then lowers a `psum`'s reducer with Shardy constraints in its
    body, which XLA refuses ("Unsupported reduction computation"; on a GPU the process
    aborts): every k-split product under `set_mesh` failed so.
    """
    wrapped = custom_partitioning(body)

    def shapes(mesh, tree):
        return jax.tree.map(lambda s: decoded(s, mesh), tree)

    def partition_without_context(mesh, args, result):
        mesh, lower_fn, result_shardings, arg_shardings = partition(
            mesh, shapes(mesh, args), shapes(mesh, result)
        )
        return mesh, untyped(lower_fn), result_shardings, arg_shardings

    wrapped.def_partition(
        partition=partition_without_context,
        infer_sharding_from_operands=lambda mesh, args, result: infer(mesh, shapes(mesh, args)),
        decode_shardings=False,
        sharding_rule=rule,
    )
    return wrapped


def lower_partitioned(wrapped, ctx, *operands, multiple_results: bool) -> list:
    """`mlir.lower_fun(wrapped)` (a `partitioned` function) on `operands`, each result typed
    over Explicit axes passed through empty, open Shardy constraints (`_open_constraint`).

    Without it the custom call's result has no sharding of its own, and Shardy applies the
    sharding of a constraint that consumes it: a user's `jax.sharding.reshard` of the result
    to an `unreduced=` type made the call's result unreduced, which its callbacks see as
    replicated (the HLO sharding drops unreduced axes), so each device's whole sum was summed
    again over those axes (4x over "model"). Behind the open constraint a consumer's sharding
    reaches the call by propagation only, which carries dim shardings (a requested split of a
    row-parallel result: the reduce-scatter) and never unreduced axes. A closed constraint of
    the result's type (JAX's own for its ops, `lower_with_sharding_in_types`) mended the
    values too, but turned those reduce-scatters into an all-reduce and a slice; the type's
    axes as an open constraint's kept them, but moved more bytes in FSDP-style programs on
    meshes mixing Auto and Explicit axes."""
    outs = jax_mlir.lower_fun(wrapped, multiple_results=multiple_results)(ctx, *operands)
    return [
        _open_constraint(ctx, out, aval) if _typed(aval) else out
        for out, aval in zip(outs, ctx.avals_out, strict=True)
    ]


def _typed(aval) -> bool:
    sh = getattr(aval, "sharding", None)
    return (
        isinstance(sh, NamedSharding)
        and sh.mesh._any_axis_explicit
        and not sh.mesh.are_all_axes_manual
        and jax.config.jax_use_shardy_partitioner
    )


def _open_constraint(ctx, out, aval):
    """`out` through two `sdy.sharding_constraint`s on `aval`'s mesh that name no axis and
    leave every dim open: nothing for propagation to follow or to refuse.

    Two, because from JAX 0.12 one alone, right after the custom call, stopped being a
    barrier: a consumer's unreduced axes reached it again (the 4x above, for k-split
    products). The second's operand has a sharding of its own (the first's), and that holds
    on JAX 0.10 to 0.12, with the same collectives as one (review helper-66's sweep)."""
    sdy = aval.sharding._to_sdy_sharding(aval.ndim)
    sdy = sdy.replace(
        dim_shardings=tuple(d.replace(axes=(), is_open=True) for d in sdy.dim_shardings),
        replicated_axes=frozenset(),
    )
    for _ in range(2):
        out = jax_mlir.wrap_with_sharding_op(ctx, out, aval, sdy)
    return out


def decoded(shape: jax.ShapeDtypeStruct, mesh) -> jax.ShapeDtypeStruct:
    """`shape` with its GSPMD sharding (custom_partitioning's callbacks get those) as a
    NamedSharding over `mesh`: per dim, the mesh axes (major first) whose coordinates give every
    device's block along it. A dim that no axes give (split over a part of an axis) is unsplit
    in the result, so each device's block holds the one it has; with no mesh, or a sharding that
    is not a tiling of the mesh's devices, no sharding.

    The devices of the HLO sharding are positions in the mesh's device order, as JAX's
    `parse_flatten_op_sharding` reads them (custom_partitioning builds the mesh from the
    program's device assignment)."""
    sh = shape.sharding
    if sh is None or mesh.empty:
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype)
    ndim = len(shape.shape)
    hlo = sh._hlo_sharding
    try:
        if hlo.is_replicated():
            named = NamedSharding(mesh, PS())
        elif (
            not hlo.is_tiled()
            or hlo.num_devices() != mesh.size
            or any(t != xc.OpSharding.Type.REPLICATED for t in hlo.subgroup_types())
        ):  # maximal, on other devices, or with unreduced or manual subgroups
            named = None
        else:
            named = NamedSharding(mesh, PS(*_axes_per_dim(hlo, mesh, ndim)))
    except (NotImplementedError, AssertionError):  # shardings XLA's bindings do not describe
        named = None
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=named)


def _axes_per_dim(hlo, mesh, ndim) -> list:
    tiles = tuple(hlo.tile_assignment_dimensions())
    devices = np.asarray(hlo.tile_assignment_devices()).reshape(tiles)
    block = np.zeros((ndim, mesh.size), np.int64)  # each device's block index along each dim
    for t in np.ndindex(*tiles):
        block[:, devices[t]] = t[:ndim]
    sizes = dict(mesh.shape)
    positions = np.unravel_index(np.arange(mesh.size), tuple(sizes.values()))
    coords = dict(zip(mesh.axis_names, positions, strict=True))
    used, spec = set(), []
    for d in range(ndim):
        # Peel the dim's axes major first: the axis whose coordinate is every device's block
        # index divided by the blocks the rest make, then the rest.
        got, rest, index = [], tiles[d], block[d]
        while rest > 1:
            for ax in mesh.axis_names:
                n = sizes[ax]
                if ax in used or ax in got or n == 1 or rest % n:
                    continue
                if np.array_equal(index // (rest // n), coords[ax]):
                    got.append(ax)
                    rest, index = rest // n, index % (rest // n)
                    break
            else:  # a part of an axis: unsplit here
                got = []
                break
        used.update(got)
        spec.append(P.spec_entry(tuple(got)))
    return spec


def unsharded_context(ctx):
    """`ctx` with its avals' sharding types made replicated, for a lowering on one device.

    Under an Explicit mesh every aval carries its sharding in its type, even on a one-device mesh
    (axes of size 1), where nothing is partitioned. XLA's dot then refuses a contracting dim typed
    as sharded ("ambiguous how the output should be sharded"), though nothing is split; on one
    device every sharding is the replicated one, so the local lowering sees that instead.
    """

    def replicated(aval):
        sh = getattr(aval, "sharding", None)
        if sh is None or not hasattr(sh, "spec") or all(d is None for d in sh.spec):
            return aval
        return aval.update(sharding=sh.update(spec=PS()))

    return ctx.replace(
        avals_in=[replicated(a) for a in ctx.avals_in],
        avals_out=[replicated(a) for a in ctx.avals_out],
    )


def typed_over_explicit_axes(ctx) -> bool:
    return any(P.explicit_mesh(a) for a in (*ctx.avals_in, *ctx.avals_out))


def explicit_context() -> bool:
    """Whether the mesh in context (`jax.set_mesh`) has Explicit axes and no Manual ones (in
    `shard_map` the body is traced in its own, manual, context)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh._any_axis_explicit and not mesh._any_axis_manual


def untyped_context(ctx):
    """`ctx` with its avals untyped, for a lowering on one device of a mesh with Explicit axes.

    There (axes of size 1) every aval still carries the mesh, and XLA's ragged dot asks for an
    `out_sharding` it has no rule to infer, even for replicated operands (JAX 0.10); nothing is
    partitioned, so the local function (ragged_sharding.py's, scaled_sharding.py's) is traced on
    plain avals and outside the mesh (`untyped`).
    """

    def untyped(aval):
        if not P.explicit_mesh(aval):
            return aval
        return jax.core.ShapedArray(aval.shape, aval.dtype, aval.weak_type)

    return ctx.replace(
        avals_in=[untyped(a) for a in ctx.avals_in],
        avals_out=[untyped(a) for a in ctx.avals_out],
    )


def untyped(fn):
    """`fn` traced outside any mesh (for `untyped_context`'s avals)."""

    def outside_the_mesh(*operands):
        with jax.sharding.use_abstract_mesh(_NO_MESH):
            return fn(*operands)

    return outside_the_mesh


def _is_sharded(axis_context) -> bool:
    if isinstance(axis_context, sharding_impls.ShardingContext):
        return axis_context.num_devices > 1
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        # Inside shard_map the operands are already local blocks.
        if axis_context.manual_axes:
            return False
        return axis_context.mesh.size > 1
    return False


# --- factors -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Roles:
    """The factor of every dim of every operand and of the result, as in the sharding rule."""

    operands: tuple[tuple[str, ...], ...]
    result: tuple[str, ...]
    operand_shapes: tuple[tuple[int, ...], ...]
    result_shape: tuple[int, ...]
    num_results: int = 1

    @classmethod
    def of(cls, avals_in, out_shape, params) -> _Roles:
        has_bias, has_c = params["has_bias"], params["has_c"]
        out_shape = tuple(out_shape)
        nb = len(out_shape) - 2
        batch = tuple(f"b{i}" for i in range(nb))
        mats = [
            ("k", "m") if params["transpose_a"] else ("m", "k"),
            ("n", "k") if params["transpose_b"] else ("k", "n"),
        ]
        if has_bias:
            mats.append(("n",))
        if has_c:
            mats.append(("m", "n"))
        operands = []
        for j, (aval, mat) in enumerate(zip(avals_in, mats, strict=True)):
            dims = []
            for i in range(nb):
                if aval.shape[i] == out_shape[i]:
                    dims.append(batch[i])
                else:  # a broadcast unit dim: its own factor, never sharded
                    dims.append(f"u{j}_{i}")
            operands.append((*dims, *mat))
        return cls(
            operands=tuple(operands),
            result=(*batch, "m", "n"),
            operand_shapes=tuple(tuple(a.shape) for a in avals_in),
            result_shape=out_shape,
            num_results=P.num_results(params),
        )

    def nbytes(self, arg_shapes, out_dtype=None):
        """`_decide`'s `nbytes` for these operands."""
        return nbytes(arg_shapes, math.prod(self.result_shape), out_dtype)

    def sharding_rule(self) -> SdyShardingRule:
        return SdyShardingRule(
            operand_mappings=tuple(ArrayMapping(*dims) for dims in self.operands),
            result_mappings=(ArrayMapping(*self.result),) * self.num_results,
            reduction_factors=("k",),
        )

    def size(self, factor: str) -> int:
        for dims, shape in zip(
            (*self.operands, self.result), (*self.operand_shapes, self.result_shape), strict=True
        ):
            if factor in dims:
                return shape[dims.index(factor)]
        raise KeyError(factor)


def _spec_axes(sharding, ndim) -> list[tuple[str, ...]]:
    # No sharding: GSPMD's inference, or the program names no mesh (`decoded`).
    if not isinstance(sharding, NamedSharding):
        return [()] * ndim
    spec = tuple(sharding.spec)
    return [P.spec_axes(e) for e in spec] + [()] * (ndim - len(spec))


@dataclasses.dataclass(frozen=True)
class _Decision:
    """How one sharded bind runs: mesh axes per factor, and how k's partials are reduced."""

    local: dict[str, tuple[str, ...]]  # factor -> axes its dim is split over for the local GEMM
    scatter: dict[str, tuple[str, ...]]  # output factor -> k axes reduce-scattered onto it
    psum: tuple[str, ...]  # k axes reduced by an all-reduce

    def final(self, factor: str) -> tuple[str, ...]:
        """The axes of the result's `factor` dim after the reduction."""
        return self.local.get(factor, ()) + self.scatter.get(factor, ())

    def spec(self, dims, *, final: bool) -> PS:
        pick = self.final if final else (lambda f: self.local.get(f, ()))
        return PS(*(P.spec_entry(pick(f)) for f in dims))


def _decide(roles: _Roles, mesh, arg_shardings, result_sharding, nbytes) -> _Decision:
    """Chooses the axes of every factor from the given shardings (see the module docstring);
    `nbytes`: as `nbytes` returns them."""
    mesh_shape = dict(mesh.shape)
    operand_axes = [
        _spec_axes(s, len(dims)) for s, dims in zip(arg_shardings, roles.operands, strict=True)
    ]

    def from_operands(factor):
        for dims, axes in zip(roles.operands, operand_axes, strict=True):
            if factor in dims and axes[dims.index(factor)]:
                return axes[dims.index(factor)]
        return ()

    # k first: the result's sharding then says whether its partials are reduce-scattered.
    k = _even_prefix(from_operands("k"), roles.size("k"), mesh_shape)
    local = {"k": k} if k else {}
    chosen = _decide_result(roles, mesh_shape, result_sharding, from_operands, local, k)
    if k:
        gather = _decide_result(roles, mesh_shape, result_sharding, from_operands, {}, ())
        if _gathers_less(roles, mesh_shape, operand_axes, result_sharding, nbytes, chosen, gather):
            chosen = gather
    return _requested_first(roles, mesh_shape, operand_axes, result_sharding, nbytes,
                            from_operands, chosen)  # fmt: skip


def _requested_first(roles, mesh_shape, operand_axes, result_sharding, nbytes, from_operands,
                     chosen, reductions=("k",)):  # fmt: skip
    """`chosen`, or the decision that leaves to the requested result dims the axes the
    requested sharding gives them, where that moves fewer bytes with the work divided as finely.
    The reduction factors (`reductions`: matmul's k; ragged_dot's k and g; ragged_outer's m and
    the batch dims it sums) keep `chosen`'s axes.

    A result dim takes the axes the request gives it, else its operands' (`_decide_result`, in
    the result's order: batch, m, n for matmul), so an axis requested for n but held by an
    operand's m goes to m:
    sequence parallelism's backward (the cotangent's rows over "model", the weight's n over
    it, the result asked split along n) then gathered the weight and moved the result to its
    requested split by an all-to-all, where gathering the cotangent's rows, as XLA's dot does,
    moves fewer bytes. Bytes arriving per device, as `_gathers_less` counts them, plus the
    reduced result's move to the requested split, in the result's dtype and as a gather (JAX
    0.12's XLA moves a result from a split of rows to one of columns by a full gather where
    0.10's runs an all-to-all, a quarter of it on 4 devices: review helper-115)."""
    result_axes = _spec_axes(result_sharding, len(roles.result))
    requested = {a for axes in result_axes for a in axes}
    if not requested:
        return chosen
    local = {f: chosen.local[f] for f in reductions if f in chosen.local}
    reduced = tuple(a for f in reductions for a in local.get(f, ()))

    def others(factor):
        return tuple(a for a in from_operands(factor) if a not in requested)

    alternative = _decide_result(roles, mesh_shape, result_sharding, others, local, reduced)
    if alternative == chosen:
        return chosen

    def work(decision):
        return _split(mesh_shape, (a for axes in decision.local.values() for a in axes))

    if work(alternative) != work(chosen):
        return chosen
    result_bytes, out_bytes = nbytes[1:]
    factors = _factors(roles, operand_axes, nbytes)

    def moved(decision):
        local = _result_split(roles, decision, mesh_shape)
        finals = [decision.final(f) for f in roles.result]
        result_move = _arrive(finals, result_axes, out_bytes, mesh_shape, all_to_all=False)
        return (_arriving(factors, decision, mesh_shape)
                + _reducing(roles, decision, result_bytes / local, {}, mesh_shape)
                + result_move)  # fmt: skip

    # A tie goes to the request, as XLA's dot takes it.
    return alternative if moved(alternative) <= moved(chosen) else chosen


def _gathers_less(roles, mesh_shape, operand_axes, result_sharding, nbytes, keep, gather):
    """Whether gathering k's split (`gather`) moves fewer bytes than reducing partial products
    over it (`keep`), with the work still divided as finely.

    FSDP's layout splits the activations' rows and the weights' k over one axis. Keeping k
    split moves the activations to a split of k and reduce-scatters every device's partial
    product of all the rows, in the accumulator dtype; gathering the weights moves only them,
    and each device computes its rows. Only a split of the two factors' other dims counts:
    tensor parallelism's row-parallel product (both split along k) keeps k though a residual
    c or the requested result splits its rows over that axis (sequence parallelism's
    reduce-scatter), and gathering must not leave devices computing alike.

    Bytes arriving per device, for each decision: the two factors' moves from the blocks they
    hold to the decision's (`_arriving`), and the result's reduction and reordering
    (`_reducing`). A model: XLA reshards as it chooses (JAX 0.12 moves an operand from a split
    of rows to a split of k by an all-gather and a slice, where 0.10 runs an all-to-all)."""
    result_bytes = nbytes[1]
    k_axes = set(keep.local["k"])
    factors = _factors(roles, operand_axes, nbytes)
    claimed = {
        a
        for dims, axes, _ in factors
        for f, f_axes in zip(dims, axes, strict=True)
        if f in roles.result
        for a in f_axes
    }
    finer = _result_split(roles, keep, mesh_shape) * _split(mesh_shape, k_axes)
    if not k_axes <= claimed or _result_split(roles, gather, mesh_shape) < finer:
        return False
    requested = dict(zip(roles.result, _spec_axes(result_sharding, len(roles.result)), strict=True))

    def moved(decision):
        block = result_bytes / _result_split(roles, decision, mesh_shape)
        return _arriving(factors, decision, mesh_shape) + _reducing(
            roles, decision, block, requested, mesh_shape
        )

    return moved(gather) < moved(keep)


def _factors(roles, operand_axes, nbytes):
    """The two product operands as `_arriving` takes them: (dims, held axes, bytes)."""
    return list(zip(roles.operands[:2], operand_axes[:2], nbytes[0][:2], strict=True))


def _result_split(roles, decision, mesh_shape) -> int:
    """How many blocks `decision`'s local GEMMs cut the result into."""
    return _split(mesh_shape, (a for f in roles.result for a in decision.local.get(f, ())))


def _arriving(factors, decision, mesh_shape) -> float:
    """Bytes arriving at a device for operands (dims, held axes, bytes) to take `decision`'s
    local blocks. Per dim, a wanted split that extends the held one is a slice (nothing
    arrives, unless another dim is gathered: XLA gathers first); a held split that extends the
    wanted one is gathered over its extra axes (an axis held on one dim and wanted on another
    is an all-to-all); splits in another order hold none of the wanted block."""
    return sum(
        _arrive(axes, [decision.local.get(f, ()) for f in dims], size, mesh_shape)
        for dims, axes, size in factors
    )


def _arrive(held_axes, wanted_axes, size, mesh_shape, all_to_all=True) -> float:
    """Bytes arriving at a device to take the block `wanted_axes` (per dim) of an array of
    `size` bytes from the block `held_axes` it holds (`_arriving`'s rule). XLA gathers before
    it slices: a gather over axes that no dim is then sliced over brings the held block's
    whole extent along the sliced dims (review helper-112: rows gathered over "data" beside k
    sliced over "model" moved all of k). An axis moved from one dim to another is an
    all-to-all (sliced first, then exchanged), or with `all_to_all=False` a gather."""
    held_block = size / _split(mesh_shape, (a for h in held_axes for a in h))
    gathered, sliced = [], []
    for have, want in zip(held_axes, wanted_axes, strict=True):
        have, want = tuple(have), tuple(want)
        if want[: len(have)] == have:
            sliced += want[len(have) :]
        elif have[: len(want)] == want:
            gathered += have[len(want) :]
        else:
            return size / _split(mesh_shape, (a for w in wanted_axes for a in w))
    moved = _split(mesh_shape, (a for a in gathered if a in sliced)) if all_to_all else 1
    return held_block * (_split(mesh_shape, gathered) - 1) / moved


def _reducing(roles, decision, block, requested, mesh_shape) -> float:
    """Bytes arriving at a device to reduce its partial result `block` (bytes) as `decision`
    says (a reduce-scatter, then an all-reduce, twice the bytes, over the axes left), and to
    reorder the reduced block where its dims' axes come in another order than `requested`
    (a scatter's axes follow the local ones; XLA then permutes the block)."""
    scattered = _split(mesh_shape, (a for axes in decision.scatter.values() for a in axes))
    cost = block * (1 - 1 / scattered)
    cost += 2 * block / scattered * (1 - 1 / _split(mesh_shape, decision.psum))
    for f in roles.result:
        final, wanted = decision.final(f), tuple(requested.get(f, ()))
        if wanted and final != wanted and set(final) == set(wanted):
            cost += block / scattered
            break
    return cost


def _split(mesh_shape, axes) -> int:
    return math.prod(mesh_shape[a] for a in axes)


def _decide_result(roles, mesh_shape, result_sharding, from_operands, local, reduced):
    """The decision, given the reduction factors' axes (`local`; `reduced`, their axes in
    order): each result dim's axes, as `result_sharding` asks or as the operands have them
    (`from_operands(factor)`), and the reduced axes reduce-scattered onto the dims that name
    them, each onto one dim at most (two operands, x over rows and a bias over columns, or
    lhs's rows and rhs's columns, can both name it); the others are all-reduced. Shared with
    ragged_sharding."""
    used, scatter, scattered = set(reduced), {}, set()
    result_axes = _spec_axes(result_sharding, len(roles.result))
    for factor, wanted in zip(roles.result, result_axes, strict=True):
        wanted = wanted or from_operands(factor)
        got = _even_prefix([a for a in wanted if a not in used], roles.size(factor), mesh_shape)
        used.update(got)
        if got:
            local[factor] = got
        extent = roles.size(factor) // math.prod(mesh_shape[a] for a in got)
        free = [a for a in wanted if a in reduced and a not in scattered]
        onto = _even_prefix(free, extent, mesh_shape)
        scattered.update(onto)
        if onto:
            scatter[factor] = onto
    psum = tuple(a for a in reduced if a not in scattered)
    return _Decision(local=local, scatter=scatter, psum=psum)


def _even_prefix(axes, extent, mesh_shape) -> tuple[str, ...]:
    """The longest prefix of `axes` whose mesh sizes together divide `extent`."""
    got = []
    for ax in axes:
        if extent % (math.prod(mesh_shape[a] for a in got) * mesh_shape[ax]):
            break
        got.append(ax)
    return tuple(got)


# --- callbacks ---------------------------------------------------------------------------------


def nbytes(arg_shapes, result_elements: int, out_dtype=None) -> tuple[list[float], int, int]:
    """`_decide`'s `nbytes`: the operands' bytes (nvfp4's half a byte an element, as packed on
    the GPU), the whole result's in the accumulator dtype (float32, or float64 beside a float64
    operand: its partial sums are reduced in it) and in `out_dtype` (as written, and moved to a
    requested split; the accumulator's when None)."""
    operand_bytes = [
        math.prod(s.shape)
        * C.OPERAND_BITS.get(np.dtype(s.dtype).name, 8 * np.dtype(s.dtype).itemsize)
        / 8
        for s in arg_shapes
    ]
    acc = P.acc_dtype(*(s.dtype for s in arg_shapes))
    out = acc if out_dtype is None else np.dtype(out_dtype)
    return operand_bytes, result_elements * acc.itemsize, result_elements * out.itemsize


def _infer(roles: _Roles, mesh, arg_shapes):
    """GSPMD: the result shardings implied by the operands'."""
    decision = _decide(
        roles, mesh, [s.sharding for s in arg_shapes], None, roles.nbytes(arg_shapes)
    )
    return [NamedSharding(mesh, decision.spec(roles.result, final=True))] * roles.num_results


def _partition(roles: _Roles, params, mesh, arg_shapes, result_shapes):
    # Every result (out, and the pre-activation z) has the same dims: the first one's requested
    # sharding decides.
    result_shape = result_shapes[0]
    decision = _decide(
        roles, mesh, [s.sharding for s in arg_shapes], result_shape.sharding,
        roles.nbytes(arg_shapes, result_shape.dtype),
    )  # fmt: skip
    deferred = "k" in decision.local
    arg_shardings = []
    for i, dims in enumerate(roles.operands):
        # bias and c join the reduced result, so they take its final sharding.
        final = deferred and i >= 2
        arg_shardings.append(NamedSharding(mesh, decision.spec(dims, final=final)))
    result_sharding = NamedSharding(mesh, decision.spec(roles.result, final=True))
    local_params = _local_params(params, roles, decision, dict(mesh.shape))

    def lower_fn(*operands):
        if not deferred:
            return P.matmul_p.bind(*operands, **local_params)
        return _row_parallel(operands, roles, decision, params, local_params)

    return mesh, lower_fn, [result_sharding] * roles.num_results, tuple(arg_shardings)


def _row_parallel(operands, roles, decision, params, local_params):
    """Local partial products, their reduction, then the epilogue once on the reduced block."""
    a, b, bias, c = P._split(operands, params["has_bias"], params["has_c"])
    out_dtype = params["out_dtype"]
    acc = P.acc_dtype(a.dtype, b.dtype, out_dtype)
    partial_params = dict(
        local_params,
        activation=None,
        out_dtype=acc,
        has_bias=False,
        has_c=False,
        beta=1.0,
        alpha=1.0,
        save_preact=False,
        act_grad=None,
    )
    (z,) = P.matmul_p.bind(a, b, **partial_params)
    for factor, axes in decision.scatter.items():
        z = lax.psum_scatter(
            z, P.spec_entry(axes), scatter_dimension=roles.result.index(factor), tiled=True
        )
    if decision.psum:
        z = lax.psum(z, P.spec_entry(decision.psum))
    return P.epilogue_xla(
        z, c, bias, alpha=params["alpha"], beta=params["beta"], activation=params["activation"],
        out_dtype=out_dtype, save_preact=params["save_preact"], act_grad=params["act_grad"],
    )  # fmt: skip


def _local_params(params, roles: _Roles, decision: _Decision, mesh_shape):
    """The params of the per-device bind: a user's plan is resized to the local problem.

    When k is sharded the bind is the partial product (accumulator dtype out, no C), and the
    plan is made to say so too.
    """
    plan = params["plan"]
    if plan is None:
        return params

    def local(factor):
        axes = decision.local.get(factor, ())
        return roles.size(factor) // math.prod(mesh_shape[a] for a in axes)

    batch = math.prod(local(f) for f in roles.result[:-2])
    m = local("m")
    # The GEMM the kernels run: the local batch folded into m where the lowering folds it.
    local_out = tuple(local(f) for f in roles.result)
    a_dims = roles.operands[0]
    local_a = tuple(local(f) if f in roles.result or f in ("m", "k") else 1 for f in a_dims)
    local_b = tuple(1 if f.startswith("u") else local(f) for f in roles.operands[1])
    if P.folds_batch(local_a, local_b, params["transpose_a"], local_out):
        m, batch = m * batch, 1
    fields = dict(m=m, n=local("n"), k=local("k"), batch=batch)
    if "k" in decision.local:
        acc = P.acc_dtype(plan.a_dtype, plan.b_dtype, params["out_dtype"])
        fields.update(out_dtype=acc.name, c_dtype=None, preact_out=False)
    problem = dataclasses.replace(plan.problem, **fields)
    if problem == plan.problem:
        return params
    try:
        plan = plan.for_problem(problem)
    except C.PlanError:
        # The user's tiles do not fit the per-device problem; the planner chooses for it.
        plan = None
    return dict(params, plan=plan)
