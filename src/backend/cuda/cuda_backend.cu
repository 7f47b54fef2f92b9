// The CUDA backend: device copies of the weights (4/8-bit affine as in the checkpoint, or bf16), fp32
// activations, per-sequence state in one device allocation, every op as one to four kernels on one stream,
// and CUDA-graph capture of whole decode steps. Which kernels run for which rows and shapes: kernel_plan.h.
// (Over 700 lines: one class implementing backend.h, each op a short method over the launchers.)
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <map>
#include <unordered_map>

#include "backend/backend.h"
#include "backend/cuda/adjust.cuh"
#include "backend/cuda/attention.cuh"
#include "backend/cuda/common.cuh"
#include "backend/cuda/device.h"
#include "backend/cuda/gdn.cuh"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/gemv.cuh"
#include "backend/cuda/kernel_plan.h"
#include "backend/cuda/logprobs.cuh"
#include "backend/cuda/misc.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/sample.cuh"
#include "backend/cuda/stream.cuh"
#include "backend/cuda/weights_dev.h"
#include "core/fp8.h"
#include "core/log.h"

namespace tansy {

namespace {

using namespace cuda;

static_assert(k_device_max_top_k == k_sample_max_top_k && k_device_max_sample_ids == k_sample_max_ids,
              "the scheduler's device-draw rule must match the CUDA sampler");
static_assert(k_logprob_max_ids == k_device_max_logprob_ids,
              "the scheduler's device log-prob rule must match the kernels");

float* f32(const tensor& t) {
    TANSY_CHECK(t.type == dtype::f32, "cuda backend expects f32 activations, got %s", dtype_name(t.type));
    return (float*)t.data;
}

// ------------------------------------------------------------------------------------------- state

class cuda_state final : public seq_state {
  public:
    // Memory operations on the state are queued on `stream` (the backend's), in order with the steps that use it.
    cuda_state(const dshape& sh, int n_attn, int n_gdn, int64_t capacity, cudaStream_t stream, bool zero = true)
        : sh_(sh), n_attn_(n_attn), n_gdn_(n_gdn), stream_(stream) {
        capacity_ = capacity;
        kv_bytes_ = (size_t)n_attn * 2 * sh.capacity * sh.kvd * (sh.kv8 ? 1 : 2);
        scale_bytes_ = sh.kv8 ? (size_t)n_attn * 2 * sh.capacity * sh.hkv * 4 : 0;
        kv_bytes_ = (kv_bytes_ + 255) / 256 * 256;  // the scales and the state stay 256-byte aligned
        scale_bytes_ = (scale_bytes_ + 255) / 256 * 256;
        conv_bytes_ = (size_t)n_gdn * 2 * sh.conv_rows * sh.conv_ch * 4;
        s_bytes_ = (size_t)n_gdn * sh.s_elems * (sh.s16 ? 2 : 4);
        mem_ = stream_buffer(kv_bytes_ + scale_bytes_ + conv_bytes_ + s_bytes_ + 256, stream);
        if (zero) reset();
    }
    std::unique_ptr<seq_state> clone() const override {
        auto c = std::make_unique<cuda_state>(sh_, n_attn_, n_gdn_, capacity_, stream_, /*zero=*/false);
        CUDA_CHECK(cudaMemcpyAsync(c->mem_.get(), mem_.get(), mem_.size(), cudaMemcpyDeviceToDevice, stream_));
        c->n_past_ = n_past_;
        return c;
    }
    size_t bytes() const override { return mem_.size(); }
    void reset() override {
        CUDA_CHECK(cudaMemsetAsync(mem_.get(), 0, mem_.size(), stream_));
        n_past_ = 0;
    }
    const dshape& shape() const { return sh_; }
    dseq dev() const {
        char* base = (char*)mem_.get();
        char* conv = base + kv_bytes_ + scale_bytes_;
        return {(uint16_t*)base, sh_.kv8 ? (float*)(base + kv_bytes_) : nullptr, (float*)conv,
                conv + conv_bytes_, (int32_t*)(conv + conv_bytes_ + s_bytes_)};
    }
    // The recurrent part: conv [n_gdn][2][K-1][C], S and meta are contiguous, from dev().conv on.
    size_t tail_bytes() const { return conv_bytes_ + s_bytes_ + 2 * sizeof(int32_t); }

    // KV rows [0, n) of every layer (K and V; codes and scales for FP8) from src into this state: one strided
    // copy per region, as both hold [n_attn * 2][capacity][row] with their own capacities.
    void copy_kv_rows(const cuda_state& src, int64_t n) {
        TANSY_CHECK(src.sh_.kv8 == sh_.kv8 && src.sh_.kvd == sh_.kvd && n <= capacity_ && n <= src.capacity_,
                    "copy_kv_rows: %lld rows from capacity %lld into %lld", (long long)n, (long long)src.capacity_,
                    (long long)capacity_);
        if (n <= 0 || n_attn_ == 0) return;
        const size_t e = sh_.kv8 ? 1 : 2, row = (size_t)sh_.kvd * e;
        CUDA_CHECK(cudaMemcpy2DAsync(dev().kv, row * (size_t)capacity_, src.dev().kv, row * (size_t)src.capacity_,
                                     row * (size_t)n, (size_t)n_attn_ * 2, cudaMemcpyDeviceToDevice, stream_));
        if (sh_.kv8) {
            const size_t srow = (size_t)sh_.hkv * 4;
            CUDA_CHECK(cudaMemcpy2DAsync(dev().kv_scale, srow * (size_t)capacity_, src.dev().kv_scale,
                                         srow * (size_t)src.capacity_, srow * (size_t)n, (size_t)n_attn_ * 2,
                                         cudaMemcpyDeviceToDevice, stream_));
        }
    }
    // conv tails (both parities), S and meta (n_past, steps: the conv parity) from src.
    void copy_recurrent(const cuda_state& src) {
        TANSY_CHECK(src.tail_bytes() == tail_bytes(), "copy_recurrent: state shapes differ");
        CUDA_CHECK(cudaMemcpyAsync(dev().conv, src.dev().conv, tail_bytes(), cudaMemcpyDeviceToDevice, stream_));
    }

