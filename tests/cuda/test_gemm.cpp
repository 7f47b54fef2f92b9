// Tensor-core gemm (CUDA) vs its CPU twin on odd shapes with fresh random inputs, for every weight format and
// epilogue, dense and grouped (the MoE work list from moe_plan, with ragged expert loads), plus moe_plan's
// routing invariants and moe_combine.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <random>
#include <tuple>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/moe.cuh"
#include "cuda_test_util.h"
#include "op_twins.h"
#include "test_matrix.h"

using namespace tansy;

namespace {

using cuda::dfmt;
using test::f16_round;
using test::test_matrix;

// Against a reference fed the same fp16-rounded operands, only the fp32 summation order differs.
constexpr double TOL_GEMM_EMULATED = 2e-5;
// The small-M MoE kernels' h16: fp16 outputs (2^-12 relative rounding per value) over fp32 math.
constexpr double TOL_MOE_SMALL_H = 1e-3;
// Against the fp32 reference: both operands rounded to fp16 (2^-11 relative each) give ~4e-4 relative error on
// dot products of random terms, up to ~3x that for short rows (K = 64); a wrong term gives O(1).
constexpr double TOL_GEMM_FP32 = 2.5e-3;
// precise mode (bf16 hi + lo operands, three products): each operand keeps ~17 bits, the dropped lo x lo term is
// 2^-18 relative; dot products land near 1e-5 of the fp32 result.
constexpr double TOL_GEMM_PRECISE = 3e-5;


// y[t, n] = sum_k x[t, k] W[row_of(n), k] in fp32 (operands optionally fp16-rounded as the fast kernel does)
std::vector<float> reference(const test_matrix& W, const std::vector<float>& x, int64_t T, int64_t row0, int64_t N,
                             bool round) {
    const int64_t K = W.m.cols;
    std::vector<float> xr = x;
    if (round)
        for (float& v : xr) v = f16_round(v);
    std::vector<float> y((size_t)(T * N));
    for (int64_t n = 0; n < N; n++) {
        const std::vector<float> w = W.row(row0 + n, round);
        for (int64_t t = 0; t < T; t++) y[(size_t)(t * N + n)] = cpu::dot(xr.data() + t * K, w.data(), K);
    }
    return y;
}

float silu(float v) { return v / (1.0f + std::exp(-v)); }

template <class T>
cuda::device_buffer to_device(const std::vector<T>& v) {
    cuda::device_buffer b(std::max<size_t>(v.size(), 1) * sizeof(T));
    if (!v.empty()) b.upload(v.data(), v.size() * sizeof(T));
    return b;
}
template <class T>
std::vector<T> from_device(const cuda::device_buffer& b, size_t n) {
    std::vector<T> v(n);
    b.download(v.data(), n * sizeof(T));
    return v;
}

// The fast mode's A operand: rows x cols floats at dx (row stride cols) as fp16 times scale (to_f16).
cuda::device_buffer fp16_of(const cuda::device_buffer& dx, int64_t rows, int64_t cols, float scale = 1.0f) {
    cuda::device_buffer b(std::max<size_t>((size_t)(rows * cols), 1) * 2);
    cuda::to_f16((uint16_t*)b.get(), (const float*)dx.get(), rows, cols, cols, scale, 0);
    return b;
}

// Routing of T tokens to k distinct experts each out of E (E > 10): expert 3 picked by most tokens (so that it has
// full and partial tiles), 7..9 never (experts without rows).
std::vector<int32_t> skewed_routing(int T, int E, int k, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> idx((size_t)T * k);
    for (int t = 0; t < T; t++) {
        std::vector<int32_t> pool;
        for (int e = 0; e < E; e++)
            if (e < 7 || e > 9) pool.push_back(e);
        std::shuffle(pool.begin(), pool.end(), rng);
        if (rng() % 8 != 0) std::iter_swap(pool.begin(), std::find(pool.begin(), pool.end(), 3));
        for (int j = 0; j < k; j++) idx[(size_t)t * k + j] = pool[(size_t)j];
    }
    return idx;
}

}  // namespace

struct gemm_case {
    int fmt;  // 0 q4, 1 q8, 2 bf16
    int64_t N, K;
    int M;
    bool accumulate;
};

class cuda_gemm : public ::testing::TestWithParam<gemm_case> {};

