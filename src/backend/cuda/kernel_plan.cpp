// kernel_plan.h: the plan's builder, its description, the --kernels parser, and the one place the environment
// (TANSY_KERNELS, a debug override) is read below the CLI.
#include "backend/cuda/kernel_plan.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "backend/backend.h"
#include "core/check.h"
#include "model/config.h"

namespace tansy::cuda {

namespace {

std::string families_name(unsigned f) {
    if ((f & mma_all) == 0) return "none";
    if ((f & mma_all) == mma_all) return "all";
    std::string s;
    const std::pair<unsigned, const char*> names[] = {
        {mma_gemv1, "gemv1"}, {mma_gemvn, "gemvn"}, {mma_gate_up, "gate_up"}, {mma_down, "down"}};
    for (const auto& [bit, name] : names)
        if (f & bit) s += (s.empty() ? "" : "+") + std::string(name);
    return s;
}

// '+'-joined family names; false on an unknown one (named in *bad).
bool parse_families(const std::string& v, unsigned* out, std::string* bad) {
    unsigned m = 0;
    for (size_t i = 0; i <= v.size();) {
        size_t j = v.find('+', i);
        if (j == std::string::npos) j = v.size();
        const std::string t = v.substr(i, j - i);
        if (t == "all" || t == "1")
            m |= mma_all;
        else if (t == "gemv1")
            m |= mma_gemv1;
        else if (t == "gemvn")
            m |= mma_gemvn;
        else if (t == "gate_up")
            m |= mma_gate_up;
        else if (t == "down")
            m |= mma_down;
        else if (!(t == "none" || t == "0" || t.empty())) {
            *bad = t;
            return false;
        }
        i = j + 1;
    }
    *out = m;
    return true;
}

int parse_on_off(const std::string& v) {
    if (v == "on" || v == "1") return 1;
    if (v == "off" || v == "0") return 0;
    return -1;
}

void apply(const kernel_options& o, kernel_plan& p) {
    if (o.mma_families >= 0) p.mma_families = (unsigned)o.mma_families & mma_all;
    if (o.int8_inputs >= 0) p.int8_inputs = o.int8_inputs != 0;
    if (o.gemm_wgmma >= 0) p.gemm_wgmma = o.gemm_wgmma != 0;
    if (o.gemm_tma >= 0) p.gemm_tma = o.gemm_tma != 0;
    if (o.moe_groups >= 0) p.moe_groups = o.moe_groups;
    if (o.dense_groups >= 0) p.dense_groups = o.dense_groups;
    if (o.moe_small >= 0) p.moe_small = o.moe_small;
    if (o.dense_rows > 0) p.dense_rows = o.dense_rows;
    if (o.gemm_split >= 0) p.gemm_split = o.gemm_split;
    if (o.moe_small_gate_up_items > 0) p.moe_small_gate_up_items = o.moe_small_gate_up_items;
    if (o.moe_small_down_items > 0) p.moe_small_down_items = o.moe_small_down_items;
    if (o.recur >= 0) p.recur = o.recur;
}

bool any(const kernel_options& o) {
    return o.mma_families >= 0 || o.int8_inputs >= 0 || o.gemm_wgmma >= 0 || o.gemm_tma >= 0 || o.moe_groups >= 0 ||
           o.dense_groups >= 0 || o.moe_small >= 0 || o.dense_rows > 0 || o.moe_small_gate_up_items > 0 ||
           o.moe_small_down_items > 0 || o.recur >= 0 || o.gemm_split >= 0;
}

// TANSY_KERNELS: the debug override, on top of whatever the options chose. A malformed value aborts (it is set by
// hand for a measurement; silently ignoring it would measure the wrong kernels).
void apply_env(kernel_plan& p) {
    const char* v = std::getenv("TANSY_KERNELS");
    if (!v || !*v) return;
    kernel_options o;
    const std::string why = parse_kernel_options(v, &o);
    TANSY_CHECK(why.empty(), "TANSY_KERNELS=%s: %s", v, why.c_str());
    apply(o, p);
    p.source += std::string(p.source.empty() ? "" : ", ") + "TANSY_KERNELS=" + v;
}

kernel_plan default_plan() {
    kernel_plan p;
    apply_env(p);
    return p;
}

// The plan before any backend (op tests): the defaults with TANSY_KERNELS applied.
const kernel_plan& defaults() {
    static const kernel_plan p = default_plan();
    return p;
}
// Per thread: a backend's ops run on one thread at a time, and each points it at its plan first.
const kernel_plan*& active_ptr() {
    static thread_local const kernel_plan* p = &defaults();
    return p;
}
const kernel_plan& active() { return *active_ptr(); }

// The forms tests force over whichever plan is active (kernel_plan.h).
struct overrides {
    std::optional<unsigned> mma_families;
    std::optional<bool> int8_inputs, gemm_wgmma, gemm_tma;
    std::optional<int> recur;
};
overrides& forced() {
    static overrides o;
    return o;
}

template <class T>
std::optional<T> exchange(std::optional<T>& slot, std::optional<T> v) {
    std::optional<T> prev = slot;
    slot = v;
    return prev;
}

}  // namespace

const char* const k_keys = "mma, int8, wgmma, tma, moe_groups, dense_groups, moe_small, dense_rows, moe_small_gu, moe_small_dn, recur, gemm_split";

std::string parse_kernel_options(const std::string& spec, kernel_options* opt) {
    for (size_t i = 0; i <= spec.size();) {
        size_t j = spec.find_first_of(",;", i);
        if (j == std::string::npos) j = spec.size();
        const std::string item = spec.substr(i, j - i);
        i = j + 1;
        if (item.empty()) continue;
        const size_t eq = item.find('=');
        if (eq == std::string::npos) return "'" + item + "' is not KEY=VALUE (keys: " + k_keys + ")";
        const std::string key = item.substr(0, eq), val = item.substr(eq + 1);
        if (key == "mma") {
            unsigned f = 0;
            std::string bad;
            if (!parse_families(val, &f, &bad))
                return "mma: unknown kernel family '" + bad + "' (gemv1, gemvn, gate_up, down, all, none)";
            opt->mma_families = (int)f;
        } else if (key == "int8" || key == "wgmma" || key == "tma") {
            const int b = parse_on_off(val);
            if (b < 0) return key + " must be on or off, got '" + val + "'";
            (key == "int8" ? opt->int8_inputs : key == "wgmma" ? opt->gemm_wgmma : opt->gemm_tma) = b;
        } else if (key == "moe_groups" || key == "dense_groups" || key == "moe_small" || key == "gemm_split") {
            const bool split = key == "gemm_split";
            const long hi = split ? 64 : 4096;
            char* end = nullptr;
            const long n = strtol(val.c_str(), &end, 10);
            if (val.empty() || *end || n < 0 || n > hi)
                return key + " takes " + (split ? "a slice count" : "a row count") + " in 0.." + std::to_string(hi) + ", got '" + val + "'";
            (key == "moe_groups" ? opt->moe_groups : key == "dense_groups" ? opt->dense_groups
                                                   : split                 ? opt->gemm_split
                                                                           : opt->moe_small) = (int)n;
        } else if (key == "dense_rows" || key == "moe_small_gu" || key == "moe_small_dn") {
            const bool rows = key == "dense_rows";
            const long lo = rows ? k_mma_max_tokens : 1, hi = rows ? k_mma_warp_max_tokens : 8;
            char* end = nullptr;
            const long n = strtol(val.c_str(), &end, 10);
            if (val.empty() || *end || n < lo || n > hi)
                return key + " takes " + std::to_string(lo) + ".." + std::to_string(hi) + ", got '" + val + "'";
            (rows ? opt->dense_rows : key == "moe_small_gu" ? opt->moe_small_gate_up_items : opt->moe_small_down_items) = (int)n;
        } else if (key == "recur") {
            if (val != "0" && val != "1") return "recur takes 0 (registers) or 1 (shared memory), got '" + val + "'";
            opt->recur = val == "1";
        } else {
            return "unknown key '" + key + "' (" + k_keys + ")";
        }
    }
    return "";
}

kernel_plan make_kernel_plan(const kernel_device& dev, const model_config* cfg, bool precise,
                             const kernel_options& opt) {
    kernel_plan p;
    p.dev = dev;
    p.precise = precise;
    if (cfg) {
        p.hidden = cfg->hidden, p.expert_inter = cfg->expert_inter, p.shared_inter = cfg->shared_inter;
        p.n_experts = cfg->n_experts, p.top_k = cfg->top_k;
    }
    p.source = any(opt) ? "--kernels" : "";
    apply(opt, p);
    apply_env(p);
    if (p.source.empty()) p.source = "defaults";
    return p;
}

std::string kernel_plan::describe(const char* indent) const {
    std::string s;
    char b[1024];
    auto line = [&](const char* fmt, auto... args) {
        snprintf(b, sizeof b, fmt, args...);
        s += (s.empty() ? "" : std::string("\n") + indent) + b;
    };
    if (!dev.name.empty())
        line("device     %s: compute capability %d.%d, %d SMs, %zu KB shared memory per block", dev.name.c_str(),
             dev.cc / 10, dev.cc % 10, dev.sms, dev.smem_optin / 1024);
    line("switches   mma=%s int8=%s wgmma=%s tma=%s moe_groups=%d dense_groups=%d moe_small=%d dense_rows=%d moe_small_gu=%d "
         "moe_small_dn=%d recur=%d gemm_split=%d (%s)%s",
         families_name(mma_families).c_str(), int8_inputs ? "on" : "off", gemm_wgmma ? "on" : "off", gemm_tma ? "on" : "off", moe_groups,
         dense_groups, moe_small, dense_rows, moe_small_gate_up_items, moe_small_down_items, recur, gemm_split, source.c_str(),
         gemm_wgmma && !wgmma() ? "; wgmma: not in this build or not on this device" : "");
    line("mode       %s", precise ? "precise (--gemm precise): split-bf16 GEMM operands, fp32 decode inputs"
                                  : "fast: fp16 GEMM operands; decode inputs rounded to fp16 as the GEMMs' are");
    if (hidden > 0)
        line("model      hidden %lld, experts %lld (top %lld) of width %lld, shared expert %lld", (long long)hidden,
             (long long)n_experts, (long long)top_k, (long long)expert_inter, (long long)shared_inter);
    const bool fast = !precise;
    const bool int8 = fast && int8_inputs;
    // in the order gemv.cu's and moe.cu's dispatch try them; each takes the shapes it supports
    line("1 row      dense: %s%sgemv_stream where a row splits over 32 lanes, else gemv_general",
         mma(mma_gemv1) ? "gemv_mma (tensor cores) where it fits, else " : "",
         int8 ? "4-bit: gemv_warp (int8 inputs; out_proj with the router tap), else " : "");
    line("2-%d rows  dense: %sgemv_general", k_gemm_min_rows - 1,
         fast && mma(mma_gemvn)
             ? "4-bit: gemv_mma_warp (tensor cores, per warp), else gemv_mma (ring; groups of 8 where 16 rows do not "
               "fit), else "
             : "");
    line("<= %d rows moe: gate/up %s%smoe_decode_stream (4-bit), else moe_route + moe_general; down %s%s"
         "moe_decode_stream; router: an fp32 GEMV%s",
         k_gemm_min_rows - 1, mma(mma_gate_up) ? "moe_decode_mma, else " : "",
         int8 ? "moe_decode_warp (int8), else " : "", mma(mma_down) ? "moe_decode_mma, else " : "",
         int8 ? "moe_decode_warp (int8), else " : "",
         int8 ? ", or one token's from out_proj's tap" : "");
    if (dense_groups >= k_gemm_min_rows)
        line("%d-%d rows  dense: the 2-%d row kernels above in groups of <= %d rows (<= %d where gemv_mma_warp.cu takes "
             "them: K = 2048); fp32 inputs (the router) in one launch of the general GEMV", k_gemm_min_rows, dense_groups,
             k_gemm_min_rows - 1, k_mma_max_tokens, dense_rows);
    if (fast && wgmma())
        line("%d+ rows   dense: GEMM, 4-bit on wgmma (sm90/gemm_wgmma.cu), 64-token tiles; from %d rows %d-token tiles",
             std::max(k_gemm_min_rows, dense_groups + 1), k_gemm_wide_min_rows, k_gemm_wgmma_dense_tokens);
    else
        line("%d+ rows   dense: GEMM (gemm.cu), 64-row tiles; from %d rows 128-row tiles where they fit%s",
             std::max(k_gemm_min_rows, dense_groups + 1), k_gemm_wide_min_rows, !fast ? " (fast mode only)" : " (mma.sync)");
    if (gemm_split >= 2)
        line("gemm split dense GEMMs (precise, or 4-bit on wgmma) whose CTAs leave half the SMs idle: K in up to %d "
             "slices of >= %d k-tiles (precise: %d), summed in order by a second kernel",
             gemm_split, k_gemm_split_min_ktiles, k_gemm_split_min_ktiles_precise);
    else
        line("gemm split off");
    const int small_from = moe_groups >= k_gemm_min_rows ? std::min(k_moe_small_min_rows, moe_groups + 1) : k_gemm_min_rows;
    if (fast && moe_small >= small_from)
        line("%d-%d rows moe: small-M grouped kernels (moe_grouped_mma.cu: tiles of <= %d expert-sorted rows, each "
             "touched expert read once, the shared expert in the same launches) where the experts are 4-bit and suit "
             "them; otherwise as below",
             small_from, moe_small, k_mma_max_tokens);
    if (moe_groups >= k_gemm_min_rows)
        line("%d-%d rows  moe: the decode kernels above in groups of <= %d rows; router: the general GEMV", k_gemm_min_rows,
             moe_groups, k_mma_max_tokens);
    char moe_tiles[96] = "";
    if (fast && wgmma())
        std::snprintf(moe_tiles, sizeof moe_tiles, ", %d-token tiles once experts average %d rows (wgmma)",
                      k_gemm_wgmma_moe_tokens, k_gemm_wgmma_moe_wide_rows);
    else if (fast)
        std::snprintf(moe_tiles, sizeof moe_tiles, ", 128-row tiles once experts average that many");
    line("%d+ rows   moe: grouped GEMMs over expert-sorted rows (moe_grouped.cu)%s, shared expert on a side stream; "
         "router: a precise GEMM",
         std::max(k_gemm_min_rows, moe_groups + 1), moe_tiles);
    line(
        "attention  spans < %d rows: split-K decode (attention.cu); longer: flash prefill tiles (attention_prefill.cu)",
        k_attn_prefill_min_rows);
    char recur_form[96];
    if (recur >= 0)
        snprintf(recur_form, sizeof recur_form, "the state %s", recur ? "staged in shared memory" : "in registers");
    else
        snprintf(recur_form, sizeof recur_form, "the state in registers below %d sequences, else in shared memory",
                 k_recur_smem_min_spans);
    line("deltanet   spans <= %d rows: recurrent (gdn.cu: %s); longer: chunk-parallel (gdn_prefill.cu) unless "
         "--deltanet", k_gdn_recur_max_rows, recur_form);
    return s;
}

const kernel_plan& active_kernel_plan() { return active(); }
void use_kernel_plan(const kernel_plan* plan) { active_ptr() = plan ? plan : &defaults(); }
void release_kernel_plan(const kernel_plan* plan) {
    if (active_ptr() == plan) active_ptr() = &defaults();
}

unsigned decode_mma_families() { return forced().mma_families.value_or(active().mma_families); }
bool decode_int8_inputs() { return forced().int8_inputs.value_or(active().int8_inputs); }
bool deltanet_recur_smem(int64_t spans) { return recur_smem_form(forced().recur.value_or(active().recur), spans); }
bool gemm_wgmma_requested() { return forced().gemm_wgmma.value_or(active().gemm_wgmma); }
bool gemm_tma_requested() { return forced().gemm_tma.value_or(active().gemm_tma); }

std::optional<unsigned> force_mma_families(std::optional<unsigned> families) {
    if (families) *families &= mma_all;
    return exchange(forced().mma_families, families);
}
std::optional<bool> force_int8_inputs(std::optional<bool> on) { return exchange(forced().int8_inputs, on); }
std::optional<int> force_deltanet_recur(std::optional<int> form) { return exchange(forced().recur, form); }
std::optional<bool> force_gemm_wgmma(std::optional<bool> on) { return exchange(forced().gemm_wgmma, on); }
std::optional<bool> force_gemm_tma(std::optional<bool> on) { return exchange(forced().gemm_tma, on); }

}  // namespace tansy::cuda
