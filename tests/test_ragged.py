"""`jax_sm100.ragged_dot` on CPU: values against a float64 reference, every transformation, the
backward's two primitives, the fallbacks and the errors."""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import sys
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax import lax
from jax.test_util import check_grads

import jax_sm100
from jax_sm100._src import planning, ragged, ragged_sharding
from jax_sm100._src import primitive as P
from tests import test_util as tu


def _groups(rng, m, g, fill=True):
    """Random group sizes summing to m (or to less, leaving trailing rows in no group), with
    empty groups among them."""
    total = m if fill else int(rng.integers(0, m))
    cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [total]]))
    return jnp.asarray(sizes.astype(np.int32))


def _reference(lhs, rhs, group_sizes):
    """float64 numpy: rows of group i times rhs[i]; rows past the last group are zero."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[-1]))
    start = 0
    for i, size in enumerate(np.asarray(group_sizes)):
        out[start : start + size] = lhs[start : start + size] @ rhs[i]
        start += size
    return out


def _dense(lhs, rhs, group_sizes):
    """The same math in differentiable jnp (any order, any transformation)."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(lhs.shape[0])[:, None]
    member = ((rows >= (ends - group_sizes)[None]) & (rows < ends[None])).astype(lhs.dtype)
    return jnp.einsum("mk,gkn,mg->mn", lhs, rhs, member)


def _batched_case(seed, transpose, batch=(2, 3), g=4, m=13, k=8, n=5):
    """Batched float32 operands for the fold and merge checks of the CUDA lowering: sizes
    [*batch, g] (past m, negative, empty groups, batches ending before m), lhs [*batch, m, k],
    experts [*batch, g, k, n] ([.., n, k] under `transpose`), a bias [*batch, g, n] and a
    cotangent [*batch, m, n]."""
    rng = np.random.default_rng(seed)
    sizes = jnp.asarray(rng.integers(-3, 8, (*batch, g)), jnp.int32)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    rhs = normal(*batch, g, *((n, k) if transpose else (k, n)))
    return sizes, normal(*batch, m, k), rhs, normal(*batch, g, n), normal(*batch, m, n)


def _export(fn, *avals):
    checks = jax_sm100.export_disabled_checks()
    return jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(*avals)


