"""Masks in sparsa.torch: the ops' mask argument, FlexAttention mask_mods made from sparsa masks,
BlockMasks that carry them (both ways), against SDPA and FlexAttention on the CPU."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

import sparsa  # noqa: E402
import sparsa.torch as st  # noqa: E402

# f32 against an f64 reference (sparsa's cpu path accumulates in f32): ~1e-6 relative.
F32 = 1e-5


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def sdpa64(q, k, v, mask):
    """f64 SDPA with a boolean mask [len_q, len_kv] (True = visible) and GQA by repetition."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)


def visible(mask, len_q, len_kv):
    m = sparsa.Mask.of(mask)
    return torch.tensor([[m.visible(i, j, len_q, len_kv) for j in range(len_kv)] for i in range(len_q)])


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mask", ["causal", ("block_causal", 16), ("sliding_window", 20), ("sliding_window", 24, 0)])
@pytest.mark.parametrize("len_q,len_kv", [(80, 80), (50, 96)])
def test_dense_op_mask_against_sdpa(mask, len_q, len_kv):
    q, k, v = randn(1, 4, len_q, 32, seed=1), randn(1, 2, len_kv, 32, seed=2), randn(1, 2, len_kv, 32, seed=3)
    out, lse = st.dense(q, k, v, mask=mask)
    assert rel(out, sdpa64(q, k, v, visible(mask, len_q, len_kv))) < F32
    if mask == "causal" and len_q == len_kv:  # SDPA's own causal flag, for equal lengths
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.repeat_interleave(2, 1).double(),
                                                               v.repeat_interleave(2, 1).double(), is_causal=True)
        assert rel(out, ref) < F32


@pytest.mark.parametrize("mask", ["causal", ("block_causal", 16), ("sliding_window", 40)])
def test_mask_mod_block_mask_runs_exactly_as_flex_attention(mask):
    L = 160
    q, k, v = randn(1, 2, L, 32, seed=4), randn(1, 2, L, 32, seed=5), randn(1, 2, L, 32, seed=6)
    bm = flex.create_block_mask(st.mask_mod(mask, L, L), B=None, H=None, Q_LEN=L, KV_LEN=L, BLOCK_SIZE=32,
                                device="cpu")
    ours = st.attention(q, k, v, block_mask=bm)
    theirs = flex.flex_attention(q, k, v, block_mask=bm)
    assert rel(ours, theirs) < F32
    assert rel(ours, sdpa64(q, k, v, visible(mask, L, L))) < F32


def test_plan_with_mask_to_block_mask_and_back():
    L = 128
    q, k, v = randn(1, 2, L, 32, seed=7), randn(1, 2, L, 32, seed=8), randn(1, 2, L, 32, seed=9)
    plan = sparsa.BlockIndex.full(1, 2, L, L, 32, 32, mask=("sliding_window", 40))
    plan.counts[0, 1, 2] = 2  # a sparser row (blocks 0, 1 of 0-3; no row left empty): not the mask's own plan
    bm = st.to_block_mask(plan, L, L, mask=("sliding_window", 40))
    assert bm.mask_mod._sparsa_mask[0] == sparsa.Mask.sliding_window(40)
    # The oracle: SDPA over the listed blocks and the mask. (flex_attention without
    # torch.compile applies only the mask_mod and ignores the block structure, so it is not
    # the oracle of a plan sparser than its mask.)
    listed = torch.zeros(L, L, dtype=torch.bool)
    for qb in range(4):
        for kb in plan.indices[0, 1, qb, :plan.counts[0, 1, qb]]:
            listed[qb * 32:(qb + 1) * 32, kb * 32:(kb + 1) * 32] = True
    theirs = sdpa64(q, k, v, listed & visible(("sliding_window", 40), L, L))[:, 1:]
    ours, _ = sparsa.block_sparse(q, k, v, plan, mask=("sliding_window", 40))
    assert rel(ours[:, 1:], theirs) < F32
    assert rel(st.attention(q, k, v, block_mask=bm)[:, 1:], theirs) < F32
    with pytest.raises(ValueError, match="^mask: .*differs from the block_mask's mask_mod"):
        st.attention(q, k, v, block_mask=bm, mask="causal")
    # Negative control: the same blocks without the mask are another answer.
    unmasked, _ = sparsa.block_sparse(q, k, v, plan)
    assert rel(unmasked[:, 1:], theirs) > 1e-3


def test_foreign_mask_mod_with_partial_blocks_is_still_refused():
    L = 64
    q = randn(1, 1, L, 16, seed=10)
    bm = flex.create_block_mask(lambda b, h, i, j: j <= i, B=None, H=None, Q_LEN=L, KV_LEN=L, BLOCK_SIZE=16,
                                device="cpu")
    with pytest.raises(ValueError, match="^block_mask: has partial blocks"):
        st.attention(q, q, q, block_mask=bm)


