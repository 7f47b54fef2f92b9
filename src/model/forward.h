// The forward pass, written once against backend.h (MODEL.md §6):
//   h = embed(ids); for each layer: h += mixer(input_norm(h)); h += moe(post_norm(h));
//   logits = lm_head(norm(h))
// where mixer is Gated DeltaNet or gated full attention. A batch is any set of sequences, each contributing
// a span of consecutive tokens (a prefill chunk or one decode token), each with its own seq_state.
#pragma once
#include <functional>
#include <vector>

#include "backend/backend.h"

namespace tansy {

enum class logits_rows : uint8_t {
    all,      // one row of logits per batch row (eval, `tansy logits`)
    last,     // only the last row of each span (generation)
    none,     // no lm_head (prefill of a prefix)
};

// Named-intermediate hook (llama.cpp cb(), yalm DEBUG_MODEL): called with "embed", "layer" (after each layer,
// with its index), "final_norm". Tensors are in backend memory.
using tap_fn = std::function<void(const char* name, int layer, const tensor& t)>;

// A checkpoint a prefill takes on the way (seq_span::mark): `state` gets the recurrent part after `at` rows.
struct span_mark {
    seq_state* state = nullptr;
    int64_t at = 0;
};

// Aborts unless every span of a step has its own state, and each mark's checkpoint is a state of its own: the
// CUDA kernels read a span's state before their PDL wait and update it in place (backend/cuda/common.cuh), so one
// state in two spans of a step would be a silent race, not an error.
void check_one_span_per_state(const std::vector<seq_span>& spans);

class forward_pass {
  public:
    forward_pass(backend& be, const model& m);

    // Runs `ids` (int32 [T, 1] in backend memory) through the model. `spans` partition the rows by sequence;
    // each span's pos0 must equal its state's n_past(), which advances by the span length. Returns the logits
    // tensor (backend memory, valid until the next run): [T, V] for all, [n_spans, V] for last.
    tensor run(const tensor& ids, const std::vector<seq_span>& spans, logits_rows which);

    // Called by prefill() for logits_rows::all with each chunk's logits ([n, V], backend memory, valid until the
    // next chunk) and the row of `ids` where the chunk starts.
    using chunk_fn = std::function<void(const tensor& logits, int64_t row0)>;

    // The prompt of one sequence (ids int32 [T, 1] in backend memory) in chunks of at most prefill_chunk rows,
    // so that the activations (reserve) stay bounded whatever T is. Every chunk but the last runs with
    // logits_rows::none; the last one with `which`, whose logits are returned ([1, V] for last). For all, every
    // chunk computes its rows' logits and hands them to on_chunk; the returned tensor is then the final
    // chunk's [n_last, V]. The result equals one run() over all T rows up to fp32 summation order.
    // A mark (state set) is taken by the chunk it falls inside, which must hold k_marked_span_min_rows rows.
    tensor prefill(const tensor& ids, seq_state& st, logits_rows which, const chunk_fn& on_chunk = {},
                   const span_mark& mark = {});

    // Convenience for one sequence: host ids -> host logits (rows per `which`), through prefill().
    std::vector<float> run_host(const std::vector<int32_t>& ids, seq_state& st, logits_rows which,
                                const span_mark& mark = {});

    gdn_mode gdn = gdn_mode::auto_select;
    tap_fn tap;
    // Rows per forward step of prefill(): the activation workspace is sized by it (~270 KB a row on the real
    // model). 8192 rather than 4096: faster prefill on the H200 (fuller expert tiles; docs/PERF.md), and the engine with a
    // 128K context still fits in 23.6 GiB (docs/PERF.md).
    static constexpr int64_t DEFAULT_PREFILL_CHUNK = 8192;
    int64_t prefill_chunk = DEFAULT_PREFILL_CHUNK;

    backend& be() { return be_; }
    // Grows each time run() reallocates its buffers (see backend::memory_epoch).
    uint64_t memory_epoch() const { return epoch_; }
    // Allocates buffers for batches of up to T rows (and n_logit_rows rows of logits) ahead of time.
    void reserve(int64_t T, int64_t n_logit_rows);
    int64_t workspace_rows() const { return cap_; }  // batch rows the activation buffers hold now
    // The first `rows` rows of the logits buffer: what run() returned for a step of that many logits rows (a
    // replayed graph of such a step writes them too).
    tensor logits_view(int64_t rows) const { return logits_.t().rows_view(0, rows); }
    const model& mdl() const { return m_; }

  private:
    uint64_t epoch_ = 0;

    backend& be_;
    const model& m_;
    int64_t cap_ = 0, cap_logits_ = 0;
    buffer host_ids_;  // int32 [prompt, 1]: run_host's whole prompt (not part of the step workspace)
    buffer x_, a_, qg_, k_, v_, attn_, qkv_, z_, b_, gate_a_, gdn_out_, sel_, logits_;
    std::vector<int> slot_;  // per layer: index among layers of its kind (KV cache or recurrent state)
};

}  // namespace tansy
