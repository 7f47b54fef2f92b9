#include "runtime/decode_step.h"

#include <atomic>
#include <cstring>

#include "core/check.h"
#include "runtime/engine.h"
#include "sampling/sampler_math.h"

namespace tansy {

namespace {
std::atomic<uint64_t> g_next_uid{1};
}

decode_step::decode_step(engine& eng, int max_slots, bool graphs)
    : eng_(eng), be_(eng.be()), max_slots_(max_slots), graphs_(graphs && eng.be().supports_graphs()),
      uid_(g_next_uid++), n_valid_(eng.n_valid_tokens()) {
    TANSY_CHECK(max_slots >= 1 && max_slots < (1 << 20), "decode_step: %d slots", max_slots);
    tok_ = be_.alloc(max_slots + 1, 1, dtype::i32);
    params_ = be_.alloc(max_slots + 1, k_row_sampling_cols, dtype::f32);
    rng_ = be_.alloc(max_slots + 1, 2, dtype::i32);
    row_slot_ = be_.alloc(max_slots, 1, dtype::i32);
    ids_ = be_.alloc(max_slots, 1, dtype::i32);
    next_ = be_.alloc(max_slots, 1, dtype::i32);
    one_slot_ = be_.alloc(1, 1, dtype::i32);
    pen_ = be_.alloc(max_slots + 1, k_adjust_cols, dtype::f32);
    mask_ = be_.alloc(max_slots + 1, mask_words(n_valid_), dtype::i32);  // 31 KB a slot at 248K ids: from the start,
                                                                         // so graphs never hold a stale pointer
    bias_ = be_.alloc(max_slots + 1, 2 * k_device_max_bias, dtype::i32);
    adjusting_.assign((size_t)max_slots + 1, false);
    masking_.assign((size_t)max_slots + 1, false);
    host_pen_.assign((size_t)(max_slots + 1) * k_adjust_cols, 0.0f);
    for (int s = 0; s <= max_slots; s++) host_pen_[(size_t)s * k_adjust_cols + 2] = 1.0f;  // repetition 1: none
    host_params_.assign((size_t)(max_slots + 1) * k_row_sampling_cols, 0.0f);
    lp_top_ = be_.alloc(max_slots + 1, 1, dtype::i32);
    lp_host_.assign((size_t)max_slots + 1, -1);
    be_.upload(lp_top_.t(), lp_host_.data());
    lp_rec_ = be_.alloc(max_slots, k_logprob_words, dtype::i32);
    pinned_ = be_.alloc_host((size_t)k_ring * (size_t)max_slots * (1 + k_logprob_words) * sizeof(int32_t));
    fences_.assign(k_ring, 0);
    ring_logprobs_.assign(k_ring, 0);
    // the forward pass's buffers for a full batch now, so that growing them later does not invalidate graphs
    eng_.fwd().reserve(max_slots, max_slots);
}

decode_step::~decode_step() {
    try {
        be_.synchronize();  // no queued step may still write the buffers freed below
    } catch (const std::exception&) {
    }
    for (const auto& [key, mark] : captured_) be_.drop_graph(key);
}

void decode_step::bind(int slot, const sampling_params& p, const logit_adjust* adjust, int logprobs) {
    TANSY_CHECK(slot >= 0 && slot < max_slots_, "decode_step: slot %d of %d", slot, max_slots_);
    TANSY_CHECK(logprobs >= -1 && logprobs <= k_max_top_logprobs, "decode_step: %d top log-probs (at most %d)", logprobs,
                k_max_top_logprobs);
    TANSY_CHECK(logprobs < 0 || n_valid_ <= k_device_max_logprob_ids, "decode_step: log-probs over %lld ids",
                (long long)n_valid_);
    lp_host_[(size_t)slot] = logprobs;
    be_.upload(lp_top_.t().rows_view(slot, 1), &lp_host_[(size_t)slot]);
    if (logprobs >= 0 && adjust) ensure_raw();
    float* a = host_params_.data() + (size_t)slot * k_row_sampling_cols;
    pack_row_sampling(a, p, n_valid_);
    be_.upload(params_.t().rows_view(slot, 1), a);
    const uint64_t st = sampling_math::rng_start(p.seed);
    be_.upload(rng_.t().rows_view(slot, 1), &st);

    float* pen = host_pen_.data() + (size_t)slot * k_adjust_cols;
    std::fill(pen, pen + k_adjust_cols, 0.0f);
    pen[2] = 1.0f;
    if (adjust) {
        TANSY_CHECK(fits_on_device(adjust->penalties, adjust->bias), "decode_step: %zu logit_bias entries (at most %lld)",
                    adjust->bias.size(), (long long)k_device_max_bias);
        const penalty_params& pp = adjust->penalties;
        pen[0] = pp.presence, pen[1] = pp.frequency, pen[2] = pp.repetition, pen[3] = 1.0f;
        pen[4] = (float)adjust->bias.size();
        std::vector<int32_t> b((size_t)2 * k_device_max_bias, -1);
        for (size_t i = 0; i < adjust->bias.size(); i++) {
            b[2 * i] = adjust->bias[i].first;
            memcpy(&b[2 * i + 1], &adjust->bias[i].second, sizeof(float));
        }
        be_.upload(bias_.t().rows_view(slot, 1), b.data());
        if (!counts_) counts_ = be_.alloc(max_slots_ + 1, n_valid_, dtype::i32);
        std::vector<int32_t> c((size_t)n_valid_, 0);
        if (pp.repetition != 1.0f && adjust->prompt)
            for (int32_t id : *adjust->prompt)
                if (id >= 0 && id < n_valid_) c[(size_t)id] = k_count_prompt_bit;
        be_.upload(counts_.t().rows_view(slot, 1), c.data());
    }
    adjusting_[(size_t)slot] = adjust != nullptr;
    masking_[(size_t)slot] = false;
    upload_pen(slot);
}

void decode_step::upload_pen(int slot) {
    be_.upload(pen_.t().rows_view(slot, 1), host_pen_.data() + (size_t)slot * k_adjust_cols);
}

// The raw logits of a step that adjusts a slot with log-prob records are copied aside before the adjustments:
// room for a full step, allocated once (so that no captured graph holds a stale pointer), when such a slot first
// appears.
void decode_step::ensure_raw() {
    if (!raw_) raw_ = be_.alloc(max_slots_, eng_.cfg().vocab, dtype::f32);
}

void decode_step::set_mask(int slot, const uint32_t* words) {
    TANSY_CHECK(slot >= 0 && slot < max_slots_, "decode_step: slot %d of %d", slot, max_slots_);
    if (lp_host_[(size_t)slot] >= 0) ensure_raw();
    be_.upload(mask_.t().rows_view(slot, 1), words);
    if (!masking_[(size_t)slot]) {
        masking_[(size_t)slot] = true;
        host_pen_[(size_t)slot * k_adjust_cols + 5] = 1.0f;
        upload_pen(slot);
    }
}

void decode_step::clear_mask(int slot) {
    TANSY_CHECK(slot >= 0 && slot < max_slots_, "decode_step: slot %d of %d", slot, max_slots_);
    if (!masking_[(size_t)slot]) return;
    masking_[(size_t)slot] = false;
    host_pen_[(size_t)slot * k_adjust_cols + 5] = 0.0f;
    upload_pen(slot);
}

decode_step::pick_flags decode_step::flags_of(const std::vector<int32_t>& slots) const {
    pick_flags f;
    for (int32_t s : slots) {
        const bool adjusted = adjusting_[(size_t)s] || masking_[(size_t)s], records = lp_host_[(size_t)s] >= 0;
        f.sampling = f.sampling || host_params_[(size_t)s * k_row_sampling_cols] > 0;
        f.adjust = f.adjust || adjusted;
        f.count = f.count || adjusting_[(size_t)s];
        f.logprobs = f.logprobs || records;
        f.raw = f.raw || (records && adjusted);
    }
    return f;
}

void decode_step::set_token(int slot, int32_t id) {
    TANSY_CHECK(slot >= 0 && slot < max_slots_, "decode_step: slot %d of %d", slot, max_slots_);
    be_.upload(tok_.t().rows_view(slot, 1), &id);
}

int32_t decode_step::pick_prompt(int slot, const tensor& logits) {
    TANSY_CHECK(slot >= 0 && slot < max_slots_ && logits.rows == 1, "decode_step::pick_prompt: slot %d, %lld rows",
                slot, (long long)logits.rows);
    const int32_t s = slot;
    be_.upload(one_slot_.t(), &s);
    const tensor nx = next_.t().rows_view(0, 1);
    pick_flags f = flags_of({s});
    f.logprobs = f.raw = false;  // engine::generate reports no log-probs
    pick(nx, logits, one_slot_.t(), f);
    int32_t id = 0;
    be_.download(&id, nx);
    return id;
}

// next = each logits row's argmax, or its slot's device draw, after the slots' penalties and bias where any
// row has them (in place: logits() then shows adjusted rows for those slots); then into the slots' next input
// tokens, and counted for the penalties. Rows of slots with log-probs get their records, from the raw logits.
void decode_step::pick(const tensor& next, const tensor& logits, const tensor& slots, const pick_flags& f) {
    const tensor raw = f.raw ? raw_.t().rows_view(0, logits.rows) : logits;
    if (f.raw) be_.copy(raw, logits);  // the adjustments work in place
    if (f.adjust) be_.adjust_logits(logits, n_valid_, slots, pen_.t(), counts_.t(), bias_.t(), mask_.t());
    be_.argmax(next, logits, n_valid_);
    if (f.sampling) be_.sample_rows(next, logits, n_valid_, params_.t(), rng_.t(), slots);
    be_.scatter_slots(tok_.t(), next, slots);
    if (f.count) be_.count_picks(counts_.t(), next, slots, pen_.t());
    if (f.logprobs)
        be_.logprob_rows(lp_rec_.t().rows_view(0, logits.rows), raw, n_valid_, next, slots, lp_top_.t());
}

// Ring entry t % k_ring of pinned memory: the picks, then the log-prob records.
int32_t* decode_step::ring_entry(uint64_t t) const {
    return (int32_t*)pinned_.get() + (size_t)(t % k_ring) * (size_t)max_slots_ * (1 + k_logprob_words);
}

// The picks of step `++launched_` (its first `n` rows of next_), and its records where it made them, into its
// ring entry.
uint64_t decode_step::copy_out(int64_t n, bool logprobs) {
    const uint64_t t = ++launched_;
    int32_t* out = ring_entry(t);
    be_.download_async(out, next_.t().rows_view(0, n));
    if (logprobs) be_.download_async(out + max_slots_, lp_rec_.t().rows_view(0, n));
    ring_logprobs_[t % k_ring] = logprobs;
    fences_[t % k_ring] = be_.fence();
    return t;
}

void decode_step::run_ops(int64_t B, const pick_flags& f, const std::vector<seq_span>& spans) {
    const tensor ids = ids_.t().rows_view(0, B), rs = row_slot_.t().rows_view(0, B);
    be_.gather_slots(ids, tok_.t(), rs);
    logits_ = eng_.fwd().run(ids, spans, logits_rows::last);
    pick(next_.t().rows_view(0, B), logits_, rs, f);
}

// A step with prompt chunks: decode rows first (one token each), then each chunk's span; one logits row per
// span. Eager, in buffers of its own, so that no captured graph refers to memory it grows.
decode_step::pick_flags decode_step::run_mixed(const std::vector<row>& rows, const std::vector<prompt_chunk>& chunks) {
    const int64_t B = (int64_t)rows.size(), C = (int64_t)chunks.size();
    int64_t T = B;
    for (const prompt_chunk& c : chunks) {
        TANSY_CHECK(c.state && c.ids && c.n >= 1 && c.slot >= 0 && c.slot < max_slots_, "decode_step: a prompt chunk of %lld tokens, slot %d",
                    (long long)c.n, c.slot);
        T += c.n;
    }
    TANSY_CHECK(B + C <= max_slots_, "decode_step: %lld rows and %lld prompt chunks (%d slots)", (long long)B, (long long)C,
                max_slots_);
    if (!mixed_ids_ || mixed_ids_.t().rows < T) mixed_ids_ = be_.alloc(std::max<int64_t>(T, 2 * max_slots_), 1, dtype::i32);
    if (!mixed_slot_) mixed_slot_ = be_.alloc(max_slots_, 1, dtype::i32);
    std::vector<int32_t> slots;
    std::vector<seq_span> spans;
    for (int64_t r = 0; r < B; r++) {
        slots.push_back(rows[(size_t)r].slot);
        spans.push_back(seq_span{rows[(size_t)r].state, r, 1, rows[(size_t)r].state->n_past()});
    }
    int64_t at = B;
    for (const prompt_chunk& c : chunks) {
        slots.push_back(c.last ? c.slot : max_slots_);
        be_.upload(mixed_ids_.t().rows_view(at, c.n), c.ids);
        spans.push_back(seq_span{c.state, at, c.n, c.state->n_past(), c.mark_state, c.mark_state ? c.mark : 0});
        at += c.n;
    }
    const pick_flags f = flags_of(slots);
    const tensor ms = mixed_slot_.t().rows_view(0, B + C);
    be_.upload(ms, slots.data());
    const tensor ids = mixed_ids_.t().rows_view(0, T);
    if (B > 0) be_.gather_slots(ids.rows_view(0, B), tok_.t(), ms.rows_view(0, B));
    logits_ = eng_.fwd().run(ids, spans, logits_rows::last);
    pick(next_.t().rows_view(0, B + C), logits_, ms, f);
    return f;
}

uint64_t decode_step::launch(const std::vector<row>& rows, const std::vector<prompt_chunk>& chunks) {
    const int64_t B = (int64_t)rows.size();
    if (!chunks.empty()) {
        for (const row& w : rows)
            TANSY_CHECK(w.slot >= 0 && w.slot < max_slots_ && w.state, "decode_step: a row of slot %d", w.slot);
        const pick_flags f = run_mixed(rows, chunks);
        return copy_out(B + (int64_t)chunks.size(), f.logprobs);
    }
    TANSY_CHECK(B >= 1 && B <= max_slots_, "decode_step: a step of %lld rows (%d slots)", (long long)B, max_slots_);
    std::vector<int32_t> slots((size_t)B);
    std::vector<seq_span> spans((size_t)B);
    const int64_t capacity = rows[0].state->capacity();
    for (int64_t r = 0; r < B; r++) {
        const row& w = rows[(size_t)r];
        TANSY_CHECK(w.slot >= 0 && w.slot < max_slots_ && w.state, "decode_step: row %lld slot %d", (long long)r, w.slot);
        if (w.state->n_past() + 1 > w.state->capacity())
            fail("sequence of %lld tokens exceeds the context capacity of %lld", (long long)(w.state->n_past() + 1),
                 (long long)w.state->capacity());
        slots[(size_t)r] = w.slot;
        spans[(size_t)r] = seq_span{w.state, r, 1, w.state->n_past()};
    }
    if (row_slot_rows_ != B || slots != row_slot_host_) {
        be_.upload(row_slot_.t().rows_view(0, B), slots.data());
        row_slot_host_ = slots;
        row_slot_rows_ = B;
    }
    // One graph per (rows, pick_flags), keyed apart from other decode_steps on the backend; it holds the states'
    // capacity (baked into the kernels) and the memory epochs it was recorded at, and is recorded again when
    // either differs. Span lengths are all 1 here: prepare_step's contract. (counts_ and raw_ exist before any
    // step that uses them: bind and set_mask allocate them.)
    const pick_flags f = flags_of(slots);
    const uint64_t key = (uid_ << 26) ^ ((uint64_t)B << 5) ^ ((uint64_t)f.raw << 4) ^ ((uint64_t)f.logprobs << 3) ^
                         ((uint64_t)f.count << 2) ^ ((uint64_t)f.adjust << 1) ^ (uint64_t)f.sampling;
    const shape_mark now{capacity, be_.memory_epoch(), eng_.fwd().memory_epoch()};
    bool same_capacity = true;
    for (const row& w : rows) same_capacity = same_capacity && w.state->capacity() == capacity;
    const bool graph = graphs_ && same_capacity;
    auto c = captured_.find(key);
    auto w = warm_.find(key);
    if (graph && c != captured_.end() && c->second == now) {
        check_one_span_per_state(spans);  // (a replay skips forward_pass::run and its checks)
        be_.prepare_step(spans);
        be_.replay(key);
        for (const row& r : rows) r.state->set_n_past(r.state->n_past() + 1);
        logits_ = eng_.fwd().logits_view(B);
    } else if (graph && w != warm_.end() && w->second == now) {
        // the eager step before settled every buffer of this shape: record one step, then run it
        be_.prepare_step(spans);
        be_.capture_begin();
        try {
            run_ops(B, f, spans);
        } catch (...) {
            be_.capture_abort();
            for (const row& r : rows) r.state->set_n_past(spans[(size_t)(&r - rows.data())].pos0);
            throw;
        }
        be_.capture_end(key);
        // capture only recorded: the states' host mirrors advanced as if it ran; undo that before the replay
        for (const row& r : rows) r.state->set_n_past(r.state->n_past() - 1);
        be_.replay(key);
        for (const row& r : rows) r.state->set_n_past(r.state->n_past() + 1);
        captured_[key] = now;
    } else {
        run_ops(B, f, spans);
        warm_[key] = {capacity, be_.memory_epoch(), eng_.fwd().memory_epoch()};
    }
    return copy_out(B, f.logprobs);
}

const int32_t* decode_step::wait(uint64_t ticket) {
    TANSY_CHECK(ticket >= 1 && ticket <= launched_ && launched_ - ticket < (uint64_t)k_ring,
                "decode_step::wait: step %llu is not in flight (%llu launched)", (unsigned long long)ticket,
                (unsigned long long)launched_);
    be_.wait_fence(fences_[ticket % k_ring]);
    return ring_entry(ticket);
}

const int32_t* decode_step::logprob_records(uint64_t ticket) const {
    TANSY_CHECK(ticket >= 1 && ticket <= launched_ && launched_ - ticket < (uint64_t)k_ring,
                "decode_step::logprob_records: step %llu is not in flight (%llu launched)", (unsigned long long)ticket,
                (unsigned long long)launched_);
    return ring_logprobs_[ticket % k_ring] ? ring_entry(ticket) + max_slots_ : nullptr;
}

}  // namespace tansy
