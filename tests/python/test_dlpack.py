"""dmattn._C over DLPack arrays without torch's ops: NumPy in, NumPy out, zero copy."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import dmattn
import reference
from dmattn import _C


def test_numpy_forward_backward_in_place():
    rng = np.random.default_rng(0)
    B, S, H, Hk, D = 2, 9, 4, 2, 8
    # q as a strided view: (B, H, S, D) memory read as (B, S, H, D).
    q = rng.standard_normal((B, H, S, D)).transpose(0, 2, 1, 3)
    k, v = rng.standard_normal((B, S, Hk, D)), rng.standard_normal((B, S, Hk, D))
    bias = rng.standard_normal((B, Hk, 1, S))
    mask = rng.random((B, 1, 1, S)) < 0.8
    for a in (q, k, v, bias, mask):
        a.flags.writeable = False  # inputs may be read-only
    out, lse = np.full((B, S, H, D), np.nan), np.full((B, H, S), np.nan)
    options = dict(causal=True, keep_window_size=3)
    _C.forward(q, k, v, mask, bias, out, lse, **options)

    ref_out, ref_lse = reference.attention(*(torch.tensor(a) for a in (q, k, v, mask, bias)), **options)
    np.testing.assert_allclose(out, ref_out.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse.numpy(), rtol=1e-12, atol=1e-12)

    dout = rng.standard_normal(out.shape)
    dq, dk, dv, dbias = (np.full(a.shape, np.nan) for a in (q, k, v, bias))
    _C.backward(q, k, v, mask, bias, out, dout, lse, dq, dk, dv, dbias, **options)
    torch_bias = torch.tensor(bias, requires_grad=True)
    ref_out, _ = reference.attention(*(torch.tensor(a) for a in (q, k, v, mask)), torch_bias, **options)
    ref_out.backward(torch.tensor(dout))
    np.testing.assert_allclose(dbias, torch_bias.grad.numpy(), rtol=1e-10, atol=1e-12)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()


def test_outputs_are_written_in_place_zero_copy():
    """The torch output's memory is what the core wrote: nothing was copied on the way."""
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    out = torch.full_like(q, float("nan"))
    pointer = out.data_ptr()
    _C.forward(q, q, q, None, None, out, None)
    assert out.data_ptr() == pointer and torch.isfinite(out).all()


def test_read_only_output_is_refused():
    q = np.ones((1, 2, 1, 4))
    out = np.zeros_like(q)
    out.flags.writeable = False
    with pytest.raises(TypeError):
        _C.forward(q, q, q, None, None, out, None)


def test_unsupported_dlpack_dtype_is_named():
    q = np.ones((1, 2, 1, 4), dtype=np.complex64)
    with pytest.raises(TypeError, match="dmattn: q.dtype: expected a dtype dmattn takes .*, got complex64"):
        _C.forward(q, q, q, None, None, np.zeros((1, 2, 1, 4)), None)


def test_build_info():
    info = dmattn.build_info()
    assert info["version"] == dmattn.__version__
    assert isinstance(info["cuda"], bool)


def test_extension_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; import numpy as np, dmattn; "
            "q = np.ones((1, 3, 1, 4)); out = np.zeros_like(q); "
            "dmattn._C.forward(q, q, q, None, None, out, None); "
            "assert not hasattr(dmattn, 'attention') and np.allclose(out, 1.0)")
    subprocess.run([sys.executable, "-c", code], check=True)
