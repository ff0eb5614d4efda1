"""The engine core's profiler: step names from the SchedulerOutput, the trace and table it writes, the
messages that start and stop it, and the flag (or environment variable) that turns it on."""

import gzip
import json

import pytest
import torch

from tokenmill.cli import make_parser
from tokenmill.cli.serve import PROFILER_DIR_ENV, server_config_from_args
from tokenmill.engine.codec import RequestKind, decode_outputs, decode_request, encode_outputs, encode_profile
from tokenmill.engine.core_profiler import CoreProfiler, describe_step
from tokenmill.protocol import EngineCoreOutputs, ProfileCommand, ProfileReply
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.server.profiling import prepare_profiler_dir


def mixed_step() -> SchedulerOutput:
    """A new 7-token prompt, a 5-token chunk of an older one, two decodes, one of them verifying 3 drafts."""
    new = NewRequestData("new", list(range(7)), 7, SamplingParams(), [0], 0)
    cached = [CachedRequestData(rid, []) for rid in ("chunk", "d1", "d2")]
    scheduled = {"d1": 1, "d2": 4, "chunk": 5, "new": 7}
    return SchedulerOutput([new], cached, scheduled, sum(scheduled.values()), num_lookahead_tokens={"d2": 3})


def test_step_name_counts_prefill_tokens_and_decoding_requests():
    assert describe_step(mixed_step()) == "step prefill_tokens=12 decode_reqs=2 prefill_reqs=2 total_tokens=17"
    decode_only = SchedulerOutput([], [CachedRequestData("a", [])], {"a": 1}, 1)
    assert describe_step(decode_only) == "step prefill_tokens=0 decode_reqs=1 prefill_reqs=0 total_tokens=1"


def test_trace_and_table_hold_the_named_steps(tmp_path):
    profiler = CoreProfiler(str(tmp_path / "traces"), with_cuda=False)
    with profiler.step_region(mixed_step()):
        torch.ones(64, 64) @ torch.ones(64, 64)
    trace_file, table_file = profiler.stop()
    assert trace_file.endswith(".json.gz") and table_file.endswith(".table.txt")
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == sorted(
        [trace_file.rsplit("/", 1)[1], table_file.rsplit("/", 1)[1]])  # no leftover partial files
    with gzip.open(trace_file, "rt") as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert describe_step(mixed_step()) in names and "aten::mm" in names
    table = open(table_file).read()
    assert "aten::mm" in table and "Self CPU" in table


def test_profile_messages_survive_encoding():
    command = ProfileCommand(3, start=True, output_dir="/tmp/traces")
    assert decode_request(encode_profile(command)) == (RequestKind.PROFILE, command)
    reply = EngineCoreOutputs(profile_reply=ProfileReply(3, "/t/a.json.gz", "/t/a.table.txt"))
    assert decode_outputs(encode_outputs(reply)) == reply


def test_profiler_dir_from_the_flag_or_the_environment(monkeypatch, tmp_path):
    parser = make_parser()
    monkeypatch.delenv(PROFILER_DIR_ENV, raising=False)
    assert server_config_from_args(parser.parse_args(["serve"])).profiler_dir is None
    monkeypatch.setenv(PROFILER_DIR_ENV, "/from/env")
    assert server_config_from_args(parser.parse_args(["serve"])).profiler_dir == "/from/env"
    given = parser.parse_args(["serve", "--profiler-dir", str(tmp_path)])
    assert server_config_from_args(given).profiler_dir == str(tmp_path)


def test_an_unwritable_profiler_dir_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--profiler-dir .*cannot create it"):
        prepare_profiler_dir(str(blocker / "traces"))
    assert prepare_profiler_dir(str(tmp_path / "new" / "traces")) == str(tmp_path / "new" / "traces")
