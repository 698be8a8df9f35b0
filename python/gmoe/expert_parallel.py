"""Expert parallelism (gmoe/expert_parallel.h): the experts of a layer spread over the ranks of a
group, each token row sent to the rank that holds its expert (dispatch) and back (combine), with the
counts only on the device.

Rank r of a group of R holds the global experts [r·El, (r+1)·El), El = E / R. Making and closing a
group and every op are COLLECTIVE: all ranks call them in the same order. Nothing reads counts on
the host, so a pass with them never synchronises and can be captured in a CUDA graph (buffers are
sized from the group's host-known bounds, ``max_rows`` and ``recv_capacity``).

Layouts (the header's): the source layout of a rank is its permuted rows [max_rows, H] grouped by
global expert (its counts int32 [E]); the receive layout [recv_capacity, H] is grouped by local
expert, within an expert by source rank, within a source in source order. Rows past a layout's
valid total are zeros.

    group = gmoe.EpGroup.from_process_group(pg, num_experts=E, hidden=H, max_rows=T * k)
    plan = gmoe.ep_plan(group, counts)                       # counts int32 [E] of the source layout
    recv = gmoe.ep_dispatch(group, plan, rows, probs)        # EpRows: rows [recv_capacity, H], scalars
    back = gmoe.ep_combine(group, plan, expert_out)          # EpRows: rows [max_rows, H]

:func:`ep_dispatch` and :func:`ep_combine` are differentiable (each one's backward is the other,
with the same plan).

Checkpoints across EP sizes: each rank's ``MoELayer.state_dict()`` holds its El experts;
:func:`merge_ep_state_dicts` makes the state dict of all E experts from the ranks' (what an EP = 1
layer saves), and an expert-parallel ``MoELayer`` loads such a state dict as its rank's slice. So EP
= 2 saves load at EP = 1 (merged), EP = 1 saves at EP = 2, and EP = a at EP = b (merged, then
sliced).
"""
import re
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

_ops = torch.ops.gmoe

class EpPlan(NamedTuple):
    """The counts of one exchange, from every rank (gmoe::EpPlan); a forward's plan serves its
    backward."""
    counts_all: Tensor    #: int32 [R, E]: row s = rank s's rows per global expert (source layout)
    local_counts: Tensor  #: int32 [El]: the rows this rank's experts receive (the receive layout's counts)


class EpRows(NamedTuple):
    """What :func:`ep_dispatch` and :func:`ep_combine` return."""
    rows: Tensor               #: the moved rows
    scalars: Optional[Tensor]  #: float32, row for row (None when none were given)


