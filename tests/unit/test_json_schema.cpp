// response_format json_schema and schema-constrained tool calls: the schema compiler (limits, refusals), the
// byte-level recogniser (valid documents in, invalid out, every prefix completable), and constrained
// generations with random logits over the bundled tokenizer's full vocabulary, checked by an independent
// validator of the subset (and, for tool calls, through the output parser). Also measures the mask's cost.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <random>

#include "runtime/output_parser.h"
#include "runtime/text_engine.h"
#include "scheduler_test_util.h"
#include "server/constraints.h"
#include "server/json_schema.h"
#include "mask_reference.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace tansy {
namespace {

using ojson = nlohmann::ordered_json;

using test::tiny;

std::shared_ptr<const token_table> table() {
    static auto t = token_table::build(tiny().tok(), tiny().eng().n_valid_tokens(), tiny().eos(), tiny().think_end());
    return t;
}

size_t code_points(const std::string& s) {
    size_t n = 0;
    for (unsigned char c : s) n += (c & 0xC0) != 0x80;
    return n;
}

// An independent validator of the subset, with JSON Schema's own defaults (additionalProperties absent: allowed).
bool valid(const ojson& v, const ojson& s, const ojson& root, int depth = 0) {
    if (depth > 64) return false;
    if (s.is_boolean()) return s.get<bool>();
    if (s.contains("$ref")) {
        const std::string r = s["$ref"];
        return valid(v, root.at(ojson::json_pointer(r.substr(1))), root, depth + 1);
    }
    for (const char* k : {"anyOf", "oneOf", "allOf"})
        if (s.contains(k)) {
            int n = 0;
            for (const ojson& b : s[k]) n += valid(v, b, root, depth + 1);
            if (std::string(k) == "anyOf" && n == 0) return false;
            if (std::string(k) == "oneOf" && n != 1) return false;
            if (std::string(k) == "allOf" && n != (int)s[k].size()) return false;
        }
    if (s.contains("type")) {
        std::vector<std::string> ts;
        if (s["type"].is_string()) ts.push_back(s["type"]);
        else for (const ojson& t : s["type"]) ts.push_back(t);
        if (s.value("nullable", false)) ts.push_back("null");
        bool ok = false;
        for (const std::string& t : ts)
            ok = ok || (t == "null" && v.is_null()) || (t == "boolean" && v.is_boolean()) ||
                 (t == "integer" && (v.is_number_integer() || (v.is_number_float() && v.get<double>() == (double)(int64_t)v.get<double>()))) ||
                 (t == "number" && v.is_number()) || (t == "string" && v.is_string()) ||
                 (t == "object" && v.is_object()) || (t == "array" && v.is_array());
        if (!ok) return false;
    }
    if (s.contains("enum")) {
        bool ok = false;
        for (const ojson& e : s["enum"]) ok = ok || e == v;
        if (!ok) return false;
    }
    if (s.contains("const") && s["const"] != v) return false;
    if (v.is_string()) {
        const size_t n = code_points(v.get<std::string>());
        if (n < s.value("minLength", 0u) || n > s.value("maxLength", SIZE_MAX)) return false;
    }
    if (v.is_object()) {
        const ojson props = s.value("properties", ojson::object());
        for (const ojson& r : s.value("required", ojson::array()))
            if (!v.contains(r.get<std::string>())) return false;
        for (auto it = v.begin(); it != v.end(); ++it) {
            if (props.contains(it.key())) {
                if (!valid(it.value(), props[it.key()], root, depth + 1)) return false;
            } else if (s.contains("additionalProperties") && !valid(it.value(), s["additionalProperties"], root, depth + 1)) {
                return false;
            }
        }
    }
    if (v.is_array()) {
        if (v.size() < s.value("minItems", 0u) || v.size() > s.value("maxItems", SIZE_MAX)) return false;
        const ojson prefix = s.value("prefixItems", ojson::array());
        for (size_t i = 0; i < v.size(); i++) {
            const ojson& is = i < prefix.size() ? prefix[i] : s.contains("items") ? s["items"] : ojson(true);
            if (!valid(v[i], is, root, depth + 1)) return false;
        }
    }
    return true;
}

struct compiled {
    schema_program p;
    int root = 0;
    explicit compiled(const ojson& s, bool strict = false) {
        root = p.compile(s, strict);
        p.finish();
    }
};

const std::vector<ojson>& schemas() {
    static const std::vector<ojson> s = {
        ojson::parse(R"({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}},
                         "required": ["name", "age", "tags"], "additionalProperties": false})"),
        ojson::parse(R"({"type": "object", "properties": {"kind": {"enum": ["cat", "dog", 3, null, {"x": [1]}]},
                         "score": {"type": ["number", "null"]}, "ok": {"type": "boolean"}},
                         "required": ["kind", "ok"]})"),
        ojson::parse(R"({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                         "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
                         "required": ["v"]}}, "$ref": "#/$defs/node"})"),
        ojson::parse(R"({"anyOf": [{"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]},
                                   {"type": "array", "prefixItems": [{"type": "string", "minLength": 2, "maxLength": 4},
                                    {"type": "integer"}], "items": false, "minItems": 2},
                                   {"type": "string", "maxLength": 3}]})"),
        ojson::parse(R"({"type": "object", "properties": {"x": {"type": "string", "minLength": 3}},
                         "additionalProperties": {"type": "integer"}, "required": ["x", "extra"]})"),
        ojson::parse(R"({"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "object",
                         "properties": {"r": {"type": "array", "items": {"type": "object", "properties":
                         {"s": {"type": "number"}}, "required": ["s"]}}}, "required": ["r"]}}, "required": ["q"]}},
                         "required": ["p"], "title": "nested", "description": "ignored annotations"})"),
        ojson::parse(R"({"type": "integer"})"),
        ojson::parse(R"({"type": "object", "properties": {"a": {"type": "string", "nullable": true},
                         "b": {"oneOf": [{"type": "integer"}, {"type": "string"}]}}, "required": ["a", "b"]})"),
    };
    return s;
}

