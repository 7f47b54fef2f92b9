// CLI subcommands. Each takes the arguments after its name and returns the process exit status.
#pragma once
#include "cli/args.h"
#include "runtime/engine.h"
#include "runtime/text_engine.h"
#include "sampling/sampler.h"

namespace tansy {

struct serve_options;  // server/server.h

int cmd_logits(int argc, char** argv);
int cmd_generate(int argc, char** argv);
int cmd_eval(int argc, char** argv);
int cmd_info(int argc, char** argv);
int cmd_convert(int argc, char** argv);
int cmd_render(int argc, char** argv);
int cmd_tokenize(int argc, char** argv);
int cmd_bench(int argc, char** argv);
int cmd_run(int argc, char** argv);
int cmd_serve(int argc, char** argv);
int cmd_bench_serve(int argc, char** argv);  // tansy bench --serve (cmd_bench hands over)

// --model, --backend, --threads: shared by every command that runs the model.
void add_engine_options(arg_parser& p);
engine_options engine_options_from(const arg_parser& p);
// --kernels (cuda/kernel_plan.h syntax), or the defaults without it; a clear error on a bad spec.
kernel_options kernel_options_from(const arg_parser& p);
// The value of a KV-cache option (`option`, e.g. "--kv-cache"): true for fp8, false for bf16, else a clear error.
bool kv_fp8_from(const std::string& value, const char* option);
// --deltanet-state's value: fp32 (false) or bf16 (true); fails naming the option otherwise.
bool state_bf16_from(const std::string& value, const char* option);

// --synthetic, --layers, --seed, --skew: serve random weights of a config.json (serve, bench --serve). The
// seed and skew go into eo.backend_opt; the spec is empty without --synthetic.
void add_synthetic_options(arg_parser& p);
synthetic_spec synthetic_from(const arg_parser& p, engine_options& eo);
// The default sequence-state budget of a server: half of the available memory on cpu, 16 GiB on cuda.
size_t default_state_budget(const std::string& backend);
// The batch, state-memory and prefix-cache options that serve and bench --serve share (cmd_serve.cpp), with the
// defaults the command states; batch_options_from validates them into o (after o.engine is set).
void add_batch_options(arg_parser& p, const std::string& max_batch_default, const std::string& state_default);
void batch_options_from(const arg_parser& p, const char* cmd, int max_batch, size_t state_budget, serve_options& o);

// --temperature, --top-k, --top-p, --min-p, --seed: shared by generate and run.
void add_sampling_options(arg_parser& p);
sampling_params sampling_from(const arg_parser& p);

}  // namespace tansy
