// Every CUDA backend op vs the CPU backend (its twin) on the same weights: random synthetic models at the tiny
// fixture's shapes and at the real Qwen3.6-35B-A3B shapes (hidden 2048, 256 experts, 16/2 heads of 256,
// DeltaNet 16/32 heads of 128), fresh random inputs, several sequences per batch, spans of 1 and many tokens.
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "backend/cuda/moe.cuh"
#include "op_twins.h"

using namespace tansy;
using namespace tansy::test;

namespace {

// Same weights, fp32 math in both; only summation order differs.
constexpr double TOL_FP32_OP = 2e-5;
// Fast mode: the GEMV/MoE inputs rounded to fp16 (2^-11 relative per value) as the fast GEMM's operands are, or
// (one row, 4-bit weights) as two-level int8 per 32 values (xq.cuh: at most max|x| / 64516 off per value).
constexpr double TOL_F16_INPUT_OP = 2e-3;
// The CUDA KV cache is bf16 (2^-8 relative per stored value), the CPU's fp32.
constexpr double TOL_ATTENTION = 1e-2;

void check_project_moe_matmul(pair_of_backends& p, double tol) {
    const model_config& c = p.m.cfg;
    const layer_weights& gl = p.m.w.layers[0];  // DeltaNet layer
    const layer_weights& al = p.m.w.layers[3];  // attention layer
    for (int T : {1, 2, 5, 8, 9, 12, 13, 16}) {  // the decode kernels' path (tensor-core GEMMs from 17 rows: test_gemm.cpp)
        twin x(p, T, c.hidden, 100 + T, 2.0f);
        twin qkv(p, T, c.lin_conv_dim()), z(p, T, c.lin_value_dim()), b(p, T, c.lin_v_heads), a(p, T, c.lin_v_heads);
        for (auto* be : {p.cpu.get(), p.gpu.get()}) {
            const bool g = be == p.gpu.get();
            auto pick = [&](twin& t) { return g ? t.g.t() : t.c.t(); };
            be->project({pick(qkv), pick(z), pick(b), pick(a)}, pick(x), vv(gl.input_norm), c.eps,
                        {&gl.gdn.in_qkv, &gl.gdn.in_z, &gl.gdn.in_b, &gl.gdn.in_a});
        }
        for (twin* t : {&qkv, &z, &b, &a}) EXPECT_LT(t->diff(p), tol) << "project T=" << T;
        twin qg(p, T, c.q_proj_rows()), k(p, T, c.kv_dim()), v(p, T, c.kv_dim());
        for (auto* be : {p.cpu.get(), p.gpu.get()}) {
            const bool g = be == p.gpu.get();
            auto pick = [&](twin& t) { return g ? t.g.t() : t.c.t(); };
            be->project({pick(qg), pick(k), pick(v)}, pick(x), vv(al.input_norm), c.eps,
                        {&al.attn.q_proj, &al.attn.k_proj, &al.attn.v_proj});
        }
        for (twin* t : {&qg, &k, &v}) EXPECT_LT(t->diff(p), tol) << "attention project T=" << T;
        // The residual matmul and the MoE each from inputs equal on both sides: chained after another op, the
        // first op's rounding (fast mode: 2^-11) reaches the router, where it can swap a token's 8th and 9th expert,
        // an O(1) change of that row that says nothing about either op.
        twin xr(p, T, c.hidden, 150 + T, 2.0f), zr(p, T, c.lin_value_dim(), 160 + T), xm(p, T, c.hidden, 170 + T, 2.0f);
        for (auto* be : {p.cpu.get(), p.gpu.get()}) {
            const bool g = be == p.gpu.get();
            auto pick = [&](twin& t) { return g ? t.g.t() : t.c.t(); };
            be->matmul(pick(xr), pick(zr), gl.gdn.out_proj, true);  // residual accumulate
            be->moe(pick(xm), vv(gl.post_norm), c.eps, gl.moe);
        }
        EXPECT_LT(xr.diff(p), tol) << "matmul accumulate T=" << T;
        EXPECT_LT(xm.diff(p), tol) << "moe T=" << T << ", " << worst_rows(p, xm);
        // the layer's tail as one op (CUDA, one fast-mode row: out_proj with the router tap, then the experts), from
        // both mixers' widths; more rows run matmul and moe, checked above
        if (T != 1) continue;
        twin y1(p, T, c.hidden, 200 + T, 2.0f), y2(p, T, c.hidden, 210 + T, 2.0f), zo(p, T, c.lin_value_dim(), 220 + T),
            ao(p, T, c.n_q_heads * c.head_dim, 300 + T);
        for (auto* be : {p.cpu.get(), p.gpu.get()}) {
            const bool g = be == p.gpu.get();
            auto pick = [&](twin& t) { return g ? t.g.t() : t.c.t(); };
            be->out_proj_moe(pick(y1), pick(zo), gl.gdn.out_proj, vv(gl.post_norm), c.eps, gl.moe);
            be->out_proj_moe(pick(y2), pick(ao), al.attn.o_proj, vv(al.post_norm), c.eps, al.moe);
        }
        EXPECT_LT(y1.diff(p), tol) << "out_proj_moe (DeltaNet out_proj) T=" << T;
        EXPECT_LT(y2.diff(p), tol) << "out_proj_moe (attention o_proj) T=" << T;
    }
}

// Two sequences advanced through several batched steps (spans of different lengths, then single tokens).
void check_mixers(pair_of_backends& p) {
    const model_config& c = p.m.cfg;
    const layer_weights& gl = p.m.w.layers[0];
    const layer_weights& al = p.m.w.layers[3];
    auto s_cpu = std::vector<std::unique_ptr<seq_state>>{}, s_gpu = std::vector<std::unique_ptr<seq_state>>{};
    for (int i = 0; i < 2; i++) s_cpu.push_back(p.cpu->new_state(256)), s_gpu.push_back(p.gpu->new_state(256));
    const std::vector<std::pair<int, int>> steps = {{7, 70}, {1, 1}, {3, 1}, {1, 65}, {1, 1}};
    uint32_t seed = 1000;
    for (auto [na, nb] : steps) {
        const int T = na + nb;
        auto spans = [&](std::vector<std::unique_ptr<seq_state>>& s) {
            return std::vector<seq_span>{{s[0].get(), 0, na, s[0]->n_past()}, {s[1].get(), na, nb, s[1]->n_past()}};
        };
        twin qkv(p, T, c.lin_conv_dim(), seed++), z(p, T, c.lin_value_dim(), seed++), b(p, T, c.lin_v_heads, seed++),
            a(p, T, c.lin_v_heads, seed++), o(p, T, c.lin_value_dim());
        twin qg(p, T, c.q_proj_rows(), seed++), k(p, T, c.kv_dim(), seed++), v(p, T, c.kv_dim(), seed++),
            ao(p, T, c.n_q_heads * c.head_dim);
        auto sc = spans(s_cpu), sg = spans(s_gpu);
        p.cpu->gdn(o.c.t(), qkv.c.t(), z.c.t(), b.c.t(), a.c.t(), gl.gdn, 0, sc, gdn_mode::auto_select);
        p.gpu->gdn(o.g.t(), qkv.g.t(), z.g.t(), b.g.t(), a.g.t(), gl.gdn, 0, sg, gdn_mode::auto_select);
        EXPECT_LT(o.diff(p), TOL_FP32_OP) << "gdn step " << na << "+" << nb;
        p.cpu->attention(ao.c.t(), qg.c.t(), k.c.t(), v.c.t(), al.attn, 0, sc);
        p.gpu->attention(ao.g.t(), qg.g.t(), k.g.t(), v.g.t(), al.attn, 0, sg);
        EXPECT_LT(ao.diff(p), TOL_ATTENTION) << "attention step " << na << "+" << nb;
        p.cpu->end_step(sc);
        p.gpu->end_step(sg);
        for (auto* s : {&s_cpu, &s_gpu}) (*s)[0]->set_n_past((*s)[0]->n_past() + na), (*s)[1]->set_n_past((*s)[1]->n_past() + nb);
    }
}

}  // namespace

