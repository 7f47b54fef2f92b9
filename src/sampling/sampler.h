// Token selection from a row of logits (host): greedy, or temperature with top-k / top-p / min-p filtering and
// a seeded RNG (same seed, same logits -> same tokens).
#pragma once
#include <cstdint>
#include <vector>

namespace tansy {

struct sampling_params {
    float temperature = 0.0f;  // 0: greedy
    int top_k = 0;             // 0: off
    float top_p = 1.0f;        // 1: off
    float min_p = 0.0f;        // 0: off
    uint64_t seed = 0;
};

// OpenAI's presence/frequency penalties (over generated tokens) and HF's repetition penalty (over prompt and
// generated tokens).
struct penalty_params {
    float presence = 0.0f, frequency = 0.0f, repetition = 1.0f;
    bool any() const { return presence != 0.0f || frequency != 0.0f || repetition != 1.0f; }
};

class sampler {
  public:
    // Ids >= n_valid (the embedding's padding rows, MODEL.md §6) are never chosen; 0 means all are valid.
    sampler(sampling_params p, int64_t n_valid = 0);
    int32_t sample(const float* logits, int64_t vocab);
    const sampling_params& params() const { return p_; }
    // The splitmix64 state (sampling_math::rng_start(seed) at construction): a draw held elsewhere (a device
    // slot) continues the same stream through these.
    uint64_t rng_state() const { return rng_; }
    void set_rng_state(uint64_t s) { rng_ = s; }

  private:
    double uniform();  // [0, 1)
    sampling_params p_;
    int64_t n_valid_;
    uint64_t rng_;
    std::vector<std::pair<float, int32_t>> cand_;  // (logit, id) of the tokens that can be drawn
    std::vector<float> w_;                         // their weights, e^((l - l_best) / T)
    std::vector<float> sl_;                        // top-k: the candidates' logits, sorted
};

int32_t argmax(const float* logits, int64_t n);  // first maximum

}  // namespace tansy
