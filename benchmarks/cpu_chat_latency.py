"""`tokenmill chat --local`'s latency on the CPU: time to the first streamed piece and decode tokens/s of a reply.

.venv/bin/python benchmarks/cpu_chat_latency.py [--dtype auto] [--turns 5] [--max-tokens 128]

Each turn asks a new question of the default model in a fresh conversation through the same streaming call the
chat command uses (cli/chat.py stream_local_reply), greedy, the reply held to --max-tokens (ignore_eos) so every
turn decodes as many tokens. Medians over the turns after a warm-up turn.
"""

from __future__ import annotations

import argparse
import statistics
import time

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is.",
    "Give three tips for learning to cook.",
    "Why is the sky blue?",
    "What does a compiler do?",
    "Name the planets of the solar system.",
    "How do vaccines work?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    from tokenmill import LLM, SamplingParams
    from tokenmill.cli.chat import stream_local_reply

    llm = LLM(dtype=args.dtype)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    first_piece, decode_rates = [], []
    for turn in range(args.turns + 1):
        conversation = [{"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]}]
        start = time.perf_counter()
        first = None
        for _ in stream_local_reply(llm, conversation, params):
            first = first or time.perf_counter()
        end = time.perf_counter()
        if turn == 0:
            continue  # warm-up: first-call allocations
        first_piece.append((first - start) * 1e3)
        decode_rates.append((args.max_tokens - 1) / (end - first))
        print(f"turn {turn}: first piece {first_piece[-1]:.1f} ms, then {decode_rates[-1]:.1f} tok/s", flush=True)
    print(f"RESULT chat --local dtype={args.dtype}: first piece median {statistics.median(first_piece):.1f} ms, "
          f"decode median {statistics.median(decode_rates):.1f} tok/s over {args.turns} turns")


if __name__ == "__main__":
    main()
