"""sparsa as a transformers attention implementation (docs/torch.md).

``sparsa.hf.register()`` adds ``"sparsa_dense"`` and ``"sparsa_ba_att"`` to transformers'
``AttentionInterface`` (and the SDPA mask function to its ``AttentionMaskInterface`` under the
same names), so any model that dispatches through the interface (Llama, Qwen3, and the
diffusion LMs built on them) runs sparsa's attention::

    import sparsa.hf
    sparsa.hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sparsa_ba_att")
    with sparsa.hf.options(density=0.1):
        logits = model(ids).logits

Options (the budget and block sizes) come from, first to last: :func:`options` (a context
manager), the model config's ``sparsa`` dict (``cfg.sparsa = {"density": 0.1}``), the defaults
of :data:`DEFAULTS`.

Attention without a mask and with the module's ``is_causal`` False (a diffusion LM's
bidirectional attention) is sparsa's own call: ``sparsa::dense`` or ``sparsa::ba_att``. Causal
attention (``is_causal`` True, more than one query) goes through
:func:`sparsa.torch.causal_attention`: the blocks before each query block sparse (all of them
for ``sparsa_dense``; BA-Att's choice without the norm sort for ``sparsa_ba_att``), the diagonal
block exact. A padding mask (an ``attention_mask`` that is neither all-visible nor the causal
pattern), sliding windows, softcapping and attention dropout are refused with an error.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional

import torch

from . import torch as st

__all__ = ["register", "options", "record", "DEFAULTS", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("sparsa_dense", "sparsa_ba_att")

DEFAULTS: Dict[str, Any] = {
    "density": 0.5,       # the budget: one of density, top_kappa (bidirectional only)
    "top_kappa": None,
    "block_q": 64,        # BA-Att's blocks (causal attention uses block_q for both sides)
    "block_kv": 64,
    "sort_q": True,       # BA-Att's norm sorts (bidirectional only: a sort breaks causality)
    "sort_k": True,
    "compensate": True,
    "beta": 1.0,
}

_local = threading.local()


def _overrides() -> Dict[str, Any]:
    return getattr(_local, "options", {})


@contextlib.contextmanager
def options(**kwargs) -> Iterator[None]:
    """Override :data:`DEFAULTS` and the config's ``sparsa`` dict inside a ``with`` block (this
    thread). Unknown names are refused."""
    _check_names(kwargs, "options")
    if "density" in kwargs and "top_kappa" not in kwargs:
        kwargs.setdefault("top_kappa", None)
    if "top_kappa" in kwargs and kwargs["top_kappa"] is not None and "density" not in kwargs:
        kwargs["density"] = None
    saved = _overrides()
    _local.options = {**saved, **kwargs}
    try:
        yield
    finally:
        _local.options = saved


def _check_names(d: Dict[str, Any], where: str) -> None:
    unknown = sorted(set(d) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"{where}: unknown sparsa option(s) {', '.join(unknown)}; expected some of "
                         f"{', '.join(DEFAULTS)}")


def _resolve(module) -> Dict[str, Any]:
    resolved = dict(DEFAULTS)
    config = getattr(module, "config", None)
    from_config = getattr(config, "sparsa", None) if config is not None else None
    if from_config:
        if not isinstance(from_config, dict):
            raise TypeError(f"config.sparsa: expected a dict of sparsa options, got {type(from_config).__name__}")
        _check_names(from_config, "config.sparsa")
        if from_config.get("top_kappa") is not None and "density" not in from_config:
            resolved["density"] = None
        resolved.update(from_config)
    resolved.update(_overrides())
    if resolved["density"] is not None and resolved["top_kappa"] is not None:
        raise ValueError(f"budget: expected one of density or top_kappa, got density={resolved['density']}, "
                         f"top_kappa={resolved['top_kappa']}")
    return resolved


@contextlib.contextmanager
def record() -> Iterator[List[Dict[str, Any]]]:
    """Inside the block every sparsa attention call appends ``{"implementation", "causal",
    "q", "k", "plan"}`` (q/k as the layer saw them, the plan as a BlockIndex, None for dense
    bidirectional calls) to the yielded list: to inspect or test the plans a model's layers
    made. Eager mode only (the plan is computed apart from the fused op)."""
    calls: List[Dict[str, Any]] = []
    saved = getattr(_local, "record", None)
    _local.record = calls
    try:
        yield calls
    finally:
        _local.record = saved


def _visible(attention_mask):
    """The mask as bool, True where visible (an additive float mask: 0 where visible, a large
    negative value where not)."""
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0


def _is_causal_pattern(m, q_len: int, kv_len: int):
    """Whether the visibility ``m`` is the causal pattern, as a device bool (no synchronisation)."""
    want = torch.ones(q_len, kv_len, dtype=torch.bool, device=m.device).tril()
    # compared as int8: inductor's value-range analysis (torch 2.11's Triton codegen) fails on an
    # == between two bool tensors ("A Boolean argument can only be used in Eq and Ne")
    return (m.to(torch.int8) == want.to(torch.int8)).all()


def _assert_mask_is(attention_mask, causal: bool, q_len: int, kv_len: int) -> None:
    """A device-side check, no synchronisation: the mask is the causal pattern (``causal``) or
    all visible."""
    m = _visible(attention_mask)
    if causal:
        ok = _is_causal_pattern(m, q_len, kv_len)
        what = "the causal pattern (the layer is causal)"
    else:
        ok = m.all()
        what = "all visible (the layer is bidirectional, or the queries are a chunk after a cache)"
    torch._assert_async(ok, f"attention_mask: under CUDA-graph capture sparsa's attention follows the layer's "
                            f"is_causal, and the mask must be {what}")


def _mask_kind(attention_mask, q_len: int, kv_len: int) -> str:
    """'none' for an all-visible mask, 'causal' for the causal pattern; else an error."""
    m = _visible(attention_mask)
    if bool(m.all()):
        return "none"
    if q_len == kv_len and bool(_is_causal_pattern(m, q_len, kv_len)):
        return "causal"
    raise ValueError("attention_mask: sparsa's attention implementations take no padding or custom mask (only "
                     "none, all-visible or causal); run unpadded sequences, or pick another attn_implementation")


def _attention(implementation: str, module, query, key, value, attention_mask, dropout: float = 0.0,
               scaling: Optional[float] = None, is_causal: Optional[bool] = None, sliding_window=None,
               softcap=None, **kwargs):
    if dropout:
        raise ValueError(f"dropout: {implementation} has no attention dropout, got {dropout} (call model.eval(), or "
                         "set attention_dropout 0)")
    if sliding_window is not None:
        raise ValueError(f"sliding_window: {implementation} attends no sliding window, got {sliding_window}")
    if softcap is not None:
        raise ValueError(f"softcap: {implementation} has no logit softcapping, got {softcap}")
    q_len, kv_len = int(query.shape[2]), int(key.shape[2])
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None and torch.compiler.is_compiling():
        # A mask's values cannot steer Python while tracing: the graph decides when it runs, as
        # eager does (the mask rules, whatever the layer's is_causal says), through torch.cond
        # between the causal and the bidirectional call; any other mask fails an assertion then
        # (an error, never a silent wrong answer).
        return _traced_masked_attention(implementation, module, query, key, value, attention_mask, scaling)
    elif attention_mask is not None and st._capturing():
        # transformers builds its mask under CUDA-graph capture even where eager passes none, and
        # reading the mask would synchronise, which capture forbids: the layer decides, and the
        # mask must agree, checked on the device when the graph runs (an error, never a silent
        # wrong answer).
        causal = bool(causal) and q_len == kv_len and q_len > 1
        # transformers hands every layer the same mask tensor: checked once (at 32K tokens a
        # check reads a 1 GB mask and builds the pattern beside it).
        checked = getattr(_local, "captured_mask", None)
        if checked is None or checked[0]() is not attention_mask or checked[1] != causal:
            _assert_mask_is(attention_mask, causal, q_len, kv_len)
            _local.captured_mask = (weakref.ref(attention_mask), causal)
    elif attention_mask is not None:
        kind = _mask_kind(attention_mask, q_len, kv_len)
        causal = kind == "causal"
    else:
        causal = bool(causal) and q_len > 1
        if causal and kv_len > q_len:  # a static cache's empty slots (as transformers' SDPA path crops them)
            key, value = key[:, :, :q_len], value[:, :, :q_len]
    return _attend(implementation, module, query, key, value, causal, scaling)


def _traced_masked_attention(implementation, module, query, key, value, attention_mask, scaling):
    q_len, kv_len = int(query.shape[2]), int(key.shape[2])
    m = _visible(attention_mask)
    all_visible = m.all()
    if q_len == kv_len and q_len > 1:
        is_causal = _is_causal_pattern(m, q_len, kv_len)
    else:  # as _mask_kind: a causal mask is taken over the chunk's own keys only
        is_causal = torch.zeros((), dtype=torch.bool, device=m.device)
    torch._assert_async(all_visible | is_causal, "attention_mask: sparsa's attention implementations take no "
                                                 "padding or custom mask (only none, all-visible or causal)")
    if q_len == 1 or q_len != kv_len:
        return _attend(implementation, module, query, key, value, False, scaling)

    def causal_branch(q, k, v):
        return _attend(implementation, module, q, k, v, True, scaling)[0].contiguous()

    def bidirectional_branch(q, k, v):
        return _attend(implementation, module, q, k, v, False, scaling)[0].contiguous()

    operands = (_pinned(query), _pinned(key), _pinned(value))
    out = torch.cond(is_causal & ~all_visible, causal_branch, bidirectional_branch, operands)
    return out, None


@torch.library.custom_op("sparsa::hf_pinned", mutates_args=())
def _pinned(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x`` whose layout a compiled graph cannot change. torch.cond traces
    its branches for the layout its operands have when traced, but inductor may lay a computed
    tensor out as it likes where the graph runs: with torch 2.11 on CUDA it handed the branches
    q/k/v laid out [head_dim, tokens, heads] (inductor's stride assertion, also with .contiguous()
    operands). An op's output keeps the layout its fake kernel gives."""
    return x.clone(memory_format=torch.contiguous_format)


