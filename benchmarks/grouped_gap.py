"""Where the grouped kernel loses to the dense one: `python benchmarks/grouped_gap.py`.

At each problem (G equal groups, [m, k] @ [G, k, n], normal bfloat16 data) it times, by wall
clock (`bench_train.time_steps`), `jax_sm100.ragged_dot` with G groups (in 1x1 and 2x1 clusters)
and with one group of all m rows, each restricted to one tile and schedule, beside
`jax_sm100.matmul` at the same m, k, n on the same tile and schedule with 1 x 1 and 2 x 1
clusters and with the grouped kernel's raster (its plan's order, no swizzle) or the planner's. The
differences between rows separate what grouping costs (the table, the ragged TMA views, group
boundaries) from what the grouped plans lack (clusters, raster). Prints TF/s.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from grouped_tiles import forced  # benchmarks/: the script's own folder is on sys.path

import jax_sm100
from jax_sm100._src import planning
from jax_sm100.bench_ragged import PROBLEMS as BENCH_PROBLEMS
from jax_sm100.bench_ragged import group_sizes, operands
from jax_sm100.bench_train import time_steps

PROBLEMS = ((64, 65536, 2048, 1408), (128, 16384, 2048, 768))
SCHEDULES = ((128, 256, False), (128, 160, True))


def _grouped(lhs, rhs, sizes, tm, tn, pingpong, pair):
    """Seconds per `ragged_dot`, planned on this tile and schedule in `pair` x 1 clusters
    (forced through the planner's tables, `grouped_tiles.forced`); NaN if another plan ran."""
    with forced((tm, tn, pingpong, f"{pair}x1", 0)):
        f = jax.jit(lambda a, b, s: jax_sm100.ragged_dot(a, b, s))
        with jax_sm100.lowerings() as seen:
            t = time_steps(f, lhs, rhs, sizes)
    ran = {(low.plan.cta_tile_mnk[:2], low.plan.cluster_shape_mn) for low in seen if low.plan}
    return t if ran == {((tm, tn), (pair, 1))} else float("nan")


def _dense(a, b, tm, tn, pingpong, cluster, grouped_raster):
    """Our dense matmul on the tile and cluster; `grouped_raster` None keeps the dense
    planner's raster, True / False walks the tiles along M / N (no swizzle), as the grouped
    kernel walks one group's."""
    base = jax_sm100.plan(a.shape[0], b.shape[1], a.shape[1], a_dtype=a.dtype,
                          b_dtype=b.dtype, arch="sm_90a")  # fmt: skip
    changes = {"stream_k": False}
    if grouped_raster is not None:
        changes.update(raster_along_m=grouped_raster, swizzle_size=1)
    plan = planning.sm90_variant(base, tile_mn=(tm, tn), cluster_mn=cluster,
                                 pingpong=pingpong, **changes)  # fmt: skip
    f = jax.jit(lambda x, y: jax_sm100.matmul(x, y, plan=plan))
    return time_steps(f, a, b)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.parse_args(argv)
    for g, m, k, n in PROBLEMS:
        i = BENCH_PROBLEMS.index((g, m, k, n))  # bench --ragged's seed: the same data
        lhs, rhs, _, _ = operands(i, g, m, k, n)
        flops = 2 * m * k * n
        for tm, tn, pp in SCHEDULES:
            kind = f"{tm}x{tn} {'ping-pong' if pp else 'cooperative'}"
            row = {
                f"{g} groups 1x1": _grouped(lhs, rhs, group_sizes(i, g, m), tm, tn, pp, 1),
                f"{g} groups 2x1": _grouped(lhs, rhs, group_sizes(i, g, m), tm, tn, pp, 2),
                "1 group 1x1": _grouped(lhs, rhs[:1], jnp.array([m], jnp.int32), tm, tn, pp, 1),
            }
            along_m = jax_sm100.plan(
                m, n, k, a_dtype=lhs.dtype, b_dtype=rhs.dtype, arch="sm_90a", groups=g, ragged="m"
            ).raster_along_m
            for cluster in ((1, 1), (2, 1)):
                for raster in (along_m, None):
                    order = "plan" if raster is None else ("M,1" if raster else "N,1")
                    name = f"dense {cluster[0]}x{cluster[1]} {order}"
                    row[name] = _dense(lhs, rhs[0], tm, tn, pp, cluster, raster)
            cells = "  ".join(f"{name}: {flops / t / 1e12:6.1f}" for name, t in row.items())
            print(f"{g:3d} x {m}x{k}x{n} {kind}: {cells}", flush=True)


if __name__ == "__main__":
    main()
