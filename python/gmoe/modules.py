"""gmoe.GroupedLinear and gmoe.GroupedMLP: expert layers with Transformer Engine / Megatron conventions.

* ``forward(x, m_splits)``: ``m_splits`` is an int32/int64 tensor [E] of rows per expert on x's
  device (the signature of Transformer Engine's graph-safe GroupedLinear); it is never read on the
  host, so a step can be captured in a CUDA graph once and replayed under any routing. Counts known
  on the host (a list of ints, or a CPU tensor) are accepted too: uploaded once per forward,
  stream-ordered from pinned memory (no sync, no pageable copy; PyTorch's pinned allocator keeps
  the staging block until the copy has run). In a CUDA graph pass device counts.
* Megatron's gradient convention: a weight (or bias) that has a float32 ``main_grad`` attribute gets
  its gradient added into it (``accumulate_main_grad=True``, the default) or written over it, its
  ``grad_added_to_main_grad`` attribute is set to True, and ``param.grad`` is not materialised.
  A parameter that had ``grad_added_to_main_grad`` set beforehand (Megatron's DDP marks its
  parameters so) gets a placeholder gradient instead, so that hooks on its AccumulateGrad node (where
  Megatron launches the gradient reduction) still run, as with Transformer Engine's modules.
  Otherwise ``param.grad`` is set as autograd does.
* ``delay_wgrad_compute=True``: backward computes the data (and bias) gradients only; the weight
  gradients are computed by ``backward_dw()``, which then calls the hooks registered with
  ``register_wgrad_hook(fn)`` (where a data-parallel reduce-scatter is launched). With main_grad
  weights and no delay the hooks are called at the end of the layer's backward.
* ``expert_mask`` (a settable attribute: None, or an int32 tensor [E] on the layer's device) with
  ``masked_off_wgrad`` (``"skip"`` or ``"fresh"``): which experts' weight gradients go to
  ``main_grad`` (mask 1) and what the others get (Megatron's partial accumulation of "spare"
  experts; MaskedOffWgrad of gmoe/grouped_gemm.h). See :class:`GroupedLinear`.
* weights as one stacked parameter ``weight`` [E, out, in] (``weight_layout="stacked"``) or per-expert
  parameters ``weight0`` … ``weight{E-1}`` (``"per_expert"``); biases alike (``bias`` [E, out] or
  ``bias0`` …). ``load_state_dict`` accepts either layout's checkpoint.
"""
import contextlib
import math
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .fp8 import Fp8Rows, Fp8Weights, fp8_grouped_gemm, fp8_grouped_gemm_dgrad, fp8_grouped_gemm_wgrad, \
    quantize_grouped, quantize_weights
from .ops import ACTIVATIONS, MASKED_OFF_WGRAD, glu_block_of

_ops = torch.ops.gmoe
#: The innermost saved-tensor hooks in force, (pack, unpack) or None: torch's own lookup for
#: SavedVariable, applied to what GroupedLinear keeps for backward_dw outside autograd.
_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_LAYOUTS = ("stacked", "per_expert")
#: FP8 recipes of the modules (LinearRecipe of gmoe/grouped_linear.h) and their quantization recipe.
FP8_RECIPES = {"fp8_tensorwise": "tensorwise", "fp8_blockwise": "blockwise", "mxfp8": "mxfp8"}
_autocast_recipe: List[Optional[str]] = [None]


class fp8_autocast:
    """``with gmoe.fp8_autocast("fp8_blockwise"):`` — the GroupedLinear / GroupedMLP layers built
    without a recipe run their GEMMs in FP8 with this one inside the block (``None``: native)."""

    def __init__(self, recipe: Optional[str] = "fp8_blockwise"):
        if recipe is not None and recipe not in FP8_RECIPES:
            raise ValueError(f"recipe: expected one of {tuple(FP8_RECIPES)} or None, got {recipe!r}")
        self.recipe = recipe

    def __enter__(self):
        self.previous = _autocast_recipe[0]
        _autocast_recipe[0] = self.recipe
        return self

    def __exit__(self, *exc):
        _autocast_recipe[0] = self.previous
        return False


class _Wgrad:
    """One weight gradient to compute, now or in backward_dw: dy and x (native), or their
    columnwise FP8 copies; the expert mask and masked_off mode of the forward that made them."""

    def __init__(self, dy: Tensor, x, counts: Tensor, mask: Optional[Tensor] = None, masked_off: str = "skip"):
        self.dy, self.x, self.counts, self.mask, self.masked_off = dy, x, counts, mask, masked_off
        self.stream = torch.cuda.current_stream() if _device_of(dy).type == "cuda" else None

    def tensors(self) -> List[Tensor]:
        mask = [] if self.mask is None else [self.mask]
        if isinstance(self.dy, Tensor):
            return [self.dy, self.x, self.counts, *mask]
        return [t for t in (*self.dy[:5], *self.x[:5], self.counts, *mask) if t.numel()]

    def fresh(self, dtype: torch.dtype) -> Tensor:
        """A new [E, N, K] gradient (the experts with mask 0: zeros)."""
        if isinstance(self.dy, Tensor):
            return _ops.grouped_gemm_wgrad(self.dy, self.x, self.counts, dtype, self.mask)
        return fp8_grouped_gemm_wgrad(self.dy, self.x, self.counts, expert_mask=self.mask).to(dtype)

    def into(self, out: List[Tensor], accumulate: bool, fresh_out: Optional[List[Tensor]] = None) -> None:
        """The experts with mask 1 into `out`; with masked_off "fresh" the others into fresh_out."""
        masked_off = "fresh" if fresh_out is not None else "skip"
        if isinstance(self.dy, Tensor):
            _ops.grouped_gemm_wgrad_(self.dy, self.x, self.counts, out, accumulate, self.mask, masked_off,
                                     fresh_out)
        else:
            fp8_grouped_gemm_wgrad(self.dy, self.x, self.counts, out=out, accumulate=accumulate, expert_mask=self.mask,
                                   masked_off=masked_off, fresh_out=fresh_out)


