// 4-bit rows times one or more input vectors on tensor cores (device code), for the decode GEMV and the MoE.
// Why: the CUDA-core dot costs ~3.3 instructions per 4-bit weight (byte_perm + FFMA + nibble extraction), which
// bounds the decode kernels (docs/PERF.md). Here mma.sync m16n8k16 does the multiply-adds: a warp
// takes 16 rows x 32 columns per "unit"; lane (g, c) = (lane/4, lane%4) loads word c of the unit in rows g and
// g+8, and one LOP3 + HSUB2 (or HFMA2) turns nibbles (n, n+4) of a word into an exact fp16 pair: the A
// fragments of two k-steps (q4_pairs). x is stored permuted per 8 values as x0 x4 x1 x5 x2 x6 x3 x7 (the order
// the nibble pairs come in). With one input row every column of B is that x, so every column of C is a row's
// dot product; with several, B column n is row n's x (mma_dot_rows_tokens). Precise mode splits x
// into fp16 hi + lo (two mma per k-step; lo is stored times 2^11 and accumulated apart, which keeps it out of
// fp16's subnormals); fast mode's x is already fp16 (lo = 0, skipped). Per group of columns:
// y += scale * C + bias * sum(x). tools/check_gemv_mma_layout.py checks the fragment layout on the CPU.
#pragma once
#include <cuda_fp16.h>

#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gemv.cuh"
#include "backend/cuda/mma.cuh"

// Shared-memory tiles: rows of codes padded by 16 bytes (the 8 rows of one fragment load fall in distinct banks),
// scale/bias rows padded by one word.
namespace tansy::cuda {

__host__ __device__ inline int64_t mma_row_bytes(int64_t rw) { return rw * 4 + 16; }
// x - hi is at most half an fp16 ulp of x: times 2^11 it is about as large as x again, a normal fp16 (exact
// scaling by a power of two)
constexpr float k_lo_scale = 2048.0f;
__host__ __device__ inline int64_t mma_sb_stride(int64_t ng) { return ng + 1; }

// (a & mask) | magic in one instruction (the compiler emits AND and OR apart).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t magic) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));
    return r;
}

// The nibble pairs (q0, q4), (q1, q5), (q2, q6), (q3, q7) of w as exact fp16 pairs: the low nibble of each half
// under the exponent of 1024 gives 1024 + q (minus 1024); the next nibble gives 1024 + 16 q (times 1/16, minus
// 64, one exact HFMA2). 9 instructions per 8 weights (15 with a shift per pair).
__device__ __forceinline__ void q4_pairs(uint32_t w, uint32_t (&p)[4]) {
    const uint32_t magic = 0x64006400u, w8 = w >> 8;
    const __half2 k1024 = __half2half2(__ushort_as_half(0x6400)), k16th = __half2half2(__ushort_as_half(0x2C00)),
                  km64 = __half2half2(__ushort_as_half(0xD400));
    uint32_t h[4] = {and_or(w, 0x000F000Fu, magic), and_or(w, 0x00F000F0u, magic), and_or(w8, 0x000F000Fu, magic),
                     and_or(w8, 0x00F000F0u, magic)};
    __half2 r[4];
    r[0] = __hsub2(*reinterpret_cast<const __half2*>(&h[0]), k1024);
    r[1] = __hfma2(*reinterpret_cast<const __half2*>(&h[1]), k16th, km64);
    r[2] = __hsub2(*reinterpret_cast<const __half2*>(&h[2]), k1024);
    r[3] = __hfma2(*reinterpret_cast<const __half2*>(&h[3]), k16th, km64);
#pragma unroll
    for (int i = 0; i < 4; i++) p[i] = *reinterpret_cast<const uint32_t*>(&r[i]);
}

// The A fragments of one 32-column unit for rows (ra, rb): k-steps (nibbles 0,4 | 1,5) and (2,6 | 3,7).
__device__ __forceinline__ void q4_fragments(uint32_t w0, uint32_t w1, uint32_t (&a02)[4], uint32_t (&a13)[4]) {
    uint32_t p0[4], p1[4];
    q4_pairs(w0, p0), q4_pairs(w1, p1);
    a02[0] = p0[0], a02[1] = p1[0], a02[2] = p0[1], a02[3] = p1[1];
    a13[0] = p0[2], a13[1] = p1[2], a13[2] = p0[3], a13[3] = p1[3];
}

