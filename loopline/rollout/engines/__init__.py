"""Engines: what turns token ids into token ids and logprobs (the built-in CPU engine, SGLang), built by name from the run config's `engine:`."""
