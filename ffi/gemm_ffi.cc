// XLA FFI handler that runs GEMM kernels compiled by CuTe DSL.
//
// The kernel travels inside the HLO: the custom call carries the object file that
// `JitCompiledFunction.dump_to_object` produced (a host ELF holding the cubin and the host
// launch wrapper) as a u8 array attribute. That wrapper is native host code: loading the object
// runs it in this process, so a module carrying it is code, not data (README "Trust").
//
// Two stages:
// - Instantiate (once per custom call in a compiled executable, before any CUDA-graph capture)
//   reads every attribute, checks that the object's sha256 equals the `key` attribute, checks
//   the tensor layouts of `dims` (extents inside the kernels' int32 index range, the elements
//   each tensor spans), loads the kernel through the CuTe DSL runtime (`libcute_dsl_runtime.so`,
//   from the nvidia-cutlass-dsl wheel) and keeps the loaded function and the prepared argument
//   structs in a per-instance `GemmState`. Loaded modules are shared by every instance whose
//   object is byte-identical to one already verified, so each distinct kernel is hashed and
//   loaded once per process.
// - Execute binds no attributes: it checks each buffer XLA passes against its tensor's layout
//   (dtype, element count, 16-byte alignment), copies the prepared structs onto the stack with
//   the buffers' addresses, and launches. No lock, no lookup, no allocation on the success path.
//
// The runtime is dlopen'ed on first use from the path Python registered
// (`JaxSm100_SetRuntimePath`), so this library needs no CUDA toolkit to build or import.
//
// Calling convention of an exported CuTe DSL function (see its generated header): one pointer
// per tensor to `{void* data; int32_t shapes[S]; int64_t strides[T];}` holding only the
// dynamic extents and strides, then a pointer to the `cudaStream_t`, then a pointer to an
// int32 that receives the CUDA error code of the launch.
//
// Attributes (written by gpu_lowering.py; `ffi_checks.py` is their Python mirror):
//   key     sha256 of `object`, lowercase hex
//   object  the kernel object
//   prefix  the name of its function
//   dims    kDimsFormat, then per tensor in the kernel's argument order:
//           dtype (XLA_FFI_DataType), rank, dynamic-shape mask, dynamic-stride mask,
//           shape[rank], strides[rank] (elements; every mode, static ones included);
//           then the count of extent ties and per tie (i, a, j, b, d): tensor i's extent in
//           mode a times d equals tensor j's in mode b, or with d < 0 equals ceil(tensor j's
//           / -d) (a kernel that indexes one tensor by another's extents without a TMA
//           descriptor's bounds: quantize_both's stores by x's grid, a dense epilogue's bias,
//           C and z by D's; and the operands of a product, which must agree on its problem)
//   order   per tensor, its buffer: i >= 0 is input i, -1 - j is result j
//   names   per tensor, its name ("a,b,d,bias"), for error messages

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kDimsFormat = 4;
constexpr size_t kMaxTensors = 8;  // most of any family (dense: a, b, d, c, bias, z, ws, flags)
constexpr int64_t kMaxRank = 4;
constexpr int64_t kMaxTies = 16;
// void* + int32 extents + padding + int64 strides, for kMaxRank modes each.
constexpr size_t kMaxArgBytes = 64;
// The kernels hold extents in int32 (the struct above); TMA needs 16-byte aligned buffers.
constexpr int64_t kMaxExtent = std::numeric_limits<int32_t>::max();
constexpr uintptr_t kAlignment = 16;

// ---------------------------------------------------------------------------------------------
// SHA-256 (FIPS 180-4), enough to check the `key` attribute without a crypto dependency.

class Sha256 {
 public:
  void Update(const uint8_t* data, size_t size) {
    if (size == 0) return;  // data may be null (an empty attribute): memcpy must not see it
    length_ += size;
    if (buffered_ > 0) {
      const size_t take = std::min(size, sizeof(buffer_) - buffered_);
      std::memcpy(buffer_ + buffered_, data, take);
      buffered_ += take;
      data += take;
      size -= take;
      if (buffered_ < sizeof(buffer_)) return;
      Compress(buffer_);
      buffered_ = 0;
    }
    for (; size >= 64; data += 64, size -= 64) Compress(data);
    std::memcpy(buffer_, data, size);
    buffered_ = size;
  }