def _device_counts(m_splits, device: torch.device) -> Tensor:
    """m_splits on `device`: a tensor there as it is; host counts (a list or tuple of ints, or a CPU
    tensor) copied once, for CUDA from pinned memory with a non-blocking copy on the current stream."""
    if isinstance(m_splits, Tensor) and m_splits.device == device:
        return m_splits
    host = m_splits if isinstance(m_splits, Tensor) else torch.tensor(list(m_splits), dtype=torch.int64)
    if host.device.type != "cpu":
        raise ValueError(f"m_splits: expected counts on {device} or on the host, got a tensor on {host.device}")
    if device.type != "cuda":
        return host
    pinned = host if host.is_pinned() else host.pin_memory()
    return pinned.to(device, non_blocking=True)


def save_bias_layout(ctx, biases) -> None:
    """What bias_grads needs to know of the biases (an empty list: no bias)."""
    ctx.num_biases = len(biases)
    ctx.bias_grouped = len(biases) == 1 and biases[0].dim() == 2
    ctx.bias_dtype = biases[0].dtype if biases else None


def bias_grads(ctx, dy, counts):
    """The biases' gradients in their layout: [] without bias, [db] for a grouped [E, N] bias, E
    tensors [N] for per-expert biases."""
    if not ctx.num_biases:
        return []
    g = _ops.grouped_bias_grad(dy, counts, ctx.bias_dtype)
    return [g] if ctx.bias_grouped else list(g.unbind(0))


def _any_main_grad(weights: List[Tensor], biases: List[Tensor]) -> bool:
    for p in weights:
        if hasattr(p, "main_grad"):
            return True
    for p in biases:
        if hasattr(p, "main_grad"):
            return True
    return False


def _device_of(dy) -> torch.device:
    return dy.device if isinstance(dy, Tensor) else dy.data_t.device


def _check_masked_off(masked_off: str) -> str:
    if masked_off not in MASKED_OFF_WGRAD:
        raise ValueError(f"masked_off_wgrad: expected one of {MASKED_OFF_WGRAD}, got {masked_off!r}")
    return masked_off


def _check_expert_mask(mask: Optional[Tensor], num_experts: int) -> Optional[Tensor]:
    """An expert_mask's metadata (no device read): None, or int32 [E]."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise ValueError(f"expert_mask: expected None or an int32 tensor [{num_experts}], got {type(mask).__name__}")
    if mask.dtype != torch.int32 or tuple(mask.shape) != (num_experts,):
        raise ValueError(f"expert_mask: expected an int32 tensor [{num_experts}] (num_experts), got "
                         f"{mask.dtype} {list(mask.shape)}")
    return mask


#: Every expert's view of a packed per-expert gradient starts on this boundary, the alignment that
#: gmoe's own packed gradients keep in both layouts (GroupedLinearGrads, gmoe/grouped_linear.h).
_PACK_ALIGN_BYTES = 256


_placeholders: Dict[Tuple[Tuple[int, ...], torch.dtype, torch.device, bool], Tensor] = {}


def _main_grad_placeholder(p: Tensor) -> Optional[Tensor]:
    """What autograd gets for parameter p once its gradient went into p.main_grad (and sets
    p.grad_added_to_main_grad). Megatron's DDP marks the parameters it manages by setting that
    attribute (False) beforehand, and launches its gradient reduction from hooks on their
    AccumulateGrad nodes: those run only when autograd has a gradient to accumulate, so such a
    parameter gets a placeholder of its shape (its values unused: the hook sees
    grad_added_to_main_grad and does not add it; zeros where the parameter asks for them with
    zero_out_wgrad), as Transformer Engine's modules do. Others get None: no .grad is made."""
    protocol = hasattr(p, "grad_added_to_main_grad")
    p.grad_added_to_main_grad = True
    if not protocol:
        return None
    zero = bool(getattr(p, "zero_out_wgrad", False))
    key = (tuple(p.shape), p.dtype, p.device, zero)
    if key not in _placeholders:
        _placeholders[key] = (torch.zeros if zero else torch.empty)(p.shape, dtype=p.dtype, device=p.device)
    return _placeholders[key]


class _WgradState:
    """What a GroupedLinear's autograd function needs beyond tensors: where weight gradients go
    (main_grad or .grad, now or in backward_dw) and the hooks. Only used outside torch.compile's
    plain path (see GroupedLinear.forward)."""

    def __init__(self, module: "GroupedLinear"):
        self.module = module
        self.pending: List[_Wgrad] = []


def _activation(h: Tensor, counts: Tensor, probs: Optional[Tensor], act: tuple) -> Tensor:
    """z = act(h)·probs by the activation op; act: (kind, alpha, limit, gelu_tanh, glu_block)."""
    kind, alpha, limit, gelu_tanh, glu_block = act
    return _ops.grouped_activation_forward(h, counts, kind, probs, alpha, limit, gelu_tanh, glu_block)


def _gemm_input(ctx, x: Tensor, probs: Optional[Tensor], counts: Tensor) -> Tensor:
    """The GEMM's input for the weight gradient: x as saved, or under recompute z = act(x)·probs
    made again by the forward's own op from the same operands, so bitwise the forward's."""
    return x if ctx.recompute is None else _activation(x, counts, probs, ctx.recompute)


