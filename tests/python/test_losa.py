"""Block-diffusion decoding on numpy arrays: the paged cache, QUEST pages and the LoSA
state (runs in CI). Checked against the independent numpy attention in reference.py."""
import numpy as np
import pytest

import sparsa
from reference import attention, rand, rel_err

F32_RTOL = 1e-5  # f32 executor vs the f64 oracle (see test_core.py)


def filled_cache(rng, heads_kv, length, d, page_size=16):
    cache = sparsa.PagedKVCache(heads_kv, d, page_size)
    k, v = rand(rng, 1, heads_kv, length, d), rand(rng, 1, heads_kv, length, d)
    cache.append(k[:, :, : length // 2], v[:, :, : length // 2])  # two appends: a partial page is extended
    cache.append(k[:, :, length // 2:], v[:, :, length // 2:])
    return cache, k, v


def test_cache_holds_what_was_appended(rng):
    cache, k, v = filled_cache(rng, 2, 75, 8)
    assert (cache.length, cache.num_pages, cache.page_size, cache.heads_kv, cache.head_dim) == (75, 5, 16, 2, 8)
    assert np.array_equal(cache.keys(), k) and np.array_equal(cache.values(), v)
    empty = sparsa.PagedKVCache(1, 4)
    assert empty.length == 0 and empty.keys().shape == (1, 1, 0, 4)


# ---- QUEST ----------------------------------------------------------------------------------

def numpy_quest_scores(q, k, page_size):
    """score[h, r, p] = sum_d max(q_d * max_d(page), q_d * min_d(page)), f64."""
    hq, hkv = q.shape[1], k.shape[1]
    length = k.shape[2]
    pages = -(-length // page_size)
    scores = np.zeros((hq, q.shape[2], pages))
    for h in range(hq):
        kk = k[0, h // (hq // hkv)].astype(np.float64)
        for p in range(pages):
            page = kk[p * page_size:(p + 1) * page_size]
            hi, lo = page.max(0), page.min(0)
            qq = q[0, h].astype(np.float64)
            scores[h, :, p] = np.maximum(qq * hi, qq * lo).sum(-1)
    return scores


def test_quest_plan_keeps_the_top_upper_bounds(rng):
    cache, k, _ = filled_cache(rng, 2, 200, 16)  # 13 pages, the last partial
    q = rand(rng, 1, 4, 5, 16)
    plan = sparsa.quest_plan(q, cache, budget=64, force_last=False)  # 4 pages per (head, row)
    assert plan.counts.shape == (4, 5) and (plan.counts == 4).all()
    scores = numpy_quest_scores(q, k, 16)
    for h, r in np.ndindex(4, 5):
        kept = plan.pages[h, r, : plan.counts[h, r]]
        assert (np.diff(kept) > 0).all()
        top = np.argsort(-scores[h, r], kind="stable")[:4]
        # the f32 scores of the core may reorder near-ties; compare by score
        assert np.allclose(np.sort(scores[h, r, kept]), np.sort(scores[h, r, top]), rtol=1e-5)


def test_quest_plan_forced_pages_and_small_caches(rng):
    cache, _, _ = filled_cache(rng, 1, 100, 8)  # 7 pages
    q = rand(rng, 1, 2, 3, 8)
    plan = sparsa.quest_plan(q, cache, budget=32, force_first=True, force_last=True)
    assert (plan.counts == 2).all()
    assert (plan.pages[..., 0] == 0).all() and (plan.pages[..., 1] == 6).all()  # both forced pages fill the budget
    whole = sparsa.quest_plan(q, cache, budget=1024)  # more than the cache: every page
    assert (whole.counts == 7).all()
    assert (whole.pages == np.arange(7)).all()


def test_quest_plan_errors(rng):
    cache, _, _ = filled_cache(rng, 2, 40, 8)
    q = rand(rng, 1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"budget: expected a positive multiple of the page size 16 \(tokens per query\), got 100"):
        sparsa.quest_plan(q, cache, budget=100)
    with pytest.raises(ValueError, match=r"budget: 16 tokens is 1 page\(s\), fewer than the 2 forced"):
        sparsa.quest_plan(q, cache, budget=16, force_first=True, force_last=True)
    with pytest.raises(ValueError, match=r"selector: expected quest or pooled, got 'max'"):
        sparsa.quest_plan(q, cache, selector="max")
    with pytest.raises(ValueError, match=r"group: expected per_head or shared, got 'all'"):
        sparsa.quest_plan(q, cache, group="all")
    with pytest.raises(ValueError, match=r"q: head_dim 4"):
        sparsa.quest_plan(rand(rng, 1, 4, 3, 4), cache)
    with pytest.raises(TypeError, match=r"cache: expected sparsa.PagedKVCache, got ndarray"):
        sparsa.quest_plan(q, q)
    with pytest.raises(ValueError, match=r"heads_kv: expected >= 1, got 0"):
        sparsa.PagedKVCache(0, 8)
    with pytest.raises(ValueError, match=r"v: "):
        cache.append(rand(rng, 1, 2, 3, 8), rand(rng, 1, 2, 4, 8))


# ---- LoSA state ----------------------------------------------------------------------------

def reference_step(cache, q, k_block, v_block):
    k = np.concatenate([cache.keys(), k_block], axis=2)
    v = np.concatenate([cache.values(), v_block], axis=2)
    return attention(q, k, v)


@pytest.mark.parametrize("method", ["losa", "dense", "quest", "reuse"])
def test_first_step_is_dense_prefix_plus_block(rng, method):
    cache, _, _ = filled_cache(rng, 2, 90, 16)
    state = sparsa.LosaState(4, 2, 16, block_size=8, method=method, budget=1024)
    q, kb, vb = rand(rng, 1, 4, 8, 16), rand(rng, 1, 2, 8, 16), rand(rng, 1, 2, 8, 16)
    out, lse = state.step(cache, q, kb, vb)
    ref_o, ref_lse = reference_step(cache, q, kb, vb)
    assert out.shape == q.shape and lse.shape == (1, 4, 8)
    assert rel_err(out, ref_o) < F32_RTOL and rel_err(lse, ref_lse) < F32_RTOL
    assert state.stats["recomputed"] == list(range(8)) and state.steps_in_block == 1
    assert state.stats["dense_prefix"] == (method != "quest")
    assert np.array_equal(state.q_ref, q)


def test_losa_recomputes_the_moved_rows_and_reuses_the_rest(rng):
    cache, _, _ = filled_cache(rng, 2, 160, 16)
    # A budget that covers the whole prefix: the sparse recompute is exact, so every row
    # whose query did not move keeps a prefix part that is still right.
    state = sparsa.LosaState(4, 2, 16, block_size=8, method="losa", budget=256, active_k=2)
    q, kb, vb = rand(rng, 1, 4, 8, 16), rand(rng, 1, 2, 8, 16), rand(rng, 1, 2, 8, 16)
    state.step(cache, q, kb, vb)
    q2 = q.copy()
    q2[:, :, 2] += 0.5 * rand(rng, 1, 4, 16)
    q2[:, :, 5] += 1.0 * rand(rng, 1, 4, 16)
    kb2, vb2 = rand(rng, 1, 2, 8, 16), rand(rng, 1, 2, 8, 16)  # the block's own keys change each step
    out, lse = state.step(cache, q2, kb2, vb2)
    assert state.stats["recomputed"] == [2, 5] and not state.stats["dense_prefix"]
    mse = ((q2 - q).astype(np.float64) ** 2).mean(axis=(0, 1, 3))
    assert np.allclose(state.stats["mse"], mse)
    ref_o, ref_lse = reference_step(cache, q2, kb2, vb2)
    assert rel_err(out, ref_o) < F32_RTOL and rel_err(lse, ref_lse) < F32_RTOL
    assert np.array_equal(state.q_ref, q2)  # rows 2 and 5 updated, the rest were equal already


def test_losa_stable_rows_keep_their_stale_prefix(rng):
    cache, _, _ = filled_cache(rng, 1, 64, 8)
    state = sparsa.LosaState(2, 1, 8, block_size=4, method="losa", budget=64, active_k=1)
    q, kb, vb = rand(rng, 1, 2, 4, 8), rand(rng, 1, 1, 4, 8), rand(rng, 1, 1, 4, 8)
    state.step(cache, q, kb, vb)
    o_p, l_p = state.o_p, state.l_p
    q2 = q + 0.1 * rand(rng, 1, 2, 4, 8)
    q2[:, :, 3] += 2.0  # row 3 moves most
    state.step(cache, q2, kb, vb)
    assert state.stats["recomputed"] == [3]
    assert np.array_equal(state.o_p[:, :, :3], o_p[:, :, :3]) and np.array_equal(state.l_p[:, :, :3], l_p[:, :, :3])
    prefix_o, prefix_lse = attention(q2[:, :, 3:], cache.keys(), cache.values())
    assert rel_err(state.o_p[:, :, 3:], prefix_o) < F32_RTOL and rel_err(state.l_p[:, :, 3:], prefix_lse) < F32_RTOL


def test_commit_grows_the_cache_and_starts_a_dense_block(rng):
    cache, _, _ = filled_cache(rng, 2, 48, 16)
    state = sparsa.LosaState(2, 2, 16, block_size=8, budget=32, active_k=1)
    q, kb, vb = rand(rng, 1, 2, 8, 16), rand(rng, 1, 2, 8, 16), rand(rng, 1, 2, 8, 16)
    state.step(cache, q, kb, vb)
    state.step(cache, q, kb, vb)
    assert state.steps_in_block == 2
    state.commit(cache, kb, vb)
    assert cache.length == 56 and state.blocks_committed == 1 and state.steps_in_block == 0
    assert np.array_equal(cache.keys()[:, :, 48:], kb)
    q3, kb3, vb3 = rand(rng, 1, 2, 8, 16), rand(rng, 1, 2, 8, 16), rand(rng, 1, 2, 8, 16)
    out, _ = state.step(cache, q3, kb3, vb3)
    assert state.stats["dense_prefix"] and state.stats["block"] == 1 and state.stats["step"] == 0
    ref_o, _ = reference_step(cache, q3, kb3, vb3)
    assert rel_err(out, ref_o) < F32_RTOL


def test_empty_prefix_is_block_attention(rng):
    cache = sparsa.PagedKVCache(1, 8)
    state = sparsa.LosaState(2, 1, 8, block_size=4)
    q, kb, vb = rand(rng, 1, 2, 4, 8), rand(rng, 1, 1, 4, 8), rand(rng, 1, 1, 4, 8)
    out, lse = state.step(cache, q, kb, vb)
    ref_o, ref_lse = attention(q, kb, vb)
    assert rel_err(out, ref_o) < F32_RTOL and rel_err(lse, ref_lse) < F32_RTOL


def test_losa_errors(rng):
    cache, _, _ = filled_cache(rng, 2, 32, 16)
    with pytest.raises(ValueError, match=r"method: expected dense, quest, losa or reuse, got 'fast'"):
        sparsa.LosaState(4, 2, 16, method="fast")
    with pytest.raises(ValueError, match=r"heads_kv: heads_q \(6\) must be a multiple of heads_kv \(4\)"):
        sparsa.LosaState(6, 4, 16)
    with pytest.raises(ValueError, match=r"active_k: expected 0 to block_size \(8\)"):
        sparsa.LosaState(4, 2, 16, block_size=8, active_k=9)
    with pytest.raises(ValueError, match=r"budget: expected a positive multiple of the page size 16 \(tokens per query\), got 20"):
        sparsa.LosaState(4, 2, 16, budget=20)
    state = sparsa.LosaState(4, 2, 16, block_size=8)
    q, kb = rand(rng, 1, 4, 8, 16), rand(rng, 1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"q: expected block_size 8 tokens \(dim 2\), got 7"):
        state.step(cache, q[:, :, :7], kb, kb)
    with pytest.raises(TypeError, match=r"q: "):
        state.step(cache, q.astype(np.float16), kb, kb)
    with pytest.raises(ValueError, match=r"cache: expected heads_kv 2 and head_dim 16, got 1 and 16"):
        state.step(sparsa.PagedKVCache(1, 16), q, kb, kb)
    with pytest.raises(TypeError, match=r"cache: expected sparsa.PagedKVCache, got NoneType"):
        state.step(None, q, kb, kb)
    with pytest.raises(ValueError, match=r"k_block: "):
        state.commit(cache, kb[:, :1], kb)


def test_quest_attention_is_attention_over_its_pages(rng):
    q, k, v = rand(rng, 1, 4, 6, 16), rand(rng, 1, 2, 120, 16), rand(rng, 1, 2, 120, 16)
    out, lse = sparsa.quest(q, k, v, budget=48)
    cache = sparsa.PagedKVCache(2, 16)
    cache.append(k, v)
    plan = sparsa.quest_plan(q, cache, budget=48)
    mask = np.zeros((1, 4, 6, 120), bool)
    for h, r in np.ndindex(4, 6):
        for p in plan.pages[h, r, : plan.counts[h, r]]:
            mask[0, h, r, p * 16:(p + 1) * 16] = True
    ref_o, ref_lse = attention(q, k, v, mask=mask)
    assert rel_err(out, ref_o) < F32_RTOL and rel_err(lse, ref_lse) < F32_RTOL
    full_o, full_lse = sparsa.quest(q, k, v, budget=128)  # every page
    ref_o, ref_lse = attention(q, k, v)
    assert rel_err(full_o, ref_o) < F32_RTOL and rel_err(full_lse, ref_lse) < F32_RTOL


@pytest.mark.parametrize("method", ["losa", "quest"])
def test_sparse_step_is_attention_over_the_selected_pages(rng, method):
    # A budget of 3 of 8 pages: the recomputed rows attend over their pages of the prefix
    # plus the whole block; the rows LoSA leaves stable keep the first step's dense prefix.
    cache, _, _ = filled_cache(rng, 2, 128, 16)
    state = sparsa.LosaState(4, 2, 16, block_size=8, method=method, budget=48, active_k=3, force_last=False)
    q, kb, vb = rand(rng, 1, 4, 8, 16), rand(rng, 1, 2, 8, 16), rand(rng, 1, 2, 8, 16)
    state.step(cache, q, kb, vb)
    q2 = q + 0.01 * rand(rng, 1, 4, 8, 16)
    q2[:, :, [1, 4, 6]] += 1.0
    out, lse = state.step(cache, q2, kb, vb)
    stats = state.stats
    rows = stats["recomputed"]
    assert rows == ([1, 4, 6] if method == "losa" else list(range(8))) and not stats["dense_prefix"]
    counts, pages = stats["plan_counts"], stats["plan_pages"]
    assert counts.shape == (4, len(rows)) and (counts == 3).all()
    keys = np.concatenate([cache.keys(), kb], axis=2)
    values = np.concatenate([cache.values(), vb], axis=2)
    mask = np.zeros((1, 4, 8, 128 + 8), bool)
    mask[..., 128:] = True  # the block's own keys, every step
    for h, i in np.ndindex(4, len(rows)):
        for p in pages[h, i, : counts[h, i]]:
            mask[0, h, rows[i], p * 16:(p + 1) * 16] = True
    ref_o, ref_lse = attention(q2, keys, values, mask=mask)
    stable = [r for r in range(8) if r not in rows]
    dense_o, _ = attention(q2, keys, values)
    assert rel_err(out[:, :, rows], ref_o[:, :, rows]) < F32_RTOL
    assert rel_err(lse[:, :, rows], ref_lse[:, :, rows]) < F32_RTOL
    if stable:  # their prefix part is the first step's, computed densely with q
        prefix_o, prefix_lse = attention(q[:, :, stable], cache.keys(), cache.values())
        assert np.allclose(state.o_p[:, :, stable], prefix_o, atol=1e-5)
        assert np.allclose(state.l_p[:, :, stable], prefix_lse, atol=1e-5)
    assert rel_err(out[:, :, rows], dense_o[:, :, rows]) > 1e-3  # 3 of 8 pages is not dense
