// The CPU backend: fp32 activations, the reference every other backend is checked against.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "core/check.h"
#include "core/fp8.h"
#include "sampling/sampler.h"
#include "sampling/sampler_math.h"

namespace tansy {

namespace {

struct cpu_state final : seq_state {
    // per full-attention layer: K (after norm + RoPE) and V (raw), [n_past, Hkv*dh], grown on demand
    std::vector<std::vector<float>> k, v;
    // per DeltaNet layer: conv tail [(K-1), C] and recurrent state S [Hv, dk, dv]
    std::vector<std::vector<float>> conv, S;

    std::unique_ptr<seq_state> clone() const override { return std::make_unique<cpu_state>(*this); }
    size_t bytes() const override {
        size_t n = 0;
        for (auto* group : {&k, &v, &conv, &S})
            for (const auto& x : *group) n += x.capacity() * sizeof(float);
        return n;
    }
    void reset() override {
        n_past_ = 0;
        for (auto* group : {&conv, &S})
            for (auto& x : *group) std::fill(x.begin(), x.end(), 0.0f);
        for (auto* group : {&k, &v})
            for (auto& x : *group) x.clear();
    }
    void set_capacity(int64_t c) { capacity_ = c; }
};

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x * sigmoid(x); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold

float* f32(const tensor& t) {
    TANSY_CHECK(t.type == dtype::f32, "cpu backend expects f32 activations, got %s", dtype_name(t.type));
    return (float*)t.data;
}

class cpu_backend final : public backend {
  public:
    cpu_backend(const model_config& cfg, const backend_options& opt)
        : cfg_(cfg), kv_fp8_(opt.kv_fp8), state_bf16_(opt.state_bf16) {}
    const char* name() const override { return "cpu"; }
    std::string kernel_summary(const char*) const override {
        return "cpu: fp32 reference (plain loops, OpenMP), one form of each op; --kernels does not apply";
    }
    dtype act_type() const override { return dtype::f32; }
    void bind(const model& m) override {
        if (m.synthetic) fail("the cpu backend needs host weights; build the synthetic model with materialize=true");
    }

    buffer alloc(int64_t rows, int64_t cols, dtype t) override {
        size_t bytes = (size_t)rows * (size_t)cols * dtype_size(t);
        size_t padded = (bytes + 63) / 64 * 64;
        void* p = std::aligned_alloc(64, padded ? padded : 64);
        TANSY_CHECK(p, "out of host memory allocating %zu bytes", bytes);
        memset(p, 0, padded ? padded : 64);
        return buffer(tensor{p, t, rows, cols}, std::shared_ptr<void>(p, std::free));
    }
    void upload(const tensor& dst, const void* src) override { memcpy(dst.data, src, dst.bytes()); }
    void download(void* dst, const tensor& src) override { memcpy(dst, src.data, src.bytes()); }

    std::unique_ptr<seq_state> new_state(int64_t capacity) override {
        auto s = std::make_unique<cpu_state>();
        s->set_capacity(capacity);
        const model_config& c = cfg_;
        for (layer_kind kind : c.layers) {
            if (kind == layer_kind::full_attention) {
                s->k.emplace_back();
                s->v.emplace_back();
            } else {
                s->conv.emplace_back((size_t)((c.conv_kernel - 1) * c.lin_conv_dim()), 0.0f);
                s->S.emplace_back((size_t)(c.lin_v_heads * c.lin_k_dim * c.lin_v_dim), 0.0f);
            }
        }
        return s;
    }

    void embed(const tensor& out, const tensor& ids, const matrix& table) override {
        const int32_t* id = (const int32_t*)ids.data;
        float* o = f32(out);
        for (int64_t t = 0; t < out.rows; t++) {
            if (id[t] < 0 || id[t] >= table.rows)
                fail("token id %d is outside the vocabulary [0, %lld)", id[t], (long long)table.rows);
            table.row_f32(id[t], o + t * out.cols);
        }
    }

    void rms_norm(const tensor& out, const tensor& in, vec_view w, float eps) override {
        TANSY_CHECK(w.n == in.cols && out.cols == in.cols && out.rows == in.rows, "rms_norm shapes");
        cpu::rms_norm(f32(out), f32(in), in.rows, in.cols, w.data, eps);
    }

