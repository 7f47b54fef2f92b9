// MoE decode per warp (fast mode, 4-bit rows, int8 inputs: xq.cuh, dp4a): gate/up and down as the one-row GEMV's
// per-warp form (gemv_warp.cu). Each warp owns rows gw, gw + NW, ... and streams them through its own cp.async
// ring (no tile barriers); every warp reads the routing itself. One token takes its routing from the router tap
// (gemv.cuh): no router launch, one warp selects on the raw logits beside the staging; down zeroes the tap for
// the next layer. The shared expert's rows need no routing and are requested before the PDL wait; copy
// descriptors are computed once per kernel, so a row costs a few predicated 16-byte copies.
#include <algorithm>

#include "backend/cuda/moe_family.cuh"
#include "backend/cuda/xq.cuh"

namespace tansy::cuda::moe_impl {

namespace {

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

size_t gate_up_warp_smem(const dmoe& m) { return warp_ring_smem(xq_stage_bytes(m.D / 32), k_gu_warp_slots, gate_up_row_bytes(m.gate)); }

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

size_t down_warp_smem(const dmoe& m) {
    const int ns = m.k + 1;
    return warp_ring_smem(xq_stage_bytes(ns * m.F / 32), k_dn_warp_slots, ns * down_seg_bytes(m.down));
}

}  // namespace

bool gate_up_warp_fits(const dmoe& m) {
    const int64_t sbb = m.gate.n_groups() * 4;  // both scale/bias rows: one 16-byte copy per lane
    return m.F == m.Fs && sbb % 16 == 0 && sbb / 8 <= 32 && (m.gate.row_words() * 4) % 16 == 0 &&
           gate_up_warp_smem(m) <= stream_smem_limit();
}

bool down_warp_fits(const dmoe& m) {
    return m.F % 32 == 0 && m.F / 32 * (m.k + 1) <= 32 * 5 && down_seg_bytes(m.down) % 16 == 0 &&
           (m.k + 1) * down_seg_bytes(m.down) <= 16 * 32 * k_dn_copy_pieces &&
           down_warp_smem(m) <= stream_smem_limit();
}

void run_gate_up_warp(float* h, const dmoe& m, const moe_routing& r, const float* x, int64_t ldx, int T,
                      const float* norm_w, float eps, int cpl, cudaStream_t stream) {
    if (cpl == 2) launch_gate_up_warp<2>(h, m, r, x, ldx, T, norm_w, eps, stream);
    else launch_gate_up_warp<1>(h, m, r, x, ldx, T, norm_w, eps, stream);
}

void run_down_warp(float* x, int64_t ldx, const dmoe& m, const int32_t* idx, const float* wt, const float* sig,
                   const float* h, int T, unsigned long long* zero_tap, cudaStream_t stream) {
    const int64_t h_ld = std::max(m.F, m.Fs);
    allow_dynamic_smem<down_warp_kernel>(stream_smem_limit());
    launch_pdl(down_warp_kernel, dim3((unsigned)std::max(1, sm_count() / T), (unsigned)T), dim3(k_stream_threads),
               down_warp_smem(m), stream, x, ldx, m, idx, wt, sig, h, h_ld, zero_tap);
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda::moe_impl
