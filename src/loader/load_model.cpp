#include "loader/load_model.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "core/check.h"
#include "core/log.h"
#include "loader/checkpoint.h"

namespace tansy {

namespace {

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }

bool is_float(dtype t) { return t == dtype::bf16 || t == dtype::f16 || t == dtype::f32; }

std::string shape_str(const std::vector<int64_t>& s) {
    std::string r = "[";
    for (size_t i = 0; i < s.size(); i++) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + "]";
}

class loader {
  public:
    loader(const checkpoint& ck, const model_config& cfg) : ck_(ck), cfg_(cfg) { detect_layout(); }

    model_weights load() {
        const model_config& c = cfg_;
        model_weights w;
        w.layout = layout_;
        w.embed = get_matrix(prefix_ + "embed_tokens", c.vocab, c.hidden);
        if (find(lm_head_ + ".weight") || find(lm_head_ + ".scales") || !c.tie_embeddings)
            w.lm_head = get_matrix(lm_head_, c.vocab, c.hidden);
        else
            w.lm_head = w.embed;
        w.final_norm = get_norm(prefix_ + "norm.weight", c.hidden);
        for (int64_t i = 0; i < c.n_layers(); i++) w.layers.push_back(load_layer(i));
        check_leftovers();
        return w;
    }

  private:
    const checkpoint& ck_;
    const model_config& cfg_;
    checkpoint_layout layout_ = checkpoint_layout::hf_text;
    std::string prefix_, lm_head_;
    bool mlx_conventions_ = false;  // norms stored as 1+w, conv [C,K,1], switch_mlp experts
    std::set<std::string> used_;

    void detect_layout() {
        bool mlx = false, release = false, text = false, switch_mlp = false;
        for (const st_tensor* t : ck_.tensors()) {
            mlx |= starts_with(t->name, "language_model.model.");
            release |= starts_with(t->name, "model.language_model.");
            text |= starts_with(t->name, "model.layers.") || starts_with(t->name, "model.embed_tokens.");
            switch_mlp |= t->name.find(".mlp.switch_mlp.") != std::string::npos;
        }
        if (mlx + release + text != 1)
            fail("%s: unrecognised checkpoint layout: expected tensors under exactly one of model.*, "
                 "model.language_model.* (release) or language_model.model.* (MLX)",
                 ck_.dir().c_str());
        if (mlx) {
            layout_ = checkpoint_layout::mlx, prefix_ = "language_model.model.", lm_head_ = "language_model.lm_head";
            mlx_conventions_ = true;
        } else if (release) {
            layout_ = checkpoint_layout::hf_release, prefix_ = "model.language_model.", lm_head_ = "lm_head";
        } else {
            layout_ = checkpoint_layout::hf_text, prefix_ = "model.", lm_head_ = "lm_head";
            // mlx-lm (not mlx-vlm) keeps model.* names but applies the same conversions.
            if (switch_mlp) layout_ = checkpoint_layout::mlx, mlx_conventions_ = true;
        }
    }

    const st_tensor* find(const std::string& name) const { return ck_.find(name); }

    const st_tensor& get(const std::string& name) {
        const st_tensor* t = ck_.find(name);
        if (!t) fail("%s: missing tensor '%s' (%s layout)", ck_.dir().c_str(), name.c_str(), layout_name(layout_));
        used_.insert(name);
        return *t;
    }

    [[noreturn]] void bad_shape(const st_tensor& t, const std::vector<int64_t>& want) {
        fail("%s: tensor '%s' has shape %s, expected %s", t.file->c_str(), t.name.c_str(), t.shape_str().c_str(),
             shape_str(want).c_str());
    }

    void expect_shape(const st_tensor& t, const std::vector<int64_t>& want) {
        if (t.shape != want) bad_shape(t, want);
    }

