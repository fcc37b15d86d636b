#!/usr/bin/env python3
"""One dense call of each of flash rung 3's consumer schedules (with 128- and 176-key tiles) and one
of SDPA's cuDNN backend, on the same tensors, with nothing else launched: the program that Nsight
Compute profiles (scripts/gpu-check --flash with FLASH_PROFILE=1), so that the kernels' counters
(tensor-pipe activity, issue slots, warp stalls) sit side by side in one report.

bf16, batch 1, 32 heads, head_dim 128, non-causal, N tokens (default 16384).
  python3 bench/cuda/flash_profile.py --lib build-gpu/bench/cuda/libsparsa_bench_shim.so
"""
import argparse
import ctypes

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_attention import SCHEDULES, Sparsa  # the same directory


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--schedules", type=int, nargs="+", default=list(SCHEDULES.keys()))
    ap.add_argument("--tiles", type=int, nargs="+", default=[128, 176], help="dense key tiles (128, 176)")
    args = ap.parse_args()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 32, args.n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(1, 32, args.n, device="cuda", dtype=torch.float32)
    sp = Sparsa(args.lib)
    lib = ctypes.CDLL(args.lib)
    for tile in args.tiles:
        lib.sparsa_bench_set_flash_dense_key_tile(tile)
        for sched in args.schedules:
            lib.sparsa_bench_set_flash_schedule(sched)
            sp.run(q, k, v, out, lse, warmup=0, iters=0)  # one launch
            torch.cuda.synchronize()
            print(f"sparsa {SCHEDULES[sched]}, {tile}-key tiles: done")
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ref = F.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"cudnn: done (rel err of the last sparsa schedule against it {err:.2e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
