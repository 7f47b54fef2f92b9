// llama.cpp's utility endpoints on `tansy serve` over HTTP: POST /tokenize, POST /detokenize, GET /props, on a
// synthetic two-layer model of the tiny config with the tiny model's tokenizer (CPU backend); and their API-key
// check. Skipped when tansy is built without its HTTP server.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "server/http_client.h"
#include "server/server.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace tansy {
namespace {

using json = nlohmann::json;

const std::string TINY_DIR = std::string(TANSY_SOURCE_DIR) + "/models/tiny-chat-q4";

using reply = tansy::test::json_reply;

server* start_server(const std::string& api_key) {
    serve_options o;
    o.engine.threads = 1;
    o.engine.model_dir = TINY_DIR;  // the tokenizer's directory
    o.synthetic.config = TINY_DIR + "/config.json";
    o.synthetic.layers = 2;
    o.http.port = 0;
    o.sched.max_batch = 2;
    o.ctx_size = 256;
    o.api_key = api_key;
    o.progress = o.log_requests = false;
    auto* s = new server(o);
    s->start();
    s->load();
    return s;
}

void stop_server(server*& s) {
    if (!s) return;
    s->request_stop();
    s->wait();
    delete s;
    s = nullptr;
}

// One request with a bearer token over a raw socket (http_client sends no Authorization header): the status.
int status_with_key(int port, const std::string& method, const std::string& path, const std::string& key,
                    const std::string& body = "") {
    const int fd = tansy::test::connect_loopback(port);
    if (fd < 0) return -1;
    const std::string req = method + " " + path + " HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key +
                            "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                            "\r\nConnection: close\r\n\r\n" + body;
    if (send(fd, req.data(), req.size(), 0) != (ssize_t)req.size()) {
        close(fd);
        return -1;
    }
    std::string out;
    char buf[4096];
    for (ssize_t n; (n = recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, (size_t)n);
    close(fd);
    return out.rfind("HTTP/1.1 ", 0) == 0 ? std::atoi(out.c_str() + 9) : -1;
}

class utility_endpoints : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        if (http_available()) srv_ = start_server("");
    }
    static void TearDownTestSuite() { stop_server(srv_); }
    void SetUp() override {
        if (!http_available()) GTEST_SKIP() << "built without the HTTP server";
    }

    reply post(const std::string& path, const std::string& body) { return tansy::test::post_json(srv_->port(), path, body); }
    reply get(const std::string& path) { return tansy::test::get_json(srv_->port(), path); }

    static server* srv_;
};
server* utility_endpoints::srv_ = nullptr;

