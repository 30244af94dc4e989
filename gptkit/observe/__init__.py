"""What a person sees of a model or a run: measures of in-context learning, the logit lens, samples during
training (used by train.py, cli/inspect.py and serving/ alike)."""
