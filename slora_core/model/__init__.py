"""The Llama-family decoder served by the engine."""

from slora_core.model.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
