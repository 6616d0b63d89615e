"""Rollouts: the prefix-shared sampler (``sampler``; its types and host-side helpers in
``config``, its decode loop's pieces in ``decode``), sampling distributions (``sampling``), and
the no-cache reference sampler the tests compare against (``naive``)."""

from relax.rollout.sampler import Rollout, RolloutConfig, generate, generate_with
from relax.rollout.sampling import SamplingConfig

__all__ = ["Rollout", "RolloutConfig", "SamplingConfig", "generate", "generate_with"]
