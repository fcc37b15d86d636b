#!/usr/bin/env python3
"""The bidirectional denoising loops side by side on the CPU: LLaDA's remasking (the whole canvas
every step), Fast-dLLM's prefix cache (the block and everything after it every step) and its dual
cache (the block alone every step), in one run on the same prompts.

The model is a random-weight LLaDA-shaped one written by the engine tests' reference module
(engines/dlm/tests/dlm_ref.py; the loops' costs do not depend on the weights); each loop generates
for the same prompts in one `sparsa generate --json` process, the loops alternate `--repeats`
times and the medians are taken (the machine's other load falls on all of them alike). The
table gives per loop the seconds, the forward passes, the tokens pushed through the model, the
generated tokens per second and the share of generated tokens equal to the remasking loop's (the
caches are approximations: what a step sees outside the block is as of the block's first step).

    python3 bench/python/bench_dlm_loops.py --sparsa build/tools/sparsa [--prompt-len 512 --gen-len 256]
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "engines", "dlm", "tests"))
import dlm_ref as R  # noqa: E402

LOOPS = ["remask", "prefix_cache", "dual_cache"]


def run(args, model, prompts, loop):
    cmd = [args.sparsa, "generate", "--model", model, "--json", "--quiet", "--loop", loop, "--gen-len",
           str(args.gen_len), "--block-len", str(args.block_len), "--steps", str(args.gen_len),
           "--no-stop-at-eos", "--threads", str(args.threads)]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"sparsa generate --loop {loop} failed: {r.stderr}")
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sparsa", required=True, help="the sparsa binary")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--block-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="attention threads (0: all cores)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.gen_len % args.block_len:
        sys.exit("--gen-len: expected a multiple of --block-len")
    s = R.Spec("llada", dim=args.dim, layers=args.layers, heads=args.dim // 64, hidden=args.dim * 11 // 4,
               vocab=args.vocab, max_len=args.prompt_len + args.gen_len)
    rng = random.Random(3)
    prompts = [[rng.randrange(args.vocab - 2) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as work:
        R.write_model(work, s, seed=5)
        results = {loop: [] for loop in LOOPS}
        for _ in range(args.repeats):
            for loop in LOOPS:
                results[loop].append(run(args, work, prompts, loop))
    print(f"random LLaDA-shaped model: dim {args.dim}, {args.layers} layers, {s.heads} heads, vocab {args.vocab}; "
          f"{args.requests} requests of {args.prompt_len} prompt tokens, {args.gen_len} generated in blocks of "
          f"{args.block_len}, one token a step; medians of {args.repeats}")
    print("| loop | seconds | vs remask | forward passes | tokens through the model | generated tokens/s | same tokens as remask |")
    print("|---|---|---|---|---|---|---|")
    base = statistics.median(r["seconds"] for r in results["remask"])
    ref = results["remask"][0]["tokens"]
    for loop in LOOPS:
        sec = statistics.median(r["seconds"] for r in results[loop])
        first = results[loop][0]
        same = sum(a == b for x, y in zip(first["tokens"], ref) for a, b in zip(x, y))
        total = sum(len(x) for x in ref)
        print(f"| {loop} | {sec:.3f} | {base / sec:.2f}x | {first['steps']} | {first['forward_tokens']} | "
              f"{args.requests * args.gen_len / sec:.1f} | {same / total:.1%} |")


if __name__ == "__main__":
    main()
