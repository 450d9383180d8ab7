// The bf16 instances of the 2:4 kernel, plain kernels (marlin_24_instances.cuh lists them), and
// the choice among the four instance sets.
#include "marlin_24_instances.cuh"

namespace marlin {
namespace sparse24 {

template Instance find<nv_bfloat16, false>(int mb, int nw, int ms, int stages, int wg, int kw);
// the other files'
extern template Instance find<nv_bfloat16, true>(int mb, int nw, int ms, int stages, int wg, int kw);
extern template Instance find<half, false>(int mb, int nw, int ms, int stages, int wg, int kw);
extern template Instance find<half, true>(int mb, int nw, int ms, int stages, int wg, int kw);

Instance find_instance(bool bf16, bool fine, int mb, int nw, int ms, int stages, int wg, int kw) {
  if (bf16)
    return fine ? find<nv_bfloat16, true>(mb, nw, ms, stages, wg, kw) : find<nv_bfloat16, false>(mb, nw, ms, stages, wg, kw);
  return fine ? find<half, true>(mb, nw, ms, stages, wg, kw) : find<half, false>(mb, nw, ms, stages, wg, kw);
}

}  // namespace sparse24
}  // namespace marlin
