"""What the folders this project writes for others carry so that transformers before 5, back to
OLDEST_TRANSFORMERS (z-lab's pin for its reference loop; the README's support matrix), reads them as 5 does.

transformers 5 saves RoPE as `rope_parameters`; a reader before 5 ignores that key and reads `rope_theta` and
`rope_scaling`, with a base of 10000 where they are missing: SmolLM2 (base 100000) then loads without a word and
answers as another model. 5 reads both forms, so both are written, equal. A tokenizer that 5 loads without a
model-specific class (GGUF's) saves as `TokenizersBackend`, a class older readers do not have; both know it as
`PreTrainedTokenizerFast`, which reads tokenizer.json as it is. tests/test_old_readers.py loads what we write with
OLDEST_TRANSFORMERS in its own environment.
"""

from __future__ import annotations

OLDEST_TRANSFORMERS = "4.57.1"


def with_legacy_rope(config: dict) -> dict:
    """`config` (a config.json's dict) with `rope_theta` and `rope_scaling` beside 5's `rope_parameters`."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:  # none, or one per layer type: left as it is
        return dict(config)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    plain = set(scaling) <= {"rope_type"} and scaling.get("rope_type", "default") == "default"
    return {**config, "rope_theta": rope["rope_theta"], "rope_scaling": None if plain else scaling}


def with_legacy_tokenizer_class(tokenizer_config: dict) -> dict:
    """`tokenizer_config` (a tokenizer_config.json's dict) naming a tokenizer class that readers before 5 have."""
    if tokenizer_config.get("tokenizer_class") != "TokenizersBackend":
        return dict(tokenizer_config)
    return {**tokenizer_config, "tokenizer_class": "PreTrainedTokenizerFast"}
