"""Partitioning of `scaled_matmul_p` across devices.

As for matmul (sharding.py): when a jitted program is sharded over more than one device, the
lowering wraps the local computation (the documented math in XLA ops on CPU, the block-scaled
kernel on CUDA where the plan takes it) in `custom_partitioning` with a Shardy rule, so XLA
never partitions the product by itself (on CUDA it would replicate the kernel's custom call:
every operand gathered, the whole product on every device), and the partition callback turns
the shardings into per-device binds of the primitive.

Background / Algorithm. The product has the factors of a batched dot, b (batch), m, n and the
reduced k:

    lhs [b, m, k]  rhs [b, n, k]  lhs_scales [b, m', k']  rhs_scales [b, n', k']  -> [b, m, n]

A scale covers a block of k (and, for 128-row tiles, of rows), so a device's block of the data
must hold whole blocks for its scales to be a block of the scales. Each data dim is therefore
cut in quanta, the compound factor (f, f_in) with f_in the quantum, and its scales' dim is f
(times a minor factor of its own where several scales fall in one quantum):

  * rows (m, n): a quantum of 1 for per-row scales, 128 for 128-row tiles and for the blocked
    layout (whose atoms hold 128 rows: [b, rows / 128, blocks / 4, 32, 4, 4]).
  * k: the lcm of the two operands' blocks (4 blocks for the blocked layout, whose atoms hold
    4); the scales' k dim is k / block = (k / quantum) x (quantum / block).
  * a dim that is not whole quanta (rows not a multiple of 128 beside tile or blocked scales,
    blocked scales padded along k) is replicated, as are the blocked layout's atom dims.

Per device: b, m and n splits are kept (each device one local product, no communication). A
split k gives partial products, each in float32 over whole scale blocks, reduced by a
`psum_scatter` onto each result dim that the requested result sharding splits over k's axes and
one `psum` over the rest, then rounded once to the output dtype, as the whole product is
(beside lhs's rows or batch split over the same axes, FSDP's layout, rhs is gathered along
k instead where that moves fewer bytes: `sharding._gathers_less`). A mesh axis serves one
factor at most; one that does not divide its factor's quanta evenly is
dropped (gathered): replicated rather than wrong (sharding._decide, shared with matmul). The
quanta bound the result's dims too (a reduce-scatter onto n needs whole quanta of n, though the
result holds no scales; otherwise an all-reduce and a slice).

Under Explicit mesh axes the result is typed by `scaled.out_spec`, which the callback reads as
the requested sharding. Unsharded lowerings (one device, or every axis manual as inside
`shard_map`) lower the local computation unchanged, on plain avals where the mesh has Explicit
axes (nothing is split on one device).

Limits: a sharded program cannot be serialized with `jax.export` (custom_partitioning's
callbacks live in this process), as for matmul. Inside a `shard_map` that leaves some axes
automatic, the product runs unpartitioned over those. Under Auto axes:
  * an operand whose sharding holds a part of a mesh axis (a sub-axis: Shardy gives one to the
    scales `quantize` makes in the same jit from data split inside a scale block, 256 rows or a
    k of 2 blocks over 4 devices) reaches the callbacks with that dim unsplit
    (`sharding.decoded`): the scales follow their data anyway, and data so split is gathered
    along that dim.
  * under `vmap` the mapped dim is merged into B as its major part: a split of the mapped dim
    stays local, a split of B inside the vmap is gathered. (Under Explicit axes the types
    say which is split and B goes major where it alone is.) A shared rhs (B of 1 beside lhs's
    B: weights the vmap left unmapped) has a B factor of its own, whole: every device reads
    its block of the one rhs.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax import lax
from jax._src import dispatch
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    CompoundFactor,
    SdyShardingRule,
)
from jax.interpreters import mlir
from jax.sharding import NamedSharding

from jax_sm100._src import primitive as P
from jax_sm100._src import scale_layout, sharding


def lowering(prim, local_fn):
    """The lowering rule of `scaled_matmul_p` (`prim`) whose per-device computation is
    `local_fn(lhs, rhs, lhs_scales, rhs_scales, *, out_dtype)`."""
    # custom_partitioning needs the device assignment while lowering; jit provides it only for
    # programs holding a primitive of this registry.
    dispatch.prim_requires_devices_during_lowering.add(prim)

    def rule(ctx, *operands, out_dtype):
        def fn(*operands):
            return local_fn(*operands, out_dtype=out_dtype)

        if sharding._is_sharded(ctx.module_context.axis_context):
            roles = _Roles.of(ctx.avals_in)
            # The body is the primitive itself, lowered only where every axis is manual (there
            # it lowers to `fn`).
            wrapped = sharding.partitioned(
                lambda *ops: prim.bind(*ops, out_dtype=out_dtype),
                partition=lambda mesh, args, result: _partition(
                    prim, roles, out_dtype, mesh, args, result
                ),
                infer=lambda mesh, args: _infer(roles, mesh, args),
                rule=roles.sharding_rule(),
            )
            return sharding.lower_partitioned(wrapped, ctx, *operands, multiple_results=False)
        if sharding.typed_over_explicit_axes(ctx) or sharding.explicit_context():
            # One device: nothing is split, so the local math is traced untyped.
            ctx, fn = sharding.untyped_context(ctx), sharding.untyped(fn)
        return mlir.lower_fun(fn, multiple_results=False)(ctx, *operands)

    return rule


# --- factors -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Roles:
    """Each operand's and the result's dims as factors: `operands`/`result` name each dim's
    major factor (what `sharding._decide` reads), `mappings` the whole rule's, with compound
    factors; `sizes` the major factors' sizes in quanta (1 for a factor that stays whole)."""

    operands: tuple[tuple[str, ...], ...]
    result: tuple[str, ...]
    mappings: tuple[tuple[tuple[str, ...], ...], ...]
    sizes: tuple[tuple[str, int], ...]
    whole: tuple[str, ...]  # factors never split: need_replication in the rule
    minor: tuple[tuple[str, int], ...]  # minor factors of compound dims, with their sizes

    @classmethod
    def of(cls, avals_in) -> _Roles:
        lhs, rhs, lhs_scales, rhs_scales = avals_in
        batch, m, k = lhs.shape
        n = rhs.shape[1]
        blocked = [scale_layout.is_blocked(3, s.ndim) for s in (lhs_scales, rhs_scales)]
        blocks = [
            scale_layout.scale_block(x.shape, s.shape, s.dtype)
            for x, s in ((lhs, lhs_scales), (rhs, rhs_scales))
        ]
        tiles = [
            scale_layout.row_block(x.shape, s.shape) > 1
            for x, s in ((lhs, lhs_scales), (rhs, rhs_scales))
        ]
        k_quanta = [
            b * (scale_layout.ATOM_BLOCKS if bl else 1)
            for b, bl in zip(blocks, blocked, strict=True)
        ]
        quanta = {
            "b": 1,
            "m": scale_layout.ATOM_ROWS if blocked[0] or tiles[0] else 1,
            "n": scale_layout.ATOM_ROWS if blocked[1] or tiles[1] else 1,
            "k": math.lcm(*k_quanta),
        }
        extents = {"b": batch, "m": m, "n": n, "k": k}
        sizes, whole, minor = {}, [], {}
        data_dims = {}
        for f, extent in extents.items():
            q = quanta[f]
            # Not whole quanta, or one quantum (a compound factor of size 1 is not a rule
            # Shardy takes, and one quantum cannot be split anyway): replicated.
            if extent % q or (q > 1 and extent == q):
                sizes[f] = 1
                whole.append(f)
                data_dims[f] = (f,)
            else:
                sizes[f] = extent // q
                data_dims[f] = (f,) if q == 1 else (f, f"{f}_in")
                if q > 1:
                    minor[f"{f}_in"] = q
                    whole.append(f"{f}_in")

        # A shared rhs (a B of 1 beside lhs's B: scaled.shared_rhs) has a B of its own, whole.
        rhs_b = ("b",)
        if rhs.shape[0] != batch:
            rhs_b = ("rhs_b",)
            whole.append("rhs_b")

        def scale_dims(tag, rows_factor, k_quantum, in_blocks, b_dims):
            # B; the rows' factor (its quanta are the scales' rows, tiles or atoms); k's factor
            # times the scales per k quantum; the blocked layout's atom dims, whole.
            dims = [b_dims]
            if rows_factor in whole:
                dims.append((f"{tag}_r",))
                whole.append(f"{tag}_r")
            else:
                dims.append((rows_factor,))
            ratio = quanta["k"] // k_quantum
            if "k" in whole:
                dims.append((f"{tag}_k",))
                whole.append(f"{tag}_k")
            elif ratio > 1:
                dims.append(("k", f"{tag}_k"))
                minor[f"{tag}_k"] = ratio
                whole.append(f"{tag}_k")
            else:
                dims.append(("k",))
            if in_blocks:
                for i in range(3):
                    dims.append((f"{tag}_a{i}",))
                    whole.append(f"{tag}_a{i}")
            return tuple(dims)

        mappings = (
            (data_dims["b"], data_dims["m"], data_dims["k"]),
            (rhs_b, data_dims["n"], data_dims["k"]),
            scale_dims("sa", "m", k_quanta[0], blocked[0], ("b",)),
            scale_dims("sb", "n", k_quanta[1], blocked[1], rhs_b),
        )
        result = (data_dims["b"], data_dims["m"], data_dims["n"])
        return cls(
            operands=tuple(tuple(d[0] for d in dims) for dims in mappings),
            result=tuple(d[0] for d in result),
            mappings=(*mappings, result),
            sizes=tuple(sorted(sizes.items())),
            whole=tuple(whole),
            minor=tuple(sorted(minor.items())),
        )

    def size(self, factor: str) -> int:
        """A result factor's or k's size in quanta (the others are never split)."""
        return dict(self.sizes)[factor]

    def sharding_rule(self) -> SdyShardingRule:
        *operands, result = self.mappings
        # Shardy wants the special factors in the order the rule first names them.
        named = list(dict.fromkeys(f for dims in self.mappings for d in dims for f in d))
        return SdyShardingRule(
            operand_mappings=tuple(_mapping(dims) for dims in operands),
            result_mappings=(_mapping(result),),
            reduction_factors=() if "k" in self.whole else ("k",),
            need_replication_factors=tuple(sorted(self.whole, key=named.index)),
            **dict(self.minor),
        )


