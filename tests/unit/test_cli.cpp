// The tansy binary: help, one-line errors with a non-zero exit, and the commands other checks rely on.
#include <filesystem>
#include <nlohmann/json.hpp>

#include "loader/safetensors.h"
#include "synth_model.h"
#include "test_util.h"

namespace {

const std::string CLI = TANSY_CLI;

int run(const std::string& args, std::string* out) { return tansy::test::run_command(CLI + " " + args, out); }

int lines(const std::string& s) {
    int n = 0;
    for (char c : s) n += c == '\n';
    return n;
}

std::string stdout_only(const std::string& args) {
    std::string out;
    EXPECT_EQ(tansy::test::run_command(CLI + " " + args + " 2>/dev/null", &out, false), 0) << args;
    return out;
}

}  // namespace

TEST(cli, help_and_unknown_commands) {
    std::string out;
    EXPECT_EQ(run("--help", &out), 0);
    EXPECT_NE(out.find("generate"), std::string::npos);
    EXPECT_EQ(run("frobnicate", &out), 2);
    for (const char* c : {"logits", "generate", "eval", "info", "convert", "run", "bench", "tokenize", "render"}) {
        EXPECT_EQ(run(std::string(c) + " --help", &out), 0) << c;
        EXPECT_NE(out.find("usage: tansy"), std::string::npos) << c;
    }
}

TEST(cli, version_names_the_build_and_its_backends) {
    for (const char* arg : {"--version", "version"}) {
        const std::string out = stdout_only(arg);
        EXPECT_EQ(out.rfind("tansy 0.", 0), 0u) << out;  // the CMake project version
        EXPECT_NE(out.find("(commit "), std::string::npos) << out;
        EXPECT_NE(out.find("backends: cpu"), std::string::npos) << out;
        EXPECT_NE(out.find("cuda"), std::string::npos) << out;
    }
}

TEST(cli, errors_are_one_line_with_exit_1) {
    const std::string d = tansy::test::temp_dir("cli");
    tansy::test::write_file(d + "/ids.txt", "1 2 3");
    tansy::test::write_file(d + "/bad.txt", "1 2 x3");
    tansy::test::write_file(d + "/big.txt", "1 2 999999");
    const std::string cases[] = {
        "logits --bogus 1",
        "logits --ids-file /nonexistent --out " + d + "/x.safetensors",
        "logits --ids-file " + d + "/bad.txt --out " + d + "/x.safetensors",
        "logits --ids-file " + d + "/big.txt --out " + d + "/x.safetensors",
        "logits --ids-file " + d + "/ids.txt",
        "generate --model /nonexistent --ids-file " + d + "/ids.txt",
        "generate --ids-file " + d + "/ids.txt -n",
        "generate --ids-file " + d + "/ids.txt -n ten",
        "generate --ids-file " + d + "/ids.txt --backend tpu",
        "generate --ids-file " + d + "/ids.txt --prefill-chunk 0",
        "logits --ids-file " + d + "/ids.txt --out " + d + "/x.safetensors --prefill-chunk -3",
        "generate --ids-file " + d + "/ids.txt --gemm exact",
        "generate --ids-file " + d + "/ids.txt --kv-cache int8",
        "generate --ids-file " + d + "/ids.txt --kernels mma=gemv2",
        "generate --ids-file " + d + "/ids.txt --kernels int8=maybe",
        "info --backend cuda --kernels tiles=64",
        "eval --ids-file " + d + "/ids.txt --compare-kv-cache fp4",
        "generate --ids-file " + d + "/ids.txt --deltanet-state fp16",
        "eval --ids-file " + d + "/ids.txt --compare-deltanet-state f32",
        "bench --prompts 0",
        "bench --prompts 256,x",
        "eval --ids-file " + d + "/ids.txt --reference /nonexistent.safetensors --reference-key x",
        "convert --model /nonexistent --out " + d + "/conv",
    };
    for (const std::string& c : cases) {
        std::string out;
        EXPECT_EQ(run(c, &out), 1) << c << "\n" << out;
        EXPECT_EQ(lines(out), 1) << c << "\n" << out;
        EXPECT_EQ(out.rfind("tansy", 0), 0u) << out;
    }
}

