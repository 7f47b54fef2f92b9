// Log-prob records on the device (logprobs.cuh), in two kernels laid out like the sampler's (sample.cu):
//  1. split_kernel: a row is cut into slices of k_slice ids; one block per slice reads its slice once (coalesced,
//     16 ids a thread, held in registers) and keeps the slice's online-softmax pair (max m, sum of e^(x - m),
//     merged across threads as pairs) and its top-n candidates (candidates.cuh: a radix select).
//  2. merge_kernel: one block per row merges the slices' pairs into the log-sum-exp (fp32, m + log s), selects
//     the top n of the slices' candidates the same way, ranks them (logit descending, id ascending: the host's
//     order) and writes the record with the logits read back from the row and the pick's logit.
// Bytes per row: one read of its n_valid logits (~1 MB at 248,320 ids) and ~10 KB of slice results; one row
// spreads over 61 blocks, so a few rows take a few microseconds, and many rows run at the memory's bandwidth.
// Rows that ask for nothing leave after reading their slot's setting.
#include "backend/cuda/logprobs.cuh"

#include <algorithm>
#include <cmath>

#include "backend/cuda/candidates.cuh"
#include "backend/cuda/common.cuh"
#include "core/check.h"
#include "sampling/logprobs.h"

namespace tansy::cuda {

namespace {

constexpr int K = k_max_top_logprobs;
constexpr int SPLIT_THREADS = 256;
constexpr int SPLIT_PER = 16;                          // ids per thread of a slice's block
constexpr int k_slice = SPLIT_THREADS * SPLIT_PER;     // 4096 ids a slice
constexpr int k_max_splits = 128;
constexpr int MERGE_THREADS = 256;
constexpr int MERGE_PER = k_max_splits * K / MERGE_THREADS;  // candidates per merge thread: 10
constexpr int WORDS = K + 1;  // per (row, slice): K candidates, then the slice's pair as two floats
static_assert(k_logprob_max_ids == (int64_t)k_max_splits * k_slice, "k_logprob_max_ids must be the split layout's");
static_assert(k_max_splits * K % MERGE_THREADS == 0, "the merge's candidates must spread evenly");

// Online softmax over some logits: m their max, s = sum e^(x - m); (-inf, 0) for none (or only -inf).
struct max_sum {
    float m, s;
};
__device__ __forceinline__ max_sum merge_pair(max_sum a, max_sum b) {
    const float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) return {m, 0.0f};
    return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};  // e^-inf = 0 for an empty side
}

// The block's pairs merged; the result is thread 0's. (merge_pair is symmetric, so every order of a warp's
// butterfly gives the same floats: the result does not depend on timing.)
template <int THREADS>
__device__ __forceinline__ max_sum block_pair(max_sum v, max_sum* red) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int o = 16; o > 0; o >>= 1)
        v = merge_pair(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < THREADS / 32 ? red[lane] : max_sum{-INFINITY, 0.0f};
        for (int o = 16; o > 0; o >>= 1)
            v = merge_pair(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
    }
    return v;
}

__device__ __forceinline__ int row_top(const int32_t* row_slot, const int32_t* top, int r) {
    return min(top[row_slot[r]], K);
}

// scratch[(r * splits + s) * WORDS + j]: j < n, slice s's top n candidates (0 after its last when it holds fewer
// ids); j = K, the slice's pair (m in the low word, s in the high one).
__global__ void __launch_bounds__(SPLIT_THREADS) split_kernel(uint64_t* scratch, const float* logits, int64_t ld, int n,
                                                               int splits, const int32_t* row_slot, const int32_t* top) {
    const int r = blockIdx.y, sl = blockIdx.x, tid = threadIdx.x;
    const int k = row_top(row_slot, top, r);
    if (k < 0) return;
    const float* l = logits + (int64_t)r * ld;
    const int i0 = sl * k_slice, i1 = min(n, i0 + k_slice);
    float x[SPLIT_PER];
#pragma unroll
    for (int j = 0; j < SPLIT_PER; j++) {
        const int i = i0 + j * SPLIT_THREADS + tid;
        x[j] = i < i1 ? l[i] : -INFINITY;
    }
    float m = -INFINITY, s = 0.0f;
#pragma unroll
    for (int j = 0; j < SPLIT_PER; j++) m = fmaxf(m, x[j]);
    if (m != -INFINITY) {
#pragma unroll
        for (int j = 0; j < SPLIT_PER; j++) s += expf(x[j] - m);
    }
    __shared__ max_sum red[SPLIT_THREADS / 32];
    const max_sum p = block_pair<SPLIT_THREADS>({m, s}, red);
    uint64_t* out = scratch + ((int64_t)r * splits + sl) * WORDS;
    if (tid == 0) out[K] = (uint64_t)__float_as_uint(p.s) << 32 | __float_as_uint(p.m);
    if (k == 0) return;
    uint64_t v[SPLIT_PER];
#pragma unroll
    for (int j = 0; j < SPLIT_PER; j++) {
        const int i = i0 + j * SPLIT_THREADS + tid;
        v[j] = i < i1 ? pack_candidate(x[j], i) : 0;
    }
    __shared__ select_smem<SPLIT_THREADS> sm;
    const uint64_t t = select_threshold(v, 1, k, sm);
    if (tid == 0) sm.count = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < SPLIT_PER; j++)
        if (v[j] >= 1 && v[j] >= t) out[atomicAdd(&sm.count, 1)] = v[j];
    __syncthreads();
    for (int j = sm.count + tid; j < k; j += SPLIT_THREADS) out[j] = 0;
}

