// JSON Schema -> a byte-level recogniser, for constrained decoding (response_format json_schema, tool calls).
//
// A schema (client data) is compiled into a small graph of nodes (schema_program). A recogniser state
// (schema_state) is a few alternative stacks of frames over that graph (a pushdown automaton); feed() takes one
// byte, closer() gives the shortest text that completes a valid document. States are plain data and cheap to
// copy: the constraint copies one per candidate token.
//
// The supported subset (JSON Schema 2020-12 / OpenAI structured outputs):
//   type               "string" "number" "integer" "boolean" "null" "object" "array", or a list of them
//   enum, const        any JSON values; the output spells them in compact form ({"a":1}, not {"a": 1})
//   nullable: true     (OpenAPI) adds null
//   properties         keys are written in the order listed; those in "required" cannot be skipped
//   required           a name not in "properties" takes the additionalProperties schema (400 if none)
//   additionalProperties  false (the default when absent, as OpenAI's strict mode), true, or a schema; other
//                      keys must not use escapes and are at most 256 bytes
//   items, prefixItems, minItems, maxItems
//   minLength, maxLength  (code points; \u escapes of surrogates are not produced)
//   anyOf, oneOf       alternatives tracked side by side (oneOf is treated as anyOf: with overlapping branches
//                      the output may match more than one); not together with other assertions in one object
//   allOf              with one element only
//   $ref               local: "#", "#/$defs/..", "#/definitions/..", any "#/json/pointer"; recursion is fine
//                      (the output nests at most k_max_nesting containers)
//   format, title, description, default, examples, $schema, $id, $comment ... : annotations, ignored
// Assertions outside the subset (pattern, minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf,
// uniqueItems, minProperties, maxProperties, patternProperties, propertyNames, not, if/then/else, contains,
// dependentRequired, dependentSchemas, unevaluatedProperties, unevaluatedItems, minContains, maxContains):
// with strict a schema_error naming the keyword; without, ignored (the output may then break them).
// Limits (schema_error past them): schema nesting 32, 2048 nodes, 4096 enum values per node, 1 MiB of enum text,
// 256 properties per object, a shortest valid document of at most 4096 bytes.
//
// Numbers are written plainly: at most 15 integer and 15 fraction digits, a two-digit exponent at most.
// Whitespace between tokens is allowed (runs of at most 24 bytes), none after the document.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace tansy {

struct schema_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

enum : uint8_t {
    st_null = 1, st_bool = 2, st_int = 4, st_num = 8, st_str = 16, st_obj = 32, st_arr = 64,
    st_any = 127,
};

constexpr size_t k_max_nesting = 32;  // containers open at once in the output

struct schema_node {
    uint8_t types = st_any;
    bool has_enum = false;
    std::vector<std::string> enums;  // sorted compact JSON texts of the allowed values (has_enum)
    std::vector<int> any_of;         // non-empty: a union of these (non-union) nodes
    int alias = -1;                  // during compilation: this node is a $ref to that one
    // object
    std::vector<std::string> prop_names;  // as written in the schema
    std::vector<std::string> prop_keys;   // JSON-escaped name, no quotes
    std::vector<int> prop_nodes;
    std::vector<uint8_t> prop_required;
    std::vector<std::string> keys_sorted;  // prop_keys sorted
    std::vector<int> keys_prop;            // keys_sorted[i] is prop keys_prop[i]
    int additional = -1;                   // -1: no other keys; else their schema
    // array
    std::vector<int> prefix;
    int items = 0;  // -1: no items past prefix
    uint32_t min_items = 0, max_items = UINT32_MAX;
    // string
    uint32_t min_len = 0, max_len = UINT32_MAX;
    // computed by finish()
    size_t min_size = SIZE_MAX;  // SIZE_MAX: no valid value (of at most the size limit)
    std::string min_text;        // the shortest valid value
    int min_depth = 0;           // containers the shortest value nests
};

