// output_parser: reasoning / content / Qwen XML tool calls, whole and streamed in every kind of piece.
#include <gtest/gtest.h>

#include <random>

#include "runtime/output_parser.h"

namespace tansy {
namespace {

using ojson = nlohmann::ordered_json;

struct result {
    std::string reasoning, content;
    std::vector<std::string> names, args;  // rebuilt from the streamed deltas
    std::vector<parsed_tool_call> calls;   // the parser's own totals
};

// Feeds `text` in pieces cut at `cuts` (byte offsets), collecting the deltas as a streaming client would.
result run(const std::string& text, output_parser_options opt, const std::vector<size_t>& cuts) {
    output_parser p(opt);
    result r;
    auto take = [&](const parsed_delta& d) {
        r.reasoning += d.reasoning;
        r.content += d.content;
        for (const tool_call_delta& t : d.tool_calls) {
            if ((int)r.names.size() <= t.index) {
                EXPECT_FALSE(t.name.empty()) << "a call's first delta carries its name";
                r.names.resize((size_t)t.index + 1);
                r.args.resize((size_t)t.index + 1);
            }
            if (!t.name.empty()) r.names[(size_t)t.index] = t.name;
            r.args[(size_t)t.index] += t.arguments;
        }
    };
    size_t at = 0;
    for (size_t c : cuts) {
        if (c <= at || c > text.size()) continue;
        take(p.push(text.substr(at, c - at)));
        at = c;
    }
    take(p.push(text.substr(at)));
    take(p.finish());
    EXPECT_EQ(r.reasoning, p.reasoning());
    EXPECT_EQ(r.content, p.content());
    r.calls = p.tool_calls();
    EXPECT_EQ(r.names.size(), r.calls.size());
    for (size_t i = 0; i < r.calls.size() && i < r.args.size(); i++) {
        EXPECT_EQ(r.names[i], r.calls[i].name);
        EXPECT_EQ(r.args[i], r.calls[i].arguments) << "streamed arguments must add up to the final ones";
    }
    return r;
}

// Whole, byte by byte, and in random pieces: all must give the same result.
result parse_all_ways(const std::string& text, output_parser_options opt = {}) {
    result whole = run(text, opt, {});
    std::vector<size_t> every;
    for (size_t i = 1; i < text.size(); i++) every.push_back(i);
    result bytes = run(text, opt, every);
    EXPECT_EQ(bytes.reasoning, whole.reasoning);
    EXPECT_EQ(bytes.content, whole.content);
    EXPECT_EQ(bytes.args, whole.args);
    std::mt19937 rng(7);
    for (int trial = 0; trial < 20; trial++) {
        std::vector<size_t> cuts;
        for (size_t i = 1; i < text.size(); i++)
            if (rng() % 5 == 0) cuts.push_back(i);
        result r = run(text, opt, cuts);
        EXPECT_EQ(r.reasoning, whole.reasoning);
        EXPECT_EQ(r.content, whole.content);
        EXPECT_EQ(r.args, whole.args);
    }
    for (const parsed_tool_call& c : whole.calls) {
        const ojson a = ojson::parse(c.arguments, nullptr, false);
        EXPECT_TRUE(a.is_object()) << "arguments must be a JSON object: " << c.arguments;
    }
    return whole;
}

output_parser_options no_thinking() {
    output_parser_options o;
    o.reasoning = false;
    return o;
}

TEST(output_parser, reasoning_then_content) {
    result r = parse_all_ways("Let me think.\nStill thinking.\n</think>\n\nThe answer is 4.");
    EXPECT_EQ(r.reasoning, "Let me think.\nStill thinking.");
    EXPECT_EQ(r.content, "The answer is 4.");
    EXPECT_TRUE(r.calls.empty());
}

TEST(output_parser, thinking_off_is_all_content) {
    result r = parse_all_ways("\nHello there.\n", no_thinking());
    EXPECT_EQ(r.reasoning, "");
    EXPECT_EQ(r.content, "Hello there.\n");
}

TEST(output_parser, the_tiny_models_tool_call) {
    // what models/tiny-chat-q4 generates for demo_tools.json
    const std::string out =
        "I should call get_docstring for heapq.heappush.\n</think>\n\n<tool_call>\n<function=get_docstring>\n"
        "<parameter=name>\nheapq.heappush\n</parameter>\n</function>\n</tool_call>";
    result r = parse_all_ways(out);
    EXPECT_EQ(r.reasoning, "I should call get_docstring for heapq.heappush.");
    EXPECT_EQ(r.content, "");
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(r.calls[0].name, "get_docstring");
    EXPECT_EQ(r.calls[0].arguments, R"({"name": "heapq.heappush"})");
    EXPECT_TRUE(r.calls[0].complete);
}

TEST(output_parser, text_before_the_call_is_content) {
    result r = parse_all_ways(
        "Let me look that up.\n\n<tool_call>\n<function=search>\n<parameter=q>\ncats\n</parameter>\n</function>\n"
        "</tool_call>",
        no_thinking());
    EXPECT_EQ(r.content, "Let me look that up.");
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(r.calls[0].arguments, R"({"q": "cats"})");
}

TEST(output_parser, several_calls_keep_their_order) {
    result r = parse_all_ways(
        "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=b>\n<parameter=y>\ntwo\n</parameter>\n<parameter=z>\nthree\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=c>\n</function>\n</tool_call>",
        no_thinking());
    ASSERT_EQ(r.calls.size(), 3u);
    EXPECT_EQ(r.calls[0].name, "a");
    EXPECT_EQ(r.calls[0].arguments, R"({"x": "1"})");
    EXPECT_EQ(r.calls[1].arguments, R"({"y": "two", "z": "three"})");
    EXPECT_EQ(r.calls[2].name, "c");
    EXPECT_EQ(r.calls[2].arguments, "{}");
    EXPECT_EQ(r.content, "");
}

TEST(output_parser, multi_line_values_keep_their_lines) {
    result r = parse_all_ways(
        "<tool_call>\n<function=run_python>\n<parameter=code>\nimport heapq\nh = []\n\nprint(\"<b>\" + '\\n')\n"
        "</parameter>\n</function>\n</tool_call>",
        no_thinking());
    ASSERT_EQ(r.calls.size(), 1u);
    const ojson a = ojson::parse(r.calls[0].arguments);
    EXPECT_EQ(a["code"], "import heapq\nh = []\n\nprint(\"<b>\" + '\\n')");
}

TEST(output_parser, a_tool_call_inside_reasoning_is_reasoning) {
    const std::string out =
        "Maybe <tool_call>\n<function=x>\n</function>\n</tool_call> would help.\n</think>\n\nNo tool needed.";
    result r = parse_all_ways(out);
    EXPECT_EQ(r.reasoning, "Maybe <tool_call>\n<function=x>\n</function>\n</tool_call> would help.");
    EXPECT_EQ(r.content, "No tool needed.");
    EXPECT_TRUE(r.calls.empty());
}

TEST(output_parser, output_cut_inside_a_value_still_gives_json) {
    result r = parse_all_ways("<tool_call>\n<function=get_docstring>\n<parameter=name>\nheapq.hea", no_thinking());
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_FALSE(r.calls[0].complete);
    EXPECT_EQ(r.calls[0].arguments, R"({"name": "heapq.hea"})");
}

TEST(output_parser, output_cut_at_every_point_never_breaks) {
    const std::string full =
        "Thinking about it.\n</think>\n\nSure.\n<tool_call>\n<function=f>\n<parameter=a>\nx\ny\n</parameter>\n"
        "<parameter=b>\n{\"k\": [1, 2]}\n</parameter>\n</function>\n</tool_call>";
    output_parser_options o;
    o.tool_schemas = ojson::parse(R"([{"type": "function", "function": {"name": "f", "parameters":
        {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "object"}}}}}])");
    for (size_t n = 0; n <= full.size(); n++) {
        result r = run(full.substr(0, n), o, {});
        for (const parsed_tool_call& c : r.calls)
            EXPECT_TRUE(ojson::parse(c.arguments, nullptr, false).is_object()) << "cut at " << n << ": " << c.arguments;
        // nothing of a call header leaks into the content once the call is recognised
        if (!r.calls.empty()) {
            EXPECT_EQ(r.content, "Sure.") << "cut at " << n;
        }
    }
    result all = parse_all_ways(full, o);
    ASSERT_EQ(all.calls.size(), 1u);
    EXPECT_EQ(all.calls[0].arguments, R"({"a": "x\ny", "b": {"k": [1, 2]}})");
}