    void matmul(const tensor& out, const tensor& in, const matrix& W, bool accumulate) override {
        TANSY_CHECK(in.cols == W.cols && out.cols == W.rows && out.rows == in.rows,
                    "matmul %s: in [%lld, %lld] out [%lld, %lld] W [%lld, %lld]", W.name.c_str(), (long long)in.rows,
                    (long long)in.cols, (long long)out.rows, (long long)out.cols, (long long)W.rows,
                    (long long)W.cols);
        if (!accumulate) return cpu::matmul(f32(out), f32(in), in.rows, W);
        std::vector<float> tmp((size_t)out.numel());
        cpu::matmul(tmp.data(), f32(in), in.rows, W);
        float* o = f32(out);
        for (int64_t i = 0; i < out.numel(); i++) o[i] += tmp[(size_t)i];
    }

    void project(const std::vector<tensor>& outs, const tensor& x, vec_view norm, float eps,
                 const std::vector<const matrix*>& Ws) override {
        TANSY_CHECK(outs.size() == Ws.size() && norm.n == x.cols, "project: %zu outputs, %zu weights", outs.size(),
                    Ws.size());
        std::vector<float> a((size_t)x.numel());
        cpu::rms_norm(a.data(), f32(x), x.rows, x.cols, norm.data, eps);
        for (size_t i = 0; i < Ws.size(); i++) {
            TANSY_CHECK(Ws[i]->cols == x.cols && outs[i].cols == Ws[i]->rows && outs[i].rows == x.rows,
                        "project %s shapes", Ws[i]->name.c_str());
            cpu::matmul(f32(outs[i]), a.data(), x.rows, *Ws[i]);
        }
    }

    void gather_rows(const tensor& out, const tensor& in, const std::vector<int64_t>& rows) override {
        TANSY_CHECK(out.rows == (int64_t)rows.size() && out.cols == in.cols, "gather_rows shapes");
        for (size_t i = 0; i < rows.size(); i++)
            memcpy(f32(out) + i * out.cols, f32(in) + rows[i] * in.cols, sizeof(float) * in.cols);
    }

    void argmax(const tensor& ids_out, const tensor& logits, int64_t n_valid) override {
        for (int64_t r = 0; r < logits.rows; r++)
            ((int32_t*)ids_out.data)[r] = tansy::argmax(f32(logits) + r * logits.cols, std::min(n_valid, logits.cols));
    }

