"""The peer of bench_dlm: the same 8B-shaped models and steps in plain eager PyTorch, the way
Fast-dLLM's and transformers' code runs them (bf16 weights and activations, nn.Linear-style
matmuls per projection, RMSNorm and RoPE as tensor ops, SDPA for attention, the KV cache as one
tensor per layer concatenated with the step's K/V every step). Random weights on the device.

Rows (same names and shapes as bench_dlm): llada_canvas (full-canvas step over --canvas tokens,
logits of 32 rows), llada_prefix (a block of 32 against ctx cached tokens), sdar_block (16 tokens
against ctx cached tokens, 32/8 heads, QK RMSNorm, block-causal inside the chunk is the whole
block, so no mask). Times: CUDA events, medians; the attention column times SDPA (with the
concatenation) alone over the same tensors.

    python3 bench/cuda/bench_dlm_torch.py [--rows ...] [--canvas 4096] [--ctx 32768,65536,131072]
"""
import argparse

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope_tables(positions, hd, theta, device):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    ang = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], -1)
    return emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


class Model:
    def __init__(self, arch, layers, dim, heads, kv_heads, hd, hidden, vocab, theta, eps, device="cuda"):
        self.arch, self.layers, self.dim, self.heads, self.kv, self.hd = arch, layers, dim, heads, kv_heads, hd
        self.hidden, self.vocab, self.theta, self.eps = hidden, vocab, theta, eps
        g = torch.Generator(device=device).manual_seed(0)

        def lin(o, i):
            return ((torch.rand(o, i, device=device, generator=g) * 2 - 1) / i ** 0.5).to(torch.bfloat16)

        one = lambda n: torch.ones(n, device=device, dtype=torch.bfloat16)  # noqa: E731
        self.embed = (torch.rand(vocab, dim, device=device, generator=g) * 2 - 1).to(torch.bfloat16)
        self.L = []
        for _ in range(layers):
            L = dict(attn_norm=one(dim), wq=lin(heads * hd, dim), wk=lin(kv_heads * hd, dim), wv=lin(kv_heads * hd, dim),
                     wo=lin(dim, heads * hd), ffn_norm=one(dim), wg=lin(hidden, dim), wu=lin(hidden, dim),
                     wd=lin(dim, hidden))
            if arch == "sdar":
                L["qn"], L["kn"] = one(hd), one(hd)
            self.L.append(L)
        self.norm = one(dim)
        self.head = lin(vocab, dim)

    def attention(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=self.kv != self.heads)

    def forward(self, tokens, pos0, cache, logit_rows, attn_only=False, qkv_saved=None):
        """tokens [n] at positions pos0.. over cache (per layer (k, v) [1, kv, m, hd] or None)."""
        n = tokens.shape[0]
        x = self.embed[tokens][None]
        cos, sin = rope_tables(torch.arange(pos0, pos0 + n, device=x.device), self.hd, self.theta, x.device)
        for l, L in enumerate(self.L):
            h = rms(x, L["attn_norm"], self.eps)
            q = F.linear(h, L["wq"]).view(1, n, self.heads, self.hd)
            k = F.linear(h, L["wk"]).view(1, n, self.kv, self.hd)
            v = F.linear(h, L["wv"]).view(1, n, self.kv, self.hd)
            if self.arch == "sdar":
                q, k = rms(q, L["qn"], self.eps), rms(k, L["kn"], self.eps)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if cache is not None and cache[l] is not None:
                k = torch.cat([cache[l][0], k], 2)
                v = torch.cat([cache[l][1], v], 2)
            a = self.attention(q, k, v).transpose(1, 2).reshape(1, n, self.heads * self.hd)
            x = x + F.linear(a, L["wo"])
            h = rms(x, L["ffn_norm"], self.eps)
            x = x + F.linear(F.silu(F.linear(h, L["wg"])) * F.linear(h, L["wu"]), L["wd"])
        h = rms(x[:, :logit_rows], self.norm, self.eps)
        return F.linear(h, self.head).float().cpu()


def llada():
    return Model("llada", 32, 4096, 32, 32, 128, 12288, 126464, 500000.0, 1e-5)


def sdar():
    return Model("sdar", 36, 4096, 32, 8, 128, 12288, 151936, 1e6, 1e-6)


def timed(fn, iters):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def row(m, name, n, ctx, logit_rows, iters):
    dev = "cuda"
    cache = None
    if ctx:
        kv = (torch.rand(1, m.kv, ctx, m.hd, device=dev) * 2 - 1).to(torch.bfloat16)
        cache = [(kv, kv.clone()) for _ in range(m.layers)]
    tokens = (torch.arange(n, device=dev) * 7919) % m.vocab
    with torch.inference_mode():
        step = timed(lambda: m.forward(tokens, ctx, cache, logit_rows), iters)
        q = (torch.rand(1, m.heads, n, m.hd, device=dev) - 0.5).to(torch.bfloat16)
        kn = (torch.rand(1, m.kv, n, m.hd, device=dev) - 0.5).to(torch.bfloat16)

        def attn():
            for l in range(m.layers):
                k = kn if cache is None else torch.cat([cache[l][0], kn], 2)
                v = kn if cache is None else torch.cat([cache[l][1], kn], 2)
                m.attention(q, k, v)

        att = timed(attn, iters)
    del cache
    torch.cuda.empty_cache()
    return name, n, ctx, step, att


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="llada_canvas,llada_prefix,sdar_block")
    ap.add_argument("--canvas", type=int, default=4096)
    ap.add_argument("--ctx", default="32768,65536,131072")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    ctxs = [int(x) for x in a.ctx.split(",")]
    out = []
    if "llada" in a.rows:
        m = llada()
        if "llada_canvas" in a.rows:
            out.append(row(m, "llada_canvas", a.canvas, 0, 32, max(a.iters // 2, 3)))
        if "llada_prefix" in a.rows:
            out += [row(m, "llada_prefix", 32, c, 32, a.iters) for c in ctxs if c <= 65536]
        del m
        torch.cuda.empty_cache()
    if "sdar" in a.rows:
        m = sdar()
        out += [row(m, "sdar_block", 16, c, 16, a.iters) for c in ctxs]
    print(f"PyTorch {torch.__version__} eager (bf16, SDPA, KV concatenated per layer; medians of CUDA events)")
    print(f"{'row':13s} {'tokens':>6s} {'ctx':>7s} | {'step ms':>9s} {'attn ms':>9s} {'rest ms':>9s}")
    for name, n, ctx, step, att in out:
        print(f"{name:13s} {n:6d} {ctx:7d} | {step:9.2f} {att:9.2f} {step - att:9.2f}")


if __name__ == "__main__":
    main()
