"""Progress of a long step, on a terminal and in a log alike: a tqdm bar when stderr is a terminal, else a plain
line (what, how far, seconds so far) at least every `interval()` seconds from a timer thread, so that a conversion
or a niah grid run under CI, nohup or a scheduler never looks hung (a bar written into a file arrives as one line
at the end, if at all). Disabled (--quiet): nothing at all."""

import contextlib
import os
import sys
import threading
import time


INTERVAL_S = 30.0  # the longest a log waits for a line while a step runs (issue 57: "at least every 30 s")
INTERVAL_ENV = "DIFF_TRANSFORMER_PROGRESS_INTERVAL"  # seconds; tests set a fraction of one

# When the running command started or last printed a progress line (`command`); None outside a command. A step's
# first line then comes `interval()` after that, not after the step began: the imports and loading before a first
# step are silence in a log too (a V1 conversion's first line came 39 s after the command started, 9 s of it before
# its first step).
_last_line: list[float | None] = [None]


def interval() -> float:
    """`INTERVAL_S`, or the positive number of seconds `$DIFF_TRANSFORMER_PROGRESS_INTERVAL` says."""
    try:
        value = float(os.environ.get(INTERVAL_ENV, ""))
    except ValueError:
        return INTERVAL_S
    return value if 0 < value < float("inf") else INTERVAL_S


@contextlib.contextmanager
def command():
    """Around one command of the command line (`cli.main`): the silence a log hears counts from its start."""
    _last_line[0] = time.monotonic()
    try:
        yield
    finally:
        _last_line[0] = None


class Progress:
    """`with Progress("calibrating V1", total=30, unit="layer", enabled=not quiet) as p: ... p.update(1)`.

    `detail` (also settable by `update`) says what the step is doing now ("loading SRC"); `total` None counts
    without a total; `bar=False`: no bar on a terminal (a step made of stages, whose inner steps have their own
    bars), the lines in a log all the same; `leave`: the finished bar stays on the terminal. In a log, a line is
    printed every `interval()` seconds while the step runs (from a daemon thread: a step inside one long C call
    still reports), and a last line when it ends if any line was printed."""

    def __init__(
        self,
        what: str,
        total: int | None = None,
        unit: str = "",
        *,
        enabled: bool = True,
        detail: str = "",
        bar: bool = True,
        leave: bool = False,
    ):
        self.what, self.total, self.unit, self.detail = what, total, unit, detail
        self.done, self.lines = 0, 0
        self._start = time.monotonic()
        self._bar = self._thread = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        if not enabled:
            return
        if sys.stderr.isatty():
            if not bar:
                return
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=what, unit=unit or "it", leave=leave)
            if detail:
                self._bar.set_postfix_str(detail)
        else:
            self._thread = threading.Thread(target=self._tick, name=f"progress: {what}", daemon=True)
            self._thread.start()

    def line(self) -> str:
        """ "calibrating V1: layer 7/30, loading weights, 41 s"."""
        count = f"{self.unit} {self.done}".strip() + (f"/{self.total}" if self.total is not None else "")
        counted = self.unit or self.total is not None
        elapsed = f"{time.monotonic() - self._start:.0f} s"
        parts = [count] * bool(counted) + [self.detail] * bool(self.detail) + [elapsed]
        return f"{self.what}: {', '.join(parts)}"

    def _say(self) -> None:
        with self._lock:
            print(self.line(), file=sys.stderr, flush=True)
            self.lines += 1
            if _last_line[0] is not None:
                _last_line[0] = time.monotonic()

    def _tick(self) -> None:
        last = _last_line[0]
        wait = interval() if last is None else max(0.0, interval() - (time.monotonic() - last))
        while not self._stop.wait(wait):
            self._say()
            wait = interval()

    def update(self, n: int = 1, detail: str | None = None) -> None:
        self.done += n
        if detail is not None:
            self.detail = detail
        if self._bar is not None:
            self._bar.update(n)
            if detail is not None:
                self._bar.set_postfix_str(detail)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            if self.lines:  # a log that heard of the step hears that it ended
                self.detail = "done"
                self._say()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["INTERVAL_ENV", "INTERVAL_S", "Progress", "interval"]
