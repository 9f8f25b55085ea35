"""Sweeps SM90 schedules on the large shapes (H200), for the planner's choices.

    python benchmarks/tune_sm90.py [--shapes 8192x8192x8192,...] [--dtype bfloat16] [--jobs 15]
        [--pingpong-tiles 128x192,128x128] [--clusters 2x1,1x2] [--swizzles 1,8] [--epi-n 0]
        [--tiles 128x256] [--stages 0] [--epi-stages 2,4] [--rasters planner,m,n]
        [--stream-k 0,1]
        [--method wall|device]

Split-K (skinny shapes): `--splits 2,4,8 --tiles 64x128,64x256 --method device` times each tile
with each split factor, partials summed by XLA and in the cluster (`--split-reduce`).

Small shapes (which the planner sends to XLA's dot), e.g. whether cluster 1x1 or fewer stages
remove our kernel's start-up cost there:

    python benchmarks/tune_sm90.py --shapes 1024x1024x1024,512x2048x512 --method device \\
        --tiles 64x128,128x128 --pingpong-tiles "" --clusters 1x1,2x1 --swizzles 1 --stages 0,2,4

For each shape the planner's plan is varied in schedule (cooperative tiles, or ping-pong with
a 128x192, 128x128 or 64x256 tile per warp group), cluster shape, raster swizzle, epilogue width
and A/B stage cap (`planning.sm90_variant` refills the stages for each tile) and timed through
`jax_sm100.matmul(plan=...)` beside `jnp.dot`, by `jax_sm100.bench`'s wall method in interleaved
rounds (median kept) so clock drift spreads over every variant, or by its device method. Every
variant's result is checked against `jnp.dot`'s before it is timed. All binaries are compiled
first by `--jobs` CPU workers. Prints one line per variant, then the best per shape.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import multiprocessing
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_sm100
from jax_sm100 import bench
from jax_sm100._src import compile as compile_mod
from jax_sm100._src import planning
from jax_sm100._src.kernels.spec import KernelSpec

SHAPES = ((8192, 8192, 8192), (16384, 4096, 4096), (4096, 4096, 4096), (4096, 14336, 4096))


def _compile_one(pair):
    compile_mod.compile_plan(*pair)


def precompile_parallel(pairs, jobs: int) -> None:
    """Fills the on-disk kernel cache with the (plan, spec) `pairs`, by `jobs` CPU-only worker
    processes (spawned, so they do not inherit this process's GPU client)."""
    saved = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = "cpu"  # the workers must not take the GPU
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            list(pool.map(_compile_one, pairs))
    finally:
        if saved is None:
            os.environ.pop("JAX_PLATFORMS")
        else:
            os.environ["JAX_PLATFORMS"] = saved


def variants(base, schedules, clusters, swizzles, epi_ns, stages=(0,), epi_stages=(2,),
             rasters=(None,), stream_ks=(False,)):  # fmt: skip
    """Every legal combination; a stage count of 0 keeps the most that fit, others cap it.
    More epilogue stages take shared memory from the A/B ring (refilled to what is left). A
    raster of None keeps the base plan's order; True / False walk tiles along M / N. Stream-K
    (cooperative plans only) balances the last waves."""
    out = []
    for (pp, tile), cluster, swz, epi_n, cap, es, along_m, sk in itertools.product(
        schedules, clusters, swizzles, epi_ns, stages, epi_stages, rasters, stream_ks
    ):
        raster = {} if along_m is None else {"raster_along_m": along_m}
        if sk and pp:
            continue  # stream-K is a cooperative schedule
        try:
            p = planning.sm90_variant(base, tile_mn=tile, cluster_mn=cluster, pingpong=pp,
                                      swizzle_size=swz, epi_n=epi_n, num_epi_stages=es,
                                      stream_k=sk, **raster)  # fmt: skip
        except planning.C.PlanError as e:
            print(f"  skip {tile} pingpong={pp} {cluster} swizzle {swz} epi_n {epi_n}: {e}")
            continue
        if cap and cap >= p.num_ab_stages:
            continue  # the same plan as the uncapped one
        p = planning.dataclasses.replace(p, num_ab_stages=cap) if cap else p
        if p not in out:  # e.g. "planner" and the raster it names
            out.append(p)
    return out


def _pairs(text):
    return tuple(tuple(int(v) for v in s.split("x")) for s in text.split(",") if s)


def split_variants(base, tiles, splits, reduces):
    """Split-K plans of `base`'s problem: each cooperative tile with each split factor, partials
    summed by each of `reduces` ("xla", "cluster")."""
    out = []
    for tile, split, reduce in itertools.product(tiles, splits, reduces):
        try:
            tiled = planning.sm90_variant(base, tile_mn=tile, pingpong=False)
            out.append(planning.with_split(tiled, split, reduce=reduce))
        except planning.C.PlanError as e:
            print(f"  skip {tile} split {split}: {e}")
    return out


def describe(p) -> str:
    tm, tn, _ = p.cta_tile_mnk
    kind = (
        f"split{p.split_k}{p.split_reduce[0]}"
        if p.split_k > 1
        else "pingpong"
        if p.pingpong
        else "coop"
    )
    kind += "+sk" if getattr(p, "stream_k", False) else ""
    # A padded swizzle runs extra clusters outside the matrix: such rows time wasted work.
    pad = "(pad)" if planning.swizzle_pads(p) else ""
    return (f"{kind:8s} {tm}x{tn} cluster {p.cluster_shape_mn[0]}x{p.cluster_shape_mn[1]} "
            f"swz {p.swizzle_size}{pad} epi {p.epi_tile[0]}x{p.epi_tile[1]} "
            f"x{p.num_epi_stages} stages {p.num_ab_stages} "
            f"raster {'M' if p.raster_along_m else 'N'}")  # fmt: skip


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
    ap.add_argument("--tiles", default="128x256", help="cooperative tiles ('' for none)")
    ap.add_argument("--stages", default="0", help="A/B stage caps; 0 = as many as fit")
    ap.add_argument("--epi-stages", default="2", help="epilogue shared-memory stages")
    ap.add_argument("--rasters", default="planner", help="tile order: planner, m, n (comma list)")
    ap.add_argument("--stream-k", default="0", help="stream-K off/on: 0, 1 or 0,1")
    ap.add_argument("--splits", default="",
                    help="split-K factors: time --tiles split by each instead")  # fmt: skip
    ap.add_argument("--split-reduce", default="xla,cluster",
                    help="where split partials are summed: xla, cluster")  # fmt: skip
    ap.add_argument("--method", choices=("wall", "device"), default="wall",
                    help="device: bench's dependent-product loop, for small shapes")  # fmt: skip
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    dt = jnp.dtype(args.dtype)
    sms = jax.devices()[0].core_count
    schedules = tuple((False, t) for t in _pairs(args.tiles)) + tuple(
        (True, t) for t in _pairs(args.pingpong_tiles)
    )
    stages = tuple(int(v) for v in args.stages.split(","))
    clusters = _pairs(args.clusters)
    swizzles = tuple(int(v) for v in args.swizzles.split(","))
    epi_ns = tuple(int(v) for v in args.epi_n.split(","))
    plans = {}
    for m, n, k in shapes:
        # force_kernel: small shapes are tuned too, though the planner sends them to XLA's dot.
        base = jax_sm100.plan(m, n, k, a_dtype=dt, b_dtype=dt, arch="sm_90a", force_kernel=True)
        base_sms = planning.dataclasses.replace(base, num_sms=sms)
        if args.splits:
            splits = tuple(int(v) for v in args.splits.split(","))
            vs = split_variants(base_sms, _pairs(args.tiles), splits, args.split_reduce.split(","))
        else:
            epi_stages = tuple(int(v) for v in args.epi_stages.split(","))
            rasters = tuple({"planner": None, "m": True, "n": False}[r]
                            for r in args.rasters.split(","))  # fmt: skip
            stream_ks = tuple(bool(int(v)) for v in args.stream_k.split(","))
            vs = variants(base_sms, schedules, clusters, swizzles, epi_ns, stages, epi_stages,
                          rasters, stream_ks)  # fmt: skip
        plans[m, n, k] = (base, vs)
    if args.jobs > 1:
        pairs = [(p, KernelSpec.for_plan(p)) for _, vs in plans.values() for p in vs]
        precompile_parallel(pairs, args.jobs)
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
        if args.method == "device":
            got = bench.time_device(list(fns.values()), a, b, rounds=args.rounds)
            for name, t in zip(fns, got, strict=True):
                times[name] = [t.seconds]
                for problem in t.check.problems():
                    print(f"  ! {name}: {problem}", flush=True)
        else:
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
