// The backend interface: memory, per-sequence state, and the coarse ops the forward pass is written against
// (src/model/forward.cpp holds the only layer logic). Each op has the same meaning on every backend; the CPU
// backend is the fp32 reference and the CUDA backend is tested op by op against it.
//
// Weights are passed as the host-side views of model_weights. A backend that keeps its own copy (CUDA) builds
// it in bind() and finds it again by the view's address.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/tensor.h"
#include "sampling/logprobs.h"
#include "sampling/sampler.h"
#include "model/weights.h"
#include "state/seq_state.h"

namespace tansy {

// The rows of a batch that belong to one sequence.
struct seq_span {
    seq_state* state = nullptr;
    int64_t row0 = 0, n = 0;  // batch rows [row0, row0 + n)
    int64_t pos0 = 0;         // absolute position of row0 (= state->n_past() before the step)
    // A checkpoint taken inside the step (runtime/prefix_cache.h): mark_state (a recurrent-only state, from
    // new_state(0)) receives the span's recurrent part (conv tails, S) as it stands after the span's first
    // `mark` rows, i.e. at position pos0 + mark, and its n_past becomes that. 0 < mark < n, and
    // n >= k_marked_span_min_rows. Saves the prompt piece that would otherwise end there.
    seq_state* mark_state = nullptr;
    int64_t mark = 0;
};
// The fewest rows of a span with a mark: a backend may run short spans on a decode path that keeps no state
// between its tokens (CUDA: up to 16 rows).
constexpr int64_t k_marked_span_min_rows = 32;
// A span without a mark, or one whose mark the rules above allow.
inline bool mark_allowed(const seq_span& s) {
    return !s.mark_state || (s.mark > 0 && s.mark < s.n && s.n >= k_marked_span_min_rows && s.mark_state != s.state);
}

// How the GDN recurrence is evaluated for spans of more than one token.
enum class gdn_mode : uint8_t {
    auto_select,  // chunked for prefill spans, recurrent for single tokens
    recurrent,    // token by token (MODEL.md §4.6)
    chunked,      // chunk-parallel form, chunk 64 (MODEL.md §4.7)
};

// Owning handle to backend memory holding a tensor.
class buffer {
  public:
    buffer() = default;
    buffer(tensor t, std::shared_ptr<void> mem) : t_(t), mem_(std::move(mem)) {}
    const tensor& t() const { return t_; }
    explicit operator bool() const { return t_.data != nullptr; }

  private:
    tensor t_;
    std::shared_ptr<void> mem_;
};

// Sampling parameters of one sequence slot as backend::sample_rows reads them (f32 [slots, 4]).
constexpr int64_t k_row_sampling_cols = 4;
// The device draws rows of temperature > 0 with top-k 1..k_device_max_top_k (top-p and min-p on top) from
// vocabularies of up to k_device_max_sample_ids ids; other sampled rows are drawn on the host from downloaded
// logits (their slot holds temperature 0: an argmax).
constexpr int k_device_max_top_k = 64;
constexpr int64_t k_device_max_sample_ids = 524288;
inline bool row_samples_on_device(const sampling_params& p, int64_t n_valid) {
    return p.temperature > 0 && p.top_k >= 1 && p.top_k <= k_device_max_top_k && p.top_k < n_valid &&
           n_valid <= k_device_max_sample_ids;
}
// The device computes log-prob records (backend::logprob_rows) over vocabularies of up to this many ids.
constexpr int64_t k_device_max_logprob_ids = 524288;
inline void pack_row_sampling(float out[k_row_sampling_cols], const sampling_params& p, int64_t n_valid) {
    const bool dev = row_samples_on_device(p, n_valid);
    out[0] = dev ? p.temperature : 0.0f;
    out[1] = (float)p.top_k, out[2] = p.top_p, out[3] = p.min_p;
}

// Per-slot logit adjustments applied on the device (backend::adjust_logits), as scheduler::choose applies them
// on the host: OpenAI's presence/frequency penalties over the generated ids, HF's repetition penalty over the
// prompt's and the generated ids, then OpenAI's logit_bias, then a grammar's mask of allowed ids.
//   pen     f32 [slots, k_adjust_cols]: presence, frequency, repetition, penalties/bias active (1: apply them to
//           this slot's rows and count its picks), bias entries in use, masked (1: apply the slot's mask)
//   counts  int32 [slots, n_valid]: bits 0..29 how often the slot generated the id (saturating), bit 30 set
//           when the prompt holds it
//   bias    int32 [slots, 2 * k_device_max_bias]: (id, bias as f32 bits) pairs, applied in order
//   mask    int32 [slots, mask_words(n_valid)]: bit (id % 32) of word id / 32 set where id may come next; the
//           others get -infinity
constexpr int64_t k_adjust_cols = 6;
constexpr int64_t k_device_max_bias = 300;  // OpenAI's cap on logit_bias entries; a longer list is applied on the host
constexpr int64_t mask_words(int64_t n_valid) { return (n_valid + 31) / 32; }
constexpr int32_t k_count_prompt_bit = 1 << 30;

class backend {
  public:
    virtual ~backend() = default;
    virtual const char* name() const = 0;
    virtual dtype act_type() const = 0;  // activation dtype: f32 (cpu), bf16 (cuda)

