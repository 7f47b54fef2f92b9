#include "server/text_stream.h"

#include <algorithm>

namespace tansy {

std::string_view token_bytes_or_unknown(const tokenizer& tok, int32_t id) {
    return id >= 0 && id < tok.size() ? tok.token_bytes(id) : UNKNOWN_TOKEN_TEXT;
}

stop_matcher::stop_matcher(std::vector<std::string> stops) {
    for (std::string& s : stops)
        if (!s.empty()) stops_.push_back(std::move(s));
}

std::string stop_matcher::push(std::string_view text) {
    if (matched_) return "";
    held_ += text;
    size_t first = std::string::npos;
    for (const std::string& s : stops_) first = std::min(first, held_.find(s));
    if (first != std::string::npos) {
        matched_ = true;
        std::string out = held_.substr(0, first);
        held_.clear();
        return out;
    }
    // hold back the longest tail that is the start of a stop string
    size_t hold = 0;
    for (const std::string& s : stops_)
        for (size_t k = std::min(held_.size(), s.size() - 1); k > hold; k--)
            if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
                hold = k;
                break;
            }
    std::string out = held_.substr(0, held_.size() - hold);
    held_.erase(0, held_.size() - hold);
    return out;
}

std::string stop_matcher::flush() {
    std::string out;
    if (!matched_) out.swap(held_);
    held_.clear();
    return out;
}

// Adds a parser step to what a delta already holds (pieces of the same call are merged).
static void append(parsed_delta& to, parsed_delta d) {
    to.reasoning += d.reasoning;
    to.content += d.content;
    for (tool_call_delta& t : d.tool_calls) {
        if (!to.tool_calls.empty() && to.tool_calls.back().index == t.index && t.name.empty())
            to.tool_calls.back().arguments += t.arguments;
        else
            to.tool_calls.push_back(std::move(t));
    }
}

completion_text::completion_text(const tokenizer& tok, std::vector<int32_t> eos, int32_t think_end, text_options opt)
    : tok_(tok),
      eos_(std::move(eos)),
      think_end_(think_end),
      opt_(std::move(opt)),
      dec_(tok, /*skip_special=*/true),
      stop_(opt_.stop),
      parser_(output_parser_options{opt_.thinking, opt_.tools, opt_.tool_schemas}),
      in_reasoning_(opt_.chat && opt_.thinking) {}

void completion_text::emit(const std::string& s, text_delta& out) {
    if (s.empty()) return;
    if (!opt_.chat) {
        text_ += s;
        out.text += s;
        return;
    }
    emit_parsed(parser_.push(s), out);
}

// Chat: the parser's step with its content run through the stop strings.
void completion_text::emit_parsed(parsed_delta d, text_delta& out) {
    if (stop_.matched()) return;
    parsed_delta v;
    v.reasoning = std::move(d.reasoning);
    v.content = stop_.push(d.content);
    if (!stop_.matched() && !d.tool_calls.empty()) {
        v.content += stop_.flush();  // a call ends the content: what was held for a possible stop string is text
        for (tool_call_delta& t : d.tool_calls) {
            if ((size_t)t.index >= calls_.size()) calls_.resize((size_t)t.index + 1);
            if (!t.name.empty()) calls_[(size_t)t.index].name = t.name;
            calls_[(size_t)t.index].arguments += t.arguments;
        }
        v.tool_calls = std::move(d.tool_calls);
    }
    reasoning_ += v.reasoning;
    content_ += v.content;
    append(out.parsed, std::move(v));
}

void completion_text::push(const token_event& e, text_delta& out) {
    if (stop_.matched()) return;
    n_tokens_++;
    const bool reasoning = in_reasoning_;
    if (in_reasoning_) {
        n_reasoning_++;
        if (e.id == think_end_) in_reasoning_ = false;
    }
    if (std::find(eos_.begin(), eos_.end(), e.id) != eos_.end()) return;  // the end of the turn is not text
    // completions: every token's log-prob; chat: the answer's only (held until its text shows, see below)
    if (!opt_.chat) out.logprobs.push_back(e);
    else if (!reasoning && !logprobs_closed_) held_logprobs_.push_back(e);
    const size_t shown = content_.size();
    // chat: stop strings apply after the parser (emit_parsed); completions: to the text here
    auto cut = [&](std::string s) { return opt_.chat ? s : stop_.push(s); };
    if (e.id < 0 || e.id >= tok_.size()) {  // a synthetic model's id: ends any partial character
        emit(cut(dec_.flush() + std::string(UNKNOWN_TOKEN_TEXT)), out);
    } else {
        emit(cut(dec_.push(e.id)), out);
    }
    if (opt_.chat) settle_logprobs(content_.size() > shown, out);
}

// Chat log-probs line up with message.content: a token's entry is reported once the text it started shows as
// content (the parser and the stop strings may hold text back), and dropped when that text turns out to be
// tool-call markup or lies past a stop string. Reasoning tokens and tool calls have none (as OpenAI's).
void completion_text::settle_logprobs(bool content_grew, text_delta& out) {
    if (!calls_.empty() || stop_.matched()) {
        held_logprobs_.clear();
        logprobs_closed_ = true;
        return;
    }
    if (!content_grew) return;
    out.logprobs.insert(out.logprobs.end(), held_logprobs_.begin(), held_logprobs_.end());
    held_logprobs_.clear();
}

void completion_text::finish(text_delta& out) {
    if (!opt_.chat) {
        if (!stop_.matched()) emit(stop_.push(dec_.flush()), out);
        emit(stop_.flush(), out);
        return;
    }
    if (stop_.matched()) return;
    const size_t shown = content_.size();
    emit(dec_.flush(), out);
    emit_parsed(parser_.finish(), out);
    if (stop_.matched()) return settle_logprobs(false, out);
    parsed_delta rest;
    rest.content = stop_.flush();
    content_ += rest.content;
    append(out.parsed, std::move(rest));
    settle_logprobs(content_.size() > shown, out);
    held_logprobs_.clear();  // tokens whose text never showed (trailing whitespace the parser dropped)
}

}  // namespace tansy
