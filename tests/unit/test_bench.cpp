// tansy bench's models and measurements: the prefill FLOP count (bench.h prefill_flops) on the real
// Qwen3.6-35B-A3B config and on a tiny config worked out by hand, and a prefill measurement on the embedded
// model with the CPU backend.
#include <cmath>

#include "loader/load_model.h"
#include "model/synthetic.h"
#include "runtime/bench.h"
#include "synth_model.h"
#include "test_util.h"

using namespace tansy;

namespace {

// MODEL.md §9.1: per layer, the matrices one token multiplies by. GDN: projections 33,685,504; full attention:
// 27,262,976; both: router 524,288 + shared expert 3,145,728 + shared gate 2,048 + 8 experts x 3,145,728.
constexpr double MOE_ACTIVE = 524288.0 + 3145728.0 + 2048.0 + 8 * 3145728.0;
constexpr double ACTIVE_NO_LM_HEAD = 30 * (33685504.0 + MOE_ACTIVE) + 10 * (27262976.0 + MOE_ACTIVE);  // 2.437 B
constexpr double LM_HEAD = 508559360.0;
// MODEL.md §9.3: 2 x 2 x Hq x dh = 16,384 FLOP per (query, key) pair and attention layer, x 10 layers.
constexpr double ATTN_PER_PAIR = 163840.0;
// Exact arithmetic on integers below 2^53 (or a few products of them): doubles hold these to ~1e-15.
constexpr double TOL_EXACT_REL = 1e-12;
// "Active parameters ~3 B" is the model card's rounding of 2.946 B (MODEL.md §9.1: with lm_head and norms).
constexpr double TOL_3B_REL = 0.03;

model real_model() {
    const std::string cfg = std::string(TANSY_SOURCE_DIR) + "/tests/fixtures/qwen3.6-35b-a3b/config.json";
    return make_synthetic_model(synthetic_config(cfg), synthetic_options{});  // shapes only, no weights
}

}  // namespace

TEST(bench, prefill_flops_on_the_real_config) {
    const model m = real_model();
    const prefill_flop_count one = prefill_flop_parts(m, 1);
    EXPECT_NEAR(one.matmul, 2 * ACTIVE_NO_LM_HEAD, TOL_EXACT_REL * one.matmul);
    EXPECT_NEAR(one.lm_head, 2 * LM_HEAD, TOL_EXACT_REL * one.lm_head);
    // one token with its logits: 2 x the ~3 B active parameters
    EXPECT_NEAR(one.matmul + one.lm_head, 2 * 3e9, TOL_3B_REL * 2 * 3e9);
    // DeltaNet: 30 layers x (7 dk dv x 32 value heads + 2 x 4 x 8192 conv) per token
    EXPECT_NEAR(one.deltanet, 30 * (7.0 * 32 * 128 * 128 + 2.0 * 4 * 8192), 1.0);

    // attention is quadratic: n (n + 1) / 2 causal pairs from an empty cache, n x n_past more after a prefix
    for (int64_t n : {256, 8192, 131072}) {
        const prefill_flop_count f = prefill_flop_parts(m, n);
        const double pairs = (double)n * (double)(n + 1) / 2;
        EXPECT_NEAR(f.attention, ATTN_PER_PAIR * pairs, TOL_EXACT_REL * f.attention) << n;
        EXPECT_NEAR(f.matmul, (double)n * one.matmul, TOL_EXACT_REL * f.matmul) << n;
        EXPECT_EQ(f.lm_head, one.lm_head) << "lm_head runs for the last token only";
        EXPECT_DOUBLE_EQ(prefill_flops(m, n), f.total());
    }
    const prefill_flop_count a = prefill_flop_parts(m, 1000), b = prefill_flop_parts(m, 3000, 1000),
                             whole = prefill_flop_parts(m, 4000);
    EXPECT_NEAR(a.attention + b.attention, whole.attention, TOL_EXACT_REL * whole.attention);
    EXPECT_NEAR(a.matmul + b.matmul, whole.matmul, TOL_EXACT_REL * whole.matmul);
    // at 128K the causal attention term outweighs the matmuls (1.41 vs 0.64 PFLOP)
    const prefill_flop_count big = prefill_flop_parts(m, 131072);
    EXPECT_GT(big.attention, big.matmul);
    EXPECT_EQ(prefill_flop_parts(m, 0).total(), 0.0);
}

