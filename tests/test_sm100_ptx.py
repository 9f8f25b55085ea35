"""The SM100 (tcgen05) kernel family, verified by compiling it for sm_100a on a CPU machine.

There is no SM100 GPU in CI, so these tests are the evidence for every claim about the SM100
kernels: each case plans a problem for sm_100a, forces a tile / cluster / dtype / epilogue
combination with `dataclasses.replace`, compiles it through `compile_plan` and reads the PTX:

  * tcgen05.mma of the expected kind (f16, tf32, f8f6f4) and cta_group (1 or 2), and no other;
  * tcgen05.alloc and tcgen05.dealloc of exactly the plan's `tmem_alloc_cols`;
  * tcgen05.ld (accumulators leave TMEM through the tensor-memory load path);
  * TMA tensor loads into SMEM that complete on an mbarrier, multicast when the cluster shares
    an operand, cta_group::2 loads for 2-CTA plans; TMA tensor stores of D;
  * the mbarrier transaction counts equal the bytes a stage moves, computed here independently
    from the plan (the kernel reads them off its TMA atoms), and a C-sized count when C is read.

What this does not show: that the kernel computes the right numbers, or how fast it runs. Those
need an SM100 GPU.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import shutil
import subprocess
import tempfile

import cuda.bindings.driver as cuda
from absl.testing import absltest, parameterized

from jax_sm100._src import constraints, planning
from jax_sm100._src.compile import compile_plan
from jax_sm100._src.kernels import family, sm100_gemm
from jax_sm100._src.kernels.spec import KernelSpec

_MMA_KIND = {
    "bfloat16": "f16",
    "float16": "f16",
    "float32": "tf32",
    "float8_e4m3fn": "f8f6f4",
    "float8_e5m2": "f8f6f4",
}

# Each case: planner arguments, plan fields to force, spec fields to add. About 1 s of compile
# each; the grid covers 1-CTA and 2-CTA, clusters with and without multicast, every operand
# dtype, both operand majors, with and without C, bias and activations, and batch broadcast.
CASES = [
    dict(
        testcase_name="bf16_1cta_128x256_c1x1",
        problem=dict(a_dtype="bfloat16", b_dtype="bfloat16"),
        force=dict(use_2cta=False, mma_tiler_mnk=(128, 256, 64), cluster_shape_mn=(1, 1)),
    ),
    dict(
        testcase_name="bf16_1cta_128x128_c2x2_C_bias_gelu_alpha_beta",
        problem=dict(a_dtype="bfloat16", b_dtype="bfloat16", c_dtype="bfloat16"),
        force=dict(use_2cta=False, mma_tiler_mnk=(128, 128, 64), cluster_shape_mn=(2, 2)),
        epilogue=dict(bias_dtype="float32", activation="gelu", alpha=0.5, beta=-1.5),
    ),
    dict(
        testcase_name="bf16_2cta_256x256_c2x1",
        problem=dict(a_dtype="bfloat16", b_dtype="bfloat16"),
        force=dict(use_2cta=True, mma_tiler_mnk=(256, 256, 64), cluster_shape_mn=(2, 1)),
    ),
    dict(
        testcase_name="bf16_2cta_256x128_c4x2_C",
        problem=dict(a_dtype="bfloat16", b_dtype="bfloat16", c_dtype="bfloat16"),
        force=dict(use_2cta=True, mma_tiler_mnk=(256, 128, 64), cluster_shape_mn=(4, 2)),
    ),
    dict(
        testcase_name="fp16_2cta_128x256_c2x1_f32out_C_silu",
        problem=dict(a_dtype="float16", b_dtype="float16", out_dtype="float32", c_dtype="float32"),
        force=dict(use_2cta=True, mma_tiler_mnk=(128, 256, 64), cluster_shape_mn=(2, 1)),
        epilogue=dict(activation="silu"),
    ),
    dict(
        testcase_name="fp16_1cta_64x256_c1x2_relu_bias",
        problem=dict(a_dtype="float16", b_dtype="float16"),
        force=dict(use_2cta=False, mma_tiler_mnk=(64, 256, 64), cluster_shape_mn=(1, 2)),
        epilogue=dict(activation="relu", bias_dtype="float16"),
    ),
    dict(
        testcase_name="tf32_planned",
        problem=dict(a_dtype="float32", b_dtype="float32", out_dtype="float32"),
    ),
    dict(
        testcase_name="tf32_1cta_128x128_c2x1_Amajor_m_Bmajor_k",
        problem=dict(a_dtype="float32", b_dtype="float32", a_major="m", b_major="k"),
        force=dict(use_2cta=False, mma_tiler_mnk=(128, 128, 32), cluster_shape_mn=(2, 1)),
    ),
    dict(
        testcase_name="e4m3_planned",
        problem=dict(a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn"),
    ),
    dict(
        testcase_name="e5m2_1cta_128x128_c1x4_f16out_Bmajor_k",
        problem=dict(
            a_dtype="float8_e5m2", b_dtype="float8_e5m2", out_dtype="float16", b_major="k"
        ),
        force=dict(use_2cta=False, mma_tiler_mnk=(128, 128, 128), cluster_shape_mn=(1, 4)),
    ),
    dict(
        testcase_name="e4m3_2cta_256x256_c2x2_C_bias_batched_broadcast",
        problem=dict(a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn", c_dtype="bfloat16", batch=3),
        force=dict(use_2cta=True, mma_tiler_mnk=(256, 256, 128), cluster_shape_mn=(2, 2)),
        epilogue=dict(bias_dtype="bfloat16", a_batched=False, c_batched=False),
    ),
    # The forward under grad (D and the pre-activation Z, two TMA stores) and the backward's
    # activation-gradient epilogue (act'(C) * acc, C the saved pre-activation, B k-major).
    dict(
        testcase_name="bf16_2cta_256x256_c2x1_bias_gelu_preact",
        problem=dict(a_dtype="bfloat16", b_dtype="bfloat16", preact_out=True),
        force=dict(use_2cta=True, mma_tiler_mnk=(256, 256, 64), cluster_shape_mn=(2, 1)),
        epilogue=dict(bias_dtype="bfloat16", activation="gelu", preact_out=True),
    ),
    dict(
        testcase_name="bf16_1cta_128x256_c1x2_Bmajor_k_act_grad_gelu",
        problem=dict(a_dtype="bfloat16", b_dtype="bfloat16", c_dtype="bfloat16", b_major="k"),
        force=dict(use_2cta=False, mma_tiler_mnk=(128, 256, 64), cluster_shape_mn=(1, 2)),
        epilogue=dict(act_grad="gelu"),
    ),
    dict(
        testcase_name="bf16_2cta_256x64_c2x1_Amajor_m_batched_broadcast_B",
        problem=dict(a_dtype="bfloat16", b_dtype="bfloat16", a_major="m", batch=4),
        force=dict(use_2cta=True, mma_tiler_mnk=(256, 64, 64), cluster_shape_mn=(2, 1)),
        epilogue=dict(b_batched=False),
    ),
]


def _plan(problem, force):
    args = dict(problem)
    p = planning.plan(4096, 4096, 4096, arch="sm_100a", **args)
    if force:
        # Take the deepest A/B pipeline that fits the forced tile, as the planner would.
        for stages in range(8, constraints.MIN_AB_STAGES - 1, -1):
            try:
                return dataclasses.replace(p, num_ab_stages=stages, **force)
            except constraints.PlanError as e:
                if "shared memory" not in str(e):
                    raise
        raise AssertionError(f"no stage count fits {force}")
    return p


def _alloc_columns(ptx: str, op: str) -> list[int]:
    """Column counts of every `tcgen05.<op>` (alloc or dealloc), immediate or via a mov."""
    cols = []
    for m in re.finditer(rf"tcgen05\.{op}\.[\w:.]+\s+[^;]*?,\s*(%r\d+|\d+);", ptx):
        operand = m.group(1)
        if operand.isdigit():
            cols.append(int(operand))
            continue
        movs = re.findall(rf"mov\.b32\s+{re.escape(operand)},\s*(\d+);", ptx[: m.start()])
        if not movs:
            raise AssertionError(f"no constant feeds {operand} of {m.group(0)!r}")
        cols.append(int(movs[-1]))
    return cols


def _constant_operands(ptx: str, pattern: str) -> list[int]:
    """The last operand of every instruction matching `pattern`, an immediate or a mov'd one
    (-1 where no constant feeds it)."""
    found = []
    for m in re.finditer(pattern + r"[\w:.]*\s+[^;]*?,\s*(%r\d+|\d+);", ptx):
        operand = m.group(1)
        if operand.isdigit():
            found.append(int(operand))
            continue
        movs = re.findall(rf"mov\.b32\s+{re.escape(operand)},\s*(\d+);", ptx[: m.start()])
        found.append(int(movs[-1]) if movs else -1)
    return found


def _expect_tx_bytes(ptx: str) -> set[int]:
    """Constant transaction counts of every mbarrier.arrive.expect_tx."""
    return set(_constant_operands(ptx, r"mbarrier\.arrive\.expect_tx"))


def _ptxas_log(ptx: str, arch: str) -> str | None:
    """What `ptxas -v` prints compiling `ptx` for `arch`, or None without a ptxas that takes
    the arch."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run(
            [ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
        )
    if run.returncode != 0:
        return None  # a ptxas too old for the arch; the DSL's own compile already passed
    return run.stderr


