// Log-prob records (sampling/logprobs.h) from the CPU twin (cpu::logprob_record, the CPU backend's logprob_rows)
// against a plain double-precision reference: a full stable sort for the top entries and a long-double
// log-sum-exp, over awkward vocabularies (65, 2049, 100,003 ids), every top count that matters (0, 1, 5, 20) and
// rows shaped to hit the edges: ties wider than the top list, -0 beside +0, rows of -inf with fewer finite ids
// than the list, all -inf, and huge and tiny magnitudes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "core/dtype.h"
#include "logprob_rows.h"
#include "model/synthetic.h"
#include "sampling/logprobs.h"
#include "test_util.h"

using namespace tansy;

namespace {

// The twin sums in double and rounds the log-sum-exp to float once: within one float ulp of the long-double
// reference; the atol covers a log-sum-exp near 0, where one ulp is tiny.
constexpr double LSE_RTOL = 1.2e-7;  // 2^-23
constexpr double LSE_ATOL = 1e-6;

constexpr int k_kinds = test::k_logprob_row_kinds;

std::vector<float> make_row(int64_t n, int kind, uint32_t seed) {
    std::mt19937 rng(seed);
    return test::logprob_row(n, kind, rng);
}

long double reference_lse(const std::vector<float>& row, int64_t n) {
    long double m = -std::numeric_limits<long double>::infinity();
    for (int64_t i = 0; i < n; i++) m = std::max(m, (long double)row[(size_t)i]);
    if (m == -std::numeric_limits<long double>::infinity()) return m;
    long double s = 0;
    for (int64_t i = 0; i < n; i++) s += std::exp((long double)row[(size_t)i] - m);
    return m + std::log(s);
}

std::vector<int32_t> reference_top(const std::vector<float>& row, int64_t n, int k) {
    std::vector<int32_t> idx((size_t)n);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return row[(size_t)a] > row[(size_t)b]; });
    idx.resize((size_t)std::min<int64_t>(k, n));
    return idx;
}

// rec against the reference for row[0, n), its pick `chosen` and `k` top entries.
void expect_record(const int32_t* rec, const std::vector<float>& row, int64_t n, int32_t chosen, int k,
                   const std::string& what) {
    const long double lse = reference_lse(row, n);
    const float got = f32_from_bits((uint32_t)rec[0]);
    if (std::isinf(lse)) {
        EXPECT_EQ(got, -std::numeric_limits<float>::infinity()) << what;
    } else {
        EXPECT_NEAR((double)got, (double)lse, LSE_ATOL + LSE_RTOL * std::fabs((double)lse)) << what;
    }
    EXPECT_EQ((uint32_t)rec[1], f32_bits(row[(size_t)chosen])) << what << ": the pick's logit";
    const std::vector<int32_t> top = reference_top(row, n, k);
    for (int i = 0; i < k_max_top_logprobs; i++) {
        const int32_t id = rec[2 + 2 * i];
        const uint32_t x = (uint32_t)rec[3 + 2 * i];
        if (i < (int)top.size()) {
            EXPECT_EQ(id, top[(size_t)i]) << what << ", entry " << i;
            EXPECT_EQ(x, f32_bits(row[(size_t)top[(size_t)i]])) << what << ", entry " << i;
        } else {
            EXPECT_EQ(id, -1) << what << ", entry " << i << " past the list";
            EXPECT_EQ(x, f32_bits(-std::numeric_limits<float>::infinity())) << what << ", entry " << i;
        }
    }
}

TEST(logprobs, records_match_a_double_precision_reference) {
    for (int64_t n : {int64_t(65), int64_t(2049), int64_t(100003)}) {
        for (int k : {0, 1, 5, 20}) {
            for (int kind = 0; kind < k_kinds; kind++) {
                const std::vector<float> row = make_row(n, kind, 40u + (uint32_t)(n + k + kind));
                const int32_t chosen = (int32_t)((n * 7 + kind) % n);
                std::vector<int32_t> rec((size_t)k_logprob_words, 0x7eadbeef);
                cpu::logprob_record(rec.data(), row.data(), n, chosen, k);
                expect_record(rec.data(), row, n, chosen, k,
                              "n " + std::to_string(n) + " top " + std::to_string(k) + " kind " + std::to_string(kind));
            }
        }
    }
}

