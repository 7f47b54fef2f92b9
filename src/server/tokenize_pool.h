// Tokenises on a few dedicated threads instead of on every HTTP worker: the tokenizer keeps a per-thread
// pre-token cache (~6 MB, tokenizer.h), so encoding on each of 64+ workers would cost hundreds of MB that
// stay resident as long as the workers live. Callers block until their text is encoded. Each thread encodes once
// at construction, so no request pays for setting up its cache.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "server/worker_pool.h"
#include "tokenizer/tokenizer.h"

namespace tansy {

class tokenize_pool {
  public:
    tokenize_pool(const tokenizer& tok, int threads);
    ~tokenize_pool();
    // tokenizer::encode(text, plain) on a pool thread (no added token matches inside the plain ranges);
    // rethrows its errors (tansy::error for invalid UTF-8).
    std::vector<int32_t> encode(const std::string& text, const std::vector<byte_range>& plain = {});

  private:
    const tokenizer& tok_;
    worker_pool pool_;
};

}  // namespace tansy
