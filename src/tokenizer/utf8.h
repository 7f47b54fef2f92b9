// UTF-8 validation and lossy decoding: the byte-level rules only (no Unicode tables).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tansy {

// Offset of the first byte that starts an invalid or truncated UTF-8 sequence in s, or -1 if s is valid.
// Valid means RFC 3629: no overlong forms, no surrogates (U+D800..DFFF), nothing above U+10FFFF.
int64_t utf8_find_invalid(std::string_view s);

// Appends s to out with every ill-formed subsequence replaced by U+FFFD, one per maximal subpart (the
// Unicode / WHATWG practice that Rust's String::from_utf8_lossy and HF tokenizers' decoders follow).
// With final = false, a truncated but so-far valid sequence at the end of s is left unconsumed, because
// more bytes may complete it. Returns the number of bytes of s consumed (s.size() when final).
size_t utf8_append_lossy(std::string_view s, bool final, std::string& out);

// utf8_append_lossy(s, true, ...) into a fresh string.
std::string utf8_lossy(std::string_view s);

// Encodes one code point (<= 0x10FFFF) as UTF-8; returns the byte count (1..4).
int utf8_encode(uint32_t cp, char out[4]);

// Length of the sequence a lead byte announces (0: the byte can never start one) and the allowed range of
// the FIRST continuation byte, which is what excludes overlongs (E0, F0), surrogates (ED) and > U+10FFFF
// (F4); later continuation bytes are always 0x80..0xBF. (Unicode 15 §3.9, table 3-7.)
struct utf8_lead_info {
    uint8_t len, lo, hi;
};

inline utf8_lead_info utf8_lead(uint8_t b) {
    if (b < 0x80) return {1, 0, 0};
    if (b < 0xC2) return {0, 0, 0};  // continuation byte or overlong 2-byte lead
    if (b < 0xE0) return {2, 0x80, 0xBF};
    if (b == 0xE0) return {3, 0xA0, 0xBF};
    if (b == 0xED) return {3, 0x80, 0x9F};
    if (b < 0xF0) return {3, 0x80, 0xBF};
    if (b == 0xF0) return {4, 0x90, 0xBF};
    if (b < 0xF4) return {4, 0x80, 0xBF};
    if (b == 0xF4) return {4, 0x80, 0x8F};
    return {0, 0, 0};
}

// UTF-8 checked one byte at a time, as the constrained-decoding recognisers read text (the same rules as
// utf8_find_invalid): *need is how many continuation bytes the current character still needs and [*lo, *hi]
// the range of the next one (a fresh state is 0, 0x80, 0xBF). False when c cannot come here; the state is
// then unchanged but for the range, which goes back to 0x80..0xBF when no character was under way.
inline bool utf8_step(uint8_t* need, uint8_t* lo, uint8_t* hi, uint8_t c) {
    if (*need > 0) {
        if (c < *lo || c > *hi) return false;
        (*need)--;
        *lo = 0x80, *hi = 0xBF;
        return true;
    }
    *lo = 0x80, *hi = 0xBF;
    const utf8_lead_info l = utf8_lead(c);
    if (l.len == 0) return false;
    if (l.len > 1) *need = (uint8_t)(l.len - 1), *lo = l.lo, *hi = l.hi;
    return true;
}

}  // namespace tansy