class EpGroup:
    """This rank's membership of an expert-parallel group (gmoe::EpGroup).

    Made by :meth:`from_process_group` (NCCL, one process per GPU: torch.distributed's group gives
    the ranks and carries NCCL's unique id at construction) or :meth:`local` (the CPU backend: R
    ranks in one process, each rank's ops called from its own thread). The group keeps its
    communication state (on NCCL: the communicator and a symmetric window of
    ``recv_capacity`` rows) until :meth:`close`, which is collective on NCCL: every rank closes it at
    the same point (a group never closed lives until the process exits).

    Properties: ``rank``, ``size``, ``device``, ``num_experts`` (E), ``hidden`` (H), ``dtype`` (of
    the rows), ``max_rows`` (the rows of a rank's source layout), ``recv_capacity`` (the rows of
    its receive layout), ``local_experts`` (El = E / size).
    """

    def __init__(self, handle: int):
        self._handle = handle
        info = _ops.ep_group_info(handle)
        (self.rank, self.size, dev_type, dev_index, self.num_experts, self.hidden, dtype, self.max_rows,
         self.recv_capacity, self.local_experts) = info
        self.device = torch.device("cuda", dev_index) if dev_type == 1 else torch.device("cpu")
        self.dtype = _scalar_type(dtype)

    @property
    def handle(self) -> int:
        """The extension's handle of the group (what the ``torch.ops.gmoe.ep_*`` ops take)."""
        if self._handle is None:
            raise ValueError("EpGroup: the group is closed")
        return self._handle

    @classmethod
    def from_process_group(cls, group=None, *, num_experts: int, hidden: int, max_rows: int,
                           max_recv_rows: int = 0, dtype: torch.dtype = torch.bfloat16,
                           device: Union[None, str, torch.device] = None) -> "EpGroup":
        """This rank's NCCL group over the ranks of torch.distributed's ``group`` (None: the default
        group), on CUDA ``device`` (default: the current CUDA device). Collective: every rank of
        ``group`` calls it with the same options. The group's rank 0 makes NCCL's unique id and
        torch.distributed broadcasts it (a setup-time exchange, never on the hot path).

        ``max_rows`` bounds the rows of a rank's source layout (a layer's permuted rows);
        ``max_recv_rows`` the receive capacity (0: size · max_rows, which never drops a row)."""
        import torch.distributed as dist
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if dev.type != "cuda":
            raise ValueError(f"device: expected a CUDA device (the NCCL backend), got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        box = [bytes(_ops.ep_unique_id().tolist()) if rank == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(box, src=src, group=group, device=dev)
        uid = torch.tensor(list(box[0]), dtype=torch.uint8)
        return cls(_ops.ep_group_nccl(uid, rank, size, dev, num_experts, hidden, dtype, max_rows, max_recv_rows))

    @classmethod
    def local(cls, size: int, *, num_experts: int, hidden: int, max_rows: int, max_recv_rows: int = 0,
              dtype: torch.dtype = torch.bfloat16) -> List["EpGroup"]:
        """``size`` ranks in this process on the CPU backend (element i is rank i); each rank's ops
        must be called from its own thread (the ops join the ranks and release the GIL)."""
        return [cls(h) for h in _ops.ep_group_local(size, num_experts, hidden, dtype, max_rows, max_recv_rows)]

    def close(self) -> None:
        """Frees the group (collective on NCCL). Idempotent."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            _ops.ep_group_destroy(handle)

    def __repr__(self) -> str:
        return (f"EpGroup(rank={self.rank}, size={self.size}, device={self.device}, num_experts={self.num_experts}, "
                f"hidden={self.hidden}, dtype={self.dtype}, max_rows={self.max_rows}, "
                f"recv_capacity={self.recv_capacity}{', closed' if self._handle is None else ''})")


# c10::ScalarType's numbering of the dtypes a group can move (ep_group_info reports the group's so;
# the numbering is stable: TorchScript and checkpoints serialise it).
_SCALAR_TYPES = {0: torch.uint8, 3: torch.int32, 5: torch.float16, 6: torch.float32, 15: torch.bfloat16,
                 24: torch.float8_e4m3fn}


def _scalar_type(code: int) -> torch.dtype:
    if code not in _SCALAR_TYPES:
        raise ValueError(f"EpGroup: unknown dtype code {code}")
    return _SCALAR_TYPES[code]


def ep_plan(group: EpGroup, counts: Tensor) -> EpPlan:
    """Collective: every rank's ``counts`` (int32 [E] on the group's device: the rows per global
    expert of its source layout, the padded counts if the permute padded), gathered."""
    counts_all, local_counts = _ops.ep_plan(group.handle, counts)
    return EpPlan(counts_all, local_counts)


def ep_dispatch(group: EpGroup, plan: EpPlan, rows: Tensor, scalars: Optional[Tensor] = None) -> EpRows:
    """Collective: source layout ``rows`` [max_rows, H] -> the receive layout [recv_capacity, H];
    ``scalars`` (None, or float32 [max_rows]: the rows' router probabilities) move with them.
    Differentiable in rows and scalars (the backward is :func:`ep_combine` of the gradients)."""
    out, out_scalars = _ops.ep_dispatch(group.handle, plan.counts_all, plan.local_counts, rows, scalars)
    return EpRows(out, out_scalars if scalars is not None else None)


def ep_combine(group: EpGroup, plan: EpPlan, rows: Tensor, scalars: Optional[Tensor] = None) -> EpRows:
    """Collective: the exact reverse of :func:`ep_dispatch`: receive layout ``rows`` [recv_capacity,
    H] back to the ranks they came from, [max_rows, H] in each source's layout; ``scalars`` (None or
    float32 [recv_capacity]) likewise. Differentiable (the backward is :func:`ep_dispatch`)."""
    out, out_scalars = _ops.ep_combine(group.handle, plan.counts_all, plan.local_counts, rows, scalars)
    return EpRows(out, out_scalars if scalars is not None else None)


# The routed experts' parameters in a MoELayer's state dict: experts.fc1 / fc2, stacked (weight,
# bias) or per-expert (weight<e>, bias<e>); the shared experts' are not expert-parallel.
_EXPERT_KEY = re.compile(r"^(?P<base>(?:.*\.)?experts\.fc[12]\.(?:weight|bias))(?P<index>\d*)$")


def merge_ep_state_dicts(state_dicts: Sequence[Mapping[str, Tensor]]) -> Dict[str, Tensor]:
    """The state dict of all E routed experts from the state dicts of ranks 0..R-1 of expert-parallel
    MoELayers (rank r holding experts [r·El, (r+1)·El)), as an EP = 1 layer would save it: stacked
    expert tensors concatenated along the expert dimension, per-expert keys renumbered with global
    indices. Every other entry (router, shared experts, buffers) must be equal on all ranks (it is
    replicated) and is taken once; a difference raises ValueError naming the key."""
    if not state_dicts:
        raise ValueError("merge_ep_state_dicts: expected the state dicts of ranks 0..R-1, got none")
    keys = list(state_dicts[0].keys())
    for r, sd in enumerate(state_dicts[1:], 1):
        if set(sd.keys()) != set(keys):
            raise ValueError(f"merge_ep_state_dicts: rank {r}'s keys differ from rank 0's: "
                             f"{sorted(set(sd.keys()) ^ set(keys))[:4]}")
    merged: Dict[str, Tensor] = {}
    per_expert: Dict[str, List[str]] = {}
    for key in keys:
        m = _EXPERT_KEY.match(key)
        if m is None:
            ref = state_dicts[0][key]
            for r, sd in enumerate(state_dicts[1:], 1):
                same = torch.equal(sd[key], ref) if isinstance(ref, Tensor) else sd[key] == ref
                if not same:
                    raise ValueError(f"merge_ep_state_dicts: {key} differs between rank 0 and rank {r} (it is "
                                     "replicated, not expert-parallel)")
            merged[key] = ref
        elif m.group("index"):
            per_expert.setdefault(m.group("base"), []).append(key)
        else:
            merged[key] = torch.cat([sd[key] for sd in state_dicts])
    for base, local_keys in per_expert.items():
        local_keys.sort(key=lambda k: int(k[len(base):]))
        El = len(local_keys)
        for r, sd in enumerate(state_dicts):
            for e, k in enumerate(local_keys):
                merged[f"{base}{r * El + e}"] = sd[k]
    return merged
