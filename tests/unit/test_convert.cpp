// tansy convert: exactness against MLX's own quantiser (the mlx4 fixture), error bounds, a loadable result.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>

#include "core/check.h"
#include "loader/checkpoint.h"
#include "loader/load_model.h"
#include "quant/affine.h"
#include "quant/convert.h"
#include "quant/quantize_model.h"
#include "loader/safetensors.h"
#include "runtime/engine.h"
#include "synth_model.h"
#include "test_util.h"

using namespace tansy;
using json = nlohmann::json;

TEST(convert, minmax_reproduces_the_mlx_fixture_bit_for_bit) {
    // tiny-qwen35moe-mlx4 was written by MLX's affine rule from tiny-qwen35moe (../shared/tools).
    const std::string src = test::fixture("tiny-qwen35moe"), want = test::fixture("tiny-qwen35moe-mlx4");
    if (src.empty() || want.empty()) GTEST_SKIP() << "tiny-qwen35moe (bf16) is not shipped; needs ../shared/fixtures";
    convert_options o;
    o.src = src, o.out = test::temp_dir("conv") + "/out", o.progress = false;
    o.policy = quant_policy::mlx();
    convert_report r = convert_to_mlx(o);
    checkpoint got(o.out), ref(want);
    ASSERT_EQ(got.tensors().size(), ref.tensors().size());
    EXPECT_EQ(r.tensors, (int64_t)ref.tensors().size());
    for (const st_tensor* t : ref.tensors()) {
        const st_tensor* g = got.find(t->name);
        ASSERT_NE(g, nullptr) << t->name;
        EXPECT_EQ(g->type, t->type) << t->name;
        EXPECT_EQ(g->shape, t->shape) << t->name;
        EXPECT_TRUE(g->nbytes() == t->nbytes() && memcmp(g->data, t->data, t->nbytes()) == 0) << t->name;
    }
    json a = json::parse(read_text_file(o.out + "/config.json")), b = json::parse(read_text_file(want + "/config.json"));
    EXPECT_EQ(a["quantization"], b["quantization"]);
}

TEST(convert, synthetic_model_round_trip) {
    json cfg = test::synth_config();
    cfg["vocab_size"] = 128;
    std::string src = test::temp_dir("conv-src");
    test::write_checkpoint(src, cfg, test::synth_tensors(cfg, 3));
    test::write_file(src + "/tokenizer_config.json", "{}");
    convert_options o;
    o.src = src, o.out = test::temp_dir("conv-dst") + "/q4", o.progress = false;
    o.policy = quant_policy::mlx();
    convert_to_mlx(o);
    EXPECT_TRUE(std::filesystem::exists(o.out + "/tokenizer_config.json"));  // side files copied
    model q = load_model(o.out), f = load_model(src);
    EXPECT_EQ(q.w.layout, checkpoint_layout::mlx);
    EXPECT_EQ(q.w.layers[0].moe.router.bits, 8);  // routers 8-bit, as MLX does
    EXPECT_EQ(q.w.layers[0].moe.gate[1].bits, 4);
    // Every dequantised weight is within half a step |scale| of the original, except where MLX's rule (the
    // larger-magnitude extreme on the grid, zero exactly representable) leaves the other extreme outside the
    // 16 levels: there the clip adds at most (hi - lo) - 15|scale|.
    const matrix &mq = q.w.layers[1].attn.q_proj, &mf = f.w.layers[1].attn.q_proj;
    std::vector<float> rq((size_t)mq.cols), rf((size_t)mf.cols);
    for (int64_t r = 0; r < mq.rows; r++) {
        mq.row_f32(r, rq.data());
        mf.row_f32(r, rf.data());
        for (int64_t g = 0; g < mq.cols / mq.group; g++) {
            uint16_t sraw;
            memcpy(&sraw, mq.scales + (size_t)(r * (mq.cols / mq.group) + g) * 2, 2);
            const float s = std::fabs(bf16_to_f32(sraw));
            float lo = INFINITY, hi = -INFINITY;
            for (int64_t c = g * mq.group; c < (g + 1) * mq.group; c++) lo = std::min(lo, rf[c]), hi = std::max(hi, rf[c]);
            const float bound = 0.5f * s + std::max(0.0f, (hi - lo) - 15.0f * s) + 4e-3f * std::max(std::fabs(lo), std::fabs(hi));
            for (int64_t c = g * mq.group; c < (g + 1) * mq.group; c++)
                ASSERT_LE(std::fabs(rq[c] - rf[c]), bound) << r << "," << c;
        }
    }
    // norms (1+w) and the small vectors survive exactly
    EXPECT_EQ(q.w.final_norm, f.w.final_norm);
    EXPECT_EQ(q.w.layers[0].gdn.conv, f.w.layers[0].gdn.conv);
    EXPECT_EQ(q.w.layers[0].gdn.A_log, f.w.layers[0].gdn.A_log);
    // and the quantised model still computes similar logits. Random untrained weights are the worst case for
    // 4-bit (measured 0.31 relative here); a packing or scale bug gives > 1.
    engine_options eo;
    eo.model_dir = o.out;
    engine eq(eo);
    eo.model_dir = src;
    engine ef(eo);
    std::vector<int32_t> ids = {1, 5, 9, 40, 77, 3};
    auto s1 = eq.new_sequence(8), s2 = ef.new_sequence(8);
    EXPECT_LT(test::rel_error(eq.step(*s1, ids, logits_rows::all), ef.step(*s2, ids, logits_rows::all)), 0.5);
}

