// Decode inputs as two-level int8 for 4-bit weights (device code; fast mode, one input row on CUDA cores).
// Why: with x in fp32 a 4-bit weight costs a byte_perm and an FFMA (chunk_dot<q4>, ~2.4 instructions per weight
// with the unpacking), and the decode kernels are bound by instruction issue and latency, not bytes
// (docs/PERF.md). With x as int8 a word of 8 codes takes two LOP3 and four dp4a (hi and lo parts of the even and
// odd values): ~0.9 instructions per weight.
//
// Numerics: each 32-value chunk (one 16-byte chunk of 4-bit codes) is x_i ~= step * (h_i + l_i / 254) with
// step = max|x| / 127 and h_i, l_i in [-127, 127]: the error is at most max|x| / 64516 per value, below the
// fp16 rounding the fast mode already applies to every value within a factor 30 of its chunk's largest.
// The chunk's sum (for the affine bias) is taken from the unquantised values.
#pragma once
#include "backend/cuda/common.cuh"

#if defined(__CUDACC__)
namespace tansy::cuda {

// Staging layout in shared memory, n chunks (xq_stage_bytes): 4 planes of n uint4 -- the h parts of the even
// values (plane 0) and odd values (1), the l parts of the even (2) and odd (3) values; chunk c's words k = 0..3
// (values 8k..8k+7) at plane + c -- then n floats of step / (254 * 16), then n chunk sums. Lane-consecutive
// chunks read consecutive 16 bytes: no bank conflicts.
__host__ __device__ inline int64_t xq_stage_bytes(int64_t n_chunks) { return n_chunks * (64 + 8); }

// One staged chunk in registers.
struct xq_chunk {
    uint4 he, ho, le, lo;  // int8 x4: h of values 8k, 8k+2, 8k+4, 8k+6 (he.k), of 8k+1, ... (ho.k); l likewise
    float s;               // step / (254 * 16): the dot's integer sum times s is sum_i q_i x_i
    float sum;             // sum_i x_i
};

// 1.5 * 2^23: v + k_xq_magic rounds v (|v| < 2^22) to an integer held in the low mantissa bits, two's complement.
constexpr float k_xq_magic = 12582912.0f;

__device__ __forceinline__ uint32_t xq_pack4(float a, float b, float c, float d) {  // low bytes of a..d
    const uint32_t ab = __byte_perm(__float_as_uint(a), __float_as_uint(b), 0x0040);
    const uint32_t cd = __byte_perm(__float_as_uint(c), __float_as_uint(d), 0x0040);
    return __byte_perm(ab, cd, 0x5410);
}

// Block-wide: stages the K values x_i * nw_i (x_i when nw is null; K % 32 == 0, x and nw 16-byte aligned) as
// above, each thread taking 8 consecutive values (one word of codes). With nw, each warp's part of sum_i x_i^2
// lands in red[warp] (the RMS norm's; inv_rms_of_parts turns it into 1/rms after the barrier): the norm's scale is
// left out of the staged values, so the norm and the staging are one pass over x. Ends without a barrier.
__device__ __forceinline__ void stage_xq(char* st, float* red, const float* x, const float* nw, int64_t K) {
    const int64_t words = K / 8, nc = K / 32;
    uint32_t* planes = reinterpret_cast<uint32_t*>(st);
    float* steps = reinterpret_cast<float*>(st + 64 * nc);
    float* sums = steps + nc;
    float ss = 0.0f;
    // a block-uniform loop: the 4 lanes of a chunk (lanes 4j..4j+3) shuffle together
    for (int64_t base = 0; base < words; base += blockDim.x) {
        const int64_t wi = base + threadIdx.x;
        const bool on = wi < words;
        float v[8];
        if (on) {
            const float4 a = *reinterpret_cast<const float4*>(x + 8 * wi);
            const float4 b = *reinterpret_cast<const float4*>(x + 8 * wi + 4);
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
            if (nw) {
                const float4 c = *reinterpret_cast<const float4*>(nw + 8 * wi);
                const float4 d = *reinterpret_cast<const float4*>(nw + 8 * wi + 4);
#pragma unroll
                for (int i = 0; i < 8; i++) ss += v[i] * v[i];
                v[0] *= c.x, v[1] *= c.y, v[2] *= c.z, v[3] *= c.w, v[4] *= d.x, v[5] *= d.y, v[6] *= d.z, v[7] *= d.w;
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = 0.0f;
        }
        float m = 0.0f, sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) m = fmaxf(m, fabsf(v[i])), sum += v[i];
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
        }
        const float q = m > 0.0f ? 127.0f / m : 0.0f;
        float h[8], l[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            h[i] = fmaf(v[i], q, k_xq_magic);                // round(v q), |.| <= 127
            const float r = fmaf(v[i], q, k_xq_magic - h[i]);  // v q - round(v q), in [-1/2, 1/2]
            l[i] = fmaf(r, 254.0f, k_xq_magic);               // round(254 r), |.| <= 127
        }
        if (on) {
            planes[0 * 4 * nc + wi] = xq_pack4(h[0], h[2], h[4], h[6]);
            planes[1 * 4 * nc + wi] = xq_pack4(h[1], h[3], h[5], h[7]);
            planes[2 * 4 * nc + wi] = xq_pack4(l[0], l[2], l[4], l[6]);
            planes[3 * 4 * nc + wi] = xq_pack4(l[1], l[3], l[5], l[7]);
            if (wi % 4 == 0) {
                // 0 * sum: a NaN or infinity in the chunk (lost by fmaxf) makes the step NaN, so it reaches the output
                steps[wi / 4] = m * (1.0f / (127.0f * 254.0f * 16.0f)) + 0.0f * sum;
                sums[wi / 4] = sum;
            }
        }
    }
    if (nw) put_warp_part(red, ss);
}

