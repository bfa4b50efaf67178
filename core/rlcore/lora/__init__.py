"""LoRA, in one package: ``config`` (``actor.lora``), ``layers`` (adapters on megatron-core's tensor-parallel
linears), ``peft`` (their factors in PEFT's names and layout), ``sync`` (the adapters-only weight sync,
``rollout.lora=adapters``), ``base`` (the base weights a LoRA checkpoint applies to), ``sizing`` (their memory)."""
