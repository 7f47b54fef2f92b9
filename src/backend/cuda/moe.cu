// MoE block for decode tokens: routing (top-k of the router's logits), gate/up with SwiGLU into h, then down,
// x[t] += sum_j w_j down_j h_j over the k routed experts and the shared expert (weight sigmoid(shared gate)).
// Per token, gate/up reads k+1 (gate, up) row sets and down k+1 row segments per output row: ~16 MB a layer.
//   gate_up_warp_kernel, down_warp_kernel  fast mode, 4-bit rows, int8 inputs (xq.cuh, dp4a): each warp owns
//       rows gw, gw + NW, ... and streams them through its own cp.async ring (no tile barriers); every warp
//       reads the routing itself. One token takes its routing from the router tap (gemv.cuh): no router launch,
//       one warp selects on the raw logits beside the staging; down zeroes the tap for the next layer.
//   gate_up_stream_kernel, down_stream_kernel  other formats: tiles through a block ring (stream.cuh).
//   gate_up_mma_kernel, down_mma_kernel  tensor-core forms (off by default, mma_family); gate_up_kernel, topk_kernel
//       the general fallback. Prompts take the grouped GEMM instead (moe_grouped.cu, gemm.cu).
// Why fast: the shared expert's rows need no routing and are requested before the PDL wait; copy descriptors are
// computed once per kernel, so a row costs a few predicated 16-byte copies. Measured figures: docs/PERF.md.
#include <algorithm>
#include <climits>

#include "backend/cuda/moe.cuh"
#include "backend/cuda/mma_dot.cuh"
#include "backend/cuda/stream.cuh"
#include "backend/cuda/topk.cuh"
#include "backend/cuda/xq.cuh"

