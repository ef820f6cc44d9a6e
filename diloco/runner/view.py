"""The live terminal view: a rich table on a terminal, plain periodic lines otherwise."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import IO

from diloco_core.progress import describe_duration
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from diloco.runner.traffic import human_bytes


@dataclass(frozen=True)
class LearnerRow:
    learner_id: str
    state: str  # training / down / rejoining / starting / finished / failed
    step: int
    tokens_per_s: float
    staleness: int
    speed_factor: float


@dataclass(frozen=True)
class Snapshot:
    mode: str
    elapsed_s: float
    learners: tuple[LearnerRow, ...]
    version: int
    rounds: int
    loss: float | None
    bytes_sent: int
    tokens: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    eta_s: float | None = None  # until the first budget (time, tokens, steps) is spent


_STATE_STYLE = {
    "training": "green",
    "down": "red",
    "rejoining": "yellow",
    "starting": "yellow",
    "finished": "blue",
}


def render_line(s: Snapshot) -> str:
    """One plain line: the global progress, then per learner ``id=state@step tok/s=N stale=N``."""
    learners = " ".join(
        f"{r.learner_id}={r.state}@{r.step} tok/s={r.tokens_per_s:.0f} stale={r.staleness}"
        for r in s.learners
    )
    loss = "n/a" if s.loss is None else f"{s.loss:.3f}"
    return (
        f"[{s.elapsed_s:6.1f}s] {s.mode} v{s.version} rounds={s.rounds} loss={loss} "
        f"tokens={s.tokens:,} sent={human_bytes(s.bytes_sent)} eta={describe_duration(s.eta_s)} | {learners}"
    )


def render_table(s: Snapshot) -> Group:
    table = Table(
        title=f"diloco run ({s.mode}) — {s.elapsed_s:.0f} s, about {describe_duration(s.eta_s)} to go",
        expand=False,
    )
    for name in ("learner", "state", "step", "tokens/s", "staleness", "speed"):
        table.add_column(name, justify="left" if name in ("learner", "state") else "right")
    for r in s.learners:
        table.add_row(
            r.learner_id,
            Text(r.state, style=_STATE_STYLE.get(r.state, "magenta")),
            str(r.step),
            f"{r.tokens_per_s:,.0f}",
            str(r.staleness),
            f"{r.speed_factor:g}x",
        )
    loss = "n/a" if s.loss is None else f"{s.loss:.4f}"
    summary = Text(
        f"global version {s.version} · rounds {s.rounds} · held-out loss {loss} · "
        f"tokens {s.tokens:,} · bytes sent {human_bytes(s.bytes_sent)}"
    )
    notes = [Text(n, style="dim") for n in s.notes[-5:]]
    return Group(table, summary, *notes)


class ProgressView:
    """Shows snapshots: a live table when ``out`` is a terminal, else a line every ``line_every_s``."""

    def __init__(self, *, plain: bool = False, out: IO[str] | None = None, line_every_s: float = 5.0) -> None:
        self._out = out or sys.stdout
        self._live_mode = not plain and self._out.isatty()
        self._line_every_s = line_every_s
        self._last_line_s: float | None = None
        self._live: Live | None = None

    def __enter__(self) -> ProgressView:
        if self._live_mode:
            self._live = Live(console=Console(file=self._out), refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def update(self, snapshot: Snapshot) -> None:
        if self._live is not None:
            self._live.update(render_table(snapshot))
            return
        if self._last_line_s is None or snapshot.elapsed_s - self._last_line_s >= self._line_every_s:
            self._last_line_s = snapshot.elapsed_s
            print(render_line(snapshot), file=self._out, flush=True)

    def note(self, message: str) -> None:
        """An event worth a line of its own (a kill, a restart) in plain mode."""
        if self._live is None:
            print(message, file=self._out, flush=True)
