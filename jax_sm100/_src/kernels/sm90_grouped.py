"""The SM90 grouped GEMM family: `ragged_dot` and its backward on persistent wgmma.

One kernel, two ragged modes (`plan.ragged`), with the group sizes read on the device (no host
sync; the launch is CUDA-graph safe):

* "m" (ragged_dot, and its d lhs): A (M, K) holds every group's rows, one after another; B
  (N, K, G) one matrix per group; D (M, N). Group j's rows [s_j, s_j + g_j) times B[j].
  Rows past the last group are written as zeros.
* "k" (ragged_dot's d rhs): A (M, K) and B (N, K) both hold every group's rows along K; D
  (M, N, G). D[j] is the product over group j's rows only (zero for an empty group).

The warp roles, stage ring, main loop and epilogue are the dense SM90 family's (sm90_gemm.py,
cooperative only: a consumer warp group per 64 rows of the tile). What differs:

* The schedule. Every CTA first builds a table in shared memory from the group sizes (one warp,
  32 groups at a time with warp shuffles): each group's first row (a running sum clamped to the
  extent the groups partition, so bad sizes never address outside the buffers) and, in "m"
  mode, its first work tile. A work tile is (group, m tile, n tile); CTA c takes work tiles c,
  c + grid, ..., and a binary search of the table gives a work index its group. In "m" mode a
  group of g_j rows has ceil(g_j / tile_m) x tiles_n work tiles, a group boundary falls inside
  a tile anywhere, and an empty group has none; a last pseudo-group covers the rows past the
  groups (zeros, no main loop). In "k" mode the tiles are G x tiles_m x tiles_n and each runs
  ceil(g_j / tile_k) k-blocks (none for an empty group: it stores zeros).
* Group boundaries through TMA's bounds checks, with one static descriptor per operand. The
  ragged extent is presented to TMA as a rank-4 view: the ragged mode of extent 2^30 and two
  extra modes whose strides are (2^34 - s, s) elements (s: the ragged mode's stride). Group j
  is then addressed at coordinates (2^30 - g_j + r, ., 2^30, s_j + g_j): the address is
  base + (s_j + r) s + 2^64 x (element bytes), which is base + (s_j + r) s modulo 2^64, and
  the bounds check of the first coordinate ends the group at row g_j. Loads past a group's end
  are zero-filled and stores past it are dropped, so a tile that straddles two groups neither
  reads the next group's rows into its sums nor writes over its output. (The same view
  technique Triton's ragged TMA and quack's varlen GEMMs use.)
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.pipeline as pipeline
from cutlass import cute
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from jax_sm100._src.kernels import common, family
from jax_sm100._src.kernels.sm90_gemm import (
    _CONSUMER_REGS,
    _EPI_BARRIER_ID,
    _PRODUCER_REGS,
    _SMEM_ALIGN,
    _THREADS_PER_WG,
    Sm90GemmKernel,
    _Epilogue,
)
from jax_sm100._src.kernels.spec import KernelSpec

# The ragged view (module docstring): the ragged mode's extent, and the extra modes' extent.
_RAGGED_EXTENT = 2**30
_EXTRA_EXTENT = 2**31 - 1
_WRAP = 2**34  # _RAGGED_EXTENT * _WRAP = 2**64


def ragged_view(t: cute.Tensor, mode: int) -> cute.Tensor:
    """`t` (rank 2) as the rank-4 view whose bounds TMA can move to any group's end."""
    shape = list(t.shape)
    stride = list(t.stride)
    s = cutlass.Int64(stride[mode])
    shape[mode] = _RAGGED_EXTENT
    layout = cute.make_layout(
        (*shape, _EXTRA_EXTENT, _EXTRA_EXTENT), stride=(*stride, _WRAP - s, s)
    )
    return cute.make_tensor(t.iterator, layout)


