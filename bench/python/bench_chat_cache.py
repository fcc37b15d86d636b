#!/usr/bin/env python3
"""`sparsa chat` with and without the prompt cache (dlm::PromptCache), in one run on the same turns.

A block-diffusion model (default: the shipped models/sparsa-sdar-ruler) gets a long system
message (seeded key-value sentences, about 4K tokens with the shipped tokenizer) and several
short user turns, through a plain chat template that writes a past assistant turn exactly as it
prompted for it. Each mode runs the whole conversation in one `sparsa chat --json` process; the
table gives per turn the prompt length, the prompt tokens whose K/V were reused, the tokens pushed
through the model and the turn's seconds, then the totals, and checks that both modes produced the
same replies (temperature 0). The two processes alternate `--repeats` times and the medians are
taken, so that the machine's other load falls on both alike.

    python3 bench/python/bench_chat_cache.py --sparsa build/tools/sparsa [--model DIR] [--threads N]
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
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
TURNS = ["What does key 512 hold?", "And key 733?", "Repeat the first answer.", "Which key holds 4242?",
         "Thanks. One more: key 101?"]


def conversation(model_dir, work):
    """A copy of the model directory (links) with the chat template, and the system message."""
    model = os.path.join(work, "model")
    os.makedirs(model)
    for name in os.listdir(model_dir):
        os.symlink(os.path.abspath(os.path.join(model_dir, name)), os.path.join(model, name))
    with open(os.path.join(model, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(TEMPLATE)
    rng = random.Random(1)
    system = " ".join(f"The key {rng.randint(100, 999)} holds {rng.randint(1000, 9999)}." for _ in range(300))
    return model, system


def run_chat(args, model, system, cache):
    cmd = [args.sparsa, "chat", "--model", model, "--system", system, "--json", "--gen-len", str(args.gen_len),
           "--threads", str(args.threads)] + ([] if cache else ["--no-prompt-cache"])
    r = subprocess.run(cmd, input="\n".join(TURNS) + "\n", capture_output=True, text=True, encoding="utf-8")
    if r.returncode != 0:
        sys.exit(f"sparsa chat failed: {r.stderr}")
    return [json.loads(line) for line in r.stdout.splitlines()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sparsa", required=True, help="the sparsa binary")
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "sparsa-sdar-ruler"))
    ap.add_argument("--threads", type=int, default=0, help="attention threads (0: all cores)")
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        model, system = conversation(args.model, work)
        runs = {True: [], False: []}
        for _ in range(args.repeats):
            for cache in (True, False):
                runs[cache].append(run_chat(args, model, system, cache))
    for cache in (True, False):
        for r in runs[cache]:
            if [t["tokens"] for t in r] != [t["tokens"] for t in runs[True][0]]:
                sys.exit("the replies differ between runs or modes")
    print(f"{len(TURNS)} turns, gen_len {args.gen_len}, threads {args.threads or 'all'}; "
          f"medians of {args.repeats} runs of each mode, alternated; replies identical in every run")
    print(f"{'turn':>4} {'prompt':>7} | {'reused':>7} {'forward':>8} {'s':>7} | {'forward':>8} {'s':>7} | {'speed-up':>8}")
    print(f"{'':>4} {'':>7} | {'with the prompt cache':^24} | {'without':^16} |")
    total = {True: 0.0, False: 0.0}
    for i in range(len(TURNS)):
        sec = {c: statistics.median(r[i]["seconds"] for r in runs[c]) for c in (True, False)}
        t, u = runs[True][0][i], runs[False][0][i]
        total[True] += sec[True]
        total[False] += sec[False]
        print(f"{i:>4} {t['prompt_tokens']:>7} | {t['reused_tokens']:>7} {t['forward_tokens']:>8} {sec[True]:>7.3f} | "
              f"{u['forward_tokens']:>8} {sec[False]:>7.3f} | {sec[False] / sec[True]:>7.2f}x")
    print(f" all {'':>7} | {'':>7} {'':>8} {total[True]:>7.3f} | {'':>8} {total[False]:>7.3f} | "
          f"{total[False] / total[True]:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
