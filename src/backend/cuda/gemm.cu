// Tensor-core GEMM with weights dequantised in the kernel (see gemm.cuh): prompt processing's projections and
// grouped experts. mma.sync m16n8k16 -> fp32; k-tile = 64 = the checkpoint's group size (one scale/bias per row
// and k-tile); swiglu interleaves gate and up rows so a thread's accumulator pair is (gate, up) of one feature.
//   gemm_fast_kernel     fp16 operands (A converted once by to_f16_kernel, or written as fp16 by the SwiGLU
//                        epilogue), A and raw W words by cp.async through a 3-4 stage ring, W dequantised
//                        smem -> smem one k-tile ahead of the tensor cores; 64-row tiles (experts) or 128-row
//                        tiles (dense: halves the shared-memory reads per FLOP). On sm_90 the 4-bit calls take
//                        sm90/gemm_wgmma.cu (wgmma, weights dequantised in registers) instead.
//   gemm_precise_kernel  both operands as bf16 hi + lo, three products (~fp32): the router (its top-8 must match
//                        decode's) and `--gemm precise`.
// fp16, not bf16, in fast mode: 2^-11 relative rounding (bf16 missed the CPU-agreement bounds); activations are
// scaled by a power of two per call site and saturate rather than overflow. Why fast: the kernel is bound by its
// shared-memory load path, so the ring keeps it fed and each A tile is converted once, not per CTA.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "backend/cuda/gemm.cuh"
#include "backend/cuda/gemm_tile.cuh"
#include "backend/cuda/kernel_plan.h"
#if TANSY_HAVE_WGMMA
#include "backend/cuda/gemm_wgmma.cuh"
#endif
#include "backend/cuda/mma.cuh"
#include "backend/cuda/moe.cuh"

namespace tansy::cuda {

namespace {

using namespace gemm_dev;
constexpr int LDS = BK + 8;  // bf16 per shared row: the 16-byte pad puts 8 ldmatrix rows in distinct banks
// precise kernel: bf16 elements per shared-memory stage, A then W, hi then lo parts; two stages
constexpr int PRECISE_STAGE = 2 * (BM + BN) * LDS;
constexpr size_t PRECISE_SMEM = 2 * PRECISE_STAGE * sizeof(uint16_t);

static_assert(BM * BK / 4 == 4 * k_threads, "A: four float4 per thread");
static_assert(BN * BK / 32 == k_threads, "W: 32 values per thread");

// (a, b) as bf16x2 hi plus the bf16x2 of what rounding left out: hi + lo carries ~16 bits of each mantissa.
__device__ __forceinline__ void split_bf16(float a, float b, uint32_t& hi, uint32_t& lo) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    const float2 hf = __bfloat1622float2(h);
    hi = *reinterpret_cast<uint32_t*>(&h);
    lo = pack_bf16(a - hf.x, b - hf.y);
}

// One k-step (16) of the warp's (16 MI) x 32 tile: A rows from sa, W columns from sw (both [rows][LDS]).
template <bool F16, int MI>
__device__ __forceinline__ void mma_kstep(float (&acc)[MI][4][4], const uint16_t* sa, const uint16_t* sw, int wm, int wn,
                                          int lane, int kk) {
    uint32_t a[MI][4], b[2][4];
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
        ldmatrix_x4(a[mi], sa + (wm * 16 * MI + mi * 16 + lane % 8 + 8 * ((lane / 8) % 2)) * LDS + kk * 16 + 8 * (lane / 16));
#pragma unroll
    for (int nj = 0; nj < 2; nj++)
        ldmatrix_x4(b[nj], sw + (wn * 32 + nj * 16 + lane % 8 + 8 * (lane / 16)) * LDS + kk * 16 + 8 * ((lane / 8) % 2));
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++) mma_16816<F16>(acc[mi][ni], a[mi], b[ni / 2][2 * (ni % 2)], b[ni / 2][2 * (ni % 2) + 1]);
}

// ------------------------------------------------------------------------------------------------ fast

