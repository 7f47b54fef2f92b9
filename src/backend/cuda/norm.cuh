// RMSNorm launchers (kernels are static in norm.cu).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace tansy::cuda {

// y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, rows of n bf16 values, fp32 math, w fp32 [n].
// CPU twin: cpu::rms_norm.
void rms_norm_bf16(uint16_t* y, const uint16_t* x, const float* w, int64_t rows, int64_t n, float eps,
                   cudaStream_t stream);

}  // namespace tansy::cuda
