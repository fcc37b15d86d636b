"""Experiment configuration: one JSON file per experiment (engines/dit/configs/NAME.json).

Sections and defaults are the dataclasses below; a field that is unknown or of the wrong type is
refused with its dotted name (``train.lr: expected a number, got 'fast'``).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Tuple

from .attention import AttentionSpec, keys_per_query
from .data import SceneParams
from .model import DiTConfig

INT64_LIMIT = 2 ** 63
# The held-out set (images and their noise, float32) is made whole before training starts.
HELDOUT_BYTES_LIMIT = 8 << 30
MAX_SAMPLE_STEPS = 4096  # each step is a forward pass over every sample


@dataclass(frozen=True)
class LlsaSection:
    block: int = 16
    topk: int = 8
    levels: int = -1
    dedupe: bool = False


@dataclass(frozen=True)
class BaAttSection:
    """BA-Att variants evaluated on every trained full-attention model (training-free): each
    density in ``densities`` with each of ``sort`` (norm-sorted Q/K as in the paper; False: the
    layout's own blocks)."""

    block: int = 64
    densities: Tuple[float, ...] = (0.5, 0.3)
    sort: Tuple[bool, ...] = (True,)


@dataclass(frozen=True)
class TrainSection:
    steps: int = 2000
    batch_size: int = 16
    lr: float = 1e-3
    warmup: int = 100  # linear warm-up steps, then constant
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global gradient norm (0: off)
    log_every: int = 50
    eval_every: int = 500  # held-out loss during training (0: only at the start and the end)
    checkpoint_every: int = 500
    compile: bool = False  # the model's forward under torch.compile (train.py: compiled_forward)
    autocast_bf16: bool = False  # on CUDA only: the training steps under bf16 autocast (evaluation stays f32)
    ema: float = 0.0  # decay of an exponential moving average of the weights (lower in the first steps:
    #                   train.py's ema_decay), which is then evaluated and sampled (0: off, the trained weights)
    timesteps: str = "uniform"  # the training times: uniform (the seed's) or logit_normal (flow.sample_times)


@dataclass(frozen=True)
class DataSection:
    stream: int = 1000  # training images of seed S come from stream `stream + S`
    scene: SceneParams = SceneParams()


@dataclass(frozen=True)
class EvalSection:
    images: int = 256
    batch_size: int = 64
    stream: int = 7  # held-out images; their noise and timesteps come from the same number
    # At every evaluation that samples: the first sample.images held-out images noised to each of
    # these times with their held-out noise, integrated back to 0 (flow.euler_from) and counted
    # for bars against the originals' bars: whether a model can finish a bar it is shown, apart
    # from whether it starts one from pure noise. Empty: none.
    reconstruct_from: Tuple[float, ...] = ()


@dataclass(frozen=True)
class SampleSection:
    images: int = 16
    steps: int = 25
    seed: int = 4242
    columns: int = 8
    upscale: int = 2
    # At every evaluation that samples: the same noise integrated again in each of these numbers of
    # Euler steps, and counted for bars: whether a finer sampler draws what the default one loses
    # (thin structures are the first to blur). Empty: none.
    more_steps: Tuple[int, ...] = ()


@dataclass(frozen=True)
class ThroughputSection:
    batch_size: int = 16
    steps: int = 3
    warmup: int = 1
    autocast_bf16: bool = True  # on CUDA only: bf16 autocast, as the paper trains
    compile: bool = False  # the model's forward under torch.compile; it compiles in the warm-up steps
    paper_tokens_per_s: Dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ExperimentConfig:
    name: str = "experiment"
    description: str = ""
    model: DiTConfig = DiTConfig()
    attention: Tuple[str, ...] = ("full", "llsa")
    llsa: LlsaSection = LlsaSection()
    ba_att: BaAttSection = BaAttSection()
    train: TrainSection = TrainSection()
    data: DataSection = DataSection()
    eval: EvalSection = EvalSection()
    sample: SampleSection = SampleSection()
    throughput: ThroughputSection = ThroughputSection()
    seeds: Tuple[int, ...] = (0,)

    def spec(self, kind: str, num_threads: int = 0, density: float = 0.5, sort: bool = True) -> AttentionSpec:
        if kind == "llsa":
            s = AttentionSpec("llsa", block=self.llsa.block, topk=self.llsa.topk, levels=self.llsa.levels,
                              dedupe=self.llsa.dedupe, num_threads=num_threads)
        elif kind == "ba_att":
            s = AttentionSpec("ba_att", block=self.ba_att.block, density=density, sort=sort, num_threads=num_threads)
        else:
            s = AttentionSpec(kind, num_threads=num_threads)
        s.validate()
        return s

    def validate(self) -> None:
        self.model.validate()
        self.data.scene.validate()
        if not self.attention:
            raise ValueError("attention: expected at least one of full, llsa")
        for kind in self.attention:
            if kind not in ("full", "llsa"):
                raise ValueError(f"attention: a trained model runs full or llsa (ba_att is evaluated on the full "
                                 f"models), got {kind!r}")
        self.spec("llsa").validate()
        if "llsa" in self.attention:
            _check_llsa(self.spec("llsa"), self.model.tokens)
        for d in self.ba_att.densities:
            self.spec("ba_att", density=d).validate()
        for name in ("steps", "batch_size"):
            _positive(f"train.{name}", getattr(self.train, name))
        for name in ("warmup", "eval_every", "log_every", "checkpoint_every"):
            _non_negative(f"train.{name}", getattr(self.train, name))
        if not self.train.lr > 0:
            raise ValueError(f"train.lr: expected a positive learning rate, got {self.train.lr}")
        if not 0 <= self.train.ema < 1:
            raise ValueError(f"train.ema: expected a decay in [0, 1) (0: off), got {self.train.ema}")
        if self.train.weight_decay < 0 or self.train.grad_clip < 0:
            raise ValueError("train.weight_decay/grad_clip: expected non-negative values")
        for name in ("images", "batch_size"):
            _positive(f"eval.{name}", getattr(self.eval, name))
        heldout_bytes = 2 * 4 * self.eval.images * self.model.channels * self.model.tokens
        if heldout_bytes > HELDOUT_BYTES_LIMIT:
            raise ValueError(f"eval.images: {self.eval.images} held-out images and their noise take "
                             f"{heldout_bytes / 2**30:.1f} GiB, more than the {HELDOUT_BYTES_LIMIT >> 30} GiB allowed")
        _non_negative("data.stream", self.data.stream)
        _non_negative("eval.stream", self.eval.stream)
        for t0 in self.eval.reconstruct_from:
            if not 0 < t0 <= 1:
                raise ValueError(f"eval.reconstruct_from: expected times in (0, 1], got {t0}")
        if self.eval.images < self.sample.images and self.eval.reconstruct_from:
            raise ValueError(f"eval.reconstruct_from: reconstructs the first sample.images ({self.sample.images}) "
                             f"held-out images, but eval.images is {self.eval.images}")
        if self.train.timesteps not in ("uniform", "logit_normal"):
            raise ValueError(f"train.timesteps: expected uniform or logit_normal, got {self.train.timesteps!r}")
        for name in ("images", "steps", "columns", "upscale"):
            _positive(f"sample.{name}", getattr(self.sample, name))
        for n in (self.sample.steps, *self.sample.more_steps):
            if not 1 <= n <= MAX_SAMPLE_STEPS:
                raise ValueError(f"sample.steps/more_steps: expected Euler step counts in [1, {MAX_SAMPLE_STEPS}], "
                                 f"got {n}")
        for name in ("batch_size", "steps"):
            _positive(f"throughput.{name}", getattr(self.throughput, name))
        _non_negative("throughput.warmup", self.throughput.warmup)
        if self.throughput.compile and self.throughput.warmup < 1:
            raise ValueError("throughput.warmup: throughput.compile needs at least one warm-up step (the first "
                             "step compiles the model)")
        if not self.seeds:
            raise ValueError("seeds: expected at least one seed")
        for s in self.seeds:
            _non_negative("seeds", s)
            if self.data.stream + s == self.eval.stream:
                raise ValueError(f"eval.stream: {self.eval.stream} is also the training stream of seed {s} "
                                 f"(data.stream + seed); the held-out images must be unseen")


def _check_llsa(spec: AttentionSpec, tokens: int) -> None:
    """LLSA's own checks of block, top-K and levels for this many tokens (keys_per_query plans
    over zeros), with the section's name on the argument's: ``llsa.levels: ...``."""
    try:
        keys_per_query(tokens, spec)
    except ValueError as e:
        raise ValueError(f"llsa.{e}") from None


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value}")


