// XLA FFI handler that runs GEMM kernels compiled by CuTe DSL.
//
// The kernel travels inside the HLO: the custom call carries the object file that
// `JitCompiledFunction.dump_to_object` produced (an x86-64 ELF holding the cubin and the host
// launch wrapper) as a u8 array attribute. The handler hands those bytes to the CuTe DSL
// runtime (`libcute_dsl_runtime.so`, from the nvidia-cutlass-dsl wheel), which loads the cubin
// into a context-independent CUDA library; the loaded module is cached per process under the
// object's sha256 (the `key` attribute, computed once at trace time), so each kernel loads once, at the instantiate stage when XLA
// runs it (before any CUDA-graph capture), else on first execution.
//
// The runtime is dlopen'ed on first use from the path Python registered
// (`JaxSm100_SetRuntimePath`), so this library needs no CUDA toolkit to build or import.
//
// Calling convention of an exported CuTe DSL function (see its generated header): one pointer
// per tensor to `{void* data; int32_t shapes[S]; int64_t strides[T];}` holding only the
// dynamic extents and strides, then a pointer to the `cudaStream_t`, then a pointer to an
// int32 that receives the CUDA error code of the launch. `dims` describes each tensor, in the
// kernel's argument order, as `S, T, shapes..., strides...`.

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The slice of CuteDSLRuntime.h this handler uses (declared here so the build needs no wheel).
using RtError = int;  // CuteDSLRT_Error_t
using ModuleCreateFn = RtError (*)(void** module, const unsigned char* bytes, size_t size,
                                   const char** shared_libs, size_t num_shared_libs);
using GetFunctionFn = RtError (*)(void** function, void* module, const char* prefix);
using RunFn = RtError (*)(void* function, void** args, size_t num_args);
using ErrorStringFn = const char* (*)(RtError error);
using CudaErrorStringFn = const char* (*)(int error);

struct Runtime {
  ModuleCreateFn module_create = nullptr;
  GetFunctionFn get_function = nullptr;
  RunFn run = nullptr;
  ErrorStringFn error_string = nullptr;
};

std::mutex g_mutex;
std::string g_runtime_path;  // guarded by g_mutex
Runtime g_runtime;           // written once under g_mutex, then read-only
bool g_runtime_loaded = false;
std::unordered_map<std::string, void*> g_functions;  // sha256 of the object -> function

ffi::ErrorOr<const Runtime*> LoadRuntimeLocked() {
  if (g_runtime_loaded) return &g_runtime;
  if (g_runtime_path.empty()) {
    return ffi::Unexpected(ffi::Error::Internal(
        "jax_sm100: the CuTe DSL runtime path was never set; import jax_sm100 (its ffi module "
        "registers the handler and the path) before running a compiled function"));
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
  rt.run = reinterpret_cast<RunFn>(dlsym(lib, "CuteDSLRT_Function_Run"));
  rt.error_string = reinterpret_cast<ErrorStringFn>(dlsym(lib, "CuteDSLRT_GetErrorString"));
  if (!rt.module_create || !rt.get_function || !rt.run || !rt.error_string) {
    return ffi::Unexpected(ffi::Error::Internal(
        "jax_sm100: " + g_runtime_path +
        " lacks the CuteDSLRT_* entry points; nvidia-cutlass-dsl >= 4.8 is required"));
  }
  g_runtime = rt;
  g_runtime_loaded = true;
  return &g_runtime;
}

std::string RuntimeErrorText(const Runtime* rt, RtError err) {
  const char* s = rt->error_string ? rt->error_string(err) : nullptr;
  return std::string(s ? s : "unknown error") + " (CuteDSLRT error " + std::to_string(err) + ")";
}

std::string CudaErrorText(int code) {
  // libcudart is loaded by JAX's CUDA plugin; use its message when it is visible.
  auto fn = reinterpret_cast<CudaErrorStringFn>(dlsym(RTLD_DEFAULT, "cudaGetErrorString"));
  const char* s = fn ? fn(code) : nullptr;
  return "CUDA error " + std::to_string(code) + (s ? std::string(" (") + s + ")" : "");
}

// Returns the runtime function for `object`, loading the module the first time.
ffi::ErrorOr<void*> GetFunction(std::string_view key, ffi::Span<const uint8_t> object,
                                std::string_view prefix) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_functions.find(std::string(key));
  if (it != g_functions.end()) return it->second;
  auto rt = LoadRuntimeLocked();
  if (rt.has_error()) return ffi::Unexpected(rt.error());
  void* module = nullptr;
  RtError err = (*rt)->module_create(&module, object.begin(), object.size(), nullptr, 0);
  if (err != 0) {
    return ffi::Unexpected(ffi::Error::Internal(
        "jax_sm100: loading the compiled GEMM kernel failed: " + RuntimeErrorText(*rt, err) +
        ". The kernel was built for a different GPU architecture or DSL version than this "
        "process runs; clear the kernel cache and re-trace"));
  }
  void* function = nullptr;
  std::string name(prefix);
  err = (*rt)->get_function(&function, module, name.c_str());
  if (err != 0) {
    return ffi::Unexpected(ffi::Error::Internal("jax_sm100: function '" + name +
                                                "' not found in the compiled kernel: " +
                                                RuntimeErrorText(*rt, err)));
  }
  g_functions.emplace(std::string(key), function);  // modules live until the process exits
  return function;
}

