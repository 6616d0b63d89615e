"""The GRPO step on a mesh (``ShardedStep``) and the run's parallelism flags (``ParallelConfig``).

Re-exported by ``relax.parallel``; the sharding rules are documented there. Execution plan:
the leaves of a composed step are regrouped like ``relax.compose`` (adjacent jittable stages fuse
into one ``jax.jit``, host stages stand alone), and each segment runs as::

    jitted segment:  place inputs (device_put / make_array_from_process_local_data)
                     -> jit(stages + with_sharding_constraint on every output)
    host segment:    global batch arrays -> this process's rows (numpy) -> fn -> unchanged
                     arrays restored as the global ones they came from

With a sampler mesh, the stages placed on the sampler (``placement="sampler"``: the rollout) run on the sampler
devices against a policy COPY laid out for the sampler mesh (a host stage placed there, partial
rollouts', gets that copy in its state and samples on its mesh); a ``weight_transfer`` segment before
the rollout refreshes that copy from the trainer's policy (i.e. after every update), so its time
appears as ``time/weight_transfer`` in the run's metrics. On several processes a host stage placed
on each process (``placement="process"``: a multi-turn rollout) gets a state holding this process's
own copy of the policy (``relax.parallel.local``) and runs on its rows alone. With ``offload_reference`` the
reference model lives in host memory (``memory_kind="pinned_host"``) except while a segment that
reads it (``reads_reference``) runs.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax

from relax.compose import (
    Segment,
    SegmentRunner,
    Stage,
    WithHost,
    batch_only,
    group_leaves,
    join_host,
    keep_state,
    split_host,
)
from relax.parallel import distributed
from relax.parallel.local import ProcessCopy
from relax.parallel.mesh import (
    DEFAULT_RULES,
    MeshSpec,
    Rules,
    ShardingError,
    batch_axes_text,
    batch_leaf_sharding,
    batch_shards,
    constrain_batch,
    make_mesh,
    param_shardings,
    place_batch,
    prompt_rows,
    replicated,
    state_shardings,
)

HOST_MEMORY = "pinned_host"
# The state a sharded step runs on is a dataclass (``relax.train.TrainState``) with a ``replace``
# method and these fields, which hold models and optimizer states (None where unused): the
# sampler segment gets a view without them and the sampler's copy of ``policy``.
MODEL_FIELDS = ("policy", "opt_state", "ref", "critic", "critic_opt_state")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Devices, meshes and multi-host setup of a run (``--parallel.*`` flags).

    ``mesh``: the trainer mesh, e.g. ``"data=2,fsdp=4,tensor=1"``, ``"expert=4,data=2"`` (a mixture
    of experts' experts split 4 ways) or ``"fsdp=-1"`` (all devices);
    None with ``sampler_devices=0`` keeps the single-device path. ``sampler_devices``: the first N
    devices run the rollout on their own mesh (``sampler_mesh``, default: data-parallel over
    them), the remaining ones train (``mesh``, default ``fsdp=-1``); single-process only.
    ``offload_reference``: keep the KL reference in host memory between its uses (GPU/TPU; a
    no-op with a warning on CPU, where device memory IS host memory); it needs a mesh (``mesh``
    or ``sampler_devices``): without one it is an error, not ignored.
    Multi-host: ``coordinator`` (host:port of process 0), ``num_processes``, ``process_id``
    (else ``RELAX_COORDINATOR`` / ``RELAX_NUM_PROCESSES`` / ``RELAX_PROCESS_ID``), or
    ``multihost=True`` to let jax detect the cluster (TPU VM, SLURM); ``init_timeout_s`` bounds
    the wait for the coordinator.
    """

    mesh: str | None = None
    sampler_devices: int = 0
    sampler_mesh: str = "data=-1"
    offload_reference: bool = False
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    multihost: bool = False
    init_timeout_s: float = 300.0

    def __post_init__(self):
        if self.mesh is not None:
            MeshSpec.parse(self.mesh)
        MeshSpec.parse(self.sampler_mesh)
        if self.sampler_devices < 0:
            raise ValueError(f"sampler_devices must be >= 0, got {self.sampler_devices}")
        if self.init_timeout_s <= 0:
            raise ValueError(f"init_timeout_s must be > 0, got {self.init_timeout_s}")
        if self.offload_reference and not self.enabled:
            raise ValueError(
                "--parallel.offload-reference needs a mesh: the single-device path keeps the reference "
                "where it is. Add --parallel.mesh (e.g. fsdp=-1, all devices) or "
                "--parallel.sampler-devices, or drop --parallel.offload-reference"
            )

    @property
    def enabled(self) -> bool:
        return self.mesh is not None or self.sampler_devices > 0

    def initialize(self) -> bool:
        """``relax.parallel.distributed.initialize`` from these flags (before any device is touched)."""
        return distributed.initialize(
            self.coordinator,
            self.num_processes,
            self.process_id,
            timeout_s=self.init_timeout_s,
            auto=self.multihost,
        )

    def meshes(self, devices=None) -> tuple[jax.sharding.Mesh | None, jax.sharding.Mesh | None]:
        """``(trainer_mesh, sampler_mesh)``; ``(None, None)`` when not ``enabled``."""
        if not self.enabled:
            return None, None
        if self.sampler_devices == 0:
            return make_mesh(self.mesh, devices), None
        pool = list(jax.devices() if devices is None else devices)
        if jax.process_count() > 1:
            raise ShardingError(
                "sampler_devices (separate sampler and trainer meshes) is single-process only"
            )
        if not 0 < self.sampler_devices < len(pool):
            raise ShardingError(
                f"sampler_devices={self.sampler_devices} must leave trainer devices: "
                f"{len(pool)} device(s) in all"
            )
        s = self.sampler_devices
        return (make_mesh(self.mesh or "fsdp=-1", pool[s:]), make_mesh(self.sampler_mesh, pool[:s]))


