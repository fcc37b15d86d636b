"""sparsa: sparse attention for diffusion models.

Every function takes the arrays you already have (numpy, torch, cupy or jax; CPU, or
CUDA once the CUDA backend is built) through DLPack without copying them, and returns
outputs of the same array type on the same device. Attention inputs are
``[batch, heads, seq, head_dim]`` with a contiguous last dimension; other dimensions
may be strided. Arrays in FlashAttention's / FlashInfer's ``[batch, seq, heads, head_dim]``
layout are passed as a view in sparsa's order, without a copy: ``x.transpose(1, 2)`` (torch)
or ``x.transpose(0, 2, 1, 3)`` (numpy, cupy, jax); ``out`` then comes back
``[batch, heads, seq, head_dim]`` (``out.transpose(1, 2)`` is the other layout again) and
``lse`` is ``[batch, heads, seq]`` as FlashAttention's. A bshd array passed as it is would be
read as bhsd: wrong, and undetectable when the shapes happen to fit. Errors carry the core's
message, which names the argument: ``ValueError`` for bad arguments, ``TypeError`` for dtypes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from . import _sparsa as _core

__all__ = [
    "BlockIndex",
    "Mask",
    "dense",
    "block_sparse",
    "dense_varlen",
    "block_sparse_varlen",
    "merge",
    "llsa",
    "llsa_backward",
    "llsa_plan",
    "ba_att",
    "ba_att_plan",
    "ba_att_scores",
    "BaAttScores",
    "xattention",
    "xattention_plan",
    "xattention_scores",
    "BlockPartition",
    "OracleBlocks",
    "oracle_blocks",
    "mass_recall",
    "DeviationBound",
    "deviation_bound",
    "mass_recall_from_lse",
    "relative_error",
    "PagedKVCache",
    "PagePlan",
    "quest_plan",
    "quest",
    "LosaState",
    "DevicePagedKVCache",
    "DeviceLosaState",
    "read_tensor",
    "write_tensor",
    "generate_workload",
    "version",
    "backends",
    "Model",
    "Chat",
    "PromptCache",
    "Tokenizer",
    "ChatTemplate",
    "backend_status",
    "token_permutation",
    "inverse_permutation",
]

__version__ = _core.version()


def version() -> str:
    """The library version."""
    return _core.version()


def backends(compiled: bool = False) -> list:
    """Backends that can run here: cpu_ref, cpu, and cuda when it is compiled in and a CUDA
    device is visible (backend_status("cuda") says which of the two is missing). With
    ``compiled=True``: the backends compiled into this build (the wheel or the CMake build),
    cuda included where it was compiled and no device is visible."""
    return _core.compiled_backends() if compiled else _core.backends()


def backend_status(name: str) -> str:
    """Why backend `name` cannot run here ('' when it can): for cuda, either "not compiled
    into this build" or "compiled into this build, but no CUDA device is visible"."""
    return _core.backend_status(name)


# ---- allocation by array type -------------------------------------------------------

def _to_host(a: Any) -> np.ndarray:
    """A numpy copy (or view) of a numpy, torch, cupy or jax array."""
    if isinstance(a, np.ndarray):
        return a
    module = type(a).__module__.split(".")[0]
    if module == "torch":
        return a.detach().cpu().numpy()
    if module == "cupy":
        return a.get()
    return np.asarray(a)


def _framework(x: Any, name: str = "array") -> str:
    module = type(x).__module__.split(".")[0]
    if module in ("numpy", "torch", "cupy", "jax", "jaxlib"):
        return "jax" if module == "jaxlib" else module
    if hasattr(x, "__dlpack__"):
        return "dlpack"
    raise TypeError(f"{name}: expected a numpy, torch, cupy or jax array, got {type(x).__name__}")


def _empty(like: Any, shape: Tuple[int, ...], float32: bool) -> Any:
    """An uninitialised array of the framework and device of `like` (dtype of `like`,
    or float32)."""
    fw = _framework(like)
    if fw == "torch":
        import torch

        return torch.empty(shape, dtype=torch.float32 if float32 else like.dtype, device=like.device)
    if fw == "cupy":
        import cupy

        return cupy.empty(shape, dtype=cupy.float32 if float32 else like.dtype)
    if fw == "numpy":
        return np.empty(shape, dtype=np.float32 if float32 else like.dtype)
    # jax arrays are immutable and other DLPack producers have no allocator we know:
    # compute into numpy (host arrays only) and convert back at the end.
    host = np.from_dlpack(like)
    return np.empty(shape, dtype=np.float32 if float32 else host.dtype)


def _finish(like: Any, result: Any) -> Any:
    if _framework(like) == "jax" and isinstance(result, np.ndarray):
        import jax.numpy as jnp

        return jnp.asarray(result)
    return result


def _shape(x: Any) -> Tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _outputs(q: Any, out: Any, lse: Any, name: str = "q") -> Tuple[Any, Any]:
    _framework(q, name)
    shape = _shape(q)
    if out is None:
        out = _empty(q, shape, float32=False)
    if lse is None:
        lse = _empty(q, shape[:-1], float32=True)
    return out, lse


def _stream(like: Any, stream: Any) -> int:
    """The CUDA stream a call on `like`'s device is ordered on, as an integer cudaStream_t.

    ``None`` takes the framework's current stream of that device (torch's
    ``torch.cuda.current_stream(device)``, cupy's current stream), so sparsa's kernels order with
    the caller's work as any torch or cupy op would; 0 for host arrays and other frameworks (the
    legacy default stream). Also accepted: a ``torch.cuda.Stream``, a cupy stream, or an integer
    handle."""
    if stream is not None:
        if isinstance(stream, bool):
            raise TypeError("stream: expected a CUDA stream or an integer handle, got bool")
        if isinstance(stream, int):
            if stream < 0:
                raise ValueError(f"stream: expected a non-negative integer handle, got {stream}")
            return stream
        for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
            handle = getattr(stream, attr, None)
            if isinstance(handle, int):
                return handle
        raise TypeError(f"stream: expected a torch.cuda.Stream, a cupy stream or an integer handle, "
                        f"got {type(stream).__name__}")
    try:
        fw = _framework(like)
    except TypeError:
        return 0  # not an array: the call's own check names the argument
    if fw == "torch" and like.is_cuda:
        import torch

        return int(torch.cuda.current_stream(like.device).cuda_stream)
    if fw == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    return 0


# ---- masks ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Mask:
    """A per-element attention mask (docs/masks.md). Query i stands at position
    ``i + (len_kv - len_q)`` of the keys (end alignment, as FlashAttention) and sees key j iff

    - ``none``: always;
    - ``causal``: ``j <= i'``;
    - ``block_causal`` (``block`` b): ``j // b <= i' // b`` (bidirectional inside blocks of b
      tokens, causal across them);
    - ``sliding_window`` (``left``, ``right``): ``i' - left <= j <= i' + right``
      (FlashAttention's ``window_size``; ``sliding_window(w)`` is ``(w, w)``).

    Every ``mask=`` argument also takes ``None``, ``"causal"``, ``("block_causal", 16)``,
    ``("sliding_window", 128)``, ``("sliding_window", 128, 0)`` or the text forms
    ``"block_causal(16)"`` / ``"sliding_window(128,0)"``."""

    kind: str = "none"
    block: int = 0
    left: int = 0
    right: int = 0

    @staticmethod
    def none() -> "Mask":
        return Mask()

    @staticmethod
    def causal() -> "Mask":
        return Mask("causal")

    @staticmethod
    def block_causal(block: int) -> "Mask":
        return Mask("block_causal", block=int(block))

    @staticmethod
    def sliding_window(left: int, right: Optional[int] = None) -> "Mask":
        return Mask("sliding_window", left=int(left), right=int(left if right is None else right))

    def __str__(self) -> str:
        if self.kind == "sliding_window" and self.left == self.right:
            return f"sliding_window({self.left})"
        return self._text()

    def _text(self) -> str:
        if self.kind == "block_causal":
            return f"block_causal({self.block})"
        if self.kind == "sliding_window":
            return f"sliding_window({self.left},{self.right})"
        return self.kind

    def visible(self, i: int, j: int, len_q: int, len_kv: int) -> bool:
        """Whether query i sees key j (0 <= i < len_q, 0 <= j < len_kv), as the C++ core decides."""
        return _core.mask_visible(self._text(), int(i), int(j), int(len_q), int(len_kv))

    @staticmethod
    def of(mask: Any) -> "Mask":
        """The Mask that a ``mask=`` argument names (see the class docstring); a clear
        ``ValueError`` naming ``mask`` otherwise. Plain Python (torch.compile traces it)."""
        if mask is None:
            return Mask()
        if isinstance(mask, Mask):
            m = mask
        elif isinstance(mask, str):
            m = _parse_mask_text(mask)
        elif isinstance(mask, tuple) and mask and isinstance(mask[0], str):
            name, args = mask[0], mask[1:]
            ints = all(isinstance(x, int) and not isinstance(x, bool) for x in args)
            if name in ("none", "causal") and not args:
                m = Mask(name)
            elif name == "block_causal" and len(args) == 1 and ints:
                m = Mask.block_causal(args[0])
            elif name == "sliding_window" and len(args) in (1, 2) and ints:
                m = Mask.sliding_window(*args)
            else:
                raise ValueError(f"mask: expected ('block_causal', B), ('sliding_window', W) or "
                                 f"('sliding_window', L, R) with integers, got {mask!r}")
        else:
            raise TypeError(f"mask: expected None, a str, a tuple such as ('block_causal', 16) or a sparsa.Mask, "
                            f"got {type(mask).__name__}")
        if m.kind not in ("none", "causal", "block_causal", "sliding_window"):
            raise ValueError(f"mask: unknown kind '{m.kind}' (none, causal, block_causal, sliding_window)")
        if m.kind == "block_causal" and m.block <= 0:
            raise ValueError(f"mask: block_causal expects a block of at least 1 token, got {m.block}")
        if m.kind == "sliding_window" and (m.left < 0 or m.right < 0):
            raise ValueError(f"mask: sliding_window expects windows >= 0, got ({m.left}, {m.right})")
        return m