// Projections and MoE with the decode kernels on CUDA cores and on tensor cores (cuda::mma_family), in both
// modes; the mixers once.
void check_ops(const model_config& cfg) {
    auto p = make_pair(cfg, /*precise_gemm=*/true);
    auto fast = make_pair(cfg);
    for (unsigned families : {0u, (unsigned)cuda::mma_all}) {
        mma_families_scope scope(families);
        SCOPED_TRACE("tensor-core families " + std::to_string(families));
        check_project_moe_matmul(*p, TOL_FP32_OP);
        check_project_moe_matmul(*fast, TOL_F16_INPUT_OP);
    }
    {
        int8_inputs_scope scope(false);  // fast mode's one-row 4-bit kernels with fp16 inputs instead of int8
        SCOPED_TRACE("int8 inputs off");
        check_project_moe_matmul(*fast, TOL_F16_INPUT_OP);
    }
    check_mixers(*p);
}

TEST(cuda_ops, tiny_shapes) {
    TANSY_REQUIRE_GPU();
    check_ops(tiny_config());
}

TEST(cuda_ops, real_shapes) {
    TANSY_REQUIRE_GPU();
    check_ops(real_config());
}

// A decode batch of 17+ sequences with the kernel plan's moe_groups and dense_groups: the MoE and the dense
// products run the decode kernels in even groups of <= 16 rows (17 = 9 + 8, 33 = 11 + 11 + 11, 50, 64, 96 = 6 x 16),
// in both modes, against the CPU. (moe_small off: fast mode would take the small-M grouped kernels instead.)
TEST(cuda_ops, decode_kernels_in_groups) {
    TANSY_REQUIRE_GPU();
    kernel_options k;
    k.moe_groups = k.dense_groups = 96;
    k.moe_small = 0;
    for (const model_config& cfg : {tiny_config(), real_config()})
        for (bool precise : {false, true}) {
            auto p = make_pair(cfg, precise, false, k);
            const model_config& c = p->m.cfg;
            const layer_weights& gl = p->m.w.layers[0];  // DeltaNet layer
            const layer_weights& al = p->m.w.layers[3];  // attention layer
            const double tol = precise ? TOL_FP32_OP : TOL_F16_INPUT_OP;
            for (int T : {17, 25, 33, 50, 64, 96}) {
                SCOPED_TRACE("hidden " + std::to_string(c.hidden) + (precise ? " precise" : " fast") + " T=" +
                             std::to_string(T));
                twin x(*p, T, c.hidden, 400 + (uint32_t)T, 2.0f), zr(*p, T, c.lin_value_dim(), 500 + (uint32_t)T, 1.0f);
                twin qkv(*p, T, c.lin_conv_dim()), z(*p, T, c.lin_value_dim()), b(*p, T, c.lin_v_heads),
                    a(*p, T, c.lin_v_heads);
                for (auto* be : {p->cpu.get(), p->gpu.get()}) {
                    const bool g = be == p->gpu.get();
                    auto pick = [&](twin& t) { return g ? t.g.t() : t.c.t(); };
                    be->project({pick(qkv), pick(z), pick(b), pick(a)}, pick(x), vv(gl.input_norm), c.eps,
                                {&gl.gdn.in_qkv, &gl.gdn.in_z, &gl.gdn.in_b, &gl.gdn.in_a});
                    be->matmul(pick(x), pick(zr), gl.gdn.out_proj, true);  // residual accumulate (inputs equal)
                }
                for (twin* t : {&qkv, &z, &b, &a}) EXPECT_LT(t->diff(*p), tol) << "project";
                EXPECT_LT(x.diff(*p), tol) << "matmul accumulate";
                // each MoE from an input equal on both sides (see check_project_moe_matmul)
                for (const layer_weights* l : {&gl, &al}) {
                    twin xm(*p, T, c.hidden, 600 + (uint32_t)T + (l == &gl ? 0u : 1000u), 2.0f);
                    p->cpu->moe(xm.c.t(), vv(l->post_norm), c.eps, l->moe);
                    p->gpu->moe(xm.g.t(), vv(l->post_norm), c.eps, l->moe);
                    EXPECT_LT(xm.diff(*p), tol) << "moe of layer " << (l == &gl ? 0 : 3) << ", " << worst_rows(*p, xm);
                }
            }
        }
}

