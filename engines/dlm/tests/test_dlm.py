"""Golden tests of the DLM engine through the CLI (sparsa logits / generate / model info /
tokenize), against the independent numpy reference in dlm_ref.py on tiny random models that
the tests write as safetensors.

Tolerance of the logits (LOGIT_TOL, relative to the largest |logit| of the reference): the
engine computes in f32 (OpenBLAS sgemm, f32 attention with f32 accumulation), the reference in
f64 on the very same (already rounded) weights, so the only difference is f32 rounding. A dot
product of length K has a relative error of about sqrt(K)·u (u = 2^-24 ≈ 6e-8), K ≤ 128 here:
about 1e-6 per GEMM; 2-3 layers of residual adds, norms and softmax amplify that by at most
~10-30 with these gains, so 5e-5 is a bound with margin that still catches any real mistake —
the negative controls below show that a wrong mask or a RoPE off by one position moves the
logits by 100x more than the tolerance.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import dlm_ref as R

LOGIT_TOL = 5e-5


def run(sparsa_bin, *args, check=True):
    p = subprocess.run([sparsa_bin, *map(str, args)], capture_output=True, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"sparsa {' '.join(map(str, args))} failed ({p.returncode}): {p.stderr}")
    return p


def engine_logits(sparsa_bin, model_dir, ids, tmp_path):
    out = tmp_path / "logits.npy"
    run(sparsa_bin, "logits", "--model", model_dir, "--ids", ",".join(map(str, ids)), "--out", out, "--quiet")
    return np.load(out)


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


SPECS = {
    "llada_mha_f32": R.Spec("llada", dim=64, heads=4, layers=2),
    "llada_gqa_bf16_sharded": R.Spec("llada", dim=64, heads=4, kv_heads=2, layers=3, dtype="BF16", shards=3),
    "llada_linear_rope_f16": R.Spec("llada", dim=48, heads=3, layers=2, hidden=80, dtype="F16", theta=500000.0,
                                    rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llada_tied": R.Spec("llada", dim=32, heads=2, layers=1, tied=True),
    "sdar_gqa_f32": R.Spec("sdar", dim=64, heads=4, kv_heads=2, layers=2, block=4, theta=1e6),
    "sdar_mixed_sharded_hd32": R.Spec("sdar", dim=48, heads=4, kv_heads=1, head_dim=32, layers=2, block=3,
                                      dtype="mixed", shards=2),
    # an odd-length bf16 entry first: the f32 norms after it sit off 4-byte alignment in the file
    "sdar_mixed_odd_unaligned": R.Spec("sdar", dim=33, heads=2, kv_heads=1, head_dim=16, hidden=40, vocab=41,
                                       dtype="mixed"),
    "sdar_ntk_bf16": R.Spec("sdar", dim=64, heads=2, kv_heads=2, layers=2, block=5, dtype="BF16",
                            rope_scaling={"type": "dynamic", "factor": 2.0}),
    "dream_gqa_f32": R.Spec("dream", dim=64, heads=4, kv_heads=2, layers=2, theta=1e6),
    "dream_bf16_sharded_tied": R.Spec("dream", dim=48, heads=4, kv_heads=1, layers=3, hidden=72, dtype="BF16",
                                      shards=2, tied=True),
    "dream_mixed_linear_rope": R.Spec("dream", dim=32, heads=2, kv_heads=2, layers=2, dtype="mixed",
                                      rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_logits_match_reference(sparsa_bin, tmp_path, name):
    s = SPECS[name]
    d = tmp_path / "model"
    w = R.write_model(d, s, seed=hash(name) % 1000)
    rng = np.random.default_rng(1)
    for n in (1, 7, 13):
        ids = rng.integers(0, s.vocab, n)
        got = engine_logits(sparsa_bin, d, ids, tmp_path)
        assert got.shape == (n, s.vocab) and got.dtype == np.float32
        ref = R.canvas_logits(s, w, ids)
        assert rel_err(got, ref) < LOGIT_TOL, (name, n, rel_err(got, ref))


@pytest.mark.parametrize("name", ["llada_gqa_bf16_sharded", "sdar_gqa_f32", "sdar_mixed_sharded_hd32"])
def test_cached_logits_match_reference(sparsa_bin, tmp_path, name):
    """`logits --cached N`: the first N ids into the KV cache (one pass), the rest over it."""
    s = SPECS[name]
    d = tmp_path / "model"
    w = R.write_model(d, s, seed=hash(name) % 1000 + 7)
    bc = s.block if s.arch == "sdar" else 0
    ids = np.random.default_rng(5).integers(0, s.vocab, 17)
    cached = 3 * bc if bc else 6
    out = tmp_path / "c.npy"
    run(sparsa_bin, "logits", "--model", d, "--ids", ",".join(map(str, ids)), "--out", out, "--quiet",
        "--cached", cached)
    got = np.load(out)
    past = R.forward(s, w, ids[:cached], None, bc)[1]
    ref = R.forward(s, w, ids[cached:], past, bc)[0]
    assert got.shape == ref.shape and rel_err(got, ref) < LOGIT_TOL, rel_err(got, ref)
    for bad, words in ((17, "cached: expected in [0, 17)"), (-1, "cached: expected in [0, 17)")):
        p = run(sparsa_bin, "logits", "--model", d, "--ids", ",".join(map(str, ids)), "--out", out, "--cached", bad,
                check=False)
        assert p.returncode != 0 and words in p.stderr, p.stderr
    if bc:
        p = run(sparsa_bin, "logits", "--model", d, "--ids", ",".join(map(str, ids)), "--out", out, "--cached",
                bc + 1, check=False)
        assert p.returncode != 0 and "multiple of the model's block_size" in p.stderr, p.stderr


def test_negative_controls_are_far_outside_the_tolerance(sparsa_bin, tmp_path):
    """The golden comparison can fail: a bidirectional sdar, or a RoPE shifted by one, is far off."""
    s = SPECS["sdar_gqa_f32"]
    d = tmp_path / "sdar"
    w = R.write_model(d, s, seed=3)
    ids = np.arange(11) % s.vocab
    got = engine_logits(sparsa_bin, d, ids, tmp_path)
    wrong_mask = R.forward(s, w, ids, None, 0)[0]
    assert rel_err(got, wrong_mask) > 100 * LOGIT_TOL
    s2 = SPECS["llada_mha_f32"]
    d2 = tmp_path / "llada"
    w2 = R.write_model(d2, s2, seed=4)
    got2 = engine_logits(sparsa_bin, d2, ids, tmp_path)
    past = [(np.zeros((1, s2.kv_heads, s2.head_dim)), np.zeros((1, s2.kv_heads, s2.head_dim)))] * s2.layers
    # positions shifted by one (an extra zero key also joins the softmax: both must show)
    shifted = R.forward(s2, w2, ids, past)[0]
    assert rel_err(got2, shifted) > 100 * LOGIT_TOL


# ---------------------------------------------------------------- generation loops


def generate_json(sparsa_bin, model_dir, prompts, *flags):
    args = ["generate", "--model", model_dir, "--json", "--quiet", *flags]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    return json.loads(run(sparsa_bin, *args).stdout)


def generate_ids(sparsa_bin, model_dir, prompts, *flags):
    return generate_json(sparsa_bin, model_dir, prompts, *flags)["tokens"]


@pytest.fixture(scope="module")
def llada_model(tmp_path_factory):
    s = R.Spec("llada", dim=64, heads=4, kv_heads=2, layers=2, vocab=64, eos=62, mask_id=63)
    d = tmp_path_factory.mktemp("llada_gen")
    return s, R.write_model(d, s, seed=11), d


@pytest.fixture(scope="module")
def sdar_model(tmp_path_factory):
    s = R.Spec("sdar", dim=64, heads=4, kv_heads=2, layers=2, vocab=64, eos=62, mask_id=63, block=4)
    d = tmp_path_factory.mktemp("sdar_gen")
    return s, R.write_model(d, s, seed=12), d


PROMPTS = [[3, 17, 5, 9, 30], [8, 1, 44, 2, 19, 27, 33, 12, 6]]


STOP = [True, False]  # stop at EOS (the default) or --no-stop-at-eos


def stop_flags(stop):
    return [] if stop else ["--no-stop-at-eos"]


@pytest.mark.parametrize("stop", STOP)
def test_remask_loop_matches_reference(sparsa_bin, llada_model, stop):
    s, w, d = llada_model
    got = generate_ids(sparsa_bin, d, PROMPTS, "--loop", "remask", "--gen-len", 16, "--block-len", 8, "--steps", 8,
                       *stop_flags(stop))
    for p, g in zip(PROMPTS, got):
        assert g == R.ref_remask(s, w, p, 16, 8, 8, stop)
    if not stop:
        assert all(len(g) == 16 for g in got)


def test_remask_with_threshold_matches_reference(sparsa_bin, llada_model):
    """remask + threshold: Fast-dLLM's parallel decoding without a cache."""
    s, w, d = llada_model
    got = generate_ids(sparsa_bin, d, PROMPTS, "--loop", "remask", "--gen-len", 16, "--block-len", 8, "--steps", 8,
                       "--threshold", 0.3, "--no-stop-at-eos")
    for p, g in zip(PROMPTS, got):
        assert g == R.ref_remask(s, w, p, 16, 8, 8, False, threshold=0.3)


