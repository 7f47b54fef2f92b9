// The fixtures committed to the repo (tests/fixtures, and the .tar.xz archives unpacked into build/fixtures)
// must be byte-identical copies of the ground truth in ../shared/fixtures whenever that is present.
#include <filesystem>
#include <fstream>
#include <iterator>

#include "test_util.h"

namespace fs = std::filesystem;

namespace {

std::string slurp(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
}

// Every regular file under root except our own documentation and the archives themselves.
std::vector<fs::path> files_under(const fs::path& root) {
    std::vector<fs::path> out;
    if (!fs::exists(root)) return out;
    for (const auto& e : fs::recursive_directory_iterator(root)) {
        if (!e.is_regular_file()) continue;
        const std::string name = e.path().filename().string();
        if (name == "README.md" || e.path().extension() == ".xz") continue;
        out.push_back(fs::relative(e.path(), root));
    }
    return out;
}

}  // namespace

TEST(fixtures, committed_copies_are_byte_identical_to_shared) {
    const std::string shared = tansy::test::shared_fixtures_dir();
    if (shared.empty()) GTEST_SKIP() << "../shared/fixtures is absent (a user's machine): nothing to compare";
    int compared = 0;
    for (const fs::path& root : {fs::path(TANSY_SOURCE_DIR) / "tests" / "fixtures", fs::path(TANSY_BINARY_DIR) / "fixtures"}) {
        for (const fs::path& rel : files_under(root)) {
            const fs::path theirs = fs::path(shared) / rel;
            ASSERT_TRUE(fs::exists(theirs)) << rel << " is committed but has no counterpart in " << shared;
            EXPECT_TRUE(slurp(root / rel) == slurp(theirs)) << rel << " differs from " << theirs;
            compared++;
        }
    }
    EXPECT_GE(compared, 10) << "expected the committed fixture set (mlx4 model, references, tiny-gqa, tokenizers)";
}
