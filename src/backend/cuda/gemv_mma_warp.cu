// GEMV on tensor cores per warp: 2..32 input rows (a decode batch: up to k_mma_warp_max_tokens where their x fits
// in shared memory, e.g. 32 rows at K = 2048, 16 at K = 4096) of 4-bit rows, mma.m16n8k16 with the input rows as
// B columns. A warp takes (16-row block, k-chunk) items and loads its A fragments straight from global memory into
// registers a step ahead of the one it multiplies (the first two before the PDL wait: weights only); the block's
// only barriers are the staging's and, with several k-chunks, the fold's. Faster than the ring form (gemv_mma.cu)
// for a batch: no tile barriers or fold per tile, and each weight fragment serves up to 32 rows.
#include <algorithm>

#include "backend/cuda/gemv_family.cuh"
#include "backend/cuda/mma_dot.cuh"

namespace tansy::cuda::gemv_impl {

namespace {

// The ring kernel (gemv_mma.cu) spends a 16-row tile's time in its barriers and fold, and at K = 4096 16 rows' x does not fit beside its
// ring (two 8-row launches). Here a warp takes (16-row block, k-chunk) items and loads
// its A fragments straight from global memory into registers, a step of k_mw_step 64-column blocks ahead of the
// one it multiplies (the first two before the PDL wait: weights only); the block's barriers are the staging's
// and, with several k-chunks, the one before the fold. Lane (g, c) loads words 2c, 2c+1 of a 64-column block of
// rows g and g + 8 (8 bytes each: a quad reads each row's 32 bytes, one sector); unit j of the block is its
// words 2c + j, so that a unit never mixes quantisation groups (group % 64 == 0), and x is staged with each
// block's words in the order 0 2 4 6 1 3 5 7 (stage_x_pairs), where a quad's B fragments lie side by side.
constexpr int k_mw_threads = 512, k_mw_step = 4;

// The T rows of x for gemv_mma_warp_kernel: row t at s_hi + t * xs (fp16, rounded as the fast GEMM's operands;
// within a word the values permuted as stage_x_mma's, each 64-column block's words in the order 0 2 4 6 1 3 5 7)
// and the sums of each 64-column block's rounded values at s_sum[32 b + t]; x * s_inv[t] * nw with nw. The loads
// of 8 rows are in flight together (not one L2 round trip per row, as stage_x_mma). K % 64 == 0. No barrier.
__device__ __forceinline__ void stage_x_pairs(uint16_t* s_hi, int64_t xs, float* s_sum, const float* x, int64_t ldx,
                                              int T, const float* nw, const float* s_inv, int64_t K) {
    constexpr int RT = 8;
    const int lane = threadIdx.x % 32;
    for (int64_t k0 = 0; k0 < K; k0 += 4 * (int64_t)blockDim.x) {
        const int64_t k = k0 + 4 * threadIdx.x;  // (a half warp's 16 lanes: one whole 64-column block, or none)
        const bool in = k < K;
        const float4 w = in && nw ? *reinterpret_cast<const float4*>(nw + k) : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
        for (int t0 = 0; t0 < T; t0 += RT) {
            float4 v[RT];
#pragma unroll
            for (int u = 0; u < RT; u++)
                v[u] = in && t0 + u < T ? *reinterpret_cast<const float4*>(x + (t0 + u) * ldx + k) : make_float4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < RT; u++) {
                const int t = t0 + u;
                if (t >= T) break;  // (uniform)
                const float inv = nw ? s_inv[t] : 1.0f;
                const float f[4] = {v[u].x * (inv * w.x), v[u].y * (inv * w.y), v[u].z * (inv * w.z), v[u].w * (inv * w.w)};
                uint32_t hi[4];
                float sum = 0;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float h = round_f16(f[i]);
                    hi[i] = __half_as_ushort(__float2half_rn(h));
                    sum += h;
                }
                uint32_t ph[4];  // lane ^ 1 holds the other 4 values of the 8
#pragma unroll
                for (int i = 0; i < 4; i++) ph[i] = __shfl_xor_sync(0xffffffffu, hi[i], 1);
                if (in && lane % 2 == 0) {
                    const int64_t wd = k / 8, pos = (wd & ~7) | ((wd & 1) << 2) | ((wd & 7) >> 1);
                    *reinterpret_cast<uint4*>(s_hi + t * xs + 8 * pos) =
                        make_uint4(hi[0] | ph[0] << 16, hi[1] | ph[1] << 16, hi[2] | ph[2] << 16, hi[3] | ph[3] << 16);
                }
#pragma unroll
                for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);  // 16 lanes: 64 values
                if (in && lane % 16 == 0) s_sum[(k / 64) * k_mma_warp_max_tokens + t] = sum;
            }
        }
    }
}

