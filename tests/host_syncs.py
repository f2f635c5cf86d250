"""Counting host-device synchronisations on a CPU (tests/test_host_syncs.py, docs/gpu.md).

On a GPU the host waits for the device whenever it reads a device tensor's value (``.item()``,
``.tolist()``, ``.cpu()``, ``int(t)``, ``bool(t)`` in an ``if``...), and a copy of pageable host
data to the device (``torch.tensor(list, device=...)``, ``.to(device)``, a tensor indexed with a
Python list) waits for the copy. On a CPU none of these costs anything, so no timing can show
them; but the calls are the same on both, and a ``TorchFunctionMode`` sees every one of them.

``HostSyncs`` counts them while a real rollout or update runs on the CPU, as they would be on a GPU.
Host and device are one here, so it tells them apart by where a tensor came from: the model's
parameters and buffers are on "the device", and so is everything computed from a device tensor,
copied to the device (``.to(device)``, ``torch.tensor(..., device=)``) or created there (a factory
given ``device=``); everything else (``torch.tensor(list)``, a ``.cpu()`` or ``.tolist()`` result,
a draw from a CPU generator) is on the host. Counted: reading a device tensor on the host, copying
host data to the device, and indexing a device tensor with a Python list (an implicit copy).
"""

from __future__ import annotations

import collections
import traceback
import weakref

import torch
from torch.overrides import TorchFunctionMode

TO_HOST = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _names_a_device(args, kwargs) -> bool:
    """Whether a ``.to(...)`` call names a device (not only a dtype)."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args)


def _python_index(index) -> bool:
    """A list in an index: torch copies it to the indexed tensor's device at every call."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) for p in parts)


class HostSyncs(TorchFunctionMode):
    """Counts the calls that synchronise host and device on a GPU, by kind and by the line of
    textrl (or transformers) that made them."""

    def __init__(self, *modules: torch.nn.Module):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.where: collections.Counter = collections.Counter()
        self._device: dict[int, weakref.ref] = {}  # tensors on "the device" (module docstring), by id
        for module in modules:
            self._mark([*module.parameters(), *module.buffers()])

    def _mark(self, tensors) -> None:
        for t in tensors:
            key = id(t)
            self._device[key] = weakref.ref(t, lambda _, key=key: self._device.pop(key, None))

    def _is_on_device(self, t: torch.Tensor) -> bool:
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # FlexAttention's kernel being traced (the batched layout): its
            return func(*args, **kwargs)  # ops run on the device, and dynamo cannot trace the bookkeeping
        name = getattr(func, "__name__", "")
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        from_device = any(self._is_on_device(t) for t in _tensors((args, kwargs)))
        kind, result_on_device = None, from_device
        if name in TO_HOST:
            kind, result_on_device = ("to_host" if source is not None and self._is_on_device(source) else None), False
        elif name in ("to", "cuda") and _names_a_device(args[1:], kwargs):
            if source is not None and not self._is_on_device(source):
                kind = "to_device"
            result_on_device = True
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            kind, result_on_device = "to_device", True
        elif kwargs.get("device") is not None:  # a factory that creates on the device
            result_on_device = True
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _python_index(args[1]) and from_device:
            kind = "list_index"
        if kind is not None:
            self.counts[kind] += 1
            self.where[f"{kind} {name} {_caller()}"] += 1
        result = func(*args, **kwargs)
        if name == "cpu" and result is source:  # a copy on a GPU: the host's own tensor from here on
            result = result.clone()
        if result_on_device:
            self._mark(_tensors(result))
        return result

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _caller() -> str:
    """The innermost frame outside torch and this file: the line that made the call."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("host_syncs.py"):
            return f"{frame.filename.split('site-packages/')[-1].split('/work/main/')[-1]}:{frame.lineno}"
    return "?"