// BMT rows per CTA: 64 (grouped experts, small M) or 128 (dense, many rows: each warp then holds 64 x 32
// accumulators, which halves the shared-memory reads and the W dequantisation per FLOP; ncu at 64 rows: L1/smem
// 77% busy, the limiter). Ring of STAGES k-tiles (STAGES - 1 in flight while the tensor cores work).
template <dfmt F, int BMT>
struct fast_layout {
    static constexpr int STAGES = BMT == 64 ? 4 : 3;
    static constexpr int RAW_BYTES = BK * (F == dfmt::q4 ? 4 : F == dfmt::q8 ? 8 : 16) / 8;  // W bytes per row and k-tile
    static constexpr bool AFFINE = F != dfmt::bf16;
    // one ring stage: A [BM][LDS] fp16 | W words [BN][RAW_BYTES] | (scale, bias) [BN][2] (both halves' groups)
    static constexpr size_t A_BYTES = (size_t)BMT * LDS * 2, W_BYTES = (size_t)BN * RAW_BYTES,
                            SB_BYTES = AFFINE ? (size_t)BN * 2 * 4 : 0;
    static constexpr size_t STAGE = A_BYTES + W_BYTES + SB_BYTES;
    static constexpr size_t DEQ = (size_t)BN * LDS * 2;  // one dequantised W tile, fp16
    static constexpr size_t SMEM = STAGES * STAGE + 2 * DEQ;
    static_assert(A_BYTES % 16 == 0 && W_BYTES % 16 == 0 && STAGE % 16 == 0, "16-byte aligned regions");
};