  private:
    dshape sh_;
    int n_attn_, n_gdn_;
    cudaStream_t stream_;
    size_t kv_bytes_ = 0, scale_bytes_ = 0, conv_bytes_ = 0, s_bytes_ = 0;
    stream_buffer mem_;  // stream-ordered: a state freed while steps are queued does not wait for them
};

// A growable device array. Growing it moves it: `epoch` counts moves so captured graphs can be invalidated.
template <class T>
struct dev_array {
    device_buffer buf;
    size_t n = 0;
    uint64_t* epoch = nullptr;
    T* ensure(size_t count) {
        if (count > n) {
            buf = device_buffer(count * sizeof(T));
            n = count;
            if (epoch) ++*epoch;
        }
        return (T*)buf.get();
    }
    T* get() const { return (T*)buf.get(); }
};

// ------------------------------------------------------------------------------------------- backend

class cuda_backend final : public backend {
  public:
    explicit cuda_backend(const model_config& cfg) : cfg_(cfg) {
        CUDA_CHECK(cudaSetDevice(0));
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
        CUDA_CHECK(cudaEventCreateWithFlags(&ev_fork_, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&ev_join_, cudaEventDisableTiming));
        sh_.kvd = cfg.kv_dim();
        sh_.hkv = cfg.n_kv_heads;
        sh_.conv_rows = cfg.conv_kernel - 1;
        sh_.conv_ch = cfg.lin_conv_dim();
        sh_.s_elems = cfg.lin_v_heads * cfg.lin_k_dim * cfg.lin_v_dim;
        n_attn_ = (int)cfg.n_full_attention();
        n_gdn_ = (int)(cfg.n_layers() - n_attn_);
        std::vector<double> inv((size_t)cfg.rope_dim / 2);
        for (size_t j = 0; j < inv.size(); j++) inv[j] = std::pow(cfg.rope_theta, -2.0 * (double)j / (double)cfg.rope_dim);
        for (auto* a : {&ws_norm_, &ws_q_, &ws_part_o_, &ws_part_ml_, &ws_gdn_o_, &ws_router_, &ws_wt_, &ws_sig_, &ws_h_, &ws_argmax_})
            a->epoch = &epoch_;
        for (auto* a : {&gather_rows_dev_, &ws_idx_, &ws_perm_, &ws_pos_, &ws_ntiles_}) a->epoch = &epoch_;
        ws_sample_.epoch = ws_logprob_.epoch = &epoch_;
        ws_tiles_.epoch = ws_y_.epoch = ws_gdn_work_.epoch = &epoch_;
        ws_a16_.epoch = ws_m16_.epoch = ws_h16_.epoch = &epoch_;
        ws_split_.epoch = &epoch_;
        rows_dev_.epoch = spans_dev_.epoch = seqs_dev_.epoch = marks_dev_.epoch = &epoch_;
        tap_ = device_buffer((size_t)(cfg.n_experts + 1) * k_tap_stride * 8);
        CUDA_CHECK(cudaMemset(tap_.get(), 0, tap_.size()));
        CUDA_CHECK(cudaStreamSynchronize(0));
        inv_freq_ = device_buffer(inv.size() * sizeof(double));
        inv_freq_.upload(inv.data(), inv.size() * sizeof(double));
    }
    ~cuda_backend() override {
        release_kernel_plan(&plan_);
        for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g);
        for (cudaEvent_t e : fences_) cudaEventDestroy(e);
        cudaEventDestroy(ev_fork_);
        cudaEventDestroy(ev_join_);
        cudaStreamDestroy(side_);
        cudaStreamDestroy(stream_);
    }

    const char* name() const override { return "cuda"; }
    dtype act_type() const override { return dtype::f32; }

    void bind(const model& m) override { weights_.bind(m, stream_, synth_seed_, synth_skew_); }
    void set_synthetic(uint64_t seed, float router_skew) { synth_seed_ = seed, synth_skew_ = router_skew; }
    void set_precise_gemm(bool on) { precise_gemm_ = on; }
    void set_kv_fp8(bool on) { sh_.kv8 = on; }  // before the first new_state
    void set_state_bf16(bool on) { sh_.s16 = on; }  // likewise
    // Decides the kernels once (kernel_plan.h). The launchers read the active plan: every call that launches
    // kernels that consult it makes this backend's plan the active one first (use_kernel_plan).
    void set_plan(const backend_options& opt) {
        kernel_device d;
        d.name = cuda::device_name(0), d.cc = device_compute_capability(0), d.sms = sm_count();
        d.smem_optin = max_dynamic_smem(), d.wgmma = gemm_wgmma_available();
        plan_ = make_kernel_plan(d, &cfg_, opt.precise_gemm, opt.kernels);
        use_kernel_plan(&plan_);
    }
    std::string kernel_summary(const char* indent) const override { return plan_.describe(indent); }
    uint64_t memory_epoch() const override { return epoch_; }

