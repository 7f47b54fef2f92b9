// Grammar masks (constraints.cpp): the trie walk's bits (plain sets and memo included: one constraint serves
// all the states of a walk) equal the per-token definition (mask_reference.h) exactly, on the real 151k Qwen3
// vocabulary and the tiny model's, in random states reached by random walks through several schemas, tool-call
// specs, json_object and forced prefixes, and in hand-picked edge states, at several tokens_left values around
// the closing and near-the-limit thresholds. Seeds are fresh per run (TANSY_MASK_SEED repeats one).
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <sstream>

#include "mask_reference.h"
#include "runtime/text_engine.h"
#include "scheduler_test_util.h"
#include "server/constraints.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace tansy {
namespace {

using ojson = nlohmann::ordered_json;

constexpr int64_t k_far = 100000;  // tokens left that never constrain the length
constexpr int k_steps = 40;        // tokens per random walk (enough to get into nested values and tool calls)
constexpr size_t k_all_lefts = 9;  // lefts_around: far and all eight values around the thresholds

using test::tiny;

std::shared_ptr<const token_table> tiny_table() {
    static auto t = token_table::build(tiny().tok(), tiny().eng().n_valid_tokens(), tiny().eos(), tiny().think_end());
    return t;
}

std::shared_ptr<const token_table> qwen3_table() {
    static std::shared_ptr<const token_table> t = [] {
        const std::string path = test::fixture("tokenizers/qwen3/tokenizer.json");
        if (path.empty()) return std::shared_ptr<const token_table>();
        const tokenizer tok = tokenizer::load(path);
        std::vector<int32_t> eos;
        if (tok.find("<|im_end|>") >= 0) eos.push_back(tok.find("<|im_end|>"));
        return token_table::build(tok, tok.size(), eos, tok.find("</think>"));
    }();
    return t;
}

uint32_t base_seed() {
    static const uint32_t s = [] {
        const char* e = std::getenv("TANSY_MASK_SEED");
        return e ? (uint32_t)std::strtoul(e, nullptr, 10) : std::random_device{}();
    }();
    return s;
}

// The first ids where two masks differ, with their texts, for a failure message.
std::string mask_diff(const token_table& t, const std::vector<uint32_t>& got, const std::vector<uint32_t>& want) {
    std::ostringstream o;
    int shown = 0;
    for (int64_t id = 0; id < (int64_t)want.size() * 32 && shown < 8; id++) {
        const bool g = got[(size_t)(id / 32)] >> (id % 32) & 1u, w = want[(size_t)(id / 32)] >> (id % 32) & 1u;
        if (g == w) continue;
        o << " id " << id << " " << ojson(id < (int64_t)t.bytes.size() ? utf8_lossy(t.bytes[(size_t)id]) : "").dump()
          << (g ? " allowed, should not be;" : " refused, should be allowed;");
        shown++;
    }
    return o.str();
}

// The tokens_left values to check in a state whose shortest completion has clen bytes: far, and `checks` - 1
// (at random) of: at and around the point where only the completion is spelled (clen + 1) and where each
// token's own completion is checked (clen + 1 + k_near), and the last tokens.
std::vector<int64_t> lefts_around(size_t clen, size_t checks, std::mt19937& rng) {
    std::vector<int64_t> v = {1, 2};
    if (clen != SIZE_MAX) {
        const int64_t c = (int64_t)clen;
        for (int64_t d : {0, 1, 2}) v.push_back(c + d);
        for (int64_t d : {0, 1, 2}) v.push_back(c + 1 + reference::k_near + d);
    }
    std::shuffle(v.begin(), v.end(), rng);
    v.resize(std::min(v.size(), checks - 1));
    v.insert(v.begin(), k_far);
    return v;
}

// The next token of a random walk, among the allowed ids (bits): often the next piece of the shortest completion
// or one that changes the structure (not plain string text, not only whitespace), so that walks reach keys,
// nested values, closers and tool-call parts rather than long strings and indentation.
int32_t pick(const token_table& t, const std::vector<uint32_t>& bits, const std::string& closer, std::mt19937& rng) {
    std::vector<int32_t> all, structural, toward;
    for (int64_t id = 0; id < (int64_t)t.bytes.size(); id++) {
        if (!(bits[(size_t)(id / 32)] >> (id % 32) & 1u)) continue;
        all.push_back((int32_t)id);
        const std::string& b = t.bytes[(size_t)id];
        const bool blank = !b.empty() && b.find_first_not_of(" \t\r\n") == std::string::npos;
        if (!blank && (!t.json_plain[(size_t)id] || b.size() <= 2)) structural.push_back((int32_t)id);
        if (!b.empty() && closer.compare(0, b.size(), b) == 0) toward.push_back((int32_t)id);
    }
    const int r = (int)(rng() % 20);
    const std::vector<int32_t>& from = r < 7 && !toward.empty() ? toward : r < 14 && !structural.empty() ? structural : all;
    return from[rng() % from.size()];
}

bool is_eos(const token_table& t, int32_t id) { return std::find(t.eos.begin(), t.eos.end(), id) != t.eos.end(); }

// Random walks through a schema_constraint's states; at each, the masks compared at several tokens_left.
void schema_walks(const std::shared_ptr<const token_table>& t, const std::shared_ptr<const content_spec>& spec,
                  const std::string& what, uint32_t seed, int walks, size_t checks) {
    const int64_t n = (int64_t)t->bytes.size();
    std::vector<uint32_t> got((size_t)mask_words(n));
    std::vector<float> row((size_t)n);
    schema_constraint c(t, false, 8, spec);  // one constraint for all states: whatever it keeps between steps counts
    for (int w = 0; w < walks; w++) {
        std::mt19937 rng(seed + (uint32_t)w);
        content_state st(spec.get());
        std::string text;
        for (int k = 0; k < k_steps && !st.free(); k++) {
            c.set_state(st);
            std::vector<uint32_t> far;
            for (int64_t left : lefts_around(st.closer(nullptr), checks, rng)) {
                c.allow(got.data(), n, left);
                std::fill(row.begin(), row.end(), 0.0f);
                reference::schema_mask(*t, st, row.data(), n, left);
                const std::vector<uint32_t> want = reference::bits_of(row, n);
                ASSERT_EQ(got, want) << what << ", seed " << seed + w << ", tokens_left " << left << ", after "
                                     << ojson(utf8_lossy(text)).dump() << ":" << mask_diff(*t, got, want);
                if (left == k_far) far = want;
            }
            std::string closer;
            st.closer(&closer);
            const int32_t id = pick(*t, far, closer, rng);
            if (is_eos(*t, id)) break;
            ASSERT_TRUE(st.feed(t->bytes[(size_t)id])) << what << ": an allowed token was refused";
            text += t->bytes[(size_t)id];
        }
    }
}

const ojson& demo_tools() {
    static const ojson t = ojson::parse(R"([
      {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "minLength": 1}, "days": {"type": "integer"},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
         "hourly": {"type": "boolean"}, "where": {"type": "object", "properties": {"lat": {"type": "number"},
         "lon": {"type": "number"}}, "required": ["lat", "lon"]}}, "required": ["city", "days", "where"]}}},
      {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
         "text": {"type": "string"}, "title": {"type": "string", "minLength": 2, "maxLength": 5},
         "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["text"]}}},
      {"type": "function", "function": {"name": "plot", "parameters": {"type": "object", "properties": {
         "points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"},
         "label": {"type": "string", "maxLength": 8}}, "required": ["x"]}, "minItems": 1},
         "style": {"type": "string", "enum": ["line", "dots"]}, "scale": {"type": "integer"}}, "required": ["points"]}}},
      {"type": "function", "function": {"name": "free_form", "parameters": {"type": "object", "properties": {
         "x": {"$ref": "https://example.com/x.json"}}}}}])");
    return t;
}

