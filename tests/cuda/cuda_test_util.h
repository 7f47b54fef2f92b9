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

// Runs a test body with a kernel form forced process-wide, over every backend's plan (Force returns the previous
// forcing), restoring it after: tests cover every form whatever the plans say (kernel_plan.h).
template <class T, std::optional<T> (*Force)(std::optional<T>)>
struct setting_scope {
    explicit setting_scope(T v) : prev(Force(v)) {}
    ~setting_scope() { Force(prev); }
    setting_scope(const setting_scope&) = delete;
    setting_scope& operator=(const setting_scope&) = delete;
    std::optional<T> prev;
};
// decode kernel families on tensor cores (cuda::mma_family bits)
using mma_families_scope = setting_scope<unsigned, cuda::force_mma_families>;
// the one-row 4-bit decode kernels' int8 inputs on or off
using int8_inputs_scope = setting_scope<bool, cuda::force_int8_inputs>;
// the DeltaNet decode form (kernel_plan::recur: 0 registers, 1 shared memory, -1 by the batch)
using deltanet_recur_scope = setting_scope<int, cuda::force_deltanet_recur>;
// the fast GEMM on wgmma (on) or mma.sync (off)
using gemm_wgmma_scope = setting_scope<bool, cuda::force_gemm_wgmma>;
// the wgmma GEMM's dense and routed down calls copying X by TMA (on) or by every thread (off)
using gemm_tma_scope = setting_scope<bool, cuda::force_gemm_tma>;

// The fast GEMM's kernels a test runs: mma.sync always, wgmma too where this build and device have it.
inline std::vector<bool> gemm_wgmma_modes() {
    std::vector<bool> m{false};
    if (cuda::gemm_wgmma_available())
        m.push_back(true);
    else if (cuda::device_compute_capability() == 90)
        printf("[ note ] compute capability 9.0, but this build has no wgmma GEMM (90 not in TANSY_CUDA_ARCHS)\n");
    return m;
}
inline const char* gemm_kernel_name(bool wgmma) { return wgmma ? "wgmma" : "mma.sync"; }

// The forms of the fast GEMM a test of dense calls runs: mma.sync, and where wgmma runs, wgmma with the X tiles
// copied by TMA (dense calls of 512+ rows: 256-token tiles; routed down calls) and by every thread.
struct gemm_form {
    bool wgmma = false, tma = false;
};
inline std::vector<gemm_form> gemm_dense_forms() {
    std::vector<gemm_form> f;
    for (bool wg : gemm_wgmma_modes()) {
        f.push_back({wg, false});
        if (wg) f.push_back({wg, true});
    }
    return f;
}
struct gemm_form_scope {
    explicit gemm_form_scope(gemm_form f) : wgmma(f.wgmma), tma(f.tma) {}
    gemm_wgmma_scope wgmma;
    gemm_tma_scope tma;
};
inline const char* gemm_form_name(gemm_form f) { return !f.wgmma ? "mma.sync" : f.tma ? "wgmma, X by TMA" : "wgmma, X by copies"; }

}  // namespace tansy::test
