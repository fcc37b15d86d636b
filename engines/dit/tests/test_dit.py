"""The pixel DiT engine (engines/dit): skipped where torch is absent.

The model's forward is checked against a plain reference written here (row-major pixels, loops
over heads, explicit softmax, RoPE by explicit rotation); the sparse attentions against full
attention where they select everything; training, resumption, the image generator, the token
layout, the sampler and the PNG writer each on their own; the compiled model (--compile) against
the eager one.
"""
import json
import math
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from engines.dit import config as config_mod  # noqa: E402
from engines.dit import train as train_mod  # noqa: E402
from engines.dit.attention import AttentionSpec  # noqa: E402
from engines.dit.bars import THRESHOLD, bar_score, count_bars  # noqa: E402
from engines.dit.data import make_images  # noqa: E402
from engines.dit.flow import euler_from, euler_sample, noise_scale, noisy, sample_times  # noqa: E402
from engines.dit.model import DiTConfig, PixelDiT, token_order  # noqa: E402
from engines.dit.png import encode_png, image_grid  # noqa: E402

import sparsa  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def randomised(model, seed=0, std=0.3):
    """Every parameter drawn N(0, std^2), so AdaLN-Zero's zero initialisation hides nothing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return model


# ---- the reference forward -------------------------------------------------------------------

def reference_forward(params, cfg: DiTConfig, x, t):
    """The DiT of engines/dit/model.py's header, in f64, pixels in row-major order."""
    p = {k: v.double() for k, v in params.items()}
    batch, channels, size, _ = x.shape
    n, d, heads = size * size, cfg.width, cfg.heads
    hd = d // heads

    def linear(name, v):
        return v @ p[name + ".weight"].T + p[name + ".bias"]

    def layer_norm(v):
        mean = v.mean(-1, keepdim=True)
        var = ((v - mean) ** 2).mean(-1, keepdim=True)
        return (v - mean) / torch.sqrt(var + 1e-6)

    def rms_norm(v, w):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-6) * w

    def gelu_tanh(v):
        return 0.5 * v * (1 + torch.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))

    def silu(v):
        return v / (1 + torch.exp(-v))

    # RoPE: pixel (r, c) = row-major index r*size + c; dims [0, hd/2) turn with r, [hd/2, hd) with c.
    quarter = hd // 4
    freq = [cfg.rope_theta ** (-2.0 * j / (hd // 2)) for j in range(quarter)]

    def rope(v):  # v [n, hd]
        out = v.clone()
        for i in range(n):
            r, c = divmod(i, size)
            for axis, pos in ((0, r), (1, c)):
                for j in range(quarter):
                    a, b = 2 * (axis * quarter + j), 2 * (axis * quarter + j) + 1
                    cos, sin = math.cos(pos * freq[j]), math.sin(pos * freq[j])
                    out[i, a] = v[i, a] * cos - v[i, b] * sin
                    out[i, b] = v[i, a] * sin + v[i, b] * cos
        return out

    half = 128
    freqs = torch.tensor([math.exp(-math.log(10000.0) * k / half) for k in range(half)], dtype=torch.float64)
    outputs = []
    for bi in range(batch):
        tokens = x[bi].double().reshape(channels, n).T  # [n, C], row-major pixels
        h = linear("embed", tokens)
        args = 1000.0 * float(t[bi]) * freqs
        c = linear("t_embed.2", silu(linear("t_embed.0", torch.cat([torch.cos(args), torch.sin(args)]))))
        for layer in range(cfg.depth):
            pre = f"blocks.{layer}."
            mod = linear(pre + "ada", silu(c))
            shift1, scale1, gate1, shift2, scale2, gate2 = (mod[k * d:(k + 1) * d] for k in range(6))
            a = layer_norm(h) * (1 + scale1) + shift1
            qkv = linear(pre + "attn.qkv", a)
            heads_out = []
            for head in range(heads):
                q = qkv[:, head * hd:(head + 1) * hd]
                k = qkv[:, d + head * hd:d + (head + 1) * hd]
                v = qkv[:, 2 * d + head * hd:2 * d + (head + 1) * hd]
                q = rope(rms_norm(q, p[pre + "attn.q_norm.weight"]))
                k = rope(rms_norm(k, p[pre + "attn.k_norm.weight"]))
                logits = q @ k.T / math.sqrt(hd)
                weights = torch.exp(logits - logits.max(-1, keepdim=True).values)
                heads_out.append((weights / weights.sum(-1, keepdim=True)) @ v)
            h = h + gate1 * linear(pre + "attn.proj", torch.cat(heads_out, dim=1))
            m = layer_norm(h) * (1 + scale2) + shift2
            h = h + gate2 * linear(pre + "mlp.2", gelu_tanh(linear(pre + "mlp.0", m)))
        final = linear("final_ada", silu(c))
        shift, scale = final[:d], final[d:]
        out = linear("out", layer_norm(h) * (1 + scale) + shift)  # [n, C]
        outputs.append(out.T.reshape(channels, size, size))
    return torch.stack(outputs)


def small_config(**changes):
    base = dict(image_size=8, channels=3, depth=2, width=16, heads=2, mlp_ratio=2.0, layout="z_order")
    base.update(changes)
    return DiTConfig(**base)


def test_forward_matches_reference():
    cfg = small_config()
    model = randomised(PixelDiT(cfg)).double()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64)
    t = torch.tensor([0.13, 0.77], dtype=torch.float64)
    with torch.no_grad():
        got = model(x, t)
        want = reference_forward(model.state_dict(), cfg, x, t)
    # Everything is f64 but the RoPE cos/sin tables, which the model keeps in f32 (2^-24 relative):
    # a few 1e-7 through two layers; a wrong axis, pair or permutation is an O(1) difference.
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-5, err


def test_x0_prediction_is_the_velocity_it_implies():
    """model.prediction x0: the same network's output read as the clean image, turned into the
    velocity (x_t - x0_pred) / max(t, T_MIN); the velocity model's output is that raw output."""
    from engines.dit.model import T_MIN

    velocity = randomised(PixelDiT(small_config())).double()
    x0 = PixelDiT(small_config(prediction="x0")).double()
    x0.load_state_dict(velocity.state_dict())
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    t = torch.tensor([0.01, 0.05, 0.7], dtype=torch.float64)
    with torch.no_grad():
        raw, got = velocity(x, t), x0(x, t)
    want = (x - raw) / t.clamp(min=T_MIN).view(-1, 1, 1, 1)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert T_MIN == 0.05 and not torch.allclose(got, raw)
    # The identity it rests on: (x_t - x0) / t is the velocity, so Euler steps with the exact clean
    # image land on it.
    target, noise = torch.rand(1, 3, 8, 8, dtype=torch.float64), torch.randn(1, 3, 8, 8, dtype=torch.float64)

    class Exact(torch.nn.Module):
        def forward(self, x, t):
            return (x - target) / t.view(-1, 1, 1, 1)

    landed = euler_from(Exact(), noise, 1.0, 10)  # from pure noise at t = 1 to t = 0 in 10 steps
    assert torch.allclose(landed, target, atol=1e-12)
    with pytest.raises(ValueError, match="model.prediction"):
        small_config(prediction="eps").validate()


def test_zorder_layout_round_trip_and_equivariance():
    perm = token_order(8, "z_order")
    assert sorted(perm.tolist()) == list(range(64))
    # Every aligned group of 4 (16) layout positions is a 2x2 (4x4) square of pixels.
    for group in (4, 16):
        side = int(math.isqrt(group))
        for start in range(0, 64, group):
            rows, cols = np.divmod(perm[start:start + group], 8)
            assert rows.max() - rows.min() == side - 1 and cols.max() - cols.min() == side - 1
            assert len(set(zip(rows.tolist(), cols.tolist()))) == group
    model = PixelDiT(small_config())
    assert np.array_equal(model.inverse_perm.numpy(), sparsa.inverse_permutation(perm))
    x = torch.randn(2, 64, 5)
    assert torch.equal(x[:, model.perm][:, model.inverse_perm], x)
    # Full attention with RoPE carried along is exactly equivariant to the token order: the same
    # weights in Z-order and in row-major order give the same velocity (f32 summation order only).
    zorder = randomised(PixelDiT(small_config(layout="z_order")))
    rowmajor = PixelDiT(small_config(layout="row_major"))
    rowmajor.load_state_dict(zorder.state_dict())
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([0.3, 0.9])
    with torch.no_grad():
        a, b = zorder(x, t), rowmajor(x, t)
    assert float((a - b).abs().max() / b.abs().max()) < 1e-5


def test_llsa_selecting_everything_equals_full_with_gradients():
    # N = 64, block 4: 16 fine blocks, top-K 16 keeps all of them at every level, and dedupe leaves
    # out the pooled tokens whose children are present: exactly dense attention (docs/llsa.md).
    cfg = small_config()
    full = randomised(PixelDiT(cfg), seed=5)
    llsa = PixelDiT(cfg)
    llsa.load_state_dict(full.state_dict())
    llsa.set_attention(AttentionSpec("llsa", block=4, topk=16, dedupe=True, num_threads=1))
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([0.2, 0.6])
    w = torch.randn(2, 3, 8, 8)
    outs = []
    for model in (full, llsa):
        model.zero_grad()
        out = model(x, t)
        (out * w).sum().backward()
        outs.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    (o_full, g_full), (o_llsa, g_llsa) = outs
    assert float((o_full - o_llsa).abs().max() / o_full.abs().max()) < 1e-5
    # f32 rounding of the whole backward (sums of a few hundred terms in another order): 1e-5 of
    # the largest gradient entry of the model, for every parameter.
    largest = max(float(a.abs().max()) for a in g_full)
    for a, b in zip(g_full, g_llsa):
        assert float((a - b).abs().max()) <= 1e-5 * largest


def test_llsa_top_k_changes_the_output():
    # The sparse path must really be sparse: with top-K 1 of 16 blocks and no enrichment beyond
    # the defaults, the output differs from full attention.
    cfg = small_config()
    full = randomised(PixelDiT(cfg), seed=6)
    llsa = PixelDiT(cfg)
    llsa.load_state_dict(full.state_dict())
    llsa.set_attention(AttentionSpec("llsa", block=4, topk=1, num_threads=1))
    x, t = torch.randn(1, 3, 8, 8), torch.tensor([0.5])
    with torch.no_grad():
        assert float((full(x, t) - llsa(x, t)).abs().max()) > 1e-3


def test_ba_att_density_one_equals_full_and_refuses_training():
    cfg = small_config()
    full = randomised(PixelDiT(cfg), seed=7)
    ba = PixelDiT(cfg)
    ba.load_state_dict(full.state_dict())
    ba.set_attention(AttentionSpec("ba_att", block=16, density=1.0, num_threads=1))
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([0.4, 0.8])
    with torch.no_grad():
        a, b = full(x, t), ba(x, t)
    assert float((a - b).abs().max() / a.abs().max()) < 1e-5
    ba.set_attention(AttentionSpec("ba_att", block=16, density=0.5, num_threads=1))
    with torch.no_grad():
        assert float((full(x, t) - ba(x, t)).abs().max()) > 1e-3  # half the blocks: not the same
    with pytest.raises(RuntimeError, match="training-free"):
        ba(x, t)


def test_image_generator_is_deterministic_per_seed():
    a = make_images(5, 0, 6, 32)
    assert a.dtype == np.float32 and a.shape == (6, 3, 32, 32)
    assert np.array_equal(a, make_images(5, 0, 6, 32))
    assert np.array_equal(a[3:], make_images(5, 3, 3, 32))  # per image, whatever the batching
    assert not np.array_equal(a, make_images(6, 0, 6, 32))
    assert a.min() >= -1 and a.max() <= 1 and a.std() > 0.1
    for i in range(6):  # a background colour and something on it
        assert np.abs(a[i] - np.median(a[i], axis=(1, 2), keepdims=True)).max() > 0.2
    with pytest.raises(ValueError, match="size"):
        make_images(5, 0, 1, 0)


def test_the_bar_detector_finds_the_scenes_bars_and_nothing_else():
    from engines.dit.data import SceneParams

    # Scenes with a bar and the same scenes' streams without one, at 64 pixels a side. Measured
    # over 200 of each (bars.py): bar-free scenes score at most 0.13, 95% of the barred ones score
    # above the threshold 0.3. 20 of each here: at most 4 misses (a recall of 80%) and no false
    # bar, a margin the detector's own measurement leaves room for.
    with_bar = make_images(7, 0, 20, 64, 3, SceneParams(bar_prob=1.0))
    without = make_images(7, 0, 20, 64, 3, SceneParams(bar_prob=0.0))
    assert count_bars(with_bar) >= 16
    scores = [bar_score(image) for image in without]
    assert max(scores) < THRESHOLD - 0.1, scores
    # Nothing to find in a flat image or in noise (a model's speckles).
    assert bar_score(np.full((3, 32, 32), 0.4)) < 1e-6
    noise = np.random.default_rng(0).normal(0.0, 0.3, (3, 64, 64)).clip(-1, 1)
    assert bar_score(noise) < THRESHOLD
    # One bar drawn by hand: a horizontal line 3 pixels wide across half of a flat image.
    image = np.full((3, 48, 48), -0.2)
    image[:, 20:23, 10:34] = 0.6
    assert bar_score(image) > 0.5
    for bad, name in ((np.zeros((32, 32)), "image"), (np.zeros((3, 32, 16)), "image"),
                      (np.full((3, 16, 16), np.nan), "image")):
        with pytest.raises(ValueError, match=name):
            bar_score(bad)
    with pytest.raises(ValueError, match="images"):
        count_bars(np.zeros((3, 16, 16)))


def test_noise_scale_and_euler_sampler():
    assert noise_scale(32) == 1 and noise_scale(64) == 1 and noise_scale(128) == 2 and noise_scale(256) == 4
    # x_t = (1 - t) x0 + s t eps: x_0 = x0, x_1 = s eps (where the sampler starts), and the
    # target is the path's derivative (central difference, exact for a straight line).
    g = torch.Generator().manual_seed(2)
    x0, eps = (torch.randn(3, 3, 4, 4, generator=g, dtype=torch.float64) for _ in range(2))
    t = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    x_t, target = noisy(x0, eps, t, 4.0)
    assert torch.allclose(x_t[0], x0[0]) and torch.allclose(x_t[2], 4.0 * eps[2])
    h = 1e-3
    derivative = (noisy(x0, eps, t + h, 4.0)[0] - noisy(x0, eps, t - h, 4.0)[0]) / (2 * h)
    assert float((derivative - target).abs().max()) < 1e-9
    # With the exact velocity of a single data point x0, (x_t - x0) / t, every Euler step follows
    # the straight path, so the sampler must land on x0 from any noise, at any s.
    x0 = torch.randn(2, 3, 4, 4, dtype=torch.float64)

    def oracle(x, t):
        return (x - x0) / t.view(-1, 1, 1, 1)

    for s in (1.0, 4.0):
        out = euler_sample(oracle, torch.randn(2, 3, 4, 4, dtype=torch.float64), steps=7, s=s)
        assert float((out - x0).abs().max()) < 1e-9
    # The same from a point of the path at t0 < 1 (a reconstruction), and a bad start is refused.
    x_half, _ = noisy(x0, torch.randn(2, 3, 4, 4, dtype=torch.float64), torch.full((2,), 0.4, dtype=torch.float64), 1.0)
    assert float((euler_from(oracle, x_half, 0.4, steps=3) - x0).abs().max()) < 1e-9
    for t0, steps, field in ((0.0, 3, "t0"), (1.5, 3, "t0"), (0.5, 0, "steps")):
        with pytest.raises(ValueError, match=field):
            euler_from(oracle, x_half, t0, steps)


def test_training_times_uniform_or_logit_normal():
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    uniform, ln = sample_times(20000, "uniform", g()), sample_times(20000, "logit_normal", g())
    assert torch.equal(uniform, sample_times(20000, "uniform", g()))  # deterministic per generator
    assert torch.equal(ln, sample_times(20000, "logit_normal", g()))
    assert 0 < float(ln.min()) and float(ln.max()) < 1
    # P(t < 0.1): 0.1 for uniform, P(u < logit 0.1 = -2.197) = 0.014 for logit-normal; the
    # medians are both 0.5. The bounds leave about ten standard errors of 20000 draws.
    assert abs(float((uniform < 0.1).float().mean()) - 0.1) < 0.02
    assert abs(float((ln < 0.1).float().mean()) - 0.014) < 0.01
    assert abs(float(ln.median()) - 0.5) < 0.02
    with pytest.raises(ValueError, match="train.timesteps"):
        sample_times(4, "cosine", g())
    # The training batches take the configured kind.
    cfg = config_mod.override(config_mod.load(CONFIGS / "tiny.json"),
                              **{"train.timesteps": "logit_normal", "train.batch_size": 4096})
    _, _, t = train_mod.train_batch(cfg, 0, 0)
    assert abs(float((t < 0.1).float().mean()) - 0.014) < 0.012


class _Oracle(torch.nn.Module):
    """The exact velocity towards fixed images ``target`` [B, C, H, W]: (x - target) / t."""

    def __init__(self, target):
        super().__init__()
        self.target = target

    def forward(self, x, t):
        return (x - self.target) / t.view(-1, 1, 1, 1)


def test_reconstructions_keep_the_bars_a_model_finishes(tmp_path):
    cfg = config_mod.override(config_mod.load(CONFIGS / "tiny.json"),
                              **{"model.image_size": 64, "eval.images": 8, "sample.images": 8,
                                 "sample.steps": 10, "eval.reconstruct_from": [0.5, 1.0]})
    heldout = train_mod.heldout_set(cfg)
    x0 = heldout[0]
    shown = count_bars(x0.numpy())
    assert 0 < shown < 8  # the held-out images have bars and bar-free scenes
    # A model that finishes every image it is shown keeps every bar, from any time.
    kept = train_mod.reconstruct(_Oracle(x0.double()), cfg, "cpu", (x0.double(), heldout[1].double()), tmp_path,
                                 "_exact")
    assert kept == [{"t0": 0.5, "bars_kept": shown, "one_step_kept": shown, "bars_shown": shown},
                    {"t0": 1.0, "bars_kept": shown, "one_step_kept": shown, "bars_shown": shown}]
    images = np.load(tmp_path / "samples_reconstruct_t0.5_exact.npy")
    assert np.allclose(images, x0.numpy(), atol=1e-6)
    assert (tmp_path / "samples_reconstruct_t1_exact.png").read_bytes()[:4] == b"\x89PNG"
    assert train_mod.format_reconstruct(kept) == (f"t0.5 {shown}/{shown} (one step {shown}/{shown}) "
                                                  f"t1 {shown}/{shown} (one step {shown}/{shown})")
    # One that draws flat images keeps none.
    flat = train_mod.reconstruct(_Oracle(torch.zeros_like(x0)), cfg, "cpu", heldout, tmp_path, "_flat")
    assert [(r["bars_kept"], r["one_step_kept"]) for r in flat] == [(0, 0), (0, 0)]

    # One that denoises its input in one step but not along the path: its one-step estimate is
    # the clean image (the velocity towards x0 at t0 exactly), and at every later time it aims
    # at flat images. The one-step count keeps the bars and the integration loses them, which is
    # the split the two counts exist to show.
    class _FirstStepOnly(torch.nn.Module):
        def forward(self, x, t):
            target = x0.double() if float(t[0]) in (0.5, 1.0) else torch.zeros_like(x)
            return (x - target) / t.view(-1, 1, 1, 1)

    split = train_mod.reconstruct(_FirstStepOnly(), cfg, "cpu", (x0.double(), heldout[1].double()), tmp_path, "_split")
    assert [(r["bars_kept"], r["one_step_kept"]) for r in split] == [(0, shown), (0, shown)]
    # Without eval.reconstruct_from nothing runs.
    none = config_mod.override(cfg, **{"eval.reconstruct_from": []})
    assert train_mod.reconstruct(_Oracle(x0), none, "cpu", heldout, tmp_path, "_none") == []


def test_png_is_valid_and_lossless():
    pixels = (np.arange(5 * 7 * 3) % 256).astype(np.uint8).reshape(5, 7, 3)
    data = encode_png(pixels)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        payload = data[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + payload)
        chunks[kind] = payload
        pos += 12 + length
    width, height = struct.unpack(">II", chunks[b"IHDR"][:8])
    assert (width, height) == (7, 5)
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(5, 1 + 7 * 3)
    assert (raw[:, 0] == 0).all() and np.array_equal(raw[:, 1:].reshape(5, 7, 3), pixels)
    grid = image_grid(np.zeros((3, 3, 4, 4)), columns=2, pad=1)
    assert grid.shape == (2 * 5 + 1, 2 * 5 + 1, 3)


def test_a_config_extends_another(tmp_path):
    """"extends": the named config's fields under the file's own (objects merged field by field);
    the shipped variants differ from medium_long only where they say; loops and bad names are errors."""
    base = config_mod.load(CONFIGS / "medium_long.json")
    l1 = config_mod.load(CONFIGS / "medium_long_l1_k8.json")
    assert l1.llsa.levels == 1 and l1.llsa.topk == 8 and l1.llsa.block == base.llsa.block == 16
    assert config_mod.override(l1, **{"name": base.name, "description": base.description, "llsa.levels": -1}) == base
    (tmp_path / "a.json").write_text((CONFIGS / "tiny.json").read_text())
    (tmp_path / "b.json").write_text(json.dumps({"extends": "a", "train": {"steps": 7}}))
    (tmp_path / "c.json").write_text(json.dumps({"extends": "b", "model": {"depth": 3}}))
    c = config_mod.load(tmp_path / "c.json")
    a = config_mod.load(tmp_path / "a.json")
    assert c.train.steps == 7 and c.model.depth == 3 and c.train.lr == a.train.lr and c.model.width == a.model.width
    (tmp_path / "d.json").write_text(json.dumps({"extends": "e"}))
    (tmp_path / "e.json").write_text(json.dumps({"extends": "d"}))
    with pytest.raises(ValueError, match="extends: .* extends itself"):
        config_mod.load(tmp_path / "d.json")
    (tmp_path / "f.json").write_text(json.dumps({"extends": "../tiny"}))
    with pytest.raises(ValueError, match="extends: expected the name of a config in the same folder"):
        config_mod.load(tmp_path / "f.json")
    (tmp_path / "g.json").write_text(json.dumps({"extends": "missing"}))
    with pytest.raises(ValueError, match="no file"):
        config_mod.load(tmp_path / "g.json")


def test_config_errors_name_the_field(tmp_path):
    for path in sorted(CONFIGS.glob("*.json")):  # every shipped config loads
        config_mod.load(path)
    raw = json.loads((CONFIGS / "tiny.json").read_text())
    cases = [({"train": {"lr": "fast"}}, "train.lr: expected a number"),
             ({"model": {"widht": 3}}, "model.widht: unknown field"),
             ({"model": {"width": 33}}, "model.width: expected a multiple of model.heads"),
             ({"model": {"width": 36}}, "2-D RoPE needs head_dim divisible by 4"),
             ({"attention": ["ba_att"]}, "attention: a trained model runs full or llsa"),
             ({"llsa": {"topk": 0}}, "llsa.topk"),
             ({"ba_att": {"densities": [1.5]}}, "ba_att.density"),
             ({"eval": {"stream": 1000}}, "eval.stream"),
             ({"train": {"compile": "yes"}}, "train.compile: expected true or false, got 'yes'"),
             ({"throughput": {"compile": 1}}, "throughput.compile: expected true or false, got 1"),
             ({"throughput": {"compile": True, "warmup": 0}}, "throughput.warmup: throughput.compile needs"),
             ({"train": {"timesteps": "cosine"}}, "train.timesteps: expected uniform or logit_normal"),
             ({"eval": {"reconstruct_from": [0]}}, r"eval.reconstruct_from: expected times in \(0, 1\]"),
             ({"eval": {"reconstruct_from": [1.5]}}, "eval.reconstruct_from: expected times"),
             ({"eval": {"reconstruct_from": 0.5}}, "eval.reconstruct_from: expected a list"),
             ({"eval": {"reconstruct_from": ["half"]}}, r"eval.reconstruct_from\[0\]: expected a number"),
             ({"eval": {"images": 4, "reconstruct_from": [0.5]}}, "eval.reconstruct_from: reconstructs the first")]
    for change, message in cases:
        bad = json.loads(json.dumps(raw))
        for section, value in change.items():
            if isinstance(value, dict):
                bad[section].update(value)
            else:
                bad[section] = value
        with pytest.raises(ValueError, match=message):
            config_mod.from_dict(bad)
    with pytest.raises(ValueError, match="--config: no file"):
        config_mod.load(tmp_path / "missing.json")


def test_tiny_trains_and_its_loss_decreases(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert train_mod.main(["--config", str(CONFIGS / "tiny.json"), "--out", str(out), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "results.json").read_text())
    assert {r["kind"] for r in result["table"]} == {"full", "llsa", "ba_att"}
    for kind in ("full", "llsa"):
        run = out / f"{kind}-seed0"
        rows = list(__import__("csv").DictReader(open(run / "log.csv")))
        heldout = [float(r["heldout_loss"]) for r in rows if r["heldout_loss"]]
        # At the start AdaLN-Zero's model predicts 0 (loss ~ 1 + E x0^2); 40 steps must take at
        # least a third of that away on the same held-out images.
        assert heldout[-1] < 0.67 * heldout[0], (kind, heldout)
        assert (run / "samples.png").read_bytes()[:4] == b"\x89PNG"
        assert (run / "checkpoint.pt").exists()
        # The mid-run evaluation (step 20 of 40) sampled too and counted the bars; the last did not.
        assert (run / "samples_step20.png").read_bytes()[:4] == b"\x89PNG"
        progress = np.load(run / "samples_step20.npy")
        assert progress.shape == np.load(run / "samples.npy").shape and np.isfinite(progress).all()
        bars = {int(r["step"]): r["sample_bars"] for r in rows}
        assert bars[20] == str(train_mod.count_bars(progress)) and bars[40] == ""
        assert not (run / "samples_step40.npy").exists()
    assert (out / "full-seed0" / "samples_ba_att_d0.5.png").exists()
    assert (out / "compare.png").exists()
    assert "| llsa (block 4, top-K 2) |" in printed and "held-out" in printed
    # Every run's samples counted for bars beside as many held-out images.
    n = result["config"]["sample"]["images"]
    assert result["bars"]["held-out"][1] == n and result["bars"]["full (seed 0)"][1] == n
    assert any(name.startswith("full, sampled with ba_att") for name in result["bars"])
    assert "Images with a bar (engines/dit/bars.py): held-out:" in printed
    # A second call finds the finished runs and only prints the table again.
    assert train_mod.main(["--config", str(CONFIGS / "tiny.json"), "--out", str(out), "--threads", "1"]) == 0
    assert "already finished" in capsys.readouterr().out
    # --table-only trains nothing: a seed that never ran is left out, the finished one is tabled.
    assert train_mod.main(["--config", str(CONFIGS / "tiny.json"), "--out", str(out), "--seeds", "0,1",
                           "--table-only"]) == 0
    printed = capsys.readouterr().out
    assert "[full seed 1] not finished" in printed and "| full | 256 of 256 | 1 |" in printed
    assert not (out / "full-seed1").exists()


@pytest.mark.parametrize("kind,ema", [("full", 0.0), ("llsa", 0.0), ("full", 0.9)])
def test_resume_equals_uninterrupted(tmp_path, kind, ema):
    cfg = config_mod.override(config_mod.load(CONFIGS / "tiny.json"),
                              **{"train.steps": 6, "train.checkpoint_every": 2, "train.eval_every": 3,
                                 "train.ema": ema, "eval.reconstruct_from": [0.5], "sample.more_steps": [2, 9]})
    torch.set_num_threads(1)
    quiet = lambda message: None  # noqa: E731
    whole = train_mod.train_run(cfg, kind, 0, tmp_path / "whole", num_threads=1, log=quiet)
    part = train_mod.train_run(cfg, kind, 0, tmp_path / "split", num_threads=1, stop_after=3, log=quiet)
    assert not part["finished"] and part["step"] == 3
    resumed = train_mod.train_run(cfg, kind, 0, tmp_path / "split", num_threads=1, log=quiet)
    assert resumed["finished"] and resumed["heldout_loss"] == whole["heldout_loss"]
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    for part in ("model", "ema") if ema else ("model",):
        for name, tensor in a[part].items():
            assert torch.equal(tensor, b[part][name]), (part, name)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "train_seconds"} for r in rows]  # noqa: E731
    assert strip(a["log"]) == strip(b["log"])
    # eval.reconstruct_from: the mid-run evaluation reconstructed too (its bars kept in the log),
    # and so did the end (in the summary).
    mid = next(r for r in a["log"] if r["step"] == 3)
    assert mid["reconstruct_bars"].startswith("t0.5 ") and (tmp_path / "whole" / "samples_reconstruct_t0.5_step3.npy").exists()
    assert [r["t0"] for r in whole["reconstruct"]] == [0.5] and (tmp_path / "whole" / "samples_reconstruct_t0.5.png").exists()
    # sample.more_steps: the same noise again in 2 and 9 steps, mid-run and at the end; counted in
    # the log, the summary and the progress line. The default sampler (4 steps) is neither.
    assert mid["more_steps_bars"].startswith("2 steps ") and ", 9 steps " in mid["more_steps_bars"]
    assert [(r["steps"], r["images"]) for r in whole["more_steps"]] == [(2, 8), (9, 8)]
    default = np.load(tmp_path / "whole" / "samples.npy")
    finer = np.load(tmp_path / "whole" / "samples_steps9.npy")
    assert (tmp_path / "whole" / "samples_steps2_step3.png").exists() and finer.shape == default.shape
    assert not np.array_equal(finer, default)
    assert np.array_equal(finer, np.load(tmp_path / "split" / "samples_steps9.npy"))
    # A checkpoint of another configuration is refused, naming what differs.
    other = config_mod.override(cfg, **{"train.lr": 0.01})
    with pytest.raises(ValueError, match="train differ"):
        train_mod.train_run(other, kind, 0, tmp_path / "split", num_threads=1, log=quiet)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_model_matches_cpu_through_the_host_llsa():
    cfg = small_config()
    cpu = randomised(PixelDiT(cfg), seed=9)
    cpu.set_attention(AttentionSpec("llsa", block=4, topk=2, num_threads=1))
    gpu = PixelDiT(cfg)
    gpu.load_state_dict(cpu.state_dict())
    gpu.set_attention(AttentionSpec("llsa", block=4, topk=2, num_threads=1))
    gpu = gpu.cuda()
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([0.3, 0.7])
    a = cpu(x, t)
    b = gpu(x.cuda(), t.cuda())
    assert b.device.type == "cuda"
    # The same f32 LLSA on the host; the linears differ by the GPU's f32 GEMMs (TF32 off by default).
    assert float((a - b.cpu()).abs().max() / a.abs().max()) < 1e-4
    b.sum().backward()
    assert all(p.grad is not None and p.grad.device.type == "cuda" for p in gpu.parameters())


def test_throughput_mode_measures_both_attentions(tmp_path):
    cfg = config_mod.load(CONFIGS / "tiny.json")
    result = train_mod.throughput(cfg, "cpu", num_threads=1, steps=1, out=tmp_path, log=lambda message: None)
    assert [r["kind"] for r in result["rows"]] == ["full", "llsa"]
    assert all(r["tokens_per_s"] > 0 and r["tokens"] == 256 for r in result["rows"])
    assert "pixel tokens/s" in result["table"] and (tmp_path / "throughput.json").exists()
    assert not result["compiled"] and ", eager, " in result["table"] and "--compile" not in result["table"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_llsa_attention_runs_on_the_device_for_cuda_tensors():
    """On CUDA tensors with head_dim 64, attend() takes sparsa's CUDA LLSA (bf16 inside, the
    output back in f32) and gradients reach the device tensors. The reference is the host path on
    the same values rounded to bf16: rounding the inputs alone moves this output by 2.5% (relative
    L2, measured on the CPU), which is the cast's doing, not the kernels'; against the rounded
    inputs what remains is the device's own rounding of P and of the output (about 2.4e-3 in
    tests/test_llsa_cuda.cpp) and near-tie picks, well inside 1e-2."""
    from engines.dit.attention import AttentionSpec, attend

    spec = AttentionSpec(kind="llsa", block=16, topk=4, levels=2)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1024, 64, generator=g) for _ in range(3))
    qc, kc, vc = (t.cuda().requires_grad_(True) for t in (q, k, v))
    out = attend(qc, kc, vc, spec)
    assert out.is_cuda and out.dtype == torch.float32
    out.square().sum().backward()
    assert qc.grad is not None and qc.grad.is_cuda and torch.isfinite(qc.grad).all()
    ref = attend(*(t.bfloat16().float() for t in (q, k, v)), spec)
    assert ((out.detach().cpu() - ref).norm() / ref.norm()).item() < 1e-2


