"""Block selectors (BA-Att, XAttention) and the oracle metrics on numpy arrays (runs in CI).

Every check is against a property or an independent numpy computation, never against
numbers the library printed.
"""
import math

import numpy as np
import pytest

import sparsa
from reference import attention, rand, rel_err

# f32 executor vs the f64 oracle (see test_core.py).
F32_RTOL = 1e-5
# Block logits: f64 sums in the core, f32 storage; numpy in f64. Rounding to f32 is
# 2^-24 relative; 1e-5 of the largest logit leaves room for the f32 inputs' products.
LOGIT_RTOL = 1e-5


def ceil_div(a, b):
    return -(-a // b)


def inverse(perm):
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm), dtype=perm.dtype)
    return inv


def plan_mask(plan, b, hq, hkv, lq, lk):
    """Dense visibility [b, hq, lq, lk] of a plan, in original token order."""
    group = hq // hkv
    mask = np.zeros((b, hq, lq, lk), bool)
    for bb, hh in np.ndindex(b, hq):
        pos_q = inverse(plan.perm_q[bb, hh]) if plan.perm_q is not None else np.arange(lq)
        pos_k = inverse(plan.perm_kv[bb, hh // group]) if plan.perm_kv is not None else np.arange(lk)
        qblock = pos_q // plan.block_q  # block of each original query token
        kblock = pos_k // plan.block_kv
        for qb in range(plan.num_q_blocks):
            kept = plan.indices[bb, hh, qb, : plan.counts[bb, hh, qb]]
            mask[bb, hh][np.ix_(qblock == qb, np.isin(kblock, kept))] = True
    return mask


def kept_sets(plan):
    b, h, nq = plan.counts.shape
    return {(bb, hh, qb): set(plan.indices[bb, hh, qb, : plan.counts[bb, hh, qb]].tolist())
            for bb, hh, qb in np.ndindex(b, h, nq)}


def check_plan_well_formed(plan, b, hq, lq, lk):
    nq, nk = ceil_div(lq, plan.block_q), ceil_div(lk, plan.block_kv)
    assert plan.counts.shape == (b, hq, nq) and plan.counts.dtype == np.int32
    assert plan.indices.dtype == np.int32 and plan.indices.shape[:3] == (b, hq, nq)
    for bb, hh, qb in np.ndindex(b, hq, nq):
        row = plan.indices[bb, hh, qb, : plan.counts[bb, hh, qb]]
        assert ((0 <= row) & (row < nk)).all() and (np.diff(row) > 0).all()


# ---- BA-Att ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu", "cpu_ref"])
@pytest.mark.parametrize("compensation", ["diagonal", "exact", "trace"])
def test_ba_att_every_block_kept_equals_dense(rng, backend, compensation):
    # GQA, partial last blocks on both sides, sorted tokens: with every key block kept the
    # permutations must not change the result.
    q, k, v = rand(rng, 2, 4, 70, 32), rand(rng, 2, 2, 90, 32), rand(rng, 2, 2, 90, 32)
    out, lse = sparsa.ba_att(q, k, v, block_q=16, block_kv=16, density=1.0, compensation=compensation,
                             backend=backend)
    ref_o, ref_lse = attention(q, k, v)
    assert isinstance(out, np.ndarray) and out.shape == q.shape and lse.shape == (2, 4, 70)
    assert rel_err(out, ref_o) < F32_RTOL and rel_err(lse, ref_lse) < F32_RTOL


def test_ba_att_f16_every_block_kept_equals_dense(rng):
    q, k, v = (rand(rng, 1, 2, 33, 64, dtype=np.float16) for _ in range(3))
    out, lse = sparsa.ba_att(q, k, v, block_q=8, block_kv=8, top_kappa=100)
    ref_o, ref_lse = attention(q, k, v)
    assert out.dtype == np.float16
    # f16 output rounding (half an ulp, 2^-11 relative) plus the f32 accumulation term.
    assert rel_err(out, ref_o) < 2.0**-11 + F32_RTOL and rel_err(lse, ref_lse) < F32_RTOL


@pytest.mark.parametrize("sort", [True, False])
def test_ba_att_output_is_attention_under_its_plan(rng, sort):
    b, hq, hkv, lq, lk, d = 1, 4, 2, 77, 100, 16
    q, k, v = rand(rng, b, hq, lq, d), rand(rng, b, hkv, lk, d), rand(rng, b, hkv, lk, d)
    opts = dict(block_q=16, block_kv=16, density=0.3, sort_q=sort, sort_k=sort)
    plan = sparsa.ba_att_plan(q, k, **opts)
    assert (plan.perm_q is not None) == sort and (plan.perm_kv is not None) == sort
    out, lse = sparsa.ba_att(q, k, v, **opts)
    ref_o, ref_lse = attention(q, k, v, mask=plan_mask(plan, b, hq, hkv, lq, lk))
    assert rel_err(out, ref_o) < F32_RTOL and rel_err(lse, ref_lse) < F32_RTOL
    o2, l2 = sparsa.block_sparse(q, k, v, plan)
    assert np.array_equal(out, o2) and np.array_equal(lse, l2)


def test_ba_att_writes_into_given_outputs(rng):
    q, k, v = rand(rng, 1, 2, 40, 16), rand(rng, 1, 2, 40, 16), rand(rng, 1, 2, 40, 16)
    out = np.full(q.shape, 5.0, np.float32)
    lse = np.full(q.shape[:3], 5.0, np.float32)
    o, l = sparsa.ba_att(q, k, v, block_q=8, block_kv=8, top_kappa=2, out=out, lse=lse)
    assert o is out and l is lse
    plan = sparsa.ba_att_plan(q, k, block_q=8, block_kv=8, top_kappa=2)
    ref_o, _ = attention(q, k, v, mask=plan_mask(plan, 1, 2, 2, 40, 40))
    assert rel_err(out, ref_o) < F32_RTOL


@pytest.mark.parametrize("lk,block_kv", [(90, 16), (128, 32), (17, 4)])
@pytest.mark.parametrize("fraction", [0.05, 0.3, 0.7, 1.0])
def test_density_budget_sets_the_count(rng, lk, block_kv, fraction):
    q, k = rand(rng, 1, 2, 50, 16), rand(rng, 1, 1, lk, 16)
    plan = sparsa.ba_att_plan(q, k, block_q=10, block_kv=block_kv, density=fraction)
    check_plan_well_formed(plan, 1, 2, 50, lk)
    nk = ceil_div(lk, block_kv)
    # ceil(F * nk), at least one block; 1e-9 absorbs decimal fractions inexact in binary.
    expected = max(1, math.ceil(fraction * nk - 1e-9))
    assert (plan.counts == expected).all()
    if lk % block_kv == 0:  # full blocks: the token density is the block density
        assert plan.density(50, lk) == pytest.approx(expected / nk)


@pytest.mark.parametrize("kappa", [1, 3, 6, 50])
def test_top_kappa_keeps_the_highest_logits(rng, kappa):
    q, k = rand(rng, 2, 2, 64, 16), rand(rng, 2, 2, 96, 16)
    opts = dict(block_q=16, block_kv=16)
    plan = sparsa.ba_att_plan(q, k, top_kappa=kappa, **opts)
    scores = sparsa.ba_att_scores(q, k, **opts)
    nk = 6
    assert (plan.counts == min(kappa, nk)).all()
    for (bb, hh, qb), kept in kept_sets(plan).items():
        row = scores.logits[bb, hh, qb]
        # stable descending order: ties go to the lower index
        top = np.argsort(-row.astype(np.float64), kind="stable")[: min(kappa, nk)]
        assert kept == set(top.tolist())


@pytest.mark.parametrize("tau", [0.3, 0.8, 0.95, 1.0])
def test_mass_budget_is_the_smallest_prefix_reaching_tau(rng, tau):
    q, k = rand(rng, 1, 3, 48, 16), rand(rng, 1, 3, 80, 16)
    # Scaled-up q sharpens the block softmax so the rows need different numbers of blocks.
    q *= 3
    opts = dict(block_q=16, block_kv=8)
    plan = sparsa.ba_att_plan(q, k, tau=tau, **opts)
    scores = sparsa.ba_att_scores(q, k, **opts)
    for (bb, hh, qb), kept in kept_sets(plan).items():
        row = scores.logits[bb, hh, qb].astype(np.float64)
        p = np.exp(row - row.max())
        p /= p.sum()
        order = np.argsort(-row, kind="stable")
        cumulative = np.cumsum(p[order])
        n = int(np.searchsorted(cumulative, tau * cumulative[-1] * (1 - 1e-12))) + 1
        n = min(n, len(row))
        assert kept == set(order[:n].tolist())
        assert p[list(kept)].sum() >= tau * (1 - 1e-9)
        if n > 1:  # minimal: one block fewer misses tau
            assert cumulative[n - 2] < tau


def numpy_block_logits(q, k, perm_q, perm_kv, block_q, block_kv, compensation):
    """BA-Att Eq. 2 (+ Eq. 14 / exact / Eq. 13 with beta = 1), f64, independent of the core."""
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d)
    nq, nk = ceil_div(lq, block_q), ceil_div(k.shape[2], block_kv)
    out = np.zeros((b, hq, nq, nk))

    def stats(x, perm, block, n):
        xs = x[perm].astype(np.float64)
        blocks = [xs[i * block:(i + 1) * block] for i in range(n)]
        means = [blk.mean(0) for blk in blocks]
        covs = [np.cov(blk.T, bias=True) if len(blk) > 1 else np.zeros((d, d)) for blk in blocks]
        return means, covs

    for bb, hh in np.ndindex(b, hq):
        hk = hh // (hq // hkv)
        qm, qc = stats(q[bb, hh], perm_q[bb, hh], block_q, nq)
        km, kc = stats(k[bb, hk], perm_kv[bb, hk], block_kv, nk)
        for i, j in np.ndindex(nq, nk):
            logit = scale * qm[i] @ km[j]
            if compensation == "diagonal":
                vq, vk = np.diag(qc[i]), np.diag(kc[j])
                delta = (vq * km[j] ** 2 + vk * qm[i] ** 2 + vq * vk).sum()
            elif compensation == "exact":
                delta = km[j] @ qc[i] @ km[j] + qm[i] @ kc[j] @ qm[i] + np.trace(qc[i] @ kc[j])
            elif compensation == "trace":
                delta = np.trace(qc[i] @ kc[j])
            else:
                delta = 0.0
            out[bb, hh, i, j] = logit + scale**2 * delta
    return out


@pytest.mark.parametrize("compensation", ["none", "diagonal", "exact", "trace"])
def test_block_logits_match_numpy(rng, compensation):
    q, k = rand(rng, 1, 2, 37, 8), rand(rng, 1, 1, 45, 8)
    opts = dict(block_q=8, block_kv=16, compensate=compensation != "none")
    if compensation != "none":
        opts["compensation"] = compensation
    scores = sparsa.ba_att_scores(q, k, **opts)
    expected = numpy_block_logits(q, k, scores.perm_q, scores.perm_kv, 8, 16, compensation)
    assert scores.logits.shape == expected.shape and scores.logits.dtype == np.float32
    assert rel_err(scores.logits, expected) < LOGIT_RTOL


def test_beta_scales_the_compensation(rng):
    q, k = rand(rng, 1, 2, 32, 8), rand(rng, 1, 2, 32, 8)
    plain = sparsa.ba_att_scores(q, k, block_q=8, block_kv=8, compensate=False).logits.astype(np.float64)
    one = sparsa.ba_att_scores(q, k, block_q=8, block_kv=8, beta=1.0).logits.astype(np.float64)
    half = sparsa.ba_att_scores(q, k, block_q=8, block_kv=8, beta=0.5).logits.astype(np.float64)
    assert np.abs(one - plain).max() > 1e-3  # the compensation is not zero on this data
    assert np.allclose(half - plain, 0.5 * (one - plain), atol=1e-5)


@pytest.mark.parametrize("window", [0, 32])
def test_perms_are_norm_sorting_permutations(rng, window):
    b, hq, hkv, lq, lk, d = 2, 4, 2, 96, 64, 16
    q, k = rand(rng, b, hq, lq, d), rand(rng, b, hkv, lk, d)
    plan = sparsa.ba_att_plan(q, k, block_q=16, block_kv=16, sort_window=window)
    assert plan.perm_q.shape == (b, hq, lq) and plan.perm_kv.shape == (b, hkv, lk)
    assert plan.perm_q.dtype == np.int32 and plan.perm_kv.dtype == np.int32
    for x, perm, length in ((q, plan.perm_q, lq), (k, plan.perm_kv, lk)):
        w = window or length
        for bb, hh in np.ndindex(perm.shape[:2]):
            p = perm[bb, hh]
            assert np.array_equal(np.sort(p), np.arange(length))  # a permutation
            norms = np.linalg.norm(x[bb, hh].astype(np.float64), axis=-1)[p]
            for start in range(0, length, w):
                # each window holds its own tokens, ascending in norm
                assert set(p[start:start + w].tolist()) == set(range(start, min(start + w, length)))
                assert (np.diff(norms[start:start + w]) >= 0).all()


def test_no_sort_gives_identity_blocks(rng):
    q, k = rand(rng, 1, 2, 32, 8), rand(rng, 1, 2, 32, 8)
    plan = sparsa.ba_att_plan(q, k, block_q=8, block_kv=8, sort_q=False, sort_k=True)
    assert plan.perm_q is None and plan.perm_kv is not None


# ---- XAttention ----------------------------------------------------------------------------

def numpy_xattention_mass(q, k, block_q, block_kv, stride):
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d)
    gq, gk = ceil_div(lq, stride), ceil_div(lk, stride)
    nq, nk = ceil_div(lq, block_q), ceil_div(lk, block_kv)
    x = np.zeros((b, hq, nq, nk))
    for bb, hh in np.ndindex(b, hq):
        qq = q[bb, hh].astype(np.float64)
        kk = k[bb, hh // (hq // hkv)].astype(np.float64)
        a = np.zeros((gq, gk))
        for g, c in np.ndindex(gq, gk):
            for s in range(stride):
                i, j = g * stride + stride - 1 - s, c * stride + s
                if i < lq and j < lk:
                    a[g, c] += qq[i] @ kk[j]
        a *= scale / stride
        p = np.exp(a - a.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        for g, c in np.ndindex(gq, gk):
            x[bb, hh, g * stride // block_q, c * stride // block_kv] += p[g, c]
    return x


@pytest.mark.parametrize("backend", ["cpu", "cpu_ref"])
def test_xattention_scores_match_numpy(rng, backend):
    q, k = rand(rng, 1, 4, 70, 16), rand(rng, 1, 2, 53, 16)
    x = sparsa.xattention_scores(q, k, block_q=16, block_kv=8, stride=4, backend=backend)
    expected = numpy_xattention_mass(q, k, 16, 8, 4)
    assert x.shape == expected.shape and x.dtype == np.float32
    # f32 products in the fast path over 4 * 16 terms: ~1e-6 relative; 1e-5 margin.
    assert rel_err(x, expected) < 1e-5
    # each row sums to the number of stride groups in its query block (70 = 4 full blocks of 4 groups + 2 groups)
    groups = np.array([4, 4, 4, 4, 2])
    assert np.allclose(x.sum(-1), groups[None, None, :], rtol=1e-5)


@pytest.mark.parametrize("lq,lk", [(64, 64), (48, 96), (80, 40)])
def test_xattention_forces_first_and_diagonal(rng, lq, lk):
    q, k = rand(rng, 1, 2, lq, 16), rand(rng, 1, 2, lk, 16)
    plan = sparsa.xattention_plan(q, k, block_q=16, block_kv=16, stride=4, top_kappa=1)
    assert plan.perm_q is None and plan.perm_kv is None
    check_plan_well_formed(plan, 1, 2, lq, lk)
    nq, nk = ceil_div(lq, 16), ceil_div(lk, 16)
    for (bb, hh, qb), kept in kept_sets(plan).items():
        diagonal = qb + nk - nq  # aligned to the end of the keys
        forced = {0} | ({diagonal} if 0 <= diagonal < nk else set())
        assert forced <= kept
        assert len(kept) == max(1, len(forced))  # forced blocks count against kappa = 1
    # Without forcing, top_kappa=1 keeps exactly the heaviest block.
    free = sparsa.xattention_plan(q, k, block_q=16, block_kv=16, stride=4, top_kappa=1, force_first=False,
                                  force_diagonal=False)
    x = sparsa.xattention_scores(q, k, block_q=16, block_kv=16, stride=4)
    assert (free.counts == 1).all()
    assert np.array_equal(free.indices[..., 0], np.argmax(x, axis=-1))


def test_xattention_default_budget_reaches_tau(rng):
    q, k = rand(rng, 1, 2, 64, 16), rand(rng, 1, 2, 64, 16)
    plan = sparsa.xattention_plan(q, k, block_q=8, block_kv=8, stride=4)  # tau = 0.9
    x = sparsa.xattention_scores(q, k, block_q=8, block_kv=8, stride=4).astype(np.float64)
    for (bb, hh, qb), kept in kept_sets(plan).items():
        row = x[bb, hh, qb]
        assert row[list(kept)].sum() >= 0.9 * row.sum() * (1 - 1e-6)


def test_xattention_output_is_attention_under_its_plan(rng):
    q, k, v = rand(rng, 1, 2, 64, 16), rand(rng, 1, 1, 64, 16), rand(rng, 1, 1, 64, 16)
    plan = sparsa.xattention_plan(q, k, block_q=16, block_kv=16, stride=8, density=0.5)
    out, lse = sparsa.xattention(q, k, v, block_q=16, block_kv=16, stride=8, density=0.5)
    ref_o, ref_lse = attention(q, k, v, mask=plan_mask(plan, 1, 2, 1, 64, 64))
    assert rel_err(out, ref_o) < F32_RTOL and rel_err(lse, ref_lse) < F32_RTOL


# ---- oracle metrics ------------------------------------------------------------------------

def numpy_block_mass(q, k, block_q, block_kv, perm_q=None, perm_kv=None):
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    group = hq // hkv
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), np.repeat(k, group, 1).astype(np.float64)) / math.sqrt(d)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    nq, nk = ceil_div(lq, block_q), ceil_div(lk, block_kv)
    mass = np.zeros((b, hq, nq, nk))
    for bb, hh in np.ndindex(b, hq):
        pos_q = inverse(perm_q[bb, hh]) if perm_q is not None else np.arange(lq)
        pos_k = inverse(perm_kv[bb, hh // group]) if perm_kv is not None else np.arange(lk)
        np.add.at(mass[bb, hh], (pos_q[:, None] // block_q, pos_k[None, :] // block_kv), a[bb, hh])
        mass[bb, hh] /= np.bincount(pos_q // block_q, minlength=nq)[:, None]
    return mass, s


@pytest.mark.parametrize("backend", ["cpu", "cpu_ref"])
def test_oracle_mass_matches_numpy_on_a_permuted_partition(rng, backend):
    q, k = rand(rng, 1, 4, 45, 16), rand(rng, 1, 2, 70, 16)
    plan = sparsa.ba_att_plan(q, k, block_q=16, block_kv=8, density=0.25)
    oracle = sparsa.oracle_blocks(q, k, plan, backend=backend)
    expected, _ = numpy_block_mass(q, k, 16, 8, plan.perm_q, plan.perm_kv)
    assert oracle.mass.shape == expected.shape == (1, 4, 3, 9)
    assert (oracle.num_q_blocks, oracle.num_kv_blocks) == (3, 9)
    assert np.abs(oracle.mass - expected).max() < 1e-5  # masses in [0, 1], f32 storage
    assert np.allclose(oracle.mass.sum(-1), 1.0, atol=1e-5)  # Eq. 3 rows sum to 1


def test_oracle_logit_range(rng):
    q, k = rand(rng, 1, 2, 32, 8), rand(rng, 1, 2, 40, 8)
    oracle = sparsa.oracle_blocks(q, k, sparsa.BlockPartition(8, 8))
    _, s = numpy_block_mass(q, k, 8, 8)
    blocks = s.reshape(1, 2, 4, 8, 5, 8)
    assert np.allclose(oracle.logit_max, blocks.max(axis=(3, 5)), atol=1e-5)
    assert np.allclose(oracle.logit_min, blocks.min(axis=(3, 5)), atol=1e-5)
    assert (oracle.logit_min <= oracle.logit_max).all()


def test_mass_recall_of_full_plan_is_one_and_of_a_plan_is_its_kept_mass(rng):
    q, k = rand(rng, 2, 2, 64, 16), rand(rng, 2, 2, 64, 16)
    full = sparsa.BlockIndex.full(2, 2, 64, 64, 16, 16)
    assert sparsa.mass_recall(full, sparsa.oracle_blocks(q, k, full)) == pytest.approx(1.0, abs=1e-5)
    plan = sparsa.ba_att_plan(q, k, block_q=16, block_kv=16, top_kappa=2)
    oracle = sparsa.oracle_blocks(q, k, plan)
    recall = sparsa.mass_recall(plan, oracle)
    kept = [oracle.mass[key][list(blocks)].sum() for key, blocks in kept_sets(plan).items()]
    assert recall == pytest.approx(np.mean(kept), abs=1e-6)
    assert 0 < recall < 1
    # An oracle-optimal plan (the two heaviest blocks per row) recalls at least as much.
    best = np.sort(oracle.mass, axis=-1)[..., -2:].sum(-1).mean()
    assert recall <= best + 1e-6


def test_mass_recall_from_lse_equals_mass_recall_on_full_blocks(rng):
    # Lengths divisible by the blocks: every block full, so the per-token and per-block
    # recalls are the same quantity.
    q, k, v = rand(rng, 1, 2, 64, 16), rand(rng, 1, 2, 96, 16), rand(rng, 1, 2, 96, 16)
    plan = sparsa.ba_att_plan(q, k, block_q=16, block_kv=16, density=0.4)
    _, lse_plan = sparsa.block_sparse(q, k, v, plan)
    _, lse_dense = sparsa.dense(q, k, v)
    from_lse = sparsa.mass_recall_from_lse(lse_plan, lse_dense)
    from_oracle = sparsa.mass_recall(plan, sparsa.oracle_blocks(q, k, plan))
    assert from_lse == pytest.approx(from_oracle, abs=1e-5)
    assert sparsa.mass_recall_from_lse(lse_dense, lse_dense) == pytest.approx(1.0)


def test_relative_error(rng):
    a = rand(rng, 2, 3, 4, 5)
    b = a + 0.01 * rand(rng, 2, 3, 4, 5)
    expected = np.linalg.norm((b - a).astype(np.float64)) / np.linalg.norm(a.astype(np.float64))
    assert sparsa.relative_error(b, a) == pytest.approx(expected, rel=1e-6)
    assert sparsa.relative_error(a, a) == 0.0
    # strided views are read through their strides
    assert sparsa.relative_error(b[:, ::2], a[:, ::2]) == pytest.approx(
        np.linalg.norm((b[:, ::2] - a[:, ::2]).astype(np.float64)) / np.linalg.norm(a[:, ::2].astype(np.float64)),
        rel=1e-6)
    # f16 against f32
    assert sparsa.relative_error(a.astype(np.float16), a) < 2.0**-11


def test_relative_error_of_ba_att_against_dense(rng):
    # The relative error of a sparse output against dense is in [0, 2] for outputs that are
    # convex combinations of the same v rows, and 0 with every block kept.
    q, k, v = rand(rng, 1, 2, 64, 16), rand(rng, 1, 2, 64, 16), rand(rng, 1, 2, 64, 16)
    dense_o, _ = sparsa.dense(q, k, v)
    full_o, _ = sparsa.ba_att(q, k, v, block_q=16, block_kv=16, density=1.0)
    sparse_o, _ = sparsa.ba_att(q, k, v, block_q=16, block_kv=16, density=0.25)
    assert sparsa.relative_error(full_o, dense_o) < F32_RTOL
    assert 0 < sparsa.relative_error(sparse_o, dense_o) < 2


def test_deviation_bound_holds_and_matches_numpy(rng):
    q, k = rand(rng, 1, 2, 48, 8), rand(rng, 1, 1, 40, 8)
    plan = sparsa.ba_att_plan(q, k, block_q=16, block_kv=8, density=0.5)
    oracle = sparsa.oracle_blocks(q, k, plan)
    result = sparsa.deviation_bound(q, k, plan, oracle)
    assert result.violations == 0  # Eq. 8 is a bound
    assert result.bound.shape == result.deviation.shape == (1, 2, 3, 5)
    assert (result.deviation <= result.bound * (1 + 1e-4) + 1e-4).all()
    assert len(result.pearson_per_head) == 2 and -1 <= result.pearson_overall <= 1
    # Independent numpy: Eq. 7 radii / norms and the observed deviation on the same partition.
    scale = 1 / math.sqrt(8)
    for hh in range(2):
        qs = q[0, hh][plan.perm_q[0, hh]].astype(np.float64)
        ks = k[0, 0][plan.perm_kv[0, 0]].astype(np.float64)
        for i, j in np.ndindex(3, 5):
            qi, kj = qs[16 * i:16 * (i + 1)], ks[8 * j:8 * (j + 1)]
            qm, km = qi.mean(0), kj.mean(0)
            rq, rk = np.linalg.norm(qi - qm, axis=1).max(), np.linalg.norm(kj - km, axis=1).max()
            mq, mk = np.linalg.norm(qi, axis=1).max(), np.linalg.norm(kj, axis=1).max()
            u = scale * (rq * mk + mq * rk + rq * rk)
            dev = np.abs(scale * qi @ kj.T - scale * qm @ km).max()
            assert result.bound[0, hh, i, j] == pytest.approx(u, rel=1e-5)
            # the deviation comes from the oracle's f32 logits
            assert result.deviation[0, hh, i, j] == pytest.approx(dev, rel=1e-4, abs=1e-5)
    assert result.mean_bound == pytest.approx(float(result.bound.astype(np.float64).mean()), rel=1e-5)


def test_deviation_bound_errors(qk):
    q, k = qk
    oracle = sparsa.oracle_blocks(q, k, sparsa.BlockPartition(8, 8))
    with pytest.raises(ValueError, match=r"oracle: computed on a different partition or shape"):
        sparsa.deviation_bound(q, k, sparsa.BlockPartition(16, 16), oracle)
    broken = sparsa.OracleBlocks(8, 8, oracle.mass, oracle.logit_max[:, :1], oracle.logit_min)
    with pytest.raises(ValueError, match=r"oracle.logit_max: expected f32 \[batch, heads_q, num_q_blocks, num_kv_blocks\] "
                                         r"equal in shape to oracle.mass \[1, 2, 4, 4\], got f32 \[1, 1, 4, 4\]"):
        sparsa.deviation_bound(q, k, sparsa.BlockPartition(8, 8), broken)


# ---- errors: the argument is named, the type says what went wrong --------------------------

@pytest.fixture
def qk(rng):
    return rand(rng, 1, 2, 32, 16), rand(rng, 1, 2, 32, 16)


@pytest.mark.parametrize("kwargs,message", [
    (dict(top_kappa=2, density=0.5), r"budget: expected at most one of top_kappa, density or tau, got top_kappa=2, density=0.5"),
    (dict(density=1.5), r"budget: density expects a fraction of key blocks in \(0, 1\], got 1.5"),
    (dict(density=0.0), r"budget: density expects a fraction"),
    (dict(top_kappa=0), r"budget: top_kappa expects an integer kappa >= 1"),
    (dict(top_kappa=2.5), r"budget: top_kappa expects an integer kappa >= 1"),
    (dict(tau=float("nan")), r"budget: mass expects a cumulative-mass threshold tau in \(0, 1\]"),
    (dict(compensation="full"), r"compensation: expected diagonal, exact or trace, got 'full'"),
    (dict(block_q=0), r"block_q: expected a block size > 0 tokens, got 0"),
    (dict(block_kv=-4), r"block_kv: expected a block size > 0 tokens, got -4"),
    (dict(sort_window=12), r"sort_window: expected a multiple of block_q \(8\) and block_kv \(8\)"),
    (dict(sort_window=-8), r"sort_window: expected 0 \(global sort\) or a positive window, got -8"),
    (dict(beta=float("inf")), r"beta: expected a finite number"),
    (dict(scale=0.0), r"scale: expected a finite positive number"),
    (dict(num_threads=-1), r"num_threads: expected 0..256 \(0 = hardware concurrency\), got -1"),
    (dict(backend="tpu"), r"backend: expected cpu_ref, cpu or cuda"),
])
def test_ba_att_plan_errors(qk, kwargs, message):
    q, k = qk
    opts = dict(block_q=8, block_kv=8)
    opts.update(kwargs)
    with pytest.raises(ValueError, match=message):
        sparsa.ba_att_plan(q, k, **opts)


def test_ba_att_budget_type_error(qk):
    with pytest.raises(TypeError, match=r"budget: density expects a number, got str"):
        sparsa.ba_att_plan(*qk, density="half")


def test_ba_att_cuda_backend_refuses_host_arrays(qk):
    with pytest.raises(ValueError, match=r"q: the cuda backend expected a tensor on a cuda device, got cpu"):
        sparsa.ba_att_plan(*qk, backend="cuda")


def test_ba_att_shape_and_dtype_errors(rng):
    q = rand(rng, 1, 6, 32, 16)
    with pytest.raises(ValueError, match=r"k: heads_q \(6\) must be a multiple of heads_kv \(4\)"):
        sparsa.ba_att_plan(q, rand(rng, 1, 4, 32, 16))
    with pytest.raises(ValueError, match=r"k: head_dim 8 differs from q's head_dim 16"):
        sparsa.ba_att_plan(q, rand(rng, 1, 2, 32, 8))
    with pytest.raises(TypeError, match=r"k: dtype f16 differs from q's f32"):
        sparsa.ba_att_plan(q, rand(rng, 1, 2, 32, 16, dtype=np.float16))
    with pytest.raises(ValueError, match=r"q: expected 4 dimensions"):
        sparsa.ba_att_plan(q[0], q)
    with pytest.raises(TypeError, match=r"q: unsupported dtype float64"):
        sparsa.ba_att_plan(q.astype(np.float64), q)


def test_ba_att_non_finite_inputs(rng):
    q, k, v = rand(rng, 1, 2, 32, 16), rand(rng, 1, 2, 32, 16), rand(rng, 1, 2, 32, 16)
    q[0, 1, 7, 3] = np.nan
    with pytest.raises(ValueError, match=r"q: contains NaN at \[0, 1, 7, 3\]"):
        sparsa.ba_att_plan(q, k, block_q=8, block_kv=8, check_finite=True)
    with pytest.raises(ValueError, match=r"q: token \[0, 1, 7\] has a NaN/Inf norm"):
        sparsa.ba_att_plan(q, k, block_q=8, block_kv=8)
    v[0, 0, 2, 2] = np.inf
    with pytest.raises(ValueError, match=r"v: contains Inf"):
        sparsa.ba_att(k, k, v, block_q=8, block_kv=8, check_finite=True)


@pytest.mark.parametrize("kwargs,message", [
    (dict(stride=3), r"stride: expected a divisor of block_q \(8\) and block_kv \(8\)"),
    (dict(stride=0), r"stride: expected >= 1, got 0"),
    (dict(tau=0.0), r"budget: mass expects a cumulative-mass threshold tau in \(0, 1\], got 0"),
    (dict(density=0.5, tau=0.9), r"budget: expected at most one of top_kappa, density or tau, got density=0.5, tau=0.9"),
    (dict(block_q=0), r"block_q: expected a block size > 0 tokens, got 0"),
])
def test_xattention_errors(qk, kwargs, message):
    opts = dict(block_q=8, block_kv=8, stride=4)
    opts.update(kwargs)
    with pytest.raises(ValueError, match=message):
        sparsa.xattention_plan(*qk, **opts)


def test_oracle_errors(rng, qk):
    q, k = qk
    with pytest.raises(ValueError, match=r"partition.block_q: expected > 0, got 0"):
        sparsa.oracle_blocks(q, k, sparsa.BlockPartition(0, 8))
    bad = np.tile(np.arange(32, dtype=np.int32), (1, 2, 1))
    bad[0, 1, 5] = 4
    with pytest.raises(ValueError, match=r"partition.perm_q: row \[0, 1\] is not a permutation of 0..31 \(entry 5 is 4\)"):
        sparsa.oracle_blocks(q, k, sparsa.BlockPartition(8, 8, perm_q=bad))
    with pytest.raises(TypeError, match=r"partition: expected sparsa.BlockPartition or sparsa.BlockIndex, got tuple"):
        sparsa.oracle_blocks(q, k, (8, 8))
    with pytest.raises(RuntimeError, match=r"backend: the oracle runs on cpu or cpu_ref, got cuda"):
        sparsa.oracle_blocks(q, k, backend="cuda")


def test_mass_recall_errors(qk):
    q, k = qk
    plan = sparsa.ba_att_plan(q, k, block_q=8, block_kv=8, top_kappa=2)
    with pytest.raises(ValueError, match=r"plan: blocks 8x8 differ from the oracle's 16x16; compute the oracle on the plan's partition"):
        sparsa.mass_recall(plan, sparsa.oracle_blocks(q, k, sparsa.BlockPartition(16, 16)))
    longer = np.concatenate([q, q], axis=2)
    with pytest.raises(ValueError, match=r"index.counts: "):  # same blocks, a different length
        sparsa.mass_recall(plan, sparsa.oracle_blocks(longer, k, sparsa.BlockPartition(8, 8)))
    oracle = sparsa.oracle_blocks(q, k, plan)
    plan.indices[0, 1, 2, 1] = 9
    with pytest.raises(ValueError, match=r"index.indices\[0, 1, 2, 1\]: key block 9 is outside"):
        sparsa.mass_recall(plan, oracle)
    with pytest.raises(ValueError, match=r"oracle.mass: expected f32 \[batch, heads_q, num_q_blocks, num_kv_blocks\]"):
        sparsa.mass_recall(plan, sparsa.OracleBlocks(8, 8, oracle.mass[0], oracle.mass, oracle.mass))
    with pytest.raises(TypeError, match=r"oracle: expected sparsa.OracleBlocks, got dict"):
        sparsa.mass_recall(plan, {})
    with pytest.raises(TypeError, match=r"plan: expected sparsa.BlockIndex, got NoneType"):
        sparsa.mass_recall(None, oracle)


def test_metric_errors(rng):
    a = rand(rng, 1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"out: expected the shape of reference \[1, 2, 8, 4\], got \[1, 2, 8, 3\]"):
        sparsa.relative_error(a[..., :3], a)
    with pytest.raises(TypeError, match=r"reference: unsupported dtype float64"):
        sparsa.relative_error(a, a.astype(np.float64))
    lse = rand(rng, 1, 2, 8)
    with pytest.raises(ValueError, match=r"lse_plan: expected f32 \[batch, heads, len_q\] equal in shape to lse_dense"):
        sparsa.mass_recall_from_lse(lse[:, :1], lse)


def test_selectors_read_strided_views_in_place(rng):
    # [batch, seq, heads, dim] buffers viewed as [batch, heads, seq, dim]: no copy needed,
    # and the plans equal those of contiguous copies.
    qs, ks = rand(rng, 1, 40, 2, 16), rand(rng, 1, 56, 2, 16)
    q, k = qs.transpose(0, 2, 1, 3), ks.transpose(0, 2, 1, 3)
    assert not q.flags.c_contiguous
    for plan_of in (lambda a, b: sparsa.ba_att_plan(a, b, block_q=8, block_kv=8, density=0.4),
                    lambda a, b: sparsa.xattention_plan(a, b, block_q=8, block_kv=8, stride=4)):
        strided, contiguous = plan_of(q, k), plan_of(np.ascontiguousarray(q), np.ascontiguousarray(k))
        assert np.array_equal(strided.counts, contiguous.counts)
        assert np.array_equal(strided.indices, contiguous.indices)
    a = sparsa.oracle_blocks(q, k, sparsa.BlockPartition(8, 8)).mass
    b = sparsa.oracle_blocks(np.ascontiguousarray(q), np.ascontiguousarray(k), sparsa.BlockPartition(8, 8)).mass
    assert np.array_equal(a, b)
