"""The SM100 grouped GEMM family: `ragged_dot` and its backward on persistent tcgen05.

`Sm100GroupedGemmKernel` is the dense family's `Sm100GemmKernel` (sm100_gemm.py) with
grouped.py's `GroupedGemm` in front, as `Sm90GroupedGemmKernel` is the dense SM90 kernel with
it: the same host operands and ragged modes ("m": ragged_dot and its d lhs; "k": its d rhs),
the same device-built group table and work tiles, the same group boundaries (TMA bounds on a
rank-4 ragged view). From the dense family it keeps the warp roles and their code:

    warps 0-3  epilogue (sm100_epilogue.py's `setup` and `store_tile`): TMEM -> registers ->
               alpha/bias/activation -> SMEM -> TMA store of D, one subtile at a time; warp 0
               allocates and frees the TMEM accumulators
    warp 4     MMA: tcgen05.mma (cta_group::1) into one of `num_acc_stages` TMEM accumulators
    warp 5     TMA producer (`_load_k_tiles`): A and B stages; before the roles split it also
               builds the group table

the tiled MMA, SMEM layouts, TMA atoms and mbarrier rings (`_setup`, `_ab_tma_atoms`,
`_tma_copy_bytes`). What the grouped kernel does differently, per work tile: every role reads
(group, first row, rows, m tile, n tile) off the table (`_work`), the producer and the epilogue
address the group's rows through `ragged_slice` of the ragged views, and a tile with no
k-blocks (the rows past the groups in "m" mode, an empty group in "k" mode) takes no
accumulator stage: the MMA warp skips it and the epilogue stores the epilogue of zeros.

1-CTA MMAs, in 1x1 or 2x1 clusters. A work tile's rows end at its group's end, anywhere inside
the tile; in a 2x1 cluster the shared schedule makes the work tile two CTA tiles tall inside
one group (`GroupedGemm.pair`, as on sm_90a, where the H200 runs it), so the two CTAs share
the group's B tile by multicast (the dense family's partition and masks) and each loads its
own m tile of A. A cta_group::2 pair (one 256-row MMA) is not built for grouped plans.
(planning/sm100.py plans 128x256 or 128x128.)

TMA descriptors: one static descriptor per operand, built on the host over the ragged views
(`cute.nvgpu.make_tiled_tma_atom_A/B`, `cpasync.make_tiled_tma_atom`), covers every group, since
a group's bounds travel in the TMA coordinates (grouped.py). No per-group descriptor is built,
so none is patched in global memory or fenced before use, and the DSL's TensorMap route
(`cutlass.experimental.cuda.TensorMap`, which CUTLASS's own grouped GEMM uses for per-group
pointers) has nothing to describe here. Each stage's mbarrier expects the bytes of the A and
B boxes the stage's TMA copies move, read off the atoms and their SMEM partitions
(`_tma_copy_bytes`): the whole tile, since TMA counts a box's zero-filled bytes past a group's
end towards the transaction too.

In 1x1 clusters the work tiles are claimed dynamically (`plan.dynamic_tiles`, grouped.py's
protocol, which the SM90 family runs on the H200): the TMA warp claims and publishes each tile's
index, and the MMA warp and the epilogue warps read them from the ring in turn. The ring's
GROUPED_WORK_RING slots let the TMA warp run at most that many tiles ahead of the epilogue,
which trails the MMA by up to `num_acc_stages` tiles: for tiles of one or two k-blocks (weight
gradients of short groups) the ring, not the A/B stages, bounds how far loads run ahead.

Verified only by compiling for sm_100a on a CPU machine (tests/test_sm100_grouped_ptx.py reads
the PTX); no SM100 GPU has run this code.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync, tcgen05

from jax_sm100._src import planning
from jax_sm100._src.kernels import sm100_epilogue
from jax_sm100._src.kernels.grouped import GroupedGemm, ragged_slice
from jax_sm100._src.kernels.sm100_gemm import (
    _AB_LOAD_WARP,
    _EPI_WARPS,
    _MMA_WARP,
    _TMEM_PTR_BARRIER,
    _WARP,
    Sm100GemmKernel,
    _tma_copy_bytes,
)
from jax_sm100._src.kernels.spec import KernelSpec


class Sm100GroupedGemmKernel(GroupedGemm, Sm100GemmKernel):
    """A persistent grouped tcgen05 GEMM for one (GemmPlan with `groups`, KernelSpec).

    Host entry point: `__call__(a, b, d, group_sizes, bias, counter, stream)` (grouped.py's
    modes and dynamic tiles); legality and fake operands are `GroupedGemm`'s, then the dense
    family's.
    """

    KERNEL = planning.KERNEL_SM100_GROUPED
    GROUPED_BIAS = True

    def __init__(self, plan: Any, spec: KernelSpec):
        super().__init__(plan, spec)
        self._init_grouped(plan)

    @classmethod
    def why_not(cls, plan: Any, spec: KernelSpec) -> str | None:
        if plan.use_2cta:
            return "grouped sm_100a plans run 1-CTA MMAs (a CTA pair's tile would span groups)"
        return super().why_not(plan, spec)

    def _smem_fields(self) -> dict:
        # The group table (and the dynamic tiles' ring) after the 1024-byte aligned tiles (the
        # planner counts them apart).
        return {**super()._smem_fields(), "table": self._table_field(), **self._work_ring_fields()}

    # ---------------------------------------------------------------- host

    @cute.jit
    def __call__(
        self, a: cute.Tensor, b: cute.Tensor, d: cute.Tensor, gs: cute.Tensor,
        bias: cute.Tensor | None, counter: cute.Tensor | None, stream: cuda.CUstream,
    ):  # fmt: skip
        self._setup()
        a_view, b_view, d_view, extent, tiles_m, tiles_n, max_work = self._grouped_views(a, b, d)
        # ragged_dot's bias (N, G) as (M, N, G) with a zero M stride, so that the epilogue
        # partitions it as the dense family's (M, N, L) bias, each tile at its group.
        bias_mng = None
        if cutlass.const_expr(self.spec.has_bias):
            n = bias.shape[0]
            bias_mng = cute.make_tensor(
                bias.iterator, cute.make_layout((extent, n, self.groups), stride=(0, 1, n))
            )
        tma_atom_a, tma_a, tma_atom_b, tma_b = self._ab_tma_atoms(a_view, b_view)
        tma_atom_d, tma_d = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(),
            d_view,
            cute.slice_(self.d_smem_staged, (None, None, 0)),
            self.epi_tile,
        )
        grid = cutlass.max(cutlass.min(max_work, self.max_active_clusters), 1) * self.pair
        self.grouped_kernel(
            self.tiled_mma, tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_d, tma_d, gs, bias_mng,
            counter, extent, a.shape[1], tiles_m, tiles_n, self.cluster_layout_vmnk,
            self.a_smem_staged, self.b_smem_staged, self.d_smem_staged, self.epi_tile,
        ).launch(
            grid=[grid, 1, 1], block=[self.threads_per_cta, 1, 1], cluster=(self.pair, 1, 1),
            stream=stream,
        )  # fmt: skip

    # ---------------------------------------------------------------- device

    @cute.kernel
    def grouped_kernel(
        self,
        mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_d: cute.CopyAtom,
        mD: cute.Tensor,
        mGs: cute.Tensor,
        mBias: cute.Tensor | None,
        mCounter: cute.Tensor | None,
        extent: cutlass.Int32,
        k_extent: cutlass.Int32,
        tiles_m: cutlass.Int32,
        tiles_n: cutlass.Int32,
        cluster: cute.Layout,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        d_smem_staged: cute.ComposedLayout,
        epi_tile: cute.Tile,
    ):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        # In a 2x1 cluster the CTA's rank along M is its m tile within each work tile (both
        # CTAs walk the same work tiles, inside one group: grouped.py), and B's loads multicast
        # to both CTAs, as in the dense family's clusters.
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        coord_vmnk = cluster.get_flat_coord(rank)

        if warp == _AB_LOAD_WARP:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
        if warp == _EPI_WARPS[0]:
            cpasync.prefetch_descriptor(tma_atom_d)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sD = storage.sD.get_tensor(d_smem_staged.outer, swizzle=d_smem_staged.inner)
        table = storage.table.get_tensor(cute.make_layout(2 * (self.groups + 2)))
        thr_mma = mma.get_slice(0)

        # The SMEM side of the A/B TMA partitions is the same for every work tile (group 0's
        # empty slice stands in for the global side here).
        tAsA, _, tBsB, _ = self._ab_tiles(
            tma_atom_a, mA, sA, tma_atom_b, mB, sB, thr_mma, 0, 0, 0, cluster, coord_vmnk
        )
        # Every MMA warp that reads a stage (the CTAs B is multicast to) releases it.
        ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.num_ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.mcast_ctas_a + self.mcast_ctas_b - 1
            ),
            tx_count=_tma_copy_bytes(tma_atom_a, tAsA[(None, 0)])
            + _tma_copy_bytes(tma_atom_b, tBsB[(None, 0)]),
            cta_layout_vmnk=cluster,
            defer_sync=True,
        ).make_participants()
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_barriers.data_ptr(),
            num_stages=self.num_acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, len(_EPI_WARPS)),
            cta_layout_vmnk=cluster,
            defer_sync=True,
        )
        # Dynamic tiles (grouped.py): the TMA warp publishes, the MMA and epilogue warps read.
        work = self._work_ring(storage, _WARP * (len(_EPI_WARPS) + 1), mCounter)
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_base.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=_TMEM_PTR_BARRIER, num_threads=_WARP * (len(_EPI_WARPS) + 1)
            ),
            allocator_warp_id=_EPI_WARPS[0],
            is_two_cta=False,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_barrier.ptr,
        )

        if warp == _AB_LOAD_WARP:
            self._build_table(mGs, table, extent, tiles_n)
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster, is_relaxed=True)
        acc_shape = mma.partition_shape_C(self.mma_tiler[:2])
        acc_layout = mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stages)).layout
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster)
        # The table is complete before any role reads it.
        cute.arch.sync_threads()

        sched = (table, tiles_m, tiles_n, k_extent)
        first, num, stride = self._work_range(sched)
        m_rank = coord_vmnk[1]  # this CTA's m tile of a work tile (0 in a 1x1 cluster)

        # ------------------------------------------------------------ A/B TMA producer warp
        if warp == _AB_LOAD_WARP:
            mask_b = None
            if cutlass.const_expr(self.mcast_ctas_b > 1):
                mask_b = cpasync.create_tma_multicast_mask(cluster, coord_vmnk, mcast_mode=1)
            w = first
            published = self._produce_first(work, w)
            loads = (tma_atom_a, mA, sA, tAsA, tma_atom_b, mB, sB, tBsB, mask_b, thr_mma,
                     cluster, coord_vmnk)  # fmt: skip
            tk = self.work_tile[2]
            while w < num:
                group, start, rows, m_tile, n_tile, zeros = self._work(sched, w, m_rank)
                if cutlass.const_expr(self.segments > 1):
                    # The k-blocks of every segment of the tile's D, one after another.
                    for s in cutlass.range(self.segments, unroll=1):
                        s_start, s_rows = self._segment(sched, group, s)
                        ab_producer = self._load_group_k_tiles(
                            loads, ab_producer, group, s_start, s_rows, m_tile, n_tile,
                            (s_rows + tk - 1) // tk,
                        )  # fmt: skip
                else:
                    n_k = self._k_tiles(sched, group, rows, zeros)
                    ab_producer = self._load_group_k_tiles(
                        loads, ab_producer, group, start, rows, m_tile, n_tile, n_k
                    )
                w, published = self._produce_next(work, published, w, stride)
            ab_producer.tail()

        # ------------------------------------------------------------------- MMA warp
        if warp == _MMA_WARP:
            tCrA = mma.make_fragment_A(sA)
            tCrB = mma.make_fragment_B(sB)
            tmem.wait_for_alloc()
            acc = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), acc_layout)
            acc_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.num_acc_stages
            )
            k_blocks = cute.size(tCrA, mode=[2])
            w, taken = self._take_first(work, first)
            while w < num:
                group, _, rows, _, _, zeros = self._work(sched, w)
                n_k = self._k_tiles(sched, group, rows, zeros)
                # A tile with no k-blocks takes no accumulator stage (its epilogue stores zeros).
                if n_k > 0:
                    acc_stage = acc[(None, None, None, acc_state.index)]
                    ab_consumer.reset()
                    # Each tile starts from zero: the first MMA overwrites the TMEM stage.
                    mma.set(tcgen05.Field.ACCUMULATE, False)
                    acc_pipe.producer_acquire(acc_state)
                    ab_consumer = self._mma_k_tiles(
                        mma, acc_stage, tCrA, tCrB, ab_consumer, n_k, k_blocks
                    )
                    acc_pipe.producer_commit(acc_state)
                    acc_state.advance()
                w, taken = self._take_next(work, taken, w, stride)
            acc_pipe.producer_tail(acc_state)

        # ------------------------------------------------------------------ epilogue warps
        if warp < _MMA_WARP:
            tmem.allocate(self.tmem_alloc_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            acc = sm100_epilogue.group_mma_modes(cute.make_tensor(tmem_ptr, acc_layout))
            # D by tile: in "k" mode the whole (M, N, G) output, indexed by the tile and its
            # group; in "m" mode the group's rows, partitioned per tile (group 0's empty slice
            # gives `setup` the shapes).
            tDgD, _ = self._d_tiles(tma_atom_d, mD, sD, thr_mma, epi_tile, 0, 0)
            epi = sm100_epilogue.setup(
                self, tidx, acc, sD, tma_atom_d, tDgD, mBias, mBias, thr_mma, epi_tile
            )
            acc_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.num_acc_stages
            )
            d_stage = cutlass.Int32(0)
            w, taken = self._take_first(work, first)
            while w < num:
                group, start, rows, m_tile, n_tile, zeros = self._work(sched, w, m_rank)
                n_k = self._k_tiles(sched, group, rows, zeros)
                d_tiles, tile = None, (m_tile, n_tile, group)
                if cutlass.const_expr(self.ragged == "m"):
                    _, d_tiles = self._d_tiles(tma_atom_d, mD, sD, thr_mma, epi_tile, start, rows)
                    tile = (m_tile, n_tile)
                # The bias of the tile's group; the rows past the groups (the tiles with no
                # k-blocks in "m" mode, where K > 0) add none.
                bias_tile = (m_tile, n_tile, cutlass.min(group, self.groups - 1))
                d_stage, acc_state, _ = sm100_epilogue.store_tile(
                    self, epi, warp, tile, acc_pipe, acc_state, None, None, d_stage, d_tiles,
                    n_k > 0, bias_tile, n_k > 0,
                )  # fmt: skip
                w, taken = self._take_next(work, taken, w, stride)
            epi.d_pipe.producer_tail()
            # Every epilogue warp's last TMEM load is done before the columns are freed.
            pipeline.NamedBarrier(
                barrier_id=sm100_epilogue.EPI_BARRIER, num_threads=_WARP * len(_EPI_WARPS)
            ).arrive_and_wait()
            tmem.relinquish_alloc_permit()
            tmem.free(tmem_ptr)

    # ---------------------------------------------------------------- per work tile

    @cute.jit
    def _load_group_k_tiles(self, loads, ab_producer, group, start, rows, m_tile, n_tile, n_k):
        """The TMA warp's loads of `n_k` k-blocks of a work tile of `group` whose ragged extent
        is [start, start + rows). Returns the advanced producer."""
        tma_atom_a, mA, sA, tAsA, tma_atom_b, mB, sB, tBsB, mask_b, thr_mma, cluster, vmnk = loads
        _, tAgA, _, tBgB = self._ab_tiles(
            tma_atom_a, mA, sA, tma_atom_b, mB, sB, thr_mma, group, start, rows, cluster, vmnk
        )
        # The producer's count indexes the k-blocks of this extent from its first.
        ab_producer.reset()
        return self._load_k_tiles(
            ab_producer, n_k, (tma_atom_a, tAgA[(None, m_tile, None)], tAsA, None),
            (tma_atom_b, tBgB[(None, n_tile, None)], tBsB, mask_b),
        )  # fmt: skip

    @cute.jit
    def _ab_tiles(self, tma_atom_a, mA, sA, tma_atom_b, mB, sB, thr_mma, group, start, rows,
                  cluster, coord_vmnk):  # fmt: skip
        """The TMA partitions of A and B for a tile of `group` (rows [start, start + rows) of
        the ragged extent): (tAsA, tAgA, tBsB, tBgB), the global sides indexed
        ((box values, boxes), m or n tile, k-block); each CTA of a multicast group loads its
        share of the box for all of them (the dense family's partition)."""
        a_mk, b_nk = self._group_operands(mA, mB, group, start, rows)
        gA = cute.local_tile(a_mk, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None))
        gB = cute.local_tile(b_nk, cute.slice_(self.mma_tiler, (0, None, None)), (None, None))
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a,
            coord_vmnk[2],
            cute.make_layout(cute.slice_(cluster, (0, 0, None, 0)).shape),
            cute.group_modes(sA, 0, 3),
            cute.group_modes(thr_mma.partition_A(gA), 0, 3),
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b,
            coord_vmnk[1],
            cute.make_layout(cute.slice_(cluster, (0, None, 0, 0)).shape),
            cute.group_modes(sB, 0, 3),
            cute.group_modes(thr_mma.partition_B(gB), 0, 3),
        )
        return tAsA, tAgA, tBsB, tBgB

    @cute.jit
    def _d_tiles(self, tma_atom_d, mD, sD, thr_mma, epi_tile, start, rows):
        """D by MMA tile ((M, N), tiles...: `setup`'s `tDgD`) and its TMA store partition
        ((values), n_epi_m, n_epi_n, tiles...): of group rows [start, start + rows) in "m"
        mode, of the whole (M, N, G) output in "k" mode."""
        d_mn = mD
        coord = (None, None, None)
        if cutlass.const_expr(self.ragged == "m"):
            d_mn = ragged_slice(mD, 0, start, rows)
            coord = (None, None)
        gD = cute.local_tile(d_mn, cute.slice_(self.mma_tiler, (None, None, 0)), coord)
        tDgD = sm100_epilogue.group_mma_modes(thr_mma.partition_C(gD))
        _, bSG_gD = cpasync.tma_partition(
            tma_atom_d,
            0,
            cute.make_layout(1),
            cute.group_modes(sD, 0, 2),
            cute.group_modes(cute.flat_divide(tDgD, epi_tile), 0, 2),
        )
        return tDgD, bSG_gD

    @cute.jit
    def _mma_k_tiles(self, mma, acc_stage, tCrA, tCrB, ab_consumer, k_tiles, k_blocks):
        """The MMA warp's `k_tiles` stages of one tile into `acc_stage` (the MMA set to
        overwrite it first), each stage released once its MMAs are issued; the dense kernel's
        inner loop (`device_kernel`, which keeps it inline: its PTX is compared byte for byte
        across refactors). Returns the advanced consumer."""
        for _k in cutlass.range(k_tiles, unroll=1):
            slot = ab_consumer.wait_and_advance()
            for kb in cutlass.range(k_blocks, unroll_full=True):
                a_op, b_op = self._mma_operands(tCrA, tCrB, None, kb, slot.index)
                cute.gemm(mma, acc_stage, a_op, b_op, acc_stage)
                mma.set(tcgen05.Field.ACCUMULATE, True)
            slot.release()
        return ab_consumer
