// The GEMV families' shared pieces and entry points (gemv_general/stream/warp/mma/mma_warp.cu), for gemv.cu's
// dispatch alone: not a launcher header (the backend and tests use gemv.cuh).
#pragma once
#include "backend/cuda/gemv.cuh"
#include "backend/cuda/stream.cuh"

namespace tansy::cuda::gemv_impl {

// Where output (row, t) goes.
__device__ __forceinline__ float* out_slot(const gemv_params& p, int64_t row, int t) {
    int s = 0;
    while (s + 1 < p.n_seg && row >= p.seg[s + 1].row0) s++;
    return p.seg[s].out + t * p.seg[s].ld + (row - p.seg[s].row0);
}

// Returns what it stored.
__device__ __forceinline__ float store_out(const gemv_params& p, int64_t row, int t, float v) {
    float* o = out_slot(p, row, t);
    const float r = p.accumulate ? *o + v : v;
    *o = r;
    return r;
}

// Chunks per lane when the row splits evenly over 32 lanes and the input fits in 128 registers; else 0.
template <dfmt F>
inline int xs_chunks_per_lane(int64_t n_chunks) {
    if (n_chunks % 32) return 0;
    const int64_t cpl = n_chunks / 32;
    return cpl * chunk_values<F>() <= 128 ? (int)cpl : 0;
}

// The tensor-core forms' staged x rows: K + 32 fp16 values each (the padding puts the lanes' different tokens in
// different banks; rows of 2K bytes would all start in bank 0).
__host__ __device__ inline int64_t mma_x_stride(int64_t K) { return K + 32; }

// gemv_general.cu: any shape; warp subgroups walk rows, TB input rows per pass.
void run_general(const gemv_params& p, cudaStream_t stream);
// gemv_stream.cu: one input row through a block ring of whole-row tiles; false where no instance takes the shape.
bool run_stream(const gemv_params& p, cudaStream_t stream);
// gemv_warp.cu: one input row of 4-bit rows as int8 (fast mode), per-warp rings of `slots` rows (gemv_warp_slots,
// 0 where the kernel does not apply), cpl = xs_chunks_per_lane; with p.tap, the router tap.
int gemv_warp_slots(const gemv_params& p);
void run_warp(const gemv_params& p, int cpl, int slots, cudaStream_t stream);
// gemv_mma.cu: 4-bit rows on tensor cores through a block ring, 1..16 input rows.
bool mma_gemv_supports(const gemv_params& p);
void run_mma(const gemv_params& p, cudaStream_t stream);
// gemv_mma_warp.cu: 2..32 input rows of 4-bit rows on tensor cores, per warp from global memory.
// gemv_mma_warp_kernel's launch: the k-chunks per 16-row block (a divisor of K / 64) that give the busiest warp
// the least work (its 64-column blocks, plus one per item for its flush), fewer chunks on a tie (a smaller
// fold); blocks = 0 where it does not apply.
struct mma_warp_plan {
    int blocks = 0, nkc = 0, gshift = 0;
    size_t smem = 0;
};
mma_warp_plan plan_mma_warp(const gemv_params& p);
void run_mma_warp(const gemv_params& p, const mma_warp_plan& pl, cudaStream_t stream);

}  // namespace tansy::cuda::gemv_impl
