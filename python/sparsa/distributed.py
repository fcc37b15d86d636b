"""sparsa across processes: context-parallel attention on torch.distributed (docs/distributed.md).

Two layouts, both resting on the O+LSE contract (partial results over disjoint key sets merge
exactly, :func:`sparsa.merge`):

- **sequence-sharded attention** (:func:`dense`, :func:`block_sparse`, :func:`ba_att`,
  :func:`ba_att_plan`): q, k and v ``[batch, heads, seq, head_dim]`` are split by sequence across
  the ranks of a process group (rank r holds the r-th contiguous piece; :func:`shard` cuts one).
  Each rank returns the output of its own queries over every key of every rank. The default
  ``schedule="ring"`` passes the key/value shards around the ranks (the next shard's isend/irecv
  runs while the current one is computed) and merges the partial results by LSE;
  ``schedule="allgather"`` gathers every shard first and makes one call.
- **KV-sharded prefix attention** (:func:`prefix_attention`, :func:`quest_plan`): for
  block-diffusion decoding, the prefix cache is split across the ranks, the (few) queries are the
  same on every rank; every rank returns the whole result.

The collectives are torch.distributed's (gloo on CPU tensors, NCCL on CUDA tensors: the same
code). Every check that could differ between ranks runs on metadata gathered from all ranks, so a
bad argument raises the same error on every rank instead of leaving the others waiting in a
collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

try:
    import torch
    import torch.distributed as dist
except ModuleNotFoundError as e:  # sparsa.distributed rests on torch.distributed
    raise ModuleNotFoundError("sparsa.distributed needs PyTorch, which is not installed: pip install torch "
                              "(or install sparsa with its extra: pip install 'sparsa[torch]')", name="torch") from e

import sparsa
from . import BlockIndex, PagedKVCache

__all__ = ["shard_bounds", "shard", "dense", "block_sparse", "ba_att_plan", "ba_att", "prefix_attention",
           "quest_plan", "QuestPlan", "PrefixShard", "LosaState", "Timings", "last_timings"]

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_DTYPE_NAMES = ("float32", "float16", "bfloat16")
_SCHEDULES = ("ring", "allgather")


# ---- shards -------------------------------------------------------------------------------

def shard_bounds(length: int, world_size: int, multiple: int = 1) -> List[Tuple[int, int]]:
    """``[(start, stop)]`` per rank: ``length`` tokens cut into ``world_size`` contiguous pieces of
    whole units of ``multiple`` tokens (a block size, a page size), as even as possible, earlier
    ranks taking the extra unit; the last piece may end in a partial unit (it is the sequence's
    end) and is never longer than the first. A rank may get an empty piece when there are fewer
    units than ranks."""
    for name, value in (("length", length), ("world_size", world_size), ("multiple", multiple)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an integer, got {type(value).__name__}")
    if length < 0 or world_size < 1 or multiple < 1:
        raise ValueError(f"shard_bounds: expected length >= 0, world_size >= 1, multiple >= 1, got {length}, "
                         f"{world_size}, {multiple}")
    units = -(-length // multiple)
    bounds, start = [], 0
    for r in range(world_size):
        take = units // world_size + (1 if r < units % world_size else 0)
        stop = min(start + take * multiple, length)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard(x: torch.Tensor, *, group=None, dim: int = 2, multiple: int = 1) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim`` (a view), as :func:`shard_bounds` cuts it."""
    ctx = _context(group)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    start, stop = shard_bounds(int(x.shape[dim]), ctx.world, multiple)[ctx.rank]
    return x.narrow(dim, start, stop - start)


# ---- the process group and the collective checks --------------------------------------------

@dataclass
class _Context:
    group: object
    world: int
    rank: int
    backend: str

    def peer(self, rank: int) -> int:
        """The global rank of group rank ``rank`` (what point-to-point operations name)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def meta_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if "nccl" in self.backend else torch.device("cpu")


def _context(group) -> _Context:
    if not dist.is_available():
        raise RuntimeError("group: torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        raise RuntimeError("group: no torch.distributed process group is initialised: call "
                           "torch.distributed.init_process_group(...) first (gloo for CPU tensors, nccl for CUDA), "
                           "or pass group=")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group")
    return _Context(group, dist.get_world_size(group), rank, str(dist.get_backend(group)))


# Per tensor argument, the fields every rank contributes: kind (1 a tensor, 0 something else,
# -1 None), ndim, the four sizes (-1 past ndim), dtype code (-1 unsupported), device type (0 cpu,
# 1 cuda, 2 other), last-dimension stride 1.
_FIELDS = 9


def _describe(x) -> List[int]:
    if x is None:
        return [-1] + [0] * (_FIELDS - 1)
    if not isinstance(x, torch.Tensor):
        return [0] + [0] * (_FIELDS - 1)
    sizes = list(x.shape[:4]) + [-1] * max(0, 4 - x.dim())
    device = {"cpu": 0, "cuda": 1}.get(x.device.type, 2)
    contiguous = int(x.dim() == 0 or x.stride(-1) == 1 or x.shape[-1] == 1)
    return [1, x.dim()] + sizes + [_DTYPES.get(x.dtype, -1), device, contiguous]


def _gather_meta(ctx: _Context, tensors: Sequence, extra: Sequence[float] = ()) -> torch.Tensor:
    """Float64 ``[world, len(tensors) * _FIELDS + len(extra)]``: every rank's descriptions."""
    row = []
    for x in tensors:
        row += _describe(x)
    row = torch.tensor(row + [float(e) for e in extra], dtype=torch.float64)
    if ctx.world == 1:
        return row[None]
    row = row.to(ctx.meta_device())
    table = [torch.empty_like(row) for _ in range(ctx.world)]
    dist.all_gather(table, row, group=ctx.group)
    return torch.stack(table).cpu()


class _Described:
    """One argument's description on every rank (read from the gathered table)."""

    def __init__(self, name: str, table: torch.Tensor, slot: int):
        self.name = name
        self.rows = [[int(v) for v in table[r, slot * _FIELDS:(slot + 1) * _FIELDS]] for r in range(table.shape[0])]

    def kind(self, r): return self.rows[r][0]
    def ndim(self, r): return self.rows[r][1]
    def size(self, r, i): return self.rows[r][2 + i]
    def dtype(self, r): return self.rows[r][6]
    def device(self, r): return self.rows[r][7]
    def contiguous(self, r): return self.rows[r][8]


_DEVICE_NAMES = ("cpu", "cuda", "another device type")