// A decode batch of 17..256 rows on the small-M grouped MoE kernels (kernel plan moe_small, fast mode), against the
// CPU: tiles of <= 16 expert-sorted rows, mostly one or two rows per expert at 17 rows (real shapes), several tiles
// per expert when every row is the same token (all T rows on the same k experts: ceil(T / 16) tiles each, and a
// last partial one), and the shared expert's tiles; moe_small = 0 (the decode kernels in groups, or the grouped
// GEMMs) alike. moe_small_launches() shows which path each call took.
TEST(cuda_ops, moe_grouped_small_m) {
    TANSY_REQUIRE_GPU();
    for (const model_config& cfg : {tiny_config(), real_config()})
        for (int small : {256, 0}) {
            kernel_options ko;
            ko.moe_small = small;
            if (small) ko.moe_groups = 0;  // from 17 rows (by default the groups keep rows below k_moe_small_min_rows)
            auto p = make_pair(cfg, /*precise_gemm=*/false, false, ko);
            const model_config& c = p->m.cfg;
            for (const layer_weights* l : {&p->m.w.layers[0], &p->m.w.layers[3]})
                for (int T : {17, 33, 100, 255})
                    for (bool same : {false, true}) {
                        SCOPED_TRACE("hidden " + std::to_string(c.hidden) + " moe_small=" + std::to_string(small) +
                                     " layer " + (l == &p->m.w.layers[0] ? "0" : "3") + " T=" + std::to_string(T) +
                                     (same ? " (one token repeated)" : ""));
                        const uint32_t seed = 700 + (uint32_t)T + (l == &p->m.w.layers[0] ? 0u : 1000u);
                        twin xm(*p, T, c.hidden, seed, 2.0f);
                        if (same) {  // every row the same token: its k experts get all T rows
                            std::vector<float> v = random_normal((size_t)c.hidden, seed + 1, 2.0f), all;
                            for (int t = 0; t < T; t++) all.insert(all.end(), v.begin(), v.end());
                            p->cpu->upload(xm.c.t(), all.data());
                            p->gpu->upload(xm.g.t(), all.data());
                        }
                        const uint64_t n0 = cuda::moe_small_launches();
                        p->cpu->moe(xm.c.t(), vv(l->post_norm), c.eps, l->moe);
                        p->gpu->moe(xm.g.t(), vv(l->post_norm), c.eps, l->moe);
                        EXPECT_EQ(cuda::moe_small_launches() - n0, small ? 1u : 0u) << "the path taken";
                        EXPECT_LT(xm.diff(*p), TOL_F16_INPUT_OP) << worst_rows(*p, xm);
                    }
        }
}