def _non_negative(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name}: expected a non-negative integer, got {value}")


def _convert(name: str, kind: Any, default: Any, value: Any) -> Any:
    """``value`` from JSON as the type of a field (``kind``), or a ValueError naming the field."""
    if dataclasses.is_dataclass(default):
        if not isinstance(value, dict):
            raise ValueError(f"{name}: expected an object, got {type(value).__name__}")
        return _build(type(default), value, name)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{name}: expected true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: expected an integer, got {value!r}")
        if not -INT64_LIMIT <= value < INT64_LIMIT:  # seeds and streams go to torch and numpy as int64
            raise ValueError(f"{name}: expected an integer of at most 63 bits, got {value}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}: expected a number, got {value!r}")
        # Python's json reads NaN and Infinity; no field means anything by them.
        if not math.isfinite(value):
            raise ValueError(f"{name}: expected a finite number, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ValueError(f"{name}: expected a string, got {value!r}")
        return value
    if isinstance(default, tuple):
        if not isinstance(value, list):
            raise ValueError(f"{name}: expected a list, got {value!r}")
        # The elements' type: the default's, or for an empty default the annotation's (a string).
        element = default[0] if default else 0.0 if "float" in str(kind) else 0
        return tuple(_convert(f"{name}[{i}]", None, element, v) for i, v in enumerate(value))
    if isinstance(default, dict):
        if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  and math.isfinite(v) and v > 0 for v in value.values()):
            raise ValueError(f"{name}: expected an object of positive numbers, got {value!r}")
        return {str(k): float(v) for k, v in value.items()}
    raise ValueError(f"{name}: unsupported field")


