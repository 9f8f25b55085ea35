"""jax_sm100: JAX primitives running CuTe DSL GEMM kernels on SM100 (tcgen05) and SM90 (wgmma).

>>> import jax_sm100
>>> y = jax_sm100.matmul(x, w, bias=b, activation="gelu")
>>> print(jax_sm100.plan(8192, 8192, 8192, a_dtype="bfloat16", b_dtype="bfloat16"))
"""

from jax_sm100 import checkpoint_policies, tuning
from jax_sm100._src.api import matmul, plan_for
from jax_sm100._src.compile import compile_plan
from jax_sm100._src.constraints import PlanError
from jax_sm100._src.dispatch import Lowered, last_lowering, lowerings
from jax_sm100._src.dot_general import dot_general, einsum
from jax_sm100._src.ffi import export_safety_checks as export_disabled_checks
from jax_sm100._src.kernels.spec import KernelSpec
from jax_sm100._src.planning import GemmPlan, GemmProblem, plan
from jax_sm100._src.precompile import precompile
from jax_sm100._src.quantize_both import quantize_both
from jax_sm100._src.ragged import ragged_dot
from jax_sm100._src.scaled import quantize, scaled_matmul
from jax_sm100._src.scaled_dot import DEEPSEEK_V3, scaled_dot_general

__all__ = [
    "DEEPSEEK_V3",
    "GemmPlan",
    "GemmProblem",
    "KernelSpec",
    "Lowered",
    "PlanError",
    "checkpoint_policies",
    "compile_plan",
    "dot_general",
    "einsum",
    "export_disabled_checks",
    "last_lowering",
    "lowerings",
    "matmul",
    "plan",
    "plan_for",
    "precompile",
    "quantize",
    "quantize_both",
    "ragged_dot",
    "scaled_dot_general",
    "scaled_matmul",
    "tuning",
]
__version__ = "0.1.0"

# Register the FFI target with a CUDA-enabled JAX at import, so that a process which only runs a
# deserialized jax.export artifact or a persistent-cache hit finds the handler. A no-op elsewhere.
from jax_sm100._src import ffi as _ffi  # noqa: E402

_ffi.register_if_cuda()
