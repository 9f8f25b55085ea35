"""The SM90 (wgmma) planner: tile, cluster, ping-pong or cooperative schedule, split-K,
stream-K, raster and swizzle, A/B and store stages; and the edits that keep an SM90 plan
consistent (`sm90_variant`, `with_split`). The measurements behind each rule are beside it."""

from __future__ import annotations

import dataclasses
import math

from jax_sm100._src import constraints as C
from jax_sm100._src.planning.gemm_plan import (
    KERNEL_SM90,
    KERNEL_SM90_GROUPED,
    KERNEL_SM90_SPLITK,
    KERNEL_XLA,
    GemmPlan,
    _wave_cost,
    grouped_raster_along_m,
    grouped_support,
    grouped_work_tiles,
    smem_capacity,
)

_SM90_CANDIDATES = (
    # (tile_m, tile_n, efficiency), cooperative. 256x128 and a cooperative 128x160 run
    # correctly on the H200 but were not faster than 128x256 there (benchmarks/RESULTS.md,
    # third session): plan options only.
    (128, 256, 1.00),
    (128, 128, 0.85),
    (64, 256, 0.72),
    (64, 128, 0.62),
)
# Ping-pong tiles (one warp group per tile, so its epilogue hides under the other group's main
# loop), walked along N in bands of 8 cluster rows (wide 8-bit grids along M, `_wide_8bit`).
# H200, device method, sixth session (benchmarks/RESULTS.md): 128x160 / 128x192 ping-pong with
# clusters of 2x1 beat the best cooperative 128x256 plan by 1-4 % at 16384x4096x4096, 8192^3 and
# 4096x14336x4096, the one of the two that wastes the least last wave winning each time; the
# efficiency below puts that per-tile gain into the wave model. Taken for many waves of 16-bit
# tiles (measured there), and of short-k 8-bit tiles (below).
_SM90_PINGPONG_CANDIDATES = (
    (128, 160, 1.03),
    (128, 192, 1.03),
)
SM90_PINGPONG_MIN_WAVES = 8
# 8-bit operands run a k-tile in half the time of 16-bit ones, so at short k a cooperative
# tile's epilogue (not hidden) weighs twice as much. H200, fifteenth session, e4m3 with a
# bfloat16 result, device method (benchmarks/RESULTS.md), unswizzled 128x192 ping-pong (2x1,
# along N, 2 store stages) against the cooperative 128x256 plan in the same call: 1.07x at
# 16384x4096x4096, 1.10x at 8192x8192x4096, 1.20x at 16384x8192x2048; at 4096x14336x4096
# (a worse last wave) 0.99x, and 1.08x in another call swizzled, as the planner plans it; at
# 8192^3 0.90x and 0.96x, so only up to `SM90_PINGPONG_8BIT_MAX_KTILES` k-tiles. 128x160 ran
# 3-8 % behind 128x192 at the three short-k shapes where ping-pong wins. The same plan read up
# to 5 % apart between calls, more than some of the same-call differences here.
_SM90_PINGPONG_CANDIDATES_8BIT = (
    (128, 160, 1.03),
    (128, 192, 1.08),
    (128, 176, 1.08),  # after 128x192, which keeps a tie
)
# 176-column tiles, for 8-bit operands: cuBLAS's width on the H200 at 4096x7168x16384
# (`nvjet_sm90_qqtst_176x128_..`, twenty-fourth session), where 41 columns of them times 32
# rows of 128 fill 9.9 waves of 132 SMs. H200, twenty-fifth session, e4m3 -> bfloat16, device
# method (`scaled_probe.py`), two calls: 4096x7168x16384 cooperative 256x176 in 2x1 clusters
# (4.97 waves) 1365.7 / 1349.1 TF/s against 1308.9 / 1336.4 for the 128x256 plan (6.8 waves)
# and cuBLAS fp8 1310.0 / 1348.2; at 8192^3 (11.4 waves against 15.5) 1247.7 against 1294.8,
# which the wave model predicts. 128x176 cooperative read 1283-1285 there (not taken). Ping-pong
# 128x176 at 4096x14336x4096 (19.9 waves against 18.2 of 128x192) 1351.1 against 1290.1,
# cuBLAS 1366.0. Only 8-bit operands were measured, so 16-bit plans do not take them. A third
# call, planner (256x176 or ping-pong 128x176) against the plan before, two readings each:
# 5120x5120x8192 1206-1236 / 1185, 14336x1408x8192 1118-1150 / 976 (128x128), 32768x1408x8192
# 1247-1256 / 1172, 7168x7168x4096 1259-1275 / 1251, 6144x6144x4096 1283-1288 / 1283; but
# 3072x3072x8192, 1.6 waves of 256x176, 1094-1110 against 1135 for 128x128 (4.4 waves): the
# cooperative 256x176 tile competes from `SM90_256X176_MIN_WAVES` waves of it on.
_SM90_CANDIDATES_8BIT = ((256, 176, 1.00),)
SM90_256X176_MIN_WAVES = 3
SM90_PINGPONG_8BIT_MAX_KTILES = 32
# With 8-bit operands the 2-deep store ring, leaving a fifth A/B stage at 128x192, ran 1-7 %
# faster than the 4-deep one at those three shapes (any C or pre-activation staged too).
SM90_PINGPONG_8BIT_EPI_STAGES = 2


def sm90_variant(plan: GemmPlan, *, tile_mn=None, cluster_mn=None, pingpong=None, **changes):
    """`plan` with another SM90 tile, cluster or schedule, its A/B stages refilled to the SMEM left.

    For tuning and tests: `dataclasses.replace` keeps `num_ab_stages`, which is rarely right for
    another tile. Other plan fields (swizzle_size, raster_along_m, ...) pass through `changes`;
    `num_epi_stages` given there is kept and the A/B ring filled beside it; `num_ab_stages`
    given there replaces the filled depth (one that does not fit raises PlanError).
    Asking for ping-pong, or clusters of more than 2 CTAs, turns stream-K off unless `stream_k`
    is given. A new tile or cluster keeps the plan's swizzle only where it still divides the
    cluster columns (rows for a raster along N; see `_sm90_swizzle`), unless `swizzle_size` is
    given.
    Raises PlanError for an illegal combination, like any plan edit.
    """
    if plan.arch != "sm_90a":
        raise C.PlanError(f"sm90_variant takes an sm_90a plan, got {plan.arch}")
    tm, tn = tile_mn or plan.cta_tile_mnk[:2]
    epi_stages = changes.pop("num_epi_stages", None)
    ab_stages = changes.pop("num_ab_stages", None)
    cluster = tuple(cluster_mn or plan.cluster_shape_mn)
    if pingpong or cluster[0] * cluster[1] > 2:
        changes.setdefault("stream_k", False)
    along_m = changes.get("raster_along_m", plan.raster_along_m)
    swapped = changes.get("swap_ab", plan.swap_ab)
    mn = (plan.n, plan.m) if swapped else (plan.m, plan.n)
    if _swizzled_extent(*mn, (tm, tn), cluster, along_m) % plan.swizzle_size:
        changes.setdefault("swizzle_size", 1)
    edited = dataclasses.replace(
        plan,
        mma_tiler_mnk=(tm, tn, plan.mma_tiler_mnk[2]),
        cluster_shape_mn=cluster,
        pingpong=plan.pingpong if pingpong is None else bool(pingpong),
        num_ab_stages=C.MIN_AB_STAGES,
        **changes,
    )
    # The edited plan has derived its epilogue and stage sizes; fill the SMEM that is left.
    filled = _fill_sm90_smem(edited, epi_stages)
    if ab_stages is None:
        return filled
    return dataclasses.replace(filled, num_ab_stages=ab_stages)  # checked as any plan edit


