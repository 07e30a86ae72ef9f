"""Tokenizer: tokenizer.json plus tokenizer_config.json, behaving like transformers' fast tokenizer.

Chat templates render the way transformers 5's `apply_chat_template` renders them (utils/chat_template_utils.py):
the same sandboxed jinja2 environment, globals, filters and template variables. transformers is not imported here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import jinja2.utils
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import InvalidRequestError, ModelLoadError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """Encode, decode and chat-format text for one model. Build it with `from_files` or `from_dir`.

    Safe to share between threads: everything is set up in __init__ and nothing changes afterwards (the HF
    backend encodes and decodes through shared references; each jinja render makes its own context).
    """

    def __init__(self, backend: HFTokenizer, config: Mapping[str, Any], chat_templates: Mapping[str, str]) -> None:
        self._tok = backend
        # transformers turns these off unless a call asks for them
        self._tok.no_truncation()
        self._tok.no_padding()
        self._tok.encode_special_tokens = bool(config.get("split_special_tokens", False))

        # template variables: the named special tokens plus model-specific ones like `image_token`
        self.special_tokens: dict[str, str] = {}
        for key, value in config.items():
            token = _token_str(value)
            if token is not None and (key in SPECIAL_TOKEN_NAMES or key.endswith("_token")):
                self.special_tokens[key] = token
        missing = [t for t in dict.fromkeys(self.special_tokens.values()) if self._tok.token_to_id(t) is None]
        if missing:
            self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])

        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.bos_token_id: int | None = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id: int | None = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)  # = len(transformers tokenizer)
        # transformers skips the cleanup for BPE models: it would delete real spaces before punctuation
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(self._tok.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        )

        # special token strings (e.g. <|im_start|>): in chat content they would forge roles, so callers refuse them
        self.control_tokens: tuple[str, ...] = tuple(
            t.content for t in self._tok.get_added_tokens_decoder().values() if t.special and t.content
        )
        self.chat_template: str | None = chat_templates.get("default")
        env = _template_environment()
        self._templates: dict[str, jinja2.Template] = {}
        for name, source in chat_templates.items():
            try:
                template = env.from_string(source)
            except jinja2.TemplateError as e:
                raise ModelLoadError(f"chat template {name!r} does not compile: {e}") from e
            # NOTE: a template's globals are a ChainMap over the environment's, merged into a dict at every render:
            # one flat copy (the environment is complete by now) takes a render from 8.4 to 3.1 us (Zen 4)
            template.globals = dict(template.globals)
            self._templates[name] = template
        # whether the template itself renders `tools` (else a caller describes the tools in the messages)
        self.renders_tools: bool = "tool_use" in chat_templates or (
            self.chat_template is not None
            and "tools" in jinja2.meta.find_undeclared_variables(env.parse(self.chat_template))
        )

    @classmethod
    def from_files(cls, read: Callable[[str], bytes]) -> Tokenizer:
        """Load from a model directory's files; `read(name)` raises FileNotFoundError for a missing file."""

        def read_json(name: str) -> Any:
            try:
                return json.loads(read(name))
            except FileNotFoundError:
                return None
            except (ValueError, UnicodeDecodeError) as e:
                raise ModelLoadError(f"{name} is not valid JSON: {e}") from e

        try:
            raw = read("tokenizer.json")
        except FileNotFoundError as e:
            raise ModelLoadError("the model directory has no tokenizer.json (a fast tokenizer is required)") from e
        try:
            backend = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the Rust side raises plain Exception
            raise ModelLoadError(f"tokenizer.json cannot be loaded: {e}") from e

        config = read_json("tokenizer_config.json") or {}
        if not isinstance(config, dict):
            raise ModelLoadError("tokenizer_config.json must hold a JSON object")
        # legacy: transformers reads special_tokens_map.json only for configs without added_tokens_decoder
        if "added_tokens_decoder" not in config:
            legacy = read_json("special_tokens_map.json")
            if isinstance(legacy, dict):
                config.update({k: v for k, v in legacy.items() if k in SPECIAL_TOKEN_NAMES or k.endswith("_token")})

        templates = _chat_templates(config.get("chat_template"))
        try:
            templates = {"default": read("chat_template.jinja").decode("utf-8")}  # a separate file wins
        except FileNotFoundError:
            if not templates:
                processor = read_json("chat_template.json")
                if isinstance(processor, dict) and isinstance(processor.get("chat_template"), str):
                    templates = {"default": processor["chat_template"]}
        return cls(backend, config, templates)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        root = Path(path)
        return cls.from_files(lambda name: (root / name).read_bytes())

    def backend_json(self) -> str:
        """The tokenizer as tokenizer.json text, special tokens added here included (for the grammar engine)."""
        return self._tok.to_str()

    def find_control_token(self, text: str) -> str | None:
        return next((t for t in self.control_tokens if t in text), None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the same ids as encode(); the fast batch entry skips the character offsets (a quarter of a short call)
        return self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def token_text(self, token_id: int) -> str:
        """Display text of one token (logprobs); a lone piece of a multi-byte character shows as U+FFFD."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render messages to the prompt text; `tools`, `documents` and other kwargs become template variables."""
        tools = kwargs.pop("tools", None)
        documents = kwargs.pop("documents", None)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
            raise InvalidRequestError("tools must be a list of JSON schema objects", param="tools")
        if documents is not None and not (
            isinstance(documents, list) and all(isinstance(d, Mapping) for d in documents)
        ):
            raise InvalidRequestError("documents must be a list of objects", param="documents")
        template = self._template(tools)
        chat = _normalize_messages(messages)
        variables = {**self.special_tokens, **_plain(kwargs)}  # kwargs override special tokens, as in transformers
        try:
            return template.render(
                messages=chat,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:  # raise_exception() lands here
            raise InvalidRequestError(f"the chat template rejected these messages: {e}", param="messages") from e
        except Exception as e:  # the template's own expressions fail on this input (e.g. str + list)
            raise InvalidRequestError(
                f"the chat template cannot render these messages: {type(e).__name__}: {e}", param="messages"
            ) from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)  # the template writes bos itself

    def _template(self, tools: list | None) -> jinja2.Template:
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        if self._templates:
            raise InvalidRequestError(f"this model has chat templates {sorted(self._templates)} but none is 'default'")
        raise InvalidRequestError("this model has no chat template; send a plain prompt to /v1/completions instead")


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken dict with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_templates(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys() for t in value):
        return {str(t["name"]): str(t["template"]) for t in value}
    if isinstance(value, dict) and all(isinstance(t, str) for t in value.values()):
        return dict(value)
    raise ModelLoadError("tokenizer_config.json chat_template must be a string or a list of {name, template}")


def _clean_up_tokenization(text: str) -> str:
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(old, new)
    for old, new in ((" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    chat = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"{where} must be an object with 'role' and 'content'", param="messages")
        if not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"{where}.role must be a string", param="messages")
        content = message.get("content")
        if content is None:
            if not message.get("tool_calls"):  # OpenAI: content may be null on an assistant tool call
                raise InvalidRequestError(f"{where}.content is required", param="messages")
        elif isinstance(content, list):
            for part in content:
                if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise InvalidRequestError(
                        f"{where}.content parts must be {{'type': 'text', 'text': str}}", param="messages"
                    )
        elif not isinstance(content, str):
            raise InvalidRequestError(f"{where}.content must be a string or a list of text parts", param="messages")
        # transformers drops None values: templates handle a missing key, but may print "None"
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(_plain(message))
    return chat


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types, so the sandbox never sees an object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


# chat templates: the environment of transformers' _cached_compile_jinja_template


class _GenerationTag(jinja2.ext.Extension):
    # `{% generation %}` marks assistant spans for training masks; for inference the body renders as-is
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    # `dict(...)` for templates, without exposing the dict type itself
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # namespaces reject underscore names, which would reach CPython internals
    def __init__(*args: Any, **kwargs: Any) -> None:
        # `self` taken from *args, as jinja2's Namespace does, so that `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # unlike jinja2's own tojson: no HTML escaping, and non-ASCII text stays as-is
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env
