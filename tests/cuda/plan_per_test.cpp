// Every CUDA test starts on the default kernel plan (kernel_plan.h): a backend's calls make its own plan active
// and engines are shared between tests (test::shared_engine), so without this an op test that calls the launchers
// directly would run on the plan of whichever backend ran last, and its figures would depend on the test order.
#include <gtest/gtest.h>

#include "backend/cuda/kernel_plan.h"

namespace {

struct default_plan_per_test : testing::EmptyTestEventListener {
    void OnTestStart(const testing::TestInfo&) override { tansy::cuda::use_kernel_plan(nullptr); }
};

const bool registered = [] {
    testing::UnitTest::GetInstance()->listeners().Append(new default_plan_per_test);  // (gtest owns it)
    return true;
}();

}  // namespace
