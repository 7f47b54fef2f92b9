// The CUDA backend's kernel plan: which kernel family runs each op for a given row count and shape, decided once
// when the backend is made (from the device, the model and backend_options::kernels, i.e. --kernels) and printed
// by `tansy info --backend cuda` and the bench header (llama.cpp's per-op choice in one function; FlashInfer's
// plan/run split). Launchers read the active plan (the calling backend's: active_kernel_plan) for the switches
// below; the row-count boundaries are compile-time where they size kernels' shared arrays. TANSY_KERNELS (the
// --kernels syntax) is the one debug override of the environment, read in kernel_plan.cpp alone.
// Plain C++ with no CUDA header: built into every configuration (the CLI parses --kernels without CUDA too).
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace tansy {
struct kernel_options;
struct model_config;
}  // namespace tansy

namespace tansy::cuda {

// ---- Row-count boundaries (the rows of one forward call: decode tokens of a batch, or prompt tokens)

// Dense and MoE products of at least this many rows may run on the tensor-core GEMMs (gemm.cu, moe_grouped.cu),
// which read each weight once for all rows; below it, the decode kernels (gemv_*.cu, moe_decode_*.cu). At 16 rows
// the decode kernels measured faster than the GEMMs, and in groups up to 96 rows (kernel_plan::moe_groups).
constexpr int k_gemm_min_rows = 17;
// From this many rows, dense GEMMs take 128-row tiles where they fit, or on Hopper's wgmma GEMM (when enabled)
// tiles of k_gemm_wgmma_dense_tokens tokens (64 below). 256 against 128 measured +5% on 2K and 8K prompts (H100).
constexpr int k_gemm_wide_min_rows = 512;
constexpr int k_gemm_wgmma_dense_tokens = 256;
// Routed experts' tiles on the wgmma GEMM (moe_plan's bm): a tile costs about the same whether it holds 8 tokens
// or 64, so the widest tile that still runs two CTAs an SM (80 tokens: 128 registers) leaves the fewest tiles
// once experts average k_gemm_wgmma_moe_wide_rows rows (a 2K prompt's average 64: 64-token tiles split half of
// them in two); below, 64-token tiles (the 80-token kernel runs a few % slower per tile). 128-token tiles (one CTA
// an SM) measured slower than either at 4K and 8K tokens (H100).
constexpr int k_gemm_wgmma_moe_tokens = 80;
constexpr int k_gemm_wgmma_moe_wide_rows = 48;
// The GEMV's RMS-norm prologue handles up to this many rows (a shared array's size); more are normalised first.
constexpr int k_gemv_max_norm_rows = 16;
// The tensor-core GEMV takes up to 16 input rows (two mma n-groups of 8); a batch the 16-row form cannot hold
// runs in groups of 8.
constexpr int k_mma_max_tokens = 16, k_mma_group_tokens = 8;
// The per-warp tensor-core GEMV (gemv_mma_warp.cu) takes up to 32 rows where their staged x fits in shared memory
// (K = 2048: 133 KB; K = 4096 takes 16), without the RMS-norm prologue past k_gemv_max_norm_rows: each weight
// fragment then serves twice the rows, so a decode batch's dense products run in half the groups.
constexpr int k_mma_warp_max_tokens = 32;
// Attention: rows of spans of at least this many rows go to attention_prefill, the others to attention_decode.
// note: 16 rows keep a 64-row tensor-core tile at least a quarter busy; below that the decode path, which walks
// the context once per row, is cheap enough. (Without spans every row goes to attention_decode.)
constexpr int k_attn_prefill_min_rows = 16;
// DeltaNet: spans of at most this many rows run the recurrent kernel, longer ones the chunked prefill path.
// note: the decode kernel costs ~1-2 us per token and layer, the prefill path two extra launches (a few us) and
// then ~0.1 us per token, so the crossover lies at a few tokens; 16 keeps short speculative/verification spans
// on the latency-tuned kernel and must stay >= K-1 (a long span's new conv window is its own rows).
constexpr int k_gdn_recur_max_rows = 16;

// DeltaNet decode batches of at least this many sequences stage the state in shared memory (recur_smem_kernel: ~2x
// the state bytes in flight per SM, +6-14% decode at 16-256 rows), smaller ones keep it in registers
// (recur_kernel: one round trip less, 4% faster at 4 rows).
constexpr int k_recur_smem_min_spans = 8;

// The default of kernel_plan::moe_groups: decode batches up to this many rows stay on the decode kernels (in
// groups), larger ones go to the GEMMs.
constexpr int k_decode_groups_max_rows = 96;
// The default of kernel_plan::moe_small: MoE blocks up to this many rows (fast mode) run moe_grouped_mma.cu.
constexpr int k_moe_small_max_rows = 256;
// Below this many rows the decode kernels in groups (where moe_groups takes the rows) measured faster than the
// small-M grouped kernels (24 rows: two groups of 12), from it slower (docs/PERF.md: decode batches of 17-256).
constexpr int k_moe_small_min_rows = 32;

// Dense store GEMMs whose CTAs would leave at least half the SMs idle (a decode batch's output projections: 16
// CTAs of 128 W rows; the router: 3) split K into slices of at least this many k-tiles (the precise kernel's
// k-tiles cost ~3x: 2), as many as fill the SMs' CTA slots, at most kernel_plan::gemm_split, summed in order by a
// second kernel (gemm_params::split_k).
constexpr int k_gemm_split_min_ktiles = 8, k_gemm_split_min_ktiles_precise = 2;
constexpr int k_gemm_split_max = 16;

// ---- Kernel-family switches

// Which decode kernel families run on tensor cores (mma_dot.cuh) where the shapes allow: bits of
// kernel_plan::mma_families. Default: gemvn (a decode batch's 2..16 rows share one dequantisation); one row stays
// on the CUDA-core kernels, which measured faster for it (docs/PERF.md).
enum mma_family : unsigned { mma_gemv1 = 1, mma_gemvn = 2, mma_gate_up = 4, mma_down = 8, mma_all = 15 };
constexpr unsigned k_mma_default_families = mma_gemvn;

// What the device offers the plan (filled by the CUDA backend; empty in a plan made without a device).
struct kernel_device {
    std::string name;
    int cc = 0;             // 10 * major + minor (90: H100/H200)
    int sms = 0;            // streaming multiprocessors
    size_t smem_optin = 0;  // dynamic shared memory a block may opt in to, bytes
    bool wgmma = false;     // the wgmma GEMM is in this build (90 among TANSY_CUDA_ARCHS) and runs here (cc 9.0)
};

// kernel_plan::recur's form for a batch of `spans` sequences: 0 registers, 1 shared memory, -1 by the batch.
inline bool recur_smem_form(int recur, int64_t spans) { return recur >= 0 ? recur == 1 : spans >= k_recur_smem_min_spans; }

struct kernel_plan {
    kernel_device dev;
    bool precise = false;  // backend_options::precise_gemm: split-bf16 GEMMs, fp32 decode inputs
    // the model's main shapes (0 when the plan was made without a model)
    int64_t hidden = 0, expert_inter = 0, shared_inter = 0, n_experts = 0, top_k = 0;
    unsigned mma_families = k_mma_default_families;  // mma_family bits
    bool int8_inputs = true;  // fast mode's one-row 4-bit decode kernels take x as two-level int8 (xq.cuh, dp4a)
    bool gemm_wgmma = true;   // fast-mode 4-bit GEMMs on wgmma (sm90/gemm_wgmma.cu) where built and on cc 9.0
    bool gemm_tma = true;     // its prompt-sized dense and routed down calls' X tiles by TMA (a copy a k-tile)
    // MoE blocks of k_gemm_min_rows .. moe_groups rows (a decode batch of 17+ sequences) run the decode kernels in
    // even groups of at most k_mma_max_tokens rows instead of the grouped GEMMs (0: never): each group reads the
    // experts its rows touch, where the GEMMs' 64-row tiles hold 2-8 rows per expert (measured faster up to 96
    // rows on the H200, the GEMMs from 128). Dense products of k_gemm_min_rows .. dense_groups rows likewise on the
    // GEMV kernels (default 0: the wgmma GEMM with K split, which reads each weight once, measured 6-28% faster
    // a step at 32-256 rows on the H100; docs/PERF.md: decode batches of 17-256).
    int moe_groups = k_decode_groups_max_rows;
    int dense_groups = 0;
    // MoE blocks of k_gemm_min_rows .. moe_small rows in fast mode run the small-M grouped kernels
    // (moe_grouped_mma.cu: tiles of <= 16 expert-sorted rows, each touched expert read once, the shared expert in
    // the same launches) where the weights suit them (moe_small_supports), before the grouped GEMMs and, from
    // k_moe_small_min_rows rows, before moe_groups (0: never).
    int moe_small = k_moe_small_max_rows;
    // A decode batch's dense products run in even groups of at most this many rows where gemv_mma_warp.cu takes
    // them (else k_mma_max_tokens): 16 .. k_mma_warp_max_tokens.
    int dense_rows = k_mma_warp_max_tokens;
    // The most K slices of a dense store GEMM that leaves most SMs idle (0 or 1: never split).
    int gemm_split = k_gemm_split_max;
    // The small-M MoE kernels' grid: items (16 weight rows x the whole K) per warp, which sets the slices of each
    // tile and so how often a tile's rows are staged (gate/up items are twice as long as down's).
    int moe_small_gate_up_items = 1, moe_small_down_items = 2;
    // DeltaNet decode spans (gdn.cu): 0 the state in registers (recur_kernel), 1 staged in shared memory
    // (recur_smem_kernel); -1: by the batch's spans (recur_smem()).
    int recur = -1;
    std::string source = "defaults";  // where the switches came from: defaults, --kernels, TANSY_KERNELS

