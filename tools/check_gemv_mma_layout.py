#!/usr/bin/python3
"""Checks, on the CPU, the fragment layout of mma_dot.cuh (the 4-bit tensor-core dot of the decode kernels): lane (g, c) of a warp
loads word c of each 32-column unit in rows g and g+8, turns nibble pairs (n, n+4) into the A fragments of two
m16n8k16 k-steps, and reads x stored permuted per 8 values (x0 x4 x1 x5 x2 x6 x3 x7) as B. Emulates the mma with
the PTX fragment layout (a0 = A[g][2c..2c+1], a1 = A[g+8][..], a2 = A[g][2c+8..], a3 = A[g+8][2c+8..];
b0 = B[2c..2c+1][g], b1 = B[2c+8..2c+9][g]) and checks that every column of C is the rows' dot product with x."""
import numpy as np

rng = np.random.default_rng(1)
K, R = 256, 16
q = rng.integers(0, 16, size=(R, K))
x = rng.standard_normal(K)
# word j of a row holds values 8j..8j+7 at nibbles 0..7, least significant first (MLX packing)
words = [[sum(int(q[r, 8 * j + i]) << (4 * i) for i in range(8)) for j in range(K // 8)] for r in range(R)]


def f16_bits(b):
    return np.array([b], dtype=np.uint16).view(np.float16)[0]


def pairs(w):  # what q4_pairs(w) yields, in fp16 arithmetic: (q0, q4), (q1, q5), (q2, q6), (q3, q7)
    out = []
    for src in (w, w >> 8):
        lo = [f16_bits(((src >> (16 * h)) & 0xF) | 0x6400) - np.float16(1024) for h in (0, 1)]
        hi = [f16_bits(((src >> (16 * h)) & 0xF0) | 0x6400) * np.float16(1 / 16) + np.float16(-64) for h in (0, 1)]
        out += [tuple(float(v) for v in lo), tuple(float(v) for v in hi)]
    return out


def pair(w, i):  # pair i of word w, checked against the nibbles
    p = pairs(w)[i]
    assert p == ((w >> (4 * i)) & 15, (w >> (16 + 4 * i)) & 15), (hex(w), i, p)
    return p


# stage_x_mma: thread t takes x[4t..4t+3]; the even lane of each pair stores 4 words (its x_i low, the odd
# partner's x_{4+i} high) at s_hi[k..k+8)
s_hi = np.zeros(K)
for t in range(0, K // 4, 2):
    k = 4 * t
    own, partner = x[k:k + 4], x[k + 4:k + 8]
    for i in range(4):
        s_hi[k + 2 * i], s_hi[k + 2 * i + 1] = own[i], partner[i]


def a_fragment(u, step):
    """The 16 x 16 A operand of unit u's k-step (0: nibble pairs 0,4 | 1,5; 1: 2,6 | 3,7), as the lanes fill it
    (q4_fragments: lane (g, c) takes word c of the unit in rows g and g+8)."""
    lo, hi = (0, 1) if step == 0 else (2, 3)
    A = np.zeros((16, 16))
    for lane in range(32):
        g, c = lane // 4, lane % 4
        w0, w1 = words[g][u * 4 + c], words[g + 8][u * 4 + c]
        A[g, 2 * c:2 * c + 2], A[g + 8, 2 * c:2 * c + 2] = pair(w0, lo), pair(w1, lo)
        A[g, 2 * c + 8:2 * c + 10], A[g + 8, 2 * c + 8:2 * c + 10] = pair(w0, hi), pair(w1, hi)
    return A


def b_column(B, g, c, v, step):
    """Lane (g, c)'s share of B column g from its staged uint4 v (words .x .y for k-step 0, .z .w for 1)."""
    w_b0, w_b1 = (0, 1) if step == 0 else (2, 3)
    B[2 * c:2 * c + 2, g] = v[2 * w_b0:2 * w_b0 + 2]
    B[2 * c + 8:2 * c + 10, g] = v[2 * w_b1:2 * w_b1 + 2]


C = np.zeros((16, 8))
for u in range(K // 32):
    for step in (0, 1):
        B = np.zeros((16, 8))
        for lane in range(32):
            g, c = lane // 4, lane % 4
            b_column(B, g, c, s_hi[8 * (u * 4 + c):8 * (u * 4 + c) + 8], step)  # the lane's uint4
        C += a_fragment(u, step) @ B
err = np.max(np.abs(C - (q @ x)[:, None]))
print(f"max |C - q x| over all columns: {err:.2e}")
assert err < 1e-9

# mma_dot_rows_tokens<NG>: group j's B column n is token 8j + n's staged x (lanes whose token is >= T load token
# 0); lane (g, c) keeps C columns 2c and 2c+1 of each group, i.e. tokens 8j + 2c and 8j + 2c + 1
for T in (5, 13):
    NG = (T + 7) // 8
    X = rng.standard_normal((T, K))
    S_hi = np.zeros((T, K))
    for tok in range(T):
        for t in range(0, K // 4, 2):
            k = 4 * t
            for i in range(4):
                S_hi[tok, k + 2 * i], S_hi[tok, k + 2 * i + 1] = X[tok, k + i], X[tok, k + 4 + i]
    C = np.zeros((NG, 16, 8))
    for u in range(K // 32):
        for step in (0, 1):
            A, B = a_fragment(u, step), np.zeros((NG, 16, 8))
            for lane in range(32):
                g, c = lane // 4, lane % 4
                for j in range(NG):
                    tb = 8 * j + g if 8 * j + g < T else 0
                    b_column(B[j], g, c, S_hi[tb, 8 * (u * 4 + c):8 * (u * 4 + c) + 8], step)
            for j in range(NG):
                C[j] += A @ B[j]
    # the lanes' stores: token 8j + 2c + e of row g (+8) from group j's column 2c + e
    Y = np.zeros((16, T))
    for lane in range(32):
        g, c = lane // 4, lane % 4
        for j in range(NG):
            for e in range(2):
                t = 8 * j + 2 * c + e
                if t < T:
                    Y[g, t], Y[g + 8, t] = C[j, g, 2 * c + e], C[j, g + 8, 2 * c + e]
    err = np.max(np.abs(Y - q @ X.T))
    print(f"{T} tokens ({NG} groups of 8): max |Y - q X^T|: {err:.2e}")
    assert err < 1e-9
