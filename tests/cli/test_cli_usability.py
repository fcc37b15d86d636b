# What a new user of the CLI relies on: `info` lists every method the README names and says
# why a backend cannot run; --layout reads FlashAttention's [batch, seq, heads, dim] files;
# `plan --index` writes the file `run --index` reads; the mask SVG says which order its axes
# are in; help text has no stray defaults.
import json
import subprocess

import numpy as np


def run_cli(sparsa_bin, *args, timeout=600):
    return subprocess.run([sparsa_bin, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def write_qkv(tmp_path, layout, seed=0, b=1, hq=4, hkv=2, n=200, d=32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, n, d), dtype=np.float32)
    k = rng.standard_normal((b, hkv, n, d), dtype=np.float32)
    v = rng.standard_normal((b, hkv, n, d), dtype=np.float32)
    paths = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        path = tmp_path / f"{name}_{layout}.npy"
        np.save(path, np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if layout == "bshd" else x)
        paths.append(path)
    return (q, k, v), paths


def test_info_lists_the_decode_methods(sparsa_bin):
    r = run_cli(sparsa_bin, "info")
    assert r.returncode == 0, r.stderr
    assert "decode methods" in r.stdout
    assert any(line.split()[:1] == ["losa"] for line in r.stdout.splitlines())
    j = json.loads(run_cli(sparsa_bin, "info", "--json").stdout)
    assert [m["name"] for m in j["trace_methods"]] == ["losa", "reuse"]


def test_info_says_why_cuda_cannot_run(sparsa_bin):
    j = json.loads(run_cli(sparsa_bin, "info", "--json").stdout)
    cuda = next(b for b in j["backends"] if b["name"] == "cuda")
    if cuda["available"]:
        assert cuda["reason"] == ""
    elif cuda["compiled_in"]:
        assert "compiled into this build, but no CUDA device is visible" in cuda["reason"]
    else:
        assert "not compiled into this build" in cuda["reason"]
    text = run_cli(sparsa_bin, "info").stdout
    cuda_line = next(line for line in text.splitlines() if line.strip().startswith("cuda"))
    assert ("not available: " in cuda_line) != cuda["available"]


def test_run_on_a_cuda_backend_that_cannot_run_names_the_reason(sparsa_bin, tmp_path):
    j = json.loads(run_cli(sparsa_bin, "info", "--json").stdout)
    cuda = next(b for b in j["backends"] if b["name"] == "cuda")
    if cuda["available"]:
        return  # a GPU machine: the message under test is not produced there
    _, (q, k, v) = write_qkv(tmp_path, "bhsd")
    r = run_cli(sparsa_bin, "run", "--method", "dense", "--backend", "cuda", "--q", q, "--k", k, "--v", v,
                "--out", tmp_path / "o.npy")
    assert r.returncode != 0
    assert cuda["reason"] in r.stderr


def test_layout_bshd_reads_and_writes_the_other_order(sparsa_bin, tmp_path):
    _, (q, k, v) = write_qkv(tmp_path, "bhsd")
    _, (qs, ks, vs) = write_qkv(tmp_path, "bshd")
    for method in ("dense", "ba_att"):
        base = run_cli(sparsa_bin, "run", "--method", method, "--q", q, "--k", k, "--v", v,
                       "--out", tmp_path / "o.npy", "--lse", tmp_path / "l.npy")
        assert base.returncode == 0, base.stderr
        other = run_cli(sparsa_bin, "run", "--method", method, "--layout", "bshd", "--q", qs, "--k", ks, "--v", vs,
                        "--out", tmp_path / "os.npy", "--lse", tmp_path / "ls.npy")
        assert other.returncode == 0, other.stderr
        o, o_s = np.load(tmp_path / "o.npy"), np.load(tmp_path / "os.npy")
        assert o_s.shape == (1, 200, 4, 32)
        np.testing.assert_allclose(o_s.transpose(0, 2, 1, 3), o, rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.load(tmp_path / "ls.npy"), np.load(tmp_path / "l.npy"), rtol=0, atol=1e-6)
    # Without the flag the bshd files read as 200 heads of 4 tokens: another computation (the
    # silent misreading --layout exists for).
    wrong = run_cli(sparsa_bin, "run", "--method", "dense", "--q", qs, "--k", ks, "--v", vs, "--out", tmp_path / "x.npy")
    assert wrong.returncode == 0, wrong.stderr
    base = run_cli(sparsa_bin, "run", "--method", "dense", "--q", q, "--k", k, "--v", v, "--out", tmp_path / "o.npy")
    assert not np.allclose(np.load(tmp_path / "x.npy").transpose(0, 2, 1, 3), np.load(tmp_path / "o.npy"), atol=1e-3)


def test_layout_rejects_an_unknown_order(sparsa_bin, tmp_path):
    _, (q, k, v) = write_qkv(tmp_path, "bhsd")
    r = run_cli(sparsa_bin, "run", "--method", "dense", "--layout", "bsdh", "--q", q, "--k", k, "--v", v,
                "--out", tmp_path / "o.npy")
    assert r.returncode == 2
    assert "--layout: expected bhsd" in r.stderr and "'bsdh'" in r.stderr


def test_plan_index_round_trips_through_run(sparsa_bin, tmp_path):
    _, (q, k, v) = write_qkv(tmp_path, "bhsd", n=300)
    for method, params in (("ba_att", ["-P", "density=0.3", "-P", "block=32"]),
                           ("xattention", ["-P", "density=0.3", "-P", "block=32"])):
        plan = run_cli(sparsa_bin, "plan", "--method", method, *params, "--q", q, "--k", k,
                       "--index", tmp_path / f"{method}.safetensors")
        assert plan.returncode == 0, plan.stderr
        replay = run_cli(sparsa_bin, "run", "--method", "block_sparse", "--index", tmp_path / f"{method}.safetensors",
                         "--q", q, "--k", k, "--v", v, "--out", tmp_path / "replay.npy")
        assert replay.returncode == 0, replay.stderr
        direct = run_cli(sparsa_bin, "run", "--method", method, *params, "--q", q, "--k", k, "--v", v,
                         "--out", tmp_path / "direct.npy")
        assert direct.returncode == 0, direct.stderr
        np.testing.assert_array_equal(np.load(tmp_path / "replay.npy"), np.load(tmp_path / "direct.npy"))


def test_plan_index_refuses_another_extension(sparsa_bin, tmp_path):
    r = run_cli(sparsa_bin, "plan", "--method", "ba_att", "--length", 256, "--index", tmp_path / "plan.json")
    assert r.returncode == 2
    assert "--index" in r.stderr


def test_mask_svg_names_the_order_of_its_axes(sparsa_bin, tmp_path):
    r = run_cli(sparsa_bin, "plan", "--method", "ba_att", "--length", 512, "--svg", tmp_path / "ba.svg")
    assert r.returncode == 0, r.stderr
    sorted_svg = (tmp_path / "ba.svg").read_text()
    assert "key blocks (8, norm-sorted order)" in sorted_svg and "query blocks (8, norm-sorted order)" in sorted_svg
    r = run_cli(sparsa_bin, "plan", "--method", "xattention", "--length", 512, "--svg", tmp_path / "xa.svg")
    assert r.returncode == 0, r.stderr
    plain = (tmp_path / "xa.svg").read_text()
    assert "key blocks (8, token order)" in plain and "norm-sorted" not in plain


def test_help_shows_no_flag_defaults_in_braces(sparsa_bin):
    r = run_cli(sparsa_bin, "demo", "--help")
    assert r.returncode == 0
    assert "--no-trace" in r.stdout and "{false}" not in r.stdout


def morton_order(height, width):
    """perm[p] = row-major index of the p-th cell in Z-order (col bits even, row bits odd)."""
    def code(r, c):
        x = 0
        for bit in range(16):
            x |= ((c >> bit) & 1) << (2 * bit) | ((r >> bit) & 1) << (2 * bit + 1)
        return x
    cells = sorted(range(height * width), key=lambda i: code(i // width, i % width))
    return np.array(cells, dtype=np.int64)


def test_llsa_image_layout_runs_in_z_order_and_answers_in_row_major(sparsa_bin, tmp_path):
    (q, k, v), (qp, kp, vp) = write_qkv(tmp_path, "bhsd", n=256)
    perm = morton_order(16, 16)
    for name, x in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{name}_z.npy", np.ascontiguousarray(x[:, :, perm]))
    by_hand = run_cli(sparsa_bin, "run", "--method", "llsa", "--q", tmp_path / "q_z.npy", "--k", tmp_path / "k_z.npy",
                      "--v", tmp_path / "v_z.npy", "--out", tmp_path / "o_z.npy", "--lse", tmp_path / "l_z.npy")
    assert by_hand.returncode == 0, by_hand.stderr
    flag = run_cli(sparsa_bin, "run", "--method", "llsa", "-P", "layout=z_order", "-P", "height=16", "-P", "width=16",
                   "--q", qp, "--k", kp, "--v", vp, "--out", tmp_path / "o.npy", "--lse", tmp_path / "l.npy")
    assert flag.returncode == 0, flag.stderr
    inverse = np.argsort(perm)
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), np.load(tmp_path / "o_z.npy")[:, :, inverse])
    np.testing.assert_array_equal(np.load(tmp_path / "l.npy"), np.load(tmp_path / "l_z.npy")[:, :, inverse])
    hilbert = run_cli(sparsa_bin, "run", "--method", "llsa", "-P", "layout=hilbert", "-P", "height=16", "-P", "width=16",
                      "--q", qp, "--k", kp, "--v", vp, "--out", tmp_path / "oh.npy")
    assert hilbert.returncode == 0, hilbert.stderr
    plan = run_cli(sparsa_bin, "plan", "--method", "llsa", "-P", "layout=hilbert", "-P", "height=16", "-P", "width=16",
                   "--q", qp, "--k", kp)
    assert plan.returncode == 0, plan.stderr


def test_llsa_image_layout_checks_its_sides(sparsa_bin, tmp_path):
    _, (q, k, v) = write_qkv(tmp_path, "bhsd", n=256)
    for params, needle in ((["-P", "layout=z_order"], "needs -P height=H -P width=W"),
                           (["-P", "layout=z_order", "-P", "height=8", "-P", "width=16"], "height x width"),
                           (["-P", "layout=peano", "-P", "height=16", "-P", "width=16"], "layout: expected row_major")):
        r = run_cli(sparsa_bin, "run", "--method", "llsa", *params, "--q", q, "--k", k, "--v", v,
                    "--out", tmp_path / "o.npy")
        assert r.returncode == 2, (params, r.stderr)
        assert needle in r.stderr, (params, r.stderr)


def test_demo_takes_plain_param_keys_for_every_method_that_has_them(sparsa_bin):
    r = run_cli(sparsa_bin, "demo", "--length", 512, "--methods", "ba_att,xattention,llsa", "--no-trace", "--plot", "",
                "--json", "-P", "density=0.25", "-P", "llsa.topk=4")
    assert r.returncode == 0, r.stderr
    params = {row["method"]: row["params"] for row in json.loads(r.stdout)["results"]}
    assert params["ba_att"]["density"] == 0.25 and params["xattention"]["density"] == 0.25
    assert "density" not in params["llsa"] and params["llsa"]["topk"] == 4
    r = run_cli(sparsa_bin, "demo", "--length", 512, "--methods", "llsa", "--no-trace", "--plot", "", "-P", "density=0.2")
    assert r.returncode == 2
    assert "-P: no method run takes 'density'" in r.stderr


def test_trace_and_demo_plot_the_decode_section(sparsa_bin, tmp_path):
    r = run_cli(sparsa_bin, "trace", "--prefix", 512, "--heads", 4, "--kv-heads", 2, "--head-dim", 32,
                "--plot", tmp_path / "trace.svg")
    assert r.returncode == 0, r.stderr
    svg = (tmp_path / "trace.svg").read_text()
    for needle in ("CPU ms per step", "% of prefix pages loaded", "error vs dense", "dense", "quest", "losa"):
        assert needle in svg
    r = run_cli(sparsa_bin, "trace", "--prefix", 512, "--plot", tmp_path / "trace.png")
    assert r.returncode == 2 and "--plot" in r.stderr
    r = run_cli(sparsa_bin, "demo", "--length", 256, "--methods", "ba_att", "--plot", tmp_path / "demo.svg")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "demo.svg").exists() and (tmp_path / "demo-decode.svg").exists()


