"""The SM90 (Hopper) GEMM family: persistent, warp-specialised wgmma with a fused epilogue.

One CTA runs 1 + W warp groups (W = 2 for 128- and 256-row tiles, 1 for 64-row tiles):

* warp group 0 is the producer. It gives registers back (`setmaxnreg` down) and one of its
  warps walks the persistent tile schedule issuing TMA loads of A and B k-blocks into a ring of
  `num_ab_stages` shared-memory stages, multicast across the cluster where the cluster shares an
  operand (CTAs in one cluster row share A tiles, in one cluster column B tiles). With
  `plan.stage_c`, one more warp per epilogue group fills that group's ring of C sub-tiles by
  TMA (sm90_epilogue.py).
* warp groups 1..W are consumers. They take registers (`setmaxnreg` up), run wgmma on each
  stage as it lands (one wgmma batch kept in flight before a stage is released), then run the
  epilogue on the float32 accumulators (sm90_epilogue.py): sub-tile by sub-tile
  (`plan.epi_tile`) they apply `common.apply_epilogue` (alpha, beta * C, bias, activation, or a
  backward epilogue's act'(C) * acc; C comes from its shared-memory ring by ldmatrix, or from
  global memory one sub-tile ahead of its use, bias from global memory at the coordinates each
  register lands on), convert to the output type, write the sub-tile to shared memory with
  `stmatrix` and one thread stores it with TMA (and the pre-activation Z beside it).

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

A swapped plan (`plan.swap_ab`, fp8) is this kernel on D^T = B A^T: the caller's B is its A and
the caller's A its B, and it stores D M-major (`spec.d_major == "m"`): each sub-tile goes to
shared memory M-major by stmatrix's transposing form and out by TMA as it is, into the caller's
row-major D; bias runs along its M.

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
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from jax_sm100._src import constraints
from jax_sm100._src.kernels import common, family
from jax_sm100._src.kernels.sm90_epilogue import Sm90Epilogue
from jax_sm100._src.kernels.sm90_schedules import Sm90SplitSchedules
from jax_sm100._src.kernels.spec import KernelSpec

_THREADS_PER_WG = 128
# Register budgets per thread after `setmaxnreg`: the producer needs few, the consumers hold the
# accumulators (128 fp32 per thread for a 128x256 tile over two warp groups). 40 + 2 * 232
# fits the 64K-register file for 384 threads; the same split CUTLASS uses for this layout.
_PRODUCER_REGS = 40
_CONSUMER_REGS = 232
_SMEM_ALIGN = 1024
# Named barriers (common.py's table): one per epilogue group (two in ping-pong), then the two
# ping-pong turn barriers that order the consumer warp groups' main loops.
_EPI_BARRIER_ID = common.SM90_EPI_BARRIER
_TURN_BARRIER_ID = common.SM90_TURN_BARRIER

# What one consumer warp group's tile epilogue works with (`_store_tile`), built once.
_Epilogue = collections.namedtuple(
    "_Epilogue",
    "gD cD gC sD tma_d r2s thr_r2s tRS_sD tRS_acc sub_acc sub_out sub_size mBias mD store_pipe "
    "barrier store_warp group gZ sZ tma_z tRS_sZ",
)

# 256-row tiles give each consumer warp group two 64-row MMA blocks. N = 160 is cuBLAS's choice
# for large tall and wide problems on the H200 (benchmarks/cublas_kernels.py), 176 its fp8 one
# at 4096x7168x16384 (41 columns of 176 fill the waves; epilogue sub-tiles of 16 columns).
SUPPORTED_TILE_M = (64, 128, 256)
SUPPORTED_TILE_N = (64, 128, 160, 176, 192, 256)


class Sm90GemmKernel(Sm90Epilogue, Sm90SplitSchedules, family.KernelFamily):
    """A persistent warp-specialised wgmma GEMM for one (GemmPlan, KernelSpec).

    Host entry point: `__call__(a, b, d, c, bias, z, ws, flags, stream)` with the modes of
    spec.py (ws and flags: the stream-K workspace, compile.workspace_shapes), `None`
    for an absent c, bias, z or workspace.
    """

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
        # Operand and output types and layouts, from the spec (as the SM100 family takes them):
        # A (M, K, L) and B (N, K, L) are "row major" when K is their contiguous mode.
        self.a_dtype = common.cutlass_dtype(spec.a_dtype)
        self.b_dtype = common.cutlass_dtype(spec.b_dtype)
        self.d_dtype = common.cutlass_dtype(spec.out_dtype)
        self._a_k_major = spec.a_major == "k"
        self._b_k_major = spec.b_major == "k"
        self._a_layout = LayoutEnum.ROW_MAJOR if self._a_k_major else LayoutEnum.COL_MAJOR
        self._b_layout = LayoutEnum.ROW_MAJOR if self._b_k_major else LayoutEnum.COL_MAJOR
        # D (and Z) N-major, or M-major for a swapped product (`GemmPlan.swap_ab`): its
        # sub-tiles are staged M-major in shared memory (stmatrix's transposing form) and
        # stored as they are by TMA.
        self._d_m_major = spec.d_major == "m"
        self._d_layout = LayoutEnum.COL_MAJOR if self._d_m_major else LayoutEnum.ROW_MAJOR
        # The epilogue also stores the pre-activation Z, through its own staging buffers.
        self.preact = bool(spec.preact_out)
        # C through shared-memory rings filled by TMA rather than global loads into registers:
        # one ring per epilogue group (a slot per store stage), each filled by its own producer
        # warp walking that group's tiles, so each ring has one consumer that reads it in order.
        # (A C broadcast over the batch, stride 0, keeps the global loads: TMA is not asked to
        # take a zero stride.)
        self.stage_c = bool(plan.stage_c) and self.has_c and spec.c_batched
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
        if (spec.b_groups or spec.k_segments > 1) and not plan.groups:
            return "b_groups and k_segments are for grouped plans (kernels/grouped.py)"
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
        # (GemmPlan allows swap_ab on the dense kernel only, with no C, split-K or stream-K.)
        if (spec.d_major == "m") != plan.swap_ab:
            return (f"spec.d_major={spec.d_major!r} with swap_ab={plan.swap_ab} on kernel="
                    f"{plan.kernel!r}: D is stored M-major by swapped dense plans only "
                    "(KernelSpec.for_plan gives a plan's spec)")  # fmt: skip
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
            self.d_dtype, self._d_layout, self.epi_tile, self.epi_stages * self.epi_groups
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
        self._launch(a, b, d, c, bias, z, ws, flags, stream, None)

    @cute.jit
    def _launch(self, a, b, d, c, bias, z, ws, flags, stream, stage_extra):
        """`__call__`'s host work. `stage_extra`: the tensors a subclass loads into every A/B
        stage beside the A and B tiles (None here; `_stage_extra_host` and the hooks below)."""
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

        # Every mbarrier before A's stages, in the bytes the planner reserves for them
        # (`constraints.SMEM_RESERVED_BYTES`): after D's (1024-aligned) stages, staged C's
        # barriers cost a whole 1024 bytes the plan did not count.
        fields = {
            "ab_barriers": cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2 + red_bars],
        }
        if cutlass.const_expr(self.stage_c):
            fields["c_barriers"] = cute.struct.MemRange[
                cutlass.Int64, 2 * self.epi_stages * self.epi_groups
            ]
        fields |= {
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
            fields["sc"] = cute.struct.Align[
                cute.struct.MemRange[c.element_type, cute.cosize(c_staged)], _SMEM_ALIGN
            ]
        extra, extra_fields = self._stage_extra_host(stage_extra)
        fields.update(extra_fields)
        self.shared = common.shared_struct(fields, self.plan)
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
            extra,
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
        extra_params,
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
        stage_bytes += self._stage_extra_bytes()
        # Every consumer warp of every CTA that reads a multicast stage releases it (in ping-pong
        # only the warp group whose tile the stage belongs to reads it).
        releasers = (self.a_mcast + self.b_mcast - 1) * self.mma_wgs * 4
        # The stage ring spans the CTAs that share stages by multicast (none for split-K).
        pipe_layout = cute.make_layout((1, *cluster_layout.shape))
        if cutlass.const_expr(self.split > 1):
            pipe_layout = cute.make_layout((1, 1, 1, 1))
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            tidx=common.pinned_thread_idx(),
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
        extra = self._stage_extra_smem(storage, extra_params)
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
                                     tBgB, tBsB, b_mask, k_tiles, extra)  # fmt: skip
                else:
                    self._produce(ab_pipe, sched_params, tma_a, tAgA, tAsA, a_mask, tma_b, tBgB,
                                  tBsB, b_mask, k_tiles, extra)  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(_CONSUMER_REGS)
            self._consume(ab_pipe, sched_params, tiled_mma, sA, sB, sD, gD, tma_d, mD, mC,
                          mBias, k_tiles, wg - 1, warp, tidx - _THREADS_PER_WG, red_bars,
                          rank, mWs, mFlags, (gZ, sZ, tma_z, mZ), (c_pipe, sC),
                          extra)  # fmt: skip

    @cute.jit
    def _produce(self, ab_pipe, sched_params, tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB,
                 b_mask, k_tiles, extra=None):  # fmt: skip
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
                common.acquire_empty(ab_pipe, state)
                barrier = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_a, a_k[(None, state.count)], tAsA[(None, state.index)],
                          tma_bar_ptr=barrier, mcast_mask=a_mask)  # fmt: skip
                cute.copy(tma_b, b_k[(None, state.count)], tBsB[(None, state.index)],
                          tma_bar_ptr=barrier, mcast_mask=b_mask)  # fmt: skip
                self._produce_stage_extra(extra, tile, state.count, state, barrier)
                ab_pipe.producer_commit(state)
                state.advance()
            sched.advance_to_next_work()
            work = sched.get_current_work()
        ab_pipe.producer_tail(state)

    @cute.jit
    def _consume(self, ab_pipe, sched_params, tiled_mma, sA, sB, sD, gD, tma_d, mD, mC, mBias,
                 k_tiles, consumer_wg, warp, ctidx, red_bars, rank, mWs, mFlags,
                 zout, cstage, extra=None):  # fmt: skip
        tm, tn, _ = self.tile_mnk
        etidx, mma_base, store_warp, epi_group = self._consumer_roles(consumer_wg, ctidx)
        thr_mma = tiled_mma.get_slice(mma_base)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gD).shape[:3], self.acc_dtype)
        k_blocks = cute.size(tCrA, mode=[2])

        # Register -> shared copy of one epilogue sub-tile (stmatrix for 16-bit outputs). The
        # split-K epilogue writes its float32 partial tile element by element instead.
        r2s, thr_r2s, tRS_sD, tRS_acc, sub_acc, sub_out, sub_size = (None,) * 7
        if cutlass.const_expr(self.split == 1):
            r2s, thr_r2s, tRS_sD, tRS_acc, sub_acc, sub_out, sub_size = self._d_copy(
                tiled_mma, sD, acc, etidx
            )
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
        store_pipe, epi_barrier, my_turn, their_turn = self._consumer_barriers(
            consumer_wg, epi_group
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
                             k_tiles, epi, warp, ctidx, rank, mWs, mFlags, extra)  # fmt: skip
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
                                               k_tiles, read, release,
                                               self._tile_extra(extra, tile))  # fmt: skip
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

    def _consumer_roles(self, consumer_wg, ctidx):
        """A consumer thread's place in the epilogue: (its index within its epilogue group, the
        first thread of the warp group whose MMA slice it holds, the warp that issues the
        group's TMA stores, the group). Cooperative: every consumer thread is one epilogue
        group, stored by the first consumer warp; ping-pong: a group per warp group."""
        if self.pingpong:
            return ctidx % _THREADS_PER_WG, 0, 4 + 4 * consumer_wg, consumer_wg
        return ctidx, consumer_wg * _THREADS_PER_WG, 4, 0

    def _d_copy(self, tiled_mma, sD, acc, etidx):
        """The register -> shared copy of one epilogue sub-tile (stmatrix for 16-bit outputs)
        as `_store_tile` takes it: (r2s, thr_r2s, tRS_sD, tRS_acc, sub_acc, sub_out,
        sub_size)."""
        r2s_atom = sm90.get_smem_store_op(
            self._d_layout, elem_ty_d=self.d_dtype, elem_ty_acc=self.acc_dtype
        )
        stm_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(self._d_m_major, 4), self.d_dtype
        )
        r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stm_atom, tiled_mma))
        thr_r2s = r2s.get_slice(etidx)
        tRS_sD = thr_r2s.partition_D(sD)
        tRS_acc = r2s.retile(acc)
        sub_shape = cute.shape(thr_r2s.partition_S(sD))[:3]
        sub_acc = cute.make_rmem_tensor(sub_shape, self.acc_dtype)
        sub_out = cute.make_rmem_tensor(sub_shape, self.d_dtype)
        return r2s, thr_r2s, tRS_sD, tRS_acc, sub_acc, sub_out, cute.size(sub_acc)

    def _consumer_barriers(self, consumer_wg, epi_group):
        """A consumer warp group's (TMA-store pipeline, epilogue barrier, my turn, their turn).

        Ping-pong turns: a warp group waits on its own barrier before its main loop; the other
        group arrives on it once it has seen every stage of its own tile land. This keeps the
        two groups' waits on the stage ring in tile order, so a group never waits on a stage
        barrier more than one phase ahead of the fills it has observed."""
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.epi_threads),
        )
        epi_barrier = pipeline.NamedBarrier(
            barrier_id=_EPI_BARRIER_ID + epi_group, num_threads=self.epi_threads
        )
        return store_pipe, epi_barrier, *turn_barriers(consumer_wg)

    @cute.jit
    def _mainloop(self, ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks, n_k, read, release,
                  extra=None):  # fmt: skip
        """`n_k` k-tiles of wgmma into zeroed accumulators, one batch kept in flight and each
        stage released once its batch retired; the last batch is left in flight (the caller
        waits for it and releases its stage). Returns the advanced (read, release) states.
        (`extra`: `_stage_extra_smem`'s, for a subclass's main loop.)"""
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.fence()
        for kt in range(n_k):
            common.wait_full(ab_pipe, read)
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

    # ---------------------------------------------------------------- stage extras
    # What a subclass loads into every A/B stage beside the tiles, under the stage's barrier
    # (sm90_scaled.py: the k-block's scale factors). Nothing here: each hook adds no code.

    def _stage_extra_host(self, stage_extra):
        """(kernel argument, shared-memory fields) for `_launch`'s `stage_extra` tensors."""
        return None, {}

    def _stage_extra_bytes(self) -> int:
        """Bytes the extras add to each stage's TMA transaction count."""
        return 0

    def _stage_extra_smem(self, storage, extra_params):
        """In the kernel, before the warp roles split: what the producer and the consumers
        use of the extras (`extra` of `_produce`, `_consume` and `_mainloop`)."""
        return None

    def _produce_stage_extra(self, extra, tile, k, state, barrier):
        """The producer's loads of the extras of k-block `k` of `tile` into stage `state`."""

    def _tile_extra(self, extra, tile):
        """The consumers' `extra` for `tile`'s main loop (`extra` itself here)."""
        return extra


def turn_barriers(consumer_wg):
    """(consumer warp group `consumer_wg`'s turn barrier, the other group's): two named
    barriers over both groups' threads, by which the groups take turns in the ping-pong
    schedule's main loops."""
    my_turn = pipeline.NamedBarrier(
        barrier_id=_TURN_BARRIER_ID + consumer_wg, num_threads=2 * _THREADS_PER_WG
    )
    their_turn = pipeline.NamedBarrier(
        barrier_id=_TURN_BARRIER_ID + 1 - consumer_wg, num_threads=2 * _THREADS_PER_WG
    )
    return my_turn, their_turn


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
