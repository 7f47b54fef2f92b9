// Attention kernels (head_dim 256 = 8 values per lane).
// v1: prep is a warp per head (norm, RoPE through shared memory, bf16 KV append); the split kernel gives each
//     block a slice of the context for one KV head and all G query heads that read it (GQA packing: each K/V
//     row is loaded once for G heads), warps stride over positions with an online softmax, and the block folds
//     its warps together; the combine kernel merges the splits and applies the sigmoid output gate.
//     H200, batch 1, 2K context: split 42 us, combine 15 us per layer.
// v2: split gave each of the G warps one query head over the block's whole slice: 2K context faster, but at
//     128K each warp walked 2048 positions alone (17 ms/token). Combine stages the split weights in shared
//     memory so the partial reads are independent (kept).
// v3: back to warps striding over positions with all G heads each, the warps folded through shared memory
//     without atomics; slices of at least 32 positions, at most 64 per KV head.
//     (Tried: up to 256 slices for long contexts: 128K decode 215 -> 200 tok/s, reverted.)
// The split and combine kernels skip the rows of spans of k_attn_prefill_min_rows or more: attention_prefill
// (attention_prefill.cu) does those with tensor cores.
#include <cfloat>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/common.cuh"

namespace tansy::cuda {

namespace {

constexpr int DH = 256, DPL = DH / 32, k_warps = 8, k_max_splits = 256;
constexpr int k_min_split = 32;  // positions: below this a slice is not worth a block

__device__ __forceinline__ int position_of(const attn_params& p, int t, dseq* s_out) {
    const drow r = p.rows[t];
    *s_out = p.seqs[r.seq];
    return s_out->meta[0] + r.offset;
}

// Rows of long spans belong to attention_prefill (attention.cuh); the decode kernels leave them alone.
__device__ __forceinline__ bool row_in_prefill(const attn_params& p, int t) {
    return p.spans && p.spans[p.rows[t].seq].n >= k_attn_prefill_min_rows;
}

__global__ void __launch_bounds__(k_warps * 32) prep_kernel(const attn_params p) {
    __shared__ float sh[k_warps][DH];
    const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int hi = blockIdx.y * k_warps + warp;
    pdl_trigger();
    pdl_wait();  // q/k/v come from the projection kernel
    if (hi >= p.Hq + p.Hkv) return;
    dseq s;
    const int pos = position_of(p, t, &s);
    const bool is_q = hi < p.Hq;
    const int kh = hi - p.Hq;
    const float* src = is_q ? p.qg + (int64_t)t * p.Hq * 2 * DH + hi * 2 * DH : p.k + ((int64_t)t * p.Hkv + kh) * DH;
    const float* nw = is_q ? p.q_norm : p.k_norm;
    float v[DPL];
    float ss = 0;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
        v[i] = src[lane * DPL + i];
        ss += v[i] * v[i];
    }
    const float inv = rsqrtf(warp_sum(ss) / (float)DH + p.eps);
#pragma unroll
    for (int i = 0; i < DPL; i++) sh[warp][lane * DPL + i] = v[i] = v[i] * inv * nw[lane * DPL + i];
    __syncwarp();
    const int half = p.rope_dim / 2;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
        const int d = lane * DPL + i;
        if (d >= p.rope_dim) continue;
        const int j = d < half ? d : d - half;
        // angle in double: fp32 pos * freq loses radians at long context (MODEL.md §3 numerics)
        const double ang = (double)pos * p.inv_freq[j];
        const float r = (float)(ang - 6.283185307179586 * rint(ang * 0.15915494309189535));  // into [-pi, pi]
        float sn, cs;
        sincosf(r, &sn, &cs);
        v[i] = d < half ? sh[warp][d] * cs - sh[warp][d + half] * sn : sh[warp][d] * cs + sh[warp][d - half] * sn;
    }
    if (is_q) {
#pragma unroll
        for (int i = 0; i < DPL; i++) p.q[((int64_t)t * p.Hq + hi) * DH + lane * DPL + i] = v[i];
    } else {
        uint16_t* K = kv_k(s, p.shape, p.slot) + (int64_t)pos * p.shape.kvd + kh * DH;
        uint16_t* V = kv_v(s, p.shape, p.slot) + (int64_t)pos * p.shape.kvd + kh * DH;
        const float* vs = p.v + ((int64_t)t * p.Hkv + kh) * DH;
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            K[lane * DPL + i] = float_to_bf16_bits(v[i]);
            V[lane * DPL + i] = float_to_bf16_bits(vs[lane * DPL + i]);
        }
    }
}

