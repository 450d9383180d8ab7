// Lock counters for calls made without a workspace (torch.ops.marlin.gemm(..., workspace=None)).
//
// The kernels use the locks as arrival counters of split columns and leave them at zero, so one
// zeroed buffer can serve every call of a stream: calls of one stream run in order (a
// programmatically dependent launch waits for the previous kernel before it touches the locks).
// Two streams must not share one. Allocating and zeroing a buffer per call cost 1-3.4 us per call
// at M = 16 on an H100 (an allocation, a memset launch, and a broken launch-overlap chain), so each
// (device, stream) gets its own slot of a statically allocated device array instead.
//
// Static __device__ memory is zero when the module loads and needs no allocation or memset, so
// taking a slot is safe during CUDA-graph capture too (a buffer allocated and memset inside a
// capture would only be zeroed when the graph replays). A graph captured on a stream keeps using
// that stream's slot; replaying it on another stream while the first one runs gemm calls is the
// same hazard as sharing a workspace between streams.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

#include "marlin_gemm.h"

namespace marlin {
namespace {

constexpr int kSlots = 64;           // streams per device with their own slot
constexpr int kLocksPerSlot = 1024;  // >= max_locks(sms) for any GPU up to 512 SMs

__device__ int g_stream_locks[kSlots][kLocksPerSlot];

}  // namespace

int* stream_locks(int device, cudaStream_t stream, int needed) {
  if (needed > kLocksPerSlot) return nullptr;
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, int> slot_of;  // (device, stream) -> slot
  static std::map<int, int> used;                               // device -> slots handed out
  int slot;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto key = std::make_pair(device, stream);
    const auto it = slot_of.find(key);
    if (it != slot_of.end()) {
      slot = it->second;
    } else {
      if (used[device] >= kSlots) return nullptr;
      slot = used[device]++;
      slot_of.emplace(key, slot);
    }
  }
  void* base = nullptr;
  if (cudaGetSymbolAddress(&base, g_stream_locks) != cudaSuccess) {
    cudaGetLastError();  // leave no sticky error behind; the caller allocates instead
    return nullptr;
  }
  return static_cast<int*>(base) + static_cast<long long>(slot) * kLocksPerSlot;
}

}  // namespace marlin
