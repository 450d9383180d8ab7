// The prefill kernel's dense instances with 128-row tiles (for 65-255 rows, MARLIN_PREFILL_ROWS=128):
// the same ten formats as prefill.cu's 256-row ones.
#include "prefill.h"
#include "prefill_launch.cuh"

namespace marlin {

MARLIN_PREFILL_INSTANCES(128)

}  // namespace marlin
