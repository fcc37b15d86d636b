"""sparsa as transformers' attention (sparsa.hf): tiny random Qwen3- and Llama-shaped models
built from configs here (nothing downloaded), against the same weights under "sdpa".

Bound at density 1.0: f32 everywhere; each layer's attention differs from SDPA's by a few f32
roundings (~1e-6 relative), and two layers with RMSNorm and a 128-wide head carry that to the
logits: |logits - sdpa| <= 1e-4 * max|logits| (seen: ~5e-7)."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import sparsa  # noqa: E402
import sparsa.hf  # noqa: E402
import sparsa.torch as st  # noqa: E402

BOUND = 1e-4
sparsa.hf.register()

SMALL = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)


def configs():
    return {"qwen3": transformers.Qwen3Config(head_dim=32, **SMALL), "llama": transformers.LlamaConfig(**SMALL)}


def models(cfg, implementation, bidirectional=False):
    """The same random weights under sdpa and `implementation` (from_config writes the choice
    into the config it gets, so each model gets its own copy)."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=implementation).eval()
    model.load_state_dict(ref.state_dict())
    if bidirectional:  # a diffusion LM's attention: every token sees every token
        for m in (ref, model):
            for module in m.modules():
                if hasattr(module, "is_causal"):
                    module.is_causal = False
    return ref, model


def ids(n=300, seed=1):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        return model(x).logits


def close(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("implementation", ["sparsa_dense", "sparsa_ba_att"])
def test_density_one_equals_sdpa(arch, bidirectional, implementation):
    ref, model = models(configs()[arch], implementation, bidirectional)
    x = ids()
    with sparsa.hf.options(density=1.0, block_q=32, block_kv=32), sparsa.hf.record() as calls:
        got = logits(model, x)
    assert len(calls) == 2 and all(c["causal"] != bidirectional for c in calls)
    assert close(got, logits(ref, x)) < BOUND


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_bidirectional_half_density_runs_sparsa_ba_att_plan(arch):
    ref, model = models(configs()[arch], "sparsa_ba_att", bidirectional=True)
    x = ids()
    with sparsa.hf.options(density=0.5, block_q=32, block_kv=32), sparsa.hf.record() as calls:
        got = logits(model, x)
    assert close(got, logits(ref, x)) > 1e-3  # sparse: not the dense logits
    assert len(calls) == 2
    for call in calls:
        mine = sparsa.ba_att_plan(call["q"], call["k"], block_q=32, block_kv=32, density=0.5)  # sparsa alone
        for name in ("counts", "indices", "perm_q", "perm_kv"):
            assert np.array_equal(getattr(call["plan"], name).numpy(), getattr(mine, name)), name
        assert (call["plan"].counts == 5).all()  # ceil(0.5 * 10 key blocks)


def test_causal_half_density_plan_is_ba_att_choice_of_earlier_blocks():
    ref, model = models(configs()["qwen3"], "sparsa_ba_att")
    x = ids()
    with sparsa.hf.options(density=0.5, block_q=32), sparsa.hf.record() as calls:
        got = logits(model, x)
    assert close(got, logits(ref, x)) > 1e-3
    for call in calls:
        mine = st.causal_plan(call["q"], call["k"], block=32, density=0.5)
        assert torch.equal(call["plan"].counts, mine.counts) and torch.equal(call["plan"].indices, mine.indices)
        scores = sparsa.ba_att_scores(call["q"], call["k"], block_q=32, block_kv=32, sort_q=False, sort_k=False)
        # query block 9 keeps ceil(0.5 * 10) - 1 = 4 of its 9 earlier blocks: the top BA-Att logits
        top = np.sort(np.argsort(-scores.logits[0, 0, 9, :9], kind="stable")[:4])
        assert np.array_equal(call["plan"].indices[0, 0, 9, :4].numpy(), top)


def test_options_come_from_the_config_and_the_context_manager():
    cfg = configs()["qwen3"]
    cfg.sparsa = {"density": 0.25, "block_q": 32, "block_kv": 32}
    _, model = models(cfg, "sparsa_ba_att", bidirectional=True)
    x = ids()
    with sparsa.hf.record() as calls:
        logits(model, x)
    assert (calls[0]["plan"].counts == 3).all()  # ceil(0.25 * 10)
    with sparsa.hf.options(top_kappa=2), sparsa.hf.record() as calls:
        logits(model, x)
    assert (calls[0]["plan"].counts == 2).all()
    with pytest.raises(ValueError, match=r"options: unknown sparsa option\(s\) dens"):
        with sparsa.hf.options(dens=0.5):
            pass


def test_refusals_name_what_is_unsupported():
    _, model = models(configs()["llama"], "sparsa_ba_att")
    x = torch.cat([ids(40), ids(40, seed=2)])
    padding = torch.ones(2, 40, dtype=torch.long)
    padding[1, :5] = 0
    with pytest.raises(ValueError, match=r"attention_mask: sparsa's attention implementations take no padding"):
        with torch.no_grad():
            model(x, attention_mask=padding)
    with pytest.raises(ValueError, match=r"dropout: sparsa_ba_att has no attention dropout"):
        sparsa.hf._ba_att_forward(model.model.layers[0].self_attn, *(torch.zeros(1, 4, 8, 32),) * 3, None,
                                  dropout=0.1)


def test_generate_with_a_kv_cache_matches_sdpa():
    ref, model = models(configs()["qwen3"], "sparsa_dense")
    x = ids(50)
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False, pad_token_id=127)
    with torch.no_grad():
        assert torch.equal(model.generate(x, **kw), ref.generate(x, **kw))


