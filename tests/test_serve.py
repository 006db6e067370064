"""`path-hf serve`: transformers' server on a tiny hybrid PaTH checkpoint (a PaTH layer and a local layer of window 8),
started as a real process on a free port of 127.0.0.1 and driven with the `openai` client: what it serves, greedy
answers token for token those of `model.generate`, concurrency, a client leaving mid-stream, and the errors."""

import json
import pickle
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cli.serving.model_manager import ModelLoader

import path_hf
from path_hf.cli import main
from path_hf.serving import PaTHModelLoader
from tests.processes import ROOT, environment, group, stop_group
from tests.tiny import tiny_config

TOKENIZER = ROOT / "examples" / "default_model" / "checkpoint"
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
WINDOW = 8
CONTEXT = 64
# More new tokens than the local window: the answer runs past what the local layer's cache keeps.
NEW_TOKENS = 3 * WINDOW
PROMPT = "Once upon a time there was a little"
STARTUP_SECONDS = 120


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A randomly initialised tiny hybrid PaTHLlama saved with a real tokenizer and a chat template."""
    directory = tmp_path_factory.mktemp("serve") / "tiny-path"
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = tiny_config("path", tokenizer, path_layers=[0], local_window=WINDOW, max_position_embeddings=CONTEXT)
    path_hf.PaTHLlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The checkpoint loaded here, and its greedy answer to a prompt or chat: `generate(..., do_sample=False)`."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert isinstance(model, path_hf.PaTHLlamaForCausalLM)

    def answer(prompt: str | None = None, messages: list | None = None, new_tokens: int = NEW_TOKENS):
        if messages is not None:
            inputs = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
        else:
            inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        ids = output[0, inputs["input_ids"].shape[1] :].tolist()
        return ids, tokenizer.decode(ids, skip_special_tokens=True)

    return answer


def http(url: str, body: bytes | None = None) -> tuple[int, dict]:
    """GET `url`, or POST `body` to it as JSON: the status and the JSON answer."""
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """`path-hf serve CHECKPOINT` in a process group of its own on a free port, with an empty modules cache (where
    remote code would be copied); yields (base URL, log file, modules cache). The group is killed on the way out."""
    workdir = tmp_path_factory.mktemp("server")
    log, modules = workdir / "server.log", workdir / "modules"
    port = free_port()
    command = [sys.executable, "-m", "path_hf", "serve", str(checkpoint), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--device", "cpu"]
    env = environment(HF_MODULES_CACHE=str(modules))
    with log.open("w") as output, group(command, stdout=output, stderr=subprocess.STDOUT, env=env) as process:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if process.poll() is not None:
                pytest.fail(f"path-hf serve exited ({process.returncode}):\n{log.read_text()[-4000:]}", pytrace=False)
            try:
                if http(f"{url}/health")[0] == 200:
                    break
            except OSError:  # not listening yet
                pass
            if time.monotonic() > deadline:
                stop_group(process)
                pytest.fail(f"path-hf serve not answering after {STARTUP_SECONDS} s:\n{log.read_text()[-12000:]}")
            time.sleep(0.5)
        yield url, log, modules
        assert process.poll() is None, f"the server stopped:\n{log.read_text()[-4000:]}"


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", timeout=60, max_retries=0)


def test_lists_its_model(client, checkpoint):
    (model,) = client.models.list().data
    assert model.id == str(checkpoint)


def test_greedy_completion_is_generates(client, checkpoint, reference):
    ids, text = reference(PROMPT)
    assert len(ids) == NEW_TOKENS and text.strip()
    completion = client.completions.create(model=str(checkpoint), prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert completion.choices[0].text == text
    assert completion.usage.completion_tokens == len(ids)
    assert completion.choices[0].finish_reason == "length"


def test_greedy_streamed_completion_is_generates(client, checkpoint, reference):
    ids, text = reference(PROMPT)
    stream = client.completions.create(
        model=str(checkpoint),
        prompt=PROMPT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert streamed == text
    assert len([chunk for chunk in chunks if chunk.choices and chunk.choices[0].text]) > 1, "one chunk: not streamed"
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_chat_completion_uses_the_chat_template(client, checkpoint, reference):
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    ids, text = reference(messages=messages)
    answer = client.chat.completions.create(
        model=str(checkpoint), messages=messages, max_tokens=NEW_TOKENS, temperature=0
    )
    assert answer.choices[0].message.content == text
    assert answer.usage.completion_tokens == len(ids)
    # The prompt is the chat template's, not the bare message.
    rendered = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True
    )
    assert answer.usage.prompt_tokens == len(rendered["input_ids"])


def test_streamed_chat_completion_is_generates(client, checkpoint, reference):
    messages = [{"role": "user", "content": "hello"}]
    _, text = reference(messages=messages)
    stream = client.chat.completions.create(
        model=str(checkpoint), messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text


def test_two_concurrent_clients_get_their_own_answers(server, checkpoint, reference):
    prompts = [PROMPT, "The weather today is"]
    expected = [reference(prompt)[1] for prompt in prompts]

    def ask(prompt: str) -> str:
        client = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", timeout=60, max_retries=0)
        stream = client.completions.create(
            model=str(checkpoint), prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
        return "".join(choice.text for chunk in stream for choice in chunk.choices)

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(ask, prompts)) == expected
    assert expected[0] != expected[1]


def test_a_client_leaving_mid_stream_does_not_stop_the_server(client, server, checkpoint, reference):
    stream = client.completions.create(model=str(checkpoint), prompt=PROMPT, max_tokens=400, temperature=0, stream=True)
    first = next(iter(stream))
    assert first.choices[0].text
    stream.close()  # the connection goes, mid-answer
    # The server goes on answering, the same answers.
    _, text = reference(PROMPT)
    completion = client.completions.create(model=str(checkpoint), prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert completion.choices[0].text == text
    assert http(f"{server[0]}/health") == (200, {"status": "ok"})


def test_no_remote_code_runs(client, server):
    client.models.list()
    modules = server[2]
    copied = sorted(path.name for path in modules.rglob("*.py")) if modules.exists() else []
    assert "modeling_path_llama.py" not in copied, f"the checkpoint's own code was loaded: {copied}"


def refusal(error: pytest.ExceptionInfo) -> str:
    """What the server said (`{"detail": ...}`), which the openai client keeps in `body` (its message shows only the
    status: it reads OpenAI's `{"error": {"message": ...}}`)."""
    return error.value.body["detail"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_prompt_longer_than_the_model_takes_is_refused(client, checkpoint, stream):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=str(checkpoint), prompt="time " * CONTEXT, max_tokens=4, stream=stream)
    assert f"takes at most {CONTEXT}" in refusal(refused)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=str(checkpoint),
            messages=[{"role": "user", "content": "time " * CONTEXT}],
            max_tokens=4,
            stream=stream,
        )
    assert f"takes at most {CONTEXT}" in refusal(refused)


