#!/usr/bin/env python3
"""sparsa's LLSA on the GPU side by side with dense attention and the peers, in one process.

bf16, batch 1, non-causal, the official kernel's shape by default: 16 heads, head_dim 64, block 16,
top-K 8, two levels. Rows per N:
  sparsa        sparsa.llsa / sparsa.llsa_backward on torch CUDA tensors (the plan built on the
                device inside the call: pooling, selection and the executor are all timed);
  official      the authors' Triton LLSA (llsa_l2: pooling, selection, attention; autograd for the
                backward), imported from a checkout given with --official (never part of sparsa);
  cudnn         SDPA with the cuDNN backend, dense;
  flex-fine     FlexAttention (torch.compile) over LLSA's fine-block mask (sparsa's own plan, no
                enrichment): the block-sparse part alone, at FlexAttention's 128-token tiles (every
                tile holding a selected block) with a mask_mod keeping the selected blocks' keys;
                timed in a child process of this script (--flex-only N), so a kernel fault there
                cannot take the other rows' CUDA context with it.
Every time is the median of CUDA-event-timed calls after warm-ups; sparsa and the official kernel
are timed in --rounds interleaved rounds (bench/cuda/rounds.py), each ratio the rounds' median.
TFLOP/s counts the keys each query actually visits (fine and pooled): forward 4 * H * N * keys *
D; forward+backward 3.5 times that (the backward recomputes S and computes dP, dQ, dK, dV). The
plan row times sparsa.llsa_plan (the device selection plus its copy back to the host, an upper
bound of selection's share).
--scale N: one forward+backward at N tokens (heads --scale-heads), with the device memory in use at
its peak (polled every 0.2 ms by a second thread; sparsa's scratch comes from its own stream-ordered
pool, not torch's allocator), minus what was in use before.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparsa
import rounds  # interleaved rounds: drift falls on every variant alike
from bench_attention import time_torch  # the same CUDA-event timing as the executor benchmark

CEILING = 790.0  # bf16 TFLOP/s measured on this H200 kind (8192^3 matmul)
# Bytes of the fine-block table the flex-fine row may build: at 256K (16 heads, block 16) the table
# has 2^32 entries and FlexAttention's kernel faulted with an illegal address (an H100, torch 2.11),
# so rows whose table passes 2^31 entries are skipped.
FLEX_TABLE_LIMIT = 2**31 - 1
FLEX_TILE = 128  # FlexAttention's tile (its BlockMask's block) for the flex-fine row


def flex_fine_mask(index, n, block, heads, device, tile=FLEX_TILE):
    """A FlexAttention BlockMask over LLSA's fine blocks (batch 1): every tile x tile block that
    holds a selected (query block, key block) pair is listed, and its mask_mod keeps the keys of
    the query's selected key blocks only."""
    from torch.nn.attention.flex_attention import BlockMask

    nb = -(-n // block)
    counts = torch.as_tensor(index.counts, device=device).reshape(heads, nb).long()
    picks = torch.as_tensor(index.indices, device=device).reshape(heads, nb, -1).long()
    valid = torch.arange(picks.shape[-1], device=device) < counts[..., None]
    h, qb, slot = valid.nonzero(as_tuple=True)
    kb = picks[h, qb, slot]
    selected = torch.zeros(heads, nb, nb, dtype=torch.bool, device=device)
    selected[h, qb, kb] = True
    # The tiles a block's tokens fall in (a block need not divide a tile): its first token, every
    # tile-th token after it and its last token, each clamped to the sequence.
    nt = -(-n // tile)
    offsets = list(range(0, block, tile)) + [block - 1]
    tiles = torch.zeros(heads, nt, nt, dtype=torch.bool, device=device)
    for oq in offsets:
        for ok in offsets:
            qt = torch.clamp(qb * block + oq, max=n - 1) // tile
            kt = torch.clamp(kb * block + ok, max=n - 1) // tile
            tiles[h, qt, kt] = True
    kv_num = tiles.sum(-1, dtype=torch.int32)[None]
    kv_idx = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)[None]

    def mask_mod(b, hh, qi, ki):
        return selected[hh, qi // block, ki // block]

    return BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=(n, n))


def child_row(argv, timeout_s):
    """Runs a peer's measurement in a child process and returns (row, None) from the JSON object
    its last line of output holds, or (None, why) where the child failed: a kernel that faults
    (an illegal address poisons the whole CUDA context) takes only its child down, not the
    benchmark."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"no answer in {timeout_s:.0f} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        try:
            return json.loads(lines[-1]), None
        except json.JSONDecodeError:
            pass
    tail = (done.stderr.strip().splitlines() or lines or ["no output"])[-1]
    return None, f"exit code {done.returncode}: {tail[:200]}"


def inputs(n, heads, dim, device):
    """The benchmark's Q, K, V and dO at N = n: the same tensors in every process."""
    torch.manual_seed(0)
    return [torch.randn(1, heads, n, dim, device=device, dtype=torch.bfloat16) for _ in range(4)]


def flex_fine_times(n, args, iters):
    """FlexAttention over the plan's fine-block mask: forward and forward+backward ms."""
    from torch.nn.attention.flex_attention import flex_attention

    dev = torch.device("cuda")
    q, k, v, do = inputs(n, args.heads, args.dim, dev)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    plan = sparsa.llsa_plan(q, k, block=args.block, topk=args.topk, levels=args.levels)
    mask = flex_fine_mask(plan["index"], n, args.block, args.heads, dev)
    flex = torch.compile(flex_attention, dynamic=False)

    def f_fwd():
        flex(q, k, v, block_mask=mask)

    def f_fb():
        flex(qg, kg, vg, block_mask=mask).backward(do)

    return time_ms(f_fwd, iters), time_ms(f_fb, iters)


RUNG_VAR = "SPARSA_LLSA_FORWARD_RUNG"
FINE_STEP_VAR = "SPARSA_LLSA_FINE_STEP"
RUNGS = ("1", "2", "3", "4", "2:64", "3:64", "4:64")


def forced_rung_ms(rung, fn, timer):
    """timer(fn) with sparsa's LLSA forward held to `rung` (SPARSA_LLSA_FORWARD_RUNG, read by the
    library at every call; "R:64" also takes the fine blocks in 64-key softmax steps,
    SPARSA_LLSA_FINE_STEP=64); the variables' earlier values (or their absence) are restored after."""
    number, _, fine = rung.partition(":")
    wanted = {RUNG_VAR: number, FINE_STEP_VAR: fine or None}
    before = {name: os.environ.get(name) for name in wanted}

    def put(values):
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    put(wanted)
    try:
        return timer(fn)
    finally:
        put(before)


def parse_rungs(text):
    """--forward-rungs: a comma-separated list of the forward's rungs (1, 2, 3, 4; 2:64, 3:64 and 4:64
    with the fine blocks in 64-key steps), at least two."""
    rungs = [r.strip() for r in text.split(",") if r.strip()]
    if len(rungs) < 2 or any(r not in RUNGS for r in rungs) or len(set(rungs)) != len(rungs):
        raise argparse.ArgumentTypeError(
            f"expected two or more distinct rungs of {', '.join(RUNGS)} (e.g. 2,3,3:64), got {text!r}")
    return rungs


def time_ms(fn, iters, warmup=2):
    return time_torch(fn, iters, warmup)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=[16384, 65536, 262144])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--levels", type=int, default=2)
    ap.add_argument("--official", default=None, help="path of the official LLSA checkout's src/ (a peer)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--scale", type=int, default=0, help="one forward+backward at this N (0: none)")
    ap.add_argument("--scale-heads", type=int, default=4)
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel times of one sparsa forward, then of one forward+backward")
    ap.add_argument("--rounds", type=int, default=3,
                    help="sparsa and the official kernel timed in this many interleaved rounds (median, range)")
    ap.add_argument("--forward-rungs", type=parse_rungs, default=None, metavar="R,R",
                    help="also time sparsa's forward held to each of these rungs (e.g. 2,3,3:64; R:64 with 64-key "
                         "fine steps) in interleaved rounds: the evidence for the coarsest level's path and the fine step")
    ap.add_argument("--flex-only", type=int, default=0, metavar="N",
                    help="(the child process of the flex-fine row) time FlexAttention at N, print one JSON line")
    ap.add_argument("--iters", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.flex_only:
        fwd, fb = flex_fine_times(args.flex_only, args, args.iters or 5)
        print(json.dumps({"fwd": fwd, "fb": fb}))
        return
    dev = torch.device("cuda")
    H, D, B, K, L = args.heads, args.dim, args.block, args.topk, args.levels
    kw = dict(block=B, topk=K, levels=L)
    official = None
    if args.official:
        try:
            sys.path.insert(0, args.official)
            from llsa.kernel.torch_op.flash_sparse_attention_res_2 import llsa_l2 as official_l2
            official = official_l2
        except Exception as e:  # noqa: BLE001 - report and go on without the peer
            print(f"official: not importable ({type(e).__name__}: {e})")
    print(f"LLSA on {torch.cuda.get_device_name()}: bf16, batch 1, heads {H}, head_dim {D}, block {B}, "
          f"top-K {K}, levels {L}; torch {torch.__version__}")
    print(f"{'N':>7} {'row':<10} {'fwd ms':>9} {'fwd+bwd ms':>11} {'x cuDNN fwd':>11} {'x cuDNN f+b':>11} "
          f"{'fwd TFLOP/s':>11} {'f+b TFLOP/s':>11} {'keys/query':>10}")
    for N in args.sizes:
        q, k, v, do = inputs(N, H, D, dev)
        iters = 20 if N <= 65536 else 5
        plan = sparsa.llsa_plan(q, k, **kw)
        kpq = plan["keys_per_query"]
        flops = 4.0 * H * N * kpq * D
        rows = {}
        out, lse = sparsa.llsa(q, k, v, **kw)

        def s_fwd():
            sparsa.llsa(q, k, v, **kw)

        def s_fb():
            o, l_ = sparsa.llsa(q, k, v, **kw)
            sparsa.llsa_backward(q, k, v, o, l_, do, **kw)

        sparsa_fns = (s_fwd, s_fb)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            # The forward alone first (its pooling, selection, dense coarsest level and row-wise
            # kernel), then forward+backward (the backward builds its plan again).
            for what, fn in (("forward", s_fwd), ("forward+backward", s_fb)):
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    fn()
                    torch.cuda.synchronize()
                try:
                    table = prof.key_averages().table(sort_by="device_time_total", row_limit=14)
                except Exception:  # noqa: BLE001 - older torch names it cuda_time_total
                    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14)
                print(f"{N:>7} sparsa {what}, per kernel:")
                print("\n".join(line[:160] for line in table.splitlines()))
        plan_ms = time_ms(lambda: sparsa.llsa_plan(q, k, **kw), iters)

        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        c_iters = iters if N <= 65536 else 2
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            def c_fwd():
                F.scaled_dot_product_attention(q, k, v)

            def c_fb():
                F.scaled_dot_product_attention(qg, kg, vg).backward(do)

            rows["cudnn"] = (time_ms(c_fwd, c_iters, warmup=1), time_ms(c_fb, c_iters, warmup=1), N)
        official_fns = None
        if official is not None:
            try:
                o_off = official(q, k, v, K, K, B)
                print(f"{N:>7} official vs sparsa output: rel diff {rel(out, o_off):.3g}")

                def o_fwd():
                    official(q, k, v, K, K, B)

                def o_fb():
                    official(qg, kg, vg, K, K, B).backward(do)

                o_fb()  # a backward that fails is reported here, not inside the timed rounds
                official_fns = (o_fwd, o_fb)
            except Exception as e:  # noqa: BLE001
                print(f"{N:>7} official: failed ({type(e).__name__}: {str(e)[:200]})")
        # The official kernel's times moved by up to 30% between calls (clocks, the Triton kernel's
        # first-call tuning), so sparsa and it are timed in interleaved rounds (bench/cuda/rounds.py):
        # each row is its median over the rounds, each ratio the median of the rounds' own ratios.
        summary = {}
        for part, at in (("fwd", 0), ("f+b", 1)):
            variants = [("sparsa", sparsa_fns[at])] + ([("official", official_fns[at])] if official_fns else [])
            times = rounds.interleaved(variants, max(1, args.rounds), lambda fn: time_ms(fn, iters))
            summary[part] = rounds.summarise(times, "official" if official_fns else "sparsa")
        rows["sparsa"] = (summary["fwd"]["sparsa"]["ms"], summary["f+b"]["sparsa"]["ms"], kpq)
        if official_fns:
            rows["official"] = (summary["fwd"]["official"]["ms"], summary["f+b"]["official"]["ms"], float("nan"))
        # FlexAttention cannot take LLSA's 16-token blocks as its own (its tiles must divide the
        # BlockMask's blocks, and asked for 16-token tiles its compiler finds no kernel), so the
        # peer is FlexAttention at its 128-token tiles over every tile that holds a selected fine
        # block, with a mask_mod that keeps exactly the selected fine blocks' keys: what a general
        # block-sparse kernel does with this mask. Its lookup table is H x (N / B)^2 bytes.
        table_bytes = H * (-(-N // B)) ** 2
        if not args.no_flex and table_bytes > FLEX_TABLE_LIMIT:
            print(f"{N:>7} flex-fine: skipped (its fine-block table would take {table_bytes / 2**30:.0f} GiB, "
                  f"past 2^31 entries)")
        elif not args.no_flex:
            # In a child process: a kernel that faults with an illegal address (FlexAttention's did
            # at 256K) leaves its process's CUDA context unusable for the rows after it.
            argv = [sys.executable, __file__, "--flex-only", str(N), "--iters", str(iters), "--heads", str(H),
                    "--dim", str(D), "--block", str(B), "--topk", str(K), "--levels", str(L)]
            row, why = child_row(argv, timeout_s=900)
            if row:
                rows["flex-fine"] = (row["fwd"], row["fb"], K * B)
            else:
                print(f"{N:>7} flex-fine: failed in its child process ({why})")
        cf, cb, _ = rows["cudnn"]
        for name in sorted(rows, key=["sparsa", "cudnn", "official", "flex-fine"].index):
            f, b, keys = rows[name]
            kf = 4.0 * H * N * keys * D if keys == keys else float("nan")
            print(f"{N:>7} {name:<10} {f:>9.3f} {b:>11.3f} {cf / f:>11.2f} {cb / b:>11.2f} "
                  f"{kf / f / 1e9:>11.1f} {3.5 * kf / b / 1e9:>11.1f} {keys:>10.0f}")
        sf = rows["sparsa"][0]
        print(f"{N:>7} plan (device selection + copy back) {plan_ms:.3f} ms = {plan_ms / sf:.0%} of the forward; "
              f"sparsa forward at {flops / sf / 1e9 / CEILING:.1%} of the {CEILING:.0f} TFLOP/s ceiling")
        if "official" in rows:
            f_, b_ = summary["fwd"]["sparsa"], summary["f+b"]["sparsa"]
            of_, ob_ = summary["fwd"]["official"], summary["f+b"]["official"]
            print(f"{N:>7} sparsa vs official: forward {f_['speed']:.2f}x ({f_['speed_min']:.2f}-{f_['speed_max']:.2f}), "
                  f"forward+backward {b_['speed']:.2f}x ({b_['speed_min']:.2f}-{b_['speed_max']:.2f}) over "
                  f"{max(1, args.rounds)} interleaved rounds; official fwd {of_['ms_min']:.3f}-{of_['ms_max']:.3f} ms, "
                  f"f+b {ob_['ms_min']:.3f}-{ob_['ms_max']:.3f} ms")
        if args.forward_rungs:
            # Which rung is faster moves with N (the coarsest level's length); the rows of one
            # process differ by a few percent between runs, so they are timed in alternation.
            n_rounds = max(3, args.rounds)
            times = rounds.interleaved([(f"rung {r}", r) for r in args.forward_rungs], n_rounds,
                                       lambda r: forced_rung_ms(r, s_fwd, lambda fn: time_ms(fn, iters)))
            base = f"rung {args.forward_rungs[0]}"
            for line in rounds.table(rounds.summarise(times, base), base,
                                     f"{N:>7} sparsa forward held to each rung ({RUNG_VAR}), {n_rounds} interleaved rounds"):
                print(line)
        del q, k, v, do, qg, kg, vg, out, lse
        torch.cuda.empty_cache()

    if args.scale:
        N, Hs = args.scale, args.scale_heads
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        q, k, v, do = (torch.randn(1, Hs, N, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
        torch.cuda.synchronize()
        free0, total = torch.cuda.mem_get_info()
        peak = [0]
        done = threading.Event()

        def poll():
            while not done.is_set():
                free, _ = torch.cuda.mem_get_info()
                peak[0] = max(peak[0], free0 - free)
                time.sleep(0.0002)

        th = threading.Thread(target=poll)
        th.start()
        t0 = time.perf_counter()
        o, l_ = sparsa.llsa(q, k, v, **dict(kw, levels=-1))
        dq, dk, dv = sparsa.llsa_backward(q, k, v, o, l_, do, **dict(kw, levels=-1))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        done.set()
        th.join()
        input_bytes = 4 * q.numel() * 2
        print(f"scale: N {N}, heads {Hs}, d {D}, levels auto: forward+backward {wall * 1e3:.1f} ms (first call, wall); "
              f"peak device memory beyond the inputs {peak[0] / 2**30:.2f} GiB (inputs q,k,v,dO {input_bytes / 2**30:.2f} GiB), "
              f"finite: {bool(torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all())}")
        fb = time_ms(lambda: sparsa.llsa_backward(q, k, v, o, l_, do, **dict(kw, levels=-1)), 3, warmup=1)
        ff = time_ms(lambda: sparsa.llsa(q, k, v, **dict(kw, levels=-1)), 3, warmup=1)
        print(f"scale: forward {ff:.1f} ms, backward {fb:.1f} ms (medians of 3)")


if __name__ == "__main__":
    main()
