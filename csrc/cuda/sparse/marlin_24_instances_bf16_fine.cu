// The bf16 instances of the 2:4 kernel for groups of 64 or 32 rows and zero points (the FINE
// kernels; marlin_24_instances.cuh lists them).
#include "marlin_24_instances.cuh"

namespace marlin {
namespace sparse24 {

template Instance find<nv_bfloat16, true>(int mb, int nw, int ms, int stages, int wg, int kw);

}  // namespace sparse24
}  // namespace marlin
