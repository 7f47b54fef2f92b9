// Prompts processed in bounded chunks (forward_pass::prefill, engine_options::prefill_chunk) give the results of
// one pass over the whole prompt: logits equal up to fp32 summation order, greedy continuations identical, and
// the activation workspace never holds more rows than a chunk.
#include "golden.h"
#include "sampling/sampler.h"

using namespace tansy;

namespace {

// A chunk boundary only moves where the delta rule switches from its chunked form to the carried state and
// where attention reads keys back from the cache: the same math in another fp32 order (the prefill-then-decode
// split tests in test_consistency.cpp see ~1e-6 after 300 tokens).
constexpr double TOL_CHUNKED_REL = 1e-5;
// The golden logits' bound (test_golden.cpp TOL_LOGITS_REL).
constexpr double TOL_GOLDEN_REL = 1e-5;
constexpr int64_t CHUNKS[] = {1, 7, 64, 1000};
constexpr int64_t GREEDY_TOKENS = 24;

// Sets the shared engine's chunk for one scope.
struct chunk_scope {
    forward_pass& f;
    int64_t saved;
    chunk_scope(engine& e, int64_t chunk) : f(e.fwd()), saved(e.fwd().prefill_chunk) { f.prefill_chunk = chunk; }
    ~chunk_scope() { f.prefill_chunk = saved; }
};

std::vector<int32_t> greedy(engine& e, const std::vector<int32_t>& prompt, int64_t n) {
    auto st = e.new_sequence((int64_t)prompt.size() + n);
    generation_request req;
    req.prompt = prompt;
    req.max_tokens = n;
    std::vector<int32_t> out;
    e.generate(*st, req, [&](int32_t id) {
        out.push_back(id);
        return true;
    });
    return out;
}

}  // namespace

// The 4-bit fixture is committed; the bf16 one (with golden greedy continuations) is in ../shared/fixtures.
class prefill_chunks : public ::testing::TestWithParam<const char*> {
  protected:
    void SetUp() override {
        dir_ = test::fixture(GetParam());
        const std::string refp = test::fixture("tiny-reference.safetensors");
        if (dir_.empty() || refp.empty()) GTEST_SKIP() << GetParam() << " or the golden tensors are absent";
        ref_ = std::make_unique<test::golden>(refp);
        q4_ = std::string(GetParam()).find("mlx4") != std::string::npos;
    }
    engine& eng() { return test::cpu_engine(dir_); }
    std::string dir_;
    std::unique_ptr<test::golden> ref_;
    bool q4_ = false;
};

TEST_P(prefill_chunks, all_logits_equal_one_pass) {
    const auto ids = ref_->ints("prompt5.ids");  // 300 tokens
    const int64_t T = (int64_t)ids.size();
    ASSERT_LT(T, forward_pass::DEFAULT_PREFILL_CHUNK);
    auto st = eng().new_sequence(T);
    const auto one_pass = eng().step(*st, ids, logits_rows::all);
    for (int64_t chunk : CHUNKS) {
        chunk_scope cs(eng(), chunk);
        auto s = eng().new_sequence(T);
        const auto got = eng().step(*s, ids, logits_rows::all);
        EXPECT_EQ(s->n_past(), T) << "chunk " << chunk;
        ASSERT_EQ(got.size(), one_pass.size()) << "chunk " << chunk;
        EXPECT_LT(test::rel_error(got, one_pass), TOL_CHUNKED_REL) << "chunk " << chunk;
    }
    // and against the reference implementation, chunked
    const std::string key = q4_ ? "prompt4.q4_logits" : "prompt4.logits";
    const auto ids4 = ref_->ints("prompt4.ids");  // 130 tokens
    chunk_scope cs(eng(), 7);
    auto s = eng().new_sequence((int64_t)ids4.size());
    EXPECT_LT(test::rel_error(eng().step(*s, ids4, logits_rows::all), ref_->floats(key)), TOL_GOLDEN_REL);
}