TEST(json_schema, accepts_valid_documents_and_completes_every_prefix) {
    const std::vector<std::pair<size_t, std::string>> docs = {
        {0, R"({"name": "Ann", "age": -3, "tags": ["a", "b\"c\u00e9"]})"},
        {0, "{\n  \"name\": \"\",\n  \"age\": 0,\n  \"tags\": [\"x\"]\n}"},
        {1, R"({"kind": {"x":[1]}, "score": 1.5e+3, "ok": false})"},
        {1, R"({"kind":null,"ok":true})"},
        {2, R"({"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]})"},
        {3, R"({"a": 1})"}, {3, R"(["ab", 7])"}, {3, R"("xyz")"},
        {4, R"({"x": "abc", "extra": 5, "more": 6})"},
        {5, R"({"p": {"q": {"r": [{"s": 0.25}]}}})"},
        {6, "12"}, {6, "-0"},
        {7, R"({"a": null, "b": "s"})"}, {7, R"({"a": "t", "b": 4})"},
    };
    for (const auto& [k, doc] : docs) {
        const ojson& s = schemas()[k];
        ASSERT_TRUE(valid(ojson::parse(doc), s, s)) << "the test's own document: " << doc;
        compiled c(s);
        schema_state st(&c.p, c.root);
        for (size_t i = 0; i < doc.size(); i++) {
            std::string close;
            st.closer(&close);
            const std::string done = doc.substr(0, i) + close;
            const ojson v = ojson::parse(done, nullptr, false);
            EXPECT_TRUE(!v.is_discarded() && valid(v, s, s)) << "prefix " << i << " of " << doc << " -> " << done;
            schema_state t = st;
            EXPECT_TRUE(t.feed(close)) << done;
            EXPECT_TRUE(t.accepting()) << done;
            ASSERT_EQ(st.feed(doc[i]), schema_state::result::ok) << "rejected byte " << i << " of " << doc;
        }
        EXPECT_TRUE(st.accepting()) << doc;
        EXPECT_EQ(st.closer(nullptr), 0u) << doc;
    }
}

