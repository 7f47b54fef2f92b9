// --model ORG/NAME[@REV]: checkpoints found in a Hugging Face hub cache laid out as `hf download` leaves it
// (snapshot files are symlinks into blobs/), for the resolver and through the tansy binary.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "cli/args.h"
#include "core/check.h"
#include "loader/hf_cache.h"
#include "server/http.h"
#include "synth_model.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace {

const std::string CLI = TANSY_CLI;
const std::string TINY = TANSY_SOURCE_DIR "/models/tiny-chat-q4";
const std::string HASH = "0123456789abcdef0123456789abcdef01234567";  // a commit hash as the hub writes it

// CACHE/models--ORG--NAME with refs/main and refs/v1 -> HASH, snapshots/HASH/* -> ../../blobs/*. Without
// config.json when `complete` is false (an interrupted download).
void make_cached_repo(const std::string& cache, const std::string& org, const std::string& name, bool complete) {
    const fs::path repo = fs::path(cache) / ("models--" + org + "--" + name);
    fs::create_directories(repo / "blobs");
    fs::create_directories(repo / "refs");
    fs::create_directories(repo / "snapshots" / HASH);
    int i = 0;
    for (const auto& e : fs::directory_iterator(TINY)) {
        const std::string file = e.path().filename().string();
        if (!complete && file == "config.json") continue;
        const std::string blob = "b10b" + std::to_string(i++);  // stands in for the file's sha256
        fs::copy_file(e.path(), repo / "blobs" / blob);
        fs::create_symlink(fs::path("../../blobs") / blob, repo / "snapshots" / HASH / file);
    }
    tansy::test::write_file((repo / "refs" / "main").string(), HASH);  // no newline, as the hub writes it
    tansy::test::write_file((repo / "refs" / "v1").string(), HASH + "\n");
}

// Sets an environment variable for one test and restores it after.
struct scoped_env {
    std::string name, old;
    bool had;
    scoped_env(const char* n, const char* v) : name(n), had(std::getenv(n) != nullptr) {
        if (had) old = std::getenv(n);
        if (v) setenv(n, v, 1);
        else unsetenv(n);
    }
    ~scoped_env() {
        if (had) setenv(name.c_str(), old.c_str(), 1);
        else unsetenv(name.c_str());
    }
};

// As the command line resolves --model: in the cache the environment names.
std::string resolve(const std::string& arg) { return tansy::resolve_model_path(arg, tansy::hf_hub_cache_dir()); }

std::string error_of(const std::string& arg) {
    try {
        resolve(arg);
    } catch (const tansy::error& e) {
        return e.what();
    }
    return "";
}

}  // namespace

TEST(hf_cache, cache_dir_follows_the_hub_environment) {
    scoped_env a("HF_HUB_CACHE", "/x/hub-cache"), b("HF_HOME", "/y/hf"), c("HOME", "/z");
    EXPECT_EQ(tansy::hf_hub_cache_dir(), "/x/hub-cache");
    unsetenv("HF_HUB_CACHE");
    EXPECT_EQ(tansy::hf_hub_cache_dir(), "/y/hf/hub");
    unsetenv("HF_HOME");
    EXPECT_EQ(tansy::hf_hub_cache_dir(), "/z/.cache/huggingface/hub");
}

TEST(hf_cache, repo_ids_and_paths) {
    for (const char* id : {"Qwen/Qwen3.6-35B-A3B", "org/name@main", "org/name@refs/pr/1", "a-b/c_d.e@0123abc"})
        EXPECT_TRUE(tansy::is_hf_repo_id(id)) << id;
    for (const char* p : {"name", "/abs/dir", "./org/name", "a/b/c", "org/", "/org/name", "org/..", "org/name@",
                          "org/name@../x", "org/na me"})
        EXPECT_FALSE(tansy::is_hf_repo_id(p)) << p;
    EXPECT_EQ(tansy::hf_repo_name("org/name@v1"), "org/name");
    // anything that is no repo id goes to the loader unchanged (it reports missing paths itself)
    EXPECT_EQ(resolve("/nonexistent"), "/nonexistent");
    EXPECT_EQ(resolve(TINY), TINY);
}

TEST(hf_cache, resolves_refs_hashes_and_prefixes) {
    const std::string cache = tansy::test::temp_dir("hf_cache");
    make_cached_repo(cache, "acme", "tiny", true);
    scoped_env e("HF_HUB_CACHE", cache.c_str());
    const std::string snap = cache + "/models--acme--tiny/snapshots/" + HASH;
    EXPECT_EQ(resolve("acme/tiny"), snap);
    EXPECT_EQ(resolve("acme/tiny@main"), snap);
    EXPECT_EQ(resolve("acme/tiny@v1"), snap);  // a ref file with a trailing newline
    EXPECT_EQ(resolve("acme/tiny@" + HASH), snap);
    EXPECT_EQ(resolve("acme/tiny@" + HASH.substr(0, 7)), snap);
}

TEST(hf_cache, an_existing_directory_wins_over_a_repo_id) {
    const std::string cache = tansy::test::temp_dir("hf_cache");
    make_cached_repo(cache, "acme", "tiny", true);
    const std::string cwd = tansy::test::temp_dir("hf_cwd");
    fs::create_directories(cwd + "/acme/tiny");
    scoped_env e("HF_HUB_CACHE", cache.c_str());
    const fs::path old = fs::current_path();
    fs::current_path(cwd);
    const std::string got = resolve("acme/tiny");
    fs::current_path(old);
    EXPECT_EQ(got, "acme/tiny");
}

