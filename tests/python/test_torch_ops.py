"""sparsa's torch.library custom ops, torch.compile(fullgraph=True) over them, and the
FlexAttention-shaped entry against torch's flex_attention (CPU; skipped where torch is absent).

Tolerances: f32 attention against an f64 reference is within a few f32 roundings of the softmax
and the weighted sum, ~1e-5 relative to max|out|; ops are compared with the sparsa calls they wrap
exactly (the same kernels on the same inputs)."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparsa  # noqa: E402
import sparsa.torch as st  # noqa: E402

F32 = 1e-5


def qkv(seed, b=1, hq=4, hkv=2, lq=70, lkv=90, d=32, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, lq, d, generator=g, dtype=dtype), torch.randn(b, hkv, lkv, d, generator=g, dtype=dtype),
            torch.randn(b, hkv, lkv, d, generator=g, dtype=dtype))


def sdpa64(q, k, v, mask=None, is_causal=False):
    groups = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1), attn_mask=mask,
        is_causal=is_causal)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def dense_mask_of(index, lq, lkv):
    """Element mask [b, hq, lq, lkv] of a plan without permutations."""
    counts, indices = torch.as_tensor(index.counts), torch.as_tensor(index.indices)
    b, h, nq = counts.shape
    mask = torch.zeros(b, h, lq, lkv, dtype=torch.bool)
    for i in np.ndindex(b, h, nq):
        for s in range(int(counts[i])):
            kb = int(indices[i][s])
            mask[i[0], i[1], i[2] * index.block_q:(i[2] + 1) * index.block_q,
                 kb * index.block_kv:(kb + 1) * index.block_kv] = True
    return mask


# ---- the ops --------------------------------------------------------------------------

def test_fake_kernels_give_shapes_without_computing():
    with torch._subclasses.fake_tensor.FakeTensorMode():
        q, k, v = torch.empty(1, 4, 70, 32), torch.empty(1, 2, 90, 32), torch.empty(1, 2, 90, 32)
        for out, lse in (torch.ops.sparsa.dense(q, k, v), torch.ops.sparsa.ba_att(q, k, v, 16, 16),
                         torch.ops.sparsa.llsa(q, q, q)):
            assert out.shape == q.shape and out.dtype == q.dtype
            assert lse.shape == (1, 4, 70) and lse.dtype == torch.float32
        counts, indices, perm_q, perm_kv = torch.ops.sparsa.ba_att_plan(q, k, 16, 16, True, False)
        assert counts.shape == (1, 4, 5) and indices.shape == (1, 4, 5, 3)  # ceil(0.5 * 6)
        assert perm_q.shape == (1, 4, 70) and perm_kv.shape == (0,) and indices.dtype == torch.int32


@pytest.mark.parametrize("name", ["dense", "block_sparse", "ba_att_plan", "ba_att", "merge", "llsa"])
def test_opcheck(name):
    """torch.library.opcheck: the schema, the fake kernel against the real one, and (llsa) the
    autograd registration."""
    q, k, v = qkv(3, lq=64, lkv=64, d=16)
    if name == "dense":
        args = (q, k, v, None)
    elif name == "block_sparse":
        plan = sparsa.BlockIndex.full(1, 4, 64, 64, 16, 16)
        args = (q, k, v, *st.plan_tensors(plan)[:2], None, None, 16, 16, None, True)
    elif name == "ba_att_plan":
        args = (q, k, 16, 16, True, True, True, 1.0, "density", 0.5, None)
    elif name == "ba_att":
        args = (q, k, v, 16, 16, True, True, True, 1.0, "top_kappa", 2.0, None)
    elif name == "merge":
        o1, l1 = st.dense(q, k[:, :, :30], v[:, :, :30])
        o2, l2 = st.dense(q, k[:, :, 30:], v[:, :, 30:])
        args = (o1, l1, o2, l2)
    else:
        q, k, v = qkv(3, hkv=4, lq=64, lkv=64, d=16)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        args = (q, k, v, 4, 2, -1, True, False, None)
    torch.library.opcheck(getattr(torch.ops.sparsa, name).default, args)


def test_dense_and_block_sparse_ops_against_sdpa():
    q, k, v = qkv(4)
    out, lse = st.dense(q, k, v)
    assert rel(out, sdpa64(q, k, v)) < F32
    scores = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(32)
    assert (lse.double() - torch.logsumexp(scores, -1)).abs().max() < F32 * 10
    plan = sparsa.xattention_plan(q, k, block_q=16, block_kv=16, stride=4, density=0.5)
    out, _ = st.block_sparse(q, k, v, plan)
    assert rel(out, sdpa64(q, k, v, mask=dense_mask_of(plan, 70, 90))) < F32


def test_ba_att_ops_equal_the_sparsa_calls():
    q, k, v = qkv(5)
    plan = st.ba_att_plan(q, k, block_q=16, block_kv=16, density=0.5)
    ref = sparsa.ba_att_plan(q, k, block_q=16, block_kv=16, density=0.5)
    for name in ("counts", "indices", "perm_q", "perm_kv"):
        assert np.array_equal(getattr(plan, name).numpy(), getattr(ref, name)), name
    out, lse = st.ba_att(q, k, v, block_q=16, block_kv=16, density=0.5)
    ref_out, ref_lse = sparsa.ba_att(q, k, v, block_q=16, block_kv=16, density=0.5)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    out2, _ = st.block_sparse(q, k, v, plan)
    assert torch.equal(out2, out)
    unsorted = st.ba_att_plan(q, k, block_q=16, block_kv=16, sort_q=False, sort_k=False, top_kappa=3)
    assert unsorted.perm_q is None and unsorted.perm_kv is None and unsorted.capacity == 3


@pytest.mark.parametrize("density", [0.05, 0.3, 0.5, 0.7, 1.0])
def test_ba_att_plan_fake_capacity_matches_the_core(density):
    q, k, _ = qkv(6, lq=200, lkv=330)
    real = st.ba_att_plan(q, k, block_q=32, block_kv=32, density=density)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = st.ba_att_plan(mode.from_tensor(q), mode.from_tensor(k), block_q=32, block_kv=32, density=density)
    assert tuple(fake.indices.shape) == tuple(real.indices.shape)
    assert tuple(fake.counts.shape) == tuple(real.counts.shape)


def test_bad_budgets_are_refused_by_name():
    q, k, v = qkv(7)
    with pytest.raises(ValueError, match=r"budget: a mass \(tau\) budget keeps a data-dependent number"):
        torch.ops.sparsa.ba_att_plan(q, k, 16, 16, True, True, True, 1.0, "mass", 0.9, None)
    with pytest.raises(ValueError, match=r"budget: expected one of density, top_kappa, mass, got 'dens'"):
        torch.ops.sparsa.ba_att(q, k, v, 16, 16, True, True, True, 1.0, "dens", 0.5, None)
    with pytest.raises(ValueError, match=r"budget: expected at most one of top_kappa, density or tau"):
        st.ba_att(q, k, v, density=0.5, top_kappa=2)
    # the core's own checks still name the argument through the op
    with pytest.raises(ValueError, match=r"budget"):
        st.ba_att(q, k, v, block_q=16, block_kv=16, density=1.5)


def test_merge_op_of_two_halves_is_dense():
    q, k, v = qkv(8)
    o1, l1 = st.dense(q, k[:, :, :40], v[:, :, :40])
    o2, l2 = st.dense(q, k[:, :, 40:], v[:, :, 40:])
    out, lse = st.merge(o1, l1, o2, l2)
    ref, ref_lse = st.dense(q, k, v)
    assert rel(out, ref) < F32 and (lse - ref_lse).abs().max() < F32 * 10


def test_the_cuda_merge_formula_equals_sparsa_merge():
    """sparsa has no CUDA merge kernel: the op's CUDA kernel is torch math, checked here on the
    CPU against sparsa's merge, empty sides (lse = -inf) included."""
    q, k, v = qkv(20)
    o1, l1 = st.dense(q, k[:, :, :40], v[:, :, :40])
    o2, l2 = st.dense(q, k[:, :, 40:], v[:, :, 40:])
    l1[0, 0, :5] = float("-inf")
    o1[0, 0, :5] = 0
    l1[0, 1, :3] = l2[0, 1, :3] = float("-inf")
    o1[0, 1, :3] = o2[0, 1, :3] = 0
    out, lse = st._merge_cuda(o1, l1, o2, l2)
    ref, ref_lse = sparsa.merge(o1, l1, o2, l2)
    assert rel(out, ref) < F32 and torch.allclose(lse, ref_lse, atol=1e-5, rtol=0)
    assert (out[0, 1, :3] == 0).all() and torch.isneginf(lse[0, 1, :3]).all()
    assert torch.equal(out[0, 0, :5], o2[0, 0, :5]) or rel(out[0, 0, :5], o2[0, 0, :5]) < F32


