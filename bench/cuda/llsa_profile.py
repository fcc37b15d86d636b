#!/usr/bin/env python3
"""One LLSA forward and backward on the GPU (bf16, heads 16, d 64, block 16, top-K 8, two levels), for a
kernel profiler: ncu --kernel-name regex:llsa python3 bench/cuda/llsa_profile.py [N]."""
import sys

import torch

import sparsa

N = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
q, k, v, do = (torch.randn(1, 16, N, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
kw = dict(block=16, topk=8, levels=2)
out, lse = sparsa.llsa(q, k, v, **kw)
sparsa.llsa_backward(q, k, v, out, lse, do, **kw)
torch.cuda.synchronize()
