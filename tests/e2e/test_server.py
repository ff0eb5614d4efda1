"""The OpenAI-compatible server end to end: a real `tokenmill serve` subprocess on SmolLM2, driven
through the openai SDK and raw httpx (one server for the module; the last test stops it)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import socket
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import HOST, RemoteServer, descendants, is_alive

from tokenmill.server.stats_log import INTERVAL_ENV

pytestmark = pytest.mark.slow

API_KEY = "test-key"
MODEL = "smollm2"
ALIAS = "org/smollm2-alias"
"""The server's second --served-model-name."""
WEB_UI = "http://ui.example"
"""The one origin the server lets browsers call it from (CORS)."""
MAX_MODEL_LEN = 1024
MAX_BODY_BYTES = 64 * 1024
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
STATS_INTERVAL_S = 0.2
STATS_LINE = re.compile(r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: ([\d.]+) "
                        r"tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%, "
                        r"Prefix cache hit rate: [\d.]+%")
"""vLLM's periodic stats line (test_server_limits' server, with --disable-log-stats, writes none)."""


@pytest.fixture(scope="module")
def server(smollm2_path):
    # float32: test_concurrent_streams_match_one_by_one needs batch-invariant greedy text, which bfloat16
    # (dtype 'auto' on a CPU with bfloat16 units) does not give: a batch's GEMMs round differently.
    server = RemoteServer(
        smollm2_path, "--served-model-name", MODEL, ALIAS, "--kv-cache-space", "0.25", "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN), "--max-request-body-bytes", str(MAX_BODY_BYTES),
        "--allowed-origins", json.dumps([WEB_UI]),  # vLLM's spelling: a JSON list
        "--enable-request-id-headers", "--max-logprobs", "-1", api_key=API_KEY,
        env={INTERVAL_ENV: str(STATS_INTERVAL_S)},  # test_periodic_stats_lines_show_the_work
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120)


def post(server, path, body=None, headers=None, **kwargs):
    return httpx.post(server.url(path), json=body, headers={**server.headers, **(headers or {})}, timeout=120,
                      **kwargs)


def sse_events(response: httpx.Response) -> list:
    """The decoded `data:` payloads of a server-sent-events body, "[DONE]" kept as a string."""
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def metric_samples(server) -> dict[str, float]:
    text = httpx.get(server.url("/metrics"), headers=server.headers).text
    return {sample.name: sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if not sample.labels.keys() - {"model_name"}}


# ---- the API -------------------------------------------------------------------------------------


def test_models_health_version(server, client):
    cards = client.models.list().data
    assert [card.id for card in cards] == [MODEL, ALIAS] and cards[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.get(server.url("/version")).json()["version"]


def test_sagemaker_routes_ping_and_invocations(server):
    """vLLM's /ping (GET or POST: /health's answer, open as it is) and /invocations (a chat completion's body or a
    completion's, told apart by messages and prompt, answered as their own routes answer them)."""
    assert [httpx.request(method, server.url("/ping")).status_code for method in ("GET", "POST")] == [200, 200]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    completion = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    for route, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        direct, invoked = (post(server, path, body).json() for path in (route, "/invocations"))
        assert invoked["object"] == direct["object"] and invoked["choices"] == direct["choices"], (direct, invoked)
        streamed = sse_events(post(server, "/invocations", {**body, "stream": True}))
        assert streamed[-1] == "[DONE]" and streamed[0]["object"].endswith(".chunk" if "messages" in body else "")
    assert httpx.post(server.url("/invocations"), json=chat).status_code == 401  # the API key, as /v1's routes
    assert "messages" in assert_openai_error(post(server, "/invocations", {"model": MODEL}), 400)["message"]
    assert "messages" in assert_openai_error(post(server, "/invocations", {**chat, "prompt": "x"}), 400)["message"]
    assert assert_openai_error(post(server, "/invocations", {**chat, "max_tokens": "many"}), 400)["param"] == \
        "max_tokens"
    assert assert_openai_error(post(server, "/invocations", content=b"{not json"), 400)


def test_engine_core_and_server_freeze_their_startup_heap(server):
    """Both long-lived processes take their start-up objects out of the garbage collector's full passes."""
    frozen = dict(re.findall(r"(engine core|server): (\d+) start-up objects frozen", server.log_tail(10**6)))
    assert set(frozen) == {"engine core", "server"}, server.log_tail()
    assert all(int(count) > 10_000 for count in frozen.values()), frozen


def test_models_retrieve(client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("org/unknown-model")
    assert raised.value.body["code"] == "model_not_found"


def test_every_served_model_name_is_served(client):
    """Before: `--served-model-name a b` was refused ('b' taken for the model path)."""
    assert client.models.retrieve(ALIAS).id == ALIAS
    completion = client.completions.create(model=ALIAS, prompt="Hi", max_tokens=1)
    assert completion.model == MODEL  # responses carry the first name, as vLLM's do


def test_completion_streamed_and_not_agree_and_count_tokens(server, client, smollm2_tokenizer):
    prompt = "The capital of France is"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY)
    [choice] = full.choices
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.prompt_tokens == len(smollm2_tokenizer.encode(prompt))
    assert full.usage.completion_tokens == 6 and full.usage.total_tokens == full.usage.prompt_tokens + 6

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def mean_logprob(server, prompt_ids: list[int], token_ids: list[int]) -> float:
    """The tokens' mean logprob after the prompt, as the prompt's echo scores them."""
    body = {"prompt": prompt_ids + token_ids, "max_tokens": 0, "echo": True, "logprobs": 0}
    logprobs = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]["token_logprobs"]
    return sum(logprobs[len(prompt_ids):]) / len(token_ids)


