"""Grouped GEMMs beside XLA: `python -m jax_sm100.bench --ragged [--shapes G:MxKxN,...] [--small]`.

For each problem (G groups, m rows split among them, [m, k] @ [G, k, n]), with normal random
bfloat16 data and group sizes drawn as a mixture-of-experts router makes them (multinomial over
the groups, some empty), times in one process, by wall clock (3 warm-up calls, then the median
of 5 rounds of 10 async calls blocked once):

- `jax_sm100.ragged_dot` forward, and its vjp (d lhs and d rhs);
- `jax.lax.ragged_dot` forward and vjp;
- the dense product of the same FLOPs (`jnp.dot` of [m, k] @ [k, n]), the ceiling.

Prints TFLOP/s (2 m k n per forward, twice that per vjp) and ours / lax. The default problems are
issue 18's (8 x 32768x4096x4096, 64 x 65536x2048x1408, 128 x 16384x2048x768); `--small` runs
tiny ones (a CPU smoke test). Which path ours took is printed from `jax_sm100.lowerings()`.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_sm100
from jax_sm100.bench_train import time_steps

PROBLEMS = ((8, 32768, 4096, 4096), (64, 65536, 2048, 1408), (128, 16384, 2048, 768))
SMALL = ((4, 256, 64, 32), (16, 512, 32, 48))


def group_sizes(seed: int, groups: int, m: int) -> jnp.ndarray:
    """Sizes summing to m, as top-1 routing of m tokens over `groups` experts gives them."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(groups, 2.0))
    return jnp.asarray(rng.multinomial(m, weights).astype(np.int32))


def _vjp_of(f):
    """(lhs, rhs, sizes, ct) -> (d lhs, d rhs) of `f`, jitted."""
    return jax.jit(lambda a, b, s, t: jax.vjp(lambda u, v: f(u, v, s), a, b)[1](t))


def run(problems, dtype=jnp.bfloat16):
    rows = []
    for i, (g, m, k, n) in enumerate(problems):
        keys = jax.random.split(jax.random.key(i), 4)
        lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
        rhs = (jax.random.normal(keys[1], (g, k, n), jnp.float32) * k**-0.5).astype(dtype)
        dense_w = rhs[0]
        ct = jax.random.normal(keys[2], (m, n), jnp.float32).astype(dtype)
        sizes = group_sizes(i, g, m)
        ours = jax.jit(lambda a, b, s: jax_sm100.ragged_dot(a, b, s))
        theirs = jax.jit(lambda a, b, s: lax.ragged_dot(a, b, s, preferred_element_type=dtype))

        with jax_sm100.lowerings() as seen:
            t_ours = time_steps(ours, lhs, rhs, sizes)
        t_lax = time_steps(theirs, lhs, rhs, sizes)
        v_ours = time_steps(_vjp_of(ours), lhs, rhs, sizes, ct)
        v_lax = time_steps(_vjp_of(theirs), lhs, rhs, sizes, ct)
        t_dense = time_steps(jax.jit(jnp.dot), lhs, dense_w)
        path = "; ".join(sorted({low.note for low in seen})) or "XLA (no CUDA lowering)"
        rows.append(((g, m, k, n), 2 * m * k * n, t_ours, t_lax, v_ours, v_lax, t_dense, path))
    return rows


def report(rows) -> None:
    print(f"{'groups x m x k x n':24s}| {'ours fwd':>9s} {'lax fwd':>9s} {'ratio':>6s} | "
          f"{'ours vjp':>9s} {'lax vjp':>9s} {'ratio':>6s} | {'dense':>9s}   (TF/s)")  # fmt: skip
    for (g, m, k, n), flop, t_o, t_l, v_o, v_l, t_d, path in rows:
        tf = lambda f, t: f / t / 1e12  # noqa: E731
        print(f"{g:3d} x {m}x{k}x{n}".ljust(24) + f"| {tf(flop, t_o):9.3g} {tf(flop, t_l):9.3g} "
              f"{t_l / t_o:6.3f} | {tf(2 * flop, v_o):9.3g} {tf(2 * flop, v_l):9.3g} "
              f"{v_l / v_o:6.3f} | {tf(flop, t_d):9.3g}")  # fmt: skip
        print(f"    path: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_sm100.bench --ragged", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--shapes", default=None, help="G:MxKxN,... (default: issue 18's)")
    ap.add_argument("--small", action="store_true", help="tiny problems (a CPU smoke test)")
    args = ap.parse_args(argv)
    problems = SMALL if args.small else PROBLEMS
    if args.shapes:
        problems = []
        for spec in args.shapes.split(","):
            g, mkn = spec.split(":")
            problems.append((int(g), *(int(v) for v in mkn.split("x"))))
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, bfloat16, "
          "wall clock, median of 5 rounds of 10 calls")  # fmt: skip
    report(run(problems))
    return 0


if __name__ == "__main__":
    sys.exit(main())
