// A small command-line option parser: --name VALUE, --name=VALUE, boolean --flag, short aliases such as -n.
// Unknown options, missing values and malformed numbers are tansy::error with a one-line message.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tansy {

class arg_parser {
  public:
    arg_parser(std::string command, std::string synopsis, std::string description);

    // metavar empty: a boolean flag. alias: optional short spelling ("-n").
    arg_parser& option(const std::string& name, const std::string& metavar, const std::string& help,
                       const std::string& alias = "", bool repeatable = false);

    // Returns false when --help was given (help already printed to stdout).
    bool parse(int argc, char** argv);

    bool has(const std::string& name) const;
    std::string str(const std::string& name, const std::string& dflt = "") const;
    std::vector<std::string> all(const std::string& name) const;
    int64_t integer(const std::string& name, int64_t dflt) const;
    double number(const std::string& name, double dflt) const;
    std::string help() const;

  private:
    struct spec {
        std::string name, metavar, help, alias;
        bool repeatable;
    };
    const spec* lookup(const std::string& s) const;
    std::string command_, synopsis_, description_;
    std::vector<spec> specs_;
    std::map<std::string, std::vector<std::string>> values_;
};

// The environment the command line reads (the only reads below main but the server's and the kernel plan's
// documented ones): the model to use without --model ($TANSY_MODEL, a path or ORG/NAME[@REV], else the bundled
// tiny model), and the Hugging Face hub cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub).
std::string default_model_dir();
std::string hf_hub_cache_dir();

// A checkpoint option (--model, --compare-model) as a path: a directory as given, or ORG/NAME[@REV] found in the
// local Hugging Face cache (loader/hf_cache.h); `dflt` when the option is absent.
std::string model_path_arg(const arg_parser& p, const std::string& name = "--model", const std::string& dflt = "");

// Token ids from a file: integers separated by whitespace and/or commas (a JSON array also works).
std::vector<int32_t> read_ids_file(const std::string& path);

}  // namespace tansy
