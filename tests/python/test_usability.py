# What a new Python user relies on: plans saved and loaded (the CLI's index file format),
# a short BlockIndex repr, FlashAttention-layout arrays as views, Z-order / Hilbert token
# orders, backend availability that says why, a hint when torch is missing, and dtype
# errors that list what each argument accepts.
import subprocess
import sys

import numpy as np
import pytest

import sparsa
from reference import attention


def test_block_index_save_load_round_trip(tmp_path, rng):
    q = rng.standard_normal((1, 4, 300, 32), dtype=np.float32)
    k = rng.standard_normal((1, 2, 300, 32), dtype=np.float32)
    v = rng.standard_normal((1, 2, 300, 32), dtype=np.float32)
    plan = sparsa.ba_att_plan(q, k, block_q=32, block_kv=32, density=0.3)
    assert plan.perm_q is not None and plan.perm_kv is not None
    plan.save(tmp_path / "plan.safetensors")
    back = sparsa.BlockIndex.load(tmp_path / "plan.safetensors")
    assert (back.block_q, back.block_kv) == (32, 32)
    for name in ("counts", "indices", "perm_q", "perm_kv"):
        np.testing.assert_array_equal(getattr(back, name), np.asarray(getattr(plan, name)))
    # The library's writer: a folder that is not there is an error naming the path, and saving
    # over the file replaces it whole (the same bytes again).
    with pytest.raises(RuntimeError, match="nowhere/plan.safetensors"):
        plan.save(tmp_path / "nowhere" / "plan.safetensors")
    first = (tmp_path / "plan.safetensors").read_bytes()
    back.save(tmp_path / "plan.safetensors")
    assert (tmp_path / "plan.safetensors").read_bytes() == first
    out, lse = sparsa.block_sparse(q, k, v, plan)
    out2, lse2 = sparsa.block_sparse(q, k, v, back)
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(lse, lse2)


def test_block_index_load_without_block_sizes_says_so(tmp_path):
    plan = sparsa.BlockIndex.full(1, 1, 64, 64, 32, 32)
    plan.save(tmp_path / "p.safetensors")
    raw = (tmp_path / "p.safetensors").read_bytes()
    # The same file with the metadata's keys renamed (same length, so the offsets stay valid).
    (tmp_path / "nometa.safetensors").write_bytes(raw.replace(b'"block_q"', b'"xlock_q"'))
    with pytest.raises(ValueError, match="block sizes unknown"):
        sparsa.BlockIndex.load(tmp_path / "nometa.safetensors")
    assert sparsa.BlockIndex.load(tmp_path / "nometa.safetensors", block_q=32, block_kv=32).block_q == 32


def test_block_index_repr_is_short():
    plan = sparsa.BlockIndex.full(1, 8, 4096, 4096, 64, 64)
    text = repr(plan)
    assert len(text) < 200, text
    assert "counts=int32[1, 8, 64]" in text and "indices=int32[1, 8, 64, 64]" in text and "perm_q=None" in text


def test_flash_attention_layout_as_a_view(rng):
    # [batch, seq, heads, dim] arrays pass as transposed views: no copy, the same result.
    q_bshd = rng.standard_normal((2, 50, 4, 16), dtype=np.float32)
    k_bshd = rng.standard_normal((2, 70, 2, 16), dtype=np.float32)
    v_bshd = rng.standard_normal((2, 70, 2, 16), dtype=np.float32)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q_bshd, k_bshd, v_bshd))
    assert not q.flags["C_CONTIGUOUS"]
    out, lse = sparsa.dense(q, k, v)
    ref_out, ref_lse = attention(q, k, v)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5)
    assert out.transpose(0, 2, 1, 3).shape == q_bshd.shape


@pytest.mark.parametrize("layout", ["z_order", "hilbert"])
def test_token_permutation_makes_blocks_square_patches(layout):
    perm = sparsa.token_permutation(8, 8, layout)
    assert perm.dtype == np.int32 and sorted(perm.tolist()) == list(range(64))
    rows, cols = perm // 8, perm % 8
    for b in range(4):  # each aligned group of 16 is a 4 x 4 square
        r, c = rows[16 * b:16 * b + 16], cols[16 * b:16 * b + 16]
        assert r.max() - r.min() == 3 and c.max() - c.min() == 3
    inv = sparsa.inverse_permutation(perm)
    np.testing.assert_array_equal(perm[inv], np.arange(64))
    x = np.arange(64, dtype=np.float32).reshape(1, 1, 64, 1) * np.ones((1, 1, 1, 16), np.float32)
    np.testing.assert_array_equal(x[:, :, perm][:, :, inv], x)


def test_token_permutation_errors_name_the_argument():
    with pytest.raises(ValueError, match="layout"):
        sparsa.token_permutation(4, 4, "snake")
    with pytest.raises(ValueError, match="perm"):
        sparsa.inverse_permutation(np.array([0, 0, 1]))


def test_backend_status_says_why():
    for name in ("cpu", "cpu_ref"):
        assert sparsa.backend_status(name) == ""
    why = sparsa.backend_status("cuda")
    assert (why == "") == ("cuda" in sparsa.backends())
    if why:
        assert ("not compiled into this build" in why) or ("no CUDA device is visible" in why)
    with pytest.raises(ValueError, match="backend"):
        sparsa.backend_status("tpu")


def test_paged_kv_cache_has_a_docstring():
    assert "page" in (sparsa.PagedKVCache.__doc__ or "")


def test_unsupported_dtype_lists_attention_dtypes_apart_from_plan_dtypes(rng):
    q = rng.standard_normal((1, 2, 8, 16)).astype(np.float64)
    with pytest.raises(TypeError) as e:
        sparsa.dense(q, q, q)
    assert "attention tensors: float32, float16 or bfloat16" in str(e.value)


def test_sparsa_torch_without_torch_says_how_to_get_it(tmp_path):
    # A torch that cannot be imported (a module that raises ModuleNotFoundError for it).
    (tmp_path / "torch.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    code = "import sparsa.torch"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       env={**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}"})
    assert r.returncode != 0
    assert "sparsa[torch]" in r.stderr and "pip install torch" in r.stderr
