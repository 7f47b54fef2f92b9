// MoE gate/up, the general form: h = silu(x W_gate^T) * (x W_up^T) for each token's k routed experts and the
// shared expert, any weight format (8-bit, bf16, precise mode, shapes the decode families do not take), after a
// separate top-k launch (moe_route.cu). Grid (row tiles, T (k+1) slots); a subgroup of L lanes owns R rows and
// computes gate and up for each, weights straight from global memory (__ldg), the input chunk normalised on load.
#include <algorithm>

#include "backend/cuda/moe_family.cuh"

namespace tansy::cuda::moe_impl {

namespace {

constexpr int k_warps = 4;

template <dfmt F>
__device__ __forceinline__ float load_chunk(float (&xv)[chunk_values<F>()], const float* x, const float* nw,
                                            bool norm, float inv, bool f16) {
    constexpr int CH = chunk_values<F>();
    chunk_load<CH>(xv, x);
    if (norm) {
        float w[CH];
        chunk_load<CH>(w, nw);
#pragma unroll
        for (int i = 0; i < CH; i++) xv[i] *= inv * w[i];
    }
    if (f16) {
#pragma unroll
        for (int i = 0; i < CH; i++) xv[i] = round_f16(xv[i]);
    }
    return chunk_sum<CH>(xv);
}

// grid: (row tiles, T*(k+1)). Each subgroup of L lanes owns R rows and computes gate and up for each.
template <dfmt F, int R>
__global__ void __launch_bounds__(k_warps * 32)
    gate_up_kernel(float* h, const dmoe m, const int32_t* idx, const float* x, int64_t ldx, const float* norm_w,
                   float eps, bool f16, int L, int64_t h_ld) {
    constexpr int CH = chunk_values<F>();
    __shared__ float s_inv[1];
    const int slot = blockIdx.y, t = slot / (m.k + 1), j = slot % (m.k + 1);
    const bool shared = j == m.k;
    const int64_t rows = shared ? m.Fs : m.F;
    const dmat G = shared ? m.s_gate : m.gate.rows_view((int64_t)idx[t * m.k + j] * m.F, m.F);
    const dmat U = shared ? m.s_up : m.up.rows_view((int64_t)idx[t * m.k + j] * m.F, m.F);
    const float* xr = x + t * ldx;
    if (norm_w) block_inv_rms_rows(s_inv, xr, ldx, 1, m.D, eps);
    const float inv = norm_w ? s_inv[0] : 1.0f;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sl = lane % L;
    const int64_t row0 = ((int64_t)blockIdx.x * k_warps + warp) * (32 / L) * R + (lane / L) * R;
    const bool active = row0 < rows;  // idle lanes stay for the shuffles
    const int64_t n_chunks = m.D / CH, rw = G.row_words(), ng = G.n_groups();
    float g[R], u[R];
#pragma unroll
    for (int r = 0; r < R; r++) g[r] = u[r] = 0.0f;
    for (int64_t c = sl; active && c < n_chunks; c += L) {
        uint4 wg[R], wu[R];
        uint32_t sg[R], su[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int64_t row = min(row0 + r, rows - 1);
            wg[r] = __ldg(reinterpret_cast<const uint4*>(G.w + row * rw) + c);
            wu[r] = __ldg(reinterpret_cast<const uint4*>(U.w + row * rw) + c);
            if constexpr (F != dfmt::bf16) {
                sg[r] = __ldg(G.sb + row * ng + (c * CH) / G.group);
                su[r] = __ldg(U.sb + row * ng + (c * CH) / U.group);
            } else {
                sg[r] = su[r] = 0;
            }
        }
        float xv[CH];
        const float sx = load_chunk<F>(xv, xr + c * CH, norm_w + c * CH, norm_w != nullptr, inv, f16);
#pragma unroll
        for (int r = 0; r < R; r++) {
            g[r] += affine_or_dense<F>(wg[r], sg[r], xv, sx);
            u[r] += affine_or_dense<F>(wu[r], su[r], xv, sx);
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
        for (int o = L / 2; o > 0; o >>= 1) {
            g[r] += __shfl_xor_sync(0xffffffffu, g[r], o);
            u[r] += __shfl_xor_sync(0xffffffffu, u[r], o);
        }
    if (active && sl == 0)
#pragma unroll
        for (int r = 0; r < R; r++)
            if (row0 + r < rows) h[slot * h_ld + row0 + r] = siluf_(g[r]) * u[r];
}

}  // namespace

void run_gate_up_general(float* h, const dmoe& m, const int32_t* idx, const float* x, int64_t ldx, int T,
                         const float* norm_w, float eps, bool f16, cudaStream_t stream) {
    const dfmt f = m.gate.fmt;
    constexpr int R = 2;
    const int L = gemv_lanes_per_row(m.D / chunk_of(f));
    const int64_t rows = std::max(m.F, m.Fs), per_block = (int64_t)k_warps * (32 / L) * R;
    const dim3 grid((unsigned)((rows + per_block - 1) / per_block), (unsigned)(T * (m.k + 1)));
    switch (f) {
        case dfmt::q4: gate_up_kernel<dfmt::q4, R><<<grid, k_warps * 32, 0, stream>>>(h, m, idx, x, ldx, norm_w, eps, f16, L, rows); break;
        case dfmt::q8: gate_up_kernel<dfmt::q8, R><<<grid, k_warps * 32, 0, stream>>>(h, m, idx, x, ldx, norm_w, eps, f16, L, rows); break;
        case dfmt::bf16: gate_up_kernel<dfmt::bf16, R><<<grid, k_warps * 32, 0, stream>>>(h, m, idx, x, ldx, norm_w, eps, f16, L, rows); break;
    }
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda::moe_impl