struct spec_case {
    std::string name;
    std::shared_ptr<const content_spec> spec;
};

std::vector<spec_case> spec_cases() {
    const ojson record = ojson::parse(R"({"type": "object", "properties": {
        "id": {"type": "integer"}, "name": {"type": "string", "minLength": 2, "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "kind": {"enum": ["alpha", "beta", "gamma delta", 7, null]},
        "meta": {"type": "object", "properties": {"score": {"type": "number"}, "ok": {"type": "boolean"},
                 "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}, "required": ["score"],
                 "additionalProperties": {"type": "integer"}},
        "items": {"type": "array", "items": {"anyOf": [{"type": "object", "properties": {"x": {"type": "integer"}},
                  "required": ["x"]}, {"type": "string", "minLength": 1, "maxLength": 3}]}}},
        "required": ["id", "name", "kind"]})");
    const ojson tree = ojson::parse(R"({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "string"},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}}, "required": ["v"]}},
        "$ref": "#/$defs/node"})");
    const ojson either = ojson::parse(R"({"anyOf": [{"type": "object", "properties": {"a": {"const": "x y"}},
        "required": ["a"]}, {"type": "array", "prefixItems": [{"type": "string", "minLength": 2, "maxLength": 4},
        {"type": "integer"}], "items": false, "minItems": 2}, {"type": "string", "maxLength": 3}]})");
    const ojson any_object = {{"type", "object"}, {"additionalProperties", true}};
    const ojson text = ojson::parse(R"({"type": "object", "properties": {"text": {"type": "string"}},
        "required": ["text"], "additionalProperties": true})");
    return {
        {"record", build_content_spec(&record, false, nullptr, "", false, true)},
        {"tree", build_content_spec(&tree, false, nullptr, "", false, true)},
        {"anyOf", build_content_spec(&either, false, nullptr, "", false, true)},
        {"any object", build_content_spec(&any_object, false, nullptr, "", false, true)},
        {"text + tools", build_content_spec(&text, false, demo_tools(), "", true, true)},
        {"tools", build_content_spec(nullptr, false, demo_tools(), "", true, true)},
        {"named tool", build_content_spec(nullptr, false, demo_tools(), "note", true, false)},
        {"named JSON-valued tool", build_content_spec(nullptr, false, demo_tools(), "plot", true, true)},
        {"record + tools", build_content_spec(&record, false, demo_tools(), "", true, true)},
    };
}

