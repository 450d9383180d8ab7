// The prefill kernel's instances (fp16 / bf16; 4-bit in groups, per column or in groups with zero
// points; 8-bit in groups or per column), their tensor maps and their launch.
#include "prefill.h"

#include <algorithm>
#include <utility>

#include "../marlin_gemm.h"  // max_locks
#include "prefill_launch.cuh"

namespace marlin {

static_assert(PrefillShape<>::kTileN == kPrefillTileN && PrefillShape<>::kTileM == kPrefillTileM &&
                  PrefillShape<>::kTileK == kPrefillTileK,
              "prefill.h and prefill_kernel.cuh disagree on the tile");
static_assert(PrefillShape<4, true, kPrefillTileMShort>::kTileM == kPrefillTileMShort, "the short tile");

int prefill_smem_bytes(int bits, int tile_m) {
  if (tile_m == kPrefillTileMShort) return bits == 8 ? PrefillShape<8, false, 128>::kSmemBytes : PrefillShape<4, false, 128>::kSmemBytes;
  return bits == 8 ? PrefillShape<8>::kSmemBytes : PrefillShape<4>::kSmemBytes;
}

namespace {

// The fewest rows the kernel takes: 256 with 256-row tiles (at 128 rows such a tile is half empty
// and the decode kernels are far ahead), more than the wgmma variant's 64-row slice with 128-row ones.
long long prefill_min_rows(int tile_m) { return tile_m == kPrefillTileMShort ? 65 : 256; }

long long prefill_tiles(long long m, long long n, int tile_m) { return (m + tile_m - 1) / tile_m * (n / kPrefillTileN); }

// The last round's split (prefill.h): its first tile and parts; {0, 1} for none; parts
// kPrefillStreamK: every tile in one stream-K range over the grid (128-row tiles only).
std::pair<long long, int> tail_split(long long tiles, long long k, int sms, int forced_parts, int tile_m) {
  const long long k_tiles = k / kPrefillTileK;
  if (forced_parts == kPrefillStreamK) return {0, kPrefillStreamK};
  if (forced_parts > 0) return {0, static_cast<int>(std::max(1LL, std::min<long long>(forced_parts, k_tiles)))};
  const long long left = tiles % sms;  // tiles of the last round (all of them below one round)
  if (left == 0) return {0, 1};
  if (2 * left > sms) {
    // a single round more than half full: stream-K where its pieces (a block's share of the
    // stages plus a cut tile's partial sums) come out shorter than a whole tile
    const double share = static_cast<double>(left * k_tiles) / sms;
    const bool sk = tile_m == kPrefillTileMShort && tiles < sms && share >= kPrefillMinPartStages &&
                    share + kPrefillSplitStages < kPrefillStreamKShare * static_cast<double>(k_tiles);
    return sk ? std::pair<long long, int>{0, kPrefillStreamK} : std::pair<long long, int>{0, 1};
  }
  const long long parts = std::min<long long>({kPrefillMaxParts, sms / left, k_tiles / kPrefillMinPartStages});
  return parts < 2 ? std::pair<long long, int>{0, 1} : std::pair<long long, int>{tiles - left, static_cast<int>(parts)};
}

// prefill_pick_tile_m's model: the time of the schedule's rounds, in 256-row stage times.
struct RoundCostModel {
  double unit_fixed;   // stage times per unit beyond its K stages
  double short_stage;  // a 128-row stage, in 256-row stage times
  double split_chain;  // stage times a split tile's last part spends on the others' partials, beyond its lead
};
constexpr RoundCostModel kGroupScalesModel{4.0, 0.6, 4.0};
constexpr RoundCostModel kPerColumnModel{0.0, 0.56, 12.0};
constexpr RoundCostModel kSparse24Model{4.0, 0.6, 10.0};

const RoundCostModel& round_cost_model(PrefillRoundModel kind) {
  switch (kind) {
    case PrefillRoundModel::kPerColumn: return kPerColumnModel;
    case PrefillRoundModel::kSparse24: return kSparse24Model;
    default: return kGroupScalesModel;
  }
}

double schedule_cost(long long m, long long n, long long k, int sms, int tile_m, const RoundCostModel& model) {
  const long long tiles = prefill_tiles(m, n, tile_m);
  const auto [first, parts] = tail_split(tiles, k, sms, 0, tile_m);
  const double stage = tile_m == kPrefillTileMShort ? model.short_stage : 1.0;
  const double k_tiles = static_cast<double>(k / kPrefillTileK);
  const long long whole = parts > 1 ? first : tiles;  // tiles that run unsplit
  if (parts == kPrefillStreamK)  // one round, every block a share of the stages and a cut tile
    return model.unit_fixed + (static_cast<double>(tiles) * k_tiles / sms + kPrefillSplitStages) * stage;
  double cost = static_cast<double>(whole / sms) * (model.unit_fixed + k_tiles * stage);
  if (parts > 1)
    cost += model.unit_fixed + (k_tiles / parts + kPrefillSplitLead * (1.0 - 1.0 / parts) + model.split_chain) * stage;
  else if (whole % sms != 0)
    cost += model.unit_fixed + k_tiles * stage;
  return cost;
}

}  // namespace

int prefill_pick_tile_m(long long m, long long n, long long k, int sms, int forced, PrefillRoundModel kind) {
  if (forced == kPrefillTileM || forced == kPrefillTileMShort) return forced;
  if (m < prefill_min_rows(kPrefillTileM)) return kPrefillTileMShort;
  const RoundCostModel& model = round_cost_model(kind);
  return schedule_cost(m, n, k, sms, kPrefillTileMShort, model) < schedule_cost(m, n, k, sms, kPrefillTileM, model)
             ? kPrefillTileMShort
             : kPrefillTileM;
}

bool prefill_pays(long long m, long long n, long long k, int sms, double min_fill, int tile_m) {
  const long long tiles = prefill_tiles(m, n, tile_m);
  const int tail_parts = tail_split(tiles, k, sms, 0, tile_m).second;
  // a stream-K round is as full as its tiles make it; a split one counts 1 / its parts
  const double tail = tail_parts == kPrefillStreamK ? static_cast<double>(tiles % sms) / sms : 1.0 / tail_parts;
  const double rounds = static_cast<double>(tiles / sms) + (tiles % sms != 0 ? tail : 0.0);
  return m >= prefill_min_rows(tile_m) && static_cast<double>(tiles) >= min_fill * rounds * sms;
}

PrefillSchedule prefill_schedule(long long m, long long n, long long k, int sms, int forced_parts, int tile_m, int lead) {
  const long long tiles = prefill_tiles(m, n, tile_m);
  auto [first, parts] = tail_split(tiles, k, sms, forced_parts, tile_m);
  // stream-K needs a stage per block, and the kernel's stage arithmetic in 32 bits (stages x grid
  // below 2^31: prefill_kernel.cuh)
  if (parts == kPrefillStreamK && (tiles * (k / kPrefillTileK) < sms || tiles * (k / kPrefillTileK) * sms >= (1LL << 31))) parts = 1;
  if (parts > 1 && tiles - first > max_locks(sms)) first = 0, parts = 1;
  PrefillSchedule s;
  if (parts == kPrefillStreamK) {
    // every block of the grid one share of the stages of all tiles; cut tiles' partials in two
    // slots per block, one lock per block
    s.grid = sms;
    s.parts = kPrefillStreamK;
    s.split_first = 0;  // tail_split gives stream-K every tile; the kernel assumes it
    s.partial_floats = 2LL * sms * kPrefillTileN * tile_m;
    s.locks = sms;
    return s;
  }
  const long long split_tiles = parts > 1 ? tiles - first : 0;
  const long long units = split_tiles > 0 ? first + split_tiles * parts : tiles;
  s.grid = static_cast<int>(std::min<long long>(units, sms));
  s.parts = parts;
  s.split_first = static_cast<int>(split_tiles > 0 ? first : tiles);
  s.partial_floats = split_tiles * parts * kPrefillTileN * tile_m;
  s.locks = static_cast<int>(split_tiles);
  // each part but the last: (k_tiles - lead) / parts stages, at least one; the last the rest
  if (lead < 0) lead = kPrefillSplitLead;
  if (split_tiles > 0 && lead > 0) s.split_stages = static_cast<int>(std::max(1LL, (k / kPrefillTileK - lead) / parts));
  return s;
}

MARLIN_PREFILL_INSTANCES(256)  // the 128-row ones: prefill_m128.cu

}  // namespace marlin