    buffer alloc(int64_t rows, int64_t cols, dtype t) override {
        auto mem = std::make_shared<device_buffer>((size_t)std::max<int64_t>(rows * cols, 1) * dtype_size(t));
        CUDA_CHECK(cudaMemsetAsync(mem->get(), 0, mem->size(), stream_));
        return buffer(tensor{mem->get(), t, rows, cols}, mem);
    }
    void upload(const tensor& dst, const void* src) override {
        CUDA_CHECK(cudaMemcpyAsync(dst.data, src, dst.bytes(), cudaMemcpyHostToDevice, stream_));
        CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    void download(void* dst, const tensor& src) override {
        CUDA_CHECK(cudaMemcpyAsync(dst, src.data, src.bytes(), cudaMemcpyDeviceToHost, stream_));
        CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    void synchronize() override { CUDA_CHECK(cudaStreamSynchronize(stream_)); }

    std::unique_ptr<seq_state> new_state(int64_t capacity) override {
        dshape sh = sh_;
        sh.capacity = capacity;
        return std::make_unique<cuda_state>(sh, n_attn_, n_gdn_, capacity, stream_);
    }

    std::unique_ptr<seq_state> snapshot(const seq_state& st, int64_t kv_rows) override {
        const auto& s = static_cast<const cuda_state&>(st);
        TANSY_CHECK(kv_rows >= 0 && kv_rows <= s.n_past(), "snapshot: %lld KV rows of a state at %lld",
                    (long long)kv_rows, (long long)s.n_past());
        dshape sh = s.shape();
        sh.capacity = kv_rows;
        auto c = std::make_unique<cuda_state>(sh, n_attn_, n_gdn_, kv_rows, stream_, /*zero=*/false);
        c->copy_kv_rows(s, kv_rows);
        c->copy_recurrent(s);
        c->set_n_past(s.n_past());
        return c;
    }
    void restore(seq_state& dst, const seq_state& rec, const seq_state& kv, int64_t n) override {
        TANSY_CHECK(rec.n_past() == n && n <= dst.capacity(), "restore: %lld tokens from a checkpoint at %lld into capacity %lld",
                    (long long)n, (long long)rec.n_past(), (long long)dst.capacity());
        auto& d = static_cast<cuda_state&>(dst);
        d.copy_kv_rows(static_cast<const cuda_state&>(kv), n);
        d.copy_recurrent(static_cast<const cuda_state&>(rec));  // meta[0] = n with it
        d.set_n_past(n);
    }

    void pretend_context(seq_state& st, int64_t n) override {
        TANSY_CHECK(n <= st.capacity(), "pretend_context %lld > capacity", (long long)n);
        const int32_t meta[2] = {(int32_t)n, 0};
        CUDA_CHECK(cudaMemcpyAsync(static_cast<cuda_state&>(st).dev().meta, meta, sizeof meta, cudaMemcpyHostToDevice, stream_));
        CUDA_CHECK(cudaStreamSynchronize(stream_));
        st.set_n_past(n);
    }

    void embed(const tensor& x, const tensor& ids, const matrix& table) override {
        embed_rows(f32(x), (const int32_t*)ids.data, (int)x.rows, weights_.mat(table), stream_);
    }

    void rms_norm(const tensor& out, const tensor& in, vec_view w, float eps) override {
        rms_norm_f32(f32(out), f32(in), weights_.vec(w), (int)in.rows, in.cols, eps, stream_);
    }

    void matmul(const tensor& out, const tensor& in, const matrix& W, bool accumulate) override {
        use_kernel_plan(&plan_);
        TANSY_CHECK(in.cols == W.cols && out.cols == W.rows && out.rows == in.rows, "matmul %s shapes", W.name.c_str());
        const gemv_segment seg{f32(out), out.cols, 0};
        dense(weights_.mat(W), f32(in), in.cols, (int)in.rows, nullptr, 0.0f, &seg, 1, accumulate);
    }

    void gather_rows(const tensor& out, const tensor& in, const std::vector<int64_t>& rows) override {
        std::vector<int32_t> r(rows.begin(), rows.end());
        if (r != gather_cache_) {
            TANSY_CHECK(!capturing_, "gather_rows: row list changed during graph capture");
            int32_t* d = gather_rows_dev_.ensure(r.size());
            CUDA_CHECK(cudaMemcpyAsync(d, r.data(), r.size() * 4, cudaMemcpyHostToDevice, stream_));
            CUDA_CHECK(cudaStreamSynchronize(stream_));
            gather_cache_ = r;
            if (gather_in_graph_) epoch_++, gather_in_graph_ = false;  // a captured graph reads the old list
        }
        if (capturing_) gather_in_graph_ = true;
        gather_rows_f32(f32(out), f32(in), gather_rows_dev_.get(), (int)r.size(), in.cols, stream_);
    }

    void project(const std::vector<tensor>& outs, const tensor& x, vec_view norm, float eps,
                 const std::vector<const matrix*>& Ws) override {
        use_kernel_plan(&plan_);
        const int T = (int)x.rows;
        const float* nw = weights_.vec(norm);
        const float* xin = f32(x);
        // lm_head alone (no projection group) takes the norm in its prologue only in fast mode at 4 bits (the
        // per-warp kernels, ~132 blocks). In precise mode or at 8/16 bits the plain GEMV's ~19K blocks would each
        // norm all T rows: it is normalised once first.
        const bool lone = Ws.size() == 1 && !weights_.grouped(*Ws[0]);
        const bool lone_prologue = lone && !precise_gemm_ && weights_.mat(*Ws[0]).fmt == dfmt::q4;
        const device_weights::concat* cc = lone ? nullptr : &weights_.cat(Ws);
        const uint16_t* x16 = nullptr;
        if (T > k_gemv_max_norm_rows || plan_.use_gemm(T) || (lone && !lone_prologue)) {  // normalise once
            // every matrix on the fast GEMM: the norm writes only the fp16 A operand they share
            bool all_fast = true;
            if (lone) all_fast = fast_gemm(weights_.mat(*Ws[0]), T);
            else
                for (const auto& part : cc->parts) all_fast &= fast_gemm(part.W, T);
            if (all_fast) {
                uint16_t* a16 = ws_a16_.ensure((size_t)x.numel());
                rms_norm_f32(nullptr, xin, nw, T, x.cols, eps, stream_, a16);
                x16 = a16, xin = nullptr;
            } else {
                float* a = ws_norm_.ensure((size_t)x.numel());
                rms_norm_f32(a, xin, nw, T, x.cols, eps, stream_);
                xin = a;
            }
            nw = nullptr;
        }
        if (lone) {  // one matrix of no group (lm_head after the final norm)
            TANSY_CHECK(Ws[0]->cols == x.cols && outs[0].cols == Ws[0]->rows && outs[0].rows == x.rows,
                        "project %s shapes", Ws[0]->name.c_str());
            const gemv_segment seg{f32(outs[0]), outs[0].cols, 0};
            dense(weights_.mat(*Ws[0]), xin, x.cols, T, nw, eps, &seg, 1, false, false, x16);
            return;
        }
        for (size_t part = 0; part < cc->parts.size(); part++) {
            gemv_segment seg[4];
            int n_seg = 0;
            for (int i : cc->parts[part].members) seg[n_seg++] = {f32(outs[(size_t)i]), outs[(size_t)i].cols, cc->row0[(size_t)i]};
            dense(cc->parts[part].W, xin, x.cols, T, nw, eps, seg, n_seg, false, false, x16);
        }
    }

    void attention(const tensor& out, const tensor& qg, const tensor& k, const tensor& v, const attn_weights& w,
                   int slot, const std::vector<seq_span>& spans) override {
        use_kernel_plan(&plan_);
        prepare_batch(spans, (int)qg.rows);
        const int T = (int)qg.rows;
        attn_params p;
        p.qg = f32(qg), p.k = f32(k), p.v = f32(v);
        p.q_norm = weights_.vec({w.q_norm.data(), (int64_t)w.q_norm.size()});
        p.k_norm = weights_.vec({w.k_norm.data(), (int64_t)w.k_norm.size()});
        p.T = T, p.Hq = (int)cfg_.n_q_heads, p.Hkv = (int)cfg_.n_kv_heads, p.dh = (int)cfg_.head_dim;
        p.rope_dim = (int)cfg_.rope_dim, p.eps = cfg_.eps, p.inv_freq = (const double*)inv_freq_.get();
        p.rows = rows_dev_.get(), p.seqs = seqs_dev_.get(), p.shape = batch_shape_, p.slot = slot;
        p.spans = spans_dev_.get(), p.n_spans = (int)spans.size();
        p.min_span = p.max_span = spans.empty() ? 0 : (int)spans[0].n;
        int decode_rows = spans.empty() ? T : 0;  // the split kernel's rows (a prompt's go to attention_prefill)
        for (const seq_span& s : spans) {
            p.min_span = std::min(p.min_span, (int)s.n), p.max_span = std::max(p.max_span, (int)s.n);
            if (s.n < k_attn_prefill_min_rows) decode_rows += (int)s.n;
        }
        p.n_splits = attention_splits(decode_rows, p.Hkv);
        p.q_bf16 = !precise_gemm_;  // fast mode: decode's scores as attention_prefill computes them
        p.q = ws_q_.ensure((size_t)T * p.Hq * p.dh);
        // note: the split partials take 1 MB per row (real shapes); a batch of long spans only (a prompt)
        // needs none, since those rows go to attention_prefill
        if (p.min_span < k_attn_prefill_min_rows) {
            p.part_o = ws_part_o_.ensure((size_t)T * p.Hq * p.n_splits * p.dh);
            p.part_ml = ws_part_ml_.ensure((size_t)T * p.Hq * p.n_splits * 2);
        }
        p.out = f32(out);
        attention_prep(p, stream_);
        attention_decode(p, stream_);   // rows of spans shorter than k_attn_prefill_min_rows (decode tokens)
        attention_prefill(p, stream_);  // rows of the longer spans (prompts)
    }

    // A span with a mark takes the prefill path (gdn_prefill.cu), which writes the checkpoint.
    static_assert(k_marked_span_min_rows > k_gdn_recur_max_rows, "marked spans must be prefill spans");
    void gdn(const tensor& out, const tensor& qkv, const tensor& z, const tensor& b, const tensor& a,
             const gdn_weights& w, int slot, const std::vector<seq_span>& spans, gdn_mode mode) override {
        use_kernel_plan(&plan_);
        for (const seq_span& sp : spans)
            TANSY_CHECK(mark_allowed(sp), "cuda gdn: a span of %lld rows marked at %lld", (long long)sp.n, (long long)sp.mark);
        prepare_batch(spans, (int)qkv.rows);
        gdn_params p;
        p.qkv = f32(qkv), p.b = f32(b), p.a = f32(a), p.z = f32(z);
        p.conv_w = weights_.vec({w.conv.data(), (int64_t)w.conv.size()});
        p.A_log = weights_.vec({w.A_log.data(), (int64_t)w.A_log.size()});
        p.dt_bias = weights_.vec({w.dt_bias.data(), (int64_t)w.dt_bias.size()});
        p.norm_w = weights_.vec({w.norm.data(), (int64_t)w.norm.size()});
        p.T = (int)qkv.rows, p.Hk = (int)cfg_.lin_k_heads, p.Hv = (int)cfg_.lin_v_heads;
        p.dk = (int)cfg_.lin_k_dim, p.dv = (int)cfg_.lin_v_dim, p.K = (int)cfg_.conv_kernel, p.eps = cfg_.eps;
        p.spans = spans_dev_.get(), p.seqs = seqs_dev_.get(), p.marks = marks_dev_.get(), p.n_spans = (int)spans.size();
        p.shape = batch_shape_, p.slot = slot;
        p.o = ws_gdn_o_.ensure((size_t)out.numel());
        p.chunked = mode != gdn_mode::recurrent;  // prompts in the chunk-parallel form unless told otherwise
        for (const seq_span& sp : spans) {
            p.max_span = std::max(p.max_span, (int)sp.n);
            p.any_mark |= sp.mark_state != nullptr;
        }
        if (p.T - (p.n_spans - 1) > k_gdn_recur_max_rows)  // some span may take the prefill path (gdn_forward)
            p.work = ws_gdn_work_.ensure(gdn_prefill_workspace_floats(p.T, p.Hk, p.Hv, p.dk, p.dv, p.chunked));
        p.out = f32(out);
        gdn_forward(p, stream_);
    }

    void moe(const tensor& x, vec_view norm, float eps, const moe_weights& w) override {
        use_kernel_plan(&plan_);
        const int T = (int)x.rows;
        const device_weights::moe_dev& md = weights_.moe(w);
        const float* nw = weights_.vec(norm);
        const float* xin = f32(x);
        const int E = (int)cfg_.n_experts, k = (int)cfg_.top_k;
        // a decode batch of 17+ rows: the small-M grouped kernels (fast mode), else the decode kernels in groups
        const bool small = plan_.moe_in_small(T) && !precise_gemm_ && moe_small_supports(md.m);
        const bool in_groups = !small && plan_.moe_in_groups(T);
        const bool grouped = !small && !in_groups &&
                             use_gemm(T, {&md.m.gate, &md.m.up, &md.m.down, &md.m.s_gate, &md.m.s_up, &md.m.s_down});
        // fast mode: the experts' A operands in fp16 (the input once for all gate/up GEMMs, the SwiGLU outputs
        // written so directly); nullptr in precise mode. The norm writes m16 with m (the router's fp32 input).
        uint16_t *m16 = nullptr, *h16 = nullptr;
        if ((grouped || small) && !precise_gemm_) {
            m16 = ws_m16_.ensure((size_t)T * md.m.D);
            h16 = ws_h16_.ensure((size_t)T * (k + 1) * std::max(md.m.F, md.m.Fs));
        }
        if (T > k_gemv_max_norm_rows || plan_.use_gemm(T) || m16) {
            TANSY_CHECK(md.m.D == x.cols, "moe: input of %lld values for experts of %lld", (long long)x.cols, (long long)md.m.D);
            float* a = ws_norm_.ensure((size_t)x.numel());
            rms_norm_f32(a, xin, nw, T, x.cols, eps, stream_, m16);
            xin = a, nw = nullptr;
        }
        float* logits = ws_router_.ensure((size_t)T * (E + 1));
        int32_t* idx = ws_idx_.ensure((size_t)T * k);
        float* wt = ws_wt_.ensure((size_t)T * k);
        float* sig = ws_sig_.ensure((size_t)T);
        // the experts' fp32 activations: the GEMV path's and the precise GEMMs' (fast GEMMs keep them in fp16)
        float* h = (grouped && !precise_gemm_) || small
                       ? nullptr
                       : ws_h_.ensure((size_t)T * (k + 1) * std::max(cfg_.expert_inter, cfg_.shared_inter));
        float* y = grouped || small ? ws_y_.ensure((size_t)T * (k + 1) * md.m.D) : nullptr;
        // the shared expert needs only the normalised input: on the side stream, alongside the router, top-k,
        // routing plan and routed experts (the router GEMM alone leaves a third of the SMs idle)
        if (grouped)
            shared_expert_async(md.m, xin, m16, h ? h + (size_t)T * k * md.m.F : nullptr,
                                h16 ? h16 + (size_t)T * k * md.m.F : nullptr, y + (size_t)T * k * md.m.D, T);
        // [router; shared_expert_gate] rows -> logits [T, E+1], always ~fp32 (GEMV, or the precise GEMM): bf16
        // inputs move router logits by ~1e-3 relative, enough to swap the 8th and 9th expert of some tokens, which
        // changes those tokens' outputs by O(1) and makes prompt processing disagree with decode.
        // A decode batch (<= 16 rows) takes the fp32 GEMV: the router is 0.5 MB, and the precise GEMM's tiles take
        // an order of magnitude longer for it at 16 rows (measured: docs/PERF.md).
        for (const auto& part : md.router.parts) {
            const gemv_segment seg{logits + (part.members[0] == 0 ? 0 : E), E + 1, 0};
            if (T <= k_gemv_max_norm_rows)
                dense_gemv(part.W, xin, x.cols, T, nw, eps, &seg, 1, false, /*f16=*/false);
            else
                dense(part.W, xin, x.cols, T, nw, eps, &seg, 1, false, /*precise=*/true);
        }
        moe_routing route;
        route.logits = logits, route.ld = E + 1, route.bias = md.router_bias, route.idx = idx, route.wt = wt, route.sig = sig;
        if (grouped || small) {
            moe_topk(route, T, E, k, stream_);
            if (small)
                moe_grouped_small(f32(x), x.cols, md.m, m16, idx, wt, sig, h16, y, T);
            else
                moe_grouped(f32(x), x.cols, md.m, xin, m16, idx, wt, sig, h, h16, y, T);
            return;
        }
        // fast mode: inputs rounded as the grouped GEMM's fp16 operands (m16, and h16 = h * k_down_a_scale);
        // more rows than the decode kernels take: in groups, one after another
        for_each_row_group(T, k_mma_max_tokens, [&](int t0, int n) {
            moe_routing rg = route;
            rg.logits += (size_t)t0 * (E + 1), rg.idx += (size_t)t0 * k, rg.wt += (size_t)t0 * k, rg.sig += t0;
            moe_route_gate_up(h, md.m, rg, xin + (size_t)t0 * x.cols, x.cols, n, nw, eps, /*f16=*/!precise_gemm_, stream_);
            moe_down(f32(x) + (size_t)t0 * x.cols, x.cols, md.m, rg.idx, rg.wt, rg.sig, h, n,
                     precise_gemm_ ? 0.0f : k_down_a_scale, stream_);
        });
    }

    // One decode token in fast mode: the output projection's GEMV also sums the router's logits (gemv's router
    // tap), and gate/up takes its routing from them: the router GEMV's launch leaves the chain.
    void out_proj_moe(const tensor& x, const tensor& o, const matrix& W_out, vec_view norm, float eps,
                      const moe_weights& w) override {
        use_kernel_plan(&plan_);
        const device_weights::moe_dev& md = weights_.moe(w);
        const int E = (int)cfg_.n_experts, k = (int)cfg_.top_k;
        if (x.rows == 1 && !precise_gemm_ && md.router.parts.size() == 1 && md.router.parts[0].W.rows == E + 1 &&
            moe_tap_supports(md.m)) {
            TANSY_CHECK(o.cols == W_out.cols && x.cols == W_out.rows && o.rows == 1, "out_proj_moe %s shapes",
                        W_out.name.c_str());
            gemv_params p;
            p.W = weights_.mat(W_out);
            p.x = f32(o), p.ldx = o.cols, p.T = 1, p.f16_inputs = true;
            p.seg[0] = {f32(x), x.cols, 0}, p.n_seg = 1, p.accumulate = true;
            p.tap = {md.router.parts[0].W, weights_.vec(norm), tap_logits()};
            if (gemv_router_tap_supports(p)) {
                gemv(p, stream_);
                moe_routing route;
                route.tap = tap_logits(), route.bias = md.router_bias;
                route.idx = ws_idx_.ensure((size_t)k), route.wt = ws_wt_.ensure((size_t)k), route.sig = ws_sig_.ensure(1);
                float* h = ws_h_.ensure((size_t)(k + 1) * std::max(cfg_.expert_inter, cfg_.shared_inter));
                moe_route_gate_up(h, md.m, route, f32(x), x.cols, 1, weights_.vec(norm), eps, /*f16=*/true, stream_);
                moe_down(f32(x), x.cols, md.m, route.idx, route.wt, route.sig, h, 1, k_down_a_scale, stream_, tap_logits());
                return;
            }
        }
        backend::out_proj_moe(x, o, W_out, norm, eps, w);
    }

    void read_kv(const seq_state& st, int slot, int64_t pos, float* k, float* v) override {
        const auto& cs = static_cast<const cuda_state&>(st);
        const dshape& sh = cs.shape();
        const dseq d = cs.dev();
        TANSY_CHECK(slot >= 0 && slot < n_attn_ && pos >= 0 && pos < sh.capacity, "read_kv: layer %d row %lld", slot,
                    (long long)pos);
        CUDA_CHECK(cudaStreamSynchronize(stream_));
        const int64_t kvd = sh.kvd, dh = sh.kvd / sh.hkv;
        if (!sh.kv8) {
            std::vector<uint16_t> b((size_t)kvd);
            for (int which = 0; which < 2; which++) {
                const uint16_t* src = (which ? kv_v(d, sh, slot) : kv_k(d, sh, slot)) + pos * kvd;
                CUDA_CHECK(cudaMemcpy(b.data(), src, (size_t)kvd * 2, cudaMemcpyDeviceToHost));
                for (int64_t i = 0; i < kvd; i++) (which ? v : k)[i] = bf16_to_f32(b[(size_t)i]);
            }
            return;
        }
        std::vector<uint8_t> c((size_t)kvd);
        std::vector<float> sc((size_t)sh.hkv);
        for (int which = 0; which < 2; which++) {
            CUDA_CHECK(cudaMemcpy(c.data(), (which ? kv8_v(d, sh, slot) : kv8_k(d, sh, slot)) + pos * kvd, (size_t)kvd,
                                  cudaMemcpyDeviceToHost));
            CUDA_CHECK(cudaMemcpy(sc.data(), (which ? kv8_vs(d, sh, slot) : kv8_ks(d, sh, slot)) + pos * sh.hkv,
                                  (size_t)sh.hkv * 4, cudaMemcpyDeviceToHost));
            for (int64_t i = 0; i < kvd; i++) (which ? v : k)[i] = e4m3_decode(c[(size_t)i]) * sc[(size_t)(i / dh)];
        }
    }

    void end_step(const std::vector<seq_span>& spans) override {
        prepare_batch(spans, spans.empty() ? 0 : (int)(spans.back().row0 + spans.back().n));
        advance_seqs(seqs_dev_.get(), spans_dev_.get(), (int)spans.size(), stream_);
    }

    void argmax(const tensor& ids_out, const tensor& logits, int64_t n_valid) override {
        float* scratch = ws_argmax_.ensure((size_t)2 * logits.rows * k_argmax_parts);
        argmax_rows((int32_t*)ids_out.data, f32(logits), (int)logits.rows, logits.cols, std::min(n_valid, logits.cols),
                    scratch, stream_);
    }

    void sample_rows(const tensor& ids_out, const tensor& logits, int64_t n_valid, const tensor& params,
                     const tensor& rng, const tensor& row_slot) override {
        TANSY_CHECK(params.cols == k_row_sampling_cols && params.type == dtype::f32 && rng.cols == 2 &&
                        rng.rows == params.rows && row_slot.rows >= logits.rows && ids_out.rows >= logits.rows,
                    "cuda sample_rows shapes");
        const int64_t nv = std::min(n_valid, logits.cols);
        uint64_t* scratch = ws_sample_.ensure(sample_scratch_words((int)logits.rows, nv));
        sample_slot_rows((int32_t*)ids_out.data, f32(logits), (int)logits.rows, logits.cols, nv,
                         (const float*)params.data, (uint64_t*)rng.data, (const int32_t*)row_slot.data, scratch, stream_);
    }
    void adjust_logits(const tensor& logits, int64_t n_valid, const tensor& row_slot, const tensor& pen,
                       const tensor& counts, const tensor& bias, const tensor& mask) override {
        const int64_t nv = std::min(n_valid, logits.cols);
        TANSY_CHECK(pen.cols == k_adjust_cols && pen.type == dtype::f32 && bias.rows == pen.rows &&
                        bias.cols == 2 * k_device_max_bias && row_slot.rows >= logits.rows &&
                        (!counts.data || (counts.type == dtype::i32 && counts.rows == pen.rows)) &&
                        (!mask.data || (mask.rows == pen.rows && mask.cols >= mask_words(nv))),
                    "cuda adjust_logits shapes");
        adjust_logits_rows(f32(logits), (int)logits.rows, logits.cols, nv, (const int32_t*)row_slot.data,
                           (const float*)pen.data, (const int32_t*)counts.data, counts.cols, (const int32_t*)bias.data,
                           (int)k_device_max_bias, (const uint32_t*)mask.data, mask.cols, stream_);
    }
    void count_picks(const tensor& counts, const tensor& ids, const tensor& row_slot, const tensor& pen) override {
        count_picks_rows((int32_t*)counts.data, counts.cols, (const int32_t*)ids.data, (const int32_t*)row_slot.data,
                         (const float*)pen.data, (int)ids.rows, stream_);
    }
    void logprob_rows(const tensor& records, const tensor& logits, int64_t n_valid, const tensor& ids,
                      const tensor& row_slot, const tensor& top) override {
        TANSY_CHECK(records.cols == k_logprob_words && records.type == dtype::i32 && records.rows >= logits.rows &&
                        ids.rows >= logits.rows && row_slot.rows >= logits.rows && top.type == dtype::i32,
                    "cuda logprob_rows shapes");
        const int64_t nv = std::min(n_valid, logits.cols);
        uint64_t* scratch = ws_logprob_.ensure(logprob_scratch_words((int)logits.rows, nv));
        logprob_slot_rows((int32_t*)records.data, f32(logits), (int)logits.rows, logits.cols, nv,
                          (const int32_t*)ids.data, (const int32_t*)row_slot.data, (const int32_t*)top.data, scratch,
                          stream_);
    }
    void copy(const tensor& dst, const tensor& src) override {
        TANSY_CHECK(dst.bytes() == src.bytes() && dst.type == src.type, "copy: %zu bytes into %zu", src.bytes(),
                    dst.bytes());
        CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDeviceToDevice, stream_));
    }
    void gather_slots(const tensor& out, const tensor& vals, const tensor& row_slot) override {
        gather_slots_i32((int32_t*)out.data, (const int32_t*)vals.data, (const int32_t*)row_slot.data, (int)out.rows,
                         stream_);
    }
    void scatter_slots(const tensor& vals, const tensor& in, const tensor& row_slot) override {
        scatter_slots_i32((int32_t*)vals.data, (const int32_t*)in.data, (const int32_t*)row_slot.data, (int)in.rows,
                          stream_);
    }