template <dfmt F, gemm_epilogue EPI, int BMT>
__global__ void __launch_bounds__(k_threads, 2) gemm_fast_kernel(const gemm_params p) {
    using L = fast_layout<F, BMT>;
    constexpr int FAST_STAGES = L::STAGES, MI = BMT / 32;  // MI: 16-row m-tiles per warp
    constexpr int CPR = L::RAW_BYTES / 16;                // 16-byte chunks of W words per row and k-tile
    constexpr int W_CHUNKS = BN * CPR / k_threads;       // per thread: 1 (q4), 2 (q8), 4 (bf16)
    constexpr int A_CHUNKS = BMT * (BK / 8) / k_threads;  // per thread: 2 or 4
    static_assert(BN * CPR % k_threads == 0 && BMT * (BK / 8) % k_threads == 0, "whole chunks per thread");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint16_t* deq = reinterpret_cast<uint16_t*>(smem_raw + FAST_STAGES * L::STAGE);  // [2][BN][LDS]
    int expert, row0, rows;
    if (!tile_rows<BMT>(p, expert, row0, rows)) return;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int nk = (int)(p.W.cols / BK);

    // copy roles. A: rows tid/8 + 32 i, 16-byte chunk tid % 8 of each k-tile's 64 fp16
    const uint16_t* asrc[A_CHUNKS];
    a_sources(p, row0, rows, tid, asrc);
    // W words: chunk id = tid + 256 i -> tile column id / CPR, chunk id % CPR of the row's k-tile bytes
    const unsigned char* wsrc[W_CHUNKS];
    bool wok[W_CHUNKS];
#pragma unroll
    for (int i = 0; i < W_CHUNKS; i++) {
        const int id = tid + k_threads * i, c = id / CPR;
        int64_t wrow;
        const dmat& W = w_of_column<EPI>(p, c, expert, wrow, wok[i]);
        wsrc[i] = reinterpret_cast<const unsigned char*>(W.w + wrow * W.row_words()) + (id % CPR) * 16;
    }
    // scale/bias words: thread tid copies the word of tile column tid / 2 for values [32 (tid % 2), +32)
    const uint32_t* sbsrc = nullptr;
    bool sbok = false;
    if constexpr (L::AFFINE) {
        int64_t wrow;
        const dmat& W = w_of_column<EPI>(p, tid / 2, expert, wrow, sbok);
        sbsrc = W.sb + wrow * W.n_groups();
    }
    const int group = p.W.group;

    auto issue = [&](int kt) {  // k-tile kt into ring stage kt % FAST_STAGES (one commit group)
        unsigned char* st = smem_raw + (kt % FAST_STAGES) * L::STAGE;
        uint16_t* sa = reinterpret_cast<uint16_t*>(st);
#pragma unroll
        for (int i = 0; i < A_CHUNKS; i++)
            cp_async16_zfill(sa + (tid / 8 + 32 * i) * LDS + (tid % 8) * 8, asrc[i] ? asrc[i] + kt * BK : p.x16, asrc[i] != nullptr);
        unsigned char* sw = st + L::A_BYTES;
#pragma unroll
        for (int i = 0; i < W_CHUNKS; i++)
            cp_async16_zfill(sw + (size_t)(tid + k_threads * i) * 16, wok[i] ? wsrc[i] + (size_t)kt * L::RAW_BYTES : wsrc[0], wok[i]);
        if constexpr (L::AFFINE) {
            uint32_t* ssb = reinterpret_cast<uint32_t*>(st + L::A_BYTES + L::W_BYTES);
            cp_async4_zfill(ssb + tid, sbok ? sbsrc + (kt * BK + (tid % 2) * 32) / group : p.W.sb, sbok);
        }
    };
    // k-tile kt's W: the words this thread's (tile column, half) owns, dequantised into deq[kt & 1]
    const int c = tid / 2, half = tid % 2;
    auto dequant = [&](int kt) {
        const unsigned char* st = smem_raw + (kt % FAST_STAGES) * L::STAGE;
        constexpr int NW = w_words<F>();
        uint4 rw[NW];
        const uint4* src = reinterpret_cast<const uint4*>(st + L::A_BYTES + (size_t)c * L::RAW_BYTES + half * (L::RAW_BYTES / 2));
#pragma unroll
        for (int j = 0; j < NW; j++) rw[j] = src[j];
        uint32_t sb = 0;
        if constexpr (L::AFFINE) sb = reinterpret_cast<const uint32_t*>(st + L::A_BYTES + L::W_BYTES)[tid];
        float v[32];
        dequant32<F>(v, rw, sb);
        uint4* dst = reinterpret_cast<uint4*>(deq + (kt & 1) * BN * LDS + c * LDS + half * 32);
#pragma unroll
        for (int j = 0; j < 4; j++) dst[j] = pack_f16x8(v + 8 * j);
    };

    ring_start<FAST_STAGES>(nk, issue, dequant);

    const int wm = warp % 2, wn = warp / 2;  // warp tile: rows wm*16*MI .. +16*MI, tile columns wn*32 .. +32
    float acc[MI][4][4] = {};
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait<FAST_STAGES - 3>();  // k-tiles <= kt + 1 have landed (this thread's copies)
        __syncthreads();  // everyone's copies and deq[kt & 1] are visible; k-tile kt-1's stage and deq are free
        if (kt + FAST_STAGES - 1 < nk) issue(kt + FAST_STAGES - 1);
        cp_async_commit();
        if (kt + 1 < nk) dequant(kt + 1);  // one step ahead of the tensor cores
        const uint16_t* sa = reinterpret_cast<const uint16_t*>(smem_raw + (kt % FAST_STAGES) * L::STAGE);
        const uint16_t* sw = deq + (kt & 1) * BN * LDS;
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) mma_kstep<true, MI>(acc, sa, sw, wm, wn, lane, kk);
    }
    store_tile<EPI, MI>(p, acc, row0, rows, wm, wn, lane, 1.0f / p.a_scale);  // a_scale: a power of two, exact
}

// ------------------------------------------------------------------------------------------------ precise

