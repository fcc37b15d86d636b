"""sparsa inside PyTorch: custom ops, a FlexAttention-shaped entry, BlockIndex <-> BlockMask.

Importing this module registers the ``torch.library`` custom ops ``sparsa::dense``,
``sparsa::block_sparse``, ``sparsa::ba_att_plan``, ``sparsa::ba_att``, ``sparsa::merge``,
``sparsa::llsa`` (differentiable) and ``sparsa::llsa_backward`` (docs/torch.md). It requires
torch; nothing else in sparsa does.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

try:
    import torch
except ModuleNotFoundError as e:  # the one sparsa module that needs torch: say how to get it
    raise ModuleNotFoundError("sparsa.torch needs PyTorch, which is not installed: pip install torch "
                              "(or install sparsa with its extra: pip install 'sparsa[torch]')", name="torch") from e

import sparsa
from . import BlockIndex

__all__ = ["to_block_mask", "from_block_mask", "mask_mod", "llsa_attention", "attention", "dense", "block_sparse",
           "ba_att", "ba_att_plan", "merge", "plan_tensors", "block_index", "causal_plan", "causal_attention"]


def _pair(block: Union[int, Tuple[int, int]]) -> Tuple[int, int]:
    return (block, block) if isinstance(block, int) else (int(block[0]), int(block[1]))


def mask_mod(mask, len_q: int, len_kv: int):
    """A FlexAttention ``mask_mod`` of a sparsa mask (``"causal"``, ``("block_causal", 16)``,
    ``("sliding_window", 128)``, a :class:`sparsa.Mask`) for len_q queries over len_kv keys,
    with sparsa's end alignment (query i at key position ``i + len_kv - len_q``). sparsa
    recognises the function again (:func:`attention` with a BlockMask made from it runs the
    mask exactly, partial blocks included)."""
    m = sparsa.Mask.of(mask)
    shift = int(len_kv) - int(len_q)

    def mod(b, h, q_idx, kv_idx):
        pos = q_idx + shift
        if m.kind == "causal":
            return kv_idx <= pos
        if m.kind == "block_causal":
            return torch.div(kv_idx, m.block, rounding_mode="floor") <= torch.div(pos, m.block, rounding_mode="floor")
        if m.kind == "sliding_window":
            return (pos - kv_idx <= m.left) & (kv_idx - pos <= m.right)
        return kv_idx >= 0

    mod._sparsa_mask = (m, int(len_q), int(len_kv))
    mod.__name__ = f"sparsa_{m.kind}"
    return mod


def to_block_mask(index: BlockIndex, len_q: int, len_kv: int, device: Optional[torch.device] = None, mask=None):
    """A FlexAttention ``BlockMask`` with the same block structure (kv_num_blocks =
    counts, kv_indices = indices). Permuted plans (perm_q / perm_kv) have no BlockMask
    form: apply the permutation to q, k, v first. With ``mask`` (a sparsa mask), the BlockMask
    carries its :func:`mask_mod`, which FlexAttention applies inside every listed block: the
    same attention as ``sparsa.block_sparse(..., mask=mask)``."""
    from torch.nn.attention.flex_attention import BlockMask

    if index.perm_q is not None or index.perm_kv is not None:
        raise ValueError("index: a plan with perm_q/perm_kv has no BlockMask form; permute q, k, v first")
    counts = torch.as_tensor(index.counts, dtype=torch.int32, device=device)
    indices = torch.as_tensor(index.indices, dtype=torch.int32, device=device)
    # A BlockMask reads the number of key blocks off kv_indices' last dimension: pad a plan whose
    # capacity is smaller to ceil(len_kv / block_kv) columns.
    num_kv_blocks = -(-len_kv // index.block_kv)
    if indices.shape[-1] > num_kv_blocks:
        raise ValueError(f"index: capacity {indices.shape[-1]} exceeds the {num_kv_blocks} key blocks of len_kv {len_kv}")
    indices = torch.nn.functional.pad(indices, (0, num_kv_blocks - indices.shape[-1]))
    extra = {} if mask is None else {"mask_mod": mask_mod(mask, len_q, len_kv)}
    return BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=(index.block_q, index.block_kv),
                                    seq_lengths=(len_q, len_kv), **extra)


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


# ---- torch.library custom ops (namespace sparsa::) ---------------------------------------
#
# Each op has a CPU kernel (sparsa's fast "cpu" backend), a CUDA kernel (sparsa's "cuda" backend,
# ordered on torch's current stream of the inputs' device) and a fake kernel that gives the
# outputs' shapes and dtypes without computing them, so torch.compile(fullgraph=True) traces a
# model that calls them as any torch op. Outputs: ``out`` has q's shape and dtype, ``lse`` is
# float32 ``q.shape[:-1]``. Plans travel as tensors: ``counts``, ``indices`` and, for permuted
# plans, ``perm_q`` / ``perm_kv`` (an empty tensor stands for "no permutation", as an op's output
# cannot be None).

_BUDGETS = ("density", "top_kappa", "mass")


def _stream_of(t: "torch.Tensor") -> int:
    return int(torch.cuda.current_stream(t.device).cuda_stream)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _attention_outputs(q):
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        q.new_empty(q.shape[:-1], dtype=torch.float32)


def _optional(perm: "torch.Tensor"):
    return None if perm.numel() == 0 else perm


# ``mask`` travels as its text ("none", "causal", "block_causal(16)", "sliding_window(128,128)").

@torch.library.custom_op("sparsa::dense", mutates_args=(), device_types="cpu")
def _dense_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None, mask: str = "none"
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    return sparsa.dense(q, k, v, scale=scale, mask=mask, backend="cpu")


@_dense_op.register_kernel("cuda")
def _dense_cuda(q, k, v, scale=None, mask="none"):
    return sparsa.dense(q, k, v, scale=scale, mask=mask, backend="cuda", stream=_stream_of(q))


@_dense_op.register_fake
def _dense_fake(q, k, v, scale=None, mask="none"):
    return _attention_outputs(q)


@torch.library.custom_op("sparsa::block_sparse", mutates_args=(), device_types="cpu")
def _block_sparse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor, indices: torch.Tensor,
                     perm_q: Optional[torch.Tensor], perm_kv: Optional[torch.Tensor], block_q: int, block_kv: int,
                     scale: Optional[float] = None, check_index: bool = True, mask: str = "none"
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    index = BlockIndex(block_q, block_kv, counts, indices, perm_q, perm_kv)
    return sparsa.block_sparse(q, k, v, index, scale=scale, mask=mask, backend="cpu")


@_block_sparse_op.register_kernel("cuda")
def _block_sparse_cuda(q, k, v, counts, indices, perm_q, perm_kv, block_q, block_kv, scale=None, check_index=True,
                       mask="none"):
    # The device check of the plan reads a verdict back (a synchronisation), which CUDA-graph
    # capture forbids: under capture the plan is trusted (check it once before capturing).
    index = BlockIndex(block_q, block_kv, counts, indices, perm_q, perm_kv)
    return sparsa.block_sparse(q, k, v, index, scale=scale, mask=mask, backend="cuda",
                               check_index=check_index and not _capturing(), stream=_stream_of(q))


@_block_sparse_op.register_fake
def _block_sparse_fake(q, k, v, counts, indices, perm_q, perm_kv, block_q, block_kv, scale=None, check_index=True,
                       mask="none"):
    return _attention_outputs(q)


def _budget_keywords(budget: str, value: float) -> dict:
    if budget not in _BUDGETS:
        raise ValueError(f"budget: expected one of {', '.join(_BUDGETS)}, got '{budget}'")
    if budget == "top_kappa":
        if value != int(value):
            raise ValueError(f"budget: top_kappa expects an integer, got {value}")
        return {"top_kappa": int(value)}
    return {"tau" if budget == "mass" else budget: float(value)}


def _ba_att_keywords(block_q, block_kv, sort_q, sort_k, compensate, beta, budget, value, scale) -> dict:
    return dict(block_q=block_q, block_kv=block_kv, sort_q=sort_q, sort_k=sort_k, compensate=compensate, beta=beta,
                scale=scale, **_budget_keywords(budget, value))


def _plan_capacity(budget: str, value: float, num_kv_blocks: int) -> int:
    """The plan's capacity (indices' last dimension) for a budget, as the core allocates it."""
    if budget == "top_kappa":
        return min(int(value), num_kv_blocks)
    if budget == "density":
        return min(num_kv_blocks, max(1, math.ceil(value * num_kv_blocks - 1e-9)))
    raise ValueError("budget: a mass (tau) budget keeps a data-dependent number of blocks, which a traced "
                     "plan cannot size; use density or top_kappa in sparsa::ba_att_plan")


def _plan_tensors(plan: BlockIndex, q):
    def tensor(a):  # a fresh empty tensor each: an op's outputs may not alias one another
        return torch.empty(0, dtype=torch.int32, device=q.device) if a is None else torch.as_tensor(a, device=q.device)

    return tensor(plan.counts), tensor(plan.indices), tensor(plan.perm_q), tensor(plan.perm_kv)


@torch.library.custom_op("sparsa::ba_att_plan", mutates_args=(), device_types="cpu")
def _ba_att_plan_op(q: torch.Tensor, k: torch.Tensor, block_q: int = 64, block_kv: int = 64, sort_q: bool = True,
                    sort_k: bool = True, compensate: bool = True, beta: float = 1.0, budget: str = "density",
                    budget_value: float = 0.5, scale: Optional[float] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _plan_capacity(budget, budget_value, 1)  # refuses a mass budget as the fake kernel does
    plan = sparsa.ba_att_plan(q, k, backend="cpu", **_ba_att_keywords(block_q, block_kv, sort_q, sort_k, compensate,
                                                                      beta, budget, budget_value, scale))
    return _plan_tensors(plan, q)


@_ba_att_plan_op.register_kernel("cuda")
def _ba_att_plan_cuda(q, k, block_q=64, block_kv=64, sort_q=True, sort_k=True, compensate=True, beta=1.0,
                      budget="density", budget_value=0.5, scale=None):
    _plan_capacity(budget, budget_value, 1)
    plan = sparsa.ba_att_plan(q, k, backend="cuda", stream=_stream_of(q),
                              **_ba_att_keywords(block_q, block_kv, sort_q, sort_k, compensate, beta, budget,
                                                 budget_value, scale))
    return _plan_tensors(plan, q)


@_ba_att_plan_op.register_fake
def _ba_att_plan_fake(q, k, block_q=64, block_kv=64, sort_q=True, sort_k=True, compensate=True, beta=1.0,
                      budget="density", budget_value=0.5, scale=None):
    b, hq, lq = q.shape[0], q.shape[1], q.shape[2]
    hkv, lkv = k.shape[1], k.shape[2]
    nq, nkv = -(-lq // block_q), -(-lkv // block_kv)
    i32 = dict(dtype=torch.int32)
    return (q.new_empty((b, hq, nq), **i32), q.new_empty((b, hq, nq, _plan_capacity(budget, budget_value, nkv)), **i32),
            q.new_empty((b, hq, lq) if sort_q else (0,), **i32), q.new_empty((b, hkv, lkv) if sort_k else (0,), **i32))


@torch.library.custom_op("sparsa::ba_att", mutates_args=(), device_types="cpu")
def _ba_att_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int = 64, block_kv: int = 64,
               sort_q: bool = True, sort_k: bool = True, compensate: bool = True, beta: float = 1.0,
               budget: str = "density", budget_value: float = 0.5, scale: Optional[float] = None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    return sparsa.ba_att(q, k, v, backend="cpu", **_ba_att_keywords(block_q, block_kv, sort_q, sort_k, compensate, beta,
                                                                    budget, budget_value, scale))


@_ba_att_op.register_kernel("cuda")
def _ba_att_cuda(q, k, v, block_q=64, block_kv=64, sort_q=True, sort_k=True, compensate=True, beta=1.0,
                 budget="density", budget_value=0.5, scale=None):
    return sparsa.ba_att(q, k, v, backend="cuda", stream=_stream_of(q),
                         **_ba_att_keywords(block_q, block_kv, sort_q, sort_k, compensate, beta, budget, budget_value,
                                            scale))


@_ba_att_op.register_fake
def _ba_att_fake(q, k, v, block_q=64, block_kv=64, sort_q=True, sort_k=True, compensate=True, beta=1.0,
                 budget="density", budget_value=0.5, scale=None):
    return _attention_outputs(q)


@torch.library.custom_op("sparsa::merge", mutates_args=(), device_types="cpu")
def _merge_op(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    return sparsa.merge(o1, lse1, o2, lse2, backend="cpu")


@_merge_op.register_kernel("cuda")
def _merge_cuda(o1, lse1, o2, lse2):
    # sparsa has no CUDA merge kernel yet: the contract's formula in torch ops (f32), on the
    # current stream like the rest. A side with lse = -inf adds nothing; both: out 0, lse -inf.
    for name, o, lse in (("o1", o1, lse1), ("o2", o2, lse2)):
        if o.shape[:-1] != lse.shape:
            raise ValueError(f"lse{name[1]}: expected shape {list(o.shape[:-1])} to match {name}, got {list(lse.shape)}")
    if o1.shape != o2.shape:
        raise ValueError(f"o2: expected shape {list(o1.shape)} as o1, got {list(o2.shape)}")
    l1, l2 = lse1.float(), lse2.float()
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    total = w1 + w2
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (w1[..., None] * o1.float() + w2[..., None] * o2.float()) / safe[..., None]
    return out.to(o1.dtype), (m + torch.log(total)).contiguous()


@_merge_op.register_fake
def _merge_fake(o1, lse1, o2, lse2):
    return _attention_outputs(o1)


def _llsa_keywords(block, topk, levels, enrich, dedupe, scale) -> dict:
    return dict(block=block, topk=topk, levels=levels, enrich=enrich, dedupe=dedupe, scale=scale)


def _llsa_backend(q: torch.Tensor) -> str:
    # The cuda backend takes bf16/f16 (f32 tensors on a GPU get its clear dtype error).
    return "cuda" if q.is_cuda else "cpu"


@torch.library.custom_op("sparsa::llsa", mutates_args=(), device_types=("cpu", "cuda"))
def _llsa_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = 16, topk: int = 8, levels: int = -1,
             enrich: bool = True, dedupe: bool = False, scale: Optional[float] = None
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    return sparsa.llsa(q, k, v, backend=_llsa_backend(q), **_llsa_keywords(block, topk, levels, enrich, dedupe, scale))


@_llsa_op.register_fake
def _llsa_fake(q, k, v, block=16, topk=8, levels=-1, enrich=True, dedupe=False, scale=None):
    return _attention_outputs(q)


@torch.library.custom_op("sparsa::llsa_backward", mutates_args=(), device_types=("cpu", "cuda"))
def _llsa_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      d_out: torch.Tensor, block: int = 16, topk: int = 8, levels: int = -1, enrich: bool = True,
                      dedupe: bool = False, scale: Optional[float] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return sparsa.llsa_backward(q, k, v, out, lse, d_out.contiguous(), backend=_llsa_backend(q),
                                **_llsa_keywords(block, topk, levels, enrich, dedupe, scale))


@_llsa_backward_op.register_fake
def _llsa_backward_fake(q, k, v, out, lse, d_out, block=16, topk=8, levels=-1, enrich=True, dedupe=False, scale=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _llsa_setup_context(ctx, inputs, output):
    q, k, v, block, topk, levels, enrich, dedupe, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = _llsa_keywords(block, topk, levels, enrich, dedupe, scale)
    ctx.mark_non_differentiable(lse)


def _llsa_backward_formula(ctx, grad_out, grad_lse):
    # lse is marked non-differentiable: sparsa's backward takes dO only (selection is not
    # differentiated either), so no gradient flows through the returned lse.
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        return (None,) * 9
    dq, dk, dv = torch.ops.sparsa.llsa_backward(q, k, v, out, lse, grad_out, **ctx.options)
    return (dq, dk, dv) + (None,) * 6


_llsa_op.register_autograd(_llsa_backward_formula, setup_context=_llsa_setup_context)


# ---- the plan as tensors ------------------------------------------------------------------

def plan_tensors(index: BlockIndex, device=None):
    """``(counts, indices, perm_q, perm_kv)`` of a BlockIndex as int32 torch tensors on ``device``
    (a missing permutation as an empty tensor): the form ``sparsa::block_sparse`` takes."""
    def tensor(a):
        if a is None:
            return torch.empty(0, dtype=torch.int32, device=device)
        return torch.as_tensor(a, dtype=torch.int32, device=device)

    return tensor(index.counts), tensor(index.indices), tensor(index.perm_q), tensor(index.perm_kv)


def block_index(block_q: int, block_kv: int, counts, indices, perm_q=None, perm_kv=None) -> BlockIndex:
    """A BlockIndex of plan tensors (as ``sparsa::ba_att_plan`` returns them; empty
    permutations mean none)."""
    return BlockIndex(int(block_q), int(block_kv), counts, indices,
                      None if perm_q is None or perm_q.numel() == 0 else perm_q,
                      None if perm_kv is None or perm_kv.numel() == 0 else perm_kv)


def ba_att_plan(q, k, *, block_q: int = 64, block_kv: int = 64, sort_q: bool = True, sort_k: bool = True,
                compensate: bool = True, beta: float = 1.0, top_kappa: Optional[int] = None,
                density: Optional[float] = None, scale: Optional[float] = None) -> BlockIndex:
    """BA-Att's plan through the traceable op ``sparsa::ba_att_plan``: a BlockIndex of tensors on
    q's device (a density or top_kappa budget; default density 0.5)."""
    budget, value = _op_budget(top_kappa, density)
    counts, indices, perm_q, perm_kv = torch.ops.sparsa.ba_att_plan(q, k, block_q, block_kv, sort_q, sort_k, compensate,
                                                                    beta, budget, value, scale)
    return block_index(block_q, block_kv, counts, indices, perm_q, perm_kv)


