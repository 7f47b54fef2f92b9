// Decode attention (head_dim 256 = 8 values per lane), gated output (MODEL.md), bf16 or FP8 KV cache.
//   prep_kernel     a warp per head: q/k RMS norm, partial RoPE, KV cache append.
//   split_kernel    one block per (row, KV head, slice of the context): the G <= 8 query heads of the KV head
//                   share every K/V tile (GQA packing) as the rows of one m16n8k16 tile; online softmax; the
//                   warps' partials fold into one per head.
//   combine_kernel  merges the slices' partials of a (row, head) and applies the sigmoid output gate.
// Slices per (row, KV head): one wave of blocks over the SMs, at most 64 (attention_splits). Rows of spans of
// k_attn_prefill_min_rows or more are skipped here: attention_prefill.cu does those.
// Why fast: at short context attention is a latency chain, so the key tiles of earlier steps (fixed while the step
// runs) are requested before the PDL wait, while prep runs, and each kernel's position, weights and rotation are
// found before its wait; at long context the split kernel is bound by the KV bytes (tensor cores, not FMAs).
// Measured figures and rejected variants (a fused prep, 3-stage tiles, more slices): docs/PERF.md.
#include <algorithm>
#include <atomic>
#include <cfloat>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/attention_tile.cuh"
#include "backend/cuda/common.cuh"
#include "core/fp8.h"

