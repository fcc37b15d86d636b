"""sparsa on numpy arrays: every function, dtype and error path (runs in CI)."""
import numpy as np
import pytest

import sparsa
from reference import attention, rand, rel_err

# f32 fast path vs f64 oracle: the cpu backend accumulates in f32 over up to ~1K keys,
# so relative errors stay around 1e-6; 1e-5 leaves a margin without hiding real bugs.
F32_RTOL = 1e-5


@pytest.mark.parametrize("backend", ["cpu", "cpu_ref"])
@pytest.mark.parametrize("d", [64, 128])
def test_dense_matches_numpy_gqa(rng, backend, d):
    q, k, v = rand(rng, 2, 8, 37, d), rand(rng, 2, 2, 53, d), rand(rng, 2, 2, 53, d)
    out, lse = sparsa.dense(q, k, v, backend=backend)
    ref_o, ref_lse = attention(q, k, v)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (2, 8, 37)
    assert rel_err(out, ref_o) < F32_RTOL
    assert rel_err(lse, ref_lse) < F32_RTOL


def test_dense_f16_inputs(rng):
    q, k, v = (rand(rng, 1, 4, 19, 64, dtype=np.float16) for _ in range(3))
    out, lse = sparsa.dense(q, k, v)
    assert out.dtype == np.float16
    ref_o, ref_lse = attention(q, k, v)
    # The output is rounded to f16: half an ulp relative (2^-11) of the largest value,
    # plus the f32 accumulation term.
    assert rel_err(out, ref_o) < 2.0**-11 + F32_RTOL
    assert rel_err(lse, ref_lse) < F32_RTOL


def test_custom_scale(rng):
    q, k, v = rand(rng, 1, 2, 9, 16), rand(rng, 1, 2, 11, 16), rand(rng, 1, 2, 11, 16)
    out, lse = sparsa.dense(q, k, v, scale=0.3)
    ref_o, ref_lse = attention(q, k, v, scale=0.3)
    assert rel_err(out, ref_o) < F32_RTOL and rel_err(lse, ref_lse) < F32_RTOL


def test_strided_inputs_and_outputs_are_not_copied(rng):
    # Inputs in [batch, seq, heads, dim] memory, viewed as [batch, heads, seq, dim].
    qs, ks, vs = rand(rng, 1, 33, 4, 32), rand(rng, 1, 40, 2, 32), rand(rng, 1, 40, 2, 32)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (qs, ks, vs))
    assert not q.flags.c_contiguous
    # Outputs: views into larger buffers; the result must be written through them.
    big = np.full((1, 4, 33, 48), 7.0, dtype=np.float32)
    out_view = big[:, :, :, 8:40]
    lse_big = np.full((1, 4, 33, 2), 7.0, dtype=np.float32)
    lse_view = lse_big[..., 0]
    out, lse = sparsa.dense(q, k, v, out=out_view, lse=lse_view)
    assert out is out_view and lse is lse_view
    ref_o, ref_lse = attention(q, k, v)
    assert rel_err(big[:, :, :, 8:40], ref_o) < F32_RTOL
    assert rel_err(lse_big[..., 0], ref_lse) < F32_RTOL
    assert (big[:, :, :, :8] == 7.0).all() and (big[:, :, :, 40:] == 7.0).all()
    assert (lse_big[..., 1] == 7.0).all()


