"""The SM100 (tcgen05) planner: the tile, 1- or 2-CTA MMA, cluster, accumulator and pipeline
stages of a problem (the wave model of the package docstring), from the DSL's own planning
helpers."""

from __future__ import annotations

import math

from jax_sm100._src import constraints as C
from jax_sm100._src.planning import sm90
from jax_sm100._src.planning.gemm_plan import (
    KERNEL_SM100,
    KERNEL_SM100_GROUPED,
    KERNEL_XLA,
    GemmPlan,
    _dsl,
    _max_ab_stages,
    _pow2_ceil,
    _wave_cost,
    epi_smem_bytes,
    group_table_bytes,
    grouped_raster_along_m,
    grouped_support,
)

# Relative tensor-core efficiency of each tile (see the module docstring).
_SM100_CANDIDATES = (
    # (use_2cta, mma_m, mma_n, efficiency)
    (True, 256, 256, 1.00),
    (False, 128, 256, 0.96),
    (True, 256, 128, 0.92),
    (False, 128, 128, 0.86),
    (True, 128, 256, 0.80),
    (False, 64, 256, 0.70),
    (False, 64, 128, 0.62),
)


def _choose_sm100(m, n, k, batch, num_sms, candidates=_SM100_CANDIDATES):
    best = None
    for use_2cta, mm, mn, eff in candidates:
        cta_m = mm // 2 if use_2cta else mm
        if use_2cta and m <= 128 and mm > m:
            continue  # a 2-CTA pair would be mostly padding
        tiles = math.ceil(m / mm) * math.ceil(n / mn) * batch
        cost = _wave_cost(tiles, 2 if use_2cta else 1, num_sms, mm * mn, eff)
        cost *= (math.ceil(m / cta_m) * cta_m) / max(m, 1) if m < cta_m else 1.0
        if best is None or cost < best[0] - 1e-9:
            best = (cost, use_2cta, mm, mn)
    _, use_2cta, mm, mn = best
    tiles_m = math.ceil(m / mm)
    cluster = (2, 1) if use_2cta else ((2, 1) if tiles_m >= 2 else (1, 1))
    return use_2cta, mm, mn, cluster


def _sm100_reason(use_2cta, mm, mn, num_sms) -> str:
    kind = "2-CTA" if use_2cta else "1-CTA"
    return f"tcgen05 {kind} {mm}x{mn} MMA: fewest weighted waves on {num_sms} SMs"