TEST(cli, info_prints_the_kernel_plan) {
    std::string out = stdout_only("info --backend cpu");
    EXPECT_NE(out.find("kernels    cpu: fp32 reference"), std::string::npos) << out;
    // with or without a GPU (then it says why there is no plan), and with the options that set the plan
    out = stdout_only("info --backend cuda --kernels mma=all,int8=off,wgmma=off");
    const bool gpu = out.find("kernels    cuda unavailable") == std::string::npos;
    EXPECT_NE(out.find(gpu ? "mma=all int8=off wgmma=off (--kernels)" : "kernels    cuda unavailable: "),
              std::string::npos)
        << out;
}

TEST(cli, logits_generate_eval_on_the_mlx_fixture) {
    const std::string m = tansy::test::fixture("tiny-qwen35moe-mlx4");
    if (m.empty()) GTEST_SKIP();
    const std::string d = tansy::test::temp_dir("cli2");
    tansy::test::write_file(d + "/ids.txt", "220 5 7 11 13\n17 19 23");
    stdout_only("logits --model " + m + " --ids-file " + d + "/ids.txt --out " + d + "/l.safetensors");
    tansy::st_file f(d + "/l.safetensors");
    ASSERT_NE(f.find("logits"), nullptr);
    EXPECT_EQ(f.find("logits")->shape, (std::vector<int64_t>{8, 4096}));
    EXPECT_EQ(f.find("logits")->type, tansy::dtype::f32);

    std::string g1 = stdout_only("generate --model " + m + " --ids-file " + d + "/ids.txt -n 5 --greedy --output-ids");
    std::string g2 = stdout_only("generate --model " + m + " --ids-file " + d + "/ids.txt -n 5 --greedy --output-ids --threads 1");
    EXPECT_EQ(g1, g2);
    EXPECT_EQ(lines(g1), 1);
    int n = 0;
    for (size_t i = 0; i < g1.size(); i++) n += g1[i] != ' ' && g1[i] != '\n' && (i == 0 || g1[i - 1] == ' ');
    EXPECT_EQ(n, 5) << g1;

    // eval: the file's own logits as the reference -> perfect agreement, zero KL
    std::string js = stdout_only("eval --model " + m + " --ids-file " + d + "/ids.txt --reference " + d +
                                 "/l.safetensors --reference-key logits --json");
    auto j = nlohmann::json::parse(js);
    EXPECT_EQ(j["positions"], 7);
    EXPECT_GT(j["perplexity"].get<double>(), 1.0);
    EXPECT_EQ(j["references"][0]["top1_agreement"], 1.0);
    EXPECT_LT(j["references"][0]["mean_kl"].get<double>(), 1e-9);

    // the FP8 KV cache as run B: it moves the logits, a little
    js = stdout_only("eval --model " + m + " --ids-file " + d + "/ids.txt --compare-kv-cache fp8 --json");
    j = nlohmann::json::parse(js);
    ASSERT_EQ(j["runs"].size(), 2u) << js;
    EXPECT_NE(j["runs"][1]["weights"].get<std::string>().find("FP8 KV cache"), std::string::npos) << js;

    // the bf16 DeltaNet state as run B, one decode step a position: it moves the logits, a little
    js = stdout_only("eval --model " + m + " --ids-file " + d +
                     "/ids.txt --compare-deltanet-state bf16 --prefill-chunk 1 --json");
    j = nlohmann::json::parse(js);
    ASSERT_EQ(j["runs"].size(), 2u) << js;
    EXPECT_NE(j["runs"][1]["weights"].get<std::string>().find("bf16 DeltaNet state"), std::string::npos) << js;
    EXPECT_GT(j["comparisons"][0]["mean_kl"].get<double>(), 0.0) << js;
    EXPECT_LT(j["comparisons"][0]["mean_kl"].get<double>(), 1e-3) << js;
}