// nr rows of n units each (u-byte units: 16 or 4) from contiguous src into dst rows `stride` bytes apart, with
// the whole block. Each thread walks its (row, unit) pairs incrementally in 32-bit arithmetic: a 64-bit division
// per 16 bytes costs ~100 instructions per copy and would make the copy, not the dot, the bulk of the kernels'
// instructions.
template <int U>
__device__ __forceinline__ void copy_rows_padded(char* dst, int64_t stride, const char* src, int nr, int n) {
    const int bd = blockDim.x, dr = bd / n, dc = bd % n;
    int r = threadIdx.x / n, c = threadIdx.x % n;
    while (r < nr) {
        if constexpr (U == 16)
            cp_async16(dst + r * stride + c * 16, src + ((int64_t)r * n + c) * 16);
        else
            cp_async4_zfill(dst + r * stride + c * 4, src + ((int64_t)r * n + c) * 4, true);
        r += dr, c += dc;
        if (c >= n) c -= n, r++;
    }
}

// nr rows (rw code words, ng scale/bias words each) into the padded shared-memory layout, with the whole block.
__device__ __forceinline__ void copy_rows_mma(char* codes, char* sbs, const uint32_t* w, const uint32_t* sb, int nr,
                                              int64_t rw, int64_t ng) {
    copy_rows_padded<16>(codes, mma_row_bytes(rw), reinterpret_cast<const char*>(w), nr, (int)(rw / 4));
    copy_rows_padded<4>(sbs, mma_sb_stride(ng) * 4, reinterpret_cast<const char*>(sb), nr, (int)ng);
}

// x (K values, optionally RMS-normalised: x * inv * nw, then times scale) into s_hi/s_lo (fp16, permuted per 8;
// lo times k_lo_scale) and s_sum32 (fp32 sums of hi + lo per 32 values, used by groups in order: deterministic). f16: lo = 0 (fast
// mode's inputs are rounded to fp16, as the fast GEMM's). K % 64 == 0, blockDim.x even. Ends with a barrier
// unless told not to.
__device__ __forceinline__ void stage_x_mma(uint16_t* s_hi, uint16_t* s_lo, float* s_sum32, const float* x,
                                            const float* nw, float inv, int64_t K, bool f16, float scale = 1.0f,
                                            bool barrier = true) {
    const int lane = threadIdx.x % 32;
    for (int64_t k0 = 0; k0 < K; k0 += 4 * (int64_t)blockDim.x) {
        const int64_t k = k0 + 4 * threadIdx.x;
        float f[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (k < K) {
            float4 v = *reinterpret_cast<const float4*>(x + k);
            if (nw) {
                const float4 w = *reinterpret_cast<const float4*>(nw + k);
                v.x *= inv * w.x, v.y *= inv * w.y, v.z *= inv * w.z, v.w *= inv * w.w;
            }
            f[0] = v.x * scale, f[1] = v.y * scale, f[2] = v.z * scale, f[3] = v.w * scale;
        }
        uint32_t hi[4], lo[4];
        float sum = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float h = round_f16(f[i]), l = f16 ? 0.0f : round_f16((f[i] - h) * k_lo_scale);
            hi[i] = __half_as_ushort(__float2half_rn(h)), lo[i] = __half_as_ushort(__float2half_rn(l));
            sum += h + l * (1.0f / k_lo_scale);
        }
        uint32_t ph[4], pl[4];  // lane ^ 1 holds the other 4 values of the 8
#pragma unroll
        for (int i = 0; i < 4; i++) ph[i] = __shfl_xor_sync(0xffffffffu, hi[i], 1), pl[i] = __shfl_xor_sync(0xffffffffu, lo[i], 1);
        if (k < K && lane % 2 == 0) {  // this lane x0..x3, the partner x4..x7: (x0,x4) (x1,x5) (x2,x6) (x3,x7)
            *reinterpret_cast<uint4*>(s_hi + k) = make_uint4(hi[0] | ph[0] << 16, hi[1] | ph[1] << 16, hi[2] | ph[2] << 16, hi[3] | ph[3] << 16);
            if (!f16)  // fast mode has no low half (and may not have room for one)
                *reinterpret_cast<uint4*>(s_lo + k) = make_uint4(lo[0] | pl[0] << 16, lo[1] | pl[1] << 16, lo[2] | pl[2] << 16, lo[3] | pl[3] << 16);
        }
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);  // 8 lanes: 32 values
        if (k < K && lane % 8 == 0) s_sum32[k / 32] = sum;
    }
    if (barrier) __syncthreads();
}

