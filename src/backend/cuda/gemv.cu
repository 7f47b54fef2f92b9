// GEMV: y[t] = W x[t] for a few input rows t (decode steps, small batches), W of 4-bit / 8-bit affine or bf16
// rows (y = sum_g scale_g (q . x)_g + bias_g sum_g x), x optionally RMS-normalised in the prologue. This file is
// the dispatch; each family has its own file (gemv_family.cuh), tried in this order:
//   gemv_mma_warp   2..32 rows, 4-bit, fast mode: tensor cores, A fragments from global memory per warp
//   gemv_mma        1..16 rows, 4-bit: tensor cores through a block ring (16 rows in groups of 8 where they fit)
//   gemv_warp       one row, 4-bit, fast mode: int8 inputs, per-warp rings; optional router tap
//   gemv_stream     one row, other formats/modes: whole-row tiles through a block ring
//   gemv_general    everything else: warp subgroups walk rows
// Which families may run (mma, int8) is the kernel plan's (kernel_plan.h). Decode is a chain of small launches
// bound by latency, not bytes: weights (independent of the previous kernel) are requested before the PDL wait.
#include <algorithm>

#include "backend/cuda/gemv_family.cuh"

namespace tansy::cuda {

using namespace gemv_impl;

namespace {

// The per-warp ring's rows per warp where gemv(p) takes int8 inputs (gemv_int8_inputs), else 0.
int int8_warp_slots(const gemv_params& p) {
    const bool int8 = decode_int8_inputs() && p.f16_inputs && p.W.fmt == dfmt::q4 && p.T == 1 && !mma_gemv_supports(p) &&
                      xs_chunks_per_lane<dfmt::q4>(p.W.cols / 32) != 0;
    return int8 ? gemv_warp_slots(p) : 0;
}

template <dfmt F>
void launch(const gemv_params& p, cudaStream_t stream) {
    const int64_t n_chunks = p.W.cols / chunk_values<F>();
    if (mma_gemv_supports(p)) {
        run_mma(p, stream);
        CUDA_CHECK_LAUNCH();
        return;
    }
    if (p.T == 1) {
        bool done = true;
        if (const int slots = int8_warp_slots(p)) {
            if constexpr (F == dfmt::q4) run_warp(p, xs_chunks_per_lane<F>(n_chunks), slots, stream);
        } else {
            done = run_stream(p, stream);
        }
        if (done) {
            CUDA_CHECK_LAUNCH();
            return;
        }
    }
    run_general(p, stream);
    CUDA_CHECK_LAUNCH();
}

}  // namespace

bool gemv_int8_inputs(const gemv_params& p) { return int8_warp_slots(p) != 0; }

bool gemv_router_tap_supports(const gemv_params& p) {
    const dmat& R = p.tap.R;
    const int64_t N = p.W.rows;
    return int8_warp_slots(p) != 0 && p.n_seg == 1 && R.fmt == dfmt::q8 && R.cols == N && N % 16 == 0 &&
           N <= (int64_t)sm_count() * (k_stream_threads / 32) && R.group % 16 == 0 && R.rows >= 1 &&
           R.rows <= k_stream_threads && p.tap.nw;
}

int gemv_max_rows(const dmat& W) {
    gemv_params p;
    p.W = W, p.T = std::clamp(active_kernel_plan().dense_rows, k_mma_max_tokens, k_mma_warp_max_tokens), p.f16_inputs = true;
    return plan_mma_warp(p).blocks > 0 ? p.T : k_mma_max_tokens;
}

int gemv_lanes_per_row(int64_t n_chunks) {
    int L = 1;
    while (L < 32 && 2 * L <= n_chunks) L *= 2;
    return L;
}

void gemv(const gemv_params& p, cudaStream_t stream) {
    TANSY_CHECK(!p.tap.logits || gemv_router_tap_supports(p), "gemv: router tap on an unsupported shape");
    const int CH = p.W.fmt == dfmt::q4 ? 32 : p.W.fmt == dfmt::q8 ? 16 : 8;
    TANSY_CHECK(p.W.cols % CH == 0, "gemv: %lld columns is not a multiple of %d", (long long)p.W.cols, CH);
    TANSY_CHECK(p.W.fmt == dfmt::bf16 || (p.W.group % CH == 0), "gemv: group %d vs chunk %d", p.W.group, CH);
    TANSY_CHECK(p.ldx % 4 == 0 && p.T >= 1, "gemv: ldx %lld, T %d", (long long)p.ldx, p.T);
    TANSY_CHECK(!p.norm_w || p.T <= k_gemv_max_norm_rows, "gemv: norm prologue with T=%d", p.T);
    TANSY_CHECK(p.n_seg >= 1 && p.n_seg <= 4 && p.seg[0].row0 == 0, "gemv: %d segments", p.n_seg);
    if (p.W.rows == 0) return;
    if (const mma_warp_plan pl = plan_mma_warp(p); pl.blocks > 0) {  // 2..32 rows on tensor cores, per warp
        run_mma_warp(p, pl, stream);
        CUDA_CHECK_LAUNCH();
        return;
    }
    if (p.T > k_mma_group_tokens && !mma_gemv_supports(p)) {  // rows in groups of 8 on tensor cores where they fit
        gemv_params q = p;
        q.T = k_mma_group_tokens;
        if (mma_gemv_supports(q)) {
            for (int t0 = 0; t0 < p.T; t0 += k_mma_group_tokens) {
                q.T = std::min(k_mma_group_tokens, p.T - t0);
                q.x = p.x + t0 * p.ldx;
                for (int i = 0; i < p.n_seg; i++) q.seg[i].out = p.seg[i].out + t0 * p.seg[i].ld;
                gemv(q, stream);
            }
            return;
        }
    }
    switch (p.W.fmt) {
        case dfmt::q4: launch<dfmt::q4>(p, stream); break;
        case dfmt::q8: launch<dfmt::q8>(p, stream); break;
        case dfmt::bf16: launch<dfmt::bf16>(p, stream); break;
    }
}

}  // namespace tansy::cuda
