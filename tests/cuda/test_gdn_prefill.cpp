// The CUDA Gated DeltaNet prefill path (gdn_prefill.cu: prep, then the chunk-parallel form or the token scan,
// taken by spans of more than k_gdn_recur_max_rows rows) against the CPU backend, and its hand-over to the decode kernel: a prompt
// from an empty state, its continuation, single-token decode steps that must pick up the prefill's state and
// conv window exactly, batches mixing long and single-token spans, both sides of the routing threshold, and
// odd lengths; at the tiny fixture's shapes and the real Qwen3.6-35B-A3B ones (DeltaNet layer 0).
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cuda/gdn.cuh"
#include "op_twins.h"

using namespace tansy;
using namespace tansy::test;

namespace {

// fp32 on both sides, as TOL_FP32_OP of test_ops.cpp. The CPU evaluates spans of more than one row in the
// chunked form (MODEL.md §4.7); the GPU in the chunked form too (by default: an explicit inverse of I + L where
// the CPU substitutes, other summation orders, matrix products in 3xTF32 at ~2^-20 relative per product) or
// token by token. The CPU's two forms differ by <= 6.3e-7 on these steps; on the H200 the worst step was 1.16e-6
// (chunked) and 8.4e-7 (token scan) over the four head shapes tested, so 5e-6 is ~4x the worst seen.
// The update is a contraction: the state's error does not grow with span length.
constexpr double TOL_GDN_PREFILL = 5e-6;
// Both sides with a bf16 state (backend_options::state_bf16), rounded where a span ends and at a mark: an entry
// whose fp32 values on the two sides (~1e-7 apart) straddle a bf16 rounding boundary takes the neighbouring value
// (2^-8 relative) on one side, and later steps read it. A state ignoring the bf16 rounding on one side errs by
// ~1e-3 (2^-9 relative in every entry), so this bound still tells the two apart.
constexpr double TOL_GDN_BF16_STATE = 2e-4;
// The chunked form's long spans against the decode kernel's token-by-token steps (check_against_decode): another
// form of the math, fp32 with 3xTF32 products, one span of up to 128 rows and one step after it.
constexpr double TOL_GDN_FORMS = 2e-5;
// The token-scan prefill path against the decode kernel on the same inputs: the conv, norms and gates are
// bit-identical, only the two 128-term dot products per token are summed in another order (~1e-7 relative per
// token). The chunked form against the decode kernel is held to TOL_GDN_FORMS.
constexpr double TOL_GDN_SAME_MATH = 5e-6;

// Sequences advanced on both backends through GDN layer 0, one forward step at a time.
struct gdn_sequences {
    pair_of_backends& p;
    std::vector<std::unique_ptr<seq_state>> cpu, gpu;
    std::vector<std::unique_ptr<seq_state>> cpu_mark, gpu_mark;  // checkpoints taken at marks, by sequence
    uint32_t seed = 5000;
    gdn_mode gpu_mode;  // auto_select: the chunked form for prefill spans; recurrent: the token scan

    gdn_sequences(pair_of_backends& pb, int n, int64_t capacity, gdn_mode m) : p(pb), gpu_mode(m) {
        for (int i = 0; i < n; i++) {
            cpu.push_back(p.cpu->new_state(capacity));
            gpu.push_back(p.gpu->new_state(capacity));
        }
        cpu_mark.resize((size_t)n), gpu_mark.resize((size_t)n);
    }

