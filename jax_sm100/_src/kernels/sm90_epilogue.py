"""The SM90 GEMM's epilogue (a mixin of `Sm90GemmKernel`, sm90_gemm.py): one output tile at a
time, one sub-tile (`plan.epi_tile`) after another, from the consumer warp group's float32
accumulators: the fused math (`common.apply_epilogue`: alpha, beta * C, bias, activation, or a
backward epilogue's act'(C) * acc), registers -> shared memory by stmatrix, shared -> global
memory by TMA (D, and the pre-activation Z with `spec.preact_out`).

C comes either from global memory into registers, one sub-tile ahead of its use, or with
`plan.stage_c` from a shared-memory ring per epilogue group that its own producer warp fills by
TMA (`_produce_c`), read by ldmatrix, the inverse of D's stmatrix.
"""

from __future__ import annotations

import cutlass
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass import cute
from cutlass.cute.nvgpu import cpasync

from jax_sm100._src.kernels import common


class Sm90Epilogue:
    """The epilogue methods of `Sm90GemmKernel` (they read its configuration)."""

    @cute.jit
    def _store_tile(self, tile, tiles_done, epi, warp, c_pipe=None, c_read=None):
        """The fused epilogue of one output tile, from the accumulators, one sub-tile at a time:
        registers -> shared memory (stmatrix) -> global memory (TMA store). With a staged C
        (`c_pipe` = (pipeline, this thread's view of the ring), `c_read` its state), each
        sub-tile's C comes from its ring slot; returns the advanced state."""
        (gD, cD, gC, sD, tma_d, r2s, thr_r2s, tRS_sD, tRS_acc, sub_acc, sub_out, sub_size,
         mBias, mD, store_pipe, epi_barrier, store_warp, epi_group, gZ, sZ, tma_z,
         tRS_sZ) = epi  # fmt: skip
        gD_tile = cute.zipped_divide(gD[(None, None, *tile)], self.epi_tile)
        cD_tile = cD[(None, None, *tile)]
        bSG_sD, bSG_gD = cpasync.tma_partition(
            tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_tile
        )
        bSG_sZ, bSG_gZ = None, None
        if cutlass.const_expr(self.preact):
            bSG_sZ, bSG_gZ = cpasync.tma_partition(
                tma_z, 0, cute.make_layout(1), cute.group_modes(sZ, 0, 2),
                cute.zipped_divide(gZ[(None, None, *tile)], self.epi_tile),
            )  # fmt: skip
        subs_mn = gD_tile.shape[1]
        sub_order = cute.make_layout(subs_mn, stride=(subs_mn[1], 1))
        num_subs = cute.size(sub_order)
        done = tiles_done * num_subs
        # C comes from global memory into registers, one sub-tile ahead of its use, so that its
        # latency overlaps the previous sub-tile's math and stores; as vectors where the whole
        # tile lies inside the matrix.
        gC_tile, whole, rc_next = None, None, None
        if cutlass.const_expr(self.has_c and not self.stage_c):
            tm, tn, _ = self.tile_mnk
            gC_tile = gC[(None, None, *tile)]
            whole = ((tile[0] + 1) * tm <= mD.shape[0]) & ((tile[1] + 1) * tn <= mD.shape[1])
            rc_next = self._load_c(thr_r2s, cD_tile, gC_tile, sub_order.get_hier_coord(0), mD,
                                   whole, sub_acc.shape)  # fmt: skip
        for s in cutlass.range_constexpr(num_subs):
            for v in cutlass.range_constexpr(sub_size):
                sub_acc[v] = tRS_acc[s * sub_size + v]
            sub_crd = sub_order.get_hier_coord(s)
            rc = rc_next
            if cutlass.const_expr(self.stage_c):
                pipe, s2r, thr_s2r, tSR_sC = c_pipe
                slot = self._ring_slot(c_read, epi_group)
                pipe.consumer_wait(slot)
                rc = cute.make_rmem_tensor(sub_acc.shape, tSR_sC.element_type)
                cute.copy(s2r, tSR_sC[(None, None, None, slot.index)], thr_s2r.retile(rc))
                # The slot is refilled by TMA (async proxy) after these generic-proxy reads.
                cute.arch.fence_proxy("async.shared", space="cta")
                pipe.consumer_release(slot)
                c_read.advance()
            elif cutlass.const_expr(self.has_c and s + 1 < num_subs):
                rc_next = self._load_c(thr_r2s, cD_tile, gC_tile, sub_order.get_hier_coord(s + 1),
                                       mD, whole, sub_acc.shape)  # fmt: skip
            vals = sub_acc.load()
            if cutlass.const_expr(self.preact):
                vals, pre = self._fused(vals, rc, thr_r2s, cD_tile, mBias, sub_crd, mD,
                                        preact=True)  # fmt: skip
                sub_out.store(pre.to(self.d_dtype))
                buf = epi_group * self.epi_stages + (done + s) % self.epi_stages
                cute.copy(r2s, sub_out, tRS_sZ[(None, None, None, buf)])
            elif cutlass.const_expr(not common.epilogue_is_identity(self.spec)):
                vals = self._fused(vals, rc, thr_r2s, cD_tile, mBias, sub_crd, mD)
            sub_out.store(vals.to(self.d_dtype))
            buf = epi_group * self.epi_stages + (done + s) % self.epi_stages
            cute.copy(r2s, sub_out, tRS_sD[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_barrier.arrive_and_wait()
            if warp == store_warp:
                cute.copy(tma_d, bSG_sD[(None, buf)], bSG_gD[(None, sub_crd)])
                if cutlass.const_expr(self.preact):
                    cute.copy(tma_z, bSG_sZ[(None, buf)], bSG_gZ[(None, sub_crd)])
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            epi_barrier.arrive_and_wait()
        return c_read

    def _ring_slot(self, state, group):
        """`state` (a position in one epilogue group's C ring of `epi_stages` slots) as the
        position of the shared pipeline's slot it names."""
        return pipeline.PipelineState(
            self.epi_stages * self.epi_groups, state.count,
            state.index + group * self.epi_stages, state.phase,
        )  # fmt: skip

    @cute.jit
    def _produce_c(self, c_pipe, sched_params, tma_c, mC_tma, sC, group):
        """The staged-C producer of epilogue group `group` (one warp): that group's tiles of
        this CTA's schedule, in order (every tile, or every other one in ping-pong), each tile's
        C sub-tiles in the epilogue's order, into the group's ring."""
        tm, tn, _ = self.tile_mnk
        gC = cute.local_tile(mC_tma, (tm, tn), (None, None, None))
        sched = utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        if cutlass.const_expr(group > 0):
            sched.advance_to_next_work(advance_count=group)
        work = sched.get_current_work()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.epi_stages)
        while work.is_valid_tile:
            tile = work.tile_idx
            gC_tile = cute.zipped_divide(gC[(None, None, *tile)], self.epi_tile)
            bGS_sC, bGS_gC = cpasync.tma_partition(
                tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_tile
            )
            subs_mn = gC_tile.shape[1]
            sub_order = cute.make_layout(subs_mn, stride=(subs_mn[1], 1))
            for s in cutlass.range_constexpr(self.num_subs):
                slot = self._ring_slot(state, group)
                c_pipe.producer_acquire(slot)
                cute.copy(tma_c, bGS_gC[(None, sub_order.get_hier_coord(s))],
                          bGS_sC[(None, slot.index)],
                          tma_bar_ptr=c_pipe.producer_get_barrier(slot))  # fmt: skip
                state.advance()
            sched.advance_to_next_work(advance_count=self.epi_groups)
            work = sched.get_current_work()
        # Wait until the group has released every slot before this warp exits.
        for _ in cutlass.range_constexpr(self.epi_stages):
            c_pipe.producer_acquire(self._ring_slot(state, group))
            state.advance()

    @cute.jit
    def _load_c(self, thr_r2s, cD_tile, gC_tile, sub_crd, mD, whole, shape):
        """This thread's C values of one sub-tile, in registers (zero outside the matrix).

        The registers are the source of the register->shared copy, so the copy's source view
        (`partition_S`) of a tile gives each register's element of it.
        """
        src = thr_r2s.partition_S(cute.local_tile(gC_tile, self.epi_tile, sub_crd))
        rc = cute.make_rmem_tensor(shape, src.element_type)
        if whole:
            cute.autovec_copy(src, rc)
        else:
            coords = thr_r2s.partition_S(cute.local_tile(cD_tile, self.epi_tile, sub_crd))
            rc.fill(0.0)
            for i in cutlass.range_constexpr(cute.size(coords)):
                if cute.elem_less(coords[i], mD.shape):
                    rc[i] = src[i]
        return rc

    @cute.jit
    def _fused(self, vals, rc, thr_r2s, cD_tile, mBias, sub_crd, mD, preact=False):
        """alpha, beta * C (`rc`, from `_load_c`), bias and activation on one sub-tile's
        registers, each register's (m, n, l) read off the copy's source view of the tile."""
        coords = thr_r2s.partition_S(cute.local_tile(cD_tile, self.epi_tile, sub_crd))
        n_vals = cute.size(coords)
        c_vals = None
        bias_vals = None
        if cutlass.const_expr(self.has_c):
            c_vals = rc.load()
        if cutlass.const_expr(self.has_bias):
            rb = cute.make_rmem_tensor(vals.shape, mBias.element_type)
            rb.fill(0.0)
            for i in cutlass.range_constexpr(n_vals):
                if cute.elem_less(coords[i], mD.shape):
                    # Bias runs along the caller's n: D's N, or its M when D is M-major.
                    rb[i] = mBias[coords[i][0 if self._d_m_major else 1]]
            bias_vals = rb.load()
        return self._epilogue_math(vals, c_vals, bias_vals, preact)

    def _epilogue_math(self, vals, c_vals, bias_vals, preact=False):
        """The spec's epilogue on float32 values (inlined into the kernel); with `preact`,
        (result, pre-activation)."""
        return common.apply_epilogue(
            vals,
            c_vals,
            bias_vals,
            alpha=self.spec.alpha,
            beta=self.spec.beta,
            activation=self.spec.activation,
            act_grad=self.spec.act_grad,
            preact=preact,
        )