ffi::Error Instantiate(std::string_view key, ffi::Span<const uint8_t> object,
                       std::string_view prefix, ffi::Span<const int64_t>,
                       ffi::Span<const int64_t>) {
  auto fn = GetFunction(key, object, prefix);
  return fn.has_error() ? fn.error() : ffi::Error::Success();
}

// One tensor argument, laid out like the exported header's struct.
class TensorArg {
 public:
  TensorArg(void* data, const int64_t* shapes, int64_t num_shapes, const int64_t* strides,
            int64_t num_strides) {
    const size_t shape_bytes = sizeof(int32_t) * num_shapes;
    const size_t strides_at = (sizeof(void*) + shape_bytes + 7) / 8 * 8;
    storage_.assign((strides_at + sizeof(int64_t) * num_strides + 7) / 8, 0);
    auto* base = reinterpret_cast<unsigned char*>(storage_.data());
    std::memcpy(base, &data, sizeof(void*));
    for (int64_t i = 0; i < num_shapes; ++i) {
      const int32_t v = static_cast<int32_t>(shapes[i]);
      std::memcpy(base + sizeof(void*) + i * sizeof(int32_t), &v, sizeof(v));
    }
    std::memcpy(base + strides_at, strides, sizeof(int64_t) * num_strides);
  }
  void* ptr() { return storage_.data(); }

 private:
  std::vector<int64_t> storage_;  // int64 backing keeps the struct 8-byte aligned
};

ffi::Error Execute(void* stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   std::string_view key, ffi::Span<const uint8_t> object,
                   std::string_view prefix, ffi::Span<const int64_t> dims,
                   ffi::Span<const int64_t> order) {
  auto fn = GetFunction(key, object, prefix);
  if (fn.has_error()) return fn.error();

  // `order` lists, in the kernel's argument order, which buffer each tensor is:
  // i >= 0 is input i, -1 - j is output j.
  std::vector<TensorArg> tensors;
  tensors.reserve(order.size());
  size_t at = 0;
  for (int64_t which : order) {
    void* data = nullptr;
    if (which >= 0) {
      auto buf = args.get<ffi::AnyBuffer>(which);
      if (buf.has_error()) return buf.error();
      data = buf->untyped_data();
    } else {
      auto buf = rets.get<ffi::AnyBuffer>(-1 - which);
      if (buf.has_error()) return buf.error();
      data = (*buf)->untyped_data();
    }
    if (reinterpret_cast<uintptr_t>(data) % 16 != 0) {
      return ffi::Error::InvalidArgument(
          "jax_sm100: a GEMM operand is not 16-byte aligned, which TMA requires");
    }
    if (at + 2 > dims.size()) {
      return ffi::Error::InvalidArgument("jax_sm100: the dims attribute is too short");
    }
    const int64_t ns = dims[at], nt = dims[at + 1];
    if (ns < 0 || nt < 0 || at + 2 + ns + nt > dims.size()) {
      return ffi::Error::InvalidArgument("jax_sm100: the dims attribute is malformed");
    }
    const int64_t* p = dims.begin() + at + 2;
    tensors.emplace_back(data, p, ns, p + ns, nt);
    at += 2 + ns + nt;
  }
  if (at != dims.size()) {
    return ffi::Error::InvalidArgument("jax_sm100: the dims attribute has trailing entries");
  }

  int32_t launch_status = 0;
  std::vector<void*> call_args;
  for (auto& t : tensors) call_args.push_back(t.ptr());
  call_args.push_back(&stream);
  call_args.push_back(&launch_status);
  const Runtime* rt = &g_runtime;
  RtError err = rt->run(*fn, call_args.data(), call_args.size());
  if (err != 0) {
    return ffi::Error::Internal("jax_sm100: running the GEMM kernel failed: " +
                                RuntimeErrorText(rt, err));
  }
  if (launch_status != 0) {
    return ffi::Error::Internal("jax_sm100: launching the GEMM kernel failed with " +
                                CudaErrorText(launch_status) +
                                "; run with compute-sanitizer or CUDA_LAUNCH_BLOCKING=1 to "
                                "locate it");
  }
  return ffi::Error::Success();
}

}  // namespace

extern "C" void JaxSm100_SetRuntimePath(const char* path) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_runtime_loaded) g_runtime_path = path;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSm100GemmInstantiate, Instantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Attr<std::string_view>("key")             // sha256(object)
                                  .Attr<ffi::Span<const uint8_t>>("object")  // kernel object
                                  .Attr<std::string_view>("prefix")          // its function
                                  .Attr<ffi::Span<const int64_t>>("dims")    // unused here
                                  .Attr<ffi::Span<const int64_t>>("order")); // unused here

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSm100GemmExecute, Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()         // XLA's stream
                                  .RemainingArgs()                           // a, b, [c], [bias]
                                  .RemainingRets()                           // d
                                  .Attr<std::string_view>("key")             // sha256(object)
                                  .Attr<ffi::Span<const uint8_t>>("object")  // kernel object
                                  .Attr<std::string_view>("prefix")          // its function
                                  .Attr<ffi::Span<const int64_t>>("dims")    // dynamic extents
                                  .Attr<ffi::Span<const int64_t>>("order"),  // buffer per arg
                              {ffi::Traits::kCmdBufferCompatible});
