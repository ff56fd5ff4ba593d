"""The demo command runs end to end and reports honestly (small model, smoke only)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.parametrize("model, graphs, compiled", [
    ("llama", 5, 6),  # the block (2 pieces) + embed_tokens, rotary_emb, norm, lm_head
    ("mla", 4, 5),  # the block (2 pieces) + embed_tokens, norm, lm_head
])
def test_demo_runs_and_matches_eager(model, graphs, compiled):
    proc = subprocess.run(
        [sys.executable, "-m", "qaic_dynamo", "demo", "--model", model, "--layers", "3", "--hidden-size", "64",
         "--max-new-tokens", "3"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = dict(re.findall(r"^  (\S.*?)\s{2,}(\S.*)$", proc.stdout, re.M))
    assert rows["layers"] == "3"
    assert rows["Dynamo graphs"].startswith(f"{graphs} (the decoder block traced once for all 3 layers")
    assert rows["unique pieces compiled"] == str(compiled)
    assert rows["eager fallbacks"] == rows["exporter fallbacks"] == "0"
    assert rows["greedy tokens identical"] == "yes"
    # Export counts are read from compilation_counter: the cold compile exports, the restart does not.
    cold_exports = re.search(r"(\d+) exports\)$", rows["cold compile (first call, s)"])
    assert cold_exports and int(cold_exports[1]) >= 1, rows["cold compile (first call, s)"]
    restart = re.search(r"\((\d+) pieces loaded from disk, (\d+) exports\)$", rows["restart, persistent cache (s)"])
    assert restart and (int(restart[1]), int(restart[2])) == (compiled, 0), rows["restart, persistent cache (s)"]
    assert float(rows["max |logit - eager logit|"]) < 1e-3


def test_demo_prints_text_when_the_model_directory_has_a_tokenizer(tmp_path):
    from transformers import LlamaConfig

    from test_sampling import tiny_tokenizer

    tok = tiny_tokenizer()
    LlamaConfig(num_hidden_layers=2, vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "qaic_dynamo", "demo", "--config", str(tmp_path), "--max-new-tokens", "3"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    text = proc.stdout.split("generated text (compiled):", 1)[1]
    lines = re.findall(r"^  \[\d\] '(.*)'$", text, re.M)
    assert len(lines) == 4 and all(re.fullmatch(r"(w\d+ ?)+|", line.replace("<unk>", "")) for line in lines), text
