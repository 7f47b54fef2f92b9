// The grammar masks' per-token definition: every token of the vocabulary checked on its own, a copy of the
// recogniser fed its whole text; no byte tables, no plain-text sets, no memo. The oracle the trie-walk masks
// must equal exactly (test_grammar_mask.cpp), and the per-token cost in the mask benchmark (test_json_schema.cpp).
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "server/constraints.h"

namespace tansy::reference {

constexpr float k_neg_inf = -std::numeric_limits<float>::infinity();
constexpr int64_t k_near = 16;  // the constraints' near-the-limit window (constraints.cpp)

inline bool is_eos(const token_table& t, int32_t id) { return std::find(t.eos.begin(), t.eos.end(), id) != t.eos.end(); }

// Keeps at least one token: when a mask removed all, the end of the turn is the way out.
inline void ensure_one(const token_table& t, float* logits, const std::vector<float>& saved, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (logits[i] != k_neg_inf) return;
    for (int32_t e : t.eos)
        if (e >= 0 && e < n) logits[e] = saved.empty() ? 0.0f : saved[(size_t)e];
}

template <class F>
void mask_tokens(const token_table& t, float* logits, int64_t n, F&& ok) {
    std::vector<float> saved(logits, logits + n);
    for (int64_t i = 0; i < n; i++) {
        if (logits[i] == k_neg_inf) continue;
        if (!ok(i, t.bytes[(size_t)i])) logits[i] = k_neg_inf;
    }
    ensure_one(t, logits, saved, n);
}

// json_object_constraint's mask (after the reasoning) for recogniser state json.
inline void json_object_mask(const token_table& t, const json_prefix& json, float* logits, int64_t n, int64_t tokens_left) {
    n = std::min<int64_t>(n, (int64_t)t.bytes.size());
    const std::string closer = json.closer();
    const int64_t left = tokens_left - 1;
    const bool closing = left <= (int64_t)closer.size();
    const bool near = left <= (int64_t)closer.size() + k_near;
    json_prefix next = json;  // (assigned per token: its buffers reused)
    mask_tokens(t, logits, n, [&](int64_t i, const std::string& b) {
        if (json.complete()) return is_eos(t, (int32_t)i);
        if (t.special[(size_t)i] || b.empty()) return false;
        if (closing) return closer.compare(0, b.size(), b) == 0;
        next = json;
        return next.feed(b) && (!near || (int64_t)next.closer().size() <= left - 1);
    });
}

// prefix_constraint's mask (after the reasoning) once so_far has been written.
inline void prefix_mask(const token_table& t, const std::vector<std::string>& alts, const std::string& so_far,
                        float* logits, int64_t n) {
    auto allowed = [&](const std::string& s) {
        for (const std::string& a : alts)
            if (a.compare(0, std::min(a.size(), s.size()), s, 0, std::min(a.size(), s.size())) == 0) return true;
        return false;
    };
    n = std::min<int64_t>(n, (int64_t)t.bytes.size());
    mask_tokens(t, logits, n, [&](int64_t i, const std::string& b) {
        return !t.special[(size_t)i] && !b.empty() && allowed(so_far + b);
    });
}

// schema_constraint's mask (after the reasoning) for recogniser state st.
inline void schema_mask(const token_table& t, const content_state& st, float* logits, int64_t n, int64_t tokens_left) {
    n = std::min<int64_t>(n, (int64_t)t.bytes.size());
    std::string closer;
    const size_t clen = st.closer(&closer);
    const bool complete = st.complete();
    const int64_t left = tokens_left - 1;
    const bool closing = clen != SIZE_MAX && left <= (int64_t)clen;
    const bool near = clen != SIZE_MAX && left <= (int64_t)clen + k_near;
    content_state next = st;  // (assigned per token: its buffers reused)
    mask_tokens(t, logits, n, [&](int64_t i, const std::string& b) {
        if (is_eos(t, (int32_t)i)) return complete;
        if (t.special[(size_t)i] || b.empty()) return false;
        next = st;
        if (closing) return b.size() <= closer.size() && closer.compare(0, b.size(), b) == 0 && next.feed(b);
        return next.feed(b) && (!near || (int64_t)next.closer(nullptr) <= left - 1);
    });
}

// The bits of a masked row (a row of zeros masked: what the scheduler sent the device).
inline std::vector<uint32_t> bits_of(const std::vector<float>& logits, int64_t n_valid) {
    std::vector<uint32_t> w((size_t)((n_valid + 31) / 32), 0u);
    for (int64_t v = 0; v < n_valid; v++)
        if (logits[(size_t)v] != k_neg_inf) w[(size_t)(v / 32)] |= 1u << (v % 32);
    return w;
}

}  // namespace tansy::reference
