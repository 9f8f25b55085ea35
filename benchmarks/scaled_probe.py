"""Plan variants of the block-scaled and unscaled fp8 kernels on one problem, timed side by side
or run inside a CUDA profiler range for Nsight Compute:

    python3 benchmarks/scaled_probe.py --shape 4096x7168x16384 \\
        --variants scaled,scaled:128x128:overlap,scaled:128x192,fp8,fp8:128x128
    ncu --profile-from-start off --section SpeedOfLight --csv \\
        python3 benchmarks/scaled_probe.py --shape ... --variants ... --profile

A variant is `kind[:edit]...`. Kinds: `scaled` (jax_sm100.scaled_matmul's kernel, fp8 e4m3
with float32 scales per 128 of k), `tiled` (scaled_matmul on the weights scaled per 128 x 128
tile: the planner's plan; with edits, the kernel called on the edited plan, e.g.
`tiled:256x128`), `fp8` (the dense fp8 kernel, unscaled, B K-major) and
`cublas` (`lax.dot_general` on the same fp8 data, unscaled: XLA's cuBLAS call) and `jaxnn`
(`jax.nn.scaled_matmul` on the `scaled` kind's operands, B scaled per row: issue 19's baseline,
beside ours in one process). Edits change the
planner's plan in order (`planning.sm90_variant`, stages refilled): `TMxTN` the tile, `overlap`
`GemmPlan.scaled_overlap`, `coop` the planner's cooperative plan (fp8), `pp` the ping-pong
schedule (unscaled kinds; after the tile, e.g. `fp8:128x160:pp`), `cAxB` the cluster,
`sk0`/`sk1` stream-K off/on, `spN` split-K N ways (fp8), `swzN` the raster swizzle, `eN` the
epilogue stages, `epiN` the epilogue sub-tile width, `rm`/`rn` the raster along M/N,
`swap`/`noswap` the swapped product (`GemmPlan.swap_ab`, fp8) on or off, e.g. the unswapped
plan of a very tall grid before the swap: `fp8:noswap:64x256:c2x1:rn`, `smsN` the SMs the
persistent grid takes (`GemmPlan.num_sms`; e.g. `tiled:sms128`).
`--pairs a/b,...` adds, for each pair of variants, the ratio of a's TF/s to b's in each round
(both timed in it, a few hundred ms apart), as median, quartiles and range over the rounds.
Every variant runs on the same quantized data with a bfloat16 result. Timing is
`python -m jax_sm100.bench`'s device method (with the SM clock and board power NVML saw during
each variant's timed calls, `bench.ClockSampler`): the median of `--rounds` (5 by default), the
rounds taking `bench.round_orders`' orders in turn (a multiple of their count, n variants or 2n
for odd n, balances which variant each follows). Before timing, each `scaled` variant's result
is compared with the first `scaled` variant's, each `tiled` one's with the planner's `tiled`
plan's, `jaxnn`'s with the planner's `scaled` plan's (each planner's plan run for the check
if it is not a variant), and each `fp8` variant's with the `cublas` variant's when one runs
(within `--tol`, 1e-2 of its largest magnitude by default: bfloat16 rounding apart; fp8's
accumulation over a long k in one chain may take more); the others are checked
finite, so a broken variant is reported, not timed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import jax_sm100
from jax_sm100 import bench, bench_scaled
from jax_sm100._src import dispatch, ffi, planning, scaled_gpu
from jax_sm100._src import primitive as P
from jax_sm100._src.planning import sm90_scaled

E4M3 = "float8_e4m3fn"


# Kinds that run XLA's product (their plan is a placeholder, the planner's for the problem).
XLA_KINDS = ("cublas", "jaxnn")


def variant_plan(spec: str, m: int, n: int, k: int) -> planning.GemmPlan:
    kind, *edits = spec.split(":")
    if kind in XLA_KINDS and edits:
        raise SystemExit(f"{spec!r}: {kind} is XLA's product; it takes no edits")
    if kind in ("scaled", "tiled", "jaxnn"):
        plan = jax_sm100.plan(m, n, k, a_dtype=E4M3, b_dtype=E4M3, out_dtype="bfloat16",
                              b_major="k", scale_dtype="float32", scale_block=128,
                              b_scale_rows=128 if kind == "tiled" else 1,
                              arch="sm_90a")  # fmt: skip
    elif kind in ("fp8", "cublas"):
        plan = jax_sm100.plan(m, n, k, a_dtype=E4M3, b_dtype=E4M3, out_dtype="bfloat16",
                              b_major="k", arch="sm_90a")  # fmt: skip
    else:
        raise SystemExit(f"unknown kind {kind!r} in {spec!r}")
    for edit in edits:
        if edit == "overlap":
            plan = sm90_scaled.with_scaled_overlap(plan)
        elif edit == "coop":  # the planner's cooperative plan for the problem
            if kind != "fp8":
                raise SystemExit(f"{spec!r}: coop is for the fp8 kind (scaled plans are "
                                 "cooperative)")  # fmt: skip
            plan = planning.cooperative(plan)
        elif edit == "pp":
            plan = planning.sm90_variant(plan, pingpong=True)
        elif edit[0] == "c":  # cluster, e.g. c2x1
            plan = planning.sm90_variant(
                plan, cluster_mn=tuple(int(v) for v in edit[1:].split("x"))
            )
        elif edit.startswith("sp"):  # split-K, e.g. sp4 (partials summed by XLA)
            plan = planning.with_split(plan, int(edit[2:]))
        elif edit.startswith("sk"):  # stream-K off / on: sk0, sk1
            plan = planning.sm90_variant(plan, stream_k=bool(int(edit[2:])))
        elif edit.startswith("swz"):  # raster swizzle, e.g. swz8
            plan = planning.sm90_variant(plan, swizzle_size=int(edit[3:]))
        elif edit.startswith("epi"):  # epilogue sub-tile width, e.g. epi64
            plan = planning.sm90_variant(plan, epi_n=int(edit[3:]))
        elif edit[0] == "e":  # epilogue stages, e.g. e2
            plan = planning.sm90_variant(plan, num_epi_stages=int(edit[1:]))
        elif edit in ("rm", "rn"):  # raster along M / N
            plan = planning.sm90_variant(plan, raster_along_m=edit == "rm")
        elif edit in ("swap", "noswap"):  # D^T = B A^T on the same tiles (fp8), or not
            plan = planning.sm90_variant(plan, swap_ab=edit == "swap")
        elif edit.startswith("sms"):  # the persistent grid's SMs, e.g. sms128
            plan = dataclasses.replace(plan, num_sms=int(edit[3:]))
        else:
            tile = tuple(int(v) for v in edit.split("x"))
            # 256-row tiles run the serial loop only (constraints.check_scaled_overlap): the
            # planner's overlap is turned off; an `overlap` edit before the tile is refused.
            if tile[0] == 256 and "overlap" in edits[: edits.index(edit)]:
                raise SystemExit(f"{spec!r}: 256-row tiles run the serial loop (no overlap)")
            serial = {"scaled_overlap": False} if tile[0] == 256 and plan.scale_dtype else {}
            plan = planning.sm90_variant(plan, tile_mn=tile, **serial)
    return plan


def sms_context(spec: str, plan: planning.GemmPlan):
    """For an unscaled variant with an `smsN` edit: a context in which the matmul lowering
    sees a device of that many SMs (it otherwise resizes a caller's plan to the device's), so
    the kernel's persistent grid takes N SMs; None for the others (the block-scaled kernel is
    called on its plan as it is)."""
    if spec.split(":")[0] != "fp8" or not any(e.startswith("sms") for e in spec.split(":")):
        return None
    target = dispatch.Target(plan.arch, plan.num_sms, on_device=True)
    return lambda: mock.patch.object(dispatch, "device_target", lambda: target)


def product(spec: str, plan: planning.GemmPlan):
    """(a [m, k], (w [n, k], ls, rs, ...)) -> [m, n] bfloat16 on `plan`'s kernel (cuBLAS for a
    `cublas` variant: `lax.dot_general`, unscaled), on `bench_scaled.operands`."""
    ffi.register()
    if spec.split(":")[0] == "cublas":
        return bench_scaled._unscaled(jax.lax.dot_general)
    if spec.split(":")[0] == "jaxnn":
        return bench_scaled._scaled(jax.nn.scaled_matmul)
    if spec == "tiled":
        return bench_scaled._scaled(jax_sm100.scaled_matmul, "tiles")
    if plan.kernel == planning.KERNEL_SM90_SCALED:
        # The bench's scaled product (its weights and loop-variant scales) on `plan`'s kernel.
        weights = "tiles" if spec.split(":")[0] == "tiled" else "rows"
        return bench_scaled._scaled(
            lambda *ops, preferred_element_type: scaled_gpu._call_sm90(plan, *ops), weights
        )

    def unscaled(a, b):
        (out,) = P.matmul_p.bind(
            a, b[0], plan=plan, transpose_a=False, transpose_b=True, alpha=1.0, beta=1.0,
            activation=None, out_dtype=np.dtype(jnp.bfloat16), has_bias=False, has_c=False,
            save_preact=False, act_grad=None,
        )  # fmt: skip
        return out

    return unscaled


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="4096x7168x16384")
    ap.add_argument("--variants", default="scaled,scaled:128x128:overlap,fp8,fp8:128x128")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="one call of each variant inside cudaProfilerStart/Stop, no timing",
    )
    ap.add_argument("--device-ms", type=float, default=20.0)
    ap.add_argument(
        "--tol",
        type=float,
        default=1e-2,
        help="largest |diff| / max |ref| a checked variant may have and be timed",
    )
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (the median is kept)")
    ap.add_argument(
        "--pairs",
        default="",
        help="comma-separated a/b variant pairs: the TF/s ratio of a to b in each round (both "
        "timed in it), summarized as median, quartiles and range",
    )
    args = ap.parse_args()
    m, n, k = (int(v) for v in args.shape.split("x"))
    specs = args.variants.split(",")
    pairs = [pair.split("/") for pair in filter(None, args.pairs.split(","))]
    for pair in pairs:
        # Checked before anything is compiled or timed, so a typo costs no device time.
        if len(pair) != 2 or not set(pair) <= set(specs):
            ap.error(f"--pairs {'/'.join(pair)!r}: want a/b with a and b among --variants {specs}")
    a, b = bench_scaled.operands(0, m, n, k)
    plans = [variant_plan(s, m, n, k) for s in specs]
    fns = [jax.jit(product(s, p)) for s, p in zip(specs, plans, strict=True)]
    contexts = [sms_context(s, p) for s, p in zip(specs, plans, strict=True)]
    outs = []
    for f, ctx in zip(fns, contexts, strict=True):
        with ctx() if ctx else contextlib.nullcontext():
            outs.append(np.asarray(f(a, b).astype(jnp.float32)))

    # References: for `scaled` variants the first of them; for `jaxnn` (the same per-row
    # product, by XLA) and `tiled` variants the planner's plain `scaled` / `tiled` plan, run
    # here if it is not among the variants, so that an edited plan never checks only itself.
    def planner_ref(kind):
        plain = [o for o, s in zip(outs, specs, strict=True) if s == kind]
        return plain[0] if plain else np.asarray(
            jax.jit(product(kind, variant_plan(kind, m, n, k)))(a, b).astype(jnp.float32)
        )  # fmt: skip

    refs = {"scaled": next((o for o, s in zip(outs, specs, strict=True)
                            if s.startswith("scaled")), None)}  # fmt: skip
    if "jaxnn" in specs:
        refs["jaxnn"] = planner_ref("scaled")
    if any(s.startswith("tiled") for s in specs):
        refs["tiled"] = planner_ref("tiled")
    # Unscaled fp8 variants: cuBLAS's product of the same data, when a `cublas` variant runs.
    refs["fp8"] = next((o for o, s in zip(outs, specs, strict=True) if s == "cublas"), None)
    ok = []
    for s, o in zip(specs, outs, strict=True):
        ref = refs.get(s.split(":")[0])
        if ref is not None:
            err = float(np.max(np.abs(o - ref)) / max(np.max(np.abs(ref)), 1e-30))
            ok.append(err < args.tol)
            print(f"{s}: max |diff| / max |ref| = {err:.2e} against its reference")
        else:
            ok.append(bool(np.isfinite(o).all()))
    if args.profile:
        from cuda.bindings import runtime as cudart  # noqa: PLC0415

        for f in fns:
            f(a, b).block_until_ready()
        cudart.cudaProfilerStart()
        for f in fns:
            f(a, b).block_until_ready()
        cudart.cudaProfilerStop()
        print("profiled one call of each:", ", ".join(specs))
        return
    timed = [(s, p, f) for s, p, f, good in zip(specs, plans, fns, ok, strict=True) if good]
    timed_contexts = [c for c, good in zip(contexts, ok, strict=True) if good]
    with bench.ClockSampler() as clocks:
        timings = bench.time_device([f for _, _, f in timed], a, b,
                                    min_seconds=args.device_ms / 1e3, rounds=args.rounds,
                                    contexts=timed_contexts)  # fmt: skip
    print(f"{jax.devices()[0].device_kind}, {m}x{n}x{k}, device method, median of {args.rounds}; "
          "SM clock and board power: means over the timed calls (NVML)")  # fmt: skip
    for (s, p, _), t in zip(timed, timings, strict=True):
        seen = clocks.over(t.intervals)
        rate = 2 * m * n * k / t.seconds / 1e12
        # TF/s per GHz of SM clock: the kernel's work per cycle, apart from the clock it got.
        power = "" if seen is None else (
            f" @ {seen.sm_mhz:6.0f} MHz ({rate / seen.sm_mhz * 1e3:6.1f} TF/s/GHz) "
            f"{seen.watts:5.0f} W (reasons {seen.reasons:#x})"
        )  # fmt: skip
        tflops = f"{s:28s} {rate:8.1f} TF/s{power}"
        if s in XLA_KINDS:
            print(f"{tflops}   - (XLA's product)")
            continue
        tm, tn, _ = p.cta_tile_mnk
        print(
            f"{tflops}   {tm}x{tn} "
            f"{p.cluster_shape_mn} {p.num_ab_stages} stages stream_k={p.stream_k} "
            f"pingpong={p.pingpong} overlap={p.scaled_overlap} swap={p.swap_ab} "
            f"{'rm' if p.raster_along_m else 'rn'} swz{p.swizzle_size} sms{p.num_sms}"
        )
    for s, good in zip(specs, ok, strict=True):
        if not good:
            print(f"{s}: WRONG result, not timed")
    by_spec = {s: t for (s, _, _), t in zip(timed, timings, strict=True)}
    for num, den in pairs:
        pair = f"{num}/{den}"
        if num not in by_spec or den not in by_spec:
            print(f"{pair}: not both timed (a wrong result is not timed)")
            continue
        ratios = per_round(by_spec[den]) / per_round(by_spec[num])
        q1, med, q3 = np.percentile(ratios, [25, 50, 75])
        print(
            f"{pair}: per-round TF/s ratio median {med:.3f} (quartiles {q1:.3f}-{q3:.3f}, "
            f"range {ratios.min():.3f}-{ratios.max():.3f}, {len(ratios)} rounds)"
        )


def per_round(timing: bench.DeviceTiming) -> np.ndarray:
    """Seconds per product in each timed round of `timing`."""
    return np.array([t1 - t0 for t0, t1 in timing.intervals]) / timing.reps


if __name__ == "__main__":
    main()
