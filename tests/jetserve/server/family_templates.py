"""Chat templates in the formats of two of today's families, written for these tests, and
tokenizer directories saved by transformers 5 (chat_template.jinja beside
tokenizer_config.json) that hold them.

QWEN3: `<|im_start|>ROLE\\n...<|im_end|>\\n` turns; tools listed in the system turn as JSON
lines inside `<tools>`; an assistant's calls as `<tool_call>` JSON; tool results folded
into one user turn of `<tool_response>` blocks; an assistant's thinking (its
`reasoning_content`, or what its content holds before `</think>`) kept only after the
last user query; `enable_thinking` false writes an empty think block after the cue.
GEMMA3: BOS, then `<start_of_turn>user` / `<start_of_turn>model` turns closed by
`<end_of_turn>`; the system message folded into the first user turn; roles must
alternate, else the template raises.
"""

import json

QWEN3_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nFunctions you may call, one JSON signature a line, inside <tools>:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call one, answer with its name and arguments as JSON inside \
<tool_call></tool_call> tags.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages | length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages | length - 1) - loop.index0 %}
    {%- if message.role == 'user' and not (message.content is string
            and message.content.startswith('<tool_response>')) %}
        {%- set ns.last_query = index %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set thought = '' %}
        {%- if message.reasoning_content is string %}
            {%- set thought = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set thought = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query and (loop.last or thought) %}
            {{- '<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content.lstrip('\\n') }}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if (loop.first and content) or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

GEMMA3_TEMPLATE = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set prefix = messages[0]['content'] | trim + '\\n\\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {%- for part in message['content'] if part['type'] == 'text' -%}
            {{ part['text'] | trim }}
        {%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

# family: (template, specials (bos, eos, pad), other added tokens, special or not)
FAMILIES = {
    "qwen3": (QWEN3_TEMPLATE, (None, "<|im_end|>", "<|endoftext|>"),
              [("<|im_start|>", True), ("<think>", False), ("</think>", False),
               ("<tool_call>", False), ("</tool_call>", False),
               ("<tool_response>", False), ("</tool_response>", False)]),
    "gemma3": (GEMMA3_TEMPLATE, ("<bos>", "<eos>", "<pad>"),
               [("<start_of_turn>", True), ("<end_of_turn>", True)]),
}

CORPUS = [
    "The weather in Paris is mild today, and the time in Tokyo is late.",
    "You are a helpful assistant. Answer briefly; think step by step first.",
    'Functions you may call, one JSON signature a line: {"name": "get_weather", '
    '"arguments": {"city": "Paris"}} and {"type": "object", "properties": {}}',
    "user model assistant system tool Hello! How are you? 2 + 2 = 4. Ça va très bien.",
]


def write_tokenizer_dir(d, family: str):
    """Saves a small byte-level BPE tokenizer with `family`'s special tokens and chat
    template into `d` through transformers' save_pretrained (which writes the template
    to chat_template.jinja); returns the PreTrainedTokenizerFast."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, (bos, eos, pad), added = FAMILIES[family]
    specials = [t for t in (bos, eos, pad) if t]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, special in added if not special])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, special in added if special])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                   pad_token=pad, chat_template=template)
    fast.save_pretrained(str(d))
    assert (d / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((d / "tokenizer_config.json").read_text())
    return fast
