#include "model/weights.h"

#include <cstring>

#include "core/check.h"

namespace tansy {

const char* layout_name(checkpoint_layout l) {
    switch (l) {
        case checkpoint_layout::hf_text: return "hf-text";
        case checkpoint_layout::hf_release: return "hf-release";
        case checkpoint_layout::mlx: return "mlx";
    }
    return "?";
}

size_t matrix::row_bytes() const {
    if (fmt == wfmt::dense) return (size_t)cols * dtype_size(type);
    return (size_t)cols * (size_t)bits / 8;
}

size_t matrix::group_bytes() const { return fmt == wfmt::affine ? (size_t)(cols / group) * dtype_size(type) : 0; }

size_t matrix::bytes() const { return (size_t)rows * (row_bytes() + 2 * group_bytes()); }

matrix matrix::rows_view(int64_t r0, int64_t n) const {
    TANSY_CHECK(r0 >= 0 && n >= 0 && r0 + n <= rows, "rows [%lld, %lld) of %lld", (long long)r0, (long long)(r0 + n),
                (long long)rows);
    matrix m = *this;
    m.rows = n;
    m.w = w + (size_t)r0 * row_bytes();
    if (fmt == wfmt::affine) {
        m.scales = scales + (size_t)r0 * group_bytes();
        m.biases = biases + (size_t)r0 * group_bytes();
    }
    return m;
}

// Checkpoint data may be unaligned (the header length need not be a multiple of 8), so every load is a memcpy.
static inline float load_scalar(const uint8_t* p, dtype t) {
    switch (t) {
        case dtype::bf16: {
            uint16_t h;
            memcpy(&h, p, 2);
            return bf16_to_f32(h);
        }
        case dtype::f16: {
            uint16_t h;
            memcpy(&h, p, 2);
            return f16_to_f32(h);
        }
        case dtype::f32: {
            float f;
            memcpy(&f, p, 4);
            return f;
        }
        default: TANSY_ABORT("unsupported weight dtype %s", dtype_name(t));
    }
}

void matrix::row_f32(int64_t r, float* out) const {
    TANSY_CHECK(r >= 0 && r < rows, "row %lld of %lld", (long long)r, (long long)rows);
    const uint8_t* src = w + (size_t)r * row_bytes();
    if (fmt == wfmt::dense) {
        switch (type) {
            case dtype::bf16:
                for (int64_t c = 0; c < cols; c++) {
                    uint16_t h;
                    memcpy(&h, src + 2 * c, 2);
                    out[c] = bf16_to_f32(h);
                }
                return;
            case dtype::f32: memcpy(out, src, (size_t)cols * 4); return;
            default:
                for (int64_t c = 0; c < cols; c++) out[c] = load_scalar(src + c * dtype_size(type), type);
                return;
        }
    }
    // note: MLX affine, LSB-first: value c of a row sits at bit (c*bits) % 32 of word (c*bits) / 32,
    // w = scale[c/group] * q + bias[c/group] (no zero-point subtraction). MODEL.md §11.2.
    const size_t es = dtype_size(type);
    const uint8_t* sc = scales + (size_t)r * group_bytes();
    const uint8_t* bi = biases + (size_t)r * group_bytes();
    const int per_word = 32 / bits;
    const uint32_t mask = (1u << bits) - 1;
    const int64_t n_groups = cols / group;
    const int64_t words_per_group = group / per_word;
    for (int64_t g = 0; g < n_groups; g++) {
        const float s = load_scalar(sc + g * es, type), b = load_scalar(bi + g * es, type);
        const uint8_t* wg = src + (size_t)g * words_per_group * 4;
        float* o = out + g * group;
        for (int64_t k = 0; k < words_per_group; k++) {
            uint32_t word;
            memcpy(&word, wg + 4 * k, 4);
            for (int j = 0; j < per_word; j++) o[k * per_word + j] = s * (float)((word >> (bits * j)) & mask) + b;
        }
    }
}

float matrix::at(int64_t r, int64_t c) const {
    std::vector<float> row((size_t)cols);
    row_f32(r, row.data());
    return row[(size_t)c];
}

}  // namespace tansy