@pytest.mark.parametrize("factor", [0.5, 1.0, 3.0])
def test_factor_rule_matches_reference(sparsa_bin, llada_model, factor):
    """--factor: Fast-dLLM's factor rule in the remask loop and the prefix-cache loop (steps unused:
    the block's masks set the pace), against the reference loops."""
    s, w, d = llada_model
    for loop, ref in (("remask", lambda p: R.ref_remask(s, w, p, 16, 8, 8, False, factor=factor)),
                      ("prefix_cache", lambda p: R.ref_prefix_cache(s, w, p, 16, 8, 8, 0.0, False, factor=factor))):
        got = generate_ids(sparsa_bin, d, PROMPTS, "--loop", loop, "--gen-len", 16, "--block-len", 8, "--steps", 3,
                           "--factor", factor, "--no-stop-at-eos")
        for p, g in zip(PROMPTS, got):
            assert g == ref(p), (loop, p)


@pytest.mark.parametrize("rule", [("--threshold", 0.0), ("--threshold", 0.3), ("--factor", 1.0)])
@pytest.mark.parametrize("stop", STOP)
def test_dual_cache_loop_matches_reference(sparsa_bin, llada_model, rule, stop):
    """Fast-dLLM's dual cache: each later step runs the block alone over the prefix and suffix
    K/V of the block's first step."""
    s, w, d = llada_model
    got = generate_ids(sparsa_bin, d, PROMPTS, "--loop", "dual_cache", "--gen-len", 24, "--block-len", 8,
                       "--steps", 12, *rule, *stop_flags(stop))
    thr, fac = (rule[1], 0.0) if rule[0] == "--threshold" else (0.0, rule[1])
    for p, g in zip(PROMPTS, got):
        assert g == R.ref_dual_cache(s, w, p, 24, 8, 12, thr, stop, factor=fac)


