// Tensor-core GEMM with weights dequantised in the kernel (see gemm.cuh).
// v1: CTA tile 64 rows x 128 W rows x 64 k, 8 warps of 32 x 32 (mma.sync m16n8k16 bf16 -> fp32, operands via
//     ldmatrix from padded shared memory), two shared-memory stages fed through registers: the global loads of
//     k-tile i+1 are in flight while the tensor cores work on tile i, then the thread converts (A: fp32 ->
//     bf16) or dequantises (W: q * scale + bias in fp32, rounded once to bf16) into the other stage; one
//     barrier per k-tile. Every thread owns 32 consecutive values of one W row per k-tile (one 16-byte load
//     for 4-bit weights) and 4 float4 of A. k-tile = 64 = the checkpoint's group size, so a row needs one
//     (scale, bias) word per k-tile. swiglu interleaves gate and up rows (tile column 2f = gate f, 2f + 1 =
//     up f) so that each thread's accumulator pair is (gate, up) of one feature.
// v1b: `precise` splits both operands into bf16 hi + lo parts (three products), for the router (whose top-8
//     must not differ from the decode path's) and for users who want fp32-faithful prompt processing.
//     H200, synthetic 35B, 2K prompt: 19.8k tok/s with bf16 operands, 11.1k precise.
// v1c: the fast mode takes fp16 operands instead of bf16 (same speed, 2^-11 instead of 2^-9 relative rounding:
//     bf16 fell short of the CPU-agreement bounds on random-weight models, top-1 ~95%); activations are scaled
//     by a power of two per call site (the MoE down projection's SwiGLU inputs by 2^-4) and clamped, so a
//     large activation saturates rather than overflowing.
#include <algorithm>

#include "backend/cuda/gemm.cuh"
#include "backend/cuda/mma.cuh"

