#include "cli/args.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/check.h"
#include "loader/hf_cache.h"
#include "model/config.h"
#include "runtime/engine.h"

namespace tansy {

arg_parser::arg_parser(std::string command, std::string synopsis, std::string description)
    : command_(std::move(command)), synopsis_(std::move(synopsis)), description_(std::move(description)) {
    option("--help", "", "show this help", "-h");
}

arg_parser& arg_parser::option(const std::string& name, const std::string& metavar, const std::string& help,
                               const std::string& alias, bool repeatable) {
    specs_.push_back({name, metavar, help, alias, repeatable});
    return *this;
}

const arg_parser::spec* arg_parser::lookup(const std::string& s) const {
    for (const spec& sp : specs_)
        if (sp.name == s || (!sp.alias.empty() && sp.alias == s)) return &sp;
    return nullptr;
}

bool arg_parser::parse(int argc, char** argv) {
    for (int i = 0; i < argc; i++) {
        std::string a = argv[i], value;
        bool inline_value = false;
        if (a.rfind("--", 0) == 0) {
            size_t eq = a.find('=');
            if (eq != std::string::npos) {
                value = a.substr(eq + 1);
                a = a.substr(0, eq);
                inline_value = true;
            }
        }
        const spec* sp = lookup(a);
        if (!sp) {
            if (a.empty() || a[0] != '-')
                fail("%s: unexpected argument '%s' (see 'tansy %s --help')", command_.c_str(), a.c_str(),
                     command_.c_str());
            fail("%s: unknown option '%s' (see 'tansy %s --help')", command_.c_str(), a.c_str(), command_.c_str());
        }
        if (sp->name == "--help") {
            fputs(help().c_str(), stdout);
            return false;
        }
        if (sp->metavar.empty()) {
            if (inline_value) fail("%s: option %s takes no value", command_.c_str(), sp->name.c_str());
            value.assign(1, '1');  // not `= "1"`: GCC 12 warns -Wrestrict on that, falsely
        } else if (!inline_value) {
            if (i + 1 >= argc) fail("%s: option %s needs a value (%s)", command_.c_str(), sp->name.c_str(), sp->metavar.c_str());
            value = argv[++i];
        }
        auto& v = values_[sp->name];
        if (!v.empty() && !sp->repeatable)
            fail("%s: option %s given more than once", command_.c_str(), sp->name.c_str());
        v.push_back(value);
    }
    return true;
}

bool arg_parser::has(const std::string& name) const { return values_.count(name) > 0; }

std::string arg_parser::str(const std::string& name, const std::string& dflt) const {
    auto it = values_.find(name);
    return it == values_.end() ? dflt : it->second.back();
}

std::vector<std::string> arg_parser::all(const std::string& name) const {
    auto it = values_.find(name);
    return it == values_.end() ? std::vector<std::string>{} : it->second;
}

int64_t arg_parser::integer(const std::string& name, int64_t dflt) const {
    if (!has(name)) return dflt;
    std::string s = str(name);
    char* end = nullptr;
    errno = 0;
    long long v = strtoll(s.c_str(), &end, 10);
    if (s.empty() || *end || errno) fail("%s: %s expects an integer, got '%s'", command_.c_str(), name.c_str(), s.c_str());
    return v;
}

double arg_parser::number(const std::string& name, double dflt) const {
    if (!has(name)) return dflt;
    std::string s = str(name);
    char* end = nullptr;
    errno = 0;
    double v = strtod(s.c_str(), &end);
    if (s.empty() || *end || errno) fail("%s: %s expects a number, got '%s'", command_.c_str(), name.c_str(), s.c_str());
    return v;
}

std::string arg_parser::help() const {
    std::string h = "usage: tansy " + command_ + " " + synopsis_ + "\n\n" + description_ + "\n\noptions:\n";
    for (const spec& sp : specs_) {
        std::string left = "  " + (sp.alias.empty() ? "" : sp.alias + ", ") + sp.name +
                           (sp.metavar.empty() ? "" : " " + sp.metavar);
        if (left.size() < 28) left.resize(28, ' ');
        else left += "\n" + std::string(28, ' ');
        h += left + sp.help + "\n";
    }
    return h;
}

std::vector<int32_t> read_ids_file(const std::string& path) {
    if (!file_exists(path)) fail("%s: no such file", path.c_str());
    std::string text = read_text_file(path);
    std::vector<int32_t> ids;
    size_t i = 0, n = text.size();
    while (i < n) {
        char c = text[i];
        if (isspace((unsigned char)c) || c == ',' || (ids.empty() && c == '[') || c == ']') {
            i++;
            continue;
        }
        size_t j = i;
        while (j < n && !isspace((unsigned char)text[j]) && text[j] != ',' && text[j] != ']') j++;
        std::string tok = text.substr(i, j - i);
        char* end = nullptr;
        errno = 0;
        long long v = strtoll(tok.c_str(), &end, 10);
        if (*end || errno || v < 0 || v > INT32_MAX)
            fail("%s: '%s' (entry %zu) is not a token id (a non-negative integer)", path.c_str(), tok.c_str(),
                 ids.size() + 1);
        ids.push_back((int32_t)v);
        i = j;
    }
    if (ids.empty()) fail("%s: contains no token ids", path.c_str());
    return ids;
}

static std::string env(const char* name) {
    const char* v = std::getenv(name);
    return v ? v : "";
}

std::string hf_hub_cache_dir() { return tansy::hf_hub_cache_dir(env("HF_HUB_CACHE"), env("HF_HOME"), env("HOME")); }

std::string default_model_dir() {
    const std::string m = env("TANSY_MODEL");
    return m.empty() ? bundled_model_dir() : resolve_model_path(m, hf_hub_cache_dir());
}

std::string model_path_arg(const arg_parser& p, const std::string& name, const std::string& dflt) {
    return p.has(name) ? resolve_model_path(p.str(name), hf_hub_cache_dir()) : dflt;
}

}  // namespace tansy
