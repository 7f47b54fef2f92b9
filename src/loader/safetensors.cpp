#include "loader/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/json_util.h"

namespace tansy {

using json = nlohmann::json;

int64_t st_tensor::numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;  // validated not to overflow at parse time
    return n;
}

std::string st_tensor::shape_str() const {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); i++) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

// ------------------------------------------------------------------------------------------- parsing

static bool as_u64(const json& j, uint64_t* out) {
    if (j.is_number_unsigned()) {
        *out = j.get<uint64_t>();
        return true;
    }
    if (j.is_number_integer() && j.get<int64_t>() >= 0) {
        *out = (uint64_t)j.get<int64_t>();
        return true;
    }
    return false;
}

st_header parse_safetensors_header(std::string_view text, uint64_t data_size, const std::string& what) {
    if (text.size() > k_max_safetensors_header)
        fail("%s: safetensors header of %zu bytes is larger than the %llu-byte limit", what.c_str(), text.size(),
             (unsigned long long)k_max_safetensors_header);
    const json root =
        parse_json_object(text, what, "safetensors header is not valid JSON", "safetensors header must be a JSON object");

    st_header h;
    for (auto it = root.begin(); it != root.end(); ++it) {
        const std::string& name = it.key();
        const json& v = it.value();
        if (name == "__metadata__") {
            if (!v.is_object()) fail("%s: __metadata__ must be an object of strings", what.c_str());
            for (auto m = v.begin(); m != v.end(); ++m) {
                if (!m.value().is_string())
                    fail("%s: __metadata__[\"%s\"] is not a string", what.c_str(), m.key().c_str());
                h.metadata.emplace_back(m.key(), m.value().get<std::string>());
            }
            continue;
        }
        const char* nm = name.c_str();
        if (name.empty()) fail("%s: a tensor has an empty name", what.c_str());
        if (!v.is_object()) fail("%s: tensor '%s': entry is not an object", what.c_str(), nm);
        st_tensor t;
        t.name = name;

        auto dt = v.find("dtype");
        if (dt == v.end() || !dt->is_string()) fail("%s: tensor '%s': missing dtype", what.c_str(), nm);
        const auto& dts = dt->get_ref<const std::string&>();
        if (!dtype_from_name(dts.data(), dts.size(), &t.type))
            fail("%s: tensor '%s': unknown dtype '%s'", what.c_str(), nm, dts.c_str());

        auto sh = v.find("shape");
        if (sh == v.end() || !sh->is_array()) fail("%s: tensor '%s': missing shape", what.c_str(), nm);
        if (sh->size() > 8) fail("%s: tensor '%s': %zu dimensions is too many", what.c_str(), nm, sh->size());
        uint64_t numel = 1;
        for (const json& d : *sh) {
            uint64_t n;
            if (!as_u64(d, &n) || n > (uint64_t)INT64_MAX)
                fail("%s: tensor '%s': shape entries must be non-negative integers", what.c_str(), nm);
            if (__builtin_mul_overflow(numel, n, &numel) || numel > (uint64_t)INT64_MAX)
                fail("%s: tensor '%s': shape %s overflows", what.c_str(), nm, sh->dump().c_str());
            t.shape.push_back((int64_t)n);
        }

        auto off = v.find("data_offsets");
        if (off == v.end() || !off->is_array() || off->size() != 2 || !as_u64((*off)[0], &t.begin) ||
            !as_u64((*off)[1], &t.end))
            fail("%s: tensor '%s': data_offsets must be [begin, end] with non-negative integers", what.c_str(), nm);
        if (t.begin > t.end)
            fail("%s: tensor '%s': data_offsets [%llu, %llu] has begin > end", what.c_str(), nm,
                 (unsigned long long)t.begin, (unsigned long long)t.end);
        if (t.end > data_size)
            fail("%s: tensor '%s': data_offsets [%llu, %llu] reach past the data section (%llu bytes): "
                 "truncated file?",
                 what.c_str(), nm, (unsigned long long)t.begin, (unsigned long long)t.end,
                 (unsigned long long)data_size);
        uint64_t want;
        if (__builtin_mul_overflow(numel, (uint64_t)dtype_size(t.type), &want) || want != t.end - t.begin)
            fail("%s: tensor '%s': %s %s needs %llu bytes but data_offsets span %llu", what.c_str(), nm,
                 dts.c_str(), t.shape_str().c_str(), (unsigned long long)(numel * dtype_size(t.type)),
                 (unsigned long long)(t.end - t.begin));
        h.tensors.push_back(std::move(t));
    }

    std::sort(h.tensors.begin(), h.tensors.end(),
              [](const st_tensor& a, const st_tensor& b) { return a.begin < b.begin; });
    const st_tensor* prev = nullptr;
    for (const st_tensor& t : h.tensors) {
        if (t.begin == t.end) continue;  // empty tensors occupy no bytes
        if (prev && t.begin < prev->end)
            fail("%s: tensors '%s' and '%s' overlap (bytes [%llu, %llu) and [%llu, %llu))", what.c_str(),
                 prev->name.c_str(), t.name.c_str(), (unsigned long long)prev->begin, (unsigned long long)prev->end,
                 (unsigned long long)t.begin, (unsigned long long)t.end);
        prev = &t;
    }
    return h;
}