namespace tansy::cuda {

namespace {

constexpr int DH = 256, DPL = DH / 32, k_warps = 8, k_max_splits = 256;
constexpr int k_min_split = 64;  // positions: below this a slice is not worth a block (one key tile)
// An FP8 cache's fp16 query remainder (precise mode) is stored times 2^11: about as large as the query again,
// clear of fp16's subnormals (exact scaling).
constexpr float k_q_lo_scale = 2048.0f;

__device__ __forceinline__ int position_of(const attn_params& p, int t, dseq* s_out) {
    const drow r = p.rows[t];
    *s_out = p.seqs[r.seq];
    return s_out->meta[0] + r.offset;
}

// Rows of long spans belong to attention_prefill (attention.cuh); the decode kernels leave them alone.
__device__ __forceinline__ bool row_in_prefill(const attn_params& p, int t) {
    return p.spans && p.spans[p.rows[t].seq].n >= k_attn_prefill_min_rows;
}

// One (position, KV head) row of the FP8 cache from the warp's DH values (DPL per lane): the power-of-two scale
// of the row's largest magnitude (core/fp8.h) and the E4M3 codes, rounded to nearest even as kv8_round does.
struct kv8_row {
    uint2 codes;  // the lane's DPL codes, first value in the low byte
    float scale;
};
__device__ __forceinline__ kv8_row encode_kv8(const float (&x)[DPL]) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; i++) amax = fmaxf(amax, fabsf(x[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const int e = kv8_scale_exp(amax);
    const float inv = __int_as_float((127 - e) << 23);  // 2^-e, exact
    static_assert(DPL == 8, "8 codes per lane: one 8-byte store");
    uint32_t w[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < DPL; i++)
        w[i / 4] |= (uint32_t)__nv_cvt_float_to_fp8(x[i] * inv, __NV_SATFINITE, __NV_E4M3) << (8 * (i % 4));
    return {make_uint2(w[0], w[1]), __int_as_float((127 + e) << 23)};
}
__device__ __forceinline__ void store_kv8(uint8_t* dst, float* scale, const kv8_row& r, int lane) {
    *reinterpret_cast<uint2*>(dst + lane * DPL) = r.codes;
    if (lane == 0) *scale = r.scale;
}
// A row's values as the cache holds them (what a tile gives the mma): code times scale, exact in fp32.
__device__ __forceinline__ void decode_kv8(const kv8_row& r, float (&x)[DPL]) {
#pragma unroll
    for (int i = 0; i < DPL; i++) {
        const uint32_t w = i < 4 ? r.codes.x : r.codes.y;
        const __half h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)((w >> (8 * (i % 4))) & 0xFFu), __NV_E4M3);
        x[i] = __half2float(h) * r.scale;
    }
}

// Row P of KV head kh in this layer's cache, K or V, the lane's DPL values as stored: bf16 pairs, or (FP8) the
// codes in .x .y and the scale's bits in .z. Through L2 only (ld.global.cg): it reads rows this step's prep wrote,
// and the split kernel's tiles fetch the scales of earlier rows with L1-allocating 4-byte copies before its PDL wait,
// sometimes in the same 32-byte sector; L1 is not kept coherent with other SMs' stores.
__device__ __forceinline__ uint4 cache_row(const dseq& s, const attn_params& p, bool v, int64_t P, int kh, int lane) {
    if (p.shape.kv8) {
        const int64_t row = P * p.shape.kvd + kh * DH + lane * DPL, srow = P * p.shape.hkv + kh;
        const uint8_t* codes = v ? kv8_v(s, p.shape, p.slot) : kv8_k(s, p.shape, p.slot);
        const float* scales = v ? kv8_vs(s, p.shape, p.slot) : kv8_ks(s, p.shape, p.slot);
        const uint2 c = __ldcg(reinterpret_cast<const uint2*>(codes + row));
        return make_uint4(c.x, c.y, __float_as_uint(__ldcg(scales + srow)), 0u);
    }
    const uint16_t* vals = v ? kv_v(s, p.shape, p.slot) : kv_k(s, p.shape, p.slot);
    return __ldcg(reinterpret_cast<const uint4*>(vals + P * p.shape.kvd + kh * DH + lane * DPL));
}
// A cache_row's values in fp32 (exact).
__device__ __forceinline__ void cache_row_values(const attn_params& p, const uint4& r, float (&x)[DPL]) {
    if (p.shape.kv8) {
        decode_kv8({make_uint2(r.x, r.y), __uint_as_float(r.z)}, x);
        return;
    }
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < DPL / 2; i++) x[2 * i] = __uint_as_float(w[i] << 16), x[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
}

// A head's DH values at src (lane * DPL + i per lane) into v.
__device__ __forceinline__ void load_head(float (&v)[DPL], const float* src, int lane) {
    const float4 a = *reinterpret_cast<const float4*>(src + lane * DPL);
    const float4 b = *reinterpret_cast<const float4*>(src + lane * DPL + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// The partial RoPE's rotation at position pos for the lane's values (lane * DPL + i): cos and sin of value i's
// angle, 1 and 0 past rope_dim. Independent of the activations: prep computes it before its PDL wait.
__device__ __forceinline__ void rope_angles(const attn_params& p, int pos, int lane, float (&cs)[DPL], float (&sn)[DPL]) {
    const int half = p.rope_dim / 2;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
        const int d = lane * DPL + i;
        cs[i] = 1.0f, sn[i] = 0.0f;
        if (d >= p.rope_dim) continue;
        const int j = d < half ? d : d - half;
        // angle in double: fp32 pos * freq loses radians at long context (MODEL.md §3 numerics)
        const double ang = (double)pos * p.inv_freq[j];
        const float r = (float)(ang - 6.283185307179586 * rint(ang * 0.15915494309189535));  // into [-pi, pi]
        sincosf(r, &sn[i], &cs[i]);
    }
}

// RMS norm with weights w (the lane's DPL of them), then the rotation (rope_angles), of one head held by the warp
// (value lane * DPL + i in v[i]); sh: the warp's DH floats of scratch (the rotation pairs values of other lanes).
__device__ __forceinline__ void norm_rope(float (&v)[DPL], const float (&w)[DPL], const float (&cs)[DPL],
                                          const float (&sn)[DPL], const attn_params& p, float* sh, int lane) {
    float ss = 0;
#pragma unroll
    for (int i = 0; i < DPL; i++) ss += v[i] * v[i];
    const float inv = rsqrtf(warp_sum(ss) / (float)DH + p.eps);
#pragma unroll
    for (int i = 0; i < DPL; i++) sh[lane * DPL + i] = v[i] = v[i] * inv * w[i];
    __syncwarp();
    const int half = p.rope_dim / 2;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
        const int d = lane * DPL + i;
        if (d >= p.rope_dim) continue;
        v[i] = d < half ? v[i] * cs[i] - sh[d + half] * sn[i] : v[i] * cs[i] + sh[d - half] * sn[i];
    }
    __syncwarp();  // sh is free for the warp's next head
}

__global__ void __launch_bounds__(k_warps * 32) prep_kernel(const attn_params p) {
    __shared__ float sh[k_warps][DH];
    const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int hi = blockIdx.y * k_warps + warp;
    pdl_trigger();
    if (hi >= p.Hq + p.Hkv) {
        pdl_wait();
        return;
    }
    // before the wait: the position (the batch is fixed, n_past from earlier steps), the norm's weights and the
    // rotation, so that after it the kernel is one L2 round trip and arithmetic
    dseq s;
    const int pos = position_of(p, t, &s);
    const bool is_q = hi < p.Hq;
    const int kh = hi - p.Hq;
    float v[DPL], nw[DPL], cs[DPL], sn[DPL];
    load_head(nw, is_q ? p.q_norm : p.k_norm, lane);
    rope_angles(p, pos, lane, cs, sn);
    pdl_wait();  // q/k/v come from the projection kernel
    load_head(v, is_q ? p.qg + (int64_t)t * p.Hq * 2 * DH + hi * 2 * DH : p.k + ((int64_t)t * p.Hkv + kh) * DH, lane);
    norm_rope(v, nw, cs, sn, p, sh[warp], lane);
    if (is_q) {
#pragma unroll
        for (int i = 0; i < DPL; i++) p.q[((int64_t)t * p.Hq + hi) * DH + lane * DPL + i] = v[i];
        return;
    }
    float w[DPL];
    load_head(w, p.v + ((int64_t)t * p.Hkv + kh) * DH, lane);
    if (p.shape.kv8) {
        const int64_t row = (int64_t)pos * p.shape.kvd + kh * DH, srow = (int64_t)pos * p.shape.hkv + kh;
        store_kv8(kv8_k(s, p.shape, p.slot) + row, kv8_ks(s, p.shape, p.slot) + srow, encode_kv8(v), lane);
        store_kv8(kv8_v(s, p.shape, p.slot) + row, kv8_vs(s, p.shape, p.slot) + srow, encode_kv8(w), lane);
    } else {
        uint16_t* K = kv_k(s, p.shape, p.slot) + (int64_t)pos * p.shape.kvd + kh * DH;
        uint16_t* V = kv_v(s, p.shape, p.slot) + (int64_t)pos * p.shape.kvd + kh * DH;
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            K[lane * DPL + i] = float_to_bf16_bits(v[i]);
            V[lane * DPL + i] = float_to_bf16_bits(w[i]);
        }
    }
}

