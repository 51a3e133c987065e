"""The target's cache in the verify loop, rolled back to the accepted prefix after each verify, for every layer type.

A verify forward feeds the anchor and the B-1 drafts; only the anchor and the accepted drafts stay. Full attention
drops the rejected keys and values (`crop`). A sliding-window layer that has filled its window has already dropped
the keys the rollback needs back, and a linear-attention layer (Gated DeltaNet: Qwen3.5/3.6, Qwen3-Next) holds a
recurrent and a convolution state, not one entry per token. transformers (5.25) records what those layers need for
the last K tokens once `activate_past_recording(recurrent_states_to_keep=K)` is called, after the prefill as its own
assisted decoding does, and `crop(-k)` then rolls every layer back k tokens. K must be at least the verify block
(a smaller K gives wrong states without an error), and `crop` runs after every verify, a count of 0 included, which
trims the recorded history (without it the states grow by a block per cycle). Full-attention targets keep the plain
crop and skip the recording (its sequential state updates cost a linear-attention verify about 1.9x on a CPU).
"""

from __future__ import annotations

import inspect

from torch import nn

_PLAIN_LAYERS = ("DynamicLayer",)  # layers whose crop needs no recording


def new_target_cache(model: nn.Module):
    from transformers import DynamicCache

    return DynamicCache(config=getattr(model, "config", None))


def needs_recording(cache) -> bool:
    """Whether a rollback of this cache needs transformers' past recording (sliding or linear-attention layers)."""
    layers = getattr(cache, "layers", None) or []
    return any(type(layer).__name__ not in _PLAIN_LAYERS for layer in layers)


def start_recording(cache, block_size: int) -> bool:
    """After the prefill: record what rolling back up to `block_size` tokens needs. Returns whether it records."""
    if not needs_recording(cache):
        return False
    if not hasattr(cache, "activate_past_recording"):
        import transformers

        kinds = sorted({type(layer).__name__ for layer in cache.layers} - set(_PLAIN_LAYERS))
        raise RuntimeError(
            f"the target has {', '.join(kinds)} layers, whose cache transformers {transformers.__version__} cannot "
            "roll back to the accepted drafts: speculative decoding on this target needs transformers >= 5.25"
        )
    cache.activate_past_recording(recurrent_states_to_keep=block_size)
    return True


def crop_cache(cache, length: int, recording: bool = False, current: int | None = None) -> None:
    """Keep the first `length` positions of a KV cache (`current`: the positions it holds, when known).

    Works for `DraftKVCache` and for transformers' DynamicCache in both of its conventions: `crop(max_length)`
    (absolute, transformers < 5.2x) and `crop(tokens_to_remove)` (negative count, newer versions). A recording
    cache is cropped every time, by 0 too: that ends the recorded history of the verify it just ran.
    """
    current = int(cache.get_seq_length()) if current is None else current
    if recording:
        cache.crop(length - current)
        return
    if current <= length:
        return
    first = next(iter(inspect.signature(cache.crop).parameters))
    if first == "tokens_to_remove":
        cache.crop(length - current)
    else:
        cache.crop(length)
