"""The attention capture (`--dump-attention DIR`) and the per-step breakdown of `sparsa generate`.

What the capture writes is checked three ways: the captured q, k, v equal the independent numpy
reference's per-layer q, k, v (after RoPE) within the golden tests' LOGIT_TOL (f32 engine vs f64
reference on the same weights); a later forward's prefix_k / prefix_v equal the k / v that the
capture saw when those positions were the chunk; and the block plan the engine's BA-Att layers
ran over is, entry for entry, the plan `sparsa plan` builds from the captured q and k with the
parameters the capture names (selection is deterministic, so "equal" is exact). Capturing does
not change what the engine computes (the logits are bit-identical with and without it).
"""
import json
import os

import numpy as np
import pytest

import dlm_ref as R
from test_dlm import LOGIT_TOL, PROMPTS, rel_err, run

CANVAS = [5, 9, 30, 63, 63, 63, 12, 7, 63, 63, 41, 2, 63, 63, 63, 63, 19, 27, 33, 63, 6, 63, 63, 63]


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    s = R.Spec("llada", dim=64, heads=4, kv_heads=2, layers=2, vocab=64, eos=62, mask_id=63)
    d = tmp_path_factory.mktemp("llada_dump")
    return s, R.write_model(d, s, seed=31), d


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    s = R.Spec("sdar", dim=64, heads=4, kv_heads=2, layers=2, vocab=64, eos=62, mask_id=63, block=4)
    d = tmp_path_factory.mktemp("sdar_dump")
    return s, R.write_model(d, s, seed=32), d


def logits(sparsa_bin, d, out, *flags, ids=CANVAS, check=True):
    return run(sparsa_bin, "logits", "--model", d, "--ids", ",".join(map(str, ids)), "--out", out, "--quiet", *flags,
               check=check)


def bhsd(x):
    """The reference's [n, heads, hd] as the capture's [1, heads, n, hd]."""
    return np.transpose(x, (1, 0, 2))[None]


def test_dense_capture_equals_the_reference(sparsa_bin, llada, tmp_path):
    s, w, d = llada
    dump = tmp_path / "dump"
    p = logits(sparsa_bin, d, tmp_path / "a.npy", "--dump-attention", dump)
    assert "attention dump: 2 files" in p.stderr
    assert sorted(os.listdir(dump)) == ["r0-l0-f0.safetensors", "r0-l1-f0.safetensors"]
    captured = []
    R.forward(s, w, CANVAS, None, 0, capture=captured)
    for layer, (q, k, v) in enumerate(captured):
        t, meta = R.read_safetensors(dump / f"r0-l{layer}-f0.safetensors")
        assert set(t) == {"q", "k", "v"}  # no prefix: the canvas is the whole sequence
        assert t["q"].shape == (1, s.heads, len(CANVAS), s.head_dim)
        assert t["k"].shape == (1, s.kv_heads, len(CANVAS), s.head_dim)
        for name, ref in (("q", q), ("k", k), ("v", v)):
            assert rel_err(t[name], bhsd(ref)) < LOGIT_TOL, (layer, name)
        assert meta["layer"] == str(layer) and meta["pos0"] == "0" and meta["tokens"] == str(len(CANVAS))
        assert meta["method"] == "dense" and meta["request"] == "0" and meta["forward"] == "0"
        assert "plan" not in meta
    # The capture does not change the computation.
    plain = tmp_path / "b.npy"
    logits(sparsa_bin, d, plain)
    assert np.array_equal(np.load(tmp_path / "a.npy"), np.load(plain))


@pytest.mark.parametrize("method", ["ba_att:top_kappa=2,block=4,min_tokens=0",
                                    "ba_att:density=0.5,block=8,min_tokens=0,compensate=false,sort_k=false",
                                    "mean_pool:density=0.5,block=4,min_tokens=0",
                                    "xattention:top_kappa=2,block=4,stride=2,min_tokens=0,force_first=false"])
