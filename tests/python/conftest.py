"""Shared fixtures: the devices to run on, and how a CUDA path that is not built yet is reported.

Tests that take the `device` fixture run on the CPU and, when torch sees a GPU,
on CUDA. The core refuses what CUDA does not run yet with NotImplementedError:
everything while the CUDA kernels are not built, and with them the top-k keep
window and head dims that are not multiples of 8. CUDA tests are marked xfail
for that exception only (the reason names what is missing): any other failure
still fails, and tests of the parts that exist pass.
"""

import pytest
import torch

import dmattn


def _cuda_not_built_reason():
    """The core's message if a CUDA call is refused as not built, else None."""
    if not torch.cuda.is_available():
        return None
    q = torch.randn(1, 1, 1, 8, device="cuda", dtype=torch.float16, requires_grad=True)
    try:
        dmattn.attention(q, q, q).sum().backward()
    except NotImplementedError as e:
        return str(e)
    return None


CUDA_NOT_BUILT = _cuda_not_built_reason()
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


CUDA_PARTIAL = "CUDA refuses the top-k keep window and head dims that are not multiples of 8 (not built yet)"


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        return
    mark = pytest.mark.xfail(raises=NotImplementedError, strict=False, reason=CUDA_NOT_BUILT or CUDA_PARTIAL)
    for item in items:
        callspec = getattr(item, "callspec", None)
        if (callspec is not None and callspec.params.get("device") == "cuda") or item.get_closest_marker("cuda"):
            item.add_marker(mark)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: the test runs on CUDA only (skipped without a GPU)")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
