// Tensor-core matrix multiplication for many input rows (prompt processing, large batches): Y = X W^T with W
// a device matrix (4/8-bit affine dequantised inside the kernel, or bf16), X fp32 rounded to fp16 (fast) or
// split into bf16 hi + lo pairs (precise) on its way into shared memory, fp32 accumulation (mma.sync m16n8k16). The same kernel runs dense projections and the
// grouped MoE experts: in grouped mode each CTA reads its (expert, rows) tile from a device-side work list
// built by moe_plan(), so no launch size depends on the routing and nothing waits for the host.
// Host launchers only; kernels are in gemm.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/gemv.cuh"

namespace tansy::cuda {

// Rows of the A operand (tokens or token slots) per tile, and W rows (output columns) per tile.
constexpr int k_gemm_bm = 64, k_gemm_bn = 128;

// What the kernel does with a tile's accumulators.
enum class gemm_epilogue : uint8_t {
    store,   // dense only: out segments (as gemv), optional accumulate
    rows,    // row r -> out + r * ldo (no accumulate)
    swiglu,  // W = gate, W2 = up: row r -> out + r * ldo gets silu(gate) * up for each of the N features
};

// One tile of a grouped GEMM: rows [row0, row0 + rows) of the (expert-sorted) A rows use expert `expert`.
struct gemm_tile {
    int32_t expert, row0, rows;
};

struct gemm_params {
    dmat W, W2;                 // [N (* experts), K]; W2 only for swiglu (same format and shape as W)
    int64_t N = 0;              // output columns (swiglu: features) per expert
    const float* x = nullptr;   // A rows fp32, row i at x + i * ldx
    int64_t ldx = 0;
    const int32_t* gather = nullptr;  // optional: A row r is x row gather[r] / gather_div
    int gather_div = 1;
    // dense: M rows, one implicit tile per 64; grouped: tiles[0, *n_tiles) (max_tiles launched, rest exit)
    int M = 0;
    const gemm_tile* tiles = nullptr;
    const int32_t* n_tiles = nullptr;
    int max_tiles = 0;
    gemm_epilogue epi = gemm_epilogue::store;
    gemv_segment seg[4];  // store
    int n_seg = 1;
    bool accumulate = false;
    float* out = nullptr;  // rows / swiglu
    int64_t ldo = 0;
    // Operands as bf16 hi + lo pairs (three tensor-core products): ~fp32 accuracy instead of bf16's 2^-9
    // relative rounding of each input, for 2-3x the tensor work.
    bool precise = false;
    // Fast mode: A is multiplied by this power of two before its fp16 conversion (results are divided by it), so
    // activations up to 65504 / a_scale fit; values beyond saturate.
    float a_scale = 1.0f;
};

// True when gemm() can run W (format, K a multiple of 64, group a multiple of 32).
bool gemm_supports(const dmat& W);

// CPU twin: cpu::matmul (W rows of expert e: rows [e*N, (e+1)*N)).
void gemm(const gemm_params& p, cudaStream_t stream);

}  // namespace tansy::cuda
