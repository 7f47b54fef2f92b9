// MoE block on the device (MODEL.md §5), without host synchronisation: router logits come from gemv() on
// the concatenated [router; shared_expert_gate] rows; then top-k, the selected experts' gate/up, and the down
// projections combined into the residual stream. Host launchers only.
#pragma once
#include <cuda_runtime.h>

#include "backend/cuda/gemm.cuh"
#include "backend/cuda/gemv.cuh"

namespace tansy::cuda {

// Experts stacked: expert e's rows are [e*rows_per_expert, (e+1)*rows_per_expert) of gate/up/down.
struct dmoe {
    dmat gate, up;        // [E*F, D]
    dmat down;            // [E*D, F]
    dmat s_gate, s_up;    // [Fs, D]
    dmat s_down;          // [D, Fs]
    int E = 0, k = 0;
    int64_t F = 0, Fs = 0, D = 0;
};

// The routing of T tokens: router logits [T, ld], E of them then the shared-expert gate logit in column E,
// and where the top-k writes idx/wt [T, k] (descending weight; ties to the lower id) and sig [T] =
// sigmoid(shared gate). bias (optional, [E]) is added to the router logits before selection (synthetic
// routing skew). CPU twin: cpu::moe_route.
struct moe_routing {
    const float* logits = nullptr;
    int64_t ld = 0;
    const float* bias = nullptr;
    // Instead of logits, one token (T == 1, moe_tap_supports): the router tap's fixed-point logits of the
    // unnormalised input ([E + 1], stride k_tap_stride: gemv_router_tap), which the gate/up kernel scales by the norm's 1/rms; moe_down
    // zeroes them again for the next tap (pass it as zero_tap).
    unsigned long long* tap = nullptr;
    int32_t* idx = nullptr;
    float* wt = nullptr;
    float* sig = nullptr;
};

void moe_topk(const moe_routing& r, int T, int E, int k, cudaStream_t stream);

// Routes the T tokens (as moe_topk) and computes h [T, k+1, max(F, Fs)]: slot j < k is expert idx[t][j], slot
// k the shared expert; h = silu(W_gate m) * (W_up m) with m = rms_norm(x[t], norm_w). On the decode path the
// top-k runs inside the gate/up kernel (one launch less per layer). f16: m rounded to fp16 first (round_f16),
// as the fast grouped GEMM's operand is.
void moe_route_gate_up(float* h, const dmoe& m, const moe_routing& r, const float* x, int64_t ldx, int T,
                       const float* norm_w, float eps, bool f16, cudaStream_t stream);

// x[t] += sum_j wt[t][j] * W_down^{idx[t][j]} h[t][j] + sig[t] * W_sdown h[t][k]. h_f16_scale != 0: h is taken
// as round_f16(h * h_f16_scale) / h_f16_scale, the fast grouped GEMM's scaled fp16 operand.
void moe_down(float* x, int64_t ldx, const dmoe& m, const int32_t* idx, const float* wt, const float* sig,
              const float* h, int T, float h_f16_scale, cudaStream_t stream, unsigned long long* zero_tap = nullptr);

// Whether one token's MoE block (fast mode, f16 inputs) can take its routing from the router tap: the gate/up and
// down kernels with per-warp rows and int8 inputs (the tap itself: gemv_router_tap_supports).
bool moe_tap_supports(const dmoe& m);

// ---- many rows (prompt processing): experts as a grouped tensor-core GEMM (gemm.cuh)

// Device-side routing plan for T tokens x k slots: slots sorted by expert (perm[p] = t*k + j at sorted position
// p, pos_of[t*k + j] = p) and the work list of gemm tiles (expert, first sorted row, rows <= bm), at most
// moe_max_tiles(T, E, k, bm, shared) of them, the count in *n_tiles. One CTA; no host synchronisation. bm is 64,
// 80 or 128 (gemm_params::tile_bm, as gemm_grouped_tile_rows picks it), or k_moe_small_bm (moe_small_gate_up).
// shared: the shared expert's tiles follow the routed ones, as expert E over sorted rows [T k, T k + T) (row
// T k + t is token t).
constexpr int k_moe_wide_rows_per_expert = 128;
int moe_max_tiles(int T, int E, int k, int bm, bool shared = false);
void moe_plan(int32_t* perm, int32_t* pos_of, gemm_tile* tiles, int32_t* n_tiles, const int32_t* idx, int T, int E,
              int k, int bm, cudaStream_t stream, bool shared = false);

// x[t] += sum_j wt[t][j] * y[pos_of[t*k + j]] + sig[t] * ys[t] (rows of D floats), in a fixed order.
void moe_combine(float* x, int64_t ldx, const float* y, const float* ys, const int32_t* pos_of, const float* wt,
                 const float* sig, int T, int k, int64_t D, cudaStream_t stream);

// ---- a decode batch of k_gemm_min_rows .. kernel_plan::moe_small rows (fast mode): each expert the step touches
// read once for all its rows, on tensor cores (moe_grouped_mma.cu)

// Rows per tile of moe_plan for these kernels: one mma's two groups of 8 B columns.
constexpr int k_moe_small_bm = 16;

// Whether the kernels take this MoE: all six matrices 4-bit with mma_dot_supports and one group size (a multiple
// of 64 times a power of two), F == Fs, D and F multiples of 64, and 16 rows' staged inputs fit shared memory.
bool moe_small_supports(const dmoe& m);

// Gate/up with SwiGLU for moe_plan(..., k_moe_small_bm, shared = true)'s tiles: h16 [T (k + 1), F] (fp16, row p
// the sorted row p) = fp16(silu(W_gate m) * (W_up m) * h_scale), with m the row's token's input from m16 [T, D]
// (fp16: to_f16 of the normalised input; token of row p < T k: perm[p] / k, of row p >= T k: p - T k) and the
// expert the tile's (E: the shared expert). Rounded as the fast grouped GEMM's SwiGLU epilogue (gemm_params::out16).
void moe_small_gate_up(uint16_t* h16, const dmoe& m, const uint16_t* m16, const int32_t* perm, const gemm_tile* tiles,
                       const int32_t* n_tiles, int max_tiles, int T, float h_scale, cudaStream_t stream);
// Down for the same tiles: y [T (k + 1), D] (fp32, row p the sorted row p) = (W_down h16[p]) / h_scale, as the fast
// grouped GEMM's a_scale. moe_combine(x, ldx, y, y + T k D, ...) then adds the rows into x.
void moe_small_down(float* y, const dmoe& m, const uint16_t* h16, const gemm_tile* tiles, const int32_t* n_tiles,
                    int max_tiles, int T, float h_scale, cudaStream_t stream);
// moe_small_gate_up launches so far in this process (tests: that a MoE block took these kernels).
uint64_t moe_small_launches();

}  // namespace tansy::cuda