def _mapping(dims) -> ArrayMapping:
    return ArrayMapping(*(CompoundFactor(*d) if len(d) > 1 else d[0] for d in dims))


# --- callbacks ---------------------------------------------------------------------------------


def _data_shardings(arg_shapes):
    """The operands' shardings as the decision reads them: the data's only. The scales follow
    their data (gathering a split of the small scales is cheaper than following it: scales
    split along k beside data split along rows would move the data and reduce partials)."""
    return [s.sharding for s in arg_shapes[:2]] + [None, None]


def _nbytes(arg_shapes, out_dtype=None):
    lhs, rhs = arg_shapes[:2]
    return sharding.nbytes(arg_shapes, lhs.shape[0] * lhs.shape[1] * rhs.shape[1], out_dtype)


def _infer(roles: _Roles, mesh, arg_shapes):
    """GSPMD: the result sharding implied by the operands'."""
    decision = sharding._decide(roles, mesh, _data_shardings(arg_shapes), None, _nbytes(arg_shapes))
    return NamedSharding(mesh, decision.spec(roles.result, final=True))


def _partition(prim, roles: _Roles, out_dtype, mesh, arg_shapes, result_shape):
    decision = sharding._decide(
        roles, mesh, _data_shardings(arg_shapes), result_shape.sharding,
        _nbytes(arg_shapes, result_shape.dtype),
    )  # fmt: skip
    arg_shardings = tuple(
        NamedSharding(mesh, decision.spec(dims, final=False)) for dims in roles.operands
    )
    result_sharding = NamedSharding(mesh, decision.spec(roles.result, final=True))
    partial = "k" in decision.local

    def lower_fn(*operands):
        # Partial sums over k in float32, as the whole product accumulates, rounded once after.
        out = prim.bind(*operands, out_dtype=np.dtype(np.float32) if partial else out_dtype)
        for factor, axes in decision.scatter.items():
            out = lax.psum_scatter(
                out, P.spec_entry(axes), scatter_dimension=roles.result.index(factor), tiled=True
            )
        if decision.psum:
            out = lax.psum(out, P.spec_entry(decision.psum))
        return out.astype(out_dtype)

    return mesh, lower_fn, result_sharding, arg_shardings
