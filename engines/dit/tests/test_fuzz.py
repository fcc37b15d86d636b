"""Fuzz harnesses of the DiT engine's readers: the experiment config (JSON with ``extends``), a
run's checkpoint and its summary. Whatever the file holds, the reader returns what it describes
or raises a ValueError that names the file or the field; never another exception, a hang, code
run from the file, or a file lost.

Each harness mutates real files (the shipped configs; a checkpoint and a summary written by a
two-step training run) with a fixed seed. SPARSA_FUZZ_CASES sets the number of cases per harness
(default below, a few seconds each in CI); a longer campaign is
``SPARSA_FUZZ_CASES=100000 python -m pytest engines/dit/tests/test_fuzz.py``.
"""
import json
import os
import pickle
import random
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from engines.dit import config as config_mod  # noqa: E402
from engines.dit import train as train_mod  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CASES = int(os.environ.get("SPARSA_FUZZ_CASES", "400"))

# A field's dotted name ("train.lr", "seeds[0]", "data.scene.sigma_min/sigma_max") or the file's
# role ("--config", "config", "extends"), then a colon: what every config error starts with.
FIELD_ERROR = re.compile(r"^(--config|config|extends|[a-z_0-9]+(\[\d+\])?(\.[a-z_0-9]+(\[\d+\])?)*(/[a-z_0-9]+)?): ")

# Values of every JSON type, the edges of numbers among them (Python's json writes NaN and
# Infinity, and reads them back).
SPECIAL = [None, True, False, 0, -1, 1, 3, 2 ** 31, 2 ** 63, 2 ** 64, -2 ** 63 - 1, 10 ** 30, 0.5, -0.5, 1e308,
           float("nan"), float("inf"), float("-inf"), "", "x", "full", "llsa", "z_order", "logit_normal", [], [1],
           [0.5], ["full"], [True], {}, {"steps": 1}, {"_note": 1}, [[[]]]]


def _value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if r < 0.6 or depth > 2:
        return json.loads(json.dumps(rng.choice(SPECIAL)))  # a fresh copy: mutations must not alias
    if r < 0.8:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["steps", "block", "_c", "extends", "image_size", "zz"]): _value(rng, depth + 1)
            for _ in range(rng.randint(0, 2))}


def _paths(node, prefix=()):
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield prefix + (key,)
        yield from _paths(value, prefix + (key,))


def _mutate(rng: random.Random, raw):
    paths = list(_paths(raw))
    if not paths:
        return _value(rng)
    *parents, leaf = rng.choice(paths)
    node = raw
    for key in parents:
        node = node[key]
    op = rng.random()
    if op < 0.7:
        node[leaf] = _value(rng)
    elif op < 0.85 and isinstance(node, dict):
        del node[leaf]
    elif isinstance(node, dict):
        node[rng.choice(["zz", "_x", "extends"])] = _value(rng)
    return raw


def _check_config(path: Path):
    try:
        cfg = config_mod.load(path)
    except ValueError as e:
        assert FIELD_ERROR.match(str(e)), f"an error that names no field: {e}"
        return None
    # Accepted: it validates, and survives its own round trip.
    assert config_mod.from_dict(config_mod.to_dict(cfg)) == cfg
    return cfg


def test_config_fuzz(tmp_path):
    """Mutated shipped configs (values of other types, edges of numbers, fields deleted or added,
    ``extends`` pointing anywhere), whole and as the base another config extends."""
    shipped = {p.stem: json.loads(p.read_text()) for p in sorted(CONFIGS.glob("*.json"))}
    for name, raw in shipped.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(raw))
    rng = random.Random(20261207)
    accepted = 0
    for case in range(CASES):
        name = rng.choice(sorted(shipped))
        raw = json.loads(json.dumps(shipped[name]))
        for _ in range(rng.randint(1, 3)):
            raw = _mutate(rng, raw)
        if rng.random() < 0.3:  # the mutation in a base, under a config that extends it
            (tmp_path / "base.json").write_text(json.dumps(raw))
            raw = {"extends": "base", "name": "over"}
        (tmp_path / "case.json").write_text(json.dumps(raw))
        accepted += _check_config(tmp_path / "case.json") is not None
    # A harness that accepts nothing, or everything, is not exploring.
    assert 0 < accepted < CASES


