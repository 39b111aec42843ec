"""Mistral (``MistralForCausalLM``): Llama's tensors; every layer's attention within the
config's ``sliding_window``."""

from shardplug.pretrained.families.base import Family

FAMILY = Family(model_type="mistral", title="Mistral")
