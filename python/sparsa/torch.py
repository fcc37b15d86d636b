"""PyTorch helpers: BlockIndex <-> FlexAttention BlockMask.

Importing this module requires torch; nothing else in sparsa does.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

try:
    import torch
except ModuleNotFoundError as e:  # the one sparsa module that needs torch: say how to get it
    raise ModuleNotFoundError("sparsa.torch needs PyTorch, which is not installed: pip install torch "
                              "(or install sparsa with its extra: pip install 'sparsa[torch]')", name="torch") from e

import sparsa
from . import BlockIndex

__all__ = ["to_block_mask", "from_block_mask", "llsa_attention"]


def _pair(block: Union[int, Tuple[int, int]]) -> Tuple[int, int]:
    return (block, block) if isinstance(block, int) else (int(block[0]), int(block[1]))


def to_block_mask(index: BlockIndex, len_q: int, len_kv: int, device: Optional[torch.device] = None):
    """A FlexAttention ``BlockMask`` with the same block structure (kv_num_blocks =
    counts, kv_indices = indices). Permuted plans (perm_q / perm_kv) have no BlockMask
    form: apply the permutation to q, k, v first."""
    from torch.nn.attention.flex_attention import BlockMask

    if index.perm_q is not None or index.perm_kv is not None:
        raise ValueError("index: a plan with perm_q/perm_kv has no BlockMask form; permute q, k, v first")
    counts = torch.as_tensor(index.counts, dtype=torch.int32, device=device)
    indices = torch.as_tensor(index.indices, dtype=torch.int32, device=device)
    return BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=(index.block_q, index.block_kv),
                                    seq_lengths=(len_q, len_kv))


def from_block_mask(block_mask) -> BlockIndex:
    """A BlockIndex with the block structure of a FlexAttention ``BlockMask``.

    Full blocks (``full_kv_*``) and partial blocks (``kv_*``) are united. sparsa treats
    every listed block as fully visible: a ``mask_mod``'s element-level masking inside
    partial blocks is not carried over."""
    block_q, block_kv = _pair(block_mask.BLOCK_SIZE)
    counts = block_mask.kv_num_blocks.to(torch.int32)
    indices = block_mask.kv_indices.to(torch.int32)
    if block_mask.full_kv_num_blocks is not None:
        fc = block_mask.full_kv_num_blocks.to(torch.int32)
        fi = block_mask.full_kv_indices.to(torch.int32)
        cap = indices.shape[-1] + fi.shape[-1]
        slots = torch.arange(cap, device=counts.device)
        a = torch.where(slots[: indices.shape[-1]] < counts[..., None], indices, torch.iinfo(torch.int32).max)
        b = torch.where(slots[: fi.shape[-1]] < fc[..., None], fi, torch.iinfo(torch.int32).max)
        indices = torch.cat([a, b], dim=-1)
        counts = counts + fc
    else:
        slots = torch.arange(indices.shape[-1], device=counts.device)
        indices = torch.where(slots < counts[..., None], indices, torch.iinfo(torch.int32).max)
    # sparsa wants each row's first `count` entries ascending; padding goes last.
    indices, _ = torch.sort(indices, dim=-1)
    indices = torch.where(indices == torch.iinfo(torch.int32).max, 0, indices).to(torch.int32).contiguous()
    return BlockIndex(block_q, block_kv, counts.contiguous(), indices)


class _LlsaFunction(torch.autograd.Function):
    """LLSA forward and backward from sparsa's kernels (selection not differentiated)."""

    @staticmethod
    def forward(ctx, q, k, v, options):
        q, k, v = (t.detach() for t in (q, k, v))
        out, lse = sparsa.llsa(q, k, v, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        options = {key: val for key, val in ctx.options.items() if key != "check_finite"}
        dq, dk, dv = sparsa.llsa_backward(q, k, v, out, lse, grad_out, **options)
        return dq, dk, dv, None


def llsa_attention(q, k, v, *, block: int = 16, topk: int = 8, levels: int = -1, enrich: bool = True,
                   dedupe: bool = False, scale: Optional[float] = None, num_threads: int = 0,
                   check_finite: bool = False):
    """Log-linear sparse attention as a differentiable torch op: ``[batch, heads, N, d]``
    in, the attention output out; gradients reach q, k and v through sparsa's backward."""
    options = dict(block=block, topk=topk, levels=levels, enrich=enrich, dedupe=dedupe, scale=scale,
                   num_threads=num_threads, check_finite=check_finite)
    return _LlsaFunction.apply(q, k, v, options)
