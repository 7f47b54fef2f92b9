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

// Runs a test body with a switch of the active kernel plan changed (Set returns the previous value), restoring
// it after: tests cover every form whatever the default. Open the scope after making the backends it is meant
// for: making a CUDA backend sets the active plan (kernel_plan.h).
template <class T, T (*Set)(T)>
struct setting_scope {
    explicit setting_scope(T v) : prev(Set(v)) {}
    ~setting_scope() { Set(prev); }
    setting_scope(const setting_scope&) = delete;
    setting_scope& operator=(const setting_scope&) = delete;
    T prev;
};
// decode kernel families on tensor cores (cuda::mma_family bits)
using mma_families_scope = setting_scope<unsigned, cuda::set_decode_mma_families>;
// the one-row 4-bit decode kernels' int8 inputs on or off
using int8_inputs_scope = setting_scope<bool, cuda::set_decode_int8_inputs>;
// the DeltaNet decode form (kernel_plan::recur: 0 registers, 1 shared memory, -1 by the batch)
using deltanet_recur_scope = setting_scope<int, cuda::set_deltanet_recur>;

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
