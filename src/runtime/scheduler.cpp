#include "runtime/scheduler.h"

#include <omp.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <unordered_map>

#include "core/check.h"
#include "core/log.h"
#include "model/config.h"
#include "sampling/logprobs.h"
#include "sampling/sampler_math.h"

namespace tansy {

const char* finish_reason_name(finish_reason r) {
    switch (r) {
        case finish_reason::stop: return "stop";
        case finish_reason::length: return "length";
        case finish_reason::cancelled: return "cancelled";
        case finish_reason::shutdown: return "shutdown";
        case finish_reason::error: return "error";
    }
    return "?";
}

struct scheduler::sequence {
    uint64_t id = 0;
    sequence_request req;
    sampler smp;
    std::unique_ptr<seq_state> st;
    int slot = -1;          // its decode_step slot, from admission until swept
    bool started = false;   // prompt prefilled: its next token is in its slot (backend memory)
    int64_t prefilled = 0;  // prompt tokens processed so far (prompts advance a chunk per scheduler step)
    size_t need = 0;        // state bytes it was admitted on (a state that grows on demand shows less until filled)
    int64_t generated = 0;
    int64_t in_flight = 0;  // decode steps launched for it whose token is not emitted yet
    bool host_always = false;  // every token is chosen on the host (sampling the device does not draw, ...)
    bool device_mask = false;  // a constraint whose mask goes to the device before each pick (update_mask)
    bool done = false;
    std::unordered_map<int32_t, int> counts;  // generated ids (presence/frequency penalties)
    std::unordered_set<int32_t> seen;         // prompt and generated ids (repetition penalty)
    sched_clock::time_point submitted, admitted;
    double prefill_s = 0;
    finish_reason reason = finish_reason::stop;
    // prefix cache: the looked-up prefix (until restored), the prompt tokens it restored, the positions where
    // checkpoints are taken (prefix_cache::plan), where the last one was taken, the checkpoints taken, the one
    // the piece in flight fills at its mark, and the tokens emitted (the state's input after the prompt, for
    // storing prompt + completion)
    prefix_cache::lease hit;
    int64_t cached = 0;
    std::vector<int64_t> marks;
    int64_t last_cp = 0;
    prefix_cache::checkpoints cps;
    std::unique_ptr<seq_state> mark_state;
    std::vector<int32_t> out;

    sequence(uint64_t i, sequence_request&& r, int64_t n_valid)
        : id(i), req(std::move(r)), smp(req.sampling, n_valid), submitted(sched_clock::now()) {}
};

scheduler::scheduler(engine& eng, scheduler_options opt) : eng_(eng), opt_(opt) {
    TANSY_CHECK(opt_.max_batch >= 1 && opt_.max_queue >= 0, "scheduler: max_batch %d, max_queue %d", opt_.max_batch,
                opt_.max_queue);
    // What a state costs: measured on two empty states (a backend that allocates the KV cache up front shows
    // it in the difference); one that grows it on demand is charged the KV bytes of its prompt, from the config.
    const size_t b1 = eng_.new_sequence(1)->bytes(), b2 = eng_.new_sequence(1025)->bytes();
    base_bytes_ = b1;
    preallocated_ = b2 > b1;
    const model_config& c = eng_.cfg();
    per_token_bytes_ = preallocated_ ? (b2 - b1 + 1023) / 1024
                                     : (size_t)2 * (size_t)c.n_full_attention() * (size_t)c.kv_dim() * sizeof(float);
    step_ = std::make_unique<decode_step>(eng_, opt_.max_batch);
    pacer_ = step_pacer(opt_.prefill_pace);
    for (int i = opt_.max_batch - 1; i >= 0; i--) free_slots_.push_back(i);
    stats_.state_budget = opt_.state_budget;
    // note: omp_set_num_threads (engine_options::threads) holds for the thread that called it; a new thread
    // starts from the process default, so the engine thread inherits the caller's setting explicitly.
    const int omp_threads = omp_get_max_threads();
    thread_ = std::thread([this, omp_threads] {
        omp_set_num_threads(omp_threads);
        loop();
    });
}

scheduler::~scheduler() { shutdown(std::chrono::milliseconds(0)); }

size_t scheduler::state_estimate(int64_t prompt_tokens, int64_t capacity) const {
    return base_bytes_ + per_token_bytes_ * (size_t)(preallocated_ ? capacity : prompt_tokens);
}

scheduler::submit_status scheduler::submit(uint64_t id, sequence_request&& r) {
    TANSY_CHECK(r.sink, "submit without a sink");
    if (r.prompt.empty()) fail("the prompt is empty");
    if (r.max_tokens < 1) fail("max_tokens must be >= 1");
    if (r.logprobs > k_max_top_logprobs) fail("top_logprobs must be <= %d", k_max_top_logprobs);
    const int64_t need = (int64_t)r.prompt.size() + r.max_tokens;
    if (opt_.seq_capacity > 0 && need > opt_.seq_capacity)
        fail("prompt of %zu tokens + %lld new tokens exceeds the sequence capacity of %lld", r.prompt.size(),
             (long long)r.max_tokens, (long long)opt_.seq_capacity);
    if (state_estimate((int64_t)r.prompt.size(), capacity_for(need)) > opt_.state_budget) return submit_status::too_large;
    auto s = std::make_unique<sequence>(id, std::move(r), eng_.n_valid_tokens());  // validates sampling params
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (shutting_down_) return submit_status::shutting_down;
        if ((int)queue_.size() >= opt_.max_queue) return submit_status::queue_full;
        queue_.push_back(std::move(s));
        stats_.queued = (int)queue_.size();
    }
    cv_.notify_all();
    return submit_status::ok;
}

