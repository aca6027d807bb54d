"""What the fleet client asks of one inference server, per backend: the HTTP calls behind
generation, scoring, pause / continue, weight loads and the weight-update group.

`RemoteInferenceEngine` (routing, retries, fleet membership, the distributed transport) is
the same for every backend; only this layer differs. `SGLangAPI` speaks SGLang's native
endpoints; `engines/vllm/api.py` speaks vLLM's; `engines.fleet.backends.server_api(backend)`
picks one.
"""

from __future__ import annotations

import abc
from typing import Any, Optional

import aiohttp

from areal_like.api.io_struct import GenerationHyperparameters, WeightUpdateMeta
from engines.server.replies import GenerateReply, GroupReply, ScoreReply


class ServerAPI(abc.ABC):
    """One backend's HTTP API. Every call takes the client's session and a server address."""

    name: str  # in messages: "SGLang server 127.0.0.1:3000 ..."
    generate_path: str
    scores_in_one_request = True  # ascore_batch: one request for all sequences (else one each)
    # how a server is paused for a weight load: "retract" keeps the requests in flight
    update_pause_mode = "retract"
    # whether replies can carry a mixture of experts' routing; `routed_experts`: asked for
    can_return_routed_experts = False
    routed_experts = False

    @abc.abstractmethod
    def generate_payload(self, input_ids: list[int], gconfig: GenerationHyperparameters,
                         rid: str, max_new_tokens: int, min_new_tokens: int,
                         seed: Optional[int] = None) -> dict[str, Any]: ...

    def add_images(self, payload: dict[str, Any], image_data: list[str]) -> dict[str, Any]:
        """`payload` with the prompt's images (base64 PNGs, one per image pad token)."""
        raise ValueError(f"the {self.name} backend does not take images in generation "
                         f"requests yet ({len(image_data)} image(s) given); serve a "
                         "vision-language model with rollout.backend=sglang")

    def name_adapter(self, payload: dict[str, Any], adapter: str) -> dict[str, Any]:
        """A generate or score `payload` served by the LoRA adapter named `adapter`, one of
        several a fleet holds (e.g. the Tinker API's sampler checkpoints)."""
        raise ValueError(f"the {self.name} backend does not serve a LoRA adapter named per "
                         f"request (adapter {adapter!r}); use an SGLang fleet started with "
                         f"server.lora_rank > 0")

    @abc.abstractmethod
    def parse_generate_reply(self, data: Any, server: str, rid: str) -> GenerateReply: ...

    @abc.abstractmethod
    def score_payload(self, sequences: list[list[int]], starts: list[int],
                      rid: str, top_k: int = 0) -> dict[str, Any]: ...

    @abc.abstractmethod
    def parse_score_reply(self, data: Any, server: str, rid: str, sequences: list[list[int]],
                          starts: list[int], top_k: int = 0) -> ScoreReply: ...

    @abc.abstractmethod
    def set_rid(self, payload: dict[str, Any], rid: str) -> None:
        """Name the request `rid` in `payload` (a retry renames it)."""

    # ---- a prompt's samples in one request (backends that take a batch) -------------------
    groups_in_one_request = False  # agenerate_n: one request for the samples (else one each)

    def group_payload(self, payloads: list[dict[str, Any]]) -> dict[str, Any]:
        """`generate_payload`s of one prompt's samples as one request."""
        raise NotImplementedError(f"the {self.name} backend takes one sample per request")

    def parse_group_reply(self, data: Any, server: str, rids: list[str]) -> GroupReply:
        raise NotImplementedError(f"the {self.name} backend takes one sample per request")

    def set_rids(self, payload: dict[str, Any], rids: list[str]) -> None:
        """Name the samples of a `group_payload` (a retry renames them)."""
        raise NotImplementedError(f"the {self.name} backend takes one sample per request")

    @abc.abstractmethod
    async def answers(self, session: aiohttp.ClientSession, addr: str, timeout: float) -> str:
        """'' when the server's HTTP front end answers (no generation involved), else why not."""

    async def health(self, session: aiohttp.ClientSession, addr: str, timeout: float) -> str:
        """'' when the server is up and ready to generate, else why not."""
        async with session.get(f"http://{addr}/health",
                               timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return "" if resp.status == 200 else f"HTTP {resp.status}"

    async def model_identity(self, session: aiohttp.ClientSession,
                             addr: str) -> dict[str, Any]:
        """What the server says it loaded (compared between servers of one fleet)."""
        return {}

    async def model_folder(self, session: aiohttp.ClientSession, addr: str) -> Optional[str]:
        """The folder the server says it loaded its model from (None: it does not say)."""
        return None

    def vocabulary_probe(self, token_id: int, rid: str) -> dict[str, Any]:
        """A one-token request that the server refuses (HTTP 400) when `token_id` is past
        its vocabulary, and that cannot harm it otherwise (engines/fleet/identity.py)."""
        return self.generate_payload([token_id], GenerationHyperparameters(greedy=True), rid,
                                     max_new_tokens=1, min_new_tokens=0)

    @abc.abstractmethod
    async def generates(self, session: aiohttp.ClientSession, addr: str,
                        timeout: float) -> str:
        """'' when the server's scheduler makes progress (a busy server passes at once), else
        why not, within `timeout` s (where the server does not bound its probe itself). A
        paused server fails it: do not probe one."""

    @abc.abstractmethod
    async def pause(self, session: aiohttp.ClientSession, addr: str, mode: str) -> None:
        """Stop generating; `mode` is `rollout.client.pause_mode`'s ("retract", "abort",
        "in_place"): a backend maps it to what it has (see `aborts_on_pause`)."""

    def aborts_on_pause(self, mode: str) -> bool:
        """Whether a pause in `mode` aborts the requests in flight. The client then continues
        each from the tokens it has once the server serves again, so callers never see it."""
        return mode == "abort"

    @abc.abstractmethod
    async def resume(self, session: aiohttp.ClientSession, addr: str) -> None: ...

    @abc.abstractmethod
    async def abort(self, session: aiohttp.ClientSession, addr: str, rid: str) -> None: ...

    @abc.abstractmethod
    async def load_from_disk(self, session: aiohttp.ClientSession, addr: str, path: str,
                             version: int, timeout: float) -> None:
        """Load the HF folder `path` (the server is paused) and serve it as `version`; raises
        naming the server when it refused."""

    def lost_state(self, status: int, body: str) -> str:
        """Why a refused request (HTTP `status`, `body`) shows that the server lost state it
        had loaded (it restarted), '' when it does not: the request is then retried
        elsewhere and the server reloaded, instead of failing the request."""
        return ""

    async def load_weights(self, session: aiohttp.ClientSession, addr: str,
                           meta: WeightUpdateMeta, timeout: float) -> None:
        """Load what `meta` names on a paused server: a folder (`type="disk"`) here; a
        backend that serves LoRA adapters also takes them in memory (`type="adapter"`)."""
        if meta.type != "disk":
            raise ValueError(f"{self.name} client: WeightUpdateMeta(type={meta.type!r}) is "
                             f"not loaded per server (disk folders only)")
        await self.load_from_disk(session, addr, str(meta.path), meta.version, timeout)

    # ---- the delta transport (engines/weight_transport/delta_fleet.py) -------------------
    async def apply_weight_file(self, session: aiohttp.ClientSession, addr: str, path: str,
                                version: int, timeout: float,
                                model_digest: bool = False) -> dict[str, Any]:
        """Apply the weight file `path` (engines/weight_transport/delta/) inside the open
        update and serve it as `version`; returns the server's receipt (`applied`, `refused`:
        base | model | corrupt | unreadable, `state_digest`, with `model_digest` a digest of
        the server's own parameters). Raises only when the server could not be asked."""
        raise NotImplementedError(f"the {self.name} backend does not take weight files "
                                  f"(rollout.weights.transport=delta)")

    # ---- the weight-update group (trainer rank 0 + the server's workers) -----------------
    @abc.abstractmethod
    async def tp_size(self, session: aiohttp.ClientSession, addr: str) -> int:
        """How many ranks the server brings to a weight-update group."""

    @abc.abstractmethod
    async def join_group(self, session: aiohttp.ClientSession, addr: str,
                         body: dict[str, Any], timeout: float) -> None:
        """Join the group `body` names (master_address, master_port, rank_offset,
        world_size, group_name, backend); returns once the group has formed."""

    @abc.abstractmethod
    async def leave_group(self, session: aiohttp.ClientSession, addr: str,
                          group_name: str) -> None: ...

    @abc.abstractmethod
    async def begin_update(self, session: aiohttp.ClientSession, addr: str) -> None:
        """Before the first bucket (the server is paused)."""

    @abc.abstractmethod
    async def receive_bucket(self, session: aiohttp.ClientSession, addr: str,
                             body: dict[str, Any], timeout: float) -> None:
        """Receive one flattened bucket (names, dtypes, shapes, group_name, flush_cache,
        weight_version: set on the last bucket); not retried."""

    @abc.abstractmethod
    async def end_update(self, session: aiohttp.ClientSession, addr: str) -> None:
        """After the last bucket (or to close a session a failed broadcast left open)."""

    async def begin_group_update(self, session: aiohttp.ClientSession, addr: str) -> None:
        """Before a broadcast's first bucket: the session of the weight-update group, where a
        server has one of its own (vLLM's weight-transfer API); else any update's."""
        await self.begin_update(session, addr)

    async def end_group_update(self, session: aiohttp.ClientSession, addr: str) -> None:
        """After a broadcast's last bucket, or to close the session a failed one left open."""
        await self.end_update(session, addr)


