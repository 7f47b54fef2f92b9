// Request-level checks of `tansy serve` over HTTP (issue 29), on a synthetic two-layer model of the tiny config
// (CPU backend): the model name is checked, unknown /v1/models/ID answers model_not_found, deep JSON and bad
// logit_bias are 400s, and a logit_bias reaches the sampler. Skipped when tansy is built without cpp-httplib.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include <nlohmann/json.hpp>

#include "server/http_client.h"
#include "server/server.h"
#include "test_util.h"

namespace tansy {
namespace {

using json = nlohmann::json;

const std::string TINY_CONFIG = std::string(TANSY_SOURCE_DIR) + "/models/tiny-chat-q4/config.json";

using reply = tansy::test::json_reply;

// A server of a synthetic two-layer model of the tiny config on a free port, quiet.
serve_options tiny_synthetic() {
    serve_options o;
    o.engine.threads = 1;
    o.synthetic.config = TINY_CONFIG;
    o.synthetic.layers = 2;
    o.http.port = 0;
    o.sched.max_batch = 2;
    o.ctx_size = 256;
    o.progress = o.log_requests = false;
    return o;
}

class served : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        if (!http_available()) return;
        serve_options o = tiny_synthetic();
        o.model_aliases = {"alias-one"};
        srv_ = new server(o);
        srv_->start();
        srv_->load();
    }
    static void TearDownTestSuite() {
        if (!srv_) return;
        srv_->request_stop();
        srv_->wait();
        delete srv_;
        srv_ = nullptr;
    }
    void SetUp() override {
        if (!http_available()) GTEST_SKIP() << "built without the HTTP server (no Asio headers)";
    }

    reply post(const std::string& path, const std::string& body) { return tansy::test::post_json(srv_->port(), path, body); }
    reply get(const std::string& path) { return tansy::test::get_json(srv_->port(), path); }
    static json chat(json extra = json::object()) {
        json b = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}, {"temperature", 0}};
        b.update(extra);
        return b;
    }

    static server* srv_;
};
server* served::srv_ = nullptr;

const char* SERVED = "synthetic-tiny-chat-q4";

TEST_F(served, model_is_checked) {
    EXPECT_EQ(post("/v1/chat/completions", chat().dump()).status, 200) << "no model: served";
    EXPECT_EQ(post("/v1/chat/completions", chat({{"model", SERVED}}).dump()).status, 200);
    EXPECT_EQ(post("/v1/chat/completions", chat({{"model", "alias-one"}}).dump()).status, 200);
    const reply r = post("/v1/chat/completions", chat({{"model", "gpt-4o"}}).dump());
    EXPECT_EQ(r.status, 404);
    EXPECT_EQ(r.body["error"]["code"], "model_not_found");
    EXPECT_EQ(r.body["error"]["type"], "invalid_request_error");
    EXPECT_NE(r.body["error"]["message"].get<std::string>().find("gpt-4o"), std::string::npos);
    const reply c = post("/v1/completions", json{{"prompt", "hi"}, {"max_tokens", 1}, {"model", "other"}}.dump());
    EXPECT_EQ(c.status, 404);
    EXPECT_EQ(c.body["error"]["code"], "model_not_found");
}

TEST_F(served, models_by_id) {
    const reply ok = get(std::string("/v1/models/") + SERVED);
    EXPECT_EQ(ok.status, 200);
    EXPECT_EQ(ok.body["id"], SERVED);
    EXPECT_EQ(get("/v1/models/alias-one").body["id"], "alias-one");
    const reply r = get("/v1/models/no-such-model");
    EXPECT_EQ(r.status, 404);
    EXPECT_EQ(r.body["error"]["code"], "model_not_found");
    EXPECT_EQ(get("/v1/nothing").body["error"]["code"], "unknown_url");
}

TEST_F(served, deep_json_is_a_400_and_the_server_lives_on) {
    const int n = 100000;
    const std::string body = R"({"messages": [{"role": "user", "content": "hi"}], "x": )" + std::string(n, '[') +
                             std::string(n, ']') + R"(, "max_tokens": 1})";
    const reply r = post("/v1/chat/completions", body);
    EXPECT_EQ(r.status, 400);
    EXPECT_EQ(r.body["error"]["code"], "json_too_deep");
    EXPECT_EQ(get("/health").status, 200);
}