// Split slice length for a context of len positions: at least k_min_split positions per block, at most
// n_splits blocks (the grid's static z extent); the split and combine kernels must agree on it.
__device__ __forceinline__ int split_len(int len, int n_splits) {
    return max(k_min_split, (len + n_splits - 1) / n_splits);
}

// One block per (token, KV head, slice of the context), on tensor cores: the G <= 8 query heads of the KV
// head are the rows of one m16n8k16 tile, each head twice: bf16(q) in row g and bf16(q - bf16(q)) in row g + 8,
// so that S = Q K^T sums both halves in the same thread (~16-bit q at no extra mma). Key tiles of BN positions
// (cp.async, double-buffered) are split over BN/16 warps, 16 keys each: S for those keys, an online softmax in
// base 2, P rounded to bf16 as the A operand of O += P V (V through ldmatrix.trans), as attention_prefill does.
// The warps' partials fold through shared memory into one per head for the combine kernel.
// (One warp per position with fp32 FMAs is bound by instruction issue: ~350 instructions per position and KV
// head.) The tiles cover only the keys of earlier steps (positions < n_past), so they are requested before the
// PDL wait, while prep runs; the keys of this step in the slice (the row's own, and those of earlier rows of its
// span: prep appends them) are read from the cache after the wait and their contributions computed in fp32 as one
// more partial of the fold. Prep finds its position, loads its norm weights and computes the rotation before its
// PDL wait (after it: one L2 round trip and arithmetic, not the row -> sequence -> n_past -> inv_freq chain of
// dependent loads); the split kernel requests the row's own K/V with q; the combine finds its position before the
// wait. (Measured, not kept, docs/PERF.md: this kernel doing prep's work, one launch less per layer, puts the
// norms and rotations on every block's critical path where prep runs hidden behind the key tiles' DRAM latency;
// key tiles through 3 stages instead of 2 gain nothing.)
template <int G, int BN, bool KV8>
struct split_cfg {
    // WARPS do the math, 16 keys of a tile each. With an FP8 cache as many again join in the copies and the
    // E4M3 -> fp16 conversion: with one warp per scheduler (and per-unit index arithmetic) the conversion ran
    // latency-bound (by the source counters; measured: docs/PERF.md).
    static constexpr int WARPS = BN / 16, THREADS = (KV8 ? 2 : 1) * WARPS * 32, LD = DH + 8;
    static constexpr int ALL_WARPS = THREADS / 32, HEADS_PER_WARP = (8 + ALL_WARPS - 1) / ALL_WARPS;  // Q rows 0-7
    // an FP8 cache: 3 raw tiles in flight beside the one being converted (2 measured the same: the math phase,
    // ~2.3 us per 64-key tile with one math warp per scheduler, bounds the kernel with either cache; converter
    // warps that double-buffer the fp16 tiles meanwhile were slower still: docs/PERF.md)
    using tiles = kv_tiles<KV8, DH, THREADS, BN, 4>;
    // sQ [16][LD] 16-bit | this step's keys' partial: acc [G][DH], max [G], sum [G] fp32 | the K/V tiles; after
    // the loop the K/V space holds the fold's partials
    static constexpr size_t Q_BYTES = (size_t)16 * LD * sizeof(uint16_t);
    static constexpr size_t NEW_BYTES = ((size_t)G * (DH + 2) * sizeof(float) + 15) / 16 * 16;
    static constexpr size_t SMEM = Q_BYTES + NEW_BYTES + tiles::SMEM;
    static_assert(G <= 8, "two rows per query head");
    static_assert((size_t)WARPS * G * (DH + 2) * sizeof(float) <= tiles::SMEM, "fold space");
};

