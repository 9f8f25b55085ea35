"""The SM90 GEMM's split schedules (a mixin of `Sm90GemmKernel`, sm90_gemm.py): stream-K
(`plan.stream_k`: the last waves' tiles shared out by k-blocks between consecutive persistent
clusters, meeting in a float32 workspace through a release/acquire flag) and the in-cluster
split-K reduction (`plan.split_reduce == "cluster"`: the CTAs of a (1, S) cluster sum their
float32 partial tiles through distributed shared memory, then run the fused epilogue). The
schedules themselves are described in sm90_gemm.py's docstring.
"""

from __future__ import annotations

import cutlass
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass import cute
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import warpgroup

from jax_sm100._src import constraints
from jax_sm100._src.kernels import common


class Sm90SplitSchedules:
    """The stream-K and in-cluster split-K methods of `Sm90GemmKernel`."""

    @cute.jit
    def _produce_sk(self, ab_pipe, sched_params, tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB,
                    b_mask, k_tiles, extra=None):  # fmt: skip
        """The producer on the stream-K schedule: each segment's k-blocks [kb, ke)."""
        sched = utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        sk = self._sk_schedule(sched_params, k_tiles)
        idx = cutlass.Int32(0)
        work, kb, ke = self._sk_segment(sched, sk, idx, k_tiles)
        while work.is_valid_tile:
            tile = work.tile_idx
            a_k = tAgA[(None, tile[0], None, tile[2])]
            b_k = tBgB[(None, tile[1], None, tile[2])]
            for j in range(ke - kb):
                common.acquire_empty(ab_pipe, state)
                barrier = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_a, a_k[(None, kb + j)], tAsA[(None, state.index)],
                          tma_bar_ptr=barrier, mcast_mask=a_mask)  # fmt: skip
                cute.copy(tma_b, b_k[(None, kb + j)], tBsB[(None, state.index)],
                          tma_bar_ptr=barrier, mcast_mask=b_mask)  # fmt: skip
                self._produce_stage_extra(extra, tile, kb + j, state, barrier)
                ab_pipe.producer_commit(state)
                state.advance()
            idx += 1
            work, kb, ke = self._sk_segment(sched, sk, idx, k_tiles)
        ab_pipe.producer_tail(state)

    @cute.jit
    def _sk_schedule(self, sched_params, k_tiles):
        """This cluster's share of the stream-K schedule, as (g, G, D, start, end, dp_count).

        T cluster tiles (a cluster tile is one tile per CTA of the cluster) over G persistent
        clusters. When T > G and G does not divide T, the first D = (T // G - 1) G tiles run
        data-parallel (cluster g takes tiles g, g + G, ...) and the last T - D tiles (between
        one and two waves) are cut into (T - D) * k_tiles k-block units shared out evenly:
        cluster g takes units [g U / G, (g + 1) U / G), at least k_tiles of them, so every such
        tile is split between at most two consecutive clusters. Otherwise all tiles run
        data-parallel (U = 0).
        """
        g = cute.arch.block_idx()[2]
        num_clusters = cute.arch.grid_dim()[2]
        tiles = cute.size(sched_params.problem_layout_ncluster_mnl)
        full = tiles // num_clusters
        dp_tiles = tiles
        units = cutlass.Int32(0)
        if full >= 1:
            if tiles - full * num_clusters != 0:
                dp_tiles = (full - 1) * num_clusters
                units = (tiles - dp_tiles) * k_tiles
        dp_count = cutlass.Int32(0)
        if g < dp_tiles:
            dp_count = (dp_tiles - g + num_clusters - 1) // num_clusters
        start = g * units // num_clusters
        end = (g + 1) * units // num_clusters
        return g, num_clusters, dp_tiles, start, end, dp_count

    @cute.jit
    def _sk_segment(self, sched, sk, idx, k_tiles):
        """Segment `idx` of this cluster's schedule: (work, kb, ke), k-blocks [kb, ke) of the
        work's tile; work.is_valid_tile is False past the last segment."""
        g, num_clusters, dp_tiles, start, end, dp_count = sk
        # The stream-K range is walked backwards, a tile at a time: segment j is the part of
        # tile t1 - j in [start, end), t1 the range's last tile and t0 its first.
        j = idx - dp_count
        t0 = start // k_tiles
        t1 = t0
        if end > start:
            t1 = (end - 1) // k_tiles
        t = t1 - j
        u = t * k_tiles
        if u < start:
            u = start
        e = (t + 1) * k_tiles
        if e > end:
            e = end
        lin = dp_tiles + t
        kb = u - t * k_tiles
        ke = e - t * k_tiles
        in_dp = idx < dp_count
        if in_dp:
            lin = g + idx * num_clusters
            kb = cutlass.Int32(0)
            ke = k_tiles
        valid = in_dp | ((end > start) & (j <= t1 - t0))
        work = sched._get_current_work_for_linear_idx(lin)
        return utils.WorkTileInfo(work.tile_idx, valid), kb, ke

    @cute.jit
    def _consume_sk(self, ab_pipe, sched, sched_params, tiled_mma, tCrA, tCrB, acc, k_blocks,
                    k_tiles, epi, warp, ctidx, rank, mWs, mFlags, extra=None):  # fmt: skip
        """The consumers on the stream-K schedule.

        A whole tile ends in the epilogue. A segment that stops short of its tile's end (ke <
        k_tiles; it starts the tile and comes first in this cluster's backwards walk) publishes
        its float32 partial in this CTA's workspace slot and raises the slot's flag. A segment
        that starts inside a tile (kb > 0; last in the walk) waits for the previous cluster's
        flag for the same CTA rank, adds that partial and runs the epilogue. The previous
        cluster publishes at the start of its stream-K range and this one gathers at the end of
        its own, so the wait is short.
        """
        cluster_size = self.cluster_mn[0] * self.cluster_mn[1]
        epi_barrier = epi.barrier
        sk = self._sk_schedule(sched_params, k_tiles)
        mine = sk[0] * cluster_size + rank
        previous = mine - cluster_size
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        tiles_done = cutlass.Int32(0)
        idx = cutlass.Int32(0)
        work, kb, ke = self._sk_segment(sched, sk, idx, k_tiles)
        while work.is_valid_tile:
            tile = work.tile_idx
            read, release = self._mainloop(ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks,
                                           ke - kb, read, release,
                                           self._tile_extra(extra, tile))  # fmt: skip
            warpgroup.wait_group(0)
            ab_pipe.consumer_release(release)
            release.advance()
            if ke < k_tiles:
                self._sk_publish(acc, mWs, mFlags, mine, ctidx, epi_barrier)
            else:
                if kb > 0:
                    self._sk_gather(acc, mWs, mFlags, previous, ctidx, epi_barrier)
                self._store_tile(tile, tiles_done, epi, warp)
                tiles_done += 1
            idx += 1
            work, kb, ke = self._sk_segment(sched, sk, idx, k_tiles)
        epi.store_pipe.producer_tail()

    def _sk_slot(self, mWs, slot, ctidx, acc):
        """This thread's words of workspace slot `slot`, shaped as `acc`: its v-th element at
        v * threads + ctidx, so a warp's access to one v is 128 contiguous bytes."""
        threads = self.num_consumer_threads
        base = slot * (threads * cute.size(acc)) + ctidx
        flat = cute.make_layout(cute.size(acc), stride=threads)
        return cute.make_tensor(
            mWs.iterator + base, cute.composition(flat, cute.make_layout(acc.shape))
        )

    @cute.jit
    def _sk_publish(self, acc, mWs, mFlags, slot, ctidx, sync):
        """Writes this CTA's partial tile to its slot, then releases the slot's flag (after a
        barrier over the consumer threads, so every thread's stores come before it)."""
        dst = self._sk_slot(mWs, slot, ctidx, acc)
        dst.store(acc.load())
        sync.arrive_and_wait()
        if ctidx == 0:
            cute.arch.atomic_add(mFlags.iterator + slot, cutlass.Int32(1), sem="release",
                                 scope="gpu")  # fmt: skip

    @cute.jit
    def _sk_gather(self, acc, mWs, mFlags, slot, ctidx, sync):
        """Waits (one thread, acquire) for slot `slot`'s flag, then adds its partial tile."""
        if ctidx == 0:
            ready = cute.arch.load(mFlags.iterator + slot, cutlass.Int32, sem="acquire",
                                   scope="gpu")  # fmt: skip
            while ready == 0:
                ready = cute.arch.load(mFlags.iterator + slot, cutlass.Int32, sem="acquire",
                                       scope="gpu")  # fmt: skip
        sync.arrive_and_wait()
        src = self._sk_slot(mWs, slot, ctidx, acc)
        acc.store(acc.load() + src.load())

    @cute.jit
    def _splitk_epilogue(self, acc, thr_c, sRed, red_bars, rank, tile, tiles_done, ctidx, mD, mC,
                         mBias, mZ):  # fmt: skip
        """Sums one output tile's S partials across the cluster, then the fused epilogue.

        `acc` is this CTA's float32 partial for K slice `rank`; `sRed` its (tm, tn) shared
        buffer; `red_bars` the "partials written" and "done reading" mbarriers, each completing
        once per tile when all S CTAs have arrived. One thread per CTA arrives, after a barrier
        over the CTA's consumer threads, with a cluster-scope release that carries their
        writes (or reads) along; one arrival per thread measured several times slower on the
        H200 (S x 128 remote atomics on one word).
        """
        tm, tn, _ = self.tile_mnk
        split = self.split
        threads = self.num_consumer_threads
        phase = tiles_done % 2
        cluster_scope = nvvm.MemScopeKind.CLUSTER
        sync = pipeline.NamedBarrier(barrier_id=common.SM90_EPI_BARRIER, num_threads=threads)
        # 1. Publish this CTA's partial (the previous tile's readers are done: step 3).
        tCsRed = thr_c.partition_C(sRed)
        tCsRed.store(acc.load())
        sync.arrive_and_wait()
        if ctidx == 0:
            for q in cutlass.range_constexpr(split):
                cute.arch.mbarrier_arrive(red_bars, peer_cta_rank_in_cluster=q, scope=cluster_scope)
        cute.arch.mbarrier_wait(red_bars, phase)
        cute.arch.fence_acq_rel_cluster()

        # 2. Rows [rank * rows, (rank + 1) * rows) of the tile: 4 columns per thread and step,
        # summed over the S partials (read through distributed shared memory), then the
        # epilogue and a predicated store (n is a multiple of 4, so a vector is in or out).
        rows = tm // split
        vecs_per_row = tn // 4
        num_vecs = rows * vecs_per_row
        row_words = tn + constraints.SPLITK_ROW_PAD
        m0 = tile[0] * tm
        n0 = (tile[1] // split) * tn
        for j in cutlass.range_constexpr((num_vecs + threads - 1) // threads):
            v = ctidx + j * threads
            if v < num_vecs:
                r = rank * rows + v // vecs_per_row
                col = (v % vecs_per_row) * 4
                off = cute.assume(r * row_words + col, divby=4)
                total = cute.make_rmem_tensor((4,), cutlass.Float32)
                total.fill(0.0)
                part = cute.make_rmem_tensor((4,), cutlass.Float32)
                for q in cutlass.range_constexpr(split):
                    src = cute.make_tensor(
                        cute.arch.map_dsmem_ptr(sRed.iterator + off, q), cute.make_layout(4)
                    )
                    cute.autovec_copy(src, part)
                    total.store(total.load() + part.load())
                gm = m0 + r
                gn = n0 + col
                if gm < mD.shape[0]:
                    if gn < mD.shape[1]:
                        vals = total.load()
                        out = cute.make_rmem_tensor((4,), self.d_dtype)
                        if cutlass.const_expr(self.preact):
                            vals, pre = self._splitk_fused(vals, gm, gn, mC, mBias, preact=True)
                            out.store(pre.to(self.d_dtype))
                            for i in cutlass.range_constexpr(4):
                                mZ[(gm, gn + i, 0)] = out[i]
                        elif cutlass.const_expr(not common.epilogue_is_identity(self.spec)):
                            vals = self._splitk_fused(vals, gm, gn, mC, mBias)
                        out.store(vals.to(self.d_dtype))
                        for i in cutlass.range_constexpr(4):
                            mD[(gm, gn + i, 0)] = out[i]

        # 3. Done reading the peers' partials; wait until every peer is done reading ours.
        sync.arrive_and_wait()
        if ctidx == 0:
            for q in cutlass.range_constexpr(split):
                cute.arch.mbarrier_arrive(
                    red_bars + 1, peer_cta_rank_in_cluster=q, scope=cluster_scope
                )
        cute.arch.mbarrier_wait(red_bars + 1, phase)
        # The wait acquires at CTA scope; the peers released at cluster scope. Order their reads
        # before this CTA's next partial overwrites the buffer (as after step 1's wait).
        cute.arch.fence_acq_rel_cluster()

    @cute.jit
    def _splitk_fused(self, vals, gm, gn, mC, mBias, preact=False):
        """alpha, beta * C, bias and activation on 4 summed values at (gm, gn .. gn + 3)."""
        c_vals = None
        bias_vals = None
        if cutlass.const_expr(self.has_c):
            rc = cute.make_rmem_tensor((4,), mC.element_type)
            for i in cutlass.range_constexpr(4):
                rc[i] = mC[(gm, gn + i, 0)]
            c_vals = rc.load()
        if cutlass.const_expr(self.has_bias):
            rb = cute.make_rmem_tensor((4,), mBias.element_type)
            for i in cutlass.range_constexpr(4):
                rb[i] = mBias[gn + i]
            bias_vals = rb.load()
        return self._epilogue_math(vals, c_vals, bias_vals, preact)
