#!/usr/bin/env python3
"""The CPU block selectors' cost side by side: XAttention's and BA-Att's plans (selection only, no
attention) on random f32 Q/K of one shape, best of --repeats calls, with and without a
block-causal mask (mask_aware: only the visible key blocks are scored and chosen).

Default shape: the shipped model's (models/sparsa-sdar-ruler: 6 query heads over 2 kv heads,
head_dim 64) at 8K tokens; blocks of 64, XAttention stride 8, density 0.1, BA-Att without the
norm sort (as the engine's block-causal prefill runs it).

    PYTHONPATH=build/python python3 bench/python/bench_selectors.py [--len 8192] [--threads 2]
"""
import argparse
import time

import numpy as np

import sparsa


def best_of(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--len", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--stride", type=int, default=8)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, a.heads, a.len, a.dim), dtype=np.float32)
    k = rng.standard_normal((1, a.kv_heads, a.len, a.dim), dtype=np.float32)
    common = dict(block_q=a.block, block_kv=a.block, density=a.density, backend="cpu", num_threads=a.threads)
    print(f"{a.len} tokens, {a.heads}/{a.kv_heads} heads, head_dim {a.dim}, blocks of {a.block}, density {a.density}, "
          f"threads {a.threads or 'all'}; best of {a.repeats} (s)")
    for label, mask in (("no mask", {}), ("block_causal(16), mask_aware", dict(mask="block_causal(16)",
                                                                                mask_aware=True))):
        x = best_of(lambda: sparsa.xattention_plan(q, k, stride=a.stride, **common, **mask), a.repeats)
        b = best_of(lambda: sparsa.ba_att_plan(q, k, sort_q=False, sort_k=False, **common, **mask), a.repeats)
        print(f"{label:<30} xattention {x:.4f}   ba_att (unsorted) {b:.4f}")


if __name__ == "__main__":
    main()