    void sample_rows(const tensor& ids_out, const tensor& logits, int64_t n_valid, const tensor& params,
                     const tensor& rng, const tensor& row_slot) override {
        TANSY_CHECK(params.cols == k_row_sampling_cols && params.type == dtype::f32 && rng.cols == 2 &&
                        rng.rows == params.rows && row_slot.rows >= logits.rows && ids_out.rows >= logits.rows,
                    "sample_rows shapes");
        const int64_t nv = std::min(n_valid, logits.cols);
        const int32_t* slots = (const int32_t*)row_slot.data;
        for (int64_t r = 0; r < logits.rows; r++) {
            const int32_t s = slots[r];
            TANSY_CHECK(s >= 0 && s < params.rows, "sample_rows: slot %d of %lld", s, (long long)params.rows);
            const float* a = f32(params) + s * k_row_sampling_cols;
            sampling_params p;
            p.temperature = a[0], p.top_k = (int)a[1], p.top_p = a[2], p.min_p = a[3];
            if (!row_samples_on_device(p, nv)) continue;  // the argmax already in ids_out stands
            uint64_t* st = (uint64_t*)rng.data + s;
            sampler smp(p, nv);
            smp.set_rng_state(*st);
            ((int32_t*)ids_out.data)[r] = smp.sample(f32(logits) + r * logits.cols, nv);
            *st = smp.rng_state();
        }
    }
    void adjust_logits(const tensor& logits, int64_t n_valid, const tensor& row_slot, const tensor& pen,
                       const tensor& counts, const tensor& bias, const tensor& mask) override {
        TANSY_CHECK(pen.cols == k_adjust_cols && pen.type == dtype::f32 && bias.rows == pen.rows &&
                        bias.cols == 2 * k_device_max_bias && row_slot.rows >= logits.rows &&
                        (!counts.data || (counts.type == dtype::i32 && counts.rows == pen.rows)) &&
                        (!mask.data || (mask.rows == pen.rows && mask.cols >= mask_words(std::min(n_valid, logits.cols)))),
                    "adjust_logits shapes");
        const int64_t nv = std::min(n_valid, logits.cols);
        for (int64_t r = 0; r < logits.rows; r++) {
            const int32_t s = ((const int32_t*)row_slot.data)[r];
            TANSY_CHECK(s >= 0 && s < pen.rows, "adjust_logits: slot %d of %lld", s, (long long)pen.rows);
            const float* a = f32(pen) + s * k_adjust_cols;
            float* x = f32(logits) + r * logits.cols;
            if (a[3] != 0.0f) {
                TANSY_CHECK(counts.data, "adjust_logits: penalties without counts");
                const int32_t* c = (const int32_t*)counts.data + s * counts.cols;
                for (int64_t v = 0; v < std::min(nv, counts.cols); v++) {
                    if (c[v] == 0) continue;
                    const int32_t n = c[v] & (k_count_prompt_bit - 1);
                    if (n > 0) x[v] = sampling_math::presence_frequency(x[v], n, a[0], a[1]);
                    if (a[2] != 1.0f) x[v] = sampling_math::repetition(x[v], a[2]);
                }
                const int32_t* b = (const int32_t*)bias.data + s * bias.cols;
                for (int64_t i = 0; i < (int64_t)a[4]; i++) {
                    const int32_t id = b[2 * i];
                    float add;
                    memcpy(&add, &b[2 * i + 1], sizeof add);
                    if (id >= 0 && id < nv) x[id] += add;
                }
            }
            if (a[5] != 0.0f) {
                TANSY_CHECK(mask.data, "adjust_logits: a masked slot without masks");
                const uint32_t* m = (const uint32_t*)mask.data + s * mask.cols;
                for (int64_t v = 0; v < nv; v++)
                    if (!((m[v / 32] >> (v % 32)) & 1u)) x[v] = -std::numeric_limits<float>::infinity();
            }
        }
    }
    void count_picks(const tensor& counts, const tensor& ids, const tensor& row_slot, const tensor& pen) override {
        for (int64_t r = 0; r < ids.rows; r++) {
            const int32_t s = ((const int32_t*)row_slot.data)[r], id = ((const int32_t*)ids.data)[r];
            TANSY_CHECK(s >= 0 && s < pen.rows, "count_picks: slot %d of %lld", s, (long long)pen.rows);
            if (f32(pen)[s * k_adjust_cols + 3] == 0.0f || id < 0 || id >= counts.cols) continue;
            int32_t& c = ((int32_t*)counts.data)[s * counts.cols + id];
            if ((c & (k_count_prompt_bit - 1)) < k_count_prompt_bit - 1) c++;
        }
    }
    void logprob_rows(const tensor& records, const tensor& logits, int64_t n_valid, const tensor& ids,
                      const tensor& row_slot, const tensor& top) override {
        TANSY_CHECK(records.cols == k_logprob_words && records.type == dtype::i32 && records.rows >= logits.rows &&
                        ids.rows >= logits.rows && row_slot.rows >= logits.rows && top.type == dtype::i32,
                    "logprob_rows shapes");
        const int64_t nv = std::min(n_valid, logits.cols);
        for (int64_t r = 0; r < logits.rows; r++) {
            const int32_t s = ((const int32_t*)row_slot.data)[r];
            TANSY_CHECK(s >= 0 && s < top.rows, "logprob_rows: slot %d of %lld", s, (long long)top.rows);
            const int32_t n = ((const int32_t*)top.data)[s];
            if (n < 0) continue;
            cpu::logprob_record((int32_t*)records.data + r * k_logprob_words, f32(logits) + r * logits.cols, nv,
                                ((const int32_t*)ids.data)[r], n);
        }
    }
    void copy(const tensor& dst, const tensor& src) override {
        TANSY_CHECK(dst.bytes() == src.bytes() && dst.type == src.type, "copy: %zu bytes into %zu", src.bytes(),
                    dst.bytes());
        memcpy(dst.data, src.data, src.bytes());
    }
    void gather_slots(const tensor& out, const tensor& vals, const tensor& row_slot) override {
        for (int64_t r = 0; r < out.rows; r++) {
            const int32_t s = ((const int32_t*)row_slot.data)[r];
            TANSY_CHECK(s >= 0 && s < vals.rows, "gather_slots: slot %d of %lld", s, (long long)vals.rows);
            ((int32_t*)out.data)[r] = ((const int32_t*)vals.data)[s];
        }
    }
    void scatter_slots(const tensor& vals, const tensor& in, const tensor& row_slot) override {
        for (int64_t r = 0; r < in.rows; r++) {
            const int32_t s = ((const int32_t*)row_slot.data)[r];
            TANSY_CHECK(s >= 0 && s < vals.rows, "scatter_slots: slot %d of %lld", s, (long long)vals.rows);
            ((int32_t*)vals.data)[s] = ((const int32_t*)in.data)[r];
        }
    }

