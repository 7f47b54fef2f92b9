// CUDA tests skip themselves when no GPU is usable.
#pragma once
#include <cstdio>
#include <string>
#include <vector>

#include "backend/cuda/device.h"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/gemv.cuh"
#include "test_util.h"

#define TANSY_REQUIRE_GPU()                                                      \
    do {                                                                         \
        std::string why_;                                                        \
        if (::tansy::cuda::device_count(&why_) == 0) GTEST_SKIP() << why_;       \
    } while (0)

namespace tansy::test {

// Runs a test body with the given decode kernel families on tensor cores (cuda::mma_family bits), restoring
// the previous set after: tests cover both forms whatever the default.
struct mma_families_scope {
    explicit mma_families_scope(unsigned families) : prev(cuda::set_decode_mma_families(families)) {}
    ~mma_families_scope() { cuda::set_decode_mma_families(prev); }
    mma_families_scope(const mma_families_scope&) = delete;
    mma_families_scope& operator=(const mma_families_scope&) = delete;
    unsigned prev;
};

// Runs a test body with the one-row 4-bit decode kernels' int8 inputs on or off (cuda::set_decode_int8_inputs),
// restoring the previous setting after.
struct int8_inputs_scope {
    explicit int8_inputs_scope(bool on) : prev(cuda::set_decode_int8_inputs(on)) {}
    ~int8_inputs_scope() { cuda::set_decode_int8_inputs(prev); }
    int8_inputs_scope(const int8_inputs_scope&) = delete;
    int8_inputs_scope& operator=(const int8_inputs_scope&) = delete;
    bool prev;
};

// The fast GEMM's kernels a test runs: mma.sync always, wgmma too where this build and device have it.
inline std::vector<bool> gemm_wgmma_modes() {
    std::vector<bool> m{false};
    if (cuda::gemm_wgmma_available())
        m.push_back(true);
    else if (cuda::device_compute_capability() == 90)
        printf("[ note ] compute capability 9.0, but this build has no wgmma GEMM (90 not in TANSY_CUDA_ARCHS)\n");
    return m;
}
// Runs a test body on the wgmma (on) or mma.sync (off) fast GEMM, restoring the previous choice after.
struct gemm_wgmma_scope {
    explicit gemm_wgmma_scope(bool on) : prev(cuda::set_gemm_wgmma(on)) {}
    ~gemm_wgmma_scope() { cuda::set_gemm_wgmma(prev); }
    gemm_wgmma_scope(const gemm_wgmma_scope&) = delete;
    gemm_wgmma_scope& operator=(const gemm_wgmma_scope&) = delete;
    bool prev;
};
inline const char* gemm_kernel_name(bool wgmma) { return wgmma ? "wgmma" : "mma.sync"; }

}  // namespace tansy::test
