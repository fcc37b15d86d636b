"""bench/cuda/bench_llsa.py's FlexAttention peer: its BlockMask (FlexAttention's 128-token tiles
over LLSA's fine blocks, a mask_mod keeping the selected blocks' keys) gives, on the CPU, dense
attention restricted to exactly the plan's fine blocks. N is not a multiple of the block or the
tile, so the last partial block and tile are in play."""
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")
import sparsa  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "cuda"))
import bench_llsa  # noqa: E402


@pytest.mark.parametrize("n,block,topk", [(1000, 16, 4), (700, 20, 3)])
def test_flex_peer_attends_exactly_the_fine_blocks(n, block, topk):
    heads, d = 2, 32
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, d) for _ in range(3))
    plan = sparsa.llsa_plan(q, k, block=block, topk=topk, levels=2)
    index = plan["index"]
    mask = bench_llsa.flex_fine_mask(index, n, block, heads, "cpu")
    out = flex.flex_attention(q, k, v, block_mask=mask)

    nb = -(-n // block)
    counts = torch.as_tensor(index.counts).reshape(heads, nb)
    picks = torch.as_tensor(index.indices).reshape(heads, nb, -1)
    allow = torch.zeros(heads, n, n, dtype=torch.bool)
    for h in range(heads):
        for qb in range(nb):
            for s in range(int(counts[h, qb])):
                kb = int(picks[h, qb, s])
                allow[h, qb * block:(qb + 1) * block, kb * block:(kb + 1) * block] = True
    assert allow.any(-1).all(), "every query has selected keys"
    logits = (q[0] @ k[0].transpose(-1, -2)) / math.sqrt(d)
    ref = torch.softmax(logits.masked_fill(~allow, float("-inf")), -1) @ v[0]
    # f32 throughout; the two sum the same terms in another order.
    assert (out[0] - ref).abs().max().item() < 1e-5
    # Exactly the tiles that hold a selected block are listed, no more (they would be computed).
    t = bench_llsa.FLEX_TILE
    nt = -(-n // t)
    padded = torch.zeros(heads, nt * t, nt * t, dtype=torch.bool)
    padded[:, :n, :n] = allow
    want = padded.view(heads, nt, t, nt, t).any(dim=4).any(dim=2)
    listed = torch.zeros_like(want)
    num, idx = mask.kv_num_blocks[0], mask.kv_indices[0]
    for h in range(heads):
        for qt in range(nt):
            listed[h, qt, idx[h, qt, :int(num[h, qt])].long()] = True
    assert torch.equal(num.long(), want.sum(-1))
    assert torch.equal(listed, want)


def test_child_row_reads_the_last_json_line_and_reports_a_failed_child():
    """The flex-fine row runs in a child process so a faulting kernel cannot poison the
    benchmark's CUDA context: its answer is the child's last JSON line; a crash, a timeout or
    output that is not JSON comes back as the reason, never as an exception."""
    py = sys.executable
    row, why = bench_llsa.child_row([py, "-c", 'print("compiling"); print(\'{"fwd": 1.5, "fb": 4.0}\')'], 60)
    assert row == {"fwd": 1.5, "fb": 4.0} and why is None
    row, why = bench_llsa.child_row([py, "-c", "import sys; sys.stderr.write('illegal address\\n'); sys.exit(3)"], 60)
    assert row is None and "exit code 3" in why and "illegal address" in why
    row, why = bench_llsa.child_row([py, "-c", 'print("not json")'], 60)
    assert row is None and "not json" in why
    row, why = bench_llsa.child_row([py, "-c", "import time; time.sleep(5)"], 0.5)
    assert row is None and "no answer" in why


def test_forced_rung_holds_the_variable_for_the_call_and_restores_it(monkeypatch):
    seen = []

    def fn():
        seen.append((os.environ.get(bench_llsa.RUNG_VAR), os.environ.get(bench_llsa.FINE_STEP_VAR)))

    def timer(f):
        f()
        return 1.25

    monkeypatch.delenv(bench_llsa.RUNG_VAR, raising=False)
    monkeypatch.delenv(bench_llsa.FINE_STEP_VAR, raising=False)
    assert bench_llsa.forced_rung_ms("3", fn, timer) == 1.25
    assert seen == [("3", None)]
    assert bench_llsa.RUNG_VAR not in os.environ and bench_llsa.FINE_STEP_VAR not in os.environ
    assert bench_llsa.forced_rung_ms("3:64", fn, timer) == 1.25
    assert seen[-1] == ("3", "64") and bench_llsa.FINE_STEP_VAR not in os.environ
    monkeypatch.setenv(bench_llsa.RUNG_VAR, "1")
    monkeypatch.setenv(bench_llsa.FINE_STEP_VAR, "16")

    def failing(f):
        f()
        raise RuntimeError("timer failed")

    with pytest.raises(RuntimeError):
        bench_llsa.forced_rung_ms("2", fn, failing)
    assert seen[-1] == ("2", None)
    assert os.environ[bench_llsa.RUNG_VAR] == "1" and os.environ[bench_llsa.FINE_STEP_VAR] == "16"


@pytest.mark.parametrize("text,want", [("2,3", ["2", "3"]), (" 1, 3 ", ["1", "3"]), ("1,2,3", ["1", "2", "3"]),
                                       ("2,3,3:64", ["2", "3", "3:64"]), ("3,4,4:64", ["3", "4", "4:64"])])
def test_parse_rungs_accepts(text, want):
    assert bench_llsa.parse_rungs(text) == want


@pytest.mark.parametrize("text", ["", "3", "2,2", "2,5", "rung2,3", "0,1", "3,3:32", "1:16,2", "3,3:16"])
def test_parse_rungs_refuses(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        bench_llsa.parse_rungs(text)
