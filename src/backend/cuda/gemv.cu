// GEMV: y[t] = W x[t] for a few input rows t (decode steps, small batches), W of 4-bit / 8-bit affine or bf16
// rows (y = sum_g scale_g (q . x)_g + bias_g sum_g x), x optionally RMS-normalised in the prologue. gemv() picks:
//   gemv_warp_kernel      one row, 4-bit, fast mode: x as two-level int8 (xq.cuh), dp4a dots; each warp streams
//                         its own rows through a private cp.async ring (no tile barriers); optional router tap.
//   gemv_stream_kernel    one row, other formats: whole-row tiles through a block ring (stream.cuh), x in registers.
//   gemv_mma_warp_kernel  2..16 rows, 4-bit: mma.m16n8k16 with the input rows as B columns, so a weight is
//                         dequantised once per step for the batch; A fragments go from global memory to registers.
//   gemv_mma_kernel       the ring form on tensor cores, for shapes the per-warp plan does not take.
//   gemv_kernel           the general fallback (8-bit router batches, precise mode): warp subgroups walk rows.
// Why fast: decode is a chain of small launches bound by latency, not bytes. Weights (independent of the previous
// kernel) are requested before the PDL wait; after it, what counts is the number of dependent L2 round trips and
// instructions per weight. Measured figures and rejected variants: docs/PERF.md.
#include <algorithm>

#include "backend/cuda/gemv.cuh"
#include "backend/cuda/mma_dot.cuh"
#include "backend/cuda/stream.cuh"
#include "backend/cuda/xq.cuh"