template <int G, int BN, bool KV8>
__global__ void __launch_bounds__(split_cfg<G, BN, KV8>::THREADS) split_kernel(const attn_params p) {
    using C = split_cfg<G, BN, KV8>;
    constexpr int LD = C::LD, NT_O = DH / 8, NW = C::ALL_WARPS;
    extern __shared__ __align__(16) uint16_t smem_kv[];
    char* const smem = reinterpret_cast<char*>(smem_kv);
    uint16_t* sQ = smem_kv;
    float* s_new_acc = reinterpret_cast<float*>(smem + C::Q_BYTES);  // this step's keys: [G][DH], then max, sum
    float* s_new_m = s_new_acc + G * DH;
    float* s_new_l = s_new_m + G;
    const int t = blockIdx.x, kh = blockIdx.y, sp = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    char* sKV = smem + C::Q_BYTES + C::NEW_BYTES;
    pdl_trigger();
    // Before the wait: the batch's rows, spans and sequences are fixed while a graph of them replays, n_past and
    // the cache below it were written by earlier steps (pdl_trigger in common.cuh)
    if (row_in_prefill(p, t)) {
        pdl_wait();
        return;
    }
    const drow r = p.rows[t];
    const dseq s = p.seqs[r.seq];
    const int n_past = s.meta[0], pos = n_past + r.offset, len = pos + 1;
    const int S = split_len(len, p.n_splits);
    const int start = sp * S, end = min(len, start + S);
    if (start >= end) {  // the combine kernel only reads the slices that exist
        pdl_wait();
        return;
    }
    const int cached_end = max(start, min(end, n_past)), new0 = max(start, n_past);  // [start, cached) [new0, end)
    const int64_t part0 = ((int64_t)t * p.Hq + kh * G) * p.n_splits + sp;  // + g * n_splits
    typename C::tiles kv = cache_tiles<typename C::tiles>(s, p.shape, p.slot, kh, sKV, start, cached_end);
    const int n_tiles = kv.n_tiles;
    kv.start();
    const bool has_new = new0 < end, own = end == len;  // this step's keys in the slice; among them the row's own
    pdl_wait();  // q and this step's K/V come from prep
    // the row's own K/V (cache, as prep appended them) requested with q: one L2 round trip for both
    uint4 k_own = {}, v_own = {};
    if (own) k_own = cache_row(s, p, false, pos, kh, lane), v_own = cache_row(s, p, true, pos, kh, lane);
    // Q rows: g < G the head in the tiles' 16-bit type (bf16, or fp16 for an FP8 cache), 8 + g its
    // remainder (fp16: times k_q_lo_scale, clear of fp16's subnormals), the others zero. qe: the query the two
    // rows hold, for this step's keys.
    float qe[C::HEADS_PER_WARP][DPL];
#pragma unroll
    for (int j = 0; j < C::HEADS_PER_WARP; j++) {
        const int g = warp + j * NW;
        if (g >= 8) break;
        float v[DPL] = {};
        if (g < G) load_head(v, p.q + ((int64_t)t * p.Hq + kh * G + g) * DH, lane);
        uint32_t hi[DPL / 2], lo[DPL / 2];
#pragma unroll
        for (int i = 0; i < DPL / 2; i++) {
            hi[i] = pack_16bit<KV8>(v[2 * i], v[2 * i + 1]);
            float h0, h1;
            if constexpr (KV8) {
                const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&hi[i]));
                h0 = a.x, h1 = a.y;
            } else {
                h0 = __uint_as_float(hi[i] << 16), h1 = __uint_as_float(hi[i] & 0xFFFF0000u);
            }
            const float r0 = v[2 * i] - h0, r1 = v[2 * i + 1] - h1;
            lo[i] = p.q_bf16 ? 0u : KV8 ? pack_16bit<KV8>(r0 * k_q_lo_scale, r1 * k_q_lo_scale) : pack_16bit<KV8>(r0, r1);
            float l0, l1;
            if constexpr (KV8) {
                const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&lo[i]));
                l0 = b.x * (1.0f / k_q_lo_scale), l1 = b.y * (1.0f / k_q_lo_scale);
            } else {
                l0 = __uint_as_float(lo[i] << 16), l1 = __uint_as_float(lo[i] & 0xFFFF0000u);
            }
            qe[j][2 * i] = h0 + l0, qe[j][2 * i + 1] = h1 + l1;
        }
        *reinterpret_cast<uint4*>(sQ + g * LD + lane * DPL) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        *reinterpret_cast<uint4*>(sQ + (g + 8) * LD + lane * DPL) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
    // This step's keys in the slice (positions new0 .. end-1), as prep appended them: scores and weights in fp32
    // (the rows' values are exact in fp32); one partial per head, in natural units as the fold's.
    if (has_new) {
#pragma unroll
        for (int j = 0; j < C::HEADS_PER_WARP; j++) {
            const int g = warp + j * NW;
            if (g >= G) break;
            float nm = -INFINITY, nl = 0.0f, na[DPL] = {};
            for (int P = new0; P < end; P++) {
                float kx[DPL], vx[DPL];
                cache_row_values(p, P == pos ? k_own : cache_row(s, p, false, P, kh, lane), kx);
                cache_row_values(p, P == pos ? v_own : cache_row(s, p, true, P, kh, lane), vx);
                float d = 0.0f;
#pragma unroll
                for (int i = 0; i < DPL; i++) d = fmaf(qe[j][i], kx[i], d);
                const float x = warp_sum(d) * rsqrtf((float)DH);
                const float mn = fmaxf(nm, x), corr = __expf(nm - mn), pe = __expf(x - mn);  // nm = -inf: corr 0
                nl = nl * corr + pe;
#pragma unroll
                for (int i = 0; i < DPL; i++) na[i] = fmaf(pe, vx[i], na[i] * corr);
                nm = mn;
            }
#pragma unroll
            for (int i = 0; i < DPL; i++) s_new_acc[g * DH + lane * DPL + i] = na[i];
            if (lane == 0) s_new_m[g] = nm, s_new_l[g] = nl;
        }
    }
    // ldmatrix lane addresses (as attention_prefill): A = Q rows, B = this warp's 16 keys of a tile
    const uint16_t* q_lane = sQ + (lane % 16) * LD + (lane / 16) * 8;
    const int k_off = (warp * 16 + lane % 8 + (lane / 16) * 8) * LD + ((lane / 8) % 2) * 8;
    const int v_off = BN * LD + (warp * 16 + lane % 16) * LD + (lane / 16) * 8;
    const float sl2 = rsqrtf((float)DH) * 1.4426950408889634f;  // scores to base-2 exponents
    float o[NT_O][4];
