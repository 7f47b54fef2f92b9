#include "runtime/engine.h"

#include <omp.h>

#include <chrono>
#include <cstdlib>

#include "core/check.h"
#include "loader/load_model.h"
#include "quant/quantize_model.h"
#include "runtime/prefix_cache.h"

#ifndef TANSY_DEFAULT_MODEL_DIR
#define TANSY_DEFAULT_MODEL_DIR "models/tiny-chat-q4"
#endif

namespace tansy {

std::string bundled_model_dir() { return TANSY_DEFAULT_MODEL_DIR; }

// Option errors are reported before anything is loaded.
static void check_options(const engine_options& opt) {
    if (opt.prefill_chunk < 0)
        fail("prefill chunk must be >= 1 token (0: the default of %lld), got %lld",
             (long long)forward_pass::DEFAULT_PREFILL_CHUNK, (long long)opt.prefill_chunk);
}

engine::engine(const engine_options& opt) {
    check_options(opt);
    if (opt.threads > 0) omp_set_num_threads(opt.threads);
    model_ = std::make_unique<model>(load_model(opt.model_dir.empty() ? bundled_model_dir() : opt.model_dir));
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
                                  const std::function<bool(int32_t)>& on_token, const span_mark& mark) {
    using clock = std::chrono::steady_clock;
    auto secs = [](clock::time_point a) { return std::chrono::duration<double>(clock::now() - a).count(); };
    generation_stats gs;
    if (req.prompt.empty()) fail("generate: the prompt is empty");
    if (req.penalties.any() || !req.logit_bias.empty() || req.logprobs >= 0)
        fail("generate: penalties, logit_bias and log-probs are the scheduler's (tansy serve), not generate's");
    check_ids(req.prompt);
    const int64_t room = st.capacity() - st.n_past() - (int64_t)req.prompt.size();
    if (room < 0 || req.max_tokens > room)
        fail("prompt of %zu tokens + %lld new tokens exceeds the context capacity of %lld", req.prompt.size(),
             (long long)std::max<int64_t>(req.max_tokens, 0), (long long)(st.capacity() - st.n_past()));
    const int64_t max_tokens = req.max_tokens < 0 ? room : req.max_tokens;
    gs.prompt_tokens = (int64_t)req.prompt.size();
    if (max_tokens <= 0) return gs;
    backend& be = *backend_;
    sampler smp(req.sampling, n_valid_);  // validates the parameters
    // Sampling the device does not draw (or device_sampling off) is drawn here from downloaded logits; the
    // slot then holds temperature 0 and the host's choice overwrites its argmax.
    const bool host_draw = req.sampling.temperature > 0 &&
                           (!req.device_sampling || !row_samples_on_device(req.sampling, n_valid_));
    const bool graphs = req.use_graphs && be.supports_graphs();
    if (!dec_ || dec_graphs_ != graphs) dec_ = std::make_unique<decode_step>(*this, 1, graphs), dec_graphs_ = graphs;
    decode_step& ds = *dec_;
    sampling_params dev_params = req.sampling;
    if (host_draw) dev_params.temperature = 0;
    ds.bind(0, dev_params);
    std::vector<float> host_logits;
    auto host_pick = [&](const tensor& logits) {
        host_logits.resize((size_t)logits.cols);
        be.download(host_logits.data(), logits.rows_view(logits.rows - 1, 1));
        const int32_t id = smp.sample(host_logits.data(), logits.cols);
        ds.set_token(0, id);
        return id;
    };
    auto emit = [&](int32_t id) {
        gs.generated++;
        const bool stop = std::find(req.stop_ids.begin(), req.stop_ids.end(), id) != req.stop_ids.end();
        return on_token(id) && !stop && gs.generated < max_tokens;
    };

    auto t0 = clock::now();
    const int64_t T = (int64_t)req.prompt.size();
    if (!prompt_ids_ || prompt_ids_.t().rows < T) prompt_ids_ = be.alloc(T, 1, dtype::i32);
    const tensor pids = prompt_ids_.t().rows_view(0, T);
    be.upload(pids, req.prompt.data());
    const tensor plog = fwd_->prefill(pids, st, logits_rows::last, {}, mark);
    int32_t id = host_draw ? host_pick(plog) : ds.pick_prompt(0, plog);
    gs.prefill_s = secs(t0);
    if (!emit(id)) return gs;

    auto t1 = clock::now();
    const std::vector<decode_step::row> rows = {{0, &st}};
    for (;;) {
        id = ds.wait(ds.launch(rows))[0];
        if (host_draw) id = host_pick(ds.logits());
        if (!emit(id)) break;
    }
    be.synchronize();
    gs.decode_s = secs(t1);
    gs.graphs = graphs;
    return gs;
}

generation_stats engine::generate_cached(prefix_cache& cache, seq_state& st, const generation_request& req,
                                         const std::function<bool(int32_t)>& on_token) {
    using clock = std::chrono::steady_clock;
    if (!cache.enabled()) return generate(st, req, on_token);
    if (req.prompt.empty()) fail("generate: the prompt is empty");
    check_ids(req.prompt);
    TANSY_CHECK(st.n_past() == 0, "generate_cached: the state must be fresh");
    const auto t0 = clock::now();
    const int64_t P = (int64_t)req.prompt.size();
    int64_t done = 0;
    if (prefix_cache::lease l = cache.lookup(req.prompt)) {
        done = l.tokens();
        cache.restore(l, st);
    } else {
        cache.miss();
    }
    const int64_t cached = done;
    prefix_cache::checkpoints cps;
    // the scheduler's pieces for a lone prompt (scheduler::next_chunks): prefill chunks that carry the cache's
    // marks or end at them, a checkpoint where one is due; the last piece goes to generate(), whose logits pick
    // the first token
    const std::vector<int64_t> marks = cache.plan(req.prompt, done);
    prefix_cache::piece pc;
    std::unique_ptr<seq_state> ms;
    auto mark_of = [&](const prefix_cache::piece& k) {  // the piece's checkpoint inside, as the step takes it
        if (k.mark == 0) return span_mark{};
        ms = cache.mark_state();
        return span_mark{ms.get(), k.mark - done};
    };
    for (int64_t last = done;;) {
        pc = prefix_cache::next_piece(marks, done, fwd_->prefill_chunk, P);
        if (pc.end == P) break;
        fwd_->run_host({req.prompt.begin() + done, req.prompt.begin() + pc.end}, st, logits_rows::none, mark_of(pc));
        if (ms) cps.push_back(std::move(ms)), last = pc.mark;
        done = pc.end;
        if (cache.checkpoint_due(marks, last, done, P)) cps.push_back(cache.checkpoint(st)), last = done;
    }
    const double pieces_s = std::chrono::duration<double>(clock::now() - t0).count();
    generation_request rest = req;
    rest.prompt.assign(req.prompt.begin() + done, req.prompt.end());
    std::vector<int32_t> out;
    generation_stats gs = generate(st, rest, [&](int32_t id) {
        out.push_back(id);
        return on_token(id);
    }, mark_of(pc));
    if (ms) cps.push_back(std::move(ms));
    gs.prompt_tokens = P;
    gs.cached_tokens = cached;
    gs.prefill_s += pieces_s;
    // the state ran the prompt and all but the last emitted token
    const int64_t n = st.n_past();
    if (n >= P && n - P <= (int64_t)out.size()) {
        std::vector<int32_t> tokens = req.prompt;
        tokens.insert(tokens.end(), out.begin(), out.begin() + (n - P));
        cache.insert(tokens.data(), n, st, std::move(cps));
    }
    return gs;
}

}  // namespace tansy
