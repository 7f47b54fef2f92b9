#include "runtime/engine.h"

#include <omp.h>

#include <chrono>
#include <cstdlib>

#include "core/check.h"
#include "loader/load_model.h"
#include "quant/quantize_model.h"
#include "sampling/sampler_math.h"

#ifndef TANSY_DEFAULT_MODEL_DIR
#define TANSY_DEFAULT_MODEL_DIR "models/tiny-chat-q4"
#endif

namespace tansy {

std::string default_model_dir() {
    if (const char* env = std::getenv("TANSY_MODEL"); env && *env) return env;
    return TANSY_DEFAULT_MODEL_DIR;
}

// Option errors are reported before anything is loaded.
static void check_options(const engine_options& opt) {
    if (opt.prefill_chunk < 0)
        fail("prefill chunk must be >= 1 token (0: the default of %lld), got %lld",
             (long long)forward_pass::DEFAULT_PREFILL_CHUNK, (long long)opt.prefill_chunk);
}

engine::engine(const engine_options& opt) {
    check_options(opt);
    if (opt.threads > 0) omp_set_num_threads(opt.threads);
    model_ = std::make_unique<model>(load_model(opt.model_dir.empty() ? default_model_dir() : opt.model_dir));
    init(opt);
}

engine::engine(model&& m, const engine_options& opt) {
    check_options(opt);
    if (opt.threads > 0) omp_set_num_threads(opt.threads);
    model_ = std::make_unique<model>(std::move(m));
    init(opt);
}

void engine::init(const engine_options& opt) {
    prepare_weights(*model_, opt.weights, opt.backend);
    backend_ = make_backend(opt.backend, model_->cfg, opt.backend_opt);
    backend_->bind(*model_);
    fwd_ = std::make_unique<forward_pass>(*backend_, *model_);
    if (opt.prefill_chunk > 0) fwd_->prefill_chunk = opt.prefill_chunk;
    fwd_->gdn = opt.gdn;
    tok_ = backend_->alloc(1, 1, dtype::i32);
    n_valid_ = model_->cfg.vocab;
}

void engine::check_ids(const std::vector<int32_t>& ids) const {
    for (size_t i = 0; i < ids.size(); i++)
        if (ids[i] < 0 || ids[i] >= model_->cfg.vocab)
            fail("token id %d (entry %zu) is outside the model's vocabulary of %lld", ids[i], i + 1,
                 (long long)model_->cfg.vocab);
}

std::vector<float> engine::step(seq_state& st, const std::vector<int32_t>& ids, logits_rows which) {
    check_ids(ids);
    return fwd_->run_host(ids, st, which);
}

generation_stats engine::generate(seq_state& st, const generation_request& req,
                                  const std::function<bool(int32_t)>& on_token) {
    using clock = std::chrono::steady_clock;
    auto secs = [](clock::time_point a) { return std::chrono::duration<double>(clock::now() - a).count(); };
    generation_stats gs;
    if (req.prompt.empty()) fail("generate: the prompt is empty");
    check_ids(req.prompt);
    if (st.n_past() + (int64_t)req.prompt.size() + req.max_tokens > st.capacity())
        fail("prompt of %zu tokens + %lld new tokens exceeds the context capacity of %lld", req.prompt.size(),
             (long long)req.max_tokens, (long long)(st.capacity() - st.n_past()));
    gs.prompt_tokens = (int64_t)req.prompt.size();
    if (req.max_tokens <= 0) return gs;
    backend& be = *backend_;
    const bool greedy = req.sampling.temperature == 0.0f;
    sampler smp(req.sampling, n_valid_);  // validates the parameters
    const bool device_sampling = !greedy && req.device_sampling && be.can_sample(req.sampling, n_valid_);
    buffer rng;  // the device sampler's splitmix64 state: the host sampler's start for this seed
    if (device_sampling) {
        rng = be.alloc(1, 2, dtype::i32);
        const uint64_t st = sampling_math::rng_start(req.sampling.seed);
        be.upload(rng.t(), &st);
    }
    const tensor tok = tok_.t();
    std::vector<float> host_logits;
    // The next token into `tok`: on the device for greedy and for the sampling the backend supports, through the
    // host sampler otherwise.
    auto pick = [&](const tensor& logits) {
        if (greedy) return be.argmax(tok, logits, n_valid_);
        if (device_sampling) return be.sample(tok, logits, n_valid_, req.sampling, rng.t());
        host_logits.resize((size_t)logits.numel());
        be.download(host_logits.data(), logits);
        const int32_t id = smp.sample(host_logits.data(), logits.cols);
        be.upload(tok, &id);
    };
    auto read_tok = [&] {
        int32_t id;
        be.download(&id, tok);
        return id;
    };
    auto emit = [&](int32_t id) {
        gs.generated++;
        const bool stop = std::find(req.stop.begin(), req.stop.end(), id) != req.stop.end();
        return on_token(id) && !stop && gs.generated < req.max_tokens;
    };

    auto t0 = clock::now();
    const int64_t T = (int64_t)req.prompt.size();
    if (!prompt_ids_ || prompt_ids_.t().rows < T) prompt_ids_ = be.alloc(T, 1, dtype::i32);
    const tensor pids = prompt_ids_.t().rows_view(0, T);
    be.upload(pids, req.prompt.data());
    pick(fwd_->prefill(pids, st, logits_rows::last));
    int32_t id = read_tok();
    gs.prefill_s = secs(t0);
    if (!emit(id)) return gs;

    auto t1 = clock::now();
    const bool graphs = req.use_graphs && (greedy || device_sampling) && be.supports_graphs();
    bool warm = false, captured = false;
    uint64_t epoch_be = 0, epoch_fw = 0;
    auto epochs_match = [&] { return be.memory_epoch() == epoch_be && fwd_->memory_epoch() == epoch_fw; };
    for (;;) {
        const std::vector<seq_span> span = {seq_span{&st, 0, 1, st.n_past()}};
        if (graphs && captured && epochs_match()) {
            be.replay();
            st.set_n_past(st.n_past() + 1);  // the host mirror of what the replayed step did on the device
            gs.graphs = true;
        } else if (graphs && warm) {
            // Record one decode step (its buffers and batch layout are settled by the eager step before),
            // then run it: capture only records.
            be.capture_begin();
            pick(fwd_->run(tok, span, logits_rows::last));
            be.capture_end();
            be.replay();
            captured = true;
            epoch_be = be.memory_epoch(), epoch_fw = fwd_->memory_epoch();
        } else {
            pick(fwd_->run(tok, span, logits_rows::last));
            warm = true;
        }
        id = read_tok();
        if (!emit(id)) break;
    }
    be.synchronize();
    gs.decode_s = secs(t1);
    return gs;
}

}  // namespace tansy
