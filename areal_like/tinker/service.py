"""The Tinker API's state and operations, apart from HTTP: sessions (kept alive by heartbeats,
reaped when they stop), training models (their calls run in `seq_id` order), checkpoints on
disk, and sampling sessions. `areal_like.tinker.app` maps the routes onto this."""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from areal_like.tinker import fields, losses, runs
from areal_like.tinker.callers import CALLER, callers, json_digest, model_seq_id, seq_id_of
from areal_like.tinker.errors import Conflict, Gone, NotFound, UserError
from areal_like.tinker.futures import FutureStore, Result
from areal_like.tinker.lora_shape import LoRAShape
from areal_like.tinker.ranks import TrainerRanks
from areal_like.tinker.sampling import FleetSampler
from areal_like.tinker.trainer import check_data
from areal_like.tinker.wire import ForwardBackwardCall, encode_forward_backward_output

logger = logging.getLogger(__name__)
WEIGHTS, SAMPLER_WEIGHTS = "weights", "sampler_weights"
MAX_NUM_SAMPLES = 128  # one asample's num_samples: more is a caller's mistake, not a job


@dataclass
class ServiceConfig:
    model_name: str  # what clients call the base model (also accepted: its path)
    model_path: str
    storage_dir: str  # checkpoints: <storage>/<model id>/<weights|sampler_weights>/<name>
    max_lora_rank: int  # the servers' (--max-lora-rank)
    max_models: int = 4  # training models alive at once (each holds its own engine)
    session_timeout_s: float = 120.0  # no heartbeat for this long: the session is reaped
    seq_gap_timeout_s: float = 300.0  # an earlier seq_id missing this long is skipped
    max_tokens_per_datum: int = 4096  # the trainer's micro-batch budget (a datum fits one)
    vocab_size: int = 0


@dataclass
class Session:
    id: str
    last_seen: float
    owner: str = ""  # the fingerprint of the key that created it
    models: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)


@dataclass
class Model:
    id: str
    session_id: str
    lora: LoRAShape
    user_metadata: dict[str, Any]
    next_seq: int = 1
    waiting: dict[int, tuple[str, Callable[[], Awaitable[Result]], float]] = field(
        default_factory=dict)  # seq_id -> (request id, the call, when it arrived)
    request_ids: dict[int, str] = field(default_factory=dict)  # seq_id -> request id
    digests: dict[int, str] = field(default_factory=dict)  # seq_id -> its request's digest
    last_request: float = field(default_factory=time.time)


