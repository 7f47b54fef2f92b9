// bf16 checkpoint (any HF layout) -> MLX affine checkpoint (the mlx-community layout of MODEL.md §11), written
// tensor by tensor so that memory stays near one module's weights, not the checkpoint's size.
#pragma once
#include <cstdint>
#include <string>

#include "quant/quantize_model.h"

namespace tansy {

struct convert_options {
    std::string src, out;
    quant_policy policy;  // bits, group size, method and the per-module bit overrides
    uint64_t shard_bytes = 5000000000ull;  // split the output into files of at most this many bytes
    bool progress = true;                  // progress bar on stderr
};

struct convert_report {
    int64_t tensors = 0, files = 0;
    int64_t params = 0;  // weights quantised
    uint64_t bytes_in = 0, bytes_out = 0;
    double seconds = 0;
};

convert_report convert_to_mlx(const convert_options& opt);  // throws tansy::error

}  // namespace tansy
