"""Compile a run's programs for TPU and GPU targets without the hardware, and say whether it fits.

``plan(algorithm, flags, target)`` (and the command ``relax plan``) builds one step of a run from
its flags and a ``config.json``, compiles every program with the target's compiler on
compile-only devices (``relax.plan.targets``) and reports per chip what each program needs
(``relax.plan.memory``) and does (``relax.plan.hlo_summary``).
"""

from relax.plan.plan import Plan, parse_run, plan, plan_run
from relax.plan.targets import CHIPS, Chip, Target
from relax.plan.trainers import ALGORITHMS

__all__ = ["ALGORITHMS", "CHIPS", "Chip", "Plan", "Target", "parse_run", "plan", "plan_run"]
