// Key/value tiles of the KV cache into shared memory (device code), shared by the flash-attention prefill
// kernel and the tensor-core decode split kernel: bf16 tiles straight from a bf16 cache, or E4M3 tiles of an
// FP8 cache converted to fp16 just before use (kv_tiles).
#pragma once
#include <cuda_fp8.h>

#include "backend/cuda/mma.cuh"
#include "backend/cuda/seq_layout.h"

namespace tansy::cuda {

// One key tile (BN rows of DH bf16, row stride kvd in the cache) into shared memory; keys >= n_keys are
// zero-filled, never read (they may lie past the cache's capacity, and zeros keep 0 * V finite).
template <int DH, int THREADS, int BN>
__device__ __forceinline__ void load_kv_tile(uint16_t* dst, const uint16_t* src, int64_t kvd, int k0, int n_keys) {
    constexpr int CHUNKS = DH / 8;          // 16-byte chunks per row
    constexpr int ROWS = THREADS / CHUNKS;  // rows per pass; a warp copies whole rows (coalesced)
    static_assert(THREADS % CHUNKS == 0 && BN % ROWS == 0, "whole rows per pass");
    // note: one running source pointer; per-pass 64-bit offsets kept in registers cost 400 bytes of spills
    const int jt = threadIdx.x / CHUNKS, d = (threadIdx.x % CHUNKS) * 8;
    const uint16_t* s = src + (int64_t)(k0 + jt) * kvd + d;
    uint16_t* t = dst + jt * (DH + 8) + d;
#pragma unroll
    for (int it = 0; it < BN / ROWS; it++) {
        const bool ok = k0 + jt + it * ROWS < n_keys;
        cp_async16_zfill(t + it * ROWS * (DH + 8), ok ? s : src, ok);
        s += ROWS * kvd;
    }
}

// One tile of BN rows of DH E4M3 codes (row stride kvd bytes in the cache) into dst [BN][DH], and the rows'
// scales (stride hkv floats) into sc [BN]; rows >= n_keys are zero-filled, codes and scales (they decode to 0).
template <int DH, int THREADS, int BN>
__device__ __forceinline__ void load_kv8_tile(uint8_t* dst, float* sc, const uint8_t* src, const float* ssrc,
                                              int64_t kvd, int64_t hkv, int k0, int n_keys) {
    constexpr int CHUNKS = DH / 16;
    constexpr int ROWS = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && BN % ROWS == 0, "whole rows per pass");
    const int jt = threadIdx.x / CHUNKS, d = (threadIdx.x % CHUNKS) * 16;
    const uint8_t* s = src + (int64_t)(k0 + jt) * kvd + d;
    uint8_t* t = dst + jt * DH + d;
#pragma unroll
    for (int it = 0; it < BN / ROWS; it++) {
        const bool ok = k0 + jt + it * ROWS < n_keys;
        cp_async16_zfill(t + it * ROWS * DH, ok ? s : src, ok);
        s += ROWS * kvd;
    }
    for (int j = threadIdx.x; j < BN; j += THREADS) {
        const bool ok = k0 + j < n_keys;
        cp_async4_zfill(sc + j, ok ? ssrc + (int64_t)(k0 + j) * hkv : ssrc, ok);
    }
}

// Two E4M3 codes (low byte first) as an exact fp16 pair (E4M3 values are normal fp16 numbers or zero).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t codes) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(codes & 0xFFFFu), __NV_E4M3);
    return (uint32_t)h.x | (uint32_t)h.y << 16;
}

// raw [BN][DH] codes -> dst [BN][DH + 8] fp16 (the padded layout the mma operands read); with row scales, row r
// times sc[r] * inv_ref (a power of two <= 1: exact unless the product falls below fp16's normal range, i.e.
// below 2^-15 of the tile's largest scale). One cvt per two values (and one HMUL2 with scales): the first FP8
// kernels dequantised to bf16 through fp32 (~3 instructions per value) and ran 128K decode slower than the
// bf16 cache (docs/PERF.md).
template <int DH, int THREADS, int BN>
__device__ __forceinline__ void convert_kv8_tile(uint16_t* dst, const uint8_t* raw, const float* sc, float inv_ref) {
    constexpr int UNITS = DH / 8;             // 8 codes -> one 16-byte store
    constexpr int ROWS = THREADS / UNITS;     // rows per pass
    static_assert(THREADS % UNITS == 0 && BN % ROWS == 0, "whole rows per pass");
    // note: each thread's (row, column) and pointers are fixed up front and advance by constants: recomputed per
    // unit, the index arithmetic outnumbers the conversions (by the source counters)
    const int r0 = threadIdx.x / UNITS, c = (threadIdx.x % UNITS) * 8;
    const uint8_t* src = raw + r0 * DH + c;
    uint16_t* out = dst + r0 * (DH + 8) + c;
#pragma unroll
    for (int i = 0; i < BN / ROWS; i++) {
        const uint2 w = *reinterpret_cast<const uint2*>(src + i * ROWS * DH);
        uint32_t h[4] = {e4m3x2_to_f16x2(w.x), e4m3x2_to_f16x2(w.x >> 16), e4m3x2_to_f16x2(w.y),
                         e4m3x2_to_f16x2(w.y >> 16)};
        if (sc) {
            const __half2 f2 = __float2half2_rn(sc[r0 + i * ROWS] * inv_ref);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&h[k]), f2);
                h[k] = *reinterpret_cast<const uint32_t*>(&v);
            }
        }
        *reinterpret_cast<uint4*>(out + i * ROWS * (DH + 8)) = make_uint4(h[0], h[1], h[2], h[3]);
    }
}

