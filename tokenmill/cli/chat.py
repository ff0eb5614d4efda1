"""`tokenmill chat`: an interactive chat in the terminal, with a running server (through the openai
client) or, with --local, a model loaded in this process."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

from tokenmill.cli.args import (
    API_KEY_ENV,
    add_engine_args,
    add_generation_config_arg,
    api_key_or_env,
    check_text_prompts,
    cli_sampling_params,
    engine_kwargs_from_args,
    http_url,
)

EXIT_COMMANDS = ("/exit", "/quit")
FALLBACK_MAX_TOKENS = 512
"""Most tokens a reply, where neither --max-tokens nor (with --local) the model's generation_config.json says."""

Reply = Callable[[list[dict]], str]


def register(subparsers) -> None:
    parser = subparsers.add_parser("chat", help="chat in the terminal with a running server (or --local)")
    parser.add_argument("--url", type=http_url, default="http://127.0.0.1:8000/v1",
                        help="the server's OpenAI base URL")
    parser.add_argument("--model-name", default=None, help="model to ask the server for (default: its first)")
    parser.add_argument("--api-key", default=None, help=f"the server's API key (default: ${API_KEY_ENV})")
    parser.add_argument("--system-prompt", default=None, help="a system message to start the conversation")
    parser.add_argument("-q", "--quick", metavar="MESSAGE", default=None,
                        help="send one message, print the reply, exit")
    # Left out, these are the model's (its generation_config.json), as vLLM's: the server's defaults, or with --local
    # the defaults --generation-config names.
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"most tokens per reply (default: the model's, else {FALLBACK_MAX_TOKENS})")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature, 0: greedy (default: the model's, else 1)")
    parser.add_argument("--local", action="store_true", help="load the model here instead of calling a server")
    add_generation_config_arg(parser)  # used with --local
    add_engine_args(parser, model_positional=False)  # used with --local
    # url_flag, model_flag: what the hint of a connection or model-not-found error names (cli/errors.py).
    parser.set_defaults(handler=run, url_flag="--url", model_flag="--model-name")


def _server_reply(args: argparse.Namespace) -> Reply:
    from openai import OpenAI

    client = OpenAI(base_url=args.url, api_key=api_key_or_env(args.api_key) or "EMPTY")
    model = args.model_name or client.models.list().data[0].id

    # The server caps max_tokens by the model's max_new_tokens itself; a temperature left out is the server's.
    sampling = {"max_tokens": FALLBACK_MAX_TOKENS if args.max_tokens is None else args.max_tokens}
    if args.temperature is not None:
        sampling["temperature"] = args.temperature

    def reply(conversation: list[dict]) -> str:
        stream = client.chat.completions.create(model=model, messages=conversation, stream=True, **sampling)
        parts = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                print(parts[-1], end="", flush=True)
        print()
        return "".join(parts)

    return reply


def stream_local_reply(llm, conversation: list[dict], params) -> Iterator[str]:
    """The assistant's reply to `conversation` from an in-process LLM, piece by piece as each step decodes it
    (what a server streams), so the first words show after one prefill rather than the whole reply."""
    from tokenmill.engine.chat_template import render_chat
    from tokenmill.sampling_params import RequestOutputKind

    engine = llm.engine
    text, token_ids = render_chat(llm.get_tokenizer(), conversation, None, True, False)
    request_id = engine.next_request_id()
    engine.add_request(request_id, {"prompt": text, "prompt_token_ids": token_ids}, params,
                       output_kind=RequestOutputKind.DELTA)
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == request_id and output.outputs[0].text:
                    yield output.outputs[0].text
    finally:
        if engine.has_unfinished_requests():  # the caller stopped early (Ctrl-C)
            engine.abort_request([request_id])


def local_sampling_params(args: argparse.Namespace, model_defaults: dict):
    """--max-tokens and --temperature where given, over the model's defaults (LLM.sampling_defaults)."""
    given = {name: getattr(args, name) for name in ("max_tokens", "temperature") if getattr(args, name) is not None}
    return cli_sampling_params(model_defaults, given, {"max_tokens": FALLBACK_MAX_TOKENS})


def _local_reply(args: argparse.Namespace) -> Reply:
    from tokenmill import LLM

    model, engine_kwargs = engine_kwargs_from_args(args)
    check_text_prompts(engine_kwargs, "chat")
    llm = LLM(model, generation_config=args.generation_config, **engine_kwargs)
    params = local_sampling_params(args, llm.sampling_defaults)

    def reply(conversation: list[dict]) -> str:
        parts = []
        for piece in stream_local_reply(llm, conversation, params):
            parts.append(piece)
            print(piece, end="", flush=True)
        print()
        return "".join(parts)

    return reply


def run(args: argparse.Namespace) -> int:
    reply = _local_reply(args) if args.local else _server_reply(args)
    conversation = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    if args.quick is not None:
        reply(conversation + [{"role": "user", "content": args.quick}])
        return 0
    print(f"chatting ({'local model' if args.local else args.url}); {EXIT_COMMANDS[0]} or Ctrl-D to leave")
    while True:
        try:
            message = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if message.strip() in EXIT_COMMANDS:
            return 0
        if not message.strip():
            continue
        conversation.append({"role": "user", "content": message})
        conversation.append({"role": "assistant", "content": reply(conversation)})
