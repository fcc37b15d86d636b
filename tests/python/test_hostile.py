# The Python API against hostile arguments (issue 14): each bad argument gives an exception
# whose message names the argument, never nanobind's generic "incompatible function
# arguments", a crash or a wrong answer. Outputs that alias each other or overlap
# themselves are refused; num_threads is bounded (256, as the CLI's --threads);
# read_tensor on a deeply nested header raises instead of overflowing the stack.
import struct

import numpy as np
import pytest

import sparsa


def qkv(len_q=16, len_kv=16, d=8, heads=2):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((1, heads, n, d)).astype(np.float32) for n in (len_q, len_kv, len_kv))


Q, K, V = qkv()
INDEX = sparsa.BlockIndex.full(1, 2, 16, 16, 8, 8)


def read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def stride0(shape):
    buf = np.zeros(shape[-1], np.float32)
    return np.lib.stride_tricks.as_strided(buf, shape=shape, strides=(0,) * (len(shape) - 1) + (4,), writeable=True)


def overlapping(shape):
    # rows of 8 floats starting every 4 floats: elements repeat addresses
    n = int(np.prod(shape[:-1]))
    buf = np.zeros(4 * n + 8, np.float32)
    return np.lib.stride_tricks.as_strided(buf, shape=shape, strides=tuple(
        4 * 4 * int(np.prod(shape[i + 1:-1])) for i in range(len(shape) - 1)) + (4,), writeable=True)


def lse_into_out():
    base = np.zeros((1, 2, 16, 9), np.float32)
    return dict(out=base[..., :8], lse=base[..., 8])


def lse_inside_out():
    out = np.zeros((1, 2, 16, 8), np.float32)
    return dict(out=out, lse=out[:, :, :, 0])


# Bad keyword values shared by the executors: (label, kwargs, exception, message regex).
COMMON = [
    ("scale str", dict(scale="a"), TypeError, r"^scale: expected a number or None, got str 'a'"),
    ("scale list", dict(scale=[1.0]), TypeError, r"^scale: expected a number"),
    ("scale nan", dict(scale=float("nan")), ValueError, r"^scale: expected a finite positive number"),
    ("scale 0", dict(scale=0.0), ValueError, r"^scale: expected a finite positive number"),
    ("scale -1", dict(scale=-1.0), ValueError, r"^scale: expected a finite positive number"),
    ("scale inf", dict(scale=float("inf")), ValueError, r"^scale: expected a finite positive number"),
    ("scale 1e39", dict(scale=1e39), ValueError, r"^scale"),
    ("backend None", dict(backend=None), TypeError, r"^backend: expected a string, got None"),
    ("backend int", dict(backend=3), TypeError, r"^backend: expected a string"),
    ("backend tpu", dict(backend="tpu"), ValueError, r"^backend: expected cpu_ref, cpu or cuda"),
    ("num_threads 10**6", dict(num_threads=10 ** 6), ValueError, r"^num_threads: expected 0\.\.256"),
    ("num_threads 257", dict(num_threads=257), ValueError, r"^num_threads: expected 0\.\.256"),
    ("num_threads -1", dict(num_threads=-1), ValueError, r"^num_threads: expected 0\.\.256"),
    ("num_threads 2**31", dict(num_threads=2 ** 31), ValueError, r"^num_threads: expected an integer in"),
    ("num_threads 10**20", dict(num_threads=10 ** 20), ValueError, r"^num_threads: expected an integer in"),
    ("num_threads str", dict(num_threads="4"), TypeError, r"^num_threads: expected an integer"),
    ("num_threads float", dict(num_threads=2.5), TypeError, r"^num_threads: expected an integer"),
]
CHECK_FINITE = [
    ("check_finite str", dict(check_finite="yes"), TypeError, r"^check_finite: expected True or False"),
    ("check_finite None", dict(check_finite=None), TypeError, r"^check_finite: expected True or False"),
]
OUTPUTS = [
    ("out read-only", lambda: dict(out=read_only(np.zeros_like(Q))), ValueError, r"^out: expected a writable array"),
    ("lse read-only", lambda: dict(lse=read_only(np.zeros((1, 2, 16), np.float32))), ValueError,
     r"^lse: expected a writable array"),
    ("out a list", lambda: dict(out=[0.0]), TypeError, r"^out: expected an output array"),
    ("lse a str", lambda: dict(lse="lse"), TypeError, r"^lse: expected an output array"),
    ("out stride 0", lambda: dict(out=stride0((1, 2, 16, 8))), ValueError, r"^out: its elements overlap"),
    ("lse stride 0", lambda: dict(lse=stride0((1, 2, 16))), ValueError, r"^lse: its elements overlap"),
    ("out rows overlap", lambda: dict(out=overlapping((1, 2, 16, 8))), ValueError, r"^out: its elements overlap"),
    ("lse a view into out", lse_into_out, ValueError, r"^lse: shares memory with out"),
    ("lse inside out", lse_inside_out, ValueError, r"^lse: shares memory with out"),
    ("out wrong shape", lambda: dict(out=np.zeros((1, 2, 16, 4), np.float32)), ValueError, r"^out: expected shape"),
    ("out wrong dtype", lambda: dict(out=np.zeros((1, 2, 16, 8), np.float16)), (TypeError, ValueError), r"^out: "),
    ("lse wrong dtype", lambda: dict(lse=np.zeros((1, 2, 16), np.float16)), (TypeError, ValueError), r"^lse: "),
]
ARRAYS = [
    ("k None", dict(k=None), TypeError, r"^k: expected an array \(numpy, torch, cupy or jax\), got None"),
    ("v None", dict(v=None), TypeError, r"^v: expected an array"),
    ("k a list", dict(k=[[1.0]]), TypeError, r"^k: expected an array"),
    ("v a str", dict(v="v.npy"), TypeError, r"^v: expected an array"),
    ("k a float", dict(k=1.0), TypeError, r"^k: expected an array"),
    ("q None", dict(q=None), TypeError, r"^q: expected (a numpy, torch, cupy or jax array|an array)"),
    ("q a list", dict(q=[1.0]), TypeError, r"^q: expected (a numpy, torch, cupy or jax array|an array)"),
    ("k float64", dict(k=K.astype(np.float64)), TypeError, r"^k: unsupported dtype float64"),
    ("v int64", dict(v=V.astype(np.int64)), TypeError, r"^v: unsupported dtype int64"),
    ("k 3-d", dict(k=K[0]), ValueError, r"^k: expected 4 dimensions"),
]


