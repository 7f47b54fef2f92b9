// Byte-level BPE tokenizer and streaming detokenizer against the Hugging Face `tokenizers` fixtures:
// exact ids, exact decoded text, NFC round trips, stream decoding that never emits broken UTF-8, and
// clear errors for malformed tokenizer.json files and invalid input.
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>
#include <utf8proc.h>

#include "core/check.h"
#include "model/config.h"
#include "test_util.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

using namespace tansy;
using json = nlohmann::json;

namespace {

// The fixture tokenizers and their cases. Paths are relative to the fixtures root.
constexpr const char* QWEN3_JSON = "tokenizers/qwen3/tokenizer.json";
constexpr const char* TINY_JSON = "tiny-qwen35moe-mlx4/tokenizer.json";
constexpr const char* MINI_JSON = "tokenizers/qwen35-regex-mini/tokenizer.json";
constexpr const char* MINI_CASES = "tokenizers/qwen35-regex-mini/cases.json";
constexpr const char* CASES = "tokenizer_cases.json";

json read_json(const std::string& path) { return json::parse(read_text_file(path)); }

bool valid_utf8(std::string_view s) { return utf8_find_invalid(s) < 0; }

std::string nfc(std::string_view s) {
    std::string out;
    nfc_normalize(s, out);
    return out;
}

std::string write_temp(const std::string& dir, const std::string& name, const std::string& text) {
    const std::string path = dir + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
}

// Streams ids one at a time; checks every piece is valid UTF-8 and returns the concatenation.
std::string stream_all(const tokenizer& tok, const std::vector<int32_t>& ids, bool skip_special) {
    stream_decoder sd(tok, skip_special);
    std::string all;
    for (size_t i = 0; i < ids.size(); i++) {
        const std::string piece = sd.push(ids[i]);
        EXPECT_TRUE(valid_utf8(piece)) << "push #" << i << " (id " << ids[i] << ") emitted invalid UTF-8";
        all += piece;
    }
    const std::string tail = sd.flush();
    EXPECT_TRUE(valid_utf8(tail));
    EXPECT_FALSE(sd.has_pending());
    return all + tail;
}

// Every check the fixtures support, for one tokenizer and its cases; returns the number of cases run.
int check_cases(const tokenizer& tok, const json& cases, const std::string& name) {
    int n = 0;
    for (const json& c : cases) {
        const std::string text = c.at("text").get<std::string>();
        const std::vector<int32_t> want = c.at("ids").get<std::vector<int32_t>>();
        const std::string decoded = c.at("decoded").get<std::string>();
        SCOPED_TRACE(name + " case " + std::to_string(n) + ": " + json(text).dump().substr(0, 80));
        const std::vector<int32_t> ids = tok.encode(text);
        EXPECT_EQ(ids, want);
        EXPECT_EQ(tok.decode(want), decoded);
        EXPECT_EQ(tok.decode(ids), nfc(text)) << "round trip decode(encode(s)) != NFC(s)";
        EXPECT_EQ(stream_all(tok, want, false), tok.decode(want));
        EXPECT_EQ(stream_all(tok, want, true), tok.decode(want, true));
        n++;
    }
    return n;
}

// Loading the 11 MB Qwen3 file takes a few hundred ms: load each fixture tokenizer once per process.
const tokenizer& cached_load(const std::string& path) {
    static std::map<std::string, tokenizer> loaded;
    auto it = loaded.find(path);
    if (it == loaded.end()) it = loaded.emplace(path, tokenizer::load(path)).first;
    return it->second;
}

// A tokenizer from a tokenizer.json modified in memory (written to a temp file, loaded like any other).
tokenizer load_modified(const json& j, const std::string& tag) {
    const std::string dir = test::temp_dir(tag);
    return tokenizer::load(write_temp(dir, "tokenizer.json", j.dump()));
}

// The token of one raw byte (the byte-level alphabet spells it as one character).
int32_t byte_token(const tokenizer& tok, uint8_t b) {
    const int32_t id = tok.find(byte_level_encode(std::string(1, (char)b)));
    EXPECT_GE(id, 0) << "no token for byte " << (int)b;
    return id;
}

}  // namespace

// ---- UTF-8 helpers ------------------------------------------------------------------------------------