TEST_F(served, logit_bias_reaches_the_sampler) {
    const int64_t vocab = srv_->eng().n_valid_tokens();
    const reply bad = post("/v1/chat/completions", chat({{"logit_bias", {{std::to_string(vocab), 1}}}}).dump());
    EXPECT_EQ(bad.status, 400);
    EXPECT_EQ(bad.body["error"]["param"], "logit_bias");
    // +100 on one token: every generated token is that one (usage counts them; logprobs names them)
    const int forced = 300;
    const reply r = post("/v1/completions", json{{"prompt", "hello"}, {"max_tokens", 4}, {"temperature", 0},
                                                 {"ignore_eos", true}, {"logprobs", 0},
                                                 {"logit_bias", {{std::to_string(forced), 100}}}}
                                                .dump());
    ASSERT_EQ(r.status, 200) << r.body.dump();
    const json& toks = r.body["choices"][0]["logprobs"]["tokens"];
    ASSERT_EQ(toks.size(), 4u);
    for (const json& t : toks) EXPECT_EQ(t, toks[0]);
}

// The shutdown log counted only the scheduler's sequences ("0 running" while responses were still being sent):
// in_flight() counts a request from its handler's start to its response's end.
TEST_F(served, requests_in_flight_are_counted) {
    EXPECT_EQ(srv_->in_flight(), 0);
    http_client c("127.0.0.1", srv_->port(), 60);
    std::string err;
    int seen = -1;
    const std::string body = chat({{"stream", true}, {"max_tokens", 4}, {"ignore_eos", true}}).dump();
    ASSERT_EQ(c.post("/v1/chat/completions", body, [&](std::string_view) {
        if (seen < 0) seen = srv_->in_flight();  // the first event: the request is surely in flight
        return true;
    }, &err), 200) << err;
    EXPECT_EQ(seen, 1);
    for (int i = 0; i < 100 && srv_->in_flight() != 0; i++) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_EQ(srv_->in_flight(), 0);
}

// A schema the compiler refuses is a 400 naming the field as the endpoint names it.
TEST_F(served, schema_errors_name_the_endpoints_field) {
    const json bad_schema = {{"type", "string"}, {"pattern", "^a+$"}};
    const reply c = post("/v1/chat/completions",
                         chat({{"response_format", {{"type", "json_schema"},
                                                    {"json_schema", {{"name", "s"}, {"schema", bad_schema}, {"strict", true}}}}}})
                             .dump());
    EXPECT_EQ(c.status, 400);
    EXPECT_EQ(c.body["error"]["param"], "response_format");
    const reply r = post("/v1/responses", json{{"input", "hi"}, {"max_output_tokens", 2},
                                               {"text", {{"format", {{"type", "json_schema"}, {"name", "s"},
                                                                     {"schema", bad_schema}, {"strict", true}}}}}}
                                              .dump());
    EXPECT_EQ(r.status, 400);
    EXPECT_EQ(r.body["error"]["param"], "text.format");
}

// --strict-api: an unknown field is a 400 naming it, on every completion endpoint; documented no-ops still pass.
TEST(served_strict, unknown_fields_are_refused) {
    if (!http_available()) GTEST_SKIP() << "built without the HTTP server (no Asio headers)";
    serve_options o = tiny_synthetic();
    o.strict_api = true;
    server srv(o);
    srv.start();
    srv.load();
    const json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}, {"temperature", 0}};
    json typo = chat;
    typo["max_token"] = 5;
    const reply r = tansy::test::post_json(srv.port(), "/v1/chat/completions", typo.dump());
    EXPECT_EQ(r.status, 400);
    EXPECT_EQ(r.body["error"]["param"], "max_token");
    EXPECT_EQ(r.body["error"]["code"], "unknown_parameter");
    json noop = chat;
    noop["user"] = "u-1";
    noop["metadata"] = json::object();
    EXPECT_EQ(tansy::test::post_json(srv.port(), "/v1/chat/completions", noop.dump()).status, 200);
    const reply c = tansy::test::post_json(srv.port(), "/v1/completions",
                                           json{{"prompt", "hi"}, {"max_tokens", 1}, {"frobnicate", true}}.dump());
    EXPECT_EQ(c.status, 400);
    EXPECT_EQ(c.body["error"]["param"], "frobnicate");
    const reply x = tansy::test::post_json(srv.port(), "/v1/responses",
                                           json{{"input", "hi"}, {"max_output_tokens", 2}, {"max_tokens", 2}}.dump());
    EXPECT_EQ(x.status, 400);
    EXPECT_EQ(x.body["error"]["param"], "max_tokens");
    srv.request_stop();
    srv.wait();
}

}  // namespace
}  // namespace tansy
