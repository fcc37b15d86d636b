"""Masks and variable-length batches from Python: against an independent numpy statement of the
masks (reference.attention with an explicit boolean mask), the argument forms, the errors."""
import numpy as np
import pytest

import sparsa
from reference import attention, rand, rel_err

# f32 fast path vs the f64 oracle (as test_core.py): relative errors around 1e-6.
F32_RTOL = 1e-5


def numpy_mask(kind, len_q, len_kv, block=0, left=0, right=0):
    """[len_q, len_kv] bool, True = visible, written from the definitions (docs/masks.md)."""
    i = np.arange(len_q)[:, None] + (len_kv - len_q)  # end-aligned query positions
    j = np.arange(len_kv)[None, :]
    if kind == "none":
        return np.ones((len_q, len_kv), dtype=bool)
    if kind == "causal":
        return j <= i
    if kind == "block_causal":
        return j // block <= np.floor_divide(i, block)
    if kind == "sliding_window":
        return (i - left <= j) & (j <= i + right)
    raise AssertionError(kind)


def same_lse(got, ref):
    """LSE equal to the oracle within F32_RTOL where finite, -inf exactly where it is -inf."""
    got = np.asarray(got, dtype=np.float64)
    empty = np.isneginf(ref)
    assert np.array_equal(np.isneginf(got), empty)
    if (~empty).any():
        assert np.abs(got[~empty] - ref[~empty]).max() <= F32_RTOL * max(1.0, np.abs(ref[~empty]).max())


MASKS = [
    ("causal", "causal", dict()),
    (("block_causal", 16), "block_causal", dict(block=16)),
    ("block_causal(5)", "block_causal", dict(block=5)),
    (("sliding_window", 20), "sliding_window", dict(left=20, right=20)),
    (("sliding_window", 30, 0), "sliding_window", dict(left=30, right=0)),
    (sparsa.Mask.sliding_window(0, 7), "sliding_window", dict(left=0, right=7)),
    (None, "none", dict()),
]


@pytest.mark.parametrize("backend", ["cpu", "cpu_ref"])
@pytest.mark.parametrize("mask,kind,params", MASKS)
@pytest.mark.parametrize("len_q,len_kv", [(77, 77), (40, 150), (150, 40)])
def test_dense_mask_matches_numpy(rng, backend, mask, kind, params, len_q, len_kv):
    q, k, v = rand(rng, 2, 4, len_q, 64), rand(rng, 2, 2, len_kv, 64), rand(rng, 2, 2, len_kv, 64)
    out, lse = sparsa.dense(q, k, v, mask=mask, backend=backend)
    visible = numpy_mask(kind, len_q, len_kv, **params)
    ref_o, ref_lse = attention(q, k, v, mask=np.broadcast_to(visible, (2, 4, len_q, len_kv)))
    assert rel_err(out, ref_o) < F32_RTOL
    same_lse(lse, ref_lse)
    if kind != "none" and (~visible).mean() > 0.1:  # negative control: the mask changed the answer
        plain, _ = attention(q, k, v)
        assert rel_err(out, plain) > 1e-3


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [np.float16])
def test_dense_mask_half_and_head_dims(rng, d, dtype):
    q, k, v = (rand(rng, 1, 2, 70, d, dtype=dtype) for _ in range(3))
    out, lse = sparsa.dense(q, k, v, mask=("block_causal", 16))
    ref_o, ref_lse = attention(q, k, v, mask=numpy_mask("block_causal", 70, 70, block=16))
    assert out.dtype == dtype
    assert rel_err(out, ref_o) < 2.0**-11 + F32_RTOL  # rounded to f16 once
    same_lse(lse, ref_lse)