def _input_grads(ctx, x: Tensor, probs: Optional[Tensor], counts: Tensor,
                 dgrad: Callable[[], Tensor]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The gradients of the inputs x and probs: dgrad() for x; under recompute (x is h) dz = dgrad()
    through the activation's backward, which gives dh and d(probs) as its autograd formula does."""
    if ctx.recompute is None:
        return (dgrad() if ctx.needs_input_grad[0] else None), None
    need_dprobs = probs is not None and ctx.needs_input_grad[6]
    if not (ctx.needs_input_grad[0] or need_dprobs):
        return None, None
    kind, alpha, limit, gelu_tanh, glu_block = ctx.recompute
    dh, dprobs = _ops.grouped_activation_backward(x, dgrad().contiguous(), counts, kind, probs, need_dprobs, alpha,
                                                  limit, gelu_tanh, glu_block)
    return dh, (dprobs if need_dprobs else None)


def _columnwise_only(q: Fp8Rows) -> Fp8Rows:
    """q without its rowwise copy (what the FP8 weight gradient reads)."""
    return Fp8Rows(q.data.new_empty(0), q.scale_inv.new_empty(0), *q[2:])


class _Regathered:
    """What is saved instead of permuted rows under _regather_input: the tokens and the map (each
    as the hooks outside packed it)."""
    __slots__ = ("tokens", "row_of", "src_token")

    def __init__(self, tokens, row_of, src_token):
        self.tokens, self.row_of, self.src_token = tokens, row_of, src_token


@contextlib.contextmanager
def _regather_input(rows: Tensor, tokens: Tensor, row_of: Tensor, src_token: Tensor):
    """Saved-tensor hooks under which ``rows`` (tokens permuted by the map: permute's output) is not
    kept for backward: whatever saves it keeps the tokens and the map instead, and backward gathers
    the rows again with combine's backward at weights 1, which writes each token's row where the map
    put it and zeros elsewhere: permute's rows, bitwise (gmoe/moe_layer.h, regather_expert_input).
    Every other saved tensor, and the tokens and the map, go through the saved-tensor hooks active
    outside (gmoe.offload_activations), if any, as they would without these."""
    outer = _saved_tensor_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)
    # rows' identity, not rows itself: a reference here would keep it alive.
    ptr, shape, dtype, device = rows.data_ptr(), rows.shape, rows.dtype, rows.device

    def keep(t):
        return t if outer_pack is None else outer_pack(t)

    def back(p):
        return p if outer_unpack is None else outer_unpack(p)

    def pack(t: Tensor):
        if t.numel() > 0 and t.data_ptr() == ptr and t.shape == shape and t.dtype == dtype and t.device == device:
            return _Regathered(keep(tokens), keep(row_of), keep(src_token))
        return keep(t)

    def unpack(p):
        if isinstance(p, _Regathered):
            return _ops.combine_backward(back(p.tokens), back(p.row_of), back(p.src_token))[0]
        return back(p)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class _GroupedLinearFunction(torch.autograd.Function):
    """y = grouped_gemm(x, weights, counts, biases); params = weights + biases (a count of each).
    mask, masked_off: the weight gradient's expert mask (None: every expert) and its mode.
    recompute: None, or (GroupedMLP's FC2 with recompute_activation) the activation's arguments
    (kind, alpha, limit, gelu_tanh, glu_block): then x is FC1's output h, the GEMM's input is
    z = act(h)·probs, and only h and probs are kept; backward makes z again for the weight
    gradient and runs the activation's backward for dh and d(probs). One function for both, so
    that h is saved once (an offload moves it once)."""

    @staticmethod
    def forward(ctx, x: Tensor, counts: Tensor, mask: Optional[Tensor], masked_off: str,
                state: Optional[_WgradState], recompute: Optional[tuple], probs: Optional[Tensor], num_weights: int,
                *params: Tensor):
        weights, biases = list(params[:num_weights]), list(params[num_weights:])
        ctx.save_for_backward(x, probs, counts, mask, *weights)
        ctx.masked_off = masked_off
        ctx.state = state
        ctx.recompute = recompute
        ctx.num_weights = num_weights
        save_bias_layout(ctx, biases)
        z = x if recompute is None else _activation(x, counts, probs, recompute)
        return _ops.grouped_gemm_fprop(z, weights, counts, biases, None)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, probs, counts, mask, *weights = ctx.saved_tensors
        dy = dy.contiguous()
        dx, dprobs = _input_grads(ctx, x, probs, counts, lambda: _ops.grouped_gemm_dgrad(dy, weights, counts, None))
        dbiases = bias_grads(ctx, dy, counts)
        no_grads = (None,) * 5  # counts, mask, masked_off, state, recompute
        state = ctx.state
        if state is None:
            dweights: List[Optional[Tensor]] = [None] * ctx.num_weights
            if any(ctx.needs_input_grad[8:8 + ctx.num_weights]):
                dw = _ops.grouped_gemm_wgrad(dy, _gemm_input(ctx, x, probs, counts), counts, weights[0].dtype, mask)
                dweights = [dw] if ctx.num_weights == 1 and weights[0].dim() == 3 else list(dw.unbind(0))
            return (dx, *no_grads, dprobs, None, *dweights, *dbiases)
        wg = _Wgrad(dy, _gemm_input(ctx, x, probs, counts), counts, mask, ctx.masked_off)
        dweights, dbiases = state.module._finish_backward(wg, dbiases)
        return (dx, *no_grads, dprobs, None, *dweights, *dbiases)


