#!/usr/bin/env python3
"""Writes the seed corpora (corpus/<parser>/) and the regression inputs (regressions/<parser>/)
of the fuzz harnesses. The files are committed; run this again only to change them.

Seeds are small valid files of every dtype and rank the readers take, so the fuzzer starts
from the accepted formats. Regressions are the inputs that once crashed a reader or threw
out of a Status API (each is also a unit test in tests/test_io.cpp or tests/cli).
"""
import io
import json
import os
import struct

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def put(kind, name, data):
    path = os.path.join(HERE, kind, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def npy(array, version=None):
    buf = io.BytesIO()
    if version is None:
        np.save(buf, array)
    else:
        np.lib.format.write_array(buf, array, version=version)
    return buf.getvalue()


def safetensors(entries, metadata=None, raw_header=None):
    """entries: name -> (dtype string, shape, bytes)."""
    header, data = {}, b""
    for name, (dtype, shape, payload) in entries.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    if metadata is not None:
        header["__metadata__"] = metadata
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def main():
    rng = np.random.default_rng(1)
    # .npy seeds
    put("corpus/npy", "f32_2x3", npy(rng.standard_normal((2, 3)).astype(np.float32)))
    put("corpus/npy", "f16_4", npy(rng.standard_normal(4).astype(np.float16)))
    put("corpus/npy", "i32_2x2x2", npy(np.arange(8, dtype=np.int32).reshape(2, 2, 2)))
    put("corpus/npy", "f32_scalar", npy(np.float32(1.5)))
    put("corpus/npy", "f32_empty", npy(np.zeros((0, 3), np.float32)))
    put("corpus/npy", "f32_v2", npy(np.ones((1, 2, 1, 2), np.float32), version=(2, 0)))
    put("corpus/npy", "f32_v3", npy(np.ones((3,), np.float32), version=(3, 0)))
    put("corpus/npy", "f32_fortran_1d", npy(np.asfortranarray(np.ones((1, 3), np.float32))))
    put("corpus/npy", "f8_refused", npy(np.ones(2, np.float64)))
    # .safetensors seeds
    f32 = rng.standard_normal(6).astype(np.float32).tobytes()
    put("corpus/safetensors", "one_f32", safetensors({"x": ("F32", (2, 3), f32)}))
    put("corpus/safetensors", "mixed", safetensors({
        "a": ("F16", (2,), np.ones(2, np.float16).tobytes()),
        "b": ("BF16", (1, 2), b"\x80\x3f\x00\x40"),
        "c": ("I32", (2,), np.arange(2, dtype=np.int32).tobytes())}, metadata={"format": "pt"}))
    put("corpus/safetensors", "empty_entry", safetensors({"e": ("F32", (0, 4), b"")}))
    put("corpus/safetensors", "no_entries", safetensors({}, metadata={"k": "v"}))
    put("corpus/safetensors", "f64_refused", safetensors({"d": ("F64", (1,), b"\x00" * 8)}))
    # index seeds: counts [1, 1, 2], indices [1, 1, 2, 2], optional perms
    counts = np.array([[[1, 2]]], np.int32)
    indices = np.array([[[[0, 0], [0, 1]]]], np.int32)
    meta = {"block_q": "16", "block_kv": "16"}
    put("corpus/index", "plan", safetensors({"counts": ("I32", counts.shape, counts.tobytes()),
                                             "indices": ("I32", indices.shape, indices.tobytes())}, metadata=meta))
    perm = np.arange(32, dtype=np.int32).reshape(1, 1, 32)
    put("corpus/index", "plan_perm", safetensors({
        "counts": ("I32", counts.shape, counts.tobytes()), "indices": ("I32", indices.shape, indices.tobytes()),
        "perm_q": ("I32", perm.shape, perm.tobytes()), "perm_kv": ("I32", perm.shape, perm.tobytes())}, metadata=meta))
    put("corpus/index", "plan_no_meta", safetensors({"counts": ("I32", counts.shape, counts.tobytes()),
                                                     "indices": ("I32", indices.shape, indices.tobytes())}))

    # Regressions (issue 14): deep nesting in the header, a number beyond a double.
    deep = b"[" * 100000 + b"]" * 100000
    # (the index harness runs regressions/safetensors too)
    put("regressions/safetensors", "deep_member",
        safetensors({}, raw_header=b'{"a":' + deep + b',"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'))
    put("regressions/safetensors", "deep_dtype",
        safetensors({}, raw_header=b'{"x":{"dtype":' + deep + b',"shape":[1],"data_offsets":[0,4]}}'))
    put("regressions/safetensors", "number_1e400",
        safetensors({}, raw_header=b'{"x":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}}'))
    put("regressions/safetensors", "bad_utf8_dtype",
        safetensors({}, raw_header=b'{"x":{"dtype":["\xff"],"shape":[1],"data_offsets":[0,4]}}'))
    put("regressions/index", "deep_metadata", safetensors({}, raw_header=b'{"__metadata__":{"block_q":' + deep + b"}}"))
    put("regressions/index", "number_1e400_metadata", safetensors({}, raw_header=b'{"__metadata__":{"block_q":1e400}}'))
    put("regressions/npy", "deep_header", b"\x93NUMPY\x01\x00" + struct.pack("<H", 20000) + b"{'descr':" + b"(" * 19990 + b"\n")


if __name__ == "__main__":
    main()
