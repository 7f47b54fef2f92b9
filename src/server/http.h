// A small HTTP/1.1 server: our own request/response structs over cpp-httplib (pimpl; httplib.h is included by
// http.cpp only). Handlers run on a pool of worker threads, one connection per thread, and must not throw:
// whatever escapes one is caught here and answered with a 500 in OpenAI's error shape.
//
// Streaming: a handler sets response.stream; it runs on the same worker thread after the handler returns,
// writing chunks (Transfer-Encoding: chunked) until it returns. write() returns false once the client is gone.
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
    int port = 8080;               // 0: any free port (see http_server::port())
    size_t max_body_bytes = 8u << 20;
    int threads = 64;              // worker threads = concurrent connections served
    int read_timeout_s = 30;       // a client that stops sending its request
    int write_timeout_s = 30;      // a client that stops reading its response
    int keepalive_max = 100;       // requests per connection
};

// False when tansy was built without cpp-httplib (http_unavailable.cpp): http_server::bind() then fails.
bool http_available();

class http_server {
  public:
    explicit http_server(const http_options& opt);
    ~http_server();
    http_server(const http_server&) = delete;
    http_server& operator=(const http_server&) = delete;

    // Routes: exact path match. Requests to a known path with another method get 405, unknown paths 404,
    // bodies over max_body_bytes 413 (all with JSON error bodies made by `error_body`).
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
    // Thread-safe, async-signal-unsafe: stops accepting; run() returns once in-flight handlers are done.
    void stop();

  private:
    class impl;
    std::unique_ptr<impl> impl_;
};

}  // namespace tansy
