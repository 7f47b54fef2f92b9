// The fp32 reference ops of the CPU backend, exposed so tests can call each piece on its own (yalm's
// "exposed for tests" block). Plain loops, fp32 accumulation, OpenMP over independent work, no fast-math.
// Layouts follow backend.h; all pointers are host fp32 unless noted.
#pragma once
#include <cstdint>

#include "model/weights.h"

namespace tansy::cpu {

// out[T, W.rows] = in[T, W.cols] W^T, dequantising W one row at a time.
void matmul(float* out, const float* in, int64_t T, const matrix& W);

float dot(const float* a, const float* b, int64_t n);

// out[t] = in[t] / sqrt(mean(in[t]^2) + eps) * w   (rows of length n)
void rms_norm(float* out, const float* in, int64_t T, int64_t n, const float* w, float eps);

// Rotate-half (NeoX) RoPE on the first rope_dim entries of one head vector u at position pos.
void rope_neox(float* u, int64_t rope_dim, int64_t pos, double theta);

// Causal depthwise conv1d + SiLU over T tokens of C channels, continuing from `state` [(K-1), C] (oldest
// first, the raw pre-conv inputs) and leaving the last K-1 inputs in it. w [C, K]; x [T, C] in, y [T, C] out
// (y may not alias x).
void conv1d_silu(float* y, const float* x, float* state, const float* w, int64_t T, int64_t C, int64_t K);

// Delta-rule inputs for one span, per value head h (key head h / (Hv/Hk)): qn, kn [T, Hk, dk] already L2
// normalised (q also scaled by 1/sqrt(dk)), v [T, Hv, dv], beta and g [T, Hv]. S [Hv, dk, dv] fp32 state,
// updated. o [T, Hv, dv].
struct delta_args {
    const float *q, *k, *v, *beta, *g;
    float* S;
    float* o;
    int64_t T, Hk, Hv, dk, dv;
};
void delta_rule_recurrent(const delta_args& a);                   // MODEL.md §4.6
void delta_rule_chunked(const delta_args& a, int64_t chunk = 64);  // MODEL.md §4.7

// y[t,h] = (o[t,h] / rms(o[t,h])) * w * silu(z[t,h]) over heads of length dv.
void gated_rms_norm(float* y, const float* o, const float* z, const float* w, int64_t T, int64_t Hv, int64_t dv,
                    float eps);

// Router: softmax over E logits, top-k (ties to the lower expert id), renormalised weights.
// idx [T, k] sorted by descending weight, w [T, k].
void moe_route(int32_t* idx, float* w, const float* logits, int64_t T, int64_t E, int64_t k);

// One row's log-prob record (sampling/logprobs.h: k_logprob_words words) from its raw logits row[0, n_valid):
// the log-sum-exp (in double, then rounded), row[chosen], and the top `top` (id, logit), top <= k_max_top_logprobs.
void logprob_record(int32_t* rec, const float* row, int64_t n_valid, int32_t chosen, int top);

}  // namespace tansy::cpu