TEST(convert, refuses_bad_requests) {
    const std::string mlx = test::fixture("tiny-qwen35moe-mlx4");
    if (!mlx.empty()) {
        convert_options o;
        o.src = mlx, o.out = test::temp_dir("conv-bad") + "/x", o.progress = false;
        EXPECT_THROW(convert_to_mlx(o), tansy::error);  // already quantised
    }
    json cfg = test::synth_config();
    std::string src = test::temp_dir("conv-src2");
    test::write_checkpoint(src, cfg, test::synth_tensors(cfg, 4));
    convert_options o;
    o.src = src, o.out = src, o.progress = false;
    EXPECT_THROW(convert_to_mlx(o), tansy::error);  // would overwrite a checkpoint
    o.out = test::temp_dir("conv-b") + "/y", o.policy.bits = 3;
    EXPECT_THROW(convert_to_mlx(o), tansy::error);
}

TEST(quantize, minmax_maps_group_extremes_exactly) {
    std::vector<float> w = test::random_normal(128, 8);
    quantized_rows q;
    quantize_rows(w.data(), 2, 64, 4, 64, quant_method::minmax, &q);
    for (int r = 0; r < 2; r++) {
        const float s = bf16_to_f32(q.scales[r]), b = bf16_to_f32(q.biases[r]);
        float lo = INFINITY, hi = -INFINITY, dlo = INFINITY, dhi = -INFINITY;
        for (int c = 0; c < 64; c++) {
            const uint32_t v = (q.packed[(size_t)(r * 8 + c / 8)] >> (4 * (c % 8))) & 15u;
            const float d = s * (float)v + b;
            lo = std::min(lo, w[r * 64 + c]), hi = std::max(hi, w[r * 64 + c]);
            dlo = std::min(dlo, d), dhi = std::max(dhi, d);
        }
        // the larger-magnitude extreme is the bias (exact up to bf16), the other lands within a step
        EXPECT_NEAR(std::fabs(lo) > std::fabs(hi) ? dlo : dhi, std::fabs(lo) > std::fabs(hi) ? lo : hi,
                    std::fabs(b) * 4e-3f);
        EXPECT_NEAR(dhi - dlo, hi - lo, std::fabs(s) * 1.01f);
    }
}