// Both operands as bf16 hi + lo and three products (hi hi, lo hi, hi lo; bf16 weights are exact and need only
// the first two): ~fp32 accuracy for 2-3x the tensor work. Two shared-memory stages fed through registers.
template <dfmt F, gemm_epilogue EPI>
__global__ void __launch_bounds__(k_threads, 1) gemm_precise_kernel(const gemm_params p) {
    extern __shared__ __align__(16) uint16_t smem[];
    constexpr int NW = w_words<F>();
    constexpr bool AFFINE = F != dfmt::bf16;
    constexpr int LO = (BM + BN) * LDS;  // offset of the low parts in a stage
    int expert, row0, rows;
    if (!tile_rows<BM>(p, expert, row0, rows)) return;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int kt0, kt1;  // this CTA's k-tiles (a K split's slice)
    k_slice((int)(p.W.cols / BK), kt0, kt1);

    // A: this thread's rows tid/16 + 16 i, columns (tid % 16) * 4 of each k-tile
    const float* aptr[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = tid / 16 + 16 * i;
        aptr[i] = r < rows ? p.x + a_row(p, row0 + r) * p.ldx + (tid % 16) * 4 : nullptr;
    }
    // W: tile column c = tid / 2, values [32 * (tid % 2), +32) of each k-tile
    const int c = tid / 2, half = tid % 2;
    int64_t wrow;
    bool wvalid;
    const dmat& Wc = w_of_column<EPI>(p, c, expert, wrow, wvalid);
    const uint32_t* wp = Wc.w + wrow * Wc.row_words();
    const uint32_t* sbp = AFFINE ? Wc.sb + wrow * Wc.n_groups() : nullptr;
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
        uint16_t* sa = smem + s * PRECISE_STAGE;
        uint16_t* sw = sa + BM * LDS;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = tid / 16 + 16 * i;
            uint2 hi, lo;
            split_bf16(ra[i].x, ra[i].y, hi.x, lo.x);
            split_bf16(ra[i].z, ra[i].w, hi.y, lo.y);
            *reinterpret_cast<uint2*>(sa + LO + r * LDS + (tid % 16) * 4) = lo;
            *reinterpret_cast<uint2*>(sa + r * LDS + (tid % 16) * 4) = hi;
        }
        float v[32];
        dequant32<F>(v, rw, rsb);
        uint32_t hi[16], lo[16];
#pragma unroll
        for (int j = 0; j < 16; j++) {
            if constexpr (AFFINE)
                split_bf16(v[2 * j], v[2 * j + 1], hi[j], lo[j]);
            else
                hi[j] = pack_bf16(v[2 * j], v[2 * j + 1]);  // bf16 weights: exact
        }
        uint4* dst = reinterpret_cast<uint4*>(sw + c * LDS + half * 32);
#pragma unroll
        for (int j = 0; j < 4; j++) dst[j] = make_uint4(hi[4 * j], hi[4 * j + 1], hi[4 * j + 2], hi[4 * j + 3]);
        if constexpr (AFFINE) {
            uint4* dlo = reinterpret_cast<uint4*>(sw + LO + c * LDS + half * 32);
#pragma unroll
            for (int j = 0; j < 4; j++) dlo[j] = make_uint4(lo[4 * j], lo[4 * j + 1], lo[4 * j + 2], lo[4 * j + 3]);
        }
    };

    const int wm = warp % 2, wn = warp / 2;
    float acc[2][4][4] = {};
    load(kt0);
    store(kt0 & 1);
    __syncthreads();
    for (int kt = kt0; kt < kt1; kt++) {
        if (kt + 1 < kt1) load(kt + 1);
        const uint16_t* sa = smem + (kt & 1) * PRECISE_STAGE;
        const uint16_t* sw = sa + BM * LDS;
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            mma_kstep<false, 2>(acc, sa, sw, wm, wn, lane, kk);           // A hi x W hi
            mma_kstep<false, 2>(acc, sa + LO, sw, wm, wn, lane, kk);      // A lo x W hi
            if constexpr (AFFINE) mma_kstep<false, 2>(acc, sa, sw + LO, wm, wn, lane, kk);  // A hi x W lo
        }
        if (kt + 1 < kt1) store((kt + 1) & 1);
        __syncthreads();
    }
    store_tile<EPI, 2>(p, acc, row0, rows, wm, wn, lane, 1.0f);
}

