"""Per-request sampling parameters, with vLLM's names, defaults and rules.

Pure Python (no torch) so that the scheduler, the server schema and the tests
can build and validate parameters anywhere. The sampler
(:mod:`tinyvllm.sampling.sampler`) turns a batch of these into device tensors.

Normalisations done in ``__post_init__`` (all as vLLM does):

* ``top_k = -1`` becomes ``0`` (both mean "disabled"), as does a ``top_k`` above 2**31 - 1, which
  keeps every token of any vocabulary (the samplers hold ``top_k`` as int32); ``seed = -1`` becomes
  ``None``.
* ``stop`` and ``stop_token_ids`` become lists (``None`` -> ``[]``, a single
  string -> ``[string]``).
* ``logprobs=True`` / ``prompt_logprobs=True`` become ``1``.
* ``0 < temperature < 0.01`` is raised to ``0.01`` with a warning (tiny
  temperatures overflow half-precision logits in vLLM; we keep the rule so
  that the same request samples the same distribution on both engines).
* ``temperature < 1e-5`` means greedy: ``top_p``, ``top_k`` and ``min_p`` are
  reset to their neutral values (1.0, 0, 0.0), and ``n`` must be 1.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import numbers
from typing import Any

logger = logging.getLogger(__name__)

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (argmax) sampling, as in vLLM."""

MIN_RANDOM_TEMPERATURE = 1e-2
"""Positive temperatures below this are raised to it, as in vLLM (``_MAX_TEMP``)."""

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = 0
    """everything generated so far, at every step."""
    DELTA = 1
    """only what is new since the previous output."""
    FINAL_ONLY = 2
    """one output, when the request finishes (what ``LLM.generate`` uses)."""


class SamplingType(enum.Enum):
    """How the sampler picks the next token of a request."""

    GREEDY = 0
    """argmax of the (penalised) logits."""
    RANDOM = 1
    """a draw from the batch generator."""
    RANDOM_SEED = 2
    """a draw from the request's own generator, seeded with ``SamplingParams.seed``."""


_ALL_TOKENS = 2**31 - 1  # a top_k above this keeps every token of any vocabulary


