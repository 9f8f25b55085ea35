"""`jax_sm100.dot_general` and `jax_sm100.einsum` against `lax.dot_general` and `jnp.einsum`.

What each contraction binds (the primitive, with how many copies, or lax's dot), its numbers,
dtype, weak type and shape against lax's, its gradients and batching, and the record of every
contraction that runs on lax.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax import lax

import jax_sm100
from jax_sm100._src import dot_general as DG
from tests import test_util as tu

NO_BATCH = ((), ())

# (name, lhs shape, rhs shape, dimension numbers, copies): every case is a GEMM; `copies` is
# how many operands need a transpose first (0: the layouts fold into the transpose flags).
GEMMS = [
    ("nn", (24, 40), (40, 16), (((1,), (0,)), NO_BATCH), 0),
    ("tn", (40, 24), (40, 16), (((0,), (0,)), NO_BATCH), 0),
    ("nt", (24, 40), (16, 40), (((1,), (1,)), NO_BATCH), 0),
    ("tt", (40, 24), (16, 40), (((0,), (1,)), NO_BATCH), 0),
    ("dense_3d", (3, 8, 40), (40, 16), (((2,), (0,)), NO_BATCH), 0),
    ("dense_4d_out", (3, 8, 40), (40, 4, 5), (((2,), (0,)), NO_BATCH), 0),
    ("batch", (3, 8, 40), (3, 40, 16), (((2,), (1,)), ((0,), (0,))), 0),
    ("batch_nt", (3, 8, 40), (3, 16, 40), (((2,), (2,)), ((0,), (0,))), 0),
    ("two_batch", (2, 3, 8, 40), (2, 3, 40, 16), (((3,), (2,)), ((0, 1), (0, 1))), 0),
    ("grouped_k", (3, 8, 4, 10), (4, 10, 16), (((2, 3), (0, 1)), NO_BATCH), 0),
    ("grouped_k_m_major", (4, 10, 24), (4, 10, 16), (((0, 1), (0, 1)), NO_BATCH), 0),
    ("grouped_free", (6, 4, 40), (40, 2, 8), (((2,), (0,)), NO_BATCH), 0),
    ("vector_lhs", (40,), (40, 16), (((0,), (0,)), NO_BATCH), 0),
    ("vector_rhs", (24, 40), (40,), (((1,), (0,)), NO_BATCH), 0),
    ("vector_vector", (40,), (40,), (((0,), (0,)), NO_BATCH), 0),
    ("unit_dims_move", (24, 1, 40), (1, 40, 16), (((2,), (1,)), NO_BATCH), 0),
    ("attention_scores", (2, 4, 8, 16), (2, 4, 12, 16), (((3,), (3,)), ((0, 1), (0, 1))), 0),
    ("attention_values", (2, 4, 8, 12), (2, 4, 12, 16), (((3,), (2,)), ((0, 1), (0, 1))), 0),
    # Batch dims that are not leading, or contracting dims paired in another order, need one
    # transpose (XLA's dot makes the same copy).
    ("batch_not_leading", (8, 3, 40), (3, 40, 16), (((2,), (1,)), ((1,), (0,))), 1),
    ("bshd_scores", (2, 8, 4, 16), (2, 12, 4, 16), (((3,), (3,)), ((0, 2), (0, 2))), 2),
    ("k_pairs_crossed", (3, 4, 10), (10, 4, 16), (((1, 2), (1, 0)), NO_BATCH), 1),
    ("k_pairs_rhs_order", (3, 4, 10), (10, 4, 16), (((2, 1), (0, 1)), NO_BATCH), 1),
    ("batch_pairs_crossed", (2, 3, 8, 16), (3, 2, 16, 12), (((3,), (2,)), ((0, 1), (1, 0))), 1),
    ("batch_descending", (2, 3, 8, 16), (2, 3, 16, 12), (((3,), (2,)), ((1, 0), (1, 0))), 2),
    ("nnx_einsum", (16, 11, 32), (8, 32, 4), (((2,), (1,)), NO_BATCH), 1),
    ("dense_general_axes", (2, 3, 6, 7), (3, 7, 4, 5), (((1, 3), (0, 1)), NO_BATCH), 1),
]

# (name, lhs shape, lhs dtype, rhs shape, rhs dtype, dimension numbers, kwargs, reason): run
# on lax, with the recorded reason containing `reason`.
FALLBACKS = [
    ("outer", (24,), "float32", (16,), "float32", (NO_BATCH, NO_BATCH), {}, "outer product"),
    (
        "batch_only",
        (3, 8),
        "float32",
        (3, 8),
        "float32",
        (NO_BATCH, ((0,), (0,))),
        {},
        "outer product",
    ),  # fmt: skip
    ("int8", (24, 40), "int8", (40, 16), "int8", (((1,), (0,)), NO_BATCH), {}, "int8"),
    (
        "int_result",
        (24, 40),
        "bfloat16",
        (40, 16),
        "bfloat16",
        (((1,), (0,)), NO_BATCH),
        {"preferred_element_type": jnp.int32},
        "int32",
    ),  # fmt: skip
    (
        "highest_f32",
        (24, 40),
        "float32",
        (40, 16),
        "float32",
        (((1,), (0,)), NO_BATCH),
        {"precision": lax.Precision.HIGHEST},
        "HIGHEST",
    ),  # fmt: skip
    (
        "highest_pair",
        (24, 40),
        "float32",
        (40, 16),
        "float32",
        (((1,), (0,)), NO_BATCH),
        {"precision": (lax.Precision.DEFAULT, lax.Precision.HIGHEST)},
        "HIGHEST",
    ),  # fmt: skip
    (
        "algorithm",
        (24, 40),
        "bfloat16",
        (40, 16),
        "bfloat16",
        (((1,), (0,)), NO_BATCH),
        {"precision": lax.DotAlgorithmPreset.F32_F32_F32},
        "not a dot algorithm the kernels compute",
    ),  # fmt: skip
    (
        "other_operands_algorithm",
        (24, 40),
        "float16",
        (40, 16),
        "float16",
        (((1,), (0,)), NO_BATCH),
        {"precision": "BF16_BF16_F32"},
        "not a dot algorithm the kernels compute",
    ),  # fmt: skip
    ("empty", (0, 40), "float32", (40, 16), "float32", (((1,), (0,)), NO_BATCH), {}, "empty"),
]


def _operands(lhs_shape, rhs_shape, dtype="float32", seed=0, rhs_dtype=None):
    rng = np.random.default_rng(seed)
    return tu.rand(rng, lhs_shape, dtype), tu.rand(rng, rhs_shape, rhs_dtype or dtype)


def _eqn_names(fn, *args):
    return [e.primitive.name for e in jax.make_jaxpr(fn)(*args).eqns]


def _reference(lhs, rhs, dn, **kw):
    """lax.dot_general with exact float32 products (the CPU primitive's math)."""
    return lax.dot_general(lhs, rhs, dn, precision=lax.Precision.HIGHEST, **kw)


class GemmFormTest(parameterized.TestCase):
    """Which contractions bind the primitive, and with how many copies."""

    @parameterized.named_parameters(*GEMMS)
    def test_binds_the_primitive(self, lhs_shape, rhs_shape, dn, copies):
        lhs, rhs = _operands(lhs_shape, rhs_shape)
        names = _eqn_names(lambda a, b: jax_sm100.dot_general(a, b, dn), lhs, rhs)
        self.assertEqual(names.count("jax_sm100_matmul"), 1, names)
        self.assertNotIn("dot_general", names)
        self.assertEqual(names.count("transpose"), copies, names)

    @parameterized.named_parameters(*GEMMS)
    def test_matches_lax(self, lhs_shape, rhs_shape, dn, copies):
        del copies
        lhs, rhs = _operands(lhs_shape, rhs_shape)
        got = jax_sm100.dot_general(lhs, rhs, dn)
        want = _reference(lhs, rhs, dn)
        self.assertEqual(jax.typeof(got), jax.typeof(want))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)

    @parameterized.named_parameters(*GEMMS)
    def test_bfloat16_against_float32(self, lhs_shape, rhs_shape, dn, copies):
        del copies
        lhs, rhs = _operands(lhs_shape, rhs_shape, "bfloat16", seed=1)
        got = jax.jit(lambda a, b: jax_sm100.dot_general(a, b, dn))(lhs, rhs)
        self.assertEqual(got.dtype, jnp.bfloat16)
        want = _reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), dn)
        tu.assert_close(self, got, want, "bfloat16")

    def test_dense_input_reaches_the_primitive_as_itself(self):
        # [b, s, d] x [d, n]: no reshape of the activations, so autodiff can fuse a previous
        # layer's activation derivative, and the batch folds into one GEMM.
        lhs, rhs = _operands((3, 8, 40), (40, 16))
        jaxpr = jax.make_jaxpr(lambda a, b: jax_sm100.dot_general(a, b, GEMMS[4][3]))(lhs, rhs)
        (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "jax_sm100_matmul"]
        self.assertIs(eqn.invars[0], jaxpr.jaxpr.invars[0])
        self.assertFalse(eqn.params["transpose_a"])

    def test_transpose_flags(self):
        for name, lhs_shape, rhs_shape, dn, _ in GEMMS[:4]:
            form = DG.gemm_form(lhs_shape, rhs_shape, dn)
            self.assertEqual(
                (form.lhs.transposed, form.rhs.transposed),
                (name[0] == "t", name[1] == "t"),
                name,
            )
            self.assertIsNone(form.lhs.perm)
            self.assertIsNone(form.rhs.perm)

    def test_copy_keeps_the_contiguous_dim(self):
        # q [b, s, h, d] x k [b, t, h, d] -> [b, h, s, t]: each operand is transposed to
        # [b, h, s|t, d], which moves rows of d, not single elements.
        form = DG.gemm_form((2, 8, 4, 16), (2, 12, 4, 16), GEMMS[19][3])
        self.assertEqual(form.lhs.perm, (0, 2, 1, 3))
        self.assertEqual(form.rhs.perm, (0, 2, 1, 3))
        self.assertTrue(form.rhs.transposed)

    def test_copies_are_recorded(self):
        lhs, rhs = _operands((8, 3, 40), (3, 40, 16))
        with jax_sm100.lowerings() as seen:
            jax_sm100.dot_general(lhs, rhs, GEMMS[18][3])
        self.assertTrue(any("lhs transposed (1, 0, 2) (a copy)" in x.note for x in seen), seen)


