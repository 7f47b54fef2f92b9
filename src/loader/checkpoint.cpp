#include "loader/checkpoint.h"

#include <dirent.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "model/config.h"

namespace tansy {

using json = nlohmann::json;

static bool ends_with(const std::string& s, const char* suffix) {
    size_t n = strlen(suffix);
    return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

void checkpoint::add_file(const std::string& name) {
    files_.push_back(std::make_unique<st_file>(dir_ + "/" + name));
    for (const st_tensor& t : files_.back()->tensors()) {
        auto [it, fresh] = by_name_.emplace(t.name, &t);
        if (!fresh)
            fail("%s: tensor '%s' appears in both %s and %s", dir_.c_str(), t.name.c_str(), it->second->file->c_str(),
                 t.file->c_str());
    }
}

checkpoint::checkpoint(const std::string& dir) : dir_(dir) {
    if (!dir_exists(dir)) fail("%s: model directory does not exist", dir.c_str());
    std::string index = dir + "/model.safetensors.index.json";
    if (file_exists(index)) {
        json j;
        try {
            j = json::parse(read_text_file(index));
        } catch (const json::exception& e) {
            fail("%s: not valid JSON: %s", index.c_str(), e.what());
        }
        if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
            fail("%s: missing 'weight_map' object", index.c_str());
        std::map<std::string, std::vector<std::string>> by_file;  // sorted: deterministic open order
        for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
            if (!it->is_string()) fail("%s: weight_map['%s'] is not a file name", index.c_str(), it.key().c_str());
            std::string f = it->get<std::string>();
            if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
                fail("%s: weight_map['%s'] = '%s' is not a plain file name", index.c_str(), it.key().c_str(),
                     f.c_str());
            by_file[f].push_back(it.key());
        }
        if (by_file.empty()) fail("%s: weight_map is empty", index.c_str());
        for (const auto& [f, names] : by_file) {
            if (!file_exists(dir + "/" + f))
                fail("%s: shard '%s' listed in model.safetensors.index.json is missing", dir.c_str(), f.c_str());
            add_file(f);
            const st_file& sf = *files_.back();
            for (const std::string& n : names)
                if (!sf.find(n))
                    fail("%s: the index puts tensor '%s' in %s, which does not contain it", dir.c_str(), n.c_str(),
                         f.c_str());
        }
    } else if (file_exists(dir + "/model.safetensors")) {
        add_file("model.safetensors");
    } else {
        std::vector<std::string> names;
        if (DIR* d = opendir(dir.c_str())) {
            while (dirent* e = readdir(d)) {
                std::string n = e->d_name;
                if (ends_with(n, ".safetensors")) names.push_back(n);
            }
            closedir(d);
        }
        std::sort(names.begin(), names.end());
        if (names.empty()) fail("%s: no .safetensors files (and no model.safetensors.index.json)", dir.c_str());
        for (const std::string& n : names) add_file(n);
    }
}

const st_tensor* checkpoint::find(std::string_view name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : it->second;
}

const st_tensor& checkpoint::get(std::string_view name) const {
    const st_tensor* t = find(name);
    if (!t) fail("%s: missing tensor '%.*s'", dir_.c_str(), (int)name.size(), name.data());
    return *t;
}

std::vector<const st_tensor*> checkpoint::tensors() const {
    std::vector<const st_tensor*> out;
    for (const auto& f : files_)
        for (const st_tensor& t : f->tensors()) out.push_back(&t);
    return out;
}

size_t checkpoint::total_bytes() const {
    size_t n = 0;
    for (const auto& f : files_)
        for (const st_tensor& t : f->tensors()) n += t.nbytes();
    return n;
}

}  // namespace tansy
