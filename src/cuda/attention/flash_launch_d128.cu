// The flash executor's launches at head_dim 128, both dtypes (flash_launch.cuh: one translation
// unit a head_dim, compiled in parallel).
#include "cuda/attention/flash_launch.cuh"

namespace sparsa::cuda::flash {

SPARSA_FLASH_LAUNCH_TILES(, __nv_bfloat16, 128)
SPARSA_FLASH_LAUNCH_TILES(, __half, 128)

}  // namespace sparsa::cuda::flash
