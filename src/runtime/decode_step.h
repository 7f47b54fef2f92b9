// One decode step, written once for engine::generate, the scheduler and the bench.
//
// Each sequence being decoded holds a slot (0 .. max_slots - 1). Per slot, backend memory holds the next input
// token, the sampling parameters and the RNG state. A step over rows r = 0 .. B-1 (row r: slot slots[r], state
// states[r]) is
//     ids[r] = tok[slot r]  ->  forward pass, one token per row  ->  next[r] = argmax, or a seeded draw where the
//     slot samples on the device  ->  tok[slot r] = next[r]  ->  next copied to pinned host memory
// and needs nothing from the host, so steps can be queued back to back: a caller may launch step t+1 before it
// reads step t's tokens. On a backend with graphs a step of B rows is one graph replay: one graph per (B, what the
// picks do: pick_flags, capacity), captured at the second step of that shape and again whenever memory moves.
//
// Penalties, logit_bias and a grammar's mask (set by the caller before each step) are applied on the device, per
// slot, before the pick. A slot that asks for log-probs gets, per row, a record of its raw logits (before those
// adjustments: backend::logprob_rows) copied out with the picks: its log-sum-exp, the pick's logit and the top
// ones. Rows whose request needs the whole distribution (sampling settings the device does not draw:
// row_samples_on_device) are picked by the caller on the host from logits(), and the choice goes back to the
// slot with set_token before the next step.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "sampling/sampler.h"

namespace tansy {

class engine;

class decode_step {
  public:
    // graphs: replay steps as graphs where the backend has them (false: every step runs its ops eagerly).
    decode_step(engine& eng, int max_slots, bool graphs = true);
    ~decode_step();
    decode_step(const decode_step&) = delete;
    decode_step& operator=(const decode_step&) = delete;

    int max_slots() const { return max_slots_; }

    // Penalties and logit_bias a slot applies on the device before its pick (backend::adjust_logits), as the
    // host would (scheduler::choose). The prompt's ids count for the repetition penalty.
    struct logit_adjust {
        penalty_params penalties;
        std::vector<std::pair<int32_t, float>> bias;  // at most k_device_max_bias entries
        const std::vector<int32_t>* prompt = nullptr;
    };
    static bool fits_on_device(const penalty_params& p, const std::vector<std::pair<int32_t, float>>& bias) {
        return (p.any() || !bias.empty()) && (int64_t)bias.size() <= k_device_max_bias;
    }
    // A sequence takes `slot`: its sampling parameters, and its RNG from the start of its seed's stream; with
    // `adjust`, the penalties and bias its rows get on the device (none without); `logprobs`, the log-prob records
    // its rows get (-1 none, 0 the pick's, 1..k_max_top_logprobs the top ones too).
    void bind(int slot, const sampling_params& p, const logit_adjust* adjust = nullptr, int logprobs = -1);
    // A grammar's mask for the slot's next pick (bit id % 32 of word id / 32 set where id may come:
    // mask_words(n_valid) words), applied after its penalties and bias; it holds until cleared or rebound.
    void set_mask(int slot, const uint32_t* words);
    void clear_mask(int slot);
    // The slot's next input token, decided on the host.
    void set_token(int slot, int32_t id);

    // After a prompt's last chunk: the slot's first token from the prompt's logits ([1, V], backend memory),
    // picked as a step picks (argmax or the slot's device draw). Synchronous; returns the token.
    int32_t pick_prompt(int slot, const tensor& logits);

    struct row {
        int slot = 0;
        seq_state* state = nullptr;
    };
    // A piece of a prompt that runs in the same forward pass as the decode rows (a mixed step): its state
    // advances by n tokens. The last piece of a prompt picks the slot's first token; earlier pieces pick nothing.
    struct prompt_chunk {
        int slot = 0;
        seq_state* state = nullptr;
        const int32_t* ids = nullptr;  // host
        int64_t n = 0;
        bool last = false;
        seq_state* mark_state = nullptr;  // seq_span::mark_state: a checkpoint after the piece's first mark tokens
        int64_t mark = 0;
    };
    // Queues one step over `rows` (every state advances by one token; each must have room for it) and `chunks`.
    // A step with prompt chunks runs eagerly (its shape is new each time). Returns the step's ticket for wait().
    uint64_t launch(const std::vector<row>& rows, const std::vector<prompt_chunk>& chunks = {});
    // Blocks until step `ticket` (one of the last k_ring launched) has finished; its picks, rows first and then
    // one per chunk (meaningful for last chunks), valid until k_ring more steps are launched.
    const int32_t* wait(uint64_t ticket);
    // After wait(ticket): the log-prob records of that step (sampling/logprobs.h: k_logprob_words each), one per
    // pick in wait()'s order, meaningful for the rows of slots bound with logprobs >= 0; nullptr when no row of the
    // step asked for them. Valid as long as the picks.
    const int32_t* logprob_records(uint64_t ticket) const;
    // The logits of the last launched step, [B + chunks, V] in backend memory: valid once it has been waited
    // for, until the next launch.
    const tensor& logits() const { return logits_; }

