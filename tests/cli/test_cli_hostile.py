# The CLI against hostile inputs (issue 14): every case gives exactly one error line that
# names the flag (and the file), a non-zero exit, no crash, no lost or replaced file, and
# no output left behind; or, where an answer exists, the reference's answer.
#   - malformed headers (deep nesting, numbers beyond a double, bad UTF-8, long or nested
#     values) as --q (.safetensors and .npy) and as --index;
#   - outputs that alias an input or each other, by file identity;
#   - failed writes (a file-size limit standing in for a full disk): old files kept;
#   - logits that overflow f32 (the cpu backend must give cpu_ref's answer, or both refuse);
#   - bounds on flags (--length of plan/eval, --threads, --scale).
import hashlib
import json
import os
import resource
import signal
import struct

import numpy as np
import pytest

from test_cli import full_index, npy_bytes, random_qkv, reference_attention, run_cli, write_safetensors


def st_bytes(header_text, data=b""):
    """A .safetensors file from raw header text (bytes) and data."""
    return struct.pack("<Q", len(header_text)) + header_text + data


ENTRY_OK = b'"dtype": "F32", "shape": [1, 1, 2, 4], "data_offsets": [0, 32]'
DATA = b"\x00" * 32


def deep(n, open_="[", close="]"):
    return (open_ * n + close * n).encode()


def entry(body):
    return b'{"t": {' + body + b"}}"


# (name, header bytes, fragment of the error line). Each header is tried as --q and as --index.
HEADERS = []
for depth in (33, 1000, 100000):
    d = deep(depth)
    HEADERS += [
        (f"deep {depth} earlier member", b'{"a": ' + d + b", " + ENTRY_OK.join([b'"t": {', b"}"]) + b"}",
         "nests deeper than 32 levels"),
        (f"deep {depth} dtype", entry(b'"dtype": ' + d + b', "shape": [1, 1, 2, 4], "data_offsets": [0, 32]'),
         "nests deeper than 32 levels"),
        (f"deep {depth} shape", entry(b'"dtype": "F32", "shape": ' + d + b', "data_offsets": [0, 32]'),
         "nests deeper than 32 levels"),
        (f"deep {depth} offsets", entry(b'"dtype": "F32", "shape": [1, 1, 2, 4], "data_offsets": ' + d),
         "nests deeper than 32 levels"),
        (f"deep {depth} metadata", b'{"__metadata__": {"block_q": ' + d + b"}, " +
         ENTRY_OK.join([b'"t": {', b"}"]) + b"}", "nests deeper than 32 levels"),
        (f"deep {depth} objects", b'{"a": ' + b'{"b": ' * depth + b"1" + b"}" * depth + b"}",
         "nests deeper than 32 levels"),
        (f"deep {depth} unclosed", b'{"a": ' + b"[" * depth, "nests deeper than 32 levels"),
    ]
for number in (b"1e400", b"-1e400", b"1e99999", b"9" * 400, b"1.5e309"):
    label = number[:12].decode()
    HEADERS += [
        (f"{label} in shape", entry(b'"dtype": "F32", "shape": [1, 1, 2, ' + number + b'], "data_offsets": [0, 32]'),
         "expected a number that fits a double"),
        (f"{label} in offsets", entry(b'"dtype": "F32", "shape": [1, 1, 2, 4], "data_offsets": [0, ' + number + b"]"),
         "'data_offsets'"),
        (f"{label} as dtype", entry(b'"dtype": ' + number + b', "shape": [1, 1, 2, 4], "data_offsets": [0, 32]'),
         "'dtype'"),
        (f"{label} in metadata", b'{"__metadata__": {"block_q": ' + number + b"}, " +
         ENTRY_OK.join([b'"t": {', b"}"]) + b"}", "'__metadata__' > 'block_q'"),
        (f"{label} as a member", b'{"x": ' + number + b", " + ENTRY_OK.join([b'"t": {', b"}"]) + b"}", "'x'"),
    ]