void scheduler::cancel(uint64_t id) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        cancels_.insert(id);
    }
    cv_.notify_all();
}

void scheduler::shutdown(std::chrono::milliseconds grace) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (!shutting_down_) {
            shutting_down_ = true;
            deadline_ = sched_clock::now() + grace;
        }
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

scheduler_stats scheduler::stats() const {
    std::lock_guard<std::mutex> lk(mu_);
    scheduler_stats st = stats_;
    if (opt_.cache) st.cache = opt_.cache->stats();
    return st;
}

void scheduler::finish(sequence& s, finish_reason r, const std::string& error) {
    if (s.done) return;
    s.done = true;
    s.reason = r;
    finish_event e;
    e.reason = r;
    e.cached_tokens = s.cached;
    e.error = error;
    e.prompt_tokens = (int64_t)s.req.prompt.size();
    e.generated = s.generated;
    if (s.admitted.time_since_epoch().count())
        e.queue_s = std::chrono::duration<double>(s.admitted - s.submitted).count();
    e.prefill_s = s.prefill_s;
    try {
        s.req.sink->on_finish(e);
    } catch (const std::exception& ex) {
        TANSY_WARN("scheduler: a sink threw from on_finish: %s", ex.what());
    }
}

bool scheduler::needs_host_logits(const sequence& s) const {
    return s.host_always || (s.req.constraint && s.req.constraint->active() && !s.device_mask);
}

// A constrained row picked on the device: the grammar's allowed ids for its next pick go to its slot's mask (the
// constraint writes the bits), or the mask goes while the constraint lets all through.
void scheduler::update_mask(sequence& s) {
    if (!s.device_mask || s.done) return;
    if (!s.req.constraint->active()) return step_->clear_mask(s.slot);
    const int64_t nv = eng_.n_valid_tokens();
    mask_bits_.resize((size_t)mask_words(nv));
    s.req.constraint->allow(mask_bits_.data(), nv, s.req.max_tokens - s.generated);
    step_->set_mask(s.slot, mask_bits_.data());
}

// Bytes of state the running sequences hold: what admission charged them (a state that grows on demand shows
// less until filled), and the checkpoints their prompts have taken so far (not yet in the cache) or are taking.
size_t scheduler::running_bytes() const {
    size_t bytes = 0;
    for (const auto& s : active_) {
        if (!s) continue;
        bytes += std::max(s->need, s->st ? s->st->bytes() : 0);
        for (const auto& cp : s->cps) bytes += cp ? cp->bytes() : 0;
        if (s->mark_state) bytes += s->mark_state->bytes();
    }
    return bytes;
}