def _fill_sm90_smem(plan: GemmPlan, epi_stages: int | None = None) -> GemmPlan:
    """`plan` with its shared memory refilled: with `epi_stages` given, that epilogue depth and
    as many A/B stages as fit beside it; else as many A/B stages as fit beside a 2-deep epilogue
    ring, then, for a swizzled raster, the epilogue ring deepened with what is left (up to
    `SM90_MAX_EPI_STAGES`)."""
    free = smem_capacity(plan.arch) - C.SMEM_RESERVED_BYTES
    base = dataclasses.replace(plan, num_epi_stages=epi_stages or 2, num_ab_stages=C.MIN_AB_STAGES)
    stages = (free - base._epi_bytes) // base.ab_stage_bytes
    depth = base.num_epi_stages
    in_cluster = plan.split_k > 1 and plan.split_reduce == "cluster"
    if epi_stages is None and plan.swizzle_size > 1 and not in_cluster:
        # (An in-cluster split stages its whole partial tile, whatever the depth.)
        left = free - base._epi_bytes - stages * base.ab_stage_bytes
        depth = min(SM90_MAX_EPI_STAGES, depth + left // (base._epi_bytes // depth))
    return dataclasses.replace(base, num_ab_stages=stages, num_epi_stages=depth)


def _choose_sm90(m, n, k, batch, num_sms, pingpong_ok=False, ab_bits=16):
    """(tile_m, tile_n, cluster, pingpong): the tile with the fewest weighted waves; ping-pong
    tiles compete only with `pingpong_ok` and when 128x256 tiles fill at least
    `SM90_PINGPONG_MIN_WAVES` waves (with the 8-bit efficiencies for `ab_bits` 8, and 64x256
    in place of 128x192 for a very tall 8-bit grid, `_very_tall_8bit`: the plan where it
    cannot run swapped, `_sm90_swapped_plan`). 8-bit operands also weigh the cooperative
    256x176 tile (from `SM90_256X176_MIN_WAVES` waves of it) and ping-pong 128x176, except
    where ping-pong tiles compete in a very tall grid (it runs swapped, or in 64x256 or 128x192
    tiles, as measured: 256x176 took 4 x 8200 x 1032 x 1024 from the swapped plan by a 1 %
    weight, on no measurement)."""

    def tiles(tm, tn):
        return math.ceil(m / tm) * math.ceil(n / tn) * batch

    candidates = [(tm, tn, False, eff) for tm, tn, eff in _SM90_CANDIDATES]
    pp_ok = pingpong_ok and tiles(128, 256) >= SM90_PINGPONG_MIN_WAVES * num_sms
    tall = ab_bits == 8 and _very_tall_8bit(m, n)
    if ab_bits == 8 and not (pp_ok and tall):
        candidates += [(tm, tn, False, eff) for tm, tn, eff in _SM90_CANDIDATES_8BIT
                       if tiles(tm, tn) >= SM90_256X176_MIN_WAVES * num_sms]  # fmt: skip
    if pp_ok:
        pp = _SM90_PINGPONG_CANDIDATES_8BIT if ab_bits == 8 else _SM90_PINGPONG_CANDIDATES
        candidates += [(tm, tn, True, eff) for tm, tn, eff in pp if not (tall and tn == 176)]
    best = None
    for tm, tn, pingpong, eff in candidates:
        cost = _wave_cost(tiles(tm, tn), 1, num_sms, tm * tn, eff)
        if m < tm:
            cost *= tm / m  # rows of padding still cost MMA time
        if best is None or cost < best[0] - 1e-9:
            best = (cost, tm, tn, pingpong)
    _, tm, tn, pingpong = best
    if pingpong and tn == 192 and tall:
        if math.ceil(n / 256) * 256 <= math.ceil(n / tn) * tn:
            # Very tall 8-bit grids: 64x256 ping-pong tiles, where they pad N no more (H200,
            # fifteenth session, against 128x192 in the same call: 16384x4096x4096 1311 / 1287
            # and 1291 / 1280 TF/s, 32768x4096x2048 1283 / 1252, 32768x2048x4096 1269 / 1263;
            # at 8192x8192x4096, not tall, 1228 / 1318).
            tm, tn = 64, 256
    if pingpong:
        # Measured best with CTAs paired along M (B multicast) in all three sweeps but one.
        return tm, tn, (2, 1), True
    return tm, tn, _paired_cluster(math.ceil(m / tm), math.ceil(n / tn)), False


def _paired_cluster(tiles_m: int, tiles_n: int) -> tuple[int, int]:
    """The cooperative plans' cluster: CTAs paired along the longer side of the tile grid, so
    that the operand more CTAs share is multicast."""
    cluster = (2, 1) if tiles_m >= 2 and tiles_m >= tiles_n else (1, 2) if tiles_n >= 2 else (1, 1)
    if tiles_n >= 2 and tiles_m >= 4 * tiles_n:
        # Very tall grids: A (m x k) is the big operand that does not stay in L2; pairing CTAs
        # along N multicasts it. Three H200 sweeps of 16384x4096x4096 (benchmarks/RESULTS.md)
        # put 1x2 ahead of 2x1 by 3-4% each time (0.96-1.0x against 0.95-0.96x jnp.dot).
        cluster = (1, 2)
    return cluster


def _very_tall_8bit(m, n) -> bool:
    """Whether an 8-bit ping-pong grid is very tall: at least 4x as many 128-row tiles as
    192-column ones (16384x4096 is; 16384x8192 and 8192x8192 are not)."""
    return math.ceil(m / 128) >= 4 * math.ceil(n / 192)


def _unpadded_cluster(m, n, tm, tn, cluster, batch=1, num_sms=0):
    """`cluster`, or the other pairing, or none: the first that adds at most CLUSTER_PAD_MAX
    of a tiles_m x tiles_n grid. The DSL's scheduler runs whole clusters, so a pair over an odd
    tile count adds a CTA that runs its main loop on zero-filled tiles outside the matrix
    (n = 768 in 256-column tiles: 4 CTA columns for 3, a third more work). With `num_sms`, the
    other pairing also replaces `cluster` where `cluster`'s padding alone adds more than
    CLUSTER_PAD_MAX of its waves of `num_sms` CTAs (4096x7168 in 256x176 tiles: 16 x 41, 5
    waves in 2x1 clusters, 6 in 1x2; H200, twenty-fifth session, e4m3, 1365.7 against 1208.8
    TF/s at k = 16384); one wave in many is less than the 3-4 % a pairing was measured to be
    worth (the very tall grids' 1x2 in `_choose_sm90`). For cooperative plans; ping-pong plans
    keep the 2x1 clusters they were measured with (they need 8 waves, so an odd row count pads
    at most a few percent)."""
    tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
    allowed = [c for c in (cluster, cluster[::-1])
               if _cluster_pad(tiles_m, tiles_n, c) <= CLUSTER_PAD_MAX]  # fmt: skip
    if not allowed:
        return (1, 1)
    if num_sms and len(allowed) == 2:
        grids = (_cluster_grid(tiles_m, tiles_n, c, batch, num_sms) for c in allowed)
        first, other = (math.ceil(work / clusters) for work, clusters in grids)
        if first - other > CLUSTER_PAD_MAX * first:
            return allowed[1]
    return allowed[0]


# The share of extra (zero-filled) CTA tiles a cluster shape may add to the grid.
CLUSTER_PAD_MAX = 1 / 16


def _cluster_pad(tiles_m: int, tiles_n: int, cluster) -> float:
    """The CTA tiles `cluster` adds to a tiles_m x tiles_n grid, as a share of the grid."""
    cm, cn = cluster
    if (cm > 1 and tiles_m < 2) or (cn > 1 and tiles_n < 2):
        return math.inf  # a cluster along a single tile shares nothing
    return _padded_ctas(tiles_m, tiles_n, cluster) / (tiles_m * tiles_n) - 1


def _padded_ctas(tiles_m: int, tiles_n: int, cluster) -> int:
    """The CTA tiles a grid of whole `cluster`s over tiles_m x tiles_n runs."""
    cm, cn = cluster
    return math.ceil(tiles_m / cm) * cm * math.ceil(tiles_n / cn) * cn


def _cluster_grid(tiles_m: int, tiles_n: int, cluster, batch: int, num_sms: int):
    """(cluster work tiles over the batch, persistent clusters on `num_sms` SMs)."""
    size = cluster[0] * cluster[1]
    return _padded_ctas(tiles_m, tiles_n, cluster) // size * batch, max(1, num_sms // size)


def _split_k(m, n, k, batch, tm, tn, ktile, num_sms, cluster, min_k=None) -> int:
    """Split factor for problems whose output tiles leave most SMs idle: skinny ones (m <= 256),
    and wider ones of few tiles over a long k (`_splits_wide`: `SPLIT_K_MIN_K_WIDE` of k a split
    or more; the planner then re-tiles them, `_wide_split`). `min_k`, given for a re-tiled
    split, skinny or wide, is the k each split keeps at least.
    At 512x512x65536 fp8 (32 tiles of 64 x 128) the H100 ran the unsplit plan at 0.45x cuBLAS,
    split 4 ways at 0.87x (sixty-fifth session, benchmarks/scaled_probe.py `fp8:sp4`); split,
    fp8's accumulation also runs over a part of k in the tensor core before float32 partials
    add, as cuBLAS's split plan does (max error 5.3e-3 of the largest |ref| 4 ways, against
    2.1e-2 unsplit and cuBLAS's 3.1e-3). A training step of small layers over many tokens,
    whose weight gradients split so, ran 1.03-1.05x `jnp.dot` against 0.82-0.95x without, and
    1.08-1.09x re-tiled (sixty-sixth session)."""
    tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
    tiles = tiles_m * tiles_n * batch
    wide_ok = m <= 256 or _splits_wide(m, n, k, batch, tiles_m, tiles_n, cluster)
    if tiles * 2 > num_sms or not wide_ok:
        return 1
    k_tiles = math.ceil(k / ktile)
    # Keep at least 4 k-tiles per split so each CTA still pipelines; wider problems split only
    # where each split keeps a long k (measured there), and re-tiled ones `min_k`.
    if min_k:
        least = min_k // ktile
    else:
        least = 4 if m <= 256 else SPLIT_K_MIN_K_WIDE // ktile
    split = 1
    while tiles * split * 2 <= num_sms and k_tiles // (split * 2) >= least:
        split *= 2
    return split


# The k each split keeps where m > 256, in the planner's tile: which wide problems split (the
# 512x512x65536 fp8 measurement kept 16384; sixty-fifth session).
SPLIT_K_MIN_K_WIDE = 8192

# Split plans re-tiled (`_wide_split`): their tile, and the k each split keeps in it.
# H100, sixty-sixth session (device method, B K-major, x cuBLAS in one process): bfloat16
# 512x512x65536 128x128 split 8 0.891 against the planner's 64x128 split 4 0.785 (128x256
# split 16 0.888); 1024x512x32768 128x128 split 4 0.913 against 64x128 split 2 0.704;
# 768x512x16384 128x128 split 4 0.950 against 64x128 split 2 0.850; fp8 768x512x16384 0.973
# against 0.869; fp8 512x512x16384 128x128 split 8 (2048 of k a split) 0.937, split 4 0.890,
# against 64x128 split 2 0.904. In each the fastest plan filled about one wave.
SPLIT_WIDE_TILE = (128, 128)
SPLIT_WIDE_MIN_K = 2048
# The k each split of a re-tiled skinny problem (m <= 256) keeps: the least measured (H100,
# sixty-seventh session: 4096 at bfloat16 and fp8 256x2048x16384, 8192 at fp8 256x4096x16384).
# Splits of 2048 (256x4096x4096 in 2) are unmeasured, so such problems keep the planner's plan.
SPLIT_SKINNY_MIN_K = 4096


def _wide_split(m, n, k, batch, ktile, num_sms, planned):
    """`planned` (tile_m, tile_n, cluster, split) re-tiled in `SPLIT_WIDE_TILE` and split into
    about one wave, each split keeping `SPLIT_WIDE_MIN_K` of k or more, where its grid pads no
    more of the output than the planner's tile: the planner's tile fits the SMs best unsplit,
    which once split leaves its CTAs small tiles (64 x 128 reads 192 elements of A and B a
    k-step for 16 KFLOP, 128 x 128 reads 256 for 32). Taken by wide problems (m > 256) that
    split, and by skinny ones of two 128-row tiles (128 < m <= 256; below 193 rows 128-row tiles
    pad more than 64-row ones, so in practice 193-256), split or not, each split keeping
    `SPLIT_SKINNY_MIN_K` of k or more, where the re-tiled grid may split as a wide one does
    (`_splits_wide`: one GEMM of at least `SM90_MIN_FLOPS`, so no problem XLA's dot took moves;
    a cluster that pads no tile) and runs as many CTAs as planned, as measured: H100,
    sixty-seventh session, device method, B K-major, x cuBLAS in one process, bfloat16
    256x2048x16384 128 x 128 split 4 0.973 against the planner's 64 x 128 split 2 0.823; fp8
    256x4096x16384 128 x 128 split 2 0.977 against 64 x 128 unsplit 0.863 (128 CTAs each);
    fp8 256x2048x16384 split 4 0.956 against 0.881. At m = 128 the re-tile gained nothing
    (bfloat16 128x4096x16384 0.993 against 1.017), so those keep 64-row tiles. Elsewhere (257
    rows: a third 128-row tile of one row; a 128 x 128 grid whose cluster pads) `planned`
    stands, as measured in the sixty-fifth session."""
    tm, tn = SPLIT_WIDE_TILE
    ptm, ptn, _, psplit = planned
    padded = lambda a, b: math.ceil(m / a) * a * math.ceil(n / b) * b  # noqa: E731
    if padded(tm, tn) > padded(ptm, ptn):
        return planned
    tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
    cluster = _paired_cluster(tiles_m, tiles_n)
    min_k = SPLIT_WIDE_MIN_K if m > 256 else SPLIT_SKINNY_MIN_K
    split = _split_k(m, n, k, batch, tm, tn, ktile, num_sms, cluster, min_k)
    if m <= 256 and not (
        _splits_wide(m, n, k, batch, tiles_m, tiles_n, cluster)
        and tiles_m * tiles_n * split >= math.ceil(m / ptm) * math.ceil(n / ptn) * psplit
    ):
        return planned
    return (tm, tn, cluster, split) if split > 1 else planned


def _splits_wide(m, n, k, batch, tiles_m, tiles_n, cluster) -> bool:
    """Whether a problem of m > 256, or a skinny one re-tiled (`_wide_split`), may split k:
    as measured (one GEMM, at least `SM90_MIN_FLOPS`, so that no problem XLA's dot takes
    unsplit moves to the split kernel), and its cluster pads no tile (padded CTAs would run a
    whole split's main loop on zeros)."""
    return (batch == 1 and 2 * m * n * k >= SM90_MIN_FLOPS
            and _cluster_pad(tiles_m, tiles_n, cluster) == 0)  # fmt: skip


def with_split(plan: GemmPlan, split: int, reduce: str | None = None) -> GemmPlan:
    """`plan` (sm_90a) with split factor `split` (1: the unsplit SM90 kernel) and partials summed
    by `reduce` ("xla" or "cluster"; default: the plan's), A/B stages refilled to the shared
    memory its epilogue leaves. An in-cluster split takes the (1, split) cluster it reduces in.
    Raises PlanError if the combination is illegal or no stages fit."""
    reduce = reduce or plan.split_reduce
    kernel = KERNEL_SM90_SPLITK if split > 1 else KERNEL_SM90
    cluster = plan.cluster_shape_mn
    if reduce == "cluster":
        cluster = (1, split)
    # The reason says what the plan now is (it kept the planner's: "XLA dot: a small problem",
    # "ping-pong tile", beside a split cooperative kernel).
    reason = (f"split-K x{split} (partials summed by {reduce}): tuning.with_split" if split > 1
              else "unsplit: tuning.with_split")  # fmt: skip
    edited = dataclasses.replace(
        plan, kernel=kernel, reason=reason, split_k=split, split_reduce=reduce,
        cluster_shape_mn=cluster,
        pingpong=False if split > 1 else plan.pingpong, num_ab_stages=C.MIN_AB_STAGES,
        num_epi_stages=2, stream_k=plan.stream_k and split == 1,
        stage_c=plan.stage_c and split == 1, swap_ab=plan.swap_ab and split == 1,
    )  # fmt: skip
    return _fill_sm90_smem(edited)


# Below these sizes (FLOPs of the whole batched problem) XLA's dot beats the SM90 kernels on
# the H200: the persistent kernel's start-up (barrier init, cluster sync, pipeline fill) costs
# ~1-1.6 us more than cuBLAS's kernels, measured by `python -m jax_sm100.bench --method device`
# on 2026-11-29 (benchmarks/RESULTS.md): 0.62-0.83x at 128^3, 256^3, 1024^3, 1024x1024x128 and
# 512x2048x512; 0.90x at 1024x4096x1024 (2^33 FLOPs) and 0.91-0.93x at 2048^3. Split-K plans
# win at 64x4096x4096 (1.2x, 2^31.0 FLOPs), tie at 256x256x4096 and 128x1024x1024 and lose at
# 64x64x4096 (0.72x).
# Epilogue store stages the SM90 planner gives from the shared memory the A/B ring leaves over,
# for swizzled rasters: with 4 (not 2) sub-tiles in flight the 128x256 tile's epilogue stalls
# less on its TMA stores. H200, device method, two sweeps: +0.2-7 % in all 16 swizzle-8 pairs
# (8192^3, 16384x4096x4096, 4096^3, 4096x14336x4096; both clusters), -5 to +2 % (mean -1 %)
# with swizzle 1, where the planner keeps 2 (benchmarks/RESULTS.md, fourth session).
SM90_MAX_EPI_STAGES = 4
SM90_MIN_FLOPS = 2**33
SM90_SPLITK_MIN_FLOPS = 2**30


def sm90_too_small(m, n, k, batch, split) -> str | None:
    """The planner's reason to send a small sm_90a problem to XLA's dot, or None."""
    flops = 2 * m * n * k * batch
    floor = SM90_SPLITK_MIN_FLOPS if split > 1 else SM90_MIN_FLOPS
    if flops >= floor:
        return None
    kind = f"split-K x{split}" if split > 1 else "wgmma"
    return (
        f"XLA dot: a small problem ({flops / 1e9:.3g} GFLOP < {floor / 1e9:.3g}), where the "
        f"persistent {kind} kernel's ~1.5 us start-up makes it slower than XLA's dot on the "
        "H200 (benchmarks/RESULTS.md); plan(..., force_kernel=True) plans the kernel anyway"
    )


def _sm90_pingpong_plan(common, tile, cluster, ab_bits) -> GemmPlan | None:
    """The ping-pong plan the planner chose, walked along N (swizzled in bands of 8 cluster rows
    where 8 divides them: the DSL scheduler pads the rows otherwise, see `_sm90_swizzle`; very
    tall 8-bit grids unswizzled; wide 8-bit grids along M, unswizzled, in 1x2 clusters) with the
    measured 4-deep epilogue store ring (2-deep for 8-bit operands), or None where it does not
    fit (the caller then plans the cooperative tile). A C
    of D's 16-bit dtype (the backward's saved pre-activation, a residual) is staged by TMA
    (`GemmPlan.stage_c`), with a shallower store ring (measured below)."""
    rows = _swizzled_extent(common["m"], common["n"], tile, cluster, along_m=False)
    swizzle = 8 if rows % 8 == 0 else 1
    eight_bit = ab_bits == 8
    tall = eight_bit and _very_tall_8bit(common["m"], common["n"])
    if tall and tuple(tile[:2]) == (64, 256):
        why = "64x256 in place of 128x192 in a very tall 8-bit grid at short k (measured)"
    else:
        why = f"fewest weighted waves on {common['num_sms']} SMs"
        why += "; 8-bit operands at short k" if eight_bit else ""
    if tall:
        # Very tall 8-bit grids walk along N unswizzled (H200, fifteenth session, same call,
        # 128x192: 16384x4096x4096 1282 against 1236 TF/s swizzled; 8192x8192x4096 and
        # 4096x14336x4096 ran 3 % and 7 % faster swizzled, 16384x8192x2048 within 1 %; 64x256:
        # 1311 against 1221).
        swizzle = 1
    wide = eight_bit and _wide_8bit(common["m"], common["n"], tile)
    if wide:
        # Wide 8-bit grids walk along M unswizzled, CTAs paired along N (A multicast;
        # measured beside `_wide_8bit`, without a C or pre-activation).
        cluster, swizzle = SM90_WIDE_8BIT_CLUSTER, 1
    c_dtype = common["c_dtype"]
    stage_c = c_dtype == common["out_dtype"] and c_dtype is not None and C.DTYPE_BITS[c_dtype] == 16
    try:
        plan = GemmPlan(
            **common, kernel=KERNEL_SM90,
            reason=(f"wgmma {tile[0]}x{tile[1]} ping-pong tile (each warp group's epilogue "
                    f"hidden under the other's main loop): {why}; raster along "
                    + ("M, unswizzled, CTAs paired along N (a wide 8-bit grid)" if wide else "N")
                    + (", unswizzled (a very tall 8-bit grid)" if tall else "")),
            mma_tiler_mnk=tile, cluster_shape_mn=cluster, use_2cta=False,
            num_ab_stages=C.MIN_AB_STAGES, num_acc_stages=1, raster_along_m=wide,
            swizzle_size=swizzle, pingpong=True, stage_c=stage_c,
        )  # fmt: skip
        if eight_bit:
            depth = SM90_PINGPONG_8BIT_EPI_STAGES
        elif plan.preact_out or plan.stage_c:
            depth = SM90_PINGPONG_SHALLOW_EPI_STAGES
        else:
            depth = SM90_PINGPONG_EPI_STAGES
        return _fill_sm90_smem(plan, depth)
    except C.PlanError:
        return None


# Very tall 8-bit ping-pong grids run swapped (`GemmPlan.swap_ab`: D^T = B A^T, D stored
# M-major), where 128x192 tiles fit: the transposed grid is very wide, its 192-column tiles pad
# the long side (0.8 % at 16384 rows) instead of the short one (3.1 % at 4096 columns), so
# 128x192 replaces the 64x256 tiles the unswapped grid takes. H200, twenty-fourth session,
# e4m3 -> bfloat16, device method, one call: the 4096x16384x4096 product (the swapped problem
# of 16384x4096x4096) in 128x192 ping-pong tiles walked along M, unswizzled: 1349.7 TF/s in
# 1x2 clusters, 1317.8 / 1324.5 in 2x1, 1227.5-1234.3 swizzled 8 or 4, 1306.8 as the planner
# plans that wide problem itself (along N, swizzle 8); 16384x4096x4096 unswapped (64x256)
# 1284.2 / 1289.4; cuBLAS fp8 1315.1-1335.6 at either shape.
SM90_SWAP_TILE = (128, 192)
SM90_SWAP_CLUSTER = (1, 2)


# Wide 8-bit ping-pong grids (`_wide_8bit`) walk along M, unswizzled, in 1x2 clusters, as the
# swapped plans do (each column of tiles reads one block of B while A stays in L2). H200,
# twenty-fourth session, device method, same calls, against along N swizzled 8 in 2x1:
# 4096x16384x4096 1349.7 against 1306.8 TF/s, 4096x14336x4096 1290.7 / 1273.4 against
# 1262.2 / 1265.1 (cuBLAS fp8 1333.6 there).
SM90_WIDE_8BIT_CLUSTER = (1, 2)


def _wide_8bit(m, n, tile) -> bool:
    """Whether an 8-bit ping-pong grid is wide: at least twice as many tile columns as tile
    rows (4096 x 14336 in 128x192 tiles is, 75 against 32; 8192 x 8192 is not)."""
    return math.ceil(n / tile[1]) >= 2 * math.ceil(m / tile[0])


def _sm90_swapped_plan(common, ktile) -> GemmPlan | None:
    """The swapped ping-pong plan of a very tall 8-bit grid (`SM90_SWAP_TILE` over (n, m),
    `SM90_SWAP_CLUSTER`, raster along the kernel's M unswizzled, the 8-bit store ring), or None
    where it does not fit or the problem cannot run swapped (a C, an operand not K-major:
    constraints.check_swap_ab, run by GemmPlan)."""
    tm, tn = SM90_SWAP_TILE
    try:
        plan = GemmPlan(
            **common, kernel=KERNEL_SM90,
            reason=(f"wgmma {tm}x{tn} ping-pong tile on the swapped product D^T = B A^T (a very "
                    f"tall 8-bit grid: {tn}-column tiles pad its {common['m']} rows, not its "
                    f"{common['n']} columns; measured); raster along the kernel's M (the "
                    "caller's n), unswizzled"),
            mma_tiler_mnk=(tm, tn, ktile), cluster_shape_mn=SM90_SWAP_CLUSTER, use_2cta=False,
            num_ab_stages=C.MIN_AB_STAGES, num_acc_stages=1, raster_along_m=True,
            swizzle_size=1, pingpong=True, swap_ab=True,
        )  # fmt: skip
        return _fill_sm90_smem(plan, SM90_PINGPONG_8BIT_EPI_STAGES)
    except C.PlanError:
        return None


SM90_PINGPONG_EPI_STAGES = 4
# Epilogues that stage a second tile in shared memory take 2 store stages, leaving room for one
# more A/B stage (H200, benchmarks/epilogue_probe.py, interleaved rounds, 2026-12-01,
# 8192x14336x4096 bf16, 128x160 ping-pong):
# - with the pre-activation Z also stored (the forward under `grad`, bias + gelu), 4 store
#   stages leave 4 A/B stages, 2 leave 5: 631 against 655 TF/s;
# - with C staged by TMA (`GemmPlan.stage_c`; gelu'(C) * acc): 617 TF/s with 4/4 stages, 627
#   with 5/2, against 608 with C loaded from global memory (5/4).
SM90_PINGPONG_SHALLOW_EPI_STAGES = 2


def _sm90_stream_k(m, n, batch, tm, tn, cluster, num_sms) -> bool:
    """Whether an SM90 plan shares its last waves out by k-blocks (`GemmPlan.stream_k`).

    When the persistent clusters' waves do not divide the tiles, the last wave leaves clusters
    idle (2048 tiles on 132 SMs: 15.5 waves, 3 % of the time). Stream-K costs each cluster one
    partial tile written and read back; on the H200 (benchmarks/RESULTS.md, fifth session) it
    gained 0.5-4.4 % at 15.5 waves, was even at 13.6 and lost 3 % at 3.9, so it is taken from
    `SM90_STREAM_K_MIN_WAVES` full waves on.
    """
    cluster_tiles, clusters = _cluster_grid(math.ceil(m / tm), math.ceil(n / tn), cluster, batch,
                                            num_sms)  # fmt: skip
    return cluster_tiles // clusters >= SM90_STREAM_K_MIN_WAVES and cluster_tiles % clusters != 0


SM90_STREAM_K_MIN_WAVES = 8

# The dense planner's stream-K is for 16- and 32-bit operands. An fp8 tile's main loop takes
# half a bf16 one's time while its partial costs the same, and on the H200 (2026-12-01,
# benchmarks/RESULTS.md, thirteenth session; `scaled_probe.py`) stream-K cost fp8 e4m3 2.7-3.1 %
# at 16384x4096x4096 (1206-1207 against 1239-1245 TF/s, two machine starts) and 0.7 % at 8192^3
# (one run, within the spread), both 15.5 waves of 128x256 tiles. (The block-scaled kernel's
# slower tiles keep it: 0.5-1.2 % faster with it at 8192^3 and 4096x7168x16384.)
SM90_STREAM_K_MIN_AB_BITS = 16


def _sm90_swizzle(m, n, batch, tm, tn, cluster) -> int:
    """Raster swizzle for SM90 grids with many more tile rows than columns (and >= 8 of each).

    Rastering along M in 8-tile bands keeps the B tiles of the CTAs running at the same time in
    L2. Measured on the H200 (benchmarks/RESULTS.md, 2026-11-29, bf16 vs jnp.dot): 16384x4096x4096
    0.86-0.87x -> 0.93-0.95x, 8192^3 0.95-0.97x -> 0.98-1.0x, 4096^3 unchanged; on
    4096x14336x4096 (more tile columns than rows) it measured 0.83-0.94x against 0.97-1.1x
    without, so wide grids keep 1.

    The DSL's tile scheduler rounds the number of cluster columns up to a multiple of the
    swizzle, and the clusters it adds lie wholly outside the matrix yet run their main loops (on
    zero-filled tiles): 10 columns of clusters would run as 16. So the swizzle is taken only
    where it divides the cluster columns.
    """
    tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
    cluster_cols = _swizzled_extent(m, n, (tm, tn), cluster, along_m=True)
    tall = tiles_n >= 8 and tiles_m >= 2 * tiles_n
    return 8 if tall and cluster_cols % 8 == 0 else 1


def _swizzled_extent(m, n, tile_mn, cluster, along_m) -> int:
    """The cluster count the DSL's tile scheduler rounds up to a multiple of the swizzle: the
    cluster columns for a raster along M, the cluster rows along N."""
    if along_m:
        return math.ceil(math.ceil(n / tile_mn[1]) / cluster[1])
    return math.ceil(math.ceil(m / tile_mn[0]) / cluster[0])


def swizzle_pads(plan: GemmPlan) -> bool:
    """Whether `plan`'s swizzle makes the scheduler run clusters outside the matrix (correct,
    but each runs a full main loop on zero-filled tiles); the planner never plans one."""
    extent = _swizzled_extent(*plan.kernel_mn, plan.cta_tile_mnk[:2], plan.cluster_shape_mn,
                              plan.raster_along_m)  # fmt: skip
    return extent % plan.swizzle_size != 0


def plan_sm90(common, why_not, ab_bits, ktile, out_bits, allow_pingpong, force_kernel) -> GemmPlan:
    """The planner's sm_90a plan for the problem in `common` (GemmPlan's problem fields, arch
    and num_sms); `why_not` (a reason or None) sends it to XLA's dot."""
    m, n, k, batch = common["m"], common["n"], common["k"], common["batch"]
    num_sms = common["num_sms"]
    a_dtype, b_dtype = common["a_dtype"], common["b_dtype"]
    pingpong_ok = allow_pingpong and why_not is None and a_dtype == b_dtype
    short_k = ab_bits == 8 and math.ceil(k / ktile) <= SM90_PINGPONG_8BIT_MAX_KTILES
    pingpong_ok = pingpong_ok and (ab_bits == 16 or short_k) and out_bits == 16
    tm, tn, cluster, pingpong = _choose_sm90(m, n, k, batch, num_sms, pingpong_ok, ab_bits)
    split = _split_k(m, n, k, batch, tm, tn, ktile, num_sms, cluster) if why_not is None else 1
    if why_not is None and not pingpong and (split > 1 and m > 256 or 128 < m <= 256):
        tm, tn, cluster, split = _wide_split(m, n, k, batch, ktile, num_sms,
                                             (tm, tn, cluster, split))  # fmt: skip
    if split == 1 and not pingpong:
        cluster = _unpadded_cluster(m, n, tm, tn, cluster, batch, num_sms)
    if why_not is None and not force_kernel:
        why_not = sm90_too_small(m, n, k, batch, split)
        split = 1 if why_not else split
    if why_not is not None:
        kernel = KERNEL_XLA
        reason = why_not
    elif split > 1:
        kernel = KERNEL_SM90_SPLITK
        reason = (
            f"split-K x{split}: only {math.ceil(m / tm) * math.ceil(n / tn) * batch} output "
            f"tiles for {num_sms} SMs, so K is spread over idle SMs"
        )
    else:
        kernel = KERNEL_SM90
        if pingpong and ab_bits == 8 and _very_tall_8bit(m, n):
            plan = _sm90_swapped_plan(common, ktile)
            if plan is not None:
                return plan
        if pingpong:
            plan = _sm90_pingpong_plan(common, (tm, tn, ktile), cluster, ab_bits)
            if plan is not None:
                return plan
            tm, tn, cluster, _ = _choose_sm90(m, n, k, batch, num_sms, ab_bits=ab_bits)
            cluster = _unpadded_cluster(m, n, tm, tn, cluster, batch, num_sms)
        reason = f"wgmma {tm}x{tn} tile: fewest weighted waves on {num_sms} SMs"
    stream_k = (kernel == KERNEL_SM90 and ab_bits >= SM90_STREAM_K_MIN_AB_BITS
                and _sm90_stream_k(m, n, batch, tm, tn, cluster, num_sms))  # fmt: skip
    if stream_k:
        reason += "; stream-K over the last waves (they do not divide evenly)"
    plan = GemmPlan(
        **common,
        kernel=kernel,
        reason=reason,
        mma_tiler_mnk=(tm, tn, ktile),
        cluster_shape_mn=cluster,
        use_2cta=False,
        num_ab_stages=C.MIN_AB_STAGES,
        num_acc_stages=1,
        split_k=split,
        swizzle_size=_sm90_swizzle(m, n, batch, tm, tn, cluster),
        stream_k=stream_k,
    )
    # A/B stages as many as fit, then the SMEM left deepens the epilogue's TMA-store ring.
    return _fill_sm90_smem(plan)


# Cooperative 128x160 / 128x192 tiles fit expert widths that 256 does not divide (1408 = 9 x 160
# - 32), but measured no faster than 128x256 on the H200 at issue 18's shapes
# (benchmarks/grouped_tiles.py, ninth session: 565 / 549 against 567 TF/s at 64 groups of
# 1024 x 2048 x 1408), so the grouped planner does not add them.
_SM90_GROUPED_EXTRA = ()
# Ping-pong tiles for grouped problems (one warp group's epilogue under the other's main loop):
# on the H200 they ran 0.63-0.96x the cooperative plans' speed at issue 18's shapes in 1x1
# clusters (ninth session); in 2x1 clusters (eleventh) ahead with equal groups (0.940 against
# 0.907 of dense at 64 groups) but behind with skewed ones at every g. Forty-sixth session
# (benchmarks/grouped_tiles.py, after the skewed forward lost its padded rows): 128x160 in 2x1
# clusters 1.17x the cooperative 128x256 plan at 64 equal groups of 1024 x 2048 x 1408 (1.042
# against 0.893 of dense) and 1.04x at skewed ones (0.835 against 0.801). Cooperative tiles skip
# the products of a warp group whose rows lie past its group (`_rows_past_group`), which ping-pong
# tiles cannot, so short groups keep them: ping-pong competes for 16-bit ragged-rows problems
# whose groups average GROUPED_PINGPONG_MIN_ROWS rows, weighed by GROUPED_PINGPONG_GAIN below 1:
# taken where its tile saves 5 % of the weighted waves or more, as at the one shape measured
# (1408 columns are 8.8 tiles of 160, 5.5 of 256: 9 % fewer). Where the waves are about equal
# (8 groups of 4096 x 4096, the d lhs products' 2048 columns: 0.4 % fewer) the cooperative
# tile stays, as the eleventh session measured it with skewed groups; unmeasured since.
_SM90_GROUPED_PINGPONG = ((128, 192, 1.0), (128, 160, 1.0))
GROUPED_PINGPONG_GAIN = 0.95
GROUPED_PINGPONG_MIN_ROWS = 512
# JAX_SM100_GROUPED_SCHEDULE: "pingpong" or "cooperative" restricts the grouped planner to that
# schedule (tests and tuning); unset, the planner's choice between them.
GROUPED_SCHEDULES = ("", "pingpong", "cooperative")


# The grouped plans' store ring depth, as the swizzled dense plans' (4; 2 where that leaves fewer
# than GROUPED_MIN_AB_STAGES A/B stages, and for float32 outputs, unmeasured). H200, eleventh
# session (`python -m jax_sm100.bench --ragged`, 4 against 2): the weight gradient of 128-row
# groups 1.08-1.10x (285 -> 314 and 308 -> 333 TF/s at 128 and 256 groups), forward + vjp at 64
# groups 0.938 -> 0.991 of our dense product, the forwards within run-to-run spread.
GROUPED_EPI_STAGES = 4
GROUPED_MIN_AB_STAGES = 3


# A 2x1 cluster's CTAs take two m tiles of one group and share its B tile by multicast; the
# weight the planner gives that (our dense kernel at 65536x2048x1408, 128x256 cooperative, 2x1
# against 1x1 clusters: 1.08x; benchmarks/grouped_gap.py, eleventh session). A group with an
# odd number of m tiles leaves one CTA of its last pair idle (its rows are past the group: zero
# loads, no stores), which the wave count below charges.
GROUPED_MULTICAST_GAIN = 1.08
# The weight of dynamic work tiles (1x1 clusters only) in a weight gradient (ragged "k": one
# [k, n] result per group, its k-segment as long as its group), whose tiles cost what their
# groups' sizes do. H200, eighteenth session (benchmarks/grouped_schedule.py: each grouped
# product in 1x1 clusters with dynamic tiles against the 2x1 pair; benchmarks/RESULTS.md):
# skewed groups 1.14-1.19x the 2x1 pair (64 groups 522 -> 594-602, 128: 241-243 -> 285-288,
# 256: 247-248 -> 283-287 TF/s), equal groups 0.95-1.01x. Taking the pair as
# GROUPED_MULTICAST_GAIN over 1x1 round-robin (the weights' unit), that is about 1.25x and 1.04x
# of it, and the weight is their mean, since routed tokens are rarely equal. Above
# GROUPED_MULTICAST_GAIN it makes the rule absolute: a pair's work tiles number at least half
# the single CTAs' on half as many clusters, so its waves are never fewer, and weight gradients
# always plan 1x1 with dynamic tiles (2x1 with JAX_SM100_GROUPED_DYNAMIC=0). Forward and d lhs
# products (ragged "m") measured within spread of the 2x1 pair or behind it, so there dynamic
# tiles carry no weight and the pair keeps its multicast gain. The sm_100a planner takes the
# same weights (H200 figures; no SM100 GPU has run either schedule).
GROUPED_DYNAMIC_K_GAIN = 1.14


def grouped_cluster_cost(
    common, tm: int, tn: int, eff: float, dynamic: bool = False
) -> tuple[float, int]:
    """(weighted waves, pair) of a grouped problem on tm x tn CTA tiles in the better of 1x1
    and 2x1 clusters (both grouped planners): a pair's work tiles are two CTA tiles tall, run
    on num_sms // 2 clusters and weighed by GROUPED_MULTICAST_GAIN; a 1x1 cluster of a weight
    gradient is weighed by GROUPED_DYNAMIC_K_GAIN when it would take dynamic tiles (`dynamic`)."""
    single = GROUPED_DYNAMIC_K_GAIN if dynamic and common["ragged"] == "k" else 1.0
    best = None
    for pair, gain in ((1, single), (2, GROUPED_MULTICAST_GAIN)):
        tiles = grouped_work_tiles(common, pair * tm, tn)
        cost = _wave_cost(tiles, pair, common["num_sms"], pair * tm * tn, eff * gain)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, pair)
    return best


