#!/usr/bin/env bash
# Builds a mixed UTF-8 text (~10 MB by default) for bench/bench_tokenizer.cpp and scripts/bench_tokenizer_hf.py
# from material found on the machine, so nothing large is committed:
#   ~40% code         Python standard library sources
#   ~25% English      Debian copyright/licence files (/usr/share/doc/*/copyright)
#   ~30% translations gettext catalogues (/usr/share/locale/*/LC_MESSAGES/*.mo), round-robin over ~100
#                     languages: CJK, Cyrillic, Arabic, Hebrew, Devanagari, Thai, Greek, ...
#   the rest          the tokenizer fixture texts, CJK test files, emoji / ZWJ / combining-mark lines
# Deterministic for a given machine (sorted file lists). Both benchmarks must be run on the same file.
# usage: scripts/make_tokenizer_bench_text.sh OUT [MB]
set -euo pipefail
out=${1:?usage: make_tokenizer_bench_text.sh OUT [MB]}
mb=${2:-10}
root=$(cd "$(dirname "$0")/.." && pwd)

python3 - "$out" "$mb" "$root" <<'EOF'
import glob, gettext, json, os, sys, sysconfig

out, mb, root = sys.argv[1], float(sys.argv[2]), sys.argv[3]
total = int(mb * 1e6)
parts = []

def read(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None

def take(files, budget):
    got, n = [], 0
    for f in files:
        t = read(f)
        if not t:
            continue
        got.append(t)
        n += len(t.encode())
        if n >= budget:
            break
    return got, n

# code: the standard library of the running python, then any other python found
stdlib = sysconfig.get_paths()["stdlib"]
py = sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True))
code, n_code = take(py, 0.40 * total)

docs = sorted(glob.glob("/usr/share/doc/*/copyright"))
prose, n_prose = take(docs, 0.25 * total)

# translations: msgstr values of gettext catalogues, a fair share per language
langs = sorted(d for d in glob.glob("/usr/share/locale/*") if os.path.isdir(d))
per_lang = 0.30 * total / max(len(langs), 1)
trans, n_trans = [], 0
for d in langs:
    n = 0
    for mo in sorted(glob.glob(os.path.join(d, "LC_MESSAGES", "*.mo"))):
        try:
            with open(mo, "rb") as f:
                cat = gettext.GNUTranslations(f)._catalog
        except Exception:
            continue
        for k in sorted(cat, key=str):
            v = cat[k]
            if isinstance(v, str) and v and k and n < per_lang:
                trans.append(v)
                n += len(v.encode())
        if n >= per_lang:
            break
    n_trans += n

# extras: fixture texts, CJK test files, emoji
extra = []
for fx in [os.path.join(root, "tests/fixtures/tokenizer_cases.json"), "/work/shared/fixtures/tokenizer_cases.json"]:
    if os.path.exists(fx):
        for cases in json.load(open(fx)).values():
            extra += [c["text"] for c in cases]
        break
for fx in [os.path.join(root, "tests/fixtures/tokenizers/qwen35-regex-mini/cases.json"),
           "/work/shared/fixtures/tokenizers/qwen35-regex-mini/cases.json"]:
    if os.path.exists(fx):
        extra += [c["text"] for c in json.load(open(fx))]
        break
for f in sorted(glob.glob("/usr/lib/python3*/test/cjkencodings/*-utf8.txt") +
                glob.glob(os.path.expanduser("~/.pyenv/versions/*/lib/python3*/test/cjkencodings/*-utf8.txt"))):
    t = read(f)
    if t:
        extra.append(t)
emoji = [chr(c) for c in range(0x1F600, 0x1F650)] + [chr(c) for c in range(0x1F300, 0x1F400, 3)]
for i in range(2000):
    e = emoji[(i * 7) % len(emoji)] + emoji[(i * 13 + 5) % len(emoji)]
    extra.append(f"line {i}: {e} 👨\u200d👩\u200d👧 👍🏽 e\u0301 ñ 日本語 {i * 31 % 997}\n")

chunks = extra + code + prose + trans
text = "\n".join(chunks)
data = text.encode("utf-8", "replace")
# repeat if the machine had too little material, then cut at a character boundary
while len(data) < total and data:
    data += b"\n" + data
data = data[:total]
data = data.decode("utf-8", "ignore").encode("utf-8")
with open(out, "wb") as f:
    f.write(data)
print(f"{out}: {len(data)/1e6:.2f} MB (code {n_code/1e6:.1f}, prose {n_prose/1e6:.1f}, "
      f"translations {n_trans/1e6:.1f} in {len(langs)} languages, extras {sum(len(x.encode()) for x in extra)/1e6:.2f})")
EOF