TEST_F(utility_endpoints, tokenize_matches_the_tokenizer) {
    const tokenizer tok = tokenizer::load(TINY_DIR);
    const std::string text = "Hello world, 世界!";
    reply r = post("/tokenize", json{{"content", text}}.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    const std::vector<int32_t> want = tok.encode(text);
    EXPECT_EQ(r.body["tokens"].get<std::vector<int32_t>>(), want);
    // add_special is accepted (Qwen has no BOS to add)
    r = post("/tokenize", json{{"content", text}, {"add_special", true}}.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.body["tokens"].get<std::vector<int32_t>>(), want);
    // special-token text is one id by default, plain text with parse_special false
    r = post("/tokenize", json{{"content", "<|im_start|>"}}.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.body["tokens"], json::array({tok.find("<|im_start|>")}));
    r = post("/tokenize", json{{"content", "<|im_start|>"}, {"parse_special", false}}.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_GT(r.body["tokens"].size(), 1u) << r.body;
    r = post("/tokenize", json{{"content", ""}}.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.body["tokens"], json::array());
}

TEST_F(utility_endpoints, tokenize_with_pieces) {
    const std::string text = "Hello world";
    reply r = post("/tokenize", json{{"content", text}, {"with_pieces", true}}.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    std::string joined;
    for (const json& t : r.body["tokens"]) {
        ASSERT_TRUE(t["id"].is_number_integer()) << t;
        ASSERT_TRUE(t["piece"].is_string()) << t;
        joined += t["piece"].get<std::string>();
    }
    EXPECT_EQ(joined, text);
    // a character split over tokens: pieces that are not UTF-8 on their own come as byte values
    const tokenizer tok = tokenizer::load(TINY_DIR);
    const std::string rare = "\xF0\x9F\xA6\x80";  // U+1F980, split by a small vocabulary
    r = post("/tokenize", json{{"content", rare}, {"with_pieces", true}}.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    std::string bytes;
    for (const json& t : r.body["tokens"]) {
        if (t["piece"].is_string()) bytes += t["piece"].get<std::string>();
        else for (const json& b : t["piece"]) bytes += (char)b.get<int>();
    }
    EXPECT_EQ(bytes, rare);
}

TEST_F(utility_endpoints, detokenize_round_trips_and_checks_ids) {
    const std::string text = "Hello world, 世界!";
    reply t = post("/tokenize", json{{"content", text}}.dump());
    ASSERT_EQ(t.status, 200) << t.body;
    reply r = post("/detokenize", json{{"tokens", t.body["tokens"]}}.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.body["content"], text);
    r = post("/detokenize", R"({"tokens": []})");
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.body["content"], "");
    const int64_t vocab = tokenizer::load(TINY_DIR).size();
    for (const std::string& bad : {json{{"tokens", {1, -1}}}.dump(), json{{"tokens", {vocab}}}.dump(),
                                   std::string(R"({"tokens": ["a"]})"), std::string(R"({"tokens": 5})"),
                                   std::string(R"({"content": "x"})"), std::string("{"), std::string("[]")}) {
        r = post("/detokenize", bad);
        EXPECT_EQ(r.status, 400) << bad << " -> " << r.body;
        EXPECT_TRUE(r.body["error"]["message"].is_string()) << r.body;
    }
    r = post("/detokenize", json{{"tokens", {vocab + 5}}}.dump());
    EXPECT_NE(r.body["error"]["message"].get<std::string>().find(std::to_string(vocab + 5)), std::string::npos);
    for (const std::string& bad : {std::string(R"({"content": 3})"), std::string(R"({"content": "x", "with_pieces": 1})"),
                                   std::string("")}) {
        r = post("/tokenize", bad);
        EXPECT_EQ(r.status, 400) << bad << " -> " << r.body;
    }
}

TEST_F(utility_endpoints, props_describe_the_server) {
    reply r = get("/props");
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.body["model"], "synthetic-tiny-chat-q4");
    EXPECT_EQ(r.body["model_path"], TINY_DIR);
    EXPECT_EQ(r.body["n_ctx"], 256);
    EXPECT_EQ(r.body["total_slots"], 2);
    EXPECT_EQ(r.body["backend"], "cpu");
    EXPECT_TRUE(r.body["device"].is_string()) << r.body;
    EXPECT_EQ(r.body["version"].get<std::string>().rfind("0.", 0), 0u) << r.body;  // the CMake project version
    EXPECT_EQ(r.body["default_generation_settings"]["n_ctx"], 256);
    const json& p = r.body["default_generation_settings"]["params"];
    for (const char* k : {"temperature", "top_k", "top_p", "min_p"}) EXPECT_TRUE(p[k].is_number()) << k << r.body;
    EXPECT_EQ(post("/props", "{}").status, 405);
}

TEST(utility_endpoints_auth, need_the_api_key) {
    if (!http_available()) GTEST_SKIP() << "built without the HTTP server";
    server* s = start_server("sekrit");
    const int port = s->port();
    const std::string tok = R"({"content": "hi"})", detok = R"({"tokens": [1]})";
    EXPECT_EQ(status_with_key(port, "GET", "/props", "wrong"), 401);
    EXPECT_EQ(status_with_key(port, "POST", "/tokenize", "wrong", tok), 401);
    EXPECT_EQ(status_with_key(port, "POST", "/detokenize", "wrong", detok), 401);
    EXPECT_EQ(status_with_key(port, "GET", "/props", "sekrit"), 200);
    EXPECT_EQ(status_with_key(port, "POST", "/tokenize", "sekrit", tok), 200);
    EXPECT_EQ(status_with_key(port, "POST", "/detokenize", "sekrit", detok), 200);
    http_client c("127.0.0.1", port, 60);
    std::string body, err;
    EXPECT_EQ(c.get("/props", &body, &err), 401);  // no Authorization header at all
    stop_server(s);
}

}  // namespace
}  // namespace tansy