// checks: tokens_left values per state (the per-token definition costs ~1 ms a check on the 151k vocabulary)
void all_schema_walks(const std::shared_ptr<const token_table>& t, int walks, size_t checks) {
    const uint32_t seed = base_seed();
    SCOPED_TRACE("TANSY_MASK_SEED=" + std::to_string(seed));
    uint32_t k = 0;
    for (const spec_case& s : spec_cases()) schema_walks(t, s.spec, s.name, seed + 1000 * k++, walks, checks);
}

TEST(grammar_mask, schema_masks_equal_the_per_token_definition_tiny_vocab) { all_schema_walks(tiny_table(), 8, k_all_lefts); }

TEST(grammar_mask, schema_masks_equal_the_per_token_definition_qwen3_vocab) {
    if (!qwen3_table()) GTEST_SKIP() << "no tokenizers/qwen3 fixture";
    all_schema_walks(qwen3_table(), 1, 2);  // (the per-token definition takes ~10 ms a check here)
}

// Hand-picked states where a plain-text shortcut could go wrong: tags under way in raw values and in strings
// beside tools, bounded raw strings at and past their limits, long additional keys, values that just ended.
void edge_states(const std::shared_ptr<const token_table>& t) {
    const ojson text = ojson::parse(R"({"type": "object", "properties": {"text": {"type": "string"}},
        "required": ["text"], "additionalProperties": true})");
    const ojson any_object = {{"type", "object"}, {"additionalProperties", true}};
    const auto tools = build_content_spec(nullptr, false, demo_tools(), "", true, true);
    const auto json_tools = build_content_spec(&text, false, demo_tools(), "", true, true);
    const auto keys = build_content_spec(&any_object, false, nullptr, "", false, true);
    const std::string note = "<tool_call>\n<function=note>\n<parameter=text>\n";
    const std::string title = note + "x\n</parameter>\n<parameter=title>\n";
    const std::string city = "<tool_call>\n<function=get_weather>\n<parameter=city>\n";
    const std::string points = "<tool_call>\n<function=plot>\n<parameter=points>\n[{\"x\": 1, \"label\": \"";
    const std::vector<std::pair<std::shared_ptr<const content_spec>, std::string>> states = {
        {tools, note + "x</param"}, {tools, note + "x\n</par"}, {tools, note + "x\n<"}, {tools, note + "x\n"},
        {tools, note + "a < b <"}, {tools, note + "a </function"}, {tools, note + "<tool_ca"}, {tools, note + "x\n</parameter"},
        {tools, title}, {tools, title + "a"}, {tools, title + "abcd"}, {tools, title + "abcde"}, {tools, title + "abcde\n"},
        {tools, title + "ab\n</"}, {tools, city}, {tools, city + "P"}, {tools, city + "Paris\n"},
        {tools, points}, {tools, points + "a</param"}, {tools, points + "<b>x</b"}, {tools, points + "abcdefg"},
        {json_tools, "{\"text\": \"a <tool_c"}, {json_tools, "{\"text\": \"<b>x</b> <"}, {json_tools, "{\"<tool"},
        {keys, "{\"" + std::string(190, 'k')}, {keys, "{\"" + std::string(250, 'k')}, {keys, "{\"\u00e9" + std::string(200, 'k')},
        {keys, "{\"k\": \"v\""}, {keys, "{\"k\": 12"},
    };
    const int64_t n = (int64_t)t->bytes.size();
    std::vector<uint32_t> got((size_t)mask_words(n));
    std::vector<float> row((size_t)n);
    std::mt19937 rng(base_seed());
    for (const auto& [spec, prefix] : states) {
        content_state st(spec.get());
        ASSERT_TRUE(st.feed(prefix)) << prefix;
        schema_constraint c(t, false, 8, spec);
        c.set_state(st);
        for (int64_t left : lefts_around(st.closer(nullptr), k_all_lefts, rng)) {
            c.allow(got.data(), n, left);
            std::fill(row.begin(), row.end(), 0.0f);
            reference::schema_mask(*t, st, row.data(), n, left);
            const std::vector<uint32_t> want = reference::bits_of(row, n);
            EXPECT_EQ(got, want) << "after " << ojson(prefix).dump() << ", tokens_left " << left << ":"
                                 << mask_diff(*t, got, want);
        }
    }
}