def _check_tensors(ctx: _Context, args: Sequence[_Described], float_dtype: bool = True) -> None:
    """Every argument a 4-d tensor with a contiguous last dimension, on every rank; dtype and
    device type equal across the arguments and the ranks."""
    for a in args:
        for r in range(ctx.world):
            if a.kind(r) != 1:
                raise TypeError(f"{a.name}: expected a torch.Tensor on every rank, rank {r} passed "
                                f"{'None' if a.kind(r) < 0 else 'something else'}")
            if a.ndim(r) != 4:
                raise ValueError(f"{a.name}: expected 4 dimensions [batch, heads, seq, head_dim], rank {r} passed "
                                 f"{a.ndim(r)}")
            if not a.contiguous(r):
                raise ValueError(f"{a.name}: expected a contiguous last dimension (stride 1), rank {r} passed a "
                                 "strided one")
            if float_dtype and a.dtype(r) < 0:
                raise TypeError(f"{a.name}: expected float32, float16 or bfloat16, rank {r} passed another dtype")
    first = args[0]
    for a in args:
        for r in range(ctx.world):
            if a.dtype(r) != first.dtype(0):
                raise TypeError(f"{a.name}: rank {r} passed {_DTYPE_NAMES[a.dtype(r)]}, but {first.name} on rank 0 is "
                                f"{_DTYPE_NAMES[first.dtype(0)]} (every rank and argument must share one dtype)")
            if a.device(r) != first.device(0):
                raise ValueError(f"{a.name}: rank {r} passed a tensor on {_DEVICE_NAMES[a.device(r)]}, but {first.name} "
                                 f"on rank 0 is on {_DEVICE_NAMES[first.device(0)]}")
    if "nccl" in ctx.backend and first.device(0) != 1:
        raise ValueError(f"{first.name}: the process group's backend is {ctx.backend}, which needs CUDA tensors; "
                         "got CPU tensors (use a gloo group for CPU tensors)")


def _same_across_ranks(ctx: _Context, a: _Described, dims: Sequence[int], what: Sequence[str]) -> None:
    for i, label in zip(dims, what):
        for r in range(ctx.world):
            if a.size(r, i) != a.size(0, i):
                raise ValueError(f"{a.name}: rank {r} has {label} {a.size(r, i)}, rank 0 has {a.size(0, i)} "
                                 f"(every rank must pass the same {label})")


@dataclass
class _Shards:
    """Sequence lengths of q and k/v on every rank (and their starts)."""

    q_lens: List[int]
    kv_lens: List[int]

    @staticmethod
    def starts(lens: List[int]) -> List[int]:
        out = [0]
        for n in lens:
            out.append(out[-1] + n)
        return out


def _check_attention(ctx: _Context, q, k, v) -> _Shards:
    table = _gather_meta(ctx, (q, k, v))
    dq, dk, dv = (_Described(n, table, i) for i, n in enumerate(("q", "k", "v")))
    _check_tensors(ctx, (dq, dk, dv))
    _same_across_ranks(ctx, dq, (0, 1, 3), ("batch", "heads", "head_dim"))
    _same_across_ranks(ctx, dk, (1,), ("heads",))
    for r in range(ctx.world):
        b, hq, d = dq.size(r, 0), dq.size(r, 1), dq.size(r, 3)
        for a in (dk, dv):
            if a.size(r, 0) != b:
                raise ValueError(f"{a.name}: rank {r} has batch {a.size(r, 0)}, q has {b}")
            if a.size(r, 3) != d:
                raise ValueError(f"{a.name}: rank {r} has head_dim {a.size(r, 3)}, q has {d}")
        if dv.size(r, 1) != dk.size(r, 1) or dv.size(r, 2) != dk.size(r, 2):
            raise ValueError(f"v: rank {r} has heads {dv.size(r, 1)} and seq {dv.size(r, 2)}, k has "
                             f"{dk.size(r, 1)} and {dk.size(r, 2)} (v must match k)")
        if dk.size(r, 1) < 1 or hq % dk.size(r, 1) != 0:
            raise ValueError(f"k: heads_q ({hq}) must be a multiple of heads_kv ({dk.size(r, 1)})")
        for a in (dq, dk):
            if a.size(r, 2) < 1:
                raise ValueError(f"{a.name}: rank {r} holds no tokens; every rank needs at least one "
                                 "(shard_bounds with fewer units than ranks leaves some empty: use fewer ranks)")
    return _Shards([dq.size(r, 2) for r in range(ctx.world)], [dk.size(r, 2) for r in range(ctx.world)])


def _check_schedule(schedule: str) -> None:
    if schedule not in _SCHEDULES:
        raise ValueError(f"schedule: expected one of {', '.join(_SCHEDULES)}, got {schedule!r}")


# ---- timings (the benchmark's communication share) --------------------------------------------

@dataclass
class Timings:
    """Where the last call of this process spent its time (seconds, host clock; on CUDA the
    compute and wait times include the device's work only where a wait synchronised it):
    ``wait`` is time blocked on communication that compute did not hide, ``compute`` the time in
    sparsa's executors and merges, ``plan`` BA-Att's selection, ``bytes_sent`` what this rank sent."""

    wait: float = 0.0
    compute: float = 0.0
    plan: float = 0.0
    bytes_sent: int = 0


last_timings = Timings()


class _Clock:
    """Accumulates into ``last_timings``; when ``sync``, waits for the current CUDA stream at each
    boundary, so a lap after compute is the compute, and a lap after a wait is the communication
    that the compute did not hide (the current stream waits on NCCL's work there)."""

    def __init__(self, device: torch.device, sync: bool):
        self.sync = sync and device.type == "cuda"
        self.device = device
        last_timings.__init__()  # one object, reset in place: `from ... import last_timings` stays valid
        self.t = self._now()

    def _now(self) -> float:
        import time

        if self.sync:  # the compute stream only: a device-wide sync would also wait for NCCL's stream
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def lap(self, field: str) -> None:
        now = self._now()
        setattr(last_timings, field, getattr(last_timings, field) + now - self.t)
        self.t = now


# ---- collectives on sequence shards ------------------------------------------------------------

def _gather_seq(ctx: _Context, x: torch.Tensor, lens: List[int], async_op: bool = False):
    """The whole sequence from every rank's piece (dim 2; pieces of unequal length are padded to
    the longest for the all-gather). With ``async_op``: a function that waits and returns it."""
    if ctx.world == 1:
        return (lambda: x) if async_op else x
    longest = max(lens)
    piece = x.contiguous()
    if piece.shape[2] < longest:
        piece = torch.nn.functional.pad(piece, (0, 0, 0, longest - piece.shape[2]))
    pieces = [torch.empty_like(piece) for _ in range(ctx.world)]
    work = dist.all_gather(pieces, piece, group=ctx.group, async_op=async_op)
    last_timings.bytes_sent += piece.numel() * piece.element_size() * (ctx.world - 1)

    def finish():
        if work is not None:
            work.wait()
        return torch.cat([p[:, :, :n] for p, n in zip(pieces, lens)], dim=2)

    return finish if async_op else finish()


