"""sparsa's tokenizer.json reader against the `tokenizers` package, on byte-level BPE tokenizers
trained here (no download): GPT-2's pre-tokenizer (with and without add_prefix_space), Qwen2's
Split pattern with NFC, Llama-3's pattern with ignore_merges; added/special tokens; encode ids
and decode text must be identical."""
import json
import subprocess

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

QWEN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

CORPUS = [
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say it's fine, we've done it.",
    "Diffusion language models denoise a canvas of masked tokens in parallel; block diffusion keeps a KV cache.",
    "Numbers: 12345, 3.14159, 2026-12-01, 1000000 tokens/s!!! (maybe) [x] {y} <z> #tag @user $5 %20",
    "def forward(self, x):\n    return self.proj(x) + 1\n\n\tif a == b:\r\n\t\tpass",
    "café naïve résumé Ελληνικά русский язык 中文分词 日本語のテキスト 한국어 😀🚀 emoji",
    "   leading spaces, trailing spaces   \n\n\n  mixed \t whitespace \u00a0 nbsp",
] * 20

TEXTS = [
    "Hello world",
    "I'm here, don't WE'LL they'RE you've",
    "12345 678 3.14 x2 2x",
    "a  b\n\n  c\t\td   ",
    "trailing space ",
    "  two leading",
    "\n\nnewlines first\r\nthen crlf\n",
    "café naïve Ελληνικά русский 中文 日本語 😀 emoji",
    "<|endoftext|>hi<|mdm_mask|> there<|endoftext|>",
    "!!! ... --- ??? ;;; (){}[]",
    "def f(x):\n    return x  # comment\n",
    "unseen words zyxwvut qqqq",
    "x",
    " ",
]

SPECIALS = ["<|endoftext|>", "<|mdm_mask|>"]


