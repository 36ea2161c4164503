"""Statistics, learned from each step's plan and result after the step (never inside it).

The scheduler's counters (request.SchedulerStats), each request's (request.RequestStats) and the load-aware
policy (load_aware.LoadAwareK: the calls' costs, the rows' acceptance, whole rounds' tokens per second) are told
what a step did once the scheduler has emitted its tokens: ``admitted``, ``prompts``, ``round`` and ``alone``.
"""

from __future__ import annotations

import time
from collections import deque

from .load_aware import LoadAwareK
from .plan import DecodeResult, DraftShape, LoneResult, PromptResult, Verdict
from .request import SchedulerStats


class Statistics:
    def __init__(self, policy: LoadAwareK | None):
        self.counters = SchedulerStats()
        self.policy = policy
        self.round_log: deque = deque(maxlen=1 << 16)  # (round number, k chosen, rows)

    def admitted(self, r, reused: int, prefix_cache: bool) -> None:
        """Request r took a row, reusing ``reused`` prefix slots."""
        stats = self.counters
        if reused > 0:
            stats.prefix_hits += 1
            stats.prefix_tokens_reused += reused
        elif prefix_cache:
            stats.prefix_misses += 1
        r.stats.prefix_tokens_reused = reused
        stats.prompt_tokens += int(r.prompt_ids.size)

    def prompts(self, rows, result: PromptResult) -> None:
        """One target call read the prompt chunks of ``rows`` (and the draft the same chunks)."""
        stats = self.counters
        stats.target_calls += 1
        stats.draft_calls += result.draft_calls
        stats.prefill_s += result.seconds
        for r in rows:
            r.stats.target_calls += 1

    def round(self, rows, plan: DraftShape, result: DecodeResult, emitted: int) -> None:
        """A decoding round over ``rows`` that emitted ``emitted`` tokens: its one target call and its drafting, each
        row's verdict, and what the load-aware policy learns of it."""
        stats, policy = self.counters, self.policy
        b, k = len(rows), plan.k
        stats.k_histogram[k] = stats.k_histogram.get(k, 0) + 1
        self.round_log.append((stats.rounds, k, b))
        stats.rounds += 1
        stats.target_calls += 1
        stats.draft_calls += len(result.calls)
        stats.verify_s += result.verify_s
        stats.draft_s += result.draft_s
        if result.tree:
            stats.tree_shapes[result.shape] = stats.tree_shapes.get(result.shape, 0) + 1
        width = plan.width if result.tree else 1
        # rounds that verify forced tokens before the drafts are left out (their cost and tokens are the grammar's),
        # and so are those whose chains held forced tokens (_learn_round)
        learn = policy is not None and not plan.forced
        if learn:
            self._learn_calls(b, plan.k, result)
        for r, verdict in zip(rows, result.verdicts):
            r.stats.target_calls += 1
            if isinstance(verdict, Verdict):
                self._record_verdict(r, verdict, width)
        if learn:
            self._learn_round(b, plan, result, emitted, time.perf_counter() - result.started)

    def alone(self, r, result: LoneResult) -> None:
        """A lone row's one-token calls in the engine's own loop: each counts as a round of k = 0."""
        stats, calls = self.counters, result.calls
        self.round_log.extend((stats.rounds + i, 0, 1) for i in range(calls))
        stats.k_histogram[0] = stats.k_histogram.get(0, 0) + calls
        stats.rounds += calls
        stats.target_calls += calls
        stats.verify_s += result.seconds
        r.stats.target_calls += calls
        r.stats.rounds += calls
        if self.policy is not None:  # as many one-token rounds as the loop made (what the batch path records)
            per_round = (time.perf_counter() - result.started) / calls
            for _ in range(calls):
                self.policy.target.record(1, 1, result.seconds / calls)
                self.policy.record_round(1, 0, 1, per_round, 1, None, result.sampled)

    def _record_verdict(self, r, verdict: Verdict, width: int) -> None:
        """One row's verdict in its request's and the scheduler's statistics and the policy's acceptance (proposed:
        drafts of a chain, the deepest path of a tree); tokens a grammar forced count apart, not as the drafter's."""
        stats = self.counters
        r.stats.rounds += 1
        accepted, proposed = verdict.accepted, verdict.proposed
        if verdict.forced:
            r.stats.forced_tokens += verdict.forced_accepted
            accepted, proposed = accepted - verdict.forced_accepted, proposed - verdict.forced
        r.stats.record_accept(accepted, proposed)
        if proposed and self.policy is not None:
            self.policy.record_acceptance(proposed, accepted, width, r.sampler.mode != "greedy")
        stats.proposed += proposed
        stats.accepted += accepted
        if proposed:
            counts = stats.by_drafter.setdefault(verdict.source, [0, 0])
            counts[0] += proposed
            counts[1] += accepted

    def _learn_calls(self, b: int, k: int, result: DecodeResult) -> None:
        """What a round's calls cost: the verify call, the draft engine's calls at their sizes (a long catch-up is
        not a token), or per token of a drafter without an engine."""
        policy = self.policy
        (policy.tree_target if result.tree else policy.target).record(b, result.width, result.verify_s)
        for calls, tokens, seconds in result.calls:
            policy.draft.record(calls, tokens, seconds)
        if not result.calls and result.drafted:
            # per token drafted: a tree's depth is the round's k, a chain's its widest row
            policy.draft.record(b, 1, result.draft_s / max(k if result.tree else result.drafted, 1))

    def _learn_round(self, b: int, plan: DraftShape, result: DecodeResult, emitted: int, seconds: float) -> None:
        """What a whole round at (b, k) emitted and took. A round whose chains held tokens a grammar forced is not
        recorded: they come whatever k is and cost what the grammar's work costs, so such a round says little about
        k. (Counted as output, a k = 1 chain that reached a forced run looked better than any longer one, and
        drafting stayed at k = 1; left out of the output but not of the time, longer chains, which reach more forced
        runs, looked slower, and plain rows at the same batch size drafted too few.) Grammar rows learn from their
        rounds of free text, with their own acceptance."""
        if result.forced_in_chains:
            return
        if result.calls and result.calls[0][1] > 2:
            # a long catch-up pays for earlier rounds that did not draft: charge this round a usual one
            seconds += self.policy.draft.estimate(b, 2) - result.calls[0][2]
        self.policy.record_round(b, plan.k, emitted, seconds, plan.width if result.tree else 1, plan.expected,
                                 plan.sampled)
