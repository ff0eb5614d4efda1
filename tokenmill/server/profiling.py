"""POST /start_profile and /stop_profile: a torch profiler trace of the engine core(s) while the server runs,
as vLLM serves them. On only with --profiler-dir (or $TOKENMILL_TORCH_PROFILER_DIR); otherwise 404."""

from __future__ import annotations

import os

from tokenmill.engine.async_engine import ProfilerError
from tokenmill.server.errors import APIError
from tokenmill.server.state import ServerState


def prepare_profiler_dir(path: str) -> str:
    """The folder made absolute and created, at start-up: a folder that cannot be written fails in a line
    before the model loads rather than at the first /stop_profile."""
    folder = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--profiler-dir {path}: cannot create it: {(e.strerror or str(e)).lower()}") from None
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--profiler-dir {path}: not writable")
    return folder


def _profiler_dir(state: ServerState) -> str:
    folder = state.config.profiler_dir
    if folder is None:
        raise APIError(404, "profiling is off: start the server with --profiler-dir DIR (or "
                            "TOKENMILL_TORCH_PROFILER_DIR=DIR)", code="profiler_disabled")
    return os.path.abspath(os.path.expanduser(folder))


def _api_error(e: ProfilerError) -> APIError:
    if e.is_misuse:
        return APIError(400, str(e), code="profiler_state")
    return APIError(500, str(e), code="profiler_failed")


async def start_profile(state: ServerState) -> dict:
    """Returns once every engine core records: the requests sent after this answer are in the trace."""
    folder = _profiler_dir(state)
    try:
        await state.engine.start_profile(folder)
    except ProfilerError as e:
        raise _api_error(e) from None
    return {"status": "profiling", "profiler_dir": folder}


async def stop_profile(state: ServerState) -> dict:
    """Returns once every engine core has written its trace (seconds to minutes, by the trace's size)."""
    _profiler_dir(state)
    try:
        replies = await state.engine.stop_profile()
    except ProfilerError as e:
        raise _api_error(e) from None
    return {"status": "stopped", "trace_files": [r.trace_file for r in replies],
            "table_files": [r.table_file for r in replies]}