def test_beam_search(server, client):
    """vLLM's use_beam_search (before: ignored, a warning in the log, and the request sampled): n beams wide, the n
    best beams are the choices, best first; one beam wide it is greedy; streamed, the same answer comes whole."""
    prompt, beams = "The capital of France is", {"use_beam_search": True, "ignore_eos": True, "max_tokens": 4}
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, **GREEDY).choices[0].text
    assert post(server, "/v1/completions", {"prompt": prompt, **beams}).json()["choices"][0]["text"] == greedy
    body = {"prompt": prompt, "n": 2, "return_token_ids": True, **beams}
    choices = post(server, "/v1/completions", body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and choices[0]["token_ids"] != choices[1]["token_ids"]
    # Same length (ignore_eos): ranked by cumulative logprob, as the model scores the tokens.
    first, second = (mean_logprob(server, c["prompt_token_ids"], c["token_ids"]) for c in choices)
    assert first >= second - 1e-3, (first, second, choices)
    events = sse_events(post(server, "/v1/completions", {**body, "stream": True}))
    assert [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in events[:-1]] == [
        (c["index"], c["text"]) for c in choices]
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "n": 2, **beams}
    answer = post(server, "/v1/chat/completions", chat).json()
    texts = [c["message"]["content"] for c in answer["choices"]]
    assert len(set(texts)) == 2 and answer["usage"]["completion_tokens"] == 8, answer
    streamed = ["", ""]
    for event in sse_events(post(server, "/v1/chat/completions", {**chat, "stream": True}))[:-1]:
        for c in event["choices"]:
            streamed[c["index"]] += c["delta"].get("content") or ""
    assert streamed == texts


def test_beam_search_takes_a_temperature(client):
    """vLLM's beam search takes a temperature (before: a 400): each step samples its token at it, which joins the
    candidates, but beams are ranked by the model's own (raw) logprobs, so they are those of temperature 0."""
    beams = {"use_beam_search": True, "ignore_eos": True, "return_token_ids": True}

    def search(temperature: float) -> list[tuple[str, list[int]]]:
        answer = client.completions.create(model=MODEL, prompt="The capital of France is", n=3, max_tokens=4,
                                           temperature=temperature, extra_body=beams)
        return [(c.text, c.model_extra["token_ids"]) for c in answer.choices]

    greedy = search(0.0)
    assert len({tuple(ids) for _, ids in greedy}) == 3, greedy
    assert search(1.5) == search(0.7) == greedy
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], n=2,
                                          max_completion_tokens=3, temperature=1.0, extra_body=beams)
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == 6, chat


