"""One record -> token ids and a loss mask on exactly the assistant turns.

A record is `{"text"}`, `{"messages": [{role, content}]}` or ShareGPT's `{"conversations": [{from, value}]}`.
Conversations are normalised as real exports need (`record_messages`; docs/data.md states each decision):
empty turns dropped, consecutive turns of one speaker merged, assistant turns before the first user turn kept
as unsupervised context, turns after the last assistant turn dropped; what is left untrainable raises
`BadRecordError` with a reason it is counted under.
Chat records are rendered once with the tokenizer's chat template; each assistant turn's *character* span is
found in that text (its generation prompt is a prefix of the conversation's render; the turn ends after its
content and the template's end-of-turn marker), and a token is supervised when its characters overlap a span
(the fast tokenizer's offset mapping); a turn cut at the generation limit (`"finish_reason": "length"`) is
supervised without the marker, which its model never wrote. Working on characters, not token prefixes, means
a BPE merge across a turn boundary ('assistant\\n' + '    x = 1' -> 'assistant' + '\\n    ' ...) cannot drop a
turn: the merged token overlaps the answer, so it is supervised. Renders per record: one for the whole
conversation plus one generation prompt per assistant turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from dflash.data.corpus import BadRecordError

# ShareGPT speaker names -> chat roles
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
_PROBE = "\x00dflash-probe\x00"


@dataclass
class Rendered:
    ids: list[int]
    loss_mask: list[bool]
    answer_starts: list[int]  # token index where each supervised turn starts (eval prompts end there); [] for text
    is_chat: bool
    answer_ends: list[int] | None = None  # token index after each supervised turn's last token


def parse_line(raw: bytes, where: str) -> dict:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecordError(f"{where}: not UTF-8 ({e.reason} at byte {e.start} of the record)", "not_utf8") from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadRecordError(f"{where}: invalid JSON ({e.msg})", "invalid_json") from None
    if not isinstance(record, dict):
        raise BadRecordError(f"{where}: expected a JSON object, got {type(record).__name__}", "bad_shape")
    return record


def record_messages(record: dict, where: str) -> list[dict] | None:
    """The record's chat messages as [{role, content}] (None for a `text` record), validated and normalised."""
    if "text" in record:
        if not isinstance(record["text"], str):
            raise BadRecordError(f"{where}: 'text' must be a string", "bad_shape")
        if not record["text"]:
            raise BadRecordError(f"{where}: 'text' is empty: no token to supervise", "empty_text")
        return None
    if "messages" in record:
        msgs = record["messages"]
        if not (isinstance(msgs, list) and all(_is_message(m, "role", "content") for m in msgs)):
            raise BadRecordError(f"{where}: 'messages' must be a list of {{role, content}} strings", "bad_shape")
        msgs = [{"role": m["role"], "content": m["content"], **_cut(m)} for m in msgs]
    elif "conversations" in record:
        turns = record["conversations"]
        if not (isinstance(turns, list) and all(_is_message(t, "from", "value") for t in turns)):
            raise BadRecordError(f"{where}: 'conversations' must be a list of {{from, value}} strings", "bad_shape")
        unknown = sorted({t["from"] for t in turns} - set(SHAREGPT_ROLES))
        if unknown:
            known = sorted(SHAREGPT_ROLES)
            raise BadRecordError(f"{where}: unknown speaker(s) {unknown} (known: {known})", "unknown_speaker")
        msgs = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
    else:
        why = f"a record needs 'text', 'messages' or 'conversations' (keys: {sorted(record)})"
        raise BadRecordError(f"{where}: {why}", "bad_shape")
    return normalise(msgs, where)


def normalise(msgs: list[dict], where: str) -> list[dict]:
    """Empty turns dropped, consecutive turns of one role merged (blank line between), turns after the last
    assistant turn dropped. Assistant turns before the first user turn stay, as context (`first_user`)."""
    if not msgs:
        raise BadRecordError(f"{where}: the conversation is empty", "empty_conversation")
    merged: list[dict] = []
    for m in msgs:
        if not m["content"].strip():
            continue
        if merged and merged[-1]["role"] == m["role"]:  # the turn ends as its last part does
            merged[-1] = {**m, "content": merged[-1]["content"] + "\n\n" + m["content"]}
        else:
            merged.append(dict(m))
    if not merged:
        raise BadRecordError(f"{where}: every turn of the conversation is empty", "empty_conversation")
    roles = [m["role"] for m in merged]
    if "assistant" not in roles:
        raise BadRecordError(f"{where}: no assistant turn to supervise", "no_assistant_turn")
    if "user" not in roles:
        raise BadRecordError(f"{where}: no user turn (the assistant's turns answer nothing)", "no_user_turn")
    last = len(roles) - 1 - roles[::-1].index("assistant")
    if last < roles.index("user"):
        raise BadRecordError(f"{where}: no assistant turn answers a user turn", "no_assistant_turn")
    return merged[: last + 1]


