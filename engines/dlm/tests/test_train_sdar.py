"""The training script (engines/dlm/train) on the CPU, with a tiny configuration:
- a few steps of block-diffusion training on the generator's tasks lower the loss, and a run
  resumes from its checkpoint;
- the two-stream training sequence gives a noisy block exactly the logits the engine's block
  loop computes for it (the clean prefix, block-causal, then the block itself);
- the exported Hugging Face directory loads in the engine, and `sparsa logits` matches the
  PyTorch model's logits (f32 and bf16 exports, one file and sharded): this is the
  engine-vs-independent-reference test of the trained model's architecture.

Tolerance of the logits (LOGIT_TOL, relative to the largest |logit|, as in test_dlm.py): the
reference is the PyTorch model in float64 on the very weights the engine reads (bf16 exports:
the weights rounded to bf16 first), the engine computes in f32; dot products of length <= 128
round at ~sqrt(K)·2^-24 ≈ 1e-6, amplified ~10-30x by two layers of norms and softmax: 5e-5
holds with margin, while the negative control (a bidirectional canvas instead of the
block-causal one) moves the logits by far more."""
import json
import math
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
import sdar_torch as S  # noqa: E402
import train_sdar as T  # noqa: E402

LOGIT_TOL = 5e-5
STEPS = 30
TASKS = "niah_single_1,niah_multikey_2,qa_1"  # tasks that fit 512 tokens


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def make_run(sparsa_bin, tmp_path_factory, arch):
    run = str(tmp_path_factory.mktemp("run_" + arch))
    T.main(["tokenizer", "--run", run, "--sparsa", sparsa_bin, "--vocab", "400", "--numbers", "digits", "--samples", "2", "--dim", "64",
            "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--hidden", "128",
            "--block", "16", "--max-len", "1024", "--arch", arch])
    return run


@pytest.fixture(scope="module")
def run_dir(sparsa_bin, tmp_path_factory):
    return make_run(sparsa_bin, tmp_path_factory, "sdar")


def train(run, sparsa_bin, steps):
    T.main(["train", "--run", run, "--stage", "1", "--lengths", "512", "--tasks", TASKS, "--steps", str(steps),
            "--batch-tokens", "4096", "--device", "cpu", "--attention", "sdpa", "--val-samples", "2",
            "--gen-threads", "1", "--chunk", "4", "--lr", "3e-3", "--warmup", "5", "--sparsa", sparsa_bin, "--log-seconds", "0",
            "--compile", "0"])


@pytest.fixture(scope="module")
def trained(run_dir, sparsa_bin):
    torch.manual_seed(0)
    train(run_dir, sparsa_bin, STEPS)
    return run_dir


@pytest.fixture(scope="module")
def trained_llada(sparsa_bin, tmp_path_factory):
    run = make_run(sparsa_bin, tmp_path_factory, "llada")
    torch.manual_seed(0)
    train(run, sparsa_bin, STEPS)
    return run


def lowers_the_loss(run):
    with open(os.path.join(run, "log.jsonl")) as f:
        first = json.loads(f.readline())
    losses, ces = first["losses"], first["ces"]
    assert len(losses) == STEPS and all(np.isfinite(losses))
    head, tail = np.mean(ces[:6]), np.mean(ces[-6:])
    # The cross-entropy per masked token starts near ln(400) = 6 and the answers' unigram (digits,
    # EOS) alone takes it below 85% of that within these steps (seen: 5.8 -> 4.4); a broken loss,
    # mask or optimizer step stays near the start (the objective itself, 1/t-weighted, is too
    # noisy for 30 steps).
    assert tail < 0.85 * head, (head, tail)
    assert first["val_loss"] is not None and np.isfinite(first["val_loss"])


def test_bidirectional_variant_trains_too(trained_llada):
    lowers_the_loss(trained_llada)


def test_training_lowers_the_loss_and_resumes(trained, sparsa_bin, capsys):
    lowers_the_loss(trained)
    capsys.readouterr()
    train(trained, sparsa_bin, 3)
    assert "resumed" in capsys.readouterr().out
    ck = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)  # data only, as the trainer reads it
    assert ck["state"]["step"] == STEPS + 3 and len(ck["state"]["stages"]) == 2


def load_model(run):
    c = T.load_run(run)
    m = S.Sdar(c)
    m.load_state_dict(torch.load(os.path.join(run, "ckpt.pt"), weights_only=False)["model"])
    return m.eval()


def test_noisy_blocks_see_what_the_engine_loop_sees(trained):
    """The logits of each noisy copy in the training sequence equal the block-causal canvas
    logits of (clean prefix + that noisy block), the engine's view when it denoises the block."""
    model = load_model(trained).double()
    c = model.c
    gen = torch.Generator().manual_seed(3)
    prompt = list(torch.randint(2, c.vocab_size, (37,), generator=gen).tolist())
    target = list(torch.randint(2, c.vocab_size, (20,), generator=gen).tolist()) + [c.eos_id]
    batch, _ = T.build_batch([(256, prompt, target, 128)], c, 2, gen)
    with torch.no_grad():
        logits = model(batch["ids"], batch["pos"], S.sdpa_attention(T.dense_mask(batch["blk"], batch["copy"])))[0]
    ids, blk, copy = batch["ids"][0].tolist(), batch["blk"][0].tolist(), batch["copy"][0].tolist()
    x0 = [i for i, cp in zip(ids, copy) if cp < 0]
    B = c.block_size
    copies = sorted({cp for cp in copy if cp >= 0})
    assert len(copies) >= 3  # the answer's blocks (2 here) and prompt blocks
    for cp in copies:
        at = [i for i, x in enumerate(copy) if x == cp]
        b = blk[at[0]]
        canvas = x0[: b * B] + [ids[i] for i in at]
        with torch.no_grad():
            want = model.canvas_logits(canvas)[b * B:]
        assert torch.allclose(logits[at], want, rtol=0, atol=1e-9), cp
    # and the clean stream is the canvas itself
    with torch.no_grad():
        assert torch.allclose(logits[: len(x0)], model.canvas_logits(x0), atol=1e-9)


def test_flex_attention_matches_sdpa(trained):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    model = load_model(trained)
    gen = torch.Generator().manual_seed(4)
    items = [(256, list(range(5, 60)), [7, 8, 9, 0], 128), (256, list(range(9, 40)), [3, 0], 128)]
    batch, total = T.build_batch(items, model.c, 2, gen, 256)
    with torch.no_grad():
        a = float(T.loss_of(model, batch, total, "sdpa")[0])
        try:
            b = float(T.loss_of(model, batch, total, "flex")[0])
        except Exception as e:  # eager FlexAttention is not available on every CPU build
            pytest.skip(f"FlexAttention on the CPU: {e}")
    assert abs(a - b) <= 1e-4 * abs(a), (a, b)
    del flex


def engine_logits(sparsa_bin, model_dir, ids, tmp_path):
    out = tmp_path / "logits.npy"
    p = subprocess.run([sparsa_bin, "logits", "--model", str(model_dir), "--ids", ",".join(map(str, ids)),
                        "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return np.load(out)


@pytest.mark.parametrize("arch,dtype,shard_bytes", [("sdar", "f32", 16 << 20), ("sdar", "bf16", 16 << 20),
                                                    ("sdar", "f32", 120_000), ("llada", "f32", 16 << 20),
                                                    ("llada", "bf16", 120_000)])
def test_export_loads_in_the_engine_and_logits_match(request, sparsa_bin, tmp_path, arch, dtype, shard_bytes):
    trained = request.getfixturevalue("trained" if arch == "sdar" else "trained_llada")
    model = load_model(trained)
    out = tmp_path / "model"
    total, shards = S.export_hf(model, str(out), dtype, shard_bytes, os.path.join(trained, "tokenizer.json"))
    if shard_bytes < total:
        assert shards > 1 and (out / "model.safetensors.index.json").exists()
        assert all(os.path.getsize(out / f) <= shard_bytes + 8192 for f in os.listdir(out)
                   if f.endswith(".safetensors"))  # + the JSON header
    else:
        assert shards == 1 and (out / "model.safetensors").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch
    assert (cfg["block_size"] == 16 and cfg["tie_word_embeddings"]) if arch == "sdar" else cfg["weight_tying"]
    info = json.loads(subprocess.run([sparsa_bin, "model", "info", str(out), "--json"], capture_output=True,
                                     text=True, check=True).stdout)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    ref = load_model(trained).double()
    if dtype == "bf16":
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float64))
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.c.vocab_size, (45,), generator=gen).tolist()  # 2 blocks and a partial one
    ids[20] = ids[33] = model.c.mask_id
    got = engine_logits(sparsa_bin, out, ids, tmp_path)
    with torch.no_grad():
        want = ref.canvas_logits(ids).numpy()
        assert rel_err(got, want) < LOGIT_TOL
        # negative control: the other attention pattern (bidirectional for sdar, causal for llada)
        n = len(ids)
        tok = torch.arange(n)
        other = torch.ones(1, n, n, dtype=torch.bool) if arch == "sdar" else (tok[None, :] <= tok[:, None])[None]
        wrong = ref(torch.tensor(ids)[None], torch.arange(n)[None], S.sdpa_attention(other))[0].numpy()
    assert rel_err(got, wrong) > 100 * LOGIT_TOL