def test_json_means_the_same_in_every_command(sparsa_bin, tmp_path):
    # Bare --json: JSON on stdout instead of the table; --json FILE: JSON there, the table printed.
    commands = {
        "demo": ["demo", "--length", 256, "--methods", "ba_att", "--no-trace", "--plot", ""],
        "eval": ["eval", "--length", 256, "--methods", "ba_att", "--densities", 0.5],
        "trace": ["trace", "--prefix", 256, "--heads", 4, "--kv-heads", 2, "--head-dim", 32],
        "bench": ["bench", "--methods", "dense", "--lengths", 128, "--repeats", 1, "--warmup", 0],
        "plan": ["plan", "--method", "ba_att", "--length", 256],
    }
    for name, args in commands.items():
        bare = run_cli(sparsa_bin, *args, "--json")
        assert bare.returncode == 0, (name, bare.stderr)
        json.loads(bare.stdout if name != "plan" else bare.stdout[bare.stdout.index("{"):])
        path = tmp_path / f"{name}.json"
        to_file = run_cli(sparsa_bin, *args, "--json", path)
        assert to_file.returncode == 0, (name, to_file.stderr)
        json.loads(path.read_text())
        assert "{" not in to_file.stdout.split("\n")[0], name  # the usual output, not JSON
        bad = run_cli(sparsa_bin, *args, "--json", tmp_path / f"{name}.txt")
        assert bad.returncode == 2 and "--json" in bad.stderr, (name, bad.stderr)
