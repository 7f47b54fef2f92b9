// Host-side CUDA runtime helpers usable from plain C++ (tests, the backend factory).
#pragma once
#include <cstddef>
#include <string>

struct CUstream_st;  // cudaStream_t without the runtime header

namespace tansy::cuda {

// Number of usable CUDA devices (0 when there is no driver or GPU); *why gets the reason when 0.
int device_count(std::string* why = nullptr);
std::string device_name(int dev);
// 10 * major + minor of device dev (90 for an H100/H200), 0 if it cannot be read.
int device_compute_capability(int dev = 0);

// RAII device allocation.
class device_buffer {
  public:
    device_buffer() = default;
    explicit device_buffer(size_t bytes);
    ~device_buffer();
    device_buffer(const device_buffer&) = delete;
    device_buffer& operator=(const device_buffer&) = delete;
    device_buffer(device_buffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
    device_buffer& operator=(device_buffer&& o) noexcept;
    void* get() const { return p_; }
    size_t size() const { return n_; }
    void upload(const void* src, size_t bytes);
    void download(void* dst, size_t bytes) const;

  private:
    void* p_ = nullptr;
    size_t n_ = 0;
};

// Device memory of the stream-ordered pool (cudaMallocAsync), allocated and freed in order with `stream`'s work:
// freeing never waits for the device (cudaFree synchronises the whole device, which would stall a server's
// queued steps each time a request ends), and freed blocks stay in the pool for the next sequence state. Out of
// memory throws tansy::error naming the size, so a caller can end one request instead of the process.
class stream_buffer {
  public:
    stream_buffer() = default;
    stream_buffer(size_t bytes, CUstream_st* stream);
    ~stream_buffer();
    stream_buffer(const stream_buffer&) = delete;
    stream_buffer& operator=(const stream_buffer&) = delete;
    stream_buffer(stream_buffer&& o) noexcept : p_(o.p_), n_(o.n_), stream_(o.stream_) { o.p_ = nullptr, o.n_ = 0; }
    stream_buffer& operator=(stream_buffer&& o) noexcept;
    void* get() const { return p_; }
    size_t size() const { return n_; }

  private:
    void* p_ = nullptr;
    size_t n_ = 0;
    CUstream_st* stream_ = nullptr;
};

// Hands the stream-ordered pool's unused blocks back to the device (an idle server; before a plain allocation
// that would not fit otherwise). Returns the bytes the pool still holds.
size_t trim_stream_pool();

}  // namespace tansy::cuda
