#!/usr/bin/env python3
"""One decode step's timeline from a TANSY_TIMELINE file (src/backend/cuda/timeline.cuh; a -DTANSY_TIMELINE=ON
build, e.g. `scripts/device.sh timeline`).

The file lists the PDL launches in order ("L name", "#capture" where a graph capture began) and the stamps ("R grid
block sm event t": event 0 when a block started, 1 when its wait returned; t in ns). The step is the last capture's
launches; its kernels are the same number of launches with the latest first stamps, taken in the order they
started (a PDL kernel starts after its predecessor's blocks have started). Per kernel: when its first and last
blocks became resident and when its waits returned, relative to the step's first stamp, and the chain time: from
the previous kernel's last wait to this one's, i.e. what the previous kernel cost inside the graph.

  python3 scripts/timeline.py FILE [--top N] [--all]
"""
import argparse
import re
import subprocess
import sys
from collections import defaultdict


def demangle(names):
    """Kernel names as c++filt prints them, shortened to name<template args> (the mangled ones if no c++filt)."""
    uniq = sorted(set(names))
    try:
        out = subprocess.run(["c++filt"], input="\n".join(uniq), capture_output=True, text=True, check=True).stdout
        plain = dict(zip(uniq, out.split("\n")))
    except (OSError, subprocess.CalledProcessError):
        plain = {n: n for n in uniq}
    def short(n):
        d = plain.get(n, n)
        d = re.sub(r"\([^()]*\)$", "", d)  # the parameter list
        d = re.sub(r"^.*?::(?=[a-z_0-9]+_kernel)", "", d)  # namespaces
        d = re.sub(r"^void ", "", d)
        return d
    return [short(n) for n in names]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=20, help="kernels in the summary")
    ap.add_argument("--all", action="store_true", help="every kernel of the step, in order")
    a = ap.parse_args()
    top = a.top
    names, stamps = [], defaultdict(lambda: [[], []])
    with open(a.file) as f:
        for line in f:
            if line.startswith("L "):
                names.append(line[2:].strip())
            elif line.startswith("R "):
                _, grid, block, sm, ev, t = line.split()
                stamps[int(grid)][int(ev)].append((int(t), int(block), int(sm)))
    caps = [i for i, n in enumerate(names) if n == "#capture"]
    step = names[caps[-1] + 1:] if caps else names
    step = [n for n in step if not n.startswith("#")]
    if not step or not stamps:
        sys.exit("timeline: no launches or no stamps in the file")
    grids = sorted((g for g in stamps if stamps[g][0]), key=lambda g: min(s[0] for s in stamps[g][0]))
    if len(grids) < len(step):
        sys.exit(f"timeline: {len(grids)} stamped launches for a step of {len(step)}")
    grids = grids[-len(step):]
    t0 = min(s[0] for s in stamps[grids[0]][0])
    us = lambda t: (t - t0) / 1000.0
    rows = []
    for name, g in zip(demangle(step), grids):
        st, wt = stamps[g]
        first_s, last_s = min(s[0] for s in st), max(s[0] for s in st)
        first_w = min(s[0] for s in wt) if wt else None
        last_w = max(s[0] for s in wt) if wt else None
        rows.append((name, len(st), us(first_s), us(last_s), first_w and us(first_w), last_w and us(last_w)))
    print(f"one decode step: {len(step)} PDL kernels, {rows[-1][3] - rows[0][2]:.1f} us from the first block start "
          f"to the last (stamps of the last capture's last replay)")
    chain = defaultdict(float)
    count = defaultdict(int)
    prev_w = None
    if a.all:
        print(f"{'kernel':42} {'blocks':>6} {'start first..last':>18} {'wait first..last':>18} {'chain':>7}")
    for i, (n, nb, fs, ls, fw, lw) in enumerate(rows):
        # chain: the previous kernel's cost in the graph, attributed to it (its last wait to this one's)
        if prev_w is not None and lw is not None:
            chain[rows[i - 1][0]] += lw - prev_w
            count[rows[i - 1][0]] += 1
        if a.all:
            w = f"{fw:8.2f}..{lw:8.2f}" if lw is not None else " " * 18
            c = f"{lw - prev_w:7.2f}" if (prev_w is not None and lw is not None) else ""
            print(f"{n[:42]:42} {nb:6d} {fs:8.2f}..{ls:8.2f} {w} {c}")
        if lw is not None:
            prev_w = lw
    total = sum(chain.values())
    print(f"chain time by kernel (a kernel's last wait to the next one's), {total:.1f} us in all:")
    for n, v in sorted(chain.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {v:8.1f} us  {100 * v / total:5.1f}%  x {count[n]:3d}  {v / count[n]:6.2f} us each  {n}")


if __name__ == "__main__":
    main()