def test_dual_cache_is_not_the_prefix_cache(sparsa_bin, llada_model):
    """The two caches differ in what a step sees after the block (the suffix of the block's
    first step, not the current one), so on this model they commit different tokens somewhere."""
    s, w, d = llada_model
    prompts = PROMPTS + [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46]]
    args = ("--gen-len", 24, "--block-len", 8, "--steps", 24, "--no-stop-at-eos")
    dual = generate_ids(sparsa_bin, d, prompts, "--loop", "dual_cache", *args)
    prefix = generate_ids(sparsa_bin, d, prompts, "--loop", "prefix_cache", *args)
    assert dual == [R.ref_dual_cache(s, w, p, 24, 8, 24, 0.0, False) for p in prompts]
    assert prefix == [R.ref_prefix_cache(s, w, p, 24, 8, 24, 0.0, False) for p in prompts]
    assert dual != prefix


def test_dual_cache_refusals(sparsa_bin, llada_model, sdar_model):
    """A layer method that cannot see the suffix (LoSA's block steps) is refused by name, as is the
    dual cache on a block-diffusion model; QUEST (over the prefix) and the canvas methods take it."""
    d = llada_model[2]
    base = ["generate", "--model", d, "--prompt-ids", "1,2,3", "--loop", "dual_cache", "--gen-len", 8,
            "--block-len", 8, "--json", "--quiet"]
    p = run(sparsa_bin, *map(str, base), "--attention", "losa:budget=16", check=False)
    assert p.returncode == 1 and "does not take the dual cache's suffix" in p.stderr, p.stderr
    for method in ("quest:budget=16", "ba_att:density=0.5", "dense"):
        run(sparsa_bin, *map(str, base), "--attention", method)
    p = run(sparsa_bin, "generate", "--model", sdar_model[2], "--prompt-ids", "1,2", "--loop", "dual_cache",
            "--json", check=False)
    assert p.returncode == 1 and "dual_cache" in p.stderr, p.stderr


@pytest.mark.parametrize("threshold", [0.0, 0.3])
@pytest.mark.parametrize("stop", STOP)
def test_prefix_cache_loop_matches_reference(sparsa_bin, llada_model, threshold, stop):
    s, w, d = llada_model
    got = generate_ids(sparsa_bin, d, PROMPTS, "--loop", "prefix_cache", "--gen-len", 16, "--block-len", 8,
                       "--steps", 8, "--threshold", threshold, *stop_flags(stop))
    for p, g in zip(PROMPTS, got):
        assert g == R.ref_prefix_cache(s, w, p, 16, 8, 8, threshold, stop)


@pytest.mark.parametrize("threshold", [0.0, 0.3])
@pytest.mark.parametrize("stop", STOP)
def test_block_loop_matches_reference(sparsa_bin, sdar_model, threshold, stop):
    s, w, d = sdar_model
    got = generate_ids(sparsa_bin, d, PROMPTS, "--loop", "block", "--gen-len", 10, "--steps", 2,
                       "--threshold", threshold, *stop_flags(stop))
    for p, g in zip(PROMPTS, got):
        assert g == R.ref_block(s, w, p, 10, 2, threshold, stop)
    if not stop:
        assert all(len(g) == 10 for g in got)


@pytest.fixture(scope="module")
def sdar_model_varied(tmp_path_factory):
    """An sdar model whose outputs on PROMPTS do not collapse to one repeated token, so that the
    order of the commits shows in the tokens."""
    s = R.Spec("sdar", dim=64, heads=4, kv_heads=2, layers=2, vocab=64, eos=62, mask_id=63, block=4)
    d = tmp_path_factory.mktemp("sdar_varied")
    return s, R.write_model(d, s, seed=2), d


@pytest.mark.parametrize("unmask", [("sequential", 0.35), ("entropy_bounded", 0.35), ("entropy_bounded", 9.0),
                                    ("entropy_bounded", 100.0)])
