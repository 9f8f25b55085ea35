"""One-call GPU check: build the FFI, run a randomized correctness matrix through `jax.jit`, time.

Usage on the H200 (see benchmarks/RESULTS.md):

    python benchmarks/gpu_check.py [--cases N] [--bench] [--jobs J]
        [--pingpong | --epi-n 64 | --large-configs | --stream-k] [--sms 10] [--planner-routing]

`--stream-k --sms 10` runs every cooperative plan on the stream-K schedule, planned for a
pretend 10-SM device so that the matrix's small problems have more tiles than clusters.

Correctness compares every case against a float32 (HIGHEST precision) XLA reference on the same
inputs by ||out - ref|| / ||ref||, with a per-dtype tolerance; NaNs fail. The kernel path taken
by each case (kernel, tile, split, fallback reason) is printed from `gpu_lowering.explain()`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import jax_sm100
from jax_sm100._src import compile as compile_mod
from jax_sm100._src import gpu_lowering, planning
from jax_sm100._src import primitive as P
from jax_sm100._src.kernels.spec import KernelSpec

TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 5e-3, "float8_e4m3fn": 8e-2}


def _rand(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def make_cases(n_cases: int, seed: int = 0) -> list[dict]:
    """A deterministic random matrix of problems covering sizes, batch, layouts, epilogues."""
    rng = np.random.default_rng(seed)
    sizes = [1, 7, 8, 16, 64, 100, 128, 136, 200, 256, 384, 520, 1000, 1024]
    cases = []
    for i in range(n_cases):
        dtype = ["bfloat16", "float16"][i % 2]
        m = int(rng.choice(sizes))
        n = int(rng.choice(sizes[3:])) // 8 * 8 or 8
        k = int(rng.choice(sizes[3:])) // 8 * 8 or 8
        ta, tb = bool(rng.integers(2)), bool(rng.integers(2))
        if ta:
            m = max(8, m // 8 * 8)
        has_c = bool(i % 5 == 1)
        cases.append(dict(
            m=m, n=n, k=k, batch=[(), (), (3,), (2, 2)][i % 4], dtype=dtype, ta=ta, tb=tb,
            act=[None, "relu", "gelu", "silu"][(i // 2) % 4], alpha=[1.0, 0.5][(i // 3) % 2],
            beta=0.75 if has_c else 1.0, has_c=has_c, has_bias=bool(i % 3 == 2),
            out_dtype=dtype if i % 7 else "float32",
        ))  # fmt: skip
    return cases


def _inputs(case, seed):
    rng = np.random.default_rng(seed)
    m, n, k, batch, dt = case["m"], case["n"], case["k"], case["batch"], case["dtype"]
    a_shape = (*batch, k, m) if case["ta"] else (*batch, m, k)
    b_shape = (*batch, n, k) if case["tb"] else (*batch, k, n)
    a = rng.standard_normal(a_shape, np.float32).astype(jnp.dtype(dt))
    b = rng.standard_normal(b_shape, np.float32).astype(jnp.dtype(dt))
    bias = rng.standard_normal((*([1] * len(batch)), n), np.float32) if case["has_bias"] else None
    c = None
    if case["has_c"]:
        c = rng.standard_normal((*batch, m, n), np.float32).astype(jnp.dtype(case["out_dtype"]))
    return a, b, bias, c


def _np_reference(case, a, b, bias, c):
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    if case["ta"]:
        a32 = np.swapaxes(a32, -1, -2)
    if case["tb"]:
        b32 = np.swapaxes(b32, -1, -2)
    z = case["alpha"] * np.matmul(a32, b32)
    if c is not None:
        z = z + case["beta"] * c.astype(np.float32)
    if bias is not None:
        z = z + bias[..., None, :]
    act = case["act"]
    if act == "relu":
        z = np.maximum(z, 0)
    elif act == "gelu":
        z = 0.5 * z * (1 + np.tanh(0.7978845608028654 * (z + 0.044715 * z**3)))
    elif act == "silu":
        z = z / (1 + np.exp(-z))
    return z


def _bind_fn(case):
    params = dict(transpose_a=case["ta"], transpose_b=case["tb"], alpha=case["alpha"],
                  beta=case["beta"], activation=case["act"],
                  out_dtype=np.dtype(jnp.dtype(case["out_dtype"])), has_bias=case["has_bias"],
                  has_c=case["has_c"], plan=None, save_preact=False, act_grad=None)  # fmt: skip
    return jax.jit(lambda *xs: P.matmul_p.bind(*xs, **params)[0])


class _Collected(Exception):
    pass


def collect_binaries(cases) -> list:
    """(plan, spec) of every kernel the cases need."""
    calls = []
    for i, case in enumerate(cases):
        calls.append((_bind_fn(case), [x for x in _inputs(case, i) if x is not None]))
    return binaries_of(calls)


def binaries_of(calls) -> list:
    """(plan, spec) of every kernel that `calls` ((jitted function, arguments) pairs) compile,
    found by lowering each for CUDA with compiling stubbed: exactly what the calls will ask for."""
    seen, pairs = set(), []
    real = compile_mod.compile_plan

    def record(plan, spec=None):
        key = compile_mod.binary_key(plan, spec or KernelSpec.for_plan(plan))
        if key not in seen:
            seen.add(key)
            pairs.append((plan, spec))
        raise _Collected

    compile_mod.compile_plan = record
    try:
        for fn, args in calls:
            avals = [None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
            try:
                fn.trace(*avals).lower(lowering_platforms=("cuda",))
            except Exception:  # the stub stops every lowering that reaches a kernel
                pass
    finally:
        compile_mod.compile_plan = real
    return pairs


def _compile_one(pair):
    plan, spec = pair
    t = time.perf_counter()
    compile_mod.compile_plan(plan, spec)
    return time.perf_counter() - t


def precompile_parallel(pairs, jobs: int):
    """Fills the on-disk kernel cache with `jobs` CPU-only worker processes."""
    saved = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = "cpu"  # the workers must not take the GPU
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            times = list(pool.map(_compile_one, pairs))
    finally:
        if saved is None:
            os.environ.pop("JAX_PLATFORMS")
        else:
            os.environ["JAX_PLATFORMS"] = saved
    return times


def correctness(n_cases: int, seed: int = 0, jobs: int = 0):
    cases = make_cases(n_cases, seed)
    if jobs > 1:
        t = time.perf_counter()
        pairs = collect_binaries(cases)
        times = precompile_parallel(pairs, jobs) if pairs else [0.0]
        print(f"precompiled {len(pairs)} binaries with {jobs} workers in "
              f"{time.perf_counter() - t:.1f} s (per compile median {np.median(times):.2f} s, "
              f"max {max(times):.2f} s)", flush=True)  # fmt: skip
    fails, paths = 0, {}
    t0 = time.perf_counter()
    for i, case in enumerate(cases):
        a, b, bias, c = _inputs(case, i)
        args = [jnp.asarray(x) for x in (a, b, bias, c) if x is not None]
        try:
            out = np.asarray(_bind_fn(case)(*args).astype(jnp.float32))
            how = gpu_lowering.explain()
            ref = _np_reference(case, a, b, bias, c)
            err = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
            ok = out.shape == ref.shape and np.isfinite(out).all() and err < TOL[case["dtype"]]
            path = how.plan.kernel if how is not None and how.plan is not None else "xla"
        except Exception as e:  # report and count, keep going
            ok, err, path = False, float("nan"), f"EXC {type(e).__name__}: {str(e)[:300]}"
        fails += not ok
        paths[path] = paths.get(path, 0) + 1
        if not ok:
            print("FAIL", case, err, path, flush=True)
        if i % 25 == 0 or i == n_cases - 1:
            bar = "#" * int(30 * (i + 1) / n_cases)
            print(f"[{bar:30s}] {i + 1}/{n_cases} fails={fails} "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)  # fmt: skip
    print(f"correctness: {n_cases} cases, {fails} failures; paths {paths}", flush=True)
    return fails


def grad_check():
    key = jax.random.key(1)
    a = _rand(key, (256, 512), jnp.bfloat16)
    b = _rand(jax.random.split(key)[0], (512, 384), jnp.bfloat16)

    def loss(fn, a, b):
        return jnp.sum(fn(a, b).astype(jnp.float32) ** 2)

    g = jax.jit(jax.grad(lambda a, b: loss(lambda x, y: jax_sm100.matmul(x, y, activation="gelu"),
                                             a, b), argnums=(0, 1)))(a, b)  # fmt: skip
    r = jax.grad(lambda a, b: loss(lambda x, y: jax.nn.gelu(
        jnp.dot(x.astype(jnp.float32), y.astype(jnp.float32))).astype(jnp.bfloat16), a, b),
        argnums=(0, 1))(a, b)  # fmt: skip
    errs = []
    for x, y in zip(g, r, strict=True):
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        errs.append(float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y)))
    v = jax.jit(jax.vmap(lambda x: jax_sm100.matmul(x, b)))(_rand(key, (4, 64, 512), jnp.bfloat16))
    print("grad rel errs", errs, "vmap shape", v.shape, flush=True)
    return all(e < 3e-2 for e in errs)


def force_kernels():
    """Plans our kernels for every problem a kernel can take, small ones included.

    The planner sends sm_90a problems under `planning.SM90_MIN_FLOPS` to XLA's dot (faster
    there); this matrix is about the kernels' correctness, so it plans them anyway.
    """
    real = planning.plan

    def plan(*args, **kw):
        return real(*args, **{**kw, "force_kernel": True})

    planning.plan = plan


def _vary_sm90_plans(edits):
    """Replaces each SM90 plan of this process by `sm90_variant(plan, **edit)`, edits rotating.

    The first edit tried for a problem is picked by a hash of its plan, not by call order, so
    the precompile workers and this process give each problem the same variant (a rotation by
    call count gave the workers other variants than the cases then asked for, and every case
    compiled again). An edit that is illegal for a plan (a tile too big for its problem, say) is
    skipped for the next one; a plan no edit fits stays as planned.
    """
    real = planning.plan
    edits = list(edits)

    def plan(*args, **kw):
        p = real(*args, **kw)
        if p.kernel not in (planning.KERNEL_SM90, planning.KERNEL_SM90_SPLITK):
            return p
        first = zlib.crc32(repr(p).encode())
        for i in range(len(edits)):
            try:
                return planning.sm90_variant(p, **edits[(first + i) % len(edits)])
            except planning.C.PlanError:
                continue
        return p

    planning.plan = plan


def force_pingpong():
    """Every SM90 plan a ping-pong one, cycling through its tile shapes: the schedule on the
    whole case matrix, whatever the planner prefers."""
    tiles = ((128, 128), (128, 160), (128, 192), (64, 256), (64, 128))
    edits = [dict(tile_mn=t, pingpong=True) for t in tiles]
    # The planner's own ping-pong plans for many waves: clusters of 2x1 walked along N in
    # swizzled bands (on small problems the swizzle pads the rows with clusters outside the
    # matrix, which must leave it untouched).
    edits += [dict(tile_mn=t, pingpong=True, cluster_mn=(2, 1), raster_along_m=False,
                   swizzle_size=z) for t, z in (((128, 160), 8), ((128, 192), 2))]  # fmt: skip
    _vary_sm90_plans(edits)


# The cooperative configurations the planner picks for large problems, to run on the small
# problems of the matrix: (tile_mn, cluster_mn, swizzle_size).
_LARGE_CONFIGS = (
    ((128, 256), (2, 1), 8),
    ((128, 256), (1, 2), 8),
    ((128, 256), (1, 2), 1),
    ((128, 128), (2, 1), 1),
    ((64, 256), (1, 2), 1),
    ((128, 256), (1, 1), 1),
    ((256, 128), (1, 2), 1),
    ((256, 128), (2, 1), 8),
    ((128, 160), (2, 1), 1),
)


def force_large_configs():
    """Every SM90 plan cycled through the planner's large-problem configurations.

    The matrix's problems (sizes up to 1024) mostly plan 64x128 tiles; this runs the same cases
    on the 128x256 / 1x2 / swizzle-8 configurations large problems use, fused epilogues included.
    """
    _vary_sm90_plans(dict(tile_mn=t, cluster_mn=c, swizzle_size=z) for t, c, z in _LARGE_CONFIGS)


def force_stream_k():
    """Every cooperative unsplit SM90 plan on the stream-K schedule, in its own tile or cycled
    through the large-problem configurations. Run it with `--sms` small, so the matrix's problems
    have more tiles than the grid has clusters and the stream-K phase runs."""
    edits = [dict(stream_k=True, pingpong=False)] + [
        dict(tile_mn=t, cluster_mn=c, swizzle_size=z, stream_k=True, pingpong=False)
        for t, c, z in _LARGE_CONFIGS
    ]
    _vary_sm90_plans(edits)


def pretend_sms(num_sms: int):
    """Plans (and so persistent grids) for a device of `num_sms` SMs: small grids put many
    tiles on each cluster, which the small problems of the matrix otherwise never do."""
    arch, _ = gpu_lowering.device_info()
    gpu_lowering.device_info = lambda: (arch, num_sms)


def force_epi_n(epi_n: int):
    """Every SM90 plan with epilogue sub-tiles `epi_n` wide, where legal."""
    _vary_sm90_plans([dict(epi_n=epi_n)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--pingpong", action="store_true", help="force ping-pong SM90 plans")
    ap.add_argument("--epi-n", type=int, default=0, help="force this SM90 epilogue width")
    ap.add_argument("--stream-k", action="store_true", help="force stream-K SM90 plans")
    ap.add_argument("--sms", type=int, default=0, help="plan for this many SMs (small grids)")
    ap.add_argument("--large-configs", action="store_true",
                    help="cycle SM90 plans through large-problem tiles and clusters")  # fmt: skip
    ap.add_argument("--planner-routing", action="store_true",
                    help="let small problems go to XLA's dot as the planner says")  # fmt: skip
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--jobs", type=int, default=0, help="parallel precompile workers")
    args = ap.parse_args()
    print("devices", jax.devices(), "info", gpu_lowering.device_info(), flush=True)
    if not args.planner_routing:
        force_kernels()
    if args.pingpong:
        force_pingpong()
    if args.epi_n:
        force_epi_n(args.epi_n)
    if args.sms:
        pretend_sms(args.sms)
    if args.stream_k:
        force_stream_k()
    if args.large_configs:
        force_large_configs()
    fails = correctness(args.cases, jobs=args.jobs)
    ok_grad = grad_check()
    if args.bench:
        from jax_sm100 import bench  # noqa: PLC0415  (the one benchmark, same method)

        bench.main([])
    print("compile cache", compile_mod.cache_stats())
    print("RESULT correctness_fails", fails, "grad_ok", ok_grad)
    return 0 if fails == 0 and ok_grad else 1


if __name__ == "__main__":
    sys.exit(main())