// The cache's own budget is its share; the state budget bounds it too, live: after an insert, whatever the
// running sequences leave.
void scheduler::trim_cache() {
    if (!opt_.cache) return;
    const size_t running = running_bytes();
    if (running + opt_.cache->bytes() > opt_.state_budget)
        opt_.cache->evict_to(opt_.state_budget > running ? opt_.state_budget - running : 0);
}

bool scheduler::uses_cache(const sequence& s) const {
    return opt_.cache && opt_.cache->enabled() && s.req.cache_prompt;
}

// A row whose next pick may depend on its last token on the host (a grammar that turns on after the reasoning,
// host-chosen tokens): its steps are not queued ahead of the host.
static bool sync_row(const sequence_request& r, bool host_always) { return host_always || r.constraint != nullptr; }

// row: the sequence's raw logits on the host (nullptr when it needs none); device_argmax: the backend's argmax
// of the same row (what engine::generate feeds back for greedy decoding).
token_event scheduler::choose(sequence& s, const float* row, int32_t device_argmax, std::vector<float>& scratch_) {
    const int64_t nv = eng_.n_valid_tokens();
    token_event ev;
    int32_t id = device_argmax;
    if (row) {
        double lse = 0;  // log-sum-exp of the raw row: logprob(i) = row[i] - lse
        if (s.req.logprobs >= 0) {
            lse = log_sum_exp(row, nv);
            for (const auto& [i, x] : top_logits(row, nv, s.req.logprobs))
                ev.top.emplace_back(i, (float)((double)x - lse));
        }
        const penalty_params& pp = s.req.penalties;
        const bool constrained = s.req.constraint && s.req.constraint->active();
        const bool modify = pp.any() || constrained || !s.req.logit_bias.empty();
        const float* src = row;
        if (modify) {
            scratch_.assign(row, row + nv);
            if (pp.frequency != 0.0f || pp.presence != 0.0f)
                for (const auto& [tok, n] : s.counts)
                    if (tok < nv)
                        scratch_[(size_t)tok] = sampling_math::presence_frequency(scratch_[(size_t)tok], n, pp.presence,
                                                                                  pp.frequency);
            if (pp.repetition != 1.0f)
                for (int32_t tok : s.seen)
                    if (tok < nv) scratch_[(size_t)tok] = sampling_math::repetition(scratch_[(size_t)tok], pp.repetition);
            for (const auto& [tok, bias] : s.req.logit_bias)
                if (tok >= 0 && tok < nv) scratch_[(size_t)tok] += bias;
            // (constrained rows are chosen on the engine thread, never in drain's parallel loop: mask_bits_ is free)
            if (constrained) s.req.constraint->mask(scratch_.data(), nv, s.req.max_tokens - s.generated, mask_bits_);
            src = scratch_.data();
        }
        if (s.req.sampling.temperature > 0.0f) {
            id = s.smp.sample(src, nv);
        } else if (modify) {
            id = argmax(src, nv);
        }
        if (s.req.logprobs >= 0) ev.logprob = (float)((double)row[id] - lse);
    }
    ev.id = id;
    return ev;
}

void scheduler::emit(sequence& s, token_event ev) {
    const int32_t id = ev.id;
    ev.t = sched_clock::now();
    s.generated++;
    generated_total_++;
    if (uses_cache(s)) s.out.push_back(id);
    if (s.req.penalties.frequency != 0.0f || s.req.penalties.presence != 0.0f) s.counts[id]++;
    if (s.req.penalties.repetition != 1.0f) s.seen.insert(id);
    if (s.req.constraint) s.req.constraint->accept(id);
    try {
        s.req.sink->on_token(ev);
    } catch (const std::exception& ex) {
        TANSY_WARN("scheduler: a sink threw from on_token: %s", ex.what());
    }
    if (std::find(s.req.stop_ids.begin(), s.req.stop_ids.end(), id) != s.req.stop_ids.end()) {
        finish(s, finish_reason::stop);
    } else if (s.generated >= s.req.max_tokens) {
        finish(s, finish_reason::length);
    }
}