def call(function, kwargs, index=False, **fixed):
    args = dict(q=Q, k=K, v=V)
    args.update(fixed)
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    if index:
        return function(q, k, v, args.pop("index", INDEX), **args)
    return function(q, k, v, **args)


def build_cases():
    cases = []
    executors = {
        "dense": (sparsa.dense, False, COMMON + CHECK_FINITE),
        "block_sparse": (sparsa.block_sparse, True, COMMON + CHECK_FINITE),
        "llsa": (sparsa.llsa, False, COMMON + CHECK_FINITE),
        "ba_att": (sparsa.ba_att, False, COMMON + CHECK_FINITE),
        "xattention": (sparsa.xattention, False, [c for c in COMMON if "scale 1e39" not in c[0]] + CHECK_FINITE),
        "quest": (sparsa.quest, False, COMMON),
    }
    for name, (function, index, keywords) in executors.items():
        extra = dict(block=4, topk=2) if name == "llsa" else dict(block_q=8, block_kv=8) if name in (
            "ba_att", "xattention") else {}
        if name == "quest":
            extra = dict(budget=16)
        for label, kwargs, error, pattern in keywords + ARRAYS:
            cases.append((f"{name}: {label}", (lambda f=function, kw=kwargs, i=index, e=extra: call(f, kw, i, **e)),
                          error, pattern))
        if name in ("dense", "block_sparse", "llsa"):
            for label, make, error, pattern in OUTPUTS:
                cases.append((f"{name}: {label}",
                              (lambda f=function, mk=make, i=index, e=extra: call(f, mk(), i, **e)), error, pattern))
    # Block sizes and counts beyond the C++ int, and other ints of the selectors.
    for name, function, keyword in [("llsa", sparsa.llsa, "block"), ("llsa", sparsa.llsa, "topk"),
                                    ("llsa", sparsa.llsa, "levels"), ("ba_att", sparsa.ba_att, "block_q"),
                                    ("ba_att", sparsa.ba_att, "block_kv"), ("ba_att", sparsa.ba_att, "top_kappa"),
                                    ("xattention", sparsa.xattention, "stride"),
                                    ("xattention", sparsa.xattention, "block_q"), ("quest", sparsa.quest, "page_size")]:
        # top_kappa is read by the package's budget check, whose messages say "budget: top_kappa ...".
        prefix = "^budget: top_kappa expects" if keyword == "top_kappa" else f"^{keyword}: expected"
        for value, error, pattern in [(2 ** 40, ValueError, prefix + (" an integer kappa" if keyword == "top_kappa"
                                                                      else " an integer in")),
                                      (-(2 ** 40), ValueError, prefix + (" an integer kappa" if keyword == "top_kappa"
                                                                         else " an integer in")),
                                      ("8", TypeError, prefix + (" a number" if keyword == "top_kappa"
                                                                 else " an integer")),
                                      (None if keyword != "top_kappa" else 1.5,
                                       ValueError if keyword == "top_kappa" else TypeError,
                                       prefix + (" an integer kappa" if keyword == "top_kappa" else " an integer"))]:
            cases.append((f"{name}: {keyword}={value!r}",
                          (lambda f=function, kw={keyword: value}: f(Q, K, V, **kw)), error, pattern))
    # The BlockIndex of block_sparse.
    c, i = INDEX.counts, INDEX.indices
    for label, index, error, pattern in [
        ("indices None", sparsa.BlockIndex(8, 8, c, None), TypeError, r"^index\.indices: expected an int32 array"),
        ("counts None", sparsa.BlockIndex(8, 8, None, i), TypeError, r"^index\.counts: expected an int32 array"),
        ("counts a list", sparsa.BlockIndex(8, 8, [1], i), TypeError, r"^index\.counts: expected an int32 array"),
        ("perm_q a str", sparsa.BlockIndex(8, 8, c, i, perm_q="p"), TypeError, r"^index\.perm_q: expected"),
        ("block_q 2**40", sparsa.BlockIndex(2 ** 40, 8, c, i), ValueError, r"^index\.block_q: expected an integer in"),
        ("block_kv str", sparsa.BlockIndex(8, "8", c, i), TypeError, r"^index\.block_kv: expected an integer"),
        ("block_q 0", sparsa.BlockIndex(0, 8, c, i), ValueError, r"^index\.block_q"),
        ("counts f32", sparsa.BlockIndex(8, 8, c.astype(np.float32), i), (TypeError, ValueError), r"^index\.counts"),
        ("indices out of range", sparsa.BlockIndex(8, 8, c, i + 5), ValueError, r"^index\.indices\["),
        ("not a BlockIndex", {"counts": c}, TypeError, r"^index: expected sparsa\.BlockIndex"),
    ]:
        cases.append((f"block_sparse: {label}", (lambda ix=index: sparsa.block_sparse(Q, K, V, ix)), error, pattern))
    # merge's outputs.
    o1, l1 = sparsa.dense(Q, K, V)
    for label, make, error, pattern in OUTPUTS[:9]:
        cases.append((f"merge: {label}", (lambda mk=make: sparsa.merge(o1, l1, o1, l1, **mk())), error, pattern))
    cases.append(("merge: o2 None", lambda: sparsa.merge(o1, l1, None, l1), TypeError, r"^o2: expected an array"))
    cases.append(("merge: lse2 a str", lambda: sparsa.merge(o1, l1, o1, "l"), TypeError, r"^lse2: expected an array"))
    return cases


