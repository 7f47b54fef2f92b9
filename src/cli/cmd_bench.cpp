// tansy bench: decode throughput against the memory-bandwidth roofline; prefill (time to first token) against the
// tensor-core peak.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>

#include "cli/commands.h"
#include "core/check.h"
#include "model/synthetic.h"
#include "runtime/bench.h"

namespace tansy {

static std::vector<int64_t> int_list(const std::string& s, const char* what) {
    std::vector<int64_t> v;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        char* end = nullptr;
        long long x = strtoll(item.c_str(), &end, 10);
        if (item.empty() || *end || x <= 0) fail("bench: %s must be a comma-separated list of positive integers", what);
        v.push_back(x);
    }
    return v;
}

// A list flag that may also be "none" (skip those rows).
static std::vector<int64_t> int_list_or_none(const std::string& s, const char* what) {
    return s == "none" ? std::vector<int64_t>{} : int_list(s, what);
}

int cmd_bench(int argc, char** argv) {
    for (int i = 0; i < argc; i++)
        if (std::string_view(argv[i]) == "--serve") return cmd_bench_serve(argc, argv);
    arg_parser p("bench", "[--synthetic CONFIG.json | --model DIR] [options]",
                 "Decode throughput: batch-1 tok/s at each context, aggregate tok/s for batches at one context, with\n"
                 "the bytes a step must move and the achieved GB/s as a share of the memory roofline. Each step is\n"
                 "one CUDA-graph replay; median of --runs runs of --steps steps after warm-up.\n"
                 "Prefill: for each prompt length, the time to first token (the prompt in chunks of --prefill-chunk\n"
                 "tokens, then the last token's lm_head and argmax, synchronised), tok/s, achieved TFLOP/s against the\n"
                 "tensor-core peak, and the most device memory in use; one warm-up run, then the median of\n"
                 "max(1, min(--runs, 65536 / prompt)) runs (long prompts run fewer times: 1 at 128K).\n"
                 "--synthetic builds the model of a config.json (e.g. the full Qwen3.6-35B-A3B config) with seeded\n"
                 "random 4-bit weights generated on the GPU.");
    add_engine_options(p);
    p.option("--synthetic", "CONFIG", "config.json of the model to synthesise (no checkpoint needed)")
        .option("--layers", "N", "keep only the first N layers of the synthetic config")
        .option("--seed", "S", "synthetic weight seed (default 1)")
        .option("--skew", "X", "synthetic router skew: 0 uniform (default), ~1 strongly uneven expert load")
        .option("--contexts", "LIST", "batch-1 contexts (default 256,2048,8192,32768,131072; none to skip)")
        .option("--batches", "LIST", "aggregate batch sizes (default 4,16,64; none to skip)")
        .option("--batch-context", "N", "context of the batch rows (default 2048)")
        .option("--steps", "N", "decode steps per timed run (default 32)")
        .option("--runs", "N", "timed runs, median reported (default 5)")
        .option("--warmup", "N", "untimed steps before the runs (default 3)")
        .option("--peak-gbps", "X", "roofline bandwidth in GB/s (default 4280, the H200's measured copy rate)")
        .option("--sampled", "", "decode rows draw as Qwen's non-thinking defaults say (temperature 0.7, top_p 0.8,\n"
                                 "                            top_k 20; on the device where it can) instead of greedy")
        .option("--prompts", "LIST",
                "prefill prompt lengths (default 256,512,2048,8192,32768,131072 on cuda, 256,2048 on the cpu; none to skip)")
        .option("--peak-tflops", "X", "prefill compute peak in TFLOP/s (default 989, the H200's dense bf16 tensor core)")
        .option("--json", "", "print one JSON object")
        .option("--serve", "", "measure the HTTP server instead: streamed requests at several concurrencies, beside\n"
                               "                            the engine's own rate (see tansy bench --serve --help)");
    if (!p.parse(argc, argv)) return 0;
    bench_options o;
    if (p.has("--contexts")) o.contexts = int_list_or_none(p.str("--contexts"), "--contexts");
    if (p.has("--batches")) o.batch_sweep = int_list_or_none(p.str("--batches"), "--batches");
    if (p.has("--prompts")) o.prompts = int_list_or_none(p.str("--prompts"), "--prompts");
    o.batch_context = p.integer("--batch-context", 2048);
    o.steps = (int)p.integer("--steps", 32);
    o.runs = (int)p.integer("--runs", 5);
    o.warmup = (int)p.integer("--warmup", 3);
    o.peak_gbps = p.number("--peak-gbps", 4280);
    o.peak_tflops = p.number("--peak-tflops", H200_BF16_DENSE_TFLOPS);
    if (!(o.peak_gbps > 0) || !(o.peak_tflops > 0)) fail("bench: --peak-gbps and --peak-tflops must be positive");
    if (o.steps < 1 || o.runs < 1) fail("bench: --steps and --runs must be positive");
    if (p.has("--sampled")) o.sampling.temperature = 0.7f, o.sampling.top_p = 0.8f, o.sampling.top_k = 20, o.sampling.seed = 12345;
    engine_options eo = engine_options_from(p);
    // the fp32 CPU reference would spend hours on 32K-128K prompts (quadratic attention)
    if (!p.has("--prompts") && eo.backend == "cpu") o.prompts = {256, 2048};
    eo.backend_opt.synthetic_seed = (uint64_t)p.integer("--seed", 1);
    eo.backend_opt.router_skew = (float)p.number("--skew", 0.0);
    o.kv_fp8 = eo.backend_opt.kv_fp8;
    o.state_bf16 = eo.backend_opt.state_bf16;
    std::unique_ptr<engine> eng;
    std::string what;
    if (p.has("--synthetic")) {
        model_config c = synthetic_config(p.str("--synthetic"), p.integer("--layers", 0));
        synthetic_options so;
        so.seed = eo.backend_opt.synthetic_seed;
        so.materialize = eo.backend != "cuda";
        eng = std::make_unique<engine>(make_synthetic_model(c, so), eo);
        what = "synthetic " + p.str("--synthetic");
    } else {
        eng = std::make_unique<engine>(eo);
        what = eng->mdl().dir;
    }
    fprintf(stderr, "tansy bench: %s on %s\n  %s\n  %s\n", what.c_str(), eng->be().device_name().c_str(),
            eng->cfg().summary().c_str(), eng->be().kernel_summary("  ").c_str());
    std::vector<bench_point> rows;
    auto measure = [&](int64_t B, int64_t ctx) {
        rows.push_back(bench_decode(*eng, B, ctx, o));
        const bench_point& r = rows.back();
        fprintf(stderr, "  batch %3lld context %7lld: %9.1f tok/s  %8.3f ms/step  %6.1f%% of roofline\n", (long long)B,
                (long long)ctx, r.tok_s, r.step_s * 1e3, r.roofline_pct);
    };
    for (int64_t ctx : o.contexts) measure(1, ctx);
    for (int64_t B : o.batch_sweep) measure(B, o.batch_context);
    // Prefill after decode, so that the decode rows' memory figures are what they were without it.
    std::vector<prefill_point> prefill;
    for (int64_t n : o.prompts) {
        prefill.push_back(bench_prefill(*eng, n, o));
        const prefill_point& r = prefill.back();
        fprintf(stderr, "  prompt %7lld: %9.1f tok/s  TTFT %9.3f ms  %7.2f TFLOP/s  %5.1f%% of peak  (%d run%s)\n",
                (long long)n, r.tok_s, r.ttft_s * 1e3, r.tflops, r.peak_pct, r.runs, r.runs == 1 ? "" : "s");
    }
    if (p.has("--json")) {
        nlohmann::json j = {{"model", what}, {"device", eng->be().device_name()}, {"kv_cache", o.kv_fp8 ? "fp8" : "bf16"},
                            {"deltanet_state", o.state_bf16 ? "bf16" : "fp32"},
                            {"decode_sampling", o.sampling.temperature > 0 ? "sampled" : "greedy"},
                            {"peak_gbps", o.peak_gbps},
                            {"peak_tflops", o.peak_tflops}, {"rows", nlohmann::json::array()},
                            {"prefill", nlohmann::json::array()}};
        for (const bench_point& r : rows)
            j["rows"].push_back({{"batch", r.batch}, {"context", r.context}, {"tok_s", r.tok_s}, {"ms_per_step", r.step_s * 1e3},
                                 {"mb_per_step", r.bytes_per_step / 1e6}, {"gbps", r.gbps}, {"roofline_pct", r.roofline_pct},
                                 {"peak_gib", r.peak_gib}, {"graphs", r.graphs}});
        for (const prefill_point& r : prefill)
            j["prefill"].push_back({{"prompt", r.prompt}, {"chunk", r.chunk}, {"runs", r.runs}, {"tok_s", r.tok_s},
                                    {"ttft_ms", r.ttft_s * 1e3}, {"gflop", r.flops / 1e9}, {"tflops", r.tflops},
                                    {"peak_pct", r.peak_pct}, {"peak_gib", r.peak_gib}});
        printf("%s\n", j.dump(2).c_str());
        return 0;
    }
    if (!rows.empty()) {
        printf("%6s %8s %10s %9s %10s %8s %10s %9s\n", "batch", "context", "tok/s", "ms/step", "MB/step", "GB/s",
               "%roofline", "GPU GiB");
        for (const bench_point& r : rows)
            printf("%6lld %8lld %10.1f %9.3f %10.1f %8.1f %9.1f%% %9.2f\n", (long long)r.batch, (long long)r.context, r.tok_s,
                   r.step_s * 1e3, r.bytes_per_step / 1e6, r.gbps, r.roofline_pct, r.peak_gib);
        printf("roofline: %.0f GB/s (--peak-gbps); bytes/step = weights touched + KV cache (%s) + DeltaNet state "
               "(%s)\n", o.peak_gbps, o.kv_fp8 ? "FP8 E4M3 + a scale per KV head" : "bf16",
               o.state_bf16 ? "bf16" : "fp32");
    }
    if (!prefill.empty()) {
        if (!rows.empty()) printf("\n");
        printf("%8s %7s %5s %10s %11s %10s %9s %7s %9s\n", "prompt", "chunk", "runs", "tok/s", "TTFT ms", "GFLOP",
               "TFLOP/s", "%peak", "GPU GiB");
        for (const prefill_point& r : prefill)
            printf("%8lld %7lld %5d %10.1f %11.3f %10.1f %9.2f %6.1f%% %9.2f\n", (long long)r.prompt, (long long)r.chunk,
                   r.runs, r.tok_s, r.ttft_s * 1e3, r.flops / 1e9, r.tflops, r.peak_pct, r.peak_gib);
        printf("peak: %.0f TFLOP/s (--peak-tflops); FLOPs = active matmuls + causal attention + DeltaNet recurrence "
               "(bench.h prefill_flops)\n", o.peak_tflops);
    }
    return 0;
}

}  // namespace tansy
