"""Text <-> token ids: a Hugging Face ``tokenizer.json`` wrapper, chat templates, incremental detokenization.

* :class:`Tokenizer` loads ``tokenizer.json`` + ``tokenizer_config.json`` (and, if present,
  ``special_tokens_map.json``, ``chat_template.jinja``, ``additional_chat_templates/*.jinja``)
  from a model directory with the ``tokenizers`` library only; transformers is not needed.
* :meth:`Tokenizer.apply_chat_template` renders the model's Jinja chat template exactly as
  ``transformers`` does (:mod:`tinyvllm.chat_template`).
* :class:`IncrementalDetokenizer` turns a request's generated ids into text token by token,
  never emitting half a UTF-8 character, and cuts the text at stop strings.

A model may have more embedding rows than its tokenizer has tokens (Qwen3: 151,936 rows, 151,669
tokens), so a model can produce an id the tokenizer lacks. Such an id decodes to the empty string
everywhere: in :meth:`Tokenizer.decode`, in the detokenizer's text and in :meth:`Tokenizer.token_texts`
(logprobs). Only :meth:`Tokenizer.convert_ids_to_tokens` (vocabulary strings) refuses it.

Decoding is the raw ``tokenizers`` decode: ``clean_up_tokenization_spaces`` from
tokenizer_config.json is ignored (as in vLLM's incremental output), so
``Tokenizer.decode(ids)`` and the detokenizer's final text always agree.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import tokenizers
import tokenizers.decoders
import tokenizers.pre_tokenizers
import tokenizers.processors

from tinyvllm.chat_template import ChatTemplates, load_chat_templates, render_chat_template, select_chat_template

# Named special-token attributes, as transformers' SPECIAL_TOKENS_ATTRIBUTES; the ones present
# are passed to chat templates as variables (``bos_token``, ``eos_token``, ...).
SPECIAL_TOKEN_ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def check_text(text: str, what: str) -> None:
    """Raise ValueError, naming ``what``, when ``text`` is not valid Unicode text.

    The one kind of Python ``str`` that ``tokenizers`` cannot take is one holding a lone
    surrogate (U+D800..U+DFFF outside a pair): it has no UTF-8 encoding, and the library
    fails with ``TypeError: TextInputSequence must be str``. Python makes such strings from
    JSON escapes (``"\\ud800"``) and, for bytes that are not UTF-8, from command-line arguments
    and files read with ``errors="surrogateescape"`` (U+DC80..U+DCFF). Everything else, NUL,
    right-to-left marks, combining marks and emoji included, is valid.

    Cost: O(1) for ASCII strings (CPython keeps the flag); otherwise one UTF-8 encode.

    Args:
        text: the string to check (its type is the caller's to check).
        what: how the message names it, e.g. ``"prompt 3"`` or ``"messages[1].content"``.

    Raises:
        ValueError: ``text`` contains a lone surrogate; the message gives its position.
    """
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = text[e.start]
        hint = ""
        if 0xDC80 <= ord(char) <= 0xDCFF:
            hint = f" (Python's stand-in for the byte 0x{ord(char) - 0xDC00:02x}, which is not valid UTF-8)"
        raise ValueError(
            f"{what} contains a lone surrogate at character {e.start} ({char!r}){hint}; text must be valid Unicode"
        ) from None


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")
"""Message roles a conversation may use: OpenAI's, plus Llama 3.x's ``ipython`` (tool results)."""


def check_conversation(messages: Any, where: str = "messages") -> list[dict[str, Any]]:
    """Check one conversation and return it in the form chat templates take.

    A conversation is a non-empty list of message dicts. A message has a ``role`` from
    :data:`CHAT_ROLES` and a ``content``: a string, or a list of OpenAI text parts
    (``{"type": "text", "text": ...}``), which are joined with newlines as vLLM's "string"
    content format does. Only an assistant message with ``tool_calls`` may leave ``content``
    out (or None). Other keys (``name``, ``tool_calls``, ``tool_call_id``, ...) pass through.
    Every text is checked with :func:`check_text`.

    Args:
        messages: the conversation.
        where: how error messages name it, e.g. ``"messages"`` or ``"messages[2]"``; a message is
            then ``messages[1]``, its text ``messages[1].content``.

    Returns:
        New message dicts (the caller's are not modified).

    Raises:
        TypeError: the conversation is not a list, a message not a dict, a role or content of the
            wrong type.
        ValueError: an empty conversation, a missing role or content, an unknown role, a content
            part that is not text, text that is not valid Unicode.
    """
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"{where} must be a list of message dicts, not {type(messages).__name__}")
    if not messages:
        raise ValueError(f"{where} is an empty conversation; it needs at least one message")
    out = []
    for i, message in enumerate(messages):
        name = f"{where}[{i}]"
        if not isinstance(message, dict):
            raise TypeError(
                f"{name} must be a dict with 'role' and 'content', not {type(message).__name__} ({message!r:.60})"
            )
        role = message.get("role")
        if role is None:
            raise ValueError(f"{name} has no 'role'; expected one of {', '.join(CHAT_ROLES)}")
        if not isinstance(role, str):
            raise TypeError(f"{name}.role must be a string, not {type(role).__name__}")
        if role not in CHAT_ROLES:
            raise ValueError(f"{name}.role {role!r} is not a known role; expected one of {', '.join(CHAT_ROLES)}")
        message = dict(message)
        message["content"] = _message_text(message.get("content"), role, "tool_calls" in message, f"{name}.content")
        if message["content"] is None:
            del message["content"]
        out.append(message)
    return out


def _message_text(content: Any, role: str, has_tool_calls: bool, name: str) -> str | None:
    """A message's content as one checked string (None: an assistant tool call without content)."""
    if content is None:
        if role == "assistant" and has_tool_calls:
            return None
        raise ValueError(f"{name} is missing; every message needs a string content (or a list of text parts)")
    if isinstance(content, str):
        check_text(content, name)
        return content
    if not isinstance(content, (list, tuple)):
        raise TypeError(f"{name} must be a string or a list of text parts, not {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        part_name = f"{name}[{j}]"
        if not isinstance(part, dict):
            raise TypeError(f"{part_name} must be a dict {{'type': 'text', 'text': ...}}, not {type(part).__name__}")
        if part.get("type") != "text":
            raise ValueError(f"{part_name} has type {part.get('type')!r}; only text parts are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise TypeError(f"{part_name}.text must be a string, not {type(text).__name__}")
        check_text(text, f"{part_name}.text")
        texts.append(text)
    return "\n".join(texts)


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and chat template(s) of one model.

    Args:
        backend: the loaded ``tokenizers.Tokenizer``.
        special_tokens: named special tokens as strings, e.g. ``{"bos_token": "<|begin_of_text|>"}``;
            keys must be in :data:`SPECIAL_TOKEN_ATTRIBUTES`; each token must be in the vocabulary.
        chat_template: one Jinja template, or named templates (``{"default": ..., "tool_use": ...}``),
            or None when the model has no chat template.

    Attributes:
        vocab_size: number of ids, added tokens included (the largest id + 1).
        bos_token_id, eos_token_id: ids of the named bos/eos tokens, None when not named.
        all_special_ids: ids of the special added tokens and of the named special tokens.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str] | None = None,
        chat_template: ChatTemplates | None = None,
    ) -> None:
        self._backend = backend
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        for name, token in self.special_tokens.items():
            if name not in SPECIAL_TOKEN_ATTRIBUTES:
                raise ValueError(
                    f"unknown special token attribute {name!r}; expected one of {SPECIAL_TOKEN_ATTRIBUTES}"
                )
            if backend.token_to_id(token) is None:
                raise ValueError(f"{name} {token!r} is not in the tokenizer's vocabulary")
        self.chat_template = chat_template
        self.bos_token_id: int | None = self._named_id("bos_token")
        self.eos_token_id: int | None = self._named_id("eos_token")
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        special |= {backend.token_to_id(t) for t in self.special_tokens.values()}
        self.all_special_ids: set[int] = special
        self._token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_one)
        self._alone: tuple[dict[int, str], dict[int, str]] = ({}, {})  # see decoded_alone
        # A ByteLevel decoder (Llama 3, Qwen) decodes the ids' bytes, concatenated, as UTF-8 (lossy): ids
        # whose texts alone are valid (no U+FFFD) decode together to the concatenation of those texts.
        self.decodes_by_concatenation: bool = isinstance(backend.decoder, tokenizers.decoders.ByteLevel)

    @functools.cached_property
    def vocab_size(self) -> int:
        """The largest id + 1 (a tokenizer's ids may have gaps, so not its token count). Computed at
        first use: the whole vocabulary as a dict is ~0.1 s of a 128k-token tokenizer's load."""
        return max(self._backend.get_vocab(with_added_tokens=True).values()) + 1

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model directory (no network access).

        Special tokens come from tokenizer_config.json (a string or an AddedToken dict with
        ``"content"``); special_tokens_map.json fills in the ones it lacks. The chat template comes
        from ``chat_template.jinja`` (+ ``additional_chat_templates/``) when present, else from
        tokenizer_config.json's ``chat_template`` (a string or a list of ``{"name", "template"}``).

        Raises:
            ValueError: ``model_dir`` has no tokenizer.json.
        """
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json; pass a Hugging Face model directory")
        backend = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = _read_json(model_dir / "tokenizer_config.json")
        special_map = _read_json(model_dir / "special_tokens_map.json")
        special_tokens = {}
        for name in SPECIAL_TOKEN_ATTRIBUTES:
            value = config.get(name) or special_map.get(name)
            if value:
                special_tokens[name] = value["content"] if isinstance(value, dict) else str(value)
        if config.get("tokenizer_class") in _SENTENCEPIECE_CLASSES and getattr(backend.model, "byte_fallback", False):
            _sentencepiece_pipeline(backend, config)
        if "add_bos_token" in config or "add_eos_token" in config:
            _bos_eos_post_processor(backend, config, special_tokens)
        return cls(backend, special_tokens, load_chat_templates(model_dir, config))

    def encode(self, text: str, add_special_tokens: bool = True, what: str = "text") -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (Llama 3: BOS first).

        Raises:
            TypeError: ``text`` is not a str.
            ValueError: ``text`` is not valid Unicode (:func:`check_text`; the message calls it ``what``).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        check_text(text, what)
        # encode_batch releases the GIL while it works; encode holds it throughout (seconds for a long
        # text, during which no other thread of the process runs)
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes that do not form valid UTF-8 decode to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """The text of each id decoded alone, special tokens included (vLLM's logprob ``decoded_token``:
        ``" the"``, ``"<|im_end|>"``, U+FFFD for a byte that is part of a character). An id the
        tokenizer lacks (past its last token, e.g. one of Qwen's padding rows) gives ``""``."""
        return [self._token_text(i) for i in ids]

    def decoded_alone(self, skip_special_tokens: bool) -> dict[int, str]:
        """A cache, shared by this tokenizer's detokenizers, of ``decode([id], skip_special_tokens)``
        by id (the callers fill it; at most one entry per token)."""
        return self._alone[bool(skip_special_tokens)]

    def _decode_one(self, token_id: int) -> str:
        if not 0 <= token_id < self.vocab_size:
            return ""
        return self._backend.decode([token_id], skip_special_tokens=False)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings of ``ids`` (byte-level BPE: ``"Ġthe"`` for ``" the"``)."""
        tokens = []
        for i in ids:
            token = self._backend.id_to_token(i) if 0 <= i < self.vocab_size else None
            if token is None:
                raise ValueError(f"token id {i} is not in the vocabulary (size {self.vocab_size})")
            tokens.append(token)
        return tokens

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the chat template, as ``transformers``' ``apply_chat_template(tokenize=False)``.

        The template sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the
        named special tokens (``bos_token``, ``eos_token``, ...) and ``kwargs`` (e.g. ``date_string``,
        Qwen3's ``enable_thinking``), which override the special tokens.
        ``chat_template`` is a template string or the name of one of the model's templates.
        See :mod:`tinyvllm.chat_template` for the environment.

        Raises:
            ValueError: no chat template, an empty conversation, or the template rejected the
                messages (``raise_exception``), broke a sandbox rule or has a syntax error.
            TypeError: ``tools`` is not a list of JSON-schema dicts.
        """
        template = select_chat_template(self.chat_template, chat_template, tools)
        variables = {**self.special_tokens, **kwargs}
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            **variables,
        )


# transformers 5 builds the text pipeline of these classes itself instead of reading tokenizer.json's.
_SENTENCEPIECE_CLASSES = frozenset({"LlamaTokenizer", "LlamaTokenizerFast"})
_SPACE = "▁"


def _sentencepiece_pipeline(backend: tokenizers.Tokenizer, config: dict[str, Any]) -> None:
    """Give a SentencePiece-converted tokenizer (``LlamaTokenizer`` class with a byte-fallback BPE: Llama 2,
    Mistral v0.1; a byte-level BPE mislabelled ``LlamaTokenizer`` is left as its file says) the
    pipeline transformers 5 gives it, whatever tokenizer.json says, so that ids match transformers (and
    vLLM): no normalizer; a Metaspace pre-tokenizer (spaces -> ``▁``) that prepends ``▁`` to every
    text piece between added tokens that does not start with one (tokenizer_config's ``legacy``), to
    the first piece only (not legacy, the default), or never (``add_prefix_space: false``); a decoder
    that maps ``▁`` back, joins byte tokens and drops the prepended space."""
    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    scheme = ("always" if config.get("legacy", False) else "first") if add_prefix_space else "never"
    backend.normalizer = None
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme=scheme, split=False)
    steps = [tokenizers.decoders.Replace(_SPACE, " "), tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse()]
    if add_prefix_space:
        steps.append(tokenizers.decoders.Strip(" ", 1, 0))
    backend.decoder = tokenizers.decoders.Sequence(steps)


