"""Flax models on `jax_sm100.dot_general` and `jax_sm100.flax` (flax is in the test extra).

Training steps of nnx and linen models must give the losses of the same models on
`lax.dot_general`; the fused layers must keep Flax's parameters and match the unfused layer
followed by its activation; and a training step exported for CUDA on this CPU machine must run
every product on our custom call.
"""

from __future__ import annotations

import os
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from flax import linen, nnx
from jax import lax

import jax_sm100
from jax_sm100 import flax as sm100_flax
from jax_sm100._src import ffi
from tests import test_util as tu

DOT_GENERALS = {"ours": jax_sm100.dot_general, "lax": lax.dot_general}
STEPS = 4
# float32 products on a GPU run in TF32, ours and XLA's alike (JAX's default precision): each
# operand keeps 10 of its 23 mantissa bits, so the two differ by about 1e-3 of a result where on
# a CPU (both in float32) they agree to float32 rounding.
F32_TOL = 1e-5 if jax.default_backend() == "cpu" else 5e-3


class Mlp(nnx.Module):
    """x -> down(gelu(up(x))), with `up` fused (`jax_sm100.flax.Linear`) or not."""

    def __init__(self, d, h, *, dot_general, dtype=None, fused=False, rngs):
        if fused:
            self.up = sm100_flax.Linear(d, h, activation="gelu", dtype=dtype, rngs=rngs)
        else:
            self.up = nnx.Linear(d, h, dot_general=dot_general, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(h, d, dot_general=dot_general, dtype=dtype, rngs=rngs)
        self.fused = fused

    def __call__(self, x):
        h = self.up(x)
        return self.down(h if self.fused else nnx.gelu(h))


# Biases drawn at random (Flax's default is zeros), so that a layer dropping one is seen.
NNX_BIAS = nnx.initializers.normal(1.0)
LINEN_BIAS = linen.initializers.normal(1.0)


def _data(shape, seed=0):
    rng = np.random.default_rng(seed)
    return tu.rand(rng, shape, "float32"), tu.rand(rng, shape, "float32")


def _mse(out, y):
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def _train_nnx(model, x, y, steps=STEPS):
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: _mse(m(x), y))(model)
        optimizer.update(model, grads)
        return loss

    return np.array([float(step(model, optimizer, x, y)) for _ in range(steps)])


def _train_linen(module, x, y, steps=STEPS):
    params = module.init(jax.random.key(0), x)
    tx = optax.adam(1e-2)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(lambda p: _mse(module.apply(p, x), y))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    return np.array(losses)


def _matmul_count(fn, *args):
    return str(jax.make_jaxpr(fn)(*args)).count("jax_sm100_matmul")


