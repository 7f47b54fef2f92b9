// MLX-compatible affine quantisation (MODEL.md §11.2): per group of `group` consecutive columns of a row,
// w ~= scale * q + bias with q unsigned in [0, 2^bits), packed LSB-first into u32 words; scale and bias bf16.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tansy {

enum class quant_method : uint8_t {
    minmax,  // MLX's own rule: the group's min/max map exactly onto the grid ends (what mlx-lm/mlx-vlm write)
};

quant_method parse_quant_method(const std::string& s);  // throws tansy::error
const char* quant_method_name(quant_method m);

struct quantized_rows {
    std::vector<uint32_t> packed;  // [rows, cols * bits / 32]
    std::vector<uint16_t> scales;  // bf16 [rows, cols / group]
    std::vector<uint16_t> biases;  // bf16 [rows, cols / group]
};

// Quantises rows x cols fp32 weights (row-major). cols % group == 0 and 32 % bits == 0 are required.
void quantize_rows(const float* w, int64_t rows, int64_t cols, int bits, int group, quant_method method,
                   quantized_rows* out);

}  // namespace tansy