@cute.jit
def ragged_slice(view: cute.Tensor, mode: cutlass.Constexpr[int], start, length) -> cute.Tensor:
    """The rank-2 view of `view` (a ragged_view, or its TMA coordinates) whose `mode` starts
    at `start` and ends after `length`."""
    sub = view[(None, None, _RAGGED_EXTENT, start + length)]
    offset = [0, 0]
    offset[mode] = _RAGGED_EXTENT - length
    return cute.domain_offset(tuple(offset), sub)


class Sm90GroupedGemmKernel(Sm90GemmKernel):
    """A persistent grouped wgmma GEMM for one (GemmPlan with `groups`, KernelSpec).

    Host entry point: `__call__(a, b, d, group_sizes, stream)`; modes as in the module
    docstring (a, d rank 2 and b rank 3 in "m" mode; a, b rank 2 and d rank 3 in "k" mode),
    group_sizes (G,) int32.
    """

    HOST_OPERANDS = ("a", "b", "d", "group_sizes")

    def __init__(self, plan, spec: KernelSpec):
        super().__init__(plan, spec)
        self.groups = int(plan.groups)
        self.ragged = plan.ragged

    @classmethod
    def why_not(cls, plan, spec: KernelSpec) -> str | None:
        if not plan.groups or plan.ragged not in ("m", "k"):
            return "not a grouped plan (plan.groups, plan.ragged)"
        if plan.pingpong or plan.split_k != 1 or plan.stream_k or plan.stage_c:
            return "grouped plans are cooperative, without split-K, stream-K or a staged C"
        if tuple(plan.cluster_shape_mn) != (1, 1):
            return f"grouped plans run 1x1 clusters, not {plan.cluster_shape_mn}"
        if spec.has_c or spec.has_bias or spec.preact_out or spec.act_grad:
            return "the grouped epilogue takes alpha and an activation only"
        if plan.ragged == "m" and spec.a_major != "k":
            return "ragged rows need a K-major A"
        if plan.ragged == "k" and (spec.a_major != "m" or spec.b_major != "n"):
            return "a ragged contraction takes A M-major and B N-major (rows outermost)"
        return super().why_not(plan, spec)

    @classmethod
    def compile_inputs(cls, plan, spec: KernelSpec) -> family.CompileInputs:
        from cutlass.cute.runtime import make_fake_compact_tensor  # noqa: PLC0415

        def div(dtype):
            return common.elems_per_16b(dtype)

        def fake(dtype, shape, order):
            return make_fake_compact_tensor(
                common.cutlass_dtype(dtype), shape, stride_order=order,
                assumed_align=common.TMA_ALIGN_BYTES,
            )  # fmt: skip

        g = int(plan.groups)
        gs = make_fake_compact_tensor(cutlass.Int32, (g,), assumed_align=4)
        if plan.ragged == "m":
            m = cute.sym_int()
            k = cute.sym_int(divisibility=div(spec.a_dtype))
            b_n = spec.b_major == "n"
            n = cute.sym_int(divisibility=div(spec.out_dtype) * (1 if not b_n else 1))
            if b_n:
                n = cute.sym_int(
                    divisibility=max(div(spec.out_dtype), div(spec.b_dtype))
                )
            else:
                k = cute.sym_int(divisibility=max(div(spec.a_dtype), div(spec.b_dtype)))
            a = fake(spec.a_dtype, (m, k), (1, 0))
            # B (N, K, G): the rhs [G, K, N] (N-major) or [G, N, K] (K-major).
            b = fake(spec.b_dtype, (n, k, g), (0, 1, 2) if b_n else (1, 0, 2))
            d = fake(spec.out_dtype, (m, n), (1, 0))
        else:
            # A = lhs^T (M, K) from lhs [K, M]; B = the cotangent^T (N, K) from [K, N].
            m = cute.sym_int(divisibility=div(spec.a_dtype))
            n = cute.sym_int(divisibility=max(div(spec.b_dtype), div(spec.out_dtype)))
            k = cute.sym_int()
            a = fake(spec.a_dtype, (m, k), (0, 1))
            b = fake(spec.b_dtype, (n, k), (0, 1))
            d = fake(spec.out_dtype, (m, n, g), (1, 0, 2))
        return family.CompileInputs(plan, spec, (a, b, d, gs))

    # ---------------------------------------------------------------- host

    @cute.jit
    def __call__(
        self, a: cute.Tensor, b: cute.Tensor, d: cute.Tensor, gs: cute.Tensor,
        stream: cuda.CUstream,
    ):  # fmt: skip
        self._setup()
        tm, tn, tk = self.tile_mnk
        if cutlass.const_expr(self.ragged == "m"):
            a_view, b_view, d_view = ragged_view(a, 0), b, ragged_view(d, 0)
            extent = a.shape[0]
            tiles_n = cute.ceil_div(d.shape[1], tn)
            tiles_m = cute.ceil_div(d.shape[0], tm)
            # Every group can add one partial m tile, and so can the rows past the groups.
            max_work = (tiles_m + self.groups + 1) * tiles_n
        else:
            a_view, b_view, d_view = ragged_view(a, 1), ragged_view(b, 1), d
            extent = a.shape[1]
            tiles_n = cute.ceil_div(d.shape[1], tn)
            tiles_m = cute.ceil_div(d.shape[0], tm)
            max_work = tiles_m * tiles_n * self.groups
        tma_a, ta = self._tma_load(a_view, self.a_smem_staged, (tm, tk), 1)
        tma_b, tb = self._tma_load(b_view, self.b_smem_staged, (tn, tk), 1)
        tma_d, td = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), d_view,
            cute.slice_(self.d_smem_staged, (None, None, 0)), self.epi_tile,
        )  # fmt: skip
        fields = {
            "ab_barriers": cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2],
            "table": cute.struct.MemRange[cutlass.Int32, 2 * (self.groups + 2)],
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
        self.shared = cute.struct(type("Shared", (), {"__annotations__": fields}))
        grid = cutlass.max(cutlass.min(max_work, self.max_active_clusters), 1)
        self.kernel(
            tma_a, ta, tma_b, tb, tma_d, td, gs, extent, a.shape[1], tiles_m, tiles_n,
            self.tiled_mma,
            self.a_smem_staged, self.b_smem_staged, self.d_smem_staged,
        ).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], cluster=(1, 1, 1),
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

        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_d)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared)
        stage_bytes = cute.size_in_bytes(
            self.a_dtype, cute.slice_(a_smem_staged, (None, None, 0))
        ) + cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem_staged, (None, None, 0)))
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_wgs * 4),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        table = storage.table.get_tensor(cute.make_layout(2 * (self.groups + 2)))
        if warp == 0:
            self._build_table(mGs, table, extent, tiles_n)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        cute.arch.sync_threads()

        sA = storage.sa.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sb.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sD = storage.sd.get_tensor(d_smem_staged.outer, swizzle=d_smem_staged.inner)
        sched = (table, tiles_m, tiles_n, k_extent)

        if wg == 0:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if warp == 0:
                self._produce_grouped(ab_pipe, sched, tma_a, mA, sA, tma_b, mB, sB)
        else:
            cute.arch.setmaxregister_increase(_CONSUMER_REGS)
            self._consume_grouped(ab_pipe, sched, tiled_mma, sA, sB, sD, tma_d, mD, warp,
                                  tidx - _THREADS_PER_WG)  # fmt: skip

    # ---------------------------------------------------------------- the schedule

    @cute.jit
    def _build_table(self, mGs, table, extent, tiles_n):
        """Fills `table` (one warp): entry j of [0, G + 2) holds group j's first row, entry
        G + 2 + j its first work tile ("m" mode); entry G is where the groups end and G + 1 the
        extent. Sizes are clamped so that every row range lies inside [0, extent)."""
        g = self.groups
        rows_per_tile = self.tile_mnk[0] if self.ragged == "m" else self.tile_mnk[2]
        lane = cute.arch.lane_idx()
        carry_rows = cutlass.Int32(0)
        carry_tiles = cutlass.Int32(0)
        if lane == 0:
            table[0] = cutlass.Int32(0)
            table[g + 2] = cutlass.Int32(0)
        for c in cutlass.range((g + 31) // 32, unroll=1):
            j = c * 32 + lane
            size = cutlass.Int32(0)
            if j < g:
                size = cutlass.max(cutlass.min(mGs[j], extent), 0)
            # Inclusive running sum of the sizes, saturating at the extent.
            end = size
            for d in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_up(end, 1 << d)
                if lane >= (1 << d):
                    end = cutlass.min(end + other, extent)
            end = cutlass.min(end + carry_rows, extent)
            start = cute.arch.shuffle_sync_up(end, 1)
            if lane == 0:
                start = carry_rows
            tiles = (end - start + rows_per_tile - 1) // rows_per_tile * tiles_n
            last = tiles
            for d in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_up(last, 1 << d)
                if lane >= (1 << d):
                    last = last + other
            last = last + carry_tiles
            if j < g:
                table[j + 1] = end
                table[g + 2 + j + 1] = last
            carry_rows = cute.arch.shuffle_sync(end, 31)
            carry_tiles = cute.arch.shuffle_sync(last, 31)
        if lane == 0:
            # The rows past the groups: a last pseudo-group, written as zeros ("m" mode).
            table[g + 1] = extent
            rest = (extent - carry_rows + rows_per_tile - 1) // rows_per_tile * tiles_n
            table[2 * g + 3] = carry_tiles + rest
        cute.arch.sync_warp()

    @cute.jit
    def _num_work(self, sched):
        table, tiles_m, tiles_n, _ = sched
        num = tiles_m * tiles_n * self.groups
        if cutlass.const_expr(self.ragged == "m"):
            num = table[2 * self.groups + 3]
        return num

    @cute.jit
    def _work(self, sched, w):
        """Work tile `w` as (group, first row, rows, m tile, n tile, zeros): `zeros` when the
        tile has no main loop (the rows past the groups, or an empty group's D)."""
        table, tiles_m, tiles_n, _ = sched
        g = self.groups
        tm, _, tk = self.tile_mnk
        group = cutlass.Int32(0)
        local = w
        if cutlass.const_expr(self.ragged == "m"):
            # The last group (counting the pseudo-group g) whose first tile is <= w.
            lo = cutlass.Int32(0)
            hi = cutlass.Int32(g + 1)
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if table[g + 2 + mid] <= w:
                    lo = mid
                else:
                    hi = mid
            group = lo
            local = w - table[g + 2 + group]
        else:
            per_group = tiles_m * tiles_n
            group = w // per_group
            local = w - group * per_group
        start = table[group]
        rows = table[group + 1] - start
        m_tiles = tiles_m
        if cutlass.const_expr(self.ragged == "m"):
            m_tiles = (rows + tm - 1) // tm
        n_tile = local // m_tiles
        m_tile = local - n_tile * m_tiles
        zeros = rows == 0
        if cutlass.const_expr(self.ragged == "m"):
            zeros = group == g
        return group, start, rows, m_tile, n_tile, zeros

    @cute.jit
    def _k_tiles(self, sched, rows, zeros):
        """The k-blocks of a work tile: K's in "m" mode, its group's rows' in "k" mode."""
        tk = self.tile_mnk[2]
        n_k = (sched[3] + tk - 1) // tk
        if cutlass.const_expr(self.ragged == "k"):
            n_k = (rows + tk - 1) // tk
        if zeros:
            n_k = 0
        return n_k

    # ---------------------------------------------------------------- producer

    @cute.jit
    def _produce_grouped(self, ab_pipe, sched, tma_a, mA, sA, tma_b, mB, sB):
        tm, tn, tk = self.tile_mnk
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        num = self._num_work(sched)
        w = cute.arch.block_idx()[0]
        stride = cute.arch.grid_dim()[0]
        sAg = cute.group_modes(sA, 0, 2)
        sBg = cute.group_modes(sB, 0, 2)
        while w < num:
            group, start, rows, m_tile, n_tile, zeros = self._work(sched, w)
            if cutlass.const_expr(self.ragged == "m"):
                a_mk = ragged_slice(mA, 0, start, rows)
                b_nk = mB[(None, None, group)]
            else:
                a_mk = ragged_slice(mA, 1, start, rows)
                b_nk = ragged_slice(mB, 1, start, rows)
            gA = cute.local_tile(a_mk, (tm, tk), (m_tile, None))
            gB = cute.local_tile(b_nk, (tn, tk), (n_tile, None))
            tAsA, tAgA = cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), sAg, cute.group_modes(gA, 0, 2)
            )
            tBsB, tBgB = cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), sBg, cute.group_modes(gB, 0, 2)
            )
            n_k = self._k_tiles(sched, rows, zeros)
            for kt in range(n_k):
                ab_pipe.producer_acquire(state)
                barrier = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=barrier)
                cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, state.index)], tma_bar_ptr=barrier)
                ab_pipe.producer_commit(state)
                state.advance()
            w += stride
        ab_pipe.producer_tail(state)

    # ---------------------------------------------------------------- consumers

    @cute.jit
    def _consume_grouped(self, ab_pipe, sched, tiled_mma, sA, sB, sD, tma_d, mD, warp, ctidx):
        tm, tn, tk = self.tile_mnk
        thr_mma = tiled_mma.get_slice(ctidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        tile_crd = cute.make_identity_tensor((tm, tn))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(tile_crd).shape[:3], self.acc_dtype)
        k_blocks = cute.size(tCrA, mode=[2])

        r2s_atom = cutlass.utils.hopper_helpers.get_smem_store_op(
            LayoutEnum.ROW_MAJOR, elem_ty_d=self.d_dtype, elem_ty_acc=self.acc_dtype
        )
        stm_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.d_dtype)
        r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stm_atom, tiled_mma))
        thr_r2s = r2s.get_slice(ctidx)
        tRS_sD = thr_r2s.partition_D(sD)
        tRS_acc = r2s.retile(acc)
        sub_shape = cute.shape(thr_r2s.partition_S(sD))[:3]
        sub_acc = cute.make_rmem_tensor(sub_shape, self.acc_dtype)
        sub_out = cute.make_rmem_tensor(sub_shape, self.d_dtype)
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.epi_threads),
        )
        epi_barrier = pipeline.NamedBarrier(
            barrier_id=_EPI_BARRIER_ID, num_threads=self.epi_threads
        )
        gD_k = None
        if cutlass.const_expr(self.ragged == "k"):
            gD_k = cute.local_tile(mD, (tm, tn), (None, None, None))

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        num = self._num_work(sched)
        w = cute.arch.block_idx()[0]
        stride = cute.arch.grid_dim()[0]
        tiles_done = cutlass.Int32(0)
        while w < num:
            group, start, rows, m_tile, n_tile, zeros = self._work(sched, w)
            n_k = self._k_tiles(sched, rows, zeros)
            acc.fill(0.0)
            if n_k > 0:
                read, release = self._mainloop(ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks,
                                               n_k, read, release)  # fmt: skip
                warpgroup.wait_group(0)
                ab_pipe.consumer_release(release)
                release.advance()
            if cutlass.const_expr(self.ragged == "m"):
                d_mn = ragged_slice(mD, 0, start, rows)
                gD = cute.local_tile(d_mn, (tm, tn), (None, None))
                tile = (m_tile, n_tile)
            else:
                gD = gD_k
                tile = (m_tile, n_tile, group)
            epi = _Epilogue(gD, gD, None, sD, tma_d, r2s, thr_r2s, tRS_sD, tRS_acc, sub_acc,
                            sub_out, cute.size(sub_acc), None, mD, store_pipe, epi_barrier, 4,
                            0, None, None, None, None)  # fmt: skip
            self._store_tile(tile, tiles_done, epi, warp)
            tiles_done += 1
            w += stride
        store_pipe.producer_tail()