    // A weight matrix [rows, cols], or `lead` stacked matrices [lead, rows, cols] (returned as one
    // [lead*rows, cols] view). `module` is the path without ".weight"; `fused` names a 3-D HF tensor that has
    // no ".weight" suffix.
    matrix get_matrix(const std::string& module, int64_t rows, int64_t cols, int64_t lead = 0,
                      bool no_weight_suffix = false) {
        std::vector<int64_t> lead_dims;
        if (lead) lead_dims.push_back(lead);
        auto dims = [&](int64_t r, int64_t c) {
            std::vector<int64_t> d = lead_dims;
            d.push_back(r);
            d.push_back(c);
            return d;
        };
        const std::string wname = no_weight_suffix ? module : module + ".weight";
        matrix m;
        m.name = module;
        m.rows = (lead ? lead : 1) * rows;
        m.cols = cols;
        const st_tensor& wt = get(wname);
        if (const st_tensor* sc = find(module + ".scales")) {
            const st_tensor& bi = get(module + ".biases");
            used_.insert(sc->name);
            quant_spec q = cfg_.quant_for(module);
            if (!cfg_.quantized)
                fail("%s: tensor '%s' is quantised but config.json has no 'quantization' block", ck_.dir().c_str(),
                     sc->name.c_str());
            if (q.bits == 0)
                fail("%s: config.json marks '%s' unquantised but the checkpoint has scales for it",
                     ck_.dir().c_str(), module.c_str());
            if (wt.type != dtype::u32)
                fail("%s: quantised tensor '%s' must be U32, got %s", wt.file->c_str(), wname.c_str(),
                     dtype_name(wt.type));
            if (!is_float(sc->type) || bi.type != sc->type)
                fail("%s: '%s' and '%s' must share a float dtype (got %s, %s)", sc->file->c_str(), sc->name.c_str(),
                     bi.name.c_str(), dtype_name(sc->type), dtype_name(bi.type));
            if (cols % q.group_size)
                fail("%s: '%s' has %lld input columns, not a multiple of group_size %d", ck_.dir().c_str(),
                     module.c_str(), (long long)cols, q.group_size);
            expect_shape(*sc, dims(rows, cols / q.group_size));
            expect_shape(bi, dims(rows, cols / q.group_size));
            // Robust rule (MODEL.md §11.3): bits follow from the shapes; they must agree with config.json.
            if (wt.shape.size() != lead_dims.size() + 2 || wt.shape.back() <= 0 ||
                (wt.shape.back() * 32) % cols != 0)
                bad_shape(wt, dims(rows, cols * q.bits / 32));
            int bits = (int)(wt.shape.back() * 32 / cols);
            if (bits != q.bits)
                fail("%s: '%s' is packed as %d-bit but config.json says %d-bit", ck_.dir().c_str(), module.c_str(),
                     bits, q.bits);
            expect_shape(wt, dims(rows, cols * bits / 32));
            m.fmt = wfmt::affine;
            m.type = sc->type;
            m.bits = bits;
            m.group = q.group_size;
            m.w = wt.data;
            m.scales = sc->data;
            m.biases = bi.data;
            return m;
        }
        if (!is_float(wt.type))
            fail("%s: tensor '%s' has dtype %s; expected BF16, F16 or F32%s", wt.file->c_str(), wname.c_str(),
                 dtype_name(wt.type), wt.type == dtype::u32 ? " (packed weights need .scales and .biases)" : "");
        expect_shape(wt, dims(rows, cols));
        m.fmt = wfmt::dense;
        m.type = wt.type;
        m.w = wt.data;
        return m;
    }

    std::vector<float> get_vector(const std::string& name, int64_t n) {
        const st_tensor& t = get(name);
        if (!is_float(t.type))
            fail("%s: tensor '%s' has dtype %s; expected a float type", t.file->c_str(), name.c_str(),
                 dtype_name(t.type));
        expect_shape(t, {n});
        std::vector<float> v((size_t)n);
        matrix m;
        m.type = t.type, m.rows = 1, m.cols = n, m.w = t.data;
        m.row_f32(0, v.data());
        return v;
    }

    // Zero-centred RMSNorm weights: returned as the multiplier the math applies (1+w).
    std::vector<float> get_norm(const std::string& name, int64_t n) {
        std::vector<float> v = get_vector(name, n);
        if (!mlx_conventions_)
            for (float& x : v) x += 1.0f;
        return v;
    }

    layer_weights load_layer(int64_t i) {
        const model_config& c = cfg_;
        const std::string p = prefix_ + "layers." + std::to_string(i) + ".";
        layer_weights l;
        l.kind = c.layers[(size_t)i];
        l.input_norm = get_norm(p + "input_layernorm.weight", c.hidden);
        l.post_norm = get_norm(p + "post_attention_layernorm.weight", c.hidden);
        if (l.kind == layer_kind::full_attention) {
            const std::string a = p + "self_attn.";
            l.attn.q_proj = get_matrix(a + "q_proj", c.q_proj_rows(), c.hidden);
            l.attn.k_proj = get_matrix(a + "k_proj", c.kv_dim(), c.hidden);
            l.attn.v_proj = get_matrix(a + "v_proj", c.kv_dim(), c.hidden);
            l.attn.o_proj = get_matrix(a + "o_proj", c.hidden, c.n_q_heads * c.head_dim);
            l.attn.q_norm = get_norm(a + "q_norm.weight", c.head_dim);
            l.attn.k_norm = get_norm(a + "k_norm.weight", c.head_dim);
        } else {
            const std::string a = p + "linear_attn.";
            const int64_t C = c.lin_conv_dim(), K = c.conv_kernel, Hv = c.lin_v_heads;
            l.gdn.in_qkv = get_matrix(a + "in_proj_qkv", C, c.hidden);
            l.gdn.in_z = get_matrix(a + "in_proj_z", c.lin_value_dim(), c.hidden);
            l.gdn.in_b = get_matrix(a + "in_proj_b", Hv, c.hidden);
            l.gdn.in_a = get_matrix(a + "in_proj_a", Hv, c.hidden);
            l.gdn.out_proj = get_matrix(a + "out_proj", c.hidden, c.lin_value_dim());
            l.gdn.dt_bias = get_vector(a + "dt_bias", Hv);
            l.gdn.A_log = get_vector(a + "A_log", Hv);
            l.gdn.norm = get_vector(a + "norm.weight", c.lin_v_dim);
            // conv1d: HF [C, 1, K], MLX [C, K, 1]; both are channel-major with the K taps contiguous.
            const st_tensor& cw = get(a + "conv1d.weight");
            std::vector<int64_t> hf{C, 1, K}, mlx{C, K, 1}, flat{C, K};
            if (cw.shape != hf && cw.shape != mlx && cw.shape != flat) bad_shape(cw, mlx_conventions_ ? mlx : hf);
            if (!is_float(cw.type))
                fail("%s: tensor '%s' has dtype %s; expected a float type", cw.file->c_str(), cw.name.c_str(),
                     dtype_name(cw.type));
            l.gdn.conv.resize((size_t)(C * K));
            matrix m;
            m.type = cw.type, m.rows = 1, m.cols = C * K, m.w = cw.data;
            m.row_f32(0, l.gdn.conv.data());
        }
        load_moe(p + "mlp.", l.moe);
        return l;
    }

