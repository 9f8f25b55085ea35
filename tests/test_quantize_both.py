"""Tests of `jax_sm100.quantize_both` (quantize_both.py) and its kernel (kernels/quantize.py).

On CPU the primitive lowers to XLA's two quantizations, so the values are checked bit for bit
against `quantize` and `quantize_transposed` here, and on the device against the same functions
run by XLA there (tests/test_gpu_scaled.py). The kernel is compiled for sm_90a and sm_100a with
no GPU, and its PTX checked for what makes it one pass and bit-exact (a reciprocal's product
with one correction, 16-byte loads, round-to-nearest fp8 conversion); that division is
emulated operation for operation in numpy and checked against IEEE division here.
"""

from __future__ import annotations

import dataclasses
import os
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import PartitionSpec as PS

import jax_sm100
from jax_sm100._src import compile as compile_mod
from jax_sm100._src import constraints, ffi, scaled
from jax_sm100._src.planning.quantize import QuantizePlan, plan_quantize_both


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(np.uint32)


def special_values(shape, dtype, seed=0):
    """Normal data of changing magnitude with the cases the recipe treats apart: a NaN, both
    infinities, an all-zero tile, a tile of subnormal float32 values (for bfloat16 and float32
    input: scales floored at float32's least normal number, power-of-two scales whose
    quotients tie) and one near the top of the input's range (each in a different 128 x 128
    tile where the shape has one)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x *= np.exp2(rng.integers(-6, 7, size=shape[:-1] + (1,)))
    rows, cols = shape[-2:]
    x[..., 0, 5] = np.nan
    x[..., rows - 1, cols - 1] = np.inf
    x[..., rows // 2, 3] = -np.inf
    if rows >= 256 and cols >= 256:
        x[..., :128, 128:256] = 0.0
        finfo = jnp.finfo(dtype)
        x[..., 128:256, 128:256] *= float(finfo.tiny) * 4  # subnormal inputs, floored scales
        # Near the top of the input's range (normal values under 8, times max / 64).
        x[..., 128:256, :128] = np.clip(rng.standard_normal(x[..., 128:256, :128].shape), -8, 8)
        x[..., 128:256, :128] *= float(finfo.max) / 64
    return jnp.asarray(x, dtype)


def _rn32_sum(p, q):
    """float32 round-to-nearest of p + q, for a float64 p and a float32 q: the float64 sum and
    its exact error (TwoSum), then float32 ties decided by the error's sign."""
    q = q.astype(np.float64)
    t = p + q
    bp = t - q
    err = (p - bp) + (q - (t - bp))
    r = t.astype(np.float32)
    d = t - r
    other = np.nextafter(r, np.where(d > 0, np.inf, -np.inf).astype(np.float32))
    tie = (d != 0) & (np.abs(d) == np.abs(other - t))
    return np.where(tie & (err != 0) & (np.sign(err) == np.sign(d)), other, r)


def _emulated_division(x, s, correct=True, rescale=True):
    """The kernel's x / s (QuantizeBothKernel._quantized) in numpy, operation for operation:
    x and s times 2^64 where s < 2^-80; y = 1 / s; q0 = x y; r = fma(q0, s, -x); q = fma(-r, y,
    q0). The FMAs are exact in float64 here: q0 s has 48 bits within a few units of x, and r y
    48 bits (`_rn32_sum` rounds their sum with q0 once)."""
    f32 = np.float32
    c = np.where(rescale & (s < f32(2.0**-80)), f32(2.0**64), f32(1))
    x, s = x * c, s * c
    y = f32(1) / s
    q0 = x * y
    if not correct:
        return q0
    r = (q0.astype(np.float64) * s - x).astype(f32)
    return _rn32_sum(-(r.astype(np.float64) * y), q0)