TEST(output_parser, a_call_cut_before_its_name_is_content) {
    result r = parse_all_ways("Hi\n<tool_call>\n<function=get_do", no_thinking());
    EXPECT_TRUE(r.calls.empty());
    EXPECT_EQ(r.content, "Hi\n<tool_call>\n<function=get_do");
}

TEST(output_parser, values_follow_the_schema_types) {
    output_parser_options o = no_thinking();
    o.tool_schemas = ojson::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
                       "obj": {"type": "object"}, "list": {"type": ["array", "null"]}, "s": {"type": "string"},
                       "bad": {"type": "integer"}}}}}])");
    result r = parse_all_ways(
        "<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=x>\n2.5\n</parameter>\n"
        "<parameter=ok>\nTrue\n</parameter>\n<parameter=obj>\n{\"a\": 1}\n</parameter>\n<parameter=list>\n[1, \"b\"]\n"
        "</parameter>\n<parameter=s>\n42\n</parameter>\n<parameter=bad>\nmany\n</parameter>\n</function>\n</tool_call>",
        o);
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(r.calls[0].arguments,
              R"({"n": 42, "x": 2.5, "ok": true, "obj": {"a": 1}, "list": [1, "b"], "s": "42", "bad": "many"})");
}

// A parameter value nesting 100,000 levels (the model's text; a prompt can ask for it) stays a string: parsed,
// it would be copied and dumped recursively, once per level.
TEST(output_parser, a_deeply_nested_value_stays_a_string) {
    output_parser_options o = no_thinking();
    o.tool_schemas = ojson::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"a": {"type": "array"}}}}}])");
    output_parser p(o);
    const std::string deep = std::string(100000, '[') + std::string(100000, ']');
    p.push("<tool_call>\n<function=f>\n<parameter=a>\n" + deep + "\n</parameter>\n</function>\n</tool_call>");
    p.finish();
    ASSERT_EQ(p.tool_calls().size(), 1u);
    const ojson args = ojson::parse(p.tool_calls()[0].arguments);
    EXPECT_EQ(args["a"], deep);
}

