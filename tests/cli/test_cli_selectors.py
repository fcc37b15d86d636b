# Tests of the block selectors' CLI surface: the `ba_att`, `mean_pool` and `xattention`
# methods, `sparsa plan` (JSON plan, SVG mask) and `sparsa eval` (matched densities).
# The reference is numpy attention under the mask that the dumped plan describes, so a
# plan whose permutations or indices were written wrongly, or an output not returned to
# the original token order, fails here.
import json
import math
import subprocess

import numpy as np
import pytest


def run_cli(sparsa_bin, *args, timeout=600):
    return subprocess.run([sparsa_bin, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def attention(q, k, v, mask):
    """float64 softmax attention; q [B, Hq, Lq, d], k/v [B, Hkv, Lk, d], mask [B, Hq, Lq, Lk]."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("bhij,bhjd->bhid", p / p.sum(axis=-1, keepdims=True), v)


def mask_of_plan(plan, len_q, len_kv, heads_kv):
    """Token-level visibility [B, Hq, Lq, Lk] in the original order, from a `sparsa plan` JSON."""
    B, Hq, nq = plan["shape"]
    bq, bk = plan["block_q"], plan["block_kv"]
    perm_q = np.arange(len_q)[None, None].repeat(B, 0).repeat(Hq, 1)
    perm_kv = np.arange(len_kv)[None, None].repeat(B, 0).repeat(heads_kv, 1)
    if plan["perm_q"] is not None:
        perm_q = np.array(plan["perm_q"]).reshape(B, Hq, len_q)
    if plan["perm_kv"] is not None:
        perm_kv = np.array(plan["perm_kv"]).reshape(B, heads_kv, len_kv)
    mask = np.zeros((B, Hq, len_q, len_kv), dtype=bool)
    group = Hq // heads_kv
    for b in range(B):
        for h in range(Hq):
            for qb in range(nq):
                rows = perm_q[b, h, qb * bq:(qb + 1) * bq]
                for kb in plan["indices"][b][h][qb]:
                    cols = perm_kv[b, h // group, kb * bk:(kb + 1) * bk]
                    mask[b, h, rows[:, None], cols[None, :]] = True
    return mask


@pytest.fixture
def qkv(tmp_path):
    rng = np.random.default_rng(3)
    # Heavy-tailed norms so the sort matters; awkward lengths (partial blocks), GQA 4:2.
    q = rng.standard_normal((1, 4, 150, 32)) * np.exp(0.5 * rng.standard_normal((1, 4, 150, 1)))
    k = rng.standard_normal((1, 2, 210, 32)) * np.exp(0.5 * rng.standard_normal((1, 2, 210, 1)))
    v = rng.standard_normal((1, 2, 210, 32))
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    paths = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{name}.npy", x)
        paths.append(tmp_path / f"{name}.npy")
    return q, k, v, paths


@pytest.mark.parametrize("method,params", [
    ("ba_att", ["-P", "block=16", "-P", "density=0.3"]),
    ("ba_att", ["-P", "block_q=32", "-P", "block_kv=16", "-P", "kappa=3", "-P", "compensation=exact"]),
    ("ba_att", ["-P", "block=16", "-P", "tau=0.8", "-P", "window=64"]),
    ("mean_pool", ["-P", "block=16", "-P", "density=0.25"]),
    ("xattention", ["-P", "block=16", "-P", "stride=4"]),
])
def test_plan_json_drives_run_output(sparsa_bin, tmp_path, qkv, method, params):
    q, k, v, (pq, pk, pv) = qkv
    r = run_cli(sparsa_bin, "plan", "--method", method, "--q", pq, "--k", pk, *params,
                "--json", tmp_path / "plan.json", "--svg", tmp_path / "mask.svg", "--head", 3)
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    for b in plan["indices"]:
        for h in b:
            for row in h:
                assert row == sorted(set(row)) and len(row) >= 1
    for key, n in (("perm_q", 150), ("perm_kv", 210)):
        if plan[key] is not None:
            for row in np.array(plan[key]).reshape(-1, n):
                assert sorted(row) == list(range(n)), f"{key} is not a permutation"
    assert (tmp_path / "mask.svg").read_text().startswith("<svg")
    r = run_cli(sparsa_bin, "run", "--method", method, "--q", pq, "--k", pk, "--v", pv, *params,
                "--out", tmp_path / "o.npy", "--quiet")
    assert r.returncode == 0, r.stderr
    expected = attention(q, k, v, mask_of_plan(plan, 150, 210, 2))
    out = np.load(tmp_path / "o.npy")
    assert np.abs(out - expected).max() <= 1e-5 * np.abs(expected).max()  # f32 online softmax vs f64


def test_eval_matched_densities(sparsa_bin, tmp_path, qkv):
    _, _, _, (pq, pk, pv) = qkv
    r = run_cli(sparsa_bin, "eval", "--q", pq, "--k", pk, "--v", pv, "--methods", "ba_att,mean_pool,xattention",
                "--densities", "0.2,1", "-P", "ba_att.block=16", "-P", "mean_pool.block=16",
                "-P", "xattention.block=16", "-P", "xattention.stride=4", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["results"]
    assert len(rows) == 6
    for row in rows:
        assert 0 < row["mass_recall"] <= 1 + 1e-6
        if row["target_density"] == 1:
            assert row["density"] == 1 and row["mass_recall"] > 1 - 1e-5 and row["rel_err"] < 1e-5
        else:
            assert row["density"] < 0.5


def test_eval_under_a_mask(sparsa_bin, tmp_path, qkv):
    """--mask: the dense reference and the executors apply it; with mask_aware the selections see
    it, so at density 1 they are the masked reference exactly and below it they list no block the
    mask hides (the causal plan's visible share of the blocks bounds the density)."""
    _, _, _, (pq, pk, pv) = qkv
    aware = ["-P", "ba_att.sort=false", "-P", "ba_att.mask_aware=true", "-P", "mean_pool.mask_aware=true",
             "-P", "xattention.mask_aware=true", "-P", "xattention.stride=4"]
    blocks = [x for m in ("ba_att", "mean_pool", "xattention") for x in ("-P", f"{m}.block=16")]
    r = run_cli(sparsa_bin, "eval", "--q", pq, "--k", pk, "--v", pv, "--methods", "ba_att,mean_pool,xattention",
                "--densities", "0.3,1", "--mask", "causal", *aware, *blocks, "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["mask"] == "causal" and len(report["results"]) == 6
    plain = json.loads(run_cli(sparsa_bin, "eval", "--q", pq, "--k", pk, "--v", pv, "--methods", "ba_att",
                               "--densities", "1", *blocks[:2], "--json").stdout)["results"][0]
    for row in report["results"]:
        if row["target_density"] == 1:
            assert row["mass_recall"] > 1 - 1e-5 and row["rel_err"] < 1e-5, row
            assert row["density"] < plain["density"]  # the hidden blocks are not listed
        else:
            assert 0 < row["mass_recall"] < 1 and row["rel_err"] > 1e-3, row
    r = run_cli(sparsa_bin, "eval", "--q", pq, "--k", pk, "--v", pv, "--methods", "ba_att", "--mask", "causal(2)")
    assert r.returncode == 2 and "--mask" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["plan", "--method", "dense"], "--method: plan supports"),
    (["plan", "--method", "ba_att", "-P", "density=0.1", "-P", "tau=0.5"], "alternative budgets"),
    (["plan", "--method", "ba_att", "-P", "compensation=full"], "compensation: expected diagonal, exact or trace"),
    (["plan", "--method", "xattention", "-P", "stride=3"], "stride: expected a divisor"),
    (["plan", "--method", "ba_att", "-P", "window=100"], "sort_window: expected a multiple"),
    (["eval", "--methods", "dense"], "dense is the reference"),
    (["eval", "--densities", "0.1,2"], "--densities"),
])
def test_selector_errors_name_the_argument(sparsa_bin, args, needle):
    r = run_cli(sparsa_bin, *args, "--length", 256)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sparsa: error:") and needle in lines[0], r.stderr
