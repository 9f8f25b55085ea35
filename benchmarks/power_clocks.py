"""SM clock and board power while our kernel and `jnp.dot` run, side by side (H200).

    python benchmarks/power_clocks.py [--shapes 16384x4096x4096,...] [--seconds 1.5] [--rounds 2]

Each (shape, function, data) runs sustained for `--seconds` (many async-dispatched calls, one
block) while `nvidia-smi` samples the SM clock, board power and the active clock-limit reasons
every 50 ms; the samples that fall inside a run are summarised by their median. Besides TFLOP/s
it prints TFLOP/s per GHz of SM clock (work per cycle), which separates "fewer cycles" from
"slower cycles": two kernels at the power cap with equal work per cycle differ only in how much
power each FLOP draws.

Two operand kinds: `normal` (what the benchmarks and a user's model feed) and `int` (integers in
[-2, 2], as CUTLASS's own harness fills them; fewer toggling bits, less power). The `int` rows are
a diagnosis only: speed claims come from normal data.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sm100

SHAPES = ((8192, 8192, 8192), (16384, 4096, 4096), (4096, 14336, 4096), (4096, 4096, 4096))
_FIELDS = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"


class Sampler:
    """`nvidia-smi` polling in the background; `window(t0, t1)` gives the samples in between."""

    def __init__(self, period_ms: int = 50):
        fields = _FIELDS
        probe = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
        )
        if probe.returncode != 0:  # older drivers name the reasons "throttle"
            fields = fields.replace("clocks_event_reasons", "clocks_throttle_reasons")
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
             f"-lms={period_ms}"],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.samples: list[tuple[float, float, float, str]] = []

    def stop(self) -> None:
        self.proc.terminate()
        out, _ = self.proc.communicate()
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 4:
                continue
            try:
                stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.samples.append((stamp, float(parts[1]), float(parts[2]), parts[3]))
            except ValueError:
                continue

    def window(self, t0: float, t1: float):
        return [s for s in self.samples if t0 <= s[0] <= t1]


def sustained(fn, a, b, seconds: float) -> tuple[float, float, float]:
    """(seconds per call, start, end) of calls dispatched back to back for about `seconds`."""
    fn(a, b).block_until_ready()
    t = time.perf_counter()
    fn(a, b).block_until_ready()
    reps = max(5, int(seconds / max(time.perf_counter() - t, 1e-6)))
    start = time.time()
    t = time.perf_counter()
    out = None
    for _ in range(reps):
        out = fn(a, b)
    out.block_until_ready()
    return (time.perf_counter() - t) / reps, start, time.time()


def operands(m, n, k, dtype, kind):
    ka, kb = jax.random.split(jax.random.key(m * 31 + n * 7 + k))
    if kind == "normal":
        a = jax.random.normal(ka, (m, k), jnp.float32)
        b = jax.random.normal(kb, (k, n), jnp.float32)
    else:
        a = jax.random.randint(ka, (m, k), -2, 3).astype(jnp.float32)
        b = jax.random.randint(kb, (k, n), -2, 3).astype(jnp.float32)
    return a.astype(dtype), b.astype(dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kinds", default="normal,int")
    args = ap.parse_args()
    dt = jnp.dtype(args.dtype)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    fns = {"ours": jax.jit(lambda x, y: jax_sm100.matmul(x, y)), "jnp.dot": jax.jit(jnp.dot)}
    sampler = Sampler()
    time.sleep(0.5)
    runs = []  # (shape, kind, who, sec/call, t0, t1)
    for m, n, k in shapes:
        for kind in args.kinds.split(","):
            a, b = operands(m, n, k, dt, kind)
            ref = np.asarray(fns["jnp.dot"](a, b).astype(jnp.float32))
            out = np.asarray(fns["ours"](a, b).astype(jnp.float32))
            err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            how = jax_sm100.last_lowering()
            plan = how.plan if how is not None else None
            print(f"{m}x{n}x{k} {kind}: rel. err vs jnp.dot {err:.1e}; plan {plan}", flush=True)
            for _ in range(args.rounds):
                for who, fn in fns.items():
                    per, t0, t1 = sustained(fn, a, b, args.seconds)
                    runs.append(((m, n, k), kind, who, per, t0, t1))
                    time.sleep(0.2)
    time.sleep(0.3)
    sampler.stop()
    print(f"\n{len(sampler.samples)} nvidia-smi samples; one line per run (median of its samples)")
    print("| shape | data | who | TFLOP/s | SM MHz | W | TFLOP/s per GHz | limit reasons |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    for (m, n, k), kind, who, per, t0, t1 in runs:
        # Skip the first 0.2 s of a run (clocks settle); keep all when the run was shorter.
        w = sampler.window(t0 + 0.2, t1) or sampler.window(t0, t1)
        tf = 2 * m * n * k / per / 1e12
        mhz = statistics.median(s[1] for s in w) if w else float("nan")
        watts = statistics.median(s[2] for s in w) if w else float("nan")
        reasons = sorted({s[3] for s in w})
        print(f"| {m}x{n}x{k} | {kind} | {who} | {tf:.0f} | {mhz:.0f} | {watts:.0f} | "
              f"{tf / (mhz / 1000):.0f} | {' '.join(reasons)} |")  # fmt: skip
        summary.setdefault(((m, n, k), kind, who), []).append((tf, tf / (mhz / 1000)))
    print("\n| shape | data | ours / jnp.dot TFLOP/s | ours / jnp.dot work per cycle |")
    print("| --- | --- | --- | --- |")
    for (shape, kind, who), vals in summary.items():
        if who != "ours":
            continue
        other = summary[shape, kind, "jnp.dot"]
        r_tf = statistics.median(v[0] for v in vals) / statistics.median(v[0] for v in other)
        r_cy = statistics.median(v[1] for v in vals) / statistics.median(v[1] for v in other)
        print(f"| {'x'.join(map(str, shape))} | {kind} | {r_tf:.3f} | {r_cy:.3f} |")


if __name__ == "__main__":
    main()