namespace tansy::cuda {

namespace {

constexpr int k_warps = 4;

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

// sum_i w_i x_i over a chunk from d, its dot product with the codes (affine: scale d + bias sum x) or values.
template <dfmt F>
__device__ __forceinline__ float affine_or_dense(float d, uint32_t sb, float sx) {
    if constexpr (F == dfmt::bf16)
        return d;
    else
        return sb_scale(sb) * d + sb_bias(sb) * sx;
}
template <dfmt F>
__device__ __forceinline__ float affine_or_dense(const uint4& w, uint32_t sb, const float* xv, float sx) {
    return affine_or_dense<F>(chunk_dot<F>(w, xv, sx), sb, sx);
}

template <dfmt F>
__device__ __forceinline__ float load_chunk(float (&xv)[chunk_values<F>()], const float* x, const float* nw,
                                            bool norm, float inv, bool f16) {
    constexpr int CH = chunk_values<F>();
    chunk_load<CH>(xv, x);
    if (norm) {
        float w[CH];
        chunk_load<CH>(w, nw);
#pragma unroll
        for (int i = 0; i < CH; i++) xv[i] *= inv * w[i];
    }
    if (f16) {
#pragma unroll
        for (int i = 0; i < CH; i++) xv[i] = round_f16(xv[i]);
    }
    return chunk_sum<CH>(xv);
}

// grid: (row tiles, T*(k+1)). Each subgroup of L lanes owns R rows and computes gate and up for each.
template <dfmt F, int R>
__global__ void __launch_bounds__(k_warps * 32)
    gate_up_kernel(float* h, const dmoe m, const int32_t* idx, const float* x, int64_t ldx, const float* norm_w,
                   float eps, bool f16, int L, int64_t h_ld) {
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
        const float sx = load_chunk<F>(xv, xr + c * CH, norm_w + c * CH, norm_w != nullptr, inv, f16);
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

// gate/up: a block's ~35 (gate, up) row pairs fit 3 slots of 16; down: its ~16 output rows x 9 slots fit one
// slot of 16 (one row per warp).
constexpr int k_ring_gate_up = 3, k_ring_down = 2;

// Rows of one ring slot of gate/up: the same rows of W_gate and W_up, codes then scale/bias words.
int64_t gate_up_slot_bytes(const dmat& G, int64_t rows) {
    return 2 * align16(rows * G.row_words() * 4) + 2 * align16(rows * G.n_groups() * 4);
}

// Tile j of a gate/up block (tiles of tr rows per slot, block-strided over the k+1 slots): slot q (0 = the
// shared expert, then the token's k experts) and its first row r0 within that expert; returns its row count.
__device__ __forceinline__ int gate_up_tile(int j, int tr, int64_t F, int64_t tiles_per_slot, int& q, int64_t& r0) {
    const int64_t g = blockIdx.x + (int64_t)j * gridDim.x;
    q = (int)(g / tiles_per_slot), r0 = (g % tiles_per_slot) * tr;
    return (int)min((int64_t)tr, F - r0);
}

// Slot q's gate and up matrices (the shared expert's for q = 0, else the stacked experts') and the row where its
// row r0 sits in them (for an expert, from s_row0 after routing).
struct gate_up_source {
    const dmat& G;
    const dmat& U;
    int64_t row;
};
__device__ __forceinline__ gate_up_source gate_up_rows(const dmoe& m, int q, int64_t r0, const int64_t* s_row0) {
    return {q == 0 ? m.s_gate : m.gate, q == 0 ? m.s_up : m.up, (q == 0 ? 0 : s_row0[q]) + r0};
}

// The gate/up kernels' start (every thread calls it): tile 0 first if it is the shared expert's (it needs no
// routing, so it streams while the router finishes), then the wait for the router's logits, the token's top-k
// into s_row0[1..k] (block 0 stores it for down), tile 0 if it was an expert's, and one commit group for it.
template <class Tile, class Issue>
__device__ __forceinline__ void gate_up_start(int n, Tile&& tile, Issue&& issue, const dmoe& m, const moe_routing& route,
                                              int t, int64_t* s_row0, int warp, int lane) {
    pdl_trigger();
    int q0 = -1;
    int64_t r00 = 0;
    if (n > 0) tile(0, q0, r00);
    const bool first_is_shared = q0 == 0;
    if (first_is_shared) issue(0);
    pdl_wait();
    if (warp == 0) {
        int chosen[k_max_topk];
        float wt[k_max_topk];
        warp_topk(route.logits + t * route.ld, route.bias, m.E, m.k, chosen, wt);
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < k_max_topk; j++)
                if (j < m.k) s_row0[j + 1] = (int64_t)chosen[j] * m.F;
            if (blockIdx.x == 0) store_route(route, t, m.E, m.k, chosen, wt);
        }
    }
    __syncthreads();
    if (!first_is_shared && n > 0) issue(0);
    cp_async_commit();  // group 0: tile 0, wherever it was issued
}

// T tokens x (k+1) slots x F rows of (gate, up) pairs: grid (blocks per token, T). A token's tiles of rows
// (shared expert first, then its k experts) stream through the shared-memory ring (stream.cuh); the block holds
// the normalised input in registers (lane l: chunks l, l+32, ...) and each warp takes rows of the tile. The top-k
// runs in every block of the token (cheaper than a launch); block 0 stores it for down. Requires F == Fs and
// D = 32*CPL chunks.
template <dfmt F, int CPL>
__global__ void __launch_bounds__(k_stream_threads)
    gate_up_stream_kernel(float* h, const dmoe m, const moe_routing route, const float* x, int64_t ldx,
                          const float* norm_w, float eps, bool f16, int64_t h_ld, int tr, int64_t slot_bytes) {
    constexpr int CH = chunk_values<F>();
    constexpr bool AFFINE = F != dfmt::bf16;
    __shared__ int64_t s_row0[k_max_topk + 1];  // slot order: shared expert, then the k experts
    extern __shared__ __align__(16) char smem[];
    const int t = blockIdx.y;
    const float* xr = x + t * ldx;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t rw = m.gate.row_words(), ng = m.gate.n_groups(), code_bytes = align16((int64_t)tr * rw * 4),
                  sb_bytes = align16((int64_t)tr * ng * 4);
    float* s_x = reinterpret_cast<float*>(smem);
    char* slots = smem + align16((m.D / CH) * (CH + 4) * 4);
    const int64_t tiles_per_slot = (m.F + tr - 1) / tr;
    const int n = block_tiles((m.k + 1) * tiles_per_slot);
    auto tile = [&](int j, int& q, int64_t& r0) { return gate_up_tile(j, tr, m.F, tiles_per_slot, q, r0); };
    auto issue = [&](int j) {
        int q;
        int64_t r0;
        const int nr = tile(j, q, r0);
        const auto [G, U, row] = gate_up_rows(m, q, r0, s_row0);
        char* s = slots + (j % k_ring_gate_up) * slot_bytes;
        block_copy_async(s, G.w + row * rw, nr * rw * 4);
        block_copy_async(s + code_bytes, U.w + row * rw, nr * rw * 4);
        if constexpr (AFFINE) {
            block_copy_async(s + 2 * code_bytes, G.sb + row * ng, nr * ng * 4);
            block_copy_async(s + 2 * code_bytes + sb_bytes, U.sb + row * ng, nr * ng * 4);
        }
    };
    gate_up_start(n, tile, issue, m, route, t, s_row0, warp, lane);
    ring_start<k_ring_gate_up>(n, 1, issue);
    __shared__ float red[32];
    float xv[CPL][CH], sx[CPL];
    stage_x<CH, CPL>(xv, sx, xr, norm_w, eps, m.D, s_x, red, f16);
    int gi[CPL];  // lane's scale/bias word in a row, per chunk
#pragma unroll
    for (int i = 0; i < CPL; i++) gi[i] = AFFINE ? ((lane + 32 * i) * CH) / m.gate.group : 0;
    ring_run<k_ring_gate_up>(n, issue, [&](int j) {
        int q;
        int64_t r0;
        const int nr = tile(j, q, r0);
        const char* s = slots + (j % k_ring_gate_up) * slot_bytes;
        const int slot = q == 0 ? m.k : q - 1;  // h's slot order: the k experts, then the shared one
        for (int r = warp; r < nr; r += k_stream_threads / 32) {
            const uint4* wg = reinterpret_cast<const uint4*>(s + (int64_t)r * rw * 4);
            const uint4* wu = reinterpret_cast<const uint4*>(s + code_bytes + (int64_t)r * rw * 4);
            const uint32_t* sg = reinterpret_cast<const uint32_t*>(s + 2 * code_bytes) + (int64_t)r * ng;
            const uint32_t* su = reinterpret_cast<const uint32_t*>(s + 2 * code_bytes + sb_bytes) + (int64_t)r * ng;
            float g = 0, u = 0;
#pragma unroll
            for (int i = 0; i < CPL; i++) {
                const int c = lane + 32 * i;
                g += affine_or_dense<F>(wg[c], AFFINE ? sg[gi[i]] : 0u, xv[i], sx[i]);
                u += affine_or_dense<F>(wu[c], AFFINE ? su[gi[i]] : 0u, xv[i], sx[i]);
            }
            g = warp_sum(g), u = warp_sum(u);
            if (lane == 0) h[((int64_t)t * (m.k + 1) + slot) * h_ld + r0 + r] = siluf_(g) * u;
        }
    });
}

// gate/up with per-warp rows (fast mode, 4-bit rows, int8 inputs): warp w of block b owns the token's rows
// v = gw, gw + NW, ... (gw = b * warps + w, NW warps per token; v < F: the shared expert's row v, else expert
// slot v / F, row v % F) and streams them through its own ring of k_gu_warp_slots rows in shared memory: it
// waits only for its own rows (cp.async groups and __syncwarp), so a row is used as soon as it lands, no block
// waits for a 16-row tile, and there is no barrier per tile. Every warp selects the top-k itself (batches) or,
// from the router tap (one token), the last warp selects while the others stage the input (int8, xq.cuh), whose
// one barrier publishes the choice; the shared expert's rows, first in each warp's order, stream before the PDL
// wait. At one token each warp has 2-3 rows: all in flight at once.
constexpr int k_gu_warp_slots = 3;

__host__ __device__ inline int64_t gate_up_row_bytes(const dmat& G) { return 2 * G.row_words() * 4 + 2 * G.n_groups() * 4; }

// TAP: the routing from moe_routing::tap (one token) instead of logits.
template <int CPL, bool TAP>
__global__ void __launch_bounds__(k_stream_threads)
    gate_up_warp_kernel(float* h, const dmoe m, const moe_routing route, const float* x, int64_t ldx,
                        const float* norm_w, float eps, int64_t h_ld) {
    constexpr int S = k_gu_warp_slots, W = k_stream_threads / 32;
    extern __shared__ __align__(16) char smem[];
    const int t = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t rw = m.gate.row_words(), ng = m.gate.n_groups(), code = rw * 4, sbb = ng * 4;
    const int64_t row_bytes = 2 * code + 2 * sbb, rows = (int64_t)(m.k + 1) * m.F;
    char* ring = smem + align16(xq_stage_bytes(m.D / 32)) + (int64_t)warp * S * row_bytes;
    const int64_t NW = (int64_t)gridDim.x * W, gw = (int64_t)blockIdx.x * W + warp;
    const int nr = gw < rows ? (int)((rows - gw + NW - 1) / NW) : 0;
    int my_id = 0;  // lane j < k: the token's expert j (after the top-k)
    const int F32 = (int)m.F;  // (k+1) F rows fit an int: 32-bit division below, not a 64-bit one
    const uint32_t *gw_s = m.s_gate.w, *gw_r = m.gate.w, *uw_s = m.s_up.w, *uw_r = m.up.w;
    const uint32_t *gs_s = m.s_gate.sb, *gs_r = m.gate.sb, *us_s = m.s_up.sb, *us_r = m.up.sb;
    auto issue = [&](int i) {
        const int v = (int)(gw + i * NW), q = v / F32, r = v - q * F32;
        const int e = __shfl_sync(0xffffffffu, my_id, max(q - 1, 0));
        const bool sh = q == 0;
        const int64_t row = (sh ? 0 : (int64_t)e * F32) + r;
        char* s = ring + (i % S) * row_bytes + 16 * lane;
        const char* g = reinterpret_cast<const char*>((sh ? gw_s : gw_r) + row * rw) + 16 * lane;
        const char* u = reinterpret_cast<const char*>((sh ? uw_s : uw_r) + row * rw) + 16 * lane;
        // a row's codes are exactly CPL 16-byte pieces per lane (D = 1024 CPL): unrolled, no copy loop
#pragma unroll
        for (int c = 0; c < CPL; c++) cp_async16(s + 512 * c, g + 512 * c), cp_async16(s + code + 512 * c, u + 512 * c);
        // both scale/bias rows in one predicated copy per lane, not two warp_copy_async loops (measured: the
        // loops are much slower, docs/PERF.md)
        const int half = (int)(sbb / 16);
        if (lane < 2 * half) {
            const bool up = lane >= half;
            const uint32_t* sb = sh ? (up ? us_s : gs_s) : (up ? us_r : gs_r);
            cp_async16(s + 2 * code, reinterpret_cast<const char*>(sb + row * ng) + 16 * (lane - (up ? half : 0)));
        }
    };
    pdl_trigger();
    // the shared expert's rows come first in the warp's order: those of the first S-1 stream before the wait
    int pre = 0;
    while (pre < min(nr, S - 1) && gw + pre * NW < m.F) issue(pre), cp_async_commit(), pre++;
    pdl_wait();
    xq_chunk xc[CPL];
    int gi[CPL];
    if constexpr (!TAP) {
        // (every warp selects here: on the batch path one selecting warp beside the staging measured slower, as
        // its routed rows then wait for the staging)
        int chosen[k_max_topk];
        float wt[k_max_topk];
        warp_topk(route.logits + t * route.ld, route.bias, m.E, m.k, chosen, wt);
#pragma unroll
        for (int j = 0; j < k_max_topk; j++)
            if (j < m.k && lane == j) my_id = chosen[j];
        if (blockIdx.x == 0 && warp == 0 && lane == 0) store_route(route, t, m.E, m.k, chosen, wt);
        ring_start<S>(nr, pre, issue);
        stage_lane_xq(xc, gi, smem, x + t * ldx, norm_w, eps, m.D, m.gate.group);
    } else {
        // The router tap's logits (T == 1) are of the unnormalised input: their ranking is the normalised one's,
        // so without a bias the selection need not wait for the staging's 1/rms: it runs beside the staging.
        // One warp selects while the others stage x; the staging's barrier publishes its choice (s_ids). It is
        // the last warp: the staging takes a word of 8 values per thread, so at D <= 8 * 32 (W - 1) (D = 2048:
        // warps 0-7) the last warp stages nothing and its selection runs beside the staging's loads.
        // note: with every warp selecting, 16 warps x ~580 instructions shared an SM's 4 schedulers before any
        // routed row was requested (~1.2 us at one token, by the SASS; one warp alone takes ~0.35 us). With warp 0
        // selecting, its staging loads waited for its selection: the barrier came two L2 round trips after the
        // wait (tap, then x) instead of one.
        constexpr int sel = W - 1;
        __shared__ int s_ids[k_max_topk];
        auto logit = [&](int e) { return (float)(long long)route.tap[e * k_tap_stride] * (1.0f / k_tap_logit_scale); };
        float my_val = 0.0f;  // lane j < k: expert j's logit (+ bias)
        const float gate_logit = logit(m.E);
        auto select = [&](float scale) {  // (loads the logits itself: nothing held across the staging)
            uint32_t key[k_topk_per_lane];
#pragma unroll
            for (int i = 0; i < k_topk_per_lane; i++) {
                const int e = lane + 32 * i;
                key[i] = 0u;
                if (32 * i >= m.E) continue;  // (uniform: E = 256 reads 8 keys per lane, not 16)
                if (e < m.E) key[i] = router_key(logit(e) * scale + (route.bias ? route.bias[e] : 0.0f));
            }
            warp_topk_select_lane(key, m.E, m.k, my_id, my_val);
        };
        const bool late = route.bias != nullptr;  // a bias is added to the normalised logits
        auto publish = [&] {
            if (lane < m.k) s_ids[lane] = my_id;
        };
        if (!late && warp == sel) select(1.0f), publish();
        const float inv_rms = stage_lane_xq(xc, gi, smem, x, norm_w, eps, m.D, m.gate.group);
        if (late) {
            if (warp == sel) select(inv_rms), publish();
            __syncthreads();
        }
        if (lane < m.k) my_id = s_ids[lane];
        ring_start<S>(nr, pre, issue);
        if (blockIdx.x == 0 && warp == sel) {  // the routing for down (as store_route): softmax over the top-k
            const float scale = late ? 1.0f : inv_rms;
            const float top = __shfl_sync(0xffffffffu, my_val, 0);  // (every lane: a full-warp shuffle)
            const float ex = lane < m.k ? expf((my_val - top) * scale) : 0.0f;
            const float sum = warp_sum(ex);
            if (lane < m.k) route.idx[lane] = my_id, route.wt[lane] = ex / sum;
            if (lane == 0) route.sig[0] = sigmoidf_(gate_logit * inv_rms);
        }
    }
    warp_ring_run<S>(nr, issue, [&](int i) {
        const char* s = ring + (i % S) * row_bytes;
        const uint4* wg = reinterpret_cast<const uint4*>(s);
        const uint4* wu = reinterpret_cast<const uint4*>(s + code);
        const uint32_t* sg = reinterpret_cast<const uint32_t*>(s + 2 * code);
        const uint32_t* su = reinterpret_cast<const uint32_t*>(s + 2 * code + sbb);
        float g = 0, u = 0;
#pragma unroll
        for (int c = 0; c < CPL; c++) {
            g += affine_or_dense<dfmt::q4>(chunk_dot_xq(wg[lane + 32 * c], xc[c]), sg[gi[c]], xc[c].sum);
            u += affine_or_dense<dfmt::q4>(chunk_dot_xq(wu[lane + 32 * c], xc[c]), su[gi[c]], xc[c].sum);
        }
        g = warp_sum(g), u = warp_sum(u);
        const int v = (int)(gw + i * NW), q = v / F32, slot = q == 0 ? m.k : q - 1;  // h's slot order: the k experts, then the shared one
        if (lane == 0) h[((int64_t)t * (m.k + 1) + slot) * h_ld + (v - q * F32)] = siluf_(g) * u;
    });
}

// gate/up on tensor cores: as gate_up_stream_kernel, but the dot products go through mma_dot.cuh (the
// gemv_mma_kernel scheme): a ring slot holds the same 16 rows of W_gate and W_up (padded), the warps split
// (matrix, 16-row block, k-chunk) items and fold through shared memory. Correct, but measured slower than the
// CUDA-core kernels at one token, as the one-row GEMV on tensor cores is (docs/PERF.md): off by default
// (mma_family, gemv.cuh), kept as the base for cutting its per-mma overhead.
constexpr int k_gu_mma_threads = 512, k_gu_mma_ring = 3;
constexpr int64_t k_gu_mma_ring_budget = 160 * 1024;  // 3 slots of 16 (gate, up) rows at D = 2048: 112 KB

int64_t gate_up_mma_slot_bytes(const dmat& G, int64_t rows) {
    return 2 * align16(rows * mma_row_bytes(G.row_words())) + 2 * align16(rows * mma_sb_stride(G.n_groups()) * 4);
}
// x staging (hi, lo, sums per 32) | fold [gate, up][4 row blocks][k-chunks][16]
__host__ __device__ size_t gate_up_mma_fixed(int64_t D, int nkc) {
    return (size_t)align16(4 * D) + (size_t)align16(4 * (D / 32)) + (size_t)align16(4 * 2 * 4 * nkc * 16);
}

template <int S>
__global__ void __launch_bounds__(k_gu_mma_threads)
    gate_up_mma_kernel(float* h, const dmoe m, const moe_routing route, const float* x, int64_t ldx,
                       const float* norm_w, float eps, bool f16, int64_t h_ld, int tr, int64_t slot_bytes, int nkc) {
    constexpr int W = k_gu_mma_threads / 32;
    __shared__ float s_inv[1];
    __shared__ int64_t s_row0[k_max_topk + 1];  // slot order: shared expert, then the k experts
    extern __shared__ __align__(16) char smem[];
    const int t = blockIdx.y;
    const float* xr = x + t * ldx;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
    const int64_t rw = m.gate.row_words(), ng = m.gate.n_groups();
    const int64_t cb = align16((int64_t)tr * mma_row_bytes(rw)), sbb = align16((int64_t)tr * mma_sb_stride(ng) * 4);
    const int ug = m.gate.group / 32, upc = (int)(m.D / 32) / nkc;
    uint16_t* s_hi = reinterpret_cast<uint16_t*>(smem);
    uint16_t* s_lo = s_hi + m.D;
    float* s_sum32 = reinterpret_cast<float*>(smem + align16(4 * m.D));
    float* s_red = s_sum32 + align16(4 * (m.D / 32)) / 4;
    char* slots = smem + gate_up_mma_fixed(m.D, nkc);
    const int64_t tiles_per_slot = (m.F + tr - 1) / tr;
    const int n = block_tiles((m.k + 1) * tiles_per_slot);
    auto tile = [&](int j, int& q, int64_t& r0) { return gate_up_tile(j, tr, m.F, tiles_per_slot, q, r0); };
    auto issue = [&](int j) {
        int q;
        int64_t r0;
        const int nr = tile(j, q, r0);
        const auto [G, U, row] = gate_up_rows(m, q, r0, s_row0);
        char* s = slots + (j % S) * slot_bytes;
        copy_rows_mma(s, s + 2 * cb, G.w + row * rw, G.sb + row * ng, nr, rw, ng);
        copy_rows_mma(s + cb, s + 2 * cb + sbb, U.w + row * rw, U.sb + row * ng, nr, rw, ng);
    };
    gate_up_start(n, tile, issue, m, route, t, s_row0, warp, lane);
    ring_start<S>(n, 1, issue);
    if (norm_w) block_inv_rms_rows(s_inv, xr, ldx, 1, m.D, eps);
    stage_x_mma(s_hi, s_lo, s_sum32, xr, norm_w, norm_w ? s_inv[0] : 1.0f, m.D, f16);
    ring_run<S>(n, issue, [&](int j) {
        int q;
        int64_t r0;
        const int nr = tile(j, q, r0);
        const char* s = slots + (j % S) * slot_bytes;
        const int nrb = (nr + 15) / 16;
        for (int it = warp; it < 2 * nrb * nkc; it += W) {
            const int mat = it % 2, rb = (it / 2) / nkc, kc = (it / 2) % nkc;  // mat 0: gate, 1: up
            float y0 = 0, y1 = 0;
            mma_dot_rows(s + mat * cb, s + 2 * cb + mat * sbb, rw, ng, min(rb * 16 + g, nr - 1),
                         min(rb * 16 + g + 8, nr - 1), kc * upc, (kc + 1) * upc, ug, s_hi, s_lo, s_sum32, f16, y0, y1);
            float* red = s_red + ((mat * 4 + rb) * nkc + kc) * 16;
            if (lane % 4 == 0) red[g] = y0, red[g + 8] = y1;
        }
        __syncthreads();
        const int slot = q == 0 ? m.k : q - 1;  // h's slot order: the k experts, then the shared one
        for (int r = threadIdx.x; r < nr; r += k_gu_mma_threads) {
            float gs = 0, us = 0;
            for (int kc = 0; kc < nkc; kc++) {
                gs += s_red[((0 * 4 + r / 16) * nkc + kc) * 16 + r % 16];
                us += s_red[((1 * 4 + r / 16) * nkc + kc) * 16 + r % 16];
            }
            h[((int64_t)t * (m.k + 1) + slot) * h_ld + r0 + r] = siluf_(gs) * us;
        }
    });
}

// Rows of one down-projection ring slot: the same output rows of the k+1 slots' matrices.
int64_t down_slot_bytes(const dmat& W, int slots, int64_t rows) {
    return slots * (align16(rows * W.row_words() * 4) + align16(rows * W.n_groups() * 4));
}

// grid: (blocks per token, T). Tiles of output rows stream through the ring, each holding those rows of all
// k+1 slots' down matrices; one warp per output row, whose (k+1) x (F/CH) (slot, chunk) pairs are spread over the
// lanes; the token's activations h sit in shared memory. x[t] += sum_j w_j down_j h_j. Requires F == Fs.
template <dfmt F>
__global__ void __launch_bounds__(k_stream_threads)
    down_stream_kernel(float* x, int64_t ldx, const dmoe m, const int32_t* idx, const float* wt, const float* sig,
                       const float* h, int64_t h_ld, float h_f16_scale, int tr, int64_t slot_bytes) {
    constexpr int CH = chunk_values<F>();
    constexpr bool AFFINE = F != dfmt::bf16;
    __shared__ int64_t s_row0[k_max_topk + 1];
    __shared__ float s_w[k_max_topk + 1];
    extern __shared__ __align__(16) char smem[];
    const int t = blockIdx.y, ns = m.k + 1;
    const int64_t cpr = m.F / CH, rw = m.down.row_words(), ng = m.down.n_groups();
    const int64_t code_bytes = align16((int64_t)tr * rw * 4), seg_bytes = code_bytes + align16((int64_t)tr * ng * 4);
    float* s_h = reinterpret_cast<float*>(smem);  // the token's (k+1) x F activations, chunk-padded as in stage_x
    char* slots = smem + align16(ns * cpr * (CH + 4) * 4);
    const int n = block_tiles((m.D + tr - 1) / tr);
    auto rows_of = [&](int j, int64_t& r0) { return block_tile_rows(j, tr, m.D, r0); };
    auto issue = [&](int j) {
        int64_t r0;
        const int nr = rows_of(j, r0);
        char* s = slots + (j % k_ring_down) * slot_bytes;
        for (int q = 0; q < ns; q++) {
            const bool sh = s_row0[q] < 0;
            const dmat& W = sh ? m.s_down : m.down;
            const int64_t row = (sh ? 0 : s_row0[q]) + r0;
            block_copy_async(s + q * seg_bytes, W.w + row * rw, nr * rw * 4);
            if constexpr (AFFINE) block_copy_async(s + q * seg_bytes + code_bytes, W.sb + row * ng, nr * ng * 4);
        }
    };
    pdl_trigger();
    pdl_wait();  // routing and h come from gate/up
    if (threadIdx.x < ns) {  // the token's slots: expert row offset and weight
        const int j = threadIdx.x;
        s_row0[j] = j == m.k ? -1 : (int64_t)idx[t * m.k + j] * m.D;
        s_w[j] = j == m.k ? sig[t] : wt[t * m.k + j];
    }
    __syncthreads();
    ring_start<k_ring_down>(n, 0, issue);
    for (int e = 4 * threadIdx.x, iF = (int)m.F; e < ns * iF; e += 4 * blockDim.x) {
        const int j = e / iF, f = e - j * iF;
        float4 v = *reinterpret_cast<const float4*>(h + ((int64_t)t * ns + j) * h_ld + f);
        if (h_f16_scale != 0.0f) {
            const float s = h_f16_scale, inv_s = 1.0f / h_f16_scale;  // powers of two: exact
            v = make_float4(round_f16(v.x * s) * inv_s, round_f16(v.y * s) * inv_s, round_f16(v.z * s) * inv_s,
                            round_f16(v.w * s) * inv_s);
        }
        *reinterpret_cast<float4*>(s_h + (j * cpr + f / CH) * (CH + 4) + f % CH) = v;
    }
    __syncthreads();  // s_h staged
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // A row's (k+1) x (F/CH) (slot, chunk) pairs, U per lane at once (all 144 of a 4-bit row in one round).
    // Where they sit in a slot, their input sums and slot weights are the same for every row: computed once when
    // one round covers a row. (Per row, a 64-bit division and a 32-value input sum per pair made this kernel
    // instruction-bound at 16 tokens.)
    constexpr int U = 5;
    struct pair_ref {
        int seg, code, sb, xo;  // byte offsets of the slot's segment and of the chunk in a row; sb word; s_h offset
        float sx, w;            // the input chunk's sum; the slot's weight
    };
    const int pairs = ns * (int)cpr, icpr = (int)cpr;
    auto make_refs = [&](int q0, pair_ref(&pr)[U]) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int q = min(q0 + 32 * u, pairs - 1), slot = q / icpr, c = q - slot * icpr;
            pr[u].seg = slot * (int)seg_bytes, pr[u].code = c * 16, pr[u].sb = AFFINE ? (c * CH) / m.down.group : 0;
            pr[u].xo = (slot * icpr + c) * (CH + 4);
            float xv[CH];
            chunk_load<CH>(xv, s_h + pr[u].xo);
            pr[u].sx = chunk_sum<CH>(xv), pr[u].w = s_w[slot];
        }
    };
    const bool one_round = pairs <= 32 * U;
    pair_ref pr0[U];
    if (one_round) make_refs(lane, pr0);
    const int row_bytes = (int)rw * 4;
    ring_run<k_ring_down>(n, issue, [&](int j) {
        int64_t r0;
        const int nr = rows_of(j, r0);
        const char* s = slots + (j % k_ring_down) * slot_bytes;
        for (int r = warp; r < nr; r += k_stream_threads / 32) {
            float total = 0;
            for (int q0 = lane; q0 < pairs; q0 += 32 * U) {
                pair_ref pr[U];
                if (one_round) {
#pragma unroll
                    for (int u = 0; u < U; u++) pr[u] = pr0[u];
                } else {
                    make_refs(q0, pr);
                }
                uint4 w[U];  // the row's shared-memory loads first, then U chains
                uint32_t sb[U];
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const char* seg = s + pr[u].seg;
                    w[u] = *reinterpret_cast<const uint4*>(seg + r * row_bytes + pr[u].code);
                    sb[u] = AFFINE ? reinterpret_cast<const uint32_t*>(seg + code_bytes)[r * (int)ng + pr[u].sb] : 0u;
                }
#pragma unroll
                for (int u = 0; u < U; u++) {
                    if (q0 + 32 * u >= pairs) break;
                    float xv[CH];
                    chunk_load<CH>(xv, s_h + pr[u].xo);
                    total += pr[u].w * affine_or_dense<F>(w[u], sb[u], xv, pr[u].sx);
                }
            }
            total = warp_sum(total);
            if (lane == 0) x[t * ldx + r0 + r] += total;
        }
    });
}

