// The CUDA sampler (sample.cu) against its CPU twin, the host sampler (sampling/sampler.cpp): the same candidates
// and the same arithmetic (sampling/sampler_math.h), so the same draws from the same logits and seeds, over
// full-size rows (248,320 ids, padding ids excluded, a row stride wider than the row) shaped to hit every step:
// a broad body with a peaked head, a run of tied top logits wider than top-k, rows of -inf with a few finite
// tokens, flat rows, and rows with an infinite or NaN logit.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/device.h"
#include "backend/cuda/misc.cuh"
#include "backend/cuda/sample.cuh"
#include "cuda_test_util.h"
#include "sampling/sampler.h"
#include "sampling/sampler_math.h"

using namespace tansy;

namespace {

// Every draw equal: both sides compute the same candidates and the same floats (no FMA contraction on either
// side, sums in one fixed order in double); a wrong candidate set, order or weight changes draws at once.
constexpr double MIN_SAME_DRAWS = 1.0;

std::vector<float> make_row(int64_t n, int kind, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> body(0.0f, 3.0f);
    std::vector<float> l((size_t)n);
    const float inf = std::numeric_limits<float>::infinity();
    switch (kind) {
        case 0:  // trained-model-like: broad body, peaked head
            for (float& x : l) x = body(rng);
            for (int i = 0; i < 30; i++) l[rng() % (uint64_t)n] += 10.0f + (float)i * 0.1f;
            break;
        case 1:  // 200 ids tied at the top (top-k takes the lowest ids among them), the rest below
            for (float& x : l) x = body(rng) - 20.0f;
            for (int i = 0; i < 200; i++) l[(size_t)((1000 + 37 * i) % n)] = 5.0f;
            break;
        case 2:  // -inf (a constraint's mask) but for 12 tokens
            for (float& x : l) x = -inf;
            for (int i = 0; i < 12; i++) l[rng() % (uint64_t)n] = body(rng);
            break;
        case 3:  // flat
            for (float& x : l) x = 1.5f;
            break;
        case 4:  // an infinite logit: the host sampler returns the (first) maximum
            for (float& x : l) x = body(rng);
            l[(size_t)(n / 2)] = inf;
            l[(size_t)(n / 3)] = std::numeric_limits<float>::quiet_NaN();
            break;
    }
    return l;
}

struct setting {
    float t;
    int k;
    float top_p, min_p;
};

// `rows` rows of V ids (row stride ld, ids >= n_valid padding) of every kind, `draws` draws per row with each
// setting: the device's draws against the host sampler's, the same seeds.
void expect_host_draws(int64_t V, int64_t ld, int64_t n_valid, int rows, int draws, const std::vector<setting>& settings) {
    constexpr int kinds = 5;
    for (const setting& s : settings) {
        SCOPED_TRACE("vocabulary " + std::to_string(n_valid) + " temperature " + std::to_string(s.t) + " top-k " +
                     std::to_string(s.k) + " top-p " + std::to_string(s.top_p) + " min-p " + std::to_string(s.min_p));
        sampling_params p;
        p.temperature = s.t, p.top_k = s.k, p.top_p = s.top_p, p.min_p = s.min_p;
        std::vector<float> host((size_t)(rows * ld), -1e30f);  // the columns past V are never read
        std::vector<std::vector<float>> lr;
        for (int r = 0; r < rows; r++) {
            lr.push_back(make_row(V, r % kinds, 500u + (uint32_t)r + (uint32_t)V));
            std::copy(lr.back().begin(), lr.back().end(), host.begin() + r * ld);
        }
        cuda::device_buffer dl(host.size() * 4), dids((size_t)rows * 4), drng((size_t)rows * 8),
            dscratch(cuda::sample_scratch_words(rows, n_valid) * 8);
        dl.upload(host.data(), host.size() * 4);
        std::vector<uint64_t> st((size_t)rows);
        for (int r = 0; r < rows; r++) st[(size_t)r] = sampling_math::rng_start(1000 + (uint64_t)r);
        drng.upload(st.data(), st.size() * 8);
        std::vector<sampler> twins;
        for (int r = 0; r < rows; r++) {
            p.seed = 1000 + (uint64_t)r;
            twins.emplace_back(p, n_valid);
        }
        cuda::sample_args a;
        a.temperature = p.temperature, a.top_k = p.top_k, a.top_p = p.top_p, a.min_p = p.min_p;
        int same = 0, total = 0;
        for (int d = 0; d < draws; d++) {
            cuda::sample_rows((int32_t*)dids.get(), (const float*)dl.get(), rows, ld, n_valid, a, (uint64_t*)drng.get(),
                              (uint64_t*)dscratch.get(), 0);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            std::vector<int32_t> got((size_t)rows);
            dids.download(got.data(), got.size() * 4);
            for (int r = 0; r < rows; r++) {
                const int32_t want = twins[(size_t)r].sample(lr[(size_t)r].data(), V);
                const int32_t g = got[(size_t)r];
                ASSERT_GE(g, 0);
                ASSERT_LT(g, n_valid) << "row " << r << ": a padding id";
                EXPECT_TRUE(std::isfinite(lr[(size_t)r][(size_t)g]) || r % kinds == 4) << "row " << r << " drew a masked token";
                same += g == want, total++;
                EXPECT_EQ(g, want) << "row " << r << " (kind " << r % kinds << "), draw " << d;
            }
        }
        EXPECT_GE((double)same / total, MIN_SAME_DRAWS);
    }
}

}  // namespace

