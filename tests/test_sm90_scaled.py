"""The SM90 block-scaled family on a CPU machine: its plans (planning/sm90_scaled.py), its PTX
for sm_90a (kernels/sm90_scaled.py) and the CUDA lowering of scaled_matmul (scaled_gpu.py),
exported for an sm_90a target. tests/test_gpu_scaled.py runs it on an H100/H200."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_sm100
from jax_sm100._src import compile as compile_mod
from jax_sm100._src import dispatch, ffi, kernel_key, planning, scale_layout, scaled_gpu
from jax_sm100._src.kernels import sm90_scaled
from jax_sm100._src.kernels.spec import KernelSpec
from jax_sm100._src.planning import sm90_scaled as scaled_planning
from tests.test_sm100_ptx import ptxas_spill_bytes, wgmma_serialized

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def _plan(m, n, k, dtype=E4M3, arch="sm_90a", **kw):
    kw = dict(b_major="k", scale_dtype="float32", scale_block=128) | kw
    return jax_sm100.plan(m, n, k, a_dtype=dtype, b_dtype=dtype, arch=arch, **kw)


def _plan128(m, n, k, **kw):
    """`_plan`'s plan in 128 x 128 tiles (the planner's are 256 x 128 for most problems that
    fill the SMs), its stages refilled."""
    return planning.sm90_variant(_plan(m, n, k, **kw), tile_mn=(128, 128))


class ScaledPlanTest(parameterized.TestCase):
    def test_the_kernels_plan(self):
        p = _plan(8192, 8192, 8192)
        self.assertEqual(p.kernel, planning.KERNEL_SM90_SCALED)
        # 256 x 128 tiles in 1x2 clusters (the H200 ran them 1.03-1.05x 128 x 192's TF/s, each
        # warp group's rows in two waves): 15.5 waves on 132 SMs, so stream-K shares out the
        # last ones.
        self.assertEqual((p.cta_tile_mnk, p.cluster_shape_mn, p.pingpong, p.split_k, p.stream_k,
                          p.scaled_overlap),
                         ((256, 128, 128), (1, 2), False, 1, True, False))  # fmt: skip
        self.assertIn("two 64-row waves", p.reason)
        self.assertEqual((p.scale_dtype, p.scale_block), ("float32", 128))
        # Each stage holds the k-block's A and B tiles and their 256 + 128 float32 scales.
        self.assertEqual(p.ab_stage_bytes, (256 + 128) * 128 + (256 + 128) * 4)
        self.assertLessEqual(p.smem_bytes, planning.smem_capacity("sm_90a"))
        self.assertEqual(p.num_ab_stages, 4)
        # Where 256-row tiles would leave more of the last wave idle: 128 x 192.
        self.assertEqual(_plan(3072, 3072, 4096).cta_tile_mnk, (128, 192, 128))
        self.assertEqual(p.problem.scale_block, 128)
        text = str(p)
        self.assertIn("float32 per 128 of k", text)
        self.assertIn("sm90_wgmma_scaled", text)
        self.assertIn("none (unscaled", str(jax_sm100.plan(64, 64, 64, a_dtype="bfloat16",
                                                           b_dtype="bfloat16")))  # fmt: skip

    def test_plans_the_gpu_suite_asserts(self):
        # tests/test_gpu_scaled.py asserts these plans on the GPU (the 128 x 192 default loop at
        # 2000x3008x384; stream-K at 7168x3840x512 in either loop): checked here too, so that a
        # planner change that moves one fails in CI.
        for overlap in (False, True):
            env = {scaled_planning.OVERLAP_ENV: "1" if overlap else "0"}
            with mock.patch.dict(os.environ, env):
                small, sk = _plan(2000, 3008, 384), _plan(7168, 3840, 512)
            for p in (small, sk):
                self.assertEqual((p.kernel, p.scaled_overlap),
                                 (planning.KERNEL_SM90_SCALED, overlap))  # fmt: skip
            if not overlap:
                self.assertEqual(small.cta_tile_mnk, (128, 192, 128))
            self.assertTrue(sk.stream_k, sk)

    def test_skinny_problems_take_64_wide_tiles(self):
        # 128 x 7168 is 56 tiles of 128 x 128 for 132 SMs; 128 x 64 tiles make 112 CTAs.
        p = _plan(128, 7168, 16384)
        self.assertEqual((p.cta_tile_mnk, p.num_tiles), ((128, 64, 128), 112))
        self.assertEqual(p.ab_stage_bytes, (128 + 64) * 128 + (128 + 64) * 4)
        # 128 x 64 tiles take the overlapped main loop unless told otherwise (measured faster).
        self.assertTrue(p.scaled_overlap)
        self.assertIn("measured faster", p.reason)
        ptx = _ptx(jax_sm100.tuning.with_scaled_overlap(p, False))
        self.assertEqual(len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k32", ptx)), 4)
        self.assertEqual(len(re.findall(r"\bfma\.rn\.f32\b", ptx)), 32)
        self.assertEqual(_plan(4096, 7168, 16384).cta_tile_mnk, (256, 128, 128))

    @parameterized.named_parameters(
        ("mxfp8", dict(scale_dtype="float8_e8m0fnu", scale_block=32), "not float8_e8m0fnu per 32"),
        ("bf16_data", dict(dtype="bfloat16"), "takes fp8 data"),
        ("mixed", dict(b_dtype=E5M2), "mixed operand dtypes"),
        ("n_unaligned", dict(n=100), "not a multiple of 16 bytes"),
    )
    def test_xla_with_the_reason(self, edit, reason):
        edit = dict(edit)
        n = edit.pop("n", 1024)
        if "b_dtype" in edit:
            p = jax_sm100.plan(256, n, 1024, a_dtype=E4M3, arch="sm_90a", b_major="k",
                               scale_dtype="float32", scale_block=128, **edit)  # fmt: skip
        else:
            p = _plan(256, n, 1024, **edit)
        self.assertEqual(p.kernel, planning.KERNEL_XLA)
        self.assertIn(reason, p.reason)
        self.assertIn("scale_dtype", str(p))

    def test_edits_that_break_a_rule_raise(self):
        p = _plan(4096, 4096, 4096)
        for bad in (
            dict(pingpong=True, mma_tiler_mnk=(128, 128, 128)),
            dict(mma_tiler_mnk=(64, 128, 128)),
            dict(split_k=2),
            dict(kernel=planning.KERNEL_SM90),
            dict(scale_block=0),
            dict(scale_dtype="int8"),
        ):
            with self.assertRaises(planning.C.PlanError, msg=bad):
                dataclasses.replace(p, **bad)
        dense = dataclasses.replace(p, kernel=planning.KERNEL_SM90, scale_dtype=None, scale_block=0)
        with self.assertRaisesRegex(planning.C.PlanError, "block-scaled problems"):
            dataclasses.replace(dense, kernel=planning.KERNEL_SM90_SCALED)
        with self.assertRaisesRegex(planning.C.PlanError, "c_dtype='bfloat16'.*no fused epilogue"):
            _plan(256, 256, 256, c_dtype=jnp.bfloat16)
        wide = planning.sm90_variant(p, tile_mn=(128, 160))
        self.assertEqual(wide.kernel, planning.KERNEL_SM90_SCALED)
        self.assertEqual(wide.ab_stage_bytes, (128 + 160) * 128 + (128 + 160) * 4)


def _ptx(plan, spec=None):
    return compile_mod.compile_plan(plan, spec).ptx


def _ptxas_spill_bytes(ptx: str) -> tuple[int, int] | None:
    """(spill stores, spill loads) in bytes that ptxas reports for `ptx` on sm_90a."""
    return ptxas_spill_bytes(ptx, "sm_90a")


# What the consumers' main loop does, in PTX order: wgmma batches, commits and waits, the
# promotions' fused multiply-adds and the stage barriers (a run of one kind written "x N").
_EVENTS = re.compile(
    r"wgmma\.fence|wgmma\.mma_async|wgmma\.commit_group|wgmma\.wait_group\.sync\.aligned\s+\d"
    r"|\bfma\.rn\.f32\b|mbarrier\.arrive(?:\.shared::cluster|\.shared\.b64)"
    r"|mbarrier\.try_wait[\w.:]*"
)

# The 256-row loop's events (`_events`) for one 64-row wave of a 256 x 128 tile's k-tile, and
# for both waves with the first one's promotion between them.
_WAVE = "wgmma.fence | wgmma.mma_async x4 | wgmma.commit_group | wait 0"
_TWO_WAVES = f"{_WAVE} | fma x64 | {_WAVE}"


def _events(ptx: str) -> str:
    """The consumers' events of `ptx` (from the first wgmma fence on), runs counted:
    "wgmma.fence | wgmma.mma_async x4 | ... | wait 1 | fma x64 | release | ...". A "stage
    wait" is a poll (`try_wait` without a suspend hint) and the blocking retry loop right after
    it (common.wait_full), or a poll alone (the 256-row loop polls the next stage early); a
    retry loop without its poll reads "blocking wait", and any other form of try_wait its
    opcode."""
    names = {"mbarrier.arrive.shared::cluster": "release", "mbarrier.arrive.shared.b64": "release",
             "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64": "stage wait",
             "mbarrier.try_wait.parity.shared.b64": "blocking wait",
             "fma.rn.f32": "fma"}  # fmt: skip
    runs = []
    polled = False
    for m in _EVENTS.finditer(ptx[ptx.index("wgmma.fence") :]):
        e = re.sub(r"wgmma\.wait_group\.sync\.aligned\s+", "wait ", m.group(0))
        e = names.get(e, e)
        if e == "blocking wait" and polled:
            polled = False
            continue  # the poll's fallback: one stage wait
        polled = e == "stage wait"
        if runs and runs[-1][0] == e:
            runs[-1][1] += 1
        else:
            runs.append([e, 1])
    return " | ".join(f"{e} x{n}" if n > 1 else e for e, n in runs)


class ScaledPtxTest(parameterized.TestCase):
    @parameterized.parameters("bfloat16", "float16", "float32")
    def test_every_output_on_the_kernel(self, out_dtype):
        # All three passed their H200 checks (tests/test_gpu_scaled.py).
        p = _plan(4096, 4096, 4096, out_dtype=out_dtype)
        self.assertEqual((p.kernel, p.out_dtype), (planning.KERNEL_SM90_SCALED, out_dtype))

    def test_float32_epilogue_is_the_dense_familys(self):
        # A float32 D leaves the registers by 64-bit shared stores, not stmatrix (16-bit
        # elements), in the dense family's float32 epilogue for the same tile (whose float32
        # results pass on the H200): 4 sub-tiles of 128 x 32, 8 stores of 2 per thread each.
        p = _plan128(4096, 4096, 4096, out_dtype="float32")
        self.assertEqual((p.cta_tile_mnk, p.epi_tile), ((128, 128, 128), (128, 32)))
        dense = planning.replace_fitting(
            jax_sm100.plan(4096, 4096, 4096, a_dtype=E4M3, b_dtype=E4M3, out_dtype="float32",
                           b_major="k", arch="sm_90a"),
            mma_tiler_mnk=p.mma_tiler_mnk, cluster_shape_mn=p.cluster_shape_mn, pingpong=False,
            stream_k=False,
        )  # fmt: skip
        self.assertEqual((dense.kernel, dense.epi_tile), (planning.KERNEL_SM90, p.epi_tile))
        for ptx in (_ptx(p), _ptx(dense)):
            self.assertEqual(len(re.findall(r"st\.shared\.v2\.b32", ptx)), 32)
            self.assertNotIn("stmatrix", ptx)
            self.assertNotIn("cvt.rn.bf16", ptx)

    @parameterized.product(dtype=(E4M3, E5M2), out_dtype=("bfloat16",))
    def test_main_loop_instructions(self, dtype, out_dtype):
        p = _plan128(4096, 4096, 4096, dtype=dtype, out_dtype=out_dtype)
        self.assertFalse(p.stream_k)
        compiled = compile_mod.compile_plan(p)
        ptx = compiled.ptx
        kind = {E4M3: "e4m3", E5M2: "e5m2"}[dtype]
        # One k-tile: four k32 wgmma of 64 x 128 per consumer warp group, into the k-block
        # fragment (the first overwrites it: its scale-d predicate is 0), then the promotion.
        self.assertEqual(
            len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.{kind}\.{kind}",
                           ptx)), 4)  # fmt: skip
        # acc += frag * (sfa[row] * sfb[col]): a multiply and a fused multiply-add for each of
        # the 64 accumulators of a thread, once per k-tile.
        self.assertEqual(len(re.findall(r"\bfma\.rn\.f32\b", ptx)), 64)
        self.assertEqual(len(re.findall(r"\bmul(\.rn)?\.f32\b", ptx)), 64)
        # The scales of a thread's 2 rows and 32 columns, each read once per k-tile.
        self.assertEqual(len(re.findall(r"ld\.shared\.b32", ptx)), 2)
        self.assertEqual(len(re.findall(r"ld\.shared\.v2\.b32", ptx)), 16)
        # The batch retires before its fragment is read: one full wait per k-tile (and the
        # caller's after the tile's last), the stage released before the promotion.
        self.assertEqual(len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0;", ptx)), 2)
        self.assertNotIn("wgmma.wait_group.sync.aligned 	1;", ptx)
        self.assertEqual(
            _events(ptx),
            "wgmma.fence | wgmma.mma_async x4 | wgmma.commit_group | wait 0 | release | fma x64 "
            "| wait 0 | release",
        )
        # Five TMA operands: A, B, D and the two scale tensors (3-D boxes, one CTA each).
        self.assertEqual([t.name for t in compiled.tensor_args], ["a", "b", "d", "sfa", "sfb"])
        self.assertIn("cp.async.bulk.tensor.3d.shared::cta.global.tile.mbarrier", ptx)
        self.assertRegex(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232")

    def test_stream_k(self):
        # The dense family's stream-K schedule with the scaled main loop: the workspace tensors,
        # the flags' release and acquire, the same promotion.
        p = _plan(8192, 8192, 8192)
        self.assertTrue(p.stream_k)
        compiled = compile_mod.compile_plan(p)
        self.assertEqual([t.name for t in compiled.tensor_args],
                         ["a", "b", "d", "sfa", "sfb", "ws", "flags"])  # fmt: skip
        ptx = compiled.ptx
        self.assertIn("ld.acquire.gpu.global.b32", ptx)
        self.assertRegex(ptx, r"atom\.global\.release(\.gpu)?\.add")
        # 256 x 128 tiles: the promotions of a thread's two waves of 64 accumulators (64 x 128
        # over 128 threads each), after a batch of four wgmma each; twice (the main loop's
        # k-tile and its peeled last one).
        self.assertEqual(p.cta_tile_mnk, (256, 128, 128))
        self.assertEqual(len(re.findall(r"\bfma\.rn\.f32\b", ptx)), 256)
        self.assertEqual(len(re.findall(r"wgmma\.mma_async", ptx)), 16)

    def test_wgmma_not_serialized(self):
        # Every main loop (the serial one at 128 and 256 rows, the overlapped one), both B scale
        # layouts, the widest tiles: ptxas keeps the wgmma batches asynchronous
        # (tests/test_sm100_ptx.py `wgmma_serialized`).
        for rows in (1, 128):
            p = _plan(8192, 8192, 8192, b_scale_rows=rows)  # 256 x 128, serial
            plans = [p, jax_sm100.tuning.with_scaled_overlap(p)]  # 128 x 128, overlapped
            if rows == 1:
                plans.append(planning.sm90_variant(p, tile_mn=(128, 192)))  # serial
            for q in plans:
                self.assertIn(wgmma_serialized(_ptx(q)), ([], None),
                              (rows, q.cta_tile_mnk, q.scaled_overlap))  # fmt: skip

    def test_no_spills(self):
        # The two accumulator sets and the scales fit a consumer thread's 232 registers at
        # 128 x 128 (the scales read before the batch), 128 x 160 and 128 x 192 (read during
        # the promotion; ptxas, where the machine has it).
        if shutil.which("ptxas") is None:
            self.skipTest("ptxas is not on PATH")
        for tn in (128, 160, 192):
            p = planning.sm90_variant(_plan(8192, 8192, 8192), tile_mn=(128, tn))
            self.assertEqual(_ptxas_spill_bytes(_ptx(p)), (0, 0), tn)

    def test_family_refuses_what_it_does_not_run(self):
        p = _plan(4096, 4096, 4096)
        spec = KernelSpec.for_plan(p)
        self.assertIsNone(sm90_scaled.Sm90ScaledGemmKernel.why_not(p, spec))
        self.assertIn("no fused epilogue", sm90_scaled.Sm90ScaledGemmKernel.why_not(
            p, dataclasses.replace(spec, activation="relu")))  # fmt: skip
        dense = _plan(4096, 4096, 4096, scale_dtype=None, scale_block=0)
        self.assertIn("is not", sm90_scaled.Sm90ScaledGemmKernel.why_not(dense, spec))


class ScaledOverlapTest(parameterized.TestCase):
    """`GemmPlan.scaled_overlap`: k-tile i promoted under k-tile i + 1's wgmma batch."""

    def test_off_unless_asked(self):
        p = _plan(4096, 4096, 4096)
        self.assertFalse(p.scaled_overlap)
        self.assertIn("scaled_overlap", str(p))
        env = scaled_planning.OVERLAP_ENV
        with mock.patch.dict(os.environ, {env: "1"}):
            q = _plan(4096, 4096, 4096)
            dense = jax_sm100.plan(4096, 4096, 4096, a_dtype=E4M3, b_dtype=E4M3, b_major="k",
                                   arch="sm_90a")  # fmt: skip
            xla = _plan(256, 256, 1024, scale_dtype="float8_e8m0fnu", scale_block=32)
        self.assertTrue(q.scaled_overlap)
        self.assertIn(env, q.reason)
        # The overlapped loop runs 128-row tiles: the planner's 256 x 128 becomes 128 x 128,
        # scheduled as for that tile (with_scaled_overlap narrows to the same plan).
        self.assertEqual((p.cta_tile_mnk, q.cta_tile_mnk), ((256, 128, 128), (128, 128, 128)))
        for shape in ((4096, 4096, 4096), (8192, 8192, 8192), (4096, 7168, 16384)):
            with mock.patch.dict(os.environ, {env: "1"}):
                asked = _plan(*shape)
            narrowed = jax_sm100.tuning.with_scaled_overlap(_plan(*shape))
            self.assertEqual(dataclasses.replace(narrowed, reason=asked.reason), asked, shape)
        # The unscaled planner and XLA plans are not touched.
        self.assertFalse(dense.scaled_overlap)
        self.assertEqual((xla.kernel, xla.scaled_overlap), (planning.KERNEL_XLA, False))
        # The plan cache keeps the settings apart.
        self.assertFalse(_plan(4096, 4096, 4096).scaled_overlap)
        with mock.patch.dict(os.environ, {env: "0"}):
            self.assertEqual(_plan(4096, 4096, 4096), p)
        with mock.patch.dict(os.environ, {env: "yes"}):
            with self.assertRaisesRegex(planning.C.PlanError, env):
                _plan(4096, 4096, 4096)

    def test_the_plan_edit(self):
        p = _plan128(4096, 4096, 4096)
        q = jax_sm100.tuning.with_scaled_overlap(p)
        self.assertTrue(q.scaled_overlap)
        self.assertEqual(jax_sm100.tuning.with_scaled_overlap(q, False), p)
        # A choice the binary depends on: its own cache key.
        self.assertIn(("scaled_overlap", True), q.binary_fields())
        spec = KernelSpec.for_plan(p)
        self.assertNotEqual(kernel_key.cache_key(p, spec, arch="sm_90a"),
                            kernel_key.cache_key(q, spec, arch="sm_90a"))  # fmt: skip
        self.assertIsNone(sm90_scaled.Sm90ScaledGemmKernel.why_not(q, KernelSpec.for_plan(q)))

    def test_only_on_the_scaled_kernel(self):
        p = _plan(4096, 4096, 4096)
        dense = jax_sm100.plan(4096, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16",
                               arch="sm_90a")  # fmt: skip
        xla = _plan(256, 256, 1024, scale_dtype="float8_e8m0fnu", scale_block=32)
        sm100 = jax_sm100.plan(4096, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16")
        for other in (dense, xla, sm100):
            with self.assertRaisesRegex(planning.C.PlanError, "block-scaled kernel"):
                dataclasses.replace(other, scaled_overlap=True)
            with self.assertRaisesRegex(planning.C.PlanError, "with_scaled_overlap takes"):
                jax_sm100.tuning.with_scaled_overlap(other)
            self.assertEqual(jax_sm100.tuning.with_scaled_overlap(other, False), other)
        with self.assertRaisesRegex(planning.C.PlanError, "must be a bool"):
            dataclasses.replace(p, scaled_overlap=1)
        # Three fragments of 64 x N per warp group: N <= 128 fits the registers.
        q = jax_sm100.tuning.with_scaled_overlap(p)
        self.assertEqual(planning.sm90_variant(q, tile_mn=(128, 64)).cta_tile_mnk[1], 64)
        with self.assertRaisesRegex(planning.C.PlanError, "tile_n=160 must be <= 128"):
            planning.sm90_variant(q, tile_mn=(128, 160))
        # The planner's 128 x 192 and 256 x 128 tiles are narrowed to 128 x 128, their stages
        # refilled, the waves' note dropped from the reason.
        for wide in (_plan(3072, 3072, 4096), _plan(8192, 8192, 8192)):
            narrow = jax_sm100.tuning.with_scaled_overlap(wide)
            self.assertEqual((narrow.cta_tile_mnk, narrow.scaled_overlap), ((128, 128, 128), True))
            self.assertEqual(
                narrow.num_ab_stages,
                planning.sm90_variant(wide, tile_mn=(128, 128)).num_ab_stages,
            )
            self.assertIn(f"(narrowed from {wide.cta_tile_mnk[0]}x{wide.cta_tile_mnk[1]})",
                          narrow.reason)  # fmt: skip
            self.assertNotIn("64-row waves", narrow.reason)

    @parameterized.named_parameters(
        ("tile_128x128", (4096, 4096, 4096), (128, 128, 128), False),
        ("tile_128x64", (128, 7168, 16384), (128, 64, 128), False),
        ("stream_k", (8192, 8192, 8192), (128, 128, 128), True),
    )
    def test_main_loop_instructions(self, shape, tile, stream_k):
        p = jax_sm100.tuning.with_scaled_overlap(_plan(*shape))
        self.assertEqual((p.cta_tile_mnk, p.stream_k), (tile, stream_k))
        ptx = _ptx(p)
        regs = tile[1] // 2  # a thread's accumulators: 64 rows x N over 128 threads
        # Two k-tiles a trip, each into its fragment: issue the next batch, wait for all but
        # it (`wait_group 1`), promote the retired fragment, then release its stage. After the
        # loop an even count issues one more k-tile (the same step) and drains it with a full
        # wait; an odd count drains the fragment in flight. Then the caller's wait and release
        # of the last stage. No other wait: ptxas keeps one batch in flight through each
        # promotion (no serialization).
        step = (f"stage wait | wgmma.fence | wgmma.mma_async x4 | wgmma.commit_group | wait 1 | "
                f"fma x{regs} | release")  # fmt: skip
        self.assertEqual(
            _events(ptx),
            " | ".join([
                "wgmma.fence | wgmma.mma_async x4 | wgmma.commit_group", step, step, step,
                f"wait 0 | fma x{regs}", f"wait 0 | fma x{regs}", "wait 0 | release",
            ]),
        )  # fmt: skip
        kind = "m64n128k32" if tile[1] == 128 else "m64n64k32"
        self.assertEqual(len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.{kind}\.f32\."
                                        r"e4m3\.e4m3", ptx)), 16)  # fmt: skip
        # Each of the 5 promotions: a multiply and an FMA per accumulator, and the scales of
        # the thread's 2 rows and N / 4 columns read from the stage (as pairs of columns).
        self.assertEqual(len(re.findall(r"\bmul(\.rn)?\.f32\b", ptx)), 5 * regs)
        self.assertEqual(len(re.findall(r"ld\.shared\.b32", ptx)), 5 * 2)
        self.assertEqual(len(re.findall(r"ld\.shared\.v2\.b32", ptx)), 5 * tile[1] // 8)
        self.assertRegex(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232")

    def test_no_spills(self):
        # acc and two k-tile fragments (3 x 64 registers a thread at 128 x 128) and the scales
        # read during the promotion fit 232 registers; scales loaded before the batch spilled.
        if shutil.which("ptxas") is None:
            self.skipTest("ptxas is not on PATH")
        for shape in ((8192, 8192, 8192), (4096, 4096, 4096), (128, 7168, 16384)):
            p = jax_sm100.tuning.with_scaled_overlap(_plan(*shape))
            self.assertEqual(_ptxas_spill_bytes(_ptx(p)), (0, 0), shape)


class WeightTilesTest(parameterized.TestCase):
    """B scaled per 128 x 128 tile (`b_scale_rows=128`, DeepSeek-V3's weights): tiles of D's
    columns within one scale tile, one FMA per accumulator in the promotion."""

    @parameterized.named_parameters(
        # 256 x 128 tiles on the serial loop where they fill the SMs (measured 1.11-1.18x the
        # overlapped 128 x 128 tiles); 128 x 128 (measured 1.01-1.05x the serial loop) where
        # 256 rows would leave more of the last wave idle; 128 x 64 for a few rows.
        ("square", (8192, 8192, 8192), (256, 128, 128), None),
        ("wide", (4096, 7168, 16384), (256, 128, 128), None),
        ("ragged", (2048, 7168, 16384), (128, 128, 128), "B scaled per tile: measured faster"),
        ("skinny", (128, 7168, 16384), (128, 64, 128), "tiles of 64 columns: measured faster"),
    )
    def test_plan_and_promotion(self, shape, tile, why_overlap):
        p = _plan(*shape, b_scale_rows=128)
        overlapped = why_overlap is not None
        self.assertEqual((p.kernel, p.cta_tile_mnk, p.b_scale_rows, p.scaled_overlap),
                         (planning.KERNEL_SM90_SCALED, tile, 128, overlapped))  # fmt: skip
        self.assertIn("one FMA per accumulator", p.reason)
        with mock.patch.dict(os.environ, {scaled_planning.OVERLAP_ENV: "0"}):
            off = _plan(*shape, b_scale_rows=128)
        if why_overlap:
            self.assertTrue(p.reason.endswith(f"({why_overlap})"), p.reason)
            # JAX_SM100_SCALED_OVERLAP=0 turns it off at the same tile: the plan
            # with_scaled_overlap(p, False) gives, its note gone.
            self.assertEqual((off.cta_tile_mnk, off.scaled_overlap), (tile, False))
            self.assertEqual(off, jax_sm100.tuning.with_scaled_overlap(p, False))
            self.assertNotIn("measured faster", off.reason)
        else:
            self.assertIn("two 64-row waves (measured faster)", p.reason)
            self.assertEqual(off, p)
        self.assertIn("each 128 rows of B (b_scale_rows)", str(p))
        serial = jax_sm100.tuning.with_scaled_overlap(p, False)
        ptx = _ptx(serial)
        # Per 128-row wave, one promotion of a thread's tile[1] / 2 accumulators: an FMA each,
        # the products of the 2 row scales and the tile's one B scale (2 multiplies), 3 shared
        # loads. The 256-row loop's k-tile is written six times (a ring of its 4 stages at
        # trace-time indices, the run-time one, the peeled last); per-row B scales' twice.
        waves, regs = tile[0] // 128, tile[1] // 2
        copies, row_copies = (6, 2) if waves > 1 else (1, 1)
        self.assertEqual(len(re.findall(r"\bfma\.rn\.f32\b", ptx)), copies * waves * regs)
        self.assertEqual(len(re.findall(r"\bmul(\.rn)?\.f32\b", ptx)), copies * waves * 2)
        self.assertEqual(len(re.findall(r"ld\.shared(\.v2)?\.b32", ptx)), copies * waves * 3)
        # Per-row B scales at the same tile: a multiply per accumulator.
        rows = planning.replace_fitting(serial, b_scale_rows=1)
        self.assertEqual(len(re.findall(r"\bmul(\.rn)?\.f32\b", _ptx(rows))),
                         row_copies * waves * regs)  # fmt: skip
        if shutil.which("ptxas"):
            self.assertEqual(_ptxas_spill_bytes(_ptx(p)), (0, 0))

    def test_256_row_tiles(self):
        # Each warp group's 128 rows of a 256 x 128 tile in two 64-row waves through one
        # 64-register fragment, per k-tile: the wave's batch, a full wait, the promotion (one FMA
        # per accumulator). B scaled per 128 x 128 tile: the wave's scales read before its
        # batch, the next stage polled and this one released after the second wave's wait,
        # before its promotion. The loop takes whole rings of its 4 stages at trace-time stage
        # indices (sm90_scaled._STATIC_RINGS), so six k-tiles in the PTX: the ring's four, the
        # run-time one (before the ring reaches stage 0 and after its last whole ring) and the
        # peeled last one (no release), then the caller's wait and release.
        p = _plan(8192, 8192, 8192, b_scale_rows=128)
        self.assertEqual((p.kernel, p.cta_tile_mnk, p.num_ab_stages),
                         (planning.KERNEL_SM90_SCALED, (256, 128, 128), 4))  # fmt: skip
        ktile = f"{_TWO_WAVES} | stage wait | release | fma x64 | blocking wait"
        events = " | ".join([ktile] * 5 + [f"{_TWO_WAVES} | fma x64"]) + " | wait 0 | release"
        ptx = _ptx(p)
        self.assertEqual(_events(ptx), events)
        # The same in a 1x1 cluster (the stage released by a local arrive).
        alone = planning.sm90_variant(p, cluster_mn=(1, 1))
        alone_ptx = _ptx(alone)
        self.assertEqual(_events(alone_ptx), events)
        self.assertEqual(len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32", ptx)), 48)
        self.assertEqual(len(re.findall(r"\bfma\.rn\.f32\b", ptx)), 6 * 2 * 64)
        # Per-row B scales: 32 columns a thread, read during each promotion (as pairs of
        # columns) and multiplied by the row's scale; the stage released after the second
        # wave's promotion (the next one polled before it).
        per_row = _plan(8192, 8192, 8192)
        self.assertEqual((per_row.cta_tile_mnk, per_row.b_scale_rows), ((256, 128, 128), 1))
        rows_ptx = _ptx(per_row)
        rows_events = (f"{_TWO_WAVES} | stage wait | fma x64 | release | blocking wait | "
                       f"{_TWO_WAVES} | fma x64 | wait 0 | release")  # fmt: skip
        self.assertEqual(_events(rows_ptx), rows_events)
        alone = planning.sm90_variant(per_row, cluster_mn=(1, 1))
        self.assertEqual(_events(_ptx(alone)), rows_events)
        # Which lanes release a stage, and to which CTA, comes from a thread index read once
        # (common.pinned_thread_idx): no %tid.x read between the first and the last wgmma of
        # the tile (an S2R there stalled the second wave's batch on the H200).
        for q in (ptx, alone_ptx, rows_ptx):
            loop = q[q.index("wgmma.fence") : q.rindex("wgmma.mma_async")]
            self.assertEqual(loop.count("%tid.x"), 0)
        self.assertEqual(len(re.findall(r"\bmul(\.rn)?\.f32\b", rows_ptx)), 256)
        self.assertEqual(len(re.findall(r"ld\.shared\.v2\.b32", rows_ptx)), 64)
        if shutil.which("ptxas"):
            for q in (ptx, rows_ptx):
                self.assertEqual(_ptxas_spill_bytes(q), (0, 0))
                self.assertEqual(wgmma_serialized(q), [])
        # tests/test_gpu_scaled.py's 8192x4352x512 runs them with stream-K, both layouts.
        for rows in (1, 128):
            sk = _plan(8192, 4352, 512, b_scale_rows=rows)
            self.assertEqual((sk.cta_tile_mnk, sk.stream_k), ((256, 128, 128), True))
        # The overlapped loop and wider tiles are refused.
        with self.assertRaisesRegex(planning.C.PlanError, "runs 128-row tiles"):
            dataclasses.replace(p, scaled_overlap=True)
        with self.assertRaisesRegex(planning.C.PlanError, "tile N=192 must be <= 128"):
            planning.sm90_variant(per_row, tile_mn=(256, 192))

    def test_run_time_stage_indices(self):
        # With _STATIC_RINGS off (the loop before the twenty-third session; per-row B scales
        # always take it), B per 128 x 128 tile runs one k-tile at run-time stage indices: the
        # loop's k-tile, then the peeled last one, then the caller's wait and release. Compiled
        # apart from the kernel caches, whose keys see the constant only in the source text.
        p = _plan(8192, 8192, 8192, b_scale_rows=128)
        with mock.patch.object(sm90_scaled, "_STATIC_RINGS", False):
            ptx = compile_mod._compile(p, KernelSpec.for_plan(p)).ptx
        self.assertEqual(_events(ptx), f"{_TWO_WAVES} | stage wait | release | fma x64 | "
                         f"blocking wait | {_TWO_WAVES} | fma x64 | wait 0 | release")  # fmt: skip
        self.assertEqual(len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32", ptx)), 16)
        self.assertEqual(len(re.findall(r"\bfma\.rn\.f32\b", ptx)), 256)
        self.assertEqual(len(re.findall(r"\bmul(\.rn)?\.f32\b", ptx)), 8)
        loop = ptx[ptx.index("wgmma.fence") : ptx.rindex("wgmma.mma_async")]
        self.assertEqual(loop.count("%tid.x"), 0)
        if shutil.which("ptxas"):
            self.assertEqual(_ptxas_spill_bytes(ptx), (0, 0))
            self.assertEqual(wgmma_serialized(ptx), [])

    @parameterized.parameters(
        # (m, n, k, swizzle): 256-row tiles in bands of 8 of the 1x2 clusters' columns where 8
        # divides them and there are >= 32 tile rows (sm90_scaled._scaled_swizzle).
        (8192, 8192, 8192, 8),
        (16384, 8192, 4096, 8),
        (16384, 4096, 4096, 8),
        (4096, 8192, 8192, 1),  # 16 tile rows
        (4096, 7168, 16384, 1),  # 28 cluster columns
        (8192, 7168, 4096, 1),
        (7936, 8192, 4096, 1),  # 31 tile rows
        (7937, 8192, 4096, 8),  # 32
        # tests/test_gpu_scaled.py runs these two (the second with stream-K).
        (8192, 4096, 512, 8),
        (9216, 4096, 512, 8),
    )
    def test_banded_raster(self, m, n, k, swizzle):
        for rows in (1, 128):
            p = _plan(m, n, k, b_scale_rows=rows)
            self.assertEqual((p.cta_tile_mnk[:2], p.cluster_shape_mn, p.raster_along_m),
                             ((256, 128), (1, 2), True))  # fmt: skip
            self.assertEqual(p.swizzle_size, swizzle, p)
            self.assertFalse(planning.swizzle_pads(p))

    def test_rules(self):
        with self.assertRaisesRegex(planning.C.PlanError, "must be one of"):
            _plan(4096, 4096, 4096, b_scale_rows=64)
        with self.assertRaisesRegex(planning.C.PlanError, "needs a block-scaled problem"):
            jax_sm100.plan(256, 256, 256, a_dtype=E4M3, b_dtype=E4M3, arch="sm_90a",
                           b_scale_rows=128)  # fmt: skip
        wide = _plan(3072, 3072, 4096)
        self.assertEqual(wide.cta_tile_mnk[1], 192)
        with self.assertRaisesRegex(planning.C.PlanError, "tile_n=192 must divide"):
            dataclasses.replace(wide, b_scale_rows=128)
        # sm_100a has no kernel for them: the documented math in XLA ops.
        self.assertEqual(_plan(4096, 4096, 4096, arch="sm_100a", b_scale_rows=128).kernel,
                         planning.KERNEL_XLA)  # fmt: skip

    def test_lowering_plans_the_weight_tiles(self):
        a, b, sa, _ = _avals(1, 4096, 1008, 1024)
        tiles = jax.ShapeDtypeStruct((1, 10, 8), jnp.float32)  # ceil(1160 / 128) tiles of rows
        b = jax.ShapeDtypeStruct((1, 1160, 1024), b.dtype)
        text, how = _export((a, b, sa, tiles))
        self.assertEqual((how.plan.b_scale_rows, how.plan.cta_tile_mnk[1] in (64, 128)),
                         (128, True))  # fmt: skip
        # The tiles' scales go to the kernel as they are, transposed ([1, k / 128, tiles] with
        # the tiles padded to 16 bytes), not repeated per row: a TMA box of 4 tiles a stage.
        (call,) = [ln for ln in text.splitlines() if "custom_call @jax_sm100_gemm" in ln]
        self.assertIn("tensor<1x8x12xf32>", call)
        self.assertNotIn("x1160xf32", call)
        self.assertEqual(
            how.plan.ab_stage_bytes,
            sum(how.plan.cta_tile_mnk[:2]) * 128 + how.plan.cta_tile_mnk[0] * 4 + 128,
        )
        _, per_row = _export(_avals(1, 4096, 1008, 1024))
        self.assertEqual(per_row.plan.b_scale_rows, 1)
        # A plan for tile scales called with per-row ones is refused before the kernel is built
        # (it would read row t's scales as tile t's).
        with self.assertRaisesRegex(ValueError, "per 128 rows .* these are per 1"):
            jax.eval_shape(functools.partial(scaled_gpu._call_sm90, how.plan),
                           *_avals(1, 4096, 1160, 1024))  # fmt: skip


def _avals(batch, m, n, k, dtype=jnp.float8_e4m3fn, block=128, scale=jnp.float32):
    return (jax.ShapeDtypeStruct((batch, m, k), dtype), jax.ShapeDtypeStruct((batch, n, k), dtype),
            jax.ShapeDtypeStruct((batch, m, k // block), scale),
            jax.ShapeDtypeStruct((batch, n, k // block), scale))  # fmt: skip


def _export(avals, out_dtype=jnp.bfloat16):
    fn = jax.jit(lambda *a: jax_sm100.scaled_matmul(*a, preferred_element_type=out_dtype))
    with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
        with jax_sm100.lowerings() as seen:
            exp = jax.export.export(fn, platforms=["cuda"],
                                    disabled_checks=ffi.export_safety_checks())(*avals)  # fmt: skip
    return exp.mlir_module(), seen[-1]


@absltest.skipUnless(shutil.which("g++") or shutil.which("c++"),
                     "the CUDA lowering builds the FFI handler: needs g++/c++")  # fmt: skip
class ScaledLoweringTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("square", (1, 1024, 1024, 1024), jnp.bfloat16),
        ("ragged_rows", (1, 202, 136, 384), jnp.bfloat16),  # m padded to 204 in the scales
        ("batched", (3, 256, 384, 512), jnp.bfloat16),
        ("stream_k", (1, 8192, 8192, 8192), jnp.bfloat16),
    )
    def test_one_custom_call(self, shape, out_dtype):
        batch, m, n, k = shape
        text, how = _export(_avals(*shape), out_dtype)
        self.assertEqual(how.plan.kernel, planning.KERNEL_SM90_SCALED)
        self.assertEqual((how.plan.m, how.plan.batch), (m, batch))
        self.assertIn("block-scaled kernel", how.note)
        (call,) = [ln for ln in text.splitlines() if "custom_call @jax_sm100_gemm" in ln]
        self.assertNotIn("stablehlo.dot_general", text)
        # a, b, d, sfa, sfb: inputs 0 and 1, the result, the transposed scales (inputs 2, 3);
        # stream-K's workspace a second result, its flags zeros passed in and aliased.
        if how.plan.stream_k:
            self.assertIn("order = dense<[0, 1, -1, 2, 3, -2, 4]>", call)
            self.assertIn("output_tuple_indices = [2], operand_index = 4", call)
        else:
            self.assertIn("order = dense<[0, 1, -1, 2, 3]>", call)
        ld = -(-m // 4) * 4
        self.assertIn(f"tensor<{batch}x{k // 128}x{ld}xf32>", call)
        out = {"bfloat16": "bf16", "float16": "f16"}[jnp.dtype(out_dtype).name]
        self.assertIn(f"tensor<{batch}x{m}x{n}x{out}>", call.split(" -> ")[-1])
        objects = re.findall(r'object = dense<"0x([0-9A-F]+)"', text)
        self.assertLen(objects, 1)
        self.assertIn(b"Sm90ScaledGemmKernel", bytes.fromhex(objects[0]))

    @parameterized.named_parameters(
        ("mxfp8", _avals(1, 256, 256, 256, block=32, scale=jnp.float8_e8m0fnu), "per 32"),
        ("bf16_data", _avals(1, 256, 256, 256, dtype=jnp.bfloat16), "takes fp8 data"),
        ("n_unaligned", _avals(1, 256, 100, 256), "not a multiple of 16 bytes"),
        ("two_blocks", (*_avals(1, 256, 256, 256)[:3],
                        jax.ShapeDtypeStruct((1, 256, 4), jnp.float32)), "blocks [64, 128]"),
    )  # fmt: skip
    def test_xla_where_no_kernel_runs(self, avals, reason):
        text, how = _export(avals)
        self.assertNotIn("jax_sm100_gemm", text)
        self.assertIn("XLA ops", how.note)
        self.assertIn(reason, how.note)

    @parameterized.parameters(
        (jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.float32),
        (jnp.float8_e8m0fnu, jnp.float8_e8m0fnu), (jnp.float8_e5m2, jnp.float8_e4m3fn),
    )  # fmt: skip
    def test_scales_of_other_dtypes_converted(self, lhs_scale, rhs_scale):
        # Scales per 128 of another dtype (each exact in float32), alike or mixed: converted
        # for the kernel (they ran on XLA's ops), the float32 plan, the note says so.
        a, b, ls, rs = _avals(1, 1024, 1024, 1024)
        ls, rs = ls.update(dtype=lhs_scale), rs.update(dtype=rhs_scale)
        text, how = _export((a, b, ls, rs))
        _, want = _export(_avals(1, 1024, 1024, 1024))
        self.assertEqual(how.plan, want.plan)
        self.assertIn("block-scaled kernel", how.note)
        names = sorted({jnp.dtype(d).name for d in (lhs_scale, rhs_scale)} - {"float32"})
        self.assertIn(f"; {' and '.join(names)} scales converted to float32 (exact)", how.note)
        self.assertIn("tensor<1x8x1024xf32>", text.split("custom_call @jax_sm100_gemm")[1])
        # Not where the kernel does not run them (bfloat16 data; n of 100 fp8 elements, not a
        # multiple of 16 bytes): XLA's ops, as they were, and the note does not say converted.
        _, other = _export((a.update(dtype=jnp.bfloat16), b.update(dtype=jnp.bfloat16), ls, rs))
        _, unaligned = _export(
            (a, b.update(shape=(1, 100, 1024)), ls, rs.update(shape=(1, 100, 8)))
        )
        for how in (other, unaligned):
            self.assertIn("XLA ops", how.note)
            self.assertNotIn("converted", how.note)
        self.assertIn("scale_dtype='float32'", str(jax_sm100.plan(
            1024, 1024, 1024, a_dtype=E4M3, b_dtype=E4M3, scale_dtype="bfloat16",
            scale_block=128, arch="sm_90a")))  # fmt: skip

    def test_overlap_from_the_environment(self):
        # JAX_SM100_SCALED_OVERLAP=1 while a call is lowered: its plan takes the overlapped
        # main loop (a binary of its own); the next lowering without it does not.
        avals = _avals(1, 4096, 4096, 1024)  # 256 x 128 tiles: not overlapped unless asked
        with mock.patch.dict(os.environ, {scaled_planning.OVERLAP_ENV: "1"}):
            text, how = _export(avals)
        default_text, default = _export(avals)
        self.assertEqual((how.plan.kernel, how.plan.scaled_overlap, how.plan.cta_tile_mnk),
                         (planning.KERNEL_SM90_SCALED, True, (128, 128, 128)))  # fmt: skip
        self.assertEqual((default.plan.scaled_overlap, default.plan.cta_tile_mnk),
                         (False, (256, 128, 128)))  # fmt: skip
        objects = [re.findall(r'object = dense<"0x([0-9A-F]+)"', t) for t in (text, default_text)]
        self.assertNotEqual(objects[0], objects[1])

    def test_no_target_runs_xla(self):
        fn = jax.jit(jax_sm100.scaled_matmul)
        with mock.patch.object(dispatch, "device_target", lambda: None):
            with jax_sm100.lowerings() as seen:
                jax.export.export(fn, platforms=["cuda"])(*_avals(1, 256, 256, 256))
        self.assertIsNone(seen[-1].plan)
        self.assertIn("no sm_90a/sm_100a device", seen[-1].note)

    def test_vmap_merges_into_the_batch(self):
        avals = [jax.ShapeDtypeStruct((2, *a.shape), a.dtype) for a in _avals(1, 256, 256, 256)]
        fn = jax.vmap(lambda *a: jax_sm100.scaled_matmul(*a, preferred_element_type=jnp.bfloat16))
        checks = ffi.export_safety_checks()
        with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_90a"}):
            with jax_sm100.lowerings() as seen:
                exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
                    *avals
                )
        self.assertEqual(seen[-1].plan.batch, 2)
        self.assertEqual(exp.out_avals[0].shape, (2, 1, 256, 256))
        self.assertEqual(np.dtype(exp.out_avals[0].dtype), np.dtype(jnp.bfloat16))

    def test_vmap_with_shared_weights_reads_them_once(self):
        # Per-example activations against one weight the vmap leaves unmapped: on both arches
        # the lowering folds the examples into lhs's rows (a reshape) and runs one product
        # whose custom call takes the weight [1, n, k] as it is, and says so.
        cases = (
            ("sm_90a", "fp8_block128", "fp8_block128x128", "1x4x512xf32", "1x4x4xf32"),
            ("sm_100a", "mxfp8", "mxfp8", "8192xf8E8M0FNU", "8192xf8E8M0FNU"),
        )
        for arch, lhs_recipe, rhs_recipe, sfa, sfb in cases:
            x = jax.ShapeDtypeStruct((4, 1, 128, 512), jnp.float32)
            w = jax.ShapeDtypeStruct((1, 512, 512), jnp.float32)
            lq, ls = jax.eval_shape(functools.partial(jax_sm100.quantize, recipe=lhs_recipe), x)
            rq, rs = jax.eval_shape(functools.partial(jax_sm100.quantize, recipe=rhs_recipe), w)
            fn = jax.jit(jax.vmap(functools.partial(jax_sm100.scaled_matmul,
                                                    preferred_element_type=jnp.bfloat16),
                                  (0, None, 0, None)))  # fmt: skip
            with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}):
                with jax_sm100.lowerings() as seen:
                    exp = jax.export.export(fn, platforms=["cuda"],
                                            disabled_checks=ffi.export_safety_checks())(
                        lq, rq, ls, rs)  # fmt: skip
            self.assertEqual(exp.out_avals[0].shape, (4, 1, 128, 512))
            low = seen[-1]
            self.assertEqual((low.plan.m, low.plan.batch), (512, 1), arch)
            self.assertIn("lhs's 4 batches as rows against the one shared rhs", low.note)
            (call,) = [ln for ln in exp.mlir_module().splitlines()
                       if "custom_call @jax_sm100_gemm" in ln]  # fmt: skip
            signature = call[call.rindex(" : (") :]
            self.assertIn(f"(tensor<1x512x512xf8E4M3FN>, tensor<1x512x512xf8E4M3FN>, "
                          f"tensor<{sfa}>, tensor<{sfb}>)", signature)  # fmt: skip
            # No example at all: no rows to fold; XLA's ops.
            empty = [jax.ShapeDtypeStruct((0, *a.shape[1:]), a.dtype) for a in (lq, ls)]
            with mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": arch}):
                with jax_sm100.lowerings() as seen:
                    exp = jax.export.export(fn, platforms=["cuda"],
                                            disabled_checks=ffi.export_safety_checks())(
                        empty[0], rq, empty[1], rs)  # fmt: skip
            self.assertEqual(exp.out_avals[0].shape, (0, 1, 128, 512))
            self.assertNotIn("as rows", seen[-1].note)

    def test_folded_rows_keep_their_scales(self):
        # The shared-rhs fold takes lhs [B, m, k] as [1, B m, k]: its scales, in every layout
        # (per row, 128-row tiles, mxfp8's and nvfp4's blocked atoms), mean for each folded row
        # what they meant for it before; reshaped as they are where every batch holds whole
        # tiles or atoms.
        for recipe in ("fp8_block128", "fp8_block128x128", "mxfp8", "nvfp4"):
            for m in (1, 96, 128, 200, 256):
                x = jnp.asarray(np.random.default_rng(m).standard_normal((3, m, 512)), jnp.float32)
                data, scales = jax_sm100.quantize(x, recipe)
                rows = scaled_gpu._rows(data.shape, scales)
                got = scale_layout.plain((1, 3 * m, 512), rows).astype(jnp.float32)
                want = scale_layout.plain(data.shape, scales).astype(jnp.float32)
                np.testing.assert_array_equal(got, want.reshape(1, 3 * m, -1), f"{recipe} {m}")
                if m % 128 == 0:
                    self.assertEqual(rows.ndim, scales.ndim, f"{recipe} {m}")  # as they are


if __name__ == "__main__":
    absltest.main()
