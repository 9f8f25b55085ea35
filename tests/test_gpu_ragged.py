"""GPU tests of `jax_sm100.ragged_dot` on the grouped kernels (SM90 device); skipped elsewhere.

Every case checks ours against a float32 reference (`lax.ragged_dot` of the operands upcast),
with random normal data and group sizes that put boundaries anywhere (empty groups, groups
smaller than a tile, sizes that sum to less than m), and that the kernel, not XLA, ran.
"""

import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax import lax

import jax_sm100
from jax_sm100._src import dispatch, planning, ragged_gpu
from jax_sm100._src import primitive as P
from jax_sm100._src.planning import gemm_plan
from tests import test_util as tu

GROUPED = "sm90_wgmma_grouped"


def _arch():
    try:
        return getattr(dispatch.device_target(), "arch", None)
    except Exception:
        return None


def _sizes(rng, g, m, fill):
    """Random sizes over g groups summing to about `fill` * m, some empty, boundaries anywhere."""
    w = rng.dirichlet(np.full(g, 0.5))
    sizes = rng.multinomial(int(m * fill), w)
    sizes[rng.random(g) < 0.2] = 0
    return jnp.asarray(sizes.astype(np.int32))


def _rel(x, ref):
    x = np.asarray(x, np.float32)
    ref = np.asarray(ref, np.float32)
    return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)


def _reference(lhs, rhs, gs, transpose_rhs=False):
    r = jnp.swapaxes(rhs, -1, -2) if transpose_rhs else rhs
    return lax.ragged_dot(
        lhs.astype(jnp.float32), r.astype(jnp.float32), gs, precision=lax.Precision.HIGHEST
    )


# The bfloat16 result's rounding (2^-9 relative) dominates the fp8 rows: their products are
# exact in the float32 reference.
_TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float8_e4m3fn": 1e-2, "float8_e5m2": 1e-2}


