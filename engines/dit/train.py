"""Train pixel DiTs with full attention and with LLSA, evaluate them on one fixed held-out set,
sample them (the full-attention models also with BA-Att, training-free), and print the table.

    python -m engines.dit.train --config engines/dit/configs/seed.json [--seeds 0,1,2,3,4]
                                [--device cpu|cuda] [--out DIR] [--threads N] [--fresh] [--table-only]
                                [--compile]
    python -m engines.dit.train --config engines/dit/configs/dit_s_128.json --throughput [--device cuda]
                                [--compile]

Each run (attention x seed) lives in OUT/ATTENTION-seedS/: checkpoint.pt (written every
train.checkpoint_every steps and at the end; a run that finds one resumes from it), log.csv
(step, mean training loss since the last row, learning rate, training seconds, held-out loss where
evaluated), summary.json, samples.png (and samples_ba_att_*.png for full-attention runs; with
eval.reconstruct_from, samples_reconstruct_t{t0}.png of held-out images noised to t0 and
integrated back, and how many of their bars were kept, in the summary and in log.csv at each
evaluation; with sample.more_steps, samples_steps{N}.png of the same noise in N Euler steps, and
their bar counts, the same way). OUT
gets results.json, results.md (the table, and how many of each run's samples and of as many
held-out images show a bar, by bars.py) and compare.png (first seed: a row of held-out images,
then one row per attention, every row from the same starting noise). Default OUT:
out/dit/NAME.

Reproducibility: the model of seed S is initialised from torch.manual_seed(S); the images of
training step i are images [i*batch, (i+1)*batch) of stream data.stream + S, and their noise and
timesteps (train.timesteps: uniform, or logit_normal) come from a generator seeded by (S, i); so
a resumed run repeats an uninterrupted one exactly (on the same machine and thread count). The
held-out images, noise and timesteps depend on eval.stream alone: every model of every seed is
scored on the same ones.

--compile (train.compile, or throughput.compile with --throughput) runs the model's forward in
the training steps through torch.compile (compiled_forward); evaluation and sampling stay eager.
--bf16 (train.autocast_bf16) runs the training steps under bf16 autocast on CUDA, as the
throughput mode does; the weights, the optimiser, evaluation and sampling stay f32.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import io
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from . import config as config_mod
from .config import ExperimentConfig

try:
    import torch
except ModuleNotFoundError:
    raise SystemExit("engines.dit needs PyTorch (a training-time dependency): pip install torch") from None

from .attention import AttentionSpec, keys_per_query  # noqa: E402
from .bars import count_bars, has_bar  # noqa: E402
from .data import make_images  # noqa: E402
from .flow import euler_from, euler_sample, flow_loss, noise_scale, noisy, sample_times  # noqa: E402
from .model import PixelDiT  # noqa: E402
from .png import encode_png, image_grid  # noqa: E402


# ---- data, schedule, evaluation ------------------------------------------------------------

def step_generator(seed: int, step: int) -> "torch.Generator":
    """The generator of training step ``step`` of seed ``seed`` (noise and timesteps)."""
    state = np.random.SeedSequence([seed, step]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def train_batch(cfg: ExperimentConfig, seed: int, step: int):
    """(x0, eps, t) of one training step, on the CPU."""
    m, b = cfg.model, cfg.train.batch_size
    x0 = torch.from_numpy(make_images(cfg.data.stream + seed, step * b, b, m.image_size, m.channels, cfg.data.scene))
    g = step_generator(seed, step)
    t = sample_times(b, cfg.train.timesteps, g)
    eps = torch.randn(x0.shape, generator=g)
    return x0, eps, t


def heldout_set(cfg: ExperimentConfig):
    """The fixed held-out (x0, eps, t): the same for every model, seed and attention."""
    m, n = cfg.model, cfg.eval.images
    x0 = torch.from_numpy(make_images(cfg.eval.stream, 0, n, m.image_size, m.channels, cfg.data.scene))
    g = torch.Generator().manual_seed(cfg.eval.stream)
    t = torch.rand(n, generator=g)
    eps = torch.randn(x0.shape, generator=g)
    return x0, eps, t


def lr_at(cfg: ExperimentConfig, step: int) -> float:
    """Linear warm-up over train.warmup steps, then constant (the paper's schedule)."""
    warmup = cfg.train.warmup
    return cfg.train.lr * min(1.0, (step + 1) / warmup) if warmup > 0 else cfg.train.lr


@torch.no_grad()
def evaluate(model, heldout, cfg: ExperimentConfig, device) -> float:
    """Held-out flow-matching loss: the mean squared velocity error over every element."""
    x0, eps, t = heldout
    s = noise_scale(cfg.model.image_size)
    total, count = 0.0, 0
    for i in range(0, x0.shape[0], cfg.eval.batch_size):
        j = min(i + cfg.eval.batch_size, x0.shape[0])
        loss = flow_loss(model, x0[i:j].to(device), eps[i:j].to(device), t[i:j].to(device), s)
        total += float(loss) * (j - i)
        count += j - i
    return total / count


def sample_noise(cfg: ExperimentConfig):
    m = cfg.model
    g = torch.Generator().manual_seed(cfg.sample.seed)
    return torch.randn(cfg.sample.images, m.channels, m.image_size, m.image_size, generator=g)


def draw_samples(model, cfg: ExperimentConfig, device, steps: Optional[int] = None) -> np.ndarray:
    """Samples from the fixed noise of sample.seed in ``steps`` Euler steps (default sample.steps)."""
    noise = sample_noise(cfg).to(device)
    steps = cfg.sample.steps if steps is None else steps
    return euler_sample(model, noise, steps, noise_scale(cfg.model.image_size)).float().cpu().numpy()


def more_steps_samples(model, cfg: ExperimentConfig, device, run_dir: Path, suffix: str) -> List[Dict]:
    """sample.more_steps: the samples again from the same noise in each of those numbers of steps,
    written as samples_steps{N}{suffix}.npy/.png; per count, how many show a bar (bars.py)."""
    out = []
    for steps in cfg.sample.more_steps:
        images = draw_samples(model, cfg, device, steps)
        save_samples(run_dir, f"_steps{steps}{suffix}", images, cfg)
        out.append({"steps": steps, "bars": count_bars(images), "images": len(images)})
    return out


def format_more_steps(rows: List[Dict]) -> str:
    """'100 steps 3/16, 200 steps 5/16': bars drawn per number of sampling steps."""
    return ", ".join(f"{r['steps']} steps {r['bars']}/{r['images']}" for r in rows)


def save_grid(path: Path, images: np.ndarray, cfg: ExperimentConfig) -> None:
    _write_atomic(Path(path), encode_png(image_grid(images, cfg.sample.columns, upscale=cfg.sample.upscale)))


def save_samples(run_dir: Path, suffix: str, images: np.ndarray, cfg: ExperimentConfig) -> None:
    """A run's samples as samples{suffix}.npy (the values) and samples{suffix}.png (the grid)."""
    npy = io.BytesIO()
    np.save(npy, images)
    _write_atomic(run_dir / f"samples{suffix}.npy", npy.getvalue())
    save_grid(run_dir / f"samples{suffix}.png", images, cfg)


def progress_samples(model, cfg: ExperimentConfig, device, run_dir: Path, step: int) -> int:
    """Samples of ``model`` at training step ``step`` (the noise of the final samples), written
    as samples_step{step}.npy/.png in ``run_dir``; returns how many show a bar (bars.py)."""
    model.eval()
    images = draw_samples(model, cfg, device)
    save_samples(run_dir, f"_step{step}", images, cfg)
    return count_bars(images)


def bars_shown(cfg: ExperimentConfig, heldout) -> List[int]:
    """Which of the first sample.images held-out images show a bar (bars.py)."""
    return [i for i in range(cfg.sample.images) if has_bar(heldout[0][i].numpy())]


def reconstruct(model, cfg: ExperimentConfig, device, heldout, run_dir: Path, suffix: str,
                with_bar: Optional[List[int]] = None) -> List[Dict]:
    """eval.reconstruct_from: for each time t0, the first sample.images held-out images noised to
    x_t0 with their held-out noise and integrated back to 0 in round(sample.steps * t0) Euler steps
    (the sampler's step size), written as samples_reconstruct_t{t0}{suffix}.npy/.png in ``run_dir``.
    Returns per t0 how many of the originals with a bar (``with_bar``, from bars_shown unless
    given) still show one after the integration (``bars_kept``) and in the model's one-step
    estimate of the clean image, x_t0 - t0 v(x_t0, t0) (``one_step_kept``): a denoiser that keeps
    a bar it can see at t0 in one step, and loses it over the steps, points at the sampler; one
    that loses it at once cannot draw it."""
    if not cfg.eval.reconstruct_from:
        return []
    model.eval()
    n = cfg.sample.images
    x0, eps = heldout[0][:n], heldout[1][:n]
    with_bar = bars_shown(cfg, heldout) if with_bar is None else with_bar
    s = noise_scale(cfg.model.image_size)
    out = []
    for t0 in cfg.eval.reconstruct_from:
        x_t, _ = noisy(x0, eps, torch.full((n,), t0, dtype=x0.dtype), s)
        steps = max(1, round(cfg.sample.steps * t0))
        x_t = x_t.to(device)
        with torch.no_grad():
            t = torch.full((n,), t0, dtype=x_t.dtype, device=device)
            one_step = (x_t - t0 * model(x_t, t)).float().cpu().numpy()
        images = euler_from(model, x_t, t0, steps).float().cpu().numpy()
        save_samples(run_dir, f"_reconstruct_t{t0:g}{suffix}", images, cfg)
        out.append({"t0": t0, "bars_kept": sum(has_bar(images[i]) for i in with_bar),
                    "one_step_kept": sum(has_bar(one_step[i]) for i in with_bar), "bars_shown": len(with_bar)})
    return out


def format_reconstruct(rows: List[Dict]) -> str:
    """'t0.5 7/9 (one step 5/9) t0.9 1/9 (one step 0/9)': bars kept of the bars shown, per time,
    after the integration and in the one-step estimate."""
    return " ".join(f"t{r['t0']:g} {r['bars_kept']}/{r['bars_shown']} (one step {r['one_step_kept']}/{r['bars_shown']})"
                    for r in rows)


# ---- one run ---------------------------------------------------------------------------------

LOG_FIELDS = ["step", "train_loss", "lr", "train_seconds", "heldout_loss", "sample_bars", "reconstruct_bars",
              "more_steps_bars"]


def fingerprint(cfg: ExperimentConfig, kind: str, seed: int) -> Dict:
    """What a checkpoint must agree with to be resumed (not the step count or the intervals)."""
    d = config_mod.to_dict(cfg)
    # compile changes how the forward runs, not what it computes: a run may resume either way.
    skip = ("steps", "log_every", "eval_every", "checkpoint_every", "compile")
    train = {k: v for k, v in d["train"].items() if k not in skip}
    return {"model": d["model"], "attention": kind, "llsa": d["llsa"] if kind == "llsa" else None,
            "train": train, "data": d["data"], "seed": seed}


def _write_atomic(path: Path, data) -> None:
    """``data`` (str, UTF-8, or bytes) into ``path`` by a temporary file and a rename. Every file
    a run writes goes this way, so an interrupted write leaves the previous file whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    os.replace(tmp, path)


def _save_atomic(obj, path: Path) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    _write_atomic(path, buffer.getvalue())


CHECKPOINT_KEYS = {"fingerprint": dict, "step": int, "model": dict, "optimizer": dict, "log": list,
                   "train_seconds": (int, float)}


def _unusable(path: Path, why: str) -> ValueError:
    return ValueError(f"{path}: {why}; pass --fresh to start over (the file is replaced at the next checkpoint) "
                      f"or --out for another directory")


def load_checkpoint(path: Path, device="cpu") -> Dict:
    """A run's checkpoint, read as data only (``weights_only``: tensors, numbers, strings, lists
    and dicts, never code from the file), or a ValueError naming the file and what is wrong."""
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # a truncated or foreign file fails in the zip, pickle or tensor reader
        raise _unusable(path, f"not a readable checkpoint ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(ckpt, dict):
        raise _unusable(path, f"not a checkpoint of this trainer (it holds a {type(ckpt).__name__})")
    for key, kind in CHECKPOINT_KEYS.items():
        if not isinstance(ckpt.get(key), kind) or isinstance(ckpt.get(key), bool):
            raise _unusable(path, f"not a checkpoint of this trainer ({key!r} is missing or a "
                                  f"{type(ckpt.get(key)).__name__})")
    return ckpt


def _log_row(row) -> bool:
    """Whether ``row`` has the shape of the rows train_run logs (the numbers it formats later)."""
    def number_or_none(v):
        return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))

    return (isinstance(row, dict) and set(row) <= set(LOG_FIELDS) and type(row.get("step")) is int
            and all(number_or_none(row.get(k)) for k in ("train_loss", "lr", "train_seconds", "heldout_loss"))
            and (row.get("sample_bars") is None or type(row.get("sample_bars")) is int)
            and all(row.get(k) is None or isinstance(row.get(k), str) for k in ("reconstruct_bars", "more_steps_bars")))


def resume(path: Path, want: Dict, model, optimizer, ema, device="cpu"):
    """Load the checkpoint at ``path`` into the model, its optimiser and EMA; (step, log rows,
    training seconds). A checkpoint of another configuration (``want``: train.py's fingerprint),
    or one whose contents do not fit, is a ValueError naming the file; nothing is half loaded
    that the caller goes on with."""
    ckpt = load_checkpoint(path, device)
    try:
        diff = [k for k in want if ckpt["fingerprint"].get(k) != want[k]]
    except Exception:  # a fingerprint holding tensors cannot be compared: it is not one of ours
        diff = list(want)
    if diff or len(ckpt["fingerprint"]) != len(want):
        raise _unusable(path, f"written for a different configuration ({', '.join(diff) or 'its fields'} differ)")
    rows = ckpt["log"]
    if ckpt["step"] < 0 or not rows or not all(_log_row(r) for r in rows):
        raise _unusable(path, "its step or its log rows are malformed")
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if ema is not None:
            ema.load_state_dict(ckpt["ema"])
    except Exception as e:  # torch raises a different type for each way a state can fail to fit
        raise _unusable(path, f"its weights do not fit this model ({type(e).__name__}: {str(e)[:200]})") from None
    return ckpt["step"], rows, ckpt["train_seconds"]


def _write_log(path: Path, rows: List[Dict]) -> None:
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=LOG_FIELDS)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in LOG_FIELDS})
    _write_atomic(path, text.getvalue())


def compiled_forward(model: "PixelDiT") -> Callable:
    """``model``'s forward through torch.compile (inductor): fullgraph, so a graph break is an
    error rather than a silent return to eager (sparsa's ops trace as single nodes: their fake
    kernels give the shapes); dynamic=False, one graph per input shape (a training run has one).
    The parameters stay the model's own: the optimiser takes model.parameters() and the checkpoint
    model.state_dict(), with no ``_orig_mod.`` prefix, loadable compiled or not."""
    return torch.compile(model, fullgraph=True, dynamic=False)


@contextlib.contextmanager
def compile_errors_named(option: str, compiled: bool):
    """In a compiled step, a torch.compile failure (tracing, or inductor's code generation in the
    forward or the lazily compiled backward) as an error naming the option that asked for it."""
    if not compiled:
        yield
        return
    try:
        yield
    except torch._dynamo.exc.TorchDynamoException as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"{option} (--compile): torch.compile could not compile the model: {first}; run "
                           f"without --compile") from e


def build_model(cfg: ExperimentConfig, spec: AttentionSpec, seed: int, device) -> "PixelDiT":
    torch.manual_seed(seed)
    model = PixelDiT(cfg.model)
    model.set_attention(spec)
    return model.to(device)


def make_optimizer(cfg: ExperimentConfig, model):
    return torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.999),
                             weight_decay=cfg.train.weight_decay)


def make_ema(cfg: ExperimentConfig, model) -> Optional["PixelDiT"]:
    """With train.ema: a copy of ``model`` that follows its weights as an exponential moving
    average (update_ema after every step); None without."""
    if not cfg.train.ema:
        return None
    ema = copy.deepcopy(model)
    ema.requires_grad_(False)
    return ema


def ema_decay(decay: float, step: int) -> float:
    """The decay after ``step`` steps: ``decay``, or less early on, (1 + step) / (10 + step), so
    that the initial weights do not linger in the average (their share after n steps is the
    product of the decays: 0.999^n alone would leave 13% of them after 2000 steps)."""
    return min(decay, (1.0 + step) / (10.0 + step))


@torch.no_grad()
def update_ema(ema, model, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * model for every parameter, in one fused call per step
    (the step's hot path: a kernel per tensor would be ~100 launches); buffers are copied."""
    torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1.0 - decay)
    for a, b in zip(ema.buffers(), model.buffers()):
        a.copy_(b)


