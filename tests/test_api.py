"""`jax_sm100.matmul`'s user-facing semantics against `jnp.matmul` (api.py).

1-D operands, weak types and dtype promotion as jnp's; jnp's keyword arguments (precision,
preferred_element_type, out_sharding); and each deliberate difference the README lists.
"""

from __future__ import annotations

import functools
import os
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_sm100
from tests import test_util as tu


def _rand(shape, dtype="float32", seed=0):
    return tu.rand(np.random.default_rng(seed), shape, dtype)


def _names(fn, *args):
    return [e.primitive.name for e in jax.make_jaxpr(fn)(*args).eqns]


class VectorTest(parameterized.TestCase):
    @parameterized.parameters(
        ((40,), (40,)),
        ((40,), (40, 16)),
        ((24, 40), (40,)),
        ((3, 24, 40), (40,)),
        ((40,), (3, 40, 16)),
        ((2, 1, 24, 40), (3, 40, 16)),
    )
    def test_as_jnp_matmul(self, a_shape, b_shape):
        a, b = _rand(a_shape), _rand(b_shape, seed=1)
        got = jax.jit(jax_sm100.matmul)(a, b)
        want = jnp.matmul(a, b, precision=lax.Precision.HIGHEST)
        self.assertEqual(jax.typeof(got), jax.typeof(want))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        self.assertIn("jax_sm100_matmul", _names(jax_sm100.matmul, a, b))

    def test_vector_b_with_epilogue(self):
        a, b, c = _rand((3, 24, 40)), _rand((40,), seed=1), _rand((24,), seed=2)
        bias = _rand((1,), seed=3)
        got = jax_sm100.matmul(a, b, bias=bias, c=c, beta=0.5, activation="gelu")
        want = tu.reference(a, b[:, None], bias=bias, c=c[:, None], beta=0.5, activation="gelu")
        self.assertEqual(got.shape, (3, 24))
        tu.assert_close(self, got, want[..., 0], "float32", 4)

    def test_vector_a_with_c(self):
        # a [k] is the row [1, k]: c [n] adds along n (a batched b, along each batch's n).
        for b_shape in ((40, 16), (3, 40, 16)):
            a, b, c = _rand((40,)), _rand(b_shape, seed=1), _rand((16,), seed=2)
            got = jax_sm100.matmul(a, b, c=c, beta=0.5)
            want = jnp.matmul(a, b, precision=lax.Precision.HIGHEST) + 0.5 * c
            self.assertEqual(got.shape, want.shape)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def test_vector_b_reads_k_contiguous(self):
        # b [k] is the K-major column [1, k]: no copy, k stays the contiguous dim.
        jaxpr = jax.make_jaxpr(jax_sm100.matmul)(_rand((24, 40)), _rand((40,)))
        (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "jax_sm100_matmul"]
        self.assertTrue(eqn.params["transpose_b"])
        self.assertNotIn("transpose", [e.primitive.name for e in jaxpr.eqns])

    def test_vector_gradients(self):
        a, b = _rand((24, 40)), _rand((40,), seed=1)

        def loss(mm):
            return lambda a, b: jnp.sum(jnp.sin(mm(a, b)))

        got = jax.grad(loss(jax_sm100.matmul), (0, 1))(a, b)
        want = jax.grad(loss(lambda a, b: jnp.matmul(a, b, precision="highest")), (0, 1))(a, b)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)

    def test_scalar_rejected_as_jnp(self):
        with self.assertRaisesRegex(ValueError, "rank >= 1"):
            jax_sm100.matmul(jnp.float32(2.0), _rand((4, 3)))

    def test_vector_bias_shape(self):
        with self.assertRaisesRegex(ValueError, r"b is a vector: n = 1"):
            jax_sm100.matmul(_rand((4, 8)), _rand((8,)), bias=jnp.ones(4))


