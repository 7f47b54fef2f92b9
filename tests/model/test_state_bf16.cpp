// The bf16 DeltaNet state (--deltanet-state bf16) on the CPU reference: the tiny bf16 model's teacher window, every
// position a decode step of its own (the state stored, so rounded, after each token: the most rounding a sequence
// can see), against the same steps with the fp32 state. docs/QUALITY.md records the figures; the CUDA side is held
// to this reference by cuda_model.teacher_window_mlx4_bf16_state.
#include "golden.h"

using namespace tansy;

namespace {

// Measured (CPU, tiny-qwen35moe, token by token): the 256 positions this test takes: top-1 100%, mean KL 5.5e-6,
// NLL shift -1.6e-4 nats (1,024 positions: 99.9%, 6.7e-6, -5e-5). bf16 keeps 8 significant bits of each state
// entry, and the state decays (alpha < 1), so rounding errors do not pile up. These bounds leave ~10x room and still
// catch a state stored in a wrong layout or a lost update (KL 1e-2+).
constexpr double MIN_TOP1_BF16_STATE = 0.98;
constexpr double MAX_MEAN_KL_BF16_STATE = 1e-4;
constexpr double MAX_NLL_SHIFT_BF16_STATE = 0.002;  // nats
// Below this the rounding would not be in effect at all (the fp32 run repeats the same steps: KL exactly 0).
constexpr double MIN_MEAN_KL_BF16_STATE = 1e-8;
constexpr int64_t POSITIONS = 256;

}  // namespace

TEST(state_bf16, tiny_model_decode_steps) {
    const std::string dir = test::fixture("tiny-qwen35moe"), refp = test::fixture("tiny-reference.safetensors");
    ASSERT_FALSE(dir.empty() || refp.empty()) << "fixtures missing";
    test::golden ref(refp);
    const std::vector<int32_t> ids = ref.ints("teacher.ids");
    ASSERT_GT((int64_t)ids.size(), POSITIONS);
    const std::vector<int32_t> in(ids.begin(), ids.begin() + POSITIONS);
    // one thread each: hundreds of one-token steps (golden.h own_cpu_engine)
    auto p32 = test::own_cpu_engine(dir, 1), p16 = test::own_cpu_engine(dir, 1, /*state_bf16=*/true);
    engine &e32 = *p32, &e16 = *p16;
    const int64_t V = e32.cfg().vocab;
    const std::vector<float> a = test::prefill_then_decode(e32, in, 0), b = test::prefill_then_decode(e16, in, 0);
    const test::nearness_bounds bounds = {MIN_TOP1_BF16_STATE, MAX_MEAN_KL_BF16_STATE, MIN_MEAN_KL_BF16_STATE,
                                          MAX_NLL_SHIFT_BF16_STATE};
    test::expect_near_run("bf16 vs fp32 DeltaNet state, decode steps", a, b, POSITIONS, V, ids.data() + 1, bounds);
}