    static constexpr int k_ring = 4;  // steps whose tokens can be in flight at once

  private:
    // What a step's picks do beyond an argmax, from its rows' slots (each flag: some slot of the step has it).
    struct pick_flags {
        bool sampling = false;  // draws on the device
        bool adjust = false;    // penalties, bias or a mask
        bool count = false;     // penalties or bias: picks are counted
        bool logprobs = false;  // log-prob records
        bool raw = false;       // log-prob records and adjustments in one slot: the raw logits are kept aside first
    };
    pick_flags flags_of(const std::vector<int32_t>& slots) const;
    void run_ops(int64_t B, const pick_flags& f, const std::vector<seq_span>& spans);
    pick_flags run_mixed(const std::vector<row>& rows, const std::vector<prompt_chunk>& chunks);
    void pick(const tensor& next, const tensor& logits, const tensor& slots, const pick_flags& f);
    void upload_pen(int slot);
    void ensure_raw();
    int32_t* ring_entry(uint64_t t) const;
    uint64_t copy_out(int64_t n, bool logprobs);

    engine& eng_;
    backend& be_;
    int max_slots_;
    bool graphs_;
    uint64_t uid_;
    int64_t n_valid_;
    // tok_, params_ and rng_ have one slot more than max_slots: the scratch slot takes the picks of prompt
    // chunks that are not a prompt's last (greedy, never read)
    buffer tok_, params_, rng_, row_slot_, ids_, next_, one_slot_;
    buffer mixed_ids_, mixed_slot_;  // a mixed step's ids and pick -> slot table (never in a graph)
    // logit adjustments (backend.h: k_adjust_cols): pen_, bias_ and mask_ from the start, counts_ ([slots,
    // n_valid] int32, ~1 MB per slot) from the first slot with penalties or bias; adjusting_ and masking_ mirror
    // pen_'s active and masked columns
    buffer pen_, bias_, counts_, mask_;
    // log-prob records: lp_top_ int32 [slots + 1, 1] each slot's setting (-1 none), lp_rec_ int32 [max_slots,
    // k_logprob_words] a step's records, raw_ f32 [max_slots, V] the raw logits of a step that adjusts a slot with
    // records (from the first such slot: ~1 MB per slot)
    buffer lp_top_, lp_rec_, raw_;
    std::vector<int32_t> lp_host_;  // mirrors lp_top_
    std::vector<float> host_pen_;  // [max_slots + 1, k_adjust_cols], mirrors pen_
    std::vector<bool> adjusting_, masking_;
    std::vector<float> host_params_;        // [max_slots, 4], mirrors params_
    std::vector<int32_t> row_slot_host_;    // what row_slot_ holds
    int64_t row_slot_rows_ = -1;
    // per ring entry: int32 [max_slots] picks, then int32 [max_slots, k_logprob_words] log-prob records
    std::shared_ptr<void> pinned_;
    uint64_t launched_ = 0;
    std::vector<uint64_t> fences_;          // per ring entry: the fence of the step that fills it
    std::vector<char> ring_logprobs_;       // per ring entry: whether its step copied out records
    tensor logits_;
    // per graph key: the states' capacity and the memory epochs (backend, forward pass) it was captured at /
    // last run eagerly at
    struct shape_mark {
        int64_t capacity = 0;
        uint64_t be_epoch = 0, fwd_epoch = 0;
        bool operator==(const shape_mark&) const = default;
    };
    std::map<uint64_t, shape_mark> captured_, warm_;
};

}  // namespace tansy
