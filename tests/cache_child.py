"""Compile the reference Llama in a fresh process against a given cache; print counters.

Usage: python tests/cache_child.py CACHE_DIR [LAYERS] [OPSET]
Prints one JSON line: the compilation counter deltas, the report's propagate seconds and
a sha256 of the logits (identical outputs give identical hashes).
"""

import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from harness import Driver  # noqa: E402

from qaic_dynamo import compilation_counter, last_compile_report  # noqa: E402
from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM  # noqa: E402

cache_dir = sys.argv[1]
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 3
opset = int(sys.argv[3]) if len(sys.argv) > 3 else 18
torch.manual_seed(0)
model = QaicLlamaForCausalLM(QaicLlamaConfig(num_hidden_layers=layers)).eval()
prompts = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43]]
compiled = torch.compile(model, backend="qaic", options={"cache_dir": cache_dir, "opset": opset})
with torch.no_grad():
    eager = Driver(model, prompts).generate(model, 3)
    out = Driver(model, prompts).generate(compiled, 3)
logits = torch.stack([o for o in out]).contiguous()
c = compilation_counter
print(
    json.dumps(
        {
            "num_backend_compilations": c.num_backend_compilations,
            "num_onnx_exports": c.num_onnx_exports,
            "num_disk_cache_hits": c.num_disk_cache_hits,
            "num_disk_cache_writes": c.num_disk_cache_writes,
            "num_piece_reuses": c.num_piece_reuses,
            "num_eager_fallbacks": c.num_eager_fallbacks,
            "logits_sha256": hashlib.sha256(logits.numpy().tobytes()).hexdigest(),
            "max_diff_vs_eager": max((a - b).abs().max().item() for a, b in zip(out, eager)),
            "propagate_s": last_compile_report().seconds["propagate"],
        }
    )
)