// The prompt pieces the next step carries, in admission order: while sequences are decoding, as many tokens as
// fill the step to prefill_budget rows with theirs (at least a quarter of the budget: prompts progress beside
// any number of streams), so that none of them waits longer than one bounded piece between two tokens
// (with prefill_pace, as many as keep the step near that many decode steps where a piece's fixed cost allows,
// and none in a step that measures the decode rows alone: step_pacer.h); the engine's whole prefill chunk when
// nothing else runs.
std::vector<scheduler::chunk_plan> scheduler::next_chunks(int64_t decode_rows) {
    std::vector<chunk_plan> out;
    const int64_t chunk = eng_.fwd().prefill_chunk;
    const int64_t beside = prompt_tokens_beside(opt_.prefill_budget, decode_rows);
    int64_t budget = decode_rows > 0 ? pacer_.budget(std::min(beside, chunk), decode_rows) : chunk;
    for (auto& sp : active_) {
        sequence& s = *sp;
        if (s.done || !s.st || s.started) continue;
        const int64_t left = (int64_t)s.req.prompt.size() - s.prefilled;
        if (left <= 0) continue;
        if (budget <= 0) break;
        // a checkpoint position inside the piece is taken by the step, or the piece ends there
        const int64_t T = (int64_t)s.req.prompt.size();
        const prefix_cache::piece pc = prefix_cache::next_piece(s.marks, s.prefilled, budget, T);
        const int64_t n = pc.end - s.prefilled;
        out.push_back({&s, n, n == left, pc.mark});
        budget -= n;
    }
    return out;
}

// The sequences that can take one more decode step, in admission order.
std::vector<scheduler::sequence*> scheduler::decodable() const {
    std::vector<sequence*> batch;
    for (const auto& s : active_)
        if (!s->done && s->started && s->generated + s->in_flight < s->req.max_tokens) batch.push_back(s.get());
    return batch;
}

