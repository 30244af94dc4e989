"""The run reader a live page needs: a run directory's metrics.jsonl, insight.jsonl, samples.jsonl and config.yaml
as plain dicts, each JSONL file read on from where the reader stopped last time.

A reader's place in a file is a cursor: the byte offset it has read up to and a digest of the bytes just before it.
The next read goes on from the offset while those bytes are unchanged; a file rewritten under it (a resumed run
rewrites metrics.jsonl and samples.jsonl up to its checkpoint) is read again from the start and marked `reset`.
A line still being written (no newline yet, and not yet a whole JSON object) is left for the next read.
Nothing here imports torch: `gptkit watch` starts in a fraction of a second, with no model.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import yaml

from gptkit.errors import GptkitError, InputError

# The files gptkit train writes (observe.run_log.METRICS_FILE, observe.training.INSIGHT_FILE,
# observe.samples.SAMPLES_FILE, train.CONFIG_FILE), named here again so that reading them imports none of the
# training code (tests/observe/test_watch.py ties the names together).
RUN_FILES = {"metrics": "metrics.jsonl", "insight": "insight.jsonl", "samples": "samples.jsonl"}
CONFIG_FILE = "config.yaml"
DIGEST_SPAN = 1024  # bytes before a cursor's offset that must be unchanged for a read to go on from it
# The settings shown at the top of the page: the model's shape, and what the run trains.
SHAPE_KEYS = ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "vocab_size", "position")
RUN_KEYS = {"finetune": ("objective", "method"), "train": ("max_steps", "eval_interval")}


def check_run_dir(path: str | Path) -> Path:
    """path as a run directory that holds metrics.jsonl; a GptkitError naming what is missing otherwise."""
    run_dir = Path(path)
    if not run_dir.exists():
        raise GptkitError(f"{path} does not exist; give the run directory gptkit train writes (its --out)")
    if not run_dir.is_dir():
        raise GptkitError(f"{path} is a file, not a run directory; give the directory gptkit train writes (its --out)")
    if not (run_dir / RUN_FILES["metrics"]).is_file():
        raise GptkitError(
            f"{path} holds no {RUN_FILES['metrics']}: it is not a gptkit train run directory, or the "
            "run has not started yet (gptkit train writes it first)"
        )
    return run_dir


def finite(value: Any) -> Any:
    """value with every NaN or infinity (which Python's JSON reads, and JSON itself has not) made None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(v) for key, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def parse_record(line: bytes) -> dict[str, Any] | None:
    """One line's record: a JSON object with a whole-number step; None for anything else (a damaged line)."""
    try:
        record = json.loads(line)
    except ValueError:  # invalid JSON or invalid UTF-8
        return None
    if not isinstance(record, dict) or type(record.get("step")) is not int:  # (true is an int to Python)
        return None
    return finite(record)


def parse_records(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """The records of data's lines and the bytes they span; a last line with no newline that is not yet a whole
    JSON object is being written: it is left out (read it again next time). A whole line that is no record (damaged,
    or no step) is skipped for good."""
    records, start = [], 0
    while start < len(data):
        end = data.find(b"\n", start)
        line = data[start:] if end < 0 else data[start:end]
        record = parse_record(line)
        if end < 0 and record is None:
            break
        if record is not None:
            records.append(record)
        start = len(data) if end < 0 else end + 1
    return records, start


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data[-DIGEST_SPAN:], digest_size=8).hexdigest()


START = (0, _digest(b""))  # the cursor of a reader that has read nothing


def read_from(path: Path, offset: int = START[0], digest: str = START[1]) -> dict[str, Any]:
    """A JSONL file's records after the cursor (offset, digest): {"records", "offset", "digest", "reset"}. reset
    is true, and the records are the whole file's, when the bytes before offset are no longer those the cursor saw.
    An absent file has no records (a run without observation writes no insight.jsonl)."""
    try:
        with open(path, "rb") as file:
            start = max(0, offset - DIGEST_SPAN)
            file.seek(start)
            before = file.read(offset - start)
            reset = len(before) < offset - start or _digest(before) != digest
            if reset:
                file.seek(0)
                before, offset = b"", 0
            rest = file.read()
    except FileNotFoundError:
        before, rest, reset = b"", b"", offset > 0
        offset = 0
    records, used = parse_records(rest)
    digest = _digest(before + rest[max(0, used - DIGEST_SPAN) : used])
    return {"records": records, "offset": offset + used, "digest": digest, "reset": reset}


def format_cursor(places: dict[str, tuple[int, str]]) -> str:
    """A cursor over the run's files as one string for a URL: name:offset:digest, comma separated."""
    return ",".join(f"{name}:{offset}:{digest}" for name, (offset, digest) in places.items())


def parse_cursor(text: str) -> dict[str, tuple[int, str]]:
    """format_cursor's string back; an InputError naming the part that is not one."""
    places = {}
    for part in text.split(","):
        name, offset, digest = (part.split(":") + ["", ""])[:3]
        if name not in RUN_FILES or not offset.isdigit() or part.count(":") != 2:
            raise InputError(
                f"since: {part!r} is not a run file's place (name:offset:digest); send the cursor the "
                "previous response gave, or leave since out to read the whole run"
            )
        places[name] = (int(offset), digest)
    return places


def read_config(path: Path) -> dict[str, Any] | None:
    """config.yaml's text and the settings the page shows at its top ({"error"} when it cannot be read; None when
    absent)."""
    try:
        text = path.read_text()
        data = yaml.safe_load(text)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        return {"error": f"{path.name} cannot be read: {str(err).splitlines()[0]}"}
    if not isinstance(data, dict):
        return {"error": f"{path.name} holds no settings (not a YAML mapping)"}
    sections = {name: data.get(name) if isinstance(data.get(name), dict) else {} for name in ("model", *RUN_KEYS)}
    model = {key: sections["model"][key] for key in SHAPE_KEYS if key in sections["model"]}
    run = {key: sections[name][key] for name, keys in RUN_KEYS.items() for key in keys if key in sections[name]}
    return {"model": model, **run, "text": text}


def read_run(run_dir: Path, since: str | None = None) -> dict[str, Any]:
    """What a page needs of run_dir after the cursor `since` (None: the whole run): the run's name, its config,
    each file's new records (and whether it was rewritten) and the cursor to send next time."""
    places = parse_cursor(since) if since else {}
    files, cursor = {}, {}
    for name, file_name in RUN_FILES.items():
        chunk = read_from(run_dir / file_name, *places.get(name, START))
        files[name] = {"records": chunk["records"], "reset": chunk["reset"]}
        cursor[name] = (chunk["offset"], chunk["digest"])
    return {
        "name": run_dir.resolve().name,
        "config": read_config(run_dir / CONFIG_FILE),
        "files": files,
        "cursor": format_cursor(cursor),
    }