    void read_kv(const seq_state& st, int slot, int64_t pos, float* k, float* v) override {
        const auto& s = static_cast<const cpu_state&>(st);
        const int64_t kvd = cfg_.kv_dim();
        TANSY_CHECK(slot >= 0 && (size_t)slot < s.k.size() && (pos + 1) * kvd <= (int64_t)s.k[(size_t)slot].size(),
                    "read_kv: layer %d row %lld", slot, (long long)pos);
        memcpy(k, s.k[(size_t)slot].data() + pos * kvd, sizeof(float) * kvd);
        memcpy(v, s.v[(size_t)slot].data() + pos * kvd, sizeof(float) * kvd);
    }

    std::unique_ptr<seq_state> snapshot(const seq_state& st, int64_t kv_rows) override {
        const auto& s = static_cast<const cpu_state&>(st);
        const size_t n = (size_t)(kv_rows * cfg_.kv_dim());
        TANSY_CHECK(kv_rows >= 0 && kv_rows <= s.n_past(), "snapshot: %lld KV rows of a state at %lld",
                    (long long)kv_rows, (long long)s.n_past());
        auto c = std::make_unique<cpu_state>();
        c->set_capacity(kv_rows);
        c->set_n_past(s.n_past());
        for (size_t l = 0; l < s.k.size(); l++) {
            TANSY_CHECK(s.k[l].size() >= n, "snapshot: layer %zu holds %zu floats of KV, %zu needed", l, s.k[l].size(), n);
            c->k.emplace_back(s.k[l].begin(), s.k[l].begin() + (ptrdiff_t)n);
            c->v.emplace_back(s.v[l].begin(), s.v[l].begin() + (ptrdiff_t)n);
        }
        c->conv = s.conv;
        c->S = s.S;
        return c;
    }
    void restore(seq_state& dst, const seq_state& rec, const seq_state& kv, int64_t n) override {
        auto& d = static_cast<cpu_state&>(dst);
        const auto &r = static_cast<const cpu_state&>(rec), &k = static_cast<const cpu_state&>(kv);
        const size_t m = (size_t)(n * cfg_.kv_dim());
        TANSY_CHECK(rec.n_past() == n && n <= dst.capacity(), "restore: %lld tokens from a checkpoint at %lld into capacity %lld",
                    (long long)n, (long long)rec.n_past(), (long long)dst.capacity());
        for (size_t l = 0; l < d.k.size(); l++) {
            TANSY_CHECK(k.k[l].size() >= m, "restore: layer %zu holds %zu floats of KV, %zu needed", l, k.k[l].size(), m);
            d.k[l].assign(k.k[l].begin(), k.k[l].begin() + (ptrdiff_t)m);
            d.v[l].assign(k.v[l].begin(), k.v[l].begin() + (ptrdiff_t)m);
        }
        d.conv = r.conv;
        d.S = r.S;
        d.set_n_past(n);
    }

    void pretend_context(seq_state& st, int64_t n) override {
        auto& s = static_cast<cpu_state&>(st);
        const int64_t kvd = cfg_.kv_dim();
        for (auto* group : {&s.k, &s.v})
            for (auto& x : *group) x.assign((size_t)(n * kvd), 0.0f);
        s.set_n_past(n);
    }

    void attention(const tensor& out, const tensor& qg, const tensor& k, const tensor& v, const attn_weights& w,
                   int slot, const std::vector<seq_span>& spans) override;
    void gdn(const tensor& out, const tensor& qkv, const tensor& z, const tensor& b, const tensor& a,
             const gdn_weights& w, int slot, const std::vector<seq_span>& spans, gdn_mode mode) override;
    void moe(const tensor& x, vec_view norm, float eps, const moe_weights& w) override;

