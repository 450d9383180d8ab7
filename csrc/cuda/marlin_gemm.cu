// Tile table, partition planning and the dispatch from a runtime configuration to one
// instantiated kernel. No torch headers: the host wrapper is gemm_cuda.cpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "marlin_gemm.h"
#include "marlin_instances.cuh"
#include "prefill/prefill.h"
#include "smallm_instances.cuh"

namespace marlin {

namespace {


// Priority-ordered tile table: small batches want more blocks along K (more parallel streams of
// weights per column), larger ones want wide N tiles so that each A tile is reused 256 times.
constexpr TileConfig kSmallBatchTiles[] = {{128, 128}, {64, 256}};
constexpr TileConfig kLargeBatchTiles[] = {{64, 256}, {128, 128}};

// When the small-batch kernel (smallm_kernel.cuh) is used instead, measured on an H200
// (benchmarks/NOTES.md, probe_tiles): always up to 8 rows; up to 16 rows on deep layers
// (K >= 16384), where its longer columns amortise the wider slice; up to 32 rows only on layers
// so large that each SM streams >= 8 MB, and then with the 512-column tile. N must be a multiple
// of the tile width; elsewhere the tiled kernel (marlin_kernel.cuh) runs.
constexpr int kSmallMAlways = 8;
constexpr int kSmallMDeep = 16;
constexpr int kSmallMDeepK = 16384;
constexpr int kSmallMMaxM = 32;
constexpr long long kSmallMHugeBytesPerSm = 8LL << 20;

// With wgmma (sm_90a, compute capability 9.0; measured on an H200, benchmarks/NOTES.md
// "Session 3" and "Session 5"): the wgmma variant takes 9-64 rows on layers where each SM
// streams >= 80 KB (with the 512-column tile at 9-16 rows from 768 KB on), and every M above
// 64, in slices of 64 or 128 rows (wg_slice_rows below). Elsewhere the rules above apply.
// (Since columns are split in equal parts, 7B qkv / down and 70B o at 32-64 rows run 9-29%
// faster with it than with the tiled kernel.) The 80 KB line, probed on an H100 (NOTES.md
// "2026-11-25: the planner on small layers"): Llama-3-8B qkv (93 KB per SM) and Llama-2-13B o
// (97 KB) run 8-17% faster on the wgmma variant than on the tiled kernel at 16-64 rows.
constexpr long long kWgBytesPerSm = 80LL << 10;
// Below that line (7B o, Llama-3-8B o: 62 KB per SM on 132 SMs) the tiled kernel takes 9-64
// rows, and there its 128x128 tile (more blocks along K) beats the 64x256 one by 11-14% at
// 32-64 rows (H100 probe, same entry): the layer is too small for wide tiles to pay.
// The 512-column tile (9-16 rows) pays where each SM streams long enough: 768 KB per SM on an
// H100 SXM (3.35 TB/s peak over 132 SMs: 31 us of streaming). The line is that streaming time, so
// it moves with the memory: on an H200 (4.8 TB/s peak) 1.1 MB per SM, where probe_tiles puts the
// crossover between 1.0 MB (16384 x 16384: 256 columns 2-4% faster; 70B down, 0.87 MB: 3-7%) and
// 1.27 MB (8192 x 40960: 512 columns 2-3% faster; NOTES.md "2026-11-28 (eighth)"). It never
// drops below 768 KB (slower memories than the H100's were not probed).
constexpr long long kWg512BytesPerSm = 768LL << 10;
constexpr double kWg512StreamUs = 30.9;
constexpr int kWgSliceRows = 64;

// Blocks per column when every column is split in equal parts (plan_split): as many as the
// block slots allow, at most 8 (the portable cluster size) and at most one per k-tile; 0 or 1:
// no split.
int split_parts(long long columns, long long slots, int k_tiles) {
  return static_cast<int>(std::min<long long>({8, slots / columns, k_tiles}));
}

// Above 64 rows (wgmma): 128-row slices dequantize each weight half as often as 64-row ones and
// give each wgmma twice the N, but make half as many columns, so more blocks share each column,
// and the last of them reads every block's 128 KB fp32 partial. That read grows with the parts
// per column, the stream it ends with the k-tiles per part: 128 rows where parts^2 * 6 <= k-tiles
// (parts at one block per SM). Fitted on an H200 (benchmarks/NOTES.md "Session 6" and "Session
// 7", all 8 model layers at M = 96-4096 with both sizes forced, group 128): 128 rows win by 7-32%
// at 7B qkv M=128 (2 parts of 32 k-tiles), 7B o M=512 (2 of 32), 70B down M=128 (4 of 224; per
// column 3% slower), 70B qkv M=96 (3 of 64), and wherever a column has one block; 64 rows win by
// 16-95% at 7B down M=256 (4 of 86), 70B o M=128 (4 of 64), 7B o M=256 (4 of 32). 70B qkv M=128
// (3 of 64) is a tie. (Not captured: M just above a multiple of 128, e.g. 192, where 128-row
// slices compute 256 rows; 7-9% slower there on 7B qkv / gate_up and 70B qkv.)
int wg_slice_rows(const GemmArgs& a) {
  if (a.wg_slice_rows == 64 || a.wg_slice_rows == 128) return a.wg_slice_rows;
  const long long columns = static_cast<long long>((a.m + 127) / 128) * ((a.n + 255) / 256);
  const long long parts = std::max(1, split_parts(columns, a.sms, a.k / 128));
  return parts * parts * 6 <= a.k / 128 ? 128 : 64;
}

// The weight format of a call, as the instance table of marlin_instances.cuh names it.
struct Format {
  bool bf16 = false;
  int w = kU4;                     // WType
  int group_mode = kPerColumn;     // kGroupBlocks128 (fp16 kU4 only), kGroupBlocksRuntime or kPerColumn
  int group_shift = 0;             // log2 of the group size in k16 blocks (run-time groups)
  bool no_group_sums = false;      // never a raw group-sum instance (GemmArgs::group_sums off)
  bool fixed_g128 = true;          // GemmArgs::fmt_fixed_g128
  // fp16 symmetric INT4 in groups of 128 or per column: the format every kernel and instance
  // runs; the others run on the tiled kernel and on the small-batch kernel with the 256-column
  // tile only (all but per-column zero points): mma.sync with 8 or 16 rows, wgmma with 16-128
  bool base() const { return !bf16 && w == kU4 && group_mode != kGroupBlocksRuntime; }
  bool small_batch() const { return base() || !(w == kU4Zp && group_mode == kPerColumn); }
};

// Checks what the instance table can run; returns an empty string or what is unsupported.
std::string format_of(const GemmArgs& a, Format* f) {
  if (a.bits != 4 && a.bits != 8) return "marlin.gemm: bits = " + std::to_string(a.bits) + ", expected 4 or 8";
  if (a.bits == 8 && a.zeros != nullptr)
    return "marlin.gemm: zero points (b_zeros) are supported with 4-bit weights only, got bits = 8";
  f->bf16 = a.bf16;
  f->w = a.bits == 8 ? kU8 : a.zeros != nullptr ? kU4Zp : kU4;
  f->no_group_sums = !a.group_sums;
  f->fixed_g128 = a.fmt_fixed_g128;
  if (a.groups == 1) {
    f->group_mode = kPerColumn;
    f->group_shift = 0;
    return "";
  }
  const int group = a.groups > 0 && a.k % a.groups == 0 ? a.k / a.groups : 0;
  if (group != 32 && group != 64 && group != 128)
    return "marlin.gemm: group size K / b_scales.size(0) = " + std::to_string(a.k) + " / " + std::to_string(a.groups) +
           " is not one of 32, 64, 128 (or one row of scales: per column)";
  f->group_shift = group == 32 ? 1 : group == 64 ? 2 : 3;
  f->group_mode = (!f->bf16 && f->w == kU4 && group == 128) ? kGroupBlocks128 : kGroupBlocksRuntime;
  return "";
}

long long weight_bytes_per_sm(const GemmArgs& a) { return static_cast<long long>(a.k) * a.n / 2 / std::max(1, a.sms); }

// Bytes per SM from which the wgmma variant takes the 512-column tile at 9-16 rows (see above).
long long wg512_bytes_per_sm(const GemmArgs& a) {
  const double streamed = kWg512StreamUs * 1e-6 * a.dram_gbps * 1e9 / std::max(1, a.sms);
  return std::max(kWg512BytesPerSm, static_cast<long long>(streamed));
}

// 0: use the tiled kernel; else the small-batch kernel's tile width (fp16 symmetric INT4).
int base_small_m_tile(const GemmArgs& a) {
  const long long bytes_per_sm = weight_bytes_per_sm(a);
  if (a.wgmma && a.m > kSmallMAlways) {
    if (a.m > kWgSliceRows) return 256;
    if (bytes_per_sm >= kWgBytesPerSm)
      return a.m <= kSmallMDeep && bytes_per_sm >= wg512_bytes_per_sm(a) && a.n % 512 == 0 ? 512 : 256;
  }
  if (a.m > kSmallMMaxM) return 0;
  if (a.m <= kSmallMAlways) return 256;
  if (a.m <= kSmallMDeep && a.k >= kSmallMDeepK) return 256;
  if (bytes_per_sm >= kSmallMHugeBytesPerSm) return a.n % 512 == 0 ? 512 : 256;
  return 0;
}

// The other formats follow the same rules with the 256-column tile (their only small-batch
// tile): with wgmma (M > 8 on sm_90a) where the base format takes either tile, without it at
// M <= 8, and M <= 16 on deep layers (their mma.sync instances have 8 or 16 rows). Their
// instances with 8-row mma.sync slices and 16- or 32-row wgmma slices take a partial last tile
// (N a multiple of 64, SmallMShape::kPartialN); the others need N to be a multiple of the tile.
constexpr int kSmallMPartialNMaxM = 32;
bool small_m_partial_n(const Format& f, bool wgmma, int m_blocks) {
  return !f.base() && (m_blocks == 1 || (wgmma && m_blocks <= kSmallMPartialNMaxM / 8));
}

int small_m_tile(const GemmArgs& a, const Format& f) {
  if (a.k % 128 != 0 || !f.small_batch()) return 0;
  if (f.base()) return a.n % 256 == 0 ? base_small_m_tile(a) : 0;
  if (a.n % 256 != 0 && a.m > (a.wgmma ? kSmallMPartialNMaxM : kSmallMAlways)) return 0;
  if (a.wgmma && a.m > kSmallMAlways) return std::min(base_small_m_tile(a), 256);
  return a.m <= kSmallMAlways || (a.m <= kSmallMDeep && a.k >= kSmallMDeepK) ? 256 : 0;
}

// What the planner needs to know of one compiled kernel instance.
struct Instance {
  int blocks_per_sm;  // what its register budget allows
  int smem_bytes;
  int partial_floats;  // per split column
  LaunchFn launch;
  int (*max_clusters)(int cluster, int smem);  // resident clusters of that size; null: no cluster support
};

template <typename T, int W, int TM, int TK, int TN, int G, bool PN>
Instance make_instance() {
  using S = KernelShape<TM, TK, TN, kStages, G, W>;
  return Instance{kMinBlocksPerSm<TM>, S::kSmemBytes, S::kPartialFloats, &launch_instance<T, W, TM, TK, TN, G, PN>,
                  nullptr};
}

// The two tiles of one compiled (T, W, TM, G, PN).
template <typename T, int W, int G, bool PN, int TM>
bool find_tiled_tm(int m_blocks, TileConfig tile, Instance* out) {
  if (m_blocks != TM) return false;
  if (tile.tile_k == 128 && tile.tile_n == 128) {
    *out = make_instance<T, W, TM, 8, 8, G, PN>();
    return true;
  }
  if (tile.tile_k == 64 && tile.tile_n == 256) {
    *out = make_instance<T, W, TM, 4, 16, G, PN>();
    return true;
  }
  return false;
}

// m_blocks 1, 2, 4 for every format; 3 too for the fp16 base instances (marlin_instances.cuh).
template <typename T, int W, int G, bool PN>
bool find_tiled(int m_blocks, TileConfig tile, Instance* out) {
  if constexpr (!PN) {
    if (find_tiled_tm<T, W, G, PN, 3>(m_blocks, tile, out)) return true;
  }
  return find_tiled_tm<T, W, G, PN, 1>(m_blocks, tile, out) || find_tiled_tm<T, W, G, PN, 2>(m_blocks, tile, out) ||
         find_tiled_tm<T, W, G, PN, 4>(m_blocks, tile, out);
}

// fp16 symmetric INT4 in groups of 128 or per column has base instances without partial-N
// support; where the tile does not divide N, the run-time group instance (which takes 128 too)
// or the per-column one with it runs instead.
template <typename T, int W>
bool find_tiled_groups(int m_blocks, TileConfig tile, int group_mode, bool partial_n, Instance* out) {
  if constexpr (std::is_same<T, half>::value && W == kU4) {
    if (!partial_n && group_mode == kGroupBlocks128) return find_tiled<T, W, kGroupBlocks128, false>(m_blocks, tile, out);
    if (!partial_n && group_mode == kPerColumn) return find_tiled<T, W, kPerColumn, false>(m_blocks, tile, out);
  }
  if (group_mode == kPerColumn) return find_tiled<T, W, kPerColumn, true>(m_blocks, tile, out);
  return find_tiled<T, W, kGroupBlocksRuntime, true>(m_blocks, tile, out);
}

// The compiled tiled instances (marlin_instances.cuh): element type x weight type x group mode.
bool find_instance(int m_blocks, TileConfig tile, const Format& f, bool partial_n, Instance* out) {
  if (f.bf16) {
    if (f.w == kU4) return find_tiled_groups<nv_bfloat16, kU4>(m_blocks, tile, f.group_mode, partial_n, out);
    if (f.w == kU4Zp) return find_tiled_groups<nv_bfloat16, kU4Zp>(m_blocks, tile, f.group_mode, partial_n, out);
    return find_tiled_groups<nv_bfloat16, kU8>(m_blocks, tile, f.group_mode, partial_n, out);
  }
  if (f.w == kU4) return find_tiled_groups<half, kU4>(m_blocks, tile, f.group_mode, partial_n, out);
  if (f.w == kU4Zp) return find_tiled_groups<half, kU4Zp>(m_blocks, tile, f.group_mode, partial_n, out);
  return find_tiled_groups<half, kU8>(m_blocks, tile, f.group_mode, partial_n, out);
}

// Rows of M per tiled slice / 16: up to 4; 3 only where that instance is compiled (fp16 base).
int tiled_m_blocks(int m, const Format& f, bool partial_n) {
  const int mb = std::min(4, (m + 15) / 16);
  return mb == 3 && (!f.base() || partial_n) ? 4 : mb;
}

template <int MB, int NW, bool G, bool WG, typename ET = half, int W = kU4, int RG = 0,
          int MINB = kSmallMMinBlocksPerSm<MB, WG>>
Instance make_smallm_instance() {
  using S = SmallMShapeOf<MB, NW, G, WG, ET, W, RG>;
  return Instance{MINB, S::kSmemBytes, S::kPartialFloats, &launch_smallm<MB, NW, G, WG, ET, W, RG, MINB>,
                  &smallm_max_clusters<MB, NW, G, WG, ET, W, RG, MINB>};
}

// Zero points (fp16, bf16) and bf16 symmetric INT4 in groups of 128 on the 8-row mma.sync slice run
// the raw group-sum instances (SmallMShape::kFmtSums): the weights enter the mma with
// their offset, which one correction mma per k16 step and each group's end take off the fp32
// sums, and the scale (and zero point) cost one FFMA per sum and group instead of a dequantization
// and scale multiply of every weight at every k16 step. Groups of 64 / 32 (4-bit, symmetric or
// with zero points, fp16 or bf16) take the same path with the group size at run time
// (SmallMShape::kRgSums), on one-block instances only (`one_block`: the plan keeps one block per
// SM); elsewhere they scale every weight.
bool fmt_group_sums(const Format& f, int mb, bool wg, bool one_block) {
  if (f.group_mode == kPerColumn || f.w == kU8 || mb != 1 || wg || f.no_group_sums) return false;
  if (f.group_shift == 3) return f.w == kU4Zp || f.bf16;  // fp16 symmetric group 128 is the base format
  return one_block;
}

// Zero points (fp16, bf16) in groups of 128 on the wgmma slices run instances with the group size
// fixed at 128 (MARLIN_INSTANTIATE_SMALLM_FMT_G128): one scale and zero-point row per stage, read
// and made into dequantization constants at its first k16 step, instead of the run-time-group
// instance's scale row per step with its address and its test for a new group. Their column loops
// (nvdisasm, sm_90a, 256 columns) have 5-8% fewer instructions at 16-128 rows; measured (H200, 9
// layers, median new / old time) 0.97 at 16 rows, 0.99 at 32, 0.98 at 64 (benchmarks/NOTES.md,
// 2026-11-29 twenty-fourth). bf16 symmetric INT4: 0-3.5% fewer instructions, no time gain at 64 rows.
bool fixed_g128_instance(const Format& f, bool wg) {
  return wg && f.fixed_g128 && f.w == kU4Zp && f.group_mode != kPerColumn && f.group_shift == 3;
}

// The other formats on the wgmma variant's 128-column tile (MARLIN_INSTANTIATE_SMALLM_FMT_NARROW):
// zero points (fp16, bf16) in groups of 128 on their fixed-group instances and bf16 symmetric INT4
// in groups of 128, at 17-64 rows (32- and 64-row slices), where narrow_tile_where_it_pays takes
// the 128-column tile for fp16 group 128 (on 7B o and 70B o they ran 1.10-1.23x of fp16 g128 on
// the 256-column tile, twice the parts per column; H200, benchmarks/NOTES.md twenty-fourth); and at
// 9-16 rows (16-row slice, MARLIN_INSTANTIATE_SMALLM_FMT_NARROW_TWO: two blocks per SM only) on
// layers of at most kFmtTwoMaxTiles 256-column tiles (`two`: GemmArgs::wg16_narrow_two).
bool fmt_narrow_format(const Format& f) {
  if (f.group_mode == kPerColumn || f.group_shift != 3) return false;
  return fixed_g128_instance(f, true) || (f.bf16 && f.w == kU4);
}
bool fmt_narrow_instance(const Format& f, int mb, bool two) {
  return (mb == 4 || mb == 8 || (mb == 2 && two)) && fmt_narrow_format(f);
}

// The other formats' small-batch instances (smallm_instances.cuh, MARLIN_INSTANTIATE_SMALLM_FORMATS_WG):
// 256 columns; grouped ones take the group size at run time, but for fmt_group_sums (whose
// instances come in two register bounds: `one_block` takes the one for a single block per SM).
template <int MB, bool WG, typename ET>
bool find_smallm_format_mb(const Format& f, int tile_n, bool one_block, Instance* out) {
  const bool grouped = f.group_mode != kPerColumn;
  if constexpr (MB == 1 && !WG) {
    if (fmt_group_sums(f, MB, WG, one_block)) {
      if (f.group_shift != 3) {
        *out = f.w == kU4Zp ? make_smallm_instance<1, 4, true, false, ET, kU4Zp, kRgSumsMode, 1>()
                            : make_smallm_instance<1, 4, true, false, ET, kU4, kRgSumsMode, 1>();
        return true;
      }
      if (f.w == kU4Zp)
        *out = one_block ? make_smallm_instance<1, 4, true, false, ET, kU4Zp, 0, 1>()
                         : make_smallm_instance<1, 4, true, false, ET, kU4Zp, 0, 2>();
      else
        *out = one_block ? make_smallm_instance<1, 4, true, false, nv_bfloat16, kU4, 0, 1>()
                         : make_smallm_instance<1, 4, true, false, nv_bfloat16, kU4, 0, 2>();
      return true;
    }
  }
  if constexpr (WG) {
    if (tile_n == 128) {  // (plan_small_m asks only where fmt_narrow_instance holds)
      if (!fmt_narrow_format(f)) return false;
      if constexpr (MB == 4 || MB == 8) {
        if (f.w == kU4Zp) return *out = make_smallm_instance<MB, 2, true, true, ET, kU4Zp, 0>(), true;
        if constexpr (std::is_same<ET, nv_bfloat16>::value) return *out = make_smallm_instance<MB, 2, true, true, ET, kU4, 1>(), true;
      }
      if constexpr (MB == 2) {
        if (f.w == kU4Zp) return *out = make_smallm_instance<2, 2, true, true, ET, kU4Zp, 0, 2>(), true;
        if constexpr (std::is_same<ET, nv_bfloat16>::value) return *out = make_smallm_instance<2, 2, true, true, ET, kU4, 1, 2>(), true;
      }
      return false;
    }
    if (fixed_g128_instance(f, WG)) return *out = make_smallm_instance<MB, 4, true, true, ET, kU4Zp, 0>(), true;
  }
  if (f.w == kU4) {
    if (grouped) *out = make_smallm_instance<MB, 4, true, WG, ET, kU4, 1>();
    else if (std::is_same<ET, nv_bfloat16>::value) *out = make_smallm_instance<MB, 4, false, WG, nv_bfloat16, kU4, 0>();
    else return false;  // fp16 per column is the base format
  } else if (f.w == kU4Zp) {
    if (!grouped) return false;  // per-column zero points: tiled kernel only
    *out = make_smallm_instance<MB, 4, true, WG, ET, kU4Zp, 1>();
  } else {
    *out = grouped ? make_smallm_instance<MB, 4, true, WG, ET, kU8, 1>()
                   : make_smallm_instance<MB, 4, false, WG, ET, kU8, 0>();
  }
  return true;
}

template <bool WG, typename ET>
bool find_smallm_format_et(int mb, int tile_n, const Format& f, bool one_block, Instance* out) {
  if constexpr (WG) {  // smallm_wg_fmt_instances_*.cu
    switch (mb) {
      case 2: return find_smallm_format_mb<2, true, ET>(f, tile_n, one_block, out);
      case 4: return find_smallm_format_mb<4, true, ET>(f, tile_n, one_block, out);
      case 8: return find_smallm_format_mb<8, true, ET>(f, tile_n, one_block, out);
      case 16: return find_smallm_format_mb<16, true, ET>(f, tile_n, one_block, out);
      default: return false;
    }
  } else {  // smallm_fmt_instances_mb*.cu
    switch (mb) {
      case 1: return find_smallm_format_mb<1, false, ET>(f, tile_n, one_block, out);
      case 2: return find_smallm_format_mb<2, false, ET>(f, tile_n, one_block, out);
      default: return false;
    }
  }
}

// mma.sync: MB 1 or 2; wgmma: MB 2, 4, 8 or 16; 256 columns (wgmma at MB 2 / 4 / 8 also 128: fmt_narrow_instance).
bool find_smallm_format(int mb, int tile_n, bool wg, const Format& f, bool one_block, Instance* out) {
  if (tile_n != 256 && !(tile_n == 128 && wg)) return false;
  if (f.bf16)
    return wg ? find_smallm_format_et<true, nv_bfloat16>(mb, tile_n, f, one_block, out)
              : find_smallm_format_et<false, nv_bfloat16>(mb, tile_n, f, one_block, out);
  return wg ? find_smallm_format_et<true, half>(mb, tile_n, f, one_block, out)
            : find_smallm_format_et<false, half>(mb, tile_n, f, one_block, out);
}

// The small-batch instances: MB n8 tiles of the batch (1, 2, 4 with mma.sync; 2, 4, 8 with
// wgmma) x 256 or 512 columns x scales; MB = 16 with wgmma, 256 columns only; and with wgmma at
// MB = 2-16 the 128-column tile, group 128 only. `one_block`: the 8-row, 256-column mma.sync
// instances built for one block per SM (no 128-register bound), where the plan keeps one.
// `two`: the 16-row 128-column tile's instance held to 128 registers (two blocks per SM).
bool find_smallm_instance(int mb, int tile_n, bool grouped, bool wg, bool one_block, bool two, Instance* out) {
  if (one_block && mb == 1 && tile_n == 256 && !wg) {
    *out = grouped ? make_smallm_instance<1, 4, true, false, half, kU4, 0, 1>()
                   : make_smallm_instance<1, 4, false, false, half, kU4, 0, 1>();
    return true;
  }
#define MARLIN_TRY(MB, NW, WG)                                                                                \
  if (mb == MB && tile_n == 64 * NW && wg == WG) {                                                           \
    *out = grouped ? make_smallm_instance<MB, NW, true, WG>() : make_smallm_instance<MB, NW, false, WG>(); \
    return true;                                                                                             \
  }
  MARLIN_TRY(1, 4, false)
  MARLIN_TRY(1, 8, false)
  MARLIN_TRY(2, 4, false)
  MARLIN_TRY(2, 8, false)
  MARLIN_TRY(4, 4, false)
  MARLIN_TRY(4, 8, false)
  MARLIN_TRY(2, 4, true)
  MARLIN_TRY(2, 8, true)
  MARLIN_TRY(4, 4, true)
  MARLIN_TRY(4, 8, true)
  MARLIN_TRY(8, 4, true)
  MARLIN_TRY(8, 8, true)
  MARLIN_TRY(16, 4, true)
  if (grouped && wg && tile_n == 128) {  // the 128-column tile: fp16 group 128 only
    if (mb == 2)
      return *out = two ? make_smallm_instance<2, 2, true, true, half, kU4, 0, 2>() : make_smallm_instance<2, 2, true, true>(),
             true;
    if (mb == 4) return *out = make_smallm_instance<4, 2, true, true>(), true;
    if (mb == 8) return *out = make_smallm_instance<8, 2, true, true>(), true;
    if (mb == 16) return *out = make_smallm_instance<16, 2, true, true>(), true;
  }
#undef MARLIN_TRY
  return false;
}

// fp16 group 128 on the wgmma variant's 16-row slices (9-16 rows, 256-column tile) runs the
// run-time-group instance, which scales the dequantized weights before each wgmma, instead of the
// group-sum one, which drains every wgmma in flight at each group's end to read its sums. At 16
// rows the math and its synchronisation, not the copies, set the time (NOTES.md, "the M = 16
// instance under ncu" and "compute alone and copies alone"), and groups of 64 / 32 measured 4-7%
// faster there than group 128 on the group-sum path (H100, full run of 2026-11-25).
void g128_as_runtime_group(const GemmArgs& a, const GemmPlan& plan, Format* f) {
  if (a.g128_runtime_group && f->group_mode == kGroupBlocks128 && plan.small_m && plan.wgmma && plan.m_blocks == 2 &&
      plan.tile.tile_n == 256)
    f->group_mode = kGroupBlocksRuntime;  // group_shift is 3 (128 rows) already
}

std::string describe(const GemmArgs& a, TileConfig tile, int m_blocks) {
  // std::to_string, not ostream: see the note on message formatting in csrc/gemm_checks.h
  return "m=" + std::to_string(a.m) + " n=" + std::to_string(a.n) + " k=" + std::to_string(a.k) +
         " groups=" + std::to_string(a.groups) + " dtype=" + (a.bf16 ? "bf16" : "fp16") + " bits=" + std::to_string(a.bits) +
         " zeros=" + (a.zeros != nullptr ? "1" : "0") + " tile_k=" + std::to_string(tile.tile_k) +
         " tile_n=" + std::to_string(tile.tile_n) + " m_blocks=" + std::to_string(m_blocks);
}

// Split parts instead of stream-K stripes (smallm_kernel.cuh): every column in `parts` nearly
// equal parts, one block each, as many parts as the device holds (at most 8, the portable
// cluster size). A stripe that ends a column in its middle stops streaming for the column's
// reduction (write, fence, counter; 1-3 us on an H200); equal parts have none. Taken where no
// block streams more than kSplitExtraBytes more than its stripe would: measured on an H200 at
// M = 1-8, 7B down 14.0 -> 12.0 us (stripes of 11 tiles, parts of 11), 7B qkv 13.4 -> 12.2
// (12 tiles -> 16, in clusters), 70B qkv 18.2 -> 17.3 (20 -> 22), nothing slower.
// Reduced in one thread-block cluster per column where all clusters are resident at once (a
// second wave would double the time), else through global memory as the stripes are.
constexpr long long kSplitExtraBytes = 64LL << 10;
void plan_split(const GemmArgs& args, const Instance& inst, int k_tiles, int n_tiles, GemmPlan* plan) {
  if (args.split_mode <= 0) return;
  const long long columns = static_cast<long long>(plan->m_slices) * n_tiles;
  const long long slots = static_cast<long long>(args.sms) * plan->blocks_per_sm;
  int parts = split_parts(columns, slots, k_tiles);
  if (args.max_split_parts > 0) parts = std::min(parts, args.max_split_parts);
  if (parts < 2) return;
  const long long tile_bytes = static_cast<long long>(plan->tile.tile_k) * plan->tile.tile_n / 2;
  auto longest_of = [&](int p) { return (k_tiles + p - 1) / p; };  // k-tiles of a column's longest part
  // whether parts of this many tiles stream too much more than the stripes would
  auto too_long = [&](int p) {
    return args.split_mode == 1 && (longest_of(p) - plan->tiles_per_block) * tile_bytes > kSplitExtraBytes;
  };
  if (too_long(parts)) return;
  // A cluster's blocks are placed GPC by GPC, filling SMs up to the occupancy limit; with one
  // block per SM planned, ask for more shared memory than two blocks could share so that the
  // blocks spread over the SMs as stream-K's do.
  int smem = plan->smem_bytes;
  if (plan->blocks_per_sm == 1) smem = std::min(args.max_smem, std::max(smem, args.max_smem_per_sm / 2 + 1024));
  const bool can_cluster = args.clusters && args.split_mode != 3;
  bool clusters = can_cluster && inst.max_clusters(parts, smem) >= columns;
  // Clusters are placed whole inside one GPC, so on an H100 16 columns of 8 parts do not all fit
  // (4096 x 4096) while 16 of 6 do. Fewer, longer parts reduced in clusters then beat the planned
  // ones that end through global memory where the slices have more than 16 rows (H100,
  // benchmarks/NOTES.md 2026-11-27 "split parts that fit as clusters": 7B o at 64 rows 16.0 ->
  // 12.5 us, 7B down 26.0 -> 21.6, every format), and at 8 rows where the columns are few enough
  // for 6-8 parts each at one block per SM and the parts grow by at most 40% (7B down, 86 tiles
  // in 8 -> 6 parts: 2-9% faster; 7B o, 32 tiles in parts of 4 -> 6: 7-10% slower). Not at 16
  // rows (7B down and 4096 x 4096 4-10% slower) nor with more columns (70B down and 1024 x 8192
  // at 8 rows, two blocks per SM or 4 -> 3 parts: 8-10% slower).
  const int rows = 8 * plan->m_blocks;
  const int planned_longest = longest_of(parts);
  auto fewer_parts_pay = [&](int p) {
    if (!args.cluster_fit) return false;
    if (rows > 16) return true;
    return rows <= 8 && parts >= 6 && plan->blocks_per_sm == 1 && 5 * longest_of(p) <= 7 * planned_longest;
  };
  for (int p = parts - 1; can_cluster && !clusters && p >= 2 && !too_long(p) && fewer_parts_pay(p); --p) {
    if (inst.max_clusters(p, smem) >= columns) {
      parts = p;
      clusters = true;
    }
  }
  const int longest = longest_of(parts);
  plan->split_parts = parts;
  plan->cluster_reduce = clusters;
  if (clusters) plan->smem_bytes = smem;
  plan->grid = static_cast<int>(columns * parts);
  plan->tiles_per_block = longest;
  plan->needs_partial = !clusters;
  plan->partial_floats = clusters ? 0 : static_cast<std::size_t>(inst.partial_floats) * 2 * plan->grid;
}

// Two blocks per SM (where registers and shared memory allow) hide more latency on large layers,
// but double the split columns and reductions; measured on an H200 it pays only when a single
// block per SM would stream at least kBytesFor2PerSm of weights (benchmarks/NOTES.md). (Tried for
// the small-batch kernel: two blocks everywhere made 7B layers 10-15% slower.) MARLIN_BLOCKS_PER_SM=1
// keeps one everywhere.
// The 8-row mma.sync slice (1-8 rows) has a higher line, kBytesFor2PerSm8Rows (128 stages of 128 x
// 256 per SM): there one block per SM, on the instance without the 128-register bound, streamed
// most layers above the general line faster than two blocks (H200, benchmarks/NOTES.md,
// twenty-ninth; fp16 group 128 at 1-8 rows: 13B gate_up, 8192 x 28672 and 70B down 7-14% faster,
// Falcon-180B qkv / o 4-7%, 70B gate_up 0-4%; groups of 64, zero points and per column alike or
// better), while on the layers above it two blocks stayed faster (Falcon-180B up / down 0-9%, the
// 135168-deep ideal layer 5-12%).
long long tiles_of(const GemmArgs& args, TileConfig tile, int m_slices) {
  return static_cast<long long>(m_slices) * ((args.n + tile.tile_n - 1) / tile.tile_n) * (args.k / tile.tile_k);
}
bool two_blocks_pay(const GemmArgs& args, TileConfig tile, int m_slices, bool eight_rows) {
  constexpr long long kBytesFor2PerSm = 64LL * 128 * 128 / 2;
  constexpr long long kBytesFor2PerSm8Rows = 128LL * 128 * 256 / 2;
  const long long tile_bytes = static_cast<long long>(tile.tile_k) * tile.tile_n / 2;
  const long long line = eight_rows ? kBytesFor2PerSm8Rows : kBytesFor2PerSm;
  return args.blocks_per_sm != 1 && tiles_of(args, tile, m_slices) * tile_bytes >= line * args.sms;
}
// The small-batch plan's 8-row mma.sync slice (two_blocks_pay's own line)
bool eight_row_slice(const GemmPlan& plan) { return plan.small_m && !plan.wgmma && plan.m_blocks == 1; }

// The 8-row mma.sync instances built for one block per SM (no 128-register bound) save ptxas's
// recomputed addresses at every stage: measured on an H200 at 1-8 rows (NOTES.md, 2026-11-29,
// twenty-second), fp16 group 128 2-8% faster where each SM streams 10-22 stages (7B qkv / down /
// gate_up, 70B o / qkv), but 3% slower on 7B o, whose blocks stream 4 stages each. Taken where the
// plan keeps one block per SM and the tiles make at least kOneBlockMinStages stages per SM.
constexpr int kOneBlockMinStages = 8;
bool one_block_regs_pay(const GemmArgs& args, const GemmPlan& plan) {
  return !two_blocks_pay(args, plan.tile, plan.m_slices, eight_row_slice(plan)) &&
         tiles_of(args, plan.tile, plan.m_slices) >= kOneBlockMinStages * args.sms;
}

// Fills the partition of a plan whose tile and instance are chosen.
std::string finish_plan(const GemmArgs& args, const Instance& inst, GemmPlan* plan, bool keep_two = false) {
  plan->blocks_per_sm = std::min(inst.blocks_per_sm, std::max(1, args.max_smem_per_sm / std::max(1, inst.smem_bytes)));
  if (args.blocks_per_sm > 0) plan->blocks_per_sm = std::min(plan->blocks_per_sm, args.blocks_per_sm);
  plan->smem_bytes = inst.smem_bytes;

  const int k_tiles = args.k / plan->tile.tile_k;
  // the last column of tiles may be partial (N a multiple of 64): in the tiled kernel, and in some
  // small-batch instances of the other formats (plan_small_m)
  const int n_tiles = (args.n + plan->tile.tile_n - 1) / plan->tile.tile_n;
  const long long total = static_cast<long long>(plan->m_slices) * n_tiles * k_tiles;
  if (total >= (1LL << 31)) return "marlin.gemm: problem too large for 32-bit tile indices; " + describe(args, plan->tile, plan->m_blocks);
  if (plan->blocks_per_sm > 1 && !keep_two && !two_blocks_pay(args, plan->tile, plan->m_slices, eight_row_slice(*plan)))
    plan->blocks_per_sm = 1;
  const int blocks = static_cast<int>(std::min<long long>(static_cast<long long>(args.sms) * plan->blocks_per_sm, total));
  plan->tiles_per_block = static_cast<int>((total + blocks - 1) / blocks);
  plan->grid = static_cast<int>((total + plan->tiles_per_block - 1) / plan->tiles_per_block);
  // A column is split unless every stripe is a whole number of columns.
  plan->needs_partial = plan->tiles_per_block % k_tiles != 0;
  plan->partial_floats = plan->needs_partial ? static_cast<std::size_t>(inst.partial_floats) * 2 * plan->grid : 0;
  plan->split_parts = 0;
  plan->cluster_reduce = false;
  if (plan->needs_partial && inst.max_clusters != nullptr) plan_split(args, inst, k_tiles, n_tiles, plan);
  plan->locks = plan->grid;
  plan->launch = inst.launch;
  return "";
}

// The small-batch kernel: batch slices of 8, 16 or 32 rows (64 or 128 with wgmma), tiles of
// 128 x 256 or 128 x 512. Above 8 rows on a wgmma-capable device and build, the wgmma variant.
std::string plan_small_m(const GemmArgs& args, int tile_n, GemmPlan* plan) {
  const bool grouped = args.groups > 1;
  Format f;
  const std::string bad = format_of(args, &f);
  if (!bad.empty()) return bad;
  if (!f.base() && (tile_n != 256 || !f.small_batch()))
    return "marlin.gemm: the small-batch kernel runs this format with tile_n=256 only (the planner may take 128), and per-column zero points "
           "not at all; " + describe(args, TileConfig{128, tile_n}, 0) +
           " (leave tile_k / tile_n unset to let the planner choose)";
  plan->small_m = true;
  // GemmArgs::wg_tile_n == 128 (narrow_tile_where_it_pays, or forced by MARLIN_WG_TILE_N=128): the
  // wgmma variant's 256-column tile as 128 columns, fp16 group 128 (and fmt_narrow_instance's
  // formats at 17-64 rows: see below)
  bool narrow = args.wg_tile_n == 128 && tile_n == 256 && grouped && args.wgmma && args.m > 8;
  // 8-bit weights run the wgmma variant from one row on: its 16-row slice, at M = 1 on an H100,
  // took 21.6 instead of 24.5 us on 7B qkv and 160 instead of 170 us on 70B gate_up (7B down and
  // 70B o within 2%), where the 8-row mma.sync slice's two 8-bit fragments per block cost more.
  plan->wgmma = args.wgmma && (args.m > 8 || f.w == kU8);
  // rows per slice / 8: above 64 rows (wgmma) 64 or 128, the latter with the 128- or 256-column tile
  const bool wide = plan->wgmma && args.m > kWgSliceRows && (tile_n == 256 || tile_n == 128);
  plan->m_blocks = args.m <= 8 ? (plan->wgmma ? 2 : 1) : args.m <= 16 ? 2 : (args.m <= 32 || !plan->wgmma) ? 4 : wide ? wg_slice_rows(args) / 8 : 8;
  if (!f.base() && !plan->wgmma && plan->m_blocks > 2) plan->m_blocks = 2;  // their mma.sync slices: 8 or 16 rows
  narrow = narrow && (f.base() || fmt_narrow_instance(f, plan->m_blocks, args.wg16_narrow_two));  // (wide holds for 128 or 256 alike)
  if (narrow) tile_n = 128;
  plan->tile = TileConfig{128, tile_n};
  plan->m_slices = (args.m + 8 * plan->m_blocks - 1) / (8 * plan->m_blocks);
  if (!narrow) g128_as_runtime_group(args, *plan, &f);
  // the 8-row instances of the base format and the group-sum ones of the others have twins without
  // the 128-register bound, for plans with one block per SM
  const bool one_block = args.one_block_regs && one_block_regs_pay(args, *plan);
  plan->group_sums = fmt_group_sums(f, plan->m_blocks, plan->wgmma, one_block);
  plan->fixed_g128 = fixed_g128_instance(f, plan->wgmma);
  Instance inst;
  // GemmArgs::wg16_narrow_two: the 16-row slice's 128-column tile held to 128 registers, two
  // blocks per SM whatever the layer's size (narrow_tile_where_it_pays: rows_16_narrow_two)
  const bool narrow_two = args.wg16_narrow_two && narrow && plan->m_blocks == 2;
  const bool found = f.base() ? find_smallm_instance(plan->m_blocks, tile_n, grouped, plan->wgmma, one_block, narrow_two, &inst)
                              : find_smallm_format(plan->m_blocks, tile_n, plan->wgmma, f, one_block, &inst);
  if (!found) return "marlin.gemm: internal error, no small-batch kernel for " + describe(args, plan->tile, plan->m_blocks);
  plan->one_block_regs = one_block && plan->m_blocks == 1 && !plan->wgmma && (f.base() ? tile_n == 256 : plan->group_sums);
  // some instances of the other formats take a partial last tile of whole 64-column chunks
  const bool partial_n = small_m_partial_n(f, plan->wgmma, plan->m_blocks);
  if (args.k % 128 != 0 || args.n % (partial_n ? 64 : tile_n) != 0)
    return "marlin.gemm: k=" + std::to_string(args.k) + " n=" + std::to_string(args.n) +
           " do not divide into tile_k=128 x tile_n=" + std::to_string(tile_n);
  if (inst.smem_bytes > args.max_smem)
    return "marlin.gemm: tile needs " + std::to_string(inst.smem_bytes) + " bytes of shared memory, the device allows " +
           std::to_string(args.max_smem) + "; " + describe(args, plan->tile, plan->m_blocks);
  return finish_plan(args, inst, plan, narrow_two);
}

}  // namespace

int max_locks(int sms) { return 2 * std::max(sms, 1); }

// The prefill kernel (prefill/prefill_kernel.cuh): sm_90a, every format but per-column zero points
// (fp16 or bf16; 4-bit, 4-bit with zero points or 8-bit; groups of 32, 64, 128 or per column), N a
// multiple of its 128 columns, K of its 64-row stage; where prefill_pays (prefill.h: the measured rule).
bool prefill_format(const Format& f) { return !(f.w == kU4Zp && f.group_mode == kPerColumn); }

// The prefill kernel's tile height for this call (prefill_pick_tile_m's rule for the format's scale
// kind, or MARLIN_PREFILL_ROWS: GemmArgs::prefill_rows), or 0 where the kernel cannot take the call
// or does not pay (the planner asks once and plans with the answer).
int prefill_tile_m(const GemmArgs& a, const Format& f) {
  if (!a.wgmma || a.prefill == 0 || !prefill_format(f) || a.m <= kWgSliceRows) return 0;
  if (a.n % kPrefillTileN != 0 || a.k % kPrefillTileK != 0) return 0;
  const int tile_m = prefill_pick_tile_m(a.m, a.n, a.k, a.sms, a.prefill_rows,
                                         f.group_mode == kPerColumn ? PrefillRoundModel::kPerColumn : PrefillRoundModel::kGroupScales);
  if (prefill_smem_bytes(a.bits, tile_m) > a.max_smem) return 0;
  return a.prefill == 1 || prefill_pays(a.m, a.n, a.k, a.sms, kPrefillMinFill, tile_m) ? tile_m : 0;
}

// The prefill instances of one tile height, by element type, weight type and scale kind (the group
// size is a run-time shift); nullptr where prefill_format refuses (per-column zero points).
template <int TILE_M>
struct PrefillInstances {
  static constexpr LaunchFn table[2][3][2] = {
      {{&launch_prefill<false, kU4, false, TILE_M>, &launch_prefill<false, kU4, true, TILE_M>},
       {nullptr, &launch_prefill<false, kU4Zp, true, TILE_M>},
       {&launch_prefill<false, kU8, false, TILE_M>, &launch_prefill<false, kU8, true, TILE_M>}},
      {{&launch_prefill<true, kU4, false, TILE_M>, &launch_prefill<true, kU4, true, TILE_M>},
       {nullptr, &launch_prefill<true, kU4Zp, true, TILE_M>},
       {&launch_prefill<true, kU8, false, TILE_M>, &launch_prefill<true, kU8, true, TILE_M>}}};
};

void plan_prefill(const GemmArgs& args, const Format& f, int tile_m, GemmPlan* plan) {
  plan->small_m = false;
  plan->wgmma = true;
  plan->prefill = true;
  plan->tile = TileConfig{kPrefillTileK, kPrefillTileN};
  plan->m_blocks = tile_m / 16;
  plan->m_slices = (args.m + tile_m - 1) / tile_m;
  plan->blocks_per_sm = 1;
  // persistent: at most one block per SM, each taking every grid-th unit of work; the last
  // round's tiles in K parts where few (prefill_schedule), the parts' fp32 partials added by the
  // tile's last unit to arrive (one lock counter per split tile)
  const PrefillSchedule ps = prefill_schedule(args.m, args.n, args.k, args.sms, args.prefill_split, tile_m, args.prefill_lead);
  plan->grid = ps.grid;
  plan->tiles_per_block = args.k / kPrefillTileK;
  plan->smem_bytes = prefill_smem_bytes(args.bits, tile_m);
  plan->split_parts = ps.parts;
  plan->split_first = ps.split_first;
  plan->split_stages = ps.split_stages;
  plan->cluster_reduce = false;
  plan->needs_partial = ps.partial_floats > 0;
  plan->partial_floats = static_cast<std::size_t>(ps.partial_floats);
  plan->locks = ps.locks;
  const auto& instances = tile_m == kPrefillTileMShort ? PrefillInstances<kPrefillTileMShort>::table
                                                      : PrefillInstances<kPrefillTileM>::table;
  plan->launch = instances[f.bf16][f.w][f.group_mode != kPerColumn];  // prefill_format excludes the nullptr
}

// Replans the small-batch call with `variant` (the same call, one planner knob set) and takes
// that plan if it plans and ends no column through global memory.
void take_if_no_global_reduction(const GemmArgs& variant, GemmPlan* plan) {
  GemmPlan trial;
  if (plan_small_m(variant, 256, &trial).empty() && !trial.needs_partial) *plan = trial;
}

// The 128-column tile of the wgmma variant (fp16 group 128; 17-128 rows): twice the columns of
// the 256-column plan, so half the parts per column, each streaming twice as deep. Taken where the
// layer is small (under kWgBytesPerSm of weights per SM: its 256-column columns are few and short,
// so their many parts' reduction and pipeline fill weigh most) or where the 256-column plan ends
// columns through global memory, and only if the 128-column plan then ends none there. H100 probe
// (benchmarks/NOTES.md 2026-11-27, "a 128-column tile"), us, 256 -> 128 columns: 4096 x 4096 at
// M = 32 / 64 / 128 10.0 / 12.2 / 16.4 -> 9.0 / 10.9 / 13.6 (FP16 14.3 at 128), 2048 x 4096 12-21%
// faster, 8192 x 8192 at M = 32 / 64 (a global reduction before) 6% / 12% faster. Slower, and left
// out by the rule: the larger layers whose 256-column columns already reduce in clusters
// (11008 x 4096 +1-3%, 4096 x 12288 +4-16%), 16 rows on one block per SM (8192 x 8192 +7%; two
// blocks: rows_16_narrow_two), 8192 x 8192 above 64 rows, where the 128-column plan falls back to
// stream-K stripes, and layers deeper than
// kNarrowMaxK: 28672 x 8192 at M = 32 / 64 / 128 took 55.4 / 77.3 / 115.9 us on the 128-column
// tile (clusters) against 50.9 / 74.0 / 114.1 on the 256-column one (global reduction); likely
// because twice the column tiles each stream the whole depth of A. MARLIN_WG_TILE_N=256 keeps the
// 256-column tile everywhere, =128 takes the 128-column one wherever it can run (probes).
constexpr int kNarrowMaxK = 16384;

// fp16 group 128 at 9-16 rows (one 16-row slice): the 128-column tile with two blocks per SM (the
// instance held to 128 registers), 16 warps per SM where the 256-column tile runs 8. H200 A/B
// (benchmarks/NOTES.md, twenty-sixth), new / old time at 12 / 16 rows: 7B down 0.95 / 0.91, 70B o
// and qkv 0.97-0.99, the others within 1% (layers on the 512-column tile do not take it). Taken
// where it plans, unless it would end columns through global memory that the 256-column plan
// reduces in clusters or does not split (small_layer_small_m relies on those). Returns whether the
// rule applied (9-16 rows).
bool rows_16_narrow_two(const GemmArgs& args, GemmPlan* plan) {
  if (!args.wg16_narrow_two || args.m <= 8 || plan->m_blocks != 2) return false;
  GemmArgs narrow = args;
  narrow.wg_tile_n = 128;
  GemmPlan trial;
  if (plan_small_m(narrow, 256, &trial).empty() && (!trial.needs_partial || plan->needs_partial)) *plan = trial;
  return true;
}

// The other formats (zero points, bf16; groups of 128) take the 16-row rule's two-block tile only
// on layers of at most kFmtTwoMaxTiles 256-column tiles. H200 A/B (benchmarks/NOTES.md,
// twenty-seventh), 16 rows, time with the tile over without it, bf16 / zero points: 7B down 0.925 /
// 0.941, Llama-3-8B down 0.948 / 0.961, 13B o 0.904 / 0.916, Llama-3-8B qkv 0.921 / 0.932, 13B down
// 0.977 / 0.995 (20 tiles); on wider layers they gain nothing or lose, zero points most (their
// dequantization constants take registers that the two-block bound of 128 lacks): 70B o (32 tiles)
// 0.988 / 1.005, 13B qkv (60) 1.008 / 1.035, 7B gate_up, 70B down, 70B gate_up and the ideal
// layer 1.00-1.09 (twenty-sixth). fp16 group 128 takes it wherever its 256-column plan would run.
constexpr int kFmtTwoMaxTiles = 24;

void narrow_tile_where_it_pays(const GemmArgs& args, GemmPlan* plan) {
  if (args.wg_tile_n != 0 || !plan->small_m || !plan->wgmma || plan->tile.tile_n != 256 || args.groups <= 1) return;
  Format f;
  if (!format_of(args, &f).empty()) return;
  const bool fmt_two = fmt_narrow_format(f) && args.n <= 256 * kFmtTwoMaxTiles;
  if ((f.base() || fmt_two) && rows_16_narrow_two(args, plan)) return;
  if (plan->m_blocks < 4 || args.m > 2 * kWgSliceRows || args.k > kNarrowMaxK) return;
  if (!(f.base() || fmt_narrow_instance(f, plan->m_blocks, false))) return;
  if (weight_bytes_per_sm(args) >= kWgBytesPerSm && !plan->needs_partial) return;
  GemmArgs narrow = args;
  narrow.wg_tile_n = 128;
  take_if_no_global_reduction(narrow, plan);
}

// Layers under kWgBytesPerSm of weights per SM at 9-64 rows (wgmma) take the tiled kernel by
// default, but the small-batch kernel where its plan ends no column through global memory: every
// split column reduced inside one thread-block cluster (all clusters resident at once), or no
// column split at all. Whether that holds is what separated the two kernels in an H100 sweep of
// 16 such layers at M = 12-64 (benchmarks/NOTES.md, 2026-11-27): with cluster-reduced columns
// the small-batch kernel took 7-47% less time (3072 x 3072, 2048 x 3072, 4096 x 1024, 4096 x 2048,
// 1536 x 8960); where its 8 parts per column did not fit as clusters (16 columns of 4096 x 4096,
// 2048 x 4096, 1024 x 4096) or stream-K left long chains (8960 x 1536) the tiled kernel won by up
// to 1.7x.
bool small_layer_small_m(const GemmArgs& args, const Format& f, GemmPlan* plan) {
  if (!args.wgmma || args.m <= kSmallMAlways || args.m > kWgSliceRows || weight_bytes_per_sm(args) >= kWgBytesPerSm)
    return false;
  if (args.k % 128 != 0 || !f.small_batch() || (f.base() && args.n % 256 != 0)) return false;
  GemmPlan trial;
  if (!plan_small_m(args, 256, &trial).empty()) return false;
  narrow_tile_where_it_pays(args, &trial);
  if (trial.needs_partial) return false;
  *plan = trial;
  return true;
}

// Above 64 rows wg_slice_rows picks 64-row slices for shallow layers, counting the parts that
// plan_split first plans. Where those 64-row columns then end through global memory but 128-row
// ones reduce in clusters (fewer parts that fit), the 128-row plan is taken: H100 probe
// (benchmarks/NOTES.md 2026-11-27 "split parts that fit as clusters", 128-row slices) 7B down at
// M = 96 / 128 29.1 / 30.3 us against 32.4 / 32.7, while the layers whose 64-row columns already
// reduce in clusters (1024-4096 x 4096) were as fast or faster on 64 rows.
void slices_of_128_where_they_reduce_in_clusters(const GemmArgs& args, GemmPlan* plan) {
  if (!plan->small_m || !plan->wgmma || args.m <= kWgSliceRows || args.wg_slice_rows != 0 || plan->m_blocks != 8 ||
      plan->tile.tile_n != 256 || !plan->needs_partial || !args.cluster_fit)
    return;
  GemmArgs rows128 = args;
  rows128.wg_slice_rows = 128;
  take_if_no_global_reduction(rows128, plan);
}

std::string plan_gemm(const GemmArgs& args, int tile_k, int tile_n, GemmPlan* plan) {
  Format f;
  const std::string bad = format_of(args, &f);
  if (!bad.empty()) return bad;
  const bool forced = tile_k > 0 || tile_n > 0;
  const int prefill_rows = forced ? 0 : prefill_tile_m(args, f);
  if (prefill_rows > 0) {
    plan_prefill(args, f, prefill_rows, plan);
    return "";
  }
  if (forced && tile_k == 128 && (tile_n == 256 || tile_n == 512)) return plan_small_m(args, tile_n, plan);
  if (!forced) {
    // the small-batch kernel where it pays, else (or where its tile does not fit the device's
    // shared memory, e.g. the 512-column tile on sm_80/sm_86) the tiled kernel
    const int small_tile = small_m_tile(args, f);
    if (small_tile > 0 && plan_small_m(args, small_tile, plan).empty()) {
      slices_of_128_where_they_reduce_in_clusters(args, plan);
      narrow_tile_where_it_pays(args, plan);
      return "";
    }
    if (small_tile == 512 && plan_small_m(args, 256, plan).empty()) return "";
    if (small_tile == 0 && args.small_layer_clusters && small_layer_small_m(args, f, plan)) return "";
  }

  plan->small_m = false;
  plan->wgmma = false;
  plan->m_blocks = tiled_m_blocks(args.m, f, false);
  const bool small_layer = args.wgmma && args.m <= kWgSliceRows && weight_bytes_per_sm(args) < kWgBytesPerSm;
  const TileConfig* table = args.m <= 16 || small_layer ? kSmallBatchTiles : kLargeBatchTiles;
  const int table_len = 2;
  std::string why;
  for (int i = 0; i < (forced ? 1 : table_len); i++) {
    const TileConfig t = forced ? TileConfig{tile_k, tile_n} : table[i];
    const bool partial_n = t.tile_n > 0 && args.n % t.tile_n != 0;
    plan->m_blocks = tiled_m_blocks(args.m, f, partial_n);
    plan->m_slices = (args.m + 16 * plan->m_blocks - 1) / (16 * plan->m_blocks);
    Instance inst;
    if (!find_instance(plan->m_blocks, t, f, partial_n, &inst)) {
      why = "no kernel instance for tile_k=" + std::to_string(t.tile_k) + " tile_n=" + std::to_string(t.tile_n) +
            " (available: 128x128, 64x256, 128x256, 128x512)";
      continue;
    }
    if (args.k % t.tile_k != 0 || args.n % 64 != 0) {  // a partial last tile of N holds whole 64-column chunks
      why = "k=" + std::to_string(args.k) + " n=" + std::to_string(args.n) + " do not divide into tile_k=" +
            std::to_string(t.tile_k) + " x 64-column chunks";
      continue;
    }
    if (inst.smem_bytes > args.max_smem) {
      why = "tile needs " + std::to_string(inst.smem_bytes) + " bytes of shared memory, the device allows " +
            std::to_string(args.max_smem);
      continue;
    }
    plan->tile = t;
    return finish_plan(args, inst, plan);
  }
  return "marlin.gemm: no tile configuration fits (" + why + "); " + describe(args, TileConfig{tile_k, tile_n}, plan->m_blocks);
}

std::string describe_plan(const GemmArgs& args, const GemmPlan& plan) {
  const char* kernel = plan.prefill ? "prefill_wgmma" : !plan.small_m ? "tiled" : plan.wgmma ? "small_m_wgmma" : "small_m";
  return describe(args, plan.tile, plan.m_blocks) + " kernel=" + kernel + " m_slices=" + std::to_string(plan.m_slices) +
         " grid=" + std::to_string(plan.grid) + " blocks_per_sm=" + std::to_string(plan.blocks_per_sm) +
         " tiles_per_block=" + std::to_string(plan.tiles_per_block) + " split_parts=" + std::to_string(plan.split_parts) +
         (plan.prefill ? " split_first=" + std::to_string(plan.split_first) + " split_stages=" + std::to_string(plan.split_stages) : "") +
         " clusters=" + (plan.cluster_reduce ? "1" : "0") + " global_reduction=" + (plan.needs_partial ? "1" : "0") +
         (plan.group_sums ? " group_sums=1" : "") + (plan.fixed_g128 ? " fixed_g128=1" : "") + (plan.one_block_regs ? " one_block_regs=1" : "") + " dram_gbps=" + std::to_string(static_cast<long long>(args.dram_gbps)) +
         " wg512_bytes_per_sm=" + std::to_string(wg512_bytes_per_sm(args));
}

std::string launch_gemm(const GemmArgs& args, const GemmPlan& plan, cudaStream_t stream) {
  KernelParams p;
  p.a = static_cast<const int4*>(args.a);
  p.b = static_cast<const int4*>(args.b_q);
  p.s = static_cast<const int4*>(args.scales);
  p.z = static_cast<const int4*>(args.zeros);
  p.c = args.c;
  p.partial = reinterpret_cast<float4*>(args.partial);
  p.locks = args.locks;
  p.m = args.m;
  p.n = args.n;
  p.k = args.k;
  p.lda_int4 = args.lda / 8;
  p.m_slices = plan.m_slices;
  p.tiles_per_block = plan.tiles_per_block;
  p.prefetch = args.pdl;
  p.split_parts = plan.split_parts;
  p.split_first = plan.split_first;
  p.split_stages = plan.split_stages;
  p.fast_sum = args.prefill_fast_sum;
  p.cluster_reduce = plan.cluster_reduce;
  Format f;
  const std::string bad = format_of(args, &f);
  if (!bad.empty()) return bad;
  p.group_shift = f.group_shift;
  if (plan.launch == nullptr)
    return "marlin.gemm: internal error, the plan names no kernel instance; " + describe(args, plan.tile, plan.m_blocks);
  const cudaError_t err = plan.launch(p, plan.grid, plan.smem_bytes, stream, args.pdl, plan.cluster_reduce ? plan.split_parts : 1);
  if (err != cudaSuccess) {
    return std::string("marlin.gemm: kernel launch failed: ") + cudaGetErrorString(err) + "; " +
           describe(args, plan.tile, plan.m_blocks);
  }
  return "";
}

}  // namespace marlin