namespace tansy::cuda {

namespace {

constexpr int BM = k_gemm_bm, BN = k_gemm_bn, BK = 64;
constexpr int LDS = BK + 8;  // bf16 per shared row: the 16-byte pad puts 8 ldmatrix rows in distinct banks
constexpr int k_threads = 256;
// bf16 elements per shared-memory stage: A then W (and with SPLIT, their low parts after them)
template <bool SPLIT>
constexpr int stage_elems() {
    return (BM + BN) * LDS * (SPLIT ? 2 : 1);
}
template <bool SPLIT>
constexpr size_t smem_bytes() {
    return 2 * stage_elems<SPLIT>() * sizeof(uint16_t);
}

static_assert(BM * BK / 4 == 4 * k_threads, "A: four float4 per thread");
static_assert(BN * BK / 32 == k_threads, "W: 32 values per thread");

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

// (a, b) as bf16x2 hi plus the bf16x2 of what rounding left out: hi + lo carries ~16 bits of each mantissa.
__device__ __forceinline__ void split_bf16(float a, float b, uint32_t& hi, uint32_t& lo) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    const float2 hf = __bfloat1622float2(h);
    hi = *reinterpret_cast<uint32_t*>(&h);
    lo = pack_bf16(a - hf.x, b - hf.y);
}

// Fast mode: fp16 operands (A times p.a_scale, clamped to the fp16 range), one product.
// SPLIT: both operands as bf16 hi + lo and three products (hi hi, lo hi, hi lo; bf16 weights are exact and
// need only the first two): ~fp32 accuracy for 2-3x the tensor work and twice the shared memory.
template <dfmt F, gemm_epilogue EPI, bool SPLIT>
__global__ void __launch_bounds__(k_threads, SPLIT ? 1 : 2) gemm_kernel(const gemm_params p) {
    extern __shared__ __align__(16) uint16_t smem[];
    constexpr int NW = w_words<F>();
    constexpr bool AFFINE = F != dfmt::bf16;
    constexpr int STAGE = stage_elems<SPLIT>(), LO = (BM + BN) * LDS;  // LO: offset of the low parts
    int expert = 0, row0, rows;
    if (p.tiles) {
        if ((int)blockIdx.y >= *p.n_tiles) return;
        const gemm_tile t = p.tiles[blockIdx.y];
        expert = t.expert, row0 = t.row0, rows = t.rows;
    } else {
        row0 = (int)blockIdx.y * BM;
        rows = min(BM, p.M - row0);
    }
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int64_t K = p.W.cols;
    const int nk = (int)(K / BK);

    // A: this thread's rows tid/16 + 16 i, columns (tid % 16) * 4 of each k-tile
    const float* aptr[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = tid / 16 + 16 * i;
        aptr[i] = nullptr;
        if (r < rows) {
            int64_t src = row0 + r;
            if (p.gather) src = p.gather[src] / p.gather_div;
            aptr[i] = p.x + src * p.ldx + (tid % 16) * 4;
        }
    }
    // W: tile column c = tid / 2, values [32 * (tid % 2), +32) of each k-tile
    const int c = tid / 2, half = tid % 2;
    int64_t n = EPI == gemm_epilogue::swiglu ? (int64_t)blockIdx.x * (BN / 2) + c / 2 : (int64_t)blockIdx.x * BN + c;
    const bool wvalid = n < p.N;
    const int64_t wrow = (int64_t)expert * p.N + (wvalid ? n : 0);
    const bool use_w2 = EPI == gemm_epilogue::swiglu && (c & 1);
    const uint32_t* wp = (use_w2 ? p.W2.w : p.W.w) + wrow * p.W.row_words();
    const uint32_t* sbp = AFFINE ? (use_w2 ? p.W2.sb : p.W.sb) + wrow * p.W.n_groups() : nullptr;
    const int bits = F == dfmt::q4 ? 4 : F == dfmt::q8 ? 8 : 16;

    float4 ra[4];
    uint4 rw[NW];
    uint32_t rsb = 0;
    auto load = [&](int kt) {
#pragma unroll
        for (int i = 0; i < 4; i++)
            ra[i] = aptr[i] ? *reinterpret_cast<const float4*>(aptr[i] + kt * BK) : make_float4(0, 0, 0, 0);
        const int64_t v0 = (int64_t)kt * BK + half * 32;
        if (wvalid) {
            const uint4* src = reinterpret_cast<const uint4*>(wp + v0 * bits / 32);
#pragma unroll
            for (int j = 0; j < NW; j++) rw[j] = src[j];
            if constexpr (AFFINE) rsb = sbp[v0 / p.W.group];
        } else {
#pragma unroll
            for (int j = 0; j < NW; j++) rw[j] = make_uint4(0, 0, 0, 0);
            rsb = 0;
        }
    };
    auto store = [&](int s) {
        uint16_t* sa = smem + s * STAGE;
        uint16_t* sw = sa + BM * LDS;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = tid / 16 + 16 * i;
            uint2 hi, lo;
            if constexpr (SPLIT) {
                split_bf16(ra[i].x, ra[i].y, hi.x, lo.x);
                split_bf16(ra[i].z, ra[i].w, hi.y, lo.y);
                *reinterpret_cast<uint2*>(sa + LO + r * LDS + (tid % 16) * 4) = lo;
            } else {
                const float sc = p.a_scale;
                hi = make_uint2(pack_f16(sc * ra[i].x, sc * ra[i].y), pack_f16(sc * ra[i].z, sc * ra[i].w));
            }
            *reinterpret_cast<uint2*>(sa + r * LDS + (tid % 16) * 4) = hi;
        }
        float v[32];
        dequant32<F>(v, rw, rsb);
        uint32_t hi[16], lo[16];
#pragma unroll
        for (int j = 0; j < 16; j++) {
            if constexpr (SPLIT && AFFINE)
                split_bf16(v[2 * j], v[2 * j + 1], hi[j], lo[j]);
            else if constexpr (SPLIT)
                hi[j] = pack_bf16(v[2 * j], v[2 * j + 1]);  // bf16 weights: exact
            else
                hi[j] = pack_f16(v[2 * j], v[2 * j + 1]);
        }
        uint4* dst = reinterpret_cast<uint4*>(sw + c * LDS + half * 32);
#pragma unroll
        for (int j = 0; j < 4; j++) dst[j] = make_uint4(hi[4 * j], hi[4 * j + 1], hi[4 * j + 2], hi[4 * j + 3]);
        if constexpr (SPLIT && AFFINE) {
            uint4* dlo = reinterpret_cast<uint4*>(sw + LO + c * LDS + half * 32);
#pragma unroll
            for (int j = 0; j < 4; j++) dlo[j] = make_uint4(lo[4 * j], lo[4 * j + 1], lo[4 * j + 2], lo[4 * j + 3]);
        }
    };

