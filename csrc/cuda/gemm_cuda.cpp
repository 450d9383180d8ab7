// CUDA implementation of marlin::gemm: checks, device guard, stream, buffers, then the kernel
// plan and launch from marlin_gemm.cu. Never synchronises with the host.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "../gemm_checks.h"
#include "marlin_gemm.h"

namespace marlin {
namespace {

// Run-time knobs for tuning, tests and debugging (README, "Run-time knobs"); not part of the API.
// Each is read once per process, at its first use.
int env_int(const char* name, int unset) {
  const char* env = std::getenv(name);
  return env ? std::atoi(env) : unset;
}

// MARLIN_BLOCKS_PER_SM=1 caps resident blocks per multiprocessor (0: as many as fit).
int tuning_blocks_per_sm() {
  static const int value = env_int("MARLIN_BLOCKS_PER_SM", 0);
  return value;
}

// MARLIN_WGMMA=0 keeps the sm_90a (wgmma) kernels off, so that the mma.sync kernels can be
// measured and tested on Hopper too.
bool tuning_wgmma_allowed() {
  static const bool value = env_int("MARLIN_WGMMA", 1) != 0;
  return value;
}

// MARLIN_PDL=0 launches without programmatic dependent launch (sm_90+), which is on by default.
bool tuning_pdl_allowed() {
  static const bool value = env_int("MARLIN_PDL", 1) != 0;
  return value;
}

// MARLIN_SPLIT=0 keeps the small-batch kernel on stream-K stripes; 1 (default) the planner's
// choice; 2 and 3 force split parts (see GemmArgs::split_mode).
int tuning_split_mode() {
  static const int value = env_int("MARLIN_SPLIT", 1);
  return value;
}

// MARLIN_WG_SLICE=64 or 128 forces the wgmma variant's slices above 64 rows (default: the
// planner's choice).
int tuning_wg_slice_rows() {
  static const int value = env_int("MARLIN_WG_SLICE", 0);
  return value;
}

// MARLIN_G128_RG=0 keeps fp16 group 128 at 9-16 rows (wgmma) on the group-sum instance.
bool tuning_g128_runtime_group() {
  static const bool value = env_int("MARLIN_G128_RG", 1) != 0;
  return value;
}

// MARLIN_ZP_SUMS=0 keeps fp16 zero points in groups of 128 at <= 8 rows (mma.sync) on the
// run-time-group instance instead of the raw group-sum one.
bool tuning_zp_sums() {
  static const bool value = env_int("MARLIN_ZP_SUMS", 1) != 0;
  return value;
}

// MARLIN_SMALL_LAYER_CLUSTERS=0 keeps layers under 80 KB of weights per SM at 9-64 rows (wgmma)
// on the tiled kernel, even where the small-batch kernel's plan reduces its columns in clusters.
bool tuning_small_layer_clusters() {
  static const bool value = env_int("MARLIN_SMALL_LAYER_CLUSTERS", 1) != 0;
  return value;
}

// MARLIN_PREFILL=0 keeps large batches off the prefill kernel; 1 runs it wherever it can above 64
// rows (default: the planner's rule, GemmArgs::prefill).
int tuning_prefill() {
  static const int value = env_int("MARLIN_PREFILL", -1);
  return value;
}

// MARLIN_LOG_PLAN=1 prints each call's plan (kernel, tile, partition) to stderr.
bool log_plan() {
  static const bool value = env_int("MARLIN_LOG_PLAN", 0) == 1;
  return value;
}

at::Tensor gemm_cuda(const at::Tensor& a, const at::Tensor& b_q, const at::Tensor& b_scales,
                     const std::optional<at::Tensor>& b_zeros, const std::optional<at::Tensor>& workspace,
                     std::optional<int64_t> tile_k, std::optional<int64_t> tile_n, int64_t bits) {
  const GemmShape sh = check_gemm_args(a, b_q, b_scales, b_zeros, workspace, tile_k, tile_n, bits);
  // Every format and shape of the schema runs (the planner picks an instance from marlin_gemm.cu's
  // table; K multiples of 64 but not 128 take the 64 x 256 tile, N multiples of 64 a partial last
  // tile). b_zeros are used as given (integers 0..15 by the format; the CPU reference checks them,
  // a check here would cost a device synchronisation).
  const c10::cuda::OptionalCUDAGuard guard(a.device());
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(prop->major >= 8, "marlin.gemm: needs a GPU of compute capability 8.0 or newer (Ampere+), but ",
              prop->name, " is ", num(prop->major), ".", num(prop->minor));
  TORCH_CHECK(sh.m <= (int64_t{1} << 30) && sh.k <= (int64_t{1} << 30) && sh.n <= (int64_t{1} << 30),
              "marlin.gemm: dimensions beyond 2^30 are not supported (M = ", num(sh.m), ", K = ", num(sh.k), ", N = ",
              num(sh.n), ")");

  at::Tensor c = at::empty({sh.m, sh.n}, a.options());
  if (sh.m == 0) return c;

  // The kernel streams rows of `a` with 16-byte copies: last dim contiguous, rows 16-byte aligned.
  at::Tensor a_use = a;
  const bool a_ok = a.stride(1) == 1 && a.stride(0) % 8 == 0 && a.stride(0) >= sh.k &&
                    reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0;
  if (!a_ok) a_use = a.contiguous();
  if (reinterpret_cast<uintptr_t>(a_use.data_ptr()) % 16 != 0) a_use = a.clone();

  GemmArgs args;
  args.a = a_use.data_ptr();
  args.b_q = b_q.data_ptr();
  args.scales = b_scales.data_ptr();
  args.zeros = sh.has_zeros ? b_zeros->data_ptr() : nullptr;
  args.c = c.data_ptr();
  args.bf16 = sh.dtype == at::kBFloat16;
  args.bits = static_cast<int>(sh.bits);
  args.m = static_cast<int>(sh.m);
  args.n = static_cast<int>(sh.n);
  args.k = static_cast<int>(sh.k);
  args.lda = a_use.stride(0);
  args.groups = static_cast<int>(sh.groups);
  args.sms = prop->multiProcessorCount;
  args.max_smem = static_cast<int>(prop->sharedMemPerBlockOptin);
  args.max_smem_per_sm = static_cast<int>(prop->sharedMemPerMultiprocessor);
  args.blocks_per_sm = tuning_blocks_per_sm();
  // sm_90a code runs on compute capability 9.0 only (H100, H200), and only if it was built
  args.wgmma = kBuiltWithSm90a && prop->major == 9 && prop->minor == 0 && tuning_wgmma_allowed();
  args.pdl = prop->major >= 9 && tuning_pdl_allowed();
  args.split_mode = tuning_split_mode();
  args.clusters = prop->major >= 9;
  args.wg_slice_rows = tuning_wg_slice_rows();
  args.g128_runtime_group = tuning_g128_runtime_group();
  args.zp_sums = tuning_zp_sums();
  args.small_layer_clusters = tuning_small_layer_clusters();
  args.prefill = tuning_prefill();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(args.b_q) % 16 == 0 && reinterpret_cast<uintptr_t>(args.scales) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(args.zeros) % 16 == 0,
              "marlin.gemm: b_q, b_scales and b_zeros must be 16-byte aligned (got a view with an offset?)");

