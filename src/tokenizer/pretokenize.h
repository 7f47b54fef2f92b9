// Pre-tokenisation: the only Unicode-heavy code. NFC normalisation (utf8proc), the Split pre-tokenizer's
// regex (PCRE2 with UTF + UCP and JIT), and the GPT-2 byte <-> unicode map of the ByteLevel steps.
// Third-party types stay in pretokenize.cpp (STYLE rule 15).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace tansy {

// --- regex -----------------------------------------------------------------------------------------------

// Hugging Face tokenizers compiles Split patterns with Oniguruma (Ruby syntax); tansy uses PCRE2. The two
// agree on everything the Qwen/GPT-style patterns use except:
//  - \s: Oniguruma matches exactly Unicode White_Space (= \p{Z} plus \t \n \v \f \r and U+0085), PCRE2 10.42
//    also matches U+180E. \s and \S are therefore rewritten in terms of \p{Z}.
// Constructs whose meaning differs and that no known tokenizer uses (\w \b \h, ^ $, POSIX and nested
// classes, inline flags other than (?i:...)) are rejected with tansy::error rather than guessed at.
// Both engines use their own Unicode tables for \p{..} and case folding, so characters assigned in recent
// Unicode versions may classify differently (PCRE2 10.42: Unicode 14).
std::string translate_hf_regex(std::string_view onig_pattern);

// The regex of a Split pre-tokenizer with behaviour "Isolated": text is cut into the matches and the
// (non-empty) gaps between them, in order. Thread-safe: each call allocates its own match state.
class regex_splitter {
  public:
    explicit regex_splitter(std::string_view hf_pattern);  // throws tansy::error (unsupported / bad regex)
    ~regex_splitter();
    regex_splitter(regex_splitter&&) noexcept;
    regex_splitter& operator=(regex_splitter&&) noexcept;

    const std::string& pattern() const { return hf_pattern_; }

    // Per-call match state (PCRE2 match data); make one per encode call and reuse it for every segment.
    class matcher {
      public:
        explicit matcher(const regex_splitter& re);
        ~matcher();
        matcher(const matcher&) = delete;
        matcher& operator=(const matcher&) = delete;

        // First match in s at or after `from` (s must be valid UTF-8; lookarounds see all of s).
        // Returns false when there is none.
        bool find(std::string_view s, size_t from, size_t* start, size_t* end);

      private:
        const regex_splitter* re_;
        void* match_data_;  // pcre2_match_data_8*
    };

    // Calls f(piece) for each piece of s: every match, and every gap between matches. An empty match splits
    // the text without producing a piece (as HF's Split does), and the search resumes one character later.
    template <class F>
    void split(std::string_view s, matcher& m, F&& f) const {
        size_t pos = 0, gap = 0, ms, me;
        while (pos <= s.size() && m.find(s, pos, &ms, &me)) {
            if (ms > gap) f(s.substr(gap, ms - gap));
            if (me > ms) {
                f(s.substr(ms, me - ms));
                pos = gap = me;
            } else {
                gap = ms;
                pos = ms + 1;
                while (pos < s.size() && ((uint8_t)s[pos] & 0xC0) == 0x80) pos++;  // next code point
            }
            if (pos >= s.size()) break;
        }
        if (gap < s.size()) f(s.substr(gap));
    }

  private:
    friend class matcher;
    std::string hf_pattern_;
    void* code_ = nullptr;  // pcre2_code_8*
    bool jit_ = false;
};

// --- normalisation ---------------------------------------------------------------------------------------

// NFC of valid UTF-8 text into out (replacing its contents). The text is cut before every code point that
// NFC cannot join to what precedes it (all of ASCII and Latin-1, most letters and ideographs); only the
// pieces that hold something else (combining marks, decomposable or composable characters, Hangul) go
// through utf8proc, so mostly-plain text is copied at memory speed.
void nfc_normalize(std::string_view s, std::string& out);
// True when s may change under NFC (it has a code point >= U+0300); false means it is certainly NFC
// (nothing below U+0300 decomposes or combines: the NFC quick check's "minimum NO/MAYBE" bound).
bool nfc_maybe_changes(std::string_view s);

// Rust's char::is_whitespace (Unicode White_Space) for the code point starting at s[i]; *len gets its length.
bool is_white_space_at(std::string_view s, size_t i, int* len);
// A word character as HF's single_word check sees it (Rust regex \w: Alphabetic, marks, Nd, Pc, Join_Control),
// approximated by general category L*, M*, Nd, Nl, Pc and U+200C/U+200D (misses the few Other_Alphabetic
// symbols such as circled letters).
bool is_word_cp(uint32_t cp);
// Decodes the code point at s[i] (s valid UTF-8); *len gets its length.
uint32_t decode_cp(std::string_view s, size_t i, int* len);

// --- byte level ------------------------------------------------------------------------------------------

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes map to themselves, the other 68 to U+0100.. in order.
uint32_t byte_to_unicode(uint8_t b);
// Raw bytes of a byte-level token string such as "Ġthe" -> " the". Returns false (out unspecified) if a
// character is outside the byte-level alphabet or s is not valid UTF-8.
bool byte_level_decode(std::string_view s, std::string& out);
// The byte-level string of raw bytes (" the" -> "Ġthe").
std::string byte_level_encode(std::string_view bytes);

}  // namespace tansy