# ---- torch.compile (--compile) ------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled_steps():
    """Two training steps (train_step, as train_run takes them) of the tiny model from the same
    randomised weights and batches, eager and through compiled_forward, for full and llsa: per
    step the loss, the gradients and the parameters' update so far (after minus before); and how
    many graphs were compiled.
    One compiled model per attention: compiling is the slow part (tens of seconds on 2 cores)."""
    cfg = config_mod.load(CONFIGS / "tiny.json")
    torch._dynamo.reset()  # a fresh cache, so that the graph count below is this fixture's
    from torch._dynamo.utils import counters

    results = {}
    for kind in ("full", "llsa"):
        spec = cfg.spec(kind, 1)
        eager = randomised(train_mod.build_model(cfg, spec, 0, "cpu"), seed=11, std=0.1)
        compiled = train_mod.build_model(cfg, spec, 0, "cpu")
        compiled.load_state_dict(eager.state_dict())
        start = [p.detach().clone() for p in eager.parameters()]
        graphs_before = counters["stats"]["unique_graphs"]
        runs = {}
        for name, model, forward in (("eager", eager, eager),
                                     ("compiled", compiled, train_mod.compiled_forward(compiled))):
            optimizer = train_mod.make_optimizer(cfg, model)
            steps = []
            for step in range(2):
                loss = train_mod.train_step(cfg, model, forward, optimizer, train_mod.train_batch(cfg, 0, step),
                                            train_mod.lr_at(cfg, step))
                steps.append({"loss": loss, "grad": torch.cat([p.grad.flatten() for p in model.parameters()]),
                              "update": torch.cat([(p.detach() - s).flatten()
                                                   for p, s in zip(model.parameters(), start)])})
            runs[name] = steps
        runs["graphs"] = counters["stats"]["unique_graphs"] - graphs_before
        results[kind] = runs
    return results