    bool mma(mma_family f) const { return (mma_families & f) != 0; }
    bool wgmma() const { return gemm_wgmma && dev.wgmma; }
    static bool use_gemm(int64_t rows) { return rows >= k_gemm_min_rows; }
    bool moe_in_groups(int64_t rows) const { return rows >= k_gemm_min_rows && rows <= moe_groups; }
    bool dense_in_groups(int64_t rows) const { return rows >= k_gemm_min_rows && rows <= dense_groups; }
    // Whether a dense product of this many rows runs on the GEMMs: fp16 inputs past the groups; fp32 inputs (the
    // router) from k_gemm_min_rows rows where K splits (the precise GEMM split over K), else past the groups too.
    bool dense_gemm(int64_t rows, bool fp32_inputs) const {
        return use_gemm(rows) && (!dense_in_groups(rows) || (fp32_inputs && gemm_split >= 2));
    }
    bool moe_in_small(int64_t rows) const {
        return !precise && rows >= k_gemm_min_rows && rows <= moe_small &&
               (rows >= k_moe_small_min_rows || !moe_in_groups(rows));
    }
    bool recur_smem(int64_t spans) const { return recur_smem_form(recur, spans); }
    // The plan in words, one decision a line, each line starting with `indent` (after the first).
    std::string describe(const char* indent = "") const;
};

// The plan for a device, a model (may be null) and the options; then TANSY_KERNELS applied on top.
kernel_plan make_kernel_plan(const kernel_device& dev, const model_config* cfg, bool precise,
                             const kernel_options& opt);

// The plan the launchers consult: each CUDA backend points it at its own plan on every call that launches
// kernels, so backends with different plans can share a process (tests keep fast and precise engines side by
// side); with none, the defaults with TANSY_KERNELS applied. The pointer is per thread; forcing (below) is
// process-wide. Captured graph launches keep their kernels.
// release_kernel_plan(p) returns to the defaults if p is active (a backend's destructor).
const kernel_plan& active_kernel_plan();
void use_kernel_plan(const kernel_plan* plan);
void release_kernel_plan(const kernel_plan* plan);

// Four forms as the launchers read them: the active plan's, unless a test forces one process-wide.
unsigned decode_mma_families();
bool decode_int8_inputs();
bool deltanet_recur_smem(int64_t spans);
bool gemm_wgmma_requested();
bool gemm_tma_requested();
// Forcing (tests run every form whatever the plan: tests/cuda/cuda_test_util.h setting_scope): each takes the
// forced value (nullopt: the plan's own again) and returns the previous one.
std::optional<unsigned> force_mma_families(std::optional<unsigned> families);
std::optional<bool> force_int8_inputs(std::optional<bool> on);
std::optional<int> force_deltanet_recur(std::optional<int> form);  // kernel_plan::recur's values
std::optional<bool> force_gemm_wgmma(std::optional<bool> on);
std::optional<bool> force_gemm_tma(std::optional<bool> on);

// --kernels / TANSY_KERNELS: KEY=VALUE items separated by ',' (or ';', which survives scripts/device.sh ab-multi's
// comma-separated environments), applied onto *opt:
//   mma=FAMILIES   decode families on tensor cores: '+'-joined gemv1, gemvn, gate_up, down, or all / none
//   int8=on|off    int8 inputs of the one-row 4-bit decode kernels (off: fp16 inputs)
//   wgmma=on|off   Hopper wgmma for the prompt GEMMs (off: mma.sync)
//   tma=on|off     the wgmma GEMM's prompt-sized dense and routed down calls copy X by TMA (off: 16-byte copies by
//                  every thread)
//   moe_groups=N   MoE blocks of 17..N rows on the decode kernels in groups of <= 16 rows (0: grouped GEMMs)
//   dense_groups=N dense products of 17..N rows on the GEMV kernels in groups of <= 16 rows (0: GEMMs)
//   moe_small=N    MoE blocks of 17..N rows (fast mode) on the small-M grouped MoE kernels (0: off)
//   dense_rows=N   a decode batch's dense products in groups of at most N rows (16..32)
//   gemm_split=N   the most K slices of a dense GEMM whose CTAs leave most SMs idle (0..64; 0 or 1: never)
//   moe_small_gu=N, moe_small_dn=N   the small-M MoE kernels' items per warp, gate/up and down (1..8)
//   recur=N        DeltaNet decode: 0 the state in registers, 1 staged in shared memory
// Returns an empty string, or what is wrong with the spec.
std::string parse_kernel_options(const std::string& spec, kernel_options* opt);

}  // namespace tansy::cuda