TEST(utf8, find_invalid) {
    EXPECT_EQ(utf8_find_invalid(""), -1);
    EXPECT_EQ(utf8_find_invalid("plain ascii text, long enough for the 8-byte path"), -1);
    EXPECT_EQ(utf8_find_invalid("é日😀\xF4\x8F\xBF\xBF"), -1);  // U+10FFFF is the last valid code point
    EXPECT_EQ(utf8_find_invalid("abc\xFF"), 3);
    EXPECT_EQ(utf8_find_invalid("ab\xC0\xAF"), 2);              // overlong '/'
    EXPECT_EQ(utf8_find_invalid("\xE0\x80\x80"), 0);             // overlong NUL
    EXPECT_EQ(utf8_find_invalid("x\xED\xA0\x80"), 1);            // surrogate U+D800
    EXPECT_EQ(utf8_find_invalid("\xF4\x90\x80\x80"), 0);         // above U+10FFFF
    EXPECT_EQ(utf8_find_invalid("0123456789\xE6\x97"), 10);      // truncated at the end
    EXPECT_EQ(utf8_find_invalid(std::string_view("a\0b", 3)), -1);  // NUL is a character
}

TEST(utf8, lossy_replaces_maximal_subparts) {
    // Unicode 15 §3.9 "U+FFFD Substitution of Maximal Subparts" (also what Python and Rust produce).
    EXPECT_EQ(utf8_lossy("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64"),
              "a\uFFFD\uFFFD\uFFFD" "b\uFFFD" "c\uFFFD\uFFFD" "d");
    EXPECT_EQ(utf8_lossy("\xC0\xAF"), "\uFFFD\uFFFD");
    EXPECT_EQ(utf8_lossy("\xED\xA0\x80z"), "\uFFFD\uFFFD\uFFFDz");
    EXPECT_EQ(utf8_lossy("\xF0\x9F\x98"), "\uFFFD");
    EXPECT_EQ(utf8_lossy("ok é"), "ok é");
}

TEST(utf8, append_lossy_holds_back_a_truncated_tail) {
    std::string out;
    EXPECT_EQ(utf8_append_lossy("ab\xF0\x9F\x98", false, out), 2u);
    EXPECT_EQ(out, "ab");
    out.clear();
    EXPECT_EQ(utf8_append_lossy("ab\xF0\x28", false, out), 4u);  // 0x28 cannot continue: replaced now
    EXPECT_EQ(out, "ab\uFFFD(");
}

// ---- NFC ----------------------------------------------------------------------------------------------

