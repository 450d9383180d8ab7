// The prefill kernel's 2:4 instances with 128-row tiles (where prefill.h's prefill_pick_tile_m
// takes them): the same six formats as prefill_24.cu's.
#include "prefill.h"
#include "prefill_launch.cuh"

namespace marlin {

MARLIN_PREFILL_24_INSTANCES(128)

}  // namespace marlin
