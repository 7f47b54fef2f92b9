#!/usr/bin/env python3
"""Summarise an `ncu --csv --metrics gpu__time_duration.sum` log: time per kernel name over the last decode
step (the kernels after the final launch of the first kernel of a step), largest first. --by-grid: one line per (kernel, grid size), e.g. to tell lm_head from the projections.
--prefill: the log of a bench that prefilled one prompt (after a warm-up) in chunks, each starting with an embed
launch: the timed prompt is the second half of the log (every chunk), not the last chunk."""
import csv, re, sys
from collections import defaultdict

rows = []
with open([a for a in sys.argv[1:] if not a.startswith("--")][0]) as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = re.sub(r"\(.*", "", r["Kernel Name"]).strip()
    if "--by-grid" in sys.argv:
        name += f"  grid {r.get('Grid Size', '?')} block {r.get('Block Size', '?')}"
    unit = r.get("Metric Unit", "nsecond")
    v = float(r["Metric Value"].replace(",", ""))
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6}.get(unit, 1.0)
    rows.append((int(r["ID"]), name, v * scale))
rows.sort()
starts = [i for i, (_, n, _) in enumerate(rows) if "embed" in n]
if "--prefill" in sys.argv:  # warm-up, then the timed prompt: as many chunks (embed launches) each
    what = "one prefill"
    step = rows[starts[len(starts) // 2]:] if len(starts) >= 2 else rows
else:  # the last decode step starts at the last embed launch
    what = "one decode step"
    step = rows[starts[-1]:] if starts else rows
tot = defaultdict(float)
cnt = defaultdict(int)
for _, n, us in step:
    tot[n] += us
    cnt[n] += 1
total = sum(tot.values())
print(f"{what}: {len(step)} kernels, {total:.1f} us of kernel time")
for n, us in sorted(tot.items(), key=lambda x: -x[1]):
    print(f"{us:10.1f} us {100 * us / total:5.1f}%  x{cnt[n]:4d}  {n[:140]}")
