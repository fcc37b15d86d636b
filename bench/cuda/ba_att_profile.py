#!/usr/bin/env python3
"""Where BA-Att's time goes on the GPU: one ba_att_plan call under torch.profiler (CUDA time per
kernel), then block_sparse on that plan with its permutations (the gathers in the executor) and
on the same block lists without them (contiguous tokens), and torch's dense SDPA (cuDNN) for scale.

Run with the Python package on the path (PYTHONPATH=<build>/python):
  python3 bench/cuda/ba_att_profile.py [--n 131072] [--density 0.1]
"""
import argparse
import dataclasses

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparsa
from bench_attention import time_torch  # the same directory: one timing loop for both


def time_ms(fn, iters=5, warmup=2):
    return time_torch(fn, iters, warmup=warmup)


def timeline(fn):
    """One call's device timeline (kernels, memsets, copies in start order, with the idle gap before
    each) and its runtime API calls, from a chrome trace of torch.profiler (CPU + CUDA activity):
    where the wall time of a call goes beyond its kernels' time."""
    import json
    import os
    import tempfile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                    key=lambda e: e["ts"])
    api = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"), key=lambda e: e["ts"])
    if not device or not api:
        print("timeline: no device or runtime events in the trace")
        return
    t0 = api[0]["ts"]
    print(f"device timeline (us from the first runtime call; gap = idle time before the event):")
    end = None
    for e in device:
        gap = e["ts"] - end if end is not None else e["ts"] - t0
        print(f"  start {e['ts'] - t0:9.1f}  dur {e['dur']:8.1f}  gap {gap:7.1f}  {e['name'][:70]}")
        end = max(end or 0, e["ts"] + e["dur"])
    print(f"  last device event ends at {end - t0:.1f} us; runtime calls span {api[-1]['ts'] + api[-1]['dur'] - t0:.1f} us")
    print("runtime calls (us from the first; calls over 5 us, or the first 40):")
    for i, e in enumerate(api):
        if e["dur"] > 5 or i < 40:
            print(f"  at {e['ts'] - t0:9.1f}  dur {e['dur']:8.1f}  {e['name']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--density", type=float, nargs="+", default=[0.1, 0.5])
    args = ap.parse_args()
    torch.manual_seed(0)
    shape = (1, args.heads, args.n, 128)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for density in args.density:
        plan_fn = lambda: sparsa.ba_att_plan(q, k, block_q=128, block_kv=128, density=density, backend="cuda")
        plan = plan_fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            plan_fn()
            torch.cuda.synchronize()
        print(f"\nN={args.n} density={density}: ba_att_plan kernels (one call)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        timeline(plan_fn)
        select = time_ms(plan_fn)
        no_perm = dataclasses.replace(plan, perm_q=None, perm_kv=None)
        # Both trusted (check_index=False, as ba_att does): the device check of the permutations
        # would otherwise count against the permuted run only.
        with_perm = time_ms(lambda: sparsa.block_sparse(q, k, v, plan, backend="cuda", check_index=False))
        without = time_ms(lambda: sparsa.block_sparse(q, k, v, no_perm, backend="cuda", check_index=False))
        print(f"select {select:.3f} ms; executor with perms {with_perm:.3f} ms, same blocks without perms "
              f"{without:.3f} ms ({with_perm / without:.3f}x)")
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        dense = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), iters=3)
    print(f"SDPA cuDNN dense {dense:.3f} ms")


if __name__ == "__main__":
    main()
