"""Progress of a long task: a live line on a terminal, a line a minute in a file; driven by a fake clock."""

from __future__ import annotations

import io

from kvpolicy.tasks.base import Context
from kvpolicy.tasks.progress import Progress, duration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_file_gets_a_line_a_minute_with_rows_tokens_per_second_and_time_left():
    clock, out = Clock(), io.StringIO()
    progress = Progress(out, live=False, clock=clock)
    with progress.task("ppl (1500 tokens)", 1500, rows=17, unit="tokens") as task:
        for _ in range(1500):
            clock.now += 0.44  # 11 minutes in all
            task.advance(1, tokens=17)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10  # one a minute, none redrawn
    assert lines[0] == "ppl (1500 tokens) (17 rows): 137/1500 tokens (9%), 39 tokens/s, 1m00s elapsed, ~10m00s left"
    assert lines[-1] == "ppl (1500 tokens) (17 rows): 1370/1500 tokens (91%), 39 tokens/s, 10m03s elapsed, ~57s left"
    assert "\r" not in out.getvalue()


def test_a_terminal_gets_one_live_line_with_a_bar_cleared_at_the_end():
    clock, out = Clock(), io.StringIO()
    progress = Progress(out, live=True, clock=clock, redraw=0.2)
    with progress.task("passkey", 4, rows=3, unit="prompts") as task:
        for _ in range(4):
            clock.now += 1.0
            task.advance(1, tokens=300)
    text = out.getvalue()
    frames = text.split("\r")[1:-1]  # the clearing ends with a carriage return too
    assert "\n" not in text and len(frames) == 5  # four redraws and the clearing
    assert frames[1].startswith("[############............] passkey (3 rows): 2/4 prompts (50%), 300 tokens/s, 2s elapsed, ~2s left")
    assert frames[-1].strip() == ""


def test_live_redraws_are_throttled_and_the_stream_decides_the_mode():
    clock, out = Clock(), io.StringIO()
    progress = Progress(out, live=True, clock=clock, redraw=0.2)
    with progress.task("fast", 1000) as task:
        for _ in range(1000):
            clock.now += 0.001
            task.advance()
    assert out.getvalue().count("\r") <= 1000 * 0.001 / 0.2 + 3
    assert Progress(io.StringIO()).live is False  # not a terminal: lines, not redraws


def test_context_track_reports_through_the_progress():
    clock, out = Clock(), io.StringIO()
    ctx = Context(model=None, tokenizer=None, text_ids=None, progress=Progress(out, live=False, clock=clock, every=5))
    items = []
    for item in ctx.track(range(3), 3, "task", rows=2, unit="samples", tokens=lambda i: 100 * (i + 1)):
        clock.now += 10
        items.append(item)
    assert items == [0, 1, 2]
    assert out.getvalue().splitlines()[-1] == "task (2 rows): 3/3 samples (100%), 20 tokens/s, 30s elapsed"
    assert list(Context(model=None, tokenizer=None, text_ids=None).track([1, 2], 2, "silent")) == [1, 2]


def test_durations():
    assert [duration(s) for s in (0, 42.4, 185, 3725)] == ["0s", "42s", "3m05s", "1h02m"]
