// tansy eval's consistency report: the metrics it is built from, and its fields on small cases.
#include <cmath>
#include <nlohmann/json.hpp>

#include "runtime/metrics.h"
#include "synth_model.h"
#include "test_util.h"

using json = nlohmann::json;

namespace {

const std::string CLI = TANSY_CLI;

// KL and perplexity of identical logits: only summation rounding remains.
constexpr double TOL_IDENTICAL = 1e-12;

int run(const std::string& args, std::string* out) { return tansy::test::run_command(CLI + " " + args, out); }

json run_json(const std::string& args) {
    std::string out;
    EXPECT_EQ(tansy::test::run_command(CLI + " " + args + " --json 2>/dev/null", &out, false), 0) << args;
    return json::parse(out);
}

// A small synthetic bf16 checkpoint and an ids file of n tokens.
std::string synth_model(const std::string& tag) {
    json cfg = tansy::test::synth_config();
    const std::string d = tansy::test::temp_dir(tag);
    tansy::test::write_checkpoint(d, cfg, tansy::test::synth_tensors(cfg, 12));
    return d;
}

std::string ids_file(const std::string& dir, int n) {
    std::string s;
    for (int i = 0; i < n; i++) s += std::to_string((i * 37 + 5) % 90) + " ";
    tansy::test::write_file(dir + "/ids.txt", s);
    return dir + "/ids.txt";
}

}  // namespace

TEST(metrics, percentile_is_nearest_rank) {
    std::vector<double> v;
    for (int i = 100; i >= 1; i--) v.push_back(i);
    EXPECT_EQ(tansy::percentile(v, 99), 99);
    EXPECT_EQ(tansy::percentile(v, 100), 100);
    EXPECT_EQ(tansy::percentile(v, 50), 50);
    EXPECT_EQ(tansy::percentile(v, 0), 1);
    EXPECT_EQ(tansy::percentile({7.0}, 99), 7.0);
    EXPECT_EQ(tansy::percentile({}, 99), 0.0);
}

TEST(metrics, compare_logits_agreement_and_kl) {
    const int64_t rows = 4, V = 5;
    std::vector<float> ref = tansy::test::random_normal((size_t)(rows * V), 3), cand = ref;
    tansy::logits_comparison same = tansy::compare_logits(ref.data(), cand.data(), rows, V);
    EXPECT_EQ(same.rows, rows);
    EXPECT_EQ(same.top1_agreement, 1.0);
    EXPECT_LT(same.max_kl, TOL_IDENTICAL);
    for (int64_t v = 0; v < V; v++) cand[(size_t)v] += 10.0f;  // a constant shift: same distribution
    EXPECT_LT(tansy::compare_logits(ref.data(), cand.data(), rows, V).max_kl, 1e-9);
    // move the top of row 0 elsewhere: one disagreement, and the KL of that row only
    cand = ref;
    int64_t top = 0;
    for (int64_t v = 1; v < V; v++)
        if (ref[(size_t)v] > ref[(size_t)top]) top = v;
    cand[(size_t)((top + 1) % V)] = ref[(size_t)top] + 5.0f;
    tansy::logits_comparison c = tansy::compare_logits(ref.data(), cand.data(), rows, V);
    EXPECT_EQ(c.top1_agreement, 0.75);
    EXPECT_GT(c.max_kl, 0.1);
    EXPECT_NEAR(c.mean_kl, c.max_kl / 4, 1e-12);
    EXPECT_EQ(c.p99_kl, c.max_kl);
    EXPECT_NEAR(tansy::kl_divergence(ref.data(), cand.data(), V), c.max_kl, 1e-12);
}

TEST(eval_report, bf16_against_q4_at_load_has_every_field) {
    const std::string m = synth_model("ev-q4"), ids = ids_file(m, 40);
    json j = run_json("eval --model " + m + " --ids-file " + ids + " --compare-weights q4");
    EXPECT_EQ(j["positions"], 39);
    EXPECT_EQ(j["tokens"], 40);
    ASSERT_EQ(j["runs"].size(), 2u);
    EXPECT_EQ(j["runs"][0]["name"], "A");
    EXPECT_EQ(j["runs"][0]["weights"], "bf16");
    EXPECT_NE(j["runs"][1]["weights"].get<std::string>().find("quantised at load"), std::string::npos);
    ASSERT_EQ(j["comparisons"].size(), 1u);
    const json& c = j["comparisons"][0];
    EXPECT_EQ(c["reference"], "A");
    EXPECT_EQ(c["candidate"], "B");
    EXPECT_EQ(c["positions"], 39);
    for (const char* k : {"reference_perplexity", "candidate_perplexity", "delta_perplexity_pct", "top1_agreement",
                          "mean_kl", "p99_kl", "max_kl"})
        EXPECT_TRUE(c.contains(k) && c[k].is_number()) << k;
    EXPECT_NEAR(c["reference_perplexity"].get<double>(), j["runs"][0]["perplexity"].get<double>(), 1e-9);
    EXPECT_NEAR(c["delta_perplexity_pct"].get<double>(),
                100 * (c["candidate_perplexity"].get<double>() / c["reference_perplexity"].get<double>() - 1), 1e-6);
    EXPECT_GT(c["mean_kl"].get<double>(), 0.0);  // random weights: 4-bit differs
    EXPECT_LE(c["mean_kl"].get<double>(), c["max_kl"].get<double>());
    EXPECT_LE(c["p99_kl"].get<double>(), c["max_kl"].get<double>());
}

