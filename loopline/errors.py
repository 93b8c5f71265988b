"""The base of every error a user acts on, in every layer: each message says what is wrong and what to run."""


class LooplineError(Exception):
    """Printed as one line by the CLIs, never as a traceback."""
