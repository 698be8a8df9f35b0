"""Autograd formulas of the differentiable routing ops (torch.library.register_autograd), written with
the gmoe ops themselves, so that the backward runs gmoe's kernels and traces under torch.compile; and
the bias-gradient helpers of the modules' autograd functions.

The expert ops' formulas (grouped_gemm_fprop, grouped_bias_add, grouped_activation_forward) are
registered in C++ (python/csrc/autograd.cpp): a formula registered here runs Python on every call of
its op, which the expert ops, called several times per layer, cannot afford."""
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
