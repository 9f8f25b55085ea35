"""Runs ours and jnp.dot on one shape inside a CUDA profiler range, for Nsight Compute.

    ncu --profile-from-start off --metrics <list> --csv \\
        python3 benchmarks/ncu_probe.py --shape 16384x4096x4096 [--dtype bfloat16]
            [--tile 128x160 --cluster 2x1 --pingpong]   # another SM90 plan than the planner's
            [--groups 64]   # ragged_dot, equal groups, against our dense matmul instead

Both sides are compiled and run (XLA's GEMM autotuning included) before
`cudaProfilerStart`, so the profiled range holds only `--calls` calls of each, ours first:
hardware counters (DRAM and L2 bytes, clocks, duration) then compare the two kernels on the
same inputs without any autotuning kernels in between.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from cuda.bindings import runtime as cudart

import jax_sm100
from jax_sm100._src import planning


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x4096x4096")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--tile", default="", help="profile this SM90 tile instead, e.g. 128x160")
    ap.add_argument("--cluster", default="", help="... with this cluster, e.g. 2x1")
    ap.add_argument("--pingpong", action="store_true", help="... on the ping-pong schedule")
    ap.add_argument(
        "--groups",
        type=int,
        default=0,
        help="profile jax_sm100.ragged_dot with this many equal groups (m / G rows "
        "each) against our dense matmul at the same m x k x n instead",
    )
    args = ap.parse_args()
    m, n, k = (int(v) for v in args.shape.split("x"))
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(args.dtype)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(args.dtype)
    if args.groups:
        g = args.groups
        if m % g or args.tile or args.cluster or args.pingpong:
            raise SystemExit("--groups takes an m it divides, and the planner's plans only")
        experts = jax.random.normal(kb, (g, k, n), jnp.float32).astype(args.dtype)
        sizes = jnp.full((g,), m // g, jnp.int32)
        grouped = jax.jit(lambda a, w: jax_sm100.ragged_dot(a, w, sizes))
        dense = jax.jit(lambda a, w: jax_sm100.matmul(a, w[0]))
        _profile([(grouped, (a, experts)), (dense, (a, experts))], args.calls)
        print(
            f"profiled {args.calls} calls of ragged_dot ({g} groups), then of matmul, at "
            f"{args.shape}"
        )
        return
    plan = None
    if args.tile or args.cluster or args.pingpong:
        base = jax_sm100.plan(m, n, k, a_dtype=args.dtype, b_dtype=args.dtype, arch="sm_90a")
        pair = lambda text: tuple(int(v) for v in text.split("x")) if text else None  # noqa: E731
        plan = planning.sm90_variant(base, tile_mn=pair(args.tile),
                                     cluster_mn=pair(args.cluster),
                                     pingpong=args.pingpong)  # fmt: skip
        print(plan)
    ours = jax.jit(lambda a, b: jax_sm100.matmul(a, b, plan=plan))
    dot = jax.jit(jnp.dot)
    _profile([(ours, (a, b)), (dot, (a, b))], args.calls)
    print(f"profiled {args.calls} calls of jax_sm100.matmul, then of jnp.dot, at {args.shape}")


def _profile(calls, n):
    """Warms up each (fn, args), then runs each `n` times inside the profiler range."""
    for f, xs in calls:
        for _ in range(3):
            f(*xs).block_until_ready()
    cudart.cudaProfilerStart()
    for f, xs in calls:
        for _ in range(n):
            f(*xs).block_until_ready()
    cudart.cudaProfilerStop()


if __name__ == "__main__":
    main()
