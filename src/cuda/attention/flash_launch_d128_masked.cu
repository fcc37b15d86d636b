// The flash executor's masked launches at head_dim 128, both dtypes, both key tiles (the most
// kernels of one head_dim: their own translation unit beside flash_launch_d128.cu).
#include "cuda/attention/flash_launch.cuh"

namespace sparsa::cuda::flash {

SPARSA_FLASH_LAUNCH_MASKED(, __nv_bfloat16, 128, 64)
SPARSA_FLASH_LAUNCH_MASKED(, __half, 128, 64)
SPARSA_FLASH_LAUNCH_MASKED(, __nv_bfloat16, 128, 128)
SPARSA_FLASH_LAUNCH_MASKED(, __half, 128, 128)

}  // namespace sparsa::cuda::flash
