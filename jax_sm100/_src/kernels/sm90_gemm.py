"""The SM90 (Hopper) GEMM family: persistent, warp-specialised wgmma with a fused epilogue.

One CTA runs 1 + W warp groups (W = 2 for 128- and 256-row tiles, 1 for 64-row tiles):

* warp group 0 is the producer. It gives registers back (`setmaxnreg` down) and one of its
  warps walks the persistent tile schedule issuing TMA loads of A and B k-blocks into a ring of
  `num_ab_stages` shared-memory stages, multicast across the cluster where the cluster shares an
  operand (CTAs in one cluster row share A tiles, in one cluster column B tiles).
* warp groups 1..W are consumers. They take registers (`setmaxnreg` up), run wgmma on each
  stage as it lands (one wgmma batch kept in flight before a stage is released), then run the
  epilogue on the float32 accumulators: sub-tile by sub-tile (`plan.epi_tile`) they apply
  `common.apply_epilogue` (alpha, beta * C, bias, activation; C and bias are read straight from
  global memory at the coordinates each register lands on), convert to the output type, write
  the sub-tile to shared memory with `stmatrix` and one thread stores it with TMA.

Split-K (`plan.split_k = S > 1`) with `plan.split_reduce == "xla"` is this kernel as a batched
GEMM over (rows, K/S, S) views writing float32 partials; the caller sums them. With "cluster", A
and B come as (rows, K/S, S) views and the tile grid is folded to (tiles_m, tiles_n * S): the S
CTAs of one (1, S) cluster take the S K slices of one output tile (no multicast; the cluster is
the reduction group). After the main loop each CTA writes its float32 partial tile to its own
shared memory and signals every CTA of the cluster on an mbarrier; CTA r then sums rows
[r tm / S, (r + 1) tm / S) over the S partials through distributed shared memory, applies the
fused epilogue and stores to D, and signals that it is done reading, so no CTA reuses or frees
its partial while another still reads it. One launch, no workspace, no second reduction kernel.

The tile schedule is CUTLASS's static persistent scheduler (grid = min(clusters of tiles,
SMs / cluster size)), rasterised along M or N with the plan's swizzle. Out-of-bounds rows,
columns and k-blocks are handled by TMA (zero fill on load, clipping on store), so any m, n, k
work as long as each operand's contiguous dimension is 16-byte aligned.

Stream-K (`plan.stream_k`, cooperative plans): when the tiles do not fill the persistent
clusters' last wave evenly, the first (T // G - 1) G of the T cluster tiles run as above and the
rest (between one and two waves) are cut into k-blocks shared out evenly over the G clusters,
so every such tile is split between at most two consecutive clusters. Each cluster walks its
share backwards, a tile at a time. Cluster g ends its share inside a tile: it computes that
tile's first k-blocks first, writes the float32 partial to its workspace slot and raises the
slot's flag (gpu-scope release); cluster g + 1, whose share starts inside the same tile,
computes the tile's last k-blocks last, waits for the flag (acquire), adds the partial and runs
the epilogue. The flags come in zeroed by XLA on every call; the order of the two partials is
fixed, so results are deterministic. A cluster waits only at its very end, and only on a
cluster of lower index (launched before it), whose publish comes before any wait of its own:
the schedule finishes however few clusters are resident at once.

Everything this kernel is specialised on comes from the `GemmPlan` (tiles, cluster, stages,
raster) and the `KernelSpec` (dtypes, layouts, epilogue); it decides nothing itself.
"""

from __future__ import annotations

import collections

import cuda.bindings.driver as cuda
import cutlass
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90
from cutlass import cute
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from jax_sm100._src import constraints
from jax_sm100._src.kernels import common, family
from jax_sm100._src.kernels.spec import KernelSpec

_THREADS_PER_WG = 128
# Register budgets per thread after `setmaxnreg`: the producer needs few, the consumers hold the
# accumulators (128 fp32 per thread for a 128x256 tile over two warp groups). 40 + 2 * 232
# fits the 64K-register file for 384 threads; the same split CUTLASS uses for this layout.
_PRODUCER_REGS = 40
_CONSUMER_REGS = 232
_SMEM_ALIGN = 1024
# Named barriers (0 is __syncthreads): one per epilogue group (two in ping-pong), then the two
# ping-pong turn barriers that order the consumer warp groups' main loops.
_EPI_BARRIER_ID = 1
_TURN_BARRIER_ID = 3

# What one consumer warp group's tile epilogue works with (`_store_tile`), built once.
_Epilogue = collections.namedtuple(
    "_Epilogue",
    "gD cD gC sD tma_d r2s thr_r2s tRS_sD tRS_acc sub_acc sub_out sub_size mBias mD store_pipe "
    "barrier store_warp group gZ sZ tma_z tRS_sZ",
)

