// conv_patch's block functions for any CPU (baseline x86-64, or any other target): 8-float vectors
// (conv_patch_blocks.h).
#include "conv_patch_kernels.h"

namespace blade::conv_patch_blocks {
namespace {

int64_t patch_block(BLADE_BLOCK_PARAMS) { return patch_block_for<float_vectors::Floats8>(BLADE_BLOCK_ARGS); }
int64_t image_block(BLADE_BLOCK_PARAMS) { return image_block_for<float_vectors::Floats8>(BLADE_BLOCK_ARGS); }

}  // namespace

BlockKernels baseline_blocks() { return {patch_block, image_block}; }
}  // namespace blade::conv_patch_blocks
