// tansy bench: decode throughput against the memory-bandwidth roofline.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

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

int cmd_bench(int argc, char** argv) {
    arg_parser p("bench", "[--synthetic CONFIG.json | --model DIR] [options]",
                 "Decode throughput: batch-1 tok/s at each context, aggregate tok/s for batches at one context, with\n"
                 "the bytes a step must move and the achieved GB/s as a share of the memory roofline. Each step is\n"
                 "one CUDA-graph replay; median of --runs runs of --steps steps after warm-up.\n"
                 "--synthetic builds the model of a config.json (e.g. the full Qwen3.6-35B-A3B config) with seeded\n"
                 "random 4-bit weights generated on the GPU.");
    add_engine_options(p);
    p.option("--synthetic", "CONFIG", "config.json of the model to synthesise (no checkpoint needed)")
        .option("--layers", "N", "keep only the first N layers of the synthetic config")
        .option("--seed", "S", "synthetic weight seed (default 1)")
        .option("--skew", "X", "synthetic router skew: 0 uniform (default), ~1 strongly uneven expert load")
        .option("--contexts", "LIST", "batch-1 contexts (default 256,2048,8192,32768,131072)")
        .option("--batches", "LIST", "aggregate batch sizes (default 4,16,64; none to skip)")
        .option("--batch-context", "N", "context of the batch rows (default 2048)")
        .option("--steps", "N", "decode steps per timed run (default 32)")
        .option("--runs", "N", "timed runs, median reported (default 5)")
        .option("--warmup", "N", "untimed steps before the runs (default 3)")
        .option("--peak-gbps", "X", "roofline bandwidth in GB/s (default 4280, the H200's measured copy rate)")
        .option("--json", "", "print one JSON object");
    if (!p.parse(argc, argv)) return 0;
    bench_options o;
    if (p.has("--contexts")) o.contexts = int_list(p.str("--contexts"), "--contexts");
    if (p.has("--batches")) o.batch_sweep = p.str("--batches") == "none" ? std::vector<int64_t>{} : int_list(p.str("--batches"), "--batches");
    o.batch_context = p.integer("--batch-context", 2048);
    o.steps = (int)p.integer("--steps", 32);
    o.runs = (int)p.integer("--runs", 5);
    o.warmup = (int)p.integer("--warmup", 3);
    o.peak_gbps = p.number("--peak-gbps", 4280);
    if (o.steps < 1 || o.runs < 1) fail("bench: --steps and --runs must be positive");
    engine_options eo = engine_options_from(p);
    eo.backend_opt.synthetic_seed = (uint64_t)p.integer("--seed", 1);
    eo.backend_opt.router_skew = (float)p.number("--skew", 0.0);
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
    fprintf(stderr, "tansy bench: %s on %s\n  %s\n", what.c_str(), eng->be().device_name().c_str(),
            eng->cfg().summary().c_str());
    std::vector<bench_point> rows;
    auto measure = [&](int64_t B, int64_t ctx) {
        rows.push_back(bench_decode(*eng, B, ctx, o));
        const bench_point& r = rows.back();
        fprintf(stderr, "  batch %3lld context %7lld: %9.1f tok/s  %8.3f ms/step  %6.1f%% of roofline\n", (long long)B,
                (long long)ctx, r.tok_s, r.step_s * 1e3, r.roofline_pct);
    };
    for (int64_t ctx : o.contexts) measure(1, ctx);
    for (int64_t B : o.batch_sweep) measure(B, o.batch_context);
    if (p.has("--json")) {
        nlohmann::json j = {{"model", what}, {"device", eng->be().device_name()}, {"peak_gbps", o.peak_gbps}};
        for (const bench_point& r : rows)
            j["rows"].push_back({{"batch", r.batch}, {"context", r.context}, {"tok_s", r.tok_s}, {"ms_per_step", r.step_s * 1e3},
                                 {"mb_per_step", r.bytes_per_step / 1e6}, {"gbps", r.gbps}, {"roofline_pct", r.roofline_pct},
                                 {"peak_gib", r.peak_gib}, {"graphs", r.graphs}});
        printf("%s\n", j.dump(2).c_str());
        return 0;
    }
    printf("%6s %8s %10s %9s %10s %8s %10s %9s\n", "batch", "context", "tok/s", "ms/step", "MB/step", "GB/s",
           "%roofline", "GPU GiB");
    for (const bench_point& r : rows)
        printf("%6lld %8lld %10.1f %9.3f %10.1f %8.1f %9.1f%% %9.2f\n", (long long)r.batch, (long long)r.context, r.tok_s,
               r.step_s * 1e3, r.bytes_per_step / 1e6, r.gbps, r.roofline_pct, r.peak_gib);
    printf("roofline: %.0f GB/s (--peak-gbps); bytes/step = weights touched + KV cache + DeltaNet state\n", o.peak_gbps);
    return 0;
}

}  // namespace tansy
