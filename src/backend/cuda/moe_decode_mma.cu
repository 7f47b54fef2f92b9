// MoE decode on tensor cores (mma_dot.cuh, the tensor-core GEMV's scheme): gate/up and down with a ring slot
// holding the same 16 rows of each matrix (padded); warps split (matrix or slot, 16-row block, k-chunk) items and
// fold through shared memory. Correct, but slower than the CUDA-core forms at one token, so off by default in the
// kernel plan (mma=gate_up, mma=down turn them on); kept as the base for cutting its per-mma overhead.
#include <algorithm>

#include "backend/cuda/moe_family.cuh"
#include "backend/cuda/mma_dot.cuh"

namespace tansy::cuda::moe_impl {

namespace {

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

int gate_up_mma_k_chunks(const dmoe& m) {  // (gate, up) x k-chunks items for the warps of a 16-row block
    return mma_k_chunks(m.D, m.gate.group, k_gu_mma_threads / 32 / 2);
}

int down_mma_k_chunks(const dmoe& m) {  // (slot, k-chunk) items for the warps of a 16-row block
    const int ns = m.k + 1, warps = k_dn_mma_threads / 32;
    return mma_k_chunks(m.F, m.down.group, std::max(1, (warps + ns - 1) / ns));
}

}  // namespace

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

}  // namespace tansy::cuda::moe_impl
