"""The SM100 block-scaled GEMM family: mxfp8 and nvfp4 products on tcgen05's block-scaled MMA.

    d = (a * sfa) @ (b * sfb)^T      a [M, K] and b [N, K] (K-major), one scale factor per
                                     `scale_block` elements of k (32 for mxfp8, 16 for nvfp4)

One class, `Sm100BlockScaledGemmKernel`, a subclass of the dense family's `Sm100GemmKernel`
(sm100_gemm.py): the warp roles, the persistent schedule, the A/B pipeline, the TMEM
accumulators and the epilogue (sm100_epilogue.py) are the dense kernel's. What it adds, through
the dense kernel's hooks:

    MMA          `make_blockscaled_trivial_tiled_mma`: tcgen05.mma.kind::block_scale, kind
                 mxf8f6f4 (e4m3/e5m2 data, ue8m0 scales) or mxf4nvf4 (packed e2m1 data, e4m3
                 scales), 1- or 2-CTA
    scale loads  with each A/B stage the producer warp loads the stage's scale factors of A (the
                 CTA's 128 rows) and of B (the tile's N) by TMA, from descriptors built with
                 `cutlass.experimental.cuda`'s TensorMap; each stage's mbarrier expects their
                 `global_tx_bytes()` beside the A and B bytes (both CTAs' of a pair on the
                 leader's barrier)
    TMEM         the MMA warp copies a stage's scale factors from SMEM into TMEM columns after
                 the accumulators (tcgen05.cp, 32x128b.warpx4) before the stage's MMAs, which
                 read them there (tcgen05's pipe orders the copies before the MMAs)

The scale factors in global memory are in the layout the MMA reads, which is the layout
`jax_sm100.quantize` writes (scaled.py): per batch, 512-byte atoms of 128 rows by 4 blocks of
k, atoms k-fastest, row r of an atom at byte 16 * (r % 32) + 4 * (r // 32) and block j at
+ j. A K tile covers whole atoms (128 bytes of data: 4 blocks of 32 fp8 or 16 blocks of 16 fp4),
so a stage's factors are (K tile / (4 * block)) atoms per 128 rows: one TMA box of
(16 bytes, 32 rows, atoms along k, atoms along rows) over the tensor viewed that way.

Like the dense family, verified only by compiling for sm_100a on a CPU machine
(tests/test_sm100_blockscaled_ptx.py reads the PTX); no SM100 GPU has run this code.
"""

from __future__ import annotations

from typing import Any, ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.experimental.cuda as tensormap
import cutlass.utils as utils
import cutlass.utils.blockscaled_layout as blockscaled
from cutlass.cute.nvgpu import tcgen05
from cutlass.cute.runtime import make_fake_compact_tensor
from cutlass.experimental import primitives as prims

from jax_sm100._src import constraints, planning
from jax_sm100._src.kernels import common, family, sm100_gemm
from jax_sm100._src.kernels.spec import KernelSpec

# One scale-factor atom: 32 rows of 16 bytes (4 row groups x 4 blocks of k), 128 rows of A or B.
_ATOM_ROW_BYTES = 16
_ATOM_LANES = 32
_ATOM_BYTES = _ATOM_ROW_BYTES * _ATOM_LANES
_ATOM_ROWS = constraints.SCALE_ATOM_ROWS
_ATOM_BLOCKS = constraints.SCALE_ATOM_BLOCKS


