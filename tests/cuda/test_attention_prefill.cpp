// The CUDA attention of prompt rows (attention_prefill: tensor-core causal flash attention for spans of at least
// k_attn_prefill_min_rows rows, the split-K decode path for shorter ones) vs the CPU backend's fp32 attention, at
// the real Qwen3.6-35B-A3B shapes (16/2 heads of 256) and the tiny fixture's (8/1 heads of 256): prompts from an
// empty cache and after a cached prefix, odd lengths, partial last tiles, several long spans in one batch, long
// spans mixed with single tokens of other sequences, and spans on both sides of the routing threshold.
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/attention.cuh"  // k_attn_prefill_min_rows
#include "core/fp8.h"
#include "op_twins.h"

using namespace tansy;
using namespace tansy::test;

namespace {

// CUDA rounds K/V (cache), Q and P (tensor-core operands) to bf16 (with an FP8 cache: Q and P to fp16), 2^-9
// relative each or better, with fp32 accumulation;
// the errors are independent over the 256 terms of a score and over the keys of a row, so they average: a numpy
// emulation of these roundings on these shapes gives ~3e-3 relative. 1e-2 leaves room; a wrong key, row or mask
// bit moves a row at context n by ~1/sqrt(n) (>= 4e-2 for the contexts here) and a wrong tile far more.
constexpr double TOL_PREFILL = 1e-2;
// Any one row (Hq*dh values): the emulation's worst row is ~5e-3. It catches a single wrong key or a wrong
// partial tile that the whole-batch error would dilute.
constexpr double TOL_PREFILL_ROW = 2e-2;
// With the FP8 cache both backends round K and V to the same E4M3 values (core/fp8.h; a value whose fp32 K
// differs across a rounding boundary may take the neighbouring code, rare and diluted), so the same bounds
// hold; a wrong code, scale or tile conversion moves rows by ~2^-4 relative or more.

constexpr int64_t k_capacity = 512;  // KV rows per sequence: the longest here is 300 + 200 + 1

struct seq_twin {
    std::unique_ptr<seq_state> c, g;
};

// n fresh sequences on both backends.
std::vector<seq_twin> fresh_seqs(pair_of_backends& p, size_t n) {
    std::vector<seq_twin> seqs(n);
    for (seq_twin& s : seqs) s.c = p.cpu->new_state(k_capacity), s.g = p.gpu->new_state(k_capacity);
    return seqs;
}

// Relative Frobenius error of each row of got [rows, cols] against ref; returns the worst and its row.
double worst_row_error(const std::vector<float>& got, const std::vector<float>& ref, int64_t row0, int64_t rows,
                       int64_t cols, int64_t* worst) {
    double w = 0;
    *worst = -1;
    for (int64_t r = row0; r < row0 + rows; r++) {
        const std::vector<float> a(got.begin() + r * cols, got.begin() + (r + 1) * cols);
        const std::vector<float> b(ref.begin() + r * cols, ref.begin() + (r + 1) * cols);
        const double e = rel_error(a, b);
        if (!(e <= w)) w = e, *worst = r;  // NaN counts as worst
    }
    return w;
}

// One forward step of the attention layer: parts are (sequence, rows) in batch order; fresh random q|gate, k, v.
void step(pair_of_backends& p, std::vector<seq_twin>& seqs, const std::vector<std::pair<int, int>>& parts,
          uint32_t& seed, const std::string& what) {
    const model_config& c = p.m.cfg;
    const layer_weights& al = p.m.w.layers[3];  // the first full-attention layer
    std::vector<seq_span> sc, sg;
    int64_t T = 0;
    for (auto [s, n] : parts) {
        sc.push_back({seqs[(size_t)s].c.get(), T, n, seqs[(size_t)s].c->n_past()});
        sg.push_back({seqs[(size_t)s].g.get(), T, n, seqs[(size_t)s].g->n_past()});
        T += n;
    }
    const int64_t cols = c.n_q_heads * c.head_dim;
    twin qg(p, T, c.q_proj_rows(), seed++), k(p, T, c.kv_dim(), seed++), v(p, T, c.kv_dim(), seed++), out(p, T, cols);
    p.cpu->attention(out.c.t(), qg.c.t(), k.c.t(), v.c.t(), al.attn, 0, sc);
    p.gpu->attention(out.g.t(), qg.g.t(), k.g.t(), v.g.t(), al.attn, 0, sg);
    std::vector<float> ref((size_t)(T * cols)), got(ref.size());
    p.cpu->download(ref.data(), out.c.t());
    p.gpu->download(got.data(), out.g.t());
    EXPECT_LT(rel_error(got, ref), TOL_PREFILL) << what;
    for (size_t i = 0; i < parts.size(); i++) {
        int64_t worst = -1;
        const double e = worst_row_error(got, ref, sg[i].row0, sg[i].n, cols, &worst);
        EXPECT_LT(e, TOL_PREFILL_ROW) << what << ": span " << i << " (" << sg[i].n << " rows after " << sg[i].pos0
                                      << "), worst row " << worst - sg[i].row0;
    }
    p.cpu->end_step(sc);
    p.gpu->end_step(sg);
    for (auto [s, n] : parts)
        for (seq_state* st : {seqs[(size_t)s].c.get(), seqs[(size_t)s].g.get()}) st->set_n_past(st->n_past() + n);
}

void check_prefill(pair_of_backends& p) {
    std::vector<seq_twin> seqs = fresh_seqs(p, 5);
    uint32_t seed = 5000;
    const int th = cuda::k_attn_prefill_min_rows;
    // 5 tiles, the last of 44 rows; the key tiles line up with the query tiles
    step(p, seqs, {{0, 300}}, seed, "300-row prompt, empty cache");
    // prefix 300 (not a multiple of 64): each query tile's diagonal straddles two key tiles
    step(p, seqs, {{0, 200}}, seed, "200 rows after a 300-row prefix");
    step(p, seqs, {{1, 40}, {2, 3}}, seed, "40-row prompt + 3-row span");
    // one long span between two single tokens of other sequences (both paths write their own rows)
    step(p, seqs, {{1, 1}, {3, 129}, {2, 1}}, seed, "token + 129-row prompt + token");
    // two long spans in one batch (the CTAs walk past the first span's tiles), odd lengths, one with a prefix
    step(p, seqs, {{2, 77}, {1, 1}, {4, 77}}, seed, "77 rows after 4 + token + 77-row prompt");
    // both sides of the routing threshold
    step(p, seqs, {{3, th - 1}, {1, th}, {0, 1}}, seed, "spans of threshold-1, threshold, 1");
    // plain decode afterwards: the decode path still sees the prompts' cache rows
    step(p, seqs, {{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}}, seed, "decode tokens");
}

}  // namespace

