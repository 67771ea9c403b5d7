"""An exhaustive breadth-first explorer of a :class:`~tests.model.protocol.Model`.

Every reachable state is stored once (states are hashable values), the invariants are checked
in each new state, and the first violation found comes back with the shortest trace that
reaches it (breadth-first order). After a complete exploration without violation, a liveness
pass checks that from *every* reachable state some intended end (the query finished, or
refused after an operator action) is still reachable: a deadlock, or a loop the query can
never leave (a batch retried for ever), is reported with the trace that reaches it.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from tests.model.protocol import LIVENESS, Violation

S = TypeVar("S")


class Explorable(Protocol[S]):
    """What the checker needs of a model."""

    def initial(self) -> S: ...

    def successors(self, s: S) -> Iterator[tuple[str, S]]: ...

    def violation(self, s: S) -> Violation | None: ...

    def goal(self, s: S) -> bool: ...

    def describe(self, s: S) -> str: ...


@dataclass
class Report:
    """The outcome of one exploration."""

    name: str
    states: int
    transitions: int
    seconds: float
    complete: bool
    """Every reachable state was explored (no violation stopped it, no bound cut it)."""
    violation: Violation | None = None
    trace: list[str] = field(default_factory=list)
    final: str = ""
    loop: list[str] = field(default_factory=list)
    """For a liveness violation: what happens next without any further fault (a loop or a dead end)."""
    goals: int = 0
    terminals: int = 0

    @property
    def ok(self) -> bool:
        return self.violation is None and self.complete

    def summary(self) -> str:
        head = f"[{self.name}] {self.states:,} states, {self.transitions:,} transitions, {self.seconds:.1f} s"
        if self.violation is None:
            tail = "complete, no violation" if self.complete else "INCOMPLETE (state bound reached)"
            return f"{head}: {tail} ({self.goals:,} end states)"
        return f"{head}: VIOLATION of {self.violation.invariant}: {self.violation.detail}"

    def counterexample(self, limit: int = 60) -> str:
        """The trace as numbered steps (the middle elided beyond `limit` steps)."""
        steps = [f"  {i + 1:3d}. {label}" for i, label in enumerate(self.trace)]
        if len(steps) > limit:
            steps = steps[: limit // 2] + [f"  ... {len(steps) - limit} steps ..."] + steps[-limit // 2 :]
        lines = [self.summary(), *steps, f"  state: {self.final}"]
        if self.loop:
            lines.append("  then, with no further fault:")
            lines += [f"       {label}" for label in self.loop]
        return "\n".join(lines)

    def story(self) -> str:
        """The trace in one line: its faults and operator actions, and the step that broke."""
        if self.violation is None:
            return ""
        key = [t for t in self.trace if t.split(" ", 1)[0].isupper()]
        last = self.trace[-1] if self.trace else "(initial state)"
        if self.trace and last not in key:
            key.append(last)
        if self.loop:
            key.append(
                "(then nothing can happen)" if self.loop[-1].startswith("(nothing") else "(then it loops for ever)"
            )
        return " -> ".join(key)


def _trace(parent: list[int], labels: list[str], i: int) -> list[str]:
    out = []
    while parent[i] >= 0:
        out.append(labels[i])
        i = parent[i]
    return out[::-1]


def explore(model: Explorable[S], name: str, *, liveness: bool = True, max_states: int = 3_000_000) -> Report:
    """Explore every state reachable from the model's initial state."""
    t0 = time.perf_counter()
    init = model.initial()
    index: dict[S, int] = {init: 0}
    states: list[S] = [init]
    parent: list[int] = [-1]
    labels: list[str] = [""]
    src, dst = array("I"), array("I")
    v = model.violation(init)
    if v is not None:
        return Report(name, 1, 0, time.perf_counter() - t0, False, v, [], model.describe(init))
    i = 0
    transitions = 0
    complete = True
    while i < len(states):
        s = states[i]
        for label, ns in model.successors(s):
            transitions += 1
            j = index.get(ns)
            if j is None:
                j = len(states)
                index[ns] = j
                states.append(ns)
                parent.append(i)
                labels.append(label)
                v = model.violation(ns)
                if v is not None:
                    return Report(
                        name,
                        len(states),
                        transitions,
                        time.perf_counter() - t0,
                        False,
                        v,
                        _trace(parent, labels, j),
                        model.describe(ns),
                    )
            if liveness and j != i:
                src.append(i)
                dst.append(j)
        i += 1
        if len(states) > max_states:
            complete = False
            break
    n = len(states)
    report = Report(name, n, transitions, 0.0, complete)
    if liveness and complete:
        goals = [k for k in range(n) if model.goal(states[k])]
        report.goals = len(goals)
        stuck = _cannot_reach(n, src, dst, goals)
        if stuck is not None:
            k = stuck
            has_succ = any(True for _ in model.successors(states[k]))
            kind = "a livelock: the query loops for ever" if has_succ else "a deadlock: nothing can happen"
            report.violation = Violation(LIVENESS, f"from this state the query can never finish ({kind})")
            report.trace = _trace(parent, labels, k)
            report.final = model.describe(states[k])
            report.loop = _continuation(model, states[k])
    report.seconds = time.perf_counter() - t0
    return report


def _continuation(model: Explorable[S], s: S, limit: int = 40) -> list[str]:
    """Follow the first fault-free step from `s` until a state repeats or nothing can happen."""
    seen = {s: 0}
    out: list[str] = []
    for i in range(1, limit + 1):
        nxt = next(
            ((label, ns) for label, ns in model.successors(s) if not label.split(" ", 1)[0].isupper() and ns != s), None
        )
        if nxt is None:
            out.append("(nothing can happen any more)")
            return out
        label, s = nxt
        out.append(label)
        if s in seen:
            out.append(
                f"(back to the state after step {seen[s]} of this continuation: it loops for ever)"
                if seen[s]
                else "(back to the stuck state: it loops for ever)"
            )
            return out
        seen[s] = i
    out.append("...")
    return out


def _cannot_reach(n: int, src: array[int], dst: array[int], goals: list[int]) -> int | None:
    """The first state (in breadth-first order) from which no goal is reachable, or None."""
    # Predecessor lists in compressed form: for each state, the sources of its edges.
    start = array("I", [0]) * (n + 1)
    for d in dst:
        start[d + 1] += 1
    for k in range(n):
        start[k + 1] += start[k]
    fill = array("I", start)
    preds = array("I", [0]) * len(dst)
    for s, d in zip(src, dst):
        preds[fill[d]] = s
        fill[d] += 1
    alive = bytearray(n)
    todo = list(goals)
    for g in goals:
        alive[g] = 1
    while todo:
        k = todo.pop()
        for e in range(start[k], start[k + 1]):
            p = preds[e]
            if not alive[p]:
                alive[p] = 1
                todo.append(p)
    for k in range(n):
        if not alive[k]:
            return k
    return None