    // warp tile: rows wm*32 .. +32, tile columns wn*32 .. +32
    const int wm = warp % 2, wn = warp / 2;
    float acc[2][4][4] = {};
    load(0);
    store(0);
    __syncthreads();
    for (int kt = 0; kt < nk; kt++) {
        if (kt + 1 < nk) load(kt + 1);
        const uint16_t* sa = smem + (kt & 1) * STAGE;
        const uint16_t* sw = sa + BM * LDS;
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            uint32_t a[2][4], b[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
                ldmatrix_x4(a[mi], sa + (wm * 32 + mi * 16 + lane % 8 + 8 * ((lane / 8) % 2)) * LDS + kk * 16 + 8 * (lane / 16));
#pragma unroll
            for (int nj = 0; nj < 2; nj++)
                ldmatrix_x4(b[nj], sw + (wn * 32 + nj * 16 + lane % 8 + 8 * (lane / 16)) * LDS + kk * 16 + 8 * ((lane / 8) % 2));
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int ni = 0; ni < 4; ni++) {
                    if constexpr (SPLIT)
                        mma_bf16(acc[mi][ni], a[mi], b[ni / 2][2 * (ni % 2)], b[ni / 2][2 * (ni % 2) + 1]);
                    else
                        mma_f16(acc[mi][ni], a[mi], b[ni / 2][2 * (ni % 2)], b[ni / 2][2 * (ni % 2) + 1]);
                }
            if constexpr (SPLIT) {
                uint32_t x[2][4];  // A lo x W hi
#pragma unroll
                for (int mi = 0; mi < 2; mi++)
                    ldmatrix_x4(x[mi], sa + LO + (wm * 32 + mi * 16 + lane % 8 + 8 * ((lane / 8) % 2)) * LDS + kk * 16 + 8 * (lane / 16));
#pragma unroll
                for (int mi = 0; mi < 2; mi++)
#pragma unroll
                    for (int ni = 0; ni < 4; ni++) mma_bf16(acc[mi][ni], x[mi], b[ni / 2][2 * (ni % 2)], b[ni / 2][2 * (ni % 2) + 1]);
                if constexpr (AFFINE) {  // A hi x W lo
#pragma unroll
                    for (int nj = 0; nj < 2; nj++)
                        ldmatrix_x4(b[nj], sw + LO + (wn * 32 + nj * 16 + lane % 8 + 8 * (lane / 16)) * LDS + kk * 16 + 8 * ((lane / 8) % 2));
#pragma unroll
                    for (int mi = 0; mi < 2; mi++)
#pragma unroll
                        for (int ni = 0; ni < 4; ni++) mma_bf16(acc[mi][ni], a[mi], b[ni / 2][2 * (ni % 2)], b[ni / 2][2 * (ni % 2) + 1]);
                }
            }
        }
        if (kt + 1 < nk) store((kt + 1) & 1);
        __syncthreads();
    }

    const float inv_scale = SPLIT ? 1.0f : 1.0f / p.a_scale;  // a power of two: exact
    // epilogue: accumulator (mi, ni) element 2h + e is row wm*32 + mi*16 + lane/4 + 8h, column wn*32 + ni*8 +
    // 2*(lane%4) + e
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int m = wm * 32 + mi * 16 + lane / 4 + 8 * h;
            if (m >= rows) continue;
            const int64_t r = row0 + m;
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                const int cl = wn * 32 + ni * 8 + 2 * (lane % 4);
                const float v0 = acc[mi][ni][2 * h] * inv_scale, v1 = acc[mi][ni][2 * h + 1] * inv_scale;
                if constexpr (EPI == gemm_epilogue::swiglu) {
                    const int64_t f = (int64_t)blockIdx.x * (BN / 2) + cl / 2;
                    if (f < p.N) p.out[r * p.ldo + f] = siluf_(v0) * v1;
                } else {
                    const int64_t n0 = (int64_t)blockIdx.x * BN + cl;
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int64_t col = n0 + e;
                        if (col >= p.N) continue;
                        const float v = e ? v1 : v0;
                        if constexpr (EPI == gemm_epilogue::rows) {
                            p.out[r * p.ldo + col] = v;
                        } else {
                            int s = 0;
                            while (s + 1 < p.n_seg && col >= p.seg[s + 1].row0) s++;
                            float* o = p.seg[s].out + r * p.seg[s].ld + (col - p.seg[s].row0);
                            *o = p.accumulate ? *o + v : v;
                        }
                    }
                }
            }
        }
}

