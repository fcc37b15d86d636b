#!/usr/bin/env python3
"""Trains a small block-diffusion LM in the engine's `sdar` format on the long-context tasks of
`sparsa ruler generate` (docs/eval.md, "Training the model"). torch is a training-time
dependency only; the result is a Hugging Face directory that `sparsa generate` and
`sparsa eval-model` run.

    train_sdar.py tokenizer --run RUN                  BPE tokenizer.json trained on the task text
    train_sdar.py train --run RUN --stage N --minutes M  one stage of the curriculum (resumes)
    train_sdar.py train --run RUN --plan 1:3,2:3 --export DIR  several stages in one process, exported after each
    train_sdar.py export --run RUN --out DIR           config.json + safetensors (+ shards) + tokenizer.json
    train_sdar.py stages                               the curriculum
    train_sdar.py probe --run RUN                      does the model copy / retrieve yet (answer CE)

The task text comes from the C++ generator through the CLI (one source of truth for the tasks):
a background thread runs `sparsa ruler generate` on fresh seeds (from 1,000,000 up, far from
the evaluation seeds) and tokenizes its JSON lines with the run's tokenizer.

Training sequence (block diffusion, BD3-LM style two streams): the clean sequence x0 = prompt
+ target + EOS (padded with EOS to whole blocks of block_size) runs block-causally, exactly as
the engine's prefix cache sees it; after it come noisy copies of the answer's blocks (and of a
few random prompt blocks), each masked at its own rate t ~ U(0, 1). A noisy copy of block b
sees the clean blocks before b and itself (bidirectionally) — what the engine's block loop
sees when it denoises block b. The loss is the masked-diffusion ELBO: cross-entropy on the
masked tokens weighted by 1/t, averaged over the noisy blocks' tokens.

`tokenizer --arch llada` makes the run a bidirectional LLaDA-format model instead (no QK norm,
LLaDA's SFT-style loss over the answer region; build_batch_llada), for BA-Att's full canvases.
"""
import argparse
import json
import math
import os
import queue
import random
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import replace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdar_torch import (Sdar, SdarConfig, export_hf, flex_attention_fn, fold_qk_norm, import_hf, qk_rms,  # noqa: E402
                        sdpa_attention)

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))

# The curriculum: each stage's generator lengths (samples of every length in equal numbers, so
# the shorter ones keep what earlier stages taught), learning rate, and optionally its tasks and
# noisy prompt blocks (defaults: --tasks, --prompt-blocks). Each fits in a few minutes of one
# H200; docs/eval.md gives the command sequence.
#
# Stage 0 is a retrieval warm-up: the NIAH family only, at 256 and 512 tokens, with the whole
# loss on the answers (no noisy prompt blocks). The first H200 run started at stage 1 (all
# tasks, 512/1K) and after 1507 steps (99M tokens, stages 1-3) answered no needle, even at 1K:
# each answer is ~7 of a sample's 48 masked tokens and one per sample, so at long lengths the
# retrieval signal per step is small; short samples give it many times per step. Stage 0 also
# replaces half its samples by copy samples (copy_item) and clips the masking rate to
# U(0.3, 0.8): the 1/t weights of rates near 0 make the ELBO's gradient noisy (BD3-LM's
# argument for clipped schedules; this range is our choice, not yet measured).
STAGES = {
    0: {"lengths": [256, 512], "lr": 2e-3, "warmup": 200, "tasks": "niah", "prompt_blocks": 0, "copy": 0.5,
        "t_range": (0.3, 0.8)},
    1: {"lengths": [512, 1024], "lr": 1.5e-3, "warmup": 300},
    2: {"lengths": [1024, 2048], "lr": 1.2e-3, "warmup": 100},
    3: {"lengths": [1024, 2048, 4096], "lr": 1e-3, "warmup": 100},
    4: {"lengths": [2048, 4096, 8192], "lr": 8e-4, "warmup": 100},
    5: {"lengths": [4096, 8192, 16384], "lr": 6e-4, "warmup": 100},
    6: {"lengths": [4096, 8192, 16384], "lr": 3e-4, "warmup": 50},
}
TRAIN_SEED_BASE = 1_000_000  # generator seeds of training; validation uses 900,000 + stage
SPECIALS = ["<|endoftext|>", "<|mask|>"]  # ids 0 (EOS, padding) and 1 (mask)
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
              r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_SPLIT = QWEN_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")  # numbers in runs of up to three digits
# How the tokenizer cuts numbers (`tokenizer --numbers`): one token per digit (Qwen2), or runs of
# up to three digits (Llama 3's split), every one of the 1,110 runs "0".."999" a single token.
# With digits, a 7-digit value is 7 tokens from an alphabet of 10, so a value digit recurs all
# over a haystack of values and copying it needs the two or three digits before it; with
# triples, a value is 3 tokens from ~1,110 and each run is nearly unique in a context, so one
# visible run finds the next by plain induction, the circuit the second H200 run did learn on
# unique tokens. On the key-value drill the value vocabulary decided it: with one-digit values
# (ten tokens) the key match formed in about 3,000 steps, with three-digit ones (a thousand, each
# to be copied to the output token by token first) not in 7,662 (docs/eval.md).
NUMBER_SPLITS = {"digits": QWEN_SPLIT, "triples": LLAMA3_SPLIT}


def log(*args):
    print("[train_sdar]", *args, flush=True)


def find_sparsa(path):
    if path:
        return path
    for cand in (os.path.join(REPO, "build", "tools", "sparsa"), shutil.which("sparsa")):
        if cand and os.access(cand, os.X_OK):
            return cand
    sys.exit("train_sdar: no sparsa binary: build it (scripts/build --target sparsa_cli) or pass --sparsa PATH")


def ruler_generate(sparsa, tasks, lengths, samples, seed, tokenizer=None, threads=1):
    cmd = [sparsa, "ruler", "generate", "--tasks", tasks, "--lengths", ",".join(map(str, lengths)),
           "--samples", str(samples), "--seed", str(seed), "--threads", str(threads), "--skip-unfit"]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
    return [json.loads(line) for line in p.stdout.splitlines() if line.strip()]


# ---------------------------------------------------------------- tokenizer

def number_runs():
    """Every run of one to three digits: the number tokens a `triples` tokenizer must have."""
    return [f"{i:0{w}d}" for w in (1, 2, 3) for i in range(10 ** w)]


def train_tokenizer(sparsa, out_path, vocab_size, seed=TRAIN_SEED_BASE - 1, samples=12, lengths=(1024, 4096),
                    numbers="triples"):
    """Byte-level BPE trained on the generator's text of every task, with EOS and mask as special
    tokens 0 and 1. `numbers` (NUMBER_SPLITS): "digits" splits numbers digit by digit (Qwen2);
    "triples" into runs of up to three (Llama 3), and the training text then also holds every
    run 20 times so that each becomes one token (checked: an error naming --vocab if the
    vocabulary is too small to hold them)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    if numbers not in NUMBER_SPLITS:
        raise ValueError(f"--numbers: expected one of {', '.join(NUMBER_SPLITS)}, got {numbers!r}")
    rows = ruler_generate(sparsa, "all", list(lengths), samples, seed)
    text = [r["input"] + r["target"] for r in rows]
    if numbers == "triples":
        runs = number_runs()
        text += [" ".join(runs)] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(NUMBER_SPLITS[numbers]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    if numbers == "triples":
        split = [r for r in runs if len(tok.encode(r, add_special_tokens=False).ids) != 1]
        if split:
            raise ValueError(f"--vocab {vocab_size}: too small for --numbers triples ({len(split)} of the "
                             f"{len(runs)} digit runs, e.g. {split[0]!r}, are not single tokens; try 2048 or more)")
    tok.save(out_path)
    return tok


def number_tokens(tok):
    """The ids of the tokens that are digits only (single digits, or runs of up to three)."""
    return {i for t, i in tok.get_vocab().items() if t.isascii() and t.isdigit()}


# ---------------------------------------------------------------- data

def copy_item(length, rng, vocab, eos):
    """A synthetic copy sample for the retrieval warm-up: the prompt is 16-96 random tokens, the
    answer the same tokens again. Every answer token is found by copying from the prompt, so the
    loss is dense in the signal that builds copying (induction) heads; a needle task gives that
    signal for its ~7 value tokens alone. Same tuple as TaskStream.tokenize's items."""
    n = rng.randint(16, max(16, min(96, length // 2)))
    seq = [rng.randrange(len(SPECIALS), vocab) for _ in range(n)]
    return (length, seq, seq + [eos], n + 1)


KV_KEYS = ("letters", "tokens")
KV_OPEN, KV_CLOSE = "Remember these numbers.", "\nRecall them."  # the drill's text around its lines
KV_TEMPLATE = KV_OPEN + KV_CLOSE


def single_token_keys(tok):
    """The words of the tokenizer's vocabulary (3-8 lowercase letters) that stay one token as a
    drill key, after a newline and before " is: ", on the first line and on later ones: keys
    that a model can match with one token's identity (random letter keys are 3-5 BPE pieces,
    whose last is often shared by many keys). Words that are pieces of the drill's own text
    ("Remember these numbers.", "Recall them.") are left out: a key must occur once a line."""
    template = {tok.id_to_token(i) for i in tok.encode(KV_TEMPLATE, add_special_tokens=False).ids}
    words = []
    for t in sorted(tok.get_vocab()):
        if not (t.isascii() and t.isalpha() and t.islower() and 3 <= len(t) <= 8) or t in template:
            continue
        if all(t in [tok.id_to_token(i) for i in tok.encode(pre + t + " is: ", add_special_tokens=False).ids]
               for pre in ("\n", ".\n")):
            words.append(t)
    return words


def kv_text(pairs, rng, digits=7, asked=6, keys=None):
    """The text of a key-value recall sample (an associative recall drill shaped like the needle
    tasks): the prompt lists `pairs` lines "KEY is: VALUE." with random letter keys and values of
    `digits` random digits, then asks for some of them back; the answer repeats `asked` (at most
    the pairs) of those lines in another order. Each answer value is found by matching its key
    in the prompt and reading the digits after it, the circuit a needle question needs, but
    several values a sample instead of one. `keys`: a list of words to draw the keys from
    (single_token_keys) instead of random letters. Returns (prompt, answer, the answer's value
    spans as (start, end) character offsets)."""
    def key():
        if keys:
            return rng.choice(keys)
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 7)))
    listed, seen = [], set()
    while len(listed) < max(2, pairs):
        k = key()
        if k not in seen:
            seen.add(k)
            listed.append((k, "".join(rng.choice("0123456789") for _ in range(digits))))
    chosen = rng.sample(listed, min(asked, len(listed)))
    prompt = KV_OPEN + "".join(f"\n{k} is: {v}." for k, v in listed) + KV_CLOSE
    answer, spans = "", []
    for k, v in chosen:
        answer += f"\n{k} is: "
        spans.append((len(answer), len(answer) + len(v)))
        answer += f"{v}."
    return prompt, answer, spans