@pytest.mark.parametrize("text, field", [
    ('[' * 100000 + ']' * 100000, "--config"),
    ('{"extends": "base"}', "config"),  # base.json holds a list (written below)
    ('{"extends": "../tiny"}', "extends"),
    ('{"extends": "case"}', "extends"),
    ('{"seeds": [18446744073709551616]}', "seeds[0]"),
    ('{"sample": {"seed": -9223372036854775809}}', "sample.seed"),
    ('{"train": {"lr": Infinity}}', "train.lr"),
    ('{"train": {"grad_clip": NaN}}', "train.grad_clip"),
    ('{"train": {"weight_decay": NaN}}', "train.weight_decay"),
    ('{"model": {"rope_theta": -Infinity}}', "model.rope_theta"),
    ('{"model": {"image_size": 1000000000}}', "model.image_size"),
    ('{"model": {"mlp_ratio": 0.0001}}', "model.mlp_ratio"),
    ('{"data": {"stream": -5}}', "data.stream"),
    ('{"eval": {"stream": -5}}', "eval.stream"),
    ('{"eval": {"images": 100000000000}}', "eval.images"),
    ('{"data": {"scene": {"blobs_max": 100000000000}}}', "data.scene.blobs_min/blobs_max"),
    ('{"data": {"scene": {"sigma_max": Infinity}}}', "data.scene.sigma_max"),
    ('{"throughput": {"paper_tokens_per_s": {"256": NaN}}}', "throughput.paper_tokens_per_s"),
    ('{"llsa": {"levels": 50}}', "llsa.levels"),
    ('{"llsa": {"block": 100000}}', "llsa.block"),
])
def test_config_edge_cases_name_their_field(tmp_path, text, field):
    """What the first fuzzing campaign found (each was a crash, a hang, an out-of-memory kill or
    a silent NaN run before): each is now one error naming its field."""
    (tmp_path / "base.json").write_text("[1, 2]")
    (tmp_path / "case.json").write_text(text)
    with pytest.raises(ValueError) as e:
        config_mod.load(tmp_path / "case.json")
    assert str(e.value).startswith(field + ": "), str(e.value)


def test_config_unreadable_files(tmp_path):
    (tmp_path / "latin1.json").write_bytes(b'{"name": "\xe9"}')
    (tmp_path / "folder.json").mkdir()
    for name in ("latin1.json", "folder.json", "missing.json"):
        with pytest.raises(ValueError, match=r"^--config: "):
            config_mod.load(tmp_path / name)


# ---- checkpoints and summaries -----------------------------------------------------------------

