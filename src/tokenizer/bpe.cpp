#include "tokenizer/bpe.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"

namespace tansy {

// --- word_cache ------------------------------------------------------------------------------------------

uint64_t word_cache::hash(std::string_view key) {
    // 8 bytes at a time with a multiply-xorshift mix: pre-tokens are short, so speed beats quality here.
    constexpr uint64_t K = 0x9E3779B97F4A7C15ull;
    uint64_t h = key.size() * K;
    size_t i = 0;
    for (; i + 8 <= key.size(); i += 8) {
        uint64_t w;
        memcpy(&w, key.data() + i, 8);
        h = (h ^ w) * K;
        h ^= h >> 29;
    }
    if (i < key.size()) {
        uint64_t w = 0;
        memcpy(&w, key.data() + i, key.size() - i);
        h = (h ^ w) * K;
        h ^= h >> 29;
    }
    h *= K;
    h ^= h >> 32;
    return h | 1;  // never 0, the empty-slot marker
}

bool word_cache::get(std::string_view key, uint64_t h, std::vector<int32_t>& out) const {
    if (slots_.empty()) return false;
    const size_t mask = SLOTS - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
        const slot& s = slots_[i];
        if (s.hash == 0) return false;
        if (s.hash == h && s.key_len == key.size() && memcmp(keys_.data() + s.key_off, key.data(), key.size()) == 0) {
            out.insert(out.end(), vals_.begin() + s.val_off, vals_.begin() + s.val_off + s.val_len);
            return true;
        }
    }
}

void word_cache::put(std::string_view key, uint64_t h, const int32_t* ids, size_t n) {
    if (key.size() > MAX_WORD_BYTES) return;
    if (slots_.empty()) slots_.resize(SLOTS);
    if (used_ >= MAX_ENTRIES) clear();  // start over: cheaper than LRU, and text drifts anyway
    const size_t mask = SLOTS - 1;
    size_t i = h & mask;
    while (slots_[i].hash != 0) i = (i + 1) & mask;
    slot& s = slots_[i];
    s.hash = h;
    s.key_off = (uint32_t)keys_.size();
    s.key_len = (uint16_t)key.size();
    s.val_off = (uint32_t)vals_.size();
    s.val_len = (uint16_t)n;  // n <= key bytes <= MAX_WORD_BYTES: a token covers at least one byte
    keys_.append(key);
    vals_.insert(vals_.end(), ids, ids + n);
    used_++;
}

void word_cache::clear() {
    if (used_ == 0) return;
    std::fill(slots_.begin(), slots_.end(), slot{});
    keys_.clear();
    vals_.clear();
    used_ = 0;
}

// --- bpe_model -------------------------------------------------------------------------------------------

bpe_model::bpe_model(const int32_t (&byte_ids)[256], const int32_t (&fallback_ids)[256], const options& opt)
    : opt_(opt) {
    memcpy(byte_ids_, byte_ids, sizeof byte_ids_);
    memcpy(fallback_ids_, fallback_ids, sizeof fallback_ids_);
    reserve_merges(0);
}

static inline uint64_t pair_key(int32_t a, int32_t b) { return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b; }

void bpe_model::reserve_merges(size_t n) {
    int bits = 4;
    while (((size_t)1 << bits) < 2 * n + 16) bits++;  // load factor <= 0.5
    if (bits <= pair_bits_) return;
    std::vector<pair_slot> old = std::move(pairs_);
    pairs_.assign((size_t)1 << bits, pair_slot{});
    pair_bits_ = bits;
    n_pairs_ = 0;
    for (const pair_slot& s : old)
        if (s.key != EMPTY_KEY) add_merge((int32_t)(s.key >> 32), (int32_t)(uint32_t)s.key, s.merged, s.rank);
}

const bpe_model::pair_slot* bpe_model::find_pair(int32_t left, int32_t right) const {
    const uint64_t key = pair_key(left, right);
    const size_t mask = pairs_.size() - 1;
    for (size_t i = (key * 0x9E3779B97F4A7C15ull) >> (64 - pair_bits_);; i = (i + 1) & mask) {
        const pair_slot& s = pairs_[i];
        if (s.key == key) return &s;
        if (s.key == EMPTY_KEY) return nullptr;
    }
}

void bpe_model::add_merge(int32_t left, int32_t right, int32_t merged, int32_t rank) {
    TANSY_CHECK(left >= 0 && right >= 0 && merged >= 0 && rank >= 0, "bad merge %d %d -> %d", left, right, merged);
    if (2 * (n_pairs_ + 1) > pairs_.size()) reserve_merges(2 * n_pairs_ + 1);
    const uint64_t key = pair_key(left, right);
    const size_t mask = pairs_.size() - 1;
    size_t i = (key * 0x9E3779B97F4A7C15ull) >> (64 - pair_bits_);
    while (pairs_[i].key != EMPTY_KEY && pairs_[i].key != key) i = (i + 1) & mask;
    if (pairs_[i].key == EMPTY_KEY) n_pairs_++;
    pairs_[i] = {key, rank, merged};
}

