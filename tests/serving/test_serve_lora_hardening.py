"""Run-time LoRA adapters that cannot hurt the server (issue 57): cached prefixes are keyed by an adapter's weights,
not its name; files that are not regular files are refused before they are opened, and reading runs off the engine
thread under a deadline; a damaged LoRA directory is one line (exit 2) or a 400 naming the field; a request body
nested deeper than the JSON parser goes is a 400 naming the field."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gptkit.cli import main
from gptkit.errors import GptkitError
from gptkit.formats.lora import CONFIG_FILE, WEIGHTS_FILE
from gptkit.serving import lora_registry
from gptkit.serving.server import ServeOptions, build_app
from tests.serving.servers import live_server, serve_process
from tests.serving.test_serve_lora import KEY, _base, _lora

HEADERS = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3 + "Then"  # 139 bytes: two whole 64-token blocks


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hardening")
    base = _base(root)
    return {
        "base": base,
        "alice": _lora(base, root / "alice", 1, "all", 4),
        "bob": _lora(base, root / "bob", 2, "all", 4),
    }


@pytest.fixture(scope="module")
def url(dirs) -> Iterator[str]:
    """A server of the base that loads adapters at run time (behind the key), without a prefix cache."""
    with _serving(dirs["base"], cache_ram=0) as url:
        yield url


@pytest.fixture(scope="module")
def child_url(dirs) -> Iterator[str]:
    """The same server as `url`, as a child process: a test that could leave the server blocked in a system call
    (a FIFO's open, an endless read of a device) fails at its request's timeout instead of hanging the test run."""
    with serve_process(dirs["base"], ["--api-key", KEY, "--cache-ram", "0"]) as url:
        yield url


def _logprobs(url: str, model: str) -> list[float]:
    reply = httpx.post(
        f"{url}/v1/completions",
        headers=HEADERS,
        timeout=60,
        json={"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0},
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["logprobs"]["token_logprobs"]


def _serving(base: Path, **options) -> contextlib.AbstractContextManager[str]:
    return live_server(build_app(base, ServeOptions(api_key=KEY, **options)))


def _load(url: str, name: str, path: Path | str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/load_lora_adapter", headers=HEADERS, json={"lora_name": name, "lora_path": str(path)}, timeout=60
    )


# ---------------------------------------------------------------- item 2: cached blocks keyed by the weights


def test_a_name_reloaded_with_other_weights_does_not_reuse_the_old_weights_cached_prefix(dirs, tmp_path):
    with _serving(dirs["base"], lora=(f"y={dirs['bob']}",), cache_ram=0) as url:
        cold_bob = _logprobs(url, "y")
    with _serving(dirs["base"], lora=(f"y={dirs['alice']}",), cache_ram=1 << 24) as url:
        alice = _logprobs(url, "y")  # her prefix blocks go into the cache
        assert httpx.post(f"{url}/v1/unload_lora_adapter", headers=HEADERS, json={"lora_name": "y"}).status_code == 200
        assert _load(url, "y", dirs["bob"]).status_code == 200
        hot_bob = _logprobs(url, "y")
    assert alice != cold_bob  # the two adapters differ where it shows
    assert hot_bob == cold_bob  # bit for bit: a prefix-cache hit changes no bit, and this is no hit


def test_a_restart_over_the_cache_dir_with_other_weights_under_the_name_computes_afresh(dirs, tmp_path):
    with _serving(dirs["base"], lora=(f"y={dirs['bob']}",), cache_ram=0) as url:
        cold_bob = _logprobs(url, "y")
    disk = {"cache_ram": 0, "cache_dir": str(tmp_path / "cache")}
    with _serving(dirs["base"], lora=(f"y={dirs['alice']}",), **disk) as url:
        alice = _logprobs(url, "y")  # written to the cache directory when the server stops
    with _serving(dirs["base"], lora=(f"y={dirs['bob']}",), **disk) as url:
        assert _logprobs(url, "y") == cold_bob
    with _serving(dirs["base"], lora=(f"y={dirs['alice']}",), **disk) as url:
        assert _logprobs(url, "y") == alice  # alice's own blocks, found again, still serve her


# ---------------------------------------------------------------- item 3: no file opened before its type is known


def _broken_copy(source: Path, out: Path, file: str, kind: str) -> Path:
    """A copy of LoRA directory source whose `file` is a FIFO or a character device (/dev/zero, by symlink)."""
    shutil.copytree(source, out)
    (out / file).unlink()
    if kind == "fifo":
        os.mkfifo(out / file)
    else:
        (out / file).symlink_to("/dev/zero")
    return out


@contextlib.contextmanager
def _fifos_released(*dirs: Path) -> Iterator[None]:
    """On the way out, opens each FIFO in dirs for writing and closes it: a reader the code under test left
    blocked in open() (before the fix) gets end-of-file and its thread ends."""
    try:
        yield
    finally:
        for directory in dirs:
            for path in directory.rglob("*"):
                if stat.S_ISFIFO(path.lstat().st_mode):
                    with contextlib.suppress(OSError):  # no reader waiting: nothing to release
                        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("file, kind", [(WEIGHTS_FILE, "fifo"), (WEIGHTS_FILE, "device"), (CONFIG_FILE, "fifo")])
def test_a_fifo_or_device_in_an_adapter_is_a_400_and_the_server_goes_on(child_url, dirs, tmp_path, file, kind):
    url = child_url
    broken = _broken_copy(dirs["alice"], tmp_path / "broken", file, kind)
    with _fifos_released(broken):
        try:
            reply = _load(url, "z", broken)
        except httpx.TimeoutException:
            pytest.fail("the load request hung")
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "lora_path", reply.text
        assert "not a regular file" in reply.json()["error"]["message"] or file == CONFIG_FILE
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert _load(url, "z", dirs["alice"]).status_code == 200  # the registry took nothing of the broken one
        assert httpx.post(f"{url}/v1/unload_lora_adapter", headers=HEADERS, json={"lora_name": "z"}).status_code == 200


def test_reading_an_adapter_runs_off_the_engine_thread_under_a_deadline(url, dirs, monkeypatch):
    # A read that never ends (a stalled network mount, stood in for here): the load is refused at the deadline,
    # and the engine decodes meanwhile.
    release = threading.Event()

    def stalled(path: Path, limit: int | None = None) -> dict:
        release.wait(60)
        raise GptkitError("released")

    monkeypatch.setattr(lora_registry, "LOAD_SECONDS", 2.0)
    monkeypatch.setattr(lora_registry, "read_lora_weights", stalled)
    answers: list[httpx.Response] = []
    loading = threading.Thread(target=lambda: answers.append(_load(url, "z", dirs["alice"])))
    try:
        loading.start()
        time.sleep(0.5)
        health = httpx.get(f"{url}/health", timeout=10)
        served = httpx.post(
            f"{url}/v1/completions",
            headers=HEADERS,
            timeout=30,
            json={"model": "base", "prompt": "Hi", "max_tokens": 2},
        )
        loading.join(30)
        assert health.status_code == 200 and served.status_code == 200, served.text
        assert answers and answers[0].status_code == 400, answers and answers[0].text
        assert answers[0].json()["error"]["param"] == "lora_path" and "2 s" in answers[0].json()["error"]["message"]
    finally:
        release.set()


def _cli_exit(args: list[str], seconds: float = 120) -> int | None:
    """`gptkit serve ...`'s exit code run in a thread (the real CLI, in this process), or None when it has not
    ended within seconds (it hung, or started serving)."""
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(main(["serve", *args])), daemon=True)
    thread.start()
    thread.join(seconds)
    return codes[0] if codes else None


# Beside the base (8 s) in the slow suite: the adapter is read the same way (CI's 10 minutes).
@pytest.mark.parametrize("beside", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["lora", "lora-beside"])
def test_a_fifo_as_an_adapters_weights_is_one_line_and_exit_2_at_start_up(tmp_path, beside):
    # In a process of its own: before the fix, the load blocked for ever in open(), beyond what pytest can stop.
    base = _base(tmp_path)
    broken = _broken_copy(_lora(base, tmp_path / "made", 1, "all", 2), tmp_path / "broken", WEIGHTS_FILE, "fifo")
    flags = ["--lora-beside"] if beside else ["--lora", f"z={broken}"]
    command = [sys.executable, "-m", "gptkit", "serve", str(base), "--port", "0", "--cache-ram", "0", *flags]
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("gptkit serve hung on the FIFO")
    err = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and err.startswith("gptkit serve: error:"), done.stderr
    assert "named pipe" in err and str(broken) in err, err


# ---------------------------------------------------------------- item 4: symlink loops and deep configs


def _deep_config(source: Path, out: Path) -> Path:
    shutil.copytree(source, out)
    (out / CONFIG_FILE).write_text('{"format": "gptkit-lora", "x": ' + "[" * 5000 + "]" * 5000 + "}")
    return out


def test_a_symlink_loop_beside_the_base_is_skipped_in_a_log_line(tmp_path, caplog):
    base = _base(tmp_path)
    _lora(base, tmp_path / "fine", 1, "all", 2)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with caplog.at_level("INFO", logger="gptkit"):
        state = build_app(base, ServeOptions(lora_beside=True, cache_ram=0)).state.gptkit
    assert set(state.adapters.adapters) == {"fine"}
    assert any("loop" in r.getMessage() for r in caplog.records)


def test_a_deeply_nested_lora_config_beside_the_base_is_one_line_and_exit_2(tmp_path, capsys):
    base = _base(tmp_path)
    _deep_config(_lora(base, tmp_path / "made", 1, "all", 2), tmp_path / "deep")
    shutil.rmtree(tmp_path / "made")
    assert _cli_exit([str(base), "--port", "0", "--cache-ram", "0", "--lora-beside"], seconds=60) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("gptkit serve: error:") and "deep" in err and CONFIG_FILE in err, err


def test_a_deeply_nested_lora_config_is_a_400_naming_lora_path(url, dirs, tmp_path):
    reply = _load(url, "z", _deep_config(dirs["alice"], tmp_path / "deep"))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "lora_path", reply.text
    unusable = _load(url, "no spaces", dirs["alice"])
    assert unusable.status_code == 400 and unusable.json()["error"]["param"] == "lora_name", unusable.text


# ---------------------------------------------------------------- item 10: a body nested past the JSON parser


DEEP_SCHEMA = '{"type": "object", "properties": {"a": ' * 5000 + "{}" + "}}" * 5000


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            '{"model": "base", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": '
            '"function", "function": {"name": "f", "parameters": ' + DEEP_SCHEMA + "}}]}",
            "tools[0].function.parameters",
        ),
        (
            "/v1/chat/completions",
            '{"model": "base", "messages": [{"role": "user", "content": "x"}], "response_format": '
            '{"type": "json_schema", "json_schema": {"name": "n", "schema": ' + DEEP_SCHEMA + "}}}",
            "response_format.json_schema.schema",
        ),
        (
            "/v1/responses",
            '{"model": "base", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": '
            + DEEP_SCHEMA
            + "}]}",
            "tools[0]",
        ),
    ],
)
def test_a_body_nested_deeper_than_the_parser_goes_is_a_400_naming_the_field(url, path, body, param):
    reply = httpx.post(url + path, content=body, timeout=60, headers={**HEADERS, "Content-Type": "application/json"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and "nested" in error["message"], reply.text
