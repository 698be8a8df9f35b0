"""Autograd formulas of the differentiable gmoe ops (torch.library.register_autograd), written with
the gmoe ops themselves, so that the backward runs gmoe's kernels and traces under torch.compile."""
import torch

_ops = torch.ops.gmoe


def _fit(ctx, *grads):
    """The gradients of the arguments the op was called with: the dispatcher leaves trailing
    arguments that have their default out of the inputs, and the backward must match them."""
    return grads[:len(ctx.needs_input_grad)]


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


def _unstack_like(g: torch.Tensor, like):
    """A stacked gradient [E, ...] in the layout of `like` (one stacked tensor, or E tensors)."""
    if len(like) == 1 and like[0].dim() == g.dim():
        return [g]
    return list(g.unbind(0))


# ---- grouped_gemm_fprop(x, w, counts, bias, out_dtype) -----------------------------------------

def _fprop_setup(ctx, inputs, output):
    x, w, counts, bias, _ = inputs
    ctx.save_for_backward(x, counts, *w)
    save_bias_layout(ctx, bias)


def _fprop_backward(ctx, dy):
    x, counts, *w = ctx.saved_tensors
    dy = dy.to(x.dtype).contiguous()
    dx = _ops.grouped_gemm_dgrad(dy, w, counts, None) if ctx.needs_input_grad[0] else None
    dw = None
    if any(t.requires_grad for t in w):
        dw = _unstack_like(_ops.grouped_gemm_wgrad(dy, x, counts, w[0].dtype), w)
    return _fit(ctx, dx, dw, None, bias_grads(ctx, dy, counts), None)


torch.library.register_autograd("gmoe::grouped_gemm_fprop", _fprop_backward, setup_context=_fprop_setup)


# ---- grouped_bias_add(y, bias, counts) ----------------------------------------------------------

def _bias_add_setup(ctx, inputs, output):
    _, bias, counts = inputs
    ctx.save_for_backward(counts)
    save_bias_layout(ctx, bias)


def _bias_add_backward(ctx, dy):
    (counts,) = ctx.saved_tensors
    dy = dy.contiguous()
    return _fit(ctx, dy, bias_grads(ctx, dy, counts), None)


torch.library.register_autograd("gmoe::grouped_bias_add", _bias_add_backward, setup_context=_bias_add_setup)


# ---- grouped_activation_forward(h, counts, kind, probs, alpha, limit, gelu_tanh, glu_block) -----

def _activation_setup(ctx, inputs, output):
    h, counts, kind, probs, alpha, limit, gelu_tanh, glu_block = inputs
    ctx.save_for_backward(h, counts, probs)
    ctx.args = (kind, alpha, limit, gelu_tanh, glu_block)
    ctx.need_dprobs = probs is not None and probs.requires_grad


def _activation_backward(ctx, dz):
    h, counts, probs = ctx.saved_tensors
    kind, alpha, limit, gelu_tanh, glu_block = ctx.args
    dh, dprobs = _ops.grouped_activation_backward(h, dz.contiguous(), counts, kind, probs, ctx.need_dprobs, alpha,
                                                  limit, gelu_tanh, glu_block)
    return _fit(ctx, dh, None, None, (dprobs if ctx.need_dprobs else None), None, None, None, None)


torch.library.register_autograd("gmoe::grouped_activation_forward", _activation_backward,
                                setup_context=_activation_setup)


# ---- routing ---------------------------------------------------------------------------------------
# The integer outputs (ids, counts, the map, dropped) have no gradient; the selection is a constant.

# router_topk(logits, top_k, score, normalize, n_group, topk_group, scaling_factor, score_bias)
#   -> (probs, ids, counts)
def _router_topk_setup(ctx, inputs, output):
    logits, _, score, normalize, _, _, scaling_factor = inputs[:7]
    ids = output[1]
    ctx.save_for_backward(logits, ids)
    ctx.args = (score, normalize, scaling_factor)


def _router_topk_backward(ctx, dprobs, _dids, _dcounts):
    logits, ids = ctx.saved_tensors
    if dprobs is None or not ctx.needs_input_grad[0]:
        return _fit(ctx, *([None] * 8))
    score, normalize, scaling_factor = ctx.args
    dlogits = _ops.router_topk_backward(logits, ids, dprobs.float().contiguous(), score, normalize, scaling_factor,
                                        None)
    return _fit(ctx, dlogits, *([None] * 7))


torch.library.register_autograd("gmoe::router_topk", _router_topk_backward, setup_context=_router_topk_setup)


# router_aux_loss(logits, counts, top_k, score, coeff)
def _aux_loss_setup(ctx, inputs, output):
    logits, counts, top_k, score, coeff = inputs
    ctx.save_for_backward(logits, counts)
    ctx.args = (top_k, score, coeff)


