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
