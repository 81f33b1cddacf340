"""The chat templates that ship (engine/templates/*.jinja): chosen by name or alias, each renders a conversation
through transformers' apply_chat_template, and a template's end-of-turn tokens resolve to ids where the vocabulary
has them."""
from __future__ import annotations

import pytest

from engine import chat_templates
from engine.chat_templates import ChatTemplate

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
# What each family's rendering of CONVERSATION must contain (turn markers, the system text where the family puts it).
EXPECTED = {ChatTemplate.GEMMA: ["<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n",
                                 "<start_of_turn>model\nHello.<end_of_turn>\n", "<start_of_turn>model\n"],
            ChatTemplate.LLAMA3: ["<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>",
                                  "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"],
            ChatTemplate.CHATML: ["<|im_start|>system\nBe brief.<|im_end|>\n", "<|im_start|>assistant\nHello.<|im_end|>\n",
                                  "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"],
            ChatTemplate.MISTRAL: ["[INST] Be brief.\n\nHi [/INST] Hello.", "[INST] Bye [/INST]"]}


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded SmolLM2's tokenizer (ChatML: <|im_end|> closes a turn)."""
    from transformers import AutoTokenizer

    from engine.models.loader import default_model_dir
    from engine.settings import Settings

    return AutoTokenizer.from_pretrained(default_model_dir(Settings.from_env().cache_dir))


def test_names_aliases_paths_and_texts_select_a_template(tmp_path) -> None:
    assert chat_templates.template_text("gemma") == ChatTemplate.GEMMA.path.read_text()
    assert chat_templates.template_text("Qwen") == ChatTemplate.CHATML.path.read_text()
    own = tmp_path / "own.jinja"
    own.write_text("{{ messages[0]['content'] }}")
    assert chat_templates.template_text(str(own)) == own.read_text()
    assert chat_templates.template_text("{{ x }}") == "{{ x }}"
    with pytest.raises(ValueError, match="neither a shipped template \\(gemma, llama3, chatml, mistral\\)"):
        chat_templates.template_text("gemma4")


@pytest.mark.parametrize("family", list(ChatTemplate), ids=str)
def test_each_shipped_template_renders_its_familys_turns(tokenizer, family) -> None:
    text = tokenizer.apply_chat_template(CONVERSATION, chat_template=family.path.read_text(), tokenize=False,
                                         add_generation_prompt=True)
    for part in EXPECTED[family]:
        assert part in text, text


def test_end_of_turn_ids_are_the_templates_tokens_the_vocabulary_has(tokenizer) -> None:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert chat_templates.end_of_turn_ids(tokenizer, ChatTemplate.CHATML.path.read_text()) == [im_end]
    assert chat_templates.end_of_turn_ids(tokenizer, tokenizer.chat_template) == [im_end]  # the model's own
    assert chat_templates.end_of_turn_ids(tokenizer, ChatTemplate.GEMMA.path.read_text()) == []  # no <end_of_turn>
    assert chat_templates.end_of_turn_ids(tokenizer, None) == []


def test_a_model_without_a_template_is_told_its_familys_name() -> None:
    assert chat_templates.suggestion("gemma3").startswith("--chat-template gemma ")
    assert chat_templates.suggestion("qwen2").startswith("--chat-template chatml ")
    assert chat_templates.suggestion("phi3").startswith("--chat-template NAME (gemma, llama3, chatml, mistral)")


def test_every_shipped_template_is_package_data() -> None:
    """A wheel carries engine/templates/*.jinja (pyproject's package-data), so `--chat-template gemma` works there."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["engine"]
    for family in ChatTemplate:
        relative = family.path.relative_to(root / "engine").as_posix()
        assert family.path.is_file() and any(fnmatch.fnmatch(relative, g) for g in globs), relative