TEST(cuda_attention_prefill, real_shapes) {
    TANSY_REQUIRE_GPU();
    auto p = make_pair(real_config());
    check_prefill(*p);
}

TEST(cuda_attention_prefill, tiny_shapes) {
    TANSY_REQUIRE_GPU();
    auto p = make_pair(tiny_config());
    check_prefill(*p);
}

// The FP8 KV cache: E4M3 tiles converted to bf16 in shared memory, on the decode and the prefill kernels.
TEST(cuda_attention_prefill, fp8_cache_real_shapes) {
    TANSY_REQUIRE_GPU();
    auto p = make_pair(real_config(), false, /*kv_fp8=*/true);
    check_prefill(*p);
}

TEST(cuda_attention_prefill, fp8_cache_tiny_shapes) {
    TANSY_REQUIRE_GPU();
    auto p = make_pair(tiny_config(), false, true);
    check_prefill(*p);
}

// One slice per (token, KV head): the decode kernel walks up to 8 key tiles of the ~500-position contexts
// here, so its tile ring wraps and the V reference grows across tiles (at the default 64 slices a context
// needs 4K+ positions for that).
TEST(cuda_attention_prefill, long_slices) {
    TANSY_REQUIRE_GPU();
    struct reset {
        ~reset() { cuda::force_attention_splits(0); }
    } guard;
    cuda::force_attention_splits(1);
    for (bool fp8 : {false, true}) {
        SCOPED_TRACE(fp8 ? "fp8 cache" : "bf16 cache");
        auto p = make_pair(real_config(), false, fp8);
        check_prefill(*p);
    }
}

// The decode kernel's slices at forced counts (by default they follow the SM count): a span of 8 rows straddling
// a slice boundary (positions 60-67: its earlier rows' keys fall in the first slice, and a slice may hold only this
// step's keys) and one of 5 rows after a longer prefix, with both caches and both query precisions.
TEST(cuda_attention_prefill, decode_slices) {
    TANSY_REQUIRE_GPU();
    struct reset {
        ~reset() { cuda::force_attention_splits(0); }
    } guard;
    for (int splits : {2, 4})
        for (auto [precise, fp8] : {std::pair{false, false}, std::pair{true, false}, std::pair{false, true}}) {
            SCOPED_TRACE(std::to_string(splits) + " slices, " + (precise ? "precise" : "fast") + (fp8 ? ", fp8 cache" : ""));
            cuda::force_attention_splits(splits);
            auto p = make_pair(real_config(), precise, fp8);
            std::vector<seq_twin> seqs = fresh_seqs(*p, 2);
            uint32_t seed = 7000;
            step(*p, seqs, {{0, 60}, {1, 130}}, seed, "prompts of 60 and 130 rows");
            step(*p, seqs, {{0, 8}, {1, 5}}, seed, "spans of 8 (positions 60-67) and 5 (130-134)");
            step(*p, seqs, {{0, 1}, {1, 1}}, seed, "decode tokens");
        }
}

