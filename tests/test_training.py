"""Training on our kernels, checked on the CPU: what a compiled step runs, and its numbers.

The step is `value_and_grad` of a two-layer MLP block, `act(x @ w1 + b1) @ w2`. Exported for
CUDA here (the kernels are cross-compiled for sm_90a and sm_100a), every product of the module
must be our custom call, with 16-bit operands; the CPU numbers of the same rules (reference
lowering) must match float64 math, to second order.
"""

from __future__ import annotations

import functools
import os
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.test_util import check_grads

import jax_sm100
from jax_sm100._src import ffi
from jax_sm100._src import primitive as P
from tests import test_util as tu

jax.config.update("jax_enable_x64", True)


def _block(impl, act="gelu"):
    def block(params, x):
        w1, b1, w2 = params
        if impl == "ours":
            return jax_sm100.matmul(jax_sm100.matmul(x, w1, bias=b1, activation=act), w2)
        return P.apply_activation(x @ w1 + b1, act) @ w2

    return block


def _loss(block):
    def loss(params, x):
        return jnp.mean(block(params, x).astype(jnp.float32) ** 2)

    return loss


def _mlp_args(t, d, f, dtype, seed=0):
    rng = np.random.default_rng(seed)
    params = (tu.rand(rng, (d, f), dtype) * d**-0.5, tu.rand(rng, (f,), dtype) * 0.1,
              tu.rand(rng, (f, d), dtype) * f**-0.5)  # fmt: skip
    return tuple(p.astype(dtype) for p in params), tu.rand(rng, (t, d), dtype)


def _matmul_eqns(jaxpr):
    return [e for e in jaxpr.eqns if e.primitive.name == "jax_sm100_matmul"]


class StepStructureTest(parameterized.TestCase):
    """Which products a differentiated block binds (platform-independent jaxprs)."""

    def test_six_products_fused_forward_and_backward(self):
        params, x = _mlp_args(64, 32, 128, "bfloat16")
        step = jax.value_and_grad(_loss(_block("ours")), argnums=(0, 1))
        jaxpr = jax.make_jaxpr(step)(params, x).jaxpr
        eqns = _matmul_eqns(jaxpr)
        self.assertLen(eqns, 6)
        # The forward of layer 1 saves its pre-activation, in bfloat16, from the same kernel.
        self.assertEqual([e.params["save_preact"] for e in eqns].count(True), 1)
        fwd = next(e for e in eqns if e.params["save_preact"])
        self.assertEqual([v.aval.dtype for v in fwd.outvars], [jnp.bfloat16] * 2)
        # Layer 2's input gradient carries gelu' in its epilogue, reading z as C.
        (fused,) = [e for e in eqns if e.params["act_grad"] is not None]
        self.assertEqual(fused.params["act_grad"], "gelu")
        self.assertIs(fused.invars[2], fwd.outvars[1])
        # Every product takes 16-bit operands and writes 16 bits; nothing is left to XLA.
        for e in eqns:
            self.assertEqual({v.aval.dtype for v in e.invars[:2]}, {np.dtype(jnp.bfloat16)})
            self.assertEqual(e.outvars[0].aval.dtype, jnp.bfloat16)
        names = {e.primitive.name for e in jaxpr.eqns}
        self.assertNotIn("dot_general", names)
        self.assertNotIn("jax_sm100_act_grad_mul", names)  # no separate elementwise pass
        self.assertNotIn("tanh", names)

    def test_something_between_the_products_unfuses_correctly(self):
        # h * 2 is a new tangent: layer 2's backward is the plain product, and act' runs in XLA.
        params, x = _mlp_args(16, 8, 24, "float64", seed=3)

        def block(params, x):
            w1, b1, w2 = params
            h = jax_sm100.matmul(x, w1, bias=b1, activation="silu")
            return jax_sm100.matmul(h * 2.0, w2)

        def ref(params, x):
            w1, b1, w2 = params
            return jax.nn.silu(x @ w1 + b1) * 2.0 @ w2

        jaxpr = jax.make_jaxpr(jax.grad(_loss(block), argnums=(0, 1)))(params, x).jaxpr
        self.assertEqual([e.params["act_grad"] for e in _matmul_eqns(jaxpr)], [None] * 6)
        got = jax.grad(_loss(block), argnums=(0, 1))(params, x)
        want = jax.grad(_loss(ref), argnums=(0, 1))(params, x)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)

    def test_shared_weight_gradient_folds_the_batch(self):
        # vmap over examples with one weight: its gradient is one product over batch * rows.
        rng = np.random.default_rng(4)
        x, w = tu.rand(rng, (5, 12, 16), "bfloat16"), tu.rand(rng, (16, 24), "bfloat16")

        def loss(w):
            y = jax.vmap(lambda x: jax_sm100.matmul(x, w))(x)
            return jnp.sum(y.astype(jnp.float32) ** 2)

        eqns = _matmul_eqns(jax.make_jaxpr(jax.grad(loss))(w).jaxpr)
        self.assertLen(eqns, 2)
        wgrad = eqns[1]
        self.assertEqual(wgrad.invars[0].aval.shape, (1, 60, 16))  # [1, batch * m, k]
        self.assertEqual(wgrad.outvars[0].aval.shape, (1, 16, 24))

    @parameterized.parameters("relu", "gelu", "silu")
    def test_saved_residuals_no_larger_than_jnp(self, act):
        from jax._src.ad_checkpoint import saved_residuals

        params, x = _mlp_args(64, 32, 128, "bfloat16")

        def nbytes(block):
            res = saved_residuals(_loss(block), params, x)
            return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a, _ in res)

        self.assertLessEqual(nbytes(_block("ours", act)), nbytes(_block("jnp", act)))


