"""An independent numpy attention (f64), the oracle of the Python tests."""
import numpy as np


def attention(q, k, v, scale=None, mask=None):
    """q [b,hq,lq,d], k/v [b,hkv,lk,d]; mask [b,hq,lq,lk] bool (True = visible) or None."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * np.einsum("bhid,bhjd->bhij", q, k)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = (m + np.log(denom))[..., 0]
        o = np.where(denom > 0, np.einsum("bhij,bhjd->bhid", p, v) / np.where(denom > 0, denom, 1), 0.0)
    return o, lse


def rand(rng, *shape, dtype=np.float32):
    """Standard normal values of `shape` from the numpy Generator rng, in `dtype`."""
    return rng.standard_normal(shape).astype(dtype)


def rel_err(a, b):
    """max |a - b| / max |b| in f64 (the Python tests' error measure)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
