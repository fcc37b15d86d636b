"""One rank of test_distributed.py's process groups (not collected by pytest: no test_ prefix).

Usage: distributed_worker.py RANK WORLD PORT. Every rank builds the same whole-sequence inputs
from fixed seeds, takes its piece, runs sparsa.distributed and compares its part of the result
with the single-process sparsa call on the whole inputs. It prints one JSON line per check
({"name", "ok", "detail"}); the parent test asserts that every rank passed every check.

Tolerances (every comparison is against single-process sparsa on the same inputs):
- f32: the distributed result is the same convex combination of the same value rows, summed in
  another order (W online-softmax passes and W-1 LSE merges instead of one pass). Each reordered
  f32 sum step moves the result by about one ulp (2^-24 ~ 6e-8) of max|out|; over the ~10^2 keys
  of a row and up to 4 merges that is < 1e-5 of max|out| with a wide margin (measured: ~1e-7).
  LSE: the same, relative to 1 + |lse|. A dropped shard moves the output by O(1/W) of max|out|,
  five orders above (the negative control checks that the bound catches it).
- bf16 / f16: per element, the single-process output is rounded once to the dtype (half an ulp,
  at most u|out| with u = 2^-8 for bf16's 8-bit significand, 2^-11 for f16's 11); the distributed
  one rounds each shard's partial output (at most u|partial| <= u max|v|, the partials are convex
  combinations of v rows), merges them in f32 with weights summing to 1, and rounds once more.
  So |difference| <= u (2 max|out| + max|v|), plus the f32 term. LSE is f32 on both sides, from
  the same rounded inputs: 1e-4 of 1 + |lse|.
- plans (BA-Att, QUEST): exactly equal.
"""
import datetime
import json
import sys
import traceback

import numpy as np
import torch
import torch.distributed as dist

import sparsa
import sparsa.distributed as sd

RANK, WORLD, PORT = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
F32_BOUND = 1e-5
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
LSE_BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4}


def report(name, ok, detail=""):
    print(json.dumps({"name": name, "ok": bool(ok), "detail": str(detail)}), flush=True)


def close(name, out, lse, ref_out, ref_lse, dtype, v_max):
    """out/lse against the reference within the dtype's bound (see the module comment)."""
    ref_out, ref_lse = torch.as_tensor(ref_out), torch.as_tensor(ref_lse)
    scale = max(float(ref_out.double().abs().max()), 1e-30)
    bound = F32_BOUND * scale + UNIT_ROUNDOFF[dtype] * (2 * scale + float(v_max))
    err = float((out.double() - ref_out.double()).abs().max())
    finite = torch.isfinite(ref_lse)
    lse_err = float(((lse.double() - ref_lse.double()).abs() / (1 + ref_lse.double().abs()))[finite].max()) \
        if finite.any() else 0.0
    same_empty = bool(torch.equal(torch.isfinite(lse), finite))
    ok = err <= bound and lse_err <= LSE_BOUND[dtype] and same_empty
    report(name, ok, f"out {err:.3g} (bound {bound:.3g}), lse {lse_err:.3g}, empty rows agree {same_empty}")
    return err


def inputs(seed, batch, heads_q, heads_kv, len_q, len_kv, d, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, len_q, d, generator=g)
    k = torch.randn(batch, heads_kv, len_kv, d, generator=g)
    v = torch.randn(batch, heads_kv, len_kv, d, generator=g)
    # Heavy-tailed key norms and a few strong keys, so that the plans have structure to find.
    k = k * torch.exp(0.5 * torch.randn(batch, heads_kv, len_kv, 1, generator=g))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def piece(x, multiple=1):
    lo, hi = sd.shard_bounds(x.shape[2], WORLD, multiple)[RANK]
    return x[:, :, lo:hi], lo, hi


def expect_error(name, kind, words, call):
    try:
        call()
    except kind as e:
        text = str(e)
        report(name, all(w in text for w in words), text)
        return
    except Exception as e:  # noqa: BLE001 - the wrong kind is a failure, reported with its text
        report(name, False, f"{type(e).__name__}: {e}")
        return
    report(name, False, "no error")