def test_chat_streamed_and_not_agree_and_count_tokens(server, client, smollm2_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6, **GREEDY)
    [choice] = full.choices
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    prompt_ids = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):  # transformers 5 returns a BatchEncoding
        prompt_ids = prompt_ids["input_ids"]
    assert full.usage.prompt_tokens == len(prompt_ids) and full.usage.completion_tokens == 6

    response = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 6,
                                                     "temperature": 0, "ignore_eos": True, "stream": True,
                                                     "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    first, *middle, finish, usage = events[:-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == first["id"] for e in events[:-1])
    assert "".join(e["choices"][0]["delta"]["content"] for e in middle) == choice.message.content
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["delta"] == {}
    assert usage["choices"] == [] and usage["usage"] == full.usage.model_dump(exclude_none=True)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server, route):
    # vLLM's stream option, with include_usage (before: accepted and ignored, no chunk but the last had usage).
    prompt = {"prompt": "Hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    events = sse_events(post(server, route, {**prompt, "model": MODEL, "max_tokens": 3, "n": 2, "ignore_eos": True,
                                             "stream": True, "stream_options": {"include_usage": True,
                                                                                "continuous_usage_stats": True}}))
    *chunks, last, done = events
    assert done == "[DONE]" and last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * 3
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 2 * 3
    assert all(chunk["usage"] == {**last["usage"], "completion_tokens": count,
                                  "total_tokens": last["usage"]["prompt_tokens"] + count}
               for chunk, count in zip(chunks, counts))


def test_return_token_ids_gives_the_prompt_and_output_ids_streamed_or_not(server, smollm2_tokenizer):
    """vLLM's return_token_ids (before: ignored, the fields absent). Completions: each choice carries its prompt's
    ids (streamed, in its first chunk) and its output's; chat: the prompt's at the top (streamed, the first chunk)."""
    prompts, options = ["The capital of France is", "Hi"], {"max_tokens": 3, "ignore_eos": True, "temperature": 0}
    full = post(server, "/v1/completions", {"model": MODEL, "prompt": prompts, "return_token_ids": True, **options})
    choices = full.json()["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [smollm2_tokenizer.encode(p) for p in prompts]
    assert all(smollm2_tokenizer.decode(c["token_ids"]) == c["text"] and len(c["token_ids"]) == 3 for c in choices)
    chunks = sse_events(post(server, "/v1/completions", {"model": MODEL, "prompt": prompts, "return_token_ids": True,
                                                         "stream": True, **options}))[:-1]
    for index, choice in enumerate(choices):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert [c.get("prompt_token_ids") for c in mine] == [choice["prompt_token_ids"], None, None]
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "return_token_ids": True, **options}
    chat = post(server, "/v1/chat/completions", body).json()
    assert chat["usage"]["prompt_tokens"] == len(chat["prompt_token_ids"])
    assert smollm2_tokenizer.decode(chat["prompt_token_ids"]).endswith("<|im_start|>assistant\n")
    [choice] = chat["choices"]
    assert smollm2_tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]
    first, *middle, finish = sse_events(post(server, "/v1/chat/completions", {**body, "stream": True}))[:-1]
    assert first["prompt_token_ids"] == chat["prompt_token_ids"] and "token_ids" not in first["choices"][0]
    assert [t for c in middle for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert all("prompt_token_ids" not in c for c in [*middle, finish])
    plain = post(server, "/v1/chat/completions", {**body, "return_token_ids": False}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_prompt_logprobs_score_the_prompt_as_echoed_logprobs_do(server):
    """vLLM's prompt_logprobs (before: ignored, the field absent): per prompt position the token's own logprob and
    the N most likely, keyed by token id; the same numbers as echo with logprobs gives."""
    body = {"model": MODEL, "prompt": "Monday, Tuesday, Wednesday", "max_tokens": 1}
    echoed = post(server, "/v1/completions", {**body, "echo": True, "logprobs": 2}).json()["choices"][0]["logprobs"]
    [choice] = post(server, "/v1/completions", {**body, "prompt_logprobs": 2}).json()["choices"]
    scores = choice["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(echoed["tokens"]) - 1
    for position, entry in enumerate(scores[1:], start=1):
        assert {e["decoded_token"]: e["logprob"] for e in entry.values()} == pytest.approx(
            {**echoed["top_logprobs"][position], echoed["tokens"][position]: echoed["token_logprobs"][position]})
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]

    messages = [{"role": "user", "content": "Hi"}]
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1,
                                                 "prompt_logprobs": 0, "return_token_ids": True}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(list(entry) == [str(t)] for t, entry in zip(chat["prompt_token_ids"][1:], chat["prompt_logprobs"][1:]))
    error = assert_openai_error(post(server, "/v1/completions", {**body, "prompt_logprobs": 1, "stream": True}), 400)
    assert error["param"] == "prompt_logprobs"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_every_token_arrives_in_a_chunk_of_its_own_even_when_its_text_is_held_back(server, route):
    """Clients (vLLM's benchmark among them) time chunks as tokens: a step whose text is held back (here
    all of it, behind a long stop string's possible start) still sends a chunk, with empty text."""
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
            "stop": ["a stop string far longer than the whole output could ever be"]}
    body |= {"prompt": "Once upon a time"} if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "Tell me a story."}]}
    events = sse_events(post(server, route, body))[:-1]
    if route == "/v1/chat/completions":  # the role chunk first, the finish chunk last
        events = [e for e in events[1:-1] if e["choices"][0]["finish_reason"] is None]
        assert len(events) == 8 and not any(e["choices"][0]["delta"]["content"] for e in events[:-1])
    else:
        assert len(events) == 8 and not any(e["choices"][0]["text"] for e in events[:-1])

