"""A torch.profiler session over the engine core's steps, started and stopped on request (the server's
POST /start_profile and /stop_profile), written as a gzipped chrome trace plus a text table of the ops.

While it runs, each step is a `record_function` range named by its composition ("step prefill_tokens=...
decode_reqs=..."), so a trace shows what every step computed; with CUDA that range also marks the step's
kernels on the GPU timeline. When no session runs the core makes no profiler call at all.

Only this process is profiled: with tensor parallelism (executor/multiproc.py) that is the driver, rank 0,
whose kernels stand for every rank's (the others run the same step in lockstep); the other ranks'
processes are not traced. Each data-parallel replica is a core of its own and writes its own files.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import time

from torch.profiler import ProfilerActivity, profile, record_function

from tokenmill.protocol import ProfileCommand, ProfileReply
from tokenmill.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)

TABLE_ROWS = 40


def describe_step(scheduler_output: SchedulerOutput) -> str:
    """The step's name in a trace: its prefill tokens and requests, its decoding requests and all its tokens.

    A request computing more than one token of its own (draft tokens aside) is prefilling; a prompt's last
    chunk of a single token counts as a decode, which it costs as."""
    lookahead = scheduler_output.num_lookahead_tokens
    num_prefill_tokens = num_prefill_reqs = num_decode_reqs = 0
    for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
        own = num_tokens - lookahead.get(request_id, 0) if lookahead else num_tokens
        if own > 1:
            num_prefill_tokens += own
            num_prefill_reqs += 1
        else:
            num_decode_reqs += 1
    return (f"step prefill_tokens={num_prefill_tokens} decode_reqs={num_decode_reqs} "
            f"prefill_reqs={num_prefill_reqs} total_tokens={scheduler_output.total_num_scheduled_tokens}")


class CoreProfiler:
    def __init__(self, output_dir: str, with_cuda: bool) -> None:
        """Starts recording at once; `with_cuda`: the engine runs on a GPU (its kernels are recorded too)."""
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir = output_dir
        self.with_cuda = with_cuda
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if with_cuda else [])
        # Shapes and stacks off: they multiply the trace's size and the profiler's own overhead.
        self._profile = profile(activities=activities, record_shapes=False, with_stack=False)
        self._profile.start()
        logger.info("torch profiler started; the trace goes to %s", output_dir)

    def step_region(self, scheduler_output: SchedulerOutput) -> record_function:
        return record_function(describe_step(scheduler_output))

    def stop(self) -> tuple[str, str]:
        """Stop recording and write the trace and the table; returns their paths."""
        self._profile.stop()
        stem = os.path.join(self.output_dir, f"tokenmill-trace-{os.getpid()}-{int(time.time() * 1000)}")
        trace_file, table_file = f"{stem}.json.gz", f"{stem}.table.txt"
        start = time.perf_counter()
        # Exported and compressed in the output folder (not /tmp, which may be small), and renamed into
        # place last: whoever watches the folder never sees half a file.
        self._profile.export_chrome_trace(f"{stem}.json.part")
        with open(f"{stem}.json.part", "rb") as plain, gzip.open(f"{trace_file}.part", "wb", compresslevel=6) as gz:
            shutil.copyfileobj(plain, gz)
        os.remove(f"{stem}.json.part")
        os.replace(f"{trace_file}.part", trace_file)
        # self_device_time_total is torch's current name for self_cuda_time_total.
        sort_by = "self_device_time_total" if self.with_cuda else "self_cpu_time_total"
        with open(table_file, "w") as f:
            f.write(self._profile.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS))
        logger.info("torch profiler stopped; wrote %s and %s in %.1f s", trace_file, table_file,
                    time.perf_counter() - start)
        return trace_file, table_file


def handle_profile_command(core, command: ProfileCommand) -> ProfileReply:
    """Start or stop `core.profiler` (an EngineCore's); any failure is the reply's error, never the core's."""
    try:
        if command.start:
            if core.profiler is not None:
                return ProfileReply(command.call_id, error="the profiler is already running: POST /stop_profile "
                                    "first", is_misuse=True)
            core.profiler = CoreProfiler(command.output_dir, with_cuda=core.executor.device.type == "cuda")
            return ProfileReply(command.call_id)
        profiler, core.profiler = core.profiler, None
        if profiler is None:
            return ProfileReply(command.call_id, error="the profiler is not running: POST /start_profile first",
                                is_misuse=True)
        trace_file, table_file = profiler.stop()
        return ProfileReply(command.call_id, trace_file, table_file)
    except Exception as e:  # a full disk or a profiler error must not take the engine down
        logger.exception("profiling failed")
        return ProfileReply(command.call_id, error=f"profiling failed: {type(e).__name__}: {e}")