@_pinned.register_fake
def _pinned_fake(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _attend(implementation, module, query, key, value, causal: bool, scaling):
    o = _resolve(module)
    calls = getattr(_local, "record", None)
    plan = None
    if causal:
        density = 1.0 if implementation == "sparsa_dense" else o["density"]
        if density is None:
            raise ValueError("top_kappa: causal attention takes a density budget; set density")
        out, _, plan = st.causal_attention(query, key, value, block=o["block_q"], density=density,
                                           compensate=o["compensate"], beta=o["beta"], scale=scaling,
                                           return_plan=True)
    elif implementation == "sparsa_dense":
        out, _ = st.dense(query, key, value, scale=scaling)
    else:
        budget = dict(density=o["density"]) if o["top_kappa"] is None else dict(top_kappa=o["top_kappa"])
        args = dict(block_q=o["block_q"], block_kv=o["block_kv"], sort_q=o["sort_q"], sort_k=o["sort_k"],
                    compensate=o["compensate"], beta=o["beta"], scale=scaling)
        if calls is None:
            out, _ = st.ba_att(query, key, value, **args, **budget)
        else:
            plan = st.ba_att_plan(query, key, **args, **budget)
            out, _ = st.block_sparse(query, key, value, plan, scale=scaling, check_index=False)
    if calls is not None:
        calls.append({"implementation": implementation, "causal": causal, "q": query.detach(), "k": key.detach(),
                      "plan": plan})
    return out.transpose(1, 2).contiguous(), None


def _dense_forward(module, query, key, value, attention_mask, **kwargs):
    return _attention("sparsa_dense", module, query, key, value, attention_mask, **kwargs)


def _ba_att_forward(module, query, key, value, attention_mask, **kwargs):
    return _attention("sparsa_ba_att", module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    """Add ``sparsa_dense`` and ``sparsa_ba_att`` to transformers' AttentionInterface, with
    SDPA's mask function (a mask only where padding needs one, which these implementations
    then refuse). Idempotent."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    except ImportError as e:
        raise ImportError("sparsa.hf needs transformers with AttentionInterface (>= 4.54): pip install transformers"
                          ) from e
    for name, function in zip(IMPLEMENTATIONS, (_dense_forward, _ba_att_forward)):
        AttentionInterface.register(name, function)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
