// Continuous batching over one engine. A single engine-owner thread (the only thread that touches the engine
// and its backend, which are single-threaded) loops:
//   1. takes cancellations (their states are freed once no step in flight uses them);
//   2. admits queued sequences (FIFO) while the batch is under max_batch and their state fits the memory
//      budget (the prefix cache's bytes included: it is evicted from first); each takes a decode_step slot
//      (runtime/decode_step.h) holding its next token, sampling parameters and RNG on the device, and restores
//      the longest cached prefix of its prompt (runtime/prefix_cache.h) into its new state: its prefill starts
//      after it, in pieces that end where the cache wants a checkpoint;
//   3. runs one step (decode_step::launch): one token for every running sequence, plus the next pieces of the
//      prompts being prefilled in the same forward pass (a mixed step) - prompt tokens up to prefill_budget rows
//      in all (at least a quarter of it) while others decode, so none waits longer than one bounded piece between
//      two tokens; a prompt alone goes in the engine's prefill chunks (engine::generate's, so a lone greedy
//      request gives exactly its tokens);
//   4. reports each pick to its sequence's sink and ends sequences at a stop id or max_tokens. Picks are made
//      on the device (argmax, or a seeded draw), after the row's penalties, logit_bias and grammar mask (the
//      host computes the mask from the grammar's state before each step of such a row); log-probs come from a
//      record the device makes of the row's raw logits (its log-sum-exp, the pick's logit, the top ones); rows
//      that need the distribution (sampling the device does not draw) are chosen on the host from their logits
//      row only. Decode-only steps whose rows need nothing from the host are queued one ahead of it.
// Submission is bounded: a full queue is refused at once (the HTTP layer answers 429 with Retry-After).
//
// Text is not the scheduler's business: stop strings, detokenisation and parsing happen where the sink's
// events are consumed (the HTTP worker), which cancels the sequence when a stop string matches.
#pragma once
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "runtime/decode_step.h"
#include "runtime/engine.h"
#include "runtime/prefix_cache.h"
#include "runtime/request.h"
#include "runtime/step_pacer.h"
#include "sampling/sampler.h"

