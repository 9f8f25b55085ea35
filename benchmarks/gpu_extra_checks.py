"""GPU checks beyond gpu_check.py: fp8 operands, CUDA-graph replay, compute-sanitizer memcheck.

    python benchmarks/gpu_extra_checks.py            # all three (memcheck in a child process)
    python benchmarks/gpu_extra_checks.py --cases X  # parts: fp8, graph, memcheck, racecheck,
                                                     # splitk, streamk, pingpong

Each part compares against a float32 XLA reference on normal random data and prints one
`RESULT` line.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_sm100
from jax_sm100._src import compile as compile_mod
from jax_sm100._src import gpu_lowering, planning
from jax_sm100._src import primitive as P


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _bind(a, b, *, transpose_b, out_dtype, c=None, bias=None, activation=None, transpose_a=False,
          alpha=1.0, beta=1.0, plan=None):  # fmt: skip
    ops = [a, b] + ([bias] if bias is not None else []) + ([c] if c is not None else [])
    return P.matmul_p.bind(
        *ops, transpose_a=transpose_a, transpose_b=transpose_b, alpha=alpha, beta=beta,
        activation=activation, out_dtype=np.dtype(out_dtype), has_bias=bias is not None,
        has_c=c is not None, plan=plan, save_preact=False, act_grad=None,
    )[0]  # fmt: skip


_ACTIVATIONS = {"gelu": lambda z: jax.nn.gelu(z, approximate=True), "silu": jax.nn.silu}


def _large_case(rng, m, n, k, dtype, batch, epi, activation):
    """Inputs, matmul parameters and float32 reference of one large-problem check: normal A, B,
    C and bias; with `epi`, B transposed ([n, k]) and the fused epilogue alpha 0.5, beta 0.75,
    bias and `activation`; else a plain product."""
    a = jnp.asarray(rng.standard_normal((*batch, m, k), np.float32), dtype)
    b_shape = (*batch, n, k) if epi else (*batch, k, n)
    b = jnp.asarray(rng.standard_normal(b_shape, np.float32), dtype)
    c = jnp.asarray(rng.standard_normal((*batch, m, n), np.float32), dtype)
    bias = jnp.asarray(rng.standard_normal((n,), np.float32), dtype)
    kws = dict(transpose_b=epi, out_dtype=dtype)
    if epi:
        kws.update(activation=activation, alpha=0.5, beta=0.75)
    f32 = lambda t: t.astype(jnp.float32)  # noqa: E731
    ref = jnp.matmul(f32(a), jnp.swapaxes(f32(b), -1, -2) if epi else f32(b), precision="highest")
    if epi:
        ref = _ACTIVATIONS[activation](0.5 * ref + 0.75 * f32(c) + f32(bias))
    return (a, b, c, bias), kws, ref


def _large_fn(epi, kws, plan=None):
    """The jitted product of a `_large_case`, C and bias taken only with the epilogue."""
    return jax.jit(lambda a, b, c, bias: _bind(
        a, b, c=c if epi else None, bias=bias if epi else None, plan=plan, **kws))  # fmt: skip


def _splitk_cases(cases: int):
    """(inputs, matmul params, plan) of `cases` random in-cluster split-K problems."""
    rng = np.random.default_rng(5)
    tiles = ((64, 128), (64, 256), (128, 128))
    acts = (None, "relu", "gelu", "silu")
    out = []
    for i in range(cases):
        split = (2, 4, 8)[i % 3]
        tile = tiles[(i // 3) % len(tiles)]
        dt = ("bfloat16", "float16")[i % 2]
        m = int(rng.choice([1, 8, 37, 64, 100, 128, 200, 256]))
        n = int(rng.choice([64, 136, 520, 1000, 4096]))
        k = split * int(rng.choice([256, 520, 1024, 2056]))
        ta, tb = bool(rng.integers(2)), bool(rng.integers(2))
        if ta:
            m = max(8, m // 8 * 8)  # an M-major A needs 16-byte rows for TMA
        epi = i % 4
        kw = dict(activation=acts[epi], out_dtype=("float32", dt, dt, dt)[epi])
        if epi == 3:
            kw.update(alpha=2.0, beta=0.5)
        a = rng.standard_normal((k, m) if ta else (m, k), np.float32)
        b = rng.standard_normal((n, k) if tb else (k, n), np.float32) / np.sqrt(k)
        c = rng.standard_normal((m, n), np.float32) if epi >= 2 else None
        bias = rng.standard_normal((n,), np.float32) if epi else None
        base = jax_sm100.plan(m, n, k, a_dtype=dt, b_dtype=dt, arch="sm_90a",
                              a_major="m" if ta else "k", b_major="k" if tb else "n",
                              out_dtype=kw["out_dtype"], c_dtype=None if c is None else dt,
                              force_kernel=True)  # fmt: skip
        try:
            p = planning.with_split(
                planning.sm90_variant(base, tile_mn=tile), split, reduce="cluster"
            )
        except planning.C.PlanError as e:
            print(f"splitk case {i}: skipped ({e})")
            continue
        kw.update(transpose_a=ta, transpose_b=tb, plan=p)
        arrays = [jnp.asarray(x, dt) for x in (a, b)] + [
            None if c is None else jnp.asarray(c, dt),
            None if bias is None else jnp.asarray(bias),
        ]
        out.append((i, arrays, kw, p))
    return out


def splitk(cases: int = 60, jobs: int = 15) -> int:
    """In-cluster split-K plans (`split_reduce="cluster"`) forced on random skinny problems.

    Every split factor (2, 4, 8), split tiles 64x128 / 64x256 / 128x128, m not a multiple of
    the tile (1 to 256), n not a multiple of it, both operand layouts, bf16 / fp16, and each
    epilogue (alpha, beta * C, bias, relu / gelu / silu, out dtype) against a float32 reference.
    The binaries are compiled first by `jobs` CPU workers.
    """
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_check  # noqa: PLC0415  (its parallel precompile and host reference)

    todo = [
        (i, args, kw, p, jax.jit(lambda a, b, c, bias, kw=kw: _bind(a, b, c=c, bias=bias, **kw)))
        for i, args, kw, p in _splitk_cases(cases)
    ]
    if jobs > 1:
        pairs = gpu_check.binaries_of([(f, args) for _, args, _, _, f in todo])
        gpu_check.precompile_parallel(pairs, jobs)
    fails = 0
    stats = compile_mod.cache_stats()
    for i, (a, b, c, bias), kw, p, f in todo:
        out = f(a, b, c, bias)
        low = gpu_lowering.explain()
        # gpu_check's float32 host reference (no per-case XLA compiles for it).
        ta, tb = kw["transpose_a"], kw["transpose_b"]
        case = dict(ta=ta, tb=tb, alpha=kw.get("alpha", 1.0), beta=kw.get("beta", 1.0),
                    act=kw["activation"])  # fmt: skip
        host = [None if x is None else np.asarray(x, np.float32) for x in (a, b, bias, c)]
        z = gpu_check._np_reference(case, *host)
        err = _rel_err(out, z)
        ran = low.plan.split_k if low and low.plan else 0
        ok = err < (2e-3 if kw["out_dtype"] == "float32" else 1e-2) and ran > 1
        fails += not ok
        if not ok or i % 10 == 0 or os.environ.get("JAX_SM100_VERBOSE"):
            verdict = "ok" if ok else "FAIL"
            m, n = out.shape
            print(f"splitk case {i} {m}x{n}x{a.size // m} {a.dtype} tile {p.cta_tile_mnk[:2]} "
                  f"split {p.split_k} (ran {ran}) ta={ta} tb={tb} {kw['activation']} "
                  f"out {kw['out_dtype']}: rel err {err:.2e} {verdict}")  # fmt: skip
    print("compiles in this process:", compile_mod.cache_stats()["compiles"] - stats["compiles"])
    print("RESULT splitk fails", fails)
    return fails


def streamk() -> int:
    """Stream-K plans (`GemmPlan.stream_k`) on the device's own SM count, where the last waves
    are shared out by k-blocks: the benchmark's large shapes, a batch, non-multiples of the
    tile with a transposed operand and a fused epilogue. Each against a float32 XLA reference
    and beside the same plan without stream-K; then 20 replays, which must be bitwise equal
    (the partial tiles always meet in the same order)."""
    rng = np.random.default_rng(3)
    cases = [
        ((16384, 4096, 4096), {}), ((8192, 8192, 8192), {}), ((4096, 4096, 4096), {}),
        ((4096, 14336, 4096), {}), ((3000, 5000, 1000), {"epilogue": True}),
        ((2048, 2048, 1024), {"batch": 4}),
    ]  # fmt: skip
    fails = 0
    for (m, n, k), kw in cases:
        batch = (kw["batch"],) if "batch" in kw else ()
        epi = kw.get("epilogue", False)
        args, kws, z = _large_case(rng, m, n, k, "bfloat16", batch, epi, "gelu")
        # The planner's cooperative plan (many waves of 16-bit tiles plan ping-pong instead).
        base = planning.cooperative(jax_sm100.plan(
            m, n, k, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a",
            batch=batch[0] if batch else 1, b_major="k" if epi else "n",
            c_dtype="bfloat16" if epi else None))  # fmt: skip
        outs = {}
        for sk in (False, True):
            f = _large_fn(epi, kws, planning.sm90_variant(base, stream_k=sk))
            outs[sk] = f(*args)
            if sk:
                same = all(bool(jnp.array_equal(f(*args), outs[sk])) for _ in range(20))
                low = gpu_lowering.explain()
        err = _rel_err(outs[True], z)
        err_dp = _rel_err(outs[False], z)
        ran_sk = bool(low and low.plan and low.plan.stream_k)
        ok = err < 1e-2 and err <= 1.5 * err_dp + 1e-4 and same and ran_sk
        fails += not ok
        print(f"streamk {batch}{m}x{n}x{k} tile {low.plan.cta_tile_mnk[:2]} cluster "
              f"{low.plan.cluster_shape_mn} epilogue {epi}: rel err {err:.2e} (without stream-K "
              f"{err_dp:.2e}), 20 replays identical {same}: {'ok' if ok else 'FAIL'}")  # fmt: skip
    print("RESULT streamk fails", fails)
    return fails


def pingpong() -> int:
    """The planner's ping-pong plans (many waves of 16-bit tiles, walked along N in swizzled
    bands) at the benchmark's shapes and a few more: the fused epilogue with transposed B, a
    batch, a grid whose cluster rows 8 does not divide, fp16; each against float32."""
    rng = np.random.default_rng(7)
    cases = [
        ((16384, 4096, 4096), {}), ((8192, 8192, 8192), {}), ((4096, 14336, 4096), {}),
        ((16384, 5120, 4096), {"dtype": "float16"}), ((8192, 8192, 2048), {"epilogue": True}),
        ((4096, 4096, 2048), {"batch": 4}), ((8200, 8200, 1000), {"epilogue": True}),
    ]  # fmt: skip
    fails = 0
    for (m, n, k), kw in cases:
        dt = kw.get("dtype", "bfloat16")
        batch = (kw["batch"],) if "batch" in kw else ()
        epi = kw.get("epilogue", False)
        args, kws, z = _large_case(rng, m, n, k, dt, batch, epi, "silu")
        out = _large_fn(epi, kws)(*args)
        low = gpu_lowering.explain()
        err = _rel_err(out, z)
        plan = low.plan if low else None
        ran_pp = bool(plan and plan.kernel == planning.KERNEL_SM90 and plan.pingpong)
        ok = err < 1e-2 and ran_pp
        fails += not ok
        desc = "?" if plan is None else (
            f"{plan.cta_tile_mnk[0]}x{plan.cta_tile_mnk[1]} cluster {plan.cluster_shape_mn} "
            f"pingpong {plan.pingpong} raster {'M' if plan.raster_along_m else 'N'} swizzle "
            f"{plan.swizzle_size}")  # fmt: skip
        print(f"pingpong {dt} {batch}{m}x{n}x{k} epilogue {epi}: {desc}: rel err {err:.2e}: "
              f"{'ok' if ok else 'FAIL'}")  # fmt: skip
    print("RESULT pingpong fails", fails)
    return fails


def fp8() -> int:
    """fp8 operands with K-major B (b stored [n, k]), the layout the SM90 fp8 wgmma takes."""
    fails = 0
    rng = np.random.default_rng(0)
    for dt in ("float8_e4m3fn", "float8_e5m2"):
        for m, n, k in ((128, 256, 512), (1000, 520, 256), (64, 4096, 4096), (4096, 4096, 4096)):
            a = jnp.asarray(rng.standard_normal((m, k), np.float32).astype(jnp.dtype(dt)))
            b = jnp.asarray(rng.standard_normal((n, k), np.float32).astype(jnp.dtype(dt)))
            out = jax.jit(lambda a, b: _bind(a, b, transpose_b=True, out_dtype="bfloat16"))(a, b)
            low = gpu_lowering.explain()
            ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32).T, precision="highest")
            err = _rel_err(out, ref)
            ok = err < 1e-2 and np.isfinite(np.asarray(out, np.float32)).all()
            fails += not ok
            kernel = low.plan.kernel if low and low.plan else "?"
            print(f"fp8 {dt} {m}x{n}x{k}: rel err {err:.2e} {'ok' if ok else 'FAIL'} ({kernel})")
    print("RESULT fp8 fails", fails)
    return fails


def graph() -> int:
    """The kernels inside XLA command buffers (CUDA graphs), replayed many times."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((512, 1024), np.float32), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((1024, 2048), np.float32) / 32, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((2048, 1024), np.float32) / 45, jnp.bfloat16)
    b1 = jnp.asarray(rng.standard_normal((2048,), np.float32), jnp.bfloat16)

    def ours(x):
        h = jax_sm100.matmul(x, w1, bias=b1, activation="gelu")
        return jax_sm100.matmul(h, w2, c=x, beta=0.5)

    def ref(x):
        f = lambda t: t.astype(jnp.float32)  # noqa: E731
        h = jax.nn.gelu(jnp.dot(f(x), f(w1), precision="highest") + f(b1), approximate=True)
        h = h.astype(jnp.bfloat16)
        return jnp.dot(f(h), f(w2), precision="highest") + 0.5 * f(x)

    f = jax.jit(ours)
    first = f(x)
    for _ in range(50):
        out = f(x)
    err = _rel_err(out, ref(x))
    same = bool(jnp.array_equal(out, first))
    text = f.lower(x).compile().as_text()
    ok = err < 2e-2 and same
    print(f"graph: rel err {err:.2e}, 50 replays identical {same}, "
          f"custom calls in HLO {text.count('jax_sm100_gemm')}")  # fmt: skip
    print("RESULT graph fails", int(not ok))
    return int(not ok)