// down with per-warp rows (fast mode, 4-bit rows, int8 h), as gate_up_warp_kernel: warp gw (of NW) owns
// output rows gw, gw + NW, ... and streams each row's k+1 segments (the slots' down rows: codes, then scale/bias
// words) through its own ring; every warp reads the routing itself; one barrier stages h. x[t] += sum_j w_j
// down_j h_j. Requires F == Fs, F % 32 == 0.
constexpr int k_dn_warp_slots = 2;
constexpr int k_dn_copy_pieces = 7;  // 16-byte copies per lane per ring row: (k+1) segments of <= 224 pieces

__host__ __device__ inline int64_t down_seg_bytes(const dmat& W) { return W.row_words() * 4 + W.n_groups() * 4; }

__global__ void __launch_bounds__(k_stream_threads)
    down_warp_kernel(float* x, int64_t ldx, const dmoe m, const int32_t* idx, const float* wt, const float* sig,
                     const float* h, int64_t h_ld, unsigned long long* zero_tap) {
    constexpr int S = k_dn_warp_slots, W = k_stream_threads / 32, U = 5;
    extern __shared__ __align__(16) char smem[];
    const int t = blockIdx.y, ns = m.k + 1, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t rw = m.down.row_words(), ng = m.down.n_groups();
    const int code = (int)(rw * 4), seg = code + (int)(ng * 4), row_bytes = ns * seg;
    const int cpr = (int)(m.F / 32), pairs = ns * cpr;  // (slot, chunk) pairs of a row = staged chunks of h
    char* ring = smem + align16(xq_stage_bytes(pairs)) + (int64_t)warp * S * row_bytes;
    const int64_t NW = (int64_t)gridDim.x * W, gw = (int64_t)blockIdx.x * W + warp;
    const int nr = gw < m.D ? (int)((m.D - gw + NW - 1) / NW) : 0;
    pdl_trigger();
    // A ring row is the k+1 segments back to back, each its codes then its scale/bias words: lane's 16-byte
    // piece u of it (q = lane + 32 u) is read from src[u] + (output row) * (codes or scale/bias row stride).
    // Computed once (generic per-segment copy loops cost ~78 instructions per segment, most of the kernel's
    // instructions at 16 tokens, by the source counters), what needs no routing before the wait.
    const int pps = seg / 16, pieces = ns * pps;
    const char* src[k_dn_copy_pieces];
    int slot_of[k_dn_copy_pieces];    // the piece's slot j (its expert's first row is added after the wait)
    int stride_of[k_dn_copy_pieces];  // bytes per row of the piece's array (codes or scale/bias words)
    uint32_t sb_piece = 0;  // bit u: piece u is scale/bias words (row stride ng * 4, else rw * 4)
    {
        int j = 0, o = lane;  // piece q = j * pps + o, stepped by 32 without a division
#pragma unroll
        for (int u = 0; u < k_dn_copy_pieces; u++) {
            while (o >= pps) o -= pps, j++;
            const int jj = min(j, m.k), oo = 16 * o;  // (past the last piece: any valid address, not copied)
            const bool sbp = oo >= code;
            const uint32_t* base = sbp ? (jj == m.k ? m.s_down.sb : m.down.sb) : (jj == m.k ? m.s_down.w : m.down.w);
            src[u] = reinterpret_cast<const char*>(base) + (sbp ? oo - code : oo);
            slot_of[u] = jj, stride_of[u] = (int)(sbp ? ng * 4 : rw * 4);
            if (sbp) sb_piece |= 1u << u;
            o += 32;
        }
    }
    pdl_wait();  // routing and h come from gate/up
    if (zero_tap && blockIdx.x == 0)  // gate/up, which read them, has completed: zero for the next tap
        for (int e = threadIdx.x; e <= m.E; e += blockDim.x) zero_tap[e * k_tap_stride] = 0ull;
    // lane j <= k: slot j's first row in its matrix (the shared expert's for j == k) and weight
    const int64_t my_row0 = lane < m.k ? (int64_t)idx[t * m.k + lane] * m.D : 0;
    const float my_w = lane < m.k ? wt[t * m.k + lane] : lane == m.k ? sig[t] : 0.0f;
#pragma unroll
    for (int u = 0; u < k_dn_copy_pieces; u++) {
        const int64_t row0 = __shfl_sync(0xffffffffu, my_row0, min(slot_of[u], m.k - 1));  // (every lane shuffles)
        if (slot_of[u] < m.k) src[u] += row0 * stride_of[u];
    }
    auto issue = [&](int i) {
        const int64_t r = gw + i * NW, rc = r * code, rs = r * (ng * 4);
        char* s = ring + (i % S) * row_bytes + 16 * lane;
#pragma unroll
        for (int u = 0; u < k_dn_copy_pieces; u++)
            if (lane + 32 * u < pieces) cp_async16(s + 512 * u, src[u] + ((sb_piece >> u) & 1 ? rs : rc));
    };
    ring_start<S>(nr, 0, issue);
    // lane 0 loads each row's old x a row ahead, so that the store waits for no L2 round trip after the dot (at
    // one token, one row per warp: the kernel's last step)
    auto old_x = [&](int i) { return i < nr ? x[t * ldx + gw + i * NW] : 0.0f; };
    float prev = lane == 0 ? old_x(0) : 0.0f;
    stage_xq(smem, nullptr, h + (int64_t)t * ns * h_ld, nullptr, ns * m.F);  // h_ld == F
    __syncthreads();
    // this lane's (slot, chunk) pairs: q = lane + 32 u
    int sb_of[U], seg_of[U];
    float w_of[U], st_of[U], sum_of[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int q = min(lane + 32 * u, pairs - 1), j = q / cpr, c = q - j * cpr;
        seg_of[u] = j * seg + c * 16, sb_of[u] = j * seg + code + ((c * 32) / m.down.group) * 4;
        w_of[u] = __shfl_sync(0xffffffffu, my_w, j);
        st_of[u] = xq_steps(smem, pairs)[q], sum_of[u] = xq_sums(smem, pairs)[q];
    }
    warp_ring_run<S>(nr, issue, [&](int i) {
        const char* s = ring + (i % S) * row_bytes;
        float total = 0;
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (lane + 32 * u >= pairs) break;
            xq_chunk xc;
            load_xq_codes(xc, smem, pairs, lane + 32 * u);
            xc.s = st_of[u];
            const uint32_t sb = *reinterpret_cast<const uint32_t*>(s + sb_of[u]);
            const float d = chunk_dot_xq(*reinterpret_cast<const uint4*>(s + seg_of[u]), xc);
            total += w_of[u] * (sb_scale(sb) * d + sb_bias(sb) * sum_of[u]);
        }
        total = warp_sum(total);
        if (lane == 0) {
            const float next = old_x(i + 1);
            x[t * ldx + gw + i * NW] = prev + total;
            prev = next;
        }
    });
}

