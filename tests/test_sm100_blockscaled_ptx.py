"""The SM100 block-scaled family (mxfp8, nvfp4), verified by compiling it for sm_100a on a CPU.

No SM100 GPU is available, so, as for the dense family (tests/test_sm100_ptx.py), the PTX is the
evidence. Each case plans a block-scaled problem for sm_100a, forces a tile / cluster / dtype
combination where it says so, compiles it through the package's compile path and reads:

  * tcgen05.mma of kind mxf8f6f4 (mxfp8) or mxf4nvf4 (nvfp4) with `block_scale` and the
    format's scale block, in the plan's CTA group, and no other MMA;
  * the scale factors' moves from SMEM into TMEM (tcgen05.cp 32x128b.warpx4), one per
    512-byte atom of a stage, before the stage's MMAs;
  * TMA loads of the scale factors (4-D boxes from the TensorMap descriptors) completing on the
    same mbarrier as A and B, and every mbarrier transaction count equal to the A and B bytes of
    a stage (from the plan) plus the descriptors' own `global_tx_bytes()` (times the CTAs of a
    pair), which in turn equal the plan's scale-factor bytes;
  * TMEM allocated with the plan's columns, which hold the accumulators and the scale factors.

What this does not show: that the kernel computes the right numbers, or how fast it runs.
"""

from __future__ import annotations

import dataclasses
import os
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_sm100
from jax_sm100._src import compile as compile_mod
from jax_sm100._src import constraints, dispatch, planning
from jax_sm100._src.kernels import family
from jax_sm100._src.kernels.sm100_blockscaled import Sm100BlockScaledGemmKernel
from jax_sm100._src.kernels.spec import KernelSpec
from jax_sm100._src.planning import sm100_blockscaled
from tests.test_sm100_ptx import _constant_operands, _ptxas_spill_bytes

_RECIPES = {
    "mxfp8": dict(scale_dtype="float8_e8m0fnu", scale_block=32),
    "nvfp4": dict(scale_dtype="float8_e4m3fn", scale_block=16),
}
_KIND = {"mxfp8": "mxf8f6f4", "nvfp4": "mxf4nvf4"}
E4M3, E5M2, E2M1 = "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"

CASES = [
    dict(testcase_name="mxfp8_e4m3_planned", recipe="mxfp8", dtypes=(E4M3, E4M3)),
    dict(
        testcase_name="mxfp8_e5m2_x_e4m3_1cta_128x128_c2x2_f16out_bias_relu",
        recipe="mxfp8",
        dtypes=(E5M2, E4M3),
        out_dtype="float16",
        force=dict(use_2cta=False, mma_tiler_mnk=(128, 128, 128), cluster_shape_mn=(2, 2)),
        epilogue=dict(bias_dtype="float16", activation="relu"),
    ),
    dict(
        testcase_name="mxfp8_e4m3_2cta_256x128_c4x2_batch3",
        recipe="mxfp8",
        dtypes=(E4M3, E4M3),
        batch=3,
        force=dict(use_2cta=True, mma_tiler_mnk=(256, 128, 128), cluster_shape_mn=(4, 2)),
    ),
    dict(testcase_name="nvfp4_planned", recipe="nvfp4", dtypes=(E2M1, E2M1)),
    dict(
        testcase_name="nvfp4_1cta_128x256_c1x1_f32out",
        recipe="nvfp4",
        dtypes=(E2M1, E2M1),
        out_dtype="float32",
        force=dict(
            use_2cta=False, mma_tiler_mnk=(128, 256, 256), cluster_shape_mn=(1, 1), num_acc_stages=1
        ),
    ),
    dict(
        testcase_name="nvfp4_2cta_256x128_c2x2",
        recipe="nvfp4",
        dtypes=(E2M1, E2M1),
        force=dict(use_2cta=True, mma_tiler_mnk=(256, 128, 256), cluster_shape_mn=(2, 2)),
    ),
    dict(
        testcase_name="nvfp4_1cta_128x128_c1x2",
        recipe="nvfp4",
        dtypes=(E2M1, E2M1),
        force=dict(use_2cta=False, mma_tiler_mnk=(128, 128, 256), cluster_shape_mn=(1, 2)),
    ),
]


