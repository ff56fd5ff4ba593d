"""One fresh process of the precompile tests: compile a model region by region against a
given cache, run it, print one JSON line.

    python tests/precompile_child.py CACHE_DIR llama [PATCH]
    python tests/precompile_child.py CACHE_DIR user:DIR

``llama``: a small transformers Llama (2 layers) in a forward context, as the engine runs
it. PATCH, applied before compiling: ``rotary`` (transformers' ``apply_rotary_pos_emb``
replaced), ``attention`` (another function registered under ``"qaic"``), or
``rotary-later`` (the same replacement after a first compiled forward, in this process).
``mla-llm``: the reference MLA model (2 layers) through ``LLM(backend="qaic")``, greedy
tokens of one prompt (the engine's own inputs reach the embedding region as they are).
``user:DIR``: the model of ``DIR/userblocks.py`` (the test edits that file); with PATCH
``edit-after-import`` the file's ``torch.relu`` becomes ``torch.sigmoid`` on disk after it
was imported and before the model is compiled, so the code traced is not the file's.

Prints the compilation counter deltas, a sha256 of the outputs (identical outputs give
identical hashes) and the largest difference from eager run with the same patches.
"""

import hashlib
import json
import sys

import torch

import qaic_dynamo
from qaic_dynamo import build_attention_metadata, compilation_counter, set_forward_context
from qaic_dynamo.compiler.regions.precompile import wait_for_saves

cache_dir, model_name = sys.argv[1], sys.argv[2]
patch = sys.argv[3] if len(sys.argv) > 3 else "none"
options = {"cache_dir": cache_dir}


def patch_rotary() -> None:
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb

    def halved_rotary(q, k, cos, sin, *args, **kwargs):
        return original(q, k, cos * 0.5, sin * 0.5, *args, **kwargs)

    modeling_llama.apply_rotary_pos_emb = halved_rotary


def patch_attention() -> None:
    from transformers import AttentionInterface

    from qaic_dynamo.models.hf import qaic_attention_forward

    def scaled_attention(module, query, *args, **kwargs):
        return qaic_attention_forward(module, query * 1.5, *args, **kwargs)

    AttentionInterface.register("qaic", scaled_attention)


def llama() -> dict:
    from qaic_dynamo.engine import LLM
    from qaic_dynamo.models import hf_config, hf_model_from_config

    cfg = dict(
        model_type="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    llm = LLM(hf_model_from_config(hf_config(cfg)), backend="eager", max_num_seqs=2, max_model_len=64)
    ids = torch.randint(0, 512, (24,))
    pos = torch.cat([torch.arange(12), torch.arange(12)])
    idx = torch.tensor([11, 23])
    md = build_attention_metadata([12, 12], [12, 12], [[0], [1]], 16)

    def forward(model):
        for cache in torch.utils._pytree.tree_leaves(llm.kv_caches):
            cache.zero_()  # every forward starts from the same caches
        with set_forward_context(md, llm.kv_caches, llm.kv_cache_layers), torch.no_grad():
            return model(ids, pos, idx).clone()

    if patch == "rotary":
        patch_rotary()
    if patch == "attention":
        patch_attention()
    eager_first = forward(llm.model)
    if patch == "rotary-later":
        patch_rotary()
    eager = forward(llm.model)
    compiled = qaic_dynamo.compile(llm.model, **options)
    if patch == "rotary-later":  # compiled before the patch; it lands between two forwards
        import transformers.models.llama.modeling_llama as modeling_llama

        patched = modeling_llama.apply_rotary_pos_emb
        modeling_llama.apply_rotary_pos_emb = patched.__closure__[0].cell_contents  # the original
        first = forward(compiled)
        modeling_llama.apply_rotary_pos_emb = patched
        out = forward(compiled)
        return {"out": out, "eager": eager, "first_diff": float((first - eager_first).abs().max())}
    return {"out": forward(compiled), "eager": eager}


def mla_llm() -> dict:
    from qaic_dynamo.engine import LLM
    from qaic_dynamo.models import QaicMLAConfig, QaicMLAForCausalLM

    torch.manual_seed(0)
    model = QaicMLAForCausalLM(QaicMLAConfig(num_hidden_layers=2)).eval()
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    eager = LLM(model, backend="eager", max_model_len=64).generate(prompt, 6)[0]
    tokens = LLM(model, backend="qaic", compile_options=options, max_model_len=64).generate(prompt, 6)[0]
    return {"out": torch.tensor(tokens, dtype=torch.float32), "eager": torch.tensor(eager, dtype=torch.float32)}


def user(directory: str) -> dict:
    sys.path.insert(0, directory)
    import userblocks

    if patch == "edit-after-import":
        from pathlib import Path

        path = Path(userblocks.__file__)
        path.write_text(path.read_text().replace("torch.relu", "torch.sigmoid"))

    torch.manual_seed(0)
    model = userblocks.Net(3).eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        eager = model(x)
        compiled = qaic_dynamo.compile(model, **options)
        return {"out": compiled(x), "eager": eager}


before = compilation_counter.snapshot()
if model_name == "llama":
    result = llama()
elif model_name == "mla-llm":
    result = mla_llm()
else:
    result = user(model_name.split(":", 1)[1])
wait_for_saves()
after = compilation_counter.snapshot()
counts = {k: v - before.counts()[k] for k, v in after.counts().items() if v != before.counts()[k]}
out = result.pop("out")
eager = result.pop("eager")
print(
    json.dumps(
        {
            "counts": counts,
            "sha256": hashlib.sha256(out.contiguous().numpy().tobytes()).hexdigest(),
            "max_diff": float((out - eager).abs().max()),
            **result,
        }
    )
)
