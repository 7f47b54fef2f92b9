// JSON Schema -> schema_program: the compiler (keywords to nodes, $ref resolution, flattened unions, each
// node's shortest valid value). json_schema.cpp runs a program byte by byte; json_schema.h has the subset.
#include "server/json_schema.h"

#include <algorithm>

namespace tansy {

namespace {

using ojson = nlohmann::ordered_json;

constexpr int k_max_schema_depth = 32;
constexpr size_t k_max_nodes = 2048;
constexpr size_t k_max_enum = 4096;
constexpr size_t k_max_enum_bytes = size_t(1) << 20;
constexpr size_t k_max_props = 256;
constexpr size_t k_max_branches = 64;
constexpr size_t k_max_min_size = 4096;

const char* const k_unsupported[] = {"pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                     "multipleOf", "uniqueItems", "minProperties", "maxProperties",
                                     "patternProperties", "propertyNames", "not", "if", "then", "else", "contains",
                                     "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties",
                                     "unevaluatedItems", "minContains", "maxContains", "additionalItems"};

bool listed(const char* const* b, const char* const* e, const std::string& k) {
    return std::any_of(b, e, [&](const char* x) { return k == x; });
}

std::string compact(const ojson& v) { return v.dump(-1, ' ', false, ojson::error_handler_t::strict); }

std::string escape_key(const std::string& name) {
    const std::string q = compact(ojson(name));
    return q.substr(1, q.size() - 2);
}

uint8_t type_bit(const std::string& t) {
    if (t == "null") return st_null;
    if (t == "boolean") return st_bool;
    if (t == "integer") return st_int;
    if (t == "number") return st_num | st_int;
    if (t == "string") return st_str;
    if (t == "object") return st_obj;
    if (t == "array") return st_arr;
    throw schema_error("unknown type '" + t + "'");
}

uint8_t value_type(const ojson& v) {
    if (v.is_null()) return st_null;
    if (v.is_boolean()) return st_bool;
    if (v.is_number_integer() || v.is_number_unsigned()) return st_int;
    if (v.is_number()) return st_num;
    if (v.is_string()) return st_str;
    if (v.is_object()) return st_obj;
    return st_arr;
}

uint32_t bound(const ojson& s, const char* k, uint32_t dflt) {
    auto it = s.find(k);
    if (it == s.end()) return dflt;
    if (!it->is_number_integer() || it->get<int64_t>() < 0)
        throw schema_error(std::string("'") + k + "' must be a non-negative integer");
    return (uint32_t)std::min<int64_t>(it->get<int64_t>(), UINT32_MAX - 1);
}

size_t add_sat(size_t a, size_t b) { return a == SIZE_MAX || b == SIZE_MAX || a + b > k_max_min_size ? SIZE_MAX : a + b; }

int text_depth(const std::string& s) {  // container nesting of a JSON text
    int d = 0, m = 0;
    bool str = false, esc = false;
    for (char c : s) {
        if (str) {
            if (esc) esc = false;
            else if (c == '\\') esc = true;
            else if (c == '"') str = false;
        } else if (c == '"') {
            str = true;
        } else if (c == '{' || c == '[') {
            m = std::max(m, ++d);
        } else if (c == '}' || c == ']') {
            d--;
        }
    }
    return m;
}

}  // namespace

// ---- compilation

schema_program::schema_program() {
    add();                       // 0: anything
    nodes_[0].additional = 0;
    add();                       // 1: nothing
    nodes_[1].types = 0;
}

int schema_program::add() {
    if (nodes_.size() >= k_max_nodes) throw schema_error("the schema has more than 2048 subschemas");
    nodes_.emplace_back();
    return (int)nodes_.size() - 1;
}

int schema_program::compile(const ojson& doc, bool strict) {
    doc_ = &doc;
    strict_ = strict;
    refs_.clear();
    return compile_node(doc, 0);
}

int schema_program::compile_node(const ojson& s, int depth) {
    if (depth > k_max_schema_depth) throw schema_error("the schema nests deeper than 32 levels");
    if (s.is_boolean()) return s.get<bool>() ? 0 : 1;
    if (!s.is_object()) throw schema_error("a schema must be an object or a boolean");
    bool assertions = false;  // keywords that constrain values, besides $ref / anyOf / oneOf / allOf
    for (auto it = s.begin(); it != s.end(); ++it) {
        const std::string& k = it.key();
        if (listed(std::begin(k_unsupported), std::end(k_unsupported), k)) {
            if (strict_) throw schema_error("the keyword '" + k + "' is not supported");
        } else if (k == "type" || k == "enum" || k == "const" || k == "properties" || k == "required" ||
                   k == "additionalProperties" || k == "items" || k == "prefixItems" || k == "minItems" ||
                   k == "maxItems" || k == "minLength" || k == "maxLength") {
            assertions = true;
        }
    }
    const bool nullable = s.contains("nullable") && s["nullable"].is_boolean() && s["nullable"].get<bool>();
    auto combinator = [&](const char* key) -> const ojson* {
        auto it = s.find(key);
        return it == s.end() ? nullptr : &*it;
    };
    if (const ojson* r = combinator("$ref")) {
        if (!r->is_string()) throw schema_error("'$ref' must be a string");
        if (assertions) throw schema_error("'$ref' together with other assertions is not supported");
        const std::string ref = r->get<std::string>();
        if (ref.empty() || ref[0] != '#') throw schema_error("only local '$ref's (\"#/...\") are supported: " + ref);
        int target = -1;
        for (const auto& [path, n] : refs_)
            if (path == ref) target = n;
        if (target < 0) {
            const ojson* t = nullptr;
            try {
                t = &doc_->at(ojson::json_pointer(ref.substr(1)));
            } catch (const std::exception&) {
                throw schema_error("'$ref' " + ref + " does not resolve");
            }
            target = add();
            refs_.emplace_back(ref, target);
            const int real = compile_node(*t, depth + 1);
            nodes_[(size_t)target].alias = real;
        }
        if (!nullable) return target;
        const int u = add();
        nodes_[(size_t)u].any_of = {target, add()};
        nodes_[(size_t)nodes_[(size_t)u].any_of[1]].types = st_null;
        return u;
    }
    const ojson* any = combinator("anyOf");
    if (!any) any = combinator("oneOf");
    if (const ojson* all = combinator("allOf")) {
        if (any || !all->is_array() || all->size() != 1)
            throw schema_error("'allOf' is supported with one element only");
        if (assertions) throw schema_error("'allOf' together with other assertions is not supported");
        any = all;
    }
    if (any) {
        if (!any->is_array() || any->empty() || any->size() > k_max_branches)
            throw schema_error("'anyOf' / 'oneOf' must be an array of 1 to 64 schemas");
        if (assertions) throw schema_error("'anyOf' / 'oneOf' together with other assertions is not supported");
        std::vector<int> branches;
        for (const ojson& b : *any) branches.push_back(compile_node(b, depth + 1));
        if (nullable) {
            const int n = add();
            nodes_[(size_t)n].types = st_null;
            branches.push_back(n);
        }
        const int u = add();
        nodes_[(size_t)u].any_of = std::move(branches);
        return u;
    }

    const int id = add();
    uint8_t types = st_any;
    if (auto t = s.find("type"); t != s.end()) {
        if (t->is_string()) {
            types = type_bit(t->get<std::string>());
        } else if (t->is_array() && !t->empty()) {
            types = 0;
            for (const ojson& x : *t) {
                if (!x.is_string()) throw schema_error("'type' must be a string or a list of strings");
                types |= type_bit(x.get<std::string>());
            }
        } else {
            throw schema_error("'type' must be a string or a list of strings");
        }
    }
    if (nullable) types |= st_null;
    nodes_[(size_t)id].types = types;
    const ojson* en = combinator("enum");
    ojson one;
    if (const ojson* c = combinator("const")) {
        one = ojson::array({*c});
        en = &one;
    }
    if (en) {
        if (!en->is_array() || en->size() > k_max_enum) throw schema_error("'enum' must be an array of at most 4096 values");
        std::vector<std::string> texts;
        size_t bytes = 0;
        for (const ojson& v : *en) {
            if (!(value_type(v) & types) && !(value_type(v) == st_num && (types & st_int) && v.get<double>() == (double)(int64_t)v.get<double>()))
                continue;
            texts.push_back(compact(v));
            bytes += texts.back().size();
            if (bytes > k_max_enum_bytes) throw schema_error("'enum' holds more than 1 MiB of values");
        }
        if (nullable && (types & st_null)) texts.push_back("null");
        std::sort(texts.begin(), texts.end());
        texts.erase(std::unique(texts.begin(), texts.end()), texts.end());
        nodes_[(size_t)id].has_enum = true;
        nodes_[(size_t)id].enums = std::move(texts);
        return id;  // the values are checked against the rest at compile time only by type
    }
    // objects
    int additional = -1;
    if (auto a = s.find("additionalProperties"); a != s.end()) additional = compile_node(*a, depth + 1);
    if (additional == 1) additional = -1;
    std::vector<std::string> names;
    std::vector<int> pnodes;
    if (auto p = s.find("properties"); p != s.end()) {
        if (!p->is_object()) throw schema_error("'properties' must be an object");
        if (p->size() > k_max_props) throw schema_error("an object schema lists more than 256 properties");
        for (auto it = p->begin(); it != p->end(); ++it) {
            names.push_back(it.key());
            pnodes.push_back(compile_node(it.value(), depth + 1));
        }
    }
    std::vector<uint8_t> req(names.size(), 0);
    if (auto r = s.find("required"); r != s.end()) {
        if (!r->is_array()) throw schema_error("'required' must be an array of strings");
        for (const ojson& x : *r) {
            if (!x.is_string()) throw schema_error("'required' must be an array of strings");
            const std::string name = x.get<std::string>();
            auto f = std::find(names.begin(), names.end(), name);
            if (f == names.end()) {
                if (additional < 0)
                    throw schema_error("required property '" + name + "' is not in 'properties' and "
                                       "additionalProperties is false");
                if (names.size() >= k_max_props) throw schema_error("an object schema lists more than 256 properties");
                names.push_back(name);
                pnodes.push_back(additional);
                req.push_back(1);
            } else {
                req[(size_t)(f - names.begin())] = 1;
            }
        }
    }
    // arrays
    std::vector<int> prefix;
    if (auto p = s.find("prefixItems"); p != s.end()) {
        if (!p->is_array() || p->size() > k_max_props) throw schema_error("'prefixItems' must be an array");
        for (const ojson& x : *p) prefix.push_back(compile_node(x, depth + 1));
    }
    int items = 0;
    if (auto it = s.find("items"); it != s.end()) {
        if (it->is_array()) throw schema_error("'items' as an array (draft 4) is not supported: use 'prefixItems'");
        items = compile_node(*it, depth + 1);
        if (items == 1) items = -1;
    }
    schema_node& n = nodes_[(size_t)id];  // (compile_node may have grown nodes_)
    n.additional = additional;
    n.prop_names = names;
    n.prop_nodes = pnodes;
    n.prop_required = req;
    for (const std::string& name : names) n.prop_keys.push_back(escape_key(name));
    std::vector<int> order(names.size());
    for (size_t i = 0; i < order.size(); i++) order[i] = (int)i;
    std::sort(order.begin(), order.end(), [&](int a, int b) { return n.prop_keys[(size_t)a] < n.prop_keys[(size_t)b]; });
    for (int i : order) {
        n.keys_sorted.push_back(n.prop_keys[(size_t)i]);
        n.keys_prop.push_back(i);
    }
    n.prefix = prefix;
    n.items = items;
    n.min_items = bound(s, "minItems", 0);
    n.max_items = bound(s, "maxItems", UINT32_MAX);
    n.min_len = bound(s, "minLength", 0);
    n.max_len = bound(s, "maxLength", UINT32_MAX);
    return id;
}

int schema_program::restrict_types(int n, uint8_t mask) {
    while (nodes_[(size_t)n].alias >= 0) n = nodes_[(size_t)n].alias;
    if (!nodes_[(size_t)n].any_of.empty()) {
        std::vector<int> branches;
        for (int b : std::vector<int>(nodes_[(size_t)n].any_of)) branches.push_back(restrict_types(b, mask));
        const int u = add();
        nodes_[(size_t)u].any_of = std::move(branches);
        return u;
    }
    const int c = add();
    nodes_[(size_t)c] = nodes_[(size_t)n];
    schema_node& x = nodes_[(size_t)c];
    x.types &= mask;
    if (x.has_enum) {
        std::vector<std::string> keep;
        for (const std::string& t : x.enums) {
            const ojson v = ojson::parse(t);
            if ((value_type(v) & mask) && (value_type(v) != st_num || (mask & st_num))) keep.push_back(t);
        }
        x.enums = std::move(keep);
    }
    return c;
}

void schema_program::finish() {
    const size_t N = nodes_.size();
    auto resolve = [&](int n) {
        for (size_t steps = 0; n >= 0 && nodes_[(size_t)n].alias >= 0; steps++) {
            if (steps > N) throw schema_error("'$ref' refers to itself in a loop");
            n = nodes_[(size_t)n].alias;
        }
        return n;
    };
    for (size_t i = 0; i < N; i++)  // an alias becomes a copy of what it names (roots may be aliases too)
        if (nodes_[i].alias >= 0) {
            const int t = resolve((int)i);
            nodes_[i] = nodes_[(size_t)t];
        }
    for (schema_node& x : nodes_) {
        for (int& c : x.any_of) c = resolve(c);
        for (int& c : x.prop_nodes) c = resolve(c);
        for (int& c : x.prefix) c = resolve(c);
        if (x.additional >= 0) x.additional = resolve(x.additional);
        if (x.items >= 0) x.items = resolve(x.items);
    }
    // unions: the leaves, flattened (cycles of unions add nothing)
    for (size_t u = 0; u < N; u++) {
        if (nodes_[u].any_of.empty() || nodes_[u].alias >= 0) continue;
        std::vector<int> leaves, todo = nodes_[u].any_of;
        std::vector<uint8_t> seen(N, 0);
        seen[u] = 1;
        while (!todo.empty()) {
            const int b = todo.back();
            todo.pop_back();
            if (seen[(size_t)b]) continue;
            seen[(size_t)b] = 1;
            if (nodes_[(size_t)b].any_of.empty()) leaves.push_back(b);
            else todo.insert(todo.end(), nodes_[(size_t)b].any_of.rbegin(), nodes_[(size_t)b].any_of.rend());
            if (leaves.size() > k_max_branches) throw schema_error("a union has more than 64 alternatives");
        }
        if (leaves.empty()) leaves.push_back(1);
        nodes_[u].any_of = std::move(leaves);
    }
    // shortest values: a fixed point over sizes (they only fall), then the texts
    auto item_node = [](const schema_node& x, uint32_t i) { return i < x.prefix.size() ? x.prefix[i] : x.items; };
    auto size_of = [&](const schema_node& x) -> size_t {
        if (x.alias >= 0) return nodes_[(size_t)x.alias].min_size;
        if (!x.any_of.empty()) {
            size_t m = SIZE_MAX;
            for (int b : x.any_of) m = std::min(m, nodes_[(size_t)b].min_size);
            return m;
        }
        if (x.has_enum) {
            size_t m = SIZE_MAX;
            for (const std::string& t : x.enums) m = std::min(m, t.size());
            return m > k_max_min_size ? SIZE_MAX : m;
        }
        size_t m = SIZE_MAX;
        if (x.types & (st_int | st_num)) m = 1;
        if (x.types & (st_null | st_bool)) m = std::min<size_t>(m, 4);
        if ((x.types & st_str) && x.min_len <= x.max_len) m = std::min(m, add_sat(2, x.min_len));
        if (x.types & st_obj) {
            size_t o = 2, k = 0;
            for (size_t i = 0; i < x.prop_nodes.size(); i++) {
                if (!x.prop_required[i]) continue;
                o = add_sat(o, add_sat(x.prop_keys[i].size() + 3 + (k++ ? 1 : 0), nodes_[(size_t)x.prop_nodes[i]].min_size));
            }
            m = std::min(m, o);
        }
        if ((x.types & st_arr) && x.min_items <= x.max_items) {
            size_t a = 2;
            for (uint32_t i = 0; i < x.min_items && a != SIZE_MAX; i++) {
                const int it = item_node(x, i);
                a = add_sat(a, it < 0 ? SIZE_MAX : add_sat(nodes_[(size_t)it].min_size, i ? 1 : 0));
            }
            m = std::min(m, a);
        }
        return m;
    };
    for (bool changed = true; changed;) {
        changed = false;
        for (schema_node& x : nodes_) {
            const size_t m = size_of(x);
            if (m < x.min_size) x.min_size = m, changed = true;
        }
    }
    // texts, children first: a node's shortest value only uses children with strictly smaller sizes
    std::vector<size_t> order(N);
    for (size_t i = 0; i < N; i++) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return nodes_[a].min_size < nodes_[b].min_size; });
    for (size_t i : order) {
        schema_node& x = nodes_[i];
        if (x.min_size == SIZE_MAX) break;
        if (x.alias >= 0) continue;
        std::string t;
        if (!x.any_of.empty()) {
            for (int b : x.any_of)
                if (nodes_[(size_t)b].min_size == x.min_size) { t = nodes_[(size_t)b].min_text; break; }
        } else if (x.has_enum) {
            for (const std::string& e : x.enums)
                if (e.size() == x.min_size) { t = e; break; }
        } else if ((x.types & (st_int | st_num)) && x.min_size == 1) {
            t = "0";
        } else if ((x.types & st_null) && x.min_size == 4) {
            t = "null";
        } else if ((x.types & st_bool) && x.min_size == 4) {
            t = "true";
        } else if ((x.types & st_str) && x.min_len <= x.max_len && x.min_size == add_sat(2, x.min_len)) {
            t = "\"" + std::string(x.min_len, 'a') + "\"";
        } else {
            bool done = false;
            if (x.types & st_obj) {
                std::string o = "{";
                for (size_t p = 0; p < x.prop_nodes.size(); p++) {
                    if (!x.prop_required[p]) continue;
                    if (o.size() > 1) o += ',';
                    o += "\"" + x.prop_keys[p] + "\":" + nodes_[(size_t)x.prop_nodes[p]].min_text;
                }
                o += '}';
                if (o.size() == x.min_size) t = o, done = true;
            }
            if (!done) {
                std::string a = "[";
                for (uint32_t k = 0; k < x.min_items; k++) {
                    if (k) a += ',';
                    a += nodes_[(size_t)item_node(x, k)].min_text;
                }
                t = a + "]";
            }
        }
        x.min_text = std::move(t);
        x.min_depth = text_depth(x.min_text);
        if (x.min_depth + 1 > (int)k_max_nesting) x.min_size = SIZE_MAX, x.min_text.clear();
    }
    for (schema_node& x : nodes_)
        if (x.alias >= 0) {
            const schema_node& t = nodes_[(size_t)x.alias];
            x.min_size = t.min_size, x.min_text = t.min_text, x.min_depth = t.min_depth;
        }
}

}  // namespace tansy
