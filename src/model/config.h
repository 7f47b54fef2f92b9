// Hyperparameters of a qwen3_5_moe text model, read from config.json in either form:
// text-only (Qwen3_5MoeForCausalLM, fields at top level) or release (Qwen3_5MoeForConditionalGeneration,
// fields under text_config), plus the MLX `quantization` block.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace tansy {

enum class layer_kind : uint8_t { linear_attention, full_attention };

struct quant_spec {
    int bits = 0;        // 0: stored unquantised
    int group_size = 0;
};

struct model_config {
    std::string model_type;  // as written at the top level
    int64_t hidden = 0;      // D
    int64_t vocab = 0;       // embedding / lm_head rows
    std::vector<layer_kind> layers;
    float eps = 1e-6f;
    bool tie_embeddings = false;
    int64_t max_positions = 0;

    // full (gated) attention
    int64_t n_q_heads = 0, n_kv_heads = 0, head_dim = 0;
    int64_t rope_dim = 0;  // rotated dims per head (partial RoPE)
    double rope_theta = 0;

    // Gated DeltaNet
    int64_t lin_k_heads = 0, lin_v_heads = 0, lin_k_dim = 0, lin_v_dim = 0, conv_kernel = 0;

    // MoE
    int64_t n_experts = 0, top_k = 0, expert_inter = 0, shared_inter = 0;

    // MLX affine quantisation (absent for bf16 checkpoints)
    bool quantized = false;
    quant_spec quant_default;
    std::map<std::string, quant_spec> quant_overrides;  // keyed by MLX module path

    int64_t n_layers() const { return (int64_t)layers.size(); }
    int64_t lin_key_dim() const { return lin_k_heads * lin_k_dim; }    // q and k width
    int64_t lin_value_dim() const { return lin_v_heads * lin_v_dim; }  // v and z width
    int64_t lin_conv_dim() const { return 2 * lin_key_dim() + lin_value_dim(); }
    int64_t q_proj_rows() const { return 2 * n_q_heads * head_dim; }   // query + output gate
    int64_t kv_dim() const { return n_kv_heads * head_dim; }
    int64_t n_full_attention() const;
    quant_spec quant_for(const std::string& module) const;
    std::string summary() const;
};

// Throws tansy::error naming `what` (usually the file path) on any missing, malformed or unsupported value.
model_config parse_model_config(std::string_view json_text, const std::string& what);
model_config load_model_config(const std::string& model_dir);

// Token ids that end generation, from generation_config.json (falls back to config.json eos_token_id).
std::vector<int32_t> load_eos_ids(const std::string& model_dir);

std::string read_text_file(const std::string& path);  // throws tansy::error
bool file_exists(const std::string& path);
bool dir_exists(const std::string& path);

}  // namespace tansy