// The K/V tiles kt = 0 .. n_tiles-1 (keys key0 + kt * BN ..., up to n_keys) of one KV head, for a loop that
// calls start() once, then next(kt) for every kt in order; next returns [K: BN rows | V: BN rows] x (DH + 8)
// 16-bit values, valid until the following next(). Every thread of the block calls both (they hold barriers).
//   bf16 cache: bf16 tiles; two stages, tile kt+1 streaming in (cp.async) while the caller works on tile kt.
//   FP8 cache (KV8): fp16 tiles; NR raw stages of codes + scales in flight (half the bytes per tile, so more
//   tiles for the same bytes in flight), each converted into one fp16 buffer between two barriers. K holds the
//   raw E4M3 values: the caller scales score j by k_scale[j] (scores are exact fp32 sums either way). V row j
//   holds v_j * vs_j / v_scale: the caller weights P by v_scale (see the kernels' running reference scale).
template <bool KV8, int DH, int THREADS, int BN, int NR = 2>
struct kv_tiles {
    static constexpr int LD = DH + 8;
    static constexpr size_t TILE = (size_t)2 * BN * LD * sizeof(uint16_t);   // one 16-bit stage: K then V
    static constexpr size_t RAW = (size_t)2 * BN * DH + (size_t)2 * BN * 4;  // one raw stage: codes, scales
    static constexpr size_t SMEM = KV8 ? TILE + NR * RAW : 2 * TILE;
    static_assert(!KV8 || NR >= 2, "at least two raw stages");
    static constexpr int block_n = BN, dh = DH;

    char* smem;                  // SMEM bytes, 16-byte aligned
    const void *K, *V;           // this KV head's column in the cache: bf16 or E4M3 rows of kvd values
    const float *ks, *vs;        // KV8: this head's scales (stride hkv)
    int64_t kvd, hkv;
    int key0, n_keys, n_tiles;

    __device__ __forceinline__ void issue(int kt) {
        const int k0 = key0 + kt * BN;
        if constexpr (KV8) {
            uint8_t* r = reinterpret_cast<uint8_t*>(smem + TILE + (size_t)(kt % NR) * RAW);
            float* sc = reinterpret_cast<float*>(r + 2 * BN * DH);
            load_kv8_tile<DH, THREADS, BN>(r, sc, static_cast<const uint8_t*>(K), ks, kvd, hkv, k0, n_keys);
            load_kv8_tile<DH, THREADS, BN>(r + BN * DH, sc + BN, static_cast<const uint8_t*>(V), vs, kvd, hkv, k0, n_keys);
        } else {
            uint16_t* st = reinterpret_cast<uint16_t*>(smem + (size_t)(kt & 1) * TILE);
            load_kv_tile<DH, THREADS, BN>(st, static_cast<const uint16_t*>(K), kvd, k0, n_keys);
            load_kv_tile<DH, THREADS, BN>(st + BN * LD, static_cast<const uint16_t*>(V), kvd, k0, n_keys);
        }
    }
    __device__ __forceinline__ void start() {
        const int first = KV8 ? NR - 1 : 1;
        for (int j = 0; j < first; j++) {
            if (j < n_tiles) issue(j);
            cp_async_commit();
        }
    }
    const float* k_scale = nullptr;  // KV8, after next(kt): tile kt's K scales [BN] (rows past n_keys: 0)
    float v_scale = 0.0f;            // KV8, after next(kt): the largest V scale of tile kt (0: no row)

