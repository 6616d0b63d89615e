"""Training forwards: the forward config, prefix-shared and packed forwards, packing and routes."""

from relax.models.forward.binned import binned_hidden, binned_logprobs, bins_hidden, bins_logprobs
from relax.models.forward.completion_packing import CompletionBins, to_padded, to_rows
from relax.models.forward.config import ForwardConfig
from relax.models.forward.forward_pass import (
    DEFAULT_PASS,
    REMAT_POLICIES,
    TRAIN_ATTENTION,
    ForwardPass,
    attention_probs_bytes,
    check_train_attention,
    resolve_attention,
)
from relax.models.forward.packed import (
    greedy_hits,
    packed_attention,
    packed_hidden,
    packed_logprobs,
    segment_mask,
    segment_positions,
)
from relax.models.forward.prefix_shared import (
    CompletionRope,
    CompletionRows,
    completion_hidden,
    completion_logprobs,
    completion_rope,
    over_groups,
    padded_rows,
    rows_hidden,
    shared_hidden,
)
from relax.models.forward.routes import Routes, route_dtype

__all__ = [
    "CompletionRope",
    "CompletionRows",
    "DEFAULT_PASS",
    "ForwardConfig",
    "ForwardPass",
    "CompletionBins",
    "REMAT_POLICIES",
    "Routes",
    "TRAIN_ATTENTION",
    "attention_probs_bytes",
    "binned_hidden",
    "binned_logprobs",
    "bins_hidden",
    "bins_logprobs",
    "check_train_attention",
    "completion_hidden",
    "completion_logprobs",
    "completion_rope",
    "greedy_hits",
    "over_groups",
    "packed_attention",
    "packed_hidden",
    "packed_logprobs",
    "padded_rows",
    "resolve_attention",
    "route_dtype",
    "rows_hidden",
    "segment_mask",
    "segment_positions",
    "shared_hidden",
    "to_padded",
    "to_rows",
]
