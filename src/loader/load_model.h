// Maps any supported checkpoint layout onto model_weights (MODEL.md §10, §11):
//   hf-text     model.*, per-expert or fused experts, zero-centred norms stored as w
//   hf-release  model.language_model.* (+ model.visual.*, mtp.* skipped), fused experts, F32 A_log
//   mlx         language_model.model.*, switch_mlp.*, affine-quantised U32 + scales/biases, conv [C,K,1],
//               zero-centred norms stored as 1+w
// The layout is detected from tensor names. Every tensor's dtype and shape is validated.
#pragma once
#include <string>

#include "model/weights.h"

namespace tansy {

model load_model(const std::string& dir);  // throws tansy::error

}  // namespace tansy