def test_block_unmask_strategies_match_reference(sparsa_bin, sdar_model_varied, unmask):
    """SDAR's other strategies in the block loop (--unmask): sequential commits the step's
    scheduled count left to right; entropy_bounded the lowest-entropy positions while their
    entropies (at most ln 64 each here) sum below --eb-threshold, at least one: one a step at 0.35,
    the whole block at 100 (so one step a block, its forwards counted)."""
    s, w, d = sdar_model_varied
    name, eb = unmask
    flags = ("--loop", "block", "--gen-len", 12, "--steps", 2, "--no-stop-at-eos", "--unmask", name,
             "--eb-threshold", eb)
    out = generate_json(sparsa_bin, d, PROMPTS, *flags)
    for p, g in zip(PROMPTS, out["tokens"]):
        assert g == R.ref_block(s, w, p, 12, 2, 0.0, False, unmask=name, eb=eb), p
    # Denoising steps + one commit pass per block + the prefill of each prompt's whole blocks.
    masks = [(-(-(len(p) + 12) // 4)) * 4 - len(p) for p in PROMPTS]
    blocks = [-(-(len(p) + 12) // 4) - len(p) // 4 for p in PROMPTS]
    fixed = sum(blocks) + sum(1 for p in PROMPTS if len(p) >= 4)
    if name == "entropy_bounded" and eb == 100.0:
        assert out["steps"] == fixed + sum(blocks)
    elif name == "entropy_bounded" and eb == 0.35:
        assert out["steps"] == fixed + sum(masks)
    if eb != 100.0:  # not the confidence strategy's commits: on this model both prompts differ
        conf = generate_ids(sparsa_bin, d, PROMPTS, *flags[:-4])
        assert all(a != b for a, b in zip(conf, out["tokens"]))


def test_block_unmask_refusals(sparsa_bin, sdar_model, llada_model):
    """--unmask: unknown names, other loops, a threshold beside it, a confidence that does not
    apply, and bad --eb-threshold values are refused by name."""
    base = ["--gen-len", 8, "--steps", 2]
    for model, extra, field in (
            (sdar_model, ["--unmask", "random"], "unmask"),
            (llada_model, ["--loop", "remask", "--block-len", 8, "--unmask", "sequential"], "unmask"),
            (sdar_model, ["--unmask", "entropy_bounded", "--threshold", 0.5], "threshold"),
            (sdar_model, ["--unmask", "sequential", "--confidence", "margin"], "confidence"),
            (sdar_model, ["--unmask", "entropy_bounded", "--confidence", "margin"], "confidence"),
            (sdar_model, ["--unmask", "entropy_bounded", "--eb-threshold", 0], "eb_threshold"),
            (sdar_model, ["--unmask", "entropy_bounded", "--eb-threshold", "nan"], "eb_threshold")):
        args = ["generate", "--model", model[2], "--json", "--quiet", "--prompt-ids", "1,2,3", *base, *extra]
        p = subprocess.run([sparsa_bin, *map(str, args)], capture_output=True, text=True)
        assert p.returncode != 0 and field in p.stderr, (extra, p.stderr)


def test_eos_ids_override(sparsa_bin, llada_model):
    """--eos-ids replaces config.json's EOS: the output stops before the first of them."""
    s, w, d = llada_model
    flags = ["--loop", "remask", "--gen-len", 16, "--block-len", 8, "--steps", 8]
    full = generate_ids(sparsa_bin, d, PROMPTS[:1], *flags, "--no-stop-at-eos")[0]
    stop_at = full[3]
    got = generate_ids(sparsa_bin, d, PROMPTS[:1], *flags, "--eos-ids", f"{stop_at},{s.vocab - 3}")[0]
    assert got == full[:full.index(stop_at)]
    p = run(sparsa_bin, "generate", "--model", d, "--prompt-ids", "1", *flags, "--eos-ids", "999", "--json",
            check=False)
    assert p.returncode == 1 and "eos_ids" in p.stderr


def test_batch_equals_single_requests(sparsa_bin, sdar_model, llada_model):
    for model, flags in ((sdar_model, ["--gen-len", 9, "--steps", 4]),
                         (llada_model, ["--loop", "prefix_cache", "--gen-len", 16, "--block-len", 8, "--steps", 4])):
        _, _, d = model
        both = generate_ids(sparsa_bin, d, PROMPTS, *flags)
        singles = [generate_ids(sparsa_bin, d, [p], *flags)[0] for p in PROMPTS]
        assert both == singles


def test_gumbel_sampling_matches_reference(sparsa_bin, llada_model):
    """Temperature > 0: Gumbel-max with the engine's seeded generator, draw for draw (the reference
    re-implements splitmix64), per request of a batch; another seed gives other tokens."""
    s, w, d = llada_model
    flags = ["--gen-len", 8, "--block-len", 4, "--steps", 4, "--temperature", 1.5, "--no-stop-at-eos"]
    got = generate_ids(sparsa_bin, d, PROMPTS, *flags, "--seed", 5)
    for r, (p, g) in enumerate(zip(PROMPTS, got)):
        assert g == R.ref_remask(s, w, p, 8, 4, 4, False, temperature=1.5, seed=5, request=r)
    greedy = generate_ids(sparsa_bin, d, PROMPTS, "--gen-len", 8, "--block-len", 4, "--steps", 4, "--no-stop-at-eos")
    other = generate_ids(sparsa_bin, d, PROMPTS, *flags, "--seed", 6)
    assert got != greedy and got != other


# ---------------------------------------------------------------- bad model directories


def fresh(tmp_path, spec=None, name="m"):
    s = spec or R.Spec("sdar", dim=32, heads=2, kv_heads=1, layers=1, vocab=40, block=4)
    d = tmp_path / name
    R.write_model(d, s, seed=0)
    return d


def edit_config(d, **changes):
    p = d / "config.json"
    c = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    p.write_text(json.dumps(c))


def expect_error(sparsa_bin, d, *words):
    p = run(sparsa_bin, "model", "info", d, check=False)
    assert p.returncode == 1, p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sparsa: error: "), p.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


# ---------------------------------------------------------------- fast_dllm (Fast-dLLM v2)


@pytest.fixture(scope="module")
def fast_dllm_model(tmp_path_factory):
    s = R.Spec("fast_dllm", dim=64, heads=4, kv_heads=2, layers=2, vocab=64, eos=62, mask_id=63, block=8)
    d = tmp_path_factory.mktemp("fast_dllm_gen")
    return s, R.write_model(d, s, seed=17), d


FAST_PROMPTS = [[3, 17, 5], list(range(1, 9)), list(range(20, 36)), [9, 4, 30, 2, 8, 11, 6, 40, 13, 7, 21]]


def test_fast_dllm_logits_match_reference(sparsa_bin, fast_dllm_model, tmp_path):
    """Qwen2's layers with q / k / v biases, block-causal over bd_size blocks, token shift: the
    engine's logits are the reference's; a bidirectional reading of the same weights is not."""
    s, w, d = fast_dllm_model
    ids = np.array([5, 9, 2, 44, 17, 3, 8, 30, 12, 1, 7, 50, 19], np.int32)
    got = engine_logits(sparsa_bin, d, ids, tmp_path)
    assert rel_err(got, R.canvas_logits(s, w, ids)) < LOGIT_TOL
    assert rel_err(got, R.forward(s, w, ids)[0]) > 100 * LOGIT_TOL  # not bidirectional
    info = json.loads(run(sparsa_bin, "model", "info", d, "--json").stdout)
    assert info["arch"] == "fast_dllm" and info["default_loop"] == "fast_dllm" and info["block_size"] == 8


@pytest.mark.parametrize("threshold", [0.0, 0.1])
@pytest.mark.parametrize("sub", [4, 8])
@pytest.mark.parametrize("stop", STOP)
def test_fast_dllm_loop_matches_reference(sparsa_bin, fast_dllm_model, threshold, sub, stop):
    """Fast-dLLM v2's loop, token for token with the reference: prompts shorter than a block, of
    exactly one and two blocks (prefilled, their next token autoregressive) and with a tail; sub-
    blocks of half and all the block; one token a step or every one above the threshold."""
    s, w, d = fast_dllm_model
    got = generate_ids(sparsa_bin, d, FAST_PROMPTS, "--gen-len", 20, "--threshold", threshold, "--sub-block", sub,
                       *stop_flags(stop))
    for p, g in zip(FAST_PROMPTS, got):
        assert g == R.ref_fast_dllm(s, w, p, 20, threshold, sub, stop), (p, threshold, sub, stop)
        if not stop:
            assert len(g) == 20


def test_fast_dllm_stops_at_eos(sparsa_bin, fast_dllm_model):
    """With an EOS the model does produce (40, through --eos-ids), the loop stops once every
    position before it is decoded and the output ends before it, as the reference's; without
    stopping the same requests run to gen_len."""
    import copy
    s, w, d = fast_dllm_model
    s40 = copy.copy(s)
    s40.eos = 40
    for threshold in (0.0, 0.1):
        got = generate_ids(sparsa_bin, d, FAST_PROMPTS, "--gen-len", 20, "--threshold", threshold, "--eos-ids", 40)
        for p, g in zip(FAST_PROMPTS, got):
            assert g == R.ref_fast_dllm(s40, w, p, 20, threshold, 8, True), (p, threshold)
        assert any(len(g) < 20 for g in got)


def test_fast_dllm_refusals(sparsa_bin, fast_dllm_model, llada_model, tmp_path):
    """One clear error each: another loop on a fast_dllm model, the fast_dllm loop on another
    model, a sub-block that does not divide the block, the cuda backend, a config without a mask
    id whose vocabulary cannot hold the default one."""
    s, w, d = fast_dllm_model
    for flags, words in ((["--loop", "remask", "--block-len", 4], ["fast_dllm"]),
                         (["--sub-block", 3], ["sub_block", "8"]),
                         (["--backend", "cuda"], ["cuda", "fast_dllm"])):
        p = run(sparsa_bin, "generate", "--model", d, "--prompt-ids", "1,2", *map(str, flags), "--json", check=False)
        assert p.returncode == 1 and all(x in p.stderr for x in words), (flags, p.stderr)
    p = run(sparsa_bin, "generate", "--model", llada_model[2], "--prompt-ids", "1,2", "--loop", "fast_dllm",
            "--json", check=False)
    assert p.returncode == 1 and "fast_dllm" in p.stderr, p.stderr
    # the context (256) holds whole blocks: 240 + 16 fits, 241 + 16 (264 in blocks) does not
    assert len(generate_ids(sparsa_bin, d, [[5] * 240], "--gen-len", 16, "--no-stop-at-eos")[0]) == 16
    p = run(sparsa_bin, "generate", "--model", d, "--prompt-ids", ",".join(["5"] * 241), "--gen-len", 16, "--json",
            check=False)
    assert p.returncode == 1 and "whole blocks" in p.stderr and "256" in p.stderr, p.stderr
    e = tmp_path / "nomask"
    R.write_model(e, R.Spec("fast_dllm", dim=64, heads=4, kv_heads=2, layers=1, vocab=64, eos=62, mask_id=151665))
    expect_error(sparsa_bin, e, "mask_token_id", "151665")


# ---------------------------------------------------------------- dream


@pytest.fixture(scope="module")
def dream_model(tmp_path_factory):
    s = R.Spec("dream", dim=64, heads=4, kv_heads=2, layers=2, vocab=64, eos=62, mask_id=63)
    d = tmp_path_factory.mktemp("dream_gen")
    return s, R.write_model(d, s, seed=13), d


@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_dream_prefix_cache_matches_reference(sparsa_bin, dream_model, threshold):
    """Fast-dLLM's prefix cache on a shifted-logit model: the cache stops one position before the
    block and the suffix starts there, so each block's first position is predicted from a fresh
    row, as the reference's whole-canvas and cached forwards do (a one-token prompt among them:
    its first block's suffix starts at position 0)."""
    s, w, d = dream_model
    prompts = PROMPTS + [[7]]
    got = generate_ids(sparsa_bin, d, prompts, "--loop", "prefix_cache", "--gen-len", 16, "--block-len", 8,
                       "--steps", 8, "--threshold", threshold, "--no-stop-at-eos")
    for p, g in zip(prompts, got):
        assert g == R.ref_prefix_cache(s, w, p, 16, 8, 8, threshold, False)


@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_dream_dual_cache_matches_reference(sparsa_bin, dream_model, threshold):
    """The dual cache on a shifted-logit model: a step runs positions [lo - 1, hi - 1) (each block
    position predicted from the row before it), the prefix cache stops at lo - 1 and the suffix
    starts at hi - 1; a one-token prompt among them."""
    s, w, d = dream_model
    prompts = PROMPTS + [[7]]
    got = generate_ids(sparsa_bin, d, prompts, "--loop", "dual_cache", "--gen-len", 24, "--block-len", 8,
                       "--steps", 12, "--threshold", threshold, "--no-stop-at-eos")
    for p, g in zip(prompts, got):
        assert g == R.ref_dual_cache(s, w, p, 24, 8, 12, threshold, False)


@pytest.mark.parametrize("confidence", ["entropy", "margin", "probability"])
def test_dream_loop_matches_reference(sparsa_bin, dream_model, confidence):
    """Dream's schedule (floor(n (1 - t_{i+1} / t_i)) a step) and confidences, the shifted logits:
    the engine commits the reference's tokens; the default confidence of a dream model is entropy."""
    s, w, d = dream_model
    for steps in (12, 5):
        flags = ["--gen-len", 12, "--steps", steps, "--no-stop-at-eos"]
        got = generate_ids(sparsa_bin, d, PROMPTS, *flags, "--confidence", confidence)
        for p, g in zip(PROMPTS, got):
            assert g == R.ref_dream(s, w, p, 12, steps, confidence, stop=False), (confidence, steps)
        if confidence == "entropy":
            assert generate_ids(sparsa_bin, d, PROMPTS, *flags) == got


def test_dream_sampling_with_top_p_and_top_k_matches_reference(sparsa_bin, dream_model):
    """Temperature > 0 through Dream's filters (top_p, then top_k), draw for draw: the picks stay
    inside the filtered set and the confidences are taken of it. Without the filters the same
    seed gives other tokens."""
    s, w, d = dream_model
    flags = ["--gen-len", 10, "--steps", 5, "--temperature", 0.8, "--seed", 3, "--no-stop-at-eos"]
    for top_p, top_k, confidence in ((0.6, 0, "entropy"), (1.0, 3, "probability"), (0.9, 2, "margin")):
        got = generate_ids(sparsa_bin, d, PROMPTS, *flags, "--top-p", top_p, "--top-k", top_k, "--confidence",
                           confidence)
        for r, (p, g) in enumerate(zip(PROMPTS, got)):
            assert g == R.ref_dream(s, w, p, 10, 5, confidence, stop=False, temperature=0.8, top_p=top_p, top_k=top_k,
                                    seed=3, request=r), (top_p, top_k, confidence)
        unfiltered = generate_ids(sparsa_bin, d, PROMPTS, *flags, "--confidence", confidence)
        assert unfiltered != got, (top_p, top_k)  # the filters do change the draws' outcome
    for flag, value in (("--top-p", 0), ("--top-p", 1.5), ("--top-k", -1)):
        p = run(sparsa_bin, "generate", "--model", d, "--prompt-ids", "1,2", flag, value, "--json", check=False)
        assert p.returncode == 1 and flag[2:].replace("-", "_") in p.stderr, p.stderr


def test_dream_alg_temp_matches_reference(sparsa_bin, dream_model):
    """Dream's alg_temp: a step's positions drawn with weights softmax(confidence / alg_temp), draw
    for draw with the reference, at temperature 0 and with sampled tokens; the draws move the
    positions (another seed, other tokens); a vanishing alg_temp is the deterministic schedule;
    bad values and other loops are refused naming alg_temp."""
    s, w, d = dream_model
    flags = ["--gen-len", 12, "--steps", 6, "--no-stop-at-eos"]
    for temperature, alg_temp, seed in ((0.0, 0.5, 1), (0.7, 2.0, 4)):
        got = generate_ids(sparsa_bin, d, PROMPTS, *flags, "--temperature", temperature, "--alg-temp", alg_temp,
                           "--seed", seed)
        for r, (p, g) in enumerate(zip(PROMPTS, got)):
            assert g == R.ref_dream(s, w, p, 12, 6, "entropy", stop=False, temperature=temperature, seed=seed,
                                    request=r, alg_temp=alg_temp), (temperature, alg_temp)
    drawn = [generate_ids(sparsa_bin, d, PROMPTS, *flags, "--alg-temp", 5, "--seed", seed) for seed in range(4)]
    assert len({str(x) for x in drawn}) > 1
    assert generate_ids(sparsa_bin, d, PROMPTS, *flags, "--alg-temp", 1e-12) == generate_ids(sparsa_bin, d, PROMPTS,
                                                                                               *flags)
    for extra in (["--alg-temp", -1], ["--alg-temp", "nan"], ["--alg-temp", 1, "--loop", "remask", "--block-len", 12]):
        p = run(sparsa_bin, "generate", "--model", d, "--prompt-ids", "1,2", *map(str, extra), "--json", check=False)
        assert p.returncode == 1 and "alg_temp" in p.stderr, (extra, p.stderr)


def test_reference_position_draws_are_the_softmax():
    """The reference's Gumbel-top-k stands for torch.multinomial without replacement: its first pick
    falls on position i with probability softmax(conf / alg_temp)_i, its first two on (i, j) with
    p_i p_j / (1 - p_i) (within 4 standard errors over 40,000 draws)."""
    conf, temp, n = [0.3, -0.2, 0.9, 0.0], 0.5, 40000
    p = np.exp(np.array(conf) / temp)
    p /= p.sum()
    rng = R.SplitMix64(7, 0)
    first, pair = np.zeros(4), 0
    for _ in range(n):
        pick = R.sample_positions(conf, 2, temp, rng)
        first[pick[0]] += 1
        pair += pick == [2, 0]
    for i in range(4):
        assert abs(first[i] / n - p[i]) < 4 * np.sqrt(p[i] * (1 - p[i]) / n), (i, first[i] / n, p[i])
    q = p[2] * p[0] / (1 - p[2])
    assert abs(pair / n - q) < 4 * np.sqrt(q * (1 - q) / n), (pair / n, q)


def test_dream_remask_loop_and_confidences_on_llada(sparsa_bin, dream_model, llada_model):
    """The remask loop on a dream model (its blocks read the shifted logits one row back) and the
    margin / entropy confidences on LLaDA's remasking."""
    s, w, d = dream_model
    got = generate_ids(sparsa_bin, d, PROMPTS, "--loop", "remask", "--gen-len", 16, "--block-len", 8, "--steps", 8,
                       "--no-stop-at-eos")
    for p, g in zip(PROMPTS, got):
        assert g == R.ref_remask(s, w, p, 16, 8, 8, False)
    sl, wl, dl = llada_model
    for confidence in ("margin", "entropy"):
        got = generate_ids(sparsa_bin, dl, PROMPTS, "--loop", "remask", "--gen-len", 16, "--block-len", 8, "--steps",
                           8, "--confidence", confidence)
        for p, g in zip(PROMPTS, got):
            assert g == R.ref_remask(sl, wl, p, 16, 8, 8, True, confidence=confidence), confidence


def test_dream_negative_controls(sparsa_bin, dream_model, tmp_path):
    """The dream golden test can fail: logits not shifted, or the biases left out, are far off."""
    s, w, d = dream_model
    ids = np.random.default_rng(2).integers(0, s.vocab, 9)
    got = engine_logits(sparsa_bin, d, ids, tmp_path)
    ref = R.canvas_logits(s, w, ids)
    assert rel_err(got, ref) < LOGIT_TOL
    unshifted = np.concatenate([ref[1:], R.canvas_logits(s, w, np.append(ids, 0))[-1:]], axis=0)
    assert rel_err(got, unshifted) > 100 * LOGIT_TOL
    no_bias = {**w, "layers": [{**L, "bq": 0 * L["bq"], "bk": 0 * L["bk"], "bv": 0 * L["bv"]} for L in w["layers"]]}
    assert rel_err(got, R.canvas_logits(s, no_bias, ids)) > 100 * LOGIT_TOL


def test_dream_refusals(sparsa_bin, dream_model, tmp_path):
    """What a dream model cannot do is one clear error each: logits over a cached prefix (the
    chunk's first row needs the position before), the block loop; a missing bias is named."""
    s, w, d = dream_model
    p = run(sparsa_bin, "logits", "--model", d, "--ids", "1,2,3,4", "--out", tmp_path / "l.npy", "--cached", 2,
            check=False)
    assert p.returncode == 1 and "cached" in p.stderr and "dream" in p.stderr, p.stderr
    p = run(sparsa_bin, "generate", "--model", d, "--prompt-ids", "1,2", "--loop", "block", "--json", check=False)
    assert p.returncode == 1 and "block" in p.stderr, p.stderr
    p = run(sparsa_bin, "generate", "--model", d, "--prompt-ids", "1,2", "--confidence", "doubt", "--json",
            check=False)
    assert p.returncode == 2 and "--confidence" in p.stderr and "entropy" in p.stderr, p.stderr
    info = json.loads(run(sparsa_bin, "model", "info", d, "--json").stdout)
    assert info["arch"] == "dream" and info["default_loop"] == "dream" and info["kv_heads"] == 2
    e = tmp_path / "nobias"
    R.write_model(e, s, seed=1)
    t, meta = R.read_safetensors(e / "model.safetensors")
    R.write_safetensors(e / "model.safetensors", [(k, v, "F32") for k, v in t.items() if "k_proj.bias" not in k])
    expect_error(sparsa_bin, e, "model.layers.0.self_attn.k_proj.bias")


def test_model_info(sparsa_bin, tmp_path):
    d = fresh(tmp_path)
    info = json.loads(run(sparsa_bin, "model", "info", d, "--json").stdout)
    assert info["arch"] == "sdar" and info["kv_heads"] == 1 and info["block_size"] == 4
    assert info["default_loop"] == "block" and info["weight_dtypes"] == "f32"


@pytest.mark.parametrize("field,value,words", [
    ("model_type", "llama", ["model_type", "llama"]),
    ("model_type", None, ["model_type", "missing"]),
    ("hidden_size", None, ["hidden_size", "missing"]),
    ("hidden_size", "32", ["hidden_size", "integer"]),
    ("num_key_value_heads", 3, ["num_key_value_heads", "divide"]),
    ("rope_theta", -1, ["rope_theta"]),
    ("block_size", 0, ["block_size"]),
    ("mask_token_id", 40, ["mask_token_id"]),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2}, ["rope_scaling.rope_type", "yarn"]),
    ("attention_bias", True, ["attention_bias"]),
])
def test_bad_config(sparsa_bin, tmp_path, field, value, words):
    d = fresh(tmp_path)
    edit_config(d, **{field: value})
    expect_error(sparsa_bin, d, "config.json", *words)


def test_missing_and_malformed_config(sparsa_bin, tmp_path):
    d = fresh(tmp_path)
    (d / "config.json").write_text("{ not json")
    expect_error(sparsa_bin, d, "config.json", "JSON")
    (d / "config.json").unlink()
    expect_error(sparsa_bin, d, "config.json")


def rewrite_tensors(d, change):
    """Re-writes model.safetensors with change(name, arr, dtype) -> (name, arr, dtype) or None."""
    import struct
    path = d / "model.safetensors"
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    tensors = []
    for name, info in header.items():
        b, e = info["data_offsets"]
        arr = np.frombuffer(raw[8 + n + b:8 + n + e], dtype="<f4").reshape(info["shape"])
        t = change(name, arr, info["dtype"])
        if t is not None:
            tensors.append(t)
    R.write_safetensors(path, tensors)


def test_missing_tensor(sparsa_bin, tmp_path):
    d = fresh(tmp_path)
    rewrite_tensors(d, lambda n, a, t: None if n == "model.layers.0.self_attn.k_norm.weight" else (n, a, t))
    expect_error(sparsa_bin, d, "model.layers.0.self_attn.k_norm.weight", "missing")


def test_wrong_shape(sparsa_bin, tmp_path):
    d = fresh(tmp_path)
    rewrite_tensors(d, lambda n, a, t: (n, a[:-1], t) if n == "model.layers.0.mlp.up_proj.weight" else (n, a, t))
    expect_error(sparsa_bin, d, "model.layers.0.mlp.up_proj.weight", "shape")


def test_wrong_dtype(sparsa_bin, tmp_path):
    d = fresh(tmp_path)
    rewrite_tensors(d, lambda n, a, t: (n, a.astype(np.int32), "I32") if n == "model.norm.weight" else (n, a, t))
    expect_error(sparsa_bin, d, "model.norm.weight", "i32")


def test_unsupported_dtype_f64(sparsa_bin, tmp_path):
    d = fresh(tmp_path)
    rewrite_tensors(d, lambda n, a, t: (n, a.astype(np.float64), "F64") if n == "model.norm.weight" else (n, a, t))
    expect_error(sparsa_bin, d, "model.norm.weight", "F64")


def test_truncated_shard(sparsa_bin, tmp_path):
    s = R.Spec("sdar", dim=32, heads=2, kv_heads=1, layers=1, vocab=40, block=4, shards=2)
    d = fresh(tmp_path, s)
    shard = d / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    expect_error(sparsa_bin, d, "model-00002-of-00002.safetensors", "truncated")


def test_index_problems(sparsa_bin, tmp_path):
    s = R.Spec("llada", dim=32, heads=2, layers=1, vocab=40, shards=2)
    d = fresh(tmp_path, s)
    idx = d / "model.safetensors.index.json"
    good = json.loads(idx.read_text())
    (d / "model-00001-of-00002.safetensors").unlink()
    expect_error(sparsa_bin, d, "model-00001-of-00002.safetensors")
    d = fresh(tmp_path, s, "m2")
    idx = d / "model.safetensors.index.json"
    bad = dict(good)
    bad["weight_map"] = {k: "../evil.safetensors" for k in good["weight_map"]}
    idx.write_text(json.dumps(bad))
    expect_error(sparsa_bin, d, "index.json", "file name")
    moved = dict(good)  # a tensor the index places in a shard that does not hold it
    first = sorted(good["weight_map"])[0]
    other = [f for f in set(good["weight_map"].values()) if f != good["weight_map"][first]][0]
    moved["weight_map"] = dict(good["weight_map"], **{first: other})
    idx.write_text(json.dumps(moved))
    expect_error(sparsa_bin, d, first, other)
    idx.write_text("[1, 2")
    expect_error(sparsa_bin, d, "index.json", "JSON")
    idx.write_text(json.dumps({"metadata": {}}))
    expect_error(sparsa_bin, d, "weight_map")


def test_no_weights(sparsa_bin, tmp_path):
    d = fresh(tmp_path)
    (d / "model.safetensors").unlink()
    expect_error(sparsa_bin, d, "model.safetensors")


def test_prompt_longer_than_context(sparsa_bin, tmp_path):
    s = R.Spec("llada", dim=32, heads=2, layers=1, vocab=40, max_len=24)
    d = fresh(tmp_path, s)
    p = run(sparsa_bin, "generate", "--model", d, "--prompt-ids", ",".join(["1"] * 20), "--gen-len", 8,
            "--block-len", 8, "--steps", 8, "--json", check=False)
    assert p.returncode == 1 and "context of 24" in p.stderr, p.stderr
    p = run(sparsa_bin, "logits", "--model", d, "--ids", ",".join(["1"] * 25), "--out", tmp_path / "x.npy",
            check=False)
    assert p.returncode == 1 and "context of 24" in p.stderr, p.stderr
    p = run(sparsa_bin, "logits", "--model", d, "--ids", "1,99", "--out", tmp_path / "x.npy", check=False)
    assert p.returncode == 1 and "99" in p.stderr, p.stderr


def test_loop_and_option_errors(sparsa_bin, sdar_model, llada_model):
    _, _, ds = sdar_model
    _, _, dl = llada_model
    p = run(sparsa_bin, "generate", "--model", dl, "--prompt-ids", "1,2", "--loop", "block", "--json", check=False)
    assert p.returncode == 1 and "block" in p.stderr
    p = run(sparsa_bin, "generate", "--model", ds, "--prompt-ids", "1,2", "--loop", "remask", "--json", check=False)
    assert p.returncode == 1 and "sdar" in p.stderr
    p = run(sparsa_bin, "generate", "--model", dl, "--prompt-ids", "1,2", "--gen-len", 10, "--block-len", 4,
            "--json", check=False)
    assert p.returncode == 1 and "block_len" in p.stderr
    p = run(sparsa_bin, "generate", "--model", dl, "--prompt-ids", "1,x", "--json", check=False)
    assert p.returncode == 2 and "--prompt-ids" in p.stderr
    # The GEMM choice is checked on every backend, by name.
    p = run(sparsa_bin, "generate", "--model", dl, "--prompt-ids", "1,2", "--gemm", "fast", "--json", check=False)
    assert p.returncode == 1 and "gemm" in p.stderr and "streaming" in p.stderr, p.stderr
    p = run(sparsa_bin, "logits", "--model", dl, "--ids", "1,2", "--out", dl / "g.npy", "--gemm", "streaming",
            "--quiet", check=False)
    assert p.returncode == 0, p.stderr  # the cpu backend ignores it


def test_number_beyond_double_range(sparsa_bin, tmp_path):
    """Found by tests/fuzz/dlm_config_fuzz.cpp: a number JSON cannot hold in a double is an error."""
    d = fresh(tmp_path)
    text = (d / "config.json").read_text().replace('"block_size": 4', '"block_size": 4e475')
    (d / "config.json").write_text(text)
    expect_error(sparsa_bin, d, "config.json")


def test_the_loops_benchmark_runs(sparsa_bin):
    """bench/python/bench_dlm_loops.py at a tiny size: a row per loop, the token counts the loops'
    definitions give (remasking the whole canvas every step; the dual cache the fewest)."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "python", "bench_dlm_loops.py")
    p = subprocess.run([sys.executable, script, "--sparsa", sparsa_bin, "--dim", "64", "--layers", "1", "--vocab",
                        "64", "--prompt-len", "24", "--gen-len", "16", "--block-len", "8", "--requests", "1",
                        "--repeats", "1", "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in p.stdout.splitlines() if line.startswith("| ") and not line.startswith("| loop")}
    assert set(rows) == {"remask", "prefix_cache", "dual_cache"}
    tokens = {loop: int(r[3]) for loop, r in rows.items()}
    assert tokens["remask"] == 16 * 40 and tokens["dual_cache"] < tokens["prefix_cache"] < tokens["remask"]
    assert rows["remask"][5] == "100.0%"
