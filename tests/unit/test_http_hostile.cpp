// http_server against hostile or careless clients, over raw loopback sockets (issue 29): connection bursts,
// slow clients trickling their headers, huge or negative Content-Length, HTTP/1.0, wrong methods, CORS,
// malformed request lines, oversized headers, connection limits, pipelining and a graceful stop. Every wait
// is bounded (SO_RCVTIMEO, loop counts), and the whole suite takes a few seconds.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "server/http.h"
#include "server/http_client.h"
#include "server/openai.h"
#include "test_util.h"

namespace tansy {
namespace {

using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;

constexpr int RECV_TIMEOUT_MS = 5000;  // no test response should take anywhere near this long

double seconds_since(steady::time_point t0) { return std::chrono::duration<double>(steady::now() - t0).count(); }

bool send_str(int fd, const std::string& s) {
    size_t off = 0;
    while (off < s.size()) {
        const ssize_t n = send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
        if (n <= 0) return false;
        off += (size_t)n;
    }
    return true;
}

// Reads one response: the head, then Content-Length bytes, or until the server closes (or the timeout).
std::string read_response(int fd) {
    std::string out;
    char buf[4096];
    for (;;) {
        const size_t end = out.find("\r\n\r\n");
        if (end != std::string::npos) {
            const size_t cl = out.find("Content-Length: ");
            if (cl != std::string::npos && cl < end) {
                const size_t need = end + 4 + (size_t)std::atoll(out.c_str() + cl + 16);
                if (out.size() >= need) return out;
            }
        }
        const ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n <= 0) return out;
        out.append(buf, (size_t)n);
    }
}

std::string roundtrip(int port, const std::string& request) {
    const int fd = tansy::test::connect_loopback(port);
    if (fd < 0) return "";
    send_str(fd, request);
    std::string r = read_response(fd);
    close(fd);
    return r;
}

int status_of(const std::string& r) {
    return r.size() > 12 && r.compare(0, 5, "HTTP/") == 0 ? std::atoi(r.c_str() + 9) : 0;
}
bool has(const std::string& r, const std::string& piece) { return r.find(piece) != std::string::npos; }
std::string body_of(const std::string& r) {
    const size_t p = r.find("\r\n\r\n");
    return p == std::string::npos ? "" : r.substr(p + 4);
}

struct test_server {
    http_server srv;
    std::thread t;
    explicit test_server(http_options o) : srv(o) {
        srv.set_error_body([](int status, const std::string& m) { return error_body(status, m); });
        srv.route("GET", "/hello", [](const http_request&, http_response& res) { res.body = "{\"hi\": 1}"; });
        srv.route("POST", "/echo", [](const http_request& r, http_response& res) { res.body = r.body; });
        srv.route("GET", "/stream", [](const http_request&, http_response& res) {
            res.content_type = "text/event-stream";
            res.stream = [](const http_write_fn& write) {
                for (int i = 0; i < 3; i++) write("data: " + std::to_string(i) + "\n\n");
            };
        });
        srv.route("GET", "/slow", [](const http_request&, http_response& res) {
            std::this_thread::sleep_for(300ms);
            res.body = "{\"slow\": 1}";
        });
        srv.bind();
        t = std::thread([this] { srv.run(); });
    }
    ~test_server() {
        srv.stop();
        if (t.joinable()) t.join();
    }
    int port() { return srv.port(); }
};

http_options opts() {
    http_options o;
    o.port = 0;
    o.threads = 4;  // far fewer than the connections below: connections must not cost threads
    o.max_body_bytes = 1024;
    o.max_header_bytes = 8192;
    o.max_headers = 32;
    return o;
}

#define REQUIRE_HTTP() \
    if (!http_available()) GTEST_SKIP() << "built without Asio"

TEST(http_hostile, burst_of_64_connections_all_answered) {
    REQUIRE_HTTP();
    test_server s(opts());
    constexpr int N = 64;
    std::vector<int> fds;
    for (int i = 0; i < N; i++) {  // all connects in flight before any request is sent
        const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons((uint16_t)s.port());
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        connect(fd, (sockaddr*)&a, sizeof a);
        fds.push_back(fd);
    }
    const auto t0 = steady::now();
    int ok = 0;
    for (int fd : fds) {
        pollfd p{fd, POLLOUT, 0};
        ASSERT_EQ(poll(&p, 1, RECV_TIMEOUT_MS), 1);
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
        timeval tv{RECV_TIMEOUT_MS / 1000, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        if (send_str(fd, "GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") &&
            status_of(read_response(fd)) == 200)
            ok++;
        close(fd);
    }
    EXPECT_EQ(ok, N);
    // note: with a listen backlog of 5 the excess connections wait for SYN retransmits (1 s and more)
    EXPECT_LT(seconds_since(t0), 0.9) << "a burst must not wait on SYN retransmits";
}

TEST(http_hostile, slow_clients_do_not_block_a_normal_request) {
    REQUIRE_HTTP();
    test_server s(opts());
    constexpr int N_SLOW = 300;
    std::vector<int> slow;
    for (int i = 0; i < N_SLOW; i++) {
        const int fd = tansy::test::connect_loopback(s.port());
        ASSERT_GE(fd, 0) << "slow client " << i;
        send_str(fd, "GET /hello HTTP/1.1\r\nHo");
        slow.push_back(fd);
    }
    std::atomic<bool> done{false};
    std::thread trickle([&] {  // a byte to each slow client every 100 ms (at most 5 s)
        for (int round = 0; round < 50 && !done; round++) {
            for (int fd : slow) send(fd, "s", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
            std::this_thread::sleep_for(100ms);
        }
    });
    std::this_thread::sleep_for(300ms);
    const auto t0 = steady::now();
    const std::string r = roundtrip(s.port(), "GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    const double took = seconds_since(t0);
    done = true;
    trickle.join();
    EXPECT_EQ(status_of(r), 200) << r;
    EXPECT_LT(took, 3.0);
    for (int fd : slow) close(fd);
}

TEST(http_hostile, header_and_body_deadlines_are_totals_not_per_read) {
    REQUIRE_HTTP();
    http_options o = opts();
    o.header_timeout_s = 0.8;
    o.body_timeout_s = 0.8;
    test_server s(o);
    for (const std::string start :
         {"GET /hello HTTP/1.1\r\nX-", "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"}) {
        const int fd = tansy::test::connect_loopback(s.port());
        ASSERT_GE(fd, 0);
        send_str(fd, start);
        const auto t0 = steady::now();
        for (int i = 0; i < 30 && seconds_since(t0) < 3; i++) {  // a byte every 50 ms: never idle for long
            if (send(fd, "a", 1, MSG_NOSIGNAL) != 1) break;
            pollfd p{fd, POLLIN, 0};
            if (poll(&p, 1, 50) == 1) break;  // the server answered (or closed)
        }
        const std::string r = read_response(fd);
        EXPECT_EQ(status_of(r), 408) << start << r;
        EXPECT_LT(seconds_since(t0), 2.0);
        close(fd);
    }
}

TEST(http_hostile, bad_content_length_is_answered_without_waiting_for_a_body) {
    REQUIRE_HTTP();
    test_server s(opts());
    const struct {
        const char* length;
        int status;
    } cases[] = {
        {"99999999999999999999999", 413}, {"5000", 413}, {"-5", 400}, {"12abc", 400}, {"", 400}, {"1, 2", 400}};
    for (const auto& c : cases) {
        const auto t0 = steady::now();
        const std::string r = roundtrip(s.port(), std::string("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: ") +
                                                      c.length + "\r\n\r\n");  // no body follows
        EXPECT_EQ(status_of(r), c.status) << c.length << ": " << r;
        EXPECT_LT(seconds_since(t0), 1.0) << c.length;
        EXPECT_TRUE(ojson::parse(body_of(r), nullptr, false)["error"].is_object()) << r;
    }
    // conflicting lengths, both framings, unknown codings
    const std::string post = "POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n";
    EXPECT_EQ(status_of(roundtrip(s.port(), post + "Content-Length: 2\r\nContent-Length: 3\r\n\r\nab")), 400);
    EXPECT_EQ(status_of(roundtrip(s.port(), post + "Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\nab")), 400);
    EXPECT_EQ(status_of(roundtrip(s.port(), post + "Transfer-Encoding: gzip, chunked\r\n\r\n")), 501);
    // chunked bodies: decoded (extensions and trailers ignored), counted against the limit as they arrive
    std::string r = roundtrip(
        s.port(), post + "Transfer-Encoding: chunked\r\n\r\n2;x=y\r\nab\r\nA\r\n0123456789\r\n0\r\nT: 1\r\n\r\n");
    EXPECT_EQ(status_of(r), 200) << r;
    EXPECT_EQ(body_of(r), "ab0123456789");
    EXPECT_EQ(status_of(roundtrip(s.port(), post + "Transfer-Encoding: chunked\r\n\r\n3FF\r\n" +
                                                std::string(1023, 'a') + "\r\n2\r\nab\r\n0\r\n\r\n")),
              413);
    EXPECT_EQ(status_of(roundtrip(s.port(), post + "Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n")), 400);
    EXPECT_EQ(status_of(roundtrip(s.port(), post + "Transfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n")), 400);
    EXPECT_EQ(status_of(roundtrip(s.port(), post + "Transfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFF\r\n")), 400);
}

TEST(http_hostile, http10_gets_an_unchunked_stream_ended_by_close) {
    REQUIRE_HTTP();
    test_server s(opts());
    std::string r = roundtrip(s.port(), "GET /stream HTTP/1.0\r\n\r\n");
    EXPECT_EQ(status_of(r), 200) << r;
    EXPECT_FALSE(has(r, "Transfer-Encoding")) << r;
    EXPECT_TRUE(has(r, "Connection: close")) << r;
    EXPECT_EQ(body_of(r), "data: 0\n\ndata: 1\n\ndata: 2\n\n");
    // a plain response to HTTP/1.0 has a length and ends the connection too
    r = roundtrip(s.port(), "GET /hello HTTP/1.0\r\n\r\n");
    EXPECT_EQ(body_of(r), "{\"hi\": 1}");
    EXPECT_TRUE(has(r, "Connection: close"));
    // HTTP/1.1 keeps chunking, with Connection: close honoured
    r = roundtrip(s.port(), "GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    EXPECT_TRUE(has(r, "Transfer-Encoding: chunked") && has(r, "Connection: close") && has(r, "0\r\n\r\n")) << r;
}

TEST(http_hostile, wrong_method_gets_405_with_allow) {
    REQUIRE_HTTP();
    test_server s(opts());
    std::string r = roundtrip(s.port(), "PUT /hello HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}");
    EXPECT_EQ(status_of(r), 405) << r;
    EXPECT_TRUE(has(r, "Allow: GET, OPTIONS\r\n")) << r;
    r = roundtrip(s.port(), "DELETE /echo HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_EQ(status_of(r), 405);
    EXPECT_TRUE(has(r, "Allow: POST, OPTIONS\r\n")) << r;
    r = roundtrip(s.port(), "PUT /nowhere HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_EQ(status_of(r), 404);
    r = roundtrip(s.port(), "OPTIONS /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(status_of(r), 204);
    EXPECT_TRUE(has(r, "Allow: POST, OPTIONS\r\n")) << r;
    EXPECT_FALSE(has(r, "Access-Control-Allow-Origin")) << "no CORS unless configured";
}

TEST(http_hostile, cors_headers_and_preflight) {
    REQUIRE_HTTP();
    http_options o = opts();
    o.cors_origins = {"http://app.example"};
    test_server s(o);
    std::string r = roundtrip(s.port(),
                              "GET /hello HTTP/1.1\r\nHost: x\r\nOrigin: http://app.example\r\n"
                              "Connection: close\r\n\r\n");
    EXPECT_EQ(status_of(r), 200);
    EXPECT_TRUE(has(r, "Access-Control-Allow-Origin: http://app.example\r\n")) << r;
    EXPECT_TRUE(has(r, "Vary: Origin\r\n")) << r;
    r = roundtrip(s.port(),
                  "GET /hello HTTP/1.1\r\nHost: x\r\nOrigin: http://evil.example\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(status_of(r), 200);
    EXPECT_FALSE(has(r, "Access-Control-Allow-Origin")) << r;
    r = roundtrip(s.port(),
                  "OPTIONS /echo HTTP/1.1\r\nHost: x\r\nOrigin: http://app.example\r\n"
                  "Access-Control-Request-Method: POST\r\n"
                  "Access-Control-Request-Headers: authorization, content-type\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(status_of(r), 204) << r;
    EXPECT_TRUE(has(r, "Access-Control-Allow-Origin: http://app.example\r\n")) << r;
    EXPECT_TRUE(has(r, "Access-Control-Allow-Methods: POST, OPTIONS\r\n")) << r;
    EXPECT_TRUE(has(r, "Access-Control-Allow-Headers: authorization, content-type\r\n")) << r;
    // errors carry the headers too, so a browser can read them
    r = roundtrip(s.port(),
                  "POST /echo HTTP/1.1\r\nHost: x\r\nOrigin: http://app.example\r\nContent-Length: 99999\r\n\r\n");
    EXPECT_EQ(status_of(r), 413);
    EXPECT_TRUE(has(r, "Access-Control-Allow-Origin: http://app.example\r\n")) << r;

    http_options any = opts();
    any.cors_origins = {"*"};
    test_server s2(any);
    r = roundtrip(s2.port(),
                  "POST /echo HTTP/1.1\r\nHost: x\r\nOrigin: http://x.example\r\nContent-Length: 2\r\n"
                  "Connection: close\r\n\r\nok");
    EXPECT_EQ(body_of(r), "ok");
    EXPECT_TRUE(has(r, "Access-Control-Allow-Origin: *\r\n")) << r;
}

TEST(http_hostile, malformed_requests_get_400_family) {
    REQUIRE_HTTP();
    test_server s(opts());
    const struct {
        std::string request;
        int status;
    } cases[] = {
        {"GARBAGE\r\n\r\n", 400},
        {"GET /hello\r\nHost: x\r\n\r\n", 400},
        {"GET  /hello HTTP/1.1\r\nHost: x\r\n\r\n", 400},
        {"GET /hello HTTP/1.1 extra\r\nHost: x\r\n\r\n", 400},
        {"G@T /hello HTTP/1.1\r\nHost: x\r\n\r\n", 400},
        {"GET hello HTTP/1.1\r\nHost: x\r\n\r\n", 400},
        {"GET /hello HTTP/2.0\r\nHost: x\r\n\r\n", 505},
        {"GET /hello HTTX/1.1\r\nHost: x\r\n\r\n", 400},
        {"GET /hello HTTP/1.1\r\n\r\n", 400},  // no Host
        {"GET /hello HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n", 400},
        {"GET /hello HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400},
        {"GET /hello HTTP/1.1\r\nHost: x\r\nBad Name: 1\r\n\r\n", 400},
        {std::string("GET /hello HTTP/1.1\r\nHost: x\r\nX: a\x01z\r\n\r\n"), 400},
        {std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 15), 400},  // TLS hello-ish bytes
        {"GET /" + std::string(9000, 'a') + " HTTP/1.1\r\nHost: x\r\n\r\n", 431},        // over max_header_bytes
        {"GET /hello HTTP/1.1\r\nHost: x\r\nExpect: 999-nope\r\n\r\n", 417},
    };
    for (const auto& c : cases) {
        const std::string r = roundtrip(s.port(), c.request);
        EXPECT_EQ(status_of(r), c.status) << c.request.substr(0, 60) << " -> " << r.substr(0, 200);
    }
    // oversized headers: one huge header, too many headers, and a block that never ends
    std::string big = "GET /hello HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(10000, 'b') + "\r\n\r\n";
    EXPECT_EQ(status_of(roundtrip(s.port(), big)), 431);
    std::string many = "GET /hello HTTP/1.1\r\nHost: x\r\n";
    for (int i = 0; i < 40; i++) many += "X-" + std::to_string(i) + ": v\r\n";
    EXPECT_EQ(status_of(roundtrip(s.port(), many + "\r\n")), 431);
    const auto t0 = steady::now();
    EXPECT_EQ(status_of(roundtrip(s.port(), "GET /hello HTTP/1.1\r\n" + std::string(20000, 'h'))), 431);
    EXPECT_LT(seconds_since(t0), 1.0);
    // the server is still fine
    EXPECT_EQ(status_of(roundtrip(s.port(), "GET /hello?x=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")), 200);
}

TEST(http_hostile, connection_limits_answer_503_with_retry_after) {
    REQUIRE_HTTP();
    http_options o = opts();
    o.max_connections_per_addr = 4;
    test_server s(o);
    std::vector<int> held;
    for (int i = 0; i < 4; i++) held.push_back(tansy::test::connect_loopback(s.port()));
    std::this_thread::sleep_for(50ms);  // let the server accept them
    std::string r = roundtrip(s.port(), "GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(status_of(r), 503) << r;
    EXPECT_TRUE(has(r, "Retry-After: ")) << r;
    for (int fd : held) close(fd);
    int status = 0;
    for (int i = 0; i < 40 && status != 200; i++) {  // the server notices the closes (within 2 s)
        std::this_thread::sleep_for(50ms);
        status = status_of(roundtrip(s.port(), "GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
    }
    EXPECT_EQ(status, 200);

    http_options t = opts();
    t.max_connections = 2;
    test_server s2(t);
    const int a = tansy::test::connect_loopback(s2.port()), b = tansy::test::connect_loopback(s2.port());
    std::this_thread::sleep_for(50ms);
    EXPECT_EQ(status_of(roundtrip(s2.port(), "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")), 503);
    close(a);
    close(b);
}

TEST(http_hostile, keep_alive_pipelining_and_expect_continue) {
    REQUIRE_HTTP();
    test_server s(opts());
    const int fd = tansy::test::connect_loopback(s.port());
    ASSERT_GE(fd, 0);
    // two pipelined requests in one send, then a third on the same connection
    send_str(fd,
             "GET /hello HTTP/1.1\r\nHost: x\r\n\r\nPOST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc");
    std::string both;
    char buf[4096];
    for (int i = 0; i < 20 && !has(both, "\r\n\r\nabc"); i++) {
        const ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n <= 0) break;
        both.append(buf, (size_t)n);
    }
    EXPECT_TRUE(has(both, "{\"hi\": 1}") && has(both, "\r\n\r\nabc")) << both;
    // Expect: 100-continue: the body is sent only after the interim response
    send_str(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n");
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0);
    EXPECT_EQ(std::string(buf, (size_t)n), "HTTP/1.1 100 Continue\r\n\r\n");
    send_str(fd, "wxyz");
    const std::string r = read_response(fd);
    EXPECT_EQ(body_of(r), "wxyz") << r;
    close(fd);
}

TEST(http_hostile, client_reads_chunked_and_close_delimited_streams) {
    REQUIRE_HTTP();
    test_server s(opts());
    http_client c("127.0.0.1", s.port(), 5);
    std::string body, err;
    EXPECT_EQ(c.get("/stream", &body, &err), 200) << err;
    EXPECT_EQ(body, "data: 0\n\ndata: 1\n\ndata: 2\n\n");
    std::string echoed;
    EXPECT_EQ(c.post(
                  "/echo", "{\"a\": 1}", [&](std::string_view p) { return echoed.append(p), true; }, &err),
              200)
        << err;
    EXPECT_EQ(echoed, "{\"a\": 1}");
    EXPECT_EQ(c.get("/nowhere", &body, &err), 404);
    EXPECT_EQ(c.get("/hello", &body, &err), 200) << "the same connection after a 404";
    http_client refused("127.0.0.1", 1, 1);
    EXPECT_EQ(refused.get("/", &body, &err), -1);
    EXPECT_FALSE(err.empty());
}

TEST(http_hostile, stop_waits_for_handlers_in_flight) {
    REQUIRE_HTTP();
    auto s = std::make_unique<test_server>(opts());
    const int fd = tansy::test::connect_loopback(s->port());
    const int idle = tansy::test::connect_loopback(s->port());
    send_str(fd, "GET /slow HTTP/1.1\r\nHost: x\r\n\r\n");
    std::this_thread::sleep_for(100ms);  // the handler is running
    const auto t0 = steady::now();
    s.reset();  // stop() + join of run()
    const double took = seconds_since(t0);
    const std::string r = read_response(fd);
    EXPECT_EQ(status_of(r), 200) << r;
    EXPECT_EQ(body_of(r), "{\"slow\": 1}");
    EXPECT_TRUE(has(r, "Connection: close")) << "no keep-alive while stopping";
    EXPECT_LT(took, 2.0);
    char c;
    EXPECT_EQ(recv(idle, &c, 1, 0), 0) << "an idle connection is closed at stop";
    close(fd);
    close(idle);
}

}  // namespace
}  // namespace tansy