  GemmPlan plan;
  const std::string why = plan_gemm(args, tile_k.value_or(0), tile_n.value_or(0), &plan);
  TORCH_CHECK(why.empty(), why);
  if (log_plan()) std::fprintf(stderr, "marlin.gemm plan: %s\n", describe_plan(args, plan).c_str());

  // The locks count the blocks of a column reduced through global memory (plan.needs_partial);
  // plans whose columns are reduced in clusters or owned by one block never touch them. Without
  // a workspace, the stream's own zeroed slot of static device memory is used (stream_locks.cu):
  // no allocation, no memset launch between two programmatically dependent gemm launches, and
  // safe under graph capture. Only if every slot is taken is a zeroed buffer allocated.
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor locks;
  args.locks = nullptr;
  if (workspace.has_value()) {
    TORCH_CHECK(workspace->numel() >= plan.locks, "marlin.gemm: workspace.numel() = ", num(workspace->numel()),
                ", expected at least ", num(plan.locks), " (marlin.ops.workspace_size(device) always suffices)");
    args.locks = workspace->data_ptr<int>();
  } else if (plan.needs_partial) {
    args.locks = stream_locks(a.get_device(), stream, max_locks(args.sms));
    if (args.locks == nullptr) {
      locks = at::zeros({max_locks(args.sms)}, a.options().dtype(at::kInt));
      args.locks = locks.data_ptr<int>();
    }
  }
  at::Tensor partial;
  if (plan.needs_partial) {
    partial = at::empty({static_cast<int64_t>(plan.partial_floats)}, a.options().dtype(at::kFloat));
    args.partial = partial.data_ptr<float>();
  } else {
    args.partial = nullptr;
  }

  const std::string err = launch_gemm(args, plan, stream);
  TORCH_CHECK(err.empty(), err);
  return c;
}

}  // namespace

TORCH_LIBRARY_IMPL(marlin, CUDA, m) { m.impl("gemm", &gemm_cuda); }

}  // namespace marlin
