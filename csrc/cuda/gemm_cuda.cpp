// CUDA implementation of marlin::gemm: checks, device guard, stream, buffers, then the kernel
// plan and launch from marlin_gemm.cu. Never synchronises with the host.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "../gemm_checks.h"
#include "marlin_gemm.h"

namespace marlin {
namespace {

// Run-time knobs for tuning, tests and debugging (README, "Run-time knobs"); not part of the API.
// Each is read once per process, at the first call.
int env_int(const char* name, int unset) {
  const char* env = std::getenv(name);
  return env ? std::atoi(env) : unset;
}

struct Knobs {
  int blocks_per_sm;          // MARLIN_BLOCKS_PER_SM=1 caps resident blocks per multiprocessor (0: as many as fit)
  bool wgmma;                 // MARLIN_WGMMA=0 keeps the sm_90a (wgmma) kernels off, so that the mma.sync
                              // kernels can be measured and tested on Hopper too
  bool pdl;                   // MARLIN_PDL=0 launches without programmatic dependent launch (sm_90+)
  int split_mode;             // MARLIN_SPLIT=0 stream-K stripes only; 1 the planner's choice; 2 and 3
                              // force split parts (GemmArgs::split_mode)
  int wg_slice_rows;          // MARLIN_WG_SLICE=64 or 128 forces the wgmma variant's slices above 64 rows
  bool g128_runtime_group;    // MARLIN_G128_RG=0 keeps fp16 group 128 at 9-16 rows (wgmma) on the
                              // group-sum instance
  bool group_sums;            // MARLIN_GROUP_SUMS=0 keeps zero points and bf16 in groups of 128, and groups of
                              // 64 / 32, at <= 8 rows on the run-time-group instances instead of the raw group-sum ones
  bool fmt_fixed_g128;        // MARLIN_FMT_G128=0 keeps zero points in groups of 128 on the wgmma slices on
                              // the run-time-group instances instead of the fixed-group-128 ones
  bool one_block_regs;        // MARLIN_ONE_BLOCK_REGS=0 keeps the 8-row mma.sync instances at their
                              // 128-register bound (built for two blocks per SM) where the plan keeps one
  bool small_layer_clusters;  // MARLIN_SMALL_LAYER_CLUSTERS=0 keeps layers under 80 KB of weights per SM
                              // at 9-64 rows (wgmma) on the tiled kernel
  bool cluster_fit;           // MARLIN_CLUSTER_FIT=0 keeps split columns that do not fit as resident
                              // clusters on a global reduction instead of fewer parts that do
  int max_split_parts;        // MARLIN_SPLIT_PARTS=N caps the split parts per column (0: the planner's)
  int wg_tile_n;              // MARLIN_WG_TILE_N=128 or 256 forces the wgmma variant's fp16 group-128 tile
                              // (128 wherever it can run; 256: never the 128-column one)
  bool wg16_narrow_two;       // MARLIN_WG16_NARROW_TWO=0: fp16 group 128 at 9-16 rows (wgmma) keeps the
                              // 256-column tile, and MARLIN_WG_TILE_N=128 takes the one-block 128-column one
                              // there (GemmArgs::wg16_narrow_two)
  int prefill;                // MARLIN_PREFILL=0 keeps large batches off the prefill kernel; 1 runs it
                              // wherever it can above 64 rows (default -1: the planner's rule)
  int prefill_split;          // MARLIN_PREFILL_SPLIT=P: the prefill kernel splits K in P parts; -1: stream-K (probes)
  int prefill_rows;           // MARLIN_PREFILL_ROWS=128 or 256 forces the prefill kernel's tile height (probes)
  int prefill_lead;           // MARLIN_PREFILL_LEAD=n: a K split's last part takes n stages more (0: equal parts)
  bool prefill_fast_sum;      // MARLIN_PREFILL_FAST_SUM=0: the split's last part never adds the others' partials itself
  bool log_plan;              // MARLIN_LOG_PLAN=1 prints each call's plan (kernel, tile, partition) to stderr
};

const Knobs& knobs() {
  static const Knobs k{env_int("MARLIN_BLOCKS_PER_SM", 0),
                       env_int("MARLIN_WGMMA", 1) != 0,
                       env_int("MARLIN_PDL", 1) != 0,
                       env_int("MARLIN_SPLIT", 1),
                       env_int("MARLIN_WG_SLICE", 0),
                       env_int("MARLIN_G128_RG", 1) != 0,
                       env_int("MARLIN_GROUP_SUMS", 1) != 0,
                       env_int("MARLIN_FMT_G128", 1) != 0,
                       env_int("MARLIN_ONE_BLOCK_REGS", 1) != 0,
                       env_int("MARLIN_SMALL_LAYER_CLUSTERS", 1) != 0,
                       env_int("MARLIN_CLUSTER_FIT", 1) != 0,
                       env_int("MARLIN_SPLIT_PARTS", 0),
                       env_int("MARLIN_WG_TILE_N", 0),
                       env_int("MARLIN_WG16_NARROW_TWO", 1) != 0,
                       env_int("MARLIN_PREFILL", -1),
                       env_int("MARLIN_PREFILL_SPLIT", 0),
                       env_int("MARLIN_PREFILL_ROWS", 0),
                       env_int("MARLIN_PREFILL_LEAD", -1),
                       env_int("MARLIN_PREFILL_FAST_SUM", 1) != 0,
                       env_int("MARLIN_LOG_PLAN", 0) == 1};
  return k;
}

// Peak DRAM bandwidth of `device` in GB/s (2 x memory clock x bus width: DDR), read once per
// device (the attributes are fixed; cudaDeviceProp lost its memory clock in CUDA 13). 0 where the
// driver does not report them: the planner then keeps its H100 lines.
double peak_dram_gbps(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<double> cache[kMaxDevices];  // 0: not read yet (a race reads it twice, alike)
  if (device < 0 || device >= kMaxDevices) return 0;
  double v = cache[device].load(std::memory_order_relaxed);
  if (v > 0) return v;
  int khz = 0, bits = 0;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; leave no error for the next launch check
    return 0;
  }
  v = 2.0 * khz * 1e3 * (bits / 8) / 1e9;
  if (v > 0) cache[device].store(v, std::memory_order_relaxed);
  return v;
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
  args.dram_gbps = peak_dram_gbps(a.get_device());
  args.max_smem = static_cast<int>(prop->sharedMemPerBlockOptin);
  args.max_smem_per_sm = static_cast<int>(prop->sharedMemPerMultiprocessor);
  args.blocks_per_sm = knobs().blocks_per_sm;
  // sm_90a code runs on compute capability 9.0 only (H100, H200), and only if it was built
  args.wgmma = kBuiltWithSm90a && prop->major == 9 && prop->minor == 0 && knobs().wgmma;
  args.pdl = prop->major >= 9 && knobs().pdl;
  args.split_mode = knobs().split_mode;
  args.clusters = prop->major >= 9;
  args.cluster_fit = knobs().cluster_fit;
  args.max_split_parts = knobs().max_split_parts;
  args.wg_slice_rows = knobs().wg_slice_rows;
  args.wg_tile_n = knobs().wg_tile_n;
  args.wg16_narrow_two = knobs().wg16_narrow_two;
  args.g128_runtime_group = knobs().g128_runtime_group;
  args.group_sums = knobs().group_sums;
  args.fmt_fixed_g128 = knobs().fmt_fixed_g128;
  args.one_block_regs = knobs().one_block_regs;
  args.small_layer_clusters = knobs().small_layer_clusters;
  args.prefill = knobs().prefill;
  args.prefill_split = knobs().prefill_split;
  args.prefill_rows = knobs().prefill_rows;
  args.prefill_lead = knobs().prefill_lead;
  args.prefill_fast_sum = knobs().prefill_fast_sum;
  TORCH_CHECK(args.prefill_rows == 0 || args.prefill_rows == 128 || args.prefill_rows == 256,
              "marlin.gemm: MARLIN_PREFILL_ROWS = ", num(args.prefill_rows), ", expected 128 or 256 (unset: the planner's rule)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(args.b_q) % 16 == 0 && reinterpret_cast<uintptr_t>(args.scales) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(args.zeros) % 16 == 0,
              "marlin.gemm: b_q, b_scales and b_zeros must be 16-byte aligned (got a view with an offset?)");

  GemmPlan plan;
  const std::string why = plan_gemm(args, tile_k.value_or(0), tile_n.value_or(0), &plan);
  TORCH_CHECK(why.empty(), why);
  if (knobs().log_plan) std::fprintf(stderr, "marlin.gemm plan: %s\n", describe_plan(args, plan).c_str());

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
