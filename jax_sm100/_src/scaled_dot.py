"""`jax_sm100.scaled_dot_general`: block-scaled low-precision training of a dot_general.

`jax.nn.scaled_dot_general`'s meaning: the operands come in high precision (float32, bfloat16)
and are quantized inside, per block of the contraction, by `configs[0]` (lhs) and `configs[1]`
(rhs); the product is `scaled_matmul` of the quantized operands. Its gradient quantizes too: the
cotangent by `configs[2]` and the other operand again, each per block of the gradient's own
contraction (for lhs's, rhs's free dims; for rhs's, lhs's free dims), so the three products of
a training step all run block-scaled:

    y      = scaled_matmul(q0(lhs along k), q1(rhs along k))
    d lhs  = scaled_matmul(q2(g along n),   q1(rhs along n))
    d rhs  = scaled_matmul(q2(g along m),   q0(lhs along m))

with the gradients passed straight through the quantization (a straight-through estimator), as
JAX's rule does. Under a gradient, an operand quantized per 1 x 128 block (fp8_block128:
DeepSeek-V3's activations) or per 128 x 128 tile (fp8_block128x128: its weights) whose dims
are whole 128-blocks is quantized both ways at once in the forward, by one pass of the
`quantize_both` kernel, and the residual is its other orientation's fp8 data and scales rather
than the operand: about half a bfloat16 operand's bytes where the operand would be kept only
for the backward (an activation; a weight gathered inside the step, as under FSDP), and that
much more where it is live anyway (a weight passed as a jit argument: one byte a parameter
held from the forward to the backward, as TransformerEngine keeps its fp8 weights' transposes;
under `jax.checkpoint` it is a residual like any other, which a policy that does not save it
recomputes in the backward). The cotangent is quantized both ways in one pass likewise.
Otherwise the residuals are the unquantized operands, as JAX keeps them. Either form is named
per operand (`LHS_RESIDUAL`, `RHS_RESIDUAL`; public as `jax_sm100.checkpoint_policies`'
SCALED_DOT_LHS and SCALED_DOT_RHS), so that JAX's name policies save, offload or recompute
each.

Each config is a `quantize` recipe name ("fp8_block128", "fp8_block128x128", "mxfp8",
"nvfp4"), a (recipe, data dtype) pair ("fp8_block128", jnp.float8_e5m2), or a
`jax.nn.BlockScaleConfig` (`jax.nn.get_scaled_dot_general_config`). `DEEPSEEK_V3` is DeepSeek-V3's
recipe (activations and cotangents per 1 x 128, weights per 128 x 128 tile, float32 scales),
which runs on the sm_90a block-scaled kernel; mxfp8 and nvfp4 run on the sm_100a one. nvfp4
follows JAX's nvfp4 rule: all three configs nvfp4, a per-tensor global scale (the config's, or
for the recipe name one computed per call, `quantize(..., global_scale=True)`), and a backward of
plain products whose gradients are zeroed where the forward clipped the operand.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_sm100._src import constraints, quantize_both, scaled
from jax_sm100._src import dot_general as dg
from jax_sm100._src import primitive as P

# DeepSeek-V3's fp8 training recipe (lhs = activations, rhs = weights, cotangents), on the
# sm_90a block-scaled kernel.
DEEPSEEK_V3 = ("fp8_block128", "fp8_block128x128", "fp8_block128")
# nvfp4's largest magnitude under a global scale of 1: e2m1's 6 times e4m3's 448.
_NVFP4_TOP = float(jnp.finfo(jnp.float4_e2m1fn).max) * float(jnp.finfo(jnp.float8_e4m3fn).max)
_BLOCK = scaled.RECIPES["fp8_block128"].block
# The names (`jax.ad_checkpoint.checkpoint_name`) of what a gradient keeps of each operand from
# the forward (its other orientation's fp8 data and scales, or the operand itself), which
# `jax.checkpoint_policies.save_only_these_names` and its offloading kin select.
LHS_RESIDUAL = "jax_sm100.scaled_dot_general.lhs"
RHS_RESIDUAL = "jax_sm100.scaled_dot_general.rhs"


@dataclasses.dataclass(frozen=True)
class _Config:
    recipe: str
    data_dtype: str
    global_scale: object = None  # nvfp4: a float32 array, or None for one computed per call


def _config(c, position: int) -> _Config:
    where = ("lhs", "rhs", "gradient")[position]
    pair = isinstance(c, (tuple, list)) and len(c) == 2 and isinstance(c[0], str)
    if isinstance(c, str) or pair:
        name, dtype = (c, None) if isinstance(c, str) else c
        if name not in scaled.RECIPES:
            raise ValueError(
                f"jax_sm100.scaled_dot_general: configs[{position}] ({where}) is {name!r}; use "
                f"one of {tuple(scaled.RECIPES)}, a (recipe, data dtype) pair, or a "
                "jax.nn.BlockScaleConfig"
            )
        who = f"jax_sm100.scaled_dot_general: configs[{position}] ({where})"
        return _Config(name, scaled.recipe_with(name, dtype, who).data_dtype)
    if hasattr(c, "mode") and hasattr(c, "block_size") and hasattr(c, "data_type"):
        expect = {"mxfp8": (32, "float8_e8m0fnu"), "nvfp4": (16, "float8_e4m3fn")}.get(c.mode)
        got = (c.block_size, np.dtype(c.scale_type).name)
        if expect is None or got != expect:
            raise ValueError(
                f"jax_sm100.scaled_dot_general: configs[{position}] ({where}) is mode "
                f"{c.mode!r}, block {got[0]}, {got[1]} scales; the BlockScaleConfigs taken are "
                "jax.nn.get_scaled_dot_general_config('mxfp8') and ('nvfp4', global_scale)"
            )
        who = f"jax_sm100.scaled_dot_general: configs[{position}] ({where})"
        if c.mode == "mxfp8":
            if c.global_scale is not None:
                raise ValueError(
                    f"{who} is an mxfp8 BlockScaleConfig with a global_scale; mxfp8 takes none "
                    "(jax.nn's quantization asserts it is None): drop it, or use nvfp4"
                )
            return _config(("mxfp8", c.data_type), position)
        recipe = scaled.recipe_with("nvfp4", c.data_type, who)
        gs = jnp.asarray(1.0 if c.global_scale is None else c.global_scale, jnp.float32)
        return _Config("nvfp4", recipe.data_dtype, gs)
    raise TypeError(
        f"jax_sm100.scaled_dot_general: configs[{position}] ({where}) is {type(c).__name__}; "
        "use a jax_sm100.quantize recipe name, a (recipe, data dtype) pair, or a "
        "jax.nn.BlockScaleConfig"
    )


def scaled_dot_general(
    lhs,
    rhs,
    dimension_numbers,
    preferred_element_type=jnp.float32,
    configs=None,
    *,
    precision=None,
    out_sharding=None,
) -> jax.Array:
    """`jax.nn.scaled_dot_general` on the block-scaled kernels (see the module docstring).

    Args:
      lhs, rhs: floating arrays in high precision (quantized inside).
      dimension_numbers: `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`.
      preferred_element_type: the result dtype: float32 (the default), bfloat16 or float16;
        None takes the operands' promoted dtype (`jnp.result_type`): pass it in the
        partial given to a Flax layer as `dot_general=` (Flax passes none unless the layer
        sets one, and a bfloat16 layer would otherwise return float32).
      configs: three configs, for lhs, rhs and the gradient (see the module docstring), e.g.
        `jax_sm100.DEEPSEEK_V3` or `[jax.nn.get_scaled_dot_general_config("mxfp8")] * 3`. None
        runs `jax_sm100.dot_general` unquantized, as `jax.nn.scaled_dot_general` runs
        `lax.dot_general`.
      precision: with configs, None or DEFAULT (the formats set the products' precision),
        taken so that the function can be passed as `dot_general=` to Flax's layers; without
        configs, as `jax_sm100.dot_general`.
      out_sharding: as `lax.dot_general`: the result is resharded to it.

    Returns:
      `[batch..., lhs free..., rhs free...]` in `preferred_element_type`, as `lax.dot_general`.
      Differentiable once in reverse mode (`grad`, `vjp`), under `vmap` and `jit`, and on
      sharded operands (`quantize_both` and the products `scaled_matmul` partitioned per
      device; other quantizations XLA ops); forward mode (`jvp`) is not defined, as for
      JAX's, and a second derivative raises NotImplementedError (the backward's quantization
      has none).

    A contraction (k, or for the gradients n and m) that a block does not divide is padded
    with zeros: its last block is partial, scaled by its own largest magnitude (where
    `jax.nn.scaled_dot_general` asserts).

    Raises:
      ValueError: configs that are not three, unknown recipes, a BlockScaleConfig other than
        jax.nn's mxfp8 and nvfp4 (an mxfp8 one with a global scale among them), nvfp4 mixed
        with other recipes.
      TypeError: non-floating operands, one config where three are due, a data dtype its
        recipe does not take, a `precision` with
        configs, or a `preferred_element_type` that is not floating; `lax.dot_general`'s
        errors for invalid dimension numbers and shardings.
    """
    lhs = P.as_array(lhs, "scaled_dot_general", "lhs")
    rhs = P.as_array(rhs, "scaled_dot_general", "rhs")
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"jax_sm100.scaled_dot_general: {name} is {x.dtype}; it quantizes floating "
                "operands (float32, bfloat16, float16)"
            )
    if preferred_element_type is None:
        preferred_element_type = jnp.result_type(lhs.dtype, rhs.dtype)
    out_dtype = scaled._out_dtype(preferred_element_type)
    dn = _normalized(dimension_numbers)
    # lax's checks of the dimension numbers, shapes and shardings, and the result's shape.
    want = jax.eval_shape(
        lambda a, b: lax.dot_general(a, b, dn, out_sharding=out_sharding), lhs, rhs
    )
    if configs is None:
        return dg.dot_general(
            lhs, rhs, dn, precision, preferred_element_type=out_dtype, out_sharding=out_sharding
        )
    default = (None, lax.Precision.DEFAULT)
    pair = isinstance(precision, (tuple, list))
    if not (all(p in default for p in precision) if pair else precision in default):
        raise TypeError(
            f"jax_sm100.scaled_dot_general: precision={precision}; the configs' formats set the "
            "products' precision: pass precision=None"
        )
    if isinstance(configs, str) or hasattr(configs, "mode"):
        raise TypeError(
            f"jax_sm100.scaled_dot_general: configs={configs!r} is one config; give three (lhs, "
            "rhs, gradient), e.g. [config] * 3 or jax_sm100.DEEPSEEK_V3"
        )
    configs = tuple(configs)
    if len(configs) != 3:
        raise ValueError(
            f"jax_sm100.scaled_dot_general: {len(configs)} configs; give three (lhs, rhs, "
            "gradient), e.g. jax_sm100.DEEPSEEK_V3"
        )
    cfg = tuple(_config(c, i) for i, c in enumerate(configs))
    fp4 = [c.recipe == "nvfp4" for c in cfg]
    if any(fp4) and not all(fp4):
        raise ValueError(
            "jax_sm100.scaled_dot_general: nvfp4 is taken for all three configs or none (its "
            "per-tensor scale multiplies the product, and its gradient is unquantized, as "
            "jax.nn.scaled_dot_general's nvfp4 rule has it)"
        )
    layout = _Layout.of(lhs.shape, rhs.shape, dn, want.shape)
    out = _product(lhs, rhs, layout, cfg, out_dtype)
    return out if out_sharding is None else jax.sharding.reshard(out, out_sharding)


def _normalized(dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    return (tuple(map(int, lc)), tuple(map(int, rc))), (tuple(map(int, lb)), tuple(map(int, rb)))


@dataclasses.dataclass(frozen=True)
class _Operand:
    """How an operand folds to 3-D, [B, P, Q]: its batch dims, then its free and contracting
    groups in the order they lie in memory, or (where neither order does) transposed to [B,
    free, contracting]. Each product quantizes it where it lies; where it needs the
    contraction last, the DeepSeek-V3 recipes write their fp8 data transposed in the same pass
    (`_quantize`)."""

    perm: tuple  # applied before the reshape (the identity where the order lies in memory)
    shape3: tuple
    contract_first: bool  # [B, contracting, free]

    @staticmethod
    def of(shape, batch, contract):
        free = tuple(d for d in range(len(shape)) if d not in batch and d not in contract)
        size = lambda dims: math.prod(shape[d] for d in dims)  # noqa: E731
        same = tuple(range(len(shape)))
        if (*batch, *contract, *free) == same and (*batch, *free, *contract) != same:
            return _Operand(same, (size(batch), size(contract), size(free)), True)
        perm = (*batch, *free, *contract)
        return _Operand(perm, (size(batch), size(free), size(contract)), False)

    def fold(self, x):
        if self.perm != tuple(range(x.ndim)):
            x = lax.transpose(x, self.perm)
        folded = P.reshape_in_place(x, self.shape3)
        if folded is None:
            # Under Explicit axes, a merge that would move data between devices (a sequence
            # split under a whole batch): each merged group is gathered but along its first
            # dim (slower, never wrong; lax's products reshard such layouts too).
            folded = P.typed_reshape(P.unsplit(x, *self._minor_dims(x.shape)), self.shape3)
        return folded

    def _minor_dims(self, shape) -> list[int]:
        """The dims of the permuted operand that `shape3` merges under another dim."""
        minor, d = [], 0
        for extent in self.shape3:
            first, got = True, 1
            while d < len(shape) and (got < extent or shape[d] == 1):
                if shape[d] != 1:
                    if not first:
                        minor.append(d)
                    first = False
                got *= shape[d]
                d += 1
        return minor

    def unfold(self, x3, shape):
        x = P.typed_reshape(x3, tuple(shape[d] for d in self.perm))
        inverse = tuple(int(i) for i in np.argsort(self.perm))
        return x if inverse == tuple(range(x.ndim)) else lax.transpose(x, inverse)

    def axis(self, contracting: bool) -> int:
        """The 3-D axis of the contracting group (or, with False, of the free group)."""
        return 1 if contracting == self.contract_first else 2


@dataclasses.dataclass(frozen=True)
class _Layout:
    lhs: _Operand
    rhs: _Operand
    out3: tuple  # [B, m, n]
    out_shape: tuple

    @staticmethod
    def of(lhs_shape, rhs_shape, dn, out_shape):
        (lc, rc), (lb, rb) = dn
        lhs, rhs = _Operand.of(lhs_shape, lb, lc), _Operand.of(rhs_shape, rb, rc)
        m, n = lhs.shape3[lhs.axis(False)], rhs.shape3[rhs.axis(False)]
        return _Layout(lhs, rhs, (lhs.shape3[0], m, n), tuple(out_shape))


def _quantize(x3, axis: int, c: _Config):
    """(data [B, rows, contraction], scales, global scale or None) of a 3-D operand that
    contracts along `axis` (1 or 2); along axis 1 the DeepSeek-V3 recipes read it where it
    lies and write the data transposed (`scaled.quantize_transposed`), the others quantize a
    transposed copy."""
    if (
        axis == 1
        and c.recipe in ("fp8_block128", "fp8_block128x128")
        and P.explicit_type(x3) is None
    ):
        data, scales = scaled.quantize_transposed(x3, c.recipe, data_dtype=c.data_dtype)
        return data, scales, None
    if axis == 1:
        x3 = jnp.swapaxes(x3, 1, 2)
    if c.recipe != "nvfp4":
        data, scales = scaled.quantize(x3, c.recipe, data_dtype=c.data_dtype)
        return data, scales, None
    if c.global_scale is None:
        return scaled.quantize(x3, "nvfp4", global_scale=True)
    # JAX's nvfp4 rule: x over the config's scale, each block's scale clipped to the scale
    # dtype's largest value and the data to e2m1's: clipping x to 6 x 448 first does both.
    x = jnp.clip(x3.astype(jnp.float32) / c.global_scale, -_NVFP4_TOP, _NVFP4_TOP)
    data, scales = scaled.quantize(x, "nvfp4")
    return data, scales, c.global_scale


class _Side(NamedTuple):
    """One operand of a scaled product: `x3` (3-D) contracting along `axis` (1 or 2),
    quantized by `config`; or, with `pre`, quantized already ((data [B, rows, contraction],
    scales, global scale or None), `_both`'s), `x3` then unused (None)."""

    x3: Any
    axis: int
    config: _Config
    pre: tuple | None = None

    @property
    def contraction(self) -> int:
        return self.pre[0].shape[2] if self.pre is not None else self.x3.shape[self.axis]

    def quantized(self):
        return self.pre if self.pre is not None else _quantize(self.x3, self.axis, self.config)


def _both(x3, c: _Config):
    """{axis: (data, scales, None)} of `x3` quantized along its axes 1 and 2 in one pass
    (`quantize_both`: a kernel reading x3 once where it runs), or None where that does not
    apply: a recipe other than fp8_block128 (activations, cotangents) and fp8_block128x128
    (weights: one scale a tile serves both orientations), or rows or contraction not whole
    blocks (padded per product instead)."""
    if c.recipe not in constraints.QUANTIZE_RECIPES:
        return None
    if not x3.size or x3.shape[1] % _BLOCK or x3.shape[2] % _BLOCK:
        return None
    if not quantize_both.keeps_type(x3):
        # Under Explicit axes, a split inside 128-blocks: quantize_both's results would be
        # typed whole there, and the forward's result then not typed as without a gradient
        # (which a custom_vjp, jax.checkpoint and lax.scan require to agree).
        return None
    (q, s), (qt, st) = quantize_both.quantize_both(x3, c.recipe, data_dtype=c.data_dtype)
    return {2: (q, s, None), 1: (qt, st, None)}


def _scaled(a: _Side, b: _Side, out_dtype):
    """scaled_matmul of two operands, quantized by their configs (where not already): [B, a's
    rows, b's rows]. A contraction that a block does not divide is padded with zeros (its last
    block partial, scaled by its own values: zeros add nothing to it or to the product)."""
    block = max(scaled.RECIPES[a.config.recipe].block, scaled.RECIPES[b.config.recipe].block)
    # The padded length as a whole number of blocks, so that a symbolic contraction (jax.export)
    # stays provably divisible (-k % block added to k does not simplify).
    if pad := -(-a.contraction // block) * block - a.contraction:
        # `_both` quantizes whole 128-blocks only, which every recipe's block divides.
        assert a.pre is None and b.pre is None, (a.contraction, block)
        a, b = (
            x._replace(x3=jnp.pad(x.x3, [(0, pad) if d == x.axis else (0, 0) for d in range(3)]))
            for x in (a, b)
        )
    qa, sa, ga = a.quantized()
    qb, sb, gb = b.quantized()
    if ga is None:
        return scaled.scaled_matmul(qa, qb, sa, sb, preferred_element_type=out_dtype)
    out = scaled.scaled_matmul(qa, qb, sa, sb, preferred_element_type=jnp.float32)
    return (out * ga * gb).astype(out_dtype)  # in this order: ga * gb alone can underflow


def _plain(a: _Side, b: _Side):
    """The unquantized float32 product of two operands as `_scaled` takes them. Under Explicit
    axes its result is typed as a dot's would be (the batch as either operand splits it, rows
    as a's, columns as b's), which lax asks for where both split the contraction."""
    dn = (((a.axis,), (b.axis,)), ((0,), (0,)))
    out3 = (a.x3.shape[0], a.x3.shape[3 - a.axis], b.x3.shape[3 - b.axis])
    # The matmul primitive's rule, its a [B, k, m] and b [B, n, k] being transposed operands.
    a3, b3 = jax.typeof(a.x3), jax.typeof(b.x3)
    out_sharding = P.out_sharding(a3, b3, None, None, out3, a.axis == 1, b.axis == 2)
    return dg.dot_general(a.x3, b.x3, dn, preferred_element_type=jnp.float32,
                          out_sharding=out_sharding)  # fmt: skip


def _unclipped(x3, d3, c: _Config):
    """JAX's nvfp4 straight-through rule: the gradient `d3` zeroed where the forward clipped
    `x3` (past the config's global scale x 6 x 448; none with a scale computed per call)."""
    if c.global_scale is None:
        return d3
    return jnp.where(jnp.abs(x3.astype(jnp.float32)) <= c.global_scale * _NVFP4_TOP, d3, 0.0)


def _first_order_only(f):
    """`f` (the backward), raising where it is differentiated: its quantization has no useful
    derivative, and differentiating through it gave silently wrong values."""

    @jax.custom_jvp
    def wrapped(*args):
        return f(*args)

    @wrapped.defjvp
    def _(primals, tangents):
        raise NotImplementedError(
            "jax_sm100.scaled_dot_general: its gradient quantizes the cotangent and is not "
            "differentiable (as jax.nn.scaled_dot_general's); differentiate it once, or use "
            "configs=None (unquantized) for higher-order derivatives"
        )

    return wrapped


def _grad_dtype(dtype) -> np.dtype:
    """The dtype a gradient's product is rounded to: its operand's where scaled_matmul writes
    it, else float32 (then cast)."""
    name = np.dtype(dtype).name
    return np.dtype(name if name in constraints.SCALED_OUT_DTYPES else "float32")


def _product(lhs, rhs, layout: _Layout, cfg, out_dtype):
    L = layout
    (lhs_shape, lhs_dtype), (rhs_shape, rhs_dtype) = ((x.shape, x.dtype) for x in (lhs, rhs))
    # Each primal's sharding type under Explicit axes (None elsewhere): an operand kept as its
    # quantization is not in the residuals, and its cotangent must be typed as it is.
    lhs_type, rhs_type = P.explicit_type(lhs), P.explicit_type(rhs)

    # The configs' global scales (nvfp4's, arrays or None) go through the custom_vjp as
    # arguments: captured, a traced scale (a jit argument under an outer grad, a scanned
    # per-layer scale, jax.checkpoint) would leak from its trace. Their cotangents are zeros.
    scales = tuple(c.global_scale for c in cfg)

    def configs(scales):
        return [dataclasses.replace(c, global_scale=g) for c, g in zip(cfg, scales, strict=True)]

    def forward(lhs, rhs, cfg, keep: bool):
        """The product and, with `keep` (the forward of a gradient), each operand's
        quantization along its free dims where `_both` made it with the forward's (what its
        weight gradient reads; else None)."""
        a3, b3 = L.lhs.fold(lhs), L.rhs.fold(rhs)
        a_axis, b_axis = L.lhs.axis(True), L.rhs.axis(True)
        a_both = _both(a3, cfg[0]) if keep else None
        b_both = _both(b3, cfg[1]) if keep else None
        out = _scaled(
            _Side(a3, a_axis, cfg[0], a_both and a_both[a_axis]),
            _Side(b3, b_axis, cfg[1], b_both and b_both[b_axis]),
            out_dtype,
        )
        a_keep = a_both and a_both[L.lhs.axis(False)]
        b_keep = b_both and b_both[L.rhs.axis(False)]
        return P.typed_reshape(out, L.out_shape), a_keep, b_keep

    @jax.custom_vjp
    def product(lhs, rhs, scales):
        # Without a gradient, each operand is quantized the one way its product reads it.
        return forward(lhs, rhs, configs(scales), keep=False)[0]

    def fwd(lhs, rhs, scales):
        # An operand quantized both ways is kept as its other orientation's fp8 data and
        # scales in place of itself.
        out, a_keep, b_keep = forward(lhs, rhs, configs(scales), keep=True)
        # Each operand's residual, in whichever form, under its name for checkpoint policies.
        lhs_res, a_keep = checkpoint_name((None if a_keep else lhs, a_keep), LHS_RESIDUAL)
        rhs_res, b_keep = checkpoint_name((None if b_keep else rhs, b_keep), RHS_RESIDUAL)
        return out, (lhs_res, rhs_res, a_keep, b_keep, scales)

    def bwd(res, g):
        *res, scales = res
        da, db = _first_order_only(gradients)(*res, scales, g)
        return da, db, jax.tree.map(jnp.zeros_like, scales)

    def gradients(lhs, rhs, a_keep, b_keep, scales, g):
        cfg = configs(scales)
        a3 = None if lhs is None else L.lhs.fold(lhs)
        b3 = None if rhs is None else L.rhs.fold(rhs)
        g3 = P.typed_reshape(g, L.out3)
        g_both = _both(g3, cfg[2]) or {}
        # Each gradient contracts the other operand's free dims with the cotangent's, and
        # comes out in its operand's folded order (its rows first where they lie first).
        over_n = (_Side(g3, 2, cfg[2], g_both.get(2)),
                  _Side(b3, L.rhs.axis(False), cfg[1], b_keep))  # fmt: skip
        over_m = (_Side(g3, 1, cfg[2], g_both.get(1)),
                  _Side(a3, L.lhs.axis(False), cfg[0], a_keep))  # fmt: skip
        if L.lhs.contract_first:
            over_n = over_n[::-1]
        if L.rhs.contract_first:
            over_m = over_m[::-1]
        if cfg[2].recipe == "nvfp4":
            # JAX's nvfp4 rule: plain products, zeroed where the forward clipped the operand.
            da = _unclipped(a3, _plain(*over_n), cfg[0])
            db = _unclipped(b3, _plain(*over_m), cfg[1])
        else:
            da = _scaled(*over_n, _grad_dtype(lhs_dtype))
            db = _scaled(*over_m, _grad_dtype(rhs_dtype))
        # A custom_vjp's cotangents must be typed as its primals (under Explicit axes).
        da = L.lhs.unfold(da, lhs_shape).astype(lhs_dtype)
        db = L.rhs.unfold(db, rhs_shape).astype(rhs_dtype)
        return P.typed_as(da, lhs_type), P.typed_as(db, rhs_type)

    product.defvjp(fwd, bwd)
    return product(lhs, rhs, scales)
