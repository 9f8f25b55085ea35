"""Which tile the grouped SM90 kernel runs best at: `python benchmarks/grouped_tiles.py`.

For each problem (G groups, [m, k] @ [G, k, n], normal bfloat16 data, `bench --ragged`'s seeds
and sizes, equal or skewed) and each variant (a tile, its schedule and cluster, forced through
the grouped planner's tables), `jax_sm100.ragged_dot`'s forward is compiled under that variant
and timed by wall clock beside our dense product of the same FLOPs (`jax_sm100.matmul`, the
planner's plan), all of them in interleaved rounds (`bench_train.time_steps_alike`), so that
the card's clocks fall on every side alike. Prints TF/s and the ratio to the dense product
(issue 18's measure) per variant, with the plan that ran and its largest error against
`lax.ragged_dot` in float32 (relative to the largest result; bfloat16 rounding is ~4e-3).
"planner" is the plan `planning/sm90.py: plan_sm90_grouped` makes unforced.

A variant is `TMxTN[:pp][:1x1|:2x1][:eN]`: a cooperative tile (or ping-pong with `:pp`) in the
cluster given, or in the one the planner pairs with it, with a store ring N deep where the
A/B stages leave room (`:eN`; 256x176 takes 3 A/B stages beside the planner's 4, 4 beside 2).
16-bit grouped plans take 128- and 64-row cooperative tiles unforced, and ping-pong 128x160 /
128x192 for groups of `GROUPED_PINGPONG_MIN_ROWS` rows on average where they save waves; the
others here (256x176, 256x128, 128x176) compile without spills for sm_90a (checked on a CPU)
and are here to be measured.
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
from jax import lax

import jax_sm100
from jax_sm100._src import planning
from jax_sm100._src.planning import sm90
from jax_sm100.bench_ragged import PROBLEMS as BENCH_PROBLEMS
from jax_sm100.bench_ragged import SMALL, group_sizes, operands
from jax_sm100.bench_train import time_steps_alike

VARIANTS = (
    "planner",
    "128x256:1x1",
    "128x176",
    "128x176:1x1",
    "256x176",
    "256x176:e2",
    "256x176:1x1",
    "256x128",
    "128x176:pp:2x1",
    "128x160:pp:2x1",
)


def parse_variant(text: str) -> tuple[int, int, bool, str, int] | None:
    """(tile m, tile n, ping-pong, cluster "" / "1x1" / "2x1", store ring depth, 0 for the
    planner's) of a variant, None for "planner"."""
    if text == "planner":
        return None
    tile, *rest = text.split(":")
    tm, tn = (int(x) for x in tile.split("x"))
    clusters = [r for r in rest if r in ("1x1", "2x1")]
    depths = [int(r[1:]) for r in rest if r[:1] == "e" and r[1:].isdigit()]
    if (
        len(clusters) > 1
        or len(depths) > 1
        or len(rest) != len(clusters) + len(depths) + ("pp" in rest)
    ):
        raise SystemExit(f"variant {text!r}: TMxTN[:pp][:1x1|:2x1][:eN]")
    return tm, tn, "pp" in rest, "".join(clusters), depths[0] if depths else 0


@contextlib.contextmanager
def forced(variant):
    """The grouped planner restricted to `variant` (`parse_variant`'s tuple, None: unforced)."""
    with contextlib.ExitStack() as stack:
        if variant is not None:
            tm, tn, pingpong, cluster, depth = variant
            table = ((tm, tn, 1.0),)
            schedule = "pingpong" if pingpong else "cooperative"
            stack.enter_context(mock.patch.dict("os.environ", JAX_SM100_GROUPED_SCHEDULE=schedule))
            if pingpong:
                stack.enter_context(mock.patch.object(sm90, "_SM90_GROUPED_PINGPONG", table))
            else:
                stack.enter_context(mock.patch.object(sm90, "_SM90_CANDIDATES", table))
                stack.enter_context(mock.patch.object(sm90, "_SM90_GROUPED_EXTRA", ()))
            if cluster:
                gain = {"1x1": 1e-6, "2x1": 1e6}[cluster]
                stack.enter_context(mock.patch.object(sm90, "GROUPED_MULTICAST_GAIN", gain))
            if depth:
                stack.enter_context(mock.patch.object(sm90, "GROUPED_EPI_STAGES", depth))
        planning._plan_cached.cache_clear()
        try:
            yield
        finally:
            planning._plan_cached.cache_clear()


def compiled_forward(variant, lhs, rhs, sizes):
    """(the forward compiled under `variant`, a description of the plan that ran)."""
    with forced(variant), jax_sm100.lowerings() as seen:
        f = jax.jit(lambda a, b, s: jax_sm100.ragged_dot(a, b, s))
        compiled = f.lower(lhs, rhs, sizes).compile()
    plans = {low.plan for low in seen if low.plan is not None}
    ran = "; ".join(
        f"{p.kernel} {'x'.join(map(str, p.cta_tile_mnk[:2]))}"
        f"{' pp' if p.pingpong else ''} {'x'.join(map(str, p.cluster_shape_mn))}"
        f" ab{p.num_ab_stages} epi{p.num_epi_stages}{' dyn' if p.dynamic_tiles else ''}"
        for p in plans
    )
    return compiled, ran or "?"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kind", nargs="+", default=["equal", "skewed"], choices=("equal", "skewed"))
    ap.add_argument("--groups", nargs="+", type=int, default=[64],
                    help="which of bench --ragged's problems, by group count")  # fmt: skip
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument(
        "--d-lhs", action="store_true", help="the problems' d lhs shapes (k and n swapped)"
    )
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--small", action="store_true", help="tiny problems (a CPU smoke test)")
    args = ap.parse_args(argv)
    variants = [(v, parse_variant(v)) for v in args.variants]
    for i, (g, m, k, n) in enumerate(SMALL if args.small else BENCH_PROBLEMS):
        if not args.small and g not in args.groups:
            continue
        if args.d_lhs:  # ct [m, n] @ rhs[i]^T: a ragged-rows product of k columns over n
            k, n = n, k
        lhs, rhs, _, _ = operands(i, g, m, k, n)  # bench --ragged's seed: the same data
        dense = (jax.jit(jax_sm100.matmul), (lhs, rhs[0]))
        for kind in args.kind:
            sizes = group_sizes(i, g, m, kind)
            ref = lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
            scale = float(jnp.max(jnp.abs(ref)))
            sides, plans = [dense], ["dense (planner)"]
            for _, variant in variants:
                f, ran = compiled_forward(variant, lhs, rhs, sizes)
                err = float(jnp.max(jnp.abs(f(lhs, rhs, sizes).astype(jnp.float32) - ref)))
                sides.append((f, (lhs, rhs, sizes)))
                plans.append(f"{ran}; max error {err / scale:.1e} of max|ref|")
            times = time_steps_alike(sides, rounds=args.rounds)
            flops = 2 * m * k * n
            print(f"{g} x {m}x{k}x{n} ({kind}): dense {flops / times[0] / 1e12:6.1f} TF/s")
            for (name, _), t, ran in zip(variants, times[1:], plans[1:], strict=True):
                print(f"  {name:>16s}: {flops / t / 1e12:6.1f} TF/s  {times[0] / t:5.3f} of dense"
                      f"  [{ran}]", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
