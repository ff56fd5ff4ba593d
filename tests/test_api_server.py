"""The OpenAI-compatible server (issue 38), driven by the official ``openai`` client on
127.0.0.1: completions, chat, streaming, concurrent clients, a client that goes away,
OpenAI-style errors, models, health and metrics."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from test_sampling import hf_llama, tiny_tokenizer

from qaic_dynamo import LLM, SamplingParams
from qaic_dynamo.deploy.api_server import build_app

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    hf_llama().save_pretrained(d)
    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def served(model_dir):
    """(llm, base_url): the server on a free port of 127.0.0.1, in a thread."""
    llm = LLM(str(model_dir), "eager", max_num_seqs=4, max_model_len=64)
    server = uvicorn.Server(uvicorn.Config(build_app(llm, "tiny"), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield llm, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(str(model_dir), "eager", max_model_len=64)

    def greedy(prompt: str, n: int) -> str:
        return llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0))[0].outputs[0].text

    return greedy


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions_and_their_stream(client, reference):
    out = client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=6, temperature=0)
    assert out.choices[0].text == reference("w1 w2 w3", 6)
    assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens == 3
    assert out.choices[0].finish_reason == "length"
    stream = client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=6, temperature=0, stream=True)
    chunks = [c.choices[0].text for c in stream]
    assert len(chunks) > 1 and "".join(chunks) == out.choices[0].text


def test_chat_and_its_stream(client, reference):
    messages = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w4 w5"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == reference("w9 w4 w5 ", 5)  # the chat template's rendering
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == out.choices[0].message.content


def test_n_logprobs_and_stop_through_the_api(client, reference):
    out = client.completions.create(model="tiny", prompt="w1", max_tokens=4, n=2, temperature=1.0, seed=7, logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) > 0 for c in out.choices)
    free = reference("w1", 8)
    stop = free.split(" ")[2]
    cut = client.completions.create(model="tiny", prompt="w1", max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].text == free[: free.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_clients_are_batched(served, client, reference):
    llm, _ = served
    prompts = [" ".join(f"w{(i * 7 + j) % 200}" for j in range(1 + i % 5)) for i in range(16)]
    steps = llm.core.num_steps

    def ask(p: str) -> str:
        return client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, prompts))
    assert got == [reference(p, 8) for p in prompts]
    # Alone, 16 requests of 8 tokens take 16 x 8 steps; batched (4 at a time) far fewer.
    assert llm.core.num_steps - steps < 16 * 8


def test_a_client_that_disconnects_mid_stream_frees_its_request(served):
    llm, base = served
    body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 60, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", base + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data:"):
                    break  # one token in: disconnect
    deadline = time.monotonic() + 20
    while llm.num_free_blocks != llm.num_blocks or llm.scheduler.has_unfinished():
        assert time.monotonic() < deadline, "the disconnected request still holds its blocks"
        time.sleep(0.05)
    assert llm.core._groups == {}  # released, not only finished


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(model="gpt-4"), "The model `gpt-4` does not exist; this server serves `tiny`"),
        (dict(max_tokens=100), "exceeds max_model_len=64"),
        (dict(temperature=-1), "temperature must be a finite number >= 0"),
        (dict(presence_penalty=3), r"presence_penalty must be a number in \[-2, 2\]"),
    ],
)
def test_bad_requests_get_openai_400s(client, kwargs, message):
    args = dict(model="tiny", prompt="w1 w2", max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError, match=message) as e:
        client.completions.create(**args)
    assert e.value.status_code == 400 and e.value.body["message"]


def test_a_malformed_body_is_a_400_naming_the_field(served):
    r = httpx.post(served[1] + "/v1/chat/completions", json={"model": "tiny", "messages": "hi"}, timeout=30)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_models_health_and_metrics(served, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(served[1] + "/health", timeout=30).status_code == 200
    client.completions.create(model="tiny", prompt="w3", max_tokens=3, temperature=0)
    text = httpx.get(served[1] + "/metrics", timeout=30).text
    for name in (
        "qaic:request_success_total",
        "qaic:generation_tokens_total",
        "qaic:prompt_tokens_total",
        "qaic:time_to_first_token_seconds_count",
        "qaic:time_per_output_token_seconds_count",
        "qaic:num_requests_waiting",
        "qaic:num_requests_running",
    ):
        assert name in text, name
    generated = next(line for line in text.splitlines() if line.startswith("qaic:generation_tokens_total"))
    assert float(generated.split()[-1]) >= 3


def test_the_cli_serves_a_built_in_model_with_its_byte_tokenizer(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "qaic_dynamo",
        "serve",
        "llama",
        "--layers",
        "2",
        "--hidden-size",
        "64",
        "--backend",
        "eager",
        "--port",
        str(port),
        "--max-model-len",
        "128",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="llama", prompt="héllo", max_tokens=4, temperature=0)
        assert out.usage.prompt_tokens == len("héllo".encode()) and out.usage.completion_tokens == 4
        chat = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 3
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert f"serving llama at http://127.0.0.1:{port}/v1" in out and "qaic-dynamo serve: stopped by SIGTERM" in out


def test_an_engine_thread_failure_reaches_every_waiting_request(model_dir, monkeypatch):
    """An error outside a step (here: building the outputs) killed the engine thread and
    left every client waiting forever while /health said 200."""
    import asyncio

    from qaic_dynamo.deploy.api_server import AsyncEngine
    from qaic_dynamo.errors import EngineStepError

    llm = LLM(str(model_dir), "eager", max_model_len=64)
    engine = AsyncEngine(llm)
    engine.start()

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(llm.core, "output", broken)

    async def ask() -> None:
        async for _ in engine.generate(None, [5, 6, 7], SamplingParams(max_tokens=4)):
            pass

    try:
        with pytest.raises(EngineStepError, match="the engine thread failed: KeyError: 'boom'"):
            asyncio.run(asyncio.wait_for(ask(), 60))
        assert engine.dead is not None
        with pytest.raises(EngineStepError, match="restart the server"):
            asyncio.run(asyncio.wait_for(ask(), 60))
    finally:
        engine.stop()