// The staged steps and sums of n chunks.
__device__ __forceinline__ const float* xq_steps(const char* st, int64_t nc) {
    return reinterpret_cast<const float*>(st + 64 * nc);
}
__device__ __forceinline__ const float* xq_sums(const char* st, int64_t nc) { return xq_steps(st, nc) + nc; }

// The int8 parts of chunk c of n staged chunks (r.s and r.sum untouched).
__device__ __forceinline__ void load_xq_codes(xq_chunk& r, const char* st, int64_t nc, int64_t c) {
    const uint4* p = reinterpret_cast<const uint4*>(st);
    r.he = p[c], r.ho = p[nc + c], r.le = p[2 * nc + c], r.lo = p[3 * nc + c];
}

// Chunk c of n staged chunks, its step and sum times `scale` (the RMS norm's 1/rms, or 1).
__device__ __forceinline__ xq_chunk load_xq(const char* st, int64_t nc, int64_t c, float scale) {
    xq_chunk r;
    load_xq_codes(r, st, nc, c);
    r.s = xq_steps(st, nc)[c] * scale, r.sum = xq_sums(st, nc)[c] * scale;
    return r;
}

// Block-wide (every thread calls it; one barrier inside): stage_xq of the K values x (RMS-normalised with nw when
// set), then each lane's chunks lane + 32 c (c < CPL) into registers, steps and sums scaled by 1/rms; gi[c]: the
// chunk's scale/bias word in a weight row of quantisation group `group`. Returns the scale (1/rms, or 1).
// Callers rely on the barrier: shared-memory writes made before the call are visible to every thread after it
// (gate/up's top-k, published by its selecting warp).
template <int CPL>
__device__ __forceinline__ float stage_lane_xq(xq_chunk (&xc)[CPL], int (&gi)[CPL], char* st, const float* x,
                                              const float* nw, float eps, int64_t K, int group) {
    __shared__ float red[32];
    stage_xq(st, red, x, nw, K);
    __syncthreads();
    const float scale = nw ? inv_rms_of_parts(red, K, eps) : 1.0f;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int c = 0; c < CPL; c++) xc[c] = load_xq(st, K / 32, lane + 32 * c, scale), gi[c] = ((lane + 32 * c) * 32) / group;
    return scale;
}

// d = sum of 4 (unsigned byte of a) x (signed byte of b), plus c.
__device__ __forceinline__ int dp4a_us(uint32_t a, uint32_t b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// sum_i q_i x_i over one 16-byte chunk of 4-bit codes (word k holds values 8k..8k+7 at nibbles 0..7, LSB first:
// even values in the low nibbles), as chunk_dot<dfmt::q4> computes it from fp32 x. The odd values' codes stay in
// the high nibbles (16 q): the integer sums are (16 h.q_even + h.16q_odd) * 254 + (16 l.q_even + l.16q_odd), at
// most 248M in magnitude.
__device__ __forceinline__ float chunk_dot_xq(const uint4& c, const xq_chunk& x) {
    const uint32_t w[4] = {c.x, c.y, c.z, c.w};
    const uint32_t he[4] = {x.he.x, x.he.y, x.he.z, x.he.w}, ho[4] = {x.ho.x, x.ho.y, x.ho.z, x.ho.w};
    const uint32_t le[4] = {x.le.x, x.le.y, x.le.z, x.le.w}, lo[4] = {x.lo.x, x.lo.y, x.lo.z, x.lo.w};
    int ae = 0, ao = 0, be = 0, bo = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const uint32_t e = w[k] & 0x0F0F0F0Fu, o = w[k] & 0xF0F0F0F0u;
        ae = dp4a_us(e, he[k], ae);
        ao = dp4a_us(o, ho[k], ao);
        be = dp4a_us(e, le[k], be);
        bo = dp4a_us(o, lo[k], bo);
    }
    return x.s * (float)((16 * ae + ao) * 254 + (16 * be + bo));
}

}  // namespace tansy::cuda
#endif