// grid: blocks of 16-row blocks [n_rb b / grid, n_rb (b + 1) / grid); nkc k-chunks of K / 64 / nkc blocks each.
// NG: groups of 8 input rows per A fragment (T <= 8 NG). Shared memory: x [T][K + 32] fp16 | sums [K/64][32] |
// (nkc > 1) partials [items][16 rows][T].
template <int NG>
__global__ void __launch_bounds__(k_mw_threads) gemv_mma_warp_kernel(const gemv_params p, int nkc, int gshift) {
    constexpr int W = k_mw_threads / 32, SB = k_mw_step;
    extern __shared__ __align__(16) char smem[];
    __shared__ float s_inv[k_mma_max_tokens];
    const int64_t K = p.W.cols, N = p.W.rows, rw = p.W.row_words(), ng = p.W.n_groups();
    const int T = p.T, nb = (int)(K / 64), bpk = nb / nkc, spi = (bpk + SB - 1) / SB;  // steps per item
    const int64_t xs = mma_x_stride(K);
    uint16_t* s_hi = reinterpret_cast<uint16_t*>(smem);
    float* s_sum = reinterpret_cast<float*>(smem + align16(2 * T * xs));
    float* s_red = s_sum + nb * k_mma_warp_max_tokens;
    const int64_t n_rb = (N + 15) / 16, rb0 = n_rb * blockIdx.x / gridDim.x, rb1 = n_rb * (blockIdx.x + 1) / gridDim.x;
    const int n_items = (int)(rb1 - rb0) * nkc;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int n_steps = warp < n_items ? (n_items - warp + W - 1) / W * spi : 0;

    struct regs {  // one step: [block][row g, g + 8]
        uint2 a[SB][2];
        uint32_t s[SB][2];
    };
    struct where {
        int64_t rb;
        int kc, b0, b1;  // this step's blocks [b0, b1)
    };
    auto locate = [&](int st) {
        const int it = warp + W * (st / spi), part = st % spi;
        where w;
        w.rb = rb0 + it / nkc, w.kc = it % nkc, w.b0 = w.kc * bpk + part * SB, w.b1 = min(w.b0 + SB, (w.kc + 1) * bpk);
        return w;
    };
    auto load = [&](int st, regs& r) {
        const where w = locate(st);
        const int64_t ra = min(w.rb * 16 + g, N - 1), rb = min(w.rb * 16 + g + 8, N - 1);
        const uint2* A0 = reinterpret_cast<const uint2*>(p.W.w + ra * rw) + c;  // block b's words 2c, 2c+1: [4 b]
        const uint2* A1 = reinterpret_cast<const uint2*>(p.W.w + rb * rw) + c;
#pragma unroll
        for (int b = 0; b < SB; b++) {
            const int blk = min(w.b0 + b, w.b1 - 1);  // (past the step's end: loaded again, not used)
            r.a[b][0] = __ldg(A0 + 4 * blk), r.a[b][1] = __ldg(A1 + 4 * blk);
            r.s[b][0] = __ldg(p.W.sb + ra * ng + (blk >> gshift)), r.s[b][1] = __ldg(p.W.sb + rb * ng + (blk >> gshift));
        }
    };
    regs A, B;
    pdl_trigger();
    if (n_steps > 0) load(0, A);  // weights: before the wait
    if (n_steps > 1) load(1, B);
    pdl_wait();
    if (p.norm_w) block_inv_rms_rows<8>(s_inv, p.x, p.ldx, T, K, p.eps);
    stage_x_pairs(s_hi, xs, s_sum, p.x, p.ldx, T, p.norm_w, s_inv, K);
    for (int i = threadIdx.x; i < nb * (k_mma_warp_max_tokens - T); i += blockDim.x)  // the sums' unused columns
        s_sum[(i / (k_mma_warp_max_tokens - T)) * k_mma_warp_max_tokens + T + i % (k_mma_warp_max_tokens - T)] = 0.0f;
    __syncthreads();

    const uint16_t* xb[NG];  // this lane's B column: token 8 n + g (token 0 past T: that column is dropped)
#pragma unroll
    for (int n = 0; n < NG; n++) xb[n] = s_hi + (8 * n + g < T ? 8 * n + g : 0) * xs + 8 * c;
    float y[NG][4];
    auto compute = [&](int st, const regs& r) {
        const where w = locate(st);
        if (w.b0 == w.kc * bpk)  // the item's first step
#pragma unroll
            for (int n = 0; n < NG; n++) y[n][0] = y[n][1] = y[n][2] = y[n][3] = 0.0f;
#pragma unroll
        for (int b = 0; b < SB; b++) {
            const int blk = w.b0 + b;
            if (blk >= w.b1) break;
            float acc[NG][4];
#pragma unroll
            for (int n = 0; n < NG; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                uint32_t a02[4], a13[4];
                q4_fragments(j ? r.a[b][0].y : r.a[b][0].x, j ? r.a[b][1].y : r.a[b][1].x, a02, a13);
#pragma unroll
                for (int n = 0; n < NG; n++) {
                    const uint4 xh = *reinterpret_cast<const uint4*>(xb[n] + (int64_t)(8 * blk + 4 * j) * 8);
                    mma_f16(acc[n], a02, xh.x, xh.y);
                    mma_f16(acc[n], a13, xh.z, xh.w);
                }
            }
            affine_accumulate<NG>(y, acc, r.s[b][0], r.s[b][1], s_sum + blk * k_mma_warp_max_tokens, c);
        }
        if (w.b1 < (w.kc + 1) * bpk) return;  // the item goes on in the next step
        const int64_t r0 = w.rb * 16 + g;
        float* red = s_red + ((w.rb - rb0) * nkc + w.kc) * 16 * T;  // [16 rows][T]
#pragma unroll
        for (int n = 0; n < NG; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int t = 8 * n + 2 * c + e;
                if (t >= T) continue;
                if (nkc > 1) {
                    red[g * T + t] = y[n][e], red[(g + 8) * T + t] = y[n][2 + e];
                } else {  // the whole row: straight out
                    if (r0 < N) store_out(p, r0, t, y[n][e]);
                    if (r0 + 8 < N) store_out(p, r0 + 8, t, y[n][2 + e]);
                }
            }
    };
    two_step_pipeline(n_steps, A, B, load, compute);
    if (nkc == 1) return;
    __syncthreads();
    for (int i = threadIdx.x; i < (int)(rb1 - rb0) * 16 * T; i += blockDim.x) {
        const int rbl = i / (16 * T), r = (i / T) % 16, t = i % T;
        const int64_t row = (rb0 + rbl) * 16 + r;
        if (row >= N) continue;
        float v = 0;
        for (int kc = 0; kc < nkc; kc++) v += s_red[((rbl * nkc + kc) * 16 + r) * T + t];
        store_out(p, row, t, v);
    }
}

