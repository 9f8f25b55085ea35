"""GPU tests of the SM90 block-scaled kernel (kernels/sm90_scaled.py) through
`jax_sm100.scaled_matmul`; skipped without an SM90 device.

Every case: normally distributed data whose magnitude changes by up to 2^+-6 from one row (of
lhs and of rhs) and from one 128-block of k to the next, quantized to fp8 with float32 scales per
128 of k; the kernel's output against the float64 product of the dequantized operands. The
changing magnitudes make every scale matter: the same data with its scales ignored, or with
B's scales ignored, is checked to miss the reference by far more than the tolerance. Integer
data with power-of-two scales, which the fp8 MMA sums exactly, must come out exactly right.

A float32 result of an fp8 product is checked to the fp8 MMA's accuracy (`FP8_MMA_RTOL`), not
float32's. float16 cases scale lhs by a power of two where the product would overflow it
(`_in_range`).

The correctness tests run twice: on the default main loop and on the overlapped one
(`GemmPlan.scaled_overlap`, JAX_SM100_SCALED_OVERLAP=1: each k-block promoted under the next
one's MMAs), whose k-block counts are chosen to cover its loop's paths (1; odd and even counts
with and without a whole trip of its two-k-block loop; stream-K's uneven shares).
"""

from __future__ import annotations

import functools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_sm100
from jax_sm100._src import dispatch, planning
from jax_sm100._src.planning import sm90_scaled as scaled_planning
from tests import test_util as tu
from tests.test_scaled import _reference64

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2

# The kernel's outputs.
OUT_DTYPES = [jnp.bfloat16, jnp.float32, jnp.float16]

# Hopper's fp8 wgmma accumulates in 13 mantissa bits, truncating each k32 instruction's aligned
# products and sum (the DeepSeek-V3 report, 3.5.2); the kernel promotes each 128-k block's sum
# into float32 accumulators, as DeepGEMM does. So a float32 result of an fp8 product is
# that accurate, not float32's RTOL (2e-5), which the ninth session's H200 run missed by 2-8x in
# every float32 case; benchmarks/scaled_accuracy.py emulates 1-16x on these cases. 2^-10 is 8
# units of the 13-bit mantissa: 6x the worst of that run, and 400x below an element misplaced.
FP8_MMA_RTOL = 2.0**-10


def _arch():
    try:
        return getattr(dispatch.device_target(), "arch", None)
    except Exception:
        return None


def _quantize(x, dtype):
    """(data, float32 scales per 128 of the last dim): `jax_sm100.quantize(x, "fp8_block128")`
    for e4m3, the same rule (block max onto the format's largest value) for e5m2."""
    if dtype == E4M3:
        return jax_sm100.quantize(x, "fp8_block128")
    blocks = x.reshape(*x.shape[:-1], -1, 128)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0).astype(jnp.float32)
    data = (blocks / scale[..., None]).reshape(x.shape).astype(dtype)
    return data, scale


