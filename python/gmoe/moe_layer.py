"""gmoe.MoELayer: the whole Mixture-of-Experts block as one module (gmoe/moe_layer.h in PyTorch).

    logits             = x · W_routerᵀ in float32                        (self.router)
    ids, probs, counts = router_topk(logits)                             (gmoe.router_topk)
    rows, m_splits, p  = permute(x, ids, probs)                          rows grouped by expert, p
                                                                         each row's probability
    y_rows             = experts(rows, m_splits, p)                      (self.experts, a GroupedMLP:
                                                                         z = act(h)·p)
    out[t]             = Σ_j y_rows[row(t, j)]  (+ shared_experts(x))    combine with weights 1

The probabilities scale the experts' activation, as in Megatron and Transformer Engine, rather
than the combine: a weighted combine keeps y_rows for the probabilities' gradient
<dout[t], y_rows[row]>, while inside the experts that gradient comes from what their backward has
anyway, and y_rows is not kept. Exact because FC2 is linear (FC2(p·z) = p·FC2(z)); with
``bias=True`` FC2 adds b2, and FC2(p·z) = p·W2·z + b2 is not the block's p·(W2·z + b2), so those
experts take the weighted combine (``out[t] = Σ_j probs[t, j] · y_rows[row(t, j)]``).

With an expert-parallel group (``ep_group``, :class:`gmoe.EpGroup` of R ranks) the layer holds only
this rank's El = E / R experts (global experts [rank·El, (rank+1)·El)): the router and the permute
run over all E experts on this rank's tokens, then

    plan               = ep_plan(group, counts)                          every rank's counts
    recv, recv_p       = ep_dispatch(group, plan, rows, p)               rows of this rank's experts,
                                                                         grouped by local expert
    y_recv             = experts(recv, plan.local_counts, recv_p)
    y_rows             = ep_combine(group, plan, y_recv)                 back to the rows' ranks

and the combine as above; backward runs the same exchanges in reverse with the same plan. Every
rank calls forward and backward at the same points (the exchanges are collective). A group of size
1 is the single-GPU path, bitwise.

With ``experts_wgrad_during_combine`` (and ``delay_wgrad_compute``) backward computes the experts'
delayed weight gradients itself, while the reverse of the dispatch (the combine of the experts'
input gradients back to the tokens' ranks) is in flight on a communication stream: Megatron's
``overlap_dispatch_backward_with_experts_wgrad``, gmoe::MoEBackwardOverlap's
``experts_wgrad_during_combine``. Only the streams differ: the gradients are bitwise those of the
plain backward. The dispatch's backward is the one exchange that can overlap them: the experts'
backward needs every row that the combine's backward (a dispatch) brings, and the weight gradients
need the experts' backward.

Every shape is host-known and the counts never leave the device, so a training step with the
layer never synchronises and can be captured in a CUDA graph once and replayed under any routing.
Autograd gives gradients to x, the router weight (through the probabilities and the losses), the
experts and the shared experts; the experts keep GroupedLinear's Megatron conventions (``main_grad``,
``delay_wgrad_compute`` with :meth:`MoELayer.backward_dw`, wgrad hooks, ``expert_mask`` with
``masked_off_wgrad``).
"""
from typing import Callable, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._autograd import EpDispatchWorkDuringCombine, WorkAfterBackward
from .expert_parallel import EpGroup, EpRows, ep_combine, ep_dispatch, ep_plan
from .modules import GroupedLinear, GroupedMLP
from .routing import SCORE_FUNCS, RoutingMap, combine, permute, router_aux_loss, router_topk, router_z_loss