CASES = build_cases()


@pytest.mark.parametrize("name,run,error,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_argument_is_named(name, run, error, pattern):
    with pytest.raises(error, match=pattern) as info:
        run()
    assert "incompatible function arguments" not in str(info.value)


def test_at_least_two_hundred_bad_arguments():
    assert len({c[0] for c in CASES}) >= 200


def test_bad_arguments_leave_the_result_correct_afterwards():
    # The refusals happen before any work: a later valid call gives the reference answer.
    out = np.zeros_like(Q)
    with pytest.raises(ValueError):
        sparsa.dense(Q, K, V, out=out, lse=out[:, :, :, 0])
    assert not out.any(), "a refused call wrote into out"
    o, lse = sparsa.dense(Q, K, V, backend="cpu")
    o_ref, lse_ref = sparsa.dense(Q, K, V, backend="cpu_ref")
    np.testing.assert_allclose(o, o_ref, atol=1e-5 * np.abs(o_ref).max())  # the f32 bound of test_core


def _safetensors(header):
    return struct.pack("<Q", len(header)) + header


@pytest.mark.parametrize("header,pattern", [
    (b'{"a": ' + b"[" * 200000 + b"]" * 200000 + b"}", r"nests deeper than 32 levels"),
    (b'{"t": {"dtype": ' + b"[" * 100000 + b"]" * 100000 + b', "shape": [1], "data_offsets": [0, 4]}}',
     r"nests deeper than 32 levels"),
    (b'{"__metadata__": {"k": ' + b'{"a": ' * 50000 + b"1" + b"}" * 50000 + b"}}", r"nests deeper than 32 levels"),
    (b'{"t": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}}', r"fits a double"),
    (b'{"t": {"dtype": ["\xff"], "shape": [1], "data_offsets": [0, 4]}}', r"bad JSON header.*\\xff"),
], ids=["deep member", "deep dtype", "deep metadata", "1e400", "bad utf-8"])
def test_read_tensor_refuses_hostile_headers(tmp_path, header, pattern):
    p = tmp_path / "x.safetensors"
    p.write_bytes(_safetensors(header) + b"\x00" * 4)
    with pytest.raises(ValueError, match=pattern):
        sparsa.read_tensor(str(p))


# ---- BlockIndex.load, fuzzed ----------------------------------------------------------------
# The index file's reader is the library's safetensors reader (fuzzed in C++ by fuzz_safetensors
# and fuzz_index) plus BlockIndex.load's checks of entries, dtypes, dimensions and block sizes.
# A real plan's file, its header's values mutated (the length prefix kept right, so the reader
# gets past it) or its bytes damaged: load gives a well-formed BlockIndex or a ValueError naming
# the file or the entry. SPARSA_FUZZ_CASES cases (default 400; a longer campaign sets it higher).

def _index_file(tmp_path):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 40, 8), dtype=np.float32)
    plan = sparsa.ba_att_plan(q, q, block_q=8, block_kv=8, density=0.5)
    plan.save(tmp_path / "plan.safetensors")
    return plan, (tmp_path / "plan.safetensors").read_bytes()