TEST(json_schema, rejects_invalid_documents) {
    const std::vector<std::pair<size_t, std::string>> bad = {
        {0, R"({"age": 1)"},                                  // required "name" skipped
        {0, R"({"name": "a", "age": 1.5)"},                   // not an integer
        {0, R"({"name": "a", "age": 1, "tags": []})"},        // minItems
        {0, R"({"name": "a", "age": 1, "tags": ["a","b","c","d"])"},  // maxItems
        {0, R"({"name": "a", "zzz": 1)"},                     // additionalProperties false (the default)
        {0, R"({"age": 1, "name": "a")"},                     // out of the listed order
        {1, R"({"kind": "cow")"},                             // not in the enum
        {1, R"({"kind": {"x": [1]})"},                        // enums are written compactly
        {2, R"({"v": 1, "kids": [{"v": 2}, {"v": 3}, {"v": 4})"},
        {3, R"("toolong")"}, {3, R"(["a", 1])"}, {3, R"(["ab", 1, 2])"}, {3, R"({"a": 2})"},
        {4, R"({"x": "ab")"}, {4, R"({"x": "abc", "extra": "s")"}, {4, R"({"x": "abc", "x": 1)"},
        {6, "1.5"}, {6, "01"}, {6, "1234567890123456"}, {6, " 1 "},
        {7, R"({"a": null, "b": true)"},
    };
    for (const auto& [k, doc] : bad) {
        compiled c(schemas()[k]);
        schema_state st(&c.p, c.root);
        const bool ok = st.feed(doc) && st.accepting();
        EXPECT_FALSE(ok) << doc;
    }
}

