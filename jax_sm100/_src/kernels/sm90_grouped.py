"""The SM90 grouped GEMM family: `ragged_dot` and its backward on persistent wgmma.

One kernel, the two ragged modes of grouped.py ("m": ragged_dot and its d lhs; "k": its d rhs),
whose schedule (the device-built group table, the work tiles) and group boundaries (TMA bounds
on a rank-4 ragged view, one static descriptor per operand) are grouped.py's `GroupedGemm`,
shared with the SM100 family (sm100_grouped.py).

The warp roles, stage ring, main loop and epilogue are the dense SM90 family's (sm90_gemm.py):
a producer warp walking the work tiles with per-group TMA coordinates, and consumer warp groups
that are cooperative (a warp group per 64 rows of the tile) or ping-pong (whole tiles in turn).
In 2x1 clusters (`plan.cluster_shape_mn`) the two CTAs take the two m tiles of each work tile,
inside one group: each loads half of the group's B tile for both (TMA multicast), and every
consumer warp of both releases each stage to both producers.

ragged_dot's bias (N, G) is added in the epilogue (`GROUPED_BIAS`): each tile reads its group's
column, at the coordinates of the group's rows; the tiles of the rows past the groups add none.

Dynamic work tiles (`plan.dynamic_tiles`: cooperative plans in 1x1 clusters, the planner's choice
there; grouped.py's protocol). Round-robin, skewed group sizes leave the busiest SM 1.2x the
average's work (128 Dirichlet(0.3) groups: tiles of a few rows stream a whole weight slice,
others compute on full tiles). Instead the producer warp claims each next tile once it has
issued the current tile's loads, and both consumer warp groups read the indices from the ring.
Each tile is computed as in the static schedule, so results are the same bit for bit.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.pipeline as pipeline
from cutlass import cute
from cutlass.cute.nvgpu import cpasync, warpgroup

from jax_sm100._src.kernels import common
from jax_sm100._src.kernels.grouped import GroupedGemm, ragged_slice
from jax_sm100._src.kernels.sm90_gemm import (
    _CONSUMER_REGS,
    _PRODUCER_REGS,
    _SMEM_ALIGN,
    _THREADS_PER_WG,
    Sm90GemmKernel,
    _Epilogue,
)
from jax_sm100._src.kernels.spec import KernelSpec

# Rows of one wgmma: a cooperative tile's warp groups take them in turn along M.
_WGMMA_M = 64


class Sm90GroupedGemmKernel(GroupedGemm, Sm90GemmKernel):
    """A persistent grouped wgmma GEMM for one (GemmPlan with `groups`, KernelSpec).

    Host entry point: `__call__(a, b, d, group_sizes, bias, counter, stream)` (grouped.py's
    modes; `counter`: with `plan.dynamic_tiles`, one int32 the caller zeroes for every call,
    else None); legality and fake operands are `GroupedGemm`'s, then the dense family's.
    """

    GROUPED_BIAS = True

    def __init__(self, plan, spec: KernelSpec):
        super().__init__(plan, spec)
        self._init_grouped(plan)

    # ---------------------------------------------------------------- host

    @cute.jit
    def __call__(
        self, a: cute.Tensor, b: cute.Tensor, d: cute.Tensor, gs: cute.Tensor,
        bias: cute.Tensor | None, counter: cute.Tensor | None, stream: cuda.CUstream,
    ):  # fmt: skip
        self._setup()
        tm, tn, tk = self.tile_mnk
        a_view, b_view, d_view, extent, tiles_m, tiles_n, max_work = self._grouped_views(a, b, d)
        tma_a, ta = self._tma_load(a_view, self.a_smem_staged, (tm, tk), 1)
        # A 2x1 cluster's CTAs share the B tile: each loads half of it for both.
        tma_b, tb = self._tma_load(b_view, self.b_smem_staged, (tn, tk), self.pair)
        tma_d, td = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), d_view,
            cute.slice_(self.d_smem_staged, (None, None, 0)), self.epi_tile,
        )  # fmt: skip
        # The barriers, the work ring and the group table share the bytes before A's stages
        # (which start at the next 1024-byte boundary), as the planner counts them
        # (`GemmPlan._table_bytes`); after D's stages the ring cost a whole 1024 bytes.
        fields = {
            "ab_barriers": cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2],
            **self._work_ring_fields(),
            "table": self._table_field(),
            "sa": cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_staged)], _SMEM_ALIGN
            ],
            "sb": cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_staged)], _SMEM_ALIGN
            ],
            "sd": cute.struct.Align[
                cute.struct.MemRange[self.d_dtype, cute.cosize(self.d_smem_staged)], _SMEM_ALIGN
            ],
        }
        self.shared = common.shared_struct(fields, self.plan)
        grid = cutlass.max(cutlass.min(max_work, self.max_active_clusters), 1) * self.pair
        self.kernel(
            tma_a, ta, tma_b, tb, tma_d, td, gs, bias, counter, extent, a.shape[1], tiles_m,
            tiles_n,
            self.tiled_mma,
            self.a_smem_staged, self.b_smem_staged, self.d_smem_staged,
        ).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], cluster=(self.pair, 1, 1),
            min_blocks_per_mp=1, stream=stream,
        )  # fmt: skip

    # ---------------------------------------------------------------- device

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_d: cute.CopyAtom,
        mD: cute.Tensor,
        mGs: cute.Tensor,
        mBias: cute.Tensor | None,
        mCounter: cute.Tensor | None,
        extent: cutlass.Int32,
        k_extent: cutlass.Int32,
        tiles_m: cutlass.Int32,
        tiles_n: cutlass.Int32,
        tiled_mma: cute.TiledMma,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        d_smem_staged: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // _THREADS_PER_WG)
        # The CTA's rank along the cluster's M: its m tile within each work tile (0 in 1x1
        # clusters). Both CTAs of a pair walk the same work tiles, so they agree on each tile's
        # group and k-block count, and so on the stages they share.
        rank = cutlass.Int32(0)
        b_mask = 0
        if cutlass.const_expr(self.pair > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            cluster = cute.make_layout((self.pair, 1, 1))
            b_mask = cute.make_layout_image_mask(cluster, cluster.get_flat_coord(rank), mode=0)

        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_d)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared)
        stage_bytes = cute.size_in_bytes(
            self.a_dtype, cute.slice_(a_smem_staged, (None, None, 0))
        ) + cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem_staged, (None, None, 0)))
        # Every consumer warp of both CTAs reads a stage whose B half came from either CTA, so
        # every one of them releases it to both producers.
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            tidx=common.pinned_thread_idx(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.pair * self.mma_wgs * 4
            ),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.pair, 1, 1)),
            defer_sync=True,
        )
        work = self._work_ring(storage, self.num_consumer_threads, mCounter)
        table = storage.table.get_tensor(cute.make_layout(2 * (self.groups + 2)))
        if warp == 0:
            self._build_table(mGs, table, extent, tiles_n)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.pair, 1), is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=(self.pair, 1))
        cute.arch.sync_threads()

        sA = storage.sa.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sb.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sD = storage.sd.get_tensor(d_smem_staged.outer, swizzle=d_smem_staged.inner)
        sched = (table, tiles_m, tiles_n, k_extent)

        if wg == 0:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if warp == 0:
                self._produce_grouped(ab_pipe, sched, tma_a, mA, sA, tma_b, mB, sB, rank,
                                      b_mask, work)  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(_CONSUMER_REGS)
            self._consume_grouped(ab_pipe, sched, tiled_mma, sA, sB, sD, tma_d, mD, mBias,
                                  warp, wg - 1, tidx - _THREADS_PER_WG, rank, work)  # fmt: skip

    # ---------------------------------------------------------------- producer

    @cute.jit
    def _produce_grouped(self, ab_pipe, sched, tma_a, mA, sA, tma_b, mB, sB, rank, b_mask,
                         work):  # fmt: skip
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        w, end, stride = self._work_range(sched)
        published = self._produce_first(work, w)
        sAg = cute.group_modes(sA, 0, 2)
        sBg = cute.group_modes(sB, 0, 2)
        loads = (ab_pipe, tma_a, mA, sAg, tma_b, mB, sBg, rank, b_mask)
        tk = self.work_tile[2]
        while w < end:
            group, start, rows, m_tile, n_tile, zeros = self._work(sched, w, rank)
            if cutlass.const_expr(self.segments > 1):
                # The k-blocks of every segment of the tile's D, one after another.
                for s in cutlass.range(self.segments, unroll=1):
                    s_start, s_rows = self._segment(sched, group, s)
                    state = self._load_k_blocks(loads, state, group, s_start, s_rows, m_tile,
                                                n_tile, (s_rows + tk - 1) // tk)  # fmt: skip
            else:
                n_k = self._k_tiles(sched, group, rows, zeros)
                state = self._load_k_blocks(loads, state, group, start, rows, m_tile, n_tile, n_k)
            w, published = self._produce_next(work, published, w, stride)
        ab_pipe.producer_tail(state)

    @cute.jit
    def _load_k_blocks(self, loads, state, group, start, rows, m_tile, n_tile, n_k):
        """The producer warp's loads of `n_k` k-blocks of a work tile of `group` whose ragged
        extent is [start, start + rows), into the stages from `state`. Returns the state
        advanced past them."""
        ab_pipe, tma_a, mA, sAg, tma_b, mB, sBg, rank, b_mask = loads
        tm, tn, tk = self.tile_mnk
        a_mk, b_nk = self._group_operands(mA, mB, group, start, rows)
        gA = cute.local_tile(a_mk, (tm, tk), (m_tile, None))
        gB = cute.local_tile(b_nk, (tn, tk), (n_tile, None))
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), sAg, cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, rank, cute.make_layout(self.pair), sBg, cute.group_modes(gB, 0, 2)
        )
        for kt in range(n_k):
            common.acquire_empty(ab_pipe, state)
            barrier = ab_pipe.producer_get_barrier(state)
            cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=barrier)
            cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, state.index)], tma_bar_ptr=barrier,
                      mcast_mask=b_mask)  # fmt: skip
            ab_pipe.producer_commit(state)
            state.advance()
        return state

    # ---------------------------------------------------------------- consumers

    @cute.jit
    def _consume_grouped(self, ab_pipe, sched, tiled_mma, sA, sB, sD, tma_d, mD, mBias, warp,
                         consumer_wg, ctidx, rank, work):  # fmt: skip
        """The consumer warp groups. Cooperative: both take every tile of the CTA, 64 rows
        each. Ping-pong: warp group c takes the CTA's tiles c, c + 2, ... whole, and the two
        take turns at the stage ring (a named barrier each), so one's epilogue runs under the
        other's main loop; each skips the stages of the other's tiles, whose k-block counts it
        reads off the same schedule."""
        tm, tn, tk = self.tile_mnk
        # `consumer_wg` comes warp-uniform (make_warp_uniform), as in the dense kernel: computed
        # here from the thread index, ptxas took the ping-pong schedule's branches on it for
        # divergent paths and serialized every wgmma (its note C7520).
        etidx, mma_base, store_warp, epi_group = self._consumer_roles(consumer_wg, ctidx)
        thr_mma = tiled_mma.get_slice(mma_base)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        tile_crd = cute.make_identity_tensor((tm, tn))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(tile_crd).shape[:3], self.acc_dtype)
        k_blocks = cute.size(tCrA, mode=[2])

        r2s, thr_r2s, tRS_sD, tRS_acc, sub_acc, sub_out, sub_size = self._d_copy(
            tiled_mma, sD, acc, etidx
        )
        store_pipe, epi_barrier, my_turn, their_turn = self._consumer_barriers(
            consumer_wg, epi_group
        )
        gD_k = None
        if cutlass.const_expr(self.ragged == "k"):
            gD_k = cute.local_tile(mD, (tm, tn), (None, None, None))

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        w, end, stride = self._work_range(sched)
        step = stride
        w, taken = self._take_first(work, w)
        if cutlass.const_expr(self.pingpong):
            step = 2 * stride
            if consumer_wg == 1:
                # Group 1 lets group 0 start on the CTA's first tile, then skips its stages.
                if w < end:
                    their_turn.arrive()
                    read, release = self._skip(sched, w, read, release)
                w += stride
        tiles_done = cutlass.Int32(0)
        while w < end:
            group, start, rows, m_tile, n_tile, zeros = self._work(sched, w, rank)
            n_k = self._k_tiles(sched, group, rows, zeros)
            if cutlass.const_expr(self.pingpong):
                my_turn.arrive_and_wait()
            # The main loop and its final wait run on every path, as in the dense kernel (a
            # zero tile's n_k = 0 leaves the zeroed accumulators and an empty wait); only the
            # release of the last stage depends on n_k. With the main loop and the wait each
            # under its own `if n_k > 0`, ptxas could not prove that no path reads the
            # accumulators while a batch is in flight, and serialized every wgmma of the kernel
            # (its notes C7514, cooperative, and C7520, ping-pong).
            if self._rows_past_group(consumer_wg, m_tile, rows):
                read, release = self._drain(ab_pipe, acc, n_k, read, release)
            else:
                read, release = self._mainloop(ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks,
                                               n_k, read, release)  # fmt: skip
            self._hand_turn(their_turn, w + stride < end)
            warpgroup.wait_group(0)
            if n_k > 0:
                ab_pipe.consumer_release(release)
                release.advance()
            if cutlass.const_expr(self.pingpong):
                if w + stride < end:
                    read, release = self._skip(sched, w + stride, read, release)
            cD, bias_g, bounds = None, None, mD
            if cutlass.const_expr(self.ragged == "m"):
                d_mn = ragged_slice(mD, 0, start, rows)
                gD = cute.local_tile(d_mn, (tm, tn), (None, None))
                tile = (m_tile, n_tile)
                cD = gD
                if cutlass.const_expr(self.has_bias):
                    # The group's bias column, at each register's (row in the group, column);
                    # a tile of the rows past the groups has no rows in bounds, so adds none.
                    live = rows
                    if zeros:
                        live = cutlass.Int32(0)
                    bounds = cute.make_identity_tensor((live, mD.shape[1]))
                    cD = cute.local_tile(bounds, (tm, tn), (None, None))
                    bias_g = mBias[(None, cutlass.min(group, self.groups - 1))]
            else:
                gD = gD_k
                tile = (m_tile, n_tile, group)
                cD = gD
            epi = _Epilogue(gD, cD, None, sD, tma_d, r2s, thr_r2s, tRS_sD, tRS_acc, sub_acc,
                            sub_out, sub_size, bias_g, bounds, store_pipe, epi_barrier,
                            store_warp, epi_group, None, None, None, None)  # fmt: skip
            self._store_tile(tile, tiles_done, epi, warp)
            tiles_done += 1
            w, taken = self._take_next(work, taken, w, step)
        store_pipe.producer_tail()

    @cute.jit
    def _rows_past_group(self, consumer_wg, m_tile, rows):
        """Cooperative "m" mode: whether all of this warp group's rows of the tile (64 of each
        128, from consumer_wg x 64 on) lie past its group's end, as in a group's last tile when
        its rows end in the tile's first half, or in a pair's CTA past a short group. Such a
        warp group's products would be stored nowhere (TMA drops rows past the group), so it
        skips its wgmma and the other warp group has the tensor cores to itself. Skewed
        groups have many such tiles (128 Dirichlet(0.3) groups of 128 rows on average: a
        third fewer rows through the tensor cores). False otherwise."""
        past = False
        if cutlass.const_expr(self.ragged == "m" and not self.pingpong):
            # Warp group c's first row is 64 c at every tile height: a 256-row tile gives it
            # rows [64 c, 64 c + 64) and [128 + 64 c, ...), so the test holds for both.
            past = m_tile * self.tile_mnk[0] + consumer_wg * _WGMMA_M >= rows
        return past

    @cute.jit
    def _drain(self, ab_pipe, acc, n_k, read, release):
        """`_mainloop`'s stage traffic without its products: zeroed accumulators, each of the
        `n_k` stages waited for (its bytes landed before it is handed back) and released but
        the last, which the caller releases after its `wait_group(0)`, as after the main loop.
        No wgmma is issued on this path, so the caller's wait has nothing in flight from it."""
        acc.fill(0.0)
        for kt in range(n_k):
            common.wait_full(ab_pipe, read)
            read.advance()
            if kt > 0:
                ab_pipe.consumer_release(release)
                release.advance()
        return read, release

    @cute.jit
    def _hand_turn(self, their_turn, other_has_tile):
        """Ping-pong: this tile's stages have all landed, so the other group's tile is next in
        the ring: hand it the turn if it has a tile (the caller then skips that tile's stages).
        Nothing in the cooperative schedule."""
        if cutlass.const_expr(self.pingpong):
            if other_has_tile:
                their_turn.arrive()

    @cute.jit
    def _skip(self, sched, w, read, release):
        """(read, release) advanced past the stages of work tile `w` (another warp group's)."""
        group, _, rows, _, _, zeros = self._work(sched, w)
        n_k = self._k_tiles(sched, group, rows, zeros)
        for _ in range(n_k):
            read.advance()
            release.advance()
        return read, release
