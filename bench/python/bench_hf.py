#!/usr/bin/env python3
"""A transformers Qwen3-shaped model (random weights) at long prefill: attn_implementation
"sparsa_ba_att" against "sdpa", end to end, in one process on the same weights and tokens.

Default shape: 8 layers, 32 query / 8 kv heads, head_dim 128 (hidden 4096, MLP 12288, Qwen3-8B's
layer), vocabulary 8192 (the real 151936 would make 32K x 151936 bf16 logits, 10 GB, and time the
LM head instead of attention), bf16, one sequence of 32768 tokens.

Rows, per mask (--mask causal: Qwen3 as it is; bidirectional: every layer's is_causal off, as a
diffusion LM built on it attends):
  sdpa                     the reference: transformers' SDPA path (flash / cuDNN as torch picks)
  sdpa, K kernel           the same model through SDPA restricted to one backend K (cuDNN, else
                           the memory-efficient kernel; the first that takes the shape: on the
                           H200 with torch 2.11 the efficient kernel refused transformers' GQA
                           call, "No available kernel"): two exact kernels' agreement in this
                           dtype, the floor for the rows below; a skipped row if none runs
  sparsa_ba_att d=1.0      sparsa at density 1.0: logits agreement with sdpa
  sparsa_ba_att d=F        the sparse run (default F = 0.1): the time ratio
  ... compiled             torch.compile(fullgraph=True) of the sparse model: its time, and its
                           logits against sdpa and the eager sparse run. Inductor fuses the norms
                           and RoPE differently, so q and k differ from eager in the last bits,
                           and in a random-weight model BA-Att's block scores are near-ties that
                           such bits reorder: compiled and eager sparse logits then differ as two
                           sparse plans do (at density 1.0 they agree to rounding)
  ... cuda graph           the eager sparse forward captured in a CUDA graph and replayed (causal
                           only: under capture transformers builds Qwen3's causal mask, which the
                           layers set bidirectional by hand refuse)
Each row is printed, and --json rewritten, as soon as it is measured. --profile also prints, per
mask, the GPU kernels of one eager sparse forward by their total time (torch.profiler).
Times are medians of CUDA-event-timed forwards after warm-ups. Agreement: max|a-b|/max|b|,
||a-b||/||b|| over all logits, and the share of positions whose argmax token agrees.

    PYTHONPATH=build-gpu/python python3 bench/python/bench_hf.py              # the H200 run
    PYTHONPATH=build/python python3 bench/python/bench_hf.py --device cpu --len 512 --layers 2 \\
        --hidden 256 --heads 4 --kv-heads 2 --intermediate 512 --block 64  # a smoke run on a CPU
"""
import argparse
import copy
import json
import statistics
import sys
import time

import torch

import sparsa
import sparsa.hf


def build(args, implementation):
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                                   max_position_embeddings=max(args.len, 4096))
    torch.manual_seed(args.seed)
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=implementation,
                                                         dtype=args.dtype).to(args.device).eval()


def set_causal(model, causal: bool):
    for module in model.modules():
        if hasattr(module, "is_causal"):
            module.is_causal = causal


