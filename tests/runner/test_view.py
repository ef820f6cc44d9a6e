import io

from rich.console import Console

from diloco.runner.view import LearnerRow, ProgressView, Snapshot, render_line, render_table


def snapshot(elapsed: float) -> Snapshot:
    rows = (
        LearnerRow("learner-0", "training", 42, 8000.0, 1, 1.0),
        LearnerRow("learner-1", "down", 30, 0.0, 0, 1.18),
    )
    return Snapshot(
        "decoupled", elapsed, rows, version=7, rounds=12, loss=3.25, bytes_sent=2048, tokens=36_864
    )


def test_plain_line_shows_learner_states_and_global_progress() -> None:
    line = render_line(snapshot(12.0))
    assert "v7 rounds=12 loss=3.250" in line
    assert "learner-0=training@42 tok/s=8000 stale=1 learner-1=down@30 tok/s=0 stale=0" in line
    assert "tokens=36,864" in line
    assert "sent=2.0 KiB" in line


def test_table_lists_every_learner() -> None:
    console = Console(file=io.StringIO(), width=120)
    console.print(render_table(snapshot(3.0)))
    text = console.file.getvalue()
    assert "learner-1" in text
    assert "down" in text
    assert "held-out loss 3.2500" in text


def test_without_a_terminal_lines_are_printed_periodically() -> None:
    out = io.StringIO()
    with ProgressView(out=out, line_every_s=5.0) as view:
        for t in (0.0, 1.0, 4.9, 5.0, 6.0, 10.5):
            view.update(snapshot(t))
        view.note("chaos: killed learner-1")
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # at 0, 5.0, 10.5 and the note
    assert lines[-1] == "chaos: killed learner-1"
