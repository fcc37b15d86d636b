"""Sparse attention inside the DLM engine (--attention, --attention-layers): each method at a
budget that covers everything is the exact engine (the same logits within LOGIT_TOL, the same
tokens as the reference loop at temperature 0); at a real budget it is applied (the logits move
far outside the tolerance) and the loops still run; a bad spec is one clear error naming it.

BA-Att at density 1 keeps every key block, so only the order of f32 sums changes (its blocks are
formed over norm-sorted keys): the same bound as the dense golden tests. QUEST and LoSA with a
budget of every prefix page (and LoSA with every row active) attend over exactly the dense keys.
"""
import json

import numpy as np
import pytest

import dlm_ref as R
from test_dlm import LOGIT_TOL, PROMPTS, engine_logits, generate_ids, rel_err, run


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    s = R.Spec("llada", dim=64, heads=4, kv_heads=2, layers=2, vocab=64, eos=62, mask_id=63)
    d = tmp_path_factory.mktemp("llada_sparse")
    return s, R.write_model(d, s, seed=21), d


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    s = R.Spec("sdar", dim=64, heads=4, kv_heads=2, layers=2, vocab=64, eos=62, mask_id=63, block=4)
    d = tmp_path_factory.mktemp("sdar_sparse")
    return s, R.write_model(d, s, seed=22), d


def logits_with(sparsa_bin, d, ids, tmp_path, *flags):
    out = tmp_path / "logits_sparse.npy"
    run(sparsa_bin, "logits", "--model", d, "--ids", ",".join(map(str, ids)), "--out", out, "--quiet", *flags)
    return np.load(out)


CANVAS = [5, 9, 30, 63, 63, 63, 12, 7, 63, 63, 41, 2, 63, 63, 63, 63, 19, 27, 33, 63, 6, 63, 63, 63]


def test_ba_att_at_density_one_is_exact(sparsa_bin, llada, tmp_path):
    s, w, d = llada
    ref = engine_logits(sparsa_bin, d, CANVAS, tmp_path)
    got = logits_with(sparsa_bin, d, CANVAS, tmp_path, "--attention", "ba_att:density=1,block=4,min_tokens=0")
    assert rel_err(got, ref) < LOGIT_TOL


def test_ba_att_at_a_real_budget_is_applied(sparsa_bin, llada, tmp_path):
    """Two of six key blocks per query block: the logits move by far more than f32 noise."""
    s, w, d = llada
    ref = engine_logits(sparsa_bin, d, CANVAS, tmp_path)
    got = logits_with(sparsa_bin, d, CANVAS, tmp_path, "--attention", "ba_att:top_kappa=2,block=4,min_tokens=0")
    assert rel_err(got, ref) > 100 * LOGIT_TOL
    # Below min_tokens the canvas stays dense: exact again.
    got = logits_with(sparsa_bin, d, CANVAS, tmp_path, "--attention", "ba_att:top_kappa=2,block=4,min_tokens=25")
    assert rel_err(got, ref) < LOGIT_TOL


@pytest.mark.parametrize("method", ["mean_pool:density=1,block=4,min_tokens=0",
                                    "xattention:density=1,block=4,stride=2,min_tokens=0",
                                    "ba_att:density=1,block=4,min_tokens=0,sort=false,compensate=false"])
def test_canvas_selectors_at_density_one_are_exact(sparsa_bin, llada, tmp_path, method):
    s, w, d = llada
    ref = engine_logits(sparsa_bin, d, CANVAS, tmp_path)
    assert rel_err(logits_with(sparsa_bin, d, CANVAS, tmp_path, "--attention", method), ref) < LOGIT_TOL


def test_canvas_selectors_at_a_real_budget(sparsa_bin, llada, tmp_path):
    """Each selector is applied (the logits move) and they are different selectors; mean_pool is
    BA-Att's selector with the sorts and the compensation off, bit for bit."""
    s, w, d = llada
    ref = engine_logits(sparsa_bin, d, CANVAS, tmp_path)
    got = {m: logits_with(sparsa_bin, d, CANVAS, tmp_path, "--attention", f"{m},block=4,min_tokens=0")
           for m in ("ba_att:top_kappa=2", "ba_att:top_kappa=2,sort=false", "mean_pool:top_kappa=2",
                     "ba_att:top_kappa=2,sort=false,compensate=false", "xattention:top_kappa=2,stride=2",
                     "ba_att:top_kappa=2,sort_q=false")}
    for m, g in got.items():
        assert rel_err(g, ref) > 100 * LOGIT_TOL, m
    assert np.array_equal(got["mean_pool:top_kappa=2"], got["ba_att:top_kappa=2,sort=false,compensate=false"])
    assert rel_err(got["ba_att:top_kappa=2"], got["ba_att:top_kappa=2,sort=false"]) > 100 * LOGIT_TOL
    assert rel_err(got["ba_att:top_kappa=2,sort=false"], got["mean_pool:top_kappa=2"]) > 100 * LOGIT_TOL
    assert rel_err(got["xattention:top_kappa=2,stride=2"], got["mean_pool:top_kappa=2"]) > 100 * LOGIT_TOL
    assert rel_err(got["ba_att:top_kappa=2,sort_q=false"], got["ba_att:top_kappa=2"]) > 100 * LOGIT_TOL