def _build(cls, raw: Dict[str, Any], prefix: str = ""):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    defaults = cls()
    values = {}
    for key, value in raw.items():
        name = f"{prefix}.{key}" if prefix else key
        if key.startswith("_"):  # "_comment" and the like
            continue
        if key not in fields:
            raise ValueError(f"{name}: unknown field (known: {', '.join(fields)})")
        values[key] = _convert(name, fields[key].type, getattr(defaults, key), value)
    return dataclasses.replace(defaults, **values)


def from_dict(raw: Dict[str, Any]) -> ExperimentConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"config: expected a JSON object, got {type(raw).__name__}")
    cfg = _build(ExperimentConfig, raw)
    cfg.validate()
    return cfg


def _merged(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    """``over``'s fields on ``base``'s: objects merged field by field, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _read(path: Path, seen: Tuple[Path, ...] = ()) -> Dict[str, Any]:
    """The JSON object of a config file; with ``"extends": "NAME"`` the fields of NAME.json (in the
    same folder, itself possibly extending another) under this file's own."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--config: no file {path}") from None
    except (OSError, UnicodeDecodeError) as e:  # a folder, no permission, not UTF-8
        raise ValueError(f"--config: cannot read {path} ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--config: {path} is not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"--config: {path} nests its values too deeply") from None
    if not isinstance(raw, dict):
        raise ValueError(f"config: {path} holds a JSON {type(raw).__name__}, expected an object")
    if "extends" not in raw:
        return raw
    base = raw.pop("extends")
    if not isinstance(base, str) or not base or "/" in base or "\\" in base:
        raise ValueError(f"extends: expected the name of a config in the same folder, got {base!r} ({path})")
    base_path = path.parent / f"{base}.json"
    if base_path.resolve() in seen + (path.resolve(),):
        raise ValueError(f"extends: {path.name} extends itself through {base}.json")
    return _merged(_read(base_path, seen + (path.resolve(),)), raw)


def load(path) -> ExperimentConfig:
    return from_dict(_read(Path(path)))


def to_dict(cfg) -> Dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def override(cfg: ExperimentConfig, **changes) -> ExperimentConfig:
    """A copy with dotted fields replaced: ``override(cfg, **{"train.steps": 10})``."""
    raw = to_dict(cfg)
    for dotted, value in changes.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        if leaf not in node:
            raise ValueError(f"{dotted}: unknown field")
        node[leaf] = list(value) if isinstance(value, tuple) else value
    return from_dict(raw)