namespace {

// The fp32 CPU engine against a float64 numpy forward of the same dequantised weights: tiny-gqa's own golden
// logits sit ~5e-6 (relative) from an exact fp32 engine; 2e-5 as the GQA test allows.
constexpr double TOL_NUMPY_LOGITS_REL = 2e-5;

// Every linear module of two loaded models holds the same bytes (format, bits, packed words, scales, biases).
void expect_same_matrices(model& a, model& b) {
    std::vector<linear_module> la = linear_modules(a.w, a.cfg), lb = linear_modules(b.w, b.cfg);
    ASSERT_EQ(la.size(), lb.size());
    for (size_t i = 0; i < la.size(); i++) {
        ASSERT_EQ(la[i].path, lb[i].path);
        ASSERT_EQ(la[i].parts.size(), lb[i].parts.size());
        for (size_t k = 0; k < la[i].parts.size(); k++) {
            const matrix &x = *la[i].parts[k], &y = *lb[i].parts[k];
            ASSERT_EQ(x.fmt, y.fmt) << la[i].path;
            ASSERT_EQ(x.bits, y.bits) << la[i].path;
            ASSERT_EQ(x.group, y.group) << la[i].path;
            ASSERT_EQ(x.type, y.type) << la[i].path;
            ASSERT_EQ(x.rows, y.rows) << la[i].path;
            ASSERT_EQ(memcmp(x.w, y.w, (size_t)x.rows * x.row_bytes()), 0) << la[i].path << " part " << k;
            if (x.fmt == wfmt::affine) {
                ASSERT_EQ(memcmp(x.scales, y.scales, (size_t)x.rows * x.group_bytes()), 0) << la[i].path;
                ASSERT_EQ(memcmp(x.biases, y.biases, (size_t)x.rows * x.group_bytes()), 0) << la[i].path;
            }
        }
    }
}

// tools/dequant_reference.py's checksum: sum of byte_i * (i % 65521 + 1), mod 2^64.
uint64_t checksum(const uint8_t* p, size_t n) {
    uint64_t s = 0;
    for (size_t i = 0; i < n; i++) s += (uint64_t)p[i] * (uint64_t)(i % 65521 + 1);
    return s;
}

}  // namespace

TEST(convert, text_and_release_layouts_give_identical_tensors) {
    const std::string text = test::fixture("tiny-qwen35moe"), release = test::fixture("tiny-qwen35moe-hub");
    if (text.empty() || release.empty()) GTEST_SKIP() << "the bf16 tiny model is not shipped; needs ../shared/fixtures";
    const std::string d = test::temp_dir("conv-layouts");
    convert_options o;
    o.progress = false;
    o.src = text, o.out = d + "/a";
    convert_to_mlx(o);
    o.src = release, o.out = d + "/b";
    convert_to_mlx(o);
    checkpoint a(d + "/a"), b(d + "/b");
    ASSERT_EQ(a.tensors().size(), b.tensors().size());
    for (const st_tensor* t : a.tensors()) {
        const st_tensor* u = b.find(t->name);
        ASSERT_NE(u, nullptr) << t->name;
        EXPECT_EQ(t->type, u->type) << t->name;
        EXPECT_EQ(t->shape, u->shape) << t->name;
        EXPECT_TRUE(t->nbytes() == u->nbytes() && memcmp(t->data, u->data, t->nbytes()) == 0) << t->name;
    }
    json ca = json::parse(read_text_file(d + "/a/config.json")), cb = json::parse(read_text_file(d + "/b/config.json"));
    EXPECT_EQ(ca["quantization"], cb["quantization"]);
}

TEST(convert, config_lists_every_module_quantised_at_other_bits) {
    json cfg = test::synth_config();
    const std::string src = test::temp_dir("conv-cfg");
    test::write_checkpoint(src, cfg, test::synth_tensors(cfg, 5));
    convert_options o;
    o.src = src, o.out = test::temp_dir("conv-cfg-out") + "/q", o.progress = false;
    o.policy.overrides.push_back({"layers.1.self_attn.q_proj", 2});
    o.policy.group_overrides.push_back({"layers.1.mlp.switch_mlp", 32});  // a group size of its own
    convert_to_mlx(o);
    const json q = json::parse(read_text_file(o.out + "/config.json"))["quantization"];
    EXPECT_EQ(q, json::parse(read_text_file(o.out + "/config.json"))["quantization_config"]);
    checkpoint ck(o.out);
    int listed = 0, quantised = 0;
    for (const st_tensor* t : ck.tensors()) {
        if (t->name.size() < 7 || t->name.compare(t->name.size() - 7, 7, ".scales") != 0) continue;
        const std::string module = t->name.substr(0, t->name.size() - 7);
        const st_tensor& w = ck.get(module + ".weight");
        const int group = o.policy.group_for(module);
        const int bits = (int)(w.shape.back() * 32 / (t->shape.back() * group));  // MODEL.md §11.3
        EXPECT_EQ(bits, o.policy.bits_for(module)) << module;
        quantised++;
        if (q.contains(module)) {
            listed++;
            EXPECT_EQ(q[module]["bits"], bits) << module;
            EXPECT_EQ(q[module]["group_size"], group) << module;
        } else {
            EXPECT_EQ(bits, q["bits"].get<int>()) << module << " differs from the default but is not listed";
            EXPECT_EQ(group, q["group_size"].get<int>()) << module << " differs from the default but is not listed";
        }
    }
    EXPECT_GT(quantised, 10);
    EXPECT_EQ(listed + 3, (int)q.size());  // + group_size, bits, mode
    ASSERT_TRUE(q.contains("language_model.model.layers.1.self_attn.q_proj"));
    EXPECT_EQ(q["language_model.model.layers.1.self_attn.q_proj"]["bits"], 2);
    const std::string experts = "language_model.model.layers.1.mlp.switch_mlp.up_proj";
    ASSERT_TRUE(q.contains(experts));
    EXPECT_EQ(q[experts]["group_size"], 32);
    EXPECT_EQ(q[experts]["bits"], 4);
    model m = load_model(o.out);  // the loader checks shapes against the block too
    EXPECT_EQ(m.w.layers[1].attn.q_proj.bits, 2);
    EXPECT_EQ(m.w.embed.bits, 8);
    ASSERT_EQ(m.w.layers.size(), 2u);
    ASSERT_FALSE(m.w.layers[1].moe.up.empty());
    EXPECT_EQ(m.w.layers[1].moe.up[0].group, 32);
    EXPECT_EQ(m.w.layers[0].moe.up[0].group, 64);
}