def test_llsa_op_autograd_equals_sparsa_backward():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=g, requires_grad=True) for _ in range(3))
    out = st.llsa_attention(q, k, v, block=4, topk=2)
    w = torch.randn(out.shape, generator=g)
    (out * w).sum().backward()
    qn, kn, vn = (t.detach().numpy() for t in (q, k, v))
    ref_o, ref_lse = sparsa.llsa(qn, kn, vn, block=4, topk=2)
    dq, dk, dv = sparsa.llsa_backward(qn, kn, vn, ref_o, ref_lse, w.numpy(), block=4, topk=2)
    assert np.array_equal(out.detach().numpy(), ref_o)
    assert np.array_equal(q.grad.numpy(), dq) and np.array_equal(k.grad.numpy(), dk) and \
        np.array_equal(v.grad.numpy(), dv)


# ---- torch.compile(fullgraph=True) ---------------------------------------------------------

class SparseBlock(torch.nn.Module):
    """A layer that calls every op: BA-Att, a BA-Att plan run by block_sparse, dense, merge."""

    def __init__(self, d=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, d
        g = torch.Generator().manual_seed(10)
        self.wq = torch.nn.Parameter(torch.randn(heads * d, heads * d, generator=g) / math.sqrt(heads * d))
        self.wk = torch.nn.Parameter(torch.randn(kv_heads * d, heads * d, generator=g) / math.sqrt(heads * d))

    def forward(self, x):
        b, n, _ = x.shape
        q = (x @ self.wq.T).view(b, n, self.heads, self.d).transpose(1, 2)
        k = (x @ self.wk.T).view(b, n, self.kv_heads, self.d).transpose(1, 2)
        v = k * 0.5
        a, _ = st.ba_att(q, k, v, block_q=16, block_kv=16, density=0.5)
        plan = st.ba_att_plan(q, k, block_q=16, block_kv=16, top_kappa=2)
        c, lse_c = st.block_sparse(q, k, v, plan, check_index=False)
        d, lse_d = st.dense(q[..., :1, :].expand(-1, -1, n, -1).contiguous(), k, v)
        e, _ = st.merge(c, lse_c, d, lse_d)
        return a + e + st.attention(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_traces_the_ops(backend):
    torch._dynamo.reset()
    model = SparseBlock()
    x = torch.randn(1, 80, 128, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ref = model(x)
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        got = compiled(x)
    # The ops run the same kernels; inductor may reorder the projections' f32 sums (~1e-6).
    assert rel(got, ref) < F32


def test_compile_fullgraph_llsa_backward():
    torch._dynamo.reset()

    def loss(q, k, v):
        return (st.llsa_attention(q, k, v, block=4, topk=2) ** 2).sum()

    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g, requires_grad=True) for _ in range(3))
    loss(q, k, v).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v).backward()
    for a, b in zip(eager, (q.grad, k.grad, v.grad)):
        assert torch.equal(a, b)


