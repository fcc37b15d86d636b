"""`sparsa trace` (LoSA / QUEST / dense prefix attention over a decode trace) and the
decode section of `sparsa demo`."""
import json
import subprocess

import pytest


def run(sparsa_bin, *args):
    return subprocess.run([sparsa_bin, *args], capture_output=True, text=True, timeout=300)


def test_trace_json_counts_pages_rows_and_error(sparsa_bin):
    r = run(sparsa_bin, "trace", "--prefix", "1024", "-P", "k=2", "-P", "budget=128", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    by = {m["method"]: m for m in d["methods"]}
    assert set(by) == {"dense", "quest", "losa"}
    steps = len(by["dense"]["steps"])
    assert steps == 16  # block 16, one token unmasked per step
    # Dense loads every page of the 1024-token prefix (64 pages of 16) and is the reference.
    assert by["dense"]["pages_per_kv_head"] == 64 and by["dense"]["err"] == 0
    # LoSA: the first step of the block is dense (all 16 rows), later steps recompute only K = 2 rows.
    losa_rows = [s["recomputed"] for s in by["losa"]["steps"]]
    assert losa_rows[0] == 16 and all(n == 2 for n in losa_rows[1:])
    # QUEST recomputes every row every step; its per-token pages inflate the union beyond LoSA's.
    assert all(s["recomputed"] == 16 for s in by["quest"]["steps"])
    assert by["losa"]["pages_per_kv_head"] < by["quest"]["pages_per_kv_head"] < 64
    assert 0 < by["losa"]["err"] < 1 and 0 < by["quest"]["err"] < 1.5


def cuda_available(sparsa_bin):
    info = json.loads(run(sparsa_bin, "info", "--json").stdout)
    return next(b for b in info["backends"] if b["name"] == "cuda")["available"]


def test_trace_on_cuda(sparsa_bin):
    """`--backend cuda`: every method and the dense reference on the device (bf16). Without a
    device (CI) a clear error naming the backend; with one, the same counts as on the CPU (the
    rows each step recomputes), dense exact against its own reference, reuse's error below
    LoSA's, and the time column named for the device."""
    args = ["trace", "--prefix", "1024", "--methods", "dense,quest,losa,reuse", "-P", "k=2", "-P", "budget=128",
            "--backend", "cuda"]
    r = run(sparsa_bin, *args, "--json")
    if not cuda_available(sparsa_bin):
        assert r.returncode != 0
        assert "--backend: backend: 'cuda'" in r.stderr and "generating" not in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["trace"]["backend"] == "cuda"
    by = {m["method"]: m for m in d["methods"]}
    assert by["dense"]["err"] == 0 and by["dense"]["pages_per_kv_head"] == 64
    losa_rows = [s["recomputed"] for s in by["losa"]["steps"]]
    assert losa_rows[0] == 16 and all(n == 2 for n in losa_rows[1:])
    assert [s["recomputed"] for s in by["reuse"]["steps"]] == losa_rows
    assert all(s["recomputed"] == 16 for s in by["quest"]["steps"])
    assert by["losa"]["pages_per_kv_head"] < by["quest"]["pages_per_kv_head"] < 64
    assert 0 <= by["reuse"]["err"] < by["losa"]["err"] < 1
    assert "device_ms" in by["losa"] and "cpu_ms" not in by["losa"]
    table = run(sparsa_bin, *args)
    assert table.returncode == 0, table.stderr
    assert "device ms/step" in table.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["-P", "budget=0"], "budget: expected an integer"),
        (["-P", "k=-1"], "k: expected an integer"),
        (["--block", "3"], "block_size: expected 4 to 32 tokens, got 3"),
        (["--block", "40"], "block_size: expected 4 to 32 tokens, got 40"),
        (["-P", "selector=foo"], "selector: expected quest or pooled, got 'foo'"),
        (["--methods", "losa,bogus"], "method: expected dense, quest, losa or reuse, got 'bogus'"),
    ],
)
def test_trace_bad_arguments(sparsa_bin, args, message):
    r = run(sparsa_bin, "trace", "--prefix", "1024", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("sparsa: error: ") and message in lines[-1], r.stderr


def test_demo_includes_the_decode_trace(sparsa_bin, tmp_path):
    r = subprocess.run([sparsa_bin, "demo", "--length", "512", "--plot", str(tmp_path / "d.svg")],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "block-diffusion decode" in r.stdout
    assert "\nlosa " in r.stdout and "\nquest " in r.stdout


def test_eval_with_losa_scores_a_decode_trace(sparsa_bin):
    r = run(sparsa_bin, "eval", "--methods", "dense,quest,losa", "-P", "k=2", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert [m["method"] for m in d["methods"]] == ["dense", "quest", "losa"]
    assert d["params"] == {"k": 2}
    assert all(s["recomputed"] == 2 for s in d["methods"][2]["steps"][1:])


def test_eval_with_losa_is_the_trace_with_its_defaults(sparsa_bin):
    # Without --seed, eval runs the trace sparsa trace runs (its seed, not eval's workload seed);
    # -P takes the trace's keys scoped (losa.k) or not.
    a = run(sparsa_bin, "eval", "--methods", "dense,quest,losa", "-P", "losa.k=2", "--json")
    b = run(sparsa_bin, "trace", "-P", "k=2", "--json")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    da, db = json.loads(a.stdout), json.loads(b.stdout)
    assert da["params"] == db["params"] == {"k": 2}
    pages = lambda d: [m["pages_per_kv_head"] for m in d["methods"]]
    assert pages(da) == pages(db)


@pytest.mark.parametrize(
    "args, flag",
    [
        (["eval", "--methods", "losa", "--length", "512"], "--length"),
        (["eval", "--methods", "losa", "--q", "missing.npy", "--k", "k.npy", "--v", "v.npy"], "--q"),
        (["eval", "--methods", "dense,losa", "--densities", "0.1"], "--densities"),
        (["bench", "--methods", "losa", "--heads", "4"], "--heads"),
    ],
)
def test_trace_methods_refuse_flags_they_do_not_use(sparsa_bin, args, flag):
    r = run(sparsa_bin, *args)
    assert r.returncode == 2, r.stdout
    assert f"{flag}: not used when --methods names losa or reuse" in r.stderr


def test_bench_with_losa_times_each_prefix(sparsa_bin):
    r = run(sparsa_bin, "bench", "--methods", "dense,losa", "--lengths", "512,1024", "--repeats", "1")
    assert r.returncode == 0, r.stderr
    assert "prefix 512:" in r.stdout and "prefix 1024:" in r.stdout
    assert r.stdout.count("\nlosa ") == 2 and r.stdout.count("\ndense ") == 2
    r = run(sparsa_bin, "bench", "--methods", "losa", "--json", "x.json")
    assert r.returncode == 2 and "use `sparsa trace --json`" in r.stderr
