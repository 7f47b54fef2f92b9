#!/usr/bin/env python3
"""Summarise `ncu -i REP --page source --csv --print-source sass` output: instructions executed in total, and
the SASS lines with the most warp-stall samples (with their execution counts), to see where a kernel's issue
slots and stalls go. Usage: ncu_source.py FILE.csv [TOP]"""
import csv, sys

path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40
with open(path) as f:
    lines = [l for l in f if l.startswith('"') and not l.startswith('"Kernel Name"')]
rows = list(csv.DictReader(lines))
if not rows:
    sys.exit("no rows")
cols = rows[0].keys()
def col(*keys):
    for c in cols:
        if all(k.lower() in c.lower() for k in keys):
            return c
    return None
c_src, c_addr = col("source"), col("address")
c_samp = col("warp stall sampling", "all") or col("sampling")
c_exec = col("instructions executed")
def num(r, c):
    try:
        return float((r.get(c) or "0").replace(",", ""))
    except ValueError:
        return 0.0
tot_exec = sum(num(r, c_exec) for r in rows) if c_exec else 0
tot_samp = sum(num(r, c_samp) for r in rows) if c_samp else 0
print(f"columns: source={c_src} samples={c_samp} executed={c_exec}")
print(f"{len(rows)} SASS lines, {tot_exec:.0f} warp instructions executed, {tot_samp:.0f} stall samples")
# executed instructions by opcode
ops = {}
for r in rows:
    op = (r.get(c_src) or "").split()
    op = [o for o in op if not o.startswith("@")]
    name = op[0].split(".")[0] if op else "?"
    ops[name] = ops.get(name, 0) + num(r, c_exec)
print("executed by opcode: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(ops.items(), key=lambda x: -x[1])[:24]))
for r in sorted(rows, key=lambda r: -num(r, c_samp))[:top]:
    print(f"{num(r, c_samp):7.0f} samp {num(r, c_exec):9.0f} exec  {r.get(c_addr, '')}  {(r.get(c_src) or '')[:90]}")
