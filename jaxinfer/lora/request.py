"""``LoRARequest``: which LoRA adapter a request runs with (vLLM's ``vllm.lora.request``).

An adapter is named by the user (``lora_name``, the ``model`` a server client sends), numbered
(``lora_int_id`` >= 1, unique per adapter in one engine: the key of its device slot, of its
host copy and of the prefix cache's page hashes) and read from a PEFT directory
(``lora_path``: ``adapter_config.json`` + ``adapter_model.safetensors``).

Source: vLLM's ``LoRARequest`` (same field names and order, so code written for vLLM runs).
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """One adapter: its name, its id and its PEFT directory.

    Raises:
        ValueError: ``lora_int_id`` < 1 (0 is the base model's slot), an empty name or path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str | os.PathLike = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(
                f"LoRARequest.lora_name must be a non-empty string, not {self.lora_name!r}"
            )
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise ValueError(
                f"LoRARequest.lora_int_id must be an integer >= 1 (0 is the base model), "
                f"not {self.lora_int_id!r}"
            )
        if not str(self.lora_path):
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path is empty")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
