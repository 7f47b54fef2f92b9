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

}  // namespace tansy