class _Fp8GroupedLinearFunction(torch.autograd.Function):
    """The FP8 GroupedLinear: x and dy quantized in one pass each (rowwise for fprop/dgrad, and the
    columnwise copy the FP8 weight gradient reads), the weights quantized by the caller (cached).
    recompute, probs: as for _GroupedLinearFunction; then z is quantized rowwise in forward and
    columnwise in backward from the z made again (the two copies' scales are independent, so this
    is bitwise the copy forward would have kept)."""

    @staticmethod
    def forward(ctx, x: Tensor, counts: Tensor, mask: Optional[Tensor], masked_off: str,
                state: Optional[_WgradState], recompute: Optional[tuple], probs: Optional[Tensor], num_weights: int,
                recipe: str, grad_format: str, wq: Fp8Weights, *params: Tensor):
        biases = list(params[num_weights:])
        z = x if recompute is None else _activation(x, counts, probs, recompute)
        xq = quantize_grouped(z, counts, recipe, "e4m3", rowwise=True, columnwise=recompute is None)
        y = fp8_grouped_gemm(xq, wq, counts, biases, out_dtype=z.dtype)
        # Only the columnwise copy lives on to backward (the weight gradient's operand), or h and
        # probs that make it again.
        if recompute is None:
            ctx.save_for_backward(counts, mask, None, None, *_columnwise_only(xq)[:5], *wq[:4])
        else:
            ctx.save_for_backward(counts, mask, x, probs, *(None,) * 5, *wq[:4])
        ctx.masked_off = masked_off
        ctx.x_meta = (recipe, xq.capacity, xq.cols, z.dtype)
        ctx.grad_format, ctx.state, ctx.num_weights, ctx.recompute = grad_format, state, num_weights, recompute
        ctx.stacked = params[0].dim() == 3
        save_bias_layout(ctx, biases)
        ctx.weight_dtype = params[0].dtype
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        counts, mask, h, probs, *rest = ctx.saved_tensors
        recipe, capacity, cols, z_dtype = ctx.x_meta
        wq = Fp8Weights(*rest[5:9], recipe)
        dy = dy.contiguous()
        dyq = quantize_grouped(dy, counts, recipe, ctx.grad_format, rowwise=True, columnwise=True)
        dx, dprobs = _input_grads(ctx, h, probs, counts, lambda: fp8_grouped_gemm_dgrad(dyq, wq, counts,
                                                                                         out_dtype=z_dtype))
        dbiases = bias_grads(ctx, dy, counts)
        if ctx.recompute is None:
            xq = Fp8Rows(*rest[:5], recipe, capacity, cols)
        else:
            xq = _columnwise_only(quantize_grouped(_gemm_input(ctx, h, probs, counts), counts, recipe, "e4m3",
                                                   rowwise=False, columnwise=True))
        wg = _Wgrad(_columnwise_only(dyq), xq, counts, mask, ctx.masked_off)
        no_grads = (None,) * 5  # counts, mask, masked_off, state, recompute
        no_grads_after = (None,) * 4  # num_weights, recipe, grad_format, wq
        if ctx.state is None:
            dw = wg.fresh(ctx.weight_dtype)
            dweights = [dw] if ctx.stacked else list(dw.unbind(0))
            return (dx, *no_grads, dprobs, *no_grads_after, *dweights, *dbiases)
        dweights, dbiases = ctx.state.module._finish_backward(wg, dbiases)
        return (dx, *no_grads, dprobs, *no_grads_after, *dweights, *dbiases)


def _kaiming_like_linear(w: Tensor, b: Optional[Tensor], in_features: int) -> None:
    """nn.Linear's initialisation, per expert."""
    with torch.no_grad():
        for e in range(w.shape[0]):
            nn.init.kaiming_uniform_(w[e], a=math.sqrt(5))
        if b is not None:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            nn.init.uniform_(b, -bound, bound)