TEST(cli, prefill_chunk_gives_the_same_logits_and_ids) {
    const std::string m = tansy::test::fixture("tiny-qwen35moe-mlx4");
    if (m.empty()) GTEST_SKIP();
    const std::string d = tansy::test::temp_dir("cli_chunk");
    std::string ids;
    for (int i = 0; i < 50; i++) ids += std::to_string((i * 37 + 11) % 4000) + " ";
    tansy::test::write_file(d + "/ids.txt", ids);
    stdout_only("logits --model " + m + " --ids-file " + d + "/ids.txt --out " + d + "/l.safetensors");
    // eval collects every chunk's logits: against the one-pass logits, the same argmax everywhere, KL ~ 0
    auto j = nlohmann::json::parse(stdout_only("eval --model " + m + " --ids-file " + d + "/ids.txt --prefill-chunk 7 " +
                                               "--reference " + d + "/l.safetensors --reference-key logits --json"));
    EXPECT_EQ(j["positions"], 49);
    EXPECT_EQ(j["references"][0]["top1_agreement"], 1.0);
    EXPECT_LT(j["references"][0]["mean_kl"].get<double>(), 1e-9);
    const std::string gen = "generate --model " + m + " --ids-file " + d + "/ids.txt -n 8 --greedy --output-ids";
    EXPECT_EQ(stdout_only(gen + " --prefill-chunk 3"), stdout_only(gen));
    EXPECT_EQ(stdout_only(gen + " --gemm precise"), stdout_only(gen));  // a CUDA option: the CPU is fp32 anyway
}

TEST(cli, bench_prefill_rows_on_the_cpu) {
    // the embedded tiny model: decode at one context, then the prefill rows
    const std::string args = "bench --backend cpu --contexts 256 --batches none --prompts 256,512 --prefill-chunk 200 "
                             "--steps 2 --runs 1 --warmup 0";
    auto j = nlohmann::json::parse(stdout_only(args + " --json"));
    ASSERT_EQ(j["rows"].size(), 1u);
    EXPECT_EQ(j["rows"][0]["context"], 256);
    ASSERT_EQ(j["prefill"].size(), 2u);
    for (int i = 0; i < 2; i++) {
        const auto& r = j["prefill"][i];
        EXPECT_EQ(r["prompt"], i == 0 ? 256 : 512);
        EXPECT_EQ(r["chunk"], 200);
        EXPECT_EQ(r["runs"], 1);
        EXPECT_GT(r["tok_s"].get<double>(), 0);
        EXPECT_GT(r["ttft_ms"].get<double>(), 0);
        EXPECT_GT(r["gflop"].get<double>(), 0);
        EXPECT_GT(r["tflops"].get<double>(), 0);
    }
    EXPECT_EQ(j["peak_tflops"], 989);
    // the tables: decode, then prefill
    const std::string table =
        stdout_only("bench --backend cpu --contexts 64 --batches none --prompts 32 --steps 2 --runs 1 --warmup 0");
    EXPECT_NE(table.find("%roofline"), std::string::npos) << table;
    EXPECT_NE(table.find("TFLOP/s"), std::string::npos) << table;
    // --prompts none: the decode table alone
    auto k = nlohmann::json::parse(
        stdout_only("bench --backend cpu --contexts 256 --batches none --prompts none --steps 2 --runs 1 --warmup 0 --json"));
    EXPECT_EQ(k["rows"].size(), 1u);
    EXPECT_TRUE(k["prefill"].empty());
}

TEST(cli, run_streams_a_chat_turn_and_stops_at_end_of_turn) {
    // The bundled chat model: greedy, so deterministic; it must stop at <|im_end|> well before -n.
    std::string out;
    ASSERT_EQ(tansy::test::run_command(CLI + " run --prompt 'Use a tool to find out what heapq.heappush does.' "
                                             "--tools " TANSY_SOURCE_DIR "/models/tiny-chat-q4/demo_tools.json -n 200 2>/dev/null",
                                       &out, false),
              0);
    EXPECT_NE(out.find("<tool_call>"), std::string::npos) << out;
    EXPECT_NE(out.find("<function=get_docstring>"), std::string::npos) << out;
    EXPECT_EQ(out.find("<|im_end|>"), std::string::npos) << "end-of-turn token leaked: " << out;
    EXPECT_EQ(out.find("</think>"), std::string::npos) << "reasoning marker shown: " << out;
    std::string err;
    EXPECT_EQ(run("run --prompt hi --chat", &err), 1);
    EXPECT_EQ(run("run", &err), 1);
    EXPECT_EQ(run("run --prompt hi --tools /nonexistent.json", &err), 1);
    EXPECT_EQ(lines(err), 1) << err;
}