class DtypeTest(parameterized.TestCase):
    @parameterized.parameters(
        ("bfloat16", "bfloat16"),
        ("bfloat16", "float32"),
        ("float16", "bfloat16"),
        ("float16", "float32"),
        ("float32", "float32"),
    )
    def test_promotion_as_jnp(self, a_dtype, b_dtype):
        a, b = _rand((24, 40), a_dtype), _rand((40, 16), b_dtype, seed=1)
        self.assertEqual(jax_sm100.matmul(a, b).dtype, jnp.matmul(a, b).dtype)

    @parameterized.parameters("bfloat16", "float16")
    def test_weak_operand_has_no_say(self, dtype):
        a = _rand((24, 40), dtype)

        def f(a, s):
            w = jnp.broadcast_to(s, (40, 16))  # weakly typed float
            return jax_sm100.matmul(a, w), jnp.matmul(a, w), jax_sm100.matmul(w.T, a.T)

        ours, ref, ours_t = jax.jit(f)(a, 0.75)
        self.assertEqual(jax.typeof(ours), jax.typeof(ref))
        self.assertEqual(ours_t.dtype, np.dtype(dtype))
        tu.assert_close(self, ours, np.asarray(ref, np.float32), dtype, 2)
        # The weak operand (b, then a) takes the other's dtype, so both operands match.
        jaxpr = jax.make_jaxpr(f)(a, 0.75)
        eqns = [e for e in jaxpr.eqns if e.primitive.name == "jax_sm100_matmul"]
        self.assertLen(eqns, 2)
        for eqn in eqns:
            self.assertEqual({v.aval.dtype for v in eqn.invars}, {np.dtype(dtype)})

    def test_weak_operand_beside_fp8_or_with_out_dtype(self):
        # Beside fp8 (it stayed float32, so the pair ran on XLA's dot with a float32 result)
        # both become bfloat16 (fp8 exactly; narrowing the weak value to fp8 would make 1000 a
        # NaN); with out_dtype beside bfloat16 (it stayed float32) it takes bfloat16. Either
        # way the product has one 16-bit operand dtype and the kernels take it.
        x8 = _rand((24, 40), "float8_e4m3fn")
        xb = _rand((24, 40), "bfloat16")

        def f(x, s, **kw):
            return jax_sm100.matmul(x, jnp.broadcast_to(s, (40, 16)), **kw)

        for x, kw, want_dtype in (
            (x8, {}, "bfloat16"),
            (x8, {"out_dtype": jnp.float32}, "float32"),
            (xb, {"out_dtype": jnp.float32}, "float32"),
        ):
            for s in (0.75, 1000.0):
                jaxpr = jax.make_jaxpr(functools.partial(f, **kw))(x, s)
                (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "jax_sm100_matmul"]
                self.assertEqual({v.aval.dtype for v in eqn.invars}, {np.dtype(jnp.bfloat16)})
                got = jax.jit(functools.partial(f, **kw))(x, s)
                self.assertEqual(got.dtype, np.dtype(want_dtype))
                w = jnp.full((40, 16), s, jnp.bfloat16)
                np.testing.assert_array_equal(
                    got, jax_sm100.matmul(x.astype(jnp.bfloat16), w, **kw).astype(want_dtype)
                )
                self.assertTrue(np.all(np.isfinite(np.asarray(got, np.float32))))

    def test_weak_integer_operand_has_no_say(self):
        # A broadcast Python int (weak int32) beside a float takes jnp's promoted float dtype,
        # as a weak float does (it was refused as an integer operand); ints alone stay refused.
        def f(a, s, t):
            w, v = jnp.broadcast_to(s, (40, 16)), jnp.broadcast_to(t, (40, 16))
            return jax_sm100.matmul(a, w), jnp.matmul(a, w), jax_sm100.matmul(w.T, 0.5 * v)

        a = _rand((24, 40), "bfloat16")
        ours, ref, both = jax.jit(f)(a, 3, 1.5)
        self.assertEqual(jax.typeof(ours), jax.typeof(ref))
        tu.assert_close(self, ours, np.asarray(ref, np.float32), "bfloat16", 2)
        self.assertEqual(
            jax.typeof(both),
            jax.typeof(jnp.matmul(jnp.broadcast_to(3, (16, 40)), jnp.broadcast_to(0.75, (40, 16)))),
        )
        np.testing.assert_allclose(both, np.full((16, 16), 3 * 0.75 * 40))
        # The same rules as the weak float it stands for: beside fp8, and with out_dtype.
        a8 = jnp.ones((4, 8), jnp.float8_e4m3fn)
        for b, kw in ((a8, {}), (a[:4, :8], {"out_dtype": jnp.float32})):
            got = jax_sm100.matmul(b, jnp.broadcast_to(1001, (8, 3)), **kw)
            want = jax_sm100.matmul(b, jnp.broadcast_to(1001.0, (8, 3)), **kw)
            self.assertEqual(jax.typeof(got), jax.typeof(want))
            np.testing.assert_array_equal(got, want)
        with self.assertRaisesRegex(TypeError, "a has integer dtype int(32|64)"):
            jax_sm100.matmul(jnp.broadcast_to(1, (4, 8)), jnp.broadcast_to(2, (8, 3)))
        with self.assertRaisesRegex(TypeError, "a has integer dtype int32"):
            jax_sm100.matmul(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 3), jnp.bfloat16))

    def test_both_weak_gives_weak(self):
        def f(s, t):
            a, b = jnp.broadcast_to(s, (4, 8)), jnp.broadcast_to(t, (8, 3))
            return jax_sm100.matmul(a, b), jnp.matmul(a, b)

        ours, ref = jax.jit(f)(0.5, 2.0)
        self.assertTrue(jax.typeof(ours).weak_type)
        self.assertEqual(jax.typeof(ours), jax.typeof(ref))
        np.testing.assert_allclose(ours, ref)

    @parameterized.parameters(("float8_e4m3fn", "float8_e5m2"), ("float8_e4m3fn", "bfloat16"))
    def test_fp8_results_where_jnp_refuses(self, a_dtype, b_dtype):
        # Documented difference: jnp.matmul does not promote fp8; matmul returns bfloat16.
        a, b = _rand((24, 64), a_dtype), _rand((64, 16), b_dtype, seed=1)
        with self.assertRaises(jax.dtypes.TypePromotionError):
            jnp.matmul(a, b)
        self.assertEqual(jax_sm100.matmul(a, b).dtype, jnp.bfloat16)

    def test_float64_without_x64_as_jnp(self):
        a, b = _rand((24, 40), "bfloat16"), _rand((40, 16), "bfloat16", seed=1)
        with jax.enable_x64(False):
            for ours, fn in (
                (True, lambda: jax_sm100.matmul(a, b, out_dtype=jnp.float64)),
                (True, lambda: jax_sm100.matmul(a, b, preferred_element_type=jnp.float64)),
                (False, lambda: jnp.matmul(a, b, preferred_element_type=jnp.float64)),
            ):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    got = fn()
                self.assertEqual(got.dtype, jnp.float32)
                (w,) = caught
                self.assertIs(w.category, UserWarning)
                self.assertIn("jax_enable_x64", str(w.message))
                if ours:
                    self.assertEqual(w.filename, __file__)  # points at the caller

    def test_float64_with_x64(self):
        a, b = _rand((24, 40)), _rand((40, 16), seed=1)
        with jax.enable_x64(True):
            got = jax_sm100.matmul(a, b, out_dtype=jnp.float64)
        self.assertEqual(got.dtype, jnp.float64)

    def test_preferred_element_type_is_out_dtype(self):
        a, b = _rand((24, 40), "bfloat16"), _rand((40, 16), "bfloat16", seed=1)
        got = jax_sm100.matmul(a, b, preferred_element_type=jnp.float32)
        self.assertEqual(got.dtype, jnp.float32)
        with self.assertRaisesRegex(ValueError, "differ"):
            jax_sm100.matmul(a, b, out_dtype=jnp.bfloat16, preferred_element_type=jnp.float32)

    def test_bad_result_dtypes_name_the_argument(self):
        a, b = _rand((24, 40), "bfloat16"), _rand((40, 16), "bfloat16", seed=1)
        # The fix is another dtype argument, not a cast of a dtype (`out_dtype.astype`).
        with self.assertRaisesRegex(TypeError, r"out_dtype is .*int32.* e.g. out_dtype=jnp"):
            jax_sm100.matmul(a, b, out_dtype=jnp.int32)
        with self.assertRaisesRegex(TypeError, "preferred_element_type is .*int32"):
            jax_sm100.ragged_dot(
                a, b[None], jnp.asarray([24], jnp.int32), preferred_element_type=jnp.int32
            )
        with self.assertRaisesRegex(TypeError, "runs only block-scaled: use .*scaled_matmul"):
            jax_sm100.matmul(a.astype(jnp.float4_e2m1fn), b)
        with self.assertRaisesRegex(TypeError, "matmul: preferred_element_type is .*int8"):
            jax_sm100.matmul(a, b, preferred_element_type=jnp.int8)
        with self.assertRaisesRegex(TypeError, "plan_for: out_dtype is .*int8"):
            jax_sm100.plan_for(a, b, out_dtype=jnp.int8)
        with self.assertRaisesRegex(TypeError, "precompile: c_dtype is .*int32"):
            jax_sm100.precompile([(128, 128, 128)], c_dtype="int32", progress=False)
        with jax.enable_x64(False), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # Rejected as asked, before any truncation (int64 is not reported as int32).
            with self.assertRaisesRegex(TypeError, "out_dtype is the integer dtype int64"):
                jax_sm100.matmul(a, b, out_dtype=np.int64)
            self.assertEqual(caught, [])
            # plan_for truncates a float64 out_dtype with the warning at the caller's line.
            p = jax_sm100.plan_for(a, b, out_dtype=np.float64)
        self.assertEqual(p.out_dtype, "float32")
        (w,) = caught
        self.assertIn("float64 requested in plan_for", str(w.message))
        self.assertEqual(w.filename, __file__)


