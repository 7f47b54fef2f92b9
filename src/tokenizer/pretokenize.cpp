#include "tokenizer/pretokenize.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "tokenizer/utf8.h"

namespace tansy {

// --- regex translation -----------------------------------------------------------------------------------

namespace {

// Oniguruma's \s, spelled with properties both engines define the same way: White_Space = Zs+Zl+Zp plus
// the five ASCII controls \t..\r and NEL. (\x0B, not \v: in PCRE2 \v is the vertical-space class.)
constexpr const char* WHITE_SPACE_ITEMS = "\\p{Z}\\t\\n\\x0B\\f\\r\\x{85}";

[[noreturn]] void unsupported(std::string_view p, size_t at, const char* what) {
    fail("tokenizer regex: %s at offset %zu is not supported (its meaning differs between Oniguruma, which "
         "the reference uses, and PCRE2): %.*s",
         what, at, (int)p.size(), p.data());
}

// Copies a \p{..} / \x{..} style braced escape (or the short one-character form) starting at p[i] == '\\'.
size_t copy_escape_arg(std::string_view p, size_t i, std::string& out) {
    const size_t start = i;
    i += 2;  // "\p"
    if (i < p.size() && p[i] == '{') {
        const size_t close = p.find('}', i);
        if (close == std::string_view::npos) fail("tokenizer regex: unterminated '\\%c{' at offset %zu", p[start + 1], start);
        i = close + 1;
    } else if (p[start + 1] == 'x') {
        while (i < p.size() && i < start + 4 && isxdigit((unsigned char)p[i])) i++;  // \xHH
    } else {
        i++;  // \pL
    }
    if (i > p.size()) fail("tokenizer regex: truncated escape at offset %zu", start);
    out.append(p.substr(start, i - start));
    return i;
}

}  // namespace

std::string translate_hf_regex(std::string_view p) {
    std::string out;
    out.reserve(p.size() * 2);
    bool in_class = false;
    size_t class_body = 0;  // offset of the first character of the current class body
    size_t i = 0;
    while (i < p.size()) {
        const char c = p[i];
        if (c == '\\') {
            if (i + 1 >= p.size()) fail("tokenizer regex: trailing backslash: %.*s", (int)p.size(), p.data());
            const char e = p[i + 1];
            switch (e) {
                case 's':
                    out += in_class ? std::string(WHITE_SPACE_ITEMS) : std::string("[") + WHITE_SPACE_ITEMS + "]";
                    i += 2;
                    continue;
                case 'S':
                    if (in_class) unsupported(p, i, "\\S inside a character class");
                    out += std::string("[^") + WHITE_SPACE_ITEMS + "]";
                    i += 2;
                    continue;
                case 'p':
                case 'P':
                case 'x':
                    i = copy_escape_arg(p, i, out);
                    continue;
                case 'u': {  // Oniguruma \uHHHH -> PCRE2 \x{HHHH}
                    if (i + 6 > p.size()) fail("tokenizer regex: truncated \\u escape at offset %zu", i);
                    out += "\\x{" + std::string(p.substr(i + 2, 4)) + "}";
                    i += 6;
                    continue;
                }
                case 'v':
                    out += "\\x0B";
                    i += 2;
                    continue;
                case 'd':  // both: \p{Nd}
                case 'D':
                case 'r':
                case 'n':
                case 't':
                case 'f':
                case 'e':
                case 'a':
                    out.append(p.substr(i, 2));
                    i += 2;
                    continue;
                case 'A':
                case 'z':
                case 'Z':
                    if (in_class) unsupported(p, i, "an anchor inside a character class");
                    out.append(p.substr(i, 2));
                    i += 2;
                    continue;
                default:
                    if (isalnum((unsigned char)e)) unsupported(p, i, strprintf("'\\%c'", e).c_str());
                    out.append(p.substr(i, 2));  // an escaped punctuation character is a literal in both
                    i += 2;
                    continue;
            }
        }
        if (in_class) {
            if (c == '[') unsupported(p, i, p.substr(i, 2) == "[:" ? "a POSIX class" : "a nested character class");
            if (c == '&' && p.substr(i, 2) == "&&") unsupported(p, i, "class intersection '&&'");
            if (c == ']' && i > class_body) in_class = false;
            out += c;
            i++;
            continue;
        }
        switch (c) {
            case '[':
                in_class = true;
                out += c;
                i++;
                if (i < p.size() && p[i] == '^') out += p[i++];
                class_body = i;  // a ']' right here is a literal in both engines
                continue;
            case '(':
                if (p.substr(i, 2) == "(?") {
                    static const char* const allowed[] = {"(?:", "(?=", "(?!", "(?<=", "(?<!", "(?>", "(?i:"};
                    bool ok = false;
                    for (const char* a : allowed) ok = ok || p.substr(i, strlen(a)) == a;
                    if (!ok) unsupported(p, i, "this group syntax");
                }
                break;
            case '^':
            case '$':
                unsupported(p, i, "a line anchor");  // Ruby syntax: always multi-line
            default:
                break;
        }
        out += c;
        i++;
    }
    if (in_class) fail("tokenizer regex: unterminated character class: %.*s", (int)p.size(), p.data());
    return out;
}

// --- regex_splitter --------------------------------------------------------------------------------------

regex_splitter::regex_splitter(std::string_view hf_pattern) : hf_pattern_(hf_pattern) {
    const std::string pcre_pattern = translate_hf_regex(hf_pattern);
    pcre2_compile_context* cc = pcre2_compile_context_create(nullptr);
    TANSY_CHECK(cc, "pcre2_compile_context_create failed");
    pcre2_set_newline(cc, PCRE2_NEWLINE_LF);  // Oniguruma's '.' excludes only \n
    int err = 0;
    PCRE2_SIZE err_off = 0;
    pcre2_code* code = pcre2_compile((PCRE2_SPTR)pcre_pattern.data(), pcre_pattern.size(),
                                     PCRE2_UTF | PCRE2_UCP, &err, &err_off, cc);
    pcre2_compile_context_free(cc);
    if (!code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        fail("tokenizer regex does not compile: %s at offset %zu of the translated pattern %s", (const char*)msg,
             (size_t)err_off, pcre_pattern.c_str());
    }
    code_ = code;
    // JIT is what makes pre-tokenisation fast; without it (an unsupported CPU) pcre2_match still works.
    jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

regex_splitter::~regex_splitter() {
    if (code_) pcre2_code_free((pcre2_code*)code_);
}

regex_splitter::regex_splitter(regex_splitter&& o) noexcept
    : hf_pattern_(std::move(o.hf_pattern_)), code_(o.code_), jit_(o.jit_) {
    o.code_ = nullptr;
}

regex_splitter& regex_splitter::operator=(regex_splitter&& o) noexcept {
    if (this != &o) {
        if (code_) pcre2_code_free((pcre2_code*)code_);
        hf_pattern_ = std::move(o.hf_pattern_);
        code_ = o.code_;
        jit_ = o.jit_;
        o.code_ = nullptr;
    }
    return *this;
}

regex_splitter::matcher::matcher(const regex_splitter& re) : re_(&re) {
    match_data_ = pcre2_match_data_create_from_pattern((const pcre2_code*)re.code_, nullptr);
    TANSY_CHECK(match_data_, "pcre2_match_data_create failed");
}

regex_splitter::matcher::~matcher() { pcre2_match_data_free((pcre2_match_data*)match_data_); }

bool regex_splitter::matcher::find(std::string_view s, size_t from, size_t* start, size_t* end) {
    auto* code = (const pcre2_code*)re_->code_;
    auto* md = (pcre2_match_data*)match_data_;
    // note: the caller validated s as UTF-8 once; checking again per match would make this quadratic.
    int rc = re_->jit_ ? pcre2_jit_match(code, (PCRE2_SPTR)s.data(), s.size(), from, 0, md, nullptr)
                       : pcre2_match(code, (PCRE2_SPTR)s.data(), s.size(), from, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)  // deep backtracking: the interpreter keeps its frames on the heap
        rc = pcre2_match(code, (PCRE2_SPTR)s.data(), s.size(), from, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        fail("tokenizer regex: matching failed at byte %zu: %s", from, (const char*)msg);
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    *start = ov[0];
    *end = ov[1];
    TANSY_CHECK(*start >= from && *end >= *start && *end <= s.size(), "bad regex match [%zu, %zu) from %zu",
                *start, *end, from);
    return true;
}

// --- normalisation ---------------------------------------------------------------------------------------

bool nfc_maybe_changes(std::string_view s) {
    // U+0300 is 0xCC 0x80 in UTF-8 and every lead byte >= 0xCC starts a code point >= U+0300; continuation
    // bytes are 0x80..0xBF, so one byte compare per byte finds them.
    for (unsigned char b : s)
        if (b >= 0xCC) return true;
    return false;
}

namespace {

// NFC of one segment through utf8proc, into a per-thread buffer (utf8proc_map would malloc per call).
void append_nfc_utf8proc(std::string_view s, std::string& out) {
    constexpr auto OPTIONS = (utf8proc_option_t)(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    thread_local std::vector<utf8proc_int32_t> buf;
    utf8proc_ssize_t n = -1;
    for (int attempt = 0; attempt < 2; attempt++) {  // the first call may only report the size it needs
        if (buf.size() < s.size() + 1) buf.resize(s.size() + 1);
        n = utf8proc_decompose((const utf8proc_uint8_t*)s.data(), (utf8proc_ssize_t)s.size(), buf.data(),
                               (utf8proc_ssize_t)buf.size() - 1, OPTIONS);
        if (n < 0) fail("NFC normalisation failed: %s", utf8proc_errmsg(n));
        if ((size_t)n < buf.size()) break;
        buf.resize((size_t)n + 1);
    }
    TANSY_CHECK(n >= 0 && (size_t)n < buf.size(), "utf8proc_decompose: %lld code points", (long long)n);
    n = utf8proc_reencode(buf.data(), n, OPTIONS);  // composes, then writes UTF-8 over the buffer
    if (n < 0) fail("NFC normalisation failed: %s", utf8proc_errmsg(n));
    out.append((const char*)buf.data(), (size_t)n);
}

// One segment with the U+11A7 workaround.
// note: utf8proc (<= 2.8 at least) composes an LV syllable + U+11A7 by adding T index 0, i.e. it drops
// U+11A7, which is not a trailing consonant (those are U+11A8..U+11C2). U+11A7 is a starter that
// composes with nothing, so NFC(a + U+11A7 + b) = NFC(a) + U+11A7 + NFC(b): normalise around it.
void append_nfc(std::string_view s, std::string& out) {
    constexpr std::string_view HANGUL_11A7 = "\xE1\x86\xA7";
    size_t from = 0;
    for (size_t at; (at = s.find(HANGUL_11A7, from)) != std::string_view::npos; from = at + HANGUL_11A7.size()) {
        append_nfc_utf8proc(s.substr(from, at - from), out);
        out.append(HANGUL_11A7);
    }
    append_nfc_utf8proc(s.substr(from), out);
}

// A code point before which NFC can cut the text: a starter (ccc 0) that has no canonical decomposition and
// never composes with what precedes it. Canonical reordering stops at starters and composition needs the
// preceding starter, so NFC(a + x + b) = NFC(a) + NFC(x + b), and such x alone is unchanged by NFC.
// Everything below U+0300 qualifies (NFC quick check "minimum NO/MAYBE"), as do most CJK ideographs,
// kana and letters of other scripts. Hangul is left to utf8proc (its composition is algorithmic).
bool nfc_boundary(uint32_t cp) {
    if (cp < 0x300) return true;
    if ((cp >= 0x1100 && cp <= 0x11FF) || (cp >= 0xAC00 && cp <= 0xD7A3)) return false;
    const utf8proc_property_t* p = utf8proc_get_property((utf8proc_int32_t)cp);
    // comb_index: UINT16_MAX = takes no part in compositions; >= 0x8000 = can be a second element.
    const bool second = p->comb_index != UINT16_MAX && p->comb_index >= 0x8000;
    return p->combining_class == 0 && p->decomp_seqindex == UINT16_MAX && !second;
}

}  // namespace

void nfc_normalize(std::string_view s, std::string& out) {
    // Only segments between boundary code points that hold something else go through utf8proc; most text
    // (ASCII, CJK, Cyrillic, ...) is copied.
    out.clear();
    out.reserve(s.size());
    size_t done = 0;     // s[0, done) is in out
    size_t segment = 0;  // start of the current segment (a boundary code point, or 0)
    bool dirty = false;  // the segment holds a non-boundary code point
    for (size_t i = 0; i < s.size();) {
        int len = 1;
        const bool boundary = (uint8_t)s[i] < 0x80 || nfc_boundary(decode_cp(s, i, &len));
        if (boundary) {
            if (dirty) {
                out.append(s.substr(done, segment - done));
                append_nfc(s.substr(segment, i - segment), out);
                done = i;
                dirty = false;
            }
            segment = i;
        } else {
            dirty = true;
        }
        i += len;
    }
    out.append(s.substr(done, segment - done));
    if (dirty)
        append_nfc(s.substr(segment), out);
    else
        out.append(s.substr(segment));
}

uint32_t decode_cp(std::string_view s, size_t i, int* len) {
    const uint8_t* p = (const uint8_t*)s.data() + i;
    if (p[0] < 0x80) return *len = 1, p[0];
    if (p[0] < 0xE0) return *len = 2, ((p[0] & 0x1Fu) << 6) | (p[1] & 0x3Fu);
    if (p[0] < 0xF0) return *len = 3, ((p[0] & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
    return *len = 4, ((p[0] & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
}

bool is_white_space_at(std::string_view s, size_t i, int* len) {
    const uint32_t cp = decode_cp(s, i, len);
    if ((cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85) return true;
    if (cp < 0x80) return false;
    const utf8proc_category_t cat = utf8proc_category((utf8proc_int32_t)cp);
    return cat == UTF8PROC_CATEGORY_ZS || cat == UTF8PROC_CATEGORY_ZL || cat == UTF8PROC_CATEGORY_ZP;
}

bool is_word_cp(uint32_t cp) {
    if (cp == '_' || cp == 0x200C || cp == 0x200D) return true;
    switch (utf8proc_category((utf8proc_int32_t)cp)) {
        case UTF8PROC_CATEGORY_LU:
        case UTF8PROC_CATEGORY_LL:
        case UTF8PROC_CATEGORY_LT:
        case UTF8PROC_CATEGORY_LM:
        case UTF8PROC_CATEGORY_LO:
        case UTF8PROC_CATEGORY_MN:
        case UTF8PROC_CATEGORY_MC:
        case UTF8PROC_CATEGORY_ME:
        case UTF8PROC_CATEGORY_ND:
        case UTF8PROC_CATEGORY_NL:
        case UTF8PROC_CATEGORY_PC:
            return true;
        default:
            return false;
    }
}

// --- byte level ------------------------------------------------------------------------------------------

uint32_t byte_to_unicode(uint8_t b) {
    // bytes_to_unicode(): '!'..'~', '¡'..'¬', '®'..'ÿ' keep their code point; the rest are numbered from 256.
    auto printable = [](int x) { return (x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE); };
    if (printable(b)) return b;
    uint32_t n = 0;
    for (int x = 0; x < b; x++) n += !printable(x);
    return 256 + n;
}

namespace {
struct byte_level_tables {
    uint32_t to_cp[256];
    int16_t from_cp[324];  // code points of the alphabet are all < 256 + 68
    byte_level_tables() {
        for (int16_t& v : from_cp) v = -1;
        for (int b = 0; b < 256; b++) {
            to_cp[b] = byte_to_unicode((uint8_t)b);
            TANSY_CHECK(to_cp[b] < 324, "byte-level map out of range");
            from_cp[to_cp[b]] = (int16_t)b;
        }
    }
};
const byte_level_tables& tables() {
    static const byte_level_tables t;
    return t;
}
}  // namespace

bool byte_level_decode(std::string_view s, std::string& out) {
    out.clear();
    if (utf8_find_invalid(s) >= 0) return false;
    const byte_level_tables& t = tables();
    for (size_t i = 0; i < s.size();) {
        int len;
        const uint32_t cp = decode_cp(s, i, &len);
        if (cp >= 324 || t.from_cp[cp] < 0) return false;
        out += (char)t.from_cp[cp];
        i += len;
    }
    return true;
}

std::string byte_level_encode(std::string_view bytes) {
    std::string out;
    const byte_level_tables& t = tables();
    for (unsigned char b : bytes) {
        char buf[4];
        out.append(buf, utf8_encode(t.to_cp[b], buf));
    }
    return out;
}

}  // namespace tansy
