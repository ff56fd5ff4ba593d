"""The demo command runs end to end and reports honestly (small model, smoke only)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "model, graphs, compiled, retraced",
    [
        ("llama", 5, 6, 0),  # the block (2 pieces) + embed_tokens, rotary_emb, norm, lm_head
        # The reference MLA model hands input_ids straight to its embed_tokens region; the
        # restart re-traced that region while the engine marked input_ids itself.
        ("mla", 4, 5, 0),  # the block (2 pieces) + embed_tokens, norm, lm_head
    ],
)
def test_demo_runs_and_matches_eager(model, graphs, compiled, retraced):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "qaic_dynamo",
            "demo",
            "--model",
            model,
            "--layers",
            "3",
            "--hidden-size",
            "64",
            "--max-new-tokens",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = dict(re.findall(r"^  (\S.*?)\s{2,}(\S.*)$", proc.stdout, re.M))
    assert rows["layers"] == "3"
    assert rows["Dynamo graphs"].startswith(f"{graphs} (the decoder block traced once for all 3 layers")
    assert rows["unique pieces compiled"] == str(compiled)
    assert rows["eager fallbacks"] == rows["exporter fallbacks"] == "0"
    assert rows["greedy tokens identical"] == "yes (eager, compiled, restarted)"
    # Export counts are read from compilation_counter: the cold compile exports, the restart does not.
    cold_exports = re.search(r"(\d+) exports\)$", rows["cold compile (first call, s)"])
    assert cold_exports and int(cold_exports[1]) >= 1, rows["cold compile (first call, s)"]
    # The restart loads every region's saved trace and every piece: no Dynamo graph, no export.
    restart = re.search(
        r"\(a new process: (\d+) region traces and (\d+) pieces loaded, (\d+) Dynamo graphs, (\d+) exports\)$",
        rows["restart, persistent cache (s)"],
    )
    assert restart, rows["restart, persistent cache (s)"]
    assert [int(g) for g in restart.groups()] == [graphs, compiled, retraced, 0], rows["restart, persistent cache (s)"]
    assert float(rows["max |logit - eager logit|"]) < 1e-3


def test_demo_prints_text_when_the_model_directory_has_a_tokenizer(tmp_path):
    from test_sampling import tiny_tokenizer
    from transformers import LlamaConfig

    tok = tiny_tokenizer()
    LlamaConfig(
        num_hidden_layers=2,
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "qaic_dynamo", "demo", "--config", str(tmp_path), "--max-new-tokens", "3"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    text = proc.stdout.split("generated text (compiled):", 1)[1]
    lines = re.findall(r"^  \[\d\] '(.*)'$", text, re.M)
    assert len(lines) == 4 and all(re.fullmatch(r"(w\d+ ?)+|", line.replace("<unk>", "")) for line in lines), text


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "qaic_dynamo", *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


def test_demo_runs_the_weights_of_a_model_directory(tmp_path):
    """--config DIR with weights built a random model from the directory's config."""
    import torch
    from transformers import LlamaConfig

    from qaic_dynamo import demo
    from qaic_dynamo.models import hf_model_from_config

    hf = hf_model_from_config(
        LlamaConfig(
            num_hidden_layers=2,
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        seed=5,
    )
    hf.save_pretrained(tmp_path)
    args = demo.argparse.Namespace(model="llama", config=str(tmp_path), layers=None, hidden_size=None, seed=0)
    built = demo.build_model(args)
    built_sd, hf_sd = built.state_dict(), hf.state_dict()
    assert built_sd.keys() == hf_sd.keys() and len(built_sd) > 0
    assert all(torch.equal(built_sd[k], hf_sd[k]) for k in built_sd)
    proc = run_cli("demo", "--config", str(tmp_path), "--layers", "4")
    assert proc.returncode == 2 and "holds weights, so its shape is fixed" in proc.stderr, proc.stderr[-2000:]


def test_demo_layers_resize_every_per_layer_list_and_bad_lengths_are_reported(tmp_path):
    import json

    from qaic_dynamo import demo

    (tmp_path / "smollm3.json").write_text(
        json.dumps(
            dict(
                model_type="smollm3",
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                no_rope_layers=[1, 1, 1, 0],
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            )
        )
    )
    args = demo.argparse.Namespace(
        model="llama", config=str(tmp_path / "smollm3.json"), layers=6, hidden_size=None, seed=0
    )
    model = demo.build_model(args)  # IndexError before: no_rope_layers kept 4 entries for 6 layers
    assert model.config.no_rope_layers == [1, 1, 1, 0, 0, 0] and model.config.num_hidden_layers == 6
    (tmp_path / "eos.json").write_text(
        json.dumps(
            dict(
                model_type="llama",
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                eos_token_id=[1, 2, 3, 4],
            )
        )
    )
    args.config = str(tmp_path / "eos.json")
    assert demo.build_model(args).config.eos_token_id == [1, 2, 3, 4]  # four entries by chance, not per layer
    proc = run_cli("demo", "--model", "llama", "--layers", "1", "--hidden-size", "64", "--max-new-tokens", "3000")
    assert proc.returncode == 2 and "exceeds the model's max_position_embeddings" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_command_says_when_a_model_directory_has_no_config(tmp_path, capsys):
    # transformers blamed a missing model_type key, after a warning that random weights
    # would be used (found by review).
    from qaic_dynamo.cli import main

    (tmp_path / "prompts.txt").write_text("1 2 3\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv in (
        ["demo", "--config", str(empty)],
        ["export", "--model", str(empty), "--out", str(tmp_path / "x")],
        ["serve-disagg", "--model", str(empty), "--prompts", str(tmp_path / "prompts.txt")],
    ):
        assert main(argv) in (1, 2), argv
        err = capsys.readouterr().err
        assert f"{empty} has no config.json" in err and "Traceback" not in err and "model_type" not in err, err


def test_cli_takes_a_directory_named_like_a_built_in_model_as_that_directory(tmp_path):
    from qaic_dynamo.cli.common import model_arg as _model_arg
    from qaic_dynamo.demo import argparse

    (tmp_path / "llama").mkdir()
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        got = _model_arg(argparse.Namespace(model="llama", layers=None, hidden_size=None, seed=0))
    finally:
        os.chdir(cwd)
    assert got == str(tmp_path / "llama")  # was "llama": the built-in model


@pytest.mark.parametrize("command", [["demo"], ["export", "--out", "x"], ["serve-disagg", "--prompts", "p.txt"]])
@pytest.mark.parametrize("flag", ["--layers", "--hidden-size"])
def test_cli_refuses_a_zero_or_negative_size(command, flag, capsys):
    from qaic_dynamo.cli import main

    for value in ("0", "-3", "x"):
        with pytest.raises(SystemExit) as e:  # 0 was read as "not given": a 16-layer export
            main([*command, flag, value])
        assert e.value.code == 2
        assert f"argument {flag}: must be a positive integer, got '{value}'" in capsys.readouterr().err


def test_cli_refuses_a_hidden_size_the_heads_do_not_divide_and_resizing_a_model_directory(tmp_path, capsys):
    from qaic_dynamo.cli.common import model_arg as _model_arg
    from qaic_dynamo.demo import argparse

    for model in ("llama", "mla"):  # was a torch size error deep in the trace
        assert _model_arg(argparse.Namespace(model=model, layers=1, hidden_size=60, seed=0)) is None
        assert (
            "--hidden-size 60 is not a multiple of the model's 8 attention heads; pass a multiple of 8 (e.g. 56)"
            in capsys.readouterr().err
        )
    for layers, hidden in ((7, None), (None, 128)):  # was silently ignored: the directory's model as it is
        assert _model_arg(argparse.Namespace(model=str(tmp_path), layers=layers, hidden_size=hidden, seed=0)) is None
        assert "--layers and --hidden-size resize the built-in models" in capsys.readouterr().err
