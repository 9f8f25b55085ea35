"""Runs ours and jnp.dot on one shape inside a CUDA profiler range, for Nsight Compute.

    ncu --profile-from-start off --metrics <list> --csv \\
        python3 benchmarks/ncu_probe.py --shape 16384x4096x4096 [--dtype bfloat16]

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x4096x4096")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args()
    m, n, k = (int(v) for v in args.shape.split("x"))
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(args.dtype)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(args.dtype)
    ours = jax.jit(lambda a, b: jax_sm100.matmul(a, b))
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
