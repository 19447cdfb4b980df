"""LoRA adapters: PEFT directories loaded into a stacked device pool, applied per token."""

from jaxinfer.lora.request import LoRARequest

__all__ = ["LoRARequest"]