class Sm100BlockScaledGemmKernel(sm100_gemm.Sm100GemmKernel):
    """`d = act(alpha * ((a * sfa) @ (b * sfb)^T) + bias)` on SM100 with block-scaled tcgen05
    MMAs, one plan (`planning.KERNEL_SM100_BLOCKSCALED`) at a time.

    Operand modes: a (M, K, L) and b (N, K, L) K-major, d (M, N, L) N-major, bias (N,); sfa and
    sfb are the scale factors of a and b in the MMA's atom layout (the module docstring), passed
    as 1-D tensors of the scale dtype whose base the kernel reads from (k's atoms from a's K
    extent; the atoms along rows and batch from each tensor's own extent).

    Example:
        kernel = Sm100BlockScaledGemmKernel(plan, spec)
        compiled = cute.compile(kernel, a, b, sfa, sfb, d, None, None, None, stream)
    """

    HOST_OPERANDS: ClassVar[tuple[str, ...]] = ("a", "b", "sfa", "sfb", "d", "c", "bias", "z")

    def __init__(self, plan: Any, spec: KernelSpec):
        super().__init__(plan, spec)
        self.sf_dtype = common.cutlass_dtype(plan.scale_dtype)
        self.sf_vec = plan.scale_block
        self.kind = constraints.SM100_BLOCKSCALED_KINDS[
            (plan.a_dtype, plan.scale_dtype, plan.scale_block)
        ]
        # Atoms of scale factors one stage holds: along k (the K tile), and along the rows of
        # the CTA's A tile and of B's (whole-atom) N tile.
        self.sf_atoms_k = self.mma_tiler[2] // (self.sf_vec * _ATOM_BLOCKS)
        self.sfa_atoms = self.cta_tile[0] // _ATOM_ROWS
        self.sfb_atoms = -(-self.mma_tiler[1] // _ATOM_ROWS)
        self.acc_tmem_cols = plan.acc_tmem_cols_per_stage * plan.num_acc_stages

    # -------------------------------------------------------------------------------- setup

    def _make_tiled_mma(self) -> cute.TiledMma:
        return utils.sm100.make_blockscaled_trivial_tiled_mma(
            self.a_dtype,
            self.b_dtype,
            self.a_major,
            self.b_major,
            self.sf_dtype,
            self.sf_vec,
            self.cta_group,
            self.mma_tiler[:2],
        )

    def _setup_operands(self):
        """The scale factors' staged SMEM layouts (the DSL's, for this tiled MMA), checked to span
        the bytes a stage's TMA boxes bring. Not checked here: that their order is the boxes'
        (atoms along k, then atoms along the rows). Review helper-79 read it off the PTX of
        nvfp4 at 128x256 with DSL 4.8.1 (each copy into TMEM reads the atom the boxes' order
        puts at its SMEM offset); a DSL release that reorders the layout would break it
        silently."""
        self.sfa_smem_staged = blockscaled.make_smem_layout_sfa(
            self.tiled_mma, self.mma_tiler, self.sf_vec, self.num_ab_stages
        )
        self.sfb_smem_staged = blockscaled.make_smem_layout_sfb(
            self.tiled_mma, self.mma_tiler, self.sf_vec, self.num_ab_stages
        )
        self.sfa_stage_elems = _stage_elems(self.sfa_smem_staged)
        self.sfb_stage_elems = _stage_elems(self.sfb_smem_staged)
        for name, elems, atoms in (
            ("A", self.sfa_stage_elems, self.sfa_atoms),
            ("B", self.sfb_stage_elems, self.sfb_atoms),
        ):
            if elems * self.sf_dtype.width // 8 != atoms * self.sf_atoms_k * _ATOM_BYTES:
                raise ValueError(
                    f"a stage of {name}'s scale factors spans {elems} elements in the DSL's SMEM "
                    f"layout, not the {atoms} x {self.sf_atoms_k} atoms of {_ATOM_BYTES} bytes "
                    "its TMA box brings"
                )

    def _smem_fields(self) -> dict:
        fields = super()._smem_fields()
        for name, layout in (("sSFA", self.sfa_smem_staged), ("sSFB", self.sfb_smem_staged)):
            fields[name] = cute.struct.Align[
                cute.struct.MemRange[self.sf_dtype, cute.cosize(layout)], 1024
            ]
        return fields

    # ------------------------------------------------------------------------------ host side

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,
        b: cute.Tensor,
        sfa: cute.Tensor,
        sfb: cute.Tensor,
        d: cute.Tensor,
        c: cute.Tensor | None,
        bias: cute.Tensor | None,
        z: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """The scale factors' TMA descriptors, then the dense family's host work and launch."""
        self._setup()
        tma_sfa = self._scale_tensor_map("sfa", sfa, a, self.sfa_atoms)
        tma_sfb = self._scale_tensor_map("sfb", sfb, a, self.sfb_atoms)
        self._launch(
            a,
            b,
            d,
            c,
            bias,
            z,
            stream,
            (tma_sfa, tma_sfb, self.sfa_smem_staged, self.sfb_smem_staged),
        )

    def _scale_tensor_map(self, name: str, sf: cute.Tensor, a: cute.Tensor, row_atoms: int):
        """The TMA descriptor of one operand's scale factors: the tensor as (16 bytes, 32 lanes,
        atoms along k, atoms along rows and batch), one box per stage of `sf_atoms_k` by
        `row_atoms` atoms (k's atoms from a's K extent, which b shares). The last mode's extent
        is what `sf`'s own extent holds (the problem's atoms along rows and batch, ceil(rows /
        128) x batch, for the lowering's scales), so that the descriptor never reads past the
        buffer whatever the other operands' extents."""
        k = a.shape[1]
        atoms_k = cute.ceil_div(k, self.sf_vec * _ATOM_BLOCKS)
        elems_16b = _ATOM_ROW_BYTES * 8 // self.sf_dtype.width
        view = cute.make_tensor(
            sf.iterator,
            cute.make_layout(
                (
                    elems_16b,
                    _ATOM_LANES,
                    atoms_k,
                    sf.shape[0] // (elems_16b * _ATOM_LANES * atoms_k),
                ),
                stride=(1, elems_16b, elems_16b * _ATOM_LANES, atoms_k * elems_16b * _ATOM_LANES),
            ),
        )
        desc = tensormap.create_tensor_map_tiled_from_view(
            view,
            box_dims=(elems_16b, _ATOM_LANES, self.sf_atoms_k, row_atoms),
            stride_order=(0, 1, 2, 3),
        )
        stage_bytes = row_atoms * self.sf_atoms_k * _ATOM_BYTES
        # What one box moves, by the descriptor's own count (tests read this record).
        self.scale_tx_bytes = {**getattr(self, "scale_tx_bytes", {}), name: desc.global_tx_bytes()}
        if desc.shared_storage_bytes != stage_bytes:
            raise ValueError(
                f"the scale factors' TMA box holds {desc.shared_storage_bytes} bytes in SMEM, "
                f"not the {stage_bytes} of a stage"
            )
        return desc

    # ---------------------------------------------------------------------------- device hooks

    def _prefetch_scales(self, tma_sfa, tma_sfb):
        prims.prefetch_tensormap(tma_sfa.get_ptr())
        prims.prefetch_tensormap(tma_sfb.get_ptr())

    def _scale_smem(self, storage, tma_sfa, tma_sfb, sfa_smem_staged, sfb_smem_staged):
        sSFA = storage.sSFA.get_tensor(sfa_smem_staged)
        sSFB = storage.sSFB.get_tensor(sfb_smem_staged)
        return tma_sfa, tma_sfb, sSFA, sSFB

    def _scale_tx_bytes(self, scales, pair) -> int:
        """One TMA box of each operand's scale factors per stage and CTA, as the descriptors
        count them; with cta_group::2 both CTAs' boxes complete on the leader's barrier."""
        tma_sfa, tma_sfb, _, _ = scales
        return pair * (tma_sfa.global_tx_bytes() + tma_sfb.global_tx_bytes())

    def _load_scales(self, scales, slot, tile, d_in, pair):
        """This CTA's scale factors of stage `slot`: A's rows of its M tile (one atom row: the
        CTA's 128 rows) and B's whole N tile, for the stage's K tile, in batch `tile[2]`."""
        tma_sfa, tma_sfb, sSFA, sSFB = scales
        k_atom = slot.count * self.sf_atoms_k
        a_rows = cute.ceil_div(d_in.shape[0], _ATOM_ROWS)
        b_rows = cute.ceil_div(d_in.shape[1], _ATOM_ROWS)
        a_atom = tile[2] * a_rows + tile[0] * self.sfa_atoms
        b_atom = tile[2] * b_rows + tile[1] * self.sfb_atoms
        group, barrier = None, slot.barrier
        if cutlass.const_expr(pair == 2):
            group, barrier = prims.CTAGroup.CTA_2, _PairBarrier(barrier)
        with cute.arch.elect_one():
            for desc, sSF, stage_elems, coord in (
                (tma_sfa, sSFA, self.sfa_stage_elems, a_atom),
                (tma_sfb, sSFB, self.sfb_stage_elems, b_atom),
            ):
                prims.cp_async_bulk_tensor_shared_cluster_global(
                    sSF.iterator + slot.index * stage_elems,
                    desc.get_ptr(),
                    (0, 0, k_atom, coord),
                    barrier,
                    [],
                    group=group,
                )

    def _scale_mma_setup(self, mma, scales, acc_ptr):
        """The scale factors' TMEM tensors (after the accumulators' columns) and the tcgen05.cp
        copies that fill them from a stage's SMEM."""
        _, _, sSFA, sSFB = scales
        sfa_tmem = blockscaled.make_tmem_layout_sfa(
            mma, self.mma_tiler, self.sf_vec, cute.slice_(sSFA.layout, (None,) * 3 + (0,))
        )
        sfb_tmem = blockscaled.make_tmem_layout_sfb(
            mma, self.mma_tiler, self.sf_vec, cute.slice_(sSFB.layout, (None,) * 3 + (0,))
        )
        tCtSFA = cute.make_tensor(
            cute.recast_ptr(acc_ptr + self.acc_tmem_cols, dtype=self.sf_dtype), sfa_tmem
        )
        sfa_cols = tcgen05.find_tmem_tensor_col_offset(tCtSFA)
        tCtSFB = cute.make_tensor(
            cute.recast_ptr(acc_ptr + self.acc_tmem_cols + sfa_cols, dtype=self.sf_dtype),
            sfb_tmem,
        )
        sfb_cols = tcgen05.find_tmem_tensor_col_offset(tCtSFB)
        planned = planning.gemm_plan.scale_tmem_cols(self.plan)
        if sfa_cols + sfb_cols != planned or self.acc_tmem_cols + planned > self.tmem_alloc_cols:
            raise ValueError(
                f"the scale factors take {sfa_cols} + {sfb_cols} TMEM columns (the plan counted "
                f"{planned}) after {self.acc_tmem_cols} of accumulators, in {self.tmem_alloc_cols}"
            )
        return tCtSFA, tCtSFB, self._s2t(sSFA, tCtSFA), self._s2t(sSFB, tCtSFB)

    def _s2t(self, sSF: cute.Tensor, tSF: cute.Tensor):
        """(copy, SMEM source by stage, TMEM destination) of one operand's scale factors: the
        32x128b copy broadcast to the four lane quarters, which the atom layout is made for."""
        copy = tcgen05.make_s2t_copy(
            cute.make_copy_atom(tcgen05.Cp4x32x128bOp(self.cta_group), self.sf_dtype),
            cute.filter_zeros(tSF),
        )
        part = copy.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(copy, part.partition_S(cute.filter_zeros(sSF)))
        return copy, src, part.partition_D(cute.filter_zeros(tSF))

    def _scales_to_tmem(self, scales_mma, stage):
        _, _, *copies = scales_mma
        for copy, src, dst in copies:
            cute.copy(copy, src[(None,) * (cute.rank(src) - 1) + (stage,)], dst)

    def _mma_operands(self, tCrA, tCrB, scales_mma, kb, stage):
        tCtSFA, tCtSFB, _, _ = scales_mma
        return (
            [tCrA[(None, None, kb, stage)], tCtSFA[(None, None, kb)]],
            [tCrB[(None, None, kb, stage)], tCtSFB[(None, None, kb)]],
        )

    # ----------------------------------------------------------------------------- legality

    @classmethod
    def why_not(cls, plan: Any, spec: KernelSpec) -> str | None:
        """The first reason this family cannot take (plan, spec), or None. The block-scaled
        rules are constraints.py's (`check_sm100_blockscaled`), re-run on the plan as given."""
        if plan.arch != "sm_100a" or plan.kernel != planning.KERNEL_SM100_BLOCKSCALED:
            return f"{plan.arch=}, {plan.kernel=}: not an sm_100a block-scaled plan"
        if spec.d_major != "n":
            return f"spec.d_major={spec.d_major!r}: sm_100a kernels store D N-major only"
        if spec.b_groups or spec.k_segments > 1:
            return "b_groups and k_segments are for grouped plans (kernels/grouped.py)"
        for field in ("a_dtype", "b_dtype", "out_dtype", "c_dtype", "a_major", "b_major"):
            got, want = getattr(plan, field), getattr(spec, field)
            if got != want:
                return f"plan.{field}={got!r} but spec.{field}={want!r}"
        if spec.out_dtype not in constraints.KERNEL_OUT_DTYPES:
            return f"{spec.out_dtype=} must be one of {constraints.KERNEL_OUT_DTYPES}"
        if spec.has_bias and spec.bias_dtype not in constraints.KERNEL_OUT_DTYPES:
            return f"{spec.bias_dtype=} must be one of {constraints.KERNEL_OUT_DTYPES}"
        if spec.preact_out or spec.act_grad or not (spec.a_batched and spec.b_batched):
            return "the block-scaled family writes D only, from batched A and B"
        try:
            constraints.check_sm100_blockscaled(
                plan.mma_tiler_mnk, plan.use_2cta, plan.a_dtype, plan.b_dtype, plan.scale_dtype,
                plan.scale_block, spec.a_major, spec.b_major,
            )  # fmt: skip
            constraints.check_cluster("sm_100a", plan.cluster_shape_mn, plan.use_2cta)
            constraints.check_tmem(plan.tmem_alloc_cols)
            constraints.check_ab_stages(plan.num_ab_stages)
        except constraints.PlanError as e:
            return str(e)
        sf_cols = planning.gemm_plan.scale_tmem_cols(plan)
        if plan.acc_tmem_cols_per_stage * plan.num_acc_stages + sf_cols > plan.tmem_alloc_cols:
            return (
                f"{plan.num_acc_stages=} x {plan.acc_tmem_cols_per_stage=} and {sf_cols} columns "
                f"of scale factors exceed {plan.tmem_alloc_cols=}"
            )
        if plan.num_epi_stages < 1 or plan.num_acc_stages < 1:
            return f"{plan.num_epi_stages=} and {plan.num_acc_stages=} must be at least 1"
        return None

    @classmethod
    def compile_inputs(cls, plan: Any, spec: KernelSpec) -> family.CompileInputs:
        """The dense family's fake operands with 1-D scale-factor tensors after a and b (their
        extent is a runtime value; the kernel sizes its view of them from it and a's K)."""
        a, b, d, c, bias, z = common.make_fake_operands(plan, spec)
        sf_dtype = common.cutlass_dtype(plan.scale_dtype)
        sfa, sfb = (
            make_fake_compact_tensor(
                sf_dtype, (cute.sym_int(),), assumed_align=common.TMA_ALIGN_BYTES
            )
            for _ in range(2)
        )
        return family.CompileInputs(plan, spec, (a, b, sfa, sfb, d, c, bias, z))


def _stage_elems(staged: cute.Layout) -> int:
    """Elements one stage of a staged scale-factor SMEM layout spans."""
    return cute.cosize(cute.filter_zeros(cute.slice_(staged, (None,) * 3 + (0,))))


class _PairBarrier:
    """A stage's mbarrier as the DSL's cta_group::2 TMA wrapper takes it: it clears bit 24 of
    `data_ptr()` (the CTA's rank parity in a shared::cluster address), so that both CTAs of a
    pair complete on the leader's barrier, as the dense family's 2-CTA TMA atoms do."""

    def __init__(self, barrier):
        self._barrier = barrier

    def data_ptr(self):
        return cutlass.Pointer._from_raw_ptr(self._barrier.llvm_ptr)
