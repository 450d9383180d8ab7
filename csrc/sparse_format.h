// The 2:4 metadata order of marlin/sparse.py, for the C++ reference: where the index nibble of
// each (group of 4 rows, column) of a 32 x 64 strip tile sits among the tile's 64 int32 words of
// b_meta. Must match sparse._meta_order(). The values themselves use the dense tile order of
// format_tables.h on the compressed [K/2, N] matrix.
#pragma once

#include <array>
#include <cstdint>

namespace marlin {

// For group go (0..7 of the strip) and tile column col (0..63), flattened as go * 64 + col:
// slot = 8 * word + nibble, word = 2 * lane + r.
inline const std::array<int16_t, 512>& meta_slot_of() {
  static const std::array<int16_t, 512> table = [] {
    std::array<int16_t, 512> t{};
    for (int lane = 0; lane < 32; lane++) {
      const int g = lane / 4, c = lane % 4;
      for (int r = 0; r < 2; r++) {
        const int j = 2 * (c / 2) + r;  // 16-column block: lanes c = 0, 1 hold blocks 0, 1; c = 2, 3 blocks 2, 3
        for (int p = 0; p < 8; p++) {
          const int go = 4 * (c % 2) + p % 4;  // c even: K rows 0..15 of the strip, odd: 16..31
          const int col = 16 * j + g + 8 * (p / 4);
          t[go * 64 + col] = static_cast<int16_t>(8 * (2 * lane + r) + p);
        }
      }
    }
    return t;
  }();
  return table;
}

}  // namespace marlin
