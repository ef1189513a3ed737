"""The Python layer's one argument type check (`checked`), shared by every entry point."""

import numbers
import operator

import torch
from torch import Tensor

# What each argument type of `checked` takes besides its own instances (symbolic values from torch.compile,
# NumPy scalars), and its words.
_ARGUMENT_TYPES = {
    Tensor: ((Tensor,), "a torch.Tensor"),
    bool: ((bool, torch.SymBool), "a bool"),
    int: ((numbers.Integral, torch.SymInt), "an int"),
    float: ((numbers.Real, torch.SymFloat, torch.SymInt), "a float"),
}
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def checked(name: str, value, expected: type, optional: bool = False):
    """`value` as an argument `name` of type `expected` (Tensor, bool, int or float; None too if `optional`).

    The Python layer's one type check, used by every entry point (attention, varlen_attention, the
    flash-dmattn compatible functions and the transformers integration): a value of another type raises
    TypeError, an int outside int64 ValueError, in the core's format. Bools are not ints or floats here.
    Returns other integers as int and reals as float (symbolic values as they are).
    """
    if value is None and optional:
        return None
    if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
        types, words = _ARGUMENT_TYPES[expected]
        if not isinstance(value, types) or isinstance(value, bool):
            kind = type(value)
            kind = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
            raise TypeError(f"dmattn: {name}: expected {words}{' or None' if optional else ''}, got {kind}")
        if isinstance(value, _SYMBOLIC):
            return value
        value = float(value) if expected is float else operator.index(value)
    if expected is int and not -2 ** 63 <= value < 2 ** 63:
        raise ValueError(f"dmattn: {name}: expected an int in [-2^63, 2^63), got {value}")
    return value
