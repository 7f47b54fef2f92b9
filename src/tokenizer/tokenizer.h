// The byte-level BPE tokenizer of a Hugging Face tokenizer.json, exact to the `tokenizers` library
// (MODEL.md §12.1), and a streaming detokenizer.
//
// Supported tokenizer.json (anything else is a tansy::error at load, never a silent difference):
//   model          BPE: vocab, merges ("a b" strings or [a, b] pairs), unk_token, fuse_unk, byte_fallback,
//                  ignore_merges; dropout null/0; no subword prefix/suffix
//   normalizer     null, NFC, or a Sequence of NFC
//   pre_tokenizer  Sequence [Split(Regex|String, behavior Isolated, invert false), ByteLevel(add_prefix_space
//                  false, use_regex false)], or the ByteLevel step alone. The regex comes from the file.
//   decoder        ByteLevel
//   post_processor null or ByteLevel (encode() never adds BOS/EOS; the chat template writes special tokens)
//   added_tokens   matched as whole strings before BPE (leftmost, then longest), honouring lstrip, rstrip,
//                  single_word and normalized as HF does
// The pipeline: split out added tokens -> NFC -> regex pieces -> BPE per piece (cached).
//
// Exactness: the ids equal HF tokenizers 0.23's on every fixture case, on 10 MB of mixed text and on
// ~100k random strings of awkward characters. The known differences come from Unicode table versions and
// only touch recently assigned characters: HF's NFC tables predate Unicode 11,
// so it does not reorder marks such as U+07FD, U+089A or U+1ABF that tansy (utf8proc, Unicode 15)
// reorders; and HF's Oniguruma knows letters/digits of Unicode 15-16 (e.g. U+10D40, U+11F00) that PCRE2
// 10.42 (Unicode 14) does not.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tansy {

// Bytes [begin, end) of a text.
struct byte_range {
    size_t begin = 0, end = 0;
};

class tokenizer {
  public:
    // A tokenizer.json file, or a directory containing one. Throws tansy::error.
    static tokenizer load(const std::string& path);
    // From the text of a tokenizer.json; `what` names it in error messages.
    static tokenizer from_json(std::string_view json_text, const std::string& what = "tokenizer.json");

    tokenizer(tokenizer&&) noexcept;
    tokenizer& operator=(tokenizer&&) noexcept;
    ~tokenizer();

    // Token ids of text, as HF's Tokenizer.encode(text, add_special_tokens=True).ids for these files.
    // parse_special = false treats the text of special added tokens as plain text (HF's
    // encode_special_tokens = True); non-special added tokens (<think>, <tool_call>, ...) still match.
    // Throws tansy::error when text is not valid UTF-8 (the message gives the byte offset).
    // Thread-safe: each encoding thread keeps its own pre-token cache (allocated on first use, typically
    // ~8 MB, bounded by word_cache's limits in bpe.h).
    std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;
    // The same ids as encode(text), except that no added token (special or not) is matched where its text
    // overlaps one of `plain` (ascending, disjoint ranges): there it is tokenised as ordinary text. For
    // prompts that mix trusted template text with client text (render_chat_marked): a client cannot type
    // "<|im_start|>system" into a message and get the control token. Text with no token text inside the plain
    // ranges gets exactly encode(text)'s ids: pre-tokenisation still runs across the range boundaries.
    std::vector<int32_t> encode(std::string_view text, std::span<const byte_range> plain) const;

    // The exact bytes of the tokens, concatenated (no U+FFFD substitution: a token sequence that ends inside
    // a multi-byte character gives a truncated UTF-8 sequence; use utf8_lossy() or stream_decoder for
    // display). skip_special drops special added tokens. Throws tansy::error for an id outside [0, size());
    // an id inside the range that names no token decodes to nothing (HF skips it).
    std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

    // Raw bytes of one token ("" for an unused id), valid while the tokenizer lives. Throws tansy::error
    // outside [0, size()).
    std::string_view token_bytes(int32_t id) const;
    // Id of a token given as tokenizer.json spells it (byte-level form for the vocabulary, e.g. "Ġthe";
    // the content for added tokens, e.g. "<|im_end|>"); -1 if there is none.
    int32_t find(std::string_view token) const;
    bool is_special(int32_t id) const;   // an added token with "special": true
    bool is_added(int32_t id) const;     // any added token
    int64_t size() const;                // highest id + 1
    int64_t n_merges() const;
    const std::string& pre_tokenizer_regex() const;  // the Split pattern as the file gives it ("" if none)

  private:
    struct impl;
    explicit tokenizer(std::unique_ptr<impl> p);
    std::unique_ptr<impl> impl_;
};

// Turns token ids into text as they are generated. Every string returned is valid UTF-8: bytes that may
// still become a character (a truncated multi-byte sequence at the end) are held back until the next token
// completes them; bytes that can no longer form a character become U+FFFD (one per maximal ill-formed
// subpart). The concatenation of all push() results and flush() equals utf8_lossy(decode(ids, skip_special)),
// which is decode() itself whenever that is valid UTF-8. With skip_special, a skipped special token between
// the halves of a character does not break it.
class stream_decoder {
  public:
    explicit stream_decoder(const tokenizer& tok, bool skip_special = false);
    std::string push(int32_t id);  // text complete now (may be empty); throws tansy::error for a bad id
    std::string flush();           // whatever is held back, as U+FFFD; the decoder is then empty
    void reset() { pending_.clear(); }
    bool has_pending() const { return !pending_.empty(); }

  private:
    const tokenizer* tok_;
    bool skip_special_;
    std::string pending_;  // undecoded bytes: at most one truncated UTF-8 sequence (< 4 bytes)
};

}  // namespace tansy