// Emits the tokens of the step in flight, if any: one per decode row, and the first token of each prompt whose
// last piece it carried. Rows of sequences that ended meanwhile (a stop token in the step before, a cancellation)
// are dropped: that token was computed ahead and is not theirs to report.
void scheduler::drain() {
    if (!pending_) return;
    step_in_flight p = std::move(*pending_);
    pending_.reset();
    const int32_t* toks = step_->wait(p.ticket);
    {
        // the step's time as the streams see it: since the step before it was read, or since its launch when
        // it started after that (a sync step, or one after an idle spell)
        const sched_clock::time_point now = sched_clock::now();
        const double dt = std::chrono::duration<double>(now - std::max(last_done_, p.launched)).count();
        int64_t prompt_tokens = 0;
        for (const chunk_plan& k : p.chunks) prompt_tokens += k.n;
        const int64_t rows = (int64_t)p.rows.size();
        if (rows > 0 && prompt_tokens == 0) pacer_.decode_step(dt, rows);
        if (rows > 0 && prompt_tokens > 0) pacer_.mixed_step(dt, rows, prompt_tokens);
        last_done_ = now;
    }
    struct pick {
        sequence* s;
        int64_t row;  // the step's logits row
    };
    std::vector<pick> picks;
    for (size_t i = 0; i < p.rows.size(); i++) {
        p.rows[i]->in_flight--;
        picks.push_back({p.rows[i], (int64_t)i});
    }
    const double step_s = std::chrono::duration<double>(sched_clock::now() - p.launched).count();
    for (size_t c = 0; c < p.chunks.size(); c++) {
        sequence& s = *p.chunks[c].seq;
        s.in_flight--;
        s.prefill_s += step_s;
        if (uses_cache(s) && !s.done) {
            // nothing else runs on this state now (a step with prompt pieces is waited for before the next)
            try {
                if (p.chunks[c].mark > 0 && s.mark_state)
                    s.cps.push_back(std::move(s.mark_state)), s.last_cp = p.chunks[c].mark;
                if (p.chunks[c].last)
                    opt_.cache->insert(s.req.prompt.data(), s.st->n_past(), *s.st, std::move(s.cps));
                else if (opt_.cache->checkpoint_due(s.marks, s.last_cp, s.prefilled, (int64_t)s.req.prompt.size()))
                    s.cps.push_back(opt_.cache->checkpoint(*s.st)), s.last_cp = s.prefilled;
                trim_cache();
            } catch (const std::exception& e) {  // a snapshot that does not fit costs a later hit, not this request
                TANSY_WARN("scheduler: a prefix cache snapshot failed: %s", e.what());
            }
        }
        s.mark_state.reset();  // one the step filled but that was not kept (the sequence ended meanwhile)
        if (p.chunks[c].last && !s.done) {
            s.started = true;
            prompt_total_ += s.req.prompt.size();
            picks.push_back({&s, (int64_t)(p.rows.size() + c)});
        }
    }
    // Host-chosen picks (sync steps only): their logits rows come down, and the choice replaces the slot's token.
    // Sampling a 248K-token row costs ~0.1-1 ms on the host: the rows are chosen in parallel (each touches only
    // its own sequence), then emitted in order. Constrained rows stay on this thread (a grammar's state is the
    // request's own, but its matcher need not be thread-safe).
    const int64_t n = (int64_t)picks.size();
    std::vector<token_event> ev((size_t)n);
    std::vector<char> host((size_t)n), parallel_row((size_t)n);
    int64_t n_host = 0, n_parallel = 0;
    for (int64_t i = 0; i < n; i++) {
        const sequence& s = *picks[(size_t)i].s;
        ev[(size_t)i].id = toks[picks[(size_t)i].row];
        host[(size_t)i] = !s.done && needs_host_logits(s);
        parallel_row[(size_t)i] = host[(size_t)i] && !s.req.constraint;
        n_host += host[(size_t)i];
        n_parallel += parallel_row[(size_t)i];
    }
    // Device-picked rows with log-probs: from the step's records (their raw logits stay on the device).
    const int32_t* records = step_->logprob_records(p.ticket);
    for (int64_t i = 0; i < n; i++) {
        const sequence& s = *picks[(size_t)i].s;
        if (host[(size_t)i] || s.done || s.req.logprobs < 0) continue;
        TANSY_CHECK(records, "scheduler: a step without the log-prob records of its rows");
        read_logprob_record(records + picks[(size_t)i].row * k_logprob_words, s.req.logprobs, &ev[(size_t)i].logprob,
                            &ev[(size_t)i].top);
    }
    const tensor& logits = step_->logits();
    const int64_t V = logits.cols;
    if (n_host > 0) {
        TANSY_CHECK(p.sync, "scheduler: a host-chosen row in a queued-ahead step");
        host_picks_total_ += (uint64_t)n_host;
        host_logits_.resize((size_t)(n * V));
        for (int64_t i = 0; i < n; i++)
            if (host[(size_t)i]) eng_.be().download(host_logits_.data() + i * V, logits.rows_view(picks[(size_t)i].row, 1));
    }
    std::vector<std::exception_ptr> failed((size_t)n);  // an exception must not leave an OpenMP region
#pragma omp parallel if (n_parallel > 1)
    {
        thread_local std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; i++) {
            if (!parallel_row[(size_t)i]) continue;
            try {
                ev[(size_t)i] = choose(*picks[(size_t)i].s, host_logits_.data() + i * V, ev[(size_t)i].id, scratch);
            } catch (...) {
                failed[(size_t)i] = std::current_exception();
            }
        }
    }
    for (int64_t i = 0; i < n; i++) {
        sequence& s = *picks[(size_t)i].s;
        if (s.done) continue;
        if (failed[(size_t)i]) std::rethrow_exception(failed[(size_t)i]);  // as if chosen here, in order
        const int32_t dev = toks[picks[(size_t)i].row];
        if (host[(size_t)i] && !parallel_row[(size_t)i]) ev[(size_t)i] = choose(s, host_logits_.data() + i * V, dev, scratch_);
        if (host[(size_t)i] && ev[(size_t)i].id != dev) step_->set_token(s.slot, ev[(size_t)i].id);
        emit(s, std::move(ev[(size_t)i]));
    }
}

