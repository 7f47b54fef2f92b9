// What the server does with generated tokens: stop strings matched across token boundaries (never shown),
// the JSON-mode recogniser and constraint, and the forced tool-call prefix.
#include <gtest/gtest.h>

#include <random>

#include "runtime/text_engine.h"
#include "server/constraints.h"
#include "server/text_stream.h"

namespace tansy {
namespace {

using ojson = nlohmann::ordered_json;

std::string feed_all(stop_matcher& m, const std::vector<std::string>& pieces) {
    std::string out;
    for (const std::string& p : pieces) out += m.push(p);
    return out + m.flush();
}

TEST(server_text, stop_strings_across_pieces_never_leak) {
    {
        stop_matcher m({"STOP"});
        EXPECT_EQ(feed_all(m, {"abc S", "T", "O", "P after"}), "abc ");
        EXPECT_TRUE(m.matched());
    }
    {
        stop_matcher m({"STOP"});
        EXPECT_EQ(m.push("abc ST"), "abc ") << "a possible start of a stop string is held back";
        EXPECT_EQ(m.push("ART"), "START");
        EXPECT_EQ(m.flush(), "");
        EXPECT_FALSE(m.matched());
    }
    {
        stop_matcher m({"\n\n", "END"});
        EXPECT_EQ(feed_all(m, {"line\n", "\nnext"}), "line");
    }
    {
        stop_matcher m({"xyz", "yz!"});
        EXPECT_EQ(feed_all(m, {"ab", "cy", "z!"}), "abc") << "the earliest match wins";
    }
    {
        stop_matcher m({"EN"});
        EXPECT_EQ(feed_all(m, {"ab", "E"}), "abE") << "held text comes out at the end";
    }
    {
        stop_matcher m({""});
        EXPECT_EQ(feed_all(m, {"empty stops are ignored"}), "empty stops are ignored");
    }
    // every split of a text containing the stop string gives the text before it
    const std::string text = "one two thr\xc3\xa9\xc3\xa9 stop-here and more";
    for (size_t a = 0; a <= text.size(); a++)
        for (size_t b = a; b <= text.size(); b += 3) {
            stop_matcher m({"stop-here"});
            EXPECT_EQ(feed_all(m, {text.substr(0, a), text.substr(a, b - a), text.substr(b)}),
                      "one two thr\xc3\xa9\xc3\xa9 ");
        }
}

text_engine& tiny() {
    static text_engine te([] {
        engine_options o;
        o.threads = 1;
        return o;
    }());
    return te;
}

TEST(server_text, completion_text_cuts_a_stop_string_spanning_tokens) {
    const tokenizer& tok = tiny().tok();
    const std::string text = "The quick brown fox jumps over the lazy dog.";
    const std::vector<int32_t> ids = tok.encode(text);
    ASSERT_GT(ids.size(), 4u);
    text_options o;
    o.chat = false;
    o.stop = {"fox jum"};  // not a token boundary on either side
    completion_text ct(tok, tiny().eos(), tiny().think_end(), o);
    std::string shown;
    for (int32_t id : ids) {
        text_delta d;
        token_event e;
        e.id = id;
        ct.push(e, d);
        shown += d.text;
    }
    text_delta d;
    ct.finish(d);
    shown += d.text;
    EXPECT_EQ(shown, "The quick brown ");
    EXPECT_EQ(ct.text(), "The quick brown ");
    EXPECT_TRUE(ct.stop_matched());
    EXPECT_LT(ct.completion_tokens(), (int64_t)ids.size()) << "tokens after the stop are not counted";
}

TEST(server_text, completion_text_counts_reasoning_tokens) {
    const tokenizer& tok = tiny().tok();
    const std::vector<int32_t> ids = tok.encode("Let me think.</think>\n\nAnswer.");
    text_options o;
    o.chat = true;
    o.thinking = true;
    completion_text ct(tok, tiny().eos(), tiny().think_end(), o);
    text_delta d;
    for (int32_t id : ids) {
        token_event e;
        e.id = id;
        ct.push(e, d);
    }
    token_event eos;
    eos.id = tiny().eos()[0];
    ct.push(eos, d);
    ct.finish(d);
    EXPECT_EQ(ct.parser().reasoning(), "Let me think.");
    EXPECT_EQ(ct.parser().content(), "Answer.");
    EXPECT_EQ(d.parsed.reasoning, "Let me think.");
    EXPECT_EQ(ct.completion_tokens(), (int64_t)ids.size() + 1);
    const std::vector<int32_t> r = tok.encode("Let me think.</think>");
    EXPECT_EQ(ct.reasoning_tokens(), (int64_t)r.size());
    // log-probs cover the answer's tokens: not the reasoning, not </think>, not the end-of-turn token
    EXPECT_EQ(d.logprobs.size(), ids.size() - r.size());
}

// Chat log-probs line up with message.content: their tokens' text is the content (after the blank lines the
// parser drops), never reasoning, tool-call markup, or text past a stop string.
TEST(server_text, chat_logprobs_cover_the_content_only) {
    const tokenizer& tok = tiny().tok();
    auto text_of = [&](const std::vector<token_event>& lp) {
        std::vector<int32_t> ids;
        for (const token_event& e : lp) ids.push_back(e.id);
        std::string t = tok.decode(ids);
        t.erase(0, t.find_first_not_of('\n'));
        return t;
    };
    auto run = [&](text_options o, const std::string& out, completion_text** keep = nullptr) {
        auto* ct = new completion_text(tok, tiny().eos(), tiny().think_end(), o);
        std::vector<token_event> lp;
        for (int32_t id : tok.encode(out)) {
            text_delta d;
            token_event e;
            e.id = id;
            ct->push(e, d);
            lp.insert(lp.end(), d.logprobs.begin(), d.logprobs.end());
        }
        text_delta d;
        ct->finish(d);
        lp.insert(lp.end(), d.logprobs.begin(), d.logprobs.end());
        std::string content = ct->content();
        delete ct;
        return std::make_pair(text_of(lp), content);
    };
    text_options o;
    o.chat = true;
    o.thinking = true;
    auto [a, ca] = run(o, "Let me think.</think>\n\nThe answer is 4.");
    EXPECT_EQ(a, ca);
    EXPECT_EQ(a, "The answer is 4.");
    o.tools = true;
    auto [b, cb] = run(o, "ok</think>\n\nCalling it.\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n"
                          "</function>\n</tool_call>");
    EXPECT_EQ(cb, "Calling it.");
    EXPECT_EQ(b.substr(0, cb.size()), cb);
    EXPECT_EQ(b.find("tool_call"), std::string::npos) << b;
    EXPECT_LE(b.size(), cb.size() + 1) << b;  // at most the newline before the call
    o.tools = false;
    o.stop = {"STOP"};
    auto [c, cc] = run(o, "hm</think>\n\nfirst part STOP second part");
    EXPECT_EQ(cc, "first part ");
    EXPECT_EQ(c.find("second"), std::string::npos) << c;
}

// Issue 36: in chat, stop strings are matched against the answer (content) only: not the reasoning, not the
// tool-call markup.
struct chat_run {
    std::string streamed_reasoning, streamed_content;
    int n_call_pieces = 0;
};
chat_run run_chat(completion_text& ct, const std::string& out) {
    chat_run r;
    const tokenizer& tok = tiny().tok();
    auto take = [&](const text_delta& d) {
        r.streamed_reasoning += d.parsed.reasoning;
        r.streamed_content += d.parsed.content;
        r.n_call_pieces += (int)d.parsed.tool_calls.size();
    };
    for (int32_t id : tok.encode(out)) {
        text_delta d;
        token_event e;
        e.id = id;
        ct.push(e, d);
        take(d);
    }
    text_delta d;
    ct.finish(d);
    take(d);
    return r;
}

TEST(server_text, chat_stop_strings_match_the_answer_only) {
    const tokenizer& tok = tiny().tok();
    text_options o;
    o.chat = true;
    o.thinking = true;
    o.stop = {"think", "function"};
    {
        completion_text ct(tok, tiny().eos(), tiny().think_end(), o);
        const chat_run r = run_chat(ct, "I think about it.</think>\n\nWe think so. More.");
        EXPECT_EQ(ct.reasoning(), "I think about it.") << "the reasoning is not cut";
        EXPECT_EQ(ct.content(), "We ");
        EXPECT_TRUE(ct.stop_matched());
        EXPECT_EQ(r.streamed_reasoning, ct.reasoning());
        EXPECT_EQ(r.streamed_content, ct.content());
    }
    {  // tool-call markup is not matched; the call is kept
        o.tools = true;
        completion_text ct(tok, tiny().eos(), tiny().think_end(), o);
        const chat_run r = run_chat(ct, "ok</think>\n\nCalling.\n<tool_call>\n<function=f>\n<parameter=a>\n1\n"
                                        "</parameter>\n</function>\n</tool_call>");
        EXPECT_FALSE(ct.stop_matched());
        EXPECT_EQ(ct.content(), "Calling.");
        ASSERT_EQ(ct.tool_calls().size(), 1u);
        EXPECT_EQ(ct.tool_calls()[0].name, "f");
        EXPECT_EQ(ct.tool_calls()[0].arguments, ct.parser().tool_calls()[0].arguments);
        EXPECT_GT(r.n_call_pieces, 0);
        EXPECT_EQ(r.streamed_content, ct.content());
    }
    {  // a stop string in the content before a call: the call is dropped
        completion_text ct(tok, tiny().eos(), tiny().think_end(), o);
        run_chat(ct, "ok</think>\n\nI think I will call.\n<tool_call>\n<function=f>\n</function>\n</tool_call>");
        EXPECT_TRUE(ct.stop_matched());
        EXPECT_EQ(ct.content(), "I ");
        EXPECT_TRUE(ct.tool_calls().empty());
    }
    {  // a held-back possible stop string is released at the end
        o.stop = {"thinker"};
        completion_text ct(tok, tiny().eos(), tiny().think_end(), o);
        const chat_run r = run_chat(ct, "a</think>\n\nto think");
        EXPECT_EQ(ct.content(), "to think");
        EXPECT_EQ(r.streamed_content, "to think");
    }
}

TEST(server_text, json_prefix_accepts_json_and_completes_every_prefix) {
    const std::vector<std::string> docs = {
        R"({})", R"( {"a": 1})", R"({"a": [1, -2.5e+3, true, false, null, "x\"y\\u00e9"], "b": {"c": {}}})",
        "{\n  \"k\": [\n    0.5,\n    {\"z\": []}\n  ]\n}", R"({"emoji": "é ☃", "n": -0, "e": 1E5})"};
    for (const std::string& doc : docs) {
        ASSERT_TRUE(ojson::parse(doc, nullptr, false).is_object()) << doc;
        json_prefix p;
        for (size_t i = 0; i < doc.size(); i++) {
            // the closer of every prefix completes it to valid JSON
            const std::string done = doc.substr(0, i) + p.closer();
            EXPECT_TRUE(ojson::parse(done, nullptr, false).is_object()) << "prefix " << i << " of " << doc << " -> " << done;
            ASSERT_TRUE(p.feed(doc[i])) << "rejected byte " << i << " of " << doc;
        }
        EXPECT_TRUE(p.complete()) << doc;
        EXPECT_EQ(p.closer(), "");
        EXPECT_FALSE(p.feed(' ')) << "nothing may follow the object";
    }
    for (const std::string bad : {"[1]", "x", "{a", R"({"a" 1})", R"({"a": 01})", R"({"a": tru})", "{\"a\n",
                                  R"({"a": 1,})", R"({"a": [1,]})", R"({"a": "\x"})", "{}}"}) {
        json_prefix p;
        bool ok = p.feed(std::string_view(bad));
        ok = ok && p.complete();
        EXPECT_FALSE(ok) << bad;
    }
}