TEST_P(prefill_chunks, last_logits_and_continuation_from_a_cached_prefix) {
    const auto ids = ref_->ints("prompt5.ids");
    const int64_t T = (int64_t)ids.size(), V = eng().cfg().vocab;
    auto st = eng().new_sequence(T);
    const auto all = eng().step(*st, ids, logits_rows::all);
    const std::vector<float> last(all.end() - V, all.end());
    const std::vector<int32_t> head(ids.begin(), ids.begin() + 100), tail(ids.begin() + 100, ids.end());
    for (int64_t chunk : CHUNKS) {
        chunk_scope cs(eng(), chunk);
        auto s = eng().new_sequence(T);
        EXPECT_LT(test::rel_error(eng().step(*s, ids, logits_rows::last), last), TOL_CHUNKED_REL) << "chunk " << chunk;
        // a prefix already in the state, the rest in chunks
        auto s2 = eng().new_sequence(T);
        EXPECT_TRUE(eng().step(*s2, head, logits_rows::none).empty());
        EXPECT_EQ(s2->n_past(), 100);
        const auto rest = eng().step(*s2, tail, logits_rows::all);
        const std::vector<float> want(all.begin() + 100 * V, all.end());
        EXPECT_LT(test::rel_error(rest, want), TOL_CHUNKED_REL) << "chunk " << chunk;
    }
}

TEST_P(prefill_chunks, greedy_continuations_are_identical) {
    const auto ids = ref_->ints("prompt5.ids");
    const auto want = greedy(eng(), ids, GREEDY_TOKENS);
    ASSERT_EQ((int64_t)want.size(), GREEDY_TOKENS);
    if (!q4_) {
        EXPECT_EQ(want, ref_->ints("prompt5.greedy"));  // golden continuations are the bf16 model's
    }
    for (int64_t chunk : CHUNKS) {
        chunk_scope cs(eng(), chunk);
        EXPECT_EQ(greedy(eng(), ids, GREEDY_TOKENS), want) << "chunk " << chunk;
    }
}

INSTANTIATE_TEST_SUITE_P(fixtures, prefill_chunks, ::testing::Values("tiny-qwen35moe-mlx4", "tiny-qwen35moe"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                             std::string s = i.param;
                             for (char& c : s)
                                 if (!isalnum((unsigned char)c)) c = '_';
                             return s;
                         });

TEST(prefill_chunk_option, bounds_the_workspace_and_is_validated) {
    TANSY_REQUIRE_FIXTURE(dir, "tiny-qwen35moe-mlx4");
    engine_options o;
    o.model_dir = dir;
    o.prefill_chunk = 64;
    engine e(o);  // its own engine: the shared one's workspace has seen longer steps
    EXPECT_EQ(e.fwd().prefill_chunk, 64);
    std::vector<int32_t> ids;
    for (int i = 0; i < 300; i++) ids.push_back((i * 37 + 11) % 4000);
    EXPECT_EQ((int64_t)greedy(e, ids, 4).size(), 4);
    auto st = e.new_sequence((int64_t)ids.size());
    EXPECT_EQ(e.step(*st, ids, logits_rows::all).size(), ids.size() * (size_t)e.cfg().vocab);
    EXPECT_EQ(e.fwd().workspace_rows(), 64);
    // a prompt beyond the state's capacity fails before its first chunk touches the state
    auto small = e.new_sequence(100);
    EXPECT_THROW(e.step(*small, ids, logits_rows::last), tansy::error);
    EXPECT_EQ(small->n_past(), 0);

    o.prefill_chunk = 0;  // the default
    EXPECT_EQ(engine(o).fwd().prefill_chunk, forward_pass::DEFAULT_PREFILL_CHUNK);
    o.prefill_chunk = -1;
    EXPECT_THROW(engine{o}, tansy::error);
}