def test_n_samples_are_seeded_and_distinct(client):
    def sample():
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, seed=7,
                                         temperature=1.0, extra_body={"ignore_eos": True})

    first, again = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text
    assert first.usage.completion_tokens == 12

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=3, seed=3, temperature=1.0)
    assert [c.index for c in chat.choices] == [0, 1]


def test_stop_strings_end_text_streamed_or_not(client):
    prompt = "Monday, Tuesday, Wednesday,"
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY).choices[0].text
    stop = text.strip()[2:5]  # from inside the greedy continuation
    assert stop and stop in text
    expected = text[: text.index(stop)]

    [choice] = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stop=[stop], **GREEDY).choices
    assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (expected, "stop", stop)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stop=stop, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == expected
    kept = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stop=stop, temperature=0,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop


def test_prompt_forms_and_echo(client, smollm2_tokenizer):
    prompts = ["Water boils at", "The sky is"]
    ids = [smollm2_tokenizer.encode(p) for p in prompts]
    by_text = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, **GREEDY)
    single = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=4, **GREEDY)
    assert [c.index for c in by_text.choices] == [0, 1]
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices]
    assert by_text.choices[1].text == single.choices[0].text
    assert by_text.usage.prompt_tokens == sum(map(len, ids)) and by_text.usage.completion_tokens == 8

    echoed = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=4, echo=True, **GREEDY)
    assert echoed.choices[0].text == prompts[0] + by_text.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=4, echo=True, stream=True,
                                         **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_chat_echo_starts_the_answer_with_the_last_message_of_its_role(server):
    """vLLM's chat echo (before: ignored, a warning in the log): the last message's content, if it has the answer's
    role, then the answer; streamed, in a chunk per choice after the role's. A user's last message is no echo."""
    prefill = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    body = {"model": MODEL, "messages": prefill, "add_generation_prompt": False, "continue_final_message": True,
            "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed == {"role": "assistant", "content": "My favourite is" + plain}
    first, second, *rest = sse_events(post(server, "/v1/chat/completions", {**body, "echo": True, "stream": True}))[:-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert second["choices"][0]["delta"] == {"content": "My favourite is"}
    assert "My favourite is" + "".join(c["choices"][0]["delta"].get("content", "") for c in rest) == echoed["content"]
    asked = {**body, "messages": prefill[:1], "add_generation_prompt": True, "continue_final_message": False}
    assert (post(server, "/v1/chat/completions", {**asked, "echo": True}).json()["choices"][0]["message"]["content"]
            == post(server, "/v1/chat/completions", asked).json()["choices"][0]["message"]["content"])


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server, smollm2_tokenizer):
    """vLLM's truncate_prompt_tokens (before: ignored, a warning in the log): the model sees the prompt's last k
    tokens, as if they were the prompt (echo gives their text); in chat, the rendered conversation's."""
    text = "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and"
    ids = smollm2_tokenizer.encode(text)
    options = {"model": MODEL, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    [cut] = post(server, "/v1/completions", {**options, "prompt": text, "truncate_prompt_tokens": 5,
                                             "echo": True}).json()["choices"]
    [kept] = post(server, "/v1/completions", {**options, "prompt": ids[-5:]}).json()["choices"]
    assert cut["prompt_token_ids"] == ids[-5:] and cut["token_ids"] == kept["token_ids"]
    assert cut["text"] == smollm2_tokenizer.decode(ids[-5:]) + kept["text"]

    body = {**options, "messages": [{"role": "user", "content": text}]}
    whole = post(server, "/v1/chat/completions", body).json()["prompt_token_ids"]
    chat = post(server, "/v1/chat/completions", {**body, "truncate_prompt_tokens": 7}).json()
    assert chat["prompt_token_ids"] == whole[-7:] and chat["usage"]["prompt_tokens"] == 7


def test_minus_one_logprobs_are_the_whole_vocabulary(server, smollm2_tokenizer):
    """vLLM's -1, with --max-logprobs -1: chat's top_logprobs and prompt_logprobs give every token's logprob
    (completions' logprobs takes no -1, as vLLM's)."""
    vocab_size = len(smollm2_tokenizer)  # 49152, the model's too
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0.0,
            "logprobs": True, "top_logprobs": -1}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text[:2000]
    [entry] = response.json()["choices"][0]["logprobs"]["content"]
    top = [alternative["logprob"] for alternative in entry["top_logprobs"]]
    assert len(top) == vocab_size and top == sorted(top, reverse=True) and top[0] == entry["logprob"]  # greedy
    assert math.fsum(math.exp(logprob) for logprob in top) == pytest.approx(1.0, abs=1e-3)
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": [504, 3458], "max_tokens": 1,
                                                 "prompt_logprobs": -1})
    assert response.status_code == 200, response.text[:2000]
    [first, second] = response.json()["choices"][0]["prompt_logprobs"]
    assert first is None and len(second) == vocab_size and second["3458"]["rank"] >= 1
    refused = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "logprobs": -1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs", refused.text


