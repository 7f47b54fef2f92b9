// Qwen3.6 chat template: every golden case of fixtures/chat_template/cases.json byte for byte, the error cases,
// and edge cases around the Jinja/Python semantics the native renderer reproduces.
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "core/check.h"
#include "test_util.h"
#include "tokenizer/chat_template.h"

namespace tansy {
int cmd_render(int argc, char** argv);  // src/cli/cmd_render.cpp (declared in cli/commands.h once registered)
}

using namespace tansy;
using json = nlohmann::ordered_json;

namespace {

json load_cases() {
    const std::string path = test::fixture("chat_template/cases.json");
    if (path.empty()) return json::array();
    std::ifstream f(path, std::ios::binary);
    return json::parse(f);
}

const json& cases() {
    static const json c = load_cases();
    return c;
}

std::vector<std::string> case_names() {
    std::vector<std::string> names;
    for (const json& c : cases()) names.push_back(c["name"].get<std::string>());
    if (names.empty()) names.push_back("fixture_missing");  // the test then skips
    return names;
}

const json* find_case(const std::string& name) {
    for (const json& c : cases())
        if (c["name"] == name) return &c;
    return nullptr;
}

// Options as the fixture generator passed them: add_generation_prompt explicitly, the rest as template kwargs.
chat_options options_of(const json& c) {
    chat_options opt;
    opt.variant = c["template"] == "qwen3_5.jinja" ? chat_template_variant::qwen3_5 : chat_template_variant::qwen3_6;
    opt.kwargs = c["kwargs"];
    opt.add_generation_prompt = opt.kwargs.value("add_generation_prompt", false);
    opt.kwargs.erase("add_generation_prompt");
    return opt;
}

std::string escaped(const std::string& s) {
    std::string out;
    for (unsigned char ch : s) {
        if (ch == '\n')
            out += "\\n";
        else if (ch == '\t')
            out += "\\t";
        else if (ch < 0x20)
            out += strprintf("\\x%02x", ch);
        else
            out += (char)ch;
    }
    return out;
}

// Empty if equal; otherwise where the first difference is (byte, line, column) with context from both.
std::string first_difference(const std::string& got, const std::string& want) {
    size_t i = 0;
    while (i < got.size() && i < want.size() && got[i] == want[i]) i++;
    if (i == got.size() && i == want.size()) return "";
    size_t line = 1, col = 1;
    for (size_t k = 0; k < i; k++) {
        if (want[k] == '\n')
            line++, col = 1;
        else
            col++;
    }
    const size_t from = i > 40 ? i - 40 : 0;
    return strprintf(
        "first difference at byte %zu (line %zu, column %zu); got %zu bytes, want %zu\n"
        "  got:  ...%s|>>|%s\n  want: ...%s|>>|%s",
        i, line, col, got.size(), want.size(), escaped(got.substr(from, i - from)).c_str(),
        escaped(got.substr(i, 40)).c_str(), escaped(want.substr(from, i - from)).c_str(),
        escaped(want.substr(i, 40)).c_str());
}

// The message of the tansy::error thrown by f, or "" (and a test failure) if none is thrown.
template <class F>
std::string error_of(F&& f) {
    try {
        f();
    } catch (const tansy::error& e) {
        return e.what();
    }
    ADD_FAILURE() << "expected a tansy::error";
    return "";
}

json user(const std::string& text) { return {{"role", "user"}, {"content", text}}; }

std::string render(const json& messages, const json& tools = nullptr, json kwargs = json::object(), bool gen = true) {
    chat_options opt;
    opt.add_generation_prompt = gen;
    opt.kwargs = std::move(kwargs);
    return render_chat(messages, tools, opt);
}

}  // namespace

// ---- golden cases

class chat_template_case : public ::testing::TestWithParam<std::string> {};

