"""LLSA on CUDA tensors through the Python package and the torch op (skipped without a GPU).

The kernels' accuracy is established against cpu_ref in the C++ test (tests/test_llsa_cuda.cpp,
twice a naive half-precision LLSA); here the plumbing: outputs on the input's device, the torch
op's autograd, streams, and a small DiT block trained on the GPU against the same block trained
with the CPU backend. Tolerances: bf16 has unit roundoff 2^-8 = 3.9e-3; an attention output that
rounds its probabilities and its result errs by a few of those (relative L2), so the GPU/CPU
comparisons allow 2e-2 (outputs) and 4e-2 (gradients, one more rounded product, dS).
"""
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import sparsa  # noqa: E402
import sparsa.torch as st  # noqa: E402

KW = dict(block=16, topk=4, levels=2)


def _inputs(n=700, heads=2, d=64, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, d, generator=g).to(dtype) for _ in range(4)]


def _rel(a, b):
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


def test_forward_on_device_matches_cpu():
    q, k, v, _ = _inputs()
    out, lse = sparsa.llsa(q.cuda(), k.cuda(), v.cuda(), **KW)
    assert out.is_cuda and lse.is_cuda and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref, ref_lse = sparsa.llsa(q.float(), k.float(), v.float(), backend="cpu", **KW)
    assert _rel(out, ref) < 2e-2
    assert (lse.cpu() - ref_lse).abs().max().item() < 2e-2


def test_backward_on_device_matches_cpu():
    q, k, v, do = _inputs(seed=1)
    qc, kc, vc, doc = (t.cuda() for t in (q, k, v, do))
    out, lse = sparsa.llsa(qc, kc, vc, **KW)
    grads = sparsa.llsa_backward(qc, kc, vc, out, lse, doc, **KW)
    ref = sparsa.llsa_backward(q.float(), k.float(), v.float(), out.float().cpu(), lse.cpu(), do.float(),
                               backend="cpu", **KW)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert g.is_cuda and g.dtype == torch.bfloat16, name
        assert _rel(g, r) < 4e-2, name


def test_torch_op_autograd_on_cuda_is_sparsa_backward():
    q, k, v, do = (t.cuda() for t in _inputs(seed=2))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = st.llsa_attention(qg, kg, vg, **KW)
    out.backward(do)
    o, lse = sparsa.llsa(q, k, v, **KW)
    assert torch.equal(out.detach(), o)
    dq, dk, dv = sparsa.llsa_backward(q, k, v, o, lse, do, **KW)
    assert torch.equal(qg.grad, dq) and torch.equal(kg.grad, dk) and torch.equal(vg.grad, dv)


def test_side_stream_gives_the_same_bits():
    q, k, v, _ = (t.cuda() for t in _inputs(seed=3))
    ref, _ = sparsa.llsa(q, k, v, **KW)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out, _ = sparsa.llsa(q, k, v, **KW)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(out, ref)


def test_f32_on_cuda_is_a_clear_error():
    q = torch.randn(1, 1, 64, 64, device="cuda")
    with pytest.raises(Exception, match="bf16 or f16"):
        sparsa.llsa(q, q, q, **KW)


class _Block(torch.nn.Module):
    """A DiT-style block: pre-norm LLSA self-attention and an MLP, residual."""

    def __init__(self, dim=128, heads=2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, x, half):
        b, n, c = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = (t.to(half) if half is not None else t for t in qkv)
        a = st.llsa_attention(q, k, v, **KW).float()
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


def _train(device, half, steps=50):
    torch.manual_seed(0)
    model = _Block().to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 256, 128, generator=g).to(device)
    y = torch.randn(2, 256, 128, generator=g).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x, half), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_dit_block_trains_on_cuda_like_on_cpu():
    """50 Adam steps from one seed: the GPU run (bf16 LLSA on the device) follows the CPU run with
    the same bf16 attention inputs (sparsa's CPU backend) within bf16 noise, measured as the gap
    between that CPU run and one in f32 throughout."""
    gpu = _train("cuda", torch.bfloat16)
    cpu = _train("cpu", torch.bfloat16)
    cpu32 = _train("cpu", None)
    noise = max(abs(a - b) for a, b in zip(cpu, cpu32))
    gap = max(abs(a - b) for a, b in zip(gpu, cpu))
    assert gpu[-1] < 0.9 * gpu[0], "the loss did not fall"
    assert gap <= 3 * noise + 1e-4 * cpu[0], f"gap {gap:.3g} vs bf16 noise {noise:.3g}"
