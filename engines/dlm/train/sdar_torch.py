"""The engine's `sdar` architecture in PyTorch (block diffusion, Qwen3 shape), for training:
the same equations as engines/dlm/model_sdar.cpp and the same Hugging Face weight names, so
that an exported directory loads in the engine unchanged.

Per layer (no biases; grouped-query attention):
    q, k = rms_per_head(q_proj(rms(x))), rms_per_head(k_proj(rms(x)))      (q_norm, k_norm)
    h    = x + o_proj(attention(rope(q), rope(k), v_proj(rms(x))))
    out  = h + down_proj(silu(gate_proj(rms(h))) * up_proj(rms(h)))
then model.norm and the head (the embedding when tie_word_embeddings). RoPE is NeoX style
(rotate half) with rope_theta; attention scale 1/sqrt(head_dim).

`arch="llada"` is the same stack without the QK norm, fully bidirectional, exported with LLaDA's
weight names (engines/dlm/model_llada.cpp): the bidirectional model BA-Att's full canvases need.

Attention takes an explicit pattern: a boolean mask (SDPA; any device) or a FlexAttention
block mask (the GPU path of training), so the same module runs the engine's block-causal
canvas and the two-stream block-diffusion training sequence (train_sdar.py).
"""
import json
import math
import os
import struct
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class SdarConfig:
    vocab_size: int = 4096
    dim: int = 384
    layers: int = 8
    heads: int = 6
    kv_heads: int = 2
    head_dim: int = 64
    hidden: int = 1024
    block_size: int = 16
    max_len: int = 16384
    rope_theta: float = 1e6
    eps: float = 1e-6
    mask_id: int = 1
    eos_id: int = 0
    arch: str = "sdar"  # or "llada": the same blocks without QK norm, fully bidirectional (docs/eval.md)

    def hf_config(self, dtype):
        if self.arch == "llada":
            return {
                "model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": self.dim,
                "n_layers": self.layers, "n_heads": self.heads, "n_kv_heads": self.kv_heads,
                "mlp_hidden_size": self.hidden, "vocab_size": self.vocab_size, "embedding_size": self.vocab_size,
                "rms_norm_eps": self.eps, "rope": True, "rope_theta": self.rope_theta, "rope_scaling": None,
                # the remask loop rounds the answer up to whole blocks of 32: room for it past max_len
                "max_sequence_length": self.max_len + 64, "mask_token_id": self.mask_id,
                "eos_token_id": self.eos_id, "pad_token_id": self.eos_id, "weight_tying": True,
                "block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu", "include_bias": False,
                "alibi": False, "attention_layer_norm": False, "scale_logits": False, "input_emb_norm": False,
                "torch_dtype": {"bf16": "bfloat16", "f32": "float32"}[dtype],
            }
        return {
            "model_type": "sdar", "architectures": ["SDARForCausalLM"], "hidden_size": self.dim,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "intermediate_size": self.hidden,
            "vocab_size": self.vocab_size, "rms_norm_eps": self.eps, "rope_theta": self.rope_theta,
            "rope_scaling": None, "max_position_embeddings": self.max_len, "block_size": self.block_size,
            "mask_token_id": self.mask_id, "eos_token_id": self.eos_id, "pad_token_id": self.eos_id,
            "bos_token_id": self.eos_id, "tie_word_embeddings": True, "attention_bias": False,
            "hidden_act": "silu", "torch_dtype": {"bf16": "bfloat16", "f32": "float32"}[dtype],
        }


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # f64 stays f64 (the tests' reference)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


