"""The engine-core process's loop: a step that raises is reported to the frontend as the last message."""

import os
import tempfile
import threading

import pytest
import zmq

from tokenmill.engine.codec import decode_outputs
from tokenmill.engine.core_proc import EngineCoreProc


class CoreWhoseStepRaises:
    """An engine core with work to do whose next step fails (as a CUDA error or a bug would make it)."""

    def has_requests(self) -> bool:
        return True

    def step(self):
        raise RuntimeError("boom in the forward pass")

    def shutdown(self) -> None:
        pass


def test_a_step_that_raises_is_reported_before_the_core_exits():
    folder = tempfile.mkdtemp(prefix="tokenmill-test-")
    input_address, output_address = (f"ipc://{os.path.join(folder, name)}" for name in ("input", "output"))
    context = zmq.Context()
    to_core, from_core = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    to_core.bind(input_address)
    from_core.bind(output_address)
    proc = EngineCoreProc(CoreWhoseStepRaises(), input_address, output_address)
    exit_codes = []

    def run():
        with pytest.raises(SystemExit) as exited:
            proc.run()
        exit_codes.append(exited.value.code)

    thread = threading.Thread(target=run)
    thread.start()
    assert from_core.poll(10_000), "the core sent nothing"
    outputs = decode_outputs(from_core.recv())
    thread.join(10)
    assert outputs.engine_error == "RuntimeError: boom in the forward pass"
    assert exit_codes == [1]
    for socket in (to_core, from_core):
        socket.close(linger=0)
    context.term()
