"""The tensor memory a piece of code keeps alive, measured on the CPU.

`LiveMemory` is a TorchDispatchMode: every storage that an op creates while it is
active (op outputs other than views of its inputs, `torch.empty` buffers, autograd's
gradients) counts from its creation until the storage is freed. `peak` is the largest sum of live bytes and
`at_peak` what made it up. This models `torch.cuda.max_memory_allocated` of the same
code on a GPU, which also counts a block from allocation until the Python/C++
references drop (a block freed while another stream still uses it counts as freed),
without the allocator's rounding. Not seen: storages created before the mode (the
caller's inputs), allocations inside a custom op's kernel (on CUDA, dmattn's
cudaMallocAsync scratch) and a communication backend's own buffers.
"""

import weakref
from typing import Dict, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveMemory(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: Dict[int, Tuple[int, str]] = {}  # data_ptr -> (bytes, what)
        self.now = self.peak = 0
        self.at_peak: List[Tuple[int, str]] = []

    def _created(self, t: torch.Tensor, op):
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self.live:
            return
        self.live[key] = (size, f"{op.__name__} -> {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}")
        weakref.finalize(storage, self._freed, key)
        self.now += size
        if self.now > self.peak:
            self.peak, self.at_peak = self.now, sorted(self.live.values(), reverse=True)

    def _freed(self, key: int):
        self.now -= self.live.pop(key)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self._created(t, func)
        return out
