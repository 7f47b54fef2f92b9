#!/usr/bin/env python3
"""Emulates chunk_kernel and chunk_scan_kernel (src/backend/cuda/gdn_prefill.cu) thread by thread (vectorised
over tid with the kernel's own index formulas), shared memory and the workspace filled with NaN so that any read
of unwritten memory poisons the result; checks write coverage (each element once) of the thread mappings and
compares with the recurrence (MODEL.md 4.6) in float64 / float32."""
import numpy as np
import sys

DK, CC, CH = 128, 64, 256
KP, MP, CT, CTP = DK + 4, CC + 4, 32, 32 + 4
DT = np.float64


def softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(x)))


class Problem:
    def __init__(self, spans, Hk, Hv, dv, seed, dtype=np.float64, s0_scale=0.1):
        rng = np.random.default_rng(seed)
        self.spans = spans  # (row0, n), tiling rows
        self.T = sum(n for _, n in spans)
        self.Hk, self.Hv, self.dv, self.dtype = Hk, Hv, dv, dtype
        T = self.T

        def unit(x):
            return x / np.linalg.norm(x, axis=-1, keepdims=True)

        # k^ q^ as prep leaves them (positive-biased like SiLU outputs, to make k.k sizeable)
        self.q = (unit(np.abs(rng.standard_normal((T, Hk, DK))) + 0.1 * rng.standard_normal((T, Hk, DK))) / np.sqrt(DK)).astype(dtype)
        self.k = unit(np.abs(rng.standard_normal((T, Hk, DK))) + 0.1 * rng.standard_normal((T, Hk, DK))).astype(dtype)
        self.v = rng.standard_normal((T, Hv, dv)).astype(dtype)
        self.a = rng.standard_normal((T, Hv)).astype(dtype)
        self.b = rng.standard_normal((T, Hv)).astype(dtype)
        self.A_log = (rng.standard_normal(Hv) * 0.5).astype(dtype)
        self.dt_bias = (rng.standard_normal(Hv) * 0.5).astype(dtype)
        self.beta = (1 / (1 + np.exp(-self.b))).astype(dtype)
        self.g = (-np.exp(self.A_log)[None, :] * softplus(self.a + self.dt_bias[None, :])).astype(dtype)
        self.S0 = [(rng.standard_normal((Hv, DK, dv)) * s0_scale).astype(dtype) for _ in spans]


