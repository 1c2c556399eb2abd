"""Whether a region a CUDA graph captures reads a tensor back to the host, checked on any machine.

A capture records kernels; it cannot run a host read (`item()`, `bool(tensor)`, `tolist()`, an op whose
output shape depends on the data, `equal`): CUDA refuses the copy or the sync while the stream is
capturing, the capture fails, and the part stays eager. Nor may it copy a host tensor it made to the
device (from pageable memory CUDA refuses it; from pinned memory a replay copies whatever that memory
holds by then), which the guard refuses too where it sees one (`tensor.to(device)`, `copy_`; a literal
`torch.tensor(data, device=...)` is made below the dispatcher and is not seen). Some reads hide inside
ATen's composite ops where a dispatch mode cannot see them (`torch.istft` checks its window envelope with
`at::equal` inside its C++ body), so counting ops on a CPU (`bench.engine.syncs`) misses them. This
guard runs the region on the `meta` device instead, where tensors have shapes and no data: any read of a
value fails there whatever dispatches it, and the ops a dispatch mode does see are named.

    without_data(fn, *args, **kwargs) -> fn's result (meta tensors)
        fn (a module, a module's method, or a function) on meta copies of itself and its arguments: their
        tensors, modules and the project's objects holding tensors (lanes); HostRead if anything in it
        needs a tensor's value
    to_meta(value) -> the copy `without_data` passes on

An op with no meta kernel at all also fails here (reported as such): nothing in the model's captured
regions is one. Not in here: timing, and what the graphs themselves compute (`gpu_worker.accel`'s tests).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# every op that hands a tensor's value to the host (is_nonzero: bool(tensor); equal: torch.equal)
READS = frozenset({aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default,
                   aten.equal.default, aten.nonzero.default, aten.masked_select.default,
                   aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
                   aten.repeat_interleave.Tensor})


class HostRead(RuntimeError):
    """A region that must not read a tensor back did."""


COPIES = frozenset({aten._to_copy, aten.to, aten.copy_})  # under inference mode `to` arrives whole


class _Refuse(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in READS or (func is aten.index.Tensor and _bool_index(args)):
            raise HostRead(f"{func} reads a tensor's value back to the host")
        out = func(*args, **kwargs)
        if func.overloadpacket in COPIES and _from_host(args, out):
            raise HostRead(f"{func} copies a host tensor made in the region to the device (a replay would "
                           "copy from memory that is gone)")
        return out


def _from_host(args: tuple, out: Any) -> bool:
    """A host tensor of more than one element copied to the device (a 0-d CPU tensor in an op is a kernel
    argument, not a copy)."""
    src = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else args[0]
    return (isinstance(src, torch.Tensor) and src.device.type == "cpu" and src.dim() > 0
            and isinstance(out, torch.Tensor) and out.device.type != "cpu")


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def to_meta(value: Any) -> Any:
    """Tensors -> meta tensors of the same shape, dtype and strides' layout; modules -> a meta copy;
    tuples, lists and dicts element by element; an object of this project (a `gpu_worker` class, such as
    `Lanes`) -> a shallow copy with its attributes converted; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, torch.nn.Module):
        return copy.deepcopy(value).to("meta")
    if isinstance(value, tuple):
        items = [to_meta(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [to_meta(v) for v in value]
    if isinstance(value, dict):
        return {k: to_meta(v) for k, v in value.items()}
    if type(value).__module__.startswith("gpu_worker.") and hasattr(value, "__dict__"):
        clone = copy.copy(value)
        for name, attr in vars(value).items():
            object.__setattr__(clone, name, to_meta(attr))
        return clone
    return value


def without_data(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) with no tensor data anywhere (module docstring); HostRead names the read."""
    owner = getattr(fn, "__self__", None)
    if isinstance(fn, torch.nn.Module):
        meta_fn = to_meta(fn)
    elif isinstance(owner, torch.nn.Module):  # a module's method: the same method of its meta copy
        meta_fn = getattr(to_meta(owner), fn.__name__)
    else:
        meta_fn = fn
    meta_args, meta_kwargs = to_meta(args), to_meta(kwargs)
    try:
        with _Refuse():
            return meta_fn(*meta_args, **meta_kwargs)
    except HostRead:
        raise
    except (RuntimeError, NotImplementedError) as exc:  # a value was asked of a meta tensor
        raise HostRead(f"needs a tensor's value (or an op without a meta kernel): {exc}") from exc
