"""The SM90 grouped (wgmma) kernel family's PTX, compiled for sm_90a on a CPU.

The H200 runs tests/test_gpu_ragged.py against this family; these CPU cases pin what its
binaries hold so that CI notices when a change moves them: for both ragged modes ("m": rows in
groups, B N- or K-major; "k": the contraction in groups), both schedules and fp8:

  * wgmma of the operands' kind (the tile's N); in 2x1 clusters B's loads multicast to both
    CTAs of the pair and each stage is released to both, in 1x1 clusters nothing multicasts;
  * TMA loads through the rank-4 ragged views (cp.async.bulk.tensor.4d for each operand whose
    rows come in groups; 3d for "m" mode's B, addressed by its group in the L mode) and stores
    of D (4d through the ragged view in "m" mode, 3d into (M, N, G) in "k" mode);
  * one static descriptor per operand (three prefetched, none modified on the device);
  * each stage's mbarrier expecting the whole A and B tiles, whatever the group sizes (TMA
    counts the zero-filled bytes past a group's end);
  * the warp shuffles that build the group table.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from unittest import mock

from absl.testing import absltest, parameterized

import jax_sm100
from jax_sm100._src import constraints, planning
from jax_sm100._src.compile import compile_plan
from jax_sm100._src.kernels import family
from jax_sm100._src.kernels.spec import KernelSpec
from tests import test_util as tu
from tests.test_sm100_ptx import _expect_tx_bytes, wgmma_serialized

GROUPED = planning.KERNEL_SM90_GROUPED
_KIND = {"bfloat16": "bf16.bf16", "float16": "f16.f16", "float8_e4m3fn": "e4m3.e4m3"}

CASES = [
    dict(testcase_name="m_bf16_Bmajor_n", m=8192, n=4096, k=4096, ragged="m", b_major="n"),
    dict(
        testcase_name="m_bf16_Bmajor_n_1x1",
        m=8192,
        n=4096,
        k=4096,
        ragged="m",
        b_major="n",
        cluster="1x1",
    ),  # fmt: skip
    dict(testcase_name="m_bf16_Bmajor_k", m=8192, n=4096, k=4096, ragged="m", b_major="k"),
    # Unforced: 1024-row groups and 1408 columns take ping-pong 128x160 tiles.
    dict(
        testcase_name="m_bf16_planner",
        m=16384,
        n=1408,
        k=2048,
        ragged="m",
        b_major="n",
        schedule="",
    ),  # fmt: skip
    dict(
        testcase_name="k_bf16_2x1", m=4096, n=4096, k=32768, ragged="k", b_major="n", cluster="2x1"
    ),  # fmt: skip
    dict(testcase_name="k_bf16", m=4096, n=4096, k=32768, ragged="k", b_major="n"),
    dict(
        testcase_name="m_fp16_pingpong",
        m=8192,
        n=768,
        k=2048,
        ragged="m",
        b_major="n",
        dtype="float16",
        schedule="pingpong",
        cluster="2x1",
    ),  # fmt: skip
    dict(
        testcase_name="k_bf16_pingpong",
        m=2048,
        n=768,
        k=16384,
        ragged="k",
        b_major="n",
        schedule="pingpong",
    ),  # fmt: skip
    dict(
        testcase_name="m_e4m3_Bmajor_k",
        m=8192,
        n=4096,
        k=4096,
        ragged="m",
        b_major="k",
        dtype="float8_e4m3fn",
    ),  # fmt: skip
]


class Sm90GroupedPtxTest(parameterized.TestCase):
    @parameterized.named_parameters(*CASES)
    def test_ptx(self, m, n, k, ragged, b_major, dtype="bfloat16", schedule="cooperative",
                 cluster=""):  # fmt: skip
        # `cluster` forces the planner's choice (its weight for a multicast pair, huge or tiny),
        # `schedule` its schedule ("" for its own choice).
        env = {"JAX_SM100_GROUPED_SCHEDULE": schedule, planning.GROUPED_DYNAMIC_ENV: ""}
        with mock.patch.dict(os.environ, env), tu.grouped_cluster(cluster):
            planning._plan_cached.cache_clear()
            plan = jax_sm100.plan(
                m, n, k, a_dtype=dtype, b_dtype=dtype, out_dtype="bfloat16", arch="sm_90a",
                groups=16, ragged=ragged, a_major="k" if ragged == "m" else "m",
                b_major=b_major,
            )  # fmt: skip
        planning._plan_cached.cache_clear()
        self.assertEqual(plan.kernel, GROUPED, plan.reason)
        self.assertEqual(plan.pingpong, schedule != "cooperative")
        pair = plan.cluster_shape_mn[0]
        if cluster:
            self.assertEqual(plan.cluster_shape_mn, (int(cluster[0]), 1))
        ptx = compile_plan(plan).ptx
        tm, tn, tk = plan.cta_tile_mnk
        self.assertRegex(
            ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{tn}k\d+\.f32\.{_KIND[dtype]}"
        )
        loads = re.findall(
            r"cp\.async\.bulk\.tensor\.(\d)d\.shared::(?:cta|cluster)\.global\.tile\.mbarrier",
            ptx,
        )
        multicast = re.findall(
            r"cp\.async\.bulk\.tensor\.(\d)d\.shared::cluster\.global\.tile\.mbarrier::"
            r"complete_tx::bytes\.multicast::cluster", ptx
        )  # fmt: skip
        if pair == 1:
            self.assertNotIn("multicast", ptx)
            self.assertNotIn("mbarrier.arrive.shared::cluster", ptx)
        else:
            # B's loads only (3d by group in "m" mode, 4d ragged in "k" mode); A's stay local.
            self.assertEqual(set(multicast), {"3" if ragged == "m" else "4"})
            self.assertIn("mbarrier.arrive.shared::cluster", ptx)  # releases to both CTAs
            self.assertIn("%cluster_ctarank", ptx)
        stores = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d\.global\.shared::cta", ptx)
        if ragged == "m":
            self.assertEqual(set(loads), {"3", "4"})  # A ragged, B by group in L
            self.assertEqual(set(stores), {"4"})  # D ragged
        else:
            self.assertEqual(set(loads), {"4"})  # A and B ragged along K
            self.assertEqual(set(stores), {"3"})  # D (M, N, G)
        self.assertEqual(len(re.findall(r"prefetch\.tensormap", ptx)), 3)
        self.assertNotIn("tensormap.replace", ptx)
        bits = 8 if "float8" in dtype else 16
        self.assertEqual(_expect_tx_bytes(ptx), {(tm + tn) * tk * bits // 8})
        self.assertRegex(ptx, r"shfl\.sync\.up")  # the group table's running sums
        # Dynamic work tiles (cooperative plans in 1x1 clusters): one atomic claim of the next
        # tile per tile (the producer warp's lane 0), and the counter a kernel operand.
        dynamic = pair == 1 and not plan.pingpong
        self.assertEqual(plan.dynamic_tiles, dynamic)
        self.assertEqual(len(re.findall(r"atom\.global\.add", ptx)), int(dynamic))
        names = [t.name for t in compile_plan(plan).tensor_args]
        self.assertEqual("counter" in names, dynamic)
        # ptxas keeps the wgmma batches asynchronous (it serialized them in both schedules
        # until the tenth session; tests/test_sm100_ptx.py `wgmma_serialized`).
        self.assertIn(wgmma_serialized(ptx), ([], None))

    @parameterized.product(schedule=("cooperative", "pingpong"), activation=("gelu", "silu"))
    def test_activation_in_the_epilogue(self, schedule, activation):
        # ragged_dot's fused activation (the default): the epilogue's
        # tanh (gelu) or exp2 (silu's sigmoid) before the store; wgmma not serialized.
        with mock.patch.dict(os.environ, {"JAX_SM100_GROUPED_SCHEDULE": schedule}):
            plan = jax_sm100.plan(8192, 768, 2048, a_dtype="bfloat16", b_dtype="bfloat16",
                                  arch="sm_90a", groups=16, ragged="m")  # fmt: skip
        spec = KernelSpec("bfloat16", "bfloat16", "bfloat16", activation=activation)
        ptx = compile_plan(plan, spec).ptx
        self.assertIn("tanh.approx.f32" if activation == "gelu" else "ex2.approx", ptx)
        self.assertNotIn("tanh.approx.f32", compile_plan(plan).ptx)
        self.assertIn(wgmma_serialized(ptx), ([], None))

    @parameterized.parameters("cooperative", "pingpong")
    def test_bias_in_the_epilogue(self, schedule):
        # ragged_dot's per-group bias: the (N, G) bias an operand, read per accumulator from
        # global memory in the epilogue (32-bit loads beyond the one of the group sizes);
        # wgmma not serialized. The weight gradient's mode takes none.
        with mock.patch.dict(os.environ, {"JAX_SM100_GROUPED_SCHEDULE": schedule}):
            plan = jax_sm100.plan(8192, 768, 2048, a_dtype="bfloat16", b_dtype="bfloat16",
                                  arch="sm_90a", groups=16, ragged="m")  # fmt: skip
        spec = KernelSpec("bfloat16", "bfloat16", "bfloat16", activation="gelu",
                          bias_dtype="float32")  # fmt: skip
        compiled = compile_plan(plan, spec)
        self.assertEqual([a.name for a in compiled.tensor_args],
                         ["a", "b", "d", "group_sizes", "bias"])  # fmt: skip
        loads = lambda ptx: len(re.findall(r"ld\.global", ptx))  # noqa: E731
        plain = compile_plan(plan, dataclasses.replace(spec, bias_dtype=None))
        self.assertEqual(loads(plain.ptx), 1)
        self.assertGreater(loads(compiled.ptx), 1)
        self.assertIn("tanh.approx.f32", compiled.ptx)
        self.assertIn(wgmma_serialized(compiled.ptx), ([], None))
        weight_grad = _planned(4096, 4096, 32768, 8, "k")
        why = family.family(GROUPED).why_not(
            weight_grad,
            KernelSpec(
                "bfloat16", "bfloat16", "bfloat16", a_major="m", b_major="n", bias_dtype="float32"
            ),
        )
        self.assertIn("no bias in ragged mode 'k'", why)

    def test_planner_sends_kernels_only_layouts_they_take(self):
        # A grouped kernel plan for a layout the kernel refuses would fail at compile time
        # (`GroupedGemm.why_not`); the planner sends such a problem to XLA's ragged dot.
        kernels = {"sm_90a": GROUPED, "sm_100a": planning.KERNEL_SM100_GROUPED}
        for arch, ragged, a_major, b_major in itertools.product(kernels, "mk", "mk", "nk"):
            plan = jax_sm100.plan(4096, 1024, 4096, a_dtype="bfloat16", b_dtype="bfloat16",
                                  arch=arch, groups=8, ragged=ragged, a_major=a_major,
                                  b_major=b_major)  # fmt: skip
            why = family.family(kernels[arch]).why_not(plan, KernelSpec.for_plan(plan))
            self.assertEqual(plan.kernel != planning.KERNEL_XLA, why is None,
                             (arch, ragged, a_major, b_major, plan.reason, why))  # fmt: skip

    def test_pingpong_where_it_saves_waves(self):
        # Ping-pong 128x160 for 16-bit ragged rows in groups of 512 rows or more on average,
        # where it saves 5 % of the waves (64 groups of 1024 x 2048 x 1408: 1.17x the cooperative
        # plan on the H200, forty-sixth session); cooperative tiles for short groups, equal
        # waves, fp8, weight gradients, or when asked.
        def plan(m, n, k, g, ragged="m", dtype="bfloat16", schedule=""):
            with mock.patch.dict(os.environ, {"JAX_SM100_GROUPED_SCHEDULE": schedule}):
                planning._plan_cached.cache_clear()
                try:
                    p = jax_sm100.plan(m, n, k, a_dtype=dtype, b_dtype=dtype, out_dtype="bfloat16",
                                       arch="sm_90a", groups=g, ragged=ragged,
                                       a_major="k" if ragged == "m" else "m",
                                       b_major="k" if "float8" in dtype else "n")  # fmt: skip
                finally:
                    planning._plan_cached.cache_clear()
                self.assertEqual(p.kernel, GROUPED, p.reason)
                return (*p.cta_tile_mnk[:2], p.pingpong)

        self.assertEqual(plan(65536, 1408, 2048, 64), (128, 160, True))
        self.assertEqual(plan(64 * 512, 1408, 2048, 64), (128, 160, True))
        self.assertEqual(plan(64 * 512 - 64, 1408, 2048, 64), (128, 256, False))  # short groups
        self.assertEqual(plan(16384, 768, 2048, 128), (128, 256, False))
        self.assertEqual(plan(65536, 2048, 1408, 64), (128, 256, False))  # d lhs: waves tie
        self.assertEqual(plan(32768, 4096, 4096, 8), (128, 256, False))
        self.assertFalse(plan(65536, 1408, 2048, 64, dtype="float8_e4m3fn")[2])
        self.assertFalse(plan(2048, 1408, 65536, 64, ragged="k")[2])
        self.assertFalse(plan(65536, 1408, 2048, 64, schedule="cooperative")[2])
        self.assertIn("ping-pong", _planned(65536, 1408, 2048, 64, "m").reason)

    def test_pingpong_rule_bounds(self):
        # The unasked ping-pong rule's edges (planning/sm90.py `grouped_pingpong_ok`,
        # GROUPED_PINGPONG_GAIN): never for a weight gradient (ragged "k"), even where its m
        # (the forward's k) holds GROUPED_PINGPONG_MIN_ROWS per group and a ping-pong tile
        # would save waves; and only where its tile saves 5 % of the weighted waves (8 groups
        # of 512 x 2048 x 6656: 128x192 is 3.6 % fewer, so 128x256 cooperative stays).
        from jax_sm100._src.planning import sm90  # noqa: PLC0415

        common = dict(m=2048, n=768, k=65536, groups=4, ragged="k", num_sms=132)
        self.assertFalse(sm90.grouped_pingpong_ok(common, 64))
        self.assertTrue(sm90.grouped_pingpong_ok(dict(common, ragged="m"), 64))
        with mock.patch.dict(os.environ, {"JAX_SM100_GROUPED_SCHEDULE": ""}):
            planning._plan_cached.cache_clear()
            try:
                weight_grad = _planned(2048, 768, 65536, 4, "k")
                near_tie = _planned(4096, 6656, 2048, 8, "m")
            finally:
                planning._plan_cached.cache_clear()
        self.assertEqual(weight_grad.kernel, GROUPED, weight_grad.reason)
        self.assertFalse(weight_grad.pingpong)
        self.assertTrue(weight_grad.dynamic_tiles)
        self.assertEqual((*near_tie.cta_tile_mnk[:2], near_tie.pingpong), (128, 256, False))

    @parameterized.parameters(
        (65536, 1408, 2048, 64, "bfloat16", "n"),  # 128x160 ping-pong, 2x1
        (32768, 960, 4096, 32, "float32", "k"),  # 128x192 ping-pong, float32 D, B K-major
    )
    def test_unasked_pingpong_epilogues_fit(self, m, n, k, g, out, b_major):
        # The plans the planner now takes unasked, with ragged_dot's heaviest epilogue (bias
        # and gelu): within shared memory (compile_plan checks), no register spills and no
        # serialized wgmma where a ptxas runs.
        from tests.test_sm100_ptx import ptxas_spill_bytes  # noqa: PLC0415

        with mock.patch.dict(os.environ, {"JAX_SM100_GROUPED_SCHEDULE": ""}):
            plan = jax_sm100.plan(m, n, k, a_dtype="bfloat16", b_dtype="bfloat16",
                                  out_dtype=out, arch="sm_90a", groups=g, ragged="m",
                                  b_major=b_major)  # fmt: skip
        self.assertTrue(plan.pingpong, plan.reason)
        spec = KernelSpec("bfloat16", "bfloat16", out, b_major=b_major, activation="gelu",
                          bias_dtype="float32")  # fmt: skip
        ptx = compile_plan(plan, spec).ptx
        self.assertIn(ptxas_spill_bytes(ptx, "sm_90a"), ((0, 0), None))
        self.assertIn(wgmma_serialized(ptx), ([], None))

    def test_clusters_planned(self):
        # 2x1 clusters where groups hold an even number of m tiles (64 groups of 1024 rows),
        # 1x1 for 128-row groups (a pair would idle one CTA).
        plan = _planned
        self.assertEqual(plan(65536, 1408, 2048, 64, "m").cluster_shape_mn, (2, 1))
        self.assertEqual(plan(16384, 768, 2048, 128, "m").cluster_shape_mn, (1, 1))
        self.assertIn("in 2x1 clusters", plan(65536, 1408, 2048, 64, "m").reason)
        with self.assertRaisesRegex(constraints.PlanError, "a cluster in"):
            dataclasses.replace(plan(16384, 768, 2048, 128, "m"), cluster_shape_mn=(1, 2))

    def test_dynamic_tiles_planned(self):
        # On for cooperative plans in 1x1 clusters (H200: 128 skewed groups' forward 1.08-1.11x,
        # equal groups unchanged; benchmarks/RESULTS.md, seventeenth session); never in 2x1
        # clusters or ping-pong; JAX_SM100_GROUPED_DYNAMIC turns it off or back on.
        env = planning.GROUPED_DYNAMIC_ENV

        def plan(value, *problem):
            with mock.patch.dict(os.environ, {env: value}):
                planning._plan_cached.cache_clear()
                try:
                    return _planned(*problem)
                finally:
                    planning._plan_cached.cache_clear()

        self.assertTrue(plan("", 16384, 768, 2048, 128, "m").dynamic_tiles)
        self.assertFalse(plan("0", 16384, 768, 2048, 128, "m").dynamic_tiles)
        self.assertTrue(plan("1", 16384, 768, 2048, 128, "m").dynamic_tiles)
        self.assertFalse(plan("1", 65536, 1408, 2048, 64, "m").dynamic_tiles)  # 2x1
        self.assertRegex(str(plan("", 16384, 768, 2048, 128, "m")), r"dynamic_tiles +True")
        with self.assertRaisesRegex(constraints.PlanError, "JAX_SM100_GROUPED_DYNAMIC"):
            plan("yes", 16384, 768, 2048, 128, "m")
        base = plan("", 16384, 768, 2048, 128, "m")
        with self.assertRaisesRegex(constraints.PlanError, "dynamic_tiles=True"):
            dataclasses.replace(plan("", 65536, 1408, 2048, 64, "m"), dynamic_tiles=True)
        dense = jax_sm100.plan(4096, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16",
                               arch="sm_90a")  # fmt: skip
        with self.assertRaisesRegex(constraints.PlanError, "dynamic_tiles=True"):
            dataclasses.replace(dense, dynamic_tiles=True)
        with mock.patch.dict(os.environ, {"JAX_SM100_GROUPED_SCHEDULE": "pingpong"}):
            planning._plan_cached.cache_clear()
            pingpong = jax_sm100.plan(16384, 768, 2048, a_dtype="bfloat16", b_dtype="bfloat16",
                                      arch="sm_90a", groups=128, ragged="m")  # fmt: skip
        planning._plan_cached.cache_clear()
        self.assertEqual((pingpong.pingpong, pingpong.dynamic_tiles), (True, False))
        with self.assertRaisesRegex(constraints.PlanError, "dynamic_tiles=True"):
            dataclasses.replace(pingpong, dynamic_tiles=True)
        # The work ring's shared memory is counted.
        static = dataclasses.replace(base, dynamic_tiles=False)
        self.assertEqual(base.smem_bytes - static.smem_bytes, 80)
        # Weight gradients (ragged "k": tiles as costly as their groups are large) take 1x1
        # clusters with dynamic tiles on both architectures, where round-robin would pair CTAs
        # in 2x1 clusters (planning/sm90.py GROUPED_DYNAMIC_K_GAIN; H200, eighteenth session).
        for arch in ("sm_90a", "sm_100a"):
            for g, m, n, k in ((8, 4096, 4096, 32768), (64, 2048, 1408, 65536)):
                with mock.patch.dict(os.environ, {env: ""}):
                    planning._plan_cached.cache_clear()
                    dyn = _planned(m, n, k, g, "k", arch)
                with mock.patch.dict(os.environ, {env: "0"}):
                    planning._plan_cached.cache_clear()
                    rr = _planned(m, n, k, g, "k", arch)
                planning._plan_cached.cache_clear()
                self.assertEqual((dyn.cluster_shape_mn, dyn.dynamic_tiles), ((1, 1), True))
                self.assertEqual((rr.cluster_shape_mn, rr.dynamic_tiles), ((2, 1), False))

    def test_tile_order_planned(self):
        # A group's tiles along N first for small experts (B of 2048 x 1408 bfloat16, 5.8 MB),
        # along M first for large ones (4096 x 4096: 32 MiB) and for every weight gradient.
        for arch in ("sm_90a", "sm_100a"):
            with self.subTest(arch=arch):

                def plan(*problem, arch=arch):
                    return _planned(*problem, arch=arch)

                self.assertFalse(plan(65536, 1408, 2048, 64, "m").raster_along_m)
                self.assertFalse(plan(16384, 768, 2048, 128, "m").raster_along_m)
                self.assertTrue(plan(32768, 4096, 4096, 8, "m").raster_along_m)
                self.assertTrue(plan(2048, 1408, 65536, 64, "k").raster_along_m)
                self.assertRegex(str(plan(65536, 1408, 2048, 64, "m")), r"raster +along N")


def _planned(m, n, k, g, ragged, arch="sm_90a"):
    """The planner's bfloat16 plan of a grouped problem (A K-major in "m" mode, M-major in
    "k" mode), with the grouped schedule left to the planner."""
    with mock.patch.dict(os.environ, {"JAX_SM100_GROUPED_SCHEDULE": ""}):
        return jax_sm100.plan(m, n, k, a_dtype="bfloat16", b_dtype="bfloat16", arch=arch,
                              groups=g, ragged=ragged,
                              a_major="k" if ragged == "m" else "m")  # fmt: skip


if __name__ == "__main__":
    absltest.main()
