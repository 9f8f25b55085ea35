"""`jax_sm100.scaled_matmul` and `jax_sm100.quantize` on CPU: the documented math against float64,
the recipes' layouts and accuracy, transformations, errors."""

from __future__ import annotations

import functools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_sm100
from jax_sm100._src import scale_layout, scaled
from tests import test_util as tu

# The k elements one scale covers in the blocked layout, by scale dtype (mxfp8, nvfp4).
_BLOCKED_BLOCK = {"float8_e8m0fnu": 32, "float8_e4m3fn": 16}


def _unblock64(data, blocked):
    """Blocked scales [B, rm, rk, 32, 4, 4] of data [B, rows, k] as plain float64 [B, rows,
    k / block], read element by element from the layout's definition: scale (row, j) is at
    [row // 128, j // 4, row % 32, (row % 128) // 32, j % 4]."""
    b, rows, k = data.shape
    blocks = k // _BLOCKED_BLOCK[np.dtype(blocked.dtype).name]
    blocked = np.asarray(blocked, np.float64)
    row, j = np.arange(rows)[:, None], np.arange(blocks)[None, :]
    return blocked[:, row // 128, j // 4, row % 32, (row % 128) // 32, j % 4]


def _reference64(lhs, rhs, lhs_scales, rhs_scales):
    """jax.nn.scaled_matmul's documented math in float64 numpy (scales plain, of 128-row tiles
    or blocked); tests/test_gpu_scaled.py checks the kernel against it too."""

    def dequantize(data, scales):
        if scales.ndim == 6:
            scales = _unblock64(data, scales)
        data, scales = np.asarray(data, np.float64), np.asarray(scales, np.float64)
        if scales.shape[-2] != data.shape[-2]:  # one scale per 128 rows
            scales = np.repeat(scales, 128, axis=-2)[..., : data.shape[-2], :]
        return data * np.repeat(scales, data.shape[-1] // scales.shape[-1], axis=-1)

    return np.matmul(dequantize(lhs, lhs_scales), dequantize(rhs, rhs_scales).transpose(0, 2, 1))


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# Largest error of a dequantized element relative to its block's largest magnitude: half a unit
# in the last place of the data format at its top binade (e4m3: 3 mantissa bits; e2m1: 1), and
# for mxfp8 up to twice that (its power-of-two scale leaves the block's top below the format's).
_QUANT_TOL = {"fp8_block128": 2**-4, "fp8_block128x128": 2**-4, "mxfp8": 2**-3, "nvfp4": 2**-1}


class ScaledMatmulTest(parameterized.TestCase):
    @parameterized.product(recipe=tuple(scaled.RECIPES), shape=((2, 64, 32, 256), (1, 5, 3, 128)))
    def test_recipes_against_float64(self, recipe, shape):
        b, m, n, k = shape
        lhs, lhs_scales = jax_sm100.quantize(_normal(1, (b, m, k)), recipe)
        rhs, rhs_scales = jax_sm100.quantize(_normal(2, (b, n, k)), recipe)
        r = scaled.RECIPES[recipe]
        self.assertEqual((lhs.dtype, lhs_scales.dtype), (jnp.dtype(r.data_dtype),
                                                          jnp.dtype(r.scale_dtype)))  # fmt: skip
        plain = (b, m if r.row_block == 1 else -(-m // 128), k // r.block)
        if r.layout == "blocked":  # 512-scale atoms: 128 rows by 4 blocks, padded
            plain = (b, -(-m // 128), -(-(k // r.block) // 4), 32, 4, 4)
        self.assertEqual(lhs_scales.shape, plain)
        out = jax.jit(jax_sm100.scaled_matmul)(lhs, rhs, lhs_scales, rhs_scales)
        self.assertEqual((out.shape, out.dtype), ((b, m, n), jnp.float32))
        tu.assert_close(self, out, _reference64(lhs, rhs, lhs_scales, rhs_scales), "float32", k)
        out16 = jax_sm100.scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, jnp.bfloat16)
        self.assertEqual(out16.dtype, jnp.bfloat16)
        tu.assert_close(self, out16, _reference64(lhs, rhs, lhs_scales, rhs_scales), "bfloat16")

    @parameterized.parameters(*scaled.RECIPES)
    def test_quantize_round_trip(self, recipe):
        x = _normal(3, (4, 8, 512)) * jnp.exp2(jnp.arange(8.0) - 4)[None, :, None]
        data, scales = jax_sm100.quantize(x, recipe)
        r = scaled.RECIPES[recipe]
        back = np.asarray(scaled._dequantized(data, scales))
        blocks = np.abs(np.asarray(x)).reshape(4, 8, -1, r.block).max(-1)
        if r.row_block > 1:  # one scale per tile of (up to) 128 rows: its largest magnitude
            self.assertEqual(scales.shape, (4, 1, 4))
            blocks = np.broadcast_to(blocks.max(-2, keepdims=True), blocks.shape)
        err = np.abs(back - np.asarray(x)).reshape(4, 8, -1, r.block).max(-1)
        self.assertTrue(np.all(err <= _QUANT_TOL[recipe] * blocks), np.max(err / blocks))
        if recipe == "mxfp8":  # e8m0 holds powers of two only
            s = np.asarray(scales, np.float64)
            np.testing.assert_array_equal(s, np.exp2(np.round(np.log2(s))))

    def test_mxfp8_scales_of_exact_powers_of_two(self):
        # A block whose largest magnitude is 448 x 2^e takes the scale 2^e (the power of two
        # at or above amax / 448) and reaches 448; log2 of the quotient gave e + eps for 23
        # exponents, doubling the scale (its data topped out at 224). Quantizing the
        # dequantized data again then gives it back.
        e = np.arange(-126, 120)
        x = jnp.asarray(448.0 * np.exp2(e.astype(np.float64)), jnp.float32)[None, :, None]
        x = x * jnp.where(jnp.arange(32) % 2, 0.5, 1.0)[None, None, :]
        data, scales = jax_sm100.quantize(x, "mxfp8")
        plain = _unblock64(data, scales)[0, :, 0]
        np.testing.assert_array_equal(plain, np.exp2(e.astype(np.float64)))
        np.testing.assert_array_equal(np.asarray(data, np.float32).max(-1)[0], 448.0)
        again = jax_sm100.quantize(scaled._dequantized(data, scales), "mxfp8")
        for x1, x2 in zip((data, scales), again, strict=True):
            np.testing.assert_array_equal(np.asarray(x1, np.float32), np.asarray(x2, np.float32))

    def test_nvfp4_data_is_x_over_its_stored_scale(self):
        # Each block divided by its scale as stored (rounded to e4m3), then rounded to e2m1:
        # divided by the unrounded scale, 5 % of the values came out one step off.
        x = _normal(21, (2, 128, 256)) * jnp.exp2(jnp.arange(128.0) % 9 - 4)[None, :, None]
        data, blocked = jax_sm100.quantize(x, "nvfp4")
        plain = np.repeat(_unblock64(data, blocked), 16, axis=-1)
        want = jnp.asarray(np.clip(np.asarray(x, np.float64) / plain, -6, 6), jnp.float32)
        np.testing.assert_array_equal(
            np.asarray(data, np.float32), np.asarray(want.astype(jnp.float4_e2m1fn), np.float32)
        )

    def test_nvfp4_global_scale_keeps_small_blocks(self):
        # Rows 2^0 to 2^-15 of one tensor: the global scale puts its largest block at the top
        # of e2m1 x e4m3 (6 x 448), so the e4m3 scales reach every row's blocks (at 6 alone,
        # the rows under 2^-9 flushed to zeros).
        x = _normal(22, (1, 16, 128)) * jnp.exp2(-jnp.arange(16.0))[None, :, None]
        data, scales, g = jax_sm100.quantize(x, "nvfp4", global_scale=True)
        back = np.asarray(scaled._dequantized(data, scales), np.float64) * float(g)
        x64 = np.asarray(x, np.float64)
        err = np.abs(back - x64).reshape(1, 16, -1, 16).max(-1)
        amax = np.abs(x64).reshape(1, 16, -1, 16).max(-1)
        self.assertTrue(np.all(err <= 0.2 * amax), np.max(err / amax))

    @parameterized.product(recipe=tuple(scaled.RECIPES), bad=(np.nan, np.inf, -np.inf))
    def test_quantize_keeps_non_finite_blocks_non_finite(self, recipe, bad):
        # One NaN or infinity among large finite values: its block (its tile, for 128 x 128)
        # dequantizes to NaN and so do the products that read it; every other block is
        # quantized as before. Scaled as a finite block, nvfp4 wrote the NaN as 0 (e2m1 has no
        # NaN) and the block's 100 as 6, and the product came out finite.
        x = _normal(31, (1, 256, 256)).at[0, 3, 5].set(bad).at[0, 3, 6].set(100.0)
        data, scales = jax_sm100.quantize(x, recipe)
        back = np.asarray(scaled._dequantized(data, scales))
        r = scaled.RECIPES[recipe]
        rows = slice(0, 128) if r.row_block > 1 else slice(3, 4)
        cols = slice(0, r.block)
        self.assertTrue(np.all(np.isnan(back[0, rows, cols])), recipe)
        clean, clean_scales = jax_sm100.quantize(x.at[0, 3, 5].set(0.0), recipe)
        want = np.asarray(scaled._dequantized(clean, clean_scales))
        keep = np.ones(back.shape, bool)
        keep[0, rows, cols] = False
        np.testing.assert_array_equal(back[keep], want[keep])
        w, w_scales = jax_sm100.quantize(_normal(32, (1, 64, 256)), recipe)
        out = np.asarray(jax_sm100.scaled_matmul(data, w, scales, w_scales))
        self.assertTrue(np.all(np.isnan(out[0, rows])), recipe)
        self.assertTrue(np.all(np.isfinite(np.delete(out[0], np.arange(256)[rows], 0))))

    @parameterized.parameters(np.nan, np.inf)
    def test_nvfp4_global_scale_leaves_non_finite_values_out(self, bad):
        # The global scale is the finite values' (14.5 x 6 x 448 here): the bad block dequantizes
        # to NaN, every other block as without it (the NaN gave a global scale of 1; the
        # infinity, an infinite one, and every block NaN).
        x = _normal(33, (1, 8, 64)) * 1e4
        data, scales, g = jax_sm100.quantize(x.at[0, 2, 3].set(bad), "nvfp4", global_scale=True)
        clean = jax_sm100.quantize(x.at[0, 2, 3].set(0.0), "nvfp4", global_scale=True)
        self.assertEqual(float(g), float(clean[2]))
        back = np.array(scaled._dequantized(data, scales))
        want = np.array(scaled._dequantized(*clean[:2]))
        self.assertTrue(np.all(np.isnan(back[0, 2, :16])))
        back[0, 2, :16] = want[0, 2, :16] = 0.0
        np.testing.assert_array_equal(back, want)

    @parameterized.product(recipe=tuple(scaled.RECIPES), magnitude=(1e-37, 2e-38))
    def test_quantize_tiny_magnitudes(self, recipe, magnitude):
        # Blocks of normal float32 numbers so small that amax / (the format's top) is
        # subnormal, which XLA flushes to zero: the scale stays at float32's least normal
        # number (data and scales were NaN, and so the product). Within the round trip's
        # tolerance up to the flushed subnormals, except nvfp4, whose e4m3 scales end at 2^-9:
        # its blocks flush to zeros, data and scales, and so the product (global_scale is its
        # answer: test_nvfp4_global_scale; nvfp4 passed here before the fix too).
        x = _normal(4, (2, 8, 256)) * magnitude
        data, scales = jax_sm100.quantize(x, recipe)
        for a in (data, scales):
            self.assertTrue(np.all(np.isfinite(np.asarray(a, np.float32))), recipe)
        out = jax_sm100.scaled_matmul(data, data, scales, scales)
        self.assertTrue(np.all(np.isfinite(np.asarray(out))), recipe)
        back = np.asarray(scaled._dequantized(data, scales))
        if recipe == "nvfp4":
            np.testing.assert_array_equal(np.asarray(data, np.float32), 0.0)
            np.testing.assert_array_equal(back, 0.0)
            np.testing.assert_array_equal(np.asarray(out), 0.0)
        else:
            r = scaled.RECIPES[recipe]
            blocks = np.abs(np.asarray(x)).reshape(2, 8, -1, r.block).max(-1)
            if r.row_block > 1:
                blocks = np.broadcast_to(blocks.max(-2, keepdims=True), blocks.shape)
            err = np.abs(back - np.asarray(x)).reshape(2, 8, -1, r.block).max(-1)
            tiny = float(np.finfo(np.float32).tiny)
            self.assertTrue(np.all(err <= _QUANT_TOL[recipe] * blocks + tiny), recipe)

    @parameterized.parameters("mxfp8", "nvfp4")
    def test_blocked_scales_are_the_mma_layout(self, recipe):
        # 200 rows (two 128-row atoms, the second padded) by 6 blocks of k (two 4-block atoms,
        # padded): each block's scale is where the SM100 MMA reads it, the padding is 1.0, and
        # the product is the same as with the plain scales it encodes.
        r = scaled.RECIPES[recipe]
        x = _normal(9, (2, 200, 6 * r.block)) * jnp.exp2(jnp.arange(200.0) % 7)[None, :, None]
        data, blocked = jax_sm100.quantize(x, recipe)
        self.assertEqual(blocked.shape, (2, 2, 2, 32, 4, 4))
        want = np.asarray(jnp.abs(x).reshape(2, 200, 6, r.block).max(-1), np.float64)
        want = want / float(jnp.finfo(r.data_dtype).max)
        if recipe == "mxfp8":
            want = np.exp2(np.ceil(np.log2(want)))
        got = _unblock64(data, blocked)
        np.testing.assert_allclose(got, want, rtol=2**-3 if recipe == "nvfp4" else 0)
        flat = np.asarray(blocked, np.float64).reshape(2, -1)
        # Byte offset of row 130, block 5 in the second batch: atom (1, 1), lane 2, group 0.
        self.assertEqual(flat[1, 3 * 512 + 2 * 16 + 0 * 4 + 1], got[1, 130, 5])
        rm, rk, lane, group, j = np.ix_(*(np.arange(n) for n in (2, 2, 32, 4, 4)))
        pad = ((128 * rm + 32 * group + lane >= 200) | (4 * rk + j >= 6))[None].repeat(2, 0)
        self.assertEqual(pad.sum(), 2 * (256 * 8 - 200 * 6))
        np.testing.assert_array_equal(np.asarray(blocked, np.float64)[pad], 1.0)
        plain = jnp.asarray(got, r.scale_dtype)
        rhs, rhs_blocked = jax_sm100.quantize(_normal(10, (2, 16, 6 * r.block)), recipe)
        rhs_plain = jnp.asarray(_unblock64(rhs, rhs_blocked), r.scale_dtype)
        a = jax_sm100.scaled_matmul(data, rhs, blocked, rhs_blocked)
        b = jax_sm100.scaled_matmul(data, rhs, plain, rhs_plain)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        # vmap over the blocked scales' batch, and a gradient through them.
        out = jax.vmap(jax_sm100.scaled_matmul, (0, 0, 0, 0))(
            data[:, None], rhs[:, None], blocked[:, None], rhs_blocked[:, None]
        )
        np.testing.assert_array_equal(np.asarray(out[:, 0]), np.asarray(a))

        def loss(lhs, scales, rhs_scales):
            return jnp.sin(jax_sm100.scaled_matmul(lhs, rhs, scales, rhs_scales)).sum()

        lhs32 = data.astype(jnp.float32)
        g_blocked = jax.grad(loss)(lhs32, blocked, rhs_blocked)
        g_plain = jax.grad(loss)(lhs32, plain, rhs_plain)
        np.testing.assert_allclose(np.asarray(g_blocked), np.asarray(g_plain), rtol=1e-6)

    def test_quantize_along_another_axis(self):
        x = _normal(4, (256, 16))  # k first, as a [k, n] weight is stored
        data, scales = jax_sm100.quantize(x, "fp8_block128", axis=0)
        self.assertEqual((data.shape, scales.shape), ((256, 16), (2, 16)))
        for recipe, axis in (("fp8_block128", 2), ("fp8_block128", -3), ("mxfp8", 3)):
            with self.assertRaisesRegex(ValueError, f"axis {axis} is out of bounds.*pass the"):
                jax_sm100.quantize(x, recipe, axis=axis)

    def test_global_scale_of_an_empty_array(self):
        data, scales, g = jax_sm100.quantize(jnp.zeros((0, 64)), "nvfp4", global_scale=True)
        self.assertEqual((data.shape, float(g)), ((0, 64), 1.0))

    @parameterized.product(
        shape=((256, 384), (3, 128, 200), (2, 384, 136)), data_dtype=(None, jnp.float8_e5m2)
    )
    def test_quantized_in_place_bit_for_bit(self, shape, data_dtype):
        # Blocks along a dim other than the last are reduced where they lie, and
        # `quantize_transposed` writes the data of x's transpose from x: each bit for bit
        # what moving the dim last gives. Magnitudes over 2^+-20, a zero block, NaN and infs.
        rng = np.random.default_rng(7)
        x = rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, (*shape[:-1], 1)))
        x[..., :128, 3] = 0.0
        x.flat[5], x.flat[1000], x.flat[2000] = np.nan, np.inf, -np.inf
        x = jnp.asarray(x, jnp.float32)
        swapped = jnp.swapaxes(x, -1, -2)

        def same(got, want):
            for g, w in zip(got, want, strict=True):
                self.assertEqual((g.shape, g.dtype), (w.shape, w.dtype))
                np.testing.assert_array_equal(
                    np.asarray(g).view(np.uint8) if g.dtype.itemsize == 1 else np.asarray(g),
                    np.asarray(w).view(np.uint8) if w.dtype.itemsize == 1 else np.asarray(w),
                )

        data, scales = jax_sm100.quantize(swapped, "fp8_block128", data_dtype=data_dtype)
        same(jax_sm100.quantize(x, "fp8_block128", axis=-2, data_dtype=data_dtype),
             (jnp.swapaxes(data, -1, -2), jnp.swapaxes(scales, -1, -2)))  # fmt: skip
        for recipe in ("fp8_block128", "fp8_block128x128"):
            with self.subTest(recipe):
                want = jax_sm100.quantize(swapped, recipe, data_dtype=data_dtype)
                same(scaled.quantize_transposed(x, recipe, data_dtype=data_dtype), want)
        with self.assertRaisesRegex(TypeError, "data is one of"):
            scaled.quantize_transposed(x, "fp8_block128", data_dtype=jnp.bfloat16)
        with self.assertRaisesRegex(ValueError, "use jax_sm100.quantize"):
            scaled.quantize_transposed(x, "mxfp8")

    def test_weights_scaled_per_128x128_tile(self):
        # DeepSeek-V3's weight recipe: one scale per 128 x 128 tile, [B, ceil(n / 128), k / 128]
        # (300 rows: three tiles, the last of 44 rows). The same product as those scales
        # repeated per row, gradients (the tiles' scales summed over their rows) and vmap too.
        w = _normal(9, (1, 300, 256)) * jnp.exp2(jnp.arange(300.0) % 7 - 3)[None, :, None]
        data, scales = jax_sm100.quantize(w, "fp8_block128x128")
        self.assertEqual((data.shape, scales.shape), ((1, 300, 256), (1, 3, 2)))
        tiles = np.abs(np.asarray(w)).reshape(1, 300, 2, 128).max(-1)
        want = [tiles[:, 128 * t : 128 * (t + 1)].max(1) / 448.0 for t in range(3)]
        np.testing.assert_allclose(np.asarray(scales), np.stack(want, 1), rtol=1e-6)
        lhs, ls = jax_sm100.quantize(_normal(10, (1, 64, 256)), "fp8_block128")
        per_row = jnp.repeat(scales, 128, axis=1)[:, :300]
        out = jax.jit(jax_sm100.scaled_matmul)(lhs, data, ls, scales)
        np.testing.assert_array_equal(out, jax_sm100.scaled_matmul(lhs, data, ls, per_row))
        tu.assert_close(self, out, _reference64(lhs, data, ls, scales), "float32", 256)
        loss = lambda rs: jnp.sum(jax_sm100.scaled_matmul(lhs, data, ls, rs) ** 2)  # noqa: E731
        g = jax.grad(loss)(scales)
        g_rows = jax.grad(loss)(per_row)
        want = np.stack(
            [np.asarray(g_rows)[:, 128 * t : 128 * (t + 1)].sum(1) for t in range(3)], 1
        )
        tu.assert_close(self, g, want, "float32", 300)
        both = jax.vmap(jax_sm100.scaled_matmul, (None, None, None, 0))(
            lhs, data, ls, jnp.stack([scales, 2 * scales])
        )  # fmt: skip
        tu.assert_close(self, both[1], 2 * out, "float32", 256)
        # Another count of rows is neither layout.
        with self.assertRaisesRegex(ValueError, "128-row tiles"):
            jax_sm100.scaled_matmul(lhs, data, ls, scales[:, :2])

    @parameterized.parameters("mxfp8", "nvfp4")
    def test_sm100_packs_tile_scales_per_row(self, recipe):
        # Scales of 128-row tiles reach the sm_100a kernel repeated per row, then blocked: the
        # buffer its lowering passes holds every row's scale (200 rows: two tiles).
        from jax_sm100._src import scale_layout, scaled_sm100  # noqa: PLC0415

        data, blocked = jax_sm100.quantize(_normal(11, (1, 200, 256)), recipe)
        plain = scale_layout.plain(data.shape, blocked)  # [1, 200, blocks]
        tiles = plain[:, ::128]  # one row's scales per tile, as if per 128 x block tile
        flat = scaled_sm100.blocked_flat(data, tiles)
        want = scale_layout.to_blocked(jnp.repeat(tiles, 128, axis=1)[:, :200])
        np.testing.assert_array_equal(np.asarray(flat, np.float32),
                                      np.asarray(want, np.float32).reshape(-1))  # fmt: skip
        self.assertEqual(flat.shape, (np.prod(blocked.shape),))

    def test_gradients_and_vmap(self):
        with jax.enable_x64(False):
            lhs, rhs = _normal(5, (1, 8, 64)), _normal(6, (1, 4, 64))
            ls, rs = jnp.abs(_normal(7, (1, 8, 2))) + 0.5, jnp.abs(_normal(8, (1, 4, 2))) + 0.5
            ours = jax.grad(lambda *a: jnp.sin(jax_sm100.scaled_matmul(*a)).sum(), (0, 1, 2, 3))
            ref = jax.grad(
                lambda *a: jnp.sin(scaled.reference(*a, out_dtype=jnp.float32)).sum(), (0, 1, 2, 3)
            )  # fmt: skip
            for got, want in zip(ours(lhs, rhs, ls, rs), ref(lhs, rhs, ls, rs), strict=True):
                tu.assert_close(self, got, want, "float32", 64)
            batched = jnp.stack([lhs, 2 * lhs])
            out = jax.vmap(jax_sm100.scaled_matmul, (0, None, None, None))(batched, rhs, ls, rs)
            self.assertEqual(out.shape, (2, 1, 8, 4))
            want = jnp.stack([scaled.reference(x, rhs, ls, rs, out_dtype=jnp.float32)
                              for x in batched])  # fmt: skip
            tu.assert_close(self, out, want, "float32", 64)

    @parameterized.parameters(
        ("fp8_block128", "fp8_block128"), ("fp8_block128", "fp8_block128x128"),
        ("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"),
    )  # fmt: skip
    def test_vmap_reads_a_shared_rhs_once(self, lhs_recipe, rhs_recipe):
        # Weights a vmap leaves unmapped (per-example activations against one weight): the
        # bind takes the one rhs [1, n, k] beside lhs's merged batches, not a copy per index;
        # the product, and each gradient (the shared one summed over the indices), are the
        # per-index ones. A vmap mapping that shared rhs again copies it to lhs's batches.
        x, w = _normal(20, (3, 1, 96, 256)), _normal(21, (1, 160, 256))
        lq, ls = jax_sm100.quantize(x, lhs_recipe)
        rq, rs = jax_sm100.quantize(w, rhs_recipe)
        f = jax.vmap(jax_sm100.scaled_matmul, (0, None, 0, None))
        binds = [e for e in jax.make_jaxpr(f)(lq, rq, ls, rs).eqns
                 if e.primitive is scaled.scaled_matmul_p]  # fmt: skip
        (bind,) = binds
        self.assertEqual(bind.invars[0].aval.shape, (3, 96, 256))
        self.assertEqual(bind.invars[1].aval.shape, (1, 160, 256))
        self.assertEqual(bind.invars[3].aval.shape, rs.shape)
        got = f(lq, rq, ls, rs)
        ref = np.stack([_reference64(lq[i], rq, ls[i], rs) for i in range(3)])
        tu.assert_close(self, got, ref, "float32", 256)
        # Nested: the inner vmap shares rhs, the outer maps it (each index its own weights).
        nested = jax.vmap(f, (None, 0, None, None))(lq, jnp.stack([rq, rq]), ls, rs)
        tu.assert_close(self, nested, np.stack([ref, ref]), "float32", 256)
        if rhs_recipe in ("mxfp8", "nvfp4"):
            return  # their scales have no derivative (e8m0), or fp4 data none worth checking
        x32, w32 = lq.astype(jnp.float32), rq.astype(jnp.float32)

        def loss(fn):
            return lambda a, b, sb: jnp.sin(fn(a, b, ls, sb)).sum()

        def per_index(a, b, sa, sb):
            return jnp.stack([jax_sm100.scaled_matmul(a[i], b, sa[i], sb) for i in range(3)])

        got = jax.grad(loss(f), (0, 1, 2))(x32, w32, rs)
        want = jax.grad(loss(per_index), (0, 1, 2))(x32, w32, rs)
        for g, w_ in zip(got, want, strict=True):
            self.assertEqual(g.shape, w_.shape)
            tu.assert_close(self, g, w_, "float32", 256)

    @parameterized.parameters(
        (jnp.float4_e2m1fn, 0.25, 2.0),  # each index's 0.25 rounds to 0 in e2m1
        (jnp.float8_e4m3fn, 0.3, 2.5),  # eight e4m3 0.3s summed in e4m3 gave 2.25
    )
    def test_vmap_shares_an_unmapped_lhs_as_its_rhs(self, dtype, scale, want):
        # Weights on the left, left unmapped: the vmap rule binds the transposed product with
        # them as its shared rhs, so their gradient is the indices' float32 sum rounded once
        # (2.4 -> 2.5 in e4m3), as for weights on the right, not a sum of terms each rounded
        # to their format first (a copy per index: 0 for fp4; summed in e4m3 too, 2.25).
        v, sdt = 8, jnp.float8_e4m3fn
        w, w_s = jnp.ones((1, 1, 16), dtype), jnp.ones((1, 1, 1), sdt)
        x, x_s = jnp.ones((v, 1, 1, 16), dtype), jnp.full((v, 1, 1, 1), scale, sdt)
        right = jax.vmap(jax_sm100.scaled_matmul, (0, None, 0, None))
        left = jax.vmap(jax_sm100.scaled_matmul, (None, 0, None, 0))
        g_right = jax.grad(lambda w: right(x, w, x_s, w_s).sum())(w)
        g_left = jax.grad(lambda w: left(w, x, w_s, x_s).sum())(w)
        np.testing.assert_array_equal(g_left.astype(np.float32), g_right.astype(np.float32))
        self.assertEqual(float(g_left[0, 0, 0].astype(np.float32)), want)
        # The values: one bind, lhs shared, the result the per-index products.
        lq, ls = jax_sm100.quantize(_normal(24, (1, 96, 256)), "fp8_block128x128")
        rq, rs = jax_sm100.quantize(_normal(25, (3, 1, 160, 256)), "fp8_block128")
        f = jax.vmap(jax_sm100.scaled_matmul, (None, 0, None, 0))
        (bind,) = [e for e in jax.make_jaxpr(f)(lq, rq, ls, rs).eqns
                   if e.primitive is scaled.scaled_matmul_p]  # fmt: skip
        self.assertEqual(bind.invars[1].aval.shape, (1, 96, 256))
        got = f(lq, rq, ls, rs)
        self.assertEqual(got.shape, (3, 1, 96, 160))
        ref = np.stack([_reference64(lq, rq[i], ls, rs[i]) for i in range(3)])
        tu.assert_close(self, got, ref, "float32", 256)

    def test_vmap_copies_sum_their_gradients_in_float32(self):
        # fp8 data left unmapped beside mapped scales is copied per index; the copies'
        # gradients (200 each) sum in float32 and round once, saturating: 600 -> 448. Summed in
        # e4m3 they overflowed to NaN.
        a, b = jnp.ones((1, 4, 32), jnp.float8_e4m3fn), jnp.ones((1, 2, 32), jnp.float8_e4m3fn)
        sa, sb = jnp.ones((3, 1, 4, 1), jnp.float32), jnp.ones((3, 1, 2, 1), jnp.float32)
        ct = jnp.full((3, 1, 4, 2), 100.0, jnp.float32)
        f = jax.vmap(jax_sm100.scaled_matmul, (None, None, 0, 0))
        for got in jax.grad(lambda a, b: (f(a, b, sa, sb) * ct).sum(), (0, 1))(a, b):
            self.assertEqual(got.dtype, jnp.float8_e4m3fn)
            np.testing.assert_array_equal(np.asarray(got, np.float32), 448.0)
        # The values are the per-index products'.
        np.testing.assert_array_equal(f(a, b, sa, sb), np.full((3, 1, 4, 2), 32.0, np.float32))

    def test_public_call_takes_equal_batches(self):
        # The shared rhs is the vmap rule's: scaled_matmul itself takes equal Bs, as
        # jax.nn.scaled_matmul does.
        lq, ls = jax_sm100.quantize(_normal(22, (2, 8, 128)), "fp8_block128")
        rq, rs = jax_sm100.quantize(_normal(23, (1, 4, 128)), "fp8_block128")
        with self.assertRaisesRegex(ValueError, r"must share B and k"):
            jax_sm100.scaled_matmul(lq, rq, ls, rs)

    @parameterized.parameters(*scaled.RECIPES)
    def test_no_contraction(self, recipe):
        # k = 0, quantize's own output included: zeros, as jax.nn.scaled_matmul and the jnp
        # contraction give (the plain scales' check and the dequantization divided by zero).
        lhs, ls = jax_sm100.quantize(jnp.ones((1, 3, 0), jnp.float32), recipe)
        rhs, rs = jax_sm100.quantize(jnp.ones((1, 4, 0), jnp.float32), recipe)
        out = jax.jit(jax_sm100.scaled_matmul)(lhs, rhs, ls, rs)
        np.testing.assert_array_equal(out, np.zeros((1, 3, 4), np.float32))
        grads = jax.grad(lambda x, w: jax_sm100.scaled_matmul(x, w, ls, rs).sum(), (0, 1))
        for g, x in zip(grads(lhs, rhs), (lhs, rhs), strict=True):
            self.assertEqual((g.shape, g.dtype), (x.shape, x.dtype))
        if scaled.RECIPES[recipe].layout != "blocked":
            ones = functools.partial(jnp.ones, dtype=jnp.float32)
            out = jax_sm100.scaled_matmul(lhs, rhs, ones((1, 3, 0)), ones((1, 4, 0)))
            self.assertEqual(out.shape, (1, 3, 4))
            # No k: no blocks, so no scale columns either.
            with self.assertRaisesRegex(ValueError, r"scales \(1, 3, 5\) do not fit data"):
                jax_sm100.scaled_matmul(lhs, rhs, ones((1, 3, 5)), ones((1, 4, 0)))
        for arch in ("sm_90a", "sm_100a"):
            with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}):
                exp = jax.export.export(jax.jit(jax_sm100.scaled_matmul), platforms=["cuda"])(
                    lhs, rhs, ls, rs
                )
            self.assertNotIn("custom_call @jax_sm100", exp.mlir_module())

    def test_cuda_lowering_says_which_path(self):
        lhs = jax.ShapeDtypeStruct((1, 128, 256), jnp.float8_e4m3fn)
        rhs = jax.ShapeDtypeStruct((1, 64, 256), jnp.float8_e4m3fn)
        ls = jax.ShapeDtypeStruct((1, 128, 8), jnp.float8_e8m0fnu)
        rs = jax.ShapeDtypeStruct((1, 64, 8), jnp.float8_e8m0fnu)

        def export(*args):  # a new function each time: one lowering each
            fn = jax.jit(lambda *a: jax_sm100.scaled_matmul(*a))
            return jax.export.export(fn, platforms=["cuda"])(*args)

        with jax_sm100.lowerings() as seen:
            export(lhs, rhs, ls, rs)
        self.assertIn("XLA ops (no sm_90a/sm_100a device)", seen[-1].note)
        # On an sm_90a target, mxfp8's e8m0 scales per 32 are not the kernel's format: the
        # reason is in the plan (tests/test_sm90_scaled.py covers the kernel's path).
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            with jax_sm100.lowerings() as seen:
                export(lhs, rhs, ls, rs)
        self.assertEqual(seen[-1].plan.kernel, "xla_dot")
        self.assertIn("not float8_e8m0fnu per 32", seen[-1].note)
        self.assertEqual(seen[-1].note.count("XLA ops"), 1, seen[-1].note)  # said once

    def test_cuda_export_with_symbolic_dims(self):
        # A symbolic batch or row count runs on XLA's ops (the planner sizes from ints), and
        # the note says that, not "no plan: m=m must be a positive int".
        b, s = jax.export.symbolic_shape("b, s")
        e4m3, e8m0 = jnp.float8_e4m3fn, jnp.float8_e8m0fnu
        for batch, rows in ((b, 128), (1, s)):
            args = [jax.ShapeDtypeStruct(sh, dt) for sh, dt in (
                ((batch, rows, 256), e4m3), ((batch, 64, 256), e4m3),
                ((batch, rows, 8), e8m0), ((batch, 64, 8), e8m0))]  # fmt: skip
            for arch in ("sm_90a", "sm_100a"):
                with (
                    mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}),
                    jax_sm100.lowerings() as seen,
                ):
                    fn = jax.jit(lambda *a: jax_sm100.scaled_matmul(*a))
                    text = jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
                self.assertNotIn("custom_call @jax_sm100", text)
                self.assertIsNone(seen[-1].plan)
                self.assertIn("symbolic dims", seen[-1].note)

    @parameterized.named_parameters(
        ("rank", (64, 32), (16, 32), (64, 1), (16, 1), ValueError, "3-D.*add the batch dim"),
        ("k", (1, 8, 32), (1, 4, 64), (1, 8, 1), (1, 4, 1), ValueError, "share B and k"),
        ("block", (1, 8, 32), (1, 4, 32), (1, 8, 3), (1, 4, 1), ValueError, "block dividing"),
        ("dtype", (1, 8, 32), (1, 4, 32), (1, 8, 1), (1, 4, 1), TypeError, "int32"),
    )
    def test_errors_name_the_fix(self, ls, rs, lss, rss, error, message):
        dtype = jnp.int32 if message == "int32" else jnp.float32
        f32 = jnp.float32
        args = (jnp.ones(ls, dtype), jnp.ones(rs, f32), jnp.ones(lss, f32), jnp.ones(rss, f32))
        with self.assertRaisesRegex(error, message):
            jax_sm100.scaled_matmul(*args)
        with self.assertRaisesRegex(ValueError, "not one of"):
            jax_sm100.quantize(jnp.ones((4, 128), jnp.float32), "fp6")
        with self.assertRaisesRegex(ValueError, "multiple of the mxfp8 block.*pad it"):
            jax_sm100.quantize(jnp.ones((4, 48), jnp.float32), "mxfp8")
        with self.assertRaisesRegex(TypeError, "complex64.*real and imaginary parts apart"):
            jax_sm100.quantize(jnp.ones((4, 128), jnp.complex64), "fp8_block128")
        with self.assertRaisesRegex(ValueError, "jax_sm100.quantize: x is a scalar.*pass an array"):
            jax_sm100.quantize(jnp.float32(1.0), "fp8_block128")
        # The lowering's transposed quantization (scaled_dot_general) refuses alike: its
        # complex input lost the imaginary part, and a vector failed unpacking its shape.
        with self.assertRaisesRegex(TypeError, "complex64.*real and imaginary parts apart"):
            scaled.quantize_transposed(jnp.ones((128, 4), jnp.complex64), "fp8_block128")
        with self.assertRaisesRegex(ValueError, "1-D.*takes \\[..., k, rows\\]"):
            scaled.quantize_transposed(jnp.ones(128), "fp8_block128")

    @parameterized.parameters("float8_e8m0fnu", "float32", "bfloat16")
    def test_subnormal_scales_count(self, scale_dtype):
        # A subnormal scale (e8m0's 0x00 is 2^-127, a valid MX scale) times fp8 data is a
        # normal float32 number, and so is the product: XLA's CPU read the scale as zero, and
        # the product came out 0 (the same product with the small factor on the other side
        # was right). Forward and both data gradients, against float64.
        k = 64
        # Data of 256 to 448 times scales from 3 x 2^-134: each dequantized element normal.
        lhs = jnp.asarray(np.random.default_rng(3).uniform(256, 448, (1, 2, k)), jnp.float8_e4m3fn)
        rhs = jnp.asarray(np.random.default_rng(4).uniform(1, 2, (1, 3, k)), jnp.float8_e4m3fn)
        small = np.array([2.0**-127, 3 * 2.0**-134], np.float32).reshape(1, 2, 1)
        if scale_dtype == "float8_e8m0fnu":
            small = np.full((1, 2, 1), 2.0**-127, np.float32)
        big = np.full((1, 3, 1), 2.0**100, np.float32)
        # Converted by numpy (ml_dtypes): XLA's CPU flushes a subnormal input of its own.
        ls, rs = (jnp.asarray(x.astype(jnp.dtype(scale_dtype))) for x in (small, big))
        self.assertTrue(np.all(np.asarray(ls, np.float64) > 0))
        want = _reference64(lhs, rhs, ls, rs)
        for f in (jax_sm100.scaled_matmul, jax.jit(jax_sm100.scaled_matmul)):
            got = np.asarray(f(lhs, rhs, ls, rs))
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=scale_dtype)
        lhs32, rhs32 = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
        g_lhs, g_rhs = jax.grad(
            lambda a, b: jax_sm100.scaled_matmul(a, b, ls, rs).sum(), argnums=(0, 1)
        )(lhs32, rhs32)
        scale_l, scale_r = np.asarray(ls, np.float64), np.asarray(rs, np.float64)
        np.testing.assert_allclose(  # d/d lhs[m, k] = sl[m] * sum_n sr[n] rhs[n, k]
            g_lhs,
            scale_l * (scale_r * np.asarray(rhs32, np.float64)).sum(1, keepdims=True),
            rtol=1e-5,
        )
        np.testing.assert_allclose(
            g_rhs,
            scale_r * (scale_l * np.asarray(lhs32, np.float64)).sum(1, keepdims=True),
            rtol=1e-5,
        )
        if scale_dtype == "float32":
            # A second derivative through the subnormal scale: d/d ls of sum(d/d lhs) is
            # sum over n and k of sr[n] rhs[n, k] for each row (it was 0: the scale rebuilt
            # from its bits had no derivative).
            def g(s):
                d_lhs = jax.grad(lambda a: jax_sm100.scaled_matmul(a, rhs32, s, rs).sum())(lhs32)
                return d_lhs.sum()

            want2 = np.broadcast_to((scale_r * np.asarray(rhs32, np.float64)).sum(), (1, 2, 1))
            np.testing.assert_allclose(jax.grad(g)(ls), want2, rtol=1e-5)

            # The same through reverse mode twice, with a tiny cotangent and a huge tangent
            # (taken through a 2^64 lift they flushed to 0 and overflowed to inf).
            def h(s, r):
                return 1e-30 * jax_sm100.scaled_matmul(lhs32, rhs32, s, r).sum()

            d2 = jax.jacrev(jax.grad(h, argnums=1), argnums=0)(ls, rs)
            d2 = np.asarray(d2, np.float64).reshape(3, 2)  # [rhs row, lhs row]
            # d2 h / d rs[n] d ls[m] = 1e-30 * sum over k of lhs[m, k] rhs[n, k]
            dots = np.asarray(lhs32, np.float64)[0] @ np.asarray(rhs32, np.float64)[0].T
            want = 1e-30 * dots.T
            np.testing.assert_allclose(d2, want, rtol=1e-5)
            dr = jax.jvp(lambda s: jax.grad(h, argnums=1)(s, rs) * 1e30, (ls,),
                         (jnp.full_like(ls, 1e20),))[1]  # fmt: skip
            np.testing.assert_allclose(dr, 1e20 * want.sum(1).reshape(1, 3, 1) * 1e30, rtol=1e-5)

    @parameterized.parameters("float16", "float8_e5m2")
    def test_scale_dtypes_jax_nn_takes(self, scale_dtype):
        # Scales in any dtype jax.nn.scaled_matmul computes with (these two raised TypeError),
        # a subnormal one of the format among them (exact in float32): the documented math
        # against float64, eagerly, under jit and vmap; the scales' gradient in their dtype.
        rng = np.random.default_rng(30)
        lhs = jnp.asarray(rng.standard_normal((2, 8, 256)), jnp.float8_e4m3fn)
        rhs = jnp.asarray(rng.standard_normal((2, 4, 256)), jnp.float8_e5m2)
        tiny = float(jnp.finfo(scale_dtype).smallest_subnormal)
        ls = np.asarray(rng.uniform(0.01, 4, (2, 8, 2)).astype(scale_dtype))
        ls[0, 0, 0] = tiny
        ls = jnp.asarray(ls)
        rs = jnp.asarray(rng.uniform(0.01, 4, (2, 4, 2)).astype(scale_dtype))
        self.assertEqual(float(ls[0, 0, 0]), tiny)
        want = _reference64(lhs, rhs, ls, rs)
        for f in (jax_sm100.scaled_matmul, jax.jit(jax_sm100.scaled_matmul)):
            tu.assert_close(self, f(lhs, rhs, ls, rs), want, "float32", 256)
        # The row of the subnormal scale, on its own magnitude.
        tu.assert_close(self, jax_sm100.scaled_matmul(lhs, rhs, ls, rs)[0, 0], want[0, 0],
                        "float32", 256)  # fmt: skip
        both = jax.vmap(jax_sm100.scaled_matmul, (0, None, 0, None))(
            jnp.stack([lhs, lhs]), rhs, jnp.stack([ls, ls]), rs
        )  # fmt: skip
        tu.assert_close(self, both[1], want, "float32", 256)
        grad = jax.grad(lambda s: jax_sm100.scaled_matmul(lhs, rhs, s, rs).sum())(ls)
        self.assertEqual(grad.dtype, ls.dtype)
        want_grad = jax.grad(
            lambda s: scaled.reference(lhs, rhs, s, rs, out_dtype=jnp.float32).sum()
        )(ls.astype(jnp.float32))  # fmt: skip
        want_grad = scaled._narrow(want_grad, ls.dtype)
        np.testing.assert_array_equal(
            np.asarray(grad, np.float32), np.asarray(want_grad, np.float32)
        )

    def test_batches_and_blocks_must_match(self):
        # Operands or scales of another batch count are refused, not broadcast; blocked scales
        # made for another k (one scale over 48 elements) too.
        x, y = _normal(23, (2, 8, 256)), _normal(24, (2, 4, 256))
        for recipe in ("fp8_block128", "mxfp8"):
            a, sa = jax_sm100.quantize(x, recipe)
            b, sb = jax_sm100.quantize(y, recipe)
            with self.assertRaisesRegex(ValueError, "must share B and k"):
                jax_sm100.scaled_matmul(a, b[:1], sa, sb[:1])
            for bad in ((a, b, sa[:1], sb), (a, b, sa, sb[:1])):
                with self.assertRaisesRegex(ValueError, "must be .B, rows, k / block"):
                    jax_sm100.scaled_matmul(*bad)
        a, sa = jax_sm100.quantize(jnp.ones((1, 8, 64), jnp.float32), "mxfp8")
        with self.assertRaisesRegex(ValueError, "block dividing"):
            jax_sm100.scaled_matmul(a[..., :48], a[..., :48], sa, sa)
        # Scales of a dtype no recipe has, and float32 scales in the blocked layout.
        a, sa = jax_sm100.quantize(x, "fp8_block128")
        with self.assertRaisesRegex(TypeError, "lhs_scales has dtype int32"):
            jax_sm100.scaled_matmul(a, a, sa.astype(jnp.int32), sa)
        m, sm = jax_sm100.quantize(x, "mxfp8")
        with self.assertRaisesRegex(ValueError, "must be .B, rows, k / block"):
            jax_sm100.scaled_matmul(m, m, sm.astype(jnp.float32), sm.astype(jnp.float32))

    def test_vmap_over_inner_axes(self):
        with jax.enable_x64(False):
            lhs, rhs = _normal(25, (1, 8, 64)), _normal(26, (1, 4, 64))
            ls, rs = jnp.abs(_normal(27, (1, 8, 2))) + 0.5, jnp.abs(_normal(28, (1, 4, 2))) + 0.5
            f = jax_sm100.scaled_matmul
            ref = functools.partial(scaled.reference, out_dtype=jnp.float32)
            stacked = jnp.stack([ls, 2 * ls, 4 * ls], axis=-1)  # mapped on the scales' last axis
            out = jax.vmap(f, (None, None, 3, None))(lhs, rhs, stacked, rs)
            want = jnp.stack([ref(lhs, rhs, stacked[..., i], rs) for i in range(3)])
            tu.assert_close(self, out, want, "float32", 64)
            data = jnp.stack([rhs, -rhs, 3 * rhs], axis=2)  # rhs mapped on its rows' axis
            out = jax.vmap(f, (None, 2, None, None))(lhs, data, ls, rs)
            want = jnp.stack([ref(lhs, data[:, :, i], ls, rs) for i in range(3)])
            tu.assert_close(self, out, want, "float32", 64)

    def test_jvp_tangent_has_the_result_dtype(self):
        lhs, ls = jax_sm100.quantize(_normal(29, (1, 8, 128)), "fp8_block128")
        rhs, rs = jax_sm100.quantize(_normal(30, (1, 4, 128)), "fp8_block128")
        x = lhs.astype(jnp.float32)
        f = lambda x: jax_sm100.scaled_matmul(x, rhs, ls, rs, jnp.bfloat16)  # noqa: E731
        out, tangent = jax.jvp(f, (x,), (x,))
        self.assertEqual((out.dtype, tangent.dtype), (jnp.bfloat16, jnp.bfloat16))
        tu.assert_close(self, tangent, np.asarray(out, np.float32), "bfloat16")

    def test_data_tangents_take_the_default_precision(self):
        # The tangent of 8- or 4-bit data, rounded to its format, holds no more than TF32's 10
        # bits: its product takes JAX's default precision (on an H100 at 4096 x 7168 x 16384,
        # the gradient of both operands 37.9 -> 7.2 ms, 0.65 % of the fp8 elements one unit
        # in the last place apart); the scales' stays at HIGHEST, and the user's
        # jax_default_matmul_precision is honored.
        lhs, ls = jax_sm100.quantize(_normal(31, (1, 8, 128)), "fp8_block128")
        rhs, rs = jax_sm100.quantize(_normal(32, (1, 4, 128)), "fp8_block128")

        def precisions(argnum):
            f = jax.grad(lambda *a: jax_sm100.scaled_matmul(*a).sum(), argnum)
            found = []

            def walk(jaxpr):
                for e in jaxpr.eqns:
                    if e.primitive.name == "dot_general":
                        found.append(e.params["precision"])
                    for v in e.params.values():
                        for sub in v if isinstance(v, (tuple, list)) else (v,):
                            if isinstance(sub, jax.extend.core.ClosedJaxpr):
                                walk(sub.jaxpr)
                            elif isinstance(sub, jax.extend.core.Jaxpr):
                                walk(sub)

            walk(jax.make_jaxpr(f)(lhs, rhs, ls, rs).jaxpr)
            return found

        highest = (jax.lax.Precision.HIGHEST,) * 2
        for argnum in (0, 1):
            self.assertEqual(precisions(argnum), [None])
        self.assertEqual(precisions(2), [highest])
        with jax.default_matmul_precision("highest"):
            self.assertEqual(precisions(0), [highest])

    def test_output_dtype_is_canonicalized(self):
        lhs, ls = jax_sm100.quantize(_normal(10, (1, 8, 128)), "fp8_block128")
        rhs, rs = jax_sm100.quantize(_normal(11, (1, 4, 128)), "fp8_block128")
        with jax.enable_x64(False):  # float64 means float32, as everywhere in JAX
            out = jax.jit(jax_sm100.scaled_matmul, static_argnums=4)(lhs, rhs, ls, rs,
                                                                      jnp.float64)  # fmt: skip
            self.assertEqual(out.dtype, jnp.float32)
        for bad, message in ((None, "preferred_element_type=None"), (jnp.int32, "not one of"),
                             (jnp.float8_e8m0fnu, "not one of")):  # fmt: skip
            with self.assertRaisesRegex(TypeError, message):
                jax_sm100.scaled_matmul(lhs, rhs, ls, rs, bad)

    def test_low_precision_gradients_saturate(self):
        # d out / d lhs of fp8 (and fp4) data is rounded to the data's format: past its largest
        # finite magnitude it saturates there (a plain cast would give NaN: e4m3fn has no inf).
        for recipe in ("fp8_block128", "nvfp4"):
            lhs, ls = jax_sm100.quantize(_normal(12, (1, 16, 256)), recipe)
            rhs, rs = jax_sm100.quantize(_normal(13, (1, 8, 256)), recipe)
            ct = 1e6 * _normal(14, (1, 16, 8))
            f = lambda x, ct=ct, rhs=rhs, ls=ls, rs=rs: (  # noqa: E731
                jax_sm100.scaled_matmul(x, rhs, ls, rs) * ct
            ).sum()
            got = jax.jit(jax.grad(f))(lhs)
            self.assertEqual(got.dtype, lhs.dtype)
            got = np.asarray(got, np.float32)
            self.assertFalse(np.isnan(got).any())
            want = np.asarray(jax.grad(f)(lhs.astype(jnp.float32)))
            top = float(jnp.finfo(lhs.dtype).max)
            self.assertGreater(np.abs(want).max(), top)  # the case exercised: past the range
            np.testing.assert_array_equal(
                got, np.asarray(jnp.asarray(np.clip(want, -top, top)).astype(lhs.dtype),
                                np.float32))  # fmt: skip

    def test_nvfp4_scale_gradients(self):
        # float8_e4m3fn scales in the blocked layout: the gradient is the documented math's,
        # rounded (saturating) to e4m3 in that layout.
        lhs, ls = jax_sm100.quantize(_normal(23, (1, 8, 64)), "nvfp4")
        rhs, rs = jax_sm100.quantize(_normal(24, (1, 4, 64)), "nvfp4")
        ct = _normal(25, (1, 8, 4))
        got = jax.grad(lambda s: (jax_sm100.scaled_matmul(lhs, rhs, s, rs) * ct).sum())(ls)
        self.assertEqual((got.shape, got.dtype), (ls.shape, ls.dtype))
        plain = scale_layout.plain(lhs.shape, ls).astype(jnp.float32)
        want = jax.grad(
            lambda s: (scaled.reference(lhs, rhs, s, rs, out_dtype=jnp.float32) * ct).sum()
        )(plain)  # fmt: skip
        back = np.asarray(scale_layout.plain(lhs.shape, got), np.float32)
        np.testing.assert_array_equal(back, np.asarray(want.astype(ls.dtype), np.float32))

    def test_tile_scale_gradients_sum_rows_in_float32(self):
        # A scale per 128-row tile of a narrow dtype: its gradient sums the tile's rows in
        # float32, rounded once (saturating for fp8), as the per-row gradient is; it had summed
        # them in the scale's own dtype, each row's term rounded first (e4m3: a NaN; e5m2: 256
        # for 640 here).
        a = (0.5 + jax.random.uniform(jax.random.key(26), (1, 128, 128))).astype(
            jnp.float8_e4m3fn
        )  # fmt: skip
        b = (0.5 + jax.random.uniform(jax.random.key(27), (1, 4, 128))).astype(jnp.float8_e4m3fn)
        sb = jnp.ones((1, 4, 1), jnp.float32)
        ct = jnp.full((1, 128, 4), 0.01, jnp.float32)
        exact = np.einsum("bmn,bmk,bnk->b", *(np.asarray(x, np.float64) for x in (ct, a, b)))
        for dtype in (jnp.bfloat16, jnp.float16, jnp.float8_e5m2, jnp.float8_e4m3fn):
            tile = jnp.ones((1, 1, 1), dtype)
            got = jax.grad(lambda s: (jax_sm100.scaled_matmul(a, b, s, sb) * ct).sum())(tile)
            self.assertEqual((got.shape, got.dtype), (tile.shape, tile.dtype))
            top = float(jnp.finfo(dtype).max)
            want = jnp.asarray(np.float32(min(exact[0], top))).astype(dtype)
            self.assertEqual(float(got[0, 0, 0]), float(want), msg=np.dtype(dtype).name)

    def test_no_derivative_with_respect_to_e8m0_scales(self):
        lhs, ls = jax_sm100.quantize(_normal(15, (1, 8, 64)), "mxfp8")
        rhs, rs = jax_sm100.quantize(_normal(16, (1, 4, 64)), "mxfp8")
        with self.assertRaisesRegex(TypeError, r"stop_gradient.*plain layout \[B, rows, k / "):
            jax.grad(lambda s: jax_sm100.scaled_matmul(lhs, rhs, s, rs).sum())(ls)
        # The other fix the message names: the same scales as float32 in the plain layout.
        plain = scale_layout.plain(lhs.shape, ls).astype(jnp.float32)
        self.assertEqual(plain.shape, (1, 8, 2))
        got = jax.grad(lambda s: jax_sm100.scaled_matmul(lhs, rhs, s, rs).sum())(plain)
        want = jax.grad(
            lambda s: scaled.reference(lhs, rhs, s, rs, out_dtype=jnp.float32).sum()
        )(plain)  # fmt: skip
        tu.assert_close(self, got, want, "float32", 64)
        stopped = jax.grad(
            lambda x: jax_sm100.scaled_matmul(x, rhs, jax.lax.stop_gradient(ls), rs).sum()
        )(lhs)  # fmt: skip
        self.assertEqual(stopped.dtype, lhs.dtype)

    @parameterized.parameters(*scaled.RECIPES)
    def test_transposed_in_each_operand(self, recipe):
        # Linear in each operand with the others fixed: jax.linear_transpose, and a custom_jvp
        # whose tangent calls scaled_matmul, take its transpose (it had no rule), equal to the
        # gradient bit for bit, typed as the operand, under jit and vmap.
        lhs, ls = jax_sm100.quantize(_normal(40, (2, 8, 128)), recipe)
        rhs, rs = jax_sm100.quantize(_normal(41, (2, 4, 128)), recipe)
        ops = [lhs, rhs, ls, rs]
        ct = _normal(42, (2, 8, 4)).astype(jnp.bfloat16)
        # e8m0 scales (mxfp8) have no derivative (the error names the fix).
        linear = (0, 1) if recipe == "mxfp8" else (0, 1, 2, 3)
        for i in linear:

            def f(v, i=i):
                args = list(ops)
                args[i] = v
                return jax_sm100.scaled_matmul(*args, preferred_element_type=jnp.bfloat16)

            want = jax.vjp(f, ops[i])[1](ct)[0]
            for got in (jax.linear_transpose(f, ops[i])(ct)[0],
                        jax.jit(jax.linear_transpose(f, ops[i]))(ct)[0]):  # fmt: skip
                self.assertEqual((got.shape, got.dtype), (ops[i].shape, ops[i].dtype))
                np.testing.assert_array_equal(np.asarray(got, np.float32),
                                              np.asarray(want, np.float32))  # fmt: skip
            twice = jax.vmap(lambda c, f=f, i=i: jax.linear_transpose(f, ops[i])(c)[0])(
                jnp.stack([ct, -ct])
            )  # fmt: skip
            if ops[i].dtype == jnp.float32:
                # Batched, float32 scale gradients sum in another order: equal within rounding.
                tu.assert_close(self, twice[1], -want, "float32", 128)
            else:
                np.testing.assert_array_equal(np.asarray(twice[1], np.float32),
                                              -np.asarray(want, np.float32))  # fmt: skip
        if recipe == "mxfp8":
            with self.assertRaisesRegex(TypeError, "stop_gradient"):
                jax.linear_transpose(lambda s: jax_sm100.scaled_matmul(lhs, rhs, s, rs), ls)(
                    ct.astype(jnp.float32)
                )  # fmt: skip

        @jax.custom_jvp
        def g(x):
            return jax_sm100.scaled_matmul(x, rhs, ls, rs)

        @g.defjvp
        def _(primals, tangents):
            return g(primals[0]), jax_sm100.scaled_matmul(tangents[0], rhs, ls, rs)

        x = _normal(43, lhs.shape)
        want = jax.grad(lambda x: jnp.sin(jax_sm100.scaled_matmul(x, rhs, ls, rs)).sum())(x)
        got = jax.grad(lambda x: jnp.sin(g(x)).sum())(x)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def test_not_transposed_in_two_operands_at_once(self):
        lhs, ls = _normal(44, (1, 8, 128)), jnp.ones((1, 8, 1), jnp.float32)
        with self.assertRaisesRegex(NotImplementedError, r"one operand at a time.*'lhs', 'rhs'"):
            jax.linear_transpose(lambda x: jax_sm100.scaled_matmul(x, x, ls, ls), lhs)(
                jnp.ones((1, 8, 8), jnp.float32)
            )  # fmt: skip

    @parameterized.parameters("fp8_block128", "fp8_block128x128", "mxfp8")
    def test_e5m2_recipes(self, recipe):
        lhs, ls = jax_sm100.quantize(_normal(17, (2, 40, 256)), recipe, data_dtype=jnp.float8_e5m2)
        rhs, rs = jax_sm100.quantize(_normal(18, (2, 24, 256)), recipe, data_dtype="float8_e5m2")
        self.assertEqual((lhs.dtype, rhs.dtype), (jnp.float8_e5m2, jnp.float8_e5m2))
        out = jax_sm100.scaled_matmul(lhs, rhs, ls, rs)
        tu.assert_close(self, out, _reference64(lhs, rhs, ls, rs), "float32", 256)
        back = np.asarray(scaled._dequantized(rhs, rs))
        x = np.asarray(_normal(18, (2, 24, 256)))
        # e5m2 has 2 mantissa bits: half a unit in the last place at the top binade is 2^-3,
        # twice that for mxfp8's power-of-two scales.
        tol = 2**-2 if recipe == "mxfp8" else 2**-3
        self.assertLessEqual(np.abs(back - x).max(), tol * np.abs(x).max())
        with self.assertRaisesRegex(TypeError, "not int8"):
            jax_sm100.quantize(x, recipe, data_dtype=jnp.int8)

    @parameterized.parameters((1.0, 1.0), (1e5, 1e5), (1e-5, 1e-5), (1e-17, 1e-17), (1e-37, 1e30))
    def test_nvfp4_global_scale(self, magnitude, other):
        # Blocks past 6 x 448 (or under 6 x 2^-9) do not fit nvfp4's e4m3 scales alone; with a
        # per-tensor float32 scale the product is as accurate at every magnitude.
        a, b = _normal(19, (1, 32, 128)) * magnitude, _normal(20, (1, 16, 128)) * other
        lhs, ls, ga = jax_sm100.quantize(a, "nvfp4", global_scale=True)
        rhs, rs, gb = jax_sm100.quantize(b, "nvfp4", global_scale=True)
        self.assertEqual((ga.shape, ga.dtype), ((), jnp.float32))
        # Tensors under ~3.2e-35 had a global scale of zero (its subnormal quotient flushed),
        # so NaN scales (review helper-114); `ga * gb` alone underflows under ~1e-16.
        out = np.asarray(jax_sm100.scaled_matmul(lhs, rhs, ls, rs) * ga * gb, np.float64)
        exact = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64).transpose(0, 2, 1))
        # e2m1's 1 mantissa bit: a relative error of the product's scale near 2^-2 (the
        # unit-magnitude case reads ~0.15).
        self.assertLess(np.abs(out - exact).max(), 0.25 * np.abs(exact).max())
        with self.assertRaisesRegex(ValueError, "global_scale is for nvfp4"):
            jax_sm100.quantize(a, "mxfp8", global_scale=True)

    def test_plan_of_a_scaled_problem(self):
        f8 = jnp.float8_e4m3fn
        common = dict(m=1024, n=1024, a_dtype=f8, b_dtype=f8)
        # B defaults to K-major, as scaled_matmul's rhs [n, k] is.
        p = jax_sm100.plan(k=1024, scale_dtype=jnp.float32, scale_block=128, arch="sm_90a",
                           **common)  # fmt: skip
        self.assertEqual((p.b_major, p.kernel), ("k", "sm90_wgmma_scaled"))
        for arch, dtype, block in (("sm_90a", jnp.float32, 128),
                                   ("sm_100a", jnp.float8_e8m0fnu, 32)):  # fmt: skip
            with self.assertRaisesRegex(jax_sm100.PlanError, "dividing k=1000"):
                jax_sm100.plan(k=1000, scale_dtype=dtype, scale_block=block, arch=arch, **common)
        with self.assertRaisesRegex(jax_sm100.PlanError, "without a scale_dtype"):
            jax_sm100.plan(k=1024, scale_block=32, arch="sm_90a", **common)
        # nvfp4 on sm_90a: no kernel takes fp4 data there; the plan says XLA and why.
        p = jax_sm100.plan(1024, 1024, 1024, a_dtype=jnp.float4_e2m1fn,
                           b_dtype=jnp.float4_e2m1fn, scale_dtype=jnp.float8_e4m3fn,
                           scale_block=16, arch="sm_90a")  # fmt: skip
        self.assertEqual(p.kernel, "xla_dot")
        self.assertIn("float4_e2m1fn", p.reason)
        # An N-major B ([k, n]) plans XLA on sm_100a too; scales and groups do not combine.
        p = jax_sm100.plan(k=1024, scale_dtype=jnp.float8_e8m0fnu, scale_block=32,
                           arch="sm_100a", b_major="n", **common)  # fmt: skip
        self.assertEqual(p.kernel, "xla_dot")
        with self.assertRaisesRegex(jax_sm100.PlanError, "no block-scaled grouped"):
            jax_sm100.plan(k=1024, scale_dtype=jnp.float32, scale_block=128, arch="sm_90a",
                           groups=4, ragged="m", **common)  # fmt: skip


if __name__ == "__main__":
    absltest.main()
