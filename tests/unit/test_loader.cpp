// Checkpoint and config loading: the happy path on a synthetic model, and a specific error for every kind of
// malformed input (the list: missing/truncated file, header beyond file, offsets out of range or
// overlapping, wrong dtype or shape, missing tensor, unknown model_type, layer counts that disagree).
#include <filesystem>
#include <functional>
#include <fstream>

#include "core/check.h"
#include "loader/checkpoint.h"
#include "loader/load_model.h"
#include "model/config.h"
#include "synth_model.h"
#include "test_util.h"

using namespace tansy;
using test::synth_tensor;
using json = nlohmann::json;

namespace {

void expect_load_error(const std::string& dir, const std::string& needle) {
    try {
        load_model(dir);
        ADD_FAILURE() << "loaded without error; wanted '" << needle << "'";
    } catch (const tansy::error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
    }
}

// Writes the synthetic model after letting `edit` change the config or tensors.
std::string broken(const std::string& tag, const std::function<void(json&, std::vector<synth_tensor>&)>& edit) {
    json cfg = test::synth_config();
    auto t = test::synth_tensors(cfg, 1);
    edit(cfg, t);
    std::string dir = test::temp_dir(tag);
    test::write_checkpoint(dir, cfg, t);
    return dir;
}

synth_tensor* find(std::vector<synth_tensor>& ts, const std::string& name) {
    for (auto& t : ts)
        if (t.name == name) return &t;
    ADD_FAILURE() << "no tensor " << name;
    return &ts[0];
}

}  // namespace

TEST(loader, synthetic_model_loads) {
    std::string dir = broken("ok", [](json&, std::vector<synth_tensor>&) {});
    model m = load_model(dir);
    EXPECT_EQ(m.w.layout, checkpoint_layout::hf_text);
    EXPECT_EQ(m.cfg.n_layers(), 2);
    EXPECT_EQ(m.w.layers[0].kind, layer_kind::linear_attention);
    EXPECT_EQ(m.w.layers[1].kind, layer_kind::full_attention);
    EXPECT_EQ(m.w.layers[0].moe.gate.size(), 4u);
    EXPECT_EQ(m.cfg.rope_dim, 8);
    // zero-centred norms are returned as the applied multiplier 1+w
    uint16_t raw;
    memcpy(&raw, m.ckpt->get("model.norm.weight").data, 2);
    EXPECT_EQ(m.w.final_norm[0], 1.0f + bf16_to_f32(raw));
}

TEST(loader, missing_files_and_directories) {
    expect_load_error("/nonexistent/model", "does not exist");
    std::string dir = test::temp_dir("nocfg");
    expect_load_error(dir, "missing config.json");
    test::write_file(dir + "/config.json", test::synth_config().dump());
    expect_load_error(dir, "no .safetensors files");
}

TEST(loader, bad_config) {
    expect_load_error(broken("mt", [](json& c, auto&) { c["model_type"] = "llama"; }), "unsupported model_type 'llama'");
    expect_load_error(broken("mt2", [](json& c, auto&) { c.erase("model_type"); }), "(missing)");
    expect_load_error(broken("lc", [](json& c, auto&) { c["num_hidden_layers"] = 3; }), "layer counts disagree");
    expect_load_error(broken("lt", [](json& c, auto&) { c["layer_types"][0] = "mamba"; }), "unknown layer type");
    expect_load_error(broken("hd", [](json& c, auto&) { c["hidden_size"] = "big"; }), "must be an integer");
    expect_load_error(broken("kv", [](json& c, auto&) { c["num_key_value_heads"] = 3; }), "not a multiple");
    expect_load_error(broken("rp", [](json& c, auto&) { c["rope_parameters"]["rope_type"] = "yarn"; }), "rope_type");
    std::string dir = broken("js", [](json&, auto&) {});
    test::write_file(dir + "/config.json", "{\"model_type\": ");
    expect_load_error(dir, "not valid JSON");
}