TEST_P(chat_template_case, matches_reference) {
    const json* c = find_case(GetParam());
    if (!c) GTEST_SKIP() << "fixture chat_template/cases.json not found";
    const chat_options opt = options_of(*c);
    if ((*c)["expected_error"].get<bool>()) {
        const std::string msg = error_of([&] { render_chat((*c)["messages"], (*c)["tools"], opt); });
        EXPECT_NE(msg.find((*c)["error"].get<std::string>()), std::string::npos)
            << "error '" << msg << "' does not contain the template's '" << (*c)["error"].get<std::string>() << "'";
        return;
    }
    const std::string got = render_chat((*c)["messages"], (*c)["tools"], opt);
    const std::string diff = first_difference(got, (*c)["expected"].get<std::string>());
    EXPECT_TRUE(diff.empty()) << diff;
    // the marked rendering has the same text; its client ranges are ascending, disjoint and inside it
    const rendered_chat rc = render_chat_marked((*c)["messages"], (*c)["tools"], opt);
    EXPECT_EQ(rc.text, got);
    for (size_t i = 0; i < rc.client.size(); i++) {
        EXPECT_LT(rc.client[i].begin, rc.client[i].end);
        EXPECT_LE(rc.client[i].end, rc.text.size());
        if (i) {
            EXPECT_LT(rc.client[i - 1].end, rc.client[i].begin);  // adjacent ranges are merged
        }
    }
}