def _operand(key, batch, rows, k):
    """Normal data times 2^e, e drawn per row and per (row, 128-block of k) in [-6, 6]."""
    kd, kr, kb = jax.random.split(key, 3)
    x = jax.random.normal(kd, (batch, rows, k), jnp.float32)
    per_row = jax.random.randint(kr, (batch, rows, 1), -3, 4).astype(jnp.float32)
    per_block = jax.random.randint(kb, (batch, rows, k // 128), -3, 4).astype(jnp.float32)
    return x * jnp.exp2(per_row + jnp.repeat(per_block, 128, axis=-1))


def _in_range(lhs, rhs, ls, rs, out_dtype):
    """`ls`, divided by a power of two where the product would overflow a float16 result (whose
    largest value is 65504): only the product's exponent moves, not its digits."""
    if jnp.dtype(out_dtype) != jnp.float16:
        return ls
    peak = float(np.max(np.abs(_reference64(lhs, rhs, ls, rs))))
    return ls * 2.0 ** -max(0, int(np.ceil(np.log2(peak / 2.0**13))))


def _rtol(out_dtype):
    return max(tu.RTOL[jnp.dtype(out_dtype).name], FP8_MMA_RTOL)


def _assert_close(test, got, want, out_dtype, k):
    """`tu.assert_close` with the fp8 MMA's tolerance where the output's own is tighter."""
    got, want = np.asarray(got).astype(np.float64), np.asarray(want, np.float64)
    test.assertEqual(got.shape, want.shape)
    tol = _rtol(out_dtype) * max(np.max(np.abs(want)), 1e-6) * (1 + np.log2(max(k, 1)) / 8)
    err = np.max(np.abs(got - want))
    test.assertLessEqual(err, tol, f"max abs error {err:.3g} > {tol:.3g} ({out_dtype})")


def _integer_operand(key, batch, rows, k, dtype):
    """Integers in [-4, 4] (exact in e4m3 and e5m2) and power-of-two scales 2^0 .. 2^3 per 128
    of k: each k32 wgmma's products and sums (|sum| <= 2^11 per 128-k block) are integers the
    13-bit accumulator holds exactly, and the promoted float32 sums (<= 2^22 for k <= 4096) are
    integers float32 holds exactly, so the kernel's result is exactly the float64 product."""
    kd, ks = jax.random.split(key)
    data = jax.random.randint(kd, (batch, rows, k), -4, 5).astype(jnp.float32).astype(dtype)
    scales = jnp.exp2(jax.random.randint(ks, (batch, rows, k // 128), 0, 4).astype(jnp.float32))
    return data, scales


def _integer_tiled_operands(seed, n=392, m=600, batch=1):
    """(lhs, rhs, lhs scales, rhs scales) of batch x m x n x 512 integer data
    (`_integer_operand`), the rhs scaled per 128 x 128 tile by powers of two: the kernel's
    result is exact."""
    k = 512
    ka, kb, ks = jax.random.split(jax.random.key(seed), 3)
    lhs, ls = _integer_operand(ka, batch, m, k, E4M3)
    rhs, _ = _integer_operand(kb, batch, n, k, E4M3)
    tiles = -(-n // 128)
    rs = jnp.exp2(jax.random.randint(ks, (batch, tiles, k // 128), 0, 4).astype(jnp.float32))
    return lhs, rhs, ls, rs


def _run(lhs, rhs, ls, rs, out_dtype, overlap=False):
    """The product on the planner's kernel, lowered with JAX_SM100_SCALED_OVERLAP=`overlap`."""
    fn = jax.jit(lambda *a: jax_sm100.scaled_matmul(*a, preferred_element_type=out_dtype))
    env = {scaled_planning.OVERLAP_ENV: "1" if overlap else "0"}
    with mock.patch.dict(os.environ, env), jax_sm100.lowerings() as seen:
        out = fn(lhs, rhs, ls, rs)
    return out, seen


def _run_256_rows(lhs, rhs, ls, rs, out_dtype, tile_mn=(256, 128), overlap=False, **edits):
    """The product on the kernel in 256 x 128 tiles (or `tile_mn`, on the overlapped loop with
    `overlap`; other plan `edits` for `sm90_variant`, e.g. stream_k), forced (B scaled per
    128 x 128 tile, or per row when `rs` has a row of scales per row of `rhs`), through the
    lowering's own kernel call."""
    from jax_sm100._src import scaled_gpu  # noqa: PLC0415

    batch, m, k = lhs.shape
    n = rhs.shape[1]
    plan = jax_sm100.plan(m, n, k, a_dtype=lhs.dtype, b_dtype=rhs.dtype, out_dtype=out_dtype,
                          b_major="k", batch=batch, scale_dtype="float32", scale_block=128,
                          b_scale_rows=1 if rs.shape[1] == n else 128,
                          arch="sm_90a")  # fmt: skip
    plan = planning.sm90_variant(plan, tile_mn=tile_mn, scaled_overlap=overlap, **edits)
    assert plan.kernel == planning.KERNEL_SM90_SCALED, plan
    return jax.jit(lambda *a: scaled_gpu._call_sm90(plan, *a))(lhs, rhs, ls, rs)


def _cases(shapes):
    """Each shape x data dtype x output dtype x main loop, named for `pytest -k`: e.g.
    `..._1x128x128x128_float8_e4m3fn_bfloat16_overlap` (or `_default`)."""
    return [
        dict(testcase_name="_" + "_".join(("x".join(map(str, shape)), jnp.dtype(dtype).name,
                                           jnp.dtype(out).name, loop)),
             shape=shape, dtype=dtype, out_dtype=out, overlap=loop == "overlap")
        for shape in shapes
        for dtype in (E4M3, E5M2)
        for out in OUT_DTYPES
        for loop in ("default", "overlap")
    ]  # fmt: skip


@absltest.skipIf(_arch() != "sm_90a", "needs an SM90 (Hopper) CUDA device and jax[cuda]")
class GpuScaledTest(parameterized.TestCase):
    def assert_on_kernel(self, seen, overlap=False):
        """One lowering, on the block-scaled kernel, its main loop overlapped or not (None:
        as the planner chose)."""
        self.assertLen(seen, 1)
        self.assertEqual(seen[0].plan.kernel, planning.KERNEL_SM90_SCALED, seen[0].note)
        if overlap is not None:
            self.assertEqual(seen[0].plan.scaled_overlap, overlap)
        # (tests/test_sm90_scaled.py `test_plans_the_gpu_suite_asserts` checks this plan and
        # test_stream_k's on CPU.)
        if seen[0].plan.m == 2000 and seen[0].plan.b_scale_rows == 1 and not overlap:
            self.assertEqual(seen[0].plan.cta_tile_mnk, (128, 192, 128))

    @parameterized.named_parameters(
        _cases([
            (1, 128, 128, 128),  # one tile, one k-block
            (1, 200, 136, 384),  # m and n ragged against the 128 x 128 tile
            (1, 1000, 520, 1024),
            (3, 256, 384, 512),  # batched: one scale set per batch
            (1, 128, 7168, 2048),  # skinny, a row of tiles (issue 19's decode-like shape)
            (1, 2048, 2048, 4096),  # 256 x 128 tiles (the default loop)
            (1, 2000, 3008, 384),  # 128 x 192 tiles (the default loop), m and n ragged
        ])
    )  # fmt: skip
    def test_matches_float64(self, shape, dtype, out_dtype, overlap):
        batch, m, n, k = shape
        ka, kb = jax.random.split(jax.random.key(m * n + k + batch))
        lhs, ls = _quantize(_operand(ka, batch, m, k), dtype)
        rhs, rs = _quantize(_operand(kb, batch, n, k), dtype)
        ls = _in_range(lhs, rhs, ls, rs, out_dtype)
        out, seen = _run(lhs, rhs, ls, rs, out_dtype, overlap)
        self.assert_on_kernel(seen, overlap)
        self.assertEqual((out.shape, out.dtype), ((batch, m, n), jnp.dtype(out_dtype)))
        want = _reference64(lhs, rhs, ls, rs)
        _assert_close(self, out, want, out_dtype, k)
        # The test can fail: without the scales, or without B's, the product (its first rows)
        # misses by far more than the tolerance.
        rows = slice(0, 64)
        a, sa = lhs[:, rows], ls[:, rows]
        for wrong in (_reference64(a, rhs, np.ones(sa.shape), np.ones(rs.shape)),
                      _reference64(a, rhs, sa, np.ones(rs.shape))):  # fmt: skip
            err = np.max(np.abs(wrong - want[:, rows])) / np.max(np.abs(want[:, rows]))
            self.assertGreater(err, 50 * _rtol(out_dtype))

    @parameterized.named_parameters(
        _cases([
            (1, 128, 128, 128),
            (1, 200, 136, 384),
            (3, 256, 384, 512),
            (1, 1000, 520, 1024),
            (1, 128, 7168, 2048),
            (1, 2048, 2048, 4096),
            (1, 8192, 2176, 512),  # 128 x 192 tiles, n ragged (stream-K when overlapped)
            (1, 256, 384, 640),  # 5 k-blocks: two trips of the overlapped loop, an odd tail
            (1, 2000, 3008, 384),  # 128 x 192 tiles: scales read during the promotion
        ])
    )  # fmt: skip
    def test_exact_on_integer_data(self, shape, dtype, out_dtype, overlap):
        # Data the fp8 MMA sums exactly (`_integer_operand`): every element must be the float64
        # product rounded once to the output type, so a misplaced, dropped or doubled element,
        # k-block or scale shows here whatever the output type, with no tolerance to hide in.
        batch, m, n, k = shape
        ka, kb = jax.random.split(jax.random.key(7 * m + n + k + batch))
        lhs, ls = _integer_operand(ka, batch, m, k, dtype)
        rhs, rs = _integer_operand(kb, batch, n, k, dtype)
        out, seen = _run(lhs, rhs, ls, rs, out_dtype, overlap)
        self.assert_on_kernel(seen, overlap)
        want = _reference64(lhs, rhs, ls, rs)
        self.assertLess(np.max(np.abs(want)), 2.0**24)
        want = want.astype(np.float32).astype(out_dtype).astype(np.float64)
        got = np.asarray(out).astype(np.float64)
        wrong = np.argwhere(got != want)
        first = [(tuple(int(x) for x in i), got[tuple(i)], want[tuple(i)]) for i in wrong[:4]]
        self.assertEqual(len(wrong), 0, f"{len(wrong)} of {got.size} wrong, e.g. "
                         f"(batch, row, col), got, want: {first}")  # fmt: skip

    @parameterized.named_parameters(
        (f"_{jnp.dtype(out).name}_{loop}", out, loop == "overlap")
        for out in OUT_DTYPES
        for loop in ("default", "overlap")
    )
    def test_stream_k(self, out_dtype, overlap):
        # 128 x 192 tiles (default loop) or 128 x 128 (overlapped) that do not divide into
        # waves on 132 SMs: the last waves' tiles are shared out by k-blocks between clusters,
        # which meet in the workspace.
        m, n, k = 7168, 3840, 512
        ka, kb = jax.random.split(jax.random.key(11))
        lhs, ls = jax_sm100.quantize(_operand(ka, 1, m, k), "fp8_block128")
        rhs, rs = jax_sm100.quantize(_operand(kb, 1, n, k), "fp8_block128")
        ls = _in_range(lhs, rhs, ls, rs, out_dtype)
        out, seen = _run(lhs, rhs, ls, rs, out_dtype, overlap)
        self.assert_on_kernel(seen, overlap)
        self.assertTrue(seen[0].plan.stream_k, seen[0].plan)
        _assert_close(self, out, _reference64(lhs, rhs, ls, rs), out_dtype, k)

    @parameterized.parameters(*[(d,) for d in OUT_DTYPES])
    def test_weight_blocks_of_128x128(self, out_dtype):
        # DeepSeek-V3 quantizes weights per 128 x 128 block: one scale for 128 rows of rhs,
        # here passed repeated per row (the per-row path; test_weights_per_128x128_tile passes
        # the tiles' scales themselves).
        m, n, k = 512, 640, 1024
        ka, kb = jax.random.split(jax.random.key(3))
        lhs, ls = jax_sm100.quantize(_operand(ka, 1, m, k), "fp8_block128")
        w = _operand(kb, 1, n, k).reshape(1, n // 128, 128, k // 128, 128)
        amax = jnp.max(jnp.abs(w), axis=(2, 4))
        block_scale = amax / float(jnp.finfo(E4M3).max)
        rhs = (w / block_scale[:, :, None, :, None]).reshape(1, n, k).astype(E4M3)
        rs = jnp.repeat(block_scale, 128, axis=1)  # [1, n, k / 128]
        ls = _in_range(lhs, rhs, ls, rs, out_dtype)
        out, seen = _run(lhs, rhs, ls, rs, out_dtype)
        self.assert_on_kernel(seen)
        _assert_close(self, out, _reference64(lhs, rhs, ls, rs), out_dtype, k)

    @parameterized.named_parameters(
        (f"_{'x'.join(map(str, shape))}_{jnp.dtype(out).name}_{loop}", shape, out, loop)
        for shape in ((1, 2000, 3008, 384), (1, 128, 7168, 2048), (1, 1000, 520, 1024),
                      (3, 256, 384, 512), (1, 8192, 2176, 512), (1, 8192, 4352, 512))
        for out in OUT_DTYPES
        for loop in ("planner", "default", "overlap")
    )  # fmt: skip
    def test_weights_per_128x128_tile(self, shape, out_dtype, loop):
        # rhs scaled per 128 x 128 tile ([B, ceil(n / 128), k / 128], `quantize`'s
        # "fp8_block128x128"): the kernel reads one B scale per tile and k-block (its tiles of
        # 128 or 64 columns lie within one scale tile). n = 520: the last tile of 8 rows;
        # 8192x2176x512: stream-K on the overlapped loop's 128 x 128 tiles; 8192x4352x512: the
        # planner's 256 x 128 tiles with stream-K (8 tiles a CTA).
        batch, m, n, k = shape
        ka, kb = jax.random.split(jax.random.key(n + k))
        lhs, ls = jax_sm100.quantize(_operand(ka, batch, m, k), "fp8_block128")
        rhs, rs = jax_sm100.quantize(_operand(kb, batch, n, k), "fp8_block128x128")
        self.assertEqual(rs.shape, (batch, -(-n // 128), k // 128))
        ls = _in_range(lhs, rhs, ls, rs, out_dtype)
        if loop == "planner":
            fn = jax.jit(lambda *a: jax_sm100.scaled_matmul(*a, preferred_element_type=out_dtype))
            with jax_sm100.lowerings() as seen:
                out = fn(lhs, rhs, ls, rs)
        else:
            out, seen = _run(lhs, rhs, ls, rs, out_dtype, loop == "overlap")
            self.assert_on_kernel(seen, loop == "overlap")
        self.assertEqual((seen[0].plan.kernel, seen[0].plan.b_scale_rows),
                         (planning.KERNEL_SM90_SCALED, 128))  # fmt: skip
        _assert_close(self, out, _reference64(lhs, rhs, ls, rs), out_dtype, k)

    @parameterized.parameters(*[(d,) for d in OUT_DTYPES])
    def test_weights_per_128x128_tile_exact_on_integer_data(self, out_dtype):
        # Integer data, power-of-two scales per tile (`_integer_operand`): exactly the float64
        # product rounded once, so a B scale of the wrong tile or k-block shows.
        lhs, rhs, ls, rs = _integer_tiled_operands(13)
        for overlap in (False, True):
            out, seen = _run(lhs, rhs, ls, rs, out_dtype, overlap)
            self.assert_on_kernel(seen, overlap)
            self.assertEqual(seen[0].plan.b_scale_rows, 128)
            want = (
                _reference64(lhs, rhs, ls, rs)
                .astype(np.float32)
                .astype(out_dtype)
                .astype(np.float64)
            )
            np.testing.assert_array_equal(np.asarray(out).astype(np.float64), want)

    @parameterized.parameters(1, 128)
    def test_subnormal_scales_exact(self, b_rows):
        # A's scales subnormal (2^-130 to 2^-127, as an e8m0 0x00 is), B's 2^100: the kernel
        # multiplies the two first, a normal float32 number, so integer data gives the float64
        # product exactly (the CPU path flushed such scales to zero before its fix).
        if b_rows == 1:
            lhs, ls = _integer_operand(jax.random.key(21), 1, 300, 512, E4M3)
            rhs, rs = _integer_operand(jax.random.key(22), 1, 200, 512, E4M3)
        else:
            lhs, rhs, ls, rs = _integer_tiled_operands(23)
        ls = jnp.asarray(np.asarray(ls, np.float32) * np.float32(2.0**-130))
        rs = jnp.asarray(np.asarray(rs, np.float32) * np.float32(2.0**100))
        self.assertTrue(np.all(np.asarray(ls) < np.finfo(np.float32).tiny))
        out, seen = _run(lhs, rhs, ls, rs, jnp.float32)
        self.assert_on_kernel(seen, None)
        self.assertEqual(seen[0].plan.b_scale_rows, b_rows)
        want = _reference64(lhs, rhs, ls, rs)
        self.assertTrue(np.any(want != 0))
        np.testing.assert_array_equal(np.asarray(out, np.float64), want.astype(np.float32))

    @parameterized.parameters(("bfloat16", 1), ("float16", 128), ("float8_e8m0fnu", 1),
                              ("float8_e5m2", 128))  # fmt: skip
    def test_scales_of_other_dtypes_exact(self, scale_dtype, b_rows):
        # Power-of-two scales in another dtype (each exact in float32) run on the kernel
        # converted to float32: integer data gives the float64 product exactly.
        if b_rows == 1:
            lhs, ls = _integer_operand(jax.random.key(24), 1, 300, 512, E4M3)
            rhs, rs = _integer_operand(jax.random.key(25), 1, 200, 512, E4M3)
        else:
            lhs, rhs, ls, rs = _integer_tiled_operands(26)
        ls, rs = ls.astype(scale_dtype), rs.astype(scale_dtype)
        out, seen = _run(lhs, rhs, ls, rs, jnp.float32)
        self.assert_on_kernel(seen, None)
        self.assertIn(f"{scale_dtype} scales converted to float32", seen[0].note)
        self.assertEqual(seen[0].plan.b_scale_rows, b_rows)
        want = _reference64(lhs, rhs, ls, rs)
        np.testing.assert_array_equal(np.asarray(out, np.float64), want.astype(np.float32))

    @parameterized.parameters(((256, 128), False), ((128, 128), False), ((128, 128), True),
                              ((128, 64), False), ((128, 64), True))  # fmt: skip
    def test_weight_tiles_of_every_window_exact(self, tile_mn, overlap):
        # The kernel takes B's scales per tile compact and loads a k-block's scales of 4 tiles
        # a stage (sm90_scaled._B_TILE_WINDOW), reading its own tile's: 1160 rows of rhs are 10
        # scale tiles, so tiles at every place in a window and a last window partly past the
        # scales. Integer data, power-of-two scales: a wrong tile's scale shows exactly.
        lhs, rhs, ls, rs = _integer_tiled_operands(23, n=1160)
        out = _run_256_rows(lhs, rhs, ls, rs, jnp.float32, tile_mn, overlap)
        want = _reference64(lhs, rhs, ls, rs).astype(np.float32).astype(np.float64)
        np.testing.assert_array_equal(np.asarray(out).astype(np.float64), want)

    @parameterized.parameters(False, True)
    def test_weight_tiles_batched_exact(self, stream_k):
        # The same with 2 batches (each its own tiles' scales) of 4096 rows: 80 cluster tiles of
        # 256 x 128 for 66 clusters, so with stream-K every tile's k-blocks are shared out
        # between clusters, each segment reading its k-blocks' window.
        lhs, rhs, ls, rs = _integer_tiled_operands(29, n=1160, m=4096, batch=2)
        out = _run_256_rows(lhs, rhs, ls, rs, jnp.float32, stream_k=stream_k)
        want = _reference64(lhs, rhs, ls, rs).astype(np.float32).astype(np.float64)
        np.testing.assert_array_equal(np.asarray(out).astype(np.float64), want)

    @parameterized.named_parameters(
        (f"_{w}_{'x'.join(map(str, shape))}_{jnp.dtype(out).name}", shape, out, w)
        for w in ("weights_per_128x128_tile", "per_row_scales")
        for shape in ((1, 2000, 3008, 384), (1, 1000, 520, 1024), (3, 256, 384, 512),
                      (1, 8192, 2176, 512), (1, 8192, 4352, 512), (1, 300, 128, 128),
                      (1, 8192, 4096, 512), (1, 9216, 4096, 512), (1, 4096, 4352, 1664),
                      (1, 8192, 4352, 2048))
        for out in OUT_DTYPES
    )  # fmt: skip
    def test_in_256_row_tiles(self, shape, out_dtype, w):
        # The 256 x 128 tiles (each warp group's 128 rows in two 64-row waves through one
        # fragment, kernels/sm90_scaled.py `_mainloop_waves`; the planner's for large problems),
        # forced, with B scaled per 128 x 128 tile or per row (jax.nn.scaled_matmul's: each
        # wave's promotion reads its column scales from the stage, released after it). 1000
        # rows: a last tile of 232, its second wave partly outside; 8192x4352x512: stream-K;
        # 8192x4096x512: the raster in bands of 8 cluster columns; 9216x4096x512: both;
        # 4096x4352x1664: 13 k-tiles, so a CTA's tiles start at every stage of the 4-stage ring
        # (sm90_scaled._STATIC_RINGS's rings entered after and left before single k-tiles);
        # 8192x4352x2048: stream-K segments long enough for such rings.
        batch, m, n, k = shape
        per_row = w == "per_row_scales"
        ka, kb = jax.random.split(jax.random.key(m + (2 if per_row else 1) * n + k))
        lhs, ls = jax_sm100.quantize(_operand(ka, batch, m, k), "fp8_block128")
        recipe = "fp8_block128" if per_row else "fp8_block128x128"
        rhs, rs = jax_sm100.quantize(_operand(kb, batch, n, k), recipe)
        ls = _in_range(lhs, rhs, ls, rs, out_dtype)
        out = _run_256_rows(lhs, rhs, ls, rs, out_dtype)
        _assert_close(self, out, _reference64(lhs, rhs, ls, rs), out_dtype, k)

    def test_256_row_tiles_exact_on_integer_data(self):
        lhs, rhs, ls, rs = _integer_tiled_operands(17)
        out = _run_256_rows(lhs, rhs, ls, rs, jnp.float32)
        want = _reference64(lhs, rhs, ls, rs).astype(np.float32).astype(np.float64)
        np.testing.assert_array_equal(np.asarray(out).astype(np.float64), want)
        # Per-row B scales (powers of two per row and k-block): exact too.
        ka, kb = jax.random.split(jax.random.key(19))
        lhs, ls = _integer_operand(ka, 1, 600, 512, E4M3)
        rhs, rs = _integer_operand(kb, 1, 392, 512, E4M3)
        out = _run_256_rows(lhs, rhs, ls, rs, jnp.float32)
        want = _reference64(lhs, rhs, ls, rs).astype(np.float32).astype(np.float64)
        np.testing.assert_array_equal(np.asarray(out).astype(np.float64), want)

    def test_agrees_with_jax_nn_scaled_matmul(self):
        m, n, k = 1024, 1024, 2048
        ka, kb = jax.random.split(jax.random.key(5))
        lhs, ls = jax_sm100.quantize(_operand(ka, 1, m, k), "fp8_block128")
        rhs, rs = jax_sm100.quantize(_operand(kb, 1, n, k), "fp8_block128")
        out, seen = _run(lhs, rhs, ls, rs, jnp.bfloat16)
        self.assert_on_kernel(seen)
        theirs = jax.jit(lambda *a: jax.nn.scaled_matmul(*a, preferred_element_type=jnp.bfloat16))
        tu.assert_close(self, out, theirs(lhs, rhs, ls, rs), "bfloat16", k)

    def test_vmap_with_shared_weights(self):
        # Per-example activations against one weight that the vmap leaves unmapped: one
        # product on the kernel with the examples as rows, against the per-example float64
        # products. lhs scaled per row (200 rows an example) and per 128-row tile (256 rows:
        # whole tiles, reshaped as they are); weights per 128 x 128 tile and per row.
        v, n, k = 3, 392, 512
        cases = ((200, "fp8_block128", "fp8_block128x128"),
                 (256, "fp8_block128x128", "fp8_block128"))  # fmt: skip
        for m, lhs_recipe, rhs_recipe in cases:
            ka, kb = jax.random.split(jax.random.key(m))
            lhs, ls = jax_sm100.quantize(_operand(ka, v, m, k)[:, None], lhs_recipe)
            rhs, rs = jax_sm100.quantize(_operand(kb, 1, n, k), rhs_recipe)
            fn = jax.jit(jax.vmap(functools.partial(jax_sm100.scaled_matmul,
                                                    preferred_element_type=jnp.float32),
                                  (0, None, 0, None)))  # fmt: skip
            with jax_sm100.lowerings() as seen:
                out = fn(lhs, rhs, ls, rs)
            # The planner overlaps the promotions on the weights' 128 x 128 tiles (README).
            self.assert_on_kernel(seen, overlap=None)
            self.assertEqual((seen[0].plan.m, seen[0].plan.batch), (v * m, 1))
            want = np.stack([_reference64(lhs[i], rhs, ls[i], rs) for i in range(v)])
            _assert_close(self, out, want, jnp.float32, k)

    def test_gradient_of_the_scales(self):
        # The forward on the kernel, the tangents through the documented math in XLA ops.
        m, n, k = 256, 256, 512
        ka, kb = jax.random.split(jax.random.key(9))
        lhs, ls = jax_sm100.quantize(_operand(ka, 1, m, k), "fp8_block128")
        rhs, rs = jax_sm100.quantize(_operand(kb, 1, n, k), "fp8_block128")

        def loss(f, ls, rs):
            out = f(lhs, rhs, ls, rs, preferred_element_type=jnp.bfloat16)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        ours = jax.jit(jax.grad(lambda a, b: loss(jax_sm100.scaled_matmul, a, b), (0, 1)))
        with jax_sm100.lowerings() as seen:
            got = ours(ls, rs)
        self.assertIn(planning.KERNEL_SM90_SCALED, [x.plan.kernel for x in seen if x.plan])

        def reference(lhs, rhs, ls, rs, preferred_element_type):
            from jax_sm100._src import scaled  # noqa: PLC0415

            return scaled.reference(lhs, rhs, ls, rs, out_dtype=preferred_element_type)

        want = jax.jit(jax.grad(lambda a, b: loss(reference, a, b), (0, 1)))(ls, rs)
        for g, w in zip(got, want, strict=True):
            tu.assert_close(self, g, w, "bfloat16", k)

    @parameterized.parameters(
        (jnp.bfloat16, 512, 1024, 768), (jnp.float32, 512, 1024, 768), (jnp.bfloat16, 200, 96, 136)
    )
    def test_scaled_dot_general_training_products(self, dtype, m, k, n):
        # jax_sm100.scaled_dot_general's forward and both gradients (DeepSeek-V3's recipe) each
        # on the kernel, against the float64 products of the same quantized operands
        # (tests/test_scaled_dot.py `_expected`); 200 x 96 x 136 pads every contraction.
        from tests import test_scaled_dot  # noqa: PLC0415

        keys = jax.random.split(jax.random.key(m + k + n), 3)
        if k % 128:
            x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
            w = jax.random.normal(keys[1], (k, n), jnp.float32).astype(dtype)
        else:
            x = _operand(keys[0], 1, m, k)[0].astype(dtype)
            w = _operand(keys[1], 1, n, k)[0].T.astype(dtype)
        g = jax.random.normal(keys[2], (m, n), jnp.float32)
        dn = (((1,), (0,)), ((), ()))
        step = jax.jit(functools.partial(test_scaled_dot._vjp, dn=dn,
                                         configs=jax_sm100.DEEPSEEK_V3))  # fmt: skip
        with jax_sm100.lowerings() as seen:
            y, dl, dr = step(x, w, g=g)
        products = [lw.plan.kernel for lw in seen
                    if lw.plan is not None and not lw.note.startswith("quantize_both")]  # fmt: skip
        self.assertEqual(products, [planning.KERNEL_SM90_SCALED] * 3, [lw.note for lw in seen])
        # x and w (forward) and the cotangent (backward) each quantized both ways in one kernel
        # pass where their dims are whole 128-blocks.
        quantized = [lw.plan.kernel for lw in seen if lw.note.startswith("quantize_both")]
        self.assertEqual(quantized, [] if k % 128 else ["quantize_both"] * 3, quantized)
        self.assertEqual((dl.dtype, dr.dtype), (dtype, dtype))
        padded = lambda a: np.pad(np.asarray(a, np.float32),  # noqa: E731
                                  [(0, -s % 128) for s in a.shape])  # fmt: skip

        # Operands of whole 128-blocks (x, w and the cotangent) are quantized by the quantize_both
        # kernel in the step: the reference quantizes them so too (its data is the correctly
        # rounded quotient's, which XLA's division, div.full, misses by one fp8 unit in a few
        # elements: a float32 case's gradient then missed the float64 product by 13.6 against
        # a bound of 3.1, H100). The kernel is checked against the exact quotient apart
        # (GpuQuantizeBothTest).
        whole = not (m % 128 or k % 128 or n % 128)  # these cases: all dims whole, or none

        def quantize(x, recipe, data_dtype=None):
            if whole:
                return jax_sm100.quantize_both(x, recipe, data_dtype=data_dtype)[0]
            return jax_sm100.quantize(x, recipe, data_dtype=data_dtype)

        want = test_scaled_dot._expected(padded(x), padded(w), dn, jax_sm100.DEEPSEEK_V3,
                                         padded(g), quantize)  # fmt: skip
        _assert_close(self, y, want[0][0, :m, :n], jnp.float32, k)
        _assert_close(self, dl, want[1][0, :m, :k], dtype, n)
        _assert_close(self, dr, want[2][0, :n, :k].T, dtype, m)

    def test_scaled_dot_general_under_name_policies(self):
        # Under jax.checkpoint with JAX's name policies (jax_sm100.checkpoint_policies'
        # SCALED_DOT_LHS / _RHS saved, or offloaded to the host, the other operand's
        # quantization recomputed in the backward by the quantize_both kernel), the step's
        # gradients equal those without jax.checkpoint bit for bit: the kernels are
        # deterministic and the recomputation is the forward's.
        keys = jax.random.split(jax.random.key(7), 2)
        x = jax.random.normal(keys[0], (512, 1024), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(keys[1], (1024, 768), jnp.float32).astype(jnp.bfloat16)
        dn = (((1,), (0,)), ((), ()))

        def loss(x, w):
            y = jax_sm100.scaled_dot_general(jnp.cos(x), w, dn, jnp.float32,
                                             jax_sm100.DEEPSEEK_V3)  # fmt: skip
            return jnp.sum(jnp.sin(y))

        want = jax.jit(jax.grad(loss, (0, 1)))(x, w)
        names = jax_sm100.checkpoint_policies
        policies = jax.checkpoint_policies
        for name in (names.SCALED_DOT_LHS, names.SCALED_DOT_RHS):
            offload = policies.save_and_offload_only_these_names(
                names_which_can_be_saved=[], names_which_can_be_offloaded=[name],
                offload_src="device", offload_dst="pinned_host",
            )  # fmt: skip
            for policy in (policies.save_only_these_names(name), offload):
                step = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy), (0, 1)))
                with jax_sm100.lowerings() as seen:
                    got = step(x, w)
                kernels = {lw.plan.kernel for lw in seen if lw.plan is not None}
                self.assertEqual(kernels, {planning.KERNEL_SM90_SCALED, "quantize_both"},
                                 [lw.note for lw in seen])  # fmt: skip
                for g, ref in zip(got, want, strict=True):
                    np.testing.assert_array_equal(np.asarray(g), np.asarray(ref), name)


@absltest.skipIf(_arch() not in ("sm_90a", "sm_100a"), "needs an SM90 or SM100 CUDA device")
class GpuQuantizeBothTest(parameterized.TestCase):
    @parameterized.product(
        shape=[(1024, 2048), (2, 384, 256), (8192, 4096)],
        dtype=[jnp.bfloat16, jnp.float32, jnp.float16],
        data_dtype=[E4M3, E5M2],
        recipe=["fp8_block128", "fp8_block128x128"],
    )
    def test_kernel_against_xla_and_the_exact_quotient(self, shape, dtype, data_dtype, recipe):
        # The quantize_both kernel on special values (NaN and infinite blocks, a zero tile,
        # subnormal quotients, values near the top of the input's range: tests/
        # test_quantize_both.py `special_values`): its scales are XLA's bit for bit; its data
        # is the correctly rounded x / scale's (a float32 IEEE division in numpy, rounded to
        # the fp8 format) bit for bit; XLA's data, whose division is not correctly rounded
        # (div.full), is within one fp8 unit of it and equal in all but a few elements. Per 1 x
        # 128 block (activations) and per 128 x 128 tile (weights: one scale, both ways).
        import ml_dtypes  # noqa: PLC0415

        from jax_sm100._src import quantize_both  # noqa: PLC0415
        from tests.test_quantize_both import _bits, special_values  # noqa: PLC0415

        x = special_values(shape, dtype, seed=len(shape))
        with jax_sm100.lowerings() as seen:
            got = jax.jit(lambda x: jax_sm100.quantize_both(x, recipe, data_dtype=data_dtype))(x)
        self.assertEqual([lw.plan.kernel for lw in seen], ["quantize_both"])
        self.assertEqual([lw.plan.recipe for lw in seen], [recipe])
        want = jax.jit(lambda x: quantize_both._reference(x, data_dtype=data_dtype,
                                                           recipe=recipe))(x)  # fmt: skip
        (q, s), (qt, st) = got
        (wq, ws), (wqt, wst) = want
        np.testing.assert_array_equal(_bits(s), _bits(ws))
        np.testing.assert_array_equal(_bits(st), _bits(wst))
        xf = np.asarray(x, np.float32)
        top = float(jnp.finfo(data_dtype).max)
        fp8 = getattr(ml_dtypes, np.dtype(data_dtype).name)
        for data, scales, xla, view in ((q, s, wq, xf), (qt, st, wqt, np.swapaxes(xf, -1, -2))):
            sc = np.repeat(np.asarray(scales, np.float32), 128, -1)  # per element
            if recipe == "fp8_block128x128":
                sc = np.repeat(sc, 128, -2)
            with np.errstate(all="ignore"):
                exact = np.where(sc > 0, np.clip(view / np.where(sc > 0, sc, 1), -top, top), 0)
            exact = exact.astype(np.float32).astype(fp8)
            np.testing.assert_array_equal(_bits(data), exact.view(np.uint8))
            d, w = (np.asarray(a, np.float32) for a in (data, xla))
            off = np.flatnonzero(_bits(data) != _bits(xla))
            self.assertLessEqual(len(off), max(4, d.size // 10**3), off[:5])
            # One unit of the format apart (the neighbouring value).
            normal = float(jnp.finfo(data_dtype).smallest_normal)  # below it, fixed spacing
            units = np.abs(d.ravel()[off] - w.ravel()[off]) / np.exp2(
                np.floor(np.log2(np.maximum(np.abs(w.ravel()[off]), normal)))
            )
            self.assertTrue(np.all(units <= 2.0 ** -(3 if data_dtype == E4M3 else 2)), units)


if __name__ == "__main__":
    absltest.main()
