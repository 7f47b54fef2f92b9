#include "backend/cuda/common.cuh"
#include "backend/cuda/device.h"

namespace tansy::cuda {

int device_count(std::string* why) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();  // clear the sticky error
        if (why) *why = std::string("no usable CUDA device: ") + cudaGetErrorString(e);
        return 0;
    }
    if (n == 0 && why) *why = "no CUDA device found";
    return n;
}

std::string device_name(int dev) {
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
    return p.name;
}

int device_compute_capability(int dev) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
        return 0;
    return 10 * major + minor;
}

device_buffer::device_buffer(size_t bytes) : n_(bytes) {
    if (bytes) CUDA_CHECK(cudaMalloc(&p_, bytes));
}

device_buffer::~device_buffer() {
    if (p_) cudaFree(p_);
}

device_buffer& device_buffer::operator=(device_buffer&& o) noexcept {
    if (this != &o) {
        if (p_) cudaFree(p_);
        p_ = o.p_, n_ = o.n_;
        o.p_ = nullptr, o.n_ = 0;
    }
    return *this;
}

void device_buffer::upload(const void* src, size_t bytes) {
    TANSY_CHECK(bytes <= n_, "upload of %zu bytes into %zu", bytes, n_);
    CUDA_CHECK(cudaMemcpy(p_, src, bytes, cudaMemcpyHostToDevice));
}

void device_buffer::download(void* dst, size_t bytes) const {
    TANSY_CHECK(bytes <= n_, "download of %zu bytes from %zu", bytes, n_);
    CUDA_CHECK(cudaMemcpy(dst, p_, bytes, cudaMemcpyDeviceToHost));
}

}  // namespace tansy::cuda
