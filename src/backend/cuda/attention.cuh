// Gated full attention on the device (MODEL.md §3): prep (q/k norm, partial RoPE, KV append), split-K flash
// decoding that reads each KV head once for its query-head group, and the combine with the sigmoid gate.
#pragma once
#include <cuda_runtime.h>

#include "backend/cuda/seq_layout.h"

namespace tansy::cuda {

struct attn_params {
    // inputs [T, ...] fp32
    const float* qg = nullptr;  // [T, Hq*2*dh] per head: query | gate
    const float* k = nullptr;   // [T, Hkv*dh]
    const float* v = nullptr;
    const float* q_norm = nullptr;  // [dh]
    const float* k_norm = nullptr;
    int T = 0, Hq = 0, Hkv = 0, dh = 0, rope_dim = 0;
    float eps = 1e-6f;
    const double* inv_freq = nullptr;  // [rope_dim/2] device
    // batch and state
    const drow* rows = nullptr;
    const dseq* seqs = nullptr;
    dshape shape;
    int slot = 0;
    // workspace
    float* q = nullptr;         // [T, Hq, dh] normed + rotated queries
    float* part_o = nullptr;    // [T, Hq, n_splits, dh]
    float* part_ml = nullptr;   // [T, Hq, n_splits, 2]
    int n_splits = 0;
    // output
    float* out = nullptr;       // [T, Hq*dh]
};

// Writes p.q and appends K/V of every row at its position (n_past of its sequence + offset).
void attention_prep(const attn_params& p, cudaStream_t stream);
// Split-K partials then the combine (with the output gate) into p.out.
void attention_decode(const attn_params& p, cudaStream_t stream);

}  // namespace tansy::cuda