template <dfmt F, gemm_epilogue EPI, bool SPLIT>
void launch(const gemm_params& p, cudaStream_t stream) {
    // per instantiation, once (thread-safe static init): allow more than 48 KB of dynamic shared memory
    static const bool configured = [] {
        CUDA_CHECK(cudaFuncSetAttribute(gemm_kernel<F, EPI, SPLIT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem_bytes<SPLIT>()));
        return true;
    }();
    (void)configured;
    const int64_t cols = EPI == gemm_epilogue::swiglu ? BN / 2 : BN;
    const dim3 grid((unsigned)((p.N + cols - 1) / cols), (unsigned)(p.tiles ? p.max_tiles : (p.M + BM - 1) / BM));
    gemm_kernel<F, EPI, SPLIT><<<grid, k_threads, smem_bytes<SPLIT>(), stream>>>(p);
    CUDA_CHECK_LAUNCH();
}

template <dfmt F, gemm_epilogue EPI>
void launch_split(const gemm_params& p, cudaStream_t stream) {
    if (p.precise)
        launch<F, EPI, true>(p, stream);
    else
        launch<F, EPI, false>(p, stream);
}

template <dfmt F>
void launch_epi(const gemm_params& p, cudaStream_t stream) {
    switch (p.epi) {
        case gemm_epilogue::store: return launch_split<F, gemm_epilogue::store>(p, stream);
        case gemm_epilogue::rows: return launch_split<F, gemm_epilogue::rows>(p, stream);
        case gemm_epilogue::swiglu: return launch_split<F, gemm_epilogue::swiglu>(p, stream);
    }
}

}  // namespace

bool gemm_supports(const dmat& W) {
    if (W.cols % BK != 0 || W.cols == 0) return false;
    return W.fmt == dfmt::bf16 || (W.group > 0 && W.group % 32 == 0);
}

void gemm(const gemm_params& p, cudaStream_t stream) {
    TANSY_CHECK(gemm_supports(p.W), "gemm: unsupported matrix (%lld columns, group %d)", (long long)p.W.cols, p.W.group);
    TANSY_CHECK(p.ldx % 4 == 0 && ((uintptr_t)p.x % 16) == 0, "gemm: A rows must be 16-byte aligned");
    TANSY_CHECK(p.epi != gemm_epilogue::swiglu || (p.W2.fmt == p.W.fmt && p.W2.cols == p.W.cols && p.W2.group == p.W.group),
                "gemm: swiglu needs gate and up in the same format");
    TANSY_CHECK(p.epi == gemm_epilogue::store ? p.n_seg >= 1 : p.out != nullptr, "gemm: no output");
    TANSY_CHECK(p.tiles == nullptr || p.epi != gemm_epilogue::store, "gemm: grouped tiles need a rows/swiglu output");
    if (p.tiles ? p.max_tiles == 0 : p.M == 0) return;
    switch (p.W.fmt) {
        case dfmt::q4: return launch_epi<dfmt::q4>(p, stream);
        case dfmt::q8: return launch_epi<dfmt::q8>(p, stream);
        case dfmt::bf16: return launch_epi<dfmt::bf16>(p, stream);
    }
}

}  // namespace tansy::cuda