def reference(P):
    out = np.zeros((P.T, P.Hv, P.dv))
    S_out = []
    grp = P.Hv // P.Hk
    for si, (row0, n) in enumerate(P.spans):
        S = P.S0[si].astype(np.float64).copy()
        for h in range(P.Hv):
            for t in range(row0, row0 + n):
                k, q = P.k[t, h // grp].astype(np.float64), P.q[t, h // grp].astype(np.float64)
                S[h] *= np.exp(np.float64(P.g[t, h]))
                u = S[h].T @ k
                d = P.beta[t, h] * (P.v[t, h] - u)
                S[h] += np.outer(k, d)
                out[t, h] = S[h].T @ q
        S_out.append(S)
    return out, S_out


def emulate(P, min_rows=17):
    dt = P.dtype
    f = lambda x: dt(x)
    T, Hk, Hv, dv = P.T, P.Hk, P.Hv, P.dv
    kd = Hk * DK
    nan = np.nan
    # workspace as gdn.cuh lays it out
    off = ((T * (2 * Hk * DK + 2 * Hv)) + 3) // 4 * 4
    size = off + 2 * Hv * T * CC
    work = np.full(size, nan, dtype=dt)
    work[0:T * kd] = P.q.reshape(-1)
    work[T * kd:2 * T * kd] = P.k.reshape(-1)
    g_off = 2 * T * kd
    # prep: (beta, alpha) [Hv, T, 2] for rows of long spans
    for row0, n in P.spans:
        if n < min_rows:
            continue
        for h in range(Hv):
            for r in range(row0, row0 + n):
                work[g_off + (h * T + r) * 2] = P.beta[r, h]
                work[g_off + (h * T + r) * 2 + 1] = np.exp(P.g[r, h])
    tinv_off, amat_off = off, off + Hv * T * CC
    vd = Hv * dv
    o = np.full(T * vd, nan, dtype=dt)
    for row0, n in P.spans:
        o[row0 * vd:(row0 + n) * vd] = P.v[row0:row0 + n].reshape(-1)
    states = [P.S0[i].copy().reshape(-1) for i in range(len(P.spans))]
    n_spans = len(P.spans)
    tid = np.arange(CH)

    # ---------------------------------------------------------------- chunk_kernel
    max_chunks = (T - (n_spans - 1) + CC - 1) // CC
    tinv_writes = np.zeros(Hv * T * CC, dtype=int)
    amat_writes = np.zeros(Hv * T * CC, dtype=int)
    gam_writes = np.zeros(Hv * T, dtype=int)
    for bz in range(n_spans):
        sp_row0, sp_n = P.spans[bz]
        for h in range(Hv):
            for bx in range(max_chunks):
                c0 = bx * CC
                if sp_n < min_rows or c0 >= sp_n:
                    continue
                nc = min(CC, sp_n - c0)
                kh = h // (Hv // Hk)
                row0 = sp_row0 + c0
                smem = np.full(2 * CC * KP + 2 * CC * MP, nan, dtype=dt)
                sk, sq, sL, sT = 0, CC * KP, 2 * CC * KP, 2 * CC * KP + CC * MP
                s_gam = np.full(CC, nan, dtype=dt)
                s_beta = np.full(CC, nan, dtype=dt)
                # 1.
                for i in range(CC * (DK // 4)):  # every i is some thread's
                    r, c4 = i // (DK // 4), (i % (DK // 4)) * 4
                    kv = np.zeros(4, dt)
                    qv = np.zeros(4, dt)
                    if r < nc:
                        src = (row0 + r) * kd + kh * DK + c4
                        kv = work[T * kd + src:T * kd + src + 4].copy()
                        qv = work[src:src + 4].copy()
                    smem[sk + r * KP + c4:sk + r * KP + c4 + 4] = kv
                    smem[sq + r * KP + c4:sq + r * KP + c4 + 4] = qv
                for t in range(CC):
                    g, beta = f(0), f(0)
                    if t < nc:
                        row = row0 + t
                        A = -np.exp(P.A_log[h])
                        g = f(A * softplus(P.a[row, h] + P.dt_bias[h]))
                        beta = work[g_off + (h * T + row) * 2]
                    s_gam[t], s_beta[t] = g, beta
                acc = f(0)
                for r in range(CC):
                    acc = f(acc + s_gam[r])
                    s_gam[r] = acc
                for t in range(nc):
                    work[g_off + (h * T + row0 + t) * 2 + 1] = s_gam[t]
                    gam_writes[h * T + row0 + t] += 1
                # 2.
                tr, ts = tid // 16, tid % 16
                kk = np.zeros((CH, 4, 4), dt)
                qk = np.zeros((CH, 4, 4), dt)
                for i in range(0, DK, 4):
                    for j in range(4):
                        for m in range(4):
                            for e in range(4):
                                kr = smem[sk + (tr + 16 * j) * KP + i + e]
                                qr = smem[sq + (tr + 16 * j) * KP + i + e]
                                ks = smem[sk + (ts + 16 * m) * KP + i + e]
                                kk[:, j, m] += kr * ks
                                qk[:, j, m] += qr * ks
                sL_writes = np.zeros(CC * MP, dtype=int)
                for t in range(CH):
                    for j in range(4):
                        for m in range(4):
                            r, s = tr[t] + 16 * j, ts[t] + 16 * m
                            l, a = f(0), f(0)
                            if s <= r:
                                decay = np.exp(s_gam[r] - s_gam[s])
                                if s < r:
                                    l = s_beta[r] * kk[t, j, m] * decay
                                a = qk[t, j, m] * decay
                            smem[sL + r * MP + s] = l
                            sL_writes[r * MP + s] += 1
                            if r < nc:
                                idx = (h * T + row0) * CC + r * CC + s
                                work[amat_off + idx] = a
                                amat_writes[idx] += 1
                cov = sL_writes.reshape(CC, MP)[:, :CC]
                assert (cov == 1).all(), "sL coverage"
                assert (sL_writes.reshape(CC, MP)[:, CC:] == 0).all()
                # 3.
                for j in range(CC):
                    for r in range(CC):
                        Lr = sL + r * MP
                        v = [f(0)] * 4
                        s = j
                        while s + 3 < r:
                            for u in range(4):
                                v[u] = v[u] + smem[Lr + s + u] * smem[sT + (s + u) * MP + j]
                            s += 4
                        while s < r:
                            v[0] = v[0] + smem[Lr + s] * smem[sT + s * MP + j]
                            s += 1
                        smem[sT + r * MP + j] = -((v[0] + v[1]) + (v[2] + v[3])) if j < r else (1.0 if j == r else 0.0)
                for e in range(nc * (CC // 4)):
                    r, c4 = e // (CC // 4), (e % (CC // 4)) * 4
                    base = tinv_off + (h * T + row0) * CC + r * CC + c4
                    work[base:base + 4] = smem[sT + r * MP + c4:sT + r * MP + c4 + 4]
                    tinv_writes[(h * T + row0) * CC + r * CC + c4:(h * T + row0) * CC + r * CC + c4 + 4] += 1

    # coverage of the long spans' rows
    for row0, n in P.spans:
        if n < min_rows:
            continue
        for h in range(Hv):
            blk = slice((h * T + row0) * CC, (h * T + row0 + n) * CC)
            assert (tinv_writes[blk] == 1).all() and (amat_writes[blk] == 1).all(), "tinv/amat coverage"
            assert (gam_writes[h * T + row0:h * T + row0 + n] == 1).all()

    # ---------------------------------------------------------------- chunk_scan_kernel
    o_writes = np.zeros(T * vd, dtype=int)
    for bx in range(n_spans):
        sp_row0, sp_n = P.spans[bx]
        if sp_n < min_rows:
            continue
        for h in range(Hv):
            for bzc in range(dv // CT):
                col0 = bzc * CT
                kh = h // (Hv // Hk)
                smem = np.full(2 * CC * KP + 3 * CC * CTP + 2 * CC * MP + DK * CTP + 2 * CC, nan, dtype=dt)
                sk = 0
                sq = sk + CC * KP
                sv = sq + CC * KP
                sR = sv + CC * CTP
                sD = sR + CC * CTP
                sT = sD + CC * CTP
                sA = sT + CC * MP
                sS = sA + CC * MP
                sg = sS + DK * CTP
                assert sg + 2 * CC == len(smem)
                for x in (sq, sv, sR, sD, sT, sA, sS, sg):
                    assert x % 4 == 0
                s_el = np.full(CC, nan, dtype=dt)
                si, rr, j0 = tid // 8, tid // 8, 4 * (tid % 8)
                Sflat = states[bx]
                Sbase = h * DK * dv + col0  # + j0 per thread
                st = np.zeros((CH, 4, 4), dt)
                st_cov = np.zeros(Hv * DK * dv, dtype=int)
                for m in range(4):
                    for e in range(4):
                        idx = Sbase + j0 + (si + 32 * m) * dv + e
                        st[:, m, e] = Sflat[idx]
                        np.add.at(st_cov, idx, 1)
                assert (st_cov.reshape(Hv, DK, dv)[h][:, col0:col0 + CT] == 1).all() and st_cov.sum() == DK * CT
                c0 = 0
                while c0 < sp_n:
                    nc = min(CC, sp_n - c0)
                    row0 = sp_row0 + c0
                    for i in range(CC * (DK // 4)):
                        r, c4 = i // (DK // 4), (i % (DK // 4)) * 4
                        src = (row0 + min(r, nc - 1)) * kd + kh * DK + c4
                        smem[sk + r * KP + c4:sk + r * KP + c4 + 4] = work[T * kd + src:T * kd + src + 4] if r < nc else 0
                        smem[sq + r * KP + c4:sq + r * KP + c4 + 4] = work[src:src + 4] if r < nc else 0
                    for i in range(CC * (CT // 4)):
                        r, c4 = i // (CT // 4), (i % (CT // 4)) * 4
                        src = (row0 + min(r, nc - 1)) * vd + h * dv + col0 + c4
                        smem[sv + r * CTP + c4:sv + r * CTP + c4 + 4] = o[src:src + 4] if r < nc else 0
                    for i in range(CC * (CC // 4)):
                        r, c4 = i // (CC // 4), (i % (CC // 4)) * 4
                        src = (h * T + row0 + min(r, nc - 1)) * CC + c4
                        smem[sT + r * MP + c4:sT + r * MP + c4 + 4] = work[tinv_off + src:tinv_off + src + 4] if r < nc else 0
                        smem[sA + r * MP + c4:sA + r * MP + c4 + 4] = work[amat_off + src:amat_off + src + 4] if r < nc else 0
                    for t in range(nc):
                        smem[sg + 2 * t:sg + 2 * t + 2] = work[g_off + (h * T + row0 + t) * 2:g_off + (h * T + row0 + t) * 2 + 2]
                    for m in range(4):
                        for e in range(4):
                            smem[sS + (si + 32 * m) * CTP + j0 + e] = st[:, m, e]
                    # barrier
                    g_last = smem[sg + 2 * (nc - 1) + 1]
                    for t in range(min(nc, CH)):
                        s_el[t] = np.exp(g_last - smem[sg + 2 * t + 1])
                    # 1.
                    ks = np.zeros((CH, 2, 4), dt)
                    qs = np.zeros((CH, 2, 4), dt)
                    for i in range(0, DK, 4):
                        for e in range(4):
                            for a in range(2):
                                kc = smem[sk + (rr + 32 * a) * KP + i + e]
                                qc = smem[sq + (rr + 32 * a) * KP + i + e]
                                for c in range(4):
                                    s4 = smem[sS + (i + e) * CTP + j0 + c]
                                    ks[:, a, c] += kc * s4
                                    qs[:, a, c] += qc * s4
                    # 2.
                    for t in range(CH):
                        for a in range(2):
                            r = rr[t] + 32 * a
                            if r >= nc:
                                continue
                            b = smem[sg + 2 * r]
                            bg = b * np.exp(smem[sg + 2 * r + 1])
                            for e in range(4):
                                smem[sR + r * CTP + j0[t] + e] = -bg * ks[t, a, e] + b * smem[sv + r * CTP + j0[t] + e]
                    # barrier; 3.
                    d = np.zeros((CH, 2, 4), dt)
                    s_end = np.minimum(nc, rr + 33)  # the kernel's bound (Tinv is lower triangular)
                    for s in range(nc):
                        live = s < s_end
                        for a in range(2):
                            tt = smem[sT + (rr + 32 * a) * MP + s]
                            for e in range(4):
                                d[:, a, e] += np.where(live, tt * smem[sR + s * CTP + j0 + e], 0.0)
                    for a in range(2):
                        for e in range(4):
                            smem[sD + (rr + 32 * a) * CTP + j0 + e] = d[:, a, e]
                    # barrier; 4.
                    for t in range(CH):
                        for a in range(2):
                            r = rr[t] + 32 * a
                            if r >= nc:
                                continue
                            eg = np.exp(smem[sg + 2 * r + 1])
                            ov = eg * qs[t, a].copy()
                            for s in range(r + 1):
                                ov += smem[sA + r * MP + s] * smem[sD + s * CTP + j0[t]:sD + s * CTP + j0[t] + 4]
                            base = (row0 + r) * vd + h * dv + col0 + j0[t]
                            o[base:base + 4] = ov
                            o_writes[base:base + 4] += 1
                    # 5.
                    el = np.exp(g_last)
                    st *= el
                    for r in range(nc):
                        w = s_el[r]
                        for m in range(4):
                            kv = smem[sk + r * KP + si + 32 * m] * w
                            for e in range(4):
                                st[:, m, e] += kv * smem[sD + r * CTP + j0 + e]
                    c0 += CC
                for m in range(4):
                    for e in range(4):
                        Sflat[Sbase + j0 + (si + 32 * m) * dv + e] = st[:, m, e]
    for row0, n in P.spans:
        if n >= min_rows:
            assert (o_writes[row0 * vd:(row0 + n) * vd] == 1).all(), "o coverage"
    return o.reshape(T, Hv, dv), [s.reshape(Hv, DK, dv) for s in states]


def run(spans, Hk=1, Hv=2, dv=64, dtype=np.float64, seed=1):
    P = Problem(spans, Hk, Hv, dv, seed, dtype)
    o_ref, S_ref = reference(P)
    o, S = emulate(P)
    worst = 0.0
    for si, (row0, n) in enumerate(spans):
        if n < 17:
            continue
        eo = np.abs(o[row0:row0 + n] - o_ref[row0:row0 + n]).max() / np.abs(o_ref[row0:row0 + n]).max()
        es = np.abs(S[si] - S_ref[si]).max() / np.abs(S_ref[si]).max()
        assert np.isfinite(o[row0:row0 + n]).all() and np.isfinite(S[si]).all(), "NaN"
        worst = max(worst, eo, es)
    print(f"spans {spans} dtype {np.dtype(dtype).name}: max rel diff {worst:.2e}", flush=True)
    return worst


if __name__ == "__main__":
    w = 0.0
    w = max(w, run([(0, 17)]))
    w = max(w, run([(0, 65)]))
    w = max(w, run([(0, 20), (20, 1), (21, 129)], Hk=1, Hv=2, dv=32))
    w = max(w, run([(0, 128), (128, 1)]))  # whole chunks, then a short span
    w = max(w, run([(0, 1), (1, 64), (65, 64)]))  # spans starting after row 0
    w = max(w, run([(0, 17), (17, 16), (33, 63)], Hk=2, Hv=4, dv=32))  # a span below the prefill threshold
    assert w < 1e-10, w
    print("float32:")
    run([(0, 150)], dtype=np.float32)
    print("ok")