template <int NG>
void launch_mma_warp_as(const gemv_params& p, const mma_warp_plan& pl, cudaStream_t stream) {
    allow_dynamic_smem<gemv_mma_warp_kernel<NG>>(stream_smem_limit());
    launch_pdl(gemv_mma_warp_kernel<NG>, dim3((unsigned)pl.blocks), dim3(k_mw_threads), pl.smem, stream, p, pl.nkc,
               pl.gshift);
}

}  // namespace

mma_warp_plan plan_mma_warp(const gemv_params& p) {
    mma_warp_plan pl;
    const dmat& W = p.W;
    const int groups64 = W.group / 64;
    if (p.T < 2 || p.T > k_mma_warp_max_tokens || (p.norm_w && p.T > k_mma_max_tokens) || !p.f16_inputs || !mma_decode_enabled(mma_gemvn) || !mma_dot_supports(W) ||
        W.group % 64 != 0 || (groups64 & (groups64 - 1)) != 0 || W.cols % 64 != 0 || W.rows < 1)
        return pl;
    const int64_t n_rb = (W.rows + 15) / 16, blocks = std::min<int64_t>(n_rb, sm_count()), rbpb = (n_rb + blocks - 1) / blocks;
    const int nb = (int)(W.cols / 64), warps = k_mw_threads / 32;
    const size_t fixed = (size_t)align16(2 * p.T * mma_x_stride(W.cols)) + (size_t)nb * k_mma_warp_max_tokens * 4;
    int64_t best = -1;
    for (int nkc = 1; nkc <= nb; nkc++) {
        if (nb % nkc) continue;
        const size_t smem = fixed + (nkc > 1 ? (size_t)(rbpb * nkc * 16 * p.T * 4) : 0);
        if (smem > stream_smem_limit()) continue;
        const int64_t work = (rbpb * nkc + warps - 1) / warps * (nb / nkc + 1);
        if (best < 0 || work < best) best = work, pl.nkc = nkc, pl.smem = smem;
    }
    if (best < 0) return pl;
    pl.blocks = (int)blocks;
    while ((64 << pl.gshift) < W.group) pl.gshift++;
    return pl;
}

void run_mma_warp(const gemv_params& p, const mma_warp_plan& pl, cudaStream_t stream) {
    if (p.T <= 8) launch_mma_warp_as<1>(p, pl, stream);
    else if (p.T <= 16) launch_mma_warp_as<2>(p, pl, stream);
    else if (p.T <= 24) launch_mma_warp_as<3>(p, pl, stream);
    else launch_mma_warp_as<4>(p, pl, stream);
}

}  // namespace tansy::cuda::gemv_impl
