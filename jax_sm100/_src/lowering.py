"""Per-platform lowerings of the matmul primitive.

CPU lowers to XLA's dot plus the float32 epilogue (`primitive.reference_matmul`). CUDA lowers to
our CuTe DSL kernels through the FFI (gpu_lowering.py) when the device's plan selects one, and to
XLA's dot otherwise, the plan saying why. Both go through `sharding.partition`, so a sharded
call is split into local products the same way on every platform.
"""

from __future__ import annotations

import functools

from jax.interpreters import mlir

from jax_sm100._src import (
    autodiff,  # noqa: F401  (registers the differentiation rules)
    sharding,
)
from jax_sm100._src import primitive as P


def _local_cpu(a, b, bias, c, **params):
    params.pop("plan")
    params.pop("has_bias")
    params.pop("has_c")
    return P.reference_matmul(a, b, bias, c, upcast=True, **params)


def _local_cuda(a, b, bias, c, **params):
    from jax_sm100._src import gpu_lowering  # noqa: PLC0415

    return gpu_lowering.cuda_matmul_impl(a, b, bias, c, **params)


def _lowering(local_fn, ctx, *args, **params):
    has_bias, has_c = params["has_bias"], params["has_c"]

    def fn(*args):
        a, b, bias, c = P._split(args, has_bias, has_c)
        return local_fn(a, b, bias, c, **params)

    partitioned = sharding.partition(fn, ctx, **params)
    if partitioned is fn:
        return mlir.lower_fun(fn, multiple_results=True)(sharding.unsharded_context(ctx), *args)
    return sharding.lower_partitioned(partitioned, ctx, *args, multiple_results=True)


mlir.register_lowering(P.matmul_p, functools.partial(_lowering, _local_cpu), platform="cpu")
mlir.register_lowering(P.matmul_p, functools.partial(_lowering, _local_cuda), platform="cuda")
