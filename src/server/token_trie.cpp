// The vocabulary trie and the plain-text token sets (token_trie.h).
#include "server/token_trie.h"

#include <cstring>

#include "core/check.h"

namespace tansy {

// One node per distinct prefix, in preorder: token k shares its first lcp bytes with token k - 1 (sorted), so
// it opens nodes for its bytes from lcp on; a node's subtree ends where a later token's lcp falls below its depth.
void token_trie::link(const std::vector<std::string>& bytes) {
    nodes_.clear();
    max_depth_ = 0;
    std::vector<int32_t> open;  // open[d]: the node of depth d + 1 on the current path
    auto close_to = [&](size_t depth) {
        while (open.size() > depth) {
            nodes_[(size_t)open.back()].end = (int32_t)nodes_.size();
            open.pop_back();
        }
    };
    const std::string* prev = nullptr;
    for (size_t k = 0; k < ids_.size(); k++) {
        const std::string& b = bytes[(size_t)ids_[k]];
        TANSY_CHECK(!b.empty() && b.size() <= UINT16_MAX, "token_trie: token %d has %zu bytes", ids_[k], b.size());
        size_t lcp = 0;
        if (prev)
            while (lcp < b.size() && lcp < prev->size() && b[lcp] == (*prev)[lcp]) lcp++;
        close_to(lcp);
        for (size_t d = lcp; d < b.size(); d++) {
            open.push_back((int32_t)nodes_.size());
            node x;
            x.byte = (uint8_t)b[d];
            x.depth = (uint16_t)(d + 1);
            x.first = (int32_t)k;
            nodes_.push_back(x);
        }
        node& end = nodes_[(size_t)open.back()];
        if (end.n_ids == 0) end.first = (int32_t)k;
        TANSY_CHECK(end.n_ids < UINT8_MAX, "token_trie: more than %d tokens spell the same text", UINT8_MAX);
        end.n_ids++;
        max_depth_ = std::max(max_depth_, (int)b.size());
        prev = &b;
    }
    close_to(0);
    by_len_ = ids_;
    std::stable_sort(by_len_.begin(), by_len_.end(),
                     [&](int32_t a, int32_t b) { return bytes[(size_t)a].size() > bytes[(size_t)b].size(); });
    size_t k = 0;
    for (int b = 0; b <= 256; b++) {
        while (k < ids_.size() && (uint8_t)bytes[(size_t)ids_[k]][0] < b) k++;
        by_first_[b] = (int32_t)k;
    }
    // the last child: its subtree ends where its parent's does
    std::vector<int32_t> path;
    for (int32_t i = 0; i < (int32_t)nodes_.size(); i++) {
        node& x = nodes_[(size_t)i];
        path.resize((size_t)x.depth - 1);
        const int32_t parent_end = path.empty() ? (int32_t)nodes_.size() : nodes_[(size_t)path.back()].end;
        if (x.end == parent_end) x.flags |= k_last;
        path.push_back(i);
    }
}

void plain_sets::build(int64_t n_ids, const std::vector<uint8_t>& json_plain, const std::vector<uint8_t>& raw_plain,
                       const std::vector<uint16_t>& code_points) {
    n_words_ = (n_ids + 31) / 32;
    bits_.assign((size_t)k_plain_classes * k_steps * (size_t)n_words_, 0u);
    long_.assign(k_plain_classes, {});
    for (int64_t id = 0; id < n_ids; id++) {
        const bool j = json_plain[(size_t)id], r = raw_plain[(size_t)id];
        const uint16_t cp = code_points[(size_t)id];
        for (int c = 1; c <= k_plain_classes; c++) {
            if (((c & 1) && !j) || ((c & 2) && !r)) continue;
            if (cp >= k_steps) {
                long_[(size_t)c - 1].emplace_back(cp, (int32_t)id);
                continue;
            }
            for (int k = cp; k < k_steps; k++) {
                uint32_t* w = bits_.data() + ((size_t)(c - 1) * k_steps + (size_t)k) * (size_t)n_words_;
                w[id / 32] |= 1u << (id % 32);
            }
        }
    }
    for (auto& l : long_) std::sort(l.begin(), l.end());
}

void plain_sets::write(int cls, int64_t room, uint32_t* words) const {
    TANSY_CHECK(cls >= 1 && cls <= k_plain_classes, "plain_sets: class %d", cls);
    const int64_t k = std::clamp<int64_t>(room, 0, k_steps - 1);
    const uint32_t* src = bits_.data() + ((size_t)(cls - 1) * k_steps + (size_t)k) * (size_t)n_words_;
    std::memcpy(words, src, (size_t)n_words_ * sizeof(uint32_t));
    if (room < k_steps) return;
    for (const auto& [cp, id] : long_[(size_t)cls - 1]) {
        if (cp > room) break;
        words[id / 32] |= 1u << (id % 32);
    }
}

}  // namespace tansy
