// MLX-compatible affine quantisation (MODEL.md §11.2): per group of `group` consecutive columns of a row,
// w ~= scale * q + bias with q unsigned in [0, 2^bits), packed LSB-first into u32 words; scale and bias bf16.
// Every method writes this same format, so every kernel runs every method's output unchanged.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tansy {

enum class quant_method : uint8_t {
    minmax,  // MLX's own rule: the group's min/max map exactly onto the grid ends (what mlx-lm/mlx-vlm write)
    mse,     // per-group search over clipped ranges with least-squares refits, scored after bf16 rounding of
             // scale and bias; never worse than minmax on a group's squared error (minmax is a candidate)
};

quant_method parse_quant_method(const std::string& s);  // throws tansy::error
const char* quant_method_name(quant_method m);
constexpr quant_method default_quant_method = quant_method::mse;

struct quantized_rows {
    std::vector<uint32_t> packed;  // [rows, cols * bits / 32]
    std::vector<uint16_t> scales;  // bf16 [rows, cols / group]
    std::vector<uint16_t> biases;  // bf16 [rows, cols / group]
};

// Quantises rows x cols finite fp32 weights (row-major). cols % group == 0, group % 8 == 0 and 32 % bits == 0
// are required.
// col_weight (optional, [cols], >= 0): importance of each input column in the squared error the mse method
// minimises (e.g. the mean squared activation that multiplies the column); nullptr weighs all columns alike.
// Rows are processed in parallel (OpenMP); the result does not depend on the thread count.
void quantize_rows(const float* w, int64_t rows, int64_t cols, int bits, int group, quant_method method,
                   quantized_rows* out, const float* col_weight = nullptr);
// The same into caller-provided rows of a larger buffer: packed [rows, cols*bits/32], scales/biases
// [rows, cols/group].
void quantize_rows_into(const float* w, int64_t rows, int64_t cols, int bits, int group, quant_method method,
                        uint32_t* packed, uint16_t* scales, uint16_t* biases, const float* col_weight = nullptr);

// The fp32 weights the kernels see: scale * q + bias, evaluated in fp32 (out: [rows, cols]).
void dequantize_rows(const quantized_rows& q, int64_t rows, int64_t cols, int bits, int group, float* out);

}  // namespace tansy
