// The CUDA log-prob records (logprobs.cu) against their CPU twin (cpu::logprob_record): fresh random rows of every
// shape the split layout cuts differently (one short slice, exactly one slice, one id past it, a prime, the real
// vocabulary with padding columns and a wider stride, the largest vocabulary), every top count that matters, rows
// whose slot asks for nothing, and rows shaped to hit the edges: ties wider than the list, -0 beside +0, -inf but
// for a few ids, all -inf, huge and tiny magnitudes. Then the time of a step's records at the real vocabulary.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/device.h"
#include "backend/cuda/logprobs.cuh"
#include "core/dtype.h"
#include "cuda_test_util.h"
#include "logprob_rows.h"
#include "runtime/bench.h"
#include "sampling/logprobs.h"

using namespace tansy;

namespace {

// Both sides read the same floats and rank by one total order (logit descending, id ascending, -0 tied with +0),
// so the top ids, their logits and the pick's logit must be equal exactly; only the log-sum-exp differs:
// fp32 e^x summed over up to 524K ids (each e^x within 2 ulp, ~20 rounded sums deep: ~3e-6 relative in the sum,
// absolute in its log) against double rounded once,
constexpr double LSE_ATOL = 1e-5;
// plus the rounding of m + log s to float on each side (an ulp of the result each).
constexpr double LSE_RTOL = 2.4e-7;

constexpr int k_kinds = test::k_logprob_row_kinds;

std::vector<float> make_row(int64_t n, int kind, std::mt19937& rng) { return test::logprob_row(n, kind, rng); }

// `rows` rows of n_valid ids (stride ld, padding columns holding the largest logits, which must never enter) whose
// slots ask for tops[slot]: the device's records against the twin's, rows of slots with -1 left untouched.
void expect_twin_records(int64_t n_valid, int64_t ld, int rows, uint32_t seed) {
    SCOPED_TRACE("vocabulary " + std::to_string(n_valid) + ", stride " + std::to_string(ld));
    const std::vector<int32_t> tops = {-1, 0, 1, 5, 20, 3};
    std::mt19937 rng(seed);
    std::vector<int32_t> row_slot((size_t)rows), ids((size_t)rows);
    std::vector<float> host((size_t)rows * (size_t)ld);
    for (int r = 0; r < rows; r++) {
        row_slot[(size_t)r] = (int32_t)((r * 5 + 2) % (int)tops.size());
        const std::vector<float> l = make_row(n_valid, r % k_kinds, rng);
        std::copy(l.begin(), l.end(), host.begin() + (size_t)r * (size_t)ld);
        for (int64_t c = n_valid; c < ld; c++) host[(size_t)r * (size_t)ld + (size_t)c] = 1e6f;
        ids[(size_t)r] = (int32_t)(rng() % (uint64_t)n_valid);
    }
    constexpr int32_t sentinel = 0x7eadbeef;
    std::vector<int32_t> got((size_t)rows * k_logprob_words, sentinel);
    cuda::device_buffer dl(host.size() * 4), dids((size_t)rows * 4), dslot((size_t)rows * 4), dtop(tops.size() * 4),
        drec(got.size() * 4), dscratch(cuda::logprob_scratch_words(rows, n_valid) * 8);
    dl.upload(host.data(), host.size() * 4);
    dids.upload(ids.data(), ids.size() * 4);
    dslot.upload(row_slot.data(), row_slot.size() * 4);
    dtop.upload(tops.data(), tops.size() * 4);
    drec.upload(got.data(), got.size() * 4);
    cuda::logprob_slot_rows((int32_t*)drec.get(), (const float*)dl.get(), rows, ld, n_valid, (const int32_t*)dids.get(),
                            (const int32_t*)dslot.get(), (const int32_t*)dtop.get(), (uint64_t*)dscratch.get(), 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    drec.download(got.data(), got.size() * 4);
    std::vector<int32_t> want((size_t)k_logprob_words);
    for (int r = 0; r < rows; r++) {
        const int k = tops[(size_t)row_slot[(size_t)r]];
        const int32_t* g = got.data() + (size_t)r * k_logprob_words;
        const std::string what = "row " + std::to_string(r) + " (kind " + std::to_string(r % k_kinds) + ", top " +
                                 std::to_string(k) + ")";
        if (k < 0) {
            for (int64_t w = 0; w < k_logprob_words; w++) ASSERT_EQ(g[w], sentinel) << what << " was written";
            continue;
        }
        cpu::logprob_record(want.data(), host.data() + (size_t)r * (size_t)ld, n_valid, ids[(size_t)r], k);
        const double lg = f32_from_bits((uint32_t)g[0]), lw = f32_from_bits((uint32_t)want[0]);
        if (std::isinf(lw)) {
            EXPECT_EQ(lg, lw) << what;
        } else {
            EXPECT_NEAR(lg, lw, LSE_ATOL + LSE_RTOL * std::fabs(lw)) << what << ": log-sum-exp";
        }
        EXPECT_EQ(g[1], want[1]) << what << ": the pick's logit";
        for (int i = 0; i < k_max_top_logprobs; i++) {
            EXPECT_EQ(g[2 + 2 * i], want[2 + 2 * i]) << what << ", entry " << i << ": id";
            EXPECT_EQ(g[3 + 2 * i], want[3 + 2 * i]) << what << ", entry " << i << ": logit";
        }
    }
}

}  // namespace

TEST(cuda_logprobs, records_equal_the_cpu_twin) {
    TANSY_REQUIRE_GPU();
    uint32_t seed = (uint32_t)std::chrono::steady_clock::now().time_since_epoch().count();  // fresh inputs each run
    printf("[ note ] seed %u\n", seed);
    const std::vector<std::pair<int64_t, int64_t>> shapes = {
        {65, 65}, {2049, 2053}, {4096, 4096}, {4097, 4100}, {100003, 100003}, {248320 - 77, 248320 + 64},
        {524288, 524288}};
    for (const auto& [n, ld] : shapes) expect_twin_records(n, ld, 13, seed++);
    expect_twin_records(248320, 248320, 1, seed++);  // one row: the merge's block alone
}

// The records of a decode step at the real vocabulary, every row asking for 20 entries, over rows not in L2 (a
// window of the rows moves each run): microseconds, and the rows' bytes per second against the device's peak.
TEST(cuda_logprobs, step_time) {
    TANSY_REQUIRE_GPU();
    const int64_t V = 248320;
    constexpr int pool = 128, runs = 20;
    std::vector<float> host((size_t)pool * (size_t)V);
    std::mt19937 rng(5);
    std::normal_distribution<float> body(0.0f, 3.0f);
    for (float& x : host) x = body(rng);
    std::vector<int32_t> slot(pool), ids(pool, 7);
    for (int r = 0; r < pool; r++) slot[(size_t)r] = r;
    std::vector<int32_t> tops(pool, 20);
    cuda::device_buffer dl(host.size() * 4), dids((size_t)pool * 4), dslot((size_t)pool * 4), dtop((size_t)pool * 4),
        drec((size_t)pool * k_logprob_words * 4), dscratch(cuda::logprob_scratch_words(pool, V) * 8);
    dl.upload(host.data(), host.size() * 4);
    dids.upload(ids.data(), ids.size() * 4);
    dslot.upload(slot.data(), slot.size() * 4);
    dtop.upload(tops.data(), tops.size() * 4);
    cudaEvent_t a, b;
    ASSERT_EQ(cudaEventCreate(&a), cudaSuccess);
    ASSERT_EQ(cudaEventCreate(&b), cudaSuccess);
    const double peak = bench_options{}.peak_gbps;  // the H200's measured copy bandwidth, as bench reports against
    for (int rows : {1, 8, 64}) {
        std::vector<float> us;
        for (int i = 0; i < runs + 1; i++) {
            const int64_t r0 = (int64_t)(i % (pool / rows)) * rows;
            ASSERT_EQ(cudaEventRecord(a, 0), cudaSuccess);
            cuda::logprob_slot_rows((int32_t*)drec.get(), (const float*)dl.get() + r0 * V, rows, V, V,
                                    (const int32_t*)dids.get(), (const int32_t*)dslot.get(), (const int32_t*)dtop.get(),
                                    (uint64_t*)dscratch.get(), 0);
            ASSERT_EQ(cudaEventRecord(b, 0), cudaSuccess);
            ASSERT_EQ(cudaEventSynchronize(b), cudaSuccess);
            float ms = 0;
            ASSERT_EQ(cudaEventElapsedTime(&ms, a, b), cudaSuccess);
            if (i > 0) us.push_back(ms * 1000.0f);  // the first run warms up
        }
        std::sort(us.begin(), us.end());
        const double med = us[us.size() / 2], gbps = (double)rows * (double)V * 4 / (med * 1e3);
        printf("logprob rows %3d: %8.1f us %7.0f GB/s %5.1f%% peak\n", rows, med, gbps, 100 * gbps / peak);
        // a generous bound: one block per row reading all of it took ~0.5 ms a row (sample.cu's history)
        EXPECT_LT(med / rows, 100.0) << rows << " rows";
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
}