class StepNumericsTest(parameterized.TestCase):
    @parameterized.parameters("relu", "gelu", "silu")
    def test_check_grads_two_layers(self, act):
        # float64: the fused backward (gated product, act' epilogue) and its own derivatives.
        # (At check_grads' default 1e-5 the finite differences of second order miss by 7e-4
        # here for the jnp.dot model as well: the tolerance is for both.)
        params, x = _mlp_args(6, 5, 7, "float64", seed=1)
        for impl in ("ours", "jnp"):
            check_grads(_loss(_block(impl, act)), (params, x), order=2, modes=("fwd", "rev"),
                        atol=2e-3, rtol=2e-3)  # fmt: skip

    @parameterized.parameters("relu", "gelu", "silu")
    def test_matches_jnp_in_float64(self, act):
        params, x = _mlp_args(12, 8, 16, "float64", seed=2)
        got = jax.value_and_grad(_loss(_block("ours", act)), argnums=(0, 1))(params, x)
        want = jax.value_and_grad(_loss(_block("jnp", act)), argnums=(0, 1))(params, x)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)

    def test_jitted_forward_over_reverse(self):
        # jit(hessian), jit(jacfwd) and jit(vmap(jvp)) batch the gated product over tangents
        # only: its saved pre-activation is then unbatched.
        params, x = _mlp_args(4, 3, 5, "float64", seed=8)

        def f(x, impl):
            return jnp.sum(_block(impl, "gelu")(params, x) ** 2)

        want = jax.hessian(lambda x: f(x, "jnp"))(x)
        np.testing.assert_allclose(jax.jit(jax.hessian(lambda x: f(x, "ours")))(x), want,
                                   rtol=1e-9, atol=1e-12)  # fmt: skip
        g = lambda x: _block("ours", "silu")(params, x)  # noqa: E731
        g_ref = lambda x: _block("jnp", "silu")(params, x)  # noqa: E731
        np.testing.assert_allclose(jax.jit(jax.jacfwd(g))(x), jax.jacfwd(g_ref)(x), rtol=1e-9,
                                   atol=1e-12)  # fmt: skip
        ts = jnp.stack([x, 2 * x])
        got = jax.jit(jax.vmap(lambda t: jax.jvp(g, (x,), (t,))[1]))(ts)
        ref = jax.vmap(lambda t: jax.jvp(g_ref, (x,), (t,))[1])(ts)
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)

    @parameterized.parameters("gelu", "silu")
    def test_overflowed_preactivation_gives_finite_gradients(self, act):
        # A float16 pre-activation below -65504 is saved as -inf; the activation's derivative
        # there is its limit (0), as the float32 forward's, not NaN.
        a = jnp.array([[300.0, 1.0]], jnp.float16)
        b = jnp.array([[-300.0, 0.5], [1.0, 0.25]], jnp.float16)  # z = [-89999, 0.75]
        loss = lambda a, b: jnp.sum(jax_sm100.matmul(a, b, activation=act).astype(jnp.float32))  # noqa: E731
        ga, gb = jax.grad(loss, argnums=(0, 1))(a, b)
        self.assertTrue(np.isfinite(np.asarray(ga, np.float32)).all(), ga)
        self.assertTrue(np.isfinite(np.asarray(gb, np.float32)).all(), gb)
        want = jax.grad(lambda a, b: jnp.sum(P.apply_activation(a @ b, act)), argnums=(0, 1))(
            a.astype(jnp.float32), b.astype(jnp.float32)
        )
        np.testing.assert_allclose(np.asarray(ga, np.float32), want[0], rtol=2e-3, atol=1e-3)

    def test_relu_derivative_selects(self):
        # Where relu is flat its derivative is a select of 0, whatever the cotangent, as
        # jax.nn.relu's: sqrt's infinite slope at a dead unit's 0 gave 0 * inf = NaN (eagerly
        # on the XLA path, and in the kernels' epilogue) where jax's gradient is finite.
        rng = np.random.default_rng(11)
        x, w, w2 = (tu.rand(rng, s, "float32") for s in ((8, 16), (16, 24), (24, 4)))

        def loss(impl, x, w):
            if impl == "ours":
                h = jax_sm100.matmul(jax_sm100.matmul(x, w, activation="relu"), w2)
                return jnp.sum(jnp.sqrt(jax_sm100.matmul(x, w, activation="relu"))) + h.sum()
            return jnp.sum(jnp.sqrt(jax.nn.relu(x @ w))) + (jax.nn.relu(x @ w) @ w2).sum()

        want = jax.grad(functools.partial(loss, "ref"), argnums=(0, 1))(x, w)
        self.assertTrue(all(np.isfinite(np.asarray(g)).all() for g in want))
        for grad in (jax.grad, lambda f, **kw: jax.jit(jax.grad(f, **kw))):
            got = grad(functools.partial(loss, "ours"), argnums=(0, 1))(x, w)
            for g, r in zip(got, want, strict=True):
                np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)

    def test_fp8_output_saves_a_bfloat16_preactivation(self):
        rng = np.random.default_rng(9)
        a, b = tu.rand(rng, (8, 16), "bfloat16"), tu.rand(rng, (16, 4), "bfloat16")
        f = lambda a: jax_sm100.matmul(a, b * 100, activation="gelu", out_dtype="float8_e4m3fn")  # noqa: E731
        eqns = _matmul_eqns(jax.make_jaxpr(jax.grad(lambda a: jnp.sum(
            f(a).astype(jnp.float32))))(a).jaxpr)  # fmt: skip
        fwd = next(e for e in eqns if e.params["save_preact"])
        self.assertEqual([v.aval.dtype.name for v in fwd.outvars], ["float8_e4m3fn", "bfloat16"])

    def test_bfloat16_step_against_float32(self):
        params, x = _mlp_args(64, 32, 128, "bfloat16", seed=5)
        f32 = jax.tree.map(lambda v: v.astype(jnp.float32), (params, x))
        got = jax.jit(jax.grad(_loss(_block("ours")), argnums=(0, 1)))(params, x)
        want = jax.grad(_loss(_block("jnp")), argnums=(0, 1))(*f32)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            self.assertEqual(g.dtype, jnp.bfloat16)
            err = np.linalg.norm(np.asarray(g, np.float64) - w) / np.linalg.norm(w)
            self.assertLess(err, 1e-2)

    def test_float32_output_cotangent_runs_in_operand_dtype(self):
        # out_dtype float32 with bfloat16 operands: the float32 cotangent is rounded to
        # bfloat16 for the backward products (the operands' dtype), as mixed precision does.
        rng = np.random.default_rng(6)
        a, b = tu.rand(rng, (8, 16), "bfloat16"), tu.rand(rng, (16, 4), "bfloat16")
        loss = lambda a, b: jnp.sum(jax_sm100.matmul(a, b, out_dtype=jnp.float32) ** 2)  # noqa: E731
        eqns = _matmul_eqns(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(a, b).jaxpr)
        for e in eqns[1:]:
            self.assertEqual({v.aval.dtype for v in e.invars[:2]}, {np.dtype(jnp.bfloat16)})

    def test_fp8_operands_differentiate_in_bfloat16(self):
        rng = np.random.default_rng(7)
        a, b = tu.rand(rng, (8, 16), "float8_e4m3fn"), tu.rand(rng, (16, 4), "float8_e4m3fn")
        ct = tu.rand(rng, (8, 4), "float32") * 0.25  # keeps the gradients inside fp8's range

        def loss(a, b):
            return jnp.sum(jax_sm100.matmul(a, b).astype(jnp.float32) * ct)

        ga, gb = jax.grad(loss, argnums=(0, 1))(a, b)
        self.assertEqual((ga.dtype, gb.dtype), (a.dtype, b.dtype))
        # The backward products themselves take bfloat16 operands (not fp8, not float32).
        eqns = _matmul_eqns(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(a, b).jaxpr)
        self.assertLen(eqns, 3)
        for e in eqns[1:]:
            self.assertEqual({v.aval.dtype for v in e.invars[:2]}, {np.dtype(jnp.bfloat16)})
        a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
        wa, wb = jax.grad(lambda a, b: jnp.sum((a @ b) * ct), argnums=(0, 1))(a32, b32)
        tu.assert_close(self, ga, wa, "float8_e4m3fn", 16)
        tu.assert_close(self, gb, wb, "float8_e4m3fn", 8)