def test_mask_visible_and_text_forms():
    m = sparsa.Mask.of(("sliding_window", 3, 1))
    assert m == sparsa.Mask.sliding_window(3, 1) and str(m) == "sliding_window(3,1)"
    assert str(sparsa.Mask.of("block_causal:8")) == "block_causal(8)"
    assert sparsa.Mask.of("sliding_window(4)") == sparsa.Mask.sliding_window(4)
    for len_q, len_kv in [(5, 9), (9, 5)]:
        visible = numpy_mask("sliding_window", len_q, len_kv, left=3, right=1)
        for i in range(len_q):
            for j in range(len_kv):
                assert m.visible(i, j, len_q, len_kv) == visible[i, j]


@pytest.mark.parametrize("bad", ["causl", ("block_causal", 0), ("sliding_window", -1), ("block_causal",),
                                 ("block_causal", 2.5), "block_causal(x)", ("window", 3)])
def test_bad_masks_name_the_argument(rng, bad):
    q = rand(rng, 1, 1, 8, 16)
    with pytest.raises(ValueError, match="^mask"):
        sparsa.dense(q, q, q, mask=bad)


def test_bad_mask_type(rng):
    q = rand(rng, 1, 1, 8, 16)
    with pytest.raises(TypeError, match="^mask"):
        sparsa.dense(q, q, q, mask=3)


