"""The dtypes the primitive accepts, and its default output dtype."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_sm100._src.constraints import DTYPE_BITS, FP8_DTYPES

SUPPORTED = tuple(DTYPE_BITS)


def name(dtype) -> str:
    """The canonical name of a dtype (`np.dtype(x).name`), accepting jnp scalar types."""
    try:
        return np.dtype(dtype).name
    except TypeError as e:
        raise TypeError(f"{dtype!r} is not a dtype; use one of {SUPPORTED}") from e


def operand_dtype_name(dtype, operand: str, caller: str = "jax_sm100.matmul") -> str:
    """Validates an operand dtype, returning its name; TypeError (naming `caller`) says what is
    accepted."""
    n = name(dtype)
    if n not in DTYPE_BITS:
        kind = np.dtype(dtype).kind
        what = {"i": "integer", "u": "unsigned integer", "c": "complex", "b": "boolean"}.get(
            kind, "unsupported"
        )
        raise TypeError(
            f"{caller}: {operand} has {what} dtype {n}; the kernels take floating "
            f"operands of {SUPPORTED}. Cast it first, e.g. {operand}.astype(jnp.bfloat16)."
        )
    return n


def default_out_dtype(a: str, b: str) -> str:
    """The operands' result type; bfloat16 when both are fp8 (fp8 outputs lose too much)."""
    if a in FP8_DTYPES and b in FP8_DTYPES:
        return "bfloat16"
    if a in FP8_DTYPES:
        return b
    if b in FP8_DTYPES:
        return a
    return name(jnp.promote_types(a, b))