def train(kind):
    if kind == "llama3":
        tok = Tokenizer(models.BPE(ignore_merges=True))
    else:
        tok = Tokenizer(models.BPE())
    if kind in ("gpt2", "gpt2_prefix"):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=(kind == "gpt2_prefix"))
    else:
        tok.normalizer = normalizers.NFC() if kind == "qwen" else None
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN if kind == "qwen" else LLAMA3), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def sparsa_tokenize(sparsa_bin, path, *args):
    p = subprocess.run([sparsa_bin, "tokenize", "--tokenizer", str(path), "--json", *args], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("kind", ["gpt2", "gpt2_prefix", "qwen", "llama3"])
def test_encode_decode_match_tokenizers(sparsa_bin, tmp_path, kind):
    tok = train(kind)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    for text in TEXTS:
        want = tok.encode(text, add_special_tokens=False).ids
        got = sparsa_tokenize(sparsa_bin, path, "--text", text)["ids"]
        assert got == want, (kind, text)
        decoded = sparsa_tokenize(sparsa_bin, path, "--decode", ",".join(map(str, want)))["text"]
        assert decoded == tok.decode(want, skip_special_tokens=False), (kind, text)


def byte_to_char():
    """GPT-2's byte-level alphabet: the printable Latin-1 bytes stand for themselves, the other 68
    bytes for U+0100 onwards in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def test_decode_of_ill_formed_utf8_matches_tokenizers(sparsa_bin, tmp_path):
    """Byte tokens that form no valid UTF-8 (overlong forms, surrogates, beyond U+10FFFF, cut
    sequences, stray continuation bytes, C0 / C1 / F5..FF) decode to one U+FFFD per maximal ill-
    formed subpart, as the tokenizers package's decode gives; then 200 random byte strings."""
    tok = train("qwen")
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    b2c = byte_to_char()
    ids_of = lambda data: [tok.token_to_id(b2c[b]) for b in data]  # noqa: E731
    cases = [b"\xe0\x80\x80a", b"\xed\xa0\x80b", b"\xf4\x90\x80\x80", b"\xe2\x82", b"x\xe2\x82y", b"\xc0\xaf",
             b"\x80\x80", b"\xf5\xff\xfe", b"\xf0\x9f\x98", b"\xf0\x9f\x98\x80\xed\x9f\xbf\xf4\x8f\xbf\xbf",
             "caf\u00e9 \u2013 ok".encode()]
    rng = np.random.default_rng(5)
    cases += [bytes(rng.integers(0x80 if i % 2 else 0, 256, size=int(rng.integers(1, 12)), dtype=np.uint8))
              for i in range(200)]
    for data in cases:
        ids = ids_of(data)
        got = sparsa_tokenize(sparsa_bin, path, "--decode", ",".join(map(str, ids)))["text"]
        assert got == tok.decode(ids, skip_special_tokens=False) == data.decode("utf-8", errors="replace"), data


def test_merges_saved_as_pairs_or_strings(sparsa_bin, tmp_path):
    """tokenizers >= 0.20 writes merges as ["a", "b"] pairs; older files as "a b" strings."""
    tok = train("gpt2")
    j = json.loads(tok.to_str())
    merges = j["model"]["merges"]
    j["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in merges]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(j))
    text = "The quick brown fox, 12345!"
    assert sparsa_tokenize(sparsa_bin, path, "--text", text)["ids"] == tok.encode(text).ids


@pytest.mark.parametrize("edit,words", [
    (lambda j: j["model"].pop("merges"), ["model.merges", "missing or empty"]),
    (lambda j: j["model"].__setitem__("merges", []), ["model.merges"]),
    (lambda j: j["model"].__setitem__("type", "WordPiece"), ["model.type", "WordPiece"]),
    (lambda j: j["model"].__setitem__("vocab", {}), ["model.vocab"]),
    (lambda j: j.__setitem__("pre_tokenizer", {"type": "Whitespace"}), ["pre_tokenizer", "Whitespace"]),
    (lambda j: j["model"].__setitem__("byte_fallback", True), ["byte_fallback"]),
])
def test_bad_tokenizer_is_one_clear_error(sparsa_bin, tmp_path, edit, words):
    j = json.loads(train("gpt2").to_str())
    edit(j)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(j))
    p = subprocess.run([sparsa_bin, "tokenize", "--tokenizer", str(path), "--text", "hi"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1
    line = p.stderr.strip()
    assert line.startswith("sparsa: error: ") and "\n" not in line, p.stderr
    for w in words:
        assert w in line, (w, line)


def test_malformed_and_missing_tokenizer(sparsa_bin, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": ')
    p = subprocess.run([sparsa_bin, "tokenize", "--tokenizer", str(path), "--text", "hi"], capture_output=True, text=True)
    assert p.returncode == 1 and "JSON" in p.stderr
    p = subprocess.run([sparsa_bin, "tokenize", "--tokenizer", str(tmp_path / "none.json"), "--text", "hi"],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "none.json" in p.stderr


@pytest.mark.parametrize("arch", ["llada", "sdar", "fast_dllm"])
def test_tiny_model_generates_text_through_the_cli(sparsa_bin, tmp_path, monkeypatch, arch):
    """A 2-layer model with a trained tokenizer: `sparsa generate --prompt TEXT` streams the text the
    reference loop produces, with a tokens/s progress line."""
    import numpy as np

    import dlm_ref as R

    tok = train("qwen")
    vocab = tok.get_vocab_size()
    mask_id, eos = tok.token_to_id("<|mdm_mask|>"), tok.token_to_id("<|endoftext|>")
    s = R.Spec(arch, dim=64, heads=4, kv_heads=2, layers=2, vocab=vocab, mask_id=mask_id, eos=eos, block=4)
    d = tmp_path / "model"
    w = R.write_model(d, s, seed=21)
    tok.save(str(d / "tokenizer.json"))
    prompt = "The quick brown fox"
    ids = tok.encode(prompt).ids
    if arch == "llada":
        flags = ["--gen-len", "8", "--steps", "8", "--block-len", "8", "--ban-eos"]
    elif arch == "sdar":
        flags = ["--gen-len", "8", "--steps", "2", "--ban-eos"]
    else:  # fast_dllm: blocks of 4 streamed as they are decoded, sub-blocks of 2
        flags = ["--gen-len", "8", "--sub-block", "2", "--ban-eos"]
    p = subprocess.run([sparsa_bin, "generate", "--model", str(d), "--prompt", prompt, *flags], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "tokens/s" in p.stderr

    # the reference with EOS banned (--ban-eos: its logit is -inf), decoded the same way
    ban = np.zeros(vocab)
    ban[eos] = -np.inf
    plain_forward = R.forward
    monkeypatch.setattr(R, "forward", lambda *a, **k: (lambda lk: (lk[0] + ban, lk[1]))(plain_forward(*a, **k)))
    want = R.ref_remask(s, w, ids, 8, 8, 8) if arch == "llada" else R.ref_block(s, w, ids, 8, 2, 0.0) \
        if arch == "sdar" else R.ref_fast_dllm(s, w, ids, 8, 0.0, 2)
    assert len(want) == 8
    assert p.stdout.rstrip("\n") == tok.decode(want, skip_special_tokens=True)