# JAX_SM100_GROUPED_DYNAMIC: "1" or "0" turns `GemmPlan.dynamic_tiles` on or off where it
# applies (grouped plans in 1x1 clusters: cooperative ones on sm_90a, every one on sm_100a,
# whose planner reads the same switch); unset, the planner's rule below.
GROUPED_DYNAMIC_ENV = "JAX_SM100_GROUPED_DYNAMIC"
# The planners' rule: dynamic work tiles wherever they apply (H200: 128 skewed groups' forward
# 1.08-1.11x, equal groups unchanged; benchmarks/RESULTS.md, seventeenth session).
GROUPED_DYNAMIC_DEFAULT = True


def grouped_dynamic(dynamic: str) -> bool:
    """Whether a grouped plan takes dynamic work tiles where they apply, by GROUPED_DYNAMIC_ENV's
    value `dynamic` ("" for the planners' rule); both grouped planners read it."""
    if dynamic not in ("", "0", "1"):
        raise C.PlanError(f"{GROUPED_DYNAMIC_ENV}={dynamic!r}: '1', '0' or unset")
    return dynamic == "1" or (dynamic == "" and GROUPED_DYNAMIC_DEFAULT)


def grouped_pingpong_ok(common, ktile: int) -> bool:
    """Whether the grouped planner weighs ping-pong tiles unasked: 16-bit operands (64-element
    k-tiles; 8-bit ones unmeasured), ragged rows, and groups of GROUPED_PINGPONG_MIN_ROWS rows
    on average (the comment above it). The average is the bind's m over its groups: a device's
    bind under expert parallelism holds every row against its g / E experts, so it reads E
    times the rows its groups average (ping-pong there is unmeasured)."""
    return (
        ktile == 64
        and common["ragged"] == "m"
        and common["m"] >= GROUPED_PINGPONG_MIN_ROWS * common["groups"]
    )