TEST_P(cuda_gemm, dense_store_matches_cpu_twin) {
    TANSY_REQUIRE_GPU();
    const gemm_case g = GetParam();
    const dfmt f = g.fmt == 0 ? dfmt::q4 : g.fmt == 1 ? dfmt::q8 : dfmt::bf16;
    const uint32_t seed = (uint32_t)(g.N * 131 + g.K * 7 + g.M);
    test_matrix W(f, g.N, g.K, seed);
    auto x = test::random_normal((size_t)(g.M * g.K), seed + 1, 2.0f);
    auto y0 = test::random_normal((size_t)(g.M * g.N), seed + 2);
    // two output tensors (a split at an odd row) to exercise the segments
    const int64_t split = g.N / 3 | 1;
    auto dx = to_device(x);
    std::vector<float> y0a, y0b;
    for (int64_t t = 0; t < g.M; t++) {
        y0a.insert(y0a.end(), y0.begin() + t * g.N, y0.begin() + t * g.N + split);
        y0b.insert(y0b.end(), y0.begin() + t * g.N + split, y0.begin() + (t + 1) * g.N);
    }
    const cuda::device_buffer dx16 = fp16_of(dx, g.M, g.K);
    std::vector<float> want[2];  // [round]: operands fp16-rounded as the fast kernels' (1) or fp32 (0)
    for (bool round : {true, false}) {
        want[round] = reference(W, x, g.M, 0, g.N, round);
        if (g.accumulate)
            for (size_t i = 0; i < want[round].size(); i++) want[round][i] += y0[i];
    }
    for (test::gemm_form form : test::gemm_dense_forms()) {
        test::gemm_form_scope kernel(form);
        SCOPED_TRACE(test::gemm_form_name(form));
        for (bool precise : {false, true})
            // K unsplit, in 3 slices (uneven past 3 k-tiles; the kernels that split: precise and wgmma) and as the
            // device's plan chooses
            for (int split_k : {1, 3, 0}) {
                auto da = to_device(y0a), db = to_device(y0b);
                cuda::gemm_params p;
                p.precise = precise;
                p.W = W.d, p.N = g.N, p.x = (const float*)dx.get(), p.ldx = g.K, p.M = g.M;
                p.x16 = (const uint16_t*)dx16.get(), p.ldx16 = g.K;
                p.seg[0] = {(float*)da.get(), split, 0};
                p.seg[1] = {(float*)db.get(), g.N - split, split};
                p.n_seg = 2, p.accumulate = g.accumulate;
                p.split_k = split_k;
                const size_t ws_floats = cuda::gemm_split_floats(p);
                if (split_k != 1 && ws_floats == 0) continue;  // no split for this kernel and shape
                cuda::device_buffer ws(std::max<size_t>(ws_floats, 1) * sizeof(float));
                p.split_ws = ws_floats ? (float*)ws.get() : nullptr;
                SCOPED_TRACE("K slices " + std::to_string(cuda::gemm_split_slices(p)));
                const uint64_t tma_calls = cuda::gemm_tma_calls();
                cuda::gemm(p, 0);
                ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
                if (form.tma && !precise && f == dfmt::q4 && g.M >= cuda::k_gemm_wide_min_rows) {  // 256-token tiles
                    EXPECT_EQ(cuda::gemm_tma_calls(), tma_calls + 1) << "the form with X by TMA did not take it";
                }
                auto ga = from_device<float>(da, y0a.size()), gb = from_device<float>(db, y0b.size());
                std::vector<float> got;
                for (int64_t t = 0; t < g.M; t++) {
                    got.insert(got.end(), ga.begin() + t * split, ga.begin() + (t + 1) * split);
                    got.insert(got.end(), gb.begin() + t * (g.N - split), gb.begin() + (t + 1) * (g.N - split));
                }
                for (bool round : {true, false}) {
                    if (precise && round) continue;
                    const double tol = precise ? TOL_GEMM_PRECISE : round ? TOL_GEMM_EMULATED : TOL_GEMM_FP32;
                    EXPECT_LT(test::rel_error(got, want[round]), tol) << (precise ? "precise" : round ? "fp16-emulated" : "fp32");
                }
            }
    }
}

// The K split's choice: the calls whose CTAs leave most SMs idle split (a decode batch's output projection on
// wgmma, the router's precise GEMM), prompt-sized calls and grouped or non-store calls do not; a forced count is
// capped at the k-tiles.
TEST(cuda_gemm_split, slices_where_the_tiles_leave_sms_idle) {
    TANSY_REQUIRE_GPU();
    test_matrix out_proj(dfmt::q4, 2048, 4096, 5), router(dfmt::q8, 257, 2048, 6);
    cuda::gemm_params p;
    p.W = out_proj.d, p.N = 2048, p.M = 64, p.split_k = 0;
    if (cuda::gemm_wgmma_enabled()) {
        EXPECT_GT(cuda::gemm_split_slices(p), 1);
        EXPECT_EQ(cuda::gemm_split_floats(p), (size_t)cuda::gemm_split_slices(p) * 64 * 2048);
    }
    p.M = 4096;
    EXPECT_EQ(cuda::gemm_split_slices(p), 1);  // 8 x 16 CTAs of 256 tokens
    p.W = router.d, p.N = 257, p.M = 64, p.precise = true;
    EXPECT_GT(cuda::gemm_split_slices(p), 1);
    p.split_k = 1;
    EXPECT_EQ(cuda::gemm_split_slices(p), 1);
    p.split_k = 64;
    EXPECT_EQ(cuda::gemm_split_slices(p), 2048 / 64);
    p.epi = cuda::gemm_epilogue::rows;
    EXPECT_EQ(cuda::gemm_split_slices(p), 1);
    EXPECT_EQ(cuda::gemm_split_floats(p), 0u);
}

