"""`python -m jax_sm100.bench --quantize [--shapes RxC,...] [--recipes R,...] [--small]`:
`jax_sm100.quantize_both` beside XLA's two quantizations.

For each shape and recipe, a bfloat16 operand of normal random data quantized along its columns
and, written transposed, along its rows (e4m3 data, float32 scales), per 1 x 128 block
(fp8_block128, DeepSeek-V3's activation recipe) or per 128 x 128 tile (fp8_block128x128, its
weights' recipe: one scale a tile for both orientations), both ways:

- ours: `jax_sm100.quantize_both(x, recipe)` (on sm_90a/sm_100a the one-pass kernel,
  kernels/quantize.py);
- XLA: `jax_sm100.quantize(x, recipe)` and `scaled.quantize_transposed(x, recipe)`, the two
  fusions the kernel replaces (`quantize_both`'s reference, and what runs where the kernel does
  not).

Timed by the wall clock (bench_train.py's `time_steps_alike`: 6 rounds of 50 asynchronously
dispatched calls blocked once, the two sides' rounds interleaved, median), with GB/s as the
bytes read and written (x once, both orientations' data and scales) over the time. Each side's
data is compared with numpy's correctly rounded float32 quotient x / scale (the kernel's
contract; XLA's GPU division is div.full, within 2 units of the quotient) and ours' scales with
XLA's (equal bit for bit). `--small` runs tiny shapes (a CPU smoke test, where both sides are
XLA's ops).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_sm100
from jax_sm100 import bench, bench_train
from jax_sm100._src import constraints, quantize_both

SHAPES = ((8192, 14336), (8192, 4096), (8192, 12288), (14336, 4096))
SMALL = ((256, 384), (512, 256))
_TOP = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


RECIPES = constraints.QUANTIZE_RECIPES


def _exact_data(x, scales):
    """numpy's x / scale per block (1 x 128, or 128 x 128 where `scales` has a row per 128 of
    x's), correctly rounded, clipped and cast to e4m3."""
    per_element = np.repeat(scales, 128, -1)
    if per_element.shape != x.shape:
        per_element = np.repeat(per_element, 128, -2)
    q = np.where(np.isfinite(per_element), x / per_element, 0.0)
    return np.clip(q, -_TOP, _TOP).astype(ml_dtypes.float8_e4m3fn)


def _mismatches(got, x32, want_scales):
    """(data bytes differing from the exact quotient's, scales differing from `want_scales`)
    over both orientations of `got` ((q, s), (qt, st))."""
    (q, s), (qt, st) = (tuple(np.asarray(a) for a in pair) for pair in got)
    data = sum(
        int(np.sum(d.view(np.uint8) != _exact_data(xo, so).view(np.uint8)))
        for d, xo, so in ((q, x32, s), (qt, x32.T, st))
    )
    scales = sum(int(np.sum(a.view(np.uint32) != b.view(np.uint32)))
                 for a, b in zip((s, st), want_scales, strict=True))  # fmt: skip
    return data, scales


def run(shapes, recipes=RECIPES, rounds: int = 6, steps: int = 50) -> list[dict]:
    rows = []
    for recipe in recipes:
        rows += _run(shapes, recipe, rounds, steps)
    return rows


def _run(shapes, recipe: str, rounds: int, steps: int) -> list[dict]:
    ours = jax.jit(lambda x: jax_sm100.quantize_both(x, recipe))
    xla = jax.jit(lambda x: quantize_both._reference(x, data_dtype=jnp.float8_e4m3fn,
                                                     recipe=recipe))  # fmt: skip
    rows = []
    for r, c in shapes:
        x = jax.random.normal(jax.random.key(r * 7 + c), (r, c), jnp.bfloat16)
        with jax_sm100.lowerings() as seen:
            got = jax.block_until_ready(ours(x))
        t_ours, t_xla = bench_train.time_steps_alike(((ours, (x,)), (xla, (x,))), steps, rounds)
        x32 = np.asarray(x.astype(jnp.float32))
        ref = xla(x)
        want = tuple(np.asarray(pair[1]) for pair in ref)  # XLA's scales, both orientations
        nbytes = x.size * x.dtype.itemsize + 2 * x.size + sum(4 * a.size for a in want)
        rows.append({
            "shape": f"{r}x{c}", "recipe": recipe, "ours": t_ours, "xla": t_xla,
            "gbps": nbytes / t_ours / 1e9,
            "path": "; ".join(lw.note for lw in seen) or "XLA ops (no GPU)",
            "ours_off": _mismatches(got, x32, want), "xla_off": _mismatches(ref, x32, want),
        })  # fmt: skip
    return rows


def report(rows) -> None:
    print("shape        | recipe           |  ours ms |   XLA ms | XLA/ours | ours GB/s | data "
          "!= exact quotient (ours / XLA) | ours' scales != XLA's")  # fmt: skip
    for w in rows:
        print(f"{w['shape']:<13}| {w['recipe']:<17}| {w['ours'] * 1e3:8.3f} | "
              f"{w['xla'] * 1e3:8.3f} | "
              f"{w['xla'] / w['ours']:8.2f} | {w['gbps']:9.0f} | "
              f"{w['ours_off'][0]:>13} / {w['xla_off'][0]:<13} | {w['ours_off'][1]}")  # fmt: skip
        print(f"    ours: {w['path']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_sm100.bench --quantize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--shapes", default=None,
                    help="RxC,... (default: " + ",".join(
                        "x".join(map(str, s)) for s in SHAPES) + ")")  # fmt: skip
    ap.add_argument("--recipes", default=",".join(RECIPES), help="of " + ", ".join(RECIPES))
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke test)")
    args = ap.parse_args(argv)
    recipes = args.recipes.split(",")
    if bad := [r for r in recipes if r not in RECIPES]:
        ap.error(f"--recipes: {bad} not in {RECIPES}")
    shapes = SMALL if args.small else SHAPES
    if args.shapes:
        shapes = bench.parse_shapes(ap, args.shapes, "RxC")
    dev = jax.devices()[0]
    steps = 5 if args.small else 50
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, bfloat16 in, "
          "float8_e4m3fn data with float32 scales per block, both ways; wall clock, interleaved "
          f"rounds, median of 6 x {steps} calls")  # fmt: skip
    report(run(shapes, recipes, steps=steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
