// Non-owning view of a contiguous row-major 2-D buffer (activations are [tokens, features]).
// The memory belongs to a backend (host for CPU, device for CUDA); a tensor carries no ownership and no ops.
#pragma once
#include <cstdint>

#include "core/check.h"
#include "core/dtype.h"

namespace tansy {

struct tensor {
    void* data = nullptr;
    dtype type = dtype::f32;
    int64_t rows = 0, cols = 0;

    size_t bytes() const { return (size_t)rows * (size_t)cols * dtype_size(type); }
    int64_t numel() const { return rows * cols; }
    tensor rows_view(int64_t r0, int64_t n) const {
        TANSY_CHECK(r0 >= 0 && n >= 0 && r0 + n <= rows, "rows [%lld,%lld) of %lld", (long long)r0,
                    (long long)(r0 + n), (long long)rows);
        return {(char*)data + (size_t)r0 * (size_t)cols * dtype_size(type), type, n, cols};
    }
    template <class T>
    T* as() const {
        return (T*)data;
    }
};

// A read-only fp32 vector that lives on the host (norm weights, gate constants); backends that need it
// elsewhere upload it once when binding the model and find it again by its address.
struct vec_view {
    const float* data = nullptr;
    int64_t n = 0;
};

}  // namespace tansy
