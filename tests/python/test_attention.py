"""dmattn.attention against the float64 reference (SPEC §2-§5), forward and backward, every option."""

from dataclasses import dataclass, field
from typing import Optional, Tuple

import pytest
import torch

import dmattn
import reference

LOW_PRECISION = (torch.float16, torch.bfloat16)
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
RELATIVE_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


@dataclass
class Case:
    name: str
    B: int = 2
    sq: int = 16
    sk: int = 16
    H: int = 4
    Hk: int = 2
    D: int = 16
    mask_shape: Optional[Tuple[int, int, int, int]] = None  # -1 = the full size of that dim
    bias_shape: Optional[Tuple[int, int, int, int]] = None
    bias_float32: bool = False
    bias_expanded: bool = False  # pass the bias as a stride-0 view over (B, Hb, Sq, Sk)
    bias_constant: bool = False  # every bias value equal: top-k ties everywhere
    hf_layout: bool = False  # q, k, v as (B, S, H, D) views of (B, H, S, D) tensors
    options: dict = field(default_factory=dict)


CASES = [
    Case("plain", Hk=4),
    Case("gqa_causal", sq=13, sk=29, D=8, options=dict(causal=True)),
    Case("causal_sq_gt_sk", B=1, sq=20, sk=7, H=2, Hk=1, D=8, options=dict(causal=True)),
    Case("full_mask", sq=9, sk=11, D=8, mask_shape=(-1, -1, -1, -1)),
    Case("padding_mask_key_bias", sq=17, sk=17, D=8, mask_shape=(-1, 1, 1, -1), bias_shape=(-1, "Hk", 1, -1),
         options=dict(causal=True)),
    Case("full_bias_float32", sq=8, sk=12, H=2, Hk=2, D=8, bias_shape=(-1, -1, -1, -1), bias_float32=True),
    Case("shared_bias", B=2, sq=6, sk=10, D=8, bias_shape=(1, 1, -1, -1), mask_shape=(1, "Hk", 1, -1)),
    Case("softcap_scale", sq=10, sk=14, D=8, bias_shape=(-1, "Hk", 1, -1), options=dict(softcap=5.0, scale=0.3)),
    Case("window", sq=15, sk=15, D=8, options=dict(sliding_window=(3, 2))),
    Case("window_causal_bias", sq=12, sk=20, D=8, bias_shape=(-1, -1, 1, -1),
         options=dict(causal=True, sliding_window=(4, -1))),
    Case("topk_key_bias", sq=24, sk=24, D=8, bias_shape=(-1, "Hk", 1, -1),
         options=dict(causal=True, keep_window_size=5)),
    Case("topk_row_bias", sq=14, sk=18, D=8, bias_shape=(-1, "Hk", -1, -1),
         options=dict(causal=True, keep_window_size=4)),
    Case("topk_padding_gqa", sq=19, sk=19, H=6, Hk=3, D=8, mask_shape=(-1, 1, 1, -1), bias_shape=(-1, "Hk", 1, -1),
         options=dict(causal=True, keep_window_size=3)),
    Case("topk_window", sq=16, sk=16, D=8, bias_shape=(-1, "Hk", 1, -1),
         options=dict(causal=True, sliding_window=(6, 0), keep_window_size=3)),
    Case("topk_expanded_bias", sq=21, sk=21, D=8, bias_shape=(-1, "Hk", 1, -1), bias_expanded=True,
         options=dict(causal=True, keep_window_size=6)),
    Case("topk_ties", sq=12, sk=12, D=8, bias_shape=(-1, "Hk", 1, -1), bias_constant=True,
         options=dict(causal=True, keep_window_size=4)),
    Case("topk_no_causal_softcap", sq=8, sk=15, D=8, bias_shape=(-1, -1, 1, -1),
         options=dict(keep_window_size=7, softcap=3.0)),
    Case("decode", sq=1, sk=33, D=8, bias_shape=(-1, "Hk", 1, -1), options=dict(causal=True, keep_window_size=8)),
    Case("head_dim_1", B=1, sq=5, sk=6, H=1, Hk=1, D=1),
    Case("hf_layout", sq=11, sk=11, D=8, hf_layout=True, bias_shape=(-1, "Hk", 1, -1),
         options=dict(causal=True, keep_window_size=4, deterministic=True)),
]


def _sizes(case, spec):
    full = (case.B, case.H, case.sq, case.sk)
    return tuple(case.Hk if s == "Hk" else full[d] if s == -1 else s for d, s in enumerate(spec))


def make_inputs(case, dtype, device):
    def token_tensor(S, heads):
        if case.hf_layout:
            return torch.randn(case.B, heads, S, case.D, dtype=dtype, device=device).transpose(1, 2)
        return torch.randn(case.B, S, heads, case.D, dtype=dtype, device=device)

    q, k, v = token_tensor(case.sq, case.H), token_tensor(case.sk, case.Hk), token_tensor(case.sk, case.Hk)
    mask = bias = None
    if case.mask_shape is not None:
        mask = torch.rand(_sizes(case, case.mask_shape), device=device) < 0.7
    if case.bias_shape is not None:
        bias_dtype = torch.float32 if case.bias_float32 else dtype
        shape = _sizes(case, case.bias_shape)
        bias = (torch.full(shape, 0.5) if case.bias_constant else torch.randn(shape)).to(bias_dtype).to(device)
    return q, k, v, mask, bias


