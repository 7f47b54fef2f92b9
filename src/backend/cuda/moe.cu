// MoE kernels.
// v1: top-k one warp per token; gate/up one block per (token, slot, row tile); down walks the k+1 slots per
//     output row. H200, synthetic 35B, batch 1 (per layer): top-k 19 us (serial global loads), gate/up 60 us
//     (a serial per-block norm), down 20 us (the slots' loads one after another).
// v2: top-k holds the logits in registers; gate/up normalises with one parallel round trip and gives each
//     subgroup R=2 rows of gate and up (8 loads in flight per lane); down spreads the (slot, chunk) pairs of a
//     row over the warp's lanes so every slot's weights are in flight at once. H200: gate/up 33 us, down 16 us.
// v3: gate/up keeps the normalised input in registers and walks (slot, row) pairs (as gemv_xs_kernel).
// v4: top-k selects with two warp reductions (redux.sync) per round instead of 2 x 5 shuffles, and on the
//     decode path runs inside gate/up (every block of a token computes it; block 0 stores it for down).
#include <algorithm>
#include <climits>

#include "backend/cuda/moe.cuh"

namespace tansy::cuda {

namespace {

constexpr int k_warps = 4;
constexpr int k_max_topk = 16;
constexpr int k_max_experts = 512;

// Router logits as order_key(l, 1): 0 marks padding and taken experts; a NaN (key 1, below every number) is
// chosen only when nothing else is left, and is still a real expert id.
// One warp, one token: the top-k of E router logits (+ bias), ties to the lower id (what a sequential arg-max
// picks), and the softmax over the selected logits (== the full softmax renormalised over the top-k, MODEL.md
// §5). Every lane ends with the ids and weights. Each round is two warp reductions (redux.sync), not shuffles.
__device__ __forceinline__ void warp_topk(const float* l, const float* bias, int E, int k, int (&chosen)[k_max_topk],
                                          float (&wt)[k_max_topk]) {
    constexpr int PER = k_max_experts / 32;
    const int lane = threadIdx.x % 32;
    uint32_t v[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int e = lane + 32 * i;
        v[i] = e < E ? order_key(l[e] + (bias ? bias[e] : 0.0f), 1u) : 0u;
    }
    float val[k_max_topk];
#pragma unroll
    for (int j = 0; j < k_max_topk; j++) {
        if (j >= k) break;
        uint32_t best = 0;
#pragma unroll
        for (int i = 0; i < PER; i++) best = max(best, v[i]);
        best = __reduce_max_sync(0xffffffffu, best);
        int bi = INT_MAX;
#pragma unroll
        for (int i = PER - 1; i >= 0; i--)  // descending, so the lane's lowest matching id is kept
            if (v[i] == best) bi = lane + 32 * i;
        bi = __reduce_min_sync(0xffffffffu, bi);
#pragma unroll
        for (int i = 0; i < PER; i++)
            if (lane + 32 * i == bi) v[i] = 0u;  // taken
        chosen[j] = bi, val[j] = key_value(best);
    }
    float sum = 0;
#pragma unroll
    for (int j = 0; j < k_max_topk; j++)
        if (j < k) sum += expf(val[j] - val[0]);
#pragma unroll
    for (int j = 0; j < k_max_topk; j++)
        if (j < k) wt[j] = expf(val[j] - val[0]) / sum;
}

// Writes token t's routing (lane 0 of the calling warp).
__device__ __forceinline__ void store_route(const moe_routing& r, int t, int E, int k, const int (&chosen)[k_max_topk],
                                            const float (&wt)[k_max_topk]) {
#pragma unroll
    for (int j = 0; j < k_max_topk; j++)
        if (j < k) r.idx[t * k + j] = chosen[j], r.wt[t * k + j] = wt[j];
    r.sig[t] = sigmoidf_(r.logits[t * r.ld + E]);
}

__global__ void topk_kernel(const moe_routing r, int T, int E, int k) {
    pdl_trigger();
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (t >= T) return;  // whole warp
    int chosen[k_max_topk];
    float wt[k_max_topk];
    warp_topk(r.logits + t * r.ld, r.bias, E, k, chosen, wt);
    if (threadIdx.x % 32 == 0) store_route(r, t, E, k, chosen, wt);
}

template <dfmt F>
__device__ __forceinline__ float affine_or_dense(const uint4& w, uint32_t sb, const float* xv, float sx) {
    const float d = chunk_dot<F>(w, xv, sx);
    if constexpr (F == dfmt::bf16)
        return d;
    else
        return sb_scale(sb) * d + sb_bias(sb) * sx;
}

template <dfmt F>
__device__ __forceinline__ float load_chunk(float (&xv)[chunk_values<F>()], const float* x, const float* nw,
                                            bool norm, float inv) {
    constexpr int CH = chunk_values<F>();
    chunk_load<CH>(xv, x);
    if (norm) {
        float w[CH];
        chunk_load<CH>(w, nw);
#pragma unroll
        for (int i = 0; i < CH; i++) xv[i] *= inv * w[i];
    }
    return chunk_sum<CH>(xv);
}

// grid: (row tiles, T*(k+1)). Each subgroup of L lanes owns R rows and computes gate and up for each.
template <dfmt F, int R>
__global__ void __launch_bounds__(k_warps * 32)
    gate_up_kernel(float* h, const dmoe m, const int32_t* idx, const float* x, int64_t ldx, const float* norm_w,
                   float eps, int L, int64_t h_ld) {
    constexpr int CH = chunk_values<F>();
    __shared__ float s_inv[1];
    const int slot = blockIdx.y, t = slot / (m.k + 1), j = slot % (m.k + 1);
    const bool shared = j == m.k;
    const int64_t rows = shared ? m.Fs : m.F;
    const dmat G = shared ? m.s_gate : m.gate.rows_view((int64_t)idx[t * m.k + j] * m.F, m.F);
    const dmat U = shared ? m.s_up : m.up.rows_view((int64_t)idx[t * m.k + j] * m.F, m.F);
    const float* xr = x + t * ldx;
    if (norm_w) block_inv_rms_rows(s_inv, xr, ldx, 1, m.D, eps);
    const float inv = norm_w ? s_inv[0] : 1.0f;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sl = lane % L;
    const int64_t row0 = ((int64_t)blockIdx.x * k_warps + warp) * (32 / L) * R + (lane / L) * R;
    const bool active = row0 < rows;  // idle lanes stay for the shuffles
    const int64_t n_chunks = m.D / CH, rw = G.row_words(), ng = G.n_groups();
    float g[R], u[R];
#pragma unroll
    for (int r = 0; r < R; r++) g[r] = u[r] = 0.0f;
    for (int64_t c = sl; active && c < n_chunks; c += L) {
        uint4 wg[R], wu[R];
        uint32_t sg[R], su[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int64_t row = min(row0 + r, rows - 1);
            wg[r] = __ldg(reinterpret_cast<const uint4*>(G.w + row * rw) + c);
            wu[r] = __ldg(reinterpret_cast<const uint4*>(U.w + row * rw) + c);
            if constexpr (F != dfmt::bf16) {
                sg[r] = __ldg(G.sb + row * ng + (c * CH) / G.group);
                su[r] = __ldg(U.sb + row * ng + (c * CH) / U.group);
            } else {
                sg[r] = su[r] = 0;
            }
        }
        float xv[CH];
        const float sx = load_chunk<F>(xv, xr + c * CH, norm_w + c * CH, norm_w != nullptr, inv);
#pragma unroll
        for (int r = 0; r < R; r++) {
            g[r] += affine_or_dense<F>(wg[r], sg[r], xv, sx);
            u[r] += affine_or_dense<F>(wu[r], su[r], xv, sx);
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
        for (int o = L / 2; o > 0; o >>= 1) {
            g[r] += __shfl_xor_sync(0xffffffffu, g[r], o);
            u[r] += __shfl_xor_sync(0xffffffffu, u[r], o);
        }
    if (active && sl == 0)
#pragma unroll
        for (int r = 0; r < R; r++)
            if (row0 + r < rows) h[slot * h_ld + row0 + r] = siluf_(g[r]) * u[r];
}

// T tokens x (k+1) slots x F rows of (gate, up) pairs, for a block of one token (grid.y) whose warps hold the
// normalised input in registers and walk the pairs (as gemv_xs_kernel); requires F == Fs and D = 32*CPL chunks.
template <dfmt F, int CPL, int R>
__global__ void __launch_bounds__(k_warps * 32)
    gate_up_xs_kernel(float* h, const dmoe m, const moe_routing route, const float* x, int64_t ldx,
                      const float* norm_w, float eps, int64_t h_ld) {
    constexpr int CH = chunk_values<F>();
    constexpr bool AFFINE = F != dfmt::bf16;
    __shared__ float s_inv[1];
    __shared__ int64_t s_row0[k_max_topk + 1];
    extern __shared__ float s_x[];
    const int t = blockIdx.y;
    const float* xr = x + t * ldx;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    pdl_trigger();
    pdl_wait();  // the router logits come from the kernel just before
    if (warp == 0) {  // the token's top-k, in every block of the token (cheaper than a launch); block 0 stores it
        int chosen[k_max_topk];
        float wt[k_max_topk];
        warp_topk(route.logits + t * route.ld, route.bias, m.E, m.k, chosen, wt);
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < k_max_topk; j++)
                if (j < m.k) s_row0[j] = (int64_t)chosen[j] * m.F;
            s_row0[m.k] = -1;
            if (blockIdx.x == 0) store_route(route, t, m.E, m.k, chosen, wt);
        }
    }
    __syncthreads();
    const int64_t items = (int64_t)(m.k + 1) * m.F, rw = m.gate.row_words(), ng = m.gate.n_groups();
    const int64_t stride = (int64_t)gridDim.x * k_warps * R;
    int64_t it0 = ((int64_t)blockIdx.x * k_warps + warp) * R;
    uint4 wg[R][CPL], wu[R][CPL];
    uint32_t sg[R][CPL], su[R][CPL];
    auto load = [&](int64_t i0) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int64_t it = min(i0 + r, items - 1), slot = it / m.F, row = it % m.F;
            const bool sh = s_row0[slot] < 0;
            const dmat& G = sh ? m.s_gate : m.gate;
            const dmat& U = sh ? m.s_up : m.up;
            const int64_t rr = sh ? row : s_row0[slot] + row;
#pragma unroll
            for (int i = 0; i < CPL; i++) {
                wg[r][i] = __ldg(reinterpret_cast<const uint4*>(G.w + rr * rw) + lane + 32 * i);
                wu[r][i] = __ldg(reinterpret_cast<const uint4*>(U.w + rr * rw) + lane + 32 * i);
                if constexpr (AFFINE) {
                    sg[r][i] = __ldg(G.sb + rr * ng + ((lane + 32 * i) * CH) / G.group);
                    su[r][i] = __ldg(U.sb + rr * ng + ((lane + 32 * i) * CH) / U.group);
                } else {
                    sg[r][i] = su[r][i] = 0;
                }
            }
        }
    };
    if (it0 < items) load(it0);  // in flight while the block normalises and stages x
    if (norm_w) block_inv_rms_rows(s_inv, xr, ldx, 1, m.D, eps);
    float xv[CPL][CH], sx[CPL];
    stage_x<CH, CPL>(xv, sx, xr, norm_w, norm_w ? s_inv[0] : 1.0f, m.D, s_x);
    for (; it0 < items; it0 += stride) {
        float g[R], u[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            g[r] = u[r] = 0;
#pragma unroll
            for (int i = 0; i < CPL; i++) {
                g[r] += affine_or_dense<F>(wg[r][i], sg[r][i], xv[i], sx[i]);
                u[r] += affine_or_dense<F>(wu[r][i], su[r][i], xv[i], sx[i]);
            }
        }
        if (it0 + stride < items) load(it0 + stride);
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float gg = warp_sum(g[r]), uu = warp_sum(u[r]);
            const int64_t it = it0 + r;
            if (lane == 0 && it < items) h[((int64_t)t * (m.k + 1) + it / m.F) * h_ld + it % m.F] = siluf_(gg) * uu;
        }
    }
}