def _op_budget(top_kappa, density, tau=None) -> Tuple[str, float]:
    given = [(n, v) for n, v in (("top_kappa", top_kappa), ("density", density), ("mass", tau)) if v is not None]
    if len(given) > 1:
        raise ValueError("budget: expected at most one of top_kappa, density or tau, got "
                         + ", ".join(f"{'tau' if n == 'mass' else n}={v}" for n, v in given))
    return given[0] if given else ("density", 0.5)


def block_sparse(q, k, v, index: BlockIndex, *, scale: Optional[float] = None, check_index: bool = True,
                 mask=None):
    """``sparsa::block_sparse`` on a BlockIndex whose arrays are tensors (or numpy): ``(out, lse)``.
    ``mask``: as in :func:`sparsa.block_sparse`."""
    if not isinstance(index, BlockIndex):
        raise TypeError(f"index: expected sparsa.BlockIndex, got {type(index).__name__}")
    counts, indices, perm_q, perm_kv = plan_tensors(index, q.device)
    return torch.ops.sparsa.block_sparse(q, k, v, counts, indices, _optional(perm_q), _optional(perm_kv),
                                         index.block_q, index.block_kv, scale, check_index, sparsa._mask_text(mask))


def ba_att(q, k, v, *, block_q: int = 64, block_kv: int = 64, sort_q: bool = True, sort_k: bool = True,
           compensate: bool = True, beta: float = 1.0, top_kappa: Optional[int] = None,
           density: Optional[float] = None, tau: Optional[float] = None, scale: Optional[float] = None):
    """BA-Att attention through the op ``sparsa::ba_att``: ``(out, lse)``."""
    budget, value = _op_budget(top_kappa, density, tau)
    return torch.ops.sparsa.ba_att(q, k, v, block_q, block_kv, sort_q, sort_k, compensate, beta, budget, value, scale)