    // One step over spans {(sequence, rows)} laid out in this order, marks[i] > 0: part i takes a checkpoint
    // after that many rows (into cpu_mark / gpu_mark); returns the relative error of the gated-normed output over
    // the whole batch.
    double step(const std::vector<std::pair<int, int>>& parts, const std::vector<int>& marks = {}) {
        const model_config& c = p.m.cfg;
        const gdn_weights& w = p.m.w.layers[0].gdn;
        int64_t T = 0;
        std::vector<seq_span> sc, sg;
        for (size_t i = 0; i < parts.size(); i++) {
            const auto [s, n] = parts[i];
            sc.push_back({cpu[(size_t)s].get(), T, n, cpu[(size_t)s]->n_past()});
            sg.push_back({gpu[(size_t)s].get(), T, n, gpu[(size_t)s]->n_past()});
            if (i < marks.size() && marks[i] > 0) {
                cpu_mark[(size_t)s] = p.cpu->new_state(0), gpu_mark[(size_t)s] = p.gpu->new_state(0);
                sc.back().mark_state = cpu_mark[(size_t)s].get(), sg.back().mark_state = gpu_mark[(size_t)s].get();
                sc.back().mark = sg.back().mark = marks[i];
                cpu_mark[(size_t)s]->set_n_past(sc.back().pos0 + marks[i]);
                gpu_mark[(size_t)s]->set_n_past(sg.back().pos0 + marks[i]);
            }
            T += n;
        }
        twin qkv(p, T, c.lin_conv_dim(), seed++), z(p, T, c.lin_value_dim(), seed++), b(p, T, c.lin_v_heads, seed++),
            a(p, T, c.lin_v_heads, seed++), o(p, T, c.lin_value_dim());
        p.cpu->gdn(o.c.t(), qkv.c.t(), z.c.t(), b.c.t(), a.c.t(), w, 0, sc, gdn_mode::auto_select);
        p.gpu->gdn(o.g.t(), qkv.g.t(), z.g.t(), b.g.t(), a.g.t(), w, 0, sg, gpu_mode);
        const double err = o.diff(p);
        p.cpu->end_step(sc);
        p.gpu->end_step(sg);
        for (auto [s, n] : parts) {
            cpu[(size_t)s]->set_n_past(cpu[(size_t)s]->n_past() + n);
            gpu[(size_t)s]->set_n_past(gpu[(size_t)s]->n_past() + n);
        }
        return err;
    }
};

std::string describe(const std::vector<std::pair<int, int>>& parts) {
    std::string s;
    for (auto [q, n] : parts) s += (s.empty() ? "" : " + ") + std::string(1, (char)('A' + q)) + ":" + std::to_string(n);
    return s;
}

void check_prefill(pair_of_backends& p, gdn_mode gpu_mode, double tol) {
    constexpr int A = 0, B = 1, C = 2;
    constexpr int L = cuda::k_gdn_recur_max_rows;  // longest span the decode kernel takes
    gdn_sequences seqs(p, 3, 1024, gpu_mode);
    const std::vector<std::vector<std::pair<int, int>>> steps = {
        {{A, 300}},                      // a prompt from an empty state
        {{A, 200}},                      // its continuation (state and conv window carried)
        {{A, 1}},                        // decode steps right after a prefill
        {{A, 1}},
        {{A, 1}},
        {{A, 1}, {B, L}, {C, L + 1}},    // both sides of the threshold; C starts inside a prep row tile
        {{B, 20}, {C, 21}},              // two long spans, one row tile holding the end of one and start of the other
        {{A, 129}, {B, 1}, {C, 1}},      // a long span with single-token spans of other sequences
        {{A, 33}},                       // odd length: a 1-token last chunk
        {{B, 128}},                      // a whole number of staged chunks
        {{B, 1}, {A, 1}, {C, 1}},        // the final states and conv windows, through decode
        {{A, 1}, {C, 1}, {B, 1}},
        {{C, L + 2}, {A, 1}},            // a long span after decode steps (conv window written by the decode kernel)
        {{C, 1}, {A, 1}},
        {{B, 1}, {C, 150}, {A, 70}},     // multi-chunk spans starting after row 0 (chunk blocks past a span's end)
        {{A, 1}, {B, 1}, {C, 1}},
    };
    const char* form = gpu_mode == gdn_mode::recurrent ? "token scan" : "chunked";
    double worst = 0;
    for (const auto& parts : steps) {
        const double err = seqs.step(parts);
        worst = std::max(worst, err);
        EXPECT_LT(err, tol) << "gdn step " << describe(parts) << " (" << form << ")";
    }
    printf("[ gdn prefill %s, Hk %lld Hv %lld dv %lld ] worst step error %.2e (tolerance %.0e)\n", form,
           (long long)p.m.cfg.lin_k_heads, (long long)p.m.cfg.lin_v_heads, (long long)p.m.cfg.lin_v_dim, worst, tol);
}

// Spans with a mark (seq_span::mark: a prefix-cache checkpoint taken inside the step): the outputs of the step,
// and the checkpoint restored into another sequence and continued (a prefill span, then decode steps), against
// the CPU, which takes it by running the span as two parts. Marks inside the conv window of the span's start
// (1, 2: part of the checkpoint's window comes from the old one), at and beside chunk boundaries, one row
// before the span's end; beside a decode row, after a prompt.
void check_marks(pair_of_backends& p, gdn_mode gpu_mode, double tol) {
    constexpr int A = 0, B = 1, C = 2;
    const char* form = gpu_mode == gdn_mode::recurrent ? "token scan" : "chunked";
    for (int mark : {1, 2, 3, 40, 63, 64, 65, 129}) {
        gdn_sequences seqs(p, 3, 1024, gpu_mode);
        const std::string what = std::string(form) + ", mark " + std::to_string(mark);
        EXPECT_LT(seqs.step({{A, 50}, {C, 1}}), tol) << what;
        EXPECT_LT(seqs.step({{C, 1}, {A, 130}}, {0, mark}), tol) << what << ": the marked step";
        const int64_t at = 50 + mark;
        // the restores' KV rows come from A: the CPU's grow with attention, which this layer-0 test never runs
        p.cpu->pretend_context(*seqs.cpu[A], seqs.cpu[A]->n_past());
        p.cpu->restore(*seqs.cpu[B], *seqs.cpu_mark[A], *seqs.cpu[A], at);
        p.gpu->restore(*seqs.gpu[B], *seqs.gpu_mark[A], *seqs.gpu[A], at);
        EXPECT_EQ(seqs.gpu[B]->n_past(), at);
        EXPECT_LT(seqs.step({{B, 70}, {A, 1}}), tol) << what << ": a span from the checkpoint";
        EXPECT_LT(seqs.step({{B, 1}}), tol) << what << ": decode after it";
        p.cpu->restore(*seqs.cpu[C], *seqs.cpu_mark[A], *seqs.cpu[A], at);
        p.gpu->restore(*seqs.gpu[C], *seqs.gpu_mark[A], *seqs.gpu[A], at);
        EXPECT_LT(seqs.step({{C, 1}}), tol) << what << ": decode from the checkpoint";
        EXPECT_LT(seqs.step({{C, 1}, {B, 1}}), tol) << what;
    }
}

void check_prefill_both_forms(pair_of_backends& p, double tol = TOL_GDN_PREFILL) {
    check_prefill(p, gdn_mode::auto_select, tol);
    check_prefill(p, gdn_mode::recurrent, tol);
    check_marks(p, gdn_mode::auto_select, tol);
    check_marks(p, gdn_mode::recurrent, tol);
}

// One long span through the prefill path vs the same rows one decode step at a time (the decode kernel), on
// the GPU alone; then one more decode step on both, which reads the two final states and conv windows.
void check_against_decode(pair_of_backends& p, int n, gdn_mode mode) {
    const model_config& c = p.m.cfg;
    const gdn_weights& w = p.m.w.layers[0].gdn;
    backend& be = *p.gpu;
    const int64_t C = c.lin_conv_dim(), V = c.lin_value_dim(), H = c.lin_v_heads;
    const int T = n + 1;  // the span, then one decode token
    const auto qkv = random_normal((size_t)(T * C), 71), z = random_normal((size_t)(T * V), 72),
               b = random_normal((size_t)(T * H), 73), a = random_normal((size_t)(T * H), 74);
    auto run = [&](bool prefill) {
        auto st = be.new_state(256);
        std::vector<float> out;
        auto fwd = [&](int row0, int rows) {
            buffer bq = be.alloc(rows, C, dtype::f32), bz = be.alloc(rows, V, dtype::f32);
            buffer bb = be.alloc(rows, H, dtype::f32), ba = be.alloc(rows, H, dtype::f32);
            buffer bo = be.alloc(rows, V, dtype::f32);
            be.upload(bq.t(), qkv.data() + row0 * C);
            be.upload(bz.t(), z.data() + row0 * V);
            be.upload(bb.t(), b.data() + row0 * H);
            be.upload(ba.t(), a.data() + row0 * H);
            const std::vector<seq_span> sp = {{st.get(), 0, rows, st->n_past()}};
            be.gdn(bo.t(), bq.t(), bz.t(), bb.t(), ba.t(), w, 0, sp, mode);
            be.end_step(sp);
            st->set_n_past(st->n_past() + rows);
            std::vector<float> o((size_t)(rows * V));
            be.download(o.data(), bo.t());
            out.insert(out.end(), o.begin(), o.end());
        };
        if (prefill)
            fwd(0, n);
        else
            for (int r = 0; r < n; r++) fwd(r, 1);
        fwd(n, 1);
        return out;
    };
    const std::vector<float> scan = run(true), recur = run(false);
    const size_t span_floats = (size_t)n * V;
    const double tol = mode == gdn_mode::recurrent ? TOL_GDN_SAME_MATH : TOL_GDN_FORMS;
    const char* form = mode == gdn_mode::recurrent ? " (token scan)" : " (chunked)";
    EXPECT_LT(rel_error(std::vector<float>(scan.begin(), scan.begin() + span_floats),
                        std::vector<float>(recur.begin(), recur.begin() + span_floats)),
              tol)
        << n << "-row span" << form;
    EXPECT_LT(rel_error(std::vector<float>(scan.begin() + span_floats, scan.end()),
                        std::vector<float>(recur.begin() + span_floats, recur.end())),
              tol)
        << "decode step after a " << n << "-row span" << form;
}

}  // namespace

