"""Chat prompts rendered from tokenizer_config.json match Hugging Face's apply_chat_template."""

import pytest

from jetserve.server import chat_template
from jetserve.server.validation import InvalidArgument, ModelLimits
from jetserve.tokenizer import load_tokenizer

# A ChatML-style template with BOS, a system-role check and a generation prompt.
TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([m["content"] for m in MESSAGES] * 20 + ["system user assistant"],
                            trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = TEMPLATE
    d = tmp_path_factory.mktemp("chat_tok")
    fast.save_pretrained(str(d))
    return str(d)


def _limits(tok) -> ModelLimits:
    return ModelLimits(vocab_size=tok.vocab_size, max_prefill_length=512, max_seq_len=1024,
                       bos_id=tok.bos_id, eos_ids=tuple(tok.eos_ids), top_logprobs=5,
                       tokenizer=tok)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers_apply_chat_template(hf_dir, add_generation_prompt):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(hf_dir)
    want = ref.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt,
                                   tokenize=True)
    if not isinstance(want, list):  # newer transformers return a BatchEncoding
        want = want["input_ids"]
    tok = load_tokenizer(hf_dir)
    got = chat_template.chat_prompt_ids(_limits(tok), MESSAGES, add_generation_prompt)
    assert got == list(want)
    assert got[0] == tok.bos_id  # BOS once, from the template, not added twice


def test_list_of_text_parts_is_joined(hf_dir):
    tok = load_tokenizer(hf_dir)
    parts = [{"role": "user", "content": [{"type": "text", "text": "And of "},
                                          {"type": "text", "text": "Italy?"}]}]
    plain = [{"role": "user", "content": "And of Italy?"}]
    lim = _limits(tok)
    assert chat_template.chat_prompt_ids(lim, parts) == chat_template.chat_prompt_ids(lim, plain)


def test_template_exception_names_messages(hf_dir):
    tok = load_tokenizer(hf_dir)
    with pytest.raises(InvalidArgument) as e:
        chat_template.chat_prompt_ids(_limits(tok), [{"role": "tool", "content": "x"}])
    assert e.value.field == "messages" and "roles must be" in str(e.value)


def test_default_template_when_model_has_none():
    from engines.mock_engine import ByteTokenizer

    tok = ByteTokenizer(eos_ids=(0,))
    lim = _limits(tok)
    ids = chat_template.chat_prompt_ids(lim, [{"role": "user", "content": "hi"}])
    assert bytes(ids).decode() == "<|user|>\nhi\n<|assistant|>\n"


@pytest.mark.parametrize("messages, field", [
    ([], "messages"),
    ("hello", "messages"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content[0]"),
])
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(InvalidArgument) as e:
        chat_template.normalize_messages(messages)
    assert e.value.field == field and field in str(e.value)
