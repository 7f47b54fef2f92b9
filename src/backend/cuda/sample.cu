// Top-k sampling on the device (sample.cuh). One block of 1024 threads per row; every thread owns a contiguous
// range of ids, so "lowest ids first" among equal logits is an exclusive scan over threads.
//  1. the best logit (a max over order-preserving keys), and the host sampler's floor (e^-40 of the best);
//  2. the top_k-th largest key among the tokens at or above the floor by a radix select: four passes of a
//     256-bin histogram of the next 8 key bits (warp-aggregated shared-memory atomics on integer counts, so the
//     result does not depend on timing);
//  3. the candidates: keys above that threshold, then the lowest-id ties at it; sorted by (logit descending, id
//     ascending) by counting ranks;
//  4. one thread draws with sampler_math::draw_sorted, the host sampler's code.
// Each pass re-reads the row (1 MB at 248K ids) from L2; rows run in parallel.
#include "backend/cuda/sample.cuh"

#include <climits>
#include <cmath>

#include "backend/cuda/common.cuh"
#include "sampling/sampler_math.h"

namespace tansy::cuda {

namespace {

constexpr int THREADS = 1024, WARPS = THREADS / 32;

// Keys: order_key (common.cuh), NaN as 0, below every number (the host sampler's comparisons never pick a NaN).
__device__ __forceinline__ uint32_t key_of(float f) { return order_key(f); }

// Block-wide reductions and scan through shared memory s[WARPS]; every thread gets the result.
__device__ __forceinline__ uint32_t block_max(uint32_t v, uint32_t* s) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = __reduce_max_sync(0xffffffffu, v);
    if (lane == 0) s[warp] = v;
    __syncthreads();
    v = __reduce_max_sync(0xffffffffu, lane < WARPS ? s[lane] : 0u);
    __syncthreads();
    return v;
}
__device__ __forceinline__ int block_sum(int v, int* s) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = (int)__reduce_add_sync(0xffffffffu, (unsigned)v);
    if (lane == 0) s[warp] = v;
    __syncthreads();
    v = (int)__reduce_add_sync(0xffffffffu, lane < WARPS ? (unsigned)s[lane] : 0u);
    __syncthreads();
    return v;
}
__device__ __forceinline__ int block_min(int v, int* s) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = __reduce_min_sync(0xffffffffu, v);
    if (lane == 0) s[warp] = v;
    __syncthreads();
    v = __reduce_min_sync(0xffffffffu, lane < WARPS ? s[lane] : INT_MAX);
    __syncthreads();
    return v;
}
// The sum of v over the threads before this one.
__device__ __forceinline__ int block_exclusive_scan(int v, int* s) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) s[warp] = x;
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp; w++) before += s[w];
    __syncthreads();
    return before + x - v;
}

