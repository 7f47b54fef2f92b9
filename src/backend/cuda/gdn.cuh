// Gated DeltaNet on the device (MODEL.md §4): conv (double-buffered state) + SiLU + L2 norms + gates + the
// recurrent delta rule, one block per (sequence, value head, 32 value columns) with the state slice in
// registers; then the gated RMSNorm.
#pragma once
#include <cuda_runtime.h>

#include "backend/cuda/seq_layout.h"

namespace tansy::cuda {

struct gdn_params {
    const float* qkv = nullptr;  // [T, C] raw in_proj_qkv output
    const float* b = nullptr;    // [T, Hv]
    const float* a = nullptr;    // [T, Hv]
    const float* z = nullptr;    // [T, Hv*dv]
    const float* conv_w = nullptr;   // [C, K]
    const float* A_log = nullptr;    // [Hv]
    const float* dt_bias = nullptr;  // [Hv]
    const float* norm_w = nullptr;   // [dv]
    int T = 0, Hk = 0, Hv = 0, dk = 0, dv = 0, K = 0;
    float eps = 1e-6f;
    // batch and state
    const dspan* spans = nullptr;  // [n_spans]
    const dseq* seqs = nullptr;    // [n_spans], same order
    int n_spans = 0;
    dshape shape;
    int slot = 0;
    // outputs
    float* o = nullptr;    // [T, Hv*dv] delta-rule output (before the gated norm)
    float* out = nullptr;  // [T, Hv*dv] gated-normed
};

// CPU twins: cpu::conv1d_silu, cpu::delta_rule_recurrent, cpu::gated_rms_norm.
void gdn_forward(const gdn_params& p, cudaStream_t stream);

}  // namespace tansy::cuda
