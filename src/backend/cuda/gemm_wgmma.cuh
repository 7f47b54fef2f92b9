// The Hopper (sm_90a, wgmma) form of the fast-mode GEMM for 4-bit weights (sm90/gemm_wgmma.cu). Present when the
// build includes architecture 90 (TANSY_HAVE_WGMMA); gemm() dispatches to it, callers use gemm().
#pragma once
#include <cuda_runtime.h>

#include "backend/cuda/gemm.cuh"
#include "backend/cuda/kernel_plan.h"

namespace tansy::cuda {

// True when the device is compute capability 9.0 (the only one sm_90a code runs on) with room for the tiles.
bool gemm_wgmma_device();
// Whether the kernel takes 4-bit weights of this group size (a power of two >= 32: the (scale, bias) index is a shift).
inline bool gemm_wgmma_supports(int group) { return group >= 32 && (group & (group - 1)) == 0; }
// Token rows of a dense call's tiles (kernel_plan.h: k_gemm_wgmma_dense_tokens from k_gemm_wide_min_rows rows, else
// 64; grouped calls: p.tile_bm) and the kernel's CTAs an SM at that width.
inline int gemm_wgmma_tile_tokens(const gemm_params& p) {
    return p.tiles ? p.tile_bm : p.M >= k_gemm_wide_min_rows ? k_gemm_wgmma_dense_tokens : 64;
}
inline int gemm_wgmma_ctas_per_sm(int tokens) { return tokens <= k_gemm_wgmma_moe_tokens ? 2 : 1; }
// gemm() for 4-bit W in fast mode (dense calls, grouped calls with tile_bm 64, 80 or 128); p already validated by gemm().
void gemm_wgmma(const gemm_params& p, cudaStream_t stream);

}  // namespace tansy::cuda
