// The MoE router's top-k for one token in one warp (device code; moe.cu).
#pragma once
#include <climits>

#include "backend/cuda/common.cuh"

#if defined(__CUDACC__)
namespace tansy::cuda {

constexpr int k_max_topk = 16;
constexpr int k_max_experts = 512;
constexpr int k_topk_per_lane = k_max_experts / 32;

// Router logits as order_key(l, 1): 0 marks padding and taken experts; a NaN (key 1, below every number) is
// chosen only when nothing else is left, and is still a real expert id.
__device__ __forceinline__ uint32_t router_key(float logit_plus_bias) { return order_key(logit_plus_bias, 1u); }

// One warp, one token: the top-k of the keys (lane l holds experts l + 32 i as router_key(logit + bias), 0 for
// padding), ties to the lower id (what a sequential arg-max picks). Every lane ends with the ids and their
// logits (+ bias). Each round is two warp reductions (redux.sync), not shuffles.
__device__ __forceinline__ void warp_topk_select(uint32_t (&v)[k_topk_per_lane], int k, int (&chosen)[k_max_topk],
                                                 float (&val)[k_max_topk]) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < k_max_topk; j++) {
        if (j >= k) break;
        uint32_t best = 0;
#pragma unroll
        for (int i = 0; i < k_topk_per_lane; i++) best = max(best, v[i]);
        best = __reduce_max_sync(0xffffffffu, best);
        int bi = INT_MAX;
#pragma unroll
        for (int i = k_topk_per_lane - 1; i >= 0; i--)  // descending, so the lane's lowest matching id is kept
            if (v[i] == best) bi = lane + 32 * i;
        bi = __reduce_min_sync(0xffffffffu, bi);
#pragma unroll
        for (int i = 0; i < k_topk_per_lane; i++)
            if (lane + 32 * i == bi) v[i] = 0u;  // taken
        chosen[j] = bi, val[j] = key_value(best);
    }
}

// The same from E logits in memory (+ bias, optional), with the softmax over the selected logits (== the full
// softmax renormalised over the top-k, MODEL.md §5).
__device__ __forceinline__ void warp_topk(const float* l, const float* bias, int E, int k, int (&chosen)[k_max_topk],
                                          float (&wt)[k_max_topk]) {
    const int lane = threadIdx.x % 32;
    uint32_t v[k_topk_per_lane];
#pragma unroll
    for (int i = 0; i < k_topk_per_lane; i++) {
        const int e = lane + 32 * i;
        v[i] = e < E ? router_key(l[e] + (bias ? bias[e] : 0.0f)) : 0u;
    }
    float val[k_max_topk];
    warp_topk_select(v, k, chosen, val);
    float sum = 0;
#pragma unroll
    for (int j = 0; j < k_max_topk; j++)
        if (j < k) sum += expf(val[j] - val[0]);
#pragma unroll
    for (int j = 0; j < k_max_topk; j++)
        if (j < k) wt[j] = expf(val[j] - val[0]) / sum;
}

}  // namespace tansy::cuda
#endif
