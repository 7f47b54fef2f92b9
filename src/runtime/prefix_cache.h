// Prefix cache: states of earlier prompts and conversations, kept so that a request whose prompt starts with
// the same tokens restores that state and prefills only the rest (a second chat turn, an agent's next call, a
// shared system prompt).
//
// Why snapshots, not just KV blocks: 30 of the 40 layers are Gated DeltaNet layers whose state (conv tail + S,
// ~63 MB per sequence at full size) is a function of every token so far and cannot be rolled back. The state for
// a prefix of length p exists only if it was saved when a sequence stood exactly at p. So the store keeps
//   entries      one per distinct token sequence: the tokens, and a backend state compacted to them (KV rows
//                [0, n) + the recurrent part at n) - the KV of any shorter prefix is the first rows of it;
//   checkpoints  per entry, recurrent-only states (kv_rows = 0) at positions p < n on the entry's path: they
//                borrow KV rows [0, p) from the entry. Restoring p = one copy of p KV rows + one of the recurrent
//                part.
// A lookup takes, over all entries, the longest common prefix l of the prompt (capped so that at least one prompt
// token is left to run: its logits give the first token) and the largest checkpoint (or entry end) at or
// below l.
//
// Where checkpoints come from:
//   - at the end of a prefill piece once snapshot_interval tokens have run since the last checkpoint (or the
//     restored prefix) - checkpoint_due() - so a divergence inside a long cached prompt loses at most one
//     interval plus one piece. Pieces are not cut for these: a prompt whose rest fits one piece (a cached
//     chat's next turn, an agent's next call) runs in one forward pass; a long one gets a checkpoint about
//     every interval at no extra cost (cold, alone, pieces are prefill chunks from 0: every 2048 tokens).
// and at positions in the prompt (plan(): marks), taken inside the step whose piece runs over them
// (seq_span::mark: the step writes the state at the mark into a checkpoint; next_piece()) or, when the piece
// would be too short for that, at a piece's end:
//   - the point where the prompt leaves the longest cached path (its divergence point): the next request that
//     shares the same prefix (a system prompt) finds a checkpoint exactly there;
//   - before the first turn_token after position 0 (<|im_start|>: the end of the system message, with its tool
//     definitions): every request with the same system prompt restores it;
//   - before the last turn_token of the prompt: the chat template re-renders a previous assistant
//     turn differently from what was generated (reasoning stripped), so the next turn's prompt leaves the
//     previous conversation right after "<|im_start|>assistant\n"; a checkpoint before that header is reused
//     every turn;
//   - the prompt's end, and the whole sequence when it finishes (prompt + completion), as entries.
// An entry whose tokens extend another's absorbs it (its end becomes a checkpoint, its KV is dropped), so a
// conversation of many turns is one entry with a checkpoint per turn, not one KV copy per turn.
//
// Spacing, counted at full size (Qwen3.6-35B-A3B): a checkpoint is ~63 MB (30 layers x 32 heads x 128 x 128
// fp32 + conv tails), KV is ~20 KB per token (10 layers x 2 x 2 heads x 256 x bf16), prefill runs ~25K tok/s.
// A checkpoint every B tokens costs 63 MB / B per token on top of the 20 KB of KV and saves on average B/2
// tokens of recompute on a hit inside the block: B = 1024: 62 KB/token (3x the KV), 20 ms; B = 2048: 31 KB/token
// (1.5x), 41 ms; B = 4096: 15 KB/token, 82 ms. Turn and divergence checkpoints catch the common hits exactly,
// so interval checkpoints only bound the rare miss: 2048 is the default (--prefix-cache-interval), the prefill
// chunk, so a cold prompt's pieces each end with one.
//
// Memory: entries are copies (a sequence's KV is copied into the store at its end, and back into a new state
// on a hit), not pages shared by reference: a restore costs one device copy of p rows (20 KB/token: 16K tokens =
// 320 MB at ~2 TB/s = 0.2 ms) and the attention kernels keep their contiguous per-sequence cache. Entries on
// different paths that share a prefix (two conversations with one system prompt) each hold that prefix's KV.
// A byte budget bounds the store; whole entries are evicted least recently used first, never one that is
// pinned (looked up and not yet restored from).
//
// Not built: a host-RAM tier for evicted entries. It pays once the budget (a quarter of --state-memory: ~25 GB on an
// H200, ~65 conversations of 16K tokens at 383 MB each, ~240 of 2K) evicts conversations that come back: bringing
// one back over PCIe (~25 GB/s pinned: ~15 ms for 16K tokens) costs ~4% of recomputing it (~400 ms at 40K tok/s).
// Its copies must run on a side stream and a restoring request wait on an event, never the step loop.
//
// Thread-safe (one mutex): the engine thread restores and inserts, others read stats().
#pragma once
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "backend/backend.h"

