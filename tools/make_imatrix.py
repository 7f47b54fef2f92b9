#!/usr/bin/python3
"""Column importances for `tansy convert --imatrix`: the mean squared input of every linear module of a bf16
checkpoint over calibration text (llama.cpp's "imatrix"), so the mse quantiser weighs each column's error by the
activation that multiplies it.

The forward pass is shared/tools/np_reference.py's float64 numpy model (imported): practical for the tiny
fixtures, not for the 35B release (that needs a native pass with a tap on every matmul input). Experts get one
vector per expert over the tokens routed to them ([E, cols]); the shared expert and attention/DeltaNet
projections one vector ([cols]). Output names are MLX module paths (language_model.model.layers.L....).

Usage (numpy + tokenizers):
  python3 tools/make_imatrix.py --model BF16_DIR --out imatrix.safetensors FILE.txt [FILE.txt ...]
Calibration text must not overlap the text the result is evaluated on (docs/QUALITY.md uses standard-library
files other than the held-out __future__.py that the teacher window comes from).
"""
import argparse, json, os, struct, sys
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get('NP_REFERENCE', os.path.join(ROOT, '..', 'shared', 'tools')))
import np_reference as R  # noqa: E402

P = 'language_model.model.'
MIXER = dict(q='self_attn.q_proj', k='self_attn.k_proj', v='self_attn.v_proj', o='self_attn.o_proj',
             qkv='linear_attn.in_proj_qkv', z='linear_attn.in_proj_z', b='linear_attn.in_proj_b',
             a='linear_attn.in_proj_a', out='linear_attn.out_proj')


class Stats:
    def __init__(self):
        self.sum, self.n = {}, {}

    def add(self, key, x, row=None, rows=None):
        """x [T, cols]; row/rows: slot of a per-expert [rows, cols] accumulator."""
        x = np.asarray(x).reshape(-1, np.shape(x)[-1])
        if key not in self.sum:
            shape = (rows, x.shape[1]) if rows else (x.shape[1],)
            self.sum[key], self.n[key] = np.zeros(shape), np.zeros(shape[:-1] + (1,) if rows else (1,))
        if rows:
            self.sum[key][row] += (x * x).sum(0)
            self.n[key][row] += len(x)
        else:
            self.sum[key] += (x * x).sum(0)
            self.n[key] += len(x)

    def means(self):
        return {k: (s / np.maximum(self.n[k], 1)).astype(np.float32) for k, s in self.sum.items()}


class Recorded:
    """Stands for a weight matrix in `x @ W.T`: records x, then multiplies."""
    __array_ufunc__ = None

    def __init__(self, w, key, stats):
        self.w, self.key, self.stats = w, key, stats

    @property
    def T(self):
        return self

    @property
    def shape(self):
        return self.w.shape

    def __rmatmul__(self, x):
        self.stats.add(self.key, x)
        return x @ self.w.T


class Model(R.Model):
    """np_reference's model, recording the inputs of the MoE block's matrices (routed tokens per expert)."""

    def __init__(self, W, stats):
        super().__init__(W)
        self.stats = stats

    def moe(self, l, x):
        i = next(j for j, m in enumerate(self.W.layers) if m is l)
        p, E = f'{P}layers.{i}.mlp.', l['eg'].shape[0]
        top = np.argsort(-(x @ l['router'].T), axis=1, kind='stable')[:, :self.topk]
        for e in range(E):
            xe = x[(top == e).any(1)]
            if len(xe):
                self.stats.add(p + 'switch_mlp.gate_proj', xe, e, E)
                self.stats.add(p + 'switch_mlp.down_proj', R.silu(xe @ l['eg'][e].T) * (xe @ l['eu'][e].T), e, E)
        for k in ('mlp.gate', 'mlp.shared_expert_gate', 'mlp.shared_expert.gate_proj'):
            self.stats.add(f'{P}layers.{i}.{k}', x)
        self.stats.add(p + 'shared_expert.down_proj', R.silu(x @ l['sg'].T) * (x @ l['su'].T))
        return super().moe(l, x)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--model', required=True, help='bf16 checkpoint (any layout np_reference reads)')
    ap.add_argument('--out', required=True)
    ap.add_argument('--tokens-per-file', type=int, default=1024)
    ap.add_argument('text', nargs='+')
    a = ap.parse_args()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(a.model, 'tokenizer.json'))
    W, stats = R.Weights(a.model), Stats()
    for i, l in enumerate(W.layers):
        for k, name in MIXER.items():
            if k in l:
                l[k] = Recorded(l[k], f'{P}layers.{i}.{name}', stats)
    W.lm_head = Recorded(W.lm_head, 'language_model.lm_head', stats)
    m, n = Model(W, stats), 0
    for f in a.text:
        ids = tok.encode(open(f, encoding='utf-8').read()).ids[:a.tokens_per_file]
        m.forward(ids)
        n += len(ids)
    out = stats.means()
    for k in list(out):  # gate_proj and up_proj read the same input
        if k.endswith(('switch_mlp.gate_proj', 'shared_expert.gate_proj')):
            out[k[:-len('gate_proj')] + 'up_proj'] = out[k]
    header, blobs, off = {'__metadata__': {'tokens': str(n), 'files': json.dumps(a.text)}}, [], 0
    for k in sorted(out):
        raw = np.ascontiguousarray(out[k]).tobytes()
        header[k] = {'dtype': 'F32', 'shape': list(out[k].shape), 'data_offsets': [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b' ' * ((8 - len(h) % 8) % 8)
    with open(a.out, 'wb') as fh:
        fh.write(struct.pack('<Q', len(h)) + h + b''.join(blobs))
    print(f'{a.out}: {len(out)} modules over {n} tokens')


if __name__ == '__main__':
    main()
