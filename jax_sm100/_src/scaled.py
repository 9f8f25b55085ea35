"""`jax_sm100.scaled_matmul` and `jax_sm100.quantize`: block-scaled low-precision GEMMs.

    scaled_matmul_p   lhs [B, m, k], rhs [B, n, k], lhs_scales [B, m, k / block_a],
                      rhs_scales [B, n, k / block_b]                  -> out [B, m, n]

(the primitive also takes rhs and its scales with a B of 1 beside a larger B of lhs: one rhs
shared by every batch, as `vmap` binds it for weights it leaves unmapped, read once, not
copied per batch; `scaled_matmul` itself takes equal Bs, as `jax.nn.scaled_matmul` does)

with `jax.nn.scaled_matmul`'s meaning (both operands K-major; the block of each operand inferred
from its scales). Either operand's scales may instead cover tiles of 128 rows,
[B, ceil(rows / 128), k / block] (DeepSeek-V3's weights: `quantize(w, "fp8_block128x128")`),
which means the same as those scales repeated per row:

    out = einsum("bmk,bnk->bmn", lhs * repeat(lhs_scales, block_a), rhs * repeat(rhs_scales,
                 block_b))

accumulated in float32 and rounded once to `preferred_element_type`. On an sm_90a device (or
target) fp8 data with scales per 128 of k runs on the block-scaled wgmma kernel (scales of a
dtype other than float32 converted to it first, exactly: scaled_gpu.py,
kernels/sm90_scaled.py); on sm_100a mxfp8 and nvfp4 run on the block-scaled tcgen05 kernel
(kernels/sm100_blockscaled.py); everything else, every other platform included,
computes that math in XLA ops (`reference`). Each CUDA lowering records which it took in
`jax_sm100.lowerings()`. On sharded operands both platforms' lowerings are partitioned into
local products (scaled_sharding.py); under Explicit axes the result is typed by `out_spec`.
`jax.nn.scaled_matmul` itself has no CPU lowering in JAX 0.10.

`quantize(x, recipe)` makes data and scales in exactly the layouts `scaled_matmul` reads, for
four recipes (`RECIPES`): float8_e4m3fn (or, with `data_dtype`, float8_e5m2) with float32
scales per 128 along k (DeepSeek-V3's activations) or per 128 x 128 tile (its weights),
mxfp8 (float8_e4m3fn data, float8_e8m0fnu power-of-two scales per 32) and nvfp4 (float4_e2m1fn
data, float8_e4m3fn scales per 16). mxfp8's and nvfp4's scales come in the "blocked" layout
the SM100 block-scaled MMA reads (scale_layout.py: [B, ceil(rows / 128), ceil(k / block / 4),
32, 4, 4], each 512 scales one MMA tile's), which the sm_100a kernel
(kernels/sm100_blockscaled.py) loads as they are; `scaled_matmul` takes scales in that layout
or plain ([B, rows, k / block]) and means the same product either way.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import dispatch as jax_dispatch
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_sm100._src import primitive as P
from jax_sm100._src import scale_layout, scaled_sharding
from jax_sm100._src.constraints import FP8_DTYPES, SCALE_DTYPE_BITS, SCALED_OUT_DTYPES

scaled_matmul_p = P.Primitive("jax_sm100_scaled_matmul")

DATA_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "bfloat16", "float16", "float32")
# Scale dtypes: those jax.nn.scaled_matmul computes with (each exact in float32, where the
# documented math takes them); the kernels read some (constraints.py, blockscaled_support).
SCALE_DTYPES = tuple(SCALE_DTYPE_BITS)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A quantization recipe: data dtype, scale dtype, the block of k one scale covers, and the
    layout of the scales ("plain" [..., rows, k / block], or "blocked": scale_layout.py)."""

    data_dtype: str
    scale_dtype: str
    block: int
    layout: str = "plain"
    row_block: int = 1  # rows one scale covers (plain layout)


RECIPES = {
    "fp8_block128": Recipe("float8_e4m3fn", "float32", 128),
    # DeepSeek-V3's weights: one scale per 128 x 128 tile (rows x k), [..., ceil(rows / 128),
    # k / 128].
    "fp8_block128x128": Recipe("float8_e4m3fn", "float32", 128, row_block=128),
    "mxfp8": Recipe("float8_e4m3fn", "float8_e8m0fnu", 32, "blocked"),
    "nvfp4": Recipe("float4_e2m1fn", "float8_e4m3fn", 16, "blocked"),
}


# --- the public functions ----------------------------------------------------------------------


def scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
    """`jax.nn.scaled_matmul` (see the module docstring): lhs [B, m, k] and rhs [B, n, k], each
    scaled per block of k by its scales ([B, m, k / block] and [B, n, k / block]; either may
    instead cover 128-row tiles, [B, ceil(rows / 128), k / block], as `quantize(w,
    "fp8_block128x128")` makes them; or be in the blocked layout `quantize` makes for mxfp8 and
    nvfp4: scale_layout.py).

    Differentiable (the backward runs in XLA ops), under `vmap`, and transposable in any one
    operand with the others held (`jax.linear_transpose`). A gradient takes its operand's
    dtype, as JAX's gradients do: for fp8 and fp4 data and fp8 scales it is computed in float32
    and rounded saturating (to the format's largest finite magnitude, not to NaN; float16 and
    bfloat16 ones round as `astype` does, to infinity past their range). float8_e8m0fnu scales
    hold no sign, so no derivative with respect to them exists: differentiating with respect
    to them raises (`jax.lax.stop_gradient` them).

    Raises:
      ValueError: shapes that do not match, or a k that the scales' blocks do not divide.
      TypeError: a data or scale dtype outside `DATA_DTYPES` / `SCALE_DTYPES`; a
        `preferred_element_type` that is None or not floating; a derivative with respect to
        float8_e8m0fnu scales.
    """
    lhs, rhs, lhs_scales, rhs_scales = (
        P.as_array(x, "scaled_matmul", name)
        for x, name in (
            (lhs, "lhs"), (rhs, "rhs"), (lhs_scales, "lhs_scales"), (rhs_scales, "rhs_scales")
        )
    )  # fmt: skip
    for name, x, allowed in (
        ("lhs", lhs, DATA_DTYPES), ("rhs", rhs, DATA_DTYPES),
        ("lhs_scales", lhs_scales, SCALE_DTYPES), ("rhs_scales", rhs_scales, SCALE_DTYPES),
    ):  # fmt: skip
        if np.dtype(x.dtype).name not in allowed:
            raise TypeError(
                f"jax_sm100.scaled_matmul: {name} has dtype {np.dtype(x.dtype).name}; use one of "
                f"{allowed} (jax_sm100.quantize makes data and scales for the usual recipes)"
            )
    _check_shapes(lhs, rhs, lhs_scales, rhs_scales)
    out_dtype = _out_dtype(preferred_element_type)
    return scaled_matmul_p.bind(lhs, rhs, lhs_scales, rhs_scales, out_dtype=out_dtype)


def _out_dtype(preferred_element_type) -> np.dtype:
    """`preferred_element_type` as the dtype the product is rounded to: canonicalized as JAX
    does (float64 is float32 unless x64 is on), and floating."""
    if preferred_element_type is None:
        raise TypeError(
            "jax_sm100.scaled_matmul: preferred_element_type=None; name the output dtype, e.g. "
            "jnp.float32 (the default) or jnp.bfloat16, as jax.nn.scaled_matmul needs one too"
        )
    out = np.dtype(jax.dtypes.canonicalize_dtype(preferred_element_type))
    if out.name not in SCALED_OUT_DTYPES:
        raise TypeError(
            f"jax_sm100.scaled_matmul: preferred_element_type={out.name} is not one of "
            f"{SCALED_OUT_DTYPES}; use jnp.float32 (the default), jnp.bfloat16 or jnp.float16"
        )
    return out


