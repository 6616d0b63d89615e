"""The service's operations over its sessions, without HTTP (``relax.serve.server`` serves them).

    service = Service(base, tokenizer, ServiceConfig(model="...", state_dir="serve"))
    sid = service.create_session({"rank": 8})["session"]
    service.forward_backward(sid, {"data": [...], "loss_fn": "cross_entropy"})

Every operation takes and returns msgpack-able maps (``relax.serve.wire``). Files go under
``state_dir`` only: ``states/<name>`` (``save_state``: a session's adapters, optimizer state and
step, through ``relax.train.checkpoint.Checkpointer``, with ``session.json``: the LoRA config and
seed it was created with) and ``weights/<name>`` (``save_weights``: PEFT adapters or a merged
Hugging Face model); a name is ``[A-Za-z0-9][A-Za-z0-9_.-]*`` and an existing one is refused, so
nothing saved is overwritten. A save is written into a hidden directory beside its name
(``.<name>.partial-<random>``) and renamed to it once complete: a save that fails (a full disk:
507) leaves nothing and its name free. ``load_state`` reads only from ``states/``. Pending
gradients and sampler snapshots are not part of a saved state.

Bounds (``ServiceLimits``, ``relax.serve.limits``): at most ``max_sessions`` sessions (429), of
LoRA rank at most ``max_lora_rank`` (413), each created only when its memory estimate fits what
the devices have free (413; ``relax.serve.memory``); a session's requests are bounded in
``relax.serve.session``. Every map in a request has string keys, every path and name is a
string without NUL (400 naming the field).
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import logging
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax

from relax.models.adapters.operations import add_lora, merge_lora, split_trainable
from relax.models.adapters.peft import save_adapter
from relax.models.decoder.transformer import Transformer
from relax.models.hf.checkpoint import save_pretrained
from relax.models.layers.lora import LoRAConfig
from relax.parallel.mesh import make_mesh, shard_model
from relax.serve import memory
from relax.serve.datum import DATUM_LOSSES
from relax.serve.limits import ServiceLimits, over
from relax.serve.numerics import SEED_END, check_keys, float32, integer, text
from relax.serve.objectives import OBJECTIVES
from relax.serve.programs import ProgramCache
from relax.serve.session import Bounds, Session
from relax.serve.wire import RequestError
from relax.train.checkpoint import Checkpointer

__all__ = ["Service", "ServiceConfig", "UnknownSession"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
_SESSION_FILE = "session.json"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
log = logging.getLogger("relax.serve")


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """What the service serves: ``model`` (a name for clients and PEFT's ``base_model_name_or_path``),
    ``lora`` (the default adapters of a new session; ``rank=0`` trains every weight: one full
    copy per session) and ``state_dir`` (where saves go)."""

    model: str
    state_dir: str
    lora: LoRAConfig = LoRAConfig(rank=8)
    mesh: str | None = (
        None  # the devices' mesh, e.g. "fsdp=-1" (relax.parallel.mesh.make_mesh); None: one device
    )
    samplers_kept: int = (
        4  # a session's newest sampler snapshots kept in memory (older ones are dropped)
    )
    limits: ServiceLimits = ServiceLimits()


class UnknownSession(KeyError):
    pass


def _disk_full(e: BaseException | None) -> OSError | None:
    """The full-disk ``OSError`` (ENOSPC, EDQUOT) that ``e`` is or was raised from, if any."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return e
        e = e.__cause__ or e.__context__
    return None


def _boolean(field: str, v) -> None:
    if not isinstance(v, bool):
        raise RequestError(field, f"true or false, got {v!r}")


def _names(field: str, v) -> None:
    if not isinstance(v, list) or not all(isinstance(x, str) and len(x) <= 64 for x in v):
        raise RequestError(field, "a list of module names is needed")


_LORA_CHECKS: dict[str, Callable] = {  # every LoRAConfig field, checked as sent
    "rank": lambda k, v: integer(k, v, 0, 2**31),
    "alpha": lambda k, v: float32(k, v, low=0, open_low=True),
    "dropout": lambda k, v: float32(k, v, low=0, high=1, open_high=True),
    "target_modules": _names,
    "init": lambda k, v: text(k, v, max_chars=64),
    "use_rslora": _boolean,
    "dtype": lambda k, v: text(k, v, max_chars=64),
    "vision": lambda k, v: _no_tower(k, v),
}


def _no_tower(field: str, v) -> None:
    """The service trains text models: adapters on a vision tower are refused."""
    _boolean(field, v)
    if v:
        raise RequestError(field, "false: the service trains text models (no vision tower)")


class Service:
    def __init__(self, base: Transformer, tokenizer, cfg: ServiceConfig):
        self.mesh = None if cfg.mesh is None else make_mesh(cfg.mesh)
        self.base = base if self.mesh is None else shard_model(base, self.mesh)
        self.tokenizer, self.cfg = tokenizer, cfg
        devices = tuple(self.mesh.devices.flat) if self.mesh is not None else (jax.devices()[0],)
        self.bounds = Bounds(cfg.limits, devices, ProgramCache(cfg.limits.max_programs))
        self.sessions: dict[str, Session] = {}
        self._base: Session | None = None  # base-model sampling (_base_session)
        self._ids = itertools.count(1)
        self.root = Path(cfg.state_dir).resolve()

    # ------------------------------------------------------------------ sessions

    def info(self) -> dict:
        c = self.base.config
        return {
            "model": self.cfg.model,
            "family": c.family,
            "vocab_size": c.vocab_size,
            "max_positions": c.max_position_embeddings,
            "eos_ids": list(c.eos_ids),
            "lora_rank": self.cfg.lora.rank,
            "datum_losses": list(DATUM_LOSSES),
            "objectives": sorted(OBJECTIVES),
            "sessions": len(self.sessions),
            "samplers_kept": self.cfg.samplers_kept,
            "limits": dataclasses.asdict(self.cfg.limits),
            "programs": {
                "cached": len(self.bounds.programs),
                "compiled": self.bounds.programs.compiles,
                "evicted": self.bounds.programs.evictions,
            },
        }

    def session(self, sid: str) -> Session:
        if sid not in self.sessions:
            raise UnknownSession(sid)
        return self.sessions[sid]

    def _lora(self, request: dict) -> LoRAConfig:
        fields = {f.name: f for f in dataclasses.fields(LoRAConfig)}
        options = {k: v for k, v in request.items() if k not in ("seed", "value_head")}
        if set(options) - set(fields):
            raise RequestError(
                sorted(set(options) - set(fields))[0],
                f"a session takes seed, value_head and LoRA options ({', '.join(sorted(fields))})",
            )
        for k, v in options.items():
            _LORA_CHECKS[k](k, v)
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
        try:
            lora = dataclasses.replace(self.cfg.lora, **options)
        except (TypeError, ValueError) as e:
            raise RequestError("lora", str(e)) from None
        limit = self.cfg.limits.max_lora_rank
        if lora.rank > limit:
            raise over("rank", "LoRA rank", lora.rank, "max_lora_rank", limit)
        return lora

    def _trained_bytes(self, lora: LoRAConfig) -> int:
        """Bytes a session of ``lora`` trains, from the adapters' shapes (nothing allocated)."""
        if not lora.enabled:
            return memory.tree_bytes(self.base)
        shapes = jax.eval_shape(lambda: add_lora(self.base, lora, jax.random.key(0)))
        return memory.tree_bytes(split_trainable(shapes)[0])

    def create_session(self, request: dict) -> dict:
        check_keys(request, "")
        seed = integer("seed", request.get("seed", 0), 0, SEED_END)
        value_head = request.get("value_head", False)
        if not isinstance(value_head, bool):
            raise RequestError("value_head", f"true or false, got {value_head!r}")
        lora = self._lora(request)
        limits = self.cfg.limits
        if len(self.sessions) >= limits.max_sessions:
            raise over(
                "session",
                "sessions held",
                len(self.sessions) + 1,
                "max_sessions",
                limits.max_sessions,
                status=429,
            )
        need = memory.session_bytes(self._trained_bytes(lora), self.cfg.samplers_kept)
        self.bounds.fits("rank", need, f"a session of LoRA rank {lora.rank} (estimated)")
        sid = f"s{next(self._ids)}-{secrets.token_hex(4)}"  # never an id from before a restart
        self.sessions[sid] = Session.create(
            sid, self.base, lora, seed, self.bounds, self.mesh, value_head=value_head
        )
        return {"session": sid, "lora": dataclasses.asdict(lora), "value_head": value_head}

    def close_session(self, sid: str) -> dict:
        self.sessions.pop(sid, None)
        return {"closed": sid}

    # ------------------------------------------------------------------ training

    def forward_backward(self, sid: str, request: dict, *, backward: bool = True) -> dict:
        check_keys(request, "")
        metrics, outputs = self.session(sid).forward_backward(request, backward=backward)
        return {"metrics": metrics, "loss_fn_outputs": outputs}

    def optim_step(self, sid: str, request: dict) -> dict:
        check_keys(request, "")
        return {"metrics": self.session(sid).optim_step(request.get("adam_params"))}

    def save_weights_for_sampler(self, sid: str, request: dict) -> dict:
        check_keys(request, "")
        name = self._name(request)
        self.session(sid).snapshot(name, self.cfg.samplers_kept)
        return {"path": f"session:{sid}/sampler/{name}"}

    def sample(self, request: dict) -> dict:
        check_keys(request, "")
        path = request.get("model_path")
        if path is not None:
            text("model_path", path)
        if path == "base":
            policy, session = self.base, None
        else:
            m = re.fullmatch(r"session:([A-Za-z0-9-]+)/sampler/(.+)", path or "")
            if m is None:
                raise RequestError(
                    "model_path", f"'base' or a path of save_weights_for_sampler, got {path!r}"
                )
            session = self.session(m.group(1))
            if m.group(2) not in session.samplers:
                raise RequestError(
                    "model_path",
                    f"session {m.group(1)} holds no sampler weights {m.group(2)!r}: never "
                    f"saved, or dropped (a session keeps its newest "
                    f"{self.cfg.samplers_kept}; {session.evicted} dropped so far)",
                )
            policy = session.samplers[m.group(2)]
        sequences = (session or self._base_session()).sample(policy, request)
        return {"sequences": sequences}

    def _base_session(self) -> Session:
        """The holder of the base model's sampling draws: no adapters, no state to train (so no
        optimizer moments of the whole base just to sample it), not a client's session."""
        if self._base is None:
            self._base = Session("base", LoRAConfig(rank=0), 0, state=None, bounds=self.bounds)
        return self._base

    # ------------------------------------------------------------------ files

    def _name(self, request: dict) -> str:
        name = request.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RequestError(
                "name", f"a name of letters, digits, '_', '.', '-' is needed, got {name!r}"
            )
        return name

    def _new_dir(self, kind: str, request: dict) -> Path:
        path = self.root / kind / self._name(request)
        if path.exists():
            raise RequestError(
                "name", f"{path} exists: saves are never overwritten; choose another name"
            )
        return path

    def _save(self, kind: str, request: dict, write: Callable[[Path], None]) -> dict:
        """``write(directory)`` into a hidden directory beside ``<kind>/<name>``, renamed to it once
        complete; on failure the directory is removed (a full disk: 507) and the name stays free."""
        path = self._new_dir(kind, request)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.parent / f".{path.name}.partial-{secrets.token_hex(4)}"
        try:
            write(partial)
            partial.rename(path)
        except BaseException as e:
            shutil.rmtree(partial, ignore_errors=True)
            full = _disk_full(e)
            if full is None:
                raise
            log.warning("save of %s failed: %s", path, full)
            raise RequestError(
                "name",
                f"saving {path.name} failed ({full.strerror}): nothing was kept and the name is "
                "free; free disk space on the server and save again",
                status=507,
            ) from None
        return {"path": str(path)}

    def save_state(self, sid: str, request: dict) -> dict:
        check_keys(request, "")
        s = self.session(sid)
        about = {"lora": dataclasses.asdict(s.lora), "seed": s.seed}

        def write(path: Path) -> None:
            with Checkpointer(path, max_to_keep=None, async_save=False) as ckpt:
                ckpt.save(int(s.state.step), s.state, config=about, force=True)
            (path / _SESSION_FILE).write_text(
                json.dumps(
                    {
                        **about,
                        "value_head": s.value_head,
                        "step": int(s.state.step),
                        "model": self.cfg.model,
                    }
                )
            )

        return self._save("states", request, write)

    def _state_dir(self, request: dict) -> Path:
        check_keys(request, "")
        path = text("path", request.get("path"))
        resolved = Path(path).resolve()
        if resolved.parent != self.root / "states" or not (resolved / _SESSION_FILE).is_file():
            raise RequestError(
                "path",
                f"a path returned by save_state (under {self.root / 'states'}), got {path!r}",
            )
        return resolved

    def load_state(self, sid: str, request: dict) -> dict:
        s, path = self.session(sid), self._state_dir(request)
        try:
            with Checkpointer(path, async_save=False) as ckpt:
                state, _, _ = ckpt.restore(target=s.state)
        except (ValueError, FileNotFoundError) as e:  # another LoRA shape, another base, damage
            raise RequestError("path", str(e)) from None
        s.state, s.pending = state, None
        return {"step": int(state.step)}

    def create_session_from_state(self, request: dict) -> dict:
        path = self._state_dir(request)
        try:
            saved = json.loads((path / _SESSION_FILE).read_text())
            options = {**saved["lora"], "seed": saved["seed"]}
            options["value_head"] = saved.get("value_head", False)
        except (ValueError, KeyError, TypeError) as e:
            raise RequestError("path", f"{path / _SESSION_FILE} is damaged: {e!r}") from None
        created = self.create_session(options)
        try:
            loaded = self.load_state(created["session"], request)
        except RequestError:
            self.sessions.pop(created["session"])
            raise
        return {**created, **loaded}

    def save_weights(self, sid: str, request: dict) -> dict:
        check_keys(request, "")
        fmt = request.get("format", "peft")
        if not isinstance(fmt, str) or fmt not in ("peft", "hf"):
            raise RequestError(
                "format", f"'peft' (the adapters) or 'hf' (the merged model), got {fmt!r}"
            )
        s = self.session(sid)
        if fmt == "peft" and not s.lora.enabled:
            raise RequestError(
                "format", "the session trains every weight (rank 0): it has no adapters; use 'hf'"
            )
        policy = s.state.policy
        if fmt == "hf" and s.lora.enabled:  # the merged copy of the whole model
            self.bounds.fits("format", memory.tree_bytes(self.base), "a merged copy of the model")

        def write(path: Path) -> None:
            if fmt == "peft":
                save_adapter(policy, path, base_model_name_or_path=self.cfg.model)
                return
            save_pretrained(merge_lora(policy) if s.lora.enabled else policy, path)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(path)

        return self._save("weights", request, write)

    def tokenizer_files(self) -> dict:
        """The tokenizer's files, name -> bytes (``relax.text.load_tokenizer`` reads them back)."""
        if self.tokenizer is None:
            raise RequestError("tokenizer", "the service was started without a tokenizer")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(self.tokenizer.save_pretrained(tmp))
            return {"files": {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}}
