#include "model/forward.h"

#include <algorithm>

#include "core/check.h"

namespace tansy {

forward_pass::forward_pass(backend& be, const model& m) : be_(be), m_(m) {
    int n_attn = 0, n_gdn = 0;
    for (const layer_weights& l : m.w.layers)
        slot_.push_back(l.kind == layer_kind::full_attention ? n_attn++ : n_gdn++);
}

void forward_pass::reserve(int64_t T, int64_t n_logit_rows) {
    const model_config& c = m_.cfg;
    const dtype at = be_.act_type();
    if (T > cap_) {
        cap_ = T;
        epoch_++;
        x_ = be_.alloc(T, c.hidden, at);
        a_ = be_.alloc(T, c.hidden, at);
        if (c.n_full_attention() > 0) {
            qg_ = be_.alloc(T, c.q_proj_rows(), at);
            k_ = be_.alloc(T, c.kv_dim(), at);
            v_ = be_.alloc(T, c.kv_dim(), at);
            attn_ = be_.alloc(T, c.n_q_heads * c.head_dim, at);
        }
        if (c.n_full_attention() < c.n_layers()) {
            qkv_ = be_.alloc(T, c.lin_conv_dim(), at);
            z_ = be_.alloc(T, c.lin_value_dim(), at);
            b_ = be_.alloc(T, c.lin_v_heads, at);
            gate_a_ = be_.alloc(T, c.lin_v_heads, at);
            gdn_out_ = be_.alloc(T, c.lin_value_dim(), at);
        }
    }
    if (n_logit_rows > cap_logits_) {
        cap_logits_ = n_logit_rows;
        epoch_++;
        sel_ = be_.alloc(n_logit_rows, c.hidden, at);
        logits_ = be_.alloc(n_logit_rows, c.vocab, dtype::f32);
    }
}

static vec_view vv(const std::vector<float>& v) { return {v.data(), (int64_t)v.size()}; }

void check_one_span_per_state(const std::vector<seq_span>& spans) {
    std::vector<const seq_state*> states;
    states.reserve(2 * spans.size());
    for (const seq_span& s : spans) {
        states.push_back(s.state);
        if (s.mark_state) states.push_back(s.mark_state);
    }
    std::sort(states.begin(), states.end());
    TANSY_CHECK(std::adjacent_find(states.begin(), states.end()) == states.end(),
                "a sequence state in two spans of one step (or as a mark's checkpoint)");
}

tensor forward_pass::run(const tensor& ids, const std::vector<seq_span>& spans, logits_rows which) {
    const model_config& c = m_.cfg;
    const model_weights& W = m_.w;
    const int64_t T = ids.rows;
    TANSY_CHECK(T > 0, "empty batch");
    int64_t covered = 0;
    for (const seq_span& s : spans) {
        TANSY_CHECK(s.row0 == covered && s.n > 0, "spans must tile the batch in order");
        TANSY_CHECK(s.pos0 == s.state->n_past(), "span pos0 %lld != state n_past %lld", (long long)s.pos0,
                    (long long)s.state->n_past());
        if (s.pos0 + s.n > s.state->capacity())
            fail("sequence of %lld tokens exceeds the context capacity of %lld", (long long)(s.pos0 + s.n),
                 (long long)s.state->capacity());
        TANSY_CHECK(mark_allowed(s), "a span of %lld rows marked at %lld", (long long)s.n, (long long)s.mark);
        covered += s.n;
    }
    TANSY_CHECK(covered == T, "spans cover %lld of %lld rows", (long long)covered, (long long)T);
    check_one_span_per_state(spans);
    const int64_t n_logits = which == logits_rows::all ? T : which == logits_rows::last ? (int64_t)spans.size() : 0;
    reserve(T, n_logits);

    auto rows = [T](const buffer& b) { return b.t().rows_view(0, T); };
    const tensor x = rows(x_), a = rows(a_);

    be_.embed(x, ids, W.embed);
    if (tap) tap("embed", -1, x);
    for (size_t i = 0; i < W.layers.size(); i++) {
        const layer_weights& l = W.layers[i];
        if (l.kind == layer_kind::full_attention) {
            const tensor qg = rows(qg_), k = rows(k_), v = rows(v_), o = rows(attn_);
            be_.project({qg, k, v}, x, vv(l.input_norm), c.eps, {&l.attn.q_proj, &l.attn.k_proj, &l.attn.v_proj});
            be_.attention(o, qg, k, v, l.attn, slot_[i], spans);
            be_.out_proj_moe(x, o, l.attn.o_proj, vv(l.post_norm), c.eps, l.moe);
        } else {
            const tensor qkv = rows(qkv_), z = rows(z_), b = rows(b_), ga = rows(gate_a_), o = rows(gdn_out_);
            be_.project({qkv, z, b, ga}, x, vv(l.input_norm), c.eps,
                        {&l.gdn.in_qkv, &l.gdn.in_z, &l.gdn.in_b, &l.gdn.in_a});
            be_.gdn(o, qkv, z, b, ga, l.gdn, slot_[i], spans, gdn);
            be_.out_proj_moe(x, o, l.gdn.out_proj, vv(l.post_norm), c.eps, l.moe);
        }
        if (tap) tap("layer", (int)i, x);
    }
    be_.end_step(spans);
    for (const seq_span& s : spans) {
        s.state->set_n_past(s.pos0 + s.n);
        if (s.mark_state) s.mark_state->set_n_past(s.pos0 + s.mark);
    }
    if (which == logits_rows::none) return {};

    tensor h = x;
    if (which == logits_rows::last) {
        std::vector<int64_t> last;
        bool in_place = true;  // every span one row (a decode step): the rows are x's own, in order
        for (const seq_span& s : spans) {
            in_place = in_place && s.row0 + s.n - 1 == (int64_t)last.size();
            last.push_back(s.row0 + s.n - 1);
        }
        if (in_place) {
            h = x.rows_view(0, n_logits);
        } else {
            h = sel_.t().rows_view(0, n_logits);
            be_.gather_rows(h, x, last);
        }
    }
    const tensor logits = logits_.t().rows_view(0, n_logits);
    if (tap) {
        const tensor hn = a.rows_view(0, n_logits);
        be_.rms_norm(hn, h, vv(W.final_norm), c.eps);
        tap("final_norm", -1, hn);
        be_.matmul(logits, hn, W.lm_head);
    } else {  // the norm inside lm_head's projection (one launch less a step on a GPU; with a tap, the logits
              // come from the two ops above instead: equal up to rounding on the GPU, bit-equal on the CPU)
        be_.project({logits}, h, vv(W.final_norm), c.eps, {&W.lm_head});
    }
    return logits;
}

tensor forward_pass::prefill(const tensor& ids, seq_state& st, logits_rows which, const chunk_fn& on_chunk,
                             const span_mark& mark) {
    TANSY_CHECK(prefill_chunk >= 1, "prefill_chunk %lld", (long long)prefill_chunk);
    TANSY_CHECK(which != logits_rows::all || on_chunk, "prefill with logits_rows::all needs on_chunk");
    const int64_t T = ids.rows;
    TANSY_CHECK(T > 0, "empty prompt");
    // checked here as well as in run(): a prompt that does not fit must fail before its first chunk changes st
    if (st.n_past() + T > st.capacity())
        fail("sequence of %lld tokens exceeds the context capacity of %lld", (long long)(st.n_past() + T),
             (long long)st.capacity());
    if (mark.state) {  // checked before any chunk changes st: the chunk holding the mark must be able to carry it
        const int64_t r0 = mark.at / prefill_chunk * prefill_chunk, n = std::min(prefill_chunk, T - r0);
        if (mark.at <= 0 || mark.at >= T || mark.at == r0 || n < k_marked_span_min_rows)
            fail("prefill: a mark at row %lld of %lld (chunks of %lld rows; it must fall inside one of at least %lld)",
                 (long long)mark.at, (long long)T, (long long)prefill_chunk, (long long)k_marked_span_min_rows);
    }
    tensor logits;
    for (int64_t r0 = 0; r0 < T; r0 += prefill_chunk) {
        const int64_t n = std::min(prefill_chunk, T - r0);
        const bool final_chunk = r0 + n == T;
        const logits_rows w = final_chunk || which == logits_rows::all ? which : logits_rows::none;
        const bool marked = mark.state && mark.at > r0 && mark.at < r0 + n;
        logits = run(ids.rows_view(r0, n),
                     {seq_span{&st, 0, n, st.n_past(), marked ? mark.state : nullptr, marked ? mark.at - r0 : 0}}, w);
        if (which == logits_rows::all) on_chunk(logits, r0);
    }
    return logits;
}

std::vector<float> forward_pass::run_host(const std::vector<int32_t>& ids, seq_state& st, logits_rows which,
                                          const span_mark& mark) {
    const int64_t T = (int64_t)ids.size();
    TANSY_CHECK(T > 0, "empty batch");
    if (!host_ids_ || host_ids_.t().rows < T) host_ids_ = be_.alloc(T, 1, dtype::i32);
    const tensor idt = host_ids_.t().rows_view(0, T);
    be_.upload(idt, ids.data());
    std::vector<float> out;
    auto take = [&](const tensor& lg, int64_t) {
        const size_t at = out.size();
        out.resize(at + (size_t)lg.numel());
        if (lg.numel()) be_.download(out.data() + at, lg);
    };
    const tensor lg = prefill(idt, st, which, take, mark);
    if (which != logits_rows::all) take(lg, 0);
    return out;
}

}  // namespace tansy
