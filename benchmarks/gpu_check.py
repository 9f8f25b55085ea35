"""One-call GPU check: build the FFI, run a randomized correctness matrix through `jax.jit`, time.

Usage on the H200 (see benchmarks/RESULTS.md):

    python benchmarks/gpu_check.py [--cases N] [--bench] [--quick]

Correctness compares every case against a float32 (HIGHEST precision) XLA reference on the same
inputs by ||out - ref|| / ||ref||, with a per-dtype tolerance; NaNs fail. The kernel path taken
by each case (kernel, tile, split, fallback reason) is printed from `gpu_lowering.explain()`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sm100
from jax_sm100._src import compile as compile_mod
from jax_sm100._src import gpu_lowering
from jax_sm100._src import primitive as P

TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 5e-3, "float8_e4m3fn": 8e-2}


def _rand(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def run_case(key, m, n, k, batch, dtype, ta, tb, act, alpha, beta, has_c, has_bias, out_dtype):
    ks = jax.random.split(key, 4)
    a_shape = (*batch, k, m) if ta else (*batch, m, k)
    b_shape = (*batch, n, k) if tb else (*batch, k, n)
    a = _rand(ks[0], a_shape, dtype)
    b = _rand(ks[1], b_shape, dtype)
    nb = len(batch)
    bias = _rand(ks[2], (*([1] * nb), n), jnp.float32) if has_bias else None
    c = _rand(ks[3], (*batch, m, n), out_dtype) if has_c else None
    params = dict(transpose_a=ta, transpose_b=tb, alpha=alpha, beta=beta, activation=act,
                  out_dtype=np.dtype(out_dtype), has_bias=has_bias, has_c=has_c,
                  plan=None)  # fmt: skip
    args = [a, b] + [x for x in (bias, c) if x is not None]
    out = jax.jit(lambda *xs: P.matmul_p.bind(*xs, **params))(*args)
    how = gpu_lowering.explain()
    ref = P.reference_matmul(a, b, bias, c, upcast=True, transpose_a=ta, transpose_b=tb,
                             alpha=alpha, beta=beta, activation=act,
                             out_dtype=jnp.float32)  # fmt: skip
    o = np.asarray(out.astype(jnp.float32))
    r = np.asarray(ref)
    err = float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))
    ok = np.isfinite(o).all() and err < TOL[np.dtype(dtype).name] and o.shape == r.shape
    return ok, err, how


def correctness(n_cases: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    fails, rows = 0, []
    sizes = [1, 7, 8, 16, 64, 100, 128, 136, 200, 256, 384, 520, 1000, 1024]
    for i in range(n_cases):
        dtype = ["bfloat16", "float16"][i % 2]
        m = int(rng.choice(sizes))
        n = int(rng.choice(sizes[3:])) // 8 * 8 or 8
        k = int(rng.choice(sizes[3:])) // 8 * 8 or 8
        ta, tb = bool(rng.integers(2)), bool(rng.integers(2))
        if ta:
            m = max(8, m // 8 * 8)
        batch = [(), (), (3,), (2, 2)][i % 4]
        act = [None, "relu", "gelu", "silu"][(i // 2) % 4]
        alpha = [1.0, 0.5][(i // 3) % 2]
        has_c, has_bias = bool(i % 5 == 1), bool(i % 3 == 2)
        beta = 0.75 if has_c else 1.0
        out_dtype = dtype if i % 7 else "float32"
        key, sub = jax.random.split(key)
        desc = (m, n, k, batch, dtype, ta, tb, act, alpha, beta, has_c, has_bias, out_dtype)
        try:
            ok, err, how = run_case(sub, m, n, k, batch, dtype, ta, tb, act, alpha, beta,
                                    has_c, has_bias, out_dtype)  # fmt: skip
        except Exception as e:  # report and count, keep going
            ok, err, how = False, float("nan"), f"EXC {type(e).__name__}: {str(e)[:300]}"
        fails += not ok
        path = how.plan.kernel if (isinstance(how, gpu_lowering.Lowered) and how.plan) else "-"
        rows.append((ok, err, desc, path))
        if ok and how is not None and not isinstance(how, str) and how.plan is not None:
            print("ok", desc, f"{err:.1e}", how.plan.cta_tile_mnk, how.plan.split_k, flush=True)
        if not ok:
            print("FAIL", desc, err, how, flush=True)
        if i % 20 == 0:
            print(f"[{i}/{n_cases}] fails={fails} last={desc} err={err:.2e} {path}", flush=True)
    kernels = {}
    for _, _, _, path in rows:
        kernels[path] = kernels.get(path, 0) + 1
    print(f"correctness: {n_cases} cases, {fails} failures; paths {kernels}", flush=True)
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


def _time(fn, *args, reps=30):
    out = fn(*args)
    out.block_until_ready()
    for _ in range(3):
        fn(*args).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        out.block_until_ready()
        times.append((time.perf_counter() - t) / reps)
    return float(np.median(times))


BENCH_SHAPES = [
    (8192, 8192, 8192),
    (4096, 4096, 4096),
    (16384, 4096, 4096),
    (4096, 14336, 4096),
    (2048, 2048, 2048),
    (256, 8192, 8192),
    (64, 4096, 4096),
    (128, 128, 128),
]


def bench(dtypes=("bfloat16", "float16")):
    rows = []
    for dtype in dtypes:
        for m, n, k in BENCH_SHAPES:
            key = jax.random.key(m + n + k)
            a = _rand(key, (m, k), dtype)
            b = _rand(jax.random.split(key)[1], (k, n), dtype)
            t0 = time.perf_counter()
            ours = jax.jit(lambda x, y: jax_sm100.matmul(x, y))
            ours(a, b).block_until_ready()
            first = time.perf_counter() - t0
            how = gpu_lowering.explain()
            ref = jax.jit(lambda x, y: jnp.dot(x, y))
            reps = 200 if m * n * k < 2**30 else 30
            t_ours = _time(ours, a, b, reps=reps)
            t_ref = _time(ref, a, b, reps=reps)
            flop = 2 * m * n * k
            rows.append((dtype, (m, n, k), flop / t_ours / 1e12, flop / t_ref / 1e12,
                         t_ref / t_ours, t_ours * 1e6, t_ref * 1e6, first,
                         how.plan.kernel if how and how.plan else "-"))  # fmt: skip
            print(rows[-1], flush=True)
    print(
        "\ndtype     shape                ours TF/s  dot TF/s  ratio  ours us   dot us  "
        "first-call s  kernel"
    )
    for r in rows:
        print(f"{r[0]:9s} {str(r[1]):20s} {r[2]:9.1f} {r[3]:9.1f} {r[4]:6.3f} {r[5]:8.1f} "
              f"{r[6]:8.1f} {r[7]:8.2f}  {r[8]}")  # fmt: skip
    big = [r[4] for r in rows if min(r[1]) >= 4096 or max(r[1]) >= 4096 and r[1][0] >= 4096]
    if big:
        print("geomean ratio (m >= 4096):", math.exp(sum(map(math.log, big)) / len(big)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--bench", action="store_true")
    args = ap.parse_args()
    print("devices", jax.devices(), "info", gpu_lowering.device_info(), flush=True)
    fails = correctness(args.cases)
    ok_grad = grad_check()
    if args.bench:
        bench()
    print("compile cache", compile_mod.cache_stats())
    print("RESULT correctness_fails", fails, "grad_ok", ok_grad)
    return 0 if fails == 0 and ok_grad else 1


if __name__ == "__main__":
    sys.exit(main())