def test_echo_with_max_tokens_0_scores_the_prompt(client):
    """vLLM's prompt scoring (before: a 400 for max_tokens 0). The prompt's logprobs of the tokens greedy decoding
    produced are those it gave them while decoding (one a prefill, the other decode steps)."""
    generated = client.completions.create(model=MODEL, prompt="Water boils at", max_tokens=4, logprobs=1, **GREEDY)
    text = "Water boils at" + generated.choices[0].text
    scored = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=1)
    [choice] = scored.choices
    assert choice.text == text and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == scored.usage.prompt_tokens and "".join(logprobs.tokens) == text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.tokens[-4:] == generated.choices[0].logprobs.tokens
    assert logprobs.token_logprobs[-4:] == pytest.approx(generated.choices[0].logprobs.token_logprobs, abs=2e-3)
    streamed = list(client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text and streamed[-1].choices[0].finish_reason == "length"


def test_logprobs_wire_format(client):
    completion = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, logprobs=2, **GREEDY)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 3
    assert "".join(logprobs.tokens) == completion.choices[0].text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0 and 2 <= len(top) <= 3 and top[token] == logprob
        assert max(top.values()) == logprob  # greedy picks the most likely token

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob for c in content)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_bytes_join_into_characters_split_across_tokens(client, stream):
    """An emoji is several byte-level tokens, each with the text "\ufffd"; their `bytes` are the token's own bytes,
    which join into the emoji, as OpenAI documents the field (before: every such token had the bytes of "\ufffd")."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Reply with emojis only: 😀 😁 😂 🤣"}],
                  max_tokens=8, logprobs=True, top_logprobs=3, **GREEDY)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        [choice] = client.chat.completions.create(**kwargs).choices
        text, entries = choice.message.content, choice.logprobs.content
    assert any(e.token == "\ufffd" for e in entries), entries  # some character spans tokens
    joined = b"".join(bytes(e.bytes) for e in entries)
    assert joined.decode("utf-8", "ignore") == text and "\ufffd" not in text  # "ignore": a character cut at the end
    for entry in entries:
        for top in entry.top_logprobs:
            assert top.token != "\ufffd" or bytes(top.bytes) != "\ufffd".encode()


def test_x_request_id_names_the_response_and_need_not_be_unique(server):
    """Before: the header was ignored (vLLM's responses carry it); the same id twice at once must not clash."""
    body = {"prompt": "Once upon a time", "max_tokens": 4, "stream": True}

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers={**server.headers, "X-Request-Id": "trace-42"}, timeout=120) as c:
            return await asyncio.gather(*(c.post(server.url("/v1/completions"), json=body) for _ in range(2)))

    for response in asyncio.run(both()):
        events = sse_events(response)
        assert events[-1] == "[DONE]" and {e["id"] for e in events[:-1]} == {"cmpl-trace-42"}, response.text
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
                headers={"X-Request-Id": "trace-43"})
    assert chat.json()["id"] == "chatcmpl-trace-43" and chat.headers["x-request-id"] == "trace-43"


