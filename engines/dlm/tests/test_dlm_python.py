"""The Python API of the engine: sparsa.Model.load(dir).logits() / .generate(), sparsa.Tokenizer,
against the numpy reference. Needs the extension on PYTHONPATH (CTest sets it and
SPARSA_DLM_REQUIRE_PYTHON=1, so a missing extension fails there instead of skipping)."""
import os

import numpy as np
import pytest

import dlm_ref as R

try:
    import sparsa
    HAVE = hasattr(sparsa, "Model")
except ImportError:
    HAVE = False
if not HAVE:
    if os.environ.get("SPARSA_DLM_REQUIRE_PYTHON") == "1":
        raise ImportError("sparsa (with Model) is not importable but SPARSA_DLM_REQUIRE_PYTHON=1")
    pytest.skip("the sparsa Python extension is not importable", allow_module_level=True)


def test_model_logits_and_generate(tmp_path):
    s = R.Spec("sdar", dim=64, heads=4, kv_heads=2, layers=2, vocab=64, eos=62, mask_id=63, block=4, dtype="BF16")
    w = R.write_model(tmp_path, s, seed=5)
    m = sparsa.Model.load(tmp_path)
    assert m.config["arch"] == "sdar" and m.config["kv_heads"] == 2 and m.default_loop == "block"
    assert m.tokenizer is None
    ids = [1, 2, 3, 4, 5, 6, 7]
    got = m.logits(ids)
    assert got.shape == (7, 64) and got.dtype == np.float32
    ref = R.canvas_logits(s, w, ids)
    assert np.max(np.abs(got - ref)) / max(1.0, np.max(np.abs(ref))) < 5e-5
    prompts = [[3, 17, 5, 9, 30], [8, 1, 44, 2, 19, 27]]
    out = m.generate(prompts, gen_len=10, steps=2)
    assert out == [R.ref_block(s, w, p, 10, 2, 0.0) for p in prompts]
    assert m.generate(prompts[0], gen_len=10, steps=2) == out[0]
    with pytest.raises(ValueError, match="tokenizer"):
        m.generate("some text")
    with pytest.raises(ValueError, match="loop"):
        m.generate(prompts[0], loop="remask")


def test_prompt_cache_from_python(tmp_path):
    """sparsa.PromptCache: the next turn reuses the blocks it shares with the last prompt and reply,
    and generates what the numpy reference's block loop generates without any cache."""
    s = R.Spec("sdar", dim=64, heads=4, kv_heads=2, layers=2, vocab=64, eos=62, mask_id=63, block=4, dtype="BF16")
    w = R.write_model(tmp_path, s, seed=6)
    m = sparsa.Model.load(tmp_path)
    cache = sparsa.PromptCache()
    assert cache.tokens == 0 and cache.last_reused == 0
    p1 = [3, 17, 5, 9, 30, 8, 1, 44, 2]
    out1 = m.generate(p1, gen_len=10, steps=2, stop_at_eos=False, cache=cache)
    assert out1 == R.ref_block(s, w, p1, 10, 2, 0.0, stop=False) and cache.last_reused == 0
    assert cache.tokens > 0 and cache.tokens % 4 == 0
    p2 = p1 + out1 + [11, 12, 13]
    out2 = m.generate(p2, gen_len=10, steps=2, stop_at_eos=False, cache=cache)
    assert out2 == R.ref_block(s, w, p2, 10, 2, 0.0, stop=False)
    assert cache.last_reused >= (len(p1) + len(out1)) // 4 * 4 - 4 and cache.last_reused % 4 == 0
    cache.clear()
    assert cache.tokens == 0
    with pytest.raises(ValueError, match="cache: a prompt cache serves one request"):
        m.generate([p1, p2], gen_len=10, steps=2, cache=cache)
    with pytest.raises(TypeError, match="cache: expected a sparsa.PromptCache"):
        m.generate(p1, gen_len=10, cache="yes")


def test_chat_from_python(tmp_path):
    """sparsa.Chat on the shipped model: each turn's reply is what generate() gives for the rendered
    conversation without any cache, the second turn reuses the first's blocks, reset() forgets."""
    m = sparsa.Model.load(R.shipped_model_copy(tmp_path, R.CHAT_TEMPLATE))
    chat = sparsa.Chat(m, system="The key 512 holds 4242. The key 733 holds 1001.", gen_len=16)
    history = [{"role": "system", "content": "The key 512 holds 4242. The key 733 holds 1001."}]
    for turn, text in enumerate(["What does key 512 hold?", "And key 733?"]):
        reply = chat.say(text)
        history.append({"role": "user", "content": text})
        ids = m.tokenizer.encode(m.chat_template.render(history))
        assert m.tokenizer.decode(m.generate(ids, gen_len=16, seed=turn), True) == reply
        history.append({"role": "assistant", "content": reply})
        assert (chat.last_reused > 0) == (turn == 1)
    assert [x["role"] for x in chat.messages] == ["user", "assistant", "user", "assistant"]
    replies = [x["content"] for x in chat.messages if x["role"] == "assistant"]
    chat.reset()
    assert chat.messages == [] and chat.cache.tokens == 0
    assert m.backend == "cpu"
    m.backend = "cuda"  # the prompt cache serves the cpu backend only: not passed elsewhere
    other = sparsa.Chat(m, system="The key 512 holds 4242. The key 733 holds 1001.", gen_len=16)
    assert [other.say("What does key 512 hold?"), other.say("And key 733?")] == replies
    assert other.last_reused == 0 and other.cache.tokens == 0
    m.backend = "cpu"
    with pytest.raises(TypeError, match="options"):
        sparsa.Chat(m, cache=sparsa.PromptCache())
    with pytest.raises(TypeError, match="text"):
        chat.say(3)