@pytest.mark.parametrize("mask,kind,params", MASKS[:5])
def test_block_sparse_mask_and_masked_full_plan(rng, mask, kind, params):
    q, k, v = rand(rng, 1, 2, 100, 32), rand(rng, 1, 1, 130, 32), rand(rng, 1, 1, 130, 32)
    plan = sparsa.BlockIndex.full(1, 2, 100, 130, 16, 16, mask=mask)
    full = sparsa.BlockIndex.full(1, 2, 100, 130, 16, 16)
    # Fully masked key blocks are left out of the plan...
    assert plan.counts.sum() < full.counts.sum()
    # ... and the blocks kept are exactly those with a visible pair.
    visible = numpy_mask(kind, 100, 130, **params)
    for qb in range(plan.num_q_blocks):
        rows = visible[qb * 16:(qb + 1) * 16]
        expected = [kb for kb in range(-(-130 // 16)) if rows[:, kb * 16:(kb + 1) * 16].any()]
        assert list(plan.indices[0, 0, qb, :plan.counts[0, 0, qb]]) == expected
    ref_o, ref_lse = attention(q, k, v, mask=visible)
    for backend in ("cpu", "cpu_ref"):
        out, lse = sparsa.block_sparse(q, k, v, plan, mask=mask, backend=backend)
        assert rel_err(out, ref_o) < F32_RTOL
        same_lse(lse, ref_lse)


def test_ba_att_takes_the_mask(rng):
    q, k, v = rand(rng, 1, 2, 128, 32), rand(rng, 1, 2, 128, 32), rand(rng, 1, 2, 128, 32)
    plan = sparsa.ba_att_plan(q, k, block_q=32, block_kv=32, density=0.75)
    out, lse = sparsa.ba_att(q, k, v, block_q=32, block_kv=32, density=0.75, mask="causal")
    ref_o, ref_lse = sparsa.block_sparse(q, k, v, plan, mask="causal", backend="cpu_ref")
    assert rel_err(out, ref_o) < F32_RTOL
    plain, _ = sparsa.block_sparse(q, k, v, plan, backend="cpu_ref")
    assert rel_err(out, plain) > 1e-3


def test_selections_that_see_the_mask(rng):
    """mask_aware from Python: no kept block is hidden from its query block, the block of each
    query's last visible key is kept, every query attends; density 1 is masked dense; the sort
    with mask_aware is refused by name."""
    q, k, v = rand(rng, 1, 2, 200, 32), rand(rng, 1, 2, 200, 32), rand(rng, 1, 2, 200, 32)
    visible = numpy_mask("block_causal", 200, 200, block=24)
    for plan in (sparsa.ba_att_plan(q, k, block_q=32, block_kv=16, sort_q=False, sort_k=False, top_kappa=1,
                                    mask=("block_causal", 24), mask_aware=True),
                 sparsa.xattention_plan(q, k, block_q=32, block_kv=16, stride=8, top_kappa=1, force_first=False,
                                        mask=("block_causal", 24), mask_aware=True)):
        for h, qb in np.ndindex(2, plan.counts.shape[2]):
            kept = set(plan.indices[0, h, qb, :plan.counts[0, h, qb]].tolist())
            rows = visible[qb * 32:(qb + 1) * 32]
            assert all(rows[:, j * 16:(j + 1) * 16].any() for j in kept), (h, qb)
            assert {int(np.nonzero(r)[0][-1]) // 16 for r in rows} <= kept, (h, qb)
    ref_o, ref_lse = sparsa.dense(q, k, v, mask=("block_causal", 24), backend="cpu_ref")
    for out, lse in (sparsa.ba_att(q, k, v, block_q=32, block_kv=16, sort_q=False, sort_k=False, density=1.0,
                                   mask=("block_causal", 24), mask_aware=True),
                     sparsa.xattention(q, k, v, block_q=32, block_kv=16, stride=8, density=1.0,
                                       mask=("block_causal", 24), mask_aware=True)):
        assert rel_err(out, ref_o) < F32_RTOL
        same_lse(lse, ref_lse)
    sparse, lse = sparsa.ba_att(q, k, v, block_q=32, block_kv=16, sort_q=False, sort_k=False, top_kappa=1,
                                mask="causal", mask_aware=True)
    assert np.isfinite(lse).all()
    with pytest.raises(ValueError, match="mask_aware: the selection sees the mask only without the norm sorts"):
        sparsa.ba_att_plan(q, k, mask="causal", mask_aware=True)


# ---- variable-length batches -------------------------------------------------------------

LENS_Q = [33, 0, 90, 1, 5, 0]
LENS_KV = [33, 12, 70, 1, 0, 0]


def varlen_inputs(rng, heads_q=4, heads_kv=2, d=32, dtype=np.float32):
    tq, tkv = sum(LENS_Q), sum(LENS_KV)
    q = rand(rng, tq, heads_q, d, dtype=dtype)
    k = rand(rng, tkv, heads_kv, d, dtype=dtype)
    v = rand(rng, tkv, heads_kv, d, dtype=dtype)
    cu_q = np.concatenate([[0], np.cumsum(LENS_Q)]).astype(np.int32)
    cu_kv = np.concatenate([[0], np.cumsum(LENS_KV)]).astype(np.int32)
    return q, k, v, cu_q, cu_kv


def varlen_reference(q, k, v, cu_q, cu_kv, kind="none", params=None):
    """Each sequence through the numpy oracle: out [total_q, hq, d], lse [hq, total_q]."""
    out = np.zeros(q.shape, dtype=np.float64)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for s in range(len(cu_q) - 1):
        a, b, c, e = cu_q[s], cu_q[s + 1], cu_kv[s], cu_kv[s + 1]
        if b == a or e == c:
            continue
        qs, ks, vs = (x.transpose(1, 0, 2)[None] for x in (q[a:b], k[c:e], v[c:e]))
        o, l = attention(qs, ks, vs, mask=numpy_mask(kind, b - a, e - c, **(params or {})))
        out[a:b] = o[0].transpose(1, 0, 2)
        lse[:, a:b] = l[0]
    return out, lse


@pytest.mark.parametrize("backend", ["cpu", "cpu_ref"])
@pytest.mark.parametrize("mask,kind,params", MASKS)
def test_dense_varlen_matches_per_sequence_reference(rng, backend, mask, kind, params):
    q, k, v, cu_q, cu_kv = varlen_inputs(rng)
    out, lse = sparsa.dense_varlen(q, k, v, cu_q, cu_kv, mask=mask, backend=backend)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    ref_o, ref_lse = varlen_reference(q, k, v, cu_q, cu_kv, kind, params)
    assert rel_err(out, ref_o) < F32_RTOL
    same_lse(lse, ref_lse)
    # The sequence with queries and no keys (index 4): empty rows.
    a, b = cu_q[4], cu_q[5]
    assert np.all(out[a:b] == 0) and np.all(np.isneginf(lse[:, a:b]))


def test_dense_varlen_lists_and_f16(rng):
    q, k, v, cu_q, cu_kv = varlen_inputs(rng, dtype=np.float16)
    out, lse = sparsa.dense_varlen(q, k, v, list(cu_q), cu_kv.astype(np.int64), mask="causal")
    ref_o, ref_lse = varlen_reference(q, k, v, cu_q, cu_kv, "causal")
    assert out.dtype == np.float16
    assert rel_err(out, ref_o) < 2.0**-11 + F32_RTOL
    same_lse(lse, ref_lse)


def test_block_sparse_varlen(rng):
    q, k, v, cu_q, cu_kv = varlen_inputs(rng, heads_q=2, heads_kv=1)
    block = 16
    max_q, max_kv = max(LENS_Q), max(LENS_KV)
    nq, nkv = -(-max_q // block), -(-max_kv // block)
    counts = np.zeros((len(LENS_Q), 2, nq), dtype=np.int32)
    indices = np.zeros((len(LENS_Q), 2, nq, nkv), dtype=np.int32)
    for s, (lq, lkv) in enumerate(zip(LENS_Q, LENS_KV)):
        snkv = -(-lkv // block)
        for qb in range(-(-lq // block)):
            keep = [kb for kb in range(snkv) if (kb + qb + s) % 3 != 1]  # a fixed pattern
            counts[s, :, qb] = len(keep)
            indices[s, :, qb, :len(keep)] = keep
    index = sparsa.BlockIndex(block, block, counts, indices)
    out, lse = sparsa.block_sparse_varlen(q, k, v, cu_q, cu_kv, index, mask="causal")
    ref_o, ref_lse = sparsa.block_sparse_varlen(q, k, v, cu_q, cu_kv, index, mask="causal", backend="cpu_ref")
    assert rel_err(out, ref_o) < F32_RTOL
    same_lse(lse, ref_lse)
    # Against the numpy oracle over the listed blocks and the mask, sequence by sequence.
    for s, (lq, lkv) in enumerate(zip(LENS_Q, LENS_KV)):
        if lq == 0 or lkv == 0:
            continue
        a, c = cu_q[s], cu_kv[s]
        visible = numpy_mask("causal", lq, lkv)
        listed = np.zeros((lq, lkv), dtype=bool)
        for qb in range(-(-lq // block)):
            for kb in indices[s, 0, qb, :counts[s, 0, qb]]:
                listed[qb * block:(qb + 1) * block, kb * block:(kb + 1) * block] = True
        qs, ks, vs = (x.transpose(1, 0, 2)[None] for x in (q[a:a + lq], k[c:c + lkv], v[c:c + lkv]))
        o, l = attention(qs, ks, vs, mask=visible & listed)
        assert rel_err(out[a:a + lq], o[0].transpose(1, 0, 2)) < F32_RTOL
        same_lse(lse[:, a:a + lq], l[0])


@pytest.mark.parametrize("cu,message", [
    ([1, 33, 33, 123, 124, 129, 129], r"^cu_seqlens_q: expected cu_seqlens_q\[0\] = 0"),
    ([0, 33, 20, 123, 124, 129, 129], "^cu_seqlens_q: offsets must not decrease"),
    ([0, 33, 33, 123, 124, 128, 128], "^cu_seqlens_q: the last offset"),
    ([0, 129], "^cu_seqlens_kv: expected 2 offsets"),
])
def test_varlen_bad_offsets_name_the_argument(rng, cu, message):
    q, k, v, cu_q, cu_kv = varlen_inputs(rng)
    with pytest.raises(ValueError, match=message):
        sparsa.dense_varlen(q, k, v, cu, cu_kv)


def test_varlen_wrong_rank(rng):
    q = rand(rng, 1, 8, 2, 16)
    with pytest.raises(ValueError, match=r"^q: expected 3 dimensions \[total_q, heads_q, head_dim\]"):
        sparsa.dense_varlen(q, q, q, [0, 8], [0, 8])
