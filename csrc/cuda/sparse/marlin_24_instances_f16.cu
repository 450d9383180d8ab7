// The fp16 instances of the 2:4 kernel, plain kernels (marlin_24_instances.cuh lists them).
#include "marlin_24_instances.cuh"

namespace marlin {
namespace sparse24 {

template Instance find<half, false>(int mb, int nw, int ms, int stages, int wg, int kw);

}  // namespace sparse24
}  // namespace marlin
