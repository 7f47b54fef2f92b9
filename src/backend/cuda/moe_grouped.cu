// MoE for many rows (prompt processing, and decode batches on moe_grouped_mma.cu): routing plan and combine around
// the grouped GEMM (moe.cuh).
// One CTA builds the plan (shared-memory histogram, warp scan, atomics for the positions: the order of slots
// inside an expert's block is arbitrary, which changes nothing since every GEMM row is computed on its own);
// the combine sums each token's k expert rows and the shared expert in a fixed order (deterministic).
#include <algorithm>

#include "backend/cuda/kernel_plan.h"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/topk.cuh"

namespace tansy::cuda {

namespace {

constexpr int k_plan_threads = 1024, k_plan_batch = 8;

// shared_rows: T for the shared expert's tiles after the routed ones (expert E, sorted rows [T k, T k + T)), or 0.
__global__ void __launch_bounds__(k_plan_threads) plan_kernel(int32_t* perm, int32_t* pos_of, gemm_tile* tiles,
                                                             int32_t* n_tiles, const int32_t* idx, int T, int E, int k,
                                                             int BM, int shared_rows) {
    __shared__ int cnt[k_max_experts], cur[k_max_experts], tile0[k_max_experts], n_routed;
    const int n = T * k, tid = threadIdx.x;
    for (int e = tid; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    // fn(slot, its expert) over the thread's slots, their experts loaded k_plan_batch at a time and issued together
    // (one CTA: a load's latency per slot was most of the plan's time on prompts)
    auto for_slots = [&](auto&& fn) {
        for (int i0 = tid; i0 < n; i0 += k_plan_batch * k_plan_threads) {
            int e[k_plan_batch];
#pragma unroll
            for (int b = 0; b < k_plan_batch; b++) e[b] = i0 + b * k_plan_threads < n ? idx[i0 + b * k_plan_threads] : -1;
#pragma unroll
            for (int b = 0; b < k_plan_batch; b++)
                if (e[b] >= 0) fn(i0 + b * k_plan_threads, e[b]);
        }
    };
    for_slots([&](int, int e) { atomicAdd(&cnt[e], 1); });
    __syncthreads();
    if (tid < 32) {  // exclusive scans of rows and tiles per expert: lane l owns a contiguous run of experts
        const int per = (E + 31) / 32, e0 = min(E, tid * per), e1 = min(E, e0 + per);
        int rs = 0, ts = 0;
        for (int e = e0; e < e1; e++) rs += cnt[e], ts += (cnt[e] + BM - 1) / BM;
        int ri = rs, ti = ts;
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, ri, o), b = __shfl_up_sync(0xffffffffu, ti, o);
            if (tid >= o) ri += a, ti += b;
        }
        int r = ri - rs, t = ti - ts;
        for (int e = e0; e < e1; e++) {
            cur[e] = r, tile0[e] = t;
            r += cnt[e], t += (cnt[e] + BM - 1) / BM;
        }
        if (tid == 31) n_routed = ti, *n_tiles = ti + (shared_rows + BM - 1) / BM;
    }
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x)
        for (int j = 0; j * BM < cnt[e]; j++) tiles[tile0[e] + j] = {e, cur[e] + j * BM, min(BM, cnt[e] - j * BM)};
    for (int j = tid; j * BM < shared_rows; j += blockDim.x)
        tiles[n_routed + j] = {E, n + j * BM, min(BM, shared_rows - j * BM)};
    __syncthreads();  // cur[] has been read for the tiles before the atomics below move it
    for_slots([&](int i, int e) {
        const int p = atomicAdd(&cur[e], 1);
        perm[p] = i;
        pos_of[i] = p;
    });
}

__global__ void combine_kernel(float* x, int64_t ldx, const float* y, const float* ys, const int32_t* pos_of,
                               const float* wt, const float* sig, int k, int64_t D) {
    const int t = blockIdx.x;
    const float sg = sig[t];
    for (int64_t d = 4 * threadIdx.x; d < D; d += 4 * blockDim.x) {
        float4 a = *reinterpret_cast<const float4*>(ys + t * D + d);
        a.x *= sg, a.y *= sg, a.z *= sg, a.w *= sg;
        for (int j = 0; j < k; j++) {
            const float w = wt[t * k + j];
            const float4 v = *reinterpret_cast<const float4*>(y + (int64_t)pos_of[t * k + j] * D + d);
            a.x = fmaf(w, v.x, a.x), a.y = fmaf(w, v.y, a.y), a.z = fmaf(w, v.z, a.z), a.w = fmaf(w, v.w, a.w);
        }
        float4* o = reinterpret_cast<float4*>(x + t * ldx + d);
        float4 r = *o;
        r.x += a.x, r.y += a.y, r.z += a.z, r.w += a.w;
        *o = r;
    }
}

}  // namespace

int moe_max_tiles(int T, int E, int k, int bm, bool shared) {
    const int n = T * k;
    // every used expert adds at most one partial tile
    return (n + bm - 1) / bm + std::min(E, n) + (shared ? (T + bm - 1) / bm : 0);
}

void moe_plan(int32_t* perm, int32_t* pos_of, gemm_tile* tiles, int32_t* n_tiles, const int32_t* idx, int T, int E,
              int k, int bm, cudaStream_t stream, bool shared) {
    TANSY_CHECK(E <= k_max_experts, "cuda moe: at most %d experts, got %d", k_max_experts, E);
    TANSY_CHECK(bm == k_gemm_bm || bm == 2 * k_gemm_bm || bm == k_gemm_wgmma_moe_tokens || bm == k_moe_small_bm,
                "cuda moe: tiles of %d rows", bm);
    plan_kernel<<<1, k_plan_threads, 0, stream>>>(perm, pos_of, tiles, n_tiles, idx, T, E, k, bm, shared ? T : 0);
    CUDA_CHECK_LAUNCH();
}

void moe_combine(float* x, int64_t ldx, const float* y, const float* ys, const int32_t* pos_of, const float* wt,
                 const float* sig, int T, int k, int64_t D, cudaStream_t stream) {
    TANSY_CHECK(D % 4 == 0 && ldx % 4 == 0, "cuda moe combine: D %lld", (long long)D);
    combine_kernel<<<(unsigned)T, 256, 0, stream>>>(x, ldx, y, ys, pos_of, wt, sig, k, D);
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
