// What one generation asks for, from the HTTP layer and the command line down to the decode step: the fields
// and their defaults in one place. completion_request (server/openai.h: parsed from a request body),
// sequence_request (runtime/scheduler.h: one sequence of the batch) and generation_request (runtime/engine.h:
// engine::generate) extend it with what their layer adds, so one request's settings are copied down whole.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "sampling/logprobs.h"
#include "sampling/sampler.h"

namespace tansy {

struct generation_params {
    int64_t max_tokens = -1;   // new tokens at most; -1: up to the context (the server: its context length)
    sampling_params sampling;  // temperature 0: greedy
    penalty_params penalties;
    // OpenAI's logit_bias: (token id, bias) added to the logits after the penalties, before a constraint's mask
    // (ids below the engine's n_valid_tokens; the HTTP layer checks)
    std::vector<std::pair<int32_t, float>> logit_bias;
    std::vector<int32_t> stop_ids;  // ids that end the generation once reported (the end of turn, as a rule)
    int logprobs = -1;  // -1: none; k >= 0: the chosen token's log-prob and the top k (k <= k_max_top_logprobs)
    bool cache_prompt = true;  // false: neither restored from nor stored in a prefix cache ("cache_prompt")
};

}  // namespace tansy
