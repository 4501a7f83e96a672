"""The served mix's demand, learned from the quality verdicts of the requests it served.

In: the profile's per-task demand (`DemandModel`) and, as requests finish, each one's verdict under
the plan it ran: (signal, rank depth, coverage, passed). Out: weights over the profile's tasks, and
the demand of that mixture, P(pass | S, depth, r) = sum_t w_t P_t(pass | S, depth, r), for the
planner to price hint-free plans with in place of the profiled mix's.

The hypotheses: the workload is the profiled mix, or it is one profiled task alone. Each verdict
is likelier under some of them than others (VT's requests fail query-context ranking at low
coverage, the other tasks' pass half the time), and the tasks' curves tie every signal and depth
together, so a verdict of the cheap signal reprices the others. The weights are the posterior
mean: the profiled mix's shares times its posterior, plus each task's posterior. With no verdicts
they are the profile's own shares (the profiled mix's demand); an unseen workload is read as the
profiled behaviour its verdicts fit best. The posterior is over the latest `max_observations`
verdicts, so a mix that drifts is followed.

How fast it learns is set by how far apart the tasks' curves are: on the packaged profile a VT-only
stream is told apart within about ten verdict pairs, while PR, MSQ and MV overlap and take tens,
often more than 60 (docs/adr/0031-workload-profiles-and-learning.md). Never touches tensors.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from cachesmith.errors import ConfigError
from cachesmith.planner.demand import DemandModel, read_at


@dataclass(frozen=True)
class ServedMixConfig:
    mix_prior: float = 0.5  # prior probability that the workload is the profiled mix (the rest: one task)
    max_observations: int = 200  # the window of latest verdicts the posterior is taken over
    min_pass_probability: float = 0.02  # a task's curve read as at least this likely either way
    min_change: float = 0.01  # weights moving less than this keep the planner's cached envelopes

    def __post_init__(self) -> None:
        if not 0 < self.mix_prior < 1:
            raise ConfigError(f"mix_prior={self.mix_prior}: must be in (0, 1)")
        if self.max_observations < 1:
            raise ConfigError(f"max_observations={self.max_observations}: must be at least 1")
        if not 0 < self.min_pass_probability < 0.5:
            raise ConfigError(f"min_pass_probability={self.min_pass_probability}: must be in (0, 0.5)")
        if not 0 <= self.min_change < 1:
            raise ConfigError(f"min_change={self.min_change}: must be in [0, 1)")


class ServedMix:
    def __init__(self, demand: DemandModel, config: ServedMixConfig | None = None) -> None:
        self.demand = demand
        self.config = config = config or ServedMixConfig()
        self.tasks = demand.tasks
        sizes = np.array([demand.task_size(t) for t in self.tasks], float)  # [T]
        self.prior = sizes / sizes.sum() if sizes.size else sizes  # [T] the profiled mix's shares
        num_tasks = max(1, len(self.tasks))
        # [1 + T]: the profiled mix, then each task alone
        self._log_prior = np.log([config.mix_prior, *[(1 - config.mix_prior) / num_tasks] * len(self.tasks)])
        self.posterior = np.exp(self._log_prior)  # [1 + T]
        self.weights = self.prior.copy()  # [T]
        self.version = 0  # bumped when the weights move by min_change or more
        self.num_observed = 0
        # per verdict, how likely it was under each task's demand [T]
        self._likelihoods: deque[np.ndarray] = deque(maxlen=config.max_observations)

    @property
    def is_active(self) -> bool:
        """Whether there is anything to learn: the profile has curves for two or more tasks."""
        return len(self.tasks) >= 2

    def observe(self, signal: str, rank_depth: int, coverage: float, passed: bool) -> None:
        """A served request's verdict under (signal, rank depth, coverage)."""
        if not self.is_active or signal not in self.demand.signals:
            return
        eps = self.config.min_pass_probability
        p = np.array([self.demand.pass_probability(signal, rank_depth, [coverage], t)[0] for t in self.tasks])
        p = p.clip(eps, 1 - eps)  # [T]
        self._likelihoods.append(p if passed else 1 - p)
        self.num_observed += 1
        self._refit()

    def _refit(self) -> None:
        lik = np.stack(self._likelihoods)  # [N, T]
        log_lik = np.concatenate([[np.log(lik @ self.prior).sum()], np.log(lik).sum(0)])  # [1 + T]
        log_post = self._log_prior + log_lik
        post = np.exp(log_post - log_post.max())
        self.posterior = post / post.sum()
        w = self.posterior[0] * self.prior + self.posterior[1:]  # [T]
        if np.abs(w - self.weights).max() >= self.config.min_change:  # else the cached envelopes stand
            self.weights, self.version = w, self.version + 1

    def cdf(self, signal: str, rank_depth: float) -> np.ndarray:
        """The mixture's pass probability on the demand grid [21]."""
        return sum(w * self.demand.cdf(signal, rank_depth, t) for w, t in zip(self.weights, self.tasks))

    def pass_probability(self, signal: str, rank_depth: float, coverages) -> np.ndarray:
        return read_at(self.cdf(signal, rank_depth), coverages)

    def describe(self) -> dict[str, float]:
        """Task -> weight, for logs and reports."""
        return {t: round(float(w), 4) for t, w in zip(self.tasks, self.weights)}
