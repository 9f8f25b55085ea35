"""The plan of one `quantize_both` call: its kernel (kernels/quantize.py) or XLA's ops, and why.

The kernel has no tiling to choose (one 128 x 128 tile a CTA, the recipe's block both ways), so
the plan is the problem, the target and the decision; it is keyed and compiled as GEMM plans
are (compile.py), its sizes runtime values of one binary per dtype pair and arch.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jax_sm100._src import constraints as C


@dataclasses.dataclass(frozen=True)
class QuantizePlan:
    """How one [batch, rows, cols] input is quantized along both dims.

    Attributes:
      rows, cols, batch: the problem (runtime values of the binary).
      in_dtype, data_dtype: the input's dtype and the fp8 data's, by numpy name.
      arch: the target, "sm_90a" or "sm_100a".
      kernel: `C.KERNEL_QUANTIZE_BOTH`, or `C.KERNEL_XLA` where the kernel does not take the
        problem (XLA's quantizations run, `reason` says why).
      reason: why this path.
      recipe: "fp8_block128" (a scale per 1 x 128 block of each orientation) or
        "fp8_block128x128" (one per 128 x 128 tile, for both).
    """

    rows: int
    cols: int
    batch: int
    in_dtype: str
    data_dtype: str
    arch: str
    kernel: str
    reason: str = ""
    recipe: str = C.QUANTIZE_ROW_RECIPE

    RUNTIME_FIELDS: ClassVar[tuple[str, ...]] = ("rows", "cols", "batch", "reason")
    # What the shared compile and launch paths read of a plan: one launch, no workspace.
    split_k: ClassVar[int] = 1
    stream_k: ClassVar[bool] = False

    def __post_init__(self):
        C.check_arch(self.arch)
        if self.recipe not in C.QUANTIZE_RECIPES:
            raise ValueError(f"{self.recipe=} must be one of {C.QUANTIZE_RECIPES}")
        if self.kernel not in (C.KERNEL_QUANTIZE_BOTH, C.KERNEL_XLA):
            raise ValueError(f"{self.kernel=} must be {C.KERNEL_QUANTIZE_BOTH!r} or "
                             f"{C.KERNEL_XLA!r}")  # fmt: skip
        why = C.quantize_both_support(self.rows, self.cols, self.batch, self.in_dtype,
                                      self.data_dtype)  # fmt: skip
        if self.kernel == C.KERNEL_QUANTIZE_BOTH and why is not None:
            raise ValueError(f"the quantize_both kernel cannot run this plan: {why}")

    def binary_fields(self) -> tuple[tuple[str, object], ...]:
        """(name, value) of every field the compiled binary depends on, for cache keys."""
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                     if f.name not in self.RUNTIME_FIELDS)  # fmt: skip

    # The KernelSpec fields of its tensors (`KernelSpec.for_plan`): x read as A, the data
    # written as D.
    @property
    def a_dtype(self) -> str:
        return self.in_dtype

    @property
    def b_dtype(self) -> str:
        return self.data_dtype

    @property
    def out_dtype(self) -> str:
        return self.data_dtype

    a_major: ClassVar[str] = "k"
    b_major: ClassVar[str] = "k"
    c_dtype: ClassVar[None] = None


def plan_quantize_both(rows: int, cols: int, batch: int, in_dtype: str, data_dtype: str,
                       arch: str, recipe: str = C.QUANTIZE_ROW_RECIPE) -> QuantizePlan:  # fmt: skip
    """The plan for quantizing [batch, rows, cols] of `in_dtype` to `data_dtype` by `recipe`
    on `arch`."""
    why = C.quantize_both_support(rows, cols, batch, in_dtype, data_dtype)
    kernel = C.KERNEL_QUANTIZE_BOTH if why is None else C.KERNEL_XLA
    reason = "one pass, both orientations" if why is None else f"XLA ops: {why}"
    return QuantizePlan(rows, cols, batch, in_dtype, data_dtype, arch, kernel, reason, recipe)
