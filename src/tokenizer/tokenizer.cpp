#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>

#include "core/check.h"
#include "core/json_util.h"
#include "model/config.h"  // read_text_file
#include "tokenizer/bpe.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/utf8.h"

namespace tansy {

using json = nlohmann::json;

namespace {

constexpr int64_t MAX_TOKEN_ID = int64_t(1) << 24;  // far above any real vocabulary (Qwen3.6: 248,077)

enum : uint8_t { KIND_NONE = 0, KIND_REGULAR = 1, KIND_ADDED = 2, KIND_SPECIAL = 4 };

struct added_token {
    std::string content;  // the text it matches (NFC'd when `normalized`)
    int32_t id = -1;
    bool special = false, lstrip = false, rstrip = false, single_word = false, normalized = false;
};

// Leftmost, then longest, exact matching of a few strings (HF: aho-corasick with LeftmostLongest). There
// are a few dozen added tokens, nearly all starting with '<', so bucketing by first byte is enough.
class added_matcher {
  public:
    void build(const std::vector<added_token>& all, bool normalized) {
        for (const added_token& t : all)
            if (t.normalized == normalized && !t.content.empty()) by_first_[(uint8_t)t.content[0]].push_back(&t);
        n_first_ = 0;
        for (int b = 0; b < 256; b++) {
            auto& v = by_first_[b];
            std::stable_sort(v.begin(), v.end(), [](auto* x, auto* y) { return x->content.size() > y->content.size(); });
            if (!v.empty()) {
                n_first_++;
                only_first_ = (char)b;
            }
        }
    }
    bool empty() const { return n_first_ == 0; }

    // The match starting leftmost at or after `from`, longest among those; nullptr if none.
    const added_token* find(std::string_view s, size_t from, size_t* start) const {
        for (size_t i = from; i < s.size(); i++) {
            if (n_first_ == 1) {  // the common case: memchr for the one possible first byte
                const void* p = memchr(s.data() + i, only_first_, s.size() - i);
                if (!p) return nullptr;
                i = (const char*)p - s.data();
            }
            for (const added_token* t : by_first_[(uint8_t)s[i]])
                if (s.compare(i, t->content.size(), t->content) == 0) {
                    *start = i;
                    return t;
                }
        }
        return nullptr;
    }