// One step: every decodable sequence's next token, and the next pieces of the prompts being prefilled (a mixed
// step). A decode-only step whose rows all pick on the device is queued ahead: the next step is launched before
// this one's tokens are read, so the host's work (emitting, the next iteration's bookkeeping) overlaps the
// device's. A step with prompt pieces or host-chosen rows, or whose membership changed, waits first.
void scheduler::step() {
    std::vector<sequence*> batch = decodable();
    std::vector<chunk_plan> chunks = next_chunks((int64_t)batch.size());
    bool sync = !chunks.empty();
    for (sequence* s : batch) sync = sync || sync_row(s->req, s->host_always);
    const bool ahead = pending_ && !sync && !pending_->sync && batch == pending_->rows;
    if (!ahead) {
        drain();
        batch = decodable();  // emitting may have ended some
        chunks = next_chunks((int64_t)batch.size());
        sync = !chunks.empty();
        for (sequence* s : batch) sync = sync || sync_row(s->req, s->host_always);
    }
    if (batch.empty() && chunks.empty()) return;
    // (constrained rows are sync rows: every token they picked before is emitted, and the grammar has taken it)
    for (sequence* s : batch) update_mask(*s);
    for (const chunk_plan& k : chunks)
        if (k.last) update_mask(*k.seq);
    std::vector<decode_step::row> rows;
    rows.reserve(batch.size());
    for (sequence* s : batch) rows.push_back({s->slot, s->st.get()});
    std::vector<decode_step::prompt_chunk> pieces;
    for (chunk_plan& k : chunks) {
        sequence& s = *k.seq;
        if (k.mark > 0) {
            try {
                s.mark_state = opt_.cache->mark_state();
            } catch (const std::exception& e) {  // as a snapshot that does not fit: a later hit is lost
                TANSY_WARN("scheduler: a prefix cache checkpoint failed: %s", e.what());
                k.mark = 0;
            }
        }
        pieces.push_back({s.slot, s.st.get(), s.req.prompt.data() + s.prefilled, k.n, k.last,
                          k.mark > 0 ? s.mark_state.get() : nullptr, k.mark > 0 ? k.mark - s.prefilled : 0});
    }
    step_in_flight next;
    next.launched = sched_clock::now();
    next.ticket = step_->launch(rows, pieces);
    next.rows = batch;
    next.chunks = chunks;
    next.sync = sync;
    for (sequence* s : batch) s->in_flight++;
    for (const chunk_plan& k : chunks) k.seq->prefilled += k.n, k.seq->in_flight++;
    if (ahead) drain();  // the step before, while this one runs
    pending_ = std::move(next);
    if (sync) drain();
    std::lock_guard<std::mutex> lk(mu_);
    stats_.steps++;
    stats_.decode_rows += (uint64_t)batch.size();
}

// Freed sequence states stay in the allocators' free lists (glibc keeps large freed blocks in its arenas once
// it has raised its mmap threshold; the CUDA backend pools device states); once the batch has drained and the
// server stayed idle a moment (loop: k_release_after), hand them back so its memory returns to its idle level.
void scheduler::release_free_memory() {
#ifdef __GLIBC__
    malloc_trim(0);
#endif
    eng_.be().release_free_memory();
}

// Ended sequences leave the batch and free their state and slot, except those in the step still in flight (it
// writes their state): they go once it has been drained.
void scheduler::sweep_finished() {
    bool stored = false;
    auto gone = [&](const std::unique_ptr<sequence>& s) {
        if (!s->done || s->in_flight > 0) return false;
        if (s->slot >= 0) free_slots_.push_back(s->slot);
        stored = store_finished(*s) || stored;
        return true;
    };
    active_.erase(std::remove_if(active_.begin(), active_.end(), gone), active_.end());
    if (stored) trim_cache();  // (not inside remove_if: active_ holds moved-from entries until the erase)
}