class GroupedLinear(nn.Module):
    """E expert linear layers on grouped rows: ``y[rows of e] = x[rows of e] @ W_e.T + b_e``.

    Args:
        num_experts: E.
        in_features, out_features: K and N of every expert's weight [N, K].
        bias: one bias [N] per expert.
        weight_layout: ``"stacked"`` (parameter ``weight`` [E, N, K], ``bias`` [E, N]) or
            ``"per_expert"`` (``weight0`` … ``weight{E-1}`` [N, K], ``bias0`` … [N]).
        delay_wgrad_compute: backward leaves the weight gradients to :meth:`backward_dw`.
        accumulate_main_grad: with ``param.main_grad``: add into it (True) or overwrite it (False).
        recipe: ``None`` (the parameters' precision), or an FP8 recipe for the three GEMMs:
            ``"fp8_tensorwise"``, ``"fp8_blockwise"``, ``"mxfp8"`` (also set by :class:`fp8_autocast`).
            x and dy are quantized in one pass each; the weights' FP8 copies are cached and made
            again when a weight changed (``param._version``, which ``optimizer.step()`` bumps) or
            inside a CUDA graph capture (so that every replay quantizes the current weights).
            CUDA needs bf16 parameters and in/out features multiples of 16.
        grad_format: FP8 format of the output gradients, ``"e4m3"`` or ``"e5m2"``.
        masked_off_wgrad: what the experts with ``expert_mask`` 0 get (see below), ``"skip"`` or
            ``"fresh"``; also a settable attribute.
        device, dtype: of the parameters (CUDA: bfloat16/float16; CPU: float32 too).

    Expert mask (Megatron / Transformer Engine partial accumulation): set ``layer.expert_mask`` to
    an int32 tensor [E] on the layer's device (None, the default: every expert). A forward uses
    the mask tensor set then; its contents are read on the device when that forward's weight
    gradient runs (backward, or :meth:`backward_dw`), never on the host, so a captured CUDA graph
    follows a mask updated in place before each replay. Only the weight gradients are masked (the
    biases' and the input's are not).

    * With ``main_grad`` on the weights: the experts with mask 1 are added into (or written over,
      ``accumulate_main_grad``) their ``main_grad``; the experts with mask 0 follow
      ``masked_off_wgrad``: ``"skip"`` computes no gradient for them and leaves their ``main_grad``
      untouched; ``"fresh"`` writes their gradient (never accumulated) into a new float32 tensor,
      set as each weight's ``masked_off_grad`` attribute (the weight's shape; per-expert weights
      get views of one allocation), in the same launch as main_grad's. The experts with mask 1 of
      ``masked_off_grad`` are not written (undefined contents). The wgrad hooks run after both.
    * Without ``main_grad`` (``param.grad``): the experts with mask 0 get a zero gradient
      (``"skip"``: their ``.grad`` is unchanged by the backward); ``"fresh"`` needs ``main_grad``
      and raises ValueError in forward, as gmoe's GroupedLinear does.
    * With ``delay_wgrad_compute`` and ``"fresh"``, call :meth:`backward_dw` after every backward
      (each backward's ``masked_off_grad`` is fresh; a second backward while one is pending raises).
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = True,
                 weight_layout: str = "stacked", delay_wgrad_compute: bool = False,
                 accumulate_main_grad: bool = True, recipe: Optional[str] = None, grad_format: str = "e4m3",
                 masked_off_wgrad: str = "skip", device: Optional[Union[str, torch.device]] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.masked_off_wgrad = masked_off_wgrad
        self._expert_mask: Optional[Tensor] = None
        if recipe is not None and recipe not in FP8_RECIPES:
            raise ValueError(f"recipe: expected one of {tuple(FP8_RECIPES)} or None, got {recipe!r}")
        if grad_format not in ("e4m3", "e5m2"):
            raise ValueError(f"grad_format: expected 'e4m3' or 'e5m2', got {grad_format!r}")
        self.recipe, self.grad_format = recipe, grad_format
        self._fp8_cache: Optional[tuple] = None  # (key, Fp8Weights)
        if weight_layout not in _LAYOUTS:
            raise ValueError(f"weight_layout: expected one of {_LAYOUTS}, got {weight_layout!r}")
        if num_experts < 1:
            raise ValueError(f"num_experts: expected at least 1, got {num_experts}")
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.weight_layout = weight_layout
        self.use_bias = bias
        # The parameters' names in the layout, read from self._parameters in forward: nn.Module's
        # attribute lookup costs about a microsecond per parameter, and a forward reads them all.
        if weight_layout == "stacked":
            self._weight_names: Tuple[str, ...] = ("weight",)
            self._bias_names: Tuple[str, ...] = ("bias",) if bias else ()
        else:
            self._weight_names = tuple(f"weight{e}" for e in range(num_experts))
            self._bias_names = tuple(f"bias{e}" for e in range(num_experts)) if bias else ()
        self.delay_wgrad_compute = delay_wgrad_compute
        self.accumulate_main_grad = accumulate_main_grad
        self._wgrad_hooks: List[Callable[[], None]] = []
        self._state = _WgradState(self)
        factory = dict(device=device, dtype=dtype)
        w = torch.empty(num_experts, out_features, in_features, **factory)
        b = torch.empty(num_experts, out_features, **factory) if bias else None
        _kaiming_like_linear(w, b, in_features)
        if weight_layout == "stacked":
            self.weight = nn.Parameter(w)
            if b is not None:
                self.bias = nn.Parameter(b)
        else:
            for e in range(num_experts):
                self.register_parameter(f"weight{e}", nn.Parameter(w[e].clone()))
                if b is not None:
                    self.register_parameter(f"bias{e}", nn.Parameter(b[e].clone()))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}, weight_layout={self.weight_layout}")

    @property
    def expert_mask(self) -> Optional[Tensor]:
        """None (every expert's weight gradient goes to its destination) or an int32 tensor [E] on
        the layer's device: see the class docstring. Setting it checks its dtype and length."""
        return self._expert_mask

    @expert_mask.setter
    def expert_mask(self, mask: Optional[Tensor]) -> None:
        self._expert_mask = _check_expert_mask(mask, self.num_experts)

    @property
    def masked_off_wgrad(self) -> str:
        """``"skip"`` or ``"fresh"``: what the experts with expert_mask 0 get (see the class docstring)."""
        return self._masked_off_wgrad

    @masked_off_wgrad.setter
    def masked_off_wgrad(self, mode: str) -> None:
        self._masked_off_wgrad = _check_masked_off(mode)

    def _weights(self) -> List[Tensor]:
        params = self._parameters
        return [params[n] for n in self._weight_names]

    def _biases(self) -> List[Tensor]:
        params = self._parameters
        return [params[n] for n in self._bias_names]

    def forward(self, x: Tensor, m_splits, *, _recompute: Optional[tuple] = None,
                _probs: Optional[Tensor] = None) -> Tensor:
        """y [capacity, out_features] for x [capacity, in_features] split by ``m_splits`` [E] (on x's
        device, or host counts: see the module's docstring). ``_recompute``, ``_probs``: GroupedMLP's
        FC2 with recompute_activation (x is then h, the layer's input act(h)·probs, made again in
        backward instead of kept: see _GroupedLinearFunction)."""
        m_splits = _device_counts(m_splits, x.device)
        recompute, probs = _recompute, _probs
        weights, biases = self._weights(), self._biases()
        # The plain path (autograd owns the gradients) passes no Python state, so that
        # torch.compile traces it whole.
        special = self.delay_wgrad_compute or bool(self._wgrad_hooks) or _any_main_grad(weights, biases)
        recipe = self.recipe or _autocast_recipe[0]
        if recipe is None and not special and self._expert_mask is None:
            # The ops' own autograd formulas (C++) give these gradients without a Python
            # autograd.Function: a forward runs the op and nothing else of consequence.
            if recompute is None:
                return _ops.grouped_gemm_fprop(x, weights, m_splits, biases, None)
            kind, alpha, limit, gelu_tanh, glu_block = recompute
            return _ops.grouped_gemm_fprop_of_activation(x, weights, m_splits, biases, kind, probs, alpha, limit,
                                                         gelu_tanh, glu_block)
        mask, masked_off = self._mask_for_forward(x, weights)
        if recipe is None and masked_off == "skip":
            y = self._forward_to_destinations(x, m_splits, weights, biases, recompute, probs, mask)
            if y is not None:
                return y
        state = self._state if special else None
        if recipe is None:
            return _GroupedLinearFunction.apply(x, m_splits, mask, masked_off, state, recompute, probs, len(weights),
                                                *weights, *biases)
        wq = self._fp8_weights(FP8_RECIPES[recipe], weights, x)
        return _Fp8GroupedLinearFunction.apply(x, m_splits, mask, masked_off, state, recompute, probs, len(weights),
                                               FP8_RECIPES[recipe], self.grad_format, wq, *weights, *biases)

    def _forward_to_destinations(self, x: Tensor, counts: Tensor, weights: List[Tensor], biases: List[Tensor],
                                 recompute: Optional[tuple], probs: Optional[Tensor],
                                 mask: Optional[Tensor]) -> Optional[Tensor]:
        """The main_grad / delayed-wgrad / hooks / expert-mask ("skip") forward through the op
        grouped_linear_forward, whose autograd formula (C++) sends the gradients to main_grad and
        hands autograd the placeholders; None where this layer needs the Python function instead:
        under torch.compile, with main_grad on some weights (or biases) only, with Megatron's mark
        on some of them only, with hooks on weights whose .grad autograd sets (the hooks must run
        after it), or with delay_wgrad_compute under recompute (h would be kept twice)."""
        if torch.compiler.is_compiling():
            return None
        w_main = [w.main_grad for w in weights if hasattr(w, "main_grad")]
        b_main = [b.main_grad for b in biases if hasattr(b, "main_grad")]
        if len(w_main) not in (0, len(weights)) or len(b_main) not in (0, len(biases)):
            return None
        delay = self.delay_wgrad_compute
        if (not w_main and not delay and self._wgrad_hooks) or (delay and recompute is not None):
            return None
        recording = torch.is_grad_enabled() and (x.requires_grad or (probs is not None and probs.requires_grad) or
                                                 any(p.requires_grad for p in weights) or
                                                 any(p.requires_grad for p in biases))
        w_ph: List[Tensor] = []
        b_ph: List[Tensor] = []
        if recording:
            for params, main, out in ((weights, w_main and not delay, w_ph), (biases, b_main, b_ph)):
                if not main:
                    continue
                marked = [hasattr(p, "grad_added_to_main_grad") for p in params]
                if any(marked) and not all(marked):
                    return None
                # Set here, in forward, for the backward that adds into main_grad (the Python
                # function sets it in backward): Megatron's DDP clears it before each forward.
                placeholders = [_main_grad_placeholder(p) for p in params]
                if all(marked):
                    out.extend(placeholders)
        kind, alpha, limit, gelu_tanh, glu_block = recompute or (None, 1.702, 7.0, False, 0)
        y = _ops.grouped_linear_forward(x, weights, counts, biases, w_main, b_main, w_ph, b_ph,
                                        self.accumulate_main_grad, delay, kind, probs, alpha, limit, gelu_tanh,
                                        glu_block, mask)
        if not recording:
            return y
        if delay:
            # x is kept for backward_dw here (the op does not save it): packed by the saved-tensor
            # hooks in force, as autograd would pack it (gmoe.offload_activations moves it to the
            # host and back); dy taken when backward reaches the op's node, on the backward's stream.
            hooks = _saved_tensor_hooks(False)
            packed = x if hooks is None else hooks[0](x)

            def keep_for_backward_dw(grad_outputs: Tuple[Tensor, ...]) -> None:
                kept = packed if hooks is None else hooks[1](packed)
                self._state.pending.append(_Wgrad(grad_outputs[0].contiguous(), kept, counts, mask))
            # On the op's node, not through Tensor.register_hook (its Python wrapper costs more).
            y.grad_fn.register_prehook(keep_for_backward_dw)
        elif self._wgrad_hooks:
            # After the op's backward, which added the weights' gradients into main_grad.
            y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: self._run_wgrad_hooks())
        return y

    def _mask_for_forward(self, x: Tensor, weights: List[Tensor]):
        """The expert mask and mode this forward's weight gradient uses, checked (no device read)."""
        mask = self._expert_mask
        if mask is None:
            return None, "skip"
        if mask.device != x.device:
            raise ValueError(f"expert_mask: expected a tensor on {x.device} (x's device), got one on {mask.device}")
        if self._masked_off_wgrad == "fresh" and torch.is_grad_enabled() and \
                any(w.requires_grad for w in weights) and not all(hasattr(w, "main_grad") for w in weights):
            raise ValueError("masked_off_wgrad: 'fresh' needs main_grad on the weights (the experts with "
                             "expert_mask 0 get a fresh gradient instead of main_grad's); use 'skip' without it")
        return mask, self._masked_off_wgrad

    def _fp8_weights(self, recipe: str, weights: List[Tensor], x: Tensor) -> Fp8Weights:
        """The weights' FP8 copies: cached while the weights are unchanged."""
        key = (recipe, tuple((w.data_ptr(), w._version) for w in weights))
        uncached = torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())
        if not uncached and self._fp8_cache is not None and self._fp8_cache[0] == key:
            return self._fp8_cache[1]
        wq = quantize_weights([w.detach() for w in weights], recipe)
        if not uncached:
            self._fp8_cache = (key, wq)
        return wq

    def invalidate_fp8_weight(self) -> None:
        """Drops the FP8 weight cache (changes to the weights are detected without it, through
        their version counters; this is for changes made behind autograd's back, e.g. via .data)."""
        self._fp8_cache = None

    # ---- weight gradients -------------------------------------------------------------------

    def _to_main_grad(self, p: Tensor, g: Tensor) -> Optional[Tensor]:
        """Puts gradient g of parameter p into p.main_grad when it has one (returns what autograd
        gets then: _main_grad_placeholder's), else returns g."""
        if not hasattr(p, "main_grad"):
            return g
        if self.accumulate_main_grad:
            p.main_grad.add_(g)
        else:
            p.main_grad.copy_(g)
        return _main_grad_placeholder(p)

    def _finish_backward(self, wg: _Wgrad, dbiases: List[Tensor]) -> Tuple[List[Optional[Tensor]],
                                                                            List[Optional[Tensor]]]:
        """The end of a backward with Python state: bias gradients to main_grad where there is one,
        the weight gradient now (and the hooks) or queued for backward_dw. Returns what autograd
        gets for the weights and the biases (placeholders or None where main_grad took them)."""
        if self.delay_wgrad_compute and wg.mask is not None and wg.masked_off == "fresh" and self._state.pending:
            raise ValueError("masked_off_wgrad: 'fresh' with delay_wgrad_compute needs backward_dw() after "
                             "every backward (each backward's masked_off_grad is fresh); one is still pending")
        dbiases = [self._to_main_grad(b, g) for b, g in zip(self._biases(), dbiases)]
        if self.delay_wgrad_compute:
            self._state.pending.append(wg)
            return [None] * len(self._weights()), dbiases
        dweights = self._compute_wgrad(wg)
        self._run_wgrad_hooks()
        return dweights, dbiases

    def _masked_off_grads(self, dtype: torch.dtype, device: torch.device) -> List[Tensor]:
        """New fresh destinations of the masked-off experts in the weights' layout (set as each
        weight's masked_off_grad): one allocation; per-expert views start on 256-byte boundaries."""
        E, N, K = self.num_experts, self.out_features, self.in_features
        if self.weight_layout == "stacked":
            grads = [torch.empty(E, N, K, dtype=dtype, device=device)]
        else:
            size = torch.empty(0, dtype=dtype).element_size()
            per = _PACK_ALIGN_BYTES // size
            stride = (N * K + per - 1) // per * per
            # One spare block, so that the first view starts on the boundary whatever the
            # allocator's own alignment (the CPU allocator's is 64 bytes).
            pack = torch.empty(E * stride + per, dtype=dtype, device=device)
            start = (-pack.data_ptr() % _PACK_ALIGN_BYTES) // size
            grads = [pack[start + e * stride:start + e * stride + N * K].view(N, K) for e in range(E)]
        for w, g in zip(self._weights(), grads):
            w.masked_off_grad = g
        return grads

    def _compute_wgrad(self, wg: _Wgrad) -> List[Optional[Tensor]]:
        """The weight gradients of one backward into main_grad or .grad; returns what autograd
        gets for each weight when this runs inside backward (_main_grad_placeholder's, or None)."""
        weights = self._weights()
        if all(hasattr(w, "main_grad") for w in weights):
            fresh = None
            if wg.mask is not None and wg.masked_off == "fresh":
                fresh = self._masked_off_grads(weights[0].main_grad.dtype, weights[0].main_grad.device)
            wg.into([w.main_grad for w in weights], self.accumulate_main_grad, fresh)
            return [_main_grad_placeholder(w) for w in weights]
        dw = wg.fresh(weights[0].dtype)
        grads = [dw] if self.weight_layout == "stacked" else list(dw.unbind(0))
        out: List[Optional[Tensor]] = [None] * len(weights)
        for e, (w, g) in enumerate(zip(weights, grads)):
            if hasattr(w, "main_grad"):
                if wg.mask is not None and not self.accumulate_main_grad:
                    # Only some per-expert weights have a main_grad: a masked-off one stays untouched.
                    g = torch.where(wg.mask[e] != 0, g, w.main_grad)
                out[e] = self._to_main_grad(w, g)
            elif w.grad is None:
                w.grad = g
            else:
                w.grad += g
        return out

    def _run_wgrad_hooks(self) -> None:
        for fn in self._wgrad_hooks:
            fn()

    def register_wgrad_hook(self, fn: Callable[[], None]) -> None:
        """Calls ``fn()`` once this layer's weight gradients of a backward are complete: in
        :meth:`backward_dw` with ``delay_wgrad_compute``, else at the end of the layer's backward."""
        self._wgrad_hooks.append(fn)

    def backward_dw(self) -> None:
        """Computes the weight gradients that backward left (``delay_wgrad_compute``), oldest first,
        on the current stream, then calls the wgrad hooks. Call it on a stream ordered after the
        backward (for another stream: ``s.wait_stream(torch.cuda.current_stream())`` first)."""
        pending, self._state.pending = self._state.pending, []
        for wg in pending:
            if wg.stream is not None and wg.stream != torch.cuda.current_stream():
                # The tensors were made on the backward's stream: keep their memory from being
                # reused there while this stream still reads them.
                for t in wg.tensors():
                    t.record_stream(torch.cuda.current_stream())
            self._compute_wgrad(wg)
        if pending:
            self._run_wgrad_hooks()

    # ---- checkpoints in either layout -------------------------------------------------------

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name in ("weight", "bias"):
            stacked_key = prefix + name
            expert_keys = [f"{prefix}{name}{e}" for e in range(self.num_experts)]
            if self.weight_layout == "stacked" and stacked_key not in state_dict and \
                    all(k in state_dict for k in expert_keys):
                state_dict[stacked_key] = torch.stack([state_dict.pop(k) for k in expert_keys])
            elif self.weight_layout == "per_expert" and stacked_key in state_dict and \
                    not any(k in state_dict for k in expert_keys):
                stacked = state_dict.pop(stacked_key)
                if stacked.dim() >= 1 and stacked.shape[0] == self.num_experts:
                    for k, t in zip(expert_keys, stacked.unbind(0)):
                        state_dict[k] = t
                else:
                    error_msgs.append(f"{stacked_key}: expected {self.num_experts} experts along dimension 0, "
                                      f"got shape {tuple(stacked.shape)}")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