void bpe_model::add_whole_word(std::string bytes, int32_t id) { whole_words_.emplace(std::move(bytes), id); }

void bpe_model::encode_word(std::string_view word, std::vector<int32_t>& out, bpe_work& w) const {
    if (opt_.ignore_merges && !whole_words_.empty()) {
        auto it = whole_words_.find(std::string(word));
        if (it != whole_words_.end()) {
            out.push_back(it->second);
            return;
        }
    }
    // 1. Initial symbols: one token per byte (HF: one vocab lookup per byte-level character).
    std::vector<int32_t>& ids = w.ids;
    ids.clear();
    bool prev_unk = false;
    for (unsigned char b : word) {
        int32_t id = byte_ids_[b];
        if (id < 0) id = fallback_ids_[b];
        if (id >= 0) {
            ids.push_back(id);
            prev_unk = false;
        } else if (opt_.unk_id >= 0) {
            if (!(opt_.fuse_unk && prev_unk)) ids.push_back(opt_.unk_id);
            prev_unk = true;
        }
    }
    if (ids.size() <= 1) {
        out.insert(out.end(), ids.begin(), ids.end());
        return;
    }
    // 2. Merge by rank.
    if (ids.size() <= SMALL_WORD)
        merge_small(ids, out, w);
    else
        merge_large(ids, out, w);
}

void bpe_model::merge_small(std::vector<int32_t>& ids, std::vector<int32_t>& out, bpe_work& w) const {
    // Arrays of the current symbols and of the merge available between each neighbour pair; each step
    // scans for the lowest rank (strict < keeps the leftmost) and updates only the two pairs it touched.
    int32_t* id = ids.data();
    int64_t m = (int64_t)ids.size();
    w.ranks.resize(m);
    w.merged.resize(m);
    int32_t* rank = w.ranks.data();
    int32_t* merged = w.merged.data();
    auto pair_at = [&](int64_t i) {
        const pair_slot* p = find_pair(id[i], id[i + 1]);
        rank[i] = p ? p->rank : NO_RANK;
        merged[i] = p ? p->merged : -1;
    };
    for (int64_t i = 0; i + 1 < m; i++) pair_at(i);
    while (m > 1) {
        int64_t best = 0;
        for (int64_t i = 1; i + 1 < m; i++)
            if (rank[i] < rank[best]) best = i;
        if (rank[best] == NO_RANK) break;
        id[best] = merged[best];
        // Drop symbol best+1 and pair best (pair best+1 becomes pair best after the shift).
        const int64_t tail = m - (best + 2);
        memmove(id + best + 1, id + best + 2, tail * sizeof(int32_t));
        memmove(rank + best, rank + best + 1, tail * sizeof(int32_t));
        memmove(merged + best, merged + best + 1, tail * sizeof(int32_t));
        m--;
        if (best > 0) pair_at(best - 1);
        if (best + 1 < m) pair_at(best);
    }
    out.insert(out.end(), id, id + m);
}

void bpe_model::merge_large(const std::vector<int32_t>& ids, std::vector<int32_t>& out, bpe_work& w) const {
    // A doubly linked list of symbols and a min-heap of candidate merges ordered by (rank, position);
    // entries made stale by an earlier merge are recognised by their operands and skipped (HF merge_word).
    const int32_t n = (int32_t)ids.size();
    auto& sym = w.symbols;
    auto& heap = w.heap;
    sym.resize(n);
    for (int32_t i = 0; i < n; i++) sym[i] = {ids[i], i - 1, i + 1 < n ? i + 1 : -1};
    heap.clear();
    auto later = [](const bpe_work::candidate& a, const bpe_work::candidate& b) {
        return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    };
    auto push = [&](int32_t pos) {
        const int32_t next = sym[pos].next;
        if (next < 0) return;
        const pair_slot* p = find_pair(sym[pos].id, sym[next].id);
        if (!p) return;
        heap.push_back({p->rank, pos, sym[pos].id, sym[next].id, p->merged});
        std::push_heap(heap.begin(), heap.end(), later);
    };
    for (int32_t i = 0; i + 1 < n; i++) push(i);
    while (!heap.empty()) {
        std::pop_heap(heap.begin(), heap.end(), later);
        const bpe_work::candidate c = heap.back();
        heap.pop_back();
        bpe_work::symbol& s = sym[c.pos];
        if (s.id != c.left || s.next < 0 || sym[s.next].id != c.right) continue;  // stale
        const int32_t gone = s.next;
        s.id = c.merged;
        s.next = sym[gone].next;
        if (s.next >= 0) sym[s.next].prev = c.pos;
        sym[gone].id = -1;
        if (s.prev >= 0) push(s.prev);
        push(c.pos);
    }
    for (int32_t i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
}

}  // namespace tansy
