"""POST /v1/completions: OpenAI's legacy completions, plain and streamed (SSE ending with [DONE]).

Choice ``index`` is ``prompt_index * n + sample_index``, as OpenAI numbers them. Every
response carries ``usage``: the plain one always, a stream on its last chunk (or, with
``stream_options.include_usage``, on a final chunk with no choices, as OpenAI sends it).
"""
from __future__ import annotations

import functools
import json
import time

from fastapi import Request, Response

from .errors import APIError, bad_request
from .protocol import CompletionRequest, LogprobFormatter, finish_reason, new_id, now_s, usage
from .streaming import SSE_DONE, ClientGone, event_stream, failed_stream_events, sse, sse_error, unless_disconnected


def check_model(config, name: str | None) -> None:
    if not config.accepts_model(name):
        raise APIError(404, f"The model `{name}` does not exist; this server serves "
                       f"{', '.join(repr(n) for n in config.served_model_names)}", "model", "model_not_found")


# A token is rarely longer than this many characters: a longer text is measured on its head
# first, so a multi-megabyte prompt costs one bounded tokenisation before its refusal.
CHARS_PER_TOKEN_BOUND = 32


def prompt_limit(front) -> tuple[int | None, str]:
    engine = front.info.max_input_len if front.info is not None else None
    mine = front.config.max_prompt_tokens
    if mine is not None and (engine is None or mine < engine):
        return mine, "--max-prompt-tokens"
    return engine, "the engine's max_input_len"


def check_prompt_lengths(front, prompts: list) -> None:
    """Every prompt within the limit (code ``context_length_exceeded``); runs in the input pool."""
    limit, source = prompt_limit(front)
    if limit is None:
        return
    tok = front.llm.tokenizer if front.llm is not None else None
    for i, p in enumerate(prompts):
        at_least = ""
        if isinstance(p, list):
            n = len(p)
        elif tok is None:
            continue
        else:
            head = limit * CHARS_PER_TOKEN_BOUND
            n = len(tok.encode(p[:head])) if len(p) > head else 0
            if n > limit:
                at_least = "at least "
            else:
                n = len(tok.encode(p))
        if n > limit:
            where = f"prompt {i}" if len(prompts) > 1 else "the prompt"
            raise bad_request(f"{where} has {at_least}{n} tokens; this server takes at most {limit} prompt tokens "
                              f"({source})", "prompt", "context_length_exceeded")


def register(app, front, config) -> None:
    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        check_model(config, body.model)
        prompts = body.prompts()
        params = body.sampling_params()
        if front.info is not None and front.info.is_whisper:
            raise bad_request(f"{config.model_name} is a Whisper model: send audio to /v1/audio/transcriptions",
                              "model")
        front.check_size(len(prompts) * body.sequences_per_prompt)      # before any tokenising
        body.check_against_model(front.info.vocab_size if front.info is not None else None)
        check = functools.partial(check_prompt_lengths, front, prompts) if front.is_ready else None
        rid, created, name = new_id("cmpl"), now_s(), body.model or config.model_name
        fmt = LogprobFormatter(front.llm.tokenizer if front.llm is not None else None)
        try:
            if body.stream:
                # The length check runs in the first prompt's input job: one hop to the pool, not two.
                batch = await front.submit(prompts, params, streaming=True, check=check)
                received = request.scope.get("enc2dec.received")
                return event_stream(request, batch, _events(front, batch, body, rid, created, name, fmt, received))
            if check is not None:
                await front.run_input(check)
            outs = await unless_disconnected(request, front.generate(prompts, params))
        except ClientGone:
            return Response(status_code=499)
        except APIError as e:
            if body.use_beam_search and e.status == 400 and "max_beam_width" in e.message:
                e.message += " (a server's max_beam_width is set at start: --max-beam-width or its --config YAML)"
                e.param = "best_of"
            raise
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                choices.append({"index": i * body.n + c.index, "text": c.text, "finish_reason":
                                finish_reason(c.finish_reason), "stop_reason": c.stop_reason,
                                "logprobs": fmt.format(c.token_ids, c.logprobs, body.logprobs)
                                if body.logprobs is not None and c.logprobs is not None else None})
        return {"id": rid, "object": "text_completion", "created": created, "model": name,
                "choices": choices, "usage": _usage(outs)}


