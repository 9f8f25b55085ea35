"""Sweeps SM90 schedules on the large shapes (H200), for the planner's choices.

    python benchmarks/tune_sm90.py [--shapes 8192x8192x8192,...] [--dtype bfloat16] [--jobs 15]

For each shape the planner's plan is varied in schedule (cooperative 128x256, or ping-pong with
a 128x192, 128x128 or 64x256 tile per warp group), cluster shape and raster swizzle
(`planning.sm90_variant` refills the A/B stages for each tile) and timed through
`jax_sm100.matmul(plan=...)` with `jax_sm100.bench`'s wall method, beside `jnp.dot`, which is
timed before and after the variants so drift shows. Every variant's result is checked against
`jnp.dot`'s before it is timed. All binaries are compiled first by `--jobs` CPU workers.
Prints one line per variant, then the best per shape.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_sm100
from jax_sm100 import bench
from jax_sm100._src import planning
from jax_sm100._src.kernels.spec import KernelSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check  # noqa: E402  (its parallel precompile)

SHAPES = ((8192, 8192, 8192), (16384, 4096, 4096), (4096, 4096, 4096), (4096, 14336, 4096))
# (pingpong, tile_mn)
SCHEDULES = ((False, (128, 256)), (True, (128, 192)), (True, (128, 128)), (True, (64, 256)))
CLUSTERS = ((2, 1), (1, 2))
SWIZZLES = (1, 8)


def variants(base):
    out = []
    for (pp, tile), cluster, swz in itertools.product(SCHEDULES, CLUSTERS, SWIZZLES):
        try:
            out.append(planning.sm90_variant(base, tile_mn=tile, cluster_mn=cluster,
                                             pingpong=pp, swizzle_size=swz))  # fmt: skip
        except planning.C.PlanError as e:
            print(f"  skip {tile} pingpong={pp} {cluster} swizzle {swz}: {e}")
    return out


def describe(p) -> str:
    tm, tn, _ = p.cta_tile_mnk
    kind = "pingpong" if p.pingpong else "coop"
    return (f"{kind:8s} {tm}x{tn} cluster {p.cluster_shape_mn[0]}x{p.cluster_shape_mn[1]} "
            f"swz {p.swizzle_size} stages {p.num_ab_stages}")  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--jobs", type=int, default=0)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    dt = jnp.dtype(args.dtype)
    sms = jax.devices()[0].core_count
    plans = {}
    for m, n, k in shapes:
        base = jax_sm100.plan(m, n, k, a_dtype=dt, b_dtype=dt, arch="sm_90a")
        plans[m, n, k] = (base, variants(planning.dataclasses.replace(base, num_sms=sms)))
    if args.jobs > 1:
        pairs = [(p, KernelSpec.for_plan(p)) for _, vs in plans.values() for p in vs]
        gpu_check.precompile_parallel(pairs, args.jobs)
        print(f"precompiled {len(pairs)} variants", flush=True)
    best = {}
    for (m, n, k), (base, vs) in plans.items():
        ka, kb = jax.random.split(jax.random.key(m + n + k))
        a = jax.random.normal(ka, (m, k), jnp.float32).astype(dt)
        b = jax.random.normal(kb, (k, n), jnp.float32).astype(dt)
        ref = np.asarray(jnp.dot(a, b).astype(jnp.float32))
        flops = 2 * m * n * k
        dot_f = jax.jit(jnp.dot)
        dot_s = bench.time_per_call(dot_f, a, b, reps=args.reps)
        print(f"{m}x{n}x{k}: jnp.dot {flops / dot_s / 1e12:.0f} TF/s; planner: {describe(base)}",
              flush=True)  # fmt: skip
        rows = []
        for p in vs:
            f = jax.jit(lambda a, b, p=p: jax_sm100.matmul(a, b, plan=p))
            try:
                out = np.asarray(f(a, b).astype(jnp.float32))
                err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                s = bench.time_per_call(f, a, b, reps=args.reps)
            except Exception as e:  # noqa: BLE001  (report the variant, keep sweeping)
                print(f"  {describe(p)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            bad = "  WRONG" if not err < 1e-2 else ""
            print(f"  {describe(p)}: {flops / s / 1e12:6.0f} TF/s {dot_s / s:5.3f}x "
                  f"err {err:.1e}{bad}", flush=True)  # fmt: skip
            if not bad:
                rows.append((s, describe(p)))
        dot_s2 = bench.time_per_call(dot_f, a, b, reps=args.reps)
        print(f"  jnp.dot again: {flops / dot_s2 / 1e12:.0f} TF/s", flush=True)
        dot_mid = (dot_s + dot_s2) / 2
        rows.sort()
        best[m, n, k] = [(name, dot_mid / s) for s, name in rows[:3]]
    print("\nbest per shape (ratio to the mean of the two jnp.dot timings):")
    for key, top in best.items():
        print(f"  {key}: " + "; ".join(f"{name} {r:.3f}x" for name, r in top))


if __name__ == "__main__":
    main()
