// Device helpers shared by the GEMM kernels (gemm.cu: mma.sync; sm90/gemm_wgmma.cu: wgmma): the tile
// geometry, weight dequantisation, the tile's rows and W rows, and the epilogue. Device code only.
#pragma once
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/mma.cuh"

namespace tansy::cuda::gemm_dev {

constexpr int BM = k_gemm_bm, BN = k_gemm_bn, BK = 64;
constexpr int k_threads = 256;

// 16-byte words holding 32 weights.
template <dfmt F>
constexpr int w_words() {
    return F == dfmt::q4 ? 1 : F == dfmt::q8 ? 2 : 4;
}

// 32 weights (16-byte words c) as floats: affine codes become q * scale + bias in fp32 (as the CPU twin).
template <dfmt F>
__device__ __forceinline__ void dequant32(float (&v)[32], const uint4 (&c)[w_words<F>()], uint32_t sb) {
    uint32_t w[4 * w_words<F>()];
#pragma unroll
    for (int j = 0; j < w_words<F>(); j++) w[4 * j] = c[j].x, w[4 * j + 1] = c[j].y, w[4 * j + 2] = c[j].z, w[4 * j + 3] = c[j].w;
    if constexpr (F == dfmt::bf16) {
#pragma unroll
        for (int i = 0; i < 16; i++) v[2 * i] = __uint_as_float(w[i] << 16), v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    } else if constexpr (F == dfmt::q4) {
        const float s = sb_scale(sb), b = sb_bias(sb);
        // word k: values 8k..8k+7 in nibbles 0..7; even values in the low nibble of each byte
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const uint32_t lo = w[k] & 0x0F0F0F0Fu, hi = (w[k] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                v[8 * k + 2 * i] = fmaf(byte_to_float(lo, i), s, b);
                v[8 * k + 2 * i + 1] = fmaf(byte_to_float(hi, i), s, b);
            }
        }
    } else {
        const float s = sb_scale(sb), b = sb_bias(sb);
#pragma unroll
        for (int k = 0; k < 8; k++)  // word k: values 4k..4k+3 in bytes 0..3
#pragma unroll
            for (int i = 0; i < 4; i++) v[4 * k + i] = fmaf(byte_to_float(w[k], i), s, b);
    }
}

// The tile's rows (dense: the blockIdx.y-th 64; grouped: the work list's entry); false if the CTA has none.
template <int BMT>
__device__ __forceinline__ bool tile_rows(const gemm_params& p, int& expert, int& row0, int& rows) {
    expert = 0;
    if (p.tiles) {
        if ((int)blockIdx.y >= *p.n_tiles) return false;
        const gemm_tile t = p.tiles[blockIdx.y];
        expert = t.expert, row0 = t.row0, rows = t.rows;
    } else {
        row0 = (int)blockIdx.y * BMT;
        rows = min(BMT, p.M - row0);
    }
    return true;
}

// Source row of A row r of the tile (the gathered token for grouped gate/up).
__device__ __forceinline__ int64_t a_row(const gemm_params& p, int64_t r) {
    return p.gather ? p.gather[r] / p.gather_div : r;
}

// W row behind tile column c (swiglu: even columns gate feature c/2, odd ones up) and whether it exists.
template <gemm_epilogue EPI>
__device__ __forceinline__ const dmat& w_of_column(const gemm_params& p, int c, int expert, int64_t& wrow, bool& valid) {
    const int64_t n = EPI == gemm_epilogue::swiglu ? (int64_t)blockIdx.x * (BN / 2) + c / 2 : (int64_t)blockIdx.x * BN + c;
    valid = n < p.N;
    wrow = (int64_t)expert * p.N + (valid ? n : 0);
    return EPI == gemm_epilogue::swiglu && (c & 1) ? p.W2 : p.W;
}

// Eight floats as fp16 (one 16-byte shared-memory chunk of a dequantised W row).
__device__ __forceinline__ uint4 pack_f16x8(const float* v) {
    return make_uint4(pack_f16(v[0], v[1]), pack_f16(v[2], v[3]), pack_f16(v[4], v[5]), pack_f16(v[6], v[7]));
}

// The fast kernels' A copy roles: thread tid copies 16-byte chunk tid % 8 of rows tid/8 + 32 i (i < N) of each
// k-tile; src[i] is that row's first chunk, or null past the tile's rows (zero-filled).
template <int N>
__device__ __forceinline__ void a_sources(const gemm_params& p, int row0, int rows, int tid, const uint16_t* (&src)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) {
        const int r = tid / 8 + 32 * i;
        src[i] = r < rows ? p.x16 + a_row(p, row0 + r) * p.ldx16 + (tid % 8) * 8 : nullptr;
    }
}

