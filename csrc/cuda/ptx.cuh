// Thin wrappers around the PTX instructions the kernel is built from (sm_80+).
// Each is a single asm statement so that the compiler cannot separate a value from its use.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace marlin {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy that bypasses L1. When `valid` is false nothing is read and the
// 16 bytes are zero-filled (src-size 0), which pads activation rows past M.
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}

// 16-byte copy with an L2 evict-first policy: weights are read exactly once, so they should not
// push activations (re-read by every block of a row of tiles) out of L2. The policy is created in
// the same asm statement as its use: the published kernel kept it in a C++ variable across
// statements and ptxas dropped the register in one instance ("illegal instruction").
// tests/test_gemm_cuda.py runs every kernel instance, and scripts/check_sass.py inspects SASS.
__device__ __forceinline__ void cp_async16_evict_first(void* smem, const void* gmem) {
  asm volatile(
      "{\n"
      "  .reg .b64 pol;\n"
      "  createpolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
      "  cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, pol;\n"
      "}\n" ::"r"(smem_addr(smem)),
      "l"(gmem));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Programmatic dependent launch (sm_90+). When the host launched this grid with
// cudaLaunchAttributeProgrammaticStreamSerialization, it may start while the previous kernel of
// the stream is still running: grid_dependency_wait() blocks until that kernel has finished and
// its writes are visible. launch_dependents() lets the next such kernel be scheduled now (its
// blocks take SMs as ours exit). Both are no-ops without the attribute and before sm_90.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The arrival counter of a split column's last-arriver reduction: adds 1 and returns the old
// value, as one acquire-release operation at GPU scope. Called by one thread after a
// __syncthreads(), it publishes the partial that its whole block stored before the barrier
// (release is cumulative over what the barrier ordered before it), and if this block is the last
// to arrive, the block's reads after the next __syncthreads() see every other block's partial
// (acquire). This replaces a full fence (fence.sc.gpu) in every thread before and after the
// counter, the pattern of CUTLASS's stream-K barrier.
__device__ __forceinline__ int arrive_acq_rel_gpu(int* counter) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

// A counter's value, read with acquire semantics at GPU scope (what the releases it observed
// published is visible after it; to the whole block after a barrier).
__device__ __forceinline__ int load_acquire_gpu(const int* counter) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
  return v;
}

// The end of a split column's arrival, for the whole block: every thread has stored its share of
// the block's fp32 partial. Returns, in every thread, whether this block is the last of `parts`
// to arrive on `counter`; if so its reads after the call see every other block's partial, and it
// has reset the counter to zero for the next call (the kernels leave the workspace zeroed).
__device__ __forceinline__ bool last_to_arrive(int* counter, int parts) {
  __shared__ int arrived;  // one per block: thread 0's answer for the others
  __syncthreads();         // the partial is stored: thread 0's release publishes all of it
  if (threadIdx.x == 0) {
    arrived = arrive_acq_rel_gpu(counter);
    if (arrived == parts - 1) *counter = 0;
  }
  __syncthreads();  // after thread 0's acquire: the other blocks' partials are visible to all
  return arrived == parts - 1;
}

// Asks L2 for the 128-byte line at `gmem`. Only a hint: it returns no data, so it is correct even
// while another kernel still writes there.
__device__ __forceinline__ void prefetch_l2(const void* gmem) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(gmem));
}

// Thread-block clusters (sm_90+; the planner uses them only there, elsewhere these trap).
// cluster_sync(): every thread of every block of the cluster arrives, with release semantics for
// its earlier shared-memory writes, and waits for all the others (acquire).
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

// The address in block `rank` of this cluster of what `addr` is in this block's shared memory.
__device__ __forceinline__ uint32_t cluster_map(uint32_t addr, uint32_t rank) {
  uint32_t out = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(addr), "r"(rank));
#else
  __trap();
#endif
  return out;
}

// 16 bytes of another block's shared memory (an address from cluster_map).
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t addr) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr));
#else
  __trap();
#endif
  return v;
}

// Four 8x8 fp16 matrices from shared memory into the mma A-operand registers.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

// Two 8x8 fp16 matrices (addresses from lanes 0-15): one mma B operand of 8 columns.
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem)));
}