class NnxTest(parameterized.TestCase):
    @parameterized.named_parameters(("float32", None, F32_TOL), ("bfloat16", jnp.bfloat16, 2e-2))
    def test_training_losses_match_lax(self, dtype, rtol):
        x, y = _data((4, 16, 64))
        losses = {
            name: _train_nnx(Mlp(64, 128, dot_general=dg, dtype=dtype, rngs=nnx.Rngs(0)), x, y)
            for name, dg in DOT_GENERALS.items()
        }
        self.assertLess(losses["ours"][-1], losses["ours"][0])  # it trains
        np.testing.assert_allclose(losses["ours"], losses["lax"], rtol=rtol)

    def test_fused_linear_trains_as_the_unfused_model(self):
        x, y = _data((4, 16, 64), seed=1)
        fused = Mlp(64, 128, dot_general=jax_sm100.dot_general, fused=True, rngs=nnx.Rngs(0))
        plain = Mlp(64, 128, dot_general=lax.dot_general, rngs=nnx.Rngs(0))
        np.testing.assert_allclose(_train_nnx(fused, x, y), _train_nnx(plain, x, y), rtol=F32_TOL)

    def test_products_bind_the_primitive(self):
        model = Mlp(64, 128, dot_general=jax_sm100.dot_general, rngs=nnx.Rngs(0))
        x, _ = _data((4, 16, 64))
        self.assertEqual(_matmul_count(lambda x: model(x), x), 2)

    @parameterized.parameters(None, "relu", "gelu", "silu")
    def test_fused_linear_is_linear_then_activation(self, activation):
        fused = sm100_flax.Linear(48, 40, activation=activation, bias_init=NNX_BIAS,
                                  rngs=nnx.Rngs(3))  # fmt: skip
        plain = nnx.Linear(48, 40, bias_init=NNX_BIAS, rngs=nnx.Rngs(3))
        # The same parameters, names and initial values: checkpoints carry over.
        self.assertEqual(
            jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(fused, nnx.Param))),
            jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(plain, nnx.Param))),
        )
        np.testing.assert_array_equal(fused.kernel[...], plain.kernel[...])
        np.testing.assert_array_equal(fused.bias[...], plain.bias[...])
        self.assertGreater(float(jnp.min(jnp.abs(plain.bias[...]))), 0.0)
        x = _data((3, 5, 48))[0]
        want = plain(x)
        if activation is not None:
            want = {"relu": nnx.relu, "gelu": nnx.gelu, "silu": nnx.silu}[activation](want)
        np.testing.assert_allclose(fused(x), want, rtol=F32_TOL, atol=F32_TOL)
        self.assertEqual(_matmul_count(lambda x: fused(x), x), 1)
        self.assertNotIn("add", str(jax.make_jaxpr(lambda x: fused(x))(x)))

    def test_fused_layers_meet_a_highest_precision_on_lax(self):
        x = _data((3, 5, 48))[0]
        plain = nnx.Linear(48, 40, precision="highest", bias_init=NNX_BIAS, rngs=nnx.Rngs(3))
        fused = sm100_flax.Linear(48, 40, activation="silu", precision="highest",
                                  bias_init=NNX_BIAS, rngs=nnx.Rngs(3))  # fmt: skip
        self.assertEqual(_matmul_count(lambda x: fused(x), x), 0)
        np.testing.assert_allclose(fused(x), nnx.silu(plain(x)), rtol=1e-6, atol=1e-6)
        default = sm100_flax.Linear(48, 40, activation="silu", rngs=nnx.Rngs(3))
        with jax.default_matmul_precision("highest"):
            self.assertEqual(_matmul_count(lambda x: default(x), x), 0)
        dense = sm100_flax.Dense(40, activation="relu", precision="highest",
                                 bias_init=LINEN_BIAS)  # fmt: skip
        params = dense.init(jax.random.key(0), x)
        self.assertEqual(_matmul_count(lambda p: dense.apply(p, x), params), 0)
        want = linen.relu(linen.Dense(40, precision="highest").apply(params, x))
        np.testing.assert_allclose(dense.apply(params, x), want, rtol=1e-6, atol=1e-6)
        # Under a strict rank promotion too (the bias added as linen.Dense adds it).
        with jax.numpy_rank_promotion("raise"):
            np.testing.assert_allclose(dense.apply(params, x), want, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(fused(x), nnx.silu(plain(x)), rtol=1e-6, atol=1e-6)

    def test_fused_linear_keeps_preferred_element_type_and_dtype(self):
        x = _data((4, 16))[0].astype(jnp.bfloat16)
        for kwargs in (
            dict(param_dtype=jnp.bfloat16, preferred_element_type=jnp.float32),
            dict(dtype=jnp.bfloat16),  # float32 parameters computed in bfloat16
        ):
            fused = sm100_flax.Linear(16, 8, bias_init=NNX_BIAS, rngs=nnx.Rngs(1), **kwargs)
            plain = nnx.Linear(16, 8, bias_init=NNX_BIAS, rngs=nnx.Rngs(1), **kwargs)
            got, want = fused(x), plain(x)
            self.assertEqual(got.dtype, want.dtype, kwargs)
            tu.assert_close(self, got, want.astype(jnp.float32), "bfloat16", 16)
        self.assertEqual(fused(x.astype(jnp.float32)).dtype, jnp.bfloat16)

    def test_narrow_preferred_element_type_promotes_with_the_bias_as_flax(self):
        # Flax's `y + bias` widens a bfloat16 product to a float32 bias; the fused layer gave
        # bfloat16 on the kernel path and float32 on the HIGHEST fallback (review helper-160).
        x = _data((4, 16))[0]
        for prec in (None, "highest"):
            kw = dict(preferred_element_type=jnp.bfloat16, precision=prec, bias_init=NNX_BIAS)
            want = nnx.Linear(16, 8, rngs=nnx.Rngs(0), **kw)(x)
            got = sm100_flax.Linear(16, 8, rngs=nnx.Rngs(0), **kw)(x)
            self.assertEqual(got.dtype, want.dtype, prec)
            # Flax rounds the product to bfloat16 before the bias; the fused layer does not.
            tu.assert_close(self, got, want, "bfloat16", 16)
            no_bias = dict(kw, use_bias=False)
            self.assertEqual(sm100_flax.Linear(16, 8, rngs=nnx.Rngs(0), **no_bias)(x).dtype,
                             jnp.bfloat16)  # fmt: skip

    def test_relu_derivative_is_zero_at_zero_on_every_path(self):
        # Rows of zeros (padding) with a zero bias: the pre-activation is exactly 0, where
        # jax.nn.relu's derivative is 0 (as the kernels' select), on the fused product and on
        # the lax fallback that a HIGHEST precision takes alike.
        x = jnp.zeros((2, 4), jnp.float32)
        w = jnp.ones((4, 3), jnp.float32)
        for prec in (None, "highest"):
            fused = sm100_flax.Linear(4, 3, activation="relu", precision=prec, rngs=nnx.Rngs(0))
            got = nnx.grad(lambda m: jnp.sum(m(x)))(fused).bias[...]
            np.testing.assert_array_equal(got, np.zeros(3), err_msg=str(prec))
            dense = sm100_flax.Dense(3, activation="relu", precision=prec)
            params = dense.init(jax.random.key(0), x)
            got = jax.grad(lambda p, d=dense: jnp.sum(d.apply(p, x)))(params)["params"]["bias"]
            np.testing.assert_array_equal(got, np.zeros(3), err_msg=str(prec))
            dx = jax.grad(lambda x, p=prec: jnp.sum(jax_sm100.matmul(x, w, activation="relu",
                                                                     precision=p)))(x)  # fmt: skip
            np.testing.assert_array_equal(dx, np.zeros((2, 4)), err_msg=str(prec))

    @parameterized.parameters(jnp.float8_e4m3fn, jnp.float8_e5m2)
    def test_fp8_layers_return_flax_result_dtype(self, dtype):
        # Flax computes in `dtype` and returns it (lax.dot_general of two fp8s is fp8); the
        # fused layers do the same, on the kernel and on the HIGHEST-precision fallback.
        x = _data((4, 32))[0]
        for prec in (None, "highest"):
            fused = sm100_flax.Linear(32, 16, dtype=dtype, precision=prec, bias_init=NNX_BIAS,
                                      rngs=nnx.Rngs(1))  # fmt: skip
            plain = nnx.Linear(32, 16, dtype=dtype, precision=prec, bias_init=NNX_BIAS,
                               rngs=nnx.Rngs(1))  # fmt: skip
            got, want = fused(x), plain(x)
            self.assertEqual(got.dtype, want.dtype, prec)
            # One unit in the last place apart at most: Flax rounds the product and the sum
            # with the bias, the kernel once (2^-3 relative spacing for e4m3, 2^-2 for e5m2).
            tol = 0.13 if dtype == jnp.float8_e4m3fn else 0.26
            np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                                       rtol=tol, atol=tol)  # fmt: skip
            params = linen.Dense(16, bias_init=LINEN_BIAS).init(jax.random.key(0), x)
            got = sm100_flax.Dense(16, dtype=dtype, precision=prec).apply(params, x)
            want = linen.Dense(16, dtype=dtype, precision=prec).apply(params, x)
            self.assertEqual(got.dtype, want.dtype, prec)
        # A promote_dtype that leaves the dtypes mixed: lax's result dtype, as Flax's layer
        # gives (jnp's promotion refuses fp8 beside another float).
        # (Weights drawn in float32 and rounded: Flax's default initializer draws in the
        # parameter dtype, and XLA's GPU backend has no fp8 erf.)
        keep = dict(
            promote_dtype=lambda args, dtype=None: args,
            kernel_init=lambda key, shape, d: jax.random.normal(key, shape).astype(d),
        )
        for param_dtype in (jnp.bfloat16, jnp.float8_e5m2):
            xq = x.astype(jnp.float8_e4m3fn)
            fused = sm100_flax.Linear(32, 16, param_dtype=param_dtype, rngs=nnx.Rngs(1), **keep)
            plain = nnx.Linear(32, 16, param_dtype=param_dtype, rngs=nnx.Rngs(1), **keep)
            self.assertEqual(fused(xq).dtype, plain(xq).dtype, param_dtype)

    def test_complex_layers_compute_as_flax(self):
        # The kernels take floating dtypes: complex inputs or parameters run as the Flax layer on
        # jax_sm100.dot_general does (lax's dot), not into matmul's dtype error.
        x = (_data((3, 8))[0] + 1j * _data((3, 8), seed=1)[0]).astype(jnp.complex64)
        for kwargs in (dict(), dict(param_dtype=jnp.complex64)):
            fused = sm100_flax.Linear(8, 5, rngs=nnx.Rngs(2), **kwargs)
            plain = nnx.Linear(8, 5, rngs=nnx.Rngs(2), **kwargs)
            np.testing.assert_allclose(fused(x), plain(x), rtol=1e-6, atol=1e-6)
        params = linen.Dense(5).init(jax.random.key(0), x)
        np.testing.assert_allclose(
            sm100_flax.Dense(5).apply(params, x),
            linen.Dense(5).apply(params, x),
            rtol=1e-6,
            atol=1e-6,
        )

    def test_fused_linear_rejects_dot_general_and_bad_activation(self):
        with self.assertRaisesRegex(TypeError, "takes no dot_general"):
            sm100_flax.Linear(4, 4, dot_general=lax.dot_general, rngs=nnx.Rngs(0))
        with self.assertRaisesRegex(ValueError, "unknown activation='tanh'"):
            sm100_flax.Linear(4, 4, activation="tanh", rngs=nnx.Rngs(0))

    def test_einsum_and_linear_general(self):
        x = _data((16, 11, 32))[0]
        ours = nnx.Einsum("nta,hab->nthb", (8, 32, 4), (8, 4), einsum_op=jax_sm100.einsum,
                          rngs=nnx.Rngs(0))  # fmt: skip
        ref = nnx.Einsum("nta,hab->nthb", (8, 32, 4), (8, 4), rngs=nnx.Rngs(0))
        np.testing.assert_allclose(ours(x), ref(x), rtol=F32_TOL, atol=F32_TOL)
        self.assertEqual(_matmul_count(lambda x: ours(x), x), 1)
        ours = nnx.LinearGeneral((11, 32), (4, 5), axis=(-2, -1),
                                 dot_general=jax_sm100.dot_general, rngs=nnx.Rngs(0))  # fmt: skip
        ref = nnx.LinearGeneral((11, 32), (4, 5), axis=(-2, -1), rngs=nnx.Rngs(0))
        np.testing.assert_allclose(ours(x), ref(x), rtol=F32_TOL, atol=F32_TOL)
        self.assertEqual(_matmul_count(lambda x: ours(x), x), 1)


