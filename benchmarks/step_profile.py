"""Where a training step's time goes, ours beside `jnp.dot`: round lengths and the GPU's kernels.

    python benchmarks/step_profile.py [--model transformer|mlp] [--top 25] [--small] [--fp8]
                                      [--rounds 10,50,200] [--gaps 12] [--host 20]
                                      [--sequence]

`--fp8` profiles our side with fp8 training products (`bench_train.FP8_SIDES`, through
`jax_sm100.scaled_dot_general`) instead of our bfloat16 ones.

The models are `python -m jax_sm100.bench --train`'s (`jax_sm100/bench_train.py`). For each
side it prints:

* the step time by `bench_train.time_steps_alike` (the two sides' rounds interleaved) in
  rounds of 10, 50 and 200 steps (`--rounds`; "" for none): short rounds are noisier than
  the sides differ (the transformer block read 0.95-1.00x in rounds of 10 on the H200,
  1.000-1.002x in rounds of 50 and 200; benchmarks/RESULTS.md, forty-third session);
* under `jax.profiler`, 20 steps: the wall time a step, the GPU's span a step (first kernel's
  start to last kernel's end, over every stream), each stream's busy time and the idle gaps
  between its kernels, and the `--top` kernels by time a step (name, time, launches a step).

`--sequence` lists every kernel of a step in order with its mean duration (which product is
which, by position). `--host N` lists the host's N busiest event names of every step, a step
(CUDA API calls and XLA's thunks among them: a synchronizing call such as `cuStreamSynchronize`
or `cuMemFree` shows there), and each side prints its dispatch time a step (the loop's time
before it waits): a dispatch as long as the GPU's span means the host, not the GPU, sets the
step's pace.

Where a side's kernels run on one stream (as both did on the H200, forty-third session), span
minus busy is the time the GPU waited for the host. `--small` runs tiny models (a CPU smoke
test; the CPU's profile has no device streams, so only the step times print).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import tempfile
import time

import jax

from jax_sm100 import bench_train as bt

STEPS = 20  # profiled steps a side


def _models(small: bool):
    """(name -> (params, x, model(impl))) for the two models, at `bench --train`'s sizes."""
    mlp = dict(tokens=128, d_model=64, d_ff=128) if small else bt.MLP
    tr = dict(batch=2, seq=64, d_model=128, heads=4, d_ff=256) if small else bt.TRANSFORMER
    key, xkey = jax.random.key(0), jax.random.key(1)
    return {
        "mlp": (
            bt.mlp_params(key, mlp["d_model"], mlp["d_ff"]),
            bt._normal(xkey, (mlp["tokens"], mlp["d_model"])),
            lambda impl: lambda p, x: bt.mlp(impl, p, x),
        ),
        "transformer": (
            bt.transformer_params(key, **tr),
            bt._normal(xkey, (tr["batch"], tr["seq"], tr["d_model"])),
            lambda impl: lambda p, x: bt.transformer(impl, p, x, tr["heads"]),
        ),
    }


def _profile(step, args):
    """(wall s a step, dispatch s a step, {stream: sorted (start ns, duration ns, name)},
    {host event name: [total ns, count, longest ns]}) over STEPS steps."""
    jax.block_until_ready(step(*args))
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        t = time.perf_counter()
        for _ in range(STEPS):
            out = step(*args)
        dispatch = (time.perf_counter() - t) / STEPS
        jax.block_until_ready(out)
        wall = (time.perf_counter() - t) / STEPS
        jax.profiler.stop_trace()
        streams, host = {}, collections.defaultdict(lambda: [0, 0, 0])
        for path in glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True):
            for plane in jax.profiler.ProfileData.from_file(path).planes:
                on_gpu = plane.name.startswith("/device:GPU")
                for line in plane.lines:
                    if on_gpu and line.name.startswith("Stream"):
                        events = [(e.start_ns, e.duration_ns, e.name) for e in line.events]
                        streams[f"{plane.name} {line.name}"] = sorted(events)
                    elif plane.name.startswith("/host"):
                        for e in line.events:
                            total, count, longest = host[e.name]
                            d = e.duration_ns
                            host[e.name] = [total + d, count + 1, max(longest, d)]
    return wall, dispatch, streams, host


def _gaps(evs, count):
    """The `count` largest idle gaps of one stream's step, by position in the step (averaged
    over the profiled steps; the last position is the gap into the next step), with the
    kernels on either side."""
    per_step = len(evs) // STEPS
    if per_step < 2 or len(evs) % STEPS:
        print(f"    (gaps: {len(evs)} kernels over {STEPS} steps, not one sequence a step)")
        return
    rows = []
    for i in range(per_step):
        gaps = [evs[s * per_step + i + 1][0] - sum(evs[s * per_step + i][:2])
                for s in range(STEPS) if s * per_step + i + 1 < len(evs)]  # fmt: skip
        after = evs[(i + 1) % per_step][2]
        rows.append((sum(gaps) / len(gaps) / 1e3, i, evs[i][2], after))
    for gap, i, before, after in sorted(rows, reverse=True)[:count]:
        print(f"    gap {gap:8.1f} us after kernel {i:3d} {before[:60]} -> {after[:60]}")