namespace tansy {

struct prefix_cache_options {
    size_t budget = 0;                // bytes of snapshots at most (0: the cache is off)
    // a checkpoint at the first prefill piece end this many prompt tokens after the last one (0: none)
    int64_t snapshot_interval = 2048;
    // checkpoints before the first (after position 0) and the last occurrence of this id in a prompt (-1: none)
    int32_t turn_token = -1;
    // Neither checkpoints nor entries below this many tokens: at full size a snapshot is ~63 MB, worth keeping
    // only for a prefix whose recompute it saves (256 tokens: ~10 ms at 25K tok/s).
    int64_t min_tokens = 256;
    // No mark (plan()) this close to where the prompt's prefill starts: a mark ends a prefill piece, and a piece
    // costs a forward step's fixed time (~4 ms at full size: ~100 prompt tokens at 25K tok/s) to save a later
    // request at most the tokens between the two (an agent's next call diverges a few tokens past the restored
    // prompt end: that mark cost a step and saved nothing).
    int64_t min_mark_gap = 128;
};

struct prefix_cache_stats {
    uint64_t hits = 0, misses = 0;   // lookups that restored something / nothing
    uint64_t cached_tokens = 0;      // prompt tokens restored instead of computed
    uint64_t evictions = 0;          // entries evicted for space
    uint64_t inserts = 0;            // entries and checkpoints stored
    size_t bytes = 0, budget = 0;
    int64_t entries = 0, checkpoints = 0;
};

class prefix_cache {
  public:
    prefix_cache(backend& be, prefix_cache_options opt);
    ~prefix_cache();
    prefix_cache(const prefix_cache&) = delete;
    prefix_cache& operator=(const prefix_cache&) = delete;

    bool enabled() const { return opt_.budget > 0; }
    const prefix_cache_options& options() const { return opt_; }

    struct entry;
    // A looked-up prefix: pins its entry (never evicted while the lease lives; must not outlive the cache).
    class lease {
      public:
        lease() = default;
        lease(lease&& o) noexcept : pc_(o.pc_), e_(o.e_), tokens_(o.tokens_) { o.pc_ = nullptr, o.e_ = nullptr; }
        lease& operator=(lease&& o) noexcept;
        ~lease() { release(); }
        int64_t tokens() const { return tokens_; }  // prompt tokens it restores (0: nothing cached)
        explicit operator bool() const { return e_ != nullptr; }
        void release();

      private:
        friend class prefix_cache;
        prefix_cache* pc_ = nullptr;
        entry* e_ = nullptr;
        int64_t tokens_ = 0;
    };

    // The longest cached prefix of the prompt that leaves at least one token to run (an empty lease: none).
    lease lookup(const std::vector<int32_t>& prompt);
    // dst (fresh, capacity >= l.tokens()) becomes the state after the leased prefix; counts a hit and releases
    // the lease. Queued on the backend in order with the steps.
    void restore(lease& l, seq_state& dst);
    void miss();  // counts a lookup that found nothing

    // Positions p in (from, prompt.size()) at which to stop the prefill and take a checkpoint(), ascending.
    std::vector<int64_t> plan(const std::vector<int32_t>& prompt, int64_t from) const;
    // The prefill piece that starts at `at`: at most max_n tokens, ending at the prompt's end or at a mark. The
    // first mark inside it is taken within the step (seq_span::mark: `mark`, 0 for none) when the piece then
    // runs on for at least k_marked_span_min_rows tokens (up to the next mark, max_n or the prompt's end);
    // otherwise the piece ends at that mark.
    struct piece {
        int64_t end = 0;   // the piece is prompt tokens [at, end)
        int64_t mark = 0;  // a checkpoint position in (at, end), 0: none
    };
    static piece next_piece(const std::vector<int64_t>& marks, int64_t at, int64_t max_n, int64_t prompt_size);
    // Whether a piece that ended at p < prompt_size takes a checkpoint: p is a mark, or the interval has run
    // since `last` (the last checkpoint, or where the prefill started).
    bool checkpoint_due(const std::vector<int64_t>& marks, int64_t last, int64_t p, int64_t prompt_size) const;
    // A checkpoint of st where it stands (the recurrent part only), to hand to insert().
    std::unique_ptr<seq_state> checkpoint(const seq_state& st);
    // An empty checkpoint for a step to fill at a piece's mark (seq_span::mark_state), to hand to insert() after.
    std::unique_ptr<seq_state> mark_state();

    using checkpoints = std::vector<std::unique_ptr<seq_state>>;  // each at its n_past()
    // Stores st, which holds tokens [0, n) (st.n_past() == n), with checkpoints taken on the way (positions < n).
    // Evicts down to the budget.
    void insert(const int32_t* tokens, int64_t n, const seq_state& st, checkpoints cps = {});

    size_t bytes() const;
    // Evicts unpinned entries, least recently used first, until bytes() <= target; returns the bytes freed.
    size_t evict_to(size_t target);
    void clear();
    prefix_cache_stats stats() const;

  private:
    void unpin(entry* e);
    size_t evict_locked(size_t target);
    void absorb(entry& into, entry& from);

    backend& be_;
    prefix_cache_options opt_;
    mutable std::mutex mu_;
    std::list<std::unique_ptr<entry>> entries_;  // guarded by mu_
    uint64_t tick_ = 0;
    size_t bytes_ = 0;
    prefix_cache_stats st_;
};

}  // namespace tansy