INSTANTIATE_TEST_SUITE_P(shapes, cuda_gemm,
                         ::testing::Values(gemm_case{0, 200, 256, 33, false}, gemm_case{0, 4096 + 64, 2048, 100, true},
                                           gemm_case{0, 1000, 4096, 129, false}, gemm_case{0, 64, 64, 1, false},
                                           gemm_case{0, 257, 512, 64, true}, gemm_case{1, 257, 2048, 64, false},
                                           gemm_case{1, 33, 192, 70, true}, gemm_case{2, 130, 512, 77, false},
                                           gemm_case{2, 2048, 128, 31, true}, gemm_case{0, 136, 192, 3, false},
                                           gemm_case{0, 300, 320, 17, true}, gemm_case{0, 520, 256, 255, false},
                                           // from k_gemm_wide_min_rows rows: 128-row tiles, partial last tile
                                           gemm_case{0, 1000, 1024, 600, false}, gemm_case{0, 257, 64, 517, true},
                                           gemm_case{0, 4160, 2048, 1000, true}, gemm_case{1, 257, 512, 517, true},
                                           gemm_case{2, 130, 256, 530, false},
                                           // a decode batch's output projection and router: K split by the plan
                                           gemm_case{0, 2048, 4096, 64, true}, gemm_case{0, 257, 2048, 48, false}));

