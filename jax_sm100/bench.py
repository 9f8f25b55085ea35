"""`python -m jax_sm100.bench`: jax_sm100.matmul against jnp.dot on this machine's GPU.

Both sides run in the same process on the same inputs (drawn from a normal distribution), each
jitted, and are timed by two methods (`--method wall|device|both`, default both), each applied
identically to both sides:

wall
    What a caller of `jax.jit(f)(a, b)` gets. 3 warm-up calls, then 5 rounds of N asynchronously
    dispatched calls blocked once per round; the median round divided by N is the time per call.
    This includes the per-call Python/XLA dispatch (40-60 us on the H200), so every shape whose
    kernel takes less than ~100 us measures dispatch more than the kernel, and its ratio swings
    by tens of percent between runs.
device
    What the device sustains per product. One jitted function runs the product R times in a
    `lax.fori_loop` of R / U iterations whose body holds U products (U = `--unroll`, default
    16; R is a multiple of U). Each product writes `a[0, 0] + scale * out[0, 0]` of its output
    into a[0, 0] of the next, with `scale` a runtime argument equal to 0.0. XLA cannot fold a
    runtime scale, so it can neither hoist a product out of the loop nor merge or drop any,
    while each result stays exactly one product's. Every result of every product of an
    iteration is carried out of the loop, so that XLA computes each in full (an XLA epilogue
    after the dot included) and not only the element the next update reads; those U slots are
    donated to each call and taken back from it, so no timed call fills them. R starts at 4 U
    and grows (in multiples of U) until one call takes >= 20 ms (`--device-ms`); the time is
    the median over 5 rounds of one call's wall time (after warm-up) divided by R, so dispatch
    is paid once per R products.
    In each round every side's timed call follows an untimed one of its own, so each is timed
    under its own load's clocks, not the previous side's (`time_device`).
    Unrolling shares the loop's own cost per iteration (15.3 us on the H200 with no product
    inside, more than the smallest kernels take) among U products. The compiled HLO is
    checked: exactly one while loop, with the known trip count R / U, whose body holds exactly
    U products (the `jax_sm100_gemm` custom call, a cuBLAS call or a dot), each with the full
    [m, n] output, all U products' results returned at full size, no operand copy, and no
    product outside it; a figure that fails the check is printed with `!` and the reason.
    What the loop costs besides the products (its
    bookkeeping and each product's one-element update), measured with the products removed
    under the same unrolling, is printed as the loop overhead per product, and is inside both
    sides' device times.

Both exist because they answer different questions: device ratios judge the kernels (the
project's targets, such as >= 2x jnp.dot at 64x4096x4096 where a kernel takes a few
microseconds, are about them); wall ratios are what one unbatched call from Python gets.

Prints TFLOP/s, microseconds and the ratio ours / jnp.dot (> 1: ours is faster) per shape, dtype
and method with a progress bar, the geomean ratio over the large shapes for each method, the
per-call wall overhead at 128^3, and the cold compile time of every distinct kernel binary the
shapes need (compiled with the on-disk cache bypassed). Writes a PNG plot when matplotlib is
installed (`--plot`, default benchmarks/out/bench.png; that folder is git-ignored): device-method
TFLOP/s and ratios when measured, wall otherwise.

Options: --dtypes bfloat16,float16  --shapes 4096x4096x4096,...  --method wall|device|both
         --device-ms 20  --unroll 16  --no-compile-times
         --train: a training step instead (jax_sm100/bench_train.py: value_and_grad of an MLP
         block and a transformer block beside jnp.dot, and the backward products alone)
         --ragged: grouped GEMMs beside lax.ragged_dot (jax_sm100/bench_ragged.py)
         --scaled: block-scaled fp8 GEMMs beside jax.nn.scaled_matmul and unscaled fp8
         (jax_sm100/bench_scaled.py)
         --quantize: jax_sm100.quantize_both beside XLA's two quantizations
         (jax_sm100/bench_quantize.py)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jax_sm100
from jax_sm100._src import compile as compile_mod
from jax_sm100._src import dispatch
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
METHODS = ("wall", "device")
# Products per iteration of the device method's loop. An XLA while-loop iteration cost 15.3 us
# on the H200 with nothing inside (`_loop_overhead` at unroll 1), more than the smallest kernels
# benchmarked (128^3, 64x4096x4096) take; shared by 16 products it is under 1 us each.
DEFAULT_UNROLL = 16


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


# --- The device method: R dependent products in one XLA while loop, U per iteration -------------


def _first(out):
    """A product's out [m, n]: itself, or the first of the results it returns."""
    return out[0] if isinstance(out, tuple) else out


