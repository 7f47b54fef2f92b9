// GEMV, one input row streamed: y = W x for decode's T == 1 where the int8 per-warp form (gemv_warp.cu) does not
// apply (8-bit or bf16 rows, fp16 inputs, precise mode). Lane l multiplies the chunks l, l+32, ... of every row,
// so the input row is normalised and held in registers once; the weights stream through a shared-memory ring of
// tiles of whole rows (stream.cuh), queued before the kernel waits for its input (PDL), because loading them into
// registers instead keeps only a few KB per warp in flight.
#include <algorithm>

#include "backend/cuda/gemv_family.cuh"

namespace tansy::cuda::gemv_impl {

namespace {

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

template <dfmt F>
bool run_stream_as(const gemv_params& p, cudaStream_t stream) {
    switch (xs_chunks_per_lane<F>(p.W.cols / chunk_values<F>())) {
        case 1: launch_stream<F, 1>(p, stream); return true;
        case 2: launch_stream<F, 2>(p, stream); return true;
        case 4: launch_stream<F, 4>(p, stream); return true;
        case 8:
            if constexpr (chunk_values<F>() <= 16) {
                launch_stream<F, 8>(p, stream);
                return true;
            } else {
                return false;
            }
        default: return false;
    }
}

}  // namespace

bool run_stream(const gemv_params& p, cudaStream_t stream) {
    switch (p.W.fmt) {
        case dfmt::q4: return run_stream_as<dfmt::q4>(p, stream);
        case dfmt::q8: return run_stream_as<dfmt::q8>(p, stream);
        case dfmt::bf16: return run_stream_as<dfmt::bf16>(p, stream);
    }
    return false;
}

}  // namespace tansy::cuda::gemv_impl
