// The Marlin tile orders of marlin/packing.py, for the C++ reference: where each weight of a
// 16 x 64 tile sits among the tile's int32 words. Must match packing._tile_order(bits).
#pragma once

#include <array>
#include <cstdint>

namespace marlin {

constexpr int kInterleave4[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // 4-bit: nibble p holds fragment element kInterleave4[p]
constexpr int kInterleave8[4] = {0, 2, 1, 3};              // 8-bit: byte p holds fragment element kInterleave8[p]

// Row (k) and column (n) inside the tile of the B fragment element e (0..7) of lane (g = lane / 4,
// c = lane % 4) in 16-column block j: elements 0..3 are rows 2c, 2c+1, 2c+8, 2c+9 of column
// 16j + g, elements 4..7 the same rows of column 16j + 8 + g (mma.m16n8k16's B operand).
inline int fragment_k(int c, int e) { return 2 * c + (e % 4) % 2 + 8 * ((e % 4) / 2); }
inline int fragment_n(int g, int j, int e) { return 16 * j + 8 * (e / 4) + g; }

// For (k, n) inside a tile, flattened as k * 64 + n: the value's slot counted in values, so that
// word = slot / values_per_word and position in the word = slot % values_per_word.
//   4-bit: 128 words, slot = 32 * lane + 8 * j + nibble       (lane's 4 words, one per block j)
//   8-bit: 256 words, slot = 32 * lane + 4 * (2j + h) + byte  (lane's 8 words; h = column half)
inline const std::array<int16_t, 1024>& tile_slot_of(int bits) {
  static const auto make = [](int b) {
    std::array<int16_t, 1024> t{};
    for (int lane = 0; lane < 32; lane++) {
      const int g = lane / 4, c = lane % 4;
      for (int j = 0; j < 4; j++) {
        for (int e = 0; e < 8; e++) {
          int slot;
          if (b == 4) {
            int nibble = 0;
            while (kInterleave4[nibble] != e) nibble++;
            slot = 32 * lane + 8 * j + nibble;
          } else {
            int byte = 0;
            while (kInterleave8[byte] != e % 4) byte++;
            slot = 32 * lane + 4 * (2 * j + e / 4) + byte;
          }
          t[fragment_k(c, e) * 64 + fragment_n(g, j, e)] = static_cast<int16_t>(slot);
        }
      }
    }
    return t;
  };
  static const std::array<int16_t, 1024> t4 = make(4), t8 = make(8);
  return bits == 4 ? t4 : t8;
}

// Position of column c (0..63) of a 64-column chunk in the permuted (grouped) scale layout;
// zero points use the same layout.
inline int scale_position(int c) { return 8 * (c % 8) + c / 8; }

}  // namespace marlin