  private:
    std::vector<const added_token*> by_first_[256];
    int n_first_ = 0;
    char only_first_ = 0;
};

// Which added tokens may match: all, all but the special ones (HF encode_special_tokens), or none.
enum class added_mode { all, non_special, none };

// HF AddedVocabulary::find_matches: calls f(segment, id) in order for added-token matches (id >= 0; the
// segment includes whitespace taken by lstrip/rstrip) and the text between them (id = -1).
// `refuse(token, start, stop)` returns 0 to keep a match of bytes [start, stop), else where the search goes on.
template <class R, class F>
void split_added_if(std::string_view s, const added_matcher& m, R&& refuse, F&& f) {
    size_t done = 0, pos = 0, ms;
    while (const added_token* t = m.find(s, pos, &ms)) {
        size_t start = ms, stop = ms + t->content.size();
        pos = stop;  // a discarded match still consumes its bytes, as in the aho-corasick iteration
        if (const size_t next = refuse(*t, start, stop)) {
            pos = next;
            continue;
        }
        if (t->single_word) {
            auto word_before = [&] {
                if (start == 0) return false;
                size_t i = start - 1;
                while (i > 0 && ((uint8_t)s[i] & 0xC0) == 0x80) i--;
                int len;
                return is_word_cp(decode_cp(s, i, &len));
            };
            auto word_after = [&] {
                int len;
                return stop < s.size() && is_word_cp(decode_cp(s, stop, &len));
            };
            if (word_before() || word_after()) continue;
        }
        if (t->lstrip) {
            size_t i = start;
            while (i > done) {
                size_t j = i - 1;
                while (j > done && ((uint8_t)s[j] & 0xC0) == 0x80) j--;
                int len;
                if (!is_white_space_at(s, j, &len)) break;
                i = j;
            }
            start = i;
        }
        if (t->rstrip) {
            int len;
            while (stop < s.size() && is_white_space_at(s, stop, &len)) stop += len;
            pos = stop;
        }
        if (start > done) f(s.substr(done, start - done), -1);
        f(s.substr(start, stop - start), t->id);
        done = stop;
    }
    if (done < s.size()) f(s.substr(done), -1);
}

template <class F>
void split_added(std::string_view s, const added_matcher& m, added_mode mode, F&& f) {
    split_added_if(
        s, m,
        [&](const added_token& t, size_t, size_t stop) -> size_t {
            return mode == added_mode::none || (t.special && mode == added_mode::non_special) ? stop : 0;
        },
        f);
}

// Per-thread encoding state: the pre-token cache and BPE buffers. Owned by whichever tokenizer used it
// last (by serial number, never by address), so threads never share a cache and need no lock.
struct encode_scratch {
    uint64_t owner = 0;
    word_cache cache;
    bpe_work work;
    std::string normalized;
};

std::atomic<uint64_t> g_next_serial{1};

// --- tokenizer.json helpers ------------------------------------------------------------------------------

const json* field(const json& o, const char* key) {
    if (!o.is_object()) return nullptr;
    auto it = o.find(key);
    return it == o.end() || it->is_null() ? nullptr : &*it;
}

std::string type_of(const json& o) {
    const json* t = field(o, "type");
    return t && t->is_string() ? t->get<std::string>() : std::string();
}

// The steps of a normalizer or pre_tokenizer (`section`): the list under `list_key` of a Sequence, else itself.
std::vector<const json*> sequence_steps(const json& step, const char* section, const char* list_key,
                                        const std::string& what) {
    std::vector<const json*> steps;
    if (type_of(step) == "Sequence") {
        const json* list = field(step, list_key);
        if (!list || !list->is_array()) fail("%s: %s Sequence without '%s'", what.c_str(), section, list_key);
        for (const json& s : *list) steps.push_back(&s);
    } else {
        steps.push_back(&step);
    }
    return steps;
}

bool get_bool(const json& o, const char* key, bool dflt, const std::string& ctx) {
    const json* v = field(o, key);
    if (!v) return dflt;
    if (!v->is_boolean()) fail("%s: '%s' must be true or false, got %s", ctx.c_str(), key, v->dump().c_str());
    return v->get<bool>();
}

const std::string& get_string(const json& o, const char* key, const std::string& ctx) {
    const json* v = field(o, key);
    if (!v || !v->is_string()) fail("%s: '%s' must be a string", ctx.c_str(), key);
    return v->get_ref<const std::string&>();
}

// Escapes a literal for the regex translator (Split with {"String": ...}).
std::string regex_quote(std::string_view lit) {
    std::string out;
    for (char c : lit) {
        if ((unsigned char)c < 0x80 && ispunct((unsigned char)c)) out += '\\';
        out += c;
    }
    return out;
}

}  // namespace

// --- impl ------------------------------------------------------------------------------------------------

struct tokenizer::impl {
    uint64_t serial = 0;
    std::string what;
    std::string blob;            // token bytes, back to back
    std::vector<uint32_t> offs;  // bytes of id i: blob[offs[i], offs[i+1])
    std::vector<uint8_t> kind;   // KIND_* bits per id
    std::unordered_map<std::string, int32_t> vocab;  // tokenizer.json spelling -> id (regular tokens)
    std::vector<added_token> added;
    added_matcher raw_tokens, normalized_tokens;
    bool nfc = false;
    std::string regex;
    std::optional<regex_splitter> splitter;
    std::optional<bpe_model> bpe;

    encode_scratch& scratch() const {
        thread_local encode_scratch s;
        if (s.owner != serial) {
            s.cache.clear();
            s.owner = serial;
        }
        return s;
    }