def _supports_memory(mesh, kind: str) -> bool:
    dev = mesh.devices.flat[0]
    return dev.platform != "cpu" and any(m.kind == kind for m in dev.addressable_memories())


class ShardedStep(SegmentRunner):
    """``step`` (a composed ``Stage``, e.g. ``make_grpo_step(...)``) run on ``mesh``.

    ``state`` (a ``TrainState``, possibly abstract) fixes the shardings; ``place(state)`` lays a
    state out for it; then ``state, batch = sharded(state, batch)`` like the step itself (the
    ``segments`` are compatible with ``relax.algorithms.grpo.run``'s timing loop). Jitted segments donate
    the state like ``compose`` does: use the returned state.
    """

    def __init__(
        self,
        step: Stage,
        state: Any,
        mesh: jax.sharding.Mesh,
        *,
        rules: Rules = DEFAULT_RULES,
        sampler_mesh: jax.sharding.Mesh | None = None,
        offload_reference: bool = False,
    ):
        self.mesh, self.sampler_mesh, self.rules = mesh, sampler_mesh, rules
        if offload_reference and state.ref is not None and not _supports_memory(mesh, HOST_MEMORY):
            warnings.warn(
                f"offload_reference: {mesh.devices.flat[0].platform} devices have no separate "
                f"{HOST_MEMORY} memory; the reference stays where it is",
                stacklevel=2,
            )
            offload_reference = False
        if offload_reference and state.ref is None:
            warnings.warn(
                "offload_reference: the state has no reference model (e.g. beta = 0), so there is "
                "nothing to offload",
                stacklevel=2,
            )
        self.offload = offload_reference and state.ref is not None
        self._with_ref = state_shardings(state, mesh, rules)
        self.state_shardings = (
            state_shardings(state, mesh, rules, reference_memory_kind=HOST_MEMORY)
            if self.offload
            else self._with_ref
        )
        if self.offload:
            self._no_ref = state_shardings(state.replace(ref=None), mesh, rules)
            self._ref_device = param_shardings(state.ref, mesh, rules)
            self._ref_host = param_shardings(state.ref, mesh, rules, memory_kind=HOST_MEMORY)
        self._sampler_policy = None
        self._process_copy = None
        if sampler_mesh is not None:
            self._sampler_params = param_shardings(state.policy, sampler_mesh, rules)
            self._view_shardings = state_shardings(
                state.replace(opt_state=None, ref=None), sampler_mesh, rules
            )
        self.segments = self._plan(step.leaves)

    # ------------------------------------------------------------------ public

    def place(self, state: Any) -> Any:
        """``state`` laid out on the trainer mesh (host arrays are copied; on several processes
        every process must pass the same values)."""
        return distributed.put(state, self.state_shardings)

    @property
    def sampler_policy(self):
        """The sampler's copy of the policy (None before the first step or without a sampler mesh)."""
        return self._sampler_policy

    # ------------------------------------------------------------------ plan

    def _on_sampler(self, leaf: Stage) -> bool:
        return self.sampler_mesh is not None and leaf.placement == "sampler"

    def _plan(self, leaves: tuple[Stage, ...]) -> tuple[Segment, ...]:
        segments, transferred = [], False
        for group in group_leaves(leaves, key=self._on_sampler):
            on_sampler = self._on_sampler(group[0])
            if on_sampler and not transferred:
                segments.append(
                    Segment(
                        names=("weight_transfer",),
                        jittable=False,
                        run=self._transfer,
                        updates_state=False,
                        keeps_batch=True,
                    )
                )
                transferred = True
            segments.append(self._segment(group, on_sampler))
        return tuple(segments)

    def _segment(self, group: list[Stage], on_sampler: bool) -> Segment:
        """One group's segment: a host stage (on the sampler: reading its copy of the policy) or
        a jitted program on the sampler or trainer mesh."""
        names = tuple(s.name for s in group)
        updates = any(s.updates_state for s in group)
        if not group[0].jittable:
            run = self._host(group[0].fn)
            if on_sampler:
                run = self._sampler_host(run)
            elif group[0].placement == "process" and distributed.multi_process():
                run = self._process_host(run)
            return Segment(
                names=names,
                jittable=False,
                run=run,
                updates_state=updates,
                waits=group[0].waits,
            )
        make = self._sampler_segment if on_sampler else self._trainer_segment
        jitted, run, abstract = make(group)
        return Segment(
            names=names,
            jittable=True,
            run=run,
            jitted=jitted,
            updates_state=updates,
            abstract=abstract,
        )

    @staticmethod
    def _split(batch) -> tuple[Any, Any]:
        host, dev = split_host(batch)
        if prompt_rows(dev) is None:
            raise ShardingError(
                "a sharded step needs a batch with prompt_ids (the prompt axis) or packed rows (ids)"
            )
        return host, dev

    @staticmethod
    def _program(group: list[Stage], mesh, shardings):
        """The group's jitted function with its outputs pinned: the state to ``shardings``, batch
        arrays to the batch rule; ``(fn, updates_state)`` as ``relax.compose.batch_only``."""
        fn, updates = batch_only(group)

        def program(state, batch):
            rows = prompt_rows(batch)
            if not updates:
                return constrain_batch(fn(state, batch), mesh, rows)
            state, batch = fn(state, batch)
            return jax.lax.with_sharding_constraint(state, shardings), constrain_batch(
                batch, mesh, rows
            )

        return program, updates

    def _trainer_segment(self, group: list[Stage]):
        uses_ref = self.offload and any(s.reads_reference for s in group)
        shardings = self._no_ref if self.offload and not uses_ref else self._with_ref
        program, updates = self._program(group, self.mesh, shardings)
        donate = (0,) if updates and all(s.donate_state for s in group) else ()
        jitted = jax.jit(program, donate_argnums=donate)
        call = jitted if updates else keep_state(jitted)

        def run(state, batch):
            host, dev = self._split(batch)
            dev = place_batch(dev, self.mesh)
            if self.offload:
                ref_host = state.ref
                state = state.replace(
                    ref=jax.device_put(ref_host, self._ref_device) if uses_ref else None
                )
            with jax.set_mesh(
                self.mesh
            ):  # traced under the mesh: see parallel.ambient_batch_shards
                state, out = call(state, dev)
            if updates:  # the rule's shardings, not the compiler's spelling of them (no copy)
                state = jax.tree.map(distributed.laid_out_as, state, shardings)
            if self.offload:
                state = state.replace(
                    ref=jax.device_put(state.ref, self._ref_host) if uses_ref else ref_host
                )
            return state, join_host(host, out, batch)

        def abstract(state, batch):
            _, dev = self._split(batch)
            if self.offload:  # the reference is on the devices only for the segments that read it
                state = state.replace(ref=state.ref if uses_ref else None)
            return _typed(state, shardings), _typed_batch(dev, self.mesh)

        return jitted, run, abstract

    def _sampler_segment(self, group: list[Stage]):
        program, updates = self._program(group, self.sampler_mesh, self._view_shardings)
        jitted = jax.jit(program)

        def run(state, batch):
            host, dev = self._split(batch)
            dev = place_batch(dev, self.sampler_mesh)
            small = jax.device_put(
                state.replace(**dict.fromkeys(MODEL_FIELDS)), replicated(self.sampler_mesh)
            )
            with jax.set_mesh(self.sampler_mesh):
                if not updates:  # the state stays as it is (and where it is)
                    return state, join_host(
                        host, jitted(small.replace(policy=self._sampler_policy), dev), batch
                    )
                view, out = jitted(small.replace(policy=self._sampler_policy), dev)
            changed = {
                f.name: jax.device_put(getattr(view, f.name), replicated(self.mesh))
                for f in dataclasses.fields(view)
                if f.name not in MODEL_FIELDS
            }
            return state.replace(**changed), join_host(host, out, batch)

        def abstract(state, batch):
            _, dev = self._split(batch)
            view = state.replace(**dict.fromkeys(MODEL_FIELDS))
            shardings = jax.tree.map(lambda _: replicated(self.sampler_mesh), view).replace(
                policy=self._sampler_params
            )
            return _typed(view.replace(policy=state.policy), shardings), _typed_batch(
                dev, self.sampler_mesh
            )

        return jitted, run, abstract

    def _transfer(self, state, batch):
        """Reshard the trainer's policy into the sampler's layout (the old copy is freed first)."""
        if self._sampler_policy is not None:
            for x in jax.tree.leaves(self._sampler_policy):
                x.delete()
        self._sampler_policy = jax.block_until_ready(
            jax.device_put(state.policy, self._sampler_params)
        )
        return state, batch

    def _sampler_host(self, run):
        """A host stage placed on the sampler (partial rollouts, ``relax.rollout.partial``) reads
        the sampler's copy of the policy; it only reads the state, so the caller's goes on."""

        def on_sampler(state, batch):
            _, out = run(state.replace(policy=self._sampler_policy), batch)
            return state, out

        return on_sampler

    def _process_host(self, run):
        """A host stage placed on each process (``placement="process"``) samples this process's
        rows on its own copy of the policy (``relax.parallel.local``); it only reads the state."""

        def on_process(state, batch):
            _, out = run(self.process_view(state), batch)
            return state, out

        return on_process

    def process_view(self, state):
        """The state a host stage placed on each process (``placement="process"``) gets: on
        several processes one with this process's copy of the policy (``ProcessCopy.view``),
        else ``state`` itself."""
        if not distributed.multi_process():
            return state
        if self._process_copy is None:
            self._process_copy = ProcessCopy(self.mesh, self.rules)
        return self._process_copy.view(state)

    @staticmethod
    def _host(fn):
        """Host stages see this process's rows as numpy; arrays they pass through unchanged go
        back as the global arrays they were."""

        def run(state, batch):
            if not distributed.multi_process():
                return fn(state, batch)
            originals: dict[int, Any] = {}

            def local(x):
                if distributed.is_global(x):
                    y = distributed.to_local(x)
                    originals[id(y)] = x
                    return y
                return x

            back = lambda x: originals.get(id(x), x)  # noqa: E731
            if isinstance(batch, WithHost):  # the host record stays as it is
                state, out = fn(state, batch.replace(device=jax.tree.map(local, batch.device)))
                return state, out.replace(device=jax.tree.map(back, out.device))
            state, out = fn(state, jax.tree.map(local, batch))
            return state, jax.tree.map(back, out)

        return run


def _typed(tree: Any, shardings: Any) -> Any:
    """``tree``'s arrays (or ``ShapeDtypeStruct`` s) as ``ShapeDtypeStruct`` s with ``shardings``."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _typed_batch(batch: Any, mesh: jax.sharding.Mesh) -> Any:
    """A (global) batch's arrays as ``ShapeDtypeStruct`` s with the batch rule's shardings."""
    rows = prompt_rows(batch)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=batch_leaf_sharding(x, mesh, rows)
        ),
        batch,
    )


def check_batch(
    batch_size: int, mesh: jax.sharding.Mesh | None, what: str = "--batch-size"
) -> None:
    """``ShardingError`` unless ``batch_size`` prompts split over the mesh's batch axes (data x fsdp x expert)."""
    if mesh is not None and batch_size % batch_shards(mesh):
        raise ShardingError(
            f"{what}={batch_size} prompts do not split over {batch_axes_text(mesh)} = "
            f"{batch_shards(mesh)} shards"
        )
