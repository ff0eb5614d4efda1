"""Peak GPU memory of the largest step the scheduler may issue, measured by running it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.kernels.precompile import precompile
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import NewRequestData, SchedulerOutput
from tokenmill.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from tokenmill.worker.worker import Worker


def profiled_num_tokens(worker: Worker) -> int:
    """The tokens of the profiled step: the largest step the scheduler may issue."""
    sched = worker.config.scheduler_config
    return min(sched.max_num_batched_tokens, sched.max_num_seqs * worker.max_model_len)


def profile_peak_memory(worker: Worker) -> int:
    """Bytes needed at peak (weights, activations, sampler, non-torch allocations), KV pool excluded."""
    sched = worker.config.scheduler_config
    block_size = worker.config.cache_config.block_size
    num_tokens = profiled_num_tokens(worker)
    num_reqs = min(sched.max_num_seqs, num_tokens)
    lengths = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
    blocks_per_req = [-(-n // block_size) for n in lengths]
    for layer in worker.attn_layers:
        layer.allocate_kv_cache(sum(blocks_per_req), block_size, worker.kv_cache_dtype, worker.device)
    temp_bytes = sum(layer.kv_cache_bytes_per_token(worker.kv_cache_dtype) for layer in worker.attn_layers) * (
        sum(blocks_per_req) * block_size)

    def make_runner() -> ModelRunner:
        return ModelRunner(worker.model, worker.attn_backend, worker.device, block_size, num_reqs,
                           max(lengths) + 1, worker.hf_config.vocab_size)

    # Sampling with top-k/top-p exercises the sampler's largest temporaries (the sort).
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)
    generator = torch.Generator().manual_seed(0)
    new_requests, next_block = [], 0
    for i, (n, nb) in enumerate(zip(lengths, blocks_per_req)):
        token_ids = torch.randint(0, worker.hf_config.vocab_size, (n,), generator=generator).tolist()
        block_ids = list(range(next_block, next_block + nb))
        next_block += nb
        new_requests.append(NewRequestData(f"profile-{i}", token_ids, n, params, block_ids, 0))
    output = SchedulerOutput(new_requests, [], {r.request_id: len(r.token_ids) for r in new_requests}, num_tokens)

    # The step's kernels compile first, together (a runner takes a step's requests once: one each).
    precompile(lambda: make_runner().execute_model(output), worker.device)
    runner = make_runner()
    torch.cuda.synchronize(worker.device)
    torch.cuda.reset_peak_memory_stats(worker.device)
    runner.execute_model(output)
    torch.cuda.synchronize(worker.device)
    peak_torch = torch.cuda.max_memory_allocated(worker.device)
    free, total = torch.cuda.mem_get_info(worker.device)
    non_torch = (total - free) - torch.cuda.memory_reserved(worker.device)
    for layer in worker.attn_layers:
        layer.release_kv_cache()
    del runner
    torch.cuda.empty_cache()
    return peak_torch - temp_bytes + max(0, non_torch)