    void encode_piece(std::string_view piece, encode_scratch& s, std::vector<int32_t>& out) const {
        if (piece.size() == 1) {  // a single byte: BPE is one table lookup, cheaper than the cache
            bpe->encode_word(piece, out, s.work);
            return;
        }
        const bool cacheable = piece.size() <= word_cache::MAX_WORD_BYTES;
        const uint64_t h = cacheable ? word_cache::hash(piece) : 0;
        if (cacheable && s.cache.get(piece, h, out)) return;
        const size_t before = out.size();
        bpe->encode_word(piece, out, s.work);
        if (cacheable) s.cache.put(piece, h, out.data() + before, out.size() - before);
    }

    void encode_pretokens(std::string_view text, std::optional<regex_splitter::matcher>& rm, encode_scratch& s,
                          std::vector<int32_t>& out) const {
        if (!splitter) {
            encode_piece(text, s, out);
            return;
        }
        splitter->split(text, *rm, [&](std::string_view piece) { encode_piece(piece, s, out); });
    }

    // Text between raw added tokens: NFC, then normalized added tokens, then regex pieces and BPE.
    void encode_text(std::string_view text, added_mode mode, std::optional<regex_splitter::matcher>& rm,
                     encode_scratch& s, std::vector<int32_t>& out) const {
        std::string_view norm = text;
        if (nfc && nfc_maybe_changes(text)) {
            nfc_normalize(text, s.normalized);
            norm = s.normalized;
        }
        if (normalized_tokens.empty()) {
            encode_pretokens(norm, rm, s, out);
            return;
        }
        split_added(norm, normalized_tokens, mode, [&](std::string_view seg, int32_t id) {
            if (id >= 0)
                out.push_back(id);
            else
                encode_pretokens(seg, rm, s, out);
        });
    }

