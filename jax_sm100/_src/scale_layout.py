"""The "blocked" layout of block scale factors: the one SM100's block-scaled MMA reads.

`jax_sm100.quantize` writes mxfp8's and nvfp4's scales this way and `scaled_matmul` reads them
either way (this layout or plain [..., rows, k / block]); the sm_100a kernel
(kernels/sm100_blockscaled.py) loads them from global memory as they are.

For a matrix of `rows` rows, each scaled per `block` elements of its k, the plain scales are
[rows, blocks] with blocks = k / block. The blocked layout cuts them into atoms of 128 rows by
4 blocks (512 scales: the tcgen05.mma scale-factor tile), padded to whole atoms, atoms ordered
with k fastest, and lays each atom out as 32 lanes of 16 values:

    blocked [ceil(rows / 128), ceil(blocks / 4), 32, 4, 4]
    blocked[rm, rk, lane, group, j] = plain[128 rm + 32 group + lane, 4 rk + j]

(a row-major array of that shape; leading batch dims go in front). This is cuBLAS's and
CUTLASS's "128x4 swizzled" scale layout. The padding holds 1.0 (a finite value: padded
blocks multiply data that is not there, and zero times a NaN scale would not be zero).

Plain scales may also cover 128 rows each: [..., ceil(rows / 128), k / block], one scale per
128 x block tile of the data (DeepSeek-V3 scales its weights per 128 x 128 block; `quantize`'s
"fp8_block128x128"). `row_block` tells them apart from per-row scales by their shape (the two
coincide only for one row, where they mean the same), and `plain` repeats them per row.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_sm100._src import primitive as P

ATOM_ROWS = 128
ATOM_BLOCKS = 4
LANES = 32
GROUPS = ATOM_ROWS // LANES
# The rows one scale covers in plain scales of 128-row tiles ("fp8_block128x128").
ROW_BLOCK = 128
# The k elements one scale covers in a blocked layout, by scale dtype: the OCP MX formats'
# e8m0 per 32 (mxfp8), NVFP4's e4m3 per 16. The blocked shape pads blocks to a multiple of 4,
# so it cannot say the block itself.
BLOCKED_SCALE_BLOCK = {"float8_e8m0fnu": 32, "float8_e4m3fn": 16}


def blocked_shape(rows: int, blocks: int) -> tuple[int, ...]:
    """The blocked layout's trailing shape for `rows` rows of `blocks` scales."""
    return (-(-rows // ATOM_ROWS), -(-blocks // ATOM_BLOCKS), LANES, GROUPS, ATOM_BLOCKS)


def is_blocked(data_ndim: int, scales_ndim: int) -> bool:
    """Whether scales of this rank are in the blocked layout for data of `data_ndim` dims (the
    plain layout has the data's rank)."""
    return scales_ndim == data_ndim + 3


def to_blocked(plain):
    """[..., rows, blocks] -> [..., ceil(rows / 128), ceil(blocks / 4), 32, 4, 4], padded with
    1.0 (the module docstring). Under Explicit axes the atoms keep the plain scales' split of
    rows and blocks where it falls on whole atoms (else that dim is gathered first)."""
    *lead, rows, blocks = plain.shape
    rm, rk = blocked_shape(rows, blocks)[:2]
    plain = _atom_split(plain, (rows, rm, ATOM_ROWS), (blocks, rk, ATOM_BLOCKS))
    pad = [(0, 0)] * len(lead) + [(0, rm * ATOM_ROWS - rows), (0, rk * ATOM_BLOCKS - blocks)]
    x = jnp.pad(plain, pad, constant_values=jnp.asarray(1, plain.dtype))
    # One dim split at a time: under vmap over a dim split by Explicit axes, JAX's reshape rule
    # types a split of one dim, not of two in one reshape.
    x = P.typed_reshape(x, (*lead, rm, GROUPS, LANES, rk * ATOM_BLOCKS))
    x = P.typed_reshape(x, (*lead, rm, GROUPS, LANES, rk, ATOM_BLOCKS))
    n = len(lead)
    return x.transpose((*range(n), n, n + 3, n + 2, n + 1, n + 4))


def _atom_split(x, *dims):
    """x with each of its two last dims, (size, atoms, per_atom), whole under Explicit axes
    unless its split falls on whole atoms (size == atoms * per_atom, the axes dividing atoms)."""
    axes = P.explicit_axes(x)
    if axes is None:
        return x
    gather = [
        d
        for d, (size, atoms, per_atom), have in zip((-2, -1), dims, axes[-2:], strict=True)
        if have and (size != atoms * per_atom or atoms % P.shards(x, d))
    ]
    return P.unsplit(x, *gather)


def from_blocked(blocked, rows: int, blocks: int):
    """The inverse of `to_blocked`: [..., rm, rk, 32, 4, 4] -> [..., rows, blocks]."""
    *lead, rm, rk, lanes, groups, j = blocked.shape
    if (lanes, groups, j) != (LANES, GROUPS, ATOM_BLOCKS) or (rm, rk) != blocked_shape(
        rows, blocks
    )[:2]:
        raise ValueError(
            f"blocked scales {tuple(blocked.shape)} do not hold {rows} rows of {blocks} blocks "
            f"(their trailing shape is {blocked_shape(rows, blocks)})"
        )
    n = len(lead)
    x = blocked.transpose((*range(n), n, n + 3, n + 2, n + 1, n + 4))
    # Gathered first: a split atom dim (the reshape below merges them into rows and blocks),
    # or a split dim whose padding is cut off (slicing a split dim cannot be typed).
    gather = [n + 1, n + 2, n + 4]
    gather += [n] if rm * ATOM_ROWS != rows else []
    gather += [n + 3] if rk * ATOM_BLOCKS != blocks else []
    x = P.unsplit(x, *gather)
    # One merge at a time, as to_blocked splits (JAX's rule types a vmapped merge of one run).
    x = P.typed_reshape(x, (*lead, rm, GROUPS, LANES, rk * ATOM_BLOCKS))
    x = P.typed_reshape(x, (*lead, rm * ATOM_ROWS, rk * ATOM_BLOCKS))
    return x[..., :rows, :blocks]


def scale_block(data_shape, scales_shape, scales_dtype) -> int:
    """The block along k one scale covers, for data [..., rows, k] and its scales, plain or
    blocked (where the scale dtype says it: `BLOCKED_SCALE_BLOCK`).

    Raises:
      ValueError: scales that fit the data in neither layout.
    """
    data_shape, scales_shape = tuple(data_shape), tuple(scales_shape)
    *lead, rows, k = data_shape
    if is_blocked(len(data_shape), len(scales_shape)):
        block = BLOCKED_SCALE_BLOCK.get(np.dtype(scales_dtype).name)
        if block is None or k % block or scales_shape != (*lead, *blocked_shape(rows, k // block)):
            raise ValueError(
                f"blocked scales {scales_shape} of {np.dtype(scales_dtype).name} do not fit data "
                f"{data_shape}: they are [*batch, ceil(rows / 128), ceil(k / block / 4), 32, 4, 4] "
                f"with the block of their dtype ({BLOCKED_SCALE_BLOCK})"
            )
        return block
    if (
        len(scales_shape) != len(data_shape)
        or scales_shape[:-2] != data_shape[:-2]
        or scales_shape[-2] not in (rows, -(-rows // ROW_BLOCK))
        or (scales_shape[-1] != 0 if k == 0 else scales_shape[-1] < 1 or k % scales_shape[-1])
    ):
        raise ValueError(f"scales {scales_shape} do not fit data {data_shape}")
    # No k: no blocks, whose size is then 1 (the product is zeros, as jax.nn's).
    return k // scales_shape[-1] if k else 1


def row_block(data_shape, scales_shape) -> int:
    """The rows one scale covers: `ROW_BLOCK` for plain scales of 128-row tiles
    ([..., ceil(rows / 128), k / block] with rows > 1), else 1 (per row, or blocked)."""
    rows = tuple(data_shape)[-2]
    if is_blocked(len(data_shape), len(scales_shape)) or tuple(scales_shape)[-2] == rows:
        return 1
    return ROW_BLOCK


def plain(data_shape, scales, dtype=None):
    """`scales` of data [..., rows, k] in the plain layout [..., rows, k / block]: blocked ones
    unpacked (their block read off `dtype`, the scales' own by default), those of 128-row tiles
    repeated per row."""
    *_, rows, k = data_shape
    if is_blocked(len(data_shape), scales.ndim):
        dtype = scales.dtype if dtype is None else dtype
        return from_blocked(scales, rows, k // scale_block(data_shape, scales.shape, dtype))
    if row_block(data_shape, scales.shape) > 1:
        return per_row(scales, rows)
    return scales


def per_row(tiles, rows: int):
    """Values per 128-row tile, [..., ceil(rows / 128), c], repeated for each of `rows` rows
    (typed under Explicit axes: split rows stay split where rows is whole tiles)."""
    *lead, t, c = tiles.shape
    if rows == t * ROW_BLOCK:
        x = jnp.broadcast_to(tiles[..., None, :], (*lead, t, ROW_BLOCK, c))
        return x.reshape((*lead, rows, c))
    return jnp.repeat(P.unsplit(tiles, -2), ROW_BLOCK, axis=-2)[..., :rows, :]
