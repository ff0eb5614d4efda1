"""AsyncEngine over its engine-core process, on a tiny random Llama: same tokens as the offline LLM,
aborts free the core's blocks, and a dead core fails open streams instead of hanging them."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tokenmill import LLM, AsyncEngine, EngineConfig, SamplingParams
from tokenmill.engine.async_engine import EngineDeadError

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], list(range(20, 57)), [8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE_ARGS = {"skip_tokenizer_init": True, "kv_cache_space": 0.01, "max_num_batched_tokens": 32}


class FinishRecorder:
    """A stat logger that keeps how each request finished."""

    def __init__(self) -> None:
        self.finish_reasons: dict[str, str | None] = {}

    def record(self, outputs, stats, engine_index=0) -> None:
        for output in outputs:
            if output.finished:
                self.finish_reasons[output.request_id] = output.outputs[0].finish_reason


@pytest.fixture(scope="module")
def engine(tiny_llama):
    loop = asyncio.new_event_loop()  # one loop for the module: the engine's sockets belong to it
    engine = AsyncEngine(EngineConfig.from_kwargs(tiny_llama.path, **ENGINE_ARGS), stat_logger=FinishRecorder())
    loop.run_until_complete(engine.start())
    yield engine, loop

    async def shutdown():
        engine.shutdown()
        await asyncio.sleep(0)  # let the cancelled output task finish

    loop.run_until_complete(shutdown())
    loop.close()


async def generate(engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
    token_ids = []
    async for output in engine.add_request(request_id, {"prompt_token_ids": prompt}, params):
        token_ids += output.outputs[0].token_ids
    return token_ids


async def wait_idle(engine: AsyncEngine, timeout: float = 10) -> None:
    for _ in range(int(timeout / 0.05)):
        stats = engine.last_stats
        if stats is not None and stats.num_running_reqs == 0 and stats.kv_cache_usage == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the core still holds requests: {engine.last_stats}")


def test_tokens_match_the_offline_engine(tiny_llama, engine):
    engine, loop = engine
    offline = LLM(tiny_llama.path, **ENGINE_ARGS).generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                       use_tqdm=False)

    async def run_all():
        return await asyncio.gather(*(generate(engine, f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)))

    assert loop.run_until_complete(run_all()) == [o.outputs[0].token_ids for o in offline]


def test_bad_input_raises_at_once_and_harms_nothing(engine):
    engine, loop = engine
    with pytest.raises(ValueError):
        engine.add_request("bad", {"prompt_token_ids": [10**6]}, GREEDY)
    assert loop.run_until_complete(generate(engine, "good", PROMPTS[0], GREEDY))


def test_leaving_a_stream_aborts_the_request(engine):
    engine, loop = engine

    async def leave_early():
        stream = engine.add_request("long", {"prompt_token_ids": PROMPTS[1]},
                                    SamplingParams(max_tokens=200, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        await wait_idle(engine)

    loop.run_until_complete(leave_early())
    assert engine.get_num_unfinished_seqs() == 0
    assert engine.stat_logger.finish_reasons["long"] == "abort"


def test_abort_ends_a_waiting_consumer(engine):
    engine, loop = engine

    async def abort_from_outside():
        stream = engine.add_request("other", {"prompt_token_ids": PROMPTS[0]},
                                    SamplingParams(max_tokens=200, ignore_eos=True))
        await anext(stream)
        engine.abort(["other"])
        outputs = [output async for output in stream]
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        await wait_idle(engine)

    loop.run_until_complete(abort_from_outside())


def test_abort_ends_every_sample(engine):
    """Before: of n samples aborted, only the last one's end came out (the others never finished, and the server's
    metrics counted one abort)."""
    engine, loop = engine

    async def abort_from_outside():
        stream = engine.add_request("three", {"prompt_token_ids": PROMPTS[0]},
                                    SamplingParams(n=3, max_tokens=200, ignore_eos=True, seed=1))
        await anext(stream)
        engine.abort(["three"])
        outputs = [output async for output in stream]
        assert outputs[-1].finished
        assert sorted((c.index, c.finish_reason) for c in outputs[-1].outputs) == [(i, "abort") for i in range(3)]
        await wait_idle(engine)

    loop.run_until_complete(abort_from_outside())


def test_a_request_that_cannot_cross_to_the_core_leaves_nothing_behind(engine):
    engine, loop = engine
    with pytest.raises(ValueError, match="engine-core process"):
        engine.add_request("callable", {"prompt_token_ids": PROMPTS[0]},
                           SamplingParams(n=2, logits_processors=[lambda ids, logits: logits]))
    assert engine.get_num_unfinished_seqs() == 0 and not engine.output_processor.parents


def test_samples_of_a_seed_at_the_top_of_64_bits_all_run(engine):
    """Each sample's seed is the request's plus its index, wrapped: none may fail to cross to the core."""
    engine, loop = engine
    params = SamplingParams(n=3, seed=(1 << 63) - 1, max_tokens=4, ignore_eos=True)

    async def run():
        return [output async for output in engine.add_request("top-seed", {"prompt_token_ids": PROMPTS[0]}, params)]

    outputs = loop.run_until_complete(run())
    assert outputs[-1].finished and engine.get_num_unfinished_seqs() == 0
    assert sorted({c.index for o in outputs for c in o.outputs}) == [0, 1, 2]


def test_a_dead_core_fails_open_streams_then_a_new_one_serves(engine):
    """Last: it kills the module's engine core."""
    engine, loop = engine
    expected = loop.run_until_complete(generate(engine, "before", PROMPTS[0], GREEDY))

    async def kill_core_mid_stream():
        stream = engine.add_request("doomed", {"prompt_token_ids": PROMPTS[0]},
                                    SamplingParams(max_tokens=200, ignore_eos=True))
        await anext(stream)
        os.kill(engine.core.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    loop.run_until_complete(asyncio.wait_for(kill_core_mid_stream(), timeout=20))
    assert not engine.is_healthy and engine.get_num_unfinished_seqs() == 0
    with pytest.raises(EngineDeadError):
        engine.add_request("late", {"prompt_token_ids": PROMPTS[0]}, GREEDY)

    async def wait_healthy(timeout: float = 120):
        for _ in range(int(timeout / 0.1)):
            if engine.is_healthy:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"the core was not restarted: {engine.dead_reason}")

    loop.run_until_complete(wait_healthy())
    assert engine.num_restarts == 1
    assert loop.run_until_complete(generate(engine, "after", PROMPTS[0], GREEDY)) == expected