TEST(json_schema, refuses_what_it_cannot_honour) {
    auto fails = [](const std::string& s, bool strict, const std::string& needle) {
        try {
            compiled c(ojson::parse(s), strict);
        } catch (const schema_error& e) {
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
            return true;
        }
        return false;
    };
    std::string deep = "{\"type\": \"integer\"}";
    for (int i = 0; i < 40; i++) deep = "{\"type\": \"array\", \"items\": " + deep + "}";
    EXPECT_TRUE(fails(deep, false, "deeper than 32"));
    EXPECT_TRUE(fails(R"({"type": "string", "pattern": "^a"})", true, "'pattern'"));
    EXPECT_FALSE(fails(R"({"type": "string", "pattern": "^a", "format": "date"})", false, ""));
    EXPECT_TRUE(fails(R"({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})",
                      false, "loop"));
    EXPECT_TRUE(fails(R"({"$ref": "https://example.com/s.json"})", false, "local"));
    EXPECT_TRUE(fails(R"({"$ref": "#/$defs/missing"})", false, "resolve"));
    EXPECT_TRUE(fails(R"({"type": "str"})", false, "unknown type"));
    EXPECT_TRUE(fails(R"({"type": "object", "properties": {}, "required": ["a"]})", false, "required property 'a'"));
    EXPECT_TRUE(fails(R"({"allOf": [{"type": "string"}, {"maxLength": 3}]})", false, "allOf"));
    // unsatisfiable: a recursion with no way out, detected (not looped on)
    compiled loop(ojson::parse(R"({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                  "required": ["next"]}}, "$ref": "#/$defs/n"})"));
    EXPECT_FALSE(loop.p.satisfiable(loop.root));
    // too many subschemas
    ojson wide = {{"type", "object"}, {"properties", ojson::object()}};
    const ojson nine = ojson::parse(
        R"({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"type": "string"}}}}}, "d": {"type": "integer"}, "e": {"type": "integer"}, "f": {"type": "integer"}, "g": {"type": "integer"}, "h": {"type": "integer"}, "i": {"type": "integer"}, "j": {"type": "integer"}}})");
    for (int i = 0; i < 250; i++) {
        std::string key = "p";
        key += std::to_string(i);
        wide["properties"][key] = nine;
    }
    EXPECT_TRUE(fails(wide.dump(), false, "2048"));
    // a huge enum is fine (binary search per byte)
    ojson big = {{"enum", ojson::array()}};
    for (int i = 0; i < 4000; i++) big["enum"].push_back("value-" + std::to_string(i * 7919 % 100000));
    compiled b(big);
    schema_state st(&b.p, b.root);
    EXPECT_TRUE(st.feed(std::string("\"value-") + std::to_string(17 * 7919 % 100000) + "\"") && st.accepting());
    big["enum"].push_back(0);
    for (int i = 0; i < 200; i++) big["enum"].push_back(i);
    EXPECT_TRUE(fails(big.dump(), false, "4096"));
}

TEST(json_schema, recursion_is_bounded_in_the_output) {
    compiled c(schemas()[2]);
    schema_state st(&c.p, c.root);
    std::string doc;
    int depth = 0;
    for (; depth < 100; depth++) {
        schema_state t = st;
        if (!t.feed(std::string_view("{\"v\":1,\"kids\":["))) break;
        st = t;
    }
    EXPECT_GT(depth, 5);
    EXPECT_LE(depth, (int)k_max_nesting);
    std::string close;
    st.closer(&close);
    EXPECT_TRUE(st.feed(close) && st.accepting());
}

// Random-logit generation under a constraint (as the scheduler does it); returns the text.
std::string generate(token_constraint& c, const token_table& t, int64_t max_tokens, uint32_t seed, bool* ended,
                     std::vector<double>* mask_ms = nullptr) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 3.0f);
    const int64_t n = (int64_t)t.bytes.size();
    std::string out;
    *ended = false;
    std::vector<float> logits((size_t)n);
    std::vector<uint32_t> words;
    for (int64_t k = 0; k < max_tokens; k++) {
        for (float& x : logits) x = nd(rng);
        const auto t0 = std::chrono::steady_clock::now();
        if (c.active()) c.mask(logits.data(), n, max_tokens - k, words);
        if (mask_ms && c.active())
            mask_ms->push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        const int32_t id = (int32_t)(std::max_element(logits.begin(), logits.end()) - logits.begin());
        c.accept(id);
        if (std::find(t.eos.begin(), t.eos.end(), id) != t.eos.end()) {
            *ended = true;
            break;
        }
        out += t.bytes[(size_t)id];
    }
    return out;
}

// Near the nesting cap, a key (or item) whose shortest value no longer fits is not offered: whatever has been
// written can still be completed. (Recursion through an optional key, beside a key with a deep required chain.)
TEST(json_schema, keys_too_deep_for_the_nesting_left_are_not_offered) {
    const ojson s = ojson::parse(R"({"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"},
        "d": {"type": "object", "required": ["x"], "properties": {"x": {"type": "object", "required": ["y"],
        "properties": {"y": {"type": "object", "required": ["z"], "properties": {"z": {"type": "object"}}}}}}}}}},
        "$ref": "#/$defs/n"})");
    compiled c(s);
    schema_state st(&c.p, c.root);
    std::string doc;
    for (int depth = 0; depth < 40; depth++) {
        for (const char* step : {"{\"d\":", "{\"c\":"}) {  // at every depth: can a deep "d" still be written?
            schema_state t = st;
            if (!t.feed(std::string_view(step))) continue;
            std::string close;
            t.closer(&close);
            schema_state u = t;
            EXPECT_TRUE(u.feed(close) && u.accepting()) << "depth " << depth << ": " << doc << step << " + " << close;
            const ojson v = ojson::parse(doc + step + close, nullptr, false);
            EXPECT_TRUE(!v.is_discarded() && valid(v, s, s)) << doc << step << close;
        }
        schema_state t = st;
        if (!t.feed(std::string_view("{\"c\":"))) break;
        st = t;
        doc += "{\"c\":";
    }
    std::string close;
    st.closer(&close);
    EXPECT_TRUE(st.feed(close) && st.accepting()) << doc << close;
}

