// The MoE decode families' shared pieces and entry points (moe_route/general/decode_stream/decode_warp/
// decode_mma.cu), for moe.cu's dispatch alone: not a launcher header (the backend and tests use moe.cuh).
#pragma once
#include "backend/cuda/moe.cuh"
#include "backend/cuda/stream.cuh"
#include "backend/cuda/topk.cuh"

namespace tansy::cuda::moe_impl {

inline int chunk_of(dfmt f) { return f == dfmt::q4 ? 32 : f == dfmt::q8 ? 16 : 8; }

// Writes token t's routing (lane 0 of the calling warp).
__device__ __forceinline__ void store_route(const moe_routing& r, int t, int E, int k, const int (&chosen)[k_max_topk],
                                            const float (&wt)[k_max_topk]) {
#pragma unroll
    for (int j = 0; j < k_max_topk; j++)
        if (j < k) r.idx[t * k + j] = chosen[j], r.wt[t * k + j] = wt[j];
    r.sig[t] = sigmoidf_(r.logits[t * r.ld + E]);
}

// sum_i w_i x_i over a chunk from d, its dot product with the codes (affine: scale d + bias sum x) or values.
template <dfmt F>
__device__ __forceinline__ float affine_or_dense(float d, uint32_t sb, float sx) {
    if constexpr (F == dfmt::bf16)
        return d;
    else
        return sb_scale(sb) * d + sb_bias(sb) * sx;
}
template <dfmt F>
__device__ __forceinline__ float affine_or_dense(const uint4& w, uint32_t sb, const float* xv, float sx) {
    return affine_or_dense<F>(chunk_dot<F>(w, xv, sx), sb, sx);
}

// Tile j of a gate/up block (tiles of tr rows per slot, block-strided over the k+1 slots): slot q (0 = the
// shared expert, then the token's k experts) and its first row r0 within that expert; returns its row count.
__device__ __forceinline__ int gate_up_tile(int j, int tr, int64_t F, int64_t tiles_per_slot, int& q, int64_t& r0) {
    const int64_t g = blockIdx.x + (int64_t)j * gridDim.x;
    q = (int)(g / tiles_per_slot), r0 = (g % tiles_per_slot) * tr;
    return (int)min((int64_t)tr, F - r0);
}

// Slot q's gate and up matrices (the shared expert's for q = 0, else the stacked experts') and the row where its
// row r0 sits in them (for an expert, from s_row0 after routing).
struct gate_up_source {
    const dmat& G;
    const dmat& U;
    int64_t row;
};
__device__ __forceinline__ gate_up_source gate_up_rows(const dmoe& m, int q, int64_t r0, const int64_t* s_row0) {
    return {q == 0 ? m.s_gate : m.gate, q == 0 ? m.s_up : m.up, (q == 0 ? 0 : s_row0[q]) + r0};
}

// The gate/up kernels' start (every thread calls it): tile 0 first if it is the shared expert's (it needs no
// routing, so it streams while the router finishes), then the wait for the router's logits, the token's top-k
// into s_row0[1..k] (block 0 stores it for down), tile 0 if it was an expert's, and one commit group for it.
template <class Tile, class Issue>
__device__ __forceinline__ void gate_up_start(int n, Tile&& tile, Issue&& issue, const dmoe& m, const moe_routing& route,
                                              int t, int64_t* s_row0, int warp, int lane) {
    pdl_trigger();
    int q0 = -1;
    int64_t r00 = 0;
    if (n > 0) tile(0, q0, r00);
    const bool first_is_shared = q0 == 0;
    if (first_is_shared) issue(0);
    pdl_wait();
    if (warp == 0) {
        int chosen[k_max_topk];
        float wt[k_max_topk];
        warp_topk(route.logits + t * route.ld, route.bias, m.E, m.k, chosen, wt);
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < k_max_topk; j++)
                if (j < m.k) s_row0[j + 1] = (int64_t)chosen[j] * m.F;
            if (blockIdx.x == 0) store_route(route, t, m.E, m.k, chosen, wt);
        }
    }
    __syncthreads();
    if (!first_is_shared && n > 0) issue(0);
    cp_async_commit();  // group 0: tile 0, wherever it was issued
}

// moe_general.cu: gate/up for any format and shape, after moe_topk (warp subgroups walk rows).
void run_gate_up_general(float* h, const dmoe& m, const int32_t* idx, const float* x, int64_t ldx, int T,
                         const float* norm_w, float eps, bool f16, cudaStream_t stream);
// moe_decode_stream.cu: 4-bit gate/up (D = 32 cpl chunks) and any down through block rings, top-k fused.
void run_gate_up_stream(float* h, const dmoe& m, const moe_routing& r, const float* x, int64_t ldx, int T,
                        const float* norm_w, float eps, bool f16, int cpl, cudaStream_t stream);
void run_down_stream(float* x, int64_t ldx, const dmoe& m, const int32_t* idx, const float* wt, const float* sig,
                     const float* h, int T, float h_f16_scale, cudaStream_t stream);
// moe_decode_warp.cu: 4-bit rows with int8 inputs (fast mode), per-warp rings; the router tap's consumer.
bool gate_up_warp_fits(const dmoe& m);
bool down_warp_fits(const dmoe& m);
void run_gate_up_warp(float* h, const dmoe& m, const moe_routing& r, const float* x, int64_t ldx, int T,
                      const float* norm_w, float eps, int cpl, cudaStream_t stream);
void run_down_warp(float* x, int64_t ldx, const dmoe& m, const int32_t* idx, const float* wt, const float* sig,
                   const float* h, int T, unsigned long long* zero_tap, cudaStream_t stream);
// moe_decode_mma.cu: tensor-core forms (mma=gate_up, mma=down in the kernel plan).
bool gate_up_mma_supports(const dmoe& m);
void launch_gate_up_mma(float* h, const dmoe& m, const moe_routing& r, const float* x, int64_t ldx, int T,
                        const float* norm_w, float eps, bool f16, cudaStream_t stream);
bool down_mma_supports(const dmoe& m);
void launch_down_mma(float* x, int64_t ldx, const dmoe& m, const int32_t* idx, const float* wt, const float* sig,
                     const float* h, int T, float h_f16_scale, cudaStream_t stream);

}  // namespace tansy::cuda::moe_impl
