// Completion requests (/v1/chat/completions, /v1/completions, /v1/responses): the prompt and the token constraint
// built on the HTTP worker, one sequence per prompt submitted to the scheduler, and its events turned into the
// blocking answer or the SSE stream.
#include "server/server_internal.h"

#include <algorithm>
#include <limits>
#include <optional>

#include "tokenizer/chat_template.h"

namespace tansy {

namespace {

constexpr auto k_poll = std::chrono::milliseconds(100);  // how often a waiting worker checks its client

// tool_choice "none": ids that may never be sampled (the <tool_call> token), masked to -infinity rather than
// biased (a logit_bias of -100 is not a ban). The model could still spell "<tool_call>" out of ordinary tokens;
// with tools off the parser leaves such text in the content.
class ban_constraint final : public token_constraint {
  public:
    explicit ban_constraint(std::vector<int32_t> ids) : ids_(std::move(ids)) {}
    bool active() const override { return true; }
    void allow(uint32_t* words, int64_t n_valid, int64_t) override {
        allow_all(words, n_valid);
        for (int32_t id : ids_)
            if (id >= 0 && id < n_valid) words[id / 32] &= ~(1u << (id % 32));
    }
    void accept(int32_t) override {}

  private:
    std::vector<int32_t> ids_;
};

}  // namespace

std::vector<int32_t> server::state::build_prompt(const completion_request& r, size_t k, bool* thinking) {
    const completion_request::prompt_item* pi = r.chat ? nullptr : &r.prompts[k];
    std::vector<int32_t> ids;
    *thinking = false;
    try {
        if (r.chat) {
            chat_options co;
            co.kwargs = r.template_kwargs;
            co.system_anywhere = true;  // the API allows system/developer messages anywhere (issue 36)
            const ojson tools = r.tool_choice == tool_choice_mode::none ? ojson(nullptr) : r.tools;
            // only the template's own text may become special tokens: the client's is encoded as plain text
            const rendered_chat rc = render_chat_marked(r.messages, tools, co);
            const std::string& text = rc.text;
            // thinking is on exactly when the template opened <think> for the answer
            const std::string open = "<think>\n";
            *thinking = te->think_end() >= 0 && text.size() >= open.size() &&
                        text.compare(text.size() - open.size(), open.size(), open) == 0;
            ids = tok_pool->encode(text, rc.client);
        } else if (pi->is_ids) {
            for (int32_t id : pi->ids)
                if (id >= te->eng().n_valid_tokens())
                    throw api_error(400, strprintf("token id %d is outside the vocabulary", id), "prompt");
            ids = pi->ids;
        } else if (r.allow_special_tokens) {
            ids = tok_pool->encode(pi->text);
        } else {
            ids = tok_pool->encode(pi->text, {byte_range{0, pi->text.size()}});
        }
    } catch (const error& e) {
        std::string msg = e.what();
        if (msg.rfind("chat template: ", 0) == 0) msg.erase(0, 15);
        throw api_error(400, msg, r.chat ? "messages" : "prompt");
    }
    if (ids.empty()) throw api_error(400, "the prompt is empty", r.chat ? "messages" : "prompt");
    return ids;
}

std::unique_ptr<token_constraint> server::state::make_constraint(const completion_request& r, bool thinking,
                                                                int64_t max_tokens) {
    if (!r.chat) return nullptr;
    const int64_t reserve = std::clamp<int64_t>(max_tokens / 3, 8, 1024);
    const bool forced = r.tool_choice == tool_choice_mode::required || r.tool_choice == tool_choice_mode::named;
    const bool has_tools = r.tools.is_array() && !r.tools.empty() && r.tool_choice != tool_choice_mode::none;
    // tool calls constrained by their schemas: when forced, or offered next to a response_format (issue 36);
    // a response_format with tool_choice required / named applies to a later turn
    const bool tools = forced || (has_tools && r.json_mode);
    const bool json = r.json_mode && !forced;
    if (!tools && !json) {
        if (r.tool_choice == tool_choice_mode::none) {
            const int32_t open = te->tok().find("<tool_call>");
            if (open >= 0) return std::make_unique<ban_constraint>(std::vector<int32_t>{open});
        }
        return nullptr;
    }
    if (json && !tools && r.json_schema.is_null())
        return std::make_unique<json_object_constraint>(tokens, thinking, reserve);
    static const ojson k_any_object = {{"type", "object"}, {"additionalProperties", true}};
    const ojson* schema = !json ? nullptr : r.json_schema.is_null() ? &k_any_object : &r.json_schema;
    std::shared_ptr<const content_spec> spec;
    try {
        spec = build_content_spec(schema, r.json_schema_strict, r.tools,
                                  r.tool_choice == tool_choice_mode::named ? r.tool_name : "", tools,
                                  r.parallel_tool_calls);
    } catch (const schema_error& e) {
        const std::string msg = e.what();
        const bool tool = msg.rfind("tools[", 0) == 0;
        throw api_error(400, tool ? msg : "response_format.json_schema: " + msg, tool ? "tools" : "response_format");
    }
    return std::make_unique<schema_constraint>(tokens, thinking, reserve, std::move(spec));
}

// chat: /v1/chat/completions, or with `responses` /v1/responses (the same request path, its own wire format)
void server::state::handle_completion(const http_request& req, http_response& res, bool chat, bool responses) {
    const char* endpoint = responses ? "responses" : chat ? "chat" : "completions";
    auto j0 = std::make_shared<job>();
    in_flight++;
    j0->in_flight = &in_flight;  // the request counts once, until its first job (kept by all) goes
    j0->t0 = clock_t_::now();
    // one job per prompt: a chat request has one, a completions request one per prompt (issue 36)
    std::vector<std::shared_ptr<job>> jobs;  // submitted
    try {
        check_auth(req);
        if (stopping) throw api_error(503, "the server is shutting down", "", "shutting_down");
        if (!ready) throw api_error(503, "the model is still loading; retry shortly", "", "model_loading");
        std::optional<responses_request> rr;
        if (responses) rr = parse_responses_request(req.body, defaults, stored);
        completion_request r = responses ? std::move(rr->chat)
                               : chat    ? parse_chat_request(req.body, defaults)
                                         : parse_completion_request(req.body, defaults);
        if (!r.model.empty() && !serves(r.model)) throw model_not_found(r.model);
        if (opt.strict_api && !r.unknown_fields.empty())
            throw api_error(400, "Unrecognized request argument supplied: " + r.unknown_fields[0].substr(0, 64) +
                                     " (this server runs with --strict-api)",
                            r.unknown_fields[0].substr(0, 64), "unknown_parameter");
        for (const auto& [id, bias] : r.logit_bias)
            if (id >= te->eng().n_valid_tokens())
                throw api_error(400, strprintf("logit_bias names token id %d, outside the vocabulary of %lld tokens",
                                               id, (long long)te->eng().n_valid_tokens()), "logit_bias");
        const response_meta meta{new_id(responses ? "resp_" : chat ? "chatcmpl-" : "cmpl-"), unix_now(), opt.model_name};
        if (responses) {
            const bool keep = rr->store;
            j0->resp = std::make_shared<responses_writer>(std::move(*rr), meta, keep ? &stored : nullptr);
        }
        const size_t n_prompts = chat ? 1 : r.prompts.size();
        const char* prompt_param = responses ? "input" : chat ? "messages" : "prompt";
        // every prompt is built and checked before any is submitted
        std::vector<std::vector<int32_t>> prompts(n_prompts);
        std::vector<bool> thinking(n_prompts, false);
        for (size_t k = 0; k < n_prompts; k++) {
            bool th = false;
            prompts[k] = build_prompt(r, k, &th);
            thinking[k] = th;
            const int64_t P = (int64_t)prompts[k].size();
            if (P >= ctx || (r.max_tokens > 0 && P + r.max_tokens > ctx))
                throw api_error(400,
                                strprintf("This model's maximum context length is %lld tokens. However, you requested "
                                          "%lld tokens (%lld in the %s, %lld in the completion). Please reduce the "
                                          "length of the %s or completion.",
                                          (long long)ctx, (long long)(P + std::max<int64_t>(r.max_tokens, 0)),
                                          (long long)P, prompt_param,
                                          (long long)std::max<int64_t>(r.max_tokens, 0), prompt_param),
                                prompt_param, "context_length_exceeded");
        }
        for (size_t k = 0; k < n_prompts; k++) {
            std::shared_ptr<job> j = k == 0 ? j0 : std::make_shared<job>();
            const int64_t P = (int64_t)prompts[k].size();
            const int64_t max_tokens = r.max_tokens > 0 ? r.max_tokens : ctx - P;
            j->t0 = j0->t0;
            j->endpoint = endpoint;
            j->chat = chat;
            j->index = (int)k;
            j->meta = meta;
            j->stream = r.stream;
            j->include_usage = r.stream && r.include_usage;
            j->logprobs = r.logprobs;
            j->prompt_tokens = P;
            j->client_closed = req.client_closed;
            text_options to;
            to.chat = chat;
            to.thinking = thinking[k];
            to.tools = chat && r.tool_choice != tool_choice_mode::none && r.tools.is_array();
            to.tool_schemas = r.tools;
            to.stop = r.stop;
            j->text = std::make_unique<completion_text>(te->tok(), te->eos(), te->think_end(), to);

            sequence_request sr;
            static_cast<generation_params&>(sr) = r;
            sr.prompt = std::move(prompts[k]);
            sr.max_tokens = max_tokens;
            // several prompts with one seed: each its own stream of random numbers
            sr.sampling.seed = r.sampling.seed + (uint64_t)k * 0x9E3779B97F4A7C15ull;
            if (!r.ignore_eos) sr.stop_ids = te->eos();
            try {
                sr.constraint = make_constraint(r, thinking[k], max_tokens);
            } catch (const api_error& e) {  // a schema the compiler refuses: named as the request named it
                if (responses) throw as_responses_error(e);
                throw;
            }
            sr.sink = j->ch;
            j->seq_id = next_seq++;
            switch (sched->submit(j->seq_id, std::move(sr))) {
                case scheduler::submit_status::ok: break;
                case scheduler::submit_status::queue_full:
                    metrics.rejected("queue_full");
                    throw api_error(429, "the server is busy (request queue full); retry shortly", "", "rate_limit_exceeded");
                case scheduler::submit_status::shutting_down:
                    metrics.rejected("shutting_down");
                    throw api_error(503, "the server is shutting down", "", "shutting_down");
                case scheduler::submit_status::too_large:
                    metrics.rejected("too_large");
                    throw api_error(400, "this request needs more sequence memory than the server's budget "
                                         "(--state-memory); lower max_tokens", "max_tokens", "context_length_exceeded");
            }
            jobs.push_back(j);
        }
    } catch (const api_error& e) {
        cancel_all(jobs, 0);
        return reply_error(res, e, endpoint);
    } catch (const error& e) {
        cancel_all(jobs, 0);
        return reply_error(res, api_error(400, e.what()), endpoint);
    } catch (const std::exception& e) {
        cancel_all(jobs, 0);
        return reply_error(res, api_error(500, std::string("internal error: ") + e.what()), endpoint);
    }
    if (!j0->stream) return finish_blocking(jobs, res);
    res.content_type = "text/event-stream";
    res.headers.emplace_back("Cache-Control", "no-cache");
    res.headers.emplace_back("X-Accel-Buffering", "no");
    res.stream = [this, jobs](const http_write_fn& write) {
        try {
            run_stream(jobs, write);
        } catch (const std::exception& e) {
            cancel_all(jobs, 0);
            log_line(strprintf("%s stream failed: %s", jobs[0]->meta.id.c_str(), e.what()));
        }
    };
}

void server::state::cancel_all(const std::vector<std::shared_ptr<job>>& jobs, size_t from) {
    for (size_t k = from; k < jobs.size(); k++) sched->cancel(jobs[k]->seq_id);
}

// Moves the sequence's events through its text pipeline, calling `emit(delta, final)` for text that became
// visible; returns false when the client went away (the sequence is then cancelled).
template <class F>
bool server::state::pump(job& j, F&& emit) {
    auto last_check = clock_t_::now();
    for (;;) {
        result_channel::batch b;
        const bool got = j.ch->wait(b, k_poll);
        const auto now = clock_t_::now();
        if (!got || now - last_check >= k_poll) {
            last_check = now;
            if (j.client_closed && j.client_closed()) {
                sched->cancel(j.seq_id);
                metrics.disconnect();
                return false;
            }
        }
        text_delta d;
        for (const token_event& e : b.tokens) {
            if (!j.got_first) {
                j.got_first = true;
                j.t_first = e.t;
                metrics.ttft(secs(j.t0, e.t));
            } else {
                metrics.inter_token(secs(j.t_prev, e.t));
            }
            j.t_prev = e.t;
            j.text->push(e, d);
            if (j.text->stop_matched() && !j.cancel_sent) {
                sched->cancel(j.seq_id);  // the rest would be cut anyway
                j.cancel_sent = true;
            }
        }
        if (b.finish) {
            j.fin = *b.finish;
            j.text->finish(d);
            return emit(d, true);
        }
        if (!d.empty() && !emit(d, false)) {
            sched->cancel(j.seq_id);
            metrics.disconnect();
            return false;
        }
    }
}

// "stop" / "length" / "tool_calls", or "" with *err set when the sequence failed or was cut by shutdown.
std::string server::state::finish_reason_of(const job& j, api_error* err) const {
    std::string fr;
    if (j.text->stop_matched()) {
        fr = "stop";
    } else {
        switch (j.fin.reason) {
            case finish_reason::stop:
            case finish_reason::cancelled: fr = "stop"; break;
            case finish_reason::length: fr = "length"; break;
            case finish_reason::shutdown:
                *err = api_error(503, "the server shut down before the completion finished", "", "shutting_down");
                return "";
            case finish_reason::error:
                *err = api_error(500, "generation failed: " + j.fin.error);
                return "";
        }
    }
    if (fr == "stop" && j.chat && !j.text->tool_calls().empty()) fr = "tool_calls";
    return fr;
}

// A step's content tokens in the Responses API's shape (an array; empty when logprobs were not asked for).
ojson server::state::responses_logprobs(const job& j, const text_delta& d) const {
    if (j.logprobs < 0 || d.logprobs.empty()) return ojson::array();
    return chat_logprobs(te->tok(), d.logprobs)["content"];
}

// summed over the request's prompts, as OpenAI reports it
ojson server::state::usage_of(const std::vector<std::shared_ptr<job>>& jobs) {
    int64_t p = 0, c = 0, r = 0, cached = 0;
    for (const auto& j : jobs)
        p += j->prompt_tokens, c += j->text->completion_tokens(), r += j->text->reasoning_tokens(),
            cached += j->fin.cached_tokens;
    return usage_json(p, c, r, cached);
}

// Per sequence; the request is counted (status, latency) with its first job only.
void server::state::log_done(const job& j, int status, const std::string& finish) {
    const double total = secs(j.t0, clock_t_::now());
    const int64_t n = j.text->completion_tokens();
    const double gen_s = j.got_first ? secs(j.t_first, j.t_prev) : 0.0;
    if (j.index == 0) {
        metrics.request_done(j.endpoint, status);
        metrics.request_latency(total);
    }
    metrics.tokens(j.prompt_tokens, n);
    if (j.got_first && j.fin.prefill_s > 0) metrics.prompt_timing(j.fin.queue_s, j.fin.prefill_s);  // (its finish event came)
    log_line(strprintf("%s%s %d %s%s prompt=%lld gen=%lld (reasoning %lld) ttft=%.3fs (queue %.3fs, prompt steps "
                       "%.3fs) %.1f tok/s total=%.3fs finish=%s",
                       j.meta.id.c_str(), j.index ? strprintf("[%d]", j.index).c_str() : "", status, j.endpoint,
                       j.stream ? " stream" : "", (long long)j.prompt_tokens,
                       (long long)n, (long long)j.text->reasoning_tokens(), j.got_first ? secs(j.t0, j.t_first) : 0.0,
                       j.fin.queue_s, j.fin.prefill_s, n > 1 && gen_s > 0 ? (double)(n - 1) / gen_s : 0.0, total,
                       finish.c_str()));
}

void server::state::finish_blocking(const std::vector<std::shared_ptr<job>>& jobs, http_response& res) {
    ojson choices = ojson::array();
    for (size_t k = 0; k < jobs.size(); k++) {  // the sequences run together; their results are read in order
        job& j = *jobs[k];
        std::string text;
        const bool alive = pump(j, [&](text_delta& d, bool) {
            if (j.resp) j.resp->add(d.parsed, responses_logprobs(j, d));
            else if (j.logprobs >= 0) j.lp_tokens.insert(j.lp_tokens.end(), d.logprobs.begin(), d.logprobs.end());
            text += d.text;
            return true;
        });
        if (!alive) {  // nobody to answer; the status only shows in the log and metrics
            cancel_all(jobs, k + 1);
            res.status = 499;
            log_done(*jobs[0], 499, "client disconnected");
            return;
        }
        api_error err(500, "");
        const std::string fr = finish_reason_of(j, &err);
        if (fr.empty()) {
            cancel_all(jobs, k + 1);
            reply_error(res, err, j.endpoint, j.meta.id);
            return;
        }
        ojson lp = nullptr;
        if (j.logprobs >= 0)
            lp = j.chat ? chat_logprobs(te->tok(), j.lp_tokens) : completion_logprobs(te->tok(), j.lp_tokens, 0);
        if (j.resp) {
            j.resp->set_cached_tokens(j.fin.cached_tokens);
            res.body = dump(j.resp->finish(fr == "length", j.prompt_tokens, j.text->completion_tokens(),
                                           j.text->reasoning_tokens()));
        } else if (j.chat) {
            res.body = dump(chat_response(j.meta, j.text->reasoning(), j.text->content(), j.text->tool_calls(),
                                          j.call_ids, fr, usage_of(jobs), lp));
        } else {
            choices.push_back(completion_choice(j.index, text, fr, lp));
        }
        if (k > 0) log_done(j, 200, fr);
        if (k + 1 == jobs.size()) {
            if (!j.chat) res.body = dump(completion_response(j.meta, choices, usage_of(jobs)));
            log_done(*jobs[0], 200, fr);
        }
    }
}

void server::state::run_stream(const std::vector<std::shared_ptr<job>>& jobs, const http_write_fn& write) {
    job& j0 = *jobs[0];
    const bool opened = j0.resp ? write(j0.resp->begin())
                        : !j0.chat || write(sse(chat_chunk(j0.meta, {{"role", "assistant"}, {"content", ""}}, "", nullptr,
                                                           j0.include_usage)));
    if (!opened) {
        cancel_all(jobs, 0);
        metrics.disconnect();
        log_done(j0, 499, "client disconnected");
        return;
    }
    // Several prompts: their sequences run together; the choices are sent one after the other.
    for (size_t k = 0; k < jobs.size(); k++) {
        job& j = *jobs[k];
        auto send_delta = [&](const text_delta& d) {
            if (j.resp) {
                const std::string events = j.resp->add(d.parsed, responses_logprobs(j, d));
                return events.empty() || write(events);
            }
            ojson lp = nullptr;
            if (j.logprobs >= 0 && !d.logprobs.empty()) {
                lp = j.chat ? chat_logprobs(te->tok(), d.logprobs) : completion_logprobs(te->tok(), d.logprobs, j.text_offset);
            }
            if (j.chat) {
                const ojson delta = chat_delta(d.parsed, j.call_ids);
                if (delta.empty() && lp.is_null()) return true;
                return write(sse(chat_chunk(j.meta, delta, "", lp, j.include_usage)));
            }
            j.text_offset += (int64_t)d.text.size();
            if (d.text.empty() && lp.is_null()) return true;
            return write(sse(completion_chunk(j.meta, d.text, "", lp, j.include_usage, j.index)));
        };
        bool final_ok = true;
        const bool alive = pump(j, [&](text_delta& d, bool) {
            if (!send_delta(d)) return final_ok = false;
            return true;
        });
        if (!alive || !final_ok) {
            cancel_all(jobs, k + 1);
            log_done(j0, 499, "client disconnected");
            return;
        }
        api_error err(500, "");
        const std::string fr = finish_reason_of(j, &err);
        if (fr.empty()) {
            cancel_all(jobs, k + 1);
            // the status line is long gone: the error travels as an event, as OpenAI's API does
            if (j.resp) {
                write(j.resp->failed(err));
            } else {
                write("data: " + error_body(err) + "\n\n");
                write("data: [DONE]\n\n");
            }
            log_done(j0, err.status, err.what());
            return;
        }
        if (j.resp) {
            j.resp->set_cached_tokens(j.fin.cached_tokens);
            write(j.resp->finish_events(fr == "length", j.prompt_tokens, j.text->completion_tokens(),
                                        j.text->reasoning_tokens()));
        } else if (j.chat) {
            write(sse(chat_chunk(j.meta, ojson::object(), fr, nullptr, j.include_usage)));
        } else {
            write(sse(completion_chunk(j.meta, "", fr, nullptr, j.include_usage, j.index)));
        }
        if (k > 0) log_done(j, 200, fr);
        if (k + 1 == jobs.size()) {
            if (j.include_usage && !j.resp) write(sse(usage_chunk(j.meta, j.chat, usage_of(jobs))));
            if (!j.resp) write("data: [DONE]\n\n");  // the Responses stream ends with response.completed
            log_done(j0, 200, fr);
        }
    }
}

}  // namespace tansy