def test_pinned_operand_is_a_contiguous_copy_with_a_matching_fake():
    """torch.cond's operands under compile (sparsa::hf_pinned): the values of a transposed view,
    laid out contiguously, in a new tensor; opcheck compares the fake kernel with the real one."""
    x = torch.randn(1, 6, 4, 8).transpose(1, 2)  # [1, 4, 6, 8] as transformers hands q over
    y = torch.ops.sparsa.hf_pinned(x)
    assert y.is_contiguous() and torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    torch.library.opcheck(torch.ops.sparsa.hf_pinned, (x,), test_utils=("test_schema", "test_faketensor"))


def set_causal(model, causal):
    for module in model.modules():
        if hasattr(module, "is_causal"):
            module.is_causal = causal


@pytest.mark.parametrize("bidirectional", [False, True])
def test_compiled_model_fullgraph(bidirectional):
    """torch.compile(fullgraph=True) of the whole model: no graph break in sparsa's path, and the
    compiled model attends as compiled SDPA does. Whether a compiled bidirectional model is handed
    a causal mask depends on the transformers version (5.17 builds one when compiling and none in
    eager mode, so SDPA itself turns causal there; 5.24 does not): the eager reference takes the
    semantics that compiled SDPA shows, and SDPA must show one of the two."""
    torch._dynamo.reset()
    ref, model = models(configs()["qwen3"], "sparsa_ba_att", bidirectional)
    x = ids(128)
    sdpa_eager = logits(ref, x)
    sdpa_compiled = logits(torch.compile(ref, fullgraph=True, backend="aot_eager"), x)
    if close(sdpa_compiled, sdpa_eager) < BOUND:
        causal = not bidirectional
    else:
        sdpa_causal = logits(models(configs()["qwen3"], "sdpa")[0], x)
        assert bidirectional and close(sdpa_compiled, sdpa_causal) < BOUND, \
            "compiled SDPA attends neither as in eager mode nor causally"
        causal = True
    with sparsa.hf.options(density=0.5, block_q=32, block_kv=32):
        got = logits(torch.compile(model, fullgraph=True, backend="aot_eager"), x)
        set_causal(model, causal)
        eager = logits(model, x)
    assert close(got, eager) < BOUND