def test_ba_att_plan_inside_the_engine_is_the_plan_of_sparsa_plan(sparsa_bin, llada, tmp_path, method):
    """Must-show: the captured tensors of one layer fed to the CLI give the engine's plan."""
    s, w, d = llada
    dump = tmp_path / "dump"
    logits(sparsa_bin, d, tmp_path / "a.npy", "--attention", method, "--dump-attention", dump)
    for layer in range(s.layers):
        f = dump / f"r0-l{layer}-f0.safetensors"
        _, meta = R.read_safetensors(f)
        name = method.split(":")[0]
        assert meta["method"] == method and meta["plan_method"] == name
        engine_plan, engine_meta = R.read_safetensors(dump / meta["plan"])
        params = [x for kv in meta["plan_params"].split() for x in ("-P", kv)]
        index = tmp_path / f"plan{layer}.safetensors"
        run(sparsa_bin, "plan", "--method", name, "--q", f"{f}:q", "--k", f"{f}:k", *params, "--index", index)
        cli_plan, cli_meta = R.read_safetensors(index)
        perms = {"perm_q", "perm_kv"} if name == "ba_att" and "sort_k=false" not in method else \
            {"perm_q"} if name == "ba_att" else set()
        assert set(engine_plan) == set(cli_plan) == {"counts", "indices"} | perms
        for name in engine_plan:
            assert np.array_equal(engine_plan[name], cli_plan[name]), (layer, name)
        assert engine_meta == cli_meta
        counts = engine_plan["counts"]
        nk = -(-len(CANVAS) // int(engine_meta["block_kv"]))
        assert counts.min() >= 1 and counts.max() < nk  # a real selection, not every block
    # And `sparsa eval` runs on the real tensors (the oracle recall of methods on layer 1).
    f = dump / "r0-l1-f0.safetensors"
    p = run(sparsa_bin, "eval", "--q", f"{f}:q", "--k", f"{f}:k", "--v", f"{f}:v", "--methods", "ba_att,mean_pool",
            "--densities", "0.5", "-P", "ba_att.block=4", "-P", "mean_pool.block=4", "--json", "-")
    assert "ba_att" in p.stdout and "mean_pool" in p.stdout


@pytest.mark.parametrize("method", ["ba_att:top_kappa=2,block=8,min_tokens=0,sort=false,block_causal=true",
                                    "mean_pool:density=0.5,block=8,min_tokens=0,block_causal=true",
                                    "xattention:top_kappa=2,block=8,stride=2,min_tokens=0,force_first=false,"
                                    "block_causal=true"])
def test_block_causal_plan_inside_the_engine_is_the_plan_of_sparsa_plan(sparsa_bin, sdar, tmp_path, method):
    """sdar's canvas is one block-causal chunk: with block_causal the selector sees the mask, and
    `sparsa plan --mask block_causal(B) -P mask_aware=true` on the captured q, k gives its plan."""
    s, w, d = sdar
    dump = tmp_path / "dump"
    logits(sparsa_bin, d, tmp_path / "a.npy", "--attention", method, "--dump-attention", dump)
    name = method.split(":")[0]
    for layer in range(s.layers):
        f = dump / f"r0-l{layer}-f0.safetensors"
        _, meta = R.read_safetensors(f)
        assert meta["block_causal"] == str(s.block) and meta["plan_method"] == name
        assert "mask_aware=true" in meta["plan_params"].split()
        engine_plan, engine_meta = R.read_safetensors(dump / meta["plan"])
        params = [x for kv in meta["plan_params"].split() for x in ("-P", kv)]
        index = tmp_path / f"plan{layer}.safetensors"
        run(sparsa_bin, "plan", "--method", name, "--q", f"{f}:q", "--k", f"{f}:k", *params,
            "--mask", f"block_causal({s.block})", "--index", index)
        cli_plan, cli_meta = R.read_safetensors(index)
        assert set(engine_plan) == set(cli_plan) == {"counts", "indices"}
        for key in engine_plan:
            assert np.array_equal(engine_plan[key], cli_plan[key]), (layer, key)
        assert engine_meta == cli_meta
        # Query block i (8 tokens = 2 of the model's blocks) never keeps a key block after its own.
        counts, indices = engine_plan["counts"], engine_plan["indices"]
        for row in range(counts.shape[2]):
            kept = indices[0, :, row, :].tolist()
            for h in range(counts.shape[1]):
                assert all(j <= row for j in kept[h][:counts[0, h, row]]), (layer, h, row)
                assert row in kept[h][:counts[0, h, row]]  # the diagonal block: the mask cuts it


def test_block_loop_capture_selects_layers_and_forwards(sparsa_bin, sdar, tmp_path):
    s, w, d = sdar
    dump = tmp_path / "dump"
    args = ["generate", "--model", d, "--gen-len", 8, "--steps", 2, "--no-stop-at-eos", "--json", "--quiet",
            "--dump-attention", dump, "--dump-layers", "1", "--dump-forwards", "0,2"]
    for p in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, p))]
    run(sparsa_bin, *args)
    names = sorted(os.listdir(dump))
    assert names == [f"r{r}-l1-f{f}.safetensors" for r in range(len(PROMPTS)) for f in (0, 2)]
    for r in range(len(PROMPTS)):
        first, m0 = R.read_safetensors(dump / f"r{r}-l1-f0.safetensors")
        later, m2 = R.read_safetensors(dump / f"r{r}-l1-f2.safetensors")
        assert m0["pos0"] == "0" and int(m2["pos0"]) > 0
        pos0 = int(m2["pos0"])
        assert later["prefix_k"].shape == (1, s.kv_heads, pos0, s.head_dim)
        # The prefix the later forward ran over starts with what the prefill computed (one
        # block-causal pass over the prompt's whole blocks).
        n0 = int(m0["tokens"])
        assert m0["block_causal"] == str(s.block) and n0 % s.block == 0 and pos0 >= n0
        assert np.array_equal(later["prefix_k"][:, :, :n0], first["k"])
        assert np.array_equal(later["prefix_v"][:, :, :n0], first["v"])