HEADERS += [
    ("bad utf-8 in dtype list", entry(b'"dtype": ["\xff"], "shape": [1, 1, 2, 4], "data_offsets": [0, 32]'),
     "bad JSON header"),
    ("bad utf-8 dtype", entry(b'"dtype": "F\xc3", "shape": [1, 1, 2, 4], "data_offsets": [0, 32]'), "bad JSON header"),
    ("bad utf-8 key", b'{"\xfe": {' + ENTRY_OK + b"}}", "bad JSON header"),
    ("nested dtype", entry(b'"dtype": [[[[1]]]], "shape": [1, 1, 2, 4], "data_offsets": [0, 32]'),
     "'dtype' is not a string: [[[[1]]]]"),
    ("long dtype list", entry(b'"dtype": [' + b", ".join(b"%d" % i for i in range(5000)) +
                              b'], "shape": [1, 1, 2, 4], "data_offsets": [0, 32]'), "..."),
    ("long dtype string", entry(b'"dtype": "' + b"F" * 100000 + b'", "shape": [1, 1, 2, 4], "data_offsets": [0, 32]'),
     "unknown dtype"),
    ("shape an object", entry(b'"dtype": "F32", "shape": {"a": 1}, "data_offsets": [0, 32]'), "'shape' is not a list"),
    ("shape a string", entry(b'"dtype": "F32", "shape": "1,1,2,4", "data_offsets": [0, 32]'), "'shape' is not a list"),
    ("shape of floats", entry(b'"dtype": "F32", "shape": [1.0, 1, 2, 4], "data_offsets": [0, 32]'), "not an integer"),
    ("shape of bools", entry(b'"dtype": "F32", "shape": [true, 1, 2, 4], "data_offsets": [0, 32]'), "not an integer"),
    ("shape with null", entry(b'"dtype": "F32", "shape": [null, 1, 2, 4], "data_offsets": [0, 32]'), "not an integer"),
    ("offsets nested", entry(b'"dtype": "F32", "shape": [1, 1, 2, 4], "data_offsets": [[0], [32]]'), "not an integer"),
    ("offsets of three", entry(b'"dtype": "F32", "shape": [1, 1, 2, 4], "data_offsets": [0, 16, 32]'), "not a pair"),
    ("offsets an object", entry(b'"dtype": "F32", "shape": [1, 1, 2, 4], "data_offsets": {"a": 0}'), "not a pair"),
    ("NaN literal", entry(b'"dtype": "F32", "shape": [NaN], "data_offsets": [0, 32]'), "bad JSON header"),
    ("Infinity literal", entry(b'"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 32]'), "bad JSON header"),
    ("comment", b"{/* x */" + ENTRY_OK.join([b'"t": {', b"}"]) + b"}", "bad JSON header"),
    ("nul in header", b'{"t": {"dtype": "F3\x002", "shape": [1, 1, 2, 4], "data_offsets": [0, 32]}}', "bad JSON header"),
    ("entry is null", b'{"t": null}', "expected an object"),
    ("entry is a number", b'{"t": 1e400}', "fits a double"),
    ("missing dtype", entry(b'"shape": [1, 1, 2, 4], "data_offsets": [0, 32]'), "missing key 'dtype'"),
    ("duplicate deep key", b'{"t": {' + ENTRY_OK + b', "dtype": "F32"}}', "duplicate key 'dtype'"),
]


def _write(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _qkv_files(tmp_path):
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, batch=1, heads_q=1, heads_kv=1, len_q=2, len_kv=2, head_dim=4)
    paths = []
    for name, a in (("q", q), ("k", k), ("v", v)):
        p = tmp_path / f"{name}.npy"
        np.save(p, a)
        paths.append(p)
    return paths


def _one_error_line(r, code, *needles):
    lines = r.stderr.splitlines()
    assert r.returncode == code, f"exit {r.returncode} (want {code}), stderr: {r.stderr[:2000]!r}"
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}: {r.stderr[:2000]!r}"
    assert lines[0].startswith("sparsa: error: "), lines[0][:500]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0][:2000]!r}"
    assert "internal error" not in lines[0]
    return lines[0]


@pytest.mark.parametrize("name,header,needle", HEADERS, ids=[h[0] for h in HEADERS])
def test_malformed_header_as_input(sparsa_bin, tmp_path, name, header, needle):
    qp, kp, vp = _qkv_files(tmp_path)
    bad = _write(tmp_path, "bad.safetensors", st_bytes(header, DATA))
    r = run_cli(sparsa_bin, "run", "--method", "dense", "--q", bad, "--k", kp, "--v", vp, "--out", tmp_path / "o.npy",
                timeout=120)
    _one_error_line(r, 1, "--q: ", str(bad), needle)
    assert not (tmp_path / "o.npy").exists()