// D = A * B + D, m16n8k16, fp16 (BF16 = false) or bf16 inputs, fp32 accumulators.
template <bool BF16 = false>
__device__ __forceinline__ void mma_16816(const uint32_t (&a)[4], const uint32_t (&b)[2], float (&d)[4]) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// D = A * B (no accumulator input: the first product of a sum).
template <bool BF16 = false>
__device__ __forceinline__ void mma_16816_first(const uint32_t (&a)[4], const uint32_t (&b)[2], float (&d)[4]) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.f));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.f));
  }
}

// (a & b) | c in one instruction; the compiler does not always find lop3 for this by itself.
template <uint32_t LUT>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm volatile("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return d;
}

// Eight 4-bit weights of one int32 (stored as q + 8, nibbles in 64207531 order) into the two
// mma B fragments of a 16x16 block: lo = columns g, hi = columns 8 + g.
// 0x6400 is fp16 1024: OR-ing a nibble into its low mantissa bits gives 1024 + v, and OR-ing
// it in at bits 4..7 gives 1024 + 16 v. Subtracting 1024 + 8, or scaling by 1/16 and
// subtracting 64 + 8, leaves v - 8 exactly; two halves per 32-bit operation.
__device__ __forceinline__ void dequant_int4x8(uint32_t w, uint32_t (&lo)[2], uint32_t (&hi)[2]) {
  constexpr uint32_t kLowMask = 0x000f000f;
  constexpr uint32_t kHighMask = 0x00f000f0;
  constexpr uint32_t kExp = 0x64006400;
  constexpr uint32_t kAndOr = (0xf0 & 0xcc) | 0xaa;  // lop3 truth table of (a & b) | c
  const uint32_t sub = 0x64086408;                     // {1032, 1032}
  const uint32_t mul = 0x2c002c00;                     // {1/16, 1/16}
  const uint32_t add = 0xd480d480;                     // {-72, -72}
  const uint32_t w_hi = w >> 8;
  uint32_t t0 = lop3<kAndOr>(w, kLowMask, kExp);
  uint32_t t1 = lop3<kAndOr>(w, kHighMask, kExp);
  uint32_t t2 = lop3<kAndOr>(w_hi, kLowMask, kExp);
  uint32_t t3 = lop3<kAndOr>(w_hi, kHighMask, kExp);
  half2 r0 = __hsub2(*reinterpret_cast<half2*>(&t0), *reinterpret_cast<const half2*>(&sub));
  half2 r1 = __hfma2(*reinterpret_cast<half2*>(&t1), *reinterpret_cast<const half2*>(&mul),
                     *reinterpret_cast<const half2*>(&add));
  half2 r2 = __hsub2(*reinterpret_cast<half2*>(&t2), *reinterpret_cast<const half2*>(&sub));
  half2 r3 = __hfma2(*reinterpret_cast<half2*>(&t3), *reinterpret_cast<const half2*>(&mul),
                     *reinterpret_cast<const half2*>(&add));
  lo[0] = *reinterpret_cast<uint32_t*>(&r0);
  lo[1] = *reinterpret_cast<uint32_t*>(&r1);
  hi[0] = *reinterpret_cast<uint32_t*>(&r2);
  hi[1] = *reinterpret_cast<uint32_t*>(&r3);
}

// The same eight weights as fp16 subnormals, with no arithmetic: AND-ing a nibble into the
// mantissa of a zero half gives v * 2^-24 (bits 0..3) or 16 v * 2^-24 (bits 4..7), exactly.
// The caller removes the +8 offset, the 2^-24 and the 16 (lo[1], hi[1]: rows 8..15 of K of the
// block) itself: see smallm_kernel.cuh. Fragment order as in dequant_int4x8.
__device__ __forceinline__ void unpack_int4x8_subnormal(uint32_t w, uint32_t (&lo)[2], uint32_t (&hi)[2]) {
  constexpr uint32_t kLowMask = 0x000f000f;
  constexpr uint32_t kHighMask = 0x00f000f0;
  const uint32_t w_hi = w >> 8;
  lo[0] = w & kLowMask;
  lo[1] = w & kHighMask;
  hi[0] = w_hi & kLowMask;
  hi[1] = w_hi & kHighMask;
}

__device__ __forceinline__ void scale_frag(uint32_t (&f)[2], half s) {
  const half2 s2 = __half2half2(s);
  half2* h = reinterpret_cast<half2*>(f);
  h[0] = __hmul2(h[0], s2);
  h[1] = __hmul2(h[1], s2);
}

}  // namespace marlin