def _merge_into(acc: Optional[Tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor, lse: torch.Tensor):
    """LSE-merge a partial result into the f32 accumulator (partials in bf16/f16 are widened first,
    so the merged output is rounded to q's dtype once, at the end)."""
    out = out.float()
    if acc is None:  # the partials are this module's own fresh tensors: no copy
        return out, lse
    sparsa.merge(acc[0], acc[1], out, lse, out=acc[0], lse=acc[1])
    return acc


def _ring(ctx: _Context, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: List[int], compute,
          clock: _Clock):
    """q against every rank's k/v: step s computes the shard of rank (rank - s) mod world while the
    next one arrives from rank - 1 and the current one leaves for rank + 1."""
    acc = None
    current = (k.contiguous(), v.contiguous())
    for step in range(ctx.world):
        source = (ctx.rank - step) % ctx.world
        requests = []
        if step + 1 < ctx.world:
            incoming = (ctx.rank - step - 1) % ctx.world
            shape = (k.shape[0], k.shape[1], kv_lens[incoming], k.shape[3])
            following = (torch.empty(shape, dtype=k.dtype, device=k.device),
                         torch.empty(shape, dtype=v.dtype, device=v.device))
            send_to, recv_from = ctx.peer((ctx.rank + 1) % ctx.world), ctx.peer((ctx.rank - 1) % ctx.world)
            ops = [dist.P2POp(dist.isend, current[0], send_to, ctx.group),
                   dist.P2POp(dist.isend, current[1], send_to, ctx.group),
                   dist.P2POp(dist.irecv, following[0], recv_from, ctx.group),
                   dist.P2POp(dist.irecv, following[1], recv_from, ctx.group)]
            requests = dist.batch_isend_irecv(ops)
            last_timings.bytes_sent += 2 * current[0].numel() * current[0].element_size()
        out, lse = compute(current[0], current[1], source)
        acc = _merge_into(acc, out, lse)
        clock.lap("compute")
        for request in requests:
            request.wait()
        clock.lap("wait")
        if requests:
            current = following
    return acc[0].to(q.dtype), acc[1]


# ---- sequence-sharded dense attention -----------------------------------------------------------

def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, schedule: str = "ring",
          scale: Optional[float] = None, backend: str = "auto", timed: bool = False):
    """Dense attention of this rank's queries over every rank's keys. ``q`` ``[batch, heads_q,
    n_q_local, d]``, ``k``/``v`` ``[batch, heads_kv, n_kv_local, d]`` (this rank's sequence pieces,
    in rank order; pieces may differ in length). Returns ``(out, lse)`` of the local queries, as
    :func:`sparsa.dense` over the whole sequence would give for them. ``timed``: synchronise
    around each phase so :data:`last_timings` is exact on CUDA (the benchmark's switch)."""
    _check_schedule(schedule)
    ctx = _context(group)
    shards = _check_attention(ctx, q, k, v)
    clock = _Clock(q.device, timed)
    if schedule == "allgather" or ctx.world == 1:
        k_all, v_all = _gather_seq(ctx, k, shards.kv_lens), _gather_seq(ctx, v, shards.kv_lens)
        clock.lap("wait")
        result = sparsa.dense(q, k_all, v_all, scale=scale, backend=backend)
        clock.lap("compute")
        return result
    return _ring(ctx, q, k, v, shards.kv_lens,
                 lambda kk, vv, source: sparsa.dense(q, kk, vv, scale=scale, backend=backend), clock)


# ---- sequence-sharded block-sparse attention ------------------------------------------------------

def _index_tensor(a, name: str, device: torch.device) -> torch.Tensor:
    if a is None:
        return None
    t = a if isinstance(a, torch.Tensor) else torch.as_tensor(sparsa._to_host(a))
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected int32, got {t.dtype}")
    return t.to(device)


