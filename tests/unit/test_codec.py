"""What crosses the frontend <-> engine-core process boundary survives encoding unchanged."""

import pytest

from tokenmill.engine.codec import (
    RequestKind,
    decode_outputs,
    decode_request,
    encode_abort,
    encode_add,
    encode_outputs,
    encode_wake,
)
from tokenmill.protocol import EngineCoreOutput, EngineCoreOutputs, EngineRequest, SchedulerStats
from tokenmill.request import FinishReason
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import TokenLogprobs


def test_request_round_trip():
    params = SamplingParams(n=2, temperature=0.7, top_k=5, seed=3, stop=["\n"], logit_bias={7: -1.5}, logprobs=2,
                            max_tokens=9)
    request = EngineRequest("r1", [1, 2, 3], params, eos_token_ids=frozenset({2, 9}), arrival_time=12.5, priority=1,
                            cache_salt="s")
    kind, decoded = decode_request(encode_add(request))
    assert kind == RequestKind.ADD and decoded == request


def test_abort_round_trip():
    assert decode_request(encode_abort(["a", "b"])) == (RequestKind.ABORT, ["a", "b"])


def test_wake_round_trip():
    assert decode_request(encode_wake()) == (RequestKind.WAKE, None)


def test_outputs_round_trip():
    outputs = EngineCoreOutputs(
        [EngineCoreOutput("r1", [5], FinishReason.STOP, stop_reason=2, num_cached_tokens=16,
                          new_logprobs=[TokenLogprobs([5, 6], [-0.1, -2.0], rank=1)]),
         EngineCoreOutput("r2", [7, 8])],
        SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25, prefix_cache_hits=16, queue_times=[0.5]),
    )
    assert decode_outputs(encode_outputs(outputs)) == outputs


def test_python_callables_cannot_cross():
    request = EngineRequest("r", [1], SamplingParams(logits_processors=[lambda ids, logits: logits]))
    with pytest.raises(ValueError, match="engine-core process"):
        encode_add(request)


def test_integers_past_64_bits_are_the_requests_fault():
    request = EngineRequest("r", [1], SamplingParams(), priority=1 << 70)
    with pytest.raises(ValueError, match="ints"):
        encode_add(request)
