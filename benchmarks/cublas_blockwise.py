"""cuBLAS's own blockwise-scaled fp8 GEMM (through PyTorch) beside ours, on the same data:

    python3 benchmarks/cublas_blockwise.py [--shapes 4096x7168x16384,8192x8192x8192]

Issue 19's scaled target (>= 1300 TF/s at block 128 on the H200) came from published H800 figures.
cuBLAS (12.9 and later) has the same two recipes on SM90, reachable from PyTorch's
`torch._scaled_mm` / `torch.nn.functional.scaled_mm`: A scaled per 1 x 128 (`BlockWise1x128`),
B per 128 x 128 tile (`BlockWise128x128`, DeepSeek-V3's weights) or per 1 x 128 like A
(jax.nn.scaled_matmul's layout). This times, in one process, on the same quantized operands
(`bench_scaled.operands`: normal data, e4m3, float32 scales, bfloat16 out):

- ours: `jax_sm100.scaled_matmul` with B per tile and per row, and our unscaled fp8 kernel;
- cuBLAS fp8 unscaled through `lax.dot_general` (XLA), as `python -m jax_sm100.bench --scaled`;
- cuBLAS through PyTorch: blockwise with B per tile and per row, and unscaled (one scale per
  tensor), each after a check of its result against ours.

Ours are timed by `bench.time_device` (R products in one XLA loop); PyTorch's by CUDA events
around R back-to-back calls on one stream, R grown until a call takes `--device-ms`, each timed
run after an untimed one, median of 5 (launched from Python: at small m, where a call takes
tens of microseconds, the launches may pace it, so PyTorch's figures there are lower bounds).
PyTorch's kernel names are read with `torch.profiler`.
Needs PyTorch with CUDA (the device machine has it); not part of the package or its tests.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_sm100
from jax_sm100 import bench, bench_scaled
from jax_sm100._src import ffi

E4M3 = torch.float8_e4m3fn


def _fp8(x) -> torch.Tensor:
    """A JAX float8_e4m3fn array as a CUDA torch tensor of the same bytes."""
    raw = np.asarray(x).view(np.uint8)
    return torch.from_numpy(raw.copy()).cuda().view(E4M3)


def _f32(x) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x, np.float32).copy()).cuda()


def _outer_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix with stride(0) == 1 (what cuBLAS's 1 x 128 scales are read as)."""
    return t.t().contiguous().t()