# 256-row tiles give each consumer warp group two 64-row MMA blocks. N = 160 is cuBLAS's choice
# for large tall and wide problems on the H200 (benchmarks/cublas_kernels.py).
SUPPORTED_TILE_M = (64, 128, 256)
SUPPORTED_TILE_N = (64, 128, 160, 192, 256)


class Sm90GemmKernel(family.KernelFamily):
    """A persistent warp-specialised wgmma GEMM for one (GemmPlan, KernelSpec).

    Host entry point: `__call__(a, b, d, c, bias, z, ws, flags, stream)` with the modes of
    spec.py (ws and flags: the stream-K workspace, compile.workspace_shapes), `None`
    for an absent c, bias, z or workspace.
    """

    ARCH = "sm_90a"
    KERNELS = ("sm90_wgmma", "sm90_wgmma_splitk")
    HOST_OPERANDS = ("a", "b", "d", "c", "bias", "z", "ws", "flags")

    def __init__(self, plan, spec: KernelSpec):
        super().__init__(plan, spec)
        self.tile_mnk = tuple(plan.cta_tile_mnk)
        self.cluster_mn = tuple(plan.cluster_shape_mn)
        self.ab_stages = plan.num_ab_stages
        self.epi_stages = plan.num_epi_stages
        self.epi_tile = tuple(plan.epi_tile)
        self.acc_dtype = cutlass.Float32
        self.pingpong = bool(plan.pingpong)
        # Only an in-cluster split changes the kernel; an "xla" split is a batched GEMM to it.
        self.split = int(plan.split_k) if plan.split_reduce == "cluster" else 1
        # Cooperative: the consumer warp groups split each tile's rows. Ping-pong: two consumer
        # warp groups take alternate tiles, each whole, so one's epilogue overlaps the other's
        # main loop; each has its own epilogue buffers, barrier and TMA-store thread.
        self.num_consumer_wgs = 2 if (self.pingpong or self.tile_mnk[0] >= 128) else 1
        self.mma_wgs = 1 if self.pingpong else self.num_consumer_wgs
        self.epi_groups = 2 if self.pingpong else 1
        self.threads = _THREADS_PER_WG * (1 + self.num_consumer_wgs)
        self.num_consumer_threads = _THREADS_PER_WG * self.num_consumer_wgs
        self.epi_threads = _THREADS_PER_WG * self.mma_wgs
        cluster_size = self.cluster_mn[0] * self.cluster_mn[1]
        self.max_active_clusters = max(1, plan.num_sms // cluster_size)
        # A tile is shared by the CTAs of one cluster row (same m), B by one cluster column. A
        # split-K cluster's CTAs read different K slices: nothing is shared.
        self.a_mcast = 1 if self.split > 1 else self.cluster_mn[1]
        self.b_mcast = 1 if self.split > 1 else self.cluster_mn[0]
        self.has_c = spec.has_c and (spec.beta != 0.0 or spec.act_grad is not None)
        self.has_bias = spec.has_bias
        # The epilogue also stores the pre-activation Z, through its own staging buffers.
        self.preact = bool(spec.preact_out)
        # C through shared-memory rings filled by TMA rather than global loads into registers:
        # one ring per epilogue group (a slot per store stage), each filled by its own producer
        # warp walking that group's tiles, so each ring has one consumer that reads it in order.
        self.stage_c = bool(plan.stage_c) and self.has_c
        self.num_subs = (self.tile_mnk[0] // self.epi_tile[0]) * (
            self.tile_mnk[1] // self.epi_tile[1]
        )
        self.stream_k = bool(plan.stream_k)
        # Stream-K workspace: one float32 tile and one flag per CTA of the persistent grid.
        self.ws_slots = plan.num_sms

    @classmethod
    def compile_inputs(cls, plan, spec: KernelSpec) -> family.CompileInputs:
        """A split-K plan compiles with A and B as (rows, K/split, split) views; reduced by
        XLA, as the float32 partial product (`_splitk_plan`, `_splitk_spec`). A stream-K plan
        takes its workspace too."""
        if plan.split_k > 1 and plan.split_reduce == "xla":
            plan, spec = _splitk_plan(plan), _splitk_spec(spec)
            operands = (*_splitk_fake_operands(plan, spec, partials=True), None)
        elif plan.split_k > 1:
            operands = _splitk_fake_operands(plan, spec, partials=False)
        else:
            operands = tuple(common.make_fake_operands(plan, spec))
        return family.CompileInputs(plan, spec, (*operands, *_fake_workspace(plan)))

    @classmethod
    def why_not(cls, plan, spec: KernelSpec) -> str | None:
        """None when this family can run (plan, spec); else the reason it cannot."""
        tm, tn, tk = plan.cta_tile_mnk
        if plan.arch != "sm_90a":
            return f"{plan.arch=} is not sm_90a"
        if tm not in SUPPORTED_TILE_M or tn not in SUPPORTED_TILE_N:
            return f"cta tile {tm}x{tn} not in {SUPPORTED_TILE_M} x {SUPPORTED_TILE_N}"
        if spec.a_dtype not in common.CUTLASS_DTYPES or spec.b_dtype not in common.CUTLASS_DTYPES:
            return f"operand dtypes {spec.a_dtype}, {spec.b_dtype} have no wgmma"
        bits = common.dtype_bits(spec.a_dtype)
        if bits == 16 and spec.a_dtype != spec.b_dtype:
            return f"16-bit wgmma needs equal operand dtypes, got {spec.a_dtype}, {spec.b_dtype}"
        if bits == 8 and (spec.a_major != "k" or spec.b_major != "k"):
            return "8-bit wgmma needs K-major A and B"
        if tk * bits != 1024:
            return f"cta tile k={tk} must span 128 bytes of {spec.a_dtype}"
        try:
            constraints.check_pingpong(plan.arch, plan.pingpong, plan.cta_tile_mnk)
            constraints.check_split_k(
                plan.split_k, plan.cluster_shape_mn, plan.pingpong, plan.split_reduce
            )
            constraints.check_stream_k(
                plan.arch, plan.stream_k, plan.pingpong, plan.split_k, plan.cluster_shape_mn
            )
            constraints.check_stage_c(plan.arch, plan.stage_c, spec.c_dtype, spec.out_dtype,
                                      plan.stream_k, plan.split_k)  # fmt: skip
        except constraints.PlanError as e:
            return str(e)
        if spec.preact_out and not plan.preact_out:
            return "spec.preact_out needs a plan with preact_out (its Z staging in SMEM)"
        if plan.split_reduce == "cluster" and tm % plan.split_k:
            return f"split_k={plan.split_k} must divide the tile's {tm} rows (one slice per CTA)"
        # The epilogue takes each sub-tile's registers as one contiguous run of the retiled
        # accumulator, which holds when a sub-tile is one 64-row MMA block per warp group.
        rows_per_wg = 64 if plan.pingpong else min(tm, 128) // (2 if tm >= 128 else 1)
        if plan.epi_tile[0] // (1 if plan.pingpong or tm == 64 else 2) != rows_per_wg:
            return f"epilogue tile {plan.epi_tile} does not match the {tm}-row warp-group split"
        return None

    # ---------------------------------------------------------------- derived configuration

    def _setup(self):
        """Layouts and atoms derived from the configuration and operand dtypes."""
        tm, tn, tk = self.tile_mnk
        a_major = (
            cute.nvgpu.OperandMajorMode.K if self._a_k_major else cute.nvgpu.OperandMajorMode.MN
        )
        b_major = (
            cute.nvgpu.OperandMajorMode.K if self._b_k_major else cute.nvgpu.OperandMajorMode.MN
        )
        self.tiled_mma = sm90.make_trivial_tiled_mma(
            self.a_dtype,
            self.b_dtype,
            a_major,
            b_major,
            self.acc_dtype,
            (self.mma_wgs, 1, 1),
            tiler_mn=(64, tn),
        )
        self.a_smem_staged = sm90.make_smem_layout_a(
            self._a_layout, self.tile_mnk, self.a_dtype, self.ab_stages
        )
        self.b_smem_staged = sm90.make_smem_layout_b(
            self._b_layout, self.tile_mnk, self.b_dtype, self.ab_stages
        )
        self.d_smem_staged = sm90.make_smem_layout_epi(
            self.d_dtype, LayoutEnum.ROW_MAJOR, self.epi_tile, self.epi_stages * self.epi_groups
        )
        self.cluster_layout = cute.make_layout((*self.cluster_mn, 1))

    @staticmethod
    def _tma_load(tensor, smem_staged, tile, mcast):
        op = (
            cpasync.CopyBulkTensorTileG2SOp()
            if mcast == 1
            else (cpasync.CopyBulkTensorTileG2SMulticastOp())
        )
        smem = cute.slice_(smem_staged, (None, None, 0))
        return cpasync.make_tiled_tma_atom(op, tensor, smem, tile, num_multicast=mcast)

    # ---------------------------------------------------------------- host

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,
        b: cute.Tensor,
        d: cute.Tensor,
        c: cute.Tensor | None,
        bias: cute.Tensor | None,
        z: cute.Tensor | None,
        ws: cute.Tensor | None,
        flags: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        self.a_dtype = a.element_type
        self.b_dtype = b.element_type
        self.d_dtype = d.element_type
        self._a_layout = LayoutEnum.from_tensor(a)
        self._b_layout = LayoutEnum.from_tensor(b)
        self._a_k_major = self._a_layout.is_k_major_a()
        self._b_k_major = self._b_layout.is_k_major_b()
        self._setup()
        tm, tn, tk = self.tile_mnk

        tma_a, ta = self._tma_load(a, self.a_smem_staged, (tm, tk), self.a_mcast)
        tma_b, tb = self._tma_load(b, self.b_smem_staged, (tn, tk), self.b_mcast)
        tma_d, td = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(),
            d,
            cute.slice_(self.d_smem_staged, (None, None, 0)),
            self.epi_tile,
        )
        tma_z, tz = None, None
        if cutlass.const_expr(self.preact):
            tma_z, tz = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(),
                z,
                cute.slice_(self.d_smem_staged, (None, None, 0)),
                self.epi_tile,
            )

        tma_c, tc, c_staged = None, None, None
        if cutlass.const_expr(self.stage_c):
            c_staged = sm90.make_smem_layout_epi(
                c.element_type, LayoutEnum.ROW_MAJOR, self.epi_tile,
                self.epi_stages * self.epi_groups,
            )  # fmt: skip
            tma_c, tc = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), c, cute.slice_(c_staged, (None, None, 0)),
                self.epi_tile,
            )  # fmt: skip

        tiles_mnl = cute.ceil_div(d.shape, (tm, tn, 1))
        if cutlass.const_expr(self.split > 1):
            tiles_mnl = (tiles_mnl[0], tiles_mnl[1] * self.split, tiles_mnl[2])
        sched = utils.PersistentTileSchedulerParams(
            tiles_mnl, (*self.cluster_mn, 1), self.plan.swizzle_size, self.plan.raster_along_m
        )
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, self.max_active_clusters)

        # The output buffer: D's epilogue staging, or an in-cluster split's float32 partial
        # tile; such a split also keeps its two reduction mbarriers after the stage barriers.
        out_buf = cute.struct.Align[
            cute.struct.MemRange[self.d_dtype, cute.cosize(self.d_smem_staged)], _SMEM_ALIGN
        ]
        red_bars = 0
        if cutlass.const_expr(self.split > 1):
            out_buf = cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, tm * (tn + constraints.SPLITK_ROW_PAD)], 128
            ]
            red_bars = 2

        fields = {
            "ab_barriers": cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2 + red_bars],
            "sa": cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_staged)], _SMEM_ALIGN
            ],
            "sb": cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_staged)], _SMEM_ALIGN
            ],
            "sd": out_buf,
        }
        if cutlass.const_expr(self.preact and self.split == 1):
            fields["sz"] = out_buf  # Z's staging, beside D's (an in-cluster split stores directly)
        if cutlass.const_expr(self.stage_c):
            fields["c_barriers"] = cute.struct.MemRange[
                cutlass.Int64, 2 * self.epi_stages * self.epi_groups
            ]
            fields["sc"] = cute.struct.Align[
                cute.struct.MemRange[c.element_type, cute.cosize(c_staged)], _SMEM_ALIGN
            ]
        self.shared = cute.struct(type("Shared", (), {"__annotations__": fields}))
        self.kernel(
            tma_a,
            ta,
            tma_b,
            tb,
            tma_d,
            td,
            d,
            c,
            bias,
            tma_z,
            tz,
            z,
            ws,
            flags,
            tma_c,
            tc,
            c_staged,
            self.tiled_mma,
            self.cluster_layout,
            self.a_smem_staged,
            self.b_smem_staged,
            self.d_smem_staged,
            sched,
        ).launch(  # fmt: skip
            grid=grid,
            block=[self.threads, 1, 1],
            cluster=(*self.cluster_mn, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------------- device

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_d: cute.CopyAtom,
        mD_tma: cute.Tensor,
        mD: cute.Tensor,
        mC: cute.Tensor | None,
        mBias: cute.Tensor | None,
        tma_z: cute.CopyAtom | None,
        mZ_tma: cute.Tensor | None,
        mZ: cute.Tensor | None,
        mWs: cute.Tensor | None,
        mFlags: cute.Tensor | None,
        tma_c: cute.CopyAtom | None,
        mC_tma: cute.Tensor | None,
        c_smem_staged: cute.ComposedLayout | None,
        tiled_mma: cute.TiledMma,
        cluster_layout: cute.Layout,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        d_smem_staged: cute.ComposedLayout,
        sched_params: utils.PersistentTileSchedulerParams,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // _THREADS_PER_WG)
        tm, tn, tk = self.tile_mnk

        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_d)
            if cutlass.const_expr(self.preact):
                cpasync.prefetch_descriptor(tma_z)
            if cutlass.const_expr(self.stage_c):
                cpasync.prefetch_descriptor(tma_c)

        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cluster_layout.get_flat_coord(rank)
        a_mask = 0
        b_mask = 0
        if cutlass.const_expr(self.a_mcast > 1):
            a_mask = cute.make_layout_image_mask(cluster_layout, cluster_coord, mode=1)
        if cutlass.const_expr(self.b_mcast > 1):
            b_mask = cute.make_layout_image_mask(cluster_layout, cluster_coord, mode=0)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared)
        stage_bytes = cute.size_in_bytes(
            self.a_dtype, cute.slice_(a_smem_staged, (None, None, 0))
        ) + cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem_staged, (None, None, 0)))
        # Every consumer warp of every CTA that reads a multicast stage releases it (in ping-pong
        # only the warp group whose tile the stage belongs to reads it).
        releasers = (self.a_mcast + self.b_mcast - 1) * self.mma_wgs * 4
        # The stage ring spans the CTAs that share stages by multicast (none for split-K).
        pipe_layout = cute.make_layout((1, *cluster_layout.shape))
        if cutlass.const_expr(self.split > 1):
            pipe_layout = cute.make_layout((1, 1, 1, 1))
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, releasers),
            tx_count=stage_bytes,
            cta_layout_vmnk=pipe_layout,
            defer_sync=True,
        )
        red_bars = None
        if cutlass.const_expr(self.split > 1):
            # "partials written" and "done reading": one thread of every CTA of the cluster
            # arrives once per tile. Initialised before the cluster-wide sync below, so no peer
            # arrives on them earlier.
            red_bars = storage.ab_barriers.data_ptr() + self.ab_stages * 2
            if warp == 0:
                with cute.arch.elect_one():
                    for i in cutlass.range_constexpr(2):
                        cute.arch.mbarrier_init(red_bars + i, self.split)
                cute.arch.mbarrier_init_fence()
        # The staged-C rings, as one pipeline over all slots: epilogue group g owns slots
        # [g * epi_stages, (g + 1) * epi_stages) (`_ring_slot`). One producer thread fills each
        # slot by TMA; every warp of the group that reads it releases it.
        c_pipe, sC = None, None
        if cutlass.const_expr(self.stage_c):
            c_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.c_barriers.data_ptr(),
                num_stages=self.epi_stages * self.epi_groups,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, self.epi_threads // 32
                ),
                tx_count=cute.size_in_bytes(
                    mC.element_type, cute.slice_(c_smem_staged, (None, None, 0))
                ),
                defer_sync=True,
            )
            sC = storage.sc.get_tensor(c_smem_staged.outer, swizzle=c_smem_staged.inner)
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

        sA = storage.sa.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sb.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        if cutlass.const_expr(self.split > 1):
            sD = storage.sd.get_tensor(
                cute.make_layout((tm, tn), stride=(tn + constraints.SPLITK_ROW_PAD, 1))
            )
        else:
            sD = storage.sd.get_tensor(d_smem_staged.outer, swizzle=d_smem_staged.inner)
        sZ, gZ = None, None
        if cutlass.const_expr(self.preact and self.split == 1):
            sZ = storage.sz.get_tensor(d_smem_staged.outer, swizzle=d_smem_staged.inner)
            gZ = cute.local_tile(mZ_tma, (tm, tn), (None, None, None))

        # (tile, tile, tiles_m|n, tiles_k, l) views of the operands.
        gA = cute.local_tile(mA, (tm, tk), (None, None, None))
        gB = cute.local_tile(mB, (tn, tk), (None, None, None))
        gD = cute.local_tile(mD_tma, (tm, tn), (None, None, None))
        k_tiles = cute.size(gA, mode=[3])

        # Each CTA of a multicast group loads its share of the tile for all of them.
        a_share, a_group = (
            cluster_coord[1],
            cute.make_layout(cute.slice_(cluster_layout, (0, None, 0)).shape),
        )
        b_share, b_group = (
            cluster_coord[0],
            cute.make_layout(cute.slice_(cluster_layout, (None, 0, 0)).shape),
        )
        if cutlass.const_expr(self.split > 1):
            a_share, a_group, b_share, b_group = 0, cute.make_layout(1), 0, cute.make_layout(1)
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, a_share, a_group, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, b_share, b_group, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )

        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

        if wg == 0:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if cutlass.const_expr(self.stage_c):
                for g in cutlass.range_constexpr(self.epi_groups):
                    if warp == 1 + g:
                        self._produce_c(c_pipe, sched_params, tma_c, mC_tma, sC, g)
            if warp == 0:
                if cutlass.const_expr(self.stream_k):
                    self._produce_sk(ab_pipe, sched_params, tma_a, tAgA, tAsA, a_mask, tma_b,
                                     tBgB, tBsB, b_mask, k_tiles)  # fmt: skip
                else:
                    self._produce(ab_pipe, sched_params, tma_a, tAgA, tAsA, a_mask, tma_b, tBgB,
                                  tBsB, b_mask, k_tiles)  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(_CONSUMER_REGS)
            self._consume(ab_pipe, sched_params, tiled_mma, sA, sB, sD, gD, tma_d, mD, mC,
                          mBias, k_tiles, wg - 1, warp, tidx - _THREADS_PER_WG, red_bars,
                          rank, mWs, mFlags, (gZ, sZ, tma_z, mZ), (c_pipe, sC))  # fmt: skip

    @cute.jit
    def _produce(self, ab_pipe, sched_params, tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB,
                 b_mask, k_tiles):  # fmt: skip
        sched = utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        work = sched.initial_work_tile_info()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        while work.is_valid_tile:
            tile = work.tile_idx
            a_k = tAgA[(None, tile[0], None, tile[2])]
            b_k = tBgB[(None, tile[1], None, tile[2])]
            if cutlass.const_expr(self.split > 1):
                # Folded grid: tile n * split + j is K slice j of output tile (m, n).
                a_k = tAgA[(None, tile[0], None, tile[1] % self.split)]
                b_k = tBgB[(None, tile[1] // self.split, None, tile[1] % self.split)]
            state.reset_count()
            for _ in range(k_tiles):
                ab_pipe.producer_acquire(state)
                barrier = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_a, a_k[(None, state.count)], tAsA[(None, state.index)],
                          tma_bar_ptr=barrier, mcast_mask=a_mask)  # fmt: skip
                cute.copy(tma_b, b_k[(None, state.count)], tBsB[(None, state.index)],
                          tma_bar_ptr=barrier, mcast_mask=b_mask)  # fmt: skip
                ab_pipe.producer_commit(state)
                state.advance()
            sched.advance_to_next_work()
            work = sched.get_current_work()
        ab_pipe.producer_tail(state)

    @cute.jit
    def _produce_sk(self, ab_pipe, sched_params, tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB,
                    b_mask, k_tiles):  # fmt: skip
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
                ab_pipe.producer_acquire(state)
                barrier = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_a, a_k[(None, kb + j)], tAsA[(None, state.index)],
                          tma_bar_ptr=barrier, mcast_mask=a_mask)  # fmt: skip
                cute.copy(tma_b, b_k[(None, kb + j)], tBsB[(None, state.index)],
                          tma_bar_ptr=barrier, mcast_mask=b_mask)  # fmt: skip
                ab_pipe.producer_commit(state)
                state.advance()
            idx += 1
            work, kb, ke = self._sk_segment(sched, sk, idx, k_tiles)
        ab_pipe.producer_tail(state)

    @cute.jit
    def _consume(self, ab_pipe, sched_params, tiled_mma, sA, sB, sD, gD, tma_d, mD, mC, mBias,
                 k_tiles, consumer_wg, warp, ctidx, red_bars, rank, mWs, mFlags,
                 zout, cstage):  # fmt: skip
        tm, tn, _ = self.tile_mnk
        # Thread index within this tile's epilogue group, and the group's first warp.
        etidx = ctidx
        mma_base = consumer_wg * _THREADS_PER_WG
        store_warp = 4  # the first consumer warp issues the TMA stores
        epi_group = 0
        if cutlass.const_expr(self.pingpong):
            etidx = ctidx % _THREADS_PER_WG
            mma_base = 0
            store_warp = 4 + 4 * consumer_wg
            epi_group = consumer_wg
        thr_mma = tiled_mma.get_slice(mma_base)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gD).shape[:3], self.acc_dtype)
        k_blocks = cute.size(tCrA, mode=[2])

        # Register -> shared copy of one epilogue sub-tile (stmatrix for 16-bit outputs). The
        # split-K epilogue writes its float32 partial tile element by element instead.
        r2s, thr_r2s, tRS_sD, tRS_acc, sub_acc, sub_out, sub_size = (None,) * 7
        if cutlass.const_expr(self.split == 1):
            r2s_atom = sm90.get_smem_store_op(
                LayoutEnum.ROW_MAJOR, elem_ty_d=self.d_dtype, elem_ty_acc=self.acc_dtype
            )
            stm_atom = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.d_dtype
            )
            r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stm_atom, tiled_mma))
            thr_r2s = r2s.get_slice(etidx)
            tRS_sD = thr_r2s.partition_D(sD)
            tRS_acc = r2s.retile(acc)
            sub_shape = cute.shape(thr_r2s.partition_S(sD))[:3]
            sub_acc = cute.make_rmem_tensor(sub_shape, self.acc_dtype)
            sub_out = cute.make_rmem_tensor(sub_shape, self.d_dtype)
            sub_size = cute.size(sub_acc)
        gZ, sZ, tma_z, mZ = zout
        tRS_sZ = None
        if cutlass.const_expr(self.preact and self.split == 1):
            tRS_sZ = thr_r2s.partition_D(sZ)
        c_pipe, sC = cstage
        c_read = None
        if cutlass.const_expr(self.stage_c):
            # Shared -> register copy of a C slot (ldmatrix), the inverse of D's stmatrix: it
            # lands each C element in the register that holds the same output's accumulator.
            # (The stmatrix copy's own destination partition names the rows each thread
            # addresses, not the elements it holds.)
            s2r = cute.make_tiled_copy_S(
                cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), sC.element_type),
                r2s,
            )
            thr_s2r = s2r.get_slice(etidx)
            c_pipe = (c_pipe, s2r, thr_s2r, thr_s2r.partition_S(sC))
            c_read = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.epi_stages
            )
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.epi_threads),
        )
        epi_barrier = pipeline.NamedBarrier(
            barrier_id=_EPI_BARRIER_ID + epi_group, num_threads=self.epi_threads
        )
        # Ping-pong turns: a warp group waits on its own barrier before its main loop; the other
        # group arrives on it once it has seen every stage of its own tile land. This keeps the
        # two groups' waits on the stage ring in tile order, so a group never waits on a stage
        # barrier more than one phase ahead of the fills it has observed.
        my_turn = pipeline.NamedBarrier(
            barrier_id=_TURN_BARRIER_ID + consumer_wg, num_threads=2 * _THREADS_PER_WG
        )
        their_turn = pipeline.NamedBarrier(
            barrier_id=_TURN_BARRIER_ID + 1 - consumer_wg, num_threads=2 * _THREADS_PER_WG
        )
        # Global coordinates of every output element, for predicated C and bias reads.
        cD = cute.local_tile(cute.make_identity_tensor(mD.shape), (tm, tn), (None, None, None))
        gC = None
        if cutlass.const_expr(self.has_c):
            gC = cute.local_tile(mC, (tm, tn), (None, None, None))

        # What the epilogue works with (`_store_tile`).
        epi = _Epilogue(gD, cD, gC, sD, tma_d, r2s, thr_r2s, tRS_sD, tRS_acc, sub_acc, sub_out,
                        sub_size, mBias, mD, store_pipe, epi_barrier, store_warp,
                        epi_group, gZ, sZ, tma_z, tRS_sZ)  # fmt: skip

        sched = utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        if cutlass.const_expr(self.stream_k):
            self._consume_sk(ab_pipe, sched, sched_params, tiled_mma, tCrA, tCrB, acc, k_blocks,
                             k_tiles, epi, warp, ctidx, rank, mWs, mFlags)  # fmt: skip
        else:
            work = sched.initial_work_tile_info()
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            release = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.ab_stages
            )
            if cutlass.const_expr(self.pingpong):
                # Group 1 takes the CTA's odd tiles: it lets group 0 start, then skips its tile.
                if consumer_wg == 1:
                    if work.is_valid_tile:
                        their_turn.arrive()
                sched.advance_to_next_work(advance_count=consumer_wg)
                work = sched.get_current_work()
                for _ in range(k_tiles * consumer_wg):
                    read.advance()
                    release.advance()
            tiles_done = cutlass.Int32(0)
            while work.is_valid_tile:
                tile = work.tile_idx
                if cutlass.const_expr(self.pingpong):
                    my_turn.arrive_and_wait()
                read, release = self._mainloop(ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks,
                                               k_tiles, read, release)  # fmt: skip
                if cutlass.const_expr(self.pingpong):
                    # Every stage of this tile has landed: the other group's tile is next in the
                    # ring. Hand it the turn (if it has a tile) and skip its stages.
                    sched.advance_to_next_work()
                    if sched.get_current_work().is_valid_tile:
                        their_turn.arrive()
                warpgroup.wait_group(0)
                ab_pipe.consumer_release(release)
                release.advance()
                if cutlass.const_expr(self.pingpong):
                    for _ in range(k_tiles):
                        read.advance()
                        release.advance()

                if cutlass.const_expr(self.split > 1):
                    self._splitk_epilogue(acc, tiled_mma.get_slice(ctidx), sD, red_bars, rank,
                                          tile, tiles_done, ctidx, mD, mC, mBias,
                                          mZ)  # fmt: skip
                elif cutlass.const_expr(self.stage_c):
                    c_read = self._store_tile(tile, tiles_done, epi, warp, c_pipe, c_read)
                else:
                    self._store_tile(tile, tiles_done, epi, warp)
                tiles_done += 1
                sched.advance_to_next_work()
                work = sched.get_current_work()
            store_pipe.producer_tail()

    @cute.jit
    def _mainloop(self, ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks, n_k, read, release):
        """`n_k` k-tiles of wgmma into zeroed accumulators, one batch kept in flight and each
        stage released once its batch retired; the last batch is left in flight (the caller
        waits for it and releases its stage). Returns the advanced (read, release) states."""
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.fence()
        for kt in range(n_k):
            ab_pipe.consumer_wait(read)
            for kb in cutlass.range_constexpr(k_blocks):
                crd = (None, None, kb, read.index)
                cute.gemm(tiled_mma, acc, tCrA[crd], tCrB[crd], acc)
            warpgroup.commit_group()
            read.advance()
            if kt > 0:
                warpgroup.wait_group(1)
                ab_pipe.consumer_release(release)
                release.advance()
        return read, release

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

    # ---------------------------------------------------------------- stream-K

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
                    k_tiles, epi, warp, ctidx, rank, mWs, mFlags):  # fmt: skip
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
                                           ke - kb, read, release)  # fmt: skip
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
        """This thread's words of workspace slot `slot`: word v at v * threads + ctidx, so a
        warp's access to one v is 128 contiguous bytes."""
        threads = self.num_consumer_threads
        base = slot * (threads * cute.size(acc)) + ctidx
        return cute.make_tensor(
            mWs.iterator + base, cute.make_layout(cute.size(acc), stride=threads)
        )

    @cute.jit
    def _sk_publish(self, acc, mWs, mFlags, slot, ctidx, sync):
        """Writes this CTA's partial tile to its slot, then releases the slot's flag (after a
        barrier over the consumer threads, so every thread's stores come before it)."""
        dst = self._sk_slot(mWs, slot, ctidx, acc)
        for v in cutlass.range_constexpr(cute.size(acc)):
            dst[v] = acc[v]
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
        for v in cutlass.range_constexpr(cute.size(acc)):
            acc[v] = acc[v] + src[v]

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
        sync = pipeline.NamedBarrier(barrier_id=_EPI_BARRIER_ID, num_threads=threads)
        # 1. Publish this CTA's partial (the previous tile's readers are done: step 3).
        tCsRed = thr_c.partition_C(sRed)
        for i in cutlass.range_constexpr(cute.size(acc)):
            tCsRed[i] = acc[i]
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
                    rb[i] = mBias[coords[i][1]]
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


