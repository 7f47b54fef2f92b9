// An engine plus what text needs: the model's tokenizer, its end-of-turn ids (generation_config.json) and
// the ids of the reasoning markers. What `tansy run` and `tansy serve` start from.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "tokenizer/tokenizer.h"

namespace tansy {

class text_engine {
  public:
    explicit text_engine(const engine_options& opt);  // throws tansy::error

    engine& eng() { return *engine_; }
    const tokenizer& tok() const { return *tok_; }
    const std::vector<int32_t>& eos() const { return eos_; }  // generation stops after one of these
    int32_t think_begin() const { return think_begin_; }     // <think>, -1 if the vocabulary has none
    int32_t think_end() const { return think_end_; }         // </think>, -1 if none
    const std::string& model_dir() const { return dir_; }

  private:
    std::string dir_;
    std::unique_ptr<engine> engine_;
    std::unique_ptr<tokenizer> tok_;
    std::vector<int32_t> eos_;
    int32_t think_begin_ = -1, think_end_ = -1;
};

}  // namespace tansy
