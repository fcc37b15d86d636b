#!/usr/bin/env python3
"""Context-parallel sparsa (sparsa.distributed, docs/distributed.md) on the GPUs of one host:
BA-Att over a long sequence split across 1, 2, 4 ... GPUs, and prefix attention over a long
prefix split across them. Run under torchrun, one process per GPU (NCCL); on CPUs with gloo for a
smoke run at tiny sizes.

Cases (--case):
  ba_att   BA-Att at --density (default 0.1) over --tokens (default 1M) tokens, --heads 32 /
           --kv-heads 32, d --head-dim 128, bf16, blocks 64. For every group size in --worlds
           (default 1,2,4 capped at the number of processes) the first W ranks form a group and
           run sparsa.distributed.ba_att on their pieces; W = 1 also times plain sparsa.ba_att.
  prefix   the block's --queries (default 16) queries, 32/8 heads, against a --tokens prefix
           split across the group (a PrefixShard per rank), dense (split-KV across GPUs) and
           QUEST (--budget tokens per query).
  verify   must-show 1: every method at a size that fits one GPU (--tokens, default 64K for the
           sequence methods, prefix 256K), each rank's part against single-GPU sparsa on the
           whole inputs (bf16; the bound of tests/python/distributed_worker.py).

Per row: the median time of --repeats calls after --warmup (every rank synchronised and a barrier
on both sides of each call), the speedup over the W = 1 row, the communication share (one more
call with timed=True: the time a rank waited for communication that compute did not hide, over
that call's total; max over ranks) and per-GPU rates: TFLOP/s of the attention visited, and TB/s
of the K/V bytes each GPU's attention reads (BA-Att: the kept key blocks, once per query block;
prefix dense: the local piece; QUEST: the kept pages and the page bounds).

    # the H200 host (2 or 4 GPUs; the CUDA build of the module in build-gpu)
    PYTHONPATH=build-gpu/python python3 -m torch.distributed.run --standalone --nproc_per_node 4 \\
        bench/python/bench_distributed.py --case ba_att
    PYTHONPATH=build-gpu/python python3 -m torch.distributed.run --standalone --nproc_per_node 2 \\
        bench/python/bench_distributed.py --case prefix
    # a CPU smoke run (gloo)
    PYTHONPATH=build/python python3 -m torch.distributed.run --standalone --nproc_per_node 2 \\
        bench/python/bench_distributed.py --device cpu --case ba_att --tokens 2048 --heads 4 --kv-heads 2 \\
        --head-dim 32 --block 64 --repeats 1 --warmup 0
"""
import argparse
import datetime
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

import sparsa
import sparsa.distributed as sd


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=("ba_att", "prefix", "verify"), default="ba_att")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tokens", type=int, default=None, help="sequence (ba_att) or prefix (prefix) length")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads for ba_att, 8 for prefix")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--worlds", default=None, help="comma-separated group sizes (default 1,2,4,... up to the processes)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows here (rank 0)")
    return p.parse_args()


def setup(args):
    backend = "nccl" if args.device == "cuda" else "gloo"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    return torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")


def worlds(args):
    total = dist.get_world_size()
    if args.worlds:
        sizes = [int(w) for w in args.worlds.split(",")]
    else:
        sizes, w = [], 1
        while w <= total:
            sizes.append(w)
            w *= 2
    for w in sizes:
        if not 1 <= w <= total:
            raise SystemExit(f"--worlds: {w} is not between 1 and the {total} processes")
    return sizes


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, args, device, group):
    """Median seconds of fn() over args.repeats calls after args.warmup, every member synchronised."""
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.repeats):
        sync(device)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        sync(device)
        dist.barrier(group=group)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gathered_max(value, group, device):
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def random_qkv(seed, heads_q, heads_kv, length, d, dtype, device, lo=0, hi=None):
    """Rows [lo, hi) of a seeded whole sequence, generated piece-wise so no rank holds it all:
    each 4096-token chunk has its own seed."""
    hi = length if hi is None else hi
    out = []
    for heads, salt in ((heads_q, 1), (heads_kv, 2), (heads_kv, 3)):
        pieces = []
        for c0 in range(lo - lo % 4096, hi, 4096):
            g = torch.Generator(device=device).manual_seed(seed * 1000003 + salt * 7919 + c0)
            chunk = torch.randn(1, heads, min(4096, length - c0), d, generator=g, device=device)
            if salt == 2:  # heavy-tailed key norms
                chunk *= torch.exp(0.5 * torch.randn(1, heads, chunk.shape[2], 1, generator=g, device=device))
            a, b = max(lo, c0) - c0, min(hi, c0 + 4096) - c0
            pieces.append(chunk[:, :, a:b])
        out.append(torch.cat(pieces, 2).to(dtype).contiguous())
    return out


