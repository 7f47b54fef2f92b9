// Quantiser quality and speed: for every linear module class of a bf16 checkpoint (or a synthetic matrix),
// the relative squared error ||W - deq(Q(W))||^2 / ||W||^2 of each method and its throughput.
//   bench_quant --model BF16_DIR [--threads N]       per module class, all methods
//   bench_quant --synthetic ROWSxCOLS [--threads N]  normal and heavy-tailed (Student-t, 3 dof) data
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <string>

#include "cli/args.h"
#include "core/check.h"
#include "loader/load_model.h"
#include "quant/quantize_model.h"

using namespace tansy;

namespace {

struct tally {
    double err = 0, norm = 0, seconds = 0;
    int64_t weights = 0;
};

void measure(const float* w, int64_t rows, int64_t cols, int bits, quant_method m, tally* t) {
    quantized_rows q;
    const auto t0 = std::chrono::steady_clock::now();
    quantize_rows(w, rows, cols, bits, 64, m, &q);
    t->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::vector<float> d((size_t)(rows * cols));
    dequantize_rows(q, rows, cols, bits, 64, d.data());
    for (int64_t i = 0; i < rows * cols; i++) {
        const double e = (double)d[(size_t)i] - w[i];
        t->err += e * e;
        t->norm += (double)w[i] * w[i];
    }
    t->weights += rows * cols;
}

// "layers.3.mlp.switch_mlp.up_proj" -> "switch_mlp.up_proj"
std::string module_class(const std::string& path) {
    size_t p = path.find("layers.");
    if (p == std::string::npos) return path.substr(path.rfind('.') + 1);
    p = path.find('.', p + 7);
    std::string c = path.substr(p + 1);
    if (c.rfind("mlp.", 0) == 0 || c.rfind("self_attn.", 0) == 0 || c.rfind("linear_attn.", 0) == 0)
        c = c.substr(c.find('.') + 1);
    return c;
}

void print_row(const std::string& name, const tally& a, const tally& b) {
    printf("%-26s %10lld %12.4e %12.4e %8.3f %10.2f %10.2f\n", name.c_str(), (long long)a.weights, a.err / a.norm,
           b.err / b.norm, b.err / a.err, a.weights / a.seconds / 1e6, b.weights / b.seconds / 1e6);
}

void header() {
    printf("%-26s %10s %12s %12s %8s %10s %10s\n", "class", "weights", "minmax rel", "mse rel", "ratio",
           "minmax M/s", "mse M/s");
}

}  // namespace

int main(int argc, char** argv) {
    try {
        arg_parser p("bench_quant", "(--model DIR | --synthetic ROWSxCOLS) [--threads N] [--bits N]",
                     "Relative squared error and throughput of each quantisation method.");
        p.option("--model", "DIR", "bf16 checkpoint")
            .option("--synthetic", "RxC", "random matrices of this shape")
            .option("--threads", "N", "OpenMP threads (default: all)")
            .option("--bits", "N", "bits (default 4)");
        if (!p.parse(argc - 1, argv + 1)) return 0;
        if (p.has("--threads")) omp_set_num_threads((int)p.integer("--threads", 0));
        const int bits = (int)p.integer("--bits", 4);
        printf("threads %d, %d-bit, group 64\n", omp_get_max_threads(), bits);
        header();
        if (p.has("--synthetic")) {
            long long R = 0, C = 0;
            if (sscanf(p.str("--synthetic").c_str(), "%lldx%lld", &R, &C) != 2 || R <= 0 || C <= 0 || C % 64)
                fail("--synthetic wants ROWSxCOLS with COLS a multiple of 64");
            std::mt19937 rng(1);
            std::normal_distribution<float> nd(0, 0.02f);
            std::student_t_distribution<float> td(3.0f);
            std::vector<float> w((size_t)(R * C));
            for (int kind = 0; kind < 2; kind++) {
                for (float& x : w) x = kind ? 0.01f * td(rng) : nd(rng);
                for (float& x : w) x = bf16_to_f32(f32_to_bf16(x));  // a bf16 checkpoint's values
                tally a, b;
                measure(w.data(), R, C, bits, quant_method::minmax, &a);
                measure(w.data(), R, C, bits, quant_method::mse, &b);
                print_row(kind ? "student-t(3)" : "normal", a, b);
            }
            return 0;
        }
        if (!p.has("--model")) fail("--model or --synthetic is required");
        model m = load_model(p.str("--model"));
        std::map<std::string, std::pair<tally, tally>> by_class;
        tally all_a, all_b;
        for (linear_module& lm : linear_modules(m.w, m.cfg)) {
            std::vector<const matrix*> parts(lm.parts.begin(), lm.parts.end());
            int64_t rows = 0;
            for (const matrix* x : parts) rows += x->rows;
            const int64_t cols = parts[0]->cols;
            std::vector<float> w((size_t)(rows * cols));
            int64_t r = 0;
            for (const matrix* x : parts)
                for (int64_t i = 0; i < x->rows; i++, r++) x->row_f32(i, &w[(size_t)(r * cols)]);
            auto& [a, b] = by_class[module_class(lm.path)];
            measure(w.data(), rows, cols, bits, quant_method::minmax, &a);
            measure(w.data(), rows, cols, bits, quant_method::mse, &b);
        }
        for (auto& [name, ab] : by_class) {
            print_row(name, ab.first, ab.second);
            for (tally* t : {&all_a, &all_b}) {
                const tally& s = t == &all_a ? ab.first : ab.second;
                t->err += s.err, t->norm += s.norm, t->seconds += s.seconds, t->weights += s.weights;
            }
        }
        print_row("all", all_a, all_b);
        return 0;
    } catch (const tansy::error& e) {
        fprintf(stderr, "bench_quant: %s\n", e.what());
        return 1;
    }
}