def dense(q, k, v, *, scale: Optional[float] = None, mask=None):
    """Dense attention through the op ``sparsa::dense``: ``(out, lse)``. ``mask``: as in
    :func:`sparsa.dense` (``"causal"``, ``("block_causal", 16)``, ...)."""
    return torch.ops.sparsa.dense(q, k, v, scale, sparsa._mask_text(mask))


def merge(o1, lse1, o2, lse2):
    """The log-sum-exp merge of two partial results through the op ``sparsa::merge``."""
    return torch.ops.sparsa.merge(o1, lse1, o2, lse2)


def llsa_attention(q, k, v, *, block: int = 16, topk: int = 8, levels: int = -1, enrich: bool = True,
                   dedupe: bool = False, scale: Optional[float] = None):
    """Log-linear sparse attention as a differentiable torch op (``sparsa::llsa``):
    ``[batch, heads, N, d]`` in, the attention output out; gradients reach q, k and v through
    sparsa's backward (``sparsa::llsa_backward``, registered as the op's autograd)."""
    out, _ = torch.ops.sparsa.llsa(q, k, v, block, topk, levels, enrich, dedupe, scale)
    return out


# ---- a FlexAttention-shaped entry ----------------------------------------------------------

def _sparsa_mask_of(block_mask, len_q: int, len_kv: int):
    """The sparsa mask a BlockMask's mask_mod was made from (:func:`mask_mod`), or None."""
    tag = getattr(block_mask.mask_mod, "_sparsa_mask", None)
    if tag is None:
        return None
    m, tag_q, tag_kv = tag
    if (tag_q, tag_kv) != (len_q, len_kv):
        raise ValueError(f"block_mask: its mask_mod ({m}) was made for {tag_q} queries over {tag_kv} keys, "
                         f"the call has {len_q} over {len_kv}")
    return m