TEST(bench, prefill_flops_on_a_tiny_config_by_hand) {
    // tests/synth_model.h: D 64, V 96, layers [DeltaNet, attention], Hq 4 x 32 (Hkv 2), GDN Hk 2 / Hv 4 x 16,
    // conv 4, 4 experts top-2 of width 16, shared expert 16.
    const std::string dir = test::temp_dir("bench_flops");
    const auto cfg = test::synth_config();
    test::write_checkpoint(dir, cfg, test::synth_tensors(cfg, 1));
    const model m = load_model(dir);
    // per token: GDN qkv 128x64 + z 64x64 + b,a 4x64 each + out 64x64 = 16,896; attention q 256x64 + k,v 64x64
    // each + o 64x128 = 32,768; per layer router 4x64 + shared gate 1x64 + shared 3x16x64 + 2 experts x 3x16x64
    // = 9,536
    const double per_token = 16896 + 32768 + 2 * 9536;
    const int64_t n = 10;
    const prefill_flop_count f = prefill_flop_parts(m, n);
    EXPECT_EQ(f.matmul, 2 * per_token * n);
    EXPECT_EQ(f.lm_head, 2.0 * 96 * 64);
    EXPECT_EQ(f.attention, 2.0 * 2 * 4 * 32 * (n * (n + 1) / 2));       // 1 layer, 55 pairs
    EXPECT_EQ(f.deltanet, (7.0 * 4 * 16 * 16 + 2.0 * 4 * 128) * n);      // 1 layer
    EXPECT_EQ(prefill_flop_parts(m, 5, 7).attention, 2.0 * 2 * 4 * 32 * (5 * 7 + 15));
}

TEST(bench, prefill_runs_fewer_times_for_long_prompts) {
    bench_options o;  // runs 5, 65,536 tokens of timed prefill per length
    EXPECT_EQ(prefill_runs(256, o), 5);
    EXPECT_EQ(prefill_runs(8192, o), 5);
    EXPECT_EQ(prefill_runs(32768, o), 2);
    EXPECT_EQ(prefill_runs(131072, o), 1);
    EXPECT_EQ(prefill_runs(1 << 20, o), 1);
    o.runs = 1;
    EXPECT_EQ(prefill_runs(256, o), 1);
}

TEST(bench, prefill_measurement_on_the_cpu) {
    engine_options eo;  // the embedded tiny model
    eo.threads = 1;
    eo.prefill_chunk = 16;
    engine e(eo);
    bench_options o;
    o.runs = 3;
    const prefill_point r = bench_prefill(e, 40, o);
    EXPECT_EQ(r.prompt, 40);
    EXPECT_EQ(r.chunk, 16);
    EXPECT_EQ(r.runs, 3);
    EXPECT_GT(r.ttft_s, 0);
    EXPECT_NEAR(r.tok_s, 40 / r.ttft_s, 1e-9 * r.tok_s);
    EXPECT_DOUBLE_EQ(r.flops, prefill_flops(e.mdl(), 40));
    EXPECT_NEAR(r.tflops, r.flops / r.ttft_s / 1e12, 1e-9 * r.tflops);
    EXPECT_NEAR(r.peak_pct, 100 * r.tflops / H200_BF16_DENSE_TFLOPS, 1e-9 * r.peak_pct);
    EXPECT_EQ(r.peak_gib, 0.0);  // the CPU backend reports no device memory
    EXPECT_LE(e.fwd().workspace_rows(), 16);
}
