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
