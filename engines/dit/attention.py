"""The attention a DiT layer runs: ``full`` (torch SDPA), ``llsa`` (sparsa's LLSA, trainable) or
``ba_att`` (sparsa's BA-Att, training-free: sampling and evaluation only).

Inputs are ``[batch, heads, N, head_dim]`` with the tokens in the model's layout order (Z-order
for images), which LLSA's pooling and BA-Att's blocks need and full attention ignores.

On CUDA tensors with head_dim 64 or 128, LLSA runs on the device (sparsa's CUDA kernels, forward
and backward), in bf16 or f16: float32 inputs are cast to bf16 for the call and the output cast
back (both differentiable). Other head dims, and BA-Att (training-free; its CUDA executor is not
wired here), run through the CPU op: q, k and v are copied to the host in float32, attended there,
and the output is copied back to the device in the input dtype. The copies are ordinary
differentiable torch ops, so gradients flow back to the device tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

KINDS = ("full", "llsa", "ba_att")


@dataclass(frozen=True)
class AttentionSpec:
    """Which attention, with its parameters (LLSA's ``block``/``topk``/``levels``/``dedupe``,
    BA-Att's ``block``/``density``/``sort``: norm-sorted Q and K as in the paper, or the layout's
    own blocks); ``num_threads`` goes to sparsa's BA-Att CPU call (0: all cores; LLSA's custom op
    always takes every core)."""

    kind: str = "full"
    block: int = 16
    topk: int = 8
    levels: int = -1
    dedupe: bool = False
    density: float = 0.5
    sort: bool = True
    num_threads: int = 0

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"attention: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind != "full" and self.block < 1:
            raise ValueError(f"{self.kind}.block: expected a positive block size, got {self.block}")
        if self.kind == "llsa" and self.topk < 1:
            raise ValueError(f"llsa.topk: expected a positive top-K, got {self.topk}")
        if self.kind == "ba_att" and not 0 < self.density <= 1:
            raise ValueError(f"ba_att.density: expected a density in (0, 1], got {self.density}")

    def label(self) -> str:
        if self.kind == "llsa":
            levels = "" if self.levels < 0 else f", {self.levels} level{'s' if self.levels != 1 else ''}"
            return f"llsa (block {self.block}, top-K {self.topk}{levels})"
        if self.kind == "ba_att":
            return f"ba_att (block {self.block}, density {self.density:g}{'' if self.sort else ', unsorted'})"
        return "full"


def _host(x: torch.Tensor) -> torch.Tensor:
    """A float32 CPU copy (the tensor itself when it already is one); differentiable."""
    return x.to("cpu", torch.float32).contiguous()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over the keys ``spec`` visits: ``[batch, heads, N, head_dim]``."""
    if spec.kind == "full":
        return F.scaled_dot_product_attention(q, k, v)
    import sparsa

    device, dtype = q.device, q.dtype
    if spec.kind == "llsa":
        import sparsa.torch as sparsa_torch

        if q.is_cuda and q.shape[-1] in (64, 128):
            half = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
            out = sparsa_torch.llsa_attention(q.to(half), k.to(half), v.to(half), block=spec.block,
                                              topk=spec.topk, levels=spec.levels, dedupe=spec.dedupe)
            return out.to(dtype)
        # The custom op (sparsa::llsa) takes no thread count: sparsa's CPU path uses every core.
        out = sparsa_torch.llsa_attention(_host(q), _host(k), _host(v), block=spec.block, topk=spec.topk,
                                          levels=spec.levels, dedupe=spec.dedupe)
        return out.to(device, dtype)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError("attention ba_att: BA-Att is training-free (no backward); use it under torch.no_grad()")
    out, _ = sparsa.ba_att(_host(q), _host(k), _host(v), block_q=spec.block, block_kv=spec.block,
                           sort_q=spec.sort, sort_k=spec.sort, density=spec.density,
                           num_threads=spec.num_threads)
    return out.to(device, dtype)


def keys_per_query(n: int, spec: AttentionSpec) -> Optional[float]:
    """How many keys (fine and pooled) one query attends to, for the tables; None if unknown."""
    if spec.kind == "full":
        return float(n)
    if spec.kind == "ba_att":
        blocks = -(-n // spec.block)
        return float(min(n, math.ceil(spec.density * blocks - 1e-9) * spec.block))
    import numpy as np
    import sparsa

    probe = np.zeros((1, 1, n, 4), dtype=np.float32)
    plan = sparsa.llsa_plan(probe, probe, block=spec.block, topk=spec.topk, levels=spec.levels, dedupe=spec.dedupe)
    return float(plan["keys_per_query"])