__device__ __forceinline__ void bf16x8_to_float(const uint4& u, float* f) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        f[2 * k] = __uint_as_float(w[k] << 16);
        f[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
}

// Split slice length for a context of len positions: at least k_min_split positions per block, at most
// n_splits blocks (the grid's static z extent); the split and combine kernels must agree on it.
__device__ __forceinline__ int split_len(int len, int n_splits) {
    return max(k_min_split, (len + n_splits - 1) / n_splits);
}

// One block per (token, KV head, slice of the context). The 8 warps stride over the slice's positions and each
// loads a K/V row once for all G query heads of the group (GQA packing), keeping G online softmaxes; the block
// then folds its warps through shared memory (no atomics) into one partial per head.
template <int G>
__global__ void __launch_bounds__(k_warps * 32) split_kernel(const attn_params p) {
    extern __shared__ float smem[];
    float* s_acc = smem;                            // [k_warps][G][DH]
    float* s_m = smem + k_warps * G * DH;           // [k_warps][G]
    float* s_l = s_m + k_warps * G;                 // [k_warps][G]
    const int t = blockIdx.x, kh = blockIdx.y, sp = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    pdl_trigger();
    pdl_wait();  // q and this token's K/V come from prep
    if (row_in_prefill(p, t)) return;
    dseq s;
    const int len = position_of(p, t, &s) + 1;
    const int S = split_len(len, p.n_splits);
    const int start = sp * S, end = min(len, start + S);
    const int64_t part0 = ((int64_t)t * p.Hq + kh * G) * p.n_splits + sp;  // + g * n_splits
    if (start >= end) return;  // the combine kernel only reads the slices that exist
    float q[G][DPL], acc[G][DPL], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        const float* qs = p.q + ((int64_t)t * p.Hq + kh * G + g) * DH + lane * DPL;
#pragma unroll
        for (int i = 0; i < DPL; i++) q[g][i] = qs[i] * rsqrtf((float)DH), acc[g][i] = 0.0f;
        m[g] = -INFINITY, l[g] = 0.0f;
    }
    const uint16_t* K = kv_k(s, p.shape, p.slot) + kh * DH + lane * DPL;
    const uint16_t* V = kv_v(s, p.shape, p.slot) + kh * DH + lane * DPL;
    constexpr int UNROLL = 4;  // positions per warp whose K/V loads are in flight together
    for (int pos0 = start + warp; pos0 < end; pos0 += k_warps * UNROLL) {
        uint4 kr[UNROLL], vr[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int pos = min(pos0 + u * k_warps, end - 1);
            kr[u] = *reinterpret_cast<const uint4*>(K + (int64_t)pos * p.shape.kvd);
            vr[u] = *reinterpret_cast<const uint4*>(V + (int64_t)pos * p.shape.kvd);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (pos0 + u * k_warps >= end) break;
            float kf[DPL], vf[DPL];
            bf16x8_to_float(kr[u], kf);
            bf16x8_to_float(vr[u], vf);
#pragma unroll
            for (int g = 0; g < G; g++) {
                float sc = 0;
#pragma unroll
                for (int i = 0; i < DPL; i++) sc = fmaf(q[g][i], kf[i], sc);
                sc = warp_sum(sc);
                const float mn = fmaxf(m[g], sc), corr = __expf(m[g] - mn), e = __expf(sc - mn);
                l[g] = l[g] * corr + e;
#pragma unroll
                for (int i = 0; i < DPL; i++) acc[g][i] = acc[g][i] * corr + e * vf[i];
                m[g] = mn;
            }
        }
    }
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int i = 0; i < DPL; i++) s_acc[(warp * G + g) * DH + lane * DPL + i] = acc[g][i];
        if (lane == 0) s_m[warp * G + g] = m[g], s_l[warp * G + g] = l[g];
    }
    __syncthreads();
    // thread (g, d) pairs: fold the warps (a warp that saw no position has m = -inf and contributes 0)
    for (int gd = threadIdx.x; gd < G * DH; gd += blockDim.x) {
        const int g = gd / DH, d = gd % DH;
        float M = -INFINITY;
        for (int w = 0; w < k_warps; w++) M = fmaxf(M, s_m[w * G + g]);
        float L = 0, o = 0;
        for (int w = 0; w < k_warps; w++) {
            const float mw = s_m[w * G + g];
            if (mw == -INFINITY) continue;
            const float f = __expf(mw - M);
            L += s_l[w * G + g] * f;
            o += s_acc[(w * G + g) * DH + d] * f;
        }
        const int64_t part = part0 + (int64_t)g * p.n_splits;
        p.part_o[part * DH + d] = o;
        if (d == 0) p.part_ml[part * 2] = M, p.part_ml[part * 2 + 1] = L;
    }
}

