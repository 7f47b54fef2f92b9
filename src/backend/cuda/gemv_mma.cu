// GEMV on tensor cores through a block ring: 4-bit rows, 1..16 input rows (mma_dot.cuh's m16n8k16 products with
// the input rows as B columns), so a weight is dequantised once per step for the whole batch. The weight tiles
// stream through the ring as gemv_stream's (rows padded in shared memory), the K units of a tile's 16-row blocks
// are split over the warps and folded through shared memory. Used where the per-warp form (gemv_mma_warp.cu) does
// not apply, and for one row when the plan turns mma=gemv1 on.
#include <algorithm>

#include "backend/cuda/gemv_family.cuh"
#include "backend/cuda/mma_dot.cuh"

namespace tansy::cuda::gemv_impl {

namespace {

constexpr int k_mma_threads = 512;
// plan_stream's largest tile (the fold area is sized for it): 64 rows for one input row; 16 (one mma row block)
// for several, whose fold and x staging grow with the rows
__host__ __device__ inline int mma_max_tile_rows(int T) { return T > 1 ? 16 : 64; }
// Ring budgets. One input row: 6 slots of 16 rows at K = 2048 (18.8 KB each, padded) + x staging and fold
// (12 KB), a block's share of a 14 MB projection in flight at once; wider rows (K = 4096) 3 slots of 16 rows
// (37 KB each). Several input rows (x staged per row) take what the SM has: 3 slots of 16 rows of K = 4096
// (100 KB) beside 8 rows' x (66 KB).
constexpr int64_t k_mma_ring_budget = 132 * 1024, k_mma_ring_budget_wide = 144 * 1024;
int64_t mma_budget_wide(int T) { return T > 1 ? (int64_t)stream_smem_limit() : k_mma_ring_budget_wide; }

int64_t mma_slot_bytes(const dmat& W, int64_t rows) {
    return align16(rows * mma_row_bytes(W.row_words())) + align16(rows * mma_sb_stride(W.n_groups()) * 4);
}

// A decode batch's rows share each dequantised weight: up to 8 (k_mma_group_tokens) as the n of one mma, up to 16
// (k_mma_max_tokens, kernel_plan.h) as two (when 16 rows' staged x fits beside the ring: K = 2048, not 4096)

// x staging for T input rows: hi [T][K + 32] fp16 permuted | lo [T][K + 32] (precise mode, T = 1) | sums per 32
// values [T][K/32 + 1] | fold [row blocks][k-chunks][16][T]. The per-token padding puts the lanes' different
// tokens in different banks (rows of 2K bytes would all start in bank 0).
__host__ __device__ inline int64_t mma_sum_stride(int64_t K) { return K / 32 + 1; }
__host__ __device__ size_t mma_fixed_smem(int64_t K, int nkc, int T, bool f16) {
    const int64_t x = align16(2 * T * mma_x_stride(K));
    return (size_t)(x + (f16 ? 0 : x) + align16(4 * T * mma_sum_stride(K)) +
                    align16(4 * (mma_max_tile_rows(T) / 16) * nkc * 16 * T));
}

// T >= 2 input rows of a 16-row block over units [u0, u1): the partial sums into red [16 rows][T].
template <int NG>
__device__ __forceinline__ void tokens_dot(const char* s, int64_t code_bytes, int64_t rw, int64_t ng, int ra, int rb8,
                                           int u0, int u1, int ug, const uint16_t* s_hi, int64_t xs, const float* s_sum32,
                                           int64_t ss, int T, float* red) {
    float y[2][2 * NG] = {};
    mma_dot_rows_tokens<NG>(s, s + code_bytes, rw, ng, ra, rb8, u0, u1, ug, s_hi, xs, s_sum32, ss, T, y);
    const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
#pragma unroll
    for (int n = 0; n < NG; n++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int t = 8 * n + 2 * c + e;
            if (t < T) red[g * T + t] = y[0][2 * n + e], red[(g + 8) * T + t] = y[1][2 * n + e];
        }
}

template <int S>
__global__ void __launch_bounds__(k_mma_threads) gemv_mma_kernel(const gemv_params p, int tr, int64_t slot_bytes, int nkc) {
    constexpr int W = k_mma_threads / 32;
    __shared__ float s_inv[k_mma_max_tokens];
    extern __shared__ __align__(16) char smem[];
    const int64_t K = p.W.cols, N = p.W.rows, rw = p.W.row_words(), ng = p.W.n_groups();
    const int T = p.T;
    const bool f16 = p.f16_inputs;
    const int ug = p.W.group / 32, upc = (int)(K / 32) / nkc;  // units (32 columns) per group, per k-chunk
    const int64_t xs = mma_x_stride(K), ss = mma_sum_stride(K), xbytes = align16(2 * T * xs);
    uint16_t* s_hi = reinterpret_cast<uint16_t*>(smem);
    uint16_t* s_lo = s_hi + T * xs;  // precise mode only
    float* s_sum32 = reinterpret_cast<float*>(smem + xbytes + (f16 ? 0 : xbytes));
    float* s_red = s_sum32 + align16(4 * T * ss) / 4;
    char* slots = smem + mma_fixed_smem(K, nkc, T, f16);
    const int64_t code_bytes = align16((int64_t)tr * mma_row_bytes(rw));
    const int n = block_tiles((N + tr - 1) / tr);
    auto rows_of = [&](int j, int64_t& r0) { return block_tile_rows(j, tr, N, r0); };
    auto issue = [&](int j) {
        int64_t r0;
        const int nr = rows_of(j, r0);
        char* s = slots + (j % S) * slot_bytes;
        copy_rows_mma(s, s + code_bytes, p.W.w + r0 * rw, p.W.sb + r0 * ng, nr, rw, ng);
    };
    pdl_trigger();
    ring_start<S>(n, 0, issue);  // the weights stream while the previous kernel finishes and x is staged
    pdl_wait();
    if (p.norm_w) block_inv_rms_rows(s_inv, p.x, p.ldx, T, K, p.eps);
    for (int t = 0; t < T; t++)
        stage_x_mma(s_hi + t * xs, s_lo + t * xs, s_sum32 + t * ss, p.x + t * p.ldx, p.norm_w,
                    p.norm_w ? s_inv[t] : 1.0f, K, f16, 1.0f, /*barrier=*/t == T - 1);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
    ring_run<S>(n, issue, [&](int j) {
        int64_t r0;
        const int nr = rows_of(j, r0);
        const char* s = slots + (j % S) * slot_bytes;
        const int nrb = (nr + 15) / 16;
        for (int it = warp; it < nrb * nkc; it += W) {
            const int rb = it / nkc, kc = it % nkc;
            const int ra = min(rb * 16 + g, nr - 1), rb8 = min(rb * 16 + g + 8, nr - 1);
            float* red = s_red + (rb * nkc + kc) * 16 * T;  // [16 rows][T]
            if (T == 1) {
                float y0 = 0, y1 = 0;
                mma_dot_rows(s, s + code_bytes, rw, ng, ra, rb8, kc * upc, (kc + 1) * upc, ug, s_hi, s_lo, s_sum32, f16,
                             y0, y1);
                if (lane % 4 == 0) red[g] = y0, red[g + 8] = y1;
            } else if (T <= 8) {
                tokens_dot<1>(s, code_bytes, rw, ng, ra, rb8, kc * upc, (kc + 1) * upc, ug, s_hi, xs, s_sum32, ss, T, red);
            } else {
                tokens_dot<2>(s, code_bytes, rw, ng, ra, rb8, kc * upc, (kc + 1) * upc, ug, s_hi, xs, s_sum32, ss, T, red);
            }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < nr * T; i += k_mma_threads) {
            const int r = i / T, t = i % T;
            float y = 0;
            for (int kc = 0; kc < nkc; kc++) y += s_red[(((r / 16) * nkc + kc) * 16 + r % 16) * T + t];
            store_out(p, r0 + r, t, y);
        }
    });
}

// Ring slots for W: 6 when six 16-row tiles fit the budget, else 3 (with the wide budget) when three do at one
// row; 0 when not even that fits (very wide rows: the CUDA-core kernels take them).
int mma_ring_slots(const dmat& W, int nkc, int T, bool f16) {
    const int64_t fixed = (int64_t)mma_fixed_smem(W.cols, nkc, T, f16);
    if (fixed + 6 * mma_slot_bytes(W, 16) <= std::min<int64_t>(k_mma_ring_budget, stream_smem_limit())) return 6;
    // several input rows: only with 16-row tiles (the mma's rows; smaller tiles lose to the CUDA-core kernels)
    const int64_t rows = T > 1 ? 16 : 1;
    if (fixed + 3 * mma_slot_bytes(W, rows) <= std::min<int64_t>(mma_budget_wide(T), stream_smem_limit())) return 3;
    return 0;
}

template <int S>
void launch_mma_ring(const gemv_params& p, int nkc, int64_t budget, cudaStream_t stream) {
    const stream_plan pl = plan_stream<S>(p.W.rows, sm_count(), mma_fixed_smem(p.W.cols, nkc, p.T, p.f16_inputs), k_mma_threads,
                                          [&](int64_t r) { return mma_slot_bytes(p.W, r); }, budget, mma_max_tile_rows(p.T));
    TANSY_CHECK(pl.rows_per_tile <= mma_max_tile_rows(p.T), "gemv mma: %d rows per tile", pl.rows_per_tile);
    allow_dynamic_smem<gemv_mma_kernel<S>>(stream_smem_limit());
    const int64_t blocks = std::min<int64_t>(pl.tiles, sm_count());
    launch_pdl(gemv_mma_kernel<S>, dim3((unsigned)blocks), dim3(k_mma_threads), pl.smem, stream, p, pl.rows_per_tile,
               pl.slot_bytes, nkc);
}

}  // namespace

// One input row in either mode; up to k_mma_max_tokens rows in fast mode (fp16 inputs: one staged copy each).
bool mma_gemv_supports(const gemv_params& p) {
    return (p.T == 1 ? mma_decode_enabled(mma_gemv1) : p.T <= k_mma_max_tokens && p.f16_inputs && mma_decode_enabled(mma_gemvn)) &&
           mma_dot_supports(p.W) &&
           mma_ring_slots(p.W, mma_k_chunks(p.W.cols, p.W.group, k_mma_threads / 32), p.T, p.f16_inputs) > 0;
}

void run_mma(const gemv_params& p, cudaStream_t stream) {
    const int nkc = mma_k_chunks(p.W.cols, p.W.group, k_mma_threads / 32);
    if (mma_ring_slots(p.W, nkc, p.T, p.f16_inputs) == 6)
        launch_mma_ring<6>(p, nkc, k_mma_ring_budget, stream);
    else
        launch_mma_ring<3>(p, nkc, mma_budget_wide(p.T), stream);
}

}  // namespace tansy::cuda::gemv_impl
