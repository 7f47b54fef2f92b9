#include "golden.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "core/check.h"
#include "runtime/metrics.h"

namespace tansy::test {

std::vector<float> golden::floats(const std::string& key) const {
    const st_tensor* t = f_.find(key);
    if (!t) fail("golden: no tensor %s", key.c_str());
    if (t->type != dtype::f32) fail("golden: %s is %s, expected F32", key.c_str(), dtype_name(t->type));
    std::vector<float> v((size_t)t->numel());
    memcpy(v.data(), t->data, t->nbytes());
    return v;
}

std::vector<int32_t> golden::ints(const std::string& key) const {
    const st_tensor* t = f_.find(key);
    if (!t) fail("golden: no tensor %s", key.c_str());
    if (t->type != dtype::i32) fail("golden: %s is %s, expected I32", key.c_str(), dtype_name(t->type));
    std::vector<int32_t> v((size_t)t->numel());
    memcpy(v.data(), t->data, t->nbytes());
    return v;
}

std::vector<int64_t> golden::shape(const std::string& key) const {
    const st_tensor* t = f_.find(key);
    return t ? t->shape : std::vector<int64_t>{};
}

namespace {
std::unique_ptr<engine> make_engine(const std::string& model_dir, const std::string& backend, bool precise_gemm,
                                    bool kv_fp8, bool state_bf16, int threads) {
    engine_options o;
    o.model_dir = model_dir;
    o.backend = backend;
    o.threads = threads;
    o.backend_opt.precise_gemm = precise_gemm;
    o.backend_opt.kv_fp8 = kv_fp8;
    o.backend_opt.state_bf16 = state_bf16;
    o.weights = "checkpoint";  // every backend runs the checkpoint's own weights: the comparisons are of backends
    return std::make_unique<engine>(o);
}
}  // namespace

engine& shared_engine(const std::string& model_dir, const std::string& backend, bool precise_gemm, bool kv_fp8,
                      bool state_bf16) {
    static std::mutex mu;
    static std::map<std::tuple<std::string, std::string, bool, bool, bool>, std::unique_ptr<engine>> engines;
    std::lock_guard<std::mutex> lk(mu);
    auto& e = engines[{model_dir, backend, precise_gemm, kv_fp8, state_bf16}];
    if (!e) e = make_engine(model_dir, backend, precise_gemm, kv_fp8, state_bf16, 0);
    return *e;
}

engine& cpu_engine(const std::string& model_dir) { return shared_engine(model_dir, "cpu"); }

std::unique_ptr<engine> own_cpu_engine(const std::string& model_dir, int threads, bool state_bf16) {
    return make_engine(model_dir, "cpu", false, false, state_bf16, threads);
}

void expect_near_run(const char* what, const std::vector<float>& a, const std::vector<float>& b, int64_t P, int64_t V,
                     const int32_t* targets, const nearness_bounds& bounds) {
    const logits_comparison c = compare_logits(a.data(), b.data(), P, V);
    const double shift = mean_nll(b.data(), P, V, targets) - mean_nll(a.data(), P, V, targets);
    printf("  %s, %lld positions: top-1 %.4f  mean KL %.3e  p99 KL %.3e  NLL %+.6f\n", what, (long long)P,
           c.top1_agreement, c.mean_kl, c.p99_kl, shift);
    EXPECT_GE(c.top1_agreement, bounds.min_top1) << what;
    EXPECT_LE(c.mean_kl, bounds.max_mean_kl) << what;
    EXPECT_GE(c.mean_kl, bounds.min_mean_kl) << what;
    EXPECT_LE(std::fabs(shift), bounds.max_nll_shift) << what;
}

std::vector<float> prefill_then_decode(engine& e, const std::vector<int32_t>& ids, size_t split) {
    auto st = e.new_sequence((int64_t)ids.size());
    std::vector<float> out;
    if (split > 0) out = e.step(*st, std::vector<int32_t>(ids.begin(), ids.begin() + (ptrdiff_t)split), logits_rows::all);
    for (size_t i = split; i < ids.size(); i++) {
        auto lg = e.step(*st, {ids[i]}, logits_rows::all);
        out.insert(out.end(), lg.begin(), lg.end());
    }
    return out;
}

}  // namespace tansy::test