@pytest.mark.parametrize("name,header,needle", HEADERS, ids=[h[0] for h in HEADERS])
def test_malformed_header_as_index(sparsa_bin, tmp_path, name, header, needle):
    qp, kp, vp = _qkv_files(tmp_path)
    bad = _write(tmp_path, "index.safetensors", st_bytes(header, DATA))
    r = run_cli(sparsa_bin, "run", "--method", "block_sparse", "--q", qp, "--k", kp, "--v", vp, "--index", bad,
                "-P", "block=16", "--out", tmp_path / "o.npy", timeout=120)
    _one_error_line(r, 1, "index: ", str(bad), needle)
    assert not (tmp_path / "o.npy").exists()


def test_at_least_sixty_distinct_malformed_headers():
    assert len({h[0] for h in HEADERS}) >= 60  # each is run twice: as --q and as --index


NPY_HEADERS = [
    ("deep tuple", "{'descr': '<f4', 'fortran_order': False, 'shape': " + "(" * 5000 + ")" * 5000 + ", }",
     "nests deeper"),
    ("deep list value", "{'descr': [" * 1 + "[" * 3000 + "]" * 3000 + "], 'fortran_order': False, 'shape': (1,), }",
     "nests deeper"),
    ("deep dict", "{'x': " + "{'a': " * 3000 + "1" + "}" * 3000 + "}", "nests deeper"),
    ("int beyond int64", "{'descr': '<f4', 'fortran_order': False, 'shape': (" + "9" * 400 + ",), }", "int64"),
    ("float dim 1e400", "{'descr': '<f4', 'fortran_order': False, 'shape': (1e400,), }", "not an integer"),
    ("bad utf-8 descr", "{'descr': '<\udcff4', 'fortran_order': False, 'shape': (1,), }", "dtype"),
]


@pytest.mark.parametrize("name,header,needle", NPY_HEADERS, ids=[h[0] for h in NPY_HEADERS])
def test_malformed_npy_header(sparsa_bin, tmp_path, name, header, needle):
    qp, kp, vp = _qkv_files(tmp_path)
    text = header.encode("utf-8", "surrogateescape") + b"\n"
    data = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + b"\x00" * 32
    bad = _write(tmp_path, "bad.npy", data)
    r = run_cli(sparsa_bin, "run", "--method", "dense", "--q", bad, "--k", kp, "--v", vp, "--out", tmp_path / "o.npy",
                timeout=120)
    line = _one_error_line(r, 1, "--q: ", str(bad))
    assert needle in line, line[:500]


def test_index_naming_a_directory(sparsa_bin, tmp_path):
    qp, kp, vp = _qkv_files(tmp_path)
    d = tmp_path / "plan.safetensors"
    d.mkdir()
    r = run_cli(sparsa_bin, "run", "--method", "block_sparse", "--q", qp, "--k", kp, "--v", vp, "--index", d,
                "--out", tmp_path / "o.npy")
    _one_error_line(r, 1, "is a directory, expected a .safetensors index file")


# ---- outputs that alias inputs or each other --------------------------------------------------

def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Files:
    def __init__(self, tmp_path):
        self.tmp = tmp_path
        rng = np.random.default_rng(9)
        self.q, self.k, self.v = random_qkv(rng, batch=1, heads_q=2, heads_kv=1, len_q=16, len_kv=16, head_dim=8)
        self.qp, self.kp, self.vp = (tmp_path / f"{n}.npy" for n in "qkv")
        for p, a in ((self.qp, self.q), (self.kp, self.k), (self.vp, self.v)):
            np.save(p, a)
        write_safetensors(tmp_path / "qkv.safetensors", {"q": self.q, "k": self.k, "v": self.v})
        c, i = full_index(1, 2, 1, 1)
        write_safetensors(tmp_path / "index.safetensors", {"counts": c, "indices": i},
                          metadata={"block_q": "16", "block_kv": "16"})
        os.symlink(self.qp, tmp_path / "q_link.npy")
        os.link(self.kp, tmp_path / "k_hard.npy")
        (tmp_path / "sub").mkdir()


