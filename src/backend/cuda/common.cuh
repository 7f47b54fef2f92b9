// Shared CUDA helpers: error checking, warp/block reductions, bf16 conversions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/check.h"

#define CUDA_CHECK(expr)                                                                                   \
    do {                                                                                                   \
        cudaError_t err_ = (expr);                                                                         \
        if (err_ != cudaSuccess) {                                                                         \
            int dev_ = -1;                                                                                 \
            cudaGetDevice(&dev_);                                                                          \
            ::tansy::abort_at(__FILE__, __LINE__, #expr, "CUDA error %s (%s) on device %d",              \
                              cudaGetErrorName(err_), cudaGetErrorString(err_), dev_);                    \
        }                                                                                                  \
    } while (0)

// After every launch: launch-configuration errors surface here, not at the next sync.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

namespace tansy::cuda {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block; every thread gets the result. `scratch` holds at least 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

}  // namespace tansy::cuda
