"""Data directory reading and the training/evaluation batch loaders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gptkit.data import DataMeta, TrainBatches, load_tokens, read_meta, sequential_batches
from gptkit.errors import GptkitError, InputError


def _write_data_dir(path: Path, train: np.ndarray, val: np.ndarray, **overrides) -> None:
    path.mkdir(parents=True, exist_ok=True)
    train.tofile(path / "train.bin")
    val.tofile(path / "val.bin")
    meta = dict(vocab_size=1000, dtype=str(train.dtype), train_tokens=len(train), val_tokens=len(val), **overrides)
    (path / "meta.json").write_text(json.dumps(meta))


def test_read_meta_and_load_tokens_give_the_written_data(tmp_path: Path) -> None:
    train, val = np.arange(100, dtype=np.uint16), np.arange(7, dtype=np.uint16) + 500
    _write_data_dir(tmp_path, train, val, tokenizer="char")
    meta = read_meta(tmp_path)
    assert meta.train_tokens == 100 and meta.tokenizer == "char"
    tokens = load_tokens(tmp_path / "train.bin", meta.dtype)
    assert isinstance(tokens, np.memmap) and np.array_equal(tokens, train)
    with pytest.raises(ValueError):
        tokens[0] = 1  # read-only
    assert np.array_equal(load_tokens(tmp_path / "val.bin", "uint16"), val)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "meta.json").unlink(), "has no meta.json"),
        (lambda d: (d / "meta.json").write_text("{oops"), "cannot read"),
        (lambda d: (d / "meta.json").write_text("[1]"), "JSON object"),
        (
            lambda d: (d / "meta.json").write_text(
                '{"vocab_size": 5, "train_tokens": -1, "val_tokens": 0, "dtype": "uint16"}'
            ),
            "'train_tokens' must be a non-negative integer",
        ),
        (
            lambda d: (d / "meta.json").write_text(
                '{"vocab_size": 5, "train_tokens": 9, "val_tokens": 3, "dtype": "int8"}'
            ),
            "'dtype' must be one of uint16, uint32",
        ),
        (lambda d: (d / "train.bin").write_bytes(b"\0" * 6), r"train.bin has 6 bytes but meta.json promises 18"),
        (lambda d: (d / "val.bin").unlink(), "val.bin is missing"),
    ],
    ids=["no-meta", "bad-json", "not-object", "negative", "dtype", "short-train", "no-val"],
)
def test_read_meta_names_what_is_wrong(tmp_path: Path, damage, message: str) -> None:
    _write_data_dir(tmp_path, np.arange(9, dtype=np.uint16), np.arange(3, dtype=np.uint16))
    damage(tmp_path)
    with pytest.raises(GptkitError, match=message):
        read_meta(tmp_path)


def test_read_meta_of_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(GptkitError, match="does not exist.*gptkit prepare"):
        read_meta(tmp_path / "nope")


def test_load_tokens_errors_and_empty_file(tmp_path: Path) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\0" * 5)
    with pytest.raises(GptkitError, match="not a whole number of uint16"):
        load_tokens(tmp_path / "odd.bin", "uint16")
    with pytest.raises(GptkitError, match="does not exist"):
        load_tokens(tmp_path / "none.bin", "uint16")
    (tmp_path / "empty.bin").write_bytes(b"")
    assert len(load_tokens(tmp_path / "empty.bin", "uint32")) == 0


def test_train_batches_are_shifted_contiguous_windows() -> None:
    tokens = np.arange(10_000, dtype=np.uint32) * 3  # every window is recognisable: consecutive multiples of 3
    batches = TrainBatches(tokens, block_size=64, batch_size=12, seed=0)
    x, y = batches.next_batch()
    assert x.shape == y.shape == (12, 64) and x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 3)
    assert torch.equal(x, x[:, :1] + 3 * torch.arange(64))
    assert len(set(x[:, 0].tolist())) > 1


def test_train_batches_reach_both_ends_of_the_data() -> None:
    tokens = np.arange(20, dtype=np.uint16)
    batches = TrainBatches(tokens, block_size=4, batch_size=8, seed=1)
    starts = {int(v) for _ in range(50) for v in batches.next_batch()[0][:, 0]}
    assert starts == set(range(16))  # start 15 is the last window whose target (token 19) exists


def test_train_batches_are_deterministic_per_seed_and_differ_across_seeds_and_ranks() -> None:
    tokens = np.arange(5_000, dtype=np.uint16)

    def draw(seed: int, rank: int = 0, world: int = 1) -> list[torch.Tensor]:
        b = TrainBatches(tokens, 16, 4, seed=seed, rank=rank, world_size=world)
        return [b.next_batch()[0] for _ in range(3)]

    same = draw(7)
    assert all(torch.equal(a, b) for a, b in zip(same, draw(7)))
    assert not torch.equal(same[0], draw(8)[0])
    ranks = [draw(7, rank, 4)[0] for rank in range(4)]
    assert len({tuple(r[:, 0].tolist()) for r in ranks}) == 4


def test_resumed_batches_equal_the_uninterrupted_run() -> None:
    tokens = np.arange(3_000, dtype=np.uint16)
    straight = TrainBatches(tokens, 8, 5, seed=3, rank=1, world_size=2)
    expected = [straight.next_batch() for _ in range(10)]

    first = TrainBatches(tokens, 8, 5, seed=3, rank=1, world_size=2)
    for _ in range(6):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = TrainBatches(tokens, 8, 5, seed=999, rank=1, world_size=2)  # the state restores the seed too
    resumed.load_state_dict(state)
    for want in expected[6:]:
        got = resumed.next_batch()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_train_batches_errors() -> None:
    with pytest.raises(InputError, match="has 8 tokens but one window needs block_size \\+ 1 = 9"):
        TrainBatches(np.arange(8, dtype=np.uint16), block_size=8, batch_size=1, seed=0)
    TrainBatches(np.arange(9, dtype=np.uint16), block_size=8, batch_size=1, seed=0).next_batch()  # just enough
    with pytest.raises(InputError, match="rank"):
        TrainBatches(np.arange(100, dtype=np.uint16), 8, 1, seed=0, rank=2, world_size=2)
    with pytest.raises(GptkitError, match="seed"):
        TrainBatches(np.arange(100, dtype=np.uint16), 8, 1, seed=0).load_state_dict({"step": 3})


def test_sequential_batches_cover_the_stream_once_in_order() -> None:
    tokens = np.arange(1, 104, dtype=np.uint16)  # 103 tokens: 10 windows of 10 (+1 target), 2 tokens left over
    batches = list(sequential_batches(tokens, block_size=10, batch_size=4))
    assert [x.shape[0] for x, _ in batches] == [4, 4, 2]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert torch.equal(x.flatten(), torch.arange(1, 101)) and torch.equal(y.flatten(), torch.arange(2, 102))
    assert len(list(sequential_batches(tokens, 10, 4, max_batches=2))) == 2
    with pytest.raises(InputError, match="block_size \\+ 1"):
        next(sequential_batches(tokens[:10], 10, 4))


def test_batches_from_a_memory_mapped_file(tmp_path: Path) -> None:
    np.arange(500, dtype=np.uint32).tofile(tmp_path / "t.bin")
    tokens = load_tokens(tmp_path / "t.bin", "uint32")
    x, y = TrainBatches(tokens, 32, 2, seed=0).next_batch()
    assert torch.equal(y - x, torch.ones_like(x))


# ---------------------------------------------------------------- prompts


def _prompt_data(path: Path) -> DataMeta:
    from gptkit.prepare import PrepareConfig, prepare

    rows = path.parent / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{n} times 2 is", "answer": 2 * n}) + "\n" for n in range(10)))
    return prepare(PrepareConfig(out=str(path), inputs=[str(rows)], tokenizer="byte", val_fraction=0.2))


def test_a_prompt_data_set_is_checked_and_loaded(tmp_path: Path) -> None:
    from gptkit.data import EXAMPLE_KINDS, PROMPT_FILES, PROMPT_KIND, is_examples, load_prompts

    data = tmp_path / "data"
    _prompt_data(data)
    meta = read_meta(data)
    assert meta.kind == PROMPT_KIND and PROMPT_KIND not in EXAMPLE_KINDS and not is_examples(meta)
    prompts = load_prompts(data, "val", meta)
    assert len(prompts) == 2 and prompts.offsets.dtype == np.int64 and len(prompts.offsets) == 3
    assert prompts.prompt(1) == list(prompts.texts[1].encode()) and prompts.rows[1]["answer"] % 2 == 0
    with pytest.raises(IndexError):
        prompts.prompt(2)
    rows = data / PROMPT_FILES["train"]["rows"]
    lines = rows.read_text().splitlines(keepends=True)
    rows.write_text("".join(lines[:-1]))  # a line short
    with pytest.raises(GptkitError, match=r"train.prompts.jsonl has \d+ bytes but meta.json promises \d+ bytes; rerun"):
        read_meta(data)
    with pytest.raises(
        GptkitError,
        match="train.prompts.jsonl holds 7 prompts but .*train.offsets.bin describes 8; rerun gptkit prepare",
    ):
        load_prompts(data, "train", meta)
    rows.write_text("".join(lines[:-1]) + "not json\n")
    with pytest.raises(GptkitError, match=r"train.prompts.jsonl line 8 is not a \{\"text\", \"row\"\} object; rerun"):
        load_prompts(data, "train", meta)
    rows.unlink()
    with pytest.raises(GptkitError, match="train.prompts.jsonl is missing but meta.json promises"):
        read_meta(data)


def test_read_meta_of_prompts_needs_their_counts(tmp_path: Path) -> None:
    data = tmp_path / "data"
    meta = dict(_prompt_data(data).raw)  # meta.json as written
    del meta["val_prompts"]
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(GptkitError, match="field 'val_prompts' must be a non-negative integer, got None"):
        read_meta(data)


def test_meta_json_is_read_typed_and_what_prepare_returns_is_what_readers_see(tmp_path: Path) -> None:
    data = tmp_path / "data"
    written = _prompt_data(data)
    read = read_meta(data)
    assert isinstance(read, DataMeta) and read == written and read.kind == "prompts"
    assert (read.train_prompts, read.val_prompts, read.vocab_size, read.labels) == (8, 2, 257, None)
    raw = json.loads((data / "meta.json").read_text())
    assert read.raw == raw and read.files == raw["files"]
    raw["written_by_a_newer_gptkit"] = 1  # a key this version does not know is kept, not refused
    (data / "meta.json").write_text(json.dumps(raw))
    assert read_meta(data).raw["written_by_a_newer_gptkit"] == 1
    raw["vocab_size"] = "257"
    (data / "meta.json").write_text(json.dumps(raw))
    with pytest.raises(GptkitError, match="field 'vocab_size' must be a non-negative integer, got '257'"):
        read_meta(data)