  private:
    model_config cfg_;
    bool kv_fp8_ = false;  // the cache holds K and V as the FP8 cache would (core/fp8.h)
    bool state_bf16_ = false;  // the DeltaNet state holds what a bf16 state would (rounded after each span part)
};

// MODEL.md §3. Per span: norm + rotate the new keys, append to the cache, then every (row, head) attends
// over cache positions [0, pos] in parallel.
void cpu_backend::attention(const tensor& out, const tensor& qg, const tensor& k, const tensor& v,
                            const attn_weights& w, int slot, const std::vector<seq_span>& spans) {
    const model_config& c = cfg_;
    const int64_t Hq = c.n_q_heads, Hkv = c.n_kv_heads, dh = c.head_dim, kvd = Hkv * dh, group = Hq / Hkv;
    const float scale = 1.0f / std::sqrt((float)dh);
    float* kp = f32(k);
    const float* vp = f32(v);
    for (const seq_span& s : spans) {
        auto* st = static_cast<cpu_state*>(s.state);
        std::vector<float>&K = st->k[(size_t)slot], &V = st->v[(size_t)slot];
        const size_t need = (size_t)((s.pos0 + s.n) * kvd);
        K.resize(need);
        V.resize(need);
        for (int64_t r = 0; r < s.n; r++) {
            float* kr = kp + (s.row0 + r) * kvd;
            for (int64_t h = 0; h < Hkv; h++) {
                cpu::rms_norm(kr + h * dh, kr + h * dh, 1, dh, w.k_norm.data(), c.eps);
                cpu::rope_neox(kr + h * dh, c.rope_dim, s.pos0 + r, c.rope_theta);
            }
            float* kc = &K[(size_t)((s.pos0 + r) * kvd)];
            float* vc = &V[(size_t)((s.pos0 + r) * kvd)];
            memcpy(kc, kr, sizeof(float) * kvd);
            memcpy(vc, vp + (s.row0 + r) * kvd, sizeof(float) * kvd);
            if (kv_fp8_)
                for (int64_t h = 0; h < Hkv; h++) kv8_round(kc + h * dh, dh), kv8_round(vc + h * dh, dh);
        }
    }
    const float* qgp = f32(qg);
    float* op = f32(out);
    for (const seq_span& s : spans) {
        auto* st = static_cast<cpu_state*>(s.state);
        const float* K = st->k[(size_t)slot].data();
        const float* V = st->v[(size_t)slot].data();
#pragma omp parallel
        {
            std::vector<float> q((size_t)dh), sc((size_t)(s.pos0 + s.n)), o((size_t)dh);
#pragma omp for schedule(dynamic) collapse(2)
            for (int64_t r = 0; r < s.n; r++) {
                for (int64_t h = 0; h < Hq; h++) {
                    const int64_t row = s.row0 + r, pos = s.pos0 + r, kvh = h / group;
                    const float* qh = qgp + row * 2 * Hq * dh + h * 2 * dh;  // [query dh | gate dh]
                    const float* gate = qh + dh;
                    cpu::rms_norm(q.data(), qh, 1, dh, w.q_norm.data(), c.eps);
                    cpu::rope_neox(q.data(), c.rope_dim, pos, c.rope_theta);
                    float mx = -INFINITY;
                    for (int64_t j = 0; j <= pos; j++) {
                        sc[j] = cpu::dot(q.data(), K + j * kvd + kvh * dh, dh) * scale;
                        mx = std::max(mx, sc[j]);
                    }
                    float sum = 0;
                    for (int64_t j = 0; j <= pos; j++) sum += sc[j] = std::exp(sc[j] - mx);
                    std::fill(o.begin(), o.end(), 0.0f);
                    for (int64_t j = 0; j <= pos; j++) {
                        const float p = sc[j] / sum;
                        const float* vj = V + j * kvd + kvh * dh;
                        for (int64_t i = 0; i < dh; i++) o[i] += p * vj[i];
                    }
                    float* orow = op + row * Hq * dh + h * dh;
                    for (int64_t i = 0; i < dh; i++) orow[i] = o[i] * sigmoid(gate[i]);
                }
            }
        }
    }
}

// MODEL.md §4.
void cpu_backend::gdn(const tensor& out, const tensor& qkv, const tensor& z, const tensor& b, const tensor& a,
                      const gdn_weights& w, int slot, const std::vector<seq_span>& spans, gdn_mode mode) {
    const model_config& c = cfg_;
    const int64_t T = qkv.rows, C = c.lin_conv_dim(), K = c.conv_kernel, Hk = c.lin_k_heads, Hv = c.lin_v_heads,
                  dk = c.lin_k_dim, dv = c.lin_v_dim, kd = Hk * dk;
    // A span with a mark runs as two parts, [0, mark) and [mark, n): between them its conv tail and S go to the
    // mark's state (the chunked form's chunks start again at the mark, as CUDA cuts them).
    auto save_mark = [&](const seq_span& s, bool conv_part) {
        auto* st = static_cast<cpu_state*>(s.state);
        auto* ms = static_cast<cpu_state*>(s.mark_state);
        auto& dst = conv_part ? ms->conv[(size_t)slot] : ms->S[(size_t)slot];
        dst = conv_part ? st->conv[(size_t)slot] : st->S[(size_t)slot];
    };
    std::vector<float> y((size_t)(T * C));
    for (const seq_span& s : spans) {
        auto* st = static_cast<cpu_state*>(s.state);
        const int64_t parts[3] = {0, s.mark_state ? s.mark : s.n, s.n};
        for (int i = 0; i < 2 && parts[i] < s.n; i++) {
            if (i == 1) save_mark(s, true);
            const int64_t r = s.row0 + parts[i];
            cpu::conv1d_silu(y.data() + r * C, f32(qkv) + r * C, st->conv[(size_t)slot].data(), w.conv.data(),
                             parts[i + 1] - parts[i], C, K);
        }
    }
    // Split [q | k | v], L2-normalise q and k per key head (q also scaled by 1/sqrt(dk)), §4.3-4.4.
    std::vector<float> q((size_t)(T * kd)), kk((size_t)(T * kd)), vv((size_t)(T * Hv * dv));
    const float qscale = 1.0f / std::sqrt((float)dk);
    for (int64_t t = 0; t < T; t++) {
        const float* yr = y.data() + t * C;
        for (int64_t h = 0; h < Hk; h++) {
            const float* qs = yr + h * dk;
            const float* ks = yr + kd + h * dk;
            const float qn = 1.0f / std::sqrt(cpu::dot(qs, qs, dk) + 1e-6f) * qscale;
            const float kn = 1.0f / std::sqrt(cpu::dot(ks, ks, dk) + 1e-6f);
            for (int64_t i = 0; i < dk; i++) {
                q[(size_t)(t * kd + h * dk + i)] = qs[i] * qn;
                kk[(size_t)(t * kd + h * dk + i)] = ks[i] * kn;
            }
        }
        memcpy(&vv[(size_t)(t * Hv * dv)], yr + 2 * kd, sizeof(float) * Hv * dv);
    }
    // Gates: beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias).
    std::vector<float> beta((size_t)(T * Hv)), g((size_t)(T * Hv));
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hv; h++) {
            beta[(size_t)(t * Hv + h)] = sigmoid(f32(b)[t * Hv + h]);
            g[(size_t)(t * Hv + h)] = -std::exp(w.A_log[(size_t)h]) * softplus(f32(a)[t * Hv + h] + w.dt_bias[(size_t)h]);
        }
    std::vector<float> o((size_t)(T * Hv * dv));
    for (const seq_span& s : spans) {
        auto* st = static_cast<cpu_state*>(s.state);
        const bool recurrent = mode == gdn_mode::recurrent || (mode == gdn_mode::auto_select && s.n == 1);
        const int64_t parts[3] = {0, s.mark_state ? s.mark : s.n, s.n};
        for (int i = 0; i < 2 && parts[i] < s.n; i++) {
            if (i == 1) save_mark(s, false);
            const int64_t r = s.row0 + parts[i];
            cpu::delta_args da{q.data() + r * kd,       kk.data() + r * kd,      vv.data() + r * Hv * dv,
                               beta.data() + r * Hv,    g.data() + r * Hv,       st->S[(size_t)slot].data(),
                               o.data() + r * Hv * dv, parts[i + 1] - parts[i], Hk,
                               Hv,                      dk,                      dv};
            if (recurrent)
                cpu::delta_rule_recurrent(da);
            else
                cpu::delta_rule_chunked(da);
            // stored as the CUDA kernels store it: at the span's end and at its mark (whose state goes on from there)
            if (state_bf16_)
                for (float& x : st->S[(size_t)slot]) x = bf16_to_f32(f32_to_bf16(x));
        }
    }
    cpu::gated_rms_norm(f32(out), o.data(), f32(z), w.norm.data(), T, Hv, dv, c.eps);
}

// MODEL.md §5: route, run each expert on the tokens that chose it, combine with the shared expert.
void cpu_backend::moe(const tensor& x, vec_view norm, float eps, const moe_weights& w) {
    const model_config& c = cfg_;
    const int64_t T = x.rows, D = c.hidden, E = c.n_experts, k = c.top_k, F = c.expert_inter, Fs = c.shared_inter;
    TANSY_CHECK(norm.n == D && x.cols == D, "moe shapes");
    std::vector<float> m((size_t)(T * D));
    cpu::rms_norm(m.data(), f32(x), T, D, norm.data, eps);
    const float* xp = m.data();
    std::vector<float> logits((size_t)(T * E));
    cpu::matmul(logits.data(), xp, T, w.router);
    std::vector<int32_t> idx((size_t)(T * k));
    std::vector<float> wt((size_t)(T * k));
    cpu::moe_route(idx.data(), wt.data(), logits.data(), T, E, k);

    std::vector<std::vector<int64_t>> assigned((size_t)E);  // expert -> slots t*k + j
    for (int64_t s = 0; s < T * k; s++) assigned[(size_t)idx[(size_t)s]].push_back(s);
    std::vector<float> ys((size_t)(T * k * D));  // each (token, choice) expert output
#pragma omp parallel for schedule(dynamic)
    for (int64_t e = 0; e < E; e++) {
        const auto& slots = assigned[(size_t)e];
        const int64_t n = (int64_t)slots.size();
        if (n == 0) continue;
        std::vector<float> xe((size_t)(n * D)), gte((size_t)(n * F)), up((size_t)(n * F)), ye((size_t)(n * D));
        for (int64_t i = 0; i < n; i++) memcpy(&xe[(size_t)(i * D)], xp + (slots[i] / k) * D, sizeof(float) * D);
        cpu::matmul(gte.data(), xe.data(), n, w.gate[(size_t)e]);
        cpu::matmul(up.data(), xe.data(), n, w.up[(size_t)e]);
        for (int64_t i = 0; i < n * F; i++) gte[(size_t)i] = silu(gte[(size_t)i]) * up[(size_t)i];
        cpu::matmul(ye.data(), gte.data(), n, w.down[(size_t)e]);
        for (int64_t i = 0; i < n; i++) memcpy(&ys[(size_t)(slots[i] * D)], &ye[(size_t)(i * D)], sizeof(float) * D);
    }
    std::vector<float> sg((size_t)(T * Fs)), su((size_t)(T * Fs)), sy((size_t)(T * D)), sgate((size_t)T);
    cpu::matmul(sg.data(), xp, T, w.shared_gate);
    cpu::matmul(su.data(), xp, T, w.shared_up);
    for (int64_t i = 0; i < T * Fs; i++) sg[(size_t)i] = silu(sg[(size_t)i]) * su[(size_t)i];
    cpu::matmul(sy.data(), sg.data(), T, w.shared_down);
    cpu::matmul(sgate.data(), xp, T, w.shared_expert_gate);
    float* op = f32(x);  // residual: x += moe
    for (int64_t t = 0; t < T; t++) {
        const float sig = sigmoid(sgate[(size_t)t]);
        for (int64_t d = 0; d < D; d++) {
            float acc = sig * sy[(size_t)(t * D + d)];
            for (int64_t j = 0; j < k; j++) acc += wt[(size_t)(t * k + j)] * ys[(size_t)((t * k + j) * D + d)];
            op[t * D + d] += acc;
        }
    }
}

}  // namespace

std::shared_ptr<void> backend::alloc_host(size_t bytes) {
    void* p = std::calloc(std::max<size_t>(bytes, 1), 1);
    if (!p) fail("out of host memory (%zu bytes)", bytes);
    return std::shared_ptr<void>(p, std::free);
}

std::unique_ptr<backend> make_cpu_backend(const model_config& cfg, const backend_options& opt) {
    return std::make_unique<cpu_backend>(cfg, opt);
}

std::unique_ptr<backend> make_backend(const std::string& name, const model_config& cfg, const backend_options& opt) {
    if (name == "cpu") return make_cpu_backend(cfg, opt);
    if (name == "cuda") {
        std::string why;
        auto be = make_cuda_backend(cfg, opt, &why);
        if (!be) fail("the cuda backend is unavailable: %s", why.c_str());
        return be;
    }
    fail("unknown backend '%s' (use cpu or cuda)", name.c_str());
}

}  // namespace tansy
