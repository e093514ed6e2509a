"""The one conversion of an HTTP request's sampling fields (validated by its pydantic model) to `SamplingParams`."""

from areno.config import SamplingParams


def request_sampling_params(req, *, max_new_tokens: int, top_logprobs: int) -> SamplingParams:
    """`SamplingParams` of a chat or text completion request, given what the server worked out from the context:
    ``max_new_tokens`` (the request's limit or the room left in the context) and ``top_logprobs``."""
    # any k beyond the vocabulary means no cut; bounded so it fits the sampler's int64 (an engine-step error would
    # fail every request in the batch, not just this one)
    top_k = min(req.top_k, 1 << 30) if req.top_k and req.top_k > 0 else 0
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature, top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k, max_new_tokens=max_new_tokens, min_new_tokens=min(req.min_tokens, max_new_tokens),
        stop=[s for s in req.stop_list() if s], stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos, repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        min_p=req.min_p or 0.0, logit_bias=req.logit_bias_ids(), seed=req.seed, n=req.n, top_logprobs=top_logprobs,
        grammar=req.grammar(),
    )
