// conv_patch's block functions for x86-64-v4 (AVX-512): 16-float vectors (conv_patch_blocks.h).
#define BLADE_PATCH_TARGET BLADE_ISA_TARGET("x86-64-v4")
#include "conv_patch_kernels.h"

namespace blade::conv_patch_blocks {
#if BLADE_CONV_PATCH_ISA_VERSIONS
namespace {

BLADE_PATCH_TARGET int64_t patch_block(BLADE_BLOCK_PARAMS) {
  return patch_block_for<float_vectors::Floats16>(BLADE_BLOCK_ARGS);
}
BLADE_PATCH_TARGET int64_t image_block(BLADE_BLOCK_PARAMS) {
  return image_block_for<float_vectors::Floats16>(BLADE_BLOCK_ARGS);
}

}  // namespace

BlockKernels x86_64_v4_blocks() { return {patch_block, image_block}; }
#endif
}  // namespace blade::conv_patch_blocks
