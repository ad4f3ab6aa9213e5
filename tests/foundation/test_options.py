"""CLI options generated from pydantic models (nemoflow/options.py): names, help, defaults, and back to the model."""

from __future__ import annotations

import argparse
import enum
import subprocess
import sys
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from nemoflow.options import ModelOptions, Option, OptionsError


class Color(str, enum.Enum):
    red = "red"
    blue = "blue"


class Inner(BaseModel):
    kind: Literal["a", "b"] = Field("a", description="which kind")
    path: str | None = Field(None, description="a path")


class LocalRun(BaseModel):
    kind: Literal["local"] = "local"


class ClusterRun(BaseModel):
    kind: Literal["cluster"] = "cluster"
    partition: str = "cpu"


class Config(BaseModel):
    name: str = Field("x", pattern=r"^\w+$", description="the name")
    count: int = Field(3, ge=1, description="how many")
    ratio: float = Field(0.5, description="a ratio, 50% by default")
    verbose: bool = Field(False, description="say more")
    eod: bool = Field(True, description="append an end marker")
    keys: list[str] = Field(default_factory=lambda: ["text", "title"], description="keys to read")
    sources: str | list[str] | None = Field(None, description="one spec or many")
    color: Color = Field(Color.red, description="a color")
    level: Literal[1, 2, 3] = Field(2, description="a level")
    inner: Inner = Field(default_factory=lambda: Inner(path="/default"), description="nested")
    run: LocalRun | ClusterRun = Field(default_factory=LocalRun, discriminator="kind")


def parser_for(options: ModelOptions) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t", exit_on_error=False)
    options.add_to(parser)
    return parser


@pytest.fixture
def options() -> ModelOptions:
    return ModelOptions(Config, exclude={"run"})


def test_a_field_it_cannot_map_must_be_excluded_explicitly():
    with pytest.raises(TypeError, match=r"Config\.run .*cannot be one command-line option: add it to exclude"):
        ModelOptions(Config).add_to(argparse.ArgumentParser())
    with pytest.raises(TypeError, match="no field.*nosuch"):
        ModelOptions(Config, exclude={"run", "nosuch"}).add_to(argparse.ArgumentParser())
    with pytest.raises(TypeError, match=r"no field.*inner\.nosuch"):
        ModelOptions(Config, exclude={"run"}, fields={"inner.nosuch": Option("--x")}).add_to(argparse.ArgumentParser())


def test_help_names_every_field_in_kebab_case_with_the_models_default(options):
    text = " ".join(parser_for(options).format_help().split())
    for expected in (
        "--name NAME the name (default: x)",
        "--count COUNT how many (default: 3)",
        "--ratio RATIO a ratio, 50% by default (default: 0.5)",
        "--verbose, --no-verbose say more (default: --no-verbose)",
        "--eod, --no-eod append an end marker (default: --eod)",
        "--keys KEYS [KEYS ...] keys to read (default: text title)",
        "--sources SOURCES [SOURCES ...] one spec or many",
        "--color {red,blue} a color (default: red)",
        "--level {1,2,3} a level (default: 2)",
        "--inner-kind {a,b} which kind (default: a)",
        "--inner-path INNER_PATH a path (default: /default)",  # the default factory's value, not Inner's
    ):
        assert expected in text, expected
    assert "--run" not in text


def test_nothing_given_builds_the_models_defaults(options):
    args = parser_for(options).parse_args([])
    assert options.given(args) == {}
    assert options.build(args) == Config()


def test_given_values_become_the_model(options):
    args = parser_for(options).parse_args(
        ["--count", "5", "--no-eod", "--keys", "body", "--sources", "one", "--inner-kind", "b", "--level", "3"]
    )
    assert options.given(args) == {
        "count": 5,
        "eod": False,
        "keys": ["body"],
        "sources": "one",  # one value of `str | list[str]` stays a scalar
        "inner": {"kind": "b"},
        "level": 3,
    }
    config = options.build(args)
    assert config.inner == Inner(kind="b", path="/default")  # the rest of the default factory's Inner is kept
    assert (config.count, config.eod, config.keys, config.level, config.name) == (5, False, ["body"], 3, "x")
    assert options.build(parser_for(options).parse_args(["--sources", "a", "b"])).sources == ["a", "b"]
    assert options.build(parser_for(options).parse_args(["--color", "blue"])).color is Color.blue


def test_bad_values_fail_in_one_line_naming_the_option(options):
    parser = parser_for(options)
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'c'"):
        parser.parse_args(["--inner-kind", "c"])
    with pytest.raises(argparse.ArgumentError, match="invalid int value"):
        parser.parse_args(["--count", "many"])
    with pytest.raises(OptionsError) as raised:
        options.build(parser.parse_args(["--count", "0", "--name", "a b"]))
    assert str(raised.value) == (
        "--name 'a b': string should match pattern '^\\w+$'; --count 0: input should be greater than or equal to 1"
    )


