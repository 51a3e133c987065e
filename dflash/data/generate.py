"""Batched generation with the target (HF `generate`), prompts of any lengths left-padded."""

from __future__ import annotations

from collections.abc import Callable

import torch


@torch.no_grad()
def generate_continuations(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    stop_ids: list[int],
    pad_id: int,
    should_stop: Callable[[], bool] | None = None,
) -> list[list[int]]:
    """Each prompt's generated tokens, cut after the first stop token (kept). Greedy at temperature 0.
    `should_stop()` is asked after every generated token: True ends the whole batch there (a stop request: the
    caller discards the cut batch), so a large batch does not hold a preempted job for a minute."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
        ids[r, width - len(p) :] = torch.tensor(p)
        attention[r, width - len(p) :] = 1
    sample = temperature > 0
    out = model.generate(
        ids.to(device),
        attention_mask=attention.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=temperature if sample else None,
        top_p=None,
        top_k=None,
        pad_token_id=pad_id,
        eos_token_id=stop_ids[0] if len(stop_ids) == 1 else stop_ids,
        stopping_criteria=_stop_when(should_stop) if should_stop is not None else None,
    )
    continuations = []
    for row in out[:, width:].tolist():
        cut = [i for i, t in enumerate(row) if t in stop_ids]
        continuations.append(row[: cut[0] + 1] if cut else row)
    return continuations


def _stop_when(should_stop: Callable[[], bool]):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopRequested(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            return torch.full((input_ids.shape[0],), should_stop(), dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([StopRequested()])