// A K split's end: the slices' partial products [S][M][N] summed in slice order, then out through p's store
// epilogue (segments, accumulate). V values a thread (4 when N % 4 == 0: 16-byte loads; they share a row).
template <int V>
__global__ void split_sum_kernel(const gemm_params p, const float* part, int S) {
    using vec = std::conditional_t<V == 4, float4, float>;
    const int64_t n = (int64_t)p.M * p.N, nv = n / V;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nv; i += (int64_t)gridDim.x * blockDim.x) {
        const vec* src = reinterpret_cast<const vec*>(part) + i;
        float v[V];
        const vec w0 = src[0];
        memcpy(v, &w0, sizeof v);
#pragma unroll 4
        for (int s = 1; s < S; s++) {
            const vec w = src[s * nv];
            const float* wf = reinterpret_cast<const float*>(&w);
#pragma unroll
            for (int j = 0; j < V; j++) v[j] += wf[j];
        }
        const int64_t r = i * V / p.N, c = i * V % p.N;
#pragma unroll
        for (int j = 0; j < V; j++) store_value<gemm_epilogue::store>(p, r, c + j, v[j]);
    }
}

// Blocks stride over rows, threads over a row's 4-value chunks (no division per element: a 64-bit one per chunk
// cost a third of the kernel's time on prompts).
__global__ void to_f16_kernel(uint16_t* dst, const float* src, int64_t rows, int64_t cols, int64_t ld, float scale) {
    const int q = (int)(cols / 4);
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float4* s = reinterpret_cast<const float4*>(src + r * ld);
        uint2* d = reinterpret_cast<uint2*>(dst + r * cols);
        for (int c4 = threadIdx.x; c4 < q; c4 += blockDim.x) {
            const float4 v = s[c4];
            d[c4] = make_uint2(pack_f16(v.x * scale, v.y * scale), pack_f16(v.z * scale, v.w * scale));
        }
    }
}

template <int BMT>
size_t fast_smem(dfmt f) {
    return f == dfmt::q4 ? fast_layout<dfmt::q4, BMT>::SMEM
                         : f == dfmt::q8 ? fast_layout<dfmt::q8, BMT>::SMEM : fast_layout<dfmt::bf16, BMT>::SMEM;
}

template <dfmt F, gemm_epilogue EPI, int BMT>
void launch_fast(const gemm_params& p, dim3 grid, cudaStream_t stream) {
    constexpr size_t smem = fast_layout<F, BMT>::SMEM;
    allow_dynamic_smem<gemm_fast_kernel<F, EPI, BMT>>(smem);
    grid.y = (unsigned)(p.tiles ? p.max_tiles : (p.M + BMT - 1) / BMT);
    gemm_fast_kernel<F, EPI, BMT><<<grid, k_threads, smem, stream>>>(p);
}

template <dfmt F, gemm_epilogue EPI>
void launch(const gemm_params& p, cudaStream_t stream) {
    const int64_t cols = EPI == gemm_epilogue::swiglu ? BN / 2 : BN;
    dim3 grid((unsigned)((p.N + cols - 1) / cols), (unsigned)(p.tiles ? p.max_tiles : (p.M + BM - 1) / BM),
              (unsigned)p.split_k);
    if (p.precise) {
        allow_dynamic_smem<gemm_precise_kernel<F, EPI>>(PRECISE_SMEM);
        gemm_precise_kernel<F, EPI><<<grid, k_threads, PRECISE_SMEM, stream>>>(p);
    } else {
        const bool wide = p.tiles ? p.tile_bm == 2 * BM : p.M >= k_gemm_wide_min_rows && gemm_wide_tiles_fit(F);
#if TANSY_HAVE_WGMMA
        if (F == dfmt::q4 && gemm_wgmma_supports(p.W.group) && gemm_wgmma_enabled()) return gemm_wgmma(p, stream);
#endif
        if (wide)
            launch_fast<F, EPI, 2 * BM>(p, grid, stream);
        else
            launch_fast<F, EPI, BM>(p, grid, stream);
    }
    CUDA_CHECK_LAUNCH();
}

template <dfmt F>
void launch_epi(const gemm_params& p, cudaStream_t stream) {
    switch (p.epi) {
        case gemm_epilogue::store: return launch<F, gemm_epilogue::store>(p, stream);
        case gemm_epilogue::rows: return launch<F, gemm_epilogue::rows>(p, stream);
        case gemm_epilogue::swiglu: return launch<F, gemm_epilogue::swiglu>(p, stream);
    }
}

}  // namespace