def test_load_errors(tmp_path):
    with pytest.raises(RuntimeError, match="config.json"):
        sparsa.Model.load(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(RuntimeError, match="model_type"):
        sparsa.Model.load(tmp_path)


def test_attention_capture_from_python(tmp_path):
    s = R.Spec("llada", dim=32, heads=2, layers=2, vocab=40, eos=38, mask_id=39)
    w = R.write_model(tmp_path / "m", s, seed=6)
    dump = tmp_path / "dump"
    m = sparsa.Model.load(tmp_path / "m", dump_attention=dump, dump_layers=[1], dump_max=2)
    ids = [1, 2, 3, 39, 39, 5]
    m.logits(ids)
    m.logits(ids)  # a second request: r1
    m.logits(ids)  # over dump_max: counted only
    assert m.attention_dump_counts == (2, 1)
    assert sorted(os.listdir(dump)) == ["r0-l1-f0.safetensors", "r1-l1-f0.safetensors"]
    captured = []
    R.forward(s, w, ids, None, 0, capture=captured)
    t, meta = R.read_safetensors(dump / "r1-l1-f0.safetensors")
    assert meta["request"] == "1" and meta["layer"] == "1"
    q = np.transpose(captured[1][0], (1, 0, 2))[None]
    assert np.max(np.abs(t["q"] - q)) / max(1.0, np.max(np.abs(q))) < 5e-5
    with pytest.raises((RuntimeError, ValueError), match="not empty"):
        sparsa.Model.load(tmp_path / "m", dump_attention=dump)


def test_chat_template_from_python(tmp_path):
    """sparsa.ChatTemplate renders as the CLI does (test_chat_template.py holds the comparison with
    jinja2); Model.generate(chat=True) encodes the rendered prompt."""
    t = sparsa.ChatTemplate.parse("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}"
                                  "{% if m.tool_calls %} calls {{ m.tool_calls | map(attribute='name') | join(',') }}"
                                  "{% endif %}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
                                  "{% if enable_thinking is false %} no-think{% endif %}", bos_token="<s>")
    messages = [{"role": "user", "content": " hi "},
                {"role": "assistant", "content": "", "tool_calls": [{"name": "a"}, {"name": "b"}]}]
    # (trim_blocks: the newline after {% endif %} goes)
    assert t.render(messages) == "<s>[user] hi[assistant]  calls a,b[assistant]"
    assert t.render(messages, add_generation_prompt=False, enable_thinking=False) == \
        "<s>[user] hi[assistant]  calls a,b no-think"
    with pytest.raises(ValueError, match="line 1"):
        sparsa.ChatTemplate.parse("{% if %}")
    with pytest.raises(ValueError, match="stop here"):
        sparsa.ChatTemplate.parse("{{ raise_exception('stop here') }}").render([])

    shipped = os.path.join(os.path.dirname(__file__), "..", "..", "..", "models", "sparsa-sdar-ruler")
    if not os.path.isdir(shipped):
        return
    model_dir = tmp_path / "chat_model"
    model_dir.mkdir()
    for name in os.listdir(shipped):
        os.symlink(os.path.abspath(os.path.join(shipped, name)), model_dir / name)
    m = sparsa.Model.load(model_dir)
    with pytest.raises(ValueError, match="no chat template"):
        m.generate("What is 1 + 1?", gen_len=16, chat=True)
    (model_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
        "assistant: the value is {% endif %}", encoding="utf-8")
    m = sparsa.Model.load(model_dir)
    rendered = m.chat_template.render([{"role": "system", "content": "Digits only."},
                                       {"role": "user", "content": "What is 1 + 1?"}])
    assert rendered == "system: Digits only.\nuser: What is 1 + 1?\nassistant: the value is "
    want = m.generate(m.tokenizer.encode(rendered), gen_len=16)
    assert m.generate("What is 1 + 1?", gen_len=16, chat=True, system="Digits only.") == m.tokenizer.decode(want, True)


def test_fast_dllm_from_python(tmp_path):
    """A Fast-dLLM v2 model decodes with its own loop by default; sub_block and threshold reach it."""
    s = R.Spec("fast_dllm", dim=32, heads=2, kv_heads=1, layers=2, vocab=48, eos=46, mask_id=47, block=8)
    w = R.write_model(tmp_path, s, seed=9)
    m = sparsa.Model.load(tmp_path)
    assert m.config["arch"] == "fast_dllm" and m.default_loop == "fast_dllm"
    for prompt in ([3, 17, 5, 9], list(range(1, 17))):
        assert m.generate(prompt, gen_len=12, stop_at_eos=False) == R.ref_fast_dllm(s, w, prompt, 12, 0.0, 8, False)
        assert m.generate(prompt, gen_len=12, stop_at_eos=False, sub_block=4, threshold=0.1) == \
            R.ref_fast_dllm(s, w, prompt, 12, 0.1, 4, False)
    with pytest.raises(ValueError, match="sub_block"):
        m.generate([1, 2], gen_len=8, sub_block=5)


def test_factor_rule_from_python(tmp_path):
    """factor= reaches the remask and prefix_cache loops (Fast-dLLM's factor rule), and a factor
    where it does not apply is refused by name."""
    s = R.Spec("llada", dim=32, heads=2, kv_heads=2, layers=2, vocab=48, eos=46, mask_id=47)
    w = R.write_model(tmp_path, s, seed=12)
    m = sparsa.Model.load(tmp_path)
    prompt = [3, 17, 5, 9, 30]
    assert m.generate(prompt, gen_len=8, block_len=4, factor=1.0, stop_at_eos=False) == \
        R.ref_remask(s, w, prompt, 8, 4, 8, False, factor=1.0)
    assert m.generate(prompt, gen_len=8, block_len=4, factor=2.0, loop="prefix_cache", stop_at_eos=False) == \
        R.ref_prefix_cache(s, w, prompt, 8, 4, 8, 0.0, False, factor=2.0)
    assert m.generate(prompt, gen_len=8, block_len=4, factor=1.0, loop="dual_cache", stop_at_eos=False) == \
        R.ref_dual_cache(s, w, prompt, 8, 4, 8, 0.0, False, factor=1.0)
    with pytest.raises(ValueError, match="factor: a step commits by the factor rule or by the threshold"):
        m.generate(prompt, gen_len=8, block_len=4, factor=1.0, threshold=0.5)


def test_dream_from_python(tmp_path):
    """A dream model decodes with Dream's loop and entropy confidence by default."""
    s = R.Spec("dream", dim=32, heads=2, kv_heads=1, layers=2, vocab=48, eos=46, mask_id=47)
    w = R.write_model(tmp_path, s, seed=8)
    m = sparsa.Model.load(tmp_path)
    assert m.config["arch"] == "dream" and m.default_loop == "dream"
    prompt = [3, 17, 5, 9]
    assert m.generate(prompt, gen_len=8, steps=8, stop_at_eos=False) == R.ref_dream(s, w, prompt, 8, 8, stop=False)
    assert m.generate(prompt, gen_len=8, steps=4, stop_at_eos=False, confidence="margin") == \
        R.ref_dream(s, w, prompt, 8, 4, "margin", stop=False)
    assert m.generate(prompt, gen_len=8, steps=4, stop_at_eos=False, temperature=0.7, top_p=0.8, top_k=3, seed=2) \
        == R.ref_dream(s, w, prompt, 8, 4, stop=False, temperature=0.7, top_p=0.8, top_k=3, seed=2)
    assert m.generate(prompt, gen_len=8, steps=4, stop_at_eos=False, alg_temp=0.5, seed=5) == \
        R.ref_dream(s, w, prompt, 8, 4, stop=False, alg_temp=0.5, seed=5)
    with pytest.raises(ValueError, match="alg_temp"):
        m.generate(prompt, gen_len=8, alg_temp=-0.5)
    with pytest.raises(ValueError, match="confidence"):
        m.generate(prompt, gen_len=8, confidence="doubt")
    with pytest.raises(ValueError, match="top_p"):
        m.generate(prompt, gen_len=8, top_p=0.0)


def test_unmask_strategies_from_python(tmp_path):
    """unmask= and eb_threshold= reach the block loop (SDAR's sequential and entropy_bounded)."""
    s = R.Spec("sdar", dim=64, heads=4, kv_heads=2, layers=2, vocab=64, eos=62, mask_id=63, block=4)
    w = R.write_model(tmp_path, s, seed=2)
    m = sparsa.Model.load(tmp_path)
    prompt = [8, 1, 44, 2, 19, 27, 33, 12, 6]
    for unmask, eb in (("sequential", 0.35), ("entropy_bounded", 9.0)):
        assert m.generate(prompt, gen_len=12, steps=2, stop_at_eos=False, unmask=unmask, eb_threshold=eb) == \
            R.ref_block(s, w, prompt, 12, 2, 0.0, False, unmask=unmask, eb=eb)
    with pytest.raises(ValueError, match="unmask"):
        m.generate(prompt, gen_len=8, unmask="random")
    with pytest.raises(ValueError, match="eb_threshold"):
        m.generate(prompt, gen_len=8, unmask="entropy_bounded", eb_threshold=-1.0)
