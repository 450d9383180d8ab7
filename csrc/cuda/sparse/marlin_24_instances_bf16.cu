// The bf16 instances of the 2:4 kernel (marlin_24_instances.cuh lists them), and the choice
// between the two element types.
#include "marlin_24_instances.cuh"

namespace marlin {
namespace sparse24 {

template Instance find<nv_bfloat16>(int mb, int nw, int ms, int stages, int wg, int kw);
extern template Instance find<half>(int mb, int nw, int ms, int stages, int wg, int kw);  // the fp16 file's

Instance find_instance(bool bf16, int mb, int nw, int ms, int stages, int wg, int kw) {
  return bf16 ? find<nv_bfloat16>(mb, nw, ms, stages, wg, kw) : find<half>(mb, nw, ms, stages, wg, kw);
}

}  // namespace sparse24
}  // namespace marlin