TEST(json_schema, constrained_generations_always_validate) {
    auto t = table();
    for (size_t k = 0; k < schemas().size(); k++) {
        const ojson& s = schemas()[k];
        for (uint32_t seed = 0; seed < 4; seed++) {
            for (int64_t max_tokens : {12, 40, 120}) {
                auto spec = build_content_spec(&s, false, nullptr, "", false, true);
                schema_constraint c(t, false, 8, spec);
                bool ended = false;
                const std::string out = generate(c, *t, max_tokens, seed * 31 + (uint32_t)k, &ended);
                const ojson v = ojson::parse(out, nullptr, false);
                // a length cut still gives a valid document when the shortest one fits
                if (!ended && spec->prog->node(spec->json_root).min_size > (size_t)max_tokens) continue;
                EXPECT_TRUE(!v.is_discarded() && valid(v, s, s))
                    << "schema " << k << " seed " << seed << " max_tokens " << max_tokens << (ended ? " (ended)" : "") << ": " << out;
            }
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
         "text": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["text"]}}},
      {"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "properties": {
         "x": {"type": "string", "pattern": "^a"}}}}}])");
    return t;
}

const ojson* tool_schema(const std::string& name) {
    for (const ojson& t : demo_tools())
        if (t["function"]["name"] == name) return &t["function"]["parameters"];
    return nullptr;
}

TEST(json_schema, constrained_tool_calls_parse_into_valid_arguments) {
    auto t = table();
    int calls = 0;
    for (const std::string only : {"get_weather", "note", ""}) {
        for (uint32_t seed = 0; seed < 6; seed++) {
            for (int64_t max_tokens : {30, 200}) {
                auto spec = build_content_spec(nullptr, false, demo_tools(), only, true, seed % 2 == 0);
                schema_constraint c(t, false, 8, spec);
                bool ended = false;
                const std::string out = generate(c, *t, max_tokens, seed + 100, &ended);
                const size_t lead = out.find_first_not_of(" \n");
                ASSERT_EQ(out.find("<tool_call>\n<function="), lead) << out;
                output_parser_options po;
                po.reasoning = false;
                po.tool_schemas = demo_tools();
                output_parser p(po);
                p.push(out);
                p.finish();
                ASSERT_FALSE(p.tool_calls().empty()) << out;
                EXPECT_LE(p.tool_calls().size(), seed % 2 == 0 ? 8u : 1u) << out;
                for (const parsed_tool_call& tc : p.tool_calls()) {
                    if (!only.empty()) {
                        EXPECT_EQ(tc.name, only);
                    }
                    const ojson* s = tool_schema(tc.name);
                    ASSERT_NE(s, nullptr) << tc.name;
                    const ojson args = ojson::parse(tc.arguments, nullptr, false);
                    // (pattern is outside the subset: ignored without strict, and the oracle ignores it too)
                    if (ended || tc.complete) {  // else finish_reason would be "length"
                        EXPECT_TRUE(!args.is_discarded() && valid(args, *s, *s)) << out << "\n-> " << tc.arguments;
                    }
                    calls++;
                }
                EXPECT_TRUE(p.content().empty()) << out;
            }
        }
    }
    EXPECT_GT(calls, 30);
}

TEST(json_schema, tools_and_a_response_format_allow_either) {
    auto t = table();
    const ojson s = schemas()[0];
    auto spec = build_content_spec(&s, false, demo_tools(), "", true, true);
    const int32_t call = tiny().tok().find("<tool_call>");
    ASSERT_GE(call, 0);
    ASSERT_EQ(t->bytes[(size_t)call], "<tool_call>") << "the tool-call tag is sampleable text";
    const int64_t n = (int64_t)t->bytes.size();
    std::vector<float> logits((size_t)n, 0.0f);
    std::vector<uint32_t> words;
    schema_constraint c(t, false, 8, spec);
    c.mask(logits.data(), n, 100, words);
    EXPECT_NE(logits[(size_t)call], -INFINITY) << "a tool call may come";
    const int32_t brace = tiny().tok().find("{");
    if (brace >= 0) {
        EXPECT_NE(logits[(size_t)brace], -INFINITY) << "so may the JSON";
    }
    // whichever comes, the output is valid
    int json = 0, tools = 0;
    for (uint32_t seed = 0; seed < 16; seed++) {
        schema_constraint g(t, false, 8, spec);
        std::vector<float> bias;
        bool ended = false;
        const std::string out = generate(g, *t, 150, seed + 7, &ended);
        if (out.find("<tool_call>") == out.find_first_not_of(" \n")) {
            tools++;
            continue;
        }
        json++;
        const ojson v = ojson::parse(out, nullptr, false);
        EXPECT_TRUE(!v.is_discarded() && valid(v, s, s)) << out;
    }
    std::printf("tools + json_schema: %d JSON answers, %d tool calls\n", json, tools);
    // JSON only (tool_choice none): no tool call
    auto js = build_content_spec(&s, false, demo_tools(), "", false, true);
    schema_constraint j(t, false, 8, js);
    std::fill(logits.begin(), logits.end(), 0.0f);
    j.mask(logits.data(), n, 100, words);
    EXPECT_EQ(logits[(size_t)call], -INFINITY);
}