// to_f16 over more rows than its grid (4,096 blocks: each block strides over rows) from a padded row stride:
// every value exactly fp16(v * scale), nothing written past a row's cols values.
TEST(cuda_gemm_scale, to_f16_rows_past_the_grid) {
    TANSY_REQUIRE_GPU();
    const int64_t rows = 4099, cols = 12, ld = 20;
    const float scale = 0.25f;
    auto x = test::random_normal((size_t)(rows * ld), 41, 3.0f);
    auto dx = to_device(x);
    const size_t n = (size_t)(rows * cols) + 4;  // + a guard of 4 values past the last row
    std::vector<uint16_t> guard(n, 0x7C00);      // +inf: a value the conversion of these inputs never gives
    auto dy = to_device(guard);
    cuda::to_f16((uint16_t*)dy.get(), (const float*)dx.get(), rows, cols, ld, scale, 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto y = from_device<uint16_t>(dy, n);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            ASSERT_EQ(test::f16_bits_to_float(y[(size_t)(r * cols + c)]), f16_round(x[(size_t)(r * ld + c)] * scale))
                << "row " << r << " col " << c;
    for (size_t i = (size_t)(rows * cols); i < n; i++) ASSERT_EQ(y[i], 0x7C00) << "written past the rows";
}

// Fast mode with activations past the fp16 range: a_scale 2^-4 keeps them exact to fp16 precision; without it
// they saturate (finite, never inf or NaN).
TEST(cuda_gemm_scale, large_activations) {
    TANSY_REQUIRE_GPU();
    const int64_t N = 96, K = 512;
    const int M = 600;  // 128-row tiles (wgmma on sm_90)
    test_matrix W(dfmt::q4, N, K, 77);
    auto x = test::random_normal((size_t)(M * K), 78, 3e4f);  // ~3% of the values beyond 65504
    auto dx = to_device(x);
    cuda::device_buffer dy((size_t)(M * N) * 4);
    for (test::gemm_form form : test::gemm_dense_forms()) {
        test::gemm_form_scope kernel(form);
        SCOPED_TRACE(test::gemm_form_name(form));
        for (float scale : {1.0f / 16.0f, 1.0f}) {
            const cuda::device_buffer dx16 = fp16_of(dx, M, K, scale);
            cuda::gemm_params p;
            p.W = W.d, p.N = N, p.x16 = (const uint16_t*)dx16.get(), p.ldx16 = K, p.M = M, p.a_scale = scale;
            p.seg[0] = {(float*)dy.get(), N, 0};
            cuda::gemm(p, 0);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            auto got = from_device<float>(dy, (size_t)(M * N));
            for (float v : got) ASSERT_TRUE(std::isfinite(v));
            if (scale == 1.0f) continue;
            EXPECT_LT(test::rel_error(got, reference(W, x, M, 0, N, false)), TOL_GEMM_FP32);
        }
    }
}

// 4-bit groups of 32 (two (scale, bias) per 64-value k-tile) and 128 (one per two k-tiles) next to the default 64,
// on 64-row tiles (M = 17) and the widest dense tiles (M = 600).
// K = 1664: 26 k-tiles, so the wgmma GEMM's (scale, bias) chunks (4 k-tiles with groups of 32, 8 else) wrap around
// its slots; 13 groups of 128 a row, rows not 16-byte aligned; K in 3 slices: chunks starting inside a group.
TEST(cuda_gemm_groups, q4_group_sizes_match_cpu_twin) {
    TANSY_REQUIRE_GPU();
    const int64_t N = 200;
    for (test::gemm_form form : test::gemm_dense_forms()) {
        test::gemm_form_scope kernel(form);
        SCOPED_TRACE(test::gemm_form_name(form));
        for (int group : {32, 128})
            for (int64_t K : {512, 1664})
                for (int M : {17, 600})
                    for (int split_k : {1, 3}) {
                        test_matrix W(dfmt::q4, N, K, 90 + (uint32_t)group, group);
                        auto x = test::random_normal((size_t)(M * K), 91 + (uint32_t)M, 1.0f);
                        auto dx = to_device(x);
                        const cuda::device_buffer dx16 = fp16_of(dx, M, K);
                        cuda::device_buffer dy((size_t)(M * N) * 4);
                        cuda::gemm_params p;
                        p.W = W.d, p.N = N, p.x16 = (const uint16_t*)dx16.get(), p.ldx16 = K, p.M = M;
                        p.seg[0] = {(float*)dy.get(), N, 0};
                        p.split_k = split_k;
                        const size_t ws_floats = cuda::gemm_split_floats(p);
                        if (split_k != 1 && ws_floats == 0) continue;  // no split for this kernel and shape
                        cuda::device_buffer ws(std::max<size_t>(ws_floats, 1) * 4);
                        p.split_ws = ws_floats ? (float*)ws.get() : nullptr;
                        cuda::gemm(p, 0);
                        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
                        EXPECT_LT(test::rel_error(from_device<float>(dy, (size_t)(M * N)), reference(W, x, M, 0, N, true)),
                                  TOL_GEMM_EMULATED)
                            << "group " << group << ", K " << K << ", M " << M << ", K slices " << cuda::gemm_split_slices(p);
                    }
    }
}

// Dense SwiGLU epilogue (the shared expert): out = silu(x Wg^T) * (x Wu^T).
TEST(cuda_gemm_swiglu, dense_matches_cpu_twin) {
    TANSY_REQUIRE_GPU();
    for (test::gemm_form form : test::gemm_dense_forms()) {
        test::gemm_form_scope kernel(form);
        SCOPED_TRACE(test::gemm_form_name(form));
        for (auto [N, K, M] : {std::tuple<int64_t, int64_t, int>{512, 2048, 97}, {64, 256, 40}, {100, 128, 3}, {96, 512, 700}}) {
            test_matrix Wg(dfmt::q4, N, K, 11 + (uint32_t)N), Wu(dfmt::q4, N, K, 12 + (uint32_t)N);
            auto x = test::random_normal((size_t)(M * K), 13, 1.0f);
            auto dx = to_device(x);
            const cuda::device_buffer dx16 = fp16_of(dx, M, K);
            cuda::device_buffer dout((size_t)(M * N) * 4), dout16((size_t)(M * N) * 2);
            cuda::gemm_params p;
            p.W = Wg.d, p.W2 = Wu.d, p.N = N, p.x16 = (const uint16_t*)dx16.get(), p.ldx16 = K, p.M = M;
            p.epi = cuda::gemm_epilogue::swiglu, p.out = (float*)dout.get(), p.ldo = N;
            cuda::gemm(p, 0);
            // the same as the next GEMM's fp16 input, scaled by 2^-4 (the MoE down projection's a_scale)
            cuda::gemm_params p16 = p;
            p16.out = nullptr, p16.out16 = (uint16_t*)dout16.get(), p16.out16_scale = 1.0f / 16.0f;
            cuda::gemm(p16, 0);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            auto got = from_device<float>(dout, (size_t)(M * N));
            auto got16 = from_device<uint16_t>(dout16, (size_t)(M * N));
            for (bool round : {true, false}) {
                auto g = reference(Wg, x, M, 0, N, round), u = reference(Wu, x, M, 0, N, round);
                std::vector<float> want(g.size());
                for (size_t i = 0; i < g.size(); i++) want[i] = silu(g[i]) * u[i];
                EXPECT_LT(test::rel_error(got, want), round ? TOL_GEMM_EMULATED : 2 * TOL_GEMM_FP32)
                    << N << "x" << K << " M=" << M << (round ? " fp16-emulated" : " fp32");  // 2x: two products
            }
            for (size_t i = 0; i < got.size(); i++)  // exactly the fp32 result, scaled and rounded once to fp16
                ASSERT_EQ(test::f16_bits_to_float(got16[i]), f16_round(got[i] / 16.0f)) << "out16 element " << i;
        }
    }
}

// Routed experts: moe_plan over ragged loads (an expert with most tokens, experts with none), then the grouped
// gate/up (SwiGLU, rows gathered per slot) and down (sorted rows), then the combine, vs the CPU per slot.
TEST(cuda_gemm_grouped, moe_experts_match_cpu_twin) {
    TANSY_REQUIRE_GPU();
    const int E = 16;
    const int64_t D = 256, F = 128;
    // T = 600: expert 3 gets ~500 rows, so the 128-row tiles have full and partial ones; T = 2100: 8,400 slots,
    // more than the plan kernel's one pass over 8 x 1,024; k = 10: the combine's rows in two rounds (8 in flight)
    for (test::gemm_form form : test::gemm_dense_forms()) {  // (routed down calls take X by TMA too)
        test::gemm_form_scope kernel(form);
        SCOPED_TRACE(test::gemm_form_name(form));
        const bool wg = form.wgmma;
        std::vector<std::tuple<int, int, int>> cases = {{1, 64, 4}, {37, 64, 4}, {37, 64, 10}, {300, 64, 4}, {300, 128, 4}, {600, 128, 4}, {2100, 128, 4}};
        if (wg)  // the wgmma GEMM's 80-row tiles: both of its widths (48 and 80 tokens), full and partial tiles
            cases.insert(cases.end(), {{37, 80, 4}, {300, 80, 4}, {600, 80, 4}});
        for (auto [T, bm, k] : cases) {
            SCOPED_TRACE("T=" + std::to_string(T) + " tiles of " + std::to_string(bm) + " k=" + std::to_string(k));
            const std::vector<int32_t> idx = skewed_routing(T, E, k, 1000 + (uint32_t)T);
            auto wt = test::random_uniform((size_t)T * k, 5, 0.0f, 1.0f);
            auto sig = test::random_uniform((size_t)T, 6, 0.0f, 1.0f);
            test_matrix Wg(dfmt::q4, E * F, D, 21), Wu(dfmt::q4, E * F, D, 22), Wd(dfmt::q4, E * D, F, 23);
            auto x = test::random_normal((size_t)T * D, 24, 1.0f);
            auto ys = test::random_normal((size_t)T * D, 25, 1.0f);  // stands in for the shared expert's output
            auto res = test::random_normal((size_t)T * D, 26, 1.0f);  // the residual stream

            const int max_tiles = cuda::moe_max_tiles(T, E, k, bm);
            auto didx = to_device(idx), dx = to_device(x), dwt = to_device(wt), dsig = to_device(sig), dys = to_device(ys),
                 dres = to_device(res);
            cuda::device_buffer perm((size_t)T * k * 4), pos((size_t)T * k * 4), tiles((size_t)max_tiles * sizeof(cuda::gemm_tile)),
                ntiles(4), h((size_t)T * k * F * 4), y((size_t)T * k * D * 4);
            cuda::moe_plan((int32_t*)perm.get(), (int32_t*)pos.get(), (cuda::gemm_tile*)tiles.get(), (int32_t*)ntiles.get(),
                           (const int32_t*)didx.get(), T, E, k, bm, 0);
            const cuda::device_buffer dx16 = fp16_of(dx, T, D);
            cuda::gemm_params g;
            g.W = Wg.d, g.W2 = Wu.d, g.N = F, g.x16 = (const uint16_t*)dx16.get(), g.ldx16 = D;
            g.gather = (const int32_t*)perm.get(), g.gather_div = k;
            g.tiles = (const cuda::gemm_tile*)tiles.get(), g.n_tiles = (const int32_t*)ntiles.get(), g.max_tiles = max_tiles;
            g.tile_bm = bm;
            g.epi = cuda::gemm_epilogue::swiglu, g.out = (float*)h.get(), g.ldo = F;
            cuda::gemm(g, 0);
            cuda::gemm_params d = g;
            const cuda::device_buffer h16 = fp16_of(h, (int64_t)T * k, F);
            d.W = Wd.d, d.W2 = {}, d.N = D, d.x16 = (const uint16_t*)h16.get(), d.ldx16 = F, d.gather = nullptr;
            d.epi = cuda::gemm_epilogue::rows, d.out = (float*)y.get(), d.ldo = D, d.M = T * k;  // h16's rows (TMA)
            const uint64_t tma_calls = cuda::gemm_tma_calls();
            cuda::gemm(d, 0);
            if (form.tma && (bm == 64 || bm == 80)) {  // the wgmma GEMM's tiles
                EXPECT_EQ(cuda::gemm_tma_calls(), tma_calls + 1) << "the routed down call with X by TMA did not take it";
            }
            cuda::moe_combine((float*)dres.get(), D, (const float*)y.get(), (const float*)dys.get(), (const int32_t*)pos.get(),
                              (const float*)dwt.get(), (const float*)dsig.get(), T, k, D, 0);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

            // plan invariants: perm is a permutation sorted by expert, pos_of its inverse, tiles cover each expert
            auto hp = from_device<int32_t>(perm, (size_t)T * k), hpos = from_device<int32_t>(pos, (size_t)T * k);
            const int nt = from_device<int32_t>(ntiles, 1)[0];
            auto ht = from_device<cuda::gemm_tile>(tiles, (size_t)max_tiles);
            std::vector<int> seen((size_t)T * k, 0);
            for (int p = 0; p < T * k; p++) {
                ASSERT_GE(hp[(size_t)p], 0);
                ASSERT_LT(hp[(size_t)p], T * k);
                seen[(size_t)hp[(size_t)p]]++;
                EXPECT_EQ(hpos[(size_t)hp[(size_t)p]], p);
                if (p > 0) {
                    EXPECT_LE(idx[(size_t)hp[(size_t)p - 1]], idx[(size_t)hp[(size_t)p]]) << "sorted by expert";
                }
            }
            for (int s : seen) EXPECT_EQ(s, 1);
            ASSERT_LE(nt, max_tiles);
            int covered = 0;
            for (int i = 0; i < nt; i++) {
                const cuda::gemm_tile& tl = ht[(size_t)i];
                ASSERT_GT(tl.rows, 0);
                ASSERT_LE(tl.rows, bm);
                EXPECT_EQ(tl.row0, covered);
                for (int r = tl.row0; r < tl.row0 + tl.rows; r++) EXPECT_EQ(idx[(size_t)hp[(size_t)r]], tl.expert);
                covered += tl.rows;
            }
            EXPECT_EQ(covered, T * k);

            // numerics per slot (fp32 reference, fp16-rounded operands as in the fast kernel)
            auto gh = from_device<float>(h, (size_t)T * k * F), gy = from_device<float>(dres, (size_t)T * D);
            std::vector<float> want_h((size_t)T * k * F), got_h(want_h.size()), want = res;
            for (int t = 0; t < T; t++) {
                std::vector<float> xt(x.begin() + (size_t)t * D, x.begin() + (size_t)(t + 1) * D);
                for (size_t i = 0; i < (size_t)D; i++) want[(size_t)t * D + i] += sig[(size_t)t] * ys[(size_t)t * D + i];
                for (int j = 0; j < k; j++) {
                    const int e = idx[(size_t)t * k + j], p = hpos[(size_t)t * k + j];
                    auto gg = reference(Wg, xt, 1, (int64_t)e * F, F, true), uu = reference(Wu, xt, 1, (int64_t)e * F, F, true);
                    std::vector<float> hh((size_t)F);
                    for (size_t i = 0; i < (size_t)F; i++) hh[i] = silu(gg[i]) * uu[i];
                    std::copy(hh.begin(), hh.end(), want_h.begin() + ((size_t)t * k + j) * F);
                    std::copy(gh.begin() + (size_t)p * F, gh.begin() + (size_t)(p + 1) * F, got_h.begin() + ((size_t)t * k + j) * F);
                    // down from the GPU's own h (isolates the down GEMM from the gate/up rounding)
                    std::vector<float> hg(gh.begin() + (size_t)p * F, gh.begin() + (size_t)(p + 1) * F);
                    auto yy = reference(Wd, hg, 1, (int64_t)e * D, D, true);
                    for (size_t i = 0; i < (size_t)D; i++) want[(size_t)t * D + i] += wt[(size_t)t * k + j] * yy[i];
                }
            }
            EXPECT_LT(test::rel_error(got_h, want_h), TOL_GEMM_EMULATED) << "gate/up T=" << T;
            EXPECT_LT(test::rel_error(gy, want), TOL_GEMM_EMULATED) << "down + combine T=" << T;
        }
    }
}

// The small-M grouped MoE kernels (moe_grouped_mma.cu) on moe_plan's 16-row tiles with the shared expert's tiles
// appended: plan invariants, then h16 (gate/up with SwiGLU, fp16 times h_scale) and y (down, from the GPU's own
// h16) per sorted row against fp32 references of the same fp16 operands. T = 17 (one or two rows per tile), 40,
// 255 (expert 3 in most tokens: many full 16-row tiles and a partial one), and 8 (fewer rows than one mma group).
TEST(cuda_gemm_grouped, moe_small_kernels_match_cpu_twin) {
    TANSY_REQUIRE_GPU();
    const int E = 16, k = 4;
    const int64_t D = 256, F = 128;
    const float h_scale = 1.0f / 16.0f;
    test_matrix Wg(dfmt::q4, E * F, D, 31), Wu(dfmt::q4, E * F, D, 32), Wd(dfmt::q4, E * D, F, 33);
    test_matrix Sg(dfmt::q4, F, D, 34), Su(dfmt::q4, F, D, 35), Sd(dfmt::q4, D, F, 36);
    cuda::dmoe m;
    m.gate = Wg.d, m.up = Wu.d, m.down = Wd.d, m.s_gate = Sg.d, m.s_up = Su.d, m.s_down = Sd.d;
    m.E = E, m.k = k, m.F = F, m.Fs = F, m.D = D;
    ASSERT_TRUE(cuda::moe_small_supports(m));
    for (int T : {8, 17, 40, 255}) {
        SCOPED_TRACE("T=" + std::to_string(T));
        const std::vector<int32_t> idx = skewed_routing(T, E, k, 2000 + (uint32_t)T);
        auto x = test::random_normal((size_t)T * D, 37, 1.0f);
        const int Tk = T * k, rows = Tk + T, bm = cuda::k_moe_small_bm;
        const int max_tiles = cuda::moe_max_tiles(T, E, k, bm, /*shared=*/true);
        auto didx = to_device(idx), dx = to_device(x);
        cuda::device_buffer perm((size_t)Tk * 4), pos((size_t)Tk * 4), tiles((size_t)max_tiles * sizeof(cuda::gemm_tile)),
            ntiles(4), h16((size_t)rows * F * 2), y((size_t)rows * D * 4);
        cuda::moe_plan((int32_t*)perm.get(), (int32_t*)pos.get(), (cuda::gemm_tile*)tiles.get(), (int32_t*)ntiles.get(),
                       (const int32_t*)didx.get(), T, E, k, bm, 0, /*shared=*/true);
        const cuda::device_buffer dx16 = fp16_of(dx, T, D);
        cuda::moe_small_gate_up((uint16_t*)h16.get(), m, (const uint16_t*)dx16.get(), (const int32_t*)perm.get(),
                                (const cuda::gemm_tile*)tiles.get(), (const int32_t*)ntiles.get(), max_tiles, T, h_scale, 0);
        cuda::moe_small_down((float*)y.get(), m, (const uint16_t*)h16.get(), (const cuda::gemm_tile*)tiles.get(),
                             (const int32_t*)ntiles.get(), max_tiles, T, h_scale, 0);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

        // plan: routed tiles as moe_plan's (sorted by expert, <= 16 rows), then the shared expert's over [Tk, Tk + T)
        auto hp = from_device<int32_t>(perm, (size_t)Tk);
        const int nt = from_device<int32_t>(ntiles, 1)[0];
        auto ht = from_device<cuda::gemm_tile>(tiles, (size_t)max_tiles);
        ASSERT_LE(nt, max_tiles);
        int covered = 0, multi = 0;
        for (int i = 0; i < nt; i++) {
            const cuda::gemm_tile& tl = ht[(size_t)i];
            ASSERT_GT(tl.rows, 0);
            ASSERT_LE(tl.rows, bm);
            EXPECT_EQ(tl.row0, covered);
            for (int r = tl.row0; r < tl.row0 + tl.rows; r++)
                EXPECT_EQ(r < Tk ? idx[(size_t)hp[(size_t)r]] : E, tl.expert) << "row " << r;
            if (i > 0 && ht[(size_t)i - 1].expert == tl.expert) multi++;
            covered += tl.rows;
        }
        EXPECT_EQ(covered, rows);
        if (T >= 40) {
            EXPECT_GT(multi, 0) << "some expert spans several tiles";
        }

        // numerics per sorted row: fp32 references of the fp16 input (exact 4-bit weights: the kernels apply scale
        // and bias in fp32, not to fp16-rounded weights)
        auto gh = from_device<uint16_t>(h16, (size_t)rows * F);
        auto gy = from_device<float>(y, (size_t)rows * D);
        std::vector<float> want_h((size_t)rows * F), got_h(want_h.size()), want_y((size_t)rows * D);
        for (int r = 0; r < rows; r++) {
            const int t = r < Tk ? hp[(size_t)r] / k : r - Tk;
            const int64_t e = r < Tk ? idx[(size_t)hp[(size_t)r]] : -1;
            std::vector<float> xt(x.begin() + (size_t)t * D, x.begin() + (size_t)(t + 1) * D);
            for (float& v : xt) v = f16_round(v);
            auto gg = e >= 0 ? reference(Wg, xt, 1, e * F, F, false) : reference(Sg, xt, 1, 0, F, false);
            auto uu = e >= 0 ? reference(Wu, xt, 1, e * F, F, false) : reference(Su, xt, 1, 0, F, false);
            std::vector<float> hg((size_t)F);
            for (size_t i = 0; i < (size_t)F; i++) {
                want_h[(size_t)r * F + i] = silu(gg[i]) * uu[i];
                hg[i] = test::f16_bits_to_float(gh[(size_t)r * F + i]);
                got_h[(size_t)r * F + i] = hg[i] / h_scale;
            }
            // down from the GPU's own h16 (isolates it from the gate/up rounding)
            auto yy = e >= 0 ? reference(Wd, hg, 1, e * D, D, false) : reference(Sd, hg, 1, 0, D, false);
            for (size_t i = 0; i < (size_t)D; i++) want_y[(size_t)r * D + i] = yy[i] / h_scale;
        }
        EXPECT_LT(test::rel_error(got_h, want_h), TOL_MOE_SMALL_H) << "gate/up";
        EXPECT_LT(test::rel_error(gy, want_y), TOL_GEMM_EMULATED) << "down";
    }
}

// The backend ops that switch to the tensor-core path for many rows (fused projections, residual matmul, the
// whole MoE block with grouped experts), vs the CPU backend on tiny and real shapes.
namespace {

// fp16 operands (see TOL_GEMM_FP32), compounded through the MoE's chained products (gate/up, SwiGLU, down).
constexpr double TOL_GEMM_OP = 3e-3;
// precise GEMMs: only the fp32 summation order and ~2^-17 operand residue differ.
constexpr double TOL_GEMM_OP_PRECISE = 1e-4;

// T = 600: past k_gemm_wide_min_rows, the dense GEMMs take 128-row tiles (wgmma on sm_90).
void check_many_rows(test::pair_of_backends& p, bool precise, std::initializer_list<int> row_counts) {
    using test::twin;
    const model_config& c = p.m.cfg;
    const layer_weights& gl = p.m.w.layers[0];
    const layer_weights& al = p.m.w.layers[3];
    for (int T : row_counts) {
        twin x(p, T, c.hidden, 200 + T, 2.0f), z(p, T, c.lin_value_dim(), 300 + T);
        twin qkv(p, T, c.lin_conv_dim()), b(p, T, c.lin_v_heads), a(p, T, c.lin_v_heads);
        twin qg(p, T, c.q_proj_rows()), k(p, T, c.kv_dim()), v(p, T, c.kv_dim());
        twin xm(p, T, c.hidden, 400 + T, 2.0f);
        for (auto* be : {p.cpu.get(), p.gpu.get()}) {
            const bool g = be == p.gpu.get();
            auto pick = [&](twin& t) { return g ? t.g.t() : t.c.t(); };
            be->project({pick(qkv), pick(z), pick(b), pick(a)}, pick(x), test::vv(gl.input_norm), c.eps,
                        {&gl.gdn.in_qkv, &gl.gdn.in_z, &gl.gdn.in_b, &gl.gdn.in_a});
            be->project({pick(qg), pick(k), pick(v)}, pick(x), test::vv(al.input_norm), c.eps,
                        {&al.attn.q_proj, &al.attn.k_proj, &al.attn.v_proj});
            be->matmul(pick(x), pick(z), gl.gdn.out_proj, true);
            be->moe(pick(xm), test::vv(gl.post_norm), c.eps, gl.moe);
        }
        const double tol = precise ? TOL_GEMM_OP_PRECISE : TOL_GEMM_OP;
        for (twin* t : {&qkv, &z, &b, &a, &qg, &k, &v}) EXPECT_LT(t->diff(p), tol) << "project T=" << T;
        EXPECT_LT(x.diff(p), tol) << "matmul accumulate T=" << T;
        EXPECT_LT(xm.diff(p), tol) << "moe T=" << T;
        const bool wide = !precise && T >= cuda::k_gemm_wide_min_rows && cuda::gemm_wgmma_enabled();
        printf("[ gemm ops %s, dense on %s, T=%d ] qkv %.2e qg %.2e matmul %.2e moe %.2e\n", precise ? "precise" : "fast",
               test::gemm_kernel_name(wide), T, qkv.diff(p), qg.diff(p), x.diff(p), xm.diff(p));
    }
}

}  // namespace

TEST(cuda_gemm_ops, tiny_shapes) {
    TANSY_REQUIRE_GPU();
    for (bool precise : {false, true})
        for (bool wg : test::gemm_wgmma_modes()) {
            if (precise && wg) continue;  // precise mode has one kernel
            auto p = test::make_pair(test::tiny_config(), precise);
            test::gemm_wgmma_scope kernel(wg);
            SCOPED_TRACE(test::gemm_kernel_name(wg));
            check_many_rows(*p, precise, {16, 77, 300, 600});
        }
}

TEST(cuda_gemm_ops, real_shapes) {
    TANSY_REQUIRE_GPU();
    for (bool precise : {false, true})
        for (bool wg : test::gemm_wgmma_modes()) {
            if (precise && wg) continue;  // precise mode has one kernel
            auto p = test::make_pair(test::real_config(), precise);
            test::gemm_wgmma_scope kernel(wg);
            SCOPED_TRACE(test::gemm_kernel_name(wg));
            if (precise)
                check_many_rows(*p, precise, {16, 77, 300});
            else  // 600 rows: the dense projections on 128-row tiles (wgmma) at the real widths
                check_many_rows(*p, precise, {16, 77, 300, 600});
        }
}
