// Plan and launch of the 2:4-sparse kernel (marlin_24_kernel.cuh): slice size, K split, grid.
#include <algorithm>
#include <atomic>

#include "marlin_24.h"
#include "marlin_24_kernel.cuh"

namespace marlin {
namespace sparse24 {
namespace {

constexpr int kStages = 4;

template <int MB, int NW>
constexpr int smem_bytes() {
  return kStages * Shape<MB, NW>::kStageInt4 * 16;
}

int smem_of(int mb, int nw) {
  if (nw == 4) return mb == 1 ? smem_bytes<1, 4>() : mb == 2 ? smem_bytes<2, 4>() : smem_bytes<4, 4>();
  return mb == 1 ? smem_bytes<1, 2>() : mb == 2 ? smem_bytes<2, 2>() : smem_bytes<4, 2>();
}

// Opts the instance in to its shared memory and returns its resident blocks per SM (registers
// and shared memory), at least 1; once per device and instance (the attribute stays set).
template <int MB, int NW>
int prepare_instance(int smem) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // 0: not yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  if (device < kMaxDevices && cache[device].load() > 0) return cache[device].load();
  auto kernel = marlin_24_kernel<MB, NW, kStages>;
  int blocks = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, Shape<MB, NW>::kThreads, smem) != cudaSuccess)
    return 0;  // the launch will report the error
  blocks = std::max(blocks, 1);
  if (device < kMaxDevices) cache[device].store(blocks);
  return blocks;
}

int prepare_instance_of(int mb, int nw, int smem) {
  if (nw == 4) return mb == 1 ? prepare_instance<1, 4>(smem) : mb == 2 ? prepare_instance<2, 4>(smem) : prepare_instance<4, 4>(smem);
  return mb == 1 ? prepare_instance<1, 2>(smem) : mb == 2 ? prepare_instance<2, 2>(smem) : prepare_instance<4, 2>(smem);
}

template <int MB, int NW>
cudaError_t launch_mb(const Params& p, const Plan24& plan, cudaStream_t stream) {
  // (plan_24 opted the instance in to its shared memory on this device)
  auto kernel = marlin_24_kernel<MB, NW, kStages>;
  const dim3 grid(p.n / Shape<MB, NW>::kTileN, p.parts, plan.slices);
  kernel<<<grid, Shape<MB, NW>::kThreads, plan.smem, stream>>>(p);
  return cudaGetLastError();
}

template <int NW>
cudaError_t launch_nw(const Params& p, const Plan24& plan, cudaStream_t stream) {
  switch (plan.mb) {
    case 1: return launch_mb<1, NW>(p, plan, stream);
    case 2: return launch_mb<2, NW>(p, plan, stream);
    default: return launch_mb<4, NW>(p, plan, stream);
  }
}

}  // namespace

std::string plan_24(const Args24& args, Plan24* plan) {
  // rows per slice: the smallest of 8, 16, 32 that holds M (larger M: several 32-row slices)
  plan->mb = args.m <= 8 ? 1 : args.m <= 16 ? 2 : 4;
  const int rows = 8 * plan->mb;
  plan->slices = (args.m + rows - 1) / rows;
  if (plan->slices > 65535)
    return "marlin.gemm_2_4: M = " + std::to_string(args.m) + " needs more than 65535 slices of " + std::to_string(rows) +
           " rows (split the batch)";
  // tile: 256 columns (4 warps) where N allows, else 128 (2 warps)
  plan->nw = args.n % 256 == 0 ? 4 : 2;
  plan->smem = smem_of(plan->mb, plan->nw);
  if (plan->smem > args.max_smem)
    return "marlin.gemm_2_4: the kernel needs " + std::to_string(plan->smem) + " bytes of shared memory per block, the device allows " +
           std::to_string(args.max_smem);
  if (args.n % 128 != 0) return "marlin.gemm_2_4: N = " + std::to_string(args.n) + " is not a multiple of 128";
  // Split K into parts so that the blocks fill the resident slots of the GPU in whole waves (a
  // block streams its weights at about the same rate wherever it runs, so a partial last wave
  // leaves SMs idle): among 1..16 parts, the one with the best fill, the fewest on a tie. Each
  // part keeps at least 2 stages, and with fewer blocks than SMs more parts always pay.
  const long long base = static_cast<long long>(args.n / (64 * plan->nw)) * plan->slices;
  const int k_tiles = args.k / kStageK;
  const int per_sm = prepare_instance_of(plan->mb, plan->nw, plan->smem);
  if (per_sm == 0) return "marlin.gemm_2_4: could not set up the kernel instance (cudaFuncSetAttribute / occupancy query failed)";
  const long long slots = static_cast<long long>(args.sms) * per_sm;
  int best = 1;
  double best_fill = 0.0;
  // (and at most max_locks = 2 per SM arrival counters: base <= 2 SMs to split at all)
  for (int parts = 1; parts <= (base <= 2LL * args.sms ? std::min(16, k_tiles) : 1); parts++) {
    if (parts > 1 && k_tiles / parts < 2) break;
    const long long blocks = base * parts;
    const long long waves = (blocks + slots - 1) / slots;
    // fill of the slots over the waves; below one block per SM, fewer blocks than SMs is worse
    double fill = static_cast<double>(blocks) / static_cast<double>(waves * slots);
    if (blocks < args.sms) fill *= 0.5;
    if (fill > best_fill + 0.02) best = parts, best_fill = fill;
  }
  plan->parts = best;
  plan->partial_floats = plan->parts > 1 ? static_cast<long long>(plan->parts) * args.m * args.n : 0;
  plan->locks = plan->parts > 1 ? static_cast<int>(base) : 0;
  return "";
}

cudaError_t launch_24(const Args24& args, const Plan24& plan, cudaStream_t stream) {
  Params p;
  p.a = static_cast<const int4*>(args.a);
  p.b_q = static_cast<const int4*>(args.b_q);
  p.b_meta = static_cast<const int4*>(args.b_meta);
  p.s = static_cast<const int4*>(args.s);
  p.c = static_cast<half*>(args.c);
  p.partial = args.partial;
  p.m = args.m;
  p.n = args.n;
  p.k = args.k;
  p.lda_int4 = args.lda / 8;
  p.groups = args.groups;
  p.parts = plan.parts;
  p.locks = args.locks;
  return plan.nw == 4 ? launch_nw<4>(p, plan, stream) : launch_nw<2>(p, plan, stream);
}

}  // namespace sparse24
}  // namespace marlin
