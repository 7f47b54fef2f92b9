// Ranked candidates over a row of logits, shared by the device sampler (sample.cu) and the log-prob rows
// (logprobs.cu). A candidate is (order_key(logit) << 32) | ~id: the unsigned order of candidates is (logit
// descending, id ascending), the host's order with ties going to the lower id, and no two candidates of a row are
// equal; 0 is no candidate. Device code only.
#pragma once
#include <cstdint>

#include "backend/cuda/common.cuh"

#if defined(__CUDACC__)
namespace tansy::cuda {

__device__ __forceinline__ uint64_t pack_candidate(float logit, int id) {
    return (uint64_t)order_key(logit) << 32 | (uint32_t)~(uint32_t)id;
}
__device__ __forceinline__ int candidate_id(uint64_t c) { return (int)~(uint32_t)c; }

template <int THREADS>
struct select_smem {
    int hist[256];
    int red[THREADS / 32];
    unsigned long long red64[THREADS / 32];
    int sel, need, done, count;
};

template <int THREADS>
__device__ __forceinline__ int select_block_sum(int v, select_smem<THREADS>& sm) {
    constexpr int WARPS = THREADS / 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = (int)__reduce_add_sync(0xffffffffu, (unsigned)v);
    if (lane == 0) sm.red[warp] = v;
    __syncthreads();
    v = (int)__reduce_add_sync(0xffffffffu, lane < WARPS ? (unsigned)sm.red[lane] : 0u);
    __syncthreads();
    return v;
}

template <int THREADS>
__device__ __forceinline__ uint64_t select_block_max(uint64_t v, select_smem<THREADS>& sm) {
    constexpr int WARPS = THREADS / 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int o = 16; o > 0; o >>= 1) v = max(v, (uint64_t)__shfl_xor_sync(0xffffffffu, (unsigned long long)v, o));
    if (lane == 0) sm.red64[warp] = v;
    __syncthreads();
    v = lane < WARPS ? sm.red64[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) v = max(v, (uint64_t)__shfl_xor_sync(0xffffffffu, (unsigned long long)v, o));
    __syncthreads();
    return v;
}

// Over the block's values v (PER per thread), those >= lo compete: returns t such that exactly min(k, their count)
// of them are >= t. A radix select, 8 bits a pass from the top, that stops at the first pass whose chosen bin is
// taken whole (the values are distinct, so the last pass always is). Histograms count with warp-aggregated
// shared-memory atomics, so the result does not depend on timing.
template <int THREADS, int PER>
__device__ uint64_t select_threshold(const uint64_t (&v)[PER], uint64_t lo, int k, select_smem<THREADS>& sm) {
    const int lane = threadIdx.x % 32;
    int c = 0;
#pragma unroll
    for (int j = 0; j < PER; j++) c += v[j] >= lo;
    if (select_block_sum(c, sm) <= k) return lo;
    int need = k;
    uint64_t prefix = 0, mask = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += THREADS) sm.hist[b] = 0;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < PER; j++) {  // every thread the same trip count: the warp stays converged
            const uint64_t x = v[j];
            const int bin = x >= lo && (x & mask) == prefix ? (int)((x >> shift) & 255u) : 256;
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (bin < 256 && lane == __ffs(peers) - 1) atomicAdd(&sm.hist[bin], __popc(peers));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int cum = 0, b = 255;
            for (; b > 0 && cum + sm.hist[b] < need; b--) cum += sm.hist[b];
            sm.sel = b, sm.need = need - cum, sm.done = sm.hist[b] == need - cum;
        }
        __syncthreads();
        prefix |= (uint64_t)sm.sel << shift, mask |= (uint64_t)0xFF << shift, need = sm.need;
        const bool done = sm.done;
        __syncthreads();  // every thread has read sm before the next pass clears it
        if (done) break;
    }
    return prefix;  // the chosen bin's values match prefix above the last pass's bits: all of them are >= it
}

}  // namespace tansy::cuda
#endif