@absltest.skipIf(_arch() != "sm_90a", "needs an SM90 (Hopper) CUDA device and jax[cuda]")
class GroupedGpuTest(parameterized.TestCase):
    def lower_and_run(self, schedule, fn, *args):
        """`fn(*args)` lowered with the grouped planner restricted to `schedule` ("" for the
        planner's choice), and to a cluster if it names one ("pingpong/2x1": CTA pairs along M,
        B multicast; "/1x1": none); returns (result, the lowerings)."""
        schedule, _, cluster = schedule.partition("/")
        planning._plan_cached.cache_clear()
        try:
            with (
                mock.patch.dict(os.environ, {"JAX_SM100_GROUPED_SCHEDULE": schedule}),
                tu.grouped_cluster(cluster),
                jax_sm100.lowerings() as seen,
            ):
                # A new function each call: jit of the same `fn` (jax_sm100.ragged_dot itself)
                # at the same shapes would reuse the first case's binary and never plan again.
                out = jax.jit(lambda *a: fn(*a))(*args)
        finally:
            planning._plan_cached.cache_clear()
        if schedule or cluster:
            self.assertIn(GROUPED, [x.plan.kernel for x in seen if x.plan is not None])
        for low in seen:
            if low.plan is not None and low.plan.kernel == GROUPED:
                if schedule:
                    self.assertEqual(low.plan.pingpong, schedule == "pingpong")
                if cluster:
                    self.assertEqual("x".join(map(str, low.plan.cluster_shape_mn)), cluster)
        return out, seen

    @parameterized.product(
        shape=[(8, 1024, 256, 512), (5, 777, 136, 264), (16, 4096, 512, 256), (3, 300, 64, 520)],
        fill=[1.0, 0.7],
        transpose_rhs=[False, True],
        schedule=["cooperative/1x1", "cooperative/2x1", "pingpong/1x1", "pingpong/2x1"],
    )
    def test_forward(self, shape, fill, transpose_rhs, schedule):
        self._forward(shape, fill, "bfloat16", transpose_rhs, schedule)

    @parameterized.product(
        shape=[(5, 777, 136, 264), (16, 4096, 512, 600)],
        schedule=["cooperative/1x1", "cooperative/2x1", "pingpong/2x1"],
    )
    def test_forward_m_first(self, shape, schedule):
        # Groups' work tiles along M first, as the planner orders them for a group's B over
        # GROUPED_N_FIRST_MAX_B_BYTES (these small problems get N first otherwise).
        with mock.patch.object(gemm_plan, "GROUPED_N_FIRST_MAX_B_BYTES", -1):
            seen = self._forward(shape, 0.7, "bfloat16", False, schedule)
        self.assertEqual(
            {x.plan.raster_along_m for x in seen if x.plan and x.plan.kernel == GROUPED}, {True}
        )

    @parameterized.parameters((8, 1024, 256, 512), (5, 777, 136, 264))
    def test_forward_float16(self, *shape):
        self._forward(shape, 0.8, "float16", False, "")

    def _forward(self, shape, fill, dtype, transpose_rhs, schedule):
        g, m, k, n = shape
        rng = np.random.default_rng(m + n + k + g)
        ka, kb = jax.random.split(jax.random.key(m * n + g), 2)
        lhs = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
        rshape = (g, n, k) if transpose_rhs else (g, k, n)
        rhs = jax.random.normal(kb, rshape, jnp.float32).astype(dtype)
        gs = _sizes(rng, g, m, fill)
        out, seen = self.lower_and_run(schedule, lambda a, b, s: jax_sm100.ragged_dot(
            a, jnp.swapaxes(b, -1, -2) if transpose_rhs else b, s), lhs, rhs, gs)  # fmt: skip
        ref = _reference(lhs, rhs, gs, transpose_rhs)
        self.assertLess(_rel(out, ref), _TOL[dtype])
        # Rows past the groups are exact zeros.
        total = int(np.sum(np.asarray(gs)))
        self.assertEqual(float(jnp.max(jnp.abs(out[total:].astype(jnp.float32)))), 0.0)
        self.assertIn(GROUPED, [x.plan.kernel for x in seen if x.plan is not None])
        return seen

    @parameterized.product(
        dtype=["float8_e4m3fn", "float8_e5m2"],
        shape=[(8, 1024, 256, 512), (5, 777, 144, 264)],
        transpose_rhs=[False, True],
        schedule=["cooperative/1x1", "cooperative/2x1", "pingpong/2x1"],
    )
    def test_forward_fp8(self, dtype, shape, transpose_rhs, schedule):
        # Both operands of one fp8 format on the fp8 grouped kernel (experts [g, k, n]
        # transposed by XLA first: sm_90a's fp8 wgmma reads them K-major; with transpose_rhs
        # they are stored so, and XLA's two transposes cancel), bfloat16 out, against the
        # float32 product of the same fp8 values.
        seen = self._forward(shape, 0.8, dtype, transpose_rhs, schedule)
        fwd = [x for x in seen if x.plan is not None and x.plan.kernel == GROUPED]
        self.assertEqual([(x.plan.a_dtype, x.plan.b_major) for x in fwd], [(dtype, "k")])
        self.assertIn("experts transposed", fwd[0].note)

    @parameterized.parameters("float8_e4m3fn", "float8_e5m2")
    def test_fp8_gradients_within_one_fp8_step(self, dtype):
        # The vjp of an fp8 product (its backward on the bfloat16 kernel, the fp8 operands
        # widened exactly): each fp8 gradient within one step of the format of the float64
        # gradient (a bfloat16 result rounded to fp8: two roundings), the products all grouped.
        g, m, k, n = 8, 1500, 256, 264
        rng = np.random.default_rng(53)
        ka, kb, kc = jax.random.split(jax.random.key(53), 3)
        lhs = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
        rhs = (jax.random.normal(kb, (g, k, n), jnp.float32) * 0.25).astype(dtype)
        ct = (jax.random.normal(kc, (m, n), jnp.float32) * 0.25).astype(jnp.bfloat16)
        gs = _sizes(rng, g, m, 0.9)

        def vjp(a, b, s, t):
            return jax.vjp(lambda u, v: jax_sm100.ragged_dot(u, v, s), a, b)[1](t)

        (da, db), seen = self.lower_and_run("", vjp, lhs, rhs, gs, ct)
        self.assertEqual((da.dtype, db.dtype), (jnp.dtype(dtype),) * 2)
        f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
        starts = np.concatenate([[0], np.cumsum(np.asarray(gs))])
        want_a = np.zeros((m, k))
        want_b = np.zeros((g, k, n))
        for j in range(g):
            rows = slice(starts[j], starts[j + 1])
            want_a[rows] = f64(ct)[rows] @ f64(rhs)[j].T
            want_b[j] = f64(lhs)[rows].T @ f64(ct)[rows]
        info = jnp.finfo(dtype)
        for got, want in ((da, want_a), (db, want_b)):
            # One step of the format at |want| (its spacing there, at least the smallest
            # subnormal's).
            step = np.maximum(2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30)))
                                      - info.nmant), float(info.smallest_subnormal))  # fmt: skip
            np.testing.assert_array_less(np.abs(f64(got) - want), step * 1.0001)
        ran = sorted(x.note.split(":")[0] for x in seen if x.plan and x.plan.kernel == GROUPED)
        self.assertEqual(ran, ["ragged_dot", "ragged_outer"], [x.note for x in seen])

    def test_two_fp8_formats(self):
        # e4m3 rows beside e5m2 experts: both widened exactly to bfloat16, on the 16-bit kernel.
        g, m, k, n = 8, 1024, 256, 512
        rng = np.random.default_rng(59)
        lhs = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(jnp.float8_e4m3fn)
        rhs = jax.random.normal(jax.random.key(2), (g, k, n), jnp.float32)
        rhs = rhs.astype(jnp.float8_e5m2)
        gs = _sizes(rng, g, m, 0.9)
        out, seen = self.lower_and_run("", jax_sm100.ragged_dot, lhs, rhs, gs)
        self.assertLess(_rel(out, _reference(lhs, rhs, gs)), 1e-2)
        ran = [x.plan.a_dtype for x in seen if x.plan is not None and x.plan.kernel == GROUPED]
        self.assertEqual(ran, ["bfloat16"])

    @parameterized.product(
        shape=[(8, 1024, 256, 512), (6, 999, 200, 136), (32, 2048, 128, 256)],
        fill=[1.0, 0.6],
        schedule=["cooperative/1x1", "cooperative/2x1", "pingpong/1x1", "pingpong/2x1"],
    )
    def test_gradients(self, shape, fill, schedule):
        g, m, k, n = shape
        rng = np.random.default_rng(7 * m + n)
        ka, kb, kc = jax.random.split(jax.random.key(g + m), 3)
        lhs = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
        rhs = jax.random.normal(kb, (g, k, n), jnp.float32).astype(jnp.bfloat16)
        ct = jax.random.normal(kc, (m, n), jnp.float32).astype(jnp.bfloat16)
        gs = _sizes(rng, g, m, fill)

        def vjp(fn):
            return lambda a, b, s, t: jax.vjp(lambda u, v: fn(u, v, s), a, b)[1](t)

        (da, db), seen = self.lower_and_run(schedule, vjp(jax_sm100.ragged_dot), lhs, rhs, gs, ct)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        ra, rb = jax.jit(
            vjp(lambda u, v, s: lax.ragged_dot(u, v, s, precision=lax.Precision.HIGHEST))
        )(f32(lhs), f32(rhs), gs, f32(ct))
        self.assertLess(_rel(da, ra), 1e-2)
        self.assertLess(_rel(db, rb), 1e-2)
        # Empty groups' weight gradients are exact zeros.
        for j in np.flatnonzero(np.asarray(gs) == 0):
            self.assertEqual(float(jnp.max(jnp.abs(f32(db[j])))), 0.0)
        # d lhs (ragged-rows mode) and d rhs (ragged-contraction mode) both on the kernel (the
        # forward's value is unused by the vjp, so jit drops it).
        ran = {x.note.split(":")[0] for x in seen if x.plan and x.plan.kernel == GROUPED}
        self.assertEqual(ran, {"ragged_dot", "ragged_outer"}, [x.note for x in seen])

    @parameterized.parameters(False, True)
    def test_vmap_folds_batches_onto_the_kernel(self, rhs_batched):
        # vmap of the product and of its vjp: the batches fold into one grouped product each
        # (ragged_gpu.fold_rows / fold_outer), against lax.ragged_dot per batch; sizes summing
        # below m, past m, negative and empty.
        b, g, m, k, n = 3, 6, 700, 136, 264
        rng = np.random.default_rng(41)
        ka, kb, kc = jax.random.split(jax.random.key(41), 3)
        lhs = jax.random.normal(ka, (b, m, k), jnp.float32).astype(jnp.bfloat16)
        rhs = jax.random.normal(kb, ((b,) if rhs_batched else ()) + (g, k, n), jnp.float32)
        rhs = rhs.astype(jnp.bfloat16)
        ct = jax.random.normal(kc, (b, m, n), jnp.float32).astype(jnp.bfloat16)
        gs = jnp.stack([_sizes(rng, g, m, 0.7), _sizes(rng, g, m, 1.3),
                        jnp.asarray([-5, 200, 0, 0, 300, 50], jnp.int32)])  # fmt: skip
        axes = (0, 0 if rhs_batched else None, 0, 0)

        def vjp(fn):
            return lambda a, w, s, t: (fn(a, w, s), *jax.vjp(lambda u, v: fn(u, v, s), a, w)[1](t))

        # Shared experts fold here (the batches' rows merged by expert: the next test).
        with mock.patch.dict(ragged_gpu.MERGE_BELOW_ROWS, forward=0, differentiated=0):
            (out, da, db), seen = self.lower_and_run(
                "", jax.vmap(vjp(jax_sm100.ragged_dot), axes), lhs, rhs, gs, ct
            )  # fmt: skip
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        lax_fn = lambda u, v, s: lax.ragged_dot(  # noqa: E731
            u, v, jnp.maximum(s, 0), precision=lax.Precision.HIGHEST
        )
        # lax.ragged_dot has no batching rule for an unbatched rhs: its batch dim made explicit.
        rhs_b = rhs if rhs_batched else jnp.broadcast_to(rhs, (b, *rhs.shape))
        want = jax.jit(jax.vmap(vjp(lax_fn)))(f32(lhs), f32(rhs_b), gs, f32(ct))
        for got, ref in zip((out, da, db), want, strict=True):
            self.assertEqual(got.shape, ref.shape)
            self.assertLess(_rel(got, ref), 1e-2)
        folded = [x for x in seen if x.plan and x.plan.kernel == GROUPED]
        self.assertEqual(len(folded), 3, [x.note for x in seen])
        self.assertTrue(all("vmap: 3 batches folded" in x.note for x in folded))
        # Unbatched experts are read in place by every batch's groups (no copy per batch).
        shared = [x for x in folded if "6 experts shared" in x.note]
        self.assertEqual(len(shared), 0 if rhs_batched else 2, [x.note for x in folded])

    @parameterized.parameters(("", False), ("pingpong/1x1", False), ("cooperative/2x1", False),
                              ("", True), ("cooperative/2x1", True))  # fmt: skip
    def test_shared_experts_gradient_sums_over_batches(self, schedule, merge):
        # grad of vmap with experts shared by the batches, folded: the forward and d lhs read
        # them in place, d rhs is every batch's weight gradient summed in one grouped product
        # (the kernel's k_segments); or merged: every batch's rows of an expert gathered
        # together, unbatched products (ragged_gpu.merge_rows). Against lax.ragged_dot per
        # batch, summed in float32.
        b, g, m, k, n = 4, 5, 600, 200, 136
        rng = np.random.default_rng(43)
        ka, kb, kc = jax.random.split(jax.random.key(43), 3)
        lhs = jax.random.normal(ka, (b, m, k), jnp.float32).astype(jnp.bfloat16)
        rhs = jax.random.normal(kb, (g, k, n), jnp.float32).astype(jnp.bfloat16)
        ct = jax.random.normal(kc, (b, m, n), jnp.float32).astype(jnp.bfloat16)
        gs = jnp.stack([_sizes(rng, g, m, 0.8), _sizes(rng, g, m, 1.0),
                        jnp.asarray([0, 0, 600, 0, 0], jnp.int32),
                        jnp.asarray([-3, 100, 0, 0, 0], jnp.int32)])  # fmt: skip
        gs = gs.at[:, 3].set(0)  # an expert no batch routes to: its gradient is zeros

        def vjp(fn):
            def run(a, w, t):
                f = lambda u, v: jax.vmap(fn, (0, None, 0))(u, v, gs)  # noqa: E731
                out, back = jax.vjp(f, a, w)
                return (out, *back(t))

            return run

        with mock.patch.dict(
            ragged_gpu.MERGE_BELOW_ROWS,
            forward=1 << 20 if merge else 0,
            differentiated=1 << 20 if merge else 0,
        ):
            (out, da, dw), seen = self.lower_and_run(schedule, vjp(jax_sm100.ragged_dot), lhs,
                                                     rhs, ct)  # fmt: skip
        lax_fn = lambda u, v, s: lax.ragged_dot(  # noqa: E731
            u, v, jnp.maximum(s, 0), precision=lax.Precision.HIGHEST
        )
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        # lax.ragged_dot has no batching rule for unbatched experts: one batch at a time.
        want = [jax.jit(lambda u, w, s, c: (lax_fn(u, w, s), *jax.vjp(
            lambda x, y: lax_fn(x, y, s), u, w)[1](c)))(f32(lhs[i]), f32(rhs), gs[i], f32(ct[i]))
            for i in range(b)]  # fmt: skip
        ref_out, ref_da, ref_dw = (jnp.stack(x) for x in zip(*want, strict=True))
        ref_dw = ref_dw.sum(0)
        for got, ref in ((out, ref_out), (da, ref_da), (dw, ref_dw)):
            self.assertEqual(got.shape, ref.shape)
            self.assertLess(_rel(got, ref), 1e-2)
        ran = [x for x in seen if x.plan and x.plan.kernel == GROUPED]
        self.assertEqual(len(ran), 3, [x.note for x in seen])
        how = "4 batches' rows merged by expert" if merge else "4 of them summed"
        self.assertTrue(any(how in x.note for x in ran), [x.note for x in ran])

    @parameterized.parameters("pingpong/1x1", "cooperative/2x1")
    def test_sizes_past_m_are_clamped(self, schedule):
        # Sizes summing past m: rows are assigned in order until m runs out (no out-of-bounds
        # access), as the running sum clamped to m gives them.
        g, m, k, n = 4, 512, 128, 256
        lhs = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16)
        rhs = jax.random.normal(jax.random.key(1), (g, k, n), jnp.float32).astype(jnp.bfloat16)
        gs = jnp.asarray([300, 0, 400, 100], jnp.int32)
        out, _ = self.lower_and_run(schedule, jax_sm100.ragged_dot, lhs, rhs, gs)
        ref = _reference(lhs, rhs, jnp.asarray([300, 0, 212, 0], jnp.int32))
        self.assertLess(_rel(out, ref), 1e-2)

    @parameterized.product(transpose_out=[False, True], cluster=["/1x1", "/2x1"])
    def test_weight_gradient_layouts(self, transpose_out, cluster):
        # The ragged-contraction primitive itself, both output orders ([g, k, n] and, as the
        # transpose of a transposed-rhs product gives it, [g, n, k]: the operands swap roles).
        from jax_sm100._src import ragged  # noqa: PLC0415

        g, m, k, n = 6, 1500, 192, 320
        rng = np.random.default_rng(11)
        lhs = jax.random.normal(jax.random.key(5), (m, k), jnp.float32).astype(jnp.bfloat16)
        ct = jax.random.normal(jax.random.key(6), (m, n), jnp.float32).astype(jnp.bfloat16)
        gs = _sizes(rng, g, m, 0.9)
        fn = lambda a, b, s: ragged.ragged_outer_p.bind(  # noqa: E731
            a, b, s, out_dtype=np.dtype(jnp.bfloat16), transpose_out=transpose_out
        )
        out, seen = self.lower_and_run(cluster, fn, lhs, ct, gs)
        f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
        starts = np.concatenate([[0], np.cumsum(np.asarray(gs))])
        want = np.stack([
            f32(lhs)[starts[j]:starts[j + 1]].T @ f32(ct)[starts[j]:starts[j + 1]]
            for j in range(g)
        ])  # fmt: skip
        if transpose_out:
            want = np.swapaxes(want, 1, 2)
        self.assertLess(_rel(out, want), 1e-2)
        self.assertEqual(seen[-1].plan.kernel, GROUPED)

    def test_float32_output_and_all_groups_empty(self):
        g, m, k, n = 4, 700, 128, 264
        lhs = jax.random.normal(jax.random.key(7), (m, k), jnp.float32).astype(jnp.bfloat16)
        rhs = jax.random.normal(jax.random.key(8), (g, k, n), jnp.float32).astype(jnp.bfloat16)
        gs = jnp.asarray([100, 0, 333, 200], jnp.int32)
        f = lambda a, b, s: jax_sm100.ragged_dot(a, b, s, preferred_element_type=jnp.float32)  # noqa: E731
        out, seen = self.lower_and_run("", f, lhs, rhs, gs)
        self.assertEqual(out.dtype, jnp.float32)
        self.assertLess(_rel(out, _reference(lhs, rhs, gs)), 1e-4)
        self.assertEqual(seen[-1].plan.kernel, GROUPED)
        empty, _ = self.lower_and_run("", f, lhs, rhs, jnp.zeros((g,), jnp.int32))
        self.assertEqual(float(jnp.max(jnp.abs(empty))), 0.0)

    @parameterized.product(
        activation=["relu", "gelu", "silu"],
        fused=["0", "1"],
        schedule=["cooperative/1x1", "cooperative/2x1", "pingpong/2x1"],
    )
    def test_activation(self, activation, fused, schedule):
        # act of each float32 sum in the epilogue (the default, JAX_SM100_RAGGED_FUSED_ACTIVATION
        # unset or 1), or after the kernel's float32 product (=0); rows past the groups
        # act(0) = 0.
        g, m, k, n = 8, 1500, 256, 264
        rng = np.random.default_rng(11)
        lhs = jax.random.normal(jax.random.key(5), (m, k), jnp.float32).astype(jnp.bfloat16)
        rhs = jax.random.normal(jax.random.key(6), (g, k, n), jnp.float32).astype(jnp.bfloat16)
        gs = _sizes(rng, g, m, 0.8)
        f = lambda a, b, s: jax_sm100.ragged_dot(a, b, s, activation=activation)  # noqa: E731
        env = {"JAX_SM100_RAGGED_FUSED_ACTIVATION": fused}
        with mock.patch.dict(os.environ, env):
            out, seen = self.lower_and_run(schedule, f, lhs, rhs, gs)
        want = P.apply_activation(_reference(lhs, rhs, gs), activation)
        self.assertLess(_rel(out, want), _TOL["bfloat16"])
        total = int(np.sum(np.asarray(gs)))
        self.assertEqual(float(jnp.max(jnp.abs(out[total:].astype(jnp.float32)))), 0.0)
        (low,) = [x for x in seen if x.plan is not None]
        self.assertEqual(low.plan.kernel, GROUPED)
        self.assertEqual(f"{activation} in the epilogue" in low.note, fused == "1")

    @parameterized.product(
        activation=[None, "gelu"],
        out=["bfloat16", "float32"],
        schedule=["cooperative/1x1", "cooperative/2x1", "pingpong/1x1", "pingpong/2x1"],
    )
    def test_bias(self, activation, out, schedule):
        # A per-group bias [g, n] in the epilogue: each row gets its group's row before the
        # activation, rows past the groups stay exact zeros; n = 264 ends inside a tile (the
        # bias's columns predicated), 20 % of the groups empty.
        g, m, k, n = 8, 1500, 256, 264
        rng = np.random.default_rng(12)
        lhs = jax.random.normal(jax.random.key(9), (m, k), jnp.float32).astype(jnp.bfloat16)
        rhs = jax.random.normal(jax.random.key(10), (g, k, n), jnp.float32).astype(jnp.bfloat16)
        bias = jax.random.normal(jax.random.key(11), (g, n), jnp.float32) * 4
        gs = _sizes(rng, g, m, 0.8)
        f = lambda a, b, s, c: jax_sm100.ragged_dot(  # noqa: E731
            a, b, s, preferred_element_type=jnp.dtype(out), bias=c, activation=activation
        )
        out_, seen = self.lower_and_run(schedule, f, lhs, rhs, gs, bias)
        self.assertEqual(out_.dtype, jnp.dtype(out))
        total = int(np.sum(np.asarray(gs)))
        rows = np.repeat(np.arange(g), np.asarray(gs))
        per_row = np.concatenate([np.asarray(bias)[rows], np.zeros((m - total, n), np.float32)])
        want = P.apply_activation(_reference(lhs, rhs, gs) + per_row, activation)
        self.assertLess(_rel(out_, want), _TOL["bfloat16"] if out == "bfloat16" else 1e-4)
        self.assertEqual(float(jnp.max(jnp.abs(out_[total:].astype(jnp.float32)))), 0.0)
        (low,) = [x for x in seen if x.plan is not None]
        self.assertEqual(low.plan.kernel, GROUPED)
        fused = "bias and gelu" if activation else "bias"
        self.assertIn(f"{fused} in the epilogue", low.note)

    @parameterized.parameters("cooperative/2x1", "pingpong/1x1")
    def test_bias_gradients(self, schedule):
        # value_and_grad with respect to lhs, rhs and the bias (the forward's bias in the
        # kernel, gelu' on its float32 sum), against the float32 reference's.
        g, m, k, n = 6, 999, 200, 136
        rng = np.random.default_rng(13)
        lhs = jax.random.normal(jax.random.key(12), (m, k), jnp.float32).astype(jnp.bfloat16)
        rhs = jax.random.normal(jax.random.key(13), (g, k, n), jnp.float32).astype(jnp.bfloat16)
        bias = jax.random.normal(jax.random.key(14), (g, n), jnp.float32)
        gs = _sizes(rng, g, m, 0.7)

        weights = jax.random.normal(jax.random.key(15), (m, n), jnp.float32)

        def loss(fn):
            return lambda a, b, c, s: jnp.sum(fn(a, b, s, c).astype(jnp.float32) * weights)

        ours = jax.value_and_grad(loss(lambda a, b, s, c: jax_sm100.ragged_dot(
            a, b, s, bias=c, activation="gelu")), (0, 1, 2))  # fmt: skip

        def ref(a, b, s, c):
            z = _reference(a, b, s) + jnp.take(
                c, jnp.repeat(jnp.arange(g), s, total_repeat_length=m), axis=0, mode="fill",
                fill_value=0)  # fmt: skip
            total = jnp.sum(s)
            z = jnp.where(jnp.arange(m)[:, None] < total, z, 0.0)
            return P.apply_activation(z, "gelu")

        (val, grads), seen = self.lower_and_run(schedule, ours, lhs, rhs, bias, gs)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        want_val, want = jax.value_and_grad(loss(ref), (0, 1, 2))(f32(lhs), f32(rhs), bias, gs)
        self.assertLess(abs(float(val) - float(want_val)), 1e-2 * max(abs(float(want_val)), 1))
        for x, y in zip(grads, want, strict=True):
            self.assertLess(_rel(x, y), 2e-2)
        kernels = [x.plan.kernel for x in seen if x.plan is not None]
        self.assertEqual(kernels, [GROUPED] * 3, [x.note for x in seen])
        self.assertTrue(any("bias in the epilogue" in x.note for x in seen))

    @parameterized.parameters("cooperative/1x1", "cooperative/2x1", "pingpong/1x1", "pingpong/2x1")
    def test_many_groups_small(self, schedule):
        # More groups than rows per tile: most tiles straddle boundaries; many groups empty.
        g, m, k, n = 256, 4096, 256, 384
        rng = np.random.default_rng(3)
        lhs = jax.random.normal(jax.random.key(2), (m, k), jnp.float32).astype(jnp.bfloat16)
        rhs = jax.random.normal(jax.random.key(3), (g, k, n), jnp.float32).astype(jnp.bfloat16)
        gs = _sizes(rng, g, m, 1.0)
        out, _ = self.lower_and_run(schedule, jax_sm100.ragged_dot, lhs, rhs, gs)
        self.assertLess(_rel(out, _reference(lhs, rhs, gs)), 1e-2)
        # The weight gradient of many short groups (ragged k), where ping-pong matters most.
        ct = jax.random.normal(jax.random.key(4), (m, n), jnp.float32).astype(jnp.bfloat16)
        vjp = lambda a, b, s, t: jax.vjp(lambda u, v: jax_sm100.ragged_dot(u, v, s), a, b)[1](t)  # noqa: E731
        (_, db), _ = self.lower_and_run(schedule, vjp, lhs, rhs, gs, ct)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        rb = jax.vjp(lambda v: lax.ragged_dot(f32(lhs), v, gs), f32(rhs))[1](f32(ct))[0]
        self.assertLess(_rel(db, rb), 1e-2)

    @parameterized.parameters("m", "k")
    def test_dynamic_tiles_match_the_static_schedule(self, ragged):
        # GemmPlan.dynamic_tiles (the planner's choice for cooperative 1x1 plans): work tiles
        # claimed from a counter give the same result, bit for bit, as the round-robin ones
        # (each tile's sums are the same wherever it runs), on skewed groups with empty ones,
        # across calls (the counter comes in zeroed each time) and against the reference.
        g, m, k, n = 64, 6000, 512, 384
        rng = np.random.default_rng(11)
        gs = _sizes(rng, g, m, 0.9)
        lhs = jax.random.normal(jax.random.key(5), (m, k), jnp.float32).astype(jnp.bfloat16)
        rhs = jax.random.normal(jax.random.key(6), (g, k, n), jnp.float32).astype(jnp.bfloat16)
        ct = jax.random.normal(jax.random.key(7), (m, n), jnp.float32).astype(jnp.bfloat16)
        if ragged == "m":
            fn, args = jax_sm100.ragged_dot, (lhs, rhs, gs)
            ref = _reference(lhs, rhs, gs)
        else:
            fn = lambda a, s, t: jax.vjp(lambda v: jax_sm100.ragged_dot(a, v, s), rhs)[1](t)[0]  # noqa: E731
            args = (lhs, gs, ct)
            f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
            ref = jax.vjp(lambda v: lax.ragged_dot(f32(lhs), v, gs), f32(rhs))[1](f32(ct))[0]
        outs = {}
        for dynamic in ("0", "1"):
            env = {planning.GROUPED_DYNAMIC_ENV: dynamic, "JAX_SM100_GROUPED_SCHEDULE": ""}
            planning._plan_cached.cache_clear()
            try:
                with (
                    mock.patch.dict(os.environ, env),
                    tu.grouped_cluster("1x1"),
                    jax_sm100.lowerings() as seen,
                ):
                    f = jax.jit(lambda *a: fn(*a))
                    out = np.asarray(f(*args))
                    again = np.asarray(f(*args))  # the same executable: its counter re-zeroed
            finally:
                planning._plan_cached.cache_clear()
            plans = [x.plan for x in seen if x.plan is not None and x.plan.kernel == GROUPED]
            self.assertIn(ragged, {p.ragged for p in plans})
            self.assertEqual({p.dynamic_tiles for p in plans}, {dynamic == "1"})
            np.testing.assert_array_equal(out, again)
            outs[dynamic] = out
        np.testing.assert_array_equal(outs["0"], outs["1"])
        self.assertLess(_rel(outs["1"], ref), 1e-2)


if __name__ == "__main__":
    absltest.main()