# (name, extra args replacing/adding flags, fragment). Flags: q/k/v/out/lse/method/index.
ALIASES = [
    ("out is q", dict(out="q.npy"), "--out: 'q.npy' is the same file as the input --q"),
    ("out is ./q", dict(out="./q.npy"), "the same file as the input --q"),
    ("out is sub/../k", dict(out="sub/../k.npy"), "the same file as the input --k"),
    ("out is absolute v", dict(out="{tmp}/v.npy"), "the same file as the input --v"),
    ("out is a symlink to q", dict(out="q_link.npy"), "the same file as the input --q"),
    ("q given through a symlink, out is q", dict(q="q_link.npy", out="q.npy"), "the same file as the input --q"),
    ("out is a hard link to k", dict(out="k_hard.npy"), "the same file as the input --k"),
    ("lse is q", dict(lse="q.npy"), "--lse: 'q.npy' is the same file as the input --q"),
    ("lse is ./v", dict(lse="./v.npy"), "the same file as the input --v"),
    ("lse is a symlink to q", dict(lse="q_link.npy"), "the same file as the input --q"),
    ("lse equals out", dict(out="o.npy", lse="o.npy"), "--lse: 'o.npy' is the same file as --out"),
    ("lse is ./out", dict(out="./o.npy", lse="o.npy"), "the same file as --out"),
    ("lse is sub/../out", dict(out="o.npy", lse="sub/../o.npy"), "the same file as --out"),
    ("out and lse one safetensors file, no names", dict(out="r.safetensors", lse="r.safetensors"),
     "the same file as --out"),
    ("out and lse the same entry", dict(out="r.safetensors:x", lse="./r.safetensors:x"), "the same file as --out"),
    ("out named, lse unnamed", dict(out="r.safetensors:o", lse="r.safetensors"), "the same file as --out"),
    ("out into the inputs' safetensors file", dict(q="qkv.safetensors:q", k="qkv.safetensors:k",
                                                   v="qkv.safetensors:v", out="qkv.safetensors:o"),
     "the same file as the input --q"),
    ("lse into the inputs' safetensors file", dict(q="qkv.safetensors:q", lse="./qkv.safetensors:lse"),
     "the same file as the input --q"),
    ("out is the index file", dict(method="block_sparse", index="index.safetensors", out="index.safetensors"),
     "the same file as the input --index"),
    ("lse is the index file", dict(method="block_sparse", index="index.safetensors", lse="./index.safetensors"),
     "the same file as the input --index"),
    ("out is the -P index file", dict(method="block_sparse", P="index=index.safetensors", out="index.safetensors"),
     "the same file as the input -P index"),
]


def _run_args(f, spec):
    s = {"q": "q.npy", "k": "k.npy", "v": "v.npy", "out": "o.npy", "method": "dense"}
    s.update({key: value.format(tmp=f.tmp) for key, value in spec.items()})
    args = ["run", "--method", s["method"], "--q", s["q"], "--k", s["k"], "--v", s["v"], "--out", s["out"]]
    if "lse" in s:
        args += ["--lse", s["lse"]]
    if "index" in s:
        args += ["--index", s["index"]]
    if "P" in s:
        args += ["-P", s["P"]]
    return args


@pytest.mark.parametrize("name,spec,needle", ALIASES, ids=[a[0] for a in ALIASES])
def test_aliased_outputs_are_refused_and_nothing_changes(sparsa_bin, tmp_path, name, spec, needle):
    f = Files(tmp_path)
    before = {p.name: _digest(p) for p in tmp_path.iterdir() if p.is_file()}
    r = run_cli(sparsa_bin, *_run_args(f, spec), cwd=tmp_path)
    _one_error_line(r, 2, needle)
    after = {p.name: _digest(p) for p in tmp_path.iterdir() if p.is_file()}
    assert after == before, "a file was created, changed or removed"
    assert os.path.islink(tmp_path / "q_link.npy")


