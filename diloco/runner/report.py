"""The end-of-run report built from a ``RunRecord`` (pure): goodput, bytes, loss, chaos outcome."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco.runner.record import KillRecord, RunRecord
from diloco.runner.slots import learner_label
from diloco.runner.timeline import Goodput, goodput_of, launch_durations
from diloco.runner.traffic import Traffic, human_bytes


@dataclass(frozen=True)
class Report:
    record: RunRecord
    goodput: Goodput
    traffic: Traffic

    @property
    def first_loss(self) -> float | None:
        return self.record.losses[0].loss if self.record.losses else None

    @property
    def final_loss(self) -> float | None:
        return self.record.losses[-1].loss if self.record.losses else None

    @property
    def loss_went_down(self) -> bool | None:
        if self.first_loss is None or self.final_loss is None or len(self.record.losses) < 2:
            return None
        return self.final_loss < self.first_loss

    @property
    def unrejoined(self) -> list[int]:
        """Learners killed at least once whose last kill was never followed by a rejoin."""
        last: dict[int, bool] = {}
        for kill in self.record.kills:
            last[kill.learner] = kill.rejoined_at_s is not None
        return sorted(learner for learner, ok in last.items() if not ok)

    @property
    def killed_learners(self) -> list[int]:
        return sorted({kill.learner for kill in self.record.kills})

    def to_dict(self) -> dict[str, Any]:
        return {
            "goodput": self.goodput.to_dict(),
            "traffic": self.traffic.to_dict(),
            "first_loss": self.first_loss,
            "final_loss": self.final_loss,
            "loss_went_down": self.loss_went_down,
            "killed_learners": self.killed_learners,
            "unrejoined": self.unrejoined,
            "kills": len(self.record.kills),
            "total_tokens": self.record.total_tokens,
            "total_learner_steps": self.record.total_learner_steps,
        }


def build_report(record: RunRecord) -> Report:
    traffic = Traffic(
        num_params=record.num_params,
        total_learner_steps=record.total_learner_steps,
        sent_bytes=record.sent_bytes,
        received_bytes=record.received_bytes,
        wire_sent=record.wire_sent_bytes + record.allreduce_bytes,
        wire_received=record.wire_received_bytes + record.allreduce_bytes,
    )
    return Report(record=record, goodput=goodput_of(record.timeline), traffic=traffic)


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)


def render_markdown(report: Report) -> str:
    r, g, t = report.record, report.goodput, report.traffic
    lines = [
        f"# DiLoCo run: {r.mode}",
        "",
        f"- run folder: `{r.run_dir}`",
        f"- stopped: {r.stop_reason}, after {r.duration_s:.1f} s",
        f"- learners: {len(r.learners)}, model parameters: {r.num_params:,}",
        f"- device: {_device_line(r)}",
        f"- tokens: {r.total_tokens:,} in {r.total_learner_steps:,} learner steps; global rounds: {r.rounds}",
        *_resumed_lines(r),
        "",
        "## Held-out loss of the global model",
        "",
        f"- first: {_fmt(report.first_loss)}, final: {_fmt(report.final_loss)} ({len(r.losses)} evaluations)",
        "",
        "## Goodput",
        "",
        f"**{_fmt(g.goodput, '.1%')}** = useful {g.useful_s:.1f} s / allocated {g.total_s:.1f} s of learner time",
        "",
        *_startup_lines(report),
        "",
        "| training | blocked on sync | rolled back | starting/rejoining | down |",
        "|---:|---:|---:|---:|---:|",
        f"| {g.training_s:.1f} s | {g.blocked_s:.1f} s | {g.lost_s:.1f} s | {g.starting_s:.1f} s | {g.down_s:.1f} s |",
        "",
        "## Bytes on the wire",
        "",
        "At the socket: every byte the learners' connections carried (heads, bodies, heartbeats, "
        "long-polls, first downloads, TLS), as the kernel counts it; payload: the codec bytes alone. "
        f"Data-parallel bf16 moves {human_bytes(t.data_parallel_bytes)} each way for the same steps "
        f"(= {t.num_params:,} params x 2 B x 2 x {t.total_learner_steps:,} steps).",
        "",
        "| direction | at the socket | less than data-parallel bf16 | payload | payload less than bf16 |",
        "|---|---:|---:|---:|---:|",
        f"| learners → synchronizer | {human_bytes(t.wire_sent)} | {_fmt(t.reduction_up, '.1f')}x | "
        f"{human_bytes(t.sent_bytes)} | {_fmt(t.payload_reduction_up, '.1f')}x |",
        f"| synchronizer → learners | {human_bytes(t.wire_received)} | {_fmt(t.reduction_down, '.1f')}x | "
        f"{human_bytes(t.received_bytes)} | {_fmt(t.payload_reduction_down, '.1f')}x |",
        "",
        "## Chaos",
        "",
    ]
    lines += _chaos_lines(report)
    lines += [
        "",
        "## Learners",
        "",
        "| learner | speed | steps | tokens | tokens/s | MFU | bytes sent | launches | finished |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines += [
        f"| {x.learner_id if r.mode != 'ddp' else learner_label(r.mode, x.learner, x.learner_id)} | {x.speed_factor:g} | {x.steps} | {x.tokens:,} | "
        f"{_fmt(x.tokens_per_s, ',.0f')} | {_fmt(None if x.mfu is None else 100 * x.mfu, '.1f')}{'' if x.mfu is None else ' %'} | "
        f"{human_bytes(x.bytes_sent)} | {x.launches} | {'yes' if x.finished else 'no'} |"
        for x in r.learners
    ]
    return "\n".join(lines) + "\n"


def _resumed_lines(r: RunRecord) -> list[str]:
    if not r.resumed:
        return []
    steps = ", ".join(f"{name} at step {step}" for name, step in sorted(r.resumed_from.items()))
    return [
        f"- resumed (`--resume`): {steps or 'no learner stepped'}; tokens, steps and bytes count from there"
    ]


def _device_line(r: RunRecord) -> str:
    gpus = sorted({x.gpu for x in r.learners if x.gpu is not None})
    if not gpus:
        return "CPU (MFU n/a: no known peak)"
    return (
        f"GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, gpus))} (learner → GPU: "
        + ", ".join(f"{x.learner}→{x.gpu}" for x in r.learners)
        + "); MFU against the GPU's dense bf16 peak"
    )


def _startup_lines(report: Report) -> list[str]:
    g = report.goodput
    first, later = launch_durations(report.record.timeline.intervals)
    share = g.startup_s / g.total_s if g.total_s > 0 else None
    lines = [
        f"- start-up (each learner's first launch to its first step, failures during it included): "
        f"{g.startup_s:.1f} s of learner time ({_fmt(share, '.1%')} of allocated)",
        f"- steady state (everything after it): **{_fmt(g.steady_goodput, '.1%')}** = useful {g.useful_s:.1f} s / "
        f"{g.steady_s:.1f} s",
    ]
    if first:
        lines.append(
            f"- launch to first step: {_mean(first):.1f} s on average at start ({len(first)} launches)"
            + (f", {_mean(later):.1f} s on restarts ({len(later)})" if later else "")
        )
    return lines


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _rejoined(kill: KillRecord) -> str:
    if kill.rejoined_at_s is None and kill.killed_again_at_s is not None:
        return f"killed again at {kill.killed_again_at_s:.1f} s"
    return _fmt(kill.rejoined_at_s, ".1f")


def _chaos_lines(report: Report) -> list[str]:
    kills = report.record.kills
    if not kills:
        return ["No learner was killed."]
    lines = [
        f"{len(kills)} kills of learners {report.killed_learners}.",
        "",
        "| learner | killed at | step | restarted | rejoined |",
        "|---|---:|---:|---:|---:|",
    ]
    for k in kills:
        lines.append(
            f"| {k.learner} | {k.at_s:.1f} s | {k.step} | {_fmt(k.restarted_at_s, '.1f')} | {_rejoined(k)} |"
        )
    if report.unrejoined:
        lines += ["", f"Not rejoined by the end: learners {report.unrejoined}."]
    else:
        lines += ["", "Every killed learner rejoined."]
    return lines