def _check_int(name: str, value: Any, *, optional: bool = False) -> int | None:
    """Return ``value`` as a Python int, or raise TypeError naming the field.

    Booleans are rejected (``True`` is an ``int`` to Python but never what a user means
    for a count); integral numbers from numpy are accepted and converted.
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "an int or None" if optional else "an int"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} ({value!r}).")
    return int(value)


def _check_float(name: str, value: Any) -> float:
    """Return ``value`` as a finite Python float, or raise TypeError/ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r}).")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}.")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r}).")
    return value


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(eq=True)
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's ``StructuredOutputsParams``): exactly one kind is set.

    Attributes:
        json: a JSON schema (a dict, or its JSON text); the output is one JSON value valid under it.
        regex: the output matches this regular expression as a whole.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's / GBNF syntax, start rule ``root``).
        json_object: the output is any one JSON object.
        disable_any_whitespace: JSON kinds: no whitespace between tokens of the JSON text.
        whitespace_pattern: accepted for vLLM compatibility; must be None (xgrammar has no such option).

    The constraint's text is checked (a schema that is not a JSON object, a regex that does not parse,
    a grammar without ``root``) when the engine compiles it: ``tinyvllm.structured.validate``.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise TypeError(
                f"structured_outputs.json must be a JSON schema (dict or str), got {type(self.json).__name__}"
            )
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"structured_outputs.{name} must be a string, got {type(value).__name__}")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple)):
                raise TypeError(
                    f"structured_outputs.choice must be a list of strings, got {type(self.choice).__name__}"
                )
            self.choice = list(self.choice)
            for c in self.choice:
                if not isinstance(c, str):
                    raise TypeError(f"structured_outputs.choice must hold only strings, got {type(c).__name__} ({c!r})")
            if not self.choice:
                raise ValueError(
                    "structured_outputs.choice is empty: no output could satisfy it; give at least one string"
                )
        if self.json_object is not None:
            _check_bool("structured_outputs.json_object", self.json_object)
        _check_bool("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported by the xgrammar backend; "
                "use disable_any_whitespace=True for compact JSON"
            )
        kinds = [k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            got = "none" if not kinds else " and ".join(kinds)
            raise ValueError(
                f"structured_outputs needs exactly one of json, regex, choice, grammar or json_object; got {got}"
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints have equal keys (a schema dict is dumped with sorted
        keys), so compiled grammars are cached by it."""
        kind = self.kind
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError:
                    return (kind, schema)  # invalid: the compiler reports it
            text = json.dumps(schema, sort_keys=True, ensure_ascii=False)
        elif kind == "choice":
            text = json.dumps(self.choice, ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        if kind in ("json", "json_object") and self.disable_any_whitespace:
            kind += ":compact"
        return (kind, text)

    def clone(self) -> StructuredOutputsParams:
        return dataclasses.replace(self, choice=None if self.choice is None else list(self.choice))


@dataclasses.dataclass(eq=True)
class SamplingParams:
    """Sampling parameters of one request (vLLM's ``SamplingParams`` subset).

    Attributes:
        n: number of output sequences to generate for the prompt (>= 1; 1 when greedy).
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token that
            already occurs in the output.
        frequency_penalty: in [-2, 2]; subtracted ``count`` times from the logit of a token
            that occurs ``count`` times in the output.
        repetition_penalty: > 0; for every token that occurs in the prompt or the output,
            a positive logit is divided by it and a non-positive one multiplied (HF/CTRL).
            1.0 disables it.
        temperature: >= 0; logits are divided by it. Below 1e-5: greedy.
        top_p: in (0, 1]; keep the smallest set of most likely tokens whose probability
            mass reaches ``top_p`` (the most likely token is always kept). 1.0 disables it.
        top_k: keep the ``top_k`` most likely tokens; 0 (or -1, normalised to 0) disables it.
        min_p: in [0, 1]; drop tokens whose probability is below ``min_p`` times the
            probability of the most likely token. 0.0 disables it.
        seed: seed of the request's own random generator (same seed, same output, whatever
            else is batched with it); None uses the engine's generator. -1 means None.
        stop: strings that end generation when they appear in the output text.
        stop_token_ids: token ids that end generation (besides EOS unless ``ignore_eos``).
        ignore_eos: keep generating after EOS.
        max_tokens: most tokens to generate (>= 1); None means up to the model's length.
        min_tokens: EOS and ``stop_token_ids`` are banned until this many tokens exist.
        logprobs: number of most likely tokens whose logprobs are returned for each
            generated token, besides the sampled one (0: the sampled one alone).
            None returns no logprobs.
        prompt_logprobs: the same for prompt tokens: one entry per prompt token (None for
            the first) with its logprob and rank and the ``prompt_logprobs`` most likely
            tokens at its position. A request that asks computes its whole prompt, never
            reading the prefix cache, as vLLM does.
        skip_special_tokens: drop special tokens when detokenising.
        spaces_between_special_tokens: put spaces between special tokens when detokenising.
        include_stop_str_in_output: keep the matched stop string in the output text.
        detokenize: produce text (stop strings need it).
        output_kind: what each RequestOutput carries: cumulative (default), delta or final only.
        structured_outputs: a constraint the output must satisfy (JSON schema, regex, choice, grammar);
            None: unconstrained.
        logit_bias: token id -> bias added to that token's logit before penalties, temperature and
            sampling; each bias is clamped to [-100, 100] (OpenAI's range). The engine checks the ids
            against the vocabulary.
        allowed_token_ids: only these token ids can be sampled (a non-empty list; the engine checks
            them against the vocabulary). Combines with a structured output constraint (both must allow).
        bad_words: words never generated. The engine tokenizes each with and without a leading space
            (vLLM's rule): a word of one token bans that token; a word of several bans its last token
            whenever the output so far ends with its other tokens.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        # The token ids of `bad_words`, set by the engine, which has the tokenizer (`LLMEngine`).
        self.bad_words_token_ids: list[list[int]] | None = None
        self._normalise_types()
        self._verify_args()
        if self.temperature < SAMPLING_EPS:
            # Zero temperature means greedy sampling: the filters cannot change an argmax.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling (temperature=0), got {self.n}.")

    # -- validation ----------------------------------------------------------------------

    def _normalise_types(self) -> None:
        """Check every field's type and bring it to its canonical form (see module doc)."""
        self.n = _check_int("n", self.n)
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty)
        self.frequency_penalty = _check_float("frequency_penalty", self.frequency_penalty)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        self.temperature = _check_float("temperature", self.temperature)
        self.top_p = _check_float("top_p", self.top_p)
        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k == -1 or self.top_k > _ALL_TOKENS:
            self.top_k = 0
        self.min_p = _check_float("min_p", self.min_p)
        self.seed = _check_int("seed", self.seed, optional=True)
        if self.seed == -1:
            self.seed = None
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.max_tokens = _check_int("max_tokens", self.max_tokens, optional=True)
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        if self.logprobs is True:
            self.logprobs = 1
        self.logprobs = _check_int("logprobs", self.logprobs, optional=True)
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs, optional=True)
        for name in (
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
            "detokenize",
        ):
            _check_bool(name, getattr(self, name))
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(
                "structured_outputs must be a StructuredOutputsParams or None, "
                f"got {type(self.structured_outputs).__name__}."
            )
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        self.allowed_token_ids = _normalise_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = _normalise_bad_words(self.bad_words)
        if 0.0 < self.temperature < MIN_RANDOM_TEMPERATURE and self.temperature >= SAMPLING_EPS:
            logger.warning(
                "temperature %s is less than %s, which may cause numerical errors; raised to %s (as vLLM does).",
                self.temperature,
                MIN_RANDOM_TEMPERATURE,
                MIN_RANDOM_TEMPERATURE,
            )
            self.temperature = MIN_RANDOM_TEMPERATURE

    def _verify_args(self) -> None:
        """Value ranges, vLLM's rules (types are already canonical)."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (or None), got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative (or None), got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative (or None), got {self.prompt_logprobs}.")
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are only supported when detokenize is True; set detokenize=True to use stop."
            )

    # -- derived -------------------------------------------------------------------------

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY below ``SAMPLING_EPS`` temperature, else RANDOM_SEED with a seed, else RANDOM."""
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type is SamplingType.GREEDY

    # -- copies --------------------------------------------------------------------------

    def clone(self) -> SamplingParams:
        """A deep copy (the list fields are copied, so mutating one never touches the other)."""
        return self.replace()

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied, validated again (raises like the constructor).

        Note that a greedy instance has had ``top_p``/``top_k``/``min_p`` reset; raising
        the temperature of its copy does not bring back the values it was built with.
        """
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["stop"] = list(fields["stop"])
        fields["stop_token_ids"] = list(fields["stop_token_ids"])
        if fields["structured_outputs"] is not None:
            fields["structured_outputs"] = fields["structured_outputs"].clone()
        for name in ("logit_bias", "allowed_token_ids", "bad_words"):
            if fields[name] is not None:
                fields[name] = type(fields[name])(fields[name])
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"SamplingParams has no field(s) {sorted(unknown)}.")
        fields.update(changes)
        copy = SamplingParams(**fields)
        if "bad_words" not in changes and self.bad_words_token_ids is not None:
            copy.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        return copy

    def __repr__(self) -> str:
        # Only the fields that differ from the defaults: short enough to read in a log.
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = f.default
            if f.name in ("stop", "stop_token_ids"):
                default = []
            if value != default:
                parts.append(f"{f.name}={value!r}")
        return f"SamplingParams({', '.join(parts)})"


def _normalise_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, (list, tuple)):
        stop = list(stop)
    else:
        raise TypeError(f"stop must be a string, a list of strings or None, got {type(stop).__name__}.")
    for s in stop:
        if not isinstance(s, str):
            raise TypeError(f"stop must contain only strings, got {type(s).__name__} ({s!r}).")
        if not s:
            raise ValueError("stop cannot contain an empty string.")
    return stop


def _normalise_stop_token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, set, frozenset)):
        raise TypeError(f"stop_token_ids must be a list of ints or None, got {type(ids).__name__}.")
    out = []
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
            raise TypeError(f"stop_token_ids must contain only ints, got {type(token_id).__name__} ({token_id!r}).")
        if token_id < 0:
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {token_id}.")
        out.append(int(token_id))
    return out


def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
    """{token id: bias} with int ids (a string of digits is accepted, as OpenAI sends them) and finite
    biases clamped to [-100, 100]."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise TypeError(f"logit_bias must be a dict of token id -> bias or None, got {type(bias).__name__}.")
    out: dict[int, float] = {}
    for token_id, value in bias.items():
        if isinstance(token_id, str):
            try:
                token_id = int(token_id)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids (integers), got {token_id!r}.") from None
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
            raise TypeError(f"logit_bias keys must be token ids (integers), got {type(token_id).__name__}.")
        if token_id < 0:
            raise ValueError(f"logit_bias holds token id {token_id}: token ids are non-negative.")
        value = _check_float(f"logit_bias[{token_id}]", value)
        out[int(token_id)] = min(100.0, max(-100.0, value))
    return out


def _normalise_allowed_token_ids(ids: Any) -> list[int] | None:
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, set, frozenset)):
        raise TypeError(f"allowed_token_ids must be a list of ints or None, got {type(ids).__name__}.")
    out = []
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
            raise TypeError(f"allowed_token_ids must contain only ints, got {type(token_id).__name__} ({token_id!r}).")
        if token_id < 0:
            raise ValueError(f"allowed_token_ids holds token id {token_id}: token ids are non-negative.")
        out.append(int(token_id))
    if not out:
        raise ValueError("allowed_token_ids is empty: no token could be sampled; give at least one id (or None).")
    return out


def _normalise_bad_words(words: Any) -> list[str] | None:
    if words is None:
        return None
    if isinstance(words, (str, bytes)) or not isinstance(words, (list, tuple)):
        raise TypeError(f"bad_words must be a list of strings or None, got {type(words).__name__}.")
    for w in words:
        if not isinstance(w, str):
            raise TypeError(f"bad_words must contain only strings, got {type(w).__name__} ({w!r}).")
        if not w.strip():
            raise ValueError("bad_words cannot contain an empty (or whitespace-only) word.")
    return list(words)
