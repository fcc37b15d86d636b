"""An independent numpy reference of the DLM engine (float64), written from the model cards'
equations, plus tiny random model directories written as safetensors.

Architectures:
  llada: x -> embed; per layer: h = x + Wo·attn(rope(Wq·n(x)), rope(Wk·n(x)), Wv·n(x)) (bidirectional),
         out = h + Wdown·(silu(Wgate·n(h)) * Wup·n(h)); logits = Whead·n(out)
  sdar:  the same with per-head RMSNorm of q and k before RoPE, GQA, and block-causal attention.
  dream: llada's with GQA, biases on q, k and v, and logits shifted by one position (position i
         is predicted from the logits of i - 1; position 0 from its own).
  fast_dllm: dream's layers with sdar's block-causal attention (Fast-dLLM v2).
RoPE: NeoX rotate-half, inv_freq_i = theta^(-2i/d); linear scaling divides positions by the factor.
"""
import json
import os
import struct

import numpy as np

# ---------------------------------------------------------------- safetensors writing


def f32_to_bf16_bits(a):
    """Round-to-nearest-even f32 -> bf16 bit patterns (uint16)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounding = ((u >> 16) & 1) + 0x7FFF
    return ((u + rounding) >> 16).astype(np.uint16)


def bf16_bits_to_f32(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path, tensors):
    """tensors: list of (name, array, dtype) with dtype in F32, F16, BF16 (array f32)."""
    header, blobs, offset = {}, [], 0
    for name, arr, dtype in tensors:
        if dtype == "F32":
            data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        elif dtype == "F16":
            data = np.ascontiguousarray(arr, dtype="<f2").tobytes()
        elif dtype == "BF16":
            data = f32_to_bf16_bits(arr).astype("<u2").tobytes()
        else:
            data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    """{name: array} (F32, I32 as float32 / int32) and the __metadata__ dict of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    kinds = {"F32": "<f4", "I32": "<i4"}
    out = {}
    for name, e in header.items():
        a, b = e["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=kinds[e["dtype"]]).reshape(e["shape"])
    return out, meta


def stored(arr, dtype):
    """What the engine reads back from a tensor saved as dtype (as float64)."""
    if dtype == "BF16":
        return bf16_bits_to_f32(f32_to_bf16_bits(arr)).astype(np.float64)
    if dtype == "F16":
        return arr.astype(np.float16).astype(np.float64)
    return arr.astype(np.float32).astype(np.float64)


# ---------------------------------------------------------------- tiny models

LLADA_NAMES = {
    "embed": "model.transformer.wte.weight",
    "final_norm": "model.transformer.ln_f.weight",
    "head": "model.transformer.ff_out.weight",
    "layer": "model.transformer.blocks.{}.",
    "attn_norm": "attn_norm.weight", "wq": "q_proj.weight", "wk": "k_proj.weight", "wv": "v_proj.weight",
    "wo": "attn_out.weight", "ffn_norm": "ff_norm.weight", "w_gate": "ff_proj.weight", "w_up": "up_proj.weight",
    "w_down": "ff_out.weight",
}
SDAR_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "head": "lm_head.weight",
    "layer": "model.layers.{}.",
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "ffn_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
}

DREAM_NAMES = dict(SDAR_NAMES, bq="self_attn.q_proj.bias", bk="self_attn.k_proj.bias", bv="self_attn.v_proj.bias")


class Spec:
    def __init__(self, arch="llada", dim=64, layers=2, heads=4, kv_heads=None, head_dim=None, hidden=96, vocab=80,
                 theta=10000.0, max_len=256, block=4, mask_id=None, eos=None, rope_scaling=None, eps=1e-5,
                 dtype="F32", shards=1, tied=False):
        self.arch, self.dim, self.layers, self.heads = arch, dim, layers, heads
        self.kv_heads = kv_heads if kv_heads is not None else heads
        self.head_dim = head_dim if head_dim is not None else dim // heads
        self.hidden, self.vocab, self.theta, self.max_len, self.block = hidden, vocab, theta, max_len, block
        self.mask_id = mask_id if mask_id is not None else vocab - 1
        self.eos = eos if eos is not None else vocab - 2
        self.rope_scaling, self.eps, self.dtype, self.shards, self.tied = rope_scaling, eps, dtype, shards, tied


