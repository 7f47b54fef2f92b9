// CUDA tests skip themselves when no GPU is usable.
#pragma once
#include <string>

#include "backend/cuda/device.h"
#include "test_util.h"

#define TANSY_REQUIRE_GPU()                                                      \
    do {                                                                         \
        std::string why_;                                                        \
        if (::tansy::cuda::device_count(&why_) == 0) GTEST_SKIP() << why_;       \
    } while (0)