def _parse_mask_text(text: str) -> Mask:
    """The text forms of the C++ parser (parse_mask): none, causal, block_causal(B) /
    block_causal:B, sliding_window(W) / sliding_window(L,R) / sliding_window:W / sliding_window:L,R."""
    t = text.replace(" ", "")
    if t in ("", "none", "causal"):
        return Mask(t or "none")
    for name in ("block_causal", "sliding_window"):
        if t.startswith(name + "(") and t.endswith(")"):
            args = t[len(name) + 1:-1]
        elif t.startswith(name + ":"):
            args = t[len(name) + 1:]
        else:
            continue
        parts = args.split(",")
        if all(p.isascii() and p.isdigit() and len(p) <= 18 for p in parts):
            if name == "block_causal" and len(parts) == 1:
                return Mask.block_causal(int(parts[0]))
            if name == "sliding_window" and len(parts) in (1, 2):
                return Mask.sliding_window(*(int(p) for p in parts))
    raise ValueError(f"mask: expected none, causal, block_causal(B), sliding_window(W) or sliding_window(L,R) "
                     f"(B > 0, W, L, R >= 0; also block_causal:B, sliding_window:W), got '{text}'")


def _mask_text(mask: Any) -> str:
    return Mask.of(mask)._text()


# ---- executors ------------------------------------------------------------------------

def dense(q, k, v, *, scale: Optional[float] = None, mask: Any = None, backend: str = "auto",
          check_finite: bool = False, num_threads: int = 0, out=None, lse=None, stream=None):
    """Dense softmax attention. Returns ``(out, lse)``: out has q's dtype and shape,
    lse is float32 ``[batch, heads_q, len_q]`` (natural log). GQA when k/v have fewer
    heads than q. Pass ``out=``/``lse=`` to write into existing arrays (zero copy).

    ``mask``: a per-element mask (:class:`Mask`; e.g. ``"causal"``, ``("block_causal", 16)``,
    ``("sliding_window", 128)``); a query that sees no key gets out = 0 and lse = -inf.

    ``stream`` (cuda backend): the CUDA stream the call runs on; by default torch's (or cupy's)
    current stream of q's device, so the call orders with the caller's work like any torch op."""
    text = _mask_text(mask)
    out, lse = _outputs(q, out, lse)
    _core.dense(q, k, v, out, lse, scale, backend, check_finite, num_threads, _stream(q, stream), text)
    return _finish(q, out), _finish(q, lse)


def _varlen_outputs(q: Any, out: Any, lse: Any) -> Tuple[Any, Any]:
    _framework(q, "q")
    shape = _shape(q)
    if len(shape) != 3:
        raise ValueError(f"q: expected 3 dimensions [total_q, heads_q, head_dim] (variable-length batch), "
                         f"got {len(shape)} {list(shape)}")
    if out is None:
        out = _empty(q, shape, float32=False)
    if lse is None:
        lse = _empty(q, (shape[1], shape[0]), float32=True)
    return out, lse


def _offsets(cu: Any, name: str, q: Any = None) -> Any:
    """Offsets as int32 (a Python list or an int64 array is converted; arrays already int32 pass
    as they are, zero copy). A list or numpy array beside a torch CUDA ``q`` goes to q's device
    (offsets given as tensors stay where they are: a device mismatch is an error naming them)."""
    if isinstance(cu, (list, tuple)):
        cu = np.asarray(cu, dtype=np.int32)
    if isinstance(cu, np.ndarray) and cu.dtype != np.int32:
        if not np.issubdtype(cu.dtype, np.integer):
            raise TypeError(f"{name}: expected integer offsets, got dtype {cu.dtype}")
        if cu.size and (cu.max() > np.iinfo(np.int32).max or cu.min() < np.iinfo(np.int32).min):
            raise ValueError(f"{name}: offsets beyond int32")
        cu = cu.astype(np.int32)
    if isinstance(cu, np.ndarray):
        if q is not None and getattr(q, "is_cuda", False):
            import torch

            return torch.as_tensor(cu, device=q.device)
        return cu
    if _framework(cu, name) == "torch" and str(cu.dtype) != "torch.int32":
        import torch

        if cu.dtype.is_floating_point:
            raise TypeError(f"{name}: expected integer offsets, got dtype {cu.dtype}")
        return cu.to(torch.int32)
    return cu


def dense_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, *, scale: Optional[float] = None, mask: Any = None,
                 backend: str = "auto", check_finite: bool = False, num_threads: int = 0, out=None, lse=None,
                 stream=None):
    """Dense attention over a variable-length batch (FlashAttention's varlen layout):
    ``q`` ``[total_q, heads_q, d]``, ``k``/``v`` ``[total_kv, heads_kv, d]`` and offsets
    ``cu_seqlens_q`` / ``cu_seqlens_kv`` ``[num_seqs + 1]`` (int32; 0 first, never decreasing,
    the totals last): sequence s is q rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` against k/v rows
    ``cu_seqlens_kv[s]:cu_seqlens_kv[s+1]``. Returns ``(out, lse)``: out like q, lse float32
    ``[heads_q, total_q]``. ``mask`` applies per sequence (positions local to it)."""
    text = _mask_text(mask)
    cu_q, cu_kv = _offsets(cu_seqlens_q, "cu_seqlens_q", q), _offsets(cu_seqlens_kv, "cu_seqlens_kv", q)
    out, lse = _varlen_outputs(q, out, lse)
    _core.dense_varlen(q, k, v, cu_q, cu_kv, out, lse, scale, backend, check_finite, num_threads, _stream(q, stream),
                       text)
    return _finish(q, out), _finish(q, lse)


# The entries of an index file and their dimensions (the reader of `sparsa run --index` takes the same).
_INDEX_DIMS = {"counts": ("batch", "heads_q", "num_q_blocks"),
               "indices": ("batch", "heads_q", "num_q_blocks", "capacity"),
               "perm_q": ("batch", "heads_q", "len_q"), "perm_kv": ("batch", "heads_kv", "len_kv")}
_MAX_INDEX_BLOCK = 1 << 20