def random_index(rng, b, h, lq, lk, bq, bk, keep=0.4):
    nq, nk = -(-lq // bq), -(-lk // bk)
    counts = np.zeros((b, h, nq), np.int32)
    indices = np.zeros((b, h, nq, nk), np.int32)
    for i in np.ndindex(b, h, nq):
        chosen = np.flatnonzero(rng.random(nk) < keep)
        counts[i] = len(chosen)
        indices[i][: len(chosen)] = chosen
    counts[0, 0, 0] = 0  # one empty row: O = 0, LSE = -inf
    return sparsa.BlockIndex(bq, bk, counts, indices)


def dense_mask(index, b, h, lq, lk):
    mask = np.zeros((b, h, lq, lk), bool)
    for bb, hh, qb in np.ndindex(b, h, index.num_q_blocks):
        for s in range(index.counts[bb, hh, qb]):
            kb = index.indices[bb, hh, qb, s]
            mask[bb, hh, qb * index.block_q:(qb + 1) * index.block_q, kb * index.block_kv:(kb + 1) * index.block_kv] = True
    return mask


@pytest.mark.parametrize("backend", ["cpu", "cpu_ref"])
def test_block_sparse_random_index_matches_masked_dense(rng, backend):
    b, hq, hkv, lq, lk, d = 1, 4, 2, 70, 90, 32
    q, k, v = rand(rng, b, hq, lq, d), rand(rng, b, hkv, lk, d), rand(rng, b, hkv, lk, d)
    index = random_index(rng, b, hq, lq, lk, 16, 16)
    out, lse = sparsa.block_sparse(q, k, v, index, backend=backend)
    ref_o, ref_lse = attention(q, k, v, mask=dense_mask(index, b, hq, lq, lk))
    assert (out[0, 0, :16] == 0).all() and np.isneginf(lse[0, 0, :16]).all()
    assert rel_err(out, ref_o) < F32_RTOL
    finite = np.isfinite(ref_lse)
    assert (np.isfinite(lse) == finite).all()
    assert np.abs(lse[finite] - ref_lse[finite]).max() < 1e-4
    assert 0 < index.density(lq, lk) < 1


def test_block_sparse_full_index_equals_dense(rng):
    q, k, v = rand(rng, 1, 2, 45, 16), rand(rng, 1, 2, 77, 16), rand(rng, 1, 2, 77, 16)
    index = sparsa.BlockIndex.full(1, 2, 45, 77, 16, 32)
    o1, l1 = sparsa.block_sparse(q, k, v, index)
    o2, l2 = sparsa.dense(q, k, v)
    assert rel_err(o1, o2) < F32_RTOL and rel_err(l1, l2) < F32_RTOL
    assert index.density(45, 77) == pytest.approx(1.0)


def test_block_sparse_permutations_write_back_in_original_order(rng):
    q, k, v = rand(rng, 1, 2, 40, 16), rand(rng, 1, 1, 40, 16), rand(rng, 1, 1, 40, 16)
    index = sparsa.BlockIndex.full(1, 2, 40, 40, 8, 8)
    index.perm_q = np.stack([rng.permutation(40) for _ in range(2)])[None].astype(np.int32)
    index.perm_kv = rng.permutation(40)[None, None].astype(np.int32)
    out, lse = sparsa.block_sparse(q, k, v, index)
    ref_o, ref_lse = attention(q, k, v)  # every block listed: permutation must not matter
    assert rel_err(out, ref_o) < F32_RTOL and rel_err(lse, ref_lse) < F32_RTOL


def test_merge_of_split_keys_equals_dense(rng):
    q, k, v = rand(rng, 1, 4, 21, 32), rand(rng, 1, 2, 50, 32), rand(rng, 1, 2, 50, 32)
    o1, l1 = sparsa.dense(q, k[:, :, :13], v[:, :, :13])
    o2, l2 = sparsa.dense(q, k[:, :, 13:], v[:, :, 13:])
    out, lse = sparsa.merge(o1, l1, o2, l2)
    ref_o, ref_lse = attention(q, k, v)
    assert rel_err(out, ref_o) < F32_RTOL and rel_err(lse, ref_lse) < F32_RTOL
    # In place into o1/l1.
    sparsa.merge(o1, l1, o2, l2, out=o1, lse=l1)
    assert rel_err(o1, ref_o) < F32_RTOL


def test_merge_empty_sides():
    o = np.ones((1, 1, 2, 4), np.float32)
    ninf = np.full((1, 1, 2), -np.inf, np.float32)
    zero = np.zeros((1, 1, 2), np.float32)
    out, lse = sparsa.merge(o, zero, 3 * o, ninf)
    assert (out == 1).all() and (lse == 0).all()
    out, lse = sparsa.merge(o, ninf, o, ninf)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_tensor_files_round_trip(tmp_path, rng):
    for dtype in (np.float32, np.float16, np.int32):
        a = (rng.standard_normal((3, 5)) * 10).astype(dtype)
        sparsa.write_tensor(tmp_path / "a.npy", a)
        assert np.array_equal(sparsa.read_tensor(tmp_path / "a.npy"), a)
        assert np.array_equal(np.load(tmp_path / "a.npy"), a)  # numpy reads what we write
        sparsa.write_tensor(tmp_path / "a.safetensors", a)
        assert np.array_equal(sparsa.read_tensor(tmp_path / "a.safetensors"), a)
    np.save(tmp_path / "np.npy", a)  # we read what numpy writes
    assert np.array_equal(sparsa.read_tensor(tmp_path / "np.npy"), a)


def test_workload_is_seeded():
    q1, k1, v1 = sparsa.generate_workload(seed=3, len_q=64, len_kv=64, head_dim=16)
    q2, _, _ = sparsa.generate_workload(seed=3, len_q=64, len_kv=64, head_dim=16)
    q3, _, _ = sparsa.generate_workload(seed=4, len_q=64, len_kv=64, head_dim=16)
    assert q1.shape == (1, 8, 64, 16) and k1.shape == (1, 2, 64, 16)
    assert np.array_equal(q1, q2) and not np.array_equal(q1, q3)


def test_info():
    assert sparsa.__version__ == sparsa.version()
    assert {"cpu", "cpu_ref"} <= set(sparsa.backends())


# ---- bad inputs: a Python exception with the core's message, never a crash -------------

def test_wrong_rank(rng):
    with pytest.raises(ValueError, match=r"q: expected 4 dimensions"):
        sparsa.dense(rand(rng, 2, 8, 64), rand(rng, 1, 2, 8, 64), rand(rng, 1, 2, 8, 64))


def test_unsupported_dtype(rng):
    q = rng.standard_normal((1, 2, 8, 16))  # float64
    with pytest.raises(TypeError, match=r"q: unsupported dtype float64"):
        sparsa.dense(q, q, q)


def test_mixed_dtypes(rng):
    with pytest.raises(TypeError, match=r"k: dtype f16 differs from q's f32"):
        sparsa.dense(rand(rng, 1, 2, 8, 16), rand(rng, 1, 2, 8, 16, dtype=np.float16), rand(rng, 1, 2, 8, 16))


def test_gqa_mismatch(rng):
    with pytest.raises(ValueError, match=r"heads_q \(6\) must be a multiple of heads_kv \(4\)"):
        sparsa.dense(rand(rng, 1, 6, 8, 16), rand(rng, 1, 4, 8, 16), rand(rng, 1, 4, 8, 16))


def test_non_contiguous_last_dim(rng):
    q = rand(rng, 1, 2, 8, 32)[..., ::2]
    with pytest.raises(ValueError, match=r"q: the last dimension \(head_dim\) must be contiguous"):
        sparsa.dense(q, q, q)


def test_empty_sequence(rng):
    with pytest.raises(ValueError, match=r"k: seq \(dim 2\) is 0"):
        sparsa.dense(rand(rng, 1, 2, 8, 16), rand(rng, 1, 2, 0, 16), rand(rng, 1, 2, 0, 16))


def test_nan_with_check_finite(rng):
    q = rand(rng, 1, 2, 8, 16)
    q[0, 1, 3, 5] = np.nan
    with pytest.raises(ValueError, match=r"q: contains NaN at \[0, 1, 3, 5\]"):
        sparsa.dense(q, q, q, check_finite=True)


def test_bad_backend(rng):
    q = rand(rng, 1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"backend: expected cpu_ref, cpu or cuda"):
        sparsa.dense(q, q, q, backend="tpu")


def test_bad_scale(rng):
    q = rand(rng, 1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"scale: expected a finite positive number"):
        sparsa.dense(q, q, q, scale=-1.0)


def test_index_out_of_range(rng):
    q = rand(rng, 1, 1, 32, 16)
    index = sparsa.BlockIndex.full(1, 1, 32, 32, 16, 16)
    index.indices[0, 0, 1, 1] = 5
    with pytest.raises(ValueError, match=r"index.indices\[0, 0, 1, 1\]: key block 5 is outside"):
        sparsa.block_sparse(q, q, q, index)
    # check_index=False trusts device plans only: a host plan is always checked.
    with pytest.raises(ValueError, match=r"index.indices\[0, 0, 1, 1\]: key block 5 is outside"):
        sparsa.block_sparse(q, q, q, index, check_index=False)


def test_index_wrong_type(rng):
    q = rand(rng, 1, 1, 32, 16)
    with pytest.raises(TypeError, match=r"index: expected sparsa.BlockIndex"):
        sparsa.block_sparse(q, q, q, {"counts": None})


def test_malformed_file(tmp_path):
    path = tmp_path / "bad.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00garbage")
    with pytest.raises(ValueError, match=r"bad.npy"):
        sparsa.read_tensor(path)