class FallbackTest(parameterized.TestCase):
    @parameterized.named_parameters(*FALLBACKS)
    def test_runs_lax_and_says_why(self, lhs_shape, lhs_dtype, rhs_shape, rhs_dtype, dn, kw,
                                   reason):  # fmt: skip
        lhs, rhs = _operands(lhs_shape, rhs_shape, lhs_dtype, rhs_dtype=rhs_dtype)
        fn = lambda a, b: jax_sm100.dot_general(a, b, dn, **kw)  # noqa: E731
        with jax_sm100.lowerings() as seen:
            names = _eqn_names(fn, lhs, rhs)
        self.assertIn("dot_general", names)
        self.assertNotIn("jax_sm100_matmul", names)
        (note,) = [x.note for x in seen]
        self.assertIn("lax.dot_general", note)
        self.assertIn(reason, note)
        got, want = fn(lhs, rhs), lax.dot_general(lhs, rhs, dn, **kw)
        self.assertEqual(jax.typeof(got), jax.typeof(want))
        np.testing.assert_array_equal(got, want)

    @parameterized.parameters(
        (lax.Precision.HIGHEST, "bfloat16"),
        ("highest", "bfloat16"),
        (lax.Precision.HIGH, "bfloat16"),
        # The presets the kernels compute, by value or by name, for their operands.
        (lax.DotAlgorithmPreset.BF16_BF16_F32, "bfloat16"),
        ("BF16_BF16_F32", "bfloat16"),
        ("F16_F16_F32", "float16"),
        (lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM, "float8_e4m3fn"),
        ("ANY_F8_ANY_F8_F32_FAST_ACCUM", "float8_e5m2"),
        (lax.Precision.DEFAULT, "float8_e4m3fn"),
    )
    def test_precision_of_16_bit_operands_runs_on_the_primitive(self, precision, dtype):
        lhs, rhs = _operands((24, 40), (40, 16), dtype)
        dn = (((1,), (0,)), NO_BATCH)
        fn = lambda a, b: jax_sm100.dot_general(a, b, dn, precision)  # noqa: E731
        names = _eqn_names(fn, lhs, rhs)
        self.assertIn("jax_sm100_matmul", names)
        self.assertIn("jax_sm100_matmul", _eqn_names(
            lambda a, b: jax_sm100.matmul(a, b, precision=precision), lhs, rhs))  # fmt: skip

    @parameterized.parameters(
        (lax.Precision.HIGHEST, "HIGHEST"),
        ("high", "HIGH"),
        ((lax.Precision.DEFAULT, lax.Precision.HIGHEST), "HIGHEST"),
        (lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32, "ANY_F8_ANY_F8_F32"),
    )
    def test_fp8_products_asking_for_float32_accumulation_run_on_lax(self, precision, name):
        # Two fp8 operands accumulate in the fp8 tensor core's accumulator on the kernels (as
        # cuBLAS's fast accumulation, which XLA uses at DEFAULT only); a precision asking for
        # float32 accumulation ran on them all the same, about 1e-3 off on Hopper at large k.
        dn = (((1,), (0,)), NO_BATCH)
        for a in ("float8_e4m3fn", "float8_e5m2"):
            lhs, rhs = _operands((24, 40), (40, 16), a)
            with jax_sm100.lowerings() as seen:
                names = _eqn_names(lambda x, y: jax_sm100.dot_general(x, y, dn, precision),
                                   lhs, rhs)  # fmt: skip
            self.assertNotIn("jax_sm100_matmul", names, (precision, a))
            self.assertIn(f"precision={name} with two fp8 operands asks for float32 "
                          "accumulation", seen[-1].note)  # fmt: skip
            self.assertNotIn("jax_sm100_matmul", _eqn_names(
                lambda x, y: jax_sm100.matmul(x, y, precision=precision), lhs, rhs))  # fmt: skip
            try:
                want = lax.dot_general(lhs, rhs, dn, precision)
            except ValueError as e:  # the preset on CPU: "not supported by dot_general"
                with self.assertRaisesRegex(ValueError, "not supported"):
                    jax_sm100.dot_general(lhs, rhs, dn, precision)
                self.assertIn("not supported", str(e))
                continue
            got = jax_sm100.dot_general(lhs, rhs, dn, precision)
            self.assertEqual(jax.typeof(got), jax.typeof(want))
            np.testing.assert_array_equal(got, want)
        # Two fp8 formats are widened to bfloat16 on every path (exact products, float32
        # accumulation), which meets each of these: they stay on the primitive (review
        # helper-158: they had run XLA's mixed-fp8 dot, the note saying the kernels accumulate
        # in fp8).
        lhs, rhs = _operands((24, 40), (40, 16), "float8_e5m2")
        rhs = rhs.astype("float8_e4m3fn")
        for f in (lambda x, y: jax_sm100.dot_general(x, y, dn, precision),
                  lambda x, y: jax_sm100.matmul(x, y, precision=precision)):  # fmt: skip
            self.assertIn("jax_sm100_matmul", _eqn_names(f, lhs, rhs), precision)
        self.assertEqual(  # lax's result type (the left operand's fp8 format)
            jax.eval_shape(lambda x, y: jax_sm100.dot_general(x, y, dn, precision), lhs, rhs),
            jax.eval_shape(lambda x, y: lax.dot_general(x, y, dn, precision), lhs, rhs),
        )
        got = jax_sm100.matmul(lhs, rhs, precision=precision)
        want = lax.dot_general(lhs.astype(jnp.float32), rhs.astype(jnp.float32), dn,
                               precision=lax.Precision.HIGHEST)  # fmt: skip
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2)
        # An fp8 operand beside a 16-bit one: the pair's product is exact in float32.
        self.assertIsNone(DG.precision_reason(lax.Precision.HIGHEST, "float8_e4m3fn", "bfloat16"))

    def test_precision_reason_of_mixed_operands(self):
        # One float32 operand is enough for HIGHEST to go to lax; a preset must name both.
        for lhs, rhs in (("float32", "bfloat16"), ("bfloat16", "float32")):
            self.assertIn("HIGHEST", DG.precision_reason(lax.Precision.HIGHEST, lhs, rhs))
            self.assertIn("BF16_BF16_F32", DG.precision_reason("BF16_BF16_F32", lhs, rhs))
        self.assertIsNone(DG.precision_reason("BF16_BF16_F32", "bfloat16", "bfloat16"))
        self.assertIsNone(DG.precision_reason(lax.Precision.HIGHEST, "bfloat16", "float16"))

    def test_high_float32_runs_on_the_primitive(self):
        # tf32 meets HIGH (lax.Precision("tensorfloat32") is HIGH).
        lhs, rhs = _operands((24, 40), (40, 16))
        dn = (((1,), (0,)), NO_BATCH)
        fn = lambda a, b: jax_sm100.dot_general(a, b, dn, "tensorfloat32")  # noqa: E731
        self.assertIn("jax_sm100_matmul", _eqn_names(fn, lhs, rhs))

    def test_default_matmul_precision_config(self):
        lhs, rhs = _operands((24, 40), (40, 16))
        dn = (((1,), (0,)), NO_BATCH)
        with jax.default_matmul_precision("highest"):
            names = _eqn_names(lambda a, b: jax_sm100.dot_general(a, b, dn), lhs, rhs)
        self.assertNotIn("jax_sm100_matmul", names)

    def test_invalid_dimension_numbers_raise_lax_errors(self):
        lhs, rhs = _operands((24, 40), (30, 16))
        with self.assertRaisesRegex(TypeError, "contracting"):
            jax_sm100.dot_general(lhs, rhs, (((1,), (0,)), NO_BATCH))


