"""sparsa: sparse attention for diffusion models.

Every function takes the arrays you already have (numpy, torch, cupy or jax; CPU, or
CUDA once the CUDA backend is built) through DLPack without copying them, and returns
outputs of the same array type on the same device. Attention inputs are
``[batch, heads, seq, head_dim]`` with a contiguous last dimension; other dimensions
may be strided. Errors carry the core's message, which names the argument:
``ValueError`` for bad arguments, ``TypeError`` for dtypes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from . import _sparsa as _core

__all__ = [
    "BlockIndex",
    "dense",
    "block_sparse",
    "merge",
    "llsa",
    "llsa_backward",
    "llsa_plan",
    "read_tensor",
    "write_tensor",
    "generate_workload",
    "version",
    "backends",
]

__version__ = _core.version()


def version() -> str:
    """The library version."""
    return _core.version()


def backends() -> list:
    """Backends available in this build: cpu_ref, cpu (and cuda when compiled in)."""
    return _core.backends()


# ---- allocation by array type -------------------------------------------------------

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


# ---- executors ------------------------------------------------------------------------

def dense(q, k, v, *, scale: Optional[float] = None, backend: str = "auto", check_finite: bool = False,
          num_threads: int = 0, out=None, lse=None):
    """Dense softmax attention. Returns ``(out, lse)``: out has q's dtype and shape,
    lse is float32 ``[batch, heads_q, len_q]`` (natural log). GQA when k/v have fewer
    heads than q. Pass ``out=``/``lse=`` to write into existing arrays (zero copy)."""
    out, lse = _outputs(q, out, lse)
    _core.dense(q, k, v, out, lse, scale, backend, check_finite, num_threads)
    return _finish(q, out), _finish(q, lse)


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

    @staticmethod
    def full(batch: int, heads_q: int, len_q: int, len_kv: int, block_q: int, block_kv: int) -> "BlockIndex":
        """Every query block visits every key block (dense as a plan), as numpy arrays."""
        nq = -(-len_q // block_q)
        nkv = -(-len_kv // block_kv)
        counts = np.full((batch, heads_q, nq), nkv, dtype=np.int32)
        indices = np.broadcast_to(np.arange(nkv, dtype=np.int32), (batch, heads_q, nq, nkv)).copy()
        return BlockIndex(block_q, block_kv, counts, indices)


def block_sparse(q, k, v, index: BlockIndex, *, scale: Optional[float] = None, backend: str = "auto",
                 check_finite: bool = False, num_threads: int = 0, out=None, lse=None):
    """Attention over the key blocks a BlockIndex lists. Returns ``(out, lse)``; a
    query whose block lists no key block gets out = 0 and lse = -inf."""
    if not isinstance(index, BlockIndex):
        raise TypeError(f"index: expected sparsa.BlockIndex, got {type(index).__name__}")
    out, lse = _outputs(q, out, lse)
    _core.block_sparse(q, k, v, index.counts, index.indices, index.perm_q, index.perm_kv, index.block_q,
                       index.block_kv, out, lse, scale, backend, check_finite, num_threads)
    return _finish(q, out), _finish(q, lse)


def merge(o1, lse1, o2, lse2, *, backend: str = "auto", out=None, lse=None):
    """Merge two partial attention results over disjoint key sets by log-sum-exp.
    ``out``/``lse`` may alias ``o1``/``lse1``."""
    out, lse = _outputs(o1, out, lse, "o1")
    _core.merge(o1, lse1, o2, lse2, out, lse, backend)
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
                       check_finite)
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
                        num_threads)
    return _finish(q, dq), _finish(q, dk), _finish(q, dv)


def llsa_plan(q, k, *, block: int = 16, topk: int = 8, levels: int = -1, enrich: bool = True,
              dedupe: bool = False, max_rows: int = 8) -> dict:
    """The LLSA selection plan: ``levels``, ``level_len``, ``keys_per_query``, a printable
    ``text`` of (batch 0, head 0) and ``index``, the fine-level BlockIndex."""
    plan = _core.llsa_plan(q, k, block, topk, levels, enrich, dedupe, max_rows)
    plan["index"] = BlockIndex(plan["block"], plan["block"], plan.pop("counts"), plan.pop("indices"))
    return plan


# ---- files and workloads -----------------------------------------------------------------

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
