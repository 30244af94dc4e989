"""`gptkit watch`: the run reader on files being written, the API over HTTP, the command's errors, and the live page
in real headless Chromium following a run that is still being written (and resumed)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gptkit.cli import main
from gptkit.observe.run_reader import CONFIG_FILE, RUN_FILES, parse_records, read_config, read_from, read_run
from gptkit.serving.watch import create_watch_app
from tests.serving.servers import live_server

LAYERS, HEADS, BLOCK = 2, 4, 16
EVALUATIONS = (0, 100, 200)  # the steps the fake run evaluates at; the phase change is located at the third
PHASE = 150
UPDATE_S = 10  # real seconds a change may take to show (the page's clock is run forward; see wait_for)


# ----- a fake run, written as gptkit train writes one


def step_record(step: int, shift: float = 0.0) -> dict:
    """A logged step's record; an evaluation's adds its measures (the third one locates the phase change)."""
    record = {"step": step, "loss": 4.2 - 0.008 * step + shift, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 900.0}
    if step in EVALUATIONS:
        k = EVALUATIONS.index(step)
        record.update(
            val_loss=4.3 - 0.009 * step + shift,
            train_eval_loss=4.25 - 0.009 * step,
            icl_score=-0.01 - 0.1 * k,
            induction_score=strongest(k),
            induction_chance=0.06,
            induction_loss=4.1 - 1.5 * k,
            first_half_loss=4.2,
            ablation_icl_change=0.02 * k,
            ablation_repeat_change=0.5 * k,
        )
        if k == 2:
            record["phase_change_step"] = PHASE + round(shift)
    return record


def strongest(k: int) -> float:
    return round(0.1 + 0.35 * k, 2)


def insight_record(step: int) -> dict:
    """An evaluation's insight line: layer 1 head 2 grows into an induction head; late positions grow cheaper."""
    k = EVALUATIONS.index(step)
    induction = [[round(0.05 + 0.01 * (layer + head), 2) for head in range(HEADS)] for layer in range(LAYERS)]
    induction[1][2] = strongest(k)
    position_loss = [round(4.2 - 0.3 * k * math.log(1 + p), 4) for p in range(BLOCK)]
    heads = [
        {"head": h, "icl_change": 0.01 * k * (h == 2) - 0.001, "repeat_change": 0.4 * k * (h == 2) + 0.01}
        for h in range(HEADS)
    ]
    return {
        "step": step,
        "induction": induction,
        "induction_chance": 0.06,
        "position_loss": position_loss,
        "ablation": {
            "layer": 1,
            "head": 2,
            "icl_change": heads[2]["icl_change"],
            "repeat_change": heads[2]["repeat_change"],
            "layer_heads": heads,
        },
    }


def sample_records(step: int) -> list[dict]:
    return [
        {"step": step, "prompt": "ROMEO:", "completion": f" greedy words at {step}", "kind": "greedy"},
        {"step": step, "prompt": "ROMEO:", "completion": f" sampled words at {step}", "kind": "sampled"},
    ]


def lines(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def append(path: Path, text: str) -> None:
    with open(path, "a") as file:
        file.write(text)


def replace(path: Path, text: str) -> None:
    """Rewrite a file as a resumed run does: a new file moved over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_run(run_dir: Path, up_to: int, insight: bool = True) -> Path:
    """A run directory as far as step up_to (logged every 10 steps), with config.yaml and samples."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "model": {
            "vocab_size": 65,
            "block_size": BLOCK,
            "n_layer": LAYERS,
            "n_head": HEADS,
            "n_kv_head": HEADS,
            "n_embd": 32,
            "position": "learned",
        },
        "optim": {"lr": 1e-3},
        "train": {"max_steps": 300, "eval_interval": 100},
        "finetune": {"method": "full", "objective": "lm"},
    }
    header = "# The resolved settings of this run.\n"
    (run_dir / CONFIG_FILE).write_text(header + yaml.safe_dump(config, sort_keys=False))
    (run_dir / "metrics.jsonl").write_text(lines([step_record(s) for s in range(0, up_to + 1, 10)]))
    evaluated = [s for s in EVALUATIONS if s <= up_to]
    if insight:
        (run_dir / "insight.jsonl").write_text(lines([insight_record(s) for s in evaluated]))
    (run_dir / "samples.jsonl").write_text(lines([r for s in evaluated for r in sample_records(s)]))
    return run_dir


