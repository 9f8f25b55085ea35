"""What the grouped GEMM families share: the ragged TMA view, the group table, the schedule.

`ragged_dot` and its backward run as one grouped GEMM per call, on sm_90a (sm90_grouped.py,
wgmma) and sm_100a (sm100_grouped.py, tcgen05). Both take the same host operands in the same
two ragged modes (`plan.ragged`), with the group sizes read on the device (no host sync; the
launch is CUDA-graph safe):

* "m" (ragged_dot, and its d lhs): A (M, K) holds every group's rows, one after another; B
  (N, K, G) one matrix per group; D (M, N). Group j's rows [s_j, s_j + g_j) times B[j].
  Rows past the last group are written as zeros. With `KernelSpec.b_groups` (E < G) B is
  (N, K, E) and group j's rows take B[j mod E]: batches of rows folded into one call
  (ragged_dot under vmap) that share one set of experts.
* "k" (ragged_dot's d rhs): A (M, K) and B (N, K) both hold every group's rows along K; D
  (M, N, G). D[j] is the product over group j's rows only (zero for an empty group). With
  `KernelSpec.k_segments` S > 1, D is (M, N, G / S) and D[j] the product over the rows of the
  S groups j, j + G / S, ... (its segments): one work tile runs all their k-blocks into one
  accumulator (the weight gradient of experts shared by batches folded in, summed over them).

Everything that does not depend on the tensor-core generation is here, in `GroupedGemm` (a
mixin each family puts before its dense kernel class) and two functions:

* The schedule. Every CTA first builds a table in shared memory from the group sizes (one warp,
  32 groups at a time with warp shuffles): each group's first row (a running sum clamped to the
  extent the groups partition, so bad sizes never address outside the buffers) and, in "m" mode,
  its first work tile. A work tile is (group, m tile, n tile); cluster c takes work tiles c, c +
  clusters, ..., and a binary search of the table gives a work index its group. (Plans in 1x1
  clusters, cooperative on sm_90a, take tiles dynamically instead, `GemmPlan.dynamic_tiles`:
  after its first, a CTA claims the next from a counter; the protocol below, `_work_ring`.)
  Inside a group the work tiles run along M first (`plan.raster_along_m`), or along N first in
  "m" mode when one group's B is small (the planner's `grouped_raster_along_m`: the clusters in
  flight then share a few m tiles of A and the group's whole B in L2). A cluster of `pair` CTAs
  along M (2x1 on sm_90a) makes its work tile `pair` CTA tiles tall: CTA r takes the
  rows from r * tile_m on, so both CTAs of a pair stay inside one group and share its B tile by
  multicast; a CTA whose rows start past the group's end loads zeros and stores nothing. In "m"
  mode a group of g_j rows has ceil(g_j / (pair x tile_m)) x tiles_n work tiles, a group
  boundary falls inside a tile anywhere, and an empty group has none; a last pseudo-group covers
  the rows past the groups (zeros, no main loop). In "k" mode the tiles are G x tiles_m x
  tiles_n and each runs ceil(g_j / tile_k) k-blocks (none for an empty group: it stores zeros).
  Every warp role of a CTA walks the same work indices and reads the same table, so they agree
  on each tile's group, rows and k-block count without talking to each other.
* Group boundaries through TMA's bounds checks, with one static descriptor per operand
  (`ragged_view`, `ragged_slice`). The ragged extent is presented to TMA as a rank-4 view: the
  ragged mode of extent 2^30 and two extra modes whose strides are (2^34 - s, s) elements (s:
  the ragged mode's stride). Group j is then addressed at coordinates (2^30 - g_j + r, .,
  2^30, s_j + g_j): the address is base + (s_j + r) s + 2^64 x (element bytes), which is
  base + (s_j + r) s modulo 2^64, and the bounds check of the first coordinate ends the group
  at row g_j. Loads past a group's end are zero-filled and stores past it are dropped, so a
  tile that straddles two groups neither reads the next group's rows into its sums nor writes
  over its output. (The same view technique Triton's ragged TMA and quack's varlen GEMMs use.)

Because the group's bounds travel in the coordinates, not in the descriptor, no per-group TMA
descriptor is built, patched or fenced: the descriptors are the usual static kernel parameters
(`cute.nvgpu.make_tiled_tma_atom*` over the views), made once on the host. Every box a stage
loads is the full tile, and TMA counts the zero-filled bytes of a box towards the mbarrier's
transaction, so each stage's expected byte count is the whole tile's, constant across groups.
"""

