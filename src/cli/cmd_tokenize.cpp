// tansy tokenize: text -> ids, or (--decode) ids -> text, with a model's tokenizer.json.
#include <cstdio>
#include <string>
#include <vector>

#include "cli/args.h"
#include "core/check.h"
#include "model/config.h"
#include "runtime/engine.h"
#include "tokenizer/tokenizer.h"

namespace tansy {

int cmd_tokenize(int argc, char** argv) {
    arg_parser p("tokenize", "[--model DIR|tokenizer.json] (--text-file F | --text S | --decode --ids-file F)",
                 "Prints the token ids of a UTF-8 text, space-separated on one line; with --decode prints the\n"
                 "text of token ids exactly as decoded (no newline added).");
    p.option("--model", "PATH", "model directory or tokenizer.json; default: the bundled tiny model")
        .option("--text-file", "F", "text to tokenize (UTF-8; an error if it is not)")
        .option("--text", "S", "text to tokenize, given on the command line")
        .option("--no-special", "", "treat special-token text such as <|im_end|> as plain text")
        .option("--decode", "", "decode the ids of --ids-file instead")
        .option("--ids-file", "F", "token ids separated by whitespace or commas (for --decode)")
        .option("--skip-special", "", "with --decode: leave special tokens out");
    if (!p.parse(argc, argv)) return 0;
    const tokenizer tok = tokenizer::load(model_path_arg(p, "--model", default_model_dir()));

    if (p.has("--decode")) {
        if (!p.has("--ids-file")) fail("tokenize: --decode needs --ids-file");
        if (p.has("--text-file") || p.has("--text")) fail("tokenize: --decode takes --ids-file, not text");
        const std::string text = tok.decode(read_ids_file(p.str("--ids-file")), p.has("--skip-special"));
        if (fwrite(text.data(), 1, text.size(), stdout) != text.size()) fail("tokenize: write error");
        return 0;
    }
    if (p.has("--text-file") == p.has("--text")) fail("tokenize: give exactly one of --text-file and --text");
    const std::string text = p.has("--text") ? p.str("--text") : read_text_file(p.str("--text-file"));
    const std::vector<int32_t> ids = tok.encode(text, !p.has("--no-special"));
    std::string line;
    line.reserve(ids.size() * 7);
    for (size_t i = 0; i < ids.size(); i++) {
        if (i) line += ' ';
        line += std::to_string(ids[i]);
    }
    line += '\n';
    if (fwrite(line.data(), 1, line.size(), stdout) != line.size()) fail("tokenize: write error");
    return 0;
}

}  // namespace tansy
