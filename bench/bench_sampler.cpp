// Host sampler speed over a full-size vocabulary (248,320 ids, Qwen3.6): microseconds per draw for the
// sampling settings clients send, on logits shaped like a trained model's (a broad normal body and a peaked
// head). The scheduler draws the sampled rows of a batch in parallel; this measures one draw on one thread.
//   bench_sampler [--vocab N] [--draws N]
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "cli/args.h"
#include "core/check.h"
#include "sampling/sampler.h"

using namespace tansy;

static void run(int64_t vocab, int draws) {
    TANSY_CHECK(vocab >= 2 && draws >= 1, "--vocab >= 2 and --draws >= 1");
    std::mt19937 rng(1);
    std::normal_distribution<float> body(0.0f, 3.0f);
    std::vector<float> logits((size_t)vocab);
    for (float& x : logits) x = body(rng);
    for (int i = 0; i < 20; i++) logits[rng() % (uint64_t)vocab] += 12.0f;  // a peaked head
    struct setting {
        const char* name;
        sampling_params p;
    };
    auto sp = [](float t, int k, float top_p, float min_p) {
        sampling_params p;
        p.temperature = t, p.top_k = k, p.top_p = top_p, p.min_p = min_p, p.seed = 3;
        return p;
    };
    const setting settings[] = {{"greedy", sp(0.0f, 0, 1.0f, 0.0f)},
                                {"temperature 1 (OpenAI default)", sp(1.0f, 0, 1.0f, 0.0f)},
                                {"temperature 0.7, top-p 0.95", sp(0.7f, 0, 0.95f, 0.0f)},
                                {"temperature 0.6, top-k 20, top-p 0.95 (Qwen)", sp(0.6f, 20, 0.95f, 0.0f)},
                                {"temperature 1, min-p 0.05", sp(1.0f, 0, 1.0f, 0.05f)}};
    printf("vocabulary %lld, %d draws each, one thread\n", (long long)vocab, draws);
    for (const setting& s : settings) {
        sampler smp(s.p, vocab);
        long long sum = 0;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < draws; i++) sum += smp.sample(logits.data(), vocab);
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / draws;
        printf("  %-48s %9.1f us/draw  (checksum %lld)\n", s.name, us, sum);
    }
}
int main(int argc, char** argv) {
    try {
        arg_parser a("bench_sampler", "[--vocab N] [--draws N]", "Microseconds per host sampler draw.");
        a.option("--vocab", "N", "vocabulary size (default 248320)").option("--draws", "N", "draws per setting (default 50)");
        if (!a.parse(argc - 1, argv + 1)) return 0;
        run(a.integer("--vocab", 248320), (int)a.integer("--draws", 50));
        return 0;
    } catch (const tansy::error& e) {
        fprintf(stderr, "bench_sampler: %s\n", e.what());
        return 1;
    }
}