// grid: (row tiles of D, T); one warp per output row. The (k+1) x (F/CH) (slot, chunk) pairs of the row are
// spread over the lanes, so all slots' weights load at once; requires F == Fs.
template <dfmt F>
__global__ void __launch_bounds__(k_warps * 32)
    down_kernel(float* x, int64_t ldx, const dmoe m, const int32_t* idx, const float* wt, const float* sig,
                const float* h, int64_t h_ld) {
    constexpr int CH = chunk_values<F>(), UNROLL = 8;  // 4-bit: all 144 (slot, chunk) pairs of a row in one round of loads
    __shared__ int64_t s_row0[k_max_topk + 1];
    __shared__ float s_w[k_max_topk + 1];
    extern __shared__ float s_h[];  // the token's (k+1) x F activations, chunk-padded as in stage_x
    const int t = blockIdx.y;
    pdl_trigger();
    if (threadIdx.x <= m.k) {  // the token's slots: expert row offset and weight
        const int j = threadIdx.x;
        s_row0[j] = j == m.k ? -1 : (int64_t)idx[t * m.k + j] * m.D;
        s_w[j] = j == m.k ? sig[t] : wt[t * m.k + j];
    }
    {
        const int64_t per_slot = m.F, total = (m.k + 1) * per_slot;
        for (int64_t e = 4 * threadIdx.x; e < total; e += 4 * blockDim.x) {
            const int64_t j = e / per_slot, f = e % per_slot;
            const float4 v = *reinterpret_cast<const float4*>(h + ((int64_t)t * (m.k + 1) + j) * h_ld + f);
            *reinterpret_cast<float4*>(s_h + (j * (per_slot / CH) + f / CH) * (CH + 4) + f % CH) = v;
        }
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t row = (int64_t)blockIdx.x * k_warps + warp;
    if (row >= m.D) return;  // whole warp; no barrier follows
    const int64_t cpr = m.F / CH, pairs = (m.k + 1) * cpr, rw = m.down.row_words(), ng = m.down.n_groups();
    float total = 0;
    for (int64_t q0 = lane; q0 < pairs; q0 += 32 * UNROLL) {
        uint4 w[UNROLL];
        uint32_t sb[UNROLL];
        int slot[UNROLL];
        int64_t c[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int64_t q = min(q0 + 32 * u, pairs - 1);
            slot[u] = (int)(q / cpr), c[u] = q % cpr;
            const bool sh = s_row0[slot[u]] < 0;
            const dmat& W = sh ? m.s_down : m.down;
            const int64_t r = sh ? row : s_row0[slot[u]] + row;
            w[u] = __ldg(reinterpret_cast<const uint4*>(W.w + r * rw) + c[u]);
            if constexpr (F != dfmt::bf16)
                sb[u] = __ldg(W.sb + r * ng + (c[u] * CH) / W.group);
            else
                sb[u] = 0;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (q0 + 32 * u >= pairs) break;
            float xv[CH];
            chunk_load<CH>(xv, s_h + (slot[u] * cpr + c[u]) * (CH + 4));
            total += s_w[slot[u]] * affine_or_dense<F>(w[u], sb[u], xv, chunk_sum<CH>(xv));
        }
    }
    total = warp_sum(total);
    if (lane == 0) x[t * ldx + row] += total;
}

int chunk_of(dfmt f) { return f == dfmt::q4 ? 32 : f == dfmt::q8 ? 16 : 8; }

}  // namespace

