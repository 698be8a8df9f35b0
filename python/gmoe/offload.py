"""Offloading of the gmoe modules' saved activations to host memory (issue 42, the PyTorch side of
``gmoe/offload.h``).

``with gmoe.offload_activations(model): loss = model(x)`` moves every tensor that autograd saves
inside a gmoe module's forward (GroupedLinear, GroupedMLP, MoELayer: the inputs kept for the weight
gradient, FP8 copies and scales, the MLP's intermediates, probabilities, the routing map) to host
memory as soon as it is saved, and brings it back when backward unpacks it. The modules' parameters
and ``main_grad`` are never moved; tensors saved outside gmoe modules are left alone.

How: :func:`torch.autograd.graph.saved_tensors_hooks` for the forward, switched on only while a
gmoe module's forward runs (forward pre/post hooks on the model's gmoe modules). Because the innermost
saved-tensor hooks win, regions under ``torch.utils.checkpoint`` keep their own behaviour (nothing
saved, recomputed in backward), and the rest of the gmoe modules are offloaded: the two compose.

On CUDA the copy to the host runs on a side stream after the current stream's work so far (the
device memory is handed back to PyTorch's caching allocator with ``record_stream``, so it is reused
only once the copy is done), into pinned memory from PyTorch's caching host allocator (reused from
step to step: no ``cudaHostAlloc`` per step); the copy back is asynchronous on the current stream,
ordered after the copy out by an event. Nothing synchronises the host. On the CPU an offload is a
host copy, so the logic is exercised everywhere.

Per module: ``module.offload_activations = False`` opts one module out; ``keep_last=True`` (the
default) keeps the last gmoe module of the model (in forward order) on the device, whose backward
comes first.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import List, Optional

import torch
from torch import Tensor, nn

__all__ = ["offload_activations", "OffloadStats"]


@dataclasses.dataclass
class OffloadStats:
    """What one ``offload_activations`` region moved."""

    tensors_offloaded: int = 0  #: saved tensors moved to the host
    bytes_offloaded: int = 0  #: their bytes
    tensors_kept: int = 0  #: saved tensors left on the device inside gmoe modules (parameters, opted out, last)
    tensors_reloaded: int = 0  #: offloaded tensors brought back by backward


def _gmoe_module_types():
    from .modules import GroupedLinear, GroupedMLP
    from .moe_layer import MoELayer
    return (GroupedLinear, GroupedMLP, MoELayer)


def _top_level_gmoe_modules(model: nn.Module) -> List[nn.Module]:
    """gmoe modules of ``model`` (itself included) with no gmoe module above them, in definition order."""
    types = _gmoe_module_types()
    found: List[nn.Module] = []

    def walk(m: nn.Module) -> None:
        if isinstance(m, types):
            found.append(m)
            return
        for child in m.children():
            walk(child)

    walk(model)
    return found


class _Offloaded:
    """A saved tensor while it lives on the host."""

    __slots__ = ("host", "device", "event")

    def __init__(self, host: Tensor, device: torch.device, event: Optional[torch.cuda.Event]):
        self.host, self.device, self.event = host, device, event


class offload_activations(contextlib.AbstractContextManager):
    """Offloads the saved activations of ``model``'s gmoe modules during the forward run inside it.

    Args:
        model: the model (or one gmoe module).
        keep_last: keep the last gmoe module's activations on the device (see the module docstring).
        copy_stream: the CUDA stream of the copies to the host (default: one made for this object).

    ``stats`` (:class:`OffloadStats`) counts what was moved. Backward may run after the ``with``
    block (it must: the forward is what runs inside).
    """

    def __init__(self, model: nn.Module, keep_last: bool = True, copy_stream: Optional["torch.cuda.Stream"] = None):
        self.model = model
        self.keep_last = keep_last
        self.stats = OffloadStats()
        self._copy_stream = copy_stream
        self._modules = _top_level_gmoe_modules(model)
        self._order: List[int] = []  # indices into _modules in the order their forwards ran
        self._active: Optional[nn.Module] = None
        self._handles = []
        self._param_storages = set()
        self._hooks = None

    # -- which tensors move ---------------------------------------------------------------------
    def _offloads_module(self, m: nn.Module) -> bool:
        if not getattr(m, "offload_activations", True):
            return False
        if self.keep_last:
            eligible = [x for x in self._modules if getattr(x, "offload_activations", True)]
            if eligible and m is eligible[-1]:
                return False
        return True

    def _should_offload(self, t: Tensor) -> bool:
        if self._active is None:
            return False
        if isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in self._param_storages:
            self.stats.tensors_kept += 1
            return False
        if not self._offloads_module(self._active):
            self.stats.tensors_kept += 1
            return False
        return True

    # -- the saved-tensor hooks -----------------------------------------------------------------
    def _pack(self, t: Tensor):
        if not self._should_offload(t):
            return t
        self.stats.tensors_offloaded += 1
        self.stats.bytes_offloaded += t.numel() * t.element_size()
        if t.device.type != "cuda":
            return _Offloaded(t.detach().clone(memory_format=torch.contiguous_format), t.device, None)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=t.device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        # The caching allocator reuses t's memory only after the copy stream's work so far.
        t.record_stream(stream)
        return _Offloaded(host, t.device, event)

    def _unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        self.stats.tensors_reloaded += 1
        if packed.event is None:
            return packed.host.to(packed.device)
        torch.cuda.current_stream(packed.device).wait_event(packed.event)
        return packed.host.to(packed.device, non_blocking=True)

    # -- module hooks: the saved-tensor hooks act only inside a gmoe module's forward -------------
    def _pre(self, module, args):
        if self._active is None:
            self._active = module

    def _post(self, module, args, output):
        if self._active is module:
            self._active = None

    def __enter__(self):
        self._param_storages = {p.untyped_storage().data_ptr() for m in self._modules for p in m.parameters()}
        for m in self._modules:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._active = None
        return False
