// The prefill kernel's dense instances with 128-row tiles (65-255 rows, and the layers where
// prefill.h's prefill_pick_tile_m rates them faster):
// the same ten formats as prefill.cu's 256-row ones.
#include "prefill.h"
#include "prefill_launch.cuh"

namespace marlin {

MARLIN_PREFILL_INSTANCES(128)

}  // namespace marlin
