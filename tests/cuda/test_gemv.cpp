// gemv (CUDA) vs cpu::matmul (+ cpu::rms_norm) on odd shapes and fresh random inputs, for every weight format.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/gemv.cuh"
#include "cuda_test_util.h"
#include "test_matrix.h"

using namespace tansy;

namespace {

// fp32 accumulation in a different order (lanes, groups): relative error ~1e-6; 1e-5 catches any wrong term.
constexpr double TOL_GEMV_REL = 1e-5;
// Norm then fp16 rounding: the device's norm (rsqrtf, another summation order) moves some inputs across an fp16
// rounding boundary, each such input off by one fp16 step (2^-11 relative); a layout error is ~1e-1.
constexpr double TOL_GEMV_NORM_F16_REL = 1e-4;
// Fast mode's int8 inputs (xq.cuh: two-level int8 per 32 values, at most max|x| / 64516 off per value, ~2e-5
// relative on these random rows); the twin takes the unrounded values. A layout error is ~1e-1.
constexpr double TOL_GEMV_INT8_REL = 1e-4;
// bf16 weights, fp32 inputs of ~1 over 64 columns: only the summation order differs (~1e-6); a row in the wrong
// tensor is off by ~1.
constexpr float TOL_GEMV_SEG_ABS = 1e-4f;

using cuda::dfmt;

// What the device's round_f16 does: nearest fp16, saturating at +-65504.
float round_f16_host(float v) { return (float)(_Float16)std::clamp(v, -65504.0f, 65504.0f); }

}  // namespace

struct gemv_case {
    int fmt;  // 0 q4, 1 q8, 2 bf16
    int64_t rows, cols;
    int T;
    bool norm, accumulate;
    bool f16 = false;  // gemv_params::f16_inputs (fast mode): the twin rounds x the same way
    int group = 64;    // affine formats: columns per scale/bias
};

class cuda_gemv : public ::testing::TestWithParam<gemv_case> {};

TEST_P(cuda_gemv, matches_cpu_twin) {
    TANSY_REQUIRE_GPU();
    const gemv_case g = GetParam();
    const dfmt f = g.fmt == 0 ? dfmt::q4 : g.fmt == 1 ? dfmt::q8 : dfmt::bf16;
    std::mt19937 rng((uint32_t)(g.rows * 131 + g.cols * 7 + g.T));
    test::test_matrix W(f, g.rows, g.cols, rng(), g.group);  // host matrix (checkpoint format) + its device copy
    const matrix& m = W.m;
    auto x = test::random_normal((size_t)(g.T * g.cols), rng(), 2.0f);
    auto nw = test::random_uniform((size_t)g.cols, rng(), 0.5f, 1.5f);
    auto y0 = test::random_normal((size_t)(g.T * g.rows), rng());  // prior contents for accumulate

    // CPU twin: fp32 inputs, or (fast mode) as the kernel rounds them: to fp16, or not at all for int8 inputs
    auto twin = [&](bool round_f16) {
        std::vector<float> xin = x;
        if (g.norm) cpu::rms_norm(xin.data(), x.data(), g.T, g.cols, nw.data(), 1e-6f);
        if (round_f16)
            for (float& v : xin) v = round_f16_host(v);
        std::vector<float> want((size_t)(g.T * g.rows));
        cpu::matmul(want.data(), xin.data(), g.T, m);
        if (g.accumulate)
            for (size_t i = 0; i < want.size(); i++) want[i] += y0[i];
        return want;
    };

    // device: CUDA-core and (where the shape allows) tensor-core kernels; int8 inputs on and off
    for (auto [families, int8] : {std::pair{0u, true}, std::pair{0u, false}, std::pair{(unsigned)cuda::mma_all, true}}) {
        test::mma_families_scope scope(families);
        test::int8_inputs_scope scope8(int8);
        cuda::device_buffer dx(x.size() * 4), dn(nw.size() * 4), dy(y0.size() * 4);
        dx.upload(x.data(), x.size() * 4);
        dn.upload(nw.data(), nw.size() * 4);
        dy.upload(y0.data(), y0.size() * 4);
        cuda::gemv_params p;
        p.W = W.d, p.x = (const float*)dx.get(), p.ldx = g.cols, p.T = g.T;
        p.norm_w = g.norm ? (const float*)dn.get() : nullptr;
        p.seg[0] = {(float*)dy.get(), g.rows, 0};
        p.accumulate = g.accumulate, p.f16_inputs = g.f16;
        const bool xq = cuda::gemv_int8_inputs(p);
        const bool xq_shape = int8 && g.f16 && f == dfmt::q4 && g.T == 1 && g.cols % 1024 == 0 && g.cols <= 4096;
        if (families == 0) EXPECT_EQ(xq, xq_shape) << "which rows take int8 inputs";
        else EXPECT_TRUE(!xq || xq_shape) << "which rows take int8 inputs";
        cuda::gemv(p, 0);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<float> want = twin(g.f16 && !xq);
        std::vector<float> got(want.size());
        dy.download(got.data(), got.size() * 4);
        const double tol = xq ? TOL_GEMV_INT8_REL : g.norm && g.f16 ? TOL_GEMV_NORM_F16_REL : TOL_GEMV_REL;
        EXPECT_LT(test::rel_error(got, want), tol) << "tensor-core families " << families << ", int8 inputs " << int8;
    }
}