bool gemm_wgmma_available() {
#if TANSY_HAVE_WGMMA
    return gemm_wgmma_device();
#else
    return false;
#endif
}

bool gemm_wgmma_enabled() { return gemm_wgmma_requested() && gemm_wgmma_available(); }

#if !TANSY_HAVE_WGMMA
uint64_t gemm_tma_calls() { return 0; }
#endif

namespace {
// Whether gemm() takes the wgmma GEMM for this matrix (4-bit, fast mode, a group it supports, the plan's switch on).
bool runs_on_wgmma(const dmat& W, bool precise) {
#if TANSY_HAVE_WGMMA
    return !precise && W.fmt == dfmt::q4 && gemm_wgmma_supports(W.group) && gemm_wgmma_enabled();
#else
    (void)W, (void)precise;
    return false;
#endif
}
}  // namespace

int gemm_grouped_tile_rows(const dmat& W, bool precise, int T, int E, int k) {
    if (precise || !gemm_wide_tiles_fit(W.fmt)) return BM;
    const int64_t slots = (int64_t)T * k;
    if (runs_on_wgmma(W, precise)) return slots >= (int64_t)k_gemm_wgmma_moe_wide_rows * E ? k_gemm_wgmma_moe_tokens : BM;
    return slots >= (int64_t)k_moe_wide_rows_per_expert * E ? 2 * BM : BM;
}

void to_f16(uint16_t* dst, const float* src, int64_t rows, int64_t cols, int64_t ld, float scale, cudaStream_t stream) {
    TANSY_CHECK(cols % 4 == 0 && ld % 4 == 0 && (uintptr_t)src % 16 == 0 && (uintptr_t)dst % 8 == 0,
                "to_f16: rows of %lld values (stride %lld) must be 16-byte aligned", (long long)cols, (long long)ld);
    if (rows == 0) return;
    const unsigned blocks = (unsigned)std::min<int64_t>(rows, 4096);  // row-stride beyond
    to_f16_kernel<<<blocks, 256, 0, stream>>>(dst, src, rows, cols, ld, scale);
    CUDA_CHECK_LAUNCH();
}

bool gemm_supports(const dmat& W) {
    if (W.cols % BK != 0 || W.cols == 0) return false;
    if (!(W.fmt == dfmt::bf16 || (W.group > 0 && W.group % 32 == 0))) return false;
    // both modes' 64-row kernels must fit the device's shared memory (not every format does on sm_86/89's 99 KB:
    // those take the GEMV path)
    return std::max(fast_smem<BM>(W.fmt), PRECISE_SMEM) <= max_dynamic_smem();
}

bool gemm_wide_tiles_fit(dfmt f) { return fast_smem<2 * BM>(f) <= max_dynamic_smem(); }

int gemm_split_slices(const gemm_params& p) {
    if (p.split_k == 1 || p.tiles || p.epi != gemm_epilogue::store || p.M == 0) return 1;
    const int nk = (int)(p.W.cols / BK);
    const bool wg = runs_on_wgmma(p.W, p.precise);  // (gemm_fast_kernel has no K slices)
    if (!p.precise && !wg) return 1;
    if (p.split_k > 1) return std::min(p.split_k, nk);
    const int most = active_kernel_plan().gemm_split;
    if (most < 2) return 1;
    int tokens = BM, per_sm = 1;
#if TANSY_HAVE_WGMMA
    if (wg) tokens = gemm_wgmma_tile_tokens(p), per_sm = gemm_wgmma_ctas_per_sm(tokens);
#endif
    // only where the tiles leave at least half the SMs idle: past that, slices only share SMs (the 97 CTAs of a
    // 64-row batch's input projections measured 24 us unsplit against 21.5 + 8.3 for the sum in 2 slices)
    const int64_t ctas = (p.N + BN - 1) / BN * ((p.M + tokens - 1) / tokens), slots = (int64_t)sm_count() * per_sm;
    if (2 * ctas > sm_count()) return 1;
    const int min_kt = p.precise ? k_gemm_split_min_ktiles_precise : k_gemm_split_min_ktiles;
    return (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)most, slots / ctas, (int64_t)(nk / min_kt)}));
}

