"""Adapting a pre-trained model: supervised examples, objectives, classification heads (LoRA's adapter layer is
gptkit.adapters, its directory format gptkit.formats.lora)."""
