"""Long steps report themselves in a log (issue 57 item 2): `progress.Progress` prints a plain line at least every
interval while a step runs when stderr is not a terminal, nothing under --quiet; a V1 conversion piped into a log
prints its calibration's progress as it goes, not all at the end."""

import io
import os
import subprocess
import sys
import threading
import time

import pytest

from diff_transformer import progress
from diff_transformer.cli.demo import shipped_assets


class _Log(io.StringIO):
    """A stderr that is not a terminal and notes when each line arrived."""

    def __init__(self):
        super().__init__()
        self.arrivals = []

    def write(self, text):
        self.arrivals += [time.monotonic()] * text.count("\n")
        return super().write(text)


def test_a_step_inside_one_long_call_still_reports(monkeypatch):
    monkeypatch.setenv(progress.INTERVAL_ENV, "0.05")
    log = _Log()
    monkeypatch.setattr(sys, "stderr", log)
    start = time.monotonic()
    with progress.Progress("calibrating V1", total=30, unit="layer") as report:
        report.update(7)
        time.sleep(0.5)  # one call that never returns to the step's loop
    lines = log.getvalue().splitlines()
    assert len(lines) >= 4 and lines[0].startswith("calibrating V1: layer 7/30, "), lines
    assert lines[0].endswith(" s") and lines[-1].startswith("calibrating V1: layer 7/30, done"), lines
    # they arrived while the call ran, one per interval (a timer can be late, never early), then the last one
    ticks = log.arrivals[:-1]
    assert ticks[0] - start < 0.45 and all(b - a >= 0.04 for a, b in zip(ticks, ticks[1:])), log.arrivals


def test_a_command_s_first_line_counts_its_silence_from_the_command_s_start(monkeypatch):
    """The V1 conversion's first line came 39 s after the command started (9 s of imports and loading, then 30 s of
    its first step): inside a command (`progress.command`, which `cli.main` opens) the first line of a step comes
    one interval after the command's start or its last line, whichever is later, and no later."""
    monkeypatch.setenv(progress.INTERVAL_ENV, "2")
    log = _Log()
    monkeypatch.setattr(sys, "stderr", log)
    with progress.command():
        started = time.monotonic()
        time.sleep(1.9)  # the command's work before its first step: silent
        with progress.Progress("sampling", total=3, unit="token"):
            time.sleep(1.5)  # outside a command the first line would come at 2 s into the step: none
        assert log.arrivals and log.arrivals[0] - started >= 1.99, log.arrivals  # a timer is late, never early
        assert log.getvalue().splitlines()[-1].startswith("sampling: token 0/3, done"), log.getvalue()
    assert progress._last_line == [None]  # outside a command again: a short step is silent
    with progress.Progress("sampling", total=3, unit="token"):
        time.sleep(0.1)
    assert len(log.getvalue().splitlines()) == 2, log.getvalue()


def test_disabled_progress_and_a_short_step_print_nothing(monkeypatch):
    log = _Log()
    monkeypatch.setattr(sys, "stderr", log)
    monkeypatch.setenv(progress.INTERVAL_ENV, "0.01")
    with progress.Progress("sampling", total=3, unit="token", enabled=False) as report:  # --quiet
        time.sleep(0.1)
        report.update(3)
    monkeypatch.setenv(progress.INTERVAL_ENV, "60")
    with progress.Progress("sampling", total=3, unit="token") as report:  # shorter than one interval
        report.update(3)
    assert log.getvalue() == ""


@pytest.mark.parametrize("value", ["", "0", "-1", "nan", "inf", "soon"])
def test_the_interval_is_30_s_unless_a_positive_number_is_set(monkeypatch, value):
    monkeypatch.setenv(progress.INTERVAL_ENV, value)
    assert progress.interval() == progress.INTERVAL_S == 30.0


def _convert_v1(tmp_path, name, *extra):
    """A V1 conversion of the tiny Llama with its stderr on a pipe, read as it comes: (rc, [(arrival, line)], exit
    time)."""
    with shipped_assets() as (model, heldout):
        data = tmp_path / "calibration.txt"
        data.write_text(heldout.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
        command = [sys.executable, "-m", "diff_transformer", "convert", str(model), str(tmp_path / name)]
        command += ["--diff-version", "1", "--calibration-data", str(data), *extra]
        env = {**os.environ, progress.INTERVAL_ENV: "0.2"}
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        lines = []
        reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), x) for x in child.stderr))
        reader.start()
        out = child.stdout.read()
        rc = child.wait(timeout=600)
        ended = time.monotonic()
        reader.join()
    return rc, lines, ended, out


@pytest.mark.slow
def test_a_v1_conversion_into_a_log_reports_as_it_goes(tmp_path):
    rc, lines, ended, out = _convert_v1(tmp_path, "v1")
    assert rc == 0, lines
    layers = [(at, line) for at, line in lines if line.startswith("calibrating V1: layer ")]
    assert layers and layers[-1][1].startswith("calibrating V1: layer 4/4, done"), lines
    assert all("%|" not in line for _, line in lines)  # no bar frames in a log
    # Written while the calibration ran, not flushed at exit: the lines' arrivals span several intervals.
    assert layers[-1][0] - layers[0][0] >= 0.6, layers
    assert "on 1,020 held-out tokens (4 blocks × 255) of the calibration text (--calibration-data" in out, out
    rc, lines, _, _ = _convert_v1(tmp_path, "quiet", "--quiet")
    assert rc == 0 and lines == [], lines
