"""Chat templates rendered in worker processes, for `diff-transformer serve` (issue 56 item 2).

`chat_templates` bounds a render between its Python steps and before the builders its sandbox knows, but one C call
can build gigabytes while holding the GIL (`{{ [[0] * 4000000] * 4000000 }}`, `tojson(indent=...)`,
`indent(...)`, `wordwrap(wrapstring=...)`): in the server's process that froze every request, /health included,
while memory grew ~25 MB/s. Here a render runs in a worker process whose address space is capped (`RLIMIT_AS`: what
it holds after its imports plus `WORKER_MEMORY_BYTES`; a builder past it fails with MemoryError inside the worker) and
that is killed when it runs past `chat_templates.RENDER_SECONDS` plus `KILL_MARGIN_S` (the worker's own step and time
bounds answer first whenever Python code runs). The server's thread waiting for the answer waits on a pipe, without
the GIL, so the event loop answers on.

What crosses the pipe is JSON, one line each way (nothing is unpickled): the template's source and the render's
keyword arguments (messages, tools, special tokens: what transformers passes), and back the text or the error's kind
and message. A render whose arguments are not JSON (transformers passes none such to the server's templates) renders
in the calling process as before.

`RenderPool(size)`: `size` workers, started on first use; `chat_templates.isolate(pool.render)` routes every bounded
render of this process there. benchmarks/render_isolation.py measures the cost per render."""

import json
import os
import queue
import subprocess
import sys
import threading

from ..generation.chat_templates import _cap_memory, answer_of, text_of


KILL_MARGIN_S = 1.0  # past RENDER_SECONDS: the worker's own bound answers first whenever Python code runs


class Worker:
    """One render process (`python -m diff_transformer.serving.render_pool`), talking JSON lines over its pipes."""

    def __init__(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "diff_transformer.serving.render_pool"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        if self._line(timeout=300) != {"ready": True}:
            self.kill()
            raise RuntimeError("the chat-template render worker did not start")

    def _line(self, timeout: float):
        """The worker's next line as JSON, or None when it sent none within TIMEOUT seconds (or died)."""
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                return None
        line = self.process.stdout.readline()
        return json.loads(line) if line else None

    def render(self, source: str, payload: str, timeout: float):
        self.process.stdin.write((json.dumps({"source": source, "kwargs": payload}) + "\n").encode())
        self.process.stdin.flush()
        return self._line(timeout)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


class RenderPool:
    """`size` render workers; `render(source, args, kwargs)` is what `chat_templates.isolate` takes. A worker that
    overran its time, or died, is replaced."""

    def __init__(self, size: int = 2):
        self.size = size
        self.idle: queue.Queue = queue.Queue()
        self.started = 0
        self.lock = threading.Lock()

    def _take(self) -> Worker:
        with self.lock:
            start = self.started < self.size and self.idle.empty()
            if start:
                self.started += 1
        if start:
            try:
                return Worker()
            except BaseException:
                with self.lock:
                    self.started -= 1
                raise
        return self.idle.get()

    def _replace(self) -> None:
        """A new worker for one killed, started in the background (a start takes seconds: the imports)."""

        def start() -> None:
            try:
                self.idle.put(Worker())
            except Exception:
                with self.lock:
                    self.started -= 1

        threading.Thread(target=start, name="render worker", daemon=True).start()

    def warm(self) -> None:
        """Start every worker now, in the background, so the first requests do not wait for their imports."""
        with self.lock:
            missing = self.size - self.started
            self.started = self.size
        for _ in range(missing):
            self._replace()

    def render(self, source: str, args: tuple, kwargs: dict):
        """The text of SOURCE rendered with ARGS/KWARGS in a worker; NotImplemented when they are not JSON (then
        the caller renders in its own process)."""
        from ..generation.chat_templates import RENDER_SECONDS

        if args:
            return NotImplemented
        try:
            payload = json.dumps(kwargs, ensure_ascii=False)
        except (TypeError, ValueError):
            return NotImplemented
        worker = self._take()
        healthy = False
        try:
            answer = worker.render(source, payload, RENDER_SECONDS + KILL_MARGIN_S)
            healthy = answer is not None
        finally:
            if healthy:
                self.idle.put(worker)
            else:  # past its time (a C call holding its GIL) or dead (its memory): replaced
                worker.kill()
                self._replace()
        return text_of(answer)

    def close(self) -> None:
        while not self.idle.empty():
            self.idle.get().kill()


def main() -> None:
    """The worker: one JSON request per line on stdin, one JSON answer per line on stdout."""
    from transformers.utils import chat_template_utils

    from ..generation.chat_templates import bound_chat_templates, in_process, isolate

    bound_chat_templates()
    isolate(in_process)  # this process is the isolation: no child forked per render
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing a template prints reaches the pipe
    _cap_memory()
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:

        def render(line=line) -> str:
            request = json.loads(line)
            template = chat_template_utils._compile_jinja_template(request["source"])
            return template.render(**json.loads(request["kwargs"]))

        answer = answer_of(render)
        out.write(json.dumps(answer, ensure_ascii=False) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