    // Prepares the weights of `m` (which must outlive the backend's use of it).
    virtual void bind(const model& m) = 0;

    // ---- memory
    virtual buffer alloc(int64_t rows, int64_t cols, dtype t) = 0;
    virtual void upload(const tensor& dst, const void* src) = 0;    // host -> backend, dst.bytes()
    virtual void download(void* dst, const tensor& src) = 0;        // backend -> host, src.bytes()
    virtual void synchronize() {}

    // A fresh, empty sequence state able to hold `capacity` tokens of KV cache.
    virtual std::unique_ptr<seq_state> new_state(int64_t capacity) = 0;

    // ---- state snapshots (runtime/prefix_cache.h), queued in order with the ops
    // A copy of st at st.n_past(): its recurrent part (conv tails, S) and its KV rows [0, kv_rows) (FP8 scales
    // included) in a new state of capacity kv_rows. kv_rows = 0: the recurrent part only (a checkpoint).
    virtual std::unique_ptr<seq_state> snapshot(const seq_state& st, int64_t kv_rows) {
        fail("backend %s: state snapshots are not supported", name());
    }
    // dst (capacity >= n) becomes the state after n tokens: KV rows [0, n) from kv (which holds at least n rows)
    // and the recurrent part from rec (rec.n_past() == n). rec and kv may be the same state; dst's other rows
    // are left as they are (never read: attention reads rows [0, n_past)).
    virtual void restore(seq_state& dst, const seq_state& rec, const seq_state& kv, int64_t n) {
        fail("backend %s: state snapshots are not supported", name());
    }

    // ---- ops (all activations are [T, features], T = batch rows; the residual stream x is [T, D])
    // Ops are coarse on purpose: each is what a fast backend fuses into one or two kernels (the norm into the
    // projection that follows it, the residual add into the matmul that produces it).

    // x[t] = table[ids[t]] (ids int32 [T, 1])
    virtual void embed(const tensor& x, const tensor& ids, const matrix& table) = 0;
    // out = in / rms(in) * w   (w is the applied multiplier)
    virtual void rms_norm(const tensor& out, const tensor& in, vec_view w, float eps) = 0;
    // out[T, W.rows] = in[T, W.cols] W^T; with accumulate, out += that (a residual add)
    virtual void matmul(const tensor& out, const tensor& in, const matrix& W, bool accumulate = false) = 0;
    // out[i] = in[rows[i]] (rows host-side)
    virtual void gather_rows(const tensor& out, const tensor& in, const std::vector<int64_t>& rows) = 0;

