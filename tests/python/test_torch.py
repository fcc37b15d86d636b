"""sparsa on torch tensors (skipped where torch is absent; the GPU check runs them)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparsa  # noqa: E402
import sparsa.torch as st  # noqa: E402


def test_dense_returns_torch_on_cpu():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 33, 64, generator=g)
    k = torch.randn(1, 2, 47, 64, generator=g)
    v = torch.randn(1, 2, 47, 64, generator=g)
    out, lse = sparsa.dense(q, k, v)
    assert isinstance(out, torch.Tensor) and out.device == q.device and out.dtype == q.dtype
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(2, 1),
                                                           v.double().repeat_interleave(2, 1))
    assert (out.double() - ref).abs().max() / ref.abs().max() < 1e-5


def test_bf16_inputs():
    q = torch.randn(1, 2, 16, 64).bfloat16()
    out, _ = sparsa.dense(q, q, q)
    assert out.dtype == torch.bfloat16
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), q.double(), q.double())
    # bf16 output rounding: half an ulp (2^-8) relative.
    assert (out.double() - ref).abs().max() / ref.abs().max() < 2.0**-8 + 1e-5


def test_block_mask_round_trip():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    index = sparsa.BlockIndex.full(1, 2, 256, 384, 128, 128)
    index.counts[0, 1, 0] = 1
    index.indices[0, 1, 0, :] = [2, 0, 0]
    bm = st.to_block_mask(index, 256, 384)
    assert isinstance(bm, flex.BlockMask)
    back = st.from_block_mask(bm)
    assert back.block_q == 128 and back.block_kv == 128
    assert np.array_equal(back.counts.numpy(), index.counts)
    for i in np.ndindex(index.counts.shape):
        c = index.counts[i]
        assert np.array_equal(back.indices.numpy()[i][:c], index.indices[i][:c])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensor_with_cpu_backend_is_refused_cleanly():
    q = torch.randn(1, 2, 16, 64, device="cuda")
    with pytest.raises(ValueError, match=r"q: expected a tensor on cpu, got cuda:0"):
        sparsa.dense(q, q, q, backend="cpu")


def test_llsa_attention_autograd_matches_sparsa_backward():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=g, requires_grad=True) for _ in range(3))
    out = st.llsa_attention(q, k, v, block=4, topk=2)
    w = torch.randn(out.shape, generator=g)
    (out * w).sum().backward()
    ref_o, ref_lse = sparsa.llsa(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), block=4, topk=2)
    assert np.allclose(out.detach().numpy(), ref_o)
    dq, dk, dv = sparsa.llsa_backward(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), ref_o, ref_lse,
                                      w.numpy(), block=4, topk=2)
    assert np.allclose(q.grad.numpy(), dq) and np.allclose(k.grad.numpy(), dk) and np.allclose(v.grad.numpy(), dv)
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0 and v.grad.abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_dense_on_cuda_tensors_stays_on_the_device():
    if "cuda" not in sparsa.backends():
        pytest.skip("sparsa built without the cuda backend")
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 300, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 2, 333, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, 2, 333, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    sparsa.dense(q, k, v)  # warm up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out, lse = sparsa.dense(q, k, v)
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if "memcpy" in e.name.lower() and ("HtoD" in e.name or "DtoH" in e.name)]
    assert copies == [], copies  # no host round trip
    assert out.is_cuda and out.dtype == torch.bfloat16 and lse.is_cuda and lse.dtype == torch.float32
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(4, 1),
                                                           v.double().repeat_interleave(4, 1))
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


# ---- selectors on torch tensors --------------------------------------------------------

def test_ba_att_on_cpu_torch_tensors():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 70, 32, generator=g)
    k = torch.randn(1, 2, 90, 32, generator=g)
    v = torch.randn(1, 2, 90, 32, generator=g)
    # every block kept: equals dense attention whatever the sort
    out, lse = sparsa.ba_att(q, k, v, block_q=16, block_kv=16, density=1.0)
    assert isinstance(out, torch.Tensor) and out.dtype == q.dtype and isinstance(lse, torch.Tensor)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(2, 1),
                                                           v.double().repeat_interleave(2, 1))
    assert (out.double() - ref).abs().max() / ref.abs().max() < 1e-5
    plan = sparsa.ba_att_plan(q, k, block_q=16, block_kv=16, density=0.5)
    assert isinstance(plan.counts, np.ndarray) and (plan.counts == 3).all()  # plans are numpy
    with pytest.raises(ValueError, match=r"index: a plan with perm_q/perm_kv has no BlockMask form"):
        st.to_block_mask(plan, 70, 90)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_ba_att_plan_on_cuda_tensors_stays_on_the_device():
    if "cuda" not in sparsa.backends():
        pytest.skip("sparsa built without the cuda backend")
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 4, 300, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 2, 333, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, 2, 333, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    plan = sparsa.ba_att_plan(q, k, block_q=128, block_kv=128, top_kappa=2)
    for a in (plan.counts, plan.indices, plan.perm_q, plan.perm_kv):
        assert isinstance(a, torch.Tensor) and a.is_cuda and a.dtype == torch.int32
    assert plan.counts.shape == (1, 4, 3) and (plan.counts == 2).all()
    assert plan.perm_q.shape == (1, 4, 300) and plan.perm_kv.shape == (1, 2, 333)
    assert (plan.perm_kv.sort(dim=-1).values == torch.arange(333, device="cuda", dtype=torch.int32)).all()
    out, lse = sparsa.ba_att(q, k, v, block_q=128, block_kv=128, top_kappa=2)
    assert out.is_cuda and out.dtype == torch.bfloat16 and lse.is_cuda
    # the executor under the same plan on the CPU (f32 copies)
    host = sparsa.BlockIndex(128, 128, plan.counts.cpu().numpy(), plan.indices.cpu().numpy(),
                             plan.perm_q.cpu().numpy(), plan.perm_kv.cpu().numpy())
    ref, _ = sparsa.block_sparse(q.float().cpu().numpy(), k.float().cpu().numpy(), v.float().cpu().numpy(), host,
                                 backend="cpu_ref")
    err = np.linalg.norm(out.float().cpu().numpy() - ref) / np.linalg.norm(ref)
    assert err < 4 * 2.0 ** -8, err


def test_xattention_plan_to_block_mask():
    pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 256, 64, generator=g)
    k = torch.randn(1, 2, 256, 64, generator=g)
    plan = sparsa.xattention_plan(q, k, block_q=128, block_kv=128, stride=8)
    back = st.from_block_mask(st.to_block_mask(plan, 256, 256))
    assert np.array_equal(back.counts.numpy(), plan.counts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_selectors_refuse_cuda_tensors_cleanly():
    q = torch.randn(1, 2, 64, 64, device="cuda")
    with pytest.raises(ValueError, match=r"q: expected a tensor on cpu, got cuda:0"):
        sparsa.ba_att_plan(q, q, backend="cpu")
    with pytest.raises(ValueError, match=r"q: expected a tensor on cpu, got cuda:0"):
        sparsa.xattention_plan(q, q, block_q=32, block_kv=32, backend="cpu")
    with pytest.raises(ValueError, match=r"out: expected an array on cpu, got one on cuda:0"):
        sparsa.relative_error(q, q)


def test_losa_state_and_quest_on_cpu_torch_tensors():
    g = torch.Generator().manual_seed(4)
    cache = sparsa.PagedKVCache(2, 16)
    cache.append(torch.randn(1, 2, 64, 16, generator=g), torch.randn(1, 2, 64, 16, generator=g))
    state = sparsa.LosaState(4, 2, 16, block_size=8, budget=32, active_k=2)
    q = torch.randn(1, 4, 8, 16, generator=g)
    kb, vb = torch.randn(1, 2, 8, 16, generator=g), torch.randn(1, 2, 8, 16, generator=g)
    out, lse = state.step(cache, q, kb, vb)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    k = torch.cat([torch.from_numpy(cache.keys()), kb], 2).double().repeat_interleave(2, 1)
    v = torch.cat([torch.from_numpy(cache.values()), vb], 2).double().repeat_interleave(2, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k, v)  # first step: dense
    assert (out.double() - ref).abs().max() / ref.abs().max() < 1e-5
    out, lse = sparsa.quest(q, k[:, ::2].float(), v[:, ::2].float(), budget=16 * 5)  # every page
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k, v)
    assert isinstance(out, torch.Tensor) and (out.double() - ref).abs().max() / ref.abs().max() < 1e-5


def test_quest_on_bf16_torch_returns_bf16():
    """quest's result comes back from the core in q's dtype; numpy has no bfloat16, so the bits
    travel as uint16 and are viewed back. The same inputs in f32 give the same output up to the
    output's own bf16 rounding (2^-8 relative), since quest computes in f32 either way."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 64, generator=g).bfloat16()
    k = torch.randn(1, 1, 100, 64, generator=g).bfloat16()
    v = torch.randn(1, 1, 100, 64, generator=g).bfloat16()
    out, lse = sparsa.quest(q, k, v, budget=32)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.dtype == torch.float32
    ref, ref_lse = sparsa.quest(q.float(), k.float(), v.float(), budget=32)
    assert torch.allclose(out.float(), ref, rtol=2 ** -8, atol=1e-6)
    assert torch.equal(lse, ref_lse)
