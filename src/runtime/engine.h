// Owns a loaded model, a backend with its weights bound, and a forward pass: what every CLI command and the
// server start from.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/forward.h"
#include "model/weights.h"

namespace tansy {

struct engine_options {
    std::string model_dir;   // empty: the embedded default model
    std::string backend = "cpu";
    int threads = 0;         // CPU threads; 0: all cores
};

// The bundled tiny chat model (models/tiny-chat-q4), or $TANSY_MODEL when set.
std::string default_model_dir();

class engine {
  public:
    explicit engine(const engine_options& opt);  // throws tansy::error

    const model& mdl() const { return *model_; }
    const model_config& cfg() const { return model_->cfg; }
    backend& be() { return *backend_; }
    forward_pass& fwd() { return *fwd_; }

    std::unique_ptr<seq_state> new_sequence(int64_t capacity) { return backend_->new_state(capacity); }

    // Throws tansy::error if any id is outside the vocabulary.
    void check_ids(const std::vector<int32_t>& ids) const;

    // Processes `ids` after what `st` holds; returns host logits per `which` ([n, V], [1, V] or empty).
    std::vector<float> step(seq_state& st, const std::vector<int32_t>& ids, logits_rows which);

  private:
    std::unique_ptr<model> model_;
    std::unique_ptr<backend> backend_;
    std::unique_ptr<forward_pass> fwd_;
};

}  // namespace tansy