// With tools offered, the output parser reads "<tool_call>" anywhere in the content as a call: the JSON answer
// may not spell it, even inside a string (else a quoted tag would become an invented call).
TEST(json_schema, a_json_answer_beside_tools_never_spells_the_call_tag) {
    const ojson s = ojson::parse(R"({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})");
    auto spec = build_content_spec(&s, false, demo_tools(), "", true, true);
    content_state st(spec.get());
    ASSERT_TRUE(st.feed(std::string_view("{\"a\": \"x<tool_cal")));
    content_state t = st;
    EXPECT_FALSE(t.feed('l') && t.feed('>')) << "the tag inside a string";
    EXPECT_TRUE(st.feed(std::string_view("l\"}")) && st.complete()) << "a near miss is fine";
    // without tools the same text is only a string
    auto plain = build_content_spec(&s, false, nullptr, "", false, true);
    content_state u(plain.get());
    EXPECT_TRUE(u.feed(std::string_view("{\"a\": \"<tool_call>\"}")) && u.complete());
}

TEST(json_schema, strict_tools_with_unsupported_keywords_are_refused) {
    ojson tools = demo_tools();
    tools[2]["function"]["strict"] = true;
    EXPECT_THROW(build_content_spec(nullptr, false, tools, "", true, true), schema_error);
    auto spec = build_content_spec(nullptr, false, demo_tools(), "", true, true);
    EXPECT_FALSE(spec->tools[2].free) << "without strict, pattern is ignored";
    EXPECT_FALSE(spec->tools[0].free);
    tools[2]["function"]["strict"] = false;
    tools[2]["function"]["parameters"]["properties"]["x"] = {{"$ref", "https://example.com/x.json"}};
    spec = build_content_spec(nullptr, false, tools, "", true, true);
    EXPECT_TRUE(spec->tools[2].free) << "a schema outside the subset leaves that tool unconstrained";
}

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The per-step mask cost over a whole vocabulary, by state: the trie walk (best and median of repeated steps)
// against the per-token definition it replaced (reported; the bound is loose, for slow CI).
void mask_costs(std::shared_ptr<const token_table> t) {
    constexpr int k_old_reps = 3;   // the per-token walk: slow, its best of a few
    constexpr int k_new_reps = 21;  // the trie walk: fast, so timer noise matters; median of many
    const int64_t n = (int64_t)t->bytes.size();
    const ojson s = ojson::parse(R"({"type": "object", "properties": {"answer": {"type": "string"},
        "n": {"type": "integer"}, "items": {"type": "array", "items": {"type": "string", "maxLength": 40}}},
        "required": ["answer", "n", "items"]})");
    auto spec = build_content_spec(&s, false, nullptr, "", false, true);
    auto tools = build_content_spec(&s, false, demo_tools(), "", true, true);
    const ojson any_object = {{"type", "object"}, {"additionalProperties", true}};
    auto free_keys = build_content_spec(&any_object, false, demo_tools(), "", true, true);
    struct probe {
        const char* name;
        std::shared_ptr<const content_spec> spec;
        std::string prefix;
        int64_t tokens_left;
    };
    const std::vector<probe> probes = {
        {"start", spec, "", 1000},
        {"start+tools", tools, "", 1000},
        {"key", spec, "{\"", 1000},
        {"additional key", free_keys, "{\"ab", 1000},
        {"free string", spec, "{\"answer\": \"Hello wor", 1000},
        {"free string near", spec, "{\"answer\": \"Hello wor", 30},
        {"number", spec, "{\"answer\": \"\", \"n\": 12", 1000},
        {"bounded string", spec, "{\"answer\": \"\", \"n\": 1, \"items\": [\"ab", 1000},
        {"raw tool value", tools, "<tool_call>\n<function=note>\n<parameter=text>\nSome ", 1000},
        {"json tool value", tools, "<tool_call>\n<function=note>\n<parameter=text>\nx\n</parameter>\n<parameter=tags>\n[\"a", 1000},
    };
    std::vector<float> logits((size_t)n);
    std::vector<uint32_t> words((size_t)mask_words(n));
    for (const probe& p : probes) {
        content_state st(p.spec.get());
        ASSERT_TRUE(st.feed(p.prefix)) << p.prefix;
        // the per-token definition, as the scheduler used it: a row of zeros masked, then turned into bits
        double old_ms = 1e9;
        std::vector<uint32_t> old_bits;
        for (int rep = 0; rep < k_old_reps; rep++) {
            const auto t0 = std::chrono::steady_clock::now();
            std::fill(logits.begin(), logits.end(), 0.0f);
            reference::schema_mask(*t, st, logits.data(), n, p.tokens_left);
            old_bits = reference::bits_of(logits, n);
            old_ms = std::min(old_ms, ms_since(t0));
        }
        // the trie walk into bits, repeated on one constraint (its walk buffers warm, as between steps): without
        // the memo, then with it (its first mask fills it)
        schema_constraint c(t, false, 8, p.spec);
        c.set_state(st);
        c.memoise(false);
        std::vector<double> walk, hit;
        for (int rep = 0; rep < k_new_reps; rep++) {
            const auto t0 = std::chrono::steady_clock::now();
            c.allow(words.data(), n, p.tokens_left);
            walk.push_back(ms_since(t0));
        }
        EXPECT_EQ(words, old_bits) << p.name << " (walk)";
        c.memoise(true);
        c.allow(words.data(), n, p.tokens_left);
        for (int rep = 0; rep < k_new_reps; rep++) {
            const auto t0 = std::chrono::steady_clock::now();
            c.allow(words.data(), n, p.tokens_left);
            hit.push_back(ms_since(t0));
        }
        std::sort(walk.begin(), walk.end());
        std::sort(hit.begin(), hit.end());
        int64_t allowed = 0;
        for (uint32_t w : words) allowed += __builtin_popcount(w);
        std::printf("mask %-17s walk %6.3f ms, memo %6.3f ms (medians), per-token %6.3f ms, %6lld of %lld ids allowed\n",
                    p.name, walk[walk.size() / 2], hit[hit.size() / 2], old_ms, (long long)allowed, (long long)n);
        EXPECT_EQ(words, old_bits) << p.name;
        EXPECT_LT(walk[0], 2000.0);
        EXPECT_GT(allowed, 0);
    }
}

