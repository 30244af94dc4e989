"""The prefix cache's disk tier (gptkit.decoding.kv_dir, kv_store) owns only what it wrote: a directory holding
anything else is refused and left as it was; a block file whose checksum matches but whose contents do not fit the
model (tensor count, dtype, shape, a value not finite) is a miss with one warning, never loaded."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from gptkit.decoding.kv_dir import MARKER
from gptkit.decoding.kv_store import KVStore, checksum
from gptkit.decoding.prefix_cache import PrefixCache, block_names
from gptkit.decoding.step import PREFILL_CHUNK
from gptkit.errors import GptkitError
from gptkit.native import library
from gptkit.tensors import save_tensors
from tests.decoding.test_prefix_cache import GPT2, LLAMA, answer, engine_for, make_model, prompt, request, run


@pytest.fixture(autouse=True)
def kernels_settled():
    """gptkit's kernels loaded (or known absent) before a test: a namespace names them, so it must not change between
    a block's write and a test's look for its file."""
    library.load()


def tree(directory: Path) -> dict[str, bytes]:
    """Every file under directory by relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def filled_cache_dir(directory: Path, model, target: list[int]) -> list[Path]:
    """Run target once through a cache on directory; its block files, in chain order."""
    cache = PrefixCache(1 << 30, KVStore(directory, 1 << 30))
    engine = engine_for(model, cache)
    run(engine, [[request(target)]])
    cache.close()
    names = block_names(engine.namespace(), target, len(target) // PREFILL_CHUNK)
    return [cache.store.path(engine.namespace(), name) for name in names]


# ----- item 1: the directory holds nothing but what the cache wrote


def foreign_safetensors(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tensors({"wte.weight": torch.ones(4, 4)}, path, {"format": "pt"})


LAYOUTS = ["models", "checkpoints", "hex-named model", "hex-named, unreadable", "stray file", "symlink", "marker"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_directory_holding_other_files_is_refused_and_left_as_it_was(tmp_path, layout):
    found = {
        "models": "llama-7b/model.safetensors",
        "checkpoints": "model.safetensors",
        "hex-named model": "0" * 32 + "/" + "1" * 32 + ".safetensors",  # the cache's naming, not its header
        "hex-named, unreadable": "2" * 32 + "/" + "3" * 32 + ".safetensors",  # no marker: not provably the cache's
        "stray file": "notes.txt",
        "symlink": "a" * 32,
        "marker": MARKER,
    }[layout]
    if layout == "checkpoints":  # a copy of a run's checkpoint: model, optimiser, RNG state
        for name in ("model.safetensors", "optimizer.safetensors"):
            foreign_safetensors(tmp_path / name)
        (tmp_path / "rng.json").write_text("{}")
    elif layout == "stray file":
        (tmp_path / "notes.txt").write_text("mine")
    elif layout == "symlink":
        (tmp_path / "elsewhere").mkdir()
        foreign_safetensors(tmp_path / "elsewhere" / ("b" * 32 + ".safetensors"))
        (tmp_path / found).symlink_to(tmp_path / "elsewhere")
    elif layout == "marker":
        (tmp_path / MARKER).write_text('{"format": "something else"}')
    elif layout == "hex-named, unreadable":
        (tmp_path / found).parent.mkdir()
        (tmp_path / found).write_bytes(bytes(10))
    else:
        foreign_safetensors(tmp_path / found)
    before = tree(tmp_path)
    with pytest.raises(GptkitError, match="prefix cache") as refused:
        KVStore(tmp_path, 0)  # a budget of 0 would remove every file it counted as its own
    assert "\n" not in str(refused.value) and found in str(refused.value)
    assert tree(tmp_path) == before


def test_serve_refuses_a_models_folder_as_cache_dir_and_deletes_nothing(tmp_path, monkeypatch, capsys):
    import uvicorn

    from gptkit.cli import main
    from tests.serving.servers import make_model_dir

    model_dir = make_model_dir(tmp_path / "model")
    models = tmp_path / "models"
    foreign_safetensors(models / "llama-7b" / "model.safetensors")
    before = tree(models)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)  # were it accepted, the server would not block
    code = main(["serve", str(model_dir), "--cache-dir", str(models), "--cache-disk", "0", "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "llama-7b/model.safetensors" in err[-1] and err[-1].startswith("gptkit serve: error:")
    assert tree(models) == before


def test_a_new_or_empty_directory_gets_the_marker_and_the_cache_keeps_its_blocks(tmp_path):
    model = make_model(GPT2, "fp32")
    target = prompt(140, 3)
    files = filled_cache_dir(tmp_path / "new" / "kv", model, target)
    marker = json.loads((tmp_path / "new" / "kv" / MARKER).read_text())
    assert marker["format"].startswith("gptkit-prefix-cache-dir")
    assert all(f.exists() for f in files) and len(files) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    KVStore(empty, 1 << 20).close()
    assert (empty / MARKER).exists()


def test_a_directory_of_the_earlier_format_is_adopted_only_when_all_of_it_is_blocks(tmp_path):
    model = make_model(GPT2, "fp32")
    target = prompt(140, 4)
    files = filled_cache_dir(tmp_path, model, target)
    (tmp_path / MARKER).unlink()  # as the earlier format left it: block files only
    foreign_safetensors(tmp_path / "models" / "model.safetensors")
    before = tree(tmp_path)
    with pytest.raises(GptkitError, match="models/model.safetensors"):
        KVStore(tmp_path, 0)
    assert tree(tmp_path) == before and not (tmp_path / MARKER).exists()

    (tmp_path / "models" / "model.safetensors").unlink()
    (tmp_path / "models").rmdir()
    cache = PrefixCache(1 << 30, KVStore(tmp_path, 1 << 30))  # adopted: marked, its blocks read back
    assert (tmp_path / MARKER).exists()
    assert len(cache.match(engine_for(model, cache).namespace(), target)) == 2 and cache.stats.disk_hits == 2
    assert all(f.exists() for f in files)


def test_temporary_files_a_killed_writer_left_are_swept(tmp_path):
    model = make_model(GPT2, "fp32")
    (first, _) = filled_cache_dir(tmp_path, model, prompt(140, 5))
    leftover = first.parent / f".{first.name}.k1ll3d.tmp"
    leftover.write_bytes(first.read_bytes()[:1000])
    store = KVStore(tmp_path, 1 << 30)
    assert not leftover.exists() and store.used_bytes == sum(f.stat().st_size for f in tmp_path.glob("*/*"))


def test_the_disk_budget_holds_while_a_block_is_being_written(tmp_path, monkeypatch):
    """The file being written counts against the budget: older files leave before it is written, not after."""
    from gptkit.decoding import kv_store

    budget = 2 * 40_000  # about two block files of GPT2's shape
    peaks = []

    def measured_save(tensors, path, metadata):
        save_tensors(tensors, path, metadata)  # the temporary file is renamed into place; then count all files
        peaks.append(sum(p.stat().st_size for p in tmp_path.glob("*/*.safetensors")))

    monkeypatch.setattr(kv_store, "save_tensors", measured_save)
    model = make_model(GPT2, "fp32")
    cache = PrefixCache(0, KVStore(tmp_path, budget))
    engine = engine_for(model, cache)
    for s in range(4):
        run(engine, [[request(prompt(130, 60 + s))]])
        cache.store.flush()
    assert len(peaks) >= 4 and max(peaks) <= budget


def test_with_ram_off_blocks_are_read_from_disk(tmp_path):
    model = make_model(GPT2, "fp32")
    target = prompt(140, 8)
    reference = request(target)
    run(engine_for(model, None), [[reference]])
    filled_cache_dir(tmp_path, model, target)
    cache = PrefixCache(0, KVStore(tmp_path, 1 << 30))  # --cache-ram 0: every hit comes from the disk
    again = request(target)
    run(engine_for(model, cache), [[again]])
    assert answer(again) == answer(reference) and cache.stats.disk_hits == 2 and not cache.blocks


# ----- item 5: a block file is checked against the model before use


def rewrite(path: Path, change) -> None:
    """Rewrite a block file with change(tensors) in place of its tensors, its checksum made to match."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = f.metadata()
        tensors = [f.get_tensor(str(i)) for i in range(len(f.keys()))]
    tensors = change(tensors)
    save_tensors({str(i): t for i, t in enumerate(tensors)}, path, dict(meta, checksum=checksum(tensors)))


def with_nan(tensors):
    poisoned = [t.clone() for t in tensors]
    poisoned[0][0, 0, 0] = float("nan")
    return poisoned


CHANGES = {
    "nan": (with_nan, "not finite"),
    "dtype": (lambda ts: [t.to(torch.bfloat16) for t in ts], "dtype"),
    "shape": (lambda ts: [t.reshape(t.size(0), t.size(2), t.size(1)) for t in ts], "shape"),  # the same bytes
    "fewer positions": (lambda ts: [t[:, : PREFILL_CHUNK // 2].contiguous() for t in ts], "shape"),
    "tensor count": (lambda ts: ts[:-1], "tensors"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_block_with_a_matching_checksum_but_the_wrong_contents_is_a_miss(tmp_path, caplog, change):
    model = make_model(LLAMA, "fp32")
    target = prompt(200, 7)
    reference = request(target)
    run(engine_for(model, None), [[reference]])
    files = filled_cache_dir(tmp_path, model, target)
    function, problem = CHANGES[change]
    rewrite(files[1], function)

    cache = PrefixCache(0, KVStore(tmp_path, 1 << 30))  # RAM off: every lookup asks the disk
    engine = engine_for(model, cache)
    with caplog.at_level(logging.WARNING, logger="gptkit.decoding"):
        for _ in range(2):
            again = request(target)
            run(engine, [[again]])
            assert answer(again) == answer(reference)
    warnings = [r.getMessage() for r in caplog.records if "prefix cache" in r.getMessage()]
    assert len(warnings) == 1 and problem in warnings[0]  # once for the file, not once a request
    assert cache.store.rejected == 1


def test_a_poisoned_block_does_not_reach_a_restarted_servers_answers(tmp_path):
    from fastapi.testclient import TestClient

    from gptkit.serving.server import ServeOptions, build_app
    from tests.serving.servers import make_model_dir

    model_dir = make_model_dir(tmp_path / "model", block_size=256)
    options = ServeOptions(cache_ram=1 << 28, cache_dir=str(tmp_path / "kv"), allowed_host=("testserver",))
    body = {
        "model": "model",
        "prompt": "the cat sat on the mat. " * 8,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 2,
    }
    with TestClient(build_app(model_dir, options)) as http:
        first = http.post("/v1/completions", json=body).json()["choices"]
    for path in (tmp_path / "kv").glob("*/*.safetensors"):
        rewrite(path, lambda ts: [torch.full_like(t, float("nan")) for t in ts])
    with TestClient(build_app(model_dir, options)) as http:
        again = http.post("/v1/completions", json=body).json()["choices"]
        cache = http.get("/health").json()["prefix_cache"]
    assert again == first
    assert cache["disk_hits"] == 0 and cache["disk_rejected"] == 1  # the chain's first block: the walk stops there