class TinkerService:
    def __init__(self, config: ServiceConfig, ranks: TrainerRanks, sampler: FleetSampler) -> None:
        self.config, self.ranks, self.sampler = config, ranks, sampler
        self.futures = FutureStore()
        self.sessions: dict[str, Session] = {}
        self.finished: set[str] = set()
        self.models: dict[str, Model] = {}
        # sampling session id -> (its session, the checkpoint it samples; None: the base)
        self.sampling_sessions: dict[str, tuple[str, Optional[str]]] = {}
        self._ids = itertools.count(1)
        self.reaped = 0

    # ---- sessions -----------------------------------------------------------------------
    def create_session(self) -> str:
        session_id = f"session-{next(self._ids)}-{os.urandom(8).hex()}"
        self.sessions[session_id] = Session(session_id, time.monotonic(), CALLER.get())
        return session_id

    def session(self, session_id: str) -> Session:
        """The caller's session `session_id` (another key's is answered as unknown)."""
        session = self.sessions.get(session_id)
        if session is None or session.owner != CALLER.get():
            if session_id in self.finished:
                raise Gone(f"session {session_id!r} has finished")
            raise NotFound(f"no session {session_id!r}")
        session.last_seen = time.monotonic()
        return session

    async def finish_callers_session(self, session_id: str) -> None:
        """The client's close: its own session only (another key's is unknown to it); one
        that has already ended is fine."""
        session = self.sessions.get(session_id)
        if session is not None and session.owner != CALLER.get():
            raise NotFound(f"no session {session_id!r}")
        await self.finish_session(session_id, "finished by the client")

    async def finish_session(self, session_id: str, why: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        self.finished.add(session_id)
        for sampler_id in session.samplers:
            self.sampling_sessions.pop(sampler_id, None)
        models = [m for m in (self.models.pop(i, None) for i in sorted(session.models)) if m]
        for model in models:
            for request_id, _, _ in model.waiting.values():
                self.futures.fail(request_id, Gone(f"session {session_id} ended ({why})"))
        dropped = await asyncio.gather(*(self.ranks.submit("drop", m.id) for m in models),
                                       return_exceptions=True)
        for model, error in zip(models, dropped, strict=True):
            if isinstance(error, BaseException):
                logger.error("freeing model %s failed: %r", model.id, error)
        logger.info("session %s ended (%s): %d model(s) released", session_id, why,
                    len(session.models))

    async def reap(self) -> None:
        """Sessions without a heartbeat for session_timeout_s end. A seq_id a model's calls
        have waited for seq_gap_timeout_s is skipped (its submission failed on the client:
        the SDK goes on with the next call, and so do we)."""
        now = time.monotonic()
        for session in list(self.sessions.values()):
            if now - session.last_seen > self.config.session_timeout_s:
                self.reaped += 1
                await self.finish_session(session.id, f"no heartbeat for "
                                          f"{self.config.session_timeout_s:.0f} s")
        for model in list(self.models.values()):
            waited = [now - since for _, _, since in model.waiting.values()]
            if waited and max(waited) > self.config.seq_gap_timeout_s:
                first = min(model.waiting)
                logger.warning("model %s: seq_id %d..%d never arrived within %.0f s: skipped",
                               model.id, model.next_seq, first - 1,
                               self.config.seq_gap_timeout_s)
                model.next_seq = first
                self._start_ready(model)

    # ---- models -------------------------------------------------------------------------
    def check_base_model(self, base_model: Optional[str]) -> None:
        if base_model not in (None, self.config.model_name, self.config.model_path):
            raise UserError(f"base_model {base_model!r} is not served here; this server "
                            f"trains {self.config.model_name!r}")

    def create_model(self, body: dict[str, Any]) -> str:
        session = self.session(str(body.get("session_id")))
        self.check_base_model(body.get("base_model"))
        lora = fields.mapping(body, "lora_config")
        rank = fields.integer(lora, "lora_config.rank", 32)
        if not 1 <= rank <= self.config.max_lora_rank:
            raise UserError(f"lora_config.rank={rank}: this server serves LoRA ranks 1.."
                            f"{self.config.max_lora_rank} (tinker-serve --max-lora-rank)")
        optimizer = fields.mapping(body, "optimizer_config")
        if optimizer.get("type", "adamw") != "adamw":
            raise UserError(f"optimizer_config.type={optimizer.get('type')!r}: only adamw")
        shape = LoRAShape(rank, *(fields.flag(lora, f"lora_config.train_{part}", True)
                                  for part in ("attn", "mlp", "unembed")))
        model_id = f"{session.id}:train:{model_seq_id(body)}"
        request_id = self.futures.create("CreateModel")
        self.futures.watch(request_id, self._add_model(session, model_id, shape,
                                                       fields.mapping(body, "user_metadata")))
        return request_id

    async def _add_model(self, session: Session, model_id: str, shape: LoRAShape,
                         metadata: dict[str, Any]) -> Result:
        if model_id in self.models:
            raise Conflict(f"model {model_id!r} exists already")
        if len(self.models) >= self.config.max_models:
            raise UserError(f"{len(self.models)} training models are alive, the most this "
                            f"server holds (tinker-serve --max-models); finish a session first")
        if not shape.target_modules:
            raise UserError("lora_config: train_attn, train_mlp and train_unembed are all "
                            "false: no layer would get an adapter")
        self.models[model_id] = Model(model_id, session.id, shape, metadata)
        session.models.add(model_id)
        try:
            await self.ranks.submit("create", model_id, shape)
        except BaseException:
            self.models.pop(model_id, None)
            session.models.discard(model_id)
            raise
        return {"model_id": model_id, "type": "create_model"}

    def model(self, model_id: str) -> Model:
        """The caller's model `model_id` (another key's is answered as unknown)."""
        model = self.models.get(model_id)
        session = self.sessions.get(model.session_id) if model is not None else None
        if model is None or (session is not None and session.owner != CALLER.get()):
            raise NotFound(f"no model {model_id!r} (create_model first; a model lives as "
                           f"long as its session)")
        self.session(model.session_id)
        return model

    def info(self, model_id: str) -> dict[str, Any]:
        model = self.model(model_id)
        return {"model_id": model_id, "type": "get_info", "is_lora": True,
                "lora_rank": model.lora.rank, "model_name": self.config.model_name,
                "model_data": {"arch": "causal_lm", "model_name": self.config.model_name,
                               "tokenizer_id": self.config.model_path}}

    # ---- ordered training calls ---------------------------------------------------------
    def enqueue(self, model_id: str, seq_id: int, kind: str,
                call: Callable[[], Awaitable[Result]], digest: str) -> str:
        """The call's future; it runs once every earlier seq_id of the model has been
        started. The same request again under its seq_id (`digest` equal: an SDK retry) gets
        the first one's future; another request under a used seq_id is refused."""
        model = self.model(model_id)
        model.last_request = time.time()
        if seq_id in model.request_ids:
            if model.digests.get(seq_id) == digest:
                return model.request_ids[seq_id]
            raise Conflict(f"model {model_id}: seq_id {seq_id} was used by another request "
                           f"(a retry repeats the same request; next seq_id is "
                           f"{max(model.request_ids) + 1})")
        if seq_id < model.next_seq:
            raise UserError(f"model {model_id}: seq_id {seq_id} was used already (next is "
                            f"{model.next_seq})")
        request_id = self.futures.create(kind)
        model.request_ids[seq_id] = request_id
        model.digests[seq_id] = digest
        model.waiting[seq_id] = (request_id, call, time.monotonic())
        self._start_ready(model)
        return request_id

    def _start_ready(self, model: Model) -> None:
        """Start the calls whose turn it is. Each starts synchronously (its checks, then its
        trainer call queued), so the trainer queue keeps the seq_id order; a call whose
        checks fail fails alone (its seq_id is used: the next ones still run)."""
        while model.next_seq in model.waiting:
            ready_id, ready, _ = model.waiting.pop(model.next_seq)
            model.next_seq += 1
            try:
                work = ready()
            except Exception as e:  # reported through the call's future
                self.futures.fail(ready_id, e)
                continue
            self.futures.watch(ready_id, work)

    def forward_backward(self, call: ForwardBackwardCall, digest: str) -> str:
        def run() -> Awaitable[Result]:
            if call.refused is not None:  # (a bad datum: refused in its turn, seq_id used)
                raise UserError(call.refused)
            config = losses.check_loss(call.loss_fn, call.config)
            check_data(call.data, call.loss_fn, self.config.vocab_size,
                       self.config.max_tokens_per_datum)
            done = self.ranks.submit("forward_backward", call.model_id, call.data,
                                     call.loss_fn, config, call.forward_only)

            async def encode() -> Result:
                outputs, metrics = await done
                return encode_forward_backward_output(outputs, metrics)
            return encode()
        kind = "Forward" if call.forward_only else "ForwardBackward"
        return self.enqueue(call.model_id, call.seq_id, kind, run, digest)

    def optim_step(self, body: dict[str, Any]) -> str:
        model_id = str(body.get("model_id"))

        def run() -> Awaitable[Result]:
            adam = fields.adam_params(body.get("adam_params"))
            done = self.ranks.submit("optim_step", model_id, adam)

            async def result() -> Result:
                return {"metrics": await done, "type": "optim_step"}
            return result()
        return self.enqueue(model_id, seq_id_of(body), "OptimStep", run, json_digest(body))

    # ---- checkpoints ----------------------------------------------------------------------
    def folder(self, model_id: str, kind: str, name: str) -> str:
        if not name or "/" in name or "\x00" in name or name in (".", "..") \
                or len(name.encode()) > 200:
            raise UserError(f"checkpoint name {name[:80]!r}: a name of 1-200 bytes without "
                            f"'/' (nor '.' or '..')")
        return os.path.join(self.config.storage_dir, model_id.replace(":", "_"), kind, name)

    def parse_path(self, path: str) -> tuple[str, str, str]:
        """(model id, kind, name) of tinker://<model id>/<kind>/<name>."""
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") \
            else []
        if len(parts) != 3 or parts[1] not in (WEIGHTS, SAMPLER_WEIGHTS):
            raise UserError(f"checkpoint path {path!r}: expected tinker://<model id>/"
                            f"<weights|sampler_weights>/<name>")
        folder = self.folder(*parts)
        if not os.path.isdir(folder) or not callers(runs.checkpoint_owner(folder)):
            raise NotFound(f"no checkpoint {path!r} on this server")
        return parts[0], parts[1], parts[2]

    def _callers_run(self, run_id: str) -> bool:
        """Whether training run `run_id` is the caller's: its live model's session's key, else
        the one its newest checkpoint records."""
        model = self.models.get(run_id)
        session = self.sessions.get(model.session_id) if model is not None else None
        return callers(session.owner if session is not None else runs.run_owner(
            self.config.storage_dir, run_id))

    def save_weights(self, body: dict[str, Any]) -> str:
        model_id, name = str(body.get("model_id")), str(body.get("path") or "")
        model = self.model(model_id)

        def run() -> Awaitable[Result]:
            folder = self.folder(model_id, WEIGHTS, name)
            if os.path.exists(folder) and not body.get("overwrite", False):
                raise Conflict(f"checkpoint {name!r} of {model_id} exists (overwrite=True)")
            done = self.ranks.submit("save_state", model_id, folder)

            async def result() -> Result:
                self._write_meta(model, folder, await done)
                return {"path": f"tinker://{model_id}/{WEIGHTS}/{name}", "type": "save_weights"}
            return result()
        return self.enqueue(model_id, seq_id_of(body), "SaveWeights", run, json_digest(body))

    def save_weights_for_sampler(self, body: dict[str, Any]) -> str:
        model_id = str(body.get("model_id"))
        model = self.model(model_id)
        ephemeral = not body.get("path")
        name = body.get("path") or f"ephemeral-{next(self._ids)}"
        path = f"tinker://{model_id}/{SAMPLER_WEIGHTS}/{name}"

        def run() -> Awaitable[Result]:
            folder = self.folder(model_id, SAMPLER_WEIGHTS, name)
            done = self.ranks.submit("save_adapter", model_id, folder)

            async def result() -> Result:
                self._write_meta(model, folder, await done)
                await self.sampler.replace(path, folder)  # (a reused name: a new adapter)
                if ephemeral:  # the SDK samples from it at once, under a session of its own
                    sampler_id = self._new_sampling_session(model.session_id, path)
                    return {"sampling_session_id": sampler_id}
                return {"path": path, "type": "save_weights_for_sampler"}
            return result()
        return self.enqueue(model_id, seq_id_of(body), "SaveWeightsForSampler", run,
                            json_digest(body))

    def load_weights(self, body: dict[str, Any]) -> str:
        with_optimizer = fields.flag(body, "optimizer", False)
        if "model_id" in body:  # onto an existing model, in its order
            model_id = str(body["model_id"])

            def run() -> Awaitable[Result]:
                folder = self.folder(*self.parse_path(str(body.get("path"))))
                return self._load(model_id, folder, with_optimizer)
            return self.enqueue(model_id, seq_id_of(body), "LoadWeights", run,
                                json_digest(body))
        # a new model from the checkpoint (ServiceClient.create_training_client_from_state)
        folder = self.folder(*self.parse_path(str(body.get("path"))))
        meta = self._read_meta(folder)
        self._load_check(folder)
        session = self.session(str(body.get("session_id")))
        model_id = f"{session.id}:train:{model_seq_id(body)}"
        shape = LoRAShape(meta["lora_rank"], meta["train_attn"], meta["train_mlp"],
                          meta["train_unembed"])
        metadata = fields.mapping(body, "user_metadata")
        request_id = self.futures.create("LoadWeights")

        async def create_and_load() -> Result:
            await self._add_model(session, model_id, shape, metadata)
            return await self._load(model_id, folder, with_optimizer)
        self.futures.watch(request_id, create_and_load())
        return request_id

    @staticmethod
    def _load_check(folder: str) -> None:
        if not os.path.isdir(os.path.join(folder, "dcp")):
            raise UserError(f"{folder} is a sampler checkpoint (adapter only); load a "
                            f"save_state checkpoint (tinker://<model>/weights/<name>)")

    def _load(self, model_id: str, folder: str, with_optimizer: bool) -> Awaitable[Result]:
        self._load_check(folder)
        done = self.ranks.submit("load_state", model_id, folder, with_optimizer)

        async def result() -> Result:
            await done
            return {"model_id": model_id, "type": "load_weights"}
        return result()

    def _write_meta(self, model: Model, folder: str, step: int) -> None:
        """tinker_checkpoint.json: what the checkpoint is (its LoRA shape, after how many
        optimizer steps), read to load it again and by weights_info."""
        model_id = model.id
        meta = {"base_model": self.config.model_name, "lora_rank": model.lora.rank, "step": step,
                "train_attn": model.lora.train_attn, "train_mlp": model.lora.train_mlp,
                "train_unembed": model.lora.train_unembed, "model_id": model_id, "time": runs.now(),
                "user_metadata": model.user_metadata,
                "owner": self.sessions[model.session_id].owner}  # who may list and load it
        with open(os.path.join(folder, runs.META_FILE), "w") as f:
            json.dump(meta, f)

    def _read_meta(self, folder: str) -> dict[str, Any]:
        with open(os.path.join(folder, runs.META_FILE)) as f:
            meta: dict[str, Any] = json.load(f)
        return meta

    def weights_info(self, tinker_path: str) -> dict[str, Any]:
        meta = self._read_meta(self.folder(*self.parse_path(tinker_path)))
        return {"base_model": meta["base_model"], "is_lora": True,
                "lora_rank": meta["lora_rank"], "train_unembed": meta["train_unembed"],
                "train_mlp": meta["train_mlp"], "train_attn": meta["train_attn"]}

    # ---- training runs (REST) -------------------------------------------------------------
    def training_run(self, run_id: str) -> dict[str, Any]:
        """The caller's training run `run_id` (another key's is answered as unknown)."""
        if not self._callers_run(run_id):
            raise NotFound(f"no training run {run_id!r} (no live model, no checkpoints)")
        return self._run_view(run_id)

    def _run_view(self, run_id: str) -> dict[str, Any]:
        model = self.models.get(run_id)
        alive = None if model is None else {
            "lora_rank": model.lora.rank, "user_metadata": model.user_metadata,
            "last_request_time": datetime.datetime.fromtimestamp(
                model.last_request, datetime.timezone.utc).isoformat()}
        return runs.training_run(self.config.storage_dir, run_id, alive,
                                 self.config.model_name)

    def training_runs(self, limit: int, offset: int) -> dict[str, Any]:
        ids = [i for i in runs.run_ids(self.config.storage_dir, list(self.models))
               if self._callers_run(i)]
        return {"training_runs": [self._run_view(i) for i in ids[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)}}

    async def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        if not self._callers_run(run_id):
            raise NotFound(f"no checkpoint {checkpoint_id!r} of {run_id!r}")
        runs.delete_checkpoint(self.config.storage_dir, run_id, checkpoint_id)
        await self.sampler.forget(f"tinker://{run_id}/{checkpoint_id}")

    # ---- sampling -----------------------------------------------------------------------
    def create_sampling_session(self, body: dict[str, Any]) -> str:
        session = self.session(str(body.get("session_id")))
        path = body.get("model_path")
        if path:
            self._sampler_path(str(path))
        else:
            self.check_base_model(body.get("base_model"))
        return self._new_sampling_session(session.id, str(path) if path else None)

    def _sampler_path(self, path: str) -> None:
        """Register a sampler checkpoint saved by an earlier run of this server."""
        model_id, kind, name = self.parse_path(path)
        if kind != SAMPLER_WEIGHTS:
            raise UserError(f"{path!r} is a training checkpoint; sample from a "
                            f"save_weights_for_sampler path (tinker://<model>/"
                            f"{SAMPLER_WEIGHTS}/<name>)")
        self.sampler.register(path, self.folder(model_id, kind, name))

    def _new_sampling_session(self, session_id: str, path: Optional[str]) -> str:
        sampler_id = f"sampler-{next(self._ids)}"
        self.sampling_sessions[sampler_id] = (session_id, path)
        self.sessions[session_id].samplers.add(sampler_id)
        return sampler_id

    def sampling_session(self, sampler_id: str) -> tuple[str, Optional[str]]:
        """(its session, the checkpoint it samples) of the caller's sampling session (another
        key's is answered as unknown); a request keeps its session alive, as a heartbeat."""
        found = self.sampling_sessions.get(sampler_id)
        session = self.sessions.get(found[0]) if found else None
        if found is None or session is None or session.owner != CALLER.get():
            raise NotFound(f"no sampling session {sampler_id!r}")
        self.session(found[0])
        return found

    def sampler_info(self, sampler_id: str) -> dict[str, Any]:
        self.sampling_session(sampler_id)
        return {"sampler_id": sampler_id, "base_model": self.config.model_name,
                "model_path": self.sampling_sessions[sampler_id][1]}

    def asample(self, body: dict[str, Any], params: Any, prompt: list[int]) -> str:
        sampler_id = body.get("sampling_session_id")
        if sampler_id:
            _, path = self.sampling_session(str(sampler_id))
        elif body.get("model_path"):
            path = str(body["model_path"])
            self._sampler_path(path)
        else:
            self.check_base_model(body.get("base_model"))
            path = None
        n = fields.integer(body, "num_samples", 1, low=1, high=MAX_NUM_SAMPLES)
        vocab = self.config.vocab_size  # an id past the embedding would crash the server
        for where, ids in (("prompt", prompt), ("sampling_params.stop", params.stop_tokens)):
            bad = [t for t in ids if not 0 <= t < vocab] if vocab else []
            if bad:
                raise UserError(f"asample: {where} holds token id {bad[0]}, outside the "
                                f"vocabulary [0, {vocab})")
        for key in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(key):
                raise UserError(f"{key}={body[key]} is not supported by this server")
        for key in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
            if body.get(key) is not None:
                raise UserError(f"{key} is not supported by this server")
        request_id = self.futures.create("Sample")
        self.futures.watch(request_id, self.sampler.sample(
            path, prompt, n, params, fields.flag(body, "prompt_logprobs", False),
            fields.integer(body, "topk_prompt_logprobs", 0, low=0, high=vocab or None)))
        return request_id
