"""Autograd formulas registered from Python: the expert-parallel exchanges (each one's backward is
the other with the same plan). The other ops' formulas are in C++ (python/csrc/autograd.cpp)."""
import torch

_ops = torch.ops.gmoe


def _fit(ctx, *grads):
    """The gradients of the arguments the op was called with: the dispatcher leaves trailing
    arguments that have their default out of the inputs, and the backward must match them."""
    return grads[:len(ctx.needs_input_grad)]


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