_ODD = [None, True, 0, -1, 1, 3, 2 ** 40, 2 ** 64, 0.5, float("nan"), "", "8", "0", "-8", "1048577", " 8", "I32",
        "F32", "I64", "BF16", "counts", "perm_q", [], [1], [0, 4], [4, 0], [0, 2 ** 63], [-1, 4], [2, 3, 4],
        [1, 2, 5], [1, 2, 5, 3], {}, {"block_q": "8"}]


def test_block_index_load_fuzz(tmp_path):
    import json
    import os
    import random

    plan, original = _index_file(tmp_path)
    (n,) = struct.unpack("<Q", original[:8])
    header, data = json.loads(original[8:8 + n]), original[8 + n:]
    path = tmp_path / "case.safetensors"
    rng = random.Random(17)
    cases = int(os.environ.get("SPARSA_FUZZ_CASES", "400"))
    loaded = 0
    for case in range(cases):
        if rng.random() < 0.75:  # the header's values
            h = json.loads(json.dumps(header))
            for _ in range(rng.randint(1, 3)):
                entry = rng.choice(sorted(h))
                if rng.random() < 0.15:
                    h[rng.choice(["perm_kv", "zz", entry + "x"])] = h.pop(entry)
                    continue
                field = rng.choice(sorted(h[entry]) + ["zz"])
                h[entry][field] = json.loads(json.dumps(rng.choice(_ODD)))
            text = json.dumps(h).encode()
            path.write_bytes(struct.pack("<Q", len(text)) + text + data)
        else:  # the bytes
            raw = bytearray(original)
            if rng.random() < 0.5:
                raw = raw[:rng.randrange(len(raw))]
            else:
                for _ in range(rng.randint(1, 6)):
                    raw[rng.randrange(len(raw))] = rng.randrange(256)
            path.write_bytes(bytes(raw))
        try:
            back = sparsa.BlockIndex.load(path)
        except ValueError as e:
            assert str(e).startswith((f"path: {path}", "index.")), str(e)
            continue
        loaded += 1
        assert back.counts.dtype == np.int32 and back.counts.ndim == 3 and back.indices.ndim == 4
        assert back.indices.shape[:3] == back.counts.shape and 1 <= back.block_q <= 1 << 20
        back.save(tmp_path / "again.safetensors")
        again = sparsa.BlockIndex.load(tmp_path / "again.safetensors")
        for name in ("counts", "indices", "perm_q", "perm_kv"):
            a, b = getattr(back, name), getattr(again, name)
            assert (a is None and b is None) or np.array_equal(a, b)
    assert 0 < loaded < cases


@pytest.mark.parametrize("change,pattern", [
    (lambda h: h["counts"].update(dtype="F32"), r"^index\.counts: expected dtype I32"),
    (lambda h: h["counts"].update(shape=[2, 5], data_offsets=[0, 40]), r"^index\.counts: expected 3 dimensions"),
    (lambda h: h.__setitem__("extra", h.pop("perm_kv")), r"unknown entry 'extra'"),
    (lambda h: h.pop("indices"), r"missing entry 'indices'"),
    (lambda h: h["__metadata__"].update(block_q="8x"), r"__metadata__ block_q must be an integer"),
    (lambda h: h["__metadata__"].update(block_kv="0"), r"__metadata__ block_kv must be an integer"),
    (lambda h: h["counts"].update(shape=[1, 2, 3, 0]), r"do not fit|expected 3 dimensions|data_offsets"),
], ids=["dtype", "dims", "unknown", "missing", "block text", "block zero", "shape"])
def test_block_index_load_names_what_is_wrong(tmp_path, change, pattern):
    import json

    _, original = _index_file(tmp_path)
    (n,) = struct.unpack("<Q", original[:8])
    header, data = json.loads(original[8:8 + n]), original[8 + n:]
    change(header)
    text = json.dumps(header).encode()
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data)
    with pytest.raises(ValueError, match=pattern):
        sparsa.BlockIndex.load(tmp_path / "bad.safetensors")
