"""Continuous batching: which sequences decode, which prefill (chunked) and which are preempted.

Each step every running sequence that has its prompt cached decodes one token (all loops), and
prompt chunks fill the rest of the step's token budget: first the running sequences still
prefilling, then waiting ones in arrival order (a preempted sequence first). When a decoding
sequence needs a page and none is free, the newest running sequence is preempted: its K/V of
every plane is offloaded to host memory (by the framework's device side, `Step.preempted`) and
restored when it resumes (`Step.resumed`), so it continues exactly as if it had never stopped.
Slots (indices of the per-sequence device buffers) are handed out lowest first; a step's rows
are compacted whatever the slots (`wise_core.engine.step_plan`). A new sequence starts
after the full prompt pages it shares: its first completion's (an n > 1 request's later
completions wait for that prefill), else a cached prefix (`BlockManager.fork`, `match`).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from typing import Callable

from wise_core.engine.block_manager import BlockManager
from wise_core.engine.sequence import Sequence, Status


@dataclasses.dataclass
class Chunk:
    """Prefill of seq's prompt tokens [start, start + length)."""

    seq: Sequence
    start: int
    length: int

    @property
    def completes(self) -> bool:
        return self.start + self.length == len(self.seq.prompt)

    @property
    def scored(self) -> int:
        """Positions of the chunk whose logits score the next prompt token (a sequence that
        `scores_prompt`): positions [start, start + scored) score prompt tokens [start + 1,
        start + 1 + scored), every position but the prompt's last."""
        if not self.seq.scores_prompt:
            return 0
        return min(self.start + self.length, len(self.seq.prompt) - 1) - self.start


@dataclasses.dataclass
class Step:
    """One step's plan: offload `preempted` (each with the pages it held, before anything is
    written), restore `resumed`, decode `decode`, prefill `chunks`."""

    decode: list[Sequence]
    chunks: list[Chunk]
    preempted: list[tuple[Sequence, list[int]]]
    resumed: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.chunks


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        # Speculative decoding: keys a decode step writes past a sequence's last token (its
        # drafts), and whether the sequence can decode this step.
        self.lookahead: Callable[[Sequence], int] = lambda seq: 0
        self.ready: Callable[[Sequence], bool] = lambda seq: True
        self.running: list[Sequence] = []       # arrival order
        self.free_slots: list[int] = list(range(max_num_seqs))   # a heap: lowest first
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its pages and slot. Pages still written
        by a step in flight are safe to hand out: later steps run after it, in stream order."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        self._release_slot(seq)
        seq.offloaded = None

    def _run(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        seq.slot = heapq.heappop(self.free_slots)    # never empty: running sequences <= max_num_seqs
        self.running.append(seq)

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            heapq.heappush(self.free_slots, seq.slot)
            seq.slot = -1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, step: Step) -> bool:
        """Grow a running sequence's pages, preempting the newest running sequences (its K/V
        is offloaded before this step writes anything) until they fit; False if `seq` itself
        was preempted."""
        while not self.blocks.grow(seq, num_tokens):
            victim = self.running.pop()
            step.preempted.append((victim, victim.pages))
            step.decode = [s for s in step.decode if s is not victim]
            step.chunks = [c for c in step.chunks if c.seq is not victim]
            self.blocks.release(victim)
            self._release_slot(victim)
            victim.status = Status.WAITING
            self.waiting.appendleft(victim)
            self.preemptions += 1
            if victim is seq:
                return False
        return True

    def schedule(self) -> Step:
        step = Step([], [], [], [])
        # 1. Every prefilled running sequence decodes one token; grow pages, preempting the newest.
        for seq in list(self.running):
            if seq.status is Status.RUNNING and seq.prefilled and not seq.finishing and self.ready(seq) \
                    and self._grow_or_preempt(seq, len(seq.tokens) + self.lookahead(seq), step):
                step.decode.append(seq)
        # 2. Prompt chunks within the token budget: running sequences still prefilling, then waiting ones.
        budget = self.max_num_batched_tokens - len(step.decode)
        for seq in list(self.running):
            if budget > 0 and seq.status is Status.RUNNING and not seq.prefilled:
                length = min(len(seq.prompt) - seq.num_cached, budget)
                if self._grow_or_preempt(seq, seq.num_cached + length, step):
                    step.chunks.append(Chunk(seq, seq.num_cached, length))
                    budget -= length
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if any(seq is victim for victim, _ in step.preempted):
                break                                   # not back in the step that evicted it
            if seq.offloaded is not None:               # resume: restore its pages, then continue
                if not self.blocks.grow(seq, seq.num_cached + (1 + self.lookahead(seq) if seq.prefilled else 0)):
                    break
                self.waiting.popleft()
                self._run(seq)
                step.resumed.append(seq)
                if seq.prefilled:
                    step.decode.append(seq)
                    budget -= 1
                    continue
            fresh = seq.offloaded is None and not seq.pages
            forked = False
            if fresh:
                parent = seq.parent
                if parent is not None and parent.status is not Status.FINISHED and not parent.prefilled \
                        and self.blocks.shareable(seq):
                    break                               # a completion starts once its first one's prefill is launched
                forked = parent is not None and self.blocks.fork(seq, parent)
                if not forked:
                    self.blocks.match(seq)              # a cached prefix: its prefill starts after it
            length = min(len(seq.prompt) - seq.num_cached, budget)
            if not self.blocks.grow(seq, seq.num_cached + length):
                if forked:
                    self.blocks.unfork(seq)
                elif fresh:
                    self.blocks.unmatch(seq)
                break
            if seq.offloaded is None:
                self.waiting.popleft()
                self._run(seq)
            step.chunks.append(Chunk(seq, seq.num_cached, length))
            budget -= length
        return step