    void check_id(int32_t id) const {
        if (id < 0 || (size_t)id + 1 >= offs.size())
            fail("token id %d is outside the vocabulary of %s (size %zu)", id, what.c_str(), offs.size() - 1);
    }
    std::string_view bytes(int32_t id) const { return std::string_view(blob).substr(offs[id], offs[id + 1] - offs[id]); }
};

tokenizer::tokenizer(std::unique_ptr<impl> p) : impl_(std::move(p)) {}
tokenizer::tokenizer(tokenizer&&) noexcept = default;
tokenizer& tokenizer::operator=(tokenizer&&) noexcept = default;
tokenizer::~tokenizer() = default;

// --- loading ---------------------------------------------------------------------------------------------

tokenizer tokenizer::load(const std::string& path) {
    namespace fs = std::filesystem;
    std::error_code ec;
    std::string file = path;
    if (fs::is_directory(path, ec)) {
        file = (fs::path(path) / "tokenizer.json").string();
        if (!fs::is_regular_file(file, ec)) fail("%s: no tokenizer.json in this directory", path.c_str());
    } else if (!fs::is_regular_file(path, ec)) {
        fail("%s: no such tokenizer file or model directory", path.c_str());
    }
    return from_json(read_text_file(file), file);
}

tokenizer tokenizer::from_json(std::string_view text, const std::string& what) {
    const json j = parse_json_object(text, what, "not valid JSON", "not a tokenizer.json (the top level is not an object)");

    auto m = std::make_unique<impl>();
    m->serial = g_next_serial.fetch_add(1);
    m->what = what;

    // model: BPE vocabulary and merges.
    const json* model = field(j, "model");
    if (!model || !model->is_object()) fail("%s: no 'model' object", what.c_str());
    const std::string ctx = what + ": model";
    const std::string mtype = type_of(*model);
    if (mtype.empty() ? !field(*model, "merges") : mtype != "BPE")
        fail("%s.type is '%s'; only byte-level BPE is supported", ctx.c_str(), mtype.c_str());
    const json* vocab = field(*model, "vocab");
    if (!vocab || !vocab->is_object() || vocab->empty()) fail("%s.vocab must be a non-empty object", ctx.c_str());
    const json* merges = field(*model, "merges");
    if (!merges || !merges->is_array()) fail("%s.merges must be an array", ctx.c_str());
    if (const json* d = field(*model, "dropout"); d && !(d->is_number() && d->get<double>() == 0.0))
        fail("%s.dropout = %s is not supported (tokenisation must be deterministic)", ctx.c_str(), d->dump().c_str());
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
        if (const json* v = field(*model, k); v && !(v->is_string() && v->get_ref<const std::string&>().empty()))
            fail("%s.%s = %s is not supported", ctx.c_str(), k, v->dump().c_str());

    std::vector<std::string> spelling;  // id -> tokenizer.json spelling
    int64_t n_ids = 0;
    auto claim = [&](int64_t id, const std::string& s, const char* where) {
        if (id < 0 || id >= MAX_TOKEN_ID) fail("%s: %s token '%s' has id %lld (must be in [0, %lld))", what.c_str(), where, s.c_str(), (long long)id, (long long)MAX_TOKEN_ID);
        if ((int64_t)spelling.size() <= id) {
            spelling.resize(id + 1);
            m->kind.resize(id + 1, KIND_NONE);
        }
        n_ids = std::max(n_ids, id + 1);
    };
    m->vocab.reserve(vocab->size());
    for (const auto& [s, v] : vocab->items()) {
        if (!v.is_number_integer()) fail("%s.vocab['%s'] is not an integer id", ctx.c_str(), s.c_str());
        const int64_t id = v.get<int64_t>();
        claim(id, s, "vocabulary");
        if (m->kind[id] != KIND_NONE)
            fail("%s.vocab: id %lld is used by both '%s' and '%s'", ctx.c_str(), (long long)id, spelling[id].c_str(), s.c_str());
        m->kind[id] = KIND_REGULAR;
        spelling[id] = s;
        m->vocab.emplace(s, (int32_t)id);
    }

    // added_tokens
    if (const json* at = field(j, "added_tokens")) {
        if (!at->is_array()) fail("%s: 'added_tokens' must be an array", what.c_str());
        for (size_t i = 0; i < at->size(); i++) {
            const json& e = (*at)[i];
            const std::string actx = strprintf("%s: added_tokens[%zu]", what.c_str(), i);
            if (!e.is_object()) fail("%s is not an object", actx.c_str());
            const json* idv = field(e, "id");
            if (!idv || !idv->is_number_integer()) fail("%s: 'id' must be an integer", actx.c_str());
            added_token t;
            t.content = get_string(e, "content", actx);
            if (t.content.empty()) fail("%s: empty 'content'", actx.c_str());
            if (utf8_find_invalid(t.content) >= 0) fail("%s: 'content' is not valid UTF-8", actx.c_str());
            const int64_t id = idv->get<int64_t>();
            t.id = (int32_t)std::clamp<int64_t>(id, -1, MAX_TOKEN_ID);
            t.special = get_bool(e, "special", false, actx);
            t.lstrip = get_bool(e, "lstrip", false, actx);
            t.rstrip = get_bool(e, "rstrip", false, actx);
            t.single_word = get_bool(e, "single_word", false, actx);
            t.normalized = get_bool(e, "normalized", !t.special, actx);
            claim(id, t.content, "added");
            // HF gives an added token that is also in the vocabulary the vocabulary's id; a file that says
            // otherwise would tokenise differently there, so refuse it.
            if (auto it = m->vocab.find(t.content); it != m->vocab.end() && it->second != id)
                fail("%s: '%s' has id %lld but the vocabulary gives it %d", actx.c_str(), t.content.c_str(), (long long)id, it->second);
            if (m->kind[id] != KIND_NONE && spelling[id] != t.content)
                fail("%s: id %lld is already used by '%s'", actx.c_str(), (long long)id, spelling[id].c_str());
            m->kind[id] |= KIND_ADDED | (t.special ? KIND_SPECIAL : 0);
            spelling[id] = t.content;
            m->added.push_back(std::move(t));
        }
    }

    // normalizer: NFC or nothing.
    if (const json* n = field(j, "normalizer")) {
        for (const json* s : sequence_steps(*n, "normalizer", "normalizers", what)) {
            if (type_of(*s) != "NFC") fail("%s: normalizer '%s' is not supported (only NFC)", what.c_str(), s->dump().c_str());
            m->nfc = true;
        }
    }
    if (m->nfc)  // normalized added tokens are matched in normalized text, so normalize them too
        for (added_token& t : m->added)
            if (t.normalized) nfc_normalize(std::string(t.content), t.content);

    // pre_tokenizer: [Split(regex, Isolated)] then ByteLevel without its own regex.
    const json* pt = field(j, "pre_tokenizer");
    if (!pt) fail("%s: no pre_tokenizer (byte-level BPE needs a ByteLevel step)", what.c_str());
    {
        const std::vector<const json*> steps = sequence_steps(*pt, "pre_tokenizer", "pretokenizers", what);
        bool byte_level = false;
        for (const json* s : steps) {
            const std::string t = type_of(*s);
            const std::string sctx = what + ": pre_tokenizer " + t;
            if (byte_level) fail("%s: nothing may follow the ByteLevel step", sctx.c_str());
            if (t == "Split") {
                if (m->splitter) fail("%s: more than one Split is not supported", sctx.c_str());
                const json* beh = field(*s, "behavior");
                if (!beh || !beh->is_string() || beh->get<std::string>() != "Isolated")
                    fail("%s: behavior %s is not supported (only Isolated)", sctx.c_str(), beh ? beh->dump().c_str() : "(missing)");
                if (get_bool(*s, "invert", false, sctx)) fail("%s: invert = true is not supported", sctx.c_str());
                const json* pat = field(*s, "pattern");
                if (pat && field(*pat, "Regex") && field(*pat, "Regex")->is_string())
                    m->regex = field(*pat, "Regex")->get<std::string>();
                else if (pat && field(*pat, "String") && field(*pat, "String")->is_string())
                    m->regex = regex_quote(field(*pat, "String")->get<std::string>());
                else
                    fail("%s: 'pattern' must be {\"Regex\": ...} or {\"String\": ...}", sctx.c_str());
                m->splitter.emplace(m->regex);
            } else if (t == "ByteLevel") {
                if (get_bool(*s, "add_prefix_space", true, sctx))
                    fail("%s: add_prefix_space = true is not supported", sctx.c_str());
                if (get_bool(*s, "use_regex", true, sctx))
                    fail("%s: use_regex = true (the built-in GPT-2 regex) is not supported; give the regex as a "
                         "Split step", sctx.c_str());
                byte_level = true;
            } else {
                fail("%s: pre-tokenizer type '%s' is not supported", what.c_str(), s->dump().c_str());
            }
        }
        if (!byte_level) fail("%s: the pre_tokenizer has no ByteLevel step; only byte-level BPE is supported", what.c_str());
    }

    // decoder: ByteLevel. post_processor: nothing that adds tokens.
    const json* dec = field(j, "decoder");
    if (!dec || type_of(*dec) != "ByteLevel")
        fail("%s: decoder %s is not supported (only ByteLevel)", what.c_str(), dec ? dec->dump().c_str() : "null");
    if (const json* pp = field(j, "post_processor"); pp && type_of(*pp) != "ByteLevel")
        fail("%s: post_processor type '%s' is not supported (only ByteLevel or none: tansy does not add special "
             "tokens around encoded text)", what.c_str(), type_of(*pp).c_str());

    // Token bytes. HF's ByteLevel decoder maps a token's characters back to bytes when every one of them is
    // in the byte-level alphabet, and otherwise uses the token's UTF-8 as is (added tokens like "<think>").
    m->offs.assign(n_ids + 1, 0);
    std::string bytes;
    for (int64_t id = 0; id < n_ids; id++) {
        m->offs[id] = (uint32_t)m->blob.size();
        if (m->kind[id] == KIND_NONE) continue;
        if (byte_level_decode(spelling[id], bytes))
            m->blob += bytes;
        else
            m->blob += spelling[id];
        if (m->blob.size() > UINT32_MAX) fail("%s: the vocabulary is implausibly large", what.c_str());
    }
    m->offs[n_ids] = (uint32_t)m->blob.size();

    // BPE: initial symbols and merges.
    bpe_model::options opt;
    if (const json* unk = field(*model, "unk_token")) {
        if (!unk->is_string()) fail("%s.unk_token must be a string", ctx.c_str());
        auto it = m->vocab.find(unk->get<std::string>());
        if (it == m->vocab.end()) fail("%s.unk_token '%s' is not in the vocabulary", ctx.c_str(), unk->get<std::string>().c_str());
        opt.unk_id = it->second;
    }
    opt.fuse_unk = get_bool(*model, "fuse_unk", false, ctx);
    opt.ignore_merges = get_bool(*model, "ignore_merges", false, ctx);
    const bool byte_fallback = get_bool(*model, "byte_fallback", false, ctx);
    int32_t byte_ids[256], fallback_ids[256];
    for (int b = 0; b < 256; b++) {
        auto it = m->vocab.find(byte_level_encode(std::string(1, (char)b)));
        byte_ids[b] = it == m->vocab.end() ? -1 : it->second;
        it = byte_fallback ? m->vocab.find(strprintf("<0x%02X>", b)) : m->vocab.end();
        fallback_ids[b] = it == m->vocab.end() ? -1 : it->second;
    }
    m->bpe.emplace(byte_ids, fallback_ids, opt);
    m->bpe->reserve_merges(merges->size());
    std::string left, right;
    for (size_t r = 0; r < merges->size(); r++) {
        const json& e = (*merges)[r];
        if (e.is_string()) {
            const std::string& s = e.get_ref<const std::string&>();
            const size_t sp = s.find(' ');
            if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
                fail("%s.merges[%zu] = \"%s\" is not two tokens separated by one space", ctx.c_str(), r, s.c_str());
            left.assign(s, 0, sp);
            right.assign(s, sp + 1);
        } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
            left = e[0].get<std::string>();
            right = e[1].get<std::string>();
        } else {
            fail("%s.merges[%zu] = %s is neither \"a b\" nor [\"a\", \"b\"]", ctx.c_str(), r, e.dump().c_str());
        }
        if (r > (size_t)INT32_MAX) fail("%s: too many merges", ctx.c_str());
        auto find_tok = [&](const std::string& s) {
            auto it = m->vocab.find(s);
            if (it == m->vocab.end())
                fail("%s.merges[%zu] ('%s' '%s'): '%s' is not in the vocabulary", ctx.c_str(), r, left.c_str(),
                     right.c_str(), s.c_str());
            return it->second;
        };
        const int32_t a = find_tok(left), b = find_tok(right), ab = find_tok(left + right);
        m->bpe->add_merge(a, b, ab, (int32_t)r);
    }
    if (opt.ignore_merges)
        for (const auto& [s, id] : m->vocab)
            if (byte_level_decode(s, bytes)) m->bpe->add_whole_word(bytes, id);

