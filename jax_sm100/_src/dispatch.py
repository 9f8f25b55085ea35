"""From a call to the plan that runs: the one place that decides it.

    plan_call(problem, target, plan=None) -> Decision(plan, notes)

`problem` is the GEMM the kernels run (`planning.GemmProblem`: the batch already folded where
the lowering folds it, `primitive.problem_for_operands`); `target` is the arch and SM count to
run on (`Target`; `device_target()` for this process's GPU). The result is the plan the kernel
is compiled for: the planner's for that target (or the caller's, checked against the problem
and the target), the driver's cluster occupancy put in on a present SM100 device, and the
split-K factor fitted to k. The CUDA lowerings (matmul's, ragged_dot's and scaled_matmul's),
`jax_sm100.plan_for`, `jax_sm100.precompile` and the benchmark call it; nothing else plans a
call.

Lowerings record what they chose (`record`); `last_lowering()` and the `lowerings()` context
manager read those records back (bounded: the last `HISTORY` only).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_sm100._src import constraints, planning
from jax_sm100._src import dtypes as D


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a plan runs: `arch` ("sm_90a" or "sm_100a") and the device's SM count (0: the
    arch's usual part, `planning.DEFAULT_NUM_SMS`). `on_device` is True for this process's
    own GPU, whose driver can be asked how clusters fit it; `resident_clusters` is that answer
    given for another machine's GPU ((cluster size, clusters resident) pairs, `precompile`)."""

    arch: str
    num_sms: int = 0
    on_device: bool = False
    resident_clusters: tuple[tuple[int, int], ...] = ()

    def clusters_resident(self, cluster_size: int) -> int | None:
        """How many clusters of `cluster_size` CTAs the device keeps resident, where known."""
        if self.on_device:
            return driver_max_clusters(cluster_size)
        return dict(self.resident_clusters).get(cluster_size)

    def __post_init__(self):
        constraints.check_arch(self.arch)


@functools.cache
def device_target() -> Target | None:
    """The first CUDA device's target (sm_90a for compute capability 9.0, sm_100a for 10.0), or
    None when there is no device the kernels run on. Arch-specific ("a") code runs only on its
    own compute capability, so other 9.x and 10.x parts (10.3, say) are not taken for these."""
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return None
    target = _target_of(dev)
    if target is None:
        warnings.warn(
            f"jax_sm100: this GPU ({getattr(dev, 'device_kind', '?')}, compute capability "
            f"{getattr(dev, 'compute_capability', '?')}) runs none of the kernels (built for "
            "9.0, sm_90a, and 10.0, sm_100a): products run on XLA's ops. A plan= or "
            "JAX_SM100_TARGET_ARCH would embed kernels this GPU cannot load.",
            stacklevel=2,
        )
    return target


def _target_of(dev) -> Target | None:
    """`dev`'s target from its compute capability ("9.0", as JAX gives it), or None."""
    cc = str(getattr(dev, "compute_capability", "") or "")
    try:
        major, minor = (int(x) for x in cc.split(".")[:2])
    except ValueError:
        return None
    arch = ARCH_OF_CAPABILITY.get((major, minor))
    if arch is None:
        return None
    return Target(arch, int(getattr(dev, "core_count", 0) or 0), on_device=True)


# The compute capabilities whose arch-specific code the kernels are: H100/H200, B200/GB200.
ARCH_OF_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a"}


def lowering_target(plan: planning.GemmPlan | None = None) -> Target | None:
    """The target a CUDA lowering compiles for: the local device; without one, a caller's plan's
    arch (cross-lowering, e.g. `jax.export(platforms=["cuda"])` on a CPU machine), else
    `JAX_SM100_TARGET_ARCH`; None when there is none (the call runs on XLA's dot)."""
    target = device_target()
    if target is not None:
        return target
    if plan is not None:
        return Target(plan.arch, plan.num_sms)
    arch = os.environ.get("JAX_SM100_TARGET_ARCH")
    if not arch:
        return None
    try:
        return Target(arch)
    except constraints.PlanError as e:
        raise constraints.PlanError(
            f"JAX_SM100_TARGET_ARCH={arch!r} in the environment: {e}"
        ) from e


