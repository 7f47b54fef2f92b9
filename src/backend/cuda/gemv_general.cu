// GEMV, the general form: any format, any number of input rows (8-bit router batches, precise mode, shapes the
// faster forms do not take). Warp subgroups of L lanes (a power of two <= the row's 16-byte chunks) each walk R
// rows, TB input rows per pass, so a weight chunk loaded once serves R x TB products; token groups spread over
// blockIdx.y when the rows alone would leave SMs idle. Weights go straight from global memory to registers (__ldg),
// two chunks ahead; the RMS-norm prologue normalises only the block's own input rows where it can.
#include <algorithm>

#include "backend/cuda/gemv_family.cuh"

namespace tansy::cuda::gemv_impl {

namespace {

constexpr int k_warps = 4, U = 2;

// note: nw is passed by reference with a flag, never as a pointer: taking its address would move it to local
// memory (128-byte stack frames in the SASS).
template <dfmt F>
__device__ __forceinline__ float load_x_chunk(float (&xv)[chunk_values<F>()], const float* x,
                                              const float (&nw)[chunk_values<F>()], bool norm, float scale, bool f16) {
    constexpr int CH = chunk_values<F>();
    chunk_load<CH>(xv, x);
    if (norm) {
#pragma unroll
        for (int i = 0; i < CH; i++) xv[i] *= scale * nw[i];
    }
    if (f16) {
#pragma unroll
        for (int i = 0; i < CH; i++) xv[i] = round_f16(xv[i]);
    }
    return chunk_sum<CH>(xv);
}

template <dfmt F, int R, int TB>
__global__ void __launch_bounds__(k_warps * 32) gemv_kernel(const gemv_params p, int L) {
    constexpr int CH = chunk_values<F>();
    constexpr bool AFFINE = F != dfmt::bf16;
    __shared__ float s_inv[k_gemv_max_norm_rows];
    const int64_t K = p.W.cols, N = p.W.rows, n_chunks = K / CH, rw = p.W.row_words(), ng = p.W.n_groups();
    pdl_trigger();
    if (p.norm_w) {
        // where the token groups are one pass over the grid's y (a decode batch's router: 16 rows, 4 groups of 4),
        // a block normalises only its own rows: one round trip of loads instead of T / 4
        const bool one_pass = (int64_t)gridDim.y * TB >= p.T;
        const int t0 = one_pass ? (int)blockIdx.y * TB : 0, n = one_pass ? max(0, min(TB, p.T - t0)) : p.T;
        if (n > 0) block_inv_rms_rows(s_inv + t0, p.x + t0 * p.ldx, p.ldx, n, K, p.eps);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sl = lane % L;
    const int64_t row0 = ((int64_t)blockIdx.x * k_warps + warp) * (32 / L) * R + (lane / L) * R;
    // note: an idle subgroup must not return: its lanes still take part in the warp's shuffles below
    const bool active = row0 < N;
    const uint4* wbase[R];
#pragma unroll
    for (int r = 0; r < R; r++) wbase[r] = reinterpret_cast<const uint4*>(p.W.w + min(row0 + r, N - 1) * rw);

    // blockIdx.y: this block's group of TB input rows (a small matrix, e.g. the router, still fills the GPU)
    for (int t0 = blockIdx.y * TB; t0 < p.T; t0 += TB * gridDim.y) {
        float acc[R][TB];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int tb = 0; tb < TB; tb++) acc[r][tb] = 0.0f;
        for (int64_t c0 = sl; active && c0 < n_chunks; c0 += U * L) {
            uint4 wv[U][R];
            uint32_t sb[U][R];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t c = min(c0 + u * L, n_chunks - 1);
#pragma unroll
                for (int r = 0; r < R; r++) {
                    wv[u][r] = __ldg(wbase[r] + c);
                    if constexpr (AFFINE) sb[u][r] = __ldg(p.W.sb + min(row0 + r, N - 1) * ng + (c * CH) / p.W.group);
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t c = c0 + u * L;
                if (c >= n_chunks) break;
                float nw[CH];
                if (p.norm_w) chunk_load<CH>(nw, p.norm_w + c * CH);
#pragma unroll
                for (int tb = 0; tb < TB; tb++) {
                    const int t = t0 + tb;
                    if (t >= p.T) break;
                    float xv[CH];
                    const float sx = load_x_chunk<F>(xv, p.x + t * p.ldx + c * CH, nw, p.norm_w != nullptr,
                                                     p.norm_w ? s_inv[t] : 1.0f, p.f16_inputs);
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        const float d = chunk_dot<F>(wv[u][r], xv, sx);
                        if constexpr (AFFINE)
                            acc[r][tb] += sb_scale(sb[u][r]) * d + sb_bias(sb[u][r]) * sx;
                        else
                            acc[r][tb] += d;
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int tb = 0; tb < TB; tb++)
                for (int o = L / 2; o > 0; o >>= 1) acc[r][tb] += __shfl_xor_sync(0xffffffffu, acc[r][tb], o);
        if (active && sl == 0) {
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int tb = 0; tb < TB; tb++)
                    if (row0 + r < N && t0 + tb < p.T) store_out(p, row0 + r, t0 + tb, acc[r][tb]);
        }
    }
}

template <dfmt F, int R, int TB>
void launch_rt(const gemv_params& p, int L, cudaStream_t stream) {
    const int64_t per_block = (int64_t)k_warps * (32 / L) * R;
    const int64_t blocks = (p.W.rows + per_block - 1) / per_block;
    // token groups across blocks when the rows alone leave SMs idle (>= 2 blocks per SM otherwise)
    const int64_t groups = std::min<int64_t>((p.T + TB - 1) / TB, std::max<int64_t>(1, 2 * sm_count() / blocks));
    gemv_kernel<F, R, TB><<<dim3((unsigned)blocks, (unsigned)groups), k_warps * 32, 0, stream>>>(p, L);
}

template <dfmt F>
void run_general_as(const gemv_params& p, cudaStream_t stream) {
    const int64_t n_chunks = p.W.cols / chunk_values<F>();
    const int L = gemv_lanes_per_row(n_chunks);
    // Rows per subgroup: more rows share each input chunk, but the grid must still cover every SM several
    // times over (132 SMs on an H200).
    const int64_t rows_per_r1_block = (int64_t)k_warps * (32 / L);
    const int64_t blocks_r1 = (p.W.rows + rows_per_r1_block - 1) / rows_per_r1_block;
    const int R = blocks_r1 >= 4096 ? 4 : blocks_r1 >= 2048 ? 2 : 1;
    if (p.T == 1) {
        if (R == 4) launch_rt<F, 4, 1>(p, L, stream);
        else if (R == 2) launch_rt<F, 2, 1>(p, L, stream);
        else launch_rt<F, 1, 1>(p, L, stream);
    } else {  // 4 input rows per pass: at most 2 rows per subgroup, or the accumulators spill
        if (R >= 2) launch_rt<F, 2, 4>(p, L, stream);
        else launch_rt<F, 1, 4>(p, L, stream);
    }
}

}  // namespace

void run_general(const gemv_params& p, cudaStream_t stream) {
    switch (p.W.fmt) {
        case dfmt::q4: run_general_as<dfmt::q4>(p, stream); break;
        case dfmt::q8: run_general_as<dfmt::q8>(p, stream); break;
        case dfmt::bf16: run_general_as<dfmt::bf16>(p, stream); break;
    }
}

}  // namespace tansy::cuda::gemv_impl