class PrecisionTest(parameterized.TestCase):
    def test_highest_float32_runs_on_xla_and_says_so(self):
        a, b = _rand((24, 40)), _rand((40, 16), seed=1)
        bias = _rand((16,), seed=2)
        fn = lambda a, b: jax_sm100.matmul(a, b, bias=bias, activation="relu", precision="highest")  # noqa: E731
        with jax_sm100.lowerings() as seen:
            names = _names(fn, a, b)
        self.assertNotIn("jax_sm100_matmul", names)
        (note,) = [x.note for x in seen]
        self.assertIn("HIGHEST", note)
        want = tu.reference(a, b, bias=bias, activation="relu")
        tu.assert_close(self, fn(a, b), want, "float32")

    def test_lowerings_blocks_nest(self):
        # Each block sees the records made inside it; leaving the inner block leaves the outer
        # one listening (it removed the outer list, an equal one, and the outer's exit raised).
        from jax_sm100._src import dispatch  # noqa: PLC0415

        def record():
            return jax_sm100.dot_general(jnp.ones(3), jnp.ones(4), (((), ()), ((), ())))

        before = len(dispatch._listeners)
        with jax_sm100.lowerings() as outer:
            with jax_sm100.lowerings() as inner:
                record()
            record()
        self.assertEqual((len(outer), len(inner)), (2, 1))
        self.assertLen(dispatch._listeners, before)

    def test_xla_path_runs_the_algorithm_asked_for(self):
        # Where the kernels do not meet a precision, XLA's dot runs it as asked (it ran HIGHEST).
        a, b = _rand((24, 40)), _rand((40, 16), seed=1)
        algorithm = lax.DotAlgorithm(jnp.bfloat16, jnp.bfloat16, jnp.float32)
        for precision, want in (
            ("BF16_BF16_F32", "BF16_BF16_F32"),
            (lax.DotAlgorithmPreset.TF32_TF32_F32, "TF32_TF32_F32"),
            (algorithm, "DotAlgorithm("),
        ):
            fn = lambda a, b, p=precision: jax_sm100.matmul(a, b, precision=p)  # noqa: E731
            (dot,) = [e for e in jax.make_jaxpr(fn)(a, b).eqns if e.primitive.name == "dot_general"]
            self.assertIn(want, str(dot.params["precision"]))

    def test_default_matmul_precision_is_not_consulted(self):
        # Documented: only precision= counts (the XLA path would lose the primitive's
        # sharding rules); jax_sm100.dot_general consults the default, as lax does.
        a, b = _rand((24, 40)), _rand((40, 16), seed=1)
        with jax.default_matmul_precision("highest"):
            names = _names(jax_sm100.matmul, a, b)
        self.assertIn("jax_sm100_matmul", names)

    def test_bfloat16_meets_every_precision(self):
        a, b = _rand((24, 40), "bfloat16"), _rand((40, 16), "bfloat16", seed=1)
        names = _names(lambda a, b: jax_sm100.matmul(a, b, precision="highest"), a, b)
        self.assertIn("jax_sm100_matmul", names)

    def test_plan_with_unmet_precision_raises(self):
        a, b = _rand((256, 256)), _rand((256, 256), seed=1)
        p = jax_sm100.plan(256, 256, 256, a_dtype="float32", b_dtype="float32", arch="sm_100a")
        with self.assertRaisesRegex(ValueError, "plan= runs our kernels"):
            jax_sm100.matmul(a, b, plan=p, precision=lax.Precision.HIGHEST)

    def test_grouped_or_scaled_plan_is_refused(self):
        # A ragged_dot or scaled_matmul plan is another product: refused, naming the fix (the
        # CUDA lowering swapped a grouped one for the planner's, and resized a scaled XLA plan).
        a, b = _rand((256, 512), "bfloat16"), _rand((512, 1024), "bfloat16", seed=1)
        bf = dict(a_dtype="bfloat16", b_dtype="bfloat16")
        grouped = dict(groups=2, ragged="m")
        scaled = dict(scale_dtype="float32", scale_block=128)
        for kwargs, kind in ((grouped, "grouped"), (scaled, "block-scaled")):
            p = jax_sm100.plan(256, 1024, 512, **bf, **kwargs)
            with self.assertRaisesRegex(jax_sm100.PlanError, f"is a {kind} .*dense plan"):
                jax_sm100.matmul(a, b, plan=p)


