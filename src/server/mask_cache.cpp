// The mask walks' memo (mask_cache.h).
#include "server/mask_cache.h"

namespace tansy {

bool mask_cache::apply(const std::string& key, uint32_t* words, int64_t n_words) {
    const auto it = map_.find(key);
    if (it == map_.end()) return false;
    lru_.splice(lru_.begin(), lru_, it->second);
    const entry& e = *it->second;
    if (e.dense) {
        for (int64_t w = 0; w < n_words && w < (int64_t)e.data.size(); w++) words[w] |= e.data[(size_t)w];
    } else {
        for (uint32_t id : e.data) words[id / 32] |= 1u << (id % 32);
    }
    return true;
}

void mask_cache::insert(const std::string& key, const std::vector<int32_t>& ids, int64_t n_words) {
    if (map_.count(key)) return;
    entry e;
    e.key = key;
    e.dense = (int64_t)ids.size() > n_words;
    if (e.dense) {
        e.data.assign((size_t)n_words, 0u);
        for (int32_t id : ids) e.data[(size_t)(id / 32)] |= 1u << (id % 32);
    } else {
        e.data.assign(ids.begin(), ids.end());
    }
    const size_t b = e.bytes();
    if (b > max_bytes_) return;
    while (bytes_ + b > max_bytes_ && !lru_.empty()) {
        bytes_ -= lru_.back().bytes();
        map_.erase(lru_.back().key);
        lru_.pop_back();
    }
    lru_.push_front(std::move(e));
    map_.emplace(lru_.front().key, lru_.begin());
    bytes_ += b;
}

}  // namespace tansy