def _plan_of_block_mask(block_mask, query, key):
    """The plan of a BlockMask and the sparsa mask its mask_mod stands for (None if none)."""
    from torch.nn.attention.flex_attention import noop_mask

    len_q, len_kv = int(query.shape[2]), int(key.shape[2])
    seq = tuple(int(s) for s in block_mask.seq_lengths)
    if seq != (len_q, len_kv):
        raise ValueError(f"block_mask: made for seq_lengths {seq}, but query has {len_q} tokens and key {len_kv}")
    mask = _sparsa_mask_of(block_mask, len_q, len_kv)
    if mask is None and block_mask.mask_mod is not noop_mask and bool((block_mask.kv_num_blocks > 0).any()):
        # create_block_mask puts the blocks its mask_mod leaves whole in full_kv_*, and the
        # ones it cuts in kv_* (partial): sparsa attends whole blocks and has no mask_mod.
        raise ValueError("block_mask: has partial blocks, inside which its mask_mod masks single elements; sparsa "
                         "attends whole key blocks (use a block-aligned mask, or sparsa.torch.causal_attention "
                         "for a causal one)")
    index = from_block_mask(block_mask)
    b, hq, nq = int(query.shape[0]), int(query.shape[1]), -(-len_q // index.block_q)
    if tuple(index.counts.shape[-1:]) != (nq,):
        raise ValueError(f"block_mask: has {index.counts.shape[-1]} query blocks of {index.block_q}, "
                         f"the query needs {nq}")
    counts = index.counts.expand(b, hq, nq).contiguous()  # a BlockMask may broadcast batch and heads
    indices = index.indices.expand(b, hq, nq, index.indices.shape[-1]).contiguous()
    return BlockIndex(index.block_q, index.block_kv, counts.to(query.device), indices.to(query.device)), mask


def attention(query, key, value, block_mask=None, plan: Optional[BlockIndex] = None, scale: Optional[float] = None,
              enable_gqa: bool = False, return_lse: bool = False, mask=None):
    """Attention with ``flex_attention``'s signature, so code written against it can switch:
    ``query`` ``[batch, heads_q, len_q, d]``, ``key``/``value`` ``[batch, heads_kv, len_kv, d]``.

    ``block_mask``: a FlexAttention ``BlockMask`` whose blocks are attended whole (its full
    blocks, and partial ones only with no ``mask_mod``), or masked exactly when its ``mask_mod``
    is one of :func:`mask_mod` (e.g. ``create_block_mask(mask_mod("causal", L, L), ...)`` or
    ``to_block_mask(plan, L, L, mask="causal")``); ``mask``: a sparsa mask applied inside the
    blocks (with or without a plan); ``plan``: a sparsa ``BlockIndex``
    (permuted plans too, e.g. BA-Att's); neither: dense attention. ``enable_gqa`` must be True
    when key/value have fewer heads than query (as flex_attention asks). Returns ``out``, or
    ``(out, lse)`` with ``return_lse`` (natural-log log-sum-exp, float32 ``[batch, heads_q,
    len_q]``, as flex_attention's)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"a {t.dim()}-d tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a 4-d tensor [batch, heads, seq, head_dim], got {got}")
    if int(query.shape[1]) != int(key.shape[1]) and not enable_gqa:
        raise ValueError(f"enable_gqa: query has {query.shape[1]} heads and key {key.shape[1]}; pass "
                         "enable_gqa=True for grouped-query attention")
    if block_mask is not None and plan is not None:
        raise ValueError("plan: pass block_mask or plan, not both")
    if block_mask is not None:
        plan, carried = _plan_of_block_mask(block_mask, query, key)
        if carried is not None:
            if mask is not None and sparsa.Mask.of(mask) != carried:
                raise ValueError(f"mask: {sparsa.Mask.of(mask)} differs from the block_mask's mask_mod ({carried})")
            mask = carried
    if plan is None:
        out, lse = dense(query, key, value, scale=scale, mask=mask)
    else:
        out, lse = block_sparse(query, key, value, plan, scale=scale, mask=mask)
    return (out, lse) if return_lse else out


# ---- causal attention from whole blocks and an exact diagonal --------------------------------
#
# sparsa's executors attend whole key blocks. Causal self-attention (len_q == len_kv) splits into
# the key blocks strictly before a query block, which every query of the block sees whole, and
# the diagonal block, which the causal mask cuts: the first go through sparsa::block_sparse
# (all of them, or BA-Att's choice among them), the diagonal is computed exactly here, and the two
# merge by log-sum-exp (sparsa::merge).

def _block_stats(x, block: int, dtype):
    """Per block of ``block`` tokens (the last may be partial): mean and population variance per
    dimension, ``[batch, heads, num_blocks, d]`` in ``dtype``."""
    b, h, n, d = x.shape
    nb = -(-n // block)
    xp = torch.nn.functional.pad(x.to(dtype), (0, 0, 0, nb * block - n)).view(b, h, nb, block, d)
    count = torch.clamp(n - torch.arange(nb, device=x.device) * block, max=block).to(dtype).view(1, 1, nb, 1)
    mean = xp.sum(3) / count
    var = torch.clamp((xp * xp).sum(3) / count - mean * mean, min=0)
    return mean, var


def _ba_att_block_logits(q, k, block: int, compensate: bool, beta: float, scale: float):
    """BA-Att's block logits without the norm sort (steps 2-3 with sort_q = sort_k = False, the
    compensation of Eq. 14): float ``[batch, heads_q, nb, nb]``, f64 on the CPU, f32 on a GPU."""
    dtype = torch.float64 if q.device.type == "cpu" else torch.float32
    mq, vq = _block_stats(q, block, dtype)
    mk, vk = _block_stats(k, block, dtype)
    groups = q.shape[1] // k.shape[1]
    mk, vk = mk.repeat_interleave(groups, 1), vk.repeat_interleave(groups, 1)
    logits = scale * mq @ mk.transpose(-1, -2)
    if compensate:
        delta = vq @ (mk * mk).transpose(-1, -2) + (mq * mq) @ vk.transpose(-1, -2) + vq @ vk.transpose(-1, -2)
        logits = logits + beta * scale * scale * delta
    return logits


def causal_plan(q, k, *, block: int = 64, density: float = 1.0, compensate: bool = True, beta: float = 1.0,
                scale: Optional[float] = None) -> BlockIndex:
    """The off-diagonal part of causal attention as a BlockIndex of tensors on q's device:
    query block i may visit key blocks 0..i-1 (the diagonal block i is computed apart). With
    ``density`` F < 1 it keeps ``ceil(F * (i + 1)) - 1`` of them (the diagonal counts as one of
    the ``ceil(F * (i + 1))`` blocks of the row), those of highest BA-Att block logit computed
    without the norm sort (a sort would move tokens across blocks and break causality); ties go
    to the lower block; kept indices ascending."""
    if not 0 < density <= 1:
        raise ValueError(f"density: expected a fraction in (0, 1], got {density}")
    b, hq, n = int(q.shape[0]), int(q.shape[1]), int(q.shape[2])
    nb = -(-n // block)
    rows = torch.arange(nb, device=q.device)
    keep = torch.clamp(torch.minimum(rows, torch.ceil(density * (rows + 1) - 1e-9).long() - 1), min=0)
    capacity = max(int(min(nb - 1, math.ceil(density * nb - 1e-9) - 1)), 0)
    cols = torch.arange(nb, device=q.device)
    if density >= 1:
        order = cols.expand(b, hq, nb, nb)
    else:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        logits = _ba_att_block_logits(q, k, block, compensate, beta, scale)
        logits = logits.masked_fill(cols[None, :] >= rows[:, None], float("-inf"))
        order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    chosen = order[..., :capacity]
    slot = torch.arange(capacity, device=q.device)
    big = torch.iinfo(torch.int32).max
    chosen = torch.where(slot < keep[:, None], chosen, big)
    chosen = torch.sort(chosen, dim=-1).values
    indices = torch.where(chosen == big, 0, chosen).to(torch.int32).contiguous()
    counts = keep.to(torch.int32).expand(b, hq, nb).contiguous()
    return BlockIndex(block, block, counts, indices)


def _flash_diagonal(q, k, v) -> bool:
    """Whether torch's flash kernel can take the diagonal blocks: CUDA tensors (sparsa's CUDA
    backend, which the rest of the composition needs, is built for sm_90a, where the kernel runs),
    bf16 or f16, one head_dim for q, k and v, a multiple of 8 up to 256. Shapes and dtypes only,
    so that torch.compile traces the choice without a graph break."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
            and k.shape[-1] == d and v.shape[-1] == d and d % 8 == 0 and d <= 256)


