// tansy run: one prompt, or an interactive chat, streamed as it is generated.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/line_reader.h"
#include "core/check.h"
#include "model/config.h"
#include "runtime/prefix_cache.h"
#include "runtime/text_engine.h"
#include "tokenizer/chat_template.h"

namespace tansy {

namespace {

using ojson = nlohmann::ordered_json;

// Where a turn's text goes: the answer to stdout; the reasoning dimmed on a terminal, else to stderr (a pipe
// then carries the answer alone), or nowhere with --hide-reasoning.
struct run_style {
    bool tty = false;
    bool hide_reasoning = false;
    const char* dim() const { return tty ? "\033[2m" : ""; }
    const char* reset() const { return tty ? "\033[0m" : ""; }
    FILE* reasoning_out() const { return hide_reasoning ? nullptr : tty ? stdout : stderr; }
};

// Streams one assistant turn: reasoning (before </think>), then the answer. Returns the answer text and the
// reasoning separately, for the chat history. Ctrl-C (interrupted()) ends the turn after the current token.
struct turn_result {
    std::string reasoning, content;
    generation_stats stats;
    bool stopped = false;  // by Ctrl-C
};

turn_result stream_turn(text_engine& te, const std::vector<int32_t>& prompt, const generation_request& base,
                        bool thinking, const run_style& st, prefix_cache* cache = nullptr) {
    generation_request req = base;
    req.prompt = prompt;
    req.stop_ids = te.eos();
    auto seq = te.eng().new_sequence((int64_t)prompt.size() + req.max_tokens);
    stream_decoder dec(te.tok(), /*skip_special=*/true);
    turn_result r;
    bool in_reasoning = thinking && te.think_end() >= 0;
    bool answer_started = false;  // the answer follows "</think>\n\n": its leading newlines are not shown
    FILE* rout = st.reasoning_out();
    auto show = [&](const std::string& piece, bool reasoning) {
        FILE* f = reasoning ? rout : stdout;
        if (!f || piece.empty()) return;
        fputs(piece.c_str(), f);
        fflush(f);
    };
    if (in_reasoning && rout) fputs(st.dim(), rout);
    auto gen = [&](const std::function<bool(int32_t)>& f) {
        return cache ? te.eng().generate_cached(*cache, *seq, req, f) : te.eng().generate(*seq, req, f);
    };
    r.stats = gen([&](int32_t id) {
        if (interrupted()) {
            r.stopped = true;
            return false;
        }
        if (id == te.think_end() && in_reasoning) {
            std::string tail = dec.flush();
            r.reasoning += tail;
            show(tail, true);
            if (rout) {
                fputs(st.reset(), rout);
                if (rout != stdout) fputs("\n", rout);
            }
            in_reasoning = false;
            return true;
        }
        if (std::find(te.eos().begin(), te.eos().end(), id) != te.eos().end()) return true;
        std::string piece = dec.push(id);
        (in_reasoning ? r.reasoning : r.content) += piece;
        if (!in_reasoning && !answer_started) {
            piece.erase(0, piece.find_first_not_of('\n') == std::string::npos ? piece.size() : piece.find_first_not_of('\n'));
            answer_started = !piece.empty();
        }
        show(piece, in_reasoning);
        return true;
    });
    std::string tail = dec.flush();
    (in_reasoning ? r.reasoning : r.content) += tail;
    show(tail, in_reasoning);
    if (in_reasoning && rout) fputs(st.reset(), rout);
    if (r.stopped) fputs(st.tty ? "\033[2m [stopped]\033[0m" : " [stopped]", stdout);
    fputs("\n", stdout);
    fflush(stdout);
    // the answer starts after "</think>\n\n" in the real format
    while (!r.content.empty() && r.content.front() == '\n') r.content.erase(0, 1);
    while (!r.reasoning.empty() && (r.reasoning.back() == '\n')) r.reasoning.pop_back();
    return r;
}

void report(const generation_stats& s) {
    fprintf(stderr, "tansy: prompt %lld tokens (%lld cached) in %.3f s (time to first token, %.0f tok/s), generated %lld tokens at %.1f tok/s\n",
            (long long)s.prompt_tokens, (long long)s.cached_tokens, s.prefill_s,
            (s.prompt_tokens - s.cached_tokens) / std::max(s.prefill_s, 1e-9), (long long)s.generated,
            s.generated > 1 ? (s.generated - 1) / std::max(s.decode_s, 1e-9) : 0.0);
}

constexpr const char* k_chat_help =
    "  /exit            end the chat (also Ctrl-D, or Ctrl-C twice at the prompt)\n"
    "  /reset           forget the conversation (the system message stays)\n"
    "  /system TEXT     set the system message (and forget the conversation)\n"
    "  /think on|off    thinking before answering\n"
    "  /save FILE       write the conversation as JSON ({\"messages\": [...]})\n"
    "  a line ending in \\ continues on the next line; Ctrl-C stops an answer\n";

}  // namespace

int cmd_run(int argc, char** argv) {
    arg_parser p("run", "[--prompt TEXT | --chat] [options]",
                 "Generates from a prompt and streams the text as it comes. The prompt is rendered with the model's\n"
                 "chat template as one user turn (--raw: used as is). Reasoning (<think>...</think>) is shown dimmed,\n"
                 "then the answer; generation stops at the model's end-of-turn tokens (generation_config.json).\n"
                 "--chat starts an interactive conversation: line editing and history (arrow keys), /help for its\n"
                 "commands; Ctrl-C stops the answer being written, Ctrl-D (or Ctrl-C twice at the prompt) ends it.\n"
                 "When stdout is not a terminal, the reasoning goes to stderr and stdout carries the answer alone.");
    add_engine_options(p);
    p.option("--prompt", "TEXT", "the user's message (or the raw text with --raw)")
        .option("--chat", "", "interactive multi-turn chat")
        .option("--raw", "", "no chat template: continue the prompt text")
        .option("--system", "TEXT", "system message")
        .option("--tools", "FILE", "tool definitions: a JSON array, or an object with \"tools\" (and \"system\")")
        .option("--no-think", "", "thinking off (enable_thinking = false)")
        .option("--hide-reasoning", "", "do not show the reasoning (it still happens; --no-think turns it off)")
        .option("--no-prefix-cache", "", "--chat: prefill every turn's whole conversation (default: each turn restores\n"
                                         "                            the previous ones from a prefix cache and prefills only the new message)")
        .option("--verbose", "", "after each answer: prompt tokens, time to first token, tokens/s (stderr)")
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
    bool thinking = !p.has("--no-think");
    const bool verbose = p.has("--verbose");
    text_engine te(engine_options_from(p));
    run_style st;
    st.tty = isatty(1);
    st.hide_reasoning = p.has("--hide-reasoning");

    if (p.has("--raw")) {
        std::vector<int32_t> ids = te.tok().encode(p.str("--prompt"));
        if (ids.empty()) fail("run: the prompt is empty");
        const turn_result r = stream_turn(te, ids, req, false, st);
        if (verbose) report(r.stats);
        return 0;
    }
    // --chat: one prefix cache for the conversation (runtime/prefix_cache.h), as `tansy serve` uses it
    std::unique_ptr<prefix_cache> cache;
    if (p.has("--chat") && !p.has("--no-prefix-cache")) {
        prefix_cache_options po;
        po.budget = size_t(1) << 30;
        po.turn_token = te.tok().find("<|im_start|>");
        po.min_tokens = 16;  // one conversation: even a short turn is worth its checkpoint
        po.min_mark_gap = 16;
        cache = std::make_unique<prefix_cache>(te.eng().be(), po);
    }
    ojson messages = ojson::array();
    auto restart = [&] {
        messages = ojson::array();
        if (!system.empty()) messages.push_back({{"role", "system"}, {"content", system}});
    };
    restart();
    chat_options co;
    co.kwargs = ojson::object();
    auto turn = [&](const std::string& user) {
        co.kwargs["enable_thinking"] = thinking;
        messages.push_back({{"role", "user"}, {"content", user}});
        const std::string text = render_chat(messages, tools, co);
        turn_result r = stream_turn(te, te.tok().encode(text), req, thinking, st, cache.get());
        ojson a = {{"role", "assistant"}, {"content", r.content}};
        if (!r.reasoning.empty()) a["reasoning_content"] = r.reasoning;
        messages.push_back(a);
        if (verbose) report(r.stats);
    };
    if (p.has("--prompt")) {
        turn(p.str("--prompt"));
        return 0;
    }

    install_interrupt_handler();
    line_reader in(isatty(0));
    fprintf(stderr, "tansy chat: %s (/help for commands; Ctrl-C stops an answer; Ctrl-D or Ctrl-C twice exits)\n",
            te.model_dir().c_str());
    int interrupts = 0;  // Ctrl-C at the prompt in a row
    for (;;) {
        clear_interrupt();
        std::string line;
        const line_reader::status got = in.read("> ", line);
        if (got == line_reader::status::end) break;
        if (got == line_reader::status::interrupt) {
            if (++interrupts >= 2) break;
            fputs("\n(Ctrl-C again, or Ctrl-D, to exit)\n", stderr);
            continue;
        }
        interrupts = 0;
        while (!line.empty() && line.back() == '\\') {  // continued on the next line
            line.back() = '\n';
            std::string more;
            if (in.read("... ", more) != line_reader::status::line) break;
            line += more;
        }
        if (line.find_first_not_of(" \t\n") == std::string::npos) continue;
        in.remember(line);
        if (line[0] != '/') {
            turn(line);
            continue;
        }
        const size_t sp = line.find(' ');
        const std::string cmd = line.substr(0, sp), arg = sp == std::string::npos ? "" : line.substr(sp + 1);
        if (cmd == "/exit" || cmd == "/quit") {
            break;
        } else if (cmd == "/reset") {
            restart();
            fputs("(conversation cleared)\n", stderr);
        } else if (cmd == "/system") {
            system = arg;
            restart();
            fputs(system.empty() ? "(no system message; conversation cleared)\n" : "(system message set; conversation cleared)\n", stderr);
        } else if (cmd == "/think" && (arg == "on" || arg == "off")) {
            thinking = arg == "on";
            fprintf(stderr, "(thinking %s)\n", arg.c_str());
        } else if (cmd == "/save" && !arg.empty()) {
            FILE* f = fopen(arg.c_str(), "w");
            if (!f) {
                fprintf(stderr, "(cannot write %s: %s)\n", arg.c_str(), strerror(errno));
                continue;
            }
            const std::string js = ojson{{"messages", messages}}.dump(2) + "\n";
            const bool ok = fwrite(js.data(), 1, js.size(), f) == js.size();
            fclose(f);
            fprintf(stderr, ok ? "(saved %s)\n" : "(writing %s failed)\n", arg.c_str());
        } else {
            fprintf(stderr, "%s%s", cmd == "/help" ? "" : "(unknown command; these are known)\n", k_chat_help);
        }
    }
    return 0;
}

}  // namespace tansy