class BackwardEpilogueTransposeTest(absltest.TestCase):
    # The transposes of the backward epilogues themselves, which ordinary higher-order AD does
    # not reach (their derivatives decompose into plain products): jax.linear_transpose does.
    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(8)
        self.a, self.b = tu.rand(rng, (6, 5), "float32"), tu.rand(rng, (5, 7), "float32")
        self.z = tu.rand(rng, (6, 7), "float32")
        self.ct = tu.rand(rng, (6, 7), "float32")
        self.act = lambda z: np.asarray(P.activation_grad(jnp.asarray(z, jnp.float64), "gelu"))

    def test_act_grad_product_in_a(self):
        # act'(z) * (2 a @ b), linear in a: its transpose is 2 (act'(z) * ct) @ b^T.
        params = dict(
            transpose_a=False, transpose_b=False, alpha=2.0, beta=1.0, activation=None,
            out_dtype=np.dtype(jnp.float32), has_bias=False, has_c=True, plan=None,
            save_preact=False, act_grad="gelu",
        )  # fmt: skip
        f = lambda x: P.matmul_p.bind(x, self.b, self.z, **params)[0]  # noqa: E731
        with jax.enable_x64(True):
            (got,) = jax.linear_transpose(f, self.a)(self.ct)
            ct64, b64 = np.asarray(self.ct, np.float64), np.asarray(self.b, np.float64)
            want = 2.0 * (self.act(self.z) * ct64) @ b64.T
        tu.assert_close(self, got, want, "float32", 5)

    def test_gated_product_in_b(self):
        # (act'(z) * a) @ (3 b), linear in b: its transpose is 3 (act'(z) * a)^T @ ct.
        from jax_sm100._src import autodiff  # noqa: PLC0415

        a = tu.rand(np.random.default_rng(9), (6, 7), "float32")
        b = tu.rand(np.random.default_rng(10), (7, 5), "float32")
        ct = tu.rand(np.random.default_rng(11), (6, 5), "float32")
        params = dict(activation="gelu", transpose_a=False, transpose_b=False, alpha=3.0,
                      out_dtype=np.dtype(jnp.float32))  # fmt: skip
        f = lambda y: autodiff.gated_matmul_p.bind(a, self.z, y, **params)  # noqa: E731
        with jax.enable_x64(True):
            (got,) = jax.linear_transpose(f, b)(ct)
            gated = self.act(self.z) * np.asarray(a, np.float64)
            want = 3.0 * gated.T @ np.asarray(ct, np.float64)
        tu.assert_close(self, got, want, "float32", 7)