namespace tansy::cuda {

namespace {

constexpr int k_warps = 4, U = 2;

// note: nw is passed by reference with a flag, never as a pointer: taking its address would move it to local
// memory (128-byte stack frames in the SASS).
template <dfmt F>
__device__ __forceinline__ float load_x_chunk(float (&xv)[chunk_values<F>()], const float* x,
                                              const float (&nw)[chunk_values<F>()], bool norm, float scale, bool f16) {
    constexpr int CH = chunk_values<F>();
    chunk_load<CH>(xv, x);
    if (norm) {
#pragma unroll
        for (int i = 0; i < CH; i++) xv[i] *= scale * nw[i];
    }
    if (f16) {
#pragma unroll
        for (int i = 0; i < CH; i++) xv[i] = round_f16(xv[i]);
    }
    return chunk_sum<CH>(xv);
}

// Where output (row, t) goes.
__device__ __forceinline__ float* out_slot(const gemv_params& p, int64_t row, int t) {
    int s = 0;
    while (s + 1 < p.n_seg && row >= p.seg[s + 1].row0) s++;
    return p.seg[s].out + t * p.seg[s].ld + (row - p.seg[s].row0);
}

// Returns what it stored.
__device__ __forceinline__ float store_out(const gemv_params& p, int64_t row, int t, float v) {
    float* o = out_slot(p, row, t);
    const float r = p.accumulate ? *o + v : v;
    *o = r;
    return r;
}

template <dfmt F, int R, int TB>
__global__ void __launch_bounds__(k_warps * 32) gemv_kernel(const gemv_params p, int L) {
    constexpr int CH = chunk_values<F>();
    constexpr bool AFFINE = F != dfmt::bf16;
    __shared__ float s_inv[k_gemv_max_norm_rows];
    const int64_t K = p.W.cols, N = p.W.rows, n_chunks = K / CH, rw = p.W.row_words(), ng = p.W.n_groups();
    pdl_trigger();
    if (p.norm_w) {
        // where the token groups are one pass over the grid's y (a decode batch's router: 16 rows, 4 groups of 4),
        // a block normalises only its own rows: one round trip of loads instead of T / 4
        const bool one_pass = (int64_t)gridDim.y * TB >= p.T;
        const int t0 = one_pass ? (int)blockIdx.y * TB : 0, n = one_pass ? max(0, min(TB, p.T - t0)) : p.T;
        if (n > 0) block_inv_rms_rows(s_inv + t0, p.x + t0 * p.ldx, p.ldx, n, K, p.eps);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sl = lane % L;
    const int64_t row0 = ((int64_t)blockIdx.x * k_warps + warp) * (32 / L) * R + (lane / L) * R;
    // note: an idle subgroup must not return: its lanes still take part in the warp's shuffles below
    const bool active = row0 < N;
    const uint4* wbase[R];
#pragma unroll
    for (int r = 0; r < R; r++) wbase[r] = reinterpret_cast<const uint4*>(p.W.w + min(row0 + r, N - 1) * rw);

    // blockIdx.y: this block's group of TB input rows (a small matrix, e.g. the router, still fills the GPU)
    for (int t0 = blockIdx.y * TB; t0 < p.T; t0 += TB * gridDim.y) {
        float acc[R][TB];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int tb = 0; tb < TB; tb++) acc[r][tb] = 0.0f;
        for (int64_t c0 = sl; active && c0 < n_chunks; c0 += U * L) {
            uint4 wv[U][R];
            uint32_t sb[U][R];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t c = min(c0 + u * L, n_chunks - 1);
#pragma unroll
                for (int r = 0; r < R; r++) {
                    wv[u][r] = __ldg(wbase[r] + c);
                    if constexpr (AFFINE) sb[u][r] = __ldg(p.W.sb + min(row0 + r, N - 1) * ng + (c * CH) / p.W.group);
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t c = c0 + u * L;
                if (c >= n_chunks) break;
                float nw[CH];
                if (p.norm_w) chunk_load<CH>(nw, p.norm_w + c * CH);
#pragma unroll
                for (int tb = 0; tb < TB; tb++) {
                    const int t = t0 + tb;
                    if (t >= p.T) break;
                    float xv[CH];
                    const float sx = load_x_chunk<F>(xv, p.x + t * p.ldx + c * CH, nw, p.norm_w != nullptr,
                                                     p.norm_w ? s_inv[t] : 1.0f, p.f16_inputs);
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        const float d = chunk_dot<F>(wv[u][r], xv, sx);
                        if constexpr (AFFINE)
                            acc[r][tb] += sb_scale(sb[u][r]) * d + sb_bias(sb[u][r]) * sx;
                        else
                            acc[r][tb] += d;
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int tb = 0; tb < TB; tb++)
                for (int o = L / 2; o > 0; o >>= 1) acc[r][tb] += __shfl_xor_sync(0xffffffffu, acc[r][tb], o);
        if (active && sl == 0) {
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int tb = 0; tb < TB; tb++)
                    if (row0 + r < N && t0 + tb < p.T) store_out(p, row0 + r, t0 + tb, acc[r][tb]);
        }
    }
}

// T == 1 for rows that gemv_warp_kernel does not take. Lane l multiplies the chunks l, l+32, ... of every row,
// so the input row is normalised and held in registers once; the weights stream through a shared-memory ring of
// tiles of whole rows (stream.cuh), queued before the kernel waits for its input (loading them into registers
// instead keeps only a few KB per warp in flight).
int64_t gemv_slot_bytes(const dmat& W, int64_t rows) {
    return align16(rows * W.row_words() * 4) + align16(rows * W.n_groups() * 4);
}

template <dfmt F, int CPL, int THREADS, int S, int RPW>
__global__ void __launch_bounds__(THREADS) gemv_stream_kernel(const gemv_params p, int tr, int64_t slot_bytes) {
    constexpr int CH = chunk_values<F>();
    constexpr bool AFFINE = F != dfmt::bf16;
    extern __shared__ __align__(16) char smem[];
    const int64_t K = p.W.cols, N = p.W.rows, rw = p.W.row_words(), ng = p.W.n_groups();
    float* s_x = reinterpret_cast<float*>(smem);
    char* slots = smem + align16((K / CH) * (CH + 4) * 4);
    const int64_t code_bytes = align16((int64_t)tr * rw * 4);
    const int n = block_tiles((N + tr - 1) / tr);
    auto rows_of = [&](int j, int64_t& r0) { return block_tile_rows(j, tr, N, r0); };
    auto issue = [&](int j) {
        int64_t r0;
        const int nr = rows_of(j, r0);
        char* s = slots + (j % S) * slot_bytes;
        block_copy_async(s, p.W.w + r0 * rw, nr * rw * 4);
        if constexpr (AFFINE) block_copy_async(s + code_bytes, p.W.sb + r0 * ng, nr * ng * 4);
    };
    // The weights do not depend on the input: they stream while the previous kernel finishes (PDL) and while
    // the block normalises and stages x.
    pdl_trigger();
    ring_start<S>(n, 0, issue);
    pdl_wait();
    __shared__ float red[32];
    float xv[CPL][CH], sx[CPL];
    stage_x<CH, CPL>(xv, sx, p.x, p.norm_w, p.eps, K, s_x, red, p.f16_inputs);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int gi[CPL];  // lane's scale/bias word in a row, per chunk
#pragma unroll
    for (int i = 0; i < CPL; i++) gi[i] = AFFINE ? ((lane + 32 * i) * CH) / p.W.group : 0;
    // RPW rows per warp at a time (r, r + W, ... of the tile): the per-row work outside the dot products (loop,
    // reduction, store) is shared, and the rows' loads and FFMA chains are independent. A row past the tile's end
    // is skipped (warp-uniform branch).
    constexpr int W = THREADS / 32;
    ring_run<S>(n, issue, [&](int j) {
        int64_t r0;
        const int nr = rows_of(j, r0);
        const char* s = slots + (j % S) * slot_bytes;
        for (int r = warp; r < nr; r += RPW * W) {
            uint4 wv[RPW][CPL];  // the rows' shared-memory loads first, then RPW x CPL independent FFMA chains
            uint32_t sb[RPW][CPL];
#pragma unroll
            for (int q = 0; q < RPW; q++) {
                if (q > 0 && r + q * W >= nr) break;
                const uint4* wr = reinterpret_cast<const uint4*>(s + (int64_t)(r + q * W) * rw * 4);
                const uint32_t* sbr = reinterpret_cast<const uint32_t*>(s + code_bytes) + (int64_t)(r + q * W) * ng;
#pragma unroll
                for (int i = 0; i < CPL; i++) {
                    wv[q][i] = wr[lane + 32 * i];
                    sb[q][i] = AFFINE ? sbr[gi[i]] : 0u;
                }
            }
            float acc[RPW];
#pragma unroll
            for (int q = 0; q < RPW; q++) {
                acc[q] = 0.0f;
                if (q > 0 && r + q * W >= nr) break;
#pragma unroll
                for (int i = 0; i < CPL; i++) {
                    const float d = chunk_dot<F>(wv[q][i], xv[i], sx[i]);
                    if constexpr (AFFINE)
                        acc[q] += sb_scale(sb[q][i]) * d + sb_bias(sb[q][i]) * sx[i];
                    else
                        acc[q] += d;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                for (int q = 0; q < RPW; q++) acc[q] += __shfl_xor_sync(0xffffffffu, acc[q], o);
            if (lane == 0)
#pragma unroll
                for (int q = 0; q < RPW; q++)
                    if (r + q * W < nr) store_out(p, r0 + r + q * W, 0, acc[q]);
        }
    });
}

// The ring plan of gemv_stream_kernel: S slots of tiles over the SMs, beside the staged input row.
template <dfmt F, int S>
stream_plan gemv_stream_plan(const gemv_params& p, int threads) {
    constexpr int CH = chunk_values<F>();
    const size_t x_bytes = (size_t)align16((p.W.cols / CH) * (CH + 4) * 4);
    return plan_stream<S>(p.W.rows, sm_count(), x_bytes, threads, [&](int64_t r) { return gemv_slot_bytes(p.W, r); });
}

template <dfmt F, int CPL, int THREADS, int S, int RPW>
void launch_stream_as(const gemv_params& p, const stream_plan& pl, cudaStream_t stream) {
    allow_dynamic_smem<gemv_stream_kernel<F, CPL, THREADS, S, RPW>>(stream_smem_limit());
    const int64_t blocks = std::min<int64_t>(pl.tiles, sm_count());
    launch_pdl(gemv_stream_kernel<F, CPL, THREADS, S, RPW>, dim3((unsigned)blocks), dim3(THREADS), pl.smem, stream,
               p, pl.rows_per_tile, pl.slot_bytes);
}

// Inputs in <= 64 registers per lane: where a slot of a 3-slot ring holds 32 rows (4-bit rows of K <= 2048), tiles
// of 32 rows, two rows per warp (a 14 MB projection's whole share per SM in flight, as 6 slots of 16 rows, with
// half the per-tile and per-row overhead: the K = 2048 projections spent half their instructions outside the dot
// products; measured: docs/PERF.md); else (8-bit or bf16 rows, fewer rows) a 6-slot ring of tiles of one row
// per warp. Wider inputs (K = 4096 at 4 bits): 8 warps (255 registers each), tiles of
// 8 rows, one per warp, 3 slots (a block's ~16 rows).
template <dfmt F, int CPL>
void launch_stream(const gemv_params& p, cudaStream_t stream) {
    if constexpr (CPL * chunk_values<F>() > 64) {
        launch_stream_as<F, CPL, k_stream_threads_wide, 3, 1>(p, gemv_stream_plan<F, 3>(p, k_stream_threads_wide), stream);
    } else {
        const stream_plan three = gemv_stream_plan<F, 3>(p, k_stream_threads);
        if (three.rows_per_tile >= 2 * (k_stream_threads / 32))
            launch_stream_as<F, CPL, k_stream_threads, 3, 2>(p, three, stream);
        else
            launch_stream_as<F, CPL, k_stream_threads, 6, 1>(p, gemv_stream_plan<F, 6>(p, k_stream_threads), stream);
    }
}

// ---- One input row of 4-bit rows in fast mode: per-warp rows and rings, as MoE gate/up (moe.cu). Warp
// gw (of NW) owns rows gw, gw + NW, ... and streams them through its own S-row ring in shared memory (queued
// before the PDL wait: weights only), waiting only for its own rows (cp.async groups, __syncwarp): no tile
// barriers, a row is used as soon as it lands. One barrier stages the int8 input (xq.cuh).
__host__ __device__ inline int64_t gemv_row_bytes(const dmat& W) { return W.row_words() * 4 + W.n_groups() * 4; }

// TAP: p.tap's epilogue (gemv_router_tap_supports: warp w of block b owns row 16 b + w alone): thread e < R.rows
// holds router row e's codes for the block's 16 columns (loaded before the PDL wait: weights), and after the rows
// are written adds their part of logit e.
template <int CPL, int S, bool TAP>
__global__ void __launch_bounds__(k_stream_threads) gemv_warp_kernel(const gemv_params p) {
    constexpr int W = k_stream_threads / 32;
    static_assert(!TAP || W == 16, "the tap reads 16 router columns per block");
    extern __shared__ __align__(16) char smem[];
    __shared__ float s_tap[TAP ? W : 1];  // nw * out of the block's rows
    uint4 rc = {};
    uint32_t rsb = 0;
    if constexpr (TAP) {
        const dmat& R = p.tap.R;
        const int64_t c0 = (int64_t)blockIdx.x * W;
        if (threadIdx.x % 32 == 0) s_tap[threadIdx.x / 32] = 0.0f;
        if (threadIdx.x < R.rows) {
            rc = *reinterpret_cast<const uint4*>(R.w + threadIdx.x * R.row_words() + c0 / 4);
            rsb = R.sb[threadIdx.x * R.n_groups() + c0 / R.group];
        }
    }
    const int64_t K = p.W.cols, N = p.W.rows, rw = p.W.row_words(), ng = p.W.n_groups();
    const int64_t code = rw * 4, row_bytes = code + ng * 4;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    char* ring = smem + align16(xq_stage_bytes(K / 32)) + (int64_t)warp * S * row_bytes;
    const int64_t NW = (int64_t)gridDim.x * W, gw = (int64_t)blockIdx.x * W + warp;
    const int nr = gw < N ? (int)((N - gw + NW - 1) / NW) : 0;
    auto issue = [&](int i) {
        const int64_t row = gw + i * NW;
        char* s = ring + (i % S) * row_bytes;
        warp_copy_async(s, p.W.w + row * rw, (int)code);
        warp_copy_async(s + code, p.W.sb + row * ng, (int)(ng * 4));
    };
    pdl_trigger();
    ring_start<S>(nr, 0, issue);
    // lane 0: the first row's tap weight (a weight: before the wait) and, accumulating, its old output (after
    // it), so that the store after the first dot waits for no L2 round trip (out_proj, with the tap: the only
    // row of its warp, and the kernel's last step)
    float tap_w0 = 0.0f, old0 = 0.0f;
    if constexpr (TAP)
        if (lane == 0 && nr > 0) tap_w0 = p.tap.nw[gw];
    pdl_wait();
    float* out0 = nullptr;
    if (lane == 0 && nr > 0) {
        out0 = out_slot(p, gw, 0);
        if (p.accumulate) old0 = *out0;
    }
    xq_chunk xc[CPL];
    int gi[CPL];
    stage_lane_xq(xc, gi, smem, p.x, p.norm_w, p.eps, K, p.W.group);
    warp_ring_run<S>(nr, issue, [&](int i) {
        const char* s = ring + (i % S) * row_bytes;
        const uint4* w = reinterpret_cast<const uint4*>(s);
        const uint32_t* sb = reinterpret_cast<const uint32_t*>(s + code);
        float acc = 0;
#pragma unroll
        for (int c = 0; c < CPL; c++) {
            const uint32_t v = sb[gi[c]];
            acc += sb_scale(v) * chunk_dot_xq(w[lane + 32 * c], xc[c]) + sb_bias(v) * xc[c].sum;
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            const int64_t row = gw + i * NW;
            float v;
            if (i == 0) {
                v = p.accumulate ? old0 + acc : acc;
                *out0 = v;
            } else {
                v = store_out(p, row, 0, acc);
            }
            if constexpr (TAP) s_tap[warp] = v * (i == 0 ? tap_w0 : p.tap.nw[row]);
        }
    });
    if constexpr (TAP) {
        __syncthreads();
        if (threadIdx.x < p.tap.R.rows) {
            const uint32_t w[4] = {rc.x, rc.y, rc.z, rc.w};
            float d = 0.0f, sx = 0.0f;
#pragma unroll
            for (int k = 0; k < 4; k++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const float v = s_tap[4 * k + c];
                    d = fmaf(byte_to_float(w[k], c), v, d), sx += v;
                }
            const long long q = __float2ll_rn((sb_scale(rsb) * d + sb_bias(rsb) * sx) * k_tap_logit_scale);
            atomicAdd(p.tap.logits + threadIdx.x * k_tap_stride, (unsigned long long)q);  // two's complement: signed sums wrap right
        }
    }
}

// Ring rows per warp: 6 where they fit (K = 2048: a projection's ~6 rows per warp all in flight), else 3; 0 where
// the kernel does not apply (a row's scale/bias words must be whole 16-byte copies).
int gemv_warp_slots(const gemv_params& p) {
    if ((p.W.n_groups() * 4) % 16 != 0) return 0;
    const int64_t rb = gemv_row_bytes(p.W);
    for (int s : {6, 3})
        if (warp_ring_smem(xq_stage_bytes(p.W.cols / 32), s, rb) <= stream_smem_limit() &&
            (size_t)(k_stream_threads / 32) * s * rb <= 120 * 1024)
            return s;
    return 0;
}

template <int CPL, int S, bool TAP>
void launch_warp_as(const gemv_params& p, cudaStream_t stream) {
    const size_t smem = warp_ring_smem(xq_stage_bytes(p.W.cols / 32), S, gemv_row_bytes(p.W));
    allow_dynamic_smem<gemv_warp_kernel<CPL, S, TAP>>(stream_smem_limit());
    const int64_t blocks = std::min<int64_t>(sm_count(), (p.W.rows + k_stream_threads / 32 - 1) / (k_stream_threads / 32));
    launch_pdl(gemv_warp_kernel<CPL, S, TAP>, dim3((unsigned)blocks), dim3(k_stream_threads), smem, stream, p);
}

template <int CPL>
void launch_warp(const gemv_params& p, int slots, cudaStream_t stream) {
    if (p.tap.logits) {
        if (slots == 6) launch_warp_as<CPL, 6, true>(p, stream);
        else launch_warp_as<CPL, 3, true>(p, stream);
    } else {
        if (slots == 6) launch_warp_as<CPL, 6, false>(p, stream);
        else launch_warp_as<CPL, 3, false>(p, stream);
    }
}

// ---- 4-bit weights on tensor cores through the ring: mma_dot.cuh does the dot products for 1..16 input rows;
// the weight tiles stream through the ring as gemv_stream_kernel's (rows padded in shared memory), the K units of a tile's 16-row blocks
// are split over the warps and folded through shared memory.
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
__host__ __device__ inline int64_t mma_x_stride(int64_t K) { return K + 32; }
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

// One input row in either mode; up to k_mma_max_tokens rows in fast mode (fp16 inputs: one staged copy each).
bool mma_gemv_supports(const gemv_params& p) {
    return (p.T == 1 ? mma_decode_enabled(mma_gemv1) : p.T <= k_mma_max_tokens && p.f16_inputs && mma_decode_enabled(mma_gemvn)) &&
           mma_dot_supports(p.W) &&
           mma_ring_slots(p.W, mma_k_chunks(p.W.cols, p.W.group, k_mma_threads / 32), p.T, p.f16_inputs) > 0;
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

void launch_mma(const gemv_params& p, cudaStream_t stream) {
    const int nkc = mma_k_chunks(p.W.cols, p.W.group, k_mma_threads / 32);
    if (mma_ring_slots(p.W, nkc, p.T, p.f16_inputs) == 6)
        launch_mma_ring<6>(p, nkc, k_mma_ring_budget, stream);
    else
        launch_mma_ring<3>(p, nkc, mma_budget_wide(p.T), stream);
}

// ---- Several input rows (2..16) of 4-bit rows on tensor cores, per warp from global memory. The ring kernel
// above spends a 16-row tile's time in its barriers and fold, and at K = 4096 16 rows' x does not fit beside its
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
// and the sums of each 64-column block's rounded values at s_sum[16 b + t]; x * s_inv[t] * nw with nw. The loads
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
                if (in && lane % 16 == 0) s_sum[(k / 64) * k_mma_max_tokens + t] = sum;
            }
        }
    }
}

// grid: blocks of 16-row blocks [n_rb b / grid, n_rb (b + 1) / grid); nkc k-chunks of K / 64 / nkc blocks each.
// NG: groups of 8 input rows per A fragment (T <= 8 NG). Shared memory: x [T][K + 32] fp16 | sums [K/64][16] |
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
    float* s_red = s_sum + nb * k_mma_max_tokens;
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
    for (int i = threadIdx.x; i < nb * (k_mma_max_tokens - T); i += blockDim.x)  // the sums' unused columns
        s_sum[(i / (k_mma_max_tokens - T)) * k_mma_max_tokens + T + i % (k_mma_max_tokens - T)] = 0.0f;
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
            const float s0 = sb_scale(r.s[b][0]), z0 = sb_bias(r.s[b][0]), s1 = sb_scale(r.s[b][1]), z1 = sb_bias(r.s[b][1]);
#pragma unroll
            for (int n = 0; n < NG; n++) {
                const float2 sx = *reinterpret_cast<const float2*>(s_sum + blk * k_mma_max_tokens + 8 * n + 2 * c);
                y[n][0] += s0 * acc[n][0] + z0 * sx.x, y[n][1] += s0 * acc[n][1] + z0 * sx.y;
                y[n][2] += s1 * acc[n][2] + z1 * sx.x, y[n][3] += s1 * acc[n][3] + z1 * sx.y;
            }
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
    // two steps in registers: one multiplied while the other loads
    for (int st = 0; st < n_steps; st += 2) {
        compute(st, A);
        if (st + 2 < n_steps) load(st + 2, A);
        if (st + 1 >= n_steps) break;
        compute(st + 1, B);
        if (st + 3 < n_steps) load(st + 3, B);
    }
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

// gemv_mma_warp_kernel's launch: the k-chunks per 16-row block (a divisor of K / 64) that give the busiest warp
// the least work (its 64-column blocks, plus one per item for its flush), fewer chunks on a tie (a smaller
// fold); blocks = 0 where it does not apply.
struct mma_warp_plan {
    int blocks = 0, nkc = 0, gshift = 0;
    size_t smem = 0;
};

mma_warp_plan plan_mma_warp(const gemv_params& p) {
    mma_warp_plan pl;
    const dmat& W = p.W;
    const int groups64 = W.group / 64;
    if (p.T < 2 || p.T > k_mma_max_tokens || !p.f16_inputs || !mma_decode_enabled(mma_gemvn) || !mma_dot_supports(W) ||
        W.group % 64 != 0 || (groups64 & (groups64 - 1)) != 0 || W.cols % 64 != 0 || W.rows < 1)
        return pl;
    const int64_t n_rb = (W.rows + 15) / 16, blocks = std::min<int64_t>(n_rb, sm_count()), rbpb = (n_rb + blocks - 1) / blocks;
    const int nb = (int)(W.cols / 64), warps = k_mw_threads / 32;
    const size_t fixed = (size_t)align16(2 * p.T * mma_x_stride(W.cols)) + (size_t)nb * k_mma_max_tokens * 4;
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

template <int NG>
void launch_mma_warp_as(const gemv_params& p, const mma_warp_plan& pl, cudaStream_t stream) {
    allow_dynamic_smem<gemv_mma_warp_kernel<NG>>(stream_smem_limit());
    launch_pdl(gemv_mma_warp_kernel<NG>, dim3((unsigned)pl.blocks), dim3(k_mw_threads), pl.smem, stream, p, pl.nkc,
               pl.gshift);
}

void launch_mma_warp(const gemv_params& p, const mma_warp_plan& pl, cudaStream_t stream) {
    if (p.T <= 8) launch_mma_warp_as<1>(p, pl, stream);
    else launch_mma_warp_as<2>(p, pl, stream);
}

// Chunks per lane when the row splits evenly over 32 lanes and the input fits in 128 registers; else 0.
template <dfmt F>
int xs_chunks_per_lane(int64_t n_chunks) {
    if (n_chunks % 32) return 0;
    const int64_t cpl = n_chunks / 32;
    return cpl * chunk_values<F>() <= 128 ? (int)cpl : 0;
}

// The per-warp ring's rows per warp where gemv(p) takes int8 inputs (gemv_int8_inputs), else 0.
int int8_warp_slots(const gemv_params& p) {
    const bool int8 = decode_int8_inputs() && p.f16_inputs && p.W.fmt == dfmt::q4 && p.T == 1 && !mma_gemv_supports(p) &&
                      xs_chunks_per_lane<dfmt::q4>(p.W.cols / 32) != 0;
    return int8 ? gemv_warp_slots(p) : 0;
}

template <dfmt F, int R, int TB>
void launch_rt(const gemv_params& p, int L, cudaStream_t stream) {
    const int64_t per_block = (int64_t)k_warps * (32 / L) * R;
    const int64_t blocks = (p.W.rows + per_block - 1) / per_block;
    // token groups across blocks when the rows alone leave SMs idle (>= 2 blocks per SM otherwise)
    const int64_t groups = std::min<int64_t>((p.T + TB - 1) / TB, std::max<int64_t>(1, 2 * sm_count() / blocks));
    gemv_kernel<F, R, TB><<<dim3((unsigned)blocks, (unsigned)groups), k_warps * 32, 0, stream>>>(p, L);
}

template <dfmt F>
void launch(const gemv_params& p, cudaStream_t stream) {
    const int64_t n_chunks = p.W.cols / chunk_values<F>();
    if (mma_gemv_supports(p)) {
        launch_mma(p, stream);
        CUDA_CHECK_LAUNCH();
        return;
    }
    if (p.T == 1) {
        bool done = true;
        if (const int slots = int8_warp_slots(p)) {
            if constexpr (F == dfmt::q4) {
                switch (xs_chunks_per_lane<F>(n_chunks)) {
                    case 1: launch_warp<1>(p, slots, stream); break;
                    case 2: launch_warp<2>(p, slots, stream); break;
                    case 4: launch_warp<4>(p, slots, stream); break;
                    default: TANSY_CHECK(false, "gemv: no int8-input kernel for %lld chunks", (long long)n_chunks);
                }
            }
        } else {
            switch (xs_chunks_per_lane<F>(n_chunks)) {
                case 1: launch_stream<F, 1>(p, stream); break;
                case 2: launch_stream<F, 2>(p, stream); break;
                case 4: launch_stream<F, 4>(p, stream); break;
                case 8:
                    if constexpr (chunk_values<F>() <= 16) launch_stream<F, 8>(p, stream);
                    else done = false;
                    break;
                default: done = false;
            }
        }
        if (done) {
            CUDA_CHECK_LAUNCH();
            return;
        }
    }
    const int L = gemv_lanes_per_row(n_chunks);
    // Rows per subgroup: more rows share each input chunk, but the grid must still cover every SM several
    // times over (132 SMs on an H200).
    const int64_t rows_per_r1_block = (int64_t)k_warps * (32 / L);
    const int64_t blocks_r1 = (p.W.rows + rows_per_r1_block - 1) / rows_per_r1_block;
    const int R = blocks_r1 >= 4096 ? 4 : blocks_r1 >= 2048 ? 2 : 1;
    if (p.T == 1) {
        if (R == 4) launch_rt<F, 4, 1>(p, L, stream);
        else if (R == 2) launch_rt<F, 2, 1>(p, L, stream);
        else launch_rt<F, 1, 1>(p, L, stream);
    } else {  // 4 input rows per pass: at most 2 rows per subgroup, or the accumulators spill
        if (R >= 2) launch_rt<F, 2, 4>(p, L, stream);
        else launch_rt<F, 1, 4>(p, L, stream);
    }
    CUDA_CHECK_LAUNCH();
}

}  // namespace

bool gemv_int8_inputs(const gemv_params& p) { return int8_warp_slots(p) != 0; }

bool gemv_router_tap_supports(const gemv_params& p) {
    const dmat& R = p.tap.R;
    const int64_t N = p.W.rows;
    return int8_warp_slots(p) != 0 && p.n_seg == 1 && R.fmt == dfmt::q8 && R.cols == N && N % 16 == 0 &&
           N <= (int64_t)sm_count() * (k_stream_threads / 32) && R.group % 16 == 0 && R.rows >= 1 &&
           R.rows <= k_stream_threads && p.tap.nw;
}

int gemv_lanes_per_row(int64_t n_chunks) {
    int L = 1;
    while (L < 32 && 2 * L <= n_chunks) L *= 2;
    return L;
}

void gemv(const gemv_params& p, cudaStream_t stream) {
    TANSY_CHECK(!p.tap.logits || gemv_router_tap_supports(p), "gemv: router tap on an unsupported shape");
    const int CH = p.W.fmt == dfmt::q4 ? 32 : p.W.fmt == dfmt::q8 ? 16 : 8;
    TANSY_CHECK(p.W.cols % CH == 0, "gemv: %lld columns is not a multiple of %d", (long long)p.W.cols, CH);
    TANSY_CHECK(p.W.fmt == dfmt::bf16 || (p.W.group % CH == 0), "gemv: group %d vs chunk %d", p.W.group, CH);
    TANSY_CHECK(p.ldx % 4 == 0 && p.T >= 1, "gemv: ldx %lld, T %d", (long long)p.ldx, p.T);
    TANSY_CHECK(!p.norm_w || p.T <= k_gemv_max_norm_rows, "gemv: norm prologue with T=%d", p.T);
    TANSY_CHECK(p.n_seg >= 1 && p.n_seg <= 4 && p.seg[0].row0 == 0, "gemv: %d segments", p.n_seg);
    if (p.W.rows == 0) return;
    if (const mma_warp_plan pl = plan_mma_warp(p); pl.blocks > 0) {  // 2..16 rows on tensor cores, per warp
        launch_mma_warp(p, pl, stream);
        CUDA_CHECK_LAUNCH();
        return;
    }
    if (p.T > k_mma_group_tokens && !mma_gemv_supports(p)) {  // rows in groups of 8 on tensor cores where they fit
        gemv_params q = p;
        q.T = k_mma_group_tokens;
        if (mma_gemv_supports(q)) {
            for (int t0 = 0; t0 < p.T; t0 += k_mma_group_tokens) {
                q.T = std::min(k_mma_group_tokens, p.T - t0);
                q.x = p.x + t0 * p.ldx;
                for (int i = 0; i < p.n_seg; i++) q.seg[i].out = p.seg[i].out + t0 * p.seg[i].ld;
                gemv(q, stream);
            }
            return;
        }
    }
    switch (p.W.fmt) {
        case dfmt::q4: launch<dfmt::q4>(p, stream); break;
        case dfmt::q8: launch<dfmt::q8>(p, stream); break;
        case dfmt::bf16: launch<dfmt::bf16>(p, stream); break;
    }
}

}  // namespace tansy::cuda