@functools.cache
def driver_max_clusters(cluster_size: int) -> int | None:
    """How many clusters of `cluster_size` CTAs (each with all of an SM's shared memory) the
    driver can keep resident on the first device (`cutlass.utils.HardwareInfo`), or None where
    the query fails."""
    try:
        from cutlass.utils import HardwareInfo  # noqa: PLC0415

        return int(HardwareInfo().get_max_active_clusters(cluster_size))
    except Exception:  # noqa: BLE001  (no driver, no context: fall back to the plan's count)
        return None


@dataclasses.dataclass(frozen=True)
class Decision:
    """The plan a call compiles, and notes on how it was arrived at (for `Lowered.note`)."""

    plan: planning.GemmPlan
    notes: tuple[str, ...] = ()


def plan_call(
    problem: planning.GemmProblem,
    target: Target,
    plan: planning.GemmPlan | None = None,
) -> Decision:
    """The plan that runs `problem` on `target` (see the module docstring).

    Args:
      problem: the GEMM the kernels run.
      target: where it runs.
      plan: a caller's plan (`matmul(plan=...)`), or None for the planner's.

    Raises:
      PlanError: a caller's plan made for another arch, dtypes or layouts.
    """
    notes = []
    if plan is None:
        p = planning.plan(
            **dataclasses.asdict(problem), arch=target.arch, num_sms=target.num_sms or None
        )
    else:
        # The caller's plan was checked against the call's own problem by `matmul`; `vmap` or
        # sharding may since have changed its sizes, and the plan's choices follow them.
        planning.check_plan_fits(plan, problem, target.arch, sizes=False)
        p = plan
        resized = dataclasses.replace(problem, preact_out=plan.preact_out)
        if plan.problem != resized:
            try:
                p = plan.for_problem(resized)
                notes.append(f"the plan given resized to {resized.batch} x {resized.m}x"
                             f"{resized.n}x{resized.k}")  # fmt: skip
            except constraints.PlanError as e:
                p = planning.plan(
                    **dataclasses.asdict(problem), arch=target.arch,
                    num_sms=target.num_sms or None,
                )  # fmt: skip
                notes.append(f"the plan given does not fit this call's problem ({e}): the "
                             "planner's")  # fmt: skip
        p = planning.with_preact(p) if problem.preact_out else p
        if target.num_sms and p.num_sms != target.num_sms:
            p = dataclasses.replace(p, num_sms=target.num_sms)
    sm100 = (
        planning.KERNEL_SM100,
        planning.KERNEL_SM100_BLOCKSCALED,
        planning.KERNEL_SM100_GROUPED,
    )
    if p.kernel in sm100 and not p.max_clusters:
        # The device's occupancy query (this process's device, or its answer given for
        # another's) knows how clusters fit its GPCs; the grid is compiled into the binary.
        size = p.cluster_shape_mn[0] * p.cluster_shape_mn[1]
        fit = target.clusters_resident(size)
        if fit and fit < planning.resident_clusters(p):
            p = dataclasses.replace(p, max_clusters=fit)
            notes.append(f"grid: {fit} clusters of {size} (the driver's occupancy)")
    p, split_notes = _fit_split(p, planned=plan is None)
    return Decision(p, tuple(notes) + split_notes)


