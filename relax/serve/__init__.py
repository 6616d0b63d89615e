"""Training as a service: every objective by name over a batch (``objectives``).

    from relax.serve.objectives import forward_backward, optim_step
    grads, metrics = forward_backward(state, rows, "grpo", beta=0.04)
    state = optim_step(state, grads)
"""