def config_json(s):
    if s.arch == "llada":
        c = {"model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": s.dim, "n_layers": s.layers,
             "n_heads": s.heads, "n_kv_heads": s.kv_heads, "mlp_hidden_size": s.hidden, "mlp_ratio": 4,
             "vocab_size": s.vocab, "embedding_size": s.vocab, "rms_norm_eps": s.eps, "rope": True,
             "rope_theta": s.theta, "max_sequence_length": s.max_len, "mask_token_id": s.mask_id,
             "eos_token_id": s.eos, "pad_token_id": s.eos, "weight_tying": s.tied, "block_type": "llama",
             "layer_norm_type": "rms", "activation_type": "silu", "include_bias": False, "alibi": False,
             "attention_layer_norm": False, "scale_logits": False, "input_emb_norm": False}
    elif s.arch == "fast_dllm":  # Fast-dLLM v2: Qwen2's config with bd_size, no mask_token_id (its default)
        c = {"model_type": "Fast_dLLM_Qwen", "architectures": ["Fast_dLLM_QwenForCausalLM"], "hidden_size": s.dim,
             "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
             "intermediate_size": s.hidden, "vocab_size": s.vocab, "rms_norm_eps": s.eps, "rope_theta": s.theta,
             "max_position_embeddings": s.max_len, "bd_size": s.block, "eos_token_id": s.eos,
             "tie_word_embeddings": s.tied, "hidden_act": "silu", "use_sliding_window": False,
             "torch_dtype": "bfloat16"}
        if s.mask_id != 151665:
            c["mask_token_id"] = s.mask_id
    elif s.arch == "dream":
        c = {"model_type": "Dream", "architectures": ["DreamModel"], "hidden_size": s.dim,
             "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
             "intermediate_size": s.hidden, "vocab_size": s.vocab, "rms_norm_eps": s.eps, "rope_theta": s.theta,
             "max_position_embeddings": s.max_len, "mask_token_id": s.mask_id, "eos_token_id": s.eos,
             "pad_token_id": s.eos, "tie_word_embeddings": s.tied, "hidden_act": "silu", "use_sliding_window": False,
             "torch_dtype": "bfloat16"}
    else:
        c = {"model_type": "sdar", "architectures": ["SDARForCausalLM"], "hidden_size": s.dim,
             "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
             "head_dim": s.head_dim, "intermediate_size": s.hidden, "vocab_size": s.vocab, "rms_norm_eps": s.eps,
             "rope_theta": s.theta, "max_position_embeddings": s.max_len, "block_size": s.block,
             "mask_token_id": s.mask_id, "eos_token_id": s.eos, "tie_word_embeddings": s.tied,
             "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}
    if s.rope_scaling is not None:
        c["rope_scaling"] = s.rope_scaling
    return c


def random_weights(s, seed):
    """float32 weights, scaled so the logits are peaked (distinct confidences)."""
    rng = np.random.default_rng(seed)
    d, hd, qd, kvd, f = s.dim, s.head_dim, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden

    def lin(o, i, gain=1.0):
        return (rng.standard_normal((o, i)) * gain / np.sqrt(i)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"embed": rng.standard_normal((s.vocab, d)).astype(np.float32), "layers": []}
    for _ in range(s.layers):
        L = {"attn_norm": norm(d), "wq": lin(qd, d, 2.0), "wk": lin(kvd, d, 2.0), "wv": lin(kvd, d), "wo": lin(d, qd),
             "ffn_norm": norm(d), "w_gate": lin(f, d), "w_up": lin(f, d), "w_down": lin(d, f)}
        if s.arch == "sdar":
            L["q_norm"] = norm(hd)
            L["k_norm"] = norm(hd)
        if s.arch in ("dream", "fast_dllm"):
            L["bq"] = (0.5 * rng.standard_normal(qd)).astype(np.float32)
            L["bk"] = (0.5 * rng.standard_normal(kvd)).astype(np.float32)
            L["bv"] = (0.5 * rng.standard_normal(kvd)).astype(np.float32)
        w["layers"].append(L)
    w["final_norm"] = norm(d)
    w["head"] = lin(s.vocab, d, 4.0)
    return w


def tensor_list(s, w):
    names = {"llada": LLADA_NAMES, "sdar": SDAR_NAMES, "dream": DREAM_NAMES, "fast_dllm": DREAM_NAMES}[s.arch]
    out = [(names["embed"], w["embed"])]
    for l, L in enumerate(w["layers"]):
        p = names["layer"].format(l)
        for key, arr in L.items():
            out.append((p + names[key], arr))
    out.append((names["final_norm"], w["final_norm"]))
    if not s.tied:
        out.append((names["head"], w["head"]))
    return out


def write_model(dirpath, s, seed=0, extra_files=None):
    """Writes config.json and the safetensors (sharded when s.shards > 1); returns the float64
    weights the engine will see (rounded to the stored dtype)."""
    os.makedirs(dirpath, exist_ok=True)
    w = random_weights(s, seed)
    if s.tied:
        w["head"] = w["embed"]
    with open(os.path.join(dirpath, "config.json"), "w") as f:
        json.dump(config_json(s), f)
    tensors = tensor_list(s, w)
    # norms stay f32 in a bf16 checkpoint when asked ("mixed"), like many exports
    def dtype_of(name, arr):
        if s.dtype == "mixed":
            return "F32" if arr.ndim == 1 else "BF16"
        return s.dtype
    if s.shards == 1:
        write_safetensors(os.path.join(dirpath, "model.safetensors"), [(n, a, dtype_of(n, a)) for n, a in tensors])
    else:
        per = -(-len(tensors) // s.shards)
        weight_map = {}
        for k in range(s.shards):
            fname = f"model-{k + 1:05d}-of-{s.shards:05d}.safetensors"
            part = tensors[k * per:(k + 1) * per]
            write_safetensors(os.path.join(dirpath, fname), [(n, a, dtype_of(n, a)) for n, a in part])
            for n, _ in part:
                weight_map[n] = fname
        with open(os.path.join(dirpath, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    seen = {"embed": stored(w["embed"], dtype_of("", w["embed"])), "layers": []}
    for L in w["layers"]:
        seen["layers"].append({k: stored(a, dtype_of("", a)) for k, a in L.items()})
    seen["final_norm"] = stored(w["final_norm"], dtype_of("", w["final_norm"]))
    seen["head"] = seen["embed"] if s.tied else stored(w["head"], dtype_of("", w["head"]))
    return seen


# ---------------------------------------------------------------- the reference forward


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, s):
    """x [n, heads, hd] at positions pos [n]."""
    hd = x.shape[-1]
    theta, scale = s.theta, 1.0
    rs = s.rope_scaling
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "linear":
            scale = 1.0 / rs["factor"]
        elif kind in ("dynamic", "ntk"):
            theta = theta * rs["factor"] ** (hd / (hd - 2))
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = (pos.astype(np.float64) * scale)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(q, k, v, allowed):
    """q [n, H, d], k/v [m, Hkv, d], allowed [n, m] bool -> [n, H, d]."""
    H, Hkv = q.shape[1], k.shape[1]
    g = H // Hkv
    k = np.repeat(k, g, axis=1)
    v = np.repeat(v, g, axis=1)
    logits = np.einsum("nhd,mhd->hnm", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(allowed[None], logits, -np.inf)
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hnm,mhd->nhd", p, v)


def forward(s, w, tokens, past=None, block_causal=0, capture=None, shifted=True, after=None):
    """tokens at positions [len(past), len(past)+n) over past K/V (a list per layer of (k, v) arrays
    [m, Hkv, hd], all visible); returns logits [n, vocab] and the chunk's (k, v) per layer.
    capture: a list that receives each layer's (q, k, v) of the chunk, [n, heads, hd], after RoPE.
    after: more visible K/V per layer, of positions after the chunk (a dual cache's suffix)."""
    tokens = np.asarray(tokens)
    n = len(tokens)
    m = 0 if past is None else past[0][0].shape[0]
    a_len = 0 if after is None else after[0][0].shape[0]
    pos = np.arange(m, m + n)
    if block_causal:
        own = (pos[None, :] // block_causal) <= (pos[:, None] // block_causal)
    else:
        own = np.ones((n, n), bool)
    allowed = np.concatenate([np.ones((n, m), bool), own, np.ones((n, a_len), bool)], axis=1)
    x = w["embed"][tokens]
    H, Hkv, hd = s.heads, s.kv_heads, s.head_dim
    kv = []
    for l, L in enumerate(w["layers"]):
        h = rms(x, L["attn_norm"], s.eps)
        q, k, v = h @ L["wq"].T, h @ L["wk"].T, h @ L["wv"].T
        if s.arch in ("dream", "fast_dllm"):
            q, k, v = q + L["bq"], k + L["bk"], v + L["bv"]
        q, k, v = q.reshape(n, H, hd), k.reshape(n, Hkv, hd), v.reshape(n, Hkv, hd)
        if s.arch == "sdar":
            q = rms(q, L["q_norm"], s.eps)
            k = rms(k, L["k_norm"], s.eps)
        q, k = rope(q, pos, s), rope(k, pos, s)
        kv.append((k, v))
        if capture is not None:
            capture.append((q, k, v))
        if past is not None:
            k = np.concatenate([past[l][0], k], axis=0)
            v = np.concatenate([past[l][1], v], axis=0)
        if after is not None:
            k = np.concatenate([k, after[l][0]], axis=0)
            v = np.concatenate([v, after[l][1]], axis=0)
        a = attention(q, k, v, allowed).reshape(n, H * hd)
        x = x + a @ L["wo"].T
        h = rms(x, L["ffn_norm"], s.eps)
        g = h @ L["w_gate"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ L["w_up"].T)) @ L["w_down"].T
    logits = rms(x, w["final_norm"], s.eps) @ w["head"].T
    if shifted and s.arch in ("dream", "fast_dllm"):  # position i predicted from the logits of i - 1; position 0 from its own;
        # over a cached prefix the chunk's first position has no row before it here (NaN)
        first = logits[:1] if m == 0 else np.full_like(logits[:1], np.nan)
        logits = np.concatenate([first, logits[:-1]], axis=0)
    return logits, kv


def canvas_logits(s, w, tokens):
    return forward(s, w, tokens, None, s.block if s.arch in ("sdar", "fast_dllm") else 0)[0]


# ---------------------------------------------------------------- reference loops (temperature 0)


MASK64 = (1 << 64) - 1


class SplitMix64:
    """The engine's sampler generator (sampler.cpp), so that sampling at temperature > 0 can be
    compared draw for draw: request r of a batch starts at seed ^ (0x9E3779B97F4A7C15 * (r + 1))."""

    def __init__(self, seed, request):
        self.state = (seed ^ ((0x9E3779B97F4A7C15 * (request + 1)) & MASK64)) & MASK64

    def uniform(self):  # (0, 1)
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        z = z ^ (z >> 31)
        return ((z >> 11) + 0.5) / 9007199254740992.0


# Decision margins of the reference loops, for comparisons at reduced precision: when MARGINS is a
# list, every greedy pick appends ("logit", top-1 minus top-2 logit), every top-k choice ("logconf",
# log of the k-th over the (k+1)-th confidence) and every threshold test ("logthr", |log(conf /
# threshold)|). A backend whose logits are within e of these can only decide otherwise where a
# logit margin is below 2e or a log-confidence margin below 4e.
MARGINS = None


def _note(kind, value):
    if MARGINS is not None:
        MARGINS.append((kind, float(value)))


def allowed_tokens(logits, temperature=0.0, top_p=1.0, top_k=0):
    """Dream's sample_tokens filters: top_p keeps the most probable tokens of softmax(logits / T)
    while the mass before them is <= top_p (ties by the lower id), then top_k the k largest
    logits (ties with the k-th kept). A boolean mask, or None when no filter is on."""
    V = len(logits)
    if top_p >= 1 and not (0 < top_k < V):
        return None
    ok = np.ones(V, bool)
    if top_p < 1:
        z = logits / temperature if temperature > 0 else logits.astype(np.float64)
        p = np.exp(z - z.max())
        p /= p.sum()
        order = sorted(range(V), key=lambda i: (-logits[i], i))
        kept, mass = np.zeros(V, bool), 0.0
        for i in order:
            if mass > top_p:
                break
            kept[i] = True
            mass += p[i]
        ok &= kept
    if 0 < top_k < ok.sum():
        kth = np.sort(logits[ok])[::-1][top_k - 1]
        ok &= logits >= kth
    return ok


def confidence_of(logits, kind, temperature=0.0, allowed=None):
    """Dream's confidences of a position: margin (top-1 minus top-2 probability) or entropy (sum p
    log p) of softmax(logits / T) (T = 0: softmax(logits)), among the allowed tokens."""
    z = logits / temperature if temperature > 0 else logits
    if allowed is not None:
        z = np.where(allowed, z, -np.inf)
    z = z - z.max()
    p = np.exp(z)
    p /= p.sum()
    if kind == "entropy":
        return float(np.sum(p * np.log(np.maximum(p, 1e-300))))
    top2 = np.sort(p)[-2:]
    return float(top2[1] - top2[0])


def softmax_pick(logits, temperature=0.0, rng=None, allowed=None):
    """LLaDA's sampler: argmax of the logits, or Gumbel-max argmax(l - T log(-log u)) at T > 0
    (u drawn for every vocabulary entry in order, allowed or not), among the allowed tokens;
    confidence = softmax probability of the pick among them."""
    masked = logits if allowed is None else np.where(allowed, logits, -np.inf)
    z = masked - masked.max()
    p = np.exp(z)
    p /= p.sum()
    if temperature > 0:
        u = np.array([rng.uniform() for _ in range(len(logits))])
        t = int(np.argmax(masked - temperature * np.log(-np.log(u))))
    else:
        t = int(np.argmax(masked))
        if len(logits) > 1:
            top2 = np.sort(logits)[-2:]
            _note("logit", top2[1] - top2[0])
    return t, float(p[t])


def schedule(masks, steps):
    k = [masks // steps] * steps
    for i in range(masks % steps):
        k[i] += 1
    return k


def top(conf, k, kind="probability"):
    order = sorted(range(len(conf)), key=lambda i: (-conf[i], i))
    if 0 < k < len(conf):
        if kind == "probability":
            _note("logconf", np.log(conf[order[k - 1]]) - np.log(conf[order[k]]))
        else:
            _note("conf", conf[order[k - 1]] - conf[order[k]])
    return order[:k]


def _thr(conf, threshold):
    for c in conf:
        _note("logthr", abs(np.log(c) - np.log(threshold)))


def factor_count(conf, factor):
    """Fast-dLLM's factor rule (get_transfer_index_dynamic), written from its description: sorted
    confidences c_0 >= c_1 >= ..., bounds b_i = 1 - factor / (i + 2) (none for i = 0); the count is
    the first i whose c_i < b_i, else the last index; one more when it is 0 or the last index."""
    c = sorted(conf, reverse=True)
    n = len(c) - 1
    for i in range(1, len(c)):
        bound = 1.0 - factor / (i + 2)
        _note("logthr", abs(np.log(c[i]) - np.log(bound)) if c[i] > 0 and bound > 0 else np.inf)
        if c[i] < bound:
            n = i
            break
    if n <= 0 or n == len(c) - 1:
        n += 1
    return n


def cut(s, gen, stop=True):
    if not stop:
        return list(gen)
    out = []
    for t in gen:
        if t == s.eos:
            break
        out.append(t)
    return out


def sample_positions(conf, k, alg_temp, rng):
    """Dream's torch.multinomial(softmax(conf / alg_temp), k) (without replacement), drawn as the k
    largest of conf / alg_temp + Gumbel noise (one draw per position, in order)."""
    key = [c / alg_temp - np.log(-np.log(rng.uniform())) for c in conf]
    return sorted(range(len(conf)), key=lambda i: (-key[i], i))[:k]


def ref_dream(s, w, prompt, gen_len, steps, confidence="entropy", stop=True, eps=1e-3, temperature=0.0, top_p=1.0,
              top_k=0, seed=0, request=0, alg_temp=0.0):
    """Dream's loop: the whole canvas each step; step i (timesteps t_i = 1 - i (1 - eps) / steps)
    commits floor(n (1 - t_{i+1} / t_i)) of its n masked positions, the most confident ones (with
    alg_temp > 0: drawn with weights softmax(conf / alg_temp)), and the last step the rest; picks
    through the top_p / top_k filters."""
    rng = SplitMix64(seed, request)
    x = list(prompt) + [s.mask_id] * gen_len
    masked = [False] * len(prompt) + [True] * gen_len
    P = len(prompt)
    t = [1.0 - i * (1.0 - eps) / steps for i in range(steps + 1)]
    for i in range(steps):
        pos = [j for j in range(P, P + gen_len) if masked[j]]
        if not pos:
            break
        logits = canvas_logits(s, w, x)
        allowed = [allowed_tokens(logits[j], temperature, top_p, top_k) for j in pos]
        picks = [softmax_pick(logits[j], temperature, rng, a) for j, a in zip(pos, allowed)]
        conf = [p[1] for p in picks] if confidence == "probability" else \
            [confidence_of(logits[j], confidence, temperature, a) for j, a in zip(pos, allowed)]
        k = int(np.floor(len(pos) * (1.0 - t[i + 1] / t[i]))) if i + 1 < steps else len(pos)
        chosen = [] if k == 0 else sample_positions(conf, k, alg_temp, rng) if alg_temp > 0 else top(conf, k, confidence)
        for j in chosen:
            x[pos[j]] = picks[j][0]
            masked[pos[j]] = False
    return cut(s, x[P:], stop)


def ref_remask(s, w, prompt, gen_len, block_len, steps, stop=True, temperature=0.0, seed=0, request=0,
               threshold=0.0, confidence="probability", factor=0.0):
    x = list(prompt) + [s.mask_id] * gen_len
    masked = [False] * len(prompt) + [True] * gen_len
    P, nb = len(prompt), gen_len // block_len
    spb = steps // nb
    rng = SplitMix64(seed, request)
    for b in range(nb):
        lo, hi = P + b * block_len, P + (b + 1) * block_len
        sched = schedule(sum(masked[lo:hi]), spb)
        st = 0
        while (any(masked[lo:hi]) if threshold > 0 or factor > 0 else st < spb):
            logits = canvas_logits(s, w, x)
            pos = [i for i in range(lo, hi) if masked[i]]
            picks = [softmax_pick(logits[i], temperature, rng) for i in pos]
            conf = [p[1] for p in picks] if confidence == "probability" else \
                [confidence_of(logits[i], confidence, temperature) for i in pos]
            if factor > 0:  # Fast-dLLM's factor rule, no cache
                chosen = top(conf, factor_count(conf, factor))
            elif threshold > 0:  # Fast-dLLM's parallel decoding, no cache
                _thr(conf, threshold)
                first = top(conf, 1)
                chosen = first + [j for j in range(len(conf)) if j != first[0] and conf[j] >= threshold]
            else:
                chosen = top(conf, sched[st], confidence)
            st += 1
            for j in chosen:
                x[pos[j]] = picks[j][0]
                masked[pos[j]] = False
    return cut(s, x[P:], stop)


def cache_step_choice(conf, sched, st, threshold, factor):
    """The cached loops' commit rule (prefix_cache, dual_cache): the factor rule, or the most
    confident and every other at or above the threshold, or the schedule's top-k (at least one)."""
    if factor > 0:
        return top(conf, factor_count(conf, factor))
    if threshold > 0:
        _thr(conf, threshold)
        first = top(conf, 1)
        return first + [j for j in range(len(conf)) if j != first[0] and conf[j] >= threshold]
    return top(conf, max(sched[st] if st < len(sched) else 1, 1))


def cache_step(x, masked, logits, lo, hi, sched, st, threshold, factor):
    """One step of the cached loops: pick every masked position of [lo, hi) from its logits row,
    commit cache_step_choice's."""
    pos = [i for i in range(lo, hi) if masked[i]]
    picks = [softmax_pick(logits[i]) for i in pos]
    for j in cache_step_choice([p[1] for p in picks], sched, st, threshold, factor):
        x[pos[j]] = picks[j][0]
        masked[pos[j]] = False


def ref_prefix_cache(s, w, prompt, gen_len, block_len, steps, threshold, stop=True, factor=0.0):
    x = list(prompt) + [s.mask_id] * gen_len
    masked = [False] * len(prompt) + [True] * gen_len
    P, nb = len(prompt), gen_len // block_len
    spb = max(steps // nb, 1)
    sh = 1 if s.arch == "dream" else 0  # dream's block is predicted from the cached position before it too

    for b in range(nb):
        lo, hi = P + b * block_len, P + (b + 1) * block_len
        sched = schedule(sum(masked[lo:hi]), spb)
        logits, kv = forward(s, w, x)  # the whole canvas; keep the K/V of [0, lo - sh)
        past = [(k[:lo - sh], v[:lo - sh]) for k, v in kv]
        st = 0
        while any(masked[lo:hi]):
            if st > 0:
                logits_s, _ = forward(s, w, x[lo - sh:], past)
                logits = np.concatenate([np.zeros((lo - sh, logits_s.shape[1])), logits_s], axis=0)
            cache_step(x, masked, logits, lo, hi, sched, st, threshold, factor)
            st += 1
    return cut(s, x[P:], stop)


def ref_dual_cache(s, w, prompt, gen_len, block_len, steps, threshold, stop=True, factor=0.0):
    """Fast-dLLM's dual cache: per block, one forward of the whole canvas keeps the K/V before the
    block and after it; each later step runs only the block's positions over both (for a shifted
    model, positions [lo - 1, hi - 1): position p is predicted from the row of p - 1). The commit
    rule is prefix_cache's."""
    x = list(prompt) + [s.mask_id] * gen_len
    masked = [False] * len(prompt) + [True] * gen_len
    P, nb = len(prompt), gen_len // block_len
    spb = max(steps // nb, 1)
    sh = 1 if s.arch == "dream" else 0

    for b in range(nb):
        lo, hi = P + b * block_len, P + (b + 1) * block_len
        sched = schedule(sum(masked[lo:hi]), spb)
        logits, kv = forward(s, w, x)  # the whole canvas; keep [0, lo - sh) and [hi - sh, end)
        past = [(k[:lo - sh], v[:lo - sh]) for k, v in kv]
        after = [(k[hi - sh:], v[hi - sh:]) for k, v in kv]
        st = 0
        while any(masked[lo:hi]):
            if st > 0:
                raw, _ = forward(s, w, x[lo - sh:hi - sh], past, shifted=False, after=after)
                logits = np.full((len(x), raw.shape[1]), np.nan)
                logits[lo:hi] = raw  # row i of the chunk predicts position lo - sh + i + sh
            cache_step(x, masked, logits, lo, hi, sched, st, threshold, factor)
            st += 1
    return cut(s, x[P:], stop)


def entropy_bounded_count(neg_entropy, bound):
    """SDAR's entropy_bounded rule, written from its description: the entropies sorted ascending,
    the count of their running sums below the bound (searchsorted, left), at least one."""
    e = sorted(-c for c in neg_entropy)
    run, n = 0.0, 0
    for v in e:
        run += v
        _note("conf", abs(run - bound))
        if run >= bound:
            break
        n += 1
    return max(n, 1)


def ref_block(s, w, prompt, gen_len, steps, threshold, stop=True, unmask="confidence", eb=0.35):
    B, P = s.block, len(prompt)
    nblocks = -(-(P + gen_len) // B)
    x = list(prompt) + [s.mask_id] * (nblocks * B - P)
    masked = [False] * P + [True] * (nblocks * B - P)
    first = P // B
    past = None
    if first > 0:
        _, kv = forward(s, w, x[: first * B], None, B)
        past = kv
    for b in range(first, nblocks):
        lo, hi = b * B, (b + 1) * B
        sched = schedule(sum(masked[lo:hi]), steps)
        st = 0
        while any(masked[lo:hi]):
            logits, _ = forward(s, w, x[lo:hi], past)
            pos = [i for i in range(lo, hi) if masked[i]]
            picks = [softmax_pick(logits[i - lo]) for i in pos]
            conf = [p[1] for p in picks]
            want = max(sched[st] if st < len(sched) else 1, 1)
            if unmask == "sequential":
                chosen = list(range(min(want, len(pos))))
            elif unmask == "entropy_bounded":
                ent = [confidence_of(logits[i - lo], "entropy") for i in pos]
                chosen = top(ent, entropy_bounded_count(ent, eb), "entropy")
            elif threshold > 0:
                _thr(conf, threshold)
                chosen = [j for j in range(len(conf)) if conf[j] > threshold]
                if len(chosen) < want:
                    chosen = top(conf, want)
            else:
                chosen = top(conf, want)
            for j in chosen:
                x[pos[j]] = picks[j][0]
                masked[pos[j]] = False
            st += 1
        _, kv = forward(s, w, x[lo:hi], past)  # the commit pass: the block's final K/V
        past = kv if past is None else [(np.concatenate([pk, k]), np.concatenate([pv, v]))
                                        for (pk, pv), (k, v) in zip(past, kv)]
    return cut(s, x[P:P + gen_len], stop)


def ref_fast_dllm(s, w, prompt, gen_len, threshold, sub=8, stop=True):
    """Fast-dLLM v2's generate() as the engine states it (generate_fast_dllm.cpp): the prompt's whole
    blocks prefilled; each block decoded sub-block by sub-block, a step committing the sub-block's
    most confident masked position and every other one above the threshold; the row of position
    p - 1 predicts position p (raw, unshifted logits here); after a block, its last row's argmax
    opens the next block; gen_len tokens; with stop, the output ends before an EOS that has no
    mask before it."""
    B, P = s.block, len(prompt)
    end = P + gen_len
    x = list(prompt) + [s.mask_id] * ((end + B - 1) // B * B + 1 - P)
    masked = [False] * P + [True] * (len(x) - P)

    def ended(upto):
        for i in range(P, upto):
            if masked[i]:
                return False
            if x[i] == s.eos:
                return True
        return False

    def put(p, token):
        x[p], masked[p] = token, False

    L, past = P // B * B, None
    if L > 0:
        raw, past = forward(s, w, x[:L], None, B, shifted=False)
        if P == L:
            put(L, softmax_pick(raw[L - 1])[0])
    done = False
    while L < end and not done:
        for lo in range(L, L + B, sub):
            while any(masked[lo:lo + sub]) and not done:
                raw, _ = forward(s, w, x[L:L + B], past, B, shifted=False)
                pos = [p for p in range(max(lo, L + 1), lo + sub) if masked[p]]
                picks = [softmax_pick(raw[p - 1 - L]) for p in pos]
                conf = [c for _, c in picks]
                first = top(conf, 1)[0]
                for j in range(len(pos)):
                    if j == first or (threshold > 0 and conf[j] > threshold):
                        put(pos[j], picks[j][0])
                done = stop and ended(L + B)
            if done:
                break
        if not done and L + B < end:
            raw, kv = forward(s, w, x[L:L + B], past, B, shifted=False)
            past = kv if past is None else [(np.concatenate([pk, k]), np.concatenate([pv, v]))
                                            for (pk, pv), (k, v) in zip(past, kv)]
            put(L + B, softmax_pick(raw[B - 1])[0])
            done = stop and ended(L + B + 1)
        L += B
    out = []
    for i in range(P, end):
        if masked[i] or (stop and x[i] == s.eos):
            break
        out.append(x[i])
    return out


CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def shipped_model_copy(tmp_path, template=None):
    """The shipped model's files (models/sparsa-sdar-ruler) linked into a new directory, with
    `template` as its chat_template.jinja if given; the test is skipped without the model."""
    import pytest
    shipped = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "models", "sparsa-sdar-ruler")
    if not os.path.isdir(shipped):
        pytest.skip("the shipped model is not in this checkout")
    model = tmp_path / "chat_model"
    model.mkdir()
    for name in os.listdir(shipped):
        os.symlink(os.path.abspath(os.path.join(shipped, name)), model / name)
    if template is not None:
        (model / "chat_template.jinja").write_text(template, encoding="utf-8")
    return model
