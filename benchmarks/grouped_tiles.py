"""Which tile the grouped SM90 kernel runs best at: `python benchmarks/grouped_tiles.py`.

For each problem (G groups of equal size, [m, k] @ [G, k, n], normal bfloat16 data) and each
candidate tile, the planner is restricted to that one tile and `jax_sm100.ragged_dot`'s forward
is timed by wall clock (`bench_train.time_steps`: warm-up, then the median of 5 rounds of 10
async calls). Prints TF/s per tile, with the cluster the planner paired it with, to check the
grouped planner's choice
(`planning/sm90.py: plan_sm90_grouped`).
"""

from __future__ import annotations

import argparse
from unittest import mock

import jax

import jax_sm100
from jax_sm100._src import planning
from jax_sm100._src.planning import sm90
from jax_sm100.bench_ragged import PROBLEMS as BENCH_PROBLEMS
from jax_sm100.bench_ragged import group_sizes, operands
from jax_sm100.bench_train import time_steps

PROBLEMS = ((64, 65536, 2048, 1408), (128, 16384, 2048, 768), (8, 32768, 4096, 4096))
TILES = ((128, 256), (128, 192), (128, 160), (128, 128), (64, 256))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kind", default="equal", choices=("equal", "skewed"))
    ap.add_argument(
        "--epi-stages",
        type=int,
        default=0,
        help="the epilogue's store ring this deep (the planner's grouped plans: "
        "planning/sm90.py GROUPED_EPI_STAGES where it fits, else 2)",
    )
    args = ap.parse_args(argv)
    depth = mock.patch.object(
        sm90, "GROUPED_EPI_STAGES", args.epi_stages or sm90.GROUPED_EPI_STAGES
    )
    for g, m, k, n in PROBLEMS:
        i = BENCH_PROBLEMS.index((g, m, k, n))  # bench --ragged's seed: the same data
        lhs, rhs, _, _ = operands(i, g, m, k, n)
        sizes = group_sizes(i, g, m, args.kind)
        row = []
        for tm, tn in TILES:
            only = ((tm, tn, 1.0),)
            with (
                mock.patch.object(sm90, "_SM90_CANDIDATES", only),
                mock.patch.object(sm90, "_SM90_GROUPED_EXTRA", ()),
                depth,
            ):
                planning._plan_cached.cache_clear()
                f = jax.jit(lambda a, b, s: jax_sm100.ragged_dot(a, b, s))
                with jax_sm100.lowerings() as seen:
                    t = time_steps(f, lhs, rhs, sizes)
                ran = {low.plan.cluster_shape_mn for low in seen if low.plan}
            pair = "/".join("x".join(map(str, c)) for c in sorted(ran)) or "?"
            row.append(f"{tm}x{tn} ({pair}): {2 * m * k * n / t / 1e12:6.1f}")
        print(f"{g:3d} x {m}x{k}x{n} ({args.kind}): " + "  ".join(row), flush=True)
    planning._plan_cached.cache_clear()


if __name__ == "__main__":
    main()