// Skewed routing (backend_options::router_skew, Zipf-like: a CUDA-only synthetic bias the CPU twin lacks, so CUDA
// against CUDA): some experts get far more than 16 rows of a batch. The small-M grouped kernels against the decode
// kernels in groups (T <= 96) or the grouped GEMMs (T > 96), both fast mode with the same routing.
TEST(cuda_ops, moe_grouped_small_m_skewed) {
    TANSY_REQUIRE_GPU();
    for (const model_config& cfg : {tiny_config(), real_config()}) {
        auto p = make_pair(cfg);
        backend_options on, off;
        on.router_skew = off.router_skew = 1.5f;
        on.kernels.moe_small = 256, off.kernels.moe_small = 0;
        on.kernels.moe_groups = 0;  // 17 rows too
        auto a = make_backend("cuda", cfg, on), b = make_backend("cuda", cfg, off);
        a->bind(p->m);
        b->bind(p->m);
        const model_config& c = p->m.cfg;
        const layer_weights& l = p->m.w.layers[3];
        for (int T : {17, 64, 100, 256}) {
            SCOPED_TRACE("hidden " + std::to_string(c.hidden) + " T=" + std::to_string(T));
            auto v = random_normal((size_t)T * c.hidden, 900 + (uint32_t)T, 2.0f);
            buffer xa = a->alloc(T, c.hidden, dtype::f32), xb = b->alloc(T, c.hidden, dtype::f32);
            a->upload(xa.t(), v.data());
            b->upload(xb.t(), v.data());
            const uint64_t n0 = cuda::moe_small_launches();
            a->moe(xa.t(), vv(l.post_norm), c.eps, l.moe);
            EXPECT_EQ(cuda::moe_small_launches() - n0, 1u);
            b->moe(xb.t(), vv(l.post_norm), c.eps, l.moe);
            EXPECT_EQ(cuda::moe_small_launches() - n0, 1u);
            std::vector<float> ya(v.size()), yb(v.size());
            a->download(ya.data(), xa.t());
            b->download(yb.data(), xb.t());
            EXPECT_LT(rel_error(ya, yb), TOL_F16_INPUT_OP);
        }
    }
}

