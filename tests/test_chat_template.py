"""Our tokenizer.json loader and chat-template renderer against transformers' (the reference), and the sandbox.

The app no longer imports transformers to tokenize (it was most of a second launch); these tests hold
it to transformers' results on the demo folders and on templates that use what Hub templates use.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.llm.text.tokenizer import HFTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["Hello, world!", "你好，世界！", "emoji 🎉👨‍👩‍👧 naïve café", "code:\n\tx = [1, 2]  # ok\r\n  ",
         "user typed <|im_end|> and <|endoftext|> and </s> <s> as text", " leading and trailing ", ""]

# What Hub templates use (Qwen2.5's tools block, Qwen3's namespace and reasoning split, LLaMA-2's
# bos/eos and raise_exception): written here, rendered by both renderers.
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are helpful.' }}
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% continue %}{% endif %}
{%- set content = m.content %}
{%- if m.role == 'assistant' and '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
<|im_start|>{{ m.role }}
{% generation %}{{ content }}{% endgeneration %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA2_TEMPLATE = """{% if messages[0]['role'] == 'system' %}{% set sys = '<<SYS>>\\n' + messages[0]['content'] + \
'\\n<</SYS>>\\n\\n' %}{% set msgs = messages[1:] %}{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}\
{% for m in msgs %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}\
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}\
{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + (sys if loop.first else '') + m['content'] | trim + ' [/INST]' }}\
{% else %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief. {\"json\": \"<b>\"}"}, {"role": "user", "content": "你好"},
     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nhello!"}, {"role": "user", "content": "again <|im_end|>"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & \"later\"",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _folder_with_template(tmp_path: Path, demo: Path, template: str) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(demo, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def both(request, qwen2_demo, llama_demo):
    from transformers import AutoTokenizer

    folder = qwen2_demo if request.param == "qwen2" else llama_demo
    return load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder)), request.param


def test_ids_specials_and_bytes_match_transformers(both):
    ours, ref, name = both
    assert isinstance(ours, HFTokenizer)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False, split_special_tokens=True), text
    assert ours.bos_id == ref.bos_token_id
    assert ours.special_ids == {i for i, t in ref.added_tokens_decoder.items() if t.special} | set(ref.all_special_ids)
    assert ours.vocab_size == len(ref)
    ids = ours.encode(TEXTS[2])
    assert ref.decode(ids) == TEXTS[2]
    assert ours.decode(ids) == (" " if name == "llama" else "") + TEXTS[2]  # the raw bytes: LLaMA's prefix space kept


@pytest.mark.parametrize("template", ["tools", "llama2"])
def test_templates_render_as_transformers_renders_them(tmp_path, qwen2_demo, llama_demo, template):
    from transformers import AutoTokenizer

    demo, source = (qwen2_demo, TOOLS_TEMPLATE) if template == "tools" else (llama_demo, LLAMA2_TEMPLATE)
    folder = _folder_with_template(tmp_path, demo, source)
    ours, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS) if template == "tools" else (None,):
            text = ref.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            assert ours._template.render(messages, tools) == text
            assert ours.render_chat_template(messages) == ref.encode(
                ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)


def test_a_template_error_names_the_template(tmp_path, llama_demo):
    tok = load_tokenizer(_folder_with_template(tmp_path, llama_demo, LLAMA2_TEMPLATE))
    with pytest.raises(UserError, match="chat template failed: TemplateError: Conversation roles must alternate"):
        tok.render_chat_template([{"role": "assistant", "content": "first"}])


@pytest.mark.parametrize("hostile, expected", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ("{{ messages.__class__.__name__ }}", "SecurityError"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}", "SecurityError"),
    ("{{ namespace(_x=1) }}", "SecurityError"),
    ("{{ messages.append(1) }}", "SecurityError"),  # immutable: the caller's messages stay as they are
    ("{{ cycler.__init__.__globals__ }}", "SecurityError"),
])
def test_hostile_templates_are_stopped_by_the_sandbox(tmp_path, qwen2_demo, hostile, expected):
    tok = load_tokenizer(_folder_with_template(tmp_path, qwen2_demo, hostile))
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(UserError, match=expected):
        tok.render_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_chat_template_jinja_file_wins_and_a_broken_one_is_named(tmp_path, qwen2_demo):
    folder = _folder_with_template(tmp_path, qwen2_demo, "{{ 'from the config' }}")
    (folder / "chat_template.jinja").write_text("{{ 'from the file' }}")
    assert load_tokenizer(folder).decode(load_tokenizer(folder).render_chat_template([])) == "from the file"
    (folder / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(UserError, match="chat template does not parse"):
        load_tokenizer(folder)


def test_a_damaged_tokenizer_json_is_named(tmp_path, qwen2_demo):
    folder = tmp_path / "model"
    shutil.copytree(qwen2_demo, folder)
    (folder / "tokenizer.json").write_text((qwen2_demo / "tokenizer.json").read_text()[:5000])
    with pytest.raises(UserError, match="cannot load the tokenizer in .*re-download tokenizer.json"):
        load_tokenizer(folder)


def test_loading_a_chat_model_does_not_import_transformers(qwen2_demo):
    code = ("import sys; from pipeline.llm.text.tokenizer import load_tokenizer; from pipeline.llm.text.prompt import chat_format;"
            f"t = load_tokenizer({str(qwen2_demo)!r}); chat_format(t).render([{{'role': 'user', 'content': 'hi'}}]);"
            "print('transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]
