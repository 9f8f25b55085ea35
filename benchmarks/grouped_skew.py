"""Where a skewed grouped forward's time goes: `python benchmarks/grouped_skew.py`.

At the skewed problems of `python -m jax_sm100.bench --ragged` (128 and 256 groups by default;
the same seeds, so the same Dirichlet(0.3) sizes) it times `jax_sm100.ragged_dot`'s forward by
wall clock (`bench_train.time_steps`) on variants of the group sizes, with dynamic work tiles
on and off, beside `jax_sm100.matmul` at the same m, k, n:

- the groups under 64 rows alone, the others alone (the rest set to 0 rows), and the small ones
  cut to one row each (what their weights cost to stream, with almost no MMA work);
- the same sizes in other group orders (sorted, shuffled, and the small groups spread evenly
  between the large ones by work tile), since the kernel walks its work tiles group by group;
- the skewed sizes rounded to multiples of 64 rows (at least 64 a non-empty group, the same
  total): the same weights streamed and every row through the tensor cores useful, which is
  the most a kernel that wastes no padded row could save on the skewed sizes;
- equal groups.

Every variant has the same operands; sizes that sum to less than m leave the rest of the rows
out. Prints microseconds, the minimum bytes moved per microsecond (non-empty groups' weights, A's
rows read and D's written once) and the dense product's time over the variant's.
"""

from __future__ import annotations

import argparse
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import jax_sm100
from jax_sm100._src import planning
from jax_sm100._src.planning import sm90
from jax_sm100.bench_ragged import PROBLEMS, group_sizes, operands
from jax_sm100.bench_train import time_steps

SMALL = 64  # rows: a group under this fills less than one warp group's wgmma rows


def _forward_seconds(lhs, rhs, sizes, dynamic: str) -> float:
    with mock.patch.dict("os.environ", {sm90.GROUPED_DYNAMIC_ENV: dynamic}):
        planning._plan_cached.cache_clear()
        try:
            f = jax.jit(lambda a, b, s: jax_sm100.ragged_dot(a, b, s))
            return time_steps(f, lhs, rhs, jnp.asarray(sizes, jnp.int32))
        finally:
            planning._plan_cached.cache_clear()


def spread(large, small, empty, tile_m: int = 128):
    """The large groups in their order with the small ones placed at even intervals of work
    tiles between them (each small group one m tile), then the empty ones."""
    tiles = np.ceil(large / tile_m)
    total = tiles.sum() + len(small)
    out, placed, done = [], 0, 0.0
    for size, t in zip(large, tiles, strict=True):
        out.append(size)
        done += t
        while placed < len(small) and (placed + 1) * total / (len(small) + 1) <= done + placed:
            out.append(small[placed])
            placed += 1
    return np.asarray([*out, *small[placed:], *empty])


def rounded(sizes, unit: int = SMALL):
    """`sizes` with each non-empty group rounded to a multiple of `unit` rows (at least one unit)
    and the largest groups trimmed or grown by a unit until the total is unchanged (it must be
    a multiple of `unit`)."""
    s = np.asarray(sizes)
    units = np.where(s > 0, np.maximum(1, np.rint(s / unit)), 0).astype(np.int64)
    target = int(s.sum()) // unit
    if target * unit != int(s.sum()) or target < np.count_nonzero(units):
        raise ValueError(f"{int(s.sum())} rows do not round to units of {unit} per group")
    while units.sum() != target:
        i = int(np.argmax(units))
        units[i] += 1 if units.sum() < target else -1
    return (units * unit).astype(s.dtype)


def variants(sizes, equal, seed: int):
    s = np.asarray(sizes)
    large, small, empty = s[s >= SMALL], s[(s > 0) & (s < SMALL)], s[s == 0]
    return {
        "skewed": s,
        f"under {SMALL} rows only": np.where(s < SMALL, s, 0),
        f"{SMALL}+ rows only": np.where(s >= SMALL, s, 0),
        f"under {SMALL} cut to 1 row": np.where((s > 0) & (s < SMALL), 1, 0),
        "sorted descending": np.sort(s)[::-1].copy(),
        "sorted ascending": np.sort(s),
        "shuffled": np.random.default_rng(seed).permutation(s),
        "small spread": spread(large, small, empty),
        "small spread, large desc": spread(np.sort(large)[::-1], small, empty),
        f"rounded to {SMALL} rows": rounded(s),
        "equal": np.asarray(equal),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, nargs="*", default=[128, 256])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dynamic", nargs="*", default=["1", "0"], choices=["1", "0"])
    ap.add_argument("--only", nargs="*", default=None, help="variant names to time (all unset)")
    args = ap.parse_args(argv)
    dense = jax.jit(jax_sm100.matmul)
    for i, (g, m, k, n) in enumerate(PROBLEMS):
        if g not in args.groups:
            continue
        lhs, rhs, _, _ = operands(i, g, m, k, n)
        sizes = group_sizes(i, g, m, "skewed")
        cases = variants(sizes, group_sizes(i, g, m, "equal"), i)
        if args.only is not None:
            cases = {name: v for name, v in cases.items() if name in args.only}
        for _ in range(args.rounds):
            t_dense = time_steps(dense, lhs, rhs[0])
            print(f"{g} groups, {m}x{k}x{n}: dense {2 * m * k * n / t_dense / 1e12:.1f} TF/s "
                  f"({t_dense * 1e6:.1f} us)", flush=True)  # fmt: skip
            for dynamic in args.dynamic:
                for name, v in cases.items():
                    t = _forward_seconds(lhs, rhs, v, dynamic)
                    nbytes = (np.count_nonzero(v) * k * n + int(v.sum()) * (k + n)) * 2
                    print(f"  dynamic={dynamic} {name:26s} {t * 1e6:7.1f} us "
                          f"{nbytes / t / 1e12:5.2f} TB/s  dense / this {t_dense / t:.3f}",
                          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