class ExportTest(parameterized.TestCase):
    def test_export_with_symbolic_batch_dims(self):
        # jax.export of a batched matmul with c, bias and an activation, and its gradient, for
        # symbolic batch and row counts (the batch dims' broadcast was numpy's, which cannot
        # take a symbolic dim); the exported function equals the direct one.
        b, s = jax.export.symbolic_shape("b, s")

        def f(x, w, c, bias):
            return jax_sm100.matmul(x, w, c=c, bias=bias, activation="gelu")

        def value_and_grads(*args):
            return f(*args), jax.grad(lambda *a: jnp.sin(f(*a)).sum(), (0, 1, 2, 3))(*args)

        specs = [
            jax.ShapeDtypeStruct(sh, jnp.float32) for sh in [(b, s, 8), (8, 4), (b, s, 4), (4,)]
        ]
        exported = jax.export.export(jax.jit(value_and_grads))(*specs)
        rng = np.random.default_rng(11)
        for batch, rows in ((3, 5), (1, 7)):
            shapes = [(batch, rows, 8), (8, 4), (batch, rows, 4), (4,)]
            args = [jnp.asarray(rng.standard_normal(sh), jnp.float32) for sh in shapes]
            got, want = exported.call(*args), jax.jit(value_and_grads)(*args)
            for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                tu.assert_close(self, x, y, "float32", 8)

    @parameterized.product(arch=("sm_90a", "sm_100a"), batch=("b", 4))
    def test_cuda_export_with_symbolic_dims(self, arch, batch):
        # jax.export for CUDA with a symbolic batch or row count: the kernels are planned for
        # static shapes, so each product (forward, gradients) runs on XLA's dot and says so
        # (folding a symbolic batch compared its size with 1 and raised before).
        b, s = jax.export.symbolic_shape("b, s")
        batch = b if batch == "b" else batch

        def f(x, w, bias):
            y = jax_sm100.matmul(x, w, bias=bias, activation="gelu")
            return jax.grad(lambda x, w: jax_sm100.matmul(x, w).astype(jnp.float32).sum(),
                            (0, 1))(x, w), y  # fmt: skip

        specs = [jax.ShapeDtypeStruct(sh, jnp.bfloat16)
                 for sh in [(batch, s, 1024), (1024, 2048), (2048,)]]  # fmt: skip
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}):
            with jax_sm100.lowerings() as seen:
                text = jax.export.export(
                    jax.jit(f), platforms=["cuda"],
                    disabled_checks=jax_sm100.export_disabled_checks(),
                )(*specs).mlir_module()  # fmt: skip
        self.assertNotIn("custom_call @jax_sm100_gemm", text)
        self.assertLen(seen, 4)
        for low in seen:
            self.assertIsNone(low.plan)
            self.assertIn("symbolic dims", low.note)


