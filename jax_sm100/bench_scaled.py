"""Block-scaled fp8 GEMMs beside XLA and cuBLAS:
`python -m jax_sm100.bench --scaled [--shapes MxNxK,...] [--small] [--overlap off|on|both]`.

For each problem, out[m, n] = sum_k lhs[m, k] rhs[n, k] with normal random data quantized to
float8_e4m3fn with float32 scales per 128 of k (`jax_sm100.quantize(x, "fp8_block128")`, the
DeepSeek-V3 recipe) and a bfloat16 result, five products (the last with the same weights
quantized per 128 x 128 tile instead):

- ours: `jax_sm100.scaled_matmul` (on sm_90a the block-scaled wgmma kernel; the scales'
  transposes that its lowering adds run every call and count);
- jax.nn.scaled_matmul, the same operands (XLA's block-scaled path);
- unscaled fp8 through `lax.dot_general` (cuBLAS): the product a scaled GEMM costs extra over;
- ours unscaled: `jax_sm100.dot_general` on the same data (the dense SM90 fp8 kernel);
- ours w128x128: `jax_sm100.scaled_matmul` on the same lhs and the same weights quantized per
  128 x 128 tile (`quantize(w, "fp8_block128x128")`, DeepSeek-V3's weight recipe), which the
  sm_90a kernel promotes with one FMA per accumulator instead of two. It is lowered with the
  environment's JAX_SM100_SCALED_OVERLAP (`--overlap` sets ours' rows only).

Timed by the device method of `python -m jax_sm100.bench` (bench.py's docstring): R dependent
products in one XLA while loop, U per iteration, the median call over R. Each product's scales
are multiplied by a 1 made from the carried lhs element, so XLA cannot hoist a scale transpose
out of the loop. Prints TF/s (2 m n k per product), ours / each other side, which path ours
took, and what the loop check found (`bench.LoopCheck`; the scaled products' scale copies are
part of them and are not flagged). The default problems are issue 19's (8192^3,
4096x7168x16384, 128x7168x16384); `--small` runs tiny ones (a CPU smoke test, where
jax.nn.scaled_matmul has no lowering and is left out).

`--overlap` picks ours' main loop on sm_90a (`GemmPlan.scaled_overlap`) by setting
JAX_SM100_SCALED_OVERLAP while ours is lowered: `off` the default loop, `on` the overlapped one,
`both` times the two in the same rounds and prints a row for each (the overlapped one's label
ends in "overlap"; the other sides' figures are the same in both rows). Without it the
environment decides.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

import jax_sm100
from jax_sm100 import bench
from jax_sm100._src import planning
from jax_sm100._src.planning import sm90_scaled as scaled_planning

PROBLEMS = ((8192, 8192, 8192), (4096, 7168, 16384), (128, 7168, 16384))
SMALL = ((256, 256, 512), (64, 384, 256))
# The side on DeepSeek-V3's weight recipe (`quantize(w, "fp8_block128x128")`): the same lhs, the
# same weights quantized per 128 x 128 tile.
TILES = "ours w128x128"
# `--overlap`: the JAX_SM100_SCALED_OVERLAP value ours is lowered under, for each of ours' rows
# (None: the environment's).
OVERLAP = {"off": ("0",), "on": ("1",), "both": ("0", "1")}
_NT = (((1,), (1,)), ((), ()))  # [m, k] x [n, k] -> [m, n]


def _one(a):
    """1.0, made from the loop-carried lhs so that what it multiplies is loop-variant."""
    return 1.0 + 0.0 * a[0, 0].astype(jnp.float32)


def _scaled(fn, weights="rows"):
    """(a [m, k], (rhs, ls, rs, tiled rhs, its rs)) -> [m, n] of a jax.nn.scaled_matmul-like
    `fn`, on rhs scaled per row or (`weights="tiles"`) per 128 x 128 tile."""

    def product(a, b):
        rhs, ls, rs = b[:3] if weights == "rows" else (b[3], b[1], b[4])
        one = _one(a)
        out = fn(a[None], rhs[None], (ls * one)[None], (rs * one)[None],
                 preferred_element_type=jnp.bfloat16)  # fmt: skip
        return out[0]

    return product


def _unscaled(dot):
    return lambda a, b: dot(a, b[0], _NT, preferred_element_type=jnp.bfloat16)


def products(with_jax_nn: bool):
    """The sides to time, by name: (a, (rhs, lhs_scales, rhs_scales, rhs quantized per
    128 x 128 tile, its scales)) -> [m, n] bfloat16 (`operands`)."""
    sides = {
        "ours": _scaled(jax_sm100.scaled_matmul),
        "jax.nn": _scaled(jax.nn.scaled_matmul),
        "cublas fp8": _unscaled(lax.dot_general),
        "ours fp8": _unscaled(jax_sm100.dot_general),
        TILES: _scaled(jax_sm100.scaled_matmul, "tiles"),
    }
    if not with_jax_nn:
        del sides["jax.nn"]
    return sides


def operands(seed: int, m: int, n: int, k: int):
    ka, kb = jax.random.split(jax.random.key(seed))
    a, ls = jax_sm100.quantize(jax.random.normal(ka, (m, k), jnp.float32), "fp8_block128")
    w32 = jax.random.normal(kb, (n, k), jnp.float32)
    w, rs = jax_sm100.quantize(w32, "fp8_block128")
    wt, rst = jax_sm100.quantize(w32, "fp8_block128x128")
    return a, (w, ls, rs, wt, rst)


@contextlib.contextmanager
def _lowered(overlap: str | None, seen: list):
    """Lowers with JAX_SM100_SCALED_OVERLAP=`overlap` (None: as set), appending the lowerings
    to `seen`."""
    env = scaled_planning.OVERLAP_ENV
    before = os.environ.get(env)
    if overlap is not None:
        os.environ[env] = overlap
    try:
        with jax_sm100.lowerings() as got:
            yield
        seen.extend(got)
    finally:
        if before is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = before


def run(problems, *, min_seconds: float, unroll: int, with_jax_nn: bool, overlap=(None,)):
    """One row per problem and value in `overlap` (JAX_SM100_SCALED_OVERLAP for ours; None:
    the environment's): (label, (m, n, k), seconds by side, ours' path, notes)."""
    rows = []
    sides = products(with_jax_nn)
    ours = sides.pop("ours")
    for i, (m, n, k) in enumerate(problems):
        a, b = operands(i, m, n, k)
        seen = [[] for _ in overlap]
        contexts = [lambda v=v, s=s: _lowered(v, s) for v, s in zip(overlap, seen, strict=True)]
        tiles_seen = []
        contexts += [(lambda t=tiles_seen: _lowered(None, t)) if name == TILES else None
                     for name in sides]  # fmt: skip
        timings = bench.time_device(
            [ours] * len(overlap) + list(sides.values()), a, b, min_seconds=min_seconds,
            unroll=unroll, contexts=contexts,
        )  # fmt: skip
        theirs = dict(zip(sides, timings[len(overlap) :], strict=True))
        for value, mine, lowered in zip(overlap, timings[: len(overlap)], seen, strict=True):
            timed = {"ours": mine} | theirs
            notes = {}
            for name, t in timed.items():
                problems_ = [p for p in t.check.problems() if "copies" not in p or "fp8" in name]
                if problems_:
                    notes[name] = "; ".join(problems_)
            path = "; ".join(sorted({_path(x) for x in lowered if "scaled_matmul" in x.note}))
            tiles = "; ".join(sorted({_path(x) for x in tiles_seen if "scaled_matmul" in x.note}))
            if tiles:
                path = f"{path or 'XLA ops (no CUDA lowering)'}\n    {TILES}: {tiles}"
            label = f"{m}x{n}x{k}" + (" overlap" if value == "1" else "")
            rows.append((label, (m, n, k), {name: t.seconds for name, t in timed.items()},
                         path or "XLA ops (no CUDA lowering)", notes))  # fmt: skip
    return rows


def _path(lowered) -> str:
    """A lowering's note, with its plan's tile, cluster and schedule where a kernel runs it."""
    p = lowered.plan
    if p is None or p.kernel == planning.KERNEL_XLA:
        return lowered.note
    tm, tn, _ = p.cta_tile_mnk
    cm, cn = p.cluster_shape_mn
    return (f"{lowered.note}: {tm}x{tn} tiles, {cm}x{cn} clusters, {p.num_ab_stages} stages"
            f"{', stream-K' if p.stream_k else ''}"
            f"{', promotion overlapped' if p.scaled_overlap else ''}")  # fmt: skip


def report(rows) -> None:
    names = list(rows[0][2]) if rows else []
    others = [n for n in names if n != "ours"]
    head = "".join(f"{n:>15s}" for n in names)
    ratios = "".join(f"{'/' + n:>15s}" for n in others)
    print(f"{'m x n x k':22s}|{head} (TF/s) |{ratios} (ours / ...)")
    for label, (m, n, k), seconds, path, notes in rows:
        flop = 2 * m * n * k
        tfs = "".join(f"{flop / seconds[x] / 1e12:15.4g}" for x in names)
        rel = "".join(f"{seconds[x] / seconds['ours']:15.3f}" for x in others)
        print(label.ljust(22) + f"|{tfs}        |{rel}")
        print(f"    ours: {path}")
        for name, note in notes.items():
            print(f"    ! {name}: {note}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_sm100.bench --scaled", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--shapes", default=None,
                    help="MxNxK,... (default: " + ",".join(
                        "x".join(map(str, s)) for s in PROBLEMS) + ")")  # fmt: skip
    ap.add_argument("--small", action="store_true", help="tiny problems (a CPU smoke test)")
    ap.add_argument("--device-ms", type=float, default=None,
                    help="grow R until one timed call takes this long (default 20; 1 with "
                         "--small)")  # fmt: skip
    ap.add_argument("--overlap", choices=tuple(OVERLAP), default=None,
                    help="ours' main loop on sm_90a: off, on (promotion under the next "
                         "k-block's MMAs) or both, a row each (default: the environment's "
                         "JAX_SM100_SCALED_OVERLAP)")  # fmt: skip
    ap.add_argument("--unroll", type=int, default=None,
                    help=f"products per loop iteration (default {bench.DEFAULT_UNROLL}; 2 with "
                         "--small, which compiles faster)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.unroll is not None and args.unroll < 1:
        ap.error(f"--unroll must be >= 1, got {args.unroll}")
    problems = SMALL if args.small else PROBLEMS
    if args.shapes:
        problems = bench.parse_shapes(ap, args.shapes, "MxNxK")
    dev = jax.devices()[0]
    with_jax_nn = dev.platform == "gpu"
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, float8_e4m3fn "
          "with float32 scales per 128 of k, bfloat16 out; device method, median of 5")  # fmt: skip
    if not with_jax_nn:
        print("(jax.nn.scaled_matmul has no lowering here: left out)")
    unroll = args.unroll or (2 if args.small else bench.DEFAULT_UNROLL)
    # --small times 1 ms a call unless --device-ms is given (it was ignored with --small).
    device_ms = args.device_ms if args.device_ms is not None else (1.0 if args.small else 20.0)
    min_seconds = device_ms / 1e3
    overlap = OVERLAP[args.overlap] if args.overlap else (None,)
    report(run(problems, min_seconds=min_seconds, unroll=unroll, with_jax_nn=with_jax_nn,
               overlap=overlap))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