def row(**fields):
    return fields


def bench_ba_att(args, device, dtype, rows):
    tokens = args.tokens or 1 << 20
    heads_kv = args.kv_heads or args.heads
    options = dict(block_q=args.block, block_kv=args.block, density=args.density)
    nq = -(-tokens // args.block)
    kappa = max(1, min(nq, math.ceil(args.density * nq - 1e-9)))  # the density budget's rule (docs/ba_att.md)
    visited = nq * kappa * args.block * args.block * args.heads  # (query, key) pairs, all heads
    flops = 4.0 * visited * args.head_dim
    kv_bytes = 2.0 * nq * kappa * args.block * args.head_dim * args.heads * torch.finfo(dtype).bits / 8
    base = None
    for w in worlds(args):
        group = dist.new_group(list(range(w)))
        if dist.get_rank() < w:
            lo, hi = sd.shard_bounds(tokens, w, args.block)[dist.get_rank()]
            q, k, v = random_qkv(args.seed, args.heads, heads_kv, tokens, args.head_dim, dtype, device, lo, hi)
            if w == 1:
                t = median_time(lambda: sparsa.ba_att(q, k, v, **options), args, device, group)
                base = t
                rows.append(row(case="ba_att", method="sparsa.ba_att", gpus=1, tokens=tokens, seconds=t, speedup=1.0,
                                comm_share=0.0, tflops_per_gpu=flops / t / 1e12, tbs_per_gpu=kv_bytes / t / 1e12))
            t = median_time(lambda: sd.ba_att(q, k, v, group=group, **options), args, device, group)
            start = time.perf_counter()
            sd.ba_att(q, k, v, group=group, timed=True, **options)
            total = time.perf_counter() - start
            share = gathered_max(sd.last_timings.wait / total, group, device)
            plan_share = gathered_max(sd.last_timings.plan / total, group, device)
            sent = gathered_max(sd.last_timings.bytes_sent, group, device)
            if base is None:
                base = t
            rows.append(row(case="ba_att", method="sparsa.distributed.ba_att", gpus=w, tokens=tokens, seconds=t,
                            speedup=base / t, comm_share=share, plan_share=plan_share, bytes_sent_per_gpu=sent,
                            tflops_per_gpu=flops / w / t / 1e12, tbs_per_gpu=kv_bytes / w / t / 1e12))
            del q, k, v
        dist.barrier()


def bench_prefix(args, device, dtype, rows):
    tokens = args.tokens or 1 << 20
    heads_kv = args.kv_heads or 8
    page = args.page_size
    element = torch.finfo(dtype).bits / 8
    base = {}
    for w in worlds(args):
        group = dist.new_group(list(range(w)))
        if dist.get_rank() < w:
            lo, hi = sd.shard_bounds(tokens, w, page)[dist.get_rank()]
            _, k, v = random_qkv(args.seed, 1, heads_kv, tokens, args.head_dim, dtype, device, lo, hi)
            q = random_qkv(args.seed + 1, args.heads, 1, args.queries, args.head_dim, dtype, device)[0]
            shard = sd.PrefixShard(k, v, page)
            for method in ("dense", "quest"):
                call = lambda: sd.prefix_attention(q, shard, method=method, budget=args.budget, group=group)  # noqa: E731
                t = median_time(call, args, device, group)
                start = time.perf_counter()
                sd.prefix_attention(q, shard, method=method, budget=args.budget, group=group, timed=True)
                total = time.perf_counter() - start
                share = gathered_max(sd.last_timings.wait / total, group, device)
                local = hi - lo
                if method == "dense":
                    read = 2.0 * heads_kv * local * args.head_dim * element
                    visited = args.heads * args.queries * tokens / w
                else:  # kept pages (per query head and row, worst case no sharing) + the page bounds
                    kept = min(args.budget, tokens)
                    read = 2.0 * args.heads * args.queries * kept / w * args.head_dim * element \
                        + 2.0 * heads_kv * (-(-local // page)) * args.head_dim * 4
                    visited = args.heads * args.queries * kept / w
                base.setdefault(method, t)
                rows.append(row(case="prefix", method=f"sparsa.distributed.prefix_attention[{method}]", gpus=w,
                                tokens=tokens, seconds=t, speedup=base[method] / t, comm_share=share,
                                tflops_per_gpu=4.0 * visited * args.head_dim / t / 1e12,
                                tbs_per_gpu=gathered_max(read, group, device) / t / 1e12))
            del q, k, v, shard
        dist.barrier()


def bench_verify(args, device, dtype, rows):
    """Must-show 1: every method's distributed output against single-GPU sparsa on the whole inputs."""
    w, rank = dist.get_world_size(), dist.get_rank()
    tokens = args.tokens or 1 << 16
    heads_kv = args.kv_heads or 8
    u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}[dtype]

    def check(name, out, lse, ref_out, ref_lse, v, length):
        scale = float(ref_out.double().abs().max())
        bound = 1e-5 * scale + u * (2 * scale + float(v.double().abs().max()))
        err = float((out.double() - ref_out.double()).abs().max())
        finite = torch.isfinite(ref_lse)
        lse_err = float(((lse.double() - ref_lse.double()).abs() / (1 + ref_lse.double().abs()))[finite].max())
        ok = gathered_max(0.0 if err <= bound and lse_err <= 1e-4 else 1.0, None, device) == 0.0
        rows.append(row(case="verify", method=name, gpus=w, tokens=length, max_error=gathered_max(err, None, device),
                        bound=bound, lse_error=gathered_max(lse_err, None, device), ok=ok))

    q, k, v = random_qkv(args.seed, args.heads, heads_kv, tokens, args.head_dim, dtype, device)
    lo, hi = sd.shard_bounds(tokens, w, args.block)[rank]
    mine = [x[:, :, lo:hi] for x in (q, k, v)]
    ref = sparsa.dense(q, k, v)
    for schedule in ("ring", "allgather"):
        out, lse = sd.dense(*mine, schedule=schedule)
        check(f"dense/{schedule}", out, lse, ref[0][:, :, lo:hi], ref[1][:, :, lo:hi], v, tokens)
    options = dict(block_q=args.block, block_kv=args.block, density=args.density)
    plan = sparsa.ba_att_plan(q, k, **options)
    got = sd.ba_att_plan(mine[0], mine[1], **options)
    same = all(torch.equal(torch.as_tensor(getattr(plan, f)).cpu(), torch.as_tensor(getattr(got, f)).cpu())
               for f in ("counts", "indices", "perm_q", "perm_kv"))
    rows.append(row(case="verify", method="ba_att_plan (equal plans)", gpus=w, tokens=tokens,
                    ok=gathered_max(0.0 if same else 1.0, None, device) == 0.0))
    ref = sparsa.ba_att(q, k, v, **options)
    out, lse = sd.ba_att(*mine, **options)
    check("ba_att", out, lse, ref[0][:, :, lo:hi], ref[1][:, :, lo:hi], v, tokens)
    unsorted = sparsa.ba_att_plan(q, k, sort_q=False, sort_k=False, **options)
    ref = sparsa.block_sparse(q, k, v, unsorted)
    for schedule in ("ring", "allgather"):
        out, lse = sd.block_sparse(*mine, unsorted, schedule=schedule)
        check(f"block_sparse/{schedule}", out, lse, ref[0][:, :, lo:hi], ref[1][:, :, lo:hi], v, tokens)
    del q, k, v, mine
    prefix = 4 * tokens
    _, k, v = random_qkv(args.seed + 2, 1, heads_kv, prefix, args.head_dim, dtype, device)
    q = random_qkv(args.seed + 3, args.heads, 1, args.queries, args.head_dim, dtype, device)[0]
    lo, hi = sd.shard_bounds(prefix, w, args.page_size)[rank]
    shard = sd.PrefixShard(k[:, :, lo:hi], v[:, :, lo:hi], args.page_size)
    ref = sparsa.dense(q, k, v)
    out, lse = sd.prefix_attention(q, shard, method="dense")
    check("prefix/dense", out, lse, ref[0], ref[1], v, prefix)
    # The single-process QUEST of the core on the CPU (f32, the bf16 values widened exactly): its
    # plan over a PagedKVCache of the whole prefix, and its output.
    q32, k32, v32 = (x.float().cpu() for x in (q, k, v))
    cache = sparsa.PagedKVCache(heads_kv, args.head_dim, args.page_size)
    cache.append(k32.numpy(), v32.numpy())
    single = sparsa.quest_plan(q32.numpy(), cache, budget=args.budget)
    got = sd.quest_plan(q, shard, budget=args.budget)
    same = bool((got.pages.cpu().numpy() == single.pages).all()) and got.pages.shape == single.pages.shape
    rows.append(row(case="verify", method="quest_plan (equal plans)", gpus=w, tokens=prefix,
                    ok=gathered_max(0.0 if same else 1.0, None, device) == 0.0))
    ref = sparsa.quest(q32, k32, v32, budget=args.budget, page_size=args.page_size)
    out, lse = sd.prefix_attention(q, shard, method="quest", budget=args.budget)
    check("prefix/quest", out.cpu(), lse.cpu(), ref[0], ref[1], v32, prefix)
    # LoSA: three steps of one block (16 rows; 3 rows move a lot each step) against the core's
    # LosaState on the CPU over the whole prefix.
    block_rows = 16
    ref_state = sparsa.LosaState(args.heads, heads_kv, args.head_dim, block_size=block_rows, budget=args.budget)
    state = sd.LosaState(args.heads, heads_kv, args.head_dim, block_size=block_rows, budget=args.budget)
    g = torch.Generator().manual_seed(args.seed + 4)
    qs = torch.randn(1, args.heads, block_rows, args.head_dim, generator=g)
    same_rows = True
    for step in range(3):
        if step:
            qs = qs + 0.01 * torch.randn(qs.shape, generator=g)
            qs[:, :, torch.randperm(block_rows, generator=g)[:3]] += torch.randn(1, args.heads, 3, args.head_dim, generator=g)
        q_step = qs.to(dtype)
        kb, vb = (torch.randn(1, heads_kv, block_rows, args.head_dim, generator=g).to(dtype) for _ in range(2))
        ref = ref_state.step(cache, q_step.float().numpy(), kb.float().numpy(), vb.float().numpy())
        out, lse = state.step(shard, q_step.to(device), kb.to(device), vb.to(device))
        same_rows &= list(ref_state.stats["recomputed"]) == state.stats["recomputed"]
        check(f"losa/step{step}", out.cpu(), lse.cpu(), torch.from_numpy(ref[0]), torch.from_numpy(ref[1]),
              torch.cat([v32.flatten(), vb.float().flatten()]), prefix)
    rows.append(row(case="verify", method="losa (equal active rows)", gpus=w, tokens=prefix,
                    ok=gathered_max(0.0 if same_rows else 1.0, None, device) == 0.0))


def main():
    args = parse()
    device = setup(args)
    dtype = getattr(torch, args.dtype)
    rows = []
    {"ba_att": bench_ba_att, "prefix": bench_prefix, "verify": bench_verify}[args.case](args, device, dtype, rows)
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"# sparsa.distributed {args.case} on {dist.get_world_size()} x {name}, {args.dtype}, "
              f"heads {args.heads}/{args.kv_heads or ('8' if args.case != 'ba_att' else args.heads)}, d {args.head_dim}")
        for r in rows:
            print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        if args.case == "verify" and not all(r["ok"] for r in rows):
            print("verify: FAILED")
            dist.destroy_process_group()
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
