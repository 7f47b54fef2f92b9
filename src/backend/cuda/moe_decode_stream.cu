// MoE decode through block rings: gate/up (4-bit rows, D = 32 cpl chunks, top-k fused) and down (any format) for
// a few tokens. A token's tiles of rows (shared expert first: it needs no routing, so it streams while the router
// finishes) go through a shared-memory ring (stream.cuh); the block holds the normalised input in registers and
// each warp takes rows of the tile. Down reads the k+1 slots' rows of each output row and sums w_j down_j h_j.
// Per token, gate/up reads k+1 (gate, up) row sets and down k+1 row segments per output row: ~16 MB a layer.
#include <algorithm>

#include "backend/cuda/moe_family.cuh"

namespace tansy::cuda::moe_impl {

namespace {

// gate/up: a block's ~35 (gate, up) row pairs fit 3 slots of 16; down: its ~16 output rows x 9 slots fit one
// slot of 16 (one row per warp).
constexpr int k_ring_gate_up = 3, k_ring_down = 2;

// Rows of one ring slot of gate/up: the same rows of W_gate and W_up, codes then scale/bias words.
int64_t gate_up_slot_bytes(const dmat& G, int64_t rows) {
    return 2 * align16(rows * G.row_words() * 4) + 2 * align16(rows * G.n_groups() * 4);
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

template <dfmt F>
void launch_down(dim3 grid, const stream_plan& pl, cudaStream_t stream, float* x, int64_t ldx, const dmoe& m,
                 const int32_t* idx, const float* wt, const float* sig, const float* h, int64_t h_ld, float h_f16_scale) {
    allow_dynamic_smem<down_stream_kernel<F>>(stream_smem_limit());
    launch_pdl(down_stream_kernel<F>, grid, dim3(k_stream_threads), pl.smem, stream, x, ldx, m, idx,
               wt, sig, h, h_ld, h_f16_scale, pl.rows_per_tile, pl.slot_bytes);
}

}  // namespace

void run_gate_up_stream(float* h, const dmoe& m, const moe_routing& r, const float* x, int64_t ldx, int T,
                        const float* norm_w, float eps, bool f16, int cpl, cudaStream_t stream) {
    if (cpl == 2) launch_gate_up_stream<dfmt::q4, 2>(h, m, r, x, ldx, T, norm_w, eps, f16, stream);
    else launch_gate_up_stream<dfmt::q4, 1>(h, m, r, x, ldx, T, norm_w, eps, f16, stream);
}

void run_down_stream(float* x, int64_t ldx, const dmoe& m, const int32_t* idx, const float* wt, const float* sig,
                     const float* h, int T, float h_f16_scale, cudaStream_t stream) {
    const dfmt f = m.down.fmt;
    const int64_t h_ld = std::max(m.F, m.Fs);
    const int ns = m.k + 1;
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

}  // namespace tansy::cuda::moe_impl
