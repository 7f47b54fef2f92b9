// tansy render: an OpenAI-style chat request -> the prompt text the model sees (Qwen3.6 chat template).
#include <cstdio>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/args.h"
#include "core/check.h"
#include "model/config.h"  // read_text_file
#include "runtime/engine.h"
#include "tokenizer/chat_template.h"

namespace tansy {

namespace {

nlohmann::ordered_json parse_request(const std::string& text, const std::string& path) {
    try {
        return nlohmann::ordered_json::parse(text);  // ordered: tools and arguments are printed in the given order
    } catch (const nlohmann::json::parse_error& e) {
        // e.what() is one line; the token it quotes has control characters escaped
        fail("render: %s is not valid JSON: %s", path.c_str(), e.what());
    }
}

}  // namespace

int cmd_render(int argc, char** argv) {
    arg_parser p("render", "--request-file F [--model DIR]",
                 "Renders an OpenAI-style chat request (messages, optional tools, chat_template_kwargs,\n"
                 "add_generation_prompt: default true) with the Qwen3.6 chat template and prints the prompt\n"
                 "exactly, with no newline added.");
    p.option("--model", "DIR", "model directory; default: the bundled tiny model (its files are not read yet)")
        .option("--request-file", "F", "chat request JSON");
    if (!p.parse(argc, argv)) return 0;
    if (!p.has("--request-file")) fail("render: --request-file is required");
    const std::string model_dir = model_path_arg(p, "--model", default_model_dir());
    // The template is native, so the model's files are not needed; the directory must still exist so that a
    // typo fails now rather than when rendering starts to depend on the model (e.g. its chat_template.jinja).
    if (!std::filesystem::exists(model_dir)) fail("render: model directory '%s' does not exist", model_dir.c_str());
    if (!std::filesystem::is_directory(model_dir)) fail("render: --model '%s' is not a directory", model_dir.c_str());
    const std::string path = p.str("--request-file");
    const std::string prompt = render_chat_request(parse_request(read_text_file(path), path));
    if (fwrite(prompt.data(), 1, prompt.size(), stdout) != prompt.size() || fflush(stdout) != 0)
        fail("render: cannot write to stdout");
    return 0;
}

}  // namespace tansy