def ptxas_spill_bytes(ptx: str, arch: str = "sm_100a") -> tuple[int, int] | None:
    """(spill store bytes, spill load bytes) ptxas reports for `ptx` on `arch`, or None without
    a ptxas that takes the arch."""
    log = _ptxas_log(ptx, arch)
    if log is None:
        return None
    stores = re.findall(r"(\d+) bytes spill stores", log)
    loads = re.findall(r"(\d+) bytes spill loads", log)
    return sum(int(x) for x in stores), sum(int(x) for x in loads)


def wgmma_serialized(ptx: str) -> list[str] | None:
    """ptxas's notes that it serialized the wgmma instructions of `ptx` (sm_90a: "Potential
    Performance Loss: wgmma.mma_async instructions are serialized due to ..."), [] when it did
    not, None without a ptxas. Serialized, each wgmma waits for the previous one: the SM90
    grouped kernels ran so until the tenth session (their accumulators read on a path ptxas
    could not rule out while a batch was in flight; a thread-index branch it took for
    divergent)."""
    log = _ptxas_log(ptx, "sm_90a")
    if log is None:
        return None
    return re.findall(r"wgmma\.mma_async instructions are serialized due to [^']*", log)


def _ptxas_spill_bytes(ptx: str) -> int | None:
    """Register spill bytes ptxas reports for sm_100a, or None without a CUDA 12.8+ ptxas."""
    spills = ptxas_spill_bytes(ptx)
    return None if spills is None else spills[0]