TEST(eval_report, a_run_against_itself_and_against_its_own_logits_file) {
    const std::string m = synth_model("ev-self"), ids = ids_file(m, 30);
    std::string out;
    ASSERT_EQ(run("logits --model " + m + " --ids-file " + ids + " --out " + m + "/l.safetensors", &out), 0) << out;
    json j = run_json("eval --model " + m + " --ids-file " + ids + " --compare-backend cpu --reference " + m +
                      "/l.safetensors --reference-key logits");
    ASSERT_EQ(j["comparisons"].size(), 3u);  // A || B, ref || A, ref || B
    for (const json& c : j["comparisons"]) {
        EXPECT_EQ(c["top1_agreement"], 1.0) << c;
        EXPECT_LT(c["max_kl"].get<double>(), TOL_IDENTICAL) << c;
        EXPECT_LT(std::fabs(c["delta_perplexity_pct"].get<double>()), TOL_IDENTICAL) << c;
    }
    EXPECT_EQ(j["comparisons"][1]["reference"], "ref:logits");
    EXPECT_EQ(j["references"][0]["top1_agreement"], 1.0);  // the pre-existing fields stay
    EXPECT_NEAR(j["references"][0]["reference_perplexity"].get<double>(), j["perplexity"].get<double>(), 1e-9);
}

TEST(eval_report, positions_and_the_lily_mode) {
    const std::string m = synth_model("ev-pos"), ids = ids_file(m, 200);
    json j = run_json("eval --model " + m + " --ids-file " + ids + " --compare-weights q4 --lily");
    EXPECT_EQ(j["positions"], 192);
    EXPECT_EQ(j["comparisons"][0]["positions"], 192);
    EXPECT_EQ(j["lily"]["positions"], 192);
    EXPECT_DOUBLE_EQ(j["lily"]["top1_agreement"].get<double>(), 0.9635);
    json k = run_json("eval --model " + m + " --ids-file " + ids + " --positions 10");
    EXPECT_EQ(k["positions"], 10);
    EXPECT_FALSE(k.contains("comparisons"));
    // the first 10 positions of a longer run have the same NLL (causal model)
    json all = run_json("eval --model " + m + " --ids-file " + ids + " --positions 10 --compare-weights q4");
    EXPECT_NEAR(all["runs"][0]["mean_nll"].get<double>(), k["mean_nll"].get<double>(), 1e-12);
}

TEST(eval_report, errors_are_one_line) {
    const std::string m = synth_model("ev-err"), ids = ids_file(m, 50);
    const std::string base = "eval --model " + m + " --ids-file " + ids;
    const std::string cases[] = {
        base + " --lily",                         // 49 positions < 192
        base + " --positions 0",
        base + " --lily --positions 5",
        base + " --compare-weights q3",
        base + " --text-file " + ids,             // both inputs
        "eval --model " + m,                      // no input
        "eval --model " + m + " --text-file " + ids,  // the synthetic model has no tokenizer.json
    };
    for (const std::string& c : cases) {
        std::string out;
        EXPECT_EQ(run(c, &out), 1) << c << "\n" << out;
        EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << c << "\n" << out;
    }
#ifndef TANSY_HAVE_CUDA
    std::string out;
    EXPECT_EQ(run(base + " --compare-backend cuda", &out), 1) << out;
    EXPECT_NE(out.find("run B"), std::string::npos) << out;
    EXPECT_NE(out.find("cuda"), std::string::npos) << out;
#endif
}

TEST(eval_report, text_file_is_tokenized_with_the_models_tokenizer) {
    const std::string gqa = tansy::test::fixture("tiny-gqa");
    if (gqa.empty()) GTEST_SKIP() << "tiny-gqa is unpacked at configure time";
    const std::string d = tansy::test::temp_dir("ev-text");
    tansy::test::write_file(d + "/t.txt", "def f(x):\n    return x + 1\n\nprint(f(41))\n");
    json j = run_json("eval --model " + gqa + " --text-file " + d + "/t.txt --compare-weights q4");
    EXPECT_GT(j["tokens"].get<int>(), 8);
    EXPECT_EQ(j["positions"].get<int>(), j["tokens"].get<int>() - 1);
    EXPECT_EQ(j["comparisons"].size(), 1u);
}
