// Byte-level BPE on raw bytes: one pre-token in, token ids out. Ranks come from the order of the merges
// in tokenizer.json; at every step the lowest-ranked adjacent pair is merged, the leftmost on ties (HF
// tokenizers' BPE::merge_word with dropout off).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tansy {

// A bounded pre-token -> ids cache. Natural text repeats its words, so most pre-tokens skip BPE entirely.
// Not thread-safe: each encoding thread owns one (see tokenizer.cpp).
class word_cache {
  public:
    static constexpr size_t SLOTS = size_t(1) << 18;       // open addressing, power of two (6 MB of slots)
    static constexpr size_t MAX_ENTRIES = SLOTS / 2;       // load factor 0.5, then start over
    static constexpr size_t MAX_WORD_BYTES = 64;           // longer pre-tokens rarely repeat: not cached

    static uint64_t hash(std::string_view key);
    // Appends the cached ids of key to out and returns true, or returns false.
    bool get(std::string_view key, uint64_t h, std::vector<int32_t>& out) const;
    void put(std::string_view key, uint64_t h, const int32_t* ids, size_t n);
    void clear();
    size_t size() const { return used_; }

  private:
    struct slot {
        uint64_t hash = 0;  // 0: empty (hash() never returns 0)
        uint32_t key_off = 0, val_off = 0;
        uint16_t key_len = 0, val_len = 0;
    };
    std::vector<slot> slots_;  // allocated on first put
    std::string keys_;
    std::vector<int32_t> vals_;
    size_t used_ = 0;
};

// Scratch buffers for bpe_model::encode_word, reused across calls so the hot path does not allocate.
struct bpe_work {
    std::vector<int32_t> ids, ranks, merged;
    struct symbol {
        int32_t id, prev, next;
    };
    struct candidate {
        int32_t rank, pos, left, right, merged;
    };
    std::vector<symbol> symbols;
    std::vector<candidate> heap;
};

class bpe_model {
  public:
    struct options {
        int32_t unk_id = -1;        // emitted for a byte that has no token (-1: such bytes are dropped, as HF does)
        bool fuse_unk = false;      // consecutive unknown bytes give one unk
        bool ignore_merges = false;  // a pre-token that is itself a token is emitted whole
    };

    // byte_ids[b]: the token of the single byte b (-1 if none); fallback_ids[b]: the "<0xXX>" token used
    // instead when byte_fallback is on (-1 if none).
    bpe_model(const int32_t (&byte_ids)[256], const int32_t (&fallback_ids)[256], const options& opt);

    // Registers merge number `rank` (0 = applied first): (left, right) -> merged. A repeated pair keeps the
    // later rank, as HF's HashMap collect does.
    void add_merge(int32_t left, int32_t right, int32_t merged, int32_t rank);
    void reserve_merges(size_t n);
    // For ignore_merges: raw bytes of a whole token.
    void add_whole_word(std::string bytes, int32_t id);
    size_t n_merges() const { return n_pairs_; }

    // Appends the ids of one pre-token (raw bytes, non-empty).
    void encode_word(std::string_view word, std::vector<int32_t>& out, bpe_work& w) const;

  private:
    static constexpr int32_t NO_RANK = INT32_MAX;
    static constexpr uint64_t EMPTY_KEY = ~uint64_t(0);  // ids are non-negative: no real key has all bits set
    static constexpr size_t SMALL_WORD = 24;  // up to this many symbols a linear scan beats a heap

    struct pair_slot {
        uint64_t key = EMPTY_KEY;
        int32_t rank = NO_RANK, merged = -1;
    };
    const pair_slot* find_pair(int32_t left, int32_t right) const;
    void merge_small(std::vector<int32_t>& ids, std::vector<int32_t>& out, bpe_work& w) const;
    void merge_large(const std::vector<int32_t>& ids, std::vector<int32_t>& out, bpe_work& w) const;

    int32_t byte_ids_[256];
    int32_t fallback_ids_[256];
    options opt_;
    std::vector<pair_slot> pairs_;  // open addressing, size a power of two
    int pair_bits_ = 0;
    size_t n_pairs_ = 0;
    std::unordered_map<std::string, int32_t> whole_words_;
};

}  // namespace tansy
