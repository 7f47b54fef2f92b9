// Python semantics the chat template relies on (chat_template.h): str(), repr(), json.dumps (Hugging Face's
// `tojson`), float repr and str.strip(), over UTF-8 with Python's isspace() / isprintable() from utf8proc.
#include "tokenizer/chat_template.h"

#include <utf8proc.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "core/check.h"
#include "tokenizer/chat_template_internal.h"

namespace tansy {

using json = nlohmann::ordered_json;

namespace chat_template_detail {

code_point decode_at(std::string_view s, size_t i) {
    utf8proc_int32_t cp = -1;
    utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                                          (utf8proc_ssize_t)(s.size() - i), &cp);
    if (n <= 0) return {-1, 1};
    return {cp, (size_t)n};
}

}  // namespace chat_template_detail

using namespace chat_template_detail;

namespace {

// ---------------------------------------------------------------------------------------------------------
// UTF-8 helpers (lenient: an invalid byte counts as one non-space, non-printable unit, so nothing crashes)

// Start of the code point that ends at byte `end` (exclusive), and its decoding.
code_point decode_before(std::string_view s, size_t end, size_t* start) {
    size_t b = end - 1;
    while (b > 0 && end - b < 4 && ((unsigned char)s[b] & 0xC0) == 0x80) b--;
    code_point c = decode_at(s, b);
    if (c.cp < 0 || b + c.len != end) {  // not a well-formed sequence ending here: step back one byte
        *start = end - 1;
        return {-1, 1};
    }
    *start = b;
    return c;
}

// Python's str.isspace() per code point (Objects/unicodetype_db.h is generated with: bidirectional class WS, B
// or S, or category Zs). utf8proc carries both properties, so no table is written out here.
bool py_isspace(int32_t cp) {
    if (cp < 0) return false;
    const utf8proc_property_t* p = utf8proc_get_property(cp);
    return p->category == UTF8PROC_CATEGORY_ZS || p->bidi_class == UTF8PROC_BIDI_CLASS_WS ||
           p->bidi_class == UTF8PROC_BIDI_CLASS_B || p->bidi_class == UTF8PROC_BIDI_CLASS_S;
}

// Python's str.isprintable() per code point: everything except categories C* and Z* (space excepted).
bool py_isprintable(int32_t cp) {
    if (cp == ' ') return true;
    if (cp < 0) return false;
    switch (utf8proc_category(cp)) {
        case UTF8PROC_CATEGORY_CC:
        case UTF8PROC_CATEGORY_CF:
        case UTF8PROC_CATEGORY_CS:
        case UTF8PROC_CATEGORY_CO:
        case UTF8PROC_CATEGORY_CN:
        case UTF8PROC_CATEGORY_ZL:
        case UTF8PROC_CATEGORY_ZP:
        case UTF8PROC_CATEGORY_ZS: return false;
        default: return true;
    }
}

// Python repr(str): single quotes unless the text has ' and no ", escapes per unicode_repr().
std::string py_repr_string(std::string_view s) {
    const char quote = (s.find('\'') != std::string_view::npos && s.find('"') == std::string_view::npos) ? '"' : '\'';
    std::string out(1, quote);
    for (size_t i = 0; i < s.size();) {
        code_point c = decode_at(s, i);
        const int32_t cp = c.cp < 0 ? (unsigned char)s[i] : c.cp;  // a stray byte shows as \xNN
        if (cp == quote || cp == '\\')
            out += '\\', out += (char)cp;
        else if (cp == '\t')
            out += "\\t";
        else if (cp == '\n')
            out += "\\n";
        else if (cp == '\r')
            out += "\\r";
        else if (cp < ' ' || cp == 0x7f || c.cp < 0)
            out += strprintf("\\x%02x", cp);
        else if (cp < 0x7f || py_isprintable(cp))
            out.append(s.substr(i, c.len));
        else if (cp <= 0xff)
            out += strprintf("\\x%02x", cp);
        else if (cp <= 0xffff)
            out += strprintf("\\u%04x", cp);
        else
            out += strprintf("\\U%08x", cp);
        i += c.len;
    }
    return out + quote;
}

// Python's json.dumps and repr() stop at the interpreter's recursion limit (1000 by default); so do we, which
// also keeps a hostile request from overflowing the stack.
constexpr int k_max_depth = 1000;

void check_depth(int depth) {
    if (depth > k_max_depth) fail("chat template: JSON value nested deeper than %d levels", k_max_depth);
}

std::string py_str_at(const json& v, int depth);

std::string py_repr(const json& v, int depth) {
    return v.is_string() ? py_repr_string(v.get_ref<const std::string&>()) : py_str_at(v, depth);
}

// json.dumps string encoding with ensure_ascii=False (Lib/json/encoder.py ESCAPE_DCT).
void json_quote(std::string_view s, std::string& out) {
    out += '"';
    for (char ch : s) {
        const unsigned char c = (unsigned char)ch;
        switch (c) {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\r': out += "\\r"; break;
            case '\t': out += "\\t"; break;
            case '\b': out += "\\b"; break;
            case '\f': out += "\\f"; break;
            default:
                if (c < 0x20)
                    out += strprintf("\\u%04x", c);
                else
                    out += ch;
        }
    }
    out += '"';
}

void json_dump_to(const json& v, std::string& out, int depth) {
    check_depth(depth);
    switch (v.type()) {
        case json::value_t::null: out += "null"; return;
        case json::value_t::boolean: out += v.get<bool>() ? "true" : "false"; return;
        case json::value_t::number_integer: out += std::to_string(v.get<int64_t>()); return;
        case json::value_t::number_unsigned: out += std::to_string(v.get<uint64_t>()); return;
        case json::value_t::number_float: {
            const double x = v.get<double>();
            if (std::isnan(x))
                out += "NaN";
            else if (std::isinf(x))
                out += x > 0 ? "Infinity" : "-Infinity";
            else
                out += py_float_repr(x);
            return;
        }
        case json::value_t::string: json_quote(v.get_ref<const std::string&>(), out); return;
        case json::value_t::array: {
            out += '[';
            bool first = true;
            for (const json& e : v) {
                if (!first) out += ", ";
                first = false;
                json_dump_to(e, out, depth + 1);
            }
            out += ']';
            return;
        }
        case json::value_t::object: {
            out += '{';
            bool first = true;
            for (const auto& [k, e] : v.items()) {
                if (!first) out += ", ";
                first = false;
                json_quote(k, out);
                out += ": ";
                json_dump_to(e, out, depth + 1);
            }
            out += '}';
            return;
        }
        default: fail("chat template: cannot serialise a JSON %s value", v.type_name());
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Python semantics

std::string py_float_repr(double x) {
    if (std::isnan(x)) return "nan";
    if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
    // Shortest round-trip digits, as Python's repr (dtoa mode 0), come from to_chars: "-d.ddde+XX".
    char buf[64];
    auto res = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
    TANSY_CHECK(res.ec == std::errc(), "to_chars failed");
    std::string_view sci(buf, res.ptr - buf);
    std::string sign, digits;
    size_t i = 0;
    if (sci[0] == '-') sign = "-", i = 1;
    for (; i < sci.size() && sci[i] != 'e'; i++)
        if (sci[i] != '.') digits += sci[i];
    const int exp10 = std::stoi(std::string(sci.substr(i + 1)));
    const int decpt = exp10 + 1;  // value = 0.DIGITS x 10^decpt
    const int n = (int)digits.size();
    // Python/pystrtod.c format_float_short, mode 'r': exponent when decpt <= -4 or decpt > 16.
    if (decpt <= -4 || decpt > 16) {
        std::string mant = digits.substr(0, 1) + (n > 1 ? "." + digits.substr(1) : "");
        return sign + mant + strprintf("e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    }
    if (decpt <= 0) return sign + "0." + std::string(-decpt, '0') + digits;
    if (decpt >= n) return sign + digits + std::string(decpt - n, '0') + ".0";
    return sign + digits.substr(0, decpt) + "." + digits.substr(decpt);
}

std::string py_json_dumps(const json& v) {
    std::string out;
    json_dump_to(v, out, 0);
    return out;
}

namespace {

std::string py_str_at(const json& v, int depth) {
    check_depth(depth);
    switch (v.type()) {
        case json::value_t::null: return "None";
        case json::value_t::boolean: return v.get<bool>() ? "True" : "False";
        case json::value_t::number_integer: return std::to_string(v.get<int64_t>());
        case json::value_t::number_unsigned: return std::to_string(v.get<uint64_t>());
        case json::value_t::number_float: return py_float_repr(v.get<double>());
        case json::value_t::string: return v.get<std::string>();
        case json::value_t::array: {
            std::string out = "[";
            for (size_t i = 0; i < v.size(); i++) out += (i ? ", " : "") + py_repr(v[i], depth + 1);
            return out + "]";
        }
        case json::value_t::object: {
            std::string out = "{";
            bool first = true;
            for (const auto& [k, e] : v.items()) {
                out += (first ? "" : ", ") + py_repr_string(k) + ": " + py_repr(e, depth + 1);
                first = false;
            }
            return out + "}";
        }
        default: fail("chat template: cannot print a JSON %s value", v.type_name());
    }
}

}  // namespace

std::string py_str(const json& v) { return py_str_at(v, 0); }

std::string py_strip(std::string_view s) {
    size_t b = 0, e = s.size();
    while (b < e) {
        code_point c = decode_at(s, b);
        if (!py_isspace(c.cp)) break;
        b += c.len;
    }
    while (e > b) {
        size_t start;
        code_point c = decode_before(s, e, &start);
        if (start < b || !py_isspace(c.cp)) break;
        e = start;
    }
    return std::string(s.substr(b, e - b));
}

}  // namespace tansy
