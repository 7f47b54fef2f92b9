// Tokenizer encode throughput on one thread: MB/s of UTF-8 input, median of N runs after a warm-up run
// (the warm-up, reported as "cold", starts with an empty pre-token cache). Compare with HF `tokenizers`
// on the same file and tokenizer.json (the Qwen3 one is unpacked into build/fixtures at configure time):
//   scripts/make_tokenizer_bench_text.sh /tmp/tok_bench.txt
//   build/bin/bench_tokenizer --tokenizer build/fixtures/tokenizers/qwen3/tokenizer.json --text-file /tmp/tok_bench.txt
//   scripts/bench_tokenizer_hf.py --tokenizer build/fixtures/tokenizers/qwen3/tokenizer.json --text-file /tmp/tok_bench.txt
// With --ids-out both write the ids (one per line) so that `cmp` checks they agree token for token.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "cli/args.h"
#include "core/check.h"
#include "model/config.h"
#include "tokenizer/tokenizer.h"

using namespace tansy;

namespace {

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

int run(int argc, char** argv) {
    arg_parser p("bench_tokenizer", "--tokenizer PATH --text-file F [--runs N] [--ids-out F]",
                 "Encodes F with the tokenizer N times on one thread and reports the median throughput.");
    p.option("--tokenizer", "PATH", "tokenizer.json or a model directory")
        .option("--text-file", "F", "UTF-8 text to encode")
        .option("--runs", "N", "timed runs (default 5); the first run (cold cache) is reported separately")
        .option("--no-special", "", "do not parse special tokens in the text")
        .option("--chunk-bytes", "N", "encode the text in chunks that end at the first newline after N bytes "
                                      "(prompt-sized calls; default 0: the whole file in one call)")
        .option("--ids-out", "F", "write the ids of one encode, one per line");
    if (!p.parse(argc, argv)) return 0;
    if (!p.has("--tokenizer") || !p.has("--text-file")) fail("--tokenizer and --text-file are required");
    const int64_t runs = p.integer("--runs", 5);
    if (runs < 1) fail("--runs must be >= 1");

    auto t0 = clock_type::now();
    tokenizer tok = tokenizer::load(p.str("--tokenizer"));
    const double t_load = seconds_since(t0);
    const std::string text = read_text_file(p.str("--text-file"));
    const bool special = !p.has("--no-special");
    const double mb = text.size() / 1e6;
    const int64_t chunk_bytes = p.integer("--chunk-bytes", 0);
    if (chunk_bytes < 0) fail("--chunk-bytes must be >= 0");
    std::vector<std::string_view> chunks;  // same cutting rule as scripts/bench_tokenizer_hf.py
    for (size_t at = 0; at < text.size();) {
        size_t end = text.size();
        if (chunk_bytes > 0 && at + chunk_bytes < text.size()) {
            const size_t nl = text.find('\n', at + chunk_bytes);
            end = nl == std::string::npos ? text.size() : nl + 1;
        }
        chunks.push_back(std::string_view(text).substr(at, end - at));
        at = end;
    }

    std::vector<double> secs;
    std::vector<int32_t> ids;
    double t_cold = 0;
    for (int64_t r = 0; r <= runs; r++) {  // run 0 warms the per-thread pre-token cache
        auto t1 = clock_type::now();
        ids.clear();
        for (std::string_view c : chunks) {
            const std::vector<int32_t> part = tok.encode(c, special);
            ids.insert(ids.end(), part.begin(), part.end());
        }
        const double dt = seconds_since(t1);
        if (r == 0)
            t_cold = dt;
        else
            secs.push_back(dt);
    }
    std::sort(secs.begin(), secs.end());
    const double med = secs[secs.size() / 2];
    printf("tokenizer  %s (%lld ids, %lld merges) loaded in %.3f s\n", p.str("--tokenizer").c_str(),
           (long long)tok.size(), (long long)tok.n_merges(), t_load);
    printf("text       %s: %.2f MB in %zu call%s -> %zu tokens (%.2f bytes/token)\n", p.str("--text-file").c_str(), mb,
           chunks.size(), chunks.size() == 1 ? "" : "s", ids.size(), text.size() / (double)std::max<size_t>(ids.size(), 1));
    printf("encode     cold %.1f MB/s; median of %lld: %.3f s = %.1f MB/s, %.2f M tokens/s (min %.3f s, max %.3f s)\n",
           mb / t_cold, (long long)runs, med, mb / med, ids.size() / med / 1e6, secs.front(), secs.back());

    if (p.has("--ids-out")) {
        FILE* f = fopen(p.str("--ids-out").c_str(), "w");
        if (!f) fail("%s: cannot write", p.str("--ids-out").c_str());
        for (int32_t id : ids) fprintf(f, "%d\n", id);
        fclose(f);
    }
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        return run(argc - 1, argv + 1);
    } catch (const tansy::error& e) {
        fprintf(stderr, "bench_tokenizer: error: %s\n", e.what());
        return 1;
    }
}
