#include "runtime/engine.h"

#include <omp.h>

#include <cstdlib>

#include "core/check.h"
#include "loader/load_model.h"

#ifndef TANSY_DEFAULT_MODEL_DIR
#define TANSY_DEFAULT_MODEL_DIR "models/tiny-chat-q4"
#endif

namespace tansy {

std::string default_model_dir() {
    if (const char* env = std::getenv("TANSY_MODEL"); env && *env) return env;
    return TANSY_DEFAULT_MODEL_DIR;
}

engine::engine(const engine_options& opt) {
    if (opt.threads > 0) omp_set_num_threads(opt.threads);
    model_ = std::make_unique<model>(load_model(opt.model_dir.empty() ? default_model_dir() : opt.model_dir));
    backend_ = make_backend(opt.backend, model_->cfg);
    backend_->bind(*model_);
    fwd_ = std::make_unique<forward_pass>(*backend_, *model_);
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

}  // namespace tansy
