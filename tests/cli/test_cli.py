# Tests of the `sparsa` command-line tool (docs/cli.md):
#   (a) `run` agrees with an independent numpy implementation of attention;
#   (b) bad inputs give exactly one error line naming the argument and a non-zero exit;
#   (c) `info`, `demo` and `bench` succeed and produce their table, JSON and SVG.
import json
import math
import struct
import subprocess
import xml.etree.ElementTree as ET

import numpy as np
import pytest


def run_cli(sparsa_bin, *args, cwd=None, timeout=600):
    return subprocess.run([sparsa_bin, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout)


# ---- an independent reference ------------------------------------------------------------

def reference_attention(q, k, v, scale=None, mask=None):
    """Softmax attention in float64. q [B, Hq, Lq, d], k/v [B, Hkv, Lk, d]; query head h reads
    kv head h // (Hq // Hkv). mask [B, Hq, Lq, Lk] (True = visible) or None. Returns (O, LSE);
    a query that sees no key gets O = 0, LSE = -inf."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    o = np.einsum("bhij,bhjd->bhid", p, v) / np.where(l > 0, l, 1.0)
    lse = np.where(l[..., 0] > 0, m_safe[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)), -np.inf)
    return o, lse


def assert_close(actual, expected, rel, what):
    # Relative to the largest reference entry: an element-wise rtol is meaningless for
    # outputs near zero, and a sum of n f32 products has error ~ n * eps * max term.
    actual = np.asarray(actual, dtype=np.float64)
    bound = rel * max(np.abs(expected).max(), 1e-30)
    err = np.abs(actual - expected).max()
    assert err <= bound, f"{what}: max |diff| {err:.3e} > {bound:.3e}"


def write_safetensors(path, tensors, metadata=None):
    """A .safetensors writer (format: 8-byte little-endian header length, JSON header, data)."""
    dtype_names = {np.dtype(np.int32): "I32", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
    header, blobs, offset = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        blob = array.tobytes()
        header[name] = {"dtype": dtype_names[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def random_qkv(rng, batch=2, heads_q=8, heads_kv=2, len_q=37, len_kv=113, head_dim=64, dtype=np.float32):
    q = rng.standard_normal((batch, heads_q, len_q, head_dim)).astype(dtype)
    k = rng.standard_normal((batch, heads_kv, len_kv, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, heads_kv, len_kv, head_dim)).astype(dtype)
    return q, k, v


def save_qkv(tmp_path, q, k, v):
    paths = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        p = tmp_path / f"{name}.npy"
        np.save(p, x)
        paths.append(p)
    return paths


# ---- (a) agreement with numpy ------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("backend", ["cpu", "cpu_ref"])
def test_dense_matches_numpy(sparsa_bin, tmp_path, head_dim, backend):
    rng = np.random.default_rng(1000 + head_dim)
    q, k, v = random_qkv(rng, head_dim=head_dim)  # GQA 8:2, Lq = 37 != Lk = 113
    qp, kp, vp = save_qkv(tmp_path, q, k, v)
    out, lse = tmp_path / "o.npy", tmp_path / "lse.npy"
    r = run_cli(sparsa_bin, "run", "--method", "dense", "--q", qp, "--k", kp, "--v", vp, "--out", out,
                "--lse", lse, "--backend", backend)
    assert r.returncode == 0, r.stderr
    o_ref, lse_ref = reference_attention(q, k, v)
    o, l = np.load(out), np.load(lse)
    assert o.dtype == np.float32 and o.shape == q.shape
    assert l.dtype == np.float32 and l.shape == q.shape[:3]
    # f32 accumulation over 113 keys and 128 dims: errors ~1e-6 of the largest entry.
    assert_close(o, o_ref, 1e-5, "O")
    assert_close(l, lse_ref, 1e-5, "LSE")


@pytest.mark.parametrize("mask,visible", [
    ("causal", lambda i, j: j <= i),
    ("block_causal(16)", lambda i, j: j // 16 <= i // 16),
    ("sliding_window:20,3", lambda i, j: (i - 20 <= j) & (j <= i + 3)),
])
@pytest.mark.parametrize("method", ["dense", "block_sparse"])
def test_mask_matches_numpy(sparsa_bin, tmp_path, mask, visible, method):
    rng = np.random.default_rng(77)
    q, k, v = random_qkv(rng)  # Lq = 37 < Lk = 113: queries at the end of the keys
    qp, kp, vp = save_qkv(tmp_path, q, k, v)
    out, lse = tmp_path / "o.npy", tmp_path / "lse.npy"
    extra = ["-P", "density=1", "-P", "block=16"] if method == "block_sparse" else []
    r = run_cli(sparsa_bin, "run", "--method", method, "--q", qp, "--k", kp, "--v", vp, "--out", out, "--lse", lse,
                "--mask", mask, *extra)
    assert r.returncode == 0, r.stderr
    i = np.arange(37)[:, None] + (113 - 37)
    j = np.arange(113)[None, :]
    o_ref, lse_ref = reference_attention(q, k, v, mask=np.broadcast_to(visible(i, j), (2, 8, 37, 113)))
    assert_close(np.load(out), o_ref, 1e-5, "O")
    assert_close(np.load(lse), lse_ref, 1e-5, "LSE")
    plain, _ = reference_attention(q, k, v)
    assert np.abs(np.load(out) - plain).max() > 1e-3  # the mask changed the answer


def test_dense_scale_and_safetensors_output(sparsa_bin, tmp_path):
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, batch=1, heads_q=4, heads_kv=4, len_q=17, len_kv=3)
    qp, kp, vp = save_qkv(tmp_path, q, k, v)
    out = tmp_path / "o.npy"
    r = run_cli(sparsa_bin, "run", "--method", "dense", "--q", qp, "--k", kp, "--v", vp, "--out", out,
                "--scale", "0.3", "--threads", "1", "--check-finite")
    assert r.returncode == 0, r.stderr
    o_ref, _ = reference_attention(q, k, v, scale=0.3)
    assert_close(np.load(out), o_ref, 1e-5, "O with --scale 0.3")


def full_index(batch, heads, nq, nkv):
    counts = np.full((batch, heads, nq), nkv, dtype=np.int32)
    indices = np.broadcast_to(np.arange(nkv, dtype=np.int32), (batch, heads, nq, nkv)).copy()
    return counts, indices


def test_block_sparse_index_file_matches_masked_numpy(sparsa_bin, tmp_path):
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, batch=1, heads_q=4, heads_kv=2, len_q=40, len_kv=50)
    qp, kp, vp = save_qkv(tmp_path, q, k, v)
    block_q, block_kv = 16, 8
    nq, nkv = math.ceil(40 / block_q), math.ceil(50 / block_kv)  # partial last blocks
    capacity = 4
    counts = rng.integers(0, capacity + 1, size=(1, 4, nq)).astype(np.int32)
    indices = np.zeros((1, 4, nq, capacity), dtype=np.int32)
    mask = np.zeros((1, 4, 40, 50), dtype=bool)
    for h in range(4):
        for qb in range(nq):
            chosen = np.sort(rng.choice(nkv, size=counts[0, h, qb], replace=False))
            indices[0, h, qb, :len(chosen)] = chosen
            for kb in chosen:
                mask[0, h, qb * block_q:(qb + 1) * block_q, kb * block_kv:(kb + 1) * block_kv] = True
    index = tmp_path / "index.safetensors"
    write_safetensors(index, {"counts": counts, "indices": indices},
                      metadata={"block_q": str(block_q), "block_kv": str(block_kv)})
    out, lse = tmp_path / "o.npy", tmp_path / "lse.npy"
    r = run_cli(sparsa_bin, "run", "--method", "block_sparse", "--index", index, "--q", qp, "--k", kp, "--v", vp,
                "--out", out, "--lse", lse)
    assert r.returncode == 0, r.stderr
    o_ref, lse_ref = reference_attention(q, k, v, mask=mask)
    assert_close(np.load(out), o_ref, 1e-5, "O")
    got_lse = np.load(lse)
    empty = ~mask.any(axis=-1)
    assert np.all(np.isneginf(got_lse[empty])), "rows that see no key must have LSE = -inf"
    assert_close(got_lse[~empty], lse_ref[~empty], 1e-5, "LSE")


def test_index_block_sizes_from_flags(sparsa_bin, tmp_path):
    # No __metadata__: -P block_q / block_kv give the sizes; a full plan equals dense.
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, batch=1, heads_q=2, heads_kv=1, len_q=33, len_kv=20)
    qp, kp, vp = save_qkv(tmp_path, q, k, v)
    counts, indices = full_index(1, 2, math.ceil(33 / 8), math.ceil(20 / 16))
    index = tmp_path / "full.safetensors"
    write_safetensors(index, {"counts": counts, "indices": indices})
    out = tmp_path / "o.npy"
    r = run_cli(sparsa_bin, "run", "--method", "block_sparse", "--index", index, "-P", "block_q=8", "-P", "block_kv=16",
                "--q", qp, "--k", kp, "--v", vp, "--out", out)
    assert r.returncode == 0, r.stderr
    assert_close(np.load(out), reference_attention(q, k, v)[0], 1e-5, "O")


def read_safetensors(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    dtypes = {"F32": np.float32, "F16": np.float16, "I32": np.int32}
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + a:8 + n + b], dtype=dtypes[e["dtype"]]).reshape(e["shape"])
    return out


def test_safetensors_inputs_and_outputs(sparsa_bin, tmp_path):
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, batch=1, heads_q=4, heads_kv=2, len_q=19, len_kv=23)
    qkv = tmp_path / "qkv.safetensors"
    write_safetensors(qkv, {"q": q, "k": k, "v": v})
    out, lse = tmp_path / "o.safetensors", tmp_path / "lse.safetensors"
    r = run_cli(sparsa_bin, "run", "--method", "dense", "--q", f"{qkv}:q", "--k", f"{qkv}:k", "--v", f"{qkv}:v",
                "--out", f"{out}:O", "--lse", lse)
    assert r.returncode == 0, r.stderr
    o_ref, lse_ref = reference_attention(q, k, v)
    o = read_safetensors(out)["O"]
    (l,) = read_safetensors(lse).values()
    assert_close(o, o_ref, 1e-5, "O")
    assert_close(l, lse_ref, 1e-5, "LSE")


def test_block_sparse_full_density_equals_dense(sparsa_bin, tmp_path):
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, batch=1, heads_q=2, heads_kv=1, len_q=70, len_kv=45)
    qp, kp, vp = save_qkv(tmp_path, q, k, v)
    out = tmp_path / "o.npy"
    r = run_cli(sparsa_bin, "run", "--method", "block_sparse", "-P", "density=1", "-P", "block=16",
                "--q", qp, "--k", kp, "--v", vp, "--out", out)
    assert r.returncode == 0, r.stderr
    assert "density 1.0000" in r.stdout
    assert_close(np.load(out), reference_attention(q, k, v)[0], 1e-5, "O")


def test_block_sparse_random_plan_is_seeded(sparsa_bin, tmp_path):
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, batch=1, heads_q=2, heads_kv=2, len_q=256, len_kv=256)
    qp, kp, vp = save_qkv(tmp_path, q, k, v)
    outs = []
    for i, seed in enumerate([1, 1, 2]):
        out = tmp_path / f"o{i}.npy"
        r = run_cli(sparsa_bin, "run", "--method", "block_sparse", "-P", "density=0.25", "-P", "block=32",
                    "-P", f"seed={seed}", "--q", qp, "--k", kp, "--v", vp, "--out", out)
        assert r.returncode == 0, r.stderr
        outs.append(np.load(out))
    assert np.array_equal(outs[0], outs[1]), "same seed, same plan"
    assert not np.array_equal(outs[0], outs[2]), "another seed, another plan"


# ---- (b) bad inputs ------------------------------------------------------------------------

def npy_bytes(array):
    import io
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


class Case:
    """Builds files in tmp_path and returns the argument list of one failing command."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.rng = np.random.default_rng(11)
        self.q, self.k, self.v = random_qkv(self.rng, batch=1, heads_q=4, heads_kv=2, len_q=32, len_kv=48)

    def save(self, name, array):
        p = self.tmp / name
        np.save(p, array)
        return p

    def raw(self, name, data):
        p = self.tmp / name
        p.write_bytes(data)
        return p

    def run_args(self, q=None, k=None, v=None, out=None, extra=(), method="dense"):
        q = q if q is not None else self.save("q.npy", self.q)
        k = k if k is not None else self.save("k.npy", self.k)
        v = v if v is not None else self.save("v.npy", self.v)
        out = out if out is not None else self.tmp / "o.npy"
        return ["run", "--method", method, "--q", q, "--k", k, "--v", v, "--out", out, *extra]

    def index(self, counts=None, indices=None, metadata=None, extra_tensors=None, **kw):
        nq, nkv = 2, 3  # 32 / 16 and 48 / 16
        c, i = full_index(1, 4, nq, nkv)
        tensors = {"counts": c if counts is None else counts, "indices": i if indices is None else indices}
        tensors.update(extra_tensors or {})
        p = self.tmp / "index.safetensors"
        write_safetensors(p, tensors, metadata={"block_q": "16", "block_kv": "16"} if metadata is None else metadata)
        return self.run_args(method="block_sparse", extra=["--index", p, *kw.get("extra", ())])


def lying_shape_npy(array):
    # Same header length, larger shape than the data holds.
    data = npy_bytes(array)
    old = str(array.shape).encode()
    new = str(tuple(array.shape[:-1]) + (array.shape[-1] + 1,)).encode()
    assert len(old) == len(new) or len(new) == len(old) + 0
    return data.replace(old, new, 1)


def _counts_over_capacity():
    c, _ = full_index(1, 4, 2, 3)
    c[0, 1, 1] = 4
    return c


def _unsorted():
    _, i = full_index(1, 4, 2, 3)
    i[0, 2, 0] = [2, 0, 1]
    return i


def _out_of_range():
    _, i = full_index(1, 4, 2, 3)
    i[0, 0, 1, 2] = 3
    return i


# (name, builder(case) -> args, text the error line must contain, expected exit code)
BAD_INPUTS = [
    ("wrong rank", lambda c: c.run_args(q=c.save("q3.npy", c.q[0])), "q: expected 4 dimensions", 1),
    ("mismatched head_dim", lambda c: c.run_args(k=c.save("k32.npy", c.k[..., :32])), "k: head_dim", 1),
    ("GQA ratio not integer", lambda c: c.run_args(k=c.save("k3.npy", np.concatenate([c.k, c.k[:, :1]], 1)),
                                                   v=c.save("v3.npy", np.concatenate([c.v, c.v[:, :1]], 1))),
     "heads_kv", 1),
    ("batch mismatch", lambda c: c.run_args(k=c.save("k2.npy", np.concatenate([c.k, c.k], 0))), "k: batch", 1),
    ("v shape differs from k", lambda c: c.run_args(v=c.save("v2.npy", c.v[:, :, :40])), "v: expected shape", 1),
    ("dtype mismatch f16 q, f32 k", lambda c: c.run_args(q=c.save("q16.npy", c.q.astype(np.float16))), "k: dtype", 1),
    ("f64 npy", lambda c: c.run_args(q=c.save("q64.npy", c.q.astype(np.float64))), "--q", 1),
    ("i32 tensor as q", lambda c: c.run_args(q=c.save("qi.npy", c.q.astype(np.int32))), "q: expected dtype", 1),
    ("zero-length sequence", lambda c: c.run_args(q=c.save("q0.npy", c.q[:, :, :0])), "q: empty tensor of shape [1, 4, 0, 64]", 1),
    ("NaN with --check-finite", lambda c: c.run_args(v=c.save("vnan.npy", np.where(np.arange(64) == 5, np.nan, c.v)
                                                              .astype(np.float32)), extra=["--check-finite"]),
     "v: contains NaN", 1),
    ("Inf with --check-finite", lambda c: c.run_args(q=c.save("qinf.npy", np.full_like(c.q, np.inf)),
                                                     extra=["--check-finite"]), "q: contains Inf", 1),
    ("scale zero", lambda c: c.run_args(extra=["--scale=0"]), "--scale", 2),
    ("scale negative", lambda c: c.run_args(extra=["--scale=-1"]), "--scale", 2),
    ("scale nan", lambda c: c.run_args(extra=["--scale=nan"]), "--scale", 2),
    ("scale not a number", lambda c: c.run_args(extra=["--scale", "abc"]), "--scale", 2),
    ("unknown method", lambda c: c.run_args(method="denes"), "--method: unknown method 'denes'", 2),
    ("unknown -P key", lambda c: c.run_args(method="block_sparse", extra=["-P", "denstiy=0.1"]),
     "params: unknown key 'denstiy'", 2),
    ("-P key for dense", lambda c: c.run_args(extra=["-P", "block=64"]), "params: unknown key 'block'", 2),
    ("-P without =", lambda c: c.run_args(method="block_sparse", extra=["-P", "density"]), "-P: expected key=value", 2),
    ("-P key twice", lambda c: c.run_args(method="block_sparse", extra=["-P", "block=16", "-P", "block=32"]),
     "-P: key 'block'", 2),
    ("density 0", lambda c: c.run_args(method="block_sparse", extra=["-P", "density=0"]), "params: density", 2),
    ("density 1.5", lambda c: c.run_args(method="block_sparse", extra=["-P", "density=1.5"]), "params: density", 2),
    ("density -1", lambda c: c.run_args(method="block_sparse", extra=["-P", "density=-1"]), "params: density", 2),
    ("density text", lambda c: c.run_args(method="block_sparse", extra=["-P", "density=lots"]), "params: density", 2),
    ("block 0", lambda c: c.run_args(method="block_sparse", extra=["-P", "block=0"]), "params: block", 2),
    ("block -3", lambda c: c.run_args(method="block_sparse", extra=["-P", "block=-3"]), "params: block", 2),
    ("block 2.5", lambda c: c.run_args(method="block_sparse", extra=["-P", "block=2.5"]), "params: block", 2),
    ("seed negative", lambda c: c.run_args(method="block_sparse", extra=["-P", "seed=-2"]), "params: seed", 2),
    ("index out of range", lambda c: c.index(indices=_out_of_range()), "index.indices[0, 0, 1, 2]", 1),
    ("counts over capacity", lambda c: c.index(counts=_counts_over_capacity()), "index.counts[0, 1, 1]", 1),
    ("unsorted indices", lambda c: c.index(indices=_unsorted()), "strictly ascending", 1),
    ("index with wrong num_q_blocks", lambda c: c.index(metadata={"block_q": "8", "block_kv": "16"}),
     "index.num_q_blocks", 1),
    ("index without block sizes", lambda c: c.index(metadata={}), "block sizes unknown", 1),
    ("index block size not a number", lambda c: c.index(metadata={"block_q": "x", "block_kv": "16"}),
     "__metadata__ block_q", 1),
    ("index f32 counts", lambda c: c.index(counts=full_index(1, 4, 2, 3)[0].astype(np.float32)),
     "index.counts: expected dtype i32", 1),
    ("index unknown entry", lambda c: c.index(extra_tensors={"perm_kw": np.zeros((1, 2, 48), np.int32)}),
     "unknown entry 'perm_kw'", 1),
    ("perm_q not a permutation", lambda c: c.index(extra_tensors={"perm_q": np.zeros((1, 4, 32), np.int32)}),
     "index.perm_q", 1),
    ("index and density together", lambda c: c.index(extra=["-P", "density=0.5"]), "params: density and seed", 2),
    ("index with dense", lambda c: c.run_args(extra=["--index", c.tmp / "none.safetensors"]),
     "params: unknown key 'index'", 2),
    ("index file missing", lambda c: c.run_args(method="block_sparse", extra=["--index", c.tmp / "none.safetensors"]),
     "index", 1),
    ("index file not .safetensors", lambda c: c.run_args(method="block_sparse", extra=["--index", c.tmp / "q.npy"]),
     "params: index: expected a .safetensors", 2),
    ("index file garbage", lambda c: c.run_args(method="block_sparse",
                                                extra=["--index", c.raw("bad.safetensors", b"\xff" * 20)]),
     "index", 1),
    ("truncated npy", lambda c: c.run_args(k=c.raw("kt.npy", npy_bytes(c.k)[:-10])), "--k", 1),
    ("npy bad magic", lambda c: c.run_args(v=c.raw("vm.npy", b"XNUMPY" + npy_bytes(c.v)[6:])), "--v", 1),
    ("npy lying shape", lambda c: c.run_args(q=c.raw("ql.npy", lying_shape_npy(c.q))), "--q", 1),
    ("npy empty file", lambda c: c.run_args(q=c.raw("qe.npy", b"")), "--q", 1),
    ("missing file", lambda c: c.run_args(v=c.tmp / "does_not_exist.npy"), "--v", 1),
    ("file name with a newline", lambda c: c.run_args(k=c.tmp / "no\nsuch.npy"), "--k", 1),
    ("unwritable --out (no such directory)", lambda c: c.run_args(out=c.tmp / "no_dir" / "o.npy"), "--out", 1),
    ("--out is a directory", lambda c: c.run_args(out=c.tmp), "--out", 2),
    ("--out with unknown extension", lambda c: c.run_args(out=c.tmp / "o.txt"), "--out", 2),
    ("--lse equals --out", lambda c: c.run_args(extra=["--lse", c.tmp / "o.npy"]), "--lse", 2),
    ("bad backend", lambda c: c.run_args(extra=["--backend", "gpu"]), "--backend", 2),
    ("negative threads", lambda c: c.run_args(extra=["--threads=-1"]), "--threads", 2),
    ("missing --out", lambda c: c.run_args()[:-2], "--out", 2),
    ("unknown flag", lambda c: c.run_args(extra=["--frobnicate"]), "--frobnicate", 2),
    ("no subcommand", lambda c: [], "subcommand", 2),
    ("unknown subcommand", lambda c: ["explode"], "explode", 2),
    ("bench bad length", lambda c: ["bench", "--lengths", "256,0"], "--lengths", 2),
    ("bench unknown method", lambda c: ["bench", "--methods", "dense,nope"], "--methods", 2),
    ("bench bad heads", lambda c: ["bench", "--heads", "0"], "--heads", 2),
    ("bench -P unknown method", lambda c: ["bench", "-P", "nope.density=0.1"], "-P", 2),
    ("bench -P bad value", lambda c: ["bench", "--lengths", "64", "-P", "block_sparse.density=2"],
     "params: density", 2),
    ("bench plot extension", lambda c: ["bench", "--plot", c.tmp / "p.png"], "--plot", 2),
    ("demo bad length", lambda c: ["demo", "--length", "0"], "--length", 2),
    ("demo unwritable plot", lambda c: ["demo", "--length", "64", "--plot", c.tmp / "no_dir" / "d.svg"], "--plot", 1),
    ("bad mask", lambda c: c.run_args(extra=["--mask", "causl"]), "--mask", 2),
    ("mask block 0", lambda c: c.run_args(extra=["--mask", "block_causal(0)"]), "--mask", 2),
    ("mask on llsa", lambda c: c.run_args(method="llsa", extra=["--mask", "causal"]), "--mask: method llsa", 2),
]


@pytest.mark.parametrize("name,build,needle,code", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gives_one_error_line(sparsa_bin, tmp_path, name, build, needle, code):
    args = build(Case(tmp_path))
    r = run_cli(sparsa_bin, *args, cwd=tmp_path, timeout=120)
    lines = r.stderr.splitlines()
    assert r.returncode == code, f"exit {r.returncode}, stderr: {r.stderr!r}"
    assert len(lines) == 1, f"expected one stderr line, got {lines!r}"
    assert lines[0].startswith("sparsa: error: "), lines[0]
    assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert not (tmp_path / "o.npy").exists(), "no output may be written on failure"


def test_at_least_twenty_distinct_bad_inputs():
    assert len({c[0] for c in BAD_INPUTS}) >= 20


# ---- (c) info, demo, bench -------------------------------------------------------------------

def test_info(sparsa_bin):
    r = run_cli(sparsa_bin, "info")
    assert r.returncode == 0, r.stderr
    for needle in ("sparsa ", "backends:", "cpu_ref", "cores:", "isa:", "gpu:", "methods:", "dense", "block_sparse"):
        assert needle in r.stdout
    j = json.loads(run_cli(sparsa_bin, "info", "--json").stdout)
    names = [m["name"] for m in j["methods"]]
    assert names[0] == "dense" and "block_sparse" in names
    assert {b["name"] for b in j["backends"]} == {"cpu_ref", "cpu", "cuda"}
    assert j["cpu"]["logical_cores"] >= 1


def parse_table(stdout, first_header):
    lines = stdout.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(first_header))
    header, rule = lines[start], lines[start + 1]
    assert set(rule) == {"-"}
    rows = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        rows.append(line)
    return header, rule, rows


def check_svg(path):
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    return root


def test_demo_small(sparsa_bin, tmp_path):
    r = run_cli(sparsa_bin, "demo", "--length", "512", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    header, rule, rows = parse_table(r.stdout, "method")
    names = [row.split()[0] for row in rows]
    assert names[0] == "dense" and "block_sparse" in names
    # Aligned: every row ends where the header's last column ends.
    assert all(len(row) == len(header) for row in rows), rows
    cols = header.split()
    dense = dict(zip(cols, rows[0].split()[:1] + rows[0].split()[-(len(cols) - 1):]))
    assert float(dense["rel_err"]) == 0.0 and float(dense["density"]) == 1.0
    root = check_svg(tmp_path / "demo.svg")  # the default plot path
    assert len([e for e in root.iter() if e.tag.endswith("rect")]) >= 1 + 2 * 2  # background, frames, bars
    assert "demo: [1/" in r.stderr  # progress lines

    r = run_cli(sparsa_bin, "demo", "--length", "300", "--json", "--plot", tmp_path / "d2.svg",
                "-P", "block_sparse.density=0.5", "-P", "block_sparse.block=32")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    results = {x["method"]: x for x in j["results"]}
    assert results["dense"]["rel_error"] == 0.0
    bs = results["block_sparse"]
    assert bs["params"] == {"block": 32, "density": 0.5}
    assert 0.4 < bs["density"] < 0.7  # 5 of 10 key blocks, the last one partial
    assert 0 < bs["rel_error"] < 1 and bs["max_lse_diff"] > 0
    check_svg(tmp_path / "d2.svg")


def test_bench_json_and_plot(sparsa_bin, tmp_path):
    out_json, out_svg = tmp_path / "bench.json", tmp_path / "bench.svg"
    r = run_cli(sparsa_bin, "bench", "--lengths", "256,512", "--repeats", "2", "--json", out_json, "--plot", out_svg)
    assert r.returncode == 0, r.stderr
    header, _, rows = parse_table(r.stdout, "method")
    assert len(rows) == 2 * len(json.loads(run_cli(sparsa_bin, "info", "--json").stdout)["methods"])
    assert all(len(row) == len(header) for row in rows)
    j = json.loads(out_json.read_text())
    cells = {(x["method"], x["length"]): x for x in j["results"]}
    for length in (256, 512):
        d = cells[("dense", length)]
        assert d["speedup_vs_dense"] == pytest.approx(1.0) and d["density"] == 1.0
        assert d["gflops_effective"] == pytest.approx(d["gflops_actual"])
        assert len(d["seconds"]) == 2 and d["median_s"] > 0
        b = cells[("block_sparse", length)]
        assert 0 < b["density"] < 1
        assert b["gflops_effective"] > b["gflops_actual"]
        # effective = dense FLOPs / time: 4 * heads * L^2 * d
        flops = 4 * j["heads_q"] * length * length * j["head_dim"]
        assert b["gflops_effective"] == pytest.approx(flops / b["median_s"] / 1e9, rel=1e-6)
    root = check_svg(out_svg)
    polylines = [e for e in root.iter() if e.tag.endswith("polyline")]
    assert len(polylines) == len({m for m, _ in cells})
    texts = "".join(e.text or "" for e in root.iter() if e.tag.endswith("text"))
    assert "dense" in texts and "block_sparse" in texts and "sequence length" in texts
    assert "bench: [1/" in r.stderr


# ---- no crash on any input -----------------------------------------------------------------

def test_fuzzed_files_and_flags_never_crash(sparsa_bin, tmp_path):
    """Seeded mutations of valid files and command lines: every outcome is exit 0, or exit
    1/2 with exactly one error line; never a signal, a hang or a second line."""
    rng = np.random.default_rng(2024)
    q, k, v = random_qkv(rng, batch=1, heads_q=2, heads_kv=1, len_q=8, len_kv=8, head_dim=8)
    good = {name: npy_bytes(x) for name, x in (("q", q), ("k", k), ("v", v))}
    counts, indices = full_index(1, 2, 2, 2)
    write_safetensors(tmp_path / "index_good.safetensors", {"counts": counts, "indices": indices},
                      metadata={"block_q": "4", "block_kv": "4"})
    index_good = (tmp_path / "index_good.safetensors").read_bytes()
    flags = [["--scale", "1e-40"], ["--scale", "-0"], ["--threads", "3"], ["--backend", "cpu_ref"],
             ["--check-finite"], ["-P", "block=3"], ["-P", "density=1e-9"], ["-P", "seed=99999999999999999999"],
             ["-P", "block=99999999999"], ["-P", "=1"], ["-P", "block_q=4"], ["-P", "block_kv=1"], ["--lse", "l.npy"]]

    def mutate(data):
        data = bytearray(data)
        kind = rng.integers(0, 4)
        if kind == 0 and len(data) > 1:  # truncate
            return bytes(data[:rng.integers(0, len(data))])
        if kind == 1:  # flip bytes, often in the header
            for _ in range(rng.integers(1, 6)):
                pos = rng.integers(0, min(len(data), 140) if rng.random() < 0.7 else len(data))
                data[pos] = rng.integers(0, 256)
            return bytes(data)
        if kind == 2:  # append garbage
            return bytes(data) + rng.bytes(int(rng.integers(1, 64)))
        return bytes(data)

    for case in range(120):
        files = {}
        for name in ("q", "k", "v"):
            blob = mutate(good[name]) if rng.random() < 0.4 else good[name]
            files[name] = tmp_path / f"{name}{case}.npy"
            files[name].write_bytes(blob)
        method = "block_sparse" if rng.random() < 0.5 else "dense"
        args = ["run", "--method", method, "--q", files["q"], "--k", files["k"], "--v", files["v"],
                "--out", tmp_path / f"o{case}.npy"]
        if method == "block_sparse" and rng.random() < 0.5:
            idx = tmp_path / f"index{case}.safetensors"
            idx.write_bytes(mutate(index_good))
            args += ["--index", idx]
        for _ in range(rng.integers(0, 3)):
            args += flags[rng.integers(0, len(flags))]
        r = run_cli(sparsa_bin, *args, cwd=tmp_path, timeout=60)
        assert r.returncode in (0, 1, 2), f"case {case}: exit {r.returncode} for {args}: {r.stderr!r}"
        if r.returncode != 0:
            lines = r.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith("sparsa: error: "), f"case {case}: {args}: {r.stderr!r}"
