// Writes small synthetic qwen3_5_moe checkpoints (HF text-only layout, random bf16 weights) for tests that
// need a model of a given shape, or a deliberately broken one.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace tansy::test {

struct synth_tensor {
    std::string name;
    dtype type;
    std::vector<int64_t> shape;
    std::vector<uint8_t> data;
};

// A small config of the real architecture: hidden 64, layers [linear, full], 4/2 attention heads x 32,
// deltanet 2/4 heads x 16, 4 experts top-2 x 16, vocab 96.
nlohmann::json synth_config();

// All tensors of a text-only HF checkpoint for `cfg` (random bf16, zero-centred norms small).
std::vector<synth_tensor> synth_tensors(const nlohmann::json& cfg, uint32_t seed);

// Writes config.json + model.safetensors into dir.
void write_checkpoint(const std::string& dir, const nlohmann::json& cfg, const std::vector<synth_tensor>& tensors);

// Writes a raw file.
void write_file(const std::string& path, const std::string& bytes);

}  // namespace tansy::test