class schema_program {
  public:
    schema_program();  // node 0: anything (the schema `true`); node 1: nothing (`false`)
    // Compiles one schema document (its $refs resolve within it); returns its root node. strict: keywords outside
    // the subset are errors rather than ignored. Throws schema_error.
    int compile(const nlohmann::ordered_json& doc, bool strict);
    // A copy of node n (a root) allowing only the types in mask (e.g. integer|null for a parameter the tool-call
    // parser reads as an integer).
    int restrict_types(int n, uint8_t mask);
    // Resolves references, flattens unions, computes shortest values. Call once after the last compile().
    void finish();
    const schema_node& node(int i) const { return nodes_[(size_t)i]; }
    size_t size() const { return nodes_.size(); }
    bool satisfiable(int n) const { return nodes_[(size_t)n].min_size != SIZE_MAX; }

  private:
    int compile_node(const nlohmann::ordered_json& s, int depth);
    int add();
    std::vector<schema_node> nodes_;
    // per compile()
    const nlohmann::ordered_json* doc_ = nullptr;
    bool strict_ = false;
    std::vector<std::pair<std::string, int>> refs_;
};

struct schema_frame {
    const std::vector<std::string>* texts = nullptr;  // lit: the texts matched; key: the object's keys_sorted
    int32_t node = 0;
    uint32_t count = 0;  // arr: items done; str: code points; key: bytes; num: digits in the current part
    uint32_t lo = 0, hi = 0;  // lit / key: the texts still matching
    uint16_t pos = 0;         // lit / key: bytes matched
    int16_t cur = -1;         // obj: the property whose value is read (-1: an additional one)
    uint16_t next = 0;        // obj: the first property that may still come
    uint8_t kind = 0, st = 0;
    uint8_t esc = 0, u8_need = 0, u8_lo = 0x80, u8_hi = 0xBF;
    uint8_t flags = 0;  // num: integer only; key: additional key still possible
};

struct schema_alt {
    std::vector<schema_frame> stack;  // empty: the value is complete
    uint8_t ws = 0;                   // whitespace run
};

// The state of one JSON value being read against a node of a program.
class schema_state {
  public:
    schema_state() = default;
    schema_state(const schema_program* p, int root);
    schema_state(const schema_state& o);
    schema_state& operator=(const schema_state& o);
    schema_state(schema_state&& o) noexcept
        : p_(o.p_), alts_(std::move(o.alts_)), n_(o.n_), started_(o.started_) { o.n_ = 0; }
    schema_state& operator=(schema_state&& o) noexcept {
        p_ = o.p_, alts_ = std::move(o.alts_), n_ = o.n_, started_ = o.started_;
        o.n_ = 0;
        return *this;
    }
    enum class result : uint8_t { fail, ok, ended };  // ended: the value was complete before c (c not consumed)
    result feed(char c);
    bool feed(std::string_view s);  // all bytes consumed
    // The value is complete here (nothing more is needed; e.g. after "12" or "{}").
    bool accepting() const;
    bool finished() const;  // complete and nothing may follow (e.g. after "}", not after "12")
    // The shortest text completing the value (appended to *out when given); its length.
    size_t closer(std::string* out) const;
    bool started() const { return started_; }
    // Inside a string (a single alternative, after a complete character, no escape pending): how many more code
    // points of plain string text may come (UINT32_MAX: any); -1 when not in such a string. Tokens of plain text
    // that fit pass without a walk. *exact: longer plain text is refused. In an additional key the limit is in
    // bytes (*bytes set): plain text of at most room bytes fits, longer text may (its last character may start
    // inside the room).
    int64_t free_string_room(bool* exact, bool* bytes) const;
    // Appends a text that is equal for two states (of one program) that take the same bytes from here on: the
    // fields each frame reads, with counts past every limit that could still apply folded (a mask cache's key;
    // the shortest completion may differ).
    void key(std::string* out) const;

  private:
    const schema_program* p_ = nullptr;
    std::vector<schema_alt> alts_;  // [0, n_): the live alternatives; the rest keep their buffers for reuse
    uint8_t n_ = 0;
    bool started_ = false;
};

}  // namespace tansy
