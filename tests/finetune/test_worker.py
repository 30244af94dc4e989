"""gptkit.worker: a reward's process and every process its code starts end together (timeout, close, parent gone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gptkit.finetune.rewards import RewardError, RewardProcess

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups are POSIX")

# A reward that starts a sleeping grandchild, writes its id where the test reads it, then scores (or hangs).
FORKING_REWARD = """
import subprocess, sys, time

def score(prompt, completion, row):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(row["pid_file"], "w") as f:
        f.write(str(child.pid))
    if row.get("hang"):
        time.sleep(600)
    return 1.0
"""


def _gone(pid: int, within: float = 10.0) -> bool:
    """Whether process pid has ended (a zombie awaiting its reaper counts as ended) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def forking_reward(tmp_path: Path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "forking_reward_mod.py").write_text(textwrap.dedent(FORKING_REWARD))
    return "forking_reward_mod:score"


def _grandchild(pid_file: Path) -> int:
    for _ in range(200):  # written just before the reward returns or hangs
        if pid_file.is_file() and pid_file.read_text():
            return int(pid_file.read_text())
        time.sleep(0.05)
    raise AssertionError("the reward did not start its child")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads Linux's /proc")
def test_a_process_a_reward_started_ends_when_the_reward_is_closed(forking_reward: str, tmp_path: Path) -> None:
    reward = RewardProcess(forking_reward, seconds=60)
    pid_file = tmp_path / "grandchild.pid"
    assert reward(prompt="p", completion="c", row={"pid_file": str(pid_file)}) == 1.0
    grandchild = _grandchild(pid_file)
    assert not _gone(grandchild, within=0.2)  # alive while the run goes on
    reward.close()  # what the run's end does (and the object's finaliser)
    assert _gone(grandchild)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads Linux's /proc")
def test_a_process_a_reward_started_ends_when_the_call_times_out(forking_reward: str, tmp_path: Path) -> None:
    reward = RewardProcess(forking_reward, seconds=3)
    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(RewardError, match="was still scoring after 3 s"):
        reward(prompt="p", completion="c", row={"pid_file": str(pid_file), "hang": True})
    assert _gone(_grandchild(pid_file))
    reward.close()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads Linux's /proc")
def test_a_process_a_reward_started_ends_when_the_training_process_is_killed(
    forking_reward: str, tmp_path: Path
) -> None:
    # The training process dies by SIGKILL (no finaliser runs): the reward's process sees its parent gone and ends
    # its group.
    pid_file = tmp_path / "grandchild.pid"
    script = (
        f"from gptkit.finetune.rewards import RewardProcess\n"
        f"RewardProcess({forking_reward!r}, 60)('p', 'c', {{'pid_file': {str(pid_file)!r}}})\n"
        "import time; time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
    try:
        grandchild = _grandchild(pid_file)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert _gone(grandchild)
