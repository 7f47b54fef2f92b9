#include "model/synthetic.h"

#include <cmath>
#include <cstring>
#include <random>

#include "core/check.h"

namespace tansy {

namespace {

uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

class builder {
  public:
    builder(model& m, const synthetic_options& o) : m_(m), o_(o) {}

    // Affine matrix [rows, cols] (or `stack` stacked ones) with weights of standard deviation `std`.
    std::vector<matrix> affine(const std::string& name, int64_t rows, int64_t cols, int bits, int64_t stack, float std) {
        TANSY_CHECK(cols % o_.group == 0, "%s: %lld columns", name.c_str(), (long long)cols);
        matrix m;
        m.fmt = wfmt::affine, m.type = dtype::bf16, m.rows = rows * stack, m.cols = cols, m.bits = bits, m.group = o_.group;
        m.name = name;
        if (o_.materialize) {
            const uint64_t seed = mix64(o_.seed * 1000003u + ++counter_);
            const size_t words = (size_t)(m.rows * cols * bits / 32), groups = (size_t)(m.rows * cols / o_.group);
            auto w = std::shared_ptr<uint32_t[]>(new uint32_t[words]);
            auto sc = std::shared_ptr<uint16_t[]>(new uint16_t[groups]);
            auto bi = std::shared_ptr<uint16_t[]>(new uint16_t[groups]);
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < (int64_t)words; i++) w[(size_t)i] = (uint32_t)mix64(seed ^ (uint64_t)i);
            // uniform codes have sd 2^bits/sqrt(12); the bias centres them on zero
            const float levels = (float)(1 << bits), sd = levels / std::sqrt(12.0f);
#pragma omp parallel for schedule(static)
            for (int64_t g = 0; g < (int64_t)groups; g++) {
                const uint64_t r = mix64(~seed ^ (uint64_t)g);
                const float scale = std / sd * (0.75f + 0.5f * (float)(r & 0xFFFF) / 65535.0f);
                sc[(size_t)g] = f32_to_bf16(scale);
                bi[(size_t)g] = f32_to_bf16(-scale * (levels - 1) * 0.5f);
            }
            m.w = (const uint8_t*)w.get(), m.scales = (const uint8_t*)sc.get(), m.biases = (const uint8_t*)bi.get();
            m_.owned.push_back(w), m_.owned.push_back(sc), m_.owned.push_back(bi);
        }
        if (stack == 1) return {m};
        std::vector<matrix> parts;
        for (int64_t e = 0; e < stack; e++) {
            matrix v = m.w ? m.rows_view(e * rows, rows) : m;
            v.rows = rows;
            if (!m.w) v.name = name + "[" + std::to_string(e) + "]";
            parts.push_back(v);
        }
        return parts;
    }
    matrix one(const std::string& name, int64_t rows, int64_t cols, int bits, float std) {
        return affine(name, rows, cols, bits, 1, std)[0];
    }

    std::vector<float> values(size_t n, float lo, float hi) {
        std::mt19937 rng((uint32_t)mix64(o_.seed + ++counter_));
        std::uniform_real_distribution<float> d(lo, hi);
        std::vector<float> v(n);
        for (float& x : v) x = d(rng);
        return v;
    }

  private:
    model& m_;
    const synthetic_options& o_;
    uint64_t counter_ = 0;
};

}  // namespace

model make_synthetic_model(const model_config& c, const synthetic_options& o) {
    model m;
    m.dir = "(synthetic)";
    m.cfg = c;
    m.synthetic = !o.materialize;
    builder b(m, o);
    const int64_t D = c.hidden;
    const float s_in = 1.0f / std::sqrt((float)D);
    m.w.layout = checkpoint_layout::mlx;
    m.w.embed = b.one("embed_tokens", c.vocab, D, 4, 1.0f);
    m.w.lm_head = b.one("lm_head", c.vocab, D, 4, s_in);
    m.w.final_norm.assign((size_t)D, 1.0f);
    for (layer_kind kind : c.layers) {
        layer_weights l;
        l.kind = kind;
        l.input_norm.assign((size_t)D, 1.0f);
        l.post_norm.assign((size_t)D, 1.0f);
        if (kind == layer_kind::full_attention) {
            l.attn.q_proj = b.one("q_proj", c.q_proj_rows(), D, 4, s_in);
            l.attn.k_proj = b.one("k_proj", c.kv_dim(), D, 4, s_in);
            l.attn.v_proj = b.one("v_proj", c.kv_dim(), D, 4, s_in);
            l.attn.o_proj = b.one("o_proj", D, c.n_q_heads * c.head_dim, 4, 1.0f / std::sqrt((float)(c.n_q_heads * c.head_dim)));
            l.attn.q_norm.assign((size_t)c.head_dim, 1.0f);
            l.attn.k_norm.assign((size_t)c.head_dim, 1.0f);
        } else {
            const int64_t vd = c.lin_value_dim();
            l.gdn.in_qkv = b.one("in_proj_qkv", c.lin_conv_dim(), D, 4, s_in);
            l.gdn.in_z = b.one("in_proj_z", vd, D, 4, s_in);
            l.gdn.in_b = b.one("in_proj_b", c.lin_v_heads, D, 4, s_in);
            l.gdn.in_a = b.one("in_proj_a", c.lin_v_heads, D, 4, s_in);
            l.gdn.out_proj = b.one("out_proj", D, vd, 4, 1.0f / std::sqrt((float)vd));
            l.gdn.conv = b.values((size_t)(c.lin_conv_dim() * c.conv_kernel), -0.5f, 0.5f);
            l.gdn.dt_bias = b.values((size_t)c.lin_v_heads, -1.0f, 1.0f);
            l.gdn.A_log = b.values((size_t)c.lin_v_heads, 0.0f, 2.7f);  // A in [1, 16), as trained models have
            l.gdn.norm.assign((size_t)c.lin_v_dim, 1.0f);
        }
        moe_weights& mw = l.moe;
        mw.router = b.one("mlp.gate", c.n_experts, D, 8, s_in);
        mw.shared_expert_gate = b.one("mlp.shared_expert_gate", 1, D, 8, s_in);
        mw.gate = b.affine("switch_mlp.gate_proj", c.expert_inter, D, 4, c.n_experts, s_in);
        mw.up = b.affine("switch_mlp.up_proj", c.expert_inter, D, 4, c.n_experts, s_in);
        mw.down = b.affine("switch_mlp.down_proj", D, c.expert_inter, 4, c.n_experts, 1.0f / std::sqrt((float)c.expert_inter));
        mw.shared_gate = b.one("shared_expert.gate_proj", c.shared_inter, D, 4, s_in);
        mw.shared_up = b.one("shared_expert.up_proj", c.shared_inter, D, 4, s_in);
        mw.shared_down = b.one("shared_expert.down_proj", D, c.shared_inter, 4, 1.0f / std::sqrt((float)c.shared_inter));
        m.w.layers.push_back(std::move(l));
    }
    return m;
}

model_config synthetic_config(const std::string& path, int64_t n_layers, int64_t vocab) {
    model_config c = parse_model_config(read_text_file(path), path);
    if (n_layers > 0) {
        if (n_layers > c.n_layers()) fail("%s has only %lld layers", path.c_str(), (long long)c.n_layers());
        c.layers.resize((size_t)n_layers);
    }
    if (vocab > 0) c.vocab = vocab;
    c.quantized = true;
    c.quant_default = {4, 64};
    return c;
}

}  // namespace tansy