// Rows ra (lanes' g) and rb (g + 8) of a padded tile, units [u0, u1) (whole groups of ug units): y0, y1 += their
// dot products with the staged x. Every lane of the warp must call it (mma.sync); lane%4 == 0 holds the results
// (all lanes of a quad hold the same values).
__device__ __forceinline__ void mma_dot_rows(const char* codes, const char* sbs, int64_t rw, int64_t ng, int ra, int rb,
                                             int u0, int u1, int ug, const uint16_t* s_hi, const uint16_t* s_lo,
                                             const float* s_sum32, bool f16, float& y0, float& y1) {
    const int lane = threadIdx.x % 32, c = lane % 4;
    const uint32_t* A0 = reinterpret_cast<const uint32_t*>(codes + ra * mma_row_bytes(rw));
    const uint32_t* A1 = reinterpret_cast<const uint32_t*>(codes + rb * mma_row_bytes(rw));
    const uint32_t* sb0 = reinterpret_cast<const uint32_t*>(sbs) + ra * mma_sb_stride(ng);
    const uint32_t* sb1 = reinterpret_cast<const uint32_t*>(sbs) + rb * mma_sb_stride(ng);
    for (int ub = u0; ub < u1; ub += ug) {  // one group
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc_lo[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sx = 0.0f;
        for (int u = ub; u < ub + ug; u++) {
            const uint32_t w0 = A0[u * 4 + c], w1 = A1[u * 4 + c];
            uint32_t a02[4], a13[4];
            q4_fragments(w0, w1, a02, a13);
            const uint4 xh = *reinterpret_cast<const uint4*>(s_hi + (int64_t)(u * 4 + c) * 8);
            mma_f16(acc, a02, xh.x, xh.y);
            mma_f16(acc, a13, xh.z, xh.w);
            if (!f16) {
                const uint4 xl = *reinterpret_cast<const uint4*>(s_lo + (int64_t)(u * 4 + c) * 8);
                mma_f16(acc_lo, a02, xl.x, xl.y);
                mma_f16(acc_lo, a13, xl.z, xl.w);
            }
            sx += s_sum32[u];
        }
        const int gi = ub / ug;
        const float d0 = f16 ? acc[0] : fmaf(acc_lo[0], 1.0f / k_lo_scale, acc[0]);
        const float d1 = f16 ? acc[2] : fmaf(acc_lo[2], 1.0f / k_lo_scale, acc[2]);
        y0 += sb_scale(sb0[gi]) * d0 + sb_bias(sb0[gi]) * sx;
        y1 += sb_scale(sb1[gi]) * d1 + sb_bias(sb1[gi]) * sx;
    }
}

// Whether a 4-bit matrix suits the tensor-core dot: whole groups of 64-column multiples, 16-byte aligned rows.
inline bool mma_decode_enabled(mma_family f) { return (decode_mma_families() & f) != 0; }

inline bool mma_dot_supports(const dmat& W) {
    return W.fmt == dfmt::q4 && W.group > 0 && W.group % 32 == 0 && W.cols % 64 == 0 && W.cols % W.group == 0 &&
           (uintptr_t)W.w % 16 == 0;
}

// As mma_dot_rows for T (2..8 NG) input rows of fp16 x (fast mode, no low half), token t's x at s_hi + t * xs and
// its sums at s_sum32 + t * ss (strides padded so that the lanes' different tokens fall in different banks). NG
// groups of 8 tokens share each dequantised A fragment: B column n of group i is token 8 i + n (lanes whose
// token is >= T load token 0; those columns are dropped). y[i][2 j + e] += the dot product of row (ra, rb)[i]
// with token 8 j + 2 (lane % 4) + e, for the tokens < T.
template <int NG>
__device__ __forceinline__ void mma_dot_rows_tokens(const char* codes, const char* sbs, int64_t rw, int64_t ng, int ra,
                                                    int rb, int u0, int u1, int ug, const uint16_t* s_hi, int64_t xs,
                                                    const float* s_sum32, int64_t ss, int T, float (&y)[2][2 * NG]) {
    const int lane = threadIdx.x % 32, c = lane % 4, g = lane / 4;
    const uint16_t* xb[NG];
    const float* sxp[NG][2];  // this lane's C columns' sums (clamped: dropped later)
#pragma unroll
    for (int n = 0; n < NG; n++) {
        xb[n] = s_hi + (8 * n + g < T ? 8 * n + g : 0) * xs;
        sxp[n][0] = s_sum32 + min(8 * n + 2 * c, T - 1) * ss, sxp[n][1] = s_sum32 + min(8 * n + 2 * c + 1, T - 1) * ss;
    }
    const uint32_t* A0 = reinterpret_cast<const uint32_t*>(codes + ra * mma_row_bytes(rw));
    const uint32_t* A1 = reinterpret_cast<const uint32_t*>(codes + rb * mma_row_bytes(rw));
    const uint32_t* sb0 = reinterpret_cast<const uint32_t*>(sbs) + ra * mma_sb_stride(ng);
    const uint32_t* sb1 = reinterpret_cast<const uint32_t*>(sbs) + rb * mma_sb_stride(ng);
    for (int ub = u0; ub < u1; ub += ug) {  // one group
        float acc[NG][4], sx[NG][2];
#pragma unroll
        for (int n = 0; n < NG; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = sx[n][0] = sx[n][1] = 0.0f;
        for (int u = ub; u < ub + ug; u++) {
            const uint32_t w0 = A0[u * 4 + c], w1 = A1[u * 4 + c];
            uint32_t a02[4], a13[4];
            q4_fragments(w0, w1, a02, a13);
#pragma unroll
            for (int n = 0; n < NG; n++) {
                const uint4 xh = *reinterpret_cast<const uint4*>(xb[n] + (int64_t)(u * 4 + c) * 8);
                mma_f16(acc[n], a02, xh.x, xh.y);
                mma_f16(acc[n], a13, xh.z, xh.w);
                sx[n][0] += sxp[n][0][u], sx[n][1] += sxp[n][1][u];
            }
        }
        const int gi = ub / ug;
        const float s0 = sb_scale(sb0[gi]), b0 = sb_bias(sb0[gi]), s1 = sb_scale(sb1[gi]), b1 = sb_bias(sb1[gi]);
#pragma unroll
        for (int n = 0; n < NG; n++) {
            y[0][2 * n] += s0 * acc[n][0] + b0 * sx[n][0], y[0][2 * n + 1] += s0 * acc[n][1] + b0 * sx[n][1];
            y[1][2 * n] += s1 * acc[n][2] + b1 * sx[n][0], y[1][2 * n + 1] += s1 * acc[n][3] + b1 * sx[n][1];
        }
    }
}

// One 64-column block's C fragments into the rows' sums, affine: y[n] += scale * acc[n] + bias * sum(x) for the
// lane's weight rows g (scale/bias word sb0) and g + 8 (sb1) and its B columns 8 n + 2 c, +1, whose sums of x over
// the block lie at sums[8 n + 2 c], [+1] (the per-warp kernels' staging: gemv_mma_warp.cu, moe_grouped_mma.cu).
template <int NG>
__device__ __forceinline__ void affine_accumulate(float (&y)[NG][4], const float (&acc)[NG][4], uint32_t sb0,
                                                  uint32_t sb1, const float* sums, int c) {
    const float s0 = sb_scale(sb0), z0 = sb_bias(sb0), s1 = sb_scale(sb1), z1 = sb_bias(sb1);
#pragma unroll
    for (int n = 0; n < NG; n++) {
        const float2 sx = *reinterpret_cast<const float2*>(sums + 8 * n + 2 * c);
        y[n][0] += s0 * acc[n][0] + z0 * sx.x, y[n][1] += s0 * acc[n][1] + z0 * sx.y;
        y[n][2] += s1 * acc[n][2] + z1 * sx.x, y[n][3] += s1 * acc[n][3] + z1 * sx.y;
    }
}

// Steps [0, n_steps) through two register sets: step s is multiplied (compute(s, set)) while step s + 1 loads into
// the other set (load(s + 2, set) after compute(s, set)). Steps 0 and 1 are loaded before.
template <class Regs, class Load, class Compute>
__device__ __forceinline__ void two_step_pipeline(int n_steps, Regs& A, Regs& B, Load&& load, Compute&& compute) {
    for (int st = 0; st < n_steps; st += 2) {
        compute(st, A);
        if (st + 2 < n_steps) load(st + 2, A);
        if (st + 1 >= n_steps) break;
        compute(st + 1, B);
        if (st + 3 < n_steps) load(st + 3, B);
    }
}

// The most k-chunks (whole groups each) per 16-row block that `warps` warps can split a row into.
inline int mma_k_chunks(int64_t cols, int group, int warps) {
    const int groups = (int)(cols / group);
    int nkc = std::max(1, std::min(groups, warps));
    while (groups % nkc) nkc--;
    return nkc;
}

}  // namespace tansy::cuda