class DtypeTest(parameterized.TestCase):
    """Result dtype and weak type as lax.dot_general's, whatever the operands."""

    @parameterized.named_parameters(
        ("bf16", "bfloat16", "bfloat16", None),
        ("mixed", "bfloat16", "float32", None),
        ("f16_bf16", "float16", "bfloat16", None),
        ("fp8", "float8_e4m3fn", "float8_e4m3fn", None),
        ("fp8_to_bf16", "float8_e4m3fn", "float8_e5m2", jnp.bfloat16),
        ("bf16_to_f32", "bfloat16", "bfloat16", jnp.float32),
        ("f32_to_bf16", "float32", "float32", jnp.bfloat16),
    )
    def test_result_type(self, lhs_dtype, rhs_dtype, preferred):
        lhs, rhs = _operands((24, 64), (64, 16), lhs_dtype, rhs_dtype=rhs_dtype)
        dn = (((1,), (0,)), NO_BATCH)
        got = jax_sm100.dot_general(lhs, rhs, dn, preferred_element_type=preferred)
        want = _reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), dn)
        self.assertEqual(jax.typeof(got),
                         jax.typeof(lax.dot_general(lhs, rhs, dn,
                                                    preferred_element_type=preferred)))  # fmt: skip
        tu.assert_close(self, got, want, np.dtype(got.dtype).name)

    def test_weak_types(self):
        dn = (((1,), (0,)), NO_BATCH)

        def f(a, s, t):
            weak_a = jnp.broadcast_to(s, (24, 40))
            weak_b = jnp.broadcast_to(t, (40, 16))
            ours, ref = jax_sm100.dot_general, lax.dot_general
            return (ours(weak_a, weak_b, dn), ref(weak_a, weak_b, dn), ours(a, weak_b, dn),
                    ref(a, weak_b, dn))  # fmt: skip

        ours_ww, lax_ww, ours_sw, lax_sw = jax.jit(f)(_operands((24, 40), (1,))[0], 0.5, 2.0)
        self.assertTrue(jax.typeof(ours_ww).weak_type)
        self.assertEqual(jax.typeof(ours_ww), jax.typeof(lax_ww))
        self.assertEqual(jax.typeof(ours_sw), jax.typeof(lax_sw))
        np.testing.assert_allclose(ours_ww, lax_ww)

    def test_float64_without_x64_is_truncated_as_lax_does(self):
        lhs, rhs = _operands((24, 40), (40, 16), "bfloat16")
        dn = (((1,), (0,)), NO_BATCH)
        with jax.enable_x64(False), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = jax_sm100.dot_general(lhs, rhs, dn, preferred_element_type=jnp.float64)
        self.assertEqual(got.dtype, jnp.float32)
        self.assertTrue(any("float64" in str(w.message) for w in caught))