def test_export_command_writes_the_training_record(trained, tmp_path):
    out = tmp_path / "exported"
    T.main(["export", "--run", trained, "--out", str(out), "--dtype", "bf16"])
    rec = json.loads((out / "training.json").read_text())
    assert rec["steps"] >= STEPS and rec["history"]
    assert (out / "tokenizer.json").exists()


def test_norm_gains_are_not_decayed():
    c = S.SdarConfig(vocab_size=50, dim=32, layers=2, heads=2, kv_heads=1, head_dim=16, hidden=48, block_size=16,
                     max_len=256, rope_theta=1e4, mask_id=1, eos_id=0)
    model = S.Sdar(c)
    decay, rest = T.param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in rest["params"]} == {n for n, _ in model.named_parameters() if "norm" in n}
    assert len(decay["params"]) + len(rest["params"]) == len(list(model.parameters()))
    assert any("q_norm" in names[id(p)] for p in rest["params"])


def test_qk_norm_gains_start_where_sharp_attention_is_reachable():
    """The largest logit QK-norm allows, g_q·g_k·sqrt(d), starts at 2·ln(max_len)."""
    import math
    for hd, n in ((64, 16384), (32, 2048), (128, 8192)):
        c = S.SdarConfig(vocab_size=50, dim=64, layers=1, heads=2, kv_heads=1, head_dim=hd, hidden=32, max_len=n)
        layer = S.Sdar(c).layers[0]
        g = layer.q_norm.weight
        assert torch.all(g == layer.k_norm.weight) and torch.all(g == g[0])
        assert abs(float(g[0]) ** 2 * math.sqrt(hd) - 2 * math.log(n)) < 1e-5
        assert layer.input_layernorm.weight.eq(1).all()  # the other norms start at 1
    llada = S.Sdar(S.SdarConfig(vocab_size=50, dim=64, layers=1, heads=2, kv_heads=1, head_dim=32, hidden=32,
                                arch="llada"))
    assert not hasattr(llada.layers[0], "q_norm")


def test_export_refuses_a_directory_that_is_not_an_export(trained, tmp_path):
    """--out replaces an earlier export whole (written beside it, then renamed), and never a
    directory of something else."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not an earlier export"):
        T.main(["export", "--run", trained, "--out", str(out)])
    assert (out / "notes.txt").read_text() == "keep me"
    again = tmp_path / "again"
    T.main(["export", "--run", trained, "--out", str(again)])
    T.main(["export", "--run", trained, "--out", str(again)])  # an earlier export is replaced
    assert sorted(os.listdir(tmp_path)) == ["again", "mine"]  # no .tmp left behind


def test_padding_rows_carry_no_loss(trained):
    """pad_rows gives every batch of a length bucket the same shape (one compile per bucket);
    the rows it adds change neither the loss nor the real rows' logits."""
    model = load_model(trained).double()
    gen = torch.Generator().manual_seed(8)
    items = [(256, list(range(5, 60)), [7, 8, 9, 0], 128), (256, list(range(9, 40)), [3, 0], 128)]
    batch, total = T.build_batch(items, model.c, 2, gen, 256)
    padded = T.pad_rows(batch, 5)
    assert all(v.shape == (5, 256) for v in padded.values())
    assert T.pad_rows(batch, 2) is batch
    with torch.no_grad():
        a = float(T.loss_of(model, batch, total, "sdpa")[0])
        b = float(T.loss_of(model, padded, total, "sdpa")[0])
        la = model(batch["ids"], batch["pos"], S.sdpa_attention(T.dense_mask(batch["blk"], batch["copy"])))
        lb = model(padded["ids"], padded["pos"], S.sdpa_attention(T.dense_mask(padded["blk"], padded["copy"])))
    assert abs(a - b) <= 1e-12 * abs(a), (a, b)
    assert torch.equal(la, lb[:2])
    assert (padded["labels"][2:] == -100).all() and (padded["weights"][2:] == 0).all()


@pytest.mark.parametrize("args,message", [
    ([], "--stage N or --plan"),
    (["--stage", "1", "--plan", "1:3"], "--stage N or --plan"),
    (["--plan", "1:0"], "STAGE:MINUTES"),
    (["--plan", "9:1"], "STAGE:MINUTES"),
    (["--plan", "1:3,x"], "got 'x'"),
    (["--plan", "1:3", "--lr", "1e-3"], "go with --stage"),
    (["--stage", "0", "--steps", "1", "--copy-frac", "0.6", "--kv-frac", "0.5"], "together at most 1"),
])
def test_bad_plans_are_usage_errors(run_dir, sparsa_bin, args, message):
    with pytest.raises(SystemExit, match=message):
        T.main(["train", "--run", run_dir, "--sparsa", sparsa_bin, "--device", "cpu"] + args)