def quantize(x, recipe: str, *, axis: int = -1, data_dtype=None, global_scale: bool = False):
    """(data, scales) of `x` for `recipe` (one of `RECIPES`), blocks taken along `axis` (the
    contracting dim: the last, as `scaled_matmul` reads it), so that `data * repeat(scales)`
    approximates x. Each block's scale maps its largest magnitude onto the data format's largest
    finite value (mxfp8: the power of two at or above that, as e8m0 holds only powers of two).
    A block holding a NaN or an infinity gets a NaN scale and zero data: it dequantizes to NaN,
    and so does every product that reads it.

    `data_dtype` picks the fp8 format of the fp8 recipes (fp8_block128, fp8_block128x128,
    mxfp8): float8_e4m3fn (the default) or float8_e5m2 (wider range, for gradients); nvfp4's
    data is float4_e2m1fn only.

    nvfp4's float8_e4m3fn scales hold magnitudes from 2^-9 to 448, so blocks whose largest
    magnitude lies outside 6 x that range do not fit them (past it, NaN; under it, zeros). With
    `global_scale=True` (nvfp4 only) x is first divided by one float32 scale for the whole array,
    its largest magnitude over 6 x 448, and the call returns (data, scales, global_scale): the
    product of two such operands is `scaled_matmul(a, b, sa, sb) * ga * gb` (NVIDIA's nvfp4
    recipe's per-tensor scale; `ga * gb` alone underflows for operands under ~1e-16).

    The data keeps x's shape. fp8_block128's scales are x's shape with the axis divided by the
    block; fp8_block128x128's (for weights, x [..., rows, k]) also have the rows divided by 128,
    rounded up: [..., ceil(rows / 128), k / 128], one scale per tile for its largest magnitude.
    mxfp8's and nvfp4's are in the blocked layout of the SM100 MMA (scale_layout.py) for x with
    the axis moved last, [..., rows, k]: [..., ceil(rows / 128), ceil(k / block / 4), 32, 4, 4],
    the padding 1.0.

    Raises:
      ValueError: an unknown recipe, an axis out of x's bounds or whose length the block does
        not divide, a scalar x, a 1-D x for a blocked or 128 x 128 recipe, or `global_scale`
        for a recipe other than nvfp4.
      TypeError: a `data_dtype` the recipe does not take.
    """
    if recipe not in RECIPES:
        raise ValueError(f"jax_sm100.quantize: {recipe=} is not one of {tuple(RECIPES)}")
    r = recipe_with(recipe, data_dtype, "jax_sm100.quantize")
    if global_scale and r.scale_dtype != "float8_e4m3fn":
        raise ValueError(
            f"jax_sm100.quantize: global_scale is for nvfp4, whose float8_e4m3fn scales span "
            f"2^-9 to 448; {recipe}'s {r.scale_dtype} scales cover x's range without one"
        )
    x = _real(P.as_array(x, "quantize", "x"), "jax_sm100.quantize")
    if not x.ndim:
        raise ValueError(
            "jax_sm100.quantize: x is a scalar; it quantizes blocks along an axis: pass an "
            "array whose contracting dim (axis) holds a multiple of the block"
        )
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(
            f"jax_sm100.quantize: axis {axis} is out of bounds for an array of dimension "
            f"{x.ndim}; pass the contracting dim, in [-{x.ndim}, {x.ndim})"
        )
    axis = axis % x.ndim
    if (r.layout == "plain" and r.row_block == 1 and x.ndim > 1 and axis != x.ndim - 1
            and P.explicit_type(x) is None):  # fmt: skip
        _check_divides(x.shape[axis], recipe, r.block)
        return _quantize_in_place(x, r, axis)
    x = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    g = None
    if global_scale:
        # Over the finite values: a non-finite block gets its NaN scale from its own maximum
        # (`_scale`) and leaves the other blocks' global scale as it would be without it.
        amax_all = jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), initial=0.0)
        top_all = float(jnp.finfo(r.data_dtype).max) * float(jnp.finfo(r.scale_dtype).max)
        # No smaller than float32's least normal number, as `_scale`'s block scales: under
        # ~3.2e-35 the quotient was flushed to zero, then x / g infinite and every scale NaN.
        tiny = float(jnp.finfo(jnp.float32).tiny)
        g = jnp.where(amax_all > 0, jnp.maximum(amax_all / top_all, tiny), 1.0)
        g = g.astype(jnp.float32)
        x = x / g
    if r.layout == "blocked" and x.ndim < 2:
        raise ValueError(f"jax_sm100.quantize: {recipe} scales rows of a matrix; x is 1-D")
    _check_divides(x.shape[-1], recipe, r.block)
    x_type = P.explicit_type(x)
    if (x.shape[-1] // r.block) % P.shards(x, -1):
        # Under Explicit axes, k split inside a block: gathered (x in float32, a copy of the
        # whole rows on every device; the data is split back after).
        x = P.unsplit(x, -1)
    blocks = x.reshape((*x.shape[:-1], x.shape[-1] // r.block, r.block))
    top = float(jnp.finfo(r.data_dtype).max)
    # NaN read as infinite (XLA's vectorized max reduction on CPU passes over NaNs: 128 ones
    # and a NaN gave 1): a non-finite block's largest magnitude is inf (`_scale`).
    amax = jnp.max(jnp.where(jnp.isnan(blocks), jnp.inf, jnp.abs(blocks)), axis=-1)
    if r.row_block > 1:
        if x.ndim < 2:
            raise ValueError(f"jax_sm100.quantize: {recipe} scales tiles of a matrix; x is 1-D")
        tile_scale = _scale(_tile_max(amax, r.row_block), r, top)
        scale = scale_layout.per_row(tile_scale, x.shape[-2])
    else:
        scale = _scale(amax, r, top)
    # A scale rounded down to its dtype (nvfp4's float8_e4m3fn) leaves quotients past the data
    # dtype's largest value, which cast to NaN (fp8) rather than saturating: clipped; one
    # rounded to zero (below float8_e4m3fn's least subnormal) gives zero data.
    data = _data(blocks, scale.astype(jnp.float32)[..., None], top)
    data = data.reshape(x.shape).astype(r.data_dtype)
    if x_type is not None and P.explicit_type(data) != x_type:
        data = jax.sharding.reshard(data, x_type)  # x's sharding (a local slice)
    if r.layout == "blocked":
        out = (jnp.moveaxis(data, -1, axis), scale_layout.to_blocked(scale))
    else:
        if r.row_block > 1:
            scale = tile_scale  # one per tile
        out = (jnp.moveaxis(data, -1, axis), jnp.moveaxis(scale, -1, axis))
    return out if g is None else (*out, g)


def _real(x, who: str):
    """x, or a TypeError where it is complex (its imaginary part would be dropped)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise TypeError(
            f"{who}: x is {x.dtype}; it quantizes real values: quantize the real and "
            "imaginary parts apart"
        )
    return x


def recipe_with(recipe: str, data_dtype, who: str) -> Recipe:
    """RECIPES[recipe] with its data dtype `data_dtype` (None: the recipe's own), or a
    TypeError naming the dtypes the recipe takes (the fp8 recipes: e4m3 or e5m2)."""
    r = RECIPES[recipe]
    if data_dtype is None:
        return r
    name = np.dtype(data_dtype).name
    allowed = FP8_DTYPES if r.data_dtype in FP8_DTYPES else (r.data_dtype,)
    if name not in allowed:
        raise TypeError(f"{who}: {recipe} data is one of {allowed}, not {name}")
    return dataclasses.replace(r, data_dtype=name)


def _check_divides(length: int, recipe: str, block: int, who: str = "jax_sm100.quantize"):
    if length % block:
        raise ValueError(
            f"{who}: the axis has {length} elements, not a multiple of the "
            f"{recipe} block of {block}; pad it with zeros to a multiple (zeros add nothing "
            "to the product) in both operands"
        )


def _block_max(x, axis: int):
    """The largest magnitude along `axis` (a NaN read as infinite, as in `quantize`), as a
    tree of elementwise maxima: XLA fuses it into one pass over x in x's own layout, where a
    max-reduce along a dim other than the last became a float32 transposed copy of x and a
    reduction over it (H100: 0.71 against 0.26 ms for an 8192 x 14336 bfloat16 x)."""
    m = jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x))
    while m.shape[axis] > 1:  # the recipes' blocks are powers of two
        half = m.shape[axis] // 2
        m = jnp.maximum(
            lax.slice_in_dim(m, 0, half, axis=axis), lax.slice_in_dim(m, half, None, axis=axis)
        )
    return jnp.squeeze(m, axis)


def _data(blocks, scale, top: float):
    """The data of `blocks` (float32) under their broadcast float32 `scale`: zero where the
    scale is not positive (NaN, or rounded to zero), else clipped to the format's range."""
    # x / scale in float32. The quantize_both kernel divides correctly rounded; XLA divides by
    # div.full on GPUs (`-nvptx-prec-divf32=1`, within 2 units of float32) and by the
    # reciprocal's product on CPU (its simplifier's x / broadcast(s)), so its data can differ
    # from the kernel's by one fp8 unit where the quotient lies at a rounding boundary.
    return jnp.where(scale > 0, jnp.clip(blocks / jnp.where(scale > 0, scale, 1.0), -top, top), 0.0)


def _quantize_in_place(x, r: Recipe, axis: int):
    """`quantize` of a per-block recipe along an axis other than the last, computed where the
    blocks lie (the same values as moving the axis last: a column of blocks is reduced in
    place), so that XLA moves no float32 copy of x."""
    shape = (*x.shape[:axis], x.shape[axis] // r.block, r.block, *x.shape[axis + 1 :])
    blocks = x.astype(jnp.float32).reshape(shape)
    top = float(jnp.finfo(r.data_dtype).max)
    scale = _scale(_block_max(blocks, axis + 1), r, top)
    data = _data(blocks, jnp.expand_dims(scale.astype(jnp.float32), axis + 1), top)
    return data.reshape(x.shape).astype(r.data_dtype), scale


def quantize_transposed(x, recipe: str, *, data_dtype=None):
    """`quantize(jnp.swapaxes(x, -1, -2), recipe, data_dtype=...)` for fp8_block128 and
    fp8_block128x128, x [..., k, rows] (k a multiple of 128, no Explicit split): the blocks'
    largest magnitudes taken where x lies (`_block_max`) and the data written transposed from
    x in one pass, bit for bit the same values. Quantizing x transposed let XLA lay x's copy
    out transposed and reduce across it (H100, 8192 x 14336 bfloat16: 0.82 ms; a quantization
    along the last dim takes 0.24)."""
    if recipe not in ("fp8_block128", "fp8_block128x128"):
        raise ValueError(
            f"quantize_transposed: {recipe=} is not fp8_block128 or fp8_block128x128; for "
            "other recipes use jax_sm100.quantize(jnp.swapaxes(x, -1, -2), recipe)"
        )
    r = recipe_with(recipe, data_dtype, "quantize_transposed")
    x = _real(jnp.asarray(x), "quantize_transposed")
    if x.ndim < 2:
        raise ValueError(
            f"quantize_transposed: x is {x.ndim}-D; it takes [..., k, rows] (for a vector "
            "use jax_sm100.quantize)"
        )
    *lead, k, rows = x.shape
    _check_divides(k, recipe, r.block)
    top = float(jnp.finfo(r.data_dtype).max)
    x = x.astype(jnp.float32)
    amax = _block_max(x.reshape((*lead, k // r.block, r.block, rows)), -2)  # [..., k/b, rows]
    amax = jnp.swapaxes(amax, -1, -2)  # [..., rows, k/b]: small
    if r.row_block > 1:
        scale = _scale(_tile_max(amax, r.row_block), r, top)  # [..., tiles, k/b]
        per_element = scale_layout.per_row(scale, rows)
    else:
        scale = per_element = _scale(amax, r, top)
    blocks = jnp.swapaxes(x, -1, -2).reshape((*lead, rows, k // r.block, r.block))
    data = _data(blocks, per_element.astype(jnp.float32)[..., None], top)
    return data.reshape((*lead, rows, k)).astype(r.data_dtype), scale


def _tile_max(amax, row_block):
    """[..., rows, c] -> [..., ceil(rows / row_block), c]: the largest of each tile's rows."""
    *lead, rows, c = amax.shape
    tiles = -(-rows // row_block)
    if tiles % P.shards(amax, -2):
        amax = P.unsplit(amax, -2)  # under Explicit axes, rows split inside a tile: gathered
    if rows != tiles * row_block:
        # Rows padded to whole tiles (zeros: amax is a magnitude); a split rows dim gathered
        # first, as its padding cannot be typed.
        amax = jnp.pad(
            P.unsplit(amax, -2), [(0, 0)] * len(lead) + [(0, tiles * row_block - rows), (0, 0)]
        )
    return jnp.max(amax.reshape((*lead, tiles, row_block, c)), axis=-2)


def _scale(amax, r: Recipe, top: float):
    """The scale of blocks of largest magnitude `amax`, in the recipe's scale dtype."""
    # No smaller than float32's least normal number: for blocks of tiny magnitudes amax / top
    # is subnormal, which XLA flushes to zero (a zero scale, then inf / NaN data). amax times
    # 1 / top rounded to float32, as XLA's simplifier rewrites a division by a constant (and
    # as the quantize_both kernel computes it).
    inv_top = float(np.float32(1.0 / top))
    scale = jnp.where(amax > 0, jnp.maximum(amax * inv_top, float(jnp.finfo(jnp.float32).tiny)),
                      1.0)  # fmt: skip
    if r.scale_dtype == "float8_e8m0fnu":
        # The power of two at or above the scale, read off its float32 bits (a normal number:
        # the exponent, one more for any mantissa bit) and built from exponent bits. log2 is
        # not exact at powers of two (XLA's gave e + eps for 23 of them: doubled scales), and
        # XLA's exp2 gives 0 for 2^-126.
        bits = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.int32)
        e = (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
        scale = lax.bitcast_convert_type((jnp.clip(e, -126, 127) + 127) << 23, jnp.float32)
    # A block holding a NaN or an infinity (amax inf) gets a NaN scale (every scale dtype has
    # one), so its data, zeros, dequantize to NaN: a diverged step shows in the product. Scaled
    # as a finite block, its other values were clipped and, in e2m1 (no NaN), a NaN became 0.
    scale = jnp.where(amax < jnp.inf, scale, jnp.nan)
    return scale.astype(r.scale_dtype)


# --- shapes and math ----------------------------------------------------------------------------


def _check_shapes(lhs, rhs, lhs_scales, rhs_scales, allow_shared=False):
    """Raises ValueError unless the operands (arrays or avals) fit the module docstring; with
    `allow_shared` (the primitive's own check) rhs may have a B of 1 beside lhs's."""
    shapes = [tuple(x.shape) for x in (lhs, rhs, lhs_scales, rhs_scales)]
    if not (len(shapes[0]) == len(shapes[1]) == 3 and all(len(s) in (3, 6) for s in shapes[2:])):
        raise ValueError(
            "jax_sm100.scaled_matmul: lhs [B, m, k], rhs [B, n, k] and their scales [B, m, k/b] "
            f"and [B, n, k/b] are 3-D (scales in the blocked layout 6-D); got {shapes}"
            + ("; for one product add the batch dim: x[None]" if len(shapes[0]) == 2 else "")
        )  # fmt: skip
    lhs_shape, rhs_shape = shapes[:2]
    b_ok = lhs_shape[0] == rhs_shape[0] or (allow_shared and rhs_shape[0] == 1)
    if not b_ok or lhs_shape[2] != rhs_shape[2]:
        raise ValueError(
            f"jax_sm100.scaled_matmul: lhs {lhs_shape} and rhs {rhs_shape} must share B and k"
        )
    for name, data, scales in (("lhs", lhs, lhs_scales), ("rhs", rhs, rhs_scales)):
        try:
            scale_layout.scale_block(data.shape, scales.shape, scales.dtype)
        except ValueError as e:
            raise ValueError(
                f"jax_sm100.scaled_matmul: {name}_scales {tuple(scales.shape)} must be [B, rows, "
                f"k / block], [B, ceil(rows / 128), k / block] (128-row tiles) or the first in the "
                f"blocked layout, for {name} {tuple(data.shape)}, "
                f"with the block dividing k={data.shape[2]} ({e})"
            ) from None


def shared_rhs(lhs, rhs) -> bool:
    """Whether one rhs (a B of 1) serves every batch of a larger lhs (the module docstring)."""
    return rhs.shape[0] == 1 and lhs.shape[0] != 1


def _abstract(lhs, rhs, lhs_scales, rhs_scales, *, out_dtype):
    _check_shapes(lhs, rhs, lhs_scales, rhs_scales, allow_shared=True)
    shape = (lhs.shape[0], lhs.shape[1], rhs.shape[1])
    spec = out_spec(lhs, rhs)
    if spec is None:
        return jax.core.ShapedArray(shape, out_dtype)
    mesh = (P.explicit_type(lhs) or P.explicit_type(rhs)).mesh
    return jax.core.ShapedArray(shape, out_dtype, sharding=NamedSharding(mesh, spec))


def out_spec(lhs, rhs):
    """The result's PartitionSpec under Explicit mesh axes (None elsewhere): B as the operands
    have it, m as lhs has it, n as rhs has it; a split k is reduced (scaled_sharding.py). An
    axis types one dim at most (B first, then m, then n; the dim that loses it is gathered).

    Raises:
      ValueError: B split differently in lhs and rhs.
    """
    la, ra = P.explicit_axes(lhs), P.explicit_axes(rhs)
    if la is None and ra is None:
        return None
    la, ra = la or [()] * 3, ra or [()] * 3
    if la[0] and ra[0] and la[0] != ra[0]:
        raise ValueError(
            f"jax_sm100.scaled_matmul: B is split over {la[0]} in lhs and over {ra[0]} in rhs; "
            "reshard them to one sharding first (jax.sharding.reshard)"
        )
    parts = P.first_use((la[0] or ra[0], la[1], ra[1]))
    return PartitionSpec(*map(P.spec_entry, parts))


def _dequantized(data, scales, exact: bool = True, linear_data: bool = False):
    """data * scales repeated over each block, float32, typed as `data` under Explicit axes
    (the scales resharded to it; a split k that does not fall on whole blocks gathered).
    With `exact` a subnormal scale counts as its value (`_normal_scales`); without, the
    product is linear in `scales` (a tangent's), which XLA's CPU then reads as zero there.
    `linear_data`: `data` is a tangent, so nothing may branch on its values."""
    scales = scale_layout.plain(data.shape, scales).astype(jnp.float32)
    *lead, rows, k = data.shape
    blocks = scales.shape[-1]
    data = data.astype(jnp.float32)
    if k == 0:
        return data  # no blocks to scale
    axes = P.explicit_axes(data)
    if axes is not None:
        mesh = P.explicit_type(data).mesh
        if blocks % P.shards(data, -1):
            data = P.unsplit(data, -1)
            axes[-1] = ()
        want = NamedSharding(mesh, PartitionSpec(*map(P.spec_entry, axes)))
        if P.explicit_type(scales) != want:
            scales = jax.sharding.reshard(scales, want)
    x = data.reshape((*lead, rows, blocks, k // blocks))
    if not exact:
        return (x * scales[..., None]).reshape(data.shape)
    s, post, subnormal = _normal_scales(scales)
    out = x * s[..., None] * post[..., None]
    # Where a scale is subnormal, `s` (rebuilt from its bits) carries no derivative: the
    # derivative with respect to the scale, data, comes from a term of value zero, its tangent
    # and cotangent taken as they are (not through the 2^64 lift, which overflows or flushes
    # them at extreme magnitudes). Non-finite data is left out of it (inf * 0 is NaN).
    d = jnp.where(subnormal, scales - lax.stop_gradient(scales), 0.0)
    if not linear_data:
        x = jnp.where(jnp.isfinite(x), x, 0.0)
    return (out + x * d[..., None]).reshape(data.shape)


# A subnormal float32 scale s (an e8m0 0x00 is 2^-127; float32 and bfloat16 scales may be
# subnormal too) is its 23-bit fraction f times 2^-149. XLA's CPU reads subnormal operands of
# arithmetic as zero, so data * s would be 0 where the product itself is a normal number:
# the scale is rebuilt from its bits as f * 2^-85 (normal), and the product taken times 2^-64
# after it, exact where the result is normal.
_SUBNORMAL_LIFT = 64


def _normal_scales(scales):
    """(s, post, subnormal) for float32 `scales`: s * post == scales in value, s normal or
    zero and post 1, or 2^-64 where a scale is subnormal (there s has no derivative)."""
    bits = lax.bitcast_convert_type(scales, jnp.uint32)
    subnormal = (bits & 0x7F800000) == 0
    frac = (bits & 0x007FFFFF).astype(jnp.int32).astype(jnp.float32)
    lifted = frac * np.float32(2.0 ** (_SUBNORMAL_LIFT - 149))
    lifted = jnp.where((bits >> 31) != 0, -lifted, lifted)
    s = jnp.where(subnormal, lifted, scales)
    post = jnp.where(subnormal, np.float32(2.0**-_SUBNORMAL_LIFT), np.float32(1.0))
    return s, post, subnormal


def reference(lhs, rhs, lhs_scales, rhs_scales, *, out_dtype, precision=lax.Precision.HIGHEST,
              tangent=None):  # fmt: skip
    """The documented math in XLA ops, float32 throughout, rounded once; `precision` the
    product's (the tangents of 8- and 4-bit data take JAX's default: `_jvp`). `tangent`: the
    index of an operand that is a tangent (`_jvp`), so that the result stays linear in it."""
    a = _dequantized(lhs, lhs_scales, exact=tangent != 2, linear_data=tangent == 0)
    b = _dequantized(rhs, rhs_scales, exact=tangent != 3, linear_data=tangent == 1)
    spec = out_spec(a, b)
    out_sharding = None
    if spec is not None:
        # One operand untyped beside a typed one: typed whole on the other's mesh, so that
        # JAX can type the einsum's transposes (their results take the operands' types).
        mesh = (P.explicit_type(a) or P.explicit_type(b)).mesh
        a, b = (
            x
            if P.explicit_type(x)
            else jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec()))
            for x in (a, b)
        )
        ka, kb = (P.explicit_axes(x)[-1] for x in (a, b))
        if ka != kb:
            # k split differently in the two: gathered in both (a dot reduces over one split).
            a, b = P.unsplit(a, -1), P.unsplit(b, -1)
        # A NamedSharding on the operands' mesh: a bare spec needs a mesh in context, and a
        # jit of the gradient (or an eager call) outside `set_mesh` has none.
        out_sharding = NamedSharding(mesh, spec)
    # A shared rhs (one for every batch): a product with its [n, k] alone, never broadcast.
    eq, b = ("bmk,nk->bmn", b[0]) if shared_rhs(a, b) else ("bmk,bnk->bmn", b)
    out = jnp.einsum(eq, a, b, precision=precision, out_sharding=out_sharding)
    return out.astype(out_dtype)


def _cuda(*args, **params):
    from jax_sm100._src import scaled_gpu  # noqa: PLC0415

    return scaled_gpu.cuda_scaled_matmul(*args, **params)


scaled_matmul_p.def_abstract_eval(_abstract)
# Eager calls compile the primitive alone, as jit would: the same kernels and sharding rules.
scaled_matmul_p.def_impl(functools.partial(jax_dispatch.apply_primitive, scaled_matmul_p))
# Both platforms partition a sharded call into local products the same way (scaled_sharding.py).
mlir.register_lowering(scaled_matmul_p, scaled_sharding.lowering(scaled_matmul_p, reference),
                       platform="cpu")  # fmt: skip
mlir.register_lowering(scaled_matmul_p, scaled_sharding.lowering(scaled_matmul_p, _cuda),
                       platform="cuda")  # fmt: skip


# --- vmap: the mapped dim merged into B ----------------------------------------------------------


def _batch(args, dims, *, out_dtype):
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
    # rhs and its scales unmapped and one product's worth (weights shared by every index): the
    # one rhs serves every merged batch, read in place rather than copied per index (the
    # primitive's shared rhs). Otherwise every operand is mapped or copied per index.
    shared = dims[1] is None and dims[3] is None and args[1].shape[0] == 1
    if not shared and _shares_lhs(args, dims):
        # lhs is the shared one (weights on the left): the product's transpose, rhs lhs^T,
        # with lhs as its shared rhs. A copy per index would also round each index's term of
        # lhs's gradient to its 8- or 4-bit format before the sum (`_copies`); the shared
        # operand's gradient sums unrounded float32 terms, rounded once.
        swapped = [args[1], args[0], args[3], args[2]]
        out, d = _batch(swapped, [dims[1], dims[0], dims[3], dims[2]], out_dtype=out_dtype)
        return jnp.swapaxes(out, -1, -2), d
    batched = (0, 2) if shared else (0, 1, 2, 3)
    moved = list(args)
    for i in batched:
        x, d = args[i], dims[i]
        moved[i] = _copies(x[None], (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
    if not shared and moved[1].shape[1] != moved[0].shape[1]:
        # A shared rhs (a B of 1 beside lhs's) that this vmap maps: copied to lhs's B first.
        moved[1], moved[3] = (
            _copies(x, (size, moved[0].shape[1], *x.shape[2:])) for x in moved[1::2]
        )
    # Under Explicit axes a merge whose minor dim is split and major dim whole cannot be typed.
    # The mapped dim goes major, unless B alone is split (no operand splits the mapped dim):
    # then B goes major. Otherwise a B split under a whole mapped dim is gathered, as are all
    # B splits where the merged dims would then be split differently across operands.
    axes = [P.explicit_axes(moved[i]) for i in batched]
    mapped_split = any(a is not None and a[0] for a in axes)
    b_major = not mapped_split and any(a is not None and a[1] for a in axes)
    if b_major:
        for i in batched:
            moved[i] = jnp.swapaxes(moved[i], 0, 1)
    elif mapped_split:
        for i, a in zip(batched, axes, strict=True):
            if a is not None and a[1] and not a[0]:
                moved[i] = P.unsplit(moved[i], 1)
        merged_axes = {tuple(a[0]) + tuple(a[1]) for i in batched
                       if (a := P.explicit_axes(moved[i]))}  # fmt: skip
        if len(merged_axes) > 1:
            for i in batched:
                moved[i] = P.unsplit(moved[i], 1)
    merged = list(moved)
    for i in batched:
        merged[i] = moved[i].reshape((moved[i].shape[0] * moved[i].shape[1], *moved[i].shape[2:]))
    out = scaled_matmul_p.bind(*merged, out_dtype=out_dtype)
    lead = moved[0].shape[:2]
    out = out.reshape((*lead, *out.shape[1:]))
    return (jnp.swapaxes(out, 0, 1) if b_major else out), 0


def _shares_lhs(args, dims) -> bool:
    """Whether `_batch` takes an unmapped lhs as the transposed product's shared rhs: lhs and
    its scales unmapped, one product's worth, beside an rhs of B = 1 per index, and (under
    Explicit axes) no mesh axis splitting both operands' rows: the result's type gives such an
    axis to the product's m before its n, and the transposed product's m is rhs's rows."""
    if not (dims[0] is None and dims[2] is None and args[0].shape[0] == 1):
        return False
    rhs_shape = list(args[1].shape)
    if dims[1] is not None:
        del rhs_shape[dims[1]]
    if rhs_shape[0] != 1:
        return False  # (an lhs B of 1 beside rhs's B of more: the primitive refuses the pair)

    def rows_axes(x, d):
        axes = P.explicit_axes(x)
        if axes is None:
            return set()
        if d is not None:
            del axes[d]
        return set(axes[1])

    return not rows_axes(args[0], dims[0]) & rows_axes(args[1], dims[1])


batching.primitive_batchers[scaled_matmul_p] = _batch


def _copies(x, shape):
    """`x` broadcast to `shape` (an operand copied per index), its values and dtype kept. The
    copies' gradients sum in float32, rounded once to x's dtype (saturating, as `_narrow`
    rounds): a sum in a 16-, 8- or 4-bit format would round each partial sum, and e4m3's
    overflows to NaN. (e8m0 scales have no gradient.)"""
    dtype = np.dtype(x.dtype)
    if dtype.itemsize >= 4 or dtype.name == "float8_e8m0fnu":
        return jnp.broadcast_to(x, shape)
    return jnp.broadcast_to(_widen_p.bind(x, dtype=dtype), shape).astype(dtype)


# --- differentiation: linear in each operand; tangents through the documented math --------------


# Formats whose gradients are rounded saturating: a float32 cotangent past the format's largest
# finite magnitude would otherwise round to NaN (float8_e4m3fn has no infinity).
_SATURATED = (*FP8_DTYPES, "float4_e2m1fn")
_OPERANDS = ("lhs", "rhs", "lhs_scales", "rhs_scales")


def _widen_impl(t, *, dtype):
    return t.astype(jnp.float32)


def _narrow(ct, dtype):
    """A float32 cotangent rounded to `dtype`, saturating for the formats in `_SATURATED`."""
    if np.dtype(dtype).name in _SATURATED:
        top = float(jnp.finfo(dtype).max)
        ct = jnp.clip(ct, -top, top)
    return ct.astype(dtype)


# A tangent's conversion to float32 whose transpose rounds the cotangent back saturating (the
# transpose of `astype` would round past-range values of fp8 data to NaN).
_widen_p = P.Primitive("jax_sm100_scaled_widen")
_widen_p.def_impl(_widen_impl)
# (typed as t is: under Explicit axes the cotangent must have the tangent's sharding)
_widen_p.def_abstract_eval(
    lambda t, *, dtype: t.update(dtype=np.dtype(np.float32), weak_type=False)
)
mlir.register_lowering(_widen_p, mlir.lower_fun(_widen_impl, multiple_results=False))
ad.deflinear2(_widen_p, lambda ct, t, *, dtype: [_narrow(ct, dtype)])
batching.defvectorized(_widen_p)


def _tangent_term(operands, i, t):
    """The product's derivative along operand `i` applied to `t` (float32): linear in `t`,
    through XLA ops that JAX transposes itself. `operands` are the primal values, the `i`-th
    possibly an `ad.UndefinedPrimal` (read for its shape and dtype only: the product is
    linear in each operand)."""
    dtype = np.dtype(_aval(operands[i]).dtype)
    if dtype.name == "float8_e8m0fnu":
        raise TypeError(
            f"jax_sm100.scaled_matmul: a derivative with respect to {_OPERANDS[i]} "
            "(float8_e8m0fnu, unsigned powers of two) has no representation; wrap them in "
            "jax.lax.stop_gradient, or differentiate with respect to float32 scales in "
            "jax.nn.scaled_matmul's plain layout [B, rows, k / block] (the blocked layout "
            "that quantize returns reads its block off the e8m0 dtype)"
        )
    args = list(operands)
    t = _widen_p.bind(t, dtype=dtype)
    if i >= 2:
        # Scales in the plain layout after widening: a tile scale's repeats over its 128 rows
        # transpose to a sum, taken in float32 and rounded once by the widening's transpose
        # (a blocked layout's block is read off the scale dtype).
        t = scale_layout.plain(operands[i - 2].shape, t, dtype)  # (the data: defined)
    args[i] = t
    # Of 8- or 4-bit data (3 mantissa bits at most) the product takes JAX's default precision,
    # as jnp.dot does (`jax_default_matmul_precision`; TF32 on a GPU), since the gradient is
    # rounded to the data's format and the tangent holds no more than it; scales' stay at
    # HIGHEST.
    narrow = i < 2 and dtype.name in _SATURATED
    precision = None if narrow else lax.Precision.HIGHEST
    return reference(*args, out_dtype=np.dtype(np.float32), precision=precision, tangent=i)


def _aval(x):
    return x.aval if ad.is_undefined_primal(x) else x


def _jvp(primals, tangents, *, out_dtype):
    out = scaled_matmul_p.bind(*primals, out_dtype=out_dtype)
    terms = [
        _tangent_term(primals, i, t)
        for i, t in enumerate(tangents)
        if type(t) is not ad.Zero
    ]  # fmt: skip
    if not terms:
        return out, ad.Zero.from_primal_value(out)
    return out, sum(terms[1:], terms[0]).astype(out_dtype)


def _transpose(ct, *operands, out_dtype):
    """The product is linear in each operand with the others fixed (JAX transposes one at a
    time: `jax.linear_transpose`, a custom rule's tangent that calls scaled_matmul): the
    cotangent goes back through `_tangent_term`'s XLA ops, as `grad` takes it."""
    undefined = [i for i, x in enumerate(operands) if ad.is_undefined_primal(x)]
    if len(undefined) != 1:
        raise NotImplementedError(
            "jax_sm100.scaled_matmul is linear in one operand at a time; transposing it with "
            f"respect to {[_OPERANDS[i] for i in undefined]} together is not linear"
        )
    (i,) = undefined
    aval = operands[i].aval
    cts = [None] * len(operands)
    if type(ct) is ad.Zero:
        cts[i] = ad.Zero(aval)
        return cts
    term = lambda t: _tangent_term(operands, i, t).astype(out_dtype)  # noqa: E731
    (cts[i],) = jax.linear_transpose(term, aval)(ct)
    return cts


ad.primitive_jvps[scaled_matmul_p] = _jvp
ad.primitive_transposes[scaled_matmul_p] = _transpose