class RaggedDotTest(parameterized.TestCase):
    @parameterized.product(
        dtype=("bfloat16", "float16", "float32"),
        shape=((64, 32, 48, 4), (100, 24, 40, 7), (1, 8, 8, 3), (37, 16, 1, 5)),
        fill=(True, False),
    )
    def test_values(self, dtype, shape, fill):
        m, k, n, g = shape
        rng = np.random.default_rng(m * 7 + g)
        lhs, rhs = tu.rand(rng, (m, k), dtype), tu.rand(rng, (g, k, n), dtype)
        sizes = _groups(rng, m, g, fill)
        out = jax.jit(jax_sm100.ragged_dot)(lhs, rhs, sizes)
        self.assertEqual(out.dtype, jnp.dtype(dtype))
        self.assertEqual(out.shape, (m, n))
        tu.assert_close(self, out, _reference(lhs, rhs, sizes), dtype, k)

    def test_matches_lax_ragged_dot(self):
        rng = np.random.default_rng(3)
        lhs, rhs = tu.rand(rng, (96, 40), "float32"), tu.rand(rng, (6, 40, 24), "float32")
        sizes = _groups(rng, 96, 6)
        ours = jax_sm100.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
        theirs = lax.ragged_dot(lhs, rhs, sizes, precision=lax.Precision.HIGHEST)
        tu.assert_close(self, ours, theirs, "float32", 40)

    def test_gradients_are_the_two_grouped_primitives(self):
        rng = np.random.default_rng(4)
        lhs, rhs = tu.rand(rng, (64, 32), "bfloat16"), tu.rand(rng, (4, 32, 16), "bfloat16")
        sizes = _groups(rng, 64, 4)
        loss = lambda a, b: jax_sm100.ragged_dot(a, b, sizes).astype(jnp.float32).sum()
        jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(lhs, rhs).jaxpr
        names = [e.primitive.name for e in jaxpr.eqns]
        self.assertEqual(names.count("jax_sm100_ragged_dot"), 2)  # forward and d lhs
        self.assertEqual(names.count("jax_sm100_ragged_outer"), 1)  # d rhs
        self.assertNotIn("ragged_dot_general", names)
        d_lhs, d_rhs = jax.grad(loss, (0, 1))(lhs, rhs)
        self.assertEqual((d_lhs.dtype, d_rhs.dtype), (jnp.bfloat16, jnp.bfloat16))
        want = jax.grad(
            lambda a, b: _dense(a, b, sizes).sum(), (0, 1)
        )(lhs.astype(jnp.float32), rhs.astype(jnp.float32))  # fmt: skip
        tu.assert_close(self, d_lhs, want[0], "bfloat16", 16)
        tu.assert_close(self, d_rhs, want[1], "bfloat16", 64)

    @parameterized.named_parameters(
        ("grad", lambda f: jax.grad(f, (0, 1))),
        ("hessian_lhs", lambda f: jax.hessian(f, 0)),
        ("hessian_rhs", lambda f: jax.hessian(f, 1)),
        ("jacfwd_of_grad", lambda f: jax.jacfwd(jax.grad(f, 0), 1)),
        ("jacrev_of_grad", lambda f: jax.jacrev(jax.grad(f, 1), 0)),
    )
    def test_differentiation_float64(self, transform):
        with jax.enable_x64(True):
            rng = np.random.default_rng(5)
            lhs, rhs = tu.rand(rng, (10, 4), "float64"), tu.rand(rng, (3, 4, 5), "float64")
            sizes = jnp.asarray([4, 0, 5], jnp.int32)  # one empty group, one row in none
            ours = transform(lambda a, b: jnp.sin(jax_sm100.ragged_dot(a, b, sizes)).sum())
            want = transform(lambda a, b: jnp.sin(_dense(a, b, sizes)).sum())
            for got, ref in zip(
                jax.tree.leaves(ours(lhs, rhs)), jax.tree.leaves(want(lhs, rhs)), strict=True
            ):
                tu.assert_close(self, got, ref, "float64", 4)

    @parameterized.named_parameters(
        ("lhs_and_sizes", (0, None, 0)),
        ("lhs_rows_axis", (1, None, None)),
        ("rhs_only", (None, 0, None)),
        ("all", (0, 2, 0)),
    )
    def test_vmap(self, in_axes):
        with jax.enable_x64(True):
            rng = np.random.default_rng(6)
            b, m, k, n, g = 3, 12, 5, 6, 4
            lhs = tu.rand(rng, (m, k), "float64")
            rhs = tu.rand(rng, (g, k, n), "float64")
            sizes = jnp.asarray([3, 0, 5, 2], jnp.int32)
            args = [lhs, rhs, sizes]
            batched = [
                jnp.stack([lhs * (i + 1) for i in range(b)], axis=in_axes[0] or 0),
                jnp.stack([rhs * (i + 2) for i in range(b)], axis=in_axes[1] or 0),
                jnp.asarray([[3, 0, 5, 2], [1, 1, 1, 1], [12, 0, 0, 0]], jnp.int32),
            ]
            args = [
                bx if ax is not None else x
                for x, bx, ax in zip(args, batched, in_axes, strict=True)
            ]
            got = jax.vmap(jax_sm100.ragged_dot, in_axes)(*args)
            want = jax.vmap(_dense, in_axes)(*args)
            tu.assert_close(self, got, want, "float64", k)
            grads = jax.grad(
                lambda x, y: jnp.sin(jax.vmap(jax_sm100.ragged_dot, in_axes)(x, y, args[2])).sum(),
                (0, 1),
            )(args[0], args[1])  # fmt: skip
            want = jax.grad(
                lambda x, y: jnp.sin(jax.vmap(_dense, in_axes)(x, y, args[2])).sum(), (0, 1)
            )(args[0], args[1])  # fmt: skip
            for got_g, ref in zip(grads, want, strict=True):
                tu.assert_close(self, got_g, ref, "float64", k)

    @parameterized.product(
        in_axes=[(0, None, 0), (0, 0, None), (0, None, None), (None, 0, 0), (1, None, 0)],
        case=["float32_highest", "complex64", "int8", "f32_algorithm"],
    )
    def test_vmap_of_what_runs_on_lax_ragged_dot(self, in_axes, case):
        # float32 at HIGHEST, complex and integer operands and non-kernel algorithms take
        # lax.ragged_dot's path, whose own batching rule takes only operands all mapped at dim
        # 0: under vmap with shared experts or sizes, of its gradients and inside them, they
        # batch as the kernels' path does, at the precision asked, in lax's dtypes.
        rng = np.random.default_rng(51)
        b, m, k, n, g = 3, 12, 5, 4, 3
        dtype = {"float32_highest": "float32", "f32_algorithm": "float32"}.get(case, case)
        kw = {
            "float32_highest": {"precision": lax.Precision.HIGHEST},
            "f32_algorithm": {"precision": "F32_F32_F32"},
            "int8": {"preferred_element_type": jnp.int32},
        }.get(case, {})

        def draw(shape):
            if case == "int8":
                return jnp.asarray(rng.integers(-4, 5, shape), jnp.int8)
            x = rng.standard_normal(shape)
            if case == "complex64":
                x = x + 1j * rng.standard_normal(shape)
            return jnp.asarray(x, dtype)

        def batched(shape, axis):
            return draw(shape) if axis is None else jnp.moveaxis(draw((b, *shape)), 0, axis)

        lhs, rhs = batched((m, k), in_axes[0]), batched((g, k, n), in_axes[1])
        sizes = jnp.asarray([[4, 0, 5], [1, 7, 6], [12, -1, 3]] if in_axes[2] == 0 else [4, 0, 5],
                            jnp.int32)  # fmt: skip
        ours = lambda a, w, s: jax_sm100.ragged_dot(a, w, s, **kw)  # noqa: E731
        wide = jnp.int32 if case == "int8" else (jnp.complex128 if case == "complex64" else
                                                jnp.float64)  # fmt: skip
        with jax.enable_x64(True):
            theirs = lambda a, w, s: _dense(  # noqa: E731
                a.astype(wide), w.astype(wide), jnp.clip(s, 0, m)
            )
            got = jax.vmap(ours, in_axes)(lhs, rhs, sizes)
            want = jax.vmap(theirs, in_axes)(lhs, rhs, sizes)
            one = jnp.zeros((m, k), lhs.dtype), jnp.zeros((g, k, n), rhs.dtype)
            self.assertEqual(got.dtype, lax.ragged_dot(*one, jnp.zeros(g, jnp.int32), **kw).dtype)
            if case == "int8":
                np.testing.assert_array_equal(got, want)
                return

            def close(x, y, terms):  # real and imaginary parts alike
                for part in (jnp.real, jnp.imag):
                    tu.assert_close(self, part(x), part(y), "float32", terms)

            close(got, want, k)
            # Gradients inside the vmap, of the vmap, and a tangent of it.
            loss = lambda f: lambda a, w, s: (f(a, w, s) * jnp.conj(f(a, w, s))).real.sum()  # noqa: E731
            for make in (
                lambda f: jax.vmap(jax.grad(loss(f), (0, 1)), in_axes),
                lambda f: jax.grad(lambda a, w, s: loss(jax.vmap(f, in_axes))(a, w, s), (0, 1)),
            ):
                for got_g, ref in zip(make(ours)(lhs, rhs, sizes), make(theirs)(lhs, rhs, sizes),
                                      strict=True):  # fmt: skip
                    self.assertEqual(got_g.dtype, lhs.dtype)
                    close(got_g, ref, k * m)
                if case == "float32_highest":  # every product at the precision asked
                    text = str(jax.make_jaxpr(make(ours))(lhs, rhs, sizes))
                    binds = [text.count(f"jax_sm100_ragged_{p}") for p in ("dot", "outer")]
                    self.assertGreaterEqual(min(binds), 1)
                    highest = text.count("precision=(Precision.HIGHEST, Precision.HIGHEST)")
                    self.assertEqual(highest, sum(binds))
            if case == "float32_highest" and in_axes == (0, None, 0):
                # jacfwd: a vmap of tangents beside unmapped primals (lax.ragged_dot's raises).
                jac = lambda f: jax.jacfwd(lambda w: f(lhs[0], w, sizes[0]))(rhs)  # noqa: E731
                close(jac(ours), jac(theirs), k)
            tangents = (draw(lhs.shape), draw(rhs.shape))
            _, got_t = jax.jvp(lambda a, w: jax.vmap(ours, in_axes)(a, w, sizes), (lhs, rhs),
                               tangents)  # fmt: skip
            _, want_t = jax.jvp(lambda a, w: jax.vmap(theirs, in_axes)(a, w, sizes), (lhs, rhs),
                                tangents)  # fmt: skip
            close(got_t, want_t, k)

    @parameterized.parameters(
        ("bfloat16", "complex64"),
        ("complex64", "bfloat16"),
        ("float16", "complex64"),
        ("complex64", "float16"),
    )
    def test_gradients_of_a_real_operand_beside_a_complex_one(self, a_dtype, b_dtype):
        # lax.ragged_dot's path (complex operands): a 16-bit real operand's cotangent comes
        # from a complex product, whose real part it is, as lax's transpose gives it; XLA's
        # ragged dot takes no real result narrower than its complex operands.
        rng = np.random.default_rng(0)
        m, k, n, g = 32, 16, 8, 3
        draw = lambda shape, dt: jnp.asarray(  # noqa: E731
            rng.standard_normal(shape) + (1j * rng.standard_normal(shape) if "complex" in dt else 0)
        ).astype(dt)
        lhs, rhs = draw((m, k), a_dtype), draw((g, k, n), b_dtype)
        sizes = jnp.array([10, -1, 12], jnp.int32)
        ours = lambda x, w: jax_sm100.ragged_dot(x, w, sizes)  # noqa: E731
        ref = lambda x, w: lax.ragged_dot(x, w, jnp.clip(sizes, 0, m))  # noqa: E731
        out, vjp = jax.vjp(ours, lhs, rhs)
        want, vjp_ref = jax.vjp(ref, lhs, rhs)
        self.assertEqual(out.dtype, want.dtype)
        ct = draw(want.shape, "complex64")
        for got, exp in zip(vjp(ct), vjp_ref(ct), strict=True):
            self.assertEqual(got.dtype, exp.dtype)
            np.testing.assert_allclose(
                np.asarray(got, np.complex64),
                np.asarray(exp, np.complex64),
                rtol=2e-2,
                atol=2e-2 * float(jnp.abs(exp.astype(jnp.complex64)).max()),
            )

    @parameterized.parameters(
        ("float64", "complex64"), ("complex64", "float64"), ("complex128", "float32")
    )
    def test_gradients_of_mixed_width_complex_products_under_x64(self, a_dtype, b_dtype):
        # float64 beside complex64 (or complex128 beside float32): the backward products'
        # operands are complex128, the cotangent of the narrower operand is written in
        # complex128 and converted after, as lax.ragged_dot's own transpose does.
        with jax.enable_x64(True):
            rng = np.random.default_rng(1)
            m, k, n, g = 16, 8, 4, 2
            draw = lambda shape, dt: jnp.asarray(  # noqa: E731
                rng.standard_normal(shape)
                + (1j * rng.standard_normal(shape) if "complex" in dt else 0)
            ).astype(dt)
            lhs, rhs = draw((m, k), a_dtype), draw((g, k, n), b_dtype)
            sizes = jnp.array([7, 6], jnp.int32)
            out, vjp = jax.vjp(lambda x, w: jax_sm100.ragged_dot(x, w, sizes), lhs, rhs)
            want, vjp_ref = jax.vjp(lambda x, w: lax.ragged_dot(x, w, sizes), lhs, rhs)
            self.assertEqual(out.dtype, want.dtype)
            ct = draw(want.shape, str(want.dtype))
            for got, exp in zip(vjp(ct), vjp_ref(ct), strict=True):
                self.assertEqual(got.dtype, exp.dtype)
                np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-5)

    def test_ragged_outer_is_the_weight_gradient_form(self):
        # out[i] = lhs[rows of i]^T @ rhs[rows of i], in both output orders.
        with jax.enable_x64(True):
            rng = np.random.default_rng(7)
            lhs, ct = tu.rand(rng, (20, 6), "float64"), tu.rand(rng, (20, 5), "float64")
            sizes = jnp.asarray([7, 0, 9], jnp.int32)
            for transpose_out in (False, True):
                out = ragged.ragged_outer_p.bind(
                    lhs, ct, sizes, out_dtype=np.dtype("float64"), transpose_out=transpose_out
                )
                starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
                for i, (s, size) in enumerate(zip(starts, np.asarray(sizes), strict=True)):
                    want = np.asarray(lhs[s : s + size]).T @ np.asarray(ct[s : s + size])
                    tu.assert_close(self, out[i], want.T if transpose_out else want, "float64")

    def test_fallbacks_are_recorded(self):
        rng = np.random.default_rng(8)
        lhs, rhs = tu.rand(rng, (16, 8), "float32"), tu.rand(rng, (2, 8, 4), "float32")
        sizes = jnp.asarray([8, 8], jnp.int32)
        with jax_sm100.lowerings() as seen:
            out = jax_sm100.ragged_dot(lhs, rhs, sizes, precision=lax.Precision.HIGHEST)
        self.assertIn("precision=HIGHEST", seen[-1].note)
        tu.assert_close(self, out, _reference(lhs, rhs, sizes), "float32", 8)
        with self.assertRaisesRegex(NotImplementedError, "group_offset.*sliced"):
            jax_sm100.ragged_dot(lhs, rhs, sizes, group_offset=jnp.zeros((1,), jnp.int32))

    def test_precision_forms_as_lax_takes_them(self):
        # lax canonicalizes precision: preset names as strings, a lax.DotAlgorithm (a
        # NamedTuple, not a pair of Precisions), and jax.default_matmul_precision for None.
        rng = np.random.default_rng(9)
        sizes = jnp.asarray([8, 8], jnp.int32)
        bf = [tu.rand(rng, s, "bfloat16") for s in ((16, 8), (2, 8, 4))]
        f32 = [x.astype(jnp.float32) for x in bf]

        def path(args, **kw):
            with jax_sm100.lowerings() as seen:
                jaxpr = jax.make_jaxpr(lambda a, b: jax_sm100.ragged_dot(a, b, sizes, **kw))(*args)
            # lax.ragged_dot's path is the primitive with lax's precision (`ragged._on_lax`).
            (eqn,) = [e for e in jaxpr.eqns if e.primitive is ragged.ragged_dot_p]
            on_kernels = eqn.params.get("precision") is None
            self.assertEqual(on_kernels, not seen, (kw, seen))
            return seen[-1].note if seen else None

        self.assertIsNone(path(bf, precision="BF16_BF16_F32"))
        self.assertIn("precision=F32_F32_F32", path(bf, precision="F32_F32_F32"))
        algorithm = lax.DotAlgorithm(jnp.bfloat16, jnp.bfloat16, jnp.float32)
        self.assertIn("explicit lax.DotAlgorithm", path(bf, precision=algorithm))
        self.assertIsNone(path(f32))
        with jax.default_matmul_precision("highest"):
            self.assertIn("HIGHEST with float32", path(f32))
            self.assertIsNone(path(bf))
        with self.assertRaisesRegex(ValueError, "Precision argument must be one of"):
            path(bf, precision="bogus")
        out = jax_sm100.ragged_dot(*bf, sizes, precision="BF16_BF16_F32")
        tu.assert_close(self, out, _reference(*bf, sizes), "bfloat16", 8)

    def test_mixed_16_bit_result_dtype_is_lax(self):
        # bfloat16 beside float16 gives lax's bfloat16 (jnp would promote to float32).
        rng = np.random.default_rng(10)
        sizes = jnp.asarray([5, 0, 6], jnp.int32)
        lhs, rhs = tu.rand(rng, (12, 8), "bfloat16"), tu.rand(rng, (3, 8, 4), "float16")
        for a, b in ((lhs, rhs), (lhs.astype(jnp.float16), rhs.astype(jnp.bfloat16))):
            want = lax.ragged_dot(a, b, sizes)
            got = jax_sm100.ragged_dot(a, b, sizes)
            self.assertEqual(got.dtype, want.dtype)
            tu.assert_close(self, got, _reference(a, b, sizes), "bfloat16", 8)
            grads = jax.grad(
                lambda a, b: jax_sm100.ragged_dot(a, b, sizes).astype(jnp.float32).sum(), (0, 1)
            )(a, b)
            self.assertEqual([g.dtype for g in grads], [a.dtype, b.dtype])

    def test_wide_preferred_type_without_x64_is_truncated(self):
        lhs, rhs = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((2, 8, 3), jnp.bfloat16)
        sizes = jnp.asarray([2, 2], jnp.int32)
        # x64 off here whatever the process has (some test modules turn it on at import).
        with jax.enable_x64(False):
            with self.assertWarnsRegex(
                UserWarning, "float64 requested in ragged_dot .* float32"
            ) as w:
                out = jax.jit(
                    lambda a, b: jax_sm100.ragged_dot(
                        a, b, sizes, preferred_element_type=jnp.float64
                    )
                )(lhs, rhs)
        self.assertEqual(w.filename, __file__)  # points at the caller
        self.assertEqual(out.dtype, jnp.float32)
        np.testing.assert_array_equal(out, np.full((4, 3), 8.0))

    def test_cuda_lowering_says_which_path(self):
        # Lowered for CUDA on a machine without a GPU and without a target arch: XLA's
        # ragged_dot_general, and the lowering says so.
        lhs = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
        rhs = jax.ShapeDtypeStruct((4, 32, 16), jnp.bfloat16)
        sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": ""}):
            with jax_sm100.lowerings() as seen:
                jax.export.export(jax.jit(jax_sm100.ragged_dot), platforms=["cuda"])(
                    lhs, rhs, sizes
                )
        self.assertTrue(any("XLA" in x.note for x in seen), seen)

    @parameterized.parameters((0, 64, 4, 32), (16, 0, 4, 32), (16, 64, 0, 32), (16, 64, 4, 0))
    def test_empty_extents(self, m, k, g, n):
        # Empty rows, contraction, groups or columns: zeros of the right shapes, forward and
        # gradients, eager and exported for sm_90a (where they run on XLA, which XLA's own ragged
        # dot cannot do with no groups).
        lhs = jnp.ones((m, k), jnp.bfloat16)
        rhs = jnp.ones((g, k, n), jnp.bfloat16)
        sizes = jnp.full((g,), m // max(g, 1), jnp.int32)

        def step(a, b, s):
            loss = lambda a, b: jax_sm100.ragged_dot(a, b, s).astype(jnp.float32).sum()  # noqa: E731
            return jax.value_and_grad(loss, argnums=(0, 1))(a, b)

        value, (da, db) = jax.jit(step)(lhs, rhs, sizes)
        self.assertEqual(float(value), 0.0 if 0 in (m, k, g, n) else float(m * k * n))
        self.assertEqual((da.shape, db.shape), (lhs.shape, rhs.shape))
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            with jax_sm100.lowerings() as seen:
                jax.export.export(
                    jax.jit(step), platforms=["cuda"],
                    disabled_checks=jax_sm100.export_disabled_checks(),
                )(lhs, rhs, sizes)  # fmt: skip
        self.assertTrue(all("empty operand" in x.note for x in seen), [x.note for x in seen])

    @parameterized.product(
        arch=["sm_90a", "sm_100a"],
        transpose_rhs=[False, True],
    )
    def test_training_products_are_grouped_kernels(self, arch, transpose_rhs):
        # Exported for each arch on this machine: the forward, the input gradient and the
        # weight gradient are each one call of the arch's grouped kernel (ragged rows, ragged
        # rows against the experts transposed, ragged contraction), 1-CTA, and no XLA ragged
        # dot is left.
        # (kernel, family class, a string the object holds naming its arch: the sm_100a cubin
        # carries "sm_100a"; the sm_90a one names its arch only in the ELF header's flags)
        kernel, family, arch_tag = {
            "sm_90a": ("sm90_wgmma_grouped", b"Sm90GroupedGemmKernel", b""),
            "sm_100a": ("sm100_tcgen05_grouped", b"Sm100GroupedGemmKernel", b"sm_100a"),
        }[arch]
        lhs = jax.ShapeDtypeStruct((1000, 64), jnp.bfloat16)
        rshape = (8, 48, 64) if transpose_rhs else (8, 64, 48)
        rhs = jax.ShapeDtypeStruct(rshape, jnp.bfloat16)
        sizes = jax.ShapeDtypeStruct((8,), jnp.int32)

        def step(a, b, s):
            def loss(a, b):
                w = jnp.swapaxes(b, 1, 2) if transpose_rhs else b
                return jnp.sum(jax_sm100.ragged_dot(a, w, s).astype(jnp.float32) ** 2)

            return jax.value_and_grad(loss, argnums=(0, 1))(a, b)

        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}):
            with jax_sm100.lowerings() as seen:
                exported = jax.export.export(
                    jax.jit(step), platforms=["cuda"],
                    disabled_checks=jax_sm100.export_disabled_checks(),
                )(lhs, rhs, sizes)  # fmt: skip
        text = exported.mlir_module()
        self.assertEqual(text.count("stablehlo.custom_call @jax_sm100_gemm"), 3)
        self.assertFalse(
            re.search(r"(chlo|stablehlo|mhlo)\.ragged_dot", text), "XLA ragged dot left"
        )
        plans = [x.plan for x in seen if x.plan is not None]
        self.assertEqual([p.kernel for p in plans], [kernel] * 3, seen)
        self.assertEqual({p.arch for p in plans}, {arch})
        self.assertEqual(sorted(p.ragged for p in plans), ["k", "m", "m"])
        self.assertTrue(all(p.groups == 8 and not p.use_2cta for p in plans))
        objects = [bytes.fromhex(h) for h in re.findall(r'object = dense<"0x([0-9A-F]+)"', text)]
        self.assertLen(objects, 3)
        for obj in objects:
            self.assertEqual(obj[:4], b"\x7fELF")
            self.assertIn(arch_tag, obj)
            self.assertIn(family, obj)

    @parameterized.product(activation=("relu", "gelu", "silu"), dtype=("bfloat16", "float32"))
    def test_activation(self, activation, dtype):
        # act of each float32 sum, rounded once; its gradients (through the float32 product and
        # act') and vmap; rows past the groups give act(0) = 0.
        m, k, n, g = 100, 24, 40, 7
        rng = np.random.default_rng(5)
        lhs, rhs = tu.rand(rng, (m, k), dtype), tu.rand(rng, (g, k, n), dtype)
        sizes = _groups(rng, m, g, fill=False)
        out = jax.jit(lambda a, b, s: jax_sm100.ragged_dot(a, b, s, activation=activation))(
            lhs, rhs, sizes
        )  # fmt: skip
        self.assertEqual(out.dtype, jnp.dtype(dtype))
        z = jnp.asarray(_reference(lhs, rhs, sizes), jnp.float32)
        want = P.apply_activation(z, activation)
        tu.assert_close(self, out, want, dtype, k)

        def loss(f, a, b):
            return jnp.sum(jnp.sin(f(a, b).astype(jnp.float32)))

        ours = lambda a, b: jax_sm100.ragged_dot(a, b, sizes, activation=activation)  # noqa: E731
        ref = lambda a, b: P.apply_activation(  # noqa: E731
            _dense(a.astype(jnp.float32), b.astype(jnp.float32), sizes), activation
        ).astype(dtype)
        got = jax.jit(jax.grad(lambda a, b: loss(ours, a, b), (0, 1)))(lhs, rhs)
        exp = jax.grad(lambda a, b: loss(ref, a, b), (0, 1))(lhs, rhs)
        for x, y in zip(got, exp, strict=True):
            tu.assert_close(self, x, y, dtype, k)
        both = jax.vmap(ours)(jnp.stack([lhs, -lhs]), jnp.stack([rhs, rhs]))
        tu.assert_close(self, both[0], want, dtype, k)
        tu.assert_close(self, both[1], P.apply_activation(-z, activation), dtype, k)
        with self.assertRaisesRegex(ValueError, "activation='tanh' must be one of"):
            jax_sm100.ragged_dot(lhs, rhs, sizes, activation="tanh")

    @parameterized.product(activation=(None, "gelu"), dtype=("bfloat16", "float32"))
    def test_bias(self, activation, dtype):
        # bias [g, n]: each row of group i gets bias[i] before the activation, rows past the
        # groups stay zero; one rounding; gradients (the bias's is the per-group sum of the
        # cotangent's rows, an empty group's zero) and vmap over the bias.
        m, k, n, g = 100, 24, 40, 7
        rng = np.random.default_rng(8)
        lhs, rhs = tu.rand(rng, (m, k), dtype), tu.rand(rng, (g, k, n), dtype)
        bias = tu.rand(rng, (g, n), "float32")
        sizes = jnp.asarray([20, 0, 13, 30, 1, 0, 21], jnp.int32)  # 85 rows in groups
        rows = np.repeat(np.arange(g), np.asarray(sizes))
        per_row = np.concatenate([np.asarray(bias)[rows], np.zeros((m - 85, n))])
        z = _reference(lhs, rhs, sizes) + per_row
        want = P.apply_activation(jnp.asarray(z, jnp.float32), activation)

        def ours(a, b, c):
            return jax_sm100.ragged_dot(a, b, sizes, bias=c, activation=activation)

        out = jax.jit(ours)(lhs, rhs, bias)
        self.assertEqual(out.dtype, jnp.dtype(dtype))
        tu.assert_close(self, out, want, dtype, k)
        self.assertEqual(float(jnp.max(jnp.abs(out[85:].astype(jnp.float32)))), 0.0)

        def ref(a, b, c):
            member = np.zeros((m, g), np.float32)
            member[np.arange(85), rows] = 1
            y = _dense(a.astype(jnp.float32), b.astype(jnp.float32), sizes) + member @ c
            return P.apply_activation(y, activation).astype(dtype)

        def loss(f, a, b, c):
            return jnp.sum(jnp.sin(f(a, b, c).astype(jnp.float32)))

        got = jax.jit(jax.grad(lambda a, b, c: loss(ours, a, b, c), (0, 1, 2)))(lhs, rhs, bias)
        exp = jax.grad(lambda a, b, c: loss(ref, a, b, c), (0, 1, 2))(lhs, rhs, bias)
        for x, y in zip(got, exp, strict=True):
            tu.assert_close(self, x, y, dtype, k)
        self.assertEqual(float(jnp.max(jnp.abs(got[2][1]))), 0.0)  # empty group
        both = jax.vmap(ours, (None, None, 0))(lhs, rhs, jnp.stack([bias, 2 * bias]))
        tu.assert_close(self, both[0], want, dtype, k)
        want2 = P.apply_activation(jnp.asarray(z + per_row, jnp.float32), activation)
        tu.assert_close(self, both[1], want2, dtype, k)

    def test_bias_differentiates_to_second_order(self):
        with jax.enable_x64(True):
            rng = np.random.default_rng(9)
            lhs, rhs = tu.rand(rng, (10, 4), "float64"), tu.rand(rng, (3, 4, 5), "float64")
            bias = tu.rand(rng, (3, 5), "float64")
            sizes = jnp.asarray([4, 0, 5], jnp.int32)
            check_grads(
                lambda a, b, c: jax_sm100.ragged_dot(a, b, sizes, bias=c, activation="silu"),
                (lhs, rhs, bias), order=2, modes=("fwd", "rev"),
            )  # fmt: skip

    def test_bias_edge_cases(self):
        # No groups: zeros, as without a bias. Sizes whose running sum overflows int32 saturate
        # at m as the kernels read them: all 10 rows in group 0.
        out = jax_sm100.ragged_dot(jnp.ones((4, 2)), jnp.ones((0, 2, 3)),
                                   jnp.zeros((0,), jnp.int32), bias=jnp.ones((0, 3)))  # fmt: skip
        self.assertEqual(float(jnp.max(jnp.abs(out))), 0.0)
        rows = ragged.group_rows(jnp.asarray([[1.0], [2.0], [3.0]]),
                                 jnp.asarray([2**31 - 1, 5, 1], jnp.int32), 10)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(rows)[:, 0], np.ones(10))
        rows = ragged.group_rows(jnp.asarray([[1.0], [2.0], [3.0]]),
                                 jnp.asarray([3, -2, 4], jnp.int32), 10)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(rows)[:, 0], [1] * 3 + [3] * 4 + [0] * 3)

    def test_bias_gradient_paths(self):
        # The bias gradient through the one-hot product (HIGHEST for a float32 or float16
        # result, the default for a bfloat16 one) equals the one through the gather (past the
        # limits), and a gradient keeps no [m, g] one-hot residual (jax.checkpoint rebuilds it).
        m, k, n, g = 100, 24, 40, 7
        rng = np.random.default_rng(10)
        lhs, rhs = tu.rand(rng, (m, k), "float32"), tu.rand(rng, (g, k, n), "float32")
        bias = tu.rand(rng, (g, n), "float32")
        sizes = jnp.asarray([20, 0, 13, 30, 1, 0, 21], jnp.int32)

        def loss(c, out=jnp.float32, activation="gelu"):
            y = jax_sm100.ragged_dot(lhs.astype(out), rhs.astype(out), sizes, bias=c,
                                     activation=activation)  # fmt: skip
            return jnp.sum(jnp.sin(y.astype(jnp.float32)))

        for out in (jnp.float32, jnp.bfloat16, jnp.float16):
            for activation in (None, "gelu"):
                product = jax.grad(loss)(bias, out, activation)
                with mock.patch.object(ragged, "_ONE_HOT_MAX_GROUPS", 0):
                    gather = jax.grad(loss)(bias, out, activation)
                np.testing.assert_allclose(product, gather, rtol=1e-5, atol=1e-5)
                grad = jax.grad(functools.partial(loss, out=out, activation=activation))
                text = str(jax.make_jaxpr(grad)(bias))
                # The one dot_general of the gradient is the bias's.
                self.assertEqual(text.count("dot_general["), 1)
                self.assertEqual("Precision.HIGHEST" in text, out != jnp.bfloat16)
        _, vjp = jax.vjp(loss, bias)
        shapes = [tuple(x.shape) for x in jax.tree.leaves(vjp)]
        self.assertNotIn((m, g), shapes)

    def test_bias_gradient_ignores_rows_past_the_groups(self):
        # A NaN or infinite cotangent in rows past every group (padding, dropped tokens: the
        # jnp.where(mask, f(out), 0) trap) leaves the bias gradient as lax's math has it, on
        # the one-hot product and the gather (the product made every group's NaN). Vmapped too.
        m, k, n, g = 50, 8, 16, 3
        rng = np.random.default_rng(12)
        lhs, rhs = tu.rand(rng, (m, k), "float32"), tu.rand(rng, (g, k, n), "float32")
        bias = tu.rand(rng, (g, n), "float32")
        sizes = jnp.asarray([10, 0, 25], jnp.int32)
        f = lambda c: jax_sm100.ragged_dot(lhs, rhs, sizes, bias=c)  # noqa: E731
        ct = tu.rand(rng, (m, n), "float32").at[40].set(jnp.nan).at[45, 3].set(jnp.inf)
        want = np.stack([np.asarray(ct[:10]).sum(0), np.zeros(n), np.asarray(ct[10:35]).sum(0)])
        for limit in (ragged._ONE_HOT_MAX_GROUPS, 0):
            with mock.patch.object(ragged, "_ONE_HOT_MAX_GROUPS", limit):
                got = jax.jit(lambda ct: jax.vjp(f, bias)[1](ct)[0])(ct)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
                batched = jax.vmap(lambda ct: jax.vjp(f, bias)[1](ct)[0])(jnp.stack([ct, ct]))
                np.testing.assert_allclose(batched, np.stack([want, want]), rtol=1e-5, atol=1e-5)

    def test_bias_errors_name_the_fix(self):
        lhs, rhs = jnp.ones((8, 4)), jnp.ones((2, 4, 3))
        sizes = jnp.asarray([4, 4], jnp.int32)
        with self.assertRaisesRegex(ValueError, r"bias.shape=\(3,\), expected \(g, n\)"):
            jax_sm100.ragged_dot(lhs, rhs, sizes, bias=jnp.ones((3,)))
        with self.assertRaisesRegex(TypeError, "bias must be floating"):
            jax_sm100.ragged_dot(lhs, rhs, sizes, bias=jnp.ones((2, 3), jnp.int32))

    def test_rhs_stored_transposed_names_the_transpose(self):
        lhs, sizes = jnp.ones((8, 32)), jnp.asarray([4, 4], jnp.int32)
        with self.assertRaisesRegex(ValueError, r"rhs is \[g, k, n\]: rhs.transpose\(0, 2, 1\)"):
            jax_sm100.ragged_dot(lhs, jnp.ones((2, 16, 32)), sizes)  # [g, n, k]
        with self.assertRaisesRegex(ValueError, r"k and g must agree$"):
            jax_sm100.ragged_dot(lhs, jnp.ones((2, 16, 8)), sizes)  # k wrong, not transposed

    def test_bias_training_step_runs_the_grouped_kernels(self):
        # sm_90a export of a training step with a bias and an activation: the three products
        # are still the grouped kernel's, the forward's with the bias in its epilogue (the
        # activation is XLA's, on the float32 sum its gradient needs), no XLA ragged dot is left;
        # without the gradient the activation joins the bias in the epilogue.
        lhs = jax.ShapeDtypeStruct((1000, 64), jnp.bfloat16)
        rhs = jax.ShapeDtypeStruct((8, 64, 48), jnp.bfloat16)
        bias = jax.ShapeDtypeStruct((8, 48), jnp.float32)
        sizes = jax.ShapeDtypeStruct((8,), jnp.int32)

        def step(a, b, c, s):
            def loss(a, b, c):
                y = jax_sm100.ragged_dot(a, b, s, bias=c, activation="gelu")
                return jnp.sum(y.astype(jnp.float32) ** 2)

            return jax.value_and_grad(loss, argnums=(0, 1, 2))(a, b, c)

        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            with jax_sm100.lowerings() as seen:
                text = _export(jax.jit(step), lhs, rhs, bias, sizes).mlir_module()
        plans = [x.plan for x in seen if x.plan is not None]
        self.assertEqual([p.kernel for p in plans], ["sm90_wgmma_grouped"] * 3, seen)
        self.assertEqual(sorted(p.ragged for p in plans), ["k", "m", "m"])
        self.assertFalse(re.search(r"(chlo|stablehlo|mhlo)\.ragged_dot", text))
        notes = [x.note for x in seen]
        self.assertEqual(sum("bias in the epilogue" in n for n in notes), 1, notes)
        # Each note names the kernel, tile and cluster that run (what train_moe.py prints).
        for p, n in zip(plans, notes, strict=True):
            tm, tn = p.cta_tile_mnk[:2]
            kind = "ping-pong" if p.pingpong else "cooperative"
            where = f"{kind} tiles in {p.cluster_shape_mn[0]}x1"
            self.assertIn(f"sm90_wgmma_grouped {tm}x{tn} {where}", n)
            self.assertEqual(", dynamic tiles" in n, p.dynamic_tiles, n)
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            with jax_sm100.lowerings() as seen:
                _export(jax.jit(lambda a, b, c, s: jax_sm100.ragged_dot(
                    a, b, s, bias=c, activation="gelu")), lhs, rhs, bias, sizes)  # fmt: skip
        self.assertEqual([x.note.split(": ")[-1].split("; ")[-1] for x in seen],
                         ["bias and gelu in the epilogue"])  # fmt: skip

    def test_bias_on_a_family_without_it(self):
        # A grouped family whose epilogue takes no bias: its float32 product, then XLA's bias
        # rows and activation, said so in the lowering's note.
        from jax_sm100._src.kernels import sm90_grouped  # noqa: PLC0415

        lhs = jax.ShapeDtypeStruct((1000, 64), jnp.bfloat16)
        rhs = jax.ShapeDtypeStruct((8, 64, 48), jnp.bfloat16)
        bias = jax.ShapeDtypeStruct((8, 48), jnp.float32)
        sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
        f = lambda a, b, c, s: jax_sm100.ragged_dot(a, b, s, bias=c, activation="gelu")  # noqa: E731
        with (
            mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}),
            mock.patch.object(sm90_grouped.Sm90GroupedGemmKernel, "GROUPED_BIAS", False),
            jax_sm100.lowerings() as seen,
        ):
            _export(jax.jit(f), lhs, rhs, bias, sizes)
        (low,) = seen
        self.assertEqual(low.plan.kernel, "sm90_wgmma_grouped")
        self.assertIn("bias and gelu by XLA after the float32 product", low.note)
        self.assertNotIn("in the epilogue", low.note)

    def test_composed_product_keeps_the_bias(self):
        # ragged_gpu._composed (the activation by XLA: JAX_SM100_RAGGED_FUSED_ACTIVATION=0, or a
        # family whose epilogue takes no bias), with no target arch so that XLA's product stands
        # in for the kernel: the bias in the float32 product, or (with a reason) XLA's bias rows
        # added after it, then the activation and one rounding; rows past the groups stay zero.
        from jax_sm100._src import ragged_gpu  # noqa: PLC0415

        rng = np.random.default_rng(53)
        m, k, n, g = 24, 16, 8, 3
        lhs, rhs = tu.rand(rng, (m, k), "bfloat16"), tu.rand(rng, (g, k, n), "bfloat16")
        bias = tu.rand(rng, (g, n), "float32")
        sizes = jnp.asarray([7, 0, 12], jnp.int32)  # 5 rows in no group
        params = dict(transpose_rhs=False, out_dtype=np.dtype(jnp.bfloat16), activation="gelu")
        want = ragged._ragged_dot_xla(lhs, rhs, sizes, bias, **params)
        env = {key: v for key, v in os.environ.items() if key != "JAX_SM100_TARGET_ARCH"}
        for why in (None, "no bias in this family's epilogue"):
            with self.subTest(why=why), mock.patch.dict(os.environ, env, clear=True):
                got = ragged_gpu._composed("ragged_dot", ragged._ragged_dot_xla, lhs, rhs, sizes,
                                           (bias,), params, "", why)  # fmt: skip
                self.assertEqual(got.dtype, jnp.bfloat16)
                tu.assert_close(self, got, want, "bfloat16", k)
                self.assertEqual(float(jnp.max(jnp.abs(got[19:].astype(jnp.float32)))), 0.0)

    def test_bad_switch_values_are_refused(self):
        # The two grouped switches take only their documented values, on every arch (a typo
        # such as "off" would otherwise silently keep the default).
        lhs = jax.ShapeDtypeStruct((1000, 64), jnp.bfloat16)
        rhs = jax.ShapeDtypeStruct((8, 64, 48), jnp.bfloat16)
        sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
        fwd = jax.jit(lambda a, b, s: jax_sm100.ragged_dot(a, b, s, activation="gelu"))
        for arch in ("sm_90a", "sm_100a"):
            for env, message in (
                ({"JAX_SM100_RAGGED_FUSED_ACTIVATION": "off"},
                 "JAX_SM100_RAGGED_FUSED_ACTIVATION='off': '1', '0' or unset"),
                ({"JAX_SM100_GROUPED_SCHEDULE": "pp"}, "JAX_SM100_GROUPED_SCHEDULE='pp': one of"),
            ):  # fmt: skip
                env = {"JAX_SM100_TARGET_ARCH": arch, **env}
                with mock.patch.dict(os.environ, env), self.subTest(arch=arch, env=env):
                    with self.assertRaisesRegex(jax_sm100.PlanError, message):
                        _export(fwd, lhs, rhs, sizes)

    @parameterized.parameters("0", "", "1")
    def test_activation_lowering(self, fused):
        # sm_90a: by default (or with JAX_SM100_RAGGED_FUSED_ACTIVATION=1) the kernel's epilogue
        # applies the activation; with =0 the kernel writes the float32 product and XLA applies
        # it. Under grad the
        # products are the three grouped kernels either way (the JVP binds the plain product).
        lhs = jax.ShapeDtypeStruct((1000, 64), jnp.bfloat16)
        rhs = jax.ShapeDtypeStruct((8, 64, 48), jnp.bfloat16)
        sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
        fwd = jax.jit(lambda a, b, s: jax_sm100.ragged_dot(a, b, s, activation="gelu"))
        env = {"JAX_SM100_TARGET_ARCH": "sm_90a", "JAX_SM100_RAGGED_FUSED_ACTIVATION": fused}
        with mock.patch.dict(os.environ, env), jax_sm100.lowerings() as seen:
            text = _export(fwd, lhs, rhs, sizes).mlir_module()
        (low,) = [x for x in seen if x.plan is not None]
        self.assertEqual(low.plan.kernel, "sm90_wgmma_grouped")
        if fused != "0":
            self.assertEqual(low.plan.out_dtype, "bfloat16")
            self.assertIn("gelu in the epilogue", low.note)
            self.assertNotIn("stablehlo.tanh", text)
        else:
            # The kernel's float32 product, then XLA's gelu (its tanh) and one rounding.
            self.assertEqual(low.plan.out_dtype, "float32")
            self.assertIn("gelu by XLA after the float32 product", low.note)
            self.assertIn("stablehlo.tanh", text)

        def step(a, b, s):
            loss = lambda a, b: jnp.sum(  # noqa: E731
                jax_sm100.ragged_dot(a, b, s, activation="gelu").astype(jnp.float32) ** 2
            )
            return jax.value_and_grad(loss, argnums=(0, 1))(a, b)

        with mock.patch.dict(os.environ, env), jax_sm100.lowerings() as seen:
            _export(jax.jit(step), lhs, rhs, sizes)
        plans = [x.plan for x in seen if x.plan is not None]
        self.assertEqual([p.kernel for p in plans], ["sm90_wgmma_grouped"] * 3)
        self.assertEqual(sorted(p.ragged for p in plans), ["k", "m", "m"])

    @parameterized.named_parameters(
        ("rank", (8, 4, 2), (2, 4, 3), (2,), ValueError, "lhs must be.*jax.vmap"),
        ("k", (8, 4), (2, 5, 3), (2,), ValueError, "k and g must agree"),
        ("g", (8, 4), (2, 4, 3), (3,), ValueError, "k and g must agree"),
        ("sizes_dtype", (8, 4), (2, 4, 3), (2,), TypeError, "group_sizes must be integers"),
        ("operand_dtype", (8, 4), (2, 4, 3), (2,), TypeError, "ragged_dot: lhs has boolean"),
        # fp4 runs only block-scaled, and no grouped product is: not a scaled_matmul hint alone.
        ("fp4", (8, 4), (2, 4, 3), (2,), TypeError,
         "float4_e2m1fn, which runs only block-scaled, and no grouped product is"),
    )  # fmt: skip
    def test_errors_name_the_fix(self, lhs_shape, rhs_shape, sizes_shape, error, message):
        lhs_dtype = {"boolean": jnp.bool_, "float4": jnp.float4_e2m1fn}
        lhs_dtype = next((d for key, d in lhs_dtype.items() if key in message), jnp.float32)
        lhs = jnp.ones(lhs_shape, lhs_dtype)
        rhs = jnp.ones(rhs_shape, jnp.float32)
        sizes = jnp.ones(sizes_shape, jnp.float32 if "integers" in message else jnp.int32)
        with self.assertRaisesRegex(error, message):
            jax_sm100.ragged_dot(lhs, rhs, sizes)

    def test_what_runs_on_lax_ragged_dot(self):
        # Integer operands, and dot algorithms the kernels do not compute, run on lax.ragged_dot
        # itself, recorded; the kernels' own algorithms stay on the primitive.
        rng = np.random.default_rng(21)
        sizes = jnp.array([5, 0, 6], jnp.int32)
        li = jnp.asarray(rng.integers(-8, 8, (12, 16)), jnp.int8)
        ri = jnp.asarray(rng.integers(-8, 8, (3, 16, 4)), jnp.int8)
        with jax_sm100.lowerings() as seen:
            got = jax_sm100.ragged_dot(li, ri, sizes, preferred_element_type=jnp.int32)
        np.testing.assert_array_equal(
            got, lax.ragged_dot(li, ri, sizes, preferred_element_type=jnp.int32)
        )  # fmt: skip
        self.assertIn("int8 x int8 operands", seen[-1].note)
        with self.assertRaisesRegex(TypeError, "no bias or activation"):
            jax_sm100.ragged_dot(li, ri, sizes, activation="relu")
        lhs = jnp.asarray(rng.standard_normal((12, 16)), jnp.float32)
        rhs = jnp.asarray(rng.standard_normal((3, 16, 4)), jnp.float32)
        with jax_sm100.lowerings() as seen:
            got = jax_sm100.ragged_dot(lhs, rhs, sizes,
                                       precision=lax.DotAlgorithmPreset.F32_F32_F32)  # fmt: skip
        self.assertIn("precision=F32_F32_F32", seen[-1].note)
        tu.assert_close(self, got, _reference(lhs, rhs, sizes), "float32", 16)
        lb, rb = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)
        jaxpr = jax.make_jaxpr(
            lambda a, b: jax_sm100.ragged_dot(a, b, sizes,
                                              precision=lax.DotAlgorithmPreset.BF16_BF16_F32)
        )(lb, rb)  # fmt: skip
        self.assertIn("ragged", str(jaxpr))
        self.assertNotIn("ragged_dot_general", str(jaxpr))

    @parameterized.parameters(False, True)
    def test_batched_operands_fold_into_one_grouped_product(self, transpose):
        # The CUDA lowering's fold of vmap'd operands (ragged_gpu.fold_rows / fold_outer),
        # checked with XLA's product in the kernel's place: sizes past m, negative, empty
        # groups, and batches whose groups end before m.
        from jax_sm100._src import ragged_gpu  # noqa: PLC0415

        batch, g, m, k, n = (2, 3), 4, 13, 8, 5
        sizes, lhs, rhs, bias, ct = _batched_case(31, transpose)
        params = dict(transpose_rhs=transpose, out_dtype=np.dtype(np.float32), activation="gelu")
        want = ragged._ragged_dot_xla(lhs, rhs, sizes, bias, **params)
        fl, fr, fs, fb, unfold = ragged_gpu.fold_rows(lhs, rhs, sizes, (bias,))
        self.assertEqual((fl.ndim, fs.shape), (2, (6 * g,)))
        got = unfold(ragged._ragged_dot_xla(fl, fr, fs, *fb, **params))
        tu.assert_close(self, got, want, "float32", k)
        # Experts shared by the batches stay g matrices, which folded group q reads as
        # rhs[q mod g] (the kernel's `KernelSpec.b_groups`; XLA's fallback copies them).
        w, c = rhs[0, 0], bias[0, 0]
        want = ragged._ragged_dot_xla(lhs, w, sizes, c, **params)
        fl, fr, fs, fb, unfold = ragged_gpu.fold_rows(lhs, w, sizes, (c,))
        self.assertEqual((fr.shape, fb[0].shape), (w.shape, (6 * g, n)))
        got = unfold(ragged_gpu._on_copied_experts(ragged._ragged_dot_xla, 6, fl, fr, fs, *fb,
                                                   **params))  # fmt: skip
        tu.assert_close(self, got, want, "float32", k)
        outer = dict(out_dtype=np.dtype(np.float32), transpose_out=transpose)
        want = ragged._ragged_outer_xla(lhs, ct, sizes, **outer)
        fl, fc, fs, unfold, segments = ragged_gpu.fold_outer(lhs, ct, sizes)
        self.assertEqual((fs.shape, segments), ((6 * (g + 1),), 1))
        got = unfold(ragged._ragged_outer_xla(fl, fc, fs, **outer))
        self.assertEqual(got.shape, want.shape)
        tu.assert_close(self, got, want, "float32", m)
        # The innermost batch dims summed (the gradient of experts shared by those batches):
        # runs of groups, the summed dims first, that the kernel adds up (`k_segments`).
        for summed in (1, 2):
            want = ragged._ragged_outer_xla(lhs, ct, sizes, summed=summed, **outer)
            fl, fc, fs, unfold, segments = ragged_gpu.fold_outer(lhs, ct, sizes, summed)
            self.assertEqual(segments, math.prod(batch[2 - summed :]))
            got = unfold(ragged_gpu._summed_segments(ragged._ragged_outer_xla, segments, fl, fc,
                                                     fs, **outer))  # fmt: skip
            self.assertEqual(got.shape, want.shape)
            tu.assert_close(self, got, want, "float32", m * segments)

    @parameterized.parameters(False, True)
    def test_shared_experts_merge_rows_by_expert(self, transpose):
        # The CUDA lowering's merge of batches that share their experts (ragged_gpu.
        # merge_rows): every batch's rows of expert j together, the product and its weight
        # gradient (summed over the batches) then unbatched, checked with XLA's product in the
        # kernel's place; sizes past m, negative, empty groups, batches ending before m.
        from jax_sm100._src import ragged_gpu  # noqa: PLC0415

        g, m, k = 4, 13, 8
        sizes, lhs, rhs, bias, ct = _batched_case(37, transpose)
        w, c = rhs[0, 0], bias[0, 0]  # the experts shared by every batch
        src, dest, merged = ragged_gpu.merge_rows(sizes.reshape(6, g), m)
        np.testing.assert_array_equal(np.sort(np.asarray(dest)), np.arange(6 * m))
        np.testing.assert_array_equal(np.asarray(src)[np.asarray(dest)], np.arange(6 * m))
        rows = lambda x: x.reshape(6 * m, x.shape[-1])[src]  # noqa: E731
        params = dict(transpose_rhs=transpose, out_dtype=np.dtype(np.float32), activation="gelu")
        want = ragged._ragged_dot_xla(lhs, w, sizes, c, **params)
        got = ragged._ragged_dot_xla(rows(lhs), w, merged, c, **params)[dest]
        tu.assert_close(self, got.reshape(want.shape), want, "float32", k)
        outer = dict(out_dtype=np.dtype(np.float32), transpose_out=transpose)
        want = ragged._ragged_outer_xla(lhs, ct, sizes, summed=2, **outer)
        got = ragged._ragged_outer_xla(rows(lhs), rows(ct), merged, **outer)
        tu.assert_close(self, got, want, "float32", 6 * m)

    @parameterized.product(arch=("sm_90a", "sm_100a"), merge=(False, True))
    def test_vmap_runs_on_the_grouped_kernel(self, arch, merge):
        # Exported for an sm_90a / sm_100a target, vmap of ragged_dot and of its gradient
        # lowers every product onto the grouped kernel: the batches folded, or (the experts
        # shared and the groups small, `ragged_gpu.merges_batches`) their rows merged by
        # expert. Per-example weight gradients (grad inside the vmap) always fold; the
        # gradient of shared experts (grad of the vmap) sums the batches in the kernel.
        from jax_sm100._src import ragged_gpu  # noqa: PLC0415

        kernel = {"sm_90a": planning.KERNEL_SM90_GROUPED,
                  "sm_100a": planning.KERNEL_SM100_GROUPED}[arch]  # fmt: skip
        lhs = jax.ShapeDtypeStruct((4, 512, 256), jnp.bfloat16)
        rhs = jax.ShapeDtypeStruct((8, 256, 384), jnp.bfloat16)
        sizes = jax.ShapeDtypeStruct((4, 8), jnp.int32)
        loss = lambda a, b, s: jnp.sum(  # noqa: E731
            jax_sm100.ragged_dot(a, b, s).astype(jnp.float32) ** 2
        )
        per_example = jax.jit(jax.vmap(jax.grad(loss, (0, 1)), (0, None, 0)))
        summed = jax.jit(jax.grad(lambda a, b, s: jax.vmap(loss, (0, None, 0))(a, b, s).sum(),
                                  (0, 1)))  # fmt: skip
        merged = "4 batches' rows merged by expert"
        for f, outer in ((per_example, "vmap: 4 batches folded"),
                         (summed, "4 of them summed in the kernel")):  # fmt: skip
            with (
                mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}),
                mock.patch.dict(
                    ragged_gpu.MERGE_BELOW_ROWS,
                    forward=1 << 20 if merge else 0,
                    differentiated=1 << 20 if merge else 0,
                ),
                jax_sm100.lowerings() as seen,
            ):
                text = _export(f, lhs, rhs, sizes).mlir_module()
            grouped = [x for x in seen if x.plan is not None]
            self.assertEqual([x.plan.kernel for x in grouped], [kernel] * 3)
            for x in grouped:
                if x.note.startswith("ragged_outer"):
                    want = merged if merge and f is summed else outer
                else:  # the forward and d lhs read the 8 experts in place
                    want = merged if merge else "(its 8 experts shared"
                self.assertIn(want, x.note)
            if f is summed:
                # No copy of the experts per batch, nor a weight gradient per batch to sum.
                self.assertFalse(re.search(r"tensor<4x8x256x384x", text), "a [4, 8, k, n]")

    def test_folded_batches_keep_int32_sizes_under_x64(self):
        # With x64 on, the rows each batch's groups hold were summed as int64 and added to the
        # int32 sizes: a FutureWarning from JAX 0.11 (an error in later releases).
        lhs = jax.ShapeDtypeStruct((4, 512, 256), jnp.bfloat16)
        rhs = jax.ShapeDtypeStruct((4, 8, 256, 384), jnp.bfloat16)
        sizes = jax.ShapeDtypeStruct((4, 8), jnp.int32)
        f = jax.jit(jax.vmap(jax_sm100.ragged_dot))
        with (
            jax.enable_x64(True),
            warnings.catch_warnings(),
            mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}),
            jax_sm100.lowerings() as seen,
        ):
            warnings.simplefilter("error", FutureWarning)
            _export(f, lhs, rhs, sizes)
        self.assertEqual([x.plan.kernel for x in seen], [planning.KERNEL_SM90_GROUPED])

    def test_shared_experts_merge_alike_forward_and_backward(self):
        # At 128 rows a group (4 batches of 1024 rows, 8 shared experts) a forward alone folds
        # (`MERGE_BELOW_ROWS["forward"]`), and a training step merges all three of its
        # products (`["differentiated"]`, set by ragged_dot's JVP and transpose), so that the
        # backward reuses the forward's row gathers. Without a summed weight gradient (frozen
        # experts; per-example gradients, the grad inside the vmap) they decide as a forward.
        lhs = jax.ShapeDtypeStruct((4, 1024, 256), jnp.bfloat16)
        rhs = jax.ShapeDtypeStruct((8, 256, 384), jnp.bfloat16)
        sizes = jax.ShapeDtypeStruct((4, 8), jnp.int32)
        fwd = lambda a, b, s: jax.vmap(jax_sm100.ragged_dot, (0, None, 0))(a, b, s)  # noqa: E731
        loss = lambda a, b, s: jnp.sum(fwd(a, b, s).astype(jnp.float32) ** 2)  # noqa: E731
        one = lambda a, b, s: jnp.sum(  # noqa: E731
            jax_sm100.ragged_dot(a, b, s).astype(jnp.float32) ** 2
        )
        step = jax.jit(jax.value_and_grad(loss, (0, 1)))
        frozen = jax.jit(jax.grad(loss))
        per_example = jax.jit(jax.vmap(jax.grad(one, (0, 1)), (0, None, 0)))
        merged, folded = "4 batches' rows merged by expert", "vmap: 4 batches folded"
        for f, want, products in ((jax.jit(fwd), folded, 1), (step, merged, 3), (frozen, folded, 2),
                                  (per_example, folded, 3)):  # fmt: skip
            with (
                mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}),
                jax_sm100.lowerings() as seen,
            ):
                _export(f, lhs, rhs, sizes)
            notes = [x.note for x in seen if x.plan is not None]
            self.assertEqual(len(notes), products, notes)
            for note in notes:
                self.assertIn(want, note)
        jaxpr = jax.make_jaxpr(step)(*(jnp.zeros(x.shape, x.dtype) for x in (lhs, rhs, sizes)))
        self.assertEqual(str(jaxpr).count("differentiated=True"), 2, jaxpr)

    def test_vmap_over_no_batches(self):
        # Zero batches (the experts shared or not) lower to XLA's ragged dot, which gives the
        # empty results and zero weight gradients (the fold once divided by zero segments).
        lhs = jax.ShapeDtypeStruct((0, 8192, 256), jnp.bfloat16)
        sizes = jax.ShapeDtypeStruct((0, 8), jnp.int32)
        for rhs, axes in (((8, 256, 384), (0, None, 0)), ((0, 8, 256, 384), (0, 0, 0))):
            rhs = jax.ShapeDtypeStruct(rhs, jnp.bfloat16)
            f = jax.jit(
                jax.grad(
                    lambda a, b, s, axes=axes: (
                        jax.vmap(jax_sm100.ragged_dot, axes)(a, b, s).astype(jnp.float32).sum()
                    ),
                    (0, 1),
                )
            )
            with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
                with jax_sm100.lowerings() as seen:
                    _export(f, lhs, rhs, sizes)
            self.assertTrue(seen)
            for x in seen:
                self.assertIn("no groups or no batches run on XLA", x.note)
        with jax.enable_x64(True):
            w = tu.rand(np.random.default_rng(3), (4, 5, 6), "float64")
            d_w = jax.grad(
                lambda b: jax.vmap(jax_sm100.ragged_dot, (0, None, 0))(
                    jnp.zeros((0, 7, 5)), b, jnp.zeros((0, 4), jnp.int32)
                ).sum()
            )(w)
            np.testing.assert_array_equal(d_w, np.zeros_like(w))

    def test_shared_experts_second_order(self):
        # Second derivatives through shared experts' weight gradient (whose transpose sums
        # over the batch dims): one batch dim, and two (nested vmap), against dense float64.
        with jax.enable_x64(True):
            rng = np.random.default_rng(43)
            m, k, n, g = 7, 3, 4, 3
            rhs = tu.rand(rng, (g, k, n), "float64")

            def check(batch):
                lhs = tu.rand(rng, (*batch, m, k), "float64")
                sizes = jnp.asarray(rng.integers(0, 4, (*batch, g)), jnp.int32)

                def loss(f, x, w):
                    mapped = f
                    for _ in batch:
                        mapped = jax.vmap(mapped, (0, None, 0))
                    return jnp.sin(mapped(x, w, sizes)).sum()

                for name, fn in (
                    ("hessian in rhs", lambda f: jax.hessian(lambda w: loss(f, lhs, w))(rhs)),
                    ("d lhs of d rhs", lambda f: jax.jacrev(
                        jax.grad(lambda x, w: loss(f, x, w), 1), 0)(lhs, rhs)),
                ):  # fmt: skip
                    with self.subTest(batch=batch, derivative=name):
                        got, want = fn(jax_sm100.ragged_dot), fn(_dense)
                        tu.assert_close(self, got, want, "float64", k)

            check((2,))
            check((2, 2))

    def test_shared_experts_under_nested_vmap(self):
        # Experts unmapped by an inner vmap stay shared ([g, k, n] beside [*B, m, k] rows);
        # an outer vmap that maps them, or the bias, broadcasts them along the inner batch.
        with jax.enable_x64(True):
            rng = np.random.default_rng(41)
            b, m, k, n, g = 3, 11, 5, 6, 4
            lhs = tu.rand(rng, (b, m, k), "float64")
            rhs = tu.rand(rng, (g, k, n), "float64")
            bias = tu.rand(rng, (g, n), "float64")
            sizes = jnp.asarray([[3, 0, 5, 2], [0, 0, 11, 0], [9, 1, 1, 1]], jnp.int32)
            want = jnp.stack([_dense(lhs[i], rhs, sizes[i]) for i in range(b)])
            inner = jax.vmap(jax_sm100.ragged_dot, (0, None, 0))
            jaxpr = str(jax.make_jaxpr(inner)(lhs, rhs, sizes))
            self.assertNotIn(f"f64[{b},{g},{k},{n}]", jaxpr)  # no copy per batch
            tu.assert_close(self, inner(lhs, rhs, sizes), want, "float64", k)
            outer = jax.vmap(lambda r: inner(lhs, r, sizes))(jnp.stack([rhs, -2 * rhs]))
            tu.assert_close(self, outer[1], -2 * want, "float64", k)
            outer = jax.vmap(inner, (0, None, None))(jnp.stack([lhs, 3 * lhs]), rhs, sizes)
            tu.assert_close(self, outer[1], 3 * want, "float64", k)
            biased = lambda x, c: jax_sm100.ragged_dot(x, rhs, sizes[0], bias=c)  # noqa: E731
            got = jax.vmap(jax.vmap(biased, (0, None)), (None, 0))(lhs, jnp.stack([bias, bias]))
            ref = jax.vmap(biased, (0, None))(lhs, bias)
            tu.assert_close(self, got[1], ref, "float64", k)

            def loss(f, x, w, c):
                return jnp.sin(jax.vmap(f, (0, None, 0, None))(x, w, sizes, c)).sum()

            ours = lambda x, w, s, c: jax_sm100.ragged_dot(  # noqa: E731
                x, w, s, bias=c, activation="silu"
            )
            ref = lambda x, w, s, c: jax.nn.silu(  # noqa: E731
                _dense(x, w, s) + ragged.group_rows(c, s, m)
            )
            got = jax.grad(functools.partial(loss, ours), (0, 1, 2))(lhs, rhs, bias)
            exp = jax.grad(functools.partial(loss, ref), (0, 1, 2))(lhs, rhs, bias)
            for x, y in zip(got, exp, strict=True):
                tu.assert_close(self, x, y, "float64", k * b)

    def test_fp8_weights_with_bfloat16_rows(self):
        # The fp8 operand is widened exactly to bfloat16, so the pair takes the primitive (the
        # 16-bit kernel on a GPU) and equals the product of the widened operands.
        rng = np.random.default_rng(23)
        sizes = jnp.array([7, 0, 9], jnp.int32)
        lhs = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
        rhs = jnp.asarray(rng.standard_normal((3, 32, 8)), jnp.float8_e4m3fn)
        jaxpr = str(jax.make_jaxpr(jax_sm100.ragged_dot)(lhs, rhs, sizes))
        self.assertIn("convert_element_type", jaxpr)
        got = jax_sm100.ragged_dot(lhs, rhs, sizes)
        self.assertEqual(got.dtype, jnp.bfloat16)
        want = jax_sm100.ragged_dot(lhs, rhs.astype(jnp.bfloat16), sizes)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        d_lhs, d_rhs = jax.grad(
            lambda a, b: jax_sm100.ragged_dot(a, b, sizes).astype(jnp.float32).sum(), (0, 1)
        )(lhs, rhs)  # fmt: skip
        self.assertEqual((d_lhs.dtype, d_rhs.dtype), (jnp.bfloat16, jnp.float8_e4m3fn))
        # Either side, either 16-bit type; the kernels' own algorithm for the widened pair
        # stays on the primitive.
        f16 = lhs.astype(jnp.float16)
        jaxpr = str(jax.make_jaxpr(
            lambda a, b: jax_sm100.ragged_dot(a, b, sizes,
                                              precision=jax.lax.DotAlgorithmPreset.F16_F16_F32)
        )(f16, rhs))  # fmt: skip
        self.assertNotIn("ragged_dot_general", jaxpr)
        lhs8 = lhs.astype(jnp.float8_e5m2)
        got = jax_sm100.ragged_dot(lhs8, rhs.astype(jnp.bfloat16), sizes)
        want = jax_sm100.ragged_dot(lhs8.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), sizes)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

    @parameterized.parameters("sm_90a", "sm_100a")
    def test_fp8_training_step_runs_the_grouped_kernels(self, arch):
        # fp8 experts [g, k, n] (quantized from bfloat16 masters in the step): on sm_90a, whose
        # fp8 wgmma reads B K-major, XLA transposes them for the forward's fp8 kernel; the
        # backward's two products run on the bfloat16 kernel (fp8 operands widened exactly).
        # No XLA ragged dot is left on either arch.
        lhs = jax.ShapeDtypeStruct((1000, 64), jnp.bfloat16)
        rhs = jax.ShapeDtypeStruct((8, 64, 48), jnp.bfloat16)
        sizes = jax.ShapeDtypeStruct((8,), jnp.int32)

        def step(a, w, s):
            def loss(a, w):
                y = jax_sm100.ragged_dot(a.astype(jnp.float8_e4m3fn),
                                         w.astype(jnp.float8_e4m3fn), s)  # fmt: skip
                return jnp.sum(y.astype(jnp.float32) ** 2)

            return jax.value_and_grad(loss, argnums=(0, 1))(a, w)

        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}):
            with jax_sm100.lowerings() as seen:
                text = _export(jax.jit(step), lhs, rhs, sizes).mlir_module()
        self.assertFalse(re.search(r"(chlo|stablehlo|mhlo)\.ragged_dot", text))
        ran = [(x.plan.a_dtype, x.plan.ragged) for x in seen if x.plan is not None]
        self.assertEqual(sorted(ran), [("bfloat16", "k"), ("bfloat16", "m"),
                                       ("float8_e4m3fn", "m")], seen)  # fmt: skip
        forward = next(x for x in seen if x.plan is not None and x.plan.a_dtype != "bfloat16")
        self.assertEqual(forward.plan.b_major, "k" if arch == "sm_90a" else "n")
        self.assertEqual("experts transposed" in forward.note, arch == "sm_90a", forward.note)

    def test_two_fp8_formats_run_as_bfloat16(self):
        # e4m3 beside e5m2: both widened exactly to bfloat16 (the kernels take one operand
        # dtype), equal to the product of the widened operands; ANY_F8_ANY_F8_F32 stays there.
        rng = np.random.default_rng(29)
        sizes = jnp.array([5, 0, 9], jnp.int32)
        lhs = jnp.asarray(rng.standard_normal((16, 32)), jnp.float8_e5m2)
        rhs = jnp.asarray(rng.standard_normal((3, 32, 8)), jnp.float8_e4m3fn)
        got = jax_sm100.ragged_dot(lhs, rhs, sizes)
        self.assertEqual(got.dtype, jnp.bfloat16)
        want = jax_sm100.ragged_dot(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), sizes)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        jaxpr = str(jax.make_jaxpr(
            lambda a, b: jax_sm100.ragged_dot(
                a, b, sizes, precision=jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32)
        )(lhs, rhs))  # fmt: skip
        self.assertNotIn("ragged_dot_general", jaxpr)
        self.assertIn("jax_sm100_ragged_dot", jaxpr)
        # The primitive takes both as bfloat16, so the 16-bit grouped kernel runs them.
        self.assertRegex(jaxpr, r"bf16\[16,32\] = convert_element_type\[new_dtype=bfloat16")
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            with jax_sm100.lowerings() as seen:
                _export(jax.jit(lambda a, b: jax_sm100.ragged_dot(a, b, sizes)), lhs, rhs)
        self.assertEqual([(x.plan.a_dtype, x.plan.b_dtype) for x in seen if x.plan],
                         [("bfloat16", "bfloat16")], seen)  # fmt: skip

    def test_any_f8_preset_of_two_fp8_formats_stays_on_the_kernels(self):
        # e5m2 x e4m3 at ANY_F8_ANY_F8_F32: the preset names the operands as given, so the pair
        # (widened to bfloat16) stays on the primitive's kernel path, not lax.ragged_dot's. (The
        # lax path binds the primitive too, so "jax_sm100_ragged_dot" in the jaxpr is no proof.)
        sizes = jnp.array([5, 0, 9], jnp.int32)
        rng = np.random.default_rng(29)
        lhs = jnp.asarray(rng.standard_normal((16, 32)), jnp.float8_e5m2)
        rhs = jnp.asarray(rng.standard_normal((3, 32, 8)), jnp.float8_e4m3fn)
        f = lambda a, b: jax_sm100.ragged_dot(  # noqa: E731
            a, b, sizes, precision=lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32
        )
        with jax_sm100.lowerings() as seen:
            jaxpr = str(jax.make_jaxpr(f)(lhs, rhs))
        self.assertEqual(seen, [])
        self.assertIn("precision=None", jaxpr)

    def test_fp8_at_highest_runs_on_lax(self):
        # One fp8 format: the fp8 grouped kernel accumulates in the tensor core's fp8
        # accumulator, so HIGHEST (float32 accumulation) runs on XLA's ragged dot; two formats
        # are widened to bfloat16 first and stay on the kernels (the product is exact).
        sizes = jnp.array([5, 0, 9], jnp.int32)
        rng = np.random.default_rng(31)
        lhs = jnp.asarray(rng.standard_normal((16, 32)), jnp.float8_e4m3fn)
        rhs = jnp.asarray(rng.standard_normal((3, 32, 8)), jnp.float8_e4m3fn)
        for b, lax_path in ((rhs, True), (rhs.astype(jnp.float8_e5m2), False)):
            with jax_sm100.lowerings() as seen:
                jax.make_jaxpr(lambda x, y: jax_sm100.ragged_dot(
                    x, y, sizes, precision=lax.Precision.HIGHEST))(lhs, b)  # fmt: skip
            notes = " ".join(x.note for x in seen)
            self.assertEqual("asks for float32 accumulation" in notes, lax_path, notes)

    @parameterized.parameters(False, True)
    def test_fp8_beside_float16_runs_on_the_float16_kernel(self, fp8_rhs):
        # An fp8 operand beside a float16 one is widened to float16 (not bfloat16, which
        # would leave a mixed pair for XLA's ragged dot): one float16 grouped kernel on sm_90a.
        sizes = jax.ShapeDtypeStruct((3,), jnp.int32)
        f16, f8 = jnp.float16, jnp.float8_e4m3fn
        lhs = jax.ShapeDtypeStruct((16, 32), f16 if fp8_rhs else f8)
        rhs = jax.ShapeDtypeStruct((3, 32, 8), f8 if fp8_rhs else f16)
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            with jax_sm100.lowerings() as seen:
                _export(jax.jit(jax_sm100.ragged_dot), lhs, rhs, sizes)
        self.assertEqual([x.plan and (x.plan.a_dtype, x.plan.b_dtype) for x in seen],
                         [("float16", "float16")], seen)  # fmt: skip

    def test_group_sizes_clamp_in_their_own_dtype(self):
        # Sizes past int32 saturate at m instead of wrapping; negative sizes are empty groups
        # (lax.ragged_dot's own CPU path would overlap the groups there).
        rng = np.random.default_rng(22)
        lhs = jnp.asarray(rng.standard_normal((12, 8)), jnp.float32)
        rhs = jnp.asarray(rng.standard_normal((3, 8, 5)), jnp.float32)
        want = lax.ragged_dot(lhs, rhs, jnp.array([3, 9, 0], jnp.int32))
        with jax.enable_x64(True):
            big = jnp.array([3, 2**32 + 11, 7], jnp.int64)
            np.testing.assert_array_equal(jax_sm100.ragged_dot(lhs, rhs, big), want)
        unsigned = jnp.array([3, 2**31 + 5, 1], jnp.uint32)
        np.testing.assert_array_equal(jax_sm100.ragged_dot(lhs, rhs, unsigned), want)
        negative = jnp.array([6, -2, 5], jnp.int32)
        bias = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
        got = jax_sm100.ragged_dot(lhs, rhs, negative, bias=bias)
        clamped = jnp.array([6, 0, 5], jnp.int32)
        ref = lax.ragged_dot(lhs, rhs, clamped) + jnp.concatenate(
            [jnp.repeat(bias[0:1], 6, 0), jnp.repeat(bias[2:3], 5, 0), jnp.zeros((1, 5))]
        )  # fmt: skip
        tu.assert_close(self, got, ref, "float32", 8)

    def test_int32_sizes_whose_running_sum_overflows(self):
        # int32 sizes each within int32 but whose running sum is not: the groups end at m as
        # the kernels read them ([3, 5, 0] of 8 rows) on XLA's path too, forward, bias rows
        # and both gradients, and on the lax.ragged_dot fallback (integer operands). XLA's
        # ragged dot lost the rows past the wrapped sum before.
        rng = np.random.default_rng(23)
        lhs = jnp.asarray(rng.standard_normal((8, 6)), jnp.float32)
        rhs = jnp.asarray(rng.standard_normal((3, 6, 4)), jnp.float32)
        bias = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
        sizes = jnp.array([3, 2**31 - 1, 4], jnp.int32)
        clamped = jnp.array([3, 5, 0], jnp.int32)

        def reference(a, b, s, c):
            rows = jnp.repeat(c, np.asarray(s), axis=0, total_repeat_length=a.shape[0])
            return lax.ragged_dot(a, b, s, precision=lax.Precision.HIGHEST) + rows

        def value_and_grads(f, s):
            loss = lambda a, b, c: jnp.sin(f(a, b, s, c)).sum()  # noqa: E731
            return f(lhs, rhs, s, bias), jax.grad(loss, (0, 1, 2))(lhs, rhs, bias)

        ours = lambda a, b, s, c: jax_sm100.ragged_dot(a, b, s, bias=c)  # noqa: E731
        got = jax.jit(value_and_grads, static_argnums=0)(ours, sizes)
        want = value_and_grads(reference, clamped)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            tu.assert_close(self, x, y, "float32", 8)
        ints = jnp.asarray(rng.integers(-4, 5, (8, 6)), jnp.int32)
        w = jnp.asarray(rng.integers(-4, 5, (3, 6, 4)), jnp.int32)
        np.testing.assert_array_equal(
            jax_sm100.ragged_dot(ints, w, sizes), lax.ragged_dot(ints, w, clamped)
        )

    @parameterized.parameters(2**30 - 1, 2**30 + 3, 2**31 - 1)
    def test_group_ends_of_row_counts_near_int32(self, m):
        # The running sum saturating at m for an m past 2^30, where two partial sums of up to m
        # each overflow int32 (the scan added them before clamping, and wrapped negative): the
        # ends and the sizes XLA's path takes (`_lax_sizes`, its saturated branch: g m past
        # int32) against an int64 reference.
        rng = np.random.default_rng(m % 97)
        edge = [m // 2 + 7, m // 2 + 9, -3, 5, 2**31 - 1]
        sizes = np.concatenate([edge, rng.integers(-(2**31), 2**31 - 1, 27)]).astype(np.int32)
        for s in (sizes, sizes[::-1], np.sort(sizes)):
            want = np.minimum(np.cumsum(np.clip(s.astype(np.int64), 0, m)), m)
            ends = ragged_sharding.group_ends(jnp.asarray(s), m)
            np.testing.assert_array_equal(np.asarray(ends, np.int64), want)
            np.testing.assert_array_equal(
                np.asarray(ragged._lax_sizes(jnp.asarray(s), m), np.int64),
                np.diff(want, prepend=0),
            )  # fmt: skip

    @parameterized.parameters("cpu", "cuda")
    def test_rows_past_int32_run_on_xla(self, platform):
        # m = 2^31 rows: the planner sends them to XLA's ragged dot, whose sizes end at the
        # last int32 row (clamping to m itself overflowed int32 and raised OverflowError).
        m = 2**31
        sizes = np.array([2**31 - 1, 2**31 - 1, -4, 7], np.int32)
        want = np.minimum(np.cumsum(np.clip(sizes.astype(np.int64), 0, m)), 2**31 - 1)
        ends = ragged_sharding.group_ends(jnp.asarray(sizes), m)
        np.testing.assert_array_equal(np.asarray(ends, np.int64), want)
        args = (jax.ShapeDtypeStruct((m, 16), jnp.bfloat16),
                jax.ShapeDtypeStruct((4, 16, 16), jnp.bfloat16),
                jax.ShapeDtypeStruct((4,), jnp.int32))  # fmt: skip

        def loss(lhs, rhs, gs):
            return jax_sm100.ragged_dot(lhs, rhs, gs).astype(jnp.float32).sum()

        env = {"JAX_SM100_TARGET_ARCH": "sm_90a"} if platform == "cuda" else {}
        with mock.patch.dict(os.environ, env):
            for f in (jax_sm100.ragged_dot, jax.grad(loss, argnums=(0, 1))):
                exp = jax.export.export(jax.jit(f), platforms=[platform])(*args)
                self.assertNotIn("custom_call @jax_sm100", exp.mlir_module())
            sizes32 = args[2].update(dtype=jnp.uint32)
            jax.export.export(jax.jit(jax_sm100.ragged_dot), platforms=[platform])(
                *args[:2], sizes32
            )
        # Sizes wider than int32 saturate at the last int32 row, not at m (which wrapped).
        wide = ragged._int32_sizes(jnp.asarray([2**31 + 7, 3], jnp.uint32), m)
        np.testing.assert_array_equal(wide, [2**31 - 1, 3])
        with jax.enable_x64(True):
            wide = ragged._int32_sizes(jnp.asarray([2**31, 3], jnp.int64), m)
            np.testing.assert_array_equal(wide, [2**31 - 1, 3])
            ends = ragged_sharding.group_ends(wide, m)
            np.testing.assert_array_equal(ends, [2**31 - 1, 2**31 - 1])

    def test_export_with_a_symbolic_group_count(self):
        # jax.export with g symbolic: XLA's ragged dot takes a static group count only, and
        # ours says so with lax's own error (an undecidable comparison of g m with int32
        # raised before it could).
        (m, g) = jax.export.symbolic_shape("m, g")
        args = (jax.ShapeDtypeStruct((m, 6), jnp.float32),
                jax.ShapeDtypeStruct((g, 6, 4), jnp.float32),
                jax.ShapeDtypeStruct((g,), jnp.int32))  # fmt: skip
        for f in (jax_sm100.ragged_dot, lax.ragged_dot):
            with self.assertRaisesRegex(TypeError, "group count .* to be static"):
                jax.export.export(jax.jit(f), platforms=["cpu"])(*args)

    @parameterized.parameters((0, 8, 5), (6, 0, 5), (6, 8, 0))
    def test_vmap_of_empty_extents(self, m, k, n):
        # vmap (and its gradient) with no rows, no contraction or no columns: zeros of the
        # right shapes (merging the batch into the rows divided by zero before).
        lhs, rhs = jnp.ones((2, m, k), jnp.float32), jnp.ones((2, 3, k, n), jnp.float32)
        sizes = jnp.array([[m, 0, 0], [0, m, 0]], jnp.int32)
        out = jax.vmap(jax_sm100.ragged_dot)(lhs, rhs, sizes)
        self.assertEqual(out.shape, (2, m, n))
        self.assertEqual(float(jnp.sum(jnp.abs(out))), 0.0 if 0 in (m, n) else 2.0 * m * k * n)
        loss = lambda a, b: jax.vmap(jax_sm100.ragged_dot)(a, b, sizes).sum()  # noqa: E731
        da, db = jax.grad(loss, (0, 1))(lhs, rhs)
        self.assertEqual((da.shape, db.shape), (lhs.shape, rhs.shape))
        if 0 in (m, n):
            self.assertEqual(float(jnp.sum(jnp.abs(da)) + jnp.sum(jnp.abs(db))), 0.0)

    def test_export_of_the_biased_gradient_with_symbolic_rows(self):
        # jax.export with a symbolic m: the bias tangent cannot compare m with its one-hot
        # limit, so it takes the gather (the comparison raised before); the exported
        # gradient equals the concrete one.
        (m,) = jax.export.symbolic_shape("m")
        lhs = jax.ShapeDtypeStruct((m, 6), jnp.float32)
        rhs = jax.ShapeDtypeStruct((3, 6, 4), jnp.float32)
        bias = jax.ShapeDtypeStruct((3, 4), jnp.float32)
        sizes = jax.ShapeDtypeStruct((3,), jnp.int32)

        def grad(a, b, s, c):
            loss = lambda a, b, c: jnp.sin(jax_sm100.ragged_dot(a, b, s, bias=c)).sum()  # noqa: E731
            return jax.grad(loss, (0, 1, 2))(a, b, c)

        exported = jax.export.export(jax.jit(grad), platforms=["cpu"])(lhs, rhs, sizes, bias)
        rng = np.random.default_rng(24)
        args = (jnp.asarray(rng.standard_normal((11, 6)), jnp.float32),
                jnp.asarray(rng.standard_normal((3, 6, 4)), jnp.float32),
                jnp.array([4, 0, 5], jnp.int32),
                jnp.asarray(rng.standard_normal((3, 4)), jnp.float32))  # fmt: skip
        for x, y in zip(exported.call(*args), jax.jit(grad)(*args), strict=True):
            tu.assert_close(self, x, y, "float32", 6)

    @parameterized.parameters("sm_90a", "sm_100a")
    def test_cuda_export_with_symbolic_rows(self, arch):
        # jax.export for CUDA with m symbolic: the kernels are planned for static shapes, so
        # every product (the forward and both gradient products, 16-bit and float32) runs on
        # XLA's ragged dot and says so, as matmul runs on XLA's dot (PlanError escaped before).
        (m,) = jax.export.symbolic_shape("m")
        for dtype in (jnp.bfloat16, jnp.float32):
            lhs = jax.ShapeDtypeStruct((m, 512), dtype)
            rhs = jax.ShapeDtypeStruct((8, 512, 256), dtype)
            sizes = jax.ShapeDtypeStruct((8,), jnp.int32)

            def step(a, b, s):
                loss = lambda a, b: jax_sm100.ragged_dot(a, b, s).astype(jnp.float32).sum()  # noqa: E731
                return jax.value_and_grad(loss, (0, 1))(a, b)

            with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}):
                with jax_sm100.lowerings() as seen:
                    text = _export(jax.jit(step), lhs, rhs, sizes).mlir_module()
            self.assertNotIn("custom_call @jax_sm100_gemm", text)
            self.assertLen(seen, 3)
            for low in seen:
                self.assertIsNone(low.plan)
                self.assertIn("symbolic dims", low.note)

    def test_bias_gradient_under_rank_promotion_raise(self):
        # jax_numpy_rank_promotion="raise" (a user's strict setting) holds for the library's
        # own arithmetic: the bias gradient's one-hot product compared ranks 2 and 1 before.
        m, k, n, g = 40, 8, 6, 3
        rng = np.random.default_rng(31)
        lhs, rhs = tu.rand(rng, (m, k), "float32"), tu.rand(rng, (g, k, n), "float32")
        bias = tu.rand(rng, (g, n), "float32")
        sizes = jnp.asarray([13, 0, 20], jnp.int32)

        def grads(a, c, s):
            loss = lambda c: jnp.sum(jnp.sin(jax_sm100.ragged_dot(a, rhs, s, bias=c)))  # noqa: E731
            return jax.grad(loss)(c)

        want = grads(lhs, bias, sizes)
        batched = jax.vmap(grads, (0, None, 0))(lhs[None], bias, sizes[None])
        with jax.numpy_rank_promotion("raise"):
            tu.assert_close(self, jax.jit(grads)(lhs, bias, sizes), want, "float32", 6)
            got = jax.jit(jax.vmap(grads, (0, None, 0)))(lhs[None], bias, sizes[None])
            tu.assert_close(self, got, batched, "float32", 6)

    def test_out_sharding_as_lax(self):
        lhs, rhs = jnp.ones((8, 4), jnp.float32), jnp.ones((2, 4, 3), jnp.float32)
        sizes = jnp.array([3, 5], jnp.int32)
        mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
        with jax.set_mesh(mesh):
            spec = jax.sharding.PartitionSpec("x", None)
            out = jax.jit(lambda a, b, s: jax_sm100.ragged_dot(a, b, s, out_sharding=spec))(
                lhs, rhs, sizes
            )  # fmt: skip
            self.assertEqual(out.sharding.spec, spec)
        np.testing.assert_array_equal(out, lax.ragged_dot(lhs, rhs, sizes))

    @parameterized.parameters(0, 1, 2)
    def test_random_gradients_against_lax(self, seed):
        # Values and both gradients against lax.ragged_dot's own on random sizes: empty groups,
        # sums below m, boundaries at no particular multiple.
        rng = np.random.default_rng(100 + seed)
        g, m, k, n = 5, int(rng.integers(20, 60)), int(rng.integers(3, 40)), int(rng.integers(1, 9))
        sizes = rng.multinomial(int(rng.integers(0, m + 1)), rng.dirichlet(np.full(g, 0.5)))
        sizes[rng.integers(0, g)] = 0
        sizes = jnp.asarray(sizes, jnp.int32)
        lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        rhs = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)
        ct = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

        def vjp(f):
            out, back = jax.vjp(lambda a, b: f(a, b, sizes), lhs, rhs)
            return (out, *back(ct))

        ours = jax.jit(lambda: vjp(jax_sm100.ragged_dot))()
        want = vjp(functools.partial(lax.ragged_dot, precision=lax.Precision.HIGHEST))
        for got, ref in zip(ours, want, strict=True):
            tu.assert_close(self, got, ref, "float32", max(k, m))

    @parameterized.named_parameters(
        # (operand dtype, precision, preferred_element_type): each runs on lax.ragged_dot
        ("f32_highest", "float32", lax.Precision.HIGHEST, None),
        ("f32_highest_to_bf16", "float32", lax.Precision.HIGHEST, jnp.bfloat16),
        ("bf16_f32_preset", "bfloat16", "F32_F32_F32", None),
    )
    def test_precision_fallback_keeps_bias_and_activation(self, dtype, precision, preferred):
        # A precision the kernels do not compute runs on lax.ragged_dot; a bias and an
        # activation still apply, to the float32 product, rounded once. The last column of lhs
        # is ones and each expert's last row 256, cancelled by the bias -256: a product rounded
        # to the result dtype before the bias (ulp 2 at 256 in bfloat16) would show.
        rng = np.random.default_rng(31)
        m, k, n, g = 40, 16, 12, 3
        lhs = np.concatenate([rng.standard_normal((m, k)), np.ones((m, 1))], axis=1)
        rhs = np.concatenate([rng.standard_normal((g, k, n)), np.full((g, 1, n), 256.0)], 1)
        lhs, rhs = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
        bias = jnp.asarray(rng.standard_normal((g, n)) - 256.0, jnp.float32)
        sizes = jnp.asarray([13, 0, 20], jnp.int32)  # 7 rows in no group
        out_dtype = jnp.dtype(preferred or dtype)
        member = np.zeros((m, g))
        member[np.arange(33), np.repeat(np.arange(g), np.asarray(sizes))] = 1
        z = _reference(lhs, rhs, sizes) + member @ np.asarray(bias, np.float64)
        for activation in (None, "silu"):
            with jax_sm100.lowerings() as seen:
                out = jax_sm100.ragged_dot(lhs, rhs, sizes, precision=precision,
                                           preferred_element_type=preferred, bias=bias,
                                           activation=activation)  # fmt: skip
            self.assertIn("lax.ragged_dot", seen[-1].note)
            self.assertEqual(out.dtype, out_dtype)
            want = tu.activation64(z, activation)
            tu.assert_close(self, out, want, out_dtype, k)
            self.assertEqual(float(jnp.max(jnp.abs(out[33:].astype(jnp.float32)))), 0.0)

    def test_bias_of_the_wrong_width_is_refused(self):
        # A bias [g, 1] or [g, n + 1] is refused by name, on the kernels' path and on the
        # lax.ragged_dot fallback (which would broadcast a [g, 1] bias across the columns).
        lhs, rhs = jnp.ones((8, 4)), jnp.ones((2, 4, 3))
        sizes = jnp.asarray([4, 4], jnp.int32)
        for shape in ((2, 1), (2, 4), (1, 3)):
            for precision in (None, lax.Precision.HIGHEST):
                with self.subTest(shape=shape, precision=precision):
                    with self.assertRaisesRegex(
                        ValueError, rf"bias.shape={re.escape(str(shape))}, expected \(g, n\)"
                    ):
                        jax_sm100.ragged_dot(lhs, rhs, sizes, bias=jnp.ones(shape),
                                             precision=precision)  # fmt: skip

    @parameterized.parameters("float8_e4m3fn", "float8_e5m2")
    def test_fp8_gradients_keep_the_operand_dtype(self, dtype):
        # Two operands of one fp8 format reach the primitive as they are; their gradients
        # (computed in bfloat16, autodiff.cotangent_product_dtype) come back in that format.
        rng = np.random.default_rng(37)
        sizes = jnp.array([5, 0, 9], jnp.int32)  # two rows in no group
        lhs, rhs = tu.rand(rng, (16, 32), dtype), tu.rand(rng, (3, 32, 8), dtype)
        ct = tu.rand(rng, (16, 8), "bfloat16")
        out, vjp = jax.vjp(lambda a, b: jax_sm100.ragged_dot(a, b, sizes), lhs, rhs)
        self.assertEqual(out.dtype, jnp.bfloat16)
        d_lhs, d_rhs = vjp(ct)
        self.assertEqual((d_lhs.dtype, d_rhs.dtype), (jnp.dtype(dtype), jnp.dtype(dtype)))
        a, b, c = (np.asarray(x, np.float64) for x in (lhs, rhs, ct))
        want_lhs, want_rhs = np.zeros_like(a), np.zeros_like(b)
        start = 0
        for i, size in enumerate(np.asarray(sizes)):
            rows = slice(start, start + size)
            want_lhs[rows] = c[rows] @ b[i].T
            want_rhs[i] = a[rows].T @ c[rows]
            start += size
        tu.assert_close(self, d_lhs, want_lhs, dtype, 8)
        tu.assert_close(self, d_rhs, want_rhs, dtype, 9)

    def test_lax_sizes_at_the_int32_bound(self):
        # g m = 2^31 exactly: sizes clipped to [0, m] could sum to 2^31, past int32, so XLA's
        # path takes the saturated sizes there (the clip alone only while g m < 2^31).
        m = 2**30
        for sizes, want in (([m, m], [m, 0]), ([m - 1, 5], [m - 1, 1])):
            got = ragged._lax_sizes(jnp.asarray(sizes, jnp.int32), m)
            np.testing.assert_array_equal(np.asarray(got, np.int64), want)
        got = ragged._lax_sizes(jnp.asarray([m - 1, m - 1], jnp.int32), m - 1)  # g m < 2^31
        np.testing.assert_array_equal(np.asarray(got, np.int64), [m - 1, m - 1])

    @parameterized.parameters("sm_90a", "sm_100a")
    def test_weight_gradient_of_the_input_gradient_exports(self, arch):
        # Reverse over reverse (a gradient penalty on d lhs, differentiated in the experts):
        # ragged_outer with transpose_out, whose operands swap roles in the CUDA lowering. Every
        # product is a grouped kernel; the exported module verifies.
        lhs = jax.ShapeDtypeStruct((1000, 64), jnp.bfloat16)
        rhs = jax.ShapeDtypeStruct((8, 64, 48), jnp.bfloat16)
        sizes = jax.ShapeDtypeStruct((8,), jnp.int32)

        def f(a, b, s):
            sq = lambda y: jnp.sum(y.astype(jnp.float32) ** 2)  # noqa: E731
            loss = lambda a, b: sq(jax_sm100.ragged_dot(a, b, s))  # noqa: E731
            penalty = lambda a, b: sq(jax.grad(loss)(a, b))  # noqa: E731
            return jax.grad(penalty, 1)(a, b)

        self.assertIn("transpose_out=True", str(jax.make_jaxpr(f)(
            *(jnp.zeros(x.shape, x.dtype) for x in (lhs, rhs, sizes)))))  # fmt: skip
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}):
            with jax_sm100.lowerings() as seen:
                text = _export(jax.jit(f), lhs, rhs, sizes).mlir_module()
        self.assertFalse(re.search(r"(chlo|stablehlo|mhlo)\.ragged_dot", text))
        self.assertEqual(sorted(x.plan.ragged for x in seen if x.plan), ["k", "k", "m", "m"])

    @parameterized.product(transpose=(False, True), merge=(False, True))
    def test_cuda_batched_paths_with_xla_in_the_kernels_place(self, transpose, merge):
        # ragged_gpu._folded end to end, as the CUDA lowering runs batched operands (the fold
        # or, for shared experts, the merge; the unfold or the rows put back in place; the
        # summed segments of the weight gradient), with no target arch so that XLA's product
        # stands in for the grouped kernel: equal to XLA's math of the batched operands.
        from jax_sm100._src import ragged_gpu  # noqa: PLC0415

        sizes, lhs, rhs, bias, ct = _batched_case(43, transpose)
        w, c = rhs[0, 0], bias[0, 0]  # experts (and bias) shared by every batch
        dot = dict(transpose_rhs=transpose, out_dtype=np.dtype(np.float32), activation="gelu")
        outer = dict(out_dtype=np.dtype(np.float32), transpose_out=transpose)
        cases = [
            ("dot, batched experts", lhs, rhs, sizes, (bias,), dot),
            ("dot, shared experts", lhs, w, sizes, (c,), dot),
            *((f"outer, {s} summed", lhs, ct, sizes, (), dict(outer, summed=s)) for s in range(3)),
        ]
        # bfloat16 whose two batches' weight gradients nearly cancel: summed in float32 and
        # rounded once (a sum of rounded segments is off by their rounding, ~ulp(|segment|)).
        rng = np.random.default_rng(44)
        a = jnp.asarray(np.broadcast_to(rng.standard_normal((13, 8)), (2, 13, 8)), jnp.bfloat16)
        c0 = rng.standard_normal((13, 5))
        d = jnp.asarray(np.stack([c0, -c0 + 0.01 * rng.standard_normal((13, 5))]), jnp.bfloat16)
        same = jnp.asarray([[3, 4, 0, 5]] * 2, jnp.int32)
        bf16 = dict(out_dtype=np.dtype(jnp.bfloat16), transpose_out=transpose, summed=1)
        cases.append(("outer, bfloat16 cancelling", a, d, same, (), bf16))
        env = {key: v for key, v in os.environ.items() if key != "JAX_SM100_TARGET_ARCH"}
        limit = 1 << 20 if merge else 0
        for what, x, y, s, b, params in cases:
            name = "ragged_dot" if what.startswith("dot") else "ragged_outer"
            fn = ragged._ragged_dot_xla if name == "ragged_dot" else ragged._ragged_outer_xla
            want = fn(x.astype(jnp.float32), y.astype(jnp.float32), s, *b,
                      **dict(params, out_dtype=np.dtype(np.float32)))  # fmt: skip
            with (
                self.subTest(what),
                mock.patch.dict(os.environ, env, clear=True),
                mock.patch.dict(ragged_gpu.MERGE_BELOW_ROWS, forward=limit, differentiated=limit),
                jax_sm100.lowerings() as seen,
            ):
                got = ragged_gpu._folded(name, fn, x, y, s, b, params, "", True)
                self.assertEqual(got.dtype, params["out_dtype"])
                shared = y.ndim == 3 if name == "ragged_dot" else params["summed"] == x.ndim - 2
                how = "rows merged by expert" if merge and shared else "folded into one"
                self.assertIn(how, seen[-1].note)
                tu.assert_close(self, got, want, params["out_dtype"], 6 * 13)

    @parameterized.parameters("sm_90a", "sm_100a")
    def test_kernel_calls_describe_the_product(self, arch):
        # What the CUDA lowering hands each grouped kernel (modes and strides of every tensor,
        # which buffer is which, KernelSpec's b_groups and k_segments) checked on this machine:
        # each call captured at export is replayed by a NumPy model of the kernels' mode
        # contract (kernels/spec.py) over random buffers, and compared with the primitive's
        # math on the same buffers. A training step with a bias (forward, d lhs against the
        # experts transposed, d rhs), the fused bias and activation, shared experts folded (read
        # in place; their gradient summed in the kernel) and merged, fp8 experts (transposed
        # for sm_90a), and the weight gradient of an input gradient (transpose_out).
        from jax_sm100._src import gpu_lowering, ragged_gpu  # noqa: PLC0415

        problems, calls = [], []
        real_problem, real_ffi = ragged_gpu._kernel_problem, gpu_lowering._ffi

        def spy_problem(name, lhs, rhs, group_sizes, params, segments=1):
            problems.append((name, lhs, rhs, group_sizes.shape, dict(params)))
            return real_problem(name, lhs, rhs, group_sizes, params, segments)

        def spy_ffi(compiled, out_type, operands, layouts, order, aliases=None, ties=()):
            out = out_type[0] if isinstance(out_type, tuple) else out_type
            calls.append((*problems[-1], compiled.spec, layouts, order, operands, out.shape))
            return real_ffi(compiled, out_type, operands, layouts, order, aliases, ties)

        bf = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
        sq = lambda y: jnp.sum(y.astype(jnp.float32) ** 2)  # noqa: E731

        def step(a, b, c, s):
            def loss(a, b, c):
                return sq(jax_sm100.ragged_dot(a, b, s, bias=c, activation="gelu"))

            return jax.grad(loss, (0, 1, 2))(a, b, c)

        def shared(a, b, s):
            return jax.grad(lambda a, b: sq(jax.vmap(jax_sm100.ragged_dot, (0, None, 0))(a, b, s)),
                            (0, 1))(a, b)  # fmt: skip

        def fp8(a, b, s):
            return jax_sm100.ragged_dot(a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn), s)

        def second(a, b, s):
            loss = lambda a, b: sq(jax_sm100.ragged_dot(a, b, s))  # noqa: E731
            return jax.grad(lambda a, b: sq(jax.grad(loss)(a, b)), 1)(a, b)

        exports = [
            (step, (bf(1000, 64), bf(8, 64, 48), f32(8, 48), i32(8)), 0),
            (lambda a, b, c, s: jax_sm100.ragged_dot(a, b, s, bias=c, activation="silu"),
             (bf(1000, 64), bf(8, 64, 48), f32(8, 48), i32(8)), 0),
            (shared, (bf(4, 512, 256), bf(8, 256, 384), i32(4, 8)), 0),
            (shared, (bf(4, 512, 256), bf(8, 256, 384), i32(4, 8)), 1 << 20),
            (fp8, (bf(1000, 64), bf(8, 64, 48), i32(8)), 0),
            (second, (bf(1000, 64), bf(8, 64, 48), i32(8)), 0),
        ]  # fmt: skip
        for f, args, merge in exports:
            with (
                mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}),
                mock.patch.dict(ragged_gpu.MERGE_BELOW_ROWS, forward=merge, differentiated=merge),
                mock.patch.object(ragged_gpu, "_kernel_problem", spy_problem),
                mock.patch.object(gpu_lowering, "_ffi", spy_ffi),
            ):
                _export(jax.jit(lambda *x, f=f: f(*x)), *args)  # a fresh trace for each
        kinds = {(c[0], c[5].b_groups > 0, c[5].k_segments > 1, bool(c[4].get("transpose_rhs")
                  or c[4].get("transpose_out"))) for c in calls}  # fmt: skip
        self.assertLen(calls, 15)
        self.assertContainsSubset({("ragged_dot", True, False, False),
                                   ("ragged_outer", False, True, False),
                                   ("ragged_dot", False, False, True),
                                   ("ragged_outer", False, False, True)}, kinds)  # fmt: skip
        rng = np.random.default_rng(47)
        for name, lhs, rhs, g_shape, params, spec, layouts, order, operands, out_shape in calls:
            # Random buffers for the call's inputs: sizes past the rows, negative, empty.
            rows, (g,) = lhs.shape[0], g_shape
            bufs, sizes, bias = [], None, None
            for x in operands:
                if x.dtype != jnp.int32:
                    bufs.append(rng.standard_normal(x.shape))
                    if x is not lhs and x is not rhs:
                        bias = bufs[-1]
                elif x.shape == g_shape and sizes is None:
                    sizes = rng.integers(-2, 2 * rows // g + 2, x.shape)
                    bufs.append(sizes)
                else:
                    bufs.append(np.zeros(x.shape, np.int64))  # the dynamic tiles' counter
            by_id = {id(x): buf for x, buf in zip(operands, bufs, strict=True)}
            ends = np.minimum(np.cumsum(np.clip(sizes, 0, rows)), rows)
            starts = np.concatenate([[0], ends[:-1]])
            views = {}
            for t, which in zip(layouts, order, strict=True):
                if which >= 0:
                    flat = np.ascontiguousarray(bufs[which]).reshape(-1)
                    strides = [s * flat.itemsize for s in t.strides]
                    views[t.name] = np.lib.stride_tricks.as_strided(flat, t.shape, strides)
                else:
                    d_layout = t
            # The kernel's contract in its modes: ragged rows ("m": D (M, N) row r of group j
            # = A (M, K) row r . B (N, K, E)[:, :, j or j mod b_groups] + bias (N, G)[:, j],
            # then the activation) or ragged contraction ("k": D (M, N, G / S)[:, :, j mod
            # G / S] += A (M, R)[:, rows of j] . B (N, R)[:, rows of j]).
            a, b = views["a"], views["b"]
            if name == "ragged_dot":
                model = np.zeros((a.shape[0], b.shape[0]))
                for j in range(g):
                    e = j % spec.b_groups if spec.b_groups else j
                    r = slice(starts[j], ends[j])
                    model[r] = a[r] @ b[:, :, e].T
                    if "bias" in views:
                        model[r] += views["bias"][:, j]
                model = tu.activation64(model, spec.activation)
            else:
                model = np.zeros((a.shape[0], b.shape[0], g // spec.k_segments))
                for j in range(g):
                    r = slice(starts[j], ends[j])
                    model[:, :, j % (g // spec.k_segments)] += a[:, r] @ b[:, r].T
            out = np.zeros(out_shape).reshape(-1)
            np.lib.stride_tricks.as_strided(
                out, d_layout.shape, [s * out.itemsize for s in d_layout.strides]
            )[...] = model.reshape(d_layout.shape)  # fmt: skip
            # The primitive's math on the same buffers.
            x, y = by_id[id(lhs)], by_id[id(rhs)]
            if name == "ragged_dot":
                w = np.swapaxes(y, -1, -2) if params["transpose_rhs"] else y
                want = np.zeros((x.shape[0], w.shape[-1]))
                for j in range(g):
                    r = slice(starts[j], ends[j])
                    want[r] = x[r] @ w[j % w.shape[0]] + (0 if bias is None else bias[j])
                want = tu.activation64(want, params.get("activation"))
            else:
                groups = g // spec.k_segments
                want = np.zeros((groups, x.shape[1], y.shape[1]))
                for j in range(g):
                    r = slice(starts[j], ends[j])
                    want[j % groups] += x[r].T @ y[r]
                if params["transpose_out"]:
                    want = np.swapaxes(want, -1, -2)
            with self.subTest(name=name, params=params, spec=spec):
                np.testing.assert_allclose(out.reshape(out_shape), want, rtol=1e-9, atol=1e-9)


_SHARDED = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp, numpy as np
from jax import lax
from jax.test_util import check_grads
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jax_sm100
rng = np.random.default_rng(0)
lhs = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
rhs = jnp.asarray(rng.normal(size=(8, 16, 8)), jnp.float32)
sizes = jnp.asarray([8, 0, 16, 8, 8, 4, 12, 8], jnp.int32)
mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
ref = lax.ragged_dot(lhs, rhs, sizes, precision=lax.Precision.HIGHEST)
ref_grads = jax.grad(lambda a, b: jnp.sin(lax.ragged_dot(
    a, b, sizes, precision=lax.Precision.HIGHEST)).sum(), (0, 1))(lhs, rhs)
for name, specs in {"rows": (P("d", None), P(), P()),
                    "experts": (P(), P("d", None, None), P("d"))}.items():
    a, b, c = (jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((lhs, rhs, sizes), specs))
    out = jax.jit(jax_sm100.ragged_dot)(a, b, c)
    loss = lambda a, b: jnp.sin(jax_sm100.ragged_dot(a, b, c)).sum()
    grads = jax.jit(jax.grad(loss, (0, 1)))(a, b)
    err = max(float(jnp.abs(out - ref).max()),
              *(float(jnp.abs(g - r).max()) for g, r in zip(grads, ref_grads)))
    print(name, "max error", err)
"""


class ShardedTest(absltest.TestCase):
    def test_sharded_rows_and_experts(self):
        # Tokens sharded over rows, or experts (rhs and group sizes) over an axis, of an Auto
        # mesh of 8 CPU devices: the values and gradients equal the unsharded ones, in a fresh
        # interpreter. The rules and their collectives: tests/test_ragged_sharding.py.
        proc = subprocess.run(
            [sys.executable, "-c", _SHARDED], env=tu.subprocess_env(), capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        errors = re.findall(r"(rows|experts) max error (\S+)", proc.stdout)
        self.assertEqual([e[0] for e in errors], ["rows", "experts"], proc.stdout)
        for _, err in errors:
            self.assertLess(float(err), 1e-4)


class MoeExampleTest(absltest.TestCase):
    def test_trains_like_lax_ragged_dot(self):
        # examples/train_moe.py: the student's loss falls, and its losses equal the same model's
        # on lax.ragged_dot (float32; both run XLA's ragged_dot_general on a CPU).
        def run(*flags):
            proc = subprocess.run(
                [sys.executable, str(tu.REPO_ROOT / "examples" / "train_moe.py"), "--steps", "12",
                 "--tokens", "128", "--d-model", "32", "--d-ff", "64", *flags],
                env=tu.subprocess_env(), capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
            return [float(x) for x in re.findall(r"loss (\d\.\d+)\n", proc.stdout)]

        ours, reference = run(), run("--reference")
        self.assertLess(ours[-1], 0.9 * ours[0])
        np.testing.assert_allclose(ours, reference, rtol=1e-4)

    def test_refuses_a_top_k_it_cannot_route(self):
        for top_k in ("0", "9"):  # 8 experts by default
            proc = subprocess.run(
                [sys.executable, str(tu.REPO_ROOT / "examples" / "train_moe.py"), "--top-k", top_k],
                env=tu.subprocess_env(), capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            self.assertEqual(proc.returncode, 2, proc.stderr[-2000:])
            self.assertIn(f"--top-k {top_k} must be between 1 and --experts 8", proc.stderr)


if __name__ == "__main__":
    absltest.main()
