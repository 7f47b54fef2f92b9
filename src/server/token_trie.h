// The vocabulary as a byte trie, for grammar masks (constraints.cpp): a mask walk feeds each shared prefix byte
// to a recogniser once, keeps one recogniser state per depth, and skips a whole subtree as soon as a byte is
// rejected, so its cost follows the trie nodes it visits, not the vocabulary's total bytes (~1 MB of text in
// 151k tokens, ~333k trie nodes; a state rejects most subtrees at their first byte).
//
// Also the plain-text token sets: tokens whose text may sit anywhere inside a JSON string (json) or a raw
// tool-call value (raw) whatever the recogniser's state there, as bitsets ready to copy into a mask, by how many
// code points they have at most (a bounded string's room).
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace tansy {

// Plain classes (token_table::json_plain / raw_plain): 1 json_plain, 2 raw_plain, 3 both.
constexpr int k_plain_classes = 3;

// Which plain-text tokens a recogniser state takes whatever their bytes (json_prefix::plain, content_state::plain),
// so that a mask sets them from a precomputed set instead of walking them.
struct plain_info {
    int cls = 0;           // 0: none; else the plain class
    int64_t room = 0;      // ... with at most this many code points
    bool exact = true;     // longer ones of the class are refused (else they may fit: walked)
    bool bytes = false;    // room counts bytes, not code points (an additional key; never exact)
    size_t growth = 0;     // how many bytes longer such a token can make the shortest completion
    size_t closer = SIZE_MAX;  // the shortest completion after any such token, when the same for all
    bool refused = false;  // (a mask's) none of them may come: they are neither set nor walked
    uint64_t except[4] = {};  // first bytes whose plain tokens are walked instead (they may finish a tag)
    bool excepted(uint8_t b) const { return except[b >> 6] >> (b & 63) & 1; }
    void add_except(uint8_t b) { except[b >> 6] |= 1ull << (b & 63); }
    bool any_except() const { return except[0] | except[1] | except[2] | except[3]; }
};

// A recogniser state per trie depth (reused across walks: copy-assigning a state keeps its buffers).
template <class S>
struct trie_stack {
    std::vector<S> states;
    std::vector<S*> at;  // at[d]: the state after the first d bytes of the node being visited
};

class token_trie {
  public:
    static constexpr uint8_t k_last = 1u << k_plain_classes;  // node::flags
    static constexpr uint8_t k_many = 255;                     // node::max_cp: this many or more
    struct node {
        int32_t end = 0;       // preorder index just past this node's subtree
        int32_t first = 0;     // ids()[first, ...): the subtree's tokens; the first n_ids end here
        uint16_t depth = 0;    // bytes from the root (the root's children have depth 1)
        uint16_t max_len = 0;  // the most bytes of a token of the subtree
        uint8_t byte = 0;
        uint8_t n_ids = 0;
        // bit c - 1: every token of the subtree is plain of class c; k_last: the last child of its parent (the
        // parent's state is not needed after it)
        uint8_t flags = 0;
        uint8_t max_cp = 0;    // the most code points of a token of the subtree (whole UTF-8 characters)
        bool last() const { return flags & k_last; }
        bool all_plain(int cls) const { return flags >> (cls - 1) & 1; }
        bool cp_within(int64_t room) const { return max_cp != k_many && max_cp <= room; }
        bool plain_fits(int cls, int64_t room) const { return all_plain(cls) && cp_within(room); }
    };

    // bytes: the text per id; ids: the tokens to hold (non-empty texts); plain(c, id): id is plain of class c
    // (1..3); code_points per id.
    template <class Plain>
    void build(const std::vector<std::string>& bytes, std::vector<int32_t> ids, Plain&& plain,
               const std::vector<uint16_t>& code_points);

    const std::vector<node>& nodes() const { return nodes_; }
    const std::vector<int32_t>& ids() const { return ids_; }  // sorted by text (preorder)
    // ids()[first_byte(b), first_byte(b + 1)): the tokens whose text starts with byte b
    int32_t first_byte(int b) const { return by_first_[(size_t)b]; }
    int max_depth() const { return max_depth_; }
    int max_cp() const { return max_cp_; }
    const std::vector<int32_t>& longest_first() const { return by_len_; }  // the ids, longest text first
    // ids()[x.first, ids_end(x)): the tokens of x's subtree
    int32_t ids_end(const node& x) const { return x.end < (int32_t)nodes_.size() ? nodes_[(size_t)x.end].first : (int32_t)ids_.size(); }

    // Feeds every node's byte to a copy of its parent's state (S::feed(char) -> bool), from s0 at the root. A
    // subtree is not entered when skip(node) says so, nor past a rejected byte; visit(id, state) is called for
    // each token whose whole text was accepted, with the state after it.
    template <class S, class Skip, class Visit>
    void walk(const S& s0, trie_stack<S>& st, Skip&& skip, Visit&& visit) const;

  private:
    void link(const std::vector<std::string>& bytes);  // nodes_ from ids_ (sorted)
    std::vector<node> nodes_;                        // preorder
    std::vector<int32_t> ids_, by_len_;
    int32_t by_first_[257] = {};
    int max_depth_ = 0, max_cp_ = 0;
};

// Per plain class, the bitset of its tokens with at most r code points (mask_words layout).
class plain_sets {
  public:
    // Small rooms (a bounded string near its limit) get their set by one copy; from here on the longer tokens
    // are few (~1% of a 151k vocabulary has 16 code points or more) and are added one by one.
    static constexpr int k_steps = 16;
    void build(int64_t n_ids, const std::vector<uint8_t>& json_plain, const std::vector<uint8_t>& raw_plain,
               const std::vector<uint16_t>& code_points);
    // Writes (overwrites) the words of class cls (1..3) with at most room code points.
    void write(int cls, int64_t room, uint32_t* words) const;

  private:
    int64_t n_words_ = 0;
    std::vector<uint32_t> bits_;  // [class][k][n_words_]: its tokens with at most k code points, k < k_steps
    std::vector<std::vector<std::pair<uint16_t, int32_t>>> long_;  // per class: (code points, id), k_steps or more, ascending
};

// ---- templates

template <class Plain>
void token_trie::build(const std::vector<std::string>& bytes, std::vector<int32_t> ids, Plain&& plain,
                       const std::vector<uint16_t>& code_points) {
    std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
        return bytes[(size_t)a] < bytes[(size_t)b] || (bytes[(size_t)a] == bytes[(size_t)b] && a < b);
    });
    ids_ = std::move(ids);
    link(bytes);
    // plain and max_cp bottom up: a token's own, folded into each ancestor (preorder reversed: children first)
    std::vector<int32_t> parent(nodes_.size(), -1);
    std::vector<int32_t> open;
    for (int32_t i = 0; i < (int32_t)nodes_.size(); i++) {
        open.resize((size_t)nodes_[(size_t)i].depth - 1);
        parent[(size_t)i] = open.empty() ? -1 : open.back();
        open.push_back(i);
    }
    constexpr uint8_t k_all = (1u << k_plain_classes) - 1;
    for (node& x : nodes_) x.flags |= k_all, x.max_cp = 0, x.max_len = 0;  // no token yet
    max_cp_ = 0;
    for (int32_t i = (int32_t)nodes_.size(); i-- > 0;) {
        node& x = nodes_[(size_t)i];
        for (int k = 0; k < x.n_ids; k++) {
            const int32_t id = ids_[(size_t)(x.first + k)];
            for (int c = 1; c <= k_plain_classes; c++)
                if (!plain(c, id)) x.flags &= (uint8_t)~(1u << (c - 1));
            x.max_cp = (uint8_t)std::min<int>(std::max<int>(x.max_cp, code_points[(size_t)id]), k_many);
            x.max_len = std::max(x.max_len, x.depth);
            max_cp_ = std::max<int>(max_cp_, code_points[(size_t)id]);
        }
        if (parent[(size_t)i] >= 0) {
            node& p = nodes_[(size_t)parent[(size_t)i]];
            p.flags &= (uint8_t)(x.flags | k_last);
            p.max_cp = std::max(p.max_cp, x.max_cp);
            p.max_len = std::max(p.max_len, x.max_len);
        }
    }
}

template <class S, class Skip, class Visit>
void token_trie::walk(const S& s0, trie_stack<S>& st, Skip&& skip, Visit&& visit) const {
    if (st.states.size() < (size_t)max_depth_ + 1) {
        st.states.assign((size_t)max_depth_ + 1, s0);
        st.at.resize(st.states.size());
        for (size_t d = 0; d < st.states.size(); d++) st.at[d] = &st.states[d];
    }
    S** at = st.at.data();
    *at[0] = s0;
    const node* nd = nodes_.data();
    const int32_t n = (int32_t)nodes_.size();
    for (int32_t i = 0; i < n;) {
        const node& x = nd[i];
        if (skip(x)) {
            i = x.end;
            continue;
        }
        // the parent's state, copied; or, for its last child, taken over (nothing visits the parent's depth
        // again before rewriting it)
        if (x.last()) std::swap(at[x.depth - 1], at[x.depth]);
        else *at[x.depth] = *at[x.depth - 1];
        if (!at[x.depth]->feed((char)x.byte)) {
            i = x.end;
            continue;
        }
        for (int k = 0; k < x.n_ids; k++) visit(ids_[(size_t)(x.first + k)], *at[x.depth]);
        i++;
    }
}

}  // namespace tansy
