"""Preference-pair pieces shared by the DPO family and KTO: rows, reference, update, config."""

from relax.algorithms.preference.config import PreferenceTrainConfig, make_state
from relax.algorithms.preference.pairs import Forward, PairRows, sequence_logps, shared_forward
from relax.algorithms.preference.reference import make_pair_reference, reference_logps
from relax.algorithms.preference.reference_cache import (
    FORMAT,
    StaleCacheError,
    cache_key,
    cached_reference_logps,
    data_fingerprint,
    dataset_reference_logps,
    default_cache_path,
    load_cache,
    model_digest,
    precompute,
    reference_preparer,
    save_cache,
    tokens_digest,
)
from relax.algorithms.preference.update import ref_is_policy_of, run_update, with_loss_mask

__all__ = [
    "FORMAT",
    "Forward",
    "PairRows",
    "PreferenceTrainConfig",
    "StaleCacheError",
    "cache_key",
    "cached_reference_logps",
    "data_fingerprint",
    "dataset_reference_logps",
    "default_cache_path",
    "load_cache",
    "make_pair_reference",
    "make_state",
    "model_digest",
    "precompute",
    "ref_is_policy_of",
    "reference_logps",
    "reference_preparer",
    "run_update",
    "save_cache",
    "sequence_logps",
    "shared_forward",
    "tokens_digest",
    "with_loss_mask",
]
