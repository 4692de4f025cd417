"""When a sequence stops: EOS, a stop token id, or its length budget. Pure Python."""
from __future__ import annotations

from enc2dec.engine.core.request import Request, RequestStatus, Sequence


def check_stop(req: Request, seq: Sequence, token_id: int,
               num_tokens: int | None = None) -> tuple[RequestStatus | None, int | None]:
    """(finish status, stop_reason) once ``token_id`` is the sequence's token number
    ``num_tokens`` (default: its last); (None, None) to go on."""
    num_output = (seq.num_tokens if num_tokens is None else num_tokens) - seq.num_hidden_tokens
    # min_tokens holds back EOS and stop tokens alike (as vLLM does);
    # the length limit still applies.
    if num_output >= req.min_tokens:
        if token_id in req.eos_token_ids and not req.ignore_eos:
            return RequestStatus.FINISHED_STOPPED, None    # the EOS stays in the output
        if token_id in req.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
    if num_output >= req.max_output_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    return None, None