TEST(grammar_mask, edge_states_equal_the_per_token_definition) {
    edge_states(tiny_table());
    if (qwen3_table()) edge_states(qwen3_table());
}

// json_object_constraint: its state follows the tokens it accepts; a json_prefix fed alike is the oracle's.
void json_object_walks(const std::shared_ptr<const token_table>& t, int walks, size_t checks) {
    const uint32_t seed = base_seed();
    SCOPED_TRACE("TANSY_MASK_SEED=" + std::to_string(seed));
    const int64_t n = (int64_t)t->bytes.size();
    std::vector<uint32_t> got((size_t)mask_words(n));
    std::vector<float> row((size_t)n);
    for (int w = 0; w < walks; w++) {
        std::mt19937 rng(seed + (uint32_t)w);
        json_object_constraint c(t, false, 8);
        json_prefix st;
        std::string text;
        for (int k = 0; k < k_steps; k++) {
            std::vector<uint32_t> far;
            for (int64_t left : lefts_around(st.closer().size(), checks, rng)) {
                c.allow(got.data(), n, left);
                std::fill(row.begin(), row.end(), 0.0f);
                reference::json_object_mask(*t, st, row.data(), n, left);
                const std::vector<uint32_t> want = reference::bits_of(row, n);
                ASSERT_EQ(got, want) << "json_object, seed " << seed + w << ", tokens_left " << left << ", after "
                                     << ojson(utf8_lossy(text)).dump() << ":" << mask_diff(*t, got, want);
                if (left == k_far) far = want;
            }
            const int32_t id = pick(*t, far, st.closer(), rng);
            c.accept(id);
            if (is_eos(*t, id)) break;
            ASSERT_TRUE(st.feed(t->bytes[(size_t)id]));
            text += t->bytes[(size_t)id];
        }
    }
}

