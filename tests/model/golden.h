// Reading golden tensors (tiny-reference.safetensors and friends) and running the CPU engine on fixtures.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loader/safetensors.h"
#include "runtime/engine.h"
#include "test_util.h"

namespace tansy::test {

class golden {
  public:
    explicit golden(const std::string& path) : f_(path) {}
    bool has(const std::string& key) const { return f_.find(key) != nullptr; }
    std::vector<float> floats(const std::string& key) const;
    std::vector<int32_t> ints(const std::string& key) const;
    std::vector<int64_t> shape(const std::string& key) const;

  private:
    st_file f_;
};

// One engine per (model directory, backend, GEMM mode, KV cache type, DeltaNet state type), shared by the tests of
// a process (loading is cheap, not free). Engines run the checkpoint's own weights on every backend (--weights
// checkpoint).
engine& shared_engine(const std::string& model_dir, const std::string& backend, bool precise_gemm = false,
                      bool kv_fp8 = false, bool state_bf16 = false);
engine& cpu_engine(const std::string& model_dir);
// A test's own CPU engine of that kind with `threads` threads (0: all cores). One thread suits hundreds of
// one-token steps: their many small parallel regions are mostly OpenMP team wake-ups (tests/CMakeLists.txt).
std::unique_ptr<engine> own_cpu_engine(const std::string& model_dir, int threads, bool state_bf16 = false);

// How far a storage option (the FP8 KV cache, the bf16 DeltaNet state) may move logits from the run without it.
struct nearness_bounds {
    double min_top1, max_mean_kl;
    double min_mean_kl;    // below it the option would not be in effect at all
    double max_nll_shift;  // nats
};
// Compares run b's logits with run a's over P positions of V logits (position i predicting targets[i]), prints one
// line naming `what` and checks the bounds.
void expect_near_run(const char* what, const std::vector<float>& a, const std::vector<float>& b, int64_t P, int64_t V,
                     const int32_t* targets, const nearness_bounds& bounds);

// Logits of every position of `ids`: a prefill of ids[0, split), then each further token as its own decode
// step (split 0: all of them token by token).
std::vector<float> prefill_then_decode(engine& e, const std::vector<int32_t>& ids, size_t split);

}  // namespace tansy::test