// The mask's cost per step over whole constrained generations (each step a random allowed token, as the argmax
// of random logits picks), with the memo and without (the same tokens come either way): what a constrained row
// adds between its steps.
void generation_mask_costs(std::shared_ptr<const token_table> t) {
    constexpr int64_t k_tokens = 200;  // a typical structured answer's length
    const int64_t n = (int64_t)t->bytes.size();
    const ojson s = ojson::parse(R"({"type": "object", "properties": {"answer": {"type": "string"},
        "n": {"type": "integer"}, "items": {"type": "array", "items": {"type": "object", "properties":
        {"name": {"type": "string", "maxLength": 40}, "score": {"type": "number"}}, "required": ["name", "score"]}}},
        "required": ["answer", "n", "items"]})");
    const ojson any_object = {{"type", "object"}, {"additionalProperties", true}};
    auto schema = [&](std::shared_ptr<const content_spec> spec) {
        return [t, spec](bool memo) -> std::unique_ptr<token_constraint> {
            auto c = std::make_unique<schema_constraint>(t, false, 8, spec);
            c->memoise(memo);
            return c;
        };
    };
    using maker = std::function<std::unique_ptr<token_constraint>(bool)>;
    const std::vector<std::pair<const char*, maker>> cases = {
        {"json_schema", schema(build_content_spec(&s, false, nullptr, "", false, true))},
        {"any object", schema(build_content_spec(&any_object, false, nullptr, "", false, true))},
        {"tool calls", schema(build_content_spec(nullptr, false, demo_tools(), "", true, true))},
        {"json_object", [t](bool memo) -> std::unique_ptr<token_constraint> {
             auto c = std::make_unique<json_object_constraint>(t, false, 8);
             c->memoise(memo);
             return c;
         }},
    };
    std::vector<uint32_t> words((size_t)mask_words(n));
    for (const auto& [name, make] : cases) {
        std::vector<int32_t> ids[2];
        for (int memo = 1; memo >= 0; memo--) {
            std::vector<double> ms;
            for (uint32_t seed = 0; seed < 3; seed++) {
                std::mt19937 rng(seed);
                const std::unique_ptr<token_constraint> made = make(memo);
                token_constraint& c = *made;
                for (int64_t k = 0; k < k_tokens && c.active(); k++) {
                    const auto t0 = std::chrono::steady_clock::now();
                    c.allow(words.data(), n, k_tokens - k);
                    ms.push_back(ms_since(t0));
                    // the argmax of random logits over the allowed ids: one of them, uniformly
                    int64_t allowed = 0;
                    for (uint32_t w : words) allowed += __builtin_popcount(w);
                    int64_t r = (int64_t)(rng() % (uint64_t)allowed);
                    int32_t best = -1;
                    for (int64_t v = 0; best < 0; v++)
                        if ((words[(size_t)(v / 32)] >> (v % 32) & 1u) && r-- == 0) best = (int32_t)v;
                    c.accept(best);
                    ids[memo].push_back(best);
                    if (std::find(t->eos.begin(), t->eos.end(), best) != t->eos.end()) break;
                }
            }
            std::vector<double> sorted = ms;
            std::sort(sorted.begin(), sorted.end());
            double sum = 0;
            for (double x : ms) sum += x;
            std::printf("mask per step, %-11s memo %-3s: mean %6.3f ms, median %6.3f, p90 %6.3f, max %6.3f over %zu steps\n",
                        name, memo ? "on" : "off", sum / (double)ms.size(), sorted[sorted.size() / 2],
                        sorted[sorted.size() * 9 / 10], sorted.back(), ms.size());
        }
        EXPECT_EQ(ids[0], ids[1]) << name << ": the memo changed a mask";
    }
}

TEST(json_schema, mask_cost_per_generation_qwen3_vocab) {
    TANSY_REQUIRE_FIXTURE(path, "tokenizers/qwen3/tokenizer.json");
    const tokenizer tok = tokenizer::load(path);
    std::vector<int32_t> eos;
    if (tok.find("<|im_end|>") >= 0) eos.push_back(tok.find("<|im_end|>"));
    generation_mask_costs(token_table::build(tok, tok.size(), eos, tok.find("</think>")));
}

TEST(json_schema, mask_cost_per_step_tiny_vocab) {
    mask_costs(table());
}

TEST(json_schema, mask_cost_per_step_qwen3_vocab) {
    TANSY_REQUIRE_FIXTURE(path, "tokenizers/qwen3/tokenizer.json");
    const tokenizer tok = tokenizer::load(path);
    std::vector<int32_t> eos;
    if (tok.find("<|im_end|>") >= 0) eos.push_back(tok.find("<|im_end|>"));
    mask_costs(token_table::build(tok, tok.size(), eos, tok.find("</think>")));
}

}  // namespace
}  // namespace tansy