from __future__ import annotations

import cutlass
import cutlass.pipeline as pipeline
from cutlass import cute

from jax_sm100._src.constraints import GROUPED_WORK_RING
from jax_sm100._src.kernels import common, family
from jax_sm100._src.kernels.spec import KernelSpec
from jax_sm100._src.planning.gemm_plan import GROUPED_CLUSTERS, grouped_layout_support

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


class GroupedGemm:
    """The arch-independent half of a grouped GEMM family (the module docstring).

    Put before the dense kernel class (`class K(GroupedGemm, DenseKernel)`): it gives the
    family its host operands, fake operands and the grouped legality rules (then the dense
    class's), and the device schedule. The family calls `_init_grouped(plan)` in `__init__`,
    `_grouped_views` on the host and `_build_table` once per CTA before any role reads the
    table; `_num_work`, `_work` and `_k_tiles` take `sched`, the tuple
    (table, tiles_m, tiles_n, k_extent).

    Host entry point of the family: `__call__(a, b, d, group_sizes, bias, counter, stream)`; a,
    d rank 2 and b rank 3 in "m" mode, a, b rank 2 and d rank 3 in "k" mode, group_sizes (G,)
    int32, bias (N, G) (ragged_dot's [G, N]) or None (a family that adds it sets
    `GROUPED_BIAS`), counter (1,) int32 zeroed for every call with `plan.dynamic_tiles`, else
    None.
    """

    HOST_OPERANDS = ("a", "b", "d", "group_sizes", "bias", "counter")
    # Whether the family's epilogue adds ragged_dot's per-group bias ("m" mode).
    GROUPED_BIAS = False

    def _init_grouped(self, plan):
        self.groups = int(plan.groups)
        self.ragged = plan.ragged
        # A work tile's (rows, columns, k-block) of D and the operands: the cluster's, whose
        # `pair` CTAs (the cluster's M extent) take its consecutive m tiles.
        self.pair = int(plan.cluster_shape_mn[0])
        tm, tn, tk = plan.cta_tile_mnk
        self.work_tile = (tm * self.pair, tn, tk)
        # A group's work tiles along M first, or along N first (grouped_raster_along_m).
        self.m_first = bool(plan.raster_along_m)
        # Work tiles claimed from a counter (the `_work_ring` protocol) instead of round-robin.
        self.dynamic = bool(plan.dynamic_tiles)
        # "k" mode: the groups summed into each D (`KernelSpec.k_segments`), and the D count.
        self.segments = self.spec.k_segments
        self.out_groups = self.groups // self.segments

    @classmethod
    def why_not(cls, plan, spec: KernelSpec) -> str | None:
        """The grouped rules both families share, then the dense family's own."""
        if not plan.groups or plan.ragged not in ("m", "k"):
            return "not a grouped plan (plan.groups, plan.ragged)"
        if plan.split_k != 1 or plan.stream_k or plan.stage_c:
            return "grouped plans run without split-K, stream-K or a staged C"
        clusters = GROUPED_CLUSTERS.get(plan.kernel, ((1, 1),))
        if tuple(plan.cluster_shape_mn) not in clusters:
            return f"{plan.kernel} runs clusters in {clusters}, not {plan.cluster_shape_mn}"
        if spec.has_c or spec.preact_out or spec.act_grad:
            return "the grouped epilogue takes alpha, a per-group bias and an activation only"
        if spec.has_bias and not (plan.ragged == "m" and cls.GROUPED_BIAS):
            return f"{plan.kernel}'s epilogue takes no bias in ragged mode {plan.ragged!r}"
        layout = grouped_layout_support(plan.ragged, spec.a_major, spec.b_major)
        if layout is not None:
            return layout
        if spec.b_groups and (plan.ragged != "m" or plan.groups % spec.b_groups):
            return (f"B of {spec.b_groups} matrices for {plan.groups} groups: ragged-rows plans "
                    "whose groups are a multiple of them only")  # fmt: skip
        if spec.k_segments > 1 and (plan.ragged != "k" or plan.groups % spec.k_segments):
            return (f"{spec.k_segments} segments of {plan.groups} groups: ragged-contraction "
                    "plans whose groups are a multiple of them only")  # fmt: skip
        return super().why_not(plan, spec)

    @classmethod
    def compile_inputs(cls, plan, spec: KernelSpec) -> family.CompileInputs:
        """Fake operands in the modes of the module docstring: the ragged extent (M in "m"
        mode, K in "k" mode) symbolic with no divisibility (a group may end anywhere), the
        contiguous extents 16-byte divisible, G static."""
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
        bias = None
        if plan.ragged == "m":
            m = cute.sym_int()
            k = cute.sym_int(divisibility=div(spec.a_dtype))
            b_n = spec.b_major == "n"
            n = cute.sym_int(divisibility=div(spec.out_dtype))
            if b_n:
                n = cute.sym_int(divisibility=max(div(spec.out_dtype), div(spec.b_dtype)))
            else:
                k = cute.sym_int(divisibility=max(div(spec.a_dtype), div(spec.b_dtype)))
            a = fake(spec.a_dtype, (m, k), (1, 0))
            # B (N, K, G): the rhs [G, K, N] (N-major) or [G, N, K] (K-major).
            b = fake(spec.b_dtype, (n, k, spec.b_groups or g), (0, 1, 2) if b_n else (1, 0, 2))
            d = fake(spec.out_dtype, (m, n), (1, 0))
            if spec.has_bias:
                # ragged_dot's bias [G, N] as (N, G), read per element (no TMA).
                bias = make_fake_compact_tensor(
                    common.cutlass_dtype(spec.bias_dtype), (n, g), stride_order=(0, 1),
                    assumed_align=4,
                )  # fmt: skip
        else:
            # A = lhs^T (M, K) from lhs [K, M]; B = the cotangent^T (N, K) from [K, N].
            m = cute.sym_int(divisibility=div(spec.a_dtype))
            n = cute.sym_int(divisibility=max(div(spec.b_dtype), div(spec.out_dtype)))
            k = cute.sym_int()
            a = fake(spec.a_dtype, (m, k), (0, 1))
            b = fake(spec.b_dtype, (n, k), (0, 1))
            d = fake(spec.out_dtype, (m, n, g // spec.k_segments), (1, 0, 2))
        counter = None
        if plan.dynamic_tiles:
            counter = make_fake_compact_tensor(cutlass.Int32, (1,), assumed_align=4)
        return family.CompileInputs(plan, spec, (a, b, d, gs, bias, counter))

    # ---------------------------------------------------------------- host

    def _grouped_views(self, a: cute.Tensor, b: cute.Tensor, d: cute.Tensor):
        """(A, B, D as TMA sees them, the ragged extent, tiles_m, tiles_n, the most work
        tiles any group sizes make), inside the family's host `__call__`."""
        tm, tn, _ = self.work_tile
        if self.ragged == "m":
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
            max_work = tiles_m * tiles_n * self.out_groups
        return a_view, b_view, d_view, extent, tiles_m, tiles_n, max_work

    @cute.jit
    def _group_operands(self, mA: cute.Tensor, mB: cute.Tensor, group, start, rows):
        """(A, B) as a work tile of `group` reads them, its ragged extent [start, start + rows):
        in "m" mode the group's rows of A and its matrix of B (`_group_b`), in "k" mode the
        group's rows of both (`ragged_slice`)."""
        if cutlass.const_expr(self.ragged == "m"):
            a_mk = ragged_slice(mA, 0, start, rows)
            b_nk = self._group_b(mB, group)
        else:
            a_mk = ragged_slice(mA, 1, start, rows)
            b_nk = ragged_slice(mB, 1, start, rows)
        return a_mk, b_nk

    @cute.jit
    def _group_b(self, mB: cute.Tensor, group) -> cute.Tensor:
        """Ragged-rows mode: the (N, K) matrix of B that `group`'s rows multiply: B[group], or
        B[group mod b_groups] when B holds fewer (`KernelSpec.b_groups`)."""
        if cutlass.const_expr(self.spec.b_groups != 0):
            group = group % self.spec.b_groups
        return mB[(None, None, group)]

    def _table_field(self):
        """The group table's shared-memory field (`_build_table`'s layout)."""
        return cute.struct.MemRange[cutlass.Int32, 2 * (self.groups + 2)]

    # ---------------------------------------------------------------- device: dynamic tiles
    # Every role walks its CTA's work tiles from its first (`_work_range`) with
    # `_produce_first` / `_produce_next` (the producer warp) or `_take_first` / `_take_next`
    # (each consumer), which step `stride` on without dynamic tiles. They return the ring's
    # state for the caller to assign: advanced inside a helper only, a state the caller's
    # dynamic loop carries would stay at its first slot (the loop carries what its body
    # assigns). With `plan.dynamic_tiles`
    # the producer warp (its 32 lanes) claims each CTA's next work tile from the counter once
    # it has issued the current tile's loads (`_claim`: CTA c's first tile is c, then `stride`
    # + the counter's old value), and publishes every index (`_publish`), the last one at or
    # past the end, in a ring of GROUPED_WORK_RING slots in shared memory, each with a full and
    # an empty mbarrier; every consumer thread of the CTA reads each index in turn and hands
    # its slot back (`_next_work`). Each tile is computed as in the round-robin schedule, so
    # results do not change.

    def _work_ring_fields(self) -> dict:
        """The ring's shared-memory fields (none without dynamic tiles)."""
        if not self.dynamic:
            return {}
        return {
            "work_barriers": cute.struct.MemRange[cutlass.Int64, GROUPED_WORK_RING * 2],
            "work_slots": cute.struct.MemRange[cutlass.Int32, GROUPED_WORK_RING],
        }

    @cute.jit
    def _work_ring(self, storage, consumers: int, mCounter):
        """(ring pipeline, slots, counter), or None without dynamic tiles; in the kernel before
        the pipelines' init fence and barrier (its mbarriers are initialised with theirs)."""
        work = None
        if cutlass.const_expr(self.dynamic):
            work_pipe = pipeline.PipelineAsync.create(
                barrier_storage=storage.work_barriers.data_ptr(),
                num_stages=GROUPED_WORK_RING,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
                defer_sync=True,
            )
            slots = storage.work_slots.get_tensor(cute.make_layout(GROUPED_WORK_RING))
            work = (work_pipe, slots, mCounter)
        return work

    def _work_state(self, user_type):
        """A pipeline state over the ring (`pipeline.PipelineUserType.Producer` or Consumer)."""
        return pipeline.make_pipeline_state(user_type, GROUPED_WORK_RING)

    @cute.jit
    def _claim(self, work):
        """The producer warp: the counter's old value in lane 0 (its claim of the next work
        tile), 0 in the other lanes."""
        taken = cutlass.Int32(0)
        if cute.arch.lane_idx() == 0:
            taken = cute.arch.atomic_add(work[2].iterator, cutlass.Int32(1), sem="relaxed",
                                         scope="gpu")  # fmt: skip
        return taken

    @cute.jit
    def _publish(self, work, state, w):
        """The producer warp: work tile `w` into the ring's next slot, for every consumer
        (`state` advanced past it)."""
        work_pipe, slots, _ = work
        work_pipe.producer_acquire(state)
        if cute.arch.lane_idx() == 0:
            slots[state.index] = w
        work_pipe.producer_commit(state)
        state.advance()
        return state

    @cute.jit
    def _next_work(self, work, state):
        """A consumer thread: (the work tile the producer warp published next, `state`
        advanced past its slot)."""
        work_pipe, slots, _ = work
        work_pipe.consumer_wait(state)
        w = slots[state.index]
        work_pipe.consumer_release(state)
        state.advance()
        return w, state

    @cute.jit
    def _produce_first(self, work, w):
        """The producer warp, before its first tile `w`: its ring state, `w` published (None
        without dynamic tiles)."""
        state = None
        if cutlass.const_expr(self.dynamic):
            state = self._work_state(pipeline.PipelineUserType.Producer)
            state = self._publish(work, state, w)
        return state

    @cute.jit
    def _produce_next(self, work, state, w, stride):
        """The producer warp, tile `w`'s loads issued: (its next work tile, claimed and
        published with dynamic tiles, else `stride` on; the ring state). Claimed this late, a
        tile goes to the CTA nearest to free (claimed at the tile's last stage instead, the
        skewed groups' gain fell from 1.11x to 1.02x on the H200)."""
        if cutlass.const_expr(self.dynamic):
            w = stride + cute.arch.shuffle_sync(self._claim(work), 0)
            state = self._publish(work, state, w)
        else:
            w = w + stride
        return w, state

    @cute.jit
    def _take_first(self, work, w):
        """A consumer, before its first tile: (that tile, the producer's first index with
        dynamic tiles, else `w`; its ring state or None)."""
        state = None
        if cutlass.const_expr(self.dynamic):
            state = self._work_state(pipeline.PipelineUserType.Consumer)
            w, state = self._next_work(work, state)
        return w, state

    @cute.jit
    def _take_next(self, work, state, w, step):
        """A consumer, tile `w` done: (its next work tile, the producer's next index with
        dynamic tiles, else `step` on; the ring state)."""
        if cutlass.const_expr(self.dynamic):
            w, state = self._next_work(work, state)
        else:
            w = w + step
        return w, state

    # ---------------------------------------------------------------- device: the schedule

    @cute.jit
    def _build_table(self, mGs, table, extent, tiles_n):
        """Fills `table` (one warp): entry j of [0, G + 2) holds group j's first row, entry
        G + 2 + j its first work tile ("m" mode only; "k" mode's tiles are G x tiles_m x
        tiles_n); entry G is where the groups end and G + 1 the extent. Sizes are clamped so
        that every row range lies inside [0, extent)."""
        g = self.groups
        m_mode = self.ragged == "m"
        rows_per_tile = self.work_tile[0]
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
            # Inclusive running sum of the sizes, saturating at the extent (below 2^30, the
            # planner's MAX_GROUPED_ROWS: a sum of two is below 2^31, no int32 overflow).
            end = size
            for d in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_up(end, 1 << d)
                if lane >= (1 << d):
                    end = cutlass.min(end + other, extent)
            end = cutlass.min(end + carry_rows, extent)
            if j < g:
                table[j + 1] = end
            if cutlass.const_expr(m_mode):
                # Each group's work tiles, and their running sum: its first work tile.
                start = cute.arch.shuffle_sync_up(end, 1)
                if lane == 0:
                    start = carry_rows
                last = (end - start + rows_per_tile - 1) // rows_per_tile * tiles_n
                for d in cutlass.range_constexpr(5):
                    other = cute.arch.shuffle_sync_up(last, 1 << d)
                    if lane >= (1 << d):
                        last = last + other
                last = last + carry_tiles
                if j < g:
                    table[g + 2 + j + 1] = last
                carry_tiles = cute.arch.shuffle_sync(last, 31)
            carry_rows = cute.arch.shuffle_sync(end, 31)
        if lane == 0:
            # The rows past the groups: a last pseudo-group, written as zeros ("m" mode).
            table[g + 1] = extent
            if cutlass.const_expr(m_mode):
                rest = (extent - carry_rows + rows_per_tile - 1) // rows_per_tile * tiles_n
                table[2 * g + 3] = carry_tiles + rest
        cute.arch.sync_warp()

    @cute.jit
    def _work_range(self, sched):
        """(first work tile, end, stride) of this CTA's cluster, round-robin: cluster c of C
        takes tiles c, c + C, ... below end."""
        clusters = cute.arch.grid_dim()[0] // self.pair
        return cute.arch.block_idx()[0] // self.pair, self._num_work(sched), clusters

    @cute.jit
    def _num_work(self, sched):
        table, tiles_m, tiles_n, _ = sched
        num = tiles_m * tiles_n * self.out_groups
        if cutlass.const_expr(self.ragged == "m"):
            num = table[2 * self.groups + 3]
        return num

    @cute.jit
    def _work(self, sched, w, rank=0):
        """Work tile `w` as (group, first row, rows, m tile, n tile, zeros) for the CTA of rank
        `rank` along the cluster's M (its m tile is `rank` of the work tile's `pair`; past the
        group's rows it loads zeros and stores nothing): `zeros` when the tile has no main loop
        (the rows past the groups, or an empty group's D; with segments, False: `_k_tiles`
        counts them)."""
        table, tiles_m, tiles_n, _ = sched
        g = self.groups
        tm, _, tk = self.work_tile
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
        if cutlass.const_expr(self.m_first):
            # Along M first: the group's m tiles (its own count in "m" mode) of each n tile.
            m_tiles = tiles_m
            if cutlass.const_expr(self.ragged == "m"):
                m_tiles = (rows + tm - 1) // tm
            n_tile = local // m_tiles
            m_local = local - n_tile * m_tiles
        else:
            # Along N first: every n tile of one m tile, then the next m tile.
            m_local = local // tiles_n
            n_tile = local - m_local * tiles_n
        m_tile = m_local * self.pair + rank
        # "k" mode: an empty group's tile stores zeros (with segments, those that all are).
        zeros = rows == 0
        if cutlass.const_expr(self.ragged == "k" and self.segments > 1):
            zeros = False
        if cutlass.const_expr(self.ragged == "m"):
            zeros = group == g
        return group, start, rows, m_tile, n_tile, zeros

    @cute.jit
    def _k_tiles(self, sched, group, rows, zeros):
        """The k-blocks of a work tile of `group` (`rows`, `zeros`: `_work`'s): K's in "m"
        mode, its group's rows' in "k" mode, or its segments' (`_segment`) together."""
        tk = self.work_tile[2]
        n_k = (sched[3] + tk - 1) // tk
        if cutlass.const_expr(self.ragged == "k"):
            n_k = (rows + tk - 1) // tk
            if cutlass.const_expr(self.segments > 1):
                for s in cutlass.range(1, self.segments, unroll=1):
                    _, more = self._segment(sched, group, s)
                    n_k += (more + tk - 1) // tk
        if zeros:
            n_k = 0
        return n_k

    @cute.jit
    def _segment(self, sched, group, s):
        """In "k" mode, (first row, rows) of segment `s` of D[`group`]: group s x G / S + group's
        (`KernelSpec.k_segments`; segment 0 is `_work`'s start and rows)."""
        table = sched[0]
        q = s * self.out_groups + group
        start = table[q]
        return start, table[q + 1] - start