class CheckpointPolicyTest(absltest.TestCase):
    def test_no_batch_dims_policy_saves_one_scaled_product(self):
        # scaled_matmul's operands always carry B: with B = 1 the product has no batch dims,
        # and dots_with_no_batch_dims_saveable saves it (it saved none before).
        from jax._src.ad_checkpoint import saved_residuals  # noqa: PLC0415

        rng = np.random.default_rng(13)
        x = jnp.asarray(rng.standard_normal((1, 128, 256)), jnp.float32)
        (a, sa), (b, sb) = (
            jax_sm100.quantize(x, "fp8_block128"),
            jax_sm100.quantize(x, "fp8_block128"),
        )

        def f(sa, sb):
            y = jax_sm100.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)
            return jnp.sum(jnp.sin(y))

        policy = jax_sm100.checkpoint_policies.dots_with_no_batch_dims_saveable
        got = saved_residuals(jax.checkpoint(f, policy=policy), sa, sb)
        self.assertIn("output of jax_sm100_scaled_matmul",
                      [n.split(" from ")[0] for _, n in got])  # fmt: skip
        a2, b2, sa2, sb2 = (jnp.concatenate([v, v]) for v in (a, b, sa, sb))
        prim = jax_sm100._src.scaled.scaled_matmul_p
        self.assertFalse(policy(prim, *(jax.typeof(v) for v in (a2, b2, sa2, sb2))))
        # Per-example activations against one weight a vmap leaves unmapped: the bind's rhs has
        # B = 1 (shared), a dense layer's product, saved.
        per_example = jax.vmap(f, (0, None))
        got = saved_residuals(jax.checkpoint(per_example, policy=policy), sa2[:, None], sb)
        self.assertIn("output of jax_sm100_scaled_matmul",
                      [n.split(" from ")[0] for _, n in got])  # fmt: skip

    def test_policies_save_what_jax_policies_save(self):
        # Ours are JAX's policies with our products added: a convolution, a batched
        # lax.dot_general and an unbatched one are saved as JAX's own policies save them (ours
        # knew lax.dot_general alone, so dots_saveable recomputed a convolution in the backward).
        from jax._src.ad_checkpoint import saved_residuals  # noqa: PLC0415

        rng = np.random.default_rng(14)
        img, ker = (jnp.asarray(rng.standard_normal(sh), jnp.float32)
                    for sh in [(1, 3, 8, 8), (3, 3, 3, 3)])  # fmt: skip
        w, wb = (jnp.asarray(rng.standard_normal(sh), jnp.float32) for sh in [(8, 5), (3, 8, 4)])

        def f(img, ker, w, wb):
            y = jnp.sin(lax.conv(img, ker, (1, 1), "SAME"))[0]  # [3, 8, 8]
            z = jnp.sin(jnp.einsum("bij,bjk->bik", y, wb))  # batched
            return jnp.sum(jnp.sin(y @ w)) + jnp.sum(z)

        def saved(policy):
            got = saved_residuals(jax.checkpoint(f, policy=policy), img, ker, w, wb)
            return sorted(n.split(" from ")[0] for _, n in got if n.startswith("output of"))

        for name, with_conv in (("dots_saveable", True), ("checkpoint_dots", True),
                                ("dots_with_no_batch_dims_saveable", False),
                                ("checkpoint_dots_with_no_batch_dims", False)):  # fmt: skip
            # (JAX's alias by its JAX name where the JAX at hand has it.)
            alias = name.replace("checkpoint_dots_with_no_batch_dims",
                                 "dots_with_no_batch_dims_saveable")  # fmt: skip
            want = saved(getattr(jax.checkpoint_policies, name, None)
                         or getattr(jax.checkpoint_policies, alias))  # fmt: skip
            self.assertEqual("output of conv_general_dilated" in want, with_conv)
            self.assertEqual(saved(getattr(jax_sm100.checkpoint_policies, name)), want, name)

    def test_policies_save_our_products(self):
        # jax.checkpoint with jax_sm100.checkpoint_policies saves the outputs of our products
        # as JAX's dot policies save lax.dot_general's (JAX's own save none of ours: every
        # product was recomputed in the backward); the gradients are the unsaved ones.
        from jax._src.ad_checkpoint import saved_residuals  # noqa: PLC0415

        policies = jax_sm100.checkpoint_policies
        rng = np.random.default_rng(12)
        x, w1, w2 = (jnp.asarray(rng.standard_normal(sh), jnp.float32)
                     for sh in [(2, 8, 16), (16, 32), (2, 32, 8)])  # fmt: skip
        sizes = jnp.array([3, 5], jnp.int32)
        experts = jnp.asarray(rng.standard_normal((2, 32, 4)), jnp.float32)

        def f(x, w1, w2, experts):
            h = jnp.tanh(jax_sm100.matmul(x, w1))  # weights shared: no batch dims
            y = jax_sm100.matmul(h, w2)  # batched weights
            return jnp.sum(jnp.sin(y)) + jnp.sum(
                jnp.sin(jax_sm100.ragged_dot(h[0], experts, sizes))
            )

        def saved(policy):
            got = saved_residuals(jax.checkpoint(f, policy=policy), x, w1, w2, experts)
            return sorted(n.split(" from ")[0] for _, n in got if n.startswith("output of"))

        ours = ["output of jax_sm100_matmul", "output of jax_sm100_ragged_dot"]
        self.assertEqual(saved(jax.checkpoint_policies.dots_saveable), [])
        self.assertEqual(saved(policies.dots_saveable), sorted([*ours, ours[0]]))
        self.assertEqual(saved(policies.dots_with_no_batch_dims_saveable), ours)
        want = jax.grad(f, (0, 1, 2, 3))(x, w1, w2, experts)
        for policy in (policies.dots_saveable, policies.dots_with_no_batch_dims_saveable):
            got = jax.grad(jax.checkpoint(f, policy=policy), (0, 1, 2, 3))(x, w1, w2, experts)
            for g, r in zip(got, want, strict=True):
                tu.assert_close(self, g, r, "float32", 32)


