// Gated DeltaNet on the device (MODEL.md §4): conv (double-buffered state) + SiLU + L2 norms + gates + the
// delta rule, then the gated RMSNorm. Two paths, routed by span length inside gdn_forward:
//  - decode (spans of <= k_gdn_recur_max_rows rows): one block per (sequence, value head, 32 value columns)
//    walks the span's tokens with the state slice in registers, or for batches of many sequences one block per
//    (sequence, value head) with the head's state staged in shared memory (gdn.cu);
//  - prefill (longer spans): a parallel prep kernel (conv, norms, gates) into a workspace, then either the
//    chunk-parallel form (MODEL.md §4.7: per (chunk, head) the intra-chunk matrices in parallel, then a scan over
//    chunks carrying the fp32 state; the default) or a token-by-token scan with the state in registers
//    (gdn_params::chunked = false), both in gdn_prefill.cu.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#include "backend/cuda/kernel_plan.h"
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
    // batch and state: the spans tile the T rows in order, each with at least one row
    const dspan* spans = nullptr;  // [n_spans]
    const dseq* seqs = nullptr;    // [n_spans], same order
    // [n_spans]: for a span with dspan::mark > 0, the checkpoint state that receives its conv window (parity 0),
    // S and meta {position, 0} at the mark (seq_span::mark); other entries are not read
    const dseq* marks = nullptr;
    int n_spans = 0;
    dshape shape;
    int slot = 0;
    // workspace for the prefill path (spans of more than k_gdn_recur_max_rows rows), 16-byte aligned,
    // gdn_prefill_workspace_floats(T, ..., chunked) floats: q^ [T, Hk*dk] | k^ [T, Hk*dk] | (beta, alpha)
    // [Hv, T, 2] (the chunked form replaces alpha by the chunk's cumulative log decay gamma), then for the
    // chunked form (I+L)^-1 and A rows [Hv, T, 64] each
    float* work = nullptr;
    bool chunked = true;  // prefill spans in the chunk-parallel form (MODEL.md §4.7), else token by token
    // rows of the longest span: the chunked form's grid (its chunk count), and the decode forms' choice (1: a bf16
    // state stays bf16 in shared memory, which is exact only when no span has a second token)
    int max_span = 0;
    bool any_mark = false;  // some span has a mark (its chunks restart there: one chunk more at most)
    // outputs
    float* o = nullptr;    // [T, Hv*dv] delta-rule output (before the gated norm); the prefill path stages v here
    float* out = nullptr;  // [T, Hv*dv] gated-normed
};

// Spans of at most k_gdn_recur_max_rows rows (kernel_plan.h) take the token-by-token decode kernel; longer ones
// the prep + scan path.

constexpr int k_gdn_chunk = 64;  // rows per chunk of the chunk-parallel form (MODEL.md §4.7)

// Offset of the chunked form's matrices in gdn_params::work (16-byte aligned).
__host__ __device__ inline size_t gdn_work_chunk_offset(int64_t T, int64_t Hk, int64_t Hv, int64_t dk) {
    return ((size_t)T * (size_t)(2 * Hk * dk + 2 * Hv) + 3) / 4 * 4;
}

// Floats of gdn_params::work for a batch of T rows (whatever the span lengths). At the prefill chunk of 8192
// rows of the real model: 136 MB, and 134 MB more for the chunked form.
inline size_t gdn_prefill_workspace_floats(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t /*dv*/,
                                           bool chunked) {
    return gdn_work_chunk_offset(T, Hk, Hv, dk) + (chunked ? 2 * (size_t)Hv * (size_t)T * k_gdn_chunk : 0);
}

// CPU twins: cpu::conv1d_silu, cpu::delta_rule_recurrent, cpu::gated_rms_norm.
void gdn_forward(const gdn_params& p, cudaStream_t stream);

// The prefill path alone (gdn_forward routes to it): prep + scan for the spans of at least min_rows rows,
// writing their rows of p.o (before the gated norm), their state and conv window. Needs p.work.
void gdn_prefill(const gdn_params& p, int min_rows, cudaStream_t stream);

}  // namespace tansy::cuda

#if defined(__CUDACC__)
#include "backend/cuda/common.cuh"  // bf16x2_bits_to_float2, cuda_bf16.h

namespace tansy::cuda {
// Shared by gdn.cu and gdn_prefill.cu. softplus(x) = log(1 + e^x), the identity above 20 (as PyTorch).
__device__ __forceinline__ float gdn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// The recurrent state's storage (dshape::s16): fp32, or bf16 rounded to nearest even where a kernel stores it (a
// span's end, a mark), as the CPU twin rounds its state after each span part. Values are fp32 in between.
__device__ __forceinline__ float state_ld(const float* p) { return *p; }
__device__ __forceinline__ float state_ld(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void state_st(float* p, float v) { *p = v; }
__device__ __forceinline__ void state_st(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ float2 state_ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 state_ld2(const __nv_bfloat16* p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ void state_st2(float* p, float2 v) { *reinterpret_cast<float2*>(p) = v; }
__device__ __forceinline__ void state_st2(__nv_bfloat16* p, float2 v) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __float22bfloat162_rn(v);
}
__device__ __forceinline__ float4 state_ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 state_ld4(const __nv_bfloat16* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 lo = bf16x2_bits_to_float2(u.x), hi = bf16x2_bits_to_float2(u.y);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ void state_st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void state_st4(__nv_bfloat16* p, float4 v) {
    const __nv_bfloat162 lo = __float22bfloat162_rn(make_float2(v.x, v.y));
    const __nv_bfloat162 hi = __float22bfloat162_rn(make_float2(v.z, v.w));
    *reinterpret_cast<uint2*>(p) =
        make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}
// v as a store of TS would keep it (a state carried on past a mark continues from what the checkpoint holds).
template <class TS>
__device__ __forceinline__ float state_round(float v) {
    if constexpr (sizeof(TS) == 2) return __bfloat162float(__float2bfloat16_rn(v));
    else return v;
}

// Calls f with a value of the state's storage type (float, or __nv_bfloat16 where s16): kernels instantiated for
// both are launched through it.
template <class F>
void with_state_type(bool s16, F&& f) {
    if (s16) f(__nv_bfloat16{});
    else f(float{});
}
}  // namespace tansy::cuda
#endif