def _check_index(index: BlockIndex, batch: int, heads_q: int, heads_kv: int, len_q: int, len_kv: int,
                 device: torch.device) -> BlockIndex:
    """The global plan's arrays as int32 tensors on ``device``, their shapes checked against the
    whole sequence (every rank holds the same plan)."""
    if not isinstance(index, BlockIndex):
        raise TypeError(f"index: expected sparsa.BlockIndex, got {type(index).__name__}")
    for field in ("block_q", "block_kv"):
        value = getattr(index, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"index.{field}: expected a positive integer, got {value!r}")
    counts = _index_tensor(index.counts, "index.counts", device)
    indices = _index_tensor(index.indices, "index.indices", device)
    perm_q = _index_tensor(index.perm_q, "index.perm_q", device)
    perm_kv = _index_tensor(index.perm_kv, "index.perm_kv", device)
    nq = -(-len_q // index.block_q)
    if counts is None or tuple(counts.shape) != (batch, heads_q, nq):
        raise ValueError(f"index.counts: expected [{batch}, {heads_q}, {nq}] (the whole sequence of {len_q} queries "
                         f"in blocks of {index.block_q}), got {list(counts.shape) if counts is not None else None}")
    if indices is None or indices.dim() != 4 or tuple(indices.shape[:3]) != (batch, heads_q, nq):
        raise ValueError(f"index.indices: expected [{batch}, {heads_q}, {nq}, capacity], got "
                         f"{list(indices.shape) if indices is not None else None}")
    for name, perm, shape in (("perm_q", perm_q, (batch, heads_q, len_q)), ("perm_kv", perm_kv, (batch, heads_kv, len_kv))):
        if perm is not None and tuple(perm.shape) != shape:
            raise ValueError(f"index.{name}: expected {list(shape)} (the whole sequence), got {list(perm.shape)}")
    return BlockIndex(index.block_q, index.block_kv, counts, indices, perm_q, perm_kv)


def _columns(counts: torch.Tensor, indices: torch.Tensor, lo: int, hi: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The entries of each row in key blocks [lo, hi), shifted to start at 0, ascending, padded."""
    slots = torch.arange(indices.shape[-1], device=indices.device)
    keep = (slots < counts[..., None]) & (indices >= lo) & (indices < hi)
    big = torch.iinfo(torch.int32).max
    local = torch.where(keep, indices - lo, torch.full_like(indices, big))
    local, _ = torch.sort(local, dim=-1)
    local = torch.where(local == big, torch.zeros_like(local), local)
    return keep.sum(-1, dtype=torch.int32).contiguous(), local.to(torch.int32).contiguous()


def _check_aligned(ctx: _Context, lens: List[int], block: int, name: str, block_name: str) -> None:
    for r in range(ctx.world - 1):
        if lens[r] % block != 0:
            raise ValueError(f"{name}: rank {r}'s piece holds {lens[r]} tokens, not a multiple of {block_name} "
                             f"{block} (every piece but the last must be whole blocks; shard_bounds(length, world, "
                             f"{block}) cuts such pieces)")


def _permuted_execute(ctx: _Context, q_all, k_all, v_all, plan: BlockIndex, shards: _Shards, scale, backend,
                      clock: _Clock, check_index: bool = True):
    """A plan with permutations on the gathered sequence: the query blocks of the permuted order
    are dealt out evenly, rank r computes its blocks against every key (the executor reads
    k[perm_kv]) and the rows go back to the ranks that own their original positions through one
    all-to-all."""
    batch, heads_q, len_q, d = q_all.shape
    block_q, nq = plan.block_q, plan.counts.shape[-1]
    first, last = ctx.rank * nq // ctx.world, (ctx.rank + 1) * nq // ctx.world
    device = q_all.device
    perm_q = plan.perm_q if plan.perm_q is not None else \
        torch.arange(len_q, dtype=torch.int32, device=device).expand(batch, heads_q, len_q)
    if check_index and plan.perm_q is not None:  # the rows go home through perm_q: it must be one
        identity = torch.arange(len_q, dtype=torch.int32, device=device).expand(batch, heads_q, len_q)
        if not torch.equal(torch.sort(plan.perm_q, dim=-1).values, identity):
            raise ValueError(f"index.perm_q: expected a permutation of 0..{len_q - 1} for every (batch, head)")
    starts = torch.tensor(_Shards.starts(shards.q_lens), device=device)
    owner = torch.bucketize(perm_q.long(), starts[1:], right=True)  # [batch, heads_q, len_q]

    def rows_of(r):
        lo, hi = (r * nq // ctx.world) * block_q, min(((r + 1) * nq // ctx.world) * block_q, len_q)
        return lo, hi

    lo, hi = rows_of(ctx.rank)
    if hi > lo:
        positions = perm_q[:, :, lo:hi].long()
        q_mine = torch.gather(q_all, 2, positions[..., None].expand(batch, heads_q, hi - lo, d))
        sub = BlockIndex(block_q, plan.block_kv, plan.counts[:, :, first:last].contiguous(),
                         plan.indices[:, :, first:last].contiguous(), None, plan.perm_kv)
        out, lse = sparsa.block_sparse(q_mine, k_all, v_all, sub, scale=scale, backend=backend,
                                       check_index=check_index)
    else:
        out = torch.empty((batch, heads_q, 0, d), dtype=q_all.dtype, device=device)
        lse = torch.empty((batch, heads_q, 0), dtype=torch.float32, device=device)
    clock.lap("compute")
    # Send: my rows flattened over (batch, head, position), grouped by owner in that order.
    dest = owner[:, :, lo:hi].reshape(-1)
    order = torch.sort(dest, stable=True).indices
    send_counts = torch.bincount(dest, minlength=ctx.world).tolist()
    # Receive: from each rank r, the rows of r's range that I own, in r's flattened order.
    targets, recv_counts = [], []
    flat_bh = torch.arange(batch * heads_q, device=device).reshape(batch, heads_q, 1)
    for r in range(ctx.world):
        rlo, rhi = rows_of(r)
        mask = owner[:, :, rlo:rhi] == ctx.rank
        position = perm_q[:, :, rlo:rhi].long() - int(starts[ctx.rank])
        target = (flat_bh * shards.q_lens[ctx.rank] + position)[mask]  # row-major (batch, head, position)
        targets.append(target)
        recv_counts.append(int(target.numel()))
    rows_out = out.reshape(-1, d)[order].contiguous()
    rows_lse = lse.reshape(-1)[order].contiguous()
    got_out = torch.empty((sum(recv_counts), d), dtype=out.dtype, device=device)
    got_lse = torch.empty((sum(recv_counts),), dtype=torch.float32, device=device)
    if ctx.world == 1:
        got_out, got_lse = rows_out, rows_lse
    else:
        dist.all_to_all_single(got_out, rows_out, recv_counts, send_counts, group=ctx.group)
        dist.all_to_all_single(got_lse, rows_lse, recv_counts, send_counts, group=ctx.group)
        mine = send_counts[ctx.rank]
        last_timings.bytes_sent += (rows_out.shape[0] - mine) * (d * out.element_size() + 4)
    clock.lap("wait")
    target = torch.cat(targets)
    n_local = shards.q_lens[ctx.rank]
    result = torch.empty((batch * heads_q * n_local, d), dtype=out.dtype, device=device)
    result_lse = torch.empty((batch * heads_q * n_local,), dtype=torch.float32, device=device)
    result[target] = got_out
    result_lse[target] = got_lse
    clock.lap("compute")
    return result.reshape(batch, heads_q, n_local, d), result_lse.reshape(batch, heads_q, n_local)


def _local_rows(plan: BlockIndex, q_start: int, q_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    first = q_start // plan.block_q
    last = -(-(q_start + q_len) // plan.block_q)
    return plan.counts[:, :, first:last].contiguous(), plan.indices[:, :, first:last].contiguous()


def block_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: BlockIndex, *, group=None,
                 schedule: str = "ring", scale: Optional[float] = None, backend: str = "auto", timed: bool = False):
    """Block-sparse attention of this rank's queries over every rank's keys, following ``index``,
    the plan of the *whole* sequence (the same on every rank: :func:`ba_att_plan` makes one).

    Without permutations each rank uses the rows of its query blocks and, for the key shard in
    hand, the columns of that shard's blocks; every piece but the last must then be whole blocks
    (``index.block_q`` for q, ``index.block_kv`` for k/v). A plan with ``perm_q``/``perm_kv``
    forms blocks of tokens from every rank, so its q, k and v are gathered (``schedule`` does not
    apply; docs/distributed.md gives the cost). Returns ``(out, lse)`` of the local queries."""
    _check_schedule(schedule)
    ctx = _context(group)
    shards = _check_attention(ctx, q, k, v)
    len_q, len_kv = sum(shards.q_lens), sum(shards.kv_lens)
    plan = _check_index(index, q.shape[0], q.shape[1], k.shape[1], len_q, len_kv, q.device)
    clock = _Clock(q.device, timed)
    if plan.perm_q is not None or plan.perm_kv is not None:
        q_all = _gather_seq(ctx, q, shards.q_lens)
        k_all, v_all = _gather_seq(ctx, k, shards.kv_lens), _gather_seq(ctx, v, shards.kv_lens)
        clock.lap("wait")
        return _permuted_execute(ctx, q_all, k_all, v_all, plan, shards, scale, backend, clock)
    _check_aligned(ctx, shards.q_lens, plan.block_q, "q", "index.block_q")
    q_starts, kv_starts = _Shards.starts(shards.q_lens), _Shards.starts(shards.kv_lens)
    counts, indices = _local_rows(plan, q_starts[ctx.rank], shards.q_lens[ctx.rank])
    if schedule == "allgather" or ctx.world == 1:
        k_all, v_all = _gather_seq(ctx, k, shards.kv_lens), _gather_seq(ctx, v, shards.kv_lens)
        clock.lap("wait")
        result = sparsa.block_sparse(q, k_all, v_all, BlockIndex(plan.block_q, plan.block_kv, counts, indices),
                                     scale=scale, backend=backend)
        clock.lap("compute")
        return result
    _check_aligned(ctx, shards.kv_lens, plan.block_kv, "k", "index.block_kv")
    columns = []
    for r in range(ctx.world):
        lo, hi = kv_starts[r] // plan.block_kv, -(-kv_starts[r + 1] // plan.block_kv)
        columns.append(_columns(counts, indices, lo, hi))

    def compute(kk, vv, source):
        local = BlockIndex(plan.block_q, plan.block_kv, *columns[source])
        return sparsa.block_sparse(q, kk, vv, local, scale=scale, backend=backend)

    return _ring(ctx, q, k, v, shards.kv_lens, compute, clock)


# ---- BA-Att -------------------------------------------------------------------------------------

_PLAN_OPTIONS = ("block_q", "block_kv", "sort_q", "sort_k", "sort_window", "compensate", "compensation", "beta",
                 "top_kappa", "density", "tau", "scale", "backend", "num_threads", "check_finite")


def _plan_options(options: dict) -> dict:
    unknown = sorted(set(options) - set(_PLAN_OPTIONS))
    if unknown:
        raise TypeError(f"{unknown[0]}: not an option of sparsa.ba_att_plan (expected one of {', '.join(_PLAN_OPTIONS)})")
    return options


def _ba_att_plan_gathered(ctx, q, k, shards, options, clock):
    q_all = _gather_seq(ctx, q, shards.q_lens)
    k_all = _gather_seq(ctx, k, shards.kv_lens)
    clock.lap("wait")
    plan = sparsa.ba_att_plan(q_all, k_all, **options)
    clock.lap("plan")
    return q_all, k_all, plan


def ba_att_plan(q: torch.Tensor, k: torch.Tensor, *, group=None, **options) -> BlockIndex:
    """The BA-Att plan of the whole sequence from every rank's pieces, equal to
    :func:`sparsa.ba_att_plan` on the whole q and k (the options are its keywords), on every rank.

    BA-Att's norm sort runs over the whole sequence, so every block mixes tokens of every rank and
    its statistics need those tokens: q and k are all-gathered for the plan and every rank runs
    the same deterministic selection (docs/distributed.md: why, and the cost)."""
    ctx = _context(group)
    table = _gather_meta(ctx, (q, k))
    dq, dk = _Described("q", table, 0), _Described("k", table, 1)
    _check_tensors(ctx, (dq, dk))
    _same_across_ranks(ctx, dq, (0, 1, 3), ("batch", "heads", "head_dim"))
    _same_across_ranks(ctx, dk, (0, 1, 3), ("batch", "heads", "head_dim"))
    shards = _Shards([dq.size(r, 2) for r in range(ctx.world)], [dk.size(r, 2) for r in range(ctx.world)])
    return _ba_att_plan_gathered(ctx, q, k, shards, _plan_options(options), _Clock(q.device, False))[2]


def ba_att(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, timed: bool = False, **options):
    """BA-Att attention of this rank's queries over every rank's keys: :func:`ba_att_plan` (q and
    k gathered; v's all-gather runs while the plan is made), then each rank computes an even share
    of the permuted query blocks against every key, and one all-to-all returns the rows to the
    ranks that hold them. Equal to :func:`sparsa.ba_att` on the whole sequence, for the local
    queries. The options are :func:`sparsa.ba_att_plan`'s keywords."""
    ctx = _context(group)
    shards = _check_attention(ctx, q, k, v)
    options = _plan_options(options)
    clock = _Clock(q.device, timed)
    v_finish = _gather_seq(ctx, v, shards.kv_lens, async_op=True)
    q_all, k_all, plan = _ba_att_plan_gathered(ctx, q, k, shards, options, clock)
    v_all = v_finish()
    clock.lap("wait")
    plan = _check_index(plan, q.shape[0], q.shape[1], k.shape[1], q_all.shape[2], k_all.shape[2], q.device)
    scale, backend = options.get("scale"), options.get("backend", "auto")
    if plan.perm_q is None and all(n % plan.block_q == 0 for n in shards.q_lens[:-1]):
        # Query blocks in token order: this rank's rows against the gathered keys, one call.
        counts, indices = _local_rows(plan, _Shards.starts(shards.q_lens)[ctx.rank], shards.q_lens[ctx.rank])
        result = sparsa.block_sparse(q, k_all, v_all, BlockIndex(plan.block_q, plan.block_kv, counts, indices,
                                                                 None, plan.perm_kv), scale=scale, backend=backend,
                                     check_index=False)  # the selector's own plan
        clock.lap("compute")
        return result
    return _permuted_execute(ctx, q_all, k_all, v_all, plan, shards, scale, backend, clock, check_index=False)


# ---- KV-sharded prefix attention (block-diffusion decoding) --------------------------------------

@dataclass
class QuestPlan:
    """QUEST's global selection: ``counts`` int32 ``[heads_q, rows]`` and ``pages`` int32
    ``[heads_q, rows, capacity]``, global page numbers ascending (as :class:`sparsa.PagePlan`);
    ``page_starts[r]`` is rank r's first global page."""

    page_size: int
    counts: torch.Tensor
    pages: torch.Tensor
    page_starts: List[int]


class PrefixShard:
    """This rank's piece of a prefix as tensors ``k``, ``v`` ``[1, heads_kv, n, head_dim]`` (any
    device and float dtype) with QUEST's page bounds (element-wise key min and max per page of
    ``page_size`` tokens, f32 ``[heads_kv, pages, head_dim]``) computed once, here, so that a
    QUEST step reads the bounds instead of every key (a ``(k, v)`` pair passed to
    :func:`prefix_attention` has its bounds computed at each call)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, page_size: int = 16):
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise TypeError("k, v: expected torch.Tensors")
        if k.dim() != 4 or k.shape[0] != 1:
            raise ValueError(f"k: expected [1, heads_kv, n, head_dim], got {list(k.shape)}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size: expected a positive integer, got {page_size!r}")
        self.k, self.v, self.page_size = k, v, page_size
        self.page_min, self.page_max = _page_bounds(k, page_size)


def _page_bounds(k: torch.Tensor, page_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Element-wise min and max of the keys of each page, f32 [heads_kv, pages, d] (a partial last
    page over its real tokens)."""
    keys = k[0].float()
    heads_kv, n, d = keys.shape
    pages = -(-n // page_size)
    padded = pages * page_size - n
    page_min = torch.nn.functional.pad(keys, (0, 0, 0, padded), value=float("inf"))
    page_max = torch.nn.functional.pad(keys, (0, 0, 0, padded), value=-float("inf"))
    return (page_min.reshape(heads_kv, pages, page_size, d).amin(2),
            page_max.reshape(heads_kv, pages, page_size, d).amax(2))


def _prefix_shard(cache, page_size: Optional[int]):
    """(k, v, page_size, bounds or None) of this rank's prefix piece."""
    if isinstance(cache, PagedKVCache):
        if page_size is not None and page_size != cache.page_size:
            raise ValueError(f"page_size: {page_size} differs from the cache's page_size {cache.page_size}")
        return torch.from_numpy(cache.keys()), torch.from_numpy(cache.values()), cache.page_size, None
    if isinstance(cache, PrefixShard):
        if page_size is not None and page_size != cache.page_size:
            raise ValueError(f"page_size: {page_size} differs from the shard's page_size {cache.page_size}")
        return cache.k, cache.v, cache.page_size, (cache.page_min, cache.page_max)
    if isinstance(cache, (tuple, list)) and len(cache) == 2:
        return cache[0], cache[1], 16 if page_size is None else page_size, None
    raise TypeError(f"cache: expected sparsa.PagedKVCache, sparsa.distributed.PrefixShard or a (k, v) pair of "
                    f"tensors, got {type(cache).__name__}")


def _check_prefix(ctx: _Context, q, k, v, page_size, extra: Sequence[float]):
    table = _gather_meta(ctx, (q, k, v), [float(page_size)] + list(extra))
    dq, dk, dv = (_Described(n, table, i) for i, n in enumerate(("q", "cache keys", "cache values")))
    _check_tensors(ctx, (dq, dk, dv))
    _same_across_ranks(ctx, dq, (0, 1, 2, 3), ("batch", "heads", "rows", "head_dim"))
    _same_across_ranks(ctx, dk, (1, 3), ("heads", "head_dim"))
    tail = table[:, 3 * _FIELDS:]
    for r in range(ctx.world):
        if int(tail[r, 0]) != int(tail[0, 0]):
            raise ValueError(f"page_size: rank {r} has {int(tail[r, 0])}, rank 0 has {int(tail[0, 0])}")
        if dq.size(r, 0) != 1:
            raise ValueError(f"q: expected batch 1 (one sequence; the prefix is that sequence's), got {dq.size(r, 0)}")
        if dk.size(r, 3) != dq.size(r, 3) or dv.size(r, 3) != dq.size(r, 3):
            raise ValueError(f"cache: rank {r}'s head_dim differs from q's {dq.size(r, 3)}")
        if dk.size(r, 0) != 1 or dv.size(r, 0) != 1 or dv.size(r, 1) != dk.size(r, 1) or dv.size(r, 2) != dk.size(r, 2):
            raise ValueError(f"cache: rank {r}'s keys and values must both be [1, heads_kv, n, head_dim] of one shape")
        if dq.size(r, 1) % dk.size(r, 1) != 0:
            raise ValueError(f"q: heads_q ({dq.size(r, 1)}) must be a multiple of the cache's heads_kv ({dk.size(r, 1)})")
        for i in range(1, tail.shape[1]):  # q's checksums: q must be the same tensor on every rank
            a, b = float(tail[r, i]), float(tail[0, i])
            if a != b and not (a != a and b != b):  # NaN sums (NaN in q) compare equal here
                raise ValueError(f"q: rank {r}'s values differ from rank 0's (prefix attention takes the same queries "
                                 "on every rank)")
    lens = [dk.size(r, 2) for r in range(ctx.world)]
    for r in range(ctx.world):
        if lens[r] < 1:
            raise ValueError(f"cache: rank {r} holds no prefix tokens; every rank needs at least one")
    for r in range(ctx.world - 1):
        if lens[r] % page_size != 0:
            raise ValueError(f"cache: rank {r}'s piece holds {lens[r]} tokens, not a multiple of page_size {page_size} "
                             "(every piece but the last must be whole pages)")
    return lens


def _checksums(q: torch.Tensor) -> List[float]:
    if not isinstance(q, torch.Tensor) or q.dtype not in _DTYPES:
        return [0.0, 0.0]
    x = q.detach().double()
    return [float(x.sum()), float((x * x).sum())]


_LANES = 16


def _quest_scores(q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """QUEST's page scores, float32 [heads_q, rows, pages], bit for bit those of the core's
    quest_page_score: 16 lane sums (lane j takes dims j, j + 16, ...) accumulated in dimension
    order, added lane by lane, then the tail dims one by one. q [heads_q, rows, d] f32; bounds
    [heads_kv, pages, d] f32 (query head h reads kv head h / (heads_q / heads_kv))."""
    heads, rows, d = q.shape
    group = heads // page_min.shape[0]
    pages = page_min.shape[1]
    scores = torch.empty((heads, rows, pages), dtype=torch.float32, device=q.device)
    full = d - d % _LANES
    for h in range(heads):  # one head at a time: [rows, pages, 16] per step
        qh, lo, hi = q[h][:, None, :], page_min[h // group][None], page_max[h // group][None]
        lanes = torch.zeros((rows, pages, _LANES), dtype=torch.float32, device=q.device)
        for t in range(0, full, _LANES):
            a, b = qh[..., t:t + _LANES] * hi[..., t:t + _LANES], qh[..., t:t + _LANES] * lo[..., t:t + _LANES]
            lanes += torch.where(a < b, b, a)
        score = torch.zeros((rows, pages), dtype=torch.float32, device=q.device)
        for j in range(_LANES):
            score += lanes[..., j]
        for t in range(full, d):
            score += torch.maximum(qh[..., t] * hi[..., t], qh[..., t] * lo[..., t])
        scores[h] = score
    return scores


def _rank_order(scores: torch.Tensor, pages: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """Positions along the last dim in QUEST's order: higher score first, NaN after every number,
    ties to the lower page; excluded entries last. Three stable sorts, least significant first."""
    order = torch.sort(pages, dim=-1, stable=True).indices
    key = torch.gather(scores, -1, order)
    key = torch.where(torch.isnan(key), torch.full_like(key, -float("inf")), key)
    second = torch.sort(key, dim=-1, descending=True, stable=True).indices
    order = torch.gather(order, -1, second)
    klass = torch.isnan(torch.gather(scores, -1, order)).to(torch.int8) + 2 * torch.gather(excluded, -1, order).to(torch.int8)
    third = torch.sort(klass, dim=-1, stable=True).indices
    return torch.gather(order, -1, third)


def _quest_select(ctx: _Context, q: torch.Tensor, k: torch.Tensor, lens: List[int], page_size: int, budget: int,
                  force_first: bool, force_last: bool, bounds=None) -> QuestPlan:
    heads_q, rows = q.shape[1], q.shape[2]
    device = q.device
    local_pages = [-(-n // page_size) for n in lens]
    page_starts = _Shards.starts(local_pages)
    num_pages = page_starts[-1]
    keep = min(budget // page_size, num_pages)
    if keep == num_pages:  # the budget covers the whole prefix
        pages = torch.arange(num_pages, dtype=torch.int32, device=device).expand(heads_q, rows, num_pages).contiguous()
        return QuestPlan(page_size, torch.full((heads_q, rows), keep, dtype=torch.int32, device=device), pages, page_starts)
    forced = []
    if force_first:
        forced.append(0)
    if force_last and not (force_first and num_pages == 1):
        forced.append(num_pages - 1)
    # Local candidates: this rank's best `keep` non-forced pages. A page of the global top set has
    # fewer than `keep` better pages anywhere, so it is among its own rank's best `keep`.
    mine = local_pages[ctx.rank]
    first_page = page_starts[ctx.rank]
    page_min, page_max = bounds if bounds is not None else _page_bounds(k, page_size)
    scores = _quest_scores(q[0].float(), page_min, page_max)  # [heads_q, rows, mine]
    global_page = torch.arange(first_page, first_page + mine, device=device).expand(heads_q, rows, mine)
    excluded = torch.zeros_like(global_page, dtype=torch.bool)
    for p in forced:
        excluded |= global_page == p
    order = _rank_order(scores, global_page, excluded)[..., :keep]
    cand_scores = torch.gather(scores, -1, order)
    cand_pages = torch.gather(global_page, -1, order)
    cand_excluded = torch.gather(excluded, -1, order)
    if order.shape[-1] < keep:  # fewer pages here than the budget: pad with excluded entries
        pad = keep - order.shape[-1]
        cand_scores = torch.nn.functional.pad(cand_scores, (0, pad))
        cand_pages = torch.nn.functional.pad(cand_pages, (0, pad), value=num_pages)
        cand_excluded = torch.nn.functional.pad(cand_excluded, (0, pad), value=True)
    if ctx.world > 1:
        packed = torch.stack([cand_scores.double(), cand_pages.double(), cand_excluded.double()])
        packed = packed.to(ctx.meta_device()) if "nccl" in ctx.backend else packed.cpu()
        gathered = [torch.empty_like(packed) for _ in range(ctx.world)]
        dist.all_gather(gathered, packed, group=ctx.group)
        last_timings.bytes_sent += packed.numel() * packed.element_size() * (ctx.world - 1)
        gathered = torch.cat([g.to(device) for g in gathered], dim=-1)
        cand_scores, cand_pages, cand_excluded = gathered[0].float(), gathered[1].long(), gathered[2].bool()
    order = _rank_order(cand_scores, cand_pages, cand_excluded)[..., :keep - len(forced)]
    chosen = torch.gather(cand_pages, -1, order)
    if forced:
        chosen = torch.cat([torch.tensor(forced, device=device).expand(heads_q, rows, len(forced)), chosen], -1)
    chosen, _ = torch.sort(chosen, dim=-1)
    return QuestPlan(page_size, torch.full((heads_q, rows), keep, dtype=torch.int32, device=device),
                     chosen.to(torch.int32).contiguous(), page_starts)


def quest_plan(q: torch.Tensor, cache, *, budget: int = 256, force_first: bool = False, force_last: bool = True,
               page_size: Optional[int] = None, group=None) -> QuestPlan:
    """QUEST's page selection over the prefix spread across the ranks (rank r holds the r-th
    piece as a :class:`sparsa.PagedKVCache` or a ``(k, v)`` pair ``[1, heads_kv, n_r, d]``; every
    piece but the last whole pages). Each rank scores its pages and keeps its best candidates; the
    candidates are all-gathered and the global top set is chosen as one process would: equal to
    :func:`sparsa.quest_plan` (``selector="quest"``, ``group="per_head"``) on the whole cache."""
    ctx = _context(group)
    k, v, page_size, bounds = _prefix_shard(cache, page_size)
    lens = _check_prefix(ctx, q, k, v, page_size, _checksums(q))
    _check_budget(budget, page_size, force_first, force_last)
    return _quest_select(ctx, q, k, lens, page_size, budget, force_first, force_last, bounds)


def _check_budget(budget: int, page_size: int, force_first: bool, force_last: bool) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < page_size or budget % page_size != 0:
        raise ValueError(f"budget: expected a positive multiple of page_size {page_size}, got {budget!r}")
    forced = int(bool(force_first)) + int(bool(force_last))
    if budget // page_size < forced:
        raise ValueError(f"budget: {budget} tokens is {budget // page_size} page(s), fewer than the {forced} forced "
                         "(first/last) pages")


def prefix_attention(q: torch.Tensor, cache, *, method: str = "dense", budget: int = 256, force_first: bool = False,
                     force_last: bool = True, page_size: Optional[int] = None, scale: Optional[float] = None,
                     backend: str = "auto", group=None, timed: bool = False):
    """Attention of the block's queries ``q`` ``[1, heads_q, rows, d]`` (the same on every rank)
    over a prefix spread across the ranks (``cache``: this rank's piece, as in :func:`quest_plan`).
    ``method="dense"``: every rank attends over its whole piece (split-KV across ranks);
    ``"quest"``: over the pages of the global QUEST selection that it holds. The partial results
    are all-gathered and merged by LSE in rank order, so every rank returns the same
    ``(out, lse)``: that of :func:`sparsa.dense` / :func:`sparsa.quest` over the whole prefix."""
    if method not in ("dense", "quest"):
        raise ValueError(f"method: expected dense or quest, got {method!r}")
    ctx = _context(group)
    k, v, page_size, bounds = _prefix_shard(cache, page_size)
    lens = _check_prefix(ctx, q, k, v, page_size, _checksums(q))
    clock = _Clock(q.device, timed)
    if method == "dense":
        out, lse = sparsa.dense(q, k, v, scale=scale, backend=backend)
    else:
        _check_budget(budget, page_size, force_first, force_last)
        plan = _quest_select(ctx, q, k, lens, page_size, budget, force_first, force_last, bounds)
        clock.lap("plan")
        counts, indices = _columns(plan.counts[None], plan.pages[None], plan.page_starts[ctx.rank],
                                   plan.page_starts[ctx.rank + 1])
        out, lse = sparsa.block_sparse(q, k, v, BlockIndex(1, page_size, counts, indices), scale=scale, backend=backend)
    clock.lap("compute")
    if ctx.world == 1:
        return out, lse
    out32 = out.float().contiguous()
    outs = [torch.empty_like(out32) for _ in range(ctx.world)]
    lses = [torch.empty_like(lse) for _ in range(ctx.world)]
    dist.all_gather(outs, out32, group=ctx.group)
    dist.all_gather(lses, lse.contiguous(), group=ctx.group)
    last_timings.bytes_sent += (out32.numel() * 4 + lse.numel() * 4) * (ctx.world - 1)
    clock.lap("wait")
    acc = None
    for o, l in zip(outs, lses):  # rank order: the same bits on every rank
        acc = _merge_into(acc, o, l)
    clock.lap("compute")
    return acc[0].to(q.dtype), acc[1]


# ---- LoSA over a sharded prefix ----------------------------------------------------------------

_LOSA_METHODS = ("losa", "dense", "quest", "reuse")


class LosaState:
    """:class:`sparsa.LosaState`'s semantics (docs/losa.md) over a prefix spread across the ranks:
    per layer and current block, the prefix output ``o_p``, its LSE ``l_p`` and the query
    ``q_ref`` each row was computed with (the same on every rank, f32, on q's device).

    First step of a block: every row's prefix part, dense (:func:`prefix_attention`). Later steps
    (``method="losa"``): the ``active_k`` rows whose query moved most (mean squared change over heads
    and dims against ``q_ref``; or those above ``mse_threshold``) recompute theirs over the global
    QUEST selection; the others keep theirs. Every step: attention over the block's own keys
    (``k_block``, ``v_block``, the same on every rank), merged by LSE. ``method``: ``"losa"``,
    ``"dense"`` (dense prefix every step), ``"quest"`` (QUEST every row every step) or ``"reuse"``
    (LoSA's split, active rows dense). The prefix pieces are the caller's: after a block is
    finished, append it to one rank's piece (keeping every piece but the last whole pages) and
    call :meth:`begin_block`."""

    def __init__(self, heads_q: int, heads_kv: int, head_dim: int, *, block_size: int = 16, method: str = "losa",
                 budget: int = 256, force_first: bool = False, force_last: bool = True, active_k: int = 4,
                 mse_threshold: Optional[float] = None, scale: Optional[float] = None, backend: str = "auto",
                 group=None):
        if method not in _LOSA_METHODS:
            raise ValueError(f"method: expected one of {', '.join(_LOSA_METHODS)}, got {method!r}")
        for name, value in (("heads_q", heads_q), ("heads_kv", heads_kv), ("head_dim", head_dim),
                            ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if heads_q % heads_kv != 0:
            raise ValueError(f"heads_q: {heads_q} is not a multiple of heads_kv {heads_kv}")
        if mse_threshold is not None:
            if not isinstance(mse_threshold, (int, float)) or not mse_threshold >= 0 or mse_threshold == float("inf"):
                raise ValueError(f"mse_threshold: expected a finite number >= 0, got {mse_threshold!r}")
        elif isinstance(active_k, bool) or not isinstance(active_k, int) or not 0 <= active_k <= block_size:
            raise ValueError(f"active_k: expected 0 to block_size ({block_size}) active tokens per step, got {active_k!r}")
        self.heads_q, self.heads_kv, self.head_dim, self.block_size = heads_q, heads_kv, head_dim, block_size
        self.method, self.budget, self.force_first, self.force_last = method, budget, force_first, force_last
        self.active_k, self.mse_threshold, self.scale, self.backend, self.group = \
            active_k, mse_threshold, scale, backend, group
        self.steps_in_block = 0
        self.o_p = self.l_p = self.q_ref = None
        self.stats: Optional[dict] = None

    def _active_rows(self, q: torch.Tensor) -> Tuple[List[int], List[float]]:
        diff = q[0].double() - self.q_ref[0].double()  # [heads, rows, d]
        mse = ((diff * diff).sum(dim=(0, 2)) / (self.heads_q * self.head_dim)).tolist()
        rows = range(self.block_size)
        if self.mse_threshold is not None:
            return [i for i in rows if mse[i] > self.mse_threshold or mse[i] != mse[i]], mse
        # Larger MSE first (NaN first: a broken query must not hide as stable), ties to the lower row.
        order = sorted(rows, key=lambda i: (0 if mse[i] != mse[i] else 1, -mse[i] if mse[i] == mse[i] else 0, i))
        return sorted(order[:self.active_k]), mse

    def step(self, cache, q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor):
        """One denoising step of the current block: ``(out, lse)`` over prefix + block for q
        ``[1, heads_q, block_size, head_dim]`` (the same on every rank); ``cache`` is this rank's
        prefix piece (as in :func:`prefix_attention`). ``self.stats`` then holds ``recomputed``
        (rows), ``mse`` and ``sparse`` (whether the prefix part went through QUEST)."""
        want = (1, self.heads_q, self.block_size, self.head_dim)
        for name, x, heads in (("q", q, self.heads_q), ("k_block", k_block, self.heads_kv),
                               ("v_block", v_block, self.heads_kv)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
            if tuple(x.shape) != (1, heads) + want[2:]:
                raise ValueError(f"{name}: expected {[1, heads, *want[2:]]}, got {list(x.shape)}")
        first = self.steps_in_block == 0
        if first:
            self.o_p = torch.zeros(want, dtype=torch.float32, device=q.device)
            self.l_p = torch.full(want[:3], -float("inf"), dtype=torch.float32, device=q.device)
            self.q_ref = torch.empty(want, dtype=q.dtype, device=q.device)
        mse = [0.0] * self.block_size
        if first or self.method in ("dense", "quest"):
            rows = list(range(self.block_size))
        else:
            rows, mse = self._active_rows(q)
        sparse = self.method == "quest" or (self.method == "losa" and not first)
        # Every rank reaches the same rows (q and q_ref are the same everywhere), so every rank joins
        # the collective below or none does.
        if rows:
            index = torch.tensor(rows, device=q.device)
            q_rows = q.index_select(2, index)
            out, lse = prefix_attention(q_rows, cache, method="quest" if sparse else "dense", budget=self.budget,
                                        force_first=self.force_first, force_last=self.force_last, scale=self.scale,
                                        backend=self.backend, group=self.group)
            self.o_p[:, :, index] = out.float()
            self.l_p[:, :, index] = lse
            self.q_ref[:, :, index] = q_rows
        o_block, l_block = sparsa.dense(q, k_block, v_block, scale=self.scale, backend=self.backend)
        merged, merged_lse = sparsa.merge(self.o_p, self.l_p, o_block.float(), l_block)
        self.steps_in_block += 1
        self.stats = {"recomputed": rows, "mse": mse, "sparse": sparse}
        return merged.to(q.dtype), merged_lse

    def begin_block(self) -> None:
        """The next step is the first (dense) step of a new block."""
        self.steps_in_block = 0
