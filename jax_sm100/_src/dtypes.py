"""The dtypes the primitive accepts, and its default output dtype."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_sm100._src.constraints import DTYPE_BITS, FP8_DTYPES, SCALED_DATA_BITS

SUPPORTED = tuple(DTYPE_BITS)


def name(dtype) -> str:
    """The canonical name of a dtype (`np.dtype(x).name`), accepting jnp scalar types."""
    try:
        return np.dtype(dtype).name
    except TypeError as e:
        raise TypeError(f"{dtype!r} is not a dtype; use one of {SUPPORTED}") from e


def _unsupported(dtype, n: str) -> str:
    kind = np.dtype(dtype).kind
    what = {"i": "integer", "u": "unsigned integer", "c": "complex", "b": "boolean"}.get(
        kind, "unsupported"
    )
    return f"{what} dtype {n}"


def _block_scaled_only(n: str) -> bool:
    """Data dtypes that run only block-scaled (`scaled_matmul`): nvfp4's float4_e2m1fn."""
    return n in SCALED_DATA_BITS and n not in DTYPE_BITS


_SCALED_MATMUL_FIX = ": use jax_sm100.scaled_matmul with its scales (jax_sm100.quantize makes both)"


def operand_dtype_name(
    dtype, operand: str, caller: str = "jax_sm100.matmul", block_scaled_fix=_SCALED_MATMUL_FIX
) -> str:
    """Validates an operand array's dtype, returning its name; TypeError (naming `caller`)
    says what is accepted and how to cast the array, or for data that runs only block-scaled,
    `block_scaled_fix` (the rest of the sentence after "which runs only block-scaled")."""
    n = name(dtype)
    if n not in DTYPE_BITS:
        if _block_scaled_only(n):
            raise TypeError(
                f"{caller}: {operand} has dtype {n}, which runs only block-scaled{block_scaled_fix}"
            )
        raise TypeError(
            f"{caller}: {operand} has {_unsupported(dtype, n)}; it takes floating "
            f"operands of {SUPPORTED}. Cast it first, e.g. {operand}.astype(jnp.bfloat16)."
        )
    return n


def dtype_argument_name(
    dtype, argument: str, caller: str, example: str | None = None, block_scaled_fix: str = ""
) -> str:
    """Validates a dtype given as an argument (`out_dtype=`, `preferred_element_type=`,
    `plan`'s `a_dtype=`), returning its name; TypeError (naming `caller`) says what to pass,
    with `example` (default `argument=jnp.bfloat16`), or `block_scaled_fix` for data that runs
    only block-scaled where the caller can plan that."""
    if dtype is None:  # np.dtype(None) is float64: never what a caller meant
        raise TypeError(
            f"{caller}: {argument} is None; pass a dtype of {SUPPORTED}, e.g. "
            f"{example or argument + '=jnp.bfloat16'}"
        )
    n = name(dtype)
    if n not in DTYPE_BITS:
        if _block_scaled_only(n) and block_scaled_fix:
            raise TypeError(f"{caller}: {argument}={n} runs only block-scaled: {block_scaled_fix}")
        raise TypeError(
            f"{caller}: {argument} is the {_unsupported(dtype, n)}; it takes "
            f"{SUPPORTED}: pass one of them, e.g. {example or argument + '=jnp.bfloat16'}"
        )
    return n


def requested(dtype, argument: str, caller: str, stacklevel: int = 3) -> np.dtype:
    """A result dtype a caller asks for (`argument` of `caller`), as jnp takes it: a 64-bit one
    without `jax_enable_x64` is truncated to 32 bits with jnp's UserWarning; a dtype outside
    `SUPPORTED` raises TypeError (`dtype_argument_name`), before any truncation (those the
    kernels do not write run on XLA, the plan's reason says so).
    `stacklevel` is the warning's, counted from here (3: the caller's caller)."""
    want = np.dtype(dtype_argument_name(dtype, argument, caller))
    got = np.dtype(jax.dtypes.canonicalize_dtype(want))
    if got != want:
        warnings.warn(
            f"Explicitly requested dtype {want} requested in {caller.split('.')[-1]} is not "
            f"available, and will be truncated to dtype {got}. To enable more dtypes, set the "
            "jax_enable_x64 configuration option or the JAX_ENABLE_X64 shell environment "
            "variable. See https://github.com/jax-ml/jax#current-gotchas for more.",
            UserWarning,
            stacklevel=stacklevel,
        )
    return got


def default_out_dtype(a: str, b: str) -> str:
    """The operands' result type; bfloat16 when both are fp8 (fp8 outputs lose too much)."""
    if a in FP8_DTYPES and b in FP8_DTYPES:
        return "bfloat16"
    if a in FP8_DTYPES:
        return b
    if b in FP8_DTYPES:
        return a
    return name(jnp.promote_types(a, b))


def widen_fp8_pair(a, b):
    """An fp8 operand beside a 16-bit floating one (fp8 weights with bfloat16 activations)
    converted to the other's dtype, and two different fp8 formats both to bfloat16, which
    hold every fp8 value exactly: the kernels take one operand dtype. Other pairs as given."""
    a_name, b_name = np.dtype(a.dtype).name, np.dtype(b.dtype).name
    sixteen = ("bfloat16", "float16")
    if a_name in FP8_DTYPES and b_name in sixteen:
        a = a.astype(b.dtype)
    elif b_name in FP8_DTYPES and a_name in sixteen:
        b = b.astype(a.dtype)
    elif a_name in FP8_DTYPES and b_name in FP8_DTYPES and a_name != b_name:
        # e4m3 beside e5m2 (an fp8 gradient against fp8 weights): both as bfloat16.
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return a, b
