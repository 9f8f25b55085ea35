"""GPU tests of training on our kernels: gradients of every epilogue, layout and batch form.

Each gradient is checked against the same math in float32 `jnp` (on the same bfloat16-rounded
inputs), and the compiled program is checked to run every product on our kernel. Runs on an
SM90 device (`python -m pytest tests/test_gpu_training.py`); skipped elsewhere. Small problems are
put on our kernels (`JAX_SM100_SMALL_PROBLEMS=kernel`), as the planner would send them to XLA.
"""

import itertools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_sm100
from jax_sm100._src import dispatch
from jax_sm100._src import primitive as P

ACTS = (None, "relu", "gelu", "silu")


def _arch():
    try:
        return getattr(dispatch.device_target(), "arch", None)
    except Exception:
        return None


def _normal(key, shape, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16)


def _f32(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _products(fn, *args) -> tuple[int, int]:
    """(our kernel calls, XLA products) in the compiled program of `fn`."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    ours = text.count('custom_call_target="jax_sm100_gemm"')
    xla = sum(" dot(" in ln or '"__cublas' in ln for ln in text.splitlines())
    return ours, xla


@absltest.skipIf(_arch() != "sm_90a", "needs an SM90 (Hopper) CUDA device and jax[cuda]")
class GradientTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        patcher = mock.patch.dict(os.environ, {"JAX_SM100_SMALL_PROBLEMS": "kernel"})
        patcher.start()
        self.addCleanup(patcher.stop)

    def assert_grads_close(self, got, want, tol=2e-2):
        for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
            self.assertEqual(g.shape, w.shape)
            self.assertEqual(g.dtype, jnp.bfloat16, f"gradient {i} is {g.dtype}")
            err = _rel_err(g, w)
            self.assertLess(err, tol, f"gradient {i}: relative error {err:.3g}")

    @parameterized.parameters(
        dict(act=act, bias=bias, c=c, alpha_beta=ab)
        for act, bias, c, ab in itertools.product(
            ACTS, (False, True), (False, True), ((1.0, 1.0), (0.5, -2.0))
        )
    )
    def test_every_epilogue(self, act, bias, c, alpha_beta):
        # Not multiples of the tiles; every contiguous dim a multiple of 8 (TMA's 16 bytes).
        m, n, k = 200, 136, 520
        alpha, beta = alpha_beta
        ks = jax.random.split(jax.random.key(m + 3 * bias + 5 * c), 5)
        a, b = _normal(ks[0], (m, k)), _normal(ks[1], (k, n), k**-0.5)
        args = [a, b, _normal(ks[2], (n,)) if bias else None, _normal(ks[3], (m, n)) if c else None]
        ct = _normal(ks[4], (m, n))

        def ours(a, b, bias, c):
            y = jax_sm100.matmul(a, b, bias=bias, c=c, alpha=alpha, beta=beta, activation=act)
            return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))

        def ref(a, b, bias, c):
            z = alpha * (a @ b)
            if c is not None:
                z = z + beta * c
            if bias is not None:
                z = z + bias
            return jnp.sum(P.apply_activation(z, act) * ct.astype(jnp.float32))

        nums = tuple(i for i, x in enumerate(args) if x is not None)
        got = jax.jit(jax.grad(ours, argnums=nums))(*args)
        want = jax.grad(ref, argnums=nums)(*_f32(args))
        self.assert_grads_close(got, want)
        # The input and weight gradients, and the forward where the activation's derivative
        # needs its pre-activation (a linear epilogue's gradient does not read the forward).
        kernels, xla = _products(jax.grad(ours, argnums=nums), *args)
        self.assertEqual((kernels, xla), (2 + (act is not None), 0))

    @parameterized.parameters(itertools.product((False, True), (False, True)))
    def test_layouts(self, transpose_a, transpose_b):
        # The primitive's transposed operands (what the backward binds): grads in both layouts.
        m, n, k = 264, 200, 136
        ks = jax.random.split(jax.random.key(11), 3)
        a = _normal(ks[0], (1, k, m) if transpose_a else (1, m, k))
        b = _normal(ks[1], (1, n, k) if transpose_b else (1, k, n), k**-0.5)
        ct = _normal(ks[2], (1, m, n))
        params = dict(
            transpose_a=transpose_a, transpose_b=transpose_b, alpha=1.0, beta=1.0,
            activation="silu", out_dtype=np.dtype(jnp.bfloat16), has_bias=False, has_c=False,
            plan=None, save_preact=False, act_grad=None,
        )  # fmt: skip

        def ours(a, b):
            (y,) = P.matmul_p.bind(a, b, **params)
            return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))

        def ref(a, b):
            aa = jnp.swapaxes(a, -1, -2) if transpose_a else a
            bb = jnp.swapaxes(b, -1, -2) if transpose_b else b
            return jnp.sum(jax.nn.silu(aa @ bb) * ct.astype(jnp.float32))

        got = jax.jit(jax.grad(ours, argnums=(0, 1)))(a, b)
        self.assert_grads_close(got, jax.grad(ref, argnums=(0, 1))(*_f32((a, b))))
        self.assertEqual(_products(jax.grad(ours, argnums=(0, 1)), a, b), (3, 0))

    @parameterized.named_parameters(
        ("shared_weight_3d", (4, 96, 136), (136, 200)),
        ("batched_both", (3, 96, 136), (3, 136, 200)),
        ("broadcast_a", (1, 96, 136), (3, 136, 200)),
        ("broadcast_mixed", (2, 1, 96, 136), (1, 3, 136, 200)),
    )
    def test_batch_and_broadcast(self, a_shape, b_shape):
        ks = jax.random.split(jax.random.key(len(a_shape) + a_shape[0]), 4)
        a, b = _normal(ks[0], a_shape), _normal(ks[1], b_shape, 136**-0.5)
        bias = _normal(ks[2], (b_shape[-1],))
        out_shape = jnp.broadcast_shapes(a_shape[:-2], b_shape[:-2]) + (a_shape[-2], b_shape[-1])
        ct = _normal(ks[3], out_shape)

        def ours(a, b, bias):
            y = jax_sm100.matmul(a, b, bias=bias, activation="gelu")
            return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))

        def ref(a, b, bias):
            y = jax.nn.gelu(jnp.matmul(a, b) + bias, approximate=True)
            return jnp.sum(y * ct.astype(jnp.float32))

        got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(a, b, bias)
        self.assert_grads_close(got, jax.grad(ref, argnums=(0, 1, 2))(*_f32((a, b, bias))))

    def test_vmap_shared_weight_gradient_is_one_product(self):
        ks = jax.random.split(jax.random.key(5), 3)
        x, w = _normal(ks[0], (6, 128, 136)), _normal(ks[1], (136, 200), 136**-0.5)
        ct = _normal(ks[2], (6, 128, 200))

        def ours(w):
            y = jax.vmap(lambda x: jax_sm100.matmul(x, w, activation="relu"))(x)
            return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))

        def ref(w):
            return jnp.sum(jax.nn.relu(x.astype(jnp.float32) @ w) * ct.astype(jnp.float32))

        self.assert_grads_close(jax.jit(jax.grad(ours))(w), jax.grad(ref)(w.astype(jnp.float32)))
        # Forward, and the weight gradient with the batch folded into k: two kernels.
        self.assertEqual(_products(jax.grad(ours), w), (2, 0))

    @parameterized.parameters(False, True)
    def test_act_grad_epilogue_with_staged_c(self, pingpong):
        # The backward's act'(C) * acc with C through the TMA-staged ring (GemmPlan.stage_c),
        # on sizes that are not multiples of the tile.
        from jax_sm100._src import planning

        m, n, k = 520, 1000, 264
        ks = jax.random.split(jax.random.key(13), 3)
        g, w = _normal(ks[0], (1, m, k)), _normal(ks[1], (1, n, k), k**-0.5)
        z = _normal(ks[2], (1, m, n))
        p = jax_sm100.plan(m, n, k, a_dtype="bfloat16", b_dtype="bfloat16", c_dtype="bfloat16",
                           arch="sm_90a", b_major="k", force_kernel=True)  # fmt: skip
        edit = dict(tile_mn=(128, 160), pingpong=True, cluster_mn=(2, 1)) if pingpong else {}
        plan = planning.sm90_variant(p, stage_c=True, stream_k=False, **edit)
        params = dict(
            transpose_a=False, transpose_b=True, alpha=1.0, beta=1.0, activation=None,
            out_dtype=np.dtype(jnp.bfloat16), has_bias=False, has_c=True, plan=plan,
            save_preact=False, act_grad="gelu",
        )  # fmt: skip
        (got,) = jax.jit(lambda g, w, z: P.matmul_p.bind(g, w, z, **params))(g, w, z)
        want = (g.astype(jnp.float32) @ jnp.swapaxes(w, -1, -2).astype(jnp.float32)) * (
            P.activation_grad(z.astype(jnp.float32), "gelu")
        )
        self.assertLess(_rel_err(got, want), 1e-2)
        self.assertEqual(dispatch.last_lowering().plan, plan)

    def _mlp(self, t=512, d=256, f=1024):
        ks = jax.random.split(jax.random.key(7), 5)
        params = (_normal(ks[0], (d, f), d**-0.5), _normal(ks[1], (f,), 0.1),
                  _normal(ks[2], (f, d), f**-0.5))  # fmt: skip
        return params, _normal(ks[3], (t, d)), _normal(ks[4], (t, d))

    @parameterized.parameters("relu", "gelu", "silu")
    def test_mlp_block_step(self, act):
        params, x, target = self._mlp()

        def loss(params, x, impl):
            w1, b1, w2 = params
            if impl == "ours":
                h = jax_sm100.matmul(x, w1, bias=b1, activation=act)
                y = jax_sm100.matmul(h, w2)
            else:
                h = P.apply_activation(x @ w1 + b1, act)
                y = h @ w2
            return jnp.mean((y.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)

        step = jax.value_and_grad(lambda p, x: loss(p, x, "ours"), argnums=(0, 1))
        value, grads = jax.jit(step)(params, x)
        want_value, want = jax.value_and_grad(lambda p, x: loss(p, x, "ref"), argnums=(0, 1))(
            *_f32((params, x))
        )
        self.assertLess(abs(float(value) - float(want_value)) / float(want_value), 1e-2)
        self.assert_grads_close(grads, want)
        # Six products, all ours: the activation's derivative is fused into a kernel epilogue.
        self.assertEqual(_products(step, params, x), (6, 0))
        text = jax.jit(step).lower(params, x).compile().as_text()
        self.assertNotIn("tanh", text.replace("jax_sm100", ""))

    @parameterized.parameters("relu", "gelu", "silu")
    def test_non_finite_rows_stay_non_finite(self, act):
        # A NaN row and an infinite one in x: the forward's fused activation and the backward's
        # fused derivative keep NaN where jnp's math does (the fused relu wrote 0, and a NaN
        # pre-activation gave gelu's and silu's derivative 0), and the other rows are as
        # before. The loss is linear in y, so the cotangents reaching the kernels are finite.
        params, x, target = self._mlp()
        x = x.at[3].set(jnp.nan).at[5].set(jnp.inf)

        def loss(params, x, impl):
            w1, b1, w2 = params
            if impl == "ours":
                y = jax_sm100.matmul(jax_sm100.matmul(x, w1, bias=b1, activation=act), w2)
            else:
                y = P.apply_activation(x @ w1 + b1, act) @ w2
            return jnp.sum(y.astype(jnp.float32) * target.astype(jnp.float32)), y

        step = jax.grad(lambda p, x: loss(p, x, "ours"), argnums=(0, 1), has_aux=True)
        grads, y = jax.jit(step)(params, x)
        ref = jax.grad(lambda p, x: loss(p, x, "ref"), argnums=(0, 1), has_aux=True)
        want_grads, want_y = ref(*_f32((params, x)))
        self.assertEqual(_products(step, params, x), (6, 0))
        self.assertTrue(np.all(np.isnan(np.asarray(want_y)[[3, 5]])))
        got, want = jax.tree.leaves((y, grads)), jax.tree.leaves((want_y, want_grads))
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            np.testing.assert_array_equal(np.isnan(g), np.isnan(w), f"output {i} ({act})")
            finite = np.isfinite(w)
            if finite.any():
                self.assertLess(_rel_err(g[finite], w[finite]), 2e-2, f"output {i} ({act})")

    def test_hessian_vector_product(self):
        # Forward over reverse: runs the backward epilogues' derivatives (slower paths).
        params, x, target = self._mlp(t=128, d=64, f=256)

        def loss(w1, impl):
            _, b1, w2 = params
            if impl == "ours":
                y = jax_sm100.matmul(jax_sm100.matmul(x, w1, bias=b1, activation="gelu"), w2)
            else:
                y = jax.nn.gelu(x @ w1 + b1, approximate=True) @ w2
            return jnp.mean((y.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)

        v = _normal(jax.random.key(9), params[0].shape)

        def hvp(impl, w1, v):
            return jax.jvp(jax.grad(lambda w: loss(w, impl)), (w1,), (v,))[1]

        got = jax.jit(lambda w, v: hvp("ours", w, v))(params[0], v)
        want = hvp("ref", params[0].astype(jnp.float32), v.astype(jnp.float32))
        self.assertLess(_rel_err(got, want), 5e-2)


if __name__ == "__main__":
    absltest.main()