def memcheck_child() -> None:
    rng = np.random.default_rng(2)
    cases = [((136, 200, 264), {}), ((64, 520, 4096), {}), ((100, 256, 128), {"c": True})]
    for (m, n, k), kw in cases:
        a = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
        b = jnp.asarray(rng.standard_normal((k, n), np.float32), jnp.bfloat16)
        c = jnp.asarray(rng.standard_normal((m, n), np.float32), jnp.bfloat16) if kw else None
        bias = jnp.asarray(rng.standard_normal((n,), np.float32), jnp.bfloat16) if kw else None
        # force_kernel: these problems are under the planner's XLA threshold (SM90_MIN_FLOPS).
        p = jax_sm100.plan(m, n, k, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a",
                           c_dtype="bfloat16" if kw else None, force_kernel=True)  # fmt: skip
        out = jax.jit(lambda a, b, c, bias, p=p: jax_sm100.matmul(a, b, c=c, bias=bias, plan=p))(
            a, b, c, bias
        )
        out.block_until_ready()
        low = gpu_lowering.explain()
        print(f"memcheck case {m}x{n}x{k}: {low.plan.kernel if low.plan else low.note}")
    # The ping-pong schedule, on a problem that is not a multiple of its tiles.
    m, n, k = 520, 1000, 264
    a = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n), np.float32), jnp.bfloat16)
    base = jax_sm100.plan(m, n, k, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a")
    for tile in ((128, 128), (128, 192), (64, 256)):
        p = planning.sm90_variant(base, tile_mn=tile, pingpong=True)
        out = jax.jit(lambda a, b, p=p: jax_sm100.matmul(a, b, plan=p))(a, b)
        err = _rel_err(out, jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32)))
        print(f"memcheck case {m}x{n}x{k} ping-pong {tile}: rel err {err:.1e}")
    # Split-K (the cluster's distributed-shared-memory reduction), every factor, with C and bias.
    m, n, k = 100, 520, 2048
    a = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n), np.float32), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((m, n), np.float32), jnp.bfloat16)
    base = jax_sm100.plan(m, n, k, a_dtype="bfloat16", b_dtype="bfloat16", c_dtype="bfloat16",
                          arch="sm_90a", force_kernel=True)  # fmt: skip
    for split in (2, 4, 8):
        p = planning.with_split(
            planning.sm90_variant(base, tile_mn=(64, 128)), split, reduce="cluster"
        )
        out = jax.jit(lambda a, b, c, p=p: jax_sm100.matmul(a, b, c=c, plan=p))(a, b, c)
        ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32)) + c.astype(jnp.float32)
        print(f"memcheck case {m}x{n}x{k} split-K x{split}: rel err {_rel_err(out, ref):.1e}")
    # Stream-K: 2048 x 2304 in 128x128 tiles is 144 tile pairs on 66 clusters, so 78 tiles are
    # shared out by k-blocks and 66 pairs meet in the workspace.
    m, n, k = 2048, 2304, 512
    a = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n), np.float32), jnp.bfloat16)
    base = jax_sm100.plan(m, n, k, a_dtype="bfloat16", b_dtype="bfloat16", arch="sm_90a",
                          force_kernel=True)  # fmt: skip
    p = planning.sm90_variant(base, tile_mn=(128, 128), cluster_mn=(2, 1), stream_k=True)
    out = jax.jit(lambda a, b, p=p: jax_sm100.matmul(a, b, plan=p))(a, b)
    err = _rel_err(out, jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32)))
    print(f"memcheck case {m}x{n}x{k} stream-K 128x128 2x1: rel err {err:.1e}")


def memcheck(tool: str = "memcheck") -> int:
    cmd = ["compute-sanitizer", "--tool", tool, "--print-limit", "20",
           sys.executable, __file__, "--cases", "memcheck-child"]  # fmt: skip
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=150)
    except subprocess.TimeoutExpired as e:
        print(f"{tool} did not finish in {e.timeout} s")
        print(f"RESULT {tool} not run")
        return 0
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
    print("\n".join(tail))
    ok = proc.returncode == 0 and any(
        "ERROR SUMMARY: 0 errors" in line or ("RACECHECK SUMMARY" in line and "(0 errors" in line)
        for line in tail
    )
    print(f"RESULT {tool} fails", int(not ok))
    return int(not ok)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="fp8,graph,memcheck")
    parts = ap.parse_args().cases.split(",")
    if parts == ["memcheck-child"]:
        memcheck_child()
        return 0
    fails = 0
    for part in parts:
        parts = {"fp8": fp8, "graph": graph, "memcheck": memcheck, "splitk": splitk,
                 "streamk": streamk, "pingpong": pingpong,
                 "racecheck": lambda: memcheck("racecheck")}  # fmt: skip
        fails += parts[part]()
    return int(fails > 0)


if __name__ == "__main__":
    sys.exit(main())
