"""dmattn: trainable dynamic-mask sparse attention.

`dmattn._C` is the C++ core over DLPack arrays and needs nothing else. With
PyTorch installed, `attention` and `varlen_attention` are the native functions
(torch.library ops with autograd and torch.compile support), and
`dmattn.flash_dmattn_compat` holds the flash-dmattn compatible functions.
`dmattn.integrations.transformers` registers dmattn with Hugging Face
transformers and adapts Doge models.
"""

from importlib.util import find_spec

from ._C import build_info

__version__ = build_info()["version"]
__all__ = ["build_info", "__version__"]

if find_spec("torch") is not None:
    import warnings

    import torch

    from .ops import attention, varlen_attention

    __all__ += ["attention", "varlen_attention"]
    if not build_info()["cuda"] and torch.cuda.is_available():
        warnings.warn(
            "dmattn was built without its CUDA backend (no nvcc, or DMATTN_CUDA=OFF, at install time), but a CUDA "
            "GPU is present: CUDA tensors will be refused. Reinstall with nvcc on the PATH (DMATTN_CUDA=ON makes a "
            "missing toolchain an install error).",
            RuntimeWarning,
            stacklevel=2,
        )