INSTANTIATE_TEST_SUITE_P(
    shapes, cuda_gemv,
    ::testing::Values(gemv_case{0, 1, 64, 1, false, false}, gemv_case{0, 7, 256, 1, true, false},
                      gemv_case{0, 19, 2048, 1, true, true}, gemv_case{0, 257, 512, 3, false, false},
                      gemv_case{0, 4096 + 32 + 32, 2048, 1, true, false}, gemv_case{0, 2048, 4096, 5, false, true},
                      gemv_case{0, 33, 192, 16, true, false}, gemv_case{0, 33, 192, 17, false, false}, gemv_case{0, 1000, 2048, 40, false, false},
                      gemv_case{1, 257, 2048, 1, true, false}, gemv_case{1, 3, 64, 2, false, true},
                      gemv_case{1, 1, 2048, 1, false, false}, gemv_case{2, 9, 256, 1, true, false},
                      gemv_case{2, 513, 2048, 4, false, true}, gemv_case{2, 31, 24, 3, true, false},
                      // one input row, 32k chunks per row: the streamed kernel (many ring tiles per block, tiles
                      // of 1..16 rows, a ragged last tile)
                      gemv_case{0, 40009, 2048, 1, true, false}, gemv_case{0, 2051, 4096, 1, false, true},
                      gemv_case{0, 3, 1024, 1, true, true}, gemv_case{1, 131, 4096, 1, false, false},
                      gemv_case{2, 1001, 2048, 1, true, true}, gemv_case{2, 77, 512, 1, false, false},
                      // fp16-rounded inputs (without the norm the twin rounds the very same values), both kernels
                      gemv_case{0, 4099, 2048, 1, false, false, true}, gemv_case{0, 257, 512, 3, false, true, true},
                      gemv_case{2, 1001, 2048, 1, false, true, true}, gemv_case{0, 2051, 4096, 1, false, false, true},
                      // fast mode, one row of 4-bit weights: int8 inputs (K = 1024, 2048, 4096; with the norm;
                      // a 3-slot ring of 32-row tiles, a 6-slot ring of few rows, many tiles per block)
                      gemv_case{0, 3, 1024, 1, true, true, true}, gemv_case{0, 40009, 2048, 1, true, false, true},
                      gemv_case{0, 1001, 4096, 1, true, true, true}, gemv_case{0, 77, 2048, 1, true, false, true},
                      // fp16 inputs, 2..8 rows: the tensor-core GEMV (gemv_mma_warp_kernel; one dequantisation, 8 columns)
                      gemv_case{0, 4099, 2048, 8, false, true, true}, gemv_case{0, 2051, 4096, 4, false, false, true},
                      gemv_case{0, 77, 1024, 2, false, false, true},
                      // 9..16 rows: two n8 column groups per mma A fragment, K = 2048 and 4096 alike (one launch)
                      gemv_case{0, 1001, 2048, 12, true, true, true}, gemv_case{0, 4099, 2048, 16, true, false, true},
                      gemv_case{0, 2051, 4096, 16, false, true, true}, gemv_case{0, 2051, 4096, 9, true, false, true},
                      // many 16-row blocks per thread block: several items per warp
                      gemv_case{0, 40009, 2048, 8, false, false, true},
                      // 2..16 rows, the per-warp tensor-core kernel (v10): one 64-column block (one k-chunk:
                      // stores straight from the lanes), 3 blocks (3 k-chunks of one block each), groups of 128
                      // columns, fewer rows than one 16-row block, several k-chunks folded, an odd number of rows
                      // per block
                      gemv_case{0, 100, 64, 5, false, true, true}, gemv_case{0, 17, 192, 3, true, true, true},
                      gemv_case{0, 300, 1024, 16, false, true, true, 128}, gemv_case{0, 5, 4096, 13, true, false, true},
                      gemv_case{0, 2131, 2048, 11, true, true, true}, gemv_case{0, 12352, 2048, 16, true, false, true},
                      // the same kernel: one k-chunk of 8 steps per item (lm_head's plan at 16 rows), items of 13
                      // blocks (steps of 4, 4, 4 and 1), groups of 256, 15 rows
                      gemv_case{0, 33779, 2048, 16, true, true, true}, gemv_case{0, 33779, 832, 7, true, true, true},
                      gemv_case{0, 500, 1024, 6, false, true, true, 256}, gemv_case{0, 1500, 2048, 15, true, false, true},
                      // 17..32 rows (no norm prologue): three or four n8 column groups per A fragment where the
                      // staged x fits (K <= 2048: one launch; several k-chunks folded; one 64-column block; groups of
                      // 128), else (K = 4096) groups of 8 rows on the ring kernel
                      gemv_case{0, 4099, 2048, 17, false, true, true}, gemv_case{0, 2131, 2048, 24, false, false, true},
                      gemv_case{0, 12352, 2048, 32, false, true, true}, gemv_case{0, 5, 2048, 25, false, false, true},
                      gemv_case{0, 100, 64, 29, false, false, true}, gemv_case{0, 300, 1024, 27, false, true, true, 128},
                      gemv_case{0, 2051, 4096, 32, false, true, true},
                      // groups of 32: the ring tensor-core kernel's several-row form (tokens_dot)
                      gemv_case{0, 300, 1024, 5, false, true, true, 32}, gemv_case{0, 77, 2048, 12, true, false, true, 32}));