# ---- causal attention ------------------------------------------------------------------------

@pytest.mark.parametrize("n,block", [(1, 16), (16, 16), (100, 16), (257, 64)])
def test_causal_attention_at_density_one_is_causal_sdpa(n, block):
    q, k, v = qkv(13, lq=n, lkv=n)
    out, lse = st.causal_attention(q, k, v, block=block)
    assert rel(out, sdpa64(q, k, v, is_causal=True)) < F32
    scores = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(32)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    assert (lse.double() - torch.logsumexp(scores, -1)).abs().max() < F32 * 10


def reference_causal_plan(q, k, block, density):
    """The rule of causal_plan from sparsa's own BA-Att block logits (no sort), in numpy."""
    scores = sparsa.ba_att_scores(q, k, block_q=block, block_kv=block, sort_q=False, sort_k=False)
    logits = scores.logits.astype(np.float64)
    b, h, nb, _ = logits.shape
    keep = [max(0, min(i, math.ceil(density * (i + 1) - 1e-9) - 1)) for i in range(nb)]
    cap = max(keep)
    counts = np.broadcast_to(np.array(keep, dtype=np.int32), (b, h, nb))
    indices = np.zeros((b, h, nb, cap), dtype=np.int32)
    for bi, hi, i in np.ndindex(b, h, nb):
        order = np.argsort(-logits[bi, hi, i, :i], kind="stable")[:keep[i]]
        indices[bi, hi, i, :keep[i]] = np.sort(order)
    return counts, indices


