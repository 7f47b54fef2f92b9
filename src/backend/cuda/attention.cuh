// Gated full attention on the device (MODEL.md §3): prep (q/k norm, partial RoPE, KV append), split-K flash
// decoding that reads each KV head once for its query-head group, and the combine with the sigmoid gate;
// a tensor-core causal flash-attention kernel for the rows of long spans (prompt processing).
#pragma once
#include <cuda_runtime.h>

#include "backend/cuda/kernel_plan.h"
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
    const dseq* seqs = nullptr;     // [n_spans], indexed like spans
    const dspan* spans = nullptr;   // [n_spans] device
    int n_spans = 0;
    int min_span = 0, max_span = 0; // host copies of the shortest / longest span: which kernels to launch
    dshape shape;
    int slot = 0;
    // workspace
    float* q = nullptr;         // [T, Hq, dh] normed + rotated queries
    float* part_o = nullptr;    // [T, Hq, n_splits, dh]
    float* part_ml = nullptr;   // [T, Hq, n_splits, 2]
    int n_splits = 0;
    bool q_bf16 = false;  // decode: q as one bf16 per value, as attention_prefill takes it (fast mode), not hi + lo
    // output
    float* out = nullptr;       // [T, Hq*dh]
};

// Writes p.q and appends K/V of every row at its position (n_past of its sequence + offset).
void attention_prep(const attn_params& p, cudaStream_t stream);

// Rows of spans of at least k_attn_prefill_min_rows rows (kernel_plan.h) go to attention_prefill, the others here:
// split-K partials then the combine (with the output gate) into p.out, for the rows of short spans.
void attention_decode(const attn_params& p, cudaStream_t stream);
// Causal flash attention (tensor cores) with the output gate into p.out, for the rows of long spans. Run
// after attention_prep, with attention_decode, on the same params: each writes only its own rows.
void attention_prefill(const attn_params& p, cudaStream_t stream);
// Forces attention_prefill's variant for the whole process (tests): query heads per CTA (1 or 2) and keys per
// tile (32 or 64); 0 = the largest that the head grouping and the device's shared memory allow (the default).
void force_attention_prefill_variant(int heads_per_cta, int block_n);
// Context slices per (row, KV head) of the decode path for a batch of `rows` rows: one wave of blocks over the
// SMs, at most 64 (attention.cu), unless a test forced another count (force_attention_splits; 0 = none), so that
// short test contexts still give a block many key tiles.
int attention_splits(int rows, int kv_heads);
void force_attention_splits(int n);

}  // namespace tansy::cuda
