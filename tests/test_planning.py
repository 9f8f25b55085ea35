"""The planner: invariants over a grid of problems, the DSL helpers' worked examples, edits."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from unittest import mock

import cutlass.utils as cu
import jax.numpy as jnp
from absl.testing import absltest, parameterized

import jax_sm100
from jax_sm100._src import compile as compile_mod
from jax_sm100._src import constraints as C
from jax_sm100._src import dispatch, planning
from jax_sm100._src.kernels.spec import KernelSpec
from jax_sm100._src.planning import sm90

SHAPES = [
    (1, 1, 1),
    (64, 4096, 4096),
    (128, 128, 128),
    (256, 8192, 8192),
    (1000, 1000, 1000),
    (2048, 2048, 2048),
    (4096, 14336, 4096),
    (8192, 8192, 8192),
    (16384, 4096, 4096),
    (3, 5000, 77),
]
DTYPE_PAIRS = [
    ("bfloat16", "bfloat16", None),
    ("float16", "float16", "float16"),
    ("float32", "float32", None),
    ("float8_e4m3fn", "float8_e4m3fn", None),
    ("float8_e5m2", "float8_e5m2", "bfloat16"),
    ("bfloat16", "float16", None),
    ("float64", "float64", None),
]


def _grid():
    for arch, (m, n, k), (ad, bd, cd), b_major in itertools.product(
        C.ARCHS, SHAPES, DTYPE_PAIRS, ("n", "k")
    ):
        yield arch, m, n, k, ad, bd, cd, b_major


def _sm90_floor(kernel_plan: planning.GemmPlan) -> int:
    """FLOPs under which the planner sends a problem to XLA's dot instead of this kernel plan."""
    if kernel_plan.arch != "sm_90a" or kernel_plan.kernel == planning.KERNEL_XLA:
        return 0
    split = kernel_plan.split_k > 1
    return planning.SM90_SPLITK_MIN_FLOPS if split else planning.SM90_MIN_FLOPS


