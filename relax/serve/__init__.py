"""Training as a service: every objective by name over a batch (``objectives``), and a server
(``python -m relax.serve``: ``server``, ``service``, ``session``) with a client whose calls return
futures (``client``, ``types``), named after Tinker's, so that a Tinker-style loop runs with a
changed import::

    import relax.serve as tinker                       # instead of: import tinker
    from relax.serve import types                      # instead of: from tinker import types
    service_client = tinker.ServiceClient("http://127.0.0.1:8470")
    training_client = service_client.create_lora_training_client(rank=16)

    from relax.serve.objectives import objective_forward_backward, objective_optim_step
    grads, metrics = objective_forward_backward(state, rows, "grpo", beta=0.04)  # in-process
    state = objective_optim_step(state, grads)
"""

from __future__ import annotations

_CLIENT = (
    "ServiceClient",
    "TrainingClient",
    "SamplingClient",
    "ServiceError",
    "LocalServiceClient",
)


def __getattr__(name: str):
    if name in _CLIENT:  # imported on use: `import relax.serve` stays light
        from relax.serve import client

        return getattr(client, name)
    raise AttributeError(f"module 'relax.serve' has no attribute {name!r}")