@pytest.mark.parametrize("n,hq,hkv,block", [(1000, 8, 2, 128), (256, 4, 4, 64), (77, 6, 3, 16), (5, 2, 1, 16)])
def test_the_gpu_diagonal_layout_on_the_cpu(n, hq, hkv, block):
    """The GPU form of the causal composition's diagonal blocks (blocks as the batch of one causal
    kernel call) with a plain f64 causal softmax in the kernel's place equals the CPU form (an f32
    einsum over the blocks' score tiles): this checks the blocking, GQA repetition, padding and
    unblocking that CI cannot run on a GPU (f32 against f64: 1e-5)."""
    def kernel(q, k, v, scale):
        assert q.shape == k.shape == v.shape and q.shape[2] == block
        s = (q.double() @ k.double().transpose(-1, -2)) * scale
        s = s.masked_fill(torch.ones(block, block, dtype=torch.bool).triu(1), float("-inf"))
        return (torch.softmax(s, -1) @ v.double()).to(q.dtype), torch.logsumexp(s, -1).float()

    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, h, n, 64, generator=g) for h in (hq, hkv, hkv))
    want, want_lse = st._diagonal_attention(q, k, v, block, 0.125)
    got, got_lse = st._diagonal_attention_flash(q, k, v, block, 0.125, kernel=kernel)
    assert got.shape == want.shape and got_lse.shape == want_lse.shape
    assert (got - want).abs().max() < 1e-5 and (got_lse - want_lse).abs().max() < 1e-5
    assert not st._flash_diagonal(q, k, v)  # f32 CPU tensors take the einsum form


def test_causal_plan_is_ba_att_choice_among_the_earlier_blocks():
    q, k, v = qkv(14, lq=300, lkv=300)
    plan = st.causal_plan(q, k, block=16, density=0.5)
    counts, indices = reference_causal_plan(q, k, 16, 0.5)
    assert np.array_equal(plan.counts.numpy(), counts)
    assert np.array_equal(plan.indices.numpy(), indices)
    out, _ = st.causal_attention(q, k, v, block=16, density=0.5)
    dense = sdpa64(q, k, v, is_causal=True)
    assert rel(out, dense) > 1e-3  # sparser: not the dense result


def test_mask_aware_ba_att_is_the_causal_composition():
    """sparsa's mask-aware BA-Att under the causal mask (C++, f32 logits) keeps what causal_plan
    (torch, f64 logits) keeps plus the diagonal block, and attends the same: two implementations
    of one rule."""
    q, k, v = qkv(16, lq=300, lkv=300)
    for density in (0.5, 0.3):
        plan = sparsa.ba_att_plan(q.numpy(), k.numpy(), block_q=16, block_kv=16, sort_q=False, sort_k=False,
                                  density=density, mask="causal", mask_aware=True)
        causal = st.causal_plan(q, k, block=16, density=density)
        counts, indices = causal.counts.numpy(), causal.indices.numpy()
        for bi, hi, i in np.ndindex(*counts.shape):
            want = sorted(indices[bi, hi, i, :counts[bi, hi, i]].tolist() + [i])
            assert plan.indices[bi, hi, i, :plan.counts[bi, hi, i]].tolist() == want, (density, hi, i)
        out, _ = sparsa.ba_att(q.numpy(), k.numpy(), v.numpy(), block_q=16, block_kv=16, sort_q=False, sort_k=False,
                               density=density, mask="causal", mask_aware=True)
        ref, _ = st.causal_attention(q, k, v, block=16, density=density)
        assert rel(torch.from_numpy(out), ref) < 1e-5


def test_causal_attention_refuses_cross_attention():
    q, k, v = qkv(15, lq=10, lkv=20)
    with pytest.raises(ValueError, match=r"k: causal attention here needs len_q == len_kv, got 10 and 20"):
        st.causal_attention(q, k, v)


