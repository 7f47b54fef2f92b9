#include "synth_model.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>

#include <gtest/gtest.h>

#include "loader/safetensors.h"

namespace tansy::test {

nlohmann::json synth_config() {
    return {{"architectures", {"Qwen3_5MoeForCausalLM"}},
            {"model_type", "qwen3_5_moe_text"},
            {"hidden_size", 64},
            {"vocab_size", 96},
            {"num_hidden_layers", 2},
            {"layer_types", {"linear_attention", "full_attention"}},
            {"num_attention_heads", 4},
            {"num_key_value_heads", 2},
            {"head_dim", 32},
            {"linear_num_key_heads", 2},
            {"linear_num_value_heads", 4},
            {"linear_key_head_dim", 16},
            {"linear_value_head_dim", 16},
            {"linear_conv_kernel_dim", 4},
            {"num_experts", 4},
            {"num_experts_per_tok", 2},
            {"moe_intermediate_size", 16},
            {"shared_expert_intermediate_size", 16},
            {"rms_norm_eps", 1e-6},
            {"tie_word_embeddings", false},
            {"rope_parameters",
             {{"rope_type", "default"}, {"rope_theta", 10000000.0}, {"partial_rotary_factor", 0.25}}}};
}

std::vector<synth_tensor> synth_tensors(const nlohmann::json& c, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<synth_tensor> out;
    auto add = [&](const std::string& name, std::vector<int64_t> shape, float scale) {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        std::normal_distribution<float> dist(0.0f, scale);
        synth_tensor t{name, dtype::bf16, shape, std::vector<uint8_t>((size_t)n * 2)};
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = f32_to_bf16(dist(rng));
            memcpy(&t.data[(size_t)i * 2], &h, 2);
        }
        out.push_back(std::move(t));
    };
    const int64_t D = c["hidden_size"], V = c["vocab_size"], Hq = c["num_attention_heads"],
                  Hkv = c["num_key_value_heads"], dh = c["head_dim"], Hk = c["linear_num_key_heads"],
                  Hv = c["linear_num_value_heads"], dk = c["linear_key_head_dim"], dv = c["linear_value_head_dim"],
                  K = c["linear_conv_kernel_dim"], E = c["num_experts"], F = c["moe_intermediate_size"],
                  Fs = c["shared_expert_intermediate_size"];
    const int64_t C = 2 * Hk * dk + Hv * dv;
    const float w = 1.0f / std::sqrt((float)D);
    add("model.embed_tokens.weight", {V, D}, 1.0f);
    add("lm_head.weight", {V, D}, w);
    add("model.norm.weight", {D}, 0.1f);
    const auto& types = c["layer_types"];
    for (size_t i = 0; i < types.size(); i++) {
        const std::string p = "model.layers." + std::to_string(i) + ".";
        add(p + "input_layernorm.weight", {D}, 0.1f);
        add(p + "post_attention_layernorm.weight", {D}, 0.1f);
        if (types[i] == "full_attention") {
            add(p + "self_attn.q_proj.weight", {2 * Hq * dh, D}, w);
            add(p + "self_attn.k_proj.weight", {Hkv * dh, D}, w);
            add(p + "self_attn.v_proj.weight", {Hkv * dh, D}, w);
            add(p + "self_attn.o_proj.weight", {D, Hq * dh}, 1.0f / std::sqrt((float)(Hq * dh)));
            add(p + "self_attn.q_norm.weight", {dh}, 0.1f);
            add(p + "self_attn.k_norm.weight", {dh}, 0.1f);
        } else {
            add(p + "linear_attn.in_proj_qkv.weight", {C, D}, w);
            add(p + "linear_attn.in_proj_z.weight", {Hv * dv, D}, w);
            add(p + "linear_attn.in_proj_b.weight", {Hv, D}, w);
            add(p + "linear_attn.in_proj_a.weight", {Hv, D}, w);
            add(p + "linear_attn.out_proj.weight", {D, Hv * dv}, 1.0f / std::sqrt((float)(Hv * dv)));
            add(p + "linear_attn.conv1d.weight", {C, 1, K}, 0.5f);
            add(p + "linear_attn.dt_bias", {Hv}, 0.5f);
            add(p + "linear_attn.A_log", {Hv}, 0.5f);
            add(p + "linear_attn.norm.weight", {dv}, 1.0f);
        }
        add(p + "mlp.gate.weight", {E, D}, w);
        for (int64_t e = 0; e < E; e++) {
            const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
            add(x + "gate_proj.weight", {F, D}, w);
            add(x + "up_proj.weight", {F, D}, w);
            add(x + "down_proj.weight", {D, F}, 1.0f / std::sqrt((float)F));
        }
        add(p + "mlp.shared_expert.gate_proj.weight", {Fs, D}, w);
        add(p + "mlp.shared_expert.up_proj.weight", {Fs, D}, w);
        add(p + "mlp.shared_expert.down_proj.weight", {D, Fs}, 1.0f / std::sqrt((float)Fs));
        add(p + "mlp.shared_expert_gate.weight", {1, D}, w);
    }
    return out;
}

void write_file(const std::string& path, const std::string& bytes) {
    std::ofstream f(path, std::ios::binary);
    f.write(bytes.data(), (std::streamsize)bytes.size());
}

void write_checkpoint(const std::string& dir, const nlohmann::json& cfg, const std::vector<synth_tensor>& tensors) {
    write_file(dir + "/config.json", cfg.dump(2));
    std::vector<st_out_tensor> st;
    for (const synth_tensor& t : tensors) {
        size_t n = dtype_size(t.type);
        for (int64_t d : t.shape) n *= (size_t)d;
        if (n != t.data.size()) ADD_FAILURE() << t.name << ": " << t.data.size() << " bytes for " << n;
        st.push_back({t.name, t.type, t.shape, t.data.data()});
    }
    write_safetensors(dir + "/model.safetensors", st, {{"format", "pt"}});
}

}  // namespace tansy::test
