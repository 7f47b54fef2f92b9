// Host-side CUDA runtime helpers usable from plain C++ (tests, the backend factory).
#pragma once
#include <cstddef>
#include <string>

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

}  // namespace tansy::cuda