class LinenMlp(linen.Module):
    dot_general: object = None
    fused: bool = False

    @linen.compact
    def __call__(self, x):
        if self.fused:
            h = sm100_flax.Dense(96, activation="gelu")(x)
        else:
            h = linen.gelu(linen.Dense(96, dot_general=self.dot_general)(x))
        h = linen.DenseGeneral((4, 8), dot_general=self.dot_general)(h)
        return linen.DenseGeneral(x.shape[-1], axis=(-2, -1), dot_general=self.dot_general)(h)


class LinenTest(parameterized.TestCase):
    def test_training_losses_match_lax(self):
        x, y = _data((4, 16, 64), seed=2)
        ours = _train_linen(LinenMlp(jax_sm100.dot_general), x, y)
        ref = _train_linen(LinenMlp(lax.dot_general), x, y)
        self.assertLess(ours[-1], ours[0])
        np.testing.assert_allclose(ours, ref, rtol=F32_TOL)
        fused = _train_linen(LinenMlp(jax_sm100.dot_general, fused=True), x, y)
        np.testing.assert_allclose(fused, ref, rtol=F32_TOL)

    def test_products_bind_the_primitive(self):
        module = LinenMlp(jax_sm100.dot_general, fused=True)
        x = _data((4, 16, 64))[0]
        params = module.init(jax.random.key(0), x)
        self.assertEqual(_matmul_count(lambda p: module.apply(p, x), params), 3)

    def test_fused_dense_rejects_dot_general_and_bad_activation_when_made(self):
        with self.assertRaisesRegex(TypeError, "takes no dot_general"):
            sm100_flax.Dense(4, dot_general=lax.dot_general)
        with self.assertRaisesRegex(ValueError, "unknown activation='tanh'"):
            sm100_flax.Dense(4, activation="tanh")

    def test_fused_dense_keeps_dense_parameters(self):
        x = _data((3, 48))[0]
        params = linen.Dense(40, bias_init=LINEN_BIAS).init(jax.random.key(0), x)
        fused = sm100_flax.Dense(40, activation="relu")
        self.assertEqual(
            jax.tree.map(jnp.shape, fused.init(jax.random.key(0), x)),
            jax.tree.map(jnp.shape, params),
        )
        want = linen.relu(linen.Dense(40).apply(params, x))
        np.testing.assert_allclose(fused.apply(params, x), want, rtol=F32_TOL, atol=F32_TOL)

    def test_fused_dense_computes_in_its_dtype(self):
        x = _data((3, 48))[0]
        params = linen.Dense(40, bias_init=LINEN_BIAS).init(jax.random.key(0), x)
        got = sm100_flax.Dense(40, dtype=jnp.bfloat16).apply(params, x)
        want = linen.Dense(40, dtype=jnp.bfloat16).apply(params, x)
        self.assertEqual(got.dtype, jnp.bfloat16)
        tu.assert_close(self, got, want.astype(jnp.float32), "bfloat16", 48)


