"""sparsa's custom ops on CUDA tensors: CUDA-graph capture, torch.compile on the GPU, torch's
current stream (skipped without torch, a CUDA device or the cuda backend).

Tolerances: bf16 inputs and outputs; sparsa's CUDA executor against its CPU path on f32 copies is
bounded by the bf16 output rounding plus the f32 accumulation order, 4 * 2^-8 relative (as in
test_torch.py); a replayed graph or a compiled call runs the same kernels on the same inputs:
equal."""
import math

import numpy as np
import pytest

import sparsa

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or "cuda" not in sparsa.backends(),
                                reason="no CUDA device or cuda backend")

import sparsa.torch as st  # noqa: E402

BF16 = 4 * 2.0 ** -8
HOLD_CYCLES = 400_000_000  # about 0.2 s of torch.cuda._sleep on an H200


def inputs(seed=0, hq=8, hkv=2, n=1000, d=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def calls(q, k, v):
    """Each op (and the causal composition) on the inputs: name -> out."""
    plan = st.ba_att_plan(q, k, block_q=128, block_kv=128, density=0.3)
    return {
        "dense": st.dense(q, k, v)[0],
        "ba_att": st.ba_att(q, k, v, block_q=128, block_kv=128, density=0.3)[0],
        "block_sparse": st.block_sparse(q, k, v, plan, check_index=False)[0],
        "merge": st.merge(*st.dense(q, k[:, :, :400], v[:, :, :400]), *st.dense(q, k[:, :, 400:], v[:, :, 400:]))[0],
        "causal": st.causal_attention(q, k, v, block=128, density=0.5)[0],
    }


def test_ops_on_cuda_match_the_cpu():
    q, k, v = inputs()
    gpu = calls(q, k, v)
    cpu = calls(*(t.float().cpu() for t in (q, k, v)))
    for name in ("dense", "merge"):
        assert rel(gpu[name].cpu(), cpu[name]) < BF16, name
    # BA-Att's GPU selection computes in f32 (the CPU in f64): near-tied blocks may differ, so the
    # GPU plan is checked by running it on the CPU.
    plan = st.ba_att_plan(q, k, block_q=128, block_kv=128, density=0.3)
    host = sparsa.BlockIndex(128, 128, *(t.cpu().numpy() for t in (plan.counts, plan.indices, plan.perm_q,
                                                                      plan.perm_kv)))
    ref, _ = sparsa.block_sparse(*(t.float().cpu() for t in (q, k, v)), host)
    assert rel(gpu["block_sparse"].cpu(), ref) < BF16 and rel(gpu["ba_att"].cpu(), ref) < BF16


@pytest.mark.parametrize("n,hq,hkv,block,density", [(1000, 8, 2, 128, 1.0), (1000, 8, 2, 128, 0.5),
                                                     (77, 6, 3, 16, 0.4), (512, 4, 4, 64, 0.25)])
def test_causal_attention_on_cuda_matches_the_cpu(n, hq, hkv, block, density):
    """The causal composition (plan, diagonal blocks through torch's flash kernel, block-sparse
    rest, merge) against sparsa's CPU block-sparse attention with the causal mask over the GPU's
    own plan plus each row's diagonal block (the GPU plan's f32 block logits may break near-ties
    otherwise than the CPU's f64 ones); last blocks partial where n is not a multiple of block.
    LSE: f32 on both sides, the same bf16 inputs; the GPU's diagonal LSE comes from the flash
    kernel, whose exp2-based softmax differs from the CPU's in the last bits: 1e-3 absolute."""
    q, k, v = inputs(5, hq=hq, hkv=hkv, n=n)
    assert st._flash_diagonal(q, k, v)  # the path under test (the f32 form is the CPU's)
    out, lse, plan = st.causal_attention(q, k, v, block=block, density=density, return_plan=True)
    counts, indices = plan.counts.cpu().numpy(), plan.indices.cpu().numpy()
    nb = counts.shape[-1]
    full = np.concatenate([indices, np.zeros(indices.shape[:-1] + (1,), np.int32)], -1)
    rows = np.broadcast_to(np.arange(nb, dtype=np.int32)[None, None, :, None], counts.shape + (1,))
    np.put_along_axis(full, counts[..., None].astype(np.int64), rows, -1)
    host = sparsa.BlockIndex(block, block, counts + 1, full)
    ref, ref_lse = sparsa.block_sparse(*(t.float().cpu() for t in (q, k, v)), host, mask="causal")
    assert rel(out.cpu(), ref) < BF16
    assert (lse.cpu() - torch.as_tensor(ref_lse)).abs().max().item() < 1e-3
    if density == 1.0:
        dense, _ = sparsa.dense(*(t.float().cpu() for t in (q, k, v)), mask="causal")
        assert rel(out.cpu(), dense) < BF16


def test_cuda_graph_capture_and_replay():
    """A plan made inside a torch.cuda.graph capture comes from sparsa's stream-ordered pool, whose
    capture-time addresses CUDA does not know yet: block_sparse's pointer check accepts unknown
    memory while the call's stream is capturing (it refused it before)."""
    q, k, v = inputs(1)
    static = [t.clone() for t in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (workspaces, pinned read-back slots) before capturing
        for _ in range(2):
            calls(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = calls(*static)
    fresh = inputs(2)
    for s, f in zip(static, fresh):
        s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    eager = calls(*fresh)
    for name, out in eager.items():
        assert torch.equal(captured[name], out), name


class Layer(torch.nn.Module):
    """The ops between exact elementwise steps (scaling by powers of two), so inductor's fusions
    cannot change the ops' inputs: BA-Att's plan on random data has near-ties that a last-bit
    difference in q or k would flip."""

    def forward(self, q, k, v):
        a, _ = st.ba_att(q * 2, k * 0.5, v, block_q=128, block_kv=128, density=0.3)
        c, _ = st.causal_attention(q, k, v * 2, block=128, density=0.5)
        plan = st.ba_att_plan(q, k, block_q=128, block_kv=128, top_kappa=3)
        e, lse_e = st.block_sparse(q, k, v, plan, check_index=False)
        f, _ = st.merge(e, lse_e, *st.dense(q, k[:, :, :128], v[:, :, :128]))
        return a + c + f


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compile_fullgraph_on_cuda(mode):
    """inductor on the GPU; "reduce-overhead" runs the compiled graph as a CUDA graph."""
    torch._dynamo.reset()
    q, k, v = inputs(3)
    layer = Layer()
    with torch.no_grad():
        eager = layer(q, k, v)
        compiled = torch.compile(layer, fullgraph=True, mode=mode)
        for _ in range(3):  # reduce-overhead records on a later call
            got = compiled(q, k, v)
    # the same kernels on the same inputs; inductor may sum a + c + f in another order (bf16)
    assert rel(got, eager) < 2.0 ** -8


@pytest.mark.parametrize("op", ["dense", "ba_att", "block_sparse", "causal"])
def test_the_op_runs_on_torchs_current_stream(op):
    q, k, v = inputs(4)
    expected = calls(q, k, v)[op]
    side, busy = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(side):
        calls(*(torch.zeros_like(t) for t in (q, k, v)))
    torch.cuda.synchronize()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(10 * HOLD_CYCLES)  # another stream, busy longer than the call
    with torch.cuda.stream(side):
        # inputs written on the side stream after a hold: an op on another stream reads zeros
        zq, zk, zv = (torch.zeros_like(t) for t in (q, k, v))
        torch.cuda._sleep(HOLD_CYCLES)
        for z, t in zip((zq, zk, zv), (q, k, v)):
            z.copy_(t)
        got = calls(zq, zk, zv)[op].cpu()
    assert not busy.query(), "the op synchronised the device"
    assert torch.equal(got, expected.cpu())


def test_hf_model_on_cuda_captured_and_compiled():
    transformers = pytest.importorskip("transformers")
    import copy

    import sparsa.hf

    sparsa.hf.register()
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                   max_position_embeddings=4096)
    torch.manual_seed(5)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa",
                                                        dtype=torch.bfloat16).cuda().eval()
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sparsa_ba_att",
                                                          dtype=torch.bfloat16).cuda().eval()
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 256, (1, 2048), device="cuda", generator=torch.Generator(device="cuda").manual_seed(6))
    with torch.no_grad(), sparsa.hf.options(density=1.0, block_q=128, block_kv=128):
        want = ref(ids).logits.float()
        got = model(ids).logits.float()
        # bf16 model: each layer's attention rounds differently from SDPA's (2^-8 relative), and
        # that difference passes through the MLPs; two layers: well inside 4%.
        assert rel(got, want) < 0.04
        compiled = torch.compile(model, fullgraph=True)
        assert rel(compiled(ids).logits.float(), got) < 0.04
        static = ids.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(static).logits
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.float(), got)