def test_an_option_with_convert_maps_a_union_of_models():
    options = ModelOptions(
        Config, fields={"run": Option("--run", choices=("local", "cluster"), convert=lambda k: {"kind": k})}
    )
    parser = parser_for(options)
    assert "--run {local,cluster}" in parser.format_help()
    assert options.build(parser.parse_args(["--run", "cluster"])).run == ClusterRun()
    assert options.build(parser.parse_args([])).run == LocalRun()


class Mounts(BaseModel):
    mounts: list[str] = Field(default_factory=list, description="extra mounts")
    shell: str = "bash"


def test_a_repeated_option_collects_one_value_per_flag():
    options = ModelOptions(Mounts, fields={"mounts": Option("--mount", repeat=True)})
    parser = parser_for(options)
    text = " ".join(parser.format_help().split())
    assert "--mount MOUNT extra mounts (repeatable) --shell" in text  # an empty default is not "(default: )"
    args = parser.parse_args(["--mount", "/a:/a", "--mount", "/b:/b:ro"])
    assert options.build(args).mounts == ["/a:/a", "/b:/b:ro"]
    assert options.build(parser.parse_args([])) == Mounts()
    with pytest.raises(TypeError, match=r"Mounts\.shell .*is not a list: it cannot repeat"):
        ModelOptions(Mounts, fields={"shell": Option(repeat=True)}).add_to(argparse.ArgumentParser())


def test_prepare_help_lists_every_prepareconfig_field_with_its_default():
    from flows.prepare_dataset import PrepareConfig
    from nemoflow.commands.prepare import config_options

    proc = subprocess.run([sys.executable, "-m", "nemoflow.cli", "prepare", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    # today's spellings keep working
    for flag in (
        "--name NAME",
        "--sources SOURCES [SOURCES ...]",
        "--chunks CHUNKS",
        "--shards SHARDS",
        "--output OUTPUT",
        "--shards-per-file SHARDS_PER_FILE",
        "--tokenizer-type TOKENIZER_TYPE",
        "--tokenizer-model TOKENIZER_MODEL",
        "--vocab-file VOCAB_FILE",
        "--merge-file MERGE_FILE",
        "--json-keys JSON_KEYS [JSON_KEYS ...]",
        "--no-append-eod",
        "--workers WORKERS",
        "--skip-malformed",
        "--delete-compressed",
        "--executor {local,slurm,k8s}, --backend {local,slurm,k8s}",
        "--json",
    ):
        assert flag in text, flag
    # every field of the model, nested ones flattened, with the model's default
    options = config_options()
    mapped = {".".join(m.path): m for m in options._plan()}
    default = PrepareConfig()
    expected = {name for name in PrepareConfig.model_fields if name != "tokenizer"} - options.exclude
    expected |= {f"tokenizer.{name}" for name in type(default.tokenizer).model_fields} - options.exclude
    assert set(mapped) == expected
    for key, option in mapped.items():
        value = default
        for part in key.split("."):
            value = getattr(value, part)
        assert option.flag in text, key
        if isinstance(value, bool):
            assert f"(default: {option.flag if value else '--no-' + option.flag[2:]})" in text, key
        elif isinstance(value, list):
            assert f"(default: {' '.join(value)})" in text, key
        elif value is not None:
            assert f"(default: {value})" in text, key


def test_prepare_builds_the_same_config_the_hand_written_options_did():
    from flows.prepare_dataset import PrepareConfig
    from nemoflow.cli import build_parser
    from nemoflow.commands.prepare import config_options
    from tasks.refs import TokenizerRef

    parse = build_parser().parse_args
    assert config_options().build(parse(["prepare"])) == PrepareConfig()
    args = parse(
        [
            "prepare",
            "--name",
            "gpt2",
            "--sources",
            "gs://b/raw/*.jsonl.zst",
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            "v.json",
            "--merge-file",
            "m.txt",
            "--json-keys",
            "text",
            "title",
            "--no-append-eod",
            "--skip-malformed",
            "--shards-per-file",
            "10",
            "--backend",
            "slurm",
        ]
    )
    assert config_options().build(args) == PrepareConfig(
        name="gpt2",
        sources="gs://b/raw/*.jsonl.zst",
        tokenizer=TokenizerRef(type="GPT2BPETokenizer", vocab_file="v.json", merge_file="m.txt"),
        json_keys=["text", "title"],
        append_eod=False,
        skip_malformed=True,
        shards_per_file=10,
    )
    assert args.executor == "slurm"  # where it runs: the flow's executor argument, not a config field


def test_cli_start_up_does_not_import_the_flows():
    """Options built from a flow's config are deferred: other commands must not pay for importing Prefect."""
    code = "import sys; from nemoflow.cli import build_parser; build_parser(); print('prefect' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "False", proc.stderr
