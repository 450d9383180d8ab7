// CUDA implementation of marlin::gemm_2_4: checks, device guard, stream, output and fp32
// partials, then the plan and launch of marlin_24.cu. Never synchronises with the host.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "../../gemm_2_4_checks.h"
#include "../marlin_gemm.h"  // stream_locks, max_locks
#include "marlin_24.h"

namespace marlin {
namespace {

// MARLIN_2_4_CUDA=0 switches the kernel off (a CUDA call then raises NotImplementedError), e.g.
// to rule it out when a model misbehaves. On by default since it passed tests/test_gemm_2_4_cuda.py
// and compute-sanitizer on an H100. Read once per process.
bool kernel_enabled() {
  static const bool value = [] {
    const char* env = std::getenv("MARLIN_2_4_CUDA");
    return env == nullptr || *env == '\0' || std::atoi(env) != 0;
  }();
  return value;
}

// Tuning and diagnosis knobs, read on every call (a getenv each) so that one process can compare
// plans: MARLIN_2_4_PLAN=legacy runs the first kernel's plan (8-32-row slices, K parts by fill
// alone through global memory); MARLIN_2_4_PARTS=n forces n K parts where the shape allows;
// MARLIN_2_4_TILE_N=128 or 256 forces the tile width; MARLIN_2_4_WARP_SLICES=1, 2 or 4 forces the
// 32-row warp slices per block where M > 16; MARLIN_2_4_CLUSTERS=0 keeps the K parts out of
// clusters, =1 puts them in clusters wherever they fit; MARLIN_2_4_STAGES=3 takes the 3-stage
// instances at 1-16 rows on the 256-column tile (mma.sync; and the sparse wgmma's 16-row slice,
// which the planner also takes for its one-wave rule: 4 blocks per SM); MARLIN_2_4_PDL=1 launches with
// programmatic dependent launch (sm_90+; off by default: 7B qkv M = 1-16 ran 20% slower with it
// on an H100), MARLIN_PDL=0 (as for gemm) keeps it off; the sparse wgmma instances (sm_90a
// builds on a compute capability 9.0 device) run where plan_24's rule picks them,
// MARLIN_2_4_WGMMA=0 keeps them off, =1 takes them wherever they can run (M > 8, N % 256 == 0;
// MARLIN_2_4_WARP_SLICES=2 then picks 128-row block slices above 64 rows; MARLIN_2_4_WG_LATE=0
// their early-refill variant; MARLIN_2_4_KW=1 or 2 one or two K warpgroups per block on the
// late-refill ones with one warp slice, instead of plan_24's rule); MARLIN_2_4_WAVE8=0 keeps plan_24's
// fill rule at 1-8 rows on many column tiles instead of its three-part rule; MARLIN_LOG_PLAN=1 prints the plan.
int env_or(const char* name, int fallback) {
  const char* env = std::getenv(name);
  return env != nullptr && *env != '\0' ? std::atoi(env) : fallback;
}

bool env_is(const char* name, const char* value) {
  const char* env = std::getenv(name);
  return env != nullptr && std::string(env) == value;
}

at::Tensor gemm_2_4_cuda(const at::Tensor& a, const at::Tensor& b_q, const at::Tensor& b_meta, const at::Tensor& b_scales,
                         const std::optional<at::Tensor>& workspace, const std::optional<at::Tensor>& b_zeros) {
  const Gemm24Shape sh = check_gemm_2_4_args(a, b_q, b_meta, b_scales, workspace, b_zeros);
  TORCH_CHECK_NOT_IMPLEMENTED(kernel_enabled(), "marlin.gemm_2_4: the CUDA kernel is switched off by MARLIN_2_4_CUDA=0; "
                              "unset it to use the kernel, or call the op on CPU tensors");
  const c10::cuda::OptionalCUDAGuard guard(a.device());
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(prop->major >= 8, "marlin.gemm_2_4: needs a GPU of compute capability 8.0 or newer (sparse tensor cores); ",
              prop->name, " is ", num(prop->major), ".", num(prop->minor));
  TORCH_CHECK(sh.m <= (int64_t{1} << 30) && sh.k <= (int64_t{1} << 30) && sh.n <= (int64_t{1} << 30),
              "marlin.gemm_2_4: dimensions beyond 2^30 are not supported");

  at::Tensor c = at::empty({sh.m, sh.n}, a.options());
  if (sh.m == 0) return c;

  // 16-byte copies of the rows of `a`: last dim contiguous, rows 16-byte aligned.
  at::Tensor a_use = a;
  const bool a_ok = a.stride(1) == 1 && a.stride(0) % 8 == 0 && a.stride(0) >= sh.k &&
                    reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0;
  if (!a_ok) a_use = a.contiguous();
  if (reinterpret_cast<uintptr_t>(a_use.data_ptr()) % 16 != 0) a_use = a.clone();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(b_q.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(b_meta.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(b_scales.data_ptr()) % 16 == 0 &&
                  (!b_zeros.has_value() || reinterpret_cast<uintptr_t>(b_zeros->data_ptr()) % 16 == 0),
              "marlin.gemm_2_4: b_q, b_meta, b_scales and b_zeros must be 16-byte aligned (got a view with an offset?)");

  sparse24::Args24 args;
  args.a = a_use.data_ptr();
  args.b_q = b_q.data_ptr();
  args.b_meta = b_meta.data_ptr();
  args.s = b_scales.data_ptr();
  args.z = b_zeros.has_value() ? b_zeros->data_ptr() : nullptr;
  args.c = c.data_ptr();
  args.m = static_cast<int>(sh.m);
  args.n = static_cast<int>(sh.n);
  args.k = static_cast<int>(sh.k);
  args.lda = a_use.stride(0);
  args.bf16 = a.scalar_type() == at::kBFloat16;
  args.groups = static_cast<int>(sh.groups);
  args.sms = prop->multiProcessorCount;
  args.max_smem = static_cast<int>(prop->sharedMemPerBlockOptin);
  args.pdl = prop->major >= 9 && env_or("MARLIN_2_4_PDL", 0) == 1 && env_or("MARLIN_PDL", 1) != 0;
  args.clusters = prop->major >= 9;
  const int wgmma_env = env_or("MARLIN_2_4_WGMMA", -1);
  args.wgmma = kBuiltWithSm90a && prop->major == 9 && prop->minor == 0 && wgmma_env != 0;
  args.wgmma_force = wgmma_env == 1;
  args.wg_late = env_or("MARLIN_2_4_WG_LATE", 1) != 0;
  args.legacy = env_is("MARLIN_2_4_PLAN", "legacy");
  args.force_parts = env_or("MARLIN_2_4_PARTS", 0);
  args.force_tile_n = env_or("MARLIN_2_4_TILE_N", 0);
  args.force_ms = env_or("MARLIN_2_4_WARP_SLICES", 0);
  TORCH_CHECK(args.force_ms == 0 || args.force_ms == 1 || args.force_ms == 2 || args.force_ms == 4,
              "marlin.gemm_2_4: MARLIN_2_4_WARP_SLICES = ", num(args.force_ms), ", expected 1, 2 or 4 (unset: the planner's choice)");
  args.cluster_mode = env_or("MARLIN_2_4_CLUSTERS", -1);
  args.force_stages = env_or("MARLIN_2_4_STAGES", 0);
  args.force_kw = env_or("MARLIN_2_4_KW", 0);
  args.wave8 = env_or("MARLIN_2_4_WAVE8", 1) != 0;
  args.prefill = env_or("MARLIN_PREFILL", -1);
  args.prefill_split = env_or("MARLIN_PREFILL_SPLIT", 0);
  args.prefill_lead = env_or("MARLIN_PREFILL_LEAD", -1);
  args.prefill_fast_sum = env_or("MARLIN_PREFILL_FAST_SUM", 1) != 0;
  args.prefill_rows = env_or("MARLIN_PREFILL_ROWS", 0);
  TORCH_CHECK(args.prefill_rows == 0 || args.prefill_rows == 128 || args.prefill_rows == 256,
              "marlin.gemm_2_4: MARLIN_PREFILL_ROWS = ", num(args.prefill_rows), ", expected 128 or 256 (unset: the planner's rule)");
  TORCH_CHECK(args.force_kw == 0 || args.force_kw == 1 || args.force_kw == 2,
              "marlin.gemm_2_4: MARLIN_2_4_KW = ", num(args.force_kw), ", expected 1 or 2 (unset: the planner's choice)");

  sparse24::Plan24 plan;
  const std::string why = sparse24::plan_24(args, &plan);
  TORCH_CHECK(why.empty(), why);
  if (env_or("MARLIN_LOG_PLAN", 0) == 1) std::fprintf(stderr, "marlin.gemm_2_4 plan: %s\n", sparse24::describe_24(args, plan).c_str());
  // K split: fp32 partials, and one arrival counter per column tile and slice, as for gemm: the
  // workspace if given, else the stream's own zeroed lock slot (no allocation, graph-safe), else
  // a zeroed buffer. The kernel leaves the counters at zero.
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor partial, locks;
  args.partial = nullptr;
  args.locks = nullptr;
  if (plan.partial_floats > 0) {
    partial = at::empty({plan.partial_floats}, a.options().dtype(at::kFloat));
    args.partial = partial.data_ptr<float>();
    if (workspace.has_value()) {
      TORCH_CHECK(workspace->numel() >= plan.locks, "marlin.gemm_2_4: workspace.numel() = ", num(workspace->numel()),
                  ", expected at least ", num(plan.locks), " (marlin.ops.workspace_size(device) always suffices)");
      args.locks = workspace->data_ptr<int>();
    } else {
      args.locks = stream_locks(a.get_device(), stream, max_locks(args.sms));
      if (args.locks == nullptr) {
        locks = at::zeros({max_locks(args.sms)}, a.options().dtype(at::kInt));
        args.locks = locks.data_ptr<int>();
      }
    }
  }
  const cudaError_t err = sparse24::launch_24(args, plan, stream);
  TORCH_CHECK(err == cudaSuccess, "marlin.gemm_2_4: kernel launch failed: ", cudaGetErrorString(err));
  return c;
}

}  // namespace

TORCH_LIBRARY_IMPL(marlin, CUDA, m) { m.impl("gemm_2_4", &gemm_2_4_cuda); }

}  // namespace marlin