class PlannerInvariantsTest(parameterized.TestCase):
    def test_grid(self):
        count = routed = 0
        for arch, m, n, k, ad, bd, cd, b_major in _grid():
            kw = dict(a_dtype=ad, b_dtype=bd, c_dtype=cd, arch=arch, b_major=b_major)
            forced = jax_sm100.plan(m, n, k, force_kernel=True, **kw)
            p = jax_sm100.plan(m, n, k, **kw)
            with self.subTest(plan=(arch, m, n, k, ad, bd, cd, b_major)):
                # With force_kernel, a kernel plan exactly where a kernel can take the problem.
                self._check(forced)
                if 2 * m * n * k < _sm90_floor(forced):
                    # Too small for the SM90 kernel to beat XLA's dot: the planner says so.
                    self._check(p, too_small=True)
                    self.assertEqual(p.kernel, planning.KERNEL_XLA)
                    self.assertIn("force_kernel", p.reason)
                    self.assertEqual(p.split_k, 1)
                    routed += 1
                else:
                    self.assertEqual(p, forced)
            count += 1
        self.assertGreater(count, 200)
        self.assertGreater(routed, 0)

    def _check(self, p: planning.GemmPlan, too_small: bool = False):
        """Invariants of a plan; `too_small`: one the planner sent to XLA's dot for its size."""
        cta = p.cta_tile_mnk
        out_bits = C.DTYPE_BITS[p.out_dtype]
        c_bits = None if p.c_dtype is None else C.DTYPE_BITS[p.c_dtype]
        if p.arch == "sm_100a":
            # The epilogue subtile is the DSL helper's answer for this CTA tile (D, C N-major).
            want = cu.sm100.compute_epilogue_tile_size(
                cta[0], cta[1], p.use_2cta, out_bits, c_bits, False, False
            )
            self.assertEqual(p.epi_tile, tuple(want))
            cols = cu.sm100.compute_acc_tmem_cols_per_stage(
                cta[0], cta[1], p.use_2cta, p.mma_tiler_mnk[1], False
            )
            self.assertEqual(p.acc_tmem_cols_per_stage, cols)
            # TMEM allocation legal: power of two in [32, 512], holding every stage.
            t = p.tmem_alloc_cols
            self.assertTrue(32 <= t <= 512 and t & (t - 1) == 0, t)
            self.assertGreaterEqual(t, cols * p.num_acc_stages)
            self.assertIn(p.num_acc_stages, (1, 2))
            self.assertEqual(cta[0] * (2 if p.use_2cta else 1), p.mma_tiler_mnk[0])
            if p.use_2cta:
                self.assertEqual(p.cluster_shape_mn[0] % 2, 0)
            elif p.kernel != planning.KERNEL_XLA:
                # A 1-CTA plan pairs CTAs along M only where there are two m tiles to pair: over
                # one, the pair's second CTA would hold nothing but padding (half the SMs idle).
                self.assertEqual(p.cluster_shape_mn[0] == 2, math.ceil(p.m / cta[0]) >= 2, p)
        else:
            self.assertFalse(p.use_2cta)
            self.assertEqual(p.tmem_alloc_cols, 0)
        self.assertLessEqual(p.smem_bytes, planning.smem_capacity(p.arch))
        self.assertGreaterEqual(p.num_ab_stages, 2)
        # The planner fills shared memory: one more stage would not fit.
        self.assertGreater(p.smem_bytes + p.ab_stage_bytes, planning.smem_capacity(p.arch))
        self.assertEqual(cta[0] % p.epi_tile[0], 0)
        self.assertEqual(cta[1] % p.epi_tile[1], 0)
        why = C.kernel_support(
            p.arch,
            p.m,
            p.n,
            p.k,
            p.a_dtype,
            p.b_dtype,
            p.out_dtype,
            p.c_dtype,
            p.a_major,
            p.b_major,
        )
        if too_small:
            self.assertIsNone(why)  # a kernel could take it
        else:
            self.assertEqual(p.kernel == planning.KERNEL_XLA, why is not None, p.reason)
        if why is not None:
            self.assertEqual(p.reason, why)
        self.assertTrue(p.reason)
        if p.swizzle_size > 1:
            # The DSL's scheduler pads the swizzled cluster count to a multiple of the swizzle
            # with clusters outside the matrix that still run: the planner avoids any padding.
            tiles = math.ceil(p.n / cta[1]) if p.raster_along_m else math.ceil(p.m / cta[0])
            along = p.cluster_shape_mn[1] if p.raster_along_m else p.cluster_shape_mn[0]
            self.assertEqual(math.ceil(tiles / along) % p.swizzle_size, 0, p)

    def test_preact_plans_fill_shared_memory(self):
        # The pre-activation Z is staged beside D: the planner counts it (a float32 Z of a 128-row
        # epilogue ring is 32 KiB, an A/B stage of a 256x256 tile), then fills the rest.
        for shape, out in itertools.product(
            ((8192, 8192, 8192), (256, 8192, 8192), (64, 4096, 4096), (1000, 1000, 1000)),
            ("bfloat16", "float32"),
        ):  # fmt: skip
            p = jax_sm100.plan(*shape, a_dtype="bfloat16", b_dtype="bfloat16", out_dtype=out,
                               preact_out=True)  # fmt: skip
            with self.subTest(shape=shape, out=out):
                self.assertEqual(p.kernel, planning.KERNEL_SM100, p.reason)
                self.assertTrue(p.preact_out)
                self._check(p)

    def test_kernel_choice(self):
        bf = {"a_dtype": "bfloat16", "b_dtype": "bfloat16"}
        self.assertEqual(jax_sm100.plan(8192, 8192, 8192, **bf).kernel, "sm100_tcgen05")
        big = jax_sm100.plan(8192, 8192, 8192, **bf)
        self.assertTrue(big.use_2cta)
        self.assertEqual(big.mma_tiler_mnk, (256, 256, 64))
        h = jax_sm100.plan(8192, 8192, 8192, arch="sm_90a", **bf)
        self.assertEqual(
            (h.kernel, h.cta_tile_mnk, h.pingpong), ("sm90_wgmma", (128, 192, 64), True)
        )
        h = jax_sm100.plan(4096, 4096, 4096, arch="sm_90a", **bf)
        self.assertEqual(
            (h.kernel, h.cta_tile_mnk, h.pingpong), ("sm90_wgmma", (128, 256, 64), False)
        )
        skinny = jax_sm100.plan(64, 4096, 4096, arch="sm_90a", **bf)
        self.assertEqual(skinny.kernel, "sm90_wgmma_splitk")
        self.assertGreater(skinny.split_k, 1)
        self.assertIn("split-K", skinny.reason)

    def test_fallback_reasons(self):
        odd = jax_sm100.plan(64, 64, 1001, a_dtype="bfloat16", b_dtype="bfloat16")
        self.assertEqual(odd.kernel, "xla_dot")
        self.assertIn("k=1001", odd.reason)
        self.assertIn("multiple of 8", odd.reason)
        # 1004 bf16 (2008 bytes): 8-byte aligned, not 16 (k=1001 is neither); forced too.
        for arch in ("sm_90a", "sm_100a"):
            even = jax_sm100.plan(64, 64, 1004, a_dtype="bfloat16", b_dtype="bfloat16",
                                  arch=arch, force_kernel=True)  # fmt: skip
            self.assertEqual(even.kernel, "xla_dot")
            self.assertIn("k=1004 (2008 bytes of bfloat16) is not a multiple of 16", even.reason)
        # C's rows are checked as well: n = 4 bfloat16 beside a float32 D.
        c_rows = jax_sm100.plan(128, 4, 64, a_dtype="bfloat16", b_dtype="bfloat16",
                                out_dtype="float32", c_dtype="bfloat16", b_major="k",
                                arch="sm_90a", force_kernel=True)  # fmt: skip
        self.assertEqual(c_rows.kernel, "xla_dot")
        self.assertIn("c's contiguous dim n=4", c_rows.reason)
        # nvfp4 rows of 48 elements are 24 bytes: no TMA, whatever the block.
        e2m1 = "float4_e2m1fn"
        fp4 = jax_sm100.plan(256, 256, 48, a_dtype=e2m1, b_dtype=e2m1, scale_block=16,
                             scale_dtype="float8_e4m3fn", arch="sm_100a")  # fmt: skip
        self.assertEqual(fp4.kernel, "xla_dot")
        self.assertIn("16 bytes of float4_e2m1fn rows", fp4.reason)
        mixed = jax_sm100.plan(64, 64, 64, a_dtype="bfloat16", b_dtype="float16")
        self.assertIn("mixed operand dtypes", mixed.reason)
        fp8 = jax_sm100.plan(
            64, 64, 64, a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn", arch="sm_90a"
        )
        self.assertIn("B is n-major (matmul and dot_general transpose such operands", fp8.reason)
        self.assertNotIn("A is", fp8.reason)
        # An M-major A is named as such, not blamed on a K-major B.
        fp8_a = jax_sm100.plan(
            64, 64, 64, a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn", arch="sm_90a",
            a_major="m", b_major="k",
        )  # fmt: skip
        self.assertIn("A is m-major (matmul", fp8_a.reason)
        self.assertNotIn("B is", fp8_a.reason)
        fp8_t = jax_sm100.plan(
            64, 64, 64, a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn", arch="sm_90a",
            b_major="k", force_kernel=True,
        )  # fmt: skip
        self.assertEqual(fp8_t.kernel, "sm90_wgmma")
        self.assertEqual(fp8_t.mma_tiler_mnk[2], 128)

    @parameterized.named_parameters(
        # (problem, the planner's kernel, the kernel plan(..., force_kernel=True) gives)
        # 2 * 1024 * 4096 * 1024 = 2**33 FLOPs: at SM90_MIN_FLOPS.
        ("at_the_floor", dict(m=1024, n=4096, k=1024), "sm90_wgmma", "sm90_wgmma"),
        ("under_the_floor", dict(m=1024, n=1024, k=1024), "xla_dot", "sm90_wgmma"),
        # Split-K plans have the lower floor, SM90_SPLITK_MIN_FLOPS: 2**31 FLOPs keep the
        # kernel, 2**25 do not.
        ("skinny_split_k", dict(m=64, n=4096, k=4096), "sm90_wgmma_splitk", "sm90_wgmma_splitk"),
        ("tiny_split_k", dict(m=64, n=64, k=4096), "xla_dot", "sm90_wgmma_splitk"),
        # The floor counts the whole batch: 16 GEMMs of 2**30 FLOPs each.
        ("batched", dict(m=512, n=1024, k=1024, batch=16), "sm90_wgmma", "sm90_wgmma"),
        ("one_of_the_batch", dict(m=512, n=1024, k=1024), "xla_dot", "sm90_wgmma"),
        # sm_100a plans are not affected.
        ("sm100", dict(m=128, n=128, k=128, arch="sm_100a"), "sm100_tcgen05", "sm100_tcgen05"),
    )
    def test_small_sm90_problems_run_on_xla(self, problem, kernel, forced_kernel):
        kw = dict(a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a") | problem
        p = jax_sm100.plan(**kw)
        forced = jax_sm100.plan(**kw, force_kernel=True)
        self.assertEqual(p.kernel, kernel, p.reason)
        self.assertEqual(forced.kernel, forced_kernel, forced.reason)
        if kernel == planning.KERNEL_XLA:
            self.assertIn("small problem", p.reason)
            self.assertIn("force_kernel=True", p.reason)
            self.assertEqual(p.split_k, 1)
        else:
            self.assertEqual(p, forced)

    @parameterized.product(dtype=("float8_e4m3fn", "bfloat16"),
                           case=(((512, 512, 65536), 1, 8), ((512, 512, 16384), 1, 8),
                                 ((1024, 512, 32768), 1, 4), ((768, 512, 16384), 1, 4),
                                 ((512, 768, 16384), 1, 4), ((512, 512, 8192), 1, 1),
                                 ((1024, 1024, 65536), 1, 1),
                                 # a batch, whose splits the kernel's batch mode cannot take
                                 ((512, 512, 65536), 2, 1),
                                 # 5 tile rows in 2x1 clusters: padded CTAs would run splits
                                 ((264, 384, 65536), 1, 1),
                                 # under SM90_MIN_FLOPS: XLA's dot, as unsplit
                                 ((304, 304, 16384), 1, 1)))  # fmt: skip
    def test_wide_problems_of_few_tiles_split_a_long_k(self, dtype, case):
        # m > 256 with few output tiles: split in 128 x 128 tiles into about one wave of CTAs,
        # each split keeping >= 2048 of k (512 x 512 x 65536 ran 32 of 132 SMs unsplit, 0.45x
        # cuBLAS in fp8; 64 x 128 tiles split 4 ways 0.87x; 128 x 128 tiles split into a wave
        # ran faster at every shape measured). Shorter k, tiles enough for the SMs, a batch, a
        # padded cluster or a small problem: as before.
        shape, batch, split = case
        kw = dict(a_dtype=dtype, b_dtype=dtype, b_major="k", arch="sm_90a", batch=batch)
        p = jax_sm100.plan(*shape, **kw)
        self.assertEqual(p.split_k, split, p.reason)
        if split > 1:
            self.assertEqual(p.kernel, planning.KERNEL_SM90_SPLITK)
            self.assertIn(f"split-K x{split}", p.reason)
            self.assertEqual(p.cta_tile_mnk[:2], sm90.SPLIT_WIDE_TILE)
            self.assertGreaterEqual(shape[2] // split, sm90.SPLIT_WIDE_MIN_K)
            tiles = math.prod(-(-d // t) for d, t in zip(shape[:2], p.cta_tile_mnk, strict=False))
            self.assertLessEqual(tiles * split, p.num_sms)
            self.assertGreater(tiles * split * 2, p.num_sms)
        elif 2 * math.prod(shape) * batch < sm90.SM90_MIN_FLOPS:
            self.assertEqual(p.kernel, planning.KERNEL_XLA)
        else:
            # The unsplit plan's cluster pads no tile it need not (`_unpadded_cluster`).
            self.assertEqual(p.kernel, planning.KERNEL_SM90)

    @parameterized.parameters("float8_e4m3fn", "bfloat16")
    def test_wide_splits_keep_the_planners_tile_where_128_rows_pad(self, dtype):
        # Re-tiling in 128 x 128 is for grids it pads no more: 257 rows keep their 64 x 128
        # split (a third 128-row tile would hold one row), as the sixty-fifth session planned
        # it; problems that did not split (k under 2 x SPLIT_K_MIN_K_WIDE here) still do not.
        kw = dict(a_dtype=dtype, b_dtype=dtype, b_major="k", arch="sm_90a")
        p = jax_sm100.plan(257, 768, 24576, **kw)
        self.assertEqual((p.cta_tile_mnk[:2], p.split_k), ((64, 128), 2), p.reason)
        p = jax_sm100.plan(640, 640, 12288, **kw)
        self.assertEqual((p.kernel, p.split_k), (planning.KERNEL_SM90, 1), p.reason)

    @parameterized.product(dtype=("float8_e4m3fn", "bfloat16"),
                           case=(((256, 2048, 16384), 1, (128, 128), 4),
                                 ((256, 4096, 16384), 1, (128, 128), 2),
                                 ((255, 4096, 8192), 1, (128, 128), 2),
                                 ((256, 1024, 32768), 1, (128, 128), 8),
                                 # one 128-row tile: 64-row tiles kept (measured no slower)
                                 ((128, 4096, 16384), 1, (64, 128), 2),
                                 # 192 rows: 128-row tiles would pad a third of the output
                                 ((192, 4096, 16384), 1, (64, 128), 1),
                                 # 17 tile columns: the 1x2 cluster would pad
                                 ((256, 2176, 16384), 1, (64, 128), 1),
                                 # a batch
                                 ((256, 2048, 16384), 2, (64, 128), 1),
                                 # the shortest k re-tiled: 2 splits of 4096, 128 CTAs as
                                 # the 128 unsplit 64 x 128 tiles planned
                                 ((256, 4096, 8192), 1, (128, 128), 2),
                                 # splits of 2048 (unmeasured): the planner's plan
                                 ((256, 4096, 4096), 1, (64, 128), 1),
                                 # tiles enough for the SMs unsplit: the planner's
                                 ((256, 8192, 16384), 1, (128, 128), 1)))  # fmt: skip
    def test_skinny_problems_of_two_tile_rows_split_in_128_row_tiles(self, dtype, case):
        # 192 < m <= 256, one GEMM of >= SM90_MIN_FLOPS: re-tiled in 128 x 128 and split into
        # about one wave, each split keeping >= 4096 of k, where that runs as many CTAs as the
        # planner's 64 x 128 plan and pads nothing more (H100, bfloat16 256x2048x16384 0.973x
        # cuBLAS against 0.823; fp8 256x4096x16384 0.977 against 0.863 unsplit).
        shape, batch, tile, split = case
        kw = dict(a_dtype=dtype, b_dtype=dtype, b_major="k", arch="sm_90a", batch=batch)
        p = jax_sm100.plan(*shape, **kw)
        self.assertEqual((p.cta_tile_mnk[:2], p.split_k), (tile, split), p.reason)
        if split > 1 and tile == sm90.SPLIT_WIDE_TILE:
            self.assertEqual(p.kernel, planning.KERNEL_SM90_SPLITK)
            self.assertGreaterEqual(shape[2] // split, sm90.SPLIT_SKINNY_MIN_K)
            self.assertEqual(p.cluster_shape_mn, (1, 2))

    def test_skinny_re_tile_runs_no_fewer_ctas(self):
        # On 264 SMs the planner's 64 x 128 tiles split 8 ways run 256 CTAs; 128 x 128 tiles
        # keeping 4096 of k a split could run only 128, so the planner's plan stands (on 132
        # SMs both run 128 and the re-tile is taken).
        kw = dict(a_dtype="bfloat16", b_dtype="bfloat16", b_major="k", arch="sm_90a")
        p = jax_sm100.plan(256, 1024, 32768, **kw, num_sms=264)
        self.assertEqual((p.cta_tile_mnk[:2], p.split_k), ((64, 128), 8), p.reason)
        p = jax_sm100.plan(256, 1024, 32768, **kw, num_sms=132)
        self.assertEqual((p.cta_tile_mnk[:2], p.split_k), ((128, 128), 8), p.reason)


class DslWorkedExamplesTest(parameterized.TestCase):
    """The documented examples of the helpers the planner builds on."""

    @parameterized.parameters(
        ((128, 256, False, 16, None), (128, 32)),
        ((128, 256, False, 16, 16), (128, 64)),
        ((128, 128, False, 32, 32), (128, 16)),
        ((64, 128, True, 16, None), (64, 64)),
        ((128, 256, False, 4, None), (128, 64)),
    )
    def test_epilogue_tile_size(self, args, want):
        self.assertEqual(tuple(cu.sm100.compute_epilogue_tile_size(*args)), want)

    def test_plan_uses_them(self):
        # CTA 128x256 with 16-bit D and no C: epilogue subtile (128, 32); with 16-bit C, n=64.
        p = jax_sm100.plan(4096, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16")
        p = dataclasses.replace(
            p,
            mma_tiler_mnk=(128, 256, 64),
            use_2cta=False,
            cluster_shape_mn=(1, 1),
            num_ab_stages=3,
        )
        self.assertEqual(p.cta_tile_mnk, (128, 256, 64))
        self.assertEqual(p.epi_tile, (128, 32))
        with_c = dataclasses.replace(p, c_dtype="bfloat16")
        self.assertEqual(with_c.epi_tile, (128, 64))

    @parameterized.parameters(
        ((128, 256, False, 256, False), 256),
        ((64, 256, False, 128, False), 128),
        ((64, 256, True, 256, False), 128),
    )
    def test_tmem_cols(self, args, want):
        self.assertEqual(cu.sm100.compute_acc_tmem_cols_per_stage(*args), want)


class PlanEditsTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        self.p = jax_sm100.plan(8192, 8192, 8192, a_dtype="bfloat16", b_dtype="bfloat16")

    def test_legal_edit_rederives(self):
        # One stage fewer still keeps one CTA per SM (the 2-CTA 256x256 plan takes all of TMEM).
        fewer = self.p.num_ab_stages - 1
        q = dataclasses.replace(self.p, num_ab_stages=fewer)
        self.assertEqual(q.num_ab_stages, fewer)
        self.assertLess(q.smem_bytes, self.p.smem_bytes)
        q = dataclasses.replace(
            self.p, mma_tiler_mnk=(128, 128, 64), use_2cta=False, cluster_shape_mn=(1, 1)
        )
        self.assertEqual(q.cta_tile_mnk, (128, 128, 64))
        self.assertEqual(q.acc_tmem_cols_per_stage, 128)

    @parameterized.named_parameters(
        ("stages_overflow_smem", {"num_ab_stages": 40}, "shared memory"),
        ("one_stage", {"num_ab_stages": 1}, "at least 2 stages"),
        ("tmem_overflow", {"num_acc_stages": 3}, "TMEM allocation"),
        # Two stages leave room for a second CTA per SM, which would wait for the first's 512
        # TMEM columns (issue 21).
        ("two_ctas_share_tmem", {"num_ab_stages": 2}, "2 CTAs of this plan fit on one SM"),
        ("max_clusters_negative", {"max_clusters": -1}, "max_clusters"),
        ("bad_mma_m", {"mma_tiler_mnk": (96, 256, 64)}, "M in"),
        ("bad_mma_n", {"mma_tiler_mnk": (256, 250, 64)}, "multiple of 16"),
        ("bad_k_tile", {"mma_tiler_mnk": (256, 256, 32)}, "128 bytes"),
        ("odd_cluster_2cta", {"cluster_shape_mn": (1, 2)}, "cluster M must be even"),
        ("cluster_not_pow2", {"cluster_shape_mn": (3, 1)}, "powers of two"),
        ("huge_cluster", {"cluster_shape_mn": (8, 4)}, "at most 16"),
        ("wrong_arch_kernel", {"kernel": "sm90_wgmma"}, "sm_90a only"),
        ("unknown_kernel", {"kernel": "cublas"}, "must be one of"),
        ("split_without_kernel", {"split_k": 4}, "split_k"),
        ("unaligned_k", {"k": 8191}, "16 bytes"),
        ("bad_arch", {"arch": "sm_80"}, "not supported"),
        ("pingpong_on_sm100", {"pingpong": True}, "sm_90a"),
        ("no_acc_stage", {"num_acc_stages": 0}, "must be >= 1"),
        # Depths and flags of any edit (the DSL raised on the first two at compile time; the
        # others read as True).
        ("no_epi_stage", {"num_epi_stages": -1}, r"num_epi_stages=-1 must be >= 1"),
        ("no_swizzle", {"swizzle_size": 0}, r"swizzle_size=0 must be >= 1"),
        ("flag_word", {"raster_along_m": "no"}, "raster_along_m='no' must be a bool"),
        ("flag_int", {"use_2cta": 1}, "use_2cta=1 must be a bool"),
        ("epi_n_on_sm100", {"epi_n": 64}, "epi_n=64 is an sm_90a choice"),
        ("stage_c_on_sm100", {"stage_c": True}, "stage_c=True is an sm_90a choice"),
        # cta_group::2 MMAs are 128 or 256 rows (64 rows per CTA do not exist).
        ("two_cta_m64", {"mma_tiler_mnk": (64, 256, 64)}, r"2-CTA MMA needs M in \(128, 256\)"),
    )
    def test_illegal_edit_raises(self, change, pattern):
        with self.assertRaisesRegex(C.PlanError, pattern):
            dataclasses.replace(self.p, **change)

    @parameterized.parameters(
        # (MMA tile, use_2cta, cluster, accumulator stages, TMEM columns): 1-CTA M=64 takes N in
        # steps of 8; accumulators narrower than TMEM's smallest allocation take its 32 columns.
        ((64, 8, 64), False, (1, 1), 2, 32),
        ((64, 24, 64), False, (1, 1), 2, 64),
        ((128, 16, 64), False, (1, 1), 1, 32),
        ((256, 16, 64), True, (2, 1), 1, 32),
    )
    def test_narrow_tiles(self, tile, use_2cta, cluster, acc_stages, cols):
        q = planning.replace_fitting(
            self.p, mma_tiler_mnk=tile, use_2cta=use_2cta, cluster_shape_mn=cluster,
            num_acc_stages=acc_stages,
        )  # fmt: skip
        self.assertEqual((q.mma_tiler_mnk, q.tmem_alloc_cols), (tile, cols))
        self.assertEqual(q.acc_tmem_cols_per_stage, tile[1])
        if tile == (64, 8, 64):
            # The narrowest tile builds (the kernel refuses shared storage past a CTA's).
            compile_mod._compile(q, KernelSpec.for_plan(q))

    def test_largest_clusters(self):
        # sm_100a takes non-portable clusters of 16 CTAs (the DSL allows them on every kernel);
        # sm_90a portable ones of 8. 32 is refused (huge_cluster above).
        for shape in ((4, 4), (2, 8), (16, 1)):
            self.assertEqual(dataclasses.replace(self.p, cluster_shape_mn=shape).cluster_shape_mn,
                             shape)  # fmt: skip
        h = jax_sm100.plan(4096, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16",
                           arch="sm_90a")  # fmt: skip
        with self.assertRaisesRegex(C.PlanError, "at most 8"):
            dataclasses.replace(h, cluster_shape_mn=(4, 4))

    def test_resident_ctas_count_the_system_reserve(self):
        # 228 KB of shared memory per SM, 1 KB of it kept by the system for each resident CTA:
        # two CTAs of up to 113 KB (115712 bytes) each share an SM, one of a byte more does not.
        threads = C.sm100_threads_per_cta(False)
        self.assertEqual(C.max_resident_ctas(115712, threads), 2)
        self.assertEqual(C.max_resident_ctas(115713, threads), 1)
        # 512 TMEM columns each: two would wait on each other (issue 21), one is legal.
        C.check_tmem_residency(512, 115713, threads)
        with self.assertRaisesRegex(C.PlanError, "2 CTAs of this plan fit"):
            C.check_tmem_residency(512, 115712, threads)

    def test_fp8_n_major_b_steps(self):
        # The DSL's tcgen05 rule: an 8-bit N-major B takes N in steps of 32 (2-CTA) or 16 (1-CTA).
        p = jax_sm100.plan(4096, 4096, 4096, a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn")
        self.assertEqual(p.b_major, "n")
        with self.assertRaisesRegex(C.PlanError, r"multiple of 32.*N-major float8_e4m3fn B"):
            dataclasses.replace(p, mma_tiler_mnk=(256, 48, 128), use_2cta=True,
                                cluster_shape_mn=(2, 1))  # fmt: skip
        with self.assertRaisesRegex(C.PlanError, "multiple of 16"):
            dataclasses.replace(p, mma_tiler_mnk=(128, 24, 128), use_2cta=False)
        k_major = dataclasses.replace(p, b_major="k", mma_tiler_mnk=(256, 48, 128), use_2cta=True,
                                      cluster_shape_mn=(2, 1))  # fmt: skip
        self.assertEqual(k_major.mma_tiler_mnk[1], 48)

    def test_planner_keeps_one_cta_per_sm_where_tmem_is_over_half(self):
        for m, n, k, dtype, c in itertools.product(
            (64, 256, 1024, 4096, 16384), (128, 1024, 4096, 14336), (256, 4096),
            ("bfloat16", "float32", "float8_e4m3fn"), (None, "bfloat16"),
        ):  # fmt: skip
            p = jax_sm100.plan(m, n, k, a_dtype=dtype, b_dtype=dtype, c_dtype=c)
            threads = C.sm100_threads_per_cta(c is not None)
            resident = C.max_resident_ctas(p.smem_bytes, threads)
            self.assertLessEqual(p.tmem_alloc_cols * resident, C.TMEM_MAX_COLS, str(p))
            if p.tmem_alloc_cols > 256:
                self.assertEqual(resident, 1, str(p))
            self.assertEqual(planning.resident_clusters(p), p.num_sms * resident // (
                p.cluster_shape_mn[0] * p.cluster_shape_mn[1]))  # fmt: skip

    def test_derived_fields_not_editable(self):
        with self.assertRaisesRegex(ValueError, "init=False"):
            dataclasses.replace(self.p, smem_bytes=1)

    def test_frozen_and_hashable(self):
        with self.assertRaises(dataclasses.FrozenInstanceError):
            self.p.m = 3
        self.assertEqual(hash(self.p), hash(dataclasses.replace(self.p)))

    def test_str_is_complete(self):
        text = str(self.p)
        for f in dataclasses.fields(self.p):
            if f.name not in (
                "m",
                "n",
                "k",
                "batch",
                "a_dtype",
                "b_dtype",
                "out_dtype",
                "c_dtype",
                "a_major",
                "b_major",
                "raster_along_m",
                "swizzle_size",
                "num_sms",
            ):
                self.assertIn(f.name, text)
        self.assertIn("8192 x 8192", text)
        self.assertIn("sm100_tcgen05", text)

    def test_bad_inputs(self):
        with self.assertRaisesRegex(C.PlanError, "m=0"):
            jax_sm100.plan(0, 4, 4, a_dtype="bfloat16", b_dtype="bfloat16")
        with self.assertRaisesRegex(TypeError, "integer dtype int32"):
            jax_sm100.plan(4, 4, 4, a_dtype="int32", b_dtype="bfloat16")
        with self.assertRaisesRegex(C.PlanError, "not supported"):
            jax_sm100.plan(4, 4, 4, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_89")

    def test_dtype_arguments_raise_naming_the_argument(self):
        bf16 = dict(a_dtype="bfloat16", b_dtype="bfloat16")
        for arch in ("sm_90a", "sm_100a"):
            # A result dtype no kernel writes: a TypeError naming the argument (it was a bare
            # KeyError from the planner's bit table), dense and block-scaled.
            for bad in ("int32", "bool", "complex64"):
                with self.assertRaisesRegex(TypeError, rf"jax_sm100.plan: out_dtype is .*{bad}"):
                    jax_sm100.plan(128, 128, 128, **bf16, out_dtype=bad, arch=arch)
            with self.assertRaisesRegex(TypeError, "jax_sm100.plan: out_dtype is .*int32"):
                jax_sm100.plan(
                    256, 256, 256, a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn",
                    scale_dtype="float32", scale_block=128, out_dtype="int32", arch=arch,
                )  # fmt: skip
            # An fp8 result, which scaled_matmul refuses: it had planned XLA's ops.
            scaled_args = dict(a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn",
                               scale_dtype="float32", scale_block=128, arch=arch)  # fmt: skip
            with self.assertRaisesRegex(TypeError, "out_dtype='float8_e4m3fn' is not one of"):
                jax_sm100.plan(256, 256, 256, **scaled_args, out_dtype="float8_e4m3fn")
            # b_scale_rows is 1 or 128 as an int: True and 128.0 compare equal to them.
            for bad in (True, 128.0):
                with self.assertRaisesRegex(C.PlanError, "b_scale_rows=.* must be one of"):
                    jax_sm100.plan(256, 256, 256, **scaled_args, b_scale_rows=bad)
            with self.assertRaisesRegex(TypeError, r"a_dtype is .*int8.* e.g. a_dtype=jnp"):
                jax_sm100.plan(128, 128, 128, a_dtype="int8", b_dtype="int8", arch=arch)
            # None is not a dtype here (np.dtype(None) is float64: it planned a float64 GEMM).
            with self.assertRaisesRegex(TypeError, r"a_dtype is None; pass a dtype"):
                jax_sm100.plan(128, 128, 128, a_dtype=None, b_dtype="bfloat16", arch=arch)
            with self.assertRaisesRegex(TypeError, r"a_dtype is None; pass one of"):
                jax_sm100.plan(256, 256, 256, a_dtype=None, b_dtype="float8_e4m3fn",
                               scale_dtype="float32", scale_block=128, arch=arch)  # fmt: skip
            # nvfp4 data without scales: the fix is the scales, not a cast.
            with self.assertRaisesRegex(TypeError, "runs only block-scaled: pass scale_dtype="):
                jax_sm100.plan(
                    128, 128, 128, a_dtype="float4_e2m1fn", b_dtype="float4_e2m1fn", arch=arch
                )
        with self.assertRaisesRegex(C.PlanError, "a grouped problem has batch=1.*pass batch=1"):
            jax_sm100.plan(4096, 4096, 4096, **bf16, groups=4, ragged="m", batch=2)
        # The grouped kernels read no C and write no pre-activation: said up front on both
        # archs (sm_100a's planner then refused its own stages, over shared memory).
        unread = ({"c_dtype": "bfloat16"}, {"preact_out": True})
        for arch, extra in itertools.product(("sm_90a", "sm_100a"), unread):
            with self.assertRaisesRegex(C.PlanError, "grouped kernels read no C.*drop c_dtype"):
                jax_sm100.plan(4096, 2048, 1024, **bf16, groups=8, ragged="m", arch=arch, **extra)
        with self.assertRaisesRegex(TypeError, r"precompile: the out dtype is .*int32"):
            jax_sm100.precompile([(128, 128, 128)], dtypes=("bfloat16", "bfloat16", "int32"))


class Sm90ScheduleTest(parameterized.TestCase):
    """Ping-pong plans and `sm90_variant`, the tuning edit that refills A/B stages."""

    def setUp(self):
        super().setUp()
        # 3.9 waves of 128x256 tiles: the cooperative schedule (ping-pong needs 8).
        self.p = planning.plan(
            4096, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a"
        )

    def test_no_pair_over_an_odd_tile_count(self):
        # The scheduler runs whole clusters: a pair over 3 tile columns runs 4 (the fourth on
        # zero-filled tiles). 16384x768 in 128x256 tiles pairs along M instead of N, and no
        # cooperative, unsplit plan of a sweep adds more than CLUSTER_PAD_MAX of its tiles
        # (ping-pong plans keep their measured 2x1 clusters).
        p = planning.plan(16384, 768, 2048, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
        self.assertEqual((p.cta_tile_mnk[:2], p.cluster_shape_mn), ((128, 256), (2, 1)))
        for m, n in itertools.product((1024, 4096, 16384, 65536), (768, 1280, 1408, 1792, 4096)):
            for dtype in ("bfloat16", "float8_e4m3fn"):
                p = planning.plan(m, n, 4096, a_dtype=dtype, b_dtype=dtype, out_dtype="bfloat16",
                                  arch="sm_90a", b_major="k", force_kernel=True)  # fmt: skip
                if p.pingpong or p.split_k > 1:
                    continue
                tm, tn = p.cta_tile_mnk[:2]
                pad = sm90._cluster_pad(math.ceil(m / tm), math.ceil(n / tn), p.cluster_shape_mn)
                self.assertLessEqual(pad, sm90.CLUSTER_PAD_MAX, (m, n, dtype, p.cluster_shape_mn))

    def test_planner_default_is_cooperative(self):
        self.assertFalse(self.p.pingpong)
        self.assertEqual(self.p.epi_tile, (128, 32))
        self.assertIn("pingpong", str(self.p))

    @parameterized.parameters(((128, 192), 5), ((128, 128), 6), ((64, 256), 5))
    def test_variant_refills_stages(self, tile, stages):
        # (Swizzle 8 asked for: 128x192 leaves 22 cluster columns, where the variant drops it.)
        q = planning.sm90_variant(
            self.p, tile_mn=tile, pingpong=True, cluster_mn=(1, 2), swizzle_size=8
        )
        self.assertTrue(q.pingpong)
        self.assertEqual(q.cta_tile_mnk[:2], tile)
        self.assertEqual(q.cluster_shape_mn, (1, 2))
        # One 64-row MMA block per epilogue sub-tile, and buffers for both warp groups.
        self.assertEqual(q.epi_tile, (64, 32))
        epi = planning.epi_smem_bytes("sm_90a", (64, 32), 2, "bfloat16", None, 1, True)
        self.assertEqual(epi, 2 * 2 * 64 * 32 * 2)
        self.assertEqual(q.num_ab_stages, stages)
        # What the A/B ring leaves deepens the epilogue's store ring, one stage (epi / 2) each.
        free = planning.smem_capacity("sm_90a") - C.SMEM_RESERVED_BYTES
        left = free - epi - stages * q.ab_stage_bytes
        depth = min(planning.SM90_MAX_EPI_STAGES, 2 + left // (epi // 2))
        self.assertGreater(self.p.swizzle_size, 1)
        self.assertEqual(q.num_epi_stages, depth)
        self.assertEqual(
            q.smem_bytes, C.SMEM_RESERVED_BYTES + epi * depth // 2 + stages * q.ab_stage_bytes
        )
        self.assertLessEqual(q.smem_bytes, planning.smem_capacity("sm_90a"))
        with self.assertRaisesRegex(C.PlanError, "shared memory"):
            dataclasses.replace(q, num_ab_stages=stages + 1)

    def test_planner_deepens_epilogue_ring_with_left_smem(self):
        # 128x256 bf16: 4 A/B stages of 48 KB beside 2 x 8 KB leave 18 KB: two more 8 KB stages.
        self.assertEqual((self.p.num_ab_stages, self.p.num_epi_stages), (4, 4))
        self.assertEqual(self.p.smem_bytes, C.SMEM_RESERVED_BYTES + 4 * 8192 + 4 * 49152)
        # A float32 output's 16 KB sub-tiles leave too little for a third stage.
        p32 = planning.plan(8192, 8192, 8192, a_dtype="bfloat16", b_dtype="bfloat16",
                            out_dtype="float32", arch="sm_90a")  # fmt: skip
        self.assertEqual((p32.num_ab_stages, p32.num_epi_stages), (4, 2))
        # Without a swizzled raster the ring stays 2 deep (measured no faster there).
        p1 = planning.plan(4096, 8192, 4096, a_dtype="bfloat16", b_dtype="bfloat16",
                           arch="sm_90a")  # fmt: skip
        self.assertEqual((p1.swizzle_size, p1.num_ab_stages, p1.num_epi_stages), (1, 4, 2))
        # An explicit depth is kept and the A/B ring refilled around it.
        q = planning.sm90_variant(self.p, num_epi_stages=8)
        self.assertEqual((q.num_ab_stages, q.num_epi_stages), (3, 8))

    def test_variant_keeps_other_fields(self):
        q = planning.sm90_variant(self.p, swizzle_size=2, raster_along_m=False)
        self.assertEqual((q.swizzle_size, q.raster_along_m), (2, False))
        self.assertEqual(q.cta_tile_mnk, self.p.cta_tile_mnk)
        self.assertEqual(q.num_ab_stages, self.p.num_ab_stages)
        # A/B stages asked for are kept (a raw TypeError of dataclasses.replace before), and a
        # depth that does not fit is a PlanError.
        self.assertEqual(planning.sm90_variant(self.p, num_ab_stages=3).num_ab_stages, 3)
        with self.assertRaisesRegex(planning.C.PlanError, "shared memory"):
            planning.sm90_variant(self.p, num_ab_stages=40)

    def test_with_split(self):
        p = planning.plan(64, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
        self.assertEqual((p.kernel, p.split_reduce), (planning.KERNEL_SM90_SPLITK, "xla"))
        # In-cluster: the (1, split) cluster, and the float32 partial tile in shared memory.
        q = planning.with_split(p, 8, reduce="cluster")
        self.assertEqual((q.split_k, q.cluster_shape_mn, q.split_reduce), (8, (1, 8), "cluster"))
        tm, tn, _ = q.cta_tile_mnk
        red = tm * (tn + C.SPLITK_ROW_PAD) * 4
        self.assertEqual(
            q.smem_bytes, C.SMEM_RESERVED_BYTES + red + q.num_ab_stages * q.ab_stage_bytes
        )
        self.assertGreater(q.smem_bytes + q.ab_stage_bytes, planning.smem_capacity("sm_90a"))
        # Unsplit: the plain SM90 kernel.
        u = planning.with_split(q, 1)
        self.assertEqual(
            (u.kernel, u.split_k, u.cluster_shape_mn), (planning.KERNEL_SM90, 1, (1, 1))
        )
        # An XLA-reduced split keeps the plan's cluster (it multicasts like an unsplit plan).
        self.assertEqual(planning.with_split(p, 2).cluster_shape_mn, p.cluster_shape_mn)

    @parameterized.named_parameters(
        ("cluster_not_1xS", {"cluster_shape_mn": (2, 1)}, r"cluster_shape_mn=\(1, 4\)"),
        ("pingpong", {"pingpong": True}, "cooperative"),
        ("unknown_reduce", {"split_reduce": "atomics"}, "must be one of"),
    )
    def test_cluster_split_rules(self, change, msg):
        p = planning.plan(64, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
        q = planning.with_split(p, 4, reduce="cluster")
        with self.assertRaisesRegex(C.PlanError, msg):
            dataclasses.replace(q, **change)

    @parameterized.parameters((128, 256), (256, 128))
    def test_pingpong_tile_too_big(self, tm, tn):
        with self.assertRaisesRegex(C.PlanError, "one warp group's registers"):
            planning.sm90_variant(self.p, tile_mn=(tm, tn), pingpong=True)

    @parameterized.named_parameters(
        # (m, n, k): ~15.5 waves of 66 clusters of 2 -> stream-K; 3.9 waves (measured slower
        # with it) and a wave that divides evenly -> none. The cooperative plans: with 16-bit
        # outputs, problems of 8 waves or more take the ping-pong schedule (see below), and
        # float32 outputs keep the cooperative one.
        ("waves_15_5", (16384, 4096, 4096), True),
        ("waves_15_5_square", (8192, 8192, 8192), True),
        ("waves_13_6", (4096, 14336, 4096), True),
        ("waves_3_9", (4096, 4096, 4096), False),
        ("one_wave", (2048, 2048, 2048), False),
        ("waves_16_even", (128 * 16 * 66 * 2 // 16, 4096, 4096), False),
    )
    def test_stream_k_choice(self, shape, want):
        bf = dict(a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
        p = planning.cooperative(planning.plan(*shape, **bf))
        self.assertEqual(planning.plan(*shape, out_dtype="float32", **bf).stream_k, want)
        self.assertEqual(p.kernel, planning.KERNEL_SM90)
        self.assertFalse(p.pingpong)
        self.assertEqual(p.stream_k, want, p)
        self.assertEqual("stream-K" in p.reason, want)
        self.assertIn(f"stream_k                 {want}", str(p))
        # fp8 operands never (SM90_STREAM_K_MIN_AB_BITS: measured slower at 15.5 waves).
        # (Their cooperative plans: short-k fp8 problems of many waves plan ping-pong.)
        f8 = planning.cooperative(
            planning.plan(*shape, a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn",
                          out_dtype="bfloat16", b_major="k", arch="sm_90a")
        )  # fmt: skip
        coop_f8 = (planning.KERNEL_SM90, False, False)
        self.assertEqual((f8.kernel, f8.pingpong, f8.stream_k), coop_f8, f8)

    @parameterized.named_parameters(
        # (m, n, k, tile N): of 128x160 and 128x192, the one whose last wave wastes least.
        ("tall", (16384, 4096, 4096), 160),
        ("square", (8192, 8192, 8192), 192),
        ("wide", (4096, 14336, 4096), 160),
        ("batched", (4, 4096, 4096, 2048), 160),
    )
    def test_pingpong_choice(self, shape, tn):
        *batch, m, n, k = shape
        p = planning.plan(m, n, k, a_dtype="float16", b_dtype="float16", arch="sm_90a",
                          batch=batch[0] if batch else 1)  # fmt: skip
        self.assertEqual(
            (p.kernel, p.cta_tile_mnk[:2], p.pingpong), ("sm90_wgmma", (128, tn), True)
        )
        self.assertEqual((p.cluster_shape_mn, p.raster_along_m, p.swizzle_size), ((2, 1), False, 8))
        self.assertEqual((p.stream_k, p.num_epi_stages), (False, planning.SM90_PINGPONG_EPI_STAGES))
        self.assertIn("ping-pong", p.reason)
        self.assertIn("raster                   along N, swizzle 8", str(p))
        # 8 cluster rows do not divide 33: no swizzle (the scheduler would pad the rows).
        odd = planning.plan(8200, 8200, 1000, a_dtype="bfloat16", b_dtype="bfloat16",
                            arch="sm_90a")  # fmt: skip
        self.assertEqual((odd.pingpong, odd.swizzle_size), (True, 1))
        # Not for fewer waves or 32-bit outputs.
        for kw in (dict(m=4096, n=4096, k=4096, out_dtype=None),
                   dict(m=m, n=n, k=k, out_dtype="float32")):  # fmt: skip
            q = planning.plan(kw.pop("m"), kw.pop("n"), kw.pop("k"), a_dtype="bfloat16",
                              b_dtype="bfloat16", arch="sm_90a", **kw)  # fmt: skip
            self.assertFalse(q.pingpong, q)

    @parameterized.named_parameters(
        # (m, n, k, ping-pong, tile, swizzle, swapped): 8-bit operands take 128x192 (or, where
        # its waves fill better, 128x176) ping-pong tiles for many waves of at most
        # SM90_PINGPONG_8BIT_MAX_KTILES k-tiles; very tall grids (never 128x176 or 256x176)
        # run swapped (128x192 over (n, m), `swapped`), or with a C (which a swapped plan does
        # not take) 64x256 tiles where they pad N no more, unswizzled.
        ("tall", (16384, 4096, 4096), True, (64, 256), 1, True),
        ("tall_n_not_256", (32768, 1408, 2048), True, (128, 160), 1, True),
        # Where 256x176 weighed 1 % less (tests/test_gpu_matrix.py SwapTest's folded batch).
        ("tall_folded", (32800, 1032, 1024), True, (128, 192), 1, True),
        ("square_short_k", (8192, 8192, 4096), True, (128, 192), 8, False),
        ("wide", (4096, 14336, 4096), True, (128, 176), 1, False),
        ("k_2048", (16384, 8192, 2048), True, (128, 192), 8, False),
        ("long_k", (8192, 8192, 8192), False, (128, 256), 8, False),
        ("few_waves", (4096, 4096, 4096), False, (128, 256), 8, False),
    )
    def test_pingpong_choice_8bit(self, shape, pingpong, tile, swizzle, swapped):
        f8 = dict(a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn", b_major="k", arch="sm_90a")
        p = planning.plan(*shape, out_dtype="bfloat16", **f8)
        self.assertEqual((p.kernel, p.pingpong, p.swap_ab), ("sm90_wgmma", pingpong, swapped))
        if swapped:
            self.assertEqual((p.cta_tile_mnk[:2], p.cluster_shape_mn), ((128, 192), (1, 2)), p)
            self.assertEqual((p.raster_along_m, p.swizzle_size), (True, 1), p)
            self.assertEqual(p.num_epi_stages, planning.SM90_PINGPONG_8BIT_EPI_STAGES)
            self.assertIn("swapped product D^T = B A^T", p.reason)
            m, n, _ = shape
            self.assertEqual(p.num_tiles, math.ceil(n / 128) * math.ceil(m / 192))
            self.assertRegex(str(p), r"swap_ab\s+yes")
            # The same problem with a C (read transposed if swapped): not swapped.
            p = planning.plan(*shape, out_dtype="bfloat16", c_dtype="bfloat16", **f8)
            self.assertFalse(p.swap_ab, p)
        self.assertEqual((p.cta_tile_mnk[:2], p.swizzle_size), (tile, swizzle), p)
        if pingpong:
            # Wide grids (twice as many tile columns as rows) walk along M in 1x2 clusters.
            wide = math.ceil(shape[1] / tile[1]) >= 2 * math.ceil(shape[0] / tile[0])
            self.assertEqual(wide, shape == (4096, 14336, 4096))
            self.assertEqual(p.cluster_shape_mn, (1, 2) if wide else (2, 1))
            self.assertEqual(p.num_epi_stages, planning.SM90_PINGPONG_8BIT_EPI_STAGES)
            self.assertEqual(p.raster_along_m, wide)
            self.assertEqual("a wide 8-bit grid" in p.reason, wide, p.reason)
            # The reason names the rule that picked the tile: the very-tall switch or the waves.
            self.assertEqual("in place of 128x192" in p.reason, tile == (64, 256), p.reason)
            self.assertEqual("fewest weighted waves" in p.reason, tile != (64, 256), p.reason)
        # e5m2, a float16 result, a batch, and a C staged by TMA plan the same schedule.
        m, n, k = shape
        same = (p.pingpong, p.cta_tile_mnk[:2])
        e5 = dict(f8, a_dtype="float8_e5m2", b_dtype="float8_e5m2")
        q = planning.plan(*shape, out_dtype="float16", c_dtype="float16", **e5)
        self.assertEqual((q.pingpong, q.cta_tile_mnk[:2]), same, q)
        self.assertEqual(q.stage_c, pingpong)
        if pingpong:
            self.assertEqual(q.num_epi_stages, 2, q)
            self.assertLessEqual(q.num_ab_stages, p.num_ab_stages)  # C's stage takes room
        batched = planning.plan(m // 4, n, k, batch=4, out_dtype="bfloat16", **f8)
        self.assertEqual(batched.pingpong, pingpong, batched)
        # Not for float32 outputs; mixed fp8 operands run on XLA's dot.
        self.assertFalse(planning.plan(*shape, out_dtype="float32", **f8).pingpong)
        mixed = planning.plan(*shape, out_dtype="bfloat16", **dict(f8, b_dtype="float8_e5m2"))
        self.assertEqual(mixed.kernel, planning.KERNEL_XLA, mixed)

    def test_swap_ab_rules(self):
        # A swapped plan (D^T = B A^T) is the dense sm_90a kernel's, on K-major operands, with
        # no C, split-K or stream-K; its edits keep it consistent.
        f8 = dict(a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn", b_major="k")
        p = planning.plan(16384, 4096, 4096, out_dtype="bfloat16", arch="sm_90a", **f8)
        self.assertEqual((p.swap_ab, p.kernel_mn), (True, (4096, 16384)))
        for bad in (dict(c_dtype="bfloat16"), dict(pingpong=False, stream_k=True),
                    dict(out_dtype="float32")):  # fmt: skip
            with self.assertRaisesRegex(C.PlanError, "swap_ab"):
                dataclasses.replace(p, **bad)
        bf16 = dict(a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
        with self.assertRaisesRegex(C.PlanError, "swap_ab=True takes fp8 operands"):
            dataclasses.replace(planning.plan(4096, 4096, 4096, b_major="k", **bf16), swap_ab=True)
        # An XLA plan ignores it (and does not print it).
        xla = dataclasses.replace(p, kernel=planning.KERNEL_XLA)
        self.assertNotIn("swap_ab", str(xla))
        self.assertRegex(str(p), r"swap_ab\s+yes")
        q = planning.plan(16384, 4096, 4096, out_dtype="bfloat16", arch="sm_100a", **f8)
        self.assertFalse(q.swap_ab)
        with self.assertRaisesRegex(C.PlanError, "sm_90a dense kernel"):
            dataclasses.replace(q, swap_ab=True)
        self.assertFalse(planning.with_split(p, 2).swap_ab)
        coop = planning.sm90_variant(p, tile_mn=(128, 256), pingpong=False)
        self.assertTrue(coop.swap_ab)
        self.assertEqual(coop.num_tiles, 32 * 64)  # 4096 / 128 x 16384 / 256
        # The kernel's spec: B as its A, A as its B, D M-major; a C is refused.
        spec = KernelSpec.for_plan(p)
        self.assertEqual((spec.a_major, spec.b_major, spec.d_major), ("k", "k", "m"))
        with self.assertRaisesRegex(ValueError, "takes no C"):
            dataclasses.replace(spec, c_dtype="bfloat16")
        with self.assertRaisesRegex(ValueError, "d_major"):
            dataclasses.replace(spec, d_major="k")

    def test_tuning_helpers_say_what_the_plan_is(self):
        # cooperative() of a kernel plan of a small problem (force_kernel) stays on a kernel (it
        # returned XLA's dot under the default environment); with_split's reason names the
        # split (it kept "XLA dot: ..." or "ping-pong" beside a split cooperative kernel).
        bf = dict(a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
        forced = planning.plan(1024, 1024, 1024, **bf, force_kernel=True)
        self.assertEqual(planning.cooperative(forced).kernel, planning.KERNEL_SM90)
        for p in (planning.plan(64, 64, 64, **bf), planning.plan(8192, 8192, 8192, **bf)):
            q = planning.with_split(p, 2)
            self.assertEqual((q.kernel, q.pingpong), (planning.KERNEL_SM90_SPLITK, False))
            self.assertIn("split-K x2", q.reason)
            self.assertNotIn("XLA", q.reason)
            self.assertNotIn("ping-pong", q.reason)
            r = planning.with_split(q, 1)  # and back: unsplit, saying so
            self.assertEqual((r.kernel, r.split_k, r.reason),
                             (planning.KERNEL_SM90, 1, "unsplit: tuning.with_split"))  # fmt: skip
        self.assertNotIn("XLA", planning.with_split(planning.plan(64, 64, 64, **bf), 1).reason)

    def test_cooperative_keeps_the_problem(self):
        # tuning.cooperative of a block-scaled or grouped plan is a plan of that same problem
        # (it dropped the scales and groups: an unscaled product, or a KeyError for nvfp4).
        f8 = dict(a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn")
        scaled = [
            planning.plan(4096, 4096, 4096, **f8, scale_dtype="float32", scale_block=128,
                          arch="sm_90a"),
            planning.plan(4096, 4096, 4096, **f8, scale_dtype="float32", scale_block=128,
                          b_scale_rows=128, arch="sm_90a"),
            planning.plan(4096, 4096, 4096, a_dtype="float4_e2m1fn", b_dtype="float4_e2m1fn",
                          scale_dtype="float8_e4m3fn", scale_block=16, arch="sm_100a"),
        ]  # fmt: skip
        for p in scaled:
            self.assertEqual(planning.cooperative(p), p)
        grouped = planning.plan(65536, 1408, 2048, a_dtype="bfloat16", b_dtype="bfloat16",
                                groups=64, ragged="m", arch="sm_90a")  # fmt: skip
        self.assertTrue(grouped.pingpong)
        q = planning.cooperative(grouped)
        self.assertEqual((q.kernel, q.groups, q.ragged, q.pingpong),
                         (grouped.kernel, 64, "m", False))  # fmt: skip
        # And edits the block-scaled and grouped kernels cannot run are refused up front.
        for p in (*scaled, grouped):
            for edit in ({"c_dtype": "bfloat16"}, {"preact_out": True}):
                with self.assertRaisesRegex(C.PlanError, "read no C and write D only"):
                    dataclasses.replace(p, **edit)
            # with_preact says so at once, not after trying each A/B stage count.
            with (
                mock.patch.object(planning, "replace_fitting", side_effect=AssertionError),
                self.assertRaisesRegex(C.PlanError, "read no C and write D only"),
            ):
                planning.with_preact(p)

    def _coop_stream_k(self):
        """16384x4096x4096 (bf16 output) on the planner's cooperative plan: stream-K."""
        p = planning.plan(16384, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
        q = planning.cooperative(p)
        self.assertEqual((p.pingpong, q.pingpong, q.cta_tile_mnk[:2]), (True, False, (128, 256)))
        self.assertEqual((q.cluster_shape_mn, q.raster_along_m, q.swizzle_size), ((1, 2), True, 8))
        return q

    def test_variants_of_a_stream_k_plan(self):
        p = self._coop_stream_k()
        self.assertTrue(p.stream_k)
        # Schedules stream-K does not run on turn it off; the rest keep it.
        self.assertFalse(planning.sm90_variant(p, tile_mn=(128, 128), pingpong=True).stream_k)
        self.assertFalse(planning.sm90_variant(p, cluster_mn=(2, 2)).stream_k)
        self.assertFalse(planning.with_split(p, 2).stream_k)
        self.assertTrue(planning.sm90_variant(p, cluster_mn=(2, 1)).stream_k)
        self.assertTrue(planning.with_split(p, 1).stream_k)
        with self.assertRaisesRegex(C.PlanError, "at most 2 CTAs"):
            planning.sm90_variant(p, cluster_mn=(2, 2), stream_k=True)

    def test_swizzle_only_where_it_divides_the_cluster_columns(self):
        # (Cooperative plans: float32 outputs; ping-pong plans walk along N, see above.)
        bf = dict(a_dtype="bfloat16", b_dtype="bfloat16", out_dtype="float32", arch="sm_90a")
        # 16 tile columns in clusters of 1x2: 8 cluster columns, swizzled in bands of 8.
        self.assertEqual(planning.plan(16384, 4096, 4096, **bf).swizzle_size, 8)
        # 20 tile columns: 10 cluster columns would run as 16 (6 outside the matrix): none.
        p = planning.plan(16384, 5120, 4096, **bf)
        self.assertEqual((p.cluster_shape_mn, p.swizzle_size), ((1, 2), 1))
        # A variant with another tile or cluster re-checks the swizzle, unless it is asked for.
        q = planning.plan(16384, 4096, 4096, **bf)
        pp = planning.sm90_variant(q, tile_mn=(128, 160), pingpong=True)
        self.assertEqual(pp.swizzle_size, 1)
        self.assertEqual(planning.sm90_variant(q, tile_mn=(128, 192)).swizzle_size, 1)
        self.assertEqual(planning.sm90_variant(q, cluster_mn=(2, 1)).swizzle_size, 8)
        self.assertEqual(planning.sm90_variant(q, tile_mn=(128, 128)).swizzle_size, 8)
        forced = planning.sm90_variant(q, tile_mn=(128, 160), swizzle_size=8)
        self.assertEqual(forced.swizzle_size, 8)
        # Along N the rows are padded: 8192 rows of 256-row tiles in clusters of 2x1 are 16
        # cluster rows (kept); 8320 rows are 33 (dropped).
        pp = planning.plan(8192, 8192, 8192, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
        self.assertEqual((pp.raster_along_m, pp.swizzle_size), (False, 8))
        self.assertEqual(
            planning.sm90_variant(pp, tile_mn=(256, 128), pingpong=False).swizzle_size, 8
        )
        odd = dataclasses.replace(pp, m=8320)
        self.assertEqual(planning.sm90_variant(odd, tile_mn=(128, 160)).swizzle_size, 1)

    @parameterized.named_parameters(
        ("pingpong", dict(pingpong=True, mma_tiler_mnk=(128, 128, 64)), "ping-pong"),
        ("split", dict(split_k=2, kernel="sm90_wgmma_splitk"), "split_k=2"),
        ("cluster_of_4", dict(cluster_shape_mn=(2, 2)), "at most 2 CTAs"),
    )
    def test_stream_k_rules(self, change, msg):
        p = self._coop_stream_k()
        with self.assertRaisesRegex(C.PlanError, msg):
            dataclasses.replace(p, **change)
        p100 = jax_sm100.plan(8192, 8192, 8192, a_dtype="bfloat16", b_dtype="bfloat16")
        with self.assertRaisesRegex(C.PlanError, "sm_90a"):
            dataclasses.replace(p100, stream_k=True)

    def test_variant_needs_sm90(self):
        p100 = jax_sm100.plan(1024, 1024, 1024, a_dtype="bfloat16", b_dtype="bfloat16")
        with self.assertRaisesRegex(C.PlanError, "sm_90a plan"):
            planning.sm90_variant(p100, pingpong=True)

    def test_small_problems_env(self):
        bf = dict(a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
        with mock.patch.dict(os.environ, {"JAX_SM100_SMALL_PROBLEMS": "kernel"}):
            self.assertEqual(planning.plan(512, 512, 512, **bf).kernel, planning.KERNEL_SM90)
        with mock.patch.dict(os.environ, {"JAX_SM100_SMALL_PROBLEMS": "xla"}):
            self.assertEqual(planning.plan(512, 512, 512, **bf).kernel, planning.KERNEL_XLA)
        with mock.patch.dict(os.environ, {"JAX_SM100_SMALL_PROBLEMS": "yes"}):
            with self.assertRaisesRegex(C.PlanError, "'xla' or 'kernel'"):
                planning.plan(512, 512, 512, **bf)

    def test_tall_grid_multicasts_a(self):
        # 128 x 16 tiles of 128x256: the CTAs of a cluster pair along N and share A.
        tall = planning.plan(16384, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16",
                             out_dtype="float32", arch="sm_90a")  # fmt: skip
        self.assertEqual(tall.cluster_shape_mn, (1, 2))
        self.assertEqual(self.p.cluster_shape_mn, (2, 1))


class ProblemAndChoicesTest(absltest.TestCase):
    def test_plan_keeps_its_problem_apart(self):
        kw = dict(a_dtype="bfloat16", b_dtype="bfloat16", c_dtype="bfloat16", b_major="k")
        p = planning.plan(8192, 14336, 4096, arch="sm_90a", **kw)
        self.assertEqual(p.problem, planning.make_problem(8192, 14336, 4096, **kw))
        # The same choices for a device's share of the problem: one binary for both.
        half = dataclasses.replace(p.problem, m=4096)
        q = p.for_problem(half)
        self.assertEqual((q.m, q.n, q.k), (4096, 14336, 4096))
        self.assertEqual(q.binary_fields(), p.binary_fields())
        self.assertEqual(compile_mod.binary_key(q, KernelSpec.for_plan(q)),
                         compile_mod.binary_key(p, KernelSpec.for_plan(p)))  # fmt: skip
        # A k-sharded partial product (float32 out, no C) keeps the tiles, drops the staged C.
        self.assertTrue(p.stage_c)
        partial = p.for_problem(dataclasses.replace(p.problem, out_dtype="float32", c_dtype=None))
        self.assertFalse(partial.stage_c)
        self.assertEqual(partial.mma_tiler_mnk, p.mma_tiler_mnk)
        # A problem the choices cannot serve is refused, naming the rule.
        with self.assertRaisesRegex(planning.C.PlanError, "int32"):
            p.for_problem(dataclasses.replace(p.problem, m=2**31))

    def test_an_xla_plan_prints_no_hardware(self):
        # A plan that runs on XLA's dot (here: a CPU machine) shows the problem and the reason,
        # not an arch's tiles, SMs and shared memory.
        x, w = jnp.ones((256, 512), jnp.bfloat16), jnp.ones((512, 1024), jnp.bfloat16)
        with mock.patch.object(dispatch, "device_target", lambda: None):
            text = str(jax_sm100.plan_for(x, w))
        self.assertIn("xla_dot", text)
        for hardware in ("SMs", "mma_tiler", "smem_bytes", "cluster"):
            self.assertNotIn(hardware, text)

    def test_mixed_fp8_plans_onto_xla(self):
        # e4m3 x e5m2: the kernels take one operand dtype, so XLA's dot, the plan saying why.
        for arch in ("sm_90a", "sm_100a"):
            p = planning.plan(4096, 4096, 4096, a_dtype="float8_e4m3fn", b_dtype="float8_e5m2",
                              arch=arch, b_major="k")  # fmt: skip
            self.assertEqual(p.kernel, planning.KERNEL_XLA)
            self.assertIn("mixed operand dtypes", p.reason)

    def test_extents_past_int32_run_on_xla(self):
        # A folded batch of short rows: 2^31 rows of 16. The kernels index int32 extents.
        kw = dict(a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a", force_kernel=True)
        p = planning.plan(2**31, 16, 16, **kw)
        self.assertEqual(p.kernel, planning.KERNEL_XLA)
        self.assertIn("int32 extent range", p.reason)
        kernel_plan = planning.plan(2**20, 16, 16, **kw)
        with self.assertRaisesRegex(planning.C.PlanError, "int32 extent range"):
            kernel_plan.for_problem(dataclasses.replace(kernel_plan.problem, m=2**31))


if __name__ == "__main__":
    absltest.main()
