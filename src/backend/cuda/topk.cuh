// The MoE router's top-k for one token in one warp (device code; moe_route.cu and the decode families' fused top-k).
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
// padding; only i < PL are read: E <= 32 PL), ties to the lower id (what a sequential arg-max picks). Every lane
// ends with the ids and their logits (+ bias). Each lane keeps its own best key and the lowest index holding it: a
// round is two warp reductions (redux.sync) and one rescan of the lane's PL keys.
// note: the previous form rescanned all 16 keys three times per round (~75 instructions per round and warp, with
// 16 warps per SM all selecting: ~1.3 us of issue on gate/up's critical path per layer, by its SASS). The per-lane
// count is a template so the loops unroll without a runtime exit (one with `if (i >= groups) break` made ptxas
// spill the gate/up kernel). take(j, id, logit + bias) receives the j-th choice. Unrolled: the rounds
// unrolled (the choices can land in register arrays) or a loop (one round's code).
template <int PL, bool Unrolled, class Take>
__device__ __forceinline__ void warp_topk_rounds(uint32_t (&v)[k_topk_per_lane], int k, Take take) {
    static_assert(PL <= k_topk_per_lane, "keys per lane");
    const int lane = threadIdx.x % 32;
    uint32_t b = 0;  // the lane's best key, at its lowest index bi
    int bi = 0;
    auto rescan = [&] {
        b = 0, bi = 0;
#pragma unroll
        for (int i = 0; i < PL; i++)
            if (v[i] > b) b = v[i], bi = i;  // strictly greater: the lowest index among equal keys
    };
    rescan();
    auto round = [&](int j) {
        const uint32_t best = __reduce_max_sync(0xffffffffu, b);
        const int id = __reduce_min_sync(0xffffffffu, b == best ? lane + 32 * bi : INT_MAX);
        take(j, id, key_value(best));
        // the winning lane's key is taken; every lane rescans (no divergent branch: a warp would issue the
        // winning lane's rescan once either way)
        const bool won = id == lane + 32 * bi;
#pragma unroll
        for (int i = 0; i < PL; i++) v[i] = won && i == bi ? 0u : v[i];
        rescan();
    };
    if constexpr (Unrolled) {
#pragma unroll
        for (int j = 0; j < k_max_topk; j++) {
            if (j >= k) break;
            round(j);
        }
    } else {
#pragma unroll 1
        for (int j = 0; j < k; j++) round(j);
    }
}

template <int PL>
__device__ __forceinline__ void warp_topk_select_pl(uint32_t (&v)[k_topk_per_lane], int k, int (&chosen)[k_max_topk],
                                                    float (&val)[k_max_topk]) {
    warp_topk_rounds<PL, true>(v, k, [&](int j, int id, float x) { chosen[j] = id, val[j] = x; });
}

// warp_topk_select_pl with the fewest keys per lane that hold E experts (the real model's 256: 8).
__device__ __forceinline__ void warp_topk_select(uint32_t (&v)[k_topk_per_lane], int E, int k, int (&chosen)[k_max_topk],
                                                 float (&val)[k_max_topk]) {
    if (E <= 8 * 32) warp_topk_select_pl<8>(v, k, chosen, val);
    else warp_topk_select_pl<k_topk_per_lane>(v, k, chosen, val);
}

// The same selection with lane j < k ending with the j-th choice (its id and logit + bias) and the rounds as a
// loop: one round's code instead of k_max_topk unrolled rounds, so that the one selecting warp of a decode MoE
// block (gate_up_warp_kernel's router tap) fetches ~0.5 KB of instructions, not ~12 KB straight through while the
// other warps wait for it at the staging barrier (that kernel: ~3.2K SASS instructions instead of ~8.4K).
// note: a merge network instead (per-lane bitonic sort + 5 butterfly merges) measured no faster (docs/PERF.md).
template <int PL>
__device__ __forceinline__ void warp_topk_select_lane_pl(uint32_t (&v)[k_topk_per_lane], int k, int& my_id,
                                                         float& my_val) {
    const int lane = threadIdx.x % 32;
    warp_topk_rounds<PL, false>(v, k, [&](int j, int id, float x) {
        if (lane == j) my_id = id, my_val = x;
    });
}

__device__ __forceinline__ void warp_topk_select_lane(uint32_t (&v)[k_topk_per_lane], int E, int k, int& my_id,
                                                      float& my_val) {
    if (E <= 8 * 32) warp_topk_select_lane_pl<8>(v, k, my_id, my_val);
    else warp_topk_select_lane_pl<k_topk_per_lane>(v, k, my_id, my_val);
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
    warp_topk_select(v, E, k, chosen, val);
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
