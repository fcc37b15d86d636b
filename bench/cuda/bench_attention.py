#!/usr/bin/env python3
"""sparsa's cuda executors side by side with PyTorch's, in one process, on the same tensors.

bf16, batch 1, 32 heads, head_dim 128, non-causal. Peers: SDPA with the cuDNN and flash (FA2)
backends, FlexAttention (torch.compile) dense and on the same block mask as sparsa's block-sparse
executor (random 128x128 blocks, a fraction `keep` per query block, diagonal forced).
Every time is the median of many CUDA-event-timed calls after warm-ups; sparsa is called
through a C ABI shim (bench_shim.cpp) and timed with CUDA events inside it.
FLOPs: 4 * H * N^2 * D dense; sparse: 4 * D * (visited query-key pairs).

Prefix rows (--prefix-sizes): the block-diffusion shape, 16 queries, 32 query heads over 8 kv heads
(GQA), head_dim 128, bf16, against a KV of each length; sparsa's split-KV executor (taken by the
cuda backend's dense call when len_q <= 64) vs SDPA flash and cuDNN on the same tensors (GQA
through enable_gqa; a backend that refuses it gets K/V expanded to 32 heads, and the row says so).
These kernels take tens of microseconds, so each time is the median over samples of a loop of
back-to-back calls between two events, divided by the loop length. Effective bandwidth counts the
K and V bytes of the 8 kv heads once (2 * 8 * L * 128 * 2 bytes) over that time; K+V is 134 MB at
32K and 268 MB at 64K, beyond the 60 MB L2, so the loop does not run from cache.
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

import rounds  # bench/cuda/rounds.py: variants timed in interleaved rounds

CEILING = 790.0  # bf16 TFLOP/s measured on this H200 kind (8192^3 matmul, random data)
# Flash rung 3's consumer schedules (sparsa_bench_set_flash_schedule; flash_tma_kernel.cuh).
SCHEDULES = {0: "plain", 1: "pingpong", 2: "overlap", 3: "late"}


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


class SparsaLoop:
    def __init__(self, lib):
        f = lib.sparsa_bench_dense_loop
        i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        f.argtypes = [vp, vp, vp, vp, vp, i32, i64, i64, i64, i64, i64, i64, i32, i32, i32,
                      ctypes.POINTER(ctypes.c_float), ctypes.c_char_p, i32]
        f.restype = i32
        self.f = f

    def run(self, q, k, v, out, lse, warmup=3, reps=20, iters=15):
        ms = ctypes.c_float(float("nan"))
        err = ctypes.create_string_buffer(1024)
        B, H, N, D = q.shape
        rc = self.f(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                    int(q.dtype == torch.float16), B, H, k.shape[1], N, k.shape[2], D, warmup, reps, iters,
                    ctypes.byref(ms), err, len(err))
        if rc != 0:
            raise RuntimeError(err.value.decode())
        return ms.value


def time_torch_loop(fn, reps=20, iters=15, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


def peer_prefix(res, name, backend, q, k, v, ref, group):
    """Times one SDPA backend on the prefix shape: GQA through enable_gqa, else K/V expanded."""
    how = "enable_gqa"
    try:
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    except Exception as e:  # the backend refuses GQA: expand K/V to the query heads
        print(f"{name}: enable_gqa refused ({str(e).splitlines()[0][:120]}); expanding K/V", flush=True)
        kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        how = "expanded K/V"
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q, kk, vv)
        fn = lambda: F.scaled_dot_product_attention(q, kk, vv)
    res["err_" + name] = rel_err(o, ref)
    with sdpa_kernel([backend]):
        res[name] = time_torch_loop(fn)
    res["how_" + name] = how


def bench_prefix(lib, sizes, Lq=16, Hq=32, Hkv=8, D=128):
    loop = SparsaLoop(lib)
    rows = []
    for L in sizes:
        torch.manual_seed(L + 7)
        q = torch.randn(1, Hq, Lq, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, Hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out = torch.full_like(q, float("nan"))
        lse = torch.full((1, Hq, Lq), float("nan"), device="cuda", dtype=torch.float32)
        kv_bytes = 2 * k.numel() * k.element_size()
        # f32 reference on the same bf16 values (K/V expanded to the query heads).
        kf, vf = (x.float().repeat_interleave(Hq // Hkv, dim=1) for x in (k, v))
        s = (q.float() @ kf.transpose(-1, -2)) / math.sqrt(D)
        ref_lse = torch.logsumexp(s, dim=-1)
        ref = torch.softmax(s, dim=-1) @ vf
        del kf, vf, s
        res = {"L": L, "kv_bytes": kv_bytes}
        # The output is poisoned first, so every element the timed calls leave is checked.
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        res["sparsa"] = loop.run(q, k, v, out, lse)
        torch.cuda.synchronize()
        res["err_sparsa"] = rel_err(out, ref)
        res["lse_err_sparsa"] = (lse - ref_lse).abs().max().item()
        # The previous rung (mma.sync, cp.async; still the path for unaligned inputs), same tensors.
        lib.sparsa_bench_set_split_kv_tma(0)
        out.fill_(float("nan"))
        res["sparsa_rung1"] = loop.run(q, k, v, out, lse)
        lib.sparsa_bench_set_split_kv_tma(1)
        torch.cuda.synchronize()
        res["err_sparsa_rung1"] = rel_err(out, ref)
        for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
            try:
                peer_prefix(res, name, backend, q, k, v, ref, Hq // Hkv)
            except Exception as e:  # a peer that runs in neither way: its row says so, the rest goes on
                print(f"{name}: failed ({str(e).splitlines()[0][:160]})", flush=True)
                res.update({name: float("nan"), "err_" + name: float("nan"), "how_" + name: "failed"})
        rows.append(res)
        print(json.dumps(res), flush=True)
        del q, k, v, out, lse, ref, ref_lse
        torch.cuda.empty_cache()
    print()
    print(f"prefix attention: {Lq} queries, {Hq}/{Hkv} heads (GQA), D={D}, bf16; "
          "times: median of 15 samples of 20 back-to-back calls")
    print(f"{'KV':>6} {'kernel':<34} {'us':>9} {'TB/s K+V':>9} {'rel err':>9}")
    for r in rows:
        for name, key in [("sparsa split-KV", "sparsa"), ("sparsa split-KV rung 1 (mma.sync)", "sparsa_rung1"),
                          (f"SDPA flash ({r['how_flash']})", "flash"),
                          (f"SDPA cuDNN ({r['how_cudnn']})", "cudnn")]:
            t = r[key]
            print(f"{r['L']:>6} {name:<34} {t * 1e3:>9.1f} {r['kv_bytes'] / t / 1e9:>9.2f} {r['err_' + key]:>9.2e}")
        print(f"{r['L']:>6} sparsa / flash speed {r['flash'] / r['sparsa']:.2f}x (target >= 3), "
              f"/ cuDNN speed {r['cudnn'] / r['sparsa']:.2f}x; sparsa lse max abs err {r['lse_err_sparsa']:.2e}")
    return rows


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


# ---- BA-Att: selection on the device + the block-sparse executor (--ba-att) -------------------------

def bench_ba_att(lib, sizes, densities, H=32, D=128, blk=128, iters=5):
    """sparsa_bench_ba_att (bench_shim.cpp) next to SDPA cuDNN dense on the same tensors."""
    f = lib.sparsa_bench_ba_att
    i64, i32, vp, fp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)
    f.argtypes = [vp, vp, vp, vp, vp, i32, i64, i64, i64, i64, i64, i32, ctypes.c_double, i32, i32, fp, fp, fp,
                  ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, i32]
    f.restype = i32
    rows = []
    for N in sizes:
        torch.manual_seed(N + 11)
        q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(1, H, N, device="cuda", dtype=torch.float32)
        # The dense peer's output first (for the error column); its timing after sparsa's rows, so
        # that seconds of dense attention just before do not sit under sparsa's first timings.
        peer = "cuDNN"
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ref = F.scaled_dot_product_attention(q, k, v)
        except Exception as e:  # cuDNN refuses the shape: the flash backend instead, and the table says so
            print(f"cuDNN failed ({str(e).splitlines()[0][:160]}); timing SDPA flash instead", flush=True)
            peer = "flash"
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                ref = F.scaled_dot_product_attention(q, k, v)
        torch.cuda.synchronize()
        first_row = len(rows)
        for density in densities:
            sel, ex, tot = ctypes.c_float(float("nan")), ctypes.c_float(float("nan")), ctypes.c_float(float("nan"))
            visited = ctypes.c_double(float("nan"))
            err = ctypes.create_string_buffer(1024)
            rc = f(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), 0, 1, H, H, N, D, blk,
                   density, 2, iters, ctypes.byref(sel), ctypes.byref(ex), ctypes.byref(tot), ctypes.byref(visited),
                   err, len(err))
            if rc != 0:
                raise RuntimeError(err.value.decode())
            torch.cuda.synchronize()
            # The selection with one of its earlier variants switched in (same call, same tensors).
            def select_with(switch):
                ms = ctypes.c_float(float("nan"))
                switch(0)
                rc = f(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), 0, 1, H, H, N, D,
                       blk, density, 2, iters, ctypes.byref(ms), ctypes.byref(ctypes.c_float()),
                       ctypes.byref(ctypes.c_float()), ctypes.byref(ctypes.c_double()), err, len(err))
                switch(1)
                if rc != 0:
                    raise RuntimeError(err.value.decode())
                return ms
            simt = select_with(lib.sparsa_bench_set_ba_att_tensor_core_logits)  # SIMT f32 logits
            mma_sync = select_with(lib.sparsa_bench_set_ba_att_wgmma_logits)  # mma.sync 3xTF32 logits
            serial = select_with(lib.sparsa_bench_set_ba_att_concurrent_sides)  # key side after query side
            torch.cuda.synchronize()
            res = {"N": N, "density": density, "visited": visited.value, "select_ms": sel.value,
                   "select_simt_logits_ms": simt.value, "select_mma_sync_logits_ms": mma_sync.value,
                   "select_serial_sides_ms": serial.value,
                   "executor_ms": ex.value, "total_ms": tot.value, "peer": peer,
                   "rel_err_vs_dense": rel_err(out, ref), "finite": bool(torch.isfinite(out).all().item())}
            rows.append(res)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION if peer == "cuDNN" else SDPBackend.FLASH_ATTENTION]):
            cudnn = time_torch(lambda: F.scaled_dot_product_attention(q, k, v), iters, warmup=1)
        for res in rows[first_row:]:
            res["cudnn_ms"] = cudnn
            print(json.dumps(res), flush=True)
        del q, k, v, out, lse, ref
        torch.cuda.empty_cache()
    print()
    print(f"BA-Att on the device: {H} heads, D={D}, bf16, blocks {blk}x{blk}, global norm sort, diagonal "
          f"compensation; times: median of {iters} CUDA-event-timed calls")
    print(f"{'N':>7} {'density':>7} {'visited':>7} {'select ms':>10} {'exec ms':>9} {'total ms':>9} "
          f"{'cuDNN ms':>9} {'speed-up':>8} {'select %':>8} {'err vs dense':>12} {'select ms, SIMT logits':>22} "
          f"{'select ms, mma.sync logits':>26} {'select ms, serial sides':>23}")
    for r in rows:
        print(f"{r['N']:>7} {r['density']:>7.2f} {r['visited']:>7.3f} {r['select_ms']:>10.3f} {r['executor_ms']:>9.3f} "
              f"{r['total_ms']:>9.3f} {r['cudnn_ms']:>9.3f} {r['cudnn_ms'] / r['total_ms']:>7.2f}x "
              f"{r['select_ms'] / r['total_ms']:>8.2%} {r['rel_err_vs_dense']:>12.3e} "
              f"{r['select_simt_logits_ms']:>22.3f} {r['select_mma_sync_logits_ms']:>26.3f} "
              f"{r['select_serial_sides_ms']:>23.3f}"
              + ("" if r["peer"] == "cuDNN" else "  (peer: SDPA flash)"))
    print("(err vs dense: sparse attention's own approximation error on random inputs, not a defect; "
          "'finite' in the JSON must be true)")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--keep", type=float, default=0.1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--prefix-sizes", type=int, nargs="*", default=[32768, 65536],
                    help="KV lengths of the prefix (split-KV) rows; none: skip them")
    ap.add_argument("--prefix-only", action="store_true", help="only the prefix rows")
    ap.add_argument("--ba-att", action="store_true",
                    help="only BA-Att: device selection + block-sparse executor vs SDPA cuDNN dense")
    ap.add_argument("--ba-att-sizes", type=int, nargs="+", default=[131072])
    ap.add_argument("--ba-att-densities", type=float, nargs="+", default=[0.10, 0.50])
    ap.add_argument("--ba-att-iters", type=int, default=15, help="timed calls per BA-Att median")
    ap.add_argument("--schedule", type=int, default=None, choices=SCHEDULES.keys(),
                    help="flash rung 3's consumer schedule for every sparsa call: " +
                         ", ".join(f"{k} {v}" for k, v in SCHEDULES.items()) +
                         " (default: the library's; the dense and sparse rows time each schedule either way)")
    ap.add_argument("--rounds", type=int, default=7,
                    help="interleaved rounds of the comparison against the peers (rounds.py); 0: skip them")
    args = ap.parse_args()
    set_schedule = ctypes.CDLL(args.lib).sparsa_bench_set_flash_schedule
    set_schedule.restype = ctypes.c_int
    if args.schedule is None:  # the library's default, read back through the setter
        args.schedule = set_schedule(0)
    set_schedule(args.schedule)
    print(f"sparsa's rung-3 schedule for the plain rows: {SCHEDULES[args.schedule]}")
    if args.ba_att:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"cudnn {torch.backends.cudnn.version()}")
        rows = bench_ba_att(ctypes.CDLL(args.lib), args.ba_att_sizes, args.ba_att_densities, iters=args.ba_att_iters)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    if args.prefix_only:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"cudnn {torch.backends.cudnn.version()}")
        bench_prefix(ctypes.CDLL(args.lib), args.prefix_sizes)
        return 0

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
        sp.lib.sparsa_bench_set_flash_tma(0)  # the previous rung (cp.async, no producer warp), same run
        res["sparsa_dense_rung2"] = sp.run(q, k, v, out, lse, iters=iters)
        sp.lib.sparsa_bench_set_flash_tma(1)
        # Rung 3 with each consumer schedule and each dense key tile (128, 176) in the same run,
        # each checked against cuDNN.
        for tile, suffix in ((128, ""), (176, "_176")):
            sp.lib.sparsa_bench_set_flash_dense_key_tile(tile)
            for sched, name in SCHEDULES.items():
                sp.lib.sparsa_bench_set_flash_schedule(sched)
                sp.run(q, k, v, out, lse, warmup=1)
                torch.cuda.synchronize()
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    res[f"err_{name}{suffix}_vs_cudnn"] = rel_err(out, F.scaled_dot_product_attention(q, k, v))
                res[f"sparsa_dense_{name}{suffix}"] = sp.run(q, k, v, out, lse, iters=iters)
        sp.lib.sparsa_bench_set_flash_dense_key_tile(128)
        sp.lib.sparsa_bench_set_flash_schedule(args.schedule)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            res["cudnn"] = time_torch(lambda: F.scaled_dot_product_attention(q, k, v), iters)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            res["fa2"] = time_torch(lambda: F.scaled_dot_product_attention(q, k, v), iters)
        res["flex_dense"] = time_torch(lambda: flex(q, k, v), iters)
        del ref

        # The main comparison again in interleaved rounds (rounds.py): each round times every variant
        # once, and a ratio is taken within a round, so the clocks' drift over the run falls on all.
        def sparsa_timed(schedule, *plan, calls=iters):
            def run():
                sp.lib.sparsa_bench_set_flash_schedule(schedule)
                try:
                    return sp.run(q, k, v, out, lse, *plan, warmup=1, iters=calls)
                finally:
                    sp.lib.sparsa_bench_set_flash_schedule(args.schedule)
            return run

        def cudnn_timed():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return time_torch(lambda: F.scaled_dot_product_attention(q, k, v), iters, warmup=1)

        if args.rounds > 0:
            res["rounds_dense"] = rounds.summarise(rounds.interleaved(
                [("SDPA cuDNN", cudnn_timed), ("sparsa dense overlap", sparsa_timed(2)),
                 ("sparsa dense pingpong", sparsa_timed(1))], args.rounds, lambda f: f()), "SDPA cuDNN")

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
        # The same plan trusted (check_index = false: no device check of its contents, no read-back).
        sp.lib.sparsa_bench_set_check_index(0)
        res["sparsa_sparse_unchecked"] = sp.run(q, k, v, out, lse, counts, indices, iters=iters * 3)
        sp.lib.sparsa_bench_set_check_index(1)
        res["flex_sparse"] = time_torch(lambda: flex(q, k, v, block_mask=bm), iters * 3)
        for sched, name in SCHEDULES.items():
            sp.lib.sparsa_bench_set_flash_schedule(sched)
            res[f"sparsa_sparse_{name}"] = sp.run(q, k, v, out, lse, counts, indices, iters=iters * 3)
            res[f"err_sparse_{name}_vs_flex"] = rel_err(out, ref)
        sp.lib.sparsa_bench_set_flash_schedule(args.schedule)
        if args.rounds > 0:
            res["rounds_sparse"] = rounds.summarise(rounds.interleaved(
                [("Flex sparse", lambda: time_torch(lambda: flex(q, k, v, block_mask=bm), iters * 3, warmup=1)),
                 ("sparsa sparse overlap", sparsa_timed(2, counts, indices, calls=iters * 3)),
                 ("sparsa sparse pingpong", sparsa_timed(1, counts, indices, calls=iters * 3))], args.rounds, lambda f: f()),
                "Flex sparse")
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
                                 ("sparsa dense rung 2", "sparsa_dense_rung2", r["dense_flops"]),
                                 *[(f"sparsa dense {n}", f"sparsa_dense_{n}", r["dense_flops"])
                                   for n in SCHEDULES.values()],
                                 *[(f"sparsa dense {n} 176", f"sparsa_dense_{n}_176", r["dense_flops"])
                                   for n in SCHEDULES.values()],
                                 ("SDPA cuDNN", "cudnn", r["dense_flops"]),
                                 ("SDPA flash (FA2)", "fa2", r["dense_flops"]),
                                 ("Flex dense", "flex_dense", r["dense_flops"]),
                                 (f"sparsa sparse {r['density']:.3f}", "sparsa_sparse", r["sparse_flops"]),
                                 ("sparsa sparse unchecked", "sparsa_sparse_unchecked", r["sparse_flops"]),
                                 *[(f"sparsa sparse {n}", f"sparsa_sparse_{n}", r["sparse_flops"])
                                   for n in SCHEDULES.values()],
                                 (f"Flex sparse {r['density']:.3f}", "flex_sparse", r["sparse_flops"])]:
            t = tf(flops, r[key])
            print(f"{N:>6} {name:<22} {r[key]:>9.3f} {t:>8.1f} {t / CEILING:>7.1%}")
        print(f"{N:>6} sparsa dense / cuDNN speed      {r['cudnn'] / r['sparsa_dense']:.3f}x   (issue 19: >= 1.0)")
        print(f"{N:>6} sparsa dense / FA2 speed        {r['fa2'] / r['sparsa_dense']:.3f}x")
        print(f"{N:>6} sparsa dense / Flex dense speed {r['flex_dense'] / r['sparsa_dense']:.3f}x")
        print(f"{N:>6} sparsa sparse / Flex sparse spd {r['flex_sparse'] / r['sparsa_sparse']:.3f}x   (target > 1)")
        print(f"{N:>6} sparsa sparse time / dense time {r['sparsa_sparse'] / r['sparsa_dense']:.3f}    (target <= 0.13 at 32K)")
        print(f"{N:>6} rel err: dense vs cuDNN {r['err_dense_vs_cudnn']:.2e}, sparse vs Flex {r['err_sparse_vs_flex']:.2e}")
        for n in SCHEDULES.values():
            print(f"{N:>6} cuDNN / sparsa dense {n}: {r['cudnn'] / r[f'sparsa_dense_{n}']:.3f}x (128-key tiles), "
                  f"{r['cudnn'] / r[f'sparsa_dense_{n}_176']:.3f}x (176-key tiles; rel err vs cuDNN "
                  f"{r[f'err_{n}_176_vs_cudnn']:.2e})")
        for n in list(SCHEDULES.values())[1:]:
            print(f"{N:>6} {n} / plain rung 3 time: dense {r[f'sparsa_dense_{n}'] / r['sparsa_dense_plain']:.3f}, "
                  f"sparse {r[f'sparsa_sparse_{n}'] / r['sparsa_sparse_plain']:.3f}; rel err dense vs cuDNN "
                  f"{r[f'err_{n}_vs_cudnn']:.2e}, sparse vs Flex {r[f'err_sparse_{n}_vs_flex']:.2e}")
        for key, base in (("rounds_dense", "SDPA cuDNN"), ("rounds_sparse", "Flex sparse")):
            if key in r:
                for line in rounds.table(r[key], base, f"{args.rounds} interleaved rounds (the median of the "
                                         "per-round ratios, and their range):"):
                    print(f"{N:>6} {line}")
    if args.prefix_sizes:
        print()
        bench_prefix(sp.lib, args.prefix_sizes)


if __name__ == "__main__":
    sys.exit(main())