// The ring's start: k-tiles 0 .. STAGES-2 in flight (one commit group each, empty past nk), then k-tile 0's W
// dequantised once they have landed.
template <int STAGES, class Issue, class Dequant>
__device__ __forceinline__ void ring_start(int nk, Issue&& issue, Dequant&& dequant) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nk) issue(s);
        cp_async_commit();  // (possibly empty: keeps one group per k-tile)
    }
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    dequant(0);
}

// The k-tiles [kt0, kt1) of this CTA's K slice (blockIdx.z of gridDim.z; all nk without a split).
__device__ __forceinline__ void k_slice(int nk, int& kt0, int& kt1) {
    kt0 = (int)((int64_t)blockIdx.z * nk / gridDim.z);
    kt1 = (int)((int64_t)(blockIdx.z + 1) * nk / gridDim.z);
}

// The rows epilogue's destination of A row r, column col: a K split's slice z writes rows z M .. z M + M - 1
// (gemm_params::split_ws; blockIdx.z is 0 otherwise).
__device__ __forceinline__ float* rows_out(const gemm_params& p, int64_t r, int64_t col) {
    return p.out + ((int64_t)blockIdx.z * p.M + r) * p.ldo + col;
}

// The store epilogue's output segment holding output column col.
__device__ __forceinline__ int segment_of(const gemm_params& p, int64_t col) {
    int s = 0;
    while (s + 1 < p.n_seg && col >= p.seg[s + 1].row0) s++;
    return s;
}

// One value out (store / rows epilogues): A row r (global), output column col, already divided by the fast
// mode's a_scale.
template <gemm_epilogue EPI>
__device__ __forceinline__ void store_value(const gemm_params& p, int64_t r, int64_t col, float v) {
    if (col >= p.N) return;
    if constexpr (EPI == gemm_epilogue::rows) {
        *rows_out(p, r, col) = v;
    } else {
        const int s = segment_of(p, col);
        float* o = p.seg[s].out + r * p.seg[s].ld + (col - p.seg[s].row0);
        *o = p.accumulate ? *o + v : v;
    }
}

// The SwiGLU value y of feature f (< p.N) for A row r (global) out, as fp16 times out16_scale (out16) or fp32.
__device__ __forceinline__ void store_swiglu_value(const gemm_params& p, int64_t r, int64_t f, float y) {
    if (p.out16)
        p.out16[r * p.ldo + f] = (uint16_t)(pack_f16(y * p.out16_scale, 0.0f) & 0xFFFFu);
    else
        p.out[r * p.ldo + f] = y;
}
__device__ __forceinline__ void store_swiglu(const gemm_params& p, int64_t r, int64_t f, float gate, float up) {
    store_swiglu_value(p, r, f, siluf_(gate) * up);
}

// One accumulator pair out: tile row m (token slot), tile columns cl and cl + 1 (cl even; swiglu: the gate and
// up of feature cl / 2), values already divided by the fast mode's a_scale.
template <gemm_epilogue EPI>
__device__ __forceinline__ void store_pair(const gemm_params& p, int row0, int rows, int m, int cl, float v0, float v1) {
    if (m >= rows) return;
    const int64_t r = row0 + m;
    if constexpr (EPI == gemm_epilogue::swiglu) {
        const int64_t f = (int64_t)blockIdx.x * (BN / 2) + cl / 2;
        if (f < p.N) store_swiglu(p, r, f, v0, v1);
    } else {
        const int64_t n0 = (int64_t)blockIdx.x * BN + cl;
        store_value<EPI>(p, r, n0, v0);
        store_value<EPI>(p, r, n0 + 1, v1);
    }
}

// Warp (wm, wn)'s (16 MI) x 32 accumulators out (mma.sync layout): accumulator (mi, ni) element 2h + e is tile
// row wm*16*MI + mi*16 + lane/4 + 8h, tile column wn*32 + ni*8 + 2*(lane%4) + e.
template <gemm_epilogue EPI, int MI>
__device__ __forceinline__ void store_tile(const gemm_params& p, const float (&acc)[MI][4][4], int row0, int rows,
                                           int wm, int wn, int lane, float inv_scale) {
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int ni = 0; ni < 4; ni++)
                store_pair<EPI>(p, row0, rows, wm * 16 * MI + mi * 16 + lane / 4 + 8 * h, wn * 32 + ni * 8 + 2 * (lane % 4),
                                acc[mi][ni][2 * h] * inv_scale, acc[mi][ni][2 * h + 1] * inv_scale);
}

}  // namespace tansy::cuda::gemm_dev