def rope_tables(pos, head_dim, theta):
    """NeoX RoPE's cos and sin at positions pos [B, N]: [B, 1, N, head_dim/2] each, the angles
    in f64 (the engine's precision); computed once a forward, shared by every layer."""
    inv = theta ** (-torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float64) / head_dim)
    ang = (pos.to(torch.float64)[..., None] * inv)[:, None]
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    """x [B, heads, N, hd] rotated by rope_tables' cos and sin (NeoX: the two halves rotate
    together), in x's dtype."""
    hd = x.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Layer(nn.Module):
    def __init__(self, c: SdarConfig):
        super().__init__()
        self.c = c
        self.input_layernorm = RMSNorm(c.dim, c.eps)
        self.q_proj = nn.Linear(c.dim, c.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        if c.arch == "sdar":
            self.q_norm = RMSNorm(c.head_dim, c.eps)
            self.k_norm = RMSNorm(c.head_dim, c.eps)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.dim, bias=False)
        self.post_attention_layernorm = RMSNorm(c.dim, c.eps)
        self.gate_proj = nn.Linear(c.dim, c.hidden, bias=False)
        self.up_proj = nn.Linear(c.dim, c.hidden, bias=False)
        self.down_proj = nn.Linear(c.hidden, c.dim, bias=False)

    # The layer in two halves around attention (forward), each a fixed graph of matrix products
    # and elementwise work that `compile_layers` can fuse; the attention between them takes any
    # pattern (a mask, a flex block mask).
    def qkv(self, x, cos, sin):
        """q [B, heads, N, hd], k and v [B, kv_heads, N, hd]: normed, projected, RoPE applied."""
        c = self.c
        B, N, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, N, c.heads, c.head_dim)
        k = self.k_proj(h).view(B, N, c.kv_heads, c.head_dim)
        if c.arch == "sdar":  # llada has no QK norm
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(h).view(B, N, c.kv_heads, c.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def rest(self, x, a):
        """The residual stream after attention's output a [B, heads, N, hd]: o_proj, then the MLP."""
        B, N, _ = x.shape
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, N, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def forward(self, x, tables, attn, halves=None):
        """tables: rope_tables' (cos, sin); halves: compiled (qkv, rest) or None (compile_layers)."""
        qkv, rest = halves or (Layer.qkv, Layer.rest)
        q, k, v = qkv(self, x, *tables)
        return rest(self, x, attn(q, k, v))


def sdpa_attention(mask):
    """Attention over a boolean mask [B, N, N] (True: the query sees the key)."""
    def attn(q, k, v):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # query head h reads kv head h // g
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
    return attn


def flex_attention_fn(block_mask, compiled=None):
    from torch.nn.attention.flex_attention import flex_attention
    fn = compiled or flex_attention

    def attn(q, k, v):
        return fn(q, k, v, block_mask=block_mask, enable_gqa=True)
    return attn


def qk_gain_init(c: SdarConfig):
    """The initial gain of the per-head q and k RMSNorms. After QK-norm |q| = g_q·sqrt(d) and
    |k| = g_k·sqrt(d), so no attention logit q·k/sqrt(d) can exceed g_q·g_k·sqrt(d): 8 at d = 64
    with gains of 1, while singling out one key among n takes a margin of about ln(n) (9 at
    8K) plus what separates it from its neighbours. The gains start where the bound is
    2·ln(max_len), so sharp long-range attention is reachable from the first step; random
    directions still give logits of spread g_q·g_k (about 2.4 at d = 64, 16K), not sharp ones."""
    return math.sqrt(2.0 * math.log(c.max_len) / math.sqrt(c.head_dim))


class Sdar(nn.Module):
    def __init__(self, c: SdarConfig):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList([Layer(c) for _ in range(c.layers)])
        self.norm = RMSNorm(c.dim, c.eps)
        self.halves = None  # compile_layers
        self.reset_parameters()

    def reset_parameters(self):
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scale = 1.0 / math.sqrt(2 * self.c.layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                nn.init.normal_(p, std=std * scale)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                nn.init.constant_(p, qk_gain_init(self.c))

    def hidden(self, ids, pos, attn):
        x = self.embed_tokens(ids)
        tables = rope_tables(pos, self.c.head_dim, self.c.rope_theta)
        for layer in self.layers:
            x = layer(x, tables, attn, self.halves)
        return self.norm(x)

    def compile_layers(self):
        """torch.compile each layer's two halves (Layer.qkv, Layer.rest: one compiled graph each,
        shared by every layer, whose weights are its inputs), fusing the norms, RoPE, SwiGLU
        and the casts around the matrix products; attention stays as given. The weights and
        the state_dict are unchanged."""
        self.halves = (torch.compile(Layer.qkv, dynamic=False), torch.compile(Layer.rest, dynamic=False))

    def head(self, h):
        return h @ self.embed_tokens.weight.to(h.dtype).T  # tied

    def forward(self, ids, pos, attn):
        return self.head(self.hidden(ids, pos, attn))

    # ---- the engine's own canvas (sparsa logits): block-causal over block_size (sdar),
    # bidirectional (llada) ----
    def canvas_logits(self, ids):
        ids = torch.as_tensor(ids, device=self.embed_tokens.weight.device)[None]
        n = ids.shape[1]
        block = self.c.block_size if self.c.arch == "sdar" else n
        blk = torch.arange(n, device=ids.device) // block
        mask = (blk[None, :] <= blk[:, None])[None]
        pos = torch.arange(n, device=ids.device)[None]
        return self.forward(ids, pos, sdpa_attention(mask))[0]


# ---- an sdar model as a bidirectional (llada) one: the QK norm folded into the projections ----

@torch.no_grad()
def qk_rms(model: Sdar, canvases):
    """Mean over the canvases' tokens of each head's q and k root-mean-square before the QK norm:
    ([layers, heads], [layers, kv_heads]) in f64. canvases: token id lists, each run on its own."""
    c = model.c
    sums = [torch.zeros(c.layers, c.heads, dtype=torch.float64), torch.zeros(c.layers, c.kv_heads, dtype=torch.float64)]
    count = 0
    hooks = []
    for i, L in enumerate(model.layers):
        for j, (proj, heads) in enumerate(((L.q_proj, c.heads), (L.k_proj, c.kv_heads))):
            def hook(_m, _inp, out, i=i, j=j, heads=heads):
                x = out.to(torch.float64).reshape(-1, heads, c.head_dim)
                sums[j][i] += x.pow(2).mean(-1).sqrt().sum(0)
            hooks.append(proj.register_forward_hook(hook))
    try:
        for ids in canvases:
            model.canvas_logits(ids)
            count += len(ids)
    finally:
        for h in hooks:
            h.remove()
    if count == 0:
        raise ValueError("qk_rms: no tokens to measure")
    return sums[0] / count, sums[1] / count


@torch.no_grad()
def fold_qk_norm(src: Sdar, q_rms, k_rms):
    """A llada model with src's weights where each head's QK RMSNorm becomes a fixed scale:
    W'_q = diag(g_q) W_q / rms_q (per layer and head; rms from qk_rms), the same for k. A token
    whose projection has the head's mean rms then gets exactly the normed q; others are off by
    their rms' ratio to the mean, which fine-tuning absorbs. Every other weight is copied."""
    if src.c.arch != "sdar":
        raise ValueError(f"fold_qk_norm: the source is {src.c.arch}, expected sdar")
    c = replace(src.c, arch="llada")
    dst = Sdar(c).to(next(src.parameters()).dtype)
    state = {k: v for k, v in src.state_dict().items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
    dst.load_state_dict(state)
    for i, (a, b) in enumerate(zip(src.layers, dst.layers)):
        for norm, proj, out, rms in ((a.q_norm, a.q_proj, b.q_proj, q_rms[i]), (a.k_norm, a.k_proj, b.k_proj, k_rms[i])):
            w = proj.weight.to(torch.float64).view(rms.numel(), c.head_dim, -1)
            w = w * norm.weight.to(torch.float64)[None, :, None] / rms.to(torch.float64)[:, None, None]
            out.weight.copy_(w.reshape(out.weight.shape).to(out.weight.dtype))
    return dst


# ---- Hugging Face export / import (the engine's format) ----------------------------------------

def hf_tensors(model: Sdar):
    """(name, tensor) in the engine's names (SDAR's or LLaDA's); the head is tied, so no
    lm_head.weight / transformer.ff_out.weight."""
    if model.c.arch == "llada":
        p = "model.transformer."
        out = [(p + "wte.weight", model.embed_tokens.weight)]
        for i, L in enumerate(model.layers):
            b = f"{p}blocks.{i}."
            out += [
                (b + "attn_norm.weight", L.input_layernorm.weight), (b + "q_proj.weight", L.q_proj.weight),
                (b + "k_proj.weight", L.k_proj.weight), (b + "v_proj.weight", L.v_proj.weight),
                (b + "attn_out.weight", L.o_proj.weight), (b + "ff_norm.weight", L.post_attention_layernorm.weight),
                (b + "ff_proj.weight", L.gate_proj.weight), (b + "up_proj.weight", L.up_proj.weight),
                (b + "ff_out.weight", L.down_proj.weight),
            ]
        return out + [(p + "ln_f.weight", model.norm.weight)]
    out = [("model.embed_tokens.weight", model.embed_tokens.weight)]
    for i, L in enumerate(model.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", L.input_layernorm.weight),
            (p + "self_attn.q_proj.weight", L.q_proj.weight), (p + "self_attn.k_proj.weight", L.k_proj.weight),
            (p + "self_attn.v_proj.weight", L.v_proj.weight), (p + "self_attn.q_norm.weight", L.q_norm.weight),
            (p + "self_attn.k_norm.weight", L.k_norm.weight), (p + "self_attn.o_proj.weight", L.o_proj.weight),
            (p + "post_attention_layernorm.weight", L.post_attention_layernorm.weight),
            (p + "mlp.gate_proj.weight", L.gate_proj.weight), (p + "mlp.up_proj.weight", L.up_proj.weight),
            (p + "mlp.down_proj.weight", L.down_proj.weight),
        ]
    out.append(("model.norm.weight", model.norm.weight))
    return out


def _tensor_bytes(t, dtype):
    t = t.detach().cpu().contiguous()
    if dtype == "bf16":
        return "BF16", t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    return "F32", t.to(torch.float32).numpy().tobytes()


def write_safetensors(path, entries):
    """entries: (name, dtype string, shape, bytes). The format: an 8-byte little-endian header
    length, the JSON header (padded with spaces to 8 bytes), then the data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dt, shape, data in entries:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, data in entries:
            f.write(data)


def read_safetensors(path):
    """{name: tensor} of one safetensors file (BF16, F16 or F32), the inverse of write_safetensors."""
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: too short for a safetensors header")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise ValueError(f"{path}: header length {n} exceeds the file")
    try:
        header = json.loads(raw[8:8 + n])
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deeply
        raise ValueError(f"{path}: the header is not JSON ({str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is a JSON {type(header).__name__}, expected an object")
    base, out = 8 + n, {}

    def whole(x):
        return type(x) is int and x >= 0

    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(e, dict) or not isinstance(e.get("dtype"), str) or e["dtype"] not in dtypes:
            dtype = e.get("dtype") if isinstance(e, dict) else e
            raise ValueError(f"{path}: {name}: dtype {dtype} (expected BF16, F16 or F32)")
        offsets, shape = e.get("data_offsets"), e.get("shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(whole, offsets))):
            raise ValueError(f"{path}: {name}: data_offsets {offsets} (expected two byte offsets)")
        if not (isinstance(shape, list) and all(map(whole, shape))):
            raise ValueError(f"{path}: {name}: shape {shape} (expected a list of non-negative integers)")
        lo, hi = offsets
        if not 0 <= lo <= hi <= len(raw) - base:
            raise ValueError(f"{path}: {name}: data_offsets {lo}..{hi} outside the file")
        if hi - lo != math.prod(shape) * dtypes[e["dtype"]].itemsize:
            raise ValueError(f"{path}: {name}: data_offsets {lo}..{hi} do not fit shape {e['shape']}")
        t = torch.frombuffer(bytearray(raw[base + lo:base + hi]), dtype=dtypes[e["dtype"]])
        out[name] = t.reshape(e["shape"]).clone()
    return out


def import_hf(model: Sdar, out_dir):
    """Loads an export_hf directory's weights into `model` (same names, any stored dtype): the
    inverse of export_hf, so training can continue from a shipped or exported model."""
    index = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{index}: not JSON ({str(e)[:200]})") from None
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) and f and os.path.basename(f) == f for f in weight_map.values()):
            raise ValueError(f"{index}: weight_map: expected an object of tensor names to file names in its folder")
        files = sorted(set(weight_map.values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(read_safetensors(os.path.join(out_dir, name)))
    for name, p in hf_tensors(model):
        if name not in tensors:
            raise ValueError(f"{out_dir}: no tensor {name}")
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise ValueError(f"{out_dir}: {name}: shape {tuple(tensors[name].shape)}, the model's {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(tensors[name].to(p.dtype))
    return model


def export_hf(model: Sdar, out_dir, dtype="bf16", shard_bytes=16 * 1024 * 1024, tokenizer_json=None, extra=None):
    """config.json, model.safetensors (or shards of at most shard_bytes each, with
    model.safetensors.index.json when the weights exceed it) and tokenizer.json."""
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):  # a previous export's shards must not linger
        if f.startswith("model") and (f.endswith(".safetensors") or f.endswith(".index.json")):
            os.remove(os.path.join(out_dir, f))
    entries = []
    for name, t in hf_tensors(model):
        dt, data = _tensor_bytes(t, dtype)
        entries.append((name, dt, tuple(t.shape), data))
    total = sum(len(e[3]) for e in entries)
    shards, cur, size = [], [], 0
    for e in entries:
        if cur and size + len(e[3]) > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += len(e[3])
    shards.append(cur)
    if len(shards) == 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), shards[0])
    else:
        weight_map = {}
        for i, part in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(out_dir, fname), part)
            weight_map.update({e[0]: fname for e in part})
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    config = model.c.hf_config(dtype)
    if extra:
        config.update(extra)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer_json:
        with open(tokenizer_json) as src, open(os.path.join(out_dir, "tokenizer.json"), "w") as dst:
            dst.write(src.read())
    return total, len(shards)


def config_dict(c: SdarConfig):
    return asdict(c)