def loop_fn(product: Callable, reps: int, unroll: int = DEFAULT_UNROLL) -> Callable:
    """`f(a, b, scale, slots)`: `product` run `reps` times, each feeding its output to the next.

    Product i computes out_i = product(a_i, b), where a_i is a_{i-1} with a_i[0, 0] =
    a_{i-1}[0, 0] + scale * out_{i-1}[0, 0] (in float32, rounded to a's dtype). With scale = 0.0
    the result is exactly product(a, b); because scale is a runtime value, XLA must still run
    every product in order. The products run `unroll` at a time in the body of a
    `lax.fori_loop` of reps / unroll iterations, so the loop's per-iteration cost is shared by
    `unroll` products. The update is one dynamic-update-slice of `a`, in place; a[0, 0] is also
    carried as a scalar, so that no update reads the big buffer a later update writes (on CPU,
    reading it back made XLA copy `a` before every update but the last of an iteration). A
    product costs one product plus one tiny fusion, and 1 / unroll of the loop counter.

    Every result of every product of an iteration is carried in a loop slot of its own, and `f`
    returns them all. Were only the last product's results kept, the next update would read
    just out[0, 0] of the others, and XLA computes only that element of an XLA epilogue after
    the dot (gelu(y + b1) over one element) and drops a second result outright (seen on CPU):
    the side with the XLA epilogue would do less work than the side whose kernel fuses it.
    The slots come in as an argument (`loop_slots`), so that a caller that donates them and
    passes each call's result to the next (`time_device`) times no filling of them: made
    inside, each call would first write zeros over U times one product's output.

    Args:
      product: (a [m, k], b [k, n]) -> out [m, n], or a tuple whose first element is out (the
        others are carried beside it).
      reps: the number of products, a Python int, a multiple of `unroll` (the trip count
        reps / unroll is then static: XLA knows it and annotates the loop with it).
      unroll: products per loop iteration.

    Returns:
      A function of (a [m, k], b [k, n], scale [], slots=None) returning a tuple of `unroll`
      results, the last iteration's products' in order: the last is the last product's (out
      [m, n], or its tuple). `slots` is what it returns (`loop_slots`: its initial values);
      None makes zeros inside. They take `unroll` times one product's output memory.

    Raises:
      ValueError: `unroll` is not positive or `reps` is not a positive multiple of it.
    """
    if unroll < 1 or reps < 1 or reps % unroll:
        raise ValueError(f"want reps a positive multiple of unroll >= 1, got {reps=}, {unroll=}")

    def f(a, b, scale, slots=None):
        def body(_, carry):
            a, a00, _ = carry
            outs = []
            for _ in range(unroll):
                out = product(a, b)
                outs.append(out)
                a00 = a00.astype(jnp.float32) + scale * _first(out)[0, 0].astype(jnp.float32)
                a00 = a00.astype(a.dtype)
                a = a.at[0, 0].set(a00)
            return a, a00, tuple(outs)

        if slots is None:
            slots = loop_slots(product, a, b, unroll)
        return jax.lax.fori_loop(0, reps // unroll, body, (a, a[0, 0], tuple(slots)))[2]

    return f


def loop_slots(product: Callable, a, b, unroll: int = DEFAULT_UNROLL) -> tuple:
    """`loop_fn`'s slots for `product(a, b)`: `unroll` zero results of its shapes."""
    out = jax.eval_shape(product, a, b)
    return tuple(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), out) for _ in range(unroll))


# Custom-call targets that are one matrix product: ours, cuBLAS/cuBLASLt, oneDNN on CPU.
_PRODUCT_TARGETS = re.compile(r"jax_sm100_gemm|cublas|gemm|matmul", re.IGNORECASE)
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)="
                    r"%?([\w.\-]+)")  # fmt: skip
_CALL_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_DIMS = re.compile(r"\[([\d,]*)\]")
_ENTRY_RESULT = re.compile(r"^ENTRY .*?->\s*(.*?)\s*\{\s*$", re.MULTILINE)  # the module's results


@dataclasses.dataclass(frozen=True)
class _Instr:
    shape: str
    opcode: str
    text: str

    @property
    def called(self) -> list[str]:
        names = _CALLS.findall(self.text)
        for group in _CALL_LISTS.findall(self.text):
            names += [g.strip().lstrip("%") for g in group.split(",") if g.strip()]
        return names

    @property
    def is_product(self) -> bool:
        if self.opcode == "dot":
            return True
        target = _TARGET.search(self.text)  # not jax_sm100_quantize (ffi.QUANTIZE_TARGET)
        return self.opcode == "custom-call" and bool(
            target and _PRODUCT_TARGETS.search(target.group(1))
        )

    @property
    def size(self) -> int:
        """Elements of the result (of its first array, for a tuple such as a cuBLAS call's)."""
        dims = _DIMS.search(self.shape)
        return math.prod(int(d) for d in dims.group(1).split(",") if d) if dims else 0


