"""The SM90 kernel family compiles for sm_90a on a CPU machine and emits Hopper instructions."""

import dataclasses
import re
import types
from unittest import mock

from absl.testing import absltest, parameterized

from jax_sm100._src import compile as compile_mod
from jax_sm100._src import planning
from jax_sm100._src.kernels import sm90_gemm
from jax_sm100._src.kernels.spec import KernelSpec
from tests.test_sm100_ptx import ptxas_spill_bytes, wgmma_serialized


def _plan(m, n, k, dtype="bfloat16", **kw):
    # force_kernel: these tests are about the kernel, also on problems small enough that the
    # planner would send them to XLA's dot (`planning.SM90_MIN_FLOPS`).
    return planning.plan(
        m, n, k, a_dtype=dtype, b_dtype=dtype, arch="sm_90a", force_kernel=True, **kw
    )


class Sm90PtxTest(parameterized.TestCase):
    def test_big_tile_instructions(self):
        p = _plan(4096, 4096, 4096)
        self.assertEqual(p.kernel, "sm90_wgmma")
        ptx = compile_mod.compile_plan(p).ptx
        self.assertIn(".target sm_90a", ptx)
        self.assertIn("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16", ptx)
        self.assertRegex(ptx, r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40")
        self.assertRegex(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232")
        self.assertIn("multicast::cluster", ptx)  # the 2x1 cluster shares B
        self.assertIn("stmatrix.sync.aligned", ptx)
        self.assertIn("cp.async.bulk.tensor.3d.global.shared::cta", ptx)  # TMA store

    @parameterized.parameters(
        dict(a_major="k", b_major="n"),
        dict(a_major="m", b_major="k"),
        dict(a_major="m", b_major="n"),
        dict(a_major="k", b_major="k"),
    )
    def test_layouts_compile(self, a_major, b_major):
        p = _plan(1024, 1024, 512, a_major=a_major, b_major=b_major)
        compiled = compile_mod.compile_plan(p)
        self.assertIn("wgmma.mma_async", compiled.ptx)
        self.assertGreater(len(compiled.cubin), 1000)

    @parameterized.parameters(
        dict(shape=(8192, 14336, 4096)),  # the planner's ping-pong 128x160
        dict(shape=(2048, 2048, 4096)),  # cooperative
    )
    def test_training_epilogues(self, shape):
        # The forward under grad writes D and the pre-activation Z (a fourth TMA descriptor);
        # the backward's act'(C) * acc stages C by TMA on the ping-pong plan (a fourth
        # descriptor, no global loads) and reads it as 32-bit vectors on the cooperative one.
        fwd = _plan(*shape, preact_out=True)
        spec = KernelSpec("bfloat16", "bfloat16", "bfloat16", bias_dtype="bfloat16",
                          activation="gelu", preact_out=True)  # fmt: skip
        ptx = compile_mod.compile_plan(fwd, spec).ptx
        self.assertEqual(len(re.findall(r"prefetch\.tensormap\b", ptx)), 4)
        self.assertLessEqual(fwd.smem_bytes, planning.smem_capacity("sm_90a"))
        bwd = _plan(*shape, c_dtype="bfloat16", b_major="k")
        spec = KernelSpec("bfloat16", "bfloat16", "bfloat16", b_major="k", c_dtype="bfloat16",
                          act_grad="gelu")  # fmt: skip
        ptx = compile_mod.compile_plan(bwd, spec).ptx
        self.assertEqual(bwd.stage_c, bwd.pingpong)
        self.assertEqual(len(re.findall(r"prefetch\.tensormap\b", ptx)), 3 + bwd.stage_c)
        self.assertEqual("ld.global.b32" in ptx, not bwd.stage_c)
        self.assertIn("tanh.approx.f32", ptx)
        # The pre-activation's clamp keeps NaN (common._clamp), as jnp.clip does.
        self.assertRegex(ptx, r"max\.NaN\.f32")
        self.assertRegex(ptx, r"min\.NaN\.f32")
        with self.assertRaisesRegex(ValueError, "preact_out"):
            sm90_gemm.Sm90GemmKernel(planning.sm90_variant(bwd, stage_c=False), dataclasses.replace(
                spec, act_grad=None, c_dtype=None, activation="relu", preact_out=True))  # fmt: skip

    @parameterized.named_parameters(
        ("cooperative", dict(tile_mn=(128, 256), pingpong=False), None),
        ("pingpong", dict(tile_mn=(128, 160), pingpong=True), None),
        ("stream_k", dict(tile_mn=(128, 256), pingpong=False, stream_k=True), None),
        ("staged_c_act_grad", dict(stage_c=True, stream_k=False),
         KernelSpec("bfloat16", "bfloat16", "bfloat16", b_major="k", c_dtype="bfloat16",
                    act_grad="gelu")),
    )  # fmt: skip
    def test_wgmma_not_serialized(self, edit, spec):
        # ptxas keeps every family's wgmma batches asynchronous: it serializes them (each
        # waiting for the previous) when a path may read the accumulators while a batch is in
        # flight (tests/test_sm100_ptx.py `wgmma_serialized`; the grouped kernels did).
        c = "bfloat16" if spec is not None else None
        p = _plan(8192, 14336, 4096, c_dtype=c, b_major="k")
        ptx = compile_mod.compile_plan(planning.sm90_variant(p, **edit), spec).ptx
        self.assertIn(wgmma_serialized(ptx), ([], None))
        split = planning.with_split(_plan(128, 4096, 16384), 4)
        self.assertIn(wgmma_serialized(compile_mod.compile_plan(split).ptx), ([], None))

    @parameterized.parameters(False, True)
    def test_staged_c(self, pingpong):
        # GemmPlan.stage_c: C by TMA into a shared-memory ring (a fourth descriptor), read from
        # shared memory: no global loads in the kernel; no register spills (where ptxas runs).
        p = _plan(8192, 14336, 4096, c_dtype="bfloat16", b_major="k")
        edit = {} if pingpong else dict(tile_mn=(128, 256), pingpong=False)
        q = planning.sm90_variant(p, stage_c=True, stream_k=False, **edit)
        self.assertEqual(q.pingpong, pingpong)
        self.assertGreater(q.smem_bytes, planning.sm90_variant(p, **edit).smem_bytes - 40000)
        spec = KernelSpec("bfloat16", "bfloat16", "bfloat16", b_major="k", c_dtype="bfloat16",
                          act_grad="gelu")  # fmt: skip
        ptx = compile_mod.compile_plan(q, spec).ptx
        self.assertEqual(len(re.findall(r"prefetch\.tensormap\b", ptx)), 4)
        self.assertNotIn("ld.global", ptx)
        self.assertRegex(ptx, r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global")
        # C leaves shared memory by ldmatrix, the inverse of D's stmatrix (the element a thread
        # reads is the one whose accumulator it holds).
        self.assertRegex(ptx, r"ldmatrix\.sync\.aligned\.m8n8\.x4(\.trans)?\.shared\.b16")
        for bad in (
            dict(stage_c=True, c_dtype=None),
            dict(
                stage_c=True,
                stream_k=True,
                mma_tiler_mnk=(128, 256, 64),
                pingpong=False,
                cluster_shape_mn=(2, 1),
            ),
        ):
            with self.assertRaisesRegex(planning.C.PlanError, "stage_c"):
                dataclasses.replace(p, **bad)

    @parameterized.parameters("relu", "gelu", "silu")
    def test_fused_epilogue_compiles(self, activation):
        p = _plan(512, 512, 512, dtype="float16", c_dtype="float16")
        spec = KernelSpec(
            "float16",
            "float16",
            "float16",
            c_dtype="float16",
            bias_dtype="float32",
            activation=activation,
            alpha=0.5,
            beta=0.25,
        )
        ptx = compile_mod.compile_plan(p, spec).ptx
        self.assertIn("wgmma.mma_async", ptx)
        if activation == "gelu":
            self.assertIn("tanh.approx.f32", ptx)
        if activation == "silu":
            self.assertIn("ex2.approx", ptx)
        if activation == "relu":  # one max.NaN an element: NaN stays NaN (common._activate)
            self.assertIn("max.NaN.f32", ptx)

    def test_relu_derivative_is_a_select(self):
        # act'(C) * acc for relu selects acc or 0 on C > 0 (as jax.nn.relu's derivative), so a
        # non-finite acc where relu is flat gives 0: no select of 1.0 or 0.0 multiplied in.
        p = _plan(4096, 4096, 4096, c_dtype="bfloat16", b_major="k")
        spec = KernelSpec("bfloat16", "bfloat16", "bfloat16", b_major="k", c_dtype="bfloat16",
                          act_grad="relu")  # fmt: skip
        ptx = compile_mod.compile_plan(p, spec).ptx
        self.assertIn("wgmma.mma_async", ptx)
        self.assertNotRegex(ptx, r"selp\.f32\s+%\w+, 0f3F800000, 0f00000000")
        self.assertRegex(ptx, r"setp\.gt\.(bf16|f32)")

    def test_small_tile_one_consumer_group(self):
        p = dataclasses.replace(_plan(4096, 4096, 4096), mma_tiler_mnk=(64, 128, 64),
                                cluster_shape_mn=(1, 1), num_ab_stages=4)  # fmt: skip
        ptx = compile_mod.compile_plan(p).ptx
        self.assertIn("m64n128k16", ptx)
        self.assertNotIn("multicast::cluster", ptx)

    @parameterized.parameters(((128, 192), "m64n192k16"), ((64, 256), "m64n256k16"))
    def test_pingpong(self, tile, inst):
        p = planning.sm90_variant(_plan(4096, 4096, 4096), tile_mn=tile, pingpong=True)
        ptx = compile_mod.compile_plan(p).ptx
        self.assertIn(f"wgmma.mma_async.sync.aligned.{inst}.f32.bf16.bf16", ptx)
        self.assertRegex(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232")
        # Turn barriers: each group waits on its own (bar.sync, 256 threads) and arrives on the
        # other's; the epilogue barriers hold one warp group (128 threads).
        self.assertRegex(ptx, r"bar\.arrive\s+%r\d+,\s*256;")
        self.assertRegex(ptx, r"bar\.sync\s+%r\d+,\s*256;")
        self.assertRegex(ptx, r"bar\.sync\s+%r\d+,\s*128;")
        self.assertIn("stmatrix.sync.aligned", ptx)

    @parameterized.parameters(
        ((128, 192), True, None), ((128, 256), False, "float32"), ((64, 128), False, None)
    )
    def test_swapped_store(self, tile, pingpong, bias):
        # A swapped plan's D goes out M-major: stmatrix's transposing form into M-major
        # sub-tiles, stored as they are by TMA; nothing spills.
        f8 = dict(a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn", b_major="k", arch="sm_90a")
        p = planning.plan(16384, 4096, 4096, out_dtype="bfloat16", **f8)
        self.assertTrue(p.swap_ab)
        p = planning.sm90_variant(p, tile_mn=tile, pingpong=pingpong, stream_k=False)
        spec = dataclasses.replace(KernelSpec.for_plan(p), bias_dtype=bias,
                                   activation="gelu" if bias else None)  # fmt: skip
        self.assertEqual((spec.d_major, spec.a_major, spec.b_major), ("m", "k", "k"))
        ptx = compile_mod.compile_plan(p, spec).ptx
        self.assertIn("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16", ptx)
        self.assertNotIn("stmatrix.sync.aligned.m8n8.x4.shared.b16", ptx)
        self.assertIn("cp.async.bulk.tensor.3d.global.shared::cta", ptx)
        self.assertIn(f"m64n{tile[1]}k32.f32.e4m3.e4m3", ptx)
        self.assertIn(ptxas_spill_bytes(ptx, "sm_90a"), ((0, 0), None))  # None: no ptxas

    @parameterized.parameters(
        ((4096, 7168, 16384), (256, 176), False), ((4096, 14336, 4096), (128, 176), True)
    )
    def test_176_column_tiles(self, shape, tile, pingpong):
        # The planner's 176-column 8-bit tiles: 16-column epilogue sub-tiles (32 does not divide
        # 176), m64n176 wgmmas, not serialized, nothing spilled (256x176 holds 176 float32
        # accumulators a thread).
        f8 = dict(a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn", b_major="k", arch="sm_90a")
        p = planning.plan(*shape, out_dtype="bfloat16", **f8)
        self.assertEqual((p.cta_tile_mnk[:2], p.pingpong), (tile, pingpong), p)
        self.assertEqual(p.epi_tile[1], 16)
        ptx = compile_mod.compile_plan(p).ptx
        self.assertIn("wgmma.mma_async.sync.aligned.m64n176k32.f32.e4m3.e4m3", ptx)
        self.assertIn(ptxas_spill_bytes(ptx, "sm_90a"), ((0, 0), None))  # None: no ptxas
        self.assertIn(wgmma_serialized(ptx), ([], None))

    def test_swapped_spec_refused_elsewhere(self):
        # D M-major is the dense SM90 kernel's on a swapped plan only.
        p = _plan(4096, 4096, 4096)
        spec = dataclasses.replace(KernelSpec.for_plan(p), d_major="m")
        self.assertIn("swapped dense plans only", sm90_gemm.Sm90GemmKernel.why_not(p, spec))

    def test_256_row_tile(self):
        # Two 64-row MMA blocks per consumer warp group; 128x32 epilogue sub-tiles, one block of
        # each warp group per sub-tile.
        p = planning.sm90_variant(_plan(8192, 8192, 8192), tile_mn=(256, 128), cluster_mn=(1, 2),
                                  pingpong=False)  # fmt: skip
        self.assertEqual(p.epi_tile, (128, 32))
        ptx = compile_mod.compile_plan(p).ptx
        self.assertIn("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", ptx)
        self.assertIn("multicast::cluster", ptx)

    def test_160_wide_tile(self):
        # cuBLAS's tile for tall and wide problems on the H200; B N-major gets a 64-byte swizzle.
        for pp in (True, False):
            p = planning.sm90_variant(_plan(16384, 4096, 4096), tile_mn=(128, 160), pingpong=pp)
            ptx = compile_mod.compile_plan(p).ptx
            self.assertIn("wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16", ptx)

    def test_kernel_refuses_mismatched_epilogue_tile(self):
        # The kernel reads each epilogue sub-tile as one run of registers; a ping-pong group with
        # a 128-row sub-tile would mix its two MMA blocks (seen wrong on the H200).
        p = planning.sm90_variant(_plan(4096, 4096, 4096), tile_mn=(128, 128), pingpong=True)
        spec = KernelSpec.for_plan(p)
        self.assertIsNone(sm90_gemm.Sm90GemmKernel.why_not(p, spec))
        fake = types.SimpleNamespace(**{f.name: getattr(p, f.name)
                                        for f in dataclasses.fields(p)})  # fmt: skip
        fake.epi_tile = (128, 32)
        why = sm90_gemm.Sm90GemmKernel.why_not(fake, spec)
        self.assertIn("warp-group split", why)

    def test_stream_k(self):
        # The stream-K schedule: the partial tiles' flags are released and acquired at GPU
        # scope, the partials written and read back in plain global stores and loads, and the
        # kernel takes its workspace as two more tensors of static shape (one slot per SM).
        p = planning.cooperative(_plan(8192, 8192, 8192))
        self.assertTrue(p.stream_k)
        compiled = compile_mod.compile_plan(p)
        ptx = compiled.ptx
        self.assertIn("ld.acquire.gpu.global.b32", ptx)
        self.assertRegex(ptx, r"atom\.global\.release(\.gpu)?\.add")
        acc_words = 128 * 256 // 256  # a 128x256 tile over two consumer warp groups
        self.assertEqual(ptx.count("st.global.b32"), acc_words)
        self.assertEqual(ptx.count("ld.global.b32"), acc_words)
        self.assertIn("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16", ptx)
        args = {t.name: t for t in compiled.tensor_args}
        self.assertEqual(list(args), ["a", "b", "d", "ws", "flags"])
        # The workspace's extent and stride are constants of the binary.
        self.assertEqual(
            (args["ws"].dynamic_shape_modes, args["ws"].dynamic_stride_modes), ((), ())
        )
        self.assertEqual(
            compile_mod.workspace_shapes(p),
            {"ws": ((p.num_sms * 128 * 256,), "float32"), "flags": ((p.num_sms,), "int32")},
        )
        # Without stream-K: no flags, no workspace.
        plain = compile_mod.compile_plan(dataclasses.replace(p, stream_k=False))
        self.assertNotIn("ld.acquire.gpu", plain.ptx)
        self.assertEqual([t.name for t in plain.tensor_args], ["a", "b", "d"])
        self.assertEqual(compile_mod.workspace_shapes(plain.plan), {})

    def test_fp8_k_major(self):
        p = _plan(1024, 1024, 1024, "float8_e4m3fn", out_dtype="bfloat16", b_major="k")
        if p.kernel == "xla_dot":
            self.skipTest(f"planner sends fp8 to XLA here: {p.reason}")
        ptx = compile_mod.compile_plan(p).ptx
        self.assertTrue(re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3", ptx))


def _shared_bytes(plan, spec=None) -> int:
    """The shared storage the compiled kernel of `plan` declares (its `shared` struct)."""
    kernels, init = [], sm90_gemm.Sm90GemmKernel.__init__

    def capture(self, *args, **kwargs):
        init(self, *args, **kwargs)
        kernels.append(self)

    with mock.patch.object(sm90_gemm.Sm90GemmKernel, "__init__", capture):
        compile_mod._compile(plan, spec or KernelSpec.for_plan(plan))
    return kernels[-1].shared.size_in_bytes()


class SharedMemoryTest(parameterized.TestCase):
    """The kernel's shared storage is what its plan counts (to the 1024-byte alignment of its
    struct) and fits a CTA: a kernel over the capacity cannot launch, which no CPU compile
    shows. Both cases below declared 1 KiB more than their plans before their layouts moved
    (helper-88): the group table just under a KiB's end with the work ring after D's stages,
    and staged C's barriers after D's stages."""

    @parameterized.parameters(8, 243, 244)
    def test_grouped(self, groups):
        p = planning.plan(65536, 128, 1024, a_dtype="bfloat16", b_dtype="bfloat16",
                          arch="sm_90a", groups=groups, ragged="m", b_major="k")  # fmt: skip
        self.assertEqual(p.dynamic_tiles, groups > 8)  # 8 groups: 2x1 clusters, no ring
        self.assertLessEqual(_shared_bytes(p), min(-(-p.smem_bytes // 1024) * 1024,
                                                   planning.smem_capacity("sm_90a")))  # fmt: skip

    def test_staged_c(self):
        p = planning.plan(8192, 14336, 4096, a_dtype="bfloat16", b_dtype="bfloat16",
                          c_dtype="bfloat16", arch="sm_90a")  # fmt: skip
        p = planning.sm90_variant(p, tile_mn=(64, 176))
        self.assertTrue(p.stage_c)
        self.assertEqual(p.smem_bytes, planning.smem_capacity("sm_90a"))
        self.assertLessEqual(_shared_bytes(p), p.smem_bytes)


if __name__ == "__main__":
    absltest.main()