#pragma unroll
    for (int j = 0; j < NT_O; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m = -INFINITY, l = 0.0f;  // head lane/4: running max (raw score), this thread's share of the sum
    v_reference vref;               // KV8: O's units
    const bool math = warp < C::WARPS;  // the other warps (FP8 cache) only copy and convert tiles
    // Q's A fragments stay in registers for the whole slice (64 registers): they are the same for every tile, and
    // reloading them puts an ldmatrix latency in front of every Q K^T mma (short-scoreboard stalls on those mma in
    // the source counters, with one math warp per scheduler to hide them)
    uint32_t qa[DH / 16][4];
    for (int kt = 0; kt < n_tiles; kt++) {
        const uint16_t* st = kv.next(kt);  // tile kt (and Q) visible to all; tile kt+1 on its way
        if (!math) continue;
        if (kt == 0) {
#pragma unroll
            for (int ks = 0; ks < DH / 16; ks++) ldmatrix_x4(qa[ks], q_lane + ks * 16);
        }
        float sc[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < DH / 16; ks++) {
            uint32_t b[4];
            ldmatrix_x4(b, st + k_off + ks * 16);
            mma_16bit<KV8>(sc[0], qa[ks], b[0], b[1]);
            mma_16bit<KV8>(sc[1], qa[ks], b[2], b[3]);
        }
        // this thread's scores: head lane/4, keys 2(lane%4) + {0, 1} of n-tiles 0 and 1 (hi row + lo row); an
        // FP8 tile's K is unscaled: times the key's scale
        const int kin = warp * 16 + 2 * (lane % 4), kbase = start + kt * BN + kin;
        float x[4];
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float v = KV8 ? (sc[j][e] + sc[j][2 + e] * (1.0f / k_q_lo_scale)) * kv.k_scale[kin + 8 * j + e]
                              : sc[j][e] + sc[j][2 + e];
                x[2 * j + e] = kbase + 8 * j + e < cached_end ? v : -INFINITY;
            }
        float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(mx, m);
        // a warp whose keys are all past the slice sees mx = -inf: nothing to add (p = 0), nothing to rescale
        const float corr = m == -INFINITY ? 0.0f : exp2f((m - mx) * sl2);
        const float msc = mx == -INFINITY ? 0.0f : mx * sl2;
        float pr[4];
#pragma unroll
        for (int e = 0; e < 4; e++) pr[e] = exp2f(fmaf(x[e], sl2, -msc));
        l = l * corr + (pr[0] + pr[1]) + (pr[2] + pr[3]);
        m = mx;
        float oc = corr, pf = 1.0f;
        if constexpr (KV8) pf = vref.enter(kv.v_scale, &oc);
        const uint32_t pa[4] = {pack_16bit<KV8>(pr[0] * pf, pr[1] * pf), 0u, pack_16bit<KV8>(pr[2] * pf, pr[3] * pf),
                                0u};  // rows 8-15: none
#pragma unroll
        for (int j = 0; j < NT_O; j += 2) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, st + v_off + j * 8);
            o[j][0] *= oc, o[j][1] *= oc, o[j + 1][0] *= oc, o[j + 1][1] *= oc;
            mma_16bit<KV8>(o[j], pa, b[0], b[1]);
            mma_16bit<KV8>(o[j + 1], pa, b[2], b[3]);
        }
    }
    if constexpr (KV8) {
#pragma unroll
        for (int j = 0; j < NT_O; j++) o[j][0] *= vref.unit(), o[j][1] *= vref.unit();
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    // fold the warps: partials [warp][head][DH], then (max in natural units, sum) per (warp, head)
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the K/V tiles: their space takes the partials
    float* s_acc = reinterpret_cast<float*>(sKV);
    float* s_m = s_acc + C::WARPS * G * DH;
    float* s_l = s_m + C::WARPS * G;
    const int g = lane / 4;
    if (math && g < G) {
#pragma unroll
        for (int j = 0; j < NT_O; j++)
            *reinterpret_cast<float2*>(s_acc + (warp * G + g) * DH + j * 8 + 2 * (lane % 4)) = make_float2(o[j][0], o[j][1]);
        if (lane % 4 == 0) s_m[warp * G + g] = m == -INFINITY ? -INFINITY : m * rsqrtf((float)DH), s_l[warp * G + g] = l;
    }
    __syncthreads();
    for (int gd = threadIdx.x; gd < G * DH; gd += C::THREADS) {
        const int hg = gd / DH, d = gd % DH;
        float M = has_new ? s_new_m[hg] : -INFINITY;
        for (int w = 0; w < C::WARPS; w++) M = fmaxf(M, s_m[w * G + hg]);
        float L = 0, acc = 0;
        if (has_new) {
            const float f = __expf(s_new_m[hg] - M);
            L = s_new_l[hg] * f, acc = s_new_acc[hg * DH + d] * f;
        }
        for (int w = 0; w < C::WARPS; w++) {
            const float mw = s_m[w * G + hg];
            if (mw == -INFINITY) continue;  // a warp that saw no position
            const float f = __expf(mw - M);
            L += s_l[w * G + hg] * f;
            acc += s_acc[(w * G + hg) * DH + d] * f;
        }
        const int64_t part = part0 + (int64_t)hg * p.n_splits;
        p.part_o[part * DH + d] = acc;
        if (d == 0) p.part_ml[part * 2] = M, p.part_ml[part * 2 + 1] = L;
    }
}