def test_per_layer_overrides(sparsa_bin, llada, tmp_path):
    s, w, d = llada
    ref = engine_logits(sparsa_bin, d, CANVAS, tmp_path)
    sparse = "ba_att:top_kappa=2,block=4,min_tokens=0"
    both = logits_with(sparsa_bin, d, CANVAS, tmp_path, "--attention", "dense", "--attention-layers", f"0,1={sparse}")
    every = logits_with(sparsa_bin, d, CANVAS, tmp_path, "--attention", sparse)
    assert rel_err(both, every) < LOGIT_TOL  # both layers overridden = every layer sparse
    one = logits_with(sparsa_bin, d, CANVAS, tmp_path, "--attention", sparse, "--attention-layers", "1=dense")
    assert rel_err(one, ref) > 100 * LOGIT_TOL and rel_err(one, every) > 100 * LOGIT_TOL


def test_block_causal_chunks_with_a_selection_under_the_mask(sparsa_bin, sdar, tmp_path):
    """sdar's canvas is one block-causal chunk (blocks of 4). By default the canvas selectors leave
    it exact; with block_causal=true they select under the mask (sorted BA-Att blind to it, the
    executor masking exactly): at density 1 every visible key block is kept (exact again), at one
    block a row the logits move (XAttention's and sorted BA-Att's too); mean_pool is BA-Att without
    the compensation, bit for bit."""
    s, w, d = sdar
    ref = engine_logits(sparsa_bin, d, CANVAS, tmp_path)
    common = "block=8,min_tokens=0"
    assert rel_err(logits_with(sparsa_bin, d, CANVAS, tmp_path, "--attention", f"ba_att:top_kappa=1,{common}"),
                   ref) < LOGIT_TOL
    for m in ("ba_att:density=1,sort=false", "ba_att:density=1", "mean_pool:density=1",
              "xattention:density=1,stride=2"):
        full = logits_with(sparsa_bin, d, CANVAS, tmp_path, "--attention", f"{m},{common},block_causal=true")
        assert rel_err(full, ref) < LOGIT_TOL, m
    got = {m: logits_with(sparsa_bin, d, CANVAS, tmp_path, "--attention", f"{m},{common},block_causal=true")
           for m in ("ba_att:top_kappa=1,sort=false", "ba_att:top_kappa=1,sort=false,compensate=false",
                     "mean_pool:top_kappa=1", "xattention:top_kappa=1,stride=2,force_first=false",
                     "ba_att:top_kappa=1")}
    for m, g in got.items():
        assert rel_err(g, ref) > 100 * LOGIT_TOL, m
    assert np.array_equal(got["mean_pool:top_kappa=1"], got["ba_att:top_kappa=1,sort=false,compensate=false"])
    # Below min_tokens the chunk stays dense.
    short = logits_with(sparsa_bin, d, CANVAS, tmp_path, "--attention",
                        "ba_att:top_kappa=1,block=8,min_tokens=25,sort=false,block_causal=true")
    assert rel_err(short, ref) < LOGIT_TOL


@pytest.mark.parametrize("method", ["quest:budget=1024", "losa:budget=1024,k=4"])
def test_block_loop_with_full_budgets_matches_the_reference(sparsa_bin, sdar, method):
    """Every prefix page kept (and LoSA's every row recomputed: k = the block size 4)."""
    s, w, d = sdar
    got = generate_ids(sparsa_bin, d, PROMPTS, "--loop", "block", "--gen-len", 12, "--steps", 2,
                       "--no-stop-at-eos", "--attention", method)
    for p, g in zip(PROMPTS, got):
        assert g == R.ref_block(s, w, p, 12, 2, 0.0, False)


def test_prefix_cache_loop_with_a_full_quest_budget_matches_the_reference(sparsa_bin, llada):
    s, w, d = llada
    got = generate_ids(sparsa_bin, d, PROMPTS, "--loop", "prefix_cache", "--gen-len", 16, "--block-len", 8,
                       "--steps", 8, "--no-stop-at-eos", "--attention", "quest:budget=1024")
    for p, g in zip(PROMPTS, got):
        assert g == R.ref_prefix_cache(s, w, p, 16, 8, 8, 0.0, False)


