// Token constraints for the scheduler (engine thread), built per request by the HTTP layer:
//   json_object_constraint   response_format json_object: after </think>, the content is one JSON object.
//                            The grammar is checked byte by byte on each candidate token's text; when the
//                            tokens left would no longer suffice to close the object, only tokens that
//                            spell out its shortest completion are allowed, so a length cut still gives
//                            parseable JSON. Once closed, only an end-of-turn id may follow.
//   prefix_constraint        tool_choice required / named: after </think>, the content must start with one
//                            of some strings ("<tool_call>\n<function=NAME>\n"), then the model is free.
// With thinking on, both let the reasoning run free, but force </think> when the tokens left fall to a
// reserve, so that the constrained part always gets room.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "runtime/scheduler.h"
#include "tokenizer/tokenizer.h"

namespace tansy {

// The text of every sampleable id, shared (read-only) by all constraints of a server.
struct token_table {
    std::vector<std::string> bytes;  // raw bytes per id; "" for special and unused ids
    std::vector<bool> special;
    std::vector<int32_t> eos;        // end-of-turn ids (allowed once the constrained text is complete)
    int32_t think_end = -1;
    static std::shared_ptr<const token_table> build(const tokenizer& tok, int64_t n_valid, std::vector<int32_t> eos,
                                                    int32_t think_end);
};

// A JSON prefix recogniser: feed() bytes one at a time; false when the text can no longer be the start of one
// JSON object (optionally surrounded by whitespace). Small and copyable: copied per candidate token.
class json_prefix {
  public:
    bool feed(char c);
    bool feed(std::string_view s);
    bool complete() const { return stage_ == stage::done; }
    // The shortest text that completes the object from here ("" when complete).
    std::string closer() const;

  private:
    enum class stage : uint8_t { start, value, obj_first, arr_first, obj_key, colon, after_value, string, number, literal, done };
    bool feed_value_start(char c);
    bool end_value();
    bool feed_number(char c, bool* consumed);
    bool feed_utf8(unsigned char c);

    stage stage_ = stage::start;
    std::string stack_;       // '{' / '[' per open container
    bool key_ = false;        // the string being read is an object key
    uint8_t esc_ = 0;         // inside a string: 1 after '\\', 2..5 inside \uXXXX (hex digits left + 1)
    uint8_t num_ = 0;         // number sub-state (see feed_number)
    const char* lit_ = nullptr;  // literal being matched ("true", "false", "null") and how far
    uint8_t lit_pos_ = 0;
    uint8_t ws_run_ = 0;      // consecutive whitespace outside strings (bounded: no endless indentation)
    // inside a string: continuation bytes the current UTF-8 character still needs, and the next one's range
    uint8_t u8_need_ = 0, u8_lo_ = 0x80, u8_hi_ = 0xBF;
};

class json_object_constraint final : public token_constraint {
  public:
    json_object_constraint(std::shared_ptr<const token_table> t, bool thinking, int64_t reasoning_reserve);
    bool active() const override { return true; }
    void mask(float* logits, int64_t n_valid, int64_t tokens_left) override;
    void accept(int32_t id) override;

  private:
    std::shared_ptr<const token_table> t_;
    bool reasoning_;
    int64_t reserve_;
    json_prefix json_;
};

class prefix_constraint final : public token_constraint {
  public:
    prefix_constraint(std::shared_ptr<const token_table> t, bool thinking, int64_t reasoning_reserve,
                      std::vector<std::string> alternatives);
    bool active() const override { return !done_; }
    void mask(float* logits, int64_t n_valid, int64_t tokens_left) override;
    void accept(int32_t id) override;

  private:
    bool allowed(const std::string& text) const;
    std::shared_ptr<const token_table> t_;
    bool reasoning_;
    int64_t reserve_;
    std::vector<std::string> alts_;
    std::string so_far_;
    bool done_ = false;
};

}  // namespace tansy
