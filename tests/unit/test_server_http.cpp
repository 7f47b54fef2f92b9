// http_server (our HTTP/1.1 server over Asio) on a loopback port: routing, JSON error bodies for what the server
// answers itself (404, 405, 413), a throwing handler, streaming, and noticing a client that went away.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "server/http.h"
#include "server/openai.h"
#include "test_util.h"

namespace tansy {
namespace {

using namespace std::chrono_literals;

// Sends a raw request and reads until the server closes (requests say Connection: close).
std::string roundtrip(int port, const std::string& request) {
    const int fd = tansy::test::connect_loopback(port);
    if (fd < 0) return "";
    size_t off = 0;
    while (off < request.size()) {
        const ssize_t n = send(fd, request.data() + off, request.size() - off, MSG_NOSIGNAL);
        if (n <= 0) break;
        off += (size_t)n;
    }
    std::string out;
    char buf[4096];
    for (;;) {
        const ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n <= 0) break;
        out.append(buf, (size_t)n);
    }
    close(fd);
    return out;
}

std::string body_of(const std::string& response) {
    const size_t p = response.find("\r\n\r\n");
    return p == std::string::npos ? "" : response.substr(p + 4);
}

int status_of(const std::string& response) { return response.size() > 12 ? std::atoi(response.c_str() + 9) : 0; }

struct running_server {
    http_server srv;
    std::thread t;
    explicit running_server(http_options o) : srv(o) {}
    void start() {
        srv.set_error_body([](int status, const std::string& m) { return error_body(status, m); });
        srv.bind();
        t = std::thread([this] { srv.run(); });
    }
    ~running_server() {
        srv.stop();
        if (t.joinable()) t.join();
    }
};

http_options small_opts() {
    http_options o;
    o.port = 0;
    o.threads = 4;
    o.max_body_bytes = 1024;
    return o;
}

#define REQUIRE_HTTP() \
    if (!http_available()) GTEST_SKIP() << "built without the HTTP server (no Asio headers)"

TEST(server_http, routes_errors_and_streaming) {
    REQUIRE_HTTP();
    running_server s(small_opts());
    s.srv.route("GET", "/hello", [](const http_request& r, http_response& res) {
        res.body = "{\"hi\": \"" + r.header("x-name") + "\"}";
        res.headers.emplace_back("X-Test", "1");
    });
    s.srv.route("POST", "/echo", [](const http_request& r, http_response& res) { res.body = r.body; });
    s.srv.route("GET", "/throw", [](const http_request&, http_response&) { throw std::runtime_error("boom"); });
    s.srv.route("GET", "/stream", [](const http_request&, http_response& res) {
        res.content_type = "text/event-stream";
        res.stream = [](const http_write_fn& write) {
            for (int i = 0; i < 3; i++) write("data: " + std::to_string(i) + "\n\n");
            write("");  // ignored, does not end the stream early
            write("data: [DONE]\n\n");
        };
    });
    s.start();
    const int port = s.srv.port();
    ASSERT_GT(port, 0);

    std::string r = roundtrip(port, "GET /hello HTTP/1.1\r\nHost: x\r\nX-Name: Ann\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(status_of(r), 200);
    EXPECT_EQ(body_of(r), "{\"hi\": \"Ann\"}");
    EXPECT_NE(r.find("X-Test: 1"), std::string::npos);

    r = roundtrip(port, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello");
    EXPECT_EQ(body_of(r), "hello");

    r = roundtrip(port, "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(status_of(r), 404);
    EXPECT_TRUE(ojson::parse(body_of(r))["error"].is_object());

    r = roundtrip(port, "POST /hello HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(status_of(r), 405);
    EXPECT_TRUE(ojson::parse(body_of(r))["error"].is_object());

    r = roundtrip(port, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\nConnection: close\r\n\r\n" +
                           std::string(5000, 'x'));
    EXPECT_EQ(status_of(r), 413);
    EXPECT_EQ(ojson::parse(body_of(r), nullptr, false)["error"]["type"], "invalid_request_error") << r;

    r = roundtrip(port, "GET /throw HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(status_of(r), 500);
    EXPECT_EQ(ojson::parse(body_of(r))["error"]["type"], "server_error");

    r = roundtrip(port, "GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(status_of(r), 200);
    EXPECT_NE(r.find("Transfer-Encoding: chunked"), std::string::npos);
    for (const char* piece : {"data: 0\n\n", "data: 1\n\n", "data: 2\n\n", "data: [DONE]\n\n"})
        EXPECT_NE(r.find(piece), std::string::npos) << piece;
    EXPECT_NE(r.find("0\r\n\r\n"), std::string::npos) << "the stream ends with the last chunk";
}

TEST(server_http, prefix_routes) {
    REQUIRE_HTTP();
    running_server s(small_opts());
    s.srv.route("POST", "/items", [](const http_request&, http_response& res) { res.body = "created"; });
    s.srv.route("GET", "/items/*", [](const http_request& r, http_response& res) { res.body = r.path; });
    s.srv.route("GET", "/items/special", [](const http_request&, http_response& res) { res.body = "exact"; });
    s.start();
    const int port = s.srv.port();
    auto get = [&](const std::string& method, const std::string& path) {
        return roundtrip(port, method + " " + path + " HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    };
    EXPECT_EQ(body_of(get("GET", "/items/abc")), "/items/abc");
    EXPECT_EQ(body_of(get("GET", "/items/abc?x=1")), "/items/abc");
    EXPECT_EQ(body_of(get("GET", "/items/special")), "exact");  // an exact route wins
    EXPECT_EQ(body_of(get("POST", "/items")), "created");
    EXPECT_EQ(status_of(get("GET", "/items")), 405);       // "/items/*" needs something after the slash
    EXPECT_EQ(status_of(get("GET", "/items/")), 404);
    EXPECT_EQ(status_of(get("GET", "/itemsabc")), 404);
    const std::string r = get("DELETE", "/items/abc");
    EXPECT_EQ(status_of(r), 405);
    EXPECT_NE(r.find("Allow: GET, OPTIONS"), std::string::npos) << r;
}

TEST(server_http, a_client_that_goes_away_is_noticed) {
    REQUIRE_HTTP();
    std::atomic<bool> saw_close{false}, write_failed{false};  // outlive the server and its workers
    running_server s(small_opts());
    s.srv.route("GET", "/wait", [&](const http_request& req, http_response& res) {
        auto closed = req.client_closed;
        res.stream = [&, closed](const http_write_fn& write) {
            write("data: first\n\n");
            for (int i = 0; i < 500; i++) {  // up to 5 s
                if (closed()) {
                    saw_close = true;
                    break;
                }
                std::this_thread::sleep_for(10ms);
            }
            for (int i = 0; i < 10 && !write_failed; i++)
                if (!write("data: more\n\n")) write_failed = true;
        };
    });
    s.start();
    const int fd = tansy::test::connect_loopback(s.srv.port());
    ASSERT_GE(fd, 0);
    const std::string req = "GET /wait HTTP/1.1\r\nHost: x\r\n\r\n";
    ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), (ssize_t)req.size());
    char buf[256];
    ASSERT_GT(recv(fd, buf, sizeof buf, 0), 0);  // the first chunk arrived
    close(fd);
    for (int i = 0; i < 800 && !write_failed; i++) std::this_thread::sleep_for(10ms);
    EXPECT_TRUE(saw_close) << "client_closed() must see the closed connection";
    EXPECT_TRUE(write_failed) << "writes to a closed connection must fail";
}

}  // namespace
}  // namespace tansy
