"""The engine's requests and their rows (`Scheduler`: the waiting queue, admission, retirement), and which waiting
requests a step admits and which running ones give up their rows for them (`schedule`): the batch's rows shared
fairly between the groups (clients) that sent the requests, so that one client's many requests or n / best_of
choices cannot keep another client waiting for as long as they decode."""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flexdraft.core.errors import FlexDraftError
from flexdraft.engine.state import Request


@dataclass
class Admission:
    preempt: list[Request]  # running requests to put back in the queue (each frees a row)
    admit: list[Request]  # waiting requests to prefill this step, in the order chosen


def schedule(waiting: Sequence[Request], running: Sequence[Request], rows: int, limit: int | None) -> Admission:
    """One at a time, the first waiting request whose group holds the fewest rows is admitted (plain FIFO while
    every request is a group of its own). A group that holds no row while none is free takes one from the group
    holding the most, if that holds two or more (its latest admitted request). So a client's request starts within
    one step and its prefill, whatever other clients hold, unless every row is another client's only one.
    rows: the batch's; limit: at most this many admissions, and no preemption (a server isolating a failure)."""
    held = Counter(req.group for req in running)
    free = rows - len(running)
    preempt: list[Request] = []
    if limit is None:
        hungry = list(dict.fromkeys(req.group for req in waiting if held[req.group] == 0))[max(free, 0):]
        order = {id(req): i for i, req in enumerate(running)}
        for _ in hungry:
            group, count = held.most_common(1)[0] if held else (None, 0)
            if count < 2:
                break
            taken = {id(r) for r in preempt}
            req = max((r for r in running if r.group == group and id(r) not in taken), key=lambda r: order[id(r)])
            preempt.append(req)
            held[group] -= 1
            free += 1
    else:
        free = min(free, limit)
    queue, admit = list(waiting), []
    for _ in range(max(min(free, len(queue)), 0)):
        req = min(queue, key=lambda r: held[r.group])  # (min takes the first of equals: queue order)
        queue.remove(req)
        held[req.group] += 1
        admit.append(req)
    return Admission(preempt, admit)


class Scheduler:
    """The engine's requests by where they stand: `waiting` (in queue order), `running` (running[r] holds cache row
    r: rows stay contiguous) and `finished` (until `result` hands each over once). Rows are the engine's: every
    call that frees one takes `move(src, dst)`, which moves row src's cache and state into row dst (the last row
    fills a freed one)."""

    def __init__(self, rows: int):
        self.rows = rows
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def admit(self, limit: int | None, move: Callable[[int, int], None]) -> tuple[list[Request], int]:
        """This step's admissions (`schedule`: fair between groups, at most `limit`), the running requests they
        preempt put back at the front of the queue with the tokens they have made -> (the admitted requests, out
        of the queue: the engine orders them and appends them to `running` as it prefills them; how many were
        preempted)."""
        admission = schedule(self.waiting, self.running, self.rows, limit)
        for req in admission.preempt:
            self.release(self.running.index(req), move)
            self.waiting.appendleft(req)
        for req in admission.admit:
            self.waiting.remove(req)
        return admission.admit, len(admission.preempt)

    def retire(self, move: Callable[[int, int], None]) -> None:
        """Running requests that finished (or were aborted) leave their rows for `finished`."""
        r = 0
        while r < len(self.running):
            req = self.running[r]
            if req.finish_reason is None:
                r += 1
                continue
            self.finished[req.id] = req
            self.release(r, move)

    def release(self, r: int, move: Callable[[int, int], None]) -> None:
        """Free row r: the last row moves into it."""
        last = len(self.running) - 1
        if r != last:
            move(last, r)
            self.running[r] = self.running[last]
        self.running.pop()

    def abort(self, request_id: int, move: Callable[[int, int], None]) -> None:
        """End a waiting or running request (finish_reason "abort"); the other rows are untouched."""
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                req.finish_reason = "abort"
                self.finished[req.id] = req
                return
        for req in self.running:
            if req.id == request_id:
                req.finish_reason = "abort"
                self.retire(move)
                return
        raise FlexDraftError(f"no running or waiting request with id {request_id}")

    def result(self, request_id: int) -> Request:
        """The finished (or aborted) request, handed over once."""
        if request_id not in self.finished:
            raise FlexDraftError(f"request {request_id} is not finished (or unknown)")
        return self.finished.pop(request_id)

    def requeue(self) -> list[Request]:
        """After a step that raised: every running request back to the front of the queue (one that had finished, to
        `finished`), no row held -> those requests, as they stood in rows."""
        back = list(self.running)
        self.running.clear()
        for req in reversed(back):
            if req.finish_reason is None:
                self.waiting.appendleft(req)
            else:
                self.finished[req.id] = req
        return back

    def ids(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(running, waiting) request ids, in row and queue order."""
        return tuple(r.id for r in self.running), tuple(r.id for r in self.waiting)
