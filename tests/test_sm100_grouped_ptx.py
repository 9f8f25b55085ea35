"""The SM100 grouped (tcgen05) kernel family, verified by compiling it for sm_100a on a CPU.

No SM100 GPU runs in CI, so these tests are the evidence for the grouped sm_100a kernel
(kernels/sm100_grouped.py): each case plans a grouped problem for sm_100a (ragged rows, "m",
with B N- or K-major; ragged contraction, "k"), compiles it through `compile_plan` and reads
the PTX:

  * tcgen05.mma of the operands' kind, cta_group::1 only (grouped plans are 1-CTA);
  * tcgen05.alloc and tcgen05.dealloc of the plan's `tmem_alloc_cols`, tcgen05.ld out of TMEM;
  * TMA loads through the rank-4 ragged views (cp.async.bulk.tensor.4d for the operand whose
    rows are in groups, 3d for "m" mode's B), completing on an mbarrier; in 2x1 clusters B's
    loads multicast to both CTAs (A's never) and each stage's release is committed to both;
    TMA stores of D (4d through the ragged view in "m" mode, 3d into (M, N, G) in "k" mode);
  * one static descriptor per operand (three prefetched, none modified on the device);
  * each stage's mbarrier expects the whole A and B tiles' bytes, computed here from the plan
    (TMA counts the zero-filled bytes past a group's end too), whatever the group sizes;
  * the group sizes read from global memory (the group table) and no register spills.

The planner's sm_100a grouped rule is tested here too (the export of ragged_dot's training
products for each arch is in tests/test_ragged.py). What this does not show: that the kernel
computes the right numbers, or how fast it runs. Those need an SM100 GPU
(tests/test_gpu_ragged.py runs there).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from unittest import mock

from absl.testing import absltest, parameterized

from jax_sm100._src import constraints, planning
from jax_sm100._src.compile import compile_plan
from jax_sm100._src.kernels import family, sm100_gemm, sm100_grouped
from jax_sm100._src.kernels.spec import KernelSpec
from jax_sm100._src.planning import gemm_plan
from tests.test_sm100_ptx import _MMA_KIND, _alloc_columns, _expect_tx_bytes, _ptxas_spill_bytes

GROUPED = planning.KERNEL_SM100_GROUPED

# Each case: the grouped problem (ragged "m": [m, k] rows in groups times one [k, n] matrix per
# group; "k": [m, k]^T [k, n] per group of k's rows), plan fields to force. About 0.5 s of
# compile each; the grid covers both modes, both B majors in "m" mode, both planned tiles, and
# every operand kind (f16, tf32, f8f6f4), with a float32 output.
CASES = [
    dict(
        testcase_name="m_bf16_Bmajor_n_128x256",
        problem=dict(m=8192, n=4096, k=4096, groups=8, ragged="m", b_major="n"),
    ),
    dict(
        testcase_name="m_bf16_Bmajor_k_128x256",
        problem=dict(m=8192, n=4096, k=4096, groups=8, ragged="m", b_major="k"),
    ),
    dict(
        testcase_name="k_bf16_128x256_2x1",
        problem=dict(m=4096, n=4096, k=32768, groups=8, ragged="k"),
        force=dict(cluster_shape_mn=(2, 1)),
    ),
    dict(
        testcase_name="k_bf16_128x256",
        problem=dict(m=4096, n=4096, k=32768, groups=8, ragged="k"),
    ),
    dict(
        testcase_name="m_fp16_Bmajor_k_128x128",
        problem=dict(m=4096, n=1408, k=2048, groups=64, ragged="m", b_major="k", dtype="float16"),
    ),
    dict(
        testcase_name="k_bf16_128x128_f32out",
        problem=dict(m=2048, n=1408, k=8192, groups=16, ragged="k", out_dtype="float32"),
        force=dict(mma_tiler_mnk=(128, 128, 64)),
    ),
    dict(
        testcase_name="m_e4m3_Bmajor_n",
        problem=dict(m=8192, n=4096, k=4096, groups=8, ragged="m", dtype="float8_e4m3fn"),
    ),
    dict(
        testcase_name="k_e5m2",
        problem=dict(m=4096, n=4096, k=32768, groups=8, ragged="k", dtype="float8_e5m2"),
    ),
    dict(
        testcase_name="m_tf32_Bmajor_n",
        problem=dict(m=8192, n=4096, k=4096, groups=8, ragged="m", dtype="float32"),
    ),
]


def _plan(problem, force=None):
    args = dict(problem)
    dtype = args.pop("dtype", "bfloat16")
    a_major = "k" if args["ragged"] == "m" else "m"
    args.setdefault("b_major", "n")
    with mock.patch.dict(os.environ, {planning.GROUPED_DYNAMIC_ENV: ""}):
        planning._plan_cached.cache_clear()
        p = planning.plan(
            args.pop("m"), args.pop("n"), args.pop("k"), a_dtype=dtype, b_dtype=dtype,
            arch="sm_100a", a_major=a_major, **args,
        )  # fmt: skip
    planning._plan_cached.cache_clear()
    if not force:
        return p
    if "cluster_shape_mn" in force:
        # Dynamic work tiles where the planner takes them: in 1x1 clusters.
        force = {"dynamic_tiles": tuple(force["cluster_shape_mn"]) == (1, 1), **force}
    # The deepest A/B pipeline that fits the forced tile, as the planner would take it.
    for stages in range(12, constraints.MIN_AB_STAGES - 1, -1):
        try:
            return dataclasses.replace(p, num_ab_stages=stages, **force)
        except constraints.PlanError as e:
            if "shared memory" not in str(e):
                raise
    raise AssertionError(f"no stage count fits {force}")


def _mbarrier_init_counts(ptx: str) -> collections.Counter:
    """How many mbarriers the PTX initialises with each arrival count."""
    regs = dict(re.findall(r"mov\.b32 \t(%r\d+), (\d+);", ptx))
    found = re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64 \t\[[^\]]+\], (%r\d+|\d+);", ptx)
    return collections.Counter(int(regs.get(v, v)) for v in found)


def _tma_dims(ptx: str, direction: str) -> set[int]:
    """Ranks of the TMA tensor copies: loads ("load", global -> shared::cta on an mbarrier)
    or stores ("store", shared::cta -> global)."""
    kind = r"shared::cta\.global" if direction == "load" else r"global\.shared::cta"
    return {int(d) for d in re.findall(rf"cp\.async\.bulk\.tensor\.(\d)d\.{kind}\.", ptx)}


class Sm100GroupedPtxTest(parameterized.TestCase):
    @parameterized.named_parameters(*CASES)
    def test_ptx(self, problem, force=None):
        plan = _plan(problem, force)
        self.assertEqual(plan.kernel, GROUPED, plan.reason)
        self.assertFalse(plan.use_2cta)
        self.assertIn(plan.cluster_shape_mn, ((1, 1), (2, 1)))
        pair = plan.cluster_shape_mn[0]
        spec = KernelSpec.for_plan(plan)
        self.assertIsNone(sm100_grouped.Sm100GroupedGemmKernel.why_not(plan, spec))

        compiled = compile_plan(plan, spec)
        ptx = compiled.ptx
        self.assertIn(".target sm_100a", ptx)
        self.assertEqual(compiled.cubin[:4], b"\x7fELF")
        # Dynamic work tiles in 1x1 clusters (grouped.py's protocol, proven on the H200 by the
        # SM90 family): the counter an operand, one atomic claim, and the ring's mbarriers (4
        # full ones counting the TMA warp's 32 lanes, 4 empty ones the MMA and epilogue warps').
        dynamic = pair == 1
        self.assertEqual(plan.dynamic_tiles, dynamic)
        names = ["a", "b", "d", "group_sizes"] + ["counter"] * dynamic
        self.assertEqual([t.name for t in compiled.tensor_args], names)
        self.assertEqual(len(re.findall(r"atom\.global\.add", ptx)), int(dynamic))
        ring = _mbarrier_init_counts(ptx)
        self.assertEqual((ring.get(32, 0), ring.get(160, 0)), (4, 4) if dynamic else (0, 0))

        # The MMA: the operands' kind, one CTA per MMA, nothing of a CTA pair anywhere.
        mmas = set(re.findall(r"tcgen05\.mma\.(cta_group::\d)\.(kind::\w+)", ptx))
        self.assertEqual(mmas, {("cta_group::1", f"kind::{_MMA_KIND[plan.a_dtype]}")})
        self.assertNotIn("cta_group::2", ptx)
        mm, mn, mk = plan.mma_tiler_mnk
        k_steps = mk // constraints.mma_inst_k(plan.a_dtype)
        n_mma = len(re.findall(r"tcgen05\.mma\.", ptx))
        self.assertTrue(n_mma >= k_steps and n_mma % k_steps == 0, (n_mma, k_steps))

        # TMEM: the plan's columns (two accumulator stages of the tile's N), read by tcgen05.ld.
        self.assertEqual(plan.tmem_alloc_cols, min(512, 2 * mn))
        self.assertEqual(set(_alloc_columns(ptx, "alloc")), {plan.tmem_alloc_cols})
        self.assertEqual(set(_alloc_columns(ptx, "dealloc")), {plan.tmem_alloc_cols})
        self.assertIn("tcgen05.alloc.cta_group::1", ptx)
        self.assertRegex(ptx, r"tcgen05\.ld\.sync\.aligned\.\w+\.x\d+\.b32")
        self.assertIn("tcgen05.commit", ptx)

        # TMA through the ragged views: the operand(s) in groups are rank-4 views ("m": A and
        # D; "k": A and B), "m" mode's B is (N, K, G) and "k" mode's D (M, N, G).
        loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\.[\w:.]+", ptx)
        self.assertTrue(loads and all("mbarrier::complete_tx::bytes" in x for x in loads), loads)
        ragged_m = plan.ragged == "m"
        multicast = {x.split(".")[4] for x in loads if "multicast::cluster" in x}
        # The A/B ring's empty barriers count one release per CTA that reads the stage: both
        # CTAs of a pair (B is theirs), one alone; the multicast mask names both CTAs (0b11).
        inits = _mbarrier_init_counts(ptx)
        self.assertEqual(inits.get(2, 0), plan.num_ab_stages if pair == 2 else 0, inits)
        masks = set(re.findall(r"mov\.b16 \t%rs\d+, (\d+);", ptx))
        self.assertEqual(masks, {"3"} if pair == 2 else set())
        if pair == 1:
            self.assertFalse(multicast, loads)
        else:
            # B only: 3d by group in "m" mode, 4d ragged in "k" mode; A stays local, and each
            # stage is released to both CTAs (a multicast commit).
            self.assertEqual(multicast, {"3d" if ragged_m else "4d"}, loads)
            self.assertTrue(any("shared::cta" in x for x in loads), loads)
            self.assertRegex(ptx, r"tcgen05\.commit\.cta_group::1\.[\w:.]*multicast::cluster")
        self.assertEqual(
            _tma_dims(ptx, "load") | {int(d[0]) for d in multicast}, {3, 4} if ragged_m else {4}
        )
        self.assertEqual(_tma_dims(ptx, "store"), {4} if ragged_m else {3})
        # One static descriptor each for A, B and D (prefetched once), none built or patched
        # on the device: a group's bounds travel in the TMA coordinates.
        self.assertEqual(len(re.findall(r"prefetch\.tensormap\b", ptx)), 3)
        self.assertNotRegex(ptx, r"tensormap\.(replace|cp_fenceproxy)")

        # Every stage's transaction count is the whole A and B tiles' bytes, from the plan:
        # a box past a group's end is zero-filled and still counted.
        bits = constraints.DTYPE_BITS[plan.a_dtype]
        self.assertEqual(_expect_tx_bytes(ptx), {(mm + mn) * mk * bits // 8})

        # Warp roles: the dense family's 4 epilogue warps, MMA warp and TMA warp.
        self.assertIn(f".reqntid {32 * 6}, 1, 1", ptx)
        # The group table: group sizes read from global memory (the kernel's only loads
        # outside TMA), summed with warp shuffles.
        self.assertIn("ld.global", ptx)
        self.assertIn("shfl.sync.up", ptx)
        # The epilogue warps meet after their last TMEM load, before the columns are freed.
        free = ptx.index("tcgen05.relinquish_alloc_permit")
        last_barrier = ptx.rfind("bar.sync \t1, 128;", 0, free)
        self.assertGreater(last_barrier, 0, "no epilogue barrier before the TMEM free")
        self.assertNotIn("tcgen05.ld", ptx[last_barrier:free])

        spills = _ptxas_spill_bytes(ptx)
        if spills is not None:
            self.assertEqual(spills, 0, "ptxas reports register spills")

    def test_legality(self):
        plan = _plan(CASES[0]["problem"])
        spec = KernelSpec.for_plan(plan)
        # A CTA pair, or a cluster other than 1x1 and 2x1: refused by the plan itself.
        for edit in (dict(use_2cta=True, mma_tiler_mnk=(256, 256, 64)),
                     dict(cluster_shape_mn=(1, 2))):  # fmt: skip
            with self.assertRaisesRegex(
                constraints.PlanError, r"a cluster in \(\(1, 1\), \(2, 1\)\) and 1-CTA"
            ):
                dataclasses.replace(plan, **edit)
        pair = dataclasses.replace(plan, groups=0, ragged="", kernel=planning.KERNEL_SM100)
        self.assertIn("not a grouped plan", sm100_grouped.Sm100GroupedGemmKernel.why_not(
            pair, KernelSpec.for_plan(pair)))  # fmt: skip
        # The dense family takes no grouped plan, the grouped family no epilogue beyond alpha,
        # a per-group bias ("m" mode only) and an activation, and "m" mode needs a K-major A.
        with self.assertRaisesRegex(ValueError, "not an sm100_tcgen05 plan"):
            sm100_gemm.Sm100GemmKernel(plan, spec)
        why = sm100_grouped.Sm100GroupedGemmKernel.why_not
        self.assertIn("a per-group bias and an activation", why(plan, dataclasses.replace(
            spec, c_dtype="bfloat16")))  # fmt: skip
        self.assertIsNone(why(plan, dataclasses.replace(spec, bias_dtype="float32")))
        weight_grad = _plan(dict(m=4096, n=4096, k=32768, groups=8, ragged="k"))
        self.assertIn("no bias in ragged mode 'k'", why(weight_grad, dataclasses.replace(
            KernelSpec.for_plan(weight_grad), bias_dtype="float32")))  # fmt: skip
        self.assertIsNone(why(plan, dataclasses.replace(spec, alpha=0.5, activation="relu")))
        self.assertIn("K-major A", why(plan, dataclasses.replace(spec, a_major="m")))
        self.assertIs(family.family(GROUPED), sm100_grouped.Sm100GroupedGemmKernel)

    def test_bias_in_the_epilogue(self):
        # ragged_dot's per-group bias: the (N, G) bias an operand, read in the epilogue (32-bit
        # global loads beyond the one of the group sizes), beside the tcgen05 MMAs; the
        # plan's binary without a bias reads none.
        plan = _plan(dict(m=8192, n=768, k=2048, groups=16, ragged="m"))
        spec = KernelSpec.for_plan(plan)
        biased = compile_plan(plan, dataclasses.replace(spec, bias_dtype="float32",
                                                        activation="gelu"))  # fmt: skip
        plain = compile_plan(plan, dataclasses.replace(spec, activation="gelu"))
        self.assertEqual([a.name for a in biased.tensor_args],
                         ["a", "b", "d", "group_sizes", "bias"])  # fmt: skip
        self.assertEqual([a.name for a in plain.tensor_args], ["a", "b", "d", "group_sizes"])
        loads = lambda ptx: len(re.findall(r"ld\.global", ptx))  # noqa: E731
        self.assertEqual(loads(plain.ptx), 1)
        self.assertGreater(loads(biased.ptx), 1)
        self.assertIn("tcgen05.mma", biased.ptx)
        self.assertIn("tanh.approx.f32", biased.ptx)


class Sm100GroupedPlanTest(parameterized.TestCase):
    @parameterized.parameters(
        # (m, n, k, groups, ragged): issue 18's MoE shapes, both modes.
        (8192, 4096, 4096, 8, "m"),
        (65536, 2048, 1408, 64, "m"),
        (16384, 2048, 768, 128, "m"),
        (4096, 1408, 2048, 64, "m"),
        (4096, 4096, 32768, 8, "k"),
        (2048, 1408, 8192, 64, "k"),
    )
    def test_tile_by_equal_groups_waves(self, m, n, k, g, ragged):
        p = _plan(dict(m=m, n=n, k=k, groups=g, ragged=ragged))
        self.assertEqual(p.kernel, GROUPED, p.reason)
        self.assertEqual((p.use_2cta, p.num_acc_stages), (False, 2))
        # The tile and cluster with the fewest weighted waves for equal groups: the same model
        # (`grouped_work_tiles`, pairs of CTA tiles weighed by the multicast gain, a weight
        # gradient's single CTAs by their dynamic tiles' gain) as the sm_90a grouped planner's.
        common = dict(m=m, n=n, groups=g, ragged=ragged)
        gain = planning.sm90.GROUPED_MULTICAST_GAIN
        single = planning.sm90.GROUPED_DYNAMIC_K_GAIN if ragged == "k" else 1.0

        def cost(choice):
            (tm, tn, eff), pair = choice
            tiles = gemm_plan.grouped_work_tiles(common, pair * tm, tn)
            weight = eff * (gain if pair == 2 else single)
            return gemm_plan._wave_cost(tiles, pair, p.num_sms, pair * tm * tn, weight)

        choices = [(c, pair) for c in planning.sm100._SM100_GROUPED_CANDIDATES for pair in (1, 2)]
        best, pair = min(choices, key=cost)
        self.assertEqual(p.mma_tiler_mnk[:2], best[:2])
        self.assertEqual(p.cluster_shape_mn, (pair, 1))
        self.assertIn(p.mma_tiler_mnk[:2], ((128, 256), (128, 128)))
        # TMEM: two accumulators of the tile's N; SMEM: the group table beside the deepest
        # stage ring that fits.
        self.assertEqual(p.tmem_alloc_cols, 2 * p.mma_tiler_mnk[1])
        cap = planning.smem_capacity("sm_100a")
        self.assertLessEqual(p.smem_bytes, cap)
        self.assertGreater(p.smem_bytes + p.ab_stage_bytes, cap)
        # (and the dynamic tiles' ring in 1x1 clusters).
        ring = constraints.GROUPED_WORK_RING_BYTES if p.dynamic_tiles else 0
        self.assertEqual(p.dynamic_tiles, pair == 1)
        self.assertEqual(
            p.smem_bytes,
            constraints.SMEM_RESERVED_BYTES + p._epi_bytes + gemm_plan.group_table_bytes(g)
            + ring + p.num_ab_stages * p.ab_stage_bytes,
        )  # fmt: skip
        self.assertIn("grouped tcgen05 1-CTA", p.reason)

    @parameterized.parameters(
        # (groups, A/B stages) of a 128x256 bf16 plan in 1x1 clusters with dynamic tiles: beside
        # the 1 KiB reserve and the epilogue ring, 215040 bytes hold 49152-byte stages, the group
        # table (8 * (groups + 2)) and the work ring (80). 2292 groups fill shared memory to the
        # byte with 4 stages; 8 bytes more of table (2293 groups) or of ring (2300) leave 3.
        (2292, 4),
        (2293, 3),
        (2300, 3),
    )
    def test_group_table_at_the_stage_boundary(self, groups, stages):
        p = _plan(dict(m=65536, n=4096, k=4096, groups=groups, ragged="m"))
        self.assertEqual(p.kernel, GROUPED, p.reason)
        self.assertEqual((p.mma_tiler_mnk, p.cluster_shape_mn, p.dynamic_tiles),
                         ((128, 256, 64), (1, 1), True))  # fmt: skip
        self.assertEqual(p.num_ab_stages, stages)
        cap = planning.smem_capacity("sm_100a")
        self.assertLessEqual(p.smem_bytes, cap)
        self.assertGreater(p.smem_bytes + p.ab_stage_bytes, cap)
        # The kernel's shared storage, table and ring included, fits a CTA (common.shared_struct
        # refuses it at compile time otherwise).
        compile_plan(p)

    def test_dynamic_tiles_switch(self):
        # JAX_SM100_GROUPED_DYNAMIC, read by both grouped planners: 0 turns the dynamic tiles of
        # a 1x1 plan off (and gives back the ring's shared memory), 1 or unset keeps them, any
        # other value is refused.
        env = planning.GROUPED_DYNAMIC_ENV

        def plan(value):
            with mock.patch.dict(os.environ, {env: value}):
                planning._plan_cached.cache_clear()
                try:
                    return planning.plan(16384, 768, 2048, a_dtype="bfloat16",
                                         b_dtype="bfloat16", arch="sm_100a", groups=128,
                                         ragged="m")  # fmt: skip
                finally:
                    planning._plan_cached.cache_clear()

        on, off = plan(""), plan("0")
        self.assertEqual(on.cluster_shape_mn, (1, 1))
        self.assertEqual((on.dynamic_tiles, plan("1").dynamic_tiles, off.dynamic_tiles),
                         (True, True, False))  # fmt: skip
        self.assertEqual(
            on.smem_bytes - on.num_ab_stages * on.ab_stage_bytes
            - (off.smem_bytes - off.num_ab_stages * off.ab_stage_bytes),
            constraints.GROUPED_WORK_RING_BYTES,
        )  # fmt: skip
        with self.assertRaisesRegex(constraints.PlanError, env):
            plan("yes")
        # The ring's mbarriers are initialised before the pipelines' init fence.
        ptx = compile_plan(on).ptx
        inits = [m.start() for m in re.finditer(r"mbarrier\.init", ptx)]
        self.assertLess(max(inits), ptx.index("fence.mbarrier_init"))

    def test_which_tile(self):
        # Big equal groups fill 148 SMs with 128x256 tiles; 64 groups of 64 rows over N=1408
        # waste less of a 128x128 tile's partial N.
        case = {c["testcase_name"]: c["problem"] for c in CASES}
        self.assertEqual(_plan(case["m_bf16_Bmajor_n_128x256"]).mma_tiler_mnk, (128, 256, 64))
        self.assertEqual(_plan(case["m_fp16_Bmajor_k_128x128"]).mma_tiler_mnk, (128, 128, 64))

    def test_what_runs_on_xla(self):
        # Too many groups for the group table (the kernel's limit on both archs) run on XLA's
        # ragged dot, whose plan needs no table (it used to overflow SMEM and raise).
        for g in (planning.gemm_plan.MAX_GROUPS + 1, 100_000):
            p = _plan(dict(m=8192, n=4096, k=4096, groups=g, ragged="m"))
            self.assertEqual(p.kernel, planning.KERNEL_XLA)
            self.assertIn("groups (the grouped kernel takes up to 4096)", p.reason)
        # The fp8 weight gradient runs on sm_100a's kernel (tcgen05 takes M- and N-major fp8),
        # not on sm_90a's (wgmma does not).
        fp8 = dict(m=4096, n=4096, k=32768, groups=8, ragged="k", dtype="float8_e4m3fn")
        self.assertEqual(_plan(fp8).kernel, GROUPED)
        args = dict(a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn", groups=8, ragged="k")
        sm90 = planning.plan(4096, 4096, 32768, arch="sm_90a", a_major="m", **args)
        self.assertEqual(sm90.kernel, planning.KERNEL_XLA)
        # A few groups in a layout the kernel does not take (an M-major lhs in ragged-rows mode):
        # XLA's plan in a 1x1 cluster, where the kernel's plan of the same sizes pairs CTAs.
        args = dict(a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_100a", groups=8, ragged="m")
        self.assertEqual(planning.plan(8192, 4096, 4096, **args).cluster_shape_mn, (2, 1))
        xla = planning.plan(8192, 4096, 4096, a_major="m", **args)
        self.assertEqual((xla.kernel, xla.cluster_shape_mn, xla.dynamic_tiles),
                         (planning.KERNEL_XLA, (1, 1), False))  # fmt: skip

    def test_grouped_kernels_per_arch(self):
        p = _plan(CASES[0]["problem"])
        with self.assertRaisesRegex(constraints.PlanError, "runs on sm_100a only"):
            dataclasses.replace(p, arch="sm_90a", num_sms=132)
        with self.assertRaisesRegex(constraints.PlanError, "grouped problems run on one of"):
            dataclasses.replace(p, kernel=planning.KERNEL_SM100)
        dense = planning.plan(4096, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16")
        with self.assertRaisesRegex(constraints.PlanError, "dense ones never do"):
            dataclasses.replace(dense, kernel=GROUPED)
        self.assertIn("groups", str(p))


if __name__ == "__main__":
    absltest.main()