    std::shared_ptr<void> alloc_host(size_t bytes) override {
        void* p = nullptr;
        CUDA_CHECK(cudaMallocHost(&p, std::max<size_t>(bytes, 1)));
        memset(p, 0, std::max<size_t>(bytes, 1));
        return std::shared_ptr<void>(p, [](void* q) { cudaFreeHost(q); });
    }
    void download_async(void* dst, const tensor& src) override {
        CUDA_CHECK(cudaMemcpyAsync(dst, src.data, src.bytes(), cudaMemcpyDeviceToHost, stream_));
    }
    // Fences are events from a ring: a fence stays waitable until k_fences newer ones were made.
    uint64_t fence() override {
        if (fences_.empty()) {
            fences_.resize(k_fences);
            for (cudaEvent_t& e : fences_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        }
        const uint64_t f = ++fence_count_;
        CUDA_CHECK(cudaEventRecord(fences_[f % k_fences], stream_));
        return f;
    }
    void wait_fence(uint64_t f) override {
        if (f == 0) return;
        TANSY_CHECK(f <= fence_count_ && fence_count_ - f < k_fences, "wait_fence: fence %llu is no longer held",
                    (unsigned long long)f);
        CUDA_CHECK(cudaEventSynchronize(fences_[f % k_fences]));
    }

    bool can_sample(const sampling_params& p, int64_t n_valid) const override {
        return row_samples_on_device(p, n_valid);
    }
    void sample(const tensor& ids_out, const tensor& logits, int64_t n_valid, const sampling_params& p,
                const tensor& rng) override {
        TANSY_CHECK(can_sample(p, std::min(n_valid, logits.cols)), "cuda: top-k %d sampling of %lld ids", p.top_k,
                    (long long)n_valid);
        TANSY_CHECK(rng.rows >= logits.rows && rng.cols == 2 && rng.type == dtype::i32, "cuda sample: rng state shape");
        sample_args a;
        a.temperature = p.temperature, a.top_k = p.top_k, a.top_p = p.top_p, a.min_p = p.min_p;
        const int64_t nv = std::min(n_valid, logits.cols);
        uint64_t* scratch = ws_sample_.ensure(sample_scratch_words((int)logits.rows, nv));
        cuda::sample_rows((int32_t*)ids_out.data, f32(logits), (int)logits.rows, logits.cols, nv, a, (uint64_t*)rng.data,
                          scratch, stream_);
    }

    void release_free_memory() override { trim_stream_pool(); }
    size_t device_memory_used() const override {
        size_t free_b = 0, total = 0;
        CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
        return total - free_b;
    }
    std::string device_name() const override { return cuda::device_name(0); }

    bool supports_graphs() const override { return true; }
    void capture_begin() override {
        use_kernel_plan(&plan_);
        TANSY_CHECK(!capturing_, "nested capture");
        CUDA_CHECK(cudaStreamSynchronize(stream_));
        CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
        capturing_ = true;
    }
    void capture_abort() override {
        if (!capturing_) return;
        cudaGraph_t g = nullptr;
        cudaStreamEndCapture(stream_, &g);  // the capture failed: its error is the one being reported
        if (g) cudaGraphDestroy(g);
        cudaGetLastError();
        capturing_ = false;
    }
    void capture_end(uint64_t key) override {
        TANSY_CHECK(capturing_, "capture_end without capture_begin");
        cudaGraph_t g;
        CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
        capturing_ = false;
        cudaGraphExec_t& exec = graphs_[key];
        if (exec) CUDA_CHECK(cudaGraphExecDestroy(exec));
        exec = nullptr;
        CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
        CUDA_CHECK(cudaGraphDestroy(g));
    }
    void replay(uint64_t key) override {
        auto it = graphs_.find(key);
        TANSY_CHECK(it != graphs_.end() && it->second, "replay without a captured graph");
        CUDA_CHECK(cudaGraphLaunch(it->second, stream_));
    }
    bool has_graph(uint64_t key) const override { return graphs_.count(key) > 0; }
    void drop_graph(uint64_t key) override {
        auto it = graphs_.find(key);
        if (it == graphs_.end()) return;
        if (it->second) cudaGraphExecDestroy(it->second);
        graphs_.erase(it);
    }
    void prepare_step(const std::vector<seq_span>& spans) override {
        prepare_batch(spans, spans.empty() ? 0 : (int)(spans.back().row0 + spans.back().n));
    }

  private:
    // The router tap's fixed-point logits [E + 1] (stride k_tap_stride): zero at allocation, and zeroed again by moe_down after each use.
    unsigned long long* tap_logits() { return (unsigned long long*)tap_.get(); }

    bool use_gemm(int T, std::initializer_list<const dmat*> Ws) const {
        if (!plan_.use_gemm(T)) return false;
        for (const dmat* W : Ws)
            if (!gemm_supports(*W)) return false;
        return true;
    }

    // Whether dense(W, ..., T rows) takes the fast-mode tensor-core GEMM (its A operand in fp16).
    bool fast_gemm(const dmat& W, int T) const { return !precise_gemm_ && plan_.dense_gemm(T, false) && use_gemm(T, {&W}); }

    // out segments (+)= x W^T for T rows: the tensor-core GEMM for many rows, the GEMV kernels (which can fold
    // the RMS norm nw into their prologue for T <= k_gemv_max_norm_rows) otherwise. x16 (optional, rows of
    // W.cols halves): x already as the fast GEMM's fp16 operand (then x may be nullptr where fast_gemm(W, T)).
    void dense(const dmat& W, const float* x, int64_t ldx, int T, const float* nw, float eps, const gemv_segment* seg,
               int n_seg, bool accumulate, bool precise = false, const uint16_t* x16 = nullptr) {
        if (plan_.dense_gemm(T, precise || precise_gemm_) && use_gemm(T, {&W})) {
            TANSY_CHECK(nw == nullptr, "gemm: normalise the input first");
            gemm_params p;
            p.W = W, p.N = W.rows, p.x = x, p.ldx = ldx, p.M = T, p.precise = precise || precise_gemm_;
            if (!p.precise && x16) {
                p.x16 = x16, p.ldx16 = W.cols;
            } else if (!p.precise) {
                uint16_t* a16 = ws_a16_.ensure((size_t)T * W.cols);
                to_f16(a16, x, T, W.cols, ldx, 1.0f, stream_);
                p.x16 = a16, p.ldx16 = W.cols;
            }
            p.epi = gemm_epilogue::store;
            for (int i = 0; i < n_seg; i++) p.seg[i] = seg[i];
            p.n_seg = n_seg, p.accumulate = accumulate;
            p.split_k = 0;  // (0: gemm_split_slices decides) K slices where the tiles alone would leave most SMs idle,
            p.split_k = gemm_split_slices(p);  // decided once: the workspace and gemm() take it as given
            if (p.split_k > 1) p.split_ws = ws_split_.ensure(gemm_split_floats(p));
            gemm(p, stream_);
            return;
        }
        TANSY_CHECK(x != nullptr, "dense: the GEMV path of %d rows needs the fp32 input", T);
        const bool f16 = !(precise || precise_gemm_);
        // fp32 inputs (the router, precise mode) take the general GEMV, which walks any number of rows in one launch
        if (!plan_.dense_in_groups(T) || !f16) return dense_gemv(W, x, ldx, T, nw, eps, seg, n_seg, accumulate, f16);
        // a decode batch of 17+ rows on the tensor-core GEMV kernels, in groups
        TANSY_CHECK(nw == nullptr, "dense: normalise the input of %d rows first", T);
        for_each_row_group(T, gemv_max_rows(W), [&](int t0, int n) {
            gemv_segment sg[4];
            for (int i = 0; i < n_seg; i++) sg[i] = seg[i], sg[i].out = seg[i].out + (size_t)t0 * seg[i].ld;
            dense_gemv(W, x + (size_t)t0 * ldx, ldx, n, nullptr, eps, sg, n_seg, accumulate, f16);
        });
    }

    // Rows [0, T) in even groups of at most max_rows (16: 17 = 9 + 8), the decode kernels' row counts:
    // fn(first row, rows) for each, in order.
    template <class Fn>
    static void for_each_row_group(int T, int max_rows, Fn&& fn) {
        const int n_groups = (T + max_rows - 1) / max_rows;
        for (int g = 0, t0 = 0; g < n_groups; g++) {
            const int n = (T - t0) / (n_groups - g);
            fn(t0, n);
            t0 += n;
        }
    }

    // The GEMV path of dense() (fp32 math; T <= k_gemv_max_norm_rows when nw is set). f16: the inputs rounded to
    // fp16 first, as the fast GEMM's are, so that decode computes what prefill computes (fast mode).
    void dense_gemv(const dmat& W, const float* x, int64_t ldx, int T, const float* nw, float eps,
                    const gemv_segment* seg, int n_seg, bool accumulate, bool f16) {
        gemv_params p;
        p.W = W;
        p.x = x, p.ldx = ldx, p.T = T, p.norm_w = nw, p.eps = eps, p.f16_inputs = f16;
        for (int i = 0; i < n_seg; i++) p.seg[i] = seg[i];
        p.n_seg = n_seg, p.accumulate = accumulate;
        gemv(p, stream_);
    }

    // The shared expert as dense GEMMs on side_, forked from and joined back into stream_ through events (a graph
    // capture follows the fork): m = normalised input [T, D] -> hs [T, Fs] -> ys [T, D]. moe_grouped joins it.
    // Fast mode takes m16/hs16 (fp16 copies: m's, and hs's scaled by k_down_a_scale); precise mode m/hs.
    void shared_expert_async(const dmoe& md, const float* m, const uint16_t* m16, float* hs, uint16_t* hs16, float* ys,
                             int T) {
        CUDA_CHECK(cudaEventRecord(ev_fork_, stream_));
        CUDA_CHECK(cudaStreamWaitEvent(side_, ev_fork_, 0));
        gemm_params sg;
        sg.W = md.s_gate, sg.W2 = md.s_up, sg.N = md.Fs, sg.x = m, sg.ldx = md.D, sg.M = T;
        sg.epi = gemm_epilogue::swiglu, sg.out = hs, sg.ldo = md.Fs;
        sg.x16 = m16, sg.ldx16 = md.D, sg.out16 = hs16, sg.out16_scale = k_down_a_scale;
        sg.precise = precise_gemm_;
        gemm(sg, side_);
        gemm_params sd;
        sd.W = md.s_down, sd.N = md.D, sd.x = hs, sd.ldx = md.Fs, sd.M = T;
        sd.epi = gemm_epilogue::rows, sd.out = ys, sd.ldo = md.D;
        sd.a_scale = k_down_a_scale;
        sd.x16 = hs16, sd.ldx16 = md.Fs;
        sd.precise = precise_gemm_;
        gemm(sd, side_);
        CUDA_CHECK(cudaEventRecord(ev_join_, side_));
    }

    // Routed experts as grouped GEMMs over expert-sorted slots (gate/up with SwiGLU, then down), then, once the
    // shared expert (shared_expert_async) has joined, the weighted combine into x. m = normalised input [T, D];
    // h: T*(k+1)*max(F, Fs) floats, y: T*(k+1)*D floats, the shared expert's parts after the routed ones; fast
    // mode uses m16/h16 (as shared_expert_async) instead of m/h.
    void moe_grouped(float* x, int64_t ldx, const dmoe& md, const float* m, const uint16_t* m16, const int32_t* idx,
                     const float* wt, const float* sig, float* h, uint16_t* h16, float* y, int T) {
        const int E = md.E, k = md.k;
        const int64_t D = md.D, F = md.F;
        const int bm = gemm_grouped_tile_rows(md.gate, precise_gemm_, T, E, k);
        const int max_tiles = moe_max_tiles(T, E, k, bm);
        int32_t* perm = ws_perm_.ensure((size_t)T * k);
        int32_t* pos_of = ws_pos_.ensure((size_t)T * k);
        gemm_tile* tiles = ws_tiles_.ensure((size_t)max_tiles);
        int32_t* n_tiles = ws_ntiles_.ensure(1);
        moe_plan(perm, pos_of, tiles, n_tiles, idx, T, E, k, bm, stream_);

        gemm_params g;  // routed gate/up: A rows gathered from the tokens of the sorted slots
        g.W = md.gate, g.W2 = md.up, g.N = F, g.x = m, g.ldx = D, g.gather = perm, g.gather_div = k;
        g.tiles = tiles, g.n_tiles = n_tiles, g.max_tiles = max_tiles, g.tile_bm = bm;
        g.epi = gemm_epilogue::swiglu, g.out = h, g.ldo = F;
        g.x16 = m16, g.ldx16 = D, g.out16 = h16, g.out16_scale = k_down_a_scale;
        g.precise = precise_gemm_;
        gemm(g, stream_);
        gemm_params d;  // routed down: sorted rows in, sorted rows out
        d.W = md.down, d.N = D, d.x = h, d.ldx = F, d.M = T * k;  // (M: h16's rows, the extent of a TMA map)
        d.tiles = tiles, d.n_tiles = n_tiles, d.max_tiles = max_tiles, d.tile_bm = bm;
        d.epi = gemm_epilogue::rows, d.out = y, d.ldo = D;
        d.a_scale = k_down_a_scale;
        d.x16 = h16, d.ldx16 = F;
        d.precise = precise_gemm_;
        gemm(d, stream_);

        CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_join_, 0));
        moe_combine(x, ldx, y, y + (size_t)T * k * D, pos_of, wt, sig, T, k, D, stream_);
    }