def train_step(cfg: ExperimentConfig, model, forward, optimizer, batch, lr: float) -> float:
    """One training step on ``batch`` (x0, eps, t, on the model's device): the flow loss of
    ``forward`` (the model, or compiled_forward(model)), backward, gradient clipping, AdamW at
    learning rate ``lr``. Returns the loss; float() waits for the device."""
    x0, eps, t = batch
    for group in optimizer.param_groups:
        group["lr"] = lr
    amp = cfg.train.autocast_bf16 and x0.device.type == "cuda"
    with compile_errors_named("train.compile", forward is not model), \
            torch.autocast(x0.device.type, dtype=torch.bfloat16, enabled=amp):
        loss = flow_loss(forward, x0, eps, t, noise_scale(cfg.model.image_size))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
    if cfg.train.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
    optimizer.step()
    return float(loss.detach())


def train_run(cfg: ExperimentConfig, kind: str, seed: int, run_dir: Path, device="cpu", num_threads: int = 0,
              stop_after: Optional[int] = None, fresh: bool = False, heldout=None,
              log: Callable[[str], None] = print) -> Dict:
    """Train (or resume) one model; returns its summary. ``stop_after``: train up to that step
    this time, checkpoint and return (the run resumes from there next time)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path, log_path = run_dir / "checkpoint.pt", run_dir / "log.csv"
    spec = cfg.spec(kind, num_threads)
    model = build_model(cfg, spec, seed, device)
    optimizer = make_optimizer(cfg, model)
    ema = make_ema(cfg, model)
    scored = ema if ema is not None else model  # what is evaluated and sampled
    heldout = heldout if heldout is not None else heldout_set(cfg)
    with_bar = bars_shown(cfg, heldout) if cfg.eval.reconstruct_from else []  # scored once, not per evaluation
    tag = f"[{kind} seed {seed}]"
    want = fingerprint(cfg, kind, seed)

    step, rows, train_seconds = 0, [], 0.0
    if ckpt_path.exists() and not fresh:
        step, rows, train_seconds = resume(ckpt_path, want, model, optimizer, ema, device)
        log(f"{tag} resuming from step {step} ({ckpt_path})")

    def checkpoint():
        _save_atomic({"fingerprint": want, "step": step, "model": model.state_dict(),
                      "optimizer": optimizer.state_dict(), "log": rows, "train_seconds": train_seconds,
                      **({"ema": ema.state_dict()} if ema is not None else {})}, ckpt_path)
        _write_log(log_path, rows)

    steps = cfg.train.steps
    target = steps if stop_after is None else min(steps, stop_after)
    # Held-out evaluation and sampling run the eager model: no_grad and other batch sizes would
    # each be another graph to compile, for a few calls.
    forward = compiled_forward(model) if cfg.train.compile else model
    if step == 0 and not rows:
        rows.append({"step": 0, "train_loss": None, "lr": None, "train_seconds": 0.0,
                     "heldout_loss": evaluate(scored, heldout, cfg, device)})
        log(f"{tag} step 0/{steps}  held-out {rows[-1]['heldout_loss']:.4f}")
    model.train()
    window, session_steps = [], 0
    session_seconds = 0.0
    if cfg.train.compile and step < target:
        log(f"{tag} training steps under torch.compile (--compile); the first step compiles the model")
    if cfg.train.autocast_bf16 and step < target:
        log(f"{tag} training steps under bf16 autocast (--bf16)" if torch.device(device).type == "cuda" else
            f"{tag} train.autocast_bf16 applies on CUDA only: training in f32 on {device}")
    while step < target:
        x0, eps, t = train_batch(cfg, seed, step)
        started = time.perf_counter()
        lr = lr_at(cfg, step)
        # train_step's float() waits for the device, so the time below is the step's.
        window.append(train_step(cfg, model, forward, optimizer, (x0.to(device), eps.to(device), t.to(device)), lr))
        if ema is not None:
            update_ema(ema, model, ema_decay(cfg.train.ema, step))
        elapsed = time.perf_counter() - started
        train_seconds += elapsed
        session_seconds += elapsed
        session_steps += 1
        step += 1
        at_eval = step == steps or (cfg.train.eval_every and step % cfg.train.eval_every == 0)
        if step == target or at_eval or (cfg.train.log_every and step % cfg.train.log_every == 0):
            heldout_loss = evaluate(scored, heldout, cfg, device) if at_eval else None
            # A mid-run evaluation also samples (the final samples come after the loop), so a
            # run cut short still shows what its model draws, and its bar count over time.
            bars = progress_samples(scored, cfg, device, run_dir, step) if at_eval and step < steps else None
            kept = (format_reconstruct(reconstruct(scored, cfg, device, heldout, run_dir, f"_step{step}", with_bar))
                    if bars is not None and cfg.eval.reconstruct_from else None)
            finer = (format_more_steps(more_steps_samples(scored, cfg, device, run_dir, f"_step{step}"))
                     if bars is not None and cfg.sample.more_steps else None)
            model.train()
            rows.append({"step": step, "train_loss": sum(window) / len(window), "lr": lr,
                         "train_seconds": round(train_seconds, 3), "heldout_loss": heldout_loss,
                         "sample_bars": bars, "reconstruct_bars": kept, "more_steps_bars": finer})
            rate = session_seconds / session_steps
            eta = rate * (target - step)
            extra = f"  held-out {heldout_loss:.4f}" if heldout_loss is not None else ""
            extra += f"  bars {bars}/{cfg.sample.images}" if bars is not None else ""
            extra += f"  bars kept from {kept}" if kept else ""
            extra += f"  bars with {finer}" if finer else ""
            log(f"{tag} step {step}/{steps}  loss {rows[-1]['train_loss']:.4f}  lr {lr:.2e}  "
                f"{rate:.3f} s/step  eta {eta / 60:.1f} min{extra}")
            window = []
            _write_log(log_path, rows)
        if step == target or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
            checkpoint()

    summary = {"attention": kind, "label": spec.label(), "seed": seed, "step": step, "steps": steps,
               "finished": step >= steps, "compiled": cfg.train.compile,
               "autocast_bf16": cfg.train.autocast_bf16 and torch.device(device).type == "cuda",
               "train_seconds": round(train_seconds, 3),
               "seconds_per_step": round(train_seconds / step, 5) if step else None,
               "keys_per_query": keys_per_query(cfg.model.tokens, spec),
               "parameters": sum(p.numel() for p in model.parameters()),
               "ema": cfg.train.ema,
               "heldout_loss": rows[-1]["heldout_loss"] if rows[-1]["heldout_loss"] is not None
               else evaluate(scored, heldout, cfg, device)}
    if not summary["finished"]:
        _write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        log(f"{tag} stopped at step {step} (checkpointed; run again to resume)")
        return summary

    model.eval()
    samples = {"": draw_samples(scored, cfg, device)}
    summary["reconstruct"] = reconstruct(scored, cfg, device, heldout, run_dir, "", with_bar)
    if summary["reconstruct"]:
        log(f"{tag} held-out images with a bar, noised and reconstructed, bars kept from "
            f"{format_reconstruct(summary['reconstruct'])}")
    summary["more_steps"] = more_steps_samples(scored, cfg, device, run_dir, "")
    if summary["more_steps"]:
        log(f"{tag} samples with a bar, from the same noise in more steps: {format_more_steps(summary['more_steps'])}")
    if kind == "full":
        summary["ba_att"] = []
        for sort in cfg.ba_att.sort:
            for density in cfg.ba_att.densities:
                ba_spec = cfg.spec("ba_att", num_threads, density=density, sort=sort)
                scored.set_attention(ba_spec)
                loss = evaluate(scored, heldout, cfg, device)
                name = ba_att_suffix(density, sort)
                samples[name] = draw_samples(scored, cfg, device)
                summary["ba_att"].append({"density": density, "sort": sort, "label": ba_spec.label(),
                                          "keys_per_query": keys_per_query(cfg.model.tokens, ba_spec),
                                          "heldout_loss": loss, "samples": f"samples{name}.png"})
                log(f"{tag} sampled with {ba_spec.label()}: held-out {loss:.4f}")
        scored.set_attention(spec)
    for name, images in samples.items():
        save_samples(run_dir, name, images, cfg)
    _write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    log(f"{tag} done: held-out {summary['heldout_loss']:.4f}, {summary['seconds_per_step']} s/step"
        f"{' (compiled, the first step compiling)' if cfg.train.compile else ''}")
    return summary


SUMMARY_KEYS = {"label": str, "attention": str, "seed": int, "steps": int, "keys_per_query": (int, float),
                "heldout_loss": (int, float), "seconds_per_step": (int, float, type(None)), "compiled": bool}
BA_ATT_SUMMARY_KEYS = {"label": str, "density": (int, float), "sort": bool, "keys_per_query": (int, float),
                       "heldout_loss": (int, float)}


def _read_summary(path: Path) -> Dict:
    """A finished run's summary.json, or a ValueError naming the file: the table and the bar
    counts read these fields, so a summary without them is refused rather than half used."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"{path}: {why}; delete it to have the run evaluated again from its checkpoint")

    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise refuse(f"not a readable summary ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(summary, dict):
        raise refuse(f"not a summary of this trainer (it holds a JSON {type(summary).__name__})")
    if not summary.get("finished"):
        return summary
    records = [("", summary, SUMMARY_KEYS)]
    if not isinstance(summary.get("ba_att", []), list):
        raise refuse("its 'ba_att' is not a list")
    records += [(f"ba_att[{i}].", b, BA_ATT_SUMMARY_KEYS) for i, b in enumerate(summary.get("ba_att", []))]
    for prefix, record, keys in records:
        if not isinstance(record, dict):
            raise refuse(f"its {prefix[:-1]} is not an object")
        for key, kind in keys.items():
            value = record.get(key, False) if key == "compiled" else record.get(key)  # older runs lack it
            if (key not in record and key != "compiled") or not isinstance(value, kind) or \
                    (isinstance(value, bool) and kind is not bool):
                raise refuse(f"its {prefix}{key!r} is missing or a {type(value).__name__}")
    return summary


def finished_summary(run_dir: Path, cfg: ExperimentConfig, kind: str, seed: int) -> Optional[Dict]:
    """The summary of a run that already finished with this configuration, else None."""
    path, ckpt_path = run_dir / "summary.json", run_dir / "checkpoint.pt"
    if not (path.exists() and ckpt_path.exists()):
        return None
    summary = _read_summary(path)
    if (not summary.get("finished") or summary.get("steps") != cfg.train.steps or summary.get("attention") != kind
            or summary.get("seed") != seed):
        return None
    if kind == "full":
        want = [(d, s) for s in cfg.ba_att.sort for d in cfg.ba_att.densities]
        if [(b["density"], b["sort"]) for b in summary.get("ba_att", [])] != want:
            return None
    return summary if load_checkpoint(ckpt_path)["fingerprint"] == fingerprint(cfg, kind, seed) else None


# ---- the experiment ----------------------------------------------------------------------------

def _mean_std(values: Sequence[float]):
    values = list(values)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
    return mean, std


def results_table(summaries: List[Dict]) -> List[Dict]:
    """One row per attention (and per BA-Att variant): held-out loss over seeds."""
    groups: Dict[str, Dict] = {}

    def add(label, kind, keys, loss, seed, sps, compiled):
        g = groups.setdefault(label, {"attention": label, "kind": kind, "keys_per_query": keys, "losses": [],
                                      "seeds": [], "seconds_per_step": [], "compiled": []})
        g["losses"].append(loss)
        g["seeds"].append(seed)
        if sps is not None:
            g["seconds_per_step"].append(sps)
            g["compiled"].append(compiled)

    for s in summaries:
        if not s.get("finished"):
            continue
        add(s["label"], s["attention"], s["keys_per_query"], s["heldout_loss"], s["seed"], s["seconds_per_step"],
            s.get("compiled", False))  # summaries written before train.compile existed ran eager
    for s in summaries:  # BA-Att rows after the trained ones
        for b in s.get("ba_att", []) if s.get("finished") else []:
            add(f"full, sampled with {b['label']}", "ba_att", b["keys_per_query"], b["heldout_loss"], s["seed"], None,
                False)
    rows = []
    for g in groups.values():
        g["mean"], g["std"] = _mean_std(g["losses"])
        g["seconds_per_step"] = (sum(g["seconds_per_step"]) / len(g["seconds_per_step"])
                                 if g["seconds_per_step"] else None)
        rows.append(g)
    return rows


def format_table(rows: List[Dict], tokens: int) -> str:
    lines = ["| attention | keys per query | seeds | held-out loss, mean | std over seeds | per seed | s/step |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        keys = f"{r['keys_per_query']:g} of {tokens}" if r["keys_per_query"] is not None else "?"
        std = f"{r['std']:.4f}" if r["std"] is not None else "n/a (1 seed)"
        per_seed = ", ".join(f"{loss:.4f}" for loss in r["losses"])
        sps = f"{r['seconds_per_step']:.3f}" if r["seconds_per_step"] is not None else ""
        runs, compiled = len(r["compiled"]), sum(r["compiled"])
        if compiled:  # --compile: these seconds include the first step's compilation
            sps += " compiled" if compiled == runs else f" ({compiled} of {runs} runs compiled)"
        lines.append(f"| {r['attention']} | {keys} | {len(r['losses'])} | {r['mean']:.4f} | {std} | {per_seed} | {sps} |")
    return "\n".join(lines)


def compare_grid(out: Path, cfg: ExperimentConfig, seed: int, kinds: Sequence[str], heldout) -> Optional[Path]:
    """Held-out images on the first row, then the first row of samples of each model of ``seed``."""
    cols = cfg.sample.columns
    rows, legend = [heldout[0][:cols].numpy()], ["held-out images"]
    for kind in kinds:
        run_dir = out / f"{kind}-seed{seed}"
        names = [""] + ([ba_att_suffix(d, s) for s in cfg.ba_att.sort
                         for d in cfg.ba_att.densities] if kind == "full" else [])
        for name in names:
            path = run_dir / f"samples{name}.npy"
            if path.exists():
                rows.append(np.load(path)[:cols])
                legend.append(f"{kind}{name.replace('_', ' ')}")
    if len(rows) == 1:
        return None
    path = out / "compare.png"
    save_grid(path, np.concatenate(rows), cfg)
    _write_atomic(out / "compare.txt", "rows of compare.png, top to bottom:\n" +
                  "\n".join(f"{i + 1}. {name}" for i, name in enumerate(legend)) + "\n")
    return path


def ba_att_suffix(density: float, sort: bool) -> str:
    """The file-name suffix of a full run's samples drawn with BA-Att (samples{suffix}.npy/.png)."""
    return f"_ba_att_d{density:g}" + ("" if sort else "_unsorted")


def bars_drawn(out: Path, cfg: ExperimentConfig, summaries: List[Dict], heldout) -> Dict[str, List[int]]:
    """Images with a bar (bars.py) among the first sample.images held-out images and among each
    finished run's samples (the BA-Att samplings of full runs too): name -> [with a bar, images]."""
    n = cfg.sample.images
    counts = {"held-out": [count_bars(heldout[0][:n].numpy()), min(n, len(heldout[0]))]}
    for s in summaries:
        if not s.get("finished"):
            continue
        run_dir = out / f"{s['attention']}-seed{s['seed']}"
        names = [("", s["label"])] + [(ba_att_suffix(b["density"], b["sort"]), f"full, sampled with {b['label']}")
                                      for b in s.get("ba_att", [])]
        for suffix, label in names:
            path = run_dir / f"samples{suffix}.npy"
            if path.exists():
                images = np.load(path)
                counts[f"{label} (seed {s['seed']})"] = [count_bars(images), len(images)]
    return counts


def format_bars(counts: Dict[str, List[int]]) -> str:
    return ("Images with a bar (engines/dit/bars.py): " +
            "; ".join(f"{name}: {k} of {n}" for name, (k, n) in counts.items()) + ".")


def run_experiment(cfg: ExperimentConfig, seeds: Sequence[int], out: Path, device="cpu", num_threads: int = 0,
                   fresh: bool = False, stop_after: Optional[int] = None, table_only: bool = False,
                   log: Callable[[str], None] = print) -> Dict:
    """Train every (attention, seed) run that is not finished, then write and print the table.
    ``table_only``: train nothing; the table of the runs under ``out`` that have finished."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    heldout = heldout_set(cfg)
    summaries = []
    started = time.time()
    for kind in cfg.attention:
        for seed in seeds:
            run_dir = out / f"{kind}-seed{seed}"
            done = None if fresh else finished_summary(run_dir, cfg, kind, seed)
            if done is not None:
                log(f"[{kind} seed {seed}] already finished ({run_dir}): held-out {done['heldout_loss']:.4f}")
                summaries.append(done)
                continue
            if table_only:
                log(f"[{kind} seed {seed}] not finished under {run_dir}: left out of the table")
                continue
            summaries.append(train_run(cfg, kind, seed, run_dir, device, num_threads, stop_after=stop_after,
                                       fresh=fresh, heldout=heldout, log=log))
    rows = results_table(summaries)
    table = format_table(rows, cfg.model.tokens)
    finished_seeds = [s["seed"] for s in summaries if s.get("finished")]
    grid = compare_grid(out, cfg, finished_seeds[0], cfg.attention, heldout) if finished_seeds else None
    bars = bars_drawn(out, cfg, summaries, heldout)
    result = {"config": config_mod.to_dict(cfg), "seeds": list(seeds), "device": str(device),
              "num_threads": num_threads, "wall_seconds": round(time.time() - started, 1), "runs": summaries,
              "table": rows, "bars": bars}
    _write_atomic(out / "results.json", json.dumps(result, indent=2) + "\n")
    how = "".join([f", {cfg.train.steps} steps",
                   ", training steps under bf16 autocast" if any(s.get("autocast_bf16") for s in summaries) else "",
                   f", EMA weights (decay {cfg.train.ema:g}) scored and sampled" if cfg.train.ema else ""])
    _write_atomic(out / "results.md", f"# {cfg.name}\n\n{cfg.description}\n\nHeld-out flow-matching loss{how}.\n\n"
                  f"{table}\n\n{format_bars(bars)}\n")
    log(f"\n{cfg.name}: held-out flow-matching loss ({len(heldout[0])} held-out images, same noise and "
        f"timesteps for every model){how}\n{table}\n{format_bars(bars)}")
    if grid is not None:
        log(f"samples side by side: {grid} (rows: {out / 'compare.txt'})")
    return result


# ---- throughput ---------------------------------------------------------------------------------

def sdpa_backend(device: torch.device) -> Callable:
    """A context for SDPA's kernel choice: on CUDA, cuDNN's kernel first (the issue's and the
    paper's peer), then flash, then the others; elsewhere torch's default."""
    if device.type != "cuda":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]
    return lambda: sdpa_kernel(order, set_priority=True)


def throughput(cfg: ExperimentConfig, device="cpu", num_threads: int = 0, batch_size: Optional[int] = None,
               steps: Optional[int] = None, out: Optional[Path] = None, log: Callable[[str], None] = print) -> Dict:
    """Training throughput in pixel tokens/s (forward, backward and optimiser step) per attention:
    the median wall time of ``steps`` steps after ``warmup``, and the median process CPU time (all
    threads; on a shared machine the measure of the work). With throughput.compile (--compile) the
    model's forward runs compiled; it compiles in the first warm-up step."""
    tp = cfg.throughput
    batch = batch_size or tp.batch_size
    steps = steps or tp.steps
    device = torch.device(device)
    use_amp = tp.autocast_bf16 and device.type == "cuda"
    m = cfg.model
    x0 = torch.from_numpy(make_images(cfg.data.stream, 0, batch, m.image_size, m.channels, cfg.data.scene)).to(device)
    s = noise_scale(m.image_size)
    rows = []
    backend = sdpa_backend(device)
    for kind in cfg.attention:
        spec = cfg.spec(kind, num_threads)
        model = build_model(cfg, spec, 0, device)
        optimizer = make_optimizer(cfg, model)
        forward = compiled_forward(model) if tp.compile else model
        times, cpu_times = [], []
        for i in range(tp.warmup + steps):
            g = step_generator(0, i)
            t = torch.rand(batch, generator=g).to(device)
            eps = torch.randn(x0.shape, generator=g).to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started, cpu_started = time.perf_counter(), time.process_time()
            with backend(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp), \
                    compile_errors_named("throughput.compile", tp.compile):
                loss = flow_loss(forward, x0, eps, t, s)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            if i >= tp.warmup:
                times.append(elapsed)
                cpu_times.append(cpu)
            log(f"[throughput {kind}] step {i + 1}/{tp.warmup + steps} {'(warm-up) ' if i < tp.warmup else ''}"
                f"{elapsed:.3f} s (process CPU {cpu:.3f} s)")
        median = sorted(times)[len(times) // 2]
        rows.append({"attention": spec.label(), "kind": kind, "compiled": tp.compile, "batch": batch, "tokens": m.tokens,
                     "seconds_per_step": median, "tokens_per_s": batch * m.tokens / median,
                     "cpu_seconds_per_step": sorted(cpu_times)[len(cpu_times) // 2],
                     "keys_per_query": keys_per_query(m.tokens, spec),
                     "paper_tokens_per_s": tp.paper_tokens_per_s.get(kind)})
        del model, optimizer, forward
    full = next((r for r in rows if r["kind"] == "full"), None)
    lines = [f"{cfg.name}: training throughput, {m.image_size}x{m.image_size} pixels ({m.tokens} tokens), "
             f"depth {m.depth}, width {m.width}, {m.heads} heads, batch {batch}, {device}"
             f"{', bf16 autocast' if use_amp else ''}, {'compiled (--compile)' if tp.compile else 'eager'}, "
             f"median of {steps} steps after {tp.warmup} warm-up",
             "| attention | keys per query | s/step | process CPU s/step | pixel tokens/s | vs full | paper (one H200) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}x" if full else ""
        paper = f"{r['paper_tokens_per_s'] / 1e3:.1f}K" if r["paper_tokens_per_s"] else ""
        lines.append(f"| {r['attention']} | {r['keys_per_query']:g} | {r['seconds_per_step']:.3f} | "
                     f"{r['cpu_seconds_per_step']:.3f} | {r['tokens_per_s'] / 1e3:.1f}K | {ratio} | {paper} |")
    if tp.compile:
        lines.append("Compiled: the model's forward under torch.compile (inductor, one graph; sparsa's LLSA one node "
                     "in it), compiled in the first warm-up step; loss and optimiser step eager.")
    if device.type == "cuda":
        lines.append("Full attention is torch SDPA with cuDNN's kernel first (then flash, then the others).")
        if any(r["kind"] == "llsa" for r in rows) and m.width // m.heads not in (64, 128):
            lines.append("LLSA ran through sparsa's CPU op (q, k, v to the host and back; its device kernels take "
                         "head_dim 64 or 128): this row measures that path, not a GPU kernel.")
    table = "\n".join(lines)
    log("\n" + table)
    result = {"config": cfg.name, "device": str(device), "compiled": tp.compile, "rows": rows, "table": table}
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        _write_atomic(Path(out) / "throughput.json", json.dumps(result, indent=2) + "\n")
    return result


# ---- command line -------------------------------------------------------------------------------

def _parse_seeds(text: str) -> List[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds: expected comma-separated integers such as 0,1,2, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds):
        raise SystemExit(f"--seeds: expected non-negative integers, got {text!r}")
    return seeds


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.dit.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="engines/dit/configs/NAME.json")
    parser.add_argument("--seeds", help="comma-separated seeds (default: the config's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N); LLSA and BA-Att run on the host")
    parser.add_argument("--out", help="output directory (default out/dit/NAME)")
    parser.add_argument("--threads", type=int, default=0, help="torch and sparsa CPU threads (0: their defaults)")
    parser.add_argument("--attention", help="comma-separated subset of the config's attentions (full,llsa)")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--stop-after", type=int, help="train each run up to this step, checkpoint, stop")
    parser.add_argument("--fresh", action="store_true", help="ignore existing checkpoints and start over")
    parser.add_argument("--table-only", action="store_true",
                        help="train nothing: the table of the runs under --out that have finished")
    parser.add_argument("--compile", action="store_true",
                        help="the model's forward under torch.compile in the training steps (turns on train.compile, "
                             "or throughput.compile with --throughput)")
    parser.add_argument("--bf16", action="store_true",
                        help="the training steps under bf16 autocast on CUDA (turns on train.autocast_bf16; "
                             "evaluation and sampling stay f32)")
    parser.add_argument("--throughput", action="store_true", help="measure training pixel tokens/s instead")
    parser.add_argument("--batch", type=int, help="--throughput: override throughput.batch_size")
    parser.add_argument("--throughput-steps", type=int, help="--throughput: override throughput.steps")
    args = parser.parse_args(argv)

    try:
        cfg = config_mod.load(args.config)
        changes = {}
        if args.steps is not None:
            changes["train.steps"] = args.steps
        if args.attention:
            changes["attention"] = [a.strip() for a in args.attention.split(",") if a.strip()]
        if args.compile:
            changes["throughput.compile" if args.throughput else "train.compile"] = True
        if args.bf16:
            if args.throughput:
                raise ValueError("--bf16: throughput mode runs under throughput.autocast_bf16 (on by default)")
            changes["train.autocast_bf16"] = True
        if changes:
            cfg = config_mod.override(cfg, **changes)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.threads < 0:
        raise SystemExit(f"--threads: expected a non-negative thread count, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device: {device} asked for, but torch sees no CUDA device")
    if not (device == "cpu" or device.startswith("cuda")):
        raise SystemExit(f"--device: expected cpu or cuda, got {device!r}")
    out = Path(args.out) if args.out else Path("out") / "dit" / cfg.name
    seeds = _parse_seeds(args.seeds) if args.seeds else list(cfg.seeds)
    if args.stop_after is not None and args.stop_after < 1:
        raise SystemExit(f"--stop-after: expected a positive step, got {args.stop_after}")

    def log(message: str) -> None:
        print(message, flush=True)

    log(f"{cfg.name}: {cfg.description}")
    log(f"device {device}, torch threads {torch.get_num_threads()}, sparsa threads {args.threads or 'auto'}, "
        f"out {out}")
    if args.throughput:
        throughput(cfg, device, args.threads, args.batch, args.throughput_steps, out, log)
    else:
        run_experiment(cfg, seeds, out, device, args.threads, args.fresh, args.stop_after, args.table_only, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
