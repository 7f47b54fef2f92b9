// Token constraints (constraints.h): the shared token table and, per request, the masks that keep a step's
// candidate tokens to what the recogniser allows (json_prefix.cpp, content_spec.cpp, json_schema.cpp).
//
// A mask is written as bits. Inside a string, the plain-text tokens that fit come from a precomputed set
// (token_table::plain: one copy); every other token is found by a walk of the vocabulary trie (token_trie.h)
// that feeds the recogniser each shared prefix byte once and leaves a subtree at its first rejected byte. Away
// from the length limit, what a walk allowed is kept by state (mask_cache.h): a state seen again costs no walk.
#include "server/constraints.h"

#include <algorithm>

#include "core/check.h"
#include "tokenizer/utf8.h"

namespace tansy {

namespace {

// Within this many tokens of the point where only the shortest completion fits, a token is allowed only when
// the completion it leaves still fits (farther away, a token's few bytes cannot matter yet).
constexpr int64_t k_near = 16;

void set_bit(uint32_t* words, int64_t id) { words[id / 32] |= 1u << (id % 32); }
void clear_bit(uint32_t* words, int64_t id) { words[id / 32] &= ~(1u << (id % 32)); }

// During reasoning: nothing is constrained until the tokens left fall to the reserve; then </think> comes. The
// turn may not end inside the reasoning (the constrained answer must come).
void allow_reasoning(const token_table& t, uint32_t* words, int64_t n, int64_t tokens_left, int64_t reserve) {
    if (t.think_end < 0 || t.think_end >= n) return allow_all(words, n);
    if (tokens_left > reserve) {
        allow_all(words, n);
        for (int32_t e : t.eos)
            if (e >= 0 && e < n) clear_bit(words, e);
        return;
    }
    std::fill(words, words + mask_words(n), 0u);
    set_bit(words, t.think_end);
}

// The end of the turn when the text is complete; nothing past the table (or the row); and at least one token
// kept: when nothing is allowed, the end of the turn is the way out.
void finish_mask(const token_table& t, uint32_t* words, int64_t n, bool complete) {
    const int64_t n_text = std::min<int64_t>(n, (int64_t)t.bytes.size());
    const int64_t n_words = mask_words(n);
    if (n_text % 32) words[n_text / 32] &= (1u << (n_text % 32)) - 1u;
    std::fill(words + mask_words(n_text), words + n_words, 0u);
    for (int32_t e : t.eos)
        if (complete && e >= 0 && e < n_text) set_bit(words, e);
    for (int64_t w = 0; w < n_words; w++)
        if (words[w]) return;
    for (int32_t e : t.eos)
        if (e >= 0 && e < n_text) set_bit(words, e);
}

// The reasoning's part of accept(): true while it runs (the id is then taken by it); </think> ends it.
bool accept_reasoning(const token_table& t, bool* reasoning, int32_t id) {
    if (!*reasoning) return false;
    if (id == t.think_end) *reasoning = false;
    return true;
}

// A token with text to feed a recogniser (in the table, not special).
bool is_text(const token_table& t, int32_t id) {
    return id >= 0 && id < (int32_t)t.bytes.size() && !t.special[(size_t)id];
}

bool plain_of(const token_table& t, int cls, int32_t id) {
    return (!(cls & 1) || t.json_plain[(size_t)id]) && (!(cls & 2) || t.raw_plain[(size_t)id]);
}

// What a mask walk takes from the plain sets, and whether it checks each token's completion.
struct walk_plan {
    plain_info plain;      // the plain tokens token_table::plain settles (cls 0: none)
    bool near = false;     // a walked token must leave a completion of at most `limit` bytes
    int64_t limit = 0;
};

// A constraint's memo of its walks (used away from the limit only, where the walk depends on the state alone).
struct walk_memo {
    mask_cache& cache;
    const std::string& key;        // the state's
    std::vector<int32_t>& walked;  // scratch: the ids the walk allowed
};

// Zeroes the words of a row of n ids (the table's, or more: ids past the table are never allowed).
void begin_mask(const token_table& t, uint32_t* words, int64_t n) {
    TANSY_CHECK(n >= (int64_t)t.bytes.size(), "grammar mask: a row of %lld ids, the token table has %zu",
                (long long)n, t.bytes.size());
    std::fill(words, words + mask_words(n), 0u);
}

// The plain set of p: its tokens that fit the room, but for those of an excepted first byte.
void plain_base(const token_table& t, const plain_info& p, uint32_t* words) {
    t.plain.write(p.cls, p.bytes ? INT64_MAX : p.room, words);
    if (p.bytes)  // a room in bytes: the whole class, less the tokens longer than the room
        for (int32_t id : t.trie.longest_first()) {
            if ((int64_t)t.bytes[(size_t)id].size() <= p.room) break;
            clear_bit(words, id);
        }
    if (!p.any_except()) return;
    for (int b = 0; b < 256; b++)
        if (p.excepted((uint8_t)b))
            for (int32_t k = t.trie.first_byte(b); k < t.trie.first_byte(b + 1); k++) clear_bit(words, t.trie.ids()[(size_t)k]);
}

// The walks behind walk_allowed: check(id, state after it) for each token the plain set does not settle.
template <class S, class Check>
void walk_tries(const token_table& t, const S& st, trie_stack<S>& stack, const plain_info& p, Check&& check) {
    auto no_skip = [](const token_trie::node&) { return false; };
    if (!p.cls) return t.trie.walk(st, stack, no_skip, check);
    const int c = p.cls - 1;
    // an excepted first byte's subtree is walked whole (from the whole trie), and skipped in the walks below
    uint8_t root = 0;
    auto excepted = [&](const token_trie::node& x) {
        if (x.depth == 1) root = x.byte;
        return p.excepted(root);
    };
    if (p.any_except()) t.trie.walk(st, stack, [&](const token_trie::node& x) { return !excepted(x); }, check);
    if (p.bytes) {  // the set holds the plain tokens of at most room bytes; longer ones are walked
        auto fits = [&](int32_t id) { return plain_of(t, p.cls, id) && (int64_t)t.bytes[(size_t)id].size() <= p.room; };
        return t.trie.walk(
            st, stack, [&](const token_trie::node& x) { return excepted(x) || (x.all_plain(p.cls) && x.max_len <= p.room); },
            [&](int32_t id, const S& after) {
                if (!fits(id)) check(id, after);
            });
    }
    // plain tokens beyond the room that may still be fine: the long ones, or (a room below plain_sets::k_steps)
    // any, from the whole trie but for the subtrees the plain set settles
    const bool longer = !p.exact && p.room < t.long_plain[c].max_cp();
    if (longer && p.room < plain_sets::k_steps - 1) {
        return t.trie.walk(
            st, stack, [&](const token_trie::node& x) { return excepted(x) || x.plain_fits(p.cls, p.room); },
            [&](int32_t id, const S& after) {
                if (plain_of(t, p.cls, id) && t.code_points[(size_t)id] <= p.room) return;
                check(id, after);
            });
    }
    t.rest[c].walk(st, stack, excepted, check);
    if (longer)
        t.long_plain[c].walk(
            st, stack, [&](const token_trie::node& x) { return excepted(x) || x.cp_within(p.room); },
            [&](int32_t id, const S& after) {
                if (t.code_points[(size_t)id] > p.room) check(id, after);
            });
}

// The allowed ids from state st: the plain set, and the walked tokens the recogniser accepts (from the memo
// when it has the state: then no walk).
template <class S, class Closer>
void walk_allowed(const token_table& t, const S& st, trie_stack<S>& stack, const walk_plan& w, uint32_t* words,
                  Closer&& closer_len, const walk_memo* memo) {
    plain_info p = w.plain;
    if (p.bytes && p.room >= t.trie.max_depth()) p.bytes = false, p.room = INT64_MAX, p.exact = true;  // all fit
    if (p.cls && !p.refused) plain_base(t, p, words);
    const int64_t n_words = mask_words((int64_t)t.bytes.size());
    if (memo && memo->cache.apply(memo->key, words, n_words)) return;
    if (memo) memo->walked.clear();
    auto check = [&](int32_t id, const S& after) {
        if (w.near && (int64_t)closer_len(after) > w.limit) return;
        set_bit(words, id);
        if (memo) memo->walked.push_back(id);
    };
    walk_tries(t, st, stack, p, check);
    if (memo) memo->cache.insert(memo->key, memo->walked, n_words);
}

const auto k_no_skip = [](const token_trie::node&) { return false; };

}  // namespace

void allow_all(uint32_t* words, int64_t n) {
    std::fill(words, words + n / 32, ~0u);
    if (n % 32) words[n / 32] = (1u << (n % 32)) - 1u;
}

std::shared_ptr<const token_table> token_table::build(const tokenizer& tok, int64_t n_valid, std::vector<int32_t> eos,
                                                      int32_t think_end) {
    auto t = std::make_shared<token_table>();
    t->bytes.resize((size_t)n_valid);
    t->special.resize((size_t)n_valid, true);
    for (int64_t i = 0; i < n_valid && i < tok.size(); i++) {
        if (tok.is_special((int32_t)i)) continue;
        t->bytes[(size_t)i] = std::string(tok.token_bytes((int32_t)i));
        t->special[(size_t)i] = false;
    }
    t->eos = std::move(eos);
    t->think_end = think_end;
    t->json_plain.assign((size_t)n_valid, 0);
    t->raw_plain.assign((size_t)n_valid, 0);
    t->code_points.assign((size_t)n_valid, 0);
    std::vector<int32_t> text;  // the trie's tokens
    for (int64_t i = 0; i < n_valid; i++) {
        const std::string& b = t->bytes[(size_t)i];
        if (b.empty() || std::find(t->eos.begin(), t->eos.end(), (int32_t)i) != t->eos.end()) continue;
        text.push_back((int32_t)i);
        // whole, valid UTF-8 characters only (a token that ends inside a character is checked byte by byte)
        if (utf8_find_invalid(b) >= 0) continue;
        bool json = true, raw = b.back() != '\n';
        for (char c : b) {
            if (c == '"' || c == '\\' || (unsigned char)c < 0x20) json = false;
            if (c == '<') raw = false;
        }
        t->json_plain[(size_t)i] = json;
        t->raw_plain[(size_t)i] = raw;
        size_t cp = 0;
        for (unsigned char c : b) cp += (c & 0xC0) != 0x80;
        t->code_points[(size_t)i] = (uint16_t)std::min<size_t>(cp, UINT16_MAX);
    }
    const auto is_plain = [&](int cls, int32_t id) { return plain_of(*t, cls, id); };
    for (int c = 1; c <= k_plain_classes; c++) {
        std::vector<int32_t> rest, long_plain;
        for (int32_t id : text) {
            if (!is_plain(c, id)) rest.push_back(id);
            else if (t->code_points[(size_t)id] >= plain_sets::k_steps) long_plain.push_back(id);
        }
        t->rest[c - 1].build(t->bytes, std::move(rest), is_plain, t->code_points);
        t->long_plain[c - 1].build(t->bytes, std::move(long_plain), is_plain, t->code_points);
    }
    t->trie.build(t->bytes, std::move(text), is_plain, t->code_points);
    t->plain.build(n_valid, t->json_plain, t->raw_plain, t->code_points);
    return t;
}

// ---- json_object_constraint

json_object_constraint::json_object_constraint(std::shared_ptr<const token_table> t, bool thinking,
                                               int64_t reasoning_reserve)
    : t_(std::move(t)), reasoning_(thinking && t_->think_end >= 0), reserve_(reasoning_reserve) {}

void json_object_constraint::allow(uint32_t* words, int64_t n, int64_t tokens_left) {
    const token_table& t = *t_;
    if (reasoning_) return allow_reasoning(t, words, n, tokens_left, reserve_);
    begin_mask(t, words, n);
    closer_ = json_.closer();
    // Each token adds at least one byte: with no more tokens than the completion has bytes, spell it out. One
    // token stays for the end of the turn, so that a completed object ends with finish_reason stop.
    const int64_t left = tokens_left - 1;
    const int64_t clen = (int64_t)closer_.size();
    if (left <= clen) {
        spelling<any_text> sp;
        sp.text = &closer_;
        t.trie.walk(sp, spell_, k_no_skip, [&](int32_t id, const spelling<any_text>&) { set_bit(words, id); });
    } else {
        walk_plan w;
        w.plain = json_.plain();
        w.near = left <= clen + k_near;
        w.limit = left - 1;
        if (w.near && clen > w.limit) w.plain = {};  // (then each token's own completion is checked)
        const walk_memo memo{cache_, key_, walked_};
        const bool memo_on = memo_ && !w.near;  // (near the limit, the closers matter too)
        if (memo_on) key_.clear(), json_.key(&key_);
        walk_allowed(t, json_, walk_, w, words, [](const json_prefix& p) { return p.closer().size(); },
                     memo_on ? &memo : nullptr);
    }
    finish_mask(t, words, n, json_.complete());
}

void json_object_constraint::accept(int32_t id) {
    if (accept_reasoning(*t_, &reasoning_, id) || !is_text(*t_, id)) return;
    json_.feed(t_->bytes[(size_t)id]);  // the mask only let valid tokens through
}

// ---- prefix_constraint

bool prefix_state::feed(char c) {
    if (free) return true;
    const auto b = texts->begin();
    const auto lo_it = std::lower_bound(b + lo, b + hi, c, [&](const std::string& s, char x) {
        return (unsigned char)s[pos] < (unsigned char)x;  // (every text in range is longer than pos)
    });
    const auto hi_it = std::upper_bound(lo_it, b + hi, c, [&](char x, const std::string& s) {
        return (unsigned char)x < (unsigned char)s[pos];
    });
    lo = (uint32_t)(lo_it - b), hi = (uint32_t)(hi_it - b);
    if (lo == hi) return false;
    pos++;
    if ((*texts)[lo].size() == pos) free = true;  // one was spelled out: anything may follow
    return true;
}

prefix_constraint::prefix_constraint(std::shared_ptr<const token_table> t, bool thinking, int64_t reasoning_reserve,
                                     std::vector<std::string> alternatives)
    : t_(std::move(t)), reasoning_(thinking && t_->think_end >= 0), reserve_(reasoning_reserve), alts_(std::move(alternatives)),
      sorted_(alts_) {
    std::sort(sorted_.begin(), sorted_.end());
}

bool prefix_constraint::allowed(const std::string& s) const {
    for (const std::string& a : alts_)
        if (a.compare(0, std::min(a.size(), s.size()), s, 0, std::min(a.size(), s.size())) == 0) return true;
    return false;
}

void prefix_constraint::allow(uint32_t* words, int64_t n, int64_t tokens_left) {
    const token_table& t = *t_;
    if (reasoning_) return allow_reasoning(t, words, n, tokens_left, reserve_);
    begin_mask(t, words, n);
    prefix_state p;
    p.texts = &sorted_, p.hi = (uint32_t)sorted_.size();
    p.free = !sorted_.empty() && sorted_[0].empty();
    bool ok = true;
    for (char c : so_far_) ok = ok && p.feed(c);
    if (ok) t.trie.walk(p, walk_, k_no_skip, [&](int32_t id, const prefix_state&) { set_bit(words, id); });
    finish_mask(t, words, n, false);
}

void prefix_constraint::accept(int32_t id) {
    if (accept_reasoning(*t_, &reasoning_, id)) return;
    if (!is_text(*t_, id)) {
        done_ = true;  // the turn ended (or something unexpected): nothing left to force
        return;
    }
    so_far_ += t_->bytes[(size_t)id];
    for (const std::string& a : alts_)
        if (so_far_.size() >= a.size() && so_far_.compare(0, a.size(), a) == 0) done_ = true;
    if (!allowed(so_far_)) done_ = true;
}

// ---- schema_constraint

schema_constraint::schema_constraint(std::shared_ptr<const token_table> t, bool thinking, int64_t reasoning_reserve,
                                     std::shared_ptr<const content_spec> spec)
    : t_(std::move(t)), reasoning_(thinking && t_->think_end >= 0), reserve_(reasoning_reserve), spec_(std::move(spec)),
      st_(spec_.get()) {}

void schema_constraint::allow(uint32_t* words, int64_t n, int64_t tokens_left) {
    const token_table& t = *t_;
    if (reasoning_) return allow_reasoning(t, words, n, tokens_left, reserve_);
    begin_mask(t, words, n);
    const size_t clen = st_.closer(nullptr);
    // Each token adds at least one byte: with no more tokens than the completion has bytes, spell it out. One
    // token stays for the end of the turn, so that a completed document ends with finish_reason stop.
    const int64_t left = tokens_left - 1;
    if (clen != SIZE_MAX && left <= (int64_t)clen) {
        closer_.clear();
        st_.closer(&closer_);
        spelling<content_state> sp{st_, &closer_, 0};
        t.trie.walk(sp, spell_, k_no_skip, [&](int32_t id, const spelling<content_state>&) { set_bit(words, id); });
    } else {
        walk_plan w;
        w.plain = st_.plain();
        w.near = clen != SIZE_MAX && left <= (int64_t)clen + k_near;
        w.limit = left - 1;
        // near the end, plain tokens pass only while the completion they leave (at most growth bytes longer) fits;
        // when it is one length for all and does not fit, none passes (and none is walked)
        if (w.near && (int64_t)(clen + w.plain.growth) > w.limit) {
            if (w.plain.closer == SIZE_MAX) w.plain = {};
            else if ((int64_t)w.plain.closer > w.limit) w.plain.refused = true;
        }
        const walk_memo memo{cache_, key_, walked_};
        const bool memo_on = memo_ && !w.near;  // (near the limit, the closers matter too)
        if (memo_on) key_.clear(), st_.key(&key_);
        walk_allowed(t, st_, walk_, w, words, [](const content_state& s) { return s.closer(nullptr); },
                     memo_on ? &memo : nullptr);
    }
    finish_mask(t, words, n, st_.complete());
}

void schema_constraint::accept(int32_t id) {
    if (accept_reasoning(*t_, &reasoning_, id)) return;
    if (!is_text(*t_, id)) {
        done_ = true;  // the turn ended
        return;
    }
    if (!st_.feed(t_->bytes[(size_t)id])) done_ = true;  // (only the mask's way out gets here)
}

}  // namespace tansy