    m->raw_tokens.build(m->added, false);
    m->normalized_tokens.build(m->added, true);
    return tokenizer(std::move(m));
}

// --- encode / decode -------------------------------------------------------------------------------------

std::vector<int32_t> tokenizer::encode(std::string_view text, bool parse_special) const {
    const impl& m = *impl_;
    if (const int64_t bad = utf8_find_invalid(text); bad >= 0)
        fail("cannot tokenize: the text is not valid UTF-8 (byte 0x%02X at offset %lld)", (uint8_t)text[bad], (long long)bad);
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 8);
    encode_scratch& s = m.scratch();
    std::optional<regex_splitter::matcher> rm;
    if (m.splitter) rm.emplace(*m.splitter);
    const added_mode mode = parse_special ? added_mode::all : added_mode::non_special;
    split_added(text, m.raw_tokens, mode, [&](std::string_view seg, int32_t id) {
        if (id >= 0)
            out.push_back(id);
        else
            m.encode_text(seg, mode, rm, s, out);
    });
    return out;
}

std::vector<int32_t> tokenizer::encode(std::string_view text, std::span<const byte_range> plain) const {
    const impl& m = *impl_;
    if (const int64_t bad = utf8_find_invalid(text); bad >= 0)
        fail("cannot tokenize: the text is not valid UTF-8 (byte 0x%02X at offset %lld)", (uint8_t)text[bad], (long long)bad);
    for (size_t i = 0; i < plain.size(); i++)
        TANSY_CHECK(plain[i].begin <= plain[i].end && plain[i].end <= text.size() &&
                        (i == 0 || plain[i - 1].end <= plain[i].begin),
                    "encode: plain ranges must be ascending, disjoint and inside the text");
    // Whether bytes [a, b) of `text` overlap a plain range (ranges ascending: binary search the first one
    // that ends after a).
    auto overlaps_plain = [&](size_t a, size_t b) {
        auto it = std::upper_bound(plain.begin(), plain.end(), a,
                                   [](size_t x, const byte_range& r) { return x < r.end; });
        return it != plain.end() && it->begin < b;
    };
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 8);
    encode_scratch& s = m.scratch();
    std::optional<regex_splitter::matcher> rm;
    if (m.splitter) rm.emplace(*m.splitter);
    // note: a refused match consumes one byte only, not its length, so that a token text starting in client
    // text and running into template text cannot swallow the start of a template token.
    split_added_if(
        text, m.raw_tokens,
        [&](const added_token&, size_t a, size_t b) -> size_t { return overlaps_plain(a, b) ? a + 1 : 0; },
        [&](std::string_view seg, int32_t id) {
            if (id >= 0) {
                out.push_back(id);
                return;
            }
            // normalized added tokens are matched after NFC, whose offsets differ: only in template-only text
            const size_t a = (size_t)(seg.data() - text.data());
            m.encode_text(seg, overlaps_plain(a, a + seg.size()) ? added_mode::none : added_mode::all, rm, s, out);
        });
    return out;
}

