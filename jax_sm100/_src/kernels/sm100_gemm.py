"""The SM100 (Blackwell, tcgen05) GEMM family: persistent, warp-specialised, TMEM accumulators.

One kernel class, `Sm100GemmKernel`, compiled from a `GemmPlan` (planning/) and a `KernelSpec`
(spec.py). The plan fixes every tiling and pipelining number; this module only turns those numbers
into CuTe layouts, TMA atoms and a warp-specialised device program, and refuses (in
`why_not`) a plan it cannot honour rather than re-deciding it. The epilogue warps' device
code (TMEM -> registers -> fused math -> TMA store of D) is in sm100_epilogue.py; everything
else, host and device, is here.

Warp roles inside one CTA (192 threads, 224 when a source C is read):

    warps 0-3  epilogue (sm100_epilogue.py): TMEM -> registers (tcgen05.ld), fused epilogue
               math, registers -> SMEM, TMA store of D; warp 0 also allocates and frees the
               TMEM accumulators
    warp 4     MMA: issues tcgen05.mma (cta_group::1, or cta_group::2 from the leader CTA of a
               pair) into one of `num_acc_stages` TMEM accumulators
    warp 5     producer: TMA loads of A and B tiles into `num_ab_stages` SMEM stages, multicast
               across the cluster where the plan's cluster shape allows
    warp 6     C producer (only with a source C): TMA loads of C epilogue subtiles

All roles walk the same static persistent tile schedule, so the epilogue of tile i overlaps the
MMA of tile i+1 whenever the plan gives two or more accumulator stages.

Every mbarrier transaction count is read off the TMA atom that moves the bytes (`_tma_copy_bytes`),
and the TMEM allocation is the plan's `tmem_alloc_cols`, checked against the accumulator layout.

Two families subclass this one and reuse its roles: sm100_blockscaled.py through the hooks at
the end of the class (scale factors beside A and B), and sm100_grouped.py (ragged_dot) with its
own table-driven schedule around the same setup, TMA atoms (`_ab_tma_atoms`), producer loop
(`_load_k_tiles`) and epilogue (sm100_epilogue.py's `setup` and `store_tile`).

Verified only by compiling for sm_100a on a CPU machine (tests/test_sm100_ptx.py reads the PTX);
no SM100 GPU has run this code.
"""

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.experimental.cuda import TensorMap
from cutlass.tensor_utils import LayoutEnum

from jax_sm100._src import constraints, planning
from jax_sm100._src.kernels import common, family, sm100_epilogue
from jax_sm100._src.kernels.spec import KernelSpec

# Warp roles (the module docstring); the epilogue warps are sm100_epilogue's.
_WARP = sm100_epilogue.WARP
_EPI_WARPS = sm100_epilogue.EPI_WARPS
_MMA_WARP = 4
_AB_LOAD_WARP = 5
_C_LOAD_WARP = 6

# Named-barrier ids: common.py's table.
_TMEM_PTR_BARRIER = common.SM100_TMEM_PTR_BARRIER


def _tma_copy_bytes(atom: cute.CopyAtom, smem_dst: cute.Tensor) -> int:
    """Bytes one `cute.copy(atom, ..., smem_dst)` lands on the mbarrier it names.

    `smem_dst` is one stage of the TMA-partitioned SMEM tensor, ((box values, boxes)): the copy
    issues one TMA instruction per box. The atom's value layout is (CTAs, box values); with
    cta_group::2 both CTAs of a pair signal the leader's barrier, so the CTA count multiplies in.
    Multicast needs no term: each receiving CTA gets the whole box, whoever issued its slices.
    Reading this off the atom and its partition keeps one source of truth for the byte count.
    """
    box = cute.size(atom.layout_dst_tv, mode=[1])
    values = cute.size(smem_dst)
    if values % box:
        raise ValueError(f"a TMA stage of {values} values is not whole boxes of {box}")
    return cute.size(atom.thr_id) * values * atom.value_type.width // 8