def _fit_split(plan: planning.GemmPlan, planned: bool) -> tuple[planning.GemmPlan, tuple]:
    """`plan` with its split-K factor made to fit the call.

    The planner picks a split factor from tile counts alone. A call runs split-K only on one
    GEMM (the kernel's batch mode holds the splits) and only with K/split whole and 16-byte
    aligned, so the factor drops to the largest usable one (`_usable_split`), and to the unsplit
    SM90 kernel when none is. `planned`: the plan is the planner's own (not the caller's), so an
    unsplit fallback small enough for the planner's XLA rule (`planning.SM90_MIN_FLOPS`) goes
    to XLA's dot, as the planner would have sent it there unsplit (unless
    `JAX_SM100_SMALL_PROBLEMS=kernel` puts small problems on the kernels).
    """
    if plan.split_k == 1:
        return plan, ()
    split = _usable_split(plan) if plan.batch == 1 else 1
    if split == 1:
        small = None
        if planned and not planning.small_problems_on_kernels():
            small = planning.sm90_too_small(plan.m, plan.n, plan.k, plan.batch, 1)
        if small is not None:
            plan = dataclasses.replace(plan, kernel=planning.KERNEL_XLA, split_k=1, reason=small)
            return plan, ("split-K not applicable (k not divisible) and too small unsplit",)
        note = ("split-K not applicable (k not divisible): unsplit kernel",)
        reason = _split_reason(plan, 1)
        if plan.split_reduce == "cluster":
            return dataclasses.replace(planning.with_split(plan, 1), reason=reason), note
        # An XLA-reduced plan keeps its stages, schedule and cluster (the binary verified).
        unsplit = dataclasses.replace(plan, kernel=planning.KERNEL_SM90, split_k=1, reason=reason)
        return unsplit, note
    if split != plan.split_k:
        reason = _split_reason(plan, split)
        if plan.split_reduce == "cluster":
            # Its (1, split) cluster.
            return dataclasses.replace(planning.with_split(plan, split), reason=reason), ()
        return dataclasses.replace(plan, split_k=split, reason=reason), ()
    return plan, ()


def _split_reason(plan: planning.GemmPlan, split: int) -> str:
    """The reason of `plan` refitted to `split` (`_fit_split`): what the plan now runs, and why
    the planner's factor does not."""
    tm, tn, _ = plan.mma_tiler_mnk
    if plan.batch > 1:
        why = f"the planner's split-K x{plan.split_k} runs on one GEMM, not a batch of {plan.batch}"
    else:
        why = (
            f"the planner's split-K x{plan.split_k} needs K/{plan.split_k} whole and a "
            f"multiple of {constraints.tma_quantum(plan.a_dtype)} (k={plan.k})"
        )
    if split == 1:
        return f"wgmma {tm}x{tn} tile, unsplit: {why}"
    return f"split-K x{split}, the largest factor that fits: {why}"