# The compiled and the eager model compute in float32 on the CPU; inductor fuses the elementwise
# chains and reorders reductions (LayerNorm, RMSNorm, the attention's softmax), each rounding at
# 2^-24 = 6e-8 relative. Measured here: the loss agrees to 2e-7 relative and the
# gradients to 2e-6 (relative L2 over every parameter); the bounds are 50x that, and still 25x and
# 75x below the difference between full attention and LLSA on the same weights (asserted), so a
# compiled graph that ran another attention, or dropped a term, cannot pass.
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4


def relative_l2(got, want):
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("kind", ["full", "llsa"])
def test_compiled_loss_and_gradients_equal_eager(compiled_steps, kind):
    runs = compiled_steps[kind]
    assert runs["graphs"] == 1  # it really compiled (one graph of the forward), and did not fall back to eager
    for eager, compiled in zip(runs["eager"], runs["compiled"]):
        assert abs(compiled["loss"] - eager["loss"]) <= LOSS_TOLERANCE * abs(eager["loss"]), (eager["loss"],
                                                                                              compiled["loss"])
        assert relative_l2(compiled["grad"], eager["grad"]) <= GRAD_TOLERANCE
    full, llsa = compiled_steps["full"]["eager"][0], compiled_steps["llsa"]["eager"][0]
    assert abs(full["loss"] - llsa["loss"]) > 10 * LOSS_TOLERANCE * abs(full["loss"])
    assert relative_l2(llsa["grad"], full["grad"]) > 10 * GRAD_TOLERANCE


