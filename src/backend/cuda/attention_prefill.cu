// Causal flash attention for the rows of long spans (prompt processing), FlashAttention-2 style, on tensor cores.
// One CTA per (tile of 64 query rows of one span, HPC query heads of one KV group); each warp owns one head's 16
// rows. S = Q K^T and O += P V on mma.sync m16n8k16 (bf16 in, fp32 accumulate; V through ldmatrix.trans), online
// softmax in fp32 registers (exp2, the 1/sqrt(dh) scale folded into log2(e)), P rounded to bf16 as the A operand
// of P V (as the reference does, MODEL.md §3). Key tiles walk from position 0 to the tile's last position, double
// buffered by cp.async (one barrier per tile); causal masking only on the tiles that reach past the tile's first
// position. Epilogue: O / l * sigmoid(gate), the combine kernel's arithmetic. A CTA per query-head pair, not per
// KV group: 16 rows x 256 of O is already 128 registers per thread.
// Why fast: at long prompts the kernel is bound by L2 traffic, not the tensor cores, so HPC = 2 heads share each
// K/V tile (twice the FLOPs per byte loaded); the G/HPC CTAs of a group read the same tiles at the same pace
// (head is the fastest grid index): L2 hits. smem at dh 256: 198 KB, one CTA per SM on sm_90; smaller devices or
// an odd group take HPC = 1 and/or key tiles of 32 (the largest that fits; tests force each).
#include <atomic>
#include <cmath>
#include <cstdint>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/common.cuh"
#include "backend/cuda/attention_tile.cuh"
#include "backend/cuda/mma.cuh"