// Runs p (its W of 40 rows, x and T set) with the rows split over three tensors, rows [0, 10), [10, 35) and
// [35, 40) (a concatenated projection's outputs), and returns the T x 40 results gathered back in row order.
static std::vector<float> gemv_three_segments(cuda::gemv_params p) {
    const int T = p.T, n[3] = {10, 25, 5}, row0[3] = {0, 10, 35};
    cuda::device_buffer o[3] = {cuda::device_buffer((size_t)T * 10 * 4), cuda::device_buffer((size_t)T * 25 * 4),
                                cuda::device_buffer((size_t)T * 5 * 4)};
    for (int i = 0; i < 3; i++) p.seg[i] = {(float*)o[i].get(), n[i], row0[i]};
    p.n_seg = 3;
    cuda::gemv(p, 0);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> got((size_t)T * 40);
    for (int i = 0; i < 3; i++) {
        std::vector<float> part((size_t)T * n[i]);
        o[i].download(part.data(), part.size() * 4);
        for (int t = 0; t < T; t++)
            for (int r = 0; r < n[i]; r++) got[(size_t)(t * 40 + row0[i] + r)] = part[(size_t)(t * n[i] + r)];
    }
    return got;
}

// Several outputs from one concatenated matrix (the fused projections).
TEST(cuda_gemv_segments, rows_land_in_their_tensors) {
    TANSY_REQUIRE_GPU();
    const int64_t rows = 40, cols = 64;
    std::vector<uint16_t> dense((size_t)(rows * cols));
    auto v = test::random_normal(dense.size(), 3);
    for (size_t i = 0; i < v.size(); i++) dense[i] = f32_to_bf16(v[i]);
    auto x = test::random_normal((size_t)(2 * cols), 4);
    cuda::device_buffer dw(dense.size() * 2), dx(x.size() * 4);
    dw.upload(dense.data(), dw.size());
    dx.upload(x.data(), dx.size());
    cuda::gemv_params p;
    p.W = {cuda::dfmt::bf16, rows, cols, 0, (const uint32_t*)dw.get(), nullptr};
    p.x = (const float*)dx.get(), p.ldx = cols, p.T = 2;
    const std::vector<float> got = gemv_three_segments(p);
    matrix m;
    m.fmt = wfmt::dense, m.type = dtype::bf16, m.rows = rows, m.cols = cols, m.w = (const uint8_t*)dense.data();
    std::vector<float> want((size_t)(2 * rows));
    cpu::matmul(want.data(), x.data(), 2, m);
    for (size_t i = 0; i < want.size(); i++) EXPECT_NEAR(got[i], want[i], TOL_GEMV_SEG_ABS) << "row " << i % rows;
}

// The same with 4-bit rows and fp16 inputs for 5 rows (the tensor-core kernels' stores), segment boundaries inside
// 16-row blocks.
TEST(cuda_gemv_segments, q4_rows_land_in_their_tensors) {
    TANSY_REQUIRE_GPU();
    const int64_t rows = 40, cols = 128;
    const int T = 5;
    test::test_matrix W(dfmt::q4, rows, cols, 11);
    auto x = test::random_normal((size_t)(T * cols), 12, 2.0f);
    cuda::device_buffer dx(x.size() * 4);
    dx.upload(x.data(), dx.size());
    cuda::gemv_params p;
    p.W = W.d;
    p.x = (const float*)dx.get(), p.ldx = cols, p.T = T, p.f16_inputs = true;
    const std::vector<float> got = gemv_three_segments(p);
    std::vector<float> xr = x;
    for (float& v : xr) v = round_f16_host(v);
    std::vector<float> want((size_t)(T * rows));
    cpu::matmul(want.data(), xr.data(), T, W.m);
    EXPECT_LT(test::rel_error(got, want), TOL_GEMV_REL);
}