def _sequence(evs, width=90):
    """Each kernel of one stream's step in order, its duration averaged over the steps."""
    per_step = len(evs) // STEPS
    if len(evs) % STEPS:
        print(f"    (sequence: {len(evs)} kernels over {STEPS} steps, not one sequence a step)")
        return
    for i in range(per_step):
        mean = sum(evs[s * per_step + i][1] for s in range(STEPS)) / STEPS / 1e3
        print(f"    kernel {i:3d} {mean:9.1f} us  {evs[i][2][:width]}")


def _report(name, wall, dispatch, streams, host, top, gaps=0, host_top=0, sequence=False):
    print(f"{name}: wall {wall * 1e3:.3f} ms a step under the profiler, dispatched in "
          f"{dispatch * 1e3:.3f} ms a step")  # fmt: skip
    # Events of every step only: the trace also holds the closing wait and stop_trace.
    per_step = {name: v for name, v in host.items() if v[1] >= STEPS}
    for event, (d, n, longest) in sorted(per_step.items(), key=lambda kv: -kv[1][0])[:host_top]:
        print(f"  host {d / STEPS / 1e3:9.1f} us  x{n / STEPS:<6g} longest {longest / 1e3:8.1f} us "
              f"{event[:80]}")  # fmt: skip
    events = sorted(e for evs in streams.values() for e in evs)
    if not events:
        print("  no device streams in the profile")
        return
    span = (max(s + d for s, d, _ in events) - events[0][0]) / STEPS / 1e6
    print(f"  GPU span {span:.3f} ms a step over {len(streams)} stream(s)")
    for stream, evs in streams.items():
        busy = sum(d for _, d, _ in evs) / STEPS / 1e6
        between = [b[0] - (a[0] + a[1]) for a, b in zip(evs, evs[1:], strict=False)]
        idle = sum(g for g in between if g > 0) / STEPS / 1e3
        print(f"  {stream}: {len(evs) // STEPS} kernels a step, busy {busy:.3f} ms, idle "
              f"between them {idle:.1f} us")  # fmt: skip
        if gaps and between:
            _gaps(evs, gaps)
        if sequence:
            _sequence(evs)
    by_name = collections.defaultdict(lambda: [0, 0])
    for _, d, kernel in events:
        by_name[kernel][0] += d
        by_name[kernel][1] += 1
    for kernel, (d, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {d / STEPS / 1e3:9.1f} us  x{n / STEPS:<5g} {kernel[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default="transformer", choices=("transformer", "mlp"))
    ap.add_argument("--top", type=int, default=25, help="kernels listed a side")
    ap.add_argument("--small", action="store_true", help="tiny models (a CPU smoke test)")
    ap.add_argument("--fp8", action="store_true",
                    help="our side with fp8 training products (bench_train.FP8_SIDES)")  # fmt: skip
    ap.add_argument("--rounds", default="10,50,200", help="round lengths timed ('' for none)")
    ap.add_argument("--gaps", type=int, default=0,
                    help="a stream's largest idle gaps a step, with their kernels")  # fmt: skip
    ap.add_argument("--host", type=int, default=0, help="the host's busiest events a step")
    ap.add_argument("--sequence", action="store_true",
                    help="every kernel of a step in order, with its mean duration")  # fmt: skip
    args = ap.parse_args()
    ours = "ours fp8" if args.fp8 else "ours"
    p, x, model = _models(args.small)[args.model]
    steps = {}
    for impl in (ours, "jnp"):
        step = jax.jit(jax.value_and_grad(bt._loss(model(impl)), argnums=(0, 1)))
        steps[impl] = step.lower(p, x).compile()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, {args.model}")
    sides = [(steps[ours], (p, x)), (steps["jnp"], (p, x))]
    lengths = {10: 6, 50: 6, 200: 4}
    for n, rounds in ((int(n), lengths.get(int(n), 4)) for n in args.rounds.split(",") if n):
        ours_s, theirs = bt.time_steps_alike(sides, steps=n, rounds=rounds)
        print(f"rounds of {n:3d} steps ({rounds}): {ours} {ours_s * 1e3:.3f} ms, jnp.dot "
              f"{theirs * 1e3:.3f} ms, ratio {theirs / ours_s:.3f}")  # fmt: skip
    for impl in (ours, "jnp"):
        _report(impl if impl != "jnp" else "jnp.dot", *_profile(steps[impl], (p, x)), args.top,
                args.gaps, args.host, args.sequence)  # fmt: skip


if __name__ == "__main__":
    main()
