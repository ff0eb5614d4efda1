"""The driver's share of each step, run when the engine waits for the step's tokens: pipeline micro-batches
on the CPU.

On the CPU a rank's launch is its computation: there is no device queue to return from. The driver (the
last pipeline stage) runs in the engine core's thread, so if it computed step i at launch the engine could
send step i+1 to the other stages only once the driver is done with step i, and the stages would take
turns. Deferred, the driver computes step i when the engine waits for its tokens, which it does after
sending the next micro-batch to the other stages: they compute that one meanwhile. (On a GPU the launch only
queues the work, so the driver launches at once.)

Steps run on the driver in launch order; any other call to the driver runs the steps still queued first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.pending_output import PendingOutput, ReadyOutput

DriverStep = Callable[[SchedulerOutput], PendingOutput | ReadyOutput]


class DeferredOutput:
    """A step the driver has not computed yet, with the `result()` contract of the output it will give."""

    def __init__(self, steps: DeferredDriverSteps, scheduler_output: SchedulerOutput) -> None:
        self._steps = steps
        self.scheduler_output = scheduler_output
        self.launched: PendingOutput | ReadyOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self.launched is None:
            self._steps.run_queued(until=self)
        return self.launched.result()


class DeferredDriverSteps:
    def __init__(self, run_step: DriverStep) -> None:
        self._run_step = run_step
        self._queued: deque[DeferredOutput] = deque()

    def launch(self, scheduler_output: SchedulerOutput) -> DeferredOutput:
        step = DeferredOutput(self, scheduler_output)
        self._queued.append(step)
        return step

    def finish(self) -> None:
        """Run the queued steps before shutting down, whatever they raise (a rank may be gone)."""
        try:
            self.run_queued()
        except Exception:
            self._queued.clear()

    def run_queued(self, until: DeferredOutput | None = None) -> None:
        """Compute the queued steps in order, up to `until` (default: all of them)."""
        while self._queued and (until is None or until.launched is None):
            step = self._queued.popleft()
            step.launched = self._run_step(step.scheduler_output)
