"""Partitioning of the two ragged primitives (`ragged_dot_p`, `ragged_outer_p`) across devices.

As for matmul (sharding.py): when a jitted program is sharded over more than one device, the
lowering of each ragged primitive wraps its local computation (whatever function ragged.py
registers for the platform) in `custom_partitioning` with a Shardy rule, so XLA never partitions
the grouped product by itself, and the partition callback turns the shardings into per-device
binds of the same primitive and the collectives the math needs.

Background / Algorithm. Factors, by dim:

    ragged_dot    lhs [*b, m, k]  rhs [*b, g, k, n] ([*b, g, n, k])  gs [*b, g]  -> [*b, m, n]
    ragged_outer  lhs [*b, m, k]  rhs [*b, m, n]  gs [*b, g]  -> [*b, g, k, n] ([*b, g, n, k])

(ragged_dot's rhs and bias without *b when the batches share them; ragged_outer's result
without the batch dims it sums, `summed`.) ragged_dot's reduction factors are k and g (a row's
result is the sum over experts of the row's product with each, all but one zero);
ragged_outer's is m, and the batch dims it sums. Every device needs the global group
sizes (the rows of group i start at the sum of the sizes before it), so the group sizes are
always asked for whole along g (an all-gather of g int32 when they come split over an axis;
nothing when they are replicated, as router outputs computed from replicated tokens are).

  * batch b, and ragged_dot's n, ragged_outer's k and n: kept, no communication.
  * a result dim asked split over an axis that an operand's other dim holds (under Auto axes,
    Shardy's pick between two operands' splits) takes it where that moves fewer bytes, as
    matmul's (`sharding._requested_first`): sequence-split tokens into column-split experts
    gather the tokens' rows rather than the experts along n and the result's all-to-all. The
    weight gradient (ragged_outer) may likewise take a requested axis onto n from its
    experts' split or its k. The bytes are a model (XLA gathers before it slices); under Auto
    axes a request can be one that XLA would have dropped, so a layout can move more (an MoE
    layer with FSDP weights beside experts: about 6-17 %).
  * rows m (data-parallel tokens): a device holding rows [r0, r1) binds the primitive on its
    block with the local group sizes clip(end_i, r0, r1) - clip(start_i, r0, r1) (start, end:
    each group's first and end row as the kernels read the global sizes, `group_ends`).
    Exact: a row's group is the same as in the whole problem, rows past the last group stay
    in none. ragged_dot needs nothing more (the experts are whole on every device);
    ragged_outer's per-device results are partial sums over rows, reduced by one `psum` (or
    a `psum_scatter` onto a result dim that the requested sharding splits over the same
    axes), in the accumulator dtype, rounded once after.
  * experts g (expert-parallel; the tokens already routed and whole over the expert axis): a
    device holding experts [e0, e1) computes the rows of those experts only. The local primitive
    takes groups starting at row 0, so the rows are rotated up by `lead`, the number of rows
    before group e0 (in the device's row block), the local group sizes of its experts passed,
    and the result rotated back: every row outside its experts' groups is in no group, so zero.
    ragged_dot's results are then summed over the expert axis (one all-reduce; each row is
    nonzero on one device only, so the sum is exact in the output dtype and is done in it);
    ragged_outer's result is split along g as wanted, with no communication.
  * k of ragged_dot (row-parallel weight): partial products in the accumulator dtype, one
    reduction (all-reduce, or reduce-scatter as above), rounded once, as matmul's; an
    activation is applied to the reduced sum, before that rounding (over experts, each device
    applies it to its rows: act(0) = 0 for every activation ragged_dot takes). ragged_dot's
    bias [*b, g, n] is split as rhs's g and n are; under partial sums over k the device holding
    the first k block adds it and the others add zeros. Beside rows split over the same axes
    (FSDP), the weights are gathered along k instead where that moves fewer bytes
    (`sharding._gathers_less`).
  * a mesh axis serves one factor at most; a sharding that does not divide its dim evenly is
    dropped, and whatever is not named above is gathered: replicated rather than wrong.

Cost of the expert-parallel rule, and what a kernel-side group offset would save. The
rotations are two dynamic copies per bind (lhs [m, k] in and the result [m, n] out; for
ragged_outer both operands in). The local bind's groups hold its own experts' rows only, so a
grouped kernel that skips rows in no group multiplies nothing twice; the other exact choice, a
leading dummy group with a zero weight matrix, would multiply the `lead` rows by zeros (up to
m * k * n more FLOPs on the device holding the last experts). A kernel taking a row offset (or
a group offset with the global cumulative sizes, what `lax.ragged_dot_general`'s `group_offset`
is meant for) would read and write the rows in place: it saves the two copies. It does not save
the all-reduce of the [m, n] result (zeros outside each device's rows), which this layout
needs: tokens whole over the expert axis and the output whole over it too. Sending each device
only its experts' tokens (an all-to-all dispatch) is the caller's layout, not this rule's.

The operand and result shardings the callback returns are those it computes with; XLA reshards
to and from them where the surrounding program wants something else. Unsharded lowerings (one
device, or every axis manual as inside `shard_map`) lower the local computation unchanged.

Explicit mesh axes. Results are typed (`typed`, `out_sharding`): ragged_dot's batch and m as
lhs has them, n as rhs has it; ragged_outer's batch as lhs, g as the group sizes, k as lhs, n
as rhs; the callback reads the type as the requested result sharding. A transpose's operands are
not its primal's, and JAX requires a cotangent typed as its primal: ragged.py's transposes
retype each one (`primitive.cotangent_like`: a slice, or a gather where the primal is whole),
and give the weight gradient's group sizes the experts' split (`group_sizes_like`), so that it
is computed expert-parallel rather than whole on every device. On a mesh of one device with
Explicit axes, the local function is traced untyped: XLA's ragged dot has no Explicit sharding
rule (JAX 0.10 raises for it even on replicated operands).

Limits: a sharded program cannot be serialized with `jax.export` (custom_partitioning's
callbacks live in this process), as for matmul. Under Auto axes nothing ties the weight
gradient's g to the experts' split but Shardy's propagation from where the gradient is used (an
update of the sharded weights in the same jit does); a bare `jax.grad` computes it whole on
each device. Inside a `shard_map` that leaves some axes automatic, the product runs unpartitioned
over those. A dim split over a part of a mesh axis (Shardy's sub-axes, where a reshape cuts a
split dim) is gathered, as for matmul (`sharding.decoded`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import dispatch
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    SdyShardingRule,
)
from jax.interpreters import mlir
from jax.sharding import NamedSharding

from jax_sm100._src import primitive as P
from jax_sm100._src import sharding

# The two primitives' names as ragged.py registers them, and each one's reduction factors.
_REDUCTIONS = {"ragged_dot": ("k", "g"), "ragged_outer": ("m",)}


def lowering(prim, name: str, local_fn):
    """The lowering rule of ragged primitive `prim` ("ragged_dot" or "ragged_outer").

    Args:
      prim: the primitive.
      name: which of the two it is.
      local_fn: the per-device computation, `local_fn(lhs, rhs, group_sizes, **params)`.

    Returns:
      A rule for `mlir.register_lowering`: `local_fn` itself when the program is not sharded;
      else a `custom_partitioning` call whose per-device binds of `prim` lower to `local_fn`.
    """
    if name not in _REDUCTIONS:
        raise ValueError(f"{name=}: want one of {sorted(_REDUCTIONS)}")
    # custom_partitioning needs the device assignment while lowering; jit provides it only for
    # programs holding a primitive of this registry.
    dispatch.prim_requires_devices_during_lowering.add(prim)

    def rule(ctx, *operands, **params):
        def fn(*operands):
            return local_fn(*operands, **params)

        partitioned = _partition_call(prim, name, fn, ctx, params)
        if partitioned is not fn:
            return sharding.lower_partitioned(partitioned, ctx, *operands, multiple_results=False)
        if sharding.typed_over_explicit_axes(ctx) or sharding.explicit_context():
            # Nothing partitioned: traced on plain avals outside the mesh (operands typed over
            # Explicit axes of size 1, or plain ones under a mesh of Explicit axes, would leave
            # XLA's ragged dot an `out_sharding` to infer, which it cannot).
            ctx, fn = sharding.untyped_context(ctx), sharding.untyped(fn)
        return mlir.lower_fun(fn, multiple_results=False)(ctx, *operands)

    return rule


def typed(abstract_eval, name: str):
    """`abstract_eval` of ragged primitive `name`, its result typed by `out_sharding`."""

    def typed_abstract_eval(lhs, rhs, group_sizes, *bias, **params):
        out = abstract_eval(lhs, rhs, group_sizes, *bias, **params)
        spec = out_sharding(name, lhs, rhs, group_sizes, params)
        return out if spec is None else out.update(sharding=spec)

    return typed_abstract_eval


def out_sharding(name: str, lhs, rhs, group_sizes, params):
    """The result's sharding type under Explicit mesh axes (None elsewhere).

    ragged_dot: batch and m as lhs has them, n as rhs has it (a sharded k or g is reduced).
    ragged_outer: batch as lhs, g as the group sizes have it, k as lhs, n as rhs (a sharded m is
    reduced). An axis named twice keeps its first place, as a sharding must.
    """
    operands = (lhs, rhs, group_sizes)
    meshes = {x.sharding.mesh for x in operands if getattr(x, "sharding", None) is not None
              and not x.sharding.mesh.empty}  # fmt: skip
    if len(meshes) > 1:
        raise ValueError(f"jax_sm100.{name}: operands are sharded over different meshes {meshes}")
    if not meshes or not next(iter(meshes))._any_axis_explicit:
        return None
    (mesh,) = meshes
    nb = lhs.ndim - 2

    def spec(x, i):
        return P.spec_axes(x.sharding.spec[i] if i < len(x.sharding.spec) else None)

    parts = [spec(lhs, i) for i in range(nb)]
    if name == "ragged_dot":
        # rhs [*b, g, k, n] or [*b, g, n, k], its *b absent when shared by the batches.
        n_dim = rhs.ndim - (2 if params["transpose_rhs"] else 1)
        parts += [spec(lhs, nb), spec(rhs, n_dim)]
    else:
        del parts[nb - params.get("summed", 0) :]
        k, n = spec(lhs, nb + 1), spec(rhs, nb + 1)
        parts += [spec(group_sizes, nb), *((n, k) if params["transpose_out"] else (k, n))]
    parts = P.first_use(parts)
    return NamedSharding(mesh, jax.sharding.PartitionSpec(*map(P.spec_entry, parts)))


def group_sizes_like(group_sizes, rhs):
    """The group sizes typed with g split as `rhs`'s experts are, under Explicit axes.

    ragged_outer's result takes its g's type from the group sizes: given the experts' split, the
    weight gradient is computed expert-parallel (each device its own experts) rather than whole
    on every device and sliced after. The partitioner gathers the sizes back (g int32).
    """
    want = P.explicit_type(rhs)
    if want is None:
        return group_sizes
    nb = group_sizes.ndim - 1
    spec = tuple(jax.typeof(group_sizes).sharding.spec)
    g_at = len(P.typed_aval(rhs).shape) - 3  # rhs [*b, g, ., .], or [g, ., .] shared by the batches
    g_axes = P.spec_axes(want.spec[g_at] if g_at < len(want.spec) else None)
    batch = [tuple(a for a in P.spec_axes(e) if a not in g_axes) for e in spec[:nb]]
    parts = (*map(P.spec_entry, batch), P.spec_entry(g_axes))
    target = want.update(spec=jax.sharding.PartitionSpec(*parts))
    if jax.typeof(group_sizes).sharding == target:
        return group_sizes
    return jax.sharding.reshard(group_sizes, target)


# The last row an int32 group end can name.
INT32_MAX = 2**31 - 1


def int32_rows(m):
    """`m` as far as int32 group ends reach (a symbolic m as it is)."""
    return m if jax.export.is_symbolic_dim(m) else min(m, INT32_MAX)


def group_ends(group_sizes, m):
    """[..., g] int32: each group's end row as the kernels read the sizes (each clamped to
    [0, m], their running sum saturating at m), along the last axis. The scan adds
    min(b, m - a) to a rather than clamping a + b, so no partial sum passes m (int32 holds
    every m). Sizes split along g under Explicit axes are gathered first (g int32s). Past int32
    rows (only XLA's ragged dot takes so many) the ends saturate at the last int32 row, where
    a running sum of int32 sizes would wrap in XLA."""
    m = int32_rows(m)
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, m)
    sizes = whole_groups(sizes, sizes.ndim - 1)
    return lax.associative_scan(lambda a, b: a + jnp.minimum(b, m - a), sizes, axis=-1)


def saturated_sizes(group_sizes, m):
    """[..., g] int32: the sizes whose running sum is `group_ends` (what each group holds of
    the m rows as the kernels read them: none for a negative size, the rest of the rows for
    one that overruns them)."""
    ends = group_ends(group_sizes, m)
    return jnp.diff(ends, axis=-1, prepend=jnp.zeros_like(ends[..., :1]))


def whole_groups(per_group, axis: int = 0):
    """`per_group` ([*b, g, ...] with g at `axis`: ragged_dot's bias, or its tangent) with g
    unsplit under Explicit axes, so that each row can read its group's row (a gather, or the
    product with the rows' one-hot groups; the bias is small: a gather of it)."""
    return P.unsplit(per_group, axis)


def _partition_call(prim, name, fn, ctx, params):
    if not sharding._is_sharded(ctx.module_context.axis_context):
        return fn
    roles = _Roles.of(name, ctx.avals_in, ctx.avals_out[0].shape, params)
    # The body is the primitive itself, not `fn`: it is lowered only where every axis is manual,
    # and there the primitive lowers to `fn` (tracing `fn` on the global avals would give XLA's
    # ragged dot the avals' Explicit shardings, which it has no rule for).
    return sharding.partitioned(
        lambda *operands: prim.bind(*operands, **params),
        partition=lambda mesh, args, result: _partition(prim, roles, params, mesh, args, result),
        infer=lambda mesh, args: _infer(roles, mesh, args),
        rule=roles.sharding_rule(),
    )


# --- factors -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Roles:
    """The factor of every dim of (lhs, rhs, group_sizes) and of the result, and their sizes."""

    name: str
    operands: tuple[tuple[str, ...], ...]
    result: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]
    # ragged_outer's batch dims summed into its result (`summed`): reductions too.
    summed: tuple[str, ...] = ()

    @classmethod
    def of(cls, name, avals_in, out_shape, params) -> _Roles:
        nb = len(avals_in[0].shape) - 2
        b = tuple(f"b{i}" for i in range(nb))
        summed = ()
        if name == "ragged_dot":
            w = ("g", "n", "k") if params["transpose_rhs"] else ("g", "k", "n")
            rb = b if len(avals_in[1].shape) > 3 else ()  # experts shared by the batches: none
            operands = ((*b, "m", "k"), (*rb, *w), (*b, "g"), (*rb, "g", "n"))[: len(avals_in)]
            result = (*b, "m", "n")
        else:
            operands = ((*b, "m", "k"), (*b, "m", "n"), (*b, "g"))
            summed = b[nb - params.get("summed", 0) :]
            result = (*b[: nb - len(summed)], "g",
                      *(("n", "k") if params["transpose_out"] else ("k", "n")))  # fmt: skip
        sizes = {}
        shapes = (*(a.shape for a in avals_in), out_shape)
        for dims, shape in zip((*operands, result), shapes, strict=True):
            sizes.update(zip(dims, shape, strict=True))
        return cls(name, operands, result, tuple(sorted(sizes.items())), summed)

    @property
    def reductions(self) -> tuple[str, ...]:
        return (*_REDUCTIONS[self.name], *self.summed)

    def size(self, factor: str) -> int:
        return dict(self.sizes)[factor]

    def sharding_rule(self) -> SdyShardingRule:
        # ragged_dot's bias gets factors of its own, to be replicated: tied to rhs's g and n,
        # Shardy's propagation let a bias split over experts move weights split along n (an
        # all-to-all of rhs). `_partition` then cuts the bias as rhs's g and n are cut.
        operands = [ArrayMapping(*dims) for dims in self.operands[:3]]
        own = ("g_bias", "n_bias")
        if len(self.operands) > 3:
            *batch, _, _ = self.operands[3]
            operands.append(ArrayMapping(*batch, *own))
        # Shardy wants the reduction factors in the order the rule first names them.
        named = [f for dims in (*self.operands, self.result) for f in dims]
        return SdyShardingRule(
            operand_mappings=tuple(operands),
            result_mappings=(ArrayMapping(*self.result),),
            reduction_factors=tuple(sorted(self.reductions, key=named.index)),
            need_replication_factors=own if len(self.operands) > 3 else (),
        )


def _decide(roles: _Roles, mesh, arg_shardings, result_sharding, nbytes) -> sharding._Decision:
    """The axes of every factor (module docstring): reductions first, from the operands; then
    the result's dims, as requested or as the operands have them, and which reduction axes are
    scattered onto them; then k gathered where that moves less (`sharding._gathers_less`) and
    the requested axes taken first where that moves less (`sharding._requested_first`).
    `nbytes`: as for `sharding._decide`."""
    mesh_shape = dict(mesh.shape)
    operand_axes = [
        sharding._spec_axes(s, len(dims))
        for s, dims in zip(arg_shardings, roles.operands, strict=True)
    ]

    def from_operands(factor):
        # lhs, rhs and the group sizes decide; ragged_dot's bias follows them (`sharding_rule`).
        for dims, axes in zip(roles.operands[:3], operand_axes[:3], strict=True):
            if factor in dims and axes[dims.index(factor)]:
                return axes[dims.index(factor)]
        return ()

    local, used = {}, set()
    for factor in roles.reductions:
        wanted = [a for a in from_operands(factor) if a not in used]
        got = sharding._even_prefix(wanted, roles.size(factor), mesh_shape)
        used.update(got)
        if got:
            local[factor] = got

    def decided(local):
        reduced = tuple(a for f in roles.reductions for a in local.get(f, ()))
        return sharding._decide_result(roles, mesh_shape, result_sharding, from_operands,
                                       dict(local), reduced)  # fmt: skip

    chosen = decided(local)
    if "k" in local:
        # ragged_dot's k split, or the weights gathered along k where that moves fewer bytes
        # (FSDP's layout: sharding._gathers_less); a split of g stays either way.
        gather = decided({f: axes for f, axes in local.items() if f != "k"})
        if sharding._gathers_less(roles, mesh_shape, operand_axes, result_sharding, nbytes,
                                  chosen, gather):  # fmt: skip
            chosen = gather
    # A result dim asked split over an axis that an operand's other dim holds takes it where
    # that moves fewer bytes (sequence-split tokens into column-split experts).
    return sharding._requested_first(roles, mesh_shape, operand_axes, result_sharding, nbytes,
                                     from_operands, chosen, roles.reductions)  # fmt: skip


# --- callbacks ---------------------------------------------------------------------------------


def _nbytes(roles: _Roles, arg_shapes, out_dtype=None):
    return sharding.nbytes(arg_shapes, math.prod(roles.size(f) for f in roles.result), out_dtype)


def _infer(roles: _Roles, mesh, arg_shapes):
    """GSPMD: the result sharding implied by the operands'."""
    decision = _decide(
        roles, mesh, [s.sharding for s in arg_shapes], None, _nbytes(roles, arg_shapes)
    )
    return NamedSharding(mesh, decision.spec(roles.result, final=True))


def _partition(prim, roles: _Roles, params, mesh, arg_shapes, result_shape):
    decision = _decide(
        roles, mesh, [s.sharding for s in arg_shapes], result_shape.sharding,
        _nbytes(roles, arg_shapes, result_shape.dtype),
    )  # fmt: skip
    lhs_dims, rhs_dims, gs_dims, *bias_dims = roles.operands
    # The group sizes are whole along g on every device: the local sizes are cut from them.
    gs_spec = decision.spec(gs_dims[:-1], final=False)
    arg_shardings = (
        NamedSharding(mesh, decision.spec(lhs_dims, final=False)),
        NamedSharding(mesh, decision.spec(rhs_dims, final=False)),
        NamedSharding(mesh, jax.sharding.PartitionSpec(*gs_spec, None)),
        # ragged_dot's bias: its g and n as rhs has them.
        *(NamedSharding(mesh, decision.spec(dims, final=False)) for dims in bias_dims),
    )
    result_sharding = NamedSharding(mesh, decision.spec(roles.result, final=True))
    mesh_shape = dict(mesh.shape)

    def lower_fn(lhs, rhs, group_sizes, *bias):
        return _local(prim, roles, decision, params, mesh_shape, lhs, rhs, group_sizes, *bias)

    return mesh, lower_fn, result_sharding, arg_shardings


def _local(prim, roles, decision, params, mesh_shape, lhs, rhs, group_sizes, *bias):
    """One device's bind: its rows and experts cut out of the global group sizes, the bind,
    then the reductions (module docstring)."""
    out_dtype = params["out_dtype"]
    rows = lhs.shape[-2]
    r0 = _block_index(decision.local.get("m", ()), mesh_shape) * rows
    g_axes = decision.local.get("g", ())
    g_local = roles.size("g") // math.prod(mesh_shape[a] for a in g_axes)
    e0 = _block_index(g_axes, mesh_shape) * g_local
    sizes, lead = _local_groups(
        group_sizes, roles.size("m"), r0, rows, e0 if g_axes else None, g_local
    )
    # Partial sums over k or rows are added in the accumulator dtype and rounded once; a sum
    # over experts adds zeros to each row's one result, exact in the output dtype.
    partial = any(f in decision.local for f in roles.reductions if f != "g")
    # (Integer and complex results, of lax.ragged_dot's path, are summed in their own dtype.)
    real = jnp.issubdtype(out_dtype, jnp.floating)
    local_dtype = P.acc_dtype(lhs.dtype, rhs.dtype, out_dtype) if partial and real else out_dtype
    local_params = dict(params, out_dtype=local_dtype)
    # ragged_dot's activation applies to the whole sum: with partial sums over k it comes
    # after their reduction (the accumulator-dtype partials summed, then the activation, one
    # rounding). A sum over experts needs nothing: each row is nonzero on one device and every
    # activation has act(0) = 0, so the local binds apply it (in the kernel's epilogue where
    # fused).
    activation = params.get("activation")
    late = activation is not None and partial
    if late:
        local_params["activation"] = None
    k_axes = decision.local.get("k", ())
    if bias and k_axes:
        # Partial sums over k: the bias joins one of them (the first k block's; the others add
        # zeros), so that the reduction adds it once.
        first = _block_index(k_axes, mesh_shape) == 0
        bias = (jnp.where(first, bias[0], jnp.zeros_like(bias[0])),)
    if g_axes:
        lhs = _roll_rows(lhs, -lead)
        if roles.name == "ragged_outer":
            rhs = _roll_rows(rhs, -lead)
    out = prim.bind(lhs, rhs, sizes, *bias, **local_params)
    if g_axes and roles.name == "ragged_dot":
        out = _roll_rows(out, lead)
    for factor, axes in decision.scatter.items():
        out = lax.psum_scatter(
            out, P.spec_entry(axes), scatter_dimension=roles.result.index(factor), tiled=True
        )
    if decision.psum:
        out = lax.psum(out, P.spec_entry(decision.psum))
    if late:
        out = P.apply_activation(out, activation)
    return out.astype(out_dtype)


def _block_index(axes, mesh_shape):
    """This device's block index along a dim split over `axes` (major to minor), traced."""
    index = 0
    for axis in axes:
        index = index * mesh_shape[axis] + lax.axis_index(axis)
    return index


def _local_groups(group_sizes, m, r0, rows, e0, g_local):
    """The sizes of groups [e0, e0 + g_local) within rows [r0, r0 + rows), and `lead`, the
    rows of that block before group e0 (the global sizes are [*b, g] of m rows, read as the
    kernels read them: `group_ends`; e0 None: every group)."""
    ends = group_ends(group_sizes, m)
    starts = jnp.concatenate([jnp.zeros_like(ends[..., :1]), ends[..., :-1]], axis=-1)
    clip = lambda x: jnp.clip(x, r0, r0 + rows)
    sizes = clip(ends) - clip(starts)
    if e0 is None:
        return sizes.astype(group_sizes.dtype), 0
    sizes = lax.dynamic_slice_in_dim(sizes, e0, g_local, axis=-1)
    lead = clip(lax.dynamic_index_in_dim(starts, e0, axis=-1, keepdims=False)) - r0
    return sizes.astype(group_sizes.dtype), lead


def _roll_rows(x, shift):
    """x [*b, m, c] with each batch element's rows rotated by `shift` [*b] (jnp.roll's sense)."""
    if x.ndim == 2:
        return jnp.roll(x, shift, axis=0)
    *batch, m, c = x.shape
    rolled = jax.vmap(lambda y, s: jnp.roll(y, s, axis=0))(
        x.reshape((-1, m, c)), jnp.broadcast_to(shift, tuple(batch)).reshape(-1)
    )
    return rolled.reshape(x.shape)