def test_missing_file(tmp_path):
    with pytest.raises(RuntimeError, match=r"missing.npy"):
        sparsa.read_tensor(tmp_path / "missing.npy")


def test_not_an_array():
    with pytest.raises(TypeError, match=r"q: expected a numpy, torch, cupy or jax array, got list"):
        sparsa.dense([[1.0]], [[1.0]], [[1.0]])


# ---- LLSA ---------------------------------------------------------------------------------

def test_llsa_every_block_selected_without_enrichment_equals_dense(rng):
    # N = 64 with block 16 has 4 key blocks; topk 4 selects them all.
    q, k, v = rand(rng, 1, 2, 64, 32), rand(rng, 1, 2, 64, 32), rand(rng, 1, 2, 64, 32)
    out, lse = sparsa.llsa(q, k, v, block=16, topk=4, enrich=False)
    ref_o, ref_lse = attention(q, k, v)
    assert rel_err(out, ref_o) < F32_RTOL and rel_err(lse, ref_lse) < F32_RTOL


@pytest.mark.parametrize("backend", ["cpu_ref", "cpu"])
def test_llsa_coarsest_level_is_dense_attention_over_the_pooled_keys(rng, backend):
    # Without dedupe every query attends to every token of the coarsest level, each carrying the
    # log of the B^L tokens it stands for: with one level and N a multiple of B, LLSA is its fine
    # blocks (enrich=False) merged by LSE with dense attention over the block means whose LSE is
    # raised by log B. The cuda backend's forward may compute it that way; this holds it to the
    # statement. Independent parts: numpy's attention and merge in f64.
    b, h, n, d, blk = 1, 2, 512, 32, 16
    q, k, v = rand(rng, b, h, n, d), rand(rng, b, h, n, d), rand(rng, b, h, n, d)
    out, lse = sparsa.llsa(q, k, v, block=blk, topk=4, levels=1, backend=backend)
    fine_o, fine_lse = sparsa.llsa(q, k, v, block=blk, topk=4, levels=1, enrich=False, backend=backend)
    kc = k.astype(np.float64).reshape(b, h, n // blk, blk, d).mean(axis=3)
    vc = v.astype(np.float64).reshape(b, h, n // blk, blk, d).mean(axis=3)
    coarse_o, coarse_lse = attention(q, kc, vc)
    coarse_lse = coarse_lse + np.log(blk)
    l1, l2 = np.asarray(fine_lse, dtype=np.float64), coarse_lse
    m = np.maximum(l1, l2)
    w1, w2 = np.exp(l1 - m)[..., None], np.exp(l2 - m)[..., None]
    ref_o = (w1 * np.asarray(fine_o, dtype=np.float64) + w2 * coarse_o) / (w1 + w2)
    ref_lse = m + np.log(w1[..., 0] + w2[..., 0])
    assert rel_err(out, ref_o) < F32_RTOL and rel_err(lse, ref_lse) < F32_RTOL


def test_llsa_backward_matches_finite_differences(rng):
    # f32 central differences: step 1e-2 on O(1) inputs gives ~1e-4 truncation plus
    # ~1e-5 rounding, so 2e-3 relative to the largest gradient separates right from wrong.
    q, k, v = rand(rng, 1, 1, 40, 8), rand(rng, 1, 1, 40, 8), rand(rng, 1, 1, 40, 8)
    w = rand(rng, 1, 1, 40, 8)
    opts = dict(block=4, topk=2, backend="cpu_ref")
    out, lse = sparsa.llsa(q, k, v, **opts)
    dq, dk, dv = sparsa.llsa_backward(q, k, v, out, lse, w, **opts)
    def loss(qq, kk, vv):
        o, _ = sparsa.llsa(qq, kk, vv, **opts)
        return float((o.astype(np.float64) * w).sum())
    plan = sparsa.llsa_plan(q, k, block=4, topk=2)
    eps = 1e-2
    for name, grad, idx in (("q", dq, (0, 0, 5, 3)), ("k", dk, (0, 0, 17, 1)), ("v", dv, (0, 0, 33, 7))):
        args = {"q": q.copy(), "k": k.copy(), "v": v.copy()}
        args[name][idx] += eps
        up = loss(args["q"], args["k"], args["v"])
        args[name][idx] -= 2 * eps
        down = loss(args["q"], args["k"], args["v"])
        numeric = (up - down) / (2 * eps)
        # Selection is not differentiated: valid while the nudge leaves the plan unchanged.
        if sparsa.llsa_plan(args["q"], args["k"], block=4, topk=2)["text"] == plan["text"]:
            assert abs(numeric - grad[idx]) < 2e-3 * max(1.0, np.abs(grad).max()), name


def test_llsa_plan_is_printable(rng):
    q, k = rand(rng, 1, 2, 300, 16), rand(rng, 1, 2, 300, 16)
    plan = sparsa.llsa_plan(q, k, block=4, topk=2)
    assert plan["levels"] >= 1 and plan["level_len"][0] == 300
    assert isinstance(plan["text"], str) and plan["text"]
    assert plan["index"].counts.shape[:2] == (1, 2)
    assert 0 < plan["keys_per_query"] < 300


def test_llsa_bad_block(rng):
    q = rand(rng, 1, 2, 64, 16)
    with pytest.raises(ValueError, match=r"block: expected >= 2, got 1"):
        sparsa.llsa(q, q, q, block=1)


# The stream argument (cuda backend; resolved before anything runs, so host arrays show it too).
@pytest.mark.parametrize("stream,error,match", [
    (True, TypeError, r"stream: expected a CUDA stream or an integer handle, got bool"),
    (-1, ValueError, r"stream: expected a non-negative integer handle, got -1"),
    ("s", TypeError, r"stream: expected a torch.cuda.Stream, a cupy stream or an integer handle, got str"),
])
def test_a_bad_stream_names_the_argument(stream, error, match):
    q = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(error, match=match):
        sparsa.dense(q, q, q, stream=stream)


# The device LoSA classes check their configuration before asking for a device.
def test_device_losa_config_errors_without_a_device():
    with pytest.raises(TypeError, match=r"dtype: expected bfloat16 or float16"):
        sparsa.DevicePagedKVCache(2, 64, 8, dtype="float32")
    with pytest.raises(ValueError, match=r"^heads_kv:"):
        sparsa.DevicePagedKVCache(0, 64, 8)
    with pytest.raises(ValueError, match=r"^block_size:"):
        sparsa.DeviceLosaState(1, 8, 2, 64, block_size=100)