def test_request_id_field_names_the_response_after_the_header(server):
    """vLLM's request_id (before: ignored, a warning in the log) names the response as X-Request-Id does, which wins
    over it; it need not be unique either."""
    body = {"prompt": "Hi", "max_tokens": 1, "request_id": "job-7"}
    assert [post(server, "/v1/completions", body).json()["id"] for _ in range(2)] == ["cmpl-job-7"] * 2
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "request_id": "job-8"}
    assert post(server, "/v1/chat/completions", chat).json()["id"] == "chatcmpl-job-8"
    assert post(server, "/v1/chat/completions", chat, headers={"X-Request-Id": "trace-44"}).json()["id"] == (
        "chatcmpl-trace-44")


def test_request_id_headers(server):
    """--enable-request-id-headers (before: refused as an unknown flag) answers each request's X-Request-Id, or a
    fresh one, on every route, refusals included."""
    assert httpx.get(server.url("/health"), headers={"X-Request-Id": "probe-1"}).headers["x-request-id"] == "probe-1"
    refused = httpx.get(server.url("/v1/models"), headers={"X-Request-Id": "no-key"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "no-key"
    fresh = [httpx.get(server.url("/version")).headers["x-request-id"] for _ in range(2)]
    assert all(fresh) and fresh[0] != fresh[1]


def test_tokenize_detokenize_roundtrip(server, smollm2_tokenizer):
    text = "Hello, tokenmill!"
    tokens = post(server, "/tokenize", {"prompt": text}).json()
    assert tokens["tokens"] == smollm2_tokenizer.encode(text) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == text
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": text}]}).json()
    assert chat["count"] > tokens["count"]
    with_strs = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert with_strs["token_strs"] == smollm2_tokenizer.convert_ids_to_tokens(tokens["tokens"])
    chat_strs = post(server, "/tokenize", {"messages": [{"role": "user", "content": text}],
                                           "return_token_strs": True}).json()
    assert len(chat_strs["token_strs"]) == chat["count"]


def test_concurrent_streams_match_one_by_one(server, client):
    """64 streamed requests at once give exactly the greedy text each prompt gives alone."""
    # The shared preamble fills whole KV blocks, so the batch also exercises prefix-cache hits.
    preamble = "Finish the sentence with a few words, as a helpful and knowledgeable assistant would do:\n"
    endings = ["The capital of France is", "Water boils at", "The largest planet is", "One, two, three,",
               "The opposite of hot is", "Monday, Tuesday,", "In 1492, Columbus", "My favourite colour is",
               "The sun rises in the", "Cats like to", "The first letter of the alphabet is", "Paris is famous for",
               "A square has", "Ice is made of", "The moon orbits", "Bread is baked in"]
    prompts = [preamble + ending for ending in endings] * 4
    alone = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=8, **GREEDY).choices[0].text
             for p in prompts[: len(endings)]}
    async_client = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=300)

    async def streamed(prompt: str) -> str:
        stream = await async_client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=True,
                                                       **GREEDY)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run_all() -> list[str]:
        async with async_client:
            return await asyncio.gather(*(streamed(p) for p in prompts))

    assert asyncio.run(run_all()) == [alone[p] for p in prompts]


# ---- auth, errors, limits --------------------------------------------------------------------------

PROTECTED = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
             ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
             ("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [1]}),
             ("GET", "/metrics", None)]


def test_cors_for_the_allowed_origin_only(server):
    """Before: no CORS flags (vLLM's --allowed-origins was refused), so no browser page could call the server."""
    preflight = {"Origin": WEB_UI, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    answer = httpx.options(server.url("/v1/chat/completions"), headers=preflight)  # browsers send no key here
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == WEB_UI
    assert "authorization" in answer.headers["access-control-allow-headers"].lower()
    answer = httpx.get(server.url("/v1/models"), headers={**server.headers, "Origin": WEB_UI})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == WEB_UI
    refused = httpx.get(server.url("/v1/models"), headers={"Origin": WEB_UI})  # the page can read the 401
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == WEB_UI
    other = httpx.get(server.url("/v1/models"), headers={**server.headers, "Origin": "http://elsewhere.example"})
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_protected_routes_need_the_key(server, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}):
        response = httpx.request(method, server.url(path), json=body, headers=headers)
        assert assert_openai_error(response, 401)["code"] == "invalid_api_key"
    response = httpx.request(method, server.url(path), json=body, headers=server.headers, timeout=60)
    assert response.status_code == 200


