"""Sweeps the SM90 plan's rasterization and cluster on the large shapes (H200), for the planner.

    python benchmarks/tune_sm90.py [--shapes 8192x8192x8192,...]

For each shape the planner's plan is varied in swizzle_size, raster order and cluster shape
(tile kept) and timed through `jax_sm100.matmul(plan=...)` with `jax_sm100.bench`'s method,
beside `jnp.dot`. Prints one line per variant and the best per shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import jax
import jax.numpy as jnp

import jax_sm100
from jax_sm100 import bench

SHAPES = ((8192, 8192, 8192), (16384, 4096, 4096), (4096, 4096, 4096), (4096, 14336, 4096))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    dt = jnp.dtype(args.dtype)
    sms = jax.devices()[0].core_count
    best = {}
    for m, n, k in shapes:
        ka, kb = jax.random.split(jax.random.key(m + n + k))
        a = jax.random.normal(ka, (m, k), jnp.float32).astype(dt)
        b = jax.random.normal(kb, (k, n), jnp.float32).astype(dt)
        flops = 2 * m * n * k
        dot_s = bench.time_per_call(jax.jit(jnp.dot), a, b, reps=30)
        base = jax_sm100.plan(m, n, k, a_dtype=dt, b_dtype=dt, arch="sm_90a")
        base = dataclasses.replace(base, num_sms=sms)
        print(f"{m}x{n}x{k}: jnp.dot {flops / dot_s / 1e12:.0f} TF/s; plan {base.cta_tile_mnk}")
        for swz, along_m, cluster in itertools.product(
            (1, 2, 4, 8), (True, False), ((2, 1), (1, 2), (1, 1))
        ):
            try:
                p = dataclasses.replace(
                    base, swizzle_size=swz, raster_along_m=along_m, cluster_shape_mn=cluster
                )
                f = jax.jit(lambda a, b, p=p: jax_sm100.matmul(a, b, plan=p))
                s = bench.time_per_call(f, a, b, reps=30)
            except Exception as e:  # noqa: BLE001  (a variant the kernel refuses is skipped)
                print(f"  swizzle {swz} along_m {along_m} cluster {cluster}: {type(e).__name__}")
                continue
            tf = flops / s / 1e12
            print(f"  swizzle {swz} along_m {along_m:d} cluster {cluster}: {tf:6.0f} TF/s "
                  f"{dot_s / s:5.3f}x")  # fmt: skip
            key = (m, n, k)
            if key not in best or s < best[key][0]:
                best[key] = (s, swz, along_m, cluster, dot_s / s)
    print("\nbest per shape:")
    for key, (_s, swz, along_m, cluster, ratio) in best.items():
        print(f"  {key}: swizzle {swz} along_m {along_m} cluster {cluster}  {ratio:.3f}x jnp.dot")


if __name__ == "__main__":
    main()
