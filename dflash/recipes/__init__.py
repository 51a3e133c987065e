"""Recipes that make data and drafters end to end: `make real` (make_real: SmolLM2-135M-Instruct, ShareGPT, a store,
a drafter, tau per suite), its data (sharegpt_data, sharegpt_mix) and `python -m dflash.regenerate` (answers written
again by the target, through transformers or an OpenAI-compatible server: regen_backends)."""
