#include "model/config.h"

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/check.h"
#include "core/json_util.h"

namespace tansy {

using json = nlohmann::json;

std::string read_text_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) fail("%s: cannot open: %s", path.c_str(), strerror(errno));
    std::stringstream ss;
    ss << f.rdbuf();
    if (f.bad()) fail("%s: read error", path.c_str());
    return ss.str();
}

bool file_exists(const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool dir_exists(const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

int64_t model_config::n_full_attention() const {
    int64_t n = 0;
    for (layer_kind k : layers) n += k == layer_kind::full_attention;
    return n;
}

quant_spec model_config::quant_for(const std::string& module) const {
    auto it = quant_overrides.find(module);
    return it != quant_overrides.end() ? it->second : quant_default;
}

std::string model_config::summary() const {
    return strprintf(
        "%s: hidden %lld, %lld layers (%lld full attention), vocab %lld, attention %lld/%lld heads x %lld "
        "(rope %lld), deltanet %lld/%lld heads x %lld/%lld, %lld experts top-%lld x %lld, shared %lld%s",
        model_type.c_str(), (long long)hidden, (long long)n_layers(), (long long)n_full_attention(),
        (long long)vocab, (long long)n_q_heads, (long long)n_kv_heads, (long long)head_dim, (long long)rope_dim,
        (long long)lin_k_heads, (long long)lin_v_heads, (long long)lin_k_dim, (long long)lin_v_dim,
        (long long)n_experts, (long long)top_k, (long long)expert_inter, (long long)shared_inter,
        quantized ? strprintf(", %d-bit group %d", quant_default.bits, quant_default.group_size).c_str() : "");
}

namespace {

struct reader {
    const json& j;
    const std::string& what;

    const json* find(const char* key) const {
        auto it = j.find(key);
        return it == j.end() || it->is_null() ? nullptr : &*it;
    }
    int64_t get_int(const char* key) const {
        const json* v = find(key);
        if (!v) fail("%s: missing field '%s'", what.c_str(), key);
        if (!v->is_number_integer()) fail("%s: field '%s' must be an integer, got %s", what.c_str(), key, v->dump().c_str());
        return v->get<int64_t>();
    }
    int64_t get_pos(const char* key) const {
        int64_t v = get_int(key);
        if (v <= 0) fail("%s: field '%s' must be positive, got %lld", what.c_str(), key, (long long)v);
        if (v > (int64_t)1 << 40) fail("%s: field '%s' = %lld is implausibly large", what.c_str(), key, (long long)v);
        return v;
    }
    double get_num(const char* key, double dflt) const {
        const json* v = find(key);
        if (!v) return dflt;
        if (!v->is_number()) fail("%s: field '%s' must be a number", what.c_str(), key);
        const double x = v->get<double>();
        if (!std::isfinite(x)) fail("%s: field '%s' must be finite, got %g", what.c_str(), key, x);
        return x;
    }
    bool get_bool(const char* key, bool dflt) const {
        const json* v = find(key);
        if (!v) return dflt;
        if (!v->is_boolean()) fail("%s: field '%s' must be true or false", what.c_str(), key);
        return v->get<bool>();
    }
    std::string get_str(const char* key, const char* dflt) const {
        const json* v = find(key);
        if (!v) return dflt;
        if (!v->is_string()) fail("%s: field '%s' must be a string", what.c_str(), key);
        return v->get<std::string>();
    }
};

quant_spec parse_quant_entry(const json& q, const std::string& what, const std::string& key) {
    quant_spec s;
    if (q.is_boolean()) {
        if (q.get<bool>()) fail("%s: quantization['%s'] = true is not a valid override", what.c_str(), key.c_str());
        return s;  // false: module left unquantised
    }
    if (!q.is_object()) fail("%s: quantization['%s'] must be an object", what.c_str(), key.c_str());
    auto b = q.find("bits");
    auto g = q.find("group_size");
    if (b == q.end() || !b->is_number_integer() || g == q.end() || !g->is_number_integer())
        fail("%s: quantization['%s'] needs integer bits and group_size", what.c_str(), key.c_str());
    s.bits = b->get<int>();
    s.group_size = g->get<int>();
    if (s.bits != 2 && s.bits != 4 && s.bits != 8)
        fail("%s: quantization['%s']: %d-bit weights are not supported (2, 4, 8 are)", what.c_str(), key.c_str(),
             s.bits);
    if (s.group_size <= 0 || s.group_size % 32 != 0 || s.group_size > 4096)
        fail("%s: quantization['%s']: unsupported group_size %d", what.c_str(), key.c_str(), s.group_size);
    return s;
}

}  // namespace

model_config parse_model_config(std::string_view text, const std::string& what) {
    const json root = parse_json_object(text, what, "not valid JSON", "must be a JSON object");

    model_config c;
    reader top{root, what};
    c.model_type = top.get_str("model_type", "");
    const json* tj = &root;
    if (c.model_type == "qwen3_5_moe") {
        const json* t = top.find("text_config");
        if (!t || !t->is_object()) fail("%s: model_type qwen3_5_moe needs a 'text_config' object", what.c_str());
        tj = t;
        std::string inner = reader{*t, what}.get_str("model_type", "qwen3_5_moe_text");
        if (inner != "qwen3_5_moe_text")
            fail("%s: text_config.model_type '%s' is not qwen3_5_moe_text", what.c_str(), inner.c_str());
    } else if (c.model_type != "qwen3_5_moe_text") {
        fail("%s: unsupported model_type '%s' (tansy runs qwen3_5_moe / qwen3_5_moe_text, e.g. Qwen3.6-35B-A3B)",
             what.c_str(), c.model_type.empty() ? "(missing)" : c.model_type.c_str());
    }
    reader r{*tj, what};

    c.hidden = r.get_pos("hidden_size");
    c.vocab = r.get_pos("vocab_size");
    int64_t n_layers = r.get_pos("num_hidden_layers");
    const double eps = r.get_num("rms_norm_eps", 1e-6);
    // note: checked as the float the kernels use (1e-50 rounds to 0)
    if (!((float)eps > 0.0f) || eps >= 1.0)
        fail("%s: field 'rms_norm_eps' must be in (0, 1) (as a float), got %g", what.c_str(), eps);
    c.eps = (float)eps;
    if (c.vocab > INT32_MAX)
        fail("%s: field 'vocab_size' = %lld does not fit the int32 token ids", what.c_str(), (long long)c.vocab);
    c.tie_embeddings = r.get_bool("tie_word_embeddings", top.get_bool("tie_word_embeddings", false));
    c.max_positions = r.find("max_position_embeddings") ? r.get_pos("max_position_embeddings") : 262144;

    c.n_q_heads = r.get_pos("num_attention_heads");
    c.n_kv_heads = r.get_pos("num_key_value_heads");
    if (!r.find("head_dim") && c.hidden % c.n_q_heads)
        fail("%s: without head_dim, hidden_size %lld must be a multiple of num_attention_heads %lld", what.c_str(),
             (long long)c.hidden, (long long)c.n_q_heads);
    c.head_dim = r.find("head_dim") ? r.get_pos("head_dim") : c.hidden / c.n_q_heads;
    if (c.n_q_heads % c.n_kv_heads)
        fail("%s: num_attention_heads %lld is not a multiple of num_key_value_heads %lld", what.c_str(),
             (long long)c.n_q_heads, (long long)c.n_kv_heads);
    if (!r.get_bool("attn_output_gate", true))
        fail("%s: attn_output_gate=false is not part of this architecture", what.c_str());
    if (r.get_bool("attention_bias", false)) fail("%s: attention_bias=true is not supported", what.c_str());
    std::string act = r.get_str("hidden_act", "silu");
    if (act != "silu") fail("%s: hidden_act '%s' is not supported (silu is)", what.c_str(), act.c_str());

    // RoPE: rope_parameters (transformers 5) or the older top-level fields.
    double partial = r.get_num("partial_rotary_factor", 1.0);
    c.rope_theta = r.get_num("rope_theta", 0);
    if (const json* rp = r.find("rope_parameters")) {
        if (!rp->is_object()) fail("%s: rope_parameters must be an object", what.c_str());
        reader rr{*rp, what};
        std::string type = rr.get_str("rope_type", "default");
        if (type != "default")
            fail("%s: rope_type '%s' is not supported yet (default is)", what.c_str(), type.c_str());
        partial = rr.get_num("partial_rotary_factor", partial);
        c.rope_theta = rr.get_num("rope_theta", c.rope_theta);
    }
    if (!(c.rope_theta > 0) || !std::isfinite(c.rope_theta))
        fail("%s: field 'rope_theta' must be positive and finite, got %g (or missing)", what.c_str(), c.rope_theta);
    if (!(partial > 0 && partial <= 1))
        fail("%s: field 'partial_rotary_factor' must be in (0, 1], got %g", what.c_str(), partial);
    c.rope_dim = (int64_t)(c.head_dim * partial);
    if (c.rope_dim <= 0 || c.rope_dim % 2)
        fail("%s: rotary dims %lld (head_dim x partial_rotary_factor) must be even and positive", what.c_str(),
             (long long)c.rope_dim);

    c.lin_k_heads = r.get_pos("linear_num_key_heads");
    c.lin_v_heads = r.get_pos("linear_num_value_heads");
    c.lin_k_dim = r.get_pos("linear_key_head_dim");
    c.lin_v_dim = r.get_pos("linear_value_head_dim");
    c.conv_kernel = r.get_pos("linear_conv_kernel_dim");
    if (c.lin_v_heads % c.lin_k_heads)
        fail("%s: linear_num_value_heads %lld is not a multiple of linear_num_key_heads %lld", what.c_str(),
             (long long)c.lin_v_heads, (long long)c.lin_k_heads);
    if (c.conv_kernel < 2 || c.conv_kernel > 16)
        fail("%s: linear_conv_kernel_dim %lld is out of range", what.c_str(), (long long)c.conv_kernel);

    c.n_experts = r.get_pos("num_experts");
    c.top_k = r.get_pos("num_experts_per_tok");
    c.expert_inter = r.get_pos("moe_intermediate_size");
    c.shared_inter = r.get_pos("shared_expert_intermediate_size");
    if (c.top_k > c.n_experts)
        fail("%s: num_experts_per_tok %lld exceeds num_experts %lld", what.c_str(), (long long)c.top_k,
             (long long)c.n_experts);
    if (const json* mlp_only = r.find("mlp_only_layers"); mlp_only && !(mlp_only->is_array() && mlp_only->empty()))
        fail("%s: mlp_only_layers (dense MLP layers) are not part of this architecture", what.c_str());

    if (const json* lt = r.find("layer_types")) {
        if (!lt->is_array()) fail("%s: layer_types must be an array", what.c_str());
        for (const json& v : *lt) {
            std::string s = v.is_string() ? v.get<std::string>() : v.dump();
            if (s == "linear_attention")
                c.layers.push_back(layer_kind::linear_attention);
            else if (s == "full_attention")
                c.layers.push_back(layer_kind::full_attention);
            else
                fail("%s: unknown layer type '%s' in layer_types", what.c_str(), s.c_str());
        }
        if ((int64_t)c.layers.size() != n_layers)
            fail("%s: layer counts disagree: layer_types lists %zu layers but num_hidden_layers is %lld", what.c_str(),
                 c.layers.size(), (long long)n_layers);
    } else {
        int64_t every = r.find("full_attention_interval") ? r.get_pos("full_attention_interval") : 4;
        for (int64_t i = 0; i < n_layers; i++)
            c.layers.push_back((i + 1) % every == 0 ? layer_kind::full_attention : layer_kind::linear_attention);
    }

    // Sizes that are each plausible can still multiply past int64 in byte counts: bound the largest matrices.
    const double experts_bytes = 3.0 * (double)c.n_experts * (double)c.expert_inter * (double)c.hidden;
    const double embed_bytes = (double)c.vocab * (double)c.hidden;
    if (experts_bytes * (double)n_layers > 1e14 || embed_bytes > 1e13)
        fail("%s: sizes are implausibly large (hidden_size %lld, vocab_size %lld, num_experts %lld, "
             "moe_intermediate_size %lld, %lld layers)", what.c_str(), (long long)c.hidden, (long long)c.vocab,
             (long long)c.n_experts, (long long)c.expert_inter, (long long)n_layers);

    // MLX quantisation block (top level, not inside text_config).
    const json* q = top.find("quantization");
    if (!q) q = top.find("quantization_config");
    if (q) {
        if (!q->is_object()) fail("%s: 'quantization' must be an object", what.c_str());
        reader qr{*q, what};
        std::string mode = qr.get_str("mode", "affine");
        if (mode != "affine")
            fail("%s: quantization mode '%s' is not supported (MLX affine is)", what.c_str(), mode.c_str());
        if (qr.find("quant_method"))
            fail("%s: quantization_config.quant_method '%s' is not supported (MLX affine checkpoints are)",
                 what.c_str(), qr.get_str("quant_method", "").c_str());
        json dflt = {{"bits", qr.find("bits") ? *qr.find("bits") : json()},
                     {"group_size", qr.find("group_size") ? *qr.find("group_size") : json()}};
        c.quant_default = parse_quant_entry(dflt, what, "(default)");
        for (auto it = q->begin(); it != q->end(); ++it) {
            if (it.key() == "bits" || it.key() == "group_size" || it.key() == "mode") continue;
            if (!it->is_object() && !it->is_boolean()) continue;  // unrelated scalar fields
            c.quant_overrides[it.key()] = parse_quant_entry(*it, what, it.key());
        }
        c.quantized = true;
    }
    return c;
}

model_config load_model_config(const std::string& dir) {
    if (!dir_exists(dir)) fail("%s: model directory does not exist", dir.c_str());
    std::string path = dir + "/config.json";
    if (!file_exists(path)) fail("%s: missing config.json", dir.c_str());
    return parse_model_config(read_text_file(path), path);
}

std::vector<int32_t> load_eos_ids(const std::string& dir) {
    std::vector<int32_t> ids;
    auto add = [&](const json& v) {
        if (v.is_number_integer()) ids.push_back(v.get<int32_t>());
        if (v.is_array())
            for (const json& e : v)
                if (e.is_number_integer()) ids.push_back(e.get<int32_t>());
    };
    for (const char* name : {"/generation_config.json", "/config.json"}) {
        std::string path = dir + name;
        if (!file_exists(path)) continue;
        json j = json::parse(read_text_file(path), nullptr, false);
        if (j.is_discarded() || !j.is_object()) fail("%s: not valid JSON", path.c_str());
        if (j.contains("eos_token_id")) add(j["eos_token_id"]);
        if (j.contains("text_config") && j["text_config"].is_object() && j["text_config"].contains("eos_token_id"))
            add(j["text_config"]["eos_token_id"]);
        if (!ids.empty()) break;
    }
    return ids;
}

}  // namespace tansy
