"""The grouped kernel's schedules product by product: `python benchmarks/grouped_schedule.py`.

At each problem of `python -m jax_sm100.bench --ragged` (G groups, [m, k] @ [G, k, n], normal
bfloat16 data, equal and skewed sizes) it times, by wall clock (`bench_train.time_steps`), each
product of a `ragged_dot` training step alone: the forward, d lhs (both ragged "m") and d rhs
(ragged "k", the weight gradient: one [k, n] result per group) in three plans forced through the
planner's weights: 1x1 clusters with dynamic work tiles, 1x1 round-robin, and 2x1 round-robin (a
CTA pair per work tile, B multicast). Prints TF/s, and the plans that ran where they are not the
ones forced; `--rounds` repeats the three in turn, since run-to-run spread on the H200 is a few
percent.
"""

from __future__ import annotations

import argparse
from unittest import mock

import jax

import jax_sm100
from jax_sm100._src import planning
from jax_sm100._src.planning import sm90
from jax_sm100.bench_ragged import PROBLEMS, group_sizes, operands
from jax_sm100.bench_train import time_steps

# (label, multicast pair's weight, JAX_SM100_GROUPED_DYNAMIC)
SCHEDULES = (("1x1 dynamic", 1e-6, "1"), ("1x1 round-robin", 1e-6, "0"), ("2x1", 1e6, "0"))


def _products(lhs, rhs, sizes, ct, gain, dynamic):
    """Seconds per forward, d lhs and d rhs product in the plans forced by `gain` (the multicast
    pair's weight) and `dynamic`, and the (ragged, cluster, dynamic) of the plans that ran."""
    patches = [
        mock.patch.object(sm90, "GROUPED_MULTICAST_GAIN", gain),
        mock.patch.dict("os.environ", {sm90.GROUPED_DYNAMIC_ENV: dynamic}),
    ]
    for p in patches:
        p.start()
    try:
        planning._plan_cached.cache_clear()
        rd = jax_sm100.ragged_dot
        fwd = jax.jit(lambda a, b, s: rd(a, b, s))
        d_lhs = jax.jit(lambda a, b, s, t: jax.vjp(lambda u: rd(u, b, s), a)[1](t))
        d_rhs = jax.jit(lambda a, b, s, t: jax.vjp(lambda v: rd(a, v, s), b)[1](t))
        with jax_sm100.lowerings() as seen:
            times = (
                time_steps(fwd, lhs, rhs, sizes),
                time_steps(d_lhs, lhs, rhs, sizes, ct),
                time_steps(d_rhs, lhs, rhs, sizes, ct),
            )
        plans = sorted(
            {(x.plan.ragged, x.plan.cluster_shape_mn, x.plan.dynamic_tiles) for x in seen if x.plan}
        )
    finally:
        for p in reversed(patches):
            p.stop()
        planning._plan_cached.cache_clear()
    return times, plans


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--groups", type=int, nargs="*", help="only these group counts")
    args = parser.parse_args()
    print("TF/s: forward / d lhs / d rhs")
    for i, (g, m, k, n) in enumerate(PROBLEMS):
        if args.groups and g not in args.groups:
            continue
        lhs, rhs, ct, _ = operands(i, g, m, k, n)
        flop = 2 * m * k * n
        for kind in ("equal", "skewed"):
            sizes = group_sizes(i, g, m, kind)
            cells = {label: [] for label, _, _ in SCHEDULES}
            for _ in range(args.rounds):
                for label, gain, dynamic in SCHEDULES:
                    times, plans = _products(lhs, rhs, sizes, ct, gain, dynamic)
                    cells[label].append("/".join(f"{flop / t / 1e12:.0f}" for t in times))
                    ran = {(c, d) for _, c, d in plans}
                    want = {((1, 1) if gain < 1 else (2, 1), dynamic == "1")}
                    if ran != want:  # the plans forced did not all run: say so
                        cells[label][-1] += f" (ran {sorted(ran)})"
            line = "  ".join(f"{label}: {', '.join(v)}" for label, v in cells.items())
            print(f"{g:3d} x {m}x{k}x{n} {kind:6s} {line}", flush=True)


if __name__ == "__main__":
    main()