def plan_sm90_grouped(common, why_not, ktile, schedule="", dynamic="") -> GemmPlan:
    """The sm_90a plan of a grouped problem (`common["groups"]`, `common["ragged"]`): the
    tile (cooperative, or ping-pong where `grouped_pingpong_ok` lets it compete, weighed by
    GROUPED_PINGPONG_GAIN) and cluster (1x1, or 2x1: CTA pairs inside one group, B multicast)
    with the fewest weighted waves for groups of equal size (in ragged-rows mode each group's last m
    tile, or pair of tiles, is partial; a weight gradient's 1x1 clusters weighed by their
    dynamic tiles' gain on skewed sizes, `grouped_cluster_cost`), dynamic work tiles for
    cooperative plans in 1x1 clusters (`dynamic`: GROUPED_DYNAMIC_ENV's value, "" for
    GROUPED_DYNAMIC_DEFAULT), and the store ring and A/B stages that fit beside the group table
    (GROUPED_EPI_STAGES)."""
    g, num_sms = common["groups"], common["num_sms"]
    why_not = grouped_support(common) or why_not  # `schedule` checked by planning.plan
    wants_dynamic = grouped_dynamic(dynamic)
    candidates = []
    if schedule != "pingpong":
        candidates += [(tm, tn, False, eff) for tm, tn, eff in _SM90_CANDIDATES]
        candidates += [(tm, tn, False, eff) for tm, tn, eff in _SM90_GROUPED_EXTRA]
    if schedule == "pingpong" or (schedule == "" and grouped_pingpong_ok(common, ktile)):
        gain = 1.0 if schedule else GROUPED_PINGPONG_GAIN
        candidates += [(tm, tn, True, eff * gain) for tm, tn, eff in _SM90_GROUPED_PINGPONG]
    best = None
    for tm, tn, pingpong, eff in candidates:
        cost, pair = grouped_cluster_cost(common, tm, tn, eff, wants_dynamic and not pingpong)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, tm, tn, pingpong, pair)
    _, tm, tn, pingpong, pair = best
    kind = "ping-pong" if pingpong else "cooperative"
    kernel, reason = KERNEL_SM90_GROUPED, (
        f"grouped wgmma {tm}x{tn} {kind} tile in {pair}x1 clusters over {g} groups (ragged "
        f"{common['ragged']}): fewest weighted waves on {num_sms} SMs"
    )  # fmt: skip
    if why_not is not None:
        kernel, reason, pair = KERNEL_XLA, why_not, 1
    plan = GemmPlan(
        **common,
        kernel=kernel,
        reason=reason,
        mma_tiler_mnk=(tm, tn, ktile),
        cluster_shape_mn=(pair, 1),
        use_2cta=False,
        num_ab_stages=C.MIN_AB_STAGES,
        num_acc_stages=1,
        num_epi_stages=2,
        pingpong=pingpong,
        raster_along_m=grouped_raster_along_m(common),
        dynamic_tiles=wants_dynamic
        and kernel == KERNEL_SM90_GROUPED
        and not pingpong
        and pair == 1,
    )
    # The deeper ring was measured for 16-bit outputs only; a float32 D would pay an A/B stage.
    deepest = GROUPED_EPI_STAGES if C.DTYPE_BITS[common["out_dtype"]] == 16 else 2
    for depth in (deepest, 2):
        try:
            deep = dataclasses.replace(plan, num_epi_stages=depth)
        except C.PlanError:
            continue  # that ring does not fit beside the fewest A/B stages
        # Everything but the A/B stages, then as many of those as fit.
        fixed = deep.smem_bytes - deep.num_ab_stages * deep.ab_stage_bytes
        stages = (smem_capacity(plan.arch) - fixed) // deep.ab_stage_bytes
        if stages >= GROUPED_MIN_AB_STAGES or depth == 2:
            return dataclasses.replace(deep, num_ab_stages=stages)
    raise AssertionError("unreachable: the 2-deep ring fits (the plan above was made with it)")
