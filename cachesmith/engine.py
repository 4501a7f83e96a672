"""The serving loop (paper §5): queue -> scheduler -> planner -> runner (+ transfer
engine) -> first token -> decode, on a live or replay clock.

In: `Request`s (submitted as they arrive, or a whole trace to `run`), carried whole to the executor;
the scheduler sees each through its tensor-free `QueuedRequest`. Out: one `RequestResult` per
request: refused ones carry an error naming the engine's limit they break (no stored prompt, a
context larger than the KV capacity) and the rest of the run goes on. The rules of every request
(its SLO, `max_new_tokens`, the model's positions) were checked where it entered
(`cachesmith.request`): the engine trusts a typed `Request`. At each
batch boundary the scheduler picks the batch and budget from token counts and deadlines; the
executor runs it and reports the measured TTFT, which the replay clock adds to its time. With the
simulator's runtime (`cachesmith.bench.simulate`) the same loop runs on TTFTs from the cost model and
verdicts from the outcome tables. Answers are gated here (`cachesmith.gates`); a learning method's
shadow work is handed in (`EngineConfig.shadow_work`): the engine imports no offline code.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from cachesmith.clock import Clock, make_clock
from cachesmith.errors import ConfigError, InputError
from cachesmith.executor import BatchExecution, BatchExecutor, Executor, RequestOutput, TokenHook
from cachesmith.gates import make_gate
from cachesmith.methods import make_scheduler, parse_method
from cachesmith.model import Decoding, Generation
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import Planner, PlannerConfig, Profile
from cachesmith.request import Request, RequestResult
from cachesmith.scheduler import QueuedRequest, ScheduleDecision, SchedulerConfig
from cachesmith.shadow_work import ShadowCalibrator, ShadowConfig, ShadowFactory


MAX_AWAITING_VERDICTS = 4096  # planned requests a client may still send a verdict on


@dataclass(frozen=True)
class EngineConfig:
    method: str = "cachesmith"
    clock: str = "replay"
    gate: str = "task"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)  # learning methods only (`+learn`)
    # builds a learning method's shadow work (`calibration.shadow.shadow_calibrator`); the measuring
    # sits above the engine, so whoever composes a learning engine with a model hands it in
    shadow_work: ShadowFactory | None = None

    def __post_init__(self) -> None:
        parse_method(self.method)  # names the bad part now, not at the first batch
        make_clock(self.clock)
        make_gate(self.gate)


@dataclass(frozen=True)
class PrefilledBatch:
    """A batch past its first tokens, waiting to be decoded (the live loop decodes on another thread)."""
    decision: ScheduleDecision
    batch: list[Request]
    run: BatchExecution
    first_token_s: float  # clock time of the batch's first tokens
    batch_id: int


@dataclass
class EngineStats:
    num_batches: int = 0
    busy_s: float = 0.0  # batch TTFTs summed: time the runtime was prefilling
    stall_s: float = 0.0  # of which waiting on KV transfer
    decision_ms: list[float] = field(default_factory=list)  # scheduler + planner, per batch
    num_monitor_replans: int = 0
    num_partial_batches: int = 0  # batches the scheduler ran under partial KV allocation


class Engine:
    """`runtime` builds the executor from the engine's planner: the simulator's (`bench.sim_executor`)
    instead of the model's `BatchExecutor`, with no pipeline at all."""

    def __init__(self, pipeline: RagPipeline | None, profile: Profile, config: EngineConfig | None = None,
                 clock: Clock | None = None, runtime: Callable[[Planner], Executor] | None = None) -> None:
        self.pipeline = pipeline
        self.config = config = config or EngineConfig()
        self.method = parse_method(config.method)
        self.planner = Planner(profile, self.method.planner_config(config.planner))
        self.planner.warm_up()
        self.scheduler = make_scheduler(self.method, self.planner, config.scheduler, profile.num_layers)
        if runtime is None and pipeline is None:
            raise ValueError("an Engine needs a pipeline (the model) or a runtime (the simulator)")
        self.executor = runtime(self.planner) if runtime else BatchExecutor(pipeline, self.planner)
        self.clock = clock or make_clock(config.clock)
        self.gate = make_gate(config.gate)
        self.references: dict[int, str] = {}  # full-prefill answers, for the fidelity gate
        self.stats = EngineStats()
        self._queue: dict[int, tuple[Request, QueuedRequest]] = {}  # by id: the request, the scheduler's view
        # planned requests whose verdict may still come from outside (`feedback`): the plan each ran
        self._awaiting_verdict: OrderedDict[int, tuple[str, int, int, float]] = OrderedDict()
        self._verdicts: deque[tuple[tuple, bool]] = deque()  # (plan ran, passed) from any thread
        self.shadow = self._shadow_work(pipeline, config)

    def _shadow_work(self, pipeline: RagPipeline | None, config: EngineConfig) -> ShadowCalibrator | None:
        """A learning method measures the served workload's demand from its own requests in idle
        time (the simulator has no model to measure with, and a zero fraction turns it off)."""
        if pipeline is None or not self.is_learning or config.shadow.fraction <= 0:
            return None
        if config.shadow_work is None:
            raise ConfigError(f"method={config.method!r} learns from shadow work: pass EngineConfig(shadow_work="
                              f"cachesmith.calibration.shadow.shadow_calibrator), or shadow=ShadowConfig(fraction=0)")
        return config.shadow_work(pipeline, self.planner, config.shadow)

    # -- admission -----------------------------------------------------------------------------
    def admit(self, request: Request, view: QueuedRequest | None = None) -> QueuedRequest:
        """The scheduler's view of a request whose caller keyed and stored its prompt (the engine
        stores nothing: `RagPipeline.stored_prompt` and the server do; `view`: the one its caller
        made, checked), or an `InputError` naming the engine limit it breaks."""
        return self.executor.admit(request, self.config.scheduler.kv_capacity_tokens, view)

    def enqueue(self, request: Request, view: QueuedRequest) -> RequestResult | None:
        """Queue an admitted request (`view`: its `admit`); one whose id is queued already comes
        back at once, refused."""
        if request.request_id in self._queue:
            return RequestResult.refused(request, f"request {request.request_id}: duplicate id")
        self._queue[request.request_id] = (request, view)
        return None

    def submit(self, request: Request) -> RequestResult | None:
        """Admit and queue a request; a refused one comes back at once as a result with its error."""
        try:
            view = self.admit(request)
        except InputError as exc:
            return RequestResult.refused(request, str(exc))
        return self.enqueue(request, view)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def queued_views(self) -> list[QueuedRequest]:
        """The scheduler's view of every queued request."""
        return [view for _, view in self._queue.values()]

    def cancel(self, request_id: int) -> Request | None:
        """Take a request off the queue if it has not been batched yet (else None)."""
        queued = self._queue.pop(request_id, None)
        return None if queued is None else queued[0]

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestResult]:
        """One batch boundary: schedule, run the batch, advance the clock. [] when idle."""
        decided = self.next_decision()
        if decided is None:
            return []
        decision, batch = decided
        return self.run_batch(decision, batch)

    def next_decision(self) -> tuple[ScheduleDecision, list[Request]] | None:
        """Schedule the next batch and take its requests off the queue (the part of a step that
        must not overlap a submit: `EngineLoop` holds its lock around this only)."""
        self._apply_verdicts()
        decision = self.scheduler.next_batch(self.queued_views(), self.clock.now())
        if decision is None:
            return None
        self.clock.advance(decision.decision_s)
        return decision, [self._queue.pop(i)[0] for i in decision.request_ids]

    def run_batch(self, decision: ScheduleDecision, batch: list[Request]) -> list[RequestResult]:
        """Execute a decided batch, advance the clock by its TTFT, gate and return the results."""
        return self.finish_batch(self.prefill_batch(decision, batch))

    def prefill_batch(self, decision: ScheduleDecision, batch: list[Request]) -> "PrefilledBatch":
        """Run a decided batch up to its first tokens; the clock advances by the batch's TTFT."""
        start = self.clock.now()
        run = self.executor.prefill(decision, batch)
        self.clock.advance(run.seconds)
        st = self.stats
        batch_id, st.num_batches = st.num_batches, st.num_batches + 1
        st.busy_s += run.seconds
        st.stall_s += run.stall_s
        st.decision_ms.append(1e3 * (decision.decision_s + run.planner_s))
        st.num_monitor_replans += run.num_monitor_replans
        st.num_partial_batches += decision.kv_window_layers is not None
        return PrefilledBatch(decision, batch, run, start + run.seconds, batch_id)

    def finish_batch(self, pre: "PrefilledBatch", on_token: TokenHook | None = None) -> list[RequestResult]:
        """Decode (off the TTFT clock), gate, and make the results of a prefilled batch."""
        outputs = self.executor.decode(pre.batch, pre.run, on_token)
        return [self.result(pre, req, out) for req, out in zip(pre.batch, outputs)]

    def new_decoding(self) -> Decoding:
        """An empty set of sequences decoded together on this engine's model (the live loop's)."""
        return Decoding(self.pipeline.model)

    def start_decoding(self, pre: "PrefilledBatch", on_token: TokenHook | None = None) -> list[Generation]:
        """Each request's first token chosen; the rest come from a `Decoding`'s steps. A generation's
        `tag` is its request's index in the batch."""
        return self.executor.start_decoding(pre.batch, pre.run, on_token)

    def finish_one(self, pre: "PrefilledBatch", index: int, gen: Generation,
                   token_times_s: tuple[float, ...] = ()) -> RequestResult:
        """The result of the batch's `index`-th request once its generation ended (its cache goes
        back to the pool), or its generation's error."""
        req = pre.batch[index]
        if gen.error is not None:
            pre.run.outs[index].cache.release()
            return RequestResult.failed(req, gen.error)
        return self.result(pre, req, self.executor.output(req, pre.run, index, gen), token_times_s)

    def result(self, pre: "PrefilledBatch", req: Request, out: RequestOutput,
               token_times_s: tuple[float, ...] = ()) -> RequestResult:
        """One request's result from its decoded output (gated); `token_times_s`: when each of its
        tokens was produced, where the caller timed them (the live loop)."""
        passed = self._gate(req, out.answer) if out.is_passed is None else out.is_passed  # sim: its own
        self._hear_verdict(req.request_id, pre.run.plan, out, passed)
        if self.shadow is not None:
            self.shadow.offer(req)
        return RequestResult(
            req.request_id, req.arrival_s, req.slo_s, req.task, None, pre.first_token_s, out.answer,
            passed, pre.decision.mode, pre.run.plan_label, out.coverage,
            out.num_context_tokens, out.num_recomputed, pre.batch_id, len(pre.batch), out.qci_entropy,
            out.num_prompt_tokens, out.num_output_tokens, batch_s=pre.run.seconds,
            num_cached_prefix=out.num_cached_prefix, reused_by_chunk=out.reused_by_chunk,
            logprobs=out.logprobs, output_token_ids=out.token_ids,
            planned_s=pre.run.plan.predicted_ttft_s if pre.run.plan is not None else None,
            num_replans=pre.run.num_monitor_replans, token_times_s=token_times_s)

    @property
    def is_learning(self) -> bool:
        """Whether verdicts teach the planner (a method that learns the served mix)."""
        return self.planner.served_mix is not None

    def feedback(self, request_id: int, passed: bool) -> bool:
        """A verdict on a finished request from outside (a client's judgement of its answer). Safe
        from any thread. False unless the request is one of the last `MAX_AWAITING_VERDICTS`
        planned ones still without a verdict (the first verdict on a request stands)."""
        ran = self._awaiting_verdict.pop(request_id, None)
        if ran is None:
            return False
        self._verdicts.append((ran, bool(passed)))
        return True

    def _apply_verdicts(self) -> None:
        """The planner hears the verdicts so far, on the thread that plans: between batches."""
        while self._verdicts:
            ran, passed = self._verdicts.popleft()
            self.planner.observe_verdict(*ran, passed)

    def _hear_verdict(self, request_id: int, plan, out: RequestOutput, passed: bool | None) -> None:
        """A learning planner hears each planned request's verdict (what the served mix needs); one
        the gate cannot give may come later through `feedback`."""
        if plan is None or not self.is_learning:
            return
        coverage = out.num_recomputed / out.num_context_tokens if out.num_context_tokens else 0.0
        ran = (plan.signal, plan.warmup, plan.probe, coverage)
        if passed is not None:
            self._verdicts.append((ran, passed))
        else:
            self._awaiting_verdict[request_id] = ran
            while len(self._awaiting_verdict) > MAX_AWAITING_VERDICTS:
                self._awaiting_verdict.popitem(last=False)

    def _gate(self, req: Request, answer: str) -> bool | None:
        """The quality gate's verdict; None when it cannot judge (no gold, or no reference answer)."""
        expected = req.expected
        reference = self.references.get(req.request_id)
        if reference is None and self.method.preset == "full_prefill":
            reference = answer  # full prefill is the fidelity gate's reference itself
        if self.gate.needs_reference:
            return None if reference is None else self.gate.passes(expected, answer, reference)
        return self.gate.passes(expected, answer) if expected.gold else None

    def run(self, requests: Sequence[Request], show_progress: bool = False) -> list[RequestResult]:
        """Serve a trace: each request joins the queue at its arrival time on this engine's clock
        (replay: virtual; live: real seconds from now). Results in request order."""
        admitted: list[tuple[Request, QueuedRequest]] = []
        results: dict[int, RequestResult] = {}
        for r in tqdm(requests, desc="admit", unit="req", disable=not show_progress, leave=False):
            try:
                admitted.append((r, self.admit(r)))
            except InputError as exc:
                results[r.request_id] = RequestResult.refused(r, str(exc))
        admitted.sort(key=lambda a: a[0].arrival_s)
        bar = tqdm(total=len(requests), desc=self.method.name, unit="req", disable=not show_progress,
                   initial=len(results))
        i = 0
        while i < len(admitted) or self._queue:
            now = self.clock.now()
            while i < len(admitted) and admitted[i][0].arrival_s <= now:
                refused = self.enqueue(*admitted[i])
                if refused is not None:
                    results[refused.request_id] = refused
                i += 1
            if not self._queue:
                if self.shadow is not None:  # idle: shadow work that ends before the next arrival
                    self.shadow.run_idle(self.clock, admitted[i][0].arrival_s)
                self.clock.wait_until(admitted[i][0].arrival_s)
                continue
            for res in self.step():
                results[res.request_id] = res
                bar.update(1)
        bar.close()
        self._apply_verdicts()
        return [results[r.request_id] for r in requests]