// Partials per thread held in registers; the rest are read after the weights' barrier. (A 2K context has 33
// slices, the step's own position making 2049+: all 64 in registers measured slightly slower, docs/PERF.md.)
constexpr int k_combine_regs = 32;

// Merges the splits of one (token, head): the (max, sum) pairs go through shared memory once, then each
// thread (one per dimension) reads its partials with independent loads.
__global__ void __launch_bounds__(DH) combine_kernel(const attn_params p) {
    __shared__ float s_f[k_max_splits];
    __shared__ float s_inv_l;
    pdl_trigger();
    const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    const bool skip = row_in_prefill(p, t);  // (the batch is fixed, n_past from earlier steps: before the wait)
    dseq s;
    const int len = skip ? 0 : position_of(p, t, &s) + 1;
    pdl_wait();  // the partials come from split
    if (skip) return;
    // the gate (from the projections, done) requested now: after the reduction's barrier it was one more round trip
    const float gate = p.qg[(int64_t)t * p.Hq * 2 * DH + h * 2 * DH + DH + d];
    const int S = split_len(len, p.n_splits), n_valid = (len + S - 1) / S;
    const int64_t part0 = ((int64_t)t * p.Hq + h) * p.n_splits;
    // the first k_combine_regs partials of this dimension requested with the (max, sum) pairs, before their
    // weights are known: one L2 round trip for both, where the partials waited for the weights' barrier
    float po[k_combine_regs];
#pragma unroll
    for (int i = 0; i < k_combine_regs; i++) po[i] = i < n_valid ? p.part_o[(part0 + i) * DH + d] : 0.0f;
    if (threadIdx.x < 32) {
        float M = -INFINITY;
        for (int sp = threadIdx.x; sp < n_valid; sp += 32) M = fmaxf(M, p.part_ml[(part0 + sp) * 2]);
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        float L = 0;
        for (int sp = threadIdx.x; sp < n_valid; sp += 32) {
            const float f = __expf(p.part_ml[(part0 + sp) * 2] - M);
            s_f[sp] = f;
            L += p.part_ml[(part0 + sp) * 2 + 1] * f;
        }
        L = warp_sum(L);
        if (threadIdx.x == 0) s_inv_l = 1.0f / L;
    }
    __syncthreads();
    float o = 0;
#pragma unroll
    for (int i = 0; i < k_combine_regs; i++)
        if (i < n_valid) o += po[i] * s_f[i];
#pragma unroll 8
    for (int sp = k_combine_regs; sp < n_valid; sp++) o += p.part_o[(part0 + sp) * DH + d] * s_f[sp];
    p.out[((int64_t)t * p.Hq + h) * DH + d] = o * s_inv_l * sigmoidf_(gate);
}

}  // namespace