    // The input projections of a mixer: a = rms_norm(x, norm); outs[i] = a W_i^T (all W_i share W.cols = D).
    virtual void project(const std::vector<tensor>& outs, const tensor& x, vec_view norm, float eps,
                         const std::vector<const matrix*>& Ws) = 0;

    // Gated full attention core (MODEL.md §3) from the projections to the input of o_proj:
    // qg [T, Hq*2*dh] (per head: query | gate), k/v [T, Hkv*dh]. Applies q/k norms and partial RoPE at each
    // row's position, appends k and v to the KV cache `slot` of each span's state, attends causally over the
    // cache, multiplies by sigmoid(gate). out [T, Hq*dh]. k may be modified in place.
    virtual void attention(const tensor& out, const tensor& qg, const tensor& k, const tensor& v,
                           const attn_weights& w, int slot, const std::vector<seq_span>& spans) = 0;

    // Gated DeltaNet core (MODEL.md §4) from the projections to the input of out_proj: qkv [T, C] raw
    // in_proj_qkv output, z [T, Hv*dv], b/a [T, Hv]. Runs the causal conv (state `slot`), SiLU, L2 norms,
    // gates, the delta rule (updating S) and the gated RMSNorm. out [T, Hv*dv]. qkv may be overwritten.
    virtual void gdn(const tensor& out, const tensor& qkv, const tensor& z, const tensor& b, const tensor& a,
                     const gdn_weights& w, int slot, const std::vector<seq_span>& spans, gdn_mode mode) = 0;

    // Sparse MoE block with its norm and residual (MODEL.md §5): x += MoE(rms_norm(x, norm)), where
    // MoE(m) = sum_topk w_i expert_i(m) + sigmoid(g.m) shared(m).
    virtual void moe(const tensor& x, vec_view norm, float eps, const moe_weights& w) = 0;

    // A layer's tail: the mixer's output projection into the residual stream, then the MoE block, i.e.
    // matmul(x, o, W_out, accumulate) and moe(x, norm, eps, w). One op so that a backend can fuse them (CUDA, one
    // decode token: the router's logits come out of the projection's kernel, without a router launch).
    virtual void out_proj_moe(const tensor& x, const tensor& o, const matrix& W_out, vec_view norm, float eps,
                              const moe_weights& w) {
        matmul(x, o, W_out, /*accumulate=*/true);
        moe(x, norm, eps, w);
    }

    // Tests: K (after norm and RoPE) and V of cache row `pos` of full-attention layer `slot`, as the attention
    // reads them (bf16, or FP8 dequantised), kv_dim floats each.
    virtual void read_kv(const seq_state& st, int slot, int64_t pos, float* k, float* v) {
        fail("backend %s: reading the KV cache back is not supported", name());
    }

    // Called once a forward step has updated every layer: states of the spans advance by their lengths
    // (backends that keep positions on the device update them here).
    virtual void end_step(const std::vector<seq_span>& spans) {}

    // ids_out[r] = argmax of logits row r over the first n_valid columns (ties: the lowest id). The token
    // stays in backend memory, where the next step's embed reads it.
    virtual void argmax(const tensor& ids_out, const tensor& logits, int64_t n_valid) = 0;

    // Sampling in backend memory, as tansy::sampler draws (sampling/sampler_math.h): ids_out[r] from logits row
    // r, rng holding row r's splitmix64 state (one u64 per row: a [rows, 2] i32 tensor, seeded with
    // sampling_math::rng_start) and advancing it. Only where can_sample(p, n_valid) says so; the caller samples
    // on the host otherwise.
    virtual bool can_sample(const sampling_params& p, int64_t n_valid) const { return false; }
    virtual void sample(const tensor& ids_out, const tensor& logits, int64_t n_valid, const sampling_params& p,
                        const tensor& rng) {
        fail("backend %s: sampling in backend memory is not supported", name());
    }

