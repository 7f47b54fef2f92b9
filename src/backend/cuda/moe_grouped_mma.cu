// MoE of a decode batch (32 .. kernel_plan::moe_small rows, fast mode) on tensor cores, over moe_plan's
// expert-sorted tiles of <= 16 rows (the shared expert as expert E, rows [T k, T k + T)):
//   moe_small_kernel<true>   gate/up: the tile's inputs (m16) -> h16[p] = fp16(silu(gate) * up * h_scale)
//   moe_small_kernel<false>  down: the tile's rows of h16 -> y[p] = dot / h_scale (fp32); moe_combine sums a
//                            token's rows into x in a fixed order (deterministic)
// A block takes one tile and a slice of its items (16 weight rows x the whole K; gate/up: the gate and up rows of
// the same features, so SwiGLU happens in registers). It stages the tile's rows as gemv_mma_warp.cu does; each
// warp loads its A fragments (4-bit codes, made exact fp16 pairs: q4_fragments) from global memory a step ahead
// and multiplies them with the rows as B columns (mma.m16n8k16, NG = 1 or 2 groups of 8).
// Why fast: each expert a step touches is read once for all its rows (groups of 16 rows read it once per group;
// the GEMMs' 64-row tiles hold 2-8 rows per expert here). The plan comes from a plain launch, so a block learns
// its weights only after pdl_wait.
#include <algorithm>
#include <atomic>

#include "backend/cuda/gemv_family.cuh"
#include "backend/cuda/mma_dot.cuh"
#include "backend/cuda/moe.cuh"

namespace tansy::cuda {

namespace {

using gemv_impl::mma_x_stride;

constexpr int k_ms_threads = 256, k_ms_warps = k_ms_threads / 32;
constexpr int k_ms_rows = k_moe_small_bm;
static_assert(k_ms_rows == 2 * k_mma_group_tokens, "a tile's rows are the B columns of one or two mma groups");

struct small_params {
    dmat W, W2;     // routed experts stacked [E N, K] (W2: up, gate/up only)
    dmat S, S2;     // the shared expert [N, K]
    int64_t N = 0;  // weight rows per expert: outputs per row
    int E = 0;
    const uint16_t* x16 = nullptr;  // the rows' inputs, fp16
    int64_t ldx = 0;
    const int32_t* perm = nullptr;  // gate/up: row p < Tk takes x16 row perm[p] / k, row p >= Tk row p - Tk; else p
    int k = 1, Tk = 0;
    const gemm_tile* tiles = nullptr;
    const int32_t* n_tiles = nullptr;
    uint16_t* h16 = nullptr;  // gate/up out [rows][N]
    float* y = nullptr;       // down out [rows][N]
    float scale = 1.0f;       // gate/up: times h_scale into h16; down: 1 / h_scale
    int gshift = 0;           // group = 64 << gshift
};

__host__ __device__ inline int64_t small_x_bytes(int64_t K) { return align16(2 * k_ms_rows * mma_x_stride(K)); }
// x [16][K + 32] fp16 | sums [K/64][16] fp32 | source rows [16] int32
inline size_t small_smem(int64_t K) { return (size_t)small_x_bytes(K) + (size_t)(K / 64) * k_ms_rows * 4 + k_ms_rows * 4; }

// The tile's cnt rows (fp16 already: m16 or h16; row t from src + s_src[t] * ld) into s_x in stage_x_pairs'
// layout, row t at s_x + t * xs, and each 64-column block's sum at s_sum[16 b + t]. Only permuted, not rounded.
// R words (8 values) per thread in flight together. K % 64 == 0, blockDim.x % 8 == 0. No barrier.
__device__ __forceinline__ void stage_rows_f16(uint16_t* s_x, int64_t xs, float* s_sum, const uint16_t* src, int64_t ld,
                                               const int32_t* s_src, int cnt, int64_t K) {
    constexpr int R = 4;
    const int nw = (int)(K / 8), total = cnt * nw, bd = blockDim.x;
    for (int i0 = 0; i0 < total; i0 += R * bd) {  // (uniform trip count: the shuffles below take every lane)
        uint4 v[R];
#pragma unroll
        for (int u = 0; u < R; u++) {
            const int i = i0 + u * bd + threadIdx.x;
            v[u] = i < total ? __ldg(reinterpret_cast<const uint4*>(src + (int64_t)s_src[i / nw] * ld) + i % nw)
                             : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < R; u++) {
            const int i = i0 + u * bd + threadIdx.x, t = i / nw, wd = i % nw;
            const uint32_t h[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h[j]));
                sum += f.x + f.y;
            }
            // 8 lanes: one 64-column block of one row (nw % 8 == 0, so i's groups of 8 never straddle rows)
#pragma unroll
            for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (i < total) {
                const int pos = (wd & ~7) | ((wd & 1) << 2) | ((wd & 7) >> 1);  // words 0 2 4 6 1 3 5 7
                // (x0 x1 | x2 x3 | x4 x5 | x6 x7) -> (x0 x4 | x1 x5 | x2 x6 | x3 x7)
                *reinterpret_cast<uint4*>(s_x + t * xs + 8 * pos) =
                    make_uint4(__byte_perm(h[0], h[2], 0x5410), __byte_perm(h[0], h[2], 0x7632),
                               __byte_perm(h[1], h[3], 0x5410), __byte_perm(h[1], h[3], 0x7632));
                if (wd % 8 == 0) s_sum[(wd / 8) * k_ms_rows + t] = sum;
            }
        }
    }
}

