#include "quant/convert.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "loader/checkpoint.h"
#include "loader/load_model.h"
#include "loader/safetensors.h"

namespace tansy {

using ojson = nlohmann::ordered_json;

namespace {

// A module quantised at other than the default bits or group size.
struct module_quant {
    std::string path;
    int bits, group;
};

// One output tensor: its header entry and how to produce its bytes when its turn comes. produce() returns
// them, either from memory it owns or after filling `scratch`; after() runs once they are written.
struct out_tensor {
    st_out_tensor hdr;
    uint64_t bytes = 0;
    std::function<const void*(std::vector<uint8_t>& scratch)> produce;
    std::function<void()> after;
};

// The three tensors of one quantised module come from one quantisation (run when the first is written) and
// are written one after the other; writing the last frees it.
struct quant_module {
    quantized_rows q;
    bool done = false;
};

const void* as_bytes(std::vector<uint8_t>& scratch, const void* p, size_t n) {
    scratch.assign((const uint8_t*)p, (const uint8_t*)p + n);
    return scratch.data();
}

class mlx_writer {
  public:
    mlx_writer(model& m, const convert_options& o) : m_(m), o_(o) {}

    // Unquantised vectors first, then every linear module in linear_modules() order (quantize_model.h: the one
    // list of MLX module paths, shared with quantise-at-load). Tensor order in a safetensors file is free.
    std::vector<out_tensor> plan() {
        const model_config& c = m_.cfg;
        model_weights& w = m_.w;
        const std::string P = "language_model.model.";
        f32_vector(P + "norm.weight", w.final_norm, {c.hidden});
        for (size_t i = 0; i < w.layers.size(); i++) {
            const layer_weights& l = w.layers[i];
            const std::string p = P + "layers." + std::to_string(i) + ".";
            f32_vector(p + "input_layernorm.weight", l.input_norm, {c.hidden});
            f32_vector(p + "post_attention_layernorm.weight", l.post_norm, {c.hidden});
            if (l.kind == layer_kind::full_attention) {
                f32_vector(p + "self_attn.q_norm.weight", l.attn.q_norm, {c.head_dim});
                f32_vector(p + "self_attn.k_norm.weight", l.attn.k_norm, {c.head_dim});
            } else {
                const std::string a = p + "linear_attn.";
                small_vector(a + "conv1d.weight", l.gdn.conv, {c.lin_conv_dim(), c.conv_kernel, 1});  // MLX [C,K,1]
                small_vector(a + "dt_bias", l.gdn.dt_bias, {c.lin_v_heads});
                f32_vector(a + "A_log", l.gdn.A_log, {c.lin_v_heads});  // mlx keeps A_log in fp32
                small_vector(a + "norm.weight", l.gdn.norm, {c.lin_v_dim});
            }
        }
        for (const linear_module& lm : linear_modules(w, c))
            quantized(lm.path, std::vector<const matrix*>(lm.parts.begin(), lm.parts.end()));
        return std::move(out_);
    }

    // Modules quantised at other than the default bits or group size: config.json must list each (MODEL.md §11.3).
    const std::vector<module_quant>& overrides() const { return overridden_; }
    int64_t params() const { return params_; }

  private:
    model& m_;  // non-const only because linear_modules() hands out mutable views; the writer only reads
    const convert_options& o_;
    std::vector<out_tensor> out_;
    std::vector<module_quant> overridden_;
    int64_t params_ = 0;
    std::vector<std::unique_ptr<quant_module>> modules_;


    void add(const std::string& name, dtype t, std::vector<int64_t> shape,
             std::function<const void*(std::vector<uint8_t>&)> f, std::function<void()> after = {}) {
        uint64_t n = dtype_size(t);
        for (int64_t d : shape) n *= (uint64_t)d;
        out_.push_back({{name, t, std::move(shape), nullptr}, n, std::move(f), std::move(after)});
    }

    // Zero-centred norms (already 1+w, the MLX convention) and A_log: fp32.
    void f32_vector(const std::string& name, const std::vector<float>& v, std::vector<int64_t> shape) {
        add(name, dtype::f32, std::move(shape), [&v](std::vector<uint8_t>&) -> const void* { return v.data(); });
    }

    // Other unquantised tensors: bf16 when that is lossless (it is for a bf16 source), else fp32.
    void small_vector(const std::string& name, const std::vector<float>& v, std::vector<int64_t> shape) {
        bool exact = true;
        for (float x : v) exact = exact && bf16_to_f32(f32_to_bf16(x)) == x;
        if (!exact) return f32_vector(name, v, std::move(shape));
        add(name, dtype::bf16, std::move(shape), [&v](std::vector<uint8_t>& b) {
            std::vector<uint16_t> h(v.size());
            for (size_t i = 0; i < v.size(); i++) h[i] = f32_to_bf16(v[i]);
            return as_bytes(b, h.data(), h.size() * 2);
        });
    }

