// tansy run: one prompt, or an interactive chat, streamed as it is generated.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/check.h"
#include "model/config.h"
#include "runtime/text_engine.h"
#include "tokenizer/chat_template.h"

namespace tansy {

namespace {

using ojson = nlohmann::ordered_json;

struct run_style {
    bool tty = false;
    const char* dim() const { return tty ? "\033[2m" : ""; }
    const char* reset() const { return tty ? "\033[0m" : ""; }
};

// Streams one assistant turn: reasoning (before </think>) dimmed, then the answer. Returns the answer text and
// the reasoning separately, for the chat history.
struct turn_result {
    std::string reasoning, content;
    generation_stats stats;
};

turn_result stream_turn(text_engine& te, const std::vector<int32_t>& prompt, const generation_request& base,
                        bool thinking, const run_style& st) {
    generation_request req = base;
    req.prompt = prompt;
    req.stop = te.eos();
    auto seq = te.eng().new_sequence((int64_t)prompt.size() + req.max_tokens);
    stream_decoder dec(te.tok(), /*skip_special=*/true);
    turn_result r;
    bool in_reasoning = thinking && te.think_end() >= 0;
    bool answer_started = false;  // the answer follows "</think>\n\n": its leading newlines are not shown
    if (in_reasoning) fputs(st.dim(), stdout);
    r.stats = te.eng().generate(*seq, req, [&](int32_t id) {
        if (id == te.think_end() && in_reasoning) {
            std::string tail = dec.flush();
            r.reasoning += tail;
            fputs(tail.c_str(), stdout);
            fputs(st.reset(), stdout);
            in_reasoning = false;
            fflush(stdout);
            return true;
        }
        if (std::find(te.eos().begin(), te.eos().end(), id) != te.eos().end()) return true;
        std::string piece = dec.push(id);
        (in_reasoning ? r.reasoning : r.content) += piece;
        if (!in_reasoning && !answer_started) {
            piece.erase(0, piece.find_first_not_of('\n') == std::string::npos ? piece.size() : piece.find_first_not_of('\n'));
            answer_started = !piece.empty();
        }
        fputs(piece.c_str(), stdout);
        fflush(stdout);
        return true;
    });
    std::string tail = dec.flush();
    (in_reasoning ? r.reasoning : r.content) += tail;
    fputs(tail.c_str(), stdout);
    if (in_reasoning) fputs(st.reset(), stdout);
    fputs("\n", stdout);
    fflush(stdout);
    // the answer starts after "</think>\n\n" in the real format
    while (!r.content.empty() && r.content.front() == '\n') r.content.erase(0, 1);
    while (!r.reasoning.empty() && (r.reasoning.back() == '\n')) r.reasoning.pop_back();
    return r;
}

void report(const generation_stats& s) {
    fprintf(stderr, "tansy: prompt %lld tokens %.3f s (%.0f tok/s), generated %lld tokens %.3f s (%.1f tok/s)\n",
            (long long)s.prompt_tokens, s.prefill_s, s.prompt_tokens / std::max(s.prefill_s, 1e-9),
            (long long)s.generated, s.prefill_s + s.decode_s,
            s.generated > 1 ? (s.generated - 1) / std::max(s.decode_s, 1e-9) : 0.0);
}

}  // namespace

int cmd_run(int argc, char** argv) {
    arg_parser p("run", "[--prompt TEXT | --chat] [options]",
                 "Generates from a prompt and streams the text as it comes. The prompt is rendered with the model's\n"
                 "chat template as one user turn (--raw: used as is). Reasoning (<think>...</think>) is shown dimmed,\n"
                 "then the answer; generation stops at the model's end-of-turn tokens (generation_config.json).\n"
                 "--chat starts an interactive conversation (an empty line or EOF ends it).");
    add_engine_options(p);
    p.option("--prompt", "TEXT", "the user's message (or the raw text with --raw)")
        .option("--chat", "", "interactive multi-turn chat")
        .option("--raw", "", "no chat template: continue the prompt text")
        .option("--system", "TEXT", "system message")
        .option("--tools", "FILE", "tool definitions: a JSON array, or an object with \"tools\" (and \"system\")")
        .option("--no-think", "", "thinking off (enable_thinking = false)")
        .option("-n", "N", "most tokens to generate per turn (default 512)", "--max-tokens");
    add_sampling_options(p);
    if (!p.parse(argc, argv)) return 0;
    if (p.has("--chat") == p.has("--prompt")) fail("run: give exactly one of --prompt TEXT or --chat");
    if (p.has("--raw") && p.has("--chat")) fail("run: --raw and --chat do not combine");
    generation_request req;
    req.max_tokens = p.integer("-n", 512);
    if (req.max_tokens < 1) fail("run: -n must be >= 1");
    req.sampling = sampling_from(p);
    ojson tools = ojson::array();
    std::string system = p.str("--system");
    if (p.has("--tools")) {
        ojson t;
        try {
            t = ojson::parse(read_text_file(p.str("--tools")));
        } catch (const nlohmann::json::exception& e) {
            fail("%s: not valid JSON: %s", p.str("--tools").c_str(), e.what());
        }
        if (t.is_object() && t.contains("tools")) {
            if (system.empty() && t.contains("system") && t["system"].is_string()) system = t["system"].get<std::string>();
            t = t["tools"];
        }
        if (!t.is_array()) fail("%s: expected a JSON array of tools", p.str("--tools").c_str());
        tools = t;
    }
    const bool thinking = !p.has("--no-think");
    text_engine te(engine_options_from(p));
    run_style st;
    st.tty = isatty(1);

    if (p.has("--raw")) {
        std::vector<int32_t> ids = te.tok().encode(p.str("--prompt"));
        if (ids.empty()) fail("run: the prompt is empty");
        report(stream_turn(te, ids, req, false, st).stats);
        return 0;
    }
    ojson messages = ojson::array();
    if (!system.empty()) messages.push_back({{"role", "system"}, {"content", system}});
    chat_options co;
    co.kwargs = ojson::object();
    if (!thinking) co.kwargs["enable_thinking"] = false;
    auto turn = [&](const std::string& user) {
        messages.push_back({{"role", "user"}, {"content", user}});
        const std::string text = render_chat(messages, tools, co);
        turn_result r = stream_turn(te, te.tok().encode(text), req, thinking, st);
        ojson a = {{"role", "assistant"}, {"content", r.content}};
        if (!r.reasoning.empty()) a["reasoning_content"] = r.reasoning;
        messages.push_back(a);
        report(r.stats);
    };
    if (p.has("--prompt")) {
        turn(p.str("--prompt"));
        return 0;
    }
    fprintf(stderr, "tansy chat: %s (empty line or Ctrl-D to quit)\n", te.model_dir().c_str());
    std::string line;
    for (;;) {
        fputs(st.tty ? "\033[1m> \033[0m" : "> ", stdout);
        fflush(stdout);
        if (!std::getline(std::cin, line) || line.empty()) break;
        turn(line);
    }
    return 0;
}

}  // namespace tansy