def _parse_hlo(text: str) -> tuple[dict[str, list[_Instr]], str]:
    """The computations of an HLO module's text (name -> instructions) and the entry's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                words = line.split()
                is_entry = words[0] == "ENTRY"
                name = words[1 if is_entry else 0].lstrip("%")
                current = comps.setdefault(name, [])
                entry = name if is_entry else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        rhs = line.split(" = ", 1)[-1].strip()
        if rhs.startswith("("):  # a tuple shape: up to its closing parenthesis
            depth = np.cumsum([{"(": 1, ")": -1}.get(ch, 0) for ch in rhs])
            end = int(np.argmax(depth == 0)) + 1
            shape, rest = rhs[:end], rhs[end:]
        else:
            shape, _, rest = rhs.partition(" ")
        opcode = re.match(r"\s*([\w\-]+)", rest)
        current.append(_Instr(shape, opcode.group(1) if opcode else "", line))
    return comps, entry


def _reachable(comps, root: str) -> list[str]:
    """`root` and every computation it calls, directly or not, each once."""
    seen, todo = [], [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.append(name)
        todo += [c for ins in comps[name] for c in ins.called]
    return seen


@dataclasses.dataclass(frozen=True)
class LoopCheck:
    """What the compiled HLO of a `loop_fn` function holds.

    Attributes:
      reps: the products asked for.
      unroll: the products per iteration asked for.
      min_size: the elements of one product's output ([m, n]: m * n); 1 checks no size.
      whiles: while loops in the module.
      trip_count: XLA's known trip count of the loop (None when there is not exactly one loop,
        or XLA did not annotate it).
      body_products: products in the loop's body and condition, with what they call.
      small_products: those of them whose output has fewer than `min_size` elements (a product
        XLA narrowed to the one element the next update reads).
      other_products: products elsewhere (hoisted out of the loop or peeled off it).
      body_copies: non-scalar copies in the loop's body (a per-iteration operand copy), other
        than int32 ones (stream-K flags).
      results: how many results of `min_size` elements one product returns (2 for a forward
        that also writes its pre-activation).
      carried: the module's results of exactly `min_size` elements. `loop_fn` returns every
        result of the loop's last U products, which is what makes XLA compute each in full;
        this count guards that contract (a loop keeping fewer is flagged), not what XLA does
        inside the loop (only a check of min_size > 1 reads it).
    """

    reps: int
    unroll: int
    min_size: int
    whiles: int
    trip_count: int | None
    body_products: int
    small_products: int
    other_products: int
    body_copies: int
    results: int = 1
    carried: int = 0

    @classmethod
    def from_hlo(
        cls, text: str, reps: int, unroll: int, min_size: int = 1, results: int = 1
    ) -> LoopCheck:
        """Reads a compiled module's text (`compiled.as_text()`); arguments as the attributes."""
        comps, entry = _parse_hlo(text)
        names = _reachable(comps, entry)
        whiles = [ins for n in names for ins in comps[n] if ins.opcode == "while"]
        total = sum(ins.is_product for n in names for ins in comps[n])
        body_products = small_products = body_copies = 0
        trip_count = None
        header = _ENTRY_RESULT.search(text)
        carried = sum(
            math.prod(int(d) for d in dims.split(",") if d) == min_size
            for dims in _DIMS.findall(header.group(1) if header else "")
        )
        if len(whiles) == 1:
            text = whiles[0].text
            inner = []
            for pattern in (_BODY, _CONDITION):
                found = pattern.search(text)
                inner += _reachable(comps, found.group(1)) if found else []
            products = [ins for n in inner for ins in comps[n] if ins.is_product]
            body_products = len(products)
            small_products = sum(ins.size < min_size for ins in products)
            # int32 copies are a stream-K kernel's flags, zeroed per product (`num_sms` words
            # XLA copies into the buffer aliased to the call's result); not operand copies.
            body_copies = sum(
                ins.opcode in ("copy", "copy-start")
                and not re.match(r"\w+\[\]", ins.shape)
                and not ins.shape.startswith("s32[")
                for n in inner
                for ins in comps[n]
            )
            trip = _TRIP_COUNT.search(text)
            trip_count = int(trip.group(1)) if trip else None
        return cls(reps, unroll, min_size, len(whiles), trip_count, body_products, small_products,
                   total - body_products, body_copies, results, carried)  # fmt: skip

    def problems(self) -> list[str]:
        """Why the loop is not R / U iterations of exactly U products each; empty when it is."""
        out = self.loop_problems()
        if self.body_products != self.unroll:
            out.append(f"{self.body_products} products per iteration, want {self.unroll}")
        if self.small_products:
            out.append(f"{self.small_products} products per iteration with fewer than "
                       f"{self.min_size} output elements (narrowed)")  # fmt: skip
        if self.other_products:
            out.append(f"{self.other_products} products outside the loop (hoisted or peeled)")
        if self.min_size > 1 and self.whiles == 1 and self.carried < self.unroll * self.results:
            want = self.unroll * self.results
            out.append(f"{self.carried} full-size results returned by the loop, want {want} "
                       "(of results not returned, XLA may compute only part)")  # fmt: skip
        return out

    def loop_problems(self) -> list[str]:
        """The problems of the loop itself, whatever it runs: its count, trips and copies."""
        out = []
        if self.whiles != 1:
            out.append(f"{self.whiles} while loops, want 1 (removed, unrolled or split)")
        elif self.trip_count is None:
            out.append("no known trip count (XLA did not annotate the loop)")
        elif self.trip_count != self.reps // self.unroll:
            out.append(f"trip count {self.trip_count}, want {self.reps // self.unroll} "
                       "(unrolled or split further)")  # fmt: skip
        if self.body_copies:
            out.append(f"{self.body_copies} operand copies per iteration")
        return out