    void load_moe(const std::string& p, moe_weights& m) {
        const model_config& c = cfg_;
        const int64_t E = c.n_experts, F = c.expert_inter, D = c.hidden;
        m.router = get_matrix(p + "gate", E, D);
        m.shared_gate = get_matrix(p + "shared_expert.gate_proj", c.shared_inter, D);
        m.shared_up = get_matrix(p + "shared_expert.up_proj", c.shared_inter, D);
        m.shared_down = get_matrix(p + "shared_expert.down_proj", D, c.shared_inter);
        m.shared_expert_gate = get_matrix(p + "shared_expert_gate", 1, D);
        auto split = [&](const matrix& all, int64_t rows_per, int64_t offset, std::vector<matrix>& out) {
            const int64_t stride = all.rows / E;
            for (int64_t e = 0; e < E; e++) out.push_back(all.rows_view(e * stride + offset, rows_per));
        };
        if (find(p + "switch_mlp.gate_proj.weight")) {  // MLX: stacked [E, out, in] per projection
            split(get_matrix(p + "switch_mlp.gate_proj", F, D, E), F, 0, m.gate);
            split(get_matrix(p + "switch_mlp.up_proj", F, D, E), F, 0, m.up);
            split(get_matrix(p + "switch_mlp.down_proj", D, F, E), D, 0, m.down);
        } else if (find(p + "experts.gate_up_proj")) {  // HF release: fused [E, 2F, D] (gate rows first)
            matrix gu = get_matrix(p + "experts.gate_up_proj", 2 * F, D, E, true);
            split(gu, F, 0, m.gate);
            split(gu, F, F, m.up);
            split(get_matrix(p + "experts.down_proj", D, F, E, true), D, 0, m.down);
        } else {  // HF text-only: one tensor per expert
            for (int64_t e = 0; e < E; e++) {
                const std::string x = p + "experts." + std::to_string(e) + ".";
                m.gate.push_back(get_matrix(x + "gate_proj", F, D));
                m.up.push_back(get_matrix(x + "up_proj", F, D));
                m.down.push_back(get_matrix(x + "down_proj", D, F));
            }
        }
    }

    // Tensors we did not consume: a layer beyond num_hidden_layers is an error (the counts disagree);
    // anything else outside the skipped towers is reported once.
    void check_leftovers() {
        static const char* skip[] = {"model.visual.", "vision_tower.", "language_model.vision_tower.", "mtp.",
                                     "model.mtp.", "visual."};
        std::vector<std::string> unknown;
        for (const st_tensor* t : ck_.tensors()) {
            if (used_.count(t->name)) continue;
            if (std::any_of(std::begin(skip), std::end(skip), [&](const char* s) { return starts_with(t->name, s); }))
                continue;
            if (starts_with(t->name, prefix_ + "layers.")) {
                long long idx = atoll(t->name.c_str() + prefix_.size() + 7);
                if (idx >= cfg_.n_layers())
                    fail("%s: layer counts disagree: tensor '%s' belongs to layer %lld but config.json has %lld "
                         "layers",
                         ck_.dir().c_str(), t->name.c_str(), idx, (long long)cfg_.n_layers());
            }
            unknown.push_back(t->name);
        }
        if (!unknown.empty())
            TANSY_WARN("%s: %zu unrecognised tensor(s) ignored, e.g. '%s'", ck_.dir().c_str(), unknown.size(),
                       unknown[0].c_str());
    }
};

}  // namespace

model load_model(const std::string& dir) {
    model m;
    m.dir = dir;
    m.cfg = load_model_config(dir);
    auto ck = std::make_shared<checkpoint>(dir);
    m.w = loader(*ck, m.cfg).load();
    m.ckpt = std::move(ck);
    if (m.w.layout == checkpoint_layout::mlx) {
        // Sanity check (MODEL.md §11.1): MLX converters store 1+w, so the norm means are near 1, not 0.
        double s = 0;
        for (float x : m.w.final_norm) s += x;
        if (std::abs(s / (double)m.w.final_norm.size()) < 0.25)
            TANSY_WARN("%s: final norm weights average %.3f; MLX checkpoints store 1+w (near 1). Wrong converter?",
                       dir.c_str(), s / (double)m.w.final_norm.size());
    }
    return m;
}

}  // namespace tansy