TEST(cuda_sample, draws_what_the_host_sampler_draws) {
    TANSY_REQUIRE_GPU();
    const int64_t V = 248320;
    expect_host_draws(V, V + 64, V - 77, 10, 8,
                      {setting{1.0f, 1, 1.0f, 0.0f}, setting{0.6f, 20, 0.95f, 0.0f}, setting{1.0f, 64, 1.0f, 0.0f},
                       setting{0.8f, 40, 0.5f, 0.05f}, setting{2.5f, 64, 0.9f, 0.0f}, setting{0.05f, 7, 1.0f, 0.3f}});
}

// Vocabularies that cut into slices unevenly: one short slice, one id past a slice, a slice per row shorter than
// top-k, the widest layout (slices of more than 2,048 ids), a prime; and top-k one below the vocabulary.
TEST(cuda_sample, odd_vocabularies_draw_what_the_host_sampler_draws) {
    TANSY_REQUIRE_GPU();
    const std::vector<setting> settings = {setting{0.7f, 20, 0.8f, 0.0f}, setting{1.0f, 64, 1.0f, 0.02f}};
    for (int64_t n : {int64_t(65), int64_t(2047), int64_t(2049), int64_t(100003), int64_t(300001), int64_t(524288)})
        expect_host_draws(n, n + 3, n, 7, 3, settings);
    expect_host_draws(40, 40, 33, 5, 4, {setting{0.9f, 32, 1.0f, 0.0f}});
    expect_host_draws(4096 * 128 - 5, 4096 * 128, 4096 * 128 - 5, 3, 2, {setting{1.1f, 3, 0.9f, 0.0f}});
}

