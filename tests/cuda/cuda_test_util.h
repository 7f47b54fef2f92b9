// CUDA tests skip themselves when no GPU is usable.
#pragma once
#include <string>

#include "backend/cuda/device.h"
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

}  // namespace tansy::test
