"""The chat prompt's tokenizer side: a chat template's own refusal is the client's error, named."""
from __future__ import annotations

import pytest

from cachesmith.errors import InputError
from cachesmith.model.tokenizer import Tokenizer
from tests.engine_helpers import save_tiny_chat_model

# the rule some models' templates carry (Llama 2, Mistral): user and assistant must alternate
ALTERNATING = ("{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
               "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n"
               "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = Tokenizer(save_tiny_chat_model(tmp_path_factory.mktemp("tiny-tok")))
    tok.hf.chat_template = ALTERNATING
    return tok


def test_a_template_refusal_is_an_input_error_naming_messages(tokenizer):
    parts = tokenizer.rag_prompt_parts(["a passage"], "q?", history=[("user", "hi"), ("assistant", "hello")])
    assert "user: hi" in tokenizer.hf.decode(parts.prefix_ids)  # alternating turns render
    with pytest.raises(InputError, match="messages: the model's chat template refuses .*roles must alternate"):
        tokenizer.rag_prompt_parts(["a passage"], "q?", history=[("user", "hi")])  # user twice in a row