    // A decode batch's MoE on the small-M grouped kernels (fast mode, moe_small_supports): the routing plan in tiles
    // of <= 16 sorted rows with the shared expert's rows [T k, T k + T) as expert E, gate/up with SwiGLU into h16,
    // down into y (rows as moe_grouped's), then the combine into x. m16 = the normalised input in fp16 [T, D]; h16:
    // T*(k+1)*F halves, y: T*(k+1)*D floats.
    void moe_grouped_small(float* x, int64_t ldx, const dmoe& md, const uint16_t* m16, const int32_t* idx,
                           const float* wt, const float* sig, uint16_t* h16, float* y, int T) {
        const int E = md.E, k = md.k;
        const int max_tiles = moe_max_tiles(T, E, k, k_moe_small_bm, /*shared=*/true);
        int32_t* perm = ws_perm_.ensure((size_t)T * k);
        int32_t* pos_of = ws_pos_.ensure((size_t)T * k);
        gemm_tile* tiles = ws_tiles_.ensure((size_t)max_tiles);
        int32_t* n_tiles = ws_ntiles_.ensure(1);
        moe_plan(perm, pos_of, tiles, n_tiles, idx, T, E, k, k_moe_small_bm, stream_, /*shared=*/true);
        moe_small_gate_up(h16, md, m16, perm, tiles, n_tiles, max_tiles, T, k_down_a_scale, stream_);
        moe_small_down(y, md, h16, tiles, n_tiles, max_tiles, T, k_down_a_scale, stream_);
        moe_combine(x, ldx, y, y + (size_t)T * k * md.D, pos_of, wt, sig, T, k, md.D, stream_);
    }

