"""Llama 2, 3, 3.1 and 3.2 (``LlamaForCausalLM``): the decoder as it is, Llama 3.1's
``llama3`` rotary scaling read from the config."""

from shardplug.pretrained.families.base import Family

FAMILY = Family(model_type="llama", title="Llama 2/3/3.1/3.2")