# ----- the reader


def test_the_reader_leaves_a_line_being_written_and_skips_damaged_ones():
    whole = b'{"step": 0, "loss": 4.2}\n{"step": 10, "loss": NaN}\n'
    damaged = b'{"step": 20, "lo\n[1, 2]\n{"loss": 3.0}\n{"step": true}\n'  # cut short, no object, no step
    records, used = parse_records(whole + damaged + b'{"step": 30, "loss": 3')
    assert records == [{"step": 0, "loss": 4.2}, {"step": 10, "loss": None}]  # NaN is not JSON: null
    assert used == len(whole + damaged)  # the partial line is read again next time
    # A last line without its newline that is already a whole object is a record (a copy that lost the newline).
    records, used = parse_records(b'{"step": 30, "loss": 3.1}')
    assert records == [{"step": 30, "loss": 3.1}] and used == 25


def test_the_reader_goes_on_from_its_cursor_and_starts_again_when_the_file_is_rewritten(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(lines([step_record(0), step_record(10)]) + '{"step": 20, "lo')
    first = read_from(path)
    assert [r["step"] for r in first["records"]] == [0, 10] and not first["reset"]
    again = read_from(path, first["offset"], first["digest"])
    assert again["records"] == [] and again["offset"] == first["offset"]
    append(path, 'ss": 4.0}\n' + lines([step_record(30)]))  # the line is finished, another one added
    more = read_from(path, first["offset"], first["digest"])
    assert [r["step"] for r in more["records"]] == [20, 30] and not more["reset"]
    # A resume rewrites the file up to its checkpoint (step 10), then redoes the steps after it: read from the start.
    replace(path, lines([step_record(0), step_record(10), step_record(20, shift=0.5)]))
    redone = read_from(path, more["offset"], more["digest"])
    assert redone["reset"] and [r["step"] for r in redone["records"]] == [0, 10, 20]
    assert redone["records"][2]["loss"] == step_record(20, shift=0.5)["loss"]
    # The same length, other bytes before the cursor (rewritten in place): also read again.
    path.write_text(path.read_text().replace('"grad_norm": 0.5', '"grad_norm": 0.7'))
    assert read_from(path, redone["offset"], redone["digest"])["reset"]
    path.unlink()
    gone = read_from(path, redone["offset"], redone["digest"])
    assert gone == {"records": [], "offset": 0, "digest": read_from(path)["digest"], "reset": True}


def test_a_run_without_insight_is_read_with_what_it_has(tmp_path):
    run_dir = write_run(tmp_path / "run", up_to=120, insight=False)
    run = read_run(run_dir)
    assert run["name"] == "run"
    assert [r["step"] for r in run["files"]["metrics"]["records"]] == list(range(0, 121, 10))
    assert run["files"]["insight"] == {"records": [], "reset": False}
    assert [r["completion"] for r in run["files"]["samples"]["records"]] == [
        " greedy words at 0",
        " sampled words at 0",
        " greedy words at 100",
        " sampled words at 100",
    ]
    config = run["config"]
    assert config["model"] == {
        "n_layer": 2,
        "n_head": 4,
        "n_kv_head": 4,
        "n_embd": 32,
        "block_size": 16,
        "vocab_size": 65,
        "position": "learned",
    }
    assert (config["objective"], config["method"], config["max_steps"]) == ("lm", "full", 300)
    assert config["text"].startswith("# The resolved settings")
    # Nothing new since the cursor; then an insight.jsonl appears (observation turned on at a resume).
    assert all(not f["records"] for f in read_run(run_dir, run["cursor"])["files"].values())
    (run_dir / "insight.jsonl").write_text(lines([insight_record(100)]))
    later = read_run(run_dir, run["cursor"])["files"]
    assert [r["step"] for r in later["insight"]["records"]] == [100] and not later["insight"]["reset"]


def test_a_config_that_cannot_be_read_is_said_so(tmp_path):
    assert read_config(tmp_path / "config.yaml") is None
    (tmp_path / "config.yaml").write_text("model: [unclosed\n")
    assert read_config(tmp_path / "config.yaml")["error"].startswith("config.yaml cannot be read: ")
    (tmp_path / "config.yaml").write_text("- a list\n")
    assert read_config(tmp_path / "config.yaml") == {"error": "config.yaml holds no settings (not a YAML mapping)"}


def test_the_reader_names_the_files_gptkit_train_writes():
    from gptkit.observe.run_log import METRICS_FILE
    from gptkit.observe.samples import SAMPLES_FILE
    from gptkit.observe.training import INSIGHT_FILE
    from gptkit.run_files import CONFIG_FILE as TRAIN_CONFIG

    assert (RUN_FILES["metrics"], RUN_FILES["samples"], RUN_FILES["insight"], CONFIG_FILE) == (
        METRICS_FILE,
        SAMPLES_FILE,
        INSIGHT_FILE,
        TRAIN_CONFIG,
    )


# ----- the API and the command


def test_the_api_sends_what_was_appended_since_the_cursor(tmp_path):
    run_dir = write_run(tmp_path / "run", up_to=150)
    with live_server(create_watch_app(run_dir)) as url:
        whole = httpx.get(url + "/api/run").json()
        assert [r["step"] for r in whole["files"]["insight"]["records"]] == [0, 100]
        assert len(whole["files"]["metrics"]["records"]) == 16
        cursor = whole["cursor"]
        same = httpx.get(url + "/api/run", params={"since": cursor}).json()
        assert all(not f["records"] for f in same["files"].values()) and same["cursor"] == cursor
        append(run_dir / "metrics.jsonl", lines([step_record(160)]) + '{"step": 170')
        append(run_dir / "insight.jsonl", '{"step": 160, "position_loss": [NaN, 1.5]}\n')  # as Python writes NaN
        new = httpx.get(url + "/api/run", params={"since": cursor})
        assert new.status_code == 200, new.text  # JSON has no NaN: it goes out as null
        assert [r["step"] for r in new.json()["files"]["metrics"]["records"]] == [160]
        assert new.json()["files"]["insight"]["records"] == [{"step": 160, "position_loss": [None, 1.5]}]
        bad = httpx.get(url + "/api/run", params={"since": "metrics:12"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
        assert "metrics:12" in bad.json()["error"]["message"]
        page = httpx.get(url + "/")
        assert page.status_code == 200 and '<script src="/static/watch.js">' in page.text
        assert httpx.get(url + "/static/watch.js").status_code == 200
        # A page on another name rebound to 127.0.0.1 must not read the run through the user's browser.
        assert httpx.get(url + "/api/run", headers={"Host": "evil.example"}).status_code == 403


@pytest.mark.parametrize("case", ["missing", "a file", "no metrics"])
def test_a_directory_that_is_no_run_is_one_line_and_exit_2(tmp_path, capsys, case):
    path = tmp_path / "run"
    if case == "a file":
        path.write_text("x")
    elif case == "no metrics":
        path.mkdir()
        (path / "config.yaml").write_text("model: {}\n")
    assert main(["watch", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"gptkit watch: error: {path} ")
    assert {"missing": "does not exist", "a file": "is a file", "no metrics": "holds no metrics.jsonl"}[case] in err


def test_a_port_in_use_or_a_blank_host_name_is_one_line_and_exit_2(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", up_to=0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["watch", str(run_dir), "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot listen on 127.0.0.1:" in err and "--port" in err
    for argv in (["--port", "70000"], ["--allowed-host", " "]):
        assert main(["watch", str(run_dir), "--port", "0", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"gptkit watch: error: {argv[0]} ")


def test_the_watch_server_imports_no_torch():
    # It loads no model: `gptkit watch` starts in a fraction of a second, also where torch is slow to import.
    code = "import sys, gptkit.cli.watch, gptkit.serving.watch; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_the_command_prints_its_url_and_serves_the_run(tmp_path):
    run_dir = write_run(tmp_path / "run", up_to=100)
    server = subprocess.Popen(
        [sys.executable, "-m", "gptkit", "watch", str(run_dir), "--port", "0"], stderr=subprocess.PIPE, text=True
    )
    try:
        line = server.stderr.readline()
        found = re.search(r"at (http://127\.0\.0\.1:\d+/)$", line.strip())
        assert found, line
        data = httpx.get(found.group(1) + "api/run", timeout=30).json()  # listening already: no retry needed
        assert [r["step"] for r in data["files"]["insight"]["records"]] == [0, 100]
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=20) == 130  # Ctrl-C: the shell's code for an interrupt, and one line
        assert server.stderr.read() == "gptkit watch: interrupted\n"


# ----- the page in Chromium


def open_page(browser, url: str):
    """The page, on a clock the test runs forward: its timers (the next ask for records, the player) fire when the
    test says, not a second later."""
    page = browser.new_page()
    page.errors = []
    page.on("pageerror", lambda err: page.errors.append(str(err)))
    page.clock.install()
    page.goto(url + "/")
    wait_for(page, "document.getElementById('run-name').textContent !== ''")
    return page


def wait_for(page, script: str) -> None:
    """Run the page's clock forward until script is true: only timers the page set itself fire, so a page that
    stops asking for records never shows the change."""
    deadline = time.monotonic() + UPDATE_S
    while not page.evaluate(script):
        assert time.monotonic() < deadline, f"the page never showed {script}"
        page.clock.run_for(100)
        time.sleep(0.01)  # the page's fetch is real: let it answer


def slider(page) -> tuple[str, str]:
    return tuple(page.eval_on_selector("#eval-slider", "el => [el.value, el.max]"))


def snapshot(page) -> list[str]:
    """Everything the page shows: its HTML, the slider's place and Olsson's map's pixels."""
    return page.evaluate("""() => [document.querySelector('header').innerHTML, document.querySelector('main').innerHTML,
        document.getElementById('eval-slider').value, document.getElementById('olsson').toDataURL()]""")


def heads_shown(page) -> list[float]:
    return [float(t) for t in page.locator("#heads td.score").all_inner_texts()]


def test_the_page_follows_a_run_being_written_and_resumed(tmp_path, browser):
    run_dir = write_run(tmp_path / "run", up_to=190)
    with live_server(create_watch_app(run_dir)) as url:
        page = open_page(browser, url)
        wait_for(page, "document.querySelectorAll('#heads td.score').length > 0")
        assert "2 layers × 4 heads, 32 wide, context 16, vocabulary 65" in page.inner_text("#run-shape")
        assert "objective lm (full)" in page.inner_text("#run-shape")
        assert slider(page) == ("1", "1")  # two evaluations, the newest selected
        assert page.inner_text("#eval-label") == "evaluation 2 of 2 · step 100"
        assert heads_shown(page) == pytest.approx([x for row in insight_record(100)["induction"] for x in row])
        assert page.get_attribute("#heads td.strongest", "data-layer") == "1"
        assert page.get_attribute("#heads td.strongest", "data-head") == "2"
        curves = {
            el.get_attribute("data-label"): el.get_attribute("data-points")
            for el in page.locator(".chart polyline").all()
        }
        assert curves == {
            "training": "20",
            "validation": "2",
            "ICL score": "2",
            "strongest head": "2",
            "uniform attention": "2",
            "repeated half": "2",
            "first half": "2",
            "repeated-half loss change": "2",
            "ICL score change": "2",
        }
        assert page.get_attribute("#olsson", "data-columns") == "2"
        # Olsson's map: position 0 costs the most (4.2, the top of the colour map), step 100's last position the
        # least (4.2 - 0.3 ln 16: the bottom).
        cells = page.evaluate("""() => { const m = view.map, canvas = document.getElementById('olsson');
            const at = (i, p) => [...canvas.getContext('2d').getImageData(m.x((m.edges[i] + m.edges[i + 1]) / 2),
                                                                         m.y(p + 1.5), 1, 1).data.slice(0, 3)];
            return [at(0, 0), at(1, 0), at(1, 15)]; }""")
        assert cells == [[253, 231, 37], [253, 231, 37], [68, 1, 84]]
        assert "layer 1 head 2" in page.inner_text("#ablation") and page.locator("#ablation-chart rect").count() > 0
        assert page.locator(".phase-label").count() == 0  # not located yet
        page.click("#play")  # from the newest, the player starts again at the first evaluation
        assert slider(page)[0] == "0" and page.inner_text("#play") == "Pause"
        wait_for(page, "document.getElementById('play').textContent === 'Play'")
        assert slider(page)[0] == "1"
        page.eval_on_selector("#eval-slider", "el => { el.value = 0; el.dispatchEvent(new Event('input')); }")
        assert page.inner_text("#eval-label") == "evaluation 1 of 2 · step 0"

        # The third evaluation: its metrics line whole, its insight line still being written. (Each step writes the
        # file the test waits on last: an ask that sees it has seen the others.)
        insight = json.dumps(insight_record(200)) + "\n"
        append(run_dir / "insight.jsonl", insight[:40])
        append(run_dir / "samples.jsonl", lines(sample_records(200)))
        append(run_dir / "metrics.jsonl", lines([step_record(200)]))
        wait_for(page, "document.getElementById('summary').textContent.includes('3 evaluations')")
        assert slider(page) == ("0", "1")  # the partial insight line is not an evaluation yet; the choice kept
        assert page.locator(".phase-label").count() == 5  # on every chart over steps
        assert set(page.locator(".phase-label").all_text_contents()) == {f"phase change · step {PHASE}"}
        assert page.get_attribute("#olsson", "data-phase") == str(PHASE)
        assert page.inner_text("#samples .sample .completion >> nth=0") == " greedy words at 200"  # newest first
        append(run_dir / "insight.jsonl", insight[40:])
        wait_for(page, "document.getElementById('eval-slider').max === '2'")
        assert slider(page)[0] == "0" and page.get_attribute("#olsson", "data-columns") == "3"
        page.eval_on_selector("#eval-slider", "el => { el.value = 2; el.dispatchEvent(new Event('input')); }")
        assert heads_shown(page)[1 * HEADS + 2] == strongest(2)

        # Resumed from step 150: the files are rewritten up to it, and the steps after it are redone differently.
        replace(run_dir / "insight.jsonl", lines([insight_record(0), insight_record(100)]))
        replace(run_dir / "samples.jsonl", lines(sample_records(0) + sample_records(100)))
        replace(run_dir / "metrics.jsonl", lines([step_record(s) for s in range(0, 151, 10)]))
        wait_for(page, "document.getElementById('eval-slider').max === '1'")
        append(run_dir / "insight.jsonl", insight)
        append(run_dir / "samples.jsonl", lines(sample_records(200)))
        append(run_dir / "metrics.jsonl", lines([step_record(s, shift=20.0) for s in range(160, 201, 10)]))
        wait_for(page, f"document.getElementById('summary').textContent.includes('phase change at step {PHASE + 20}')")
        live = snapshot(page)
        fresh = open_page(browser, url)  # the same files, read in one go: the same page
        wait_for(fresh, "document.getElementById('eval-slider').max === '2'")
        assert snapshot(fresh) == live
        assert page.errors == [] and fresh.errors == []


def test_a_run_that_has_just_started_fills_in(tmp_path, browser):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    with live_server(create_watch_app(run_dir)) as url:
        page = open_page(browser, url)
        assert "No records yet" in page.inner_text("#summary") and page.inner_text("#run-shape") == "no config.yaml"
        assert page.inner_text("#chart-loss") == "No losses logged yet."
        assert page.is_hidden("#player") and page.get_attribute("#olsson", "data-columns") == "0"
        # An older run's records: losses and evaluations, no measures of induction and no insight.jsonl.
        old = [
            {k: v for k, v in step_record(s).items() if k in ("step", "loss", "lr", "val_loss")}
            for s in range(0, 101, 10)
        ]
        stopped = {"step": 110, "loss": 3.3, "lr": 1e-3, "evaluation": "stopped"}  # a signal came during it
        append(run_dir / "metrics.jsonl", lines(old + [stopped]))
        wait_for(page, "document.querySelectorAll('#chart-loss polyline').length === 2")
        assert "step 110 · 3 evaluations (1 stopped before it finished)" in page.inner_text("#summary")
        assert page.inner_text("#heads").startswith("No per-head scores (insight.jsonl) yet")
        assert page.inner_text("#chart-icl").startswith("No ICL scores")
        assert page.is_hidden("#player") and page.errors == []
