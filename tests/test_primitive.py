"""The matmul primitive on CPU: numerics, every transformation, export, and input errors."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.test_util import check_grads

import jax_sm100
from tests import test_util as tu

jax.config.update("jax_enable_x64", True)

ACTS = (None, "relu", "gelu", "silu")


def _case_name(*parts):
    return "_".join(str(p) for p in parts).replace(".", "").replace("(", "").replace(")", "")


class NumericsTest(parameterized.TestCase):
    """Results against a float64 NumPy reference on random data."""

    @parameterized.named_parameters(
        (_case_name(dt, m, n, k), dt, m, n, k)
        for dt, (m, n, k) in itertools.product(
            tu.DTYPES, [(1, 1, 1), (7, 13, 5), (64, 48, 96), (33, 1, 17), (1, 40, 129)]
        )
    )
    def test_dtypes_and_odd_shapes(self, dtype, m, n, k):
        rng = np.random.default_rng(m * 1000 + n * 10 + k)
        a, b = tu.rand(rng, (m, k), dtype), tu.rand(rng, (k, n), dtype)
        out = jax.jit(jax_sm100.matmul)(a, b)
        want_dtype = "bfloat16" if "float8" in dtype else dtype
        self.assertEqual(out.dtype, np.dtype(want_dtype))
        tu.assert_close(self, out, tu.reference(a, b), want_dtype, k)

    @parameterized.named_parameters(
        (_case_name(act, bias, c, alpha, beta), act, bias, c, alpha, beta)
        for act, bias, c, (alpha, beta) in itertools.product(
            ACTS, (False, True), (False, True), ((1.0, 1.0), (0.5, -2.0))
        )
    )
    def test_epilogues(self, activation, with_bias, with_c, alpha, beta):
        rng = np.random.default_rng(7)
        m, n, k = 24, 40, 56
        a, b = tu.rand(rng, (m, k), "bfloat16"), tu.rand(rng, (k, n), "bfloat16")
        bias = tu.rand(rng, (n,), "float32") if with_bias else None
        c = tu.rand(rng, (m, n), "bfloat16") if with_c else None
        f = jax.jit(
            lambda a, b, bias, c: jax_sm100.matmul(
                a, b, bias=bias, c=c, alpha=alpha, beta=beta, activation=activation
            )
        )
        out = f(a, b, bias, c)
        want = tu.reference(a, b, bias=bias, c=c, alpha=alpha, beta=beta, activation=activation)
        tu.assert_close(self, out, want, "bfloat16", k)

    @parameterized.named_parameters(
        ("batched_both", (3, 8, 16), (3, 16, 24)),
        ("shared_weight", (2, 3, 8, 16), (16, 24)),
        ("broadcast_a", (1, 8, 16), (4, 16, 24)),
        ("broadcast_mixed", (2, 1, 8, 16), (1, 3, 16, 24)),
        ("rank_mismatch", (8, 16), (5, 16, 24)),
    )
    def test_batch_and_broadcast(self, a_shape, b_shape):
        rng = np.random.default_rng(1)
        a, b = tu.rand(rng, a_shape, "float32"), tu.rand(rng, b_shape, "float32")
        n = b_shape[-1]
        bias = tu.rand(rng, (n,), "float32")
        out = jax.jit(lambda a, b, bias: jax_sm100.matmul(a, b, bias=bias))(a, b, bias)
        self.assertEqual(out.shape, jnp.matmul(a, b).shape)
        tu.assert_close(self, out, tu.reference(a, b, bias=bias), "float32", a_shape[-1])

    def test_beta_zero_reads_no_c(self):
        # As the kernels' epilogue (and BLAS): beta = 0 leaves c out, NaN and infinities too
        # (the XLA path added 0 * c, NaN where c was not finite), and c's gradient is zero.
        rng = np.random.default_rng(3)
        a, b = tu.rand(rng, (8, 16), "float32"), tu.rand(rng, (16, 24), "float32")
        c = jnp.full((8, 24), jnp.nan).at[0].set(jnp.inf)
        out = jax.jit(lambda a, b, c: jax_sm100.matmul(a, b, c=c, beta=0.0))(a, b, c)
        tu.assert_close(self, out, tu.reference(a, b), "float32", 16)
        dc = jax.grad(lambda c: jax_sm100.matmul(a, b, c=c, beta=0.0).sum())(c)
        np.testing.assert_array_equal(np.asarray(dc), 0.0)

    def test_c_broadcasts(self):
        rng = np.random.default_rng(2)
        a, b = tu.rand(rng, (2, 8, 16), "float32"), tu.rand(rng, (2, 16, 12), "float32")
        for c_shape in [(12,), (8, 1), (1, 8, 12), (2, 8, 12), ()]:
            c = tu.rand(rng, c_shape, "float32")
            out = jax_sm100.matmul(a, b, c=c, beta=0.5)
            tu.assert_close(self, out, tu.reference(a, b, c=c, beta=0.5), "float32", 16)

    def test_out_dtype(self):
        rng = np.random.default_rng(3)
        a, b = tu.rand(rng, (16, 32), "float8_e4m3fn"), tu.rand(rng, (32, 8), "float8_e5m2")
        for out_dtype in ("float32", "float16", "bfloat16"):
            out = jax_sm100.matmul(a, b, out_dtype=out_dtype)
            self.assertEqual(out.dtype, np.dtype(out_dtype))
            tu.assert_close(self, out, tu.reference(a, b), out_dtype, 32)

    def test_float64(self):
        rng = np.random.default_rng(4)
        a, b = tu.rand(rng, (9, 11), "float64"), tu.rand(rng, (11, 6), "float64")
        out = jax_sm100.matmul(a, b, activation="gelu")
        tu.assert_close(self, out, tu.reference(a, b, activation="gelu"), "float64", 11)


class TransformationsTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(11)
        self.a = tu.rand(rng, (3, 5, 7), "float64")
        self.b = tu.rand(rng, (7, 6), "float64")
        self.bias = tu.rand(rng, (6,), "float64")
        self.c = tu.rand(rng, (5, 6), "float64")

    @parameterized.parameters(*ACTS)
    def test_check_grads_second_order(self, activation):
        def f(a, b, bias, c):
            return jax_sm100.matmul(
                a, b, bias=bias, c=c, alpha=0.7, beta=-0.4, activation=activation
            )

        # relu is not differentiable at 0; random normal data never lands there.
        check_grads(f, (self.a, self.b, self.bias, self.c), order=2, modes=("fwd", "rev"))

    def test_relu_gradient_at_zero_is_jax_nn_relus(self):
        # A pre-activation of exactly 0 (the bias cancels the product): jax.nn.relu's derivative
        # there is 0, and so is ours, for the bias, a and b alike.
        x, w = self.a[0, :1], self.b
        bias = -(x @ w)[0]

        def loss(act):
            return lambda x, w, bias: jnp.sum(act(x, w, bias))

        ours = loss(lambda x, w, bias: jax_sm100.matmul(x, w, bias=bias, activation="relu"))
        theirs = loss(lambda x, w, bias: jax.nn.relu(x @ w + bias))
        self.assertEqual(float(jnp.max(jnp.abs(jax_sm100.matmul(x, w, bias=bias)))), 0.0)
        for g, want in zip(
            jax.grad(ours, (0, 1, 2))(x, w, bias),
            jax.grad(theirs, (0, 1, 2))(x, w, bias),
            strict=True,
        ):
            np.testing.assert_array_equal(g, want)
        np.testing.assert_array_equal(jax.grad(ours, 2)(x, w, bias), np.zeros(6))

    def test_grad_matches_jnp(self):
        def ours(a, b, bias, c):
            return jnp.sum(jnp.sin(jax_sm100.matmul(a, b, bias=bias, c=c, activation="silu")))

        def theirs(a, b, bias, c):
            return jnp.sum(jnp.sin(jax.nn.silu(a @ b + c + bias)))

        args = (self.a, self.b, self.bias, self.c)
        for g, w in zip(
            jax.grad(ours, argnums=(0, 1, 2, 3))(*args),
            jax.grad(theirs, argnums=(0, 1, 2, 3))(*args),
            strict=True,
        ):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)

    def test_jacfwd_jacrev_hessian_linearize(self):
        a, b = self.a[0], self.b

        def f(a):
            return jax_sm100.matmul(a, b, activation="gelu")

        def g(a):
            return jax.nn.gelu(a @ b, approximate=True)

        np.testing.assert_allclose(jax.jacfwd(f)(a), jax.jacfwd(g)(a), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(jax.jacrev(f)(a), jax.jacrev(g)(a), rtol=1e-10, atol=1e-12)
        h_ours = jax.hessian(lambda a: f(a).sum())(a)
        h_ref = jax.hessian(lambda a: g(a).sum())(a)
        np.testing.assert_allclose(h_ours, h_ref, rtol=1e-9, atol=1e-12)
        y, f_lin = jax.linearize(f, a)
        t = jnp.ones_like(a) * 0.1 + a
        _, want = jax.jvp(g, (a,), (t,))
        np.testing.assert_allclose(f_lin(t), want, rtol=1e-10, atol=1e-12)

    def test_grad_of_grad(self):
        b = self.b

        def f(x):
            return jnp.sum(jax_sm100.matmul(x, b, activation="silu") ** 2)

        def g(x):
            return jnp.sum(jax.nn.silu(x @ b) ** 2)

        x = self.a[0]
        gg_ours = jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(x)
        gg_ref = jax.grad(lambda x: jnp.sum(jax.grad(g)(x) ** 2))(x)
        np.testing.assert_allclose(gg_ours, gg_ref, rtol=1e-9, atol=1e-12)

    def test_grad_with_broadcast_batch(self):
        rng = np.random.default_rng(5)
        a, b = tu.rand(rng, (1, 4, 6), "float64"), tu.rand(rng, (3, 6, 5), "float64")
        check_grads(lambda a, b: jax_sm100.matmul(a, b), (a, b), order=1, modes=("rev",))

    def test_nested_vmap_mixed_axes(self):
        rng = np.random.default_rng(6)
        a = tu.rand(rng, (4, 5, 7), "float64")  # vmapped over axis 0 (outer)
        b = tu.rand(rng, (7, 3, 6), "float64")  # vmapped over axis 1 (inner)
        c = tu.rand(rng, (5, 6), "float64")

        def inner(a, b):
            return jax_sm100.matmul(a, b, c=c, activation="relu")

        f = jax.vmap(jax.vmap(inner, in_axes=(None, 1)), in_axes=(0, None))
        out = f(a, b)
        self.assertEqual(out.shape, (4, 3, 5, 6))
        want = tu.reference(
            a[:, None], np.moveaxis(np.asarray(b), 1, 0)[None], c=c, activation="relu"
        )
        tu.assert_close(self, out, want, "float64", 7)

    def test_vmap_over_the_row_axis(self):
        # vmap over a's rows (in_axes=1 of a 3-D array mapped to a 2-D operand): the mapped axis
        # becomes a batch dim, never the m dim (a 2-D `a` has no batch dims to place it among).
        rng = np.random.default_rng(13)
        a = tu.rand(rng, (8, 5, 16), "float64")
        w = tu.rand(rng, (16, 4), "float64")
        for axis in (0, 1):
            out = jax.vmap(lambda x: jax_sm100.matmul(x, w), in_axes=axis)(a)
            want = np.matmul(np.moveaxis(np.asarray(a), axis, 0), np.asarray(w))
            tu.assert_close(self, out, want, "float64", 7)

    def test_vmap_inside_batch_dims(self):
        # a is mapped on one of its batch dims: the batch dim is folded in place, no transpose.
        rng = np.random.default_rng(12)
        a = tu.rand(rng, (2, 3, 5, 7), "float64")  # [batch, V, m, k], vmapped at 1
        b = tu.rand(rng, (2, 7, 6), "float64")
        bias = tu.rand(rng, (3, 6), "float64")  # vmapped at 0
        f = jax.vmap(lambda a, bias: jax_sm100.matmul(a, b, bias=bias), in_axes=(1, 0))
        out = f(a, bias)
        self.assertEqual(out.shape, (3, 2, 5, 6))
        want = (
            np.matmul(np.moveaxis(np.asarray(a), 1, 0), np.asarray(b))
            + np.asarray(bias)[:, None, None, :]
        )
        tu.assert_close(self, out, want, "float64", 7)
        jaxpr = jax.make_jaxpr(f)(a, bias).jaxpr
        (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "jax_sm100_matmul"]
        self.assertIs(eqn.invars[0], jaxpr.invars[0])  # a reaches the kernel as it is

    def test_vmap_of_grad_and_grad_of_vmap(self):
        a, b = self.a, self.b

        def loss(a, b):
            return jnp.sum(jax_sm100.matmul(a, b, activation="gelu") ** 2)

        def loss_ref(a, b):
            return jnp.sum(jax.nn.gelu(a @ b, approximate=True) ** 2)

        ours = jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None))(a, b)
        ref = jax.vmap(jax.grad(loss_ref, argnums=1), in_axes=(0, None))(a, b)
        np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-12)
        ours = jax.grad(lambda b: jax.vmap(loss, in_axes=(0, None))(a, b).sum())(b)
        ref = jax.grad(lambda b: jax.vmap(loss_ref, in_axes=(0, None))(a, b).sum())(b)
        np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-12)

    def test_vmap_bias_and_c_batched(self):
        rng = np.random.default_rng(8)
        a, b = tu.rand(rng, (5, 7), "float32"), tu.rand(rng, (7, 6), "float32")
        bias, c = tu.rand(rng, (3, 6), "float32"), tu.rand(rng, (3, 5, 6), "float32")
        out = jax.vmap(lambda bias, c: jax_sm100.matmul(a, b, bias=bias, c=c))(bias, c)
        want = np.stack([tu.reference(a, b, bias=bias[i], c=c[i]) for i in range(3)])
        tu.assert_close(self, out, want, "float32", 7)

    def test_eval_shape(self):
        s = jax.eval_shape(
            lambda a, b: jax_sm100.matmul(a, b, out_dtype=jnp.float32),
            jax.ShapeDtypeStruct((2, 9, 33, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, 17), jnp.bfloat16),
        )
        self.assertEqual((s.shape, s.dtype), ((2, 9, 33, 17), np.dtype("float32")))

    def test_export_round_trip(self):
        rng = np.random.default_rng(9)
        a, b = tu.rand(rng, (6, 16), "float32"), tu.rand(rng, (16, 8), "float32")
        bias = tu.rand(rng, (8,), "float32")
        f = jax.jit(lambda a, b, bias: jax_sm100.matmul(a, b, bias=bias, activation="silu"))
        exp = jax.export.export(f)(a, b, bias)
        restored = jax.export.deserialize(exp.serialize())
        np.testing.assert_allclose(restored.call(a, b, bias), f(a, b, bias), rtol=1e-6)
        tu.assert_close(
            self,
            restored.call(a, b, bias),
            tu.reference(a, b, bias=bias, activation="silu"),
            "float32",
            16,
        )


class ErrorsTest(parameterized.TestCase):
    """Every bad input raises a typed error naming the fix, before anything runs."""

    def setUp(self):
        super().setUp()
        self.a = jnp.ones((4, 8), jnp.float32) * 0.5
        self.b = jnp.ones((8, 3), jnp.float32) * 0.25

    def assert_raises(self, exc, pattern, fn):
        with self.assertRaisesRegex(exc, pattern):
            fn()
        with self.assertRaisesRegex(exc, pattern):
            jax.jit(fn)()

    def test_rank(self):
        # Vectors are jnp.matmul's (tests/test_api.py); scalars are rejected, as there.
        self.assert_raises(
            ValueError, r"rank >= 1.*\(\)", lambda: jax_sm100.matmul(jnp.ones(()), self.b)
        )

    def test_mismatched_k(self):
        self.assert_raises(
            ValueError,
            r"contracting dims differ.*k=8.*k=5",
            lambda: jax_sm100.matmul(self.a, jnp.ones((5, 3))),
        )

    def test_batch_not_broadcasting(self):
        self.assert_raises(
            ValueError,
            "do not broadcast",
            lambda: jax_sm100.matmul(jnp.ones((2, 4, 8)), jnp.ones((3, 8, 3))),
        )

    @parameterized.parameters(jnp.int32, jnp.int8, jnp.complex64, jnp.bool_)
    def test_bad_dtypes(self, dtype):
        x = jnp.ones((4, 8), dtype)
        self.assert_raises(TypeError, "astype", lambda: jax_sm100.matmul(x, self.b))
        self.assert_raises(TypeError, "astype", lambda: jax_sm100.matmul(self.a, x.T))

    def test_bias_shape(self):
        self.assert_raises(
            ValueError,
            r"bias must have shape \[n\] = \(3,\)",
            lambda: jax_sm100.matmul(self.a, self.b, bias=jnp.ones((4, 3))),
        )

    def test_c_shape(self):
        self.assert_raises(
            ValueError,
            "does not broadcast to the output shape",
            lambda: jax_sm100.matmul(self.a, self.b, c=jnp.ones((5, 3))),
        )

    def test_activation(self):
        self.assert_raises(
            ValueError,
            "unknown activation='tanh'",
            lambda: jax_sm100.matmul(self.a, self.b, activation="tanh"),
        )

    def test_traced_alpha(self):
        with self.assertRaisesRegex(TypeError, "alpha must be a Python float"):
            jax.jit(lambda s: jax_sm100.matmul(self.a, self.b, alpha=s))(2.0)

    def test_plan_for_other_problem(self):
        p = jax_sm100.plan(64, 64, 64, a_dtype="float32", b_dtype="float32")
        self.assert_raises(
            jax_sm100.PlanError,
            r"made for m=64.*has m=4",
            lambda: jax_sm100.matmul(self.a, self.b, plan=p),
        )

    def test_lists_raise_as_in_lax(self):
        # lax.dot_general, jnp.matmul and lax.ragged_dot raise a TypeError on a list (they do
        # not guess its dtype); every entry point does as they do, naming the argument.
        rows, w = [[0.5] * 8] * 4, jnp.ones((2, 8, 3))
        sizes = jnp.array([2, 2], jnp.int32)
        dims = (((1,), (0,)), ((), ()))
        cases = (
            ("matmul.*for a", lambda: jax_sm100.matmul(rows, self.b)),
            ("matmul.*for b", lambda: jax_sm100.matmul(self.a, self.b.tolist())),
            ("matmul.*for bias", lambda: jax_sm100.matmul(self.a, self.b, bias=[1.0] * 3)),
            ("matmul.*for c", lambda: jax_sm100.matmul(self.a, self.b, c=[[1.0] * 3] * 4)),
            ("dot_general.*for lhs", lambda: jax_sm100.dot_general(rows, self.b, dims)),
            ("ragged_dot.*for lhs", lambda: jax_sm100.ragged_dot(rows, w, sizes)),
            ("ragged_dot.*for group_sizes", lambda: jax_sm100.ragged_dot(self.a, w, [2, 2])),
            ("ragged_dot.*for bias",
             lambda: jax_sm100.ragged_dot(self.a, w, sizes, bias=[[0.0] * 3] * 2)),
            ("quantize.*for x", lambda: jax_sm100.quantize([[1.0] * 128], "fp8_block128")),
            ("scaled_matmul.*for rhs_scales", lambda: jax_sm100.scaled_matmul(
                jnp.ones((1, 4, 128)), jnp.ones((1, 4, 128)), jnp.ones((1, 4, 1)), [[[1.0]] * 4])),
        )  # fmt: skip
        for pattern, fn in cases:
            self.assert_raises(TypeError, pattern + ".*jnp.asarray", fn)
        # Scalars and numpy arrays are arrays, as for lax.
        np.testing.assert_allclose(
            jax_sm100.matmul(np.asarray(self.a), np.asarray(self.b), bias=np.ones(3), c=1.0),
            np.asarray(self.a) @ np.asarray(self.b) + 2.0, rtol=1e-6,
        )  # fmt: skip

    def test_plan_wrong_type(self):
        self.assert_raises(
            TypeError, "GemmPlan", lambda: jax_sm100.matmul(self.a, self.b, plan={"m": 4})
        )

    def test_matching_plan_runs(self):
        p = jax_sm100.plan(4, 3, 8, a_dtype="float32", b_dtype="float32")
        out = jax_sm100.matmul(self.a, self.b, plan=p)
        tu.assert_close(self, out, tu.reference(self.a, self.b), "float32", 8)


if __name__ == "__main__":
    absltest.main()
