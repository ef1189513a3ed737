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
    from .ops import attention, varlen_attention

    __all__ += ["attention", "varlen_attention"]