def _cut(message: dict) -> dict:
    """An assistant message cut at the generation limit (`"finish_reason": "length"`, as `python -m
    dflash.regenerate` and OpenAI's API mark it): the target did not end that turn, so the end-of-turn marker
    the chat template adds after it is not supervised."""
    return {"finish_reason": "length"} if message.get("finish_reason") == "length" else {}


def first_user(messages: list[dict]) -> int:
    """Index of the first user turn: assistant turns before it are context, not supervised."""
    return next(i for i, m in enumerate(messages) if m["role"] == "user")


def _is_message(m, role_key: str, content_key: str) -> bool:
    return isinstance(m, dict) and isinstance(m.get(role_key), str) and isinstance(m.get(content_key), str)


def render_template(tokenizer, messages: list[dict], add_generation_prompt: bool, **template_kwargs) -> str:
    return tokenizer.apply_chat_template(
        plain(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )


def plain(messages: list[dict]) -> list[dict]:
    """The messages as templates and chat APIs take them: role and content (no finish_reason)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def end_of_turn_marker(tokenizer, **template_kwargs) -> str:
    """What the template writes after an assistant's content (e.g. '<|im_end|>'), trailing whitespace dropped:
    the model generates it to end its turn, so it is supervised with the turn."""
    text = render_template(
        tokenizer,
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}],
        False,
        **template_kwargs,
    )
    at = text.rfind(_PROBE)
    return text[at + len(_PROBE) :].rstrip() if at >= 0 else ""


def assistant_char_spans(
    tokenizer, messages: list[dict], text: str, eot: str, where: str, **template_kwargs
) -> list[tuple[int, int]]:
    """[start, end) of every assistant turn in `text` (the conversation's render): from the end of its generation
    prompt to the end of its content plus the end-of-turn marker. The content is searched as rendered: whole,
    or (templates that drop earlier turns' reasoning, like Qwen3's) the part after its last '</think>'."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _prompt_end(tokenizer, messages[:i], text, cursor, **template_kwargs)
        content = m["content"]
        candidates = [content, content.split("</think>")[-1].lstrip("\n"), content.strip()]
        search_from = cursor if start is None else start
        found = [(text.find(c, search_from), c) for c in candidates if c]
        found = [(at, c) for at, c in found if at >= 0]
        if not found:
            why = f"assistant message {i}'s content is not in the chat template's render"
            raise BadRecordError(f"{where}: {why}", "not_in_render")
        at, c = min(found, key=lambda f: (f[0], -len(f[1])))  # the earliest, and there the longest
        end = at + len(c)
        if eot and text.startswith(eot, end) and not _cut(m):  # a cut turn's marker is the template's alone
            end += len(eot)
        if start is None:  # no usable generation prompt: the turn starts where its content does
            start = at
        spans.append((start, end))
        cursor = end
    return spans


def _prompt_end(tokenizer, head: list[dict], text: str, cursor: int, **template_kwargs) -> int | None:
    """Where the answer to `head` starts in `text`: the end of `head` rendered with the generation prompt, when
    that render is a prefix of the conversation's (it is for every template we know); else None."""
    try:
        prompt = render_template(tokenizer, head, True, **template_kwargs)
    except Exception:  # some templates refuse an empty or system-only conversation
        return None
    return len(prompt) if len(prompt) >= cursor and text.startswith(prompt) else None


def token_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """Tokens whose characters [start, end) overlap any span."""
    mask = np.zeros(len(offsets), dtype=bool)
    starts, ends = offsets[:, 0], offsets[:, 1]
    for s, e in spans:
        mask |= (starts < e) & (ends > s)
    return mask


def render_record(record: dict, tokenizer, where: str, eot: str, **template_kwargs) -> Rendered:
    """The record's token ids, loss mask and answer starts. `eot`: `end_of_turn_marker(tokenizer)`."""
    messages = record_messages(record, where)
    if messages is None:
        ids = tokenizer(record["text"], add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids = ids + [tokenizer.eos_token_id]  # supervised: the drafter learns where text ends
        return Rendered(ids, [True] * len(ids), [], False, [])
    if not getattr(tokenizer, "chat_template", None):
        why = "a chat record, but the target's tokenizer has no chat template"
        raise BadRecordError(f"{where}: {why}", "no_chat_template")
    try:
        text = render_template(tokenizer, messages, False, **template_kwargs)
    except Exception as e:  # the template's own checks (e.g. roles must alternate) reject the conversation
        raise BadRecordError(f"{where}: the chat template rejects the conversation ({e})", "template_rejects") from None
    spans = assistant_char_spans(tokenizer, messages, text, eot, where, **template_kwargs)
    answered = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    spans = [span for i, span in zip(answered, spans) if i > first_user(messages)]  # leading turns: context
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    mask = token_mask(offsets, spans)
    if not mask.any():
        why = "no token of an assistant turn (the chat template renders it empty)"
        raise BadRecordError(f"{where}: {why}", "no_supervised_token")
    per_turn = [np.flatnonzero(token_mask(offsets, [span])) for span in spans]
    starts = [int(t[0]) for t in per_turn if t.size]
    ends = [int(t[-1]) + 1 for t in per_turn if t.size]
    return Rendered(list(enc["input_ids"]), mask.tolist(), starts, True, ends)