// One tile's share: stage its rows, then each warp's items. SWIGLU: matrices (W, W2) = (gate, up), out h16; else
// W = down, out y. NG: groups of 8 rows per A fragment (the tile's rows <= 8 NG).
template <bool SWIGLU, int NG>
__device__ __forceinline__ void small_tile(const small_params& p, const gemm_tile& tile, char* smem) {
    constexpr int M = SWIGLU ? 2 : 1, SB = SWIGLU ? 2 : 4, W = k_ms_warps;  // SB: 64-column blocks per step
    const bool sh = tile.expert == p.E;
    const int64_t K = p.W.cols, rw = p.W.row_words(), ng = p.W.n_groups(), xs = mma_x_stride(K);
    const int cnt = tile.rows, p0 = tile.row0, nb = (int)(K / 64), spi = (nb + SB - 1) / SB;  // steps per item
    uint16_t* s_x = reinterpret_cast<uint16_t*>(smem);
    float* s_sum = reinterpret_cast<float*>(smem + small_x_bytes(K));
    int32_t* s_src = reinterpret_cast<int32_t*>(s_sum + nb * k_ms_rows);

    // this tile's matrices: expert rows [e N, e N + N) of the stacked ones, or the shared expert's
    const int64_t wr0 = sh ? 0 : (int64_t)tile.expert * p.N;
    const uint32_t* wq[M];
    const uint32_t* ws[M];
    wq[0] = (sh ? p.S.w : p.W.w) + wr0 * rw, ws[0] = (sh ? p.S.sb : p.W.sb) + wr0 * ng;
    if constexpr (SWIGLU) wq[1] = (sh ? p.S2.w : p.W2.w) + wr0 * rw, ws[1] = (sh ? p.S2.sb : p.W2.sb) + wr0 * ng;

    const int n_items = (int)(p.N / 16), it0 = n_items * (int)blockIdx.x / (int)gridDim.x,
              it1 = n_items * ((int)blockIdx.x + 1) / (int)gridDim.x, n_wi = it1 - it0;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int n_steps = warp < n_wi ? (n_wi - warp + W - 1) / W * spi : 0;

    struct regs {  // one step: [matrix][block][row g, g + 8]
        uint2 a[M][SB][2];
        uint32_t s[M][SB][2];
    };
    struct where {
        int it, b0, b1;  // item, and this step's blocks [b0, b1)
    };
    auto locate = [&](int st) {
        where w;
        w.it = it0 + warp + W * (st / spi), w.b0 = (st % spi) * SB, w.b1 = min(w.b0 + SB, nb);
        return w;
    };
    auto load = [&](int st, regs& r) {
        const where w = locate(st);
        const int64_t ra = (int64_t)w.it * 16 + g, rb = ra + 8;  // (N % 16 == 0: both exist)
#pragma unroll
        for (int m = 0; m < M; m++) {
            const uint2* A0 = reinterpret_cast<const uint2*>(wq[m] + ra * rw) + c;  // block b's words 2c, 2c+1: [4 b]
            const uint2* A1 = reinterpret_cast<const uint2*>(wq[m] + rb * rw) + c;
#pragma unroll
            for (int b = 0; b < SB; b++) {
                const int blk = min(w.b0 + b, w.b1 - 1);  // (past the step's end: loaded again, not used)
                r.a[m][b][0] = __ldg(A0 + 4 * blk), r.a[m][b][1] = __ldg(A1 + 4 * blk);
                r.s[m][b][0] = __ldg(ws[m] + ra * ng + (blk >> p.gshift));
                r.s[m][b][1] = __ldg(ws[m] + rb * ng + (blk >> p.gshift));
            }
        }
    };

    if (threadIdx.x < cnt) {
        const int r = p0 + threadIdx.x;
        s_src[threadIdx.x] = p.perm ? (r < p.Tk ? p.perm[r] / p.k : r - p.Tk) : r;
    }
    for (int i = threadIdx.x; i < nb * k_ms_rows; i += blockDim.x)  // the sums' unused columns
        if (i % k_ms_rows >= cnt) s_sum[i] = 0.0f;
    regs A, B;
    if (n_steps > 0) load(0, A);  // weights in flight during the staging
    if (n_steps > 1) load(1, B);
    __syncthreads();
    stage_rows_f16(s_x, xs, s_sum, p.x16, p.ldx, s_src, cnt, K);
    __syncthreads();

    const uint16_t* xb[NG];  // this lane's B column: row 8 n + g (row 0 past cnt: that column is dropped)
#pragma unroll
    for (int n = 0; n < NG; n++) xb[n] = s_x + (8 * n + g < cnt ? 8 * n + g : 0) * xs + 8 * c;
    float y[M][NG][4];
    auto compute = [&](int st, const regs& r) {
        const where w = locate(st);
        if (w.b0 == 0)  // the item's first step
#pragma unroll
            for (int m = 0; m < M; m++)
#pragma unroll
                for (int n = 0; n < NG; n++) y[m][n][0] = y[m][n][1] = y[m][n][2] = y[m][n][3] = 0.0f;
#pragma unroll
        for (int b = 0; b < SB; b++) {
            const int blk = w.b0 + b;
            if (blk >= w.b1) break;
            float acc[M][NG][4];
#pragma unroll
            for (int m = 0; m < M; m++)
#pragma unroll
                for (int n = 0; n < NG; n++) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                uint4 xh[NG];  // one B fragment pair per group, for every matrix
#pragma unroll
                for (int n = 0; n < NG; n++) xh[n] = *reinterpret_cast<const uint4*>(xb[n] + (int64_t)(8 * blk + 4 * j) * 8);
#pragma unroll
                for (int m = 0; m < M; m++) {
                    uint32_t a02[4], a13[4];
                    q4_fragments(j ? r.a[m][b][0].y : r.a[m][b][0].x, j ? r.a[m][b][1].y : r.a[m][b][1].x, a02, a13);
#pragma unroll
                    for (int n = 0; n < NG; n++) {
                        mma_f16(acc[m][n], a02, xh[n].x, xh[n].y);
                        mma_f16(acc[m][n], a13, xh[n].z, xh[n].w);
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < M; m++) affine_accumulate<NG>(y[m], acc[m], r.s[m][b][0], r.s[m][b][1], s_sum + blk * k_ms_rows, c);
        }
        if (w.b1 < nb) return;  // the item goes on in the next step
        const int64_t f = (int64_t)w.it * 16 + g;  // this lane's outputs: weight rows f and f + 8 of row t
#pragma unroll
        for (int n = 0; n < NG; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int t = 8 * n + 2 * c + e;
                if (t >= cnt) continue;
                const int64_t o = (int64_t)(p0 + t) * p.N + f;
                if constexpr (SWIGLU) {  // as the fast GEMM's swiglu epilogue into out16 (gemm_tile.cuh store_pair)
                    p.h16[o] = (uint16_t)(pack_f16(siluf_(y[0][n][e]) * y[1][n][e] * p.scale, 0.0f) & 0xFFFFu);
                    p.h16[o + 8] = (uint16_t)(pack_f16(siluf_(y[0][n][2 + e]) * y[1][n][2 + e] * p.scale, 0.0f) & 0xFFFFu);
                } else {  // as its rows epilogue with a_scale
                    p.y[o] = y[0][n][e] * p.scale, p.y[o + 8] = y[0][n][2 + e] * p.scale;
                }
            }
    };
    two_step_pipeline(n_steps, A, B, load, compute);
}

// grid: (slices, max_tiles): a tile's slices start side by side (1.3% faster than tile-major at 64 and 256 rows,
// H100); blocks past *n_tiles exit.
template <bool SWIGLU>
__global__ void __launch_bounds__(k_ms_threads, 2) moe_small_kernel(const small_params p) {
    extern __shared__ __align__(16) char smem[];
    pdl_trigger();
    pdl_wait();  // the plan, the inputs and (down) h16 come from the kernels before
    if ((int)blockIdx.y >= *p.n_tiles) return;
    const gemm_tile tile = p.tiles[blockIdx.y];
    if (tile.rows <= k_mma_group_tokens)
        small_tile<SWIGLU, 1>(p, tile, smem);
    else
        small_tile<SWIGLU, 2>(p, tile, smem);
}

template <bool SWIGLU>
void launch_small(const small_params& p, int max_tiles, int items_per_warp, cudaStream_t stream) {
    const int64_t n_items = p.N / 16;
    const int slices = (int)std::max<int64_t>(1, n_items / ((int64_t)k_ms_warps * items_per_warp));
    const size_t smem = small_smem(p.W.cols);
    TANSY_CHECK(max_tiles <= 65535, "moe_small: %d tiles exceed the grid's y limit", max_tiles);
    // (the attribute is set once per kernel: the most any shape may take, as gemv_mma_warp.cu's)
    allow_dynamic_smem<moe_small_kernel<SWIGLU>>(stream_smem_limit());
    launch_pdl(moe_small_kernel<SWIGLU>, dim3((unsigned)slices, (unsigned)max_tiles), dim3(k_ms_threads), smem, stream, p);
}

int group_shift(int group) {
    int s = 0;
    while ((64 << s) < group) s++;
    return s;
}

std::atomic<uint64_t> g_small_launches{0};

}  // namespace