def test_capture_limit_and_bad_arguments(sparsa_bin, llada, tmp_path):
    s, w, d = llada
    p = logits(sparsa_bin, d, tmp_path / "a.npy", "--dump-attention", tmp_path / "one", "--dump-max", 1)
    assert os.listdir(tmp_path / "one") == ["r0-l0-f0.safetensors"]
    assert "1 more selected, over --dump-max 1" in p.stderr
    # A directory with files in it is refused, and its files are left as they were.
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    p = logits(sparsa_bin, d, tmp_path / "b.npy", "--dump-attention", busy, check=False)
    assert p.returncode != 0 and "dump_attention" in p.stderr and "not empty" in p.stderr
    assert os.listdir(busy) == ["keep.txt"] and (busy / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "b.npy").exists()
    for flags, needle in ((["--dump-attention", tmp_path / "x", "--dump-layers", "2"], "dump_attention.layers"),
                          (["--dump-attention", tmp_path / "y", "--dump-layers", "a"], "--dump-layers"),
                          (["--dump-attention", tmp_path / "z", "--dump-max", "0"], "dump_attention.max_files"),
                          (["--dump-layers", "0"], "--dump-attention"),
                          (["--dump-attention", tmp_path / "a.npy"], "not a directory")):
        p = logits(sparsa_bin, d, tmp_path / "c.npy", *flags, check=False)
        assert p.returncode != 0 and needle in p.stderr, (flags, p.stderr)


def test_generate_reports_the_attention_share(sparsa_bin, llada):
    s, w, d = llada
    p = run(sparsa_bin, "generate", "--model", d, "--prompt-ids", "3,17,5", "--gen-len", 8, "--block-len", 4,
            "--steps", 4, "--json")
    j = json.loads(p.stdout)
    assert 0 <= j["attention_seconds"] <= j["seconds"]
    assert "forward passes" in p.stderr and "attention" in p.stderr and "the rest" in p.stderr


