"""Builds the FFI handler ahead of time (BUILD.md, "Prebuilding").

    python -m jax_sm100.build_ffi      # prints the path of the built library

Ship that file and point `JAX_SM100_FFI_LIB` at it where the target machine has no compiler.
"""

from jax_sm100._src.ffi import build

__all__ = ["build"]

if __name__ == "__main__":
    print(build(lasting=True))  # a path that outlives this process