class ArgumentsTest(parameterized.TestCase):
    def test_traced_alpha_names_a_working_fix(self):
        a, b = _rand((24, 40)), _rand((40, 16), seed=1)

        def f(s):
            return jax_sm100.matmul(a, b, alpha=s)

        with self.assertRaisesRegex(TypeError, r"scale an operand \(matmul\(s \* a, b\)\)"):
            jax.jit(f)(2.0)
        # ...and the fix it names does what alpha would.
        got = jax.jit(lambda s: jax_sm100.matmul(s * a, b))(2.0)
        np.testing.assert_allclose(got, jax_sm100.matmul(a, b, alpha=2.0), rtol=1e-6)

    def test_out_sharding(self):
        mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))
        with jax.set_mesh(mesh):
            a = jax.device_put(_rand((8, 16)), P("x", None))
            b = _rand((16, 4), seed=1)
            got = jax.jit(lambda a, b: jax_sm100.matmul(a, b, out_sharding=P(None, "x")))(a, b)
            want = jnp.matmul(a, b, out_sharding=P(None, "x"))
            self.assertEqual(jax.typeof(got), jax.typeof(want))
            dn = (((1,), (0,)), ((), ()))
            got = jax_sm100.dot_general(a, b, dn, out_sharding=P(None, "x"))
            want = lax.dot_general(a, b, dn, out_sharding=P(None, "x"))
            self.assertEqual(jax.typeof(got), jax.typeof(want))


if __name__ == "__main__":
    absltest.main()
