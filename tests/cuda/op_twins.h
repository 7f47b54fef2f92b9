// CUDA-vs-CPU op test helpers: one synthetic model bound to both backends, tensors with the same random contents
// on both, and the model shapes the op tests run at (the tiny fixture's and the real Qwen3.6-35B-A3B's).
#pragma once
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "cuda_test_util.h"
#include "model/synthetic.h"

namespace tansy::test {

struct pair_of_backends {
    model m;
    std::unique_ptr<backend> cpu, gpu;
};

inline std::unique_ptr<pair_of_backends> make_pair(const model_config& c, bool precise_gemm = false, bool kv_fp8 = false,
                                                   const kernel_options& kernels = {}, bool state_bf16 = false) {
    auto p = std::make_unique<pair_of_backends>();
    synthetic_options so;
    so.materialize = true;
    so.seed = 7;
    p->m = make_synthetic_model(c, so);
    backend_options bo;
    bo.precise_gemm = precise_gemm;
    bo.kv_fp8 = kv_fp8;
    bo.kernels = kernels;
    bo.state_bf16 = state_bf16;
    p->cpu = make_backend("cpu", c, bo);
    p->gpu = make_backend("cuda", c, bo);
    p->cpu->bind(p->m);
    p->gpu->bind(p->m);
    return p;
}

inline model_config tiny_config() {
    return synthetic_config(fixture("tiny-qwen35moe-mlx4") + "/config.json", 4);
}
inline model_config real_config() {
    return synthetic_config(fixture("qwen3.6-35b-a3b") + "/config.json", 4, 2048);
}

// A tensor with the same random contents on both backends.
struct twin {
    buffer c, g;
    twin(pair_of_backends& p, int64_t rows, int64_t cols, uint32_t seed, float sd = 1.0f) {
        c = p.cpu->alloc(rows, cols, dtype::f32);
        g = p.gpu->alloc(rows, cols, dtype::f32);
        auto v = random_normal((size_t)(rows * cols), seed, sd);
        p.cpu->upload(c.t(), v.data());
        p.gpu->upload(g.t(), v.data());
    }
    twin(pair_of_backends& p, int64_t rows, int64_t cols) {
        c = p.cpu->alloc(rows, cols, dtype::f32);
        g = p.gpu->alloc(rows, cols, dtype::f32);
    }
    double diff(pair_of_backends& p) const {
        std::vector<float> a((size_t)c.t().numel()), b(a.size());
        p.cpu->download(a.data(), c.t());
        p.gpu->download(b.data(), g.t());
        return rel_error(b, a);
    }
};

// The rows of a [rows, cols] twin whose relative error is worst (for a failure message): "row r: e, ...".
inline std::string worst_rows(pair_of_backends& p, const twin& t, int n = 3) {
    const tensor& c = t.c.t();
    std::vector<float> a((size_t)c.numel()), b(a.size());
    p.cpu->download(a.data(), c);
    p.gpu->download(b.data(), t.g.t());
    std::vector<std::pair<double, int64_t>> e;
    for (int64_t r = 0; r < c.rows; r++) {
        std::vector<float> ra(b.begin() + r * c.cols, b.begin() + (r + 1) * c.cols), rb(a.begin() + r * c.cols, a.begin() + (r + 1) * c.cols);
        e.emplace_back(rel_error(ra, rb), r);
    }
    std::sort(e.rbegin(), e.rend());
    std::string s = "worst rows:";
    for (int i = 0; i < n && i < (int)e.size(); i++) {
        char b[64];
        snprintf(b, sizeof b, " %lld: %.3g", (long long)e[(size_t)i].second, e[(size_t)i].first);
        s += b;  // (not operator+ on temporaries: GCC 12 warns -Wrestrict on it)
    }
    return s;
}

inline vec_view vv(const std::vector<float>& v) { return {v.data(), (int64_t)v.size()}; }

}  // namespace tansy::test