class TransformTest(parameterized.TestCase):
    @parameterized.named_parameters(*[g for g in GEMMS if g[0] in (
        "nn", "tt", "dense_3d", "batch_nt", "grouped_k", "vector_rhs", "bshd_scores",
        "k_pairs_crossed", "k_pairs_rhs_order", "batch_pairs_crossed",
        "batch_descending")])  # fmt: skip
    def test_grad_matches_lax(self, lhs_shape, rhs_shape, dn, copies):
        del copies
        lhs, rhs = _operands(lhs_shape, rhs_shape, seed=2)
        out_shape = jax.eval_shape(lambda a, b: _reference(a, b, dn), lhs, rhs).shape
        ct = tu.rand(np.random.default_rng(3), out_shape, "float32")

        def loss(dot):
            return lambda a, b: jnp.sum(dot(a, b) * ct)

        got = jax.jit(jax.grad(loss(lambda a, b: jax_sm100.dot_general(a, b, dn)), (0, 1)))(
            lhs, rhs
        )
        want = jax.grad(loss(lambda a, b: _reference(a, b, dn)), (0, 1))(lhs, rhs)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)

    def test_vmap(self):
        lhs, rhs = _operands((5, 8, 40), (5, 16, 40))
        dn = (((1,), (1,)), NO_BATCH)
        got = jax.vmap(lambda a, b: jax_sm100.dot_general(a, b, dn))(lhs, rhs)
        want = jax.vmap(lambda a, b: _reference(a, b, dn))(lhs, rhs)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)

    def test_vmap_of_grad_of_a_dense(self):
        lhs, rhs = _operands((4, 8, 40), (40, 16))
        dn = (((1,), (0,)), NO_BATCH)

        def grad(dot):
            return jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.tanh(dot(x, w))), 1), (0, None))

        got = grad(lambda a, b: jax_sm100.dot_general(a, b, dn))(lhs, rhs)
        want = grad(lambda a, b: _reference(a, b, dn))(lhs, rhs)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def test_exports_with_symbolic_dims_beside_a_unit_group(self):
        # An operand whose free or contracting group is all unit dims beside a symbolic one
        # (Dense(1 -> n) over a polymorphic batch; a matrix-vector product of symbolic k):
        # choosing its layout compared a symbolic size with `>` ("inconclusive"), where lax
        # exports. Forward and gradient, equal to lax's at concrete sizes.
        b, s, k = jax.export.symbolic_shape("b, s, k")
        cases = [((b, s, 1), (1, 8), (((2,), (0,)), NO_BATCH), ((2, 3, 1), (1, 8))),
                 ((3, k), (k,), (((1,), (0,)), NO_BATCH), ((3, 40), (40,)))]  # fmt: skip
        for lhs_spec, rhs_spec, dn, concrete in cases:
            lhs, rhs = _operands(*concrete)
            grad = lambda dot: jax.grad(lambda x, y: jnp.sum(jnp.sin(dot(x, y))), (0, 1))  # noqa: E731
            for wrap in (lambda dot: dot, grad):
                ours = wrap(lambda x, y, dn=dn: jax_sm100.dot_general(x, y, dn))
                specs = [jax.ShapeDtypeStruct(sh, jnp.float32) for sh in (lhs_spec, rhs_spec)]
                exported = jax.export.export(jax.jit(ours))(*specs)
                want = wrap(lambda x, y, dn=dn: _reference(x, y, dn))(lhs, rhs)
                got = exported.call(lhs, rhs)
                for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-5)


class EinsumTest(parameterized.TestCase):
    @parameterized.parameters(
        ("ij,jk->ik", (24, 40), (40, 16)),
        ("bqhd,bkhd->bhqk", (2, 8, 4, 16), (2, 12, 4, 16)),
        ("bhqk,bkhd->bqhd", (2, 4, 8, 12), (2, 12, 4, 16)),
        ("nta,hab->nthb", (16, 11, 32), (8, 32, 4)),
        ("i,i->", (40,), (40,)),
        ("ij,j->i", (24, 40), (40,)),
    )
    def test_matches_jnp(self, subscripts, lhs_shape, rhs_shape):
        lhs, rhs = _operands(lhs_shape, rhs_shape)
        jaxpr = jax.make_jaxpr(lambda a, b: jax_sm100.einsum(subscripts, a, b))(lhs, rhs)
        self.assertIn("jax_sm100_matmul", str(jaxpr))  # inside jnp.einsum's jit
        got = jax_sm100.einsum(subscripts, lhs, rhs)
        want = jnp.einsum(subscripts, lhs, rhs, precision=lax.Precision.HIGHEST)
        self.assertEqual(jax.typeof(got), jax.typeof(want))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


if __name__ == "__main__":
    absltest.main()
