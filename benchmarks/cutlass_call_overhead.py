"""Per-call overhead side by side: jnp.dot, jax_sm100.matmul, and cutlass.jax.cutlass_call.

The third runs our own SM90 kernel (the plan for the shape) through CUTLASS's closed bridge, so
the difference between the second and third rows is the cost of our FFI path against theirs for
the same binary. Row-major [1, m, k] / [1, k, n] / [1, m, n] buffers are presented to the kernel
as (M, K, L), (N, K, L) and (M, N, L) with `TensorSpec(mode=...)`, without copies.

    python3 benchmarks/cutlass_call_overhead.py [--shape 128x128x128] [--dtype bfloat16]

Written 2026-11-29; not yet run on a GPU (the session's device time was spent on correctness).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_sm100
from jax_sm100._src import dispatch, planning
from jax_sm100._src.kernels.spec import KernelSpec
from jax_sm100.bench import time_per_call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="128x128x128")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=500)
    args = ap.parse_args()
    m, n, k = (int(v) for v in args.shape.split("x"))
    import cutlass.jax as cj  # noqa: PLC0415
    from cutlass import cute  # noqa: PLC0415

    from jax_sm100._src.kernels import sm90_gemm  # noqa: PLC0415

    target = dispatch.device_target() or dispatch.Target("sm_90a")
    problem = planning.make_problem(m, n, k, a_dtype=args.dtype, b_dtype=args.dtype)
    p = dispatch.plan_call(problem, target).plan
    kernel = sm90_gemm.Sm90GemmKernel(p, KernelSpec.for_plan(p))

    @cute.jit
    def gemm(stream, a, b, d):
        kernel(a, b, d, None, None, stream)

    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (1, m, k), jnp.float32).astype(args.dtype)
    b = jax.random.normal(kb, (1, k, n), jnp.float32).astype(args.dtype)
    theirs = jax.jit(
        lambda a, b: cj.cutlass_call(
            gemm,
            output_shape_dtype=jax.ShapeDtypeStruct((1, m, n), a.dtype),
            input_spec=(cj.TensorSpec(mode=(1, 2, 0)), cj.TensorSpec(mode=(2, 1, 0))),
            output_spec=cj.TensorSpec(mode=(1, 2, 0)),
        )(a, b)
    )
    ours = jax.jit(lambda a, b: jax_sm100.matmul(a, b))
    dot = jax.jit(lambda a, b: jnp.matmul(a, b))
    for name, fn in (("jnp.dot", dot), ("jax_sm100.matmul", ours), ("cutlass_call", theirs)):
        t = time_per_call(fn, a, b, reps=args.reps)
        print(f"{name:18s} {t * 1e6:8.1f} us per call at {m}x{n}x{k} {args.dtype}")


if __name__ == "__main__":
    main()