namespace tansy::cuda {

namespace {

std::atomic<int> g_forced_hpc{0}, g_forced_bn{0};  // force_attention_prefill_variant

constexpr int BLOCK_M = 64;  // query rows per head and CTA: 4 warps x 16 (the m of one mma)

template <int DH, int HPC, int BN, bool KV8>
struct prefill_cfg {
    static constexpr int WARPS = 4 * HPC, THREADS = WARPS * 32;
    // note: rows padded by 8 bf16 (16 bytes): a row is then 33 16-byte units apart from the next, so the 8
    // row addresses of one ldmatrix phase fall in 8 different bank groups (no conflicts, no swizzle needed)
    static constexpr int LD = DH + 8;
    static constexpr int Q_ROWS = HPC * BLOCK_M;
    using tiles = kv_tiles<KV8, DH, THREADS, BN, 2>;
    // sQ [HPC*64 rows] | the K/V tiles (bf16: stage 0: sK, sV [BN rows each] | stage 1: sK, sV)
    static constexpr size_t SMEM = (size_t)Q_ROWS * LD * sizeof(uint16_t) + tiles::SMEM;
};

// grid (Hq / HPC, tiles): blockIdx.y counts the 64-row tiles of the long spans (span by span; the grid is an
// upper bound and CTAs past the last tile exit). Each (span, tile) is found by walking p.spans on the device, so
// a captured graph stays valid and nothing is uploaded per call.
template <int DH, int HPC, int BN, bool KV8>
__global__ void __launch_bounds__(prefill_cfg<DH, HPC, BN, KV8>::THREADS, 1) prefill_kernel(const attn_params p) {
    using C = prefill_cfg<DH, HPC, BN, KV8>;
    constexpr int LD = C::LD, NT_S = BN / 8, NT_O = DH / 8;  // n-tiles of 8 in S and in O
    extern __shared__ __align__(16) uint16_t smem[];
    uint16_t* sQ = smem;                    // [HPC * BLOCK_M][LD]: head h0's rows, then h0 + 1's
    uint16_t* sKV = sQ + C::Q_ROWS * LD;    // the K/V tiles (C::tiles)
    pdl_trigger();  // the o_proj GEMV waits (griddepcontrol.wait) for this grid to finish anyway

    // 1. this CTA's span and tile; the heaviest (last) tile of a span gets the lowest index, so it starts first
    const int h0 = blockIdx.x * HPC, kvh = h0 / (p.Hq / p.Hkv);
    int tile = blockIdx.y, si = -1, n = 0, row0 = 0;
    for (int s = 0; s < p.n_spans; s++) {
        const dspan sp = p.spans[s];
        if (sp.n < k_attn_prefill_min_rows) continue;  // attention_decode's rows
        const int nt = (sp.n + BLOCK_M - 1) / BLOCK_M;
        if (tile < nt) {
            si = s, n = sp.n, row0 = sp.row0, tile = nt - 1 - tile;
            break;
        }
        tile -= nt;
    }
    if (si < 0) return;
    const dseq sq = p.seqs[si];
    const int r0 = tile * BLOCK_M;                    // the tile's first row within the span
    const int n_rows = min(BLOCK_M, n - r0);          // rows of the tile that exist
    const int pos_min = sq.meta[0] + r0;              // n_past before this step + offset
    const int pos_max = pos_min + n_rows - 1;
    const int n_keys = pos_max + 1;                   // causal: no row of the tile sees past pos_max
    typename C::tiles kv =
        cache_tiles<typename C::tiles>(sq, p.shape, p.slot, kvh, reinterpret_cast<char*>(sKV), 0, n_keys);
    const int n_tiles = kv.n_tiles;

    // 2. the first K/V tile in flight while Q (the HPC heads' rows) is converted
    kv.start();
    {
        const int64_t ldq = (int64_t)p.Hq * DH;
        const float* qsrc = p.q + (int64_t)(row0 + r0) * ldq + (int64_t)h0 * DH;
        static_assert(C::Q_ROWS * DH / 4 % C::THREADS == 0, "whole float4s per thread");
#pragma unroll 8
        for (int it = 0; it < C::Q_ROWS * DH / 4 / C::THREADS; it++) {
            const int c = it * C::THREADS + threadIdx.x;
            const int qrow = c / (DH / 4), d = (c % (DH / 4)) * 4;  // qrow = head-in-CTA * 64 + row
            const int hh = qrow / BLOCK_M, i = qrow % BLOCK_M;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // rows past the span: zeros, never stored
            if (i < n_rows) v = *reinterpret_cast<const float4*>(qsrc + i * ldq + hh * DH + d);
            *reinterpret_cast<uint2*>(sQ + qrow * LD + d) = make_uint2(pack_16bit<KV8>(v.x, v.y), pack_16bit<KV8>(v.z, v.w));
        }
    }

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = h0 + warp / 4;                 // this warp's query head
    const int qr = (warp % 4) * 16 + lane / 4;   // this thread's rows of the tile: qr and qr + 8
    // positions of those rows; a row past the span takes the last real row's, which keeps it finite
    const int pos_r[2] = {pos_min + min(qr, n_rows - 1), pos_min + min(qr + 8, n_rows - 1)};
    // softmax in base 2: p = 2^((s - m) * scale * log2 e), scale = 1/sqrt(dh) (the split kernel's scaling of q)
    const float sl2 = rsqrtf((float)DH) * 1.4426950408889634f;

    float o[NT_O][4];
#pragma unroll
    for (int j = 0; j < NT_O; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // running max (raw score) and this thread's sum
    v_reference vref;                                           // KV8: O's units

    // ldmatrix lane addresses. A (Q, 16x16 per k-step): matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15) in
    // a0..a3 order, so lane l points at row l%16, column 8*(l/16). B (K rows = keys, non-trans): matrices
    // (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15) = b0, b1 of n-tile j and
    // b0, b1 of n-tile j+1: key l%8 + 8*(l/16), d 8*((l/8)%2). V (rows = keys, .trans): matrices (keys 0-7,
    // d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15): key l%16, d 8*(l/16).
    const uint16_t* q_lane = sQ + (warp * 16 + lane % 16) * LD + (lane / 16) * 8;
    const int k_off = (lane % 8 + (lane / 16) * 8) * LD + ((lane / 8) % 2) * 8;
    const int v_off = BN * LD + (lane % 16) * LD + (lane / 16) * 8;

    for (int kt = 0; kt < n_tiles; kt++) {
        const int k0 = kt * BN;
        const uint16_t* st = kv.next(kt);  // tile kt (and Q) visible to all; tile kt+1 in flight during all of kt

        // 3. S = Q K^T (raw scores, 16 x BN per warp)
        float s[NT_S][4];
#pragma unroll
        for (int j = 0; j < NT_S; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < DH / 16; ks++) {
            uint32_t a[4];
            ldmatrix_x4(a, q_lane + ks * 16);
#pragma unroll
            for (int j = 0; j < NT_S; j += 2) {
                uint32_t b[4];
                ldmatrix_x4(b, st + k_off + j * 8 * LD + ks * 16);
                mma_16bit<KV8>(s[j], a, b[0], b[1]);
                mma_16bit<KV8>(s[j + 1], a, b[2], b[3]);
            }
        }
        if constexpr (KV8) {  // an FP8 tile's K is unscaled: times each key's scale
#pragma unroll
            for (int j = 0; j < NT_S; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[j][e] *= kv.k_scale[j * 8 + 2 * (lane % 4) + (e & 1)];
        }

        // 4. causal mask, only where the tile reaches past the first row's position: key > position -> -inf
        //    (key 0 is in the first tile and visible to every row, so m is finite from the first tile on)
        if (k0 + BN - 1 > pos_min) {
#pragma unroll
            for (int j = 0; j < NT_S; j++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (k0 + j * 8 + 2 * (lane % 4) + (e & 1) > pos_r[e / 2]) s[j][e] = -INFINITY;
        }

        // 5. online softmax: new row max over the quad (the 4 lanes holding a row), rescale O and l, P = 2^...
        float corr[2], msc[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = m[r];
#pragma unroll
            for (int j = 0; j < NT_S; j++) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            corr[r] = exp2f((m[r] - mx) * sl2);  // 0 on the first tile (m = -inf)
            m[r] = mx;
            msc[r] = mx * sl2;
        }
        // P as the A operand of P V: k-step c (keys 16c..16c+15) is S n-tiles 2c (a0, a1) and 2c+1 (a2, a3);
        // with an FP8 tile, P times the tile's V scale over O's reference (v_reference)
        float oc = 1.0f, pf = 1.0f;
        if constexpr (KV8) pf = vref.enter(kv.v_scale, &oc);
        uint32_t pa[BN / 16][4];
        float rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < NT_S; j++) {
            const float p0 = exp2f(fmaf(s[j][0], sl2, -msc[0])), p1 = exp2f(fmaf(s[j][1], sl2, -msc[0]));
            const float p2 = exp2f(fmaf(s[j][2], sl2, -msc[1])), p3 = exp2f(fmaf(s[j][3], sl2, -msc[1]));
            rs[0] += p0 + p1, rs[1] += p2 + p3;
            pa[j / 2][(j % 2) * 2] = pack_16bit<KV8>(p0 * pf, p1 * pf);
            pa[j / 2][(j % 2) * 2 + 1] = pack_16bit<KV8>(p2 * pf, p3 * pf);
        }
        l[0] = l[0] * corr[0] + rs[0], l[1] = l[1] * corr[1] + rs[1];
        const float oc0 = corr[0] * oc, oc1 = corr[1] * oc;
#pragma unroll
        for (int j = 0; j < NT_O; j++) o[j][0] *= oc0, o[j][1] *= oc0, o[j][2] *= oc1, o[j][3] *= oc1;

        // 6. O += P V
#pragma unroll
        for (int c = 0; c < BN / 16; c++) {
#pragma unroll
            for (int j = 0; j < NT_O; j += 2) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, st + v_off + c * 16 * LD + j * 8);
                mma_16bit<KV8>(o[j], pa[c], b[0], b[1]);
                mma_16bit<KV8>(o[j + 1], pa[c], b[2], b[3]);
            }
        }
    }

    // 7. out = O / l * sigmoid(gate) (combine_kernel's arithmetic), rows of the span only
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int i = qr + 8 * r;
        if (i >= n_rows) continue;
        const int64_t t = row0 + r0 + i;
        const float inv_l = (KV8 ? vref.unit() : 1.0f) / l[r];  // KV8: O is in units of vref.unit()
        const float* gate = p.qg + t * p.Hq * 2 * DH + (int64_t)h * 2 * DH + DH;
        float* dst = p.out + (t * p.Hq + h) * DH;
#pragma unroll
        for (int j = 0; j < NT_O; j++) {
            const int d = j * 8 + 2 * (lane % 4);
            const float2 g = *reinterpret_cast<const float2*>(gate + d);
            *reinterpret_cast<float2*>(dst + d) =
                make_float2(o[j][2 * r] * inv_l * sigmoidf_(g.x), o[j][2 * r + 1] * inv_l * sigmoidf_(g.y));
        }
    }
}

template <int DH, int HPC, int BN, bool KV8>
void launch_prefill(const attn_params& p, cudaStream_t stream) {
    using C = prefill_cfg<DH, HPC, BN, KV8>;
    allow_dynamic_smem<prefill_kernel<DH, HPC, BN, KV8>>(C::SMEM);
    // upper bound on the tiles of the long spans: sum of ceil(n/64) <= ceil(T/64) + n_spans
    const int64_t tiles = ((int64_t)p.T + BLOCK_M - 1) / BLOCK_M + p.n_spans;
    TANSY_CHECK(tiles <= 65535, "cuda attention prefill: %lld row tiles", (long long)tiles);
    prefill_kernel<DH, HPC, BN, KV8><<<dim3((unsigned)(p.Hq / HPC), (unsigned)tiles), C::THREADS, C::SMEM, stream>>>(p);
}

// The variant for these params: forced ones as given, else the largest (heads per CTA first, then key tile)
// that divides the query-head group and fits the device's shared memory.
template <int DH, bool KV8>
void launch_variant(const attn_params& p, cudaStream_t stream) {
    const int group = p.Hq / p.Hkv;
    const int hpc = g_forced_hpc.load(), bn = g_forced_bn.load();
    TANSY_CHECK(hpc == 0 || hpc == 1 || (hpc == 2 && group % 2 == 0),
                "cuda attention prefill: %d heads per CTA with %d query heads per KV head", hpc, group);
    TANSY_CHECK(bn == 0 || bn == 32 || bn == 64, "cuda attention prefill: key tile %d (32 or 64)", bn);
    const size_t have = max_dynamic_smem();
    auto fits = [&](int hh, int nn, size_t smem) {
        return (hpc == 0 || hpc == hh) && (bn == 0 || bn == nn) && (hh == 1 || group % 2 == 0) && smem <= have;
    };
    if (fits(2, 64, prefill_cfg<DH, 2, 64, KV8>::SMEM)) return launch_prefill<DH, 2, 64, KV8>(p, stream);
    if (fits(2, 32, prefill_cfg<DH, 2, 32, KV8>::SMEM)) return launch_prefill<DH, 2, 32, KV8>(p, stream);
    if (fits(1, 64, prefill_cfg<DH, 1, 64, KV8>::SMEM)) return launch_prefill<DH, 1, 64, KV8>(p, stream);
    if (fits(1, 32, prefill_cfg<DH, 1, 32, KV8>::SMEM)) return launch_prefill<DH, 1, 32, KV8>(p, stream);
    TANSY_ABORT("cuda attention prefill: head_dim %d needs %zu bytes of shared memory per block, the device allows %zu",
                DH, prefill_cfg<DH, 1, 32, KV8>::SMEM, have);
}

}  // namespace

void force_attention_prefill_variant(int heads_per_cta, int block_n) {
    g_forced_hpc = heads_per_cta, g_forced_bn = block_n;
}

void attention_prefill(const attn_params& p, cudaStream_t stream) {
    if (p.T == 0 || !p.spans || p.max_span < k_attn_prefill_min_rows) return;  // no long span
    TANSY_CHECK(p.Hkv > 0 && p.Hq % p.Hkv == 0, "cuda attention prefill: %d query heads over %d KV heads", p.Hq, p.Hkv);
    switch (p.dh) {
        case 256:
            if (p.shape.kv8)
                launch_variant<256, true>(p, stream);
            else
                launch_variant<256, false>(p, stream);
            break;
        default: TANSY_ABORT("cuda attention prefill: head_dim %d is not supported (256)", p.dh);
    }
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