def test_open_routes_need_no_key(server):
    for path in ("/health", "/version"):
        assert httpx.get(server.url(path)).status_code == 200


BAD_REQUESTS = [
    ("invalid_json", "/v1/completions", b"{not json", 400),
    ("missing_prompt", "/v1/completions", {"max_tokens": 3}, 400),
    ("wrong_type", "/v1/completions", {"prompt": "Hi", "max_tokens": "many"}, 400),
    ("negative_temperature", "/v1/completions", {"prompt": "Hi", "temperature": -1}, 400),
    ("n_zero", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 0}, 400),
    ("empty_prompt", "/v1/completions", {"prompt": []}, 400),
    ("token_out_of_vocab", "/v1/completions", {"prompt": [10**9]}, 400),
    # Past the vocabulary's 49152 tokens: this server's --max-logprobs is -1 (the shared one's cap of 20 is tested in
    # test_server_validation).
    ("too_many_logprobs", "/v1/completions", {"prompt": "Hi", "logprobs": 49153}, 400),
    ("stream_options_without_stream", "/v1/completions", {"prompt": "Hi", "stream_options": {}}, 400),
    ("no_messages", "/v1/chat/completions", {"messages": []}, 400),
    ("image_content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ("continue_and_generation_prompt", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True}, 400),
    ("unknown_model", "/v1/completions", {"model": "gpt-4", "prompt": "Hi"}, 404),
    ("body_too_large", "/v1/completions", {"prompt": "x" * (MAX_BODY_BYTES + 1)}, 413),
]


@pytest.mark.parametrize(("path", "body", "status"), [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, path, body, status):
    if isinstance(body, bytes):
        response = post(server, path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = post(server, path, body)
    assert_openai_error(response, status)


def test_request_chat_template_needs_the_flag(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "chat_template": "{{ 'Hi' }}"}
    error = assert_openai_error(post(server, "/v1/chat/completions", body), 400)
    assert "--trust-request-chat-template" in error["message"] and error["param"] == "chat_template"


@pytest.mark.parametrize("path", ["/start_profile", "/stop_profile"])
def test_profiling_routes_are_404_without_a_profiler_dir(server, path):
    # As vLLM without a profiler configured (tests/e2e/test_server_limits.py has the server with one).
    error = assert_openai_error(post(server, path), 404)
    assert error["code"] == "profiler_disabled" and "--profiler-dir" in error["message"]


def raw_request(server, head: str, body: bytes = b"") -> socket.socket:
    """An HTTP/1.1 request on a socket of its own, sent as given (`head`: the request line and any
    headers beyond Host and the key)."""
    sock = socket.create_connection((HOST, server.port))
    lines = [head, f"Host: {HOST}", f"Authorization: Bearer {API_KEY}", "", ""]
    sock.sendall("\r\n".join(lines).encode() + body)
    return sock


def read_status(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    return sock.recv(4096).split(b"\r\n", 1)[0]


def test_oversized_body_is_refused_from_its_content_length(server):
    # The answer comes at once, with no byte of the body sent.
    with raw_request(server, "POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {10**12}") as sock:
        assert read_status(sock, timeout=1).startswith(b"HTTP/1.1 413 ")


def test_oversized_chunked_body_is_refused_once_past_the_limit(server):
    # Though the client has not finished the body.
    chunk = b"x" * (MAX_BODY_BYTES + 1)
    with raw_request(server, "POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                             "Transfer-Encoding: chunked", f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n") as sock:
        assert read_status(sock, timeout=1).startswith(b"HTTP/1.1 413 ")


def test_context_overflow_names_both_numbers(server, client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="Hello world", max_tokens=MAX_MODEL_LEN)
    message = raised.value.body["message"]
    assert str(MAX_MODEL_LEN) in message and "2 in the prompt" in message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * MAX_MODEL_LEN}])
    # None of the bad requests above disturbed the engine.
    assert httpx.get(server.url("/health")).status_code == 200
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def finished_counts(server) -> dict[str, float]:
    text = httpx.get(server.url("/metrics"), headers=server.headers).text
    return {sample.labels["finished_reason"]: sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == "tokenmill:request_success_total"}


