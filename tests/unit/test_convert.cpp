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
    o.out = test::temp_dir("conv-b") + "/y", o.bits = 3;
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
