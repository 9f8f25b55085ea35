"""Grouped GEMMs beside XLA: `python -m jax_sm100.bench --ragged [--shapes G:MxKxN,...] [--small]
[--bias] [--dtype D]`.

For each problem (G groups, m rows split among them, [m, k] @ [G, k, n]), with normal random
data (bfloat16, or `--dtype`: fp8 operands give bfloat16 results), and for two kinds of group
sizes:

- "equal": m / G rows per group (balanced routing);
- "skewed": multinomial counts over Dirichlet(0.3) weights (issue 18's skew: a few large
  groups, many small or empty ones);

it times in one process, by wall clock (3 warm-up calls, then the median of 5 rounds of 10 async
calls blocked once; ours for every problem before any of XLA's, `run`; ours' grouped and dense
sides of one problem and kind in interleaved rounds, `bench_train.time_steps_alike`, so that
the ratios to our dense product are of the same moments):

- `jax_sm100.ragged_dot` forward, and its vjp (d lhs and d rhs);
- `jax.lax.ragged_dot` forward and vjp;
- the dense product of the same FLOPs ([m, k] @ [k, n]) on our kernel (`jax_sm100.matmul`,
  forward and vjp) and on XLA (`jnp.dot`, forward): the ceiling a grouped GEMM is held to.

Prints TFLOP/s (2 m k n per forward, three times that per forward + vjp counted as the vjp's two
products) and the ratios: ours / lax, and ours / our dense product. A second line per row times
our three products alone (forward, d lhs, d rhs) beside a memory reference: each product moves
at least the bytes of A, the G weight matrices and D once (the same count for all three), and
the reference is the TFLOP/s of moving them at the device's measured copy bandwidth (a 1 GiB `x
* 2`, read and written). A copy is not the HBM's peak (4.8 TB/s on the H200), so a kernel that
mostly reads can beat it; it tells where a product is bound by memory: where the groups are
short (128 rows: 128 FLOPs per weight byte, under the H200's ~200 per byte of peak bandwidth).
With skewed sizes it counts every group's weights, which the forward and d lhs do not read for
an empty group. The default problems are issue 18's (8 x 32768x4096x4096, 64 x 65536x2048x1408,
128 x 16384x2048x768) and 256 groups of 128 rows (32768x2048x768); `--small` runs tiny ones (a
CPU smoke test). Which path ours took is printed from `jax_sm100.lowerings()`. `--bias` also times
ours with a per-group bias and gelu (forward, and forward + vjp), the bias in the kernel's
epilogue (the gelu too in the forward; the vjp's forward writes the float32 sum gelu' needs),
beside the same forward composed around our float32 product (XLA adding each row's bias row and
applying the gelu: what ragged_dot did before the grouped epilogue took the bias).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_sm100
from jax_sm100 import bench
from jax_sm100._src import ragged
from jax_sm100.bench_train import time_steps, time_steps_alike

PROBLEMS = (
    (8, 32768, 4096, 4096),
    (64, 65536, 2048, 1408),
    (128, 16384, 2048, 768),
    (256, 32768, 2048, 768),
)
SMALL = ((4, 256, 64, 32), (16, 512, 32, 48))


def group_sizes(seed: int, groups: int, m: int, kind: str = "equal") -> jnp.ndarray:
    """Sizes summing to m: equal ("equal", the remainder spread over the first groups), or
    multinomial over Dirichlet(0.3) weights ("skewed")."""
    if kind == "equal":
        sizes = np.full(groups, m // groups)
        sizes[: m % groups] += 1
        return jnp.asarray(sizes.astype(np.int32))
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(groups, 0.3))
    return jnp.asarray(rng.multinomial(m, weights).astype(np.int32))


def _vjp_of(f, nargs=3):
    """(lhs, rhs, [sizes,] ct) -> (d lhs, d rhs) of `f`, jitted."""
    if nargs == 2:
        return jax.jit(lambda a, b, t: jax.vjp(f, a, b)[1](t))
    return jax.jit(lambda a, b, s, t: jax.vjp(lambda u, v: f(u, v, s), a, b)[1](t))


# One of our vjp's two products alone (jit drops the other and the forward).
_D_LHS = jax.jit(lambda a, b, s, t: jax.vjp(lambda u: jax_sm100.ragged_dot(u, b, s), a)[1](t)[0])
_D_RHS = jax.jit(lambda a, b, s, t: jax.vjp(lambda v: jax_sm100.ragged_dot(a, v, s), b)[1](t)[0])


def _biased(a, w, s, c):
    return jax_sm100.ragged_dot(a, w, s, bias=c, activation="gelu")


_BIASED = jax.jit(_biased)


@jax.jit
def _biased_composed(a, w, s, c):
    z = jax_sm100.ragged_dot(a, w, s, preferred_element_type=jnp.float32)
    z = z + ragged.group_rows(c, s, a.shape[0])
    return jax.nn.gelu(z, approximate=True).astype(out_dtype(a.dtype))


# Its vjp with respect to lhs, rhs and the bias (gelu' needs the forward's float32 product, so
# the call runs the forward too: it is the whole forward + vjp).
_BIASED_VJP = jax.jit(
    lambda a, w, s, c, u: jax.vjp(lambda x, y, z: _biased(x, y, s, z), a, w, c)[1](u)
)


def out_dtype(dtype):
    """The result dtype of ragged_dot of two `dtype` operands: bfloat16 for fp8, else `dtype`."""
    return jnp.dtype(jnp.bfloat16 if jnp.dtype(dtype).itemsize == 1 else dtype)


def operands(seed: int, g: int, m: int, k: int, n: int, dtype=jnp.bfloat16):
    """Problem `seed`'s operands from normal data: lhs [m, k], rhs [g, k, n] (times k**-0.5, so
    products are of unit scale), a cotangent [m, n] (of the result's dtype, `out_dtype`) and a
    per-group float32 bias [g, n]. The benchmarks/ scripts of the grouped kernel take theirs
    from here too, so every grouped figure is of the same data."""
    keys = jax.random.split(jax.random.key(seed), 4)
    lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
    rhs = (jax.random.normal(keys[1], (g, k, n), jnp.float32) * k**-0.5).astype(dtype)
    ct = jax.random.normal(keys[2], (m, n), jnp.float32).astype(out_dtype(dtype))
    bias = jax.random.normal(keys[3], (g, n), jnp.float32)
    return lhs, rhs, ct, bias


def copy_bandwidth() -> float:
    """Bytes per second that `x * 2` moves (read + write) over 1 GiB of bfloat16 (16 MiB off
    GPUs: a smoke test's)."""
    nbytes = 1 << 30 if jax.default_backend() == "gpu" else 1 << 24
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    return 2 * nbytes / time_steps(jax.jit(lambda v: v * 2), x)


def run(problems, dtype=jnp.bfloat16, kinds=("equal", "skewed"), on_row=None, bias=False):
    """Times every problem and kind: ours (and the dense products) for all of them first, then
    `lax.ragged_dot` for all of them, on the same operands rebuilt from their seeds; `on_row`
    gets each row once both are timed. Ours never run after XLA's ragged dot, whose temporaries
    reach 12 GB at 64 groups: the nineteenth session's 64-group skewed row, timed after the
    equal row's `lax.ragged_dot`, read its forward, d lhs and d rhs 2 %, 12 % and 19 % under
    the same plans timed without it (`benchmarks/grouped_schedule.py`'s 2x1 and 1x1-dynamic
    columns; the twentieth session's one-process check of `_D_RHS`). Whether that run is the
    cause is not shown; this order takes it out of ours' figures."""
    rows = []
    bandwidth = None  # measured once, after the first row's products
    for i, (g, m, k, n) in enumerate(problems):
        lhs, rhs, ct, group_bias = operands(i, g, m, k, n, dtype)
        ours = jax.jit(lambda a, b, s: jax_sm100.ragged_dot(a, b, s))
        (ours_dense, xla_dense), dense_w = _dense(dtype), rhs[0]
        if jnp.dtype(dtype).itemsize == 1:
            dense_w = dense_w.T.copy()  # [n, k]: fp8 GEMMs on sm_90a read B K-major
        dense_sides = {
            "ours": (jax.jit(ours_dense), (lhs, dense_w)),
            "ours_vjp": (_vjp_of(ours_dense, 2), (lhs, dense_w, ct)),
            "xla": (jax.jit(xla_dense), (lhs, dense_w)),
        }
        for kind in kinds:
            sizes = group_sizes(i, g, m, kind)
            sides = {
                "ours": (ours, (lhs, rhs, sizes)),
                "ours_vjp": (_vjp_of(ours), (lhs, rhs, sizes, ct)),
                "d_lhs": (_D_LHS, (lhs, rhs, sizes, ct)),
                "d_rhs": (_D_RHS, (lhs, rhs, sizes, ct)),
            }
            if jnp.dtype(dtype).itemsize == 1:
                # fp8 experts stored [g, n, k]: sm_90a's kernel reads them without XLA's
                # transpose (ragged_gpu.lower's and this swapaxes cancel).
                w_nk = jnp.swapaxes(rhs, 1, 2).copy()
                sides["ours_nk"] = (_OURS_NK, (lhs, w_nk, sizes))
            if bias:
                # A per-group bias and gelu in the epilogue, and composed in XLA.
                sides["bias"] = (_BIASED, (lhs, rhs, sizes, group_bias))
                sides["bias_xla"] = (_biased_composed, (lhs, rhs, sizes, group_bias))
                sides["bias_vjp"] = (_BIASED_VJP, (lhs, rhs, sizes, group_bias, ct))
            # The row's path is the plain product's and its gradients' (lowered here, first).
            # JAX's caches would keep an earlier row's lowerings of the same shapes (the equal
            # sizes' row before the skewed one): the row would name only what it re-lowered.
            jax.clear_caches()
            with jax_sm100.lowerings() as seen:
                for key in ("ours", "ours_vjp", "d_lhs", "d_rhs"):
                    step, args = sides[key]
                    jax.block_until_ready(step(*args))
            # Ours, grouped and dense, in interleaved rounds: the grouped-to-dense ratios are
            # the targets, so the card's drift and the order fall on both sides alike.
            named = [("g", key, v) for key, v in sides.items()]
            named += [("d", key, v) for key, v in dense_sides.items()]
            times = time_steps_alike([v for _, _, v in named])
            t = {key: x for (side, key, _), x in zip(named, times, strict=True) if side == "g"}
            dense = {key: x for (side, key, _), x in zip(named, times, strict=True) if side == "d"}
            # Each lowering's note begins with what ran (ragged_gpu.lower: the kernel, tile,
            # schedule and cluster, or why XLA's ragged dot).
            path = "; ".join(sorted({low.note.split("; ")[0] for low in seen}))
            path = path or "XLA (no CUDA lowering)"
            if bandwidth is None:
                bandwidth = copy_bandwidth()
            dense["bandwidth"], dense["itemsize"] = bandwidth, jnp.dtype(dtype).itemsize
            dense["out_itemsize"] = out_dtype(dtype).itemsize
            rows.append(((g, m, k, n), kind, 2 * m * k * n, t, dense, path))
    theirs = jax.jit(
        lambda a, b, s: lax.ragged_dot(a, b, s, preferred_element_type=out_dtype(dtype))
    )
    problem_rows = iter(rows)
    for i, (g, m, k, n) in enumerate(problems):
        lhs, rhs, ct, _ = operands(i, g, m, k, n, dtype)
        for kind in kinds:
            row = next(problem_rows)
            t, sizes = row[3], group_sizes(i, g, m, kind)
            t["lax"] = _time_or_nan(theirs, lhs, rhs, sizes)
            t["lax_vjp"] = _time_or_nan(_vjp_of(theirs), lhs, rhs, sizes, ct)
            if on_row is not None:
                on_row(row)
    return rows


_NT = (((1,), (1,)), ((), ()))
_OURS_NK = jax.jit(lambda a, w_nk, s: jax_sm100.ragged_dot(a, jnp.swapaxes(w_nk, 1, 2), s))


def _dense(dtype):
    """(ours, XLA's) dense product of the same FLOPs: [m, k] @ [k, n], or for fp8 [m, k] @
    [n, k]^T into bfloat16 (sm_90a's fp8 GEMMs read B K-major; XLA's is cuBLAS's fp8 GEMM)."""
    if jnp.dtype(dtype).itemsize == 1:
        return (
            lambda a, b: jax_sm100.dot_general(a, b, _NT, preferred_element_type=jnp.bfloat16),
            lambda a, b: lax.dot_general(a, b, _NT, preferred_element_type=jnp.bfloat16),
        )
    return jax_sm100.matmul, jnp.dot


def _time_or_nan(fn, *args):
    """`time_steps`, or NaN where XLA runs out of memory (lax.ragged_dot materialises large
    temporaries at some shapes on GPUs)."""
    try:
        return time_steps(fn, *args)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return float("nan")


def _header() -> None:
    print(f"{'groups x m x k x n':22s} {'sizes':6s}| {'ours':>6s} {'lax':>6s} {'x lax':>6s} "
          f"{'/dense':>6s} | {'ours':>6s} {'lax':>6s} {'x lax':>6s} {'/dense':>6s} | "
          f"{'dense':>6s} {'vjp':>6s} {'jnp':>6s}   TF/s: forward | forward+vjp "
          "| our dense fwd, fwd+vjp; jnp.dot fwd")  # fmt: skip


def _row(row) -> None:
    for (g, m, k, n), kind, flop, t, dense, path in (row,):
        tf = lambda f, s: f / s / 1e12  # noqa: E731
        # forward + vjp: the forward time plus the vjp's (3 products in all).
        fb_o, fb_l = t["ours"] + t["ours_vjp"], t["lax"] + t["lax_vjp"]
        fb_d = dense["ours"] + dense["ours_vjp"]
        print(f"{g:3d} x {m}x{k}x{n}".ljust(22) + f" {kind:6s}| {tf(flop, t['ours']):6.1f} "
              f"{tf(flop, t['lax']):6.1f} {t['lax'] / t['ours']:6.1f} "
              f"{dense['ours'] / t['ours']:6.3f} | {tf(3 * flop, fb_o):6.1f} "
              f"{tf(3 * flop, fb_l):6.1f} {fb_l / fb_o:6.1f} {fb_d / fb_o:6.3f} | "
              f"{tf(flop, dense['ours']):6.1f} {tf(3 * flop, fb_d):6.1f} "
              f"{tf(flop, dense['xla']):6.1f}")  # fmt: skip
        bw = dense["bandwidth"]
        copy = ((m * k + g * k * n) * dense["itemsize"] + m * n * dense["out_itemsize"]) / bw
        print(f"    products alone: forward {tf(flop, t['ours']):.1f}, d lhs "
              f"{tf(flop, t['d_lhs']):.1f}, d rhs {tf(flop, t['d_rhs']):.1f} TF/s; the bytes "
              f"at copy speed {tf(flop, copy):.1f} TF/s ({bw / 1e12:.2f} TB/s)")  # fmt: skip
        if "ours_nk" in t:
            print(f"    fp8 experts stored [g, n, k] (no transpose on sm_90a): forward "
                  f"{tf(flop, t['ours_nk']):.1f} TF/s")  # fmt: skip
        if "bias" in t:
            print(f"    with a per-group bias and gelu: forward {tf(flop, t['bias']):.1f} "
                  f"(composed in XLA: {tf(flop, t['bias_xla']):.1f}), "
                  f"forward+vjp {tf(3 * flop, t['bias_vjp']):.1f} TF/s (one call: the "
                  "vjp runs the forward for gelu')")  # fmt: skip
        print(f"    path: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_sm100.bench --ragged", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--shapes", default=None,
                    help="G:MxKxN,... (default: " + ",".join(
                        f"{g}:{m}x{k}x{n}" for g, m, k, n in PROBLEMS) + ")")  # fmt: skip
    ap.add_argument("--small", action="store_true", help="tiny problems (a CPU smoke test)")
    ap.add_argument("--dtype", default="bfloat16",
                    help="operand dtype: bfloat16, float16, float8_e4m3fn or float8_e5m2 (fp8: "
                         "bfloat16 results, the dense side [m, k] @ [n, k]^T)")  # fmt: skip
    ap.add_argument("--bias", action="store_true",
                    help="also time ragged_dot with a per-group bias and gelu")  # fmt: skip
    args = ap.parse_args(argv)
    problems = SMALL if args.small else PROBLEMS
    if args.shapes:
        problems = bench.parse_shapes(ap, args.shapes, "G:MxKxN")
    dev = jax.devices()[0]
    dtype = bench.parse_dtype(ap, args.dtype, "--dtype")
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, {dtype.name}, "
          "wall clock, median of 5 rounds of 10 calls")  # fmt: skip
    _header()
    run(problems, dtype=dtype, on_row=_row, bias=args.bias)
    return 0


if __name__ == "__main__":
    sys.exit(main())