    // One linear module (or E stacked experts of identical shape) -> weight/scales/biases.
    void quantized(const std::string& module, std::vector<const matrix*> parts) {
        const int bits = o_.policy.bits_for(module), group = o_.policy.group_for(module);
        const matrix& first = *parts[0];
        for (const matrix* p : parts)
            if (p->fmt != wfmt::dense)
                fail("%s: '%s' is already quantised; convert needs a bf16/f16/f32 checkpoint", m_.dir.c_str(),
                     p->name.c_str());
        const int64_t rows = first.rows, cols = first.cols, E = parts.size() > 1 ? (int64_t)parts.size() : 0;
        std::vector<int64_t> lead = E ? std::vector<int64_t>{E} : std::vector<int64_t>{};
        auto dims = [&](int64_t r, int64_t c) {
            auto d = lead;
            d.push_back(r);
            d.push_back(c);
            return d;
        };
        if (cols % group != 0) {  // MLX leaves such layers unquantised too
            add(module + ".weight", dtype::bf16, dims(rows, cols), [parts, rows, cols](std::vector<uint8_t>& b) {
                std::vector<float> row((size_t)cols);
                std::vector<uint16_t> h;
                for (const matrix* p : parts)
                    for (int64_t r = 0; r < rows; r++) {
                        p->row_f32(r, row.data());
                        for (float x : row) h.push_back(f32_to_bf16(x));
                    }
                return as_bytes(b, h.data(), h.size() * 2);
            });
            return;
        }
        if (bits != o_.policy.bits || group != o_.policy.group) overridden_.push_back({module, bits, group});
        params_ += (E ? E : 1) * rows * cols;
        auto* qm = modules_.emplace_back(std::make_unique<quant_module>()).get();
        const quant_method method = o_.policy.method;
        const checkpoint* src = m_.ckpt.get();
        std::vector<const float*> h;
        if (o_.policy.imatrix) h = o_.policy.imatrix->for_module(module, parts.size(), cols);
        auto run = [qm, parts, bits, group, method, src, h]() {
            if (qm->done) return;
            quantize_matrices(parts, bits, group, method, &qm->q, src, h);
            qm->done = true;
        };
        add(module + ".weight", dtype::u32, dims(rows, cols * bits / 32), [qm, run](std::vector<uint8_t>&) {
            run();
            return (const void*)qm->q.packed.data();
        });
        add(module + ".scales", dtype::bf16, dims(rows, cols / group), [qm, run](std::vector<uint8_t>&) {
            run();
            return (const void*)qm->q.scales.data();
        });
        add(
            module + ".biases", dtype::bf16, dims(rows, cols / group),
            [qm, run](std::vector<uint8_t>&) {
                run();
                return (const void*)qm->q.biases.data();
            },
            [qm] { qm->q = {}; });  // the module is fully written: free it
    }
};

class progress_bar {
  public:
    progress_bar(bool on, uint64_t total) : on_(on && total > 0), tty_(isatty(2)), total_(total) {}
    void update(uint64_t done, const std::string& what) {
        if (!on_) return;
        const int pct = (int)(100.0 * (double)done / (double)total_);
        if (!tty_ && pct < last_ + 10 && done < total_) return;
        last_ = pct;
        const int w = 30, fill = pct * w / 100;
        fprintf(stderr, "%sconvert [%.*s%*s] %3d%% %s%s", tty_ ? "\r" : "", fill, "##############################",
                w - fill, "", pct, what.substr(0, 60).c_str(), tty_ ? "\033[K" : "\n");
        if (tty_ && done >= total_) fputc('\n', stderr);
    }

  private:
    bool on_, tty_;
    uint64_t total_;
    int last_ = -100;
};

void write_shard(const std::string& path, std::vector<out_tensor*>& ts, progress_bar& bar, uint64_t& done,
                 uint64_t& written) {
    std::vector<st_out_tensor> hdrs;
    for (out_tensor* t : ts) hdrs.push_back(t->hdr);
    st_writer w(path, hdrs, {{"format", "mlx"}});
    std::vector<uint8_t> scratch;
    for (out_tensor* t : ts) {
        w.write(t->produce(scratch), t->bytes);
        if (t->after) t->after();
        written += t->bytes;
        bar.update(++done, t->hdr.name);
    }
    w.finish();
}

void copy_file(const std::string& from, const std::string& to) {
    FILE* in = fopen(from.c_str(), "rb");
    if (!in) fail("%s: cannot open: %s", from.c_str(), strerror(errno));
    FILE* out = fopen(to.c_str(), "wb");
    if (!out) {
        fclose(in);
        fail("%s: cannot create: %s", to.c_str(), strerror(errno));
    }
    char buf[1 << 16];
    size_t n;
    bool ok = true;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0) ok = ok && fwrite(buf, 1, n, out) == n;
    fclose(in);
    ok = fclose(out) == 0 && ok;
    if (!ok) fail("%s: write failed", to.c_str());
}

ojson mlx_config(const std::string& src_dir, const model_config& c, const convert_options& o,
                 const std::vector<module_quant>& overridden) {
    ojson cfg = ojson::parse(read_text_file(src_dir + "/config.json"));
    if (!cfg.contains("text_config")) {  // text-only source: wrap into the release form MLX tools read
        ojson text = cfg;
        text.erase("architectures");
        text.erase("transformers_version");
        text["model_type"] = "qwen3_5_moe_text";
        cfg = ojson{{"architectures", {"Qwen3_5MoeForConditionalGeneration"}},
                    {"model_type", "qwen3_5_moe"},
                    {"tie_word_embeddings", c.tie_embeddings},
                    {"text_config", text}};
    }
    ojson q = {{"group_size", o.policy.group}, {"bits", o.policy.bits}, {"mode", "affine"}};
    std::vector<module_quant> sorted = overridden;
    std::sort(sorted.begin(), sorted.end(), [](const module_quant& a, const module_quant& b) { return a.path < b.path; });
    for (const module_quant& m : sorted) q[m.path] = {{"group_size", m.group}, {"bits", m.bits}};
    cfg["quantization"] = q;
    cfg["quantization_config"] = q;
    return cfg;
}

}  // namespace