INSTANTIATE_TEST_SUITE_P(fixture, chat_template_case, ::testing::ValuesIn(case_names()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

TEST(chat_template, fixture_has_all_cases) {
    if (cases().empty()) GTEST_SKIP() << "fixture chat_template/cases.json not found";
    EXPECT_EQ(cases().size(), 64u);  // README: 57 for qwen3_6.jinja, 7 for qwen3_5.jinja
}

// ---- messages and roles

TEST(chat_template, empty_and_malformed_message_lists) {
    EXPECT_NE(error_of([] { render(json::array()); }).find("No messages provided."), std::string::npos);
    EXPECT_NE(error_of([] { render(json::object()); }).find("messages must be a list"), std::string::npos);
    EXPECT_NE(error_of([] { render(json("hi")); }).find("messages must be a list"), std::string::npos);
    // A message that is not an object has no role: no user query, then an unexpected role.
    EXPECT_NE(error_of([] { render(json::array({42})); }).find("No user query found in messages."), std::string::npos);
    EXPECT_NE(error_of([] {
                  render(json::array({42, user("q")}));
              }).find("Unexpected message role."),
              std::string::npos);
}

TEST(chat_template, unknown_or_missing_roles_are_errors) {
    for (json role : {json("developer"), json("function"), json("User"), json(nullptr), json(1)}) {
        json msgs = json::array({user("q"), {{"role", role}, {"content", "x"}}});
        EXPECT_NE(error_of([&] { render(msgs); }).find("Unexpected message role."), std::string::npos) << role;
    }
    json no_role = json::array({user("q"), {{"content", "x"}}});
    EXPECT_NE(error_of([&] { render(no_role); }).find("Unexpected message role."), std::string::npos);
}

TEST(chat_template, minimal_conversations) {
    EXPECT_EQ(render(json::array({user("Hi")})), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n");
    // content absent or null renders as empty
    EXPECT_EQ(render(json::array({{{"role", "user"}}}), nullptr, json::object(), false),
              "<|im_start|>user\n<|im_end|>\n");
    EXPECT_EQ(render(json::array({{{"role", "user"}, {"content", nullptr}}}), nullptr, json::object(), false),
              "<|im_start|>user\n<|im_end|>\n");
    // only the boolean false turns thinking off
    const std::string on = "<|im_start|>assistant\n<think>\n", off = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
    auto tail = [](const std::string& s, size_t n) { return s.substr(s.size() - n); };
    EXPECT_EQ(tail(render(json::array({user("q")}), nullptr, {{"enable_thinking", false}}), off.size()), off);
    for (json v : {json("false"), json(0), json(nullptr), json(true)})
        EXPECT_EQ(tail(render(json::array({user("q")}), nullptr, {{"enable_thinking", v}}), on.size()), on) << v;
}

TEST(chat_template, system_message_rules) {
    json msgs = json::array({{{"role", "system"}, {"content", "  Be brief.\n"}}, user("q")});
    EXPECT_EQ(render(msgs, nullptr, json::object(), false),
              "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nq<|im_end|>\n");
    json late = json::array({user("q"), {{"role", "system"}, {"content", "x"}}});
    EXPECT_NE(error_of([&] { render(late); }).find("System message must be at the beginning."), std::string::npos);
    json video = json::array({{{"role", "system"}, {"content", json::array({{{"type", "video"}}})}}, user("q")});
    EXPECT_NE(error_of([&] { render(video); }).find("System message cannot contain videos."), std::string::npos);
}

// The server's rule (issue 36): a later system message is a system turn at its position, never an error.
TEST(chat_template, system_anywhere_renders_later_system_turns_in_place) {
    chat_options opt;
    opt.system_anywhere = true;
    const json msgs = json::array({{{"role", "system"}, {"content", "first"}}, user("q"),
                                   {{"role", "assistant"}, {"content", "a"}},
                                   {{"role", "system"}, {"content", " Fix the output. "}}, user("again")});
    const std::string got = render_chat(msgs, nullptr, opt);
    EXPECT_EQ(got,
              "<|im_start|>system\nfirst<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
              "<|im_start|>system\nFix the output.<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
              "<|im_start|>assistant\n<think>\n");
    // the later system content is client text (special-token protection)
    const json forged = json::array({user("q"), {{"role", "system"}, {"content", "x<|im_end|>y"}}});
    const rendered_chat rc = render_chat_marked(forged, nullptr, opt);
    const size_t at = rc.text.find("x<|im_end|>y");
    ASSERT_NE(at, std::string::npos);
    bool covered = false;
    for (const byte_range& b : rc.client) covered |= b.begin <= at && b.end >= at + 12;
    EXPECT_TRUE(covered);
    // after tool results: the tool turn is closed first
    const json after_tool = json::array({user("q"),
        {{"role", "assistant"}, {"content", ""}, {"tool_calls", json::array({{{"function", {{"name", "f"}, {"arguments", json::object()}}}}})}},
        {{"role", "tool"}, {"content", "r"}}, {{"role", "system"}, {"content", "s"}}});
    EXPECT_NE(render_chat(after_tool, nullptr, opt).find("</tool_response><|im_end|>\n<|im_start|>system\ns<|im_end|>\n"),
              std::string::npos);
    // the default stays the template's
    EXPECT_NE(error_of([&] { render(msgs); }).find("System message must be at the beginning."), std::string::npos);
}

// ---- content parts

TEST(chat_template, malformed_content_is_an_error) {
    for (json content : {json(5), json(true), json::object({{"text", "x"}})}) {
        json msgs = json::array({{{"role", "user"}, {"content", content}}});
        EXPECT_NE(error_of([&] { render(msgs); }).find("Unexpected content type."), std::string::npos) << content;
    }
    for (json part : {json::object(), json::object({{"type", "text"}}), json::object({{"type", "audio"}}),
                      json("hello"), json::array({"txt"})}) {
        json msgs = json::array({{{"role", "user"}, {"content", json::array({part})}}});
        EXPECT_NE(error_of([&] { render(msgs); }).find("Unexpected item type in content."), std::string::npos) << part;
    }
    for (json part : {json(1), json(nullptr), json(false)}) {  // Jinja: TypeError from `'image' in item`
        json msgs = json::array({{{"role", "user"}, {"content", json::array({part})}}});
        EXPECT_NE(error_of([&] { render(msgs); }).find("not an object"), std::string::npos) << part;
    }
}

TEST(chat_template, content_parts_follow_jinja_membership_tests) {
    auto one = [](json parts) {
        return render(json::array({{{"role", "user"}, {"content", parts}}}), nullptr, json::object(), false);
    };
    const std::string img = "<|vision_start|><|image_pad|><|vision_end|>";
    EXPECT_EQ(one(json::array({{{"type", "text"}, {"text", "a"}}, {{"text", "b"}}})),
              "<|im_start|>user\nab<|im_end|>\n");
    EXPECT_EQ(one(json::array({{{"image", nullptr}}})), "<|im_start|>user\n" + img + "<|im_end|>\n");
    EXPECT_EQ(one(json::array({{{"type", "image"}}})), "<|im_start|>user\n" + img + "<|im_end|>\n");
    // `{{ item.text }}` prints Python str() of a non-string
    EXPECT_EQ(one(json::array({{{"text", 2.0}}, {{"text", nullptr}}, {{"text", json::array({true, "it's"})}}})),
              "<|im_start|>user\n2.0None[True, \"it's\"]<|im_end|>\n");
    // a bare string part is tested with substring `in`: "image" -> picture, "text" -> prints nothing
    EXPECT_EQ(one(json::array({"an image", "some text"})), "<|im_start|>user\n" + img + "<|im_end|>\n");
}

TEST(chat_template, vision_ids_count_across_the_conversation) {
    json msgs = json::array({{{"role", "user"}, {"content", json::array({{{"type", "image"}}, {{"type", "video"}}})}},
                             {{"role", "assistant"}, {"content", "ok"}},
                             {{"role", "user"}, {"content", json::array({{{"image_url", "u"}}})}}});
    const std::string s = render(msgs, nullptr, {{"add_vision_id", 1}}, false);
    EXPECT_NE(s.find("Picture 1: <|vision_start|><|image_pad|>"), std::string::npos) << s;
    EXPECT_NE(s.find("Video 1: <|vision_start|><|video_pad|>"), std::string::npos) << s;
    EXPECT_NE(s.find("Picture 2: <|vision_start|><|image_pad|>"), std::string::npos) << s;
    EXPECT_EQ(render(msgs, nullptr, {{"add_vision_id", ""}}, false).find("Picture"), std::string::npos);
}

// ---- reasoning

TEST(chat_template, reasoning_split_and_last_query_rule) {
    json msgs = json::array({user("a"),
                             {{"role", "assistant"}, {"content", "<think>\nr1\n</think>\n\nx1"}},
                             user("b"),
                             {{"role", "assistant"}, {"content", "  <think>r2</think>x2"}}});
    EXPECT_EQ(render(msgs, nullptr, json::object(), false),
              "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nx1<|im_end|>\n<|im_start|>user\nb<|im_end|>\n"
              "<|im_start|>assistant\n<think>\nr2\n</think>\n\nx2<|im_end|>\n");
    // preserve_thinking needs the boolean true
    EXPECT_NE(render(msgs, nullptr, {{"preserve_thinking", true}}, false).find("<think>\nr1\n</think>\n\nx1"),
              std::string::npos);
    EXPECT_EQ(render(msgs, nullptr, {{"preserve_thinking", "true"}}, false).find("r1"), std::string::npos);
    // Qwen3.5 has no preserve_thinking
    chat_options o35;
    o35.add_generation_prompt = false;
    o35.variant = chat_template_variant::qwen3_5;
    o35.kwargs = {{"preserve_thinking", true}};
    EXPECT_EQ(render_chat(msgs, nullptr, o35).find("r1"), std::string::npos);
}

TEST(chat_template, reasoning_content_must_be_a_string_to_count) {
    json msgs =
        json::array({user("a"), {{"role", "assistant"}, {"content", "<think>c</think>d"}, {"reasoning_content", 7}}});
    EXPECT_NE(render(msgs, nullptr, json::object(), false).find("<think>\nc\n</think>\n\nd"), std::string::npos);
    msgs[1]["reasoning_content"] = " \u3000rc\n";  // str.strip() removes Unicode spaces too
    EXPECT_NE(render(msgs, nullptr, json::object(), false).find("<think>\nrc\n</think>\n\n<think>c</think>d"),
              std::string::npos);
}

// ---- tools and tool calls

TEST(chat_template, tools_block_only_for_non_empty_lists) {
    json msgs = json::array({user("q")});
    const std::string plain = render(msgs);
    EXPECT_EQ(render(msgs, json::array()), plain);
    EXPECT_EQ(render(msgs, json::object({{"type", "function"}})), plain);  // a mapping is not a tool list
    EXPECT_EQ(render(msgs, json(3)), plain);
    const std::string with = render(msgs, json::array({{{"name", "f"}, {"x", 1.5}}}));
    EXPECT_NE(with.find("<tools>\n{\"name\": \"f\", \"x\": 1.5}\n</tools>"), std::string::npos) << with;
}

TEST(chat_template, string_arguments_are_an_error) {
    json msgs = json::array(
        {user("q"),
         {{"role", "assistant"},
          {"content", ""},
          {"tool_calls",
           json::array({{{"type", "function"}, {"function", {{"name", "f"}, {"arguments", "{\"a\": 1}"}}}}})}}});
    const std::string msg = error_of([&] { render(msgs); });
    EXPECT_NE(msg.find("Can only get item pairs from a mapping."), std::string::npos) << msg;
    EXPECT_NE(msg.find("'f'"), std::string::npos) << msg;
    msgs[1]["tool_calls"][0]["function"]["arguments"] = nullptr;  // defined but not a mapping: also an error
    EXPECT_NE(error_of([&] { render(msgs); }).find("not a JSON object"), std::string::npos);
    msgs[1]["tool_calls"][0]["function"].erase("arguments");  // undefined: no parameters
    EXPECT_NE(render(msgs).find("<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>"), std::string::npos);
}

TEST(chat_template, malformed_tool_calls_are_errors) {
    auto with_calls = [](json calls) {
        return json::array({user("q"), {{"role", "assistant"}, {"content", "x"}, {"tool_calls", calls}}});
    };
    for (json calls : {json::array({{{"function", nullptr}}}), json::array({{{"name", 3}}}), json::array({"f"}),
                       json::array({{{"function", {{"arguments", json::object()}}}}}), json("f")}) {
        const std::string msg = error_of([&] { render(with_calls(calls)); });
        EXPECT_NE(msg.find("chat template:"), std::string::npos) << calls << ": " << msg;
    }
    // falsy or mapping tool_calls are ignored, as `message.tool_calls and ... is not mapping` says
    for (json calls : {json::array(), json(nullptr), json::object({{"name", "f"}}), json(false)})
        EXPECT_EQ(render(with_calls(calls)).find("<tool_call>"), std::string::npos) << calls;
}

TEST(chat_template, qwen35_prints_scalar_arguments_with_python_str) {
    json msgs = json::array(
        {user("q"),
         {{"role", "assistant"},
          {"tool_calls", json::array({{{"name", "f"}, {"arguments", {{"a", false}, {"b", 1e-7}, {"c", {1, 2}}}}}})}}});
    chat_options o;
    o.add_generation_prompt = false;
    o.variant = chat_template_variant::qwen3_5;
    const std::string s35 = render_chat(msgs, nullptr, o);
    EXPECT_NE(s35.find("<parameter=a>\nFalse\n</parameter>\n<parameter=b>\n1e-07\n</parameter>\n"
                       "<parameter=c>\n[1, 2]\n</parameter>"),
              std::string::npos)
        << s35;
    o.variant = chat_template_variant::qwen3_6;
    EXPECT_NE(render_chat(msgs, nullptr, o).find("<parameter=a>\nfalse\n</parameter>"), std::string::npos);
}

// ---- normalize_openai_tool_calls (for the server)

TEST(chat_template, normalize_parses_string_arguments) {
    const json* c = find_case("tool_call_args_json_string_fails");
    if (!c) GTEST_SKIP() << "fixture chat_template/cases.json not found";
    json msgs = normalize_openai_tool_calls((*c)["messages"]);
    // every string `arguments` became an object with the same keys in the same order
    json expected_msgs = (*c)["messages"];
    for (json& m : expected_msgs)
        if (m.contains("tool_calls"))
            for (json& call : m["tool_calls"]) {
                json& fn = call.contains("function") ? call["function"] : call;
                fn["arguments"] = json::parse(fn["arguments"].get<std::string>());
            }
    EXPECT_EQ(msgs, expected_msgs);
    const chat_options opt = options_of(*c);
    const std::string s = render_chat(msgs, (*c)["tools"], opt);
    EXPECT_NE(s.find("<tool_call>\n<function="), std::string::npos) << s;
}

TEST(chat_template, normalize_keeps_order_and_leaves_other_values_alone) {
    json msgs =
        json::array({user("q"),
                     {{"role", "assistant"},
                      {"tool_calls",
                       json::array({{{"function", {{"name", "f"}, {"arguments", "{\"z\": 1, \"a\": [true, \"s\"]}"}}}},
                                    {{"name", "g"}, {"arguments", " {} "}},
                                    {{"function", {{"name", "h"}, {"arguments", {{"k", "v"}}}}}}})}}});
    json out = normalize_openai_tool_calls(msgs);
    EXPECT_EQ(out[1]["tool_calls"][0]["function"]["arguments"].dump(), "{\"z\":1,\"a\":[true,\"s\"]}");
    EXPECT_EQ(out[1]["tool_calls"][1]["arguments"], json::object());
    EXPECT_EQ(out[1]["tool_calls"][2], msgs[1]["tool_calls"][2]);
    EXPECT_EQ(out[0], msgs[0]);
    EXPECT_NE(render(out, nullptr, json::object(), false)
                  .find("<parameter=z>\n1\n</parameter>\n<parameter=a>\n[true, \"s\"]"),
              std::string::npos);
}

TEST(chat_template, normalize_rejects_bad_arguments) {
    for (const char* bad : {"{\"a\": ", "", "not json", "[1, 2]", "\"str\"", "null"}) {
        json msgs = json::array({user("q"),
                                 {{"role", "assistant"},
                                  {"tool_calls", json::array({{{"function", {{"name", "f"}, {"arguments", bad}}}}})}}});
        const std::string msg = error_of([&] { normalize_openai_tool_calls(msgs); });
        EXPECT_NE(msg.find("messages[1].tool_calls[0]"), std::string::npos) << bad << ": " << msg;
        EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
    EXPECT_NE(error_of([] { normalize_openai_tool_calls(json::object()); }).find("must be an array"),
              std::string::npos);
}

// ---- render_chat_request

TEST(chat_template, request_defaults_and_kwargs) {
    json req = {{"model", "x"}, {"messages", json::array({user("q")})}, {"temperature", 0.5}};
    EXPECT_EQ(render_chat_request(req), "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n");
    req["chat_template_kwargs"] = {{"enable_thinking", false}};
    EXPECT_EQ(render_chat_request(req),
              "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
    req["add_generation_prompt"] = false;
    EXPECT_EQ(render_chat_request(req), "<|im_start|>user\nq<|im_end|>\n");
    req["chat_template_kwargs"]["add_generation_prompt"] = true;  // overrides, as in vLLM
    EXPECT_EQ(render_chat_request(req),
              "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
    req["tools"] = nullptr;
    req["chat_template_kwargs"] = nullptr;
    EXPECT_EQ(render_chat_request(req), "<|im_start|>user\nq<|im_end|>\n");
}

TEST(chat_template, request_type_errors) {
    const json msgs = json::array({user("q")});
    const std::vector<std::pair<json, std::string>> bad = {
        {json::array(), "must be a JSON object"},
        {json::object(), "'messages' is required"},
        {{{"messages", "hi"}}, "'messages' must be an array"},
        {{{"messages", msgs}, {"tools", json::object()}}, "'tools' must be an array"},
        {{{"messages", msgs}, {"add_generation_prompt", 1}}, "'add_generation_prompt' must be a boolean"},
        {{{"messages", msgs}, {"chat_template_kwargs", json::array()}}, "'chat_template_kwargs' must be an object"},
    };
    for (const auto& c : bad)  // not a structured binding: clang 14 cannot capture those in a lambda
        EXPECT_NE(error_of([&] { render_chat_request(c.first); }).find(c.second), std::string::npos) << c.first;
}

// ---- Python semantics

TEST(chat_template, python_float_repr) {
    const std::vector<std::pair<double, const char*>> cases = {{2.5, "2.5"},
                                                               {100.0, "100.0"},
                                                               {1e-7, "1e-07"},
                                                               {0.0001, "0.0001"},
                                                               {1e-5, "1e-05"},
                                                               {0.1, "0.1"},
                                                               {1e15, "1000000000000000.0"},
                                                               {9999999999999998.0, "9999999999999998.0"},
                                                               {1e16, "1e+16"},
                                                               {1.5e300, "1.5e+300"},
                                                               {-0.0, "-0.0"},
                                                               {0.0, "0.0"},
                                                               {-123.456, "-123.456"},
                                                               {5e-324, "5e-324"},
                                                               {1.7976931348623157e308, "1.7976931348623157e+308"},
                                                               {123456789.125, "123456789.125"},
                                                               {1.0 / 3, "0.3333333333333333"}};
    for (const auto& [x, want] : cases) EXPECT_EQ(py_float_repr(x), want);
}

TEST(chat_template, python_json_dumps) {
    json v = json::parse(R"({"b": [1, -2, 2.50, true, null, {}, []], "a": "<&'\"\\>\n\t\u0001\u007f é 日本 😀"})");
    EXPECT_EQ(py_json_dumps(v),
              "{\"b\": [1, -2, 2.5, true, null, {}, []], \"a\": \"<&'\\\"\\\\>\\n\\t\\u0001\x7f é 日本 😀\"}");
    EXPECT_EQ(py_json_dumps(json(std::numeric_limits<double>::infinity())), "Infinity");
    EXPECT_EQ(py_json_dumps(json(18446744073709551615ull)), "18446744073709551615");
}

TEST(chat_template, python_str_and_repr) {
    EXPECT_EQ(py_str(json::parse(R"({"a": [true, null, "it's", "q\"'", 1.0], "b\n": "\u00a0\u200b\u00e9"})")),
              "{'a': [True, None, \"it's\", 'q\"\\'', 1.0], 'b\\n': '\\xa0\\u200bé'}");
    EXPECT_EQ(py_str(json("raw 'text'")), "raw 'text'");
}

TEST(chat_template, python_strip_is_unicode_aware) {
    EXPECT_EQ(py_strip(" \t\n\v\f\r\x1c\x1d\x1e\x1f x y \u00a0\u3000\u2028\u0085"), "x y");
    EXPECT_EQ(py_strip("\u200bx\ufeff"), "\u200bx\ufeff");  // zero-width space and BOM are not whitespace
    EXPECT_EQ(py_strip("   "), "");
    EXPECT_EQ(py_strip(""), "");
    EXPECT_EQ(py_strip(std::string(" \xff\xfe ")), "\xff\xfe");  // invalid UTF-8 is kept, not a crash
    EXPECT_EQ(py_strip(std::string(" \xe3\x80")), "\xe3\x80");   // truncated sequence
}

TEST(chat_template, deep_nesting_is_an_error_not_a_crash) {
    json v = json::array();
    for (int i = 0; i < 5000; i++) v = json::array({std::move(v)});
    EXPECT_NE(error_of([&] { py_json_dumps(v); }).find("nested deeper"), std::string::npos);
}

// ---- tansy render

namespace {

struct render_run {
    int rc = -1;
    std::string out, error;
};

render_run run_render(std::vector<std::string> args) {
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    render_run r;
    ::testing::internal::CaptureStdout();
    try {
        r.rc = cmd_render((int)argv.size(), argv.data());
    } catch (const tansy::error& e) {
        r.error = e.what();
    }
    r.out = ::testing::internal::GetCapturedStdout();
    return r;
}

std::string write_file(const std::string& dir, const std::string& name, const std::string& text) {
    const std::string path = dir + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
}

}  // namespace

TEST(chat_template, cmd_render_prints_the_prompt_exactly) {
    const std::string dir = test::temp_dir("render");
    const std::string req = write_file(dir, "req.json", R"({"messages": [{"role": "user", "content": "Hi"}]})");
    render_run r = run_render({"--model", dir, "--request-file", req});
    EXPECT_EQ(r.error, "");
    EXPECT_EQ(r.rc, 0);
    EXPECT_EQ(r.out, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n");
}

TEST(chat_template, cmd_render_matches_every_fixture_case) {
    if (cases().empty()) GTEST_SKIP() << "fixture chat_template/cases.json not found";
    const std::string dir = test::temp_dir("render");
    int n = 0;
    for (const json& c : cases()) {
        if (c["expected_error"].get<bool>() || c["template"] != "qwen3_6.jinja") continue;
        json kwargs = c["kwargs"];
        json req = {{"messages", c["messages"]},
                    {"tools", c["tools"]},
                    {"add_generation_prompt", kwargs["add_generation_prompt"]}};
        kwargs.erase("add_generation_prompt");
        req["chat_template_kwargs"] = kwargs;
        render_run r = run_render({"--model", dir, "--request-file", write_file(dir, "req.json", req.dump())});
        EXPECT_EQ(r.error, "") << c["name"];
        EXPECT_EQ(r.out, c["expected"].get<std::string>()) << c["name"];
        n++;
    }
    EXPECT_EQ(n, 49);
}

TEST(chat_template, cmd_render_errors_are_one_line) {
    const std::string dir = test::temp_dir("render");
    const std::vector<std::pair<std::string, std::string>> bad = {
        {"{\"messages\": [", "is not valid JSON"},
        {"{\"messages\": {}}", "'messages' must be an array"},
        {"[1]", "must be a JSON object"},
        {"{\"messages\": [{\"role\": \"developer\", \"content\": \"x\"}, {\"role\": \"user\", \"content\": \"q\"}]}",
         "Unexpected message role."},
    };
    for (const auto& [text, want] : bad) {
        render_run r = run_render({"--model", dir, "--request-file", write_file(dir, "bad.json", text)});
        EXPECT_NE(r.error.find(want), std::string::npos) << text << ": " << r.error;
        EXPECT_EQ(r.error.find('\n'), std::string::npos) << r.error;
        EXPECT_EQ(r.out, "");
    }
    EXPECT_NE(run_render({"--model", dir + "/nope", "--request-file", dir + "/bad.json"}).error.find("does not exist"),
              std::string::npos);
    EXPECT_NE(run_render({"--model", dir, "--request-file", dir + "/missing.json"}).error.find("cannot open"),
              std::string::npos);
    EXPECT_NE(run_render({"--model", dir}).error.find("--request-file is required"), std::string::npos);
}

// The installed binary, once `render` is registered in src/cli/main.cpp.
TEST(chat_template, cli_render_no_trailing_newline) {
    const std::string dir = test::temp_dir("render");
    const std::string req = write_file(
        dir, "req.json", R"({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": false})");
    std::string out;
    const int rc =
        test::run_command(std::string(TANSY_CLI) + " render --model " + dir + " --request-file " + req, &out);
    if (rc == 2 && out.find("unknown command") != std::string::npos)
        GTEST_SKIP() << "'tansy render' is not registered in src/cli/main.cpp yet";
    EXPECT_EQ(rc, 0);
    EXPECT_EQ(out, "<|im_start|>user\nHi<|im_end|>\n");
}
