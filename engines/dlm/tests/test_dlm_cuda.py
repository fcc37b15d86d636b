"""The DLM engine's CUDA backend (--backend cuda) against the same independent numpy reference
(dlm_ref.py) as the CPU backend, on tiny random models whose heads are 64 or 128 wide (the CUDA
attention kernels' head_dim). Skipped where the binary has no CUDA backend or no GPU is visible
(CI); scripts/gpu-check runs them on the H200.

The bf16 bound (BF16_TOL, relative to the largest |logit| of the reference): the CUDA backend
rounds every weight and every GEMM input (normed rows, q/k/v, attention output, MLP hidden rows)
to bf16, unit roundoff u = 2^-8 ≈ 3.9e-3, and accumulates in f32. A rounded input perturbs each
product by ≤ u relative, and the perturbations of a dot product add like a random walk, so one
GEMM's output moves by about u·|y| (a little more where cancellation shrinks |y|); q·k logits
see two rounded operands, and 2-3 layers of residual stream carry the errors forward with gains
near 1 (RMSNorm renormalises). That is ~3u ≈ 1.2e-2 per layer in the worst rows; 4e-2 is that
bound for three layers with margin. The negative control below shows a RoPE off by one position
moves the logits by several times more, so the comparison can fail.
"""
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

import dlm_ref as R

BF16_TOL = 4e-2


def run(sparsa_bin, *args, check=True):
    p = subprocess.run([sparsa_bin, *map(str, args)], capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"sparsa {' '.join(map(str, args))} failed ({p.returncode}): {p.stderr}")
    return p


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