// Issue 29: every numeric field is validated with an error naming it (rms_norm_eps < 0 used to be accepted).
TEST(loader, numeric_config_fields_are_validated) {
    auto error_of = [](const std::function<void(json&)>& edit) -> std::string {
        json c = test::synth_config();
        edit(c);
        try {
            parse_model_config(c.dump(), "config.json");
        } catch (const tansy::error& e) {
            return e.what();
        }
        return "";
    };
    EXPECT_EQ(error_of([](json&) {}), "");
    const std::pair<std::function<void(json&)>, const char*> cases[] = {
        {[](json& c) { c["rms_norm_eps"] = -1e-6; }, "rms_norm_eps"},
        {[](json& c) { c["rms_norm_eps"] = 0; }, "rms_norm_eps"},
        {[](json& c) { c["rms_norm_eps"] = 1e-60; }, "rms_norm_eps"},  // 0 as a float
        {[](json& c) { c["rms_norm_eps"] = 2.0; }, "rms_norm_eps"},
        {[](json& c) { c["rms_norm_eps"] = "small"; }, "rms_norm_eps"},
        {[](json& c) { c["rope_parameters"]["rope_theta"] = -10000; }, "rope_theta"},
        {[](json& c) { c["rope_parameters"]["rope_theta"] = 0; }, "rope_theta"},
        {[](json& c) { c["rope_parameters"]["partial_rotary_factor"] = 1.5; }, "partial_rotary_factor"},
        {[](json& c) { c["hidden_size"] = 0; }, "hidden_size"},
        {[](json& c) { c["hidden_size"] = -64; }, "hidden_size"},
        {[](json& c) { c["vocab_size"] = (int64_t)1 << 33; }, "vocab_size"},
        {[](json& c) { c["num_experts"] = 0; }, "num_experts"},
        {[](json& c) { c["num_experts_per_tok"] = 100; }, "num_experts_per_tok"},
        {[](json& c) { c["moe_intermediate_size"] = -1; }, "moe_intermediate_size"},
        {[](json& c) { c["linear_conv_kernel_dim"] = 1; }, "linear_conv_kernel_dim"},
        {[](json& c) { c["linear_num_value_heads"] = 3; }, "linear_num_value_heads"},
        {[](json& c) { c["max_position_embeddings"] = 0; }, "max_position_embeddings"},
        {[](json& c) { c.erase("head_dim"); c["hidden_size"] = 65; }, "num_attention_heads"},
        {[](json& c) { c["hidden_size"] = (int64_t)1 << 30; c["vocab_size"] = (int64_t)1 << 30; }, "implausibly large"},
    };
    for (const auto& [edit, needle] : cases) {
        const std::string e = error_of(edit);
        EXPECT_NE(e.find(needle), std::string::npos) << "wanted an error naming '" << needle << "', got '" << e << "'";
    }
}

TEST(loader, release_config_form) {
    json text = test::synth_config();
    json rel = {{"architectures", {"Qwen3_5MoeForConditionalGeneration"}}, {"model_type", "qwen3_5_moe"}};
    text["model_type"] = "qwen3_5_moe_text";
    rel["text_config"] = text;
    model_config c = parse_model_config(rel.dump(), "config.json");
    EXPECT_EQ(c.hidden, 64);
    EXPECT_EQ(c.n_layers(), 2);
    rel.erase("text_config");
    EXPECT_THROW(parse_model_config(rel.dump(), "config.json"), tansy::error);
}

TEST(loader, quantization_block) {
    json c = test::synth_config();
    c["quantization"] = {{"group_size", 64}, {"bits", 4}, {"mode", "affine"},
                         {"model.layers.0.mlp.gate", {{"group_size", 64}, {"bits", 8}}}};
    model_config mc = parse_model_config(c.dump(), "config.json");
    EXPECT_TRUE(mc.quantized);
    EXPECT_EQ(mc.quant_for("model.layers.0.mlp.gate").bits, 8);
    EXPECT_EQ(mc.quant_for("model.layers.0.mlp.shared_expert.up_proj").bits, 4);
    c["quantization"]["bits"] = 3;
    EXPECT_THROW(parse_model_config(c.dump(), "config.json"), tansy::error);
    c["quantization"]["bits"] = 4;
    c["quantization"]["mode"] = "mxfp4";
    EXPECT_THROW(parse_model_config(c.dump(), "config.json"), tansy::error);
}