def _bos_eos_post_processor(backend: tokenizers.Tokenizer, config: dict[str, Any], special: dict[str, str]) -> None:
    """tokenizer_config's ``add_bos_token`` / ``add_eos_token`` decide what ``encode`` adds, as in
    transformers 5 (which rebuilds the post-processor from them): BOS first, EOS last (each only when
    the tokenizer names one)."""
    bos = special.get("bos_token") if config.get("add_bos_token") else None
    eos = special.get("eos_token") if config.get("add_eos_token") else None
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t]
    backend.post_processor = tokenizers.processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


# Prompt tokens decoded as context before the first generated token (vLLM uses 5 too): enough
# for decoders whose output depends on the previous token, such as Metaspace's leading space.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """One request's generated ids -> text, token by token, with stop strings.

    Decoding follows vLLM's prefix-offset / read-offset technique: each step decodes only the
    window ``ids[prefix_offset:]`` (the last emitted group of tokens + the new ones) and takes
    the text past ``decode(ids[prefix_offset:read_offset])`` as new, so a step costs O(window),
    not O(length). While the window's text ends in U+FFFD (a multi-byte character split across
    tokens, or bytes that are not UTF-8) the tokens stay in the window; the text before that
    trailing U+FFFD run is already final and is visible.

    Text states, each a prefix of the next:
      released (returned by :meth:`get_delta`) <= visible (:attr:`output_text`) <= final.
    ``output_text`` never ends in a character that may still change. After :meth:`finish` (or
    a stop string) it is final and equals ``tokenizer.decode(generated_ids, skip_special_tokens)``
    cut at the stop string, if any. When a request ends for another reason (EOS, stop token,
    max_tokens, abort), call :meth:`finish` (or ``get_delta(finished=True)``) before reading the
    final ``output_text``: until then bytes that never completed a character are held back.

    Stop strings: the first one to complete in the text wins (the earliest end; for equal ends
    the longest); only the last ``max(len(stop)) - 1`` visible characters plus the new text are
    searched. ``output_text`` is then cut before it (or after it, with
    ``include_stop_str_in_output``) and the detokenizer is finished.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens)``, normally :class:`Tokenizer`.
        prompt_token_ids: the prompt; its last few tokens give the first generated token context.
        skip_special_tokens: drop special tokens from the text.
        spaces_between_special_tokens: accepted for vLLM compatibility and ignored: the
            ``tokenizers`` decoders of byte-level BPE models (Llama 3) write special tokens
            verbatim, with no spaces added, as vLLM does for fast tokenizers.
        stop: stop strings (non-empty).
        include_stop_str_in_output: keep the matched stop string at the end of the text.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        stop = list(stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "_backend", None)  # the `tokenizers` object: skip a wrapper per call
        self._decode_ids = backend.decode if backend is not None else tokenizer.decode
        # decode([id]) by id, where the tokenizer shares one: a step's context window is mostly the
        # previous step's one token, whose text alone is then a dict lookup; with a tokenizer that
        # decodes by concatenation, so is the window's text with the one new token.
        alone = getattr(tokenizer, "decoded_alone", None)
        self._alone: dict[int, str] | None = alone(skip_special_tokens) if alone is not None else None
        self._concatenates = self._alone is not None and getattr(tokenizer, "decodes_by_concatenation", False)
        self._skip_special_tokens = skip_special_tokens
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in stop), default=0)
        # Characters held back from get_delta() while they could still start a stop string.
        self._stop_holdback = 0 if include_stop_str_in_output else max(self._max_stop_len - 1, 0)

        self._ids: list[int] = list(prompt_token_ids)
        self._num_prompt = len(self._ids)
        self._prefix_offset = max(self._num_prompt - _PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = self._num_prompt
        if self._decode(self._prefix_offset, self._read_offset).endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: generated text gets no context.
            self._prefix_offset = self._num_prompt
        self._committed = ""  # text of ids[num_prompt:read_offset]
        self._pending = ""  # text of ids[read_offset:], ends in U+FFFD; its head may be final
        self._visible_len = 0  # len(committed) + len(final head of pending)
        self._final_text: str | None = None  # set when finished: by a stop string or finish()
        self._matched_stop: str | None = None
        self._released = 0

    @property
    def output_text(self) -> str:
        """The generated text so far (never a partial character, unless finished)."""
        if self._final_text is not None:
            return self._final_text
        if not self._pending:
            return self._committed
        return self._committed + self._pending[: self._visible_len - len(self._committed)]

    @property
    def finished(self) -> bool:
        """True after a stop string matched or :meth:`finish` was called."""
        return self._final_text is not None

    @property
    def generated_token_ids(self) -> list[int]:
        """The ids given to :meth:`add_tokens` so far."""
        return self._ids[self._num_prompt :]

    def add_tokens(self, new_token_ids: Sequence[int]) -> str | None:
        """Append generated ids; return the stop string that matched, else None.

        Raises:
            RuntimeError: the detokenizer is already finished.
        """
        if self._final_text is not None:
            raise RuntimeError("add_tokens() after the request finished (stop string matched or finish() called)")
        if not new_token_ids:
            return None
        ids = self._ids
        ids.extend(new_token_ids)
        skip = self._skip_special_tokens
        decode = self._decode_ids
        start, read = self._prefix_offset, self._read_offset
        if start + 1 == read and (alone := self._alone) is not None:
            prefix_text = alone.get(ids[start])
            if prefix_text is None:
                prefix_text = alone[ids[start]] = decode(ids[start:read], skip_special_tokens=skip)
            new_text = None
            if self._concatenates and len(ids) == read + 1 and _REPLACEMENT_CHAR not in prefix_text:
                text = alone.get(ids[read])
                if text is None:
                    text = alone[ids[read]] = decode(ids[read:], skip_special_tokens=skip)
                if _REPLACEMENT_CHAR not in text:
                    new_text = prefix_text + text  # = decode(ids[start:]), see decodes_by_concatenation
            if new_text is None:
                new_text = decode(ids[start:], skip_special_tokens=skip)
        else:
            prefix_text = decode(ids[start:read], skip_special_tokens=skip) if start < read else ""
            new_text = decode(ids[start:], skip_special_tokens=skip)
        old_visible_len = self._visible_len
        if new_text.endswith(_REPLACEMENT_CHAR):
            self._pending = new_text[len(prefix_text) :]
            self._visible_len = len(self._committed) + len(self._pending.rstrip(_REPLACEMENT_CHAR))
        else:
            if len(new_text) > len(prefix_text):
                self._committed += new_text[len(prefix_text) :]
                self._prefix_offset = self._read_offset
            # else: only skipped special tokens; keep the context, drop nothing.
            self._read_offset = len(self._ids)
            self._pending = ""
            self._visible_len = len(self._committed)
        if not self._stop:
            return None
        return self._check_stop(self.output_text, old_visible_len)

    def finish(self) -> str | None:
        """Mark the request finished: the held-back tail (bytes that never formed a character,
        shown as U+FFFD) joins the text. Returns the stop string that matched, if any."""
        if self._final_text is None:
            text = self._committed + self._pending
            old_visible_len = self._visible_len
            if self._check_stop(text, old_visible_len) is None:
                self._final_text = text
        return self._matched_stop

    def get_delta(self, finished: bool) -> str:
        """Text not returned before, for streaming.

        While not finished, the last ``max(len(stop)) - 1`` visible characters are held back (they
        could still become a stop string, which is not part of the output; nothing is held back
        with ``include_stop_str_in_output``, as in vLLM: such text is output anyway); ``finished=True``
        calls :meth:`finish` and releases everything. After a stop string matched everything is
        released whatever ``finished`` says.
        """
        if finished:
            self.finish()
        text = self.output_text
        end = len(text) if self.finished else max(len(text) - self._stop_holdback, self._released)
        delta = text[self._released : end]
        self._released = end
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._decode_ids(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def _check_stop(self, text: str, old_len: int) -> str | None:
        """Find the first stop string completed in ``text`` after position ``old_len``; cut there."""
        if not self._stop:
            return None
        search_from = max(old_len - self._max_stop_len + 1, 0)
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self._stop:
            i = text.find(s, search_from)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        if best is None:
            return None
        end, neg_len, s = best
        self._final_text = text[: end if self._include_stop else end + neg_len]
        self._matched_stop = s
        return s
