"""The vLLM connector's scheduler side, free of vLLM so that `make test` covers it with fakes.

In: vLLM's scheduler-side requests (read by duck type: `request_id`, `prompt_token_ids`,
`kv_transfer_params`, `arrival_time`, `cache_salt`, `num_preemptions`) as vLLM asks how many of
their tokens the connector supplies, the blocks vLLM then allocates them, and the reports the
workers send back. Out: the number of tokens claimed (every prompt token but the last), a `Load`
per allocation that carries tokens the connector supplies, and what each response's
`kv_transfer_params` carry (the build's report, or the field the request got wrong).

One `Load` per allocation, not per new request: vLLM asks again when it resumes a request it
preempted (its blocks were freed, `num_computed_tokens` is back at 0), allocates new blocks and
hands them to `update_state_after_alloc`, so the resumed request gets a rebuild into exactly those
blocks; vLLM never computes those rows itself, so a load that was never sent would leave them stale.
A request whose build failed once (vLLM prefilled it instead) is never claimed again, so a resumed
request recomputes with vLLM's own KV throughout rather than a mix.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from cachesmith.errors import InputError
from cachesmith.integrations.prompt_kv import PARAMS_KEY, ConnectorParams
from cachesmith.kvstore import StoreConfig
from cachesmith.kvstore.keys import namespace_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreSettings:
    """The worker's chunk store, from `kv_connector_extra_config`, as `cachesmith serve` takes it."""
    tiers: tuple[str, ...] = ("memory", "disk")
    root: str | None = None  # disk tier root; None: $CACHESMITH_HOME/kv
    redis_url: str | None = None
    kv_codec: str = "none"  # how new entries are stored (`kvstore.codec`)

    @classmethod
    def from_extra(cls, extra: Callable[[str, Any], Any]) -> StoreSettings:
        return cls(tuple(extra("store_tiers", cls.tiers)), extra("store_root", None), extra("redis_url", None),
                   extra("kv_codec", cls.kv_codec))

    def config(self) -> StoreConfig:
        return StoreConfig(tiers=self.tiers, root=None if self.root is None else Path(self.root),
                           redis_url=self.redis_url, codec=self.kv_codec)


class Claim(NamedTuple):
    """What the connector found in a request when vLLM asked, kept until vLLM allocates its blocks."""
    token_ids: list[int]
    params: ConnectorParams
    namespace: str  # the store namespace of the request's cache_salt ("" without one)
    arrival_time: float  # when vLLM received the request (time.time())


@dataclass
class Load:
    """One build for the workers: a request's prompt, its parameters, and the blocks vLLM gave it."""
    request_id: str
    token_ids: list[int]
    params: ConnectorParams
    namespace: str
    arrival_time: float
    block_ids: list[int]
    num_rows: int  # the prompt rows vLLM takes from the connector: all but the last token
    num_rebuilds: int = 0  # 0: the first build; n: after vLLM preempted and resumed the request n times

    def slots(self, block_size: int) -> torch.Tensor:
        """vLLM's cache slots of rows 0..num_rows-1, [num_rows] int64; a clear error if the blocks
        cannot hold them (the build then fails and vLLM prefills the request)."""
        if len(self.block_ids) * block_size < self.num_rows:
            raise ValueError(f"request {self.request_id}: {len(self.block_ids)} blocks of {block_size} cannot hold "
                             f"the {self.num_rows} prompt rows the connector supplies")
        blocks = torch.tensor(self.block_ids, dtype=torch.int64)
        return (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:self.num_rows]


def fell_back(params: dict) -> bool:
    """Whether a worker's report says the build failed and vLLM prefilled the request instead."""
    return "fallback" in params.get(PARAMS_KEY, {})


class LoadBook:
    """The scheduler side's state, by request id: claims awaiting blocks, loads to send, reports."""

    def __init__(self, load_async: bool) -> None:
        self.load_async = load_async
        self._claims: dict[str, Claim] = {}
        self._loads: list[Load] = []  # allocated since the last step's metadata was built
        self._in_flight: set[str] = set()  # loads sent to the workers whose report is not back yet
        self._responses: dict[str, dict] = {}  # what each request's response will carry
        self._awaiting: dict[str, dict] = {}  # finished before their report came: filled in place
        self._fell_back: set[str] = set()  # a build failed; vLLM prefills them from now on

    def claim(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens the connector supplies, whether asynchronously). vLLM may ask more than once per
        admission; the claim is overwritten, so asking again changes nothing."""
        raw = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if raw is None or request.prompt_token_ids is None or request.request_id in self._fell_back:
            return 0, False
        try:
            params = ConnectorParams.parse(raw, len(request.prompt_token_ids))
            namespace = namespace_of("", request.cache_salt or "")
        except InputError as exc:  # the request is vLLM's alone; its response names the field
            log.warning("request %s: %s", request.request_id, exc)
            self._responses[request.request_id] = {PARAMS_KEY: {"error": str(exc)}}
            return 0, False
        # vLLM's prefix cache is off (the connector refuses it), so nothing is computed locally
        num_rows = len(request.prompt_token_ids) - 1 - num_computed_tokens
        if num_rows <= 0:
            return 0, False
        self._claims[request.request_id] = Claim(list(request.prompt_token_ids), params, namespace,
                                                 request.arrival_time)
        return num_rows, self.load_async

    def allocated(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM gave `request` blocks; a load for them if it takes tokens from the connector."""
        claim = self._claims.pop(request.request_id, None)
        if claim is None or num_external_tokens == 0:
            return
        self._loads.append(Load(request.request_id, claim.token_ids, claim.params, claim.namespace,
                                claim.arrival_time, list(block_ids), num_external_tokens,
                                request.num_preemptions))
        self._in_flight.add(request.request_id)

    def take_loads(self) -> list[Load]:
        loads, self._loads = self._loads, []
        return loads

    def reported(self, reports: dict[str, dict]) -> None:
        """The workers' reports of finished builds, by request id."""
        for request_id, params in reports.items():
            self._in_flight.discard(request_id)
            if fell_back(params):
                self._fell_back.add(request_id)
            awaiting = self._awaiting.pop(request_id, None)
            if awaiting is not None:
                awaiting.update(params)
            else:
                self._responses[request_id] = params

    def finished(self, request_id: str) -> dict | None:
        """What the finished request's response carries in `kv_transfer_params`, or None."""
        self._claims.pop(request_id, None)
        self._fell_back.discard(request_id)
        if request_id in self._in_flight:
            # A request that ends in its first step (one token) finishes before vLLM hands the
            # scheduler that step's worker output; the dict returned here goes out with the
            # response after this step, so `reported` fills it in place.
            self._in_flight.discard(request_id)
            self._awaiting[request_id] = {}
            return self._awaiting[request_id]
        return self._responses.pop(request_id, None)
