// Token constraints for the scheduler (engine thread), built per request by the HTTP layer:
//   json_object_constraint   response_format json_object: after </think>, the content is one JSON object.
//                            The grammar is checked byte by byte on each candidate token's text; when the
//                            tokens left would no longer suffice to close the object, only tokens that
//                            spell out its shortest completion are allowed, so a length cut still gives
//                            parseable JSON. Once closed, only an end-of-turn id may follow.
//   prefix_constraint        tool_choice required / named: after </think>, the content must start with one
//                            of some strings ("<tool_call>\n<function=NAME>\n"), then the model is free.
//   schema_constraint        response_format json_schema, and tool calls whose parameters follow the tool's schema
//                            (tool_choice required / named, or auto together with a response_format): the content
//                            is what a content_spec allows (a JSON document of a schema, or tool calls, or either).
//                            See json_schema.h for the schema subset and content_spec below for the call format.
// With thinking on, all let the reasoning run free, but force </think> when the tokens left fall to a
// reserve, so that the constrained part always gets room.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/scheduler.h"
#include "server/json_schema.h"
#include "server/mask_cache.h"
#include "server/token_trie.h"
#include "tokenizer/tokenizer.h"

namespace tansy {

// The text of every sampleable id, shared (read-only) by all constraints of a server.
struct token_table {
    std::vector<std::string> bytes;  // raw bytes per id; "" for special and unused ids
    std::vector<bool> special;
    std::vector<int32_t> eos;        // end-of-turn ids (allowed once the constrained text is complete)
    int32_t think_end = -1;
    // per id: the text can sit inside a JSON string anywhere (no '"', '\\', control bytes; whole UTF-8 characters)
    std::vector<uint8_t> json_plain;
    // per id: the text can sit inside a raw tool-call string value anywhere (no '<'; whole UTF-8 characters;
    // not ending with a newline, which could start the value's closing "\n</parameter>")
    std::vector<uint8_t> raw_plain;
    std::vector<uint16_t> code_points;  // per id: UTF-8 characters in its text
    // The tries a mask walks. trie: the text tokens (not special, not empty, not an end of turn: those follow
    // complete()); inside a string, per plain class c - 1, rest: the text tokens not plain of it (the plain ones
    // come from `plain`), long_plain: its plain tokens of plain_sets::k_steps code points or more (checked only
    // when the room is not exact, in additional keys)
    token_trie trie;
    token_trie rest[k_plain_classes], long_plain[k_plain_classes];
    plain_sets plain;  // json_plain / raw_plain ids as mask bits, by code points
    static std::shared_ptr<const token_table> build(const tokenizer& tok, int64_t n_valid, std::vector<int32_t> eos,
                                                    int32_t think_end);
};

// token_constraint::allow's bits: every id below n allowed (the rest of the words clear).
void allow_all(uint32_t* words, int64_t n);

// A recogniser that must also spell out a given text (the shortest completion, when the tokens left need it).
template <class S>
struct spelling {
    S st;
    const std::string* text = nullptr;
    size_t pos = 0;
    bool feed(char c) {
        if (pos >= text->size() || (*text)[pos] != c) return false;
        pos++;
        return st.feed(c);
    }
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
    // Inside a string (no escape or character under way) any json_plain token (see token_table) is fine, and
    // leaves closer() as long as it was.
    plain_info plain() const;
    // Appends a text equal for two states that take the same bytes from here on (a mask cache's key).
    void key(std::string* out) const;

  private:
    enum class stage : uint8_t { start, value, obj_first, arr_first, obj_key, colon, after_value, string, number, literal, done };
    bool feed_value_start(char c);
    bool end_value();
    bool feed_number(char c, bool* consumed);

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

// Any text (what json_object_constraint checks its closer against: the closer alone).
struct any_text {
    bool feed(char) { return true; }
};

class json_object_constraint final : public token_constraint {
  public:
    json_object_constraint(std::shared_ptr<const token_table> t, bool thinking, int64_t reasoning_reserve);
    bool active() const override { return true; }
    void allow(uint32_t* words, int64_t n_valid, int64_t tokens_left) override;
    void accept(int32_t id) override;
    void memoise(bool on) { memo_ = on; }  // off: every mask is walked (benchmarks of the walk alone)

  private:
    std::shared_ptr<const token_table> t_;
    bool reasoning_;
    int64_t reserve_;
    json_prefix json_;
    // scratch of the mask walks, and their memo by state
    trie_stack<json_prefix> walk_;
    trie_stack<spelling<any_text>> spell_;
    std::string closer_, key_;
    std::vector<int32_t> walked_;
    mask_cache cache_{k_mask_cache_bytes};
    bool memo_ = true;
};

// A recogniser of "one of some texts, then anything" (prefix_constraint's walk): the sorted texts still
// matching [lo, hi) after pos bytes, or free once one has been spelled out.
struct prefix_state {
    const std::vector<std::string>* texts = nullptr;
    uint32_t lo = 0, hi = 0;
    size_t pos = 0;
    bool free = false;
    bool feed(char c);
};

class prefix_constraint final : public token_constraint {
  public:
    prefix_constraint(std::shared_ptr<const token_table> t, bool thinking, int64_t reasoning_reserve,
                      std::vector<std::string> alternatives);
    bool active() const override { return !done_; }
    void allow(uint32_t* words, int64_t n_valid, int64_t tokens_left) override;
    void accept(int32_t id) override;