def _aux_loss_backward(ctx, dloss):
    logits, counts = ctx.saved_tensors
    top_k, score, coeff = ctx.args
    dlogits = _ops.router_aux_loss_backward(logits, counts, dloss.float().contiguous(), top_k, score, coeff, None)
    return _fit(ctx, dlogits, None, None, None, None)


torch.library.register_autograd("gmoe::router_aux_loss", _aux_loss_backward, setup_context=_aux_loss_setup)


# router_z_loss(logits, coeff)
def _z_loss_setup(ctx, inputs, output):
    logits, coeff = inputs
    ctx.save_for_backward(logits)
    ctx.coeff = coeff


def _z_loss_backward(ctx, dloss):
    (logits,) = ctx.saved_tensors
    dlogits = _ops.router_z_loss_backward(logits, dloss.float().contiguous(), ctx.coeff, None)
    return _fit(ctx, dlogits, None)


torch.library.register_autograd("gmoe::router_z_loss", _z_loss_backward, setup_context=_z_loss_setup)


# permute(x, ids, num_experts, pad_multiple, capacity_factor, probs)
#   -> (permuted, counts, row_of, src_token, permuted_probs, dropped)
def _permute_setup(ctx, inputs, output):
    x, probs = inputs[0], inputs[5]
    ctx.save_for_backward(output[2], output[3])
    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
    ctx.need_dprobs = probs is not None and probs.requires_grad


def _permute_backward(ctx, dpermuted, _dcounts, _drow_of, _dsrc, dpermuted_probs, _ddropped):
    row_of, src_token = ctx.saved_tensors
    rows = src_token.shape[0]
    if dpermuted is None:
        dpermuted = row_of.new_zeros((rows, ctx.x_shape[1]), dtype=ctx.x_dtype)
    want_dprobs = ctx.need_dprobs and dpermuted_probs is not None
    dx, dprobs = _ops.permute_backward(dpermuted.to(ctx.x_dtype).contiguous(), row_of, src_token,
                                       dpermuted_probs.float().contiguous() if want_dprobs else None)
    return _fit(ctx, dx, None, None, None, None, dprobs if want_dprobs else None)


torch.library.register_autograd("gmoe::permute", _permute_backward, setup_context=_permute_setup)


# combine(expert_out, row_of, src_token, probs)
def _combine_setup(ctx, inputs, output):
    expert_out, row_of, src_token, probs = inputs
    ctx.need_dprobs = probs is not None and probs.requires_grad
    # expert_out lives on to backward only for the probabilities' gradient.
    ctx.save_for_backward(row_of, src_token, probs, expert_out if ctx.need_dprobs else None)
    ctx.out_dtype = expert_out.dtype


def _combine_backward(ctx, dout):
    row_of, src_token, probs, expert_out = ctx.saved_tensors
    dexpert_out, dprobs = _ops.combine_backward(dout.to(ctx.out_dtype).contiguous(), row_of, src_token, probs,
                                                expert_out, ctx.need_dprobs)
    return _fit(ctx, dexpert_out, None, None, dprobs if ctx.need_dprobs else None)


torch.library.register_autograd("gmoe::combine", _combine_backward, setup_context=_combine_setup)


# ep_dispatch / ep_combine(group, counts_all, local_counts, rows, scalars) -> (rows, scalars): each
# one's backward is the other, with the same plan (the same ranks exchange the same rows back).
def _ep_setup(ctx, inputs, output):
    group, counts_all, local_counts, rows, scalars = inputs
    ctx.group = group
    ctx.save_for_backward(counts_all, local_counts)
    ctx.out_shape = output[0].shape  # for a missing gradient's zeros
    ctx.rows_dtype = rows.dtype
    ctx.has_scalars = scalars is not None
    ctx.needs_scalars_grad = scalars is not None and scalars.requires_grad


def _ep_backward(reverse):
    def backward(ctx, drows, dscalars):
        counts_all, local_counts = ctx.saved_tensors
        # The reverse exchange is collective: every rank runs it with the same arguments, so a missing
        # gradient (an output this rank did not use) is zeros, never a skipped exchange.
        drows = counts_all.new_zeros(ctx.out_shape, dtype=ctx.rows_dtype) if drows is None else \
            drows.to(ctx.rows_dtype).contiguous()
        ds = None
        if ctx.has_scalars:
            ds = dscalars.float().contiguous() if dscalars is not None else \
                drows.new_zeros((drows.shape[0],), dtype=torch.float32)
        drows_in, dscalars_in = reverse(ctx.group, counts_all, local_counts, drows, ds)
        return _fit(ctx, None, None, None, drows_in, dscalars_in if ctx.needs_scalars_grad else None)
    return backward


torch.library.register_autograd("gmoe::ep_dispatch", _ep_backward(_ops.ep_combine), setup_context=_ep_setup)
torch.library.register_autograd("gmoe::ep_combine", _ep_backward(_ops.ep_dispatch), setup_context=_ep_setup)