def wait_until_idle(server, timeout: float = 20) -> None:
    """Until no request runs and no KV block is held (a request of max_tokens=1000 would take minutes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples = metric_samples(server)
        if samples["tokenmill:num_requests_running"] == 0 and samples["tokenmill:kv_cache_usage_perc"] == 0:
            return
        time.sleep(0.2)
    pytest.fail(f"an abandoned request still runs or holds blocks: {samples}")


LONG_REQUEST = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1000, "ignore_eos": True}


def test_client_leaving_a_stream_aborts_it_and_frees_its_blocks(server):
    aborted_before = finished_counts(server).get("abort", 0)
    with httpx.Client(timeout=120, headers=server.headers) as http:
        with http.stream("POST", server.url("/v1/completions"), json={**LONG_REQUEST, "stream": True}) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            during = metric_samples(server)  # the stream is still open here
    assert during["tokenmill:num_requests_running"] == 1 and during["tokenmill:kv_cache_usage_perc"] > 0
    wait_until_idle(server)
    assert finished_counts(server)["abort"] == aborted_before + 1


def test_client_leaving_a_plain_request_aborts_it(server):
    aborted_before = finished_counts(server).get("abort", 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), json=LONG_REQUEST, headers=server.headers, timeout=2)
    wait_until_idle(server)
    assert finished_counts(server)["abort"] == aborted_before + 1


HANG_UPS = [
    ("completion", "/v1/completions", {"prompt": "Tell me a long story."}),
    ("completion_n2_two_prompts", "/v1/completions", {"prompt": ["Once", "Long ago"], "n": 2}),
    ("completion_stream_two_prompts", "/v1/completions", {"prompt": ["Once", "Long ago"], "stream": True}),
    ("chat_n2", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}], "n": 2}),
    ("chat_stream", "/v1/chat/completions", {"messages": [{"role": "user", "content": "A story?"}], "stream": True}),
    # max_tokens, which /v1/responses does not know, is ignored (a warning): max_output_tokens is its own.
    ("responses", "/v1/responses", {"input": "Tell me a long story.", "max_output_tokens": 900}),
    ("responses_stream", "/v1/responses", {"input": "A story?", "max_output_tokens": 900, "stream": True}),
]


@pytest.mark.parametrize(("path", "body"), [h[1:] for h in HANG_UPS], ids=[h[0] for h in HANG_UPS])
def test_hang_up_leaves_no_traceback_and_an_idle_engine(server, path, body):
    log_before = len(server.log_tail(10**9))
    data = json.dumps({"model": MODEL, "max_tokens": 900, "ignore_eos": True, **body}).encode()
    head = f"POST {path} HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    with raw_request(server, head, data):
        deadline = time.monotonic() + 20
        while metric_samples(server)["tokenmill:num_requests_running"] == 0:  # generating: then hang up
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.05)
    wait_until_idle(server)
    assert metric_samples(server)["tokenmill:num_requests_waiting"] == 0
    new_log = server.log_tail(10**9)[log_before:]
    assert "Traceback" not in new_log, new_log


def test_metrics_parse_and_count(server):
    samples = metric_samples(server)
    for name in ("prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count", "num_requests_waiting", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total"):
        assert f"tokenmill:{name}" in samples, name
    assert samples["tokenmill:generation_tokens_total"] >= 64 * 8
    for histogram in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds"):
        assert samples[f"tokenmill:{histogram}_count"] >= 64, histogram
    # Identical prompts ran together in the concurrency test: some prefix blocks were reused.
    assert samples["tokenmill:prefix_cache_hits_total"] > 0
    finished = finished_counts(server)
    assert finished["abort"] >= 2 and finished["length"] >= 64 and finished["stop"] >= 1


def test_periodic_stats_lines_show_the_work(server, client):
    log_before = len(server.log_tail(10**9))
    client.completions.create(model=MODEL, prompt="Count to ten:", max_tokens=16, **GREEDY)
    deadline = time.monotonic() + 20 * STATS_INTERVAL_S
    while not any(float(m[1]) > 0 for m in STATS_LINE.finditer(server.log_tail(10**9)[log_before:])):
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(STATS_INTERVAL_S / 4)


def test_sigterm_stops_server_and_engine(server):
    """Last in the module: it stops the shared server."""
    children = descendants(server.proc.pid)
    assert any(is_alive(pid) for pid in children)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=15) == 0
    assert time.monotonic() - start < 10
    time.sleep(0.5)  # the resource tracker leaves once it sees its pipe closed
    assert not [pid for pid in children if is_alive(pid)]