    // Row -> (sequence, offset) and sequence -> state tables on the device, re-uploaded only when the batch's
    // structure changes (never inside a graph capture). A replayed step reads the tables in place, so a graph stays
    // valid for any batch of the same shape (rows, spans' lengths, capacity) once prepare_step has uploaded it;
    // only moving the tables (a larger batch) changes the memory epoch.
    void prepare_batch(const std::vector<seq_span>& spans, int T) {
        std::vector<drow> rows((size_t)T);
        std::vector<dspan> sp;
        std::vector<dseq> sq, mk;
        int64_t cap = 0;
        for (size_t i = 0; i < spans.size(); i++) {
            const seq_span& s = spans[i];
            for (int64_t r = 0; r < s.n; r++) rows[(size_t)(s.row0 + r)] = {(int32_t)i, (int32_t)r};
            sp.push_back({(int32_t)s.row0, (int32_t)s.n, s.mark_state ? (int32_t)s.mark : 0});
            const dshape& ss = static_cast<cuda_state*>(s.state)->shape();
            TANSY_CHECK(ss.s16 == sh_.s16 && ss.kv8 == sh_.kv8, "cuda: a state of another backend's storage types");
            sq.push_back(static_cast<cuda_state*>(s.state)->dev());
            mk.push_back(s.mark_state ? static_cast<cuda_state*>(s.mark_state)->dev() : dseq{});
            cap = i == 0 ? s.state->capacity() : std::min(cap, s.state->capacity());
            TANSY_CHECK(i == 0 || s.state->capacity() == cap, "cuda: sequences of one batch need equal capacity");
        }
        const bool same = rows.size() == rows_cache_.size() && sp.size() == spans_cache_.size() &&
                          memcmp(rows.data(), rows_cache_.data(), rows.size() * sizeof(drow)) == 0 &&
                          memcmp(sp.data(), spans_cache_.data(), sp.size() * sizeof(dspan)) == 0 &&
                          memcmp(sq.data(), seqs_cache_.data(), sq.size() * sizeof(dseq)) == 0 &&
                          memcmp(mk.data(), marks_cache_.data(), mk.size() * sizeof(dseq)) == 0;
        if (same) return;
        TANSY_CHECK(!capturing_, "the batch structure changed during graph capture");
        CUDA_CHECK(cudaStreamSynchronize(stream_));
        // on the stream, so that the step after reads them; room for k_min_batch_tables entries from the start, so
        // that a batch growing to that size does not move the tables (and every captured graph with them)
        auto put = [&](void* dst, const void* src, size_t bytes) {
            CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
        };
        put(rows_dev_.ensure(std::max(rows.size() + 1, k_min_batch_tables)), rows.data(), rows.size() * sizeof(drow));
        put(spans_dev_.ensure(std::max(sp.size() + 1, k_min_batch_tables)), sp.data(), sp.size() * sizeof(dspan));
        put(seqs_dev_.ensure(std::max(sq.size() + 1, k_min_batch_tables)), sq.data(), sq.size() * sizeof(dseq));
        put(marks_dev_.ensure(std::max(mk.size() + 1, k_min_batch_tables)), mk.data(), mk.size() * sizeof(dseq));
        CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host vectors are freed on return
        rows_cache_ = rows, spans_cache_ = sp, seqs_cache_ = sq, marks_cache_ = mk;
        batch_shape_ = sh_;
        batch_shape_.capacity = cap;
    }