// An ended sequence's state goes to the prefix cache as prompt + the tokens it has run (a finished completion:
// the next turn of the conversation starts with it; a cancelled prompt: as far as it got). Not after an error
// (the state may be inconsistent) or while shutting down.
bool scheduler::store_finished(sequence& s) {
    s.hit.release();
    if (!uses_cache(s) || !s.st || s.reason == finish_reason::error || s.reason == finish_reason::shutdown) return false;
    const int64_t n = s.st->n_past(), P = (int64_t)s.req.prompt.size();
    if (n <= 0 || n - P > (int64_t)s.out.size()) return false;
    try {
        std::vector<int32_t> tokens(s.req.prompt.begin(), s.req.prompt.begin() + std::min(n, P));
        if (n > P) tokens.insert(tokens.end(), s.out.begin(), s.out.begin() + (n - P));
        opt_.cache->insert(tokens.data(), n, *s.st, std::move(s.cps));
        return true;
    } catch (const std::exception& e) {
        TANSY_WARN("scheduler: storing a finished sequence in the prefix cache failed: %s", e.what());
        return false;
    }
}

void scheduler::loop() {
    bool idle = true;
    // when the batch drained: freed memory goes back once the server has stayed idle for k_release_after, so a
    // client's next request (a chat's next turn, the next of a benchmark) finds its state's memory still pooled
    std::optional<sched_clock::time_point> release_at;
    for (;;) {
        std::vector<std::unique_ptr<sequence>> dropped, admitted;  // ended while queued; newly admitted
        std::unordered_set<uint64_t> cancels;
        bool expired = false;
        {
            std::unique_lock<std::mutex> lk(mu_);
            auto work = [&] { return stop_ || !cancels_.empty() || !active_.empty() || !queue_.empty(); };
            if (release_at && !cv_.wait_until(lk, *release_at, work)) {
                release_at.reset();
                lk.unlock();
                release_free_memory();
                continue;
            }
            release_at.reset();
            cv_.wait(lk, work);
            cancels.swap(cancels_);
            for (auto it = queue_.begin(); it != queue_.end();) {
                if (shutting_down_ || cancels.count((*it)->id)) {
                    dropped.push_back(std::move(*it));
                    it = queue_.erase(it);
                } else {
                    ++it;
                }
            }
            expired = shutting_down_ && sched_clock::now() >= deadline_;
            if (stop_ && active_.empty() && dropped.empty() && queue_.empty()) {
                stats_.active = 0;
                stats_.queued = 0;
                stats_.state_bytes = 0;
                return;
            }
            // Admission: FIFO, bounded by the batch size and the state budget (prefill_step bounds the prompt
            // tokens processed per step).
            // The prefix cache's bytes count too: it gives memory back (LRU) before a sequence is refused.
            size_t bytes = running_bytes();
            prefix_cache* pc = opt_.cache;
            while (!queue_.empty() && (int)(active_.size() + admitted.size()) < opt_.max_batch) {
                sequence& s = *queue_.front();
                const int64_t T = (int64_t)s.req.prompt.size();
                const size_t need = state_estimate(T, capacity_for(T + s.req.max_tokens));
                const bool alone = active_.empty() && admitted.empty();
                if (uses_cache(s) && !s.hit) s.hit = pc->lookup(s.req.prompt);  // pinned: not evicted below
                if (pc && bytes + need + pc->bytes() > opt_.state_budget) {
                    // the cache gives back what admits the head; when even an empty cache would not, it keeps
                    // its entries (the head waits for running sequences to end), unless the head would run alone
                    if (bytes + need <= opt_.state_budget) pc->evict_to(opt_.state_budget - bytes - need);
                    else if (alone) pc->evict_to(0);
                }
                if (!alone && bytes + need + (pc ? pc->bytes() : 0) > opt_.state_budget) break;
                bytes += need;
                s.need = need;
                admitted.push_back(std::move(queue_.front()));
                queue_.pop_front();
            }
            stats_.queued = (int)queue_.size();
        }
        for (auto& s : dropped)
            finish(*s, cancels.count(s->id) ? finish_reason::cancelled : finish_reason::shutdown);
        for (auto& s : active_) {
            if (cancels.count(s->id)) finish(*s, finish_reason::cancelled);
            if (expired) finish(*s, finish_reason::shutdown);
        }
        sweep_finished();  // cancelled states are freed here, before any further compute
        for (auto& s : admitted) {
            s->admitted = sched_clock::now();
            sequence& seq = *s;
            active_.push_back(std::move(s));
            try {
                TANSY_CHECK(!free_slots_.empty(), "scheduler: no free decode slot");
                seq.slot = free_slots_.back();
                free_slots_.pop_back();
                const sampling_params& sp = seq.req.sampling;
                const int64_t nv = eng_.n_valid_tokens();
                seq.host_always = !seq.req.device_pick || (sp.temperature > 0 && !row_samples_on_device(sp, nv)) ||
                                  (seq.req.logprobs >= 0 && nv > k_device_max_logprob_ids);
                // penalties, logit_bias and a grammar's mask go with the pick: on the device, unless the host
                // picks anyway or the bias list is longer than the device holds
                const bool adjusts = seq.req.penalties.any() || !seq.req.logit_bias.empty();
                const bool device_adjust = adjusts && !seq.host_always &&
                                           decode_step::fits_on_device(seq.req.penalties, seq.req.logit_bias);
                seq.host_always = seq.host_always || (adjusts && !device_adjust);
                seq.device_mask = seq.req.constraint && !seq.host_always;
                if (seq.req.penalties.repetition != 1.0f) seq.seen.insert(seq.req.prompt.begin(), seq.req.prompt.end());
                sampling_params on_device = sp;
                if (seq.host_always) on_device.temperature = 0;  // the slot's pick is an argmax the host replaces
                decode_step::logit_adjust adj{seq.req.penalties, seq.req.logit_bias, &seq.req.prompt};
                // log-prob records on the device for the rows it picks; the host computes them for the others
                step_->bind(seq.slot, on_device, device_adjust ? &adj : nullptr, seq.host_always ? -1 : seq.req.logprobs);
                eng_.check_ids(seq.req.prompt);  // once, at admission (a bad id ends the request with its error)
                seq.st = eng_.new_sequence(capacity_for((int64_t)seq.req.prompt.size() + seq.req.max_tokens));
                if (uses_cache(seq)) {
                    // the longest cached prefix goes into the new state; prefill starts after it
                    if (seq.hit) {
                        seq.cached = seq.hit.tokens();
                        opt_.cache->restore(seq.hit, *seq.st);
                        seq.prefilled = seq.cached;
                    } else {
                        opt_.cache->miss();
                    }
                    seq.marks = opt_.cache->plan(seq.req.prompt, seq.prefilled);
                    seq.last_cp = seq.prefilled;
                }
            } catch (const std::exception& e) {
                seq.st.reset();
                finish(seq, finish_reason::error, e.what());
            }
        }
        sweep_finished();
        try {
            step();
            if (!active_.empty() && std::all_of(active_.begin(), active_.end(), [](const auto& s) { return s->done; }))
                drain();  // nothing left to decode: the step in flight holds only ended rows
        } catch (const std::exception& e) {
            // the step's states are now inconsistent: end every sequence that was in it
            TANSY_WARN("scheduler: a step failed: %s", e.what());
            pending_.reset();
            try {
                eng_.be().synchronize();
            } catch (const std::exception& e2) {
                TANSY_WARN("scheduler: the backend failed too: %s", e2.what());
            }
            for (auto& s : active_) {
                s->in_flight = 0;
                if (s->started || s->prefilled > s->cached) finish(*s, finish_reason::error, e.what());
            }
        }
        sweep_finished();
        size_t bytes = 0;
        for (const auto& s : active_) bytes += s->st ? s->st->bytes() : 0;
        if (active_.empty() && !idle) release_at = sched_clock::now() + k_release_after;
        idle = active_.empty();
        std::lock_guard<std::mutex> lk(mu_);
        stats_.active = (int)active_.size();
        stats_.state_bytes = bytes;
        stats_.prompt_tokens = prompt_total_;
        stats_.generated_tokens = generated_total_;
        stats_.host_picks = host_picks_total_;
    }
}

}  // namespace tansy