// The router tap at other shapes: hidden 1024 (one int8 chunk per lane), expert width 128, 40 experts top-5 and
// 300 experts top-10 (over 256: the top-k's 16-keys-per-lane form); the attention o_proj (K = 2048) takes the tap,
// the DeltaNet out_proj (K = 512) the plain GEMV and router.
TEST(cuda_ops, router_tap_other_shapes) {
    TANSY_REQUIRE_GPU();
    for (auto [experts, top_k] : {std::pair{40, 5}, std::pair{300, 10}}) {
        SCOPED_TRACE(std::to_string(experts) + " experts, top-" + std::to_string(top_k));
        model_config c = tiny_config();
        c.hidden = 1024, c.expert_inter = c.shared_inter = 128, c.n_experts = experts, c.top_k = top_k;
        auto fast = make_pair(c);
        check_project_moe_matmul(*fast, TOL_F16_INPUT_OP);
    }
}

namespace {

// Sequences advanced through batched DeltaNet steps, CPU vs CUDA: steps[i][j] is sequence j's span in step i (each
// >= 1 row; spans of more than k_gdn_recur_max_rows rows take the prefill path beside the others' decode kernel).
void check_deltanet_steps(pair_of_backends& p, const std::vector<std::vector<int>>& steps, uint32_t seed,
                          double tol = TOL_FP32_OP) {
    const model_config& c = p.m.cfg;
    const layer_weights& gl = p.m.w.layers[0];
    const size_t n = steps.at(0).size();
    std::vector<std::unique_ptr<seq_state>> s_cpu, s_gpu;
    for (size_t i = 0; i < n; i++) s_cpu.push_back(p.cpu->new_state(96)), s_gpu.push_back(p.gpu->new_state(96));
    for (const std::vector<int>& lens : steps) {
        int T = 0;
        for (int len : lens) T += len;
        auto spans = [&](std::vector<std::unique_ptr<seq_state>>& s) {
            std::vector<seq_span> out;
            for (size_t i = 0, row = 0; i < n; row += (size_t)lens[i], i++)
                out.push_back({s[i].get(), (int64_t)row, lens[i], s[i]->n_past()});
            return out;
        };
        twin qkv(p, T, c.lin_conv_dim(), seed++), z(p, T, c.lin_value_dim(), seed++), b(p, T, c.lin_v_heads, seed++),
            a(p, T, c.lin_v_heads, seed++), o(p, T, c.lin_value_dim());
        auto sc = spans(s_cpu), sg = spans(s_gpu);
        p.cpu->gdn(o.c.t(), qkv.c.t(), z.c.t(), b.c.t(), a.c.t(), gl.gdn, 0, sc, gdn_mode::auto_select);
        p.gpu->gdn(o.g.t(), qkv.g.t(), z.g.t(), b.g.t(), a.g.t(), gl.gdn, 0, sg, gdn_mode::auto_select);
        std::string what;
        for (int len : lens) what += (what.empty() ? "" : "+") + std::to_string(len);
        EXPECT_LT(o.diff(p), tol) << "gdn step " << what;
        p.cpu->end_step(sc);
        p.gpu->end_step(sg);
        for (auto* s : {&s_cpu, &s_gpu})
            for (size_t i = 0; i < n; i++) (*s)[i]->set_n_past((*s)[i]->n_past() + lens[i]);
    }
}

// The DeltaNet decode forms (gdn.cu): the state in registers (0) and staged in shared memory (1).
const int k_recur_forms[] = {0, 1};
// A bf16 state on both sides (--deltanet-state bf16): as TOL_GDN_BF16_STATE in test_gdn_prefill.cpp, an entry
// within fp32 noise of a bf16 rounding boundary rounds apart (2^-8 relative) and later steps read it; a side that
// left the state in fp32 would err by ~1e-3.
constexpr double TOL_BF16_STATE_OP = 2e-4;

}  // namespace

