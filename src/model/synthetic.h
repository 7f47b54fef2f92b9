// Synthetic models of any qwen3_5_moe configuration (e.g. the full Qwen3.6-35B-A3B config) with seeded random
// weights in the MLX affine format (4-bit, routers and shared-expert gate 8-bit, group 64), for benchmarks and
// real-shape tests without a checkpoint.
#pragma once
#include <cstdint>

#include "model/weights.h"

namespace tansy {

struct synthetic_options {
    uint64_t seed = 1;
    // true: generate the packed weights in host memory (any backend can bind the model);
    // false: matrices carry shapes only and the cuda backend generates them on the device (no host copy).
    bool materialize = false;
    int group = 64;
};

model make_synthetic_model(const model_config& cfg, const synthetic_options& opt = {});

// A config from a config.json file with its layer list cut to `n_layers` (0 = keep), vocab optionally replaced.
model_config synthetic_config(const std::string& config_json_path, int64_t n_layers = 0, int64_t vocab = 0);

}  // namespace tansy
