"""The planner of block-scaled problems (`scaled_matmul`, `plan(..., scale_dtype=...)`).

sm_90a runs fp8 data with float32 scales per 128 of k on the block-scaled wgmma family
(kernels/sm90_scaled.py): each 128-wide k-block is accumulated by wgmma into a fresh float32
fragment, which the consumer warp group then adds into its main accumulators times the scales of
its rows and columns. Every other problem (other arches, data or scale formats) runs the
documented math in XLA ops (scaled.reference), with the reason in the plan.

The tile
--------
Cooperative, 128 rows: two consumer warp groups of 64 rows, each holding two 64 x N float32
fragments (the main accumulators and the k-block's: 2 x N / 2 registers per thread) within the
232 registers a consumer thread gets. 128 x 192 is the widest 128-row tile that fits (192
registers of fragments; the k-block's scales are then read during the promotion, not held
beforehand): the H200 ran it at 1.05-1.17x the TF/s of 128 x 128 (tenth
session, `benchmarks/scaled_probe.py`), whose fixed costs per k-tile (the stage wait, the
wgmma drain before each promotion) are spread over fewer MMAs. 128 x 256 would need 256
registers for the two fragments alone. The promotion (a multiply and a fused multiply-add per
accumulator and k-tile) is what separates this kernel from the unscaled fp8 one: with it
replaced by one add the same kernel ran 1.3x faster (1072 against 830 TF/s at 128 x 128,
4096x7168x16384), and with one FMA (a row scale only, as for weights scaled per 128 x 128
block) 1.25x. `GemmPlan.scaled_overlap` (JAX_SM100_SCALED_OVERLAP=1, `with_scaled_overlap`)
makes each warp group promote k-tile i under its own k-tile i + 1's wgmma: a third fragment,
so 128-row tiles of at most 128 columns; the H200 measured it from 10 % slower to 10 % faster
than the default loop at 128 x 128 depending on the run, never faster than the default at
128 x 192, and 1.07-1.09x the default at 128 x 64: the planner takes it for 128 x 64 tiles, and
for the 128 x 128 tiles of B scaled per 128 x 128 tile, whose one-FMA promotion it ran
1.01-1.05x faster (thirteenth session; JAX_SM100_SCALED_OVERLAP forces it either way).

256 x 128 tiles (`WAVE_TILES`): each warp group takes its 128 rows in two 64-row waves per
k-tile through one fragment, beside 128 registers of main accumulators (kernels/sm90_scaled.py;
DeepGEMM lays its 256-row tiles out so). Half the stage waits and TMA loads of B per MMA of
128-row tiles: the H200 ran them 1.10-1.15x the 128 x 128 tiles with B scaled per 128 x 128
tile and 1.03-1.05x the 128 x 192 tiles with per-row B scales, in 1x2 clusters (which multicast
A's tile, the larger). The wave model takes them wherever their waves are not much fuller.

Where 128 x 128 tiles leave most SMs idle (a few rows against many columns: 128 x 7168 is 56
tiles for 132 SMs), 128 x 64 tiles double the CTAs at the same k-loop (the wave model of the
package docstring picks; their efficiency is a guess until measured: each k-tile's
shared-memory reads per MMA flop are 4/3 of a 128 x 128 tile's).

There is no small-problem rule (the dense planner's `SM90_MIN_FLOPS`): the alternative is not
cuBLAS but the dequantized float32 product in XLA ops, slower at every size.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

from jax_sm100._src import constraints as C
from jax_sm100._src.planning.gemm_plan import (
    DEFAULT_NUM_SMS,
    KERNEL_SM90_SCALED,
    KERNEL_XLA,
    GemmPlan,
    GemmProblem,
    _wave_cost,
    mma_operand_dtype,
)
from jax_sm100._src.planning.sm90 import (
    _fill_sm90_smem,
    _sm90_stream_k,
    _sm90_swizzle,
    _swizzled_extent,
    _unpadded_cluster,
    sm90_variant,
)

# (tile_m, tile_n, efficiency) for the wave model (`_wave_cost`). 128 x 192 ran 1.05-1.17x the
# TF/s of 128 x 128 at 4096x7168x16384 and 1.07x at 8192^3 (H200, tenth session,
# benchmarks/scaled_probe.py; RESULTS.md): its k-tile's fixed costs (barrier waits, the
# wgmma drain before each promotion) spread over 1.5x the MMAs.
SCALED_TILES = ((128, 192, 1.1), (128, 128, 1.0), (128, 64, 0.8))
# 256 x 128 tiles (each warp group's 128 rows in two 64-row waves, on the serial loop). The
# H200 (sixteenth session, `scaled_probe.py`; RESULTS.md) ran them, edits of the planner's
# previous plans in the same process: with B scaled per 128 x 128 tile 1.11-1.12x its 128 x 128
# tiles (overlapped) at 4096x7168x16384 (1085-1096 against 976-981 TF/s) and 1.10-1.15x at
# 8192^3 (1042-1083 against 943-945); with per-row B scales 1.05x its 128 x 192 tiles at
# 4096x7168x16384 (893 against 847-853) and 1.03-1.05x at 8192^3 (857 against 820-833). 2x1
# clusters ran 0.96-0.98x 1x2's. `bench --scaled` (the planners' own plans, a session apart):
# 1.10-1.12x per tile, 1.03-1.06x per row.
WAVE_TILES = ((256, 128, 1.14),)


def plan_scaled(problem: GemmProblem, arch: str, num_sms: int | None = None) -> GemmPlan:
    """The plan of a block-scaled `problem` (`sm100_blockscaled.scaled_problem`, which checked
    it) for `arch` other than sm_100a: the block-scaled wgmma kernel's where it takes the
    problem, else XLA's ops, the reason saying why.

    Raises:
      PlanError: an unknown arch, or a scale format no block-scaled problem has.
    """
    C.check_arch(arch)
    C.check_scaled(arch, False, True, problem.scale_dtype, problem.scale_block, 128, False, 1,
                   False, False)  # fmt: skip
    return _plan_scaled(problem, arch, num_sms or 0, overlap_requested())


# The kernel's outputs (bfloat16, float16, float32) all passed tests/test_gpu_scaled.py on the
# H200 (tenth session: 200 cases, both main loops). float32's first run (ninth session) had
# missed float32's own tolerance by 2-8x: that is the fp8 wgmma's accumulator, not the epilogue
# (Hopper sums each k32 fp8 wgmma in 13 mantissa bits, truncating: the DeepSeek-V3 report,
# 3.5.2; benchmarks/scaled_accuracy.py emulates it), so the tests check float32 results of fp8
# products to that accuracy, and exactly on integer data.


# JAX_SM100_SCALED_OVERLAP in the environment: "1" puts the planner's kernel plans on the
# overlapped main loop (`GemmPlan.scaled_overlap`, kernels/sm90_scaled.py; tiles of at most 128
# columns), "0" on the default one; unset, the planner overlaps 128 x 64 tiles, and the 128 x 128
# tiles of B scaled per 128 x 128 tile. On the H200 (tenth session; `python -m jax_sm100.bench
# --scaled --overlap both`) the overlapped loop ran 128 x 64 tiles (128x7168x16384) 1.07-1.09x
# faster in both runs that timed it, and 128 x 128 tiles of per-row scales from 0.9x to 1.1x by
# run, never faster than the default loop's 128 x 192 tiles (thirteenth session: 0.99-1.0x
# again). With B scaled per tile the promotion is one FMA per accumulator and its scales three
# words, so the overlap's extra fragment costs little: 1.01x at 4096x7168x16384 (996 against 982
# TF/s) and 1.05x at 8192^3 (946 against 902), thirteenth session, `scaled_probe.py` kind `tiled`
# with JAX_SM100_SCALED_OVERLAP=1 and unset, one run each.
OVERLAP_ENV = "JAX_SM100_SCALED_OVERLAP"
# How a plan's reason says its promotion is overlapped (always its last part).
_OVERLAP_NOTE = "; each k-tile promoted while the next one's wgmma runs"
# How a plan's reason says it runs stream-K.
_STREAM_K_NOTE = "; stream-K over the last waves (they do not divide evenly)"
# How a plan's reason says its tile is taken in waves (256-row tiles).
_WAVES_NOTE = "; each warp group's 128 rows in two 64-row waves (measured faster)"
# The widest tile the planner overlaps unless told, for per-row B scales (B scaled per 128 x 128
# tile: up to constraints.SCALED_OVERLAP_MAX_TILE_N).
OVERLAP_DEFAULT_MAX_TILE_N = 64


def overlap_requested() -> bool | None:
    """True when JAX_SM100_SCALED_OVERLAP=1, False when it is 0; None (the planner's choice)
    when it is unset or empty.

    Raises:
      PlanError: any other value.
    """
    value = os.environ.get(OVERLAP_ENV, "")
    if value not in ("", "0", "1"):
        raise C.PlanError(
            f"{OVERLAP_ENV}={value!r} must be '1' (on), '0' (off) or unset (the planner's choice)"
        )
    return None if value == "" else value == "1"


def with_scaled_overlap(plan: GemmPlan, overlap: bool = True) -> GemmPlan:
    """`plan` (the sm_90a block-scaled kernel's) with its consumers' k-tile promotion
    overlapped with the next k-tile's wgmma batch (`overlap=True`), or not; for tuning and
    tests (`scaled_matmul` takes no plan: its calls ask the planner with
    JAX_SM100_SCALED_OVERLAP=1). The schedule stays, and the tile unless it is larger than the
    overlap's registers hold (128 rows of `constraints.SCALED_OVERLAP_MAX_TILE_N` columns,
    three fragments of 64 x N a consumer thread): a larger one (the planner's 128 x 192 or
    256 x 128) becomes 128 x 128, its stages refilled (`sm90_variant`).

    Raises:
      PlanError: a plan of another kernel.
    """
    if plan.kernel != KERNEL_SM90_SCALED and overlap:
        raise C.PlanError(
            f"with_scaled_overlap takes a plan of the {KERNEL_SM90_SCALED!r} kernel; this one is "
            f"{plan.kernel!r} ({plan.reason})"
        )
    tm, tn, _ = plan.cta_tile_mnk
    reason = plan.reason.split(_OVERLAP_NOTE)[0]  # the note, when there is one, comes last
    if overlap and (tn > C.SCALED_OVERLAP_MAX_TILE_N or tm > 128):
        # The narrower tile's grid is rescheduled as the planner would (cluster, stream-K,
        # swizzle), so the plan is the one JAX_SM100_SCALED_OVERLAP=1 plans.
        rows, cols = 128, min(tn, C.SCALED_OVERLAP_MAX_TILE_N)
        sms = plan.num_sms or DEFAULT_NUM_SMS[plan.arch]
        cluster, stream_k, swizzle = _schedule(plan.m, plan.n, plan.batch, rows, cols, sms)
        plan = sm90_variant(plan, tile_mn=(rows, cols), cluster_mn=cluster, stream_k=stream_k,
                            swizzle_size=swizzle)  # fmt: skip
        reason = reason.replace(
            f"{tm}x{tn} cooperative tile",
            f"{rows}x{cols} cooperative tile (narrowed from {tm}x{tn})",
        )
        reason = reason.replace(_WAVES_NOTE, "").replace(_STREAM_K_NOTE, "")
        reason += _STREAM_K_NOTE if stream_k else ""
    if overlap:
        reason += _OVERLAP_NOTE + " (with_scaled_overlap)"
    return dataclasses.replace(plan, scaled_overlap=bool(overlap), reason=reason)


def _schedule(m, n, batch, tm, tn, sms):
    """(cluster, stream-K, raster swizzle) of a tm x tn tile grid on `sms` SMs."""
    tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
    # Pair CTAs along the longer side of the tile grid, multicasting the operand the pair
    # shares (the dense planner's rule, planning/sm90.py `_choose_sm90`); 256-row tiles along
    # N, multicasting A's tile, twice B's (1x2 clusters ran 1.02-1.04x 2x1's: `WAVE_TILES`).
    if tm > 128 and tiles_n >= 2:
        cluster = (1, 2)
    elif tiles_m >= 2 and tiles_m >= tiles_n:
        cluster = (2, 1)
    else:
        cluster = (1, 2) if tiles_n >= 2 else (1, 1)
    cluster = _unpadded_cluster(m, n, tm, tn, cluster)  # no pair over an odd tile count
    # Stream-K over the last waves where they leave clusters idle (the dense planner's rule,
    # `_sm90_stream_k`: 8192^3 is 15.5 waves of 256 x 128 tiles on 132 SMs).
    stream_k = _sm90_stream_k(m, n, batch, tm, tn, cluster, sms)
    return cluster, stream_k, _scaled_swizzle(m, n, batch, tm, tn, cluster)


# The fewest tile rows for which 256-row tiles take the banded raster (`_scaled_swizzle`).
SCALED_SWIZZLE_MIN_TILE_ROWS = 32


def _scaled_swizzle(m, n, batch, tm, tn, cluster):
    """Raster swizzle of a block-scaled grid: 256-row tiles in bands of 8 cluster columns
    wherever 8 divides the cluster columns (no padded clusters, as `_sm90_swizzle`) and the
    grid has at least `SCALED_SWIZZLE_MIN_TILE_ROWS` tile rows; 128-row tiles by the dense rule.

    Rastered along M unbanded, the 66 clusters in flight span every tile row of about two
    cluster columns, so a grid of many tile rows keeps all of A in flight: at 8192^3 Nsight
    Compute counted 1,186 MB read from HBM for 128 MB of operands (L2 hit rate 60 %), where
    DeepGEMM's order (bands of 16 tile columns, as 8 of our 1x2 clusters) read 612 MB (77 %).
    The dense rule bands only grids twice as tall as wide. H200, 2026-12-02, `scaled_probe.py`,
    B scaled per 128 x 128 tile, two pairs each (TF/s, unbanded / banded): 8192^3 1156-1170 /
    1188-1190, 16384x8192x4096 1077-1082 / 1160-1163, 8192x4096x8192 1145-1146 / 1153-1158;
    with 16 tile rows, where the unbanded raster already spans only 16 rows: 4096x4096x16384
    1179-1185 / 1179-1195, 4096x8192x8192 1162-1172 / 1140-1155. Bands of 4 (where 8 does not
    divide the 28 cluster columns of 7168) ran 0.9-1.3 % slower at 16384x7168x2048 and
    8192x7168x4096. The banded plans also take the deeper store ring of swizzled plans
    (`_fill_sm90_smem`), so the figures are of both changes together, as the planner plans them.
    """
    if tm <= 128:
        return _sm90_swizzle(m, n, batch, tm, tn, cluster)
    cols = _swizzled_extent(m, n, (tm, tn), cluster, along_m=True)
    return 8 if cols % 8 == 0 and math.ceil(m / tm) >= SCALED_SWIZZLE_MIN_TILE_ROWS else 1


@functools.lru_cache(maxsize=1024)
def _plan_scaled(problem: GemmProblem, arch: str, num_sms: int,
                 overlap: bool | None = None) -> GemmPlan:  # fmt: skip
    common = dataclasses.asdict(problem) | dict(arch=arch, num_sms=num_sms)
    m, n, k, batch = problem.m, problem.n, problem.k, problem.batch
    why_not = C.kernel_support(
        arch, m, n, k, problem.a_dtype, problem.b_dtype, problem.out_dtype, None,
        problem.a_major, problem.b_major, batch,
    ) or C.scaled_support(
        arch, k, problem.a_dtype, problem.b_dtype, problem.scale_dtype, problem.scale_block
    )  # fmt: skip
    ktile = 1024 // C.OPERAND_BITS[mma_operand_dtype(arch, problem.a_dtype, problem.b_dtype)]
    tm, tn = SCALED_TILES[0][:2]
    if why_not is not None:
        # XLA runs it; the tile fields are placeholders that hold on either arch.
        return GemmPlan(
            **common, kernel=KERNEL_XLA, reason=why_not, mma_tiler_mnk=(tm, 256, ktile),
            cluster_shape_mn=(1, 1), use_2cta=False, num_ab_stages=C.MIN_AB_STAGES,
            num_acc_stages=1,
        )  # fmt: skip
    tiled = problem.b_scale_rows > 1
    costs = [
        (_wave_cost(math.ceil(m / tm) * math.ceil(n / tn) * batch, 1, num_sms or
                    DEFAULT_NUM_SMS[arch], tm * tn, eff), tm, tn)
        for tm, tn, eff in SCALED_TILES + WAVE_TILES
        # The overlapped loop's registers hold 128-row tiles of 128 columns; B scaled per
        # 128 x 128 tile takes tiles within one scale tile (one FMA per accumulator in the
        # promotion).
        if not (overlap and (tn > C.SCALED_OVERLAP_MAX_TILE_N or tm > 128))
        and not (tiled and problem.b_scale_rows % tn)
    ]  # fmt: skip
    _, tm, tn = min(costs)
    asked = overlap is not None
    if not asked:
        overlap = tm == 128 and (tn <= OVERLAP_DEFAULT_MAX_TILE_N or
                                 (tiled and tn <= C.SCALED_OVERLAP_MAX_TILE_N))  # fmt: skip
    cluster, stream_k, swizzle = _schedule(m, n, batch, tm, tn, num_sms or DEFAULT_NUM_SMS[arch])
    reason = (
        f"block-scaled wgmma {tm}x{tn} cooperative tile: each 128-k block accumulated apart and "
        f"promoted times its {problem.scale_dtype} scales"
    )
    if tiled:
        reason += f" (B's per {problem.b_scale_rows} x 128 tile: one FMA per accumulator)"
    if tm > 128:
        reason += _WAVES_NOTE
    if stream_k:
        reason += _STREAM_K_NOTE
    if overlap:
        reason += _OVERLAP_NOTE + (
            f" ({OVERLAP_ENV}=1)" if asked
            else f" (tiles of {tn} columns: measured faster)" if tn <= OVERLAP_DEFAULT_MAX_TILE_N
            else " (B scaled per tile: measured faster)"
        )  # fmt: skip
    plan = GemmPlan(
        **common,
        kernel=KERNEL_SM90_SCALED,
        reason=reason,
        mma_tiler_mnk=(tm, tn, ktile),
        cluster_shape_mn=cluster,
        use_2cta=False,
        num_ab_stages=C.MIN_AB_STAGES,
        num_acc_stages=1,
        swizzle_size=swizzle,
        stream_k=stream_k,
        scaled_overlap=overlap,
    )
    # A/B stages (each with its scales) as many as fit, then the store ring.
    return _fill_sm90_smem(plan)