class QuantizeBothTest(parameterized.TestCase):
    @parameterized.product(
        shape=[(128, 128), (256, 384), (2, 384, 256), (2, 1, 256, 128)],
        dtype=[jnp.bfloat16, jnp.float32, jnp.float16],
        data_dtype=[None, jnp.float8_e5m2],
        recipe=["fp8_block128", "fp8_block128x128"],
    )
    def test_both_orientations_bit_for_bit(self, shape, dtype, data_dtype, recipe):
        x = special_values(shape, dtype)
        (q, s), (qt, st) = jax.jit(
            lambda x: jax_sm100.quantize_both(x, recipe, data_dtype=data_dtype)
        )(x)  # fmt: skip
        want_q, want_s = scaled.quantize(x, recipe, data_dtype=data_dtype)
        want_qt, want_st = scaled.quantize(jnp.swapaxes(x, -1, -2), recipe,
                                           data_dtype=data_dtype)  # fmt: skip
        for got, want in ((q, want_q), (s, want_s), (qt, want_qt), (st, want_st)):
            self.assertEqual((got.shape, got.dtype), (want.shape, want.dtype))
            np.testing.assert_array_equal(_bits(got), _bits(want))
        if recipe == "fp8_block128x128":  # one scale a tile, for both orientations
            np.testing.assert_array_equal(_bits(st), _bits(jnp.swapaxes(s, -1, -2)))
        # The non-finite blocks dequantize to NaN, the zero tile to zeros.
        self.assertTrue(np.isnan(np.asarray(s)[..., 0, 0]).all())
        if shape[-1] >= 256 and shape[-2] >= 256:
            np.testing.assert_array_equal(np.asarray(q[..., :128, 128:256], np.float32), 0.0)

    def test_division_against_ieee(self):
        """The kernel's division, emulated, equals numpy's correctly rounded x / s on blocks as
        the recipe makes them (any exponent, bfloat16 values, the largest element's quotient at
        the top, quotients at float32 ties, signed zeros): every fp8 byte, and every float32
        quotient from 2^-18 (below it, each format rounds to zero). Without the correction or
        the rescaling of tiny blocks, the same data shows differences: the check can fail."""
        import ml_dtypes  # noqa: PLC0415

        f32 = np.float32
        rng = np.random.default_rng(0)
        blocks = 1 << 13
        amax = np.exp2(rng.uniform(-149, 127, blocks)).astype(f32)
        amax = np.maximum(amax.astype(ml_dtypes.bfloat16).astype(f32), f32(2.0**-149))
        amax[::2] = np.exp2(rng.uniform(-125, -40, blocks // 2))  # tiny blocks, rescaled
        # The recipe's scale: amax times 1 / 448 or 1 / 57344, floored at the least normal.
        for top, fp8 in ((448.0, ml_dtypes.float8_e4m3fn), (57344.0, ml_dtypes.float8_e5m2)):
            s = np.repeat(np.maximum(amax * (f32(1) / f32(top)), f32(2.0**-126)), 128)
            a = np.repeat(amax, 128).astype(np.float64)
            n = s.size
            sign = rng.choice([-1.0, 1.0], n)
            x = np.stack([
                a * rng.uniform(-1, 1, n),
                a * np.exp2(rng.uniform(-40, 0, n)) * sign,
                a * (1 - rng.uniform(0, 1e-3, n)) * sign,
                (rng.integers(1 << 23, 1 << 24, n) + 0.5) * np.exp2(rng.integers(-45, -15, n))
                * s * sign,
            ]).astype(f32)  # fmt: skip
            x[1:3] = x[1:3].astype(ml_dtypes.bfloat16).astype(f32)
            x[:, ::97], x[:, ::101] = 0.0, -0.0
            x = np.where(np.abs(x) > a, np.copysign(a, x), x).astype(f32)
            exact = x / s

            def differences(q, exact=exact, top=top, fp8=fp8):
                big = np.abs(exact) >= 2.0**-18
                bits = int(np.sum((q.view(np.uint32) != exact.view(np.uint32)) & big))
                data = [np.clip(v, -top, top).astype(fp8).view(np.uint8) for v in (q, exact)]
                return bits, int(np.sum(data[0] != data[1]))

            self.assertEqual(differences(_emulated_division(x, s)), (0, 0))
            self.assertGreater(differences(_emulated_division(x, s, correct=False))[0], 0)
            self.assertGreater(differences(_emulated_division(x, s, rescale=False))[0], 0)

    @parameterized.parameters("fp8_block128", "fp8_block128x128")
    def test_vmap_and_eager(self, recipe):
        x = special_values((3, 256, 128), jnp.bfloat16)
        got = jax.vmap(lambda x: jax_sm100.quantize_both(x, recipe), in_axes=1,
                       out_axes=1)(jnp.swapaxes(x, 0, 1))  # fmt: skip
        want = jax_sm100.quantize_both(x, recipe)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(_bits(jnp.swapaxes(g, 0, 1)), _bits(w))
        eager = jax_sm100.quantize_both(x[0])
        jitted = jax.jit(jax_sm100.quantize_both)(x[0])
        for g, w in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
            np.testing.assert_array_equal(_bits(g), _bits(w))

    def test_errors_name_the_fix(self):
        x = jnp.ones((256, 256), jnp.bfloat16)
        with self.assertRaisesRegex(ValueError, "quantize once per orientation"):
            jax_sm100.quantize_both(x, "mxfp8")
        with self.assertRaisesRegex(ValueError, "pad it with zeros"):
            jax_sm100.quantize_both(jnp.ones((200, 256)))
        with self.assertRaisesRegex(ValueError, "pad it with zeros"):
            jax_sm100.quantize_both(jnp.ones((256, 100)))
        with self.assertRaisesRegex(ValueError, r"\[..., rows, cols\]"):
            jax_sm100.quantize_both(jnp.ones((256,)))
        with self.assertRaisesRegex(TypeError, "real floats"):
            jax_sm100.quantize_both(jnp.ones((256, 256), jnp.int32))
        with self.assertRaisesRegex(TypeError, "data is one of"):
            jax_sm100.quantize_both(x, data_dtype=jnp.bfloat16)
        # Empty arrays (rows or cols 0 are whole blocks) give empty results.
        for shape in ((0, 128), (2, 0, 128), (0, 256, 128)):
            (q, s), (qt, st) = jax_sm100.quantize_both(jnp.zeros(shape))
            self.assertEqual((q.shape, qt.shape), (shape, (*shape[:-2], shape[-1], shape[-2])))
            self.assertEqual(s.shape, (*shape[:-1], shape[-1] // 128))
            (q, s), (qt, st) = jax_sm100.quantize_both(jnp.zeros(shape), "fp8_block128x128")
            self.assertEqual(s.shape, (*shape[:-2], shape[-2] // 128, shape[-1] // 128))
            self.assertEqual(st.shape, (*shape[:-2], shape[-1] // 128, shape[-2] // 128))
        with self.assertRaisesRegex(NotImplementedError, "not differentiable"):
            jax.grad(lambda x: jax_sm100.quantize_both(x)[0][1].sum())(x.astype(jnp.float32))

    def test_plan_says_which_path(self):
        p = plan_quantize_both(8192, 4096, 1, "bfloat16", "float8_e4m3fn", "sm_90a")
        self.assertEqual(p.kernel, constraints.KERNEL_QUANTIZE_BOTH)
        for rows, cols, batch, dtype, why in (
            (200, 256, 1, "bfloat16", "128 x 128 tiles"),
            (256, 256, 0, "bfloat16", "non-empty"),
            (256, 256, 1, "float64", "reads"),
            (128 * 65536, 128, 1, "bfloat16", "65535"),
            (128, 128, 65536, "bfloat16", "65535"),
        ):
            p = plan_quantize_both(rows, cols, batch, dtype, "float8_e4m3fn", "sm_100a")
            self.assertEqual(p.kernel, constraints.KERNEL_XLA)
            self.assertIn(why, p.reason)
        with self.assertRaisesRegex(ValueError, "cannot run this plan"):
            QuantizePlan(200, 256, 1, "bfloat16", "float8_e4m3fn", "sm_90a",
                         constraints.KERNEL_QUANTIZE_BOTH)  # fmt: skip
        # Plans of one dtype pair and arch share a binary: the sizes are runtime values.
        a = plan_quantize_both(256, 128, 1, "float32", "float8_e5m2", "sm_90a")
        b = plan_quantize_both(8192, 1024, 3, "float32", "float8_e5m2", "sm_90a")
        self.assertEqual(a.binary_fields(), b.binary_fields())
        key = lambda p: compile_mod.binary_key(p, compile_mod.KernelSpec.for_plan(p))  # noqa: E731
        self.assertEqual(key(a), key(b))
        # The tile recipe is a binary of its own.
        t = plan_quantize_both(256, 128, 1, "float32", "float8_e5m2", "sm_90a", "fp8_block128x128")
        self.assertNotEqual(key(a), key(t))
        with self.assertRaisesRegex(ValueError, "recipe"):
            dataclasses.replace(t, recipe="mxfp8")

    @parameterized.product(arch=["sm_90a", "sm_100a"], dtype=["bfloat16", "float16", "float32"],
                           data_dtype=["float8_e4m3fn", "float8_e5m2"])  # fmt: skip
    def test_kernel_ptx(self, arch, dtype, data_dtype):
        plan = plan_quantize_both(256, 256, 1, dtype, data_dtype, arch)
        ptx = compile_mod.compile_plan(plan).ptx

        def count(pattern):
            return len(re.findall(pattern, ptx))

        self.assertEqual(count(rf"\.target {arch}\b"), 1)
        # x read once, 16 bytes a load; the tile kept in shared memory for the transposed pass.
        loads = 8 * (2 if dtype == "float32" else 1)
        self.assertEqual(count(r"ld\.global\.(v4\.b32|v2\.b64)"), loads)
        self.assertEqual(count(r"ld\.global"), loads)
        self.assertEqual(count(r"st\.shared\.(v4\.b32|v2\.b64)"), loads)
        # x / scale as `_emulated_division`: one IEEE reciprocal a block row (8 a pass), a
        # product, rounded apart (mul.rn: not fused), and two FMAs an element; no
        # approximation and no flush to zero.
        self.assertEqual(count(r"rcp\.rn\.f32"), 2 * 8)
        self.assertEqual(count(r"mul\.rn\.f32"), 2 * 8 * 8 * 2)
        self.assertEqual(count(r"fma\.rn\.f32"), 2 * 8 * 8 * 2)
        self.assertEqual(count(r"div\.|\.approx|\.ftz\."), 0)
        # Register for register: per block row c = 2^64 where the scale is below 2^-80 (else
        # 1), s = scale c, y = 1 / s; per element x' = x c, q0 = x' y, r = fma(q0, s, -x'),
        # q = fma(-r, y, q0), with that row's c, s and y.
        rows = re.findall(
            r"setp\.lt\.f32\s+(%p\d+), %r\d+, 0f17800000;\s*"
            r"selp\.f32\s+(%r\d+), 0f5F800000, 0f3F800000, \1;\s*"
            r"mul\.f32\s+(%r\d+), %r\d+, \2;\s*rcp\.rn\.f32\s+(%r\d+), \3;", ptx)  # fmt: skip
        self.assertLen(rows, 2 * 8)
        elements = re.findall(
            r"mul\.rn\.f32\s+(%r\d+), %r\d+, (%r\d+);\s*mul\.rn\.f32\s+(%r\d+), \1, (%r\d+);\s*"
            r"neg\.f32\s+(%r\d+), \1;\s*fma\.rn\.f32\s+(%r\d+), \3, (%r\d+), \5;\s*"
            r"neg\.f32\s+(%r\d+), \6;\s*fma\.rn\.f32\s+%r\d+, \8, \4, \3;", ptx)  # fmt: skip
        self.assertLen(elements, 2 * 8 * 8)
        per_row = {(c, s, y) for _, c, s, y in rows}
        for _, c, _, y, _, _, s, _ in elements:
            self.assertIn((c, s, y), per_row)
        # Rounded to nearest, saturating (the quotient is clipped first).
        fmt = "e4m3" if data_dtype == "float8_e4m3fn" else "e5m2"
        self.assertEqual(count(rf"cvt\.rn\.satfinite\.{fmt}x2\.f32"), 2 * 8 * 4)
        # A row's and a column's maxima over the 16 threads sharing them, NaN kept.
        self.assertEqual(count(r"shfl\.sync\.bfly"), 2 * 8 * 4)
        self.assertEqual(count(r"max\.NaN\.f32"), 2 * 8 * (8 + 4))
        from tests.test_sm100_ptx import ptxas_spill_bytes  # noqa: PLC0415

        spills = ptxas_spill_bytes(ptx, arch)
        if spills is not None:
            self.assertEqual(spills, (0, 0))

    @parameterized.product(arch=["sm_90a", "sm_100a"], dtype=["bfloat16", "float32"])
    def test_kernel_ptx_per_tile(self, arch, dtype):
        # fp8_block128x128: x read once, one scale for the 128 x 128 tile (its warps' maxima
        # met in shared memory behind the one barrier the transposed pass needs), both
        # orientations' data under it, the tile's scale stored once each way.
        plan = plan_quantize_both(256, 256, 1, dtype, "float8_e4m3fn", arch, "fp8_block128x128")
        ptx = compile_mod.compile_plan(plan).ptx

        def count(pattern):
            return len(re.findall(pattern, ptx))

        loads = 8 * (2 if dtype == "float32" else 1)
        self.assertEqual(count(r"ld\.global"), loads)
        self.assertEqual(count(r"bar\.sync"), 1)
        self.assertEqual(count(r"rcp\.rn\.f32"), 1)  # one scale, one reciprocal
        self.assertEqual(count(r"fma\.rn\.f32"), 2 * 8 * 8 * 2)
        self.assertEqual(count(r"div\.|\.approx|\.ftz\."), 0)
        self.assertEqual(count(r"cvt\.rn\.satfinite\.e4m3x2\.f32"), 2 * 8 * 4)
        # 64 elements a thread, its warp (5 shuffles), the 8 warps.
        self.assertEqual(count(r"shfl\.sync\.bfly"), 5)
        self.assertEqual(count(r"max\.NaN\.f32"), 64 + 5 + 7)
        self.assertEqual(count(r"st\.global\.b32"), 2)
        from tests.test_sm100_ptx import ptxas_spill_bytes  # noqa: PLC0415

        spills = ptxas_spill_bytes(ptx, arch)
        if spills is not None:
            self.assertEqual(spills, (0, 0))

    def test_cuda_lowering_runs_the_kernel(self):
        s = jax.ShapeDtypeStruct
        for arch in ("sm_90a", "sm_100a"):
            with (mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}),
                  jax_sm100.lowerings() as seen):  # fmt: skip
                text = jax.export.export(
                    jax.jit(lambda x: jax_sm100.quantize_both(x)), platforms=["cuda"],
                    disabled_checks=ffi.export_safety_checks(),
                )(s((2, 512, 256), jnp.bfloat16)).mlir_module()  # fmt: skip
            self.assertEqual([x.plan.kernel for x in seen], ["quantize_both"])
            self.assertEqual(seen[0].plan.arch, arch)
            self.assertEqual(text.count("stablehlo.custom_call @jax_sm100_quantize"), 1)
            self.assertNotIn("custom_call @jax_sm100_gemm", text)  # not counted as a product
            self.assertIn('names = "x,q,s,qt,st"', text)
            self.assertNotIn("stablehlo.reduce", text)  # no XLA quantization beside it
            with (mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}),
                  jax_sm100.lowerings() as seen):  # fmt: skip
                exported = jax.export.export(
                    jax.jit(lambda x: jax_sm100.quantize_both(x, "fp8_block128x128")),
                    platforms=["cuda"], disabled_checks=ffi.export_safety_checks(),
                )(s((2, 512, 256), jnp.bfloat16))  # fmt: skip
            self.assertEqual([(x.plan.kernel, x.plan.recipe) for x in seen],
                             [("quantize_both", "fp8_block128x128")])  # fmt: skip
            self.assertEqual([a.shape for a in exported.out_avals],
                             [(2, 512, 256), (2, 4, 2), (2, 256, 512), (2, 2, 4)])  # fmt: skip
            tile_text = exported.mlir_module()
            self.assertEqual(tile_text.count("stablehlo.custom_call @jax_sm100_quantize"), 1)
            self.assertNotIn("stablehlo.reduce", tile_text)
            self.assertNotIn("stablehlo.transpose", tile_text)  # its scales are written as read
            # Typed over a one-device mesh of Explicit axes: the kernel, its results typed.
            mesh = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1],
                                 axis_types=(jax.sharding.AxisType.Explicit,) * 2)  # fmt: skip
            with (mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}),
                  jax.sharding.set_mesh(mesh), jax_sm100.lowerings() as seen):  # fmt: skip
                x = jax.device_put(jnp.zeros((2, 512, 256), jnp.bfloat16), PS("data", "model"))
                exported = jax.export.export(
                    jax.jit(lambda x: jax_sm100.quantize_both(x)), platforms=["cuda"],
                    disabled_checks=ffi.export_safety_checks(),
                )(x)  # fmt: skip
            self.assertEqual([x.plan.kernel for x in seen], ["quantize_both"])
            text = exported.mlir_module()
            self.assertEqual(text.count("stablehlo.custom_call @jax_sm100_quantize"), 1)
            self.assertNotIn("stablehlo.reduce", text)
            (_, _), (qt, st) = exported.out_avals[:2], exported.out_avals[2:]
            self.assertEqual(tuple(qt.sharding.spec)[:3], ("data", None, "model"))
            self.assertEqual(tuple(st.sharding.spec)[:3], ("data", None, "model"))
            # A shape the kernel does not take runs XLA's quantizations, and says why.
            with (mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}),
                  jax_sm100.lowerings() as seen):  # fmt: skip
                text = jax.export.export(
                    jax.jit(lambda x: jax_sm100.quantize_both(x)), platforms=["cuda"],
                    disabled_checks=ffi.export_safety_checks(),
                )(s((512, 256), jnp.float8_e5m2)).mlir_module()  # fmt: skip
            self.assertEqual([x.plan.kernel for x in seen], ["xla_dot"])
            self.assertIn("XLA ops (the kernel reads", seen[0].note)
            self.assertNotIn("custom_call", text)


if __name__ == "__main__":
    absltest.main()