std::string tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
    const impl& m = *impl_;
    std::string out;
    for (int32_t id : ids) {
        m.check_id(id);
        if (skip_special && (m.kind[id] & KIND_SPECIAL)) continue;
        out += m.bytes(id);
    }
    return out;
}

std::string_view tokenizer::token_bytes(int32_t id) const {
    impl_->check_id(id);
    return impl_->bytes(id);
}

int32_t tokenizer::find(std::string_view token) const {
    for (const added_token& t : impl_->added)
        if (t.content == token) return t.id;
    auto it = impl_->vocab.find(std::string(token));
    return it == impl_->vocab.end() ? -1 : it->second;
}

bool tokenizer::is_special(int32_t id) const { return id >= 0 && id < size() && (impl_->kind[id] & KIND_SPECIAL); }
bool tokenizer::is_added(int32_t id) const { return id >= 0 && id < size() && (impl_->kind[id] & KIND_ADDED); }
int64_t tokenizer::size() const { return (int64_t)impl_->offs.size() - 1; }
int64_t tokenizer::n_merges() const { return (int64_t)impl_->bpe->n_merges(); }
const std::string& tokenizer::pre_tokenizer_regex() const { return impl_->regex; }

// --- stream_decoder --------------------------------------------------------------------------------------

stream_decoder::stream_decoder(const tokenizer& tok, bool skip_special) : tok_(&tok), skip_special_(skip_special) {}

std::string stream_decoder::push(int32_t id) {
    const std::string_view b = tok_->token_bytes(id);  // throws for a bad id
    if (skip_special_ && tok_->is_special(id)) return {};
    pending_ += b;
    std::string out;
    const size_t used = utf8_append_lossy(pending_, false, out);
    pending_.erase(0, used);
    return out;
}

std::string stream_decoder::flush() {
    std::string out = utf8_lossy(pending_);
    pending_.clear();
    return out;
}

}  // namespace tansy
