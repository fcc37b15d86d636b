"""sparsa.distributed on CPU process groups (gloo) of 1 to 4 processes (docs/distributed.md).

Each group runs distributed_worker.py once per rank; every rank compares its part of every
method's result with the single-process sparsa call on the whole inputs (the tolerances are
justified in that file) and prints one JSON line per check. A rank that hangs is killed at the
timeout and fails the test instead of hanging CI."""
import json
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

import sparsa  # noqa: E402
import sparsa.distributed as sd  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_worker.py")
TIMEOUT_S = 120

# The checks every rank must report (all must pass); those of a group of one process are the same
# minus the ones that need a second rank.
EVERY_WORLD = ["dense/ring/float32", "dense/allgather/float32", "dense/ring/bfloat16", "dense/ring/float16", "dense/strided",
               "shard", "block_sparse/ring", "block_sparse/allgather", "block_sparse/permuted", "ba_att_plan/sorted",
               "ba_att/sorted", "ba_att_plan/window", "ba_att/window", "ba_att_plan/unsorted", "ba_att/unsorted",
               "ba_att/bf16", "prefix/dense", "prefix/dense/bf16", "quest_plan/budget64/last",
               "prefix/quest/budget64/last", "quest_plan/budget96/first/last", "prefix/quest/budget96/first/last",
               "quest_plan/budget48/first", "quest_plan/budget16000/last", "prefix/quest/bf16/pair",
               "prefix/quest/bf16/shard", "timings/pair", "timings/shard",
               *[f"losa/{m}/step{s}{rows}" for m in ("losa", "reuse", "quest", "dense", "threshold") for s in range(4)
                 for rows in ("", "/rows")], "error/dtype-across-ranks",
               "error/head-dim-across-ranks", "error/not-a-tensor", "error/schedule", "error/budget",
               "error/plan-shape", "error/perm-q", "after-errors/dense"]
MULTI_RANK = ["negative/dropped-shard", "negative/unshifted-columns", "negative/per-shard-top-pages",
              "quest_plan/planted", "error/unaligned-shard", "error/queries-differ"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(world: int):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, str(rank), str(world), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in range(world)]
    results = []
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=TIMEOUT_S)
            results.append((rank, p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"a group of {world} processes did not finish within {TIMEOUT_S} s (a hang)")
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_method_equals_one_process(world):
    for rank, code, out, err in run_group(world):
        assert code == 0, f"rank {rank} of {world} exited {code}:\n{err[-3000:]}"
        checks = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        failed = [c for c in checks if not c["ok"]]
        assert not failed, f"rank {rank} of {world}: " + "\n".join(f"{c['name']}: {c['detail']}" for c in failed)
        names = {c["name"] for c in checks}
        expected = EVERY_WORLD + (MULTI_RANK if world > 1 else [])
        missing = [n for n in expected if n not in names]
        assert not missing, f"rank {rank} of {world} did not report {missing}"


def test_no_process_group_is_a_clear_error():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="group: no torch.distributed process group"):
        sd.dense(q, q, q)
    with pytest.raises(RuntimeError, match="group:"):
        sd.prefix_attention(q, (q, q))


def test_shard_bounds():
    assert sd.shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    # Whole blocks of 16 but the last, which is shorter: 100 tokens = 7 units over 3 ranks.
    assert sd.shard_bounds(100, 3, 16) == [(0, 48), (48, 80), (80, 100)]
    assert sd.shard_bounds(5, 1, 16) == [(0, 5)]
    assert sd.shard_bounds(16, 2, 16) == [(0, 16), (16, 16)]  # fewer units than ranks: an empty piece
    for length, world, multiple in ((1, 4, 1), (1000, 4, 64), (129, 2, 64), (7, 7, 1)):
        bounds = sd.shard_bounds(length, world, multiple)
        assert bounds[0][0] == 0 and bounds[-1][1] == length
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert all((hi - lo) % multiple == 0 for lo, hi in bounds[:-1])
        assert bounds[-1][1] - bounds[-1][0] <= bounds[0][1] - bounds[0][0]
    with pytest.raises(ValueError, match="shard_bounds"):
        sd.shard_bounds(10, 0)
    with pytest.raises(TypeError, match="multiple"):
        sd.shard_bounds(10, 2, 1.5)


def test_quest_scores_match_the_core_bit_for_bit():
    # The global QUEST selection compares scores computed here with the core's order of sums; a
    # single process (no group needed) checks the score function on awkward head_dims, with
    # near-ties planted (pages that differ in one dimension by one ulp).
    g = torch.Generator().manual_seed(7)
    for d in (16, 40, 64, 100, 128):
        q = torch.randn(1, 4, 3, d, generator=g)
        k = torch.randn(1, 2, 16 * 20 + 3, d, generator=g)
        k[:, :, 16:32] = k[:, :, 0:16]
        k[:, :, 16, 0] = torch.nextafter(k[:, :, 16, 0], torch.tensor(float("inf")))
        cache = sparsa.PagedKVCache(2, d, 16)
        cache.append(k.numpy(), k.numpy())
        keys = k[0]
        pad = 21 * 16 - keys.shape[1]
        page_min = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=float("inf")).reshape(2, 21, 16, d).amin(2)
        page_max = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=-float("inf")).reshape(2, 21, 16, d).amax(2)
        scores = sd._quest_scores(q[0], page_min, page_max)
        for budget in (16, 48, 160):
            plan = sparsa.quest_plan(q.numpy(), cache, budget=budget, force_last=False)
            order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :budget // 16]
            assert (torch.sort(order, -1).values.numpy() == plan.pages).all(), (d, budget)


BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python", "bench_distributed.py")


@pytest.mark.parametrize("case", ["verify", "ba_att", "prefix"])
def test_benchmark_script_runs_on_cpu(case, tmp_path):
    # bench/python/bench_distributed.py is the GPU benchmark; at tiny sizes on two gloo processes
    # it must run to the end (verify: and pass its own checks) and write its rows.
    sizes = {"verify": ["--tokens", "1024", "--budget", "256", "--density", "0.25"],
             "ba_att": ["--tokens", "2048", "--density", "0.25"],
             "prefix": ["--tokens", "4096", "--budget", "512"]}[case]
    out = tmp_path / "rows.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", BENCH,
               "--device", "cpu", "--case", case, "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
               "--queries", "4", "--block", "64", "--repeats", "1", "--warmup", "0", "--json", str(out)] + sizes
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"bench_distributed.py --case {case} did not finish within {TIMEOUT_S} s")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert rows and all(r.get("ok", True) for r in rows)
    if case != "verify":
        assert {r["gpus"] for r in rows} == {1, 2} and all(r["seconds"] > 0 for r in rows)