// A decode batch's rows draw with the parameters and RNG of their slots (sample_slot_rows): rows in a slot order
// unlike their own, an odd row count, and slots that are greedy or whose settings the device does not draw (top-k
// off or above k_sample_max_top_k) keeping the argmax written before; every other row draws what the host sampler
// with that slot's parameters and stream draws, and the slots' streams advance as the host's do. Then the slot
// tables: gather_slots_i32 / scatter_slots_i32 against their definition.
TEST(cuda_sample, slot_rows_draw_what_the_host_sampler_draws) {
    TANSY_REQUIRE_GPU();
    const int64_t V = 248320, ld = V, n_valid = V - 77;
    constexpr int rows = 7, slots = 11, draws = 4;
    const int row_slot[rows] = {9, 2, 0, 7, 4, 10, 5};
    std::vector<sampling_params> ps(slots);
    for (int s = 0; s < slots; s++) {
        sampling_params& p = ps[(size_t)s];
        p.seed = 300 + (uint64_t)s;
        switch (s % 6) {
            case 0: p.temperature = 0.0f; break;                                 // greedy
            case 1: p.temperature = 0.7f, p.top_k = 20, p.top_p = 0.8f; break;  // Qwen's non-thinking defaults
            case 2: p.temperature = 1.0f, p.top_k = 0, p.top_p = 0.9f; break;   // host-drawn: top-k off
            case 3: p.temperature = 0.6f, p.top_k = 64, p.min_p = 0.05f; break;
            case 4: p.temperature = 1.3f, p.top_k = 100; break;                  // host-drawn: top-k > 64
            case 5: p.temperature = 0.9f, p.top_k = 5, p.top_p = 0.5f; break;
        }
    }
    std::vector<float> host((size_t)(rows * ld));
    std::vector<std::vector<float>> lr;
    for (int r = 0; r < rows; r++) {
        lr.push_back(make_row(V, r % 4, 900u + (uint32_t)r));
        std::copy(lr.back().begin(), lr.back().end(), host.begin() + r * ld);
    }
    std::vector<float> params((size_t)slots * 4);
    std::vector<uint64_t> st((size_t)slots);
    for (int s = 0; s < slots; s++) {
        pack_row_sampling(params.data() + s * 4, ps[(size_t)s], n_valid);
        st[(size_t)s] = sampling_math::rng_start(ps[(size_t)s].seed);
    }
    cuda::device_buffer dl(host.size() * 4), dids((size_t)rows * 4), dparams(params.size() * 4), drng((size_t)slots * 8),
        dslot((size_t)rows * 4), dscratch((size_t)2 * rows * cuda::k_argmax_parts * 4),
        dsample(cuda::sample_scratch_words(rows, n_valid) * 8);
    dl.upload(host.data(), host.size() * 4);
    dparams.upload(params.data(), params.size() * 4);
    drng.upload(st.data(), st.size() * 8);
    dslot.upload(row_slot, sizeof row_slot);
    std::vector<sampler> twins;
    for (int s = 0; s < slots; s++) twins.emplace_back(ps[(size_t)s], n_valid);
    for (int d = 0; d < draws; d++) {
        cuda::argmax_rows((int32_t*)dids.get(), (const float*)dl.get(), rows, ld, n_valid, (float*)dscratch.get(), 0);
        cuda::sample_slot_rows((int32_t*)dids.get(), (const float*)dl.get(), rows, ld, n_valid, (const float*)dparams.get(),
                               (uint64_t*)drng.get(), (const int32_t*)dslot.get(), (uint64_t*)dsample.get(), 0);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        std::vector<int32_t> got(rows);
        dids.download(got.data(), got.size() * 4);
        for (int r = 0; r < rows; r++) {
            const int s = row_slot[r];
            const bool dev = row_samples_on_device(ps[(size_t)s], n_valid);
            const int32_t want = dev ? twins[(size_t)s].sample(lr[(size_t)r].data(), V) : argmax(lr[(size_t)r].data(), n_valid);
            EXPECT_EQ(got[(size_t)r], want) << "row " << r << " slot " << s << " draw " << d;
        }
    }
    std::vector<uint64_t> st_after((size_t)slots);
    drng.download(st_after.data(), st_after.size() * 8);
    for (int s = 0; s < slots; s++) {
        const bool drawn = row_samples_on_device(ps[(size_t)s], n_valid) &&
                           std::find(row_slot, row_slot + rows, s) != row_slot + rows;
        EXPECT_EQ(st_after[(size_t)s], drawn ? twins[(size_t)s].rng_state() : sampling_math::rng_start(ps[(size_t)s].seed))
            << "slot " << s;
    }

    std::vector<int32_t> vals(slots), in(rows);
    for (int s = 0; s < slots; s++) vals[(size_t)s] = 1000 + s * 3;
    for (int r = 0; r < rows; r++) in[(size_t)r] = -5 - r;
    cuda::device_buffer dvals((size_t)slots * 4), dout((size_t)rows * 4), din((size_t)rows * 4);
    dvals.upload(vals.data(), vals.size() * 4);
    din.upload(in.data(), in.size() * 4);
    cuda::gather_slots_i32((int32_t*)dout.get(), (const int32_t*)dvals.get(), (const int32_t*)dslot.get(), rows, 0);
    cuda::scatter_slots_i32((int32_t*)dvals.get(), (const int32_t*)din.get(), (const int32_t*)dslot.get(), rows, 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<int32_t> out(rows), vals_after(slots);
    dout.download(out.data(), out.size() * 4);
    dvals.download(vals_after.data(), vals_after.size() * 4);
    for (int r = 0; r < rows; r++) {
        EXPECT_EQ(out[(size_t)r], vals[(size_t)row_slot[r]]);
        vals[(size_t)row_slot[r]] = in[(size_t)r];
    }
    EXPECT_EQ(vals_after, vals);
}