TEST(loader, bad_tensors) {
    expect_load_error(broken("dt", [](json&, auto& t) {
                          synth_tensor* x = find(t, "model.embed_tokens.weight");
                          x->type = dtype::i32;
                          x->data.resize(x->data.size() * 2);  // I32 elements are twice as wide as bf16
                      }),
                      "has dtype I32");
    expect_load_error(broken("sh", [](json&, auto& t) {
                          auto* x = find(t, "lm_head.weight");
                          x->shape = {48, 128};  // same bytes, wrong shape
                      }),
                      "has shape [48, 128], expected [96, 64]");
    expect_load_error(broken("mi", [](json&, auto& t) {
                          t.erase(std::remove_if(t.begin(), t.end(),
                                                 [](auto& x) { return x.name == "model.layers.1.self_attn.k_norm.weight"; }),
                                  t.end());
                      }),
                      "missing tensor 'model.layers.1.self_attn.k_norm.weight'");
    expect_load_error(broken("ex", [](json&, auto& t) {
                          synth_tensor x = t.back();
                          x.name = "model.layers.2.mlp.shared_expert_gate.weight";
                          t.push_back(x);
                      }),
                      "layer counts disagree");
    expect_load_error(broken("q", [](json&, auto& t) {  // packed weights without a quantization block
                          auto* x = find(t, "model.layers.0.mlp.gate.weight");
                          x->type = dtype::u32, x->shape = {4, 32};
                      }),
                      "packed weights need .scales");
}

TEST(loader, truncated_and_corrupt_shards) {
    std::string dir = broken("tr", [](json&, auto&) {});
    std::string path = dir + "/model.safetensors";
    auto size = std::filesystem::file_size(path);
    std::filesystem::resize_file(path, size - 100);
    expect_load_error(dir, "past the data section");
    std::filesystem::resize_file(path, 20);
    expect_load_error(dir, "exceeds the file size");
    std::filesystem::resize_file(path, 3);
    expect_load_error(dir, "too small");
}

TEST(loader, sharded_index_errors) {
    std::string dir = broken("ix", [](json&, auto&) {});
    std::filesystem::rename(dir + "/model.safetensors", dir + "/model-00001-of-00001.safetensors");
    json ix = {{"weight_map", {{"model.embed_tokens.weight", "model-00001-of-00002.safetensors"}}}};
    test::write_file(dir + "/model.safetensors.index.json", ix.dump());
    expect_load_error(dir, "is missing");
    ix["weight_map"] = {{"model.nothing", "model-00001-of-00001.safetensors"}};
    test::write_file(dir + "/model.safetensors.index.json", ix.dump());
    expect_load_error(dir, "does not contain it");
    ix["weight_map"] = {{"x", "../etc/passwd"}};
    test::write_file(dir + "/model.safetensors.index.json", ix.dump());
    expect_load_error(dir, "not a plain file name");
    test::write_file(dir + "/model.safetensors.index.json", "[]");
    expect_load_error(dir, "weight_map");
    // a tensor that appears in two shards
    ix["weight_map"] = {{"model.norm.weight", "model-00001-of-00001.safetensors"}};
    test::write_file(dir + "/model.safetensors.index.json", ix.dump());
    std::filesystem::copy_file(dir + "/model-00001-of-00001.safetensors", dir + "/b.safetensors");
    ix["weight_map"]["lm_head.weight"] = "b.safetensors";
    test::write_file(dir + "/model.safetensors.index.json", ix.dump());
    expect_load_error(dir, "appears in both");
}
