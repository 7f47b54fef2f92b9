// Which bits each linear module gets, and quantise-at-load: the dense matrices of a loaded bf16 model turned
// into MLX affine ones in memory by the same quantiser and the same policy as `tansy convert`, so a bf16
// checkpoint quantised at load computes exactly what its converted checkpoint computes.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/weights.h"
#include "quant/affine.h"

namespace tansy {

// Importance of each input column of each linear module: the mean squared activation that multiplies it over
// calibration text (llama.cpp's "imatrix"), so the quantiser minimises the error of W x rather than of W.
// File: safetensors, one F32 tensor per module named by its MLX path, [cols] or [n_experts, cols].
class importance {
  public:
    static std::shared_ptr<const importance> load(const std::string& path);  // throws tansy::error
    // One vector per part of the module ({} when the file has none for it); throws on a shape mismatch.
    std::vector<const float*> for_module(const std::string& path, size_t n_parts, int64_t cols) const;
    size_t size() const { return by_path_.size(); }

  private:
    std::string file_;
    std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> by_path_;
};

// Bits per module. An override applies to the modules whose MLX path (language_model.model.layers.3.mlp.gate)
// contains its pattern as whole path components: "mlp.gate" (every router, not mlp.gate_proj), "lm_head",
// "layers.0.linear_attn" (every projection of layer 0's DeltaNet). The last matching override wins.
struct quant_policy {
    int bits = 4;
    int group = 64;
    quant_method method = default_quant_method;
    std::vector<std::pair<std::string, int>> overrides = default_overrides();
    // Columns per (scale, bias) group for the modules matching a pattern (same matching rule as overrides):
    // finer groups where they pay more per byte than 8 bits would.
    std::vector<std::pair<std::string, int>> group_overrides = default_group_overrides();
    std::shared_ptr<const importance> imatrix;  // optional column weights for the mse method

    int bits_for(const std::string& module_path) const;
    int group_for(const std::string& module_path) const;

    // 8 bits where it pays, measured per module on the tiny model (docs/QUALITY.md): routers and the
    // shared-expert gate (MLX's own choice: their errors change which experts run), embed_tokens (the largest
    // single contributor to the KL; a lookup, so no decode bandwidth), attention v_proj and the DeltaNet b/a
    // gates (tiny matrices, large effect), and layer 0's DeltaNet projections (the most sensitive layer).
    // On the release model this costs +1.4% of the 4-bit size; lm_head stays 4-bit because decode reads
    // all of it every token.
    static std::vector<std::pair<std::string, int>> default_overrides();
    static std::vector<std::pair<std::string, int>> default_group_overrides();
    // What mlx-lm/mlx-vlm write: the minmax rule, 8 bits for routers and the shared-expert gate only.
    static quant_policy mlx();
    // Parses "PATTERN=BITS" (BITS 2, 4 or 8); throws tansy::error.
    static std::pair<std::string, int> parse_override(const std::string& spec);
    // Parses "PATTERN=GROUP" (GROUP a multiple of 32 from 32 to 256); throws tansy::error.
    static std::pair<std::string, int> parse_group_override(const std::string& spec);
};

// A linear module as the MLX layout names it: one matrix, or E stacked experts of one projection.
struct linear_module {
    std::string path;            // e.g. language_model.model.layers.0.mlp.switch_mlp.up_proj
    std::vector<matrix*> parts;  // 1, or n_experts in expert order
};

// Every linear module of `w` in the order `tansy convert` writes them (lm_head only when untied).
std::vector<linear_module> linear_modules(model_weights& w, const model_config& c);

// Quantises dense matrices of equal width stacked in order (E experts -> one [E*rows, cols] result), widening
// to fp32 a block of rows at a time so the scratch stays small. Parts that are views into `release_from` (may
// be null) have each consumed block dropped from the process's mapping (file-backed pages: re-read if touched
// again), which keeps the resident set near the output's size however large the checkpoint.
// col_weights: empty, or one importance vector [cols] per part (quantize_rows's col_weight).
void quantize_matrices(const std::vector<const matrix*>& parts, int bits, int group, quant_method method,
                       quantized_rows* out, const checkpoint* release_from,
                       const std::vector<const float*>& col_weights = {});

struct quantize_report {
    int64_t matrices = 0, params = 0;
    size_t bytes_before = 0, bytes_after = 0;
    double seconds = 0;
};

// Replaces every dense matrix of `m` (cols % group == 0) by its affine quantisation under `policy`; the new
// buffers are owned by `m` (model::owned). Already-quantised matrices are left as they are.
quantize_report quantize_model(model& m, const quant_policy& policy);

// The weight formats an engine runs (engine_options::weights):
//   auto        the backend's default: cuda quantises an unquantised checkpoint (no affine matrix at all) as q4
//               does; cpu, and cuda with an already-quantised checkpoint, keep the checkpoint's own format
//   checkpoint  as stored
//   q4          dense matrices quantised at load by the default quant_policy (mse, 4 bits, the 8-bit modules
//               of tansy convert): the same weights `tansy convert` writes
//   bf16        as stored, which must be unquantised
// Throws tansy::error for an unknown name or a quantised checkpoint asked to run as bf16.
quantize_report prepare_weights(model& m, const std::string& weights, const std::string& backend);

}  // namespace tansy