    static constexpr size_t k_min_batch_tables = 512;
    // SwiGLU outputs (the down projections' inputs) are where large activations live: scaled by 2^-4 before the
    // fp16 conversion they fit up to ~1e6; values below 2^-10 lose relative precision, which their products
    // barely feel.
    static constexpr float k_down_a_scale = 1.0f / 16.0f;

    model_config cfg_;
    kernel_plan plan_;  // which kernel family runs each op, by rows and shape (set_plan)
    cudaStream_t stream_ = nullptr;
    cudaStream_t side_ = nullptr;  // independent work forked from stream_ (the shared expert of prompt steps)
    cudaEvent_t ev_fork_ = nullptr, ev_join_ = nullptr;
    device_weights weights_;
    dshape sh_, batch_shape_;
    int n_attn_ = 0, n_gdn_ = 0;
    device_buffer inv_freq_;
    bool capturing_ = false, gather_in_graph_ = false;
    uint64_t epoch_ = 0, synth_seed_ = 1;
    float synth_skew_ = 0.0f;
    bool precise_gemm_ = false;
    std::unordered_map<uint64_t, cudaGraphExec_t> graphs_;  // captured steps by the caller's key
    static constexpr uint64_t k_fences = 64;
    std::vector<cudaEvent_t> fences_;
    uint64_t fence_count_ = 0;

