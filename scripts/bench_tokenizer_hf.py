#!/usr/bin/env python3
"""Times Hugging Face `tokenizers` encoding a text file on one thread: the reference for bench_tokenizer.

usage: bench_tokenizer_hf.py --tokenizer tokenizer.json --text-file F [--runs N] [--chunk-bytes N] [--ids-out F]

Reports MB/s as the median of N timed runs after one warm-up run, like bench/bench_tokenizer.cpp, and with
--ids-out writes the ids one per line so `cmp` can check tansy gives the same tokens.
"""
import argparse
import os
import statistics
import sys
import time

# one thread: HF parallelises only batches, but make sure rayon cannot help
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer, __version__  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json or a directory containing one")
    ap.add_argument("--text-file", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-special", action="store_true", help="do not parse special tokens in the text")
    ap.add_argument("--chunk-bytes", type=int, default=0,
                    help="encode in chunks ending at the first newline after N bytes (0: the whole file at once)")
    ap.add_argument("--ids-out")
    a = ap.parse_args()

    path = a.tokenizer
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    t0 = time.perf_counter()
    tok = Tokenizer.from_file(path)
    t_load = time.perf_counter() - t0
    if a.no_special:
        tok.encode_special_tokens = True
    with open(a.text_file, "rb") as f:
        data = f.read()
    mb = len(data) / 1e6
    chunks = []  # same cutting rule as bench_tokenizer.cpp, on bytes
    at = 0
    while at < len(data):
        end = len(data)
        if a.chunk_bytes > 0 and at + a.chunk_bytes < len(data):
            nl = data.find(b"\n", at + a.chunk_bytes)
            end = len(data) if nl < 0 else nl + 1
        chunks.append(data[at:end].decode("utf-8"))
        at = end

    secs, ids = [], None
    t_cold = 0.0
    for r in range(a.runs + 1):  # run 0 warms the cache, as in bench_tokenizer
        t1 = time.perf_counter()
        ids = []
        for c in chunks:
            ids += tok.encode(c, add_special_tokens=False).ids
        dt = time.perf_counter() - t1
        if r == 0:
            t_cold = dt
        else:
            secs.append(dt)
    med = statistics.median(secs)
    print(f"tokenizers {__version__}: {path} loaded in {t_load:.3f} s")
    print(f"text       {a.text_file}: {mb:.2f} MB in {len(chunks)} call{'' if len(chunks) == 1 else 's'} -> {len(ids)} tokens ({len(data) / max(len(ids), 1):.2f} bytes/token)")
    print(f"encode     cold {mb / t_cold:.1f} MB/s; median of {a.runs}: {med:.3f} s = {mb / med:.1f} MB/s, "
          f"{len(ids) / med / 1e6:.2f} M tokens/s (min {min(secs):.3f} s, max {max(secs):.3f} s)")
    if a.ids_out:
        with open(a.ids_out, "w") as f:
            f.write("".join(f"{i}\n" for i in ids))


if __name__ == "__main__":
    sys.exit(main())
