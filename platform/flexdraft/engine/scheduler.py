"""Which waiting requests a step admits, and which running requests give up their rows for them: the batch's rows
shared fairly between the groups (clients) that sent the requests, so that one client's many requests or n / best_of
choices cannot keep another client waiting for as long as they decode."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

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