st_header parse_safetensors_image(const uint8_t* bytes, size_t size, const std::string& what) {
    if (size < 8) fail("%s: %zu bytes is too small to be a safetensors file", what.c_str(), size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | bytes[i];
    if (n > size - 8)
        fail("%s: header length %llu exceeds the file size (%zu bytes): truncated or not safetensors", what.c_str(),
             (unsigned long long)n, size);
    if (n < 2) fail("%s: header length %llu is too small", what.c_str(), (unsigned long long)n);
    std::string_view text((const char*)bytes + 8, (size_t)n);
    st_header h = parse_safetensors_header(text, size - 8 - n, what);
    const uint8_t* base = bytes + 8 + n;
    for (st_tensor& t : h.tensors) t.data = base + t.begin;
    return h;
}

// ------------------------------------------------------------------------------------------- mapping

mapped_file::mapped_file(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("%s: cannot open: %s", path.c_str(), strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        ::close(fd);
        fail("%s: cannot stat: %s", path.c_str(), strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        fail("%s: not a regular file", path.c_str());
    }
    size_ = (size_t)st.st_size;
    if (size_ > 0) {
        void* p = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            ::close(fd);
            fail("%s: mmap failed: %s", path.c_str(), strerror(e));
        }
        data_ = (const uint8_t*)p;
    }
    ::close(fd);
}

mapped_file::~mapped_file() {
    if (data_) munmap((void*)data_, size_);
}

mapped_file::mapped_file(mapped_file&& o) noexcept : data_(o.data_), size_(o.size_) {
    o.data_ = nullptr;
    o.size_ = 0;
}

mapped_file& mapped_file::operator=(mapped_file&& o) noexcept {
    if (this != &o) {
        if (data_) munmap((void*)data_, size_);
        data_ = o.data_;
        size_ = o.size_;
        o.data_ = nullptr;
        o.size_ = 0;
    }
    return *this;
}

st_file::st_file(const std::string& path) : path_(path), map_(path) {
    header_ = parse_safetensors_image(map_.data(), map_.size(), path_);
    for (st_tensor& t : header_.tensors) {
        t.file = &path_;
        by_name_[t.name] = &t;
    }
}

const st_tensor* st_file::find(std::string_view name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : it->second;
}

// ------------------------------------------------------------------------------------------- writing

std::string serialize_safetensors_header(const std::vector<st_out_tensor>& tensors,
                                         const std::vector<std::pair<std::string, std::string>>& metadata) {
    // Written by hand (not via json) to keep the tensors in the given order.
    std::string h = "{";
    bool first = true;
    if (!metadata.empty()) {
        json m = json::object();
        for (const auto& [k, v] : metadata) m[k] = v;
        h += "\"__metadata__\":" + m.dump();
        first = false;
    }
    uint64_t off = 0;
    for (const st_out_tensor& t : tensors) {
        uint64_t n = dtype_size(t.type);
        for (int64_t d : t.shape) n *= (uint64_t)d;
        json shape = t.shape;
        h += std::string(first ? "" : ",") + json(t.name).dump() + ":{\"dtype\":\"" + dtype_name(t.type) +
             "\",\"shape\":" + shape.dump() + ",\"data_offsets\":[" + std::to_string(off) + "," +
             std::to_string(off + n) + "]}";
        off += n;
        first = false;
    }
    h += "}";
    while (h.size() % 8) h += ' ';
    return h;
}

st_writer::st_writer(const std::string& path, const std::vector<st_out_tensor>& tensors,
                     const std::vector<std::pair<std::string, std::string>>& metadata)
    : path_(path), tmp_(path + ".tmp") {
    const std::string h = serialize_safetensors_header(tensors, metadata);
    for (const st_out_tensor& t : tensors) {
        uint64_t n = dtype_size(t.type);
        for (int64_t d : t.shape) n *= (uint64_t)d;
        sizes_.push_back(n);
    }
    f_ = std::fopen(tmp_.c_str(), "wb");
    if (!f_) fail("%s: cannot create: %s", tmp_.c_str(), strerror(errno));
    uint8_t len[8];
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)((uint64_t)h.size() >> (8 * i));
    if (std::fwrite(len, 1, 8, f_) != 8 || std::fwrite(h.data(), 1, h.size(), f_) != h.size())
        fail("%s: write failed: %s", tmp_.c_str(), strerror(errno));
}

st_writer::~st_writer() {
    if (f_) {
        std::fclose(f_);
        std::remove(tmp_.c_str());
    }
}

void st_writer::write(const void* data, size_t bytes) {
    TANSY_CHECK(next_ < sizes_.size(), "more tensors written than declared");
    TANSY_CHECK(bytes == sizes_[next_], "tensor %zu: %zu bytes written, %llu declared", next_, bytes,
                (unsigned long long)sizes_[next_]);
    next_++;
    if (bytes && std::fwrite(data, 1, bytes, f_) != bytes) fail("%s: write failed: %s", tmp_.c_str(), strerror(errno));
}

void st_writer::finish() {
    TANSY_CHECK(next_ == sizes_.size(), "%zu of %zu tensors written", next_, sizes_.size());
    FILE* f = f_;
    f_ = nullptr;
    if (std::fclose(f) != 0) {
        std::remove(tmp_.c_str());
        fail("%s: write failed: %s", path_.c_str(), strerror(errno));
    }
    if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
        std::remove(tmp_.c_str());
        fail("%s: cannot rename into place: %s", path_.c_str(), strerror(errno));
    }
}

void write_safetensors(const std::string& path, const std::vector<st_out_tensor>& tensors,
                       const std::vector<std::pair<std::string, std::string>>& metadata) {
    st_writer w(path, tensors, metadata);
    for (const st_out_tensor& t : tensors) {
        size_t n = dtype_size(t.type);
        for (int64_t d : t.shape) n *= (size_t)d;
        w.write(t.data, n);
    }
    w.finish();
}

}  // namespace tansy
