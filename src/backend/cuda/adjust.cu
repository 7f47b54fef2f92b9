// Penalties, logit_bias and grammar masks on the device, so that rows using them keep the device pick (argmax or
// draw) and no logits row comes down; rows with penalties or bias alone also stay queued ahead of the host. The arithmetic is sampling_math's, the host's (scheduler::choose), with
// every product and sum rounded on its own: a greedy row picks the same id on either side. One block per row
// streams the slot's counts (4 bytes per vocabulary id) once; bias entries are added in list order by one thread
// (duplicate ids add up, as on the host).
#include "backend/cuda/adjust.cuh"

#include <cmath>
#include <cstring>

#include "backend/backend.h"
#include "backend/cuda/common.cuh"
#include "sampling/sampler_math.h"

namespace tansy::cuda {

namespace {

__global__ void adjust_kernel(float* logits, int64_t cols, int64_t n_valid, const int32_t* row_slot, const float* pen,
                              const int32_t* counts, int64_t counts_cols, const int32_t* bias, int max_bias,
                              const uint32_t* mask, int64_t mask_cols) {
    const int r = blockIdx.x;
    const int s = row_slot[r];
    const float* a = pen + (int64_t)s * k_adjust_cols;
    float* x = logits + (int64_t)r * cols;
    if (a[3] != 0.0f) {
        const int32_t* c = counts + (int64_t)s * counts_cols;
        const float presence = a[0], frequency = a[1], rep = a[2];
        const int64_t nc = n_valid < counts_cols ? n_valid : counts_cols;
        for (int64_t v = threadIdx.x; v < nc; v += blockDim.x) {
            const int32_t w = c[v];
            if (w == 0) continue;
            const int32_t n = w & (k_count_prompt_bit - 1);
            float y = x[v];
            if (n > 0) y = sampling_math::presence_frequency(y, n, presence, frequency);
            if (rep != 1.0f) y = sampling_math::repetition(y, rep);
            x[v] = y;
        }
        __syncthreads();  // the bias adds after the penalties, as on the host
        if (threadIdx.x == 0) {
            const int32_t* b = bias + (int64_t)s * 2 * max_bias;
            const int nb = (int)a[4];
            for (int i = 0; i < nb && i < max_bias; i++) {
                const int32_t id = b[2 * i];
                if (id >= 0 && id < n_valid) x[id] = sampling_math::add_rn(x[id], __int_as_float(b[2 * i + 1]));
            }
        }
        __syncthreads();
    }
    if (a[5] != 0.0f) {  // the grammar's mask last: whatever the bias did, a disallowed id is never picked
        const uint32_t* m = mask + (int64_t)s * mask_cols;
        for (int64_t v = threadIdx.x; v < n_valid; v += blockDim.x)
            if (!((m[v >> 5] >> (v & 31)) & 1u)) x[v] = -INFINITY;
    }
}

__global__ void count_kernel(int32_t* counts, int64_t counts_cols, const int32_t* ids, const int32_t* row_slot,
                             const float* pen, int rows) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const int s = row_slot[r], id = ids[r];
    if (pen[(int64_t)s * k_adjust_cols + 3] == 0.0f || id < 0 || id >= counts_cols) return;
    int32_t& w = counts[(int64_t)s * counts_cols + id];
    if ((w & (k_count_prompt_bit - 1)) < k_count_prompt_bit - 1) w++;  // one row per slot: no race
}

}  // namespace

void adjust_logits_rows(float* logits, int rows, int64_t cols, int64_t n_valid, const int32_t* row_slot,
                        const float* pen, const int32_t* counts, int64_t counts_cols, const int32_t* bias,
                        int max_bias, const uint32_t* mask, int64_t mask_cols, cudaStream_t stream) {
    if (rows == 0) return;
    adjust_kernel<<<(unsigned)rows, 256, 0, stream>>>(logits, cols, n_valid, row_slot, pen, counts, counts_cols, bias,
                                                      max_bias, mask, mask_cols);
    CUDA_CHECK_LAUNCH();
}

void count_picks_rows(int32_t* counts, int64_t counts_cols, const int32_t* ids, const int32_t* row_slot,
                      const float* pen, int rows, cudaStream_t stream) {
    if (rows == 0) return;
    count_kernel<<<(unsigned)((rows + 127) / 128), 128, 0, stream>>>(counts, counts_cols, ids, row_slot, pen, rows);
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
