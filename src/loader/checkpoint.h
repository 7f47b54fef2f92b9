// A checkpoint directory: one model.safetensors, or shards listed by model.safetensors.index.json, or every
// *.safetensors file in the directory. All files stay mapped for the checkpoint's lifetime.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loader/safetensors.h"

namespace tansy {

class checkpoint {
  public:
    explicit checkpoint(const std::string& dir);  // throws tansy::error

    const std::string& dir() const { return dir_; }
    const st_tensor* find(std::string_view name) const;  // nullptr when absent
    const st_tensor& get(std::string_view name) const;   // throws "missing tensor"
    std::vector<const st_tensor*> tensors() const;        // every tensor of every shard
    size_t n_files() const { return files_.size(); }
    size_t total_bytes() const;

  private:
    void add_file(const std::string& name);
    std::string dir_;
    std::vector<std::unique_ptr<st_file>> files_;
    std::unordered_map<std::string_view, const st_tensor*> by_name_;
};

}  // namespace tansy
