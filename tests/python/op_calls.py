"""OpCalls: a dispatch mode that records the dmattn ops a piece of code calls."""

from torch.utils._python_dispatch import TorchDispatchMode


class OpCalls(TorchDispatchMode):
    """Records the dmattn ops called and their arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "dmattn":
            self.calls.append((func.__name__.split(".")[0], args))
        return func(*args, **(kwargs or {}))

    def names(self):
        return [name for name, _ in self.calls]

    def args(self, name):
        return next(args for op, args in self.calls if op == name)
