"""`jax_sm100.scaled_dot_general` on CPU: its forward and gradients against the documented
quantized math and float64, against `jax.nn.scaled_dot_general` where JAX lowers it on CPU,
under the transformations and Flax, lowered for CUDA, and its errors."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import re
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax import lax
from jax.ad_checkpoint import print_saved_residuals

import jax_sm100
from jax_sm100._src import ffi
from tests import test_scaled
from tests import test_util as tu

_MXFP8 = ("mxfp8", "mxfp8", "mxfp8")
_E5M2_GRADS = ("fp8_block128", "fp8_block128x128", ("fp8_block128", jnp.float8_e5m2))
_NVFP4 = ("nvfp4", "nvfp4", "nvfp4")
# Dimension numbers with their operand shapes: a plain product, weights stored [n, k], a batch
# with two contracting dims, and a batch dim after the free ones.
_CASES = (
    ("xw", (256, 512), (512, 384), (((1,), (0,)), ((), ()))),
    ("xwT", (256, 512), (384, 512), (((1,), (1,)), ((), ()))),
    ("batched_two_k", (2, 128, 4, 64), (2, 4, 64, 256), (((2, 3), (1, 2)), ((0,), (0,)))),
    ("batch_last", (256, 3, 256), (256, 128, 3), (((0,), (0,)), ((1,), (2,)))),
)
# Relative to the largest exact element: a product of two quantized operands errs by about
# both operands' quantization errors (test_scaled._QUANT_TOL, per element of a block's top)
# averaged over k; bounded loosely as their sum.
_TOL = {
    "fp8_block128": 2**-4,
    "fp8_block128x128": 2**-4,
    "mxfp8": 2**-3,
    "nvfp4": 2**-1,
}


def _tol(c):
    return 2**-3 if _data_dtype(c) == jnp.float8_e5m2 else _TOL[_recipe(c)]


def _k(x, dims):
    return int(np.prod([x.shape[d] for d in dims], dtype=np.int64))


def _recipe(c):
    return c if isinstance(c, str) else c[0]


def _data_dtype(c):
    return None if isinstance(c, str) else c[1]


def _fold(x, batch, contract):
    """numpy [B, rows, contraction] of x, as lax.dot_general groups its dims."""
    free = [d for d in range(x.ndim) if d not in batch and d not in contract]
    size = lambda dims: int(np.prod([x.shape[d] for d in dims], dtype=np.int64))  # noqa: E731
    return np.transpose(x, (*batch, *free, *contract)).reshape(size(batch), size(free), -1)


def _product64(a3, b3, ca, cb, quantize=None):
    """float64 of scaled_matmul(quantize(a3, ca), quantize(b3, cb)), each [B, rows, k]
    (`quantize(x, recipe, data_dtype=...)`: `jax_sm100.quantize` unless given)."""
    quantize = quantize or jax_sm100.quantize
    qa = quantize(jnp.asarray(a3, jnp.float32), _recipe(ca), data_dtype=_data_dtype(ca))
    qb = quantize(jnp.asarray(b3, jnp.float32), _recipe(cb), data_dtype=_data_dtype(cb))
    return test_scaled._reference64(qa[0], qb[0], qa[1], qb[1])


def _expected(lhs, rhs, dn, configs, g, quantize=None):
    """(y, d lhs, d rhs) of the module docstring's math in float64, folded [B, rows, cols]
    (operands quantized by `quantize`, `_product64`'s)."""
    (lc, rc), (lb, rb) = dn
    a = _fold(np.asarray(lhs, np.float32), lb, lc)
    b = _fold(np.asarray(rhs, np.float32), rb, rc)
    g3 = np.asarray(g, np.float32).reshape(a.shape[0], a.shape[1], b.shape[1])
    y = _product64(a, b, configs[0], configs[1], quantize)
    da = _product64(g3, b.transpose(0, 2, 1), configs[2], configs[1], quantize)
    db = _product64(g3.transpose(0, 2, 1), a.transpose(0, 2, 1), configs[2], configs[0], quantize)
    return y, da, db


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _vjp(lhs, rhs, dn, configs, g, preferred=jnp.float32, fn=None):
    fn = fn or jax_sm100.scaled_dot_general
    f = lambda a, b: fn(a, b, dn, preferred_element_type=preferred, configs=configs)  # noqa: E731
    y, pullback = jax.vjp(f, lhs, rhs)
    return (y, *pullback(g.astype(preferred)))


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _saved_residuals(f, args, arguments=True) -> list[str]:
    """The types of what `f`'s gradient saves at `args` (`print_saved_residuals`), sorted;
    without `arguments`, those that are not `f`'s arguments."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(f, *args)
    lines = out.getvalue().splitlines()
    return sorted(line.split(" ")[0] for line in lines if arguments or "argument" not in line)


class ScaledDotGeneralTest(parameterized.TestCase):
    @parameterized.product(case=_CASES, configs=(jax_sm100.DEEPSEEK_V3, _MXFP8, _E5M2_GRADS))
    def test_forward_and_gradients_are_the_quantized_products(self, case, configs):
        _, ls, rs, dn = case
        lhs, rhs = _normal(0, ls), _normal(1, rs) * 3
        y_shape = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dn), lhs, rhs).shape
        g = _normal(2, y_shape)
        y, dl, dr = jax.jit(_vjp, static_argnums=(2, 3))(lhs, rhs, dn, configs, g)
        self.assertEqual((y.shape, dl.shape, dr.shape), (y_shape, lhs.shape, rhs.shape))
        self.assertEqual((y.dtype, dl.dtype, dr.dtype), (jnp.float32,) * 3)
        (lc, rc), (lb, rb) = dn
        want = _expected(lhs, rhs, dn, configs, g)
        got = (np.asarray(y), _fold(np.asarray(dl), lb, lc), _fold(np.asarray(dr), rb, rc))
        # Each equals its quantized product up to float32 accumulation over the contraction.
        contracted = (_k(lhs, lc), want[0].shape[-1], want[0].shape[-2])  # k, n, m
        for name, gt, wt, k in zip(("y", "d lhs", "d rhs"), got, want, contracted, strict=True):
            with self.subTest(name):
                tu.assert_close(self, gt.reshape(wt.shape), wt, "float32", k)
        # And the exact float64 products up to the formats' quantization.
        a64 = _fold(np.asarray(lhs, np.float64), lb, lc)
        b64 = _fold(np.asarray(rhs, np.float64), rb, rc)
        g64 = np.asarray(g, np.float64).reshape(want[0].shape)
        tol = [_tol(c) for c in configs]
        y64 = a64 @ b64.transpose(0, 2, 1)
        self.assertLess(_rel_err(got[0].reshape(y64.shape), y64), tol[0] + tol[1])
        self.assertLess(_rel_err(got[1], g64 @ b64), tol[2] + tol[1])
        self.assertLess(_rel_err(got[2], g64.transpose(0, 2, 1) @ a64), tol[2] + tol[0])

    @parameterized.parameters(
        (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)
    )
    def test_gradients_take_their_operands_dtype(self, dtype, preferred):
        # As JAX's gradients do; each is rounded once from the float32 accumulation.
        lhs, rhs = _normal(0, (128, 256), dtype), _normal(1, (256, 128), dtype)
        dn = (((1,), (0,)), ((), ()))
        g = _normal(2, (128, 128))
        y, dl, dr = _vjp(lhs, rhs, dn, jax_sm100.DEEPSEEK_V3, g, preferred)
        self.assertEqual((y.dtype, dl.dtype, dr.dtype), (preferred, dtype, dtype))
        g = g.astype(preferred)
        _, want_dl, want_dr = _expected(lhs, rhs, dn, jax_sm100.DEEPSEEK_V3, g)
        tu.assert_close(self, np.asarray(dl)[None], want_dl, np.dtype(dtype).name, 128)
        tu.assert_close(self, np.asarray(dr).T[None], want_dr, np.dtype(dtype).name, 128)

    @parameterized.parameters(jnp.float32, jnp.bfloat16)
    def test_equals_jax_nn_scaled_dot_general(self, dtype):
        lhs, rhs = _normal(0, (2, 256, 512), dtype), _normal(1, (2, 384, 512), dtype) * 3
        g = _normal(2, (2, 256, 384), dtype)
        dn = (((2,), (2,)), ((0,), (0,)))
        for configs in (
            [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3,
            [jax.nn.get_scaled_dot_general_config("nvfp4", jnp.array([0.05], jnp.float32))] * 3,
        ):
            try:
                theirs = _vjp(lhs, rhs, dn, configs, g, dtype, jax.nn.scaled_dot_general)
            except NotImplementedError as e:  # JAX 0.10 has no CPU lowering of it
                self.skipTest(f"jax.nn.scaled_dot_general on CPU: {e}")
            ours = _vjp(lhs, rhs, dn, configs, g, dtype)
            # nvfp4's product times the two global scales rounds in another order (ours
            # multiplies by each in turn: their product alone can underflow); JAX's backward
            # products in bfloat16 accumulate in their own order.
            exact = configs[0].mode == "mxfp8"
            for what, o, t in zip(("y", "d lhs", "d rhs"), ours, theirs, strict=True):
                with self.subTest(f"{configs[0].mode} {what}"):
                    self.assertEqual(o.dtype, t.dtype)
                    if exact and (what == "y" or dtype == jnp.float32):
                        np.testing.assert_array_equal(np.asarray(o), np.asarray(t))
                    else:
                        tu.assert_close(self, o, np.asarray(t, np.float64), "bfloat16", 512)

    def test_nvfp4_with_a_global_scale_per_call(self):
        # The recipe name: each operand's per-tensor scale computed per call (quantize's
        # global_scale=True), so no value is clipped; the backward is plain products.
        lhs, rhs = _normal(0, (128, 256)) * 1e4, _normal(1, (256, 64)) * 1e-4
        dn = (((1,), (0,)), ((), ()))
        g = _normal(2, (128, 64))
        y, dl, dr = _vjp(lhs, rhs, dn, _NVFP4, g)
        a, b = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
        self.assertLess(_rel_err(y, a @ b), 2 * _TOL["nvfp4"])
        tu.assert_close(self, dl, np.asarray(g, np.float64) @ b.T, "float32", 64)
        tu.assert_close(self, dr, a.T @ np.asarray(g, np.float64), "float32", 128)

    def test_nvfp4_gradient_is_zero_where_the_forward_clipped(self):
        # JAX's rule: with the config's global scale, |x| past scale x 6 x 448 was clipped.
        cfg = jax.nn.get_scaled_dot_general_config("nvfp4", jnp.array([1e-2], jnp.float32))
        lhs = _normal(0, (128, 256)).at[3, 5].set(100.0)  # past 1e-2 * 2688
        rhs = _normal(1, (256, 64))
        dn = (((1,), (0,)), ((), ()))
        _, dl, _ = _vjp(lhs, rhs, dn, [cfg] * 3, _normal(2, (128, 64)))
        self.assertEqual(float(dl[3, 5]), 0.0)
        self.assertGreater(int(jnp.count_nonzero(dl)), dl.size - 2)

    def test_gradient_exports_with_a_symbolic_row_count(self):
        # The weight gradient contracts over x's rows, padded to whole blocks: with the rows
        # symbolic (jax.export), -m % 128 added to m did not prove divisible and the export
        # raised quantize's "pad it with zeros". The exported gradient equals the jitted one.
        dn = (((1,), (0,)), ((), ()))

        def loss(x, w):
            y = jax_sm100.scaled_dot_general(x, w, dn, jnp.float32, jax_sm100.DEEPSEEK_V3)
            return jnp.sum(jnp.sin(y))

        grad = jax.jit(jax.grad(loss, (0, 1)))
        (m,) = jax.export.symbolic_shape("m")
        exp = jax.export.export(grad, platforms=["cpu"])(
            jax.ShapeDtypeStruct((m, 256), jnp.float32),
            jax.ShapeDtypeStruct((256, 128), jnp.float32),
        )
        w = _normal(1, (256, 128))
        for rows in (200, 1):
            x = _normal(0, (rows, 256))
            for got, want in zip(exp.call(x, w), grad(x, w), strict=True):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def test_nvfp4_global_scale_may_be_traced(self):
        # The config's global scale as a traced value: a jit argument under an outer grad,
        # under jax.checkpoint, scanned per layer. It leaked from its trace (the custom_vjp
        # captured it); the gradients now equal those with the scale concrete (within float32
        # rounding: XLA fuses the jitted forms' elementwise math otherwise).
        x, w = _normal(0, (128, 128)), _normal(1, (128, 128))
        gs = jnp.array([0.01], jnp.float32)
        dn = (((1,), (0,)), ((), ()))

        def layer(h, w, gs):
            cfg = [jax.nn.get_scaled_dot_general_config("nvfp4", gs)] * 3
            return jnp.tanh(jax_sm100.scaled_dot_general(h, w, dn, configs=cfg))

        def loss(x, w, gs):
            return jnp.sum(layer(x, w, gs) ** 2)

        def scanned(x, w, gs):
            h, _ = lax.scan(lambda h, p: (layer(h, *p), None), x, (w[None], gs[None]))
            return jnp.sum(h**2)

        want = jax.grad(loss, (0, 1))(x, w, gs)
        for f in (jax.grad(jax.jit(loss), (0, 1)), jax.grad(jax.checkpoint(loss), (0, 1)),
                  jax.grad(scanned, (0, 1))):  # fmt: skip
            for got, ref in zip(f(x, w, gs), want, strict=True):
                np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5,
                                           atol=1e-5)  # fmt: skip
        # The scale's own cotangent is zero, as jax.nn's.
        self.assertEqual(float(jax.grad(loss, 2)(x, w, gs)[0]), 0.0)

    @parameterized.parameters(jax_sm100.DEEPSEEK_V3, _MXFP8)
    def test_either_gradient_alone_under_checkpoint(self, *configs):
        # One operand's gradient, then the other's, then the first's again, under
        # jax.checkpoint with a dots policy (JAX reuses the traced forward across those
        # calls), equals the gradients taken together. A forward whose residuals depended on
        # which operand is differentiated (custom_vjp's symbolic_zeros) returned an all-zero
        # gradient or failed here (JAX pairs the cached forward with the last pattern's
        # residual layout; jax-ml/jax#16614's class), so the residuals are the same for every
        # pattern and a gradient not asked for is left to XLA's dead-code elimination.
        x, w = _normal(0, (256, 256), jnp.bfloat16), _normal(1, (256, 256), jnp.bfloat16)
        dn = (((1,), (0,)), ((), ()))

        def loss(x, w):
            return jnp.sum(jnp.sin(jax_sm100.scaled_dot_general(x, w, dn, jnp.float32, configs)))

        want = jax.grad(loss, (0, 1))(x, w)
        for policy in ("dots_saveable", "everything_saveable"):
            ck = jax.checkpoint(loss, policy=getattr(jax.checkpoint_policies, policy))
            for argnum in (1, 0, 1, 0):
                np.testing.assert_array_equal(jax.grad(ck, argnum)(x, w), want[argnum])

    def test_residuals_are_the_fp8_data_or_under_checkpoint_the_arguments(self):
        # Under a gradient the forward keeps each operand's other orientation quantized (x
        # per 1 x 128 block, the weight per 128 x 128 tile: fp8 data and float32 scales), not
        # the bfloat16 operands; under jax.checkpoint with a policy that saves nothing, the
        # arguments alone (the quantizations recomputed in the backward).
        x, w = _normal(0, (256, 512), jnp.bfloat16), _normal(1, (512, 384), jnp.bfloat16)

        def loss(x, w):
            y = jax_sm100.scaled_dot_general(x, w, (((1,), (0,)), ((), ())), jnp.float32,
                                             jax_sm100.DEEPSEEK_V3)  # fmt: skip
            return jnp.sum(jnp.sin(y))

        saved = functools.partial(_saved_residuals, args=(x, w))
        self.assertEqual(saved(loss), sorted([
            "f8_e4m3fn[1,512,256]", "f32[1,512,2]",  # x along its rows
            "f8_e4m3fn[1,512,384]", "f32[1,4,3]",  # w along its n
            "f32[256,384]",  # the product, for sin's derivative
        ]))  # fmt: skip
        nothing = jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable)
        self.assertEqual(saved(nothing), ["bf16[256,512]", "bf16[512,384]"])

    def test_residuals_are_named_for_checkpoint_policies(self):
        # Each operand's residual carries its name (jax_sm100.checkpoint_policies'
        # SCALED_DOT_LHS / _RHS) in either form: the fp8 data and scales where the forward
        # quantized it both ways (256 rows), the operand itself where not (200 rows). JAX's
        # name policies save or offload one operand's and recompute the other's, and the
        # gradients stay those without jax.checkpoint.
        names = jax_sm100.checkpoint_policies
        policies = jax.checkpoint_policies
        w = _normal(1, (512, 384), jnp.bfloat16)

        def loss(x, w):
            x = jnp.cos(x)  # x's residual then is not an argument of the checkpoint
            y = jax_sm100.scaled_dot_general(x, w, (((1,), (0,)), ((), ())), jnp.float32,
                                             jax_sm100.DEEPSEEK_V3)  # fmt: skip
            return jnp.sum(jnp.sin(y))

        def saved(f, x):
            return _saved_residuals(f, (x, w), arguments=False)

        cases = (
            (256, names.SCALED_DOT_LHS, ["f32[1,512,2]", "f8_e4m3fn[1,512,256]"]),
            (256, names.SCALED_DOT_RHS, ["f32[1,4,3]", "f8_e4m3fn[1,512,384]"]),
            (200, names.SCALED_DOT_LHS, ["bf16[200,512]"]),  # cos(x), unquantized
        )
        for rows, name, want in cases:
            x = _normal(0, (rows, 512), jnp.bfloat16)
            grads = jax.grad(loss, (0, 1))(x, w)
            kept = jax.checkpoint(loss, policy=policies.save_only_these_names(name))
            self.assertEqual(saved(kept, x), want, (rows, name))
            offload = policies.save_and_offload_only_these_names(
                names_which_can_be_saved=[], names_which_can_be_offloaded=[name],
                offload_src="device", offload_dst="pinned_host",
            )  # fmt: skip
            hosted = jax.checkpoint(loss, policy=offload)
            self.assertEqual(saved(hosted, x), [t.replace("[", "<host>[", 1) for t in want])
            for f in (kept, hosted):
                for got, ref in zip(jax.jit(jax.grad(f, (0, 1)))(x, w), grads, strict=True):
                    np.testing.assert_array_equal(got, ref)

    def test_without_configs_it_is_dot_general(self):
        lhs, rhs = _normal(0, (64, 96), jnp.bfloat16), _normal(1, (96, 32), jnp.bfloat16)
        dn = (((1,), (0,)), ((), ()))
        got = jax_sm100.scaled_dot_general(lhs, rhs, dn, preferred_element_type=jnp.bfloat16)
        want = jax_sm100.dot_general(lhs, rhs, dn, preferred_element_type=jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def test_vmap_is_the_batched_product(self):
        lhs, rhs = _normal(0, (3, 128, 256)), _normal(1, (256, 128))
        dn = (((1,), (0,)), ((), ()))
        g = _normal(2, (3, 128, 128))

        def per_example(x, w):
            return jax_sm100.scaled_dot_general(x, w, dn, configs=jax_sm100.DEEPSEEK_V3)

        def loss(x, w):
            return jnp.sum(jax.vmap(per_example, (0, None))(x, w) * g)

        got = jax.value_and_grad(loss, (0, 1))(lhs, rhs)
        for i in range(3):
            y, dl, dr = _vjp(lhs[i], rhs, dn, jax_sm100.DEEPSEEK_V3, g[i])
            tu.assert_close(self, got[1][0][i], dl, "float32", 128)
            if i == 0:
                dr_sum, value = dr, float(jnp.sum(y * g[i]))
            else:
                dr_sum, value = dr_sum + dr, value + float(jnp.sum(y * g[i]))
        # The unmapped weight's gradient sums the examples' (each quantized along its own 128
        # rows: the batch's rows are not one contraction).
        tu.assert_close(self, got[1][1], np.asarray(dr_sum), "float32", 3 * 128)
        self.assertAlmostEqual(float(got[0]), value, delta=1e-4 * abs(value))

    def test_flax_linear_trains_with_it(self):
        from flax import nnx  # noqa: PLC0415

        dot = functools.partial(jax_sm100.scaled_dot_general, configs=jax_sm100.DEEPSEEK_V3)
        model = nnx.Linear(256, 128, dot_general=dot, rngs=nnx.Rngs(0))
        x, t = _normal(0, (128, 256)), _normal(1, (128, 128))

        def loss(model):
            return jnp.mean((model(x) - t) ** 2)

        grads = nnx.grad(loss)(model)
        w, b = model.kernel[...], model.bias[...]
        y = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
        self.assertLess(_rel_err(model(x), y), 2 * _TOL["fp8_block128"])
        # The cotangent of the quantized forward's output.
        g = 2 * (np.asarray(model(x), np.float64) - np.asarray(t, np.float64)) / y.size
        self.assertLess(_rel_err(grads.kernel[...], np.asarray(x, np.float64).T @ g), 2**-3)
        np.testing.assert_allclose(grads.bias[...], g.sum(0), rtol=1e-2, atol=1e-6)

    def test_flax_finetune_example_trains_in_fp8(self):
        # examples/flax_finetune.py --fp8: an nnx transformer (attention projections through
        # LinearGeneral, MLP, head) with every projection on scaled_dot_general, AdamW; its
        # loss falls and stays within fp8's rounding of the same bfloat16 model on lax.
        proc = subprocess.run(
            [sys.executable, str(tu.REPO_ROOT / "examples" / "flax_finetune.py"), "--small",
             "--fp8", "--steps", "5"],
            env=tu.subprocess_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        self.assertIn(
            "ours fp8 (jax_sm100.scaled_dot_general, DEEPSEEK_V3): first step", proc.stdout
        )
        rows = re.findall(r"^ +\d+ +(\d+\.\d+) +(\d+\.\d+)$", proc.stdout, re.MULTILINE)
        ours, ref = np.array(rows, np.float64).T
        self.assertEqual(len(ours), 5, proc.stdout)
        self.assertLess(ours[-1], 0.8 * ours[0])
        np.testing.assert_allclose(ours, ref, rtol=2e-2)

    @parameterized.parameters(
        ("sm_90a", jax_sm100.DEEPSEEK_V3, "sm90_wgmma_scaled"),
        ("sm_100a", _MXFP8, "sm100_tcgen05_blockscaled"),
    )
    def test_a_training_step_for_cuda_runs_every_product_on_the_kernels(self, arch, configs,
                                                                        kernel):  # fmt: skip
        s = jax.ShapeDtypeStruct

        def loss(w, x):
            y = jax_sm100.scaled_dot_general(x, w, (((1,), (0,)), ((), ())), jnp.bfloat16, configs)
            return jnp.mean(y.astype(jnp.float32) ** 2)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        with (
            mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}),
            jax_sm100.lowerings() as seen,
        ):
            text = jax.export.export(
                step, platforms=["cuda"], disabled_checks=ffi.export_safety_checks()
            )(s((2048, 512), jnp.bfloat16), s((1024, 2048), jnp.bfloat16)).mlir_module()
        kernels = [lw.plan.kernel for lw in seen]
        products = [lw.plan.kernel for lw in seen if not lw.note.startswith("quantize_both")]
        self.assertEqual(products, [kernel] * 3, [lw.note for lw in seen])
        self.assertNotIn("stablehlo.dot_general", text)
        if arch == "sm_90a":
            # x and the weight (in the forward) and the cotangent (in the backward) are each
            # quantized both ways by one pass of the quantize_both kernel (the weight per 128
            # x 128 tile), whose scales come out as the product reads them. No operand or
            # cotangent is transposed whole; the transposes left are of scales.
            self.assertEqual(kernels.count("quantize_both"), 3, kernels)
            recipes = [lw.plan.recipe for lw in seen if lw.note.startswith("quantize_both")]
            self.assertEqual(sorted(recipes), ["fp8_block128"] * 2 + ["fp8_block128x128"])
            types = re.findall(r"stablehlo.transpose .* : \(tensor<([^>]*)>\)", text)
            for t in types:
                self.assertTrue(t.endswith("f32"), t)
            whole = [t for t in types if min(map(int, t.split("x")[1:3])) >= 512]
            self.assertEqual(whole, [], types)
            # The quantizations' calls have their own target: counting products counts
            # jax_sm100_gemm's.
            self.assertEqual(text.count("stablehlo.custom_call @jax_sm100_gemm"), 3)
            self.assertEqual(text.count("stablehlo.custom_call @jax_sm100_quantize"), 3)
            # Without a gradient each operand is quantized only the way its product reads it.
            with (
                mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}),
                jax_sm100.lowerings() as seen,
            ):
                args = s((2048, 512), jnp.bfloat16), s((1024, 2048), jnp.bfloat16)
                text = jax.export.export(
                    jax.jit(lambda w, x: loss(w, x)), platforms=["cuda"],
                    disabled_checks=ffi.export_safety_checks(),
                )(*args).mlir_module()  # fmt: skip
            self.assertEqual([lw.plan.kernel for lw in seen], [kernel])
            self.assertEqual(text.count("stablehlo.custom_call @jax_sm100_gemm"), 1)
            self.assertNotIn("custom_call @jax_sm100_quantize", text)

    @parameterized.parameters(jax_sm100.DEEPSEEK_V3, _MXFP8)
    def test_partial_blocks_are_padded_with_zeros(self, *configs):
        # k = 80, n = 40, m = 100: each contraction's last block is partial (of 32 and of 128),
        # scaled by its own values, as quantizing the operands padded with zeros scales it.
        x, w, g = _normal(0, (100, 80)), _normal(1, (80, 40)), _normal(2, (100, 40))
        y, dl, dr = _vjp(x, w, (((1,), (0,)), ((), ())), configs, g)
        padded = [np.pad(np.asarray(a), [(0, 128 - n) for n in a.shape]) for a in (x, w, g)]
        want = _expected(*padded[:2], (((1,), (0,)), ((), ())), configs, padded[2])
        tu.assert_close(self, np.asarray(y)[None], want[0][:, :100, :40], "float32", 80)
        tu.assert_close(self, np.asarray(dl)[None], want[1][:, :100, :80], "float32", 40)
        tu.assert_close(self, np.asarray(dr).T[None], want[2][:, :40, :80], "float32", 100)

    def test_errors_name_the_fix(self):
        x, w = _normal(0, (128, 256)), _normal(1, (256, 64))
        dn = (((1,), (0,)), ((), ()))
        f = functools.partial(jax_sm100.scaled_dot_general, dimension_numbers=dn)
        with self.assertRaisesRegex(ValueError, "give three"):
            f(x, w, configs=jax_sm100.DEEPSEEK_V3[:2])
        with self.assertRaisesRegex(ValueError, "use one of"):
            f(x, w, configs=("fp8", "fp8", "fp8"))
        with self.assertRaisesRegex(TypeError, "data is one of"):
            f(x, w, configs=(("fp8_block128", jnp.bfloat16),) * 3)
        with self.assertRaisesRegex(TypeError, "is int"):
            f(x, w, configs=(1, 2, 3))
        with self.assertRaisesRegex(ValueError, "all three configs or none"):
            f(x, w, configs=("nvfp4", "nvfp4", "mxfp8"))
        with self.assertRaisesRegex(TypeError, "pass precision=None"):
            f(x, w, configs=jax_sm100.DEEPSEEK_V3, precision=lax.Precision.HIGHEST)
        # Lists as (recipe, dtype) pairs, precision pairs of DEFAULT, and without configs the
        # precision goes to dot_general.
        y = f(x, w, configs=[["fp8_block128", jnp.float8_e5m2]] * 3,
              precision=(lax.Precision.DEFAULT, None))  # fmt: skip
        self.assertEqual(y.shape, (128, 64))
        y = f(x, w, precision=lax.Precision.HIGHEST)
        want = jax_sm100.dot_general(x, w, dn, lax.Precision.HIGHEST, jnp.float32)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
        with self.assertRaisesRegex(TypeError, "quantizes floating"):
            f(x.astype(jnp.int32), w, configs=jax_sm100.DEEPSEEK_V3)
        with self.assertRaisesRegex(TypeError, "preferred_element_type=int32"):
            f(x, w, preferred_element_type=jnp.int32, configs=jax_sm100.DEEPSEEK_V3)
        with self.assertRaisesRegex(TypeError, "dot_general requires contracting"):
            f(x, w.T, configs=jax_sm100.DEEPSEEK_V3)
        with self.assertRaisesRegex(TypeError, "is one config; give three"):
            f(x, w, configs="mxfp8")
        with self.assertRaisesRegex(TypeError, "is one config; give three"):
            f(x, w, configs=jax.nn.get_scaled_dot_general_config("mxfp8"))
        # A second derivative raises (it silently differentiated the quantization before).
        loss = lambda x: jnp.sum(f(x, w, configs=jax_sm100.DEEPSEEK_V3) ** 2)  # noqa: E731
        with self.assertRaisesRegex(NotImplementedError, "differentiate it once"):
            jax.grad(lambda x: jnp.sum(jax.grad(loss)(x) ** 2))(x)
        with self.assertRaisesRegex(NotImplementedError, "differentiate it once"):
            jax.hessian(lambda v: loss(x.at[0, :2].set(v)))(x[0, :2])
        bad = jax.nn.get_scaled_dot_general_config("mxfp8")
        with self.assertRaisesRegex(ValueError, "BlockScaleConfigs taken"):
            f(x, w, configs=[dataclasses.replace(bad, block_size=16)] * 3)
        # A BlockScaleConfig's other fields are read, not dropped: nvfp4's data dtype (it was
        # quantized to float4 whatever it said) and mxfp8's global scale (it was ignored).
        nv = jax.nn.get_scaled_dot_general_config("nvfp4", jnp.array([0.05], jnp.float32))
        with self.assertRaisesRegex(TypeError, r"configs\[0\] \(lhs\): nvfp4 data is one of"):
            f(x, w, configs=[dataclasses.replace(nv, data_type=jnp.float8_e4m3fn)] * 3)
        with self.assertRaisesRegex(ValueError, "mxfp8 takes none"):
            f(x, w, configs=[dataclasses.replace(bad, global_scale=jnp.float32(100.0))] * 3)


if __name__ == "__main__":
    absltest.main()
