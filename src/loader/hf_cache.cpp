#include "loader/hf_cache.h"

#include <cctype>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/check.h"

namespace tansy {

namespace fs = std::filesystem;

namespace {

// Hub repo names: letters, digits, '-', '_', '.' (no "..", not starting with '.' or '-').
bool repo_part_ok(const std::string& s) {
    if (s.empty() || s.size() > 96 || s[0] == '.' || s[0] == '-' || s.find("..") != std::string::npos) return false;
    for (char c : s)
        if (!(std::isalnum((unsigned char)c) || c == '-' || c == '_' || c == '.')) return false;
    return true;
}

// A revision: a branch, tag (may hold '/', as in refs/pr/1) or commit hash; never a path out of the repo.
bool rev_ok(const std::string& s) {
    if (s.empty() || s[0] == '/' || s.find("..") != std::string::npos) return false;
    for (char c : s)
        if (!(std::isalnum((unsigned char)c) || c == '-' || c == '_' || c == '.' || c == '/')) return false;
    return true;
}

std::string read_ref(const fs::path& p) {
    std::ifstream f(p);
    std::string s;
    std::getline(f, s);
    while (!s.empty() && std::isspace((unsigned char)s.back())) s.pop_back();
    return s;
}

}  // namespace

std::string hf_hub_cache_dir(const std::string& hf_hub_cache, const std::string& hf_home, const std::string& home) {
    if (!hf_hub_cache.empty()) return hf_hub_cache;
    if (!hf_home.empty()) return (fs::path(hf_home) / "hub").string();
    if (!home.empty()) return (fs::path(home) / ".cache" / "huggingface" / "hub").string();
    return "";
}

bool is_hf_repo_id(const std::string& arg) {
    const size_t at = arg.find('@');
    const std::string id = arg.substr(0, at);
    const size_t slash = id.find('/');
    if (slash == std::string::npos || id.find('/', slash + 1) != std::string::npos) return false;
    if (!repo_part_ok(id.substr(0, slash)) || !repo_part_ok(id.substr(slash + 1))) return false;
    return at == std::string::npos || rev_ok(arg.substr(at + 1));
}

std::string hf_repo_name(const std::string& arg) { return is_hf_repo_id(arg) ? arg.substr(0, arg.find('@')) : ""; }

std::string resolve_model_path(const std::string& arg, const std::string& cache) {
    std::error_code ec;
    if (arg.empty() || fs::exists(arg, ec) || !is_hf_repo_id(arg)) return arg;
    const size_t at = arg.find('@');
    const std::string id = arg.substr(0, at);
    const std::string rev = at == std::string::npos ? "main" : arg.substr(at + 1);
    const std::string org = id.substr(0, id.find('/')), name = id.substr(id.find('/') + 1);
    const std::string fetch = "hf download " + id + (rev == "main" ? "" : " --revision " + rev);
    if (cache.empty())
        fail("--model '%s' is not a directory, and no Hugging Face cache to look in (set HF_HUB_CACHE, HF_HOME or "
             "HOME); fetch it with: %s", arg.c_str(), fetch.c_str());
    const fs::path repo = fs::path(cache) / ("models--" + org + "--" + name);
    if (!fs::is_directory(repo, ec))
        fail("--model '%s' is not a directory, and %s is not in the Hugging Face cache (looked for %s; the cache "
             "is $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub); fetch it with: %s",
             arg.c_str(), id.c_str(), repo.string().c_str(), fetch.c_str());
    // 1. a branch or tag: refs/REV holds the commit hash
    std::string hash;
    if (fs::is_regular_file(repo / "refs" / rev, ec)) hash = read_ref(repo / "refs" / rev);
    // 2. a commit hash, or a unique prefix of one (7+ characters, as git shows them)
    if (hash.empty() && fs::is_directory(repo / "snapshots" / rev, ec)) hash = rev;
    if (hash.empty() && rev.size() >= 7) {
        std::vector<std::string> hits;
        for (const auto& e : fs::directory_iterator(repo / "snapshots", ec))
            if (e.path().filename().string().rfind(rev, 0) == 0) hits.push_back(e.path().filename().string());
        if (hits.size() > 1)
            fail("--model '%s': revision '%s' is ambiguous in %s (%zu snapshots start with it)", arg.c_str(),
                 rev.c_str(), (repo / "snapshots").string().c_str(), hits.size());
        if (hits.size() == 1) hash = hits[0];
    }
    if (hash.empty())
        fail("--model '%s': revision '%s' of %s is not in the Hugging Face cache (looked for %s and %s); fetch it "
             "with: %s", arg.c_str(), rev.c_str(), id.c_str(), (repo / "refs" / rev).string().c_str(),
             (repo / "snapshots" / rev).string().c_str(), fetch.c_str());
    const fs::path snap = repo / "snapshots" / hash;
    if (!fs::is_regular_file(snap / "config.json", ec))  // follows the blob symlink
        fail("--model '%s': the cached snapshot %s is incomplete (no config.json); fetch it with: %s", arg.c_str(),
             snap.string().c_str(), fetch.c_str());
    return snap.string();
}

}  // namespace tansy