class Sm100GemmKernel(family.KernelFamily):
    """`d = act(alpha * (a @ b) + beta * c + bias)` on SM100 with tcgen05.mma, one plan at a time
    (and the pre-activation z with `spec.preact_out`, or `act_grad'(c) * alpha * (a @ b)` with
    `spec.act_grad`: spec.py).

    Operand modes follow spec.py: a (M, K, L), b (N, K, L), d and c (M, N, L) N-major, bias (N,).

    Example:
        kernel = Sm100GemmKernel(plan, spec)
        compiled = cute.compile(kernel, a, b, d, None, None, None, stream)
    """

    # The `GemmPlan.kernel` this class compiles (`why_not`; a subclass may name its own).
    KERNEL = constraints.KERNEL_SM100

    def __init__(self, plan: Any, spec: KernelSpec):
        super().__init__(plan, spec)
        self.a_dtype = common.cutlass_dtype(spec.a_dtype)
        self.b_dtype = common.cutlass_dtype(spec.b_dtype)
        self.d_dtype = common.cutlass_dtype(spec.out_dtype)
        self.c_dtype = common.cutlass_dtype(spec.c_dtype) if spec.has_c else None
        self.bias_dtype = common.cutlass_dtype(spec.bias_dtype) if spec.has_bias else None
        self.acc_dtype = cutlass.Float32
        self.a_major = OperandMajorMode.K if spec.a_major == "k" else OperandMajorMode.MN
        self.b_major = OperandMajorMode.K if spec.b_major == "k" else OperandMajorMode.MN

        self.use_2cta = bool(plan.use_2cta)
        self.cta_group = tcgen05.CtaGroup.TWO if self.use_2cta else tcgen05.CtaGroup.ONE
        self.mma_tiler = tuple(plan.mma_tiler_mnk)
        self.cta_tile = tuple(plan.cta_tile_mnk)
        self.cluster_shape_mn = tuple(plan.cluster_shape_mn)
        self.epi_tile_mn = tuple(plan.epi_tile)
        self.num_ab_stages = plan.num_ab_stages
        self.num_acc_stages = plan.num_acc_stages
        self.num_epi_stages = plan.num_epi_stages
        self.tmem_alloc_cols = plan.tmem_alloc_cols
        # The persistent grid: the clusters that can be resident at once (planning's count from
        # the plan's resources, or the driver's where the lowering asked a device).
        self.max_active_clusters = planning.grid_clusters(plan)

        roles = (*_EPI_WARPS, _MMA_WARP, _AB_LOAD_WARP) + ((_C_LOAD_WARP,) if spec.has_c else ())
        self.threads_per_cta = _WARP * len(roles)
        assert self.threads_per_cta == constraints.sm100_threads_per_cta(spec.has_c)

    # -------------------------------------------------------------------------------- setup

    def _setup(self):
        """Derive every CuTe object the host and device code share (needs a trace)."""
        self.tiled_mma = self._make_tiled_mma()
        mma_k = cute.size(self.tiled_mma.shape_mnk, mode=[2])
        if self.mma_tiler[2] % mma_k:
            raise ValueError(f"plan K tile {self.mma_tiler[2]} is not a multiple of {mma_k=}")
        self.cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (self.tiled_mma.thr_id.shape,)
        )
        self.mcast_ctas_a = cute.size(self.cluster_layout_vmnk.shape[2])
        self.mcast_ctas_b = cute.size(self.cluster_layout_vmnk.shape[1])

        self.a_smem_staged = utils.sm100.make_smem_layout_a(
            self.tiled_mma, self.mma_tiler, self.a_dtype, self.num_ab_stages
        )
        self.b_smem_staged = utils.sm100.make_smem_layout_b(
            self.tiled_mma, self.mma_tiler, self.b_dtype, self.num_ab_stages
        )

        # The plan's (tile_m, tile_n) subtile, strided across the warps that share the TMEM
        # lanes: with 2-CTA and 64-row CTA tiles the 4 epilogue warps form a 2x2 grid.
        tile_m, tile_n = self.epi_tile_mn
        warp_n = 2 if (self.use_2cta and self.cta_tile[0] == 64) else 1
        self.epi_tile = (
            cute.make_layout(tile_m),
            cute.coalesce(
                cute.make_layout((tile_n // warp_n, warp_n), stride=(1, self.cta_tile[1] // warp_n))
            ),
        )
        self.d_layout = LayoutEnum.ROW_MAJOR
        self.d_smem_staged = utils.sm100.make_smem_layout_epi(
            self.d_dtype, self.d_layout, self.epi_tile, self.num_epi_stages
        )
        self.c_smem_staged = None
        if self.spec.has_c:
            self.c_smem_staged = utils.sm100.make_smem_layout_epi(
                self.c_dtype, LayoutEnum.ROW_MAJOR, self.epi_tile, self.num_epi_stages
            )

        acc_shape = self.tiled_mma.partition_shape_C(self.mma_tiler[:2])
        self.acc_fragment = self.tiled_mma.make_fragment_C(
            cute.append(acc_shape, self.num_acc_stages)
        )
        needed = cutlass.memory.get_num_tmem_alloc_cols(self.acc_fragment)
        if needed > self.tmem_alloc_cols:
            raise ValueError(
                f"plan.tmem_alloc_cols={self.tmem_alloc_cols} is below the {needed} columns that "
                f"{self.num_acc_stages} accumulator stages of {self.mma_tiler[:2]} occupy"
            )

        self._setup_operands()
        self.shared_storage = self._make_shared_storage()

    def _make_tiled_mma(self) -> cute.TiledMma:
        return utils.sm100.make_trivial_tiled_mma(
            self.a_dtype,
            self.b_dtype,
            self.a_major,
            self.b_major,
            self.acc_dtype,
            self.cta_group,
            self.mma_tiler[:2],
        )

    def _setup_operands(self):
        """Layouts of operands beyond A and B (none here; a subclass's scale factors)."""

    def _make_shared_storage(self):
        """The CTA's SMEM: mbarriers and the TMEM base slot, then 1024-byte aligned tiles."""
        return common.shared_struct(self._smem_fields(), self.plan)

    def _smem_fields(self) -> dict:
        """The shared storage's fields, in order (a subclass appends its own)."""

        def tile(dtype, layout):
            return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout.outer)], 1024]

        fields = {
            "ab_barriers": cute.struct.MemRange[cutlass.Int64, 2 * self.num_ab_stages],
            "acc_barriers": cute.struct.MemRange[cutlass.Int64, 2 * self.num_acc_stages],
            "tmem_dealloc_barrier": cutlass.Int64,
            "tmem_base": cutlass.Int32,
        }
        if self.spec.has_c:
            fields["c_barriers"] = cute.struct.MemRange[cutlass.Int64, 2 * self.num_epi_stages]
        # The small fields above share the first 1024 bytes (the planner's reserve).
        fields["sA"] = tile(self.a_dtype, self.a_smem_staged)
        fields["sB"] = tile(self.b_dtype, self.b_smem_staged)
        fields["sD"] = tile(self.d_dtype, self.d_smem_staged)
        if self.spec.preact_out:
            fields["sZ"] = tile(self.d_dtype, self.d_smem_staged)
        if self.spec.has_c:
            fields["sC"] = tile(self.c_dtype, self.c_smem_staged)
        return fields

    # ------------------------------------------------------------------------------ host side

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,
        b: cute.Tensor,
        d: cute.Tensor,
        c: cute.Tensor | None,
        bias: cute.Tensor | None,
        z: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """Build the TMA atoms and the tile schedule for these operands, then launch."""
        self._setup()
        self._launch(a, b, d, c, bias, z, stream)

    def _launch(self, a, b, d, c, bias, z, stream, scales=(None, None, None, None)):
        """The host work of `__call__` after `_setup`: TMA atoms, schedule, launch.

        `scales` is what a block-scaled subclass adds to the device kernel (its scale factors'
        TMA descriptors and SMEM layouts: `device_kernel`'s last four arguments), else Nones.
        """
        mma = self.tiled_mma
        tma_atom_a, tma_a, tma_atom_b, tma_b = self._ab_tma_atoms(a, b)
        tma_atom_d, tma_d = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(),
            d,
            cute.slice_(self.d_smem_staged, (None, None, 0)),
            self.epi_tile,
        )
        tma_atom_z, tma_z = None, None
        if cutlass.const_expr(self.spec.preact_out):
            tma_atom_z, tma_z = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(),
                z,
                cute.slice_(self.d_smem_staged, (None, None, 0)),
                self.epi_tile,
            )
        tma_atom_c, tma_c = None, None
        if cutlass.const_expr(self.spec.has_c):
            tma_atom_c, tma_c = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(),
                c,
                cute.slice_(self.c_smem_staged, (None, None, 0)),
                self.epi_tile,
            )

        # Bias is indexed by N only: view it as an (M, N, L) tensor with zero M and L strides so
        # the epilogue partitions it exactly like D.
        bias_mnl = None
        if cutlass.const_expr(self.spec.has_bias):
            bias_mnl = cute.make_tensor(
                bias.iterator,
                cute.make_layout((d.shape[0], d.shape[1], d.shape[2]), stride=(0, 1, 0)),
            )

        tiles_mnl = cute.ceil_div(
            (d.shape[0], d.shape[1], d.shape[2]), (self.cta_tile[0], self.cta_tile[1], 1)
        )
        sched_params = utils.PersistentTileSchedulerParams(
            tiles_mnl,
            (*self.cluster_shape_mn, 1),
            swizzle_size=self.plan.swizzle_size,
            raster_along_m=self.plan.raster_along_m,
        )
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(
            sched_params, self.max_active_clusters
        )

        self.device_kernel(
            mma,
            tma_atom_a,
            tma_a,
            tma_atom_b,
            tma_b,
            tma_atom_d,
            tma_d,
            tma_atom_c,
            tma_c,
            bias_mnl,
            tma_atom_z,
            tma_z,
            d,
            sched_params,
            self.cluster_layout_vmnk,
            self.a_smem_staged,
            self.b_smem_staged,
            self.d_smem_staged,
            self.c_smem_staged,
            self.epi_tile,
            *scales,
        ).launch(
            grid=grid,
            block=[self.threads_per_cta, 1, 1],
            cluster=(*self.cluster_shape_mn, 1),
            stream=stream,
        )

    def _ab_tma_atoms(self, a: cute.Tensor, b: cute.Tensor):
        """The TMA load atoms of A and B and their TMA views (after `_setup`): boxes of the
        CTA's share of an MMA tile, multicast across the cluster where it shares one."""
        mma = self.tiled_mma
        # tf32 MMAs read fp32 operands; the TMA moves them as 32-bit values either way.
        a_internal = cutlass.TFloat32 if self.a_dtype is cutlass.Float32 else None
        b_internal = cutlass.TFloat32 if self.b_dtype is cutlass.Float32 else None
        tma_atom_a, tma_a = cute.nvgpu.make_tiled_tma_atom_A(
            utils.sm100.cluster_shape_to_tma_atom_A(self.cluster_shape_mn, mma.thr_id),
            a,
            cute.slice_(self.a_smem_staged, (None, None, None, 0)),
            self.mma_tiler,
            mma,
            self.cluster_layout_vmnk.shape,
            internal_type=a_internal,
        )
        tma_atom_b, tma_b = cute.nvgpu.make_tiled_tma_atom_B(
            utils.sm100.cluster_shape_to_tma_atom_B(self.cluster_shape_mn, mma.thr_id),
            b,
            cute.slice_(self.b_smem_staged, (None, None, None, 0)),
            self.mma_tiler,
            mma,
            self.cluster_layout_vmnk.shape,
            internal_type=b_internal,
        )
        return tma_atom_a, tma_a, tma_atom_b, tma_b

    # ---------------------------------------------------------------------------- device side

    @cute.kernel
    def device_kernel(
        self,
        mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_d: cute.CopyAtom,
        mD: cute.Tensor,
        tma_atom_c: cute.CopyAtom | None,
        mC: cute.Tensor | None,
        mBias: cute.Tensor | None,
        tma_atom_z: cute.CopyAtom | None,
        mZ: cute.Tensor | None,
        d_in: cute.Tensor,
        sched_params: utils.PersistentTileSchedulerParams,
        cluster: cute.Layout,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        d_smem_staged: cute.ComposedLayout,
        c_smem_staged: cute.ComposedLayout | None,
        epi_tile: cute.Tile,
        tma_sfa: cutlass.GridConstant[TensorMap],
        tma_sfb: cutlass.GridConstant[TensorMap],
        sfa_smem_staged: cute.Layout | None,
        sfb_smem_staged: cute.Layout | None,
    ):
        # tma_sfa .. sfb_smem_staged: a block-scaled subclass's scale factors (the hooks below
        # read them; sm100_blockscaled.py); None in this dense family, which emits nothing
        # for them.
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        pair = cute.size(mma.thr_id.shape)  # 2 with cta_group::2, else 1

        if warp == _AB_LOAD_WARP:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            self._prefetch_scales(tma_sfa, tma_sfb)
        if warp == _EPI_WARPS[0]:
            cpasync.prefetch_descriptor(tma_atom_d)
            if cutlass.const_expr(self.spec.preact_out):
                cpasync.prefetch_descriptor(tma_atom_z)
        if cutlass.const_expr(self.spec.has_c):
            if warp == _C_LOAD_WARP:
                cpasync.prefetch_descriptor(tma_atom_c)

        bidx, _, _ = cute.arch.block_idx()
        peer = bidx % pair  # this CTA's half of a cta_group::2 pair
        is_leader = peer == 0
        rank_in_cluster = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        coord_vmnk = cluster.get_flat_coord(rank_in_cluster)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        scales = self._scale_smem(storage, tma_sfa, tma_sfb, sfa_smem_staged, sfb_smem_staged)
        sD = storage.sD.get_tensor(d_smem_staged.outer, swizzle=d_smem_staged.inner)
        zout = None  # the pre-activation's staging, TMA atom and tiles, when the spec writes it
        if cutlass.const_expr(self.spec.preact_out):
            sZ = storage.sZ.get_tensor(d_smem_staged.outer, swizzle=d_smem_staged.inner)
            gZ = cute.local_tile(
                mZ, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None)
            )

        # Global tiles, then this CTA's share of each MMA tile.
        thr_mma = mma.get_slice(peer)
        gA = cute.local_tile(mA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        gD = cute.local_tile(mD, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None))
        tCgA = thr_mma.partition_A(gA)
        tCgB = thr_mma.partition_B(gB)
        tCgD = thr_mma.partition_C(gD)
        if cutlass.const_expr(self.spec.preact_out):
            zout = (sZ, tma_atom_z, sm100_epilogue.group_mma_modes(thr_mma.partition_C(gZ)))
        k_tiles = cute.size(gA, mode=[3])

        # TMA views: ((box values, boxes), stage) in SMEM and ((...), tile m|n, k, l) in GMEM.
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a,
            coord_vmnk[2],
            cute.make_layout(cute.slice_(cluster, (0, 0, None, 0)).shape),
            cute.group_modes(sA, 0, 3),
            cute.group_modes(tCgA, 0, 3),
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b,
            coord_vmnk[1],
            cute.make_layout(cute.slice_(cluster, (0, None, 0, 0)).shape),
            cute.group_modes(sB, 0, 3),
            cute.group_modes(tCgB, 0, 3),
        )
        # A/B ring: the TMA warp produces; every MMA warp that reads a stage (the multicast
        # peers along M and N, counted once) must release it before it is refilled.
        ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.num_ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.mcast_ctas_a + self.mcast_ctas_b - 1
            ),
            tx_count=_tma_copy_bytes(tma_atom_a, tAsA[(None, 0)])
            + _tma_copy_bytes(tma_atom_b, tBsB[(None, 0)])
            + self._scale_tx_bytes(scales, pair),
            cta_layout_vmnk=cluster,
            defer_sync=True,
        ).make_participants()

        # Accumulator ring in TMEM: the MMA warp produces, every epilogue thread of the pair
        # consumes.
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_barriers.data_ptr(),
            num_stages=self.num_acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, len(_EPI_WARPS) * pair),
            cta_layout_vmnk=cluster,
            defer_sync=True,
        )

        c_pipe = None
        sC, bGS_sC, bGS_gC = None, None, None
        if cutlass.const_expr(self.spec.has_c):
            sC = storage.sC.get_tensor(c_smem_staged.outer, swizzle=c_smem_staged.inner)
            tCgC = thr_mma.partition_C(
                cute.local_tile(
                    mC, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None)
                )
            )
            bGS_sC, bGS_gC = cpasync.tma_partition(
                tma_atom_c,
                0,
                cute.make_layout(1),
                cute.group_modes(sC, 0, 2),
                cute.group_modes(
                    cute.flat_divide(sm100_epilogue.group_mma_modes(tCgC), epi_tile), 0, 2
                ),
            )
            # Source-C ring, local to the CTA: one releasing lane per epilogue warp.
            c_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.c_barriers.data_ptr(),
                num_stages=self.num_epi_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, len(_EPI_WARPS)),
                tx_count=_tma_copy_bytes(tma_atom_c, bGS_sC[(None, 0)]),
                defer_sync=True,
            )

        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_base.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=_TMEM_PTR_BARRIER, num_threads=_WARP * (len(_EPI_WARPS) + 1)
            ),
            allocator_warp_id=_EPI_WARPS[0],
            is_two_cta=pair == 2,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_barrier.ptr,
        )

        # Barriers are initialised; peers must see that before anyone signals across the cluster.
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster, is_relaxed=True)

        acc_shape = mma.partition_shape_C(self.mma_tiler[:2])
        acc_layout = mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stages)).layout

        # Pipeline init must be visible cluster-wide before the first TMA or MMA signal.
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster)

        sched = utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        work = sched.initial_work_tile_info()

        # ----------------------------------------------------------- A/B TMA producer warp
        if warp == _AB_LOAD_WARP:
            # A tile is multicast to the CTAs of the cluster row that share its M coordinate, B
            # to those sharing N; a 2-CTA pair always needs the mask, even in a 2x1 cluster.
            mask_a, mask_b = None, None
            if cutlass.const_expr(self.mcast_ctas_a > 1 or self.mcast_ctas_b > 1 or pair == 2):
                mask_a = cpasync.create_tma_multicast_mask(cluster, coord_vmnk, mcast_mode=2)
                mask_b = cpasync.create_tma_multicast_mask(cluster, coord_vmnk, mcast_mode=1)

            while work.is_valid_tile:
                tile = work.tile_idx
                src_a = tAgA[(None, tile[0] // pair, None, tile[2])]
                src_b = tBgB[(None, tile[1], None, tile[2])]
                ab_producer.reset()
                ab_producer = self._load_k_tiles(
                    ab_producer, k_tiles, (tma_atom_a, src_a, tAsA, mask_a),
                    (tma_atom_b, src_b, tBsB, mask_b), (scales, tile, d_in, pair),
                )  # fmt: skip
                sched.advance_to_next_work()
                work = sched.get_current_work()
            ab_producer.tail()

        # ------------------------------------------------------------------ MMA warp
        if warp == _MMA_WARP:
            tCrA = mma.make_fragment_A(sA)
            tCrB = mma.make_fragment_B(sB)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(self.acc_dtype)
            acc = cute.make_tensor(acc_ptr, acc_layout)
            scales_mma = self._scale_mma_setup(mma, scales, acc_ptr)
            acc_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.num_acc_stages
            )
            k_blocks = cute.size(tCrA, mode=[2])
            while work.is_valid_tile:
                acc_stage = acc[(None, None, None, acc_state.index)]
                ab_consumer.reset()
                # Each tile starts from zero: the first MMA overwrites the TMEM stage.
                mma.set(tcgen05.Field.ACCUMULATE, False)
                # Only the leader of a pair issues cta_group::2 MMAs; its peer idles here.
                if is_leader:
                    acc_pipe.producer_acquire(acc_state)
                    for _k in cutlass.range(k_tiles, unroll=1):
                        slot = ab_consumer.wait_and_advance()
                        self._scales_to_tmem(scales_mma, slot.index)
                        for kb in cutlass.range(k_blocks, unroll_full=True):
                            a_op, b_op = self._mma_operands(tCrA, tCrB, scales_mma, kb, slot.index)
                            cute.gemm(mma, acc_stage, a_op, b_op, acc_stage)
                            mma.set(tcgen05.Field.ACCUMULATE, True)
                        slot.release()
                    acc_pipe.producer_commit(acc_state)
                acc_state.advance()
                sched.advance_to_next_work()
                work = sched.get_current_work()
            acc_pipe.producer_tail(acc_state)

        # ----------------------------------------------------------- C TMA producer warp
        if cutlass.const_expr(self.spec.has_c):
            if warp == _C_LOAD_WARP:
                c_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.num_epi_stages
                )
                while work.is_valid_tile:
                    tile = work.tile_idx
                    src = bGS_gC[(None, None, None, tile[0] // pair, tile[1], tile[2])]
                    src = cute.group_modes(src, 1, cute.rank(src))
                    for sub in cutlass.range(cute.size(src, mode=[1]), unroll=1):
                        c_pipe.producer_acquire(c_state)
                        cute.copy(
                            tma_atom_c,
                            src[(None, sub)],
                            bGS_sC[(None, c_state.index)],
                            tma_bar_ptr=c_pipe.producer_get_barrier(c_state),
                        )
                        c_state.advance()
                    sched.advance_to_next_work()
                    work = sched.get_current_work()
                c_pipe.producer_tail(c_state)

        # ------------------------------------------------------------------ epilogue warps
        if warp < _MMA_WARP:
            tmem.allocate(self.tmem_alloc_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            acc = sm100_epilogue.group_mma_modes(cute.make_tensor(tmem_ptr, acc_layout))
            sm100_epilogue.epilogue(
                self,
                tidx,
                warp,
                acc,
                acc_pipe,
                sD,
                tma_atom_d,
                sm100_epilogue.group_mma_modes(tCgD),
                sC,
                c_pipe,
                mBias,
                d_in,
                thr_mma,
                sched,
                work,
                pair,
                epi_tile,
                zout,
            )
            # Every epilogue warp's last TMEM load is done before the columns are freed (the
            # store loop's own barriers order them today; this keeps the free safe from it).
            pipeline.NamedBarrier(
                barrier_id=sm100_epilogue.EPI_BARRIER, num_threads=_WARP * len(_EPI_WARPS)
            ).arrive_and_wait()
            tmem.relinquish_alloc_permit()
            tmem.free(tmem_ptr)

    @cute.jit
    def _load_k_tiles(self, ab_producer, k_tiles, a_load, b_load, scale_load=(None,) * 4):
        """The TMA warp's loads of one tile's `k_tiles` stages, all on the stage's barrier: A
        and B (`a_load`, `b_load`: the atom, the tile's k-blocks, the SMEM stages, the multicast
        mask or None) and a subclass's scale factors (`scale_load`: `_load_scales`' arguments
        but the slot). Returns the advanced producer."""
        tma_atom_a, src_a, tAsA, mask_a = a_load
        tma_atom_b, src_b, tBsB, mask_b = b_load
        scales, tile, d_in, pair = scale_load
        for _k in cutlass.range(k_tiles, unroll=1):
            slot = ab_producer.acquire_and_advance()
            cute.copy(
                tma_atom_a,
                src_a[(None, slot.count)],
                tAsA[(None, slot.index)],
                tma_bar_ptr=slot.barrier,
                mcast_mask=mask_a,
            )
            cute.copy(
                tma_atom_b,
                src_b[(None, slot.count)],
                tBsB[(None, slot.index)],
                tma_bar_ptr=slot.barrier,
                mcast_mask=mask_b,
            )
            self._load_scales(scales, slot, tile, d_in, pair)
        return ab_producer

    # ------------------------------------------------------- hooks of a block-scaled subclass
    # Called from the device code above with `scales` None: the dense family emits nothing
    # for them (sm100_blockscaled.py overrides each).

    def _prefetch_scales(self, tma_sfa, tma_sfb):
        pass

    def _scale_smem(self, storage, tma_sfa, tma_sfb, sfa_smem_staged, sfb_smem_staged):
        return None

    def _scale_tx_bytes(self, scales, pair) -> int:
        return 0

    def _load_scales(self, scales, slot, tile, d_in, pair):
        pass

    def _scale_mma_setup(self, mma, scales, acc_ptr):
        return None

    def _scales_to_tmem(self, scales_mma, stage):
        pass

    def _mma_operands(self, tCrA, tCrB, scales_mma, kb, stage):
        """The A and B operands of one MMA instruction: k block `kb` of SMEM stage `stage`."""
        return tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)]

    # ----------------------------------------------------------------------------- legality

    @classmethod
    def why_not(cls, plan: Any, spec: KernelSpec) -> str | None:
        """The first reason `Sm100GemmKernel` cannot take (plan, spec), or None.

        The hardware rules (MMA shape, cluster, TMEM, SMEM) live in constraints.py and are re-run
        here on the plan as given, since `dataclasses.replace` on a plan is how tests force shapes;
        what is checked locally is only what this kernel adds: an sm100 plan whose dtypes and
        layouts agree with the spec, and the epilogue dtypes it can read and write.
        """
        if plan.arch != "sm_100a" or plan.kernel != cls.KERNEL:
            return f"{plan.arch=}, {plan.kernel=}: not an {cls.KERNEL} plan"
        if spec.d_major != "n":
            return f"spec.d_major={spec.d_major!r}: sm_100a kernels store D N-major only"
        for field in ("a_dtype", "b_dtype", "out_dtype", "c_dtype", "a_major", "b_major"):
            got, want = getattr(plan, field), getattr(spec, field)
            if got != want:
                return f"plan.{field}={got!r} but spec.{field}={want!r}"
        if (spec.b_groups or spec.k_segments > 1) and not plan.groups:
            return "b_groups and k_segments are for grouped plans (kernels/grouped.py)"
        if spec.preact_out and not plan.preact_out:
            return "spec.preact_out needs a plan with preact_out (its Z staging in SMEM)"
        ops = constraints.KERNEL_OPERAND_DTYPES["sm_100a"]
        if spec.a_dtype not in ops or spec.b_dtype not in ops:
            return f"{spec.a_dtype=}, {spec.b_dtype=}: operands must be in {ops}"
        if spec.a_dtype != spec.b_dtype and not {spec.a_dtype, spec.b_dtype} <= set(
            constraints.FP8_DTYPES
        ):
            return f"{spec.a_dtype=} != {spec.b_dtype=}: only fp8 operands may mix"
        outs = constraints.KERNEL_OUT_DTYPES
        for field in ("out_dtype", "c_dtype", "bias_dtype"):
            value = getattr(spec, field)
            if value is not None and value not in outs:
                return f"spec.{field}={value!r} must be one of {outs}"
        if plan.split_k != 1:
            return f"{plan.split_k=}: the SM100 family has no split-K"
        try:
            constraints.check_mma_tiler("sm_100a", plan.mma_tiler_mnk, plan.use_2cta, spec.a_dtype)
            constraints.check_cluster("sm_100a", plan.cluster_shape_mn, plan.use_2cta)
            constraints.check_tmem(plan.tmem_alloc_cols)
            constraints.check_ab_stages(plan.num_ab_stages)
        except constraints.PlanError as e:
            return str(e)
        if plan.acc_tmem_cols_per_stage * plan.num_acc_stages > plan.tmem_alloc_cols:
            return (
                f"{plan.num_acc_stages=} x {plan.acc_tmem_cols_per_stage=} exceed "
                f"{plan.tmem_alloc_cols=}"
            )
        if plan.num_epi_stages < 1 or plan.num_acc_stages < 1:
            return f"{plan.num_epi_stages=} and {plan.num_acc_stages=} must be at least 1"
        return None