def _usable_split(p: planning.GemmPlan) -> int:
    """The largest split <= plan.split_k with K/split whole and 16-byte aligned."""
    s = p.split_k
    align = constraints.tma_quantum(p.a_dtype)
    while s > 1 and (p.k % s or (p.k // s) % align):
        s //= 2
    return s


# ---------------------------------------------------------------- what lowerings chose


def is_fp8(dtype) -> bool:
    return np.dtype(dtype).name in constraints.FP8_DTYPES


@dataclasses.dataclass(frozen=True)
class KernelForm:
    """A product as the kernels run it: `kernel_form`'s result."""

    a: object
    b: object
    c: object
    transpose_a: bool
    transpose_b: bool
    out_dtype: np.dtype
    notes: tuple[str, ...]


def kernel_form(a, b, c, *, transpose_a, transpose_b, out_dtype, arch) -> KernelForm:
    """The operands, layouts and result dtype the kernels run one bind of the primitive as on
    `arch`, with the same result once the kernel's is rounded to `out_dtype`; `notes` say what
    changed (none: the call as given). With fp8 (e4m3, e5m2) in it:

    - an fp8 operand beside a 16-bit one is widened to its dtype, and two fp8 formats both to
      bfloat16 (the kernels take one operand dtype; fp8 values are exact in either). Beside
      float32 or float64 it is not: XLA's dot runs that pair exactly, where sm_100a's kernel
      would round float32 to tf32;
    - an fp8 C is widened to bfloat16 (the epilogue adds it in float32 either way);
    - an fp8 result is the kernel's float32 result rounded once by XLA (the kernels write 16-
      and 32-bit results; a saved pre-activation then bfloat16, as `preact_dtype` has it);
    - on sm_90a, whose fp8 wgmma reads K-major operands only, an fp8 A that is M-major or B
      that is N-major is transposed by XLA (a copy, or none where the operand is itself a
      transpose: XLA folds the two).
    """
    notes = []
    given = [np.dtype(x.dtype).name for x in (a, b)]
    a, b = D.widen_fp8_pair(a, b)
    if np.dtype(a.dtype).name != given[0] or np.dtype(b.dtype).name != given[1]:
        notes.append(f"{given[0]} x {given[1]} operands widened to {np.dtype(a.dtype).name} "
                     "(exact)")  # fmt: skip
    if c is not None and is_fp8(c.dtype):
        notes.append(f"C {np.dtype(c.dtype).name} widened to bfloat16 (exact)")
        c = c.astype(jnp.bfloat16)
    out_dtype = np.dtype(out_dtype)
    if is_fp8(out_dtype):
        notes.append(f"the kernel's float32 result rounded to {out_dtype.name} by XLA")
        out_dtype = np.dtype(np.float32)
    if constraints.wgmma_k_major_only(arch, np.dtype(a.dtype).name):
        if transpose_a:
            notes.append("A transposed to K-major by XLA (sm_90a's fp8 wgmma reads K-major)")
            a, transpose_a = jnp.swapaxes(a, -1, -2), False
        if not transpose_b:
            notes.append("B transposed to K-major by XLA (sm_90a's fp8 wgmma reads K-major)")
            b, transpose_b = jnp.swapaxes(b, -1, -2), True
    return KernelForm(a, b, c, transpose_a, transpose_b, out_dtype, tuple(notes))


def kernel_form_of(a, b, c, **kw) -> KernelForm:
    """`kernel_form` of avals, arrays or `jax.ShapeDtypeStruct`s, traced abstractly: its
    operands as `jax.ShapeDtypeStruct`s (for planning the form of a call not being lowered)."""
    seen = {}

    def form(a, b, c):
        seen["form"] = kernel_form(a, b, c, **kw)
        return seen["form"].a, seen["form"].b, seen["form"].c

    a, b, c = jax.eval_shape(form, a, b, c)
    return dataclasses.replace(seen["form"], a=a, b=b, c=c)


def symbolic_dims(*arrays) -> bool:
    """Whether any of `arrays` (avals or arrays) has a symbolic dim (`jax.export`'s): the
    planner sizes tiles, stages and the grid from ints, so such products run on XLA's ops."""
    return any(jax.export.is_symbolic_dim(d) for x in arrays for d in x.shape)


@dataclasses.dataclass(frozen=True)
class Lowered:
    """How one product was lowered (a CUDA lowering of `matmul`, `ragged_dot` or
    `scaled_matmul`, or a call traced onto XLA's ops on any platform): its plan (None where no
    plan was made) and a note (the path, batch handling, split-K fitting, or why XLA's ops).
    The CUDA lowering of `quantize_both` is recorded too, with its `QuantizePlan` (whose
    kernel is "quantize_both", or "xla_dot" where XLA's quantizations ran) and a note that
    starts "quantize_both"."""

    plan: Any
    note: str


HISTORY = 64
_history: collections.deque[Lowered] = collections.deque(maxlen=HISTORY)
_listeners: list[list[Lowered]] = []
_listeners_lock = threading.Lock()  # blocks entered and left by several threads at once


def record(lowered: Lowered) -> None:
    _history.append(lowered)
    with _listeners_lock:
        listeners = tuple(_listeners)
    for listener in listeners:
        listener.append(lowered)


def last_lowering() -> Lowered | None:
    """The most recent record of this process (see `lowerings`), or None."""
    return _history[-1] if _history else None


@contextlib.contextmanager
def lowerings() -> Iterator[list[Lowered]]:
    """Collects, in order, a record of how each product inside the block runs: one per CUDA
    lowering of `matmul`, `ragged_dot` and `scaled_matmul` (their plan, or None, and a note of
    the path and why), and, on any platform, one when a call is traced onto XLA's ops instead
    of a primitive (`matmul` with a precision the kernels do not meet, or `dot_general`,
    `einsum` or `ragged_dot` running lax's own; plan None):

        with jax_sm100.lowerings() as seen:
            jax.jit(step).lower(params, batch)
        print([x.plan.kernel if x.plan else x.note for x in seen])

    Only lowerings count: a jitted function already compiled lowers nothing again.
    """
    seen: list[Lowered] = []
    with _listeners_lock:
        _listeners.append(seen)
    try:
        yield seen
    finally:
        # By identity: a nested block's list may equal this one (list.remove compares by ==).
        with _listeners_lock:
            _listeners[:] = [x for x in _listeners if x is not seen]
