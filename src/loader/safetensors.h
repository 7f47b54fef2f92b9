// safetensors: zero-copy reading (mmap) with full header validation, and a small writer.
// Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets:[begin,end]},
// "__metadata__": {str: str}}, then the data section; offsets are relative to the start of the data section.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/dtype.h"

namespace tansy {

struct st_tensor {
    std::string name;
    dtype type = dtype::f32;
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;    // byte range within the data section
    const uint8_t* data = nullptr;  // points into the mapping; may be unaligned (read with memcpy)
    const std::string* file = nullptr;  // the file it lives in, for messages

    int64_t numel() const;
    size_t nbytes() const { return (size_t)(end - begin); }
    std::string shape_str() const;  // "[4096, 256]"
};

struct st_header {
    std::vector<st_tensor> tensors;  // sorted by begin offset
    std::vector<std::pair<std::string, std::string>> metadata;
};

// Largest header we accept (the reference implementation uses the same 100 MB limit).
constexpr uint64_t k_max_safetensors_header = 100ull << 20;

// Parses and validates a JSON header for a data section of `data_size` bytes. `what` names the file in
// error messages. Throws tansy::error describing the first problem found.
st_header parse_safetensors_header(std::string_view json, uint64_t data_size, const std::string& what);

// Validates a complete in-memory safetensors image (length prefix + header + data). The fuzz target's entry.
st_header parse_safetensors_image(const uint8_t* bytes, size_t size, const std::string& what);

// A read-only memory mapping of a whole file.
class mapped_file {
  public:
    mapped_file() = default;
    explicit mapped_file(const std::string& path);  // throws tansy::error
    ~mapped_file();
    mapped_file(const mapped_file&) = delete;
    mapped_file& operator=(const mapped_file&) = delete;
    mapped_file(mapped_file&& o) noexcept;
    mapped_file& operator=(mapped_file&& o) noexcept;

    const uint8_t* data() const { return data_; }
    size_t size() const { return size_; }

  private:
    const uint8_t* data_ = nullptr;
    size_t size_ = 0;
};

class st_file {
  public:
    explicit st_file(const std::string& path);  // throws tansy::error
    const std::string& path() const { return path_; }
    const std::vector<st_tensor>& tensors() const { return header_.tensors; }
    const std::vector<std::pair<std::string, std::string>>& metadata() const { return header_.metadata; }
    const st_tensor* find(std::string_view name) const;

  private:
    std::string path_;
    mapped_file map_;
    st_header header_;
    std::unordered_map<std::string_view, const st_tensor*> by_name_;
};

// Writing. Tensors are written in the given order, header padded with spaces to a multiple of 8 bytes so
// that the data section is aligned.
struct st_out_tensor {
    std::string name;
    dtype type;
    std::vector<int64_t> shape;
    const void* data;  // numel * dtype_size bytes
};
std::string serialize_safetensors_header(const std::vector<st_out_tensor>& tensors,
                                         const std::vector<std::pair<std::string, std::string>>& metadata);
void write_safetensors(const std::string& path, const std::vector<st_out_tensor>& tensors,
                       const std::vector<std::pair<std::string, std::string>>& metadata = {});

// Streaming writer: the header is written from the tensors' dtypes and shapes (their data pointers are not
// used), then each tensor's bytes are appended in order with write(). The file appears under its name only
// when finish() succeeds (written to PATH.tmp, then renamed); a writer destroyed before that removes it.
class st_writer {
  public:
    st_writer(const std::string& path, const std::vector<st_out_tensor>& tensors,
              const std::vector<std::pair<std::string, std::string>>& metadata = {});
    ~st_writer();
    st_writer(const st_writer&) = delete;
    st_writer& operator=(const st_writer&) = delete;
    void write(const void* data, size_t bytes);  // the next tensor's bytes (exactly its size)
    void finish();

  private:
    std::string path_, tmp_;
    FILE* f_ = nullptr;
    std::vector<uint64_t> sizes_;
    size_t next_ = 0;
};

}  // namespace tansy
