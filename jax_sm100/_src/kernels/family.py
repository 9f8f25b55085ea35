"""The contract every kernel family keeps, and the registry compile.py looks families up in.

A kernel family is one class in one module under kernels/: a CuTe DSL kernel that compiles a
(GemmPlan, KernelSpec) for one arch. It subclasses `KernelFamily` and states:

- `HOST_OPERANDS`: the names of its host entry point's tensor arguments, in order (the CUDA
  stream follows them). The lowering builds the handler's argument list by these names
  (spec.py gives each tensor's modes);
- `why_not(plan, spec)`: None when it can compile the pair, else the reason (the constructor
  raises ValueError with it);
- `compile_inputs(plan, spec)`: the plan and spec the binary is built from (a family may
  re-derive them, e.g. the float32 partial product of a split-K plan) and the fake operands
  `cute.compile` takes, one per `HOST_OPERANDS` name (None for an absent one).

`FAMILIES` maps each `GemmPlan.kernel` name to the "module:Class" under kernels/ that compiles
it, and imports the module only when asked (`family`), so planning and the lowering never
import the DSL: a new family is one module and one line here.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, ClassVar

from jax_sm100._src import constraints as C
from jax_sm100._src.kernels.spec import KernelSpec

# GemmPlan.kernel (or QuantizePlan.kernel) -> the family that compiles it.
FAMILIES = {
    C.KERNEL_SM90: "sm90_gemm:Sm90GemmKernel",
    C.KERNEL_SM90_SPLITK: "sm90_gemm:Sm90GemmKernel",
    C.KERNEL_SM90_SCALED: "sm90_scaled:Sm90ScaledGemmKernel",
    C.KERNEL_SM90_GROUPED: "sm90_grouped:Sm90GroupedGemmKernel",
    C.KERNEL_SM100: "sm100_gemm:Sm100GemmKernel",
    C.KERNEL_SM100_BLOCKSCALED: "sm100_blockscaled:Sm100BlockScaledGemmKernel",
    C.KERNEL_SM100_GROUPED: "sm100_grouped:Sm100GroupedGemmKernel",
    C.KERNEL_QUANTIZE_BOTH: "quantize:QuantizeBothKernel",
}


def family(kernel: str) -> type[KernelFamily]:
    """The family class that compiles plans whose `kernel` is `kernel`.

    Raises:
      ValueError: no family compiles it (e.g. "xla_dot", which runs on XLA's dot).
    """
    where = FAMILIES.get(kernel)
    if where is None:
        raise ValueError(f"kernel={kernel!r} has no kernel family (families: {tuple(FAMILIES)})")
    module, name = where.split(":")
    return getattr(importlib.import_module(f"jax_sm100._src.kernels.{module}"), name)


@dataclasses.dataclass(frozen=True)
class CompileInputs:
    """What one `cute.compile` of a family takes: the plan and spec its binary is built from,
    and one fake operand (or None) per `HOST_OPERANDS` name."""

    plan: Any
    spec: KernelSpec
    operands: tuple


class KernelFamily:
    """Base of the kernel families (see the module docstring)."""

    HOST_OPERANDS: ClassVar[tuple[str, ...]] = ("a", "b", "d", "c", "bias", "z")

    def __init__(self, plan: Any, spec: KernelSpec):
        why = self.why_not(plan, spec)
        if why is not None:
            raise ValueError(f"{type(self).__name__} cannot run this plan: {why}")
        self.plan = plan
        self.spec = spec

    @classmethod
    def why_not(cls, plan: Any, spec: KernelSpec) -> str | None:
        raise NotImplementedError

    @classmethod
    def can_implement(cls, plan: Any, spec: KernelSpec) -> bool:
        return cls.why_not(plan, spec) is None

    @classmethod
    def compile_inputs(cls, plan: Any, spec: KernelSpec) -> CompileInputs:
        """The plan and spec as given, and `common.make_fake_operands`' tensors."""
        from jax_sm100._src.kernels import common  # noqa: PLC0415

        operands = tuple(common.make_fake_operands(plan, spec))
        return CompileInputs(plan, spec, operands + (None,) * (len(cls.HOST_OPERANDS) - 6))