def test_mask_mod_made_for_other_lengths_is_refused():
    q = randn(1, 1, 64, 16, seed=11)
    bm = flex.create_block_mask(st.mask_mod("causal", 32, 32), B=None, H=None, Q_LEN=64, KV_LEN=64, BLOCK_SIZE=16,
                                device="cpu")
    with pytest.raises(ValueError, match="^block_mask: its mask_mod"):
        st.attention(q, q, q, block_mask=bm)


def test_block_sparse_op_mask_and_compile():
    L = 96
    q, k, v = randn(1, 2, L, 32, seed=12), randn(1, 2, L, 32, seed=13), randn(1, 2, L, 32, seed=14)
    plan = st.block_index(32, 32, *[torch.as_tensor(a) for a in
                                    (sparsa.BlockIndex.full(1, 2, L, L, 32, 32, mask="causal").counts,
                                     sparsa.BlockIndex.full(1, 2, L, L, 32, 32, mask="causal").indices)])

    def f(q, k, v):
        return st.block_sparse(q, k, v, plan, mask="causal")[0] + st.dense(q, k, v, mask=("block_causal", 8))[0]

    eager = f(q, k, v)
    ref = sdpa64(q, k, v, visible("causal", L, L)) + sdpa64(q, k, v, visible(("block_causal", 8), L, L))
    assert rel(eager, ref) < F32
    compiled = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
    assert rel(compiled, eager) < 1e-7


@pytest.mark.parametrize("mask", ["causal", ("block_causal", 16), ("sliding_window", 100, 0)])
def test_cuda_masked_ops_match_the_reference(mask):
    """The cuda backend's masked executors on torch CUDA tensors (zero copy), dense and over a plan,
    against f64 SDPA under the same mask: within bf16 rounding (2^-8 relative, with room for the
    accumulation: 2e-2 of the largest output)."""
    if not torch.cuda.is_available() or "cuda" not in sparsa.backends():
        pytest.skip("no CUDA device")
    L, Lkv = 300, 340
    q, k, v = randn(1, 4, L, 64, seed=21), randn(1, 2, Lkv, 64, seed=22), randn(1, 2, Lkv, 64, seed=23)
    ref = sdpa64(q, k, v, visible(mask, L, Lkv))
    qd, kd, vd = (x.to("cuda", torch.bfloat16) for x in (q, k, v))
    out, lse = st.dense(qd, kd, vd, mask=mask)
    assert out.device.type == "cuda" and lse.device.type == "cuda"
    assert rel(out.float().cpu(), ref) < 2e-2
    out2, _ = st.block_sparse(qd, kd, vd, sparsa.BlockIndex.full(1, 4, L, Lkv, 64, 64), mask=mask)
    assert rel(out2.float().cpu(), ref) < 2e-2


@pytest.mark.parametrize("mask", [None, "causal", ("block_causal", 16)])
def test_cuda_dense_varlen_matches_the_cpu(mask):
    """dense_varlen on torch CUDA tensors, offsets given as a list (moved to q's device): each
    sequence's rows against the cpu backend on the same bf16 values (2e-2 of the largest output:
    bf16 rounding of probabilities and output, as above); empty sequences and one without keys."""
    if not torch.cuda.is_available() or "cuda" not in sparsa.backends():
        pytest.skip("no CUDA device")
    lens_q, lens_kv = [200, 0, 333, 1, 40], [250, 30, 333, 1, 0]
    cu_q, cu_kv = [0], [0]
    for a, b in zip(lens_q, lens_kv):
        cu_q.append(cu_q[-1] + a)
        cu_kv.append(cu_kv[-1] + b)
    q = randn(cu_q[-1], 4, 64, seed=31).to(torch.bfloat16)
    k, v = (randn(cu_kv[-1], 2, 64, seed=s).to(torch.bfloat16) for s in (32, 33))
    ref, ref_lse = sparsa.dense_varlen(q.float(), k.float(), v.float(), cu_q, cu_kv, mask=mask, backend="cpu")
    out, lse = sparsa.dense_varlen(q.cuda(), k.cuda(), v.cuda(), cu_q, cu_kv, mask=mask, backend="cuda")
    assert out.device.type == "cuda" and out.shape == q.shape and lse.shape == (4, cu_q[-1])
    assert rel(out.float().cpu(), torch.as_tensor(ref)) < 2e-2
    empty = torch.as_tensor(ref_lse) == -float("inf")
    assert bool(empty[:, cu_q[4]:].all())  # the sequence with queries and no keys
    assert bool((lse.cpu()[empty] == -float("inf")).all())
