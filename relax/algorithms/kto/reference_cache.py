"""KTO's reference cache: the reference log-probs of every row's completion and of its KL
completion (``relax.data.pairs.encode_unpaired`` fixes the mismatched pairs in data order, so
both can be precomputed), saved beside the data. The same file format and keys as DPO's
(``relax.algorithms.reference_cache``, kind ``"unpaired"``); attach the result with
``relax.data.pairs.with_reference`` and the batches carry ``ref_logps``."""

from relax.algorithms.reference_cache import (StaleCacheError, cache_key, cached_reference_logps,
                                              default_cache_path, load_cache, reference_logps, save_cache)

__all__ = ["StaleCacheError", "cache_key", "cached_reference_logps", "default_cache_path", "load_cache",
           "reference_logps", "save_cache"]