@dataclasses.dataclass(frozen=True)
class DeviceTiming:
    """One side's device-method figure: seconds per product, the R it used, its HLO check, and
    each timed call's (start, end) on `time.perf_counter`'s clock (for `ClockSampler.over`)."""

    seconds: float
    reps: int
    check: LoopCheck
    intervals: tuple[tuple[float, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class ClockReading:
    """What `ClockSampler` saw over some intervals: the mean SM clock (MHz) and board power
    (W) of its samples in them, how many, and the clock-event reasons NVML reported in any of
    them, OR'd (0x4: the software power cap; 0x8: HW slowdown; 0x20 / 0x40: thermal)."""

    sm_mhz: float
    watts: float
    samples: int
    reasons: int


class ClockSampler:
    """Samples GPU 0's SM clock, power draw and clock-event reasons through NVML
    (libnvidia-ml, which the driver installs) every `period` seconds on a thread, while entered:

        with bench.ClockSampler() as clocks:
            timings = bench.time_device([f, g], a, b)
        clocks.over(timings[0].intervals)  # a ClockReading, or None

    The H200 runs fp8 GEMMs at its software power cap, where a kernel's TF/s follows the
    clock it is granted (twenty-fourth session, benchmarks/RESULTS.md); a reading per side
    tells the kernel's own speed from the card's state. The clock is NVML's current one; the
    power is `nvmlDeviceGetPowerUsage`'s, which recent GPUs average over up to a second, so
    with sides alternating every few tens of milliseconds it blends them. Where NVML cannot be
    loaded (no NVIDIA driver) nothing is sampled and `over` returns None.
    """

    _SM_CLOCK = 1  # NVML_CLOCK_SM

    def __init__(self, period: float = 0.002):
        self.period = period
        self.samples: list[tuple[float, int, int, int]] = []  # (t, MHz, mW, reasons)
        self._nvml = self._thread = self._stop = None

    def __enter__(self):
        import ctypes  # noqa: PLC0415
        import threading  # noqa: PLC0415

        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            handle = ctypes.c_void_p()
            if nvml.nvmlInit_v2():
                return self
            if nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)):
                nvml.nvmlShutdown()
                return self
        except (OSError, AttributeError):
            return self
        reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        self._nvml, self._stop = nvml, threading.Event()

        def sample():
            mhz, mw, why = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
            while not self._stop.is_set():
                t = time.perf_counter()
                nvml.nvmlDeviceGetClockInfo(handle, self._SM_CLOCK, ctypes.byref(mhz))
                nvml.nvmlDeviceGetPowerUsage(handle, ctypes.byref(mw))
                if reasons_fn is not None:
                    reasons_fn(handle, ctypes.byref(why))
                self.samples.append((t, mhz.value, mw.value, why.value))
                self._stop.wait(self.period)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._nvml.nvmlShutdown()
        return False

    def over(self, intervals) -> ClockReading | None:
        """The samples taken inside any of `intervals` ((start, end) pairs), summarized; None
        when there are none."""
        inside = [s for s in self.samples if any(t0 <= s[0] <= t1 for t0, t1 in intervals)]
        if not inside:
            return None
        reasons = 0
        for s in inside:
            reasons |= s[3]
        return ClockReading(
            sm_mhz=float(np.mean([s[1] for s in inside])),
            watts=float(np.mean([s[2] for s in inside])) / 1e3,
            samples=len(inside),
            reasons=reasons,
        )


