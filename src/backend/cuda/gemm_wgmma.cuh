// The Hopper (sm_90a, wgmma) form of the fast-mode GEMM for 4-bit weights (sm90/gemm_wgmma.cu). Present when the
// build includes architecture 90 (TANSY_HAVE_WGMMA); gemm() dispatches to it, callers use gemm().
#pragma once
#include <cuda_runtime.h>

#include "backend/cuda/gemm.cuh"

namespace tansy::cuda {

// True when the device is compute capability 9.0 (the only one sm_90a code runs on) with room for the tiles.
bool gemm_wgmma_device();
// Whether the kernel takes 4-bit weights of this group size (a power of two >= 32: the (scale, bias) index is a shift).
inline bool gemm_wgmma_supports(int group) { return group >= 32 && (group & (group - 1)) == 0; }
// gemm() for 4-bit W in fast mode (dense calls, grouped calls with tile_bm 64 or 128); p already validated by gemm().
void gemm_wgmma(const gemm_params& p, cudaStream_t stream);

}  // namespace tansy::cuda
