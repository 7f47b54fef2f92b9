#include "tokenizer/utf8.h"

#include <cstring>

namespace tansy {

namespace {

// How many bytes of the sequence starting at s[i] are well-formed (1..len), and its announced length.
// valid == len: a complete code point. valid < len: a maximal ill-formed subpart of `valid` bytes
// (or, if it reaches the end of s, a possibly-truncated one).
inline int well_formed_prefix(const uint8_t* s, size_t n, size_t i, int* len) {
    const utf8_lead_info li = utf8_lead(s[i]);
    *len = li.len;
    if (li.len <= 1) return 1;
    int k = 1;
    for (; k < li.len && i + k < n; k++) {
        const uint8_t c = s[i + k];
        const uint8_t lo = k == 1 ? li.lo : 0x80, hi = k == 1 ? li.hi : 0xBF;
        if (c < lo || c > hi) break;
    }
    return k;
}

constexpr char REPLACEMENT[] = "\xEF\xBF\xBD";  // U+FFFD

}  // namespace

int64_t utf8_find_invalid(std::string_view sv) {
    const uint8_t* s = (const uint8_t*)sv.data();
    const size_t n = sv.size();
    size_t i = 0;
    while (i < n) {
        // ASCII fast path, 8 bytes at a time: most text (and all code) is mostly ASCII.
        if (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (!(w & 0x8080808080808080ull)) {
                i += 8;
                continue;
            }
        }
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        int len;
        const int ok = well_formed_prefix(s, n, i, &len);
        if (len == 0 || ok < len) return (int64_t)i;
        i += len;
    }
    return -1;
}

size_t utf8_append_lossy(std::string_view sv, bool final, std::string& out) {
    const uint8_t* s = (const uint8_t*)sv.data();
    const size_t n = sv.size();
    size_t i = 0, run = 0;  // [run, i): well-formed bytes not yet copied
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        int len;
        const int ok = well_formed_prefix(s, n, i, &len);
        if (len > 1 && ok == len) {
            i += len;
            continue;
        }
        out.append(sv.data() + run, i - run);
        if (len > 1 && i + ok == n && !final) return i;  // truncated: wait for more bytes
        out.append(REPLACEMENT, 3);
        i += ok;
        run = i;
    }
    out.append(sv.data() + run, n - run);
    return n;
}

std::string utf8_lossy(std::string_view s) {
    std::string out;
    out.reserve(s.size());
    utf8_append_lossy(s, true, out);
    return out;
}

int utf8_encode(uint32_t cp, char out[4]) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

}  // namespace tansy