namespace {
std::atomic<int> g_forced_splits{0};
}  // namespace

int attention_splits(int rows, int kv_heads) {
    const int f = g_forced_splits.load();
    if (f > 0) return f;
    // A split block takes 148-220 KB of shared memory: one per SM. A batch's rows share the SMs, so each takes
    // fewer, longer slices: more key tiles per block instead of further waves of one-tile blocks, each wave paying
    // the PDL wait, Q staging, fold and partial stores again (batch 16 at 2K: 64 slices of one tile per
    // (row, KV head) would be 2048 blocks, 16 waves).
    // note: at most 64 for one row: 256 for long contexts measured slower (more partials to write and fold, no
    // gain in streaming; docs/PERF.md)
    constexpr int k_most = 64;
    const int sms = sm_count();
    return std::clamp(sms / std::max(1, rows * kv_heads), 1, k_most);
}
void force_attention_splits(int n) {
    TANSY_CHECK(n >= 0 && n <= k_max_splits, "attention splits %d (0..%d)", n, k_max_splits);
    g_forced_splits = n;
}

void attention_prep(const attn_params& p, cudaStream_t stream) {
    TANSY_CHECK(p.dh == DH, "cuda attention supports head_dim %d, got %d", DH, p.dh);
    TANSY_CHECK(p.rope_dim % 2 == 0 && p.rope_dim <= DH, "rope_dim %d", p.rope_dim);
    if (p.T == 0) return;
    const dim3 grid((unsigned)p.T, (unsigned)((p.Hq + p.Hkv + k_warps - 1) / k_warps));
    launch_pdl(prep_kernel, grid, dim3(k_warps * 32), 0, stream, p);
    CUDA_CHECK_LAUNCH();
}