@pytest.mark.parametrize("implementation", ["sparsa_dense", "sparsa_ba_att"])
@pytest.mark.parametrize("layer_causal", [False, True])
@pytest.mark.parametrize("mask_causal", [False, True])
def test_explicit_mask_under_compile(implementation, layer_causal, mask_causal):
    """Some transformers versions hand the attention an explicit mask tensor even when it is all
    visible or causal, and some hand a causal one to layers configured bidirectional. Eager mode
    follows the mask; under torch.compile(fullgraph=True) its values cannot steer Python while
    tracing, so the graph decides when it runs (torch.cond) and gives eager's answer for every
    pair of layer and mask; a padding mask fails an assertion when the graph runs."""
    torch._dynamo.reset()
    sparsa.hf.register()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 32, generator=g) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = layer_causal
    pattern = torch.ones(64, 64, dtype=torch.bool)
    if mask_causal:
        pattern = pattern.tril()
    mask = torch.where(pattern, 0.0, float("-inf"))[None, None]

    def run(q, k, v, mask):
        return sparsa.hf._attention(implementation, module, q, k, v, mask)[0]

    with sparsa.hf.options(density=0.5, block_q=16, block_kv=16):
        eager = run(q, k, v, mask)
        compiled_run = torch.compile(run, fullgraph=True, backend="aot_eager")
        compiled = compiled_run(q, k, v, mask)
        assert torch.allclose(compiled, eager, atol=1e-6, rtol=1e-6)
        # The other pattern through the same compiled graph: decided when it runs, not traced in.
        other = torch.where(pattern if not mask_causal else torch.ones(64, 64, dtype=torch.bool), 0.0,
                            float("-inf"))[None, None]
        if not mask_causal:
            other = torch.where(torch.ones(64, 64, dtype=torch.bool).tril(), 0.0, float("-inf"))[None, None]
        assert torch.allclose(compiled_run(q, k, v, other), run(q, k, v, other), atol=1e-6, rtol=1e-6)
        assert not torch.allclose(run(q, k, v, other), eager, atol=1e-3)  # the two patterns differ
        padding = mask.clone()
        padding[..., :5] = float("-inf")
        with pytest.raises(RuntimeError, match="attention_mask: sparsa's attention implementations take no padding"):
            compiled_run(q, k, v, padding)


@pytest.mark.parametrize("layer_causal", [False, True])
def test_under_capture_the_layer_decides_and_the_mask_is_checked_on_the_device(monkeypatch, layer_causal):
    """Under CUDA-graph capture transformers builds its mask even where eager passes none, and
    reading it (_mask_kind) would synchronise, which capture forbids. Capture simulated here
    (sparsa.torch._capturing, which sparsa.hf asks): the mask is never read on the host, the
    layer's is_causal decides, the result equals eager's for the agreeing mask, and a disagreeing or padded mask fails the
    device-side assertion (on CPU tensors it raises at once; on CUDA when the graph runs)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 32, generator=g) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = layer_causal
    causal = torch.where(torch.ones(64, 64, dtype=torch.bool).tril(), 0.0, float("-inf"))[None, None]
    visible = torch.zeros(1, 1, 64, 64)
    agreeing, other = (causal, visible) if layer_causal else (visible, causal)
    with sparsa.hf.options(density=0.5, block_q=16, block_kv=16):
        eager = sparsa.hf._attention("sparsa_ba_att", module, q, k, v, agreeing)[0]
        monkeypatch.setattr(st, "_capturing", lambda: True)

        def host_read(*args):
            raise AssertionError("the mask was read on the host under capture")

        monkeypatch.setattr(sparsa.hf, "_mask_kind", host_read)
        got = sparsa.hf._attention("sparsa_ba_att", module, q, k, v, agreeing)[0]
        assert torch.equal(got, eager)
        padded = agreeing.clone()
        padded[..., :5] = float("-inf")
        for bad in (other, padded):
            with pytest.raises(RuntimeError, match="under CUDA-graph capture sparsa's attention follows the layer"):
                sparsa.hf._attention("sparsa_ba_att", module, q, k, v, bad)
        # Every layer gets the same mask tensor: it is checked once, a new one again.
        checks = []
        real = sparsa.hf._assert_mask_is
        monkeypatch.setattr(sparsa.hf, "_assert_mask_is", lambda *a: (checks.append(a[0]), real(*a)))
        fresh = agreeing.clone()
        for _ in range(3):
            sparsa.hf._attention("sparsa_ba_att", module, q, k, v, fresh)
        assert len(checks) == 1 and checks[0] is fresh
        sparsa.hf._attention("sparsa_ba_att", module, q, k, v, agreeing.clone())
        assert len(checks) == 2