    // Per-row sampling for a batch whose rows belong to sequence slots (runtime/decode_step.h): row r is slot
    // row_slot[r] (int32 [rows, 1]); params holds each slot's sampling parameters (f32 [slots, 4]: temperature,
    // top_k, top_p, min_p; see pack_row_sampling) and rng each slot's splitmix64 state ([slots, 2] i32, one u64).
    // ids_out[r] must already hold row r's argmax (backend::argmax); rows whose slot samples (temperature > 0
    // and row_samples_on_device) are replaced by a draw that advances the slot's rng, as tansy::sampler draws.
    virtual void sample_rows(const tensor& ids_out, const tensor& logits, int64_t n_valid, const tensor& params,
                             const tensor& rng, const tensor& row_slot) = 0;
    // In place on logits [rows, >= n_valid]: row r, of slot row_slot[r], gets its slot's adjustments (see
    // k_adjust_cols); the first n_valid columns only. counts or mask may be empty tensors when no slot uses them.
    virtual void adjust_logits(const tensor& logits, int64_t n_valid, const tensor& row_slot, const tensor& pen,
                               const tensor& counts, const tensor& bias, const tensor& mask) = 0;
    // After a pick: counts[row_slot[r]][ids[r]] += 1 (saturating below k_count_prompt_bit) for rows whose slot is
    // active. One row per slot.
    virtual void count_picks(const tensor& counts, const tensor& ids, const tensor& row_slot, const tensor& pen) = 0;
    // Log-probabilities of the raw logits (OpenAI's logprobs / top_logprobs; sampling/logprobs.h) for the rows
    // whose slot asks for them: row r, of slot row_slot[r], with n = top[row_slot[r]] (int32 [slots, 1]: -1 none,
    // 0 the pick's only, 1..k_max_top_logprobs the top n too), gets records[r] (int32 [rows, k_logprob_words]:
    // the row's log-sum-exp over its first n_valid logits, the logit of its pick ids[r], its top n (id, logit)).
    // Other rows' records are left as they are. logits must be the raw ones: run it before adjust_logits, or on
    // a copy taken before.
    virtual void logprob_rows(const tensor& records, const tensor& logits, int64_t n_valid, const tensor& ids,
                              const tensor& row_slot, const tensor& top) = 0;
    // dst = src, both in backend memory and of one shape, queued like the ops.
    virtual void copy(const tensor& dst, const tensor& src) = 0;
    // out[r] = vals[row_slot[r]] and vals[row_slot[r]] = in[r] (int32 [rows, 1]; vals [slots, 1]).
    virtual void gather_slots(const tensor& out, const tensor& vals, const tensor& row_slot) = 0;
    virtual void scatter_slots(const tensor& vals, const tensor& in, const tensor& row_slot) = 0;

    // ---- asynchronous host copies: pinned host memory, copies queued behind the ops, and fences to wait on.
    virtual std::shared_ptr<void> alloc_host(size_t bytes);
    virtual void download_async(void* dst, const tensor& src) { download(dst, src); }
    // A point in the queue of ops; wait_fence(f) returns once every op queued before fence() has finished.
    virtual uint64_t fence() { return 0; }
    virtual void wait_fence(uint64_t f) {}

    // ---- graphs: a fixed sequence of ops recorded once and replayed (CUDA graphs), several kept by key.
    // Backends without them return false from supports_graphs() and the caller runs the ops eagerly.
    virtual bool supports_graphs() const { return false; }
    // Changes whenever memory that a captured graph refers to moves: a graph captured at another epoch must be
    // captured again before replay. (A batch's structure is not part of it: see prepare_step.)
    virtual uint64_t memory_epoch() const { return 0; }
    virtual void capture_begin() {}
    virtual void capture_end(uint64_t key = 0) {}
    virtual void capture_abort() {}  // after an op failed during capture: the queue runs eagerly again
    virtual void replay(uint64_t key = 0) {}
    virtual bool has_graph(uint64_t key) const { return false; }
    virtual void drop_graph(uint64_t key) {}
    // Makes the device-side tables of a batch (row -> sequence, sequence -> state) those of `spans`: a replayed
    // step reads them, so call this before each replay whose batch differs from the last op's.
    virtual void prepare_step(const std::vector<seq_span>& spans) {}

