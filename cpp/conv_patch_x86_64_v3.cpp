// conv_patch's block functions for x86-64-v3 (AVX2 with FMA): 8-float vectors (conv_patch_blocks.h).
#define BLADE_PATCH_TARGET BLADE_ISA_TARGET("x86-64-v3")
#include "conv_patch_kernels.h"

namespace blade::conv_patch_blocks {
#if BLADE_CONV_PATCH_ISA_VERSIONS
namespace {

BLADE_PATCH_TARGET int64_t patch_block(BLADE_BLOCK_PARAMS) {
  return patch_block_for<float_vectors::Floats8>(BLADE_BLOCK_ARGS);
}
BLADE_PATCH_TARGET int64_t image_block(BLADE_BLOCK_PARAMS) {
  return image_block_for<float_vectors::Floats8>(BLADE_BLOCK_ARGS);
}

}  // namespace

BlockKernels x86_64_v3_blocks() { return {patch_block, image_block}; }
#endif
}  // namespace blade::conv_patch_blocks