def _tiny(ema: float = 0.0):
    return config_mod.override(config_mod.load(CONFIGS / "tiny.json"), **{"train.steps": 4, "train.ema": ema,
                                                                         "eval.images": 8, "sample.images": 4})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished two-step run of the tiny config (full attention, with an EMA of the weights)."""
    cfg = config_mod.override(_tiny(ema=0.5), **{"train.steps": 2, "ba_att.densities": ()})
    run_dir = tmp_path_factory.mktemp("run")
    train_mod.train_run(cfg, "full", 0, run_dir, log=lambda _: None)
    return cfg, run_dir


def _fresh_state(cfg):
    spec = cfg.spec("full")
    model = train_mod.build_model(cfg, spec, 0, "cpu")
    return model, train_mod.make_optimizer(cfg, model), train_mod.make_ema(cfg, model)


def _byte_mutations(rng: random.Random, data: bytes) -> bytes:
    op = rng.randrange(4)
    if op == 0:  # truncated, as by a full disk or a copy cut short
        return data[:rng.randrange(len(data))]
    data = bytearray(data)
    if op == 1:  # a few bytes changed
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif op == 2:  # a zeroed range
        start = rng.randrange(len(data))
        data[start:start + rng.randint(1, 4096)] = bytes(min(len(data) - start, 4096))[:len(data[start:start + 4096])]
    else:  # random bytes of the same length
        data = bytearray(rng.randbytes(len(data)))
    return bytes(data)


@pytest.mark.filterwarnings("ignore::UserWarning")  # the unpickler's notes on the damaged bytes it reads
def test_checkpoint_fuzz(trained, tmp_path):
    """Mutated bytes of a real checkpoint: resuming from it loads what it holds, or is one
    ValueError naming the file. Flips inside the tensors' bytes load (the file has no checksum of
    its values); every other damage is refused."""
    cfg, run_dir = trained
    original = (run_dir / "checkpoint.pt").read_bytes()
    want = train_mod.fingerprint(cfg, "full", 0)
    rng = random.Random(7)
    path = tmp_path / "checkpoint.pt"
    refused = 0
    for case in range(max(CASES // 4, 20)):
        path.write_bytes(_byte_mutations(rng, original))
        model, optimizer, ema = _fresh_state(cfg)
        try:
            step, rows, _ = train_mod.resume(path, want, model, optimizer, ema)
            assert step == 2 and rows[-1]["step"] == 2
        except ValueError as e:
            assert str(e).startswith(f"{path}: "), str(e)
            refused += 1
    assert refused > 0


@pytest.mark.parametrize("content", ["not a dict", "missing key", "bool step", "negative step", "bad rows",
                                     "foreign fingerprint", "tensor fingerprint", "wrong shapes"])
def test_checkpoint_contents_that_do_not_fit(trained, tmp_path, content):
    cfg, run_dir = trained
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    if content == "not a dict":
        ckpt = [ckpt]
    elif content == "missing key":
        del ckpt["optimizer"]
    elif content == "bool step":
        ckpt["step"] = True
    elif content == "negative step":
        ckpt["step"] = -1
    elif content == "bad rows":
        ckpt["log"][-1]["heldout_loss"] = "low"
    elif content == "foreign fingerprint":
        ckpt["fingerprint"] = {"model": 1}
    elif content == "tensor fingerprint":
        ckpt["fingerprint"] = {k: torch.zeros(3) for k in ckpt["fingerprint"]}
    else:
        ckpt["model"] = {k: torch.zeros(2, 2) for k in ckpt["model"]}
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    model, optimizer, ema = _fresh_state(cfg)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'checkpoint.pt'}: ")):
        train_mod.resume(tmp_path / "checkpoint.pt", train_mod.fingerprint(cfg, "full", 0), model, optimizer, ema)


class _Payload:
    """A pickle that would create a file when unpickled: the code a hostile checkpoint carries."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (Path.touch, (self.target,))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_checkpoint_never_runs_code(trained, tmp_path):
    cfg, _ = trained
    target = tmp_path / "ran"
    for saver in (lambda p: torch.save({"model": _Payload(target)}, p),
                  lambda p: p.write_bytes(pickle.dumps(_Payload(target)))):
        saver(tmp_path / "checkpoint.pt")
        model, optimizer, ema = _fresh_state(cfg)
        with pytest.raises(ValueError, match="not a readable checkpoint"):
            train_mod.resume(tmp_path / "checkpoint.pt", train_mod.fingerprint(cfg, "full", 0), model, optimizer, ema)
        assert not target.exists()


def test_a_damaged_checkpoint_stops_the_run_and_is_kept(trained, tmp_path):
    """train_run over a run directory whose checkpoint is damaged: one error naming it, and the
    file left as it was (the user decides: --fresh, or another --out)."""
    cfg, run_dir = trained
    damaged = (run_dir / "checkpoint.pt").read_bytes()[:1000]
    (tmp_path / "checkpoint.pt").write_bytes(damaged)
    with pytest.raises(ValueError, match="pass --fresh to start over"):
        train_mod.train_run(cfg, "full", 0, tmp_path, log=lambda _: None)
    assert (tmp_path / "checkpoint.pt").read_bytes() == damaged


def test_summary_fuzz(trained, tmp_path):
    """Mutated summaries of a finished run: finished_summary returns one it can use, None (the
    run is evaluated again), or a ValueError naming the file; the table then reads what it took."""
    cfg, run_dir = trained
    original = json.loads((run_dir / "summary.json").read_text())
    assert train_mod.finished_summary(run_dir, cfg, "full", 0) == original
    (tmp_path / "checkpoint.pt").write_bytes((run_dir / "checkpoint.pt").read_bytes())
    rng = random.Random(11)
    used = refused = 0
    for case in range(CASES):
        raw = _mutate(rng, json.loads(json.dumps(original)))
        text = json.dumps(raw)
        if rng.random() < 0.2:
            text = text[:rng.randrange(len(text) + 1)]
        (tmp_path / "summary.json").write_text(text)
        try:
            summary = train_mod.finished_summary(tmp_path, cfg, "full", 0)
        except ValueError as e:
            assert str(e).startswith(f"{tmp_path / 'summary.json'}: "), str(e)
            refused += 1
            continue
        if summary is not None:
            train_mod.format_table(train_mod.results_table([summary]), cfg.model.tokens)
            used += 1
    assert used > 0 and refused > 0