_KEY_POOLS = {}


def kv_item(length, rng, tok, eos, pairs=0, digits=7, asked=6, keys="letters"):
    """A kv_text sample tokenized to fit `length` tokens (prompt, answer and EOS; the answer
    within the 128-token budget): the tuple of TaskStream.tokenize's items plus a fifth element,
    the answer tokens that may be masked (build_batch): the value tokens alone. The keys of the
    answer stay visible, so each masked value is determined by its key (with the keys masked
    too, as before this element existed, a wholly masked answer line cannot be predicted: the
    answer asks its keys in a random order). The prompt starts at `pairs` pairs (0: length / 32,
    about half of `length` with the 4096-token BPE) and loses pairs until the sample fits. `keys`
    (KV_KEYS): random letter strings, or words that are single tokens of `tok`."""
    if keys not in KV_KEYS:
        raise ValueError(f"--kv-keys: expected one of {', '.join(KV_KEYS)}, got {keys!r}")
    pool = None
    if keys == "tokens":
        if id(tok) not in _KEY_POOLS:
            _KEY_POOLS[id(tok)] = (tok, single_token_keys(tok))  # (tok kept: its id stays its own)
        pool = _KEY_POOLS[id(tok)][1]
        if len(pool) < 2:
            raise ValueError("--kv-keys tokens: the tokenizer has fewer than 2 single-token words")
    pairs = pairs or max(2, length // 32)
    while True:
        prompt, answer, spans = kv_text(pairs, rng, digits, asked, pool)
        p = tok.encode(prompt, add_special_tokens=False).ids
        enc = tok.encode(answer, add_special_tokens=False)
        t = enc.ids
        if (len(p) + len(t) + 1 <= length and len(t) <= 128) or pairs == 2:
            value = [any(lo <= a and b <= hi for lo, hi in spans) and a < b for a, b in enc.offsets]
            return (length, p, t[:128] + [eos], 128, value[:128] + [False])
        pairs = max(2, pairs * 3 // 4)


class TaskStream:
    """Tokenized samples from `sparsa ruler generate`, produced by a background thread."""

    def __init__(self, sparsa, tokenizer_path, lengths, tasks, seed0, chunk, threads, maxsize=4096, copy_frac=0.0,
                 kv_frac=0.0, kv_shape=(0, 7, 6, "letters"), start=True):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(tokenizer_path)
        self.eos = self.tok.token_to_id(SPECIALS[0])
        self.copy_frac = copy_frac
        self.kv_frac = kv_frac
        self.kv_shape = kv_shape  # kv_item's (pairs, digits, asked, keys)
        if copy_frac < 0 or kv_frac < 0 or copy_frac + kv_frac > 1:
            raise ValueError(f"copy share {copy_frac} and key-value share {kv_frac}: each >= 0, together <= 1")
        self.args = (sparsa, tokenizer_path, lengths, tasks, chunk, threads)
        self.seed = seed0
        self.q = queue.Queue(maxsize=maxsize)
        self.error = None
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        if start:  # (start=False: a stream for its tokenizer and synthetic() alone, as validation's)
            self.thread.start()

    def tokenize(self, rows):
        prompts = self.tok.encode_batch([r["input"] for r in rows], add_special_tokens=False)
        targets = self.tok.encode_batch([r["target"] for r in rows], add_special_tokens=False)
        return [(r["max_len"], p.ids, t.ids + [self.eos], r["gen_tokens"]) for r, p, t in zip(rows, prompts, targets)]

    def _run(self):
        sparsa, tokenizer_path, lengths, tasks, chunk, threads = self.args
        try:
            while not self.stop:
                if self.all_synthetic():
                    # synthetic samples only: no generator call (its tasks need not fit the lengths);
                    # empty items of each length, which synthetic() replaces
                    items = [(L, [], [], 0) for L in lengths for _ in range(chunk)]
                else:
                    rows = ruler_generate(sparsa, tasks, lengths, chunk, self.seed, tokenizer_path, threads)
                    if not rows:
                        raise RuntimeError(f"no task of '{tasks}' fits the lengths {lengths} (sparsa ruler generate "
                                           "skipped them all)")
                    items = self.tokenize(rows)
                self.seed += 1
                rng = random.Random(self.seed)
                if self.copy_frac > 0 or self.kv_frac > 0:
                    items = [self.synthetic(it, rng) for it in items]
                rng.shuffle(items)
                for it in items:
                    while not self.stop:
                        try:
                            self.q.put(it, timeout=1)
                            break
                        except queue.Full:
                            pass
        except Exception as e:  # reported by get()
            self.error = e

    def all_synthetic(self):
        return self.copy_frac + self.kv_frac >= 1 - 1e-9

    def synthetic(self, item, rng):
        """`item`, or in its place (same length bucket) a copy or a key-value sample."""
        u = rng.random()
        if u < self.copy_frac:
            return copy_item(item[0], rng, self.tok.get_vocab_size(), self.eos)
        if u < self.copy_frac + self.kv_frac or self.all_synthetic():
            return kv_item(item[0], rng, self.tok, self.eos, *self.kv_shape)
        return item

    def get(self):
        """The next sample, or None once stopped."""
        while not self.stop:
            if self.error:
                raise self.error
            try:
                return self.q.get(timeout=1)
            except queue.Empty:
                pass
        return None

    def close(self):
        """Stops the producer and waits for it (a thread left inside torch or a subprocess at
        interpreter exit aborts the process)."""
        self.stop = True
        if self.thread.is_alive():
            self.thread.join(timeout=120)


ANSWER_TOKENS = 160  # the generation budget (at most 128 tokens) plus EOS and a partial first block


def noisy_budget(c: SdarConfig, prompt_blocks, answer_tokens=ANSWER_TOKENS):
    """Tokens reserved for noisy copies: the answer's blocks (`answer_tokens` rounded up to
    blocks: 10 blocks of 16 by default; `train --answer-tokens`) plus the prompt blocks."""
    return c.block_size * (prompt_blocks + -(-answer_tokens // c.block_size))


# Copy ids from here up mark padding tokens: each is its own singleton copy, so it sees only
# itself and nothing sees it (build_batch, build_batch_llada, pad_rows).
PAD_COPY = 10**6


def mask_rate(gen, t_range):
    """t ~ U(lo, hi): the masking rate of one noisy block (its tokens masked with probability t,
    their loss weighted 1/t)."""
    lo, hi = t_range
    return lo + (hi - lo) * float(torch.rand((), generator=gen))


FULL_T = (1e-3, 1.0)  # MDLM's whole range (t = 0 excluded: its 1/t weight)


def answer_maskable(item, L):
    """[L] bools: which tokens of the canvas prompt + target (+ EOS padding to L) a noisy copy
    may mask. Prompt tokens never; answer tokens all, unless the item carries a fifth element,
    the target's maskable tokens (kv_item: the values, with their keys kept visible), and then
    those alone (not the padding)."""
    P, n = len(item[1]), len(item[2])
    if len(item) > 4 and item[4] is not None:
        return [False] * P + list(item[4]) + [False] * (L - P - n)
    return [False] * P + [True] * (L - P)


def build_batch(items, c: SdarConfig, prompt_blocks, gen: torch.Generator, seq_len=None, t_range=FULL_T,
                full_mask=0.0, answer_tokens=ANSWER_TOKENS):
    """Two-stream sequences [B, N]: ids, positions, block ids, copy ids (-1 clean), labels
    (-100 where no loss), weights (1/t). N = seq_len (fixed shapes for torch.compile) or the
    batch's own maximum. Returns tensors and the token count the loss is averaged over."""
    Bsz = c.block_size
    rows = []
    for item in items:
        prompt, target = item[1], item[2]
        x0 = prompt + target
        L = -(-len(x0) // Bsz) * Bsz
        x0 = x0 + [c.eos_id] * (L - len(x0))
        P = len(prompt)
        maskable = answer_maskable(item, L)
        first_answer = P // Bsz
        blocks = [(b, max(b * Bsz, P)) for b in range(first_answer, L // Bsz)
                  if any(maskable[max(b * Bsz, P):(b + 1) * Bsz])]  # (a block with nothing to mask: no copy)
        budget = noisy_budget(c, prompt_blocks, answer_tokens) // Bsz
        blocks = blocks[-budget:]  # never more than the budget (the answer's last blocks)
        choices = list(range(first_answer))
        for _ in range(min(prompt_blocks, len(choices), budget - len(blocks))):
            b = choices.pop(int(torch.randint(len(choices), (1,), generator=gen)))
            blocks.append((b, b * Bsz))
        ids, pos, blk, copy = list(x0), list(range(L)), [i // Bsz for i in range(L)], [-1] * L
        labels, weights = [-100] * L, [0.0] * L
        eligible = 0
        for j, (b, lo) in enumerate(blocks):
            hi = (b + 1) * Bsz
            t = mask_rate(gen, t_range)
            if full_mask > 0 and b >= first_answer and float(torch.rand((), generator=gen)) < full_mask:
                t = 1.0  # the whole answer block: the block loop's first step, where retrieval has no help
            allowed = maskable[lo:hi] if b >= first_answer else [True] * (hi - lo)  # noisy prompt blocks: all
            m = [u and ok for u, ok in zip((torch.rand(hi - lo, generator=gen) < t).tolist(), allowed)]
            if not any(m):
                where = [i for i, ok in enumerate(allowed) if ok]
                m[where[int(torch.randint(len(where), (1,), generator=gen))]] = True
            for i in range(b * Bsz, hi):
                masked = i >= lo and m[i - lo]
                ids.append(c.mask_id if masked else x0[i])
                pos.append(i)
                blk.append(b)
                copy.append(j)
                labels.append(x0[i] if masked else -100)
                weights.append(1.0 / t if masked else 0.0)
            eligible += sum(allowed)
        rows.append((ids, pos, blk, copy, labels, weights, eligible))
    N = seq_len or max(len(r[0]) for r in rows)
    out = {k: [] for k in ("ids", "pos", "blk", "copy", "labels", "weights")}
    total = 0
    for ids, pos, blk, copy, labels, weights, eligible in rows:
        pad = N - len(ids)
        if pad < 0:
            raise ValueError(f"a sequence of {len(ids)} tokens exceeds the batch length {N}")
        # Padding: noisy-stream singletons (own copy id, block 0): they see only themselves and
        # nothing sees them.
        out["ids"].append(ids + [c.eos_id] * pad)
        out["pos"].append(pos + [0] * pad)
        out["blk"].append(blk + [0] * pad)
        out["copy"].append(copy + list(range(PAD_COPY, PAD_COPY + pad)))
        out["labels"].append(labels + [-100] * pad)
        out["weights"].append(weights + [0.0] * pad)
        total += eligible
    t = {k: torch.tensor(v, dtype=torch.float32 if k == "weights" else torch.long) for k, v in out.items()}
    return t, total


LLADA_BLOCK = 32  # eval-model's remask blocks: the answer region is gen_tokens rounded up to them


def build_batch_llada(items, c: SdarConfig, gen: torch.Generator, seq_len=None, t_range=FULL_T, full_mask=0.0):
    """Masked diffusion for a bidirectional (llada) model, as LLaDA's SFT: the canvas is the
    prompt then the answer region (target + EOS, EOS-padded to gen_tokens rounded up to 32
    tokens, what the remask loop decodes), the region masked at one rate t ~ U(0, 1) per sample
    (t = 1 for a share full_mask of the samples: every maskable token, the remask loop's first
    step), CE / t on the masked tokens over the region's length. Same tensors as build_batch:
    every real token is 'clean' in block 0 (all see all), padding singletons see only themselves."""
    out = {k: [] for k in ("ids", "pos", "blk", "copy", "labels", "weights")}
    rows, total = [], 0
    for item in items:
        prompt, target, gen_tokens = item[1], item[2], item[3]
        region = -(-gen_tokens // LLADA_BLOCK) * LLADA_BLOCK
        answer = (target + [c.eos_id] * region)[:region]
        P = len(prompt)
        allowed = answer_maskable(item, P + max(region, len(target)))[P:P + region]
        t = mask_rate(gen, t_range)
        if full_mask > 0 and float(torch.rand((), generator=gen)) < full_mask:
            t = 1.0
        m = [u and ok for u, ok in zip((torch.rand(region, generator=gen) < t).tolist(), allowed)]
        if not any(m):
            where = [i for i, ok in enumerate(allowed) if ok]
            m[where[int(torch.randint(len(where), (1,), generator=gen))]] = True
        ids = prompt + [c.mask_id if m[i] else answer[i] for i in range(region)]
        labels = [-100] * P + [answer[i] if m[i] else -100 for i in range(region)]
        weights = [0.0] * P + [1.0 / t if m[i] else 0.0 for i in range(region)]
        rows.append((ids, labels, weights))
        total += sum(allowed)
    N = seq_len or max(len(r[0]) for r in rows)
    for ids, labels, weights in rows:
        n, pad = len(ids), N - len(ids)
        if pad < 0:
            raise ValueError(f"a sequence of {n} tokens exceeds the batch length {N}")
        out["ids"].append(ids + [c.eos_id] * pad)
        out["pos"].append(list(range(n)) + [0] * pad)
        out["blk"].append([0] * N)
        out["copy"].append([-1] * n + list(range(PAD_COPY, PAD_COPY + pad)))
        out["labels"].append(labels + [-100] * pad)
        out["weights"].append(weights + [0.0] * pad)
    t = {k: torch.tensor(v, dtype=torch.float32 if k == "weights" else torch.long) for k, v in out.items()}
    return t, total


def make_batch(items, c: SdarConfig, prompt_blocks, gen, seq_len=None, t_range=FULL_T, full_mask=0.0,
               answer_tokens=ANSWER_TOKENS):
    if c.arch == "llada":
        return build_batch_llada(items, c, gen, seq_len, t_range, full_mask)
    return build_batch(items, c, prompt_blocks, gen, seq_len, t_range, full_mask, answer_tokens)


def dense_mask(blk, copy):
    """[B, N, N] bool: clean queries see clean keys of their block and before; a noisy copy of
    block b sees clean keys of blocks < b and its own copy."""
    qb, kb, qc, kc = blk[:, :, None], blk[:, None, :], copy[:, :, None], copy[:, None, :]
    clean_q, clean_k = qc < 0, kc < 0
    return (clean_q & clean_k & (kb <= qb)) | (~clean_q & clean_k & (kb < qb)) | (~clean_q & ~clean_k & (kc == qc))


def flex_block_mask(blk, copy):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, k):
        qb, kb, qc, kc = blk[b, q], blk[b, k], copy[b, q], copy[b, k]
        clean_q, clean_k = qc < 0, kc < 0
        return (clean_q & clean_k & (kb <= qb)) | (~clean_q & clean_k & (kb < qb)) | (~clean_q & ~clean_k & (kc == qc))

    B, N = blk.shape
    # compiled on the GPU: the mask is evaluated block by block, never as a [B, N, N] tensor
    return create_block_mask(mask_mod, B, None, N, N, device=blk.device, _compile=blk.device.type == "cuda")


STEP_KEYS = ("ids", "pos", "blk", "copy", "rows", "row_labels", "row_weights")  # what loss_of moves to the device


def with_loss_rows(batch):
    """The batch (host tensors) with the rows the loss reads, found on the host where the batch
    is built: "rows" (flat indices of the noisy copies' masked tokens), their "row_labels" and
    "row_weights". A boolean index on the device would make every step wait for the GPU."""
    flat = batch["labels"].reshape(-1)
    rows = (flat != -100).nonzero().squeeze(1)
    return {**batch, "rows": rows, "row_labels": flat[rows], "row_weights": batch["weights"].reshape(-1)[rows]}


def loss_of(model, batch, total, attention, compiled_flex=None):
    dev = model.embed_tokens.weight.device
    if "rows" not in batch:
        batch = with_loss_rows(batch)
    b = {k: batch[k].to(dev, non_blocking=True) for k in STEP_KEYS}
    if attention == "flex":
        attn = flex_attention_fn(flex_block_mask(b["blk"], b["copy"]), compiled_flex)
    else:
        attn = sdpa_attention(dense_mask(b["blk"], b["copy"]))
    h = model.hidden(b["ids"], b["pos"], attn)
    # the head only where there is a loss: the masked tokens of the noisy copies
    logits = model.head(h.reshape(-1, h.shape[-1]).index_select(0, b["rows"])).float()
    ce = F.cross_entropy(logits, b["row_labels"], reduction="none")
    # the objective (the ELBO's 1/t weights) and, to watch, the plain cross-entropy per masked token
    return (ce * b["row_weights"]).sum() / max(total, 1), ce.sum().detach() / max(int(batch["rows"].numel()), 1)


# ---------------------------------------------------------------- checkpoints

def run_files(run):
    return {"config": os.path.join(run, "run.json"), "ckpt": os.path.join(run, "ckpt.pt"),
            "tokenizer": os.path.join(run, "tokenizer.json"), "log": os.path.join(run, "log.jsonl")}


MAX_PARAMETERS = 2 ** 31  # 8 GiB of f32 weights, twice that again in AdamW's moments
MAX_ROPE_ENTRIES = 2 ** 28


def run_parameters(c):
    """About how many parameters the model of ``c`` has: the tied embedding, then per layer the
    attention's projections and the SwiGLU MLP."""
    attention = c.dim * (c.heads + 2 * c.kv_heads) * c.head_dim + c.heads * c.head_dim * c.dim
    return c.vocab_size * c.dim + c.layers * (attention + 3 * c.dim * c.hidden)


def load_run(run):
    """The model configuration of run.json; a file that is damaged, or whose model fields are
    missing, unknown, mistyped or out of range, exits with the file and the field named."""
    f = run_files(run)
    if not os.path.exists(f["config"]):
        sys.exit(f"train_sdar: {run}: no run.json (run `train_sdar.py tokenizer --run {run}` first)")
    try:
        with open(f["config"], encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        sys.exit(f"train_sdar: {f['config']}: not readable JSON ({type(e).__name__}: {str(e)[:200]})")
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict):
        sys.exit(f"train_sdar: {f['config']}: model: expected an object of the model's fields")
    defaults = SdarConfig()
    for key, value in model.items():
        if not hasattr(defaults, key):
            sys.exit(f"train_sdar: {f['config']}: model.{key}: unknown field")
        want = type(getattr(defaults, key))
        ok = isinstance(value, (int, float)) and math.isfinite(value) if want is float else isinstance(value, want)
        if isinstance(value, bool) or not ok:
            sys.exit(f"train_sdar: {f['config']}: model.{key}: expected {want.__name__}, got {value!r}")
    c = SdarConfig(**model)
    problems = [f"model.{k}: expected a positive integer, got {getattr(c, k)}"
                for k in ("vocab_size", "dim", "layers", "heads", "kv_heads", "head_dim", "hidden", "block_size",
                          "max_len") if getattr(c, k) < 1]
    problems += [f"model.heads: expected a multiple of kv_heads ({c.kv_heads}), got {c.heads}"] \
        if not problems and c.heads % c.kv_heads else []
    problems += [f"model.{k}: expected a token id below vocab_size ({c.vocab_size}), got {getattr(c, k)}"
                 for k in ("mask_id", "eos_id") if not 0 <= getattr(c, k) < c.vocab_size]
    problems += ["model.head_dim: expected an even number (RoPE turns pairs)"] if c.head_dim % 2 else []
    problems += [f"model.rope_theta: expected a number above 1, got {c.rope_theta}"] if not c.rope_theta > 1 else []
    problems += [f"model.eps: expected a positive number, got {c.eps}"] if not c.eps > 0 else []
    problems += [f"model.arch: expected sdar or llada, got {c.arch!r}"] if c.arch not in ("sdar", "llada") else []
    if not problems and run_parameters(c) > MAX_PARAMETERS:
        problems.append(f"model: about {run_parameters(c):.3g} parameters, more than the {MAX_PARAMETERS:.3g} "
                        "this trainer allows")
    if not problems and c.max_len * c.head_dim > MAX_ROPE_ENTRIES:
        problems.append(f"model.max_len: its RoPE table of max_len x head_dim entries would exceed {MAX_ROPE_ENTRIES}")
    if problems:
        sys.exit(f"train_sdar: {f['config']}: {problems[0]}")
    return c


def load_ckpt(path, device="cpu"):
    """A run's checkpoint, read as data only (``weights_only``: tensors, numbers, strings, lists
    and dicts, never code from the file); a damaged or foreign file exits with its name."""
    try:
        ck = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # a truncated or foreign file fails in the zip, pickle or tensor reader
        sys.exit(f"train_sdar: {path}: not a readable checkpoint ({type(e).__name__}: {str(e)[:200]}); "
                 "start a new run, or --init it from an export")
    state = ck.get("state") if isinstance(ck, dict) else None
    if not (isinstance(ck, dict) and isinstance(ck.get("model"), dict) and isinstance(ck.get("opt"), dict)
            and isinstance(state, dict) and type(state.get("step")) is int and type(state.get("tokens")) is int
            and isinstance(state.get("stages"), list) and isinstance(state.get("history"), list)):
        sys.exit(f"train_sdar: {path}: not a checkpoint of train_sdar (model, opt and state with step, tokens, "
                 "stages and history)")
    return ck


def restore(model, ck, path, opt=None):
    """The checkpoint's weights (and optimizer state) into ``model`` (and ``opt``), or an exit
    naming the file when they do not fit."""
    try:
        model.load_state_dict(ck["model"])
        if opt is not None:
            opt.load_state_dict(ck["opt"])
    except Exception as e:  # torch raises a different type for each way a state can fail to fit
        sys.exit(f"train_sdar: {path}: its weights do not fit this run's model ({type(e).__name__}: "
                 f"{str(e)[:200]})")


def save_ckpt(run, model, opt, state):
    f = run_files(run)
    tmp = f["ckpt"] + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, tmp)
    os.replace(tmp, f["ckpt"])  # an interrupted save never leaves a broken checkpoint


# ---------------------------------------------------------------- commands

def cmd_tokenizer(a):
    os.makedirs(a.run, exist_ok=True)
    f = run_files(a.run)
    sparsa = find_sparsa(a.sparsa)
    try:
        tok = train_tokenizer(sparsa, f["tokenizer"], a.vocab, samples=a.samples, numbers=a.numbers)
    except ValueError as e:
        sys.exit(f"train_sdar: {e}")
    c = SdarConfig(vocab_size=tok.get_vocab_size(), dim=a.dim, layers=a.layers, heads=a.heads,
                   kv_heads=a.kv_heads, head_dim=a.head_dim, hidden=a.hidden, block_size=a.block,
                   max_len=a.max_len, rope_theta=a.rope_theta, mask_id=tok.token_to_id(SPECIALS[1]),
                   eos_id=tok.token_to_id(SPECIALS[0]), arch=a.arch)
    with open(f["config"], "w") as fh:
        json.dump({"model": c.__dict__, "seed": a.seed}, fh, indent=2)
    log(f"tokenizer: {tok.get_vocab_size()} tokens -> {f['tokenizer']}; model config -> {f['config']}")


def cmd_stages(a):
    for n, s in STAGES.items():
        print(f"stage {n}: lengths {','.join(map(str, s['lengths']))}  lr {s['lr']}  warmup {s['warmup']}  "
              f"tasks {s.get('tasks', 'all')}  noisy prompt blocks {s.get('prompt_blocks', 2)}  "
              f"copy samples {s.get('copy', 0.0):.0%}  key-value samples {s.get('kv', 0.0):.0%}  "
              f"answer blocks wholly masked {s.get('full', 0.0):.0%}  t ~ U{s.get('t_range', FULL_T)}")


def mask_rates_arg(text):
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI, got '{text}'")
    if not 0 < lo <= hi <= 1:
        raise argparse.ArgumentTypeError(f"expected 0 < LO <= HI <= 1, got '{text}'")
    return (lo, hi)


def int_at_least(minimum):
    """An argparse type: an integer >= minimum (the error names the value, argparse the option)."""
    def parse(text):
        try:
            x = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got '{text}'")
        if x < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got '{text}'")
        return x
    return parse


def add_kv_shape(parser):
    """The key-value drill's shape (kv_item's pairs, digits, asked, keys), the same for train and probe."""
    parser.add_argument("--kv-pairs", type=int_at_least(0), default=0, metavar="N",
                        help="pairs a key-value sample lists (0: the length / 32, fewer while it does not fit)")
    parser.add_argument("--kv-digits", type=int_at_least(1), default=7, metavar="D",
                        help="digits of a key-value sample's values (7: a needle's; with --numbers triples 3 is "
                             "one token)")
    parser.add_argument("--kv-keys", choices=KV_KEYS, default="letters",
                        help="the drill's keys: random letter strings (3-5 BPE pieces each), or words that are "
                             "single tokens of the run's tokenizer (a key matched by one token's identity)")
    parser.add_argument("--kv-asked", type=int_at_least(1), default=6, metavar="N",
                        help="pairs a key-value sample asks back (its answer; keys visible, values maskable); keep "
                             "it well under the pairs: the values of earlier answer lines are clean context to "
                             "later blocks, and with every pair asked the last ones are found by elimination")


def share_arg(text):
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1], got '{text}'")
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1], got '{text}'")
    return x


def parse_plan(a):
    """The stages this call trains: `--stage N [--minutes M | --steps S]` (with optional
    --lengths/--lr/--warmup overrides) or `--plan "1:3,2:3,3:4"` (stage:minutes, one process)."""
    if (a.stage is None) == (a.plan is None):
        sys.exit("train_sdar: give --stage N or --plan \"N:MINUTES,...\" (one of them)")
    if a.plan is None:
        if a.stage not in STAGES and not a.lengths:
            sys.exit(f"train_sdar: --stage: expected one of {sorted(STAGES)} (or give --lengths), got {a.stage}")
        stage = dict(STAGES.get(a.stage, {"lr": 1e-3, "warmup": 100}))
        if a.lengths:
            stage["lengths"] = [int(x) for x in a.lengths.split(",")]
        if a.lr:
            stage["lr"] = a.lr
        if a.warmup:
            stage["warmup"] = a.warmup
        return [(a.stage, stage, a.minutes, a.steps)]
    if a.lengths or a.lr or a.warmup or a.minutes or a.steps:
        sys.exit("train_sdar: --plan takes each stage's lengths, lr, warm-up and minutes from the curriculum; "
                 "--lengths, --lr, --warmup, --minutes and --steps go with --stage")
    plan = []
    for item in a.plan.split(","):
        n, sep, m = item.strip().partition(":")
        try:
            n, m = int(n), float(m)
        except ValueError:
            n, m = None, 0.0
        if not sep or n not in STAGES or not m > 0:
            sys.exit(f"train_sdar: --plan: expected STAGE:MINUTES items with STAGE in {sorted(STAGES)} and "
                     f"MINUTES > 0, got '{item}'")
        plan.append((n, dict(STAGES[n]), m, 0))
    return plan


def pad_rows(batch, rows):
    """Pads a batch to `rows` rows with rows that carry no loss (padding singletons: each token
    sees only itself), so every batch of a length bucket has the same shape: torch.compile then
    compiles each bucket once (a new shape would recompile, and past dynamo's limit flex
    attention falls back to its unfused eager form)."""
    B, N = batch["ids"].shape
    if B >= rows:
        return batch
    extra = rows - B
    fill = {"ids": batch["ids"][0, -1].item(), "pos": 0, "blk": 0, "labels": -100, "weights": 0.0}
    out = {}
    for k, v in batch.items():
        if k == "copy":
            pad = (PAD_COPY + torch.arange(N, dtype=v.dtype)).expand(extra, N)
        else:
            pad = torch.full((extra, N), fill[k], dtype=v.dtype)
        out[k] = torch.cat([v, pad])
    return out


def param_groups(model, weight_decay):
    """AdamW's groups: weight decay on the matrices (projections, embedding = tied head), none on
    the RMSNorm gains. Decay pulls the q/k norm gains toward 0, and with QK-norm those gains
    bound every attention logit (|q.k| / sqrt(d) <= sqrt(d) g_q g_k): the sharp attention that
    retrieving one needle among thousands of tokens needs would be held back."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def cmd_train(a):
    c = load_run(a.run)
    f = run_files(a.run)
    sparsa = find_sparsa(a.sparsa)
    plan = parse_plan(a)
    for n, stage, _, _ in plan:
        if max(stage["lengths"]) > c.max_len:
            sys.exit(f"train_sdar: stage {n}'s length {max(stage['lengths'])} exceeds the model's max_len {c.max_len}")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    attention = a.attention or ("flex" if device.type == "cuda" else "sdpa")
    torch.manual_seed(a.seed)
    model = Sdar(c).to(device)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=plan[0][1]["lr"], betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    state = {"step": 0, "tokens": 0, "stages": [], "history": []}
    if os.path.exists(f["ckpt"]):
        ck = load_ckpt(f["ckpt"], device)
        groups = ck["opt"].get("param_groups")
        if isinstance(groups, list) and len(groups) != len(opt.param_groups):
            sys.exit(f"train_sdar: {f['ckpt']}: its optimizer has {len(groups)} parameter "
                     f"group(s), this version {len(opt.param_groups)} (matrices decayed, norm gains not); "
                     "start a new run")
        restore(model, ck, f["ckpt"], opt)
        state = ck["state"]
        log(f"resumed {f['ckpt']} at step {state['step']}")
    elif a.init:
        # Weights from an export (a lost machine keeps what came back: the export, not the
        # checkpoint with its optimizer state); AdamW's moments start anew, the record carries on.
        try:
            import_hf(model, a.init)
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"train_sdar: --init: {e}")
        rec = os.path.join(a.init, "training.json")
        if os.path.exists(rec):
            try:
                with open(rec, encoding="utf-8") as fh:
                    r = json.load(fh)
            except (OSError, ValueError, RecursionError) as e:
                sys.exit(f"train_sdar: {rec}: not readable JSON ({type(e).__name__}: {str(e)[:200]})")
            if not isinstance(r, dict):
                sys.exit(f"train_sdar: {rec}: expected a JSON object, got a {type(r).__name__}")
            record = {"step": r.get("steps", 0), "tokens": r.get("tokens", 0), "stages": r.get("stages", []),
                      "history": r.get("history", [])}
            if not (type(record["step"]) is int and type(record["tokens"]) is int
                    and isinstance(record["stages"], list) and isinstance(record["history"], list)):
                sys.exit(f"train_sdar: {rec}: expected steps and tokens (integers), stages and history (lists)")
            state.update(record)
        log(f"initialised from the export {a.init} at step {state['step']} (new optimizer state)")
    compiled_flex = None
    if device.type == "cuda" and attention == "flex":
        import torch._dynamo as dynamo
        from torch.nn.attention.flex_attention import flex_attention
        # Every (rows, length) bucket compiles once, for training and for validation; a plan of
        # several stages sees up to a dozen shapes. Past the limit dynamo would fall back to
        # the eager (unfused, N x N) flex attention without failing.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, 64)
        compiled_flex = torch.compile(flex_attention, dynamic=False)
    if a.compile:
        model.compile_layers()  # the state_dict is unchanged
    for n, stage, minutes, steps in plan:
        train_stage(a, c, f, sparsa, device, attention, compiled_flex, model, opt, state, n, stage, minutes, steps)
        if a.export:
            export_run(a.run, model, state, a.export, a.export_dtype, a.shard_mb)


def check_finite(model, state):
    """Exit (the checkpoint on disk untouched) if a weight is not finite: the last step's loss
    can be finite while its update overflowed the weights."""
    if not bool(torch.stack([p.detach().isfinite().all() for p in model.parameters()]).all()):
        sys.exit(f"train_sdar: a weight became non-finite by step {state['step']}; the checkpoint keeps the last "
                 "good state")


class Profiler:
    """`train --profile N`: torch.profiler over N training steps of the first stage, from its
    sixth step on (after the warm-ups, which compile every shape), then the operators that took
    the most device time (self device time on a GPU, self CPU time otherwise) and the steps' wall
    time in the log: where a step's time goes, measured inside a real run."""

    FIRST = 5

    def __init__(self, steps, device):
        self.steps, self.device, self.prof, self.t0 = steps, device, None, 0.0

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_step(self, done):
        if done == self.FIRST and self.prof is None:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.sync()
            self.prof = profile(activities=acts)
            self.prof.__enter__()
            self.t0 = time.time()

    def after_step(self, done):
        """True once the profile is written."""
        if self.prof is None or done < self.FIRST + self.steps:
            return False
        self.sync()
        wall = time.time() - self.t0
        self.prof.__exit__(None, None, None)
        key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self.prof.key_averages().table(sort_by=key, row_limit=25)
        log(f"profile of steps {self.FIRST + 1}-{self.FIRST + self.steps}: {wall / self.steps * 1e3:.1f} ms a step "
            f"(wall, synchronised), operators by {key}:\n{table}")
        self.prof = None
        return True

    def abandon(self):
        """The stage ended before the profile's last step: stop it if it started, and say so."""
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.prof = None
        log(f"profile: the stage ended before {self.FIRST + self.steps} steps; nothing profiled")


def step_batches(stream, buckets, c, prompt_blocks, gen, t_range, full_mask, answer_tokens):
    """The training batches of a sample stream: samples fill their length's bucket (`buckets`:
    rows and sequence length per length, and the bucket's waiting items); a full bucket is one
    batch of all a step reads (STEP_KEYS), with the token count its loss is averaged over.
    Ends when the stream stops."""
    while True:
        item = stream.get()
        if item is None:
            return
        bk = buckets[item[0]]
        bk["items"].append(item)
        if len(bk["items"]) >= bk["rows"]:
            items, bk["items"] = bk["items"], []
            batch, total = make_batch(items, c, prompt_blocks, gen, bk["seq"], t_range, full_mask, answer_tokens)
            batch = with_loss_rows(batch)
            yield {k: batch[k] for k in STEP_KEYS}, total  # (labels and weights: as the rows')


WORKER_SEED_STRIDE = 100_000_000  # data worker w's generator seeds start at the stage's seed0 + w * this


def data_worker(spec, worker, out, stop):
    """`train --data-workers N`: one process of the data side. Its own sample stream (generator
    seeds from spec's seed0 + worker * WORKER_SEED_STRIDE up, so no two workers draw the same
    sample) and masking generator build whole batches (step_batches) and put them on `out`
    until `stop` is set; an error goes on `out` for the training loop to raise. Sampling and
    masking are Python loops: in the training process they hold the interpreter lock that the
    loop needs to launch each step's kernels."""
    torch.set_num_threads(1)
    stream = None
    try:
        c = SdarConfig(**spec["config"])
        stream = TaskStream(spec["sparsa"], spec["tokenizer"], spec["lengths"], spec["tasks"],
                            spec["seed0"] + worker * WORKER_SEED_STRIDE, spec["chunk"], spec["threads"],
                            copy_frac=spec["copy_frac"], kv_frac=spec["kv_frac"], kv_shape=tuple(spec["kv_shape"]))
        gen = torch.Generator().manual_seed(spec["gen_seed"] + 7_777_777 * (worker + 1))
        buckets = {L: {"rows": b["rows"], "seq": b["seq"], "items": []} for L, b in spec["buckets"].items()}
        for got in step_batches(stream, buckets, c, spec["prompt_blocks"], gen, tuple(spec["t_range"]),
                                spec["full_mask"], spec["answer_tokens"]):
            # as numpy arrays, pickled by value: a tensor would travel as a shared-memory handle
            # that its receiver can no longer open once this process has ended
            got = ({k: v.numpy() for k, v in got[0].items()}, got[1])
            while not stop.is_set():
                try:
                    out.put(got, timeout=1)
                    break
                except queue.Full:
                    pass
            if stop.is_set():
                break
    except Exception as e:  # raised by the training loop
        out.put(RuntimeError(f"data worker {worker}: {type(e).__name__}: {e}"))
    finally:
        if stream is not None:
            stream.close()


def stop_data_workers(procs, out, stop, timeout=60):
    """Stops the data workers: sets `stop`, takes what they still put on `out` (a worker blocked
    on a full queue sees the stop once its put times out), waits for them, and ends any that
    have not stopped by `timeout` seconds."""
    stop.set()
    deadline = time.time() + timeout
    while any(p.is_alive() for p in procs) and time.time() < deadline:
        try:
            out.get(timeout=0.2)
        except queue.Empty:
            pass
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.time()))
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)


def train_stage(a, c, f, sparsa, device, attention, compiled_flex, model, opt, state, stage_no, stage, minutes,
                steps):
    for g_ in opt.param_groups:
        g_["lr"] = stage["lr"]
    tasks = a.tasks or stage.get("tasks", "all")
    prompt_blocks = a.prompt_blocks if a.prompt_blocks is not None else stage.get("prompt_blocks", 2)
    step0 = state["step"]
    gen_seed = a.seed * 7919 + step0  # the masking generator's (a data worker derives its own from it)
    gen = torch.Generator().manual_seed(gen_seed)
    seed0 = TRAIN_SEED_BASE + 10_000 * stage_no + step0  # fresh data on every resume
    copy_frac = a.copy_frac if a.copy_frac is not None else stage.get("copy", 0.0)
    kv_frac = a.kv_frac if a.kv_frac is not None else stage.get("kv", 0.0)
    full_mask = a.full_mask if a.full_mask is not None else stage.get("full", 0.0)
    if copy_frac + kv_frac > 1:
        sys.exit(f"train_sdar: --copy-frac {copy_frac} and --kv-frac {kv_frac}: together at most 1")
    t_range = tuple(a.mask_rates) if a.mask_rates else stage.get("t_range", FULL_T)
    kv_shape = (a.kv_pairs, a.kv_digits, a.kv_asked, a.kv_keys)
    workers = a.data_workers if a.data_workers is not None else (6 if device.type == "cuda" else 0)
    # (with data workers this stream only serves validation's samples; each worker has its own)
    stream = TaskStream(sparsa, f["tokenizer"], stage["lengths"], tasks, seed0, a.chunk, a.gen_threads,
                        copy_frac=copy_frac, kv_frac=kv_frac, kv_shape=kv_shape, start=workers == 0)
    # Fixed shapes per length bucket: batch rows and sequence length.
    nb = noisy_budget(c, prompt_blocks, a.answer_tokens) if c.arch == "sdar" else 2 * LLADA_BLOCK
    buckets = {L: {"rows": max(1, a.batch_tokens // (L + nb)), "seq": -(-(L + nb) // 128) * 128, "items": []}
               for L in stage["lengths"]}
    val = None
    if a.val_samples > 0 and stream.all_synthetic():  # the drills' own samples, on fixed seeds
        vrng = random.Random(900_000 + stage_no)
        val = [stream.synthetic((L, [], [], 0), vrng) for L in stage["lengths"] for _ in range(a.val_samples)]
    elif a.val_samples > 0:
        rows = ruler_generate(sparsa, tasks, stage["lengths"], a.val_samples, 900_000 + stage_no, f["tokenizer"],
                              a.gen_threads)
        val = stream.tokenize(rows)

    def val_batches():
        g = torch.Generator().manual_seed(12345)
        for L in stage["lengths"]:
            items = [v for v in val if v[0] == L]
            for i in range(0, len(items), buckets[L]["rows"]):
                batch, total = make_batch(items[i:i + buckets[L]["rows"]], c, prompt_blocks, g, buckets[L]["seq"],
                                          t_range, full_mask, a.answer_tokens)
                yield L, pad_rows(batch, buckets[L]["rows"]), total

    def validate():
        if not val:
            return None
        model.eval()
        tot, n = 0.0, 0
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            for _, batch, total in val_batches():
                tot += float(loss_of(model, batch, total, attention, compiled_flex)[0]) * total
                n += total
        model.train()
        return tot / max(n, 1)

    if val:
        # One forward and backward and one validation forward per bucket before the stage's
        # clock starts, each timed: on the GPU this is where torch.compile compiles each shape,
        # and compilation is not training time. (No optimizer step; its own masking draws.)
        seen = set()
        for L, batch, total in val_batches():
            if L in seen:
                continue
            seen.add(L)
            t0 = time.time()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss_of(model, batch, total, attention, compiled_flex)[0].backward()
                with torch.no_grad():
                    loss_of(model, batch, total, attention, compiled_flex)
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            log(f"warm-up of length {L} ({buckets[L]['rows']} x {buckets[L]['seq']}): {time.time() - t0:.1f} s")

    start = time.time()
    last_save = last_log = start
    budget_s = minutes * 60 if minutes else float("inf")
    max_steps = steps or (1 << 62)
    losses, ces = [], []
    kv_desc = (f" of {a.kv_pairs or 'length/32'} pairs, {a.kv_digits} digits, {a.kv_asked} asked, {a.kv_keys} keys"
               if kv_frac else "")
    log(f"stage {stage_no}: lengths {stage['lengths']}, tasks {tasks} ({copy_frac:.0%} copy, {kv_frac:.0%} key-value{kv_desc}), "
        f"{prompt_blocks} noisy prompt blocks, {full_mask:.0%} answer blocks wholly masked, "
        f"t ~ U({t_range[0]:g}, {t_range[1]:g}), {attention} attention on {device}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"budget {minutes or '-'} min / {steps or '-'} steps, "
        f"{f'{workers} data worker processes' if workers else 'batches built in this process'}")
    model.train()
    done = 0
    # Batches come from a thread of their own (Python work that overlaps the GPU's), fed either
    # by this process's sample stream (--data-workers 0: one thread, so the order and the masking
    # generator's draws stay the same from run to run) or by data worker processes, whose Python
    # work does not compete with the loop's for the interpreter lock.
    batches = queue.Queue(maxsize=4)

    def deliver(got):
        while not stream.stop:
            try:
                batches.put(got, timeout=1)
                return
            except queue.Full:
                pass

    def pinned(got):
        batch, total = got
        return ({k: v.pin_memory() for k, v in batch.items()} if device.type == "cuda" else batch), total

    procs = []
    if workers:
        ctx = torch.multiprocessing.get_context("spawn")
        worker_q, worker_stop = ctx.Queue(maxsize=2 * workers), ctx.Event()
        spec = {"config": dict(c.__dict__), "sparsa": sparsa, "tokenizer": f["tokenizer"],
                "lengths": list(stage["lengths"]), "tasks": tasks, "seed0": seed0, "chunk": a.chunk,
                "threads": max(1, a.gen_threads // workers), "copy_frac": copy_frac, "kv_frac": kv_frac,
                "kv_shape": list(kv_shape), "gen_seed": gen_seed, "prompt_blocks": prompt_blocks,
                "t_range": list(t_range), "full_mask": full_mask, "answer_tokens": a.answer_tokens,
                "buckets": {L: {"rows": b["rows"], "seq": b["seq"]} for L, b in buckets.items()}}
        procs = [ctx.Process(target=data_worker, args=(spec, w, worker_q, worker_stop), daemon=True)
                 for w in range(workers)]
        for p in procs:
            p.start()

        def make_batches():
            while not stream.stop:
                try:
                    got = worker_q.get(timeout=1)
                except queue.Empty:
                    if not any(p.is_alive() for p in procs):
                        deliver(RuntimeError("every data worker process ended without a word (killed?)"))
                        return
                    continue
                if not isinstance(got, Exception):
                    got = pinned(({k: torch.from_numpy(v) for k, v in got[0].items()}, got[1]))
                deliver(got)
                if isinstance(got, Exception):
                    return
    else:
        def make_batches():
            try:
                for got in step_batches(stream, buckets, c, prompt_blocks, gen, t_range, full_mask, a.answer_tokens):
                    deliver(pinned(got))
            except Exception as e:  # reported by the training loop
                deliver(e)

    batcher = threading.Thread(target=make_batches, daemon=True)
    batcher.start()
    waited = 0.0  # seconds the loop spent waiting for batches: the data side's share
    tokens_at_log = state["tokens"]
    # The steps' losses stay on the device until a log line or a checkpoint needs them: reading
    # one waits for the GPU, and a read every step would keep the CPU from queueing the next
    # step's kernels while the GPU runs this one.
    pending = []

    def read_losses():
        if pending:
            values = torch.stack([torch.stack(p) for p in pending]).float().tolist()
            pending.clear()
            for lv, cv in values:
                if not math.isfinite(lv):
                    sys.exit(f"train_sdar: the loss became {lv} by step {state['step']}; the checkpoint keeps the "
                             "last good state")
                losses.append(lv)
                ces.append(cv)

    # the data side stops however the loop ends (its worker processes would outlive an error)
    try:
        profiler = Profiler(a.profile, device) if a.profile else None
        while done < max_steps and time.time() - start < budget_s:
            if profiler:
                profiler.before_step(done)
            t_wait = time.time()
            got = batches.get()
            waited += time.time() - t_wait
            if isinstance(got, Exception):
                raise got
            batch, total = got
            progress = max((time.time() - start) / budget_s, done / max_steps if steps else 0.0)
            warm = min(1.0, (done + 1) / stage["warmup"])
            lr = stage["lr"] * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
            for g_ in opt.param_groups:
                g_["lr"] = lr
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss, ce = loss_of(model, batch, total, attention, compiled_flex)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            done += 1
            state["step"] += 1
            state["tokens"] += int(batch["ids"].numel())
            pending.append((loss.detach(), ce))
            if profiler and profiler.after_step(done):
                a.profile = 0  # the first stage of this call only
                profiler = None
            now = time.time()
            if now - last_log >= a.log_seconds or done == max_steps:
                read_losses()
                mean = sum(losses[-50:]) / len(losses[-50:])
                mean_ce = sum(ces[-50:]) / len(ces[-50:])
                rate = (state["tokens"] - tokens_at_log) / max(now - last_log, 1e-9)
                state["history"].append({"step": state["step"], "loss": mean, "ce": mean_ce, "lr": lr,
                                         "tokens": state["tokens"], "stage": stage_no, "seconds": now - start})
                log(f"step {state['step']}  loss {mean:.4f}  ce {mean_ce:.4f}  lr {lr:.2e}  {state['tokens'] / 1e6:.1f}M tokens  "
                    f"{rate / 1e3:.0f}K tokens/s  waited for data {waited:.0f} s  {now - start:.0f} s")
                last_log, tokens_at_log = now, state["tokens"]
            if now - last_save >= a.save_minutes * 60:
                read_losses()  # never a checkpoint of a model whose loss or weights went non-finite
                check_finite(model, state)
                save_ckpt(a.run, model, opt, state)
                last_save = now
        read_losses()
        check_finite(model, state)
        if profiler:
            profiler.abandon()
    finally:
        stream.close()
        batcher.join(timeout=120)
        if procs:
            stop_data_workers(procs, worker_q, worker_stop)
    v = validate()
    state["stages"].append({"stage": stage_no, "lengths": stage["lengths"], "steps": done, "val_loss": v,
                            "seconds": time.time() - start})
    save_ckpt(a.run, model, opt, state)
    with open(f["log"], "a") as fh:
        fh.write(json.dumps({"stage": stage_no, "steps": done, "step": state["step"], "val_loss": v,
                             "train_loss_first": losses[0] if losses else None,
                             "train_loss_last": sum(losses[-20:]) / max(1, len(losses[-20:])),
                             "losses": losses, "ces": ces}) + "\n")
    log(f"stage {stage_no} done: {done} steps, val loss {v}, checkpoint {f['ckpt']}")


def export_run(run, model, state, out, dtype, shard_mb):
    """The run's model as the engine's Hugging Face directory; written beside `out` and renamed
    over it, so `out` always holds a whole export."""
    out = out.rstrip("/") or out
    if os.path.exists(out) and not (os.path.isdir(out) and (not os.listdir(out) or
                                                            os.path.exists(os.path.join(out, "training.json")))):
        sys.exit(f"train_sdar: --out/--export {out}: exists and is not an earlier export (no training.json); "
                 "give a new or empty directory")
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    src = model if next(model.parameters()).device.type == "cpu" else copy_to_cpu(model)
    total, shards = export_hf(src, tmp, dtype, shard_mb * 1024 * 1024, run_files(run)["tokenizer"])
    with open(os.path.join(tmp, "training.json"), "w") as fh:
        json.dump({"steps": state["step"], "tokens": state["tokens"], "stages": state["stages"],
                   "history": state["history"]}, fh, indent=1)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    log(f"exported {total / 1e6:.1f} MB in {shards} file(s) ({dtype}) -> {out}")


def copy_to_cpu(model):
    m = Sdar(model.c)
    m.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    return m


def answer_scores(model, items, c, one_positions, only=None):
    """Cross-entropy and argmax accuracy of the answer tokens (the target without its EOS), in
    two views: "all" masks the whole answer region (the block loop's first step), "one" masks a
    single answer token with the others visible (the last step). On an sdar model "all" is one
    canvas per answer block: that block masked, the blocks before it clean, as the block loop's
    first step of each block sees them (and as training's noisy copies do); masks in a block
    before it would put mask tokens where the model only ever saw clean ones. A model that
    retrieves or copies scores far below chance in both; one that only knows the answers' form stays at the tokens'
    unigram in both, and one that copies only from its own block does better in "one".
    `only` (a set of token ids): mask and score just the answer tokens among them (the value
    digits of key-value samples, whose keys stay visible)."""
    out = {}
    for mode in ("all", "one"):
        ce = right = n = 0
        for item in items:
            prompt, target = item[1], item[2]
            x0 = prompt + target
            L = -(-len(x0) // c.block_size) * c.block_size
            x0 = x0 + [c.eos_id] * (L - len(x0))
            answer = [j for j in range(len(prompt), len(prompt) + len(target) - 1) if only is None or x0[j] in only]
            if not answer:
                continue
            if mode == "all":
                hidden = set(answer) if only is not None else set(range(len(prompt), len(x0)))
                # sdar: one view per answer block; llada: the whole canvas attends both ways, one view
                B = c.block_size if c.arch == "sdar" else L
                views = []
                for lo in range(len(prompt) // B * B, L, B):
                    scored = [j for j in answer if lo <= j < lo + B]
                    if scored:
                        views.append((scored, [c.mask_id if q in hidden and lo <= q < lo + B else t
                                               for q, t in enumerate(x0)]))
            else:
                step = max(1, len(answer) // one_positions)
                views = [([j], [c.mask_id if q == j else t for q, t in enumerate(x0)]) for j in answer[::step]]
            for scored, ids in views:
                with torch.no_grad():
                    logits = model.canvas_logits(ids).float()
                for j in scored:
                    ce += float(-torch.log_softmax(logits[j], -1)[x0[j]])
                    right += int(int(logits[j].argmax()) == x0[j])
                    n += 1
        out[mode] = {"ce": ce / max(n, 1), "accuracy": right / max(n, 1), "tokens": n}
    return out


def bag_scores(items, only):
    """What a model that reads the prompt's values but matches no key reaches, over the tokens
    answer_scores scores with `only`: each answer token in `only` predicted from the prompt's
    tokens in `only` taken as a bag: CE of the bag's frequencies (a token absent from it counted as
    half an occurrence), and right when it is the bag's most frequent (a tie's credit shared among
    the tied). For key-value samples with one-token values this is the pairs' bag exactly; for
    values of several tokens, the prompt's frequencies of those tokens."""
    ce = right = n = 0
    for item in items:
        prompt, target = item[1], item[2]
        bag = Counter(t for t in prompt if t in only)
        if not bag:
            continue
        total, top = sum(bag.values()), max(bag.values())
        modes = [t for t, k in bag.items() if k == top]
        for t in target[:-1]:  # the target without its EOS, as answer_scores
            if t in only:
                ce += -math.log(max(bag[t], 0.5) / total)
                right += (t in modes) / len(modes)
                n += 1
    return {"ce": ce / max(n, 1), "accuracy": right / max(n, 1), "tokens": n}


def cmd_probe(a):
    """Does the run's model copy and retrieve yet? answer_scores on copy samples and on a
    needle task, from the checkpoint, on the CPU (a minute at 256-512 tokens)."""
    c = load_run(a.run)
    f = run_files(a.run)
    model = Sdar(c)
    if a.weights:  # an export's weights (what comes back from the GPU machine), the run's config and tokenizer
        try:
            import_hf(model, a.weights)
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"train_sdar: --weights: {e}")
    elif not os.path.exists(f["ckpt"]):
        sys.exit(f"train_sdar: {a.run}: no checkpoint to probe (train first, or give --weights EXPORT)")
    else:
        restore(model, load_ckpt(f["ckpt"]), f["ckpt"])
    model.eval()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(f["tokenizer"])
    rng = random.Random(a.seed)
    kinds = {"copy": [copy_item(a.length, rng, tok.get_vocab_size(), c.eos_id) for _ in range(a.samples)]}
    eos = tok.token_to_id(SPECIALS[0])
    if a.task != "none":
        rows = ruler_generate(find_sparsa(a.sparsa), a.task, [a.length], a.samples, a.seed, f["tokenizer"])
        if not rows:
            sys.exit(f"train_sdar: --task {a.task} does not fit {a.length} tokens (--task none: the drills alone)")
        kinds[a.task] = [(r["max_len"], tok.encode(r["input"], add_special_tokens=False).ids,
                          tok.encode(r["target"], add_special_tokens=False).ids + [eos], r["gen_tokens"])
                         for r in rows]
    kinds["kv digits"] = [kv_item(a.length, rng, tok, eos, a.kv_pairs, a.kv_digits, a.kv_asked, a.kv_keys)
                          for _ in range(a.samples)]
    digits = number_tokens(tok)
    report = {"run": a.run, "chance_ce": math.log(c.vocab_size), "length": a.length,
              "kinds": {k: answer_scores(model, v, c, a.one_positions, digits if k == "kv digits" else None)
                        for k, v in kinds.items()},
              "kv_bag": bag_scores(kinds["kv digits"], digits)}
    if a.json:
        print(json.dumps(report, indent=1))
        return
    print(f"answer tokens of {a.run} at {a.length} tokens (chance CE {report['chance_ce']:.2f}; "
          f"of a number token known to be one, ln {len(digits)} = {math.log(max(len(digits), 1)):.2f}):")
    for k, r in report["kinds"].items():
        for mode, v in r.items():
            print(f"  {k:16s} {mode:3s}  CE {v['ce']:.3f}  argmax right {v['accuracy']:6.1%}  ({v['tokens']} tokens)")
    v = report["kv_bag"]
    print(f"  {'kv digits':16s} bag  CE {v['ce']:.3f}  argmax right {v['accuracy']:6.1%}  ({v['tokens']} tokens: "
          f"the prompt's numbers as a bag, what reading values without matching keys reaches)")


def cmd_export(a):
    c = load_run(a.run)
    f = run_files(a.run)
    model = Sdar(c)
    if not os.path.exists(f["ckpt"]):
        sys.exit(f"train_sdar: {a.run}: no checkpoint to export (train first)")
    ck = load_ckpt(f["ckpt"])
    restore(model, ck, f["ckpt"])
    export_run(a.run, model, ck["state"], a.out, a.dtype, a.shard_mb)


def cmd_convert(a):
    """An sdar export as the run's bidirectional (llada) model: each head's QK norm folded into its
    projection at the head's mean rms, measured over generated task prompts (fold_qk_norm). A
    start for fine-tuning: a llada model trained from scratch without the QK norm's gains did not
    form the key match in the time the sdar one did (docs/eval.md)."""
    c = load_run(a.run)
    if c.arch != "llada":
        sys.exit(f"train_sdar: {a.run}: the run's model is {c.arch}; convert makes a llada model "
                 "(`tokenizer --arch llada`)")
    f = run_files(a.run)
    src = Sdar(replace(c, arch="sdar"))
    try:
        import_hf(src, a.weights)
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"train_sdar: --weights: {e}")
    src.eval()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(f["tokenizer"])
    rows = ruler_generate(find_sparsa(a.sparsa), a.tasks, [a.length], a.samples, a.seed, f["tokenizer"])
    if not rows:
        sys.exit(f"train_sdar: --tasks {a.tasks} does not fit {a.length} tokens")
    canvases = [tok.encode(r["input"], add_special_tokens=False).ids for r in rows]
    q, k = qk_rms(src, canvases)
    dst = fold_qk_norm(src, q, k)
    log(f"q rms per layer {[round(x, 3) for x in q.mean(1).tolist()]}, k {[round(x, 3) for x in k.mean(1).tolist()]} "
        f"({sum(map(len, canvases))} tokens)")
    note = {"converted_from": os.path.basename(os.path.normpath(a.weights)), "qk_rms_tokens": sum(map(len, canvases)),
            "q_rms": q.tolist(), "k_rms": k.tolist()}
    export_run(a.run, dst, {"step": 0, "tokens": 0, "stages": [], "history": [note]}, a.out, "bf16", a.shard_mb)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer", help="train the BPE tokenizer and write the run's model config")
    t.add_argument("--run", required=True)
    t.add_argument("--sparsa")
    t.add_argument("--vocab", type=int, default=4096)
    t.add_argument("--samples", type=int, default=12, help="samples per task and length of the tokenizer's text")
    t.add_argument("--numbers", choices=sorted(NUMBER_SPLITS), default="triples",
                   help="numbers as runs of up to three digits, each run one token (the default), or digit by digit")
    t.add_argument("--dim", type=int, default=384)
    t.add_argument("--layers", type=int, default=8)
    t.add_argument("--heads", type=int, default=6)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--head-dim", type=int, default=64)
    t.add_argument("--hidden", type=int, default=1024)
    t.add_argument("--block", type=int, default=16)
    t.add_argument("--max-len", type=int, default=16384)
    t.add_argument("--rope-theta", type=float, default=1e6)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--arch", choices=["sdar", "llada"], default="sdar",
                   help="sdar: block diffusion (the default); llada: bidirectional, for BA-Att's full canvases")
    s = sub.add_parser("train", help="one stage of the curriculum; resumes from the run's checkpoint")
    s.add_argument("--run", required=True)
    s.add_argument("--stage", type=int, help="the curriculum stage to train (or --plan)")
    s.add_argument("--plan", help="several stages in one process, e.g. 1:3,2:3,3:4,4:9 (stage:minutes)")
    s.add_argument("--export", help="export the model to this directory after every stage (as `export --out`)")
    s.add_argument("--init", help="start from an exported model's weights (when the run has no checkpoint)")
    s.add_argument("--export-dtype", choices=["bf16", "f32"], default="bf16")
    s.add_argument("--minutes", type=float, default=0, help="wall-clock budget of this stage (0: --steps only)")
    s.add_argument("--steps", type=int, default=0, help="step budget (0: --minutes only)")
    s.add_argument("--lengths", help="override the stage's lengths, e.g. 256,512")
    s.add_argument("--lr", type=float, default=0, help="peak learning rate (0: the stage's)")
    s.add_argument("--warmup", type=int, default=0, help="warm-up steps (0: the stage's)")
    s.add_argument("--tasks", help="generator tasks or families (default: the stage's, else all)")
    s.add_argument("--batch-tokens", type=int, default=65536)
    s.add_argument("--prompt-blocks", type=int,
                   help="noisy prompt blocks per sample (LM loss; default: the stage's, else 2)")
    s.add_argument("--mask-rates", type=mask_rates_arg, metavar="LO,HI",
                   help="masking rates t ~ U(LO, HI) (default: the stage's, else 0.001,1): a clipped range "
                        "lowers the ELBO's gradient variance (BD3-LM)")
    s.add_argument("--kv-frac", type=share_arg,
                   help="share of samples replaced by key-value recall samples (multi-query associative recall: "
                        "the prompt lists KEY is: VALUE lines, the answer asks some keys back; only the values "
                        "are masked, the answer's keys stay visible; default: the stage's, else 0). With "
                        "--copy-frac, 1 in all: synthetic samples only, no generator task need fit the lengths "
                        "(e.g. --lengths 128 --kv-frac 1 --kv-pairs 8 --kv-asked 4 --kv-digits 3 "
                        "--full-mask 1 --answer-tokens 64: a short recall drill)")
    add_kv_shape(s)
    s.add_argument("--full-mask", type=share_arg,
                   help="share of answer blocks masked whole (t = 1; llada: of answer regions; default: the stage's, else 0)")
    s.add_argument("--copy-frac", type=share_arg,
                   help="share of samples replaced by synthetic copy samples (default: the stage's, else 0)")
    s.add_argument("--answer-tokens", type=int_at_least(1), default=ANSWER_TOKENS, metavar="N",
                   help="tokens of noisy answer blocks a row reserves (rounded up to blocks; the answer's last "
                        f"blocks are kept; default {ANSWER_TOKENS}, a 128-token answer): a drill of short answers "
                        "at short lengths needs fewer, and every row is shorter (sdar only)")
    s.add_argument("--chunk", type=int, default=32, help="samples per task and length per generator call")
    s.add_argument("--gen-threads", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                   help="threads of `sparsa ruler generate` (shared by the data workers)")
    s.add_argument("--data-workers", type=int_at_least(0), default=None, metavar="N",
                   help="processes that sample and build the batches (default: 6 on a GPU, as measured; 0, the CPU's "
                        "default: a thread of the training process, the same batches on every run)")
    s.add_argument("--val-samples", type=int, default=8)
    s.add_argument("--device")
    s.add_argument("--attention", choices=["sdpa", "flex"])
    s.add_argument("--compile", type=int, default=0,
                   help="1: torch.compile each layer's work around attention too (Sdar.compile_layers; "
                        "FlexAttention is always compiled on the GPU)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--profile", type=int_at_least(0), default=0, metavar="N",
                   help="profile N steps of the first stage (from its sixth) and log where the time goes")
    s.add_argument("--save-minutes", type=float, default=2)
    s.add_argument("--log-seconds", type=float, default=20)
    s.add_argument("--shard-mb", type=int, default=16)
    s.add_argument("--sparsa")
    e = sub.add_parser("export", help="the engine's Hugging Face directory")
    e.add_argument("--run", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    e.add_argument("--shard-mb", type=int, default=16)
    sub.add_parser("stages", help="print the curriculum")
    v = sub.add_parser("convert", help="an sdar export as the run's llada model (QK norm folded into the projections)")
    v.add_argument("--run", required=True, help="a llada run (`tokenizer --arch llada`) of the same shape and tokenizer")
    v.add_argument("--weights", required=True, help="the sdar export")
    v.add_argument("--out", required=True)
    v.add_argument("--tasks", default="niah", help="generator tasks whose prompts measure the q and k rms")
    v.add_argument("--length", type=int, default=1024)
    v.add_argument("--samples", type=int, default=4, help="samples per task")
    v.add_argument("--seed", type=int, default=7)
    v.add_argument("--shard-mb", type=int, default=16)
    v.add_argument("--sparsa")
    q = sub.add_parser("probe", help="does the model copy and retrieve yet (answer tokens' CE, two views)")
    q.add_argument("--run", required=True)
    q.add_argument("--weights", help="probe an export's weights (default: the run's checkpoint)")
    q.add_argument("--task", default="niah_single_1",
                   help="the generator task probed beside the drills (none: the copy and key-value drills alone)")
    q.add_argument("--length", type=int, default=256)
    q.add_argument("--samples", type=int, default=8)
    q.add_argument("--one-positions", type=int, default=4, help="answer tokens scored one at a time per sample")
    q.add_argument("--seed", type=int, default=5)
    add_kv_shape(q)  # the "kv digits" samples' shape, as train's
    q.add_argument("--json", action="store_true")
    q.add_argument("--sparsa")
    a = p.parse_args(argv)
    {"tokenizer": cmd_tokenizer, "train": cmd_train, "export": cmd_export, "stages": cmd_stages,
     "probe": cmd_probe, "convert": cmd_convert}[a.cmd](a)


if __name__ == "__main__":
    main()
