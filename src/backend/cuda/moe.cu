// MoE block for decode tokens: routing (top-k of the router's logits), gate/up with SwiGLU into h, then down,
// x[t] += sum_j w_j down_j h_j over the k routed experts and the shared expert (weight sigmoid(shared gate)).
// This file is the dispatch; each form has its own file (moe_family.cuh), tried in this order:
//   moe_decode_mma     tensor cores (off unless the kernel plan's mma has gate_up / down)
//   moe_decode_warp    fast mode, 4-bit rows: int8 inputs, per-warp rings; one token: routing from the router tap
//   moe_decode_stream  4-bit rows otherwise (gate/up), any format (down): block rings of whole-row tiles
//   moe_general        gate/up for everything else, after moe_route's top-k launch
// Up to 16 rows in one launch each; 17 .. kernel_plan::moe_small rows (fast mode) take the small-M grouped kernels
// (moe_grouped_mma.cu), else 17 .. kernel_plan::moe_groups rows run in groups of <= 16 (cuda_backend.cu); more rows
// (prompts) take the grouped GEMMs instead (moe_grouped.cu, gemm.cu).
#include "backend/cuda/moe_family.cuh"

namespace tansy::cuda {

using namespace moe_impl;

void moe_route_gate_up(float* h, const dmoe& m, const moe_routing& r, const float* x, int64_t ldx, int T,
                       const float* norm_w, float eps, bool f16, cudaStream_t stream) {
    const dfmt f = m.gate.fmt;
    TANSY_CHECK(m.up.fmt == f && m.s_gate.fmt == f && m.s_up.fmt == f, "moe: mixed weight formats");
    // the kernels walk every slot's rows with the routed experts' row layout
    TANSY_CHECK(f == dfmt::bf16 || (m.up.group == m.gate.group && m.s_gate.group == m.gate.group &&
                                    m.s_up.group == m.gate.group),
                "moe: mixed quantisation groups");
    TANSY_CHECK(m.D % chunk_of(f) == 0 && ldx % 4 == 0 && m.D % 4 == 0, "moe_gate_up: D=%lld", (long long)m.D);
    TANSY_CHECK(m.k >= 1 && m.k <= k_max_topk && m.k <= m.E && m.E <= k_max_experts, "moe: k=%d E=%d", m.k, m.E);
    if (T == 0) return;
    TANSY_CHECK(!r.tap || (T == 1 && f16 && moe_tap_supports(m)), "moe: the router tap is for one token (moe_tap_supports)");
    const int64_t n_chunks = m.D / chunk_of(f);
    if (gate_up_mma_supports(m))
        return launch_gate_up_mma(h, m, r, x, ldx, T, norm_w, eps, f16, stream);  // tensor cores, top-k fused
    if (m.F == m.Fs && n_chunks % 32 == 0 && f == dfmt::q4) {  // the decode hot path: x in registers, top-k fused
        const bool xq = f16 && decode_int8_inputs();  // fast mode: x as two-level int8 (xq.cuh)
        if (xq && gate_up_warp_fits(m)) {
            if (n_chunks == 64) return run_gate_up_warp(h, m, r, x, ldx, T, norm_w, eps, 2, stream);
            if (n_chunks == 32) return run_gate_up_warp(h, m, r, x, ldx, T, norm_w, eps, 1, stream);
        }
        if (n_chunks == 64) return run_gate_up_stream(h, m, r, x, ldx, T, norm_w, eps, f16, 2, stream);
        if (n_chunks == 32) return run_gate_up_stream(h, m, r, x, ldx, T, norm_w, eps, f16, 1, stream);
    }
    moe_topk(r, T, m.E, m.k, stream);
    run_gate_up_general(h, m, r.idx, x, ldx, T, norm_w, eps, f16, stream);
}

bool moe_tap_supports(const dmoe& m) {
    for (const dmat* W : {&m.gate, &m.up, &m.down, &m.s_gate, &m.s_up, &m.s_down})
        if (W->fmt != dfmt::q4) return false;
    const int64_t n_chunks = m.D / 32;
    return decode_int8_inputs() && m.F == m.Fs && m.D % 32 == 0 && (n_chunks == 32 || n_chunks == 64) && m.k >= 1 && m.k <= k_max_topk && m.k <= m.E && m.E <= k_max_experts &&
           m.up.group == m.gate.group && m.s_gate.group == m.gate.group && m.s_up.group == m.gate.group &&
           m.s_down.group == m.down.group && !gate_up_mma_supports(m) && !down_mma_supports(m) &&
           gate_up_warp_fits(m) && down_warp_fits(m);
}

void moe_down(float* x, int64_t ldx, const dmoe& m, const int32_t* idx, const float* wt, const float* sig,
              const float* h, int T, float h_f16_scale, cudaStream_t stream, unsigned long long* zero_tap) {
    const dfmt f = m.down.fmt;
    TANSY_CHECK(m.s_down.fmt == f && (f == dfmt::bf16 || m.s_down.group == m.down.group),
                "moe: mixed weight formats or quantisation groups");
    TANSY_CHECK(m.F == m.Fs, "cuda moe: expert width %lld != shared expert width %lld is not supported",
                (long long)m.F, (long long)m.Fs);
    TANSY_CHECK(m.F % chunk_of(f) == 0 && m.k <= k_max_topk, "moe_down: F=%lld", (long long)m.F);
    if (T == 0) return;
    if (down_mma_supports(m)) return launch_down_mma(x, ldx, m, idx, wt, sig, h, T, h_f16_scale, stream);
    const bool xq = f == dfmt::q4 && h_f16_scale != 0.0f && decode_int8_inputs();  // fast mode: h as int8 (xq.cuh)
    if (xq && down_warp_fits(m)) {
        run_down_warp(x, ldx, m, idx, wt, sig, h, T, zero_tap, stream);
        return;
    }
    TANSY_CHECK(!zero_tap, "moe_down: the router tap needs the per-warp kernel (moe_tap_supports)");
    run_down_stream(x, ldx, m, idx, wt, sig, h, T, h_f16_scale, stream);
}

}  // namespace tansy::cuda
