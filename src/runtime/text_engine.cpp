#include "runtime/text_engine.h"

#include "core/check.h"
#include "model/config.h"
#include "model/synthetic.h"

namespace tansy {

text_engine::text_engine(const engine_options& opt, const synthetic_spec& syn) {
    dir_ = opt.model_dir.empty() ? bundled_model_dir() : opt.model_dir;
    synthetic_ = !syn.config.empty();
    engine_options o = opt;
    o.model_dir = dir_;
    if (!file_exists(dir_ + "/tokenizer.json")) fail("%s: no tokenizer.json (text commands need one)", dir_.c_str());
    if (synthetic_) {
        synthetic_options so;
        so.seed = opt.backend_opt.synthetic_seed;
        so.materialize = opt.backend != "cuda";  // the cuda backend generates the weights on the device
        engine_ = std::make_unique<engine>(make_synthetic_model(synthetic_config(syn.config, syn.layers), so), o);
    } else {
        engine_ = std::make_unique<engine>(o);
    }
    tok_ = std::make_unique<tokenizer>(tokenizer::load(dir_ + "/tokenizer.json"));
    if (tok_->size() > engine_->cfg().vocab)
        fail("%s: the tokenizer has %lld ids but the model only %lld embedding rows", synthetic_ ? syn.config.c_str() : dir_.c_str(),
             (long long)tok_->size(), (long long)engine_->cfg().vocab);
    // Ids beyond the tokenizer are padding rows of the embedding: never sampled (MODEL.md §6). A synthetic
    // model samples its whole vocabulary, as the real model it stands for would.
    if (!synthetic_) engine_->set_valid_tokens(tok_->size());
    eos_ = load_eos_ids(dir_);
    if (eos_.empty()) {
        const int32_t im_end = tok_->find("<|im_end|>");
        if (im_end >= 0) eos_.push_back(im_end);
    }
    think_begin_ = tok_->find("<think>");
    think_end_ = tok_->find("</think>");
}

}  // namespace tansy
