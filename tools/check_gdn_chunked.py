#!/usr/bin/env python3
"""Checks the algebra of the CUDA chunked DeltaNet prefill (src/backend/cuda/gdn_prefill.cu, chunk_kernel and
chunk_scan_kernel) on the CPU in float64: per chunk of 64 rows from a span's start, gamma = running sum of g,
L_rs = beta_r (k_r.k_s) e^(gamma_r - gamma_s) (s < r), Tinv = (I + L)^-1 built column by column as the kernel
does, A_rs = (q_r.k_s) e^(gamma_r - gamma_s) (s <= r); then R = beta V - beta e^gamma (K S), Delta = Tinv R,
O = e^gamma (Q S) + A Delta, S = e^gamma_last S + (K e^(gamma_last - gamma))^T Delta; against the recurrence
of MODEL.md §4.6 (S = alpha S; u = S^T k; delta = beta (v - u); S += k delta^T; o = S^T q), from a non-zero
initial state, for span lengths with full and partial chunks."""
import numpy as np

CC, DK, DV = 64, 128, 32
rng = np.random.default_rng(7)


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def recurrent(q, k, v, g, beta, S):
    S = S.copy()
    out = np.zeros_like(v)
    for t in range(len(q)):
        S *= np.exp(g[t])
        u = S.T @ k[t]
        d = beta[t] * (v[t] - u)
        S += np.outer(k[t], d)
        out[t] = S.T @ q[t]
    return out, S


def chunked(q, k, v, g, beta, S):
    S = S.copy()
    out = np.zeros_like(v)
    for c0 in range(0, len(q), CC):
        nc = min(CC, len(q) - c0)
        K, Q, V = np.zeros((CC, DK)), np.zeros((CC, DK)), np.zeros((CC, DV))
        K[:nc], Q[:nc], V[:nc] = k[c0:c0 + nc], q[c0:c0 + nc], v[c0:c0 + nc]
        gg, bb = np.zeros(CC), np.zeros(CC)
        gg[:nc], bb[:nc] = g[c0:c0 + nc], beta[c0:c0 + nc]
        gam = np.cumsum(gg)
        # chunk_kernel
        decay = np.exp(np.minimum(gam[:, None] - gam[None, :], 0.0))
        low = np.tril(np.ones((CC, CC)), -1)
        L = bb[:, None] * (K @ K.T) * decay * low
        A = (Q @ K.T) * decay * np.tril(np.ones((CC, CC)))
        T = np.zeros((CC, CC))
        for j in range(CC):  # thread j: column j, row by row
            for r in range(CC):
                if j < r:
                    T[r, j] = -sum(L[r, s] * T[s, j] for s in range(j, r))
                elif j == r:
                    T[r, j] = 1.0
        # chunk_scan_kernel
        KS, QS = K @ S, Q @ S
        R = bb[:, None] * V - (bb * np.exp(gam))[:, None] * KS
        D = T[:nc, :nc] @ R[:nc]
        O = np.exp(gam[:nc])[:, None] * QS[:nc] + A[:nc, :nc] @ D
        out[c0:c0 + nc] = O
        gl = gam[nc - 1]
        S = np.exp(gl) * S + (K[:nc] * np.exp(gl - gam[:nc])[:, None]).T @ D
    return out, S


worst = 0.0
for n in (17, 64, 65, 129, 200):
    q, k = unit(rng.standard_normal((n, DK))) / np.sqrt(DK), unit(rng.standard_normal((n, DK)))
    v = rng.standard_normal((n, DV))
    g = -np.exp(rng.standard_normal(n) - 1.0)  # log decay < 0
    beta = 1 / (1 + np.exp(-rng.standard_normal(n)))
    S0 = rng.standard_normal((DK, DV)) * 0.1
    o1, s1 = recurrent(q, k, v, g, beta, S0)
    o2, s2 = chunked(q, k, v, g, beta, S0)
    err = max(np.max(np.abs(o1 - o2)) / np.max(np.abs(o1)), np.max(np.abs(s1 - s2)) / np.max(np.abs(s1)))
    print(f"{n:4d} rows: max relative difference (outputs, final state) {err:.2e}")
    worst = max(worst, err)
assert worst < 1e-10, worst
print("chunked form == recurrence")