// One row's draw by the whole block: ids_r = the token, rng_r = the row's splitmix64 state.
__device__ __forceinline__ void sample_row(int32_t* ids_r, const float* l, int n, const sample_args a, uint64_t* rng_r) {
    __shared__ uint32_t s_u[WARPS];
    __shared__ int s_i[WARPS];
    __shared__ int hist[256];
    __shared__ int s_sel, s_need, s_m;
    __shared__ uint32_t c_key[k_sample_max_top_k];
    __shared__ int c_id[k_sample_max_top_k], c_sorted_id[k_sample_max_top_k];
    __shared__ float c_sorted[k_sample_max_top_k], c_w[k_sample_max_top_k];
    const int tid = threadIdx.x, lane = tid % 32;
    const int per = (n + THREADS - 1) / THREADS, i0 = min(n, tid * per), i1 = min(n, i0 + per);

    // 1. the best logit; a non-finite best (an infinite logit, every token -inf or NaN): the host's argmax
    uint32_t km = 0;
    for (int i = i0; i < i1; i++) km = max(km, key_of(l[i]));
    km = block_max(km, s_u);
    const float best = key_value(km);
    if (km == 0 || !isfinite(best)) {
        int first = INT_MAX;
        for (int i = i0; i < i1 && first == INT_MAX; i++)
            if (key_of(l[i]) == km) first = i;
        first = block_min(first, s_i);
        if (tid == 0) *ids_r = first == INT_MAX ? 0 : first;
        return;
    }
    const uint32_t kf = key_of(sampling_math::floor_logit(best, a.temperature));
    int cnt = 0;
    for (int i = i0; i < i1; i++) cnt += key_of(l[i]) >= kf;
    int need = min(a.top_k, block_sum(cnt, s_i));  // >= 1: the best is above the floor

    // 2. radix select: after the four passes, tau is the need-th largest candidate key and `need` says how many
    //    of the keys equal to tau are taken (the rest of the top_k lie above tau)
    uint32_t tau = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += THREADS) hist[b] = 0;
        __syncthreads();
        for (int j = 0; j < per; j++) {  // the same trip count in every thread: the warp stays converged
            const int i = i0 + j;
            int bin = 256;
            if (i < i1) {
                const uint32_t k = key_of(l[i]);
                if (k >= kf && (k & mask) == tau) bin = (int)((k >> shift) & 255u);
            }
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (bin < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
        }
        __syncthreads();
        if (tid == 0) {
            int cum = 0, b = 255;
            for (; b > 0 && cum + hist[b] < need; b--) cum += hist[b];
            s_sel = b, s_need = need - cum;
        }
        __syncthreads();
        tau |= (uint32_t)s_sel << shift, mask |= 0xFFu << shift, need = s_need;
        __syncthreads();
    }

    // 3. candidates: keys above tau, and the `need` lowest-id keys equal to it
    int ties = 0;
    for (int i = i0; i < i1; i++) ties += key_of(l[i]) == tau;
    int taken = block_exclusive_scan(ties, s_i);  // ties at lower ids (the threads before own them)
    if (tid == 0) s_m = 0;
    __syncthreads();
    for (int i = i0; i < i1; i++) {
        const uint32_t k = key_of(l[i]);
        if (k > tau || (k == tau && taken++ < need)) {
            const int slot = atomicAdd(&s_m, 1);
            c_key[slot] = k, c_id[slot] = i;
        }
    }
    __syncthreads();
    const int m = s_m;
    if (tid < m) {  // rank by (logit descending, id ascending)
        int r = 0;
        for (int j = 0; j < m; j++) r += c_key[j] > c_key[tid] || (c_key[j] == c_key[tid] && c_id[j] < c_id[tid]);
        c_sorted[r] = l[c_id[tid]], c_sorted_id[r] = c_id[tid];
    }
    __syncthreads();

    // 4. the draw, as the host sampler makes it
    if (tid == 0) {
        uint64_t st = *rng_r;
        const double u = sampling_math::rng_uniform(st);
        *rng_r = st;
        const int i = sampling_math::draw_sorted(c_sorted, m, sampling_math::inv_temperature(a.temperature), a.top_p,
                                                 a.min_p, u, c_w);
        *ids_r = c_sorted_id[i];
    }
}

__global__ void __launch_bounds__(THREADS) sample_kernel(int32_t* ids, const float* logits, int64_t ld, int n,
                                                         sample_args a, uint64_t* rng) {
    sample_row(ids + blockIdx.x, logits + (int64_t)blockIdx.x * ld, n, a, rng + blockIdx.x);
}

// Row r draws with the parameters and rng of its slot; rows whose slot does not sample on the device keep ids[r].
__global__ void __launch_bounds__(THREADS) sample_slots_kernel(int32_t* ids, const float* logits, int64_t ld, int n,
                                                               const float* params, uint64_t* rng,
                                                               const int32_t* row_slot) {
    const int r = blockIdx.x, s = row_slot[r];
    const float* p = params + (int64_t)s * 4;
    sample_args a;
    a.temperature = p[0], a.top_k = (int)p[1], a.top_p = p[2], a.min_p = p[3];
    if (!(a.temperature > 0) || a.top_k < 1 || a.top_k > k_sample_max_top_k || a.top_k >= n) return;
    sample_row(ids + r, logits + (int64_t)r * ld, n, a, rng + s);
}

}  // namespace

void sample_rows(int32_t* ids, const float* logits, int rows, int64_t ld, int64_t n_valid, const sample_args& a,
                 uint64_t* rng, cudaStream_t stream) {
    TANSY_CHECK(a.temperature > 0 && a.top_k >= 1 && a.top_k <= k_sample_max_top_k && a.top_k < n_valid &&
                    n_valid <= ld && n_valid <= INT_MAX && a.top_p > 0 && a.top_p <= 1 && a.min_p >= 0 && a.min_p < 1,
                "cuda sampling: temperature %g, top-k %d of %lld, top-p %g, min-p %g", a.temperature, a.top_k,
                (long long)n_valid, a.top_p, a.min_p);
    if (rows == 0) return;
    sample_kernel<<<(unsigned)rows, THREADS, 0, stream>>>(ids, logits, ld, (int)n_valid, a, rng);
    CUDA_CHECK_LAUNCH();
}

void sample_slot_rows(int32_t* ids, const float* logits, int rows, int64_t ld, int64_t n_valid, const float* params,
                      uint64_t* rng, const int32_t* row_slot, cudaStream_t stream) {
    TANSY_CHECK(n_valid <= ld && n_valid <= INT_MAX, "cuda sampling: %lld of %lld ids", (long long)n_valid, (long long)ld);
    if (rows == 0) return;
    sample_slots_kernel<<<(unsigned)rows, THREADS, 0, stream>>>(ids, logits, ld, (int)n_valid, params, rng, row_slot);
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
