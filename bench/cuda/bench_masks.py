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
Varlen rows (--varlen): 16 sequences of lengths spread over 1K-16K (seeded), causal and
unmasked, in one sparsa.dense_varlen call against the sum of the per-sequence dense calls' times
(the "separate calls' ideal": each sequence alone on the GPU, no padding), and against SDPA cuDNN
on each sequence alone (summed). The varlen call reads its offsets back once (inside its time).
"""
import argparse
import random

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention import flex_attention as flex

import sparsa
import sparsa.torch as st
from bench_attention import CEILING, time_torch as time_cuda  # this folder's: the same timing and ceiling
import rounds  # this folder's: variants timed in interleaved rounds


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
    ap.add_argument("--varlen", action="store_true", help="also the variable-length rows (16 sequences of 1K-16K)")
    ap.add_argument("--causal-parts", action="store_true",
                    help="also the rows that take the causal call apart (causal_parts: its tiles without the mask, "
                         "the masked kernel over nearly every tile)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="> 0: each row's first peer and sparsa again in this many interleaved rounds (rounds.py): "
                         "the median and range of the per-round ratios")
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
                for name, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
                                      ("SDPA flash", SDPBackend.FLASH_ATTENTION)):
                    def fn(backend=backend):
                        with sdpa_kernel([backend]):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    try:
                        ref = fn()
                        peers.append((name, time_cuda(fn, args.iters), ref, fn))
                    except RuntimeError as e:
                        print(f"{n:>7} {label:<22} {name}: refused ({str(e).splitlines()[0][:100]})")
            else:
                sparsa_mask_mod = st.mask_mod(mask, n, n)
                # _compile: the mask built block by block (uncompiled, it materialises n x n
                # booleans: 128 GiB at 128K)
                bm = flex.create_block_mask(sparsa_mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device="cuda",
                                            _compile=True)
                fn = lambda: flex_compiled(q, k, v, block_mask=bm)
                ref = fn()
                peers.append(("FlexAttention", time_cuda(fn, args.iters), ref, fn))
            for name, t_peer, ref, _ in peers:
                print(f"{n:>7} {label:<22} {t_ours:>9.3f} {name:<14} {t_peer:>9.3f} {t_peer / t_ours:>7.2f}x "
                      f"{flops / t_ours / 1e9:>8.1f} {flops / t_ours / 1e9 / CEILING:>7.1%} {rel_err(ours, ref):>9.2e}",
                      flush=True)
            if args.rounds > 0 and peers:
                name, _, _, peer_fn = peers[0]
                r = rounds.summarise(rounds.interleaved([(name, peer_fn), ("sparsa", ours_fn)], args.rounds,
                                                        lambda f: time_cuda(f, args.iters)), name)["sparsa"]
                print(f"{n:>7} {label:<22} {args.rounds} interleaved rounds: {name} / sparsa {r['speed']:.3f}x "
                      f"(range {r['speed_min']:.3f}-{r['speed_max']:.3f}), sparsa {r['ms']:.3f} ms", flush=True)
            del ours
        if args.causal_parts:
            causal_parts(q, k, v, args.iters)
        del q, k, v
        torch.cuda.empty_cache()
    if args.varlen:
        varlen_rows(H, D, args.iters)


def causal_parts(q, k, v, iters, tile=128):
    """Where a causal call's time goes beyond half the unmasked call's (each row against the same run's
    unmasked call, as a fraction of its time; the causal tiles are about half the pairs):
      causal                  the dense causal call (masked kernel, query tiles longest first)
      causal tiles, no mask   the block-sparse kernel over exactly the causal call's key tiles (query
                              tile i visits key tiles 0..i, of `tile` keys), no per-element mask: the
                              cost of the structure (shorter CTAs, launch order) alone
      same, causal mask       the same plan with the causal mask (the masked block-sparse kernel; its
                              output is the causal call's, and its error against it is printed)
      masked, window n - tile the masked kernel over all but the corner tiles (a symmetric window of
                              n - tile keys): the per-tile cost of the masked kernel against the unmasked one
    """
    H, n = int(q.shape[1]), int(q.shape[2])
    nb = -(-n // tile)
    counts = torch.arange(1, nb + 1, device=q.device, dtype=torch.int32).expand(1, H, nb).contiguous()
    indices = torch.arange(nb, device=q.device, dtype=torch.int32).expand(1, H, nb, nb).contiguous()
    plan = st.block_index(tile, tile, counts, indices)
    causal = lambda: st.dense(q, k, v, mask="causal")
    masked_plan = lambda: st.block_sparse(q, k, v, plan, check_index=False, mask="causal")
    cases = [("causal", causal),
             ("causal tiles, no mask", lambda: st.block_sparse(q, k, v, plan, check_index=False)),
             ("same, causal mask", masked_plan),
             (f"masked, window {n - tile}", lambda: st.dense(q, k, v, mask=("sliding_window", n - tile)))]
    t_none = time_cuda(lambda: st.dense(q, k, v), iters)
    print(f"{n:>7} causal parts (unmasked call {t_none:.3f} ms; tiles of {tile}: the causal tiles are "
          f"{(nb + 1) / (2 * nb):.3f} of its tiles)")
    for label, fn in cases:
        t = time_cuda(fn, iters)
        err = f"{rel_err(fn()[0], causal()[0]):.1e} vs causal" if fn is masked_plan else ""
        print(f"{n:>7}   {label:<26} {t:>9.3f} ms  {t / t_none:>6.3f} of unmasked  {err}", flush=True)


def varlen_rows(H, D, iters):
    """One varlen call over 16 sequences of 1K-16K tokens against the sum of separate calls."""
    rng = random.Random(0)
    lens = sorted(rng.randint(1024, 16384) for _ in range(16))
    total = sum(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    print(f"varlen: 16 sequences, lengths {lens[0]}..{lens[-1]}, total {total} tokens, {H} heads, head_dim {D}")
    torch.manual_seed(1)
    q, k, v = (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    # per-sequence [1, H, n, D] copies for the separate calls
    seqs = [tuple(x[cu[i]:cu[i + 1]].transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
            for i in range(len(lens))]
    print(f"{'mask':<8} {'varlen ms':>10} {'separate ms':>12} {'varlen/sep':>11} {'cuDNN sep ms':>13} "
          f"{'vs cuDNN':>9} {'TFLOP/s':>8}")
    for label, mask in (("none", None), ("causal", "causal")):
        pairs = sum(n * n if mask is None else n * (n + 1) / 2 for n in lens)
        flops = 4.0 * H * D * pairs
        t_var = time_cuda(lambda: sparsa.dense_varlen(q, k, v, cu_t, cu_t, mask=mask, backend="cuda"), iters)
        t_sep = sum(time_cuda(lambda s=s: st.dense(*s, mask=mask), iters) for s in seqs)

        def cudnn(s):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(*s, is_causal=mask is not None)
        t_cudnn = sum(time_cuda(lambda s=s: cudnn(s), iters) for s in seqs)
        out, _ = sparsa.dense_varlen(q, k, v, cu_t, cu_t, mask=mask, backend="cuda")
        worst = max(rel_err(out[cu[i]:cu[i + 1]].transpose(0, 1).unsqueeze(0), st.dense(*seqs[i], mask=mask)[0])
                    for i in range(len(lens)))
        print(f"{label:<8} {t_var:>10.3f} {t_sep:>12.3f} {t_var / t_sep:>10.3f}x {t_cudnn:>13.3f} "
              f"{t_cudnn / t_var:>8.2f}x {flops / t_var / 1e9:>8.1f}   (worst per-sequence rel err vs separate "
              f"{worst:.1e})", flush=True)


if __name__ == "__main__":
    main()
