"""StopChecker.extend (a multi-step decode's tokens at once) ends exactly where append + check per token would."""

import random

from areno.config import SamplingParams
from areno.engine.sequence import Sequence
from areno.engine.stopping import StopChecker


def one_by_one(checker, seq, tokens, logprobs):
    for t, lp in zip(tokens, logprobs):
        seq.append(t, lp)
        reason = checker.check(seq)
        if reason is not None:
            return reason
    return None


def test_extend_matches_per_token_checks():
    rng = random.Random(0)
    for case in range(3000):
        opts = SamplingParams(max_new_tokens=rng.randint(1, 12), min_new_tokens=0, ignore_eos=rng.random() < 0.3,
                               stop_token_ids=rng.sample(range(6), rng.randint(0, 2)))
        opts.min_new_tokens = rng.randint(0, opts.max_new_tokens)
        checker = StopChecker(None, eos_token_ids=[rng.randrange(6)], max_model_len=rng.choice([None, 9, 14]))
        prompt = [7] * rng.randint(1, 5)
        a, b = Sequence(prompt, opts), Sequence(prompt, opts)
        done = rng.randint(0, opts.max_new_tokens - 1)
        if checker.max_model_len is not None:
            done = min(done, checker.max_model_len - len(prompt) - 1)
        if done < 0:
            continue
        for s in (a, b):
            s.extend([9] * done, [-1.0] * done)
        tokens = [rng.randrange(6) for _ in range(rng.randint(1, 8))]
        logprobs = [-rng.random() for _ in tokens]
        assert checker.extend(a, tokens, logprobs) == one_by_one(checker, b, tokens, logprobs), case
        assert a.tokens == b.tokens and a.logprobs == b.logprobs, case
