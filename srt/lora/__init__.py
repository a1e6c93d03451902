"""LoRA: not part of srt. `layers.unwrap_lora_layer` is the one name SGLang's model files use."""
