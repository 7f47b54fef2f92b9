// Top-k sampling on the device (sample.cuh), in two kernels over packed candidates (candidates.cuh: ordered by
// logit descending, id ascending, the host sampler's order with ties going to the lower id).
//  1. split_kernel: a row is cut into slices of at most k_slice ids; one block per slice keeps the slice's top_k
//     candidates (a radix select over the 64-bit values held in registers) in scratch. The row's top_k are among
//     the union of its slices' top_k.
//  2. draw_kernel: one block per row reads that union; the best candidate gives the best logit and the host
//     sampler's floor (e^-40 of the best); the top_k at or above the floor by the same radix select, ranked by
//     (logit descending, id ascending); one thread draws with sampling_math::draw_sorted, the host sampler's code.
// Reads are coalesced (a warp loads 32 consecutive ids) and one row spreads over ~120 blocks: the draw costs a
// few microseconds at any batch, where one block per row reading the whole row took ~0.5 ms at batch 1.
#include "backend/cuda/sample.cuh"

#include <climits>
#include <cmath>

#include "backend/cuda/candidates.cuh"
#include "backend/cuda/common.cuh"
#include "core/check.h"
#include "sampling/sampler_math.h"

namespace tansy::cuda {

namespace {

constexpr int SPLIT_THREADS = 256;   // a slice's block
constexpr int DRAW_THREADS = 1024;   // a row's block in the draw
constexpr int k_slice = 2048;        // ids per slice at most: 8 per thread of a split block
constexpr int k_max_splits = 128;    // slices per row at most (n_valid <= k_sample_max_ids at 4096 ids a slice)
constexpr int DRAW_PER = k_max_splits * k_sample_max_top_k / DRAW_THREADS;  // candidates per draw thread: 8
static_assert(k_sample_max_ids <= k_max_splits * 2 * k_slice, "k_sample_max_ids must fit the split layout");

// A row's parameters: one setting for every row (rng[r] is row r's state), or each row its slot's.
struct fixed_rows {
    sample_args a;
    uint64_t* rng;
    __device__ bool get(int r, int n, sample_args& out, uint64_t*& st) const {
        out = a, st = rng + r;
        return true;  // checked by the launcher
    }
};
struct slot_rows {
    const float* params;
    const int32_t* row_slot;
    uint64_t* rng;
    __device__ bool get(int r, int n, sample_args& out, uint64_t*& st) const {
        const int s = row_slot[r];
        const float* p = params + (int64_t)s * 4;
        out.temperature = p[0], out.top_k = (int)p[1], out.top_p = p[2], out.min_p = p[3];
        st = rng + s;
        return out.temperature > 0 && out.top_k >= 1 && out.top_k <= k_sample_max_top_k && out.top_k < n;
    }
};

// cand[(r * splits + s) * k_sample_max_top_k + j], j < top_k: slice s's top_k candidates, 0 (no candidate) after
// a slice's last when it holds fewer ids.
template <int PER, class Rows>
__global__ void __launch_bounds__(SPLIT_THREADS) split_kernel(uint64_t* cand, const float* logits, int64_t ld, int n,
                                                               int splits, int slice, Rows rows) {
    const int r = blockIdx.y, s = blockIdx.x;
    sample_args a;
    uint64_t* st;
    if (!rows.get(r, n, a, st)) return;
    const float* l = logits + (int64_t)r * ld;
    const int i0 = s * slice, i1 = min(n, i0 + slice);
    uint64_t v[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int i = i0 + j * SPLIT_THREADS + (int)threadIdx.x;
        v[j] = i < i1 ? pack_candidate(l[i], i) : 0;
    }
    __shared__ select_smem<SPLIT_THREADS> sm;
    const uint64_t t = select_threshold(v, 1, a.top_k, sm);
    uint64_t* out = cand + ((int64_t)r * splits + s) * k_sample_max_top_k;
    if (threadIdx.x == 0) sm.count = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < PER; j++)
        if (v[j] >= 1 && v[j] >= t) out[atomicAdd(&sm.count, 1)] = v[j];
    __syncthreads();
    for (int j = sm.count + (int)threadIdx.x; j < a.top_k; j += SPLIT_THREADS) out[j] = 0;
}

template <class Rows>
__global__ void __launch_bounds__(DRAW_THREADS) draw_kernel(int32_t* ids, const uint64_t* cand, const float* logits,
                                                             int64_t ld, int n, int splits, Rows rows) {
    const int r = blockIdx.x, tid = threadIdx.x;
    sample_args a;
    uint64_t* st;
    if (!rows.get(r, n, a, st)) return;
    const int k = a.top_k, m_all = splits * k;
    const uint64_t* c = cand + (int64_t)r * splits * k_sample_max_top_k;
    uint64_t v[DRAW_PER];
    uint64_t best = 0;
#pragma unroll
    for (int j = 0; j < DRAW_PER; j++) {
        const int e = j * DRAW_THREADS + tid;
        v[j] = e < m_all ? c[(e / k) * k_sample_max_top_k + e % k] : 0;
        best = max(best, v[j]);
    }
    __shared__ select_smem<DRAW_THREADS> sm;
    __shared__ uint64_t c_val[k_sample_max_top_k];
    __shared__ int c_id[k_sample_max_top_k];
    __shared__ float c_sorted[k_sample_max_top_k], c_w[k_sample_max_top_k];
    best = select_block_max(best, sm);

    // a non-finite best (an infinite logit, every token -inf or NaN): the host's argmax, the first id of the best key
    const float* l = logits + (int64_t)r * ld;
    const uint32_t km = (uint32_t)(best >> 32);
    if (km == 0 || !isfinite(key_value(km))) {
        if (tid == 0) ids[r] = candidate_id(best);
        return;
    }
    const uint64_t lo = (uint64_t)order_key(sampling_math::floor_logit(key_value(km), a.temperature)) << 32;
    const uint64_t t = select_threshold(v, lo, k, sm);
    if (tid == 0) sm.count = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < DRAW_PER; j++)
        if (v[j] >= lo && v[j] >= t) c_val[atomicAdd(&sm.count, 1)] = v[j];
    __syncthreads();
    const int m = sm.count;
    if (tid < m) {  // rank by (logit descending, id ascending): the candidates are distinct
        int rank = 0;
        for (int j = 0; j < m; j++) rank += c_val[j] > c_val[tid];
        c_id[rank] = candidate_id(c_val[tid]);
        c_sorted[rank] = l[c_id[rank]];  // the logit itself (-0 stays -0, as the host sees it)
    }
    __syncthreads();
    if (tid == 0) {
        uint64_t s = *st;
        const double u = sampling_math::rng_uniform(s);
        *st = s;
        const int i = sampling_math::draw_sorted(c_sorted, m, sampling_math::inv_temperature(a.temperature), a.top_p,
                                                 a.min_p, u, c_w);
        ids[r] = c_id[i];
    }
}

