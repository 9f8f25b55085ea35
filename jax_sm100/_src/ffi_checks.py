"""The FFI handler's contract with the lowering, in Python: layouts, their encoding, the checks.

The CUDA lowering describes every tensor argument of a kernel (its dtype, and the extent and
stride of each mode in elements) in the custom call's `dims` attribute; the handler
(`ffi/gemm_ffi.cc`) checks each description against the buffer XLA passes before it launches,
and refuses the call with `InvalidArgument` naming the tensor when the kernel would read or
write past that buffer. This module is the Python statement of the same rules:

- The kernels' index range (int32): the planner asks `constraints.extent_support` (through
  `kernel_support`), so that a problem past the range runs on XLA's dot with the reason in the
  plan; `encode` and the handler refuse such extents again.
- `TensorLayout`, `encode`: the attribute format (`DIMS_FORMAT`), written by gpu_lowering.py.
- `check_call`: the handler's checks (instantiate: the attribute; execute: each buffer's dtype
  and element count), run by the lowering at trace time and by the tests against the handler's
  own code (`JaxSm100_CheckCall`).

Attribute format (int64 values): `DIMS_FORMAT`, then per tensor in the kernel's argument order
`dtype, rank, shape_mask, stride_mask, shape[rank], strides[rank]`, where dtype is the
XLA_FFI_DataType code (xla/ffi/api/c_api.h), bit i of a mask says that mode i is a runtime
value of the kernel (passed in its argument struct; the other modes are compile-time constants
of the binary, included so the whole layout is checked), and extents and strides are in
elements. Then the count of extent ties and, per `Tie`, `i, mode, j, other_mode, divisor`
(tensor positions; a negative divisor is a ceil tie; format 4, where format 3's ties had no
ceil). `order` names each tensor's buffer (input i >= 0, result -1 - j) and `names`
its name.

A tensor spans `1 + sum((extent - 1) * stride)` elements (0 when an extent is 0): the offset one
past its last element. That must not exceed the element count of its buffer. That bounds a
kernel's accesses where each tensor is indexed by its own extents, or through a TMA descriptor
built from them (the GEMMs' A, B and D). Where a kernel indexes one tensor by another's extents
with plain loads and stores, the lowering declares `Tie`s and a call whose extents break one is
refused at instantiate: quantize_both's q, s, qt and st against x (stored over x's grid), the
dense GEMMs' bias, C and z against D (the epilogue's), the grouped kernels' bias against D and
group_sizes (a row per group). Every product's operands are tied to its problem as well
(`problem_ties`; sm_90a's scales to A's and B's extents, the grouped calls' experts and results
to group_sizes): TMA keeps a mismatched operand inside its buffer, but the product would be
wrong. sm_100a's block-scaled scales are flat buffers of the blocked layout, which no tie
describes: that kernel's TMA view of them takes its extent along rows from the buffer's own
(kernels/sm100_blockscaled.py), so it stays inside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jax_sm100._src import constraints

DIMS_FORMAT = 4
MAX_TENSORS = 8
MAX_RANK = 4
MAX_TIES = 16
INT64_MAX = 2**63 - 1
# The kernels hold extents as int32 (the argument struct of an exported CuTe DSL function).
MAX_EXTENT = constraints.MAX_EXTENT

# XLA_FFI_DataType codes (xla/ffi/api/c_api.h) of the dtypes a kernel argument may have.
FFI_DTYPES = {
    "bool": 1,
    "int8": 2,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "uint8": 6,
    "uint16": 7,
    "uint32": 8,
    "uint64": 9,
    "float16": 10,
    "float32": 11,
    "float64": 12,
    "bfloat16": 16,
    "float8_e5m2": 19,
    "float8_e4m3fn": 20,
    "float4_e2m1fn": 32,
    "float8_e8m0fnu": 33,
}


class LayoutError(ValueError):
    """A kernel call whose tensor layouts do not fit its buffers; the message names the tensor."""


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """One tensor argument of a kernel call.

    Attributes:
      name: the kernel's name for it ("a", "b", "d", "c", "bias", "z", "ws", "flags", "sfa",
        "sfb", "group_sizes" or "counter").
      dtype: the element type the kernel reads or writes, by numpy name.
      shape, strides: every mode's extent and stride in elements.
      dynamic_shape_modes, dynamic_stride_modes: the modes that are runtime values of the
        kernel (`compile.TensorArg`); the others are constants of its binary.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dynamic_shape_modes: tuple[int, ...] = ()
    dynamic_stride_modes: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(x) for x in self.shape))
        object.__setattr__(self, "strides", tuple(int(x) for x in self.strides))
        object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
        if not self.name or "," in self.name:
            raise ValueError(f"{self.name=} must be a non-empty name without commas")
        if self.dtype not in FFI_DTYPES:
            raise ValueError(f"{self.dtype=} is not a kernel argument dtype ({sorted(FFI_DTYPES)})")
        if len(self.shape) != len(self.strides) or len(self.shape) > MAX_RANK:
            raise ValueError(f"{self.shape=} and {self.strides=} must have one rank <= {MAX_RANK}")
        if any(x < 0 for x in self.shape + self.strides):
            raise ValueError(f"{self.shape=} and {self.strides=} must be non-negative")
        for modes in (self.dynamic_shape_modes, self.dynamic_stride_modes):
            if any(not 0 <= i < len(self.shape) for i in modes):
                raise ValueError(f"dynamic modes {modes} outside rank {len(self.shape)}")

    @property
    def span(self) -> int:
        """Elements from the first to one past the last element the kernel may touch."""
        if any(x == 0 for x in self.shape):
            return 0
        return 1 + sum((e - 1) * s for e, s in zip(self.shape, self.strides, strict=True))

    def fits_int64(self) -> bool:
        """Whether the handler's int64 walk over the modes, in order, stops at a zero extent
        or reaches `span` without overflow (gemm_ffi.cc `ElementSpan`): a zero extent after
        an overflowing mode is refused there, so here too."""
        last = 0
        for e, s in zip(self.shape, self.strides, strict=True):
            if e == 0:
                return True
            last += (e - 1) * s
            if (e - 1) * s > INT64_MAX or last > INT64_MAX:
                return False
        return last + 1 <= INT64_MAX

    def modes_text(self) -> str:
        return f"shape {list(self.shape)}, strides {list(self.strides)}"