def test_two_entries_of_one_safetensors_file_are_written_together(sparsa_bin, tmp_path):
    f = Files(tmp_path)
    r = run_cli(sparsa_bin, *_run_args(f, dict(out="r.safetensors:o", lse="./r.safetensors:lse")), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    from test_cli import read_safetensors
    entries = read_safetensors(tmp_path / "r.safetensors")
    assert set(entries) == {"o", "lse"}
    o_ref, lse_ref = reference_attention(f.q, f.k, f.v)
    assert np.abs(entries["o"] - o_ref).max() <= 1e-5 * np.abs(o_ref).max()  # the f32 bound of test_cli
    assert np.abs(entries["lse"] - lse_ref).max() <= 1e-5 * max(1.0, np.abs(lse_ref).max())


def test_output_through_a_symlink_replaces_the_target_not_the_link(sparsa_bin, tmp_path):
    f = Files(tmp_path)
    target = tmp_path / "sub" / "o.npy"
    np.save(target, np.zeros(3, np.float32))
    os.symlink(target, tmp_path / "o_link.npy")
    r = run_cli(sparsa_bin, *_run_args(f, dict(out="o_link.npy")), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert os.path.islink(tmp_path / "o_link.npy")
    assert np.load(target).shape == f.q.shape


# ---- failed writes keep what was there -----------------------------------------------------

def _limit_file_size(limit):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def _run_limited(sparsa_bin, args, cwd, limit):
    import subprocess
    return subprocess.run([sparsa_bin, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120,
                          preexec_fn=_limit_file_size(limit))


@pytest.mark.parametrize("which", ["out", "lse", "both"])
def test_failed_write_keeps_existing_outputs(sparsa_bin, tmp_path, which):
    # f16, head_dim 1: O is 2 bytes per row and LSE 4, so a size limit between them fails
    # only the LSE write (after O was written), and a limit below both fails O first.
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 1, 4096, 1)).astype(np.float16) for _ in range(3))
    for n, a in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{n}.npy", a)
    old_o, old_lse = b"old O " * 10, b"old LSE " * 10
    (tmp_path / "o.npy").write_bytes(old_o)
    (tmp_path / "l.npy").write_bytes(old_lse)
    o_bytes, lse_bytes = 128 + 2 * 4096, 128 + 4 * 4096
    limit = {"out": 4096, "lse": (o_bytes + lse_bytes) // 2, "both": 1024}[which]
    r = _run_limited(sparsa_bin, ["run", "--method", "dense", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy",
                                  "--out", "o.npy", "--lse", "l.npy"], tmp_path, limit)
    _one_error_line(r, 1, "--out" if which != "lse" else "--lse", "write failed")
    assert (tmp_path / "o.npy").read_bytes() == old_o, "O was replaced although the run failed"
    assert (tmp_path / "l.npy").read_bytes() == old_lse, "LSE was replaced although the run failed"
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert leftovers == [], f"temporary files left behind: {leftovers}"


def test_failed_write_of_a_new_output_leaves_nothing(sparsa_bin, tmp_path):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 512, 16)).astype(np.float32) for _ in range(3))
    for n, a in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{n}.npy", a)
    r = _run_limited(sparsa_bin, ["run", "--method", "dense", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy",
                                  "--out", "new.npy", "--lse", "new_lse.npy"], tmp_path, 60000)
    _one_error_line(r, 1, "write failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.npy", "q.npy", "v.npy"]


# ---- logits that overflow f32 ------------------------------------------------------------------

