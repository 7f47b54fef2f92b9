#include "backend/cuda/common.cuh"
#include "backend/cuda/device.h"

#include <cstdint>
#include <mutex>

#include "core/check.h"

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

namespace {

// The current device's default pool, set once to keep what is freed (the default threshold of 0 would hand
// blocks back to the device at every synchronisation).
cudaMemPool_t stream_pool() {
    static std::once_flag once;
    static cudaMemPool_t pool;
    std::call_once(once, [] {
        int dev = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
        uint64_t keep = UINT64_MAX;
        CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    });
    return pool;
}

}  // namespace

size_t trim_stream_pool() {
    const cudaMemPool_t pool = stream_pool();
    CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
    uint64_t held = 0;
    CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &held));
    return (size_t)held;
}

device_buffer::device_buffer(size_t bytes) : n_(bytes) {
    if (!bytes) return;
    cudaError_t e = cudaMalloc(&p_, bytes);
    if (e == cudaErrorMemoryAllocation) {  // the stream pool may hold what is missing: give it back, once
        cudaGetLastError();
        CUDA_CHECK(cudaDeviceSynchronize());  // blocks freed in stream order become free
        trim_stream_pool();
        e = cudaMalloc(&p_, bytes);
    }
    CUDA_CHECK(e);
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

stream_buffer::stream_buffer(size_t bytes, CUstream_st* stream) : n_(bytes), stream_(stream) {
    if (!bytes) return;
    const cudaError_t e = cudaMallocFromPoolAsync(&p_, bytes, stream_pool(), stream);
    if (e == cudaErrorMemoryAllocation) {
        cudaGetLastError();  // not sticky: the device stays usable
        p_ = nullptr, n_ = 0;
        size_t free_b = 0, total = 0;
        cudaMemGetInfo(&free_b, &total);
        fail("CUDA: out of device memory for %.1f MiB of sequence state (%.1f MiB free of %.1f GiB)",
             (double)bytes / (1 << 20), (double)free_b / (1 << 20), (double)total / (1 << 30));
    }
    CUDA_CHECK(e);
}

stream_buffer::~stream_buffer() {
    if (p_) cudaFreeAsync(p_, stream_);
}

stream_buffer& stream_buffer::operator=(stream_buffer&& o) noexcept {
    if (this != &o) {
        if (p_) cudaFreeAsync(p_, stream_);
        p_ = o.p_, n_ = o.n_, stream_ = o.stream_;
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
