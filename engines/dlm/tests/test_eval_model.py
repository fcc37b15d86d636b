"""`sparsa ruler` and `sparsa eval-model` through the CLI (docs/eval.md):
- length calibration against an independent tokenizer (the `tokenizers` package counts the
  generated inputs again: the counts agree exactly, and the input plus the generation budget
  fits max_len with at most the stated slack);
- eval-model on a tiny random sdar model at a short length, a few samples, two methods: the
  table/JSON/SVG outputs, determinism, and every per-sample score recomputed here with an
  independent implementation of RULER's string_match_all / string_match_part;
- bad arguments are usage errors naming the flag;
- the shipped trained model (models/sparsa-sdar-ruler) finds the needle: a real accuracy number,
  through `eval-model` and through `sparsa demo`'s needle part."""
import json
import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import dlm_ref as R

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

QWEN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
SPECIALS = ["<|endoftext|>", "<|mask|>"]
# The slack under max_len is below one haystack unit (next_unit_tokens proves it exactly); in
# tokens that is at most 128 or 3% of the length: a QA document is the largest unit, ~70 tokens
# under this 400-token BPE that spells made-up names nearly letter by letter.
SLACK = lambda length: max(128, 3 * length // 100)  # noqa: E731


SHIPPED = Path(__file__).resolve().parents[3] / "models" / "sparsa-sdar-ruler"


def run(sparsa_bin, *args, check=True, timeout=300, cwd=None):
    p = subprocess.run([sparsa_bin, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if check and p.returncode != 0:
        raise AssertionError(f"sparsa {' '.join(map(str, args))} failed ({p.returncode}): {p.stderr}")
    return p


def generate(sparsa_bin, *args):
    return [json.loads(line) for line in run(sparsa_bin, "ruler", "generate", *args).stdout.splitlines()]


@pytest.fixture(scope="module")
def tokenizer_path(sparsa_bin, tmp_path_factory):
    """A byte-level BPE trained on the generator's own text (as train_sdar.py trains it)."""
    rows = generate(sparsa_bin, "--tasks", "all", "--lengths", "1K", "--samples", "2", "--seed", "99")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([r["input"] + r["target"] for r in rows], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tiny_model(tokenizer_path, tmp_path_factory):
    tok = Tokenizer.from_file(str(tokenizer_path))
    d = tmp_path_factory.mktemp("tiny_sdar")
    spec = R.Spec("sdar", dim=32, heads=2, kv_heads=1, head_dim=16, hidden=48, layers=2, block=16,
                  vocab=tok.get_vocab_size(), max_len=2048, mask_id=tok.token_to_id("<|mask|>"),
                  eos=tok.token_to_id("<|endoftext|>"))
    R.write_model(d, spec, seed=5)
    (d / "tokenizer.json").write_text(tokenizer_path.read_text())
    return d


def test_tasks_lists_every_family(sparsa_bin):
    tasks = json.loads(run(sparsa_bin, "ruler", "tasks", "--json").stdout)
    assert {t["family"] for t in tasks} == {"niah", "vt", "cwe", "fwe", "qa"}
    assert {t["metric"] for t in tasks} == {"string_match_all", "string_match_part"}
    assert "niah_single_1" in run(sparsa_bin, "ruler", "tasks").stdout


@pytest.mark.parametrize("length", [1024, 2048])
def test_lengths_are_calibrated_with_the_models_tokenizer(sparsa_bin, tokenizer_path, length):
    tok = Tokenizer.from_file(str(tokenizer_path))
    p = run(sparsa_bin, "ruler", "generate", "--tasks", "all", "--lengths", str(length), "--samples", "2", "--seed",
            "3", "--tokenizer", tokenizer_path, "--threads", "2", "--skip-unfit")
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    # this tiny tokenizer (400 tokens) spends many tokens per word: cwe's one-shot example and
    # its 10 x 6 common words need more than 1K there (skipped, and said so)
    skipped = {"cwe"} if length == 1024 else set()
    assert {r["task"] for r in rows} == {t["name"] for t in json.loads(run(sparsa_bin, "ruler", "tasks", "--json").stdout)} - skipped
    assert all(s + "@1K" in p.stderr for s in skipped)
    assert len(rows) == 2 * (12 - len(skipped))
    for r in rows:
        n = len(tok.encode(r["input"], add_special_tokens=False).ids)
        assert n == r["input_tokens"], r["task"]  # the engine's tokenizer counts as `tokenizers` does
        assert n + r["gen_tokens"] <= length, r["task"]
        assert r["next_unit_tokens"] + r["gen_tokens"] > length, r["task"]  # the largest haystack that fits
        assert n + r["gen_tokens"] >= length - SLACK(length), (r["task"], n, length)
        assert r["input"].endswith(r["answer_prefix"])


def test_generate_is_deterministic_and_writes_jsonl(sparsa_bin, tmp_path):
    out = tmp_path / "s.jsonl"
    run(sparsa_bin, "ruler", "generate", "--tasks", "niah,vt", "--lengths", "1K", "--samples", "3", "--seed", "4",
        "--out", out, "--threads", "2")
    again = generate(sparsa_bin, "--tasks", "niah,vt", "--lengths", "1K", "--samples", "3", "--seed", "4")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == again
    assert len(rows) == 8 * 3
    assert rows != generate(sparsa_bin, "--tasks", "niah,vt", "--lengths", "1K", "--samples", "3", "--seed", "5")


def ruler_post(s):
    return re.sub(r"[\x00-\x1f]", "\n", s.strip())


def ruler_score(pred, refs, metric):
    p = ruler_post(pred).lower()
    hits = [r.lower() in p for r in refs]
    return sum(hits) / len(refs) if metric == "string_match_all" else float(any(hits))


def test_eval_model_smoke(sparsa_bin, tiny_model, tmp_path):
    js, svg = tmp_path / "r.json", tmp_path / "r.svg"
    args = ["eval-model", "--model", tiny_model, "--tasks", "niah_single_1,qa_1", "--lengths", "512",
            "--samples", "2", "--seed", "1", "--attention", "dense,quest:budget=64", "--threads", "1"]
    p = run(sparsa_bin, *args, "--json", js, "--svg", svg)
    assert "niah_single_1" in p.stdout and "quest:budget=64" in p.stdout and "mean" in p.stdout
    assert "[sparsa eval-model]" in p.stderr  # progress
    report = json.loads(js.read_text())
    assert report["arch"] == "sdar" and report["loop"] == "block"
    cells = {(c["task"], c["length"], c["method"]): c for c in report["results"]}
    assert set(cells) == {(t, 512, m) for t in ("niah_single_1", "qa_1") for m in ("dense", "quest:budget=64")}
    samples = {(r["task"], r["index"]): r
               for r in generate(sparsa_bin, "--tasks", "niah_single_1,qa_1", "--lengths", "512", "--samples", "2",
                                 "--seed", "1", "--tokenizer", tiny_model / "tokenizer.json")}
    for (task, _, _), c in cells.items():
        assert len(c["per_sample"]) == 2
        for s in c["per_sample"]:
            ref = samples[(task, s["index"])]
            assert s["score"] == ruler_score(s["prediction"], ref["outputs"], ref["metric"])
            assert s["depth"] == ref["depth"] and s["input_tokens"] == ref["input_tokens"]
        assert c["accuracy"] == pytest.approx(100 * sum(s["score"] for s in c["per_sample"]) / 2)
        assert c["nulls"] == sum(ruler_post(s["prediction"]) == "" for s in c["per_sample"])
    root = ET.fromstring(svg.read_text())
    assert root.tag.endswith("svg") and len(root) == 2  # accuracy vs length, accuracy vs depth
    again = json.loads(run(sparsa_bin, *args, "--json", "--quiet").stdout)
    for a, b in zip(report["results"], again["results"]):
        assert [s["prediction"] for s in a["per_sample"]] == [s["prediction"] for s in b["per_sample"]]


def test_eval_model_layer_overrides_apply_under_every_method(sparsa_bin, tiny_model):
    """--attention-layers applies under each method: with both layers overridden to dense, a
    sparse prefill (BA-Att over the block-causal chunk, one key block a row) answers exactly as
    dense; with one layer left sparse it is applied (the prediction of some question moves)."""
    sparse = "ba_att:top_kappa=1,block=16,min_tokens=64,sort=false,block_causal=true"
    base = ["eval-model", "--model", tiny_model, "--tasks", "niah_single_1", "--lengths", "512", "--samples", "3",
            "--threads", "1", "--json", "--quiet", "--attention", f"dense;{sparse}"]
    report = json.loads(run(sparsa_bin, *base, "--attention-layers", "0,1=dense").stdout)
    assert report["attention_layers"] == ["0,1=dense"]
    dense, masked = ([s["prediction"] for s in c["per_sample"]] for c in report["results"])
    assert dense == masked
    report = json.loads(run(sparsa_bin, *base, "--attention-layers", "1=dense").stdout)
    dense_again, one_sparse = ([s["prediction"] for s in c["per_sample"]] for c in report["results"])
    assert dense_again == dense and one_sparse != dense
    p = run(sparsa_bin, *base, "--attention-layers", "2=dense", check=False)
    assert p.returncode == 2 and "--attention-layers: attention_layers: layer '2'" in p.stderr, p.stderr
    # METHOD|LAYERS=METHOD: that method's own overrides, after the common ones.
    own = ["eval-model", "--model", tiny_model, "--tasks", "niah_single_1", "--lengths", "512", "--samples", "3",
           "--threads", "1", "--json", "--quiet",
           "--attention", f"dense;{sparse}|0,1=dense;{sparse}|1=dense;{sparse}|0=dense|1=dense"]
    cells = json.loads(run(sparsa_bin, *own).stdout)["results"]
    assert [c["method"] for c in cells] == ["dense", f"{sparse}|0,1=dense", f"{sparse}|1=dense",
                                            f"{sparse}|0=dense|1=dense"]
    got = [[s["prediction"] for s in c["per_sample"]] for c in cells]
    assert got[1] == got[3] == dense and got[2] == one_sparse
    p = run(sparsa_bin, *own[:-1], f"{sparse}|5=dense", check=False)
    assert p.returncode == 2 and "layer '5'" in p.stderr, p.stderr


@pytest.mark.parametrize("flag,value,needle", [
    ("--lengths", "99999", "--lengths"),
    ("--lengths", "2M", "--lengths"),
    ("--attention", "dense,nosuch", "--attention nosuch"),
    ("--attention", "ba_att:density=7", "--attention ba_att:density=7"),
    ("--tasks", "nope", "--tasks"),
    ("--samples", "0", "--samples"),
    ("--svg", "/nonexistent-dir/x.svg", "--svg"),
    ("--backend", "tpu", "--backend tpu"),
    ("--backend", "cuda:x", "--backend cuda:x"),
    ("--backend", "cuda", "--backend cuda"),  # no cuda in this build, no device, or head_dim 16: each names it
])
def test_eval_model_bad_arguments(sparsa_bin, tiny_model, flag, value, needle):
    args = {"--lengths": "512", "--attention": "dense", "--tasks": "niah_single_1", "--samples": "1"}
    args[flag] = value
    flat = [x for kv in args.items() for x in kv]
    p = run(sparsa_bin, "eval-model", "--model", tiny_model, *flat, "--quiet", check=False)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr, p.stderr


def test_eval_model_on_the_cuda_backend(sparsa_bin, tokenizer_path, tmp_path):
    """--backend cuda (bf16): dense and BA-Att run on the device, the report says so, each
    score is RULER's on its prediction, and a second run gives the same predictions; QUEST runs
    there too (the device step); XAttention (cpu only in the engine) is a usage error naming its
    --attention item. Skipped where the
    cuda backend is absent (this CI); scripts/gpu-check --dlm runs it on the GPU machine."""
    tok = Tokenizer.from_file(str(tokenizer_path))
    d = tmp_path / "hd64"
    spec = R.Spec("sdar", dim=128, heads=2, kv_heads=1, head_dim=64, hidden=96, layers=2, block=16,
                  vocab=tok.get_vocab_size(), max_len=2048, mask_id=tok.token_to_id("<|mask|>"),
                  eos=tok.token_to_id("<|endoftext|>"))
    R.write_model(d, spec, seed=5)
    (d / "tokenizer.json").write_text(tokenizer_path.read_text())
    args = ["eval-model", "--model", d, "--tasks", "niah_single_1", "--lengths", "512", "--samples", "2",
            "--seed", "0", "--quiet", "--json", "--backend", "cuda"]
    p = run(sparsa_bin, *args, "--attention", "dense;ba_att:density=0.5,min_tokens=0", check=False)
    if p.returncode != 0 and ("not compiled" in p.stderr or "no CUDA device" in p.stderr
                              or "has no cuda backend" in p.stderr):
        pytest.skip(f"no CUDA backend here: {p.stderr.strip()}")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["backend"] == "cuda"
    assert [c["method"] for c in report["results"]] == ["dense", "ba_att:density=0.5,min_tokens=0"]
    refs = {r["index"]: r for r in generate(sparsa_bin, "--tasks", "niah_single_1", "--lengths", "512",
                                             "--samples", "2", "--seed", "0", "--tokenizer", d / "tokenizer.json")}
    for c in report["results"]:
        assert len(c["per_sample"]) == 2
        for s in c["per_sample"]:
            ref = refs[s["index"]]
            assert s["score"] == ruler_score(s["prediction"], ref["outputs"], ref["metric"])
    again = json.loads(run(sparsa_bin, *args, "--attention", "dense;ba_att:density=0.5,min_tokens=0").stdout)
    assert [s["prediction"] for c in again["results"] for s in c["per_sample"]] == \
        [s["prediction"] for c in report["results"] for s in c["per_sample"]]
    q = json.loads(run(sparsa_bin, *args, "--attention", "quest:budget=64").stdout)
    assert [c["method"] for c in q["results"]] == ["quest:budget=64"]
    x = run(sparsa_bin, *args, "--attention", "xattention:density=0.5,min_tokens=0", check=False)
    assert x.returncode == 2 and "--attention xattention:density=0.5,min_tokens=0" in x.stderr, x.stderr


def test_eval_model_missing_model_is_a_runtime_error(sparsa_bin, tmp_path):
    p = run(sparsa_bin, "eval-model", "--model", tmp_path / "none", "--quiet", check=False)
    assert p.returncode == 1 and "sparsa: error:" in p.stderr


def test_generate_bad_arguments(sparsa_bin, tmp_path):
    for args, needle in [(["--tasks", "x"], "--tasks"), (["--lengths", "0"], "--lengths"),
                         (["--out", tmp_path / "x.txt"], "--out"), (["--threads", "0"], "--threads")]:
        p = run(sparsa_bin, "ruler", "generate", *args, check=False)
        assert p.returncode == 2 and needle in p.stderr, p.stderr
    p = run(sparsa_bin, "ruler", "generate", "--tasks", "vt", "--lengths", "128", check=False)
    assert p.returncode == 1 and "max_len 128" in p.stderr, p.stderr


def table_rows(stdout, first_header):
    """The rows of the text table whose header starts with first_header: {first cell: cells}."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [first_header])
    header = lines[start].split()
    rows = {}
    for line in lines[start + 2:]:
        cells = line.split()
        if not cells:
            break
        rows[cells[0]] = cells
    return header, rows


def test_the_shipped_model_finds_the_needle(sparsa_bin):
    """The shipped model at 1K on niah_single_1, 4 questions, dense: each answer is a random
    7-digit number in a noise haystack, so a model that does not retrieve, a broken loader,
    tokenizer or generation loop scores 0. Measured on it: 8/8 at 1K, 20/20 at 4K and at 8K
    (docs/eval.md); 3 of 4 is the bar, not 4 of 4, so that a rounding change in the CPU kernels
    that flips one digit of one answer is not a failure of the model."""
    p = run(sparsa_bin, "eval-model", "--model", SHIPPED, "--tasks", "niah_single_1", "--lengths", "1K",
            "--samples", "4", "--seed", "3", "--threads", "2", "--json", "--quiet")
    report = json.loads(p.stdout)
    (cell,) = report["results"]
    assert cell["method"] == "dense" and len(cell["per_sample"]) == 4
    assert cell["accuracy"] >= 75, [s["prediction"] for s in cell["per_sample"]]


def test_demo_asks_the_shipped_model_a_needle_question(sparsa_bin, tmp_path):
    """`sparsa demo`'s needle part: dense, QUEST, LoSA and (cpu) BA-Att prefill columns, accuracy
    and seconds per question; skipped with a note where the default model directory is absent
    (not in the working directory); its flags are checked."""
    args = ["demo", "--length", "128", "--methods", "dense", "--no-trace", "--plot", ""]
    p = run(sparsa_bin, *args, "--model", SHIPPED, "--model-length", "1024", "--model-samples", "2", "--threads", "2")
    assert "needle in a haystack on a real model" in p.stdout
    header, rows = table_rows(p.stdout, "task")
    assert header == ["task", "length", "dense", "quest:budget=128", "losa:budget=128,k=4",
                      "ba_att:density=0.1,sort=false,block_causal=true|0=dense"]
    assert float(rows["niah_single_1"][2]) >= 50  # dense, 2 questions
    assert len(rows["s/sample"]) == 5 and all(float(x) > 0 for x in rows["s/sample"][1:])
    p = run(sparsa_bin, *args, cwd=tmp_path)
    assert "no model at models/sparsa-sdar-ruler" in p.stdout
    for flag, value in (("--model-length", "0"), ("--model-samples", "0"), ("--model-length", "99999")):
        bad = run(sparsa_bin, *args, "--model", SHIPPED, flag, value, check=False)
        assert bad.returncode == 2 and flag in bad.stderr, bad.stderr  # 99999: past the model's 16384
    bad = run(sparsa_bin, *args, "--model", tmp_path / "nowhere", check=False)
    assert bad.returncode != 0 and "nowhere" in bad.stderr, bad.stderr


def test_eval_model_chat_wraps_the_question_in_the_template(sparsa_bin, tmp_path):
    """--chat (instruct models): each sample's question as the user's message in the model's chat
    template, its answer prefix after the opened assistant turn. The prompt eval-model runs is
    checked by its token count against the same text built here from `ruler generate`'s sample;
    a model without a template is told so."""
    if not SHIPPED.is_dir():
        pytest.skip("the shipped model is not in this checkout")
    model = tmp_path / "chat_model"
    model.mkdir()
    for f in SHIPPED.iterdir():
        (model / f.name).symlink_to(f)
    args = ["--tasks", "niah_single_1", "--lengths", "1K", "--samples", "2", "--seed", "4"]
    bad = run(sparsa_bin, "eval-model", "--model", model, *args, "--chat", "--quiet", check=False)
    assert bad.returncode == 1 and "--chat" in bad.stderr and "no chat template" in bad.stderr, bad.stderr
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", encoding="utf-8")
    report = json.loads(run(sparsa_bin, "eval-model", "--model", model, *args, "--chat", "--json", "--quiet",
                            "--threads", "2").stdout)
    samples = generate(sparsa_bin, *args, "--tokenizer", model / "tokenizer.json")
    (cell,) = report["results"]
    for s, got in zip(samples, cell["per_sample"]):
        assert s["input"].endswith(s["answer_prefix"]) and s["answer_prefix"]
        question = s["input"][: len(s["input"]) - len(s["answer_prefix"])]
        text = "<user>" + question.strip() + "</user>\n<assistant>" + s["answer_prefix"]
        ids = run(sparsa_bin, "tokenize", "--tokenizer", model / "tokenizer.json", "--text", text,
                  "--json").stdout
        assert got["input_tokens"] == len(json.loads(ids)["ids"]) > s["input_tokens"]


@pytest.mark.parametrize("arch, loop", [("dream", "dream"), ("fast_dllm", "fast_dllm")])
def test_eval_model_on_dream_and_fast_dllm_models(sparsa_bin, tokenizer_path, tmp_path, arch, loop):
    """A dream model answers with Dream's loop (its schedule, entropy confidence), a Fast-dLLM v2
    model with its own (sub-blocks over prompts of many whole blocks); the prompt lengths are the
    generator's."""
    tok = Tokenizer.from_file(str(tokenizer_path))
    d = tmp_path / f"tiny_{arch}"
    spec = R.Spec(arch, dim=32, heads=2, kv_heads=1, hidden=48, layers=2, vocab=tok.get_vocab_size(), max_len=2048,
                  block=16, mask_id=tok.token_to_id("<|mask|>"), eos=tok.token_to_id("<|endoftext|>"))
    R.write_model(d, spec, seed=6 if arch == "dream" else 7)
    (d / "tokenizer.json").write_text(tokenizer_path.read_text())
    report = json.loads(run(sparsa_bin, "eval-model", "--model", d, "--tasks", "niah_single_1", "--lengths", "512",
                            "--samples", "2", "--seed", "2", "--threads", "1", "--json", "--quiet").stdout)
    assert report["arch"] == arch and report["loop"] == loop
    (cell,) = report["results"]
    samples = generate(sparsa_bin, "--tasks", "niah_single_1", "--lengths", "512", "--samples", "2", "--seed", "2",
                       "--tokenizer", d / "tokenizer.json")
    assert [s["input_tokens"] for s in cell["per_sample"]] == [s["input_tokens"] for s in samples]