@dataclass
class BlockIndex:
    """The plan of every block-sparse method (the core of FlexAttention's BlockMask).

    counts  int32 [batch, heads_q, num_q_blocks]: key blocks each query block visits
    indices int32 [batch, heads_q, num_q_blocks, capacity]: those blocks, ascending
    perm_q  optional int32 [batch, heads_q, len_q]: blocks formed over q[perm_q]
    perm_kv optional int32 [batch, heads_kv, len_kv]: blocks formed over k[perm_kv]
    """

    block_q: int
    block_kv: int
    counts: Any
    indices: Any
    perm_q: Any = None
    perm_kv: Any = None

    @property
    def num_q_blocks(self) -> int:
        return int(self.counts.shape[-1])

    @property
    def capacity(self) -> int:
        return int(self.indices.shape[-1])

    def density(self, len_q: int, len_kv: int) -> float:
        """Fraction of (query, key) token pairs this plan visits."""
        return _core.block_index_density(self.counts, self.indices, self.block_q, self.block_kv, len_q, len_kv)

    def __repr__(self) -> str:
        def arr(a):
            return "None" if a is None else f"{getattr(a, 'dtype', '?')}{list(_shape(a))}"
        return (f"BlockIndex(block_q={self.block_q}, block_kv={self.block_kv}, counts={arr(self.counts)}, "
                f"indices={arr(self.indices)}, perm_q={arr(self.perm_q)}, perm_kv={arr(self.perm_kv)})")

    def save(self, path: str) -> None:
        """Write the plan as the .safetensors index file that ``sparsa run --index`` reads
        (entries counts, indices and the present permutations, int32; block sizes in the
        header's ``__metadata__``). Device arrays are copied to the host. The library's writer
        writes it: to a temporary file, then renamed over ``path``, so a failed write leaves an
        earlier file whole."""
        names = [name for name in _INDEX_DIMS if getattr(self, name) is not None]
        arrays = [np.ascontiguousarray(_to_host(getattr(self, name)), dtype=np.int32) for name in names]
        _core.write_safetensors(str(path), names, arrays, ["block_q", "block_kv"],
                                [str(int(self.block_q)), str(int(self.block_kv))])

    @staticmethod
    def load(path: str, block_q: Optional[int] = None, block_kv: Optional[int] = None) -> "BlockIndex":
        """Read an index file (``BlockIndex.save``, ``sparsa plan --index``) as numpy arrays.
        Block sizes come from the arguments, else from the header's ``__metadata__``. The file
        is read by the library's safetensors reader (the one ``sparsa run --index`` uses) and
        checked as that command checks it; a broken file is a ValueError naming it."""
        try:
            arrays, meta = _core.read_safetensors(str(path))
        except (ValueError, TypeError) as e:  # malformed, or a dtype sparsa does not read (a missing file: RuntimeError)
            raise ValueError(f"path: {e}") from None
        for name, a in arrays.items():
            if name not in _INDEX_DIMS:
                raise ValueError(f"path: {path}: unknown entry '{name}' (expected counts, indices, perm_q, perm_kv)")
            if a.dtype != np.int32:
                raise ValueError(f"index.{name}: expected dtype I32, got {a.dtype}")
            if a.ndim != len(_INDEX_DIMS[name]):
                raise ValueError(f"index.{name}: expected {len(_INDEX_DIMS[name])} dimensions "
                                 f"[{', '.join(_INDEX_DIMS[name])}], got {a.ndim}")
        for name in ("counts", "indices"):
            if name not in arrays:
                raise ValueError(f"path: {path}: missing entry '{name}'")
        counts, indices = arrays["counts"], arrays["indices"]
        if counts.shape != indices.shape[:3]:
            raise ValueError(f"index.indices: its first three dimensions {list(indices.shape[:3])} are not "
                             f"index.counts' {list(counts.shape)}")

        def block(name, given):
            if given is not None:
                return given
            text = meta.get(name)
            if text is None:
                return None
            if not (text.isascii() and text.isdigit() and 1 <= int(text) <= _MAX_INDEX_BLOCK):
                raise ValueError(f"path: {path}: __metadata__ {name} must be an integer in "
                                 f"[1, {_MAX_INDEX_BLOCK}], got {text[:80]!r}")
            return int(text)

        bq, bkv = block("block_q", block_q), block("block_kv", block_kv)
        if bq is None or bkv is None:
            raise ValueError(f"path: {path}: block sizes unknown; pass block_q and block_kv "
                             "or store them in the header's __metadata__")
        return BlockIndex(int(bq), int(bkv), counts, indices, arrays.get("perm_q"), arrays.get("perm_kv"))

    @staticmethod
    def full(batch: int, heads_q: int, len_q: int, len_kv: int, block_q: int, block_kv: int,
             mask: Any = None) -> "BlockIndex":
        """Every query block visits every key block (dense as a plan), as numpy arrays. With a
        ``mask``: only the key blocks in which the mask leaves the query block a visible pair
        (fully masked blocks are left out); run it with the same ``mask=``."""
        if mask is not None and not Mask.of(mask).kind == "none":
            return _plan(_core.masked_full_plan(batch, heads_q, len_q, len_kv, block_q, block_kv, _mask_text(mask)))
        nq = -(-len_q // block_q)
        nkv = -(-len_kv // block_kv)
        counts = np.full((batch, heads_q, nq), nkv, dtype=np.int32)
        indices = np.broadcast_to(np.arange(nkv, dtype=np.int32), (batch, heads_q, nq, nkv)).copy()
        return BlockIndex(block_q, block_kv, counts, indices)


def block_sparse(q, k, v, index: BlockIndex, *, scale: Optional[float] = None, mask: Any = None,
                 backend: str = "auto", check_finite: bool = False, num_threads: int = 0, check_index: bool = True,
                 out=None, lse=None, stream=None):
    """Attention over the key blocks a BlockIndex lists. Returns ``(out, lse)``; a
    query whose block lists no key block gets out = 0 and lse = -inf.

    ``check_index`` (cuda backend): check the index's contents on the device first (one
    read-back that synchronises the stream); ``False`` trusts a plan sparsa's own selector just
    made. A malformed plan then gives wrong numbers instead of an error, never an out-of-bounds
    access. The host backends always check. ``stream``: as in :func:`dense`. ``mask``: as in
    :func:`dense`, applied inside the listed blocks on original token positions (through any
    permutation); key blocks it hides entirely are skipped."""
    if not isinstance(index, BlockIndex):
        raise TypeError(f"index: expected sparsa.BlockIndex, got {type(index).__name__}")
    text = _mask_text(mask)
    out, lse = _outputs(q, out, lse)
    _core.block_sparse(q, k, v, index.counts, index.indices, index.perm_q, index.perm_kv, index.block_q,
                       index.block_kv, out, lse, scale, backend, check_finite, num_threads, check_index,
                       _stream(q, stream), text)
    return _finish(q, out), _finish(q, lse)


def block_sparse_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, index: BlockIndex, *, scale: Optional[float] = None,
                        mask: Any = None, backend: str = "auto", check_finite: bool = False, num_threads: int = 0,
                        out=None, lse=None, stream=None):
    """Block-sparse attention over a variable-length batch (layout as :func:`dense_varlen`). The
    index's batch dimension is the sequence: counts ``[num_seqs, heads_q, ceil(max_len_q /
    block_q)]``, indices ``[..., capacity]``; sequence s uses its first ``ceil(len_q_s / block_q)``
    rows and lists only its own ``ceil(len_kv_s / block_kv)`` key blocks; permutations are
    ``[num_seqs, heads, max_len]`` with a permutation of ``0..len_s-1`` in the first len_s entries."""
    if not isinstance(index, BlockIndex):
        raise TypeError(f"index: expected sparsa.BlockIndex, got {type(index).__name__}")
    text = _mask_text(mask)
    cu_q, cu_kv = _offsets(cu_seqlens_q, "cu_seqlens_q", q), _offsets(cu_seqlens_kv, "cu_seqlens_kv", q)
    out, lse = _varlen_outputs(q, out, lse)
    _core.block_sparse_varlen(q, k, v, cu_q, cu_kv, index.counts, index.indices, index.perm_q, index.perm_kv,
                              index.block_q, index.block_kv, out, lse, scale, backend, check_finite, num_threads,
                              _stream(q, stream), text)
    return _finish(q, out), _finish(q, lse)


def merge(o1, lse1, o2, lse2, *, backend: str = "auto", out=None, lse=None, stream=None):
    """Merge two partial attention results over disjoint key sets by log-sum-exp.
    ``out``/``lse`` may alias ``o1``/``lse1``. On CUDA tensors the kernel is ordered on ``stream``
    (default: the framework's current stream)."""
    out, lse = _outputs(o1, out, lse, "o1")
    _core.merge(o1, lse1, o2, lse2, out, lse, backend, _stream(o1, stream))
    return _finish(o1, out), _finish(o1, lse)


# ---- LLSA (log-linear sparse attention) ---------------------------------------------------

def llsa(q, k, v, *, block: int = 16, topk: int = 8, levels: int = -1, enrich: bool = True, dedupe: bool = False,
         scale: Optional[float] = None, backend: str = "auto", num_threads: int = 0, check_finite: bool = False,
         out=None, lse=None):
    """Log-linear sparse attention (docs/llsa.md): coarse-to-fine top-k selection over
    mean-pooled levels and KV enrichment. Self-attention ``[batch, heads, N, d]``.
    Returns ``(out, lse)``."""
    out, lse = _outputs(q, out, lse)
    _core.llsa_forward(q, k, v, out, lse, block, topk, levels, enrich, dedupe, scale, backend, num_threads,
                       check_finite, _stream(q, None))
    return _finish(q, out), _finish(q, lse)


def llsa_backward(q, k, v, out, lse, d_out, *, block: int = 16, topk: int = 8, levels: int = -1,
                  enrich: bool = True, dedupe: bool = False, scale: Optional[float] = None, backend: str = "auto",
                  num_threads: int = 0):
    """Gradients ``(dq, dk, dv)`` of LLSA given the forward's ``out``, ``lse`` and the
    output gradient. Selection is not differentiated."""
    dq = _empty(q, _shape(q), float32=False)
    dk = _empty(k, _shape(k), float32=False)
    dv = _empty(v, _shape(v), float32=False)
    _core.llsa_backward(q, k, v, out, lse, d_out, dq, dk, dv, block, topk, levels, enrich, dedupe, scale, backend,
                        num_threads, _stream(q, None))
    return _finish(q, dq), _finish(q, dk), _finish(q, dv)


def llsa_plan(q, k, *, block: int = 16, topk: int = 8, levels: int = -1, enrich: bool = True,
              dedupe: bool = False, max_rows: int = 8) -> dict:
    """The LLSA selection plan: ``levels``, ``level_len``, ``keys_per_query``, a printable
    ``text`` of (batch 0, head 0) and ``index``, the fine-level BlockIndex."""
    plan = _core.llsa_plan(q, k, block, topk, levels, enrich, dedupe, max_rows, _stream(q, None))
    plan["index"] = BlockIndex(plan["block"], plan["block"], plan.pop("counts"), plan.pop("indices"))
    return plan


# ---- block selectors: BA-Att and XAttention ----------------------------------------------
#
# Selectors run on the CPU and return a BlockIndex of numpy arrays, which block_sparse
# accepts beside any CPU array; ba_att_plan on CUDA arrays runs on the device and returns
# device arrays. The budget is one of three keywords (default as in the core):
#   top_kappa=K   the K highest-scoring key blocks per query block;
#   density=F     ceil(F * num_kv_blocks) key blocks per query block, F in (0, 1];
#   tau=T         the fewest key blocks whose softmax mass reaches T of the row, T in (0, 1].

def _budget(top_kappa, density, tau, default: Tuple[str, float]) -> Tuple[str, float]:
    given = [(name, value) for name, value in (("top_kappa", top_kappa), ("density", density), ("mass", tau))
             if value is not None]
    if len(given) > 1:
        names = ", ".join(f"{'tau' if n == 'mass' else n}={v}" for n, v in given)
        raise ValueError(f"budget: expected at most one of top_kappa, density or tau, got {names}")
    if not given:
        return default
    name, value = given[0]
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        keyword = "tau" if name == "mass" else name
        raise TypeError(f"budget: {keyword} expects a number, got {type(value).__name__}")
    return name, float(value)


def _from_dlpack(like: Any, array: Any) -> Any:
    """A device plan array (a DLPack capsule owner) as an array of q's framework, zero copy."""
    if array is None:
        return None
    fw = _framework(like)
    if fw == "torch":
        import torch

        return torch.from_dlpack(array)
    if fw == "cupy":
        import cupy

        return cupy.from_dlpack(array)
    return array


def _plan(d: dict, like: Any = None) -> BlockIndex:
    arrays = [d[name] for name in ("counts", "indices", "perm_q", "perm_kv")]
    if d.get("on_device", False):
        arrays = [_from_dlpack(like, a) for a in arrays]
    return BlockIndex(d["block_q"], d["block_kv"], *arrays)


def ba_att_plan(q, k, *, block_q: int = 64, block_kv: int = 64, sort_q: bool = True, sort_k: bool = True,
                sort_window: int = 0, compensate: bool = True, compensation: str = "diagonal", beta: float = 1.0,
                top_kappa: Optional[int] = None, density: Optional[float] = None, tau: Optional[float] = None,
                scale: Optional[float] = None, backend: str = "auto", num_threads: int = 0,
                check_finite: bool = False, stream=None, mask: Any = None, mask_aware: bool = False) -> BlockIndex:
    """The BA-Att plan (Block Approximate Sparse Attention, Algorithm 1; docs/ba_att.md).

    Per (batch, head): optional stable norm sort of q (per query head) and k (per kv
    head), globally or within windows of ``sort_window`` tokens (a multiple of both
    block sizes); block means (and variances); block logits ``scale * Qbar . Kbar``
    plus, when ``compensate``, ``beta * Delta`` with ``compensation`` one of
    ``"diagonal"`` (Eq. 14), ``"exact"`` or ``"trace"`` (Eq. 13); then the budget per
    query block: ``top_kappa``, ``density`` or ``tau`` (at most one; default density=0.5).

    Returns a BlockIndex whose ``perm_q`` / ``perm_kv`` (int32, or None without sort_q /
    sort_k) say which original token sits at each permuted position; block_sparse reads
    q[perm_q], k[perm_kv] and writes the output back in the original order.

    With ``backend="cuda"`` (or ``"auto"`` on CUDA arrays) the whole selection runs on q's
    device and the plan's arrays stay there: torch (or cupy) CUDA tensors for torch (cupy)
    inputs, zero copy; block_sparse / ba_att take them as they are. The selection runs on
    ``stream`` (as in :func:`dense`: torch's current stream by default) and the plan's arrays are
    allocated there.

    ``mask_aware`` (with ``sort_q = sort_k = False``; CPU backends): the selection sees ``mask``
    (``"causal"``, ``("block_causal", 16)``, ...): key blocks it hides from a whole query block are
    never chosen, the block of each query's last visible key is always kept, and the budget counts
    the visible blocks (docs/ba_att.md, "Under a causal or block-causal mask")."""
    kind, value = _budget(top_kappa, density, tau, ("density", 0.5))
    return _plan(_core.ba_att_plan(q, k, block_q, block_kv, sort_q, sort_k, sort_window, compensate, compensation,
                                   beta, kind, value, scale, backend, num_threads, check_finite,
                                   _stream(q, stream), _mask_text(mask), mask_aware), like=q)


@dataclass
class BaAttScores:
    """BA-Att's intermediate results (steps 1-3, no budget).

    logits  float32 [batch, heads_q, num_q_blocks, num_kv_blocks]: the (compensated) block logits
    perm_q  int32 [batch, heads_q, len_q] or None (sort_q=False)
    perm_kv int32 [batch, heads_kv, len_kv] or None (sort_k=False)
    """

    block_q: int
    block_kv: int
    logits: np.ndarray
    perm_q: Optional[np.ndarray]
    perm_kv: Optional[np.ndarray]


def ba_att_scores(q, k, *, block_q: int = 64, block_kv: int = 64, sort_q: bool = True, sort_k: bool = True,
                  sort_window: int = 0, compensate: bool = True, compensation: str = "diagonal", beta: float = 1.0,
                  scale: Optional[float] = None, backend: str = "auto", num_threads: int = 0,
                  check_finite: bool = False, stream=None) -> BaAttScores:
    """BA-Att's block logits and permutations before the budget (for inspection and
    evaluation); the arguments are those of :func:`ba_att_plan`."""
    d = _core.ba_att_scores(q, k, block_q, block_kv, sort_q, sort_k, sort_window, compensate, compensation, beta,
                            scale, backend, num_threads, check_finite, _stream(q, stream))
    return BaAttScores(d["block_q"], d["block_kv"], d["logits"], d["perm_q"], d["perm_kv"])


def ba_att(q, k, v, *, block_q: int = 64, block_kv: int = 64, sort_q: bool = True, sort_k: bool = True,
           sort_window: int = 0, compensate: bool = True, compensation: str = "diagonal", beta: float = 1.0,
           top_kappa: Optional[int] = None, density: Optional[float] = None, tau: Optional[float] = None,
           scale: Optional[float] = None, mask: Any = None, mask_aware: bool = False, backend: str = "auto",
           num_threads: int = 0, check_finite: bool = False, out=None, lse=None, stream=None):
    """BA-Att attention: :func:`ba_att_plan` then :func:`block_sparse` on the same
    backend (and the same ``stream``). Returns ``(out, lse)`` in the original token order of q.
    ``mask``: the executor's mask (on original positions, through the norm sort); the selection
    sees it only with ``mask_aware`` (see :func:`ba_att_plan`)."""
    text = _mask_text(mask)
    stream = _stream(q, stream)
    plan = ba_att_plan(q, k, block_q=block_q, block_kv=block_kv, sort_q=sort_q, sort_k=sort_k,
                       sort_window=sort_window, compensate=compensate, compensation=compensation, beta=beta,
                       top_kappa=top_kappa, density=density, tau=tau, scale=scale, backend=backend,
                       num_threads=num_threads, check_finite=check_finite, stream=stream, mask=text,
                       mask_aware=mask_aware)
    return block_sparse(q, k, v, plan, scale=scale, mask=text, backend=backend, check_finite=check_finite,
                        num_threads=num_threads, check_index=False, out=out, lse=lse,  # the plan just made
                        stream=stream)


def xattention_plan(q, k, *, block_q: int = 128, block_kv: int = 128, stride: int = 8,
                    top_kappa: Optional[int] = None, density: Optional[float] = None, tau: Optional[float] = None,
                    force_first: bool = True, force_diagonal: bool = True, scale: Optional[float] = None,
                    backend: str = "auto", num_threads: int = 0, check_finite: bool = False, mask: Any = None,
                    mask_aware: bool = False, stream=None) -> BlockIndex:
    """The XAttention plan (Xu et al., ICML 2025; docs/ba_att.md): antidiagonal scores
    over ``stride``-token groups (stride divides both block sizes), block masses, then
    per query block the forced blocks (key block 0 when ``force_first``; the diagonal
    block ``qb + num_kv_blocks - num_q_blocks`` when ``force_diagonal``) and blocks in
    descending mass until the budget is met (default tau=0.9). No permutations. ``mask_aware``:
    the selection sees ``mask`` (each query group's softmax over the key groups it sees; the
    choice as :func:`ba_att_plan`'s). With ``backend="cuda"`` (or ``"auto"`` on CUDA arrays) the
    masses and the budget run on q's device, on ``stream`` (torch's current stream by default),
    and the plan's arrays stay there, as :func:`ba_att_plan`'s."""
    kind, value = _budget(top_kappa, density, tau, ("mass", 0.9))
    return _plan(_core.xattention_plan(q, k, block_q, block_kv, stride, kind, value, force_first, force_diagonal,
                                       scale, backend, num_threads, check_finite, _mask_text(mask), mask_aware,
                                       _stream(q, stream)), like=q)


def xattention_scores(q, k, *, block_q: int = 128, block_kv: int = 128, stride: int = 8,
                      scale: Optional[float] = None, backend: str = "auto", num_threads: int = 0,
                      check_finite: bool = False, stream=None) -> np.ndarray:
    """XAttention's block masses X, float32 ``[batch, heads_q, num_q_blocks,
    num_kv_blocks]`` (a numpy array, also when computed on the device); each row sums to the
    number of ``stride`` groups in the query block."""
    return _core.xattention_scores(q, k, block_q, block_kv, stride, scale, backend, num_threads, check_finite,
                                   _stream(q, stream))


def xattention(q, k, v, *, block_q: int = 128, block_kv: int = 128, stride: int = 8,
               top_kappa: Optional[int] = None, density: Optional[float] = None, tau: Optional[float] = None,
               force_first: bool = True, force_diagonal: bool = True, scale: Optional[float] = None,
               mask: Any = None, mask_aware: bool = False, backend: str = "auto", num_threads: int = 0,
               check_finite: bool = False, out=None, lse=None, stream=None):
    """XAttention attention: :func:`xattention_plan` then :func:`block_sparse` under ``mask``
    (which the selection sees with ``mask_aware``) on the same backend (and the same ``stream``).
    Returns ``(out, lse)``."""
    text = _mask_text(mask)
    stream = _stream(q, stream)
    plan = xattention_plan(q, k, block_q=block_q, block_kv=block_kv, stride=stride, top_kappa=top_kappa,
                           density=density, tau=tau, force_first=force_first, force_diagonal=force_diagonal,
                           scale=scale, backend=backend, num_threads=num_threads, check_finite=check_finite,
                           mask=text, mask_aware=mask_aware, stream=stream)
    return block_sparse(q, k, v, plan, scale=scale, mask=text, backend=backend, check_finite=check_finite,
                        num_threads=num_threads, check_index=False, out=out, lse=lse,  # the plan just made
                        stream=stream)


# ---- oracle metrics (evaluation only: a dense O(L^2 d) pass per head) -------------------

@dataclass
class BlockPartition:
    """Blocks of ``block_q`` / ``block_kv`` consecutive permuted tokens; ``perm_q`` int32
    ``[batch, heads_q, len_q]`` and ``perm_kv`` int32 ``[batch, heads_kv, len_kv]`` are
    optional (None: identity). ``BlockPartition.of(plan)`` is a plan's own partition."""

    block_q: int = 64
    block_kv: int = 64
    perm_q: Any = None
    perm_kv: Any = None

    @staticmethod
    def of(plan: BlockIndex) -> "BlockPartition":
        return BlockPartition(plan.block_q, plan.block_kv, plan.perm_q, plan.perm_kv)


@dataclass
class OracleBlocks:
    """Per (batch, head_q, query block, key block) of a partition, float32
    ``[batch, heads_q, num_q_blocks, num_kv_blocks]``:

    mass       (1/|I|) sum_{i in I, j in J} softmax(scale Q K')_ij  (BA-Att Eq. 3; rows sum to 1)
    logit_max  max_{i in I, j in J} scale Q_i . K_j
    logit_min  the min
    """

    block_q: int
    block_kv: int
    mass: np.ndarray
    logit_max: np.ndarray
    logit_min: np.ndarray

    @property
    def num_q_blocks(self) -> int:
        return int(self.mass.shape[2])

    @property
    def num_kv_blocks(self) -> int:
        return int(self.mass.shape[3])


def oracle_blocks(q, k, partition=None, *, scale: Optional[float] = None, backend: str = "auto",
                  num_threads: int = 0) -> OracleBlocks:
    """The exact block mass of attention over a partition: ``partition`` is a
    BlockPartition, a BlockIndex (its own partition, permutations included) or None
    (64 x 64 blocks in token order). CPU arrays only."""
    partition = _partition(partition)
    d = _core.oracle_blocks(q, k, partition.block_q, partition.block_kv, partition.perm_q, partition.perm_kv, scale,
                            backend, num_threads)
    return OracleBlocks(d["block_q"], d["block_kv"], d["mass"], d["logit_max"], d["logit_min"])


@dataclass
class DeviationBound:
    """BA-Att Eq. 8 against the observed deviation (Fig. 2), per block pair, float32
    ``[batch, heads_q, num_q_blocks, num_kv_blocks]``:

    bound      U = scale * (RQ MK + MQ RK + RQ RK), R the largest distance of a token to
               its block mean, M the largest token norm (Eq. 7)
    deviation  max_{i in I, j in J} |scale Q_i . K_j - scale Qbar . Kbar|
    pearson_per_head  Pearson R of bound and deviation per (batch, head_q) (NaN where constant)
    pearson_overall   the same over all block pairs
    violations        block pairs where deviation > bound beyond f32 rounding (Eq. 8: none)
    """

    bound: np.ndarray
    deviation: np.ndarray
    pearson_per_head: list
    pearson_overall: float
    violations: int
    mean_bound: float
    mean_deviation: float


def _partition(partition) -> BlockPartition:
    if partition is None:
        return BlockPartition()
    if isinstance(partition, BlockIndex):
        return BlockPartition.of(partition)
    if isinstance(partition, BlockPartition):
        return partition
    raise TypeError(f"partition: expected sparsa.BlockPartition or sparsa.BlockIndex, got {type(partition).__name__}")


def deviation_bound(q, k, partition, oracle: OracleBlocks, *, scale: Optional[float] = None, backend: str = "auto",
                    num_threads: int = 0) -> DeviationBound:
    """The bound of BA-Att Eq. 8 on how far a token logit strays from its block logit,
    beside the observed deviation, on ``partition`` (as in :func:`oracle_blocks`);
    ``oracle`` must be ``oracle_blocks(q, k, partition)``. CPU arrays only."""
    partition = _partition(partition)
    if not isinstance(oracle, OracleBlocks):
        raise TypeError(f"oracle: expected sparsa.OracleBlocks, got {type(oracle).__name__}")
    d = _core.deviation_bound(q, k, partition.block_q, partition.block_kv, partition.perm_q, partition.perm_kv,
                              oracle.mass, oracle.logit_max, oracle.logit_min, oracle.block_q, oracle.block_kv,
                              scale, backend, num_threads)
    return DeviationBound(**d)


def mass_recall(plan: BlockIndex, oracle: OracleBlocks) -> float:
    """Mean over (batch, head, query block) of the oracle mass of the key blocks ``plan``
    keeps: 1 for a plan that keeps every block. The oracle must be computed on the plan's
    partition (``oracle_blocks(q, k, plan)``)."""
    if not isinstance(plan, BlockIndex):
        raise TypeError(f"plan: expected sparsa.BlockIndex, got {type(plan).__name__}")
    if not isinstance(oracle, OracleBlocks):
        raise TypeError(f"oracle: expected sparsa.OracleBlocks, got {type(oracle).__name__}")
    return _core.mass_recall(plan.counts, plan.indices, plan.block_q, plan.block_kv, oracle.mass, oracle.block_q,
                             oracle.block_kv)


def mass_recall_from_lse(lse_plan, lse_dense) -> float:
    """The same quantity per query token from executor outputs:
    ``mean_i exp(lse_plan_i - lse_dense_i)``, the share of each row's softmax mass the
    plan's visible keys hold (float32 ``[batch, heads, len_q]``, CPU)."""
    return _core.mass_recall_from_lse(lse_plan, lse_dense)


def relative_error(out, reference) -> float:
    """``||out - reference||_F / ||reference||_F`` over the whole array (f64 sums; CPU
    arrays of equal shape, any float dtype)."""
    return _core.relative_error(out, reference)


# ---- block-diffusion decoding: paged prefix cache, QUEST pages, LoSA -------------------
#
# Batch 1 (one sequence per cache), float32, CPU. PagedKVCache comes from the core:
#   PagedKVCache(heads_kv, head_dim, page_size=16); .append(k, v) with f32
#   [1, heads_kv, n, head_dim]; .length, .num_pages, .page_size; .keys() / .values()
#   return numpy copies [1, heads_kv, length, head_dim].
PagedKVCache = _core.PagedKVCache


@dataclass
class PagePlan:
    """Pages each (query head, query row) attends: ``counts`` int32 ``[heads_q, rows]``,
    ``pages`` int32 ``[heads_q, rows, capacity]`` (the first ``count`` entries, ascending).
    Page ``p`` holds cache tokens ``[p * page_size, (p + 1) * page_size)``."""

    page_size: int
    counts: np.ndarray
    pages: np.ndarray


def quest_plan(q, cache: PagedKVCache, *, budget: int = 256, selector: str = "quest", group: str = "per_head",
               force_first: bool = False, force_last: bool = True, num_threads: int = 0) -> PagePlan:
    """QUEST page selection (Tang et al., ICML 2024; docs/losa.md) for q float32
    ``[1, heads_q, rows, head_dim]`` over a PagedKVCache.

    Page score: ``selector="quest"`` the upper bound ``sum_d max(q_d max_d, q_d min_d)``
    of q.k over the page; ``"pooled"`` the page-mean logit. Each (head, row) keeps the
    top ``budget / page_size`` pages (``budget`` tokens, a multiple of the page size);
    forced pages (``force_first``: page 0, ``force_last``: the newest page) count against
    it; ties go to the lower page. ``group="shared"`` gives the query heads of a GQA group
    one list, by the group's maximum score."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected sparsa.PagedKVCache, got {type(cache).__name__}")
    counts, pages = _core.quest_plan(q, cache, budget, selector, group, force_first, force_last, num_threads)
    return PagePlan(cache.page_size, counts, pages)


def quest(q, k, v, *, budget: int = 256, page_size: int = 16, selector: str = "quest", group: str = "per_head",
          force_first: bool = False, force_last: bool = True, attend_union: bool = False,
          scale: Optional[float] = None, backend: str = "auto", num_threads: int = 0):
    """QUEST attention in one call: per batch element, k and v are paged (``page_size``
    tokens a page), every (head, query row) selects pages as :func:`quest_plan` does and
    attends over them (``attend_union``: over the union its kv head loaded). Any float
    dtype in, computed in f32. Returns ``(out, lse)`` (numpy, or torch for torch input)."""
    out, lse, _, _ = _core.quest_attention(q, k, v, budget, page_size, selector, group, force_first, force_last,
                                          attend_union, scale, backend, num_threads)
    return _host_result(q, out), _host_result(q, lse)


def _host_result(like: Any, result: np.ndarray) -> Any:
    """A numpy result of a CPU-only method as the array type of ``like``."""
    fw = _framework(like)
    # A bf16 result comes as its raw uint16 bits (numpy has no bfloat16): viewed back as bf16.
    bf16 = result.dtype == np.uint16 and "bfloat16" in str(getattr(like, "dtype", ""))
    if fw == "torch":
        import torch

        t = torch.from_numpy(result)
        return t.view(torch.bfloat16) if bf16 else t
    if bf16 and fw == "numpy":
        return result.view(like.dtype)
    return _finish(like, result)


class LosaState:
    """Per-layer prefix-attention state of block-diffusion decoding: LoSA
    (Locality-aware Sparse Attention; docs/losa.md) and its baselines.

    A block of ``block_size`` tokens is denoised in several steps against a frozen prefix
    cache. :meth:`step` returns attention over prefix + block for every block token:

    - first step of a block: dense prefix attention for all rows; the state keeps each
      row's prefix output ``o_p``, its log-sum-exp ``l_p`` and the query ``q_ref``;
    - later steps (``method="losa"``): the ``active_k`` rows whose query moved most
      (mean squared change over heads and dims vs ``q_ref``; or those above
      ``mse_threshold``) recompute their prefix part over QUEST-selected pages
      (``budget`` tokens); the other rows reuse theirs;
    - every step: attention over the block's own keys, merged by log-sum-exp.

    :meth:`commit` appends the finished block's keys and values to the cache and starts a
    new block. ``method``: ``"losa"``, ``"dense"`` (dense prefix every step), ``"quest"``
    (the selector for every row every step) or ``"reuse"`` (LoSA's split, active rows dense).
    Arrays are float32 ``[1, heads, block_size, head_dim]`` on the CPU."""

    def __init__(self, heads_q: int, heads_kv: int, head_dim: int, *, block_size: int = 16, method: str = "losa",
                 budget: int = 256, selector: str = "quest", group: str = "per_head", force_first: bool = False,
                 force_last: bool = True, active_k: int = 4, mse_threshold: Optional[float] = None,
                 attend_union: bool = False, scale: Optional[float] = None, backend: str = "cpu",
                 num_threads: int = 0, check_finite: bool = False):
        self._state = _core.PrefixAttention(heads_q, heads_kv, head_dim, block_size, method, budget, selector, group,
                                            force_first, force_last, active_k, mse_threshold, attend_union, scale,
                                            backend, num_threads, check_finite)
        self.stats: Optional[dict] = None  # what the last step did (rows recomputed, pages loaded, times)

    def step(self, cache: PagedKVCache, q, k_block, v_block, *, out=None, lse=None):
        """One denoising step of the current block: ``(out, lse)`` over prefix + block.
        ``self.stats`` then holds ``recomputed`` (rows), ``mse``, ``dense_prefix``,
        ``pages_loaded``, ``tokens_loaded``, ``loaded`` (per kv head), timings and, on
        sparse steps, the selector's pages for the recomputed rows: ``plan_counts`` int32
        ``[heads_q, len(recomputed)]`` and ``plan_pages`` int32 ``[heads_q, len(recomputed), capacity]``."""
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache: expected sparsa.PagedKVCache, got {type(cache).__name__}")
        out, lse = _outputs(q, out, lse)
        self.stats = self._state.step(cache, q, k_block, v_block, out, lse)
        return _finish(q, out), _finish(q, lse)

    def commit(self, cache: PagedKVCache, k_block, v_block) -> None:
        """Append the finished block's keys and values to ``cache``; the next step is the
        first (dense) step of a new block."""
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache: expected sparsa.PagedKVCache, got {type(cache).__name__}")
        self._state.commit(cache, k_block, v_block)

    def begin_block(self) -> None:
        """Drop the state: the next step is a first (dense) step."""
        self._state.begin_block()

    @property
    def steps_in_block(self) -> int:
        return self._state.steps_in_block

    @property
    def blocks_committed(self) -> int:
        return self._state.blocks_committed

    @property
    def o_p(self) -> np.ndarray:
        """Prefix output per row, float32 [1, heads_q, block_size, head_dim] (a copy)."""
        return self._state.o_p

    @property
    def l_p(self) -> np.ndarray:
        """Its log-sum-exp, float32 [1, heads_q, block_size] (a copy)."""
        return self._state.l_p

    @property
    def q_ref(self) -> np.ndarray:
        """The query each row's prefix part was computed with (a copy)."""
        return self._state.q_ref


# ---- block-diffusion decoding on a CUDA device ----------------------------------------------

class DevicePagedKVCache:
    """A pool of KV pages on a CUDA device shared by several sequences (docs/losa.md §10):
    K and V in bfloat16 or float16, pages of ``page_size`` tokens with their key min/max (QUEST's
    metadata) computed on the device when tokens are appended. Each sequence owns a run of
    pages reserved by :meth:`add_sequence`; a full pool or sequence raises ``MemoryError``.
    Arrays are torch (or cupy) CUDA arrays, read in place. ``stream`` (a ``torch.cuda.Stream``, a
    cupy stream or an integer handle; default the legacy default stream): where the pool is
    allocated and zeroed; give the stream the appends run on when it is a non-blocking one."""

    def __init__(self, heads_kv: int, head_dim: int, pool_pages: int, *, page_size: int = 16,
                 dtype: str = "bfloat16", device: int = 0, stream=None):
        self._core = _core.DevicePagedKVCache.create(heads_kv, head_dim, pool_pages, page_size, dtype, device,
                                                    _stream(None, stream))

    def add_sequence(self, max_tokens: int) -> int:
        """A new empty sequence with room for ``max_tokens`` tokens; its id."""
        return self._core.add_sequence(max_tokens)

    def remove_sequence(self, seq: int) -> None:
        self._core.remove_sequence(seq)

    def reset(self, seq: int) -> None:
        """Length 0 (the sequence keeps its pages)."""
        self._core.reset(seq)

    def append(self, seq: int, k, v, *, stream=None) -> None:
        """Append ``k``, ``v`` ``[1, heads_kv, n, head_dim]`` (the cache's dtype, on its device) to
        sequence ``seq``, on ``stream`` (torch's current stream by default)."""
        self._core.append(seq, k, v, _stream(k, stream))

    def length(self, seq: int) -> int:
        return self._core.length(seq)

    def capacity(self, seq: int) -> int:
        return self._core.capacity(seq)

    @property
    def free_pages(self) -> int:
        return self._core.free_pages


class DeviceLosaState:
    """Per-layer LoSA state on a CUDA device for a batch of sequences (docs/losa.md §10): the
    semantics of :class:`LosaState` (``method`` ``"losa"``, ``"quest"``, ``"dense"`` or ``"reuse"``;
    QUEST pages, per-head selection; ``attend_union``: each active row over its kv head's union of
    pages), with O_p, L_p and Q_ref kept on the device and no host
    synchronisation inside :meth:`step`. Arrays are torch (or cupy) CUDA arrays: q
    ``[batch, heads_q, block_size, head_dim]``, k/v blocks ``[batch, heads_kv, block_size,
    head_dim]`` in ``dtype``. ``stream``: where the state is allocated and zeroed, as
    :class:`DevicePagedKVCache`'s."""

    def __init__(self, batch: int, heads_q: int, heads_kv: int, head_dim: int, *, block_size: int = 16,
                 method: str = "losa", budget: int = 256, force_first: bool = False, force_last: bool = True,
                 active_k: int = 4, mse_threshold: Optional[float] = None, attend_union: bool = False,
                 scale: Optional[float] = None, dtype: str = "bfloat16", device: int = 0, stream=None):
        self._core = _core.DevicePrefixAttention.create(batch, heads_q, heads_kv, head_dim, block_size, method, budget,
                                                       force_first, force_last, active_k, mse_threshold, attend_union,
                                                       scale, dtype, device, _stream(None, stream))

    def step(self, cache: DevicePagedKVCache, seqs, q, k_block, v_block, *, out=None, lse=None, stream=None):
        """One denoising step of every entry's block (entry i's prefix is sequence ``seqs[i]``):
        ``(out, lse)`` over prefix + block, on ``stream`` (torch's current stream by default)."""
        if not isinstance(cache, DevicePagedKVCache):
            raise TypeError(f"cache: expected sparsa.DevicePagedKVCache, got {type(cache).__name__}")
        out, lse = _outputs(q, out, lse)
        self._core.step(cache._core, list(seqs), q, k_block, v_block, out, lse, _stream(q, stream))
        return out, lse

    def commit(self, cache: DevicePagedKVCache, seqs, k_block, v_block, *, stream=None) -> None:
        """Append every entry's finished block to its sequence; the next step starts a new block."""
        if not isinstance(cache, DevicePagedKVCache):
            raise TypeError(f"cache: expected sparsa.DevicePagedKVCache, got {type(cache).__name__}")
        self._core.commit(cache._core, list(seqs), k_block, v_block, _stream(k_block, stream))

    def begin_block(self) -> None:
        self._core.begin_block()

    @property
    def steps_in_block(self) -> int:
        return self._core.steps_in_block

    def _array(self, a, like):
        return _from_dlpack(like, a)

    def active_rows(self, like=None):
        """The last step's active rows int32 ``[batch, block_size]`` (the first ``active_counts[b]``
        of row b valid) and their counts ``[batch]``, as arrays of ``like``'s framework (torch)."""
        import torch

        like = like if like is not None else torch.empty(0, device="cuda")
        return self._array(self._core.active_rows(), like), self._array(self._core.active_counts(), like)


# ---- files and workloads -----------------------------------------------------------------

def token_permutation(height: int, width: int, layout: str = "z_order") -> np.ndarray:
    """Token order of an image of ``height x width`` tokens stored row-major: ``perm[p]`` is the
    row-major index of the token at position ``p`` of the layout (``"z_order"`` (Morton),
    ``"hilbert"`` or ``"row_major"``), int32. In Z-order or Hilbert order LLSA's pooled blocks of
    consecutive tokens are square patches instead of strips of one row. Reorder with
    ``x[:, :, perm]`` before attention and restore with ``out[:, :, inverse_permutation(perm)]``
    (numpy, torch, cupy and jax index alike). Any sides: for sides that are not powers of two the
    order is the curve's order restricted to the grid."""
    return _core.token_permutation(height, width, layout)


def inverse_permutation(perm) -> np.ndarray:
    """``inv[perm[p]] = p`` (int32): undoes ``token_permutation``'s reordering."""
    perm = np.asarray(_to_host(perm))
    if perm.ndim != 1 or not np.array_equal(np.sort(perm), np.arange(perm.size)):
        raise ValueError(f"perm: expected a permutation of 0..n-1 (1-d), got shape {list(perm.shape)}")
    inv = np.empty(perm.size, dtype=np.int32)
    inv[perm] = np.arange(perm.size, dtype=np.int32)
    return inv


def read_tensor(path: str) -> np.ndarray:
    """Read ``x.npy``, ``x.safetensors`` (single entry) or ``x.safetensors:name``."""
    return _core.read_tensor(str(path))


def write_tensor(path: str, array) -> None:
    """Write a CPU array to ``.npy`` (f32, f16, i32) or ``.safetensors`` (also bf16)."""
    _core.write_tensor(str(path), array)


def generate_workload(seed: int = 0, batch: int = 1, heads_q: int = 8, heads_kv: int = 2, len_q: int = 4096,
                      len_kv: int = 4096, head_dim: int = 64, dtype: str = "f32"):
    """The seeded default workload (docs/workload.md): returns numpy ``(q, k, v)``."""
    return _core.generate_workload(seed, batch, heads_q, heads_kv, len_q, len_kv, head_dim, dtype)


# ---- the diffusion-LM engine (docs/dlm.md) ---------------------------------------------

Tokenizer = _core.Tokenizer


class ChatTemplate:
    """A model's chat template (Jinja), rendered by sparsa's own interpreter as transformers'
    ``apply_chat_template`` renders it (docs/dlm.md, "Chat templates").

    ``ChatTemplate.load(dir)`` finds it where transformers does (``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template``) with the special tokens of
    ``tokenizer_config.json``; ``ChatTemplate.parse(source)`` takes a template's text.
    """

    def __init__(self, core):
        self._core = core

    @staticmethod
    def load(dir, template=None) -> "ChatTemplate":
        """``template``: a ``.jinja`` file used instead of the directory's (``dir`` may then be
        None: no special tokens)."""
        import os

        return ChatTemplate(_core.ChatTemplate.load("" if dir is None else os.fspath(dir),
                                                    "" if template is None else os.fspath(template)))

    @staticmethod
    def parse(source: str, **special_tokens) -> "ChatTemplate":
        """``special_tokens``: variables every render gets, e.g. ``bos_token="<s>"``."""
        return ChatTemplate(_core.ChatTemplate.parse(source, json.dumps(special_tokens)))

    @property
    def source(self) -> str:
        return self._core.source

    def render(self, messages, add_generation_prompt: bool = True, tools=None, **variables) -> str:
        """The prompt text for ``messages`` (dicts with ``role``, ``content`` and whatever else the
        template reads, e.g. ``tool_calls``); ``variables``: more template variables, e.g.
        ``enable_thinking=False``."""
        context = {"messages": list(messages), "tools": tools, "add_generation_prompt": bool(add_generation_prompt),
                   **variables}
        return self._core.render_json(json.dumps(context))


class Model:
    """A diffusion LM (``llada``, ``sdar``, ``dream`` or ``fast_dllm``) loaded from a Hugging Face model directory.

    ``Model.load(dir)`` reads ``config.json``, ``model.safetensors`` (or the sharded index) and, when
    present, ``tokenizer.json``. ``logits(ids)`` is one forward pass (f32 ``[len, vocab]``, the
    architecture's own attention pattern); ``generate(prompt, ...)`` runs a denoising loop
    (``loop="remask" | "prefix_cache" | "dual_cache" | "block" | "dream" | "fast_dllm"``; default: remask for
    llada, block for sdar, dream for dream, fast_dllm for fast_dllm).
    """

    def __init__(self, core, tokenizer=None, dir=None):
        self._core = core
        self.tokenizer = tokenizer
        self._dir = dir
        self._chat_template = None
        self.backend = "cpu"  # load()'s backend

    @property
    def chat_template(self) -> "ChatTemplate":
        """The model directory's chat template (loaded on first use; an error if it has none)."""
        if self._chat_template is None:
            if self._dir is None:
                raise ValueError("chat_template: this model was not loaded from a directory")
            self._chat_template = ChatTemplate.load(self._dir)
        return self._chat_template

    @staticmethod
    def load(dir, backend: str = "cpu", num_threads: int = 0, attention: str = "dense",
             attention_layers=(), dump_attention=None, dump_layers=(), dump_forwards=(),
             dump_max: int = 256) -> "Model":
        """``attention``: every layer's method, ``"dense"``, ``"ba_att:density=0.5"``,
        ``"quest:budget=256"`` or ``"losa:budget=256,k=4"``; ``attention_layers``: overrides
        such as ``["0,1,31=dense"]`` (docs/dlm.md). ``dump_attention``: a new or empty directory
        that receives the attention inputs (q, k, v, the prefix, the block plan) of the layers in
        ``dump_layers`` (all when empty) at the forward passes in ``dump_forwards`` (all when
        empty), at most ``dump_max`` files (cpu backend; docs/dlm.md, "Capturing attention")."""
        import os

        core = _core.Model.load(str(dir), backend, num_threads, attention, list(attention_layers),
                                "" if dump_attention is None else os.fspath(dump_attention),
                                [int(x) for x in dump_layers], [int(x) for x in dump_forwards], int(dump_max))
        path = os.path.join(str(dir), "tokenizer.json")
        model = Model(core, Tokenizer.load(path) if os.path.exists(path) else None, os.fspath(dir))
        model.backend = str(backend)
        return model

    @property
    def config(self) -> dict:
        return self._core.config

    @property
    def default_loop(self) -> str:
        return self._core.default_loop

    @property
    def attention_dump_counts(self):
        """(files written, selected beyond dump_max) of the attention capture."""
        return self._core.attention_dump_counts

    def logits(self, ids, cached: int = 0) -> np.ndarray:
        """f32 [len(ids) - cached, vocab]: one forward over ``ids``; with ``cached`` > 0 the first
        ``cached`` ids go into the KV cache first and the rest run over it (the loops' cached steps)."""
        return self._core.logits([int(i) for i in ids], int(cached))

    def generate(self, prompt, gen_len: int = 128, block_len: int = 32, steps: int = 0, threshold: float = 0.0,
                 temperature: float = 0.0, seed: int = 0, loop: str = "", stop_at_eos: bool = True,
                 ban_eos: bool = False, eos_ids=(), chat: bool = False, system=None, confidence: str = "",
                 top_p: float = 1.0, top_k: int = 0, alg_temp: float = 0.0, sub_block: int = 8, cache=None,
                 factor: float = 0.0, unmask: str = "confidence", eb_threshold: float = 0.35):
        """``prompt``: text (needs tokenizer.json; returns text), a list of ids (returns ids), or a
        list of either (a batch; returns a list). ``chat``: each text prompt becomes the user's
        message in the model's chat template (after a ``system`` message, if given), as instruct
        and chat models expect. ``loop="dream"`` is Dream's schedule (the default of dream models);
        ``confidence``: "probability", "margin" or "entropy" (default: entropy for the dream loop,
        probability otherwise); ``top_p`` < 1 and ``top_k`` > 0 narrow each pick to the most probable
        tokens, as Dream's sampler does; ``alg_temp`` > 0 draws the dream loop's positions with weights
        softmax(confidence / alg_temp) instead of taking the most confident (Dream's ``alg_temp``);
        ``sub_block``: the fast_dllm loop's sub-blocks (Fast-dLLM v2's small_block_size).
        ``factor`` > 0: the remask, prefix_cache and dual_cache loops commit by Fast-dLLM's factor rule (its
        ``factor`` argument) instead of the threshold or the schedule. ``unmask``: how the block
        loop picks a step's positions, SDAR's strategies: "confidence" (low_confidence_dynamic with a
        ``threshold``, low_confidence_static without), "sequential" (left to right) or
        "entropy_bounded" (the lowest-entropy positions while their entropies sum below
        ``eb_threshold``, at least one).
        ``cache``: a ``PromptCache`` passed to each turn of a conversation (one prompt; the block and
        fast_dllm loops; cpu backend): a call reuses the K/V of the leading whole blocks its prompt
        shares with the last call's prompt and output, and prefills only the rest."""
        if cache is not None and not isinstance(cache, PromptCache):
            raise TypeError(f"cache: expected a sparsa.PromptCache or None, got {type(cache).__name__}")
        batch = isinstance(prompt, (list, tuple)) and len(prompt) > 0 and not isinstance(prompt[0], (int, np.integer))
        prompts = list(prompt) if batch else [prompt]
        text = [isinstance(p, str) for p in prompts]
        if any(text) and self.tokenizer is None:
            raise ValueError("prompt: text needs the model directory's tokenizer.json (or pass token ids)")
        if chat:
            if not all(text):
                raise ValueError("chat: the prompts must be text")
            head = [] if system is None else [{"role": "system", "content": str(system)}]
            prompts = [self.chat_template.render(head + [{"role": "user", "content": p}]) for p in prompts]
        ids = [self.tokenizer.encode(p) if t else [int(i) for i in p] for p, t in zip(prompts, text)]
        out = self._core.generate(ids, gen_len, block_len, steps, threshold, temperature, seed, loop, stop_at_eos,
                                  ban_eos, [int(i) for i in eos_ids], confidence, float(top_p), int(top_k),
                                  float(alg_temp), int(sub_block), None if cache is None else cache._core,
                                  float(factor), str(unmask), float(eb_threshold))
        out = [self.tokenizer.decode(o, True) if t else o for o, t in zip(out, text)]
        return out if batch else out[0]


class Chat:
    """A conversation with an instruct / chat model, as ``sparsa chat`` holds one: ``say(text)``
    renders the whole conversation (``system``, then the turns) through the model's chat template,
    generates the reply, keeps it as the assistant's turn and returns it. A block-diffusion model
    (block and fast_dllm loops) on the cpu backend keeps the K/V of the blocks the turns share in a
    ``PromptCache``, so a turn prefills only what is new. ``options``: ``Model.generate``'s (``gen_len``,
    ``temperature``, ``loop``, ...); at temperature > 0 turn n samples with ``seed + n``, as the
    command does. ``variables``: more template variables (``enable_thinking=False``, ...)."""

    def __init__(self, model: "Model", system=None, variables=None, **options):
        if model.tokenizer is None:
            raise ValueError("model: a chat needs the model directory's tokenizer.json")
        if "chat" in options or "cache" in options or "prompt" in options:
            raise TypeError("options: chat, cache and prompt are the conversation's own")
        self.model = model
        self.system = system
        self.variables = dict(variables or {})
        self.options = options
        self.cache = PromptCache()
        self.messages = []
        self.turn = 0

    def say(self, text: str) -> str:
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        head = [] if self.system is None else [{"role": "system", "content": str(self.system)}]
        messages = self.messages + [{"role": "user", "content": text}]
        rendered = self.model.chat_template.render(head + messages, True, **self.variables)
        ids = self.model.tokenizer.encode(rendered)
        options = dict(self.options)
        options["seed"] = int(options.get("seed", 0)) + self.turn
        loop = options.get("loop") or self.model.default_loop
        cache = self.cache if loop in ("block", "fast_dllm") and self.model.backend == "cpu" else None
        reply_ids = self.model.generate(ids, cache=cache, **options)
        reply = self.model.tokenizer.decode(reply_ids, True)
        self.messages = messages + [{"role": "assistant", "content": reply}]
        self.turn += 1
        return reply

    @property
    def last_reused(self) -> int:
        """Prompt tokens whose K/V the last turn reused."""
        return self.cache.last_reused

    def reset(self) -> None:
        """Forget the turns (not the system message)."""
        self.messages = []
        self.cache.clear()


class PromptCache:
    """The K/V of a conversation's whole blocks, kept from one ``Model.generate`` call to the next
    (``cache=``): a call reuses the leading blocks its prompt shares with the last call's prompt and
    output, and prefills only the rest (block and fast_dllm loops, one prompt, the cpu backend;
    docs/dlm.md, "The prompt cache across turns")."""

    def __init__(self):
        self._core = _core.PromptCache()

    @property
    def tokens(self) -> int:
        """Positions whose K/V it holds."""
        return self._core.tokens

    @property
    def last_reused(self) -> int:
        """Prompt tokens the last generate call that took it reused."""
        return self._core.last_reused

    def clear(self) -> None:
        self._core.clear()


# ---- argument errors that name the argument ----------------------------------------------
#
# The extension's functions take typed arguments; a value nanobind cannot convert (k=None, a
# read-only out=, scale="a", an int beyond the C++ type) makes it raise a TypeError listing
# every overload ("incompatible function arguments"), which names nothing. Each public
# function below is wrapped: on that error, its own arguments are checked by annotation and
# name, and the first that cannot be what the core takes is named in the error instead.

import functools as _functools
import inspect as _inspect

_INT64_ARGS = {"sort_window", "max_rows", "budget", "seed", "batch", "heads_q", "heads_kv", "len_q", "len_kv",
               "head_dim", "len", "len_kv"}
_OUTPUT_ARGS = {"out", "lse"}  # keyword-only outputs; positional out/lse are inputs (llsa_backward)


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    text = repr(value)
    if len(text) > 40:
        text = text[:40] + "..."
    return f"{type(value).__name__} {text}" if not isinstance(value, (int, float)) else text


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) or hasattr(value, "__dlpack__")


def _writable(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return bool(value.flags.writeable)
    return True


def _argument_problem(name: str, value: Any, annotation: str, keyword_only: bool, default: Any):
    """(exception type, message) when `value` cannot be what `name` takes, else None."""
    if value is None and default is None:
        return None
    ann = annotation.replace(" ", "")
    if ann in ("int", "Optional[int]"):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            return TypeError, f"{name}: expected an integer, got {_describe(value)}"
        bits = 63 if name in _INT64_ARGS else 31
        if not -(2 ** bits) <= int(value) < 2 ** bits:
            return ValueError, f"{name}: expected an integer in [-2^{bits}, 2^{bits}), got {int(value)}"
        return None
    if "float" in ann:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            none = " or None" if default is None else ""
            return TypeError, f"{name}: expected a number{none}, got {_describe(value)}"
        return None
    if ann == "bool":
        if not isinstance(value, (bool, np.bool_)):
            return TypeError, f"{name}: expected True or False, got {_describe(value)}"
        return None
    if ann == "str":
        if not isinstance(value, str):
            return TypeError, f"{name}: expected a string, got {_describe(value)}"
        return None
    if ann == "BlockIndex":
        if not isinstance(value, BlockIndex):
            return TypeError, f"{name}: expected sparsa.BlockIndex, got {_describe(value)}"
        for field in ("counts", "indices"):
            if not _is_array(getattr(value, field)):
                return TypeError, f"{name}.{field}: expected an int32 array, got {_describe(getattr(value, field))}"
        for field in ("perm_q", "perm_kv"):
            v = getattr(value, field)
            if v is not None and not _is_array(v):
                return TypeError, f"{name}.{field}: expected an int32 array or None, got {_describe(v)}"
        for field in ("block_q", "block_kv"):
            problem = _argument_problem(f"{name}.{field}", getattr(value, field), "int", False, 0)
            if problem:
                return problem
        return None
    if ann == "PagedKVCache":
        if not isinstance(value, PagedKVCache):
            return TypeError, f"{name}: expected sparsa.PagedKVCache, got {_describe(value)}"
        return None
    if ann == "":  # an array
        if not _is_array(value):
            what = "an output array" if keyword_only and name in _OUTPUT_ARGS else "an array"
            return TypeError, f"{name}: expected {what} (numpy, torch, cupy or jax), got {_describe(value)}"
        if keyword_only and name in _OUTPUT_ARGS and not _writable(value):
            return ValueError, f"{name}: expected a writable array, got a read-only one"
    return None


def _named_errors(function):
    signature = _inspect.signature(function)

    @_functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except TypeError as error:
            if "incompatible function arguments" not in str(error):
                raise
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                raise error from None
            bound.apply_defaults()
            for name, value in bound.arguments.items():
                if name == "self":
                    continue
                parameter = signature.parameters[name]
                annotation = parameter.annotation
                annotation = "" if annotation is _inspect.Parameter.empty else str(annotation)
                default = None if parameter.default is _inspect.Parameter.empty else parameter.default
                if parameter.default is _inspect.Parameter.empty:
                    default = 0  # required: None is not allowed
                problem = _argument_problem(name, value, annotation,
                                            parameter.kind == _inspect.Parameter.KEYWORD_ONLY, default)
                if problem:
                    kind, message = problem
                    raise kind(message) from None
            raise

    return wrapper


for _name in ("dense", "block_sparse", "merge", "llsa", "llsa_backward", "llsa_plan", "ba_att", "ba_att_plan",
              "ba_att_scores", "xattention", "xattention_plan", "xattention_scores", "oracle_blocks",
              "deviation_bound", "mass_recall", "mass_recall_from_lse", "relative_error", "quest_plan", "quest",
              "read_tensor", "write_tensor", "generate_workload"):
    globals()[_name] = _named_errors(globals()[_name])
LosaState.__init__ = _named_errors(LosaState.__init__)
LosaState.step = _named_errors(LosaState.step)
LosaState.commit = _named_errors(LosaState.commit)
del _name