    // Benchmarks only: mark `n` tokens as already processed without computing them (the KV cache and state
    // keep whatever they hold). Lets a decode benchmark start at a long context instantly.
    virtual void pretend_context(seq_state& st, int64_t n) = 0;

    // Device memory in use by this process (0 where not applicable), and a description of the device.
    virtual size_t device_memory_used() const { return 0; }
    // Hands memory that ended sequences freed back to the device (the CUDA backend keeps it pooled for the next
    // sequence until told): called when a server goes idle.
    virtual void release_free_memory() {}
    virtual std::string device_name() const { return name(); }
    // Which kernels run which op, in words (one decision a line, lines after the first start with indent).
    virtual std::string kernel_summary(const char* indent = "") const {
        (void)indent;
        return std::string(name()) + ": one form of each op";
    }
};

// Kernel-family switches of the CUDA backend for A/B runs (--kernels; cuda/kernel_plan.h): -1 keeps the plan's
// default. The CPU backend has one form of each op and ignores them.
struct kernel_options {
    int mma_families = -1;  // decode families on tensor cores (bits of cuda::mma_family)
    int int8_inputs = -1;   // 0/1: int8 inputs of the one-row 4-bit decode kernels
    int gemm_wgmma = -1;    // 0/1: Hopper wgmma for the prompt GEMMs' 128-row tiles
    int gemm_tma = -1;      // 0/1: the wgmma GEMM's prompt-sized dense and routed down calls' X tiles by TMA
    int moe_groups = -1;    // >= 0: MoE of 17 .. this many rows on the decode kernels, in groups of <= 16 rows
    int dense_groups = -1;  // >= 0: dense products of 17 .. this many rows on the GEMV kernels, likewise
    int moe_small = -1;     // >= 0: MoE of 17 .. this many rows (fast mode) on the small-M grouped MoE kernels
    int dense_rows = -1;    // > 0: the most rows of one dense decode-kernel group (16 .. 32)
    int moe_small_gate_up_items = -1, moe_small_down_items = -1;  // > 0: the small-M MoE kernels' items per warp
    int recur = -1;         // >= 0: DeltaNet decode state in registers (0) or staged in shared memory (1)
    int gemm_split = -1;    // >= 0: the most K slices of a dense GEMM that leaves most SMs idle (0 or 1: never)
};

struct backend_options {
    uint64_t synthetic_seed = 1;  // weights a backend generates for a synthetic model (model::synthetic)
    float router_skew = 0.0f;     // > 0: synthetic routing prefers some experts (Zipf-like), as real traffic does
    // Matrix products over many rows (prompts) with ~fp32 accuracy (split bf16 operands) instead of fp16 inputs.
    bool precise_gemm = false;
    // KV cache in FP8 E4M3 with a power-of-two scale per (position, KV head) (core/fp8.h) instead of bf16: half
    // the cache's memory and bytes per decode step, ~2^-4 relative rounding of K and V (docs/QUALITY.md).
    bool kv_fp8 = false;
    // DeltaNet recurrent state stored in bf16 instead of fp32 (computed in fp32; rounded to nearest even where a
    // span ends and at a mark): half the state's memory and bytes per decode step, the largest term at large
    // batches (docs/QUALITY.md, docs/PERF.md).
    bool state_bf16 = false;
    kernel_options kernels;
};

std::unique_ptr<backend> make_cpu_backend(const model_config& cfg, const backend_options& opt = {});
// nullptr with a reason in *why when the CUDA backend is not compiled in or no GPU is usable.
std::unique_ptr<backend> make_cuda_backend(const model_config& cfg, const backend_options& opt, std::string* why);
// "cpu" or "cuda"; throws tansy::error naming the reason when unavailable.
std::unique_ptr<backend> make_backend(const std::string& name, const model_config& cfg, const backend_options& opt = {});

}  // namespace tansy