// down on tensor cores (like gate_up_mma_kernel, correct but measured slower than the CUDA-core kernels at one
// token, so off by default): a ring slot holds the same 16 output rows of all k+1
// slots' down matrices (padded); the token's k+1 activation rows are staged as permuted fp16 (times 1/16, the
// fast grouped GEMM's scaling, which also keeps large activations inside fp16); warps split (16-row block, slot,
// k-chunk) items, fold through shared memory, and x[t] += sum_j w_j * 16 * partial_j.
constexpr int k_dn_mma_threads = 512, k_dn_mma_ring = 2;
constexpr int64_t k_dn_mma_ring_budget = 132 * 1024;
constexpr float k_dn_mma_scale = 1.0f / 16.0f;

int64_t down_mma_slot_bytes(const dmat& W, int slots, int64_t rows) {
    return slots * (align16(rows * mma_row_bytes(W.row_words())) + align16(rows * mma_sb_stride(W.n_groups()) * 4));
}
// activations (hi, lo: (k+1) x F halves each; sums per 32) | fold [4 row blocks][k+1][k-chunks][16]
__host__ __device__ size_t down_mma_fixed(int ns, int64_t F, int nkc) {
    return (size_t)align16(4 * ns * F) + (size_t)align16(4 * ns * (F / 32)) + (size_t)align16(4 * 4 * ns * nkc * 16);
}

