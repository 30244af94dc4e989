import json
import logging
import subprocess
import sys

import pytest

from gptkit.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gptkit", *args], capture_output=True, text=True)


def test_info_gpt2_json_reports_spec_total():
    result = run_cli("info", "gpt2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["total"] == 124_439_808
    assert report["params"]["position_embedding"] == 786_432
    assert report["kv_cache_bytes_per_1024_tokens"]["float16"] == 2 * 12 * 1024 * 768 * 2


def test_info_table_and_config_file(tmp_path, capsys):
    config = tmp_path / "m.json"
    config.write_text(json.dumps({"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 100, "block_size": 32}))
    assert main(["info", str(config)]) == 0
    out = capsys.readouterr().out
    assert "2 layers" in out and "total" in out and "KV cache" in out


def test_unknown_preset_is_one_line_exit_2():
    result = run_cli("info", "gpt5")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "gpt5" in result.stderr and "gpt2" in result.stderr


def test_bad_config_value_is_one_line_exit_2(tmp_path):
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"n_head": 7}))
    result = run_cli("info", str(config))
    assert result.returncode == 2 and "n_head" in result.stderr and "Traceback" not in result.stderr


def test_version_and_help():
    assert run_cli("--version").stdout.startswith("gptkit ")
    help_text = run_cli("--help").stdout
    assert "info" in help_text


def test_argparse_errors_are_one_line_naming_the_subcommand():
    result = run_cli("info", "gpt2", "--bogus-flag", "3")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--bogus-flag" in result.stderr and "gptkit info --help" in result.stderr


def test_top_level_help_imports_no_command_dependencies():
    code = (
        "import sys, contextlib, io\n"
        "from gptkit.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main([])\n"
        "assert 'torch' not in sys.modules, 'torch imported for --help'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_closed_output_pipe_ends_the_command_quietly():
    # `gptkit plan gpt2 --json | head -0`: the reader is gone before the command writes.
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptkit", "plan", "gpt2", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and "Traceback" not in err, err


def test_library_info_messages_reach_the_command_line_user(capsys):
    from gptkit.cli import show_library_messages

    show_library_messages()
    show_library_messages()  # idempotent: one handler, one line per message
    logging.getLogger("gptkit.native").info("building gptkit's CPU kernels")
    logging.getLogger("elsewhere").info("not ours")
    assert capsys.readouterr().err == "gptkit: building gptkit's CPU kernels\n"


def test_dataclass_flags_cover_repeatable_parsed_required_and_unset_fields():
    import argparse
    import dataclasses

    from gptkit.cli.flags import add_dataclass_flags, dataclass_from_args

    @dataclasses.dataclass
    class Options:
        out: str = dataclasses.field(metadata={"help": "where"})
        names: list[str] = dataclasses.field(
            default_factory=list, metadata={"help": "n", "flag": "--name", "repeatable": True}
        )
        steps: int = dataclasses.field(default=10, metadata={"help": "s"})
        mode: bool = dataclasses.field(default=False, metadata={"help": "m", "parse": {"yes": True}.__getitem__})

    for keep_unset in (False, True):
        parser = argparse.ArgumentParser()
        add_dataclass_flags(parser, Options, keep_unset=keep_unset)
        given = dataclass_from_args(
            Options, parser.parse_args(["--out", "d", "--name", "a", "--name", "b", "c", "--steps", "2e3"])
        )
        assert given == Options(out="d", names=["a", "b", "c"], steps=2000)
        defaults = parser.parse_args(["--out", "d"])
        assert dataclass_from_args(Options, defaults) == Options(out="d")
        assert ("steps" in vars(defaults)) is not keep_unset
    with pytest.raises(SystemExit):
        parser.parse_args([])  # --out is required: it has no default
    assert "default: 10" in parser.format_help() and "default: false" in parser.format_help()