class MoELayer(nn.Module):
    """Router → permute → :class:`GroupedMLP` → combine, with optional shared experts.

    Args:
        num_experts: E, the routed experts.
        hidden_size: H, the width of x and of the output.
        ffn_hidden_size: F, each expert's activation width.
        top_k: k, the experts per token (1..E).
        activation, bias, glu_layout, recipe, weight_layout, device, dtype: the experts'
            (:class:`GroupedMLP`; the shared experts use the same).
        score_func: ``"softmax"`` (Mixtral, Qwen) or ``"sigmoid"`` (DeepSeek-V3).
        normalize_topk: renormalise each token's k probabilities to sum 1.
        n_group, topk_group: group-limited routing (DeepSeek-V3): only the best ``topk_group`` of
            ``n_group`` equal expert groups are eligible.
        scaling_factor: multiplies the final probabilities (DeepSeek-V3's routed_scaling_factor).
        score_correction_bias: a float32 buffer ``score_correction_bias`` [E] (zeros) added to the
            scores for the selection only (DeepSeek-V3's auxiliary-loss-free balancing; it gets no
            gradient: the trainer updates it from :attr:`last_counts`).
        pad_multiple: each expert's rows padded to a multiple of this (16 or 128 for FP8 recipes).
        capacity_factor: > 0 drops each expert's tokens past ``ceil(capacity_factor·T·k/E)``.
        aux_loss_coeff, z_loss_coeff: coefficients of the load-balancing loss and the router
            z-loss (0: not computed).
        shared_expert_ffn_hidden_size: > 0 adds a dense MLP of this width, run on every token,
            whose output is added (DeepSeek, Qwen).
        masked_off_wgrad: the routed experts' (``"skip"`` or ``"fresh"``, with :attr:`expert_mask`;
            see :class:`GroupedLinear`).
        recompute_activation: the experts' and the shared experts' (:class:`GroupedMLP`): their
            activation output z = act(h)·p is not kept for backward but made again from h there,
            bitwise the same; saves k·F elements per token (and F per token for the shared experts).
        regather_expert_input: the permuted rows (the experts' input, k copies of each token) are
            not kept for backward: FC1's weight gradient gathers them again from x through the
            routing map (one more gather pass in backward), bitwise the same; saves k·H elements
            per token. Settable. No effect where FC1 keeps no rows: with an FP8 recipe (FC1 keeps
            its FP8 columnwise copy), with an EP group of size > 1 (the experts' rows are those
            other ranks sent, which this rank cannot gather from its own tokens) and inside
            torch.compile (the compiled graph decides what it saves). Inside
            :func:`gmoe.offload_activations` the tokens and the map it keeps are offloaded instead.
        ep_group: None, or the :class:`gmoe.EpGroup` the experts are spread over: its num_experts
            and hidden are the layer's, its dtype the layer's rows', its max_rows at least the
            permuted rows of a forward (``gmoe.permuted_rows(T, top_k, E, pad_multiple,
            capacity_factor)``; fewer are padded with zero rows). ``experts`` then holds the
            group's ``local_experts`` experts (``expert_mask`` is over them).
        experts_wgrad_during_combine: with ``delay_wgrad_compute`` (required), backward computes
            the experts' delayed weight gradients (GroupedMLP.backward_dw, their wgrad hooks
            included) on the current stream while the dispatch's reverse exchange runs on
            ``ep_comm_stream`` (CUDA; on the CPU backend: after it); without an EP group of size
            > 1, right after the experts' backward. :meth:`backward_dw` then computes only what
            is left (the shared experts'). Settable.

    ``ep_comm_stream`` (settable): the CUDA stream of that exchange (None: a stream of the layer's
    own, made on first use).

    ``expert_mask`` (settable; None or an int32 tensor [E] on the layer's device) selects which
    routed experts' weight gradients go to ``main_grad`` (see :class:`GroupedLinear`); the router
    and the shared experts are not masked.

    Submodules: ``router`` (``nn.Linear(H, E, bias=False)``; its logits are computed in float32),
    ``experts`` (:class:`GroupedMLP`), ``shared_experts`` (None, or a one-expert
    :class:`GroupedMLP` applied to all tokens: a dense MLP).

    After each forward: ``aux_loss`` is the sum of the scaled losses (a 0-d float32 tensor in the
    autograd graph, for the trainer to add to its loss; None when both coefficients are 0),
    ``last_counts`` the tokens routed to each expert (int32 [E] on the device, before any capacity
    drop) and ``last_dropped`` the (token, slot) pairs the capacity dropped (int32 [1] on the
    device). Reading them on the host is the caller's synchronisation.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, top_k: int, *,
                 activation: str = "swiglu", bias: bool = False, glu_layout: Union[str, int] = "concatenated",
                 score_func: str = "softmax", normalize_topk: bool = False, n_group: int = 1, topk_group: int = 1,
                 scaling_factor: float = 1.0, score_correction_bias: bool = False, pad_multiple: int = 1,
                 capacity_factor: float = 0.0, aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 shared_expert_ffn_hidden_size: int = 0, recipe: Optional[str] = None,
                 weight_layout: str = "stacked", masked_off_wgrad: str = "skip", recompute_activation: bool = False,
                 regather_expert_input: bool = True, ep_group: Optional[EpGroup] = None,
                 experts_wgrad_during_combine: bool = False,
                 device: Optional[Union[str, torch.device]] = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts: expected at least 1, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k: expected 1..num_experts = 1..{num_experts}, got {top_k}")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func: expected one of {SCORE_FUNCS}, got {score_func!r}")
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"n_group: must be >= 1 and divide num_experts = {num_experts}, got {n_group}")
        if n_group > 1 and not (1 <= topk_group <= n_group and topk_group * (num_experts // n_group) >= top_k):
            raise ValueError(f"topk_group: expected 1..n_group = 1..{n_group} with topk_group groups of "
                             f"{num_experts // n_group} experts holding top_k = {top_k}, got {topk_group}")
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple: expected >= 1, got {pad_multiple}")
        if not capacity_factor >= 0:
            raise ValueError(f"capacity_factor: expected >= 0 (0: no capacity), got {capacity_factor}")
        if shared_expert_ffn_hidden_size < 0:
            raise ValueError(f"shared_expert_ffn_hidden_size: expected >= 0 (0: none), got "
                             f"{shared_expert_ffn_hidden_size}")
        if ep_group is not None and (ep_group.num_experts != num_experts or ep_group.hidden != hidden_size):
            raise ValueError(f"ep_group: made for num_experts = {ep_group.num_experts}, hidden = {ep_group.hidden}; "
                             f"the layer has num_experts = {num_experts}, hidden_size = {hidden_size}")
        self.num_experts, self.hidden_size, self.ffn_hidden_size, self.top_k = \
            num_experts, hidden_size, ffn_hidden_size, top_k
        self.ep_group = ep_group
        self.experts_wgrad_during_combine = bool(experts_wgrad_during_combine)
        self.ep_comm_stream = None
        local_experts = ep_group.local_experts if ep_group is not None else num_experts
        self.score_func, self.normalize_topk = score_func, bool(normalize_topk)
        self.n_group, self.topk_group, self.scaling_factor = n_group, topk_group, float(scaling_factor)
        self.pad_multiple, self.capacity_factor = pad_multiple, float(capacity_factor)
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.regather_expert_input = bool(regather_expert_input)

        self.router = nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=dtype)
        mlp = dict(activation=activation, glu_layout=glu_layout, bias=bias, weight_layout=weight_layout,
                   recipe=recipe, recompute_activation=recompute_activation, device=device, dtype=dtype)
        self.experts = GroupedMLP(local_experts, hidden_size, ffn_hidden_size, masked_off_wgrad=masked_off_wgrad,
                                  **mlp)
        self.shared_experts = GroupedMLP(1, hidden_size, shared_expert_ffn_hidden_size, **mlp) \
            if shared_expert_ffn_hidden_size > 0 else None
        bias_buffer = torch.zeros(num_experts, dtype=torch.float32, device=device) if score_correction_bias else None
        self.register_buffer("score_correction_bias", bias_buffer)

        self.aux_loss: Optional[Tensor] = None
        self.last_counts: Optional[Tensor] = None
        self.last_dropped: Optional[Tensor] = None

    _PER_FORWARD = ("aux_loss", "last_counts", "last_dropped")

    def __getstate__(self):
        # The last forward's outputs belong to its autograd graph: a copy or a pickle of the
        # layer starts without them (deepcopy refuses non-leaf tensors).
        # The communication stream is this process's: a copy makes its own on first use.
        state = super().__getstate__()
        return {**state, **{name: None for name in self._PER_FORWARD}, "ep_comm_stream": None}

    def extra_repr(self) -> str:
        ep = f", ep_size={self.ep_group.size}, ep_rank={self.ep_group.rank}" if self.ep_group is not None else ""
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"ffn_hidden_size={self.ffn_hidden_size}, top_k={self.top_k}, score_func={self.score_func}{ep}")

    def forward(self, x: Tensor) -> Tensor:
        """The block's output for x [..., H] (the experts' dtype), of x's shape."""
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected [..., {self.hidden_size}] (hidden_size), got {tuple(x.shape)}")
        shape = x.shape
        tokens = x.reshape(-1, self.hidden_size)
        if torch.is_autocast_enabled(tokens.device.type):  # float32 logits under autocast too
            with torch.autocast(tokens.device.type, enabled=False):
                logits = F.linear(tokens.float(), self.router.weight.float())
        else:  # the context costs microseconds of host time per forward: only where it is needed
            logits = F.linear(tokens.float(), self.router.weight.float())
        # The bias is float32 for the op even after module.to(bfloat16), which casts buffers too.
        bias = self.score_correction_bias.float() if self.score_correction_bias is not None else None
        route = router_topk(logits, self.top_k, score_func=self.score_func, normalize=self.normalize_topk,
                            n_group=self.n_group, topk_group=self.topk_group, scaling_factor=self.scaling_factor,
                            score_bias=bias)
        if self.probs_in_experts:
            perm = permute(tokens, route.ids, self.num_experts, route.probs, pad_multiple=self.pad_multiple,
                           capacity_factor=self.capacity_factor)
            out = combine(self._experts(perm.rows, perm.counts, perm.probs, tokens, perm.map), perm.map)
        else:  # FC2's bias: see the module's docstring
            perm = permute(tokens, route.ids, self.num_experts, pad_multiple=self.pad_multiple,
                           capacity_factor=self.capacity_factor)
            out = combine(self._experts(perm.rows, perm.counts, None, tokens, perm.map), perm.map, route.probs)
        if self.shared_experts is not None:
            every_token = torch.full((1,), tokens.shape[0], dtype=torch.int32, device=tokens.device)
            out = out + self.shared_experts(tokens, every_token)

        aux_loss = None
        if self.aux_loss_coeff != 0:
            aux_loss = router_aux_loss(logits, route.counts, self.top_k, self.aux_loss_coeff,
                                       score_func=self.score_func)
        if self.z_loss_coeff != 0:
            z_loss = router_z_loss(logits, self.z_loss_coeff)
            aux_loss = z_loss if aux_loss is None else aux_loss + z_loss
        self.aux_loss = aux_loss
        self.last_counts = route.counts
        self.last_dropped = perm.dropped
        return out.view(shape)

    def _experts(self, rows: Tensor, counts: Tensor, probs: Optional[Tensor], tokens: Tensor,
                 map: RoutingMap) -> Tensor:
        """The routed experts on permuted rows (tokens permuted by map) grouped by global expert:
        here, or with an EP group of size > 1 on the ranks that hold them (dispatch -> experts ->
        combine)."""
        g = self.ep_group
        overlap = self.experts_wgrad_during_combine and torch.is_grad_enabled()
        if overlap and not (self.experts.fc1.delay_wgrad_compute or self.experts.fc2.delay_wgrad_compute):
            raise ValueError("experts_wgrad_during_combine: the experts' weight gradients are not delayed "
                             "(set delay_wgrad_compute = True)")
        if g is None or g.size == 1:
            if overlap:
                rows = WorkAfterBackward.apply(rows, self.experts.backward_dw)
            regather = (tokens, map.row_of, map.src_token) if self.regather_expert_input else None
            return self.experts(rows, counts, probs, _regather=regather)
        n = rows.shape[0]
        if n > g.max_rows:
            raise ValueError(f"ep_group: max_rows = {g.max_rows}, but this forward has {n} permuted rows")
        if rows.dtype != g.dtype or rows.device != g.device:
            raise ValueError(f"ep_group: moves {g.dtype} rows on {g.device}; the layer's are {rows.dtype} on "
                             f"{rows.device}")
        if n < g.max_rows:  # the group's source layout is [max_rows, H]
            rows = F.pad(rows, (0, 0, 0, g.max_rows - n))
            probs = F.pad(probs, (0, g.max_rows - n)) if probs is not None else None
        plan = ep_plan(g, counts)
        if overlap:
            out, out_scalars = EpDispatchWorkDuringCombine.apply(
                g.handle, plan.counts_all, plan.local_counts, rows, probs, self.experts.backward_dw,
                self._comm_stream(rows.device))
            recv = EpRows(out, out_scalars if probs is not None else None)
        else:
            recv = ep_dispatch(g, plan, rows, probs)
        y = self.experts(recv.rows, plan.local_counts, recv.scalars)
        return ep_combine(g, plan, y).rows[:n]

    def _comm_stream(self, device: torch.device) -> Optional["torch.cuda.Stream"]:
        """The stream of the exchange that overlaps the experts' weight gradients (None on the CPU)."""
        if device.type != "cuda":
            return None
        if self.ep_comm_stream is None:
            self.ep_comm_stream = torch.cuda.Stream(device=device)
        return self.ep_comm_stream

    @property
    def probs_in_experts(self) -> bool:
        """True when the router probabilities scale the experts' activation and the combine has
        weights 1 (the experts' FC2 has no bias), False when the combine weights their output."""
        return not self.experts.fc2.use_bias

    # ---- checkpoints across EP sizes --------------------------------------------------------------

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A state dict of all E routed experts (an EP = 1 layer's, or the ranks' merged with
        # gmoe.merge_ep_state_dicts) loads into an expert-parallel layer as this rank's slice, stacked
        # or per-expert; a rank's own state dict (El experts) loads as it is.
        g = self.ep_group
        if g is not None and g.size > 1:
            El, first = g.local_experts, g.rank * g.local_experts
            for fc in ("fc1", "fc2"):
                for name in ("weight", "bias"):
                    key = f"{prefix}experts.{fc}.{name}"
                    t = state_dict.get(key)
                    if t is not None and t.dim() >= 1 and t.shape[0] == self.num_experts:
                        state_dict[key] = t[first:first + El]
                    every = [f"{key}{e}" for e in range(self.num_experts)]
                    if all(k in state_dict for k in every):
                        mine = [state_dict[k] for k in every[first:first + El]]
                        for k in every:
                            del state_dict[k]
                        state_dict.update({f"{key}{e}": t for e, t in enumerate(mine)})
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    # ---- the experts' Megatron conventions, for the whole layer --------------------------------

    def _grouped_linears(self) -> List[GroupedLinear]:
        mlps = [self.experts] + ([self.shared_experts] if self.shared_experts is not None else [])
        return [fc for m in mlps for fc in (m.fc1, m.fc2)]

    @property
    def delay_wgrad_compute(self) -> bool:
        """Whether backward leaves the experts' (and shared experts') weight gradients to
        :meth:`backward_dw`. Settable; the router's weight gradient is never delayed."""
        return self.experts.fc1.delay_wgrad_compute

    @delay_wgrad_compute.setter
    def delay_wgrad_compute(self, value: bool) -> None:
        for fc in self._grouped_linears():
            fc.delay_wgrad_compute = bool(value)

    @property
    def expert_mask(self) -> Optional[Tensor]:
        """The routed experts' expert_mask (GroupedMLP.expert_mask): None, or an int32 tensor [E]."""
        return self.experts.expert_mask

    @expert_mask.setter
    def expert_mask(self, mask: Optional[Tensor]) -> None:
        self.experts.expert_mask = mask

    @property
    def masked_off_wgrad(self) -> str:
        """The routed experts' masked_off_wgrad: ``"skip"`` or ``"fresh"`` (see GroupedLinear)."""
        return self.experts.masked_off_wgrad

    @masked_off_wgrad.setter
    def masked_off_wgrad(self, mode: str) -> None:
        self.experts.masked_off_wgrad = mode

    def backward_dw(self) -> None:
        """The delayed weight gradients of the experts, then of the shared experts (see
        GroupedMLP.backward_dw). With ``experts_wgrad_during_combine`` backward has computed the
        experts' already, and this computes what is left."""
        self.experts.backward_dw()
        if self.shared_experts is not None:
            self.shared_experts.backward_dw()

    def register_wgrad_hook(self, fn: Callable[[], None]) -> None:
        """Calls ``fn()`` once the experts' weight gradients of a backward are complete, and again
        once the shared experts' are (GroupedMLP.register_wgrad_hook)."""
        self.experts.register_wgrad_hook(fn)
        if self.shared_experts is not None:
            self.shared_experts.register_wgrad_hook(fn)

    def invalidate_fp8_weight(self) -> None:
        """Drops the FP8 weight caches (see GroupedLinear.invalidate_fp8_weight)."""
        self.experts.invalidate_fp8_weight()
        if self.shared_experts is not None:
            self.shared_experts.invalidate_fp8_weight()