def sequence_cases():
    # dense: GQA, len_q != len_kv, uneven pieces (the last shorter), both schedules, three dtypes.
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, k, v = inputs(1, 2, 4, 2, 23 * WORLD + 5, 31 * WORLD + 3, 32, dtype)
        ref_out, ref_lse = sparsa.dense(q, k, v)
        ql, lo, hi = piece(q)
        for schedule in ("ring", "allgather"):
            out, lse = sd.dense(ql, piece(k)[0], piece(v)[0], schedule=schedule)
            assert out.dtype == dtype and lse.dtype == torch.float32
            close(f"dense/{schedule}/{str(dtype)[6:]}", out, lse, ref_out[:, :, lo:hi], ref_lse[:, :, lo:hi], dtype, v.abs().max())
    # Strided pieces (FlashAttention's [batch, seq, heads, d] passed as a transposed view).
    q, k, v = inputs(7, 1, 4, 2, 19 * WORLD + 2, 17 * WORLD + 1, 32, torch.float32)
    ref_out, ref_lse = sparsa.dense(q, k, v)
    ql, lo, hi = piece(q)
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (ql, piece(k)[0], piece(v)[0])]
    out, lse = sd.dense(*views)
    close("dense/strided", out, lse, ref_out[:, :, lo:hi], ref_lse[:, :, lo:hi], torch.float32, v.abs().max())
    # Negative control: merging every shard but one must fail the f32 bound.
    q, k, v = inputs(2, 1, 2, 1, 20 * WORLD, 20 * WORLD, 32, torch.float32)
    ref_out, ref_lse = sparsa.dense(q, k, v)
    if WORLD > 1:
        acc = None
        for r, (a, b) in enumerate(sd.shard_bounds(k.shape[2], WORLD)):
            if r == WORLD - 1:
                continue  # the dropped shard
            o, l = sparsa.dense(q, k[:, :, a:b], v[:, :, a:b])
            acc = (o, l) if acc is None else sparsa.merge(acc[0], acc[1], o, l)
        err = float((acc[0] - ref_out).abs().max() / ref_out.abs().max())
        report("negative/dropped-shard", err > 100 * F32_BOUND, f"error {err:.3g}")

    # block_sparse over a random global plan, pieces of whole blocks (the last partial).
    bq, bkv = 16, 8
    len_q, len_kv = 48 * WORLD + 9, 40 * WORLD + 5
    q, k, v = inputs(3, 1, 4, 2, len_q, len_kv, 32, torch.float32)
    nq, nkv = -(-len_q // bq), -(-len_kv // bkv)
    g = np.random.default_rng(3)
    counts = g.integers(0, nkv + 1, size=(1, 4, nq)).astype(np.int32)
    counts[0, 0, 0] = 0  # a query block that sees nothing: out 0, lse -inf
    indices = np.zeros((1, 4, nq, nkv), dtype=np.int32)
    for h in range(4):
        for b in range(nq):
            chosen = np.sort(g.choice(nkv, counts[0, h, b], replace=False))
            indices[0, h, b, :len(chosen)] = chosen
    plan = sparsa.BlockIndex(bq, bkv, counts, indices)
    ref_out, ref_lse = sparsa.block_sparse(q, k, v, plan)
    (ql, lo, hi), kl, vl = piece(q, bq), piece(k, bkv)[0], piece(v, bkv)[0]
    report("shard", torch.equal(sd.shard(q, multiple=bq), ql) and torch.equal(sd.shard(k, multiple=bkv), kl))
    for schedule in ("ring", "allgather"):
        out, lse = sd.block_sparse(ql, kl, vl, plan, schedule=schedule)
        close(f"block_sparse/{schedule}", out, lse, ref_out[:, :, lo:hi], ref_lse[:, :, lo:hi], torch.float32, v.abs().max())
    # Negative control: the plan's global columns applied to the local pieces (no shift).
    if WORLD > 1:
        rows_c = torch.from_numpy(counts[:, :, lo // bq:-(-hi // bq)].copy())
        rows_i = torch.from_numpy(indices[:, :, lo // bq:-(-hi // bq)].copy())
        acc = None
        for a, b in sd.shard_bounds(len_kv, WORLD, bkv):  # every shard, but read with global column numbers
            unshifted = sparsa.BlockIndex(bq, bkv, *sd._columns(rows_c, rows_i, 0, -(-(b - a) // bkv)))
            o, l = sparsa.block_sparse(ql, k[:, :, a:b], v[:, :, a:b], unshifted)
            acc = (o, l) if acc is None else sparsa.merge(acc[0], acc[1], o, l)
        wrong = acc[0]
        report("negative/unshifted-columns", err > 100 * F32_BOUND, f"error {err:.3g}")
    # A plan with permutations (random): the gathered path.
    perm_q = np.stack([g.permutation(len_q) for _ in range(4)])[None].astype(np.int32)
    perm_kv = np.stack([g.permutation(len_kv) for _ in range(2)])[None].astype(np.int32)
    permuted = sparsa.BlockIndex(bq, bkv, counts, indices, perm_q, perm_kv)
    ref_out, ref_lse = sparsa.block_sparse(q, k, v, permuted)
    ql, lo, hi = piece(q)
    out, lse = sd.block_sparse(ql, piece(k)[0], piece(v)[0], permuted)
    close("block_sparse/permuted", out, lse, ref_out[:, :, lo:hi], ref_lse[:, :, lo:hi], torch.float32, v.abs().max())

    # BA-Att: the plan equals the single-process plan exactly; the output is within the bound.
    len_q = len_kv = 64 * WORLD + 40
    q, k, v = inputs(4, 1, 4, 2, len_q, len_kv, 64, torch.float32)
    ql, lo, hi = piece(q)
    kl, vl = piece(k)[0], piece(v)[0]
    for label, options in (("sorted", dict(block_q=16, block_kv=16, density=0.3)),
                           ("window", dict(block_q=16, block_kv=16, sort_window=32, top_kappa=3)),
                           ("unsorted", dict(block_q=16, block_kv=16, sort_q=False, sort_k=False, tau=0.8))):
        ref_plan = sparsa.ba_att_plan(q, k, **options)
        got = sd.ba_att_plan(ql, kl, **options)
        same = all(np.array_equal(np.asarray(getattr(ref_plan, f)), np.asarray(getattr(got, f)))
                   if getattr(ref_plan, f) is not None else getattr(got, f) is None
                   for f in ("counts", "indices", "perm_q", "perm_kv"))
        report(f"ba_att_plan/{label}", same)
        ref_out, ref_lse = sparsa.ba_att(q, k, v, **options)
        out, lse = sd.ba_att(ql, kl, vl, **options)
        close(f"ba_att/{label}", out, lse, ref_out[:, :, lo:hi], ref_lse[:, :, lo:hi], torch.float32, v.abs().max())
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    ref_out, ref_lse = sparsa.ba_att(qb, kb, vb, block_q=16, block_kv=16, density=0.3)
    out, lse = sd.ba_att(piece(qb)[0], piece(kb)[0], piece(vb)[0], block_q=16, block_kv=16, density=0.3)
    close("ba_att/bf16", out, lse, ref_out[:, :, lo:hi], ref_lse[:, :, lo:hi], torch.bfloat16, vb.abs().max())


def cache_of(k, v, page_size):
    cache = sparsa.PagedKVCache(k.shape[1], k.shape[3], page_size)
    if k.shape[2]:
        cache.append(k.numpy(), v.numpy())
    return cache


def prefix_cases():
    page = 16
    n = 16 * (9 * WORLD + 2) + 7  # pages of 16, the last partial
    q, k, v = inputs(5, 1, 8, 2, 6, n, 64, torch.float32)
    (kl, lo, hi), vl = piece(k, page), piece(v, page)[0]
    local = cache_of(kl, vl, page)
    full = cache_of(k, v, page)
    ref_out, ref_lse = sparsa.dense(q, k, v)
    out, lse = sd.prefix_attention(q, local, method="dense")
    close("prefix/dense", out, lse, ref_out, ref_lse, torch.float32, v.abs().max())
    out, lse = sd.prefix_attention(q.bfloat16(), (kl.bfloat16(), vl.bfloat16()), method="dense", page_size=page)
    ref_out, ref_lse = sparsa.dense(q.bfloat16(), k.bfloat16(), v.bfloat16())
    close("prefix/dense/bf16", out.float(), lse, ref_out.float(), ref_lse, torch.bfloat16, v.abs().max())
    for budget, first, last in ((64, False, True), (96, True, True), (48, True, False), (16 * 1000, False, True)):
        label = f"budget{budget}{'/first' if first else ''}{'/last' if last else ''}"
        reference = sparsa.quest_plan(q.numpy(), full, budget=budget, force_first=first, force_last=last)
        counts, pages = reference.counts, reference.pages
        plan = sd.quest_plan(q, local, budget=budget, force_first=first, force_last=last)
        same = np.array_equal(counts, plan.counts.numpy()) and np.array_equal(pages, plan.pages.numpy())
        report(f"quest_plan/{label}", same)
        ref_out, ref_lse = sparsa.quest(q, k, v, budget=budget, page_size=page, force_first=first, force_last=last)
        out, lse = sd.prefix_attention(q, local, method="quest", budget=budget, force_first=first, force_last=last)
        close(f"prefix/quest/{label}", out, lse, ref_out, ref_lse, torch.float32, v.abs().max())
    # The tensor forms: a (k, v) pair and a PrefixShard (bounds computed once), in bf16.
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    # (single-process QUEST computes in f32 whatever comes in: the reference takes the bf16 values
    # widened, exactly, which keeps it from sparsa.quest's bf16 torch output path)
    ref_out, ref_lse = sparsa.quest(qb.float(), kb.float(), vb.float(), budget=64, page_size=page)
    for label, shard in (("pair", (piece(kb, page)[0], piece(vb, page)[0])),
                         ("shard", sd.PrefixShard(piece(kb, page)[0], piece(vb, page)[0], page))):
        out, lse = sd.prefix_attention(qb, shard, method="quest", budget=64, page_size=page)
        close(f"prefix/quest/bf16/{label}", out, lse, ref_out, ref_lse, torch.bfloat16, vb.abs().max())
        timings = sd.last_timings
        report(f"timings/{label}", timings.plan > 0 and timings.compute > 0 and
               (timings.bytes_sent > 0) == (WORLD > 1), timings)
    # LoSA over the sharded prefix against sparsa.LosaState over the whole cache: a block of 16
    # rows denoised in 4 steps; each step every query drifts a little and 3 rows move a lot.
    g = torch.Generator().manual_seed(9)
    for method in ("losa", "reuse", "quest", "dense", "threshold"):
        options = dict(method="losa", mse_threshold=0.5) if method == "threshold" else dict(method=method)
        ref_state = sparsa.LosaState(8, 2, 64, block_size=16, budget=64, **options)
        state = sd.LosaState(8, 2, 64, block_size=16, budget=64, **options)
        qs = torch.randn(1, 8, 16, 64, generator=g)
        for step in range(4):
            if step:
                qs = qs + 0.01 * torch.randn(qs.shape, generator=g)
                moved = torch.randperm(16, generator=g)[:3]
                qs[:, :, moved] += torch.randn(1, 8, 3, 64, generator=g)
            kb, vb = torch.randn(1, 2, 16, 64, generator=g), torch.randn(1, 2, 16, 64, generator=g)
            ref_out, ref_lse = ref_state.step(full, qs.numpy(), kb.numpy(), vb.numpy())
            out, lse = state.step(local, qs, kb, vb)
            close(f"losa/{method}/step{step}", out, lse, ref_out, ref_lse, torch.float32, max(v.abs().max(), vb.abs().max()))
            report(f"losa/{method}/step{step}/rows", list(ref_state.stats["recomputed"]) == state.stats["recomputed"],
                   f"{list(ref_state.stats['recomputed'])} vs {state.stats['recomputed']}")

    # Negative control: each rank keeping its own best budget/W pages is not QUEST's plan. Rank 0's
    # keys are planted to score high, so the global top set takes more than its even share there.
    if WORLD > 1:
        planted = k.clone()
        r0_lo, r0_hi = sd.shard_bounds(n, WORLD, page)[0]
        planted[:, :, r0_lo:r0_hi] *= 4.0
        budget = 16 * 12  # 12 pages, an even share on 2, 3 and 4 ranks
        pages = sparsa.quest_plan(q.numpy(), cache_of(planted, v, page), budget=budget, force_last=False).pages
        mine = cache_of(piece(planted, page)[0], vl, page)
        own = sparsa.quest_plan(q.numpy(), mine, budget=budget // WORLD, force_last=False).pages
        own = torch.from_numpy(own).long() + lo // page
        gathered = [torch.empty_like(own) for _ in range(WORLD)]
        dist.all_gather(gathered, own)
        naive = torch.sort(torch.cat(gathered, -1), -1).values.numpy()
        report("negative/per-shard-top-pages", naive.shape == pages.shape and not np.array_equal(naive, pages),
               "the per-shard selection differs from the global one")
        plan = sd.quest_plan(q, mine, budget=budget, force_last=False)
        report("quest_plan/planted", np.array_equal(pages, plan.pages.numpy()))


def error_cases():
    q, k, v = inputs(6, 1, 4, 2, 16 * WORLD, 16 * WORLD, 32, torch.float32)
    ql, kl, vl = piece(q)[0], piece(k)[0], piece(v)[0]
    # Only the last rank passes a bf16 k: every rank raises, naming k (no rank is left waiting).
    k_bad = kl.bfloat16() if RANK == WORLD - 1 else kl
    expect_error("error/dtype-across-ranks", TypeError, ["k:", "bfloat16"] if WORLD > 1 else ["k:"],
                 lambda: sd.dense(ql, k_bad if WORLD > 1 else kl.bfloat16(), vl))
    d_bad = torch.randn(1, 4, ql.shape[2], 16) if RANK == WORLD - 1 else ql
    expect_error("error/head-dim-across-ranks", ValueError, ["q:", "head_dim"] if WORLD > 1 else ["head_dim"],
                 lambda: sd.dense(d_bad, kl, vl))
    expect_error("error/not-a-tensor", TypeError, ["v:"], lambda: sd.dense(ql, kl, vl.numpy() if RANK == 0 else vl))
    expect_error("error/schedule", ValueError, ["schedule:"], lambda: sd.dense(ql, kl, vl, schedule="tree"))
    if WORLD > 1:  # pieces of 13 tokens are not whole blocks of 16
        plan = sparsa.BlockIndex.full(1, 4, q.shape[2], k.shape[2], 16, 16)
        bounds = sd.shard_bounds(q.shape[2], WORLD, 13)[RANK]
        expect_error("error/unaligned-shard", ValueError, ["q:", "index.block_q"],
                     lambda: sd.block_sparse(q[:, :, bounds[0]:bounds[1]], kl, vl, plan))
        prefix_q = q[:, :, :4] + (RANK == 1)
        expect_error("error/queries-differ", ValueError, ["q:", "differ"],
                     lambda: sd.prefix_attention(prefix_q, (kl, vl), page_size=16))
    expect_error("error/budget", ValueError, ["budget:"],
                 lambda: sd.prefix_attention(q[:, :, :4], (kl, vl), method="quest", budget=24))
    expect_error("error/plan-shape", ValueError, ["index.counts"],
                 lambda: sd.block_sparse(ql, kl, vl, sparsa.BlockIndex.full(1, 3, 5, 5, 16, 16)))
    bad = sparsa.BlockIndex.full(1, 4, q.shape[2], k.shape[2], 16, 16)
    bad.perm_q = np.zeros((1, 4, q.shape[2]), dtype=np.int32)  # not a permutation
    expect_error("error/perm-q", ValueError, ["index.perm_q", "permutation"], lambda: sd.block_sparse(ql, kl, vl, bad))
    # After the errors the group still works (no rank is stuck in a collective).
    out, lse = sd.dense(ql, kl, vl)
    ref_out, ref_lse = sparsa.dense(q, k, v)
    lo, hi = sd.shard_bounds(q.shape[2], WORLD)[RANK]
    close("after-errors/dense", out, lse, ref_out[:, :, lo:hi], ref_lse[:, :, lo:hi], torch.float32, v.abs().max())


def main():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    for cases in (sequence_cases, prefix_cases, error_cases):
        try:
            cases()
        except Exception:  # noqa: BLE001 - reported, then the parent fails the test
            report(f"{cases.__name__}/raised", False, traceback.format_exc())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