def _export_nnx_step(arch, fused, t=2048, d=1024, h=4096):
    """value_and_grad of the Mlp's loss, bfloat16 compute, exported for CUDA on this machine."""
    model = Mlp(d, h, dot_general=jax_sm100.dot_general, dtype=jnp.bfloat16, fused=fused,
                rngs=nnx.Rngs(0))  # fmt: skip
    graphdef, params = nnx.split(model)

    def loss(params, x, y):
        return _mse(nnx.merge(graphdef, params)(x), y)

    s = jax.ShapeDtypeStruct
    avals = jax.tree.map(lambda p: s(p.shape, p.dtype), params)
    step = jax.jit(jax.value_and_grad(loss))
    with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}):
        exp = jax.export.export(
            step, platforms=["cuda"], disabled_checks=ffi.export_safety_checks()
        )(avals, s((t, d), jnp.float32), s((t, d), jnp.float32))
    return exp.mlir_module()


class CudaStepTest(parameterized.TestCase):
    """An nnx training step lowered for CUDA on this CPU machine (kernels cross-compiled)."""

    @parameterized.named_parameters(("sm_90a", "sm_90a", False), ("sm_100a_fused", "sm_100a", True))
    def test_every_product_is_our_kernel(self, arch, fused):
        # Each product is 2 * 2048 * 1024 * 4096 = 2^34 FLOPs, above the sm_90a planner's
        # small-problem rule, so none goes to XLA's dot. The input is not differentiated: two
        # forward products, the hidden layer's input gradient, and two weight gradients.
        text = _export_nnx_step(arch, fused)
        calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_sm100_gemm" in ln]
        self.assertLen(calls, 5)
        self.assertNotIn("stablehlo.dot_general", text)
        signatures = [re.search(r"\(([^()]*)\) -> (.*) loc", ln).groups() for ln in calls]
        operands = sorted(ops.count("tensor<") for ops, _ in signatures)
        outputs = sorted(outs.count("tensor<") for _, outs in signatures)
        if fused:
            # gelu in the forward kernel (x, w1, b1 in; h and z out), gelu' in the kernel of
            # the hidden layer's gradient (g, w2, z in): Flax's layers keep autodiff's fusion.
            self.assertEqual(operands, [2, 2, 2, 3, 3])
            self.assertEqual(outputs, [1, 1, 1, 1, 2])
            self.assertNotIn("stablehlo.tanh", text)
        else:
            self.assertEqual(operands, [2] * 5)


if __name__ == "__main__":
    absltest.main()