  private:
    bool allowed(const std::string& text) const;
    std::shared_ptr<const token_table> t_;
    bool reasoning_;
    int64_t reserve_;
    std::vector<std::string> alts_;
    std::vector<std::string> sorted_;  // alts_ sorted (prefix_state)
    std::string so_far_;
    bool done_ = false;
    trie_stack<prefix_state> walk_;
};

// What the content after reasoning may be: a JSON document of schema node json_root, and / or tool calls in the
// Qwen XML format the output parser reads, each parameter in the order the tool lists them, required ones forced:
//   <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>\n</tool_call>
// VALUE is raw text for parameters the parser reads as strings (it may not contain a parser tag:
// <parameter=, </parameter>, </function>, </tool_call>), else compact-or-spaced JSON of the parameter's schema,
// restricted to what the parser converts back (integer|null for "integer", number|null for "number",
// boolean|null for "boolean"). Only listed parameters are written. After a call: the end of the turn, or with
// parallel calls "\n" and another call (at most 8).
struct content_spec {
    struct param {
        std::string name;
        bool required = false, raw = false, ok = true;  // raw: a string parameter; ok: it can be written at all
        int node = 0;                                    // JSON parameters: the schema node
        std::vector<std::string> raw_enum;               // raw: allowed values + "\n</parameter>\n", sorted
        bool has_enum = false;
        uint32_t min_len = 0, max_len = UINT32_MAX;
        std::string min_value;                           // the shortest value text
    };
    struct tool {
        std::string name;
        bool free = false;  // its schema is outside the subset: after the header the model is free
        std::vector<param> params;
        std::vector<std::string> pnames_sorted;  // "P>\n"
        std::vector<int> pnames_param;
    };
    std::shared_ptr<schema_program> prog;
    int json_root = -1;
    std::vector<tool> tools;
    std::vector<std::string> names_sorted;  // "NAME>\n"
    std::vector<int> names_tool;
    bool parallel = true;
};

// Builds the spec. json: response_format's schema (nullptr: none; an "object" schema for json_object);
// tools: the OpenAI tools array, only: the one allowed ("" for any); a tool whose parameters cannot be compiled
// is free (not constrained) unless its function has strict true (then schema_error). Throws schema_error, whose
// message starts with "tools[i] " for a tool's schema.
std::shared_ptr<const content_spec> build_content_spec(const nlohmann::ordered_json* json, bool json_strict,
                                                       const nlohmann::ordered_json& tools, const std::string& only,
                                                       bool with_tools, bool parallel);

// The recogniser of a content_spec (like json_prefix: feed bytes, cheap to copy).
class content_state {
  public:
    explicit content_state(const content_spec* s);
    bool feed(char c);
    bool feed(std::string_view s);
    bool complete() const;  // the end of the turn may come now
    bool free() const { return phase_ == ph_free; }
    size_t closer(std::string* out) const;  // the shortest completion ("" when complete)
    // Which plain-text tokens (see token_table) are fine here whatever their bytes: json_plain ones inside a
    // JSON string, raw_plain ones inside a raw value, both inside a JSON string of a tool parameter or beside
    // tools; but for those that could finish a tag under way in the last bytes (plain_info::except).
    plain_info plain() const;
    // Appends a text equal for two states (of one spec) that take the same bytes from here on and say the same to
    // plain() (a mask cache's key; the shortest completion may differ): the fields the phase reads, counts past
    // every limit that could still apply folded, of the raw tail only what could still become a tag.
    void key(std::string* out) const;

  private:
    enum : uint8_t { ph_start, ph_lit, ph_name, ph_params, ph_pname, ph_sval, ph_senum, ph_jval, ph_after, ph_json,
                     ph_free };
    bool feed_lit(char c);
    bool begin_value();
    size_t tool_rest(size_t next, std::string* out) const;
    size_t param_rest(size_t p, std::string* out) const;
    size_t lit_rest(std::string* out) const;
    size_t phase_rest(uint8_t ph, std::string* out) const;
    const content_spec::tool& tool() const { return s_->tools[(size_t)tool_]; }

    const content_spec* s_;
    uint8_t phase_ = ph_start, lit_next_ = 0, ws_ = 0, calls_ = 0;
    const std::string* lit_ = nullptr;
    const std::vector<std::string>* texts_ = nullptr;  // name / pname / senum / params range
    uint32_t lo_ = 0, hi_ = 0;
    uint16_t pos_ = 0;
    int16_t tool_ = -1, param_ = -1;
    uint16_t next_ = 0;
    // raw value: the last bytes (to spot tags), code points, UTF-8 state
    char tail_[16] = {};
    uint8_t tail_n_ = 0, m_ = 0, u8_need_ = 0, u8_lo_ = 0x80, u8_hi_ = 0xBF;
    uint32_t chars_ = 0;
    schema_state js_;
};

class schema_constraint final : public token_constraint {
  public:
    schema_constraint(std::shared_ptr<const token_table> t, bool thinking, int64_t reasoning_reserve,
                      std::shared_ptr<const content_spec> spec);
    bool active() const override { return !done_ && !st_.free(); }
    void allow(uint32_t* words, int64_t n_valid, int64_t tokens_left) override;
    void accept(int32_t id) override;
    const content_state& state() const { return st_; }
    void set_state(const content_state& s) { st_ = s, reasoning_ = false; }  // for tests and benchmarks
    void memoise(bool on) { memo_ = on; }  // off: every mask is walked (benchmarks of the walk alone)

  private:
    std::shared_ptr<const token_table> t_;
    bool reasoning_;
    int64_t reserve_;
    std::shared_ptr<const content_spec> spec_;
    content_state st_;
    bool done_ = false;
    // scratch of the mask walks, and their memo by state
    trie_stack<content_state> walk_;
    trie_stack<spelling<content_state>> spell_;
    std::string closer_, key_;
    std::vector<int32_t> walked_;
    mask_cache cache_{k_mask_cache_bytes};
    bool memo_ = true;
};

}  // namespace tansy