TEST(grammar_mask, json_object_masks_equal_the_per_token_definition) {
    json_object_walks(tiny_table(), 8, k_all_lefts);
    if (qwen3_table()) json_object_walks(qwen3_table(), 3, 3);
}

// prefix_constraint: the forced tool-call header (and a blank-line variant), from every point of a walk.
void prefix_walks(const std::shared_ptr<const token_table>& t, int walks) {
    const uint32_t seed = base_seed();
    SCOPED_TRACE("TANSY_MASK_SEED=" + std::to_string(seed));
    const std::vector<std::string> alts = {"<tool_call>\n<function=get_weather>\n", "<tool_call>\n<function=note>\n",
                                           "\n\n<tool_call>\n<function=note>\n"};
    const int64_t n = (int64_t)t->bytes.size();
    std::vector<uint32_t> got((size_t)mask_words(n));
    std::vector<float> row((size_t)n);
    for (int w = 0; w < walks; w++) {
        std::mt19937 rng(seed + (uint32_t)w);
        prefix_constraint c(t, false, 8, alts);
        std::string so_far;
        for (int k = 0; k < k_steps && c.active(); k++) {
            c.allow(got.data(), n, k_far);
            std::fill(row.begin(), row.end(), 0.0f);
            reference::prefix_mask(*t, alts, so_far, row.data(), n);
            const std::vector<uint32_t> want = reference::bits_of(row, n);
            ASSERT_EQ(got, want) << "prefix, seed " << seed + w << ", after " << ojson(utf8_lossy(so_far)).dump() << ":"
                                 << mask_diff(*t, got, want);
            const int32_t id = pick(*t, want, "", rng);
            c.accept(id);
            so_far += t->bytes[(size_t)id];
        }
    }
}

TEST(grammar_mask, prefix_masks_equal_the_per_token_definition) {
    prefix_walks(tiny_table(), 8);
    if (qwen3_table()) prefix_walks(qwen3_table(), 4);
}

// During reasoning: everything but the end of the turn, then only </think> once the tokens left reach the reserve.
TEST(grammar_mask, reasoning_lets_all_through_until_the_reserve) {
    const auto t = tiny_table();
    ASSERT_GE(t->think_end, 0);
    const int64_t n = tiny().eng().n_valid_tokens();
    const ojson s = {{"type", "object"}};
    schema_constraint c(t, /*thinking=*/true, 20, build_content_spec(&s, false, nullptr, "", false, true));
    std::vector<uint32_t> w((size_t)mask_words(n));
    c.allow(w.data(), n, 21);
    for (int64_t id = 0; id < n; id++)
        EXPECT_EQ(w[(size_t)(id / 32)] >> (id % 32) & 1u, is_eos(*t, (int32_t)id) ? 0u : 1u) << id;
    c.allow(w.data(), n, 20);
    for (int64_t id = 0; id < n; id++) EXPECT_EQ(w[(size_t)(id / 32)] >> (id % 32) & 1u, id == t->think_end ? 1u : 0u) << id;
}

}  // namespace
}  // namespace tansy
