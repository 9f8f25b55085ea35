"""Sweeps SM90 schedules on the large shapes (H200), for the planner's choices.

    python benchmarks/tune_sm90.py [--shapes 8192x8192x8192,...] [--dtype bfloat16] [--jobs 15]
        [--pingpong-tiles 128x192,128x128] [--clusters 2x1,1x2] [--swizzles 1,8] [--epi-n 0]

For each shape the planner's plan is varied in schedule (cooperative 128x256, or ping-pong with
a 128x192, 128x128 or 64x256 tile per warp group), cluster shape and raster swizzle
(`planning.sm90_variant` refills the A/B stages for each tile) and timed through
`jax_sm100.matmul(plan=...)` with `jax_sm100.bench`'s wall method, beside `jnp.dot`, in
interleaved rounds (median kept) so clock drift spreads over every variant. Every variant's
result is checked against `jnp.dot`'s before it is timed. All binaries are compiled first by
`--jobs` CPU workers. Prints one line per variant, then the best per shape.
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


def variants(base, schedules, clusters, swizzles, epi_ns):
    out = []
    for (pp, tile), cluster, swz, epi_n in itertools.product(schedules, clusters, swizzles, epi_ns):
        try:
            out.append(planning.sm90_variant(base, tile_mn=tile, cluster_mn=cluster, pingpong=pp,
                                             swizzle_size=swz, epi_n=epi_n))  # fmt: skip
        except planning.C.PlanError as e:
            print(f"  skip {tile} pingpong={pp} {cluster} swizzle {swz} epi_n {epi_n}: {e}")
    return out


def _pairs(text):
    return tuple(tuple(int(v) for v in s.split("x")) for s in text.split(",") if s)


def describe(p) -> str:
    tm, tn, _ = p.cta_tile_mnk
    kind = "pingpong" if p.pingpong else "coop"
    return (f"{kind:8s} {tm}x{tn} cluster {p.cluster_shape_mn[0]}x{p.cluster_shape_mn[1]} "
            f"swz {p.swizzle_size} epi {p.epi_tile[0]}x{p.epi_tile[1]} "
            f"stages {p.num_ab_stages}")  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--jobs", type=int, default=0)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pingpong-tiles", default="128x192,128x128", help="'' for none")
    ap.add_argument("--clusters", default="2x1,1x2")
    ap.add_argument("--swizzles", default="1,8")
    ap.add_argument("--epi-n", default="0", help="epilogue sub-tile widths; 0 = the planner's")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    dt = jnp.dtype(args.dtype)
    sms = jax.devices()[0].core_count
    schedules = ((False, (128, 256)),) + tuple((True, t) for t in _pairs(args.pingpong_tiles))
    clusters = _pairs(args.clusters)
    swizzles = tuple(int(v) for v in args.swizzles.split(","))
    epi_ns = tuple(int(v) for v in args.epi_n.split(","))
    plans = {}
    for m, n, k in shapes:
        base = jax_sm100.plan(m, n, k, a_dtype=dt, b_dtype=dt, arch="sm_90a")
        base_sms = planning.dataclasses.replace(base, num_sms=sms)
        plans[m, n, k] = (base, variants(base_sms, schedules, clusters, swizzles, epi_ns))
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
        print(f"{m}x{n}x{k}: planner: {describe(base)}", flush=True)
        fns = {"jnp.dot": jax.jit(jnp.dot)}
        for p in vs:
            f = jax.jit(lambda a, b, p=p: jax_sm100.matmul(a, b, plan=p))
            try:
                out = np.asarray(f(a, b).astype(jnp.float32))
            except Exception as e:  # noqa: BLE001  (report the variant, keep sweeping)
                print(f"  {describe(p)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            if not err < 1e-2:
                print(f"  {describe(p)}: WRONG, relative error {err:.1e}", flush=True)
                continue
            fns[describe(p)] = f
        # Interleaved rounds: every variant is timed once per round, so clock drift over the
        # sweep spreads over all of them; the median over rounds is kept.
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, f in fns.items():
                times[name].append(bench.time_per_call(f, a, b, reps=args.reps, rounds=1))
        med = {name: float(np.median(t)) for name, t in times.items()}
        dot_s = med["jnp.dot"]
        for name, s in med.items():
            spread = (max(times[name]) - min(times[name])) / s
            print(f"  {name:44s} {flops / s / 1e12:6.0f} TF/s {dot_s / s:5.3f}x "
                  f"(spread {spread:.0%})", flush=True)  # fmt: skip
        rows = sorted((s, name) for name, s in med.items() if name != "jnp.dot")
        best[m, n, k] = [(name, dot_s / s) for s, name in rows[:3]]
    print("\nbest per shape (ratio to jnp.dot, medians of interleaved rounds):")
    for key, top in best.items():
        print(f"  {key}: " + "; ".join(f"{name} {r:.3f}x" for name, r in top))


if __name__ == "__main__":
    main()