convert_report convert_to_mlx(const convert_options& o) {
    const auto t0 = std::chrono::steady_clock::now();
    const quant_policy& qp = o.policy;
    if (qp.bits != 2 && qp.bits != 4 && qp.bits != 8) fail("convert: --bits must be 2, 4 or 8 (got %d)", qp.bits);
    if (qp.group <= 0 || qp.group % 32 != 0 || qp.group > 256)
        fail("convert: --group-size must be a multiple of 32 from 32 to 256 (got %d)", qp.group);
    for (const auto& [pat, bits] : qp.overrides)
        if (bits != 2 && bits != 4 && bits != 8)
            fail("convert: '%s' bits must be 2, 4 or 8 (got %d)", pat.c_str(), bits);
    for (const auto& [pat, group] : qp.group_overrides)
        if (group < 32 || group > 256 || group % 32 != 0)
            fail("convert: '%s' group size must be a multiple of 32 from 32 to 256 (got %d)", pat.c_str(), group);
    if (o.out.empty()) fail("convert: no output directory");
    model m = load_model(o.src);
    if (mkdir(o.out.c_str(), 0755) != 0 && errno != EEXIST) fail("%s: cannot create: %s", o.out.c_str(), strerror(errno));
    if (!dir_exists(o.out)) fail("%s: not a directory", o.out.c_str());
    if (file_exists(o.out + "/config.json"))
        fail("%s already holds a checkpoint (config.json); choose an empty directory", o.out.c_str());

    mlx_writer w(m, o);
    std::vector<out_tensor> plan = w.plan();
    // Shards of at most shard_bytes (each holds at least one tensor).
    std::vector<std::vector<out_tensor*>> shards(1);
    uint64_t in_shard = 0;
    for (out_tensor& t : plan) {
        if (!shards.back().empty() && in_shard + t.bytes > o.shard_bytes) shards.emplace_back(), in_shard = 0;
        shards.back().push_back(&t);
        in_shard += t.bytes;
    }
    convert_report rep;
    rep.tensors = (int64_t)plan.size();
    rep.params = w.params();
    rep.files = (int64_t)shards.size();
    rep.bytes_in = m.ckpt->total_bytes();
    progress_bar bar(o.progress, plan.size());
    uint64_t done = 0;
    ojson wmap = ojson::object();
    for (size_t s = 0; s < shards.size(); s++) {
        char name[64];
        if (shards.size() == 1)
            snprintf(name, sizeof name, "model.safetensors");
        else
            snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
        write_shard(o.out + "/" + name, shards[s], bar, done, rep.bytes_out);
        for (out_tensor* t : shards[s]) wmap[t->hdr.name] = name;
    }
    ojson index = {{"metadata", {{"total_size", rep.bytes_out}}}, {"weight_map", wmap}};
    FILE* f = fopen((o.out + "/model.safetensors.index.json").c_str(), "w");
    if (!f) fail("%s: cannot write the index", o.out.c_str());
    fputs(index.dump(2).c_str(), f);
    fclose(f);
    // Everything else (tokenizer, chat template, generation config) is copied as is.
    if (DIR* d = opendir(o.src.c_str())) {
        while (dirent* e = readdir(d)) {
            const std::string n = e->d_name;
            const bool skip = n == "config.json" || n == "model.safetensors.index.json" ||
                              (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0);
            if (!skip && file_exists(o.src + "/" + n)) copy_file(o.src + "/" + n, o.out + "/" + n);
        }
        closedir(d);
    }
    // config.json last: its presence marks a complete checkpoint.
    f = fopen((o.out + "/config.json").c_str(), "w");
    if (!f) fail("%s: cannot write config.json", o.out.c_str());
    fputs(mlx_config(o.src, m.cfg, o, w.overrides()).dump(2).c_str(), f);
    fclose(f);
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return rep;
}

}  // namespace tansy
