// An engine plus what text needs: the model's tokenizer, its end-of-turn ids (generation_config.json) and
// the ids of the reasoning markers. What `tansy run` and `tansy serve` start from.
//
// A synthetic text engine (synthetic_spec) runs random weights of any config.json (model/synthetic.h) behind the
// tokenizer of the model directory (the bundled tiny model by default), to measure served speed without a
// checkpoint. Its vocabulary may be larger than the tokenizer's: sampling then stays over the whole vocabulary
// (the work is the real model's), and the text path shows ids the tokenizer does not know as U+FFFD
// (server/text_stream.h).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "tokenizer/tokenizer.h"

namespace tansy {

struct synthetic_spec {
    std::string config;  // config.json of the model to synthesise; empty: load the checkpoint of model_dir
    int64_t layers = 0;  // keep only the first N layers (0: all)
    // the weight seed and router skew are engine_options::backend_opt.synthetic_seed / router_skew
};

class text_engine {
  public:
    // Throws tansy::error. With syn.config set, the model is synthetic and opt.model_dir (default: the bundled
    // model) supplies only the tokenizer and generation_config.json.
    explicit text_engine(const engine_options& opt, const synthetic_spec& syn = {});

    engine& eng() { return *engine_; }
    const tokenizer& tok() const { return *tok_; }
    const std::vector<int32_t>& eos() const { return eos_; }  // generation stops after one of these
    int32_t think_begin() const { return think_begin_; }     // <think>, -1 if the vocabulary has none
    int32_t think_end() const { return think_end_; }         // </think>, -1 if none
    const std::string& model_dir() const { return dir_; }  // where the tokenizer came from
    bool synthetic() const { return synthetic_; }

  private:
    std::string dir_;
    std::unique_ptr<engine> engine_;
    std::unique_ptr<tokenizer> tok_;
    std::vector<int32_t> eos_;
    int32_t think_begin_ = -1, think_end_ = -1;
    bool synthetic_ = false;
};

}  // namespace tansy