@dataclasses.dataclass(frozen=True)
class Tie:
    """Tensor `name`'s extent in `mode` times `divisor` equals tensor `other`'s in
    `other_mode` (with `ceil`: equals ceil(other's / divisor), encoded as a negative divisor):
    a kernel that indexes one tensor by another's extents outside a TMA descriptor's bounds
    (quantize_both writes q, s, qt and st over x's grid) declares it, as does a kernel whose
    operands must agree on its problem (`problem_ties`), and the handler refuses a call whose
    layouts disagree."""

    name: str
    mode: int
    other: str
    other_mode: int
    divisor: int = 1
    ceil: bool = False

    def __post_init__(self):
        if not (isinstance(self.divisor, int) and self.divisor >= 1):
            raise ValueError(f"a tie's divisor must be a positive int, not {self.divisor=}")

    def holds(self, extent: int, other_extent: int) -> bool:
        if self.ceil:
            return extent == -(-other_extent // self.divisor)
        return extent * self.divisor == other_extent

    def broken(self, extent: int, other_extent: int) -> str:
        """The handler's message for extents that break this tie."""
        if self.ceil:
            relation = (f"which is not ceil(tensor '{self.other}''s extent {other_extent} in "
                        f"mode {self.other_mode} / {self.divisor})")  # fmt: skip
        else:
            relation = (f"which times {self.divisor} is not tensor '{self.other}''s extent "
                        f"{other_extent} in mode {self.other_mode}")  # fmt: skip
        return (
            f"jax_sm100: tensor '{self.name}' has extent {extent} in mode {self.mode}, "
            f"{relation}: the kernel indexes one by the other's extents (a lowering bug, or an "
            "edited module); refusing to launch"
        )


def problem_ties(a: str = "a", b: str = "b", d: str = "d", batched: bool = True) -> list[Tie]:
    """The ties of a GEMM whose A is (m, k[, L]), B (n, k[, L]) and D (m, n[, L]) in the
    kernel's modes: the kernel takes m and k from A and n from B, and reads and writes them
    through TMA descriptors built from each tensor's own extents, so a module whose operands
    disagree would not fault but compute wrong: B zero-filled past a shorter k, rows of a
    larger D left unwritten. `batched`: A, B and D share the batch mode L (not a split-K
    kernel's (m, k / s, s) views of a D with L = 1)."""
    ties = [Tie(a, 0, d, 0), Tie(b, 0, d, 1), Tie(a, 1, b, 1)]
    if batched:
        ties += [Tie(a, 2, d, 2), Tie(b, 2, d, 2)]
    return ties


def _mask(modes: Sequence[int]) -> int:
    return sum(1 << i for i in set(modes))


def encode(layouts: Sequence[TensorLayout], ties: Sequence[Tie] = ()) -> tuple[list[int], str]:
    """The `dims` and `names` attributes of a kernel call (its tensors, then its ties).

    Raises:
      LayoutError: an extent past the kernels' index range (the planner sends such problems to
        XLA's dot: `constraints.extent_support`), or more tensors than the handler takes.
    """
    if not 0 < len(layouts) <= MAX_TENSORS:
        raise LayoutError(f"{len(layouts)} tensors; the handler takes 1 to {MAX_TENSORS}")
    dims = [DIMS_FORMAT]
    for t in layouts:
        for i, e in enumerate(t.shape):
            if e > MAX_EXTENT:
                raise LayoutError(_extent_message(t.name, e, i))
        dims += [FFI_DTYPES[t.dtype], len(t.shape), _mask(t.dynamic_shape_modes),
                 _mask(t.dynamic_stride_modes), *t.shape, *t.strides]  # fmt: skip
    if len(ties) > MAX_TIES:
        raise LayoutError(f"{len(ties)} extent ties; the handler takes up to {MAX_TIES}")
    position = {t.name: i for i, t in enumerate(layouts)}
    dims.append(len(ties))
    for tie in ties:
        divisor = -tie.divisor if tie.ceil else tie.divisor
        dims += [position[tie.name], tie.mode, position[tie.other], tie.other_mode, divisor]
    return dims, ",".join(t.name for t in layouts)


def _extent_message(name: str, extent: int, mode: int) -> str:
    return (
        f"jax_sm100: tensor '{name}' has extent {extent} in mode {mode}, past the kernels' int32 "
        "index range (2^31 - 1). Such a call runs on XLA's dot: lower it with plan=None (the "
        "planner routes it there); this module was lowered with a hand-made plan or edited"
    )


def decode(dims: Sequence[int], names: str, count: int) -> list[TensorLayout]:
    """The layouts `encode` wrote (`decode_call`'s, without the ties)."""
    return decode_call(dims, names, count)[0]


def decode_call(
    dims: Sequence[int], names: str, count: int
) -> tuple[list[TensorLayout], list[Tie]]:
    """The layouts and ties `encode` wrote, checked as the handler's instantiate stage checks
    them.

    Raises:
      LayoutError: a malformed attribute, or an extent past the kernels' index range.
    """
    dims = [int(x) for x in dims]
    if not 0 < count <= MAX_TENSORS:
        raise LayoutError(f"jax_sm100: {count} tensors, expected 1 to {MAX_TENSORS}")
    if not dims or dims[0] != DIMS_FORMAT:
        raise LayoutError(f"jax_sm100: the dims attribute has format {dims[:1]}, not {DIMS_FORMAT}")
    codes = {v: k for k, v in FFI_DTYPES.items()}
    name_list = names.split(",") if names else []
    if len(name_list) != count or not all(name_list):
        raise LayoutError(f"jax_sm100: names {names!r} does not list {count} tensors")
    out, at = [], 1
    for name in name_list:
        if at + 4 > len(dims):
            raise LayoutError(f"jax_sm100: the dims attribute is too short for tensor '{name}'")
        code, rank, shape_mask, stride_mask = dims[at : at + 4]
        at += 4
        if code not in codes or not 0 <= rank <= MAX_RANK or at + 2 * rank > len(dims):
            raise LayoutError(f"jax_sm100: tensor '{name}' has dtype code {code}, rank {rank}")
        if shape_mask < 0 or stride_mask < 0 or (shape_mask | stride_mask) >> rank:
            raise LayoutError(f"jax_sm100: tensor '{name}' has dynamic-mode masks outside its rank")
        shape, strides = dims[at : at + rank], dims[at + rank : at + 2 * rank]
        at += 2 * rank
        for i, e in enumerate(shape):
            if e > MAX_EXTENT:
                raise LayoutError(_extent_message(name, e, i))
        if any(x < 0 for x in shape + strides):
            raise LayoutError(f"jax_sm100: tensor '{name}' has a negative extent or stride")
        out.append(TensorLayout(
            name, codes[code], tuple(shape), tuple(strides),
            tuple(i for i in range(rank) if shape_mask >> i & 1),
            tuple(i for i in range(rank) if stride_mask >> i & 1),
        ))  # fmt: skip
        if not out[-1].fits_int64():
            raise LayoutError(f"jax_sm100: tensor '{name}' has an overflowing "
                              f"{out[-1].modes_text()}")  # fmt: skip
    if at >= len(dims):
        raise LayoutError("jax_sm100: the dims attribute has no count of extent ties")
    count_ties, at = dims[at], at + 1
    if not 0 <= count_ties <= MAX_TIES or len(dims) - at != 5 * count_ties:
        raise LayoutError(f"jax_sm100: {count_ties} extent ties in {len(dims) - at} entries")
    ties = []
    for k in range(at, len(dims), 5):
        i, a, j, b, d = dims[k : k + 5]
        if not (0 <= i < count and 0 <= j < count and 0 <= a < len(out[i].shape)
                and 0 <= b < len(out[j].shape) and d != 0 and d >= -INT64_MAX):  # fmt: skip
            raise LayoutError(f"jax_sm100: an extent tie names no mode of a tensor, or divides "
                              f"by {d}")  # fmt: skip
        ti, tj = out[i], out[j]
        tie = Tie(ti.name, a, tj.name, b, abs(d), d < 0)
        if not tie.holds(ti.shape[a], tj.shape[b]):
            raise LayoutError(tie.broken(ti.shape[a], tj.shape[b]))
        ties.append(tie)
    return out, ties


def _buffer_name(which: int) -> str:
    return f"input {which}" if which >= 0 else f"result {-1 - which}"


def check_call(
    dims: Sequence[int],
    order: Sequence[int],
    names: str,
    inputs: Sequence[tuple[Sequence[int], object]],
    results: Sequence[tuple[Sequence[int], object]],
) -> list[TensorLayout]:
    """The handler's checks of one kernel call, before it launches.

    Args:
      dims, order, names: the custom call's attributes.
      inputs, results: (shape, dtype) of each operand and result buffer.

    Returns:
      The decoded layouts.

    Raises:
      LayoutError: the message the handler would return (it names the tensor).
    """
    layouts = decode(dims, names, len(order))
    for t, which in zip(layouts, order, strict=True):
        which = int(which)
        pool = inputs if which >= 0 else results
        index = which if which >= 0 else -1 - which
        if index >= len(pool):
            raise LayoutError(
                f"jax_sm100: tensor '{t.name}' is {_buffer_name(which)} but the call has "
                f"{len(inputs)} inputs and {len(results)} results"
            )
        shape, dtype = pool[index]
        dtype = np.dtype(dtype).name
        if dtype != t.dtype:
            raise LayoutError(
                f"jax_sm100: tensor '{t.name}' ({_buffer_name(which)}) is {dtype} but the kernel "
                f"reads {t.dtype}"
            )
        count = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        if count < t.span:
            raise LayoutError(
                f"jax_sm100: tensor '{t.name}' ({_buffer_name(which)}) spans {t.span} elements "
                f"({t.modes_text()}) but its buffer holds {count}"
            )
    if not inputs or not results:
        # The handler binds its first input and first result as typed buffers (gemm_ffi.cc):
        # XLA refuses a call without them before the handler runs.
        raise LayoutError(
            f"jax_sm100: the handler takes one input and one result at least; the call has "
            f"{len(inputs)} inputs and {len(results)} results"
        )
    return layouts