    __device__ __forceinline__ const uint16_t* next(int kt) {
        if constexpr (KV8) {
            cp_async_wait<NR - 2>();  // this thread's copies of tile kt have landed
            __syncthreads();          // everyone's; the fp16 buffer and tile kt-1's raw stage are free
            if (kt + NR - 1 < n_tiles) issue(kt + NR - 1);
            cp_async_commit();
            const uint8_t* r = reinterpret_cast<const uint8_t*>(smem + TILE + (size_t)(kt % NR) * RAW);
            const float* sc = reinterpret_cast<const float*>(r + 2 * BN * DH);
            k_scale = sc;
            // every warp finds the tile's largest V scale itself (no extra barrier), then each row's factor
            float vmax = 0.0f;
            for (int j = threadIdx.x % 32; j < BN; j += 32) vmax = fmaxf(vmax, sc[BN + j]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, o));
            v_scale = vmax;
            uint16_t* st = reinterpret_cast<uint16_t*>(smem);
            convert_kv8_tile<DH, THREADS, BN>(st, r, nullptr, 0.0f);
            // 1 / vmax is exact (a power of two); a tile without rows (vmax 0) converts zeros times 0
            convert_kv8_tile<DH, THREADS, BN>(st + BN * LD, r + BN * DH, sc + BN, vmax > 0.0f ? 1.0f / vmax : 0.0f);
            __syncthreads();
            return st;
        } else {
            cp_async_wait<0>();  // this thread's copies of tile kt have landed
            __syncthreads();     // everyone's (and the caller's earlier shared stores); tile kt-1's stage is free
            if (kt + 1 < n_tiles) {
                issue(kt + 1);  // into tile kt-1's stage: in flight during all of tile kt
                cp_async_commit();
            }
            return reinterpret_cast<const uint16_t*>(smem + (size_t)(kt & 1) * TILE);
        }
    }
};

// The tiles' 16-bit operand type: fp16 for an FP8 cache (KV8), bf16 otherwise.
template <bool F16>
__device__ __forceinline__ void mma_16bit(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (F16)
        mma_f16(c, a, b0, b1);
    else
        mma_bf16(c, a, b0, b1);
}
template <bool F16>
__device__ __forceinline__ uint32_t pack_16bit(float lo, float hi) {
    if constexpr (F16)
        return pack_f16(lo, hi);
    else
        return pack_bf16(lo, hi);
}

// KV8: the V tiles hold v / (their tile's largest scale), so O = sum_j p_j v_j accumulates in units of a running
// reference `ref` (the largest tile scale so far, a power of two): each tile's P is weighted by its scale / ref
// (<= 1, so P stays in fp16's range) and O is rescaled when ref grows, as the online softmax rescales for a new
// maximum.
// The factor also carries 2^15 of headroom: P * vt / ref <= 1 would fall into fp16's subnormals for tiles whose
// scale is far below the reference (a numpy model of one V row 2^12 times the others: 2e-2 relative error in O);
// times 2^15 it stays normal down to 2^-29 and still below fp16's maximum. The true O is ref * 2^-15 * O (unit()).
struct v_reference {
    static constexpr float k_headroom = 32768.0f;
    float ref = 0.0f;
    // For a tile of largest V scale vt: the factor for its P; *o_corr (O's correction) absorbs a change of ref.
    __device__ __forceinline__ float enter(float vt, float* o_corr) {
        if (vt > ref) {
            *o_corr *= ref / vt;  // exact (powers of two); 0 on the first tile, whose O is still 0
            ref = vt;
        }
        return ref > 0.0f ? vt / ref * k_headroom : 0.0f;
    }
    __device__ __forceinline__ float unit() const { return ref * (1.0f / k_headroom); }  // exact
};

// The tiles of KV head kh of layer `slot` in sequence s, keys [key0, n_keys), in SMEM bytes at smem.
template <class Tiles>
__device__ __forceinline__ Tiles cache_tiles(const dseq& s, const dshape& sh, int slot, int kh, char* smem, int key0,
                                             int n_keys) {
    Tiles t;
    t.smem = smem;
    if (sh.kv8) {
        t.K = kv8_k(s, sh, slot) + (int64_t)kh * Tiles::dh, t.V = kv8_v(s, sh, slot) + (int64_t)kh * Tiles::dh;
        t.ks = kv8_ks(s, sh, slot) + kh, t.vs = kv8_vs(s, sh, slot) + kh;
    } else {
        t.K = kv_k(s, sh, slot) + (int64_t)kh * Tiles::dh, t.V = kv_v(s, sh, slot) + (int64_t)kh * Tiles::dh;
        t.ks = t.vs = nullptr;
    }
    t.kvd = sh.kvd, t.hkv = sh.hkv;
    t.key0 = key0, t.n_keys = n_keys, t.n_tiles = (n_keys - key0 + Tiles::block_n - 1) / Tiles::block_n;
    return t;
}

}  // namespace tansy::cuda