// The GPU's FP8 cache rows, read back, against the CPU's rounding (core/fp8.h): V goes in as given, so its codes
// and scales must match bit for bit; K comes from each backend's own norm and RoPE, so a value within fp32
// noise of a rounding boundary may take the neighbouring code (TOL_K8_FLIPS).
constexpr double TOL_K8_FLIPS = 1e-3;  // fraction of K values; measured 0 .. few per 10^5

TEST(cuda_attention_prefill, fp8_cache_rows) {
    TANSY_REQUIRE_GPU();
    auto p = make_pair(real_config(), false, true);
    std::vector<seq_twin> seqs = fresh_seqs(*p, 2);
    uint32_t seed = 9000;
    step(*p, seqs, {{0, 77}, {1, 1}}, seed, "77-row prompt + token");
    step(*p, seqs, {{0, 1}, {1, 1}}, seed, "decode tokens");
    const int64_t kvd = p->m.cfg.kv_dim();
    std::vector<float> kc((size_t)kvd), vc((size_t)kvd), kg((size_t)kvd), vg((size_t)kvd);
    int64_t k_flips = 0, k_total = 0;
    for (size_t s = 0; s < seqs.size(); s++) {
        for (int64_t pos = 0; pos < seqs[s].c->n_past(); pos++) {
            p->cpu->read_kv(*seqs[s].c, 0, pos, kc.data(), vc.data());
            p->gpu->read_kv(*seqs[s].g, 0, pos, kg.data(), vg.data());
            ASSERT_EQ(vg, vc) << "sequence " << s << " row " << pos;
            const int64_t dh = p->m.cfg.head_dim;
            for (int64_t i = 0; i < kvd; i++) {
                k_flips += kg[(size_t)i] != kc[(size_t)i];
                // a flip is one E4M3 step: at most 2^-3 of the value, or one subnormal step of the row's scale
                // (twice that if the row's largest value crossed a power of two and took the next scale)
                float amax = 0;
                for (int64_t j = i / dh * dh; j < (i / dh + 1) * dh; j++) amax = std::fmax(amax, std::fabs(kc[(size_t)j]));
                const float step = std::ldexp(1.0f, kv8_scale_exp(amax) - 9);
                EXPECT_LE(std::fabs(kg[(size_t)i] - kc[(size_t)i]),
                          2.0f * std::fmax(std::fabs(kc[(size_t)i]) / 8.0f, step)) << "row " << pos << " value " << i;
            }
            k_total += kvd;
        }
    }
    printf("[ fp8 cache rows ] K values that took the neighbouring code: %lld of %lld\n", (long long)k_flips,
           (long long)k_total);
    EXPECT_LE((double)k_flips, TOL_K8_FLIPS * (double)k_total);
}

TEST(cuda_attention_prefill, fp8_cache_every_variant) {
    TANSY_REQUIRE_GPU();
    struct reset {
        ~reset() { cuda::force_attention_prefill_variant(0, 0); }
    } guard;
    auto p = make_pair(real_config(), false, true);
    for (auto [hpc, bn] : {std::pair{2, 32}, std::pair{1, 64}, std::pair{1, 32}}) {
        SCOPED_TRACE("heads per CTA " + std::to_string(hpc) + ", key tile " + std::to_string(bn));
        cuda::force_attention_prefill_variant(hpc, bn);
        check_prefill(*p);
    }
}

// The smaller variants (one query head per CTA, key tiles of 32) that GPUs with less shared memory, or odd
// query-head groups, take: forced here, since the H200 picks 2 heads x 64 keys.
TEST(cuda_attention_prefill, every_variant) {
    TANSY_REQUIRE_GPU();
    struct reset {
        ~reset() { cuda::force_attention_prefill_variant(0, 0); }
    } guard;
    auto p = make_pair(real_config());
    for (auto [hpc, bn] : {std::pair{2, 32}, std::pair{1, 64}, std::pair{1, 32}}) {
        SCOPED_TRACE("heads per CTA " + std::to_string(hpc) + ", key tile " + std::to_string(bn));
        cuda::force_attention_prefill_variant(hpc, bn);
        check_prefill(*p);
    }
}
