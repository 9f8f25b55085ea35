"""The SM90 block-scaled GEMM family: fp8 data, float32 scales per 128 of k (DeepSeek-V3's).

    D[m, n] = sum over k-blocks kb of  sfa[m, kb] * sfb[n, kb] * sum_{k in kb} A[m, k] B[n, k]

The dense SM90 family (sm90_gemm.py) with two things added, through its stage hooks:

* Each A/B stage also holds the k-block's scales: one float32 per row of the tile's A (128, or
  256) and one per row of its B (column of D: 192, 128 or 64), or with B scaled per 128 x 128
  tile those of a window of 4 of B's tiles, the tile's own among them (16 bytes, TMA's
  narrowest box: `_B_TILE_WINDOW`), loaded by the producer warp with two more TMA copies under
  the stage's barrier (their bytes in its transaction count). The scales come transposed,
  [L, k/128, rows] with rows (or B's tiles) contiguous (the lowering transposes jax's
  [L, rows, k/128] layout: TMA cannot load a column of 4-byte elements), so each is one box.
  Rows past the matrix are zero-filled, as A's and B's are.
* The consumers' main loop. A 128-element fp8 k-tile is exactly one scale block, so per k-tile
  each consumer warp group (64 rows of a cooperative 128 x N tile; of a 256-row tile, 64 in each
  of two waves, below) runs its wgmma batch into a fresh float32 fragment (the first instruction
  of the batch overwrites it), waits for it, and promotes it into the main accumulators: acc +=
  frag * (sfa[row] * sfb[col]); the stage is released as soon as nothing more is read from it.
  In 128-row tiles of up to 128 columns, and in 256-row tiles with B scaled per 128 x 128 tile,
  the scales of the thread's rows and columns are read from shared memory before the wgmma
  batch is issued, so their latency hides under it; at 192 columns, and for per-row B scales in
  256-row tiles (32 columns a thread beside 192 registers of fragments), they would spill, so
  they are read during the promotion. The other warp group's wgmma batch runs on the tensor
  cores while this one promotes (the fastest published Hopper kernels, DeepGEMM's and
  CUTLASS's blockwise-scaled ones, do the same); the promotion costs two float32 instructions
  per accumulator per k-tile.
* With `plan.scaled_overlap` (the planner's choice for 128 x 64 tiles, and for 128 x 128 tiles
  of B scaled per 128 x 128 tile) each warp group also
  keeps the tensor cores fed itself: two fragments take the k-tiles in turn, and k-tile i + 1's
  batch is issued before k-tile i's is waited for (`wait_group(1)`), so k-tile i's promotion
  runs under it; its stage is released after the promotion, which reads the scales from it as
  it goes (loaded up front, they would not fit the registers beside three fragments: ptxas
  spilled). Three 64 x N fragments per warp group (acc, two k-tiles) fit 232 registers at
  N <= 128.
* B scaled per 128 x 128 tile (`plan.b_scale_rows == 128`, DeepSeek-V3's weights): the tile's
  columns (128 or 64, inside one scale tile) share one B scale per k-block, read from the
  stage's window at the tile's place in it (`_tile_extra`), so the promotion is one multiply per
  row of the thread and one FMA per accumulator. (Until the twenty-seventh session the lowering
  repeated those scales per row, an XLA fusion writing n k / 32 bytes a call, and each stage
  held a tile's width of copies.)
  The H200 (tenth session, benchmarks/RESULTS.md) ran the default loop at 744-830 TF/s on
  128 x 128 tiles and 869 on 128 x 192, the overlapped one at 752-821 (128 x 128), where the
  unscaled fp8 kernel runs 1270-1440 on the same data: the promotion is the cost. With the
  promotion replaced by one add the default loop ran 1072-1172, with one FMA 1034-1055.

Everything else (persistent schedule, clusters and multicast, TMA, epilogue through shared
memory) is the dense family's, the stream-K schedule included (the float32 partial tiles two
clusters share are of promoted accumulators, which add). Cooperative tiles (no ping-pong, no
split-K), identity epilogue: `why_not` says which. Tiles of 128 rows, or 256 x 128: each warp
group's 128 rows taken in two 64-row waves per k-tile through one fragment
(`_mainloop_waves`; DeepGEMM lays its 256-row tiles out so), the main accumulators 128
registers beside it (the planner's choice for large problems: planning/sm90_scaled.py). That
loop polls the next stage as soon as its last wave's batch retires, before that wave's
promotion, and peels its last k-tile so that the loop's releases need no branch: on the H200
(nineteenth session) 4096x7168x16384 with B per 128 x 128 tile went from 1109 to 1171 TF/s,
8192^3 from 1072 to 1101, against DeepGEMM's kernel at 1235-1292 in the same calls.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.pipeline as pipeline
from cutlass import cute
from cutlass.cute.nvgpu import cpasync, warpgroup

from jax_sm100._src import constraints
from jax_sm100._src.kernels import common, family
from jax_sm100._src.kernels.sm90_gemm import (
    _SMEM_ALIGN,
    _THREADS_PER_WG,
    Sm90GemmKernel,
    _fake_workspace,
)
from jax_sm100._src.kernels.spec import KernelSpec

_KERNEL = constraints.KERNEL_SM90_SCALED
# Rows of a tile that one wgmma batch of both consumer warp groups covers (64 each): 256-row
# tiles take two such waves per k-tile (`_mainloop_waves`).
_WAVE_ROWS = 128
# B scaled per 128 x 128 tile: the kernel takes the scales compact, [L, k / 128, tiles of B's
# rows] (`scaled_gpu`), and each stage holds a k-block's scales of a window of tiles, the tile's
# among them (`constraints.B_SCALE_TILE_WINDOW`, `constraints.b_tile_scale_stage_bytes`).
_B_TILE_WINDOW = constraints.B_SCALE_TILE_WINDOW
# The widest 128-row tile whose serial main loop reads a k-block's scales into registers up
# front.
_EARLY_SCALES_MAX_N = 128
# Whether the 256-row loop runs whole rings of stages (stage 0 to the last) at stage indices
# fixed when the kernel is traced (`_waves_ring`): its wgmma descriptors, barrier addresses and
# scale offsets then fold to constants over a base, and the pipeline state advances once a
# ring. sm_90a SASS, 256 x 128 tiles of B per 128 x 128 tile at 16384x4096x4096, 8192^3 and
# 4096x7168x16384: 168-192 instructions a ring k-tile against 211-223 at run-time indices.
# H200 (twenty-third session, two rounds each): 1214 against 1158-1187 TF/s at
# 4096x7168x16384, 1187-1191 against 1180-1183 at 8192^3, 1104-1106 against 1108-1109 at
# 16384x4096x4096. B scaled per 128 x 128 tile only: with per-row B scales ptxas spills 12-52
# bytes a thread.
_STATIC_RINGS = True


class Sm90ScaledGemmKernel(Sm90GemmKernel):
    """The block-scaled wgmma GEMM for one (GemmPlan, KernelSpec); the plan's `scale_dtype`
    and `scale_block` say how A and B are scaled.

    Host entry point: `__call__(a, b, d, sfa, sfb, ws, flags, stream)`: a (M, K, L) and
    b (N, K, L) K-major fp8, d (M, N, L) N-major, sfa (M, K / 128, L) and sfb (N, K / 128, L)
    float32 with M (N) contiguous (sfb (ceil(N / 128), K / 128, L) with B scaled per 128 x 128
    tile); ws and flags a stream-K plan's workspace (None otherwise).
    """

    HOST_OPERANDS = ("a", "b", "d", "sfa", "sfb", "ws", "flags")

    def __init__(self, plan, spec: KernelSpec):
        super().__init__(plan, spec)
        self.scale_dtype = common.cutlass_dtype(plan.scale_dtype)
        self.overlap = bool(plan.scaled_overlap)
        # B scaled per 128 x 128 tile: the tile's columns share one B scale per k-block (the
        # tile's own in the stage's window, `_tile_extra`), so the promotion multiplies by one
        # scale per row.
        self.b_tiled = plan.b_scale_rows > 1
        self.b_scale_rows = plan.b_scale_rows

    @classmethod
    def why_not(cls, plan, spec: KernelSpec) -> str | None:
        """None when this family can run (plan, spec); else the reason it cannot."""
        if plan.kernel != _KERNEL:
            return f"kernel={plan.kernel!r} is not {_KERNEL!r}"
        why = constraints.scaled_support(plan.arch, plan.k, spec.a_dtype, spec.b_dtype,
                                         plan.scale_dtype, plan.scale_block)  # fmt: skip
        if why is not None:
            return why
        if not common.epilogue_is_identity(spec) or spec.preact_out:
            return "the block-scaled kernel writes the plain product (no fused epilogue)"
        if not (spec.a_batched and spec.b_batched):
            return "the block-scaled kernel takes batched A and B (scales per batch)"
        try:
            constraints.check_scaled(
                plan.arch, True, False, plan.scale_dtype, plan.scale_block,
                plan.cta_tile_mnk[0], plan.pingpong, plan.split_k, plan.stream_k, plan.stage_c,
                plan.cta_tile_mnk[1],
            )  # fmt: skip
            constraints.check_scaled_overlap(True, plan.scaled_overlap, plan.cta_tile_mnk[1],
                                             plan.cta_tile_mnk[0])  # fmt: skip
        except constraints.PlanError as e:
            return str(e)
        return super().why_not(plan, spec)

    @classmethod
    def compile_inputs(cls, plan, spec: KernelSpec) -> family.CompileInputs:
        """A, B and D as for a dense product; the scales (rows, k / 128, L) with the rows
        contiguous, each leading dimension a multiple of 4 (16 bytes, for TMA). B's rows are
        its 128-row tiles where B is scaled per 128 x 128 tile (`b_scale_rows`)."""
        from cutlass.cute.runtime import make_fake_tensor  # noqa: PLC0415

        a, b, d, _, _, _ = common.make_fake_operands(plan, spec)
        m, n, l = a.shape[0], b.shape[0], a.shape[2]
        blocks = cute.sym_int()
        scale_type = common.cutlass_dtype(plan.scale_dtype)
        per_16b = common.elems_per_16b(plan.scale_dtype)

        def scales(rows):
            ld, batch = cute.sym_int64(divisibility=per_16b), cute.sym_int64(divisibility=per_16b)
            return make_fake_tensor(scale_type, (rows, blocks, l), (1, ld, batch),
                                    assumed_align=common.TMA_ALIGN_BYTES)  # fmt: skip

        b_rows = cute.sym_int() if plan.b_scale_rows > 1 else n
        operands = (a, b, d, scales(m), scales(b_rows), *_fake_workspace(plan))
        return family.CompileInputs(plan, spec, operands)

    # ---------------------------------------------------------------- host

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,
        b: cute.Tensor,
        d: cute.Tensor,
        sfa: cute.Tensor,
        sfb: cute.Tensor,
        ws: cute.Tensor | None,
        flags: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        self._launch(a, b, d, None, None, None, ws, flags, stream, (sfa, sfb))

    def _scale_boxes(self):
        """(rows, stage stride) of each stage's scales, A's then B's: a tile's rows and
        columns; with `b_tiled` B's box is `_B_TILE_WINDOW` 128 x 128 tiles (the tile's among
        them), each stage's at `constraints.b_tile_scale_stage_bytes` from the last (as the
        planner counts it)."""
        tm, tn, _ = self.tile_mnk
        if self.b_tiled:
            width = self.scale_dtype.width
            stride = constraints.b_tile_scale_stage_bytes(width) * 8 // width
            return (tm, tm), (_B_TILE_WINDOW, stride)
        return (tm, tm), (tn, tn)

    def _stage_extra_host(self, stage_extra):
        """TMA atoms for one k-block's scales of a tile's rows (A) and columns (B), and their
        stage rings in shared memory."""
        sfa, sfb = stage_extra
        params = []
        fields = {}
        for name, tensor, (rows, stride) in zip(("sfa", "sfb"), (sfa, sfb), self._scale_boxes(),
                                                strict=True):  # fmt: skip
            staged = cute.make_layout((rows, 1, self.ab_stages), stride=(1, stride, stride))
            atom, gmem = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), tensor, cute.slice_(staged, (None, None, 0)),
                (rows, 1),
            )  # fmt: skip
            params += [atom, gmem, staged]
            fields[f"s{name}"] = cute.struct.Align[
                cute.struct.MemRange[self.scale_dtype, cute.cosize(staged)], _SMEM_ALIGN
            ]
        return tuple(params), fields

    def _stage_extra_bytes(self) -> int:
        (rows_a, _), (rows_b, _) = self._scale_boxes()
        return (rows_a + rows_b) * self.scale_dtype.width // 8

    # ---------------------------------------------------------------- device

    def _stage_extra_smem(self, storage, extra_params):
        """(producer's TMA views, consumers' stage rings) of both scale operands."""
        tma_sfa, mSFA, sfa_staged, tma_sfb, mSFB, sfb_staged = extra_params
        (rows_a, _), (rows_b, _) = self._scale_boxes()
        out = []
        for atom, tensor, staged, buf, rows in (
            (tma_sfa, mSFA, sfa_staged, storage.ssfa, rows_a),
            (tma_sfb, mSFB, sfb_staged, storage.ssfb, rows_b),
        ):  # fmt: skip
            smem = buf.get_tensor(staged)
            # (rows, 1, tiles, k-blocks, L) tiles of the scales: one k-block of one tile each.
            gmem = cute.local_tile(tensor, (rows, 1), (None, None, None))
            s, g = cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2),
                cute.group_modes(gmem, 0, 2),
            )  # fmt: skip
            out.append((atom, g, s, smem))
        return tuple(out)

    def _produce_stage_extra(self, extra, tile, k, state, barrier):
        """k-block `k`'s scales of this tile's rows (A) and columns (B); with `b_tiled`, of the
        window of `_B_TILE_WINDOW` 128 x 128 tiles that holds this tile's columns."""
        box_b = tile[1]
        if cutlass.const_expr(self.b_tiled):
            box_b = self._b_scale_tile(tile) // _B_TILE_WINDOW
        for (atom, g, s, _), box in zip(extra, (tile[0], box_b), strict=True):
            cute.copy(atom, g[(None, box, k, tile[2])],
                      s[(None, state.index)], tma_bar_ptr=barrier)  # fmt: skip

    def _b_scale_tile(self, tile):
        """The 128 x 128 B scale tile that holds `tile`'s columns (`b_tiled`)."""
        return tile[1] // (self.b_scale_rows // self.tile_mnk[1])

    def _tile_extra(self, extra, tile):
        """With `b_tiled`, B's stage ring seen from `tile`'s scale tile within its window (so
        element (0, 0, stage) is the one the promotion reads); otherwise `extra`."""
        if cutlass.const_expr(not self.b_tiled):
            return extra
        atom, g, s, smem = extra[1]
        offset = self._b_scale_tile(tile) % _B_TILE_WINDOW
        return extra[0], (atom, g, s, cute.domain_offset((offset, 0, 0), smem))

    def _mainloop(self, ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks, n_k, read, release,
                  extra=None):  # fmt: skip
        """`n_k` >= 1 k-tiles, each a wgmma batch into a fresh fragment promoted into `acc`
        times the k-block's scales (module docstring), one batch at a time (a 256-row tile: one
        a wave, `_mainloop_waves`) or, with `plan.scaled_overlap`, each promotion under the next
        batch. Every stage but the last is
        released here; the caller releases the last (after its own `wait_group(0)`, a no-op
        here), as after the dense main loop. Returns the advanced (read, release) states."""
        loop = self._mainloop_overlap if self.overlap else self._mainloop_serial
        return loop(ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks, n_k, read, release, extra)

    @cute.jit
    def _mainloop_serial(self, ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks, n_k, read, release,
                         extra=None):  # fmt: skip
        """`_mainloop` with each batch waited for before its fragment is promoted."""
        sSFA, sSFB = extra[0][3], extra[1][3]
        tm, tn, _ = self.tile_mnk
        # This thread's (row, column) of the tile for each accumulator register.
        ctidx = cute.arch.thread_idx()[0] - _THREADS_PER_WG
        coords = tiled_mma.get_slice(ctidx).partition_C(cute.make_identity_tensor((tm, tn)))
        if cutlass.const_expr(tm > _WAVE_ROWS):
            return self._mainloop_waves(ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks, n_k,
                                        read, release, coords, sSFA, sSFB)  # fmt: skip
        frag = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
        row_scale = col_scale = None
        if cutlass.const_expr(tn <= _EARLY_SCALES_MAX_N):
            row_scale = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
            col_scale = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
        # Up to 128 columns the k-block's scales are read into registers before the batch
        # (their latency hides under it); wider tiles would spill them beside the two
        # fragments, so they are read during the promotion, from the stage (released after).
        early = tn <= _EARLY_SCALES_MAX_N
        acc.fill(0.0)
        for kt in range(n_k):
            common.wait_full(ab_pipe, read)
            if cutlass.const_expr(early):
                _read_scales(row_scale, col_scale, coords, sSFA, sSFB, read.index, self.b_tiled)
            tiled_mma = self._batch(tiled_mma, tCrA, tCrB, frag, k_blocks, read)
            warpgroup.wait_group(0)
            if cutlass.const_expr(early):
                if kt + 1 < n_k:
                    ab_pipe.consumer_release(release)
                    release.advance()
                _promote(acc, frag, row_scale, col_scale)
            else:
                _promote_from(acc, frag, coords, sSFA, sSFB, read.index, self.b_tiled)
                if kt + 1 < n_k:
                    ab_pipe.consumer_release(release)
                    release.advance()
            read.advance()
        return read, release

    @cute.jit
    def _mainloop_waves(self, ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks, n_k, read, release,
                        coords, sSFA, sSFB):  # fmt: skip
        """`_mainloop_serial` for 256-row tiles: each warp group's rows (64 in each 128-row
        wave of the tile, `_WAVE_ROWS`) run wave by wave through one 64-row fragment: per
        k-tile and wave, its wgmma batch issued and waited for, and promoted into that wave's
        main accumulators (`_waves_ktile`). The last k-tile is peeled off the loop, so that
        in the loop every stage is released without a branch (the caller releases the last).
        With `_STATIC_RINGS` the loop takes whole rings of stages at trace-time stage indices
        where it can (`_waves_ring`). `read` and `release` name the same stage on entry (both
        callers keep them so), and each k-tile releases the stage it read."""
        # One wave's fragment: the accumulators' shape with one 64-row block (V, 1, N).
        frag = cute.make_rmem_tensor((acc.shape[0], 1, acc.shape[2]), self.acc_dtype)
        row_scale = col_scale = None
        if cutlass.const_expr(self.b_tiled):
            row_scale = cute.make_rmem_tensor(frag.shape, self.acc_dtype)
            col_scale = cute.make_rmem_tensor(frag.shape, self.acc_dtype)
        regs = (frag, row_scale, col_scale, coords, sSFA, sSFB)
        acc.fill(0.0)
        landed = ab_pipe.consumer_try_wait(read)
        if cutlass.const_expr(_STATIC_RINGS and self.b_tiled):
            # Whole rings where the ring is at stage 0 and one fits before the last k-tile;
            # single k-tiles at run-time stage indices elsewhere.
            stages = read.stages
            left = n_k - 1
            while left > 0:
                if read.index == 0 and left >= stages:
                    tiled_mma, landed = self._waves_ring(ab_pipe, tiled_mma, tCrA, tCrB, acc,
                                                         k_blocks, read, landed, regs)  # fmt: skip
                    read.advance(stages)
                    release.advance(stages)
                    left -= stages
                else:
                    tiled_mma, landed = self._waves_ktile(ab_pipe, tiled_mma, tCrA, tCrB, acc,
                                                          k_blocks, read, release, landed, regs,
                                                          True)  # fmt: skip
                    read.advance()
                    release.advance()
                    left -= 1
        else:
            for _ in range(n_k - 1):
                tiled_mma, landed = self._waves_ktile(ab_pipe, tiled_mma, tCrA, tCrB, acc,
                                                      k_blocks, read, release, landed, regs,
                                                      True)  # fmt: skip
                read.advance()
                release.advance()
        tiled_mma, landed = self._waves_ktile(ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks,
                                              read, release, landed, regs, False)  # fmt: skip
        read.advance()
        return read, release

    @cute.jit
    def _waves_ring(self, ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks, read, landed, regs):
        """`_waves_ktile` (each releasing its stage) over stages 0 to the last, `read` being at
        stage 0: each k-tile's state is built with its stage index a constant and the ring's
        phase (`_STATIC_RINGS`), and releases the stage it read (the release state names the
        same stage as `read`: `_mainloop_waves`). Returns (`tiled_mma`, the poll of the stage
        after the ring); the caller advances `read` and the release state by a whole ring."""
        phase = read.phase
        for s in cutlass.range_constexpr(read.stages):
            stage = pipeline.PipelineState(read.stages, read.count + s, cutlass.Int32(s), phase)
            tiled_mma, landed = self._waves_ktile(ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks,
                                                  stage, stage, landed, regs, True)  # fmt: skip
        return tiled_mma, landed

    @cute.jit
    def _waves_ktile(self, ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks, read, release, landed,
                     regs, release_it: cutlass.Constexpr):  # fmt: skip
        """One k-tile of `_mainloop_waves`: waits for stage `read` (polled as `landed`), runs
        its waves and returns (`tiled_mma`, the poll of the stage after `read`). With
        `release_it` (every k-tile but a tile's last) it releases stage `release`; without, it
        polls nothing (the stage after a tile's last belongs to the next tile, or to none: that
        call polls it itself) and returns `landed`. The caller advances the states.

        B scaled per 128 x 128 tile: each wave's scales (two row scales, one B scale) are read
        into registers before its batch, and the stage is released after the last wave's wait.
        Per-row B scales (32 columns a thread would not fit the registers beside the
        fragments) are read during each promotion, and the stage released after the last
        wave's promotion. The next stage is polled as soon as the last wave's batch has
        retired, before that wave's promotion, so the poll's latency hides under the promotion
        (DeepGEMM's loop, whose k-iterations ptxas schedules together, polls there too); the
        next k-tile's wait only falls back to the blocking wait when the poll found the stage
        still empty."""
        frag, row_scale, col_scale, coords, sSFA, sSFB = regs
        waves = cute.size(acc, mode=[1])
        ab_pipe.consumer_wait(read, landed)
        stage = read.index
        nxt = None
        if cutlass.const_expr(release_it):
            nxt = read.clone()  # the stage the caller's advance of `read` names next
            nxt.advance()
        for w in cutlass.range_constexpr(waves):
            wave_coords = coords[(None, w, None)]
            if cutlass.const_expr(self.b_tiled):
                _read_scales(row_scale, col_scale, wave_coords, sSFA, sSFB, stage, True)
            tiled_mma = self._batch(tiled_mma, tCrA, tCrB, frag, k_blocks, read, w)
            warpgroup.wait_group(0)
            # The last wave of a k-tile that is not the tile's last: poll the next stage, and
            # release this one once nothing more reads it.
            hand_on = release_it and w == waves - 1
            if cutlass.const_expr(hand_on):
                landed = ab_pipe.consumer_try_wait(nxt)
            if cutlass.const_expr(self.b_tiled):
                if cutlass.const_expr(hand_on):
                    ab_pipe.consumer_release(release)
                _promote(acc[(None, w, None)], frag, row_scale, col_scale)
            else:
                _promote_from(acc[(None, w, None)], frag, wave_coords, sSFA, sSFB, stage, False)
                if cutlass.const_expr(hand_on):
                    ab_pipe.consumer_release(release)
        return tiled_mma, landed

    @cute.jit
    def _mainloop_overlap(self, ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks, n_k, read,
                          release, extra=None):  # fmt: skip
        """`_mainloop` with k-tile i's promotion under k-tile i + 1's wgmma batch.

        Two fragments take the batches in turn (k-tile 0 into `fa`, 1 into `fb`, 2 into `fa`,
        ...): k-tile i + 1's batch is issued, then `wait_group(1)` retires k-tile i's alone and
        its fragment is promoted while the tensor cores run the next batch; then its stage is
        released. The last k-tile's batch is drained with `wait_group(0)`. Registers are not
        indexable, so the loop takes two k-tiles per trip, one into each fragment, and the
        tail the odd one."""
        sSFA, sSFB = extra[0][3], extra[1][3]
        tm, tn, _ = self.tile_mnk
        ctidx = cute.arch.thread_idx()[0] - _THREADS_PER_WG
        coords = tiled_mma.get_slice(ctidx).partition_C(cute.make_identity_tensor((tm, tn)))
        fa = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
        fb = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
        scales = (coords, sSFA, sSFB, self.b_tiled)
        acc.fill(0.0)
        # k-tile 0 into fa; it stays in flight. `release` now names its stage, `read` the next.
        tiled_mma = self._issue(ab_pipe, tiled_mma, tCrA, tCrB, fa, k_blocks, read)
        read.advance()
        for _ in range((n_k - 1) // 2):
            tiled_mma = self._overlap_step(ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks, read,
                                           release, fb, fa, scales)  # fmt: skip
            read.advance()
            release.advance()
            tiled_mma = self._overlap_step(ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks, read,
                                           release, fa, fb, scales)  # fmt: skip
            read.advance()
            release.advance()
        if n_k % 2 == 0:
            # An even count: one more k-tile, into fb, then fb drains.
            tiled_mma = self._overlap_step(ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks, read,
                                           release, fb, fa, scales)  # fmt: skip
            read.advance()
            release.advance()
            warpgroup.wait_group(0)
            _promote_from(acc, fb, coords, sSFA, sSFB, release.index, self.b_tiled)
        else:
            warpgroup.wait_group(0)
            _promote_from(acc, fa, coords, sSFA, sSFB, release.index, self.b_tiled)
        return read, release

    @cute.jit
    def _issue(self, ab_pipe, tiled_mma, tCrA, tCrB, frag, k_blocks, read):
        """Waits for stage `read`, then issues its k-tile's wgmma batch into `frag` (the
        first instruction overwrites it) as one commit group. Returns `tiled_mma` (its
        accumulate field set here), for the caller's loop to carry."""
        common.wait_full(ab_pipe, read)
        return self._batch(tiled_mma, tCrA, tCrB, frag, k_blocks, read)

    @cute.jit
    def _batch(self, tiled_mma, tCrA, tCrB, frag, k_blocks, read, wave=None):
        """Issues the wgmma batch of stage `read` (landed) into `frag` (the first instruction
        overwrites it) as one commit group: the whole tile's rows, or with `wave` only that
        wave's of a 256-row tile (its A block given a unit M mode, for the (V, M) x (V, N)
        form of the product, into a one-wave `frag`). Returns `tiled_mma`, its accumulate
        field set."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(k_blocks):
            tiled_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
            crd = (None, None, kb, read.index)
            if cutlass.const_expr(wave is None):
                a = tCrA[crd]
            else:
                a = tCrA[(None, wave, kb, read.index)]
                a = cute.make_tensor(a.iterator, cute.append(a.layout, cute.make_layout(1)))
            cute.gemm(tiled_mma, frag, a, tCrB[crd], frag)
        warpgroup.commit_group()
        return tiled_mma

    @cute.jit
    def _overlap_step(self, ab_pipe, tiled_mma, tCrA, tCrB, acc, k_blocks, read, release, into,
                      done, scales):  # fmt: skip
        """One k-tile of the overlapped loop: the batch of stage `read` into `into`, then the
        promotion of `done` (the previous k-tile's, of stage `release`, released once its
        scales are read). The caller advances both states."""
        coords, sSFA, sSFB, b_tiled = scales
        tiled_mma = self._issue(ab_pipe, tiled_mma, tCrA, tCrB, into, k_blocks, read)
        warpgroup.wait_group(1)
        _promote_from(acc, done, coords, sSFA, sSFB, release.index, b_tiled)
        ab_pipe.consumer_release(release)
        return tiled_mma


# Plain Python over the registers (unrolled as the kernel is traced, one instruction each).


def _read_scales(row_scale, col_scale, coords, sSFA, sSFB, stage, b_tiled):
    """Each accumulator's row scale (A's) and column scale (B's) of k-block `stage`. Registers
    that share a row or column read the same word: the compiler loads each distinct word once
    (2 rows and tn / 4 columns per thread, as 16 pairs of columns; with `b_tiled`, B scaled per
    128 x 128 tile, one: element 0 of `sSFB`, the tile's own scale through `_tile_extra`'s
    view)."""
    for i in range(cute.size(coords)):
        row_scale[i] = sSFA[(coords[i][0], 0, stage)]
        col_scale[i] = sSFB[(0 if b_tiled else coords[i][1], 0, stage)]


def _promote(acc, frag, row_scale, col_scale):
    """acc += frag * (row scale * column scale): a multiply and a fused multiply-add each (the
    multiplies shared where the scales are: one per row with B scaled per 128 x 128 tile)."""
    for i in range(cute.size(acc)):
        acc[i] = acc[i] + frag[i] * (row_scale[i] * col_scale[i])


def _promote_from(acc, frag, coords, sSFA, sSFB, stage, b_tiled):
    """`_promote` with the scales read from stage `stage` as they are needed (each distinct
    word once), not held in registers beforehand."""
    for i in range(cute.size(acc)):
        col = 0 if b_tiled else coords[i][1]
        scale = sSFA[(coords[i][0], 0, stage)] * sSFB[(col, 0, stage)]
        acc[i] = acc[i] + frag[i] * scale
