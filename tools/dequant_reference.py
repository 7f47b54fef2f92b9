#!/usr/bin/python3
"""Independent check of a `tansy convert` output: dequantise the MLX affine checkpoint with numpy and compute
float64 reference logits for a few token ids.

The dequantisation and the forward pass are shared/tools/np_reference.py's (imported, not copied): its MLX
reader unpacks the U32 words LSB-first and applies w = scale * q + bias per group, written independently of the
C++ loader. Besides the logits, the output records a checksum of every quantised tensor of the checkpoint, so a
C++ test can tell "the quantiser's output changed" (regenerate this file) from "the engine computes the same
weights differently" (a bug).

Usage (numpy only):
  python3 tools/dequant_reference.py --model CONVERTED_DIR --ids "1 2 3" --out GOLDEN.safetensors
  python3 tools/dequant_reference.py --model CONVERTED_DIR --ids-from REF.safetensors:prompt0.ids --out ...
NP_REFERENCE=dir overrides where np_reference.py is found (default ../shared/tools from the repository root).
"""
import argparse, json, os, struct, sys
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get('NP_REFERENCE', os.path.join(ROOT, '..', 'shared', 'tools')))
import np_reference as R  # noqa: E402


def checksum(raw):
    """sum over bytes of byte_i * (i % 65521 + 1), mod 2^64: position-sensitive, trivial to recompute in C++."""
    b = np.frombuffer(raw, np.uint8).astype(np.uint64)
    w = np.arange(len(b), dtype=np.uint64) % np.uint64(65521) + np.uint64(1)
    return int((b * w).sum(dtype=np.uint64))


def tensor_bytes(model_dir):
    """{name: raw bytes} of every tensor of every .safetensors file in model_dir."""
    out = {}
    for f in sorted(os.listdir(model_dir)):
        if not f.endswith('.safetensors'):
            continue
        with open(os.path.join(model_dir, f), 'rb') as fh:
            n = struct.unpack('<Q', fh.read(8))[0]
            header, blob = json.loads(fh.read(n)), fh.read()
        for name, info in header.items():
            if name != '__metadata__':
                a, b = info['data_offsets']
                out[name] = blob[a:b]
    return out


def write_safetensors(path, tensors, metadata):
    """tensors: {name: np.ndarray} (float32 / int32)."""
    kinds = {np.dtype('float32'): 'F32', np.dtype('int32'): 'I32'}
    header, blobs, off = {'__metadata__': metadata}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        raw = a.tobytes()
        header[name] = {'dtype': kinds[a.dtype], 'shape': list(a.shape), 'data_offsets': [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b' ' * ((8 - len(h) % 8) % 8)
    with open(path, 'wb') as f:
        f.write(struct.pack('<Q', len(h)) + h + b''.join(blobs))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--model', required=True, help='converted (MLX affine) checkpoint directory')
    ap.add_argument('--ids', help='token ids, space separated')
    ap.add_argument('--ids-from', help='FILE.safetensors:KEY holding int ids')
    ap.add_argument('--out', required=True)
    ap.add_argument('--note', default='', help='stored as metadata "note" (e.g. the convert command)')
    a = ap.parse_args()
    if bool(a.ids) == bool(a.ids_from):
        ap.error('give exactly one of --ids and --ids-from')
    if a.ids:
        ids = np.array([int(x) for x in a.ids.split()], np.int64)
    else:
        f, key = a.ids_from.rsplit(':', 1)
        ids = R.read_safetensors(f)[key][1].astype(np.int64)
    W = R.Weights(a.model)
    if W.kind != 'mlx':
        sys.exit(f'{a.model}: not an MLX affine checkpoint (layout {W.kind})')
    bad = [n for n in W.notes if n.startswith(('BITS', 'SHAPE', 'UNUSED', 'INDEX'))]
    if bad:
        sys.exit(f'{a.model}: {bad}')
    logits = R.Model(W).forward(ids)[0]
    raw = tensor_bytes(a.model)
    quantised = {n[:-len('.scales')] for n in raw if n.endswith('.scales')}
    sums = {n: str(checksum(b)) for n, b in sorted(raw.items()) if n.rsplit('.', 1)[0] in quantised}
    meta = {'checksums': json.dumps(sums, sort_keys=True), 'note': a.note,
            'quantization': json.dumps(W.quant, sort_keys=True)}
    write_safetensors(a.out, {'ids': ids.astype(np.int32), 'logits': logits.astype(np.float32)}, meta)
    print(f'{a.out}: logits {logits.shape}, checksums of {len(sums)} quantised tensors ({"; ".join(W.notes)})')


if __name__ == '__main__':
    main()