namespace tansy {

// Restricts which tokens may come next (JSON mode, forced tool calls). Lives on the engine thread only.
class token_constraint {
  public:
    virtual ~token_constraint() = default;
    // false while the constraint lets everything through (e.g. during reasoning): allow() is then not called.
    virtual bool active() const = 0;
    // Writes which ids may come next, as the device's mask takes them: bit id % 32 of words[id / 32] set where
    // id may come, every one of the mask_words(n_valid) words written (ids from n_valid on clear). Must leave at
    // least one id allowed.
    virtual void allow(uint32_t* words, int64_t n_valid, int64_t tokens_left) = 0;
    virtual void accept(int32_t id) = 0;
    // allow() applied to a row of n_valid logits (the host's pick): ids that may not come get -infinity.
    // words: scratch for the bits.
    void mask(float* logits, int64_t n_valid, int64_t tokens_left, std::vector<uint32_t>& words) {
        words.resize((size_t)mask_words(n_valid));
        allow(words.data(), n_valid, tokens_left);
        for (int64_t w = 0; w < (int64_t)words.size(); w++) {
            const uint32_t bits = words[(size_t)w];
            if (bits == ~0u) continue;
            for (int64_t v = w * 32; v < std::min(n_valid, w * 32 + 32); v++)
                if (!(bits >> (v % 32) & 1u)) logits[v] = -std::numeric_limits<float>::infinity();
        }
    }
};

using sched_clock = std::chrono::steady_clock;

struct token_event {
    int32_t id = -1;
    sched_clock::time_point t;
    // with logprobs requested: the chosen token's log-probability (model distribution, before penalties and
    // constraints) and the top alternatives, most likely first
    float logprob = 0.0f;
    std::vector<std::pair<int32_t, float>> top;
};

enum class finish_reason { stop, length, cancelled, shutdown, error };
const char* finish_reason_name(finish_reason r);

struct finish_event {
    finish_reason reason = finish_reason::stop;
    std::string error;  // for finish_reason::error
    int64_t prompt_tokens = 0, generated = 0;
    int64_t cached_tokens = 0;  // prompt tokens restored from the prefix cache (not computed)
    double queue_s = 0, prefill_s = 0;  // waiting for admission; the prompt's forward
};

// Where a sequence's results go. Called on the engine thread (never under the scheduler's lock), so
// implementations must be quick; they may call scheduler::cancel().
class sequence_sink {
  public:
    virtual ~sequence_sink() = default;
    virtual void on_token(const token_event& e) = 0;
    virtual void on_finish(const finish_event& e) = 0;  // exactly once, last
};

// One sequence of the batch: the request's settings (max_tokens >= 1: the caller resolves -1 against its
// context; a stop id ends it with finish_reason::stop), its prompt, and where its tokens go.
struct sequence_request : generation_params {
    std::vector<int32_t> prompt;
    // false: every token is chosen on the host from its downloaded logits row, even where the device could pick
    // it (the reference the device's picks, adjustments and log-prob records are tested against)
    bool device_pick = true;
    std::unique_ptr<token_constraint> constraint;
    std::shared_ptr<sequence_sink> sink;
};

struct scheduler_options {
    int max_batch = 16;                 // sequences decoded together
    int max_queue = 64;                 // admitted-but-waiting sequences; beyond: submit() refuses
    size_t state_budget = size_t(8) << 30;  // bytes of sequence state (KV cache + recurrent state) in use at most
    // rows a step carries while sequences decode: their decode rows, and prompt tokens up to this many rows in
    // all (prompt_tokens_beside; a prompt alone goes in the engine's prefill chunks). Bounds how long a running
    // stream waits between two tokens.
    int64_t prefill_budget = 2048;
    // > 1: while sequences decode, a step's prompt tokens (at most prompt_tokens_beside) are sized from measured step
    // times so that the step lasts about this many decode-only steps (runtime/step_pacer.h); 0: all of those
    double prefill_pace = 0;
    // > 0: every state gets this capacity (the CUDA backend batches only sequences of equal capacity; the CPU
    // backend grows its KV cache on demand, so there it costs nothing); 0: each gets prompt + max_tokens.
    int64_t seq_capacity = 0;
    // Prefix cache (runtime/prefix_cache.h), owned by the caller; nullptr: none. Its bytes count against
    // state_budget: admission evicts from it before it refuses a sequence.
    prefix_cache* cache = nullptr;
};

// Prompt tokens a step may carry beside `decode_rows` decode rows: the step filled to `budget` rows, but at least
// a quarter of the budget (prompts progress beside any number of streams) and one token. A step of a round
// number of rows fills the dense GEMMs' token tiles: on the H100 a 2,048-token prompt took 56.9 ms, 2,112
// tokens 61.1 (16 column blocks of 128 outputs x 9 tiles of 256 tokens leave a second wave of 12 CTAs).
inline int64_t prompt_tokens_beside(int64_t budget, int64_t decode_rows) {
    return std::max({budget - decode_rows, budget / 4, int64_t(1)});
}

struct scheduler_stats {
    int active = 0, queued = 0;
    size_t state_bytes = 0, state_budget = 0;
    uint64_t steps = 0, decode_rows = 0;  // decode forwards, and the sequences they carried
    uint64_t prompt_tokens = 0, generated_tokens = 0;
    uint64_t host_picks = 0;  // tokens chosen on the host from a downloaded logits row
    prefix_cache_stats cache;  // the prefix cache's (its bytes count within state_budget); zero without one
};

class scheduler {
  public:
    scheduler(engine& eng, scheduler_options opt);
    ~scheduler();  // shutdown(0)
    scheduler(const scheduler&) = delete;
    scheduler& operator=(const scheduler&) = delete;

