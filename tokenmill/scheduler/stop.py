"""Token-level stop conditions, checked by the scheduler after each sampled token.

Stop strings need text, so the output processor checks them and aborts the request.
"""

from __future__ import annotations

from tokenmill.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The finished status the request's last token leads to, or None to keep going."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        last = request.output_token_ids[-1]
        if last in params.stop_token_id_set:
            request.stop_token_id = last  # reported as stop_reason; EOS leaves it None, as in vLLM
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and last in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if reaches_length(request, max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None


def reaches_length(request: Request, max_model_len: int, num_pending: int = 0) -> bool:
    """Whether the request's tokens, with `num_pending` more still in flight, reach max_tokens or
    max_model_len."""
    max_tokens = request.sampling_params.max_tokens
    max_tokens = max_model_len if max_tokens is None else max_tokens
    return (request.num_output_tokens + num_pending >= max_tokens
            or request.num_tokens + num_pending >= max_model_len)
