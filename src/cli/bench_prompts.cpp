#include "cli/bench_prompts.h"

#include <nlohmann/json.hpp>
#include <random>

#include "tokenizer/chat_template.h"

namespace tansy {

prompt_maker::prompt_maker(const tokenizer& tok) : tok_(tok) {
    static const char* const words[] = {
        "apple", "river", "stone", "cloud", "garden", "music", "window", "forest", "silver", "harbor",
        "lantern", "meadow", "engine", "pepper", "candle", "thunder", "valley", "mirror", "orange", "planet",
        "rocket", "saddle", "ticket", "violet", "wander", "yellow", "zebra", "anchor", "bridge", "copper",
        "desert", "feather", "glacier", "hammer", "island", "jungle", "kettle", "ladder", "marble", "needle",
        "ocean", "pillow", "quartz", "ribbon", "shadow", "tunnel", "umbrella", "velvet", "walnut", "basket",
        "castle", "dragon", "falcon", "ginger", "hollow", "insect", "jacket", "kitten", "lemon", "mango",
        "number", "office", "parrot", "rabbit"};
    for (const char* w : words) {
        const std::string piece = std::string(" ") + w;
        pieces_.push_back({piece, (int64_t)tok_.encode(piece).size()});
    }
}

std::string prompt_maker::make(const std::string& tag, uint64_t seed, int64_t n_max) const {
    std::mt19937_64 rng(seed);
    std::string text = tag;
    int64_t n = count(tag);
    for (;;) {
        const auto& [piece, k] = pieces_[rng() % pieces_.size()];
        if (n + k > n_max) break;
        text += piece;
        n += k;
    }
    return text;
}

int64_t prompt_maker::count(const std::string& content) const {
    const nlohmann::ordered_json messages = nlohmann::ordered_json::array({{{"role", "user"}, {"content", content}}});
    return (int64_t)tok_.encode(render_chat(messages, nullptr, chat_options{})).size();
}

}  // namespace tansy