bool moe_small_supports(const dmoe& m) {
    const int group = m.gate.group;
    for (const dmat* W : {&m.gate, &m.up, &m.down, &m.s_gate, &m.s_up, &m.s_down})
        if (W->fmt != dfmt::q4 || !mma_dot_supports(*W) || W->group != group) return false;
    if (group % 64 != 0 || (64 << group_shift(group)) != group) return false;
    if (m.F != m.Fs || m.D % 64 != 0 || m.F % 64 != 0 || m.E < 1 || m.k < 1) return false;
    const bool shapes = m.gate.cols == m.D && m.up.cols == m.D && m.down.cols == m.F && m.s_gate.cols == m.D &&
                        m.s_up.cols == m.D && m.s_down.cols == m.F && m.s_gate.rows == m.F && m.s_up.rows == m.F &&
                        m.s_down.rows == m.D && m.gate.rows == m.E * m.F && m.up.rows == m.E * m.F &&
                        m.down.rows == m.E * m.D;
    return shapes && small_smem(std::max(m.D, m.F)) <= stream_smem_limit();
}

void moe_small_gate_up(uint16_t* h16, const dmoe& m, const uint16_t* m16, const int32_t* perm, const gemm_tile* tiles,
                       const int32_t* n_tiles, int max_tiles, int T, float h_scale, cudaStream_t stream) {
    TANSY_CHECK(moe_small_supports(m), "moe_small_gate_up: unsupported MoE (D %lld, F %lld, Fs %lld)", (long long)m.D,
                (long long)m.F, (long long)m.Fs);
    TANSY_CHECK((uintptr_t)m16 % 16 == 0, "moe_small_gate_up: m16 must be 16-byte aligned");
    g_small_launches.fetch_add(1, std::memory_order_relaxed);
    if (max_tiles == 0) return;
    small_params p;
    p.W = m.gate, p.W2 = m.up, p.S = m.s_gate, p.S2 = m.s_up, p.N = m.F, p.E = m.E;
    p.x16 = m16, p.ldx = m.D, p.perm = perm, p.k = m.k, p.Tk = T * m.k;
    p.tiles = tiles, p.n_tiles = n_tiles, p.h16 = h16, p.scale = h_scale, p.gshift = group_shift(m.gate.group);
    launch_small<true>(p, max_tiles, active_kernel_plan().moe_small_gate_up_items, stream);
}

void moe_small_down(float* y, const dmoe& m, const uint16_t* h16, const gemm_tile* tiles, const int32_t* n_tiles,
                    int max_tiles, int T, float h_scale, cudaStream_t stream) {
    TANSY_CHECK(moe_small_supports(m), "moe_small_down: unsupported MoE (D %lld, F %lld, Fs %lld)", (long long)m.D,
                (long long)m.F, (long long)m.Fs);
    TANSY_CHECK((uintptr_t)h16 % 16 == 0 && h_scale > 0.0f, "moe_small_down: h16 must be 16-byte aligned");
    if (max_tiles == 0) return;
    small_params p;
    p.W = m.down, p.S = m.s_down, p.N = m.D, p.E = m.E;
    p.x16 = h16, p.ldx = m.F, p.Tk = T * m.k;
    p.tiles = tiles, p.n_tiles = n_tiles, p.y = y, p.scale = 1.0f / h_scale, p.gshift = group_shift(m.down.group);
    launch_small<false>(p, max_tiles, active_kernel_plan().moe_small_down_items, stream);
}

uint64_t moe_small_launches() { return g_small_launches.load(std::memory_order_relaxed); }

}  // namespace tansy::cuda
