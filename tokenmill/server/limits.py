"""What one request may ask for. The request models publish these bounds in /openapi.json, so a client
(or a fuzzer) learns them from the schema rather than from 400s."""

from __future__ import annotations

from tokenmill.sampling_params import INT64_MAX, INT64_MIN  # noqa: F401 - the range of seed and priority

MAX_N = 128
"""Most completions per prompt (`n`, `best_of`), as OpenAI allows."""
MAX_LOGPROBS = 2**31
"""The request models' bound of `logprobs`, `top_logprobs` and `prompt_logprobs`: the engine's max_logprobs (20
unless --max-logprobs says otherwise, as vLLM's) is checked per request, and /openapi.json publishes it
(openapi.py)."""
MAX_LOGIT_BIAS = 100.0
"""`logit_bias` values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as OpenAI's."""
MAX_PROMPTS = 256
"""Most prompts in one /v1/completions request."""
MAX_SEQUENCES = 1024
"""Most sequences one request may start (prompts times best_of, or n): past it a request is refused
with 400 rather than left to the overload check, which could never admit it."""

MAX_STOP_STRINGS = 1024
"""Most strings in `stop` (OpenAI allows 4). Every new token of every sample is searched for each of them, on the
server's event loop: 200,000 (2 MB of JSON) held every other stream up to 2 s and slowed them 4x, the body limit's
worth of them would for minutes; 1024 cost ~0.25 ms a sample a token."""

MAX_BAD_WORDS = 1024
"""Most strings in `bad_words`: each is tokenized (twice) on the server's event loop when the request arrives, and
checked against every sample's output at every step; 50,000 held every other stream for over a minute."""

TOKEN_ID_END = 2**31
"""Token ids lie in [0, TOKEN_ID_END); the engine checks them against the vocabulary."""
MAX_TOKEN_COUNT = 2**31 - 1
"""Upper bound of token counts (max_tokens, min_tokens, top_k): no context is longer."""