def _export_step(arch, t, d, f):
    s = jax.ShapeDtypeStruct
    params = (s((d, f), jnp.bfloat16), s((f,), jnp.bfloat16), s((f, d), jnp.bfloat16))
    step = jax.jit(jax.value_and_grad(_loss(_block("ours")), argnums=(0, 1)))
    with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}):
        exp = jax.export.export(
            step, platforms=["cuda"], disabled_checks=ffi.export_safety_checks()
        )(params, s((t, d), jnp.bfloat16))
    return exp.mlir_module()


class CudaStepTest(parameterized.TestCase):
    """The compiled step for CUDA, lowered on this CPU machine with the kernels cross-compiled."""

    @parameterized.parameters("sm_90a", "sm_100a")
    def test_every_product_is_our_kernel(self, arch):
        # Each product is 2 * 2048 * 1024 * 4096 = 2^34 FLOPs, above the sm_90a planner's
        # small-problem rule (planning.SM90_MIN_FLOPS), so none goes to XLA's dot.
        text = _export_step(arch, 2048, 1024, 4096)
        calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_sm100_gemm" in ln]
        self.assertLen(calls, 6)
        self.assertNotIn("stablehlo.dot_general", text)
        self.assertNotIn("stablehlo.tanh", text)  # gelu and gelu' only inside the kernels
        signatures = [re.search(r"\(([^()]*)\) -> (.*) loc", ln).groups() for ln in calls]
        for operands, _ in signatures:
            for t in operands.split(", ")[:2]:
                self.assertRegex(t, r"xbf16>$", f"a product operand is {t}")
        outputs = [out.count("tensor<") for _, out in signatures]
        self.assertEqual(sorted(outputs), [1, 1, 1, 1, 1, 2])  # the forward also writes z
        operand_counts = sorted(ops.count("tensor<") for ops, _ in signatures)
        self.assertEqual(operand_counts, [2, 2, 2, 2, 3, 3])  # (x, w1, b1) and (g, w2, z)


if __name__ == "__main__":
    absltest.main()