  std::string HexDigest() {
    const uint64_t bits = length_ * 8;
    const uint8_t one = 0x80, zero = 0;
    Update(&one, 1);
    while (buffered_ != 56) Update(&zero, 1);
    uint8_t tail[8];
    for (int i = 0; i < 8; ++i) tail[i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
    Update(tail, 8);
    static constexpr char kHex[] = "0123456789abcdef";
    std::string out(64, '0');
    for (size_t i = 0; i < 8; ++i) {
      for (size_t j = 0; j < 8; ++j) out[8 * i + j] = kHex[(state_[i] >> (28 - 4 * j)) & 0xf];
    }
    return out;
  }

 private:
  static uint32_t Rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

  void Compress(const uint8_t* block) {
    static constexpr uint32_t kRound[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2};
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      w[i] = uint32_t{block[4 * i]} << 24 | uint32_t{block[4 * i + 1]} << 16 |
             uint32_t{block[4 * i + 2]} << 8 | uint32_t{block[4 * i + 3]};
    }
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = Rotr(w[i - 15], 7) ^ Rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = Rotr(w[i - 2], 17) ^ Rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
    uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
    for (int i = 0; i < 64; ++i) {
      const uint32_t t1 =
          h + (Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[i] + w[i];
      const uint32_t t2 = (Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state_[0] += a;
    state_[1] += b;
    state_[2] += c;
    state_[3] += d;
    state_[4] += e;
    state_[5] += f;
    state_[6] += g;
    state_[7] += h;
  }

  uint32_t state_[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                        0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  uint8_t buffer_[64] = {};
  size_t buffered_ = 0;
  uint64_t length_ = 0;
};

std::string Sha256Hex(const uint8_t* data, size_t size) {
  Sha256 h;
  h.Update(data, size);
  return h.HexDigest();
}

// ---------------------------------------------------------------------------------------------
// The CuTe DSL runtime: the slice of CuteDSLRuntime.h this handler uses (declared here so the
// build needs no wheel).

using RtError = int;  // CuteDSLRT_Error_t
using ModuleCreateFn = RtError (*)(void** module, const unsigned char* bytes, size_t size,
                                   const char** shared_libs, size_t num_shared_libs);
using GetFunctionFn = RtError (*)(void** function, void* module, const char* prefix);
using ModuleDestroyFn = RtError (*)(void* module);
using RunFn = RtError (*)(void* function, void** args, size_t num_args);
using ErrorStringFn = const char* (*)(RtError error);
using CudaErrorStringFn = const char* (*)(int error);

struct Runtime {
  ModuleCreateFn module_create = nullptr;
  GetFunctionFn get_function = nullptr;
  ModuleDestroyFn module_destroy = nullptr;  // for a module whose function is missing
  RunFn run = nullptr;
  ErrorStringFn error_string = nullptr;
};

// A kernel loaded once per process, for every instance whose object is byte-identical.
struct LoadedKernel {
  std::vector<uint8_t> object;  // the bytes whose sha256 was checked against the key
  std::string prefix;
  void* function = nullptr;  // modules live until the process exits
};

// Guards everything below; taken at instantiate only, never by Execute.
std::mutex g_mutex;
std::string g_runtime_path;
Runtime g_runtime;
bool g_runtime_loaded = false;
std::unordered_map<std::string, LoadedKernel> g_kernels;  // by sha256 of the object

// Calls a runtime entry point. Some failures come back as an error code, others as a C++
// exception thrown through the C entry point (a function missing from a module:
// "BinaryExecutionEngine: Failed to lookup function"), which is caught here: its text goes to
// `thrown` (kept if set before) and the call returns -1.
template <typename Fn, typename... Args>
RtError CallRuntime(std::string* thrown, Fn fn, Args... args) {
  try {
    return fn(args...);
  } catch (const std::exception& e) {
    if (thrown->empty()) *thrown = *e.what() ? e.what() : "a C++ exception with no message";
  } catch (...) {
    if (thrown->empty()) *thrown = "an unrecognised C++ exception";
  }
  return -1;
}

ffi::ErrorOr<Runtime> LoadRuntimeLocked() {
  if (g_runtime_loaded) return g_runtime;
  if (g_runtime_path.empty()) {
    return ffi::Unexpected(ffi::Error::Internal(
        "jax_sm100: the CuTe DSL runtime path was never set; import jax_sm100 (its ffi module "
        "registers the handler and the path) before running a compiled function"));
  }
  // The runtime links its own C++ runtime and unwinder statically. An exception it throws
  // (CallRuntime) is caught here only once this process has unwound one through the system's
  // unwinder: in a process that never has, its unwind aborts (reproduced outside JAX with the
  // real runtime). One throw of our own here makes the first catch work.
  try {
    throw 0;
  } catch (...) {
  }
  void* lib = dlopen(g_runtime_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return ffi::Unexpected(ffi::Error::Internal(
        std::string("jax_sm100: cannot load the CuTe DSL runtime ") + g_runtime_path + ": " +
        dlerror() + " (is nvidia-cutlass-dsl installed for this CUDA version?)"));
  }
  Runtime rt;
  rt.module_create =
      reinterpret_cast<ModuleCreateFn>(dlsym(lib, "CuteDSLRT_Module_Create_From_Bytes"));
  rt.get_function = reinterpret_cast<GetFunctionFn>(dlsym(lib, "CuteDSLRT_Module_Get_Function"));
  rt.module_destroy = reinterpret_cast<ModuleDestroyFn>(dlsym(lib, "CuteDSLRT_Module_Destroy"));
  rt.run = reinterpret_cast<RunFn>(dlsym(lib, "CuteDSLRT_Function_Run"));
  rt.error_string = reinterpret_cast<ErrorStringFn>(dlsym(lib, "CuteDSLRT_GetErrorString"));
  if (!rt.module_create || !rt.get_function || !rt.module_destroy || !rt.run ||
      !rt.error_string) {
    return ffi::Unexpected(ffi::Error::Internal(
        "jax_sm100: " + g_runtime_path +
        " lacks the CuteDSLRT_* entry points; nvidia-cutlass-dsl >= 4.8 is required"));
  }
  g_runtime = rt;
  g_runtime_loaded = true;
  return g_runtime;
}

std::string RuntimeErrorText(ErrorStringFn error_string, RtError err) {
  const char* s = error_string ? error_string(err) : nullptr;
  return std::string(s ? s : "unknown error") + " (CuteDSLRT error " + std::to_string(err) + ")";
}

std::string CudaErrorText(int code) {
  // libcudart is loaded by JAX's CUDA plugin; use its message when it is visible.
  auto fn = reinterpret_cast<CudaErrorStringFn>(dlsym(RTLD_DEFAULT, "cudaGetErrorString"));
  const char* s = fn ? fn(code) : nullptr;
  return "CUDA error " + std::to_string(code) + (s ? std::string(" (") + s + ")" : "");
}

// Returns the loaded function of `object`, verifying that its sha256 is `key` unless a
// byte-identical object was verified and loaded before.
ffi::ErrorOr<std::pair<void*, Runtime>> LoadKernel(std::string_view key,
                                                   ffi::Span<const uint8_t> object,
                                                   std::string_view prefix) {
  const std::string key_str(key);
  auto same = [&](const LoadedKernel& k) {
    return k.prefix == prefix && k.object.size() == object.size() &&
           std::equal(object.begin(), object.end(), k.object.begin());
  };
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_kernels.find(key_str);
    if (it != g_kernels.end() && same(it->second)) {
      return std::make_pair(it->second.function, g_runtime);
    }
  }
  // Hashed outside the lock: a few milliseconds per megabyte, once per distinct kernel.
  const std::string digest = Sha256Hex(object.begin(), object.size());
  if (digest != key) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "jax_sm100: the kernel object's sha256 is " + digest + " but the custom call's key "
        "attribute says " + key_str + ": the module was edited or corrupted after it was "
        "lowered. Re-export it from the source program; do not run it"));
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_kernels.find(key_str);
  if (it != g_kernels.end() && same(it->second)) {
    return std::make_pair(it->second.function, g_runtime);
  }
  auto rt = LoadRuntimeLocked();
  if (rt.has_error()) return ffi::Unexpected(rt.error());
  void* module = nullptr;
  std::string thrown;
  RtError err = CallRuntime(&thrown, rt->module_create, &module, object.begin(), object.size(),
                            static_cast<const char**>(nullptr), size_t{0});
  if (err != 0) {
    return ffi::Unexpected(ffi::Error::Internal(
        "jax_sm100: loading the compiled GEMM kernel failed: " +
        (thrown.empty() ? RuntimeErrorText(rt->error_string, err) : thrown) +
        ". The kernel was built for a different GPU architecture or DSL version than this "
        "process runs; clear the kernel cache and re-trace"));
  }
  void* function = nullptr;
  LoadedKernel loaded{std::vector<uint8_t>(object.begin(), object.end()), std::string(prefix)};
  err = CallRuntime(&thrown, rt->get_function, &function, module, loaded.prefix.c_str());
  if (err != 0) {
    std::string ignored;
    CallRuntime(&ignored, rt->module_destroy, module);  // nothing else holds it
    return ffi::Unexpected(ffi::Error::Internal(
        "jax_sm100: function '" + loaded.prefix + "' not found in the compiled kernel: " +
        (thrown.empty() ? RuntimeErrorText(rt->error_string, err) : thrown)));
  }
  loaded.function = function;
  g_kernels[key_str] = std::move(loaded);
  return std::make_pair(function, *rt);
}

// ---------------------------------------------------------------------------------------------
// Tensor layouts: parsed and checked at instantiate, checked against XLA's buffers per call.

struct TensorSlot {
  std::string name;
  int64_t which = 0;  // input i >= 0, result -1 - j
  ffi::DataType dtype = ffi::DataType::INVALID;
  int64_t rank = 0;
  int64_t shape[kMaxRank] = {};
  int64_t strides[kMaxRank] = {};
  int64_t span = 0;  // elements from the first to one past the last the kernel may touch
  size_t arg_size = 0;
  alignas(8) unsigned char arg[kMaxArgBytes] = {};  // the kernel's struct, data pointer unset
};

struct KernelCall {
  size_t num_tensors = 0;
  std::array<TensorSlot, kMaxTensors> tensors;
};

std::string BufferName(int64_t which) {
  return which >= 0 ? "input " + std::to_string(which) : "result " + std::to_string(-1 - which);
}

std::string ModesText(const TensorSlot& t) {
  std::string s = "shape [";
  for (int64_t i = 0; i < t.rank; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  s += "], strides [";
  for (int64_t i = 0; i < t.rank; ++i) s += (i ? ", " : "") + std::to_string(t.strides[i]);
  return s + "]";
}

ffi::Error BadDims(const std::string& what) {
  return ffi::Error::InvalidArgument(
      "jax_sm100: the custom call's dims attribute is malformed (" + what +
      "); it was not written by this version of jax_sm100's lowering. Re-export the module");
}

// Whether `code` is an XLA_FFI_DataType of array elements (the kernels use a few of them).
bool IsArrayDtype(int64_t code) {
  switch (code) {
    case XLA_FFI_DataType_PRED:
    case XLA_FFI_DataType_S8:
    case XLA_FFI_DataType_S16:
    case XLA_FFI_DataType_S32:
    case XLA_FFI_DataType_S64:
    case XLA_FFI_DataType_U8:
    case XLA_FFI_DataType_U16:
    case XLA_FFI_DataType_U32:
    case XLA_FFI_DataType_U64:
    case XLA_FFI_DataType_F16:
    case XLA_FFI_DataType_F32:
    case XLA_FFI_DataType_F64:
    case XLA_FFI_DataType_BF16:
    case XLA_FFI_DataType_F8E5M2:
    case XLA_FFI_DataType_F8E4M3FN:
    case XLA_FFI_DataType_F4E2M1FN:   // block-scaled data (nvfp4), two to a byte
    case XLA_FFI_DataType_F8E8M0FNU:  // block scales (mxfp8)
      return true;
    default:
      return false;
  }
}

// Elements from a tensor's first to one past its last element: 0 when any extent is 0, else
// 1 + sum((extent - 1) * stride). False on a negative value in any mode or int64 overflow.
bool ElementSpan(const TensorSlot& t, int64_t* span) {
  for (int64_t i = 0; i < t.rank; ++i) {
    if (t.shape[i] < 0 || t.strides[i] < 0) return false;
  }
  int64_t last = 0;
  for (int64_t i = 0; i < t.rank; ++i) {
    if (t.shape[i] == 0) {
      *span = 0;
      return true;
    }
    int64_t step;
    if (__builtin_mul_overflow(t.shape[i] - 1, t.strides[i], &step) ||
        __builtin_add_overflow(last, step, &last)) {
      return false;
    }
  }
  return !__builtin_add_overflow(last, int64_t{1}, span);
}

// Parses `dims`, `order` and `names` into per-tensor slots with their argument structs.
ffi::Error ParseCall(ffi::Span<const int64_t> dims, ffi::Span<const int64_t> order,
                     std::string_view names, KernelCall* call) {
  const size_t count = order.size();
  if (count == 0 || count > kMaxTensors) {
    return BadDims(std::to_string(count) + " tensors, expected 1 to " +
                   std::to_string(kMaxTensors));
  }
  if (dims.size() == 0 || dims[0] != kDimsFormat) {
    return ffi::Error::InvalidArgument(
        "jax_sm100: the custom call's dims attribute has format " +
        (dims.size() ? std::to_string(dims[0]) : std::string("(empty)")) + ", this handler reads " +
        std::to_string(kDimsFormat) + ": the module was lowered by another jax_sm100 version. "
        "Re-export it with the installed one");
  }
  call->num_tensors = count;
  size_t at = 1;
  bool more_names = false;  // a comma after the last name read ("a,b," lists a third, empty)
  for (size_t i = 0; i < count; ++i) {
    TensorSlot& t = call->tensors[i];
    const size_t comma = names.find(',');
    t.name = std::string(names.substr(0, comma));
    more_names = comma != std::string_view::npos;
    names = more_names ? names.substr(comma + 1) : std::string_view();
    if (t.name.empty()) return BadDims("names lists fewer tensors than order");
    t.which = order[i];
    if (at + 4 > dims.size()) return BadDims("too short for tensor '" + t.name + "'");
    const int64_t dtype = dims[at], rank = dims[at + 1];
    const int64_t shape_mask = dims[at + 2], stride_mask = dims[at + 3];
    at += 4;
    if (!IsArrayDtype(dtype)) {
      return BadDims("tensor '" + t.name + "' has dtype code " + std::to_string(dtype));
    }
    t.dtype = static_cast<ffi::DataType>(dtype);
    if (rank < 0 || rank > kMaxRank || at + 2 * static_cast<size_t>(rank) > dims.size()) {
      return BadDims("tensor '" + t.name + "' has rank " + std::to_string(rank));
    }
    const int64_t all_modes = (int64_t{1} << rank) - 1;
    if (shape_mask < 0 || stride_mask < 0 || (shape_mask & ~all_modes) ||
        (stride_mask & ~all_modes)) {
      return BadDims("tensor '" + t.name + "' has dynamic-mode masks outside its rank");
    }
    t.rank = rank;
    const size_t r = static_cast<size_t>(rank);
    for (size_t m = 0; m < r; ++m) {
      t.shape[m] = dims[at + m];
      t.strides[m] = dims[at + r + m];
    }
    at += 2 * r;
    for (int64_t m = 0; m < rank; ++m) {
      if (t.shape[m] > kMaxExtent) {
        return ffi::Error::InvalidArgument(
            "jax_sm100: tensor '" + t.name + "' has extent " + std::to_string(t.shape[m]) +
            " in mode " + std::to_string(m) + ", past the kernels' int32 index range (2^31 - 1). "
            "Such a call runs on XLA's dot: lower it with plan=None (the planner routes it "
            "there); this module was lowered with a hand-made plan or edited");
      }
    }
    if (!ElementSpan(t, &t.span)) {
      return BadDims("tensor '" + t.name + "' has a negative or overflowing " + ModesText(t));
    }
    // The kernel's struct: the data pointer, the dynamic extents as int32, then (8-aligned)
    // the dynamic strides as int64.
    size_t offset = sizeof(void*);
    for (int64_t m = 0; m < rank; ++m) {
      if (!(shape_mask >> m & 1)) continue;
      const int32_t v = static_cast<int32_t>(t.shape[m]);  // <= kMaxExtent, checked above
      std::memcpy(t.arg + offset, &v, sizeof(v));
      offset += sizeof(v);
    }
    offset = (offset + 7) / 8 * 8;
    for (int64_t m = 0; m < rank; ++m) {
      if (!(stride_mask >> m & 1)) continue;
      std::memcpy(t.arg + offset, &t.strides[m], sizeof(int64_t));
      offset += sizeof(int64_t);
    }
    t.arg_size = offset;
  }
  if (more_names) return BadDims("names lists more tensors than order");
  if (at >= dims.size()) return BadDims("no count of extent ties");
  const int64_t ties = dims[at++];
  if (ties < 0 || ties > kMaxTies || dims.size() - at != 5 * static_cast<size_t>(ties)) {
    return BadDims(std::to_string(ties) + " extent ties in " + std::to_string(dims.size() - at) +
                   " entries");
  }
  for (; at < dims.size(); at += 5) {
    const int64_t i = dims[at], a = dims[at + 1], j = dims[at + 2], b = dims[at + 3];
    const int64_t d = dims[at + 4];
    if (i < 0 || j < 0 || static_cast<size_t>(i) >= count || static_cast<size_t>(j) >= count ||
        a < 0 || b < 0 || a >= call->tensors[i].rank || b >= call->tensors[j].rank || d == 0 ||
        d == std::numeric_limits<int64_t>::min()) {
      return BadDims("an extent tie names no mode of a tensor, or divides by " +
                     std::to_string(d));
    }
    const TensorSlot& ti = call->tensors[i];
    const TensorSlot& tj = call->tensors[j];
    const int64_t other = tj.shape[b];
    std::string relation;
    if (d < 0) {  // ceil(other / -d); extents are >= 0
      const int64_t q = other / -d + (other % -d != 0);
      if (q != ti.shape[a]) {
        relation = "which is not ceil(tensor '" + tj.name + "''s extent " +
                   std::to_string(other) + " in mode " + std::to_string(b) + " / " +
                   std::to_string(-d) + ")";
      }
    } else {
      int64_t times;
      if (__builtin_mul_overflow(ti.shape[a], d, &times) || times != other) {
        relation = "which times " + std::to_string(d) + " is not tensor '" + tj.name +
                   "''s extent " + std::to_string(other) + " in mode " + std::to_string(b);
      }
    }
    if (!relation.empty()) {
      return ffi::Error::InvalidArgument(
          "jax_sm100: tensor '" + ti.name + "' has extent " + std::to_string(ti.shape[a]) +
          " in mode " + std::to_string(a) + ", " + relation +
          ": the kernel indexes one by the other's extents (a lowering bug, or an edited "
          "module); refusing to launch");
    }
  }
  return ffi::Error::Success();
}

// One buffer as the checks see it.
struct BufferRef {
  ffi::DataType dtype;
  int64_t element_count;
  void* data;
};

// The kernel's arguments for one launch, on the caller's stack.
struct LaunchArgs {
  alignas(8) unsigned char structs[kMaxTensors][kMaxArgBytes];
  void* pointers[kMaxTensors + 2];
};

// Checks every tensor against the buffer `order` names and fills `args`. `Buffers` resolves
// an index: `bool Input(size_t, BufferRef*)`, `bool Result(size_t, BufferRef*)`, and the counts
// `num_inputs()` / `num_results()` for messages.
template <typename Buffers>
ffi::Error PrepareLaunch(const KernelCall& call, const Buffers& buffers, LaunchArgs* args) {
  for (size_t i = 0; i < call.num_tensors; ++i) {
    const TensorSlot& t = call.tensors[i];
    BufferRef buf;
    const bool found = t.which >= 0 ? buffers.Input(static_cast<size_t>(t.which), &buf)
                                    : buffers.Result(static_cast<size_t>(-1 - t.which), &buf);
    if (!found) {
      return ffi::Error::InvalidArgument(
          "jax_sm100: tensor '" + t.name + "' is " + BufferName(t.which) + " but the call has " +
          std::to_string(buffers.num_inputs()) + " inputs and " +
          std::to_string(buffers.num_results()) + " results: the order attribute does not match "
          "the custom call's operands (a lowering bug, or an edited module)");
    }
    if (buf.dtype != t.dtype) {
      return ffi::Error::InvalidArgument(
          "jax_sm100: tensor '" + t.name + "' (" + BufferName(t.which) + ") is dtype code " +
          std::to_string(static_cast<int>(buf.dtype)) + " but the kernel reads dtype code " +
          std::to_string(static_cast<int>(t.dtype)) +
          " (XLA_FFI_DataType): the custom call's operands do not match its kernel (a lowering "
          "bug, or an edited module)");
    }
    if (buf.element_count < t.span) {
      return ffi::Error::InvalidArgument(
          "jax_sm100: tensor '" + t.name + "' (" + BufferName(t.which) + ") spans " +
          std::to_string(t.span) + " elements (" + ModesText(t) + ") but its buffer holds " +
          std::to_string(buf.element_count) + ": the dims attribute does not match the "
          "custom call's operands (a lowering bug, or an edited module); refusing to launch");
    }
    if (t.span > 0 && reinterpret_cast<uintptr_t>(buf.data) % kAlignment != 0) {
      return ffi::Error::InvalidArgument("jax_sm100: tensor '" + t.name + "' (" +
                                         BufferName(t.which) +
                                         ") is not 16-byte aligned, which TMA requires");
    }
    std::memcpy(args->structs[i], t.arg, t.arg_size);
    std::memcpy(args->structs[i], &buf.data, sizeof(void*));
    args->pointers[i] = args->structs[i];
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// The handler.

struct GemmState {
  static ffi::TypeId id;
  KernelCall call;
  void* function = nullptr;
  RunFn run = nullptr;
  ErrorStringFn error_string = nullptr;
};
ffi::TypeId GemmState::id = {};

ffi::ErrorOr<std::unique_ptr<GemmState>> Instantiate(std::string_view key,
                                                     ffi::Span<const uint8_t> object,
                                                     std::string_view prefix,
                                                     ffi::Span<const int64_t> dims,
                                                     ffi::Span<const int64_t> order,
                                                     std::string_view names) {
  auto state = std::make_unique<GemmState>();
  ffi::Error parsed = ParseCall(dims, order, names, &state->call);
  if (parsed.failure()) return ffi::Unexpected(std::move(parsed));
  auto loaded = LoadKernel(key, object, prefix);
  if (loaded.has_error()) return ffi::Unexpected(loaded.error());
  state->function = loaded->first;
  state->run = loaded->second.run;
  state->error_string = loaded->second.error_string;
  return state;
}

// XLA's buffers: the first input and the first result typed, the others after them. One input
// at least: the quantize_both kernel reads one (x), the GEMMs two or more (a, b, ...).
class CallBuffers {
 public:
  CallBuffers(const ffi::AnyBuffer& first, const ffi::RemainingArgs& args, const ffi::AnyBuffer& d,
              const ffi::RemainingRets& rets)
      : first_(first), args_(args), d_(d), rets_(rets) {}

  bool Input(size_t i, BufferRef* out) const {
    if (i == 0) return Set(first_, out);
    if (i - 1 >= args_.size()) return false;
    auto buf = args_.get<ffi::AnyBuffer>(i - 1);
    return buf.has_value() && Set(*buf, out);
  }
  bool Result(size_t j, BufferRef* out) const {
    if (j == 0) return Set(d_, out);
    if (j - 1 >= rets_.size()) return false;
    auto buf = rets_.get<ffi::AnyBuffer>(j - 1);
    return buf.has_value() && Set(**buf, out);
  }
  size_t num_inputs() const { return 1 + args_.size(); }
  size_t num_results() const { return 1 + rets_.size(); }

 private:
  static bool Set(const ffi::AnyBuffer& buf, BufferRef* out) {
    *out = BufferRef{buf.element_type(), static_cast<int64_t>(buf.element_count()),
                     buf.untyped_data()};
    return true;
  }

  const ffi::AnyBuffer& first_;
  const ffi::RemainingArgs& args_;
  const ffi::AnyBuffer& d_;
  const ffi::RemainingRets& rets_;
};

ffi::Error Execute(void* stream, GemmState* state, ffi::AnyBuffer first, ffi::RemainingArgs args,
                   ffi::Result<ffi::AnyBuffer> d, ffi::RemainingRets rets) {
  LaunchArgs launch;
  ffi::Error prepared = PrepareLaunch(state->call, CallBuffers(first, args, *d, rets), &launch);
  if (prepared.failure()) return prepared;
  int32_t launch_status = 0;
  const size_t n = state->call.num_tensors;
  launch.pointers[n] = &stream;
  launch.pointers[n + 1] = &launch_status;
  std::string thrown;  // allocates nothing unless the runtime throws
  RtError err = CallRuntime(&thrown, state->run, state->function, launch.pointers, n + 2);
  if (err != 0) {
    return ffi::Error::Internal(
        "jax_sm100: running the GEMM kernel failed: " +
        (thrown.empty() ? RuntimeErrorText(state->error_string, err) : thrown));
  }
  if (launch_status != 0) {
    return ffi::Error::Internal("jax_sm100: launching the GEMM kernel failed with " +
                                CudaErrorText(launch_status) +
                                "; run with compute-sanitizer or CUDA_LAUNCH_BLOCKING=1 to "
                                "locate it");
  }
  return ffi::Error::Success();
}

// Buffers described by (dtype, element count) pairs, for the test entry point below.
class PairBuffers {
 public:
  PairBuffers(const int64_t* inputs, size_t num_inputs, const int64_t* results,
              size_t num_results)
      : inputs_(inputs), num_inputs_(num_inputs), results_(results), num_results_(num_results) {}

  bool Input(size_t i, BufferRef* out) const { return Get(inputs_, num_inputs_, i, out); }
  bool Result(size_t j, BufferRef* out) const { return Get(results_, num_results_, j, out); }
  size_t num_inputs() const { return num_inputs_; }
  size_t num_results() const { return num_results_; }

 private:
  static bool Get(const int64_t* pairs, size_t count, size_t i, BufferRef* out) {
    if (i >= count) return false;
    // Distinct, 16-byte aligned stand-in addresses: nothing is dereferenced.
    *out = BufferRef{static_cast<ffi::DataType>(pairs[2 * i]), pairs[2 * i + 1],
                     reinterpret_cast<void*>(uintptr_t{4096} * (i + 1))};
    return true;
  }

  const int64_t* inputs_;
  size_t num_inputs_;
  const int64_t* results_;
  size_t num_results_;
};

void CopyMessage(const std::string& text, char* out, size_t size) {
  if (size == 0) return;
  const size_t n = std::min(text.size(), size - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

}  // namespace

extern "C" void JaxSm100_SetRuntimePath(const char* path) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_runtime_loaded) g_runtime_path = path;
}

// For `jax.ffi.register_ffi_type`: the state type's id (filled in by XLA) and its deleter.
extern "C" void* JaxSm100_GemmStateTypeId() { return &GemmState::id; }

extern "C" void* JaxSm100_GemmStateTypeInfo() {
  static ffi::TypeInfo info = ffi::MakeTypeInfo<GemmState>();
  return &info;
}

// sha256 of `size` bytes as 64 hex digits and a NUL in `out` (tests compare it with hashlib).
extern "C" void JaxSm100_Sha256Hex(const uint8_t* data, size_t size, char* out) {
  CopyMessage(Sha256Hex(data, size), out, 65);
}

// The handler's layout checks, without a GPU: parses the attributes as Instantiate does and
// checks them against buffers given as (XLA_FFI_DataType, element count) pairs as Execute does,
// `repeats` times (>= 1; the per-call check is timed into `*ns_per_call`). Returns 0 when the
// call would launch, else the XLA_FFI_Error_Code, with the message in `message`.
extern "C" int JaxSm100_CheckCall(const int64_t* dims, size_t num_dims, const int64_t* order,
                                  size_t num_order, const char* names, const int64_t* inputs,
                                  size_t num_inputs, const int64_t* results, size_t num_results,
                                  int64_t repeats, double* ns_per_call, char* message,
                                  size_t message_size) {
  CopyMessage("", message, message_size);
  auto call = std::make_unique<KernelCall>();
  ffi::Error err = ParseCall(ffi::Span<const int64_t>(dims, num_dims),
                             ffi::Span<const int64_t>(order, num_order), names, call.get());
  if (err.success()) {
    const PairBuffers buffers(inputs, num_inputs, results, num_results);
    LaunchArgs launch;
    const auto start = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < std::max<int64_t>(repeats, 1) && err.success(); ++r) {
      err = PrepareLaunch(*call, buffers, &launch);
    }
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
    if (ns_per_call) *ns_per_call = took.count() / static_cast<double>(std::max<int64_t>(repeats, 1));
  }
  if (err.success()) return 0;
  CopyMessage(err.message(), message, message_size);
  return static_cast<int>(*err.errc());
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSm100GemmInstantiate, Instantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Attr<std::string_view>("key")             // sha256(object)
                                  .Attr<ffi::Span<const uint8_t>>("object")  // kernel object
                                  .Attr<std::string_view>("prefix")          // its function
                                  .Attr<ffi::Span<const int64_t>>("dims")    // tensor layouts
                                  .Attr<ffi::Span<const int64_t>>("order")   // buffer per tensor
                                  .Attr<std::string_view>("names"));         // tensor names

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSm100GemmExecute, Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()  // XLA's stream
                                  .Ctx<ffi::State<GemmState>>()       // from Instantiate
                                  .Arg<ffi::AnyBuffer>()              // a (quantize_both: x)
                                  .RemainingArgs()                    // b, c, bias, scales...
                                  .Ret<ffi::AnyBuffer>()              // d (quantize_both: q)
                                  .RemainingRets(),                   // z, ws, flags, scales...
                              {ffi::Traits::kCmdBufferCompatible});