// The host path's helpers (scheduler::choose) on lists longer than the row, and the record's reading.
TEST(logprobs, helpers_and_reading_a_record) {
    const std::vector<float> row = {1.0f, 3.0f, 3.0f, -2.0f};
    const auto top = top_logits(row.data(), 4, 20);
    ASSERT_EQ(top.size(), 4u);
    EXPECT_EQ(top[0].first, 1);
    EXPECT_EQ(top[1].first, 2);
    EXPECT_EQ(top[2].first, 0);
    EXPECT_EQ(top[3].first, 3);
    EXPECT_TRUE(top_logits(row.data(), 4, 0).empty());
    const double lse = log_sum_exp(row.data(), 4);
    EXPECT_NEAR(lse, std::log(std::exp(1.0) + 2 * std::exp(3.0) + std::exp(-2.0)), 1e-12);

    std::vector<int32_t> rec((size_t)k_logprob_words);
    cpu::logprob_record(rec.data(), row.data(), 4, 0, 3);
    float lp = 0;
    std::vector<std::pair<int32_t, float>> out;
    read_logprob_record(rec.data(), 3, &lp, &out);
    const double lse_f = f32_from_bits((uint32_t)rec[0]);
    EXPECT_FLOAT_EQ(lp, (float)(1.0 - lse_f));
    ASSERT_EQ(out.size(), 3u);
    EXPECT_EQ(out[0].first, 1);
    EXPECT_FLOAT_EQ(out[0].second, (float)(3.0 - lse_f));
    EXPECT_EQ(out[2].first, 0);
    read_logprob_record(rec.data(), 20, &lp, &out);  // asked for more than the record holds: up to its first id -1
    EXPECT_EQ(out.size(), 3u);
    read_logprob_record(rec.data(), 0, &lp, &out);
    EXPECT_TRUE(out.empty());
}

// The CPU backend's logprob_rows: row r takes slot row_slot[r]'s top count, rows of slots with -1 keep their
// record, columns past n_valid (padding ids, here the largest logits) never enter, and every record is the
// twin's.
TEST(logprobs, backend_rows_follow_their_slots) {
    const model_config cfg = synthetic_config(test::fixture("tiny-qwen35moe-mlx4") + "/config.json", 4);
    auto be = make_cpu_backend(cfg);
    constexpr int rows = 6, slots = 5;
    const int64_t ld = 2053, n_valid = 2049;
    const int32_t row_slot[rows] = {3, 0, 4, 1, 3, 2};
    const int32_t top[slots] = {0, -1, 20, 5, -1};
    std::vector<float> logits((size_t)(rows * ld));
    std::vector<int32_t> ids(rows);
    for (int r = 0; r < rows; r++) {
        const std::vector<float> row = make_row(ld, r % k_kinds, 900u + (uint32_t)r);
        std::copy(row.begin(), row.end(), logits.begin() + r * ld);
        for (int64_t c = n_valid; c < ld; c++) logits[(size_t)(r * ld + c)] = 1e6f;
        ids[(size_t)r] = (int32_t)((r * 331 + 17) % n_valid);
    }
    buffer l = be->alloc(rows, ld, dtype::f32), d_ids = be->alloc(rows, 1, dtype::i32),
           d_slot = be->alloc(rows, 1, dtype::i32), d_top = be->alloc(slots, 1, dtype::i32),
           d_rec = be->alloc(rows, k_logprob_words, dtype::i32);
    be->upload(l.t(), logits.data());
    be->upload(d_ids.t(), ids.data());
    be->upload(d_slot.t(), row_slot);
    be->upload(d_top.t(), top);
    std::vector<int32_t> rec((size_t)(rows * k_logprob_words), 0x7eadbeef);
    be->upload(d_rec.t(), rec.data());
    be->logprob_rows(d_rec.t(), l.t(), n_valid, d_ids.t(), d_slot.t(), d_top.t());
    be->download(rec.data(), d_rec.t());
    for (int r = 0; r < rows; r++) {
        const int32_t* got = rec.data() + r * k_logprob_words;
        const int k = top[row_slot[r]];
        if (k < 0) {
            for (int64_t w = 0; w < k_logprob_words; w++) EXPECT_EQ(got[w], 0x7eadbeef) << "row " << r << " was written";
            continue;
        }
        const std::vector<float> row(logits.begin() + r * ld, logits.begin() + r * ld + n_valid);
        expect_record(got, row, n_valid, ids[(size_t)r], k, "row " + std::to_string(r));
    }
}

}  // namespace