// Merges the splits of one (token, head): the (max, sum) pairs go through shared memory once, then each
// thread (one per dimension) reads its partials with independent loads.
__global__ void __launch_bounds__(DH) combine_kernel(const attn_params p) {
    __shared__ float s_f[k_max_splits];
    __shared__ float s_inv_l;
    pdl_trigger();
    pdl_wait();  // the partials come from split
    const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (row_in_prefill(p, t)) return;
    dseq s;
    const int len = position_of(p, t, &s) + 1;
    const int S = split_len(len, p.n_splits), n_valid = (len + S - 1) / S;
    const int64_t part0 = ((int64_t)t * p.Hq + h) * p.n_splits;
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
#pragma unroll 8
    for (int sp = 0; sp < n_valid; sp++) o += p.part_o[(part0 + sp) * DH + d] * s_f[sp];
    const float gate = p.qg[(int64_t)t * p.Hq * 2 * DH + h * 2 * DH + DH + d];
    p.out[((int64_t)t * p.Hq + h) * DH + d] = o * s_inv_l * sigmoidf_(gate);
}

}  // namespace

void attention_prep(const attn_params& p, cudaStream_t stream) {
    TANSY_CHECK(p.dh == DH, "cuda attention supports head_dim %d, got %d", DH, p.dh);
    TANSY_CHECK(p.rope_dim % 2 == 0 && p.rope_dim <= DH, "rope_dim %d", p.rope_dim);
    if (p.T == 0) return;
    const dim3 grid((unsigned)p.T, (unsigned)((p.Hq + p.Hkv + k_warps - 1) / k_warps));
    launch_pdl(prep_kernel, grid, dim3(k_warps * 32), 0, stream, p);
    CUDA_CHECK_LAUNCH();
}

template <int G>
void launch_split(const attn_params& p, cudaStream_t stream) {
    const size_t smem = (size_t)(k_warps * G * DH + 2 * k_warps * G) * sizeof(float);
    allow_dynamic_smem<split_kernel<G>>(smem);
    launch_pdl(split_kernel<G>, dim3((unsigned)p.T, (unsigned)p.Hkv, (unsigned)p.n_splits), dim3(k_warps * 32), smem,
               stream, p);
}

void attention_decode(const attn_params& p, cudaStream_t stream) {
    if (p.T == 0 || (p.spans && p.min_span >= k_attn_prefill_min_rows)) return;  // no short span: nothing to do
    TANSY_CHECK(p.n_splits <= k_max_splits, "cuda attention: %d splits", p.n_splits);
    switch (p.Hq / p.Hkv) {
        case 1: launch_split<1>(p, stream); break;
        case 2: launch_split<2>(p, stream); break;
        case 4: launch_split<4>(p, stream); break;
        case 8: launch_split<8>(p, stream); break;
        default: TANSY_ABORT("cuda attention: %d query heads per KV head is not supported", p.Hq / p.Hkv);
    }
    CUDA_CHECK_LAUNCH();
    launch_pdl(combine_kernel, dim3((unsigned)p.T, (unsigned)p.Hq), dim3(DH), 0, stream, p);
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