TEST(output_parser, a_tool_call_tag_without_a_function_is_text) {
    result r = parse_all_ways("Use <tool_call> tags like this.", no_thinking());
    EXPECT_TRUE(r.calls.empty());
    EXPECT_EQ(r.content, "Use <tool_call> tags like this.");
}

TEST(output_parser, missing_closing_tags_are_forgiven) {
    result r = parse_all_ways(
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\n2\n</function>\n</tool_call>", no_thinking());
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(r.calls[0].arguments, R"({"a": "1", "b": "2"})");
    EXPECT_TRUE(r.calls[0].complete);
}

TEST(output_parser, tools_off_leaves_the_xml_as_content) {
    output_parser_options o = no_thinking();
    o.tools = false;
    const std::string xml = "<tool_call>\n<function=f>\n</function>\n</tool_call>";
    result r = parse_all_ways(xml, o);
    EXPECT_TRUE(r.calls.empty());
    EXPECT_EQ(r.content, xml);
}

TEST(output_parser, a_repeated_think_tag_and_escapes) {
    result r = parse_all_ways("<think>\nhmm \"quoted\" \\ tab\t</think>\n\n<tool_call>\n<function=f>\n<parameter=p>\n"
                              "say \"hi\"\\n\n</parameter>\n</function>\n</tool_call>");
    EXPECT_EQ(r.reasoning, "\nhmm \"quoted\" \\ tab\t");
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(ojson::parse(r.calls[0].arguments)["p"], "say \"hi\"\\n");
}

TEST(output_parser, text_after_the_calls_is_content) {
    result r = parse_all_ways("<tool_call>\n<function=f>\n</function>\n</tool_call>\n\nDone.", no_thinking());
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(r.content, "Done.");
}

TEST(output_parser, reasoning_cut_short_is_all_reasoning) {
    result r = parse_all_ways("I am still thinking about <tool_call> and </thi");
    EXPECT_EQ(r.reasoning, "I am still thinking about <tool_call> and </thi");
    EXPECT_EQ(r.content, "");
}

}  // namespace
}  // namespace tansy