def torch_sides(a, b):
    """{name: (zero-argument callable, description)} of PyTorch's products on the bench's
    operands a [m, k], b = (w [n, k], ls [m, k/128], rs [n, k/128], wt [n, k], rst [n/128,
    k/128]); names whose call raised map to the error text instead."""
    w, ls, rs, wt, rst = b
    ta, tw, twt = _fp8(a), _fp8(w), _fp8(wt)
    sa = _outer_major(_f32(ls))  # (m, k/128), stride (1, m)
    sb_rows = _outer_major(_f32(rs))  # (n, k/128), stride (1, n)
    # 128 x 128 scales: (k/128, n/128) with stride (1, k/128 rounded up to 4). Published uses
    # pass the rounded-up extent as the shape; with k/128 a multiple of 4 (every shape this
    # times) the two readings are the same tensor, so other k are refused rather than guessed.
    nb, kb = rst.shape
    if kb % 4:
        raise SystemExit(f"k = {128 * kb}: this script times k a multiple of 512 only")
    sb_tiles = _f32(rst).t()
    one = torch.ones((), dtype=torch.float32, device="cuda")
    F = torch.nn.functional
    recipes = getattr(F, "ScalingType", None)
    sides = {}

    def add(name, fn):
        try:
            out = fn()
            torch.cuda.synchronize()
            sides[name] = (fn, out)
        except Exception as e:  # noqa: BLE001 - report what this PyTorch lacks, keep going
            before = sides.get(name)
            sides[name] = (f"{before}; " if before else "") + (
                f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            )

    for label, wt_, sb, recipe in (
        ("torch tiles", twt, sb_tiles, "BlockWise128x128"),
        ("torch rows", tw, sb_rows, "BlockWise1x128"),
    ):
        if recipes is not None and hasattr(F, "scaled_mm"):
            add(label, lambda wt_=wt_, sb=sb, recipe=recipe: F.scaled_mm(
                ta, wt_.t(), sa, recipes.BlockWise1x128, sb, getattr(recipes, recipe),
                output_dtype=torch.bfloat16))  # fmt: skip
        if not isinstance(sides.get(label), tuple):
            add(label, lambda wt_=wt_, sb=sb: torch._scaled_mm(
                ta, wt_.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))  # fmt: skip
    unscaled = dict(scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
    add("torch fp8", lambda: torch._scaled_mm(ta, tw.t(), **unscaled))
    return sides


def time_torch(fn, min_seconds: float, rounds: int = 5) -> float:
    def run(reps: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    reps = 4
    run(reps)
    while (t := run(reps)) < min_seconds:
        reps = max(2 * reps, int(reps * 1.25 * min_seconds / max(t, 1e-9)))
    times = []
    for _ in range(rounds):
        run(reps)  # untimed: the clocks settle under this product's own load
        times.append(run(reps) / reps)
    return statistics.median(times)


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if e.device_type.name == "CUDA"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--shapes", default="4096x7168x16384,8192x8192x8192")
    ap.add_argument("--device-ms", type=float, default=20.0)
    args = ap.parse_args()
    ffi.register()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}),"
          f" jax {jax.__version__}; e4m3, float32 scales per 128, bfloat16 out")  # fmt: skip
    table = []
    for i, shape in enumerate(args.shapes.split(",")):
        m, n, k = (int(v) for v in shape.split("x"))
        a, b = bench_scaled.operands(i, m, n, k)
        ours = {
            "ours tiles": bench_scaled._scaled(jax_sm100.scaled_matmul, "tiles"),
            "ours rows": bench_scaled._scaled(jax_sm100.scaled_matmul, "rows"),
            "ours fp8": bench_scaled._unscaled(jax_sm100.dot_general),
            "cublas fp8 (xla)": bench_scaled._unscaled(jax.lax.dot_general),
        }
        refs = {name: np.asarray(jax.jit(f)(a, b).astype(jnp.float32)) for name, f in
                list(ours.items())[:3]}  # fmt: skip
        theirs = torch_sides(a, b)
        secs = {}
        for name, side in theirs.items():
            if isinstance(side, str):
                print(f"{shape} {name}: not run ({side})")
                continue
            fn, out = side
            ref = refs.get(name.replace("torch", "ours"))
            if ref is not None:
                got = out.float().cpu().numpy()
                err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
                print(f"{shape} {name}: max |diff| / max |ours| = {err:.2e}")
                if err > 2e-2:
                    print(f"{shape} {name}: DIFFERS from ours, not timed")
                    continue
            print(f"{shape} {name} kernels: {', '.join(kernel_names(fn))}")
            secs[name] = time_torch(fn, args.device_ms / 1e3)
        timings = bench.time_device(list(ours.values()), a, b, min_seconds=args.device_ms / 1e3)
        secs |= {name: t.seconds for name, t in zip(ours, timings, strict=True)}
        # PyTorch's sides once more, after ours, so a clock drift shows.
        for name in [x for x in secs if x.startswith("torch")]:
            secs[name + " (again)"] = time_torch(theirs[name][0], args.device_ms / 1e3)
        table.append((shape, 2 * m * n * k, secs))
    print()
    for shape, flop, secs in table:
        print(f"{shape}: " + ", ".join(f"{name} {flop / s / 1e12:.1f}" for name, s in secs.items())
              + " TF/s")  # fmt: skip


if __name__ == "__main__":
    main()
