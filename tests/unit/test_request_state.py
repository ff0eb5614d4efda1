"""The worker's persistent rows: a step's late host write lands only in the row it was launched for."""

import numpy as np
import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import NewRequestData, SchedulerOutput
from tokenmill.worker.pending_output import PendingOutput
from tokenmill.worker.request_state import RequestStates


def new_request(request_id: str, token_ids: list[int]) -> NewRequestData:
    return NewRequestData(request_id, token_ids, len(token_ids), SamplingParams(), block_ids=[0], num_computed_tokens=0)


def test_a_late_token_of_an_aborted_request_never_lands_in_a_new_request_with_its_id():
    states = RequestStates(max_num_reqs=2, max_model_len=16, max_blocks_per_req=2)
    states.apply(SchedulerOutput([new_request("a", [1, 2, 3])], [], {"a": 3}, 3))
    rows = np.array([states.row_of["a"]])
    pending = PendingOutput(states, ["a"], rows, states.reserve_sampled_tokens(rows), torch.tensor([99]))
    # "a" is aborted while its step runs, and a new request takes the id (and the freed row) at once.
    states.apply(SchedulerOutput([new_request("a", [5, 6, 7, 8, 9])], [], {"a": 5}, 5, finished_request_ids={"a"}))
    assert states.row_of["a"] == rows[0]
    assert pending.result().sampled_token_ids == {"a": [99]}  # the old request's token, for the scheduler to drop
    assert states.token_ids[rows[0], :5].tolist() == [5, 6, 7, 8, 9]


def test_a_late_token_still_lands_for_the_request_it_was_sampled_for():
    states = RequestStates(max_num_reqs=2, max_model_len=16, max_blocks_per_req=2)
    states.apply(SchedulerOutput([new_request("a", [1, 2, 3]), new_request("b", [4])], [], {"a": 3, "b": 1}, 4))
    rows = np.array([states.row_of["a"], states.row_of["b"]])
    pending = PendingOutput(states, ["a", "b"], rows, states.reserve_sampled_tokens(rows), torch.tensor([11, 12]))
    states.apply(SchedulerOutput([], [], {}, 0, finished_request_ids={"b"}))  # b left; a keeps its row
    pending.result()
    assert states.token_ids[rows[0], :4].tolist() == [1, 2, 3, 11]