def test_stage_zero_trains_retrieval_on_the_answers_only(run_dir, sparsa_bin, capsys, tmp_path):
    """Stage 0's own tasks (the NIAH family) and no noisy prompt blocks, unless the flags say
    otherwise; every masked token of its batches is then an answer token."""
    import shutil
    run = str(tmp_path / "run")
    shutil.copytree(run_dir, run)  # the module's run (and its checkpoint) stay as the other tests left them
    T.main(["train", "--run", run, "--stage", "0", "--steps", "1", "--batch-tokens", "2048", "--device", "cpu",
            "--val-samples", "1", "--gen-threads", "1", "--chunk", "1", "--sparsa", sparsa_bin, "--log-seconds", "0"])
    assert ("tasks niah (50% copy, 0% key-value), 0 noisy prompt blocks, 0% answer blocks wholly masked, "
            "t ~ U(0.3, 0.8)") in capsys.readouterr().out
    c = T.load_run(run_dir)
    gen = torch.Generator().manual_seed(9)
    prompt, target = list(range(5, 300)), [7, 8, 9, c.eos_id]
    batch, _ = T.build_batch([(256, prompt, target, 128)], c, 0, gen)
    copies = batch["copy"][0]
    blocks = set(batch["blk"][0][copies >= 0].tolist())
    assert blocks == {len(prompt) // c.block_size}  # the answer's block alone


def test_copy_samples_repeat_their_prompt(run_dir, sparsa_bin):
    import random
    rng = random.Random(1)
    for L in (64, 256, 4096):
        length, prompt, target, gen_tokens = T.copy_item(L, rng, 400, 0)
        assert length == L and 16 <= len(prompt) <= max(16, min(96, L // 2))
        assert target == prompt + [0] and gen_tokens == len(target)
        assert min(prompt) >= len(T.SPECIALS) and max(prompt) < 400  # never EOS or mask
    f = T.run_files(run_dir)
    stream = T.TaskStream(sparsa_bin, f["tokenizer"], [512], TASKS, 5, 2, 1, copy_frac=1.0)
    try:
        items = [stream.get() for _ in range(4)]
    finally:
        stream.close()
    assert all(it[2] == it[1] + [stream.eos] for it in items)


def test_mask_rates_follow_the_range(run_dir):
    c = T.load_run(run_dir)
    gen = torch.Generator().manual_seed(10)
    items = [(2048, list(range(5, 600)), list(range(7, 140)) + [c.eos_id], 140)] * 8
    batch, _ = T.build_batch(items, c, 2, gen, t_range=(0.5, 0.5))
    w = batch["weights"][batch["labels"] != -100]
    assert torch.all(w == 2.0)  # 1/t with t = 0.5 exactly
    noisy = (batch["copy"] >= 0) & (batch["copy"] < T.PAD_COPY)
    frac = float((batch["labels"] != -100).sum()) / float(noisy.sum())
    assert 0.4 < frac < 0.6, frac  # ~1400 maskable tokens at p = 0.5 (less the clean prompt tail)
    batch, _ = T.build_batch(items, c, 2, gen, t_range=(0.3, 0.8))
    w = batch["weights"][batch["labels"] != -100]
    assert float(w.min()) >= 1 / 0.8 - 1e-6 and float(w.max()) <= 1 / 0.3 + 1e-6
    for bad in ("0,0.5", "0.5", "0.8,0.3", "a,b", "0.2,1.5"):
        with pytest.raises(Exception, match="LO"):
            T.mask_rates_arg(bad)
    assert T.mask_rates_arg("0.3,0.8") == (0.3, 0.8)


def test_probe_reports_both_views_of_copy_and_needle_answers(trained, sparsa_bin, capsys):
    capsys.readouterr()
    T.main(["probe", "--run", trained, "--sparsa", sparsa_bin, "--samples", "2", "--length", "512", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert set(rep["kinds"]) == {"copy", "niah_single_1", "kv digits"}
    assert rep["kinds"]["kv digits"]["all"]["tokens"] == 2 * 6 * 7  # 6 values of 7 digits a sample
    for kind in rep["kinds"].values():
        assert set(kind) == {"all", "one"}
        assert all(v["tokens"] > 0 and np.isfinite(v["ce"]) and 0 <= v["accuracy"] <= 1 for v in kind.values())
    # 30 steps on needles cannot copy 16-96 random tokens: at or above the uniform guess's CE
    assert rep["kinds"]["copy"]["all"]["ce"] > 0.8 * rep["chance_ce"]
    bag = rep["kv_bag"]  # the key-value answers' bag baseline, over the tokens the views score
    assert bag["tokens"] == rep["kinds"]["kv digits"]["all"]["tokens"]
    assert np.isfinite(bag["ce"]) and bag["ce"] > 0 and 0 < bag["accuracy"] < 1
    with pytest.raises(SystemExit, match="does not fit"):
        T.main(["probe", "--run", trained, "--sparsa", sparsa_bin, "--task", "cwe", "--length", "64"])


def test_probe_reads_an_exports_weights(trained, sparsa_bin, capsys, tmp_path):
    """--weights: the same probe on an export (f32: the very weights) gives the checkpoint's numbers."""
    out = tmp_path / "exported"
    T.main(["export", "--run", trained, "--out", str(out), "--dtype", "f32"])
    args = ["probe", "--run", trained, "--sparsa", sparsa_bin, "--samples", "2", "--length", "512", "--json"]
    capsys.readouterr()
    T.main(args)
    want = json.loads(capsys.readouterr().out)["kinds"]
    T.main(args + ["--weights", str(out)])
    got = json.loads(capsys.readouterr().out)["kinds"]
    for kind in want:
        for view in want[kind]:
            assert abs(got[kind][view]["ce"] - want[kind][view]["ce"]) < 1e-4 * max(1.0, want[kind][view]["ce"])
    with pytest.raises(SystemExit, match="--weights: .*No such file"):
        T.main(args + ["--weights", str(tmp_path / "nowhere")])


def test_plan_trains_stages_in_one_process_and_exports_after_each(sparsa_bin, tmp_path_factory, capsys):
    run = str(tmp_path_factory.mktemp("run_plan"))
    T.main(["tokenizer", "--run", run, "--sparsa", sparsa_bin, "--vocab", "400", "--numbers", "digits", "--samples", "2", "--dim", "32",
            "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--hidden", "64",
            "--block", "16", "--max-len", "2048"])
    out = os.path.join(run, "export")
    T.main(["train", "--run", run, "--plan", "1:0.02,2:0.02", "--tasks", TASKS, "--batch-tokens", "2048",
            "--device", "cpu", "--val-samples", "1", "--gen-threads", "1", "--chunk", "2", "--sparsa", sparsa_bin,
            "--log-seconds", "0", "--export", out])
    log_ = capsys.readouterr().out
    assert log_.count("exported") == 2 and "stage 1 done" in log_ and "stage 2 done" in log_
    with open(os.path.join(run, "log.jsonl")) as f:
        stages = [json.loads(line) for line in f]
    assert [s_["stage"] for s_ in stages] == [1, 2] and all(s_["steps"] >= 1 for s_ in stages)
    rec = json.loads(open(os.path.join(out, "training.json")).read())
    assert [s_["stage"] for s_ in rec["stages"]] == [1, 2]
    assert rec["steps"] == sum(s_["steps"] for s_ in stages)
    assert "tokens/s" in log_ and "waited for data" in log_
    # each stage's buckets warmed up once before its clock: 512 and 1024, then 1024 and 2048
    assert log_.count("warm-up of length") == 4, log_


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the GPU path of training)")
def test_cuda_flex_training_path(trained, sparsa_bin, tmp_path):
    """On the GPU: compiled FlexAttention under bf16 autocast gives the loss SDPA gives in f32
    (bf16 rounding: 2e-2 relative), and a few training steps there run and stay finite."""
    model = load_model(trained).cuda()
    gen = torch.Generator().manual_seed(6)
    items = [(512, list(range(5, 300)), [7, 8, 9, 0], 128), (512, list(range(9, 200)), [3, 4, 0], 128)]
    batch, total = T.build_batch(items, model.c, 2, gen, 640)
    from torch.nn.attention.flex_attention import flex_attention
    compiled = torch.compile(flex_attention, dynamic=False)
    with torch.no_grad():
        a = float(T.loss_of(model, batch, total, "sdpa")[0])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            b = float(T.loss_of(model, batch, total, "flex", compiled)[0])
    assert abs(a - b) <= 2e-2 * abs(a), (a, b)
    run = tmp_path / "gpu_run"
    import shutil
    shutil.copytree(trained, run)
    T.main(["train", "--run", str(run), "--stage", "1", "--lengths", "512", "--tasks", TASKS, "--steps", "5",
            "--batch-tokens", "8192", "--device", "cuda", "--val-samples", "2", "--gen-threads", "2",
            "--chunk", "4", "--sparsa", sparsa_bin, "--log-seconds", "0"])
    with open(run / "log.jsonl") as f:
        last = [json.loads(line) for line in f][-1]
    assert last["steps"] == 5 and all(np.isfinite(last["losses"]))


@pytest.mark.parametrize("dtype,shard_bytes", [("f32", 120_000), ("bf16", 16 << 20)])
def test_import_reads_back_what_export_wrote(trained, tmp_path, dtype, shard_bytes):
    model = load_model(trained)
    out = tmp_path / "model"
    S.export_hf(model, str(out), dtype, shard_bytes)
    fresh = S.Sdar(model.c)
    S.import_hf(fresh, str(out))
    for (name, want), (_, got) in zip(S.hf_tensors(model), S.hf_tensors(fresh)):
        want = want.detach().to(torch.bfloat16).float() if dtype == "bf16" else want.detach()
        assert torch.equal(got.detach(), want), name
    # a malformed or mismatched export is an error naming the file and tensor, not a crash
    shard = sorted(p for p in out.iterdir() if p.suffix == ".safetensors")[0]
    shard.write_bytes(shard.read_bytes()[:4])
    with pytest.raises(ValueError, match="too short"):
        S.import_hf(fresh, str(out))
    out3 = tmp_path / "model3"  # one tensor's shape no longer matching its bytes
    S.export_hf(model, str(out3), dtype)
    raw = (out3 / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["model.norm.weight"]["shape"] = [header["model.norm.weight"]["shape"][0] + 1]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (out3 / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    with pytest.raises(ValueError, match="model.norm.weight: data_offsets .* do not fit shape"):
        S.import_hf(fresh, str(out3))
    other = S.Sdar(S.SdarConfig(**{**model.c.__dict__, "hidden": model.c.hidden + 16}))
    out2 = tmp_path / "model2"
    S.export_hf(model, str(out2), dtype)
    with pytest.raises(ValueError, match="mlp.gate_proj.weight: shape"):
        S.import_hf(other, str(out2))


def test_train_init_continues_from_an_export(trained, sparsa_bin, tmp_path, capsys):
    """--init: a new run starts from an export's weights (what comes back from a lost machine)
    and carries its training record on: steps count from the export's."""
    out = tmp_path / "exported"
    T.main(["export", "--run", trained, "--out", str(out), "--dtype", "f32"])
    steps0 = json.loads((out / "training.json").read_text())["steps"]
    run = tmp_path / "run"
    run.mkdir()
    for name in ("run.json", "tokenizer.json"):
        (run / name).write_bytes(open(os.path.join(trained, name), "rb").read())
    T.main(["train", "--run", str(run), "--init", str(out), "--stage", "1", "--lengths", "512", "--tasks", TASKS,
            "--steps", "1", "--batch-tokens", "2048", "--device", "cpu", "--attention", "sdpa", "--val-samples", "0",
            "--gen-threads", "1", "--chunk", "4", "--sparsa", sparsa_bin, "--log-seconds", "0"])
    assert f"initialised from the export {out} at step {steps0}" in capsys.readouterr().out
    ck = torch.load(run / "ckpt.pt", weights_only=True)
    assert ck["state"]["step"] == steps0 + 1
    run2 = tmp_path / "run2"
    run2.mkdir()
    (run2 / "run.json").write_bytes((run / "run.json").read_bytes())
    with pytest.raises(SystemExit, match="--init: .*No such file"):
        T.main(["train", "--run", str(run2), "--init", str(tmp_path / "nowhere"), "--stage", "1",
                "--steps", "1", "--device", "cpu", "--sparsa", sparsa_bin])
    # an export whose training record is damaged or of the wrong shape: one exit naming it
    for record in ('{"steps": "many"}', '{"steps": 3, "stages": {}}', '[1, 2]', '{"steps": '):
        (out / "training.json").write_text(record)
        with pytest.raises(SystemExit, match=f"train_sdar: {out / 'training.json'}: "):
            T.main(["train", "--run", str(run2), "--init", str(out), "--stage", "1", "--steps", "1",
                    "--device", "cpu", "--sparsa", sparsa_bin])


def test_key_value_samples_ask_back_what_the_prompt_lists(run_dir, sparsa_bin):
    """kv_text: every answer line is a line of the prompt (its key listed once), at most 6 are
    asked, and the tokenized sample fits its length bucket."""
    import random
    import re
    from tokenizers import Tokenizer
    f = T.run_files(run_dir)
    tok = Tokenizer.from_file(f["tokenizer"])
    rng = random.Random(3)
    for L in (256, 512, 4096):
        for _ in range(5):
            prompt, answer, spans = T.kv_text(L // 32, rng)
            listed = re.findall(r"\n([a-z]+) is: ([0-9]{7})\.", prompt)
            asked = re.findall(r"\n([a-z]+) is: ([0-9]{7})\.", answer)
            assert len(listed) >= 2 and len({k for k, _ in listed}) == len(listed)
            assert 1 <= len(asked) <= 6 and set(asked) <= set(listed)
            assert answer == "".join(f"\n{k} is: {v}." for k, v in asked)
            assert [answer[lo:hi] for lo, hi in spans] == [v for _, v in asked]
            length, p, t, gen, maskable = T.kv_item(L, rng, tok, 0)
            assert length == L and t[-1] == 0 and len(t) <= 129 and gen == 128
            assert len(p) + len(t) <= L, (L, len(p), len(t))
            # the maskable tokens are the values' digits, all of them, and nothing else
            assert len(maskable) == len(t) and not maskable[-1]
            values = re.findall(r" ([0-9]{7})\.", tok.decode(t[:-1]))
            assert tok.decode([i for i, m in zip(t, maskable) if m]) == "".join(values)
    stream = T.TaskStream(sparsa_bin, f["tokenizer"], [512], TASKS, 5, 2, 1, kv_frac=1.0)
    try:
        items = [stream.get() for _ in range(3)]
    finally:
        stream.close()
    assert all("Recall them." in tok.decode(it[1]) for it in items)
    with pytest.raises(ValueError, match="together <= 1"):
        T.TaskStream(sparsa_bin, f["tokenizer"], [512], TASKS, 5, 2, 1, copy_frac=0.6, kv_frac=0.6)


def test_single_token_keys_stay_one_token_in_the_drill(run_dir):
    """--kv-keys tokens: every key of a sample is a word of the vocabulary that the tokenizer keeps
    as one token where the drill writes it (after a newline, before " is: "), in the prompt and in
    the answer; the value comes 4 tokens after it in both. Letter keys are several pieces. An
    unknown key kind is an error naming the option."""
    import random
    import re
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(T.run_files(run_dir)["tokenizer"])
    pool = T.single_token_keys(tok)
    assert len(pool) >= 10 and all(w.isalpha() and w.islower() for w in pool)  # a small test vocabulary
    rng = random.Random(5)
    for _ in range(20):
        length, p, t, gen, maskable = T.kv_item(256, rng, tok, 0, pairs=6, digits=3, asked=3, keys="tokens")
        prompt = tok.decode(p)
        keys = re.findall(r"\n([a-z]+) is: ", prompt)
        assert len(keys) == 6 and set(keys) <= set(pool) and len(set(keys)) == 6
        for ids in (p, t):
            # each line's key: one token (of the keys, found nowhere else), then " is: " and the
            # value's first digits four tokens on
            pieces = [tok.id_to_token(i) for i in ids]
            lines = re.findall(r"\n([a-z]+) is: ", tok.decode(ids))
            assert [x for x in pieces if x in pool] == lines
            for k in lines:
                at = pieces.index(k)
                assert pieces[at + 1:at + 4] == ["Ġis", ":", "Ġ"] and pieces[at + 4].isdigit()
    letters = T.kv_item(256, random.Random(5), tok, 0, pairs=6, digits=3, asked=3)
    pieces = [tok.id_to_token(i) for i in letters[1]]
    assert pieces.index("Ġis") - pieces.index(".Ċ") > 2  # the first letter key: several pieces
    with pytest.raises(ValueError, match="--kv-keys"):
        T.kv_item(256, rng, tok, 0, keys="words")


def test_key_value_drill_masks_the_values_alone_and_keeps_the_keys(run_dir, sparsa_bin, tmp_path, capsys):
    """A kv_item's answer asks its keys in a random order, so a value can only be found with its
    key visible: build_batch masks the value tokens alone (wholly with --full-mask 1), the keys
    and the rest of the answer stay as they are, a block without a value gets no noisy copy,
    and the loss is averaged over the maskable tokens. --kv-pairs/--kv-digits/--kv-asked shape
    the drill; with --kv-frac 1 no generator task needs to fit the length (128 here, which no
    needle task fits), and a shorter --answer-tokens shortens the rows."""
    import shutil
    from tokenizers import Tokenizer
    c = T.load_run(run_dir)
    tok = Tokenizer.from_file(T.run_files(run_dir)["tokenizer"])
    rng = random.Random(4)
    item = T.kv_item(128, rng, tok, c.eos_id, pairs=5, digits=3, asked=3)
    _, p, t, _, maskable = item
    assert sum(maskable) == 3 * 3  # digit by digit: 3 asked values of 3 digits
    batch, total = T.build_batch([item], c, 0, torch.Generator().manual_seed(1), t_range=(0.3, 0.5), full_mask=1.0)
    noisy = (batch["copy"][0] >= 0) & (batch["copy"][0] < T.PAD_COPY)
    masked = batch["ids"][0] == c.mask_id
    assert total == 9 and int(masked.sum()) == 9 and bool((batch["labels"][0] != -100).eq(masked).all())
    x0 = p + t
    pos = batch["pos"][0][masked].tolist()
    assert sorted(pos) == [len(p) + i for i, m in enumerate(maskable) if m]
    for q, i in zip(batch["pos"][0][noisy].tolist(), batch["ids"][0][noisy].tolist()):
        assert i == (c.mask_id if q in pos else (x0 + [c.eos_id] * 16)[q])  # keys and the rest: visible
    blocks = set(batch["blk"][0][noisy].tolist())
    assert blocks == {q // c.block_size for q in pos}
    # partial masking draws among the values only, and always masks one
    for seed in range(5):
        b, total = T.build_batch([item], c, 0, torch.Generator().manual_seed(seed), t_range=(0.01, 0.01))
        m = b["ids"][0] == c.mask_id
        assert 1 <= int(m.sum()) and set(b["pos"][0][m].tolist()) <= set(pos) and total == 9
    # noisy prompt blocks beside it are masked as before (any token), and the llada loss keeps to the values too
    b, _ = T.build_batch([item], c, 2, torch.Generator().manual_seed(2), t_range=(0.5, 0.5), full_mask=1.0)
    prompt_copies = (b["copy"][0] >= 0) & (b["copy"][0] < T.PAD_COPY) & (b["pos"][0] < (len(p) // 16) * 16)
    assert int(prompt_copies.sum()) == 32 and bool((b["ids"][0][prompt_copies] == c.mask_id).any())
    b, total = T.build_batch_llada([item], c, torch.Generator().manual_seed(2), t_range=(1.0, 1.0))
    m = b["ids"][0] == c.mask_id
    assert total == 9 and sorted(b["pos"][0][m].tolist()) == sorted(pos)
    run = str(tmp_path / "run")
    shutil.copytree(run_dir, run)
    capsys.readouterr()
    T.main(["train", "--run", run, "--stage", "0", "--lengths", "128", "--tasks", "niah_single_1", "--kv-frac", "1",
            "--copy-frac", "0", "--kv-pairs", "4", "--kv-digits", "3", "--kv-asked", "2", "--full-mask", "1",
            "--answer-tokens", "48", "--steps", "2", "--batch-tokens", "2048", "--device", "cpu", "--val-samples", "2",
            "--gen-threads", "1", "--chunk", "4", "--sparsa", sparsa_bin, "--log-seconds", "0"])
    out = capsys.readouterr().out
    assert "100% key-value of 4 pairs, 3 digits, 2 asked" in out and "(11 x 256)" in out  # 2048 // (128 + 48) rows
    # the drill's shape options refuse values they cannot build, naming the option
    for option, value in (("--kv-digits", "0"), ("--kv-asked", "0"), ("--kv-pairs", "-1"), ("--answer-tokens", "0"),
                          ("--kv-digits", "x")):
        with pytest.raises(SystemExit):
            T.main(["train", "--run", run, option, value])
        assert option in capsys.readouterr().err


def test_full_mask_masks_whole_answer_blocks(run_dir):
    c = T.load_run(run_dir)
    prompt, target = list(range(5, 300)), list(range(10, 40)) + [c.eos_id]
    item = [(512, prompt, target, 128)]
    def answer_of(batch):
        noisy = (batch["copy"][0] >= 0) & (batch["copy"][0] < T.PAD_COPY)
        return noisy, noisy & (batch["pos"][0] >= len(prompt)) & (batch["blk"][0] >= len(prompt) // c.block_size)

    # without it, t ~ U(0.3, 0.5) leaves some of the answer's 30+ tokens visible (all masked: p < 0.5^30)
    plain, _ = T.build_batch(item, c, 2, torch.Generator().manual_seed(4), t_range=(0.3, 0.5))
    _, answer = answer_of(plain)
    assert not bool((plain["ids"][0][answer] == c.mask_id).all())
    full, _ = T.build_batch(item, c, 2, torch.Generator().manual_seed(4), t_range=(0.3, 0.5), full_mask=1.0)
    noisy, answer = answer_of(full)
    assert bool((full["ids"][0][answer] == c.mask_id).all()) and int(answer.sum()) >= len(target)
    assert torch.allclose(full["weights"][0][answer], torch.ones(int(answer.sum())))
    prompt_blocks = noisy & (full["blk"][0] < len(prompt) // c.block_size)
    assert int(prompt_blocks.sum()) == 2 * c.block_size
    assert not bool((full["ids"][0][prompt_blocks] == c.mask_id).all())  # noisy prompt blocks keep t ~ U(0.3, 0.5)


@pytest.mark.parametrize("flag", ["--copy-frac", "--kv-frac", "--full-mask"])
def test_shares_outside_zero_one_are_usage_errors(run_dir, sparsa_bin, capsys, flag):
    for bad in ("1.5", "-0.1", "half"):
        with pytest.raises(SystemExit):
            T.main(["train", "--run", run_dir, "--sparsa", sparsa_bin, "--stage", "0", "--steps", "1", flag, bad])
        err = capsys.readouterr().err
        assert flag in err and f"expected a share in [0, 1], got '{bad}'" in err


def test_triples_tokenizer_makes_every_digit_run_one_token_and_the_engine_agrees(sparsa_bin, tmp_path):
    """--numbers triples (the default): numbers cut into runs of up to three digits (Llama 3's
    split), each of the 1,110 runs one token, so a 7-digit value is 3 tokens; the engine's C++
    tokenizer (`sparsa tokenize`) gives the `tokenizers` package's ids on needle text; the probe
    counts those runs as the value's tokens. A vocabulary too small to hold them is an error
    naming --vocab, not a tokenizer that cuts some values differently."""
    from tokenizers import Tokenizer
    run = str(tmp_path / "run")
    T.main(["tokenizer", "--run", run, "--sparsa", sparsa_bin, "--vocab", "2048", "--samples", "1", "--dim", "32",
            "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--hidden", "64",
            "--block", "16", "--max-len", "1024"])
    tok = Tokenizer.from_file(os.path.join(run, "tokenizer.json"))
    assert all(len(tok.encode(r, add_special_tokens=False).ids) == 1 for r in T.number_runs())
    assert len(T.number_tokens(tok)) == 1110
    text = "One of the special magic numbers for tense-buyer is: 1234567.\nWhat is 0070009, 12 or 98765?"
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces = [tok.id_to_token(i) for i in ids]
    assert pieces[pieces.index("123"):pieces.index("123") + 3] == ["123", "456", "7"]
    assert ["007", "000", "9"] == pieces[pieces.index("007"):pieces.index("007") + 3]
    p = subprocess.run([sparsa_bin, "tokenize", "--tokenizer", os.path.join(run, "tokenizer.json"), "--text", text,
                        "--json"], capture_output=True, text=True, check=True)
    assert json.loads(p.stdout)["ids"] == ids
    rng = random.Random(3)
    _, _, target, _, maskable = T.kv_item(256, rng, tok, 0)
    assert sum(t in T.number_tokens(tok) for t in target) == 6 * 3  # 6 values of 3 runs (3 + 3 + 1 digits)
    assert maskable == [t in T.number_tokens(tok) for t in target]  # the values' runs alone may be masked
    with pytest.raises(SystemExit, match="--vocab 400: too small for --numbers triples"):
        T.main(["tokenizer", "--run", str(tmp_path / "small"), "--sparsa", sparsa_bin, "--vocab", "400",
                "--samples", "1"])


def test_profile_logs_where_a_steps_time_goes(sparsa_bin, tmp_path_factory, capsys):
    """--profile N: N steps from the stage's sixth under torch.profiler, then a table of the
    operators by self time and the steps' wall time in the log; negative N is an error."""
    run = make_run(sparsa_bin, tmp_path_factory, "sdar")
    base = ["train", "--run", run, "--stage", "1", "--lengths", "512", "--tasks", TASKS, "--batch-tokens", "2048",
            "--device", "cpu", "--attention", "sdpa", "--val-samples", "1", "--gen-threads", "1", "--chunk", "4",
            "--sparsa", sparsa_bin, "--log-seconds", "0"]
    capsys.readouterr()
    T.main(base + ["--steps", "8", "--profile", "2"])
    out = capsys.readouterr().out
    assert "profile of steps 6-7:" in out and "ms a step" in out, out
    assert "Self CPU" in out and "aten::" in out  # torch.profiler's table of operators
    T.main(base + ["--steps", "3", "--profile", "2"])  # ends before the profile's last step
    assert "the stage ended before 7 steps" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        T.main(base + ["--steps", "1", "--profile", "-1"])
    assert "--profile: expected an integer >= 0" in capsys.readouterr().err


def test_a_non_finite_loss_stops_training_before_a_checkpoint_keeps_it(sparsa_bin, tmp_path_factory):
    """The losses are read from the device only at log and checkpoint times; a non-finite loss
    or weight found there (here: a learning rate that blows the weights up) stops the run with
    an error before the checkpoint is written, so the last checkpoint on disk is finite."""
    run = make_run(sparsa_bin, tmp_path_factory, "sdar")
    args = ["train", "--run", run, "--stage", "1", "--lengths", "512", "--tasks", TASKS, "--batch-tokens", "2048",
            "--device", "cpu", "--attention", "sdpa", "--val-samples", "1", "--gen-threads", "1", "--chunk", "4",
            "--sparsa", sparsa_bin, "--log-seconds", "1000", "--warmup", "1"]
    T.main(args + ["--steps", "2", "--lr", "1e-3"])
    ckpt = os.path.join(run, "ckpt.pt")
    with pytest.raises(SystemExit, match="(the loss|a weight) became"):
        T.main(args + ["--steps", "40", "--lr", "1e30", "--save-minutes", "0"])
    after = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert all(torch.isfinite(v).all() for v in after["model"].values())


def test_loss_rows_found_on_the_host_give_the_boolean_index_loss(trained):
    """loss_of reads the masked tokens' rows found on the host (with_loss_rows, in the batch
    thread: no device sync); the same loss and cross-entropy as a boolean index of the device
    tensors, computed here independently, bit for bit (the same rows in the same order), with
    or without the rows precomputed."""
    import torch.nn.functional as F
    model = load_model(trained)
    gen = torch.Generator().manual_seed(8)
    items = [(512, list(range(5, 300)), [7, 8, 9, 0], 128), (512, list(range(9, 200)), [3, 4, 0], 128)]
    batch, total = T.build_batch(items, model.c, 2, gen, 640)
    with torch.no_grad():
        h = model.hidden(batch["ids"], batch["pos"], S.sdpa_attention(T.dense_mask(batch["blk"], batch["copy"])))
        sel = batch["labels"] != -100
        ce = F.cross_entropy(model.head(h[sel]).float(), batch["labels"][sel], reduction="none")
        want = ((ce * batch["weights"][sel]).sum() / total, ce.sum() / int(sel.sum()))
        for b in (batch, T.with_loss_rows(batch)):
            got = T.loss_of(model, b, total, "sdpa")
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (got, want)
    rows = T.with_loss_rows(batch)["rows"]
    assert rows.numel() == int(sel.sum()) and bool((batch["labels"].reshape(-1)[rows] != -100).all())


def worker_spec(run_dir, sparsa_bin, **over):
    """A data worker's description (train_stage builds the same from its flags)."""
    c = T.load_run(run_dir)
    spec = {"config": dict(c.__dict__), "sparsa": sparsa_bin, "tokenizer": T.run_files(run_dir)["tokenizer"],
            "lengths": [512], "tasks": TASKS, "seed0": 5, "chunk": 2, "threads": 1, "copy_frac": 0.0,
            "kv_frac": 0.5, "kv_shape": [0, 7, 6, "letters"], "gen_seed": 11, "prompt_blocks": 2,
            "t_range": [0.3, 0.8], "full_mask": 0.0, "answer_tokens": T.ANSWER_TOKENS,
            "buckets": {512: {"rows": 3, "seq": 1024}}}
    spec.update(over)
    return spec


def worker_batches(spec, worker, n):
    """The first n things data worker `worker` puts on its queue (run in a thread here)."""
    import queue
    import threading
    out, stop = queue.Queue(maxsize=2), threading.Event()
    th = threading.Thread(target=T.data_worker, args=(spec, worker, out, stop), daemon=True)
    th.start()
    got = [out.get(timeout=120) for _ in range(n)]
    stop.set()
    while th.is_alive():  # a put blocked on the full queue sees the stop within its timeout
        try:
            out.get(timeout=0.5)
        except queue.Empty:
            pass
    return got


def test_data_workers_build_whole_batches_from_samples_of_their_own(run_dir, sparsa_bin):
    """train --data-workers: a worker puts whole batches (every STEP_KEYS array, the bucket's
    shape) as numpy arrays; two workers draw different samples (their seeds are
    WORKER_SEED_STRIDE apart), and a worker repeats itself given the same seeds."""
    spec = worker_spec(run_dir, sparsa_bin)
    a0, a1 = worker_batches(spec, 0, 2), worker_batches(spec, 1, 1)
    again = worker_batches(spec, 0, 1)
    for batch, total in a0 + a1:
        assert set(batch) == set(T.STEP_KEYS) and all(isinstance(v, np.ndarray) for v in batch.values())
        assert batch["ids"].shape == (3, 1024) and total > 0
        assert batch["rows"].size == batch["row_labels"].size == batch["row_weights"].size > 0
    assert not np.array_equal(a0[0][0]["ids"], a1[0][0]["ids"])
    assert not np.array_equal(a0[0][0]["ids"], a0[1][0]["ids"])
    assert np.array_equal(a0[0][0]["ids"], again[0][0]["ids"])


def test_a_data_workers_error_reaches_the_loop_naming_the_worker(run_dir, sparsa_bin, tmp_path):
    spec = worker_spec(run_dir, sparsa_bin, tokenizer=str(tmp_path / "missing.json"))
    (err,) = worker_batches(spec, 3, 1)
    assert isinstance(err, RuntimeError) and str(err).startswith("data worker 3: ")


def test_training_with_data_worker_processes(sparsa_bin, tmp_path_factory):
    """The stage's batches from two worker processes: the steps run, the loss is finite, and no
    worker process outlives the stage."""
    import multiprocessing
    run = make_run(sparsa_bin, tmp_path_factory, "sdar")
    T.main(["train", "--run", run, "--stage", "1", "--lengths", "512", "--tasks", TASKS, "--steps", "6",
            "--batch-tokens", "4096", "--device", "cpu", "--attention", "sdpa", "--val-samples", "2",
            "--gen-threads", "2", "--chunk", "4", "--kv-frac", "0.3", "--warmup", "2", "--sparsa", sparsa_bin,
            "--log-seconds", "0", "--data-workers", "2"])
    with open(os.path.join(run, "log.jsonl")) as f:
        rec = json.loads(f.readline())
    assert rec["steps"] == 6 and len(rec["losses"]) == 6 and all(np.isfinite(rec["losses"]))
    assert not multiprocessing.active_children()


def test_compiled_layers_match_the_eager_model():
    """Sdar.compile_layers (train --compile 1): each layer's two halves compiled give the eager
    model's logits and gradients (f32; inductor reorders sums: about 1e-6 relative seen, a
    wrong graph is off by order 1), and one compiled graph per half serves every layer."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    c = S.SdarConfig(vocab_size=400, dim=64, layers=3, heads=4, kv_heads=2, head_dim=16, hidden=128, block_size=16,
                     max_len=1024, rope_theta=1e6, mask_id=1, eos_id=0, arch="sdar")
    m = S.Sdar(c)
    ids, pos = torch.randint(0, 400, (3, 96)), torch.arange(96)[None].expand(3, 96)
    attn = S.sdpa_attention((torch.arange(96)[None, :] // 16 <= torch.arange(96)[:, None] // 16)[None])
    ref = m(ids, pos, attn)
    ref.square().mean().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    torch._dynamo.reset()
    counters.clear()
    m.compile_layers()
    out = m(ids, pos, attn)
    out.square().mean().backward()
    assert rel_err(out.detach().numpy(), ref.detach().numpy()) < 1e-5
    for p, g in zip(m.parameters(), grads):
        assert rel_err(p.grad.numpy(), g.numpy()) < 1e-5
    assert counters["stats"]["unique_graphs"] == 2


def test_compile_flag_compiles_the_layers(run_dir, sparsa_bin, tmp_path, monkeypatch):
    import shutil
    run = str(tmp_path / "run")
    shutil.copytree(run_dir, run)
    calls = []
    monkeypatch.setattr(S.Sdar, "compile_layers", lambda self: calls.append(self))
    T.main(["train", "--run", run, "--stage", "1", "--lengths", "512", "--tasks", TASKS, "--steps", "1",
            "--batch-tokens", "2048", "--device", "cpu", "--attention", "sdpa", "--val-samples", "1", "--gen-threads",
            "1", "--chunk", "1", "--sparsa", sparsa_bin, "--log-seconds", "0", "--compile", "1"])
    assert len(calls) == 1


def test_probe_all_view_masks_one_answer_block_at_a_time():
    """The probe's "all" view on an sdar model: one canvas per answer block, that block's answer
    tokens masked and the blocks before it clean (the block loop's first step of each block);
    the answer of an earlier block is context, never a mask. llada: one canvas, all masked."""
    c = S.SdarConfig(vocab_size=40, dim=32, layers=2, heads=2, kv_heads=1, head_dim=16, hidden=48, block_size=4,
                     max_len=64)
    torch.manual_seed(0)
    model = S.Sdar(c).eval()
    prompt = [5, 6, 7, 8, 9, 10]
    target = [11, 12, 13, 14, 15, 16, 17, 18, 19, c.eos_id]  # answer at 6..14: blocks 4-7, 8-11, 12-15

    def expected(target, arch_views):
        x0 = prompt + target
        ce = []
        for lo, hi in arch_views:
            ids = [c.mask_id if len(prompt) <= q and lo <= q < hi else t for q, t in enumerate(x0)]
            with torch.no_grad():
                logits = model.canvas_logits(ids).float()
            ce += [float(-torch.log_softmax(logits[j], -1)[x0[j]]) for j in range(max(lo, len(prompt)), min(hi, 15))]
        return sum(ce) / len(ce), len(ce)

    got = T.answer_scores(model, [(32, prompt, target, 16)], c, 4)["all"]
    want, n = expected(target, [(4, 8), (8, 12), (12, 16)])
    assert got["tokens"] == n == 9
    assert abs(got["ce"] - want) < 1e-5
    # A later block sees the earlier block's answer: changing it changes the score.
    other = [21, 22] + target[2:]
    assert abs(T.answer_scores(model, [(32, prompt, other, 16)], c, 4)["all"]["ce"] - got["ce"]) > 1e-6
    # only= masks and scores the listed tokens alone, still block by block.
    part = T.answer_scores(model, [(32, prompt, target, 16)], c, 4, only={12, 17})["all"]
    assert part["tokens"] == 2
    c.arch = "llada"
    got = T.answer_scores(model, [(32, prompt, target, 16)], c, 4)["all"]
    want, n = expected(target, [(0, 16)])
    assert got["tokens"] == n and abs(got["ce"] - want) < 1e-5


def test_bag_scores_are_the_prompts_number_frequencies():
    """bag_scores: each scored answer token predicted from the prompt's tokens in `only` as a
    bag: CE of their frequencies (an absent token as half an occurrence), right for the most
    frequent, a tie's credit shared. Tokens outside `only` and the EOS are not scored."""
    only = {5, 7, 9, 11}
    prompt = [1, 5, 2, 5, 3, 7]  # bag {5: 2, 7: 1} of 3
    target = [4, 5, 7, 9, 99]    # 4: not scored; 99: the EOS
    got = T.bag_scores([(16, prompt, target, 8)], only)
    want_ce = (-math.log(2 / 3) - math.log(1 / 3) - math.log(0.5 / 3)) / 3
    assert got["tokens"] == 3
    assert abs(got["ce"] - want_ce) < 1e-12 and abs(got["accuracy"] - 1 / 3) < 1e-12
    tie = T.bag_scores([(16, [5, 7], [7, 99], 8)], only)  # 5 and 7 tie: half the credit
    assert tie["tokens"] == 1 and abs(tie["accuracy"] - 0.5) < 1e-12 and abs(tie["ce"] - math.log(2)) < 1e-12
    assert T.bag_scores([(16, [1, 2], [5, 99], 8)], only)["tokens"] == 0  # no number in the prompt: skipped


def test_llada_full_mask_masks_the_whole_answer_region(run_dir):
    """--full-mask for llada: that share of samples has every maskable answer token masked (t = 1,
    weight 1), the remask loop's first step; without it t ~ U(0.3, 0.5) leaves some visible."""
    c = T.load_run(run_dir)
    c.arch = "llada"
    prompt, target = list(range(5, 300)), list(range(10, 40)) + [c.eos_id]
    item = [(512, prompt, target, 64)]
    region = slice(len(prompt), len(prompt) + 64)
    plain, _ = T.make_batch(item, c, 0, torch.Generator().manual_seed(4), t_range=(0.3, 0.5))
    assert not bool((plain["ids"][0][region] == c.mask_id).all())
    full, total = T.make_batch(item, c, 0, torch.Generator().manual_seed(4), t_range=(0.3, 0.5), full_mask=1.0)
    assert bool((full["ids"][0][region] == c.mask_id).all()) and total == 64
    assert torch.equal(full["weights"][0][region], torch.ones(64))
    assert not bool((full["ids"][0][:len(prompt)] == c.mask_id).any())  # the prompt stays clean
    # a share: over many samples about that share is masked whole
    gen = torch.Generator().manual_seed(9)
    whole = sum(bool((T.build_batch_llada(item, c, gen, t_range=(0.3, 0.5), full_mask=0.5)[0]["ids"][0][region]
                      == c.mask_id).all()) for _ in range(200))
    assert 70 <= whole <= 130, whole  # Binomial(200, 0.5): 6 standard deviations either side


def tiny_sdar(layers, seed=0):
    torch.manual_seed(seed)
    c = S.SdarConfig(vocab_size=60, dim=48, layers=layers, heads=4, kv_heads=2, head_dim=16, hidden=64,
                     block_size=16, max_len=256, rope_theta=1e4, mask_id=1, eos_id=0)
    m = S.Sdar(c).double()
    with torch.no_grad():  # gains away from their uniform start, so a wrong axis shows
        for L in m.layers:
            L.q_norm.weight.uniform_(0.5, 2.0)
            L.k_norm.weight.uniform_(0.5, 2.0)
    return m


def test_fold_qk_norm_scales_each_heads_projection_by_its_gain_over_its_rms():
    src = tiny_sdar(layers=2)
    gen = torch.Generator().manual_seed(3)
    canvases = [torch.randint(2, 60, (n,), generator=gen).tolist() for n in (40, 17)]
    q_rms, k_rms = S.qk_rms(src, canvases)
    assert q_rms.shape == (2, 4) and k_rms.shape == (2, 2)
    # qk_rms against a direct computation for layer 0 (its input is the embedding alone)
    with torch.no_grad():
        h = torch.cat([src.layers[0].input_layernorm(src.embed_tokens(torch.tensor(ids))) for ids in canvases])
        q = src.layers[0].q_proj(h).view(-1, 4, 16)
        want = q.pow(2).mean(-1).sqrt().mean(0)
    assert torch.allclose(q_rms[0], want, rtol=1e-12)
    dst = S.fold_qk_norm(src, q_rms, k_rms)
    assert dst.c.arch == "llada" and not hasattr(dst.layers[0], "q_norm")
    a, b = src.state_dict(), dst.state_dict()
    for name, t in b.items():  # every weight but the q and k projections is copied
        if not name.endswith(("q_proj.weight", "k_proj.weight")):
            assert torch.equal(t, a[name]), name
    # per layer and head: the folded projection is the gain times the projection over the head's rms,
    # so a vector whose projection has exactly that rms is projected to the normed q (and k)
    x = torch.randn(5, 48, dtype=torch.float64, generator=gen)
    for i in range(2):
        for proj, norm, rms, heads in (("q_proj", "q_norm", q_rms, 4), ("k_proj", "k_norm", k_rms, 2)):
            raw = getattr(src.layers[i], proj)(x).view(5, heads, 16)
            got = getattr(dst.layers[i], proj)(x).view(5, heads, 16)
            gain = getattr(src.layers[i], norm).weight
            assert torch.allclose(got, gain * raw / rms[i][None, :, None], rtol=1e-12)
            # an input scaled so that head h's projection has exactly the head's mean rms: there the
            # folded projection gives the normed one (the norm's eps 1e-6 against mean squares of
            # about 0.01 here: 5e-5 relative)
            for h in range(heads):
                xs = x * (rms[i][h] / raw[:, h].pow(2).mean(-1).sqrt())[:, None]
                normed = getattr(src.layers[i], norm)(getattr(src.layers[i], proj)(xs).view(5, heads, 16))[:, h]
                folded = getattr(dst.layers[i], proj)(xs).view(5, heads, 16)[:, h]
                assert torch.allclose(folded, normed, rtol=1e-3), (i, proj, h)
    with pytest.raises(ValueError, match="expected sdar"):
        S.fold_qk_norm(dst, q_rms, k_rms)
    with pytest.raises(ValueError, match="no tokens"):
        S.qk_rms(src, [])


def test_convert_makes_an_engine_llada_model_from_an_sdar_export(trained, sparsa_bin, tmp_path):
    sdar_export = tmp_path / "sdar"
    T.main(["export", "--run", trained, "--out", str(sdar_export), "--dtype", "f32"])
    run = tmp_path / "llada_run"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns("ckpt.pt", "log.jsonl"))
    cfg = json.loads((run / "run.json").read_text())
    cfg["model"]["arch"] = "llada"
    (run / "run.json").write_text(json.dumps(cfg))
    out = tmp_path / "llada"
    T.main(["convert", "--run", str(run), "--weights", str(sdar_export), "--out", str(out), "--length", "512",
            "--samples", "1", "--tasks", "niah_single_1", "--sparsa", sparsa_bin])
    assert json.loads((out / "config.json").read_text())["model_type"] == "llada"
    note = json.loads((out / "training.json").read_text())["history"][0]
    assert note["qk_rms_tokens"] > 100 and len(note["q_rms"]) == cfg["model"]["layers"]
    assert note["converted_from"] == "sdar"  # the directory's name, no machine path
    info = json.loads(subprocess.run([sparsa_bin, "model", "info", str(out), "--json"], capture_output=True,
                                     text=True, check=True).stdout)
    assert info["arch"] == "llada"
    # the engine runs the folded model as the PyTorch llada model with the same weights does
    model = S.Sdar(T.load_run(str(run))).double()
    S.import_hf(model, str(out))
    ids = list(range(2, 40))
    got = engine_logits(sparsa_bin, out, ids, tmp_path)
    with torch.no_grad():
        assert rel_err(got, model.canvas_logits(ids).numpy()) < LOGIT_TOL
    # a run whose model is not llada, and weights that are not an sdar export, are refused by name
    with pytest.raises(SystemExit, match="convert makes a llada model"):
        T.main(["convert", "--run", trained, "--weights", str(sdar_export), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--weights: .*no tensor"):
        T.main(["convert", "--run", str(run), "--weights", str(out), "--out", str(tmp_path / "y")])


# ---- damaged and hostile files: run.json and the checkpoint ---------------------------------
# Fuzzed with fixed seeds (SPARSA_FUZZ_CASES cases each; a longer campaign sets it higher): the
# reader returns what the file describes or exits with the file's name, never another exception
# or code run from the file.

FUZZ_CASES = int(os.environ.get("SPARSA_FUZZ_CASES", "300"))
ODD_VALUES = [None, True, 0, -1, 3, 2 ** 40, 0.5, float("nan"), float("inf"), "", "sdar", "llada", [], {}, [1]]


def test_run_json_fuzz(run_dir, tmp_path):
    original = json.loads((open(os.path.join(run_dir, "run.json")).read()))
    path = tmp_path / "run.json"
    rng = random.Random(3)
    accepted = 0
    for case in range(FUZZ_CASES):
        raw = json.loads(json.dumps(original))
        model = raw["model"]
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(sorted(model) + ["zz"])
            if rng.random() < 0.2:
                model.pop(key, None)
            else:
                model[key] = rng.choice(ODD_VALUES)
        text = json.dumps(raw if rng.random() < 0.9 else rng.choice([[], model, {"model": []}]))
        path.write_text(text[:rng.randrange(len(text) + 1)] if rng.random() < 0.1 else text)
        try:
            c = T.load_run(str(tmp_path))
        except SystemExit as e:
            assert str(e).startswith(f"train_sdar: {path}: "), str(e)
            continue
        if T.run_parameters(c) < 2e6 and c.max_len * c.head_dim < 2e6:  # larger ones are accepted, not built here
            S.Sdar(c)
        accepted += 1
    assert 0 < accepted < FUZZ_CASES


@pytest.mark.filterwarnings("ignore::UserWarning")  # the unpickler's notes on the damaged bytes it reads
def test_checkpoint_fuzz(trained, tmp_path):
    """Mutated bytes of a real checkpoint: it loads (a change inside a tensor's bytes cannot be
    seen: the file has no checksum of its values), or it is one exit naming the file."""
    original = open(os.path.join(trained, "ckpt.pt"), "rb").read()
    c = T.load_run(trained)
    path = str(tmp_path / "ckpt.pt")
    rng = random.Random(5)
    refused = 0
    for case in range(max(FUZZ_CASES // 4, 20)):
        data = bytearray(original)
        op = rng.randrange(3)
        if op == 0:
            data = data[:rng.randrange(len(data))]
        elif op == 1:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        else:
            data = bytearray(rng.randbytes(len(data)))
        open(path, "wb").write(bytes(data))
        model = S.Sdar(c)
        opt = torch.optim.AdamW(T.param_groups(model, 0.1), lr=1e-3)
        try:
            T.restore(model, T.load_ckpt(path), path, opt)
        except SystemExit as e:
            assert str(e).startswith(f"train_sdar: {path}: "), str(e)
            refused += 1
    assert refused > 0


class _Payload:
    """A pickle that creates a file when it is unpickled: the code a hostile checkpoint carries."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_checkpoint_never_runs_code(tmp_path):
    import pickle
    target = str(tmp_path / "ran")
    for write in (lambda p: torch.save({"model": _Payload(target)}, p),
                  lambda p: open(p, "wb").write(pickle.dumps(_Payload(target)))):
        path = str(tmp_path / "ckpt.pt")
        write(path)
        with pytest.raises(SystemExit, match="not a readable checkpoint"):
            T.load_ckpt(path)
        assert not os.path.exists(target)


@pytest.mark.parametrize("content", ["not a dict", "no state", "state without step", "foreign weights"])
def test_checkpoint_contents_that_do_not_fit(trained, tmp_path, content):
    ck = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    if content == "not a dict":
        ck = [ck]
    elif content == "no state":
        del ck["state"]
    elif content == "state without step":
        del ck["state"]["step"]
    else:
        ck["model"] = {"weight": torch.zeros(2)}
    path = str(tmp_path / "ckpt.pt")
    torch.save(ck, path)
    model = S.Sdar(T.load_run(trained))
    with pytest.raises(SystemExit, match=f"train_sdar: {path}: "):
        T.restore(model, T.load_ckpt(path), path)


def test_import_fuzz(trained, tmp_path):
    """An export's safetensors header mutated (values of other types and sizes, entries renamed),
    its bytes damaged, or its shard index mutated: import_hf loads it or raises one ValueError
    naming the file (what train --init, probe --weights and convert turn into an exit)."""
    model = load_model(trained)
    out = tmp_path / "model"
    S.export_hf(model, str(out), "f32", 120_000)  # sharded, with model.safetensors.index.json
    shard = sorted(p for p in out.iterdir() if p.suffix == ".safetensors")[0]
    original, index_text = shard.read_bytes(), (out / "model.safetensors.index.json").read_text()
    n = int.from_bytes(original[:8], "little")
    header, data = json.loads(original[8:8 + n]), original[8 + n:]
    rng = random.Random(9)
    fresh = S.Sdar(model.c)
    loaded = refused = 0
    for case in range(FUZZ_CASES):
        shard.write_bytes(original)
        (out / "model.safetensors.index.json").write_text(index_text)
        op = rng.random()
        if op < 0.6:
            h = json.loads(json.dumps(header))
            name = rng.choice(sorted(h))
            if rng.random() < 0.2:
                h[name + "x"] = h.pop(name)
            else:
                field = rng.choice(["dtype", "shape", "data_offsets", "zz"])
                value = rng.choice(ODD_VALUES + [[0, 2 ** 70], [-4, 4], [3], [5, 1], ["F32"], [1.5, 2]])
                h[name] = value if rng.random() < 0.1 else {**h[name], field: value}
            text = json.dumps(h).encode()
            shard.write_bytes(len(text).to_bytes(8, "little") + text + data)
        elif op < 0.8:
            raw = bytearray(original)
            for _ in range(rng.randint(1, 6)):
                raw[rng.randrange(min(len(raw), 8 + n + 64))] = rng.randrange(256)
            shard.write_bytes(bytes(raw))
        else:
            index = json.loads(index_text)
            key = rng.choice(sorted(index["weight_map"]))
            index["weight_map"][key] = rng.choice(ODD_VALUES + ["../x.safetensors", "/etc/passwd", "missing"])
            if rng.random() < 0.2:
                index = rng.choice([[], {"weight_map": []}, {"weight_map": None}])
            (out / "model.safetensors.index.json").write_text(json.dumps(index))
        try:
            S.import_hf(fresh, str(out))
            loaded += 1
        except (ValueError, OSError) as e:  # OSError: a shard the index names is missing
            assert str(out) in str(e), str(e)
            refused += 1
    assert loaded > 0 and refused > 0  # a harness that only refuses, or only accepts, explores nothing
