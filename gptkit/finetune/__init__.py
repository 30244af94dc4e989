"""Adapting a pre-trained model: supervised examples, LoRA adapters (and, later, preference and task objectives)."""
