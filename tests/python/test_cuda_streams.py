"""sparsa on torch's streams: with no ``stream=`` a call runs on torch's current stream of the
inputs' device, so it orders with the caller's torch work on that stream and needs no
device-wide synchronisation. Skipped without torch, a CUDA device, or the cuda backend."""
import pytest

import sparsa

torch = pytest.importorskip("torch")

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or "cuda" not in sparsa.backends(), reason="no CUDA device or cuda backend")

# About 0.2 s of a spinning kernel on an H200 (torch.cuda._sleep counts clock cycles).
HOLD_CYCLES = 400_000_000


def _inputs(len_q=700, len_kv=700):
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(1, 4, len_q, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 4, len_kv, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, 4, len_kv, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def _run(op, q, k, v, **kw):
    if op == "dense":
        return sparsa.dense(q, k, v, **kw)
    if op == "ba_att":
        return sparsa.ba_att(q, k, v, density=0.5, **kw)
    plan = sparsa.ba_att_plan(q, k, density=0.5, **kw)
    return sparsa.block_sparse(q, k, v, plan, **kw)


@needs_cuda
@pytest.mark.parametrize("op,len_q", [("dense", 700), ("dense", 16), ("ba_att", 700), ("block_sparse", 700)])
def test_a_call_runs_on_torchs_current_stream(op, len_q):
    q, k, v = _inputs(len_q)
    expected, expected_lse = _run(op, q, k, v)
    side, busy = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(side):  # torch's allocator takes its blocks for this stream now, not below
        zq, zk, zv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        _run(op, zq, zk, zv)
        del zq, zk, zv
    torch.cuda.synchronize()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(10 * HOLD_CYCLES)  # another stream, busy for longer than the call
    with torch.cuda.stream(side):
        # The inputs are made on the side stream after it was held: sparsa on any other stream
        # would read them before they are written.
        zq, zk, zv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        torch.cuda._sleep(HOLD_CYCLES)
        zq.copy_(q)
        zk.copy_(k)
        zv.copy_(v)
        out, lse = _run(op, zq, zk, zv)
        got = out.cpu()  # read back on the side stream (waits for it only)
        got_lse = lse.cpu()
    assert not busy.query(), "the call synchronised the device"
    assert torch.equal(got, expected.cpu())
    assert torch.equal(got_lse, expected_lse.cpu())
    busy.synchronize()


@needs_cuda
def test_an_explicit_stream_is_taken():
    q, k, v = _inputs()
    expected, _ = sparsa.dense(q, k, v)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device="cuda", dtype=torch.float32)
    with torch.cuda.stream(side):
        torch.cuda._sleep(HOLD_CYCLES)
        zq = q.clone()
    # Called outside the side stream's context, but on it by argument (a torch.cuda.Stream or its
    # integer handle).
    sparsa.dense(zq, k, v, out=out, lse=lse, stream=side)
    side.synchronize()
    assert torch.equal(out, expected)
    sparsa.dense(zq, k, v, out=out, lse=lse, stream=side.cuda_stream)
    side.synchronize()
    assert torch.equal(out, expected)