SPECS = {
    "llada_mha_f32_hd64": R.Spec("llada", dim=128, heads=2, layers=2, hidden=160, vocab=96),
    "llada_gqa_bf16_sharded_hd64": R.Spec("llada", dim=256, heads=4, kv_heads=2, layers=3, hidden=200, vocab=96,
                                          dtype="BF16", shards=3),
    "llada_linear_rope_f16_hd128": R.Spec("llada", dim=256, heads=2, layers=2, hidden=96, vocab=80, dtype="F16",
                                          theta=500000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "sdar_gqa_mixed_hd64": R.Spec("sdar", dim=128, heads=4, kv_heads=2, head_dim=64, layers=2, vocab=96, block=4,
                                  theta=1e6, dtype="mixed"),
    "sdar_ntk_bf16_hd128": R.Spec("sdar", dim=128, heads=4, kv_heads=1, head_dim=128, layers=2, vocab=80, block=5,
                                  dtype="BF16", rope_scaling={"type": "dynamic", "factor": 2.0}),
}


def engine_logits(sparsa_bin, model_dir, ids, tmp_path, backend="cuda", cached=0, gemm="cublas"):
    out = tmp_path / f"logits_{backend}.npy"
    run(sparsa_bin, "logits", "--model", model_dir, "--ids", ",".join(map(str, ids)), "--out", out, "--quiet",
        "--backend", backend, "--cached", cached, "--gemm", gemm)
    return np.load(out)


@pytest.fixture(scope="module")
def cuda_ok(sparsa_bin, tmp_path_factory):
    """Skips the module unless --backend cuda runs here."""
    d = tmp_path_factory.mktemp("probe")
    R.write_model(d, SPECS["llada_mha_f32_hd64"], seed=0)
    p = run(sparsa_bin, "logits", "--model", d, "--ids", "1,2", "--out", d / "x.npy", "--quiet", "--backend", "cuda",
            check=False)
    if p.returncode != 0:
        msg = p.stderr.strip()
        if "cuda" in msg and ("not compiled" in msg or "no CUDA device" in msg or "has no cuda backend" in msg
                              or "not available" in msg):
            pytest.skip(f"no CUDA backend here: {msg}")
        raise AssertionError(f"--backend cuda failed: {msg}")
    return True


# gemm "streaming": sparsa's weight-streaming kernel takes the chunks of up to 16 rows (n 1 and 9
# below, and the 16-row sdar blocks of the cached test), cuBLAS the rest; gemm "tuned": cuBLASLt
# with a timed algorithm takes the chunks of up to 64 rows (every chunk here).
@pytest.mark.parametrize("gemm", ["cublas", "streaming", "tuned"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_cuda_logits_within_the_bf16_bound(sparsa_bin, cuda_ok, tmp_path, name, gemm):
    s = SPECS[name]
    d = tmp_path / "model"
    w = R.write_model(d, s, seed=sum(map(ord, name)) % 1000)
    rng = np.random.default_rng(2)
    for n in (1, 9, 23, 70):  # 70 > 64 rows: the flash path of the chunk, and several sdar blocks
        ids = rng.integers(0, s.vocab, n)
        got = engine_logits(sparsa_bin, d, ids, tmp_path, gemm=gemm)
        assert got.shape == (n, s.vocab) and got.dtype == np.float32
        ref = R.canvas_logits(s, w, ids)
        err = rel_err(got, ref)
        print(f"{name} n={n}: rel err {err:.2e}")
        assert err < BF16_TOL, (name, n, err)
        # A row whose argmax moved must have been a near-tie of the reference: its two
        # candidates' reference logits within twice the bound of each other.
        scale = max(1.0, float(np.max(np.abs(ref))))
        for i in np.nonzero(np.argmax(got, -1) != np.argmax(ref, -1))[0]:
            gap = ref[i].max() - ref[i, np.argmax(got[i])]
            assert gap <= 2 * BF16_TOL * scale, (name, n, i, gap / scale)


@pytest.mark.parametrize("gemm", ["cublas", "streaming", "tuned"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_cuda_cached_logits_within_the_bf16_bound(sparsa_bin, cuda_ok, tmp_path, name, gemm):
    """The loops' cached path on the device: a prefill into the device KV cache (the pages'
    appends), then a chunk over it (prefix attention over the cache's views, the chunk's own
    keys, the merge), against the reference with the same split."""
    s = SPECS[name]
    d = tmp_path / "model"
    w = R.write_model(d, s, seed=sum(map(ord, name)) % 1000 + 1)
    rng = np.random.default_rng(3)
    bc = s.block if s.arch == "sdar" else 0
    for n, cached in ((12, 4 if bc == 4 else 5 if bc == 5 else 7), (90, 60 if bc in (4, 5) else 61)):
        ids = rng.integers(0, s.vocab, n)
        got = engine_logits(sparsa_bin, d, ids, tmp_path, cached=cached, gemm=gemm)
        past = R.forward(s, w, ids[:cached], None, bc)[1]
        ref = R.forward(s, w, ids[cached:], past, bc)[0]
        assert got.shape == ref.shape
        err = rel_err(got, ref)
        print(f"{name} n={n} cached={cached}: rel err {err:.2e}")
        assert err < BF16_TOL, (name, n, cached, err)


DREAM_SPECS = {
    "dream_gqa_bf16_hd64": R.Spec("dream", dim=128, heads=2, kv_heads=1, layers=2, hidden=160, vocab=96, theta=1e6,
                                  dtype="BF16"),
    "dream_mixed_tied_hd128": R.Spec("dream", dim=256, heads=2, kv_heads=2, layers=2, hidden=96, vocab=80,
                                     dtype="mixed", tied=True),
}


@pytest.mark.parametrize("gemm", ["cublas", "streaming", "tuned"])
@pytest.mark.parametrize("name", sorted(DREAM_SPECS))
def test_cuda_dream_logits_and_loop(sparsa_bin, cuda_ok, tmp_path, name, gemm):
    """Dream on the device: the q / k / v biases and the shifted head within the bf16 bound of the
    reference (a model without its biases is far outside), and Dream's loop gives gen_len tokens
    as the cpu backend's loop does where their picks' margins allow (the same count, no error)."""
    s = DREAM_SPECS[name]
    d = tmp_path / "model"
    w = R.write_model(d, s, seed=sum(map(ord, name)) % 1000 + 2)
    ids = np.random.default_rng(4).integers(0, s.vocab, 40)
    got = engine_logits(sparsa_bin, d, ids, tmp_path, gemm=gemm)
    ref = R.canvas_logits(s, w, ids)
    assert rel_err(got, ref) < BF16_TOL, rel_err(got, ref)
    no_bias = {**w, "layers": [{**L, "bq": 0 * L["bq"], "bk": 0 * L["bk"], "bv": 0 * L["bv"]} for L in w["layers"]]}
    assert rel_err(got, R.canvas_logits(s, no_bias, ids)) > 2 * BF16_TOL
    for backend in ("cuda", "cpu"):
        p = run(sparsa_bin, "generate", "--model", d, "--prompt-ids", "1,2,3", "--gen-len", 8, "--steps", 4,
                "--backend", backend, "--gemm", gemm, "--no-stop-at-eos", "--json", "--quiet")
        assert len(json.loads(p.stdout)["tokens"][0]) == 8


def test_cuda_negative_controls_are_outside_the_bound(sparsa_bin, cuda_ok, tmp_path):
    """The comparison can fail: a RoPE of another theta (RoPE is relative, so a shift of every
    position would not show; a wrong frequency does); a bidirectional sdar; a cached chunk that
    ignored its prefix."""
    s = R.Spec("llada", dim=128, heads=2, layers=2, hidden=160, vocab=96, theta=30.0)
    d = tmp_path / "llada"
    w = R.write_model(d, s, seed=4)
    ids = np.arange(40) % s.vocab
    got = engine_logits(sparsa_bin, d, ids, tmp_path)
    assert rel_err(got, R.canvas_logits(s, w, ids)) < BF16_TOL
    wrong_theta = R.Spec("llada", dim=128, heads=2, layers=2, hidden=160, vocab=96, theta=300.0)
    assert rel_err(got, R.canvas_logits(wrong_theta, w, ids)) > 2 * BF16_TOL
    cached = engine_logits(sparsa_bin, d, ids, tmp_path, cached=20)
    assert rel_err(cached, R.forward(s, w, ids[20:])[0]) > 2 * BF16_TOL  # as if nothing were cached
    s2 = SPECS["sdar_gqa_mixed_hd64"]
    d2 = tmp_path / "sdar"
    w2 = R.write_model(d2, s2, seed=5)
    got2 = engine_logits(sparsa_bin, d2, ids, tmp_path)
    bidirectional = R.forward(s2, w2, ids, None, 0)[0]
    assert rel_err(got2, bidirectional) > 2 * BF16_TOL, rel_err(got2, bidirectional)


def generate_ids(sparsa_bin, model_dir, prompts, backend, *flags):
    args = ["generate", "--model", model_dir, "--json", "--quiet", "--backend", backend, *flags]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    return json.loads(run(sparsa_bin, *args).stdout)["tokens"]


PROMPTS = [[3, 17, 5, 9, 30], [8, 1, 44, 2, 19, 27, 33, 12, 6]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    ll = R.Spec("llada", dim=128, heads=2, kv_heads=1, layers=2, vocab=64, eos=62, mask_id=63)
    sd = R.Spec("sdar", dim=128, heads=2, kv_heads=1, head_dim=64, layers=2, vocab=64, eos=62, mask_id=63, block=4)
    dl, ds = tmp_path_factory.mktemp("llada_gen"), tmp_path_factory.mktemp("sdar_gen")
    R.write_model(dl, ll, seed=11)
    R.write_model(ds, sd, seed=12)
    return dl, ds


LOOPS = {
    "remask": ["--loop", "remask", "--gen-len", 16, "--block-len", 8, "--steps", 8],
    "prefix_cache": ["--loop", "prefix_cache", "--gen-len", 16, "--block-len", 8, "--steps", 8, "--threshold", 0.3],
    "dual_cache": ["--loop", "dual_cache", "--gen-len", 16, "--block-len", 4, "--steps", 8, "--threshold", 0.3],
    "block": ["--loop", "block", "--gen-len", 10, "--steps", 2],
}


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_cuda_loops_are_deterministic_and_batches_equal_singles(sparsa_bin, cuda_ok, models, loop):
    """The loops on the device: every request gets gen_len tokens, a batch gives what each request
    gives alone (its own cache and state), and a second run the same tokens. (Token-for-token
    equality with the f64 reference is the CPU tests': the random test models' decisions have
    margins far below the bf16 bound, so a bf16 engine may break their near-ties otherwise. The
    cached logits above check the device's numbers.)"""
    dl, ds = models
    d = ds if loop == "block" else dl
    flags = [*LOOPS[loop], "--no-stop-at-eos"]
    gen_len = flags[flags.index("--gen-len") + 1]
    batch = generate_ids(sparsa_bin, d, PROMPTS, "cuda", *flags)
    assert [len(g) for g in batch] == [gen_len] * len(PROMPTS)
    assert all(0 <= t < 64 for g in batch for t in g)
    singles = [generate_ids(sparsa_bin, d, [p], "cuda", *flags)[0] for p in PROMPTS]
    assert batch == singles
    assert generate_ids(sparsa_bin, d, PROMPTS, "cuda", *flags) == batch
    # the repeated steps replayed from CUDA graphs compute what the eager steps compute
    assert generate_ids(sparsa_bin, d, PROMPTS, "cuda", *flags, "--no-cuda-graphs") == batch


def test_cuda_dual_cache_without_a_suffix_is_the_prefix_cache(sparsa_bin, cuda_ok, models):
    """With one block (block_len = gen_len) nothing follows the block: the dual cache keeps an empty
    suffix and each step runs the block over the prefix cache alone, which is the prefix cache's
    step (its suffix is the block): the same forwards on the device, the same tokens."""
    dl, _ = models
    flags = ["--gen-len", 8, "--block-len", 8, "--steps", 8, "--threshold", 0.3, "--no-stop-at-eos"]
    dual = generate_ids(sparsa_bin, dl, PROMPTS, "cuda", "--loop", "dual_cache", *flags)
    assert dual == generate_ids(sparsa_bin, dl, PROMPTS, "cuda", "--loop", "prefix_cache", *flags)


def test_cuda_dual_cache_refuses_the_device_prefix_steps_by_name(sparsa_bin, cuda_ok, models):
    """QUEST's and LoSA's device steps merge the prefix and the block only: with the dual cache's
    suffix they are refused by name, as LoSA is on the cpu."""
    dl, _ = models
    p = run(sparsa_bin, "generate", "--model", dl, "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--backend", "cuda",
            "--loop", "dual_cache", "--gen-len", 8, "--block-len", 4, "--steps", 4, "--attention", "quest:budget=16",
            "--quiet", check=False)
    assert p.returncode != 0 and "does not take the dual cache's suffix" in p.stderr, p.stderr


def test_cuda_errors_are_clear(sparsa_bin, cuda_ok, tmp_path):
    d = tmp_path / "hd16"
    R.write_model(d, R.Spec("llada", dim=64, heads=4, layers=1), seed=1)
    p = run(sparsa_bin, "logits", "--model", d, "--ids", "1,2,3", "--out", tmp_path / "x.npy", "--backend", "cuda",
            check=False)
    assert p.returncode != 0 and "head_dim 16" in p.stderr, p.stderr
    d2 = tmp_path / "ok"
    R.write_model(d2, SPECS["llada_mha_f32_hd64"], seed=1)
    p = run(sparsa_bin, "logits", "--model", d2, "--ids", "1,2", "--out", tmp_path / "y.npy", "--backend", "cuda:999",
            check=False)
    assert p.returncode != 0 and "cuda:999" in p.stderr, p.stderr
    # The device step takes blocks of up to 64 tokens: a longer LoSA block is a clear error.
    p = run(sparsa_bin, "generate", "--model", d2, "--prompt-ids", ",".join(["1"] * 40), "--backend", "cuda",
            "--loop", "prefix_cache", "--gen-len", 80, "--block-len", 80, "--steps", 2, "--attention", "losa",
            "--quiet", check=False)
    assert p.returncode != 0 and "losa on cuda" in p.stderr and "block_size" in p.stderr, p.stderr


LONG_PROMPTS = [[(7 * i + 3) % 60 for i in range(45)], [(11 * i + 5) % 60 for i in range(70)]]


CANVAS = [5, 9, 30, 63, 63, 63, 12, 7, 63, 63, 41, 2, 63, 63, 63, 63, 19, 27, 33, 63, 6, 63, 63, 63, 8]


@pytest.mark.parametrize("model,method", [
    ("llada", "ba_att:density=1,block=4,min_tokens=0"),
    ("llada", "ba_att:density=1,block=16,min_tokens=0,sort=false,compensate=false"),
    ("llada", "mean_pool:density=1,block=8,min_tokens=0"),
    ("sdar", "ba_att:density=1,block=4,min_tokens=0,block_causal=true"),
    ("sdar", "ba_att:density=1,block=4,min_tokens=0,sort=false,block_causal=true"),
    ("sdar", "mean_pool:density=1,block=8,min_tokens=0,block_causal=true"),
    ("llada", "xattention:density=1,block=4,stride=2,min_tokens=0"),
    ("sdar", "xattention:density=1,block=8,stride=4,min_tokens=0,block_causal=true"),
])
def test_cuda_canvas_selectors_at_density_one_give_the_dense_logits(sparsa_bin, cuda_ok, models, tmp_path, model,
                                                                    method):
    """BA-Att, mean pooling and XAttention on the device: at density 1 every key block is kept, so the
    block-sparse executor attends over the dense keys (in another order of sums): the logits are
    the dense ones within the bf16 bound. llada: over a whole bidirectional canvas; sdar: over
    the block-causal prompt prefill with `block_causal=true`, the executor applying the mask
    (sorted BA-Att's selection blind to it, the unsorted ones seeing it: mask_aware)."""
    d = models[0] if model == "llada" else models[1]
    dense = engine_logits(sparsa_bin, d, CANVAS, tmp_path)
    out = tmp_path / "sparse.npy"
    run(sparsa_bin, "logits", "--model", d, "--ids", ",".join(map(str, CANVAS)), "--out", out, "--quiet",
        "--backend", "cuda", "--attention", method)
    assert rel_err(np.load(out), dense) < BF16_TOL


@pytest.mark.parametrize("method", ["quest:budget=256", "losa:budget=256,k=4"])
def test_cuda_prefix_methods_at_a_covering_budget_commit_the_dense_tokens(sparsa_bin, cuda_ok, models, method):
    """QUEST and LoSA on the device (the engine's paged cache read in place by the device step):
    a budget of every prefix page (and, for LoSA, every row of a 4-token block active) attends
    over exactly the dense keys, so the block loop commits the dense tokens at temperature 0.
    (The two paths sum in other orders and round O_p to bf16 at other points; a decision whose
    margin is below that would differ, which these prompts do not meet.)"""
    _, ds = models
    flags = ["--loop", "block", "--gen-len", 12, "--steps", 4, "--no-stop-at-eos"]
    dense = generate_ids(sparsa_bin, ds, LONG_PROMPTS, "cuda", *flags)
    assert generate_ids(sparsa_bin, ds, LONG_PROMPTS, "cuda", *flags, "--attention", method) == dense


@pytest.mark.parametrize("method", ["quest:budget=16", "losa:budget=16,k=1", "losa:budget=32,threshold=0.5"])
def test_cuda_prefix_methods_at_a_real_budget_run_deterministically(sparsa_bin, cuda_ok, models, method):
    """One or two of up to five prefix pages: the loop runs on the device, every request gets its
    tokens, a batch gives what each request gives alone, and a second run the same tokens."""
    _, ds = models
    flags = ["--loop", "block", "--gen-len", 12, "--steps", 4, "--no-stop-at-eos", "--attention", method]
    batch = generate_ids(sparsa_bin, ds, LONG_PROMPTS, "cuda", *flags)
    assert [len(g) for g in batch] == [12, 12]
    assert all(0 <= t < 64 for g in batch for t in g)
    assert [generate_ids(sparsa_bin, ds, [p], "cuda", *flags)[0] for p in LONG_PROMPTS] == batch
    assert generate_ids(sparsa_bin, ds, LONG_PROMPTS, "cuda", *flags) == batch


@pytest.mark.parametrize("method", ["quest:budget=16", "losa:budget=16,k=1"])
def test_cuda_prefix_methods_batch_requests_out_of_step(sparsa_bin, cuda_ok, models, method):
    """Three requests of different prompt lengths decoded with a confidence threshold: each
    finishes its blocks after its own number of steps, so the batched device step sees entries
    idle (committing a block) beside entries stepping, and entries on a block's first step beside
    entries mid-block. Each request gets what it gets alone."""
    _, ds = models
    prompts = LONG_PROMPTS + [[(13 * i + 1) % 60 for i in range(58)]]
    flags = ["--loop", "block", "--gen-len", 16, "--steps", 4, "--threshold", 0.2, "--no-stop-at-eos",
             "--attention", method]
    batch = generate_ids(sparsa_bin, ds, prompts, "cuda", *flags)
    assert [len(g) for g in batch] == [16, 16, 16]
    assert [generate_ids(sparsa_bin, ds, [p], "cuda", *flags)[0] for p in prompts] == batch


def test_cuda_more_requests_than_one_device_batch(sparsa_bin, cuda_ok, models):
    """66 requests: the device caches and LoSA's batched state take 64 sequences a group
    (kDeviceLosaMaxBatch), so the batch is two groups; requests on both sides of the boundary get
    what they get alone."""
    _, ds = models
    prompts = [[(5 * i + 3 * r) % 60 for i in range(20 + r % 17)] for r in range(66)]
    flags = ["--loop", "block", "--gen-len", 8, "--steps", 2, "--no-stop-at-eos", "--attention", "losa:budget=16,k=1"]
    batch = generate_ids(sparsa_bin, ds, prompts, "cuda", *flags)
    assert [len(g) for g in batch] == [8] * 66
    for r in (0, 63, 64, 65):
        assert generate_ids(sparsa_bin, ds, [prompts[r]], "cuda", *flags)[0] == batch[r], r


SHIPPED = Path(__file__).resolve().parents[3] / "models" / "sparsa-sdar-ruler"


def test_cuda_a_model_loaded_after_another_answers_as_the_first(sparsa_bin, cuda_ok, tmp_path):
    """eval-model loads each method's model in turn in one process, each after the previous one
    is freed. The dense cells, with sparse ones between them, must answer question for question
    alike (the CPU does). Before the weights and the RoPE table went up on the engine's stream, a
    model loaded after another that had run could read part of a stale RoPE table in its first
    request: on this question (4K, one question a cell) 15-16 of 17 later cells answered wrong
    (bench/RESULTS.md)."""
    out = tmp_path / "eval.json"
    methods = "dense;quest:budget=128;dense;ba_att:density=0.5,block_causal=true|0=dense;dense"
    run(sparsa_bin, "eval-model", "--model", SHIPPED, "--backend", "cuda", "--tasks", "niah_single_1",
        "--lengths", "4K", "--samples", 1, "--attention", methods, "--json", out, "--quiet")
    cells = json.loads(out.read_text())["results"]
    predictions = [[s["prediction"] for s in c["per_sample"]] for c in cells]
    assert len(predictions) == 5
    assert predictions[2] == predictions[0] and predictions[4] == predictions[0], predictions
