// tansy eval: teacher-forced NLL / perplexity, and consistency reports between two runs of the model (any two of
// bf16 / 4-bit on cpu / cuda) and reference tensors from a file.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/check.h"
#include "loader/safetensors.h"
#include "runtime/metrics.h"
#include "tokenizer/tokenizer.h"

namespace tansy {

namespace {

// Perplexity's Lily, the figures the fixed 192-position mode (--lily) is read against: its 4-bit model against
// its comparison over 192 teacher-forced positions.
constexpr int64_t LILY_POSITIONS = 192;
constexpr double LILY_DELTA_PPL_PCT = 0.04;
constexpr double LILY_TOP1_PCT = 96.35;

// A reference tensor, interpreted by its shape and dtype:
//   float [r, V]  logits     -> top-1 agreement, KL(reference || run) and the reference's own perplexity
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

// One run of the model over the evaluated positions.
struct run_result {
    std::string name;  // "A" or "B"
    std::string model, backend, weights;
    int64_t vocab = 0;
    std::vector<float> logits;  // [positions, V]: row i predicts ids[i + 1]
    double mean_nll = 0, seconds = 0;
};

// "bf16", "affine 4-bit (+8-bit modules)", ...: what the matrices of a loaded model are.
std::string describe_weights(const model& m) {
    int dense = 0, bits_max = 0, bits_min = 99;
    dtype t = dtype::bf16;
    auto see = [&](const matrix& x) {
        if (x.empty()) return;
        if (x.fmt == wfmt::dense) dense++, t = x.type;
        else bits_min = std::min(bits_min, x.bits), bits_max = std::max(bits_max, x.bits);
    };
    see(m.w.embed);
    see(m.w.lm_head);
    for (const layer_weights& l : m.w.layers) {
        for (const matrix* x : {&l.attn.q_proj, &l.attn.o_proj, &l.gdn.in_qkv, &l.gdn.out_proj, &l.moe.router,
                                &l.moe.shared_up})
            see(*x);
        for (const matrix& x : l.moe.down) see(x);
    }
    std::string dense_name = dtype_name(t);
    for (char& c : dense_name) c = (char)tolower((unsigned char)c);
    if (bits_max == 0) return dense_name;
    std::string s = strprintf("affine %d-bit", bits_min);
    if (bits_max != bits_min) s += strprintf(" (+%d-bit modules)", bits_max);
    if (dense) s += " (+" + dense_name + ")";
    return s;
}

run_result run_side(const std::string& name, const engine_options& o, const std::vector<int32_t>& ids,
                    int64_t positions) {
    run_result r;
    r.name = name;
    std::unique_ptr<engine> eng;
    try {
        eng = std::make_unique<engine>(o);
    } catch (const error& e) {
        fail("eval: run %s (%s, %s, weights %s): %s", name.c_str(),
             o.model_dir.empty() ? "default model" : o.model_dir.c_str(), o.backend.c_str(), o.weights.c_str(),
             e.what());
    }
    r.model = eng->mdl().dir;
    r.backend = eng->be().name();
    r.weights = describe_weights(eng->mdl());
    if (o.weights == "q4") r.weights += ", quantised at load";
    if (o.backend_opt.kv_fp8) r.weights += ", FP8 KV cache";
    if (o.backend_opt.state_bf16) r.weights += ", bf16 DeltaNet state";
    r.vocab = eng->cfg().vocab;
    // Rows 0..positions-1 predict ids 1..positions: the last id is a target only.
    const std::vector<int32_t> in(ids.begin(), ids.begin() + positions);
    eng->check_ids(ids);
    auto st = eng->new_sequence(positions);
    const auto t0 = std::chrono::steady_clock::now();
    r.logits = eng->step(*st, in, logits_rows::all);
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.mean_nll = mean_nll(r.logits.data(), positions, r.vocab, ids.data() + 1);
    return r;
}

double delta_ppl_pct(double ref_nll, double cand_nll) { return 100.0 * (std::exp(cand_nll - ref_nll) - 1.0); }

nlohmann::json comparison_json(const std::string& ref, const std::string& cand, const logits_comparison& c,
                               double ref_nll, double cand_nll) {
    return {{"reference", ref},
            {"candidate", cand},
            {"positions", c.rows},
            {"reference_perplexity", std::exp(ref_nll)},
            {"candidate_perplexity", std::exp(cand_nll)},
            {"delta_perplexity_pct", delta_ppl_pct(ref_nll, cand_nll)},
            {"top1_agreement", c.top1_agreement},
            {"mean_kl", c.mean_kl},
            {"p99_kl", c.p99_kl},
            {"max_kl", c.max_kl}};
}

std::string comparison_row(const std::string& label, const logits_comparison& c, double ref_nll, double cand_nll) {
    return strprintf("  %-22s %+11.4f%% %10.4f%% (%lld/%lld) %11.3e %11.3e %11.3e\n", label.c_str(),
                     delta_ppl_pct(ref_nll, cand_nll), 100 * c.top1_agreement,
                     (long long)std::llround(c.top1_agreement * (double)c.rows), (long long)c.rows, c.mean_kl,
                     c.p99_kl, c.max_kl);
}

}  // namespace

int cmd_eval(int argc, char** argv) {
    arg_parser p(
        "eval",
        "(--ids-file F | --text-file F) [--compare-model DIR] [--compare-backend B] [--compare-weights W]\n"
        "                  [--reference REF.safetensors --reference-key KEY ...] [--lily | --positions N] [options]",
        "Teacher-forced evaluation: one prefill over the ids (in chunks of --prefill-chunk tokens, every chunk's\n"
        "logits kept), then the mean negative log-likelihood of each next token and the perplexity.\n\n"
        "Consistency report: run A is --model/--backend/--weights; any --compare-* option adds run B, which takes\n"
        "A's settings except those given. For A against B (and each reference logits tensor against each run):\n"
        "Δperplexity %, top-1 agreement, and the mean, p99 and max of KL(reference || candidate) per position.\n"
        "E.g. bf16 cpu vs 4-bit cpu:  --model BF16_DIR --compare-weights q4\n"
        "     4-bit cpu vs 4-bit gpu: --model Q4_DIR --compare-backend cuda\n"
        "     bf16 vs FP8 KV cache:    --compare-kv-cache fp8\n"
        "     fp32 vs bf16 DeltaNet state, stored after every token: --compare-deltanet-state bf16 --prefill-chunk 1\n"
        "Reference tensors: logits [n, vocab] (KL, top-1, their perplexity), argmax ids [n] (top-1), or NLL [n]\n"
        "floats (their mean); a reference may cover all n positions or the n-1 predicted ones.\n"
        "--lily evaluates the first 192 predicted positions and prints Perplexity's Lily figures beside them.");
    add_engine_options(p);
    p.option("--ids-file", "F", "token ids, separated by whitespace")
        .option("--text-file", "F", "text, tokenized with run A's tokenizer (tokenizer.json of its model)")
        .option("--compare-model", "DIR", "run B's checkpoint (default: run A's)")
        .option("--compare-backend", "NAME", "run B's backend: cpu or cuda (default: run A's)")
        .option("--compare-weights", "W", "run B's weights: checkpoint, q4 or bf16 (default: run A's)")
        .option("--compare-kv-cache", "TYPE", "run B's KV cache: bf16 or fp8 (default: run A's)")
        .option("--compare-deltanet-state", "TYPE", "run B's DeltaNet state: fp32 or bf16 (default: run A's)")
        .option("--reference", "PATH", "safetensors file with reference tensors")
        .option("--reference-key", "KEY", "tensor to compare with (repeatable)", "", true)
        .option("--positions", "N", "evaluate only the first N predicted positions")
        .option("--lily", "", "the fixed 192-position report, next to Lily's figures")
        .option("--json", "", "print one JSON object instead of a table");
    if (!p.parse(argc, argv)) return 0;
    if (p.has("--ids-file") == p.has("--text-file")) fail("eval: give exactly one of --ids-file and --text-file");
    if (p.has("--reference-key") && !p.has("--reference")) fail("eval: --reference-key needs --reference");
    if (p.has("--reference") && !p.has("--reference-key")) fail("eval: --reference needs --reference-key");
    if (p.has("--lily") && p.has("--positions")) fail("eval: --lily fixes the positions at 192; drop --positions");

    const engine_options oa = engine_options_from(p);
    std::vector<int32_t> ids;
    std::string source;
    if (p.has("--ids-file")) {
        source = "ids " + p.str("--ids-file");
        ids = read_ids_file(p.str("--ids-file"));
    } else {
        const std::string dir = oa.model_dir.empty() ? default_model_dir() : oa.model_dir;
        source = "text " + p.str("--text-file");
        if (!file_exists(p.str("--text-file"))) fail("%s: no such file", p.str("--text-file").c_str());
        ids = tokenizer::load(dir).encode(read_text_file(p.str("--text-file")));
    }
    const int64_t n = (int64_t)ids.size();
    if (n < 2) fail("eval: needs at least 2 token ids (got %zu)", ids.size());
    int64_t positions = n - 1;
    if (p.has("--lily") || p.has("--positions")) {
        const int64_t want = p.has("--lily") ? LILY_POSITIONS : p.integer("--positions", 0);
        if (want < 1) fail("eval: --positions must be at least 1");
        if (want > n - 1)
            fail("eval: %lld positions need %lld tokens; the input has %lld", (long long)want, (long long)want + 1,
                 (long long)n);
        positions = want;
    }

    const bool compare = p.has("--compare-model") || p.has("--compare-backend") || p.has("--compare-weights") ||
                         p.has("--compare-kv-cache") || p.has("--compare-deltanet-state");
    engine_options ob = oa;
    if (p.has("--compare-model")) ob.model_dir = model_path_arg(p, "--compare-model");
    if (p.has("--compare-backend")) ob.backend = p.str("--compare-backend");
    if (p.has("--compare-weights")) ob.weights = p.str("--compare-weights");
    if (p.has("--compare-kv-cache")) ob.backend_opt.kv_fp8 = kv_fp8_from(p.str("--compare-kv-cache"), "--compare-kv-cache");
    if (p.has("--compare-deltanet-state"))
        ob.backend_opt.state_bf16 = state_bf16_from(p.str("--compare-deltanet-state"), "--compare-deltanet-state");

    // The runs one after the other, so that only one model is in memory at a time.
    std::vector<run_result> runs;
    runs.push_back(run_side("A", oa, ids, positions));
    if (compare) {
        runs.push_back(run_side("B", ob, ids, positions));
        if (runs[1].vocab != runs[0].vocab)
            fail("eval: runs A and B have different vocabularies (%lld, %lld)", (long long)runs[0].vocab,
                 (long long)runs[1].vocab);
    }
    const run_result& a = runs[0];
    const int64_t V = a.vocab;

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

    nlohmann::json out = {{"model", a.model},  {"backend", a.backend},      {"weights", a.weights},
                          {"tokens", n},       {"positions", positions},    {"mean_nll", a.mean_nll},
                          {"perplexity", std::exp(a.mean_nll)}, {"seconds", a.seconds}};
    std::string table = strprintf("  %-22s %s: %lld tokens, %lld predicted positions\n", "input", source.c_str(),
                                  (long long)n, (long long)positions);
    nlohmann::json jruns = nlohmann::json::array();
    table += strprintf("  %-4s %12s %10s %8s  %s\n", "run", "perplexity", "mean NLL", "seconds",
                       "model, backend, weights");
    for (const run_result& r : runs) {
        jruns.push_back({{"name", r.name}, {"model", r.model}, {"backend", r.backend}, {"weights", r.weights},
                         {"mean_nll", r.mean_nll}, {"perplexity", std::exp(r.mean_nll)}, {"seconds", r.seconds}});
        table += strprintf("  %-4s %12.4f %10.6f %8.2f  %s, %s, %s\n", r.name.c_str(), std::exp(r.mean_nll),
                           r.mean_nll, r.seconds, r.model.c_str(), r.backend.c_str(), r.weights.c_str());
    }
    out["runs"] = jruns;

    // Logits comparisons: A || B, then each reference logits tensor || each run.
    nlohmann::json jcmp = nlohmann::json::array();
    std::string ctable;
    auto add_cmp = [&](const std::string& rname, const float* ref, double ref_nll, const run_result& cand) {
        const logits_comparison c = compare_logits(ref, cand.logits.data(), positions, V);
        jcmp.push_back(comparison_json(rname, cand.name, c, ref_nll, cand.mean_nll));
        ctable += comparison_row(rname + " || " + cand.name, c, ref_nll, cand.mean_nll);
        return c;
    };
    if (compare) add_cmp("A", a.logits.data(), a.mean_nll, runs[1]);

    nlohmann::json jrefs = nlohmann::json::array();
    std::string rtable;
    for (const reference& r : refs) {
        nlohmann::json j = {{"key", r.key}};
        if (r.kind == reference::nll) {
            double s = 0;
            for (int64_t i = 0; i < positions; i++) s += r.f[(size_t)i];
            const double rn = s / (double)positions;
            j["kind"] = "nll", j["reference_mean_nll"] = rn, j["delta_nll"] = a.mean_nll - rn;
            j["delta_perplexity_pct"] = delta_ppl_pct(rn, a.mean_nll);
            rtable += strprintf("  %-22s %.6f (A %+.2e, perplexity %+.4f%%)\n", (r.key + " mean NLL").c_str(), rn,
                                a.mean_nll - rn, delta_ppl_pct(rn, a.mean_nll));
        } else if (r.kind == reference::argmax) {
            j["kind"] = "argmax", j["positions"] = positions;
            for (const run_result& run : runs) {
                int64_t same = 0;
                for (int64_t i = 0; i < positions; i++)
                    same += r.ids[(size_t)i] == argmax(&run.logits[(size_t)(i * V)], V);
                const double rate = (double)same / (double)positions;
                if (run.name == "A") j["top1_agreement"] = rate;
                else j["top1_agreement_" + run.name] = rate;
                rtable += strprintf("  %-22s %.4f%% (%lld/%lld)\n", (r.key + " || " + run.name + " top-1").c_str(),
                                    100 * rate, (long long)same, (long long)positions);
            }
        } else {
            const double rn = mean_nll(r.f.data(), positions, V, ids.data() + 1);
            logits_comparison ca;
            for (const run_result& run : runs) {
                logits_comparison c = add_cmp("ref:" + r.key, r.f.data(), rn, run);
                if (run.name == "A") ca = c;
            }
            j["kind"] = "logits", j["positions"] = positions, j["top1_agreement"] = ca.top1_agreement;
            j["mean_kl"] = ca.mean_kl, j["p99_kl"] = ca.p99_kl, j["max_kl"] = ca.max_kl;
            j["reference_perplexity"] = std::exp(rn), j["delta_perplexity_pct"] = delta_ppl_pct(rn, a.mean_nll);
        }
        jrefs.push_back(j);
    }
    if (!refs.empty()) out["references"] = jrefs;
    if (!jcmp.empty()) {
        out["comparisons"] = jcmp;
        table += strprintf("  %-22s %13s %21s %13s %11s %11s\n", "reference || candidate", "Δperplexity",
                           "top-1 agreement", "mean KL", "p99 KL", "max KL");
        table += ctable;
    }
    table += rtable;
    if (p.has("--lily")) {
        out["lily"] = {{"positions", LILY_POSITIONS}, {"delta_perplexity_pct", LILY_DELTA_PPL_PCT},
                       {"top1_agreement", LILY_TOP1_PCT / 100}};
        table += strprintf("  %-22s Δperplexity %+.2f%%, top-1 %.2f%% over %lld teacher-forced positions\n", "Lily",
                           LILY_DELTA_PPL_PCT, LILY_TOP1_PCT, (long long)LILY_POSITIONS);
    }
    if (p.has("--json"))
        printf("%s\n", out.dump().c_str());
    else
        printf("tansy eval\n%s", table.c_str());
    return 0;
}

}  // namespace tansy