def _diagonal_attention(q, k, v, block: int, scale: float):
    """Exact causal attention of each query block over its own key block, ``(out, lse)``.

    On a GPU (bf16/f16) each block is one sequence of a batch for torch's causal flash kernel,
    which also returns the log-sum-exp: a pass over q, k and v. Elsewhere an f32 einsum over the
    blocks' score tiles (at 32K tokens and 32 heads those tiles are 0.5 GB a layer, read and
    written several times: the GPU path's cost before this one)."""
    if _flash_diagonal(q, k, v):
        return _diagonal_attention_flash(q, k, v, block, scale)
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    nb = -(-n // block)
    pad = nb * block - n
    f32 = torch.float32
    qb = torch.nn.functional.pad(q.to(f32), (0, 0, 0, pad)).view(b, hkv, hq // hkv, nb, block, d)
    kb = torch.nn.functional.pad(k.to(f32), (0, 0, 0, pad)).view(b, hkv, nb, block, d)
    vb = torch.nn.functional.pad(v.to(f32), (0, 0, 0, pad)).view(b, hkv, nb, block, v.shape[-1])
    s = torch.einsum("bhgnid,bhnjd->bhgnij", qb, kb) * scale
    pos = torch.arange(block, device=q.device)
    s = s.masked_fill((pos[None, :] > pos[:, None]).view(1, 1, 1, 1, block, block), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhgnij,bhnjd->bhgnid", torch.exp(s - lse[..., None]), vb)
    out = out.reshape(b, hq, nb * block, v.shape[-1])[:, :, :n].to(q.dtype)
    return out, lse.reshape(b, hq, nb * block)[:, :, :n]


def _flash_kernel(q, k, v, scale: float):
    """Causal attention of [batch, heads, L, d] q, k, v through torch's flash kernel: ``(out, lse)``."""
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[:2]


def _diagonal_attention_flash(q, k, v, block: int, scale: float, kernel=_flash_kernel):
    """_diagonal_attention through torch's flash kernel: the blocks become the batch (GQA's k and v
    repeated per query head; the padding of a last partial block is seen by padding rows only).
    ``kernel``: the tests pass a reference in its place to check the layout on a CPU."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    nb = -(-n // block)
    pad = nb * block - n

    def blocks(x, heads):  # [b, h, n, d] -> [b * nb, hq, block, d]
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(b, heads, 1, nb, block, d)
        x = x.expand(b, heads, hq // heads, nb, block, d).permute(0, 3, 1, 2, 4, 5)
        return x.reshape(b * nb, hq, block, d)

    out, lse = kernel(blocks(q, hq), blocks(k, hkv), blocks(v, hkv), scale)
    out = out.view(b, nb, hq, block, d).transpose(1, 2).reshape(b, hq, nb * block, d)[:, :, :n]
    lse = lse[..., :block].reshape(b, nb, hq, block).transpose(1, 2).reshape(b, hq, nb * block)[:, :, :n]
    return out, lse.float()


def causal_attention(q, k, v, *, block: int = 64, density: float = 1.0, compensate: bool = True,
                     beta: float = 1.0, scale: Optional[float] = None, return_plan: bool = False):
    """Causal self-attention (query i sees keys 0..i; len_q == len_kv): the blocks before each
    query block through ``sparsa::block_sparse`` over :func:`causal_plan`, the diagonal blocks
    exactly, merged by ``sparsa::merge``. ``density`` 1.0 is exact causal attention. Returns
    ``(out, lse)`` (and the plan with ``return_plan``)."""
    if int(q.shape[2]) != int(k.shape[2]):
        raise ValueError(f"k: causal attention here needs len_q == len_kv, got {q.shape[2]} and {k.shape[2]}")
    scale_value = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    plan = causal_plan(q, k, block=block, density=density, compensate=compensate, beta=beta, scale=scale_value)
    out, lse = _diagonal_attention(q, k, v, block, scale_value)
    if plan.capacity > 0:
        o_blocks, lse_blocks = torch.ops.sparsa.block_sparse(q, k, v, plan.counts, plan.indices, None, None, block,
                                                             block, scale_value, False)  # a plan made just above
        out, lse = merge(o_blocks, lse_blocks, out, lse.contiguous())
    return (out, lse, plan) if return_plan else (out, lse)
