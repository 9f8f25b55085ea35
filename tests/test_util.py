"""Shared helpers for the tests: random operands, a float64 reference, per-dtype tolerances."""

from __future__ import annotations

import math
import os
from pathlib import Path
from unittest import mock

import jax.numpy as jnp
import ml_dtypes
import numpy as np

DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")

# Relative tolerance of a result, by output dtype: a few ulps of the output format (the float32
# accumulation error of the CPU path is far below these).
RTOL = {
    "bfloat16": 1.6e-2,
    "float16": 2e-3,
    "float32": 2e-5,
    "float64": 1e-12,
    "float8_e4m3fn": 1.3e-1,
    "float8_e5m2": 2.6e-1,
}


def rand(rng: np.random.Generator, shape, dtype) -> jnp.ndarray:
    """Normal random data, rounded to `dtype` (never zeros or ones alone)."""
    scale = 1.0 if "float8" not in str(dtype) else 2.0
    x = rng.standard_normal(shape).astype(np.float32) * scale
    return jnp.asarray(x.astype(np.dtype(dtype)))


def activation64(z, activation):
    if activation is None:
        return z
    if activation == "relu":
        return np.maximum(z, 0)
    if activation == "gelu":
        return 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    if activation == "silu":
        return z / (1 + np.exp(-z))
    raise ValueError(activation)


def reference(a, b, *, bias=None, c=None, alpha=1.0, beta=1.0, activation=None):
    """activation(alpha * a @ b + beta * c + bias) in float64 NumPy, with matmul broadcasting."""
    f64 = lambda x: None if x is None else np.asarray(x).astype(np.float64)  # noqa: E731
    z = alpha * np.matmul(f64(a), f64(b))
    if c is not None:
        z = z + beta * f64(c)
    if bias is not None:
        z = z + f64(bias)
    return activation64(z, activation)


def assert_close(test, got, want, out_dtype, k=1):
    """|got - want| <= rtol(out_dtype) * max|want|, elementwise, scaled for long sums."""
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want, np.float64)
    test.assertEqual(got.shape, want.shape)
    scale = max(np.max(np.abs(want)) if want.size else 0.0, 1e-6)
    tol = RTOL[np.dtype(out_dtype).name] * scale * (1 + math.log2(max(k, 1)) / 8)
    err = np.max(np.abs(got - want)) if want.size else 0.0
    test.assertLessEqual(err, tol, f"max abs error {err:.3g} > {tol:.3g} ({out_dtype})")


assert ml_dtypes  # fp8 dtypes are registered with numpy by importing ml_dtypes


REPO_ROOT = Path(__file__).resolve().parents[1]


def subprocess_env(**overrides) -> dict[str, str]:
    """This process's environment with the repository on PYTHONPATH, plus `overrides`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.update(overrides)
    return env


def grouped_cluster(cluster: str):
    """A patch under which the grouped planners plan `cluster`: "1x1" or "2x1" (their weight for
    a multicast pair made tiny or huge), or "" (unchanged). Plans are cached: clear
    `planning._plan_cached` around its use."""
    from jax_sm100._src.planning import sm90  # noqa: PLC0415

    gain = {"": sm90.GROUPED_MULTICAST_GAIN, "1x1": 1e-6, "2x1": 1e6}[cluster]
    return mock.patch.object(sm90, "GROUPED_MULTICAST_GAIN", gain)