def _usage(outs) -> dict:
    return usage(sum(len(o.prompt_token_ids or ()) for o in outs),
                 sum(len(c.token_ids) for o in outs for c in o.outputs))


def token_event_renderer(rid: str, created: int, model: str, include_usage: bool):
    """``(index, text) -> str``: the SSE event of one choice's new text with no finish and no
    log-probs, byte for byte what ``sse(chunk(...))`` makes of it, from a template made once per
    stream: every streamed token is one such event (the generic path's dicts and nested JSON
    encoding cost ~1.2 us more of the API process's ~35 us of CPU a token)."""
    head = (f'data: {{"id":{json.dumps(rid, ensure_ascii=False)},"object":"text_completion","created":'
            f'{json.dumps(created)},"model":{json.dumps(model, ensure_ascii=False)},"choices":[{{"index":')
    tail = ',"finish_reason":null,"logprobs":null}]' + (',"usage":null' if include_usage else "") + "}\n\n"
    dumps = json.JSONEncoder(ensure_ascii=False).encode

    def render(index: int, text: str) -> str:
        return f'{head}{index},"text":{dumps(text)}{tail}'

    return render


async def _events(front, batch, body: CompletionRequest, rid, created, model, fmt, received: float | None = None):
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    sent_text: dict[int, str] = {}
    sent_tokens: dict[int, int] = {}
    finished_choices: set[int] = set()
    finals: dict[int, object] = {}
    # Per prompt: when this process had its first output and sent its first event (the phases
    # ServeMetrics.observe_stream sums).
    first_out: dict[int, float] = {}
    first_sent: dict[int, float] = {}

    def chunk(choices: list, **extra) -> dict:
        c = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if include_usage:
            c["usage"] = None
        return {**c, **extra}

    token_event = token_event_renderer(rid, created, model, include_usage)

    async for i, out in batch.stream():
        now = time.monotonic()
        if out.error:
            for event in failed_stream_events(front, out):
                yield event
            return
        first_out.setdefault(i, now)
        pending = []
        for c in out.outputs:
            key = i * body.n + c.index
            prev = sent_text.get(key, "")
            delta = c.text[len(prev):] if c.text.startswith(prev) else ""
            is_last = c.finish_reason is not None and key not in finished_choices
            new_ids = c.token_ids[sent_tokens.get(key, 0):]
            if not delta and not new_ids and not is_last:
                continue              # a chunk per engine step with new tokens, even if their text is held back
            new_lps = (c.logprobs or [])[sent_tokens.get(key, 0):]
            sent_text[key] = prev + delta
            sent_tokens[key] = len(c.token_ids)
            if is_last:
                finished_choices.add(key)
            elif body.logprobs is None or c.logprobs is None:
                pending.append((key, delta))     # the common event: rendered from a template below
                continue
            pending.append(chunk([{
                "index": key, "text": delta, "finish_reason": finish_reason(c.finish_reason) if is_last else None,
                "logprobs": fmt.format(new_ids, new_lps, body.logprobs, len(prev))
                if body.logprobs is not None and c.logprobs is not None else None}]))
        if out.finished:
            front.finish(out)
            finals[i] = out
        all_done = len(finals) == len(batch.handles)
        if all_done and not include_usage:
            if pending:
                if isinstance(pending[-1], tuple):
                    key, delta = pending[-1]
                    pending[-1] = chunk([{"index": key, "text": delta, "finish_reason": None, "logprobs": None}])
                pending[-1]["usage"] = _usage(list(finals.values()))
            else:
                pending.append(chunk([], usage=_usage(list(finals.values()))))
        for c in pending:
            yield token_event(*c) if isinstance(c, tuple) else sse(c)
        if pending and i not in first_sent:
            first_sent[i] = time.monotonic()
        if out.finished and received is not None:
            front.observe_stream(received, out, first_out[i], first_sent.get(i, first_out[i]), now)
    if batch.cut_reason:
        yield sse_error(503, batch.cut_reason, "server_shutdown")
        yield SSE_DONE
        return
    if include_usage:
        yield sse(chunk([], usage=_usage(list(finals.values()))))
    yield SSE_DONE
