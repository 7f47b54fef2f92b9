#include "runtime/prefix_cache.h"

#include <algorithm>

#include "core/check.h"

namespace tansy {

struct prefix_cache::entry {
    std::vector<int32_t> tokens;
    std::unique_ptr<seq_state> kv;  // capacity tokens.size(): KV rows [0, n) and the recurrent part at n
    std::map<int64_t, std::unique_ptr<seq_state>> cps;  // position p < n -> recurrent-only state at p
    uint64_t used = 0;  // LRU tick
    int pins = 0;       // leases alive: never evicted or absorbed while > 0
    size_t bytes = 0;
    void recount() {
        bytes = kv ? kv->bytes() : 0;
        for (const auto& [p, s] : cps) bytes += s->bytes();
    }
};

static int64_t common_prefix(const int32_t* a, int64_t na, const int32_t* b, int64_t nb) {
    const int64_t n = std::min(na, nb);
    return (int64_t)(std::mismatch(a, a + n, b).first - a);
}

prefix_cache::prefix_cache(backend& be, prefix_cache_options opt) : be_(be), opt_(opt) {
    TANSY_CHECK(opt_.snapshot_interval >= 0 && opt_.min_tokens >= 1, "prefix cache: interval %lld, min tokens %lld",
                (long long)opt_.snapshot_interval, (long long)opt_.min_tokens);
    st_.budget = opt_.budget;
}

prefix_cache::~prefix_cache() = default;

prefix_cache::lease& prefix_cache::lease::operator=(lease&& o) noexcept {
    if (this != &o) {
        release();
        pc_ = o.pc_, e_ = o.e_, tokens_ = o.tokens_;
        o.pc_ = nullptr, o.e_ = nullptr;
    }
    return *this;
}

void prefix_cache::lease::release() {
    if (pc_ && e_) pc_->unpin(e_);
    pc_ = nullptr, e_ = nullptr;
}

void prefix_cache::unpin(entry* e) {
    std::lock_guard<std::mutex> lk(mu_);
    TANSY_CHECK(e->pins > 0, "prefix cache: unpinning an entry that is not pinned");
    e->pins--;
}

prefix_cache::lease prefix_cache::lookup(const std::vector<int32_t>& prompt) {
    lease l;
    if (!enabled() || prompt.size() < 2) return l;
    const int64_t cap = (int64_t)prompt.size() - 1;  // the last prompt token always runs (its logits)
    std::lock_guard<std::mutex> lk(mu_);
    entry* best = nullptr;
    int64_t best_pos = 0;
    for (auto& ep : entries_) {
        entry& e = *ep;
        const int64_t n = (int64_t)e.tokens.size();
        const int64_t l = common_prefix(prompt.data(), cap, e.tokens.data(), n);
        int64_t pos = 0;
        if (l == n) {
            pos = n;
        } else if (auto it = e.cps.upper_bound(l); it != e.cps.begin()) {
            pos = std::prev(it)->first;
        }
        if (pos > best_pos || (pos == best_pos && best && pos > 0 && e.used > best->used)) best = &e, best_pos = pos;
    }
    if (!best || best_pos <= 0) return l;
    best->pins++;
    best->used = ++tick_;
    l.pc_ = this, l.e_ = best, l.tokens_ = best_pos;
    return l;
}

void prefix_cache::restore(lease& l, seq_state& dst) {
    TANSY_CHECK(l.e_ && l.pc_ == this, "prefix cache: restoring an empty lease");
    {
        std::lock_guard<std::mutex> lk(mu_);
        entry& e = *l.e_;
        const int64_t pos = l.tokens_;
        const seq_state* rec = pos == (int64_t)e.tokens.size() ? e.kv.get() : nullptr;
        if (!rec) {
            auto it = e.cps.find(pos);
            TANSY_CHECK(it != e.cps.end(), "prefix cache: checkpoint %lld of a pinned entry is gone", (long long)pos);
            rec = it->second.get();
        }
        be_.restore(dst, *rec, *e.kv, pos);
        st_.hits++;
        st_.cached_tokens += (uint64_t)pos;
    }
    l.release();
}

void prefix_cache::miss() {
    std::lock_guard<std::mutex> lk(mu_);
    st_.misses++;
}

std::vector<int64_t> prefix_cache::plan(const std::vector<int32_t>& prompt, int64_t from) const {
    std::vector<int64_t> at;
    if (!enabled()) return at;
    const int64_t T = (int64_t)prompt.size();
    auto want = [&](int64_t p) {
        if (p >= from + std::max<int64_t>(opt_.min_mark_gap, 1) && p < T && p >= opt_.min_tokens) at.push_back(p);
    };
    {
        // where the prompt leaves the longest cached path: the next request on that path restores from here
        std::lock_guard<std::mutex> lk(mu_);
        int64_t d = 0;
        for (const auto& e : entries_)
            d = std::max(d, common_prefix(prompt.data(), T - 1, e->tokens.data(), (int64_t)e->tokens.size()));
        want(d);
    }
    if (opt_.turn_token >= 0) {
        // the first turn after position 0 (the end of a system message: shared by every request that uses it)
        // and the last one (where the next turn of this conversation leaves it)
        for (int64_t p = 1; p < T; p++)
            if (prompt[(size_t)p] == opt_.turn_token) {
                want(p);
                break;
            }
        for (int64_t p = T - 1; p > from; p--)
            if (prompt[(size_t)p] == opt_.turn_token) {
                want(p);
                break;
            }
    }
    std::sort(at.begin(), at.end());
    at.erase(std::unique(at.begin(), at.end()), at.end());
    return at;
}

prefix_cache::piece prefix_cache::next_piece(const std::vector<int64_t>& marks, int64_t at, int64_t max_n,
                                             int64_t prompt_size) {
    const int64_t end = std::min(prompt_size, at + std::max<int64_t>(max_n, 1));
    auto m = std::upper_bound(marks.begin(), marks.end(), at);
    if (m == marks.end() || *m >= end) return {end, 0};
    // a mark inside: carried by a piece that runs on to the next mark (or its budget, or the prompt's end)
    const int64_t on = std::next(m) != marks.end() ? std::min(end, *std::next(m)) : end;
    if (on - at >= k_marked_span_min_rows) return {on, *m};
    return {*m, 0};  // too short to carry it: the piece ends there
}

bool prefix_cache::checkpoint_due(const std::vector<int64_t>& marks, int64_t last, int64_t p,
                                  int64_t prompt_size) const {
    if (!enabled() || p >= prompt_size) return false;
    if (std::binary_search(marks.begin(), marks.end(), p)) return true;
    return opt_.snapshot_interval > 0 && p - last >= opt_.snapshot_interval && p >= opt_.min_tokens;
}

std::unique_ptr<seq_state> prefix_cache::checkpoint(const seq_state& st) { return be_.snapshot(st, 0); }

std::unique_ptr<seq_state> prefix_cache::mark_state() { return be_.new_state(0); }

// `from`'s tokens are a prefix of `into`'s: its checkpoints and its end move into `into`, its KV goes.
// The snapshot comes first: if it throws, neither entry has changed.
void prefix_cache::absorb(entry& into, entry& from) {
    const int64_t n = (int64_t)from.tokens.size();
    std::unique_ptr<seq_state> end;
    if (n < (int64_t)into.tokens.size() && !into.cps.count(n)) end = be_.snapshot(*from.kv, 0);
    for (auto& [p, s] : from.cps) into.cps.try_emplace(p, std::move(s));
    if (end) into.cps.emplace(n, std::move(end));
}

void prefix_cache::insert(const int32_t* tokens, int64_t n, const seq_state& st, checkpoints cps) {
    if (!enabled() || n < opt_.min_tokens) return;
    TANSY_CHECK(st.n_past() == n, "prefix cache: inserting %lld tokens of a state at %lld", (long long)n,
                (long long)st.n_past());
    std::lock_guard<std::mutex> lk(mu_);
    auto add_cps = [&](entry& e) {
        for (auto& c : cps)
            if (c && c->n_past() > 0 && c->n_past() < (int64_t)e.tokens.size() && !e.cps.count(c->n_past())) {
                const int64_t p = c->n_past();
                e.cps.emplace(p, std::move(c));
                st_.inserts++;
            }
    };
    // 1. already on the path of an entry (a prefix of its tokens, or the same): only checkpoints are new
    for (auto& ep : entries_) {
        entry& e = *ep;
        if ((int64_t)e.tokens.size() < n || common_prefix(tokens, n, e.tokens.data(), n) < n) continue;
        add_cps(e);
        if (n < (int64_t)e.tokens.size() && !e.cps.count(n)) e.cps.emplace(n, be_.snapshot(st, 0)), st_.inserts++;
        e.used = ++tick_;
        bytes_ -= e.bytes;
        e.recount();
        bytes_ += e.bytes;
        evict_locked(opt_.budget);
        return;
    }
    // 2. a new entry; the entries it extends are absorbed into it
    auto ne = std::make_unique<entry>();
    ne->tokens.assign(tokens, tokens + n);
    ne->kv = be_.snapshot(st, n);
    ne->used = ++tick_;
    st_.inserts++;
    add_cps(*ne);
    for (auto it = entries_.begin(); it != entries_.end();) {
        entry& e = **it;
        const int64_t m = (int64_t)e.tokens.size();
        if (e.pins == 0 && m < n && common_prefix(tokens, n, e.tokens.data(), m) == m) {
            absorb(*ne, e);
            bytes_ -= e.bytes;
            it = entries_.erase(it);
        } else {
            ++it;
        }
    }
    ne->recount();
    bytes_ += ne->bytes;
    entries_.push_back(std::move(ne));
    evict_locked(opt_.budget);
}

size_t prefix_cache::bytes() const {
    std::lock_guard<std::mutex> lk(mu_);
    return bytes_;
}

size_t prefix_cache::evict_to(size_t target) {
    std::lock_guard<std::mutex> lk(mu_);
    return evict_locked(target);
}

size_t prefix_cache::evict_locked(size_t target) {
    size_t freed = 0;
    while (bytes_ > target) {
        auto victim = entries_.end();
        for (auto it = entries_.begin(); it != entries_.end(); ++it)
            if ((*it)->pins == 0 && (victim == entries_.end() || (*it)->used < (*victim)->used)) victim = it;
        if (victim == entries_.end()) break;  // everything left is pinned
        freed += (*victim)->bytes;
        bytes_ -= (*victim)->bytes;
        entries_.erase(victim);
        st_.evictions++;
    }
    return freed;
}

void prefix_cache::clear() { evict_to(0); }

prefix_cache_stats prefix_cache::stats() const {
    std::lock_guard<std::mutex> lk(mu_);
    prefix_cache_stats s = st_;
    s.bytes = bytes_;
    s.entries = (int64_t)entries_.size();
    for (const auto& e : entries_) s.checkpoints += (int64_t)e->cps.size();
    return s;
}

}  // namespace tansy
