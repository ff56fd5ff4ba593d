"""``torch.compile(model, backend="qaic")`` on transformers models the LLM engine does not
serve: encoders (BERT, RoBERTa, DistilBERT, CLIP's text tower), a vision transformer, GPT-2
called without a cache, decoders whose attention bypasses transformers' interface (GPT-J,
Falcon: LLM refuses them and says to do this), and encoder-decoders (T5, Whisper). They hold no qaic op, so the
backend sees one graph with no splitting op and lowers it as one piece; the outputs must
match eager and nothing may run eagerly or through the exporter fallback - also after
Dynamo recompiles for a second input size."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from qaic_dynamo import compilation_counter

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def build(family: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model (random weights, seed 0) and two inputs of different sizes."""
    torch.manual_seed(0)
    ids = torch.randint(3, 256, (2, 15))
    mask = torch.tensor([[1] * 15, [1] * 8 + [0] * 7])  # the second sequence padded
    if family == "bert":
        model = T.BertModel(T.BertConfig(vocab_size=256, **SMALL))
        return model, dict(input_ids=ids[:, :12], attention_mask=mask[:, :12]), dict(input_ids=ids, attention_mask=mask)
    if family == "roberta":
        model = T.RobertaModel(T.RobertaConfig(vocab_size=256, **SMALL))
        return model, dict(input_ids=ids[:, :12]), dict(input_ids=ids)
    if family == "distilbert":
        model = T.DistilBertModel(T.DistilBertConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, hidden_dim=128))
        return model, dict(input_ids=ids[:, :12], attention_mask=mask[:, :12]), dict(input_ids=ids, attention_mask=mask)
    if family == "clip_text":
        model = T.CLIPTextModel(T.CLIPTextConfig(vocab_size=256, **SMALL))
        return model, dict(input_ids=ids[:, :12]), dict(input_ids=ids)
    if family == "vit":
        model = T.ViTModel(T.ViTConfig(image_size=32, patch_size=8, **SMALL))
        pixels = torch.randn(3, 3, 32, 32)
        return model, dict(pixel_values=pixels[:2]), dict(pixel_values=pixels)
    if family == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4))
        return model, dict(input_ids=ids[:, :12], use_cache=False), dict(input_ids=ids, use_cache=False)
    if family == "gptj":  # decoders LLM refuses (attention outside transformers' interface)
        model = T.GPTJForCausalLM(
            T.GPTJConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, bos_token_id=1, eos_token_id=2)
        )
        return model, dict(input_ids=ids[:, :12], use_cache=False), dict(input_ids=ids, use_cache=False)
    if family == "falcon":
        model = T.FalconForCausalLM(
            T.FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
        )
        return model, dict(input_ids=ids[:, :12], use_cache=False), dict(input_ids=ids, use_cache=False)
    if family == "t5":
        model = T.T5ForConditionalGeneration(
            T.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
        )
        dec = torch.randint(0, 256, (2, 7))
        return (
            model,
            dict(input_ids=ids[:, :12], decoder_input_ids=dec[:, :5], use_cache=False),
            dict(input_ids=ids, decoder_input_ids=dec, use_cache=False),
        )
    if family == "whisper":
        model = T.WhisperModel(
            T.WhisperConfig(
                vocab_size=256,
                d_model=64,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=128,
                decoder_ffn_dim=128,
                num_mel_bins=16,
                max_source_positions=16,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=1,
            )
        )
        features = torch.randn(2, 16, 32)  # the encoder takes exactly 2 x max_source_positions frames
        dec = torch.randint(0, 256, (2, 7))
        return (
            model,
            dict(input_features=features, decoder_input_ids=dec[:, :5], use_cache=False),
            dict(input_features=features, decoder_input_ids=dec, use_cache=False),
        )
    raise AssertionError(family)


def main_output(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


FAST = ["bert", "vit", "gpt2"]
SLOW = ["roberta", "distilbert", "clip_text", "gptj", "falcon", "t5", "whisper"]  # 2-9 s each on 2 cores
CASES = (
    [pytest.param(f, torch.float32, id=f"{f}-float32") for f in FAST]
    + [pytest.param(f, torch.float16, id=f"{f}-float16") for f in FAST]
    + [pytest.param(f, torch.float32, id=f"{f}-float32", marks=pytest.mark.slow) for f in SLOW]
)


@pytest.mark.parametrize("family, dtype", CASES)
def test_plain_compile_of_models_without_qaic_ops_matches_eager(family, dtype):
    model, first, second = build(family)
    model = model.to(dtype).eval()
    first, second = (
        {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
        for inputs in (first, second)
    )
    # float32: ONNX Runtime's kernels against eager's (observed <= 2e-6); float16: a
    # couple of float16 ulps at these magnitudes (observed <= 0.004)
    atol = 1e-4 if dtype == torch.float32 else 1e-2
    compiled = torch.compile(model, backend="qaic", options={"fallback": "error"})
    with torch.no_grad():
        for inputs in (first, second):
            want = main_output(model(**inputs))
            with compilation_counter.expect(
                num_graphs_seen=1,  # the first call; then Dynamo's recompile with the size dynamic
                num_backend_compilations=1,  # one piece: no splitting op in the graph
                num_eager_fallbacks=0,
                num_exporter_fallbacks=0,
            ):
                got = main_output(compiled(**inputs))
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got, want, atol=atol, rtol=0)


def test_gpt2_with_dynamic_true_lowers_its_gelu():
    # GPT-2's GELU computes math.sqrt(2 / math.pi) in Python; under dynamic=True Dynamo
    # records that on a float input, and its pieces ran eagerly until the arithmetic was
    # computed per value (backend.scalar_arithmetic)
    model, first, second = build("gpt2")
    model.eval()
    compiled = torch.compile(model, backend="qaic", dynamic=True, options={"fallback": "error"})
    with torch.no_grad(), compilation_counter.expect(num_eager_fallbacks=0, num_exporter_fallbacks=0):
        for inputs in (first, second):
            torch.testing.assert_close(main_output(compiled(**inputs)), main_output(model(**inputs)), atol=1e-4, rtol=0)
