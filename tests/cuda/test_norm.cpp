// rms_norm_bf16 (CUDA) vs cpu::rms_norm (its CPU twin) on odd shapes and fresh random inputs.
#include <cuda_runtime.h>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/norm.cuh"
#include "core/dtype.h"
#include "cuda_test_util.h"

using namespace tansy;

namespace {
// bf16 output: one rounding of a value of magnitude ~|x*w| (2^-8 relative), on top of the fp32 reduction order.
constexpr double TOL_BF16_OUT_REL = 4e-3;
}  // namespace

class cuda_rms_norm : public ::testing::TestWithParam<std::pair<int64_t, int64_t>> {};

TEST_P(cuda_rms_norm, matches_cpu_twin) {
    TANSY_REQUIRE_GPU();
    const auto [rows, n] = GetParam();
    auto x = test::random_normal((size_t)(rows * n), (uint32_t)(rows * 31 + n), 2.0f);
    auto w = test::random_uniform((size_t)n, (uint32_t)n, 0.5f, 1.5f);
    std::vector<uint16_t> xb(x.size());
    for (size_t i = 0; i < x.size(); i++) xb[i] = f32_to_bf16(x[i]), x[i] = bf16_to_f32(xb[i]);  // same inputs
    std::vector<float> want(x.size());
    cpu::rms_norm(want.data(), x.data(), rows, n, w.data(), 1e-6f);

    cuda::device_buffer dx(xb.size() * 2), dy(xb.size() * 2), dw(w.size() * 4);
    dx.upload(xb.data(), xb.size() * 2);
    dw.upload(w.data(), w.size() * 4);
    cuda::rms_norm_bf16((uint16_t*)dy.get(), (const uint16_t*)dx.get(), (const float*)dw.get(), rows, n, 1e-6f, 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint16_t> yb(xb.size());
    dy.download(yb.data(), yb.size() * 2);
    std::vector<float> got(yb.size());
    for (size_t i = 0; i < yb.size(); i++) got[i] = bf16_to_f32(yb[i]);
    EXPECT_LT(test::rel_error(got, want), TOL_BF16_OUT_REL);
}

INSTANTIATE_TEST_SUITE_P(shapes, cuda_rms_norm,
                         ::testing::Values(std::pair<int64_t, int64_t>{1, 111}, std::pair<int64_t, int64_t>{19, 2048},
                                           std::pair<int64_t, int64_t>{7, 256}, std::pair<int64_t, int64_t>{989, 4096},
                                           std::pair<int64_t, int64_t>{3, 1}));
