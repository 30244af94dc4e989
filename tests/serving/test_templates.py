"""Chat template workers (gptkit.serving.templates): a worker that dies is replaced, and a request never fails for a
death it did not cause."""

from __future__ import annotations

import logging
import os
import signal
import sys

import pytest

from gptkit.chat import ChatTemplate, ChatTemplateError
from gptkit.serving import templates
from gptkit.serving.templates import TemplateWorkers

HELLO = [{"role": "user", "content": "hi"}]


def test_a_worker_that_dies_after_it_was_taken_is_replaced_and_the_request_answered(monkeypatch, caplog):
    # The window between the liveness check of an idle worker and the request it is sent: the check said alive,
    # then the worker was killed from outside (an operator's kill, the OOM killer).
    monkeypatch.setattr(TemplateWorkers, "_alive", lambda self, worker: True)
    workers = TemplateWorkers(ChatTemplate("{{ messages[0].content }}!"), 5.0, size=1)
    try:
        workers.warm()
        idle = workers.idle.queue[0]
        os.kill(idle.process.pid, signal.SIGKILL)
        idle.process.wait()
        with caplog.at_level(logging.WARNING, logger="gptkit.serve"):
            assert workers.render(HELLO, None, 1000) == "hi!"
        assert "died before answering; rendering in another" in caplog.text
        assert workers.started == workers.idle.qsize() == 1 and workers.idle.queue[0] is not idle
        assert idle.process.returncode == -signal.SIGKILL  # (reaped, not left a zombie)
    finally:
        workers.close()


def test_a_worker_that_dies_again_on_the_same_request_fails_it_in_one_line(monkeypatch):
    monkeypatch.setattr(templates, "WORKER_COMMAND", (sys.executable, "-c", "pass"))  # every worker ends at once
    workers = TemplateWorkers(ChatTemplate("{{ messages[0].content }}"), 5.0, size=2)
    try:
        with pytest.raises(
            ChatTemplateError,
            match=r"^the chat template's rendering process died twice before "
            r"answering; stopped$",
        ):
            workers.render(HELLO, None, 1000)
        assert workers.started == 0  # both places given back
    finally:
        workers.close()