def max_error(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_matches(name, got, ref, naive, dtype):
    """SPEC §5: relative error for float32/float64; 2x the naive low-precision error for fp16/bf16."""
    assert not torch.isnan(got).any(), f"{name}: NaN"
    if dtype in RELATIVE_TOLERANCE:
        scale = max(ref.abs().max().item(), 1e-300) if ref.numel() else 1.0
        assert max_error(got, ref) <= RELATIVE_TOLERANCE[dtype] * scale, f"{name}: {max_error(got, ref)}"
    else:
        bound = 2 * max_error(naive, ref) + 1e-5
        assert max_error(got, ref) <= bound, f"{name}: {max_error(got, ref)} > {bound}"


def assert_lse_matches(lse, ref_lse, dtype):
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite.cpu()), "lse: -inf rows differ"
    assert (lse[~finite] == -float("inf")).all()
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert max_error(lse[finite], ref_lse[finite]) <= tolerance * max(1.0, ref_lse[finite].abs().max().item())


def run_reference(inputs, dout, dtype, options):
    q, k, v, bias = [None if t is None else t.detach().cpu().to(dtype).requires_grad_() for t in inputs[:3] + inputs[4:]]
    mask = None if inputs[3] is None else inputs[3].cpu()
    options = {name: value for name, value in options.items() if name != "deterministic"}
    out, lse = reference.attention(q, k, v, mask, bias, dtype=dtype, **options)
    out.backward(dout.cpu().to(dtype))
    return out, lse, [None if t is None else t.grad for t in (q, k, v, bias)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_backward_match_reference(case, dtype, device):
    if device == "cuda" and dtype not in LOW_PRECISION:
        pytest.skip("CUDA takes float16 and bfloat16 only (SPEC §1)")
    q, k, v, mask, bias = make_inputs(case, dtype, device)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    bias_leaf = bias.requires_grad_() if bias is not None else None
    if bias is not None and case.bias_expanded:
        bias = bias_leaf.expand(case.B, bias.shape[1], case.sq, case.sk)

    out, lse = dmattn.attention(q, k, v, mask, bias, return_lse=True, **case.options)
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = [t.grad for t in leaves] + [None if bias_leaf is None else bias_leaf.grad]

    ref_out, ref_lse, ref_grads = run_reference((q, k, v, mask, bias_leaf), dout, torch.float64, case.options)
    naive_out, _, naive_grads = run_reference((q, k, v, mask, bias_leaf), dout, dtype, case.options)
    assert out.shape == q.shape and lse.shape == (case.B, case.H, case.sq)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_matches("out", out.cpu(), ref_out, naive_out, dtype)
    assert_lse_matches(lse.cpu(), ref_lse, dtype)
    for name, got, ref, naive in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, naive_grads):
        if ref is None:
            assert got is None
            continue
        assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
        # A float32 bias of float64 inputs has a float32 gradient.
        assert_matches(name, got.cpu(), ref, naive.to(got.dtype), dtype if dtype in LOW_PRECISION else got.dtype)


@pytest.mark.parametrize("shape", [(0, 5, 7), (2, 0, 7), (2, 5, 0)], ids=["B0", "Sq0", "Sk0"])
def test_empty_inputs(shape, device):
    B, sq, sk = shape
    dtype = torch.float16 if device == "cuda" else torch.float64
    q = torch.randn(B, sq, 2, 8, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(B, sk, 2, 8, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(B, sk, 2, 8, dtype=dtype, device=device, requires_grad=True)
    bias = torch.randn(B, 2, 1, sk, dtype=dtype, device=device, requires_grad=True)
    out, lse = dmattn.attention(q, k, v, None, bias, causal=True, keep_window_size=3, return_lse=True)
    assert out.shape == q.shape and lse.shape == (B, 2, sq)
    out.sum().backward()
    assert not any(torch.isnan(t.grad).any() for t in (q, k, v, bias))
    if sq and B:
        assert (out == 0).all() and (lse == -float("inf")).all()


def test_default_options_are_plain_softmax_attention():
    q, k, v = (torch.randn(2, 6, 3, 8, dtype=torch.float64) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(dmattn.attention(q, k, v), expected, rtol=1e-12, atol=1e-12)


def test_bias_gradient_keeps_the_bias_shape():
    """A key-only bias gets a key-only gradient; through an expanded view of it, the same gradient."""
    q = torch.randn(2, 9, 4, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 9, 2, 8, dtype=torch.float64) for _ in range(2))
    small = torch.randn(2, 2, 1, 9, dtype=torch.float64, requires_grad=True)
    dmattn.attention(q, k, v, None, small, causal=True, keep_window_size=3).square().sum().backward()
    expanded_leaf = small.detach().clone().requires_grad_()
    expanded = expanded_leaf.expand(2, 2, 9, 9)
    expanded.retain_grad()
    dmattn.attention(q, k, v, None, expanded, causal=True, keep_window_size=3).square().sum().backward()
    assert small.grad.shape == (2, 2, 1, 9)
    assert expanded.grad.shape == (2, 2, 9, 9)
    torch.testing.assert_close(expanded_leaf.grad, small.grad, rtol=1e-12, atol=1e-12)