void moe_topk(const moe_routing& r, int T, int E, int k, cudaStream_t stream) {
    TANSY_CHECK(k >= 1 && k <= k_max_topk && k <= E && E <= k_max_experts, "moe_topk: k=%d E=%d", k, E);
    if (T == 0) return;
    constexpr int warps = 4;
    topk_kernel<<<(T + warps - 1) / warps, warps * 32, 0, stream>>>(r, T, E, k);
    CUDA_CHECK_LAUNCH();
}

template <dfmt F, int CPL>
void launch_gate_up_xs(float* h, const dmoe& m, const moe_routing& r, const float* x, int64_t ldx, int T,
                       const float* norm_w, float eps, cudaStream_t stream) {
    constexpr int R = 2;
    static int max_blocks = 0;
    if (!max_blocks) {
        int per_sm = 0, dev = 0, sms = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gate_up_xs_kernel<F, CPL, R>, k_warps * 32,
                                                                 (size_t)32 * CPL * (chunk_values<F>() + 4) * 4));
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
        max_blocks = std::max(1, per_sm) * sms;
    }
    const int64_t items = (int64_t)(m.k + 1) * m.F, per_block = (int64_t)k_warps * R;
    const int64_t bx = std::max<int64_t>(1, std::min<int64_t>((items + per_block - 1) / per_block, max_blocks / std::max(1, T)));
    const size_t smem = (size_t)(m.D / chunk_values<F>()) * (chunk_values<F>() + 4) * sizeof(float);
    launch_pdl(gate_up_xs_kernel<F, CPL, R>, dim3((unsigned)bx, (unsigned)T), dim3(k_warps * 32), smem, stream, h, m, r, x,
               ldx, norm_w, eps, std::max(m.F, m.Fs));
    CUDA_CHECK_LAUNCH();
}