def _plan(recipe, dtypes, out_dtype=None, batch=1, force=None):
    p = jax_sm100.plan(
        4096, 4096, 4096, a_dtype=dtypes[0], b_dtype=dtypes[1], out_dtype=out_dtype, batch=batch,
        arch="sm_100a", **_RECIPES[recipe],
    )  # fmt: skip
    if not force:
        return p
    # The deepest A/B pipeline the kernel's shared memory holds, as the planner takes it.
    for stages in range(12, constraints.MIN_AB_STAGES - 1, -1):
        try:
            forced = dataclasses.replace(p, num_ab_stages=stages, **force)
        except constraints.PlanError as e:
            if "shared memory" not in str(e):
                raise
            continue
        capacity = planning.smem_capacity("sm_100a")
        if sm100_blockscaled.kernel_smem_bytes(forced) <= capacity:
            return forced
    raise AssertionError(f"no stage count fits {force}")


def _compile_capturing_kernel(plan, spec):
    """compile.py's compile of (plan, spec), keeping the kernel object its trace ran on (which
    records the byte count of each scale-factor descriptor's box)."""
    kernels = []
    init = Sm100BlockScaledGemmKernel.__init__

    def capture(self, *args, **kwargs):
        init(self, *args, **kwargs)
        kernels.append(self)

    with mock.patch.object(Sm100BlockScaledGemmKernel, "__init__", capture):
        compiled = compile_mod._compile(plan, spec)
    (kernel,) = kernels
    return compiled, kernel


