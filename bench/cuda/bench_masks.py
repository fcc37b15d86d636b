#!/usr/bin/env python3
"""sparsa's masked flash executor beside PyTorch's masked attention, in one process, on the same tensors.

bf16, batch 1, 32 heads, head_dim 128 (both settable). Rows:
  none                 sparsa dense vs SDPA cuDNN and flash (the unmasked baseline of the same run)
  causal               sparsa mask="causal" vs SDPA cuDNN and flash with is_causal=True
  block_causal(16)     sparsa vs FlexAttention (torch.compile) with the same mask_mod and BlockMask
  sliding_window(W,0)  sparsa vs FlexAttention likewise (a causal window of W keys)
sparsa is called through sparsa.torch (zero-copy torch CUDA tensors; the call's Python overhead,
tens of microseconds, is inside its time). Every time is the median of CUDA-event-timed calls after
warm-ups. TFLOP/s counts the visible query-key pairs only (4 * H * D * pairs): a mask that hides
half the pairs does half the work. Ceiling: 790 bf16 TFLOP/s (an 8192^3 matmul on this H200 kind).
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention import flex_attention as flex

import sparsa.torch as st

CEILING = 790.0


def time_cuda(fn, iters, warmup=3):
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


def visible_pairs(kind, n, arg):
    """Visible (query, key) pairs of an n x n mask (queries and keys aligned)."""
    i = torch.arange(n, dtype=torch.float64)
    if kind == "none":
        return float(n) * n
    if kind == "causal":
        return float((i + 1).sum())
    if kind == "block_causal":
        return float(torch.clamp((torch.div(i, arg, rounding_mode="floor") + 1) * arg, max=n).sum())
    if kind == "window":  # causal window: keys i - arg .. i
        return float((i - torch.clamp(i - arg, min=0) + 1).sum())
    raise ValueError(kind)


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=16, help="block_causal's block")
    ap.add_argument("--window", type=int, default=4096, help="the causal sliding window's keys")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    H, D = args.heads, args.dim
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}")
    print(f"bf16, batch 1, {H} heads, head_dim {D}; medians of {args.iters} CUDA-event-timed calls (ms)")
    flex_compiled = torch.compile(flex.flex_attention, dynamic=False)
    print(f"{'N':>7} {'mask':<22} {'sparsa':>9} {'peer':<14} {'peer ms':>9} {'vs peer':>8} {'TFLOP/s':>8} "
          f"{'ceiling':>8} {'rel err':>9}")
    for n in args.sizes:
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        rows = [("none", None, "none", 0), ("causal", "causal", "causal", 0),
                (f"block_causal({args.block})", ("block_causal", args.block), "block_causal", args.block),
                (f"sliding_window({args.window},0)", ("sliding_window", args.window, 0), "window", args.window)]
        for label, mask, kind, arg in rows:
            pairs = visible_pairs(kind, n, arg)
            flops = 4.0 * H * D * pairs
            ours_fn = lambda: st.dense(q, k, v, mask=mask)
            ours = ours_fn()[0]
            t_ours = time_cuda(ours_fn, args.iters)
            peers = []
            if kind in ("none", "causal"):
                causal = kind == "causal"
                for name, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA flash", SDPBackend.FLASH_ATTENTION)):
                    def fn(backend=backend):
                        with sdpa_kernel([backend]):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    try:
                        ref = fn()
                        peers.append((name, time_cuda(fn, args.iters), ref))
                    except RuntimeError as e:
                        print(f"{n:>7} {label:<22} {name}: refused ({str(e).splitlines()[0][:100]})")
            else:
                sparsa_mask_mod = st.mask_mod(mask, n, n)
                bm = flex.create_block_mask(sparsa_mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device="cuda")
                fn = lambda: flex_compiled(q, k, v, block_mask=bm)
                ref = fn()
                peers.append(("FlexAttention", time_cuda(fn, args.iters), ref))
            for name, t_peer, ref in peers:
                print(f"{n:>7} {label:<22} {t_ours:>9.3f} {name:<14} {t_peer:>9.3f} {t_peer / t_ours:>7.2f}x "
                      f"{flops / t_ours / 1e9:>8.1f} {flops / t_ours / 1e9 / CEILING:>7.1%} {rel_err(ours, ref):>9.2e}",
                      flush=True)
            del ours
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