TEST(cuda_gdn_prefill, matches_decode_kernel) {
    TANSY_REQUIRE_GPU();
    auto p = make_pair(real_config());
    for (gdn_mode mode : {gdn_mode::recurrent, gdn_mode::auto_select})
        for (int n : {cuda::k_gdn_recur_max_rows + 1, 100, 2 * cuda::k_gdn_chunk}) check_against_decode(*p, n, mode);
}

TEST(cuda_gdn_prefill, tiny_shapes) {
    TANSY_REQUIRE_GPU();
    auto p = make_pair(tiny_config());
    check_prefill_both_forms(*p);
}

// Value-to-key head ratios of 1 and 4 and narrower value heads than the fixtures' (ratio 2, dv 128), with either
// state type (dv 64 and 32 keep a bf16 state on the register form in decode).
TEST(cuda_gdn_prefill, other_head_shapes) {
    TANSY_REQUIRE_GPU();
    for (auto [hk, hv, dv] : {std::tuple<int64_t, int64_t, int64_t>{2, 2, 64}, {1, 4, 32}})
        for (bool bf16 : {false, true}) {
            model_config c = tiny_config();
            c.lin_k_heads = hk, c.lin_v_heads = hv, c.lin_v_dim = dv;
            SCOPED_TRACE("Hk " + std::to_string(hk) + " Hv " + std::to_string(hv) + " dv " + std::to_string(dv) +
                         (bf16 ? ", bf16 state" : ""));
            auto p = make_pair(c, false, false, {}, bf16);
            check_prefill_both_forms(*p, bf16 ? TOL_GDN_BF16_STATE : TOL_GDN_PREFILL);
        }
}

TEST(cuda_gdn_prefill, real_shapes) {
    TANSY_REQUIRE_GPU();
    auto p = make_pair(real_config());
    check_prefill_both_forms(*p);
}

// The bf16 state (--deltanet-state bf16) through every prefill form, marks and restores, at the real shapes; and
// its memory: half the fp32 state's bytes.
TEST(cuda_gdn_prefill, real_shapes_bf16_state) {
    TANSY_REQUIRE_GPU();
    auto p = make_pair(real_config(), false, false, {}, /*state_bf16=*/true);
    check_prefill_both_forms(*p, TOL_GDN_BF16_STATE);
    const model_config c = real_config();
    const int64_t n_gdn = c.n_layers() - c.n_full_attention();
    auto fp32 = make_pair(c);
    const size_t half = (size_t)(n_gdn * c.lin_v_heads * c.lin_k_dim * c.lin_v_dim) * 2;
    EXPECT_EQ(fp32->gpu->new_state(96)->bytes() - p->gpu->new_state(96)->bytes(), half);
}