# ---------------------------------------------------------------- compile inputs


def _splitk_spec(spec: KernelSpec) -> KernelSpec:
    """The spec of a split-K partial product: float32 out, no epilogue, every operand batched."""
    return KernelSpec(
        a_dtype=spec.a_dtype,
        b_dtype=spec.b_dtype,
        out_dtype="float32",
        a_major=spec.a_major,
        b_major=spec.b_major,
    )


def _splitk_fake_operands(plan, spec: KernelSpec, partials: bool):
    """(a, b, d, c, bias[, z]) for split-K: A and B as (rows, K/split, split) views of the
    row-major buffers (any leading dimension and split stride); D float32 partials
    (M, N, split) when `partials`, else D, C, bias and Z as for one GEMM."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor  # noqa: PLC0415

    s = cute.sym_int()
    kc = cute.sym_int()

    def view(dtype, rows, contiguous_k):
        div = common.elems_per_16b(dtype)
        ld, split_stride = cute.sym_int64(divisibility=div), cute.sym_int64(divisibility=div)
        stride = (ld, 1, split_stride) if contiguous_k else (1, ld, split_stride)
        return make_fake_tensor(
            common.cutlass_dtype(dtype), (rows, kc, s), stride,
            assumed_align=common.TMA_ALIGN_BYTES,
        )  # fmt: skip

    a_k, b_n = spec.a_major == "k", spec.b_major == "n"
    m = cute.sym_int(divisibility=1 if a_k else common.elems_per_16b(spec.a_dtype))
    n = cute.sym_int(divisibility=common.elems_per_16b(spec.b_dtype) if b_n else 1)
    a, b = view(spec.a_dtype, m, a_k), view(spec.b_dtype, n, not b_n)
    if partials:
        n_d = cute.sym_int(divisibility=common.elems_per_16b("float32"))
        d = make_fake_compact_tensor(
            common.cutlass_dtype("float32"), (m, n_d, s), stride_order=(1, 0, 2),
            assumed_align=common.TMA_ALIGN_BYTES,
        )  # fmt: skip
        return a, b, d, None, None
    _, _, d, c, bias, z = common.make_fake_operands(plan, spec)
    return a, b, d, c, bias, z


def _splitk_plan(plan):
    """The plan re-derived for float32 partials (a larger epilogue buffer), fewer A/B stages
    when the planner's count no longer fits in shared memory."""
    from jax_sm100._src import planning  # noqa: PLC0415

    return planning.replace_fitting(plan, out_dtype="float32", c_dtype=None, preact_out=False)


def _fake_workspace(plan):
    """(ws, flags) fake tensors of static shape for a stream-K plan, else (None, None)."""
    from cutlass.cute.runtime import make_fake_compact_tensor  # noqa: PLC0415

    from jax_sm100._src.compile import workspace_shapes  # noqa: PLC0415

    shapes = workspace_shapes(plan)
    if not shapes:
        return None, None
    types = {"float32": cutlass.Float32, "int32": cutlass.Int32}
    return tuple(
        make_fake_compact_tensor(types[dtype], shape, assumed_align=16)
        for shape, dtype in shapes.values()
    )