class Sm100PtxTest(parameterized.TestCase):
    @parameterized.named_parameters(*CASES)
    def test_ptx(self, problem, force=None, epilogue=None):
        plan = _plan(problem, force)
        self.assertEqual(plan.kernel, "sm100_tcgen05", plan.reason)
        spec = dataclasses.replace(KernelSpec.for_plan(plan), **(epilogue or {}))
        self.assertTrue(sm100_gemm.Sm100GemmKernel.can_implement(plan, spec))

        compiled = compile_plan(plan, spec)
        ptx = compiled.ptx
        self.assertIn(".target sm_100a", ptx)
        self.assertEqual(compiled.cubin[:4], b"\x7fELF")

        # The MMA: one kind and one CTA group, the plan's.
        group = 2 if plan.use_2cta else 1
        mmas = set(re.findall(r"tcgen05\.mma\.(cta_group::\d)\.(kind::\w+)", ptx))
        self.assertEqual(mmas, {(f"cta_group::{group}", f"kind::{_MMA_KIND[plan.a_dtype]}")})

        # TMEM: allocated and freed with the plan's column count, read with tcgen05.ld.
        self.assertEqual(set(_alloc_columns(ptx, "alloc")), {plan.tmem_alloc_cols})
        self.assertEqual(set(_alloc_columns(ptx, "dealloc")), {plan.tmem_alloc_cols})
        self.assertIn(f"tcgen05.alloc.cta_group::{group}", ptx)
        self.assertRegex(ptx, r"tcgen05\.ld\.sync\.aligned\.\w+\.x\d+\.b32")
        self.assertIn("tcgen05.commit", ptx)

        # TMA: loads that complete on an mbarrier, multicast iff the cluster shares an operand,
        # 2-CTA loads for 2-CTA plans; stores of D from SMEM.
        loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\.[\w:.]+", ptx)
        self.assertTrue(loads, "no TMA loads")
        self.assertTrue(all("mbarrier::complete_tx::bytes" in x for x in loads), loads)
        cm, cn = plan.cluster_shape_mn
        multicast = cn > 1 or cm > group
        self.assertEqual(any("multicast::cluster" in x for x in loads), multicast, loads)
        self.assertEqual(any("cta_group::2" in x for x in loads), plan.use_2cta, loads)
        self.assertRegex(ptx, r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta\.")
        # One TMA descriptor each for A, B and D, and for C and the pre-activation Z when the
        # spec has them (each prefetched once by the warp that uses it).
        descriptors = len(re.findall(r"prefetch\.tensormap\b", ptx))
        self.assertEqual(descriptors, 3 + spec.has_c + spec.preact_out)
        # The epilogue keeps NaN: relu's max and gelu's and silu's clamp of the saved
        # pre-activation are max.NaN / min.NaN (kernels/common.py), as jnp.maximum and jnp.clip
        # keep it (relu's derivative is a select, no clamp).
        clamped = spec.act_grad in ("gelu", "silu")
        if spec.activation == "relu" or clamped:
            self.assertIn("max.NaN.f32", ptx)
        if clamped:
            self.assertIn("min.NaN.f32", ptx)

        # Transaction bytes per stage, from the plan alone: with cta_group::2 the leader's barrier
        # receives both halves, so either way a stage is the whole MMA tile's A and B.
        mm, mn, mk = plan.mma_tiler_mnk
        bits = constraints.DTYPE_BITS[plan.a_dtype]
        expected = {(mm + mn) * mk * bits // 8}
        if spec.has_c:
            expected.add(
                plan.epi_tile[0] * plan.epi_tile[1] * constraints.DTYPE_BITS[spec.c_dtype] // 8
            )
        self.assertEqual(_expect_tx_bytes(ptx), expected)

        # Warp roles: 4 epilogue warps, the MMA warp, the A/B producer, and a C producer.
        self.assertIn(f".reqntid {32 * (7 if spec.has_c else 6)}, 1, 1", ptx)
        # One tcgen05.mma per instruction-K step of the K tile (unrolled; peeling may copy it).
        n_mma = len(re.findall(r"tcgen05\.mma\.", ptx))
        k_steps = mk // constraints.mma_inst_k(plan.a_dtype)
        self.assertTrue(n_mma >= k_steps and n_mma % k_steps == 0, (n_mma, k_steps))
        # Epilogue extras leave traces only when asked for: bias is the only global load the
        # kernel makes outside TMA, and tanh only comes from GELU.
        self.assertEqual("ld.global" in ptx, spec.has_bias)
        self.assertEqual("tanh.approx.f32" in ptx, "gelu" in (spec.activation, spec.act_grad))

        # The epilogue warps meet at their barrier after their last TMEM load and before the
        # columns are given back (named barrier 1, the 128 epilogue threads).
        free = ptx.index("tcgen05.relinquish_alloc_permit")
        last_barrier = ptx.rfind("bar.sync \t1, 128;", 0, free)
        self.assertGreater(last_barrier, 0, "no epilogue barrier before the TMEM free")
        self.assertNotIn("tcgen05.ld", ptx[last_barrier:free])
        # The grid: the resident clusters of the plan's own resources (one CTA per SM).
        size = plan.cluster_shape_mn[0] * plan.cluster_shape_mn[1]
        resident = constraints.max_resident_ctas(plan.smem_bytes, 32 * (7 if spec.has_c else 6))
        self.assertEqual(planning.resident_clusters(plan), plan.num_sms * resident // size)

        # Where a CUDA toolkit is installed, the kernel must not spill registers.
        spills = _ptxas_spill_bytes(ptx)
        if spills is not None:
            self.assertEqual(spills, 0, "ptxas reports register spills")

    def test_compile_plan_gives_a_loadable_object(self):
        plan = planning.plan(512, 512, 512, a_dtype="bfloat16", b_dtype="bfloat16")
        compiled = compile_plan(plan)
        # The host object the FFI handler loads: an x86-64 ELF carrying the sm_100a cubin.
        self.assertEqual(compiled.object_bytes[:4], b"\x7fELF")
        self.assertIn(b"sm_100a", compiled.object_bytes)
        self.assertEqual([t.name for t in compiled.tensor_args], ["a", "b", "d"])

    def test_family_registry(self):
        # compile.py finds each plan's family by its kernel name; XLA's dot has none.
        for kernel in planning.KERNELS:
            if kernel == planning.KERNEL_XLA:
                with self.assertRaisesRegex(ValueError, "no kernel family"):
                    family.family(kernel)
                continue
            self.assertTrue(issubclass(family.family(kernel), family.KernelFamily))
        # Every GEMM kernel, and the quantize_both kernel (a QuantizePlan's).
        self.assertEqual(
            set(family.FAMILIES), set(planning.KERNELS) - {planning.KERNEL_XLA} | {"quantize_both"}
        )
        self.assertTrue(issubclass(family.family("quantize_both"), family.KernelFamily))
        # Each host entry point's stream is typed as a CUstream: the DSL exports an untyped one
        # (a fake stream at compile time) into the object's argument spec untyped, and
        # `export_to_c` refuses it ("Unsupported argument ... stream = FakeStream").
        for kernel in family.FAMILIES:
            call = family.family(kernel).__call__
            call = getattr(call, "__wrapped__", call)
            annotation = inspect.signature(call).parameters["stream"].annotation
            self.assertIn(annotation, ("cuda.CUstream", cuda.CUstream), kernel)

    def test_rejects_other_plans(self):
        sm90 = planning.plan(
            4096, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a"
        )
        self.assertFalse(sm100_gemm.Sm100GemmKernel.can_implement(sm90, KernelSpec.for_plan(sm90)))
        with self.assertRaisesRegex(ValueError, "not an sm100_tcgen05 plan"):
            sm100_gemm.Sm100GemmKernel(sm90, KernelSpec.for_plan(sm90))

        sm100 = planning.plan(4096, 4096, 4096, a_dtype="bfloat16", b_dtype="bfloat16")
        other = dataclasses.replace(KernelSpec.for_plan(sm100), out_dtype="float16")
        with self.assertRaisesRegex(ValueError, "out_dtype"):
            sm100_gemm.Sm100GemmKernel(sm100, other)


if __name__ == "__main__":
    absltest.main()