# ---- the FlexAttention-shaped entry ---------------------------------------------------------

flex = pytest.importorskip("torch.nn.attention.flex_attention")


def test_attention_dense_matches_flex_attention():
    q, k, v = qkv(16, lq=128, lkv=256)
    out, lse = st.attention(q, k, v, enable_gqa=True, return_lse=True)
    ref, ref_lse = flex.flex_attention(q, k, v, enable_gqa=True, return_lse=True)
    assert rel(out, ref) < F32
    assert (lse - ref_lse).abs().max() < F32 * 10  # both natural-log
    out = st.attention(q, k, v, scale=0.3, enable_gqa=True)
    assert rel(out, flex.flex_attention(q, k, v, scale=0.3, enable_gqa=True)) < F32


def test_attention_block_mask_matches_flex_attention():
    """flex_attention run eagerly applies only the mask_mod (its block lists are a fused
    kernel's skip lists), so the mask is given as a mask_mod over the plan's blocks: then
    create_block_mask lists exactly those blocks, as full ones."""
    q, k, v = qkv(17, hq=2, hkv=2, lq=256, lkv=384)
    index = sparsa.xattention_plan(q, k, block_q=64, block_kv=64, stride=8, density=0.5)
    visible = dense_mask_of(index, 256, 384)[:, :, ::64, ::64].contiguous()  # [b, h, q block, k block]

    def in_plan(b, h, qi, ki):
        return visible[b, h, qi // 64, ki // 64]

    bm = flex.create_block_mask(in_plan, 1, 2, 256, 384, device="cpu", BLOCK_SIZE=64)
    out, lse = st.attention(q, k, v, block_mask=bm, return_lse=True)
    ref, ref_lse = flex.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert rel(out, ref) < F32 and (lse - ref_lse).abs().max() < F32 * 10
    assert rel(out, st.attention(q, k, v, plan=index)) < F32


def test_to_block_mask_against_compiled_flex_attention():
    """A BlockMask of kv blocks alone (no mask_mod), which only the compiled flex_attention reads."""
    torch._dynamo.reset()
    q, k, v = qkv(19, hq=2, hkv=2, lq=256, lkv=384, d=16)
    index = sparsa.xattention_plan(q, k, block_q=128, block_kv=128, stride=8, density=0.5)
    assert index.capacity < 3  # fewer columns than key blocks: to_block_mask pads them
    bm = st.to_block_mask(index, 256, 384)
    ref = torch.compile(flex.flex_attention)(q, k, v, block_mask=bm)
    assert rel(st.attention(q, k, v, block_mask=bm), ref) < F32
    assert rel(ref, sdpa64(q, k, v, mask=dense_mask_of(index, 256, 384))) < F32


def test_attention_plan_and_refusals():
    q, k, v = qkv(18, lq=128, lkv=128)
    plan = sparsa.ba_att_plan(q, k, block_q=32, block_kv=32, density=0.5)  # permuted: no BlockMask form
    out = st.attention(q, k, v, plan=plan, enable_gqa=True)
    ref, _ = sparsa.block_sparse(q, k, v, plan)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match=r"enable_gqa: query has 4 heads and key 2; pass enable_gqa=True"):
        st.attention(q, k, v)
    causal = flex.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 128, 128, device="cpu",
                                    BLOCK_SIZE=32)
    with pytest.raises(ValueError, match=r"block_mask: has partial blocks, inside which its mask_mod masks"):
        st.attention(q, k, v, block_mask=causal, enable_gqa=True)
    with pytest.raises(ValueError, match=r"block_mask: made for seq_lengths \(128, 128\), but query has 64"):
        st.attention(q[:, :, :64], k, v, block_mask=causal, enable_gqa=True)
    with pytest.raises(ValueError, match=r"plan: pass block_mask or plan, not both"):
        st.attention(q, k, v, block_mask=causal, plan=plan, enable_gqa=True)
    with pytest.raises(ValueError, match=r"query: expected a 4-d tensor"):
        st.attention(q[0], k, v)


def test_backends_lists_compiled_and_runnable():
    compiled = sparsa.backends(compiled=True)
    assert compiled[:2] == ["cpu_ref", "cpu"]
    assert set(sparsa.backends()) <= set(compiled)
    if "cuda" in compiled and not torch.cuda.is_available():
        assert "cuda" not in sparsa.backends()
