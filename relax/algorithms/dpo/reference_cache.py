"""DPO's reference cache: the reference log-probs of every pair's chosen and rejected completions,
saved beside the data (``relax.algorithms.reference_cache``, kind ``"pairs"``); attach the result
with ``relax.data.pairs.with_reference`` and the batches carry ``ref_logps``."""

from relax.algorithms.reference_cache import (StaleCacheError, cache_key, cached_reference_logps,
                                              default_cache_path, load_cache, reference_logps, save_cache)

__all__ = ["StaleCacheError", "cache_key", "cached_reference_logps", "default_cache_path", "load_cache",
           "reference_logps", "save_cache"]
