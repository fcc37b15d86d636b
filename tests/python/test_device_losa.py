"""Block-diffusion decoding on the device from Python (sparsa.DevicePagedKVCache,
sparsa.DeviceLosaState) on torch CUDA tensors against the CPU classes (sparsa.PagedKVCache,
sparsa.LosaState; the specification). Skipped without torch, a CUDA device or the cuda backend
(the argument checks that need no device are in test_core.py)."""
import numpy as np
import pytest

import sparsa

torch = pytest.importorskip("torch")

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or "cuda" not in sparsa.backends(), reason="no CUDA device or cuda backend")

# bf16 bound (as tests/test_losa_cuda.cpp): O is rounded to bf16 twice on the device, 2^-9 of
# max |v| each; 2^-7 leaves room for the order of the f32 sums. LSE: f32 on both sides.
OUT_TOL, LSE_TOL = 1.0 / 128, 2e-3


def bf16(x):
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("method, union", [("losa", False), ("quest", False), ("dense", False), ("reuse", False),
                                           ("losa", True), ("quest", True)])
def test_steps_match_the_cpu(method, union):
    rng = np.random.default_rng(5)
    H, Hkv, D, Bb, N = 8, 2, 64, 16, 600
    k_pre = bf16(rng.standard_normal((1, Hkv, N, D))).float().numpy()
    v_pre = bf16(rng.standard_normal((1, Hkv, N, D))).float().numpy()
    cpu_cache = sparsa.PagedKVCache(Hkv, D)
    cpu_cache.append(k_pre, v_pre)
    cpu = sparsa.LosaState(H, Hkv, D, block_size=Bb, method=method, budget=64, force_first=True, active_k=4,
                           attend_union=union, backend="cpu_ref")
    dev_cache = sparsa.DevicePagedKVCache(Hkv, D, pool_pages=64)
    seq = dev_cache.add_sequence(N + Bb)
    dev_cache.append(seq, bf16(k_pre).cuda(), bf16(v_pre).cuda())
    assert dev_cache.length(seq) == N
    dev = sparsa.DeviceLosaState(1, H, Hkv, D, block_size=Bb, method=method, budget=64, force_first=True,
                                 active_k=4, attend_union=union)
    q = bf16(rng.standard_normal((1, H, Bb, D))).float().numpy()
    for step in range(3):
        if step:
            move = np.full((1, 1, Bb, 1), 0.02, np.float32)
            move[0, 0, (3 * step) % Bb] = move[0, 0, (7 * step + 1) % Bb] = 1.0
            q = bf16(q + move * rng.standard_normal(q.shape)).float().numpy()
        kb = bf16(rng.standard_normal((1, Hkv, Bb, D))).float().numpy()
        vb = bf16(rng.standard_normal((1, Hkv, Bb, D))).float().numpy()
        o_cpu, l_cpu = cpu.step(cpu_cache, q, kb, vb)
        o_dev, l_dev = dev.step(dev_cache, [seq], bf16(q).cuda(), bf16(kb).cuda(), bf16(vb).cuda())
        assert o_dev.dtype == torch.bfloat16 and o_dev.is_cuda
        np.testing.assert_allclose(o_dev.float().cpu().numpy(), o_cpu, atol=OUT_TOL, rtol=0)
        np.testing.assert_allclose(l_dev.cpu().numpy(), l_cpu, atol=LSE_TOL, rtol=0)
        rows, counts = dev.active_rows()
        assert int(counts[0]) == len(cpu.stats["recomputed"])
        assert rows[0, : int(counts[0])].cpu().tolist() == list(cpu.stats["recomputed"])


@needs_cuda
def test_a_full_sequence_is_a_memory_error():
    cache = sparsa.DevicePagedKVCache(2, 64, pool_pages=4)
    seq = cache.add_sequence(32)
    k = torch.zeros(1, 2, 40, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(MemoryError):
        cache.append(seq, k, k)
    assert cache.length(seq) == 0
    with pytest.raises(MemoryError):
        cache.add_sequence(100)


@needs_cuda
def test_bad_arguments_name_the_argument():
    cache = sparsa.DevicePagedKVCache(2, 64, pool_pages=8)
    seq = cache.add_sequence(64)
    state = sparsa.DeviceLosaState(1, 8, 2, 64)
    q = torch.zeros(1, 8, 16, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^k_block:"):
        state.step(cache, [seq], q, q, kv)
    with pytest.raises(ValueError, match=r"^seqs"):
        state.step(cache, [seq + 5], q, kv, kv)
    with pytest.raises(TypeError, match=r"cache: expected sparsa.DevicePagedKVCache"):
        state.step(object(), [seq], q, kv, kv)