    enum class submit_status { ok, queue_full, shutting_down, too_large };
    // Thread-safe. On ok the sink will get its events; otherwise it gets none. `id` must be unique.
    submit_status submit(uint64_t id, sequence_request&& r);
    // Thread-safe: the sequence ends (finish_reason::cancelled) and its state is freed at the next iteration.
    void cancel(uint64_t id);
    // Stops admitting; running sequences may finish until `grace` has passed, then are ended with
    // finish_reason::shutdown, as are the queued ones at once. Joins the engine thread. Idempotent.
    void shutdown(std::chrono::milliseconds grace);
    scheduler_stats stats() const;
    // Bytes of state a sequence of this prompt and capacity is expected to need when admitted.
    size_t state_estimate(int64_t prompt_tokens, int64_t capacity) const;
    const scheduler_options& options() const { return opt_; }

  private:
    struct sequence;
    void loop();
    void admit(std::vector<sequence*>& fresh);
    struct chunk_plan {
        sequence* seq = nullptr;
        int64_t n = 0;      // prompt tokens in this piece
        bool last = false;  // the prompt's last piece: the step picks its first token
        int64_t mark = 0;   // a prefix-cache checkpoint position inside the piece (prefix_cache::next_piece)
    };
    std::vector<chunk_plan> next_chunks(int64_t decode_rows);
    void step();
    // The next token of s from its logits row (host; nullptr: the device's argmax is the token): log-probs,
    // penalties, constraint mask, sampler. Touches only s (its sampler and constraint) and `scratch`, so the
    // rows of a batch are chosen in parallel; emit() then delivers in batch order.
    token_event choose(sequence& s, const float* row, int32_t device_argmax, std::vector<float>& scratch);
    void emit(sequence& s, token_event ev);
    void finish(sequence& s, finish_reason r, const std::string& error = "");
    void sweep_finished();
    bool store_finished(sequence& s);  // true when it went into the prefix cache
    void release_free_memory();
    // An idle server hands freed memory back after this long without work (scheduler::loop).
    static constexpr std::chrono::milliseconds k_release_after{200};
    bool needs_host_logits(const sequence& s) const;
    void update_mask(sequence& s);
    size_t running_bytes() const;
    void trim_cache();
    bool uses_cache(const sequence& s) const;
    int64_t capacity_for(int64_t tokens) const { return opt_.seq_capacity > 0 ? opt_.seq_capacity : tokens; }

    struct step_in_flight {
        uint64_t ticket = 0;
        std::vector<sequence*> rows;     // decode rows: logits rows [0, rows)
        std::vector<chunk_plan> chunks;  // prompt pieces: logits rows [rows, rows + chunks)
        bool sync = false;  // prompt pieces, or a row chosen on the host or that may turn so: not queued ahead
        sched_clock::time_point launched;
    };
    std::vector<sequence*> decodable() const;
    void drain();

    engine& eng_;
    scheduler_options opt_;
    size_t base_bytes_ = 0, per_token_bytes_ = 0;
    bool preallocated_ = false;  // the backend allocates a state's whole capacity up front

    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::unique_ptr<sequence>> queue_;  // guarded by mu_
    std::unordered_set<uint64_t> cancels_;         // guarded by mu_
    bool shutting_down_ = false, stop_ = false;    // guarded by mu_
    sched_clock::time_point deadline_;             // guarded by mu_
    scheduler_stats stats_;                        // guarded by mu_ (copied out by stats())

    // engine thread only
    std::vector<std::unique_ptr<sequence>> active_;
    std::unique_ptr<decode_step> step_;
    std::vector<int> free_slots_;
    std::optional<step_in_flight> pending_;
    step_pacer pacer_;
    sched_clock::time_point last_done_{};  // when the last step's picks were read
    std::vector<float> host_logits_, scratch_;
    std::vector<uint32_t> mask_bits_;
    uint64_t prompt_total_ = 0, generated_total_ = 0, host_picks_total_ = 0;
    std::thread thread_;
};

}  // namespace tansy