TEST(convert, quantise_at_load_equals_convert_then_load) {
    std::vector<std::string> sources;
    json cfg = test::synth_config();
    const std::string synth = test::temp_dir("conv-qal");
    test::write_checkpoint(synth, cfg, test::synth_tensors(cfg, 6));
    sources.push_back(synth);
    if (std::string gqa = test::fixture("tiny-gqa"); !gqa.empty()) sources.push_back(gqa);
    for (const std::string& src : sources) {
        convert_options o;
        o.src = src, o.out = test::temp_dir("conv-qal-out") + "/q", o.progress = false;
        convert_to_mlx(o);
        model converted = load_model(o.out), at_load = load_model(src);
        quantize_report rep = quantize_model(at_load, quant_policy{});
        EXPECT_GT(rep.matrices, 0);
        EXPECT_LT(rep.bytes_after, rep.bytes_before);
        expect_same_matrices(converted, at_load);
        // ... and so the same logits, bit for bit (same views, same CPU ops)
        engine_options eo;
        eo.model_dir = o.out;
        engine ec(eo);
        eo.model_dir = src, eo.weights = "q4";
        engine el(eo);
        const std::vector<int32_t> ids = {3, 17, 42, 5, 77, 1, 9};
        auto s1 = ec.new_sequence(8), s2 = el.new_sequence(8);
        EXPECT_EQ(ec.step(*s1, ids, logits_rows::all), el.step(*s2, ids, logits_rows::all)) << src;
    }
}

TEST(convert, weight_formats_at_load) {
    json cfg = test::synth_config();
    const std::string src = test::temp_dir("conv-wf");
    test::write_checkpoint(src, cfg, test::synth_tensors(cfg, 7));
    model m = load_model(src);
    EXPECT_EQ(prepare_weights(m, "bf16", "cpu").matrices, 0);  // dense: nothing to do
    EXPECT_EQ(prepare_weights(m, "auto", "cpu").matrices, 0);
    EXPECT_GT(prepare_weights(m, "q4", "cpu").matrices, 0);
    EXPECT_EQ(m.w.layers[0].moe.gate[0].fmt, wfmt::affine);
    EXPECT_EQ(m.w.layers[0].moe.router.bits, 8);
    EXPECT_EQ(prepare_weights(m, "q4", "cpu").matrices, 0);      // already quantised: kept
    EXPECT_THROW(prepare_weights(m, "bf16", "cpu"), tansy::error);  // quantised: cannot run as bf16
    EXPECT_THROW(prepare_weights(m, "q3", "cpu"), tansy::error);
}