__global__ void __launch_bounds__(MERGE_THREADS) merge_kernel(int32_t* records, const uint64_t* scratch,
                                                               const float* logits, int64_t ld, int n, int splits,
                                                               const int32_t* ids, const int32_t* row_slot,
                                                               const int32_t* top) {
    const int r = blockIdx.x, tid = threadIdx.x;
    const int k = row_top(row_slot, top, r);
    if (k < 0) return;
    const uint64_t* c = scratch + (int64_t)r * splits * WORDS;
    const float* l = logits + (int64_t)r * ld;
    int32_t* rec = records + (int64_t)r * k_logprob_words;

    // 1. log-sum-exp = m + log s over the slices' pairs
    max_sum a{-INFINITY, 0.0f};
    for (int sl = tid; sl < splits; sl += MERGE_THREADS) {
        const uint64_t w = c[(int64_t)sl * WORDS + K];
        a = merge_pair(a, {__uint_as_float((uint32_t)w), __uint_as_float((uint32_t)(w >> 32))});
    }
    __shared__ max_sum red[MERGE_THREADS / 32];
    a = block_pair<MERGE_THREADS>(a, red);
    if (tid == 0) {
        rec[0] = __float_as_int(a.m == -INFINITY ? -INFINITY : a.m + logf(a.s));
        const int id = ids[r];  // the row's pick: an id below n_valid
        rec[1] = __float_as_int(id >= 0 && id < n ? l[id] : NAN);
    }

    // 2. the top k of the slices' top k, ranked by (logit descending, id ascending): the candidates are distinct
    __shared__ select_smem<MERGE_THREADS> sm;
    __shared__ uint64_t c_val[K];
    __shared__ int c_id[K];
    int m = 0;
    if (k > 0) {
        const int m_all = splits * k;
        uint64_t v[MERGE_PER];
#pragma unroll
        for (int j = 0; j < MERGE_PER; j++) {
            const int e = j * MERGE_THREADS + tid;
            v[j] = e < m_all ? c[(int64_t)(e / k) * WORDS + e % k] : 0;
        }
        const uint64_t t = select_threshold(v, 1, k, sm);
        if (tid == 0) sm.count = 0;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < MERGE_PER; j++)
            if (v[j] >= 1 && v[j] >= t) c_val[atomicAdd(&sm.count, 1)] = v[j];
        __syncthreads();
        m = sm.count;
        if (tid < m) {
            int rank = 0;
            for (int j = 0; j < m; j++) rank += c_val[j] > c_val[tid];
            c_id[rank] = candidate_id(c_val[tid]);
        }
        __syncthreads();
    }
    if (tid < K) {
        const bool has = tid < m;
        rec[2 + 2 * tid] = has ? c_id[tid] : -1;
        rec[3 + 2 * tid] = __float_as_int(has ? l[c_id[tid]] : -INFINITY);  // the logit itself: -0 stays -0
    }
}

int splits_for(int64_t n) { return (int)((n + k_slice - 1) / k_slice); }

}  // namespace

size_t logprob_scratch_words(int rows, int64_t n_valid) {
    return (size_t)rows * (size_t)std::max(1, splits_for(n_valid)) * WORDS;
}

void logprob_slot_rows(int32_t* records, const float* logits, int rows, int64_t ld, int64_t n_valid, const int32_t* ids,
                       const int32_t* row_slot, const int32_t* top, uint64_t* scratch, cudaStream_t stream) {
    TANSY_CHECK(n_valid >= 1 && n_valid <= ld && n_valid <= k_logprob_max_ids && rows >= 0 && rows <= 65535,
                "cuda log-prob rows: %d rows of %lld ids (stride %lld, at most %lld ids)", rows, (long long)n_valid,
                (long long)ld, (long long)k_logprob_max_ids);
    if (rows == 0) return;
    const int splits = splits_for(n_valid);
    split_kernel<<<dim3((unsigned)splits, (unsigned)rows), SPLIT_THREADS, 0, stream>>>(scratch, logits, ld, (int)n_valid,
                                                                                       splits, row_slot, top);
    CUDA_CHECK_LAUNCH();
    merge_kernel<<<(unsigned)rows, MERGE_THREADS, 0, stream>>>(records, scratch, logits, ld, (int)n_valid, splits, ids,
                                                               row_slot, top);
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
