// The Marlin tile order of marlin/packing.py, for the C++ reference: where each weight of a
// 16 x 64 tile sits among the tile's 128 int32 words. Must match packing._tile_order().
#pragma once

#include <array>
#include <cstdint>

namespace marlin {

constexpr int kInterleave[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // nibble p holds fragment element kInterleave[p]

// For (k, n) inside a tile, flattened as k * 64 + n: slot = 32 * lane + 8 * word + nibble.
inline const std::array<int16_t, 1024>& tile_slot_of() {
  static const std::array<int16_t, 1024> table = [] {
    std::array<int16_t, 1024> t{};
    for (int lane = 0; lane < 32; lane++) {
      const int g = lane / 4, c = lane % 4;
      for (int word = 0; word < 4; word++) {
        for (int nibble = 0; nibble < 8; nibble++) {
          const int e = kInterleave[nibble];
          const int half = e / 4, r = e % 4;
          const int k = 2 * c + (r % 2) + 8 * (r / 2);
          const int n = 16 * word + 8 * half + g;
          t[k * 64 + n] = static_cast<int16_t>(32 * lane + 8 * word + nibble);
        }
      }
    }
    return t;
  }();
  return table;
}

// Position of column c (0..63) of a 64-column chunk in the permuted (grouped) scale layout.
inline int scale_position(int c) { return 8 * (c % 8) + c / 8; }

}  // namespace marlin