def timed(fn, args):
    """Median seconds of fn() over args.repeats calls after args.warmup."""
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.repeats):
        if args.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def noise_floor(ref, ids, want, mask, emit):
    """The sdpa model through one SDPA backend against the default choice: the first backend that
    runs, a skipped row (with the last refusal) if none does."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    refusal = ""
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                other = ref(ids).logits
        except RuntimeError as e:
            refusal = f"{name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            continue
        emit({"mask": mask, "run": f"sdpa, {name} kernel", "vs_sdpa": agreement(other, want)})
        return
    emit({"mask": mask, "run": "sdpa, another kernel", "skipped": f"no other SDPA backend ran ({refusal})"})


def profile(fn, args, what, rows=16):
    """The kernels of one fn() (after timed()'s warm-ups) by total device time."""
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if args.device == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
    print(f"profile: {what}\n{prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)}",
          flush=True)


def agreement(a, b):
    a, b = a.float(), b.float()
    return {"max_rel": ((a - b).abs().max() / b.abs().max()).item(),
            "norm_rel": ((a - b).norm() / b.norm()).item(),
            "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--len", type=int, default=32768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--block", type=int, default=128, help="BA-Att block size, both sides")
    p.add_argument("--mask", choices=["causal", "bidirectional", "both"], default="both")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph row")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--profile", action="store_true", help="print the kernels of one eager sparse forward")
    args = p.parse_args()
    args.dtype = getattr(torch, args.dtype)
    if args.device == "cuda":
        assert "cuda" in sparsa.backends(), f"sparsa's cuda backend cannot run here: {sparsa.backend_status('cuda')}"
    sparsa.hf.register()
    ref = build(args, "sdpa")
    model = build(args, "sparsa_ba_att")
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, args.vocab, (1, args.len), device=args.device,
                        generator=torch.Generator(device=args.device).manual_seed(args.seed + 1))
    print(f"Qwen3-shaped: {args.layers} layers, {args.heads}/{args.kv_heads} heads, d {args.head_dim}, hidden "
          f"{args.hidden}, MLP {args.intermediate}, vocab {args.vocab}, {args.dtype}, len {args.len}, "
          f"BA-Att block {args.block}, device {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
          f"sparsa backends {sparsa.backends()}", flush=True)
    rows = []

    def emit(row):
        """Print the row and rewrite --json at once: a later failure (a crash, the machine
        going away) keeps every row measured before it."""
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, f, indent=1)

    masks = ["causal", "bidirectional"] if args.mask == "both" else [args.mask]
    sparse = dict(density=args.density, block_q=args.block, block_kv=args.block)
    for mask in masks:
        for m in (ref, model):
            set_causal(m, mask == "causal")
        with torch.no_grad():
            want = ref(ids).logits
            t_sdpa = timed(lambda: ref(ids), args)
            emit({"mask": mask, "run": "sdpa", "seconds": t_sdpa})
            if args.device == "cuda":
                noise_floor(ref, ids, want, mask, emit)
            with sparsa.hf.options(density=1.0, block_q=args.block, block_kv=args.block):
                exact = model(ids).logits
            emit({"mask": mask, "run": "sparsa_ba_att d=1.0", "vs_sdpa": agreement(exact, want)})
            del exact
            with sparsa.hf.options(**sparse):
                got = model(ids).logits
                t = timed(lambda: model(ids), args)
                emit({"mask": mask, "run": f"sparsa_ba_att d={args.density}", "seconds": t,
                      "sdpa_over_sparsa": t_sdpa / t, "vs_sdpa": agreement(got, want)})
                if args.profile:
                    profile(lambda: model(ids), args, f"{mask}, sparsa_ba_att d={args.density}")
                if not args.no_compile:
                    torch._dynamo.reset()
                    try:
                        compiled = torch.compile(model, fullgraph=True)
                        out = compiled(ids).logits
                        t = timed(lambda: compiled(ids), args)
                        emit({"mask": mask, "run": f"sparsa_ba_att d={args.density} compiled", "seconds": t,
                              "sdpa_over_sparsa": t_sdpa / t, "vs_sdpa": agreement(out, want),
                              "vs_eager": agreement(out, got)})
                        del compiled, out
                    except Exception as e:  # a row of its own: the eager rows above stand
                        emit({"mask": mask, "run": f"sparsa_ba_att d={args.density} compiled",
                              "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
                if not args.no_graph and args.device == "cuda" and mask == "bidirectional":
                    # Under capture transformers builds Qwen3's causal mask (eager passes none), and
                    # sparsa.hf follows the layer there and checks the mask on the device: a layer set
                    # bidirectional by hand would fail that check, poisoning the CUDA context.
                    emit({"mask": mask, "run": f"sparsa_ba_att d={args.density} cuda graph",
                          "skipped": "transformers builds this model's causal mask under capture; a layer set "
                                     "bidirectional by hand refuses it (docs/torch.md)"})
                elif not args.no_graph and args.device == "cuda":
                    try:
                        side = torch.cuda.Stream()
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            model(ids)
                        torch.cuda.current_stream().wait_stream(side)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            captured = model(ids).logits
                        t = timed(graph.replay, args)
                        emit({"mask": mask, "run": f"sparsa_ba_att d={args.density} cuda graph", "seconds": t,
                              "sdpa_over_sparsa": t_sdpa / t, "vs_eager": agreement(captured, got)})
                        del graph, captured
                    except Exception as e:
                        emit({"mask": mask, "run": f"sparsa_ba_att d={args.density} cuda graph",
                              "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
            del want, got
    print("\n| mask | run | time (s) | sdpa / run | agreement (max rel, norm rel, argmax) |")
    print("|---|---|---|---|---|")
    for row in rows:
        agree = row.get("vs_eager") if "cuda graph" in row["run"] else row.get("vs_sdpa")
        against = "vs eager sparse" if "cuda graph" in row["run"] else "vs sdpa"
        text = (f"{agree['max_rel']:.2e}, {agree['norm_rel']:.2e}, {agree['argmax_agree']:.4f} {against}"
                if agree else "")
        seconds = f"{row['seconds']:.3f}" if "seconds" in row else ""
        ratio = f"{row['sdpa_over_sparsa']:.2f}x" if "sdpa_over_sparsa" in row else ""
        if "error" in row:
            text = f"failed: {row['error']}"
        if "skipped" in row:
            text = f"skipped: {row['skipped']}"
        print(f"| {row['mask']} | {row['run']} | {seconds} | {ratio} | {text} |")
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
