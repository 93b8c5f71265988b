"""Sandbox backends behind one async interface (exec, files, close)."""

from loopline.envregistry.sandbox.backends import open_sandbox
from loopline.envregistry.sandbox.base import ExecResult, InfraFailure, Sandbox

__all__ = ["ExecResult", "InfraFailure", "Sandbox", "open_sandbox"]
