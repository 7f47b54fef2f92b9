// The Qwen3.6 chat template (chat_template.jinja of Qwen/Qwen3.6-35B-A3B, 154 lines) written out by hand in C++:
// no Jinja engine. render_chat() reproduces what Hugging Face `apply_chat_template` renders, byte for byte
// (fixtures/chat_template/cases.json), including the template's Jinja/Python quirks: Python truthiness,
// `is true` / `is false` needing real booleans, str.strip() Unicode whitespace, `tojson` = json.dumps with
// ", " / ": " separators and raw non-ASCII, Python float repr. The format itself: MODEL.md §12.2.
//
// Errors: what the template reports with raise_exception(), and what fails inside Jinja (tool-call `arguments`
// that is not a mapping, a tool call without a string name, a content part that is not an object), is a
// tansy::error whose message starts with "chat template: " and contains the template's text.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"

namespace tansy {

// Which template text to follow. Qwen3.5 differs in two lines (fixtures/chat_template/README.md): it has no
// preserve_thinking, and renders non-string scalar tool-call arguments with Python str() (True, None) not JSON.
enum class chat_template_variant { qwen3_6, qwen3_5 };

struct chat_options {
    bool add_generation_prompt = true;
    // Template variables other than messages/tools/add_generation_prompt, read exactly as the template reads them:
    //   enable_thinking    only the boolean false turns thinking off (0, "false" do not)
    //   preserve_thinking  only the boolean true keeps reasoning on every assistant turn (1 does not; 3.6 only)
    //   add_vision_id      any Python-truthy value prefixes "Picture N: " / "Video N: "
    // A key that is absent is undefined in the template. Other keys are ignored.
    nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();
    chat_template_variant variant = chat_template_variant::qwen3_6;
    // Not in the template (which rejects it: "System message must be at the beginning."): a system message
    // after the first becomes a "<|im_start|>system\n...<|im_end|>\n" turn at its own position, its content
    // trimmed like every other. The OpenAI API allows system/developer messages anywhere (pydantic-ai appends
    // one per output-validation retry); the server turns this on. The first message keeps the template's
    // treatment (merged with the tool block).
    bool system_anywhere = false;
};

// messages: a JSON array of message objects. tools: null, or an array of tool schemas (each dumped whole).
// Throws tansy::error for everything the template rejects.
std::string render_chat(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                        const chat_options& opt);

// The rendered prompt and which of its bytes came from the request: message contents and reasoning, tool-call
// names, argument keys and values, the dumped tool schemas. Only the template's own text may turn into special
// tokens: encode with tokenizer::encode(text, client), which tokenises the client ranges as plain text.
// note: content parts are client text as a whole, including the vision placeholders the template writes
// for image parts (this text-only engine refuses those parts before rendering).
struct rendered_chat {
    std::string text;               // exactly render_chat()'s text
    std::vector<byte_range> client; // ascending, disjoint, non-empty
};
rendered_chat render_chat_marked(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                 const chat_options& opt);

// From an OpenAI-style chat request object: "messages" (required array), "tools" (optional array or null),
// "chat_template_kwargs" (optional object or null), "add_generation_prompt" (optional bool, default true);
// other fields (model, temperature, ...) are ignored. As in vLLM, an "add_generation_prompt" inside
// chat_template_kwargs overrides the top-level one. Tool-call arguments are NOT normalised: a JSON-string
// `arguments` is an error, as in the reference template (call normalize_openai_tool_calls first to accept it).
std::string render_chat_request(const nlohmann::ordered_json& request);

// For the server: returns a copy of `messages` in which every assistant tool call whose `arguments` is a string
// (OpenAI wire format: {"function": {"name", "arguments": "{\"city\": \"Paris\"}"}}) has it parsed into a JSON
// object, keeping key order. Unparseable JSON, or JSON that is not an object, is a tansy::error. Tool calls are
// located as the template does: `function.arguments` when the call has a "function" key, else `arguments`.
nlohmann::ordered_json normalize_openai_tool_calls(const nlohmann::ordered_json& messages);

// ---- Limits on client JSON

// How deep JSON from a client (a request body, tool-call arguments) may nest arrays and objects. Copying and
// walking a parsed tree recurses once per level, so a body of 100,000 '[' would overflow the stack; bodies
// are checked with json_depth_exceeds() before they are parsed. Real requests (tool schemas included) stay
// far below this.
constexpr int k_max_json_depth = 128;

// Whether JSON text opens more than max_depth arrays/objects at once, counting brackets outside strings
// (one pass, no allocation; text that is not JSON is scanned the same way and left for the parser to reject).
bool json_depth_exceeds(std::string_view text, int max_depth = k_max_json_depth);

// ---- Python semantics the template relies on; exposed for tests.

// Hugging Face's `tojson` filter: json.dumps(x, ensure_ascii=False) (separators ", " and ": ", key order kept,
// only '"', '\\' and control characters escaped, floats as Python repr, NaN/Infinity as Python writes them).
std::string py_json_dumps(const nlohmann::ordered_json& v);
// Python str(x) of the equivalent Python value: None, True, 2.5, 100.0, 1e-07, ['a', 1], {'k': None}.
std::string py_str(const nlohmann::ordered_json& v);
// Python repr(float): shortest round-trip digits, fixed notation for 1e-4 <= |x| < 1e16, else 1e+16 / 1e-05.
std::string py_float_repr(double x);
// Python str.strip() with no argument (Jinja `|trim`): strips Unicode whitespace (bidi class WS/B/S or Zs).
std::string py_strip(std::string_view s);

}  // namespace tansy
