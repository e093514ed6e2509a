"""`SamplingParams`: the one set of generation settings, built by the CLI (from `TrainConfig`), the SDK and the
HTTP server, and read by the rollout engine for every sequence; validated here once (`ConfigError` naming the field).

The grammar spec (structured outputs, ``grammar``) is plain data, so it travels to replicas and remote rollout as
it is: ``{"type": "json_object"}``, ``{"type": "json_schema", "schema": {...}}`` or ``{"type": "tool_calls", "calls":
[{"begin", "schema", "end"}, ...], "triggers": [...] | None}`` (tool calls: ``areno.engine.tool_calls.choice``);
`normalize_grammar` checks its form here, `areno.engine.grammar` compiles it against the tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from areno.config.fields import ConfigError, check_bool, check_int, check_number, check_range, is_int

FP32_MAX = 3.4028234663852886e38  # penalties are applied in fp32: an overflow would make inf * 0
GRAMMAR_TYPES = ("json_object", "json_schema", "tool_calls")
CALL_KEYS = {"begin", "schema", "end", "arguments"}  # a tool call's grammar; arguments: one of ARGUMENT_SYNTAXES
ARGUMENT_SYNTAXES = ("json", "xml", "gemma4")  # JSON (the default), qwen3_coder's blocks, Gemma 4's object


class GrammarError(ValueError):
    """A grammar spec that cannot be used (malformed, or a schema the converter refuses)."""


_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def json_safe(schema):
    """``schema`` (for xgrammar) with each length-bounded string as a pattern of printable ASCII but the quote and the
    backslash.

    xgrammar 0.2.9 writes a string with ``minLength``/``maxLength`` as a character class that leaves out only the
    quote, the backslash, CR and LF, so the other control characters get through unescaped (the text is not JSON),
    and its character classes let token pieces of a multi-byte character through that never complete it (each bad
    byte then decodes to one more character than the length allows). Printable ASCII without escapes is a subset of
    the valid strings where both hold: a length-bounded string in a forced tool call or a strict json_schema is
    ASCII. Unbounded strings, and strings with their own pattern, format, enum or const, keep xgrammar's rules."""
    if isinstance(schema, list):
        return [json_safe(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = json_safe(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [json_safe(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: json_safe(v) for k, v in out[key].items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & set(out):
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        upper = "" if high is None else int(high)
        out["pattern"] = rf'^[ !#-\[\]-~]{{{low},{upper}}}$'
    return out


def normalize_grammar(spec) -> dict:
    """The canonical form of a spec: ``{"type": "json_object"}`` or ``{"type": "json_schema", "schema": <dict or
    bool>}`` (a schema given as JSON text is parsed)."""
    if not isinstance(spec, dict) or spec.get("type") not in GRAMMAR_TYPES:
        raise GrammarError(f"a grammar is a dict with type one of {list(GRAMMAR_TYPES)}, got {spec!r}"[:300])
    if spec["type"] == "json_object":
        if set(spec) != {"type"}:
            raise GrammarError(f"a json_object grammar takes no other keys, got {sorted(set(spec) - {'type'})}")
        return {"type": "json_object"}
    if spec["type"] == "tool_calls":
        return normalize_tool_calls(spec)
    if set(spec) != {"type", "schema"}:
        raise GrammarError(f"a json_schema grammar has exactly the keys type and schema, got {sorted(spec)}")
    schema = spec["schema"]
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema is an object (or a boolean), got {type(schema).__name__}")
    return {"type": "json_schema", "schema": schema}


def normalize_tool_calls(spec: dict) -> dict:
    """A tool-call grammar: one of ``calls`` (each its markup ``begin``, JSON arguments under ``schema``, ``end``)
    when ``triggers`` is None; else free text where each trigger starts one of the calls."""
    calls, triggers = spec.get("calls"), spec.get("triggers")
    if set(spec) != {"type", "calls", "triggers"} or not isinstance(calls, list) or not calls:
        raise GrammarError("a tool_calls grammar has exactly the keys type, calls (a non-empty list) and triggers")
    for call in calls:
        if (not isinstance(call, dict) or not {"begin", "schema", "end"} <= set(call) <= CALL_KEYS
                or not isinstance(call["begin"], str) or not isinstance(call["end"], str)
                or not isinstance(call["schema"], dict) or call.get("arguments", "json") not in ARGUMENT_SYNTAXES):
            raise GrammarError("each tool_calls call is {begin: str, schema: dict, end: str, "
                               "arguments?: json|xml|gemma4}")
    if triggers is not None and (not isinstance(triggers, list) or not triggers
                                 or not all(isinstance(t, str) and t for t in triggers)):
        raise GrammarError("tool_calls triggers is null or a non-empty list of strings")
    return {"type": "tool_calls", "calls": calls, "triggers": triggers}


def check_sampling(values, name=lambda field_name: field_name) -> None:
    """The checks of the sampling settings `SamplingParams` and `TrainConfig` share; ``values`` has them as
    attributes, ``name`` turns a field name into the one an error names (a CLI flag for `TrainConfig`)."""
    if not 0 <= values.min_new_tokens <= values.max_new_tokens:
        raise ConfigError(name("min_new_tokens"), f"must be between 0 and {name('max_new_tokens')}, got "
                          f"{values.min_new_tokens}")
    check_number(name("temperature"), values.temperature)
    if values.temperature < 0:
        raise ConfigError(name("temperature"), f"must be >= 0, got {values.temperature!r}")
    check_number(name("top_p"), values.top_p)
    check_range(name("top_p"), values.top_p, 0.0, 1.0, low_open=True)
    if not is_int(values.top_k):
        raise ConfigError(name("top_k"), f"must be an integer, got {values.top_k!r}")
    if values.top_k < 0:
        raise ConfigError(name("top_k"), f"must be >= 0, got {values.top_k!r}")
    for key, low, high, low_open in (("min_p", 0.0, 1.0, False), ("repetition_penalty", 0.0, FP32_MAX, True),
                                     ("presence_penalty", -2.0, 2.0, False), ("frequency_penalty", -2.0, 2.0, False)):
        check_number(name(key), getattr(values, key))
        check_range(name(key), getattr(values, key), low, high, low_open=low_open)


@dataclass
class SamplingParams:
    """Generation settings of one request: n samples of one prompt (the engine keeps one per sequence)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    # logit adjustments before temperature (vLLM's semantics; areno.kernels.penalties), then min-p after it
    min_p: float = 0.0  # in [0, 1]: drop tokens less likely than min_p * the most likely one; 0 = off
    repetition_penalty: float = 1.0  # > 0, 1 = off: logits of prompt/output tokens divided (> 0) or multiplied
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence of a token in the output
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in [-100, 100]
    max_new_tokens: int = 256
    min_new_tokens: int = 0  # EOS and stop ids are masked until this many tokens are out
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: bool = True
    top_logprobs: int = 0  # also return the k most likely tokens' log-probs at each step
    grammar: dict | None = None  # structured output spec (see the module docstring): {"type": "json_object"}, ...
    json_schema: dict | bool | None = None  # the SDK's shorthand: grammar {"type": "json_schema", "schema": it}
    lora: str | None = None  # serving: a loaded LoRA adapter's name (LoraSlots.load) to generate with; None: base

    def __post_init__(self):
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_int("min_new_tokens", self.min_new_tokens, 0)
        check_sampling(self)
        self._check_lists()
        check_int("n", self.n, 1)
        check_int("top_logprobs", self.top_logprobs, 0)
        if self.seed is not None and not is_int(self.seed):
            raise ConfigError("seed", f"must be an integer, got {self.seed!r}")
        for name in ("logprobs", "ignore_eos"):
            check_bool(name, getattr(self, name))
        if self.json_schema is not None:
            if self.grammar is not None and self.grammar != {"type": "json_schema", "schema": self.json_schema}:
                raise ConfigError("json_schema", "give either json_schema or grammar, not both")
            self.grammar = {"type": "json_schema", "schema": self.json_schema}
        if self.grammar is not None:
            try:
                self.grammar = normalize_grammar(self.grammar)
            except GrammarError as exc:
                raise ConfigError("grammar", str(exc)) from exc
        # whether a step may have to adjust this sequence's logits (the engine's hot path reads only this flag)
        self.adjusts_logits = bool(self.penalized or self.min_p > 0 or self.logit_bias or self.min_new_tokens)

    def _check_lists(self):
        """stop, stop_token_ids and logit_bias: None is empty; a lone stop string is a list of one."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise ConfigError("stop", f"must be a list of non-empty strings, got {self.stop!r}")
        ids = list(self.stop_token_ids or [])
        if not all(is_int(t) and t >= 0 for t in ids):
            raise ConfigError("stop_token_ids", f"must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        try:  # JSON (remote rollout) carries the token ids as strings
            bias = {int(t): b for t, b in dict(self.logit_bias or {}).items()}
        except (TypeError, ValueError):
            bias = None
        if bias is None or not all(t >= 0 and isinstance(b, (int, float)) and not isinstance(b, bool)
                                   and -100 <= b <= 100 for t, b in bias.items()):
            raise ConfigError("logit_bias", f"must map token ids >= 0 to biases in [-100, 100], got "
                              f"{self.logit_bias!r}")
        self.stop, self.stop_token_ids = stop, ids
        self.logit_bias = {t: float(b) for t, b in bias.items()}

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the sequence's token counts (a repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_train_config(cls, config, *, n=None, greedy=False, **overrides) -> SamplingParams:
        """The rollout sampling settings of a `TrainConfig`: ``n`` samples (default --n-samples), greedy (the
        evaluation's temperature 0) or --temperature, with --min-p and the penalties; ``overrides`` replace fields
        (an agent's own max_tokens, stop, ...). No seed: the engine draws each request's from its --seed generator."""
        settings = dict(temperature=0.0 if greedy else config.temperature, top_p=config.top_p,
                        top_k=max(0, config.top_k), min_p=config.min_p, repetition_penalty=config.repetition_penalty,
                        presence_penalty=config.presence_penalty, frequency_penalty=config.frequency_penalty,
                        max_new_tokens=config.max_new_tokens, min_new_tokens=config.min_new_tokens, stop=config.stop,
                        n=n or config.n_samples)
        settings.update(overrides)
        stop = settings["stop"]
        settings["stop"] = [s for s in ([stop] if isinstance(stop, str) else stop or []) if s]  # "" stops nothing
        return cls(**settings)