struct split_plan {
    int splits, slice;
    bool wide;  // 16 ids a thread (slices of up to 2 * k_slice) instead of 8
};
split_plan plan_for(int64_t n) {
    split_plan p;
    p.splits = (int)std::min<int64_t>(k_max_splits, (n + k_slice - 1) / k_slice);
    p.slice = (int)((n + p.splits - 1) / p.splits);
    p.wide = p.slice > k_slice;
    return p;
}

template <class Rows>
void launch(int32_t* ids, const float* logits, int rows, int64_t ld, int64_t n, Rows rs, uint64_t* scratch,
            cudaStream_t stream) {
    const split_plan p = plan_for(n);
    const dim3 grid((unsigned)p.splits, (unsigned)rows);
    if (p.wide)
        split_kernel<2 * k_slice / SPLIT_THREADS><<<grid, SPLIT_THREADS, 0, stream>>>(scratch, logits, ld, (int)n, p.splits, p.slice, rs);
    else
        split_kernel<k_slice / SPLIT_THREADS><<<grid, SPLIT_THREADS, 0, stream>>>(scratch, logits, ld, (int)n, p.splits, p.slice, rs);
    CUDA_CHECK_LAUNCH();
    draw_kernel<<<(unsigned)rows, DRAW_THREADS, 0, stream>>>(ids, scratch, logits, ld, (int)n, p.splits, rs);
    CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t sample_scratch_words(int rows, int64_t n_valid) {
    return (size_t)rows * (size_t)plan_for(std::max<int64_t>(n_valid, 1)).splits * k_sample_max_top_k;
}

void sample_rows(int32_t* ids, const float* logits, int rows, int64_t ld, int64_t n_valid, const sample_args& a,
                 uint64_t* rng, uint64_t* scratch, cudaStream_t stream) {
    TANSY_CHECK(a.temperature > 0 && a.top_k >= 1 && a.top_k <= k_sample_max_top_k && a.top_k < n_valid &&
                    n_valid <= ld && n_valid <= k_sample_max_ids && a.top_p > 0 && a.top_p <= 1 && a.min_p >= 0 &&
                    a.min_p < 1,
                "cuda sampling: temperature %g, top-k %d of %lld, top-p %g, min-p %g", a.temperature, a.top_k,
                (long long)n_valid, a.top_p, a.min_p);
    if (rows == 0) return;
    launch(ids, logits, rows, ld, n_valid, fixed_rows{a, rng}, scratch, stream);
}

void sample_slot_rows(int32_t* ids, const float* logits, int rows, int64_t ld, int64_t n_valid, const float* params,
                      uint64_t* rng, const int32_t* row_slot, uint64_t* scratch, cudaStream_t stream) {
    TANSY_CHECK(n_valid <= ld && n_valid <= k_sample_max_ids, "cuda sampling: %lld of %lld ids (at most %lld)",
                (long long)n_valid, (long long)ld, (long long)k_sample_max_ids);
    if (rows == 0) return;
    launch(ids, logits, rows, ld, n_valid, slot_rows{params, row_slot, rng}, scratch, stream);
}

}  // namespace tansy::cuda
