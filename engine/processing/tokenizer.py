"""`Tokenizer`: a Hugging Face tokenizer directory served by the `tokenizers` library alone.

Design: transformers is not needed at run time. `tokenizer.json` gives the model, normalizer,
pre-tokenizer, decoder and post-processor; `tokenizer_config.json` gives the special-token names,
`add_bos_token`/`add_eos_token` and the chat template (a `chat_template.jinja` file next to it
wins, as in transformers). Chat templates render in a sandboxed jinja2 environment configured
like transformers' (`trim_blocks`, `lstrip_blocks`, `loopcontrols`, `tojson`, `raise_exception`,
`strftime_now`, and a pass-through `{% generation %}` tag); a template passed with the call
rather than the tokenizer's own (a request's, `LLM.chat(chat_template=...)`'s) is the caller's
code and renders under a counted budget (chat_template.py, template_budget.py). Compiled
templates are kept in an LRU.

BOS handling: some checkpoints add BOS in tokenizer.json's post-processor, others only say
`add_bos_token: true` in tokenizer_config.json (transformers' slow-tokenizer path). `encode`
adds it in the second case only, so it is never doubled by us. A rendered chat is encoded
without special tokens, with BOS prepended only when the tokenizer adds one and the template did
not already emit it: exactly one BOS either way.

Chat rendering lives in one place, `render_chat` (checks, template, tokens): `LLM.chat`, the
server's chat and tokenize endpoints and the CLI's `chat` all go through it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, overload

import jinja2
from tokenizers import Tokenizer as HFTokenizer

from triollm.engine.processing.chat_template import TemplateCache, render_budgeted, render_own
from triollm.engine.processing.template_budget import RenderBudget

__all__ = ["ChatMessage", "RenderedChat", "Tokenizer"]

ChatMessage = Mapping[str, Any]
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# chat_template_kwargs may not override what the caller sets through its own arguments.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "continue_final_message", "chat_template", "tools", "content_parts"}
)


class RenderedChat(NamedTuple):
    """A chat rendered once: the prompt text and its token ids."""

    text: str
    token_ids: list[int]


class Tokenizer:
    """Encode, decode and chat-template rendering for one model."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        names = dict(special_tokens or {})
        self._special_tokens: dict[str, str] = {k: v for k, v in names.items() if v is not None}
        self.bos_token_id = self._token_id(self._special_tokens.get("bos_token"))
        self.eos_token_id = self._token_id(self._special_tokens.get("eos_token"))
        # What tokenizer.json's post-processor already adds around a single sequence.
        added = backend.encode("", add_special_tokens=True).ids
        self._post_adds_bos = self.bos_token_id is not None and added[:1] == [self.bos_token_id]
        self._post_adds_eos = self.eos_token_id is not None and added[-1:] == [self.eos_token_id]
        self._extra_bos = (
            bool(add_bos_token) and self.bos_token_id is not None and not self._post_adds_bos
        )
        self._extra_eos = (
            add_eos_token and self.eos_token_id is not None and not self._post_adds_eos
        )
        self.templates = TemplateCache()
        self.template_budget = RenderBudget()

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path: Path | str, chat_template: str | None = None) -> Tokenizer:
        """Load `path/tokenizer.json` (+ tokenizer_config.json, chat_template.jinja).

        `chat_template` overrides the directory's template; it may be the template itself or
        the path of a file holding it (like vLLM's `--chat-template`).
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(
                f"tokenizer: {path} has no tokenizer.json (only fast tokenizers are supported)"
            )
        backend = HFTokenizer.from_file(str(tok_file))
        # tokenizer.json may pad or truncate every encoding (sentence-transformers' BERT files pad
        # to 128 tokens): lengths are the engine's business (max_model_len, truncate_prompt_tokens).
        backend.no_padding()
        backend.no_truncation()
        config = _read_json(path / "tokenizer_config.json")
        specials = {name: _token_content(config.get(name)) for name in _SPECIAL_NAMES}
        template = _resolve_template(path, config, chat_template)
        return cls(
            backend,
            special_tokens=specials,
            add_bos_token=config.get("add_bos_token"),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_template=template,
        )

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # ------------------------------------------------------------------ properties

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added ones (may be below the model's embedding rows)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def all_special_ids(self) -> list[int]:
        ids = {i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special}
        for token in self._special_tokens.values():
            token_id = self._token_id(token)
            if token_id is not None:
                ids.add(token_id)
        return sorted(ids)

    @property
    def adds_bos_token(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` starts with BOS."""
        return self._post_adds_bos or self._extra_bos

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._extra_bos:
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
        if add_special_tokens and self._extra_eos:
            ids.append(self.eos_token_id)  # type: ignore[arg-type]
        return ids

    def encode_truncated(self, text: str, max_length: int) -> list[int]:
        """`encode(text)` cut to at most `max_length` tokens the way the tokenizer truncates:
        the end of the text goes, the special tokens around it ([CLS] ... [SEP], BOS) stay."""
        encoding = self.backend.encode(text, add_special_tokens=False)
        specials = self.backend.num_special_tokens_to_add(False) + self._extra_bos + self._extra_eos
        if len(encoding.ids) + specials <= max_length or max_length <= specials:
            return self.encode(text)[:max_length]
        encoding.truncate(max_length - specials, direction="right")
        ids: list[int] = self.backend.post_process(encoding, add_special_tokens=True).ids
        if self._extra_bos:
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
        if self._extra_eos:
            ids.append(self.eos_token_id)  # type: ignore[arg-type]
        return ids

    def encode_pair(
        self, first: str, second: str, max_length: int | None = None, max_second: int | None = None
    ) -> tuple[list[int], list[int]]:
        """A text pair as the tokenizer encodes it for a cross-encoder (`[CLS] a [SEP] b [SEP]`,
        `<s> a </s></s> b </s>`): its ids and token type ids. `max_second` first cuts the second
        text to that many tokens (Cohere's `max_tokens_per_doc`). With `max_length`, the pair is
        cut as the tokenizer's `longest_first` truncation cuts it: the shorter text keeps up to
        half the room, the longer takes the rest; the special tokens stay."""
        a = self.backend.encode(first, add_special_tokens=False)
        b = self.backend.encode(second, add_special_tokens=False)
        if max_second is not None and len(b.ids) > max_second:
            b.truncate(max_second, direction="right")
        if max_length is not None:
            room = max_length - self.backend.num_special_tokens_to_add(True)
            if room < 2:
                raise ValueError(f"truncate_prompt_tokens: {max_length} leaves no room for the texts of a pair")
            n1, n2 = len(a.ids), len(b.ids)
            if n1 + n2 > room:
                if n1 > n2:
                    n2 = min(n2, room // 2)
                    n1 = room - n2
                else:
                    n1 = min(n1, room // 2)
                    n2 = room - n1
                a.truncate(n1, direction="right")
                b.truncate(n2, direction="right")
        pair = self.backend.post_process(a, b, add_special_tokens=True)
        return list(pair.ids), list(pair.type_ids)

    def decode(self, ids: Sequence[int] | int, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    @overload
    def convert_ids_to_tokens(self, ids: int) -> str | None: ...
    @overload
    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]: ...
    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    # ------------------------------------------------------------------ transformers' surface
    # What vLLM scripts call on `get_tokenizer()` (a transformers tokenizer there), with the
    # defaults of transformers 5 (`decode` keeps special tokens; `apply_chat_template` tokenizes
    # and returns a dict). One difference: `all_special_ids` lists every special added token.

    is_fast = True

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(
        self, text: str | Sequence[str], add_special_tokens: bool = True
    ) -> dict[str, Any]:
        """`{"input_ids": ..., "attention_mask": ...}` for a text, or lists for a batch."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        batch = [self.encode(t, add_special_tokens) for t in text]
        return {"input_ids": batch, "attention_mask": [[1] * len(ids) for ids in batch]}

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        """The token strings of `text` (no special tokens added, as in transformers)."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).tokens)

    @overload
    def convert_tokens_to_ids(self, tokens: str) -> int | None: ...  # type: ignore[overload-overlap]  # a str is a Sequence[str]: this one wins
    @overload
    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int | None]: ...
    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """Unknown tokens map to the unk token's id (None without one), as in transformers."""
        if isinstance(tokens, str):
            token_id = self.backend.token_to_id(tokens)
            return self.unk_token_id if token_id is None else int(token_id)
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        decoder = self.backend.decoder
        return str(decoder.decode(list(tokens))) if decoder is not None else "".join(tokens)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend.get_vocab(with_added_tokens=True))

    @property
    def max_token_id(self) -> int:
        return max(self.backend.get_vocab(with_added_tokens=True).values())

    @property
    def pad_token(self) -> str | None:
        return self._special_tokens.get("pad_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id(self.pad_token)

    @property
    def unk_token(self) -> str | None:
        return self._special_tokens.get("unk_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._token_id(self.unk_token)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special_tokens)

    @property
    def all_special_tokens(self) -> list[str]:
        return [t for t in self.convert_ids_to_tokens(self.all_special_ids) if t is not None]

    # ------------------------------------------------------------------ chat

    @overload
    def apply_chat_template(
        self, messages: Sequence[ChatMessage], *, tokenize: Literal[False], **kwargs: Any
    ) -> str: ...
    @overload
    def apply_chat_template(
        self, messages: Sequence[ChatMessage], *, tokenize: Literal[True] = ..., **kwargs: Any
    ) -> list[int] | dict[str, list[int]]: ...
    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tokenize: bool = True,
        return_dict: bool = True,
        content_parts: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int] | dict[str, list[int]]:
        """Render `messages` with the chat template (transformers' semantics).

        A message's content given as a list of parts reaches the template as one string (the
        parts' texts, one per line), or with `content_parts` as the list (vLLM's "openai"
        content format, for templates that loop over the parts).

        With `continue_final_message` no generation prompt is added and the text is cut right
        after the final message's content, so the model continues that message.

        `tokenize=True` returns the token ids instead (the text encoded without adding special
        tokens, as transformers does; `return_dict=True`: `{"input_ids", "attention_mask"}`).
        The defaults are transformers 5's: `tokenize=True`, `return_dict=True`,
        `add_generation_prompt=False`.

        A `chat_template` other than the tokenizer's own is the caller's code: its text (never a
        path), rendered under `template_budget` (scaled to the chat; chat_template.py), with any
        failure a ValueError naming `chat_template`.
        """
        source = chat_template or self.chat_template
        if source is None:
            raise ValueError(
                "chat_template: this tokenizer has no chat template; pass chat_template= "
                "(or --chat-template) or use a plain-text prompt"
            )
        chat = [_normalize_message(i, m, content_parts) for i, m in enumerate(messages)]
        if continue_final_message and not chat:
            raise ValueError("continue_final_message: needs at least one message")
        context: dict[str, Any] = {**self._special_tokens, **template_kwargs}
        context.update(
            messages=chat,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
        )
        if tools is not None:
            context["tools"] = list(tools)
        if source == self.chat_template:
            try:
                rendered = render_own(self.templates, source, context)
            except jinja2.TemplateError as e:
                raise ValueError(f"chat_template: rendering failed: {e}") from e
        else:  # the caller's code: counted, and every failure a ValueError naming chat_template
            rendered = render_budgeted(self.templates, source, context, self.template_budget)
        if continue_final_message:
            final = _normalize_message(len(chat) - 1, chat[-1]) if content_parts else chat[-1]
            rendered = _cut_after_final(rendered, final.get("content"))
        if not tokenize:
            return rendered
        ids = self.encode(rendered, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
        content_parts: bool = False,
    ) -> RenderedChat:
        """Render a chat for generation: the one place every caller goes through.

        Checks the request (ValueErrors that name the field), renders the template once, and
        tokenizes the text: with at most one BOS (see `encode_rendered_chat`), or, with
        `add_special_tokens`, as `encode(text)` does (the tokenize endpoint's option).
        """
        if not messages:
            raise ValueError("messages: must contain at least one message")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message: cannot be true together with add_generation_prompt "
                "(set add_generation_prompt to false)"
            )
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise ValueError(
                f"chat_template_kwargs: may not set {reserved} (use the arguments of their own)"
            )
        text = self.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            tools=tools,
            content_parts=content_parts,
            **kwargs,
        )
        if add_special_tokens:
            return RenderedChat(text, self.encode(text, add_special_tokens=True))
        return RenderedChat(text, self.encode_rendered_chat(text))

    def encode_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """The token ids of `render_chat` (transformers' `apply_chat_template(tokenize=True)`)."""
        return self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            tools=tools,
            chat_template_kwargs=template_kwargs,
        ).token_ids

    def encode_rendered_chat(self, text: str) -> list[int]:
        """Token ids of an already rendered chat: no special tokens added, except one BOS when
        the tokenizer adds one and the template did not emit it."""
        ids = self.encode(text, add_special_tokens=False)
        bos = self.bos_token_id
        if self.adds_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids


# ---------------------------------------------------------------------------------------------
# tokenizer_config.json helpers


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"tokenizer: {path.name} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, {"content": ...} or null."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _resolve_template(path: Path, config: Mapping[str, Any], override: str | None) -> str | None:
    if override is not None:
        return _template_arg(override)
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return _config_template(config.get("chat_template"))


def _template_arg(value: str) -> str:
    """`value` is a template, or the path of a file holding one."""
    if "{" not in value and "\n" not in value:
        candidate = Path(value)
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8")
        raise ValueError(
            f"chat_template: {value!r} is neither a jinja template nor a readable file"
        )
    return value


def _config_template(value: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default", next(iter(named.values()), None))
        return chosen if isinstance(chosen, str) else None
    raise ValueError(
        f"chat_template: expected a string or a list of templates, got {type(value).__name__}"
    )


# ---------------------------------------------------------------------------------------------
# chat template rendering


def _normalize_message(index: int, message: ChatMessage, content_parts: bool = False) -> dict[str, Any]:
    """A plain dict copy whose content is a string when it was a list of text parts (unless
    `content_parts`: the list stays), and whose
    tool calls carry their arguments as objects: `function.arguments`, a JSON string on the
    wire, becomes what it encodes, as templates read it (`tool_call.arguments | tojson`; vLLM
    does the same); arguments that are not JSON stay strings."""
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}]: must be a mapping with 'role' and 'content'")
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list) and not content_parts:
        out["content"] = "\n".join(_part_text(index, part) for part in content)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_call_for_template(call) for call in calls]
    return out


def _call_for_template(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except (ValueError, RecursionError):  # not JSON, or nested too deep to parse: the string stays
        return call
    return {**call, "function": {**fn, "arguments": arguments}}


def _part_text(index: int, part: Any) -> str:
    if isinstance(part, str):
        return part
    if (
        isinstance(part, Mapping)
        and part.get("type", "text") == "text"
        and isinstance(part.get("text"), str)
    ):
        return str(part["text"])
    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    raise ValueError(
        f"messages[{index}].content: part type {kind!r} is not supported (text parts only)"
    )


def _cut_after_final(rendered: str, content: Any) -> str:
    """transformers' continue_final_message: drop what the template put after the last content."""
    if not isinstance(content, str):
        raise ValueError(
            "continue_final_message: the final message has no text content to continue"
        )
    stripped = content.strip()
    loc = rendered.rfind(stripped)
    if loc < 0:
        raise ValueError(
            "continue_final_message: the final message does not appear in the rendered chat "
            "(the chat template changes it)"
        )
    if rendered[loc : loc + len(content.lstrip())] == content:
        return rendered[: loc + len(content.lstrip())]
    return rendered[: loc + len(stripped)]
