// RMSNorm of bf16 rows: one block per row, 8 bf16 (16 bytes) per load, fp32 sum of squares reduced over the
// block.
#include "backend/cuda/common.cuh"
#include "backend/cuda/norm.cuh"

namespace tansy::cuda {

template <int BLOCK>
__global__ void rms_norm_bf16_kernel(__nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ x,
                                     const float* __restrict__ w, int64_t n, float eps) {
    __shared__ float scratch[32];
    const __nv_bfloat16* xr = x + blockIdx.x * n;
    __nv_bfloat16* yr = y + blockIdx.x * n;
    float ss = 0;
    for (int64_t i = threadIdx.x; i < n; i += BLOCK) {
        const float v = __bfloat162float(xr[i]);
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)n + eps);
    for (int64_t i = threadIdx.x; i < n; i += BLOCK) yr[i] = __float2bfloat16(__bfloat162float(xr[i]) * inv * w[i]);
}

void rms_norm_bf16(uint16_t* y, const uint16_t* x, const float* w, int64_t rows, int64_t n, float eps,
                   cudaStream_t stream) {
    TANSY_CHECK(rows >= 0 && n > 0, "rms_norm rows=%lld n=%lld", (long long)rows, (long long)n);
    if (rows == 0) return;
    constexpr int BLOCK = 256;
    rms_norm_bf16_kernel<BLOCK><<<(unsigned)rows, BLOCK, 0, stream>>>((__nv_bfloat16*)y, (const __nv_bfloat16*)x,
                                                                      w, n, eps);
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