def test_trace_over_a_captured_decode(sparsa_bin, sdar, tmp_path):
    """`sparsa trace --capture`: one request's decode at one layer, as the engine ran it, under
    dense, QUEST and LoSA. Checked here independently of the tool: the trace's prefix and blocks
    are the capture's (its metadata); the unmasking order it reads from layer 0 is the one the
    captured keys show (a token is unmasked by step s exactly when its layer-0 key already equals
    its committed key); dense is its own reference, QUEST and LoSA with a budget covering the
    prefix (and LoSA recomputing every row) equal it, and a one-page budget does not."""
    s, w, d = sdar
    dump = tmp_path / "dump"
    # 40 tokens, ten whole blocks of 4 (the decoded blocks hold no prompt token) and three pages
    prompt = ",".join(str((7 * i + 5) % 60) for i in range(40))
    run(sparsa_bin, "generate", "--model", d, "--prompt-ids", prompt, "--gen-len", 12, "--steps", 2,
        "--no-stop-at-eos", "--ban-eos", "--quiet", "--dump-attention", dump, "--dump-layers", "0,1")
    metas = {int(f.split("-f")[1].split(".")[0]): R.read_safetensors(dump / f)[1]
             for f in os.listdir(dump) if f.startswith("r0-l1-")}
    steps0 = [f for f in sorted(metas) if metas[f]["step"] == "0"]
    commits = [f for f in sorted(metas) if metas[f]["step"] == "-1" and f > steps0[0]]
    assert len(steps0) == 3 and len(commits) == 3  # 12 tokens, blocks of 4

    def trace(*flags, check=True):
        return run(sparsa_bin, "trace", "--capture", dump, *flags, "--json", "--threads", 1, check=check)

    full = json.loads(trace("--layer", 1, "--methods", "dense,quest,losa", "-P", "budget=64", "-P", "k=4").stdout)
    t = full["trace"]
    assert (t["prefix"], t["block"], t["blocks"], t["steps_per_block"]) == (int(metas[steps0[0]]["pos0"]), 4, 3, 2)
    assert (t["heads"], t["kv_heads"], t["head_dim"]) == (s.heads, s.kv_heads, s.head_dim)
    dense, quest, losa = full["methods"]
    assert all(x["err"] == 0 and x["mass_kept"] == 1 for x in dense["steps"])
    assert all(x["err"] < 1e-5 for x in quest["steps"] + losa["steps"])
    for b, first in enumerate(steps0):
        k0 = [R.read_safetensors(dump / f"r0-l0-f{first + i}.safetensors")[0]["k"] for i in range(3)]  # 2 steps, commit
        done = set()
        for step in range(2):
            rec = dense["steps"][b * 2 + step]
            assert (rec["block"], rec["step"]) == (b, step)
            for i in range(4):
                assert (i in done) == np.array_equal(k0[step][:, :, i], k0[2][:, :, i]), (b, step, i)
            assert len(rec["unmasked"]) == 2 and not done & set(rec["unmasked"])
            done |= set(rec["unmasked"])
        assert done == {0, 1, 2, 3}
    sparse = json.loads(trace("--layer", 1, "--methods", "dense,quest", "-P", "budget=16").stdout)["methods"][1]
    assert max(x["err"] for x in sparse["steps"]) > 1e-3  # the comparison has teeth

    # A prompt ending inside a block: the first decoded block has fewer masked tokens and steps,
    # and joins the prefix (its forwards counted as left out).
    odd = tmp_path / "odd"
    run(sparsa_bin, "generate", "--model", d, "--prompt-ids", prompt + ",11", "--gen-len", 11,  # a token a step
        "--no-stop-at-eos", "--ban-eos", "--quiet", "--dump-attention", odd, "--dump-layers", "0,1")
    odd_meta = {int(f.split("-f")[1].split(".")[0]): R.read_safetensors(odd / f)[1]
                for f in os.listdir(odd) if f.startswith("r0-l1-")}
    odd_steps0 = [f for f in sorted(odd_meta) if odd_meta[f]["step"] == "0"]
    assert [int(odd_meta[f]["pos0"]) for f in odd_steps0] == [40, 44, 48]
    p = run(sparsa_bin, "trace", "--capture", odd, "--layer", 1, "--json", "--threads", 1)
    t = json.loads(p.stdout)["trace"]
    assert (t["prefix"], t["blocks"], t["steps_per_block"]) == (44, 2, 4)

    # Bad captures and flags: usage errors naming what is wrong.
    p = trace("--layer", 1, "--prefix", 64, check=False)
    assert p.returncode == 2 and "--prefix" in p.stderr, p.stderr
    p = run(sparsa_bin, "trace", "--layer", 1, check=False)
    assert p.returncode == 2 and "--capture" in p.stderr, p.stderr
    p = trace(check=False)
    assert p.returncode == 2 and "--layer" in p.stderr, p.stderr
    p = trace("--layer", 5, check=False)
    assert p.returncode == 2 and "r0-l5-f" in p.stderr, p.stderr
    only1 = tmp_path / "only1"
    only1.mkdir()
    for f in os.listdir(dump):
        if f.startswith("r0-l1-"):
            (only1 / f).write_bytes((dump / f).read_bytes())
    p = run(sparsa_bin, "trace", "--capture", only1, "--layer", 1, check=False)
    assert p.returncode == 2 and "layer 0" in p.stderr, p.stderr
    # A forward left out (as --dump-forwards or --dump-max would): refused, naming the file.
    (only1 / f"r0-l1-f{steps0[1] + 1}.safetensors").unlink()
    for f in os.listdir(dump):
        if f.startswith("r0-l0-"):
            (only1 / f).write_bytes((dump / f).read_bytes())
    p = run(sparsa_bin, "trace", "--capture", only1, "--layer", 1, check=False)
    assert p.returncode == 2 and "commit pass" in p.stderr, p.stderr
    # Metadata that is not an integer: a malformed file, named with its field.
    name = only1 / f"r0-l1-f{steps0[0]}.safetensors"
    raw = name.read_bytes()
    assert raw.count(b'"step":"0"') == 1
    name.write_bytes(raw.replace(b'"step":"0"', b'"step":"x"'))
    p = run(sparsa_bin, "trace", "--capture", only1, "--layer", 1, check=False)
    assert p.returncode == 1 and "step: expected an integer" in p.stderr and name.name in p.stderr, p.stderr
