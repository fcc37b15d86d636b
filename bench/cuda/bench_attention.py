#!/usr/bin/env python3
"""sparsa's cuda executors side by side with PyTorch's, in one process, on the same tensors.

bf16, batch 1, 32 heads, head_dim 128, non-causal. Peers: SDPA with the cuDNN and flash (FA2)
backends, FlexAttention (torch.compile) dense and on the same block mask as sparsa's block-sparse
executor (random 128x128 blocks, a fraction `keep` per query block, diagonal forced).
Every time is the median of many CUDA-event-timed calls after warm-ups; sparsa is called
through a C ABI shim (bench_shim.cpp) and timed with CUDA events inside it.
FLOPs: 4 * H * N^2 * D dense; sparse: 4 * D * (visited query-key pairs).
"""
import argparse
import ctypes
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CEILING = 790.0  # bf16 TFLOP/s measured on this H200 kind (8192^3 matmul, random data)


def time_torch(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


class Sparsa:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        f = self.lib.sparsa_bench_attention
        i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        f.argtypes = [vp, vp, vp, vp, vp, i32, i64, i64, i64, i64, i64, i64, vp, vp, i64, i32, i32, i32, i32,
                      ctypes.POINTER(ctypes.c_float), ctypes.c_char_p, i32]
        f.restype = i32

    def run(self, q, k, v, out, lse, counts=None, indices=None, block=128, warmup=3, iters=0):
        ms = ctypes.c_float(float("nan"))
        err = ctypes.create_string_buffer(1024)
        B, H, N, D = q.shape
        rc = self.lib.sparsa_bench_attention(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), int(q.dtype == torch.float16),
            B, H, k.shape[1], N, k.shape[2], D,
            counts.data_ptr() if counts is not None else None, indices.data_ptr() if indices is not None else None,
            indices.shape[-1] if indices is not None else 0, block, block, warmup, iters, ctypes.byref(ms), err,
            len(err))
        if rc != 0:
            raise RuntimeError(err.value.decode())
        return ms.value


def random_block_mask(H, nb, keep, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mask = torch.rand(1, H, nb, nb, device="cuda", generator=g) < keep
    eye = torch.eye(nb, dtype=torch.bool, device="cuda")
    mask |= eye
    counts = mask.sum(-1).to(torch.int32).contiguous()
    # Kept blocks first, ascending (a stable sort of "not kept").
    indices = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32).contiguous()
    return mask, counts, indices


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--keep", type=float, default=0.1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    sp = Sparsa(args.lib)
    H, D, blk = 32, 128, 128
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}")
    rows = []
    for N in args.sizes:
        iters = 30 if N <= 8192 else 12
        torch.manual_seed(N)
        q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(1, H, N, device="cuda", dtype=torch.float32)
        dense_flops = 4.0 * H * N * N * D
        nb = (N + blk - 1) // blk
        mask, counts, indices = random_block_mask(H, nb, args.keep, seed=N + 1)
        density = mask.float().mean().item()
        sparse_flops = dense_flops * density

        res = {}
        # Correctness in the same run: sparsa dense vs cuDNN, sparsa sparse vs Flex on the same mask.
        sp.run(q, k, v, out, lse, warmup=1)
        torch.cuda.synchronize()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ref = F.scaled_dot_product_attention(q, k, v)
        res["err_dense_vs_cudnn"] = rel_err(out, ref)
        res["sparsa_dense"] = sp.run(q, k, v, out, lse, iters=iters)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            res["cudnn"] = time_torch(lambda: F.scaled_dot_product_attention(q, k, v), iters)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            res["fa2"] = time_torch(lambda: F.scaled_dot_product_attention(q, k, v), iters)
        res["flex_dense"] = time_torch(lambda: flex(q, k, v), iters)
        del ref

        sp.run(q, k, v, out, lse, counts, indices, warmup=1)
        torch.cuda.synchronize()
        zeros_n = torch.zeros_like(counts)
        zeros_i = torch.zeros_like(indices)
        try:  # every kept block is a full block: no per-element mask_mod work for Flex
            bm = BlockMask.from_kv_blocks(kv_num_blocks=zeros_n, kv_indices=zeros_i, full_kv_num_blocks=counts,
                                          full_kv_indices=indices, BLOCK_SIZE=blk)
        except Exception as e:  # older/newer signatures: build it from the same block table
            print(f"from_kv_blocks failed ({e}); using create_block_mask", flush=True)
            from torch.nn.attention.flex_attention import create_block_mask
            m = mask
            bm = create_block_mask(lambda b, h, qi, ki: m[b, h, qi // blk, ki // blk], 1, H, N, N,
                                   BLOCK_SIZE=blk, _compile=True)
        ref = flex(q, k, v, block_mask=bm)
        res["err_sparse_vs_flex"] = rel_err(out, ref)
        res["sparsa_sparse"] = sp.run(q, k, v, out, lse, counts, indices, iters=iters * 3)
        res["flex_sparse"] = time_torch(lambda: flex(q, k, v, block_mask=bm), iters * 3)
        res.update(N=N, density=density, dense_flops=dense_flops, sparse_flops=sparse_flops)
        rows.append(res)
        print(json.dumps(res), flush=True)
        del q, k, v, out, lse, ref, bm
        torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)

    tf = lambda flops, ms: flops / ms / 1e9
    print()
    print(f"{'N':>6} {'kernel':<22} {'ms':>9} {'TFLOP/s':>8} {'of 790':>7}")
    for r in rows:
        N = r["N"]
        for name, key, flops in [("sparsa dense", "sparsa_dense", r["dense_flops"]),
                                 ("SDPA cuDNN", "cudnn", r["dense_flops"]),
                                 ("SDPA flash (FA2)", "fa2", r["dense_flops"]),
                                 ("Flex dense", "flex_dense", r["dense_flops"]),
                                 (f"sparsa sparse {r['density']:.3f}", "sparsa_sparse", r["sparse_flops"]),
                                 (f"Flex sparse {r['density']:.3f}", "flex_sparse", r["sparse_flops"])]:
            t = tf(flops, r[key])
            print(f"{N:>6} {name:<22} {r[key]:>9.3f} {t:>8.1f} {t / CEILING:>7.1%}")
        print(f"{N:>6} sparsa dense / cuDNN speed      {r['cudnn'] / r['sparsa_dense']:.3f}x   (target >= 0.55)")
        print(f"{N:>6} sparsa dense / FA2 speed        {r['fa2'] / r['sparsa_dense']:.3f}x")
        print(f"{N:>6} sparsa dense / Flex dense speed {r['flex_dense'] / r['sparsa_dense']:.3f}x")
        print(f"{N:>6} sparsa sparse / Flex sparse spd {r['flex_sparse'] / r['sparsa_sparse']:.3f}x   (target > 1)")
        print(f"{N:>6} sparsa sparse time / dense time {r['sparsa_sparse'] / r['sparsa_dense']:.3f}    (target <= 0.13 at 32K)")
        print(f"{N:>6} rel err: dense vs cuDNN {r['err_dense_vs_cudnn']:.2e}, sparse vs Flex {r['err_sparse_vs_flex']:.2e}")


if __name__ == "__main__":
    sys.exit(main())