// auto: the GPU runs 4-bit weights, so an unquantised checkpoint is quantised at load there (the same bytes as
// --weights q4); an already-quantised one is kept; the CPU keeps what the checkpoint holds.
TEST(convert, auto_weights_are_q4_on_cuda) {
    json cfg = test::synth_config();
    const std::string src = test::temp_dir("conv-auto");
    test::write_checkpoint(src, cfg, test::synth_tensors(cfg, 8));
    model a = load_model(src), b = load_model(src);
    const quantize_report r = prepare_weights(a, "auto", "cuda");
    EXPECT_GT(r.matrices, 0);
    EXPECT_LT(r.bytes_after, r.bytes_before);
    for (const linear_module& lm : linear_modules(a.w, a.cfg))  // all but widths the group does not divide
        EXPECT_EQ(lm.parts[0]->fmt, lm.parts[0]->cols % 64 == 0 ? wfmt::affine : wfmt::dense) << lm.path;
    EXPECT_EQ(prepare_weights(b, "q4", "cpu").matrices, r.matrices);
    const matrix &ga = a.w.layers[0].moe.gate[0], &gb = b.w.layers[0].moe.gate[0];
    EXPECT_EQ(0, memcmp(ga.w, gb.w, (size_t)ga.rows * ga.row_bytes()));  // the same quantisation
    EXPECT_EQ(prepare_weights(a, "auto", "cuda").matrices, 0);  // already quantised: kept
    model c = load_model(src);
    EXPECT_EQ(prepare_weights(c, "auto", "cpu").matrices, 0);
    EXPECT_EQ(c.w.layers[0].moe.gate[0].fmt, wfmt::dense);
}

TEST(convert, output_matches_the_numpy_dequantised_reference) {
    // tests/golden/tiny-gqa-q4.safetensors: tools/dequant_reference.py run on `tansy convert` of tiny-gqa with
    // the default options; its dequantisation and float64 forward are independent of the C++ loader and ops.
    const std::string src = test::fixture("tiny-gqa");
    const std::string gold = std::string(TANSY_SOURCE_DIR) + "/tests/golden/tiny-gqa-q4.safetensors";
    if (src.empty()) GTEST_SKIP() << "tiny-gqa is unpacked at configure time";
    convert_options o;
    o.src = src, o.out = test::temp_dir("conv-np") + "/q", o.progress = false;
    convert_to_mlx(o);
    st_file g(gold);
    std::string sums_json;
    for (const auto& [k, v] : g.metadata())
        if (k == "checksums") sums_json = v;
    const json sums = json::parse(sums_json);
    checkpoint ck(o.out);
    int n = 0;
    for (const auto& [name, want] : sums.items()) {
        const st_tensor& t = ck.get(name);
        ASSERT_EQ(std::to_string(checksum(t.data, t.nbytes())), want.get<std::string>())
            << name << ": the quantiser's output changed; if on purpose, regenerate the golden: "
            << "tansy convert --model build/fixtures/tiny-gqa --out DIR && python3 tools/dequant_reference.py "
               "--model DIR --ids-from build/fixtures/tiny-gqa-reference.safetensors:prompt0.ids --out " << gold;
        n++;
    }
    EXPECT_GT(n, 100);
    const st_tensor& ids_t = *g.find("ids");
    std::vector<int32_t> ids((size_t)ids_t.numel());
    memcpy(ids.data(), ids_t.data, ids_t.nbytes());
    const st_tensor& lt = *g.find("logits");
    std::vector<float> want((size_t)lt.numel());
    memcpy(want.data(), lt.data, lt.nbytes());
    engine_options eo;
    eo.model_dir = o.out;
    engine e(eo);
    auto st = e.new_sequence((int64_t)ids.size());
    EXPECT_LT(test::rel_error(e.step(*st, ids, logits_rows::all), want), TOL_NUMPY_LOGITS_REL);
}

TEST(convert, refuses_non_finite_weights) {
    json cfg = test::synth_config();
    std::vector<test::synth_tensor> ts = test::synth_tensors(cfg, 8);
    bool poisoned = false;
    for (test::synth_tensor& t : ts)
        if (t.name.find("layers.0.mlp.experts.1.up_proj") != std::string::npos) {
            const uint16_t nan_bf16 = 0x7fc0;
            memcpy(t.data.data() + 2 * 70, &nan_bf16, 2);
            poisoned = true;
        }
    ASSERT_TRUE(poisoned);
    const std::string src = test::temp_dir("conv-nan");
    test::write_checkpoint(src, cfg, ts);
    convert_options o;
    o.src = src, o.out = test::temp_dir("conv-nan-out") + "/q", o.progress = false;
    EXPECT_THROW(convert_to_mlx(o), tansy::error);
    EXPECT_THROW(prepare_weights(*std::make_unique<model>(load_model(src)), "q4", "cpu"), tansy::error);
}
