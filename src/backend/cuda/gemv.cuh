// Matrix-vector products over device weights (q4/q8 affine or bf16), for a handful of input rows (decode,
// small batches; larger T works, correct but not yet fast). Host launchers only; kernels are in gemv_*.cu, one
// family per file, behind gemv.cu's dispatch.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/kernel_plan.h"

namespace tansy::cuda {

// A weight matrix W [rows, cols] on the device, used as y = W x.
struct dmat {
    dfmt fmt = dfmt::bf16;
    int64_t rows = 0, cols = 0;
    int group = 0;                 // affine formats: columns per (scale, bias)
    const uint32_t* w = nullptr;   // row-major; q4: cols/8 words per row, q8: cols/4, bf16: cols/2
    const uint32_t* sb = nullptr;  // affine: [rows, cols/group] bf16x2 (scale | bias << 16)

    __host__ __device__ int bits() const { return fmt == dfmt::q4 ? 4 : fmt == dfmt::q8 ? 8 : 16; }
    __host__ __device__ int64_t row_words() const { return cols * bits() / 32; }
    __host__ __device__ int64_t n_groups() const { return fmt == dfmt::bf16 ? 0 : cols / group; }
    __host__ __device__ size_t bytes() const { return (size_t)rows * (size_t)(row_words() + n_groups()) * 4; }
    __host__ __device__ dmat rows_view(int64_t r0, int64_t n) const {
        dmat m = *this;
        m.rows = n;
        m.w = w + r0 * row_words();
        if (sb) m.sb = sb + r0 * n_groups();
        return m;
    }
};

// Output rows of the (possibly concatenated) matrix go to up to 4 separate tensors: rows [row0_i, row0_{i+1})
// are written to out_i + t * ld_i + (r - row0_i).
struct gemv_segment {
    float* out = nullptr;
    int64_t ld = 0;
    int64_t row0 = 0;
};

// Optional epilogue of the one-row int8 GEMV (gemv_router_tap_supports), for an output projection that feeds the
// MoE block: the router's logits over the rows it writes. They are linear in the MoE's input up to the norm's
// 1/rms, which the gate/up kernel applies (moe_routing::tap): the router's own launch leaves the decode chain. The
// blocks' parts are summed as 64-bit fixed point, exact and so the same in any order (fp32 atomics would make
// decode differ between runs): k_tap_logit_scale units per 1, at most ~3e-8 off per part, where fp32 logits of
// |l| ~ 1-10 carry ~1e-7 - 1e-6 of rounding anyway.
constexpr float k_tap_logit_scale = 16777216.0f;  // 2^24
// Logit e sits at logits[e * k_tap_stride], one 128-byte line each: packed, the 257 logits' 33K atomics (128
// blocks each) queued on a few L2 slices.
constexpr int k_tap_stride = 16;
struct gemv_router_tap {
    dmat R;                                // [router; shared-expert gate] rows, 8-bit, R.cols == the GEMV's rows
    const float* nw = nullptr;             // the MoE norm's weights [R.cols]
    unsigned long long* logits = nullptr;  // [R.rows] (stride k_tap_stride) += R (nw * out) in fixed point (zero before)
};

struct gemv_params {
    dmat W;
    const float* x = nullptr;  // [T, ldx], first W.cols used
    int64_t ldx = 0;
    int T = 1;
    const float* norm_w = nullptr;  // optional: x rows are RMS-normalised with these weights first (T <= 16)
    float eps = 1e-6f;
    gemv_segment seg[4];
    int n_seg = 1;
    bool accumulate = false;  // out += W x instead of out = W x
    bool f16_inputs = false;  // round x (after the norm) to fp16 first, as the fast GEMM's operands are
    gemv_router_tap tap;      // used when tap.logits is set (gemv_router_tap_supports)
};

// CPU twin: cpu::matmul (+ cpu::rms_norm for the norm prologue).
void gemv(const gemv_params& p, cudaStream_t stream);

// The kernel families gemv() may take (tensor cores per mma_family, int8 inputs) are the active kernel plan's
// (kernel_plan.h: decode_mma_families, decode_int8_inputs).
// Whether gemv(p) takes the int8-input path (its result then differs from the fp16-input twin by xq.cuh's quantisation).
bool gemv_int8_inputs(const gemv_params& p);
// The most input rows of fp16 inputs (fast mode, no norm prologue) one tensor-core GEMV launch takes for W: the
// kernel plan's dense_rows where gemv_mma_warp.cu takes them (their x fits in shared memory), else k_mma_max_tokens.
// A decode batch's dense products run in even groups of at most this many rows.
int gemv_max_rows(const dmat& W);

// Whether gemv(p) can run p.tap: one input row on the int8 per-warp kernel with one row per warp (a block's 16 rows
// are 16 consecutive router columns), a q8 router of at most 512 rows.
bool gemv_router_tap_supports(const gemv_params& p);

// Lanes that cooperate on one row: the largest power of two <= min(32, chunks per row).
int gemv_lanes_per_row(int64_t n_chunks);

}  // namespace tansy::cuda