    std::vector<drow> rows_cache_;
    std::vector<dspan> spans_cache_;
    std::vector<dseq> seqs_cache_, marks_cache_;
    std::vector<int32_t> gather_cache_;
    dev_array<drow> rows_dev_;
    dev_array<dspan> spans_dev_;
    dev_array<dseq> seqs_dev_, marks_dev_;
    dev_array<int32_t> gather_rows_dev_, ws_idx_, ws_perm_, ws_pos_, ws_ntiles_;
    dev_array<gemm_tile> ws_tiles_;
    // fast-GEMM A operands as fp16: a dense call's input; the MoE's normalised input and SwiGLU outputs
    dev_array<uint16_t> ws_a16_, ws_m16_, ws_h16_;
    device_buffer tap_;  // tap_logits
    dev_array<float> ws_split_;  // dense GEMMs' K-split partial products (main stream only)
    dev_array<float> ws_y_, ws_gdn_work_, ws_norm_, ws_q_, ws_part_o_, ws_part_ml_, ws_gdn_o_, ws_router_, ws_wt_, ws_sig_, ws_h_, ws_argmax_;
    dev_array<uint64_t> ws_sample_;   // the sampler's per-slice candidates (sample_scratch_words)
    dev_array<uint64_t> ws_logprob_;  // the log-prob rows' per-slice results (logprob_scratch_words)
};

}  // namespace

std::unique_ptr<backend> make_cuda_backend(const model_config& cfg, const backend_options& opt, std::string* why) {
    std::string reason;
    if (cuda::device_count(&reason) == 0) {
        if (why) *why = reason;
        return nullptr;
    }
    auto be = std::make_unique<cuda_backend>(cfg);
    be->set_synthetic(opt.synthetic_seed, opt.router_skew);
    be->set_precise_gemm(opt.precise_gemm);
    be->set_kv_fp8(opt.kv_fp8);
    be->set_state_bf16(opt.state_bf16);
    be->set_plan(opt);
    return be;
}

}  // namespace tansy