def _sm100_stages(
    arch, use_2cta, mm, mn, ktile, ab_bits, out_dtype, out_bits, c_dtype, c_bits, preact_out,
    reserved_bytes=0,
) -> tuple[int, int]:  # fmt: skip
    """(accumulator stages, A/B stages) of an mm x mn MMA tile: two TMEM accumulators where
    they fit, and as many A/B stages as the SMEM beside a 2-deep epilogue ring (and
    `reserved_bytes`, e.g. a grouped kernel's group table) holds."""
    cta = (mm // 2 if use_2cta else mm, mn, ktile)
    cols = _dsl().sm100.compute_acc_tmem_cols_per_stage(cta[0], mn, use_2cta, mn, False)
    # Two accumulator stages let the epilogue of one tile overlap the MMAs of the next;
    # fall back to one when two do not fit in TMEM.
    acc_stages = 2 if _pow2_ceil(2 * cols) <= C.TMEM_MAX_COLS else 1
    epi = _dsl().sm100.compute_epilogue_tile_size(
        cta[0], mn, use_2cta, out_bits, c_dtype and c_bits, False, False
    )
    epi_bytes = epi_smem_bytes(arch, epi, 2, out_dtype, c_dtype, 1, preact_out=preact_out)
    b_rows = mn // 2 if use_2cta else mn
    return acc_stages, _max_ab_stages(arch, cta, b_rows, ab_bits, epi_bytes + reserved_bytes)


def plan_sm100(common, why_not, ab_bits, ktile, out_bits, c_bits) -> GemmPlan:
    """The planner's sm_100a plan for the problem in `common` (GemmPlan's problem fields, arch
    and num_sms); `why_not` (a reason or None) sends it to XLA's dot."""
    m, n, k, batch = common["m"], common["n"], common["k"], common["batch"]
    arch, num_sms = common["arch"], common["num_sms"]
    out_dtype, c_dtype = common["out_dtype"], common["c_dtype"]
    preact_out = common["preact_out"]
    use_2cta, mm, mn, cluster = _choose_sm100(m, n, k, batch, num_sms)
    acc_stages, stages = _sm100_stages(
        arch, use_2cta, mm, mn, ktile, ab_bits, out_dtype, out_bits, c_dtype, c_bits, preact_out
    )
    plan = GemmPlan(
        **common,
        kernel=KERNEL_SM100 if why_not is None else KERNEL_XLA,
        reason=why_not or _sm100_reason(use_2cta, mm, mn, num_sms),
        mma_tiler_mnk=(mm, mn, ktile),
        cluster_shape_mn=cluster,
        use_2cta=use_2cta,
        num_ab_stages=stages,
        num_acc_stages=acc_stages,
    )
    return plan


# Grouped problems (ragged_dot): 1-CTA tiles only, with the dense table's efficiencies. A
# grouped work tile's rows end at its group's end, anywhere inside the tile, and its B is that
# group's. 2x1 clusters take a work tile two CTA tiles tall inside one group
# (kernels/grouped.py) and multicast its B tile, weighed as on sm_90a
# (planning/sm90.py GROUPED_MULTICAST_GAIN, and a weight gradient's dynamic tiles by
# GROUPED_DYNAMIC_K_GAIN: both H200 figures); a cta_group::2 pair (one 256-row MMA) is not built
# for grouped plans.
_SM100_GROUPED_CANDIDATES = (
    # (mma_m, mma_n, efficiency)
    (128, 256, 0.96),
    (128, 128, 0.86),
)


def plan_sm100_grouped(common, why_not, ab_bits, ktile, out_bits, dynamic="") -> GemmPlan:
    """The sm_100a plan of a grouped problem (`common["groups"]`, `common["ragged"]`): the 1-CTA
    tile with the fewest weighted waves for groups of equal size (`grouped_work_tiles`, the
    sm_90a grouped planner's model and weights, `sm90.grouped_cluster_cost`: weight gradients
    in 1x1 clusters with dynamic tiles), two TMEM accumulators, a 2-deep store ring and as many
    A/B stages as fit beside the group table (and, in 1x1 clusters, the dynamic tiles' ring:
    `dynamic` as sm90.plan_sm90_grouped reads it); `why_not` (or `grouped_support`'s reason)
    sends it to XLA's ragged dot."""
    g, num_sms = common["groups"], common["num_sms"]
    wants_dynamic = sm90.grouped_dynamic(dynamic)
    why_not = grouped_support(common) or why_not
    best = None
    for mm, mn, eff in _SM100_GROUPED_CANDIDATES:
        cost, pair = sm90.grouped_cluster_cost(common, mm, mn, eff, wants_dynamic)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, mm, mn, pair)
    _, mm, mn, pair = best
    pair = 1 if why_not is not None else pair
    dynamic_tiles = why_not is None and pair == 1 and wants_dynamic
    reserved = group_table_bytes(g) if why_not is None else 0
    reserved += C.GROUPED_WORK_RING_BYTES if dynamic_tiles else 0
    acc_stages, stages = _sm100_stages(
        common["arch"], False, mm, mn, ktile, ab_bits, common["out_dtype"], out_bits, None, 0,
        False, reserved,
    )  # fmt: skip
    reason = why_not or (
        f"grouped tcgen05 1-CTA {mm}x{mn} MMA in {pair}x1 clusters over {g} groups (ragged "
        f"{common['ragged']}): fewest weighted waves on {num_sms} SMs"
    )
    return GemmPlan(
        **common,
        kernel=KERNEL_SM100_GROUPED if why_not is None else KERNEL_XLA,
        reason=reason,
        mma_tiler_mnk=(mm, mn, ktile),
        cluster_shape_mn=(pair, 1),
        use_2cta=False,
        num_ab_stages=stages,
        num_acc_stages=acc_stages,
        raster_along_m=grouped_raster_along_m(common),
        dynamic_tiles=dynamic_tiles,
    )
