// tansy eval: teacher-forced NLL / perplexity, optionally against reference tensors.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/check.h"
#include "loader/safetensors.h"
#include "runtime/metrics.h"

namespace tansy {

namespace {

// A reference tensor, interpreted by its shape and dtype:
//   float [r, V]  logits     -> top-1 agreement and mean KL(reference || tansy)
//   int   [r]     argmax ids -> top-1 agreement
//   float [r]     NLL per predicted position -> reference mean NLL
struct reference {
    std::string key;
    enum kind_t { logits, argmax, nll } kind;
    int64_t rows = 0;
    std::vector<float> f;      // logits or nll
    std::vector<int64_t> ids;  // argmax
};

float read_float(const uint8_t* p, dtype t) {
    switch (t) {
        case dtype::f32: { float f; memcpy(&f, p, 4); return f; }
        case dtype::bf16: { uint16_t h; memcpy(&h, p, 2); return bf16_to_f32(h); }
        case dtype::f16: { uint16_t h; memcpy(&h, p, 2); return f16_to_f32(h); }
        case dtype::f64: { double d; memcpy(&d, p, 8); return (float)d; }
        default: TANSY_ABORT("not a float dtype");
    }
}

reference load_reference(const st_file& f, const std::string& key, int64_t vocab) {
    const st_tensor* t = f.find(key);
    if (!t) fail("%s: no tensor '%s'", f.path().c_str(), key.c_str());
    reference r;
    r.key = key;
    const bool is_f = t->type == dtype::f32 || t->type == dtype::bf16 || t->type == dtype::f16 || t->type == dtype::f64;
    const bool is_i = t->type == dtype::i32 || t->type == dtype::i64;
    const size_t es = dtype_size(t->type);
    if (is_f && t->shape.size() == 2) {
        if (t->shape[1] != vocab)
            fail("%s: '%s' has %lld columns but the model's vocabulary is %lld", f.path().c_str(), key.c_str(),
                 (long long)t->shape[1], (long long)vocab);
        r.kind = reference::logits;
        r.rows = t->shape[0];
    } else if (t->shape.size() == 1 && (is_f || is_i)) {
        r.kind = is_i ? reference::argmax : reference::nll;
        r.rows = t->shape[0];
    } else {
        fail("%s: '%s' (%s %s) is neither logits [n, vocab], argmax ids [n] nor NLL [n]", f.path().c_str(),
             key.c_str(), dtype_name(t->type), t->shape_str().c_str());
    }
    const int64_t n = t->numel();
    if (r.kind == reference::argmax) {
        for (int64_t i = 0; i < n; i++) {
            int64_t v = 0;
            if (t->type == dtype::i32) {
                int32_t x;
                memcpy(&x, t->data + i * es, 4);
                v = x;
            } else {
                memcpy(&v, t->data + i * es, 8);
            }
            r.ids.push_back(v);
        }
    } else {
        r.f.resize((size_t)n);
        for (int64_t i = 0; i < n; i++) r.f[(size_t)i] = read_float(t->data + i * es, t->type);
    }
    return r;
}

}  // namespace

int cmd_eval(int argc, char** argv) {
    arg_parser p("eval", "--ids-file F [--reference REF.safetensors --reference-key KEY ...] [options]",
                 "Teacher-forced evaluation: one prefill over the ids, then the mean negative log-likelihood of\n"
                 "each next token and the perplexity. With reference tensors, also the top-1 agreement and the mean\n"
                 "KL(reference || tansy) (logits [n, vocab]), top-1 agreement with argmax ids [n], or the reference's\n"
                 "mean NLL ([n] floats). A reference may cover all n positions or the n-1 predicted ones.");
    add_engine_options(p);
    p.option("--ids-file", "F", "token ids, separated by whitespace")
        .option("--reference", "PATH", "safetensors file with reference tensors")
        .option("--reference-key", "KEY", "tensor to compare with (repeatable)", "", true)
        .option("--json", "", "print one JSON object instead of a table");
    if (!p.parse(argc, argv)) return 0;
    if (!p.has("--ids-file")) fail("eval: --ids-file is required");
    if (p.has("--reference-key") && !p.has("--reference")) fail("eval: --reference-key needs --reference");
    if (p.has("--reference") && !p.has("--reference-key")) fail("eval: --reference needs --reference-key");
    std::vector<int32_t> ids = read_ids_file(p.str("--ids-file"));
    if (ids.size() < 2) fail("eval: needs at least 2 token ids (got %zu)", ids.size());

    engine eng(engine_options_from(p));
    const int64_t V = eng.cfg().vocab, n = (int64_t)ids.size();
    std::vector<reference> refs;
    std::unique_ptr<st_file> rf;
    if (p.has("--reference")) {
        rf = std::make_unique<st_file>(p.str("--reference"));
        for (const std::string& key : p.all("--reference-key")) {
            refs.push_back(load_reference(*rf, key, V));
            if (refs.back().rows != n && refs.back().rows != n - 1)
                fail("eval: reference '%s' has %lld rows; expected %lld (all positions) or %lld (predictions)",
                     key.c_str(), (long long)refs.back().rows, (long long)n, (long long)(n - 1));
        }
    }

    eng.check_ids(ids);
    auto st = eng.new_sequence(n);
    auto t0 = std::chrono::steady_clock::now();
    std::vector<float> logits = eng.step(*st, ids, logits_rows::all);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    double nll = 0;
    for (int64_t i = 0; i + 1 < n; i++) nll += token_nll(&logits[(size_t)(i * V)], V, ids[(size_t)i + 1]);
    nll /= (double)(n - 1);

    nlohmann::json out = {{"model", eng.mdl().dir},     {"backend", eng.be().name()}, {"tokens", n},
                          {"positions", n - 1},         {"mean_nll", nll},           {"perplexity", std::exp(nll)},
                          {"seconds", dt}};
    std::string table = strprintf("  %-28s %lld tokens, %lld predicted positions, %.2f s on %s\n", "input",
                                  (long long)n, (long long)(n - 1), dt, eng.be().name());
    table += strprintf("  %-28s %.6f\n  %-28s %.4f\n", "mean NLL", nll, "perplexity", std::exp(nll));
    nlohmann::json jrefs = nlohmann::json::array();
    for (const reference& r : refs) {
        nlohmann::json j = {{"key", r.key}};
        if (r.kind == reference::nll) {
            double s = 0;
            const int64_t m = std::min<int64_t>(r.rows, n - 1);
            for (int64_t i = 0; i < m; i++) s += r.f[(size_t)i];
            const double rn = s / (double)m;
            j["kind"] = "nll", j["reference_mean_nll"] = rn, j["delta_nll"] = nll - rn;
            table += strprintf("  %-28s %.6f (tansy %+.2e, perplexity %+.4f%%)\n", (r.key + " mean NLL").c_str(), rn,
                               nll - rn, 100.0 * (std::exp(nll - rn) - 1.0));
            jrefs.push_back(j);
            continue;
        }
        agreement ag;
        double kl = 0, kl_max = 0;
        for (int64_t i = 0; i < r.rows; i++) {
            const float* ours = &logits[(size_t)(i * V)];
            const int32_t top = [&] {
                int64_t b = 0;
                for (int64_t v = 1; v < V; v++)
                    if (ours[v] > ours[b]) b = v;
                return (int32_t)b;
            }();
            ag.n++;
            if (r.kind == reference::argmax) {
                ag.same += r.ids[(size_t)i] == top;
            } else {
                const float* ref = &r.f[(size_t)(i * V)];
                int64_t rb = 0;
                for (int64_t v = 1; v < V; v++)
                    if (ref[v] > ref[rb]) rb = v;
                ag.same += rb == top;
                const double k = kl_divergence(ref, ours, V);
                kl += k;
                kl_max = std::max(kl_max, k);
            }
        }
        j["kind"] = r.kind == reference::argmax ? "argmax" : "logits";
        j["positions"] = ag.n;
        j["top1_agreement"] = ag.rate();
        table += strprintf("  %-28s %.4f%% (%lld / %lld)\n", (r.key + " top-1 agreement").c_str(), 100 * ag.rate(),
                           (long long)ag.same, (long long)ag.n);
        if (r.kind == reference::logits) {
            j["mean_kl"] = kl / (double)ag.n;
            j["max_kl"] = kl_max;
            table += strprintf("  %-28s %.3e (max %.3e)\n", (r.key + " mean KL").c_str(), kl / (double)ag.n, kl_max);
        }
        jrefs.push_back(j);
    }
    if (!refs.empty()) out["references"] = jrefs;
    if (p.has("--json"))
        printf("%s\n", out.dump().c_str());
    else
        printf("tansy eval  %s\n%s", eng.mdl().dir.c_str(), table.c_str());
    return 0;
}

}  // namespace tansy