class GroupedMLP(nn.Module):
    """The expert MLP of an MoE block: FC1 → activation (× router probability) → FC2.

    Args:
        num_experts: E.
        hidden_size: H, the input and output width.
        ffn_hidden_size: F, the activation's output width (FC1 has 2F outputs for gated kinds).
        activation: one of ``"swiglu"``, ``"geglu"``, ``"clamped_swiglu"`` (gpt-oss; ``alpha``,
            ``limit``), ``"squared_relu"``; ``gelu_tanh`` selects GeGLU's tanh approximation.
        glu_layout: FC1's gate/up output rows, ``"concatenated"`` ([gate; up]) or ``"interleaved:B"``.
        bias, weight_layout, delay_wgrad_compute, accumulate_main_grad, recipe, grad_format,
            masked_off_wgrad, device, dtype: as for :class:`GroupedLinear` (both FCs; the activation
            runs in the parameters' precision between the FP8 GEMMs).
        recompute_activation: do not keep z = act(h)·probs (FC2's input) for backward: the
            activation runs inside FC2's autograd function, which keeps h (the activation's backward
            needs it anyway) and probs, makes z again in backward for FC2's weight gradient (with
            ``delay_wgrad_compute`` it is held until :meth:`backward_dw`) and runs the activation's
            backward. Results bitwise those without it; saves capacity·F elements per layer (FP8
            recipes: FC2's columnwise FP8 copy of z) for one more activation pass. A settable attribute.

    Submodules ``fc1`` and ``fc2`` are GroupedLinear layers. ``expert_mask`` and
    ``masked_off_wgrad`` are settable attributes that set both FCs' (see :class:`GroupedLinear`).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu",
                 glu_layout: Union[str, int] = "concatenated", bias: bool = False, weight_layout: str = "stacked",
                 alpha: float = 1.702, limit: float = 7.0, gelu_tanh: bool = False,
                 delay_wgrad_compute: bool = False, accumulate_main_grad: bool = True,
                 recipe: Optional[str] = None, grad_format: str = "e4m3", masked_off_wgrad: str = "skip",
                 recompute_activation: bool = False, device: Optional[Union[str, torch.device]] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.glu_block = glu_block_of(glu_layout)
        self.alpha, self.limit, self.gelu_tanh = float(alpha), float(limit), bool(gelu_tanh)
        self.recompute_activation = bool(recompute_activation)
        fc1_out = ffn_hidden_size if activation == "squared_relu" else 2 * ffn_hidden_size
        common = dict(bias=bias, weight_layout=weight_layout, delay_wgrad_compute=delay_wgrad_compute,
                      accumulate_main_grad=accumulate_main_grad, recipe=recipe, grad_format=grad_format,
                      masked_off_wgrad=masked_off_wgrad, device=device, dtype=dtype)
        self.fc1 = GroupedLinear(num_experts, hidden_size, fc1_out, **common)
        self.fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size, **common)

    def forward(self, x: Tensor, m_splits, probs: Optional[Tensor] = None, *,
                _regather: Optional[Tuple[Tensor, Tensor, Tensor]] = None) -> Tensor:
        """y [capacity, H] for x [capacity, H] split by ``m_splits`` [E]; ``probs`` (optional,
        float32 [capacity], differentiable) scales each row's activation output. Host counts are
        uploaded once, for both FCs and the activation. ``_regather``: MoELayer's
        regather_expert_input, (tokens, row_of, src_token) such that x is the permutation of tokens
        by that map: x is then not kept for FC1's weight gradient but gathered again in backward
        (see _regather_input)."""
        m_splits = _device_counts(m_splits, x.device)
        # Through _modules, not self.fc1: nn.Module's attribute lookup costs about a microsecond.
        fc1, fc2 = self._modules["fc1"], self._modules["fc2"]
        if _regather is not None and not torch.compiler.is_compiling():
            with _regather_input(x, *_regather):
                h = fc1(x, m_splits)
        else:
            h = fc1(x, m_splits)
        if self.recompute_activation:  # the activation runs inside FC2's function, z is not kept
            act = (self.activation, self.alpha, self.limit, self.gelu_tanh, self.glu_block)
            return fc2(h, m_splits, _recompute=act, _probs=probs)
        z = _ops.grouped_activation_forward(h, m_splits, self.activation, probs, self.alpha, self.limit,
                                            self.gelu_tanh, self.glu_block)
        return fc2(z, m_splits)

    @property
    def expert_mask(self) -> Optional[Tensor]:
        """Both FCs' expert_mask (see GroupedLinear): None, or an int32 tensor [E] on the layer's device."""
        return self.fc1.expert_mask

    @expert_mask.setter
    def expert_mask(self, mask: Optional[Tensor]) -> None:
        self.fc1.expert_mask = mask
        self.fc2.expert_mask = mask

    @property
    def masked_off_wgrad(self) -> str:
        """Both FCs' masked_off_wgrad (see GroupedLinear): ``"skip"`` or ``"fresh"``."""
        return self.fc1.masked_off_wgrad

    @masked_off_wgrad.setter
    def masked_off_wgrad(self, mode: str) -> None:
        self.fc1.masked_off_wgrad = mode
        self.fc2.masked_off_wgrad = mode

    def invalidate_fp8_weight(self) -> None:
        """Drops both FCs' FP8 weight caches (see GroupedLinear.invalidate_fp8_weight)."""
        self.fc1.invalidate_fp8_weight()
        self.fc2.invalidate_fp8_weight()

    def backward_dw(self) -> None:
        """The delayed weight gradients: FC2's, then FC1's (each layer's hooks fire after its own)."""
        self.fc2.backward_dw()
        self.fc1.backward_dw()

    def register_wgrad_hook(self, fn: Callable[[], None]) -> None:
        """Calls ``fn()`` once both FCs' weight gradients of a backward are complete (FC1's come last)."""
        self.fc1.register_wgrad_hook(fn)