template <int S>
__global__ void __launch_bounds__(k_dn_mma_threads)
    down_mma_kernel(float* x, int64_t ldx, const dmoe m, const int32_t* idx, const float* wt, const float* sig,
                    const float* h, int64_t h_ld, float h_f16_scale, int tr, int64_t slot_bytes, int nkc) {
    constexpr int W = k_dn_mma_threads / 32;
    __shared__ int64_t s_row0[k_max_topk + 1];
    __shared__ float s_w[k_max_topk + 1];
    extern __shared__ __align__(16) char smem[];
    const int t = blockIdx.y, ns = m.k + 1;
    const int64_t F = m.F, rw = m.down.row_words(), ng = m.down.n_groups();
    const int64_t cb = align16((int64_t)tr * mma_row_bytes(rw)), seg = cb + align16((int64_t)tr * mma_sb_stride(ng) * 4);
    const int ug = m.down.group / 32, upc = (int)(F / 32) / nkc;
    uint16_t* s_hi = reinterpret_cast<uint16_t*>(smem);
    uint16_t* s_lo = s_hi + ns * F;
    float* s_sum32 = reinterpret_cast<float*>(smem + align16(4 * ns * F));
    float* s_red = s_sum32 + align16(4 * ns * (F / 32)) / 4;
    char* slots = smem + down_mma_fixed(ns, F, nkc);
    const int n = block_tiles((m.D + tr - 1) / tr);
    auto rows_of = [&](int j, int64_t& r0) { return block_tile_rows(j, tr, m.D, r0); };
    auto issue = [&](int j) {
        int64_t r0;
        const int nr = rows_of(j, r0);
        char* s = slots + (j % S) * slot_bytes;
        for (int q = 0; q < ns; q++) {
            const bool sh = s_row0[q] < 0;
            const dmat& Wd = sh ? m.s_down : m.down;
            const int64_t row = (sh ? 0 : s_row0[q]) + r0;
            copy_rows_mma(s + q * seg, s + q * seg + cb, Wd.w + row * rw, Wd.sb + row * ng, nr, rw, ng);
        }
    };
    pdl_trigger();
    pdl_wait();  // routing and h come from gate/up
    if (threadIdx.x < ns) {  // the token's slots: expert row offset and weight
        const int j = threadIdx.x;
        s_row0[j] = j == m.k ? -1 : (int64_t)idx[t * m.k + j] * m.D;
        s_w[j] = j == m.k ? sig[t] : wt[t * m.k + j];
    }
    __syncthreads();
    ring_start<S>(n, 0, issue);
    const bool f16 = h_f16_scale != 0.0f;
    const float scale = f16 ? h_f16_scale : k_dn_mma_scale, inv_scale = 1.0f / scale;  // powers of two
    // the k+1 rows of h are contiguous (h_ld == F: F == Fs), staged as one; visible after ring_run's first barrier
    stage_x_mma(s_hi, s_lo, s_sum32, h + (int64_t)t * ns * h_ld, nullptr, 1.0f, ns * F, f16, scale, /*barrier=*/false);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
    ring_run<S>(n, issue, [&](int j) {
        int64_t r0;
        const int nr = rows_of(j, r0);
        const char* s = slots + (j % S) * slot_bytes;
        const int nrb = (nr + 15) / 16;
        for (int it = warp; it < nrb * ns * nkc; it += W) {
            const int rb = it / (ns * nkc), q = (it / nkc) % ns, kc = it % nkc;
            float y0 = 0, y1 = 0;
            mma_dot_rows(s + q * seg, s + q * seg + cb, rw, ng, min(rb * 16 + g, nr - 1), min(rb * 16 + g + 8, nr - 1),
                         kc * upc, (kc + 1) * upc, ug, s_hi + q * F, s_lo + q * F, s_sum32 + q * (F / 32), f16, y0, y1);
            float* red = s_red + ((rb * ns + q) * nkc + kc) * 16;
            if (lane % 4 == 0) red[g] = y0, red[g + 8] = y1;
        }
        __syncthreads();
        for (int r = threadIdx.x; r < nr; r += k_dn_mma_threads) {
            float total = 0;
            for (int q = 0; q < ns; q++) {
                float part = 0;
                for (int kc = 0; kc < nkc; kc++) part += s_red[(((r / 16) * ns + q) * nkc + kc) * 16 + r % 16];
                total += s_w[q] * part;
            }
            x[t * ldx + r0 + r] += total * inv_scale;
        }
    });
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
void launch_gate_up_stream(float* h, const dmoe& m, const moe_routing& r, const float* x, int64_t ldx, int T,
                           const float* norm_w, float eps, bool f16, cudaStream_t stream) {
    constexpr int CH = chunk_values<F>();
    const int64_t bx = std::max(1, sm_count() / T);
    const size_t x_bytes = (size_t)align16((m.D / CH) * (CH + 4) * 4);
    const stream_plan pl = plan_stream<k_ring_gate_up>((m.k + 1) * m.F, bx, x_bytes, k_stream_threads,
                                               [&](int64_t rows) { return gate_up_slot_bytes(m.gate, rows); });
    allow_dynamic_smem<gate_up_stream_kernel<F, CPL>>(stream_smem_limit());
    const int64_t tiles = (m.k + 1) * ((m.F + pl.rows_per_tile - 1) / pl.rows_per_tile);
    launch_pdl(gate_up_stream_kernel<F, CPL>, dim3((unsigned)std::min(bx, tiles), (unsigned)T), dim3(k_stream_threads),
               pl.smem, stream, h, m, r, x, ldx, norm_w, eps, f16, std::max(m.F, m.Fs), pl.rows_per_tile, pl.slot_bytes);
    CUDA_CHECK_LAUNCH();
}

size_t gate_up_warp_smem(const dmoe& m) { return warp_ring_smem(xq_stage_bytes(m.D / 32), k_gu_warp_slots, gate_up_row_bytes(m.gate)); }

bool gate_up_warp_fits(const dmoe& m) {
    const int64_t sbb = m.gate.n_groups() * 4;  // both scale/bias rows: one 16-byte copy per lane
    return m.F == m.Fs && sbb % 16 == 0 && sbb / 8 <= 32 && (m.gate.row_words() * 4) % 16 == 0 &&
           gate_up_warp_smem(m) <= stream_smem_limit();
}

template <int CPL, bool TAP>
void launch_gate_up_warp_as(float* h, const dmoe& m, const moe_routing& r, const float* x, int64_t ldx, int T,
                            const float* norm_w, float eps, cudaStream_t stream) {
    allow_dynamic_smem<gate_up_warp_kernel<CPL, TAP>>(stream_smem_limit());
    launch_pdl(gate_up_warp_kernel<CPL, TAP>, dim3((unsigned)std::max(1, sm_count() / T), (unsigned)T),
               dim3(k_stream_threads), gate_up_warp_smem(m), stream, h, m, r, x, ldx, norm_w, eps, std::max(m.F, m.Fs));
    CUDA_CHECK_LAUNCH();
}

template <int CPL>
void launch_gate_up_warp(float* h, const dmoe& m, const moe_routing& r, const float* x, int64_t ldx, int T,
                         const float* norm_w, float eps, cudaStream_t stream) {
    if (r.tap) launch_gate_up_warp_as<CPL, true>(h, m, r, x, ldx, T, norm_w, eps, stream);
    else launch_gate_up_warp_as<CPL, false>(h, m, r, x, ldx, T, norm_w, eps, stream);
}

int gate_up_mma_k_chunks(const dmoe& m) {  // (gate, up) x k-chunks items for the warps of a 16-row block
    return mma_k_chunks(m.D, m.gate.group, k_gu_mma_threads / 32 / 2);
}

bool gate_up_mma_supports(const dmoe& m) {
    if (!mma_decode_enabled(mma_gate_up)) return false;
    for (const dmat* W : {&m.gate, &m.up, &m.s_gate, &m.s_up})
        if (!mma_dot_supports(*W)) return false;
    return m.F == m.Fs && gate_up_mma_fixed(m.D, gate_up_mma_k_chunks(m)) + k_gu_mma_ring * gate_up_mma_slot_bytes(m.gate, 1) <=
                              (size_t)std::min<int64_t>(k_gu_mma_ring_budget, stream_smem_limit());
}

void launch_gate_up_mma(float* h, const dmoe& m, const moe_routing& r, const float* x, int64_t ldx, int T,
                        const float* norm_w, float eps, bool f16, cudaStream_t stream) {
    const int64_t bx = std::max(1, sm_count() / T);
    const int nkc = gate_up_mma_k_chunks(m);
    const stream_plan pl = plan_stream<k_gu_mma_ring>((m.k + 1) * m.F, bx, gate_up_mma_fixed(m.D, nkc), k_gu_mma_threads,
                                                      [&](int64_t rows) { return gate_up_mma_slot_bytes(m.gate, rows); },
                                                      k_gu_mma_ring_budget);
    TANSY_CHECK(pl.rows_per_tile <= 64, "moe gate/up mma: %d rows per tile", pl.rows_per_tile);
    allow_dynamic_smem<gate_up_mma_kernel<k_gu_mma_ring>>(stream_smem_limit());
    const int64_t tiles = (m.k + 1) * ((m.F + pl.rows_per_tile - 1) / pl.rows_per_tile);
    launch_pdl(gate_up_mma_kernel<k_gu_mma_ring>, dim3((unsigned)std::min(bx, tiles), (unsigned)T), dim3(k_gu_mma_threads),
               pl.smem, stream, h, m, r, x, ldx, norm_w, eps, f16, std::max(m.F, m.Fs), pl.rows_per_tile, pl.slot_bytes, nkc);
    CUDA_CHECK_LAUNCH();
}

void moe_route_gate_up(float* h, const dmoe& m, const moe_routing& r, const float* x, int64_t ldx, int T,
                       const float* norm_w, float eps, bool f16, cudaStream_t stream) {
    const dfmt f = m.gate.fmt;
    TANSY_CHECK(m.up.fmt == f && m.s_gate.fmt == f && m.s_up.fmt == f, "moe: mixed weight formats");
    // the kernels walk every slot's rows with the routed experts' row layout
    TANSY_CHECK(f == dfmt::bf16 || (m.up.group == m.gate.group && m.s_gate.group == m.gate.group &&
                                    m.s_up.group == m.gate.group),
                "moe: mixed quantisation groups");
    TANSY_CHECK(m.D % chunk_of(f) == 0 && ldx % 4 == 0 && m.D % 4 == 0, "moe_gate_up: D=%lld", (long long)m.D);
    TANSY_CHECK(m.k >= 1 && m.k <= k_max_topk && m.k <= m.E && m.E <= k_max_experts, "moe: k=%d E=%d", m.k, m.E);
    if (T == 0) return;
    TANSY_CHECK(!r.tap || (T == 1 && f16 && moe_tap_supports(m)), "moe: the router tap is for one token (moe_tap_supports)");
    const int64_t n_chunks = m.D / chunk_of(f);
    if (gate_up_mma_supports(m))
        return launch_gate_up_mma(h, m, r, x, ldx, T, norm_w, eps, f16, stream);  // tensor cores, top-k fused
    if (m.F == m.Fs && n_chunks % 32 == 0 && f == dfmt::q4) {  // the decode hot path: x in registers, top-k fused
        const bool xq = f16 && decode_int8_inputs();  // fast mode: x as two-level int8 (xq.cuh)
        if (xq && gate_up_warp_fits(m)) {
            if (n_chunks == 64) return launch_gate_up_warp<2>(h, m, r, x, ldx, T, norm_w, eps, stream);
            if (n_chunks == 32) return launch_gate_up_warp<1>(h, m, r, x, ldx, T, norm_w, eps, stream);
        }
        if (n_chunks == 64) return launch_gate_up_stream<dfmt::q4, 2>(h, m, r, x, ldx, T, norm_w, eps, f16, stream);
        if (n_chunks == 32) return launch_gate_up_stream<dfmt::q4, 1>(h, m, r, x, ldx, T, norm_w, eps, f16, stream);
    }
    moe_topk(r, T, m.E, m.k, stream);
    const int32_t* idx = r.idx;
    constexpr int R = 2;
    const int L = gemv_lanes_per_row(m.D / chunk_of(f));
    const int64_t rows = std::max(m.F, m.Fs), per_block = (int64_t)k_warps * (32 / L) * R;
    const dim3 grid((unsigned)((rows + per_block - 1) / per_block), (unsigned)(T * (m.k + 1)));
    switch (f) {
        case dfmt::q4: gate_up_kernel<dfmt::q4, R><<<grid, k_warps * 32, 0, stream>>>(h, m, idx, x, ldx, norm_w, eps, f16, L, rows); break;
        case dfmt::q8: gate_up_kernel<dfmt::q8, R><<<grid, k_warps * 32, 0, stream>>>(h, m, idx, x, ldx, norm_w, eps, f16, L, rows); break;
        case dfmt::bf16: gate_up_kernel<dfmt::bf16, R><<<grid, k_warps * 32, 0, stream>>>(h, m, idx, x, ldx, norm_w, eps, f16, L, rows); break;
    }
    CUDA_CHECK_LAUNCH();
}

template <dfmt F>
void launch_down(dim3 grid, const stream_plan& pl, cudaStream_t stream, float* x, int64_t ldx, const dmoe& m,
                 const int32_t* idx, const float* wt, const float* sig, const float* h, int64_t h_ld, float h_f16_scale) {
    allow_dynamic_smem<down_stream_kernel<F>>(stream_smem_limit());
    launch_pdl(down_stream_kernel<F>, grid, dim3(k_stream_threads), pl.smem, stream, x, ldx, m, idx,
               wt, sig, h, h_ld, h_f16_scale, pl.rows_per_tile, pl.slot_bytes);
}

int down_mma_k_chunks(const dmoe& m) {  // (slot, k-chunk) items for the warps of a 16-row block
    const int ns = m.k + 1, warps = k_dn_mma_threads / 32;
    return mma_k_chunks(m.F, m.down.group, std::max(1, (warps + ns - 1) / ns));
}

bool down_mma_supports(const dmoe& m) {
    if (!mma_decode_enabled(mma_down)) return false;
    const int ns = m.k + 1;
    return mma_dot_supports(m.down) && mma_dot_supports(m.s_down) && m.F == m.Fs &&
           down_mma_fixed(ns, m.F, down_mma_k_chunks(m)) + k_dn_mma_ring * down_mma_slot_bytes(m.down, ns, 1) <=
               (size_t)std::min<int64_t>(k_dn_mma_ring_budget, stream_smem_limit());
}

void launch_down_mma(float* x, int64_t ldx, const dmoe& m, const int32_t* idx, const float* wt, const float* sig,
                     const float* h, int T, float h_f16_scale, cudaStream_t stream) {
    const int ns = m.k + 1;
    const int64_t bx = std::max(1, sm_count() / T);
    const int nkc = down_mma_k_chunks(m);
    const stream_plan pl = plan_stream<k_dn_mma_ring>(m.D, bx, down_mma_fixed(ns, m.F, nkc), k_dn_mma_threads,
                                                      [&](int64_t rows) { return down_mma_slot_bytes(m.down, ns, rows); },
                                                      k_dn_mma_ring_budget);
    TANSY_CHECK(pl.rows_per_tile <= 64, "moe down mma: %d rows per tile", pl.rows_per_tile);
    allow_dynamic_smem<down_mma_kernel<k_dn_mma_ring>>(stream_smem_limit());
    launch_pdl(down_mma_kernel<k_dn_mma_ring>, dim3((unsigned)std::min(bx, pl.tiles), (unsigned)T), dim3(k_dn_mma_threads),
               pl.smem, stream, x, ldx, m, idx, wt, sig, h, std::max(m.F, m.Fs), h_f16_scale, pl.rows_per_tile,
               pl.slot_bytes, nkc);
    CUDA_CHECK_LAUNCH();
}

size_t down_warp_smem(const dmoe& m) {
    const int ns = m.k + 1;
    return warp_ring_smem(xq_stage_bytes(ns * m.F / 32), k_dn_warp_slots, ns * down_seg_bytes(m.down));
}

bool down_warp_fits(const dmoe& m) {
    return m.F % 32 == 0 && m.F / 32 * (m.k + 1) <= 32 * 5 && down_seg_bytes(m.down) % 16 == 0 &&
           (m.k + 1) * down_seg_bytes(m.down) <= 16 * 32 * k_dn_copy_pieces &&
           down_warp_smem(m) <= stream_smem_limit();
}

bool moe_tap_supports(const dmoe& m) {
    for (const dmat* W : {&m.gate, &m.up, &m.down, &m.s_gate, &m.s_up, &m.s_down})
        if (W->fmt != dfmt::q4) return false;
    const int64_t n_chunks = m.D / 32;
    return decode_int8_inputs() && m.F == m.Fs && m.D % 32 == 0 && (n_chunks == 32 || n_chunks == 64) && m.k >= 1 && m.k <= k_max_topk && m.k <= m.E && m.E <= k_max_experts &&
           m.up.group == m.gate.group && m.s_gate.group == m.gate.group && m.s_up.group == m.gate.group &&
           m.s_down.group == m.down.group && !gate_up_mma_supports(m) && !down_mma_supports(m) &&
           gate_up_warp_fits(m) && down_warp_fits(m);
}

void moe_down(float* x, int64_t ldx, const dmoe& m, const int32_t* idx, const float* wt, const float* sig,
              const float* h, int T, float h_f16_scale, cudaStream_t stream, unsigned long long* zero_tap) {
    const dfmt f = m.down.fmt;
    TANSY_CHECK(m.s_down.fmt == f && (f == dfmt::bf16 || m.s_down.group == m.down.group),
                "moe: mixed weight formats or quantisation groups");
    TANSY_CHECK(m.F == m.Fs, "cuda moe: expert width %lld != shared expert width %lld is not supported",
                (long long)m.F, (long long)m.Fs);
    TANSY_CHECK(m.F % chunk_of(f) == 0 && m.k <= k_max_topk, "moe_down: F=%lld", (long long)m.F);
    if (T == 0) return;
    if (down_mma_supports(m)) return launch_down_mma(x, ldx, m, idx, wt, sig, h, T, h_f16_scale, stream);
    const int64_t h_ld = std::max(m.F, m.Fs);
    const int ns = m.k + 1;
    const bool xq = f == dfmt::q4 && h_f16_scale != 0.0f && decode_int8_inputs();  // fast mode: h as int8 (xq.cuh)
    if (xq && down_warp_fits(m)) {
        allow_dynamic_smem<down_warp_kernel>(stream_smem_limit());
        launch_pdl(down_warp_kernel, dim3((unsigned)std::max(1, sm_count() / T), (unsigned)T), dim3(k_stream_threads),
                   down_warp_smem(m), stream, x, ldx, m, idx, wt, sig, h, h_ld, zero_tap);
        CUDA_CHECK_LAUNCH();
        return;
    }
    TANSY_CHECK(!zero_tap, "moe_down: the router tap needs the per-warp kernel (moe_tap_supports)");
    const int64_t bx = std::max(1, sm_count() / T);
    const int CH = chunk_of(f);
    const size_t h_bytes = (size_t)align16(ns * (m.F / CH) * (CH + 4) * 4);
    const stream_plan pl = plan_stream<k_ring_down>(m.D, bx, h_bytes, k_stream_threads, [&](int64_t rows) { return down_slot_bytes(m.down, ns, rows); });
    const dim3 grid((unsigned)std::min(bx, pl.tiles), (unsigned)T);
    switch (f) {
        case dfmt::q4: launch_down<dfmt::q4>(grid, pl, stream, x, ldx, m, idx, wt, sig, h, h_ld, h_f16_scale); break;
        case dfmt::q8: launch_down<dfmt::q8>(grid, pl, stream, x, ldx, m, idx, wt, sig, h, h_ld, h_f16_scale); break;
        case dfmt::bf16: launch_down<dfmt::bf16>(grid, pl, stream, x, ldx, m, idx, wt, sig, h, h_ld, h_f16_scale); break;
    }
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