void moe_route_gate_up(float* h, const dmoe& m, const moe_routing& r, const float* x, int64_t ldx, int T,
                       const float* norm_w, float eps, cudaStream_t stream) {
    const dfmt f = m.gate.fmt;
    TANSY_CHECK(m.up.fmt == f && m.s_gate.fmt == f && m.s_up.fmt == f, "moe: mixed weight formats");
    TANSY_CHECK(m.D % chunk_of(f) == 0 && ldx % 4 == 0 && m.D % 4 == 0, "moe_gate_up: D=%lld", (long long)m.D);
    TANSY_CHECK(m.k >= 1 && m.k <= k_max_topk && m.k <= m.E && m.E <= k_max_experts, "moe: k=%d E=%d", m.k, m.E);
    if (T == 0) return;
    const int64_t n_chunks = m.D / chunk_of(f);
    if (m.F == m.Fs && n_chunks % 32 == 0 && f == dfmt::q4) {  // the decode hot path: x in registers, top-k fused
        if (n_chunks == 64) return launch_gate_up_xs<dfmt::q4, 2>(h, m, r, x, ldx, T, norm_w, eps, stream);
        if (n_chunks == 32) return launch_gate_up_xs<dfmt::q4, 1>(h, m, r, x, ldx, T, norm_w, eps, stream);
    }
    moe_topk(r, T, m.E, m.k, stream);
    const int32_t* idx = r.idx;
    constexpr int R = 2;
    const int L = gemv_lanes_per_row(m.D / chunk_of(f));
    const int64_t rows = std::max(m.F, m.Fs), per_block = (int64_t)k_warps * (32 / L) * R;
    const dim3 grid((unsigned)((rows + per_block - 1) / per_block), (unsigned)(T * (m.k + 1)));
    switch (f) {
        case dfmt::q4: gate_up_kernel<dfmt::q4, R><<<grid, k_warps * 32, 0, stream>>>(h, m, idx, x, ldx, norm_w, eps, L, rows); break;
        case dfmt::q8: gate_up_kernel<dfmt::q8, R><<<grid, k_warps * 32, 0, stream>>>(h, m, idx, x, ldx, norm_w, eps, L, rows); break;
        case dfmt::bf16: gate_up_kernel<dfmt::bf16, R><<<grid, k_warps * 32, 0, stream>>>(h, m, idx, x, ldx, norm_w, eps, L, rows); break;
    }
    CUDA_CHECK_LAUNCH();
}

