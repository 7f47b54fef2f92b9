// Tensor-core matrix multiplication for many input rows (prompt processing, large batches): Y = X W^T with W
// a device matrix (4/8-bit affine dequantised inside the kernel, or bf16), X fp16 (fast: converted beforehand
// by to_f16 or written so by the previous GEMM) or fp32 split into bf16 hi + lo pairs on its way into shared
// memory (precise), fp32 accumulation (mma.sync m16n8k16). The same kernels run dense projections and the
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
// Dense fast GEMMs of at least k_gemm_wide_min_rows rows (kernel_plan.h) take 128-row tiles (fewer would leave SMs
// idle).

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
    const float* x = nullptr;   // precise mode: A rows fp32, row i at x + i * ldx
    int64_t ldx = 0;
    const uint16_t* x16 = nullptr;  // fast mode: A rows as fp16, already times a_scale (to_f16), row i at x16 + i * ldx16
    int64_t ldx16 = 0;
    const int32_t* gather = nullptr;  // optional: A row r is x row gather[r] / gather_div
    int gather_div = 1;
    // dense: M rows, one implicit tile per 64; grouped: tiles[0, *n_tiles) (max_tiles launched, rest exit), and M
    // the rows of x16 (gate/up: tokens; down: slots) where known (the extent of the wgmma GEMM's TMA maps; 0: none)
    int M = 0;
    const gemm_tile* tiles = nullptr;
    const int32_t* n_tiles = nullptr;
    int max_tiles = 0;
    int tile_bm = k_gemm_bm;  // grouped: the most rows of a tile (moe_plan's bm: 64, 128, or 80 on wgmma)
    gemm_epilogue epi = gemm_epilogue::store;
    gemv_segment seg[4];  // store
    int n_seg = 1;
    bool accumulate = false;
    float* out = nullptr;  // rows / swiglu
    int64_t ldo = 0;
    // swiglu, fast mode: instead of out, write fp16(value * out16_scale) to out16 (the next GEMM's x16)
    uint16_t* out16 = nullptr;
    float out16_scale = 1.0f;
    // Operands as bf16 hi + lo pairs (three tensor-core products): ~fp32 accuracy instead of bf16's 2^-9
    // relative rounding of each input, for 2-3x the tensor work.
    bool precise = false;
    // Fast mode: x16 holds A times this power of two (the results are divided by it), so activations up to
    // 65504 / a_scale fit in fp16; values beyond saturate.
    float a_scale = 1.0f;
    // K split (dense store calls): the CTAs of slice z take k-tiles [z nk / S, (z+1) nk / S) and write their
    // partial products to split_ws [S][M][N]; a second kernel sums the slices in order (the result does not depend
    // on scheduling) and applies the store epilogue. 1: never; 0: as gemm_split_slices chooses for the device and
    // the kernel plan (a call whose CTAs would leave most SMs idle: a decode batch's output projections, the
    // router); N > 1: N slices. split_ws: gemm_split_floats(p) floats, used by one call at a time.
    int split_k = 1;
    float* split_ws = nullptr;
};

// dst [rows, cols] fp16 (row stride cols) = src [rows, cols] (row stride ld) * scale, saturating at +-65504: the
// fast GEMM's A operand, converted once instead of in every CTA that reads it. cols and ld multiples of 4.
void to_f16(uint16_t* dst, const float* src, int64_t rows, int64_t cols, int64_t ld, float scale, cudaStream_t stream);

// True when gemm() can run W (format, K a multiple of 64, group a multiple of 32, and its kernels fit the
// device's shared memory).
bool gemm_supports(const dmat& W);
// True when the 128-row tiles of this weight format fit the device's shared memory (dense calls of
// k_gemm_wide_min_rows rows take them then; grouped calls only when moe_plan was given bm = 128).
bool gemm_wide_tiles_fit(dfmt f);

// The fast mode's 4-bit GEMMs with 128-row tiles run on wgmma (sm90/gemm_wgmma.cu) where the build has it (architecture 90 among
// TANSY_CUDA_ARCHS) and the device is compute capability 9.0, else on mma.sync. The kernel plan's wgmma switch
// (--kernels wgmma=off) keeps mma.sync, for A/B; tests run both (force_gemm_wgmma, kernel_plan.h).
bool gemm_wgmma_available();
bool gemm_wgmma_enabled();
// Calls of the wgmma GEMM launched so far with their X tiles copied by TMA (kernel plan tma=on; tests check that
// this form ran). 0 where the build has no wgmma GEMM.
uint64_t gemm_tma_calls();

// Rows per tile for moe_plan when T tokens pick k of E experts whose matrices look like W: on the wgmma GEMM 80
// (k_gemm_wgmma_moe_tokens) once experts average k_gemm_wgmma_moe_wide_rows rows; on mma.sync 128 once they
// average k_moe_wide_rows_per_expert (fast mode, where such tiles fit); else 64.
int gemm_grouped_tile_rows(const dmat& W, bool precise, int T, int E, int k);

// The K slices gemm() takes for p (1: no split): dense store calls on the precise kernel or the wgmma GEMM only.
int gemm_split_slices(const gemm_params& p);
// The workspace floats p.split_ws must hold for gemm(p) (0: none).
size_t gemm_split_floats(const gemm_params& p);

// CPU twin: cpu::matmul (W rows of expert e: rows [e*N, (e+1)*N)).
void gemm(const gemm_params& p, cudaStream_t stream);

}  // namespace tansy::cuda