// The DeltaNet decode recurrence at other conv kernels than the models' 4: K - 1 <= 3 keeps the new conv window on
// chip (2, 3), more reads it back at the end (5). Two sequences through decode-sized spans only (the prompt path,
// gdn_prefill, takes K = 4 alone): spans shorter and longer than the window, then single tokens; every form.
TEST(cuda_ops, deltanet_conv_kernels) {
    TANSY_REQUIRE_GPU();
    for (int K : {2, 3, 5}) {
        model_config c = tiny_config();
        c.conv_kernel = K;
        auto p = make_pair(c, /*precise_gemm=*/true);
        for (int form : k_recur_forms) {
            SCOPED_TRACE("conv kernel " + std::to_string(K) + ", form " + std::to_string(form));
            deltanet_recur_scope scope(form);
            check_deltanet_steps(*p, {{1, 2}, {1, 1}, {6, 1}, {1, 16}, {2, 1}, {1, 1}}, 3000);
        }
    }
}

// Every decode form on batches of several sequences at the tiny and the real shapes (32 value heads of 128 over 16
// key heads): odd span lengths up to k_gdn_recur_max_rows, single tokens, and a long span beside short ones (the
// prefill path takes it; the decode kernel skips it).
TEST(cuda_ops, deltanet_decode_forms) {
    TANSY_REQUIRE_GPU();
    for (const model_config& c : {tiny_config(), real_config()}) {
        auto p = make_pair(c, /*precise_gemm=*/true);
        for (int form : k_recur_forms) {
            SCOPED_TRACE("hidden " + std::to_string(c.hidden) + ", form " + std::to_string(form));
            deltanet_recur_scope scope(form);
            check_deltanet_steps(*p, {{3, 1, 16, 5, 1}, {1, 1, 1, 1, 1}, {1, 20, 1, 2, 1}, {7, 1, 1, 1, 9}, {1, 1, 1, 1, 1}},
                                 4000 + (uint32_t)form);
        }
    }
}

// The decode forms with a bf16 state (each form loads it, widens it or keeps it bf16 on chip, stores it rounded),
// at the tiny and the real shapes: batches of odd spans, single tokens (the bf16-on-chip form), and a long span
// taking the prefill path beside them.
TEST(cuda_ops, deltanet_decode_forms_bf16_state) {
    TANSY_REQUIRE_GPU();
    for (const model_config& c : {tiny_config(), real_config()}) {
        auto p = make_pair(c, /*precise_gemm=*/true, false, {}, /*state_bf16=*/true);
        for (int form : k_recur_forms) {
            SCOPED_TRACE("hidden " + std::to_string(c.hidden) + ", form " + std::to_string(form));
            deltanet_recur_scope scope(form);
            check_deltanet_steps(*p, {{3, 1, 16, 5, 1}, {1, 1, 1, 1, 1}, {1, 20, 1, 2, 1}, {7, 1, 1, 1, 9}, {1, 1, 1, 1, 1},
                                      {1, 1, 1, 1, 1}, {1, 1, 1, 1, 1}},
                                 4100 + (uint32_t)form, TOL_BF16_STATE_OP);
        }
    }
}

TEST(cuda_ops, embed_and_argmax) {
    TANSY_REQUIRE_GPU();
    auto p = make_pair(tiny_config());
    std::vector<int32_t> ids = {0, 5, 4095, 77, 1234};
    const int T = (int)ids.size();
    buffer ic = p->cpu->alloc(T, 1, dtype::i32), ig = p->gpu->alloc(T, 1, dtype::i32);
    p->cpu->upload(ic.t(), ids.data());
    p->gpu->upload(ig.t(), ids.data());
    twin x(*p, T, p->m.cfg.hidden);
    p->cpu->embed(x.c.t(), ic.t(), p->m.w.embed);
    p->gpu->embed(x.g.t(), ig.t(), p->m.w.embed);
    EXPECT_LT(x.diff(*p), 1e-7);
    twin l(*p, 3, 4096, 55);
    p->cpu->argmax(ic.t().rows_view(0, 3), l.c.t(), 4000);
    p->gpu->argmax(ig.t().rows_view(0, 3), l.g.t(), 4000);
    std::vector<int32_t> a(3), b(3);
    p->cpu->download(a.data(), ic.t().rows_view(0, 3));
    p->gpu->download(b.data(), ig.t().rows_view(0, 3));
    EXPECT_EQ(a, b);
    for (int32_t v : b) EXPECT_LT(v, 4000);
}