void moe_down(float* x, int64_t ldx, const dmoe& m, const int32_t* idx, const float* wt, const float* sig,
              const float* h, int T, cudaStream_t stream) {
    const dfmt f = m.down.fmt;
    TANSY_CHECK(m.s_down.fmt == f, "moe: mixed weight formats");
    TANSY_CHECK(m.F == m.Fs, "cuda moe: expert width %lld != shared expert width %lld is not supported",
                (long long)m.F, (long long)m.Fs);
    TANSY_CHECK(m.F % chunk_of(f) == 0 && m.k <= k_max_topk, "moe_down: F=%lld", (long long)m.F);
    if (T == 0) return;
    const dim3 grid((unsigned)((m.D + k_warps - 1) / k_warps), (unsigned)T);
    const int64_t h_ld = std::max(m.F, m.Fs);
    const int CH = chunk_of(f);
    const size_t smem = (size_t)(m.k + 1) * (m.F / CH) * (CH + 4) * sizeof(float);
    TANSY_CHECK(smem <= 48 * 1024, "moe_down: %zu bytes of activations per token", smem);
    switch (f) {
        case dfmt::q4: down_kernel<dfmt::q4><<<grid, k_warps * 32, smem, stream>>>(x, ldx, m, idx, wt, sig, h, h_ld); break;
        case dfmt::q8: down_kernel<dfmt::q8><<<grid, k_warps * 32, smem, stream>>>(x, ldx, m, idx, wt, sig, h, h_ld); break;
        case dfmt::bf16: down_kernel<dfmt::bf16><<<grid, k_warps * 32, smem, stream>>>(x, ldx, m, idx, wt, sig, h, h_ld); break;
    }
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