def test_an_unknown_model_is_refused(client, checkpoint):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="someone/another-model", prompt=PROMPT, max_tokens=4)
    assert "someone/another-model" in refusal(refused) and str(checkpoint) in refusal(refused)


def test_malformed_json_is_refused(server):
    status, answer = http(f"{server[0]}/v1/chat/completions", b'{"messages": [')
    assert status == 422
    assert "JSON decode error" in json.dumps(answer)


def test_continuous_batching_is_refused_on_one_line(checkpoint, capsys):
    assert main(["serve", str(checkpoint), "--continuous-batching"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: --continuous-batching is refused") and error.count("\n") == 1


def test_the_loader_loads_path_hfs_class_and_pickles_by_reference(checkpoint):
    loader = PaTHModelLoader(device="cpu")
    assert type(pickle.loads(pickle.dumps(loader))) is PaTHModelLoader  # the model's process gets it so
    model = loader._load_model(str(checkpoint))
    assert type(model) is path_hf.PaTHLlamaForCausalLM


def test_upstream_still_needs_our_loader(checkpoint):
    """transformers' own loader looks the architecture up as an attribute of `transformers`. When this fails,
    upstream loads registered models: `PaTHModelLoader` can go (docs/serving.md)."""
    with pytest.raises(AttributeError, match="PaTHLlamaForCausalLM"):
        ModelLoader(device="cpu")._load_model(str(checkpoint))
