// A small blocking HTTP/1.1 client over plain POSIX sockets, for driving a server from the same process
// (tansy bench --serve, server/load_client.h). Response bodies reach a callback piece by piece as they arrive
// (Content-Length, chunked, or ended by closing), so a streamed (SSE) response can be timed event by event.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace tansy {

// A piece of a response body; return false to abort the request.
using http_body_fn = std::function<bool(std::string_view piece)>;

class http_client {
  public:
    // One keep-alive connection to host:port, opened on the first request. timeout_s bounds connecting and each
    // wait for data (a long prefill is silence on a streamed response).
    http_client(const std::string& host, int port, int timeout_s = 600);
    ~http_client();
    http_client(const http_client&) = delete;
    http_client& operator=(const http_client&) = delete;

    // POSTs a JSON body; the response body goes to on_body as it arrives. Returns the HTTP status, or -1 with
    // *error set when there was no response (refused, timed out, aborted by on_body).
    int post(const std::string& path, const std::string& json_body, const http_body_fn& on_body, std::string* error);
    // GET; the whole body in *body. Same return as post().
    int get(const std::string& path, std::string* body, std::string* error);

  private:
    class impl;
    std::unique_ptr<impl> impl_;
};

}  // namespace tansy