size_t gemm_split_floats(const gemm_params& p) {
    const int S = gemm_split_slices(p);
    return S > 1 ? (size_t)S * (size_t)p.M * (size_t)p.N : 0;
}

void gemm(const gemm_params& p, cudaStream_t stream) {
    TANSY_CHECK(gemm_supports(p.W), "gemm: unsupported matrix (%lld columns, group %d)", (long long)p.W.cols, p.W.group);
    if (p.precise)
        TANSY_CHECK(p.x && p.ldx % 4 == 0 && ((uintptr_t)p.x % 16) == 0, "gemm: A rows (fp32) must be 16-byte aligned");
    else
        TANSY_CHECK(p.x16 && p.ldx16 % 8 == 0 && p.ldx16 >= p.W.cols && ((uintptr_t)p.x16 % 16) == 0,
                    "gemm: fast mode needs A as fp16 (x16, to_f16) with 16-byte aligned rows of K values");
    TANSY_CHECK(!p.tiles || p.tile_bm == BM || gemm_wide_tiles_fit(p.W.fmt), "gemm: 128-row tiles do not fit this device");
    TANSY_CHECK(p.out16 == nullptr || (p.epi == gemm_epilogue::swiglu && !p.precise), "gemm: out16 is for fast swiglu");
    TANSY_CHECK(p.epi != gemm_epilogue::swiglu || (p.W2.fmt == p.W.fmt && p.W2.cols == p.W.cols && p.W2.group == p.W.group),
                "gemm: swiglu needs gate and up in the same format");
    TANSY_CHECK(p.epi == gemm_epilogue::store ? p.n_seg >= 1 : (p.out != nullptr || p.out16 != nullptr), "gemm: no output");
    TANSY_CHECK(p.tiles == nullptr || p.epi != gemm_epilogue::store, "gemm: grouped tiles need a rows/swiglu output");
    TANSY_CHECK(!p.tiles || p.tile_bm == BM || (p.tile_bm == 2 * BM && !p.precise) ||
                    (p.tile_bm == k_gemm_wgmma_moe_tokens && runs_on_wgmma(p.W, p.precise)),
                "gemm: grouped tiles of %d rows (precise mode: %d; %d on the wgmma GEMM only)", p.tile_bm, BM,
                k_gemm_wgmma_moe_tokens);
    TANSY_CHECK(p.split_k >= 0, "gemm: split_k %d (0: the plan's choice, 1: none, N > 1: N slices)", p.split_k);
    if (p.tiles ? p.max_tiles == 0 : p.M == 0) return;
    gemm_params q = p;
    q.split_k = gemm_split_slices(p);
    if (q.split_k > 1) {  // the slices into split_ws as rows [z M + r], then summed into p's outputs
        TANSY_CHECK(p.split_ws, "gemm: a K split needs split_ws (gemm_split_floats)");
        q.epi = gemm_epilogue::rows, q.out = p.split_ws, q.ldo = p.N, q.accumulate = false;
    }
    switch (p.W.fmt) {
        case dfmt::q4: launch_epi<dfmt::q4>(q, stream); break;
        case dfmt::q8: launch_epi<dfmt::q8>(q, stream); break;
        case dfmt::bf16: launch_epi<dfmt::bf16>(q, stream); break;
    }
    if (q.split_k > 1) {
        const int v = p.N % 4 == 0 ? 4 : 1;
        const int64_t threads = (int64_t)p.M * p.N / v;
        const unsigned blocks = (unsigned)std::min<int64_t>((threads + 255) / 256, 4 * sm_count());
        if (v == 4)
            split_sum_kernel<4><<<blocks, 256, 0, stream>>>(p, p.split_ws, q.split_k);
        else
            split_sum_kernel<1><<<blocks, 256, 0, stream>>>(p, p.split_ws, q.split_k);
        CUDA_CHECK_LAUNCH();
    }
}

}  // namespace tansy::cuda
