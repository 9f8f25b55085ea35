"""`python -m jax_sm100.bench`: jax_sm100.matmul against jnp.dot on this machine's GPU.

Both run in the same process by the same method: inputs drawn from a normal distribution, each
function jitted, 3 warm-up calls, then 5 rounds of N asynchronously dispatched calls blocked
once per round; the median round divided by N is the time per call (wall time, so it includes
dispatch: small shapes measure the per-call path as much as the kernel). Prints TFLOP/s and the
ratio ours / jnp.dot per shape and dtype with a progress bar, the geomean over the large shapes,
the per-call overhead at 128^3, and the cold compile time of every distinct kernel binary the
shapes need (compiled with the on-disk cache bypassed). Writes a PNG plot when matplotlib is
installed (`--plot`, default benchmarks/out/bench.png; that folder is git-ignored).

Options: --dtypes bfloat16,float16  --shapes 4096x4096x4096,...  --no-compile-times
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sm100
from jax_sm100._src import compile as compile_mod
from jax_sm100._src import gpu_lowering
from jax_sm100._src.kernels.spec import KernelSpec

SHAPES = (
    (8192, 8192, 8192),
    (4096, 4096, 4096),
    (16384, 4096, 4096),
    (4096, 14336, 4096),
    (2048, 2048, 2048),
    (256, 8192, 8192),
    (64, 4096, 4096),
    (128, 128, 128),
)


@dataclasses.dataclass
class Row:
    dtype: str
    shape: tuple[int, int, int]
    ours_s: float
    dot_s: float
    kernel: str

    @property
    def flop(self) -> int:
        return 2 * math.prod(self.shape)

    @property
    def ratio(self) -> float:
        return self.dot_s / self.ours_s


def time_per_call(fn, *args, reps: int, rounds: int = 5) -> float:
    """Median over `rounds` of (wall time of `reps` async calls, blocked once) / reps."""
    for _ in range(3):
        fn(*args).block_until_ready()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        out.block_until_ready()
        times.append((time.perf_counter() - t) / reps)
    return float(np.median(times))


def _progress(i: int, total: int, label: str) -> None:
    bar = "#" * (24 * i // total)
    print(f"\r[{bar:24s}] {i}/{total} {label:40s}", end="", file=sys.stderr, flush=True)


def run(shapes, dtypes) -> list[Row]:
    rows = []
    total = len(shapes) * len(dtypes)
    ours = jax.jit(lambda x, y: jax_sm100.matmul(x, y))
    dot = jax.jit(lambda x, y: jnp.dot(x, y))
    for dtype in dtypes:
        for m, n, k in shapes:
            _progress(len(rows), total, f"{dtype} {m}x{n}x{k}")
            ka, kb = jax.random.split(jax.random.key(m * 31 + n * 7 + k))
            a = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
            b = jax.random.normal(kb, (k, n), jnp.float32).astype(dtype)
            ours(a, b).block_until_ready()
            how = gpu_lowering.explain()
            kernel = how.plan.kernel if how is not None and how.plan is not None else "xla"
            reps = 30 if m * n * k >= 2**33 else 200
            rows.append(Row(dtype, (m, n, k), time_per_call(ours, a, b, reps=reps),
                            time_per_call(dot, a, b, reps=reps), kernel))  # fmt: skip
    _progress(total, total, "done")
    print(file=sys.stderr)
    return rows


def cold_compile_times(shapes, dtypes) -> list[tuple[str, float]]:
    """Seconds of `compile_plan` for each distinct binary, bypassing both caches."""
    from jax_sm100._src import planning  # noqa: PLC0415

    arch, num_sms = gpu_lowering.device_info()
    arch = arch or "sm_90a"
    seen, out = set(), []
    for dtype in dtypes:
        for m, n, k in shapes:
            p = planning.plan(m, n, k, a_dtype=dtype, b_dtype=dtype, arch=arch)
            if p.kernel == planning.KERNEL_XLA:
                continue
            if num_sms:
                p = dataclasses.replace(p, num_sms=num_sms)
            key = compile_mod.binary_key(p, KernelSpec.for_plan(p))
            if key in seen:
                continue
            seen.add(key)
            t = time.perf_counter()
            compile_mod._build(p, KernelSpec.for_plan(p))
            out.append((f"{dtype} {m}x{n}x{k} ({p.kernel} {p.cta_tile_mnk[:2]})",
                        time.perf_counter() - t))  # fmt: skip
    return out


def report(rows: list[Row]) -> None:
    print(f"{'dtype':9s} {'m x n x k':18s} {'ours TF/s':>9s} {'dot TF/s':>9s} {'ratio':>6s} "
          f"{'ours us':>8s} {'dot us':>8s}  kernel")  # fmt: skip
    for r in rows:
        shape = "x".join(map(str, r.shape))
        print(f"{r.dtype:9s} {shape:18s} {r.flop / r.ours_s / 1e12:9.1f} "
              f"{r.flop / r.dot_s / 1e12:9.1f} {r.ratio:6.3f} {r.ours_s * 1e6:8.1f} "
              f"{r.dot_s * 1e6:8.1f}  {r.kernel}")  # fmt: skip
    big = [r.ratio for r in rows if r.shape[0] >= 4096]
    if big:
        geo = math.exp(sum(map(math.log, big)) / len(big))
        print(f"geomean ratio over shapes with m >= 4096: {geo:.3f}")
    for r in rows:
        if r.shape == (128, 128, 128):
            print(f"per-call overhead vs jnp.dot at 128^3 ({r.dtype}): "
                  f"{(r.ours_s - r.dot_s) * 1e6:+.1f} us")  # fmt: skip


def plot(rows: list[Row], path: str) -> None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    dtypes = sorted({r.dtype for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        sel = [r for r in rows if r.dtype == dtype]
        x = np.arange(len(sel))
        ax.bar(x - 0.2, [r.flop / r.ours_s / 1e12 for r in sel], 0.4, label="jax_sm100.matmul")
        ax.bar(x + 0.2, [r.flop / r.dot_s / 1e12 for r in sel], 0.4, label="jnp.dot")
        ax.set_xticks(x, ["x".join(map(str, r.shape)) for r in sel], rotation=30, ha="right")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{dtype} on {jax.devices()[0].device_kind}")
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_sm100.bench", description=__doc__)
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--plot", default=os.path.join("benchmarks", "out", "bench.png"))
    ap.add_argument("--no-compile-times", action="store_true")
    args = ap.parse_args(argv)
    dtypes = args.dtypes.split(",")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
          f"target {gpu_lowering.device_info()}")  # fmt: skip
    rows = run(shapes, dtypes)
    report(rows)
    if not args.no_compile_times:
        for label, secs in cold_compile_times(shapes, dtypes):
            print(f"cold compile {secs:5.2f} s  {label}")
    plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
