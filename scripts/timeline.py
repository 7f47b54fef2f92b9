#!/usr/bin/env python3
"""One decode step's timeline from a TANSY_TIMELINE file (src/backend/cuda/timeline.cuh; a -DTANSY_TIMELINE=ON
build, e.g. `scripts/device.sh timeline`).

The file lists the stamping launches in order ("L name blocks"; "L #capture" and "L #end" around a graph capture)
and the stamps ("R grid block sm event t": event 0 when a block started, 1 when its wait returned; t in ns). The
step is the last capture's launches; its kernels are the same number of launches with the latest first stamps,
taken in the order they started (a kernel's blocks stamp after it has triggered the next), each checked against its
block count. Per kernel: when its first and last blocks became resident and when its waits returned, relative to
the step's first stamp, and its chain time: from its release (its first wait's return, when its predecessor has
completed) to the next kernel's, i.e. what it costs inside the graph.

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
    launches, stamps = [], defaultdict(lambda: [[], []])
    with open(a.file) as f:
        for line in f:
            if line.startswith("L "):
                parts = line[2:].split()
                launches.append((parts[0], int(parts[1]) if len(parts) > 1 else 0))
            elif line.startswith("R "):
                _, grid, block, sm, ev, t = line.split()
                stamps[int(grid)][int(ev)].append((int(t), int(block), int(sm)))
    caps = [i for i, (n, _) in enumerate(launches) if n == "#capture"]
    step = launches[caps[-1] + 1:] if caps else launches
    ends = [i for i, (n, _) in enumerate(step) if n == "#end"]
    step = [l for l in (step[:ends[0]] if ends else step) if not l[0].startswith("#")]
    if not step or not stamps:
        sys.exit("timeline: no launches or no stamps in the file")
    grids = sorted((g for g in stamps if stamps[g][0]), key=lambda g: (min(s[0] for s in stamps[g][0]), g))
    if len(grids) < len(step):
        sys.exit(f"timeline: {len(grids)} stamped launches for a step of {len(step)}")
    grids = grids[-len(step):]
    # each launch's stamps must be its blocks (up to the slots' 256): else a launch stamped without a name, or two
    # launches sharing a slot (gridid % 1024), shifted the pairing
    for k, ((name, blocks), g) in enumerate(zip(step, grids)):
        want, got = min(blocks, 256), len(stamps[g][0])
        if blocks and want != got:
            sys.exit(f"timeline: launch {k} of the step ({name[:60]}, {blocks} blocks) pairs with a grid of {got} "
                     "stamps: the names and the stamps do not line up (an unnamed stamping launch, or a slot reused)")
    slots = [g % 1024 for g in grids]
    if len(set(slots)) != len(slots):
        sys.exit("timeline: two launches of the step share a slot (gridid % 1024): their stamps are mixed")
    t0 = min(s[0] for s in stamps[grids[0]][0])
    us = lambda t: (t - t0) / 1000.0
    rows = []
    for name, g in zip(demangle([n for n, _ in step]), grids):
        st, wt = stamps[g]
        first_s, last_s = min(s[0] for s in st), max(s[0] for s in st)
        first_w = min(s[0] for s in wt) if wt else None
        last_w = max(s[0] for s in wt) if wt else None
        rows.append((name, len(st), us(first_s), us(last_s), first_w and us(first_w), last_w and us(last_w)))
    print(f"one decode step: {len(step)} stamping kernels, {rows[-1][2] - rows[0][2]:.1f} us from the first kernel's "
          f"first block to the last kernel's (the last capture's last replay; grid ids {grids[0]}..{grids[-1]})")
    # a kernel's release: its first wait's return (its predecessor has completed), or its first block's start when
    # it has no wait; the chain time of kernel i is release(i + 1) - release(i)
    release = [fw if fw is not None else fs for (_, _, fs, _, fw, _) in rows]
    chain = defaultdict(float)
    count = defaultdict(int)
    if a.all:
        print(f"{'kernel':44} {'blocks':>6} {'start first..last':>18} {'wait first..last':>18} {'chain':>7}")
    for i, (n, nb, fs, ls, fw, lw) in enumerate(rows):
        c = release[i + 1] - release[i] if i + 1 < len(rows) else None
        if c is not None:
            chain[n] += c
            count[n] += 1
        if a.all:
            w = f"{fw:8.2f}..{lw:8.2f}" if lw is not None else " " * 18
            print(f"{n[:44]:44} {nb:6d} {fs:8.2f}..{ls:8.2f} {w} {'' if c is None else f'{c:7.2f}'}")
    total = sum(chain.values())
    print(f"chain time by kernel (its release to the next kernel's; the last kernel not counted), {total:.1f} us:")
    for n, v in sorted(chain.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {v:8.1f} us  {100 * v / total:5.1f}%  x {count[n]:3d}  {v / count[n]:6.2f} us each  {n}")


if __name__ == "__main__":
    main()
