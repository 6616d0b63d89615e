"""Attention kernels: blocks merged by log-sum-exp, decode, the training group and dense kernels,
the packed stream's block-sparse kernel."""

from relax.models.attention.blocks import (
    NEG_INF,
    BlockStats,
    attention,
    block_stats,
    causal_mask,
    heads_major,
    merge_stats,
    partial_attention,
    shared_prefix_attention,
)
from relax.models.attention.decode import (
    BLOCK_K,
    BLOCK_ROWS,
    MIN_DIM,
    OwnAllowed,
    OwnKeys,
    OwnValues,
    pallas_available,
    pallas_decode_attention,
    reference_decode_attention,
)
from relax.models.attention.dense import fused_attention_available, prefix_dense_attention
from relax.models.attention.group import prefix_group_attention
from relax.models.attention.stream import (
    StreamMask,
    allowed_mask,
    block_pairs,
    num_block_pairs,
    stream_attention,
)

__all__ = [
    "BLOCK_K",
    "BLOCK_ROWS",
    "BlockStats",
    "MIN_DIM",
    "NEG_INF",
    "OwnAllowed",
    "OwnKeys",
    "OwnValues",
    "StreamMask",
    "allowed_mask",
    "attention",
    "block_pairs",
    "block_stats",
    "causal_mask",
    "fused_attention_available",
    "heads_major",
    "merge_stats",
    "num_block_pairs",
    "pallas_available",
    "pallas_decode_attention",
    "partial_attention",
    "prefix_dense_attention",
    "prefix_group_attention",
    "reference_decode_attention",
    "shared_prefix_attention",
    "stream_attention",
]