TEST(tokenizer_nfc, segmented_normalisation_equals_utf8proc_on_the_whole_text) {
    // nfc_normalize only sends the pieces between "boundary" code points to utf8proc; that must give what
    // utf8proc gives for the whole text. The pool mixes starters that compose with what follows, marks
    // that reorder, singletons, exclusions and Hangul (U+11A7 aside: utf8proc mishandles it, see below).
    const char* const pool[] = {"a", "e", "<", "=", "A", " ", "\n", "é", "Ā", "Å", "\u0300", "\u0301", "\u0323",
                                "\u0338", "\u0345", "\u05B9", "\u0F73", "\u0F71", "\u0F72", "\u0958", "\u0915",
                                "\u093C", "\u212B", "\uF900", "日", "か", "\u3099", "\u309A", "ｶ", "\u1100", "\u1161",
                                "\u11A8", "\uAC00", "\uAC01", "\u0627", "\u0653", "\u0CD5", "\u0CBF", "😀", "\u200D",
                                "\u1E14", "Ω", "\u03A9", "\u0308", "\u0DCF", "\u0DD9"};
    std::mt19937 rng(7);
    constexpr int N_STRINGS = 3000, MAX_LEN = 24;
    for (int n = 0; n < N_STRINGS; n++) {
        std::string s;
        for (int i = (int)(rng() % MAX_LEN); i > 0; i--) s += pool[rng() % std::size(pool)];
        utf8proc_uint8_t* ref = nullptr;
        const utf8proc_ssize_t len = utf8proc_map((const utf8proc_uint8_t*)s.data(), (utf8proc_ssize_t)s.size(), &ref,
                                                  (utf8proc_option_t)(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
        ASSERT_GE(len, 0);
        const std::string want((const char*)ref, (size_t)len);
        free(ref);
        ASSERT_EQ(nfc(s), want) << json(s).dump();
    }
    // utf8proc 2.8 composes <LV syllable, U+11A7> into the syllable, losing U+11A7; HF keeps it.
    EXPECT_EQ(nfc("\uB3A8\u11A7x"), "\uB3A8\u11A7x");
    EXPECT_EQ(nfc("\u1100\u1161\u11A7"), "\uAC00\u11A7");
    EXPECT_EQ(nfc("\u1100\u1161\u11A8"), "\uAC01");
    EXPECT_EQ(nfc("e\u0301 \u212B"), "é Å");
}

// ---- regex translation --------------------------------------------------------------------------------

TEST(tokenizer_regex, translates_white_space_and_rejects_ambiguous_constructs) {
    // \s must be Unicode White_Space (Oniguruma), which PCRE2's \s is not quite (it adds U+180E).
    const std::string ws = "[\\p{Z}\\t\\n\\x0B\\f\\r\\x{85}]";
    EXPECT_EQ(translate_hf_regex("\\s+(?!\\S)"), ws + "+(?![^\\p{Z}\\t\\n\\x0B\\f\\r\\x{85}])");
    EXPECT_EQ(translate_hf_regex("[^\\s\\p{L}]"), "[^\\p{Z}\\t\\n\\x0B\\f\\r\\x{85}\\p{L}]");
    EXPECT_EQ(translate_hf_regex("(?i:'s|'t)\\p{N}{1,3}"), "(?i:'s|'t)\\p{N}{1,3}");
    EXPECT_EQ(translate_hf_regex("[\\]s]\\u00e9\\v"), "[\\]s]\\x{00e9}\\x0B");
    for (const char* bad : {"\\w+", "\\bx", "^a", "a$", "(?m)a", "[[:alpha:]]", "[a[b]]", "[\\S]", "\\h", "(?<n>a)"})
        EXPECT_THROW(translate_hf_regex(bad), tansy::error) << bad;
    EXPECT_THROW(regex_splitter("(unclosed"), tansy::error);
}

// ---- fixture cases ------------------------------------------------------------------------------------

TEST(tokenizer_fixtures, qwen3_cases) {
    TANSY_REQUIRE_FIXTURE(tok_path, QWEN3_JSON);
    TANSY_REQUIRE_FIXTURE(cases_path, CASES);
    const tokenizer& tok = cached_load(tok_path);
    EXPECT_EQ(check_cases(tok, read_json(cases_path).at("qwen3"), "qwen3"), 33);
}

TEST(tokenizer_fixtures, tiny_model_cases) {
    TANSY_REQUIRE_FIXTURE(tok_path, TINY_JSON);
    TANSY_REQUIRE_FIXTURE(cases_path, CASES);
    const tokenizer& tok = cached_load(tok_path);
    EXPECT_EQ(check_cases(tok, read_json(cases_path).at("tiny"), "tiny"), 33);
}

TEST(tokenizer_fixtures, qwen35_regex_mini_cases) {
    TANSY_REQUIRE_FIXTURE(tok_path, MINI_JSON);
    TANSY_REQUIRE_FIXTURE(cases_path, MINI_CASES);
    const tokenizer& tok = cached_load(tok_path);
    EXPECT_NE(tok.pre_tokenizer_regex().find("[\\p{L}\\p{M}]+"), std::string::npos);
    EXPECT_EQ(check_cases(tok, read_json(cases_path), "qwen35-regex-mini"), 10);
}

TEST(tokenizer_fixtures, regex_is_taken_from_the_file) {
    // The same mini tokenizer with Qwen3's regex: the fixture says six of its ten cases then differ.
    TANSY_REQUIRE_FIXTURE(mini_path, MINI_JSON);
    TANSY_REQUIRE_FIXTURE(qwen3_path, QWEN3_JSON);
    TANSY_REQUIRE_FIXTURE(cases_path, MINI_CASES);
    json j = read_json(mini_path);
    const std::string qwen3_regex = cached_load(qwen3_path).pre_tokenizer_regex();
    EXPECT_EQ(qwen3_regex.find("\\p{M}"), std::string::npos);
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = qwen3_regex;
    const tokenizer tok = load_modified(j, "tok-regex");
    int differ = 0;
    for (const json& c : read_json(cases_path)) differ += tok.encode(c.at("text").get<std::string>()) != c.at("ids").get<std::vector<int32_t>>();
    EXPECT_EQ(differ, 6);
}

TEST(tokenizer_fixtures, loads_a_model_directory_and_knows_its_special_tokens) {
    TANSY_REQUIRE_FIXTURE(dir, "tiny-qwen35moe-mlx4");
    const tokenizer& tok = cached_load(dir);
    EXPECT_EQ(tok.size(), 4073);
    EXPECT_EQ(tok.find("<|endoftext|>"), 4064);
    EXPECT_EQ(tok.find("<|im_end|>"), 4066);
    EXPECT_TRUE(tok.is_special(4066));
    EXPECT_EQ(tok.find("<think>"), 4071);
    EXPECT_TRUE(tok.is_added(4071));
    EXPECT_FALSE(tok.is_special(4071));  // <think> is an added token but not special
    EXPECT_EQ(tok.find("no such token"), -1);
    EXPECT_EQ(tok.token_bytes(tok.find("Ġthe")), " the");
}

TEST(tokenizer_fixtures, qwen3_special_tokens) {
    TANSY_REQUIRE_FIXTURE(tok_path, QWEN3_JSON);
    const tokenizer& tok = cached_load(tok_path);
    EXPECT_EQ(tok.size(), 151669);
    EXPECT_EQ(tok.n_merges(), 151387);
    EXPECT_EQ(tok.find("<|im_start|>"), 151644);
    EXPECT_EQ(tok.find("<|im_end|>"), 151645);
    EXPECT_EQ(tok.find("</think>"), 151668);
    EXPECT_TRUE(tok.is_special(151645));
    EXPECT_FALSE(tok.is_special(151668));
    EXPECT_EQ(tok.decode(std::vector<int32_t>{151644, 872, 198, 6023, 151645}, true), "user\nhi");
}

// ---- behaviour beyond the fixture cases (expected ids from HF tokenizers 0.23.3) ----------------------

TEST(tokenizer, white_space_case_folding_and_hangul_match_hf) {
    TANSY_REQUIRE_FIXTURE(tok_path, QWEN3_JSON);
    const tokenizer& tok = cached_load(tok_path);
    const std::pair<const char*, std::vector<int32_t>> cases[] = {
        {"x  \u0085", {87, 256, 126, 227}},                  // NEL is \s in Oniguruma
        {"a\u180e b", {64, 123970, 236, 293}},               // U+180E is not (PCRE2 would say it is)
        {"a\u2028b\u2029", {64, 378, 101, 65, 378, 102}},
        {"\u00a0\u00a0x", {4102, 4102, 87}},
        {"x'\u017f K'\u212a 'S", {87, 6, 144815, 730, 6, 42, 364, 50}},  // (?i:'s) matches long s; no 'k'
        {"a\u0085\u0085 \t\u3000b", {64, 126, 227, 126, 227, 7018, 22441, 65}},
        {"\ub3a8\u11a7x", {124304, 101, 124137, 100, 87}},  // U+11A7 survives NFC (utf8proc drops it)
        {"\u1100\u1161\u11a7", {19969, 124137, 100}},
    };
    for (const auto& [text, want] : cases) EXPECT_EQ(tok.encode(text), want) << json(text).dump();
}

TEST(tokenizer, parse_special_false_keeps_special_text_as_text) {
    TANSY_REQUIRE_FIXTURE(tok_path, QWEN3_JSON);
    const tokenizer& tok = cached_load(tok_path);
    const std::string text = "<|im_start|>user\nhi<|im_end|><think>x</think>";
    EXPECT_EQ(tok.encode(text), (std::vector<int32_t>{151644, 872, 198, 6023, 151645, 151667, 87, 151668}));
    // Non-special added tokens (<think>) still match, as with HF's encode_special_tokens = True.
    EXPECT_EQ(tok.encode(text, false),
              (std::vector<int32_t>{27, 91, 318, 4906, 91, 29, 872, 198, 6023, 27, 91, 318, 6213, 91, 29, 151667, 87, 151668}));
    EXPECT_EQ(tok.decode(tok.encode(text, false)), text);
}

TEST(tokenizer, added_token_flags_match_hf) {
    TANSY_REQUIRE_FIXTURE(mini_path, MINI_JSON);
    json j = read_json(mini_path);
    constexpr int32_t BASE = 3003;  // first free id of the mini tokenizer
    const std::pair<std::string, json> extra[] = {
        {"<ls>", {{"lstrip", true}}},
        {"<rs>", {{"rstrip", true}}},
        {"<both>", {{"lstrip", true}, {"rstrip", true}}},
        {"qzx", {{"single_word", true}}},
        {"café", {{"normalized", true}}},
        {"aĠb", json::object()},
        {"x\ny", json::object()},
        {"<sp>", {{"special", true}}},
    };
    for (size_t i = 0; i < std::size(extra); i++) {
        json t = {{"id", BASE + (int)i}, {"content", extra[i].first}, {"single_word", false}, {"lstrip", false},
                  {"rstrip", false}, {"normalized", false}, {"special", false}};
        t.update(extra[i].second);
        j["added_tokens"].push_back(t);
    }
    const tokenizer tok = load_modified(j, "tok-added");
    const std::pair<const char*, std::vector<int32_t>> cases[] = {
        {"a  <ls> b", {64, 3003, 304}},
        {"a é\u3000<ls>x", {64, 220, 127, 102, 3003, 87}},
        {"a<rs>  \t b", {64, 3004, 65}},
        {"x <both>  y", {87, 3005, 88}},
        {"qzx aqzx qzx_ qzx² -qzx- \u0301qzx", {3006, 268, 80, 89, 87, 2648, 89, 87, 62, 220, 3006, 126, 110, 471, 3006, 12, 220, 136, 223, 80, 89, 87}},
        {"cafe\u0301 café", {3007, 220, 3007}},  // normalized: matched after NFC
        {"aĠb x\ny", {3008, 220, 3009}},
        {"<sp><ls> <sp>", {3010, 3003, 220, 3010}},
    };
    for (const auto& [text, want] : cases) EXPECT_EQ(tok.encode(text), want) << json(text).dump();
    EXPECT_EQ(tok.encode("<sp><ls> <sp>", false), (std::vector<int32_t>{27, 500, 29, 3003, 628, 500, 29}));
    // Decoding maps an added token through the byte-level alphabet when all its characters are in it
    // ("café" -> the single byte 0xE9, "aĠb" -> "a b"), else keeps its text; HF shows 0xE9 as U+FFFD.
    const std::vector<int32_t> ids = {3007, 3008, 3009};
    EXPECT_EQ(tok.decode(ids), "caf\xE9" "a bx\ny");
    EXPECT_EQ(utf8_lossy(tok.decode(ids)), "caf\uFFFDa bx\ny");
    EXPECT_EQ(stream_all(tok, ids, false), "caf\uFFFDa bx\ny");
}

TEST(tokenizer, merges_in_string_form_equal_pair_form) {
    TANSY_REQUIRE_FIXTURE(mini_path, MINI_JSON);
    TANSY_REQUIRE_FIXTURE(cases_path, MINI_CASES);
    json j = read_json(mini_path);
    ASSERT_TRUE(j["model"]["merges"][0].is_array());
    for (json& m : j["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
    const tokenizer tok = load_modified(j, "tok-merges");
    EXPECT_EQ(check_cases(tok, read_json(cases_path), "string merges"), 10);
}

TEST(tokenizer, concurrent_encoding_gives_the_same_ids) {
    TANSY_REQUIRE_FIXTURE(tok_path, QWEN3_JSON);
    TANSY_REQUIRE_FIXTURE(cases_path, CASES);
    const tokenizer& tok = cached_load(tok_path);
    const json cases = read_json(cases_path).at("qwen3");
    constexpr int N_THREADS = 4, ROUNDS = 20;
    std::vector<int> failures(N_THREADS, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < N_THREADS; t++)
        threads.emplace_back([&, t] {
            for (int r = 0; r < ROUNDS; r++)
                for (const json& c : cases)
                    failures[t] += tok.encode(c.at("text").get<std::string>()) != c.at("ids").get<std::vector<int32_t>>();
        });
    for (auto& th : threads) th.join();
    for (int t = 0; t < N_THREADS; t++) EXPECT_EQ(failures[t], 0) << "thread " << t;
}

// ---- streaming detokenizer ----------------------------------------------------------------------------

TEST(stream_decoder, fixture_cases_contain_tokens_that_split_characters) {
    // Guards the coverage of check_cases: with the tiny model's 4k vocabulary the CJK/emoji cases are made
    // of tokens that end mid-character, so the stream decoder's hold-back is exercised on real ids.
    TANSY_REQUIRE_FIXTURE(tok_path, TINY_JSON);
    TANSY_REQUIRE_FIXTURE(cases_path, CASES);
    const tokenizer& tok = cached_load(tok_path);
    const json cases = read_json(cases_path);
    int partial = 0;
    for (const json& c : cases.at("tiny"))
        for (int32_t id : c.at("ids").get<std::vector<int32_t>>()) partial += !valid_utf8(tok.token_bytes(id));
    EXPECT_GT(partial, 5);
}

TEST(stream_decoder, holds_back_partial_characters_byte_by_byte) {
    TANSY_REQUIRE_FIXTURE(tok_path, QWEN3_JSON);
    const tokenizer& tok = cached_load(tok_path);
    const std::string text = "é日😀";  // 2 + 3 + 4 bytes
    std::vector<int32_t> ids;
    for (unsigned char b : text) ids.push_back(byte_token(tok, b));
    stream_decoder sd(tok);
    std::vector<std::string> got;
    for (int32_t id : ids) got.push_back(sd.push(id));
    const std::vector<std::string> want = {"", "é", "", "", "日", "", "", "", "😀"};
    EXPECT_EQ(got, want);
    EXPECT_EQ(sd.flush(), "");
}

TEST(stream_decoder, special_tokens_inside_a_character) {
    TANSY_REQUIRE_FIXTURE(tok_path, QWEN3_JSON);
    const tokenizer& tok = cached_load(tok_path);
    const int32_t im_end = tok.find("<|im_end|>");
    // 日 = E6 97 A5 with <|im_end|> between its first two bytes.
    const std::vector<int32_t> ids = {byte_token(tok, 0xE6), im_end, byte_token(tok, 0x97), byte_token(tok, 0xA5)};
    {
        // Skipped special tokens do not break the character.
        stream_decoder sd(tok, true);
        EXPECT_EQ(sd.push(ids[0]), "");
        EXPECT_EQ(sd.push(ids[1]), "");
        EXPECT_EQ(sd.push(ids[2]), "");
        EXPECT_EQ(sd.push(ids[3]), "日");
        EXPECT_EQ(tok.decode(ids, true), "日");
    }
    {
        // Kept, the special token ends the sequence: U+FFFD for the lone lead byte, then the token, then
        // one U+FFFD per stray continuation byte: exactly utf8_lossy(decode(ids)).
        stream_decoder sd(tok, false);
        EXPECT_EQ(sd.push(ids[0]), "");
        EXPECT_EQ(sd.push(ids[1]), "\uFFFD<|im_end|>");
        EXPECT_EQ(sd.push(ids[2]), "\uFFFD");
        EXPECT_EQ(sd.push(ids[3]), "\uFFFD");
        EXPECT_EQ(utf8_lossy(tok.decode(ids)), "\uFFFD<|im_end|>\uFFFD\uFFFD");
    }
    {
        // A truncated character at the end comes out of flush() as U+FFFD.
        stream_decoder sd(tok);
        EXPECT_EQ(sd.push(byte_token(tok, 'a')), "a");
        EXPECT_EQ(sd.push(byte_token(tok, 0xF0)), "");
        EXPECT_EQ(sd.push(byte_token(tok, 0x9F)), "");
        EXPECT_TRUE(sd.has_pending());
        EXPECT_EQ(sd.flush(), "\uFFFD");
    }
}

TEST(stream_decoder, random_ids_never_emit_invalid_utf8) {
    TANSY_REQUIRE_FIXTURE(tok_path, QWEN3_JSON);
    const tokenizer& tok = cached_load(tok_path);
    constexpr int N_SEQUENCES = 300, SEQ_LEN = 40;
    std::mt19937 rng(1234);
    // Low ids are single bytes (many are UTF-8 fragments); the rest cover merged tokens and specials.
    std::uniform_int_distribution<int32_t> any_id(0, (int32_t)tok.size() - 1), low_id(0, 255);
    for (int s = 0; s < N_SEQUENCES; s++) {
        std::vector<int32_t> ids;
        for (int i = 0; i < SEQ_LEN; i++) ids.push_back(rng() % 3 ? low_id(rng) : any_id(rng));
        for (bool skip : {false, true}) EXPECT_EQ(stream_all(tok, ids, skip), utf8_lossy(tok.decode(ids, skip)));
    }
}

// ---- errors -------------------------------------------------------------------------------------------

TEST(tokenizer_errors, invalid_input) {
    TANSY_REQUIRE_FIXTURE(tok_path, TINY_JSON);
    const tokenizer& tok = cached_load(tok_path);
    for (const char* bad : {"abc\xFF", "truncated \xC3", "surrogate \xED\xA0\x80", "overlong \xC0\x80"}) {
        try {
            tok.encode(bad);
            ADD_FAILURE() << "no error for " << json(utf8_lossy(bad)).dump();
        } catch (const tansy::error& e) {
            EXPECT_NE(std::string(e.what()).find("not valid UTF-8"), std::string::npos) << e.what();
        }
    }
    EXPECT_THROW(tok.decode(std::vector<int32_t>{1, 4073}), tansy::error);
    EXPECT_THROW(tok.decode(std::vector<int32_t>{-1}), tansy::error);
    EXPECT_THROW(tok.token_bytes(1 << 30), tansy::error);
    stream_decoder sd(tok);
    EXPECT_THROW(sd.push(99999), tansy::error);
    EXPECT_TRUE(tok.encode("").empty());
    EXPECT_EQ(tok.decode(std::vector<int32_t>{}), "");
}

TEST(tokenizer_errors, malformed_tokenizer_json) {
    TANSY_REQUIRE_FIXTURE(mini_path, MINI_JSON);
    const json good = read_json(mini_path);
    const std::string dir = test::temp_dir("tok-bad");
    struct bad_case {
        const char* name;
        std::function<void(json&)> edit;  // applied to a copy of the good file
        const char* message;              // expected part of the error
    };
    auto split = [](json& j) -> json& { return j["pre_tokenizer"]["pretokenizers"][0]; };
    const bad_case cases[] = {
        {"no_model", [](json& j) { j.erase("model"); }, "no 'model'"},
        {"wordpiece", [](json& j) { j["model"]["type"] = "WordPiece"; }, "only byte-level BPE"},
        {"vocab_not_object", [](json& j) { j["model"]["vocab"] = json::array(); }, "vocab must be a non-empty object"},
        {"vocab_id_string", [](json& j) { j["model"]["vocab"]["a"] = "1"; }, "not an integer id"},
        {"vocab_duplicate_id", [](json& j) { j["model"]["vocab"]["zzzz"] = 5; }, "is used by both"},
        {"vocab_negative_id", [](json& j) { j["model"]["vocab"]["zzzz"] = -3; }, "must be in [0"},
        {"merge_unknown_token", [](json& j) { j["model"]["merges"].push_back({"Ġ", "notatoken"}); }, "'notatoken' is not in the vocabulary"},
        {"merge_result_unknown", [](json& j) { j["model"]["merges"].push_back({"q", "q"}); }, "'qq' is not in the vocabulary"},
        {"merge_string_no_space", [](json& j) { j["model"]["merges"].push_back("ab"); }, "two tokens separated by one space"},
        {"merge_number", [](json& j) { j["model"]["merges"].push_back(7); }, "neither"},
        {"merges_missing", [](json& j) { j["model"].erase("merges"); }, "merges must be an array"},
        {"dropout", [](json& j) { j["model"]["dropout"] = 0.1; }, "dropout"},
        {"normalizer_nfkc", [](json& j) { j["normalizer"] = {{"type", "NFKC"}}; }, "only NFC"},
        {"no_pre_tokenizer", [](json& j) { j["pre_tokenizer"] = nullptr; }, "no pre_tokenizer"},
        {"metaspace", [](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; }, "not supported"},
        {"split_removed", [&](json& j) { split(j)["behavior"] = "Removed"; }, "only Isolated"},
        {"split_invert", [&](json& j) { split(j)["invert"] = true; }, "invert"},
        {"regex_w", [&](json& j) { split(j)["pattern"]["Regex"] = "\\w+|\\s+"; }, "is not supported"},
        {"regex_broken", [&](json& j) { split(j)["pattern"]["Regex"] = "(\\p{L}+"; }, "does not compile"},
        {"regex_bad_property", [&](json& j) { split(j)["pattern"]["Regex"] = "\\p{NoSuchProperty}"; }, "does not compile"},
        {"no_byte_level", [](json& j) { j["pre_tokenizer"]["pretokenizers"].erase(1); }, "no ByteLevel"},
        {"byte_level_regex", [](json& j) { j["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = true; }, "use_regex"},
        {"prefix_space", [](json& j) { j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; }, "add_prefix_space"},
        {"no_decoder", [](json& j) { j["decoder"] = nullptr; }, "decoder"},
        {"template_post", [](json& j) { j["post_processor"] = {{"type", "TemplateProcessing"}}; }, "post_processor"},
        {"added_not_array", [](json& j) { j["added_tokens"] = json::object(); }, "must be an array"},
        {"added_no_content", [](json& j) { j["added_tokens"][0].erase("content"); }, "'content' must be a string"},
        {"added_vocab_conflict", [](json& j) { j["added_tokens"][0]["content"] = "Ġthe"; }, "the vocabulary gives it"},
        {"added_id_clash", [](json& j) { j["added_tokens"][1]["id"] = 3000; }, "already used by"},
        {"unk_missing", [](json& j) { j["model"]["unk_token"] = "<unk>"; }, "unk_token '<unk>' is not in the vocabulary"},
    };
    for (const bad_case& c : cases) {
        json j = good;
        c.edit(j);
        const std::string path = write_temp(dir, std::string(c.name) + ".json", j.dump());
        try {
            tokenizer::load(path);
            ADD_FAILURE() << c.name << ": loaded without an error";
        } catch (const tansy::error& e) {
            EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos) << c.name << ": " << e.what();
        }
    }
    const std::pair<const char*, const char*> raw[] = {
        {"{\"model\": ", "not valid JSON"},
        {"[1, 2]", "top level is not an object"},
        {"", "not valid JSON"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}", "no pre_tokenizer"},
    };
    for (const auto& [text, message] : raw) {
        const std::string path = write_temp(dir, "raw.json", text);
        try {
            tokenizer::load(path);
            ADD_FAILURE() << json(text).dump() << ": loaded without an error";
        } catch (const tansy::error& e) {
            EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
        }
    }
    EXPECT_THROW(tokenizer::load(dir + "/does-not-exist.json"), tansy::error);
    EXPECT_THROW(tokenizer::load(test::temp_dir("tok-empty-dir")), tansy::error);  // no tokenizer.json inside
}

// ---- CLI ----------------------------------------------------------------------------------------------

TEST(tokenizer_cli, tokenize_and_decode_round_trip) {
    TANSY_REQUIRE_FIXTURE(tok_path, TINY_JSON);
    std::string out;
    if (test::run_command(std::string(TANSY_CLI) + " tokenize --help", &out) != 0 ||
        out.find("tokenize") == std::string::npos)
        GTEST_SKIP() << "'tansy tokenize' is not registered in src/cli/main.cpp yet";
    const std::string dir = test::temp_dir("tok-cli");
    const std::string text = "<|im_start|>user\nhé 日本 😀<|im_end|>\n";
    const std::string text_file = write_temp(dir, "in.txt", text);
    ASSERT_EQ(test::run_command(std::string(TANSY_CLI) + " tokenize --model " + tok_path + " --text-file " + text_file, &out), 0) << out;
    const tokenizer& tok = cached_load(tok_path);
    std::string want;
    for (int32_t id : tok.encode(text)) want += (want.empty() ? "" : " ") + std::to_string(id);
    EXPECT_EQ(out, want + "\n");
    const std::string ids_file = write_temp(dir, "ids.txt", out);
    ASSERT_EQ(test::run_command(std::string(TANSY_CLI) + " tokenize --decode --model " + tok_path + " --ids-file " + ids_file, &out), 0) << out;
    EXPECT_EQ(out, text);
    const std::string bad = write_temp(dir, "bad.txt", "abc\xFF");
    EXPECT_EQ(test::run_command(std::string(TANSY_CLI) + " tokenize --model " + tok_path + " --text-file " + bad, &out), 1);
    EXPECT_NE(out.find("not valid UTF-8"), std::string::npos) << out;
}