// Key tiles of 64 (4 warps) where the shared memory allows (bf16: 148 KB at head_dim 256; FP8: 212 KB), else 32.
template <int G, bool KV8>
void launch_split(const attn_params& p, cudaStream_t stream) {
    const dim3 grid((unsigned)p.T, (unsigned)p.Hkv, (unsigned)p.n_splits);
    if (split_cfg<G, 64, KV8>::SMEM <= max_dynamic_smem()) {
        using C = split_cfg<G, 64, KV8>;
        allow_dynamic_smem<split_kernel<G, 64, KV8>>(C::SMEM);
        launch_pdl(split_kernel<G, 64, KV8>, grid, dim3(C::THREADS), C::SMEM, stream, p);
    } else {
        using C = split_cfg<G, 32, KV8>;
        allow_dynamic_smem<split_kernel<G, 32, KV8>>(C::SMEM);
        launch_pdl(split_kernel<G, 32, KV8>, grid, dim3(C::THREADS), C::SMEM, stream, p);
    }
}

template <int G>
void launch_split(const attn_params& p, cudaStream_t stream) {
    if (p.shape.kv8)
        launch_split<G, true>(p, stream);
    else
        launch_split<G, false>(p, stream);
}

void attention_decode(const attn_params& p, cudaStream_t stream) {
    if (p.T == 0 || (p.spans && p.min_span >= k_attn_prefill_min_rows)) return;  // no short span: nothing to do
    TANSY_CHECK(p.n_splits <= k_max_splits, "cuda attention: %d splits", p.n_splits);
    switch (p.Hq / p.Hkv) {
        case 1: launch_split<1>(p, stream); break;
        case 2: launch_split<2>(p, stream); break;
        case 4: launch_split<4>(p, stream); break;
        case 8: launch_split<8>(p, stream); break;
        default: TANSY_ABORT("cuda attention: %d query heads per KV head is not supported (1, 2, 4, 8)", p.Hq / p.Hkv);
    }
    CUDA_CHECK_LAUNCH();
    launch_pdl(combine_kernel, dim3((unsigned)p.T, (unsigned)p.Hq), dim3(DH), 0, stream, p);
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
