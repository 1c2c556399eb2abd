"""How `follow` shows a job's progress: in a pipe or a log one line per change (no carriage returns run
together) and each note once; on a terminal a bar that never says "succeeded" short of 100 %."""

from __future__ import annotations

import io
from typing import Any

import pytest

from app.api.client import BarProgress, follow

JOB = "96023330-aaaa-4bbb-8ccc-000000000000"
NOTE = "rendered with dummy weights"


def state(status: str, done: int, total: int = 150, notes: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"id": JOB, "status": status, "progress": {"frames_done": done, "frames_total": total},
            "notes": list(notes)}


class Scripted:
    """A client whose job reads return the given states, the last one for ever."""

    def __init__(self, states: list[dict[str, Any]]) -> None:
        self.states = states

    def job(self, job_id: str) -> dict[str, Any]:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]


def test_a_pipe_gets_one_line_per_change_and_each_note_once(capsys: pytest.CaptureFixture[str]) -> None:
    states = [state("queued", 0, 0), state("queued", 0, 0), state("running", 0, notes=(NOTE,)),
              state("running", 50, notes=(NOTE,)), state("running", 50, notes=(NOTE,)),
              state("succeeded", 150, notes=(NOTE,))]
    assert follow(Scripted(states), JOB, poll_s=0)["status"] == "succeeded"
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines() == [
        "job 96023330: queued, 0/? frames",
        f"note: job 96023330: {NOTE}",
        "job 96023330: running, 0/150 frames (0 %)",
        "job 96023330: running, 50/150 frames (33 %)",
        "job 96023330: succeeded, 150/150 frames (100 %)",
    ]


def test_the_bar_reaches_100_percent_before_it_says_succeeded() -> None:
    out = io.StringIO()
    bar = BarProgress(JOB, file=out)
    for job in (state("running", 50), state("succeeded", 150)):
        bar.update(job)
    bar.close()
    frames = [f for f in out.getvalue().replace("\n", "\r").split("\r") if f.strip()]
    said = [f for f in frames if "succeeded" in f]
    assert said and all("100%" in f and "150/150" in f for f in said), frames
