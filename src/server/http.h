// A small HTTP/1.1 server: our own request/response structs over standalone Asio (pimpl; asio.hpp is included
// by http.cpp only). One I/O thread accepts connections and reads requests with a bounded parser and deadlines,
// so idle, slow or waiting connections cost no thread; complete requests go to a pool of worker threads, where
// handlers may block. Handlers must not throw: whatever escapes one is caught here and answered with a 500 in
// OpenAI's error shape.
//
// Streaming: a handler sets response.stream; it runs on the same worker thread after the handler returns,
// writing chunks until it returns (Transfer-Encoding: chunked; to an HTTP/1.0 client the body is ended by
// closing the connection instead). write() returns false once the client is gone.
//
// What the server answers by itself: 400 (malformed request line or headers, bad Content-Length), 404, 405
// with Allow, 408 (header or body deadline passed), 413 (Content-Length over max_body_bytes, answered before
// any body is read; a chunked body once it grows past the limit), 501 (a Transfer-Encoding other than chunked), 414, 431 (header block too large or too many headers),
// 503 with Retry-After (connection limits), 505, and OPTIONS (Allow; CORS preflight when cors_origins is set).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tansy {

struct http_request {
    std::string method, path, body;
    std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased
    std::string remote_addr;
    int remote_port = -1;
    // True once the client has closed its connection (peeks at the socket; cheap enough to poll every 100 ms).
    std::function<bool()> client_closed = [] { return false; };

    std::string header(std::string_view lower_name) const;  // "" if absent
};

using http_write_fn = std::function<bool(std::string_view chunk)>;

struct http_response {
    int status = 200;
    std::string content_type = "application/json";
    std::string body;
    std::vector<std::pair<std::string, std::string>> headers;
    // When set, the body is produced by this function (chunked); `body` is ignored.
    std::function<void(const http_write_fn& write)> stream;
};

using http_handler = std::function<void(const http_request&, http_response&)>;

struct http_options {
    std::string host = "127.0.0.1";
    int port = 8080;                    // 0: any free port (see http_server::port())
    size_t max_body_bytes = 8u << 20;   // a larger Content-Length gets 413 at once
    size_t max_header_bytes = 64u << 10;  // request line + headers; larger gets 431
    int max_headers = 128;              // header lines; more gets 431
    int threads = 64;                   // worker threads = requests handled at once (the rest wait their turn)
    int backlog = 1024;                 // listen() backlog (the kernel caps it at net.core.somaxconn)
    int max_connections = 4096;         // open connections in total; over it, 503 + Retry-After
    int max_connections_per_addr = 1024;  // open connections per client address; over it, 503 + Retry-After
    double header_timeout_s = 10;       // the whole header block, from its first byte (or from accept)
    double body_timeout_s = 60;         // the whole body, from the end of the headers
    double idle_timeout_s = 5;          // keep-alive: waiting for the next request
    double write_timeout_s = 30;        // a client that stops reading its response (per blocked write)
    int keepalive_max = 100;            // requests per connection
    // Browser origins allowed to call (Access-Control-Allow-Origin, OPTIONS preflights); "*" allows any.
    std::vector<std::string> cors_origins;
};

// False when tansy was built without Asio (http_unavailable.cpp): http_server::bind() then fails.
bool http_available();

class http_server {
  public:
    explicit http_server(const http_options& opt);
    ~http_server();
    http_server(const http_server&) = delete;
    http_server& operator=(const http_server&) = delete;

    // Routes: exact path match (the query string is ignored), or a path ending in "/*" for every path under it
    // (an exact route wins). Requests to a known path with another method get
    // 405, unknown paths 404, bodies over max_body_bytes 413 (all with JSON error bodies made by `error_body`).
    void route(const std::string& method, const std::string& path, http_handler h);
    // (status, message) -> JSON body for errors the server itself produces (404, 405, 413, 500, ...).
    void set_error_body(std::function<std::string(int status, const std::string& message)> f);
    // Called once per finished request (for access logs and metrics); may be empty.
    void set_logger(std::function<void(const http_request&, int status)> f);

    // Binds the listening socket; throws tansy::error on failure. After this, port() is the bound port.
    void bind();
    int port() const;
    // Serves until stop(); returns after every worker thread has finished its connection.
    void run();
    // Thread-safe, async-signal-unsafe: stops accepting and closes connections not in a handler; run() returns
    // once in-flight handlers (and their streams) are done.
    void stop();

  private:
    class impl;
    std::unique_ptr<impl> impl_;
};

}  // namespace tansy