TEST(hf_cache, missing_or_incomplete_repos_say_where_and_how_to_fetch) {
    const std::string cache = tansy::test::temp_dir("hf_cache");
    make_cached_repo(cache, "acme", "partial", false);
    scoped_env e("HF_HUB_CACHE", cache.c_str());
    std::string m = error_of("acme/missing");
    EXPECT_NE(m.find(cache + "/models--acme--missing"), std::string::npos) << m;
    EXPECT_NE(m.find("HF_HUB_CACHE"), std::string::npos) << m;
    EXPECT_NE(m.find("hf download acme/missing"), std::string::npos) << m;
    m = error_of("acme/partial");
    EXPECT_NE(m.find("no config.json"), std::string::npos) << m;
    EXPECT_NE(m.find("hf download acme/partial"), std::string::npos) << m;
    m = error_of("acme/partial@v9");
    EXPECT_NE(m.find(cache + "/models--acme--partial/refs/v9"), std::string::npos) << m;
    EXPECT_NE(m.find("hf download acme/partial --revision v9"), std::string::npos) << m;
}

TEST(hf_cache, cli_commands_take_a_repo_id) {
    const std::string cache = tansy::test::temp_dir("hf_cache");
    make_cached_repo(cache, "acme", "tiny", true);
    const std::string env = "HF_HUB_CACHE=" + cache + " ";
    const std::string args = " --prompt 'Say hi.' -n 12 2>/dev/null";
    std::string want, got;
    ASSERT_EQ(tansy::test::run_command(CLI + " run --model " + TINY + args, &want, false), 0);
    ASSERT_FALSE(want.empty());
    for (const std::string& rev : {std::string(), std::string("@main"), std::string("@v1"), "@" + HASH}) {
        ASSERT_EQ(tansy::test::run_command(env + CLI + " run --model acme/tiny" + rev + args, &got, false), 0) << rev;
        EXPECT_EQ(got, want) << rev;
    }
    // $TANSY_MODEL takes a repo id too (the model without --model)
    ASSERT_EQ(tansy::test::run_command(env + "TANSY_MODEL=acme/tiny " + CLI + " run" + args, &got, false), 0);
    EXPECT_EQ(got, want);
    // info names the snapshot; tokenize reads its tokenizer.json through the blob symlink
    ASSERT_EQ(tansy::test::run_command(env + CLI + " info --model acme/tiny 2>/dev/null", &got, false), 0);
    EXPECT_NE(got.find("snapshots/" + HASH), std::string::npos) << got;
    ASSERT_EQ(tansy::test::run_command(env + CLI + " tokenize --model acme/tiny --text hi 2>/dev/null", &got, false), 0);
    EXPECT_FALSE(got.empty());
    // a missing repo: exit 1, one line naming the path and the fetch command
    std::string err;
    EXPECT_EQ(tansy::test::run_command(env + CLI + " run --model acme/missing --prompt hi", &err), 1);
    EXPECT_NE(err.find(cache + "/models--acme--missing"), std::string::npos) << err;
    EXPECT_NE(err.find("hf download acme/missing"), std::string::npos) << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
}

// tansy serve --model ORG/NAME: served under that name, and it answers.
TEST(hf_cache, serve_takes_a_repo_id) {
    if (!tansy::http_available()) GTEST_SKIP() << "built without the HTTP server (no Asio headers)";
    const std::string cache = tansy::test::temp_dir("hf_cache_serve");
    make_cached_repo(cache, "acme", "tiny", true);
    const std::string log = cache + "/serve.log";
    const pid_t pid = fork();
    if (pid == 0) {
        setenv("HF_HUB_CACHE", cache.c_str(), 1);
        freopen(log.c_str(), "w", stderr);
        execl(CLI.c_str(), CLI.c_str(), "serve", "--model", "acme/tiny", "--port", "0", "--threads", "1", (char*)nullptr);
        _exit(127);
    }
    ASSERT_GT(pid, 0);
    struct reap {
        pid_t pid;
        ~reap() {
            kill(pid, SIGKILL);
            waitpid(pid, nullptr, 0);
        }
    } guard{pid};
    int port = 0;
    for (int i = 0; i < 600 && port == 0; i++) {  // "listening on http://127.0.0.1:PORT", within 60 s
        std::string text;
        tansy::test::run_command("cat " + log, &text, false);
        const size_t at = text.find("listening on http://127.0.0.1:");
        if (at != std::string::npos) port = std::atoi(text.c_str() + at + 30);
        if (port == 0) usleep(100000);
    }
    ASSERT_GT(port, 0) << "the server did not start";
    for (int i = 0; i < 600 && tansy::test::get_json(port, "/health").status != 200; i++) usleep(100000);  // loading
    const tansy::test::json_reply models = tansy::test::get_json(port, "/v1/models");
    ASSERT_EQ(models.status, 200);
    EXPECT_EQ(models.body["data"][0]["id"], "acme/tiny") << models.body.dump();
    const tansy::test::json_reply r = tansy::test::post_json(
        port, "/v1/chat/completions",
        R"({"model": "acme/tiny", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0})");
    EXPECT_EQ(r.status, 200) << r.body.dump();
    EXPECT_EQ(r.body["model"], "acme/tiny") << r.body.dump();
}
