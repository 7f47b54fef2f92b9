// Prompt text for `tansy bench --serve`: seeded random words behind a tag, so that no two prompts share more
// than a few tokens of prefix (the prefix cache finds nothing to reuse between them unless a scenario means it to).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace tansy {

class prompt_maker {
  public:
    explicit prompt_maker(const tokenizer& tok);

    // A message whose chat prompt, as the one user message of a conversation, is about n tokens (never more):
    // the tag, then words drawn with the seed. Counting a word's tokens alone is exact because the
    // pre-tokenizer splits " word" pieces on their own.
    std::string make(const std::string& tag, uint64_t seed, int64_t n) const;
    // Tokens of the chat prompt of one user message with this content.
    int64_t count(const std::string& content) const;

  private:
    const tokenizer& tok_;
    std::vector<std::pair<std::string, int64_t>> pieces_;  // " word", its tokens
};

}  // namespace tansy