class Sm100BlockScaledPtxTest(parameterized.TestCase):
    @parameterized.named_parameters(*CASES)
    def test_ptx(self, recipe, dtypes, out_dtype=None, batch=1, force=None, epilogue=None):
        plan = _plan(recipe, dtypes, out_dtype, batch, force)
        self.assertEqual(plan.kernel, planning.KERNEL_SM100_BLOCKSCALED, plan.reason)
        spec = dataclasses.replace(KernelSpec.for_plan(plan), **(epilogue or {}))
        self.assertIsNone(Sm100BlockScaledGemmKernel.why_not(plan, spec))
        compiled, kernel = _compile_capturing_kernel(plan, spec)
        ptx = compiled.ptx
        self.assertIn(".target sm_100a", ptx)
        self.assertEqual(compiled.cubin[:4], b"\x7fELF")

        # The MMA: block-scaled, of the recipe's kind and scale block, in the plan's CTA group.
        group = 2 if plan.use_2cta else 1
        mmas = set(re.findall(r"tcgen05\.mma\.[\w:.]+", ptx))
        block = f"block{plan.scale_block}"
        self.assertEqual(
            {m.split(".collector")[0] for m in mmas},
            {f"tcgen05.mma.cta_group::{group}.kind::{_KIND[recipe]}.block_scale.{block}"},
        )
        mm, mn, mk = plan.mma_tiler_mnk
        k_steps = mk // constraints.mma_inst_k(plan.a_dtype)
        n_mma = len(re.findall(r"tcgen05\.mma\.", ptx))
        self.assertTrue(n_mma >= k_steps and n_mma % k_steps == 0, (n_mma, k_steps))

        # Scale factors into TMEM: one 32x128b (broadcast to the 4 lane quarters) copy per
        # 512-byte atom of a stage: the CTA's 128 rows of A and B's whole N, along the K tile.
        cps = re.findall(r"tcgen05\.cp\.[\w:.]+", ptx)
        self.assertEqual(set(cps), {f"tcgen05.cp.cta_group::{group}.32x128b.warpx4"})
        atoms_k = mk // (plan.scale_block * constraints.SCALE_ATOM_BLOCKS)
        atoms = atoms_k * (1 + -(-mn // constraints.SCALE_ATOM_ROWS))
        self.assertTrue(len(cps) >= atoms and len(cps) % atoms == 0, (len(cps), atoms))
        # Each stage's copies come before its first MMA.
        self.assertLess(ptx.index("tcgen05.cp."), ptx.index("tcgen05.mma."))

        # TMEM: the plan's columns (accumulators and scale factors), allocated and freed.
        self.assertEqual(set(_constant_operands(ptx, r"tcgen05\.alloc")), {plan.tmem_alloc_cols})
        self.assertEqual(set(_constant_operands(ptx, r"tcgen05\.dealloc")), {plan.tmem_alloc_cols})
        sf_cols = planning.gemm_plan.scale_tmem_cols(plan)
        self.assertLessEqual(
            plan.acc_tmem_cols_per_stage * plan.num_acc_stages + sf_cols, plan.tmem_alloc_cols
        )
        self.assertRegex(ptx, r"tcgen05\.ld\.sync\.aligned\.\w+\.x\d+\.b32")

        # TMA: A and B in 3-D boxes (the dense family's atoms), the scale factors in 4-D boxes
        # of the TensorMap descriptors; all complete on an mbarrier, cta_group::2 with a pair.
        loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\.[\w:.]+", ptx)
        self.assertTrue(all("mbarrier::complete_tx::bytes" in x for x in loads))
        sf_loads = re.findall(r"cp\.async\.bulk\.tensor\.4d\.shared::cluster\.global[\w:.]+", ptx)
        self.assertTrue(sf_loads and len(sf_loads) % 2 == 0, sf_loads)
        self.assertTrue(all(("cta_group::2" in x) == plan.use_2cta for x in sf_loads), sf_loads)
        self.assertFalse(any("multicast" in x for x in sf_loads), sf_loads)
        # Descriptors prefetched once each: A, B, D and the two scale-factor maps.
        self.assertEqual(len(re.findall(r"prefetch\.tensormap\b", ptx)), 5 + spec.has_c)

        # Transaction bytes per stage: A's and B's MMA tile (from the plan) and the scale
        # factors' boxes by the descriptors' own count, both CTAs' on a pair's leader.
        data_bits = constraints.OPERAND_BITS
        ab = mm * mk * data_bits[plan.a_dtype] // 8 + mn * mk * data_bits[plan.b_dtype] // 8
        sf_tx = kernel.scale_tx_bytes
        self.assertEqual(set(sf_tx), {"sfa", "sfb"})
        sfa_bytes, sfb_bytes = planning.gemm_plan.blockscaled_stage_bytes(
            plan.mma_tiler_mnk, plan.use_2cta, plan.scale_dtype, plan.scale_block
        )
        self.assertEqual((sf_tx["sfa"], sf_tx["sfb"]), (sfa_bytes, sfb_bytes))
        expected = ab + group * (sf_tx["sfa"] + sf_tx["sfb"])
        self.assertEqual(
            set(_constant_operands(ptx, r"mbarrier\.arrive\.expect_tx")), {expected}, expected
        )

        self.assertIn(".reqntid 192, 1, 1", ptx)
        self.assertEqual("ld.global" in ptx, spec.has_bias)
        spills = _ptxas_spill_bytes(ptx)
        if spills is not None:
            self.assertEqual(spills, 0, "ptxas reports register spills")

    def test_plan_and_compile_plan(self):
        # The public entry points: plan(..., scale_dtype=, scale_block=, arch="sm_100a") plans
        # the block-scaled kernel; compile_plan builds the object the FFI handler loads.
        for recipe, data in (("mxfp8", E4M3), ("nvfp4", E2M1)):
            p = jax_sm100.plan(
                1024, 2048, 1024, a_dtype=data, b_dtype=data, arch="sm_100a", **_RECIPES[recipe]
            )
            self.assertEqual(p.kernel, "sm100_tcgen05_blockscaled", p.reason)
            self.assertEqual((p.a_major, p.b_major), ("k", "k"))
            self.assertIn(f"kind::{_KIND[recipe]}", p.reason)
            self.assertIn(_RECIPES[recipe]["scale_dtype"], str(p))
            compiled = jax_sm100.compile_plan(p)
            self.assertEqual(compiled.object_bytes[:4], b"\x7fELF")
            self.assertIn(b"Sm100BlockScaledGemmKernel", compiled.object_bytes)
            self.assertEqual([t.name for t in compiled.tensor_args], ["a", "b", "sfa", "sfb", "d"])
            self.assertIn(f"kind::{_KIND[recipe]}.block_scale", compiled.ptx)
        # The family is registered under the plan's kernel name.
        self.assertIs(family.family(planning.KERNEL_SM100_BLOCKSCALED), Sm100BlockScaledGemmKernel)

    def test_planned_tiles_and_accumulator_stages(self):
        # Two accumulator stages where they fit beside the scale factors' TMEM columns (N=128:
        # 2 x 128 + 8 or 32 columns of a 512-column allocation), one at N=256 (2 x 256 alone
        # fill TMEM); and no CTA pair over 128 rows (its second CTA would hold only padding).
        tiles = set()
        for recipe, data in (("mxfp8", E4M3), ("nvfp4", E2M1)):
            for shape in ((4096, 4096, 4096), (2048, 2048, 2048), (128, 4096, 4096)):
                p = jax_sm100.plan(*shape, a_dtype=data, b_dtype=data, arch="sm_100a",
                                   **_RECIPES[recipe])  # fmt: skip
                mn = p.mma_tiler_mnk[1]
                tiles.add(mn)
                self.assertEqual(p.num_acc_stages, 2 if mn == 128 else 1, str(p))
                self.assertEqual(p.tmem_alloc_cols, 512)
                if shape[0] <= 128:
                    self.assertFalse(p.use_2cta, str(p))
        self.assertEqual(tiles, {128, 256})

    def test_what_runs_on_xla(self):
        # Formats and shapes the kernel does not take plan onto XLA's ops, with the reason.
        cases = [
            (dict(a_dtype=E4M3, b_dtype=E4M3, scale_dtype="float32", scale_block=128), "format"),
            (dict(a_dtype=E2M1, b_dtype=E4M3, **_RECIPES["mxfp8"]), "not an sm_100a"),
            (dict(a_dtype=E4M3, b_dtype=E4M3, out_dtype="float64", **_RECIPES["mxfp8"]),
             "epilogue"),
        ]  # fmt: skip
        for args, why in cases:
            p = jax_sm100.plan(1024, 1024, 1024, arch="sm_100a", **args)
            self.assertEqual(p.kernel, planning.KERNEL_XLA)
            self.assertIn(why, p.reason)
        with self.assertRaisesRegex(jax_sm100.PlanError, "dividing"):
            jax_sm100.plan(64, 64, 48, a_dtype=E4M3, b_dtype=E4M3, arch="sm_100a",
                           **_RECIPES["mxfp8"])  # fmt: skip
        # An fp8 result, which scaled_matmul refuses, is refused here too.
        with self.assertRaisesRegex(TypeError, "out_dtype='float8_e4m3fn' is not one of"):
            jax_sm100.plan(1024, 1024, 1024, a_dtype=E4M3, b_dtype=E4M3, arch="sm_100a",
                           out_dtype="float8_e4m3fn", **_RECIPES["mxfp8"])  # fmt: skip

    def test_plan_edits_checked(self):
        p = _plan("mxfp8", (E4M3, E4M3))
        for bad, rule in (
            (dict(mma_tiler_mnk=(128, 256, 128), use_2cta=True), "128 rows per CTA"),
            (dict(mma_tiler_mnk=(128, 64, 128), use_2cta=False, cluster_shape_mn=(1, 1)),
             "N=128 or 256"),
            (dict(kernel=planning.KERNEL_SM100), "applies no scales|unscaled kernel"),
            (dict(preact_out=True), "read no C and write D only"),
        ):  # fmt: skip
            with self.assertRaisesRegex(constraints.PlanError, rule):
                dataclasses.replace(p, **bad)
        dense = jax_sm100.plan(4096, 4096, 4096, a_dtype=E4M3, b_dtype=E4M3, arch="sm_100a")
        self.assertFalse(
            Sm100BlockScaledGemmKernel.can_implement(dense, KernelSpec.for_plan(dense))
        )
        with self.assertRaisesRegex(ValueError, "block-scaled plan"):
            Sm100BlockScaledGemmKernel(dense, KernelSpec.for_plan(dense))


def _embedded_objects(text: str) -> list[bytes]:
    return [bytes.fromhex(h) for h in re.findall(r'object = dense<"0x([0-9A-F]+)"', text)]


class ScaledMatmulExportTest(parameterized.TestCase):
    """`scaled_matmul`'s CUDA lowering for an sm_100a target (no GPU: `jax.export` for "cuda"
    with `JAX_SM100_TARGET_ARCH=sm_100a`) calls the block-scaled kernel."""

    @parameterized.parameters(
        ("mxfp8", jnp.float8_e4m3fn, (2, 512, 256, 1024), "blocked", "float32"),
        ("nvfp4", jnp.float4_e2m1fn, (1, 256, 512, 512), "blocked", "bfloat16"),
        ("mxfp8", jnp.float8_e5m2, (1, 256, 384, 256), "plain", "bfloat16"),
    )
    def test_custom_call_in_exported_module(self, recipe, data, shape, layout, out):
        b, m, n, k = shape
        scale_dtype = getattr(jnp, _RECIPES[recipe]["scale_dtype"])
        block = _RECIPES[recipe]["scale_block"]

        def scales(rows):
            if layout == "plain":
                return jax.ShapeDtypeStruct((b, rows, k // block), scale_dtype)
            return jax.ShapeDtypeStruct(
                (b, -(-rows // 128), -(-(k // block) // 4), 32, 4, 4), scale_dtype
            )

        args = (
            jax.ShapeDtypeStruct((b, m, k), data), jax.ShapeDtypeStruct((b, n, k), data),
            scales(m), scales(n),
        )  # fmt: skip
        fn = jax.jit(lambda *a: jax_sm100.scaled_matmul(*a, preferred_element_type=out))
        with (
            mock.patch.dict(os.environ, {"JAX_SM100_TARGET_ARCH": "sm_100a"}),
            jax_sm100.lowerings() as seen,
        ):
            exp = jax.export.export(
                fn, platforms=["cuda"], disabled_checks=jax_sm100.export_disabled_checks()
            )(*args)
        (how,) = seen
        self.assertEqual(how.plan.kernel, planning.KERNEL_SM100_BLOCKSCALED, how.note)
        self.assertEqual(
            (how.plan.scale_dtype, how.plan.scale_block), (np.dtype(scale_dtype).name, block)
        )
        text = exp.mlir_module()
        self.assertEqual(text.count("stablehlo.custom_call @jax_sm100_gemm"), 1)
        self.assertNotIn("stablehlo.dot_general", text)
        (obj,) = _embedded_objects(text)
        self.assertIn(b"Sm100BlockScaledGemmKernel", obj)
        compiled = jax_sm100.compile_plan(how.plan)
        self.assertEqual(compiled.object_bytes, obj)
        self.assertIn(f"kind::{_KIND[recipe]}.block_scale", compiled.ptx)
        self.assertEqual(exp.out_avals[0].shape, (b, m, n))
        # Blocked scales reach the kernel as they are (a reshape); plain ones are transposed
        # into the blocked layout by XLA first.
        self.assertEqual("stablehlo.transpose" in text, layout == "plain")

    def test_grid_from_the_drivers_occupancy(self):
        # As for the dense family: on an sm_100a device the driver says how many clusters fit
        # (whole GPCs), and the persistent grid launches no more.
        args = (
            jax.ShapeDtypeStruct((1, 4096, 4096), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((1, 4096, 4096), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((1, 32, 32, 32, 4, 4), jnp.float8_e8m0fnu),
            jax.ShapeDtypeStruct((1, 32, 32, 32, 4, 4), jnp.float8_e8m0fnu),
        )
        with (
            mock.patch.object(
                dispatch, "device_target", return_value=dispatch.Target("sm_100a", 148, True)
            ),
            mock.patch.object(dispatch, "driver_max_clusters", return_value=70),
            jax_sm100.lowerings() as seen,
        ):
            jax.export.export(
                jax.jit(jax_sm100.scaled_matmul),
                platforms=["cuda"],
                disabled_checks=jax_sm100.export_disabled_checks(),
            )(*args)
        (how,) = seen
        self.assertEqual(how.plan.kernel, planning.KERNEL_SM100_BLOCKSCALED)
        self.assertEqual(planning.grid_clusters(how.plan), 70)


if __name__ == "__main__":
    absltest.main()