@pytest.mark.parametrize("loop,method", [
    ("block", "quest:budget=16"),
    ("block", "losa:budget=16,k=1"),
    ("block", "losa:budget=16,threshold=0.5"),
    ("prefix_cache", "losa:budget=16,k=2"),
    ("remask", "ba_att:density=0.5,block=4,min_tokens=0"),
    ("remask", "mean_pool:density=0.5,block=4,min_tokens=0"),
    ("prefix_cache", "xattention:density=0.5,block=4,stride=2,min_tokens=0"),
])
def test_sparse_loops_run(sparsa_bin, sdar, llada, loop, method):
    s, w, d = sdar if loop == "block" else llada
    # A long prompt so that the prefix spans several pages of 16.
    prompt = [(7 * i + 3) % 60 for i in range(40)]
    got = generate_ids(sparsa_bin, d, [prompt], "--loop", loop, "--gen-len", 8, "--steps", 2 if loop == "block" else 8,
                       *(["--block-len", 8] if loop != "block" else []), "--no-stop-at-eos", "--attention", method)
    assert len(got[0]) == 8 and all(0 <= t < 64 for t in got[0])


@pytest.mark.parametrize("flags,words", [
    (["--attention", "sparse"], ["attention", "unknown method 'sparse'"]),
    (["--attention", "ba_att:density=2"], ["ba_att density", "expected a number in [0, 1]"]),
    (["--attention", "ba_att:density=0.5,tau=0.9"], ["ba_att takes one of density, top_kappa, tau"]),
    (["--attention", "quest:budget=100"], ["budget", "multiple of the page size 16"]),
    (["--attention", "quest:bugdet=256"], ["quest has no parameter 'bugdet'"]),
    (["--attention", "losa:k"], ["expected key=value"]),
    (["--attention", "losa:k=1.5"], ["losa k", "integer"]),
    (["--attention-layers", "2=dense"], ["attention_layers", "layer '2'", "[0, 2)"]),
    (["--attention-layers", "dense"], ["attention_layers", "LAYERS=METHOD"]),
    (["--attention-layers", "0=ba_att:block=0"], ["layer 0", "ba_att block"]),
    (["--attention", "ba_att:sort=false,sort_q=true"], ["ba_att sort sets both sort_q and sort_k"]),
    (["--attention", "mean_pool:beta=2"], ["mean_pool has no parameter 'beta'"]),
    (["--attention", "xattention:stride=0"], ["xattention stride"]),
    (["--attention", "xattention:density=0.5,top_kappa=2"], ["xattention takes one of density, top_kappa, tau"]),
    (["--attention", "ba_att:sort=false,block_causal=maybe"], ["ba_att block_causal: expected true or false"]),
    (["--attention", "quest:block_causal=true"], ["quest has no parameter 'block_causal'"]),
])
def test_bad_specs_are_one_clear_error(sparsa_bin, llada, flags, words):
    s, w, d = llada
    p = run(sparsa_bin, "generate", "--model", d, "--prompt-ids", "1,2,3", "--gen-len", 4, "--json", "--quiet",
            *flags, check=False)
    assert p.returncode != 0
    for word in words:
        assert word in p.stderr, p.stderr


def test_many_requests_with_a_prefix_method(sparsa_bin, sdar):
    """66 requests made together (make_sequences) with LoSA: each gets what it gets alone."""
    s, w, d = sdar
    prompts = [[(5 * i + 3 * r) % 60 for i in range(20 + r % 17)] for r in range(66)]
    flags = ["--loop", "block", "--gen-len", 8, "--steps", 2, "--no-stop-at-eos", "--attention", "losa:budget=16,k=1"]
    batch = generate_ids(sparsa_bin, d, prompts, *flags)
    assert [len(g) for g in batch] == [8] * 66
    for r in (0, 63, 64, 65):
        assert generate_ids(sparsa_bin, d, [prompts[r]], *flags)[0] == batch[r], r


def test_canvas_selectors_on_a_dream_model(sparsa_bin, tmp_path):
    """Dream's bidirectional canvases take the canvas selectors as llada's do: exact at density 1,
    applied at a real budget, and Dream's loop with BA-Att at density 1 in every layer commits the
    reference loop's tokens."""
    s = R.Spec("dream", dim=64, heads=4, kv_heads=2, layers=2, vocab=64, eos=62, mask_id=63)
    d = tmp_path / "dream_sparse"
    w = R.write_model(d, s, seed=23)
    ref = engine_logits(sparsa_bin, d, CANVAS, tmp_path)
    for method in ("ba_att:density=1,block=4,min_tokens=0", "xattention:density=1,block=4,stride=2,min_tokens=0"):
        assert rel_err(logits_with(sparsa_bin, d, CANVAS, tmp_path, "--attention", method), ref) < LOGIT_TOL, method
    got = logits_with(sparsa_bin, d, CANVAS, tmp_path, "--attention", "ba_att:top_kappa=2,block=4,min_tokens=0")
    assert rel_err(got, ref) > 100 * LOGIT_TOL
    out = generate_ids(sparsa_bin, d, PROMPTS, "--gen-len", 12, "--steps", 6, "--no-stop-at-eos", "--attention",
                       "ba_att:density=1,block=4,min_tokens=0")
    assert out == [R.ref_dream(s, w, p, 12, 6, stop=False) for p in PROMPTS]