@pytest.mark.parametrize("kind", ["full", "llsa"])
def test_compiled_training_step_equals_eager(compiled_steps, kind):
    # AdamW's first step moves each parameter by lr g / (|g| + eps), about lr whatever |g|, so an
    # element whose gradient is near zero can move differently under rounding (measured: 2 or 3 of
    # 41,187 elements, by 5-20% of the largest move). The update (parameters after minus before)
    # is compared as a whole: relative L2 within 1e-2 (measured: at most 1e-3). A wrong gradient
    # turns the sign of a large share of the moves: an O(1) difference. The second step's update
    # also weighs the gradients' magnitudes (Adam's moments).
    runs = compiled_steps[kind]
    for eager, compiled in zip(runs["eager"], runs["compiled"]):
        assert relative_l2(compiled["update"], eager["update"]) <= 1e-2
    full, llsa = compiled_steps["full"]["eager"][-1], compiled_steps["llsa"]["eager"][-1]
    assert relative_l2(llsa["update"], full["update"]) > 1e-2


def test_compile_option_in_the_throughput_table_and_the_summary(tmp_path, capsys):
    # Batch 8 as the fixture's training steps: the same shapes, so its graphs serve here.
    tiny = str(CONFIGS / "tiny.json")
    assert train_mod.main(["--config", tiny, "--throughput", "--compile", "--batch", "8", "--throughput-steps", "1",
                           "--threads", "1", "--out", str(tmp_path / "throughput")]) == 0
    printed = capsys.readouterr().out
    assert "compiled (--compile)" in printed and "Compiled: the model's forward under torch.compile" in printed
    result = json.loads((tmp_path / "throughput" / "throughput.json").read_text())
    assert result["compiled"] and [r["compiled"] for r in result["rows"]] == [True, True]
    out = tmp_path / "train"
    assert train_mod.main(["--config", tiny, "--compile", "--steps", "1", "--attention", "llsa", "--threads", "1",
                           "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "training steps under torch.compile (--compile)" in printed
    assert " compiled |" in printed  # the table's s/step
    assert json.loads((out / "llsa-seed0" / "summary.json").read_text())["compiled"] is True
    # The checkpoint holds the model's own state (no torch.compile "_orig_mod." prefix): it loads
    # into a plain model, and the run resumes eagerly.
    ckpt = torch.load(out / "llsa-seed0" / "checkpoint.pt", weights_only=False)
    PixelDiT(config_mod.load(tiny).model).load_state_dict(ckpt["model"])
    assert train_mod.main(["--config", tiny, "--steps", "2", "--attention", "llsa", "--threads", "1",
                           "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "resuming from step 1" in printed and " compiled |" not in printed
    assert json.loads((out / "llsa-seed0" / "summary.json").read_text())["compiled"] is False


def test_a_graph_break_is_an_error_naming_the_option():
    # fullgraph: what torch.compile cannot put in one graph fails, naming the option, rather than
    # running partly eager.
    class Breaks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(()))

        def forward(self, x, t):
            torch._dynamo.graph_break()
            return x * self.scale

    cfg = config_mod.load(CONFIGS / "tiny.json")
    model = Breaks()
    optimizer = train_mod.make_optimizer(cfg, model)
    with pytest.raises(RuntimeError, match=r"train\.compile \(--compile\): torch.compile could not compile"):
        train_mod.train_step(cfg, model, train_mod.compiled_forward(model), optimizer,
                             train_mod.train_batch(cfg, 0, 0), 1e-3)


# ---- bf16 autocast (--bf16) ---------------------------------------------------------------------

def test_bf16_option_is_cuda_only_and_named(tmp_path, capsys):
    """--bf16 turns on train.autocast_bf16; on the CPU it says it trains in f32 and does (the
    summary records no autocast); with --throughput (which has its own switch) it is refused."""
    tiny = str(CONFIGS / "tiny.json")
    out = tmp_path / "train"
    assert train_mod.main(["--config", tiny, "--bf16", "--steps", "1", "--attention", "full", "--threads", "1",
                           "--out", str(out)]) == 0
    assert "train.autocast_bf16 applies on CUDA only: training in f32 on cpu" in capsys.readouterr().out
    assert json.loads((out / "full-seed0" / "summary.json").read_text())["autocast_bf16"] is False
    with pytest.raises(SystemExit, match="--bf16: throughput mode"):
        train_mod.main(["--config", tiny, "--bf16", "--throughput"])
    # The flag is part of what a checkpoint must agree with: the same run without it is refused.
    cfg = config_mod.load(tiny)
    with pytest.raises(ValueError, match="train differ"):
        train_mod.train_run(cfg, "full", 0, out / "full-seed0", num_threads=1, log=lambda message: None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("kind", ["full", "llsa"])
def test_bf16_training_step_on_cuda_tracks_f32(kind):
    """One training step of a head-width-64 model on CUDA under bf16 autocast against the same
    step in f32: bf16 keeps 8 mantissa bits (relative rounding 2^-9 per product), and the loss, a
    mean of 3*16*16*2 squared errors, lands within 2% of the f32 loss (measured well inside);
    the step changes the weights and leaves them finite."""
    cfg = config_mod.override(config_mod.load(CONFIGS / "tiny.json"), **{
        "model.image_size": 16, "model.width": 128, "model.heads": 2, "llsa.block": 16, "llsa.topk": 4})
    losses, weights = {}, {}
    for amp in (False, True):
        c = config_mod.override(cfg, **{"train.autocast_bf16": amp})
        model = train_mod.build_model(c, c.spec(kind), 0, "cuda")
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = train_mod.make_optimizer(c, model)
        x0, eps, t = (v.cuda() for v in train_mod.train_batch(c, 0, 0))
        losses[amp] = train_mod.train_step(c, model, model, optimizer, (x0, eps, t), 1e-3)
        weights[amp] = [p.detach() for p in model.parameters()]
        assert all(torch.isfinite(p).all() for p in weights[amp])
        assert any(not torch.equal(a, b) for a, b in zip(before, weights[amp]))
    assert abs(losses[True] - losses[False]) / losses[False] < 2e-2


# ---- EMA weights (train.ema) --------------------------------------------------------------------

def test_update_ema_is_the_moving_average():
    cfg = small_config()
    a, b = randomised(PixelDiT(cfg), seed=1), randomised(PixelDiT(cfg), seed=2)
    want = {k: 0.75 * v + 0.25 * b.state_dict()[k] for k, v in a.state_dict().items()}
    train_mod.update_ema(a, b, 0.75)
    for k, v in a.state_dict().items():
        assert torch.allclose(v, want[k], rtol=0, atol=1e-6), k


def test_ema_decay_is_lower_early_then_the_configured_one():
    assert train_mod.ema_decay(0.999, 1) == pytest.approx(2 / 11)
    assert train_mod.ema_decay(0.999, 100) == pytest.approx(101 / 110)
    assert train_mod.ema_decay(0.999, 100000) == 0.999
    share = 1.0  # what is left of the initial weights after 2000 steps
    for step in range(1, 2001):
        share *= train_mod.ema_decay(0.999, step)
    assert share < 1e-4 < 0.999 ** 2000


def test_ema_weights_are_evaluated_and_sampled(tmp_path):
    """With train.ema the checkpoint carries the average beside the trained weights, they differ,
    and the summary's held-out loss is the average's (not the trained weights')."""
    cfg = config_mod.override(config_mod.load(CONFIGS / "tiny.json"), **{"train.steps": 4, "train.ema": 0.5,
                                                                         "attention": ["llsa"]})
    torch.set_num_threads(1)
    summary = train_mod.train_run(cfg, "llsa", 0, tmp_path, num_threads=1, log=lambda message: None)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert summary["ema"] == 0.5
    assert any(not torch.equal(v, ckpt["ema"][k]) for k, v in ckpt["model"].items())
    heldout = train_mod.heldout_set(cfg)
    for weights, same in (("ema", True), ("model", False)):
        m = train_mod.build_model(cfg, cfg.spec("llsa", 1), 0, "cpu")
        m.load_state_dict(ckpt[weights])
        assert (train_mod.evaluate(m, heldout, cfg, "cpu") == summary["heldout_loss"]) is same, weights
    printed = []
    train_mod.run_experiment(cfg, [0], tmp_path / "experiment", num_threads=1, log=printed.append)
    assert any("EMA weights (decay 0.5) scored and sampled" in line for line in printed)
    assert "EMA weights (decay 0.5)" in (tmp_path / "experiment" / "results.md").read_text()
    with pytest.raises(ValueError, match=r"train.ema: expected a decay in \[0, 1\)"):
        config_mod.override(cfg, **{"train.ema": 1.0}).validate()
