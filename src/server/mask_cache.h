// A constraint's memo of mask walks by recogniser state (constraints.cpp). Away from the length limit, which
// tokens a recogniser accepts depends on its state alone, and states repeat: every step inside one string
// (counters no limit can reach are folded out of the key), after each comma of an array of objects, between
// tool calls. A hit replaces the walk by setting the bits it found. Bounded by bytes, least recently used out.
// One per request (the engine thread's constraint), so no locking.
#pragma once
#include <cstddef>
#include <cstdint>
#include <list>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tansy {

// Per request: ~150 string states' walked tokens on a 151k vocabulary (a few KB each; a state whose walk allows
// most of the vocabulary is stored as mask words, 19-31 KB); 64 constrained rows hold 64 MiB at most.
constexpr size_t k_mask_cache_bytes = (size_t)1 << 20;

class mask_cache {
  public:
    explicit mask_cache(size_t max_bytes) : max_bytes_(max_bytes) {}
    // Sets the bits of the ids stored for a state key into words (n_words of them); false when there are none.
    bool apply(const std::string& key, uint32_t* words, int64_t n_words);
    // Stores the ids a walk allowed from a state (as ids, or as mask words when those take less room).
    void insert(const std::string& key, const std::vector<int32_t>& ids, int64_t n_words);
    size_t bytes() const { return bytes_; }
    size_t size() const { return map_.size(); }

  private:
    struct entry {
        std::string key;
        bool dense = false;           // data: mask words (dense) or ids
        std::vector<uint32_t> data;
        size_t bytes() const { return key.size() + data.size() * sizeof(uint32_t) + k_overhead; }
    };
    static constexpr size_t k_overhead = 96;  // list node, map slot, vector and string headers (about)
    size_t max_bytes_, bytes_ = 0;
    std::list<entry> lru_;  // most recently used first
    std::unordered_map<std::string_view, std::list<entry>::iterator> map_;  // keys view the entries' own
};

}  // namespace tansy
