"""Chat templates rendered in worker processes, so that a template that never ends can be stopped for real.

A Jinja template comes with a downloaded model and may loop for hours without writing a character. In a thread
nothing can stop such a loop: it keeps a core and the interpreter's lock busy for good, and every later request
slows. A worker process can be killed: past the deadline it is, a fresh one takes its place, and the server's
latency is back to normal. Requests and answers travel as JSON lines over the worker's pipes (nothing pickled).
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from typing import Any

from gptkit.chat import ChatTemplate, ChatTemplateError
from gptkit.worker import PACKAGE_ROOT, LineWorker

WORKERS = 2  # processes at most; each busy one holds a core, and rendering an ordinary template takes milliseconds
WORKER_COMMAND = (sys.executable, "-c", "from gptkit.chat import render_worker; render_worker()")

log = logging.getLogger("gptkit.serve")


class TemplateWorkers:
    """Renders one chat template in up to `size` worker processes, each render stopped after `seconds`."""

    def __init__(self, template: ChatTemplate, seconds: float, size: int = WORKERS) -> None:
        self.template, self.seconds, self.size = template, seconds, size
        self.idle: queue.LifoQueue[LineWorker] = queue.LifoQueue()
        self.started = 0  # processes alive, idle or rendering
        self.closed = False
        self.lock = threading.Lock()

    def warm(self) -> None:
        """Start one worker ahead of the first request (a start costs a fraction of a second)."""
        with self.lock:
            start = self.started == 0
            self.started += start
        if start:
            self.idle.put(self._start())

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, max_chars: int) -> str:
        """The messages rendered with the generation prompt; ChatTemplateError if the template fails, renders more
        than max_chars characters or is still rendering after the deadline (then its process is killed)."""
        if self.closed:
            raise ChatTemplateError("the server is shutting down; the chat template was not rendered")
        deadline = time.monotonic() + self.seconds
        request = {
            "source": self.template.source,
            "bos_token": self.template.bos_token,
            "eos_token": self.template.eos_token,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": True,
            "max_chars": max_chars,
        }
        answer = self._ask(request, deadline)
        if "error" in answer:
            raise ChatTemplateError(answer["error"])
        return answer["text"]

    def _ask(self, request: dict[str, Any], deadline: float) -> dict[str, Any]:
        """A worker's answer to request. A worker that dies before it answers is replaced and the request sent once
        more: the death may have come from outside (an operator's kill, the OOM killer) after the worker was taken,
        and a request never fails for a death it did not cause; a second death is the template's doing."""
        answer = self._ask_once(request, deadline)
        if answer is None:
            log.warning("a chat template's rendering process died before answering; rendering in another")
            answer = self._ask_once(request, deadline)
        if answer is None:
            raise ChatTemplateError("the chat template's rendering process died twice before answering; stopped")
        return answer

    def _ask_once(self, request: dict[str, Any], deadline: float) -> dict[str, Any] | None:
        """One worker's answer to request, or None if its process died first (it is then retired)."""
        worker = self._take(deadline)
        try:
            answer = worker.ask(request, deadline)
        except TimeoutError:
            self._retire(worker)
            log.warning("a chat template still rendering after %g s was stopped (its process ended)", self.seconds)
            raise ChatTemplateError(f"the chat template took more than {self.seconds:g} s to render; stopped") from None
        except (EOFError, OSError):  # the process died (a kill from outside, its memory cap): a broken pipe
            self._retire(worker)
            return None
        except ValueError:  # it wrote something that is not an answer line
            self._retire(worker)
            raise ChatTemplateError("the chat template's rendering process wrote garbage; stopped") from None
        except BaseException:  # (a request that cannot be sent, an interrupt): the worker's state is unknown
            self._retire(worker)
            raise
        if self.closed:
            self._retire(worker)
        else:
            self.idle.put(worker)
        return answer

    def close(self) -> None:
        """Kill every idle worker; a busy one ends when its render does, and no new one starts."""
        self.closed = True
        while True:
            try:
                worker = self.idle.get_nowait()
            except queue.Empty:
                return
            self._retire(worker)

    def _take(self, deadline: float) -> LineWorker:
        """An idle worker, a new one while fewer than size run, else the first to come free (or to be replaced)
        before deadline."""
        while True:
            try:
                worker = self.idle.get_nowait()
            except queue.Empty:
                pass
            else:
                if self._alive(worker):
                    return worker
                continue
            with self.lock:
                start = self.started < self.size
                self.started += start
            if start:
                return self._start()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChatTemplateError(
                    f"no chat template renderer came free within {self.seconds:g} s (the "
                    "others are busy with slow templates); try again"
                )
            try:
                worker = self.idle.get(timeout=min(remaining, 0.05))  # short: a killed worker frees a place too
            except queue.Empty:
                continue
            if self._alive(worker):
                return worker

    def _alive(self, worker: LineWorker) -> bool:
        """Whether an idle worker still runs; one that died while idle (killed from outside) is reaped and its place
        freed, so that no request is sent to it and fails for a death it did not cause."""
        if worker.process.poll() is None:
            return True
        log.warning(
            "a chat template rendering process had ended while idle (exit %s); starting another",
            worker.process.returncode,
        )
        self._retire(worker)
        return False

    def _start(self) -> LineWorker:
        """A new worker process (its place already counted in started)."""
        try:
            return LineWorker(WORKER_COMMAND, PACKAGE_ROOT)
        except OSError as err:
            with self.lock:
                self.started -= 1
            raise ChatTemplateError(f"cannot start a process to render the chat template: {err}") from None

    def _retire(self, worker: LineWorker) -> None:
        worker.kill()
        with self.lock:
            self.started -= 1
