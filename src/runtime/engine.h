// Owns a loaded model, a backend with its weights bound, and a forward pass: what every CLI command and the
// server start from. generate() decodes one sequence through decode_step (runtime/decode_step.h), the step the
// scheduler and the bench run too: the sampled token stays in backend memory and feeds the next step, and each
// step is one graph replay on a backend with graphs.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/forward.h"
#include "model/weights.h"
#include "runtime/decode_step.h"
#include "runtime/request.h"
#include "sampling/sampler.h"

namespace tansy {

class prefix_cache;

struct engine_options {
    std::string model_dir;   // empty: the embedded default model
    std::string backend = "cpu";
    int threads = 0;         // CPU threads; 0: all cores
    backend_options backend_opt;
    // auto | checkpoint | q4 | bf16: q4 quantises dense matrices at load with tansy convert's quantiser and
    // policy; auto does that on cuda and keeps the checkpoint's format on cpu (src/quant/quantize_model.h,
    // prepare_weights).
    std::string weights = "auto";
    // Prompt tokens per forward step (forward_pass::prefill): bounds the activation workspace of long prompts.
    // 0: forward_pass::DEFAULT_PREFILL_CHUNK (8192).
    int64_t prefill_chunk = 0;
    // DeltaNet layers' prompt spans: auto (the chunk-parallel form of MODEL.md §4.7, single tokens recurrent),
    // chunked or recurrent (token by token).
    gdn_mode gdn = gdn_mode::auto_select;
};

// The bundled tiny chat model (models/tiny-chat-q4): what an empty model_dir loads. (The command line also
// honours $TANSY_MODEL: cli/args.h default_model_dir.)
std::string bundled_model_dir();

// engine::generate's request: one sequence, greedy or sampled (penalties, logit_bias and log-probs are the
// scheduler's; generate refuses them).
struct generation_request : generation_params {
    std::vector<int32_t> prompt;
    bool use_graphs = true;
    // sampled decoding: draw on the device where the backend can (backend::can_sample; the same token as the
    // host sampler would draw), so a step stays one graph replay; false: always the host sampler
    bool device_sampling = true;
};

struct generation_stats {
    int64_t prompt_tokens = 0, generated = 0;
    int64_t cached_tokens = 0;  // of prompt_tokens, restored from a prefix cache (generate_cached)
    double prefill_s = 0, decode_s = 0;
    bool graphs = false;  // decode steps ran as graph replays
};

class engine {
  public:
    explicit engine(const engine_options& opt);         // loads opt.model_dir; throws tansy::error
    engine(model&& m, const engine_options& opt);        // an already built model (synthetic)

    const model& mdl() const { return *model_; }
    const model_config& cfg() const { return model_->cfg; }
    backend& be() { return *backend_; }
    forward_pass& fwd() { return *fwd_; }

    std::unique_ptr<seq_state> new_sequence(int64_t capacity) { return backend_->new_state(capacity); }

    // Throws tansy::error if any id is outside the vocabulary.
    void check_ids(const std::vector<int32_t>& ids) const;

    // Processes `ids` after what `st` holds, in chunks of at most prefill_chunk tokens; returns host logits per
    // `which` ([n, V], [1, V] or empty).
    std::vector<float> step(seq_state& st, const std::vector<int32_t>& ids, logits_rows which);

    // Prefill, then decode until max_tokens, a stop id, or on_token returning false. st must have room for
    // prompt + max_tokens.
    // mark: a checkpoint the prompt's prefill takes on the way (forward_pass::prefill).
    generation_stats generate(seq_state& st, const generation_request& req, const std::function<bool(int32_t)>& on_token,
                              const span_mark& mark = {});

    // generate() through a prefix cache (runtime/prefix_cache.h), as the scheduler uses it: the longest cached
    // prefix of req.prompt goes into st (fresh), the rest is prefilled in pieces that carry or end at the cache's
    // checkpoint positions, then decoding; the sequence (prompt + what it ran) is stored at the end. `tansy run
    // --chat` thus prefills only each new message.
    generation_stats generate_cached(prefix_cache& cache, seq_state& st, const generation_request& req,
                                     const std::function<bool(int32_t)>& on_token);

    // Ids at or above this are padding rows of the embedding and are never sampled (MODEL.md §6).
    int64_t n_valid_tokens() const { return n_valid_; }
    void set_valid_tokens(int64_t n) { n_valid_ = n > 0 && n < model_->cfg.vocab ? n : model_->cfg.vocab; }

  private:
    void init(const engine_options& opt);

    std::unique_ptr<model> model_;
    std::unique_ptr<backend> backend_;
    std::unique_ptr<forward_pass> fwd_;
    std::unique_ptr<decode_step> dec_;  // generate()'s one-slot step
    bool dec_graphs_ = false;
    buffer prompt_ids_;
    int64_t n_valid_ = 0;
};

}  // namespace tansy