// Simulates a generation with random logits under a constraint; returns the text.
std::string constrained_generation(token_constraint& c, const token_table& t, int64_t max_tokens, uint32_t seed,
                                   bool* ended) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 3.0f);
    const int64_t n = (int64_t)t.bytes.size();
    std::string out;
    *ended = false;
    for (int64_t k = 0; k < max_tokens; k++) {
        std::vector<float> logits((size_t)n);
        std::vector<uint32_t> words;
        for (float& x : logits) x = nd(rng);
        if (c.active()) c.mask(logits.data(), n, max_tokens - k, words);
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

TEST(server_text, json_constraint_always_gives_parseable_json) {
    const tokenizer& tok = tiny().tok();
    auto table = token_table::build(tok, tiny().eng().n_valid_tokens(), tiny().eos(), tiny().think_end());
    for (uint32_t seed = 0; seed < 12; seed++) {
        for (int64_t max_tokens : {6, 20, 60}) {
            json_object_constraint c(table, /*thinking=*/false, 8);
            bool ended = false;
            const std::string out = constrained_generation(c, *table, max_tokens, seed, &ended);
            EXPECT_TRUE(ojson::parse(out, nullptr, false).is_object())
                << "seed " << seed << " max_tokens " << max_tokens << ": " << out;
        }
    }
    // with thinking: free text, then </think> forced at the reserve, then the object
    json_object_constraint c(table, /*thinking=*/true, 20);
    bool ended = false;
    const std::string out = constrained_generation(c, *table, 60, 3, &ended);
    const size_t end = out.find("</think>");
    ASSERT_NE(end, std::string::npos) << out;
    EXPECT_TRUE(ojson::parse(out.substr(end + 8), nullptr, false).is_object()) << out;
}

TEST(server_text, prefix_constraint_forces_the_tool_call_header) {
    const tokenizer& tok = tiny().tok();
    auto table = token_table::build(tok, tiny().eng().n_valid_tokens(), tiny().eos(), tiny().think_end());
    const std::string head = "<tool_call>\n<function=get_docstring>\n";
    for (uint32_t seed = 0; seed < 5; seed++) {
        prefix_constraint c(table, false, 8, {head, "\n\n" + head});
        bool ended = false;
        const std::string out = constrained_generation(c, *table, 30, seed, &ended);
        EXPECT_TRUE(out.rfind(head, 0) == 0 || out.rfind("\n\n" + head, 0) == 0) << out;
        EXPECT_FALSE(c.active()) << "free once the header is written";
    }
}

}  // namespace
}  // namespace tansy