@pytest.mark.parametrize("method", ["dense", "block_sparse", "quest", "llsa"])
@pytest.mark.parametrize("backend", ["cpu", "cpu_ref"])
def test_huge_values_give_a_finite_answer(sparsa_bin, tmp_path, method, backend):
    rng = np.random.default_rng(4)
    q, k = (rng.standard_normal((1, 2, 64, 16)).astype(np.float32) for _ in range(2))
    v = np.where(rng.standard_normal((1, 2, 64, 16)) > 0, 3e38, -3e38).astype(np.float32)
    for n, a in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{n}.npy", a)
    extra = {"dense": [], "block_sparse": ["-P", "density=1", "-P", "block=16"], "quest": [],
             "llsa": ["-P", "block=4", "-P", "topk=2"]}[method]
    r = run_cli(sparsa_bin, "run", "--method", method, "--backend", backend, "--q", "q.npy", "--k", "k.npy",
                "--v", "v.npy", "--out", "o.npy", "--lse", "l.npy", "--quiet", *extra, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    o, lse = np.load(tmp_path / "o.npy"), np.load(tmp_path / "l.npy")
    assert np.isfinite(o).all(), f"{np.isnan(o).sum()} NaN and {np.isinf(o).sum()} inf in O"
    assert np.isfinite(lse).all()
    if method in ("dense", "block_sparse"):  # every key visible: the numpy reference
        o_ref, _ = reference_attention(q, k, v)
        assert np.abs(o - o_ref).max() <= 1e-5 * np.abs(o_ref).max()  # f32 against f64, as test_cli


@pytest.mark.parametrize("method", ["dense", "block_sparse", "quest", "llsa"])
@pytest.mark.parametrize("backend", ["cpu", "cpu_ref"])
@pytest.mark.parametrize("how", ["scale 3e38", "inputs 3e38"])
def test_lse_beyond_f32_is_an_error(sparsa_bin, tmp_path, method, backend, how):
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 1, 32, 8)).astype(np.float32) for _ in range(3))
    extra = []
    if how == "scale 3e38":
        extra = ["--scale", "3e38"]
    else:
        q = np.full_like(q, 3e38)
        k = np.full_like(k, 3e38)
    for n, a in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{n}.npy", a)
    extra += {"dense": [], "block_sparse": ["-P", "density=1", "-P", "block=8"], "quest": [],
              "llsa": ["-P", "block=4", "-P", "topk=2"]}[method]
    r = run_cli(sparsa_bin, "run", "--method", method, "--backend", backend, "--q", "q.npy", "--k", "k.npy",
                "--v", "v.npy", "--out", "o.npy", *extra, cwd=tmp_path)
    _one_error_line(r, 1, "exceeds the f32 range")
    assert not (tmp_path / "o.npy").exists()


# ---- bounds on flags ---------------------------------------------------------------------------

BOUNDS = [
    (["plan", "--method", "ba_att", "--length", "1099511627776"], "--length: expected an integer in [1, 4194304]"),
    (["plan", "--method", "ba_att", "--length", "0"], "--length: expected an integer in [1, 4194304]"),
    (["plan", "--method", "ba_att", "--length", "-5"], "--length"),
    (["plan", "--method", "llsa", "--length", "4194305"], "--length: expected an integer in [1, 4194304]"),
    (["plan", "--method", "ba_att", "--length", "4000000", "--heads", "64", "--head-dim", "128"],
     "exceeds 2^31 elements"),
    (["eval", "--methods", "ba_att", "--length", "1099511627776"], "--length: expected an integer in [1, 4194304]"),
    (["eval", "--methods", "ba_att", "--length", "0"], "--length"),
    (["plan", "--method", "ba_att", "--threads", "257"], "--threads"),
    (["plan", "--method", "ba_att", "--threads", "1000000"], "--threads"),
    (["eval", "--methods", "ba_att", "--threads", "257"], "--threads"),
    (["demo", "--length", "1099511627776"], "--length"),
    (["demo", "--threads", "300"], "--threads"),
    (["bench", "--threads", "300"], "--threads"),
    (["plan", "--method", "ba_att", "--length", "99999999999999999999999"], "--length"),
    (["plan", "--method", "llsa", "--length", "256", "--mask", "causal"],
     "--mask: only ba_att, mean_pool and xattention plans see a mask"),
    (["plan", "--method", "ba_att", "--length", "256", "--mask", "causal(3)"], "--mask"),
    (["plan", "--method", "ba_att", "--length", "256", "--mask", "causal", "-P", "mask_aware=true"],
     "params: mask_aware needs sort=false"),
    (["plan", "--method", "ba_att", "--length", "256", "-P", "mask_aware=perhaps"], "mask_aware"),
]


@pytest.mark.parametrize("args,needle", BOUNDS, ids=[" ".join(a[0][:1] + a[0][2:4]) + f" #{i}"
                                                    for i, a in enumerate(BOUNDS)])
def test_flag_bounds(sparsa_bin, tmp_path, args, needle):
    r = run_cli(sparsa_bin, *args, cwd=tmp_path, timeout=60)
    _one_error_line(r, 2, needle)


@pytest.mark.parametrize("threads", ["257", "1000000", "-1"])
def test_run_threads_bound(sparsa_bin, tmp_path, threads):
    f = Files(tmp_path)
    r = run_cli(sparsa_bin, *_run_args(f, {}), "--threads", threads, cwd=tmp_path)
    _one_error_line(r, 2, "--threads")
