"""Runs ours and jnp.dot on one shape inside a CUDA profiler range, for Nsight Compute.

    ncu --profile-from-start off --metrics <list> --csv \\
        python3 benchmarks/ncu_probe.py --shape 16384x4096x4096 [--dtype bfloat16]
            [--tile 128x160 --cluster 2x1 --pingpong]   # another SM90 plan than the planner's

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
    args = ap.parse_args()
    m, n, k = (int(v) for v in args.shape.split("x"))
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(args.dtype)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(args.dtype)
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
    for f in (ours, dot):
        for _ in range(3):
            f(a, b).block_until_ready()
    cudart.cudaProfilerStart()
    for f in (ours, dot):
        for _ in range(args.calls):
            f(a, b).block_until_ready()
    cudart.cudaProfilerStop()
    print(f"profiled {args.calls} calls of jax_sm100.matmul, then of jnp.dot, at {args.shape}")


if __name__ == "__main__":
    main()