def time_device(
    products: Callable | Sequence[Callable],
    a,
    b,
    *,
    min_seconds: float = 0.02,
    rounds: int = 5,
    start_trips: int = 4,
    max_reps: int = 1 << 20,
    unroll: int = DEFAULT_UNROLL,
    contexts: Sequence[Callable[[], contextlib.AbstractContextManager] | None] | None = None,
) -> DeviceTiming | list[DeviceTiming]:
    """Seconds per `product(a, b)` on the device, by `loop_fn` (see the module docstring).

    Each product gets its own R; then the timed calls of several products alternate, round by
    round, in the orders of `round_orders` (each product after each other equally often over
    a full cycle of them), so that a drift of the machine (clocks, other load) and the order's
    own effect fall on all of them alike. Each
    timed call follows an untimed call of the same product, so every product is timed in its
    own steady state: timed right after another product's calls, a power-bound kernel inherits
    that product's clocks (on the H200 an fp8 GEMM timed after a lighter kernel read 10 % faster
    than after a heavier one, so two sides swapped places by their order alone).

    Args:
      products: one product, or several to compare; each (a [m, k], b [k, n]) -> [m, n], or
        a tuple of results whose largest is [m, n]. Each product's loop holds U of its results
        (products of the same result shapes share them) for the whole call.
      a: [m, k], b: [k, n]: the operands.
      min_seconds: R grows (from `start_trips` * `unroll`, at least doubling) until one call
        takes this long.
      rounds: timed calls of each product after warm-up; the median is kept.
      start_trips: the first trip count tried. Keep it >= 2: XLA removes a loop of one trip,
        and the check then fails.
      max_reps: R never exceeds this (nor falls below `unroll`).
      unroll: products per loop iteration; R is a multiple of it.
      contexts: for each product, None or a function returning a context manager that is
        entered while that product's loops are traced, lowered and compiled (e.g. one that
        sets an environment variable the planner reads), so that two products of the same
        operation can take different plans.

    Returns:
      For each product (a single one when `products` is one), the median call time / R, R, and
      the check of the compiled loop.
    """
    scale = jnp.zeros((), jnp.float32)
    top_trips = max(1, max_reps // unroll)

    # The loops' result slots, donated to each call and taken back from it; by the results'
    # shapes and dtypes, so that products of the same results share one set (the loop never
    # reads them).
    slots, kinds, shapes = {}, [], []  # kinds[i], shapes[i]: product i's results

    def one_call(i, compiled) -> tuple[float, float]:
        t = time.perf_counter()
        slots[kinds[i]] = jax.block_until_ready(compiled(a, b, scale, slots[kinds[i]]))
        return t, time.perf_counter()

    def calibrate(i, product):
        trips = max(1, min(start_trips, top_trips))
        shapes.append(jax.eval_shape(product, a, b))  # inside the product's context
        kinds.append(str(jax.tree.structure(shapes[i])) + str(jax.tree.leaves(shapes[i])))
        if kinds[i] not in slots:
            slots[kinds[i]] = jax.block_until_ready(loop_slots(product, a, b, unroll))
        while True:
            reps = trips * unroll
            loop = jax.jit(loop_fn(product, reps, unroll), donate_argnums=3)
            compiled = loop.lower(a, b, scale, slots[kinds[i]]).compile()
            one_call(i, compiled)  # warm-up: first-call allocation and loading
            t0, t1 = one_call(i, compiled)
            t = t1 - t0
            if t >= min_seconds or trips >= top_trips:
                return compiled, reps
            grow = math.ceil(trips * 1.25 * min_seconds / max(t, 1e-9))
            trips = min(top_trips, max(2 * trips, grow))

    if rounds < 1:
        raise ValueError(f"rounds={rounds}: at least one timed round is needed")
    single = callable(products)
    products = [products] if single else list(products)
    contexts = list(contexts) if contexts is not None else [None] * len(products)
    if len(contexts) != len(products):
        raise ValueError(f"{len(contexts)} contexts for {len(products)} products")
    loops = []
    for i, (product, context) in enumerate(zip(products, contexts, strict=True)):
        with context() if context is not None else contextlib.nullcontext():
            loops.append(calibrate(i, product))

    def settled_call(i) -> tuple[float, float]:
        one_call(i, loops[i][0])  # untimed: the clocks settle under this product's own load
        return one_call(i, loops[i][0])

    # Rounds take the orders of `round_orders` in turn, so that each product follows each other
    # one equally often: the settling call does not absorb everything a predecessor leaves
    # behind (on the H200, 2026-12-02, of two block-scaled plans in a fixed order the one timed
    # right after `jax.nn.scaled_matmul`'s read 2.6-3.7 % below the other, whichever it was).
    orders = round_orders(len(loops))
    spans = np.zeros((rounds, len(loops), 2))
    for r in range(rounds):
        for i in orders[r % len(orders)]:
            spans[r, i] = settled_call(i)
    times = spans[:, :, 1] - spans[:, :, 0]
    out = []
    for i, (compiled, reps) in enumerate(loops):
        leaves = jax.tree.leaves(shapes[i])
        size = max(math.prod(x.shape) for x in leaves)
        results = sum(math.prod(x.shape) == size for x in leaves)
        check = LoopCheck.from_hlo(compiled.as_text(), reps, unroll, size, results)
        intervals = tuple((float(t0), float(t1)) for t0, t1 in spans[:, i])
        out.append(DeviceTiming(float(np.median(times[:, i])) / reps, reps, check, intervals))
    return out[0] if single else out


def round_orders(n: int) -> list[list[int]]:
    """Orders of `n` products for `time_device`'s rounds, balanced for the product just
    before: a Williams design, n orders (2n where n is odd) in which each product takes each
    place equally often and follows each other product equally often (once; twice where n is
    odd). A round's first product follows the last round's last, which the design leaves out.

    >>> round_orders(4)
    [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]
    """
    if n < 1:
        return [[]]
    # First order 0, 1, n-1, 2, n-2, ...; order r adds r to each (mod n).
    first = [0]
    lo, hi = 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    orders = [[(p + r) % n for p in first] for r in range(n)]
    if n % 2 and n > 1:
        orders += [order[::-1] for order in orders]
    return orders


def _loop_overhead(a, b, min_seconds: float, unroll: int = DEFAULT_UNROLL) -> DeviceTiming:
    """Seconds per product of the device method's loop with the products taken out.

    The same loop (`unroll` one-element updates of `a` per iteration, each chained to the
    last) with each product replaced by a [1, 1] one that reads a few elements of `a`: what a
    product's time in `time_device` holds besides the product itself. XLA may fuse the updates
    of one iteration, which real products keep apart, so this is a lower bound. The check's
    `loop_problems` say whether the loop ran as the timed ones do.
    """

    def no_product(x, y):
        # More than a[0, 0]: XLA reads that from the carried scalar, leaving `a` unread and dead.
        row = x[:1, :8].astype(jnp.float32).sum(keepdims=True)
        return row * y[:1, :1].astype(jnp.float32)

    return time_device(no_product, a, b, min_seconds=min_seconds, unroll=unroll)


# --- The benchmark -------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One shape and dtype: seconds per product of (ours, jnp.dot) by each method measured."""

    dtype: str
    shape: tuple[int, int, int]
    kernel: str
    wall: tuple[float, float] | None = None
    device: tuple[DeviceTiming, DeviceTiming] | None = None

    @property
    def flop(self) -> int:
        return 2 * math.prod(self.shape)

    def seconds(self, method: str) -> tuple[float, float] | None:
        if method == "wall":
            return self.wall
        return None if self.device is None else (self.device[0].seconds, self.device[1].seconds)

    def ratio(self, method: str) -> float | None:
        """jnp.dot's time / ours: > 1 when ours is faster."""
        s = self.seconds(method)
        return None if s is None else s[1] / s[0]

    def problems(self) -> list[str]:
        if self.device is None:
            return []
        return [f"{who}: {p}" for who, t in zip(("ours", "jnp.dot"), self.device, strict=True)
                for p in t.check.problems()]  # fmt: skip


def _progress(i: int, total: int, label: str) -> None:
    bar = "#" * (24 * i // total)
    print(f"\r[{bar:24s}] {i}/{total} {label:40s}", end="", file=sys.stderr, flush=True)


def _operands(m, n, k, dtype):
    ka, kb = jax.random.split(jax.random.key(m * 31 + n * 7 + k))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(dtype)
    return a, b


def run(
    shapes, dtypes, methods=METHODS, device_seconds: float = 0.02, unroll: int = DEFAULT_UNROLL
) -> list[Row]:
    """Times jax_sm100.matmul and jnp.dot on every shape and dtype by each of `methods`."""
    rows = []
    total = len(shapes) * len(dtypes)
    ours_fn = lambda x, y: jax_sm100.matmul(x, y)
    dot_fn = lambda x, y: jnp.dot(x, y)
    ours, dot = jax.jit(ours_fn), jax.jit(dot_fn)
    for dtype in dtypes:
        for m, n, k in shapes:
            _progress(len(rows), total, f"{dtype} {m}x{n}x{k}")
            a, b = _operands(m, n, k, dtype)
            ours(a, b).block_until_ready()
            how = dispatch.last_lowering()
            kernel = how.plan.kernel if how is not None and how.plan is not None else "xla"
            row = Row(dtype, (m, n, k), kernel)
            if "wall" in methods:
                reps = 30 if m * n * k >= 2**33 else 200
                row.wall = (time_per_call(ours, a, b, reps=reps),
                            time_per_call(dot, a, b, reps=reps))  # fmt: skip
            if "device" in methods:
                timings = time_device(
                    (ours_fn, dot_fn), a, b, min_seconds=device_seconds, unroll=unroll
                )
                row.device = (timings[0], timings[1])
            rows.append(row)
    _progress(total, total, "done")
    print(file=sys.stderr)
    return rows


def cold_compile_times(shapes, dtypes) -> list[tuple[str, float]]:
    """Seconds of `compile_plan` for each distinct binary, bypassing both caches."""
    from jax_sm100._src import planning  # noqa: PLC0415

    target = dispatch.device_target() or dispatch.Target("sm_90a")
    seen, out = set(), []
    for dtype in dtypes:
        for m, n, k in shapes:
            problem = planning.make_problem(m, n, k, a_dtype=dtype, b_dtype=dtype)
            p = dispatch.plan_call(problem, target).plan
            if p.kernel == planning.KERNEL_XLA:
                continue
            key = compile_mod.binary_key(p, KernelSpec.for_plan(p))
            if key in seen:
                continue
            seen.add(key)
            t = time.perf_counter()
            compile_mod._build(p, KernelSpec.for_plan(p))
            out.append((f"{dtype} {m}x{n}x{k} ({p.kernel} {p.cta_tile_mnk[:2]})",
                        time.perf_counter() - t))  # fmt: skip
    return out


def _tflops(flop: int, seconds: float) -> str:
    tf = flop / seconds / 1e12
    return f"{tf:.1f}" if tf >= 10 else f"{tf:.3g}"


def _geomean(values) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def report(rows: list[Row], methods=METHODS) -> None:
    """Prints the table, the geomeans, the 128^3 wall overhead and the device checks."""
    head = f"{'dtype':9s} {'m x n x k':18s}"
    sub = " " * len(head)
    for method in methods:
        head += f" | {method + ': ours':>10s} {'dot':>7s} {'ratio':>6s} {'ours':>8s} {'dot':>8s}"
        sub += f" | {'TF/s':>10s} {'TF/s':>7s} {'':6s} {'us':>8s} {'us':>8s}"
    if "device" in methods:
        head += f" {'R ours':>8s} {'R dot':>8s}"
        sub += " " * 18
    print(f"{head}  kernel\n{sub}")
    for r in rows:
        line = f"{r.dtype:9s} {'x'.join(map(str, r.shape)):18s}"
        for method in methods:
            ours_s, dot_s = r.seconds(method)
            flag = "!" if method == "device" and r.problems() else " "
            line += (f" | {_tflops(r.flop, ours_s):>10s} {_tflops(r.flop, dot_s):>7s} "
                     f"{r.ratio(method):5.3f}{flag} "
                     f"{ours_s * 1e6:8.2f} {dot_s * 1e6:8.2f}")  # fmt: skip
        if "device" in methods:
            line += f" {r.device[0].reps:8d} {r.device[1].reps:8d}"
        print(f"{line}  {r.kernel}")
    for method in methods:
        big = [r.ratio(method) for r in rows if r.shape[0] >= 4096]
        if big:
            print(f"geomean ratio ({method}) over shapes with m >= 4096: {_geomean(big):.3f}")
    if "wall" in methods:
        for r in rows:
            if r.shape == (128, 128, 128):
                print(f"per-call wall overhead vs jnp.dot at 128^3 ({r.dtype}): "
                      f"{(r.wall[0] - r.wall[1]) * 1e6:+.1f} us")  # fmt: skip
    for r in rows:
        for p in r.problems():
            print(f"! device-method check failed, {r.dtype} {'x'.join(map(str, r.shape))} {p}")


def plot(rows: list[Row], path: str) -> None:
    """TFLOP/s bars of both sides per dtype, ratio above each pair: device method if measured."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    method = "device" if all(r.device is not None for r in rows) else "wall"
    dtypes = sorted({r.dtype for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        sel = [r for r in rows if r.dtype == dtype]
        x = np.arange(len(sel))
        ours = [r.flop / r.seconds(method)[0] / 1e12 for r in sel]
        dot = [r.flop / r.seconds(method)[1] / 1e12 for r in sel]
        ax.bar(x - 0.2, ours, 0.4, label="jax_sm100.matmul")
        ax.bar(x + 0.2, dot, 0.4, label="jnp.dot")
        for xi, r, top in zip(x, sel, np.maximum(ours, dot), strict=True):
            flag = "!" if method == "device" and r.problems() else ""
            ax.annotate(f"{r.ratio(method):.2f}x{flag}", (xi, top), ha="center", va="bottom")
        ax.set_ylim(top=1.2 * max(max(ours), max(dot)))
        ax.set_xticks(x, ["x".join(map(str, r.shape)) for r in sel], rotation=30, ha="right")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{dtype} on {jax.devices()[0].device_kind}, {method} method "
                     "(labels: ours / jnp.dot throughput)")  # fmt: skip
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def parse_shapes(ap, text: str, form: str, flag: str = "--shapes") -> list[tuple[int, ...]]:
    """`text` ("AxBxC,...") as tuples of positive ints of `form` ("MxNxK", or "G:MxKxN" with a
    leading field before a colon), or `ap.error` naming the flag (a mistyped shape was a
    traceback)."""
    lead = ":" in form
    dims = form.count("x") + 1 + lead
    shapes = []
    for spec in text.split(","):
        try:
            fields = spec.split(":", 1) if lead else [spec]
            if len(fields) != 1 + lead:
                raise ValueError
            shape = tuple(int(v) for f in fields for v in f.split("x"))
        except ValueError:
            shape = ()
        if len(shape) != dims or min(shape) < 1:
            ap.error(f"{flag}: {spec!r} is not {form} of positive ints")
        shapes.append(shape)
    return shapes


def parse_dtype(ap, name: str, flag: str):
    """`name` as a jnp dtype, or `ap.error` naming the flag."""
    try:
        return jnp.dtype(name)
    except TypeError:
        ap.error(f"{flag}: {name!r} is not a dtype (e.g. bfloat16)")


def say_if_no_kernels() -> None:
    """A line saying so where this process has no GPU the kernels run on: every side then
    runs XLA's ops, and the ratios below compare XLA with XLA."""
    if dispatch.device_target() is None:
        print("(no sm_90a or sm_100a GPU here: every side runs XLA's ops, so the ratios "
              "below compare XLA with XLA and say nothing of the kernels)")  # fmt: skip


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--train" in argv:
        from jax_sm100 import bench_train  # noqa: PLC0415

        return bench_train.main([a for a in argv if a != "--train"])
    if "--ragged" in argv:
        from jax_sm100 import bench_ragged  # noqa: PLC0415

        return bench_ragged.main([a for a in argv if a != "--ragged"])
    if "--scaled" in argv:
        from jax_sm100 import bench_scaled  # noqa: PLC0415

        return bench_scaled.main([a for a in argv if a != "--scaled"])
    if "--quantize" in argv:
        from jax_sm100 import bench_quantize  # noqa: PLC0415

        return bench_quantize.main([a for a in argv if a != "--quantize"])
    ap = argparse.ArgumentParser(
        prog="python -m jax_sm100.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--method", choices=(*METHODS, "both"), default="both")
    ap.add_argument("--device-ms", type=float, default=20.0,
                    help="device method: grow R until one call takes this long")  # fmt: skip
    ap.add_argument("--unroll", type=int, default=DEFAULT_UNROLL,
                    help="device method: products per loop iteration")  # fmt: skip
    ap.add_argument("--plot", default=os.path.join("benchmarks", "out", "bench.png"))
    ap.add_argument("--no-compile-times", action="store_true")
    args = ap.parse_args(argv)
    if args.unroll < 1:
        ap.error(f"--unroll must be >= 1, got {args.unroll}")
    dtypes = args.dtypes.split(",")
    for dtype in dtypes:
        parse_dtype(ap, dtype, "--dtypes")
    shapes = parse_shapes(ap, args.shapes, "MxNxK")
    methods = METHODS if args.method == "both" else (args.method,)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
          f"target {dispatch.device_target()}, methods {'+'.join(methods)}, "
          f"device-method unroll {args.unroll}")  # fmt: skip
    say_if_no_kernels()
    rows = run(shapes, dtypes, methods, device_seconds=args.device_ms / 1e3, unroll=args.unroll)
    report(rows, methods)
    if "device" in methods:
        for dtype in dtypes:
            a, b = _operands(128, 128, 128, dtype)
            t = _loop_overhead(a, b, args.device_ms / 1e3, unroll=args.unroll)
            print(f"device-method loop overhead per product ({dtype}, no product, "
                  f"unroll {args.unroll}): {t.seconds * 1e6:.3f} us, inside both sides' device "
                  "times")  # fmt: skip
            for p in t.check.loop_problems():
                print(f"! device-method loop overhead ({dtype}) not measured as timed: {p}")
    if not args.no_compile_times:
        for label, secs in cold_compile_times(shapes, dtypes):
            print(f"cold compile {secs:5.2f} s  {label}")
    plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
